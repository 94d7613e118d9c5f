"""Hostile input, part 2: generated bad configs and files for this round's input surfaces (hypothesis).

* verl key aliases: random mixes of verl's spellings (``actor_rollout_ref.*``, ``*_per_gpu``, the legacy
  ``reward_model.*`` / ``custom_reward_function.*``, a legacy section given whole) with the rlplug key
  of the same meaning, with equal or different values. Composing gives the value in the rlplug key, or
  a :class:`~rlplug.config.schema.ConfigError` naming two spellings given with different values; never another
  exception type, never a silent pick of one of two values.
* ``reward.custom_reward_function`` files that cannot work (syntax error, raising at import, no such
  function, a non-callable, a wrong signature, ``reward_kwargs`` it does not take, no file, a directory,
  not ``.py``): :func:`rlplug.run.validate.validate_config` raises a ``ConfigError`` naming the file and what
  to do (before any model loads: validation builds none).
* reward models returning NaN / inf / None / junk (a stub scorer, and the real
  :class:`~rlplug.plugins.rewards.reward_model.RewardModelScorer` over a stub forward): counted failed samples, finite
  scores, finite GRPO advantages with the failed rows at 0.
* preference-pair files (:func:`rlplug.rewards.pairs.read_pairs`): missing or duplicated columns, wrong
  types, empty / None / huge strings, bad roles, chosen == rejected: a
  :class:`~rlplug.rewards.reward_model.RewardModelError` naming the file, or valid pairs.
* ``algorithm.schedule`` / ``rollout.n_schedule`` and ``trainer.alerts``: malformed phase lists and rule
  dicts are rejected with a ``ConfigError`` naming the setting (the phase ``algorithm.schedule[i]``, the
  rule ``trainer.alerts[i]``), or accepted; accepted ones build their :class:`~rlplug.run.schedule.Schedule`
  / :class:`~rlplug.run.alerts.AlertEngine` and evaluate hostile metric values without error.
"""

from __future__ import annotations

import copy
import itertools
import math
import re
import tempfile
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf, open_dict

from rlplug.config.compose import compose
from rlplug.config.schema import ConfigError
from rlplug.config.verl_keys import hydra_value


def _settings(n: int):
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
    )


_TMP = tempfile.TemporaryDirectory(prefix="rlplug-fuzz-config-")
_COUNTER = itertools.count()


def _fresh_dir() -> Path:
    """A new folder per example (reward files are imported once per path and process)."""
    d = Path(_TMP.name) / f"ex{next(_COUNTER)}"
    d.mkdir()
    return d


@pytest.fixture(scope="module")
def registry():
    from rlplug.contracts.registry import get_registry

    return get_registry()


# ============================================================================ verl key aliases

