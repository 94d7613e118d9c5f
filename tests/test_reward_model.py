"""Learned reward models (issue 18): the discriminative reward model as a reward term, its config
checks and verl aliases, validation with the rule reward, ``rlplug rm train`` (Bradley-Terry) and
preference pairs (``rlplug data pairs``).

The reward model in these tests is a random 2-layer GPT-2 sequence classifier with its own small
BPE tokenizer (vocabulary ~300, ChatML-like template of its own), so its vocabulary differs from
the actor's (SmolLM2's 49,152 tokens): scoring must go through text, re-templated with the RM's
tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from _helpers import TINY_CPU_RUN, fit, fp32_atol, run_config
from omegaconf import OmegaConf

from rlplug.algorithms.losses import compute_token_level_scores
from rlplug.config.compose import compose
from rlplug.config.schema import ConfigError
from rlplug.plugins.rewards.reward_model import RewardModelFunction
from rlplug.rewards.manager import RewardManager, validation_reward
from rlplug.rewards.pairs import build_pairs, corrected_answer, read_pairs, reference_answer, write_pairs
from rlplug.rewards.reward_model import (
    RewardModelError,
    check_reward_model_config,
    check_reward_model_folder,
    shaping_entries,
)
from rlplug.training.rm_train import train_reward_model

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>\n{% endfor %}"
CORPUS = ["What is 2 + 3 ?", "#### 5", "#### 4", "good answer", "bad answer", "the sum is", "Calculate 37 - 5."] * 20


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["[PAD]", "[UNK]", "[EOS]"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]")
    fast.chat_template = TEMPLATE
    return fast


def _gpt2_config(tok, **kw):
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=len(tok), n_positions=256, n_embd=32, n_layer=2, n_head=2, pad_token_id=tok.pad_token_id, **kw
    )


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory) -> Path:
    """A random one-label GPT-2 sequence classifier with its own tokenizer."""
    from transformers import GPT2ForSequenceClassification

    out = tmp_path_factory.mktemp("rm")
    tok = _tokenizer()
    torch.manual_seed(0)
    GPT2ForSequenceClassification(_gpt2_config(tok, num_labels=1)).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory) -> Path:
    """A random GPT-2 causal LM (the base for rm train, and a folder that is not a reward model)."""
    from transformers import GPT2LMHeadModel

    out = tmp_path_factory.mktemp("lm")
    tok = _tokenizer()
    torch.manual_seed(1)
    GPT2LMHeadModel(_gpt2_config(tok)).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


#: float32 reduction lengths along the RM's longest chain (rlplug.testing.reduction_tolerance), for
#: a sequence of at most n_positions = 256 tokens: per layer the LayerNorm, the qkv projection, the
#: attention scores (head size 16), the softmax's normaliser and weighted sum (2 x 256), the output
#: projection, the second LayerNorm, the MLP's fc (32) and proj (128); then ln_f and the score head.
#: Another padding or micro-batching runs other shapes: scores agree to this rounding at the
#: magnitude of the LayerNorm-ed activations (O(1)).
RM_TERMS = 2 * (5 * 32 + 16 + 2 * 256 + 128) + 2 * 32
MESSAGES = [{"role": "user", "content": "What is 2 + 3 ?"}]
ROWS = [
    {"data_source": "basic_arithmetic", "ground_truth": "5", "messages": MESSAGES, "extra_info": {}},
    {"data_source": "basic_arithmetic", "ground_truth": "5", "messages": MESSAGES, "extra_info": {}},
    {"data_source": "basic_arithmetic", "ground_truth": "5", "messages": MESSAGES, "extra_info": {}},
]
RESPONSES = ["the sum is #### 5", "#### 4", "bad answer, the sum is not known #### 9"]


def _direct(rm_dir: Path, messages, response: str) -> float:
    """The reference: the RM's own template and one unpadded forward."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(rm_dir))
    model = AutoModelForSequenceClassification.from_pretrained(str(rm_dir)).eval()
    text = tok.apply_chat_template([*messages, {"role": "assistant", "content": response}], tokenize=False)
    assert text.endswith(f"<assistant>{response}</assistant>\n")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        return float(model(input_ids=torch.tensor([ids])).logits[0, 0])


