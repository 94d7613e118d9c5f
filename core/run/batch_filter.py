"""Batch filters: the step's rollouts, generated until the filter keeps a full batch of prompts.

A batch filter (kind ``batch_filter``, :class:`rlplug.contracts.types.BatchFilter`) sits between the reward
and the advantages. It sees one scored generation batch and says which responses stay; the
trainer then asks for the next prompts of the data loader, generates and scores them, and keeps
going until ``data.train_batch_size`` prompts (groups) are kept, then trims to exactly that many
(DAPO's dynamic sampling, Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System
at Scale", arXiv 2503.14476; verl's ``recipe/dapo`` trainer)::

    num_gen_batches = 0, kept = []
    repeat:
        rows = loader.next_batch(); num_gen_batches += 1
        generate, score (the same reward as every step), keep = filter(batch, algorithm)
        kept += the prompts with a kept response
        if len(kept) >= train_batch_size: trim to the first train_batch_size prompts; done
        if 0 < max_num_gen_batches <= num_gen_batches: raise BatchFilterLimitError

:func:`collect_rollouts` is that loop; the trainer calls it for every step and it is a plain
generation (one batch, scored later on the reward thread) when no filter is selected. With a
filter, each batch is scored before the next is generated (the filter needs the scores), so the
scoring does not overlap the log-prob passes; the passes run once, on the kept batch.

Resume: the extra batches come from the data loader, whose position is part of every checkpoint,
so a run killed and resumed repeats exactly the batches an uninterrupted run draws. Each extra
generation batch ``k`` of a step samples with the step's seed plus ``k * 104729`` (a prime), so
the draws differ from batch to batch and stay reproducible.

The limit (``algorithm.filter_groups.max_num_gen_batches``, 0: none) raises, as verl does: a run
that cannot fill its batch (the data is too easy or too hard for the model) should stop and say
so rather than train on a smaller batch, which would change the mini-batch arithmetic the config
was validated with.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlplug.base.exit_codes import ExitCode, TrainingStopped
from rlplug.config.schema import AlgorithmConfig, ConfigError, typed
from rlplug.contracts.batch import Batch, rollout_batch
from rlplug.contracts.reward_contract import trl_inputs
from rlplug.contracts.types import RolloutOutput, SamplingParams
from rlplug.orchestration.episodes import rows_for_scoring, token_level_scores
from rlplug.rewards.manager import components_tensor, scored_rows
from rlplug.run.metrics import stage

__all__ = [
    "BatchFilterLimitError",
    "ScoredRollout",
    "batch_filter_name",
    "collect_rollouts",
    "filter_input",
    "kept_groups",
    "loader_source",
]

#: the seed offset between the generation batches of one step (a prime)
SEED_STRIDE = 104_729


class BatchFilterLimitError(TrainingStopped):
    """``algorithm.filter_groups.max_num_gen_batches`` generation batches did not fill the step's batch.

    ``rlplug train`` prints the message and exits with code 1 (:class:`rlplug.base.exit_codes.ExitCode`
    ``ERROR``); the last complete checkpoint is intact."""

    exit_code: int = ExitCode.ERROR


def batch_filter_name(algorithm: Any) -> str | None:
    """The selected batch filter: ``algorithm.batch_filter``, or ``filter_groups`` when
    ``algorithm.filter_groups.enable`` is true (verl's switch); ``None`` when neither is set.

    Raises :class:`rlplug.config.schema.ConfigError` when both name different filters.
    """
    algo = typed(AlgorithmConfig, algorithm)
    name = algo.batch_filter
    enabled = bool(algo.filter_groups.enable)
    if enabled and name not in (None, "filter_groups"):
        raise ConfigError(
            f"algorithm.filter_groups.enable=true selects the batch filter 'filter_groups', but "
            f"algorithm.batch_filter={name}. Set one of them: algorithm.batch_filter={name} with "
            "algorithm.filter_groups.enable=false, or drop algorithm.batch_filter."
        )
    return "filter_groups" if enabled else (str(name) if name else None)


@dataclass
class ScoredRollout:
    """One step's prompts, their responses and the responses' reward, aligned.

    ``rows`` and ``prompt_ids`` hold one entry per prompt; ``out`` (a :class:`RolloutOutput`),
    ``scores`` and every list of ``extra`` (the reward manager's per-response values) one per
    response, with ``out.prompt_index[i]`` the prompt of response ``i``. ``reward_metrics`` are the
    reward manager's counts (``reward/failures`` ...).
    """

    rows: list[dict]
    prompt_ids: list[list[int]]
    out: RolloutOutput
    scores: list[float]
    extra: dict[str, list[float]]
    reward_metrics: dict[str, float]

    def select(self, prompts: Sequence[int], keep: Sequence[bool]) -> ScoredRollout:
        """The prompts ``prompts`` (in that order, renumbered from 0) with their responses where ``keep``."""
        new_id = {p: k for k, p in enumerate(prompts)}
        resp = [i for i, p in enumerate(self.out.prompt_index) if p in new_id and keep[i]]
        resp.sort(key=lambda i: new_id[self.out.prompt_index[i]])  # stable: responses stay in order
        out = self.out.take(resp, [new_id[self.out.prompt_index[i]] for i in resp])
        return ScoredRollout(
            rows=[self.rows[p] for p in prompts],
            prompt_ids=[self.prompt_ids[p] for p in prompts],
            out=out,
            scores=[self.scores[i] for i in resp],
            extra={k: [v[i] for i in resp] for k, v in self.extra.items()},
            reward_metrics=dict(self.reward_metrics),
        )

    @staticmethod
    def concat(parts: Sequence[ScoredRollout]) -> ScoredRollout:
        """Prompts and responses of ``parts`` one after another; a reward value that only some parts
        report is NaN in the others (as the reward manager does); ``reward_metrics`` (counts) are summed."""
        rows: list[dict] = []
        prompt_ids: list[list[int]] = []
        index: list[int] = []
        scores: list[float] = []
        keys = list(dict.fromkeys(k for p in parts for k in p.extra))
        extra: dict[str, list[float]] = {k: [] for k in keys}
        metrics: dict[str, float] = {}
        for p in parts:
            offset = len(prompt_ids)
            rows += p.rows
            prompt_ids += p.prompt_ids
            index += [offset + i for i in p.out.prompt_index]
            scores += p.scores
            n = len(p.scores)
            for k in keys:
                extra[k] += p.extra.get(k, [math.nan] * n)
            for k, v in p.reward_metrics.items():
                metrics[k] = metrics.get(k, 0.0) + float(v)
        # the engine's numbers are run totals and gauges: the latest generation's
        out = RolloutOutput.join([p.out for p in parts], index, dict(parts[-1].out.metrics) if parts else {})
        return ScoredRollout(rows, prompt_ids, out, scores, extra, metrics)


def filter_input(part: ScoredRollout, pad_id: int) -> Batch:
    """The batch a filter sees for one generation batch: the rollout tensors of
    :func:`rlplug.contracts.batch.build_batch` plus ``token_level_scores`` / ``token_level_rewards``
    ``(B, T) float32`` (the score on the last valid token, 0 for a failed reward; the in-reward KL
    comes later, so the two are equal) and ``reward_components`` ``(B, K) float32``."""
    batch = rollout_batch(part.prompt_ids, part.out, pad_id)
    ok = scored_rows(part.extra, len(part.scores))
    batch["token_level_scores"] = token_level_scores(
        torch.tensor(part.scores, dtype=torch.float32) * ok, batch["response_mask"], part.out, ok
    )
    batch["token_level_rewards"] = batch["token_level_scores"]
    batch.set_columns("reward_components", *components_tensor(part.extra, len(part.scores)))
    return batch


def kept_groups(index: torch.Tensor, keep: torch.Tensor) -> list[int]:
    """The group ids (values of ``index`` ``(B,) int64``) whose responses are kept
    (``keep`` ``(B,) bool``), in order of first appearance.

    Raises ``ValueError`` when ``keep`` is not a ``(B,)`` bool tensor, or when it keeps only part of
    a group (a step trains on whole groups: ``data.train_batch_size`` prompts x ``rollout.n``).
    """
    if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool or tuple(keep.shape) != tuple(index.shape):
        got = f"{keep.dtype} {tuple(keep.shape)}" if isinstance(keep, torch.Tensor) else type(keep).__name__
        raise ValueError(
            f"a batch filter must return a (B,) bool tensor (True: keep the response) with B={index.shape[0]}; "
            f"got {got}. Return e.g. `values != values[0]` as a bool tensor, one entry per response."
        )
    seen: dict[int, set[bool]] = {}
    for g, k in zip(index.tolist(), keep.tolist()):
        seen.setdefault(int(g), set()).add(bool(k))
    partial = [g for g, ks in seen.items() if len(ks) == 2]
    if partial:
        raise ValueError(
            f"a batch filter kept only some responses of the groups {partial[:5]} (prompt index); it must keep "
            "or drop whole groups (every response of a prompt the same), since a step trains on "
            "data.train_batch_size prompts x rollout.n responses. Return the same value for every response of a group."
        )
    return [g for g, ks in seen.items() if True in ks]


def _score(trainer: Any, part_rows: list[dict], prompt_ids: list[list[int]], out: RolloutOutput) -> ScoredRollout:
    """Score ``out`` now (on the main process; every process gets the result)."""
    result = None
    if trainer.is_main:
        rows = rows_for_scoring(part_rows, out)
        result = trainer.reward.score(
            rows, trainer._decode(out), lengths=out.response_lengths, **trl_inputs(trainer, out)
        )
    scores, extra, reward_metrics = trainer.coordinator.broadcast(result)
    return ScoredRollout(part_rows, prompt_ids, out, list(scores), dict(extra), dict(reward_metrics))


#: where a step's generation batches come from: ``source(k, params) -> (rows, epoch, out)``, the ``k``-th
#: (0-based) batch of the step with its sampling settings (:func:`loader_source`, or the asynchronous
#: pipeline's queue: :class:`rlplug.run.async_pipeline.RolloutFeed`)
RolloutSource = Callable[[int, SamplingParams], tuple[list[dict], int, RolloutOutput]]


def loader_source(trainer: Any) -> RolloutSource:
    """The synchronous source: the data loader's next batch, generated now (``trainer._rollout``)."""

    def source(k: int, params: SamplingParams) -> tuple[list[dict], int, RolloutOutput]:
        rows, epoch = trainer.loader.next_batch()
        return rows, epoch, trainer._rollout(rows, params)

    return source


def collect_rollouts(
    trainer: Any, step: int, metrics: dict[str, float], source: RolloutSource | None = None
) -> tuple[Any, ...]:
    """The rollouts of training step ``step``: ``(rows, epoch, prompt_ids, out, scoring)``.

    Without a batch filter (``algorithm.batch_filter`` unset): the next batch of the data loader
    and its generation (stage ``gen``); ``scoring`` is ``None`` (the trainer scores on its thread).
    With one: the loop of this module's docstring; ``scoring`` is a finished future holding
    ``((scores, extra, reward_metrics), seconds)`` as :meth:`rlplug.rewards.manager.RewardManager.score_async`
    gives, ``epoch`` the last batch's. Adds ``batch_filter/num_gen_batches``,
    ``batch_filter/kept_groups`` (kept by the filter, before trimming), ``batch_filter/dropped_groups``
    and ``batch_filter/trimmed_groups`` (kept but beyond ``data.train_batch_size``) to ``metrics``;
    ``timing_s/gen`` and ``timing_s/reward`` add up every batch.

    ``trainer`` provides ``cfg``, ``registry``, ``loader``, ``pad_id``, ``reward``, ``is_main``,
    ``coordinator``, ``sampling_params(step=...)``, ``_rollout`` and ``_decode`` (a
    :class:`rlplug.run.trainer.Trainer`). ``source`` gives the generation batches (None:
    :func:`loader_source`, the loader's next batch generated now).

    Raises:
        BatchFilterLimitError: ``algorithm.filter_groups.max_num_gen_batches`` batches were generated
            and fewer than ``data.train_batch_size`` prompts were kept.
        ValueError: the filter returned something other than a ``(B,)`` bool tensor.
    """
    cfg = trainer.cfg
    name = batch_filter_name(cfg.algorithm)
    params = trainer.sampling_params(step=step)
    source = source or loader_source(trainer)
    if name is None:
        with stage(metrics, "gen", fault=None):
            rows, epoch, out = source(0, params)
        return rows, epoch, [r["prompt_ids"] for r in rows], out, None
    batch_filter = trainer.registry.get("batch_filter", name)
    target = int(cfg.data.train_batch_size)
    limit = int(cfg.algorithm.filter_groups.max_num_gen_batches)
    parts: list[ScoredRollout] = []
    kept = dropped = num_gen = 0
    reward_s = 0.0
    while kept < target:
        if 0 < limit <= num_gen:
            raise BatchFilterLimitError(
                f"Step {step}: {num_gen} generation batches (algorithm.filter_groups.max_num_gen_batches={limit}) "
                f"kept {kept} of the data.train_batch_size={target} prompts the batch filter '{name}' needs; "
                f"it dropped {dropped} groups. The prompts are too easy or too hard for the model (every response "
                "to them scores the same). Raise max_num_gen_batches, set it to 0 for no limit, or use other data."
            )
        seed = None if params.seed is None else params.seed + num_gen * SEED_STRIDE
        with stage(metrics, "gen", fault=None):
            rows, epoch, out = source(num_gen, dataclasses.replace(params, seed=seed))
        prompt_ids = [r["prompt_ids"] for r in rows]
        num_gen += 1
        t0 = time.perf_counter()
        part = _score(trainer, rows, prompt_ids, out)
        reward_s += time.perf_counter() - t0
        data = filter_input(part, trainer.pad_id)
        keep = batch_filter(data.fields(), cfg.algorithm)
        groups = kept_groups(data["index"], keep)
        dropped += len(rows) - len(groups)
        kept += len(groups)
        parts.append(part.select(groups, keep.tolist()))
    whole = ScoredRollout.concat(parts)
    whole = whole.select(list(range(target)), [True] * len(whole.scores))
    metrics["batch_filter/num_gen_batches"] = float(num_gen)
    metrics["batch_filter/kept_groups"] = float(kept)
    metrics["batch_filter/dropped_groups"] = float(dropped)
    metrics["batch_filter/trimmed_groups"] = float(kept - target)
    scoring: cf.Future = cf.Future()
    scoring.set_result(((whole.scores, whole.extra, whole.reward_metrics), reward_s))
    return whole.rows, epoch, whole.prompt_ids, whole.out, scoring