# (rlplug key, its spellings, values, nullable): the first spelling is rlplug's own
ALIASES = [
    ("actor.ppo_mini_batch_size", ["actor.ppo_mini_batch_size", "actor_rollout_ref.actor.ppo_mini_batch_size"],
     [1, 2, 4], False),
    ("rollout.n", ["rollout.n", "actor_rollout_ref.rollout.n"], [1, 2, 4], False),
    ("actor.micro_batch_size_per_device",
     ["actor.micro_batch_size_per_device", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"], [1, 2], False),
    ("critic.micro_batch_size_per_device",
     ["critic.micro_batch_size_per_device", "critic.ppo_micro_batch_size_per_gpu"], [1, 2], False),
    ("actor.max_token_len_per_device",
     ["actor.max_token_len_per_device", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"], [512, 4096], False),
    ("data.max_response_length", ["data.max_response_length", "actor_rollout_ref.rollout.response_length"],
     [16, 32], False),
    ("actor.grad_clip",
     ["actor.grad_clip", "actor_rollout_ref.actor.grad_clip", "actor_rollout_ref.actor.optim.clip_grad"],
     [0.5, 1.0, 1], False),
    ("trainer.max_ckpt_to_keep",
     ["trainer.max_ckpt_to_keep", "trainer.max_actor_ckpt_to_keep", "trainer.max_critic_ckpt_to_keep"],
     [1, 2, None], True),
    ("reward.reward_model.micro_batch_size_per_device",
     ["reward.reward_model.micro_batch_size_per_device", "reward_model.micro_batch_size_per_gpu"], [2, 4], False),
    ("reward.reward_model.max_length", ["reward.reward_model.max_length", "reward_model.max_length"],
     [64, 128, None], True),
    ("reward.reward_model.enable", ["reward.reward_model.enable", "reward_model.enable"], [True, False], False),
    ("reward.custom_reward_function.name",
     ["reward.custom_reward_function.name", "custom_reward_function.name", "custom_reward_function={name}",
      "reward.custom_reward_function={name}"], ["f", "g"], False),
    ("reward.custom_reward_function.path",
     ["reward.custom_reward_function.path", "custom_reward_function.path", "custom_reward_function={path}",
      "reward.custom_reward_function={path}"],
     ["/r/a.py", "/r/b.py"], True),
    ("rollout.name", ["rollout", "actor_rollout_ref.rollout.name"], ["hf", "vllm", "sglang"], False),
]  # fmt: skip
_NAME = next(i for i, a in enumerate(ALIASES) if a[0] == "reward.custom_reward_function.name")
_PATH = next(i for i, a in enumerate(ALIASES) if a[0] == "reward.custom_reward_function.path")
#: inert verl keys mixed in: they change nothing
INERT = ["actor_rollout_ref.actor.rollout_n=7", "trainer.nnodes=2",
         "critic.rollout_n=3", "actor_rollout_ref.actor.fsdp_config.param_offload=true"]  # fmt: skip


def _is_legacy(spelling: str) -> bool:
    return spelling.startswith(("reward_model.", "custom_reward_function"))


def _override(spelling: str, value, plus: bool) -> tuple[str, str]:
    """(override text, the spelling the conflict check reports) of ``spelling`` set to ``value``."""
    if spelling.endswith("}"):  # a section given whole: custom_reward_function={name: 'f'}
        section, leaf = spelling[:-1].split("={")
        return f"{section}={{{leaf}: {hydra_value(value)}}}", f"{section}.{leaf}"
    if spelling == "rollout":
        return f"rollout={value}", "rollout"
    text = value if spelling == "actor_rollout_ref.rollout.name" else hydra_value(value)
    prefix = "++" if plus and spelling.startswith("actor_rollout_ref.") else ""
    return f"{prefix}{spelling}={text}", spelling


def _same(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


@st.composite
def alias_mixes(draw):
    groups = draw(st.lists(st.sampled_from(range(len(ALIASES))), min_size=1, max_size=2, unique=True))
    items = []
    for g in groups:
        target, spellings, values, nullable = ALIASES[g]
        for _ in range(draw(st.integers(1, 4))):
            sp = draw(st.sampled_from(spellings))
            pool = [v for v in values if v is not None or nullable or sp != spellings[0]]
            if sp.endswith("}") or sp in ("rollout", "actor_rollout_ref.rollout.name"):
                pool = [v for v in pool if v is not None]
            items.append((g, sp, draw(st.sampled_from(pool)), draw(st.booleans())))
    items = draw(st.permutations(items))
    inert = draw(st.lists(st.sampled_from(INERT), max_size=2))
    return items, inert


def _expected(items) -> dict[int, dict[str, object]]:
    """Per alias group: {reported spelling: its last value}, without the spellings that mean "not set"
    (verl's null for a legacy key, or for a key rlplug cannot hold null)."""
    out: dict[int, dict[str, object]] = {}
    for g, sp, value, plus in items:
        _, reported = _override(sp, value, plus)
        target, spellings, _, nullable = ALIASES[g]
        if value is None and sp != spellings[0] and (_is_legacy(sp) or not nullable):
            out.setdefault(g, {})  # not set: the override is dropped
            continue
        out.setdefault(g, {}).pop(reported, None)
        out[g][reported] = value
    return out


CONFLICT = re.compile(r"^(\S+?)=(.+?) and (\S+?)=(.+?) both set (\S+) \(spellings of the same setting")


@_settings(25)
@given(mix=alias_mixes())
# a legacy section given whole against one of its keys: the other value was picked silently before
@example(mix=([(_NAME, "custom_reward_function={name}", "f", False), (_NAME, "reward.custom_reward_function.name", "g", False)], []))  # fmt: skip
@example(mix=([(_PATH, "custom_reward_function.path", "/r/a.py", False), (_PATH, "reward.custom_reward_function={path}", "/r/b.py", False)], []))  # fmt: skip
def test_verl_aliases_give_the_value_or_a_conflict_naming_both_spellings(mix):
    items, inert = mix
    overrides = [_override(sp, v, plus)[0] for _, sp, v, plus in items]
    overrides = overrides[: len(overrides) // 2] + inert + overrides[len(overrides) // 2 :]
    expected = _expected(items)
    conflicting = {
        g: spelled
        for g, spelled in expected.items()
        if any(not _same(a, b) for a in spelled.values() for b in spelled.values())
    }
    try:
        cfg = compose(overrides)
    except ConfigError as err:
        msg = str(err)
        m = CONFLICT.match(msg)
        assert conflicting and m is not None, (overrides, msg)  # only a conflict is an error here
        key_a, val_a, key_b, val_b, target = m.groups()
        group = next(g for g in conflicting if ALIASES[g][0] in (target, f"{target}.name"))
        spelled = conflicting[group]
        assert key_a in spelled and key_b in spelled and key_a != key_b, (overrides, msg)
        assert val_a == hydra_value(spelled[key_a]) or val_a == str(spelled[key_a])
        assert val_b == hydra_value(spelled[key_b]) or val_b == str(spelled[key_b])
        assert not _same(spelled[key_a], spelled[key_b]), msg
        event("conflict")
        return
    assert not conflicting, f"{overrides}: composed although spellings disagree: {conflicting}"
    for g, spelled in expected.items():
        if spelled:  # every spelling gave this value (else it is a conflict, above)
            value, got = list(spelled.values())[-1], OmegaConf.select(cfg, ALIASES[g][0])
            assert _same(got, value), (overrides, ALIASES[g][0], got, value)
    assert cfg.actor.ppo_epochs == 1  # the inert keys changed nothing they do not name
    event("composed")


def test_a_bad_value_error_quotes_the_override_as_given_not_a_prefix_of_another():
    """Regression: quoting the user's spelling replaced ``actor.ppo_mini_batch_size=2`` (sent for the verl
    key) inside ``actor.ppo_mini_batch_size=2.0``, so the error named the wrong override."""
    with pytest.raises(ConfigError) as err:
        compose(["actor.ppo_mini_batch_size=2.0", "actor_rollout_ref.actor.ppo_mini_batch_size=2"])
    assert str(err.value).startswith("Error merging override actor.ppo_mini_batch_size=2.0: Value '2.0'")


# ============================================================================ custom reward files

GOOD_FN = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):\n    return scale * 2.0\n"
)
REWARD_FILES = {  # kind -> (file text, function name, reward_kwargs, message)
    "valid": (GOOD_FN, "compute_score", {}, None),
    "valid_kwargs": (GOOD_FN, "compute_score", {"scale": 3.0}, None),
    "syntax": ("def compute_score(:\n", "compute_score", {}, "importing the file failed with SyntaxError"),
    "undecodable": ("\udcff = 1\n", "compute_score", {}, "importing the file failed with SyntaxError"),
    "indent": ("def compute_score():\nreturn 1\n", "compute_score", {}, "importing the file failed with IndentationError"),
    "raises": ("raise RuntimeError('no GPU here')\n" + GOOD_FN, "compute_score", {}, "failed with RuntimeError: no GPU here"),
    "import": ("import rlplug_no_such_module_xyz\n", "compute_score", {}, "failed with ModuleNotFoundError"),
    "exit": ("import sys\nsys.exit(3)\n", "compute_score", {}, "importing the file failed with SystemExit"),
    "null_byte": ("x = 1\x00\n", "compute_score", {}, "importing the file failed with"),
    "no_function": ("def other(a, b, c, d=None):\n    return 0\n", "compute_score", {}, "has no function 'compute_score'"),
    "empty": ("", "compute_score", {}, "functions defined there: none"),
    "wrong_name": (GOOD_FN, "score", {}, "has no function 'score'"),
    "not_callable": ("compute_score = 0.5\n", "compute_score", {}, "a float, not a function, named 'compute_score'"),
    "no_args": ("def compute_score():\n    return 1.0\n", "compute_score", {}, "cannot be called as"),
    "two_args": ("def compute_score(a, b):\n    return 1.0\n", "compute_score", {}, "cannot be called as"),
    "kw_only": ("def compute_score(a, b, c, d=None, *, must):\n    return 1.0\n", "compute_score", {}, "cannot be called as"),
    "bad_kwargs": (GOOD_FN, "compute_score", {"temperature": 2}, "cannot be called as"),
    "missing": (None, "compute_score", {}, "no such file"),
    "directory": (None, "compute_score", {}, "is a directory"),
    "not_py": (GOOD_FN, "compute_score", {}, "expected a Python source file ending in .py"),
}  # fmt: skip
#: a phrase of each error message that says what to do
WHAT_TO_DO = re.compile(r"Point it at|point .* at|Fix the file|Set reward\.custom_reward_function\.name=|Give the function verl's signature")  # fmt: skip


@pytest.fixture(scope="module")
def tiny_cfg():
    return compose(["debug=tiny"])


@pytest.mark.parametrize("kind", sorted(REWARD_FILES))  # every kind: a finite set, so all of them
def test_reward_files_that_cannot_work_are_config_errors_at_validation(tiny_cfg, registry, kind):
    from rlplug.run.validate import validate_config

    text, name, kwargs, message = REWARD_FILES[kind]
    folder = _fresh_dir()
    path = folder / ("reward.txt" if kind == "not_py" else "my_reward.py")
    if kind == "directory":
        path = folder / "rewards"
        path.mkdir()
    elif text is not None:
        path.write_bytes(text.encode("utf-8", "surrogateescape"))  # "undecodable": a 0xff byte
    cfg = copy.deepcopy(tiny_cfg)
    with open_dict(cfg):
        crf = cfg.reward.custom_reward_function
        crf.path, crf.name, crf.reward_kwargs = str(path), name, kwargs
        cfg.reward.shaping = []  # the score is the file's function alone
    with mock.patch("rlplug.training.models.load_tokenizer", side_effect=AssertionError("a model loaded")):
        if message is None:
            validate_config(cfg, registry)
            from rlplug.rewards.manager import RewardManager

            manager = RewardManager(cfg.reward, registry=registry)
            scores, extra, _ = manager.score([{"data_source": "anything", "ground_truth": "1"}], ["x"])
            assert scores == [2.0 * kwargs.get("scale", 1.0)] and extra["reward_failed"] == [0.0]
            return
        with pytest.raises(ConfigError) as err:
            validate_config(cfg, registry)
    msg = str(err.value)
    assert msg.startswith("reward.custom_reward_function"), msg
    assert path.name in msg, msg
    assert message in msg, msg
    assert WHAT_TO_DO.search(msg), f"the message does not say what to do: {msg}"


# ============================================================================ reward models returning junk

RM_VALUES = st.one_of(
    st.floats(min_value=-1e6, max_value=1e6, allow_nan=False),
    st.sampled_from([math.nan, math.inf, -math.inf, None, 1e39, -1e300, 0.0, "1.5", "junk", True, [1.0], {"score": 1}]),
)


class _StubTokenizer:
    chat_template = "stub"
    pad_token_id = 0

    def apply_chat_template(self, chat, add_generation_prompt=False, tokenize=False):
        return "".join(f"<{m['role']}>{m['content']}" for m in chat)

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[1 + ord(c) % 50 for c in t] for t in texts]}


class _StubModel:
    """Returns the next logits of ``values`` (one per row, in order), whatever the input."""

    def __init__(self, values):
        self.values, self.pos, self.config = list(values), 0, SimpleNamespace(pad_token_id=0)

    def __call__(self, input_ids, attention_mask, use_cache=False):
        n = input_ids.shape[0]
        out = torch.tensor(self.values[self.pos : self.pos + n], dtype=torch.float32).reshape(n, 1)
        self.pos += n
        return SimpleNamespace(logits=out)


@pytest.fixture(scope="module")
def rm_folder():
    """A folder :func:`rlplug.rewards.reward_model.check_reward_model_folder` accepts (no weights are read here)."""
    d = _fresh_dir()
    (d / "config.json").write_text('{"architectures": ["GPT2ForSequenceClassification"], "num_labels": 1}')
    (d / "tokenizer.json").write_text("{}")
    return d


def _as_score(v):
    """The score the manager takes from a returned value, or None for a failure (the oracle)."""
    if isinstance(v, dict):
        v = v.get("score")
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) and abs(x) <= 3.4028234663852886e38 else None


@_settings(30)
@given(data=st.data())
def test_reward_models_returning_junk_are_failed_samples_never_nan_advantages(rm_folder, data):
    group = data.draw(st.integers(1, 3), label="group")
    n_groups = data.draw(st.integers(1, 3), label="groups")
    mode = data.draw(st.sampled_from(["values", "forward", "not_a_list", "wrong_length"]), label="mode")
    cw = data.draw(st.sampled_from([None, 0.5]), label="correctness_weight")
    fallback = data.draw(st.sampled_from([0.0, -1.0]), label="fallback_score")
    mb = data.draw(st.integers(1, 4), label="micro_batch")
    n = group * n_groups
    if mode == "forward":  # a real scorer over a stub forward: float32 logits, NaN and inf included
        logits = st.one_of(st.floats(-1e6, 1e6), st.sampled_from([math.nan, math.inf, -math.inf]))
        values = data.draw(st.lists(logits, min_size=n, max_size=n))
    else:
        values = data.draw(st.lists(RM_VALUES, min_size=n, max_size=n))
    failed = _check_rm(rm_folder, group, n_groups, mode, cw, fallback, mb, values)
    event(f"{mode}: {failed}/{n} failed")


def test_a_reward_model_returning_nan_inf_none_or_a_float32_overflow_fails_those_samples(rm_folder):
    """Hand-picked: NaN, None, inf and 1e39 (finite in Python, inf in the trainer's float32 scores)."""
    assert _check_rm(rm_folder, 2, 3, "values", None, 0.0, 2, [math.nan, 1.0, None, math.inf, 1e39, -2.5]) == 4


def _check_rm(rm_folder, group, n_groups, mode, cw, fallback, mb, values):
    from rlplug.algorithms.losses import compute_token_level_scores
    from rlplug.contracts.batch import Batch, estimate_on_rows
    from rlplug.contracts.registry import Registry, get_registry
    from rlplug.plugins.rewards.reward_model import RewardModelFunction, RewardModelScorer
    from rlplug.rewards.manager import FAILED, RewardManager, scored_rows

    n = group * n_groups
    reg = Registry(load_entry_points=False)
    reg.register("reward_function", "one", lambda data_source, solution_str, ground_truth, extra_info=None: 1.0)
    reg.register("reward_function", "reward_model", RewardModelFunction())
    cfg = {
        "reward_fn_map": {"src": "one"},
        "fallback_score": fallback,
        "correctness_weight": cw,
        "reward_model": {
            "enable": True,
            "model_path": str(rm_folder),
            "device": "cpu",
            "micro_batch_size_per_device": mb,
        },
    }
    if mode == "forward":
        scorer = RewardModelScorer(
            model=_StubModel(values), tokenizer=_StubTokenizer(), device="cpu", micro_batch_size_per_device=mb
        )
    elif mode == "not_a_list":
        scorer = SimpleNamespace(score=lambda messages, responses: values[0])
    elif mode == "wrong_length":
        scorer = SimpleNamespace(score=lambda messages, responses: values + [1.0])
    else:
        scorer = SimpleNamespace(score=lambda messages, responses: values)
    rows = [{"data_source": "src", "ground_truth": "1", "messages": [{"role": "user", "content": "q"}]}] * n
    manager = RewardManager(cfg, registry=reg)
    with mock.patch("rlplug.plugins.rewards.reward_model.get_scorer", return_value=scorer):
        scores, extra, metrics = manager.score(rows, [f"response {i}" for i in range(n)])

    if mode in ("not_a_list", "wrong_length"):
        rm = [None] * n  # the whole batch failed
    elif mode == "forward":
        rm = [_as_score(float(torch.tensor(v, dtype=torch.float32))) for v in values]
    else:
        rm = [_as_score(v) for v in values]
    weight_c = 0.0 if cw is None else cw
    assert extra[FAILED] == [float(r is None) for r in rm], (values, extra[FAILED])
    assert metrics["reward/failed_samples"] == sum(r is None for r in rm)
    assert all(isinstance(s, float) and math.isfinite(s) for s in scores)
    assert scores == pytest.approx([weight_c * 1.0 + (fallback if r is None else r) for r in rm], rel=1e-6)

    # the trainer's path: failed rows are left out of the group baselines, their advantage is 0
    scored = scored_rows(extra, n)
    mask = torch.ones(n, 3)
    seq = torch.tensor(scores, dtype=torch.float32) * scored
    batch = Batch({"token_level_rewards": compute_token_level_scores(seq, mask), "response_mask": mask,
                   "index": torch.arange(n) // group})  # fmt: skip
    grpo = get_registry().get("advantage_estimator", "grpo")
    adv, ret = estimate_on_rows(grpo, batch, {"norm_adv_by_std_in_grpo": True}, scored)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all(), (values, adv)
    assert not adv[~scored].any()
    return sum(r is None for r in rm)


# ============================================================================ preference pairs

HOSTILE_STR = ["", " ", "\t\n", "x" * 100_000, "\x00", "answer", "answer ", "\U0001f600", "#### 5", "None"]
STR_OR_JUNK = st.one_of(st.sampled_from(HOSTILE_STR), st.text(max_size=10))
MSG_T = pa.struct([("role", pa.string()), ("content", pa.string())])


@st.composite
def pair_tables(draw):
    """Half the tables have the right columns and types and mostly good values; the rest anything."""
    n = draw(st.integers(1, 4))
    valid = draw(st.booleans())
    names, arrays = [], []

    def add(name, values, type_):
        names.append(name)
        arrays.append(pa.array(values, type=type_))

    def rows(strategy):
        return draw(st.lists(strategy, min_size=n, max_size=n))

    if valid:
        role = st.sampled_from(["user"] * 6 + ["system", "assistant", "wizard"])
        content = st.one_of(st.sampled_from(["What is 2 + 3 ?", "q", "q", ""]), st.text(min_size=1, max_size=10))
        text = st.one_of(st.sampled_from(["#### 5", "the sum is 7", "x" * 100_000, "\U0001f600"]), st.text(max_size=10))
        kinds, col_kinds = ["str", "chat", "chat"], ["str"]
    else:
        role = st.sampled_from(["user", "user", "system", "assistant", "tool", "wizard", "", "USER", None])
        content, text = st.one_of(st.none(), STR_OR_JUNK), STR_OR_JUNK
        kinds = ["str", "chat", "null", "int", "list_str", "struct", "binary", "chat_int", "missing"]
        col_kinds = ["str", "str", "null", "int", "float", "binary", "missing"]
    kind = draw(st.sampled_from(kinds))
    message = st.fixed_dictionaries({"role": role, "content": content})
    if kind == "str":
        add("prompt", rows(text), pa.string())
    elif kind == "chat":
        add("prompt", rows(st.lists(message, min_size=int(valid), max_size=3)), pa.list_(MSG_T))
    elif kind == "null":
        add("prompt", rows(st.one_of(st.none(), STR_OR_JUNK)), pa.string())
    elif kind == "int":
        add("prompt", rows(st.integers(-5, 5)), pa.int64())
    elif kind == "list_str":
        add("prompt", rows(st.lists(STR_OR_JUNK, max_size=2)), pa.list_(pa.string()))
    elif kind == "struct":
        add("prompt", rows(message.map(lambda m: {**m, "content": m["content"] or ""})), MSG_T)
    elif kind == "binary":
        add("prompt", rows(st.binary(max_size=5)), pa.binary())
    elif kind == "chat_int":
        int_msg = st.fixed_dictionaries({"role": role, "content": st.integers(0, 9)})
        add("prompt", rows(st.lists(int_msg, min_size=1, max_size=2)),
            pa.list_(pa.struct([("role", pa.string()), ("content", pa.int64())])))  # fmt: skip
    same = draw(st.integers(0, 3)) == 0  # rejected is chosen (or differs only in spaces)
    chosen = rows(text)
    for col in ("chosen", "rejected"):
        ck = draw(st.sampled_from(col_kinds))
        if ck == "str":
            values = chosen if col == "chosen" else [c + " " for c in chosen] if same else rows(text)
            add(col, values, pa.string())
        elif ck == "null":
            add(col, rows(st.one_of(st.none(), STR_OR_JUNK)), pa.string())
        elif ck == "int":
            add(col, rows(st.integers(0, 9)), pa.int64())
        elif ck == "float":
            add(col, rows(st.floats(allow_nan=True)), pa.float64())
        elif ck == "binary":
            add(col, rows(st.binary(max_size=5)), pa.binary())
    extra = ["junk", "chosen_source"] if valid else ["junk", "chosen_source", "prompt", "chosen", "rejected"]
    for _ in range(draw(st.integers(0, 2))):
        name = draw(st.sampled_from(extra))
        if not valid or name not in names:
            add(name, rows(STR_OR_JUNK), pa.string())
    return n, names, arrays


@_settings(40)
@given(table=pair_tables())
@example(table=(1, ["prompt", "chosen", "rejected"], [pa.array([[{"role": None, "content": "q"}]], pa.list_(MSG_T)), pa.array(["a"]), pa.array(["b"])]))  # fmt: skip
@example(table=(1, ["prompt", "chosen", "rejected"], [pa.array([[{"role": "user", "content": 5}]], pa.list_(pa.struct([("role", pa.string()), ("content", pa.int64())]))), pa.array(["a"]), pa.array(["b"])]))  # fmt: skip
def test_hostile_pair_files_end_in_a_clear_error_or_valid_pairs(table):
    from rlplug.data.dataset import ALLOWED_ROLES
    from rlplug.rewards.pairs import read_pairs
    from rlplug.rewards.reward_model import RewardModelError

    n, names, arrays = table
    path = _fresh_dir() / "pairs.parquet"
    pq.write_table(pa.Table.from_arrays(arrays, names=names), str(path))
    try:
        pairs = read_pairs(path)
    except RewardModelError as err:
        msg = str(err)
        assert msg.startswith(f"--pairs {path}"), msg
        m = re.search(r" row (\d+):", msg)
        assert m is None or 0 <= int(m.group(1)) < n, msg
        event("error: " + re.sub(r"--pairs \S+( row \d+)?", "", msg)[:40])
        return
    assert len(pairs) == n
    for p in pairs:
        assert set(p) == {"prompt", "chosen", "rejected"}
        assert p["prompt"] and all(m["role"] in ALLOWED_ROLES and isinstance(m["content"], str) for m in p["prompt"])
        assert any(m["content"].strip() for m in p["prompt"])
        assert all(isinstance(p[c], str) and p[c].strip() for c in ("chosen", "rejected"))
        assert p["chosen"].strip() != p["rejected"].strip()
    event("valid pairs")


# ============================================================================ schedules

UNTIL = st.sampled_from([None, 1, 2, 3, 0, -1, 0.5, 1.0, 1.5, 0.0, "x", True, [1], 10**6])
PRESET = st.sampled_from([None, "grpo", "ppo", "rloo", "ppoo", "../config", 5])
OVERRIDES = st.one_of(
    st.dictionaries(
        st.sampled_from(["rollout.n", "actor.clip_ratio", "actor.clip_ration", "actor.ppo_epochs", "trainer.critic_warmup",
                         "actor.optim.lr", "critic.enable", "data.train_batch_size", "critic.value_target"]),
        st.sampled_from([0, 1, 2, 3, 4, 0.3, 0.0, "x", True, "mc_return"]),
        max_size=2,
    ),
    st.sampled_from([[1], "rollout.n=2"]),
)  # fmt: skip


GOOD_PHASE = st.fixed_dictionaries(
    {"until": st.sampled_from([1, 2, 0.5, 1.0])},
    optional={"algorithm": st.sampled_from(["grpo", "rloo", None]),
              "overrides": st.sampled_from([{}, {"actor.clip_ratio": 0.3}, {"rollout.n": 2}, {"actor.optim.lr": 5e-5}])},
)  # fmt: skip


@st.composite
def phases(draw):
    """Half the schedules may well be valid (known presets, ordered ends, the last phase open); the rest
    have phases of random parts, some missing, some of the wrong type, an unknown key now and then."""
    if draw(st.booleans()):
        good = draw(st.lists(GOOD_PHASE, min_size=1, max_size=3))
        ends = sorted((p["until"] for p in good), key=lambda u: (isinstance(u, float), u))
        good = [dict(p, until=u) for p, u in zip(good, ends)]
        del good[-1]["until"]
        return good
    out = []
    for _ in range(draw(st.integers(0, 3))):
        phase = {}
        for key, strategy in (("until", UNTIL), ("algorithm", PRESET), ("overrides", OVERRIDES)):
            if draw(st.integers(0, 3)):
                phase[key] = draw(strategy)
        if draw(st.integers(0, 9)) == 0:
            phase["bogus"] = 1
        out.append(phase)
    return out


N_SCHEDULE = st.one_of(
    st.none(),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["linear", "linear", "cosine"]), "start": st.sampled_from([0, 1, 2, 3, 4]),
         "end": st.sampled_from([1, 2, 4, -1])}
    ),
)  # fmt: skip