def _rm_cfg(rm_dir: Path, **extra):
    return {
        "reward_fn_map": {"basic_arithmetic": "gsm8k"},
        "reward_model": {"enable": True, "model_path": str(rm_dir), "device": "cpu", "micro_batch_size_per_device": 2},
        **extra,
    }


# ---------------------------------------------------------------------------- scoring


@pytest.mark.numerics
def test_scores_equal_a_direct_forward_of_the_retemplated_text(rm_dir):
    fn = RewardModelFunction()
    kwargs = {"model_path": str(rm_dir), "device": "cpu", "micro_batch_size_per_device": 2}
    # 3 responses of different lengths in micro-batches of 2: right padding and two forward passes
    got = fn.score_batch(["basic_arithmetic"] * 3, RESPONSES, ["5"] * 3, [{}] * 3, messages=[MESSAGES] * 3, **kwargs)
    want = [_direct(rm_dir, MESSAGES, r) for r in RESPONSES]
    tol = fp32_atol(RM_TERMS, *want, floor=1.0)
    assert got == pytest.approx(want, abs=tol)
    assert len(set(round(x, 6) for x in got)) == 3  # the responses get different scores
    # one response alone (__call__) scores the same as in the batch
    assert fn("basic_arithmetic", RESPONSES[1], "5", {}, messages=MESSAGES, **kwargs) == pytest.approx(want[1], abs=tol)


def test_the_reward_model_passes_the_reward_function_kit(rm_dir):
    from rlplug.testing import check_reward_function

    cases = [("basic_arithmetic", r, "5", {}) for r in RESPONSES] + [("basic_arithmetic", "", "5", None)]
    check_reward_function(
        "reward_model", cases, kwargs={"model_path": str(rm_dir), "device": "cpu", "messages": MESSAGES}
    )


@pytest.mark.numerics
def test_the_score_is_placed_on_the_last_response_token_and_shaping_weights_apply(rm_dir):
    rm = RewardModelFunction().score_batch(
        [""] * 3, RESPONSES, [""] * 3, [{}] * 3, messages=[MESSAGES] * 3, model_path=str(rm_dir), device="cpu"
    )
    cfg = _rm_cfg(rm_dir, shaping=[{"name": "reward_model", "weight": 0.3}], correctness_weight=0.7)
    with RewardManager(cfg) as manager:
        scores, extra, _ = manager.score(ROWS, RESPONSES)
    # gsm8k strict: "#### 5" is right (1.0), "#### 4" and "#### 9" wrong (0.0)
    assert extra["correctness"] == [1.0, 0.0, 0.0]
    tol = fp32_atol(RM_TERMS, *rm, floor=1.0)  # the manager's micro-batches: other padding
    assert extra["shaping/reward_model"] == pytest.approx(rm, abs=tol)  # logged unweighted
    assert scores == pytest.approx([0.7 * c + 0.3 * r for c, r in zip([1.0, 0.0, 0.0], rm)], abs=0.3 * tol)
    # the trainer's placement: the whole score on the last response token (responses of 3, 1 and 2 tokens)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.float32)
    tls = compute_token_level_scores(torch.tensor(scores), mask)
    assert tls[0, 2] == pytest.approx(scores[0]) and tls[1, 0] == pytest.approx(scores[1])
    assert tls[2, 1] == pytest.approx(scores[2]) and int((tls != 0).sum()) == 3


def test_enable_alone_scores_with_the_reward_model_alone_as_verl(rm_dir):
    entries, cw = shaping_entries(_rm_cfg(rm_dir))
    assert cw == 0.0 and [e["name"] for e in entries] == ["reward_model"] and entries[0]["weight"] == 1.0
    assert entries[0]["kwargs"]["model_path"] == str(rm_dir)
    # an explicit entry keeps correctness at weight 1 unless correctness_weight says otherwise
    entries, cw = shaping_entries(_rm_cfg(rm_dir, shaping=[{"name": "reward_model", "weight": 0.5}]))
    assert cw == 1.0 and entries[0]["kwargs"]["device"] == "cpu"
    # the reward=reward_model preset: 0.7 x correctness + 0.3 x reward model, other shaping terms kept
    preset = compose(["reward=reward_model", f"reward.reward_model.model_path={rm_dir}"])
    entries, cw = shaping_entries(OmegaConf.to_container(preset.reward, resolve=True))
    assert cw == 0.7 and [(e["name"], e["weight"]) for e in entries][-1] == ("reward_model", 0.3)
    with RewardManager(_rm_cfg(rm_dir)) as manager:
        scores, extra, _ = manager.score(ROWS[:2], RESPONSES[:2])
    assert scores == pytest.approx(extra["shaping/reward_model"], abs=1e-6)  # correctness (1, 0) weighs 0


