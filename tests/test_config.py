"""Config composition and validation: every group option composes, typos and bad values fail
with messages that say what to do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from omegaconf import DictConfig, ListConfig, OmegaConf

from rlplug.config.compose import compose
from rlplug.config.schema import ConfigError, RunConfig, config_dir, config_get
from rlplug.contracts.agents import FunctionTool
from rlplug.contracts.coordinator import SINGLE_PROCESS
from rlplug.contracts.registry import Registry
from rlplug.contracts.types import AdvantageEstimator, BatchFilter, KLPenalty, PolicyLoss
from rlplug.run.validate import validate_config

CONFIGS = config_dir()
GROUPS = sorted(p.name for p in CONFIGS.iterdir() if p.is_dir() and any(p.glob("*.yaml")))
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONFIGS / g).glob("*.yaml"))]


def _noop(*args, **kwargs):  # stands in for the algorithm and reward plugin objects in the stub registry
    return None


class _StubRollout:
    """Stands in for the rollout backends (conforms to rlplug.contracts.types.RolloutBackend; builds nothing)."""

    def __init__(self, *args, **kwargs): ...
    def generate(self, prompt_ids, params): ...
    def update_weights(self, named_tensors): ...
    def sleep(self): ...
    def wake_up(self): ...
    def close(self): ...


class _StubTraining:
    """Stands in for the training backends (conforms to rlplug.contracts.types.TrainingBackend)."""

    consecutive_bad_steps = 0
    coordinator = SINGLE_PROCESS
    per_token_outputs = frozenset({"entropy", "sum_pi_squared"})
    capabilities = frozenset({"reuses_on_policy_log_probs", "apply_phase"})  # apply_phase: experiment=grpo_to_ppo

    def __init__(self, *args, **kwargs): ...
    def compute_log_probs(self, batch, *, which="actor", with_entropy=False, extras=()): ...
    def compute_values(self, batch): ...
    def update_actor(self, batch): ...
    def update_critic(self, batch): ...
    def actor_weights(self): ...
    def save(self, directory): ...
    def load(self, directory): ...
    def export_hf(self, directory, tokenizer=None): ...
    def close(self): ...


class _StubTracker:
    """Stands in for the trackers (conforms to rlplug.contracts.types.Tracker)."""

    def __init__(self, *args, **kwargs): ...
    def log_params(self, params): ...
    def log_metrics(self, metrics, step): ...
    def log_table(self, name, rows, step): ...
    def log_artifact(self, path, artifact_path=None): ...
    def close(self, status="FINISHED"): ...


@pytest.fixture
def stub_registry() -> Registry:
    """Every name the packaged configs select, as stubs with the right kind-level attributes.

    Keeps these config tests independent of the plugin implementations.
    """
    r = Registry(load_entry_points=False)
    r.register("advantage_estimator", "gae", AdvantageEstimator(_noop, requires=("values",)), "rlplug", "0.1.0")
    # group estimators; opo ... optimal_token_baseline: the packaged presets of issue 16
    for name in ("grpo", "rloo", "opo", "grpo_passk", "gpg", "gdpo", "optimal_token_baseline"):
        r.register(
            "advantage_estimator", name, AdvantageEstimator(_noop, ("index",), group_based=True), "rlplug", "0.1.0"
        )
    r.register("advantage_estimator", "reinforce_plus_plus", AdvantageEstimator(_noop), "rlplug", "0.1.0")
    r.register("advantage_estimator", "remax", AdvantageEstimator(_noop, ("reward_baselines",)), "rlplug", "0.1.0")
    for name in ("vanilla", "dual_clip", "gspo", "sapo", "gpg", "geo_mean", "cispo", "clip_cov", "kl_cov"):
        r.register("policy_loss", name, PolicyLoss(_noop), "rlplug", "0.1.0")
    for name in ("kl", "low_var_kl"):
        r.register("kl_penalty", name, KLPenalty(_noop), "rlplug", "0.1.0")
    for name in ("hf", "vllm", "sglang"):
        r.register("rollout_backend", name, _StubRollout, "rlplug", "0.1.0")
    for name in ("local", "fsdp2"):
        r.register("training_backend", name, _StubTraining, "rlplug", "0.1.0")
    for name in ("console", "mlflow"):
        r.register("tracker", name, _StubTracker, "rlplug", "0.1.0")
    # debug=tiny, grpo_arithmetic, reward=reward_model
    for name in ("gsm8k", "reasoning_gym", "math_verify", "length_penalty", "format", "reward_model"):
        r.register("reward_function", name, _noop, "rlplug", "0.1.0")
    r.register("batch_filter", "filter_groups", BatchFilter(_noop), "rlplug", "0.1.0")  # algorithm=dapo
    # experiment=calc_tool: the multi-turn environment and its tool
    r.register("environment", "tool_agent", _StubEnvironment, "rlplug", "0.1.0")
    r.register("tool", "calculator", FunctionTool(_stub_calculator, name="calculator"), "rlplug", "0.1.0")
    return r


class _StubEnvironment:
    def __init__(self, context: Any) -> None:
        pass

    def reset(self, row: Any) -> list:
        return []

    def step(self, assistant_message: Any) -> Any:
        return None


def _stub_calculator(expression: str) -> str:
    """A stub of the calculator tool.

    Args:
        expression: the arithmetic expression.
    """
    return expression


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


def required_overrides(group: str, option: str, tmp_path: Path, model_dir: Path) -> list[str]:
    """Values an option leaves mandatory (``???``)."""
    if (group, option) == ("model", "path"):
        return [f"model.path={model_dir}"]
    if (group, option) == ("reward", "reward_model"):  # a one-label sequence classifier's folder
        rm = tmp_path / "rm"
        rm.mkdir()
        (rm / "config.json").write_text('{"architectures": ["LlamaForSequenceClassification"], "id2label": {"0": "x"}}')
        (rm / "tokenizer_config.json").write_text("{}")
        return [f"reward.reward_model.model_path={rm}"]
    if (group, option) == ("data", "files"):
        train, val = tmp_path / "train.parquet", tmp_path / "test.parquet"
        train.write_bytes(b"")
        val.write_bytes(b"")
        return [f"data.train_files=[{train}]", f"data.val_files=[{val}]"]
    return []


def _leaves(node, prefix=""):
    """(dotted key, value) for every leaf of a loaded YAML option file, ``defaults`` excluded."""
    if isinstance(node, DictConfig):
        for k, v in node.items_ex(resolve=False):
            if prefix == "" and k == "defaults":
                continue
            yield from _leaves(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], node


def test_the_config_tree_has_every_group():
    assert set(GROUPS) >= {"algorithm", "data", "model", "reward", "rollout", "trainer", "debug", "experiment"}
    assert ("algorithm", "grpo") in OPTIONS and ("model", "path") in OPTIONS


@pytest.mark.parametrize("group, option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_group_option_composes_validates_and_applies(group, option, tmp_path, model_dir, stub_registry):
    extra = required_overrides(group, option, tmp_path, model_dir)
    overrides = [f"{group}={option}", *extra]
    cfg = compose(overrides)
    choices = validate_config(cfg, registry=stub_registry)
    assert {c.key for c in choices} >= {
        "algorithm.adv_estimator",
        "actor.policy_loss",
        "rollout.name",
        "trainer.backend",
    }
    # every value the option file sets is in the composed config (later groups do not undo it)
    explicit = {o.split("=", 1)[0] for o in extra}
    option_cfg = OmegaConf.load(CONFIGS / group / f"{option}.yaml")
    for key, value in _leaves(option_cfg):
        if key in explicit or value == "???":
            continue
        got = OmegaConf.select(cfg, key)
        if isinstance(got, (DictConfig, ListConfig)):
            got = OmegaConf.to_container(got)
        assert got == value, f"{group}={option} sets {key}={value!r} but the composed config has {got!r}"


def test_math_verify_scores_every_source():
    # regression: `reward_fn_map: {}` in a group file merged into the defaults instead of clearing them
    cfg = compose(["reward=math_verify"])
    assert cfg.reward.default == "math_verify"
    assert set(cfg.reward.reward_fn_map.values()) == {"math_verify"}


def test_debug_preset_is_valid_for_one_and_several_samples(stub_registry):
    for algorithm in ("ppo", "grpo"):
        cfg = compose(["debug=tiny", f"algorithm={algorithm}"])
        validate_config(cfg, registry=stub_registry)
        assert cfg.model.source == "tiny" and cfg.trainer.total_training_steps == 2


def test_defaults_match_the_schema():
    # configs/config.yaml only selects groups; values not set by a group come from RunConfig
    cfg = compose([])
    schema = OmegaConf.structured(RunConfig)
    assert cfg.actor.clip_ratio == schema.actor.clip_ratio == 0.2
    assert cfg.algorithm.adv_estimator == "gae" and cfg.critic.enable is True
    assert cfg.trainer.experiment_name == "ppo_basic_arithmetic"  # <algorithm preset>_<data task>


# ============================================================================ compose errors


def test_unknown_key_lists_valid_keys():
    with pytest.raises(ConfigError) as info:
        compose(["actor.ppo_mini_batchsize=4"])
    msg = str(info.value)
    assert msg.startswith("Unknown config key 'actor.ppo_mini_batchsize'. Did you mean 'actor.ppo_mini_batch_size'?")
    valid = msg.split("Valid keys in 'actor': ", 1)[1].rstrip(".").split(", ")
    assert valid == sorted(OmegaConf.structured(RunConfig).actor.keys())


def test_unknown_nested_and_top_level_keys():
    with pytest.raises(
        ConfigError,
        match=r"Unknown config key 'actor\.optim\.learning_rate'.*Valid keys in 'actor\.optim': betas, eps, fused, lr,",
    ):
        compose(["actor.optim.learning_rate=1e-5"])
    with pytest.raises(ConfigError) as info:
        compose(["trainr.seed=1"])
    assert "Unknown config key 'trainr'" in str(info.value)
    assert "Valid keys in the top level: actor, algorithm, critic, data, model, reward, rollout, trainer." in str(
        info.value
    )


def test_unknown_group_option_lists_available_options():
    with pytest.raises(ConfigError) as info:
        compose(["algorithm=nosuch"])
    msg = str(info.value)
    assert "Could not find 'algorithm/nosuch'" in msg and "Available options in 'algorithm'" in msg
    for option in (o for g, o in OPTIONS if g == "algorithm"):
        assert f"\t{option}\n" in msg


def test_bad_value_type_is_a_config_error():
    with pytest.raises(ConfigError, match="rollout.n"):
        compose(["rollout.n=four"])


# ============================================================================ validation errors


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["algorithm.adv_estimator=grp"],
            "algorithm.adv_estimator=grp: Unknown advantage estimator 'grp'. Did you mean 'grpo' or 'gpg' or 'gdpo'? "
            "Available: gae (rlplug 0.1.0), gdpo (rlplug 0.1.0), gpg (rlplug 0.1.0), grpo (rlplug 0.1.0), "
            "grpo_passk (rlplug 0.1.0), opo (rlplug 0.1.0), optimal_token_baseline (rlplug 0.1.0), "
            "reinforce_plus_plus (rlplug 0.1.0), remax (rlplug 0.1.0), rloo (rlplug 0.1.0). "
            "Run 'rlplug plugins' to see what is installed (the plugin may not be installed).",
        ),
        (
            ["data.train_batch_size=8", "actor.ppo_mini_batch_size=16"],
            "actor.ppo_mini_batch_size=16 is larger than data.train_batch_size=8 (both count prompts). "
            "Set actor.ppo_mini_batch_size to at most 8.",
        ),
        (
            ["data.train_batch_size=8", "actor.ppo_mini_batch_size=3"],
            "data.train_batch_size=8 is not a multiple of actor.ppo_mini_batch_size=3; each step must split "
            "into whole mini-batches. Choose a divisor of 8.",
        ),
        (
            # 8 prompts x 1 response per mini-batch = 8 responses; 3 does not divide 8
            ["data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "actor.micro_batch_size_per_device=3"],
            "actor.micro_batch_size_per_device=3 does not divide the mini-batch of 8 responses "
            "(actor.ppo_mini_batch_size=8 x rollout.n=1). Choose a divisor of 8.",
        ),
        (
            # grpo: 8 prompts x 4 responses = 32; 5 does not divide 32
            [
                "algorithm=grpo",
                "data.train_batch_size=8",
                "actor.ppo_mini_batch_size=8",
                "actor.micro_batch_size_per_device=5",
            ],
            "actor.micro_batch_size_per_device=5 does not divide the mini-batch of 32 responses "
            "(actor.ppo_mini_batch_size=8 x rollout.n=4). Choose a divisor of 32.",
        ),
        (
            ["model=path"],
            "model.source=path needs model.path: the folder of a Hugging Face model (config.json, weights, tokenizer).",
        ),
        (
            ["algorithm=grpo", "rollout.n=1"],
            "algorithm.adv_estimator=grpo compares responses within a group, but rollout.n=1: a group of one "
            "response has no baseline. Set rollout.n to 2 or more (e.g. rollout.n=4).",
        ),
        (
            ["actor.loss_agg_mode=token_mean"],
            "actor.loss_agg_mode=token_mean is not a loss aggregation mode. Use one of: token-mean, "
            "token-sum, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm.",
        ),
        (
            ["trainer.logger=[console,wandb]"],
            "trainer.logger[1]=wandb: Unknown tracker 'wandb'. Available: console (rlplug 0.1.0), "
            "mlflow (rlplug 0.1.0). Run 'rlplug plugins' to see what is installed (the plugin may not be installed).",
        ),
    ],
    ids=[
        "unknown-plugin",
        "mini>train",
        "mini-not-divisor",
        "micro-not-divisor",
        "micro-grpo",
        "model-path",
        "group-n1",
        "agg-mode",
        "unknown-tracker",
    ],
)
def test_bad_config_messages(stub_registry, overrides, expected):
    cfg = compose(overrides)
    with pytest.raises(ConfigError) as info:
        validate_config(cfg, registry=stub_registry)
    assert str(info.value) == expected


def test_model_path_without_config_json(stub_registry, tmp_path):
    cfg = compose(["model=path", f"model.path={tmp_path}"])
    with pytest.raises(ConfigError, match=r"no Hugging Face model folder there \(expected .*config\.json\)"):
        validate_config(cfg, registry=stub_registry)


def test_missing_data_file(stub_registry, tmp_path):
    cfg = compose(["data=files", f"data.train_files=[{tmp_path / 'nope.parquet'}]", "data.val_files=[]"])
    with pytest.raises(ConfigError, match=r"data\.train_files: file .*nope\.parquet does not exist"):
        validate_config(cfg, registry=stub_registry)


def test_critic_batch_sizes_checked_only_with_a_critic(stub_registry):
    # batch sizes pinned here: the default experiment preset sets its own
    sizes = ["data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "actor.micro_batch_size_per_device=4"]
    # ppo uses a critic: its own mini-batch is checked
    with pytest.raises(ConfigError, match=r"critic\.ppo_mini_batch_size=16 is larger than data\.train_batch_size=8"):
        validate_config(compose(["algorithm=ppo", *sizes, "critic.ppo_mini_batch_size=16"]), registry=stub_registry)
    # grpo has no critic: the same setting is ignored
    validate_config(compose(["algorithm=grpo", *sizes, "critic.ppo_mini_batch_size=16"]), registry=stub_registry)


def test_validate_reports_providers(stub_registry):
    stub_registry.register("advantage_estimator", "other", AdvantageEstimator(_noop), "rlplug-other", "2.0")
    choices = validate_config(compose(["algorithm.adv_estimator=other"]), registry=stub_registry)
    assert str(choices[0]) == "algorithm.adv_estimator=other (rlplug-other 2.0)"
    assert str(choices[1]) == "actor.policy_loss=vanilla (rlplug 0.1.0)"


@pytest.mark.parametrize("key", ["actor.kl_loss_type", "algorithm.kl_penalty"])
def test_full_kl_is_not_offered(stub_registry, key):
    # the trainer and the backends hand KL estimators log-probs only, never (B, T, V) logits, so
    # verl's 'full' estimator is not registered: choosing it fails like any unknown name
    overrides = {
        "actor.kl_loss_type": ["algorithm=grpo", "actor.kl_loss_type=full"],
        "algorithm.kl_penalty": ["algorithm=rloo", "algorithm.kl_penalty=full"],
    }[key]
    with pytest.raises(ConfigError, match=rf"^{key}=full: Unknown kl penalty 'full'"):
        validate_config(compose(overrides), registry=stub_registry)


def test_training_temperature_must_be_positive(stub_registry):
    with pytest.raises(ConfigError, match=r"^rollout\.temperature=0\.0: training samples responses"):
        validate_config(compose(["rollout.temperature=0"]), registry=stub_registry)
    validate_config(compose(["rollout.val_kwargs.temperature=0"]), registry=stub_registry)  # greedy validation is fine


def test_rollout_is_threshold_needs_engine_log_probs(stub_registry):
    with pytest.raises(ConfigError, match=r"rollout\.calculate_log_probs=false"):
        validate_config(compose(["actor.rollout_is_threshold=2.0"]), registry=stub_registry)
    with pytest.raises(ConfigError, match=r"^actor\.rollout_is_threshold=0\.0 must be > 0"):
        validate_config(
            compose(["actor.rollout_is_threshold=0", "rollout.calculate_log_probs=true"]), registry=stub_registry
        )
    validate_config(
        compose(["actor.rollout_is_threshold=2.0", "rollout.calculate_log_probs=true"]), registry=stub_registry
    )


@pytest.mark.parametrize(
    "override, expected",
    [
        ("model.compute_dtype=fp16", "model.compute_dtype=fp16: use 'auto'"),
        ("critic.optim.warmup_style=linear", "critic.optim.warmup_style=linear: use 'constant' or 'cosine'."),
        ("trainer.device=gpu", "trainer.device=gpu: use 'auto'"),
    ],
)
def test_enumerated_values_fail_before_any_model_loads(stub_registry, override, expected):
    with pytest.raises(ConfigError) as info:
        validate_config(compose([override]), registry=stub_registry)
    assert str(info.value).startswith(expected)


def test_config_get_reads_dictconfig_dataclass_and_dict_alike():
    # The same dotted keys through the three container kinds, each checked against plain
    # attribute / item access on that container (the composed presets may override the schema).
    composed = compose([])  # a struct DictConfig: an unknown key must give the default, not raise
    dataclass_cfg = RunConfig()
    plain = {"rollout": {"n": 3}, "actor": {"optim": {"lr": 2e-6}}}
    cases = [
        (composed, composed.rollout.n, composed.actor.optim.lr),
        (dataclass_cfg, dataclass_cfg.rollout.n, dataclass_cfg.actor.optim.lr),
        (plain, 3, 2e-6),
    ]
    for cfg, n, lr in cases:
        assert config_get(cfg, "rollout.n") == n
        assert config_get(cfg, "actor.optim.lr") == lr
        assert config_get(cfg, "rollout.no_such_key", 7) == 7
        assert config_get(cfg, "no_section.n", "d") == "d"
    # a None value (or a None config / section on the way) gives the default; falsy values do not
    assert config_get({"a": {"b": None}}, "a.b", 5) == 5
    assert config_get({"a": None}, "a.b", 5) == 5
    assert config_get(None, "a", 5) == 5
    assert config_get({"a": 0}, "a", 5) == 0
    assert config_get({"a": False}, "a", True) is False


def test_max_ckpt_to_keep_must_keep_one(stub_registry):
    with pytest.raises(ConfigError, match=r"trainer\.max_ckpt_to_keep=0: keep at least 1 checkpoint"):
        validate_config(compose(["trainer.max_ckpt_to_keep=0"]), registry=stub_registry)
    validate_config(compose(["trainer.max_ckpt_to_keep=null"]), registry=stub_registry)