@_settings(16)
@given(
    schedule=phases(),
    n_schedule=N_SCHEDULE,
    base=st.sampled_from(
        [
            ["algorithm=grpo", "rollout.n=2"],
            ["algorithm=rloo", "rollout.n=2"],
            ["algorithm=ppo"],
            ["algorithm=grpo", "rollout.n=2", "actor.ppo_mini_batch_size=2", "actor.micro_batch_size_per_device=4"],
        ]
    ),  # fmt: skip
    steps=st.sampled_from([2, 3, None]),
)
@example(schedule=[{"until": 1, "bogus": 2}], n_schedule=None, base=["algorithm=ppo"], steps=2)
@example(schedule=[{"until": 1, "algorithm": "../config"}, {}], n_schedule=None, base=["algorithm=ppo"], steps=2)
def test_hostile_schedules_are_rejected_naming_the_phase_or_build(registry, schedule, n_schedule, base, steps):
    from rlplug.run.schedule import Schedule
    from rlplug.run.validate import plan_batch, validate_config

    overrides = ["debug=tiny", *base, f"trainer.total_training_steps={hydra_value(steps)}"]
    if schedule:
        overrides.append(f"algorithm.schedule={hydra_value(schedule)}")
    if n_schedule is not None:
        overrides.append(f"rollout.n_schedule={hydra_value(n_schedule)}")
    try:
        cfg = compose(overrides)
        validate_config(cfg, registry)
    except ConfigError as err:
        msg = str(err)
        assert "algorithm.schedule" in msg or "rollout.n_schedule" in msg, (overrides, msg)
        assert "To append to your config" not in msg, msg  # Hydra's advice for a key the schema lacks
        if "algorithm.schedule[" in msg:
            i = int(msg.split("algorithm.schedule[", 1)[1].split("]")[0])
            assert 0 <= i < len(schedule), msg
        event("rejected")
        return
    total = steps or 4
    sched = Schedule(cfg, registry, total, plan_batch(cfg, registry))
    assert len(sched.phases) == len(schedule)
    assert sched.ends == sorted(sched.ends) and sched.ends[-1] == total
    for step in range(1, total + 1):
        step_cfg = sched.config_at(step)
        assert sched.n_at(step) >= 1 and int(step_cfg.rollout.n) == sched.n_at(step)
        assert step_cfg.algorithm.schedule == [] and step_cfg.rollout.n_schedule.type is None
    event(f"built: {len(schedule)} phases, n_schedule={n_schedule is not None}")