# ---------------------------------------------------------------------------- bad input


def test_bad_reward_model_folders_are_clear_errors(rm_dir, lm_dir, tmp_path):
    with pytest.raises(RewardModelError, match=r"model_path=.*nope: no such folder\. Train one .*rlplug rm train"):
        check_reward_model_folder(tmp_path / "nope")
    with pytest.raises(RewardModelError, match=r"is a GPT2LMHeadModel \(a causal LM\); a reward model is an "):
        check_reward_model_folder(lm_dir)
    (tmp_path / "empty").mkdir()
    with pytest.raises(RewardModelError, match=r"has no config\.json"):
        check_reward_model_folder(tmp_path / "empty")
    two = tmp_path / "two"
    two.mkdir()
    cfg = json.loads((rm_dir / "config.json").read_text())
    cfg["id2label"] = {"0": "LABEL_0", "1": "LABEL_1"}
    (two / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(RewardModelError, match=r"GPT2ForSequenceClassification with num_labels=2; .*num_labels=1"):
        check_reward_model_folder(two)
    with pytest.raises(RewardModelError, match=r"needs reward.reward_model.model_path"):
        check_reward_model_config({"reward_model": {"enable": True}})
    with pytest.raises(RewardModelError, match=r"reward.shaping\[0\] is the reward model, but .*enable=false"):
        RewardManager({"shaping": [{"name": "reward_model"}]})
    # the config check runs before any model loads (rlplug config / rlplug train)
    with pytest.raises(ConfigError, match=r"reward.reward_model.model_path=.*\(a causal LM\)"):
        run_config(
            TINY_CPU_RUN,
            tmp_path / "run",
            "reward.reward_model.enable=true",
            f"reward.reward_model.model_path={lm_dir}",
        )


def test_verls_current_and_legacy_reward_model_keys_compose(rm_dir):
    current = compose(
        [
            "reward.reward_model.enable=true",
            f"reward.reward_model.model_path={rm_dir}",
            "reward.reward_model.max_length=64",
        ]
    )
    legacy = compose(
        [
            "reward_model.enable=true",
            f"reward_model.model.path={rm_dir}",
            "reward_model.micro_batch_size_per_gpu=3",
            "reward_model.max_length=64",
            "reward_model.rollout.dtype=bfloat16",  # verl's engine setting: inert
        ]
    )
    for cfg in (current, legacy):
        rm = cfg.reward.reward_model
        assert rm.enable is True and rm.model_path == str(rm_dir) and rm.max_length == 64
    assert legacy.reward.reward_model.micro_batch_size_per_device == 3


# ---------------------------------------------------------------------------- validation


def test_validation_keeps_the_rule_reward_unless_val_reward_model(rm_dir):
    cfg = _rm_cfg(rm_dir)  # training: the reward model alone
    with RewardManager(cfg) as train:
        val = validation_reward(train, cfg)
        assert val is not train
        scores, extra, _ = val.score(ROWS, RESPONSES, report_acc=True)
        assert scores == [1.0, 0.0, 0.0] and "shaping/reward_model" not in extra  # strict gsm8k only
        assert validation_reward(train, {**cfg, "val_reward_model": True}) is train
    with RewardManager({"reward_fn_map": {"basic_arithmetic": "gsm8k"}}) as rules:
        assert validation_reward(rules, {}) is rules  # nothing model-based: the same manager


# ---------------------------------------------------------------------------- a tiny run


def test_a_tiny_run_trains_on_the_reward_model_and_validates_with_the_rules(rm_dir, tmp_path, monkeypatch):
    import rlplug.run.evaluate

    seen = []  # (validation's reward manager, its scored responses)
    real = rlplug.run.evaluate.score_responses

    def spy(rows, generate, decode, reward, **kw):
        out = real(rows, generate, decode, reward, **kw)
        seen.append((reward, out))
        return out

    monkeypatch.setattr(rlplug.run.evaluate, "score_responses", spy)
    cfg = run_config(
        TINY_CPU_RUN,
        tmp_path / "run",
        "reward.reward_model.enable=true",
        f"reward.reward_model.model_path={rm_dir}",
        "trainer.test_freq=2",
        "data.val_max_samples=4",
        "trainer.logger=[console]",
    )
    assert fit(cfg) == "finished"
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "critic/score/mean" in m]
    assert len(steps) == 2
    for m in steps:
        # debug=tiny's length_penalty plus the reward model (correctness weighs 0 with enable alone)
        want = m["critic/shaping/length_penalty/mean"] + m["critic/shaping/reward_model/mean"]
        assert m["critic/score/mean"] == pytest.approx(want, abs=1e-4)
        assert m["critic/shaping/reward_model/mean"] != 0.0
    assert any(k.startswith("val-core/basic_arithmetic/acc/") for k in lines[-1])
    # validation scored with the rule reward: correctness (weight 1) + length_penalty, no reward model
    assert seen and all([n for _, n, _, _ in r.shaping] == ["length_penalty"] for r, _ in seen)
    with RewardManager(OmegaConf.merge(cfg.reward, {"reward_model": {"enable": False}})) as rules:
        for _, scored in seen:
            want, _, _ = rules.score([x.row for x in scored], [x.response for x in scored])
            assert [x.score for x in scored] == pytest.approx(want)


