"""The Python entry point ``rlplug.train`` (TRL-style), the TRL reward contract, and ``rlplug reward``."""

from __future__ import annotations

import pytest
from _helpers import TINY_CPU_RUN

import rlplug
from rlplug.cli import main
from rlplug.contracts.registry import Registry
from rlplug.contracts.reward_contract import BatchedRewardFunction, RewardContractError, as_reward_function
from rlplug.rewards.manager import RewardManager

# ============================================================================ rlplug reward


@pytest.mark.parametrize(
    "response, correctness, flexible, total",
    [
        # the default reward of basic_arithmetic: gsm8k strict (1 for "#### <right answer>") + 0.5 x gsm8k
        # flexible (1 when the last number is right): 1 + 0.5 * 1 = 1.5
        ("2 + 3 = 5\n#### 5", 1.0, 1.0, 1.5),
        # right but without the "####" line: strict 0, flexible 1 -> 0 + 0.5 * 1 = 0.5
        ("2 + 3 = 5", 0.0, 1.0, 0.5),
        # wrong: strict 0 (format_score 0), flexible reads 7 -> 0 + 0.5 * 0 = 0
        ("2 + 3 = 7\n#### 7", 0.0, 0.0, 0.0),
    ],
)
def test_reward_command_default_reward(capsys, response, correctness, flexible, total):
    from rlplug.api import score_response
    from rlplug.config.compose import compose

    result = score_response(compose([]), data_source="basic_arithmetic", response=response, ground_truth="5")
    assert result["total"] == total
    terms = {t["name"]: t for t in result["terms"]}
    assert terms["correctness"]["value"] == correctness and terms["correctness"]["weight"] == 1.0
    assert terms["shaping/gsm8k"]["value"] == flexible and terms["shaping/gsm8k"]["weight"] == 0.5
    assert sum(t["contribution"] for t in result["terms"]) == total
    assert result["function"].startswith("gsm8k (chosen by reward.reward_fn_map.basic_arithmetic)")
    assert result["reported"]["format"] == (1.0 if "####" in response else 0.0)
    code = main(["reward", "--data-source", "basic_arithmetic", "--response", response, "--ground-truth", "5"])
    out = capsys.readouterr().out
    assert code == 0 and f"total: {total:g}" in out and "shaping/gsm8k" in out


