"""Batch filters (kind ``batch_filter``): which responses of a scored generation batch stay.

``filter_groups`` is DAPO's dynamic sampling (Yu et al. 2025, "DAPO: An Open-Source LLM
Reinforcement Learning System at Scale", arXiv 2503.14476, section 3.2; verl's
``algorithm.filter_groups`` in ``recipe/dapo``): a group (the responses to one prompt, same
``index``) whose metric is the same for every response has zero group-normalised advantage and
teaches nothing, so it is dropped; the trainer generates more prompts until the batch is full
(:func:`rlplug.run.batch_filter.collect_rollouts`).

``algorithm.filter_groups.metric`` (verl's names):

====================  ===========================================================================
``acc``               the correctness function's accuracy (its ``acc``, else its score)
``score``             the reward manager's score (correctness + weighted ``reward.shaping``) before the
                      overlong penalty, as verl's ``score`` is the reward function's score before it
``seq_reward``        the summed ``token_level_scores`` (the score, overlong penalty included)
``seq_final_reward``  the summed ``token_level_rewards``; the filter runs before the in-reward KL, so
                      this equals ``seq_reward`` (``algorithm.use_kl_in_reward`` with it is a config error)
any other name        that column of ``reward_components`` (a value the reward function reports)
====================  ===========================================================================

A group is kept when the metric differs within it (verl: ``np.std(values) > 0``; here the
equivalent ``max > min``) or when it has a single response (verl's ``len == 1``, ``rollout.n=1``).
Responses whose reward failed (``reward_failed``) do not count **(differs from verl, which has no
reward failures)**: a group is judged on its scored responses, and one with none is dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from rlplug.plugin import AlgorithmConfig, BatchFilter, MissingInputError, hookimpl, typed

__all__ = ["filter_groups", "metric_values"]

_SEQ = ("seq_reward", "seq_final_reward")


def _column(data: Mapping[str, torch.Tensor], name: str) -> torch.Tensor | None:
    columns = getattr(data, "columns", {}).get("reward_components", ())
    if name not in columns or data.get("reward_components") is None:
        return None
    return data["reward_components"][:, list(columns).index(name)].to(torch.float32)


def metric_values(data: Mapping[str, torch.Tensor], metric: str) -> torch.Tensor:
    """``(B,) float32``: each response's ``metric`` (the table in this module's docstring).

    Raises :class:`rlplug.MissingInputError` naming the available reward components when
    ``metric`` is neither a sequence metric nor a column of ``reward_components``.
    """
    if metric in _SEQ or metric == "score":
        field = "token_level_rewards" if metric == "seq_final_reward" else "token_level_scores"
        if data.get(field) is None:
            raise MissingInputError(f"filter_groups: metric {metric} needs the batch field '{field}'.")
        # masked_fill, not a product with the mask: whatever masked positions hold (NaN, inf) stays out
        values = data[field].masked_fill(data["response_mask"] == 0, 0.0).sum(-1).to(torch.float32)
        overlong = _column(data, "overlong_reward") if metric == "score" else None
        return values if overlong is None else values - torch.nan_to_num(overlong)
    column = _column(data, metric)
    if column is None:
        columns = list(getattr(data, "columns", {}).get("reward_components", ()))
        raise MissingInputError(
            f"filter_groups: algorithm.filter_groups.metric={metric} is not a reward component of this batch "
            f"(components: {columns}); use acc, score, seq_reward, seq_final_reward or one of those."
        )
    return column


def filter_groups(data: Mapping[str, torch.Tensor], config: Any) -> torch.Tensor:
    """``(B,) bool``: True for the responses of the groups whose ``config.filter_groups.metric``
    varies (verl's DAPO dynamic sampling; see the module docstring).

    ``data`` holds ``index`` ``(B,) int64``, ``response_mask``, ``token_level_scores`` and
    ``token_level_rewards`` ``(B, T) float32`` and ``reward_components`` ``(B, K) float32`` with its
    column names; ``config`` is the ``algorithm`` section. Raises :class:`rlplug.MissingInputError`
    for an unknown metric, ``ValueError`` when a scored response lacks the metric (NaN).
    """
    metric = str(typed(AlgorithmConfig, config).filter_groups.metric)
    values = metric_values(data, metric)
    index = data["index"]
    failed = _column(data, "reward_failed")
    ok = torch.ones_like(values, dtype=torch.bool) if failed is None else failed == 0
    if bool(torch.isnan(values[ok]).any()):
        raise ValueError(
            f"filter_groups: some scored responses do not report the metric '{metric}' (NaN); choose a metric "
            "every response has (acc, score, seq_reward)."
        )
    _, inv, counts = torch.unique(index, return_inverse=True, return_counts=True)
    g = counts.shape[0]
    vmax = torch.full((g,), -torch.inf).scatter_reduce(0, inv[ok], values[ok], "amax")
    vmin = torch.full((g,), torch.inf).scatter_reduce(0, inv[ok], values[ok], "amin")
    n_ok = torch.zeros(g).scatter_add(0, inv, ok.to(torch.float32))
    keep = (vmax > vmin) | ((counts == 1) & (n_ok == 1))
    return keep[inv]


def _validate(config: Any) -> None:
    algo = typed(AlgorithmConfig, config)
    metric = algo.filter_groups.metric
    if not metric:
        raise ValueError(
            "algorithm.filter_groups.metric must be set when group filtering is on (as verl): acc (DAPO's choice), "
            "score, seq_reward, seq_final_reward or a reward component."
        )
    if metric == "seq_final_reward" and algo.use_kl_in_reward:
        raise ValueError(
            "algorithm.filter_groups.metric=seq_final_reward with algorithm.use_kl_in_reward=true: the filter runs "
            "before the log-prob passes, so the in-reward KL is not known yet. Use seq_reward, score or acc."
        )


@hookimpl
def register_batch_filters(register):
    register(
        "filter_groups",
        BatchFilter(filter_groups, validate=_validate, description="DAPO dynamic sampling: drop all-equal groups"),
    )