# ---------------------------------------------------------------------------- rm train


def _pair_rows(n: int) -> list[dict]:
    good = ["good answer", "#### 5", "good answer #### 5", "the sum is #### 5"]
    bad = ["bad answer", "#### 4", "bad answer #### 4", "the sum is #### 4"]
    return [{"prompt": "What is 2 + 3 ?", "chosen": good[i % 4], "rejected": bad[(i // 4) % 4]} for i in range(n)]


def test_rm_train_learns_a_separable_preference(lm_dir, tmp_path):
    pairs = tmp_path / "pairs.parquet"
    pq.write_table(pa.Table.from_pylist(_pair_rows(48)), str(pairs))
    out = tmp_path / "rm"
    metrics = train_reward_model(
        pairs, out, model=lm_dir, epochs=4, lr=3e-3, batch_size=8, val_fraction=0.25, device="cpu", log_every=0
    )
    assert metrics["val_pairs"] == 12 and metrics["train_pairs"] == 36
    assert metrics["val_accuracy"] >= 0.9, metrics  # well above chance (0.5)
    assert json.loads((out / "metrics.json").read_text())["val_accuracy"] == metrics["val_accuracy"]
    # the saved folder is a reward model the plugin loads
    check_reward_model_folder(out)
    fn = RewardModelFunction()
    r = fn.score_batch(["x"] * 2, ["good answer", "bad answer"], ["5"] * 2, [{}] * 2,
                       messages=[[{"role": "user", "content": "What is 2 + 3 ?"}]] * 2, model_path=str(out), device="cpu")  # fmt: skip
    assert r[0] > r[1]


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        ([{"prompt": "q", "chosen": "a"}], r"lacks the column\(s\) \['rejected'\]; found \['prompt', 'chosen'\]"),
        ([{"prompt": "q", "chosen": "", "rejected": "b"}], r"row 0: 'chosen' is ''; expected a non-empty response"),
        ([{"prompt": "  ", "chosen": "a", "rejected": "b"}], r"row 0: the prompt is empty"),
        ([{"prompt": "q", "chosen": "a", "rejected": "b"}, {"prompt": "q", "chosen": "x ", "rejected": "x"}],
         r"row 1: chosen and rejected are the same text"),
    ],
)  # fmt: skip
def test_malformed_pairs_are_clear_errors(tmp_path, rows, match):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    with pytest.raises(RewardModelError, match=match):
        read_pairs(path)


def test_rm_train_command_reports_malformed_pairs_without_a_traceback(tmp_path, capsys):
    from rlplug.cli import main

    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "q", "chosen": "a"}]), str(path))
    assert main(["rm", "train", "--pairs", str(path), "--out", str(tmp_path / "rm")]) != 0
    err = capsys.readouterr().err
    assert "lacks the column(s) ['rejected']" in err and "Traceback" not in err
    assert not (tmp_path / "rm").exists()


# ---------------------------------------------------------------------------- data pairs


def _pair_row(gt):
    m = [{"role": "user", "content": f"Give {gt}."}]
    return {"data_source": "basic_arithmetic", "ground_truth": gt, "messages": m, "extra_info": {"answer": gt}}


