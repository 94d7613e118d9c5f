"""Generation on every rank, as the trainer runs it (``rollout.colocate``; the pure parts are in
:mod:`rlplug.rollout.colocate`): which engine each process builds, the colocated rollout (every rank's micro-batches,
joined), validation rollouts generated the same way, and each rank's share of the scoring, joined.

Every function here that takes a ``trainer`` (a :class:`rlplug.run.trainer.Trainer`) and talks to other ranks is a
collective: every rank calls it at the same point.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig

from rlplug.contracts.registry import Registry
from rlplug.contracts.reward_contract import trl_inputs
from rlplug.contracts.types import RolloutOutput, SamplingParams
from rlplug.orchestration.episodes import rows_for_scoring
from rlplug.rollout.colocate import (
    colocate_enabled,
    generate_colocated,
    idle_ranks,
    join_scores,
    pin_engine_device,
    rank_engine_config,
    rank_groups,
)
from rlplug.rollout.engine_process import build_engine
from rlplug.run.checkpoint import _fault_point

log = logging.getLogger(__name__)

__all__ = [
    "colocated_rollout",
    "colocated_scoring",
    "join_rank_scores",
    "run_colocated",
    "start_engines",
    "validation_rollouts",
]


def start_engines(trainer: Any) -> tuple[bool, Any]:
    """``(colocated, rollout)`` of this process: with :func:`run_colocated`, an engine per rank (in a process of its
    own, on the rank's cores and device); else the main process's engine (:func:`build_engine`: in a process of its
    own in the async modes), None elsewhere. Then the reward managers that score here are prepared (a judge's server
    starts, a reward model loads: outside ``reward.timeout_s``): the training reward on every rank when colocated
    (each scores its share), the validation reward on the main process. Raises what the engines and rewards raise
    and ``ConfigError`` for a colocation the run cannot do."""
    cfg, registry = trainer.cfg, trainer.registry
    colocated = run_colocated(cfg, registry, trainer.coordinator)
    rollout = None
    if colocated:
        pin_engine_device()  # a GPU rank's engine process sees only the rank's device
        rollout = build_engine(
            rank_engine_config(cfg), registry, trainer.model_path, trainer.tokenizer, own_process=True
        )
    elif trainer.is_main:
        rollout = build_engine(cfg, registry, trainer.model_path, trainer.tokenizer)
    trainer.rollout = rollout  # close() reaches it should a reward fail to prepare
    sources = trainer.reward.seen_data_sources  # the train and validation files' (read_run_datasets)
    scoring_here = [trainer.reward] if colocated or trainer.is_main else []
    for manager in dict.fromkeys([*scoring_here, *([trainer.val_reward] if trainer.is_main else [])]):
        manager.prepare(sources)
    return colocated, rollout


def validation_rollouts(trainer: Any, rows: list[dict], params: SamplingParams) -> Callable | None:
    """Colocated: the validation batches (``data.val_batch_size`` rows each) generated now by every rank, as a
    ``generate(chunk)`` that returns them in order to :func:`rlplug.run.evaluate.score_responses` on rank 0; None
    otherwise (rank 0 generates while it scores). A collective."""
    if not trainer.colocated:
        return None
    size = int(trainer.cfg.data.val_batch_size or len(rows) or 1)
    outs = iter([trainer._rollout(rows[s : s + size], params, "validation") for s in range(0, len(rows), size)])
    return lambda chunk: next(outs)


def run_colocated(cfg: DictConfig, registry: Registry, coordinator: Any) -> bool:
    """Whether every rank generates (``rollout.colocate``, :func:`rlplug.rollout.colocate.colocate_enabled`); warns
    when a step has fewer micro-batches than ranks. Raises ``ConfigError`` for a colocation the run cannot do."""
    factory = registry.get("rollout_backend", cfg.rollout.name)
    can_gather = callable(getattr(coordinator, "all_gather", None)) and hasattr(coordinator, "rank")
    on = colocate_enabled(cfg, coordinator.world_size, factory, registry, can_gather=can_gather)
    warning = idle_ranks(cfg, coordinator.world_size) if on else None
    if warning and coordinator.is_main:
        log.warning(warning)
    return on


def colocated_rollout(trainer: Any, rows: list[dict], params: SamplingParams, label: str) -> RolloutOutput:
    """The rollout of ``rows`` with every rank generating its global micro-batches in its own engine (woken for
    the call), joined in order on every rank (:func:`rlplug.rollout.colocate.generate_colocated`); multi-turn
    episodes (``rollout.multi_turn.enable``) run per micro-batch on the rank that generates it. A collective."""
    coordinator = trainer.coordinator

    woke: Exception | None = None
    try:
        trainer.rollout.wake_up()
    except Exception as exc:  # handed to the all-gather, so every rank hears of it (an idle rank's too)
        woke = exc

    def generate_part(indices: list[int], part_params: SamplingParams) -> RolloutOutput:
        if trainer.episodes is not None:
            part_rows = [rows[i] for i in indices]
            return trainer.episodes.generate(part_rows, part_params, step=trainer.global_step + 1)
        return trainer.rollout.generate([rows[i]["prompt_ids"] for i in indices], part_params)

    try:
        _fault_point(label)
        return generate_colocated(
            len(rows),
            params,
            generate_part,
            rank=int(coordinator.rank),
            world_size=int(coordinator.world_size),
            all_gather=coordinator.all_gather,
            micro_batch_size=int(trainer.cfg.rollout.micro_batch_size),
            error=woke,
        )
    finally:
        trainer.rollout.sleep()


def colocated_scoring(trainer: Any, rows: list[dict], out: RolloutOutput) -> Any:
    """Start scoring this rank's share of whole groups (:func:`rlplug.rollout.colocate.rank_groups`) on its
    reward manager's thread; the future's result is ``((start, score's result), seconds)``. None: no responses."""
    coordinator = trainer.coordinator
    share = rank_groups(out.prompt_index, int(coordinator.rank), int(coordinator.world_size))
    if not len(share):
        return None
    mine = out.take(list(share), [out.prompt_index[i] for i in share])
    start = share.start
    wrapped: Any = cf.Future()
    wrapped.rank_share = True  # its result is this rank's share: join_rank_scores joins the ranks'
    try:
        future = trainer.reward.score_async(
            rows_for_scoring(rows, mine),
            lambda: trainer._decode(mine),
            overlap=bool(trainer.cfg.reward.overlap),
            lengths=mine.response_lengths,
            **trl_inputs(trainer, mine),
        )
    except Exception as exc:  # reward.overlap=false scores here: handed over like a thread's error
        wrapped.set_exception(exc)
        return wrapped

    def done(f: Any) -> None:
        try:
            result, seconds = f.result()
        except BaseException as exc:  # handed over: join_rank_scores raises it on every rank
            wrapped.set_exception(exc)
            return
        wrapped.set_result(((start, result), seconds))

    future.add_done_callback(done)
    return wrapped


def join_rank_scores(trainer: Any, future: Any, metrics: dict[str, float]) -> tuple[list[float], dict, dict]:
    """The ranks' scores of :func:`colocated_scoring` joined on every rank (an all-gather); a rank whose scoring
    raised makes every rank raise (``RuntimeError`` naming it), so none is left waiting in a collective."""
    part, error = None, None
    if future is not None:
        try:
            part, metrics["timing_s/reward"] = future.result()
        except Exception as exc:  # reported to every rank below
            error = f"{type(exc).__name__}: {exc}"
    gathered = trainer.coordinator.all_gather((part, error))
    failed = [(rank, err) for rank, (_, err) in enumerate(gathered) if err is not None]
    if failed:
        raise RuntimeError(f"reward scoring failed on rank {failed[0][0]}: {failed[0][1]}")
    n = sum(len(p[1][0]) for p, _ in gathered if p is not None)
    return join_scores([p for p, _ in gathered], n)