# ============================================================================ alerts

METRICS = ["actor/ppo_kl", "actor/grad_norm", "critic/vf_loss", "actor/kl_seq_sum", "val-core/src/acc/mean@1",
           "no/such_metric", "", "perf/gen_tokens_per_s"]  # fmt: skip
NUMBER = st.sampled_from([None, 0.5, -1, 3, "0.5", "abc", math.nan, math.inf, True, [1], 10**400])
RULE = st.fixed_dictionaries(
    {"metric": st.one_of(st.sampled_from(METRICS), st.sampled_from([None, 5, ["a"]]))},
    optional={
        "max": NUMBER,
        "min": NUMBER,
        "action": st.sampled_from([None, "warn", "stop", "scale_lr", "scale_kl_coef", "explode", 0]),
        "factor": st.sampled_from([None, 0.5, 2, 0, -1, "x", math.inf, math.nan]),
        "patience": st.sampled_from([None, 1, 3, 0, -2, 1.5, "2", "x", True]),
        "name": st.sampled_from([None, "a", "b", 5, ["x"]]),
        "role": st.sampled_from([None, "actor", "critic", "ref", 3]),
        "optional": st.sampled_from([None, True, False, "no", 1]),
        "maxx": st.just(1),
    },
)
GOOD_RULE = st.fixed_dictionaries(
    {"metric": st.sampled_from(METRICS[:5]), "max": st.sampled_from([0.5, 3, -1, "0.5"])},
    optional={"action": st.sampled_from(["warn", "stop", "scale_lr", "scale_kl_coef"]), "factor": st.just(0.5),
              "patience": st.sampled_from([1, 2]), "optional": st.booleans()},
)  # fmt: skip
#: half the lists: rules that may well be valid; the rest: anything, non-mappings included
RULES = st.one_of(
    st.lists(GOOD_RULE, min_size=1, max_size=3),
    st.lists(st.one_of(GOOD_RULE, RULE, st.sampled_from([5, "stop", None, [1]])), max_size=3),
)


