"""Step metrics, named as verl names them.

:func:`stage` times one stage of the training step into ``timing_s/<name>``; :func:`step_metrics`
computes the per-step statistics of the batch (``critic/score/mean``, ``critic/advantages/max``,
``response_length/clip_ratio``, ...) and :func:`throughput_metrics` the step time and token rates
(``timing_s/step``, ``perf/throughput``, ...). The trainer merges them with the backends'
``actor/*`` / ``critic/*`` metrics and logs the result once per step.

:func:`validation_metrics` names the scored validation responses (``val-core/<data_source>/acc/mean@N``
when the reward reports an accuracy, else ``val-core/<data_source>/reward/mean@N``); the trainer's
validation and ``rlplug eval`` both use it. :class:`Trackers` is the run's group of trackers;
:func:`tracker_name` is the one mapping of names to the characters a tracker accepts (``@`` ->
``_at_``) and :func:`source_tags` the rlplug version and git commit trackers record.

:class:`MetricsLog` writes the run's own metric log, ``<run_dir>/metrics.jsonl`` (one JSON line per
logged step, whatever trackers are on; truncated to the resumed step at a resume), which
:func:`read_metrics_jsonl` reads back; :class:`ProgressBar` is the step loop's progress bar.

All values are Python floats. Statistics over ``(B, T)`` tensors count valid response tokens only
(``response_mask``); ``/mean``, ``/max`` and ``/min`` are left out when nothing is valid.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import math
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Hashable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from omegaconf import OmegaConf

from rlplug.base.host_memory import malloc_trim, rss_bytes
from rlplug.base.run_context import RunContext, takes_run_context
from rlplug.config.run_paths import (  # METRICS_FILE: the run's metric log, one JSON object a line
    METRICS_FILE,
    run_context_for,
    run_dir_for,
)
from rlplug.config.schema import ConfigError, TrainerConfig, config_get, typed
from rlplug.contracts.metric_names import (  # re-exported: their home before rlplug.contracts.metric_names
    TRACKER_NAME_CHARS,
    metric_value,
    source_tags,
    tracker_name,
)
from rlplug.rewards.manager import FAILED
from rlplug.run import checkpoint as _checkpoint  # _checkpoint._fault_point: looked up at each call (tests patch it)

if TYPE_CHECKING:
    import torch

    from rlplug.contracts.batch import Batch
    from rlplug.contracts.types import RolloutOutput

__all__ = [
    "host_memory_metrics",
    "metric_value",
    "stats",
    "stage",
    "step_metrics",
    "progress_metrics",
    "throughput_metrics",
    "ScoredResponse",
    "core_metric",
    "validation_metrics",
    "validation_samples",
    "train_generation_samples",
    "ENV_OPEN",
    "ENV_CLOSE",
    "marked_response",
    "multi_turn_fields",
    "N_BOOTSTRAP",
    "BOOTSTRAP_SEED",
    "subset_sizes",
    "majority_values",
    "prompt_statistics",
    "source_statistics",
    "tracker_name",
    "TRACKER_NAME_CHARS",
    "source_tags",
    "Trackers",
    "METRICS_FILE",
    "MetricsLog",
    "read_metrics_jsonl",
    "ProgressBar",
    "tracker_names",
    "run_context_for",
]


def stats(prefix: str, x: torch.Tensor, mask: torch.Tensor | None = None) -> dict[str, float]:
    """``{<prefix>/mean, <prefix>/max, <prefix>/min}`` of ``x`` (any shape; in float32), over the
    entries where ``mask`` (same shape, nonzero = valid) is set; ``{}`` when none is."""
    if mask is not None:
        x = x[mask.bool()]
    if x.numel() == 0:
        return {}
    x = x.float()
    return {f"{prefix}/mean": x.mean().item(), f"{prefix}/max": x.max().item(), f"{prefix}/min": x.min().item()}


@contextlib.contextmanager
def stage(metrics: dict[str, float], name: str, *, fault: str | bool | None = True) -> Iterator[None]:
    """Time the block into ``metrics["timing_s/<name>"]`` (seconds, added to what is there), then
    reach the fault point ``fault`` (``True``: ``name``; ``None``/``False``: none).

    The fault point is the crash tests' hook (:func:`rlplug.run.checkpoint._fault_point`): it comes
    after the stage's work and its timing, and only when the block did not raise. A block that
    raises records no time.
    """

    start = time.perf_counter()
    yield
    metrics[f"timing_s/{name}"] = metrics.get(f"timing_s/{name}", 0.0) + time.perf_counter() - start
    if fault:
        _checkpoint._fault_point(name if fault is True else fault)


def step_metrics(
    batch: Batch,
    *,
    scores: Sequence[float],
    components: Mapping[str, Sequence[float | None]],
    rollout: RolloutOutput,
    prompt_ids: Sequence[Sequence[int]],
    use_critic: bool,
    scored: torch.Tensor | None = None,
) -> dict[str, float]:
    """The batch statistics of one training step (verl's names).

    ``batch`` holds ``response_mask``, ``token_level_rewards``, ``advantages`` and ``returns``
    ``(B, T) float32`` (and ``values`` with ``use_critic``); ``scores`` are the ``B`` sequence
    scores; ``components`` the reward's named values per response (``RewardManager.score``'s
    ``extra``: lists of ``B`` floats, NaN or ``None`` where a response's reward did not report the
    name); ``rollout`` and ``prompt_ids`` the step's generation and its prompts (token ids);
    ``scored`` ``(B,) bool`` the responses whose reward succeeded (None: all): the score, reward,
    advantage, return, value and reward-component statistics count those only, the length and
    throughput statistics every response.

    Returns ``critic/score/*`` (sequence scores), ``critic/rewards/*`` (summed token-level rewards,
    after the in-reward KL), ``critic/advantages/*`` and ``critic/returns/*`` (valid tokens),
    with a critic ``critic/values/*``, ``critic/vf_explained_var`` (``1 - Var(returns - values)
    / Var(returns)`` over valid tokens, as verl) and ``critic/value_r2`` (``1 - SS_res / SS_tot`` =
    ``1 - mean((returns - values)^2) / Var(returns)`` over valid tokens, +1e-8 in the denominator;
    not in verl), ``critic/<name>/mean`` per reward component
    (the mean of the finite values, in float64), ``response_length/*`` (tokens),
    ``response_length/clip_ratio`` (share of responses cut at ``max_tokens``),
    ``response_length/empty`` (count of empty responses), ``prompt_length/*`` (tokens) and the rollout
    engine's own numbers (``rollout.metrics``, e.g. ``rollout/live_replicas``).
    """
    import numpy as np  # deferred: numpy
    import torch  # deferred: torch

    full_mask = batch["response_mask"]
    keep = torch.ones(full_mask.shape[0], dtype=torch.bool) if scored is None else scored.bool().cpu()
    mask = full_mask * keep.to(full_mask.device, full_mask.dtype).unsqueeze(-1)
    advantages, returns = batch["advantages"], batch["returns"]
    out: dict[str, float] = {}
    out.update(stats("critic/score", torch.tensor(list(scores), dtype=torch.float32)[keep]))
    rewards = batch["token_level_rewards"]
    # torch.where, not a product with the mask: whatever masked positions hold (NaN, inf) stays out
    summed = torch.where(mask != 0, rewards, torch.zeros((), dtype=rewards.dtype, device=rewards.device)).sum(-1)
    out.update(stats("critic/rewards", summed[keep.to(mask.device)]))
    out.update(stats("critic/advantages", advantages, mask))
    out.update(stats("critic/returns", returns, mask))
    if use_critic:
        out.update(stats("critic/values", batch["values"], mask))
        valid = mask.bool()
        if bool(valid.any()):
            ret, val = returns[valid], batch["values"][valid]
            var_r = ret.var(unbiased=False)
            out["critic/vf_explained_var"] = (1.0 - (ret - val).var(unbiased=False) / (var_r + 1e-8)).item()
            # R^2 = 1 - SS_res / SS_tot (both divided by the token count): unlike the explained variance
            # it also counts a constant offset of the values
            out["critic/value_r2"] = (1.0 - ((ret - val) ** 2).mean() / (var_r + 1e-8)).item()
    kept = keep.tolist()
    for name, values in components.items():
        pool = values if name == FAILED else [v for v, k in zip(values, kept) if k]  # the failure rate: all rows
        finite = [v for v in pool if v is not None and not math.isnan(v)]
        if finite:
            out[f"critic/{name}/mean"] = float(np.mean(finite))
    # from the attention mask, as verl does: rollout correction's rejection (rollout_rs) zeroes
    # response_mask tokens, which must not shorten the reported lengths
    attention = batch["attention_mask"][:, -full_mask.shape[1] :] if "attention_mask" in batch else full_mask
    out.update(stats("response_length", attention.sum(-1)))
    out["response_length/clip_ratio"] = float(np.mean(rollout.truncated_flags))
    out["response_length/empty"] = float(sum(1 for n in rollout.response_lengths if n == 0))
    out.update(stats("prompt_length", torch.tensor([len(p) for p in prompt_ids], dtype=torch.float32)))
    out.update({k: float(v) for k, v in rollout.metrics.items()})  # the engine's own (RolloutOutput.metrics)
    return out


def progress_metrics(step: int, epoch: int, kl_coef: float | None = None) -> dict[str, float]:
    """``training/global_step`` (1-based), ``training/epoch`` and, when given, ``actor/kl_coef`` (the
    KL controller's current coefficient)."""
    out = {"training/global_step": float(step), "training/epoch": float(epoch)}
    if kl_coef is not None:
        out["actor/kl_coef"] = float(kl_coef)
    return out


def throughput_metrics(batch: Batch, *, step_time: float, gen_time: float) -> dict[str, float]:
    """``timing_s/step`` (``step_time``, seconds), ``perf/total_num_tokens`` (prompt + response
    tokens of the batch), ``perf/throughput`` (those tokens per second of the step) and
    ``perf/gen_tokens_per_s`` (response tokens per second of generation, ``gen_time``)."""
    n_tokens = float(batch["attention_mask"].sum().item())
    return {
        "timing_s/step": step_time,
        "perf/total_num_tokens": n_tokens,
        "perf/throughput": n_tokens / step_time,
        "perf/gen_tokens_per_s": float(batch["response_mask"].sum(-1).sum().item()) / max(gen_time, 1e-9),
    }


class ScoredResponse(NamedTuple):
    """One scored validation response (built by :func:`rlplug.run.evaluate.score_responses`)."""

    #: the prompt's dataset row (``data_source``, ``messages``, ``ground_truth`` ...)
    row: Mapping[str, Any]
    #: the prompt's position among the scored prompts: the ``n`` responses to one prompt share it
    prompt: int
    #: the decoded response text
    response: str
    #: the sequence score: correctness + weighted shaping (``RewardManager.score``'s ``scores``)
    score: float
    #: ``RewardManager.score``'s ``extra["acc"]``: the reward's ``acc``, else its correctness score; 0.0 on failure
    acc: float
    #: whether the correctness function reported an accuracy (an ``acc`` key, or ``fn.binary = True``)
    acc_reported: bool
    #: the other numbers the correctness function reported (``format``, ``correct_unformatted`` ...)
    components: Mapping[str, float] = {}
    #: the extracted answer the correctness function reported (its dict's ``pred``, verl's key); None: none
    pred: str | None = None


def core_metric(scored: Sequence[ScoredResponse]) -> str:
    """The name of the headline validation metric of one data source's responses: ``"acc"`` when any of
    their reward functions reported an accuracy (returned an ``acc`` key, or is declared binary with
    ``fn.binary = True``), else ``"reward"`` (the sequence score), as verl chooses (``ray_trainer._validate``:
    ``core_var = "acc" if "acc" in var2metric2val else "reward"``)."""
    return "acc" if any(s.acc_reported for s in scored) else "reward"


def validation_metrics(scored: Sequence[ScoredResponse], n: int) -> dict[str, float]:
    """The validation metrics of the scored responses, per data source (sorted); ``rlplug eval`` prints
    the same numbers (one definition, one code path: :func:`rlplug.run.evaluate.score_responses` then this).

    For each data source, with ``<m>`` = :func:`core_metric` (``acc`` or ``reward``) and ``n`` the
    responses per prompt:

    * ``val-core/<data_source>/<m>/mean@<n>``: the mean over prompts of the mean over each prompt's
      responses (verl's ``mean@N``; with ``n`` responses per prompt, the mean over all responses);
    * ``val-core/<data_source>/<m>/best@<n>`` (``n > 1``): the mean over prompts of the best of each
      prompt's ``n`` values; for a 0/1 ``acc`` this is pass@n (exact; rlplug's);
    * verl's statistics (``n > 1``; :func:`source_statistics`, value for value as verl's
      ``process_validation_metrics``): ``std@<n>`` and, for ``k`` in 2, 4, ..., ``n``, the bootstrap
      ``best@<k>/mean``, ``best@<k>/std``, ``worst@<k>/mean``, ``worst@<k>/std`` and, when the reward
      reports extracted answers (:attr:`ScoredResponse.pred`), ``maj@<k>/mean`` and ``maj@<k>/std`` (the
      majority answer's value); those of ``k = n`` (but ``std@``, ``worst@``) under ``val-core``, as verl;
    * when ``<m>`` is ``acc``, the score too: ``val-aux/<data_source>/reward/mean@<n>`` (and the rest);
    * ``val-aux/<data_source>/<name>/mean@<n>`` (and verl's statistics) for every other number the reward
      reported (:attr:`ScoredResponse.components`, e.g. gsm8k's ``format``), over the responses that report it.

    ``acc`` values are the reward's ``acc`` (:attr:`ScoredResponse.acc`; a response whose reward failed
    counts 0.0); ``reward`` values are the sequence scores. Returns ``{}`` for no responses.
    """
    metrics: dict[str, float] = {}
    for src in sorted({s.row["data_source"] for s in scored}):
        mine = [s for s in scored if s.row["data_source"] == src]
        core, prompts, preds = core_metric(mine), [s.prompt for s in mine], [s.pred for s in mine]
        for var in (core,) if core == "reward" else ("acc", "reward"):
            values = [float(s.acc if var == "acc" else s.score) for s in mine]
            metrics.update(source_statistics(f"{src}/{var}", prompts, values, preds, core=var == core, exact_best=True))
        for comp in sorted({k for s in mine for k in s.components}):
            have = [s for s in mine if comp in s.components and math.isfinite(s.components[comp])]
            metrics.update(
                source_statistics(
                    f"{src}/{comp}",
                    [s.prompt for s in have],
                    [s.components[comp] for s in have],
                    [s.pred for s in have],
                    core=False,
                )
            )
    return metrics


# ============================================================================ verl's validation statistics

#: Bootstrap draws and seed of verl's ``process_validation_metrics`` (``n_bootstrap = 1000``, ``seed=42``).
N_BOOTSTRAP = 1000
BOOTSTRAP_SEED = 42


def subset_sizes(n_responses: int) -> list[int]:
    """The bootstrap subset sizes for ``n_responses`` responses per prompt: 2, 4, 8, ... below
    ``n_responses``, then ``n_responses`` itself; ``[]`` for one response (verl's ``gen_ns`` in
    ``process_validation_metrics``). Example: ``subset_sizes(6) == [2, 4, 6]``."""
    if n_responses <= 1:
        return []
    sizes, n = [], 2
    while n < n_responses:
        sizes.append(n)
        n *= 2
    return [*sizes, n_responses]


@functools.lru_cache(maxsize=64)
def _bootstrap_indices(n_data: int, subset_size: int, n_bootstrap: int, seed: int) -> Any:
    """``(n_bootstrap, subset_size) int64`` indices into ``n_data`` values, drawn with replacement by
    ``numpy.random.RandomState(seed).choice``: the draws of verl's ``bootstrap_metric``, which reseeds the
    global NumPy generator with the same seed on every call (so every prompt gets the same indices); a
    private generator gives the same numbers without touching the global one."""
    import numpy as np  # deferred: numpy

    idx = np.random.RandomState(seed).choice(n_data, size=(n_bootstrap, subset_size), replace=True)
    idx.setflags(write=False)
    return idx


def majority_values(values: Any, votes: Any) -> Any:
    """Per row, the value of the majority vote: ``values`` and ``votes`` are ``(R, n)`` arrays (float64 values,
    integer vote codes); returns ``(R,) float64``, each row's value at the first position of its most common
    vote. Ties go to the vote that appears first in the row, and a vote's value is that of its first
    occurrence (verl's ``calc_maj_val``: ``max(vote2cnt, key=vote2cnt.get)`` over first-appearance order,
    then ``vote2vals[maj_vote][0]``). Example: values ``[[1, 0, 0]]``, votes ``[[7, 3, 3]]`` -> ``[0.0]``."""
    import numpy as np  # deferred: numpy

    counts = (votes[:, :, None] == votes[:, None, :]).sum(-1)  # (R, n): how often each position's vote occurs
    first = np.argmax(counts == counts.max(axis=1, keepdims=True), axis=1)  # earliest position of a top vote
    return values[np.arange(values.shape[0]), first]


def prompt_statistics(
    values: Sequence[float],
    preds: Sequence[Hashable] | None = None,
    *,
    n_bootstrap: int = N_BOOTSTRAP,
    seed: int = BOOTSTRAP_SEED,
) -> dict[str, float]:
    """verl's statistics of one prompt's ``n`` response values (``process_validation_metrics``, per uid).

    ``values``: the ``n`` values (acc, score ...); ``preds``: the ``n`` extracted answers (any hashable:
    strings, ``None`` for no answer) or None when the reward reports none. Returns ``mean@n`` and, for
    ``n > 1``, ``std@n`` (population standard deviation, ``numpy.std``) and for each ``k`` in
    :func:`subset_sizes` the mean and standard deviation over ``n_bootstrap`` bootstrap subsets of ``k``
    values drawn with replacement (:func:`_bootstrap_indices`) of the subset's best (``best@k/mean``,
    ``best@k/std``), worst (``worst@k/mean``, ``worst@k/std``) and, with ``preds``, majority-vote value
    (``maj@k/mean``, ``maj@k/std``: :func:`majority_values`; for ``acc`` the majority answer's correctness).
    Matches verl value for value (the same draws).

    Raises ``ValueError`` for no values or ``preds`` of another length.
    """
    import numpy as np  # deferred: numpy

    vals = np.asarray([float(v) for v in values], dtype=np.float64)
    n = int(vals.size)
    if n == 0:
        raise ValueError("prompt_statistics() needs at least one value (the prompt's responses).")
    if preds is not None and len(preds) != n:
        raise ValueError(f"prompt_statistics(): {len(preds)} preds for {n} values; pass one answer per response.")
    out = {f"mean@{n}": float(np.mean(vals))}
    if n == 1:
        return out
    out[f"std@{n}"] = float(np.std(vals))
    codes = None
    if preds is not None:
        first_seen: dict[Hashable, int] = {}
        codes = np.asarray([first_seen.setdefault(p, len(first_seen)) for p in preds], dtype=np.int64)
    for k in subset_sizes(n):
        idx = _bootstrap_indices(n, k, int(n_bootstrap), int(seed))
        sample = vals[idx]  # (n_bootstrap, k)
        for name, reduced in (("best", sample.max(axis=1)), ("worst", sample.min(axis=1))):
            out[f"{name}@{k}/mean"], out[f"{name}@{k}/std"] = float(np.mean(reduced)), float(np.std(reduced))
        if codes is not None:
            maj = majority_values(sample, codes[idx])
            out[f"maj@{k}/mean"], out[f"maj@{k}/std"] = float(np.mean(maj)), float(np.std(maj))
    return out


def source_statistics(
    name: str,
    prompts: Sequence[int],
    values: Sequence[float],
    preds: Sequence[Hashable | None] | None = None,
    *,
    core: bool,
    exact_best: bool = False,
) -> dict[str, float]:
    """The validation statistics of one variable of one data source, named as verl names them.

    ``name`` is ``<data_source>/<variable>`` (``gsm8k/acc``); ``prompts``, ``values`` and ``preds`` give each
    response's prompt position, value and extracted answer (``preds`` None, or all None for a prompt: no
    ``maj@``). Each prompt's :func:`prompt_statistics` are averaged over prompts (verl's
    ``process_validation_metrics``). With ``core`` (the data source's headline variable,
    :func:`core_metric`) the ``mean@N``, ``best@N/*`` and ``maj@N/*`` of the largest ``N`` go to
    ``val-core/``, everything else to ``val-aux/`` (verl's ``_val_metrics_update``). With ``exact_best``, also
    ``best@N`` for ``N > 1``: the mean over prompts of the exact best of the ``N`` values (pass@N for a 0/1
    ``acc``; rlplug's, in the section of ``mean@N``), next to verl's bootstrap estimate ``best@N/mean``.
    """
    import numpy as np  # deferred: numpy

    groups: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(int(p), []).append(i)
    per_metric: dict[str, list[float]] = {}
    for members in groups.values():
        group_preds = [preds[i] for i in members] if preds is not None else None
        if group_preds is not None and all(p is None for p in group_preds):
            group_preds = None
        stats = prompt_statistics([values[i] for i in members], group_preds)
        if exact_best and len(members) > 1:
            stats[f"best@{len(members)}"] = max(float(values[i]) for i in members)
        for metric, v in stats.items():
            per_metric.setdefault(metric, []).append(v)
    if not per_metric:
        return {}
    n_max = max(int(m.split("@")[-1].split("/")[0]) for m in per_metric)
    out: dict[str, float] = {}
    for metric, vs in per_metric.items():
        in_core = core and metric.startswith(("mean", "maj", "best")) and f"@{n_max}" in metric
        out[f"{'val-core' if in_core else 'val-aux'}/{name}/{metric}"] = float(np.mean(vs))
    return out


#: the marks around environment (masked, ``response_mask`` 0) spans in :func:`marked_response`
ENV_OPEN, ENV_CLOSE = "\u27e6", "\u27e7"  # ⟦ ⟧


def marked_response(ids: Sequence[int], mask: Sequence[int], tokenizer: Any) -> str:
    """A multi-turn response as text with its environment spans visible: each run of tokens with the same
    mask value decoded on its own, special tokens kept (the chat template's ``<|im_start|>tool`` ...), and
    every run of mask 0 (tool results and the template tokens the engine did not sample: no loss on them)
    wrapped in ``⟦`` ``⟧`` (U+27E6, U+27E7). The model's own tokens stand unmarked. ``ids`` and ``mask``
    are aligned (``RolloutOutput.response_ids[i]`` / ``response_masks[i]``).

    Raises ``ValueError`` when ``ids`` and ``mask`` differ in length.
    """
    if len(ids) != len(mask):
        raise ValueError(f"marked_response: {len(ids)} token ids but {len(mask)} mask values; they must align.")
    runs: list[tuple[int, int]] = []  # [start, end) of each run of equal mask values
    start = 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or bool(mask[end]) != bool(mask[start]):
            runs.append((start, end))
            start = end
    texts = tokenizer.batch_decode([[int(t) for t in ids[a:b]] for a, b in runs], skip_special_tokens=False)
    return "".join(t if mask[a] else f"{ENV_OPEN}{t}{ENV_CLOSE}" for (a, _), t in zip(runs, texts))


def multi_turn_fields(rollout: RolloutOutput, i: int, tokenizer: Any) -> dict[str, Any]:
    """What a sample row shows of multi-turn response ``i`` of ``rollout`` (``{}`` for a single-turn
    rollout): ``transcript`` (its chat messages, ``{"role", "content"}`` each, the prompt included),
    ``response_marked`` (:func:`marked_response`) and ``step_rewards`` (the environment's rewards per turn,
    in turn order; ``[]`` when it gave none)."""
    if not rollout.multi_turn:
        return {}
    masks = rollout.response_masks
    assert masks is not None  # multi_turn: response_masks is set
    return {
        "transcript": _plain_messages(rollout.transcripts[i] if rollout.transcripts is not None else []),
        "response_marked": marked_response(rollout.response_ids[i], masks[i], tokenizer),
        "step_rewards": [float(r) for _, r in rollout.step_rewards[i]] if rollout.step_rewards is not None else [],
    }


def _plain_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as ``{"role", "content"}`` dicts (plus ``tool_calls`` / ``name`` when a message has
    them), JSON-ready: the transcript a sample row carries."""
    result = []
    for m in messages:
        item: dict[str, Any] = {"role": str(m.get("role", "")), "content": m.get("content") or ""}
        for key in ("name", "tool_calls"):
            if m.get(key) is not None:
                item[key] = m[key]
        result.append(item)
    return result


def _scored_transcript(row: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[float]] | None:
    """The transcript and step rewards a multi-turn scoring row carries (``extra_info["messages"]`` and
    ``extra_info["step_rewards"]``, set by :func:`rlplug.orchestration.episodes.rows_for_scoring`); None for
    a single-turn row."""
    extra = row.get("extra_info")
    if not isinstance(extra, Mapping) or "messages" not in extra or "step_rewards" not in extra:
        return None
    return _plain_messages(extra["messages"] or []), [float(r) for r in extra["step_rewards"] or []]


def validation_samples(scored: Sequence[ScoredResponse]) -> list[dict[str, Any]]:
    """The scored validation responses as the rows trackers log: ``data_source``, ``prompt`` (the last
    message's text), ``response``, ``ground_truth`` and ``score``. A multi-turn response (its row is the
    scoring row of :func:`rlplug.orchestration.episodes.rows_for_scoring`, whose ``extra_info`` holds
    ``messages`` and ``step_rewards``) adds ``transcript`` (the conversation, ``{"role", "content"}`` per
    message; the environment's messages are those after the first assistant message that are not the
    assistant's) and ``step_rewards``; its ``response`` is the last assistant message (what was scored)."""
    samples = []
    for s in scored:
        sample: dict[str, Any] = {
            "data_source": s.row["data_source"],
            "prompt": s.row["messages"][-1]["content"],
            "response": s.response,
            "ground_truth": str(s.row["ground_truth"]),
            "score": s.score,
        }
        turns = _scored_transcript(s.row)
        if turns is not None:
            sample["transcript"], sample["step_rewards"] = turns
        samples.append(sample)
    return samples


def train_generation_samples(
    rows: Sequence[Mapping[str, Any]],
    rollout: RolloutOutput,
    scores: Sequence[float],
    batch: Batch,
    tokenizer: Any,
    k: int,
) -> list[dict[str, Any]]:
    """The first ``k`` responses of a training step as the rows trackers log (``trainer.log_train_generations``).

    ``rows`` are the step's prompt rows, ``rollout`` its generation (``prompt_index`` maps each of the
    ``B`` responses to its row; prompt-major, so with ``rollout.n > 1`` whole groups come first),
    ``scores`` the ``B`` sequence scores, ``batch`` holds ``advantages`` and ``response_mask`` ``(B, T)
    float32``. Each row: ``data_source``, ``prompt`` (the last message's text), ``response`` (decoded with
    ``tokenizer``, special tokens removed), ``ground_truth``, ``score`` and ``advantage`` (the mean of the
    response's token advantages: the advantage itself for outcome-reward estimators such as GRPO; 0.0 for
    an empty response). For a multi-turn rollout each row adds :func:`multi_turn_fields`: ``transcript``,
    ``response_marked`` (the environment's spans in ``⟦`` ``⟧``) and ``step_rewards``; ``advantage`` is then
    the mean over the model's own tokens.
    """
    k = max(0, min(int(k), len(rollout.response_ids)))
    if k == 0:
        return []
    mask = batch["response_mask"][:k].float()
    adv = (batch["advantages"][:k].float() * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    texts = tokenizer.batch_decode(rollout.response_ids[:k], skip_special_tokens=True)
    out = []
    for j in range(k):
        row = rows[rollout.prompt_index[j]]
        out.append(
            {
                "data_source": row["data_source"],
                "prompt": row["messages"][-1]["content"],
                "response": texts[j],
                "ground_truth": str(row["ground_truth"]),
                "score": float(scores[j]),
                "advantage": float(adv[j]),
                **multi_turn_fields(rollout, j, tokenizer),
            }
        )
    return out


#: The step metrics the progress bar shows, with their short labels.
PROGRESS_KEYS = {"critic/score/mean": "score", "actor/pg_loss": "pg_loss", "response_length/mean": "resp_len"}


def progress_postfix(metrics: Mapping[str, float]) -> dict[str, float]:
    """The few step metrics the progress bar shows, short-named (:data:`PROGRESS_KEYS`: ``score``, ``pg_loss``,
    ``resp_len``), as floats (tqdm prints them with 3 significant digits)."""
    return {label: float(metrics[key]) for key, label in PROGRESS_KEYS.items() if key in metrics}


# ============================================================================ the run's own metric log

#: How non-finite floats are spelled in :data:`METRICS_FILE` (strict JSON has no NaN or infinity).
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _json_number(v: float) -> float | str:
    if math.isfinite(v):
        return v
    return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")


def metrics_jsonl_path(run_dir: str | Path) -> Path:
    """``<run_dir>/metrics.jsonl``; a path that already ends in ``.jsonl`` is returned unchanged."""
    p = Path(run_dir)
    return p if p.suffix == ".jsonl" else p / METRICS_FILE


def parse_step_records(
    text: str, path: Path, what: str = "metrics record", list_key: str | None = None
) -> list[tuple[dict[str, Any], str]]:
    """``(record, raw line)`` for each line of a JSON-lines log of per-step records (``metrics.jsonl``,
    ``validation_samples.jsonl``); a cut-short last line (a kill mid-write) is skipped. Each record must
    be an object with an integer ``step`` (and a list under ``list_key`` when given); top-level
    ``"NaN"``/``"Infinity"`` strings become floats.

    Raises ``ValueError`` naming ``path``, the line number and what a ``what`` must look like when a line
    other than the last is not such a record."""
    lines = text.split("\n")
    records: list[tuple[dict[str, Any], str]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("not an object with an integer 'step'")
            if list_key is not None and not isinstance(record.get(list_key), list):
                raise ValueError(f"no {list_key!r} list")
        except ValueError as exc:
            if i == len(lines) - 1:  # an unterminated last line: a write cut short by a kill, skipped
                break
            need = "an integer 'step'" + (f" and a {list_key!r} list" if list_key else "")
            raise ValueError(
                f"{path}:{i + 1} is not a {what} ({exc}): each line must be a JSON object with {need}, "
                "as the trainer writes them. Fix or delete that line."
            ) from None
        records.append(({k: _NONFINITE.get(v, v) if isinstance(v, str) else v for k, v in record.items()}, line))
    return records


def read_metrics_jsonl(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of a run's ``metrics.jsonl`` (:class:`MetricsLog`), in file order: one dict per logged step.

    ``run_dir`` is the run directory (or the ``.jsonl`` file itself). Each record holds ``step`` (int, the
    1-based global step; 0 for the validation before training), ``wall_time`` (float, Unix seconds when it
    was logged) and every metric of that step under its verl name (``actor/pg_loss``,
    ``val-core/<data_source>/acc/mean@N`` ...) as a float, NaN and infinities included. A last line without
    its newline (a write cut short by a kill) is skipped. After a resume the file holds each step once,
    as an uninterrupted run would (the trainer truncates it to the resumed step).

    Raises ``FileNotFoundError`` when there is no such file, ``ValueError`` naming the line when a line
    other than the last is not a record.
    """
    path = metrics_jsonl_path(run_dir)
    if not path.is_file():
        raise FileNotFoundError(
            f"No metrics log at {path}: every rlplug training run writes {METRICS_FILE} in its run directory "
            "(trainer.default_local_dir); pass that directory."
        )
    return [record for record, _ in parse_step_records(path.read_text(encoding="utf-8", errors="replace"), path)]


class MetricsLog:
    """Appends one JSON line per logged step to ``<run_dir>/metrics.jsonl``, whatever trackers are on.

    Each line is ``{"step": int, "wall_time": float, "<metric>": float, ...}`` (numbers only; NaN and the
    infinities are written as the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"`` so the file is strict
    JSON, and :func:`read_metrics_jsonl` turns them back into floats). A line goes to the file in one
    ``write`` on a descriptor opened with ``O_APPEND``, with no buffering in this process, so a process
    killed at any moment leaves whole lines plus at most one cut-short last line.

    ``MetricsLog(run_dir, resume_step)``: the run continues after step ``resume_step`` (0 for a fresh
    start), so the lines of later steps (written by an attempt that stopped before its next checkpoint)
    and a cut-short last line are dropped first; the file is rewritten through a temporary file and an
    atomic rename, and afterwards reads like an uninterrupted run. A fresh start (0) drops every line (with
    ``trainer.overwrite=true`` the earlier run's file was moved aside first:
    :func:`rlplug.run.checkpoint.set_aside_checkpoints`).
    """

    def __init__(self, run_dir: str | Path, resume_step: int = 0) -> None:
        self.path = metrics_jsonl_path(run_dir)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.truncate(int(resume_step))
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)

    def truncate(self, resume_step: int) -> None:
        """Keep the lines of steps ``0..resume_step`` (none when ``resume_step`` is 0) and drop the rest."""
        if not self.path.exists():
            return
        text = self.path.read_text(encoding="utf-8", errors="replace")
        records = parse_step_records(text, self.path)
        kept = "".join(line + "\n" for record, line in records if 0 < resume_step and record["step"] <= resume_step)
        if kept == text:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(kept, encoding="utf-8")
        os.replace(tmp, self.path)

    @staticmethod
    def _line(record: Mapping[str, Any]) -> str:
        out = {k: _json_number(v) if isinstance(v, float) else v for k, v in record.items()}
        return json.dumps(out, allow_nan=False, separators=(",", ":")) + "\n"

    def write(self, metrics: Mapping[str, Any], step: int) -> None:
        """Append the line of ``step`` with the numeric values of ``metrics`` (others are left out)."""
        if self._fd is None:
            return
        record: dict[str, Any] = {"step": int(step), "wall_time": time.time()}
        for key, value in metrics.items():
            v = metric_value(value)
            if v is not None and str(key) not in record:  # a metric cannot be named "step" or "wall_time"
                record[str(key)] = v
        data = memoryview(self._line(record).encode("utf-8"))
        while data:  # one write for a regular file; the loop covers a short write (e.g. a signal mid-write)
            data = data[os.write(self._fd, data) :]

    def close(self) -> None:
        """Flush the file to disk and close it; idempotent."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None


# ============================================================================ progress bar


def _validation_headline(metrics: Mapping[str, float]) -> dict[str, float]:
    """``{"val_acc": x}`` / ``{"val_reward": x}``: the mean over data sources of each ``val-core/<src>/<m>/mean@N``."""
    by_kind: dict[str, list[float]] = {}
    for key, value in metrics.items():
        parts = key.split("/")
        if key.startswith("val-core/") and len(parts) >= 4 and parts[-1].startswith("mean@"):
            by_kind.setdefault(f"val_{parts[-2]}", []).append(float(value))
    return {k: round(sum(v) / len(v), 3) for k, v in sorted(by_kind.items())}


class _BarStdout:
    """``sys.stdout`` while ``bar`` is shown: whole lines go above the bar (cleared, written, redrawn)."""

    def __init__(self, stream: Any, bar: Any) -> None:
        self.stream, self.bar, self._buf = stream, bar, ""

    def write(self, s: str) -> int:
        self._buf += s
        if "\n" in self._buf:
            lines, self._buf = self._buf.rsplit("\n", 1)
            self.bar.clear()
            self.stream.write(lines + "\n")
            self.stream.flush()
            self.bar.refresh()
        return len(s)

    def flush(self) -> None:
        self.stream.flush()

    def drain(self) -> None:
        if self._buf:
            self.stream.write(self._buf)
            self._buf = ""
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding ... of the real stream
        return getattr(self.stream, name)


class ProgressBar:
    """The step loop's progress: a ``tqdm`` bar with the ETA, the last score and the last validation result.

    ``ProgressBar(total, initial, enabled=None)``: ``total`` steps, ``initial`` already done (a resumed run).
    With ``enabled=None`` the bar is shown when both stdout and stderr (where it is drawn) are terminals;
    otherwise nothing is drawn, and the console tracker's line per step (``step N | score ...``) is the
    progress. While the bar is shown, lines printed to stdout (the console tracker, ``validation @ step``)
    appear above it. ``TQDM_DISABLE=1`` turns it off (tqdm's own setting).

    The postfix shows :func:`progress_postfix` of the step and ``val_acc`` (or ``val_reward``): the mean over
    data sources of the last validation's ``val-core/<data_source>/<acc|reward>/mean@N``.
    """

    def __init__(self, total: int, initial: int = 0, enabled: bool | None = None) -> None:

        from tqdm import tqdm  # deferred: tqdm

        if enabled is None:
            enabled = all(callable(getattr(s, "isatty", None)) and s.isatty() for s in (sys.stdout, sys.stderr))
            # tqdm's own switch (its env defaults do not override an explicit disable=False)
            enabled = enabled and os.environ.get("TQDM_DISABLE", "").lower() not in ("1", "true", "yes")
        self.last_validation: dict[str, float] = {}
        self._stdout: _BarStdout | None = None
        self.bar = tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True, disable=not enabled)
        if enabled and not self.bar.disable:
            self._stdout = _BarStdout(sys.stdout, self.bar)
            sys.stdout = self._stdout

    def update(self, step: int, metrics: Mapping[str, float]) -> None:
        """Move the bar to ``step`` (done steps) and show this step's metrics."""
        self.last_validation = _validation_headline(metrics) or self.last_validation
        self.bar.update(max(0, int(step) - self.bar.n))
        shown = progress_postfix(metrics)
        score = {"score": shown.pop("score")} if "score" in shown else {}
        self.bar.set_postfix({**score, **self.last_validation, **shown})  # score, val_acc, pg_loss, resp_len

    def close(self) -> None:
        """Close the bar and give stdout back; idempotent."""

        self.bar.close()
        if self._stdout is not None:
            self._stdout.drain()
            if sys.stdout is self._stdout:
                sys.stdout = self._stdout.stream
            self._stdout = None


# ============================================================================ trackers


def tracker_names(trainer: Any) -> list[str]:
    """The trackers a run opens: ``trainer.logger`` (a list, or one name as a string as verl allows), plus
    ``prometheus`` when ``trainer.prometheus.port`` is set, which is how the Prometheus endpoint is turned
    on (listing ``prometheus`` in ``trainer.logger`` as well changes nothing).

    Raises :class:`rlplug.config.schema.ConfigError` when ``prometheus`` is listed but ``trainer.prometheus.port``
    is null (the endpoint needs a port).
    """
    # free-form: logger=null means no tracker, not the schema's default list
    logger = config_get(trainer, "logger") or []
    names = [str(logger)] if isinstance(logger, str) else [str(n) for n in logger]
    port = typed(TrainerConfig, trainer).prometheus.port
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535):
        raise ConfigError(
            f"trainer.prometheus.port={port!r}: expected a TCP port, an integer in 0..65535 (e.g. 9400), or null "
            "for no Prometheus endpoint."
        )
    if port is None and "prometheus" in names:
        raise ConfigError(
            "trainer.logger lists 'prometheus' but trainer.prometheus.port is null: set the port to serve "
            "/metrics on, e.g. trainer.prometheus.port=9400 (it turns the endpoint on by itself), or drop "
            "'prometheus' from trainer.logger."
        )
    if port is not None and "prometheus" not in names:
        names.append("prometheus")
    return names


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    else:
        out[prefix[:-1]] = d
    return out


def build_tracker(factory: Any, cfg: Any, *, resume_step: int, run: RunContext | None = None) -> Any:
    """Build one tracker: ``factory(cfg, run=run)`` when the factory declares a ``run`` parameter
    (:func:`rlplug.base.run_context.takes_run_context`; ``run`` defaults to :func:`run_context_for` ``(cfg,
    resume_step=resume_step)``), else, as before the run context existed, ``factory(cfg,
    resume_step=resume_step)`` when it takes a ``resume_step`` keyword (or ``**kwargs``; a
    ``DeprecationWarning`` says to declare ``run`` instead), else ``factory(cfg)``.

    ``resume_step`` is the global step the trainer actually resumed from (0: a fresh start), as
    :meth:`Trackers.open` gets it from the trainer; after a fallback from a corrupt latest checkpoint
    to an earlier one (:func:`rlplug.run.checkpoint.resume_checkpoint`) it is the earlier one's step, which
    the ``latest`` pointer on disk does not say. The built-in trackers use it for TensorBoard's
    ``purge_step`` and the MLflow/W&B ``resume_step`` tags.
    """

    if takes_run_context(factory):
        return factory(cfg, run=run if run is not None else run_context_for(cfg, resume_step=resume_step))
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return factory(cfg)
    if any(p.name == "resume_step" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        if any(p.name == "resume_step" for p in params):
            warnings.warn(
                f"The tracker factory {getattr(factory, '__qualname__', factory)!r} takes 'resume_step': declare a "
                "keyword parameter 'run' instead, which gets an rlplug.plugin.RunContext (run_dir, resume_step). "
                "Factories taking 'resume_step' are built this way for one more release.",
                DeprecationWarning,
                stacklevel=2,
            )
        return factory(cfg, resume_step=int(resume_step))
    return factory(cfg)


class Trackers:
    """The run's trackers (``trainer.logger``, kind ``tracker``) as one: every call goes to each.

    :meth:`open` builds them (on the main process only; the others keep an empty group) and logs
    the flattened, resolved config as params; :meth:`close` maps the run status ``finished`` /
    ``interrupted`` / anything else to ``FINISHED`` / ``KILLED`` / ``FAILED`` and ignores errors,
    so no MLflow run is left ``RUNNING``. If building one fails, those already open are closed.
    On the main process it also writes the run's own log, ``<run_dir>/metrics.jsonl`` (:class:`MetricsLog`,
    opened by :meth:`open` after truncating it to the resumed ``step``), before the trackers get each step,
    and owns the progress bar (:meth:`progress`), which :meth:`close` closes too.
    :meth:`log_train_generations` logs a few training rollouts every ``trainer.log_train_generations``
    steps and :meth:`log_final_model` records the exported model as a param and a pointer artifact.
    """

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.metrics_log: MetricsLog | None = None
        self.bar: ProgressBar | None = None

    def open(self, cfg: Any, registry: Any, *, model_path: str, is_main: bool, step: int = 0) -> None:
        """Open ``metrics.jsonl`` (keeping the lines of steps up to ``step``, the step the run resumes
        after; 0: a fresh start) and the trackers :func:`tracker_names` lists; main process only."""
        if not is_main:
            return

        try:
            run = RunContext(run_dir_for(cfg), int(step))  # what each tracker is told (build_tracker)
            self.metrics_log = MetricsLog(run.run_dir, step)
            for name in tracker_names(cfg.trainer):
                self.items.append(build_tracker(registry.get("tracker", name), cfg, resume_step=step, run=run))
        except BaseException:
            self.close("failed")
            raise
        flat = _flatten(OmegaConf.to_container(cfg, resolve=True))
        flat["model.resolved_path"] = str(model_path)
        self.log_params(flat)

    def log_params(self, params: dict[str, Any]) -> None:
        for t in self.items:
            t.log_params(params)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.metrics_log is not None:  # first: the run's own log does not depend on a tracker working
            self.metrics_log.write(metrics, step)
        for t in self.items:
            t.log_metrics(metrics, step)

    def progress(self, total: int, initial: int) -> ProgressBar:
        """The step loop's :class:`ProgressBar` (``initial`` of ``total`` steps done); never drawn on a
        process without trackers (the non-main processes of a multi-process run)."""
        self.bar = ProgressBar(total, initial, enabled=None if self.metrics_log is not None else False)
        return self.bar

    def log_table(self, name: str, rows: list[dict], step: int) -> None:
        for t in self.items:
            t.log_table(name, rows, step)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        for t in self.items:
            t.log_artifact(path, artifact_path)

    def set_tags(self, tags: dict[str, str]) -> None:
        """Set run tags on the trackers that have the optional ``set_tags`` method (``mlflow``); others skip them."""
        for t in self.items:
            set_tags = getattr(t, "set_tags", None)
            if callable(set_tags):
                set_tags(tags)

    def log_train_generations(
        self,
        step: int,
        trainer_cfg: Any,
        rows: Sequence[Mapping[str, Any]],
        rollout: Any,
        scores: Any,
        batch: Any,
        tok: Any,
    ) -> None:
        """Every ``trainer.log_train_generations`` steps (0: never), log ``trainer.train_samples_to_log``
        responses of training step ``step`` (:func:`train_generation_samples`) as the table
        ``train_generations/step_<step:06d>.json``; nothing on processes without trackers."""
        every = int(trainer_cfg.get("log_train_generations", 0) or 0)
        if not self.items or every <= 0 or step % every:
            return
        k = int(trainer_cfg.get("train_samples_to_log", 4))
        samples = train_generation_samples(rows, rollout, scores, batch, tok, k)
        self.log_table(f"train_generations/step_{step:06d}.json", samples, step)

    def log_final_model(self, path: str | Path, step: int) -> None:
        """Record the exported final model of step ``step``: the param ``final_model_path`` (absolute) and the
        artifact ``final_model.json``, a pointer holding that path, the step and the folder's files with their
        sizes in bytes. The folder itself is not copied into the tracker (a second copy of the weights, 0.5 GB
        for the default model, buys nothing: the run directory keeps it)."""
        if not self.items:
            return
        folder = Path(path).resolve()
        self.log_params({"final_model_path": str(folder)})
        files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
        pointer = {"final_model_path": str(folder), "global_step": int(step), "files": files}
        with tempfile.TemporaryDirectory(prefix="rlplug-final-model-") as tmp:
            file = Path(tmp) / "final_model.json"
            file.write_text(json.dumps(pointer, indent=1))
            self.log_artifact(file)

    def close(self, status: str) -> None:
        label = {"finished": "FINISHED", "interrupted": "KILLED"}.get(status, "FAILED")
        for obj in (self.bar, self.metrics_log):
            if obj is not None:
                with contextlib.suppress(Exception):
                    obj.close()
        for t in self.items:
            with contextlib.suppress(Exception):
                t.close(status=label)


def host_memory_metrics(trainer_cfg: Any, rollout: Any) -> dict[str, float]:
    """After a step (and its validation): with ``trainer.malloc_trim`` (``trainer_cfg``), give the C heap's free
    memory back to the OS (``timing_s/malloc_trim``, seconds); then ``perf/rss_gb``, this process's resident memory
    in GiB (:mod:`rlplug.base.host_memory`), and ``perf/rollout_rss_gb``, the rollout engine's process's, where the
    rollout backend ``rollout`` has an integer ``pid`` (vllm's engine child, an engine process). Never raises."""
    out: dict[str, float] = {}
    if trainer_cfg.get("malloc_trim", True):
        took = malloc_trim()
        if took is not None:
            out["timing_s/malloc_trim"] = took
    rss = rss_bytes()
    if rss:
        out["perf/rss_gb"] = rss / 2**30
    pid = getattr(rollout, "pid", None)  # a rollout engine in a process of its own
    if isinstance(pid, int) and (engine_rss := rss_bytes(pid)):
        out["perf/rollout_rss_gb"] = engine_rss / 2**30
    return out
