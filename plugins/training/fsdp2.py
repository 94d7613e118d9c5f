"""The ``fsdp2`` training backend (kind ``training_backend``): sharded data-parallel training.

Launch with torchrun, one process per device (CPU ranks use gloo, GPU ranks NCCL)::

    torchrun --nproc_per_node=2 -m rlplug train trainer=fsdp2 ...
    torchrun --nnodes=2 --node_rank=R --nproc_per_node=8 --rdzv_endpoint=HOST:PORT -m rlplug train trainer=fsdp2 ...

Without torchrun (``WORLD_SIZE`` unset) it runs as a one-rank group (a ``FileStore`` in a
temporary folder), so ``trainer=fsdp2`` also works in a plain ``rlplug train``.

Design (the methods and their semantics are those of the library's
:class:`rlplug.training.backend.TrainingBackendBase`, which this class extends by overriding its
data-parallel hooks; the objectives are :mod:`rlplug.algorithms.objective`'s; only the distributed parts
differ):

* **Sharding.** The actor, the critic and the reference model are each wrapped with
  ``torch.distributed.fsdp.fully_shard``: every decoder layer (the model's ``_no_split_modules``
  classes, e.g. ``LlamaDecoderLayer``) is its own FSDP unit, then the root (embeddings, final
  norm, tied LM head, value head). Each rank keeps ``1 / world_size`` of every parameter,
  gradient and AdamW state (fp32 masters). The actor is wrapped in a small module whose
  ``forward`` is :func:`rlplug.algorithms.logprob.response_token_stats`, so the root unit's parameters
  (embedding = tied LM head) are gathered around the chunked log-prob computation. The
  reference model is sharded too (no optimizer): it costs one all-gather per layer per
  forward, and keeps its memory at ``1 / world_size`` like the actor's.
* **Data parallelism** (``docs/algorithms.md``): every rank receives the same full batch (the
  trainer broadcasts rank 0's rollout; a fingerprint check fails loudly otherwise). Each
  global mini-batch of ``ppo_mini_batch_size * rollout.n`` responses is cut into
  ``world_size`` consecutive slices, one per rank; each rank splits its slice into micro-batches
  of ``micro_batch_size_per_device``. The loss normaliser (valid tokens for ``token-mean``,
  valid sequences otherwise) is the all-reduced count over the whole mini-batch, and gradients
  are SUMMED across ranks (FSDP's reduce-scatter with divide factor 1), so the gradient equals
  the single-process one up to float reassociation, whatever the number of ranks.
  Inference (``compute_log_probs`` / ``compute_values``) splits the rows the same way and
  all-gathers the results, so every rank returns the same full ``(B, T)`` tensor.
* **Mixed precision** (``trainer.backend_kwargs``): ``param_dtype`` and ``reduce_dtype`` (default
  fp32) form the FSDP ``MixedPrecisionPolicy``; master weights, gradients after reduction and
  AdamW states stay fp32. ``param_dtype: auto`` is bf16 on CUDA when ``model.compute_dtype=bf16``
  (as verl: the parameters are gathered in bf16 and the WHOLE forward, residual stream included,
  runs in bf16) and fp32 otherwise. With fp32 parameters, ``model.compute_dtype=bf16`` means
  ``torch.autocast`` exactly as in the ``local`` backend (so on CPU, ``auto`` gives the local
  backend's numerics; with ``compute_dtype=fp32`` the results match it to float noise).
  Measured on the tiny random model: bf16 parameters move the update further from the fp32 one
  (cosine ~0.8) than bf16 autocast does (~0.999); use ``param_dtype: fp32`` when that matters.
  ``cpu_offload: true`` keeps the shards and optimizer states in CPU memory (``CPUOffloadPolicy``,
  CUDA only). Gradient checkpointing follows ``model.enable_gradient_checkpointing``.
* **Non-finite steps** are decided collectively: a non-finite loss on any rank (all-reduced
  flag, checked before backward) or a non-finite global gradient norm skips the optimizer step
  on every rank.
* **Weights for the rollout engine**: :meth:`actor_weights` gathers one parameter at a time
  (``DTensor.full_tensor()``, an all-gather every rank must join), so no rank ever holds a full
  extra copy of the model on account of the generator. The trainer lets rank 0 alone push.
* **Checkpoints** (:meth:`save` / :meth:`load`): model and optimizer shards with
  ``torch.distributed.checkpoint`` (DCP; resumable on a different number of ranks), the
  scheduler and counters written by rank 0, and the actor's full weights as
  ``actor/model.safetensors`` (written by rank 0) so ``rlplug export`` reads it unchanged.
  The checkpoint folder must be on a file system every rank sees. As in the ``local`` backend, a
  resume keeps this run's optimizer settings and LR-schedule shape over the checkpoint's
  (:meth:`rlplug.training.backend.Role.keep_optimizer_implementation`, :meth:`rlplug.training.backend.Role.load_scheduler_state`).

The trainer coordinates the ranks through ``backend.coordinator``
(:class:`rlplug.training.backend.TorchDistributedCoordinator`: ``world_size``, ``is_main``,
``broadcast(obj)``). ``world_size``, ``rank``, ``is_main_process`` and :meth:`broadcast_object` are
the older names of the same things, kept as aliases.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist

from rlplug.plugin import (
    STATE_FILE,
    Batch,
    CriticConfig,
    ModelConfig,
    Role,
    RolloutConfig,
    RunContext,
    TorchDistributedCoordinator,
    TrainerConfig,
    TrainingBackendBase,
    apply_umask,
    fault_point,
    hookimpl,
    resolve_device,
    resolve_dtype,
    response_token_stats,
    token_budgets,
    typed,
)

__all__ = ["FSDP2TrainingBackend"]

logger = logging.getLogger(__name__)

_KWARGS = {
    "dist_backend": "auto",  # auto | gloo | nccl
    "param_dtype": "auto",  # auto | fp32 | bf16
    "reduce_dtype": "fp32",  # fp32 | bf16
    "cpu_offload": False,
    "reshard_after_forward": True,
    "timeout_s": 1800,
}
_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


# ============================================================================ helpers


class _LogProbModule(torch.nn.Module):
    """Wraps a causal LM so that its ``forward`` is :func:`rlplug.algorithms.logprob.response_token_stats`.

    FSDP2 gathers a unit's parameters in the unit's forward pre-hook; ``response_token_stats``
    calls the decoder and reads ``lm_head.weight`` directly (it never calls the LM's own
    ``forward``), so the root unit has to be a module whose forward covers the whole computation.
    """

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm

    @property
    def config(self) -> Any:
        return self.lm.config

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        response_length: int,
        temperature: float,
        chunk_size: int,
        with_entropy: bool,
        extras: tuple[str, ...] = (),
    ) -> dict[str, torch.Tensor]:
        """``{"log_probs": (B, T) float32, "entropy": ..., <extra>: ...}``; see ``response_token_stats``."""
        tensors = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        return response_token_stats(
            self.lm,
            tensors,
            response_length,
            temperature=temperature,
            chunk_size=chunk_size,
            with_entropy=with_entropy,
            extras=extras,
        )


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks to shard one by one: modules whose class is in the Hugging Face
    ``_no_split_modules`` list of ``model`` or of any submodule (``LlamaDecoderLayer`` ...)."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def _unique_named(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of the state dict without aliases (tied embeddings keep the first name,
    ``model.embed_tokens.weight``, as in Hugging Face checkpoints) nor non-persistent buffers."""
    own: dict[str, torch.Tensor] = dict(module.named_parameters())  # duplicates removed: the first name wins
    own.update(dict(module.named_buffers()))
    return [(name, own[name]) for name in module.state_dict().keys() if name in own]