@pytest.fixture(scope="module")
def alert_bases():
    return {name: compose(["debug=tiny", f"algorithm={name}", "rollout.n=2"]) for name in ("ppo", "grpo")}


@_settings(40)
@given(
    rules=RULES,
    base=st.sampled_from(["ppo", "grpo"]),
    values=st.lists(st.sampled_from([math.nan, math.inf, -math.inf, 0.0, 1e308, -1e308, 5.0, 0.4]), min_size=8, max_size=8),
)  # fmt: skip
@example(rules=[{"metric": "actor/ppo_kl", "max": "abc"}], base="ppo", values=[0.0] * 8)
@example(rules=[{"metric": "actor/ppo_kl", "max": 1, "patience": 1.5}], base="ppo", values=[0.0] * 8)
@example(rules=[{"metric": "actor/ppo_kl", "max": 1, "optional": "no"}], base="ppo", values=[0.0] * 8)
def test_hostile_alert_rules_are_rejected_naming_the_rule_or_evaluate(registry, alert_bases, rules, base, values):
    from rlplug.run.alerts import ALERT_ACTIONS, AlertEngine
    from rlplug.run.validate import plan_batch, validate_config

    cfg = OmegaConf.merge(alert_bases[base], {"trainer": {"alerts": rules}})  # compose's structured merge
    try:
        validate_config(cfg, registry)
    except ConfigError as err:
        msg = str(err)
        m = re.search(r"trainer\.alerts\[(\d+)\]", msg)
        assert m is not None or "trainer.alerts rule " in msg, (rules, msg)
        assert m is None or 0 <= int(m.group(1)) < len(rules), msg
        event("rejected: " + re.sub(r"trainer\.alerts\[\d+\]:? ?", "", msg)[:30])
        return
    engine = AlertEngine.from_config(cfg, plan_batch(cfg, registry), registry)
    for rule in engine.rules:
        assert isinstance(rule.threshold, float) and math.isfinite(rule.threshold)
        assert isinstance(rule.patience, int) and rule.patience >= 1
        assert rule.action in ALERT_ACTIONS and rule.role in ("actor", "critic") and isinstance(rule.optional, bool)
        if rule.action.startswith("scale_"):
            assert math.isfinite(rule.factor) and rule.factor > 0
    metrics = {rule.metric: values[i % len(values)] for i, rule in enumerate(engine.rules)}
    for step in (1, 2, 3):
        fired = engine.evaluate(step, metrics)
        for rule, value in fired:
            assert rule.holds(value) and math.isfinite(value)
    event(f"accepted: {len(engine.rules)} rules")


def test_an_int_beyond_any_float_is_a_failed_sample_not_an_overflow():
    # review finding: float(10**400) raises OverflowError, which the score check did not catch, and
    # math.isfinite(10**400) raises it too inside a dict's extra values
    from rlplug.rewards.manager import RewardManager

    score, extra, error = RewardManager._interpret("ok", 10**400)
    assert (score, extra) == (0.0, {}) and error == "returned an int of 401 digits, beyond float32's range"
    score, extra, error = RewardManager._interpret("ok", {"score": 0.5, "big": 10**400, "acc": 1})
    assert (score, extra, error) == (0.5, {"acc": 1.0}, None)
