"""Generation on every rank: ``rollout.colocate`` (issue 35).

Under ``torchrun`` with a multi-process training backend (``trainer=fsdp2``), rank 0 alone used to generate
and score for every rank and broadcast the batch (``docs/scale_out.md``): with 8 devices, 7 waited. With
``rollout.colocate=true`` every rank runs its own engine, as verl's hybrid engine and TRL's vLLM colocate
mode do:

* **One engine per rank, in a child process.** The ``vllm`` backend's engine is a child already; another
  backend (``hf``) runs in an :class:`rlplug.rollout.engine_process.EngineProcess`. Each rank's engine gets
  its own share of the cores (:func:`rank_cores`: ``rollout.num_threads`` cores, by default the cores
  divided by the ranks on the node, ``LOCAL_WORLD_SIZE``), so the engines of one machine do not spin on
  the same cores; on a GPU each rank's engine uses the rank's device. Not vLLM's in-trainer
  ``external_launcher``, which binds threads and reseeds the trainer's RNGs inside the training process.
* **Global micro-batches.** The step's ``len(prompts) * rollout.n`` sequences (prompt-major, as a
  :class:`rlplug.contracts.types.RolloutOutput`) are cut into global micro-batches of
  ``rollout.micro_batch_size`` sequences (:func:`micro_batches`); micro-batch ``k`` is generated with
  ``n=1`` and the seed :func:`micro_batch_seed` ``(params.seed, k)`` whichever rank generates it; rank ``r``
  of ``W`` takes the contiguous block :func:`rank_micro_batches`. The parts are all-gathered and joined in
  micro-batch order (:func:`generate_colocated`), so the batch is the same whether 1 or 8 ranks made it
  (bitwise with ``rollout=hf`` and equal threads per engine; vLLM: equal token ids at temperature 0).
  Fewer micro-batches than ranks leave ranks idle: the trainer warns and names a ``micro_batch_size``.
* **Weights per rank.** After each actor update every rank loads the full actor weights into its own
  engine: the backend's ``actor_weights()`` all-gathers each tensor on every rank (no file on disk; the
  engine child reads them from ``/dev/shm``). The engine sleeps while training runs and is woken before
  generating (``sleep`` / ``wake_up``).

* **Scoring per rank.** Each rank scores a contiguous share of whole groups (:func:`rank_groups`) with its own reward
  manager, on its reward thread while the log-prob passes run, and the ranks' results are all-gathered and joined
  in response order (:func:`join_scores`), so every rank trains on the same scores. Validation, a batch filter's
  per-batch scoring and ReMax's greedy baseline are scored on rank 0 (and broadcast) as before.

What stays on rank 0: validation scoring, tracking and checkpoint metadata. ``rollout.colocate=false`` keeps rank-0 generation, which is also what one
process (``trainer=local``) does by default; ``rollout.colocate=true`` there runs its one engine in an engine process
over the same micro-batches (the one-rank reference of the batch equality). ``rollout.colocate`` unset (null) means: true under
a multi-process backend (``world_size > 1``) with ``trainer.async_mode=sync`` and an engine that can run
per rank (:func:`supports_colocate`), else false. The asynchronous modes refuse ``rollout.colocate=true``
(their engine overlaps training on devices of its own), and so does ``rollout.tensor_model_parallel_size > 1``
(one engine spanning several ranks' devices cannot be tested here); unset, ``colocate`` is then false and rank 0
generates, where the layout changes nothing (verl's example commands, which give 2, keep working).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from omegaconf import DictConfig

from rlplug.config.schema import ConfigError
from rlplug.contracts.kinds import built_classes
from rlplug.contracts.registry import Registry
from rlplug.contracts.types import RolloutOutput, SamplingParams
from rlplug.rollout.utils import merge_engine_metrics

__all__ = [
    "check_colocate_config",
    "colocate_enabled",
    "generate_colocated",
    "idle_ranks",
    "join_scores",
    "micro_batch_seed",
    "micro_batches",
    "pin_engine_device",
    "rank_cores",
    "rank_engine_config",
    "rank_micro_batches",
    "rank_groups",
    "supports_colocate",
]


def check_colocate_config(cfg: DictConfig) -> None:
    """Refuse what colocated generation cannot do, before any model loads; raises :class:`ConfigError`.

    ``rollout.colocate=true`` with ``trainer.async_mode`` other than ``sync`` or with
    ``rollout.tensor_model_parallel_size`` above 1; a ``tensor_model_parallel_size`` below 1; ``rollout.colocate``
    that is not true, false or null.
    """
    r, t = cfg.rollout, cfg.trainer
    setting = r.get("colocate", None)
    if setting not in (None, True, False):
        raise ConfigError(f"rollout.colocate={setting!r} must be true, false or null (null: decided per run).")
    tp = r.get("tensor_model_parallel_size", 1)
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ConfigError(f"rollout.tensor_model_parallel_size={tp!r} must be an integer >= 1 (devices per engine).")
    if tp > 1 and setting is True:
        raise ConfigError(
            f"rollout.colocate=true with rollout.tensor_model_parallel_size={tp}: an engine spread over several "
            "ranks' devices is not supported yet (it cannot be tested here). Use rollout.tensor_model_parallel_size=1 "
            "(one engine per training rank), or drop rollout.colocate (rank 0 generates for every rank), or a server "
            "fleet (rollout.server_urls) whose servers you start with their own tensor parallelism."
        )
    mode = t.get("async_mode", "sync")
    if setting is True and mode != "sync":
        raise ConfigError(
            f"rollout.colocate=true runs an engine on every training rank, sharing its device with training "
            f"(sleep while training), but trainer.async_mode={mode} overlaps generation with training. Use "
            "trainer.async_mode=sync with rollout.colocate=true, or drop rollout.colocate (async modes generate "
            "on rank 0, in an engine process of its own)."
        )


def supports_colocate(factory: Any, cfg: DictConfig, registry: Registry) -> bool:
    """Whether the rollout factory ``factory`` can run one engine per rank: an in-process backend
    (``rollout.mode=inprocess``) whose factory, or a class it builds (as registered in ``registry``), has
    ``supports_colocate = True`` (``hf``, ``vllm``). Server backends (a fleet shared by every rank) do not."""
    if str(cfg.rollout.get("mode", "inprocess")) != "inprocess":
        return False
    classes = list(built_classes(factory))
    for reg in registry.entries.get("rollout_backend", {}).values():
        if reg.obj is factory:
            classes += built_classes(reg.obj, reg.extra)
    return any(getattr(obj, "supports_colocate", False) is True for obj in (factory, *classes))


def colocate_enabled(cfg: DictConfig, world_size: int, factory: Any, registry: Registry, *, can_gather: bool) -> bool:
    """Whether this run generates on every rank (module docstring): ``rollout.colocate`` when given, else
    ``world_size > 1`` with ``trainer.async_mode=sync``, ``rollout.tensor_model_parallel_size=1``, an engine that
    :func:`supports_colocate` and a coordinator that can all-gather (``can_gather``).

    Raises:
        ConfigError: ``rollout.colocate=true`` with an engine that cannot run per rank (a server backend, or one
            without ``supports_colocate``) or a coordinator without ``rank`` / ``all_gather``.
    """
    setting = cfg.rollout.get("colocate", None)
    supported = supports_colocate(factory, cfg, registry)
    if setting is None:
        one_device = cfg.rollout.get("tensor_model_parallel_size", 1) == 1
        sync = cfg.trainer.get("async_mode", "sync") == "sync"
        return world_size > 1 and sync and one_device and supported and can_gather
    if setting and not supported:
        raise ConfigError(
            f"rollout.colocate=true, but rollout={cfg.rollout.name} (rollout.mode={cfg.rollout.get('mode')}) cannot "
            "run an engine per rank: servers are shared by every rank (docs/scale_out.md), and a third-party "
            "backend must declare supports_colocate = True. Drop rollout.colocate or use rollout=hf / rollout=vllm."
        )
    if setting and not can_gather:
        raise ConfigError(
            f"rollout.colocate=true, but the training backend trainer={cfg.trainer.backend}'s coordinator has no "
            "'rank' and 'all_gather' (rlplug.contracts.types.Coordinator), which colocated generation needs to "
            "join the ranks' parts. Drop rollout.colocate, or add them to the backend."
        )
    return bool(setting)


def micro_batches(num_sequences: int, size: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]``: the global micro-batches of ``size`` sequences (the last may be shorter) of
    ``num_sequences`` (the prompt-major ``len(prompts) * n`` of a rollout). Raises ``ValueError`` for ``size < 1``."""
    if size < 1:
        raise ValueError(f"rollout.micro_batch_size must be >= 1 (sequences per micro-batch), got {size}.")
    return [(s, min(s + size, num_sequences)) for s in range(0, num_sequences, size)]


