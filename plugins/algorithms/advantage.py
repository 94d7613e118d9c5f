"""Advantage estimators (kind ``advantage_estimator``).

Every estimator is ``fn(data, config) -> (advantages, returns)``: ``data`` maps tensor names to
tensors (``token_level_rewards`` ``(B, T) float32``, ``response_mask`` ``(B, T)`` and the inputs
listed in the estimator's ``requires``: ``values`` ``(B, T) float32``, ``index`` ``(B,) int64``,
``reward_baselines`` ``(B,) float32``); ``config`` is the ``algorithm`` section (DictConfig,
dataclass or dict; defaults ``gamma = 1.0``, ``lam = 1.0``, ``norm_adv_by_std_in_grpo = True``).
Both outputs are ``(B, T) float32`` and exactly 0.0 where ``response_mask`` is 0.

Implementations are vectorised over the batch: recursions over time loop over ``T`` only, group
statistics use scatter (``index_add_``) ops over all groups at once. Group statistics are computed
in float64 so that a group of equal scores gives exactly zero advantage.

Semantics: ``docs/algorithms.md``; reference verl ``verl/trainer/ppo/core_algos.py``
(``compute_gae_advantage_return``, ``compute_grpo_outcome_advantage``,
``compute_rloo_outcome_advantage``, ``compute_reinforce_plus_plus_outcome_advantage``,
``compute_reinforce_plus_plus_baseline_outcome_advantage``, ``compute_remax_outcome_advantage``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

import rlplug
from rlplug.config import config_get
from rlplug.losses import masked_whiten
from rlplug.types import AdvantageEstimator

__all__ = [
    "gae_advantage",
    "grpo_advantage",
    "rloo_advantage",
    "reinforce_plus_plus_advantage",
    "reinforce_plus_plus_baseline_advantage",
    "remax_advantage",
    "group_ids",
]

_GRPO_EPS = 1e-6


# --------------------------------------------------------------------------- input handling
def _rewards_and_mask(data: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    rewards = data["token_level_rewards"]
    mask = data["response_mask"]
    if rewards.dim() != 2 or tuple(mask.shape) != tuple(rewards.shape):
        raise ValueError(
            f"advantage estimator: token_level_rewards {tuple(rewards.shape)} and response_mask "
            f"{tuple(mask.shape)} must both be (B, T)."
        )
    return rewards.to(torch.float32), mask != 0


def _per_row(data: Mapping[str, Any], key: str, batch: int, device: torch.device) -> torch.Tensor:
    x = torch.as_tensor(data[key], device=device)
    if x.dim() != 1 or x.shape[0] != batch:
        raise ValueError(
            f"advantage estimator: '{key}' must be ({batch},) (one value per response), got {tuple(x.shape)}."
        )
    return x


def group_ids(index: Any, device: torch.device | None = None) -> tuple[torch.Tensor, int]:
    """Map group labels to dense ids ``0..G-1``.

    ``index``: ``(B,) int64`` tensor (prompt ids) or a sequence of hashable labels (e.g. verl's
    string uids). Returns ``(ids (B,) int64, G)``.
    """
    if isinstance(index, torch.Tensor):
        uniq, inv = torch.unique(index, return_inverse=True)
        return inv.to(device) if device is not None else inv, int(uniq.numel())
    try:  # numpy arrays of ints and lists of ints go through torch
        t = torch.as_tensor(index)
        if t.dim() == 1 and not t.is_floating_point():
            return group_ids(t, device)
    except (TypeError, ValueError, RuntimeError):
        pass
    mapping: dict[Any, int] = {}
    ids = [mapping.setdefault(label, len(mapping)) for label in index]
    return torch.tensor(ids, dtype=torch.long, device=device), len(mapping)


def _sequence_scores(rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``s_i = sum_t r_it`` over valid tokens, ``(B,) float64``."""
    return torch.where(valid, rewards, torch.zeros((), dtype=rewards.dtype, device=rewards.device)).sum(-1).double()


def _group_stats(scores: torch.Tensor, ids: torch.Tensor, n_groups: int):
    """Per-group (count, sum, mean, unbiased std) as ``(G,) float64``; std 0 for singletons."""
    zeros = torch.zeros(n_groups, dtype=torch.float64, device=scores.device)
    count = zeros.index_add(0, ids, torch.ones_like(scores))
    total = zeros.index_add(0, ids, scores)
    mean = total / count
    centered = scores - mean[ids]
    sq = zeros.index_add(0, ids, centered * centered)
    var = torch.where(count > 1, sq / (count - 1).clamp(min=1), zeros)
    return count, total, mean, var.sqrt()