def test_reward_command_overlong_and_errors(capsys):
    # reward.overlong_buffer: max 16 tokens, buffer 8 -> a 12-token response gets -(12 - 8) / 8 = -0.5
    args = ["reward", "--data-source", "basic_arithmetic", "--response", "#### 5", "--ground-truth", "5"]
    args += ["--response-length", "12", "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=8"]
    args += ["data.max_response_length=16"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "overlong_reward" in out and "total: 1" in out  # 1 + 0.5 * 1 - 0.5
    code = main(["reward", "--data-source", "nope", "--response", "x"])
    assert code == 2 and "No reward function for data source(s) 'nope'" in capsys.readouterr().err


# ============================================================================ the TRL contract


def trl_len(prompts, completions, **kwargs):
    return [-len(c) / 100 for c in completions]


def verl_exact(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str.strip() == ground_truth)


def test_contract_detection():
    assert isinstance(as_reward_function(trl_len), BatchedRewardFunction)
    assert as_reward_function(verl_exact) is verl_exact
    marked = rlplug.trl_reward(lambda *a, **k: [1.0])
    assert as_reward_function(marked) is marked
    # fits both: must be told
    with pytest.raises(RewardContractError, match="cannot tell the contract.*contract='trl'"):
        as_reward_function(lambda *args, **kwargs: 0.0)
    assert isinstance(as_reward_function(lambda *args, **kwargs: [0.0], contract="trl"), BatchedRewardFunction)
    with pytest.raises(RewardContractError, match="cannot be called with the verl contract"):
        as_reward_function(trl_len, contract="verl")


def test_register_with_a_contract_argument():
    class Plugin:
        @rlplug.hookimpl
        def register_reward_functions(self, register):
            register("by_arg", trl_len, contract="trl")
            register("plain", verl_exact, contract="verl")

    reg = Registry(load_entry_points=False)
    assert reg.add_plugin(Plugin(), name="p"), reg.broken
    assert isinstance(reg.get("reward_function", "by_arg"), BatchedRewardFunction)
    assert reg.get("reward_function", "plain") is verl_exact

    class Bad:
        @rlplug.hookimpl
        def register_reward_functions(self, register):
            register("bad", verl_exact, contract="trl")  # verl's signature cannot take prompts=, completions=

    assert not reg.add_plugin(Bad(), name="bad")
    assert "cannot be called with the trl contract" in reg.broken[-1].message


def test_registered_trl_function_is_called_once_per_batch():
    calls = []

    def batched(prompts, completions, answer, **kwargs):
        calls.append((list(prompts), list(completions), list(answer), kwargs["data_source"]))
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    class Plugin:
        @rlplug.hookimpl
        def register_reward_functions(self, register):
            register("batched", rlplug.trl_reward(batched))

    reg = Registry(load_entry_points=False)
    assert reg.add_plugin(Plugin(), name="p"), reg.broken
    fn = reg.get("reward_function", "batched")  # the contract check passes (verl's per-sample __call__ exists)
    assert fn.contract == "trl"
    rows = [
        {"data_source": "d", "ground_truth": "", "extra_info": {"prompt": p, "answer": a}}
        for p, a in [("1+1", "2"), ("2+2", "4")]
    ]
    with RewardManager({"default": "batched", "timeout_s": 5}, registry=reg) as rm:
        scores, extra, _ = rm.score(rows, ["2", "5"])
    assert scores == [1.0, 0.0] and extra["correctness"] == [1.0, 0.0]
    assert calls == [(["1+1", "2+2"], ["2", "5"], ["2", "4"], ["d", "d"])]  # one call, TRL's arguments

    def wrong_length(prompts, completions, **kwargs):
        return [1.0]

    reg.register("reward_function", "wrong", rlplug.trl_reward(wrong_length))
    with RewardManager({"default": "wrong"}, registry=reg) as rm:
        with pytest.raises(RewardContractError, match="returned 1 values for 2 completions"):
            rm.score(rows, ["2", "5"])


def test_trl_function_as_shaping_with_chat_prompts():
    seen = []

    def chatty(prompts, completions, **columns):
        seen.append((prompts, completions, columns))
        return [len(c[0]["content"]) for c in completions]  # ints are numbers too

    reg = Registry(load_entry_points=False)
    reg.register("reward_function", "exact", verl_exact)
    reg.register("reward_function", "chatty", rlplug.trl_reward(chatty))
    msgs = [{"role": "user", "content": "Say 5"}]
    rows = [{"data_source": "d", "ground_truth": "5", "messages": msgs, "extra_info": {"id": i}} for i in range(2)]
    config = {"default": "exact", "shaping": [{"name": "chatty", "weight": 0.5}]}
    with RewardManager(config, registry=reg) as rm:
        scores, extra, _ = rm.score(rows, ["5", "123"])
    # exact ("5" == "5": 1, else 0) + 0.5 x number of characters: 1 + 0.5 * 1 = 1.5 and 0 + 0.5 * 3 = 1.5
    assert scores == [1.5, 1.5] and extra["shaping/chatty"] == [1.0, 3.0]
    ((prompts, completions, columns),) = seen  # one call for the batch
    # TRL's conversational format: message-list prompts, completions as one assistant message each
    assert prompts == [msgs, msgs]
    assert completions == [[{"role": "assistant", "content": "5"}], [{"role": "assistant", "content": "123"}]]
    assert callable(columns.pop("log_metric"))  # TRL's log_metric (no trainer here: no trainer_state, completion_ids)
    assert columns == {"data_source": ["d", "d"], "ground_truth": ["5", "5"], "id": [0, 1]}


# ============================================================================ rlplug.train


SEEN: list[dict] = []


def brevity(prompts, completions, **columns):
    """TRL's contract; records what it got."""
    values = [-len(c) / 100 for c in completions]
    SEEN.append({"prompts": list(prompts), "completions": list(completions), "columns": columns, "values": values})
    return values


def test_train_with_a_dataset_and_a_trl_reward(tmp_path):
    from datasets import Dataset

    SEEN.clear()
    ds = Dataset.from_dict(
        {
            "prompt": ["What is 2 + 3?", "What is 7 - 4?", "What is 1 + 1?", "What is 9 - 9?"],
            "answer": ["5", "3", "2", "0"],
        }
    )
    overrides = [*TINY_CPU_RUN, "algorithm=grpo", "rollout.n=2", "trainer.total_training_steps=2"]
    overrides += ["actor.ppo_mini_batch_size=2", "actor.micro_batch_size_per_device=2", "trainer.logger=[console]"]
    overrides += [f"trainer.default_local_dir={tmp_path}", "data.shuffle=false"]
    result = rlplug.train(overrides, train_dataset=ds, reward_funcs=[brevity])
    assert result.status == "finished" and result.global_step == 2 and result.run_dir == tmp_path
    assert result.final_model is not None and (result.final_model / "config.json").is_file()
    assert len(SEEN) == 2  # one call per step (no validation set)
    answers = dict(zip(ds["prompt"], ds["answer"]))
    for call in SEEN:
        # 2 prompts x rollout.n=2, prompt-major; TRL's standard format: string prompts, string completions
        assert len(call["prompts"]) == len(call["completions"]) == 4
        assert all(isinstance(p, str) and p in answers for p in call["prompts"])
        assert call["prompts"][0] == call["prompts"][1] and call["prompts"][2] == call["prompts"][3]
        assert all(isinstance(c, str) for c in call["completions"])
        assert call["columns"]["answer"] == [answers[p] for p in call["prompts"]]  # the other column, row-aligned
        assert call["columns"]["data_source"] == ["trl"] * 4
    # data.shuffle=false: step 1 takes the first two prompts
    assert SEEN[0]["prompts"][::2] == ["What is 2 + 3?", "What is 7 - 4?"]
    # the run's metrics: the score is the function's value (it is the whole reward)
    last = SEEN[-1]["values"]
    assert result.metrics["critic/score/mean"] == pytest.approx(sum(last) / 4, abs=1e-6)
    assert result.metrics["training/global_step"] == 2
    assert [r["step"] for r in result.history] == [1, 2]


def test_train_config_errors(tmp_path):
    from rlplug.config.schema import ConfigError

    with pytest.raises(TypeError, match="not one string"):
        rlplug.train("algorithm=grpo")
    with pytest.raises(ConfigError, match="eval_dataset=...\\) needs train_dataset"):
        rlplug.train([f"trainer.default_local_dir={tmp_path}"], eval_dataset=[{"prompt": "x"}])
    from rlplug.data.dataset import DatasetError

    with pytest.raises(DatasetError, match="train_dataset row 0 has no 'prompt'"):
        rlplug.train([f"trainer.default_local_dir={tmp_path}"], train_dataset=[{"question": "x"}])
    # an empty in-memory dataset names which one it is, before any model is built
    with pytest.raises(DatasetError, match="train\\(\\): eval_dataset has no rows"):
        rlplug.train([f"trainer.default_local_dir={tmp_path}"], train_dataset=[{"prompt": "x"}], eval_dataset=[])
    with pytest.raises(DatasetError, match="train\\(\\): train_dataset has no rows"):
        rlplug.train([f"trainer.default_local_dir={tmp_path}"], train_dataset={"prompt": []})


def test_train_writes_its_dataset_under_a_content_addressed_name_and_overwrites_nothing(tmp_path):
    """A second ``train()`` on a run dir a live run holds is refused at the lock; before that it wrote the
    dataset, and it must not replace the live run's file (issue: train.parquet was overwritten)."""
    import re
    import subprocess
    import sys

    from rlplug.run.run_lock import RunDirLocked

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from rlplug.run.run_lock import acquire_run_lock\n"
            "lock = acquire_run_lock(sys.argv[1], rank_zero=True); print('held', flush=True); time.sleep(120)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        overrides = [*TINY_CPU_RUN, f"trainer.default_local_dir={tmp_path}"]
        data_a = [{"prompt": "What is 2 + 3?", "answer": "5"}]
        data_b = [{"prompt": "What is 7 - 4?", "answer": "3"}]
        with pytest.raises(RunDirLocked):
            rlplug.train(overrides, train_dataset=data_a, reward_funcs=[brevity])
        (file_a,) = (tmp_path / "datasets").iterdir()
        assert re.fullmatch(r"train-[0-9a-f]{16}\.parquet", file_a.name)
        bytes_a = file_a.read_bytes()
        with pytest.raises(RunDirLocked):
            rlplug.train(overrides, train_dataset=data_b, reward_funcs=[brevity])
        files = sorted((tmp_path / "datasets").iterdir())
        assert len(files) == 2 and file_a in files and file_a.read_bytes() == bytes_a  # the live run's data intact
        with pytest.raises(RunDirLocked):
            rlplug.train(overrides, train_dataset=data_a, reward_funcs=[brevity])
        assert sorted((tmp_path / "datasets").iterdir()) == files  # the same data: the same name, nothing new
    finally:
        holder.kill()
        holder.wait()
    from rlplug.api import dataset_file_name

    rows = [{"data_source": "trl", "prompt": "x", "reward_model": {"style": "rule", "ground_truth": ""}}]
    assert dataset_file_name(rows, "eval") == dataset_file_name([dict(reversed(list(rows[0].items())))], "eval")
    assert dataset_file_name(rows, "eval") != dataset_file_name([{**rows[0], "prompt": "y"}], "eval")


def test_a_trl_function_gets_the_same_timeout_as_a_shaping_term_as_in_the_main_slot():
    """reward.timeout_s=0.2 and 2 responses: 0.4 s for the batch in either slot; a function sleeping 3 s is a
    timeout of both responses (it was run without any timeout as a shaping term)."""
    import time as _time

    def slow(prompts, completions, **columns):
        _time.sleep(3.0)
        return [1.0] * len(completions)

    reg = Registry(load_entry_points=False)
    reg.register("reward_function", "exact", verl_exact)
    reg.register("reward_function", "slow", rlplug.trl_reward(slow))
    rows = [{"data_source": "d", "ground_truth": "5", "extra_info": {"prompt": "Say 5"}} for _ in range(2)]
    for config in (
        {"default": "slow"},
        {"default": "exact", "shaping": [{"name": "slow", "weight": 0.5}]},
    ):
        with RewardManager({**config, "timeout_s": 0.2, "fallback_score": -1.0}, registry=reg) as rm:
            t0 = _time.perf_counter()
            scores, extra, metrics = rm.score(rows, ["5", "4"])
            assert _time.perf_counter() - t0 < 2.0, config
        assert metrics["reward/timeouts"] == 2.0 and metrics["reward/failed_samples"] == 2.0, config
        assert extra["reward_failed"] == [1.0, 1.0]
    # the shaping term's failure: fallback -1 x weight 0.5 added to the correctness (exact: 1, 0)
    assert scores == [1.0 - 0.5, 0.0 - 0.5] and extra["shaping/slow"] == [-1.0, -1.0]

    class Forward:
        """A model-based batched term (a reward model): no timeout."""

        model_based = True

        def __call__(self, data_source, solution_str, ground_truth, extra_info=None):
            return 0.0

        def score_batch(self, data_sources, solution_strs, ground_truths, extra_infos, messages=None):
            _time.sleep(0.6)
            return [2.0] * len(solution_strs)

    reg.register("reward_function", "rm", Forward())
    with RewardManager(
        {"default": "exact", "shaping": [{"name": "rm", "weight": 1.0}], "timeout_s": 0.2}, registry=reg
    ) as rm:
        scores, extra, metrics = rm.score(rows, ["5", "4"])
    assert scores == [3.0, 2.0] and metrics["reward/timeouts"] == 0.0