@contextlib.contextmanager
def _quiet_view_warning() -> Iterator[None]:
    # FSDP2 warns when a unit returns a view (in-place ops on it would skip its backward hook);
    # the log-probs and values returned here are only read out of place.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        yield


# ============================================================================ the backend


def _dcp_failure(exc: BaseException) -> Exception:
    """The error to raise for DCP's ``CheckpointException`` ``exc`` (a ``BaseException`` that
    ``except Exception`` misses, raised on every rank when any rank's write failed): an ``OSError``
    with the first failing rank's errno when it had one (``ENOSPC``: :mod:`rlplug.run.checkpoint` reports a
    full disk, exit code 74), else a ``RuntimeError``; the message names the ranks and their errors."""
    failures = getattr(exc, "failures", None) or {}
    parts, code = [], None
    for rank, pair in sorted(failures.items()):
        err = pair[0] if isinstance(pair, tuple) else pair
        parts.append(f"rank {rank}: {type(err).__name__}: {err}")
        if code is None and isinstance(err, OSError) and err.errno is not None:
            code = err.errno
    msg = "The distributed checkpoint write failed (" + ("; ".join(parts) or str(exc)) + ")"
    return OSError(code, msg) if code is not None else RuntimeError(msg)


class FSDP2TrainingBackend(TrainingBackendBase):
    """Training backend sharded over a ``torch.distributed`` group (``trainer.backend=fsdp2``).

    Same factory signature, methods, metrics and checkpoint contract as
    :class:`rlplug.training.backend.TrainingBackendBase` (see there and the module docstring), and the
    same ``capabilities`` (but ``"lora"``: LoRA needs ``trainer=local``) and ``per_token_outputs``. Every method is collective: all ranks must
    call it, in the same order, with the same batch.

    Attributes:
        coordinator: :class:`rlplug.training.backend.TorchDistributedCoordinator` of the group.
        world_size, rank, local_rank: of the process group.
        is_main_process: ``rank == 0`` (alias of ``coordinator.is_main``).

    Raises ``ValueError`` for unknown or inconsistent ``trainer.backend_kwargs``, a NCCL backend
    without CUDA, or mini-batches that do not split evenly over the ranks.
    """

    #: compiling FSDP2-sharded layers is not tested here: actor.use_torch_compile is ignored (warning)
    supports_torch_compile = False

    backend_name = "fsdp2"
    log = logger
    coordinator: TorchDistributedCoordinator
    #: no LoRA: adapters are not sharded here (rlplug.training.lora.check_lora_config refuses it at config time)
    capabilities = TrainingBackendBase.capabilities - {"lora"}

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
        self._owns_group = False
        self._store_dir: str | None = None
        kwargs = dict(_KWARGS)
        trainer = typed(TrainerConfig, config.trainer)
        given = dict(trainer.backend_kwargs or {})
        unknown = sorted(set(given) - set(_KWARGS))
        if unknown:
            raise ValueError(
                f"trainer.backend_kwargs has unknown keys {unknown} for the fsdp2 backend; valid keys and defaults: {_KWARGS}."
            )
        kwargs.update({k: v for k, v in given.items() if v is not None})
        self.backend_kwargs = kwargs
        self._init_distributed(config, kwargs)
        try:  # from here on, an error must not leave the process group behind
            self._mp_policy, self._offload_policy = self._policies(config, kwargs)
            threads = trainer.num_threads
            if not threads and self._dist_device.type == "cpu":
                # one share of the cores per local rank (threads spinning on a busy core are the
                # biggest slowdown on small machines, see shared/MACHINE_NOTES.md)
                local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
            n = int(typed(RolloutConfig, config.rollout).n)
            minis = {"actor": int(config.actor.ppo_mini_batch_size) * n}
            if use_critic:
                critic_mini = typed(CriticConfig, config.critic).ppo_mini_batch_size
                # unset (None): the actor's, as the base backend's critic Role
                minis["critic"] = int(critic_mini if critic_mini is not None else config.actor.ppo_mini_batch_size) * n
            if self.world_size > 1 and any(b is not None for b in token_budgets(config).values()):
                # each rank would pack its own rows into its own number of micro-batches, and the
                # per-micro-batch collectives would then pair up wrongly (verl all-reduces the count)
                raise ValueError(
                    "use_dynamic_bsz=true (token-budget micro-batches) is not available with trainer=fsdp2 on "
                    f"{self.world_size} ranks yet: the ranks could split their rows into different numbers of "
                    "micro-batches. Set actor.use_dynamic_bsz=false (and critic.use_dynamic_bsz) and size "
                    "actor.micro_batch_size_per_device instead, or run on one process."
                )
            for name, size in minis.items():
                if size % self.world_size:
                    raise ValueError(
                        f"{name}: a mini-batch has {size} responses ({name}.ppo_mini_batch_size x rollout.n), which "
                        f"does not split over {self.world_size} ranks. Choose {name}.ppo_mini_batch_size x rollout.n "
                        "as a multiple of the number of ranks."
                    )
            super().__init__(
                config, model_path, use_critic=use_critic, use_ref=use_ref, total_steps=total_steps, run=run
            )
        except BaseException:
            self._destroy_group()
            raise
        if self._mp_policy.param_dtype not in (None, torch.float32):
            self.autocast_dtype = None  # FSDP already computes in param_dtype
        logger.info(
            "fsdp2: rank %d/%d on %s (%s), param_dtype %s, reduce_dtype %s, cpu_offload %s",
            self.rank,
            self.world_size,
            self.device,
            dist.get_backend(),
            self._mp_policy.param_dtype,
            self._mp_policy.reduce_dtype,
            bool(kwargs["cpu_offload"]),
        )

    # ------------------------------------------------------------------ process group
    def _init_distributed(self, config: Any, kwargs: dict[str, Any]) -> None:
        from torch.distributed.device_mesh import init_device_mesh  # deferred: torch (torch.distributed submodule)

        device_type = torch.device(resolve_device(config.trainer, "fsdp2")).type  # the index comes from LOCAL_RANK
        backend = str(kwargs["dist_backend"])
        if backend == "auto":
            backend = "nccl" if device_type == "cuda" else "gloo"
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"trainer.backend_kwargs.dist_backend must be 'auto', 'gloo' or 'nccl', got {backend!r}.")
        if backend == "nccl" and device_type != "cuda":
            raise ValueError("trainer.backend_kwargs.dist_backend=nccl needs CUDA devices; on CPU use gloo (or auto).")
        if backend == "gloo" and device_type == "cuda":
            raise ValueError(
                "trainer.backend_kwargs.dist_backend=gloo cannot reduce-scatter CUDA tensors for FSDP; use nccl "
                "(or auto) on GPUs, or trainer.device=cpu."
            )
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if device_type == "cuda":
            torch.cuda.set_device(self.local_rank)
            self._dist_device = torch.device("cuda", self.local_rank)
        else:
            self._dist_device = torch.device("cpu")
        timeout = timedelta(seconds=float(kwargs["timeout_s"]))
        if dist.is_initialized():
            if dist.get_backend() != backend:
                logger.warning(
                    "fsdp2: reusing the existing %s process group (asked for %s).", dist.get_backend(), backend
                )
        elif "WORLD_SIZE" in os.environ:  # torchrun (or any env:// launcher)
            dist.init_process_group(
                backend, timeout=timeout, device_id=self._dist_device if device_type == "cuda" else None
            )
            self._owns_group = True
        else:  # a plain process: a one-rank group
            self._store_dir = tempfile.mkdtemp(prefix="rlplug-fsdp2-")
            dist.init_process_group(
                backend, init_method=f"file://{self._store_dir}/store", rank=0, world_size=1, timeout=timeout
            )
            self._owns_group = True
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.coordinator = TorchDistributedCoordinator(self.world_size, self.rank)
        self.mesh = init_device_mesh(device_type, (self.world_size,))

    def _destroy_group(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False
        if self._store_dir:
            shutil.rmtree(self._store_dir, ignore_errors=True)
            self._store_dir = None

    @property
    def is_main_process(self) -> bool:
        """``rank == 0``; the older name of ``coordinator.is_main``."""
        return self.coordinator.is_main

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``obj`` of rank ``src`` (any picklable object) on every rank; collective. The older name
        of ``coordinator.broadcast``."""
        return self.coordinator.broadcast(obj, src=src)

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def _training_device(self) -> torch.device:
        return self._dist_device

    # ------------------------------------------------------------------ sharding
    def _policies(self, config: Any, kwargs: dict[str, Any]):
        from torch.distributed.fsdp import (  # deferred: torch (torch.distributed submodule)
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            OffloadPolicy,
        )

        name = str(kwargs["param_dtype"])
        if name == "auto":
            compute = resolve_dtype(
                typed(ModelConfig, config.model).compute_dtype, self._dist_device, "model.compute_dtype"
            )
            name = "bf16" if (compute == "bf16" and self._dist_device.type == "cuda") else "fp32"
        if name not in _DTYPES or str(kwargs["reduce_dtype"]) not in _DTYPES:
            raise ValueError(
                f"trainer.backend_kwargs.param_dtype / reduce_dtype must be one of {sorted(_DTYPES)} (param_dtype also "
                f"'auto'), got {kwargs['param_dtype']!r} / {kwargs['reduce_dtype']!r}."
            )
        param_dtype, reduce_dtype = _DTYPES[name], _DTYPES[str(kwargs["reduce_dtype"])]
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        offload: OffloadPolicy = OffloadPolicy()
        if bool(kwargs["cpu_offload"]):
            if self._dist_device.type != "cuda":
                raise ValueError(
                    "trainer.backend_kwargs.cpu_offload=true only makes sense on CUDA devices (the model "
                    "is already in CPU memory on CPU ranks)."
                )
            offload = CPUOffloadPolicy()
        return mp, offload

    def _prepare_model(self, model: torch.nn.Module, role: str) -> torch.nn.Module:
        """Shard ``model``: each decoder layer, then the root (see the module docstring)."""
        from torch.distributed.fsdp import (  # deferred: torch (torch.distributed submodule)
            CPUOffloadPolicy,
            FSDPModule,
            fully_shard,
        )

        root = _LogProbModule(model) if role in ("actor", "ref") else model
        if not isinstance(self._offload_policy, CPUOffloadPolicy):
            root = root.to(self._dist_device)
        layers = _decoder_layers(model)
        if not layers:
            logger.warning(
                "fsdp2: no decoder layers found in %s (no _no_split_modules); sharding it as one unit.",
                type(model).__name__,
            )
        opts = dict(mesh=self.mesh, mp_policy=self._mp_policy, offload_policy=self._offload_policy)
        reshard = bool(self.backend_kwargs["reshard_after_forward"])
        for layer in layers:
            fully_shard(layer, reshard_after_forward=reshard, **opts)
        fully_shard(root, reshard_after_forward=reshard, **opts)
        for m in root.modules():
            if isinstance(m, FSDPModule):
                # Sum the gradients over ranks (the loss already divides by the GLOBAL normaliser);
                # plain sums also work with gloo, which has no AVG / PREMUL_SUM reduction.
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
        return root

    # ------------------------------------------------------------------ rows per rank
    def _check_same_batch(self, batch: Batch, what: str) -> None:
        """Fail on every rank when the ranks were not given the same batch (integer fingerprint)."""
        if self.world_size == 1:
            return
        vals = [len(batch)]
        for key in ("input_ids", "attention_mask", "response_mask"):
            x = batch.tensors.get(key)
            if x is None:
                vals.append(-1)
                continue
            flat = (x.detach().cpu().double() * 4).round().long().flatten()
            weights = torch.arange(flat.numel(), dtype=torch.long) % 1009 + 1
            vals.append(int((flat * weights).sum()))
        mine = torch.tensor(vals, dtype=torch.long, device=self.device)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine)
        if any(not torch.equal(every[0], other) for other in every[1:]):
            raise RuntimeError(
                f"{what}: the ranks hold different batches (fingerprints {[e.tolist() for e in every]}). The fsdp2 "
                "backend needs the same full batch on every rank: broadcast rank 0's rollout results (the trainer "
                "does this when backend.world_size > 1)."
            )

    def _rank_rows(self, batch: Batch, keys: tuple[str, ...]) -> Batch:
        """This rank's consecutive block of ``ceil(B / world_size)`` rows (padded with copies of
        row 0 so every rank runs the same number of forwards; :meth:`_gather_rows` drops them)."""
        size = len(batch)
        per = -(-size // self.world_size)
        start = min(self.rank * per, size)
        stop = min(start + per, size)
        index = list(range(start, stop)) + [0] * (per - (stop - start))
        idx = torch.tensor(index, dtype=torch.long)
        return Batch({k: batch.tensors[k][idx] for k in keys if k in batch.tensors})

    def _gather_rows(self, local: torch.Tensor, size: int, out_device: torch.device) -> torch.Tensor:
        """Concatenate every rank's ``local`` rows (all the same shape) and keep the first ``size``."""
        local = local.to(self.device).contiguous()
        if self.world_size == 1:
            full = local
        else:
            parts = [torch.empty_like(local) for _ in range(self.world_size)]
            dist.all_gather(parts, local)
            full = torch.cat(parts)
        return full[:size].to(out_device)

    # ------------------------------------------------------------------ inference
    def _forward_log_probs(
        self,
        model: torch.nn.Module,
        tensors: dict[str, torch.Tensor],
        t: int,
        with_entropy: bool,
        extras: tuple[str, ...] = (),
    ) -> dict[str, torch.Tensor]:
        with _quiet_view_warning(), self._autocast():
            return model(
                tensors["input_ids"],
                tensors["attention_mask"],
                tensors["position_ids"],
                t,
                self.temperature,
                self.chunk_size,
                with_entropy,
                tuple(extras),
            )

    def _values(self, model: torch.nn.Module, tensors: dict[str, torch.Tensor], t: int) -> torch.Tensor:
        with _quiet_view_warning():
            return super()._values(model, tensors, t)

    # ------------------------------------------------------------------ updates
    def _all_reduce(self, values: list[float]) -> list[float]:
        x = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            dist.all_reduce(x)
        return x.tolist()

    def apply_phase(self, config: Any) -> None:
        """:meth:`rlplug.training.backend.TrainingBackendBase.apply_phase`, then the check of ``__init__`` for the new
        sizes: each role's mini-batch (``ppo_mini_batch_size x rollout.n`` responses) must split over the ranks.
        Raises ``ValueError`` naming the role and the sizes otherwise."""
        super().apply_phase(config)
        for role in (self.actor, self.critic):
            if role is not None and role.mini_batch % self.world_size:
                raise ValueError(
                    f"{role.name}: a mini-batch of this phase has {role.mini_batch} responses ({role.name}."
                    f"ppo_mini_batch_size x rollout.n={config.rollout.n}), which does not split over {self.world_size} "
                    "ranks. Choose the phase's rollout.n (algorithm.schedule, rollout.n_schedule) so that it does."
                )

    def _rank_slice(self, mini: Batch, role: Role) -> Batch:
        """This rank's consecutive ``1 / world_size`` of a global mini-batch (the sizes divide
        evenly: checked in ``__init__``)."""
        per_rank = role.mini_batch // self.world_size
        return mini.slice(self.rank * per_rank, (self.rank + 1) * per_rank)

    def _release(self, model: torch.nn.Module) -> None:
        model.reshard()  # type: ignore[operator]  # an FSDPModule

    def _clip_grad(self, role: Role) -> float:
        """Clip the sharded gradients to ``grad_clip`` by their GLOBAL norm; returns that norm
        (before clipping, the same on every rank; non-finite when any gradient is).

        As ``torch.nn.utils.clip_grad_norm_`` (scale ``min(1, max_norm / (norm + 1e-6))``), but on
        the local shards plus one all-reduce of the squared norms, so it also works when the
        shards live in CPU memory (``cpu_offload``) while the group is NCCL.
        """
        from torch.distributed.tensor import DTensor  # deferred: torch (torch.distributed submodule)

        grads = [p.grad for p in role.model.parameters() if p.grad is not None]
        if not grads:
            return 0.0
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        # every FSDP2 gradient is Shard(0) over the whole group: the squared norms add up over ranks
        squares = torch.stack([torch.linalg.vector_norm(g.float(), 2).to(self.device) ** 2 for g in local]).sum()
        if self.world_size > 1:
            dist.all_reduce(squares)
        norm = float(squares.sqrt())
        max_norm = float(role.grad_clip) if role.grad_clip and role.grad_clip > 0 else float("inf")
        if math.isfinite(norm):
            scale = min(1.0, max_norm / (norm + 1e-6))
            if scale < 1.0:
                torch._foreach_mul_(local, scale)
        return norm

    # ------------------------------------------------------------------ weights, checkpoints, export
    def _full(self, tensor: torch.Tensor) -> torch.Tensor:
        """The whole tensor of a (possibly sharded) parameter; collective for sharded ones."""
        from torch.distributed.tensor import DTensor  # deferred: torch (torch.distributed submodule)

        if not isinstance(tensor, DTensor):
            return tensor.detach()
        local = tensor.to_local()
        if local.device != self.device:  # CPU-offloaded shard: gather on the device
            tensor = DTensor.from_local(
                local.to(self.device), tensor.device_mesh, tensor.placements, shape=tensor.shape, stride=tensor.stride()
            )
        return tensor.full_tensor().detach()

    def actor_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, tensor)`` for every actor weight, Hugging Face names, tied weights once.

        Each full tensor is all-gathered when the generator reaches it (one parameter at a
        time, on the training device, fp32), so EVERY rank must consume the generator to the
        end, in step; ranks other than the one pushing can simply drain it. Collective.
        """
        for name, tensor in _unique_named(self.actor.model.lm):
            yield name, self._full(tensor)

    def _full_actor_state_on_main(self) -> dict[str, torch.Tensor]:
        """Full actor weights in CPU memory on rank 0 (``{}`` elsewhere); collective."""
        state: dict[str, torch.Tensor] = {}
        for name, tensor in self.actor_weights():
            if self.is_main_process:
                state[name] = tensor.to("cpu", copy=True).contiguous()
        return state

    def save(self, directory: str | Path) -> None:
        """Write the training state into ``directory`` (created; every rank must see it). Collective.

        Layout: ``<role>/dcp/`` (DCP shards of the model and, once it has state, the optimizer;
        reshardable to any number of ranks), ``<role>/scheduler.pt`` for ``actor`` and ``critic``,
        ``actor/model.safetensors`` (full actor weights, Hugging Face names, for ``rlplug export``)
        and ``backend_state.json`` (counters, world size).

        Raises on every rank when any rank's part failed (so no rank is left in a collective the others
        skipped): a failed DCP write raises on every rank (DCP gathers every rank's result; its
        ``CheckpointException`` is re-raised as the first failing rank's ``OSError``, errno kept, else a
        ``RuntimeError``), and rank 0's own writes (schedulers, full weights, state file), done after every
        collective, end in one agreement (:meth:`_agree_saved`): rank 0 raises its error, the others an
        ``OSError`` with its errno (a full disk reads as one, ``ENOSPC``) or a ``RuntimeError``.
        """
        import torch.distributed.checkpoint as dcp  # deferred: torch (torch.distributed submodule)
        from torch.distributed.checkpoint.api import CheckpointException  # deferred: torch
        from torch.distributed.checkpoint.state_dict import (  # deferred: torch
            get_model_state_dict,
            get_state_dict,
        )

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        optim_saved: dict[str, bool] = {}
        schedulers: dict[str, dict[str, Any]] = {}
        for role in self._roles():
            d = out / role.name
            d.mkdir(parents=True, exist_ok=True)
            # An optimizer without state (no step taken yet) is not saved: reading its state dict
            # would initialise it with a zero-gradient step (step count 1) and change later updates.
            optim_saved[role.name] = bool(role.optimizer.state)
            if optim_saved[role.name]:
                model_sd, optim_sd = get_state_dict(role.model, role.optimizer)
                state = {"model": model_sd, "optim": optim_sd}
            else:
                state = {"model": get_model_state_dict(role.model)}
            try:
                dcp.save(state, checkpoint_id=str(d / "dcp"))
            except CheckpointException as exc:  # raised on every rank alike: a BaseException, made an error
                raise _dcp_failure(exc) from None
            schedulers[role.name] = role.scheduler.state_dict()
        actor_state = self._full_actor_state_on_main()  # the last collective before the agreement
        error: Exception | None = None
        if self.is_main_process:
            try:
                for name, sd in schedulers.items():
                    torch.save(sd, out / name / "scheduler.pt")
                fault_point("fsdp2_full_weights")  # testing aid: a write failing on rank 0 only
                safetensors.torch.save_file(
                    actor_state, str(out / "actor" / "model.safetensors"), metadata={"format": "pt"}
                )
                meta = {
                    r.name: {"consecutive_bad_steps": r.consecutive_bad_steps, "optimizer_saved": optim_saved[r.name]}
                    for r in self._roles()
                }
                meta["world_size"] = self.world_size  # type: ignore[assignment]
                (out / STATE_FILE).write_text(json.dumps(meta, indent=1))
            except Exception as exc:
                error = exc
        del actor_state
        self._agree_saved(error, out)

    def _agree_saved(self, error: Exception | None, directory: Path) -> None:
        """The end of :meth:`save` on every rank (a collective; the barrier it replaces): each rank's
        outcome is gathered on every rank (``all_gather_object``); a rank whose part failed raises its
        ``error``; when another rank's failed, this one raises an ``OSError`` with that error's errno (a
        full disk stays ``ENOSPC`` for :mod:`rlplug.run.checkpoint`) or a ``RuntimeError``, naming the rank."""
        if self.world_size == 1:
            if error is not None:
                raise error
            return
        mine = None if error is None else (type(error).__name__, str(error), getattr(error, "errno", None))
        outcomes: list[Any] = [None] * self.world_size
        dist.all_gather_object(outcomes, mine)
        if error is not None:
            raise error
        failed = [(rank, o) for rank, o in enumerate(outcomes) if o is not None]
        if failed:
            rank, (name, text, code) = failed[0]
            msg = f"rank {rank} failed to write its part of the checkpoint in {directory}: {name}: {text}"
            if isinstance(code, int):
                raise OSError(code, msg)
            raise RuntimeError(msg)

    def load(self, directory: str | Path) -> None:
        """Restore what :meth:`save` wrote, on any number of ranks (DCP reshards). Collective.

        Raises ``FileNotFoundError`` when ``directory`` was not written by this backend (or has
        no critic while this backend has one).
        """
        import torch.distributed.checkpoint as dcp  # deferred: torch (torch.distributed submodule)
        from torch.distributed.checkpoint.state_dict import (  # deferred: torch
            get_model_state_dict,
            get_state_dict,
            set_model_state_dict,
            set_state_dict,
        )

        src = Path(directory)
        state_file = src / STATE_FILE
        for role in self._roles():
            d = src / role.name
            if not (d / "dcp" / ".metadata").is_file() or not state_file.is_file():
                hint = (
                    " (the local backend writes model.safetensors + optimizer.pt instead)"
                    if (d / "optimizer.pt").is_file()
                    else ""
                )
                raise FileNotFoundError(
                    f"{d / 'dcp'} (a torch.distributed.checkpoint folder) or {state_file} is missing: {src} was not "
                    f"written by the fsdp2 backend's save() (or without a {role.name}){hint}."
                )
        meta = json.loads(state_file.read_text())
        for role in self._roles():
            d = src / role.name
            info = meta.get(role.name, {})
            if info.get("optimizer_saved", False):
                model_sd, optim_sd = get_state_dict(role.model, role.optimizer)
                state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
                dcp.load(state, checkpoint_id=str(d / "dcp"))
                set_state_dict(
                    role.model, role.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
                )
                role.keep_optimizer_implementation()
            else:
                state = {"model": get_model_state_dict(role.model)}
                dcp.load(state, checkpoint_id=str(d / "dcp"))
                set_model_state_dict(role.model, state["model"])
                role.optimizer.state.clear()
            # this run's schedule shape; the rates recomputed when it changed or the parameter groups were not restored
            role.load_scheduler_state(
                torch.load(d / "scheduler.pt", weights_only=True),
                optimizer_restored=bool(info.get("optimizer_saved", False)),
            )
            role.consecutive_bad_steps = int(info.get("consecutive_bad_steps", 0))
        self._barrier()

    def export_hf(self, directory: str | Path, tokenizer: Any = None) -> Path:
        """Write the actor as a Hugging Face folder (as the local backend); rank 0 writes, the
        others only take part in the gathers. Collective."""
        from transformers import AutoModelForCausalLM  # deferred: transformers

        out = Path(directory)
        state = self._full_actor_state_on_main()
        if self.is_main_process:
            out.mkdir(parents=True, exist_ok=True)
            lm = self.actor.model.lm
            config = copy.deepcopy(lm.config)
            config.use_cache = True  # for generation from the exported folder
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
            model.load_state_dict(state, strict=False, assign=True)
            if getattr(config, "tie_word_embeddings", False):
                model.tie_weights()
            still_meta = [n for n, p in model.named_parameters() if p.is_meta]
            if still_meta:
                raise RuntimeError(f"export_hf: the gathered actor state lacks {still_meta[:5]}.")
            model.save_pretrained(str(out), safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(str(out))
            apply_umask(out)  # safetensors writes 0600; model files follow the umask
        del state
        self._barrier()
        return out

    def close(self) -> None:
        """Free the models and optimizer states and, when this backend created it, the process
        group; idempotent."""
        super().close()
        self._destroy_group()


@hookimpl
def register_training_backends(register: Callable[..., None]) -> None:
    register("fsdp2", FSDP2TrainingBackend)