def _broadcast(per_row: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``(B,)`` -> ``(B, T) float32``, 0 where invalid."""
    x = per_row.to(torch.float32).unsqueeze(-1).expand(valid.shape)
    return torch.where(valid, x, torch.zeros((), dtype=torch.float32, device=valid.device))


def _group_index(data: Mapping[str, Any], batch: int, device: torch.device) -> tuple[torch.Tensor, int]:
    index = data["index"]
    n = len(index) if not isinstance(index, torch.Tensor) else (index.shape[0] if index.dim() == 1 else -1)
    if n != batch:
        shape = tuple(index.shape) if isinstance(index, torch.Tensor) else (len(index),)
        raise ValueError(f"advantage estimator: 'index' must be ({batch},) group ids, got {shape}.")
    return group_ids(index, device)


# --------------------------------------------------------------------------- estimators
def gae_advantage(data: Mapping[str, Any], config: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016, "High-Dimensional Continuous
    Control Using Generalized Advantage Estimation").

    Needs ``values`` ``(B, T) float32``. Backwards over ``t`` from ``nextvalue = 0``,
    ``lastgae = 0``: ``delta = r_t + gamma * nextvalue - V_t``, ``gae = delta + gamma * lam * lastgae``;
    at masked positions both carry over unchanged (the token is skipped, so neither its reward nor
    its value has any influence). ``returns = gae + V``; ``advantages`` = gae whitened over the
    valid tokens of the batch (unbiased variance), then masked **(differs from verl on padding)**.
    ``config``: ``gamma`` (1.0), ``lam`` (1.0).
    """
    rewards, valid = _rewards_and_mask(data)
    values = data["values"]
    if tuple(values.shape) != tuple(rewards.shape):
        raise ValueError(f"gae: values must be (B, T) = {tuple(rewards.shape)}, got {tuple(values.shape)}.")
    values = values.to(torch.float32)
    gamma = float(config_get(config, "gamma", 1.0))
    lam = float(config_get(config, "lam", 1.0))
    B, T = rewards.shape
    r_cols = rewards.t().contiguous()  # (T, B)
    v_cols = values.t().contiguous()
    m_cols = valid.t().contiguous()
    gae_cols = torch.zeros((T, B), dtype=torch.float32, device=rewards.device)
    nextvalue = torch.zeros(B, dtype=torch.float32, device=rewards.device)
    lastgae = torch.zeros_like(nextvalue)
    for t in range(T - 1, -1, -1):
        m_t, v_t = m_cols[t], v_cols[t]
        delta = r_cols[t] + gamma * nextvalue - v_t
        gae = delta + (gamma * lam) * lastgae
        nextvalue = torch.where(m_t, v_t, nextvalue)
        lastgae = torch.where(m_t, gae, lastgae)
        gae_cols[t] = lastgae
    zero = torch.zeros((), dtype=torch.float32, device=rewards.device)
    gae_bt = torch.where(valid, gae_cols.t(), zero)
    returns = torch.where(valid, gae_bt + values, zero)
    advantages = masked_whiten(gae_bt, valid)
    return advantages, returns


def grpo_advantage(data: Mapping[str, Any], config: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage (Shao et al. 2024, DeepSeekMath).

    ``s_i = sum_t r_it``; within each group (``index``): ``a_i = (s_i - mean) / (std + 1e-6)``
    with the unbiased std, or ``a_i = s_i - mean`` when ``norm_adv_by_std_in_grpo`` is false
    (Dr.GRPO, Liu et al. 2025). A group of one response gets 0 **(differs from verl)**.
    Broadcast over T and masked; ``returns`` equals ``advantages`` (as in verl).
    """
    rewards, valid = _rewards_and_mask(data)
    ids, n_groups = _group_index(data, rewards.shape[0], rewards.device)
    scores = _sequence_scores(rewards, valid)
    count, _, mean, std = _group_stats(scores, ids, n_groups)
    adv = scores - mean[ids]
    if bool(config_get(config, "norm_adv_by_std_in_grpo", True)):
        adv = adv / (std[ids] + _GRPO_EPS)
    adv = torch.where(count[ids] > 1, adv, torch.zeros_like(adv))
    advantages = _broadcast(adv, valid)
    return advantages, advantages.clone()


def rloo_advantage(data: Mapping[str, Any], config: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024, "Back to Basics"): ``a_i = s_i - mean of the other responses
    in the group`` ``= (n * s_i - sum) / (n - 1)``; singleton groups get 0. Broadcast over T and
    masked; ``returns`` equals ``advantages``.
    """
    rewards, valid = _rewards_and_mask(data)
    ids, n_groups = _group_index(data, rewards.shape[0], rewards.device)
    scores = _sequence_scores(rewards, valid)
    count, total, _, _ = _group_stats(scores, ids, n_groups)
    n = count[ids]
    adv = torch.where(n > 1, (n * scores - total[ids]) / (n - 1).clamp(min=1), torch.zeros_like(scores))
    advantages = _broadcast(adv, valid)
    return advantages, advantages.clone()


def _discounted_returns(rewards: torch.Tensor, valid: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma * G_{t+1}`` over valid tokens (masked tokens skipped: G carries over); 0 on masked."""
    B, T = rewards.shape
    r_cols = rewards.t().contiguous()
    m_cols = valid.t().contiguous()
    out = torch.zeros((T, B), dtype=torch.float32, device=rewards.device)
    running = torch.zeros(B, dtype=torch.float32, device=rewards.device)
    for t in range(T - 1, -1, -1):
        running = torch.where(m_cols[t], r_cols[t] + gamma * running, running)
        out[t] = running
    return torch.where(valid, out.t(), torch.zeros((), dtype=torch.float32, device=rewards.device))


def reinforce_plus_plus_advantage(data: Mapping[str, Any], config: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted return ``G_t = r_t + gamma * G_{t+1}`` over valid
    tokens (``gamma`` from config, 1.0 default; masked tokens are skipped, like GAE), whitened over
    the valid tokens of the batch and masked. ``returns`` = ``G`` (not whitened).
    """
    rewards, valid = _rewards_and_mask(data)
    gamma = float(config_get(config, "gamma", 1.0))
    returns = _discounted_returns(rewards, valid, gamma)
    return masked_whiten(returns, valid), returns


def reinforce_plus_plus_baseline_advantage(
    data: Mapping[str, Any], config: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline: ``s_i - group mean`` (a singleton group gives 0),
    broadcast over T, whitened over the valid tokens of the batch, masked. ``returns`` equals
    ``advantages`` (as in verl).
    """
    rewards, valid = _rewards_and_mask(data)
    ids, n_groups = _group_index(data, rewards.shape[0], rewards.device)
    scores = _sequence_scores(rewards, valid)
    _, _, mean, _ = _group_stats(scores, ids, n_groups)
    centered = _broadcast(scores - mean[ids], valid)
    advantages = masked_whiten(centered, valid)
    return advantages, advantages.clone()


def remax_advantage(data: Mapping[str, Any], config: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023): ``returns_t = sum_{t' >= t} r_t'`` over valid tokens (masked),
    ``advantages = returns - b_i`` on valid tokens, with ``b_i`` = ``reward_baselines[i]`` the
    score of the greedy response to the same prompt.
    """
    rewards, valid = _rewards_and_mask(data)
    baselines = _per_row(data, "reward_baselines", rewards.shape[0], rewards.device).to(torch.float32)
    zero = torch.zeros((), dtype=torch.float32, device=rewards.device)
    r = torch.where(valid, rewards, zero)
    returns = torch.where(valid, r.flip(-1).cumsum(-1).flip(-1), zero)
    advantages = torch.where(valid, returns - baselines.unsqueeze(-1), zero)
    return advantages, returns


@rlplug.hookimpl
def register_advantage_estimators(register):
    register(
        "gae",
        AdvantageEstimator(gae_advantage, requires=("values",), description="GAE with a learned critic (PPO)"),
    )
    register(
        "grpo",
        AdvantageEstimator(
            grpo_advantage, requires=("index",), group_based=True, description="group-normalised outcome advantage"
        ),
    )
    register(
        "rloo",
        AdvantageEstimator(
            rloo_advantage, requires=("index",), group_based=True, description="leave-one-out group baseline"
        ),
    )
    register(
        "reinforce_plus_plus",
        AdvantageEstimator(reinforce_plus_plus_advantage, description="discounted returns whitened over the batch"),
    )
    register(
        "reinforce_plus_plus_baseline",
        AdvantageEstimator(
            reinforce_plus_plus_baseline_advantage,
            requires=("index",),
            group_based=True,
            description="group-mean baseline, whitened over the batch",
        ),
    )
    register(
        "remax",
        AdvantageEstimator(
            remax_advantage, requires=("reward_baselines",), description="greedy-response baseline (ReMax)"
        ),
    )
