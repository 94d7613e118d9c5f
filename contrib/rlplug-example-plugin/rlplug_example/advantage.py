"""The ``median_baseline`` advantage estimator: outcome score minus the group median.

For response ``i`` in group ``g`` (the responses sampled for one prompt, ``data["index"]``)::

    score_i = sum_t token_level_rewards[i, t] * response_mask[i, t]
    A_i     = score_i - median({score_j : j in g})
    advantages[i, t] = returns[i, t] = A_i * response_mask[i, t]

The median of an even-sized group is the mean of its two middle values (so a group
``[0, 0, 1, 1]`` has median 0.5 and advantages ``[-0.5, -0.5, 0.5, 0.5]``). Unlike GRPO's mean
baseline, one outlier score moves the baseline little. A group of one response gets advantage 0.
No std normalisation. A variant of the group baselines of GRPO (Shao et al. 2024) and RLOO
(Ahmadian et al. 2024).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from rlplug.plugin import AdvantageEstimator


def median_baseline_advantage(
    data: Mapping[str, torch.Tensor], config: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)``, both ``(B, T) float32``, 0.0 where ``response_mask`` is 0.

    ``data``: ``token_level_rewards`` ``(B, T) float32``, ``response_mask`` ``(B, T)`` (1.0 on
    response tokens), ``index`` ``(B,) int64`` group ids. ``config`` (the ``algorithm`` section)
    is not read.

    Raises ``ValueError`` when the shapes disagree.
    """
    rewards = data["token_level_rewards"]
    mask = data["response_mask"].to(torch.float32)
    index = torch.as_tensor(data["index"])
    if rewards.dim() != 2 or rewards.shape != mask.shape:
        raise ValueError(
            f"median_baseline: token_level_rewards {tuple(rewards.shape)} and response_mask "
            f"{tuple(mask.shape)} must both be (B, T)."
        )
    if index.shape != (rewards.shape[0],):
        raise ValueError(f"median_baseline: index must be ({rewards.shape[0]},) group ids, got {tuple(index.shape)}.")
    scores = (rewards.to(torch.float64) * mask).sum(dim=-1)  # (B,)
    baseline = torch.empty_like(scores)
    for group in torch.unique(index):
        members = index == group
        baseline[members] = torch.quantile(scores[members], 0.5)  # linear interpolation: mean of the middle pair
    advantages = ((scores - baseline).unsqueeze(-1) * mask).to(torch.float32)  # (B, T)
    return advantages, advantages.clone()


median_baseline = AdvantageEstimator(
    fn=median_baseline_advantage,
    requires=("index",),
    group_based=True,
    description="outcome score minus the median score of its group (robust GRPO-style baseline)",
)
