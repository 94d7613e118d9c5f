"""Advantage estimators (kind ``advantage_estimator``).

Every estimator is ``fn(data, config) -> (advantages, returns)``: ``data`` maps tensor names to
tensors (``token_level_rewards`` ``(B, T) float32``, ``response_mask`` ``(B, T)`` and the inputs
listed in the estimator's ``requires``: ``values`` ``(B, T) float32``, ``index`` ``(B,) int64``,
``reward_baselines`` ``(B,) float32``, ``old_log_probs`` / ``sum_pi_squared`` ``(B, T) float32``,
``reward_components`` ``(B, K) float32`` with ``data.columns["reward_components"]``); ``config`` is
the ``algorithm`` section (DictConfig, dataclass or dict; defaults ``gamma = 1.0``, ``lam = 1.0``,
``norm_adv_by_std_in_grpo = True``, ``gdpo_reward_keys = gdpo_reward_weights = None``). Both
outputs are ``(B, T) float32`` and exactly 0.0 where ``response_mask`` is 0. The trainer passes the
scored responses only, so a group may hold fewer than ``rollout.n`` responses; every group-based
estimator gives a group of one advantage 0.

Registered names (``s_i = sum_t r_it`` the sequence score, groups by ``index``; formulas in
``docs/algorithms.md``):

* ``gae``: GAE with a critic, whitened. ``grpo`` (alias ``grpo_vectorized``, verl's name): ``(s_i -
  mean) / (std + 1e-6)``. ``rloo`` (alias ``rloo_vectorized``): leave-one-out mean.
  ``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``, ``remax``.
* ``opo``: ``s_i`` minus the length-weighted group mean ``sum L_j s_j / sum L_j``.
* ``grpo_passk``: only the group's best gets ``(s_max - s_second) / (std + 1e-6)``.
* ``gpg``: ``alpha * (s_i - mean)``, ``alpha = B / #{s != 0}``.
* ``gdpo``: GRPO per reward component (``algorithm.gdpo_reward_keys``), weighted sum
  (``gdpo_reward_weights``), whitened over the batch.
* ``optimal_token_baseline``: reward-to-go minus a per-position group baseline weighted by the
  path-variance proxy ``W_t = sum_{j<=t} (1 - 2 pi_j + sum_pi_squared_j)``;
  ``tir_optimal_token_baseline`` aligns responses by valid token (multi-turn masks with gaps).

Implementations are vectorised over the batch: recursions over time loop over ``T`` only, group
statistics use scatter (``index_add_``) ops over all groups at once. Group statistics are computed
in float64 so that a group of equal scores gives exactly zero advantage.

Semantics: ``docs/algorithms.md``; reference verl ``verl/trainer/ppo/core_algos.py``
(``compute_gae_advantage_return``, ``compute_grpo_outcome_advantage``,
``compute_rloo_outcome_advantage``, ``compute_reinforce_plus_plus_outcome_advantage``,
``compute_reinforce_plus_plus_baseline_outcome_advantage``, ``compute_remax_outcome_advantage``,
``compute_opo_outcome_advantage``, ``compute_grpo_passk_outcome_advantage``,
``compute_gpg_outcome_advantage``, ``compute_gdpo_outcome_advantage``,
``compute_optimal_token_baseline_advantage``, ``compute_multi_turn_optimal_token_baseline_advantage``;
``compute_grpo_vectorized_outcome_advantage`` and ``compute_rloo_vectorized_outcome_advantage`` equal
the ``grpo`` and ``rloo`` functions here).
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rlplug.plugin import AdvantageEstimator, AlgorithmConfig, hookimpl, masked_whiten, typed

__all__ = [
    "gae_advantage",
    "grpo_advantage",
    "rloo_advantage",
    "reinforce_plus_plus_advantage",
    "reinforce_plus_plus_baseline_advantage",
    "remax_advantage",
    "opo_advantage",
    "grpo_passk_advantage",
    "gpg_advantage",
    "gdpo_advantage",
    "gdpo_components",
    "validate_gdpo_config",
    "optimal_token_baseline_advantage",
    "tir_optimal_token_baseline_advantage",
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
    algo = typed(AlgorithmConfig, config)
    gamma = float(algo.gamma)
    lam = float(algo.lam)
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
    if bool(typed(AlgorithmConfig, config).norm_adv_by_std_in_grpo):
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
    the valid tokens of the batch and masked. ``returns`` = ``G`` (not whitened). A masked span
    inside a response (a multi-turn response's environment tokens) is neither discounted nor a
    reset **(differs from verl, whose running return is multiplied by the mask at every position,
    so it restarts from 0 before each masked span)**; with a mask that is 1 then 0 (no span inside)
    the two agree.
    """
    rewards, valid = _rewards_and_mask(data)
    gamma = float(typed(AlgorithmConfig, config).gamma)
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