def test_pairs_are_labelled_by_the_rule_reward_with_a_reference_fallback(tmp_path):
    rows = [_pair_row("5"), _pair_row("7"), _pair_row("2")]
    fake = {"5": ["#### 3", "#### 5", "#### 6"], "7": ["#### 1", "#### 2"], "2": ["#### 2", "#### 2.0"]}
    with RewardManager({"reward_fn_map": {"basic_arithmetic": "gsm8k"}}) as rules:
        pairs, counts = build_pairs(rows, lambda rs: [fake[r["ground_truth"]] for r in rs], rules, match_format=False)
    assert counts == {"prompts": 3, "pairs": 2, "chosen_from_reference": 1, "chosen_corrected": 0, "all_correct": 1}
    assert [(p["chosen"], p["rejected"], p["chosen_source"]) for p in pairs] == [
        ("#### 5", "#### 3", "sample"),  # the first correct and the first wrong sample
        ("#### 7", "#### 1", "reference"),  # no sample right: the reference answer, in the #### format
    ]
    assert reference_answer(rows[1]) == "#### 7"
    path = write_pairs(pairs, tmp_path / "pairs.parquet")
    back = read_pairs(path)
    assert back[1] == {"prompt": rows[1]["messages"], "chosen": "#### 7", "rejected": "#### 1"}
    assert pq.read_table(str(path)).column("chosen_source").to_pylist() == ["sample", "reference"]


def test_pairs_match_the_format_so_they_differ_in_the_answer():
    """match_format (the default): the rejected sample has the chosen's form; with no right sample the chosen
    is the rejected one with its #### answer corrected; the bare reference only when no wrong sample has a
    #### number. Without it: the first wrong sample and the bare reference (a format-only preference)."""
    rows = [_pair_row("9"), _pair_row("4"), _pair_row("6"), _pair_row("3")]
    fake = {
        "9": ["nine minus one = 8", "#### 9", "4 + 5 = 10\n#### 10"],
        "4": ["4 is not 3", "2 + 2 = 5\n#### 5"],
        "6": ["six"],
        "3": ["no", "1 + 2 = 3\nI am done"],  # correct by nobody; neither has a #### line
    }
    got = {}
    for match in (True, False):
        with RewardManager({"reward_fn_map": {"basic_arithmetic": "gsm8k"}}) as rules:
            pairs, counts = build_pairs(
                rows, lambda rs: [fake[r["ground_truth"]] for r in rs], rules, match_format=match
            )
        got[match] = ([(p["chosen"], p["rejected"], p["chosen_source"]) for p in pairs], counts)
    assert got[True][0] == [
        ("#### 9", "4 + 5 = 10\n#### 10", "sample"),  # skips the unformatted wrong sample
        ("2 + 2 = 5\n#### 4", "2 + 2 = 5\n#### 5", "corrected"),  # differs in the answer only
        ("#### 6", "six", "reference"),  # no wrong sample has a #### number: the bare reference
        ("#### 3", "no", "reference"),
    ]
    assert got[True][1] == {
        "prompts": 4,
        "pairs": 4,
        "chosen_from_reference": 2,
        "chosen_corrected": 1,
        "all_correct": 0,
    }
    assert got[False][0] == [
        ("#### 9", "nine minus one = 8", "sample"),
        ("#### 4", "4 is not 3", "reference"),
        ("#### 6", "six", "reference"),
        ("#### 3", "no", "reference"),
    ]
    assert corrected_answer("a #### 1 then #### -2.5 end", {"ground_truth": "-7"}) == "a #### 1 then #### -7 end"
    assert corrected_answer("#### x", {"ground_truth": "1"}) is None


def test_the_reward_model_device_names_the_ranks_gpu_so_scoring_threads_use_it(monkeypatch) -> None:
    """On GPU rank 1 (current device 1), ``auto`` and ``cuda`` resolve to ``cuda:1`` when the scorer is built: the
    reward thread that scores later has GPU 0 as its current device and would move the inputs there."""
    from rlplug.rewards.reward_model import reward_model_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert reward_model_device("auto") == "cuda:1"
    assert reward_model_device(None) == "cuda:1"
    assert reward_model_device("cuda") == "cuda:1"
    assert reward_model_device("cuda:0") == "cuda:0"  # given: kept
    assert reward_model_device("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert reward_model_device("auto") == "cpu"