def rank_micro_batches(num_micro_batches: int, rank: int, world_size: int) -> range:
    """The micro-batches rank ``rank`` of ``world_size`` generates: a contiguous block, the blocks as equal as
    they can be (``floor(k * M / W)`` boundaries), so every micro-batch has exactly one rank."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    return range(rank * num_micro_batches // world_size, (rank + 1) * num_micro_batches // world_size)


def micro_batch_seed(seed: int | None, index: int) -> int:
    """The seed of global micro-batch ``index`` of a rollout seeded ``seed`` (``SamplingParams.seed``; None: 0):
    a pure function of the two, so it does not depend on which rank generates the micro-batch. 63 bits."""
    return (int(seed or 0) * 2_654_435_761 + (int(index) + 1) * 40_503 + 0xC010) % (2**63 - 1)


def rank_groups(prompt_index: Sequence[int], rank: int, world_size: int) -> range:
    """The responses (indices into a prompt-major rollout whose response ``i`` answers prompt ``prompt_index[i]``)
    that rank ``rank`` of ``world_size`` scores: a contiguous block of whole groups (a group: the consecutive
    responses of one prompt), the blocks as equal in groups as they can be (:func:`rank_micro_batches`), empty for a
    rank without any. Whole groups, so a reward that looks at a prompt's responses together (a TRL batched reward
    function) sees the same group whatever the number of ranks, even where a micro-batch split the group."""
    starts = [i for i in range(len(prompt_index)) if i == 0 or prompt_index[i] != prompt_index[i - 1]]
    share = rank_micro_batches(len(starts), rank, world_size)
    if not len(share):
        return range(0)
    stop = starts[share[-1] + 1] if share[-1] + 1 < len(starts) else len(prompt_index)
    return range(starts[share[0]], stop)


#: reward metrics that count (summed over the ranks' shares); the others are means (weighted by responses)
COUNTED_REWARD_METRICS = frozenset(
    {"reward/failures", "reward/timeouts", "reward/failed_samples", "reward/worker_restarts", "reward/unscorable"}
)


def join_scores(
    parts: Sequence[tuple[int, tuple[list[float], dict[str, list], dict[str, float]]] | None], num_responses: int
) -> tuple[list[float], dict[str, list], dict[str, float]]:
    """The ranks' scoring results joined into the whole rollout's, as one
    :meth:`rlplug.rewards.manager.RewardManager.score` call over it would give.

    Args:
        parts: per rank (all-gathered), ``(start, (scores, extra, reward_metrics))`` for the responses
            ``start .. start + len(scores) - 1`` it scored, or None for a rank that had none.
        num_responses: responses of the rollout.

    Returns:
        ``(scores, extra, reward_metrics)``: scores in response order; each ``extra`` list in response order, NaN
        where a rank's reward reported no such value (as the reward manager does across data sources); the
        metrics of :data:`COUNTED_REWARD_METRICS` summed, the others averaged weighted by the rank's responses.

    Raises:
        ValueError: the parts do not cover every response exactly once.
    """
    got = sorted((p for p in parts if p is not None), key=lambda p: p[0])
    covered = [i for start, (scores, _, _) in got for i in range(start, start + len(scores))]
    if covered != list(range(num_responses)):
        raise ValueError(f"the ranks scored responses {covered[:8]}... of {num_responses}: not each exactly once")
    scores = [x for _, (sc, _, _) in got for x in sc]
    keys = list(dict.fromkeys(k for _, (_, extra, _) in got for k in extra))
    extra = {k: [v for _, (sc, ex, _) in got for v in ex.get(k, [math.nan] * len(sc))] for k in keys}
    metrics: dict[str, float] = {}
    for name in dict.fromkeys(m for _, (_, _, ms) in got for m in ms):
        have = [(float(ms[name]), len(sc)) for _, (sc, _, ms) in got if name in ms]
        if name in COUNTED_REWARD_METRICS:
            metrics[name] = sum(v for v, _ in have)
        else:
            weight = sum(w for _, w in have)
            metrics[name] = sum(v * w for v, w in have) / weight if weight else math.nan
    return scores, extra, metrics


def rank_cores(local_rank: int, local_world_size: int, threads: int | None, usable: Sequence[int]) -> list[int]:
    """The cores of local rank ``local_rank``'s engine: ``threads`` of the ``usable`` cores (None: an equal share,
    ``len(usable) // local_world_size``, at least 1), rank after rank, wrapping round when the ranks ask for more
    cores than there are (they then share)."""
    cores = sorted(int(c) for c in usable)
    k = int(threads) if threads else max(1, len(cores) // max(1, local_world_size))
    k = min(k, len(cores))
    start = (local_rank * k) % len(cores)
    return [cores[(start + i) % len(cores)] for i in range(k)]


def idle_ranks(cfg: DictConfig, world_size: int) -> str | None:
    """A warning when a training step has fewer global micro-batches (``data.train_batch_size * rollout.n`` sequences
    over ``rollout.micro_batch_size``) than ranks, which leaves ranks without anything to generate; else None."""
    sequences = int(cfg.data.train_batch_size) * max(1, int(cfg.rollout.n))
    size = int(cfg.rollout.micro_batch_size)
    count = -(-sequences // size)
    if count >= world_size:
        return None
    return (
        f"rollout.colocate: a step's {sequences} sequences make {count} micro-batch(es) of rollout.micro_batch_size="
        f"{size} for {world_size} ranks, so {world_size - count} rank(s) generate nothing. Set "
        f"rollout.micro_batch_size={-(-sequences // world_size)} (or lower) to give every rank a share."
    )


def pin_engine_device() -> str | None:
    """On a CUDA machine: make the local rank's device (``LOCAL_RANK``-th of ``CUDA_VISIBLE_DEVICES``, or of every
    device) the only one the engine processes this rank starts from now on can see, and return it; None without
    CUDA. Call it after the training backend has set up its device (this process's CUDA context is made, so the
    setting only reaches the children)."""
    import torch  # deferred: torch (CUDA query)

    if not torch.cuda.is_available():
        return None
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = [d.strip() for d in visible.split(",") if d.strip()] if visible else []
    devices = devices or [str(i) for i in range(torch.cuda.device_count())]
    os.environ["CUDA_VISIBLE_DEVICES"] = devices[local_rank % len(devices)]
    return os.environ["CUDA_VISIBLE_DEVICES"]


def rank_engine_config(cfg: DictConfig) -> DictConfig:
    """A copy of the run config for this rank's engine: ``trainer.engine_cpus`` set to :func:`rank_cores` of the
    rank on its node (``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``, as torchrun sets them) and ``rollout.num_threads`` to
    their number. The engine process pins itself there (:class:`rlplug.rollout.engine_process.EngineProcess`); the
    ``vllm`` backend binds its OpenMP threads there."""
    from omegaconf import OmegaConf  # deferred: omegaconf (already imported by the config layer)

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = rank_cores(local_rank, local_world, cfg.rollout.get("num_threads"), usable)
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    assert isinstance(out, DictConfig)
    out.trainer.engine_cpus = cores
    out.rollout.num_threads = len(cores)
    return out


#: the metric an engine (rlplug.rollout.engine_process.EngineProcess, the vllm engine child) reports after its first
#: restart: the restarts so far of that engine
RESTARTS = "rollout/engine_restarts"


def generate_colocated(
    num_prompts: int,
    params: SamplingParams,
    generate_part: Callable[[list[int], SamplingParams], RolloutOutput],
    *,
    rank: int,
    world_size: int,
    all_gather: Callable[[Any], list[Any]],
    micro_batch_size: int,
    error: Exception | None = None,
) -> RolloutOutput:
    """This rank's share of a rollout of ``num_prompts`` prompts, generated, then every rank's joined.

    Args:
        num_prompts: prompts of the rollout (``params.n`` responses each).
        params: the rollout's sampling settings; each micro-batch is generated with ``n=1`` and
            ``seed=micro_batch_seed(params.seed, k)``.
        generate_part: ``generate_part(prompt_indices, params) -> RolloutOutput``: one response (``params.n`` is 1)
            per entry of ``prompt_indices`` (indices into the rollout's prompts, repeated ``n`` times in a row for
            a group), in that order; this rank's engine (or its multi-turn episodes).
        rank, world_size: this process's rank and the number of ranks.
        all_gather: ``all_gather(obj) -> [obj of rank 0, obj of rank 1, ...]``, a collective every rank calls.
        micro_batch_size: ``rollout.micro_batch_size`` (sequences per global micro-batch).
        error: an error this rank met before generating (its engine failed to wake): it generates nothing and the
            error goes through the all-gather like one raised while generating, even when the rank has no share.

    Returns:
        The whole rollout on every rank, as one engine would give it: ``len(prompts) * n`` responses, prompt-major,
        ``prompt_index`` into the prompts. ``metrics`` (the engines' numbers) are the means over the micro-batches,
        weighted by their responses (every engine reports its own run totals and gauges), except the counts of
        :data:`rlplug.rollout.utils.COUNTED_ROLLOUT_METRICS` (added up), names ending in ``/max`` or ``_max`` (the
        largest), ``/min`` or ``_min`` (the smallest) and ``rollout/engine_restarts`` (each engine's own count,
        added up over the ranks that report one), plus
        ``rollout/gen_s_rank_max`` / ``rollout/gen_s_rank_min``: the seconds the slowest / fastest rank spent
        generating its share (the max is what the step waits for; their gap is the imbalance).

    Raises:
        ValueError: a part with another number of responses than it was asked for.
        RuntimeError: another rank's generation raised (named with its message); this rank's own error is raised
            as it is. Either way after the all-gather, so no rank is left waiting in it.
    """
    n = max(1, int(params.n))
    sequences = [p for p in range(num_prompts) for _ in range(n)]  # prompt-major, as RolloutOutput
    bounds = micro_batches(len(sequences), micro_batch_size)
    mine: list[tuple[int, RolloutOutput]] = []
    t0 = time.perf_counter()
    try:
        for k in rank_micro_batches(len(bounds), rank, world_size) if error is None else ():
            start, stop = bounds[k]
            part = generate_part(
                sequences[start:stop], dataclasses.replace(params, n=1, seed=micro_batch_seed(params.seed, k))
            )
            if len(part.response_ids) != stop - start:
                raise ValueError(
                    f"micro-batch {k}: the engine returned {len(part.response_ids)} responses for {stop - start} "
                    "prompts with n=1."
                )
            mine.append((k, part))
    except Exception as exc:  # every rank still meets in the all-gather, then every rank raises
        error, mine = exc, []
    gathered = all_gather(
        (time.perf_counter() - t0, mine, None if error is None else f"{type(error).__name__}: {error}")
    )
    if error is not None:
        raise error
    failed = [(r, err) for r, (_, _, err) in enumerate(gathered) if err is not None]
    if failed:
        raise RuntimeError(f"colocated generation failed on rank {failed[0][0]}: {failed[0][1]}")
    parts = sorted((kp for _, got, _ in gathered for kp in got), key=lambda kp: kp[0])
    if [k for k, _ in parts] != list(range(len(bounds))):
        raise RuntimeError(f"colocated generation gathered micro-batches {[k for k, _ in parts]} of {len(bounds)}")
    metrics = merge_engine_metrics([(p.metrics, len(p.response_ids)) for _, p in parts])
    # a running count per engine: each rank's engine restarts on its own, so the ranks' counts add up
    restarts = [
        max(float(p.metrics[RESTARTS]) for _, p in got if RESTARTS in p.metrics)
        for _, got, _ in gathered
        if any(RESTARTS in p.metrics for _, p in got)
    ]
    if restarts:
        metrics[RESTARTS] = sum(restarts)
    seconds = [float(s) for s, _, _ in gathered]  # each rank's own generation: the step waits for the slowest
    metrics["rollout/gen_s_rank_max"], metrics["rollout/gen_s_rank_min"] = max(seconds), min(seconds)
    return RolloutOutput.join([p for _, p in parts], sequences, metrics)