# --------------------------------------------------------------------------- verl's further estimators
def opo_advantage(data: Mapping[str, Any], config: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline"): the group baseline is the
    length-weighted mean score ``b_g = sum_j L_j s_j / sum_j L_j`` (``L_j`` = valid tokens of response
    ``j``), ``a_i = s_i - b_g``, broadcast over T and masked; ``returns`` equals ``advantages``.

    Needs ``index``. A group of one response gets 0 **(differs from verl, which gives it ``s_i``)**; a
    group whose responses are all empty has no valid token to carry an advantage. Source: verl
    ``compute_opo_outcome_advantage``.
    """
    rewards, valid = _rewards_and_mask(data)
    ids, n_groups = _group_index(data, rewards.shape[0], rewards.device)
    scores = _sequence_scores(rewards, valid)
    lengths = valid.sum(-1).double()
    count, _, _, _ = _group_stats(scores, ids, n_groups)
    zeros = torch.zeros(n_groups, dtype=torch.float64, device=scores.device)
    weight = zeros.index_add(0, ids, lengths)
    baseline = zeros.index_add(0, ids, lengths * scores) / weight.clamp(min=1.0)
    adv = torch.where(count[ids] > 1, scores - baseline[ids], torch.zeros_like(scores))
    advantages = _broadcast(adv, valid)
    return advantages, advantages.clone()


def grpo_passk_advantage(data: Mapping[str, Any], config: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO for Pass@k (Chen et al. 2025, arXiv 2503.19595): in each group only the best response
    gets a non-zero advantage, ``a_best = s_max - s_second_max``, divided by ``std + 1e-6`` (the
    group's unbiased std) when ``norm_adv_by_std_in_grpo`` (default true); every other response
    gets 0. The best is the first row with the group's highest score (on a tie ``s_max -
    s_second_max = 0``, so the choice never matters). Broadcast over T and masked; ``returns``
    equals ``advantages``.

    Needs ``index``. A group of one response gets 0 **(differs from verl, which raises
    ``ValueError``: the trainer passes only the responses whose reward succeeded, so a group can
    shrink to one)**. Source: verl ``compute_grpo_passk_outcome_advantage``.
    """
    rewards, valid = _rewards_and_mask(data)
    B = rewards.shape[0]
    ids, n_groups = _group_index(data, B, rewards.device)
    scores = _sequence_scores(rewards, valid)
    count, _, _, std = _group_stats(scores, ids, n_groups)
    neg_inf = torch.full((n_groups,), -torch.inf, dtype=torch.float64, device=scores.device)
    best = neg_inf.scatter_reduce(0, ids, scores, reduce="amax")
    rows = torch.arange(B, device=scores.device)
    at_best = torch.where(scores == best[ids], rows, torch.full_like(rows, B))
    first = torch.full((n_groups,), B, dtype=torch.long, device=scores.device).scatter_reduce(
        0, ids, at_best, reduce="amin"
    )
    is_best = rows == first[ids]
    others = torch.where(is_best, torch.full_like(scores, -torch.inf), scores)
    second = neg_inf.scatter_reduce(0, ids, others, reduce="amax")
    gap = best - second  # (G,): +inf for a singleton (masked out below)
    if bool(typed(AlgorithmConfig, config).norm_adv_by_std_in_grpo):
        gap = gap / (std + _GRPO_EPS)
    adv = torch.where(is_best & (count[ids] > 1), gap[ids], torch.zeros_like(scores))
    advantages = _broadcast(adv, valid)
    return advantages, advantages.clone()


def gpg_advantage(data: Mapping[str, Any], config: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline"):
    ``a_i = alpha * (s_i - group mean) / f_norm`` with ``alpha = B / max(1, #{i: s_i != 0})`` over the
    responses passed in (the scored responses of the step) and ``f_norm = 1`` (verl's defaults; verl
    reads neither from the config). Broadcast over T and masked; ``returns`` equals ``advantages``.

    Needs ``index``. A group of one response gets 0 **(differs from verl, which gives it
    ``alpha * s_i``)**. Source: verl ``compute_gpg_outcome_advantage``.
    """
    rewards, valid = _rewards_and_mask(data)
    B = rewards.shape[0]
    ids, n_groups = _group_index(data, B, rewards.device)
    scores = _sequence_scores(rewards, valid)
    count, _, mean, _ = _group_stats(scores, ids, n_groups)
    alpha = B / max(1, int(torch.count_nonzero(scores)))
    f_norm = 1.0
    adv = torch.where(count[ids] > 1, alpha * (scores - mean[ids]) / f_norm, torch.zeros_like(scores))
    advantages = _broadcast(adv, valid)
    return advantages, advantages.clone()


def gdpo_components(data: Mapping[str, Any], config: Any) -> tuple[torch.Tensor, list[str], list[float]]:
    """The ``(B, K') float64`` reward components GDPO normalises, their names and weights, chosen by
    ``algorithm.gdpo_reward_keys`` from ``data["reward_components"]`` (column names in
    ``data.columns["reward_components"]``).

    A key is a column name, or a shell-style pattern (``fnmatch``: ``"shaping/*"``) standing for every
    column it matches, in column order **(an rlplug extension: verl takes exact keys only)**; each
    column gets its key's weight (``algorithm.gdpo_reward_weights``, default 1). With no
    keys, the one component is the sequence score ``sum_t token_level_rewards`` (what verl's function
    does when called without its config). Raises ``ValueError`` when the batch has no named
    ``reward_components``, a key matches no column (the message lists the columns there are), or a
    chosen column is NaN for some response (its reward function did not report that name).
    """
    algo = typed(AlgorithmConfig, config)
    keys = list(algo.gdpo_reward_keys or [])
    rewards, valid = _rewards_and_mask(data)
    if not keys:
        return _sequence_scores(rewards, valid).unsqueeze(-1), ["score"], [1.0]
    columns = tuple(getattr(data, "columns", {}).get("reward_components", ()) or ())
    comps = data.get("reward_components")
    if comps is None or not columns:
        raise ValueError(
            f"gdpo: algorithm.gdpo_reward_keys={keys} names reward components, but the batch has no named "
            "'reward_components' (the reward manager puts the values a reward function reports in its dict "
            "there). Use a reward function that returns a dict with these keys, or unset gdpo_reward_keys."
        )
    key_weights = _gdpo_weights(algo, keys)
    picked: list[int] = []
    weights: list[float] = []
    for key, weight in zip(keys, key_weights):
        hits = [j for j, name in enumerate(columns) if fnmatch.fnmatchcase(name, str(key))]
        if not hits:
            raise ValueError(
                f"gdpo: algorithm.gdpo_reward_keys has '{key}', but the reward reports no such component. "
                f"Components this step: {list(columns)}. Set algorithm.gdpo_reward_keys to some of them "
                "(a pattern such as 'shaping/*' matches several)."
            )
        picked.extend(hits)
        weights.extend([weight] * len(hits))
    x = torch.as_tensor(comps, device=rewards.device).double()[:, picked]
    missing = torch.isnan(x).any(0)
    if bool(missing.any()):
        names = [columns[picked[j]] for j in missing.nonzero().flatten().tolist()]
        raise ValueError(
            f"gdpo: reward components {names} are NaN for {int(torch.isnan(x).any(-1).sum())} of {x.shape[0]} "
            "responses: their reward function did not report them. Every reward function in use must report "
            "each of algorithm.gdpo_reward_keys (or leave that key out)."
        )
    return x, [columns[j] for j in picked], weights


def _gdpo_weights(algo: AlgorithmConfig, keys: Sequence[str]) -> list[float]:
    """``algorithm.gdpo_reward_weights`` as floats, one per key (all 1.0 when unset); ``ValueError`` for a
    count that differs from ``keys`` or a non-finite weight."""
    if algo.gdpo_reward_weights is None:
        return [1.0] * len(keys)
    weights = [float(w) for w in algo.gdpo_reward_weights]
    if len(weights) != len(keys):
        raise ValueError(
            f"gdpo: algorithm.gdpo_reward_weights has {len(weights)} weights for {len(keys)} gdpo_reward_keys "
            f"{list(keys)}; give one weight per key, or null for equal weights."
        )
    if not all(math.isfinite(w) for w in weights):
        raise ValueError(f"gdpo: algorithm.gdpo_reward_weights={weights} must be finite numbers.")
    return weights


def validate_gdpo_config(config: Any) -> None:
    """Config-time check of GDPO's settings (``algorithm`` section): ``gdpo_reward_keys`` is a
    non-empty list and ``gdpo_reward_weights`` is null or one finite weight per key. Raises
    ``ValueError``. Whether the reward reports the keys is checked at the first step
    (:func:`gdpo_components`): reward functions report their components only when called.
    """
    algo = typed(AlgorithmConfig, config)
    keys = list(algo.gdpo_reward_keys or [])
    if not keys:
        raise ValueError(
            "GDPO normalises each reward component separately and needs algorithm.gdpo_reward_keys, the names "
            "of the components to use, e.g. algorithm.gdpo_reward_keys=[correctness,format] (the default reward "
            "reports acc, correctness, format, correct_unformatted and shaping/<name>); or use algorithm=gdpo."
        )
    _gdpo_weights(algo, keys)


def gdpo_advantage(data: Mapping[str, Any], config: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO (group reward-decoupled normalisation, arXiv 2601.05242): each reward component ``k``
    (``algorithm.gdpo_reward_keys``, see :func:`gdpo_components`) is GRPO-normalised within each
    group, ``A_k = (r_k - mean_g(r_k)) / (std_g(r_k) + 1e-6)`` (or ``r_k - mean_g`` with
    ``norm_adv_by_std_in_grpo = false``; unbiased std), then ``A = sum_k w_k A_k``
    (``algorithm.gdpo_reward_weights``, default all 1; a key that is a pattern gives its weight to
    every column it matches), broadcast over T, whitened over the valid tokens of the batch and
    masked. ``returns`` equals ``advantages``. A group of one response gets 0 and is left out of
    the whitening statistics **(differs from verl, where its components pass unnormalised)**.

    Needs ``index`` and ``reward_components``. A component is the response's value itself, whatever
    its length **(differs from verl, which places it on the last valid token, so an empty response's
    value lands on the last padded position)**. Raises ``ValueError`` (see :func:`gdpo_components`).
    Source: verl ``compute_gdpo_outcome_advantage``.
    """
    rewards, valid = _rewards_and_mask(data)
    ids, n_groups = _group_index(data, rewards.shape[0], rewards.device)
    comps, _, weights = gdpo_components(data, config)
    norm = bool(typed(AlgorithmConfig, config).norm_adv_by_std_in_grpo)
    total = torch.zeros(rewards.shape[0], dtype=torch.float64, device=rewards.device)
    count = torch.ones(n_groups, dtype=torch.float64, device=rewards.device)
    for k, w in enumerate(weights):  # K is a handful of components
        count, _, mean, std = _group_stats(comps[:, k], ids, n_groups)
        a = comps[:, k] - mean[ids]
        if norm:
            a = a / (std[ids] + _GRPO_EPS)
        total = total + w * a
    in_group = valid & (count[ids] > 1).unsqueeze(-1)  # singleton groups: 0, and out of the whitening
    if not bool(in_group.any()):
        zeros = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device)
        return zeros, zeros.clone()
    advantages = masked_whiten(_broadcast(total, in_group), in_group)
    return advantages, advantages.clone()


def _reward_to_go(rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``G_t = sum_{t' >= t} r_t' M_t'``, ``(B, T) float32``, 0 where the mask is 0."""
    zero = torch.zeros((), dtype=torch.float32, device=rewards.device)
    r = torch.where(valid, rewards, zero)
    return torch.where(valid, r.flip(-1).cumsum(-1).flip(-1), zero)


def _path_energy(data: Mapping[str, Any], valid: torch.Tensor) -> torch.Tensor:
    """OTB's cumulative path-variance proxy ``W_t = sum_{j <= t} M_j w_j``, ``w_j = 1 - 2 pi_j + sum_pi_squared_j``
    (``pi_j = exp(old_log_probs_j)``), times ``rollout_is_weights_j ** 2`` when the batch has that field;
    ``(B, T) float64``."""
    shape = tuple(valid.shape)
    for key in ("old_log_probs", "sum_pi_squared"):
        if tuple(data[key].shape) != shape:
            raise ValueError(f"optimal token baseline: '{key}' must be (B, T) = {shape}, got {tuple(data[key].shape)}.")
    pi = torch.exp(data["old_log_probs"].double())
    w = 1.0 - 2.0 * pi + data["sum_pi_squared"].double()
    is_weights = data.get("rollout_is_weights")
    if is_weights is not None:
        w = w * is_weights.double() ** 2
    return torch.where(valid, w, torch.zeros((), dtype=w.dtype, device=w.device)).cumsum(-1)


def _otb_core(
    returns: torch.Tensor, energy: torch.Tensor, valid: torch.Tensor, ids: torch.Tensor, n_groups: int
) -> torch.Tensor:
    """OTB advantages ``(B, T) float32`` from returns ``G`` and energies ``W`` aligned by position ``t``.

    Per group and position: ``B_t = sum_i G_it W_it M_it / (sum_i W_it M_it + 1e-8)``. Zero tail (verl's
    ``handle_zero_tail=True``): when one response is strictly the longest of its group, its baseline is 0
    from the second-longest length on (no other response is there to predict it). ``A = (G - B) M``; a
    response with no valid token is in no group, and a group with fewer than two such responses gets 0.
    """
    G = returns.double()
    m = valid.double()
    lengths = valid.sum(-1)  # (B,) int64
    member = lengths > 0
    zeros_gt = torch.zeros((n_groups, G.shape[1]), dtype=torch.float64, device=G.device)
    num = zeros_gt.index_add(0, ids, G * energy * m)
    den = zeros_gt.index_add(0, ids, energy * m) + 1e-8
    baseline = (num / den)[ids]  # (B, T)
    size = torch.zeros(n_groups, dtype=torch.long, device=G.device).index_add(0, ids, member.long())
    minus1 = torch.full((n_groups,), -1, dtype=torch.long, device=G.device)
    lens = torch.where(member, lengths, torch.full_like(lengths, -1))
    longest = minus1.scatter_reduce(0, ids, lens, reduce="amax")
    at_longest = member & (lens == longest[ids])
    n_longest = torch.zeros_like(size).index_add(0, ids, at_longest.long())
    second = minus1.scatter_reduce(0, ids, torch.where(at_longest, torch.full_like(lens, -1), lens), reduce="amax")
    tail_row = at_longest & (n_longest[ids] == 1) & (size[ids] >= 2)
    positions = torch.arange(G.shape[1], device=G.device).unsqueeze(0)
    in_tail = tail_row.unsqueeze(-1) & (positions >= second[ids].clamp(min=0).unsqueeze(-1))
    baseline = torch.where(in_tail, torch.zeros_like(baseline), baseline)
    keep = valid & (size[ids] >= 2).unsqueeze(-1)
    return torch.where(keep, (G - baseline).to(torch.float32), torch.zeros((), dtype=torch.float32, device=G.device))


def optimal_token_baseline_advantage(data: Mapping[str, Any], config: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal Token Baseline (Li et al. 2026, arXiv 2602.07078): a baseline per token position.

    ``G_t`` = reward-to-go over valid tokens; ``W_t = sum_{j <= t} (1 - 2 pi_j + sum_v pi_v^2)`` over
    valid tokens (``pi_j = exp(old_log_probs_j)``, ``sum_pi_squared`` from the training backend's
    log-prob pass; each term times ``rollout_is_weights_j ** 2`` when the batch carries that field, as
    verl does); per group and position ``t``: ``B_t = sum_i G_it W_it / (sum_i W_it + 1e-8)`` over the
    responses valid at ``t``; the strictly longest response of a group gets baseline 0 past the
    second-longest length (verl's ``handle_zero_tail=True``); ``advantages = (G - B) M``,
    ``returns = G`` (masked). Positions are absolute (``t``); see
    :func:`tir_optimal_token_baseline_advantage` for masks with gaps.

    Needs ``index``, ``old_log_probs`` and ``sum_pi_squared``. A group with fewer than two non-empty
    responses gets 0 **(differs from verl, which gives a singleton group ``A = G``; an empty response
    is in no group, as in verl's TIR variant)**. Source: verl ``compute_optimal_token_baseline_advantage``.
    """
    rewards, valid = _rewards_and_mask(data)
    ids, n_groups = _group_index(data, rewards.shape[0], rewards.device)
    returns = _reward_to_go(rewards, valid)
    energy = _path_energy(data, valid)
    return _otb_core(returns, energy, valid, ids, n_groups), returns


def tir_optimal_token_baseline_advantage(
    data: Mapping[str, Any], config: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal Token Baseline for multi-turn (tool-integrated) responses, whose ``response_mask`` has
    gaps (tool output): as :func:`optimal_token_baseline_advantage`, but the responses of a group are
    aligned by their ``k``-th valid token instead of by absolute position ``t`` (the zero tail uses the
    valid-token counts). ``G`` and ``W`` are computed on the original positions, so tokens inside the
    gaps are skipped. With gap-free masks it equals ``optimal_token_baseline``.

    Needs ``index``, ``old_log_probs`` and ``sum_pi_squared``. A group with fewer than two non-empty
    responses gets 0 **(differs from verl, which gives a singleton group ``A = G``)**. Source: verl
    ``compute_multi_turn_optimal_token_baseline_advantage``.
    """
    rewards, valid = _rewards_and_mask(data)
    B, T = rewards.shape
    ids, n_groups = _group_index(data, B, rewards.device)
    returns = _reward_to_go(rewards, valid)
    energy = _path_energy(data, valid)
    # k-th valid token of each row -> column k of the compacted arrays; invalid tokens go to a spare column T
    slot = torch.where(valid, valid.long().cumsum(-1) - 1, torch.full((B, T), T, dtype=torch.long, device=valid.device))
    lengths = valid.sum(-1, keepdim=True)
    packed_valid = torch.arange(T, device=valid.device).unsqueeze(0) < lengths
    packed_returns = torch.zeros((B, T + 1), dtype=torch.float32, device=valid.device).scatter(1, slot, returns)
    packed_energy = torch.zeros((B, T + 1), dtype=torch.float64, device=valid.device).scatter(1, slot, energy)
    packed = _otb_core(packed_returns[:, :T], packed_energy[:, :T], packed_valid, ids, n_groups)
    spare = torch.zeros((B, 1), dtype=torch.float32, device=valid.device)
    advantages = torch.cat([packed, spare], dim=1).gather(1, slot)
    return torch.where(valid, advantages, torch.zeros((), dtype=torch.float32, device=valid.device)), returns


@hookimpl
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
    register(
        "grpo_vectorized",
        AdvantageEstimator(
            grpo_advantage, requires=("index",), group_based=True, description="verl's name for grpo (vectorised)"
        ),
    )
    register(
        "rloo_vectorized",
        AdvantageEstimator(
            rloo_advantage, requires=("index",), group_based=True, description="verl's name for rloo (vectorised)"
        ),
    )
    register(
        "opo",
        AdvantageEstimator(
            opo_advantage, requires=("index",), group_based=True, description="length-weighted group baseline (OPO)"
        ),
    )
    register(
        "grpo_passk",
        AdvantageEstimator(
            grpo_passk_advantage,
            requires=("index",),
            group_based=True,
            description="Pass@k: only the best of a group, by its margin over the second best",
        ),
    )
    register(
        "gpg",
        AdvantageEstimator(
            gpg_advantage, requires=("index",), group_based=True, description="group mean baseline rescaled (GPG)"
        ),
    )
    register(
        "gdpo",
        AdvantageEstimator(
            gdpo_advantage,
            requires=("index", "reward_components"),
            group_based=True,
            description="per-component group normalisation, weighted sum, whitened (GDPO)",
            validate=validate_gdpo_config,
        ),
    )
    register(
        "optimal_token_baseline",
        AdvantageEstimator(
            optimal_token_baseline_advantage,
            requires=("index", "old_log_probs", "sum_pi_squared"),
            group_based=True,
            description="per-token baseline weighted by the path-variance proxy (OTB)",
        ),
    )
    register(
        "tir_optimal_token_baseline",
        AdvantageEstimator(
            tir_optimal_token_baseline_advantage,
            requires=("index", "old_log_probs", "sum_pi_squared"),
            group_based=True,
            description="OTB aligned by valid token, for multi-turn masks with gaps",
        ),
    )
