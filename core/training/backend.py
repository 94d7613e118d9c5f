"""The training-backend library: what the packaged backends share, for any backend to reuse.

A training backend (kind ``training_backend``, :class:`rlplug.contracts.types.TrainingBackend`) owns the
models, optimizers, devices and process groups; the math it minimises is in
:mod:`rlplug.algorithms.objective`. This module holds the rest that backends have in common:

* :class:`TrainingBackendBase`: a complete single-process backend -- model loading (actor,
  reference, critic), AdamW and learning-rate schedules (:class:`Role`), inference
  (:meth:`~TrainingBackendBase.compute_log_probs`, :meth:`~TrainingBackendBase.compute_values`),
  the epoch / mini-batch / micro-batch update loop around :func:`rlplug.algorithms.objective.actor_objective`
  and :func:`rlplug.algorithms.objective.critic_objective`, non-finite-step handling, checkpoints and export.
  The ``local`` plugin is this class as it is; the data-parallel ``fsdp2`` plugin overrides its
  hooks (below). A new backend subclasses it and overrides what differs.
* :class:`Role`: one trained model with its optimizer, schedule and update sizes.
* :func:`build_lr_lambda` (the LR schedule), :func:`resolve_device` (``trainer.device``),
  :func:`unique_state` (state dict without tied aliases), :func:`check_batch_fields`,
  :data:`STATE_FILE` (the counters file of a backend checkpoint).
* :class:`TorchDistributedCoordinator`: the :class:`rlplug.contracts.types.Coordinator` of a
  ``torch.distributed`` process group (``broadcast`` = ``dist.broadcast_object_list``).

The update loop (``docs/algorithms.md``, "Batch sizes and the update loop"): for each of
``ppo_epochs`` the batch is split IN ORDER (no shuffling, like verl's default) into mini-batches
of ``ppo_mini_batch_size * rollout.n`` responses; each mini-batch is one optimizer step. Its
loss normaliser (valid tokens or sequences, :func:`rlplug.algorithms.losses.agg_normalizer`) is computed on
the whole mini-batch, so splitting it into micro-batches of ``micro_batch_size_per_device``
responses (gradient accumulation) does not change the gradient. Gradients are clipped to
``grad_clip`` by global norm; a non-finite loss or gradient norm skips the optimizer step. A
policy loss with ``minibatch_stats`` (:class:`rlplug.contracts.types.PolicyLoss`) gets them computed once per
mini-batch from a no-grad forward of the whole (global) mini-batch, before its micro-batches
(:func:`minibatch_stats_batch`), so its token selection is micro-batch invariant too.

Numerics: fp32 master weights and optimizer states; ``model.compute_dtype`` ``auto`` (the default) is
bf16 where bf16 matmuls are fast and fp32 elsewhere (:func:`rlplug.base.precision.resolve_dtype`); with bf16 the
forward passes run under ``torch.autocast(dtype=torch.bfloat16)`` (fp32 when the device has no
bf16 autocast). Log-probs come from :func:`rlplug.algorithms.logprob.response_token_stats`, which never
materialises the ``(B, T, V)`` logits at once.

Data-parallel hooks of :class:`TrainingBackendBase` (single-process defaults; ``fsdp2``
overrides them): ``_training_device()`` (the device), ``_prepare_model(model, role)`` (place /
shard a loaded model), ``_check_same_batch(batch, what)`` (every process got the same batch),
``_rank_rows(batch, keys)`` / ``_gather_rows(local, size, device)`` (this process's inference rows
and the all-gather of the results), ``_rank_slice(mini, role)`` (this process's share of a
mini-batch), ``_all_reduce(values)`` (sums over the processes), ``_release(model)`` (free gathered
parameters), ``_clip_grad(role)`` (global-norm clipping), ``_forward_log_probs(...)`` /
``_values(...)`` (one micro-batch's forward pass).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import os
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import safetensors.torch
import torch

from rlplug.algorithms.logprob import response_token_stats, trim_padding_columns
from rlplug.algorithms.losses import agg_normalizer, seq_norm_length
from rlplug.algorithms.objective import CRITIC_INPUT_FIELDS, SEQUENCE_FIELDS, actor_objective, critic_objective
from rlplug.algorithms.token_budget import pack_rows, row_lengths, token_budgets
from rlplug.base.file_modes import apply_umask
from rlplug.base.host_memory import keep_freed_memory
from rlplug.base.precision import resolve_dtype
from rlplug.base.run_context import RunContext
from rlplug.config.schema import (
    ActorConfig,
    CriticConfig,
    DataConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    TrainerConfig,
    default_cache_dir,
    typed,
)
from rlplug.contracts.batch import Batch
from rlplug.contracts.coordinator import SINGLE_PROCESS
from rlplug.contracts.registry import get_registry
from rlplug.contracts.types import BATCH_FIELD_PRODUCERS, PER_TOKEN_QUANTITIES, MiniBatchContext

# lora and models are read as module attributes at call time (tests replace e.g. models.load_causal_lm)
from rlplug.training import lora, models
from rlplug.training.models import unique_state  # also re-exported: its home before rlplug.training.models

__all__ = [
    "TrainingBackendBase",
    "Role",
    "TorchDistributedCoordinator",
    "build_lr_lambda",
    "resolve_device",
    "unique_state",
    "check_batch_fields",
    "minibatch_stats_batch",
    "STATE_FILE",
]

logger = logging.getLogger(__name__)

#: Prefix of the batch tensors that carry a policy loss's ``minibatch_stats`` through the rank
#: slice and the micro-batch split (rows stay aligned with every other tensor).
_STATS_PREFIX = "minibatch_stats/"

#: The counters file a backend checkpoint holds (``consecutive_bad_steps`` per role, ...).
STATE_FILE = "backend_state.json"

#: The attribute of a :class:`Role`'s LR scheduler that records the schedule's shape (:attr:`Role.lr_schedule`);
#: ``LambdaLR.state_dict()`` saves every attribute, so each checkpoint holds it (:meth:`Role.load_scheduler_state`).
LR_SCHEDULE_ATTR = "rlplug_lr_schedule"


# ============================================================================ helpers

_T = TypeVar("_T")


def _or(value: _T | None, fallback: _T) -> _T:
    """``value``, or ``fallback`` when it is None (a critic setting left unset follows the actor's)."""
    return fallback if value is None else value


def resolve_device(trainer: Any, backend: str) -> str:
    """``trainer.device`` as a torch device string: ``"auto"`` is ``"cuda"`` when torch sees a CUDA
    device, else ``"cpu"``. Raises ``ValueError`` for anything but auto / cpu / cuda / cuda:N, or
    for CUDA without a CUDA device (``backend`` names the backend in the message)."""
    device = str(typed(TrainerConfig, trainer).device)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"trainer.device must be 'auto', 'cpu' or 'cuda' for the {backend} backend, got {device!r}.")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("trainer.device='cuda' but torch sees no CUDA device; use trainer.device=cpu or auto.")
    return device


def build_lr_lambda(
    warmup_steps: int, total_steps: int, style: str = "constant", min_lr_ratio: float = 0.0, hold_steps: int = 0
) -> Callable[[int], float]:
    """Learning-rate multiplier per optimizer step, for ``torch.optim.lr_scheduler.LambdaLR``.

    ``step`` counts optimizer steps already taken (0 for the first step). Linear warmup:
    ``(step + 1) / warmup_steps`` for ``step < warmup_steps``, so the first step already moves
    **(differs from verl, whose first warmup step has learning rate 0)**. Afterwards
    ``"constant"``: 1.0; ``"cosine"``: ``min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + cos(pi *
    progress))`` with ``progress = (step - warmup) / (total - hold - warmup)`` capped at 1 (verl's
    ``get_cosine_schedule_with_warmup`` with half a cycle), so the decay reaches the floor
    ``min_lr_ratio`` at step ``total - hold_steps`` and the last ``hold_steps`` steps stay there
    (``optim.lr_hold_ratio``; not in verl, whose schedule is this one with ``hold_steps=0``).

    Raises ``ValueError`` for an unknown style, ``hold_steps > 0`` with ``"constant"`` (no floor to
    hold), or ``warmup_steps + hold_steps > total_steps`` with a hold (they would overlap).
    """
    if style not in ("constant", "cosine"):
        raise ValueError(f"Unknown optim.warmup_style {style!r}; expected 'constant' or 'cosine'.")
    warmup_steps = max(0, int(warmup_steps))
    total_steps = max(1, int(total_steps))
    hold_steps = max(0, int(hold_steps))
    if hold_steps and style != "cosine":
        raise ValueError(
            f"optim.lr_hold_ratio holds the cosine floor for {hold_steps} steps, but warmup_style={style!r} has none; "
            "use warmup_style=cosine."
        )
    if hold_steps and warmup_steps + hold_steps > total_steps:
        raise ValueError(
            f"The LR warmup ({warmup_steps} optimizer steps) and hold ({hold_steps} steps, optim.lr_hold_ratio) "
            f"overlap in a schedule of {total_steps} optimizer steps; lower optim.lr_warmup_steps or lr_hold_ratio."
        )

    def lr_lambda(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if style == "constant":
            return 1.0
        decay_steps = total_steps - hold_steps - warmup_steps
        if hold_steps and decay_steps <= 0:  # warmup + hold fill the schedule: the floor right after warmup
            return min_lr_ratio
        progress = min(1.0, (step - warmup_steps) / max(1, decay_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return lr_lambda


def use_rlplug_compile_cache() -> str:
    """Point torch's compile cache (Inductor's FX-graph, AOT-autograd and kernel caches) at
    ``<RLPLUG_CACHE>/torch_compile`` unless ``TORCHINDUCTOR_CACHE_DIR`` is set already; returns
    the folder in use.

    torch's default is ``<tmp>/torchinductor_<user>``, which a reboot or a clean container loses:
    the first compiled step on a machine then spends minutes compiling again (about 130 s of the
    default run's first step on a 2-core CPU, against about 29 s with a warm cache). Keeping the
    cache beside the converted model (:func:`rlplug.config.schema.default_cache_dir`) makes it last as
    long as the model does. Call before the first ``torch.compile`` of the process: Inductor
    reads the variable when it first needs its cache and keeps it from then on (child processes,
    such as a rollout engine, inherit it).
    """
    if not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(default_cache_dir() / "torch_compile")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def compile_decoder_layers(model: torch.nn.Module, role: str) -> int:
    """``torch.compile`` every decoder layer of ``model`` in place (``actor.use_torch_compile``).

    The layers are the modules of the first ``torch.nn.ModuleList`` named ``layers`` (Llama, Qwen,
    Mistral ... in transformers; also under peft's LoRA wrapper and the critic's backbone). Each is
    compiled with ``dynamic=True``, so batch size and sequence length change without recompiling,
    and because all layers run the same code with their parameters as inputs, torch compiles one
    graph for the forward and one for the backward and reuses them for every layer. The embedding,
    the final norm and the fused LM head (:mod:`rlplug.algorithms.logprob`) stay eager. Returns the number of
    layers compiled. Raises ``ValueError`` (naming ``role``) when the model has no such list.

    The compiled code is cached in rlplug's own cache (:func:`use_rlplug_compile_cache`), so it
    survives a reboot or a fresh container with the converted model.
    """
    use_rlplug_compile_cache()
    for name, module in model.named_modules():
        if name.split(".")[-1] == "layers" and isinstance(module, torch.nn.ModuleList) and len(module):
            for layer in module:
                layer.compile(dynamic=True)
            return len(module)
    raise ValueError(
        f"{'critic' if role == 'critic' else 'actor'}.use_torch_compile: the {role} model ({type(model).__name__}) "
        "has no decoder-layer list named 'layers' to compile. Set actor.use_torch_compile=false (and "
        "critic.use_torch_compile=false)."
    )


def check_batch_fields(batch: Batch, keys: tuple[str, ...], what: str, hint: str = "") -> None:
    """Raise ``ValueError`` naming the missing ones when ``batch`` lacks any of the tensors ``keys``
    (``what`` names the caller, ``hint`` says how to provide them)."""
    missing = [k for k in keys if k not in batch.tensors]
    if missing:
        raise ValueError(
            f"{what} needs batch tensors {list(keys)}; missing {missing}. Present: {sorted(batch.tensors)}.{hint}"
        )


def minibatch_stats_batch(
    stats_fn: Callable[..., Any],
    mini: Batch,
    log_probs: torch.Tensor,
    config: Any,
    context: MiniBatchContext,
    *,
    reuse: bool = False,
) -> Batch:
    """``mini`` plus a policy loss's whole-mini-batch statistics, ready to be split into micro-batches.

    Calls ``stats_fn(old_log_probs, log_probs, advantages, response_mask, config=config,
    context=context)`` (:attr:`rlplug.contracts.types.PolicyLoss.minibatch_stats`) with ``mini``'s detached
    ``(B_mini, T) float32`` tensors and the current actor's ``log_probs`` (nats, no grad; with
    ``reuse`` they also stand in for the missing ``old_log_probs``), and returns a new batch whose
    tensors also hold each returned ``(B_mini, T)`` tensor under ``"minibatch_stats/<name>"``; the
    update loop's rank slice and micro-batch split keep those rows aligned, and the actor objective
    hands them to the loss as ``<name>=``. Raises ``ValueError`` when ``stats_fn`` does not return
    a mapping of ``(B_mini, T)`` tensors.
    """
    tensors = mini.tensors
    mask = tensors["response_mask"]
    log_probs = log_probs.detach().to(mask.device)
    old = log_probs if reuse else tensors["old_log_probs"].detach()
    stats = stats_fn(old, log_probs, tensors["advantages"].detach(), mask, config=config, context=context)
    if not isinstance(stats, Mapping):
        raise ValueError(
            f"the policy loss's minibatch_stats returned {type(stats).__name__}; it must return a dict of "
            f"(B, T) = {tuple(mask.shape)} tensors, one per keyword argument of the loss."
        )
    extra: dict[str, torch.Tensor] = {}
    for name, value in stats.items():
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(mask.shape):
            raise ValueError(
                f"the policy loss's minibatch_stats returned {name!r} with shape "
                f"{tuple(getattr(value, 'shape', ())) or type(value).__name__}; every value must be a (B, T) = "
                f"{tuple(mask.shape)} tensor of the whole mini-batch (rows are sliced with the micro-batches)."
            )
        extra[_STATS_PREFIX + str(name)] = value.detach()
    return Batch({**tensors, **extra}, dict(mini.meta), dict(mini.columns))


def fused_adamw_supported(params: Sequence[torch.Tensor]) -> bool:
    """Whether ``optim.fused=null`` picks torch's fused AdamW kernel for ``params``: every one a
    plain floating-point ``torch.nn.Parameter`` on CPU or CUDA. Tensor subclasses (FSDP2's
    ``DTensor`` shards: not tried with the fused kernel here) and other devices keep torch's default
    implementation. The fused kernel updates each parameter in one pass (AdamW's formula unchanged;
    results within float32 rounding of the default implementation)."""
    return bool(params) and all(
        type(p) is torch.nn.Parameter and p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params
    )


class Role:
    """One trained model (actor or critic) with its optimizer, schedule and update settings.

    ``mini_batch``: responses per optimizer step (``ppo_mini_batch_size x rollout.n``);
    ``micro_batch``: responses per forward/backward (``micro_batch_size_per_device``); ``epochs``:
    ``ppo_epochs``; ``loss_agg_mode``; ``grad_clip`` (global-norm bound, ``None``/0: none). Builds
    AdamW over ``model``'s trainable parameters from ``optim_cfg`` (``lr``, ``betas``, ``eps``,
    ``weight_decay``, ``fused``: torch's fused kernel; ``None``: where :func:`fused_adamw_supported`)
    and a ``LambdaLR`` schedule (:func:`build_lr_lambda`) of
    ``total_optimizer_steps`` steps, ``lr_warmup_steps`` (when > 0, else ``lr_warmup_steps_ratio`` of
    the total, as verl) of them warmup and the last ``lr_hold_ratio`` of them (rounded down) held at
    the cosine floor. ``consecutive_bad_steps`` counts optimizer steps skipped in a row.
    Raises ``ValueError`` for non-positive sizes or epochs.
    """

    def __init__(
        self,
        name: str,
        model: torch.nn.Module,
        optim_cfg: Any,
        *,
        mini_batch: int,
        micro_batch: int,
        epochs: int,
        loss_agg_mode: str,
        grad_clip: float | None,
        total_optimizer_steps: int,
    ) -> None:
        self.name = name
        self.model = model
        self.mini_batch = int(mini_batch)  # responses per optimizer step
        self.micro_batch = int(micro_batch)
        self.epochs = int(epochs)
        self.loss_agg_mode = str(loss_agg_mode)
        self.grad_clip = grad_clip
        #: padded tokens per forward/backward (``use_dynamic_bsz``), or None: ``micro_batch`` rows
        self.token_budget: int | None = None
        self.consecutive_bad_steps = 0
        if self.mini_batch <= 0 or self.micro_batch <= 0 or self.epochs <= 0:
            raise ValueError(
                f"{name}: ppo_mini_batch_size x rollout.n ({self.mini_batch}), micro_batch_size_per_device "
                f"({self.micro_batch}) and ppo_epochs ({self.epochs}) must all be positive."
            )
        optim = typed(OptimConfig, optim_cfg)
        betas = tuple(float(b) for b in optim.betas)
        params = [p for p in model.parameters() if p.requires_grad]
        fused = optim.fused
        if fused is None:
            fused = fused_adamw_supported(params)
        #: torch's fused AdamW kernel (``optim.fused``, or chosen by :func:`fused_adamw_supported`)
        self.fused = bool(fused)
        self.optimizer = torch.optim.AdamW(
            params,
            lr=float(optim.lr),
            betas=betas,  # type: ignore[arg-type]
            eps=float(optim.eps),
            weight_decay=float(optim.weight_decay),
            fused=self.fused or None,
        )
        #: the AdamW settings of this run's config, put back over a checkpoint's (:meth:`keep_optimizer_implementation`)
        self.optimizer_settings: dict[str, Any] = {
            "betas": betas,
            "eps": float(optim.eps),
            "weight_decay": float(optim.weight_decay),
        }
        warmup = int(optim.lr_warmup_steps)
        if warmup <= 0:  # as verl: lr_warmup_steps wins when > 0, else the ratio of the total
            warmup = int(float(optim.lr_warmup_steps_ratio) * total_optimizer_steps)
        self.total_optimizer_steps = total_optimizer_steps
        self.warmup_steps = warmup
        #: the shape of the LR schedule (:func:`build_lr_lambda`'s arguments), kept in the scheduler's checkpoint
        #: (:data:`LR_SCHEDULE_ATTR`) so that a resume can tell when it changed (:meth:`load_scheduler_state`)
        self.lr_schedule: dict[str, Any] = {
            "warmup_steps": warmup,
            "total_steps": int(total_optimizer_steps),
            "style": str(optim.warmup_style),
            "min_lr_ratio": float(optim.min_lr_ratio),
            "hold_steps": int(float(optim.lr_hold_ratio) * total_optimizer_steps),
        }
        self.lr_lambda = build_lr_lambda(
            warmup,
            total_optimizer_steps,
            self.lr_schedule["style"],
            self.lr_schedule["min_lr_ratio"],
            self.lr_schedule["hold_steps"],
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.lr_lambda)
        setattr(self.scheduler, LR_SCHEDULE_ATTR, dict(self.lr_schedule))  # saved by state_dict()

    def keep_optimizer_implementation(self) -> None:
        """After ``optimizer.load_state_dict``: use this run's AdamW kernel and settings, not the checkpoint's.

        torch restores every param-group option from the saved state (``betas``, ``eps``,
        ``weight_decay``, ``fused`` and ``foreach`` included), so a checkpoint written with other
        settings (or before ``optim.fused`` existed) would silently keep them on resume. This puts the
        configured ``betas``, ``eps`` and ``weight_decay`` (:attr:`optimizer_settings`) and the kernel choice
        back, and places each ``step`` counter where that kernel wants it (a float32 tensor on the
        parameter's device for the fused kernel, on the CPU otherwise), as torch does at load time.
        The moment estimates are kept; AdamW reads the settings from the parameter group at every step,
        so they hold from the first resumed step. The learning rate is the scheduler's business
        (:meth:`load_scheduler_state`). An unchanged config leaves every value as saved (bitwise resume).
        """
        for group in self.optimizer.param_groups:
            group.update(self.optimizer_settings)
            group["fused"] = self.fused or None
            group["foreach"] = None
            for p in group["params"]:
                state = self.optimizer.state.get(p)
                if state and torch.is_tensor(state.get("step")):
                    device = p.device if self.fused else torch.device("cpu")
                    state["step"] = state["step"].to(device=device, dtype=torch.float32)

    def load_scheduler_state(self, state: Mapping[str, Any], *, optimizer_restored: bool = True) -> None:
        """Restore the LR scheduler from a checkpoint's ``state`` (``scheduler.state_dict()``): its base rates
        (every ``trainer.alerts`` ``scale_lr`` factor is in them) and its step count.

        The schedule's shape (:attr:`lr_schedule`: warmup, length in optimizer steps, style, floor, hold) is
        this run's config's, never the checkpoint's. When it differs from the shape the checkpoint recorded (a
        changed ``optim.warmup_style``, ``lr_warmup_steps``, ``min_lr_ratio``, ``trainer.total_training_steps``
        ...), or when the optimizer's parameter groups were not restored (``optimizer_restored=False``: they
        still hold this run's initial rate), the current rates are recomputed (:meth:`refresh_lr`), so that
        the new schedule holds from the first resumed optimizer step on. Otherwise the saved rates stay
        exactly as they were (a resume with an unchanged config is bitwise exact). A checkpoint written
        before the shape was recorded keeps its rates until the next scheduler step."""
        self.scheduler.load_state_dict(dict(state))
        saved = getattr(self.scheduler, LR_SCHEDULE_ATTR, None)
        setattr(self.scheduler, LR_SCHEDULE_ATTR, dict(self.lr_schedule))
        if not optimizer_restored or (saved is not None and dict(saved) != self.lr_schedule):
            self.refresh_lr()

    def refresh_lr(self) -> None:
        """Set each parameter group's rate to its base rate times the schedule's multiplier at the current
        optimizer step, ``base_lr * lr_lambda(last_epoch)``: what ``LambdaLR`` computes at each of its steps."""
        step = int(self.scheduler.last_epoch)  # type: ignore[attr-defined]
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs):  # type: ignore[attr-defined]
            group["lr"] = float(base) * self.lr_lambda(step)
        self.scheduler._last_lr = [float(g["lr"]) for g in self.optimizer.param_groups]  # type: ignore[attr-defined]

    @property
    def lr_multiplier(self) -> float:
        """The schedule's multiplier at the current optimizer step (:func:`build_lr_lambda` of ``last_epoch``)."""
        return float(self.lr_lambda(int(self.scheduler.last_epoch)))  # type: ignore[attr-defined]

    @property
    def lr(self) -> float:
        """The current learning rate of the first parameter group."""
        return float(self.optimizer.param_groups[0]["lr"])


class TorchDistributedCoordinator:
    """The :class:`rlplug.contracts.types.Coordinator` of a ``torch.distributed`` process group.

    ``world_size`` and ``rank`` of the group; ``is_main``: rank 0. :meth:`broadcast` and :meth:`all_gather` are
    collectives: every rank must call them, in the same order.
    """

    def __init__(self, world_size: int, rank: int) -> None:
        self.world_size = int(world_size)
        self.rank = int(rank)
        self.is_main = self.rank == 0

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` (any picklable object) on every rank (``dist.broadcast_object_list``)."""
        if self.world_size == 1:
            return obj
        import torch.distributed as dist  # deferred: torch (torch.distributed, only with several ranks)

        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order, on every rank (``dist.all_gather_object``); a collective."""
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist  # deferred: torch (torch.distributed, only with several ranks)

        box: list[Any] = [None] * self.world_size
        dist.all_gather_object(box, obj)
        return box

    def __repr__(self) -> str:
        return f"TorchDistributedCoordinator(world_size={self.world_size}, rank={self.rank})"


# ============================================================================ the base backend


class TrainingBackendBase:
    """A complete training backend for one process; subclass it for other placements.

    Implements :class:`rlplug.contracts.types.TrainingBackend` (the ``local`` plugin registers it as it is).

    Args:
        config: the whole run config (``DictConfig`` of :class:`rlplug.config.schema.RunConfig`).
        model_path: local Hugging Face folder of the initial policy (``rlplug.training.models.resolve_model_path``).
        use_critic: build and train a critic (:class:`rlplug.training.models.ValueModel` from ``critic.model``, by
            default the same folder: :func:`rlplug.training.models.resolve_critic_model_path`).
        use_ref: build the reference model (frozen copy of the initial actor) for KL terms.
        total_steps: planned training steps; with ``ppo_epochs`` and the mini-batches per step it
            fixes the length of the learning-rate schedule (in optimizer steps).
        run: the :class:`rlplug.base.run_context.RunContext` the trainer builds the backend with (run directory,
            step of the checkpoint it resumes from), kept as :attr:`run`; None outside a run (tests, scripts).

    Class attributes:
        backend_name: the name in messages (``"local"``, ``"fsdp2"``).
        log: the logger warnings go to (each plugin passes its own module's logger).
        coordinator: :data:`rlplug.contracts.coordinator.SINGLE_PROCESS` (multi-process subclasses set their own).
        capabilities: ``{"reuses_on_policy_log_probs", "policy_loss_minibatch_stats", "scale_lr", "apply_phase"}``:
            :meth:`update_actor` accepts an on-policy batch without ``old_log_probs`` (the trainer
            then skips the old-log-prob pass), calls the policy loss's ``minibatch_stats`` once
            per mini-batch (:func:`minibatch_stats_batch`), :meth:`scale_lr` scales a role's
            learning rate (the ``trainer.alerts`` action), and :meth:`apply_phase` takes another
            phase's actor and critic settings (``algorithm.schedule``, ``rollout.n_schedule``); ``"lora"``:
            ``model.lora_rank`` / ``critic.model.lora_rank`` train peft adapters (:mod:`rlplug.training.lora`).
        per_token_outputs: ``{"entropy", "sum_pi_squared"}``: what :meth:`compute_log_probs` can return.
        metrics: the update metrics :meth:`update_actor` / :meth:`update_critic` log (the names
            ``trainer.alerts`` rules may watch, :func:`rlplug.run.alerts.declared_metrics`).

    Attributes:
        run: the ``run`` argument (:class:`rlplug.base.run_context.RunContext` or None).
        consecutive_bad_steps: optimizer steps skipped in a row because of a non-finite loss or
            gradient norm (the larger of the actor's and the critic's count); reset by a good step.
        actor, critic: :class:`Role` (``critic`` ``None`` without ``use_critic``); ``ref``: the
            reference model or ``None`` (always ``None`` with LoRA: the reference is the actor with its
            adapters off); ``policy_loss`` / ``kl_loss``: the resolved plugins; ``lora`` / ``critic_lora``:
            the :class:`rlplug.training.lora.LoraSettings` of the actor / critic, ``None`` when they train every weight.

    Raises ``ValueError`` for settings this backend cannot honour (unknown ``compute_dtype`` or
    device, ``rollout.temperature <= 0``).
    """

    backend_name: str = "local"
    log: logging.Logger = logger
    coordinator: Any = SINGLE_PROCESS
    capabilities: frozenset[str] = frozenset(
        {"reuses_on_policy_log_probs", "policy_loss_minibatch_stats", "scale_lr", "apply_phase", "lora"}
    )
    per_token_outputs: frozenset[str] = frozenset({"entropy", "sum_pi_squared"})
    metrics: tuple[str, ...] = (
        *(f"actor/{k}" for k in ("pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "entropy", "kl_loss")),
        *(f"actor/{k}" for k in ("kl_coef", "rollout_is_weight", "grad_norm", "lr", "nonfinite_skipped")),
        *(f"critic/{k}" for k in ("vf_loss", "vf_clipfrac", "grad_norm", "lr", "nonfinite_skipped")),
    )

    def __init__(
        self,
        config: Any,
        model_path: str,
        *,
        use_critic: bool,
        use_ref: bool,
        total_steps: int,
        run: RunContext | None = None,
    ) -> None:
        self.run = run
        self.config = config
        self.model_path = str(model_path)
        self.use_critic = bool(use_critic)
        # critic.model: checked (folder, tokenizer) before any weights load; the actor's folder when unset
        self.critic_model_path = models.resolve_critic_model_path(config, self.model_path) if self.use_critic else None
        self.use_ref = bool(use_ref)
        self.total_steps = int(total_steps)
        trainer = typed(TrainerConfig, config.trainer)
        model_cfg = typed(ModelConfig, config.model)
        actor_cfg = typed(ActorConfig, config.actor)
        critic_cfg = typed(CriticConfig, config.critic)
        rollout, data = typed(RolloutConfig, config.rollout), typed(DataConfig, config.data)

        # ---- device, threads, precision
        self.device = self._training_device()
        if self.device.type == "cpu" and bool(trainer.malloc_keep_freed):
            keep_freed_memory()
        threads = trainer.num_threads
        if threads:
            torch.set_num_threads(int(threads))
        compute_dtype = str(model_cfg.compute_dtype)
        if compute_dtype not in ("auto", "bf16", "fp32"):
            raise ValueError(f"model.compute_dtype must be 'auto', 'bf16' or 'fp32', got {compute_dtype!r}.")
        requested, compute_dtype = compute_dtype, resolve_dtype(compute_dtype, self.device, "model.compute_dtype")
        self.log.info("computing in %s on %s (model.compute_dtype=%s)", compute_dtype, self.device, requested)
        self.autocast_dtype: torch.dtype | None = None
        if compute_dtype == "bf16":
            if self._bf16_autocast_works():
                self.autocast_dtype = torch.bfloat16
            else:
                self.log.warning("bf16 autocast is not available on %s; computing in fp32.", self.device)

        self.temperature = float(rollout.temperature)
        if not self.temperature > 0:
            raise ValueError(
                f"rollout.temperature={self.temperature}: training needs sampled responses (temperature > 0); "
                "log-probs of greedy decoding are undefined."
            )
        self.chunk_size = int(actor_cfg.logprob_chunk_size)
        self.max_response_length = int(data.max_response_length) or None
        n = int(rollout.n)
        minis_per_step = max(1, int(data.train_batch_size) // int(actor_cfg.ppo_mini_batch_size))
        trust = bool(model_cfg.trust_remote_code)
        grad_ckpt = bool(model_cfg.enable_gradient_checkpointing)
        seed = int(trainer.seed)
        # ---- LoRA (rlplug.training.lora): settings and target modules checked before any weights load
        self.lora = lora.lora_settings(model_cfg)
        self.critic_lora = lora.lora_settings(critic_cfg.model, "critic.model") if self.use_critic else None
        if (self.lora or self.critic_lora) and lora.LORA_CAPABILITY not in self.capabilities:
            raise ValueError(f"The {self.backend_name} training backend does not support LoRA; use trainer=local.")
        if self.lora is not None:
            lora.check_target_modules(self.lora, self.model_path, trust_remote_code=trust)
        if self.critic_lora is not None:
            lora.check_target_modules(
                self.critic_lora, str(self.critic_model_path), trust_remote_code=trust, value_model=True
            )

        self.attn_implementation = self._resolve_attention(config)
        self._attention_explicit = str(model_cfg.attn_implementation or "auto") != "auto"
        # ---- actor
        actor: Any = models.load_causal_lm(self.model_path, dtype=torch.float32, trust_remote_code=trust)
        self._set_attention(actor)
        if getattr(actor.config, "use_cache", None) is not None:
            actor.config.use_cache = False
        if grad_ckpt:
            actor.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self._warn_dropout(actor)
        if self.lora is not None:  # the adapters train, the base weights are frozen
            actor = lora.apply_lora(actor, self.lora, seed=seed)
        actor = self._prepare_model(actor, "actor")
        compile_actor = bool(actor_cfg.use_torch_compile)
        compile_critic_setting = critic_cfg.use_torch_compile
        if not self.supports_torch_compile and (compile_actor or compile_critic_setting):
            self.log.warning(
                "actor.use_torch_compile / critic.use_torch_compile: the %s backend runs its layers uncompiled "
                "(compiling sharded layers is not tested here); the setting is ignored.",
                self.backend_name,
            )
            compile_actor, compile_critic_setting = False, False
        if compile_actor:
            compile_decoder_layers(actor, "actor")
        actor_epochs = int(actor_cfg.ppo_epochs)
        self.actor = Role(
            "actor",
            actor,
            actor_cfg.optim,
            mini_batch=int(actor_cfg.ppo_mini_batch_size) * n,
            micro_batch=int(actor_cfg.micro_batch_size_per_device),
            epochs=actor_epochs,
            loss_agg_mode=str(actor_cfg.loss_agg_mode),
            grad_clip=actor_cfg.grad_clip,
            total_optimizer_steps=max(1, self.total_steps * actor_epochs * minis_per_step),
        )
        registry = get_registry()
        self.policy_loss = registry.get("policy_loss", str(actor_cfg.policy_loss))
        self.kl_loss = registry.get("kl_penalty", str(actor_cfg.kl_loss_type)) if actor_cfg.use_kl_loss else None

        # ---- reference model (with LoRA: the actor with its adapters switched off, no second copy)
        self.ref: torch.nn.Module | None = None
        if self.use_ref and self.lora is None:
            ref = models.load_causal_lm(self.model_path, dtype=torch.float32, trust_remote_code=trust)
            self._set_attention(ref)
            ref.requires_grad_(False)
            self.ref = self._prepare_model(ref, "ref").eval()
            if compile_actor:
                compile_decoder_layers(self.ref, "ref")

        # ---- critic
        self.critic: Role | None = None
        if self.use_critic:
            critic: Any = models.load_value_model(
                str(self.critic_model_path), dtype=torch.float32, trust_remote_code=trust
            )
            self._set_attention(critic.backbone)
            if grad_ckpt:
                critic.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if self.critic_lora is not None:  # adapters on the backbone; the value head trains fully
                critic.backbone = lora.apply_lora(critic.backbone, self.critic_lora, seed=seed, task_type=None)
            critic = self._prepare_model(critic, "critic")
            if compile_actor if compile_critic_setting is None else bool(compile_critic_setting):
                compile_decoder_layers(critic, "critic")
            # the critic's unset (None) sizes and loss aggregation follow the actor's, as verl's critic defaults
            c_mini = int(_or(critic_cfg.ppo_mini_batch_size, actor_cfg.ppo_mini_batch_size))
            c_epochs = int(_or(critic_cfg.ppo_epochs, actor_epochs))
            c_minis_per_step = max(1, int(data.train_batch_size) // c_mini)
            self.critic = Role(
                "critic",
                critic,
                critic_cfg.optim,
                mini_batch=c_mini * n,
                micro_batch=int(_or(critic_cfg.micro_batch_size_per_device, actor_cfg.micro_batch_size_per_device)),
                epochs=c_epochs,
                loss_agg_mode=str(_or(critic_cfg.loss_agg_mode, actor_cfg.loss_agg_mode)),
                grad_clip=critic_cfg.grad_clip,
                total_optimizer_steps=max(1, self.total_steps * c_epochs * c_minis_per_step),
            )
        self._set_token_budgets(config)

    def _set_token_budgets(self, config: Any) -> None:
        """``use_dynamic_bsz``: the token budget of each pass (:func:`rlplug.algorithms.token_budget.token_budgets`)."""
        self.budgets = token_budgets(config)
        self.actor.token_budget = self.budgets["actor"]
        if self.critic is not None:
            self.critic.token_budget = self.budgets["critic"]

    # ------------------------------------------------------------------ hooks for subclasses
    # Data-parallel backends (``fsdp2``) override these; everything else (the update loop,
    # inference, metrics) is shared. Here: one process that holds every row.
    def _training_device(self) -> torch.device:
        """The device the models train on (from ``trainer.device``)."""
        return torch.device(resolve_device(self.config.trainer, self.backend_name))

    def _check_same_batch(self, batch: Batch, what: str) -> None:
        """Fail when the processes were not given the same batch; nothing to check in one process."""

    def _rank_rows(self, batch: Batch, keys: tuple[str, ...]) -> Batch:
        """The rows of ``batch`` (tensors ``keys`` at least) this process computes at inference: all."""
        return batch

    def _gather_rows(self, local: torch.Tensor, size: int, out_device: torch.device) -> torch.Tensor:
        """Every process's ``local`` rows together (the first ``size``), on ``out_device``."""
        return local[:size].to(out_device)

    def _rank_slice(self, mini: Batch, role: Role) -> Batch:
        """This process's share of a training mini-batch: all of it."""
        return mini

    def _all_reduce(self, values: list[float]) -> list[float]:
        """Sums of ``values`` over the processes: the values themselves."""
        return list(values)

    def _release(self, model: torch.nn.Module) -> None:
        """Free what a forward/backward of ``model`` gathered (sharded parameters); nothing here."""

    # ------------------------------------------------------------------ small helpers
    def _prepare_model(self, model: torch.nn.Module, role: str) -> torch.nn.Module:
        """Place a freshly loaded model (``role``: ``"actor"``, ``"ref"`` or ``"critic"``) for
        training; its optimizer is built on the returned module's parameters. Here: move it to
        ``self.device``. Subclasses override it (the ``fsdp2`` backend shards the model)."""
        return model.to(self.device)

    #: whether ``actor.use_torch_compile`` / ``critic.use_torch_compile`` compile this backend's decoder
    #: layers (:func:`compile_decoder_layers`); a backend that sets False ignores them with a warning
    supports_torch_compile = True

    #: the longest prompt + response for which ``model.attn_implementation=auto`` picks eager attention on
    #: a CPU: eager keeps a (B, heads, L, L) float32 score tensor per layer, which grows with L squared
    EAGER_ATTENTION_MAX_TOKENS = 512

    def _resolve_attention(self, config: Any) -> str | None:
        """``model.attn_implementation`` -> the name to set, or None (keep the model's default).

        ``auto``: ``"eager"`` on a CPU when ``data.max_prompt_length + data.max_response_length <=``
        :attr:`EAGER_ATTENTION_MAX_TOKENS` (on the 2-core machine, eager took 2.11 s against sdpa's
        2.38 s for the forward + backward of an 8 x 202-token SmolLM2 micro-batch, and 3.99 s
        against 4.21 s at 4 x 592 tokens), else None."""
        name = str(typed(ModelConfig, config.model).attn_implementation or "auto")
        if name != "auto":
            return name
        data = typed(DataConfig, config.data)
        tokens = int(data.max_prompt_length or 0) + int(data.max_response_length or 0)
        if self.device.type == "cpu" and 0 < tokens <= self.EAGER_ATTENTION_MAX_TOKENS:
            return "eager"
        return None

    def _set_attention(self, model: Any) -> None:
        """Switch a transformers model to :attr:`attn_implementation` (nothing when None; with ``auto``,
        nothing either for a model that cannot switch).

        Raises ValueError naming ``model.attn_implementation`` when transformers refuses the name, or
        when an explicit name is set for a model without ``set_attn_implementation``."""
        name = self.attn_implementation
        if name is None:
            return
        if not hasattr(model, "set_attn_implementation"):
            if self._attention_explicit:
                raise ValueError(
                    f"model.attn_implementation={name!r}: the {type(model).__name__} model cannot switch its "
                    "attention kernel (no set_attn_implementation; transformers too old or a custom model). "
                    "Use model.attn_implementation=auto."
                )
            return
        try:
            model.set_attn_implementation(name)
        except (ValueError, ImportError) as exc:
            raise ValueError(
                f"model.attn_implementation={name!r} is not usable with this model: {exc} Use auto, eager or sdpa."
            ) from exc

    def _bf16_autocast_works(self) -> bool:
        try:
            with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16):
                a = torch.ones(2, 2, device=self.device)
                return (a @ a).dtype == torch.bfloat16
        except (RuntimeError, AssertionError, ValueError):
            return False

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def _warn_dropout(self, model: torch.nn.Module) -> None:
        ps = [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
        ps += [
            float(v) for k, v in vars(model.config).items() if "dropout" in k and isinstance(v, (int, float)) and v > 0
        ]
        if ps:
            self.log.warning(
                "The actor has dropout (p up to %.3g): log-probs are computed in eval mode and the update in "
                "train mode, so the PPO ratio starts away from 1. Set the model's dropout to 0 for RL.",
                max(ps),
            )

    def scale_lr(self, role: str, factor: float) -> float:
        """Multiply ``role``'s (``"actor"`` or ``"critic"``) learning rate by ``factor`` from the next optimizer
        step on, for the rest of the schedule: the schedule's base rates and the current rates are scaled, and
        both are in the optimizer and scheduler checkpoint. Returns the new current rate. Used by the alert
        action ``scale_lr`` (:mod:`rlplug.run.alerts`), by a phase change of ``algorithm.schedule`` and by a resume
        with another ``<role>.optim.lr`` (the ratio of the new rate to the checkpoint's, :func:`rlplug.run.resume.
        apply_resume_changes`). Raises ``ValueError`` for a role this backend does not train."""
        r = {"actor": self.actor, "critic": self.critic}.get(role)
        if r is None:
            roles = "actor, critic" if self.critic else "actor"
            raise ValueError(f"scale_lr: this backend trains no {role!r} (roles: {roles}).")
        r.scheduler.base_lrs = [float(b) * factor for b in r.scheduler.base_lrs]  # type: ignore[attr-defined]
        for group in r.optimizer.param_groups:
            group["lr"] = float(group["lr"]) * factor
        r.scheduler._last_lr = [float(g["lr"]) for g in r.optimizer.param_groups]  # type: ignore[attr-defined]
        return r.lr

    def apply_phase(self, config: Any) -> None:
        """Train with the actor and critic settings of ``config`` from the next call on: the whole run config
        of a phase of ``algorithm.schedule``, or of a step's ``rollout.n`` under ``rollout.n_schedule``
        (:mod:`rlplug.run.schedule`, which checked it at config time).

        ``config`` becomes :attr:`config`, which the updates read (``actor.*``: clip ratios, KL-loss and entropy
        coefficients ...; ``critic.*``: value clip, loss type); the policy loss and the KL-loss estimator are
        resolved again; each role's mini-batch (``ppo_mini_batch_size x rollout.n`` responses), micro-batch,
        loss aggregation and gradient clip follow it. Models, optimizer states and learning-rate schedules are
        kept (the schedule changes a learning rate with :meth:`scale_lr`). Raises ``ValueError`` when the phase
        uses a KL loss but this backend was built without the reference model (``use_ref=False``)."""
        a, registry = typed(ActorConfig, config.actor), get_registry()
        if a.use_kl_loss and self.ref is None and self.lora is None:
            raise ValueError(
                "apply_phase: the phase sets actor.use_kl_loss=true, but this backend was built without the "
                "reference model (use_ref=False). Build it for the run (the trainer does when any phase uses KL)."
            )
        self.config = config
        self.policy_loss = registry.get("policy_loss", str(a.policy_loss))
        self.kl_loss = registry.get("kl_penalty", str(a.kl_loss_type)) if a.use_kl_loss else None
        n = int(typed(RolloutConfig, config.rollout).n)
        self.actor.mini_batch = int(a.ppo_mini_batch_size) * n
        self.actor.micro_batch = int(a.micro_batch_size_per_device)
        self.actor.loss_agg_mode = str(a.loss_agg_mode)
        self.actor.grad_clip = a.grad_clip
        if self.critic is not None:
            c = typed(CriticConfig, config.critic)
            self.critic.mini_batch = int(_or(c.ppo_mini_batch_size, a.ppo_mini_batch_size)) * n
            self.critic.micro_batch = int(_or(c.micro_batch_size_per_device, a.micro_batch_size_per_device))
            self.critic.loss_agg_mode = str(_or(c.loss_agg_mode, a.loss_agg_mode))
            self.critic.grad_clip = c.grad_clip
        self._set_token_budgets(config)

    @property
    def consecutive_bad_steps(self) -> int:
        """Optimizer steps skipped in a row (non-finite loss or gradient norm), the larger of the
        actor's and the critic's count; a good step resets it."""
        return max(self.actor.consecutive_bad_steps, self.critic.consecutive_bad_steps if self.critic else 0)

    def _to_device(self, batch: Batch, keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
        return {k: batch.tensors[k].to(self.device, non_blocking=True) for k in keys if k in batch.tensors}

    @staticmethod
    def _response_length(batch: Batch) -> int:
        for key in ("responses", "response_mask"):
            if key in batch.tensors:
                return int(batch.tensors[key].shape[1])
        raise ValueError(
            f"the batch has neither 'responses' nor 'response_mask', so the response length is unknown. "
            f"Present: {sorted(batch.tensors)}."
        )

    def _forward_log_probs(
        self,
        model: torch.nn.Module,
        tensors: dict[str, torch.Tensor],
        t: int,
        with_entropy: bool,
        extras: tuple[str, ...] = (),
    ) -> dict[str, torch.Tensor]:
        """``model``'s per-token outputs on one micro-batch already on the device:
        :func:`rlplug.algorithms.logprob.response_token_stats` (``log_probs``, ``entropy`` with
        ``with_entropy``, the ``extras``; ``(B, T) float32``) under the backend's autocast."""
        with self._autocast():
            return response_token_stats(
                model,
                tensors,
                t,
                temperature=self.temperature,
                chunk_size=self.chunk_size,
                with_entropy=with_entropy,
                extras=extras,
            )

    def _values(self, model: torch.nn.Module, tensors: dict[str, torch.Tensor], t: int) -> torch.Tensor:
        trimmed, kept = trim_padding_columns(tensors, t)  # columns that are padding in every row are skipped
        with self._autocast():
            values = model(trimmed["input_ids"], trimmed.get("attention_mask"), trimmed.get("position_ids"))  # (B, L')
        length = values.shape[1]
        # the value at position p is read after token p, i.e. where token p+1 is predicted (verl)
        values = values[:, length - kept - 1 : length - 1].float()
        if "attention_mask" in trimmed:  # 0.0 after the end of each response, as the log-probs
            values = values * trimmed["attention_mask"][:, length - kept :].to(values.dtype)
        return torch.nn.functional.pad(values, (0, t - kept)) if kept < t else values

    @staticmethod
    def _micro_batches(batch: Batch, size: int, budget: int | None = None) -> tuple[list[Batch], torch.Tensor | None]:
        """Micro-batches of ``size`` rows taken in order of sequence length, and that order.

        Rows of similar length share a micro-batch, so each micro-batch's forward runs on fewer
        padding columns (:func:`rlplug.algorithms.logprob.trim_padding_columns`). Results do not depend on
        the grouping (losses use the whole mini-batch's normaliser); ``order[i]`` is the batch row
        at sorted position ``i`` (a stable sort, so the same batch always splits the same way), or
        ``None`` when one micro-batch holds the whole batch (nothing is reordered or copied).
        With a token ``budget`` (``use_dynamic_bsz``) the micro-batches are instead packed to at
        most ``budget`` padded tokens each (:func:`rlplug.algorithms.token_budget.pack_rows`; ``size`` unused).
        """
        if budget is not None:
            t = int(batch.tensors["responses" if "responses" in batch.tensors else "response_mask"].shape[1])
            order, sizes = pack_rows(*row_lengths(batch.tensors["attention_mask"], t), int(budget))
            if len(sizes) == 1:
                return [batch], None
            return list(batch.select(order).split_sizes(sizes)), order
        if len(batch) <= size:
            return [batch], None
        lengths = batch.tensors["attention_mask"].sum(dim=1)
        order = torch.sort(lengths.cpu(), stable=True).indices
        return list(batch.select(order).split(size)), order

    @staticmethod
    def _unsort(rows: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
        """``rows`` computed in :meth:`_micro_batches` order, put back in the batch's row order."""
        if order is None:
            return rows
        out = torch.empty_like(rows)
        out[order.to(rows.device)] = rows
        return out

    # ------------------------------------------------------------------ inference
    def _check_inference_batch(self, batch: Batch, what: str) -> tuple[int, torch.device]:
        """Check a batch for ``what`` (sequence tensors present, not empty, the same in every
        process); returns the response length ``T`` and the batch's device."""
        check_batch_fields(batch, SEQUENCE_FIELDS, what)
        if len(batch) == 0:
            raise ValueError(f"{what}: the batch is empty.")
        self._check_same_batch(batch, what)
        return self._response_length(batch), batch.tensors["input_ids"].device

    @torch.no_grad()
    def compute_log_probs(
        self, batch: Batch, *, which: str = "actor", with_entropy: bool = False, extras: tuple[str, ...] = ()
    ) -> dict[str, torch.Tensor]:
        """Log-probs of the response tokens under the actor or the reference model (no grad).

        ``batch`` needs ``input_ids``, ``attention_mask``, ``position_ids`` ``(B, P+T)`` and
        ``responses`` ``(B, T)``. Returns ``{"log_probs": (B, T) float32}`` (nats, of
        ``logits / rollout.temperature``) plus ``"entropy"`` ``(B, T) float32`` (nats) when
        ``with_entropy``, and ``(B, T) float32`` for each name in ``extras`` (of
        :attr:`per_token_outputs`: ``"entropy"``, ``"sum_pi_squared"`` = ``sum_v p_v^2`` of
        ``p = softmax(logits / rollout.temperature)``), on the batch's device, all from one chunked
        pass (:func:`rlplug.algorithms.logprob.response_token_stats`; the ``(B, T, V)`` logits never exist at
        once). Positions after the end of a response hold 0.0 (not computed); multiply by
        ``response_mask`` (or use masked statistics) downstream. Micro-batched by
        ``actor.micro_batch_size_per_device``, rows grouped by length.

        Raises ``ValueError`` for an unknown ``which`` or extra (the message lists the valid ones),
        ``which="ref"`` without a reference model, a missing tensor or an empty batch. With LoRA
        (``model.lora_rank > 0``) the reference is the actor with its adapters switched off (peft's
        ``disable_adapter()``): the base model's log-probs, exactly, from the one copy of its weights.
        """
        adapters_off: contextlib.AbstractContextManager = contextlib.nullcontext()
        if which == "actor":
            model = self.actor.model
        elif which == "ref":
            if self.ref is None and self.lora is None:
                raise ValueError("compute_log_probs(which='ref') but this backend was built with use_ref=False.")
            model = self.ref if self.ref is not None else self.actor.model
            if self.ref is None:
                adapters_off = cast(Any, self.actor.model).disable_adapter()  # a peft model
        else:
            raise ValueError(f"compute_log_probs: which must be 'actor' or 'ref', got {which!r}.")
        extras = self._check_extras(extras)
        t, out_device = self._check_inference_batch(batch, "compute_log_probs")
        names = tuple(dict.fromkeys((*(("entropy",) if with_entropy else ()), *extras)))
        model.eval()
        rows: dict[str, list[torch.Tensor]] = {"log_probs": [], **{name: [] for name in names}}
        micros, order = self._micro_batches(
            self._rank_rows(batch, SEQUENCE_FIELDS), self.actor.micro_batch, self.budgets["log_prob"]
        )
        with adapters_off:
            for micro in micros:
                out = self._forward_log_probs(
                    model,
                    self._to_device(micro, SEQUENCE_FIELDS),
                    t,
                    "entropy" in names,
                    tuple(e for e in extras if e != "entropy"),
                )
                for name in rows:
                    rows[name].append(out[name].float())
        self._release(model)
        return {
            name: self._gather_rows(self._unsort(torch.cat(parts), order), len(batch), out_device)
            for name, parts in rows.items()
        }

    def _check_extras(self, extras: Any) -> tuple[str, ...]:
        """``extras`` as a tuple; ``ValueError`` naming the valid names for an unknown one (a
        string is taken as one name)."""
        if isinstance(extras, str):
            extras = (extras,)
        valid = [q for q in PER_TOKEN_QUANTITIES if q in self.per_token_outputs]
        extras = tuple(dict.fromkeys(str(e) for e in extras))
        unknown = [e for e in extras if e not in valid]
        if unknown:
            raise ValueError(
                f"compute_log_probs: unknown per-token quantit{'y' if len(unknown) == 1 else 'ies'} {unknown} in "
                f"extras; the {self.backend_name} backend computes {valid}."
            )
        return extras

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> torch.Tensor:
        """Critic values ``(B, T) float32`` (no grad), on the batch's device.

        ``values[:, j]`` is the critic's output at the hidden position that predicts response
        token ``j`` (positions ``P - 1 .. P + T - 2``, as verl); 0.0 after the end of each
        response (see :meth:`compute_log_probs`). Raises ``ValueError`` when the backend has no critic, for a
        missing tensor or an empty batch.
        """
        if self.critic is None:
            raise ValueError("compute_values called but this backend was built with use_critic=False.")
        t, out_device = self._check_inference_batch(batch, "compute_values")
        model = self.critic.model
        model.eval()
        micros, order = self._micro_batches(
            self._rank_rows(batch, SEQUENCE_FIELDS), self.critic.micro_batch, self.budgets["values"]
        )
        vals = [self._values(model, self._to_device(m, SEQUENCE_FIELDS), t) for m in micros]
        self._release(model)
        return self._gather_rows(self._unsort(torch.cat(vals), order), len(batch), out_device)

    # ------------------------------------------------------------------ updates
    def _run_update(
        self,
        role: Role,
        batch: Batch,
        micro_loss: Callable[[dict[str, torch.Tensor], float], tuple[torch.Tensor, dict[str, float]]],
        mini_stats: Callable[[Batch, int, int], Batch] | None = None,
    ) -> dict[str, float]:
        """The shared epoch / mini-batch / micro-batch loop.

        ``micro_loss(tensors, normalizer)`` returns this micro-batch's contribution to the
        mini-batch loss (to backpropagate) and metrics already summed-compatible: loss terms as
        contributions (their sum over micro-batches is the mini-batch value) and masked means of
        the micro-batch (weighted here by its share of valid tokens). ``mini_stats(mini, epoch,
        index)`` (or ``None``) returns the WHOLE mini-batch with extra per-row tensors (a policy
        loss's ``minibatch_stats``); it runs on every process before the rank slice, so the rows
        of each process and micro-batch carry the global mini-batch's statistics.
        Returns the mean of each metric over the good mini-batches of all epochs, plus
        ``grad_norm``, ``lr`` and ``nonfinite_skipped`` (count), prefixed ``<role>/``.

        Data-parallel subclasses run the same loop through the hooks: each process takes its
        :meth:`_rank_slice` of every mini-batch, and the normaliser, the non-finite-loss flags
        and the metric sums go through :meth:`_all_reduce`, so every process decides alike.
        """
        size = len(batch)
        if size == 0:
            raise ValueError(f"update_{role.name}: the batch is empty.")
        if size % role.mini_batch:
            raise ValueError(
                f"update_{role.name}: the batch has {size} responses, which does not split into mini-batches of "
                f"{role.mini_batch} responses ({role.name}.ppo_mini_batch_size x rollout.n). Choose "
                f"data.train_batch_size as a multiple of {role.name}.ppo_mini_batch_size."
            )
        self._check_same_batch(batch, f"update_{role.name}")
        role.model.train()
        totals: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        skipped = 0
        lrs: list[float] = []
        for epoch in range(role.epochs):
            for index, mini in enumerate(batch.split(role.mini_batch)):
                local = self._rank_slice(mini, role)
                local_mask = local.tensors["response_mask"]
                # normaliser and token count of the WHOLE mini-batch (summed over the processes)
                normalizer, valid_tokens = self._all_reduce(
                    [agg_normalizer(local_mask, role.loss_agg_mode), float(local_mask.sum())]
                )
                lrs.append(role.lr)
                if normalizer <= 0:
                    self.log.warning(
                        "%s: mini-batch %d of epoch %d has no valid response token; no optimizer step.",
                        role.name,
                        index,
                        epoch,
                    )
                    self._scheduler_step(role)
                    continue
                if mini_stats is not None:  # statistics of the whole (global) mini-batch, then this rank's rows
                    local = self._rank_slice(mini_stats(mini, epoch, index), role)
                role.optimizer.zero_grad(set_to_none=True)
                mini_metrics: dict[str, float] = defaultdict(float)
                bad_stage: str | None = None
                for micro in self._micro_batches(local, role.micro_batch, role.token_budget)[0]:
                    tensors = self._to_device(micro, tuple(micro.tensors))
                    loss, parts = micro_loss(tensors, normalizer)
                    loss_value = float(loss.detach())
                    # decided together: a process that skipped backward alone would hang the others
                    (n_bad,) = self._all_reduce([0.0 if math.isfinite(loss_value) else 1.0])
                    if n_bad:
                        here_only = n_bad == 1 and not math.isfinite(loss_value)
                        bad_stage = (
                            f"{role.name} loss ({loss_value})"
                            if here_only
                            else (f"{role.name} loss (non-finite on {int(n_bad)} rank(s); here {loss_value})")
                        )
                        break
                    loss.backward()
                    share = float(micro.tensors["response_mask"].sum()) / valid_tokens if valid_tokens else 0.0
                    for key, value in parts.items():
                        if key.startswith("mean:"):
                            mini_metrics[key[5:]] += value * share
                        else:
                            mini_metrics[key] += value
                grad_norm = float("nan")
                if bad_stage is None:
                    grad_norm = self._clip_grad(role)  # global norm: the same in every process
                    if not math.isfinite(grad_norm):
                        bad_stage = f"{role.name} gradient norm ({grad_norm})"
                if bad_stage is not None:
                    role.optimizer.zero_grad(set_to_none=True)
                    self._release(role.model)
                    skipped += 1
                    role.consecutive_bad_steps += 1
                    self.log.warning(
                        "%s: non-finite %s in mini-batch %d of epoch %d; optimizer step skipped (%d in a row).",
                        role.name,
                        bad_stage,
                        index,
                        epoch,
                        role.consecutive_bad_steps,
                    )
                else:
                    role.optimizer.step()
                    role.consecutive_bad_steps = 0
                    keys = sorted(mini_metrics)  # the same keys in every process
                    for key, value in zip(keys, self._all_reduce([mini_metrics[k] for k in keys])):
                        totals[key] += value
                        counts[key] += 1
                    totals["grad_norm"] += grad_norm
                    counts["grad_norm"] += 1
                self._scheduler_step(role)
        role.optimizer.zero_grad(set_to_none=True)
        role.model.eval()
        prefix = role.name + "/"
        metrics = {prefix + k: (totals[k] / counts[k]) for k in totals}
        if not counts.get("grad_norm"):
            metrics[prefix + "grad_norm"] = float("nan")
        metrics[prefix + "lr"] = sum(lrs) / len(lrs) if lrs else role.lr
        metrics[prefix + "nonfinite_skipped"] = float(skipped)
        return metrics

    @staticmethod
    def _scheduler_step(role: Role) -> None:
        # The schedule advances once per planned optimizer step, taken or skipped, so its length
        # stays what total_steps planned; silence torch's "scheduler before optimizer" warning
        # for a skipped first step.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*lr_scheduler\.step\(\).*optimizer\.step\(\).*")
            role.scheduler.step()

    @staticmethod
    def _clip_grad(role: Role) -> float:
        """Clip ``role``'s gradients to ``grad_clip`` by global norm; returns the norm before
        clipping (non-finite when a gradient is)."""
        params = [p for p in role.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        max_norm = float(role.grad_clip) if role.grad_clip and role.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, error_if_nonfinite=False)
        return float(norm)

    def update_actor(self, batch: Batch) -> dict[str, float]:
        """PPO-style policy update on ``batch``; returns ``actor/*`` metrics.

        Needs ``input_ids``, ``attention_mask``, ``position_ids``, ``responses``,
        ``response_mask``, ``old_log_probs`` and ``advantages``; ``old_log_probs`` may be absent
        when the call is on-policy (``actor.ppo_epochs == 1`` and the batch is one mini-batch):
        then each micro-batch's own log-probs, detached, are the old ones (the weights have not
        moved yet; verl's ``dp_actor`` ``on_policy`` shortcut); ``ref_log_probs`` with
        ``actor.use_kl_loss``; ``rollout_log_probs`` with ``actor.rollout_is_threshold``; the
        fields the policy loss ``requires``. Per micro-batch the loss is
        :func:`rlplug.algorithms.objective.actor_objective`: ``policy_loss + kl_loss_coef * agg(kl) -
        entropy_coeff * agg(entropy)``, every term aggregated with the whole mini-batch's
        normaliser; with ``actor.rollout_is_threshold`` the policy loss receives verl's truncated
        importance weights ``min(exp(old_log_probs - rollout_log_probs), C)``. A policy loss with
        ``minibatch_stats`` costs one extra no-grad forward per mini-batch (and epoch): its
        statistics come from the whole mini-batch under the current weights
        (:meth:`_minibatch_stats_fn`), and each micro-batch passes its rows to the loss.

        Metrics (each the mean over the mini-batches and epochs of this call):
        ``actor/pg_loss``, ``actor/pg_clipfrac``, ``actor/pg_clipfrac_lower``, ``actor/ppo_kl``,
        ``actor/entropy`` (aggregated like the loss), ``actor/kl_loss`` (with the KL loss; before
        the coefficient) and ``actor/kl_coef``, ``actor/rollout_is_weight`` (with TIS),
        ``actor/grad_norm`` (before clipping), ``actor/lr`` and ``actor/nonfinite_skipped``
        (optimizer steps skipped this call).

        Raises ``ValueError`` for a missing tensor or a batch that does not split into mini-batches.
        """
        cfg = self.config.actor
        actor_cfg = typed(ActorConfig, cfg)
        # on-policy (one optimizer step over the whole batch): without old_log_probs the update uses
        # its own log-probs, detached (the same values, as the weights have not moved yet)
        on_policy = self.actor.epochs == 1 and len(batch) == self.actor.mini_batch
        reuse = on_policy and "old_log_probs" not in batch.tensors
        keys = (*SEQUENCE_FIELDS, "response_mask", "advantages", *(() if reuse else ("old_log_probs",)))
        check_batch_fields(batch, keys, "update_actor")
        if self.kl_loss is not None:
            check_batch_fields(
                batch,
                ("ref_log_probs",),
                "update_actor with actor.use_kl_loss",
                " The trainer fills ref_log_probs when a reference model is used (use_ref=True).",
            )
        if actor_cfg.rollout_is_threshold is not None:
            check_batch_fields(
                batch,
                ("rollout_log_probs",),
                "update_actor with actor.rollout_is_threshold",
                " Set rollout.calculate_log_probs=true so the rollout engine returns its log-probs.",
            )
        required = tuple(getattr(self.policy_loss, "requires", ()) or ())
        if required:
            check_batch_fields(
                batch,
                required,
                f"update_actor with actor.policy_loss={cfg.policy_loss}",
                " Producers: " + "; ".join(f"{k}: {BATCH_FIELD_PRODUCERS.get(k, 'unknown')}" for k in required) + ".",
            )
        t = self._response_length(batch)
        mode = self.actor.loss_agg_mode
        model = self.actor.model

        def micro_loss(tensors: dict[str, torch.Tensor], normalizer: float) -> tuple[torch.Tensor, dict[str, float]]:
            out = self._forward_log_probs(model, tensors, t, True)
            stats = {k[len(_STATS_PREFIX) :]: v for k, v in tensors.items() if k.startswith(_STATS_PREFIX)}
            return actor_objective(
                out["log_probs"],
                out["entropy"],
                tensors,
                policy_loss=self.policy_loss,
                config=cfg,
                loss_agg_mode=mode,
                normalizer=normalizer,
                max_response_length=self.max_response_length,
                kl_penalty=self.kl_loss,
                on_policy_reuse=reuse,
                minibatch_stats=stats or None,
            )

        metrics = self._run_update(self.actor, batch, micro_loss, self._minibatch_stats_fn(reuse))
        if self.kl_loss is not None:
            metrics["actor/kl_coef"] = float(actor_cfg.kl_loss_coef)
        return metrics

    def _minibatch_stats_fn(self, reuse: bool) -> Callable[[Batch, int, int], Batch] | None:
        """The ``mini_stats`` callback of :meth:`_run_update` for a policy loss with
        ``minibatch_stats`` (``None`` without): a no-grad forward of the whole mini-batch with the
        current weights (:meth:`compute_log_probs`, which gathers every process's rows), then
        :func:`minibatch_stats_batch`. ``reuse``: the batch has no ``old_log_probs`` (on-policy),
        so the current log-probs stand in for them."""
        stats_fn = getattr(self.policy_loss, "minibatch_stats", None)
        if stats_fn is None:
            return None
        role, seed = self.actor, int(typed(TrainerConfig, self.config.trainer).seed)

        def add_stats(mini: Batch, epoch: int, index: int) -> Batch:
            current = self.compute_log_probs(mini, which="actor")["log_probs"]
            role.model.train()  # compute_log_probs switched it to eval mode
            context = MiniBatchContext(seed, int(role.scheduler.last_epoch), epoch, index)  # type: ignore[attr-defined]
            return minibatch_stats_batch(stats_fn, mini, current, self.config.actor, context, reuse=reuse)

        return add_stats

    def update_critic(self, batch: Batch) -> dict[str, float]:
        """Clipped value-loss update on ``batch``; returns ``critic/*`` metrics.

        Needs the sequence tensors, ``response_mask``, ``values`` (the critic's values before the
        update, the clipping anchor) and ``returns``; the loss is
        :func:`rlplug.algorithms.objective.critic_objective` (clipped, ``critic.cliprange_value``; squared error or
        Huber, ``critic.loss_type`` / ``critic.huber_delta``). Metrics (means over mini-batches and epochs):
        ``critic/vf_loss``, ``critic/vf_clipfrac``, ``critic/grad_norm``, ``critic/lr``,
        ``critic/nonfinite_skipped``. Raises ``ValueError`` without a critic or a tensor.
        """
        if self.critic is None:
            raise ValueError("update_critic called but this backend was built with use_critic=False.")
        check_batch_fields(batch, CRITIC_INPUT_FIELDS, "update_critic")
        t = self._response_length(batch)
        role = self.critic
        critic_cfg = typed(CriticConfig, self.config.critic)
        cliprange = float(critic_cfg.cliprange_value)
        loss_type = str(critic_cfg.loss_type)
        huber_delta = float(critic_cfg.huber_delta)

        def micro_loss(tensors: dict[str, torch.Tensor], normalizer: float) -> tuple[torch.Tensor, dict[str, float]]:
            values = self._values(role.model, tensors, t)
            return critic_objective(
                values,
                tensors,
                cliprange_value=cliprange,
                loss_agg_mode=role.loss_agg_mode,
                normalizer=normalizer,
                # the critic follows actor.loss_scale_factor, as verl's critic defaults to the actor's
                max_response_length=seq_norm_length(self.config.actor, self.max_response_length),
                loss_type=loss_type,
                huber_delta=huber_delta,
            )

        return self._run_update(role, batch, micro_loss)

    # ------------------------------------------------------------------ weights, checkpoints, export
    def actor_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, tensor)`` for every actor weight, as in a Hugging Face checkpoint: tied
        weights once (under the embedding's name), detached views of the live fp32 parameters
        on the training device (no copies). Consume before the next update. With LoRA: the merged
        weights ``W + (lora_alpha / r) * B @ A`` of the adapted layers as new tensors
        (:func:`rlplug.training.lora.merged_weights`), views of the others; the trained model is unchanged."""
        if self.lora is not None:
            yield from lora.merged_weights(self.actor.model)
            return
        yield from unique_state(self.actor.model).items()

    def _role_lora(self, role: Role) -> Any:
        """The :class:`rlplug.training.lora.LoraSettings` of ``role`` (``None``: it trains every weight)."""
        return self.lora if role.name == "actor" else self.critic_lora

    def _role_base(self, role: Role) -> str:
        """The model folder ``role`` was loaded from (a LoRA checkpoint's base)."""
        return self.model_path if role.name == "actor" else str(self.critic_model_path)

    def _roles(self) -> list[Role]:
        return [self.actor] + ([self.critic] if self.critic is not None else [])

    def save(self, directory: str | Path) -> None:
        """Write the training state into ``directory`` (created).

        Layout: ``actor/model.safetensors`` (Hugging Face names, tied weights once),
        ``actor/optimizer.pt``, ``actor/scheduler.pt``, the same under ``critic/`` when there is a
        critic, and ``backend_state.json`` (counters). Reloaded by :meth:`load`, training continues
        bitwise identically. A LoRA role writes its adapters and a pointer to its base model instead
        of ``model.safetensors`` (:func:`rlplug.training.lora.save_lora_state`).
        """
        out = Path(directory)
        for role in self._roles():
            d = out / role.name
            d.mkdir(parents=True, exist_ok=True)
            if self._role_lora(role) is not None:
                lora.save_lora_state(role.model, d, self._role_base(role), role.name)
            else:
                state = {k: v.contiguous().cpu() for k, v in unique_state(role.model).items()}
                safetensors.torch.save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
            torch.save(role.optimizer.state_dict(), d / "optimizer.pt")
            torch.save(role.scheduler.state_dict(), d / "scheduler.pt")
        counters = {r.name: {"consecutive_bad_steps": r.consecutive_bad_steps} for r in self._roles()}
        (out / STATE_FILE).write_text(json.dumps(counters, indent=1))

    def load(self, directory: str | Path) -> None:
        """Restore what :meth:`save` wrote (weights, optimizer and scheduler states, counters).

        This run's config wins over the checkpoint's settings: AdamW's ``betas``, ``eps``, ``weight_decay``
        and kernel (:meth:`Role.keep_optimizer_implementation`) and the LR schedule's shape
        (:meth:`Role.load_scheduler_state`); the base learning rates are the checkpoint's (a changed
        ``optim.lr`` is applied by the trainer with :meth:`scale_lr`, keeping the alerts' factors).
        Optimizer/scheduler files are read with ``torch.load(..., weights_only=True)``.
        Raises ``FileNotFoundError`` for a missing file and ``ValueError`` when the weights do
        not match the model (wrong model or a checkpoint without a critic).
        """
        src = Path(directory)
        for role in self._roles():
            d = src / role.name
            weights = d / "model.safetensors"
            key = "model" if role.name == "actor" else "critic.model"
            if self._role_lora(role) is not None:
                lora.load_lora_state(role.model, d, self._role_base(role), role.name, key, self.device)
            elif lora.is_lora_role_dir(d):
                raise ValueError(
                    f"{d} holds LoRA adapters (that run trained with {key}.lora_rank > 0), but {key}.lora_rank=0 "
                    f"now. Resume with the checkpointed run's {key}.lora_rank, lora_alpha and target_modules."
                )
            elif not weights.is_file():
                raise FileNotFoundError(
                    f"{weights} is missing: {src} was not written by the {self.backend_name} backend's save() "
                    f"(or without a {role.name})."
                )
            else:
                state = safetensors.torch.load_file(str(weights), device=str(self.device))
                result = role.model.load_state_dict(state, strict=False)
                expected_missing = set(role.model.state_dict()) - set(unique_state(role.model))
                missing = set(result.missing_keys) - expected_missing
                if missing or result.unexpected_keys:
                    raise ValueError(
                        f"{weights} does not match the {role.name} model: missing {sorted(missing)[:5]}, unexpected "
                        f"{sorted(result.unexpected_keys)[:5]}. Was it saved from a different model?"
                    )
            role.optimizer.load_state_dict(torch.load(d / "optimizer.pt", weights_only=True, map_location=self.device))
            role.keep_optimizer_implementation()
            role.load_scheduler_state(torch.load(d / "scheduler.pt", weights_only=True))
        state_file = src / STATE_FILE
        if state_file.is_file():
            state = json.loads(state_file.read_text())
            for role in self._roles():
                role.consecutive_bad_steps = int(state.get(role.name, {}).get("consecutive_bad_steps", 0))

    def export_hf(self, directory: str | Path, tokenizer: Any = None) -> Path:
        """Write the actor as a normal Hugging Face folder (``save_pretrained``, safetensors, plus
        the tokenizer when given) that ``AutoModelForCausalLM.from_pretrained`` and vLLM load; the
        weights get the mode the umask gives (:func:`rlplug.base.file_modes.apply_umask`)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        model: Any = self.actor.model
        if self.lora is not None:  # base + merged adapters, the trained model unchanged (rlplug.training.lora)
            lora.save_merged(model, out, tokenizer)
            apply_umask(out)
            return out
        model.config.use_cache = True  # for generation from the exported folder
        try:
            model.save_pretrained(str(out), safe_serialization=True)
        finally:
            model.config.use_cache = False
        if tokenizer is not None:
            tokenizer.save_pretrained(str(out))
        apply_umask(out)  # safetensors writes 0600: let an inference server of another user read it
        return out

    def close(self) -> None:
        """Free the models and optimizer states; idempotent."""
        self.ref = None
        for role in self._roles():
            role.optimizer.state.clear()
        self.critic = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
