"""Policy losses (kind ``policy_loss``): PPO's clipped surrogate, its dual-clip variant, and the
other losses of verl's ``core_algos.py`` (gspo, sapo, gpg, geo_mean, dro, cispo, dppo_tv, dppo_kl,
clip_cov, kl_cov).

Every loss has the one policy-loss signature (:class:`rlplug.contracts.types.PolicyLoss`)::

    fn(old_log_probs, log_probs, advantages, response_mask, *, config, loss_agg_mode, normalizer,
       max_response_length=None, rollout_is_weights=None) -> (loss, metrics)

``old_log_probs``, ``log_probs``, ``advantages``, ``response_mask`` are ``(B, T) float32``
(log-probs in nats of the sampled tokens), ``config`` is the ``actor`` config section,
``loss_agg_mode`` / ``normalizer`` / ``max_response_length`` go to :func:`rlplug.algorithms.losses.agg_loss`
(``normalizer``: the whole mini-batch's count; ``actor.loss_scale_factor`` replaces
``max_response_length`` when set), and ``rollout_is_weights`` ``(B, T) float32`` or ``None`` are
detached truncated importance weights against the rollout engine (``actor.rollout_is_threshold``,
computed by :func:`rlplug.algorithms.objective.truncated_is_weights`): each token's loss is multiplied by its
weight before aggregation, as verl's ``compute_policy_loss_*`` do (``geo_mean``, whose loss is one
number per sequence, uses the geometric mean of its tokens' weights). Values on padded positions
never reach the loss or the gradient. They return a scalar loss tensor (this micro-batch's
contribution to the mini-batch loss) and ``dict[str, float]`` metrics computed as masked means over
THIS micro-batch's valid tokens (the caller weights them), from the unweighted per-token terms:
``pg_clipfrac``, ``pg_clipfrac_lower`` (0.0 for a loss without such a clip) and ``ppo_kl`` (masked
mean of ``old_log_probs - log_probs``, nats, with the loss's own clamp of the log-ratio).

The losses (``r = exp(clamp(log_probs - old_log_probs, -20, 20))``, ``A`` the advantage, ``sg``
stop-gradient, ``eps_low`` / ``eps_high`` = ``actor.clip_ratio_low`` / ``clip_ratio_high``, both
defaulting to ``actor.clip_ratio``), per valid token unless said otherwise:

* ``vanilla`` (PPO, Schulman et al. 2017): ``max(-A r, -A clamp(r, 1 - eps_low, 1 + eps_high))``;
  ``pg_clipfrac``: share where the clipped term is the larger.
* ``dual_clip`` (Ye et al. 2020): as vanilla, capped at ``-A * clip_ratio_c`` where ``A < 0``;
  ``pg_clipfrac_lower``: share with ``A < 0`` where the cap is active.
* ``gspo`` (Zheng et al. 2025, GSPO): the sequence ratio ``s_i = exp(mean_t(log_probs - old_log_probs))``
  replaces ``r`` with the token-level gradient of GSPO-token: ``s_it = exp(min(sg(log s_i) +
  log_probs - sg(log_probs), 10))``, then the vanilla clip. Use ``seq-mean-token-mean``.
* ``sapo`` (SAPO, arXiv 2511.20347): ``-A * f(r)`` with the soft gate
  ``f(r) = sigmoid(tau (r - 1)) * 4 / tau``, ``tau = actor.tau_pos`` where ``A > 0``, else
  ``actor.tau_neg``. Use ``seq-mean-token-mean``.
* ``gpg`` (Chu et al. 2025, GPG): the plain policy gradient ``-A * log_probs``.
* ``geo_mean`` (Zhao et al. 2025, GMPO): one loss per sequence, ``-mean_t(A) * exp(mean_t(l_t))``
  with the log-ratio ``l_t = log_probs - old_log_probs`` clipped to ``[-eps_low, eps_high]`` on the
  side the sign of ``A`` makes pessimistic, counted on each of the sequence's valid tokens.
  ``pg_clipfrac`` / ``pg_clipfrac_lower``: share of valid tokens with a clipped ``l_t`` and
  ``A > 0`` / ``A < 0``. Use ``seq-mean-token-mean`` (= verl's mean over sequences).
* ``dro`` (Richemond et al. 2024, Direct Reward Optimisation): ``-(A * log_probs -
  0.5 * actor.dro_beta * (log_probs - old_log_probs)^2)``.
* ``cispo`` (MiniMax-M1, MiniMax 2025): ``-sg(clamp(r, 1 - eps_low, 1 + eps_high)) * A * log_probs``;
  ``pg_clipfrac``: share where the clamp is active.
* ``dppo_tv`` / ``dppo_kl`` (Divergence PPO, arXiv 2602.04879): ``-A * sg(min(r, clip_ratio_c)) *
  log_probs * v`` with ``v`` (no gradient) 0 on tokens that left the trust region: ``dppo_tv`` by the
  probability difference ``p - p_old > eps_high`` (``A > 0``) or ``< -eps_low`` (``A <= 0``),
  ``dppo_kl`` by the binary KL ``p_old log(p_old/p) + (1 - p_old) log((1 - p_old)/(1 - p)) > eps``
  moving in the advantage's direction. ``pg_clipfrac``: share with ``v = 0``;
  ``pg_clipfrac_lower``: share with ``v = 1`` and ``r > clip_ratio_c``.
* ``bypass_mode`` (verl's rollout-correction bypass mode): ``old_log_probs`` are the engine's;
  ``algorithm.rollout_correction.loss_type=ppo_clip`` is ``vanilla`` on the mask after rejection,
  ``reinforce`` is ``-A * log_probs * w`` with ``w`` the truncated importance weights of the current
  policy against the engine (computed per micro-batch, no gradient).
* ``clip_cov`` / ``kl_cov`` (Cui et al. 2025, arXiv 2505.22617): with ``cov = (A - mean A) *
  (log_probs - mean log_probs)`` over the WHOLE mini-batch's valid tokens (their
  ``PolicyLoss.minibatch_stats``, computed once per mini-batch by the update loop), ``clip_cov``
  cuts the gradient (loss 0) of ``max(int(clip_cov_ratio * N), 1)`` tokens picked at random (a
  generator seeded from the run seed and the optimizer step) among the unclipped ones with
  ``clip_cov_lb < cov < clip_cov_ub``, else vanilla; ``kl_cov`` is ``-A r`` (no clip) plus
  ``ppo_kl_coef * |log_probs - old_log_probs|`` on the ``max(1, int(kl_cov_ratio * N))`` tokens
  of largest ``cov``. ``pg_clipfrac``: share of the tokens cut / penalised.

Source: verl ``compute_policy_loss_vanilla``, ``_gspo``, ``_sapo``, ``_gpg``, ``_geo_mean``, ``_dro``,
``_cispo``, ``_dppo_tv``, ``_dppo_kl``, ``_clip_cov``, ``_kl_cov`` (``verl/trainer/ppo/core_algos.py``). Unlike verl, ``vanilla``
has no dual clip (``dual_clip`` adds it); ``gspo``, ``sapo`` and ``geo_mean`` aggregate with
``actor.loss_agg_mode`` like every loss (verl forces a sequence mean; the presets set
``seq-mean-token-mean``, which equals it); see ``docs/algorithms.md`` for every difference.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from omegaconf import OmegaConf

from rlplug.plugin import (
    ActorConfig,
    MiniBatchContext,
    PolicyLoss,
    agg_loss,
    compute_rollout_correction,
    hookimpl,
    masked_mean,
    offpolicy_metrics,
    parse_rollout_correction,
    seq_norm_length,
    typed,
    with_threshold_alias,
)

__all__ = [
    "bypass_mode_policy_loss",
    "validate_bypass_mode",
    "vanilla_policy_loss",
    "dual_clip_policy_loss",
    "validate_dual_clip",
    "gspo_policy_loss",
    "sapo_policy_loss",
    "validate_sapo",
    "gpg_policy_loss",
    "geo_mean_policy_loss",
    "dro_policy_loss",
    "validate_dro",
    "cispo_policy_loss",
    "dppo_tv_policy_loss",
    "dppo_kl_policy_loss",
    "validate_dppo",
    "clip_cov_policy_loss",
    "clip_cov_minibatch_stats",
    "clip_cov_generator",
    "validate_clip_cov",
    "kl_cov_policy_loss",
    "kl_cov_minibatch_stats",
    "validate_kl_cov",
]


def _actor(config: Any) -> ActorConfig:
    """``config`` (the ``actor`` section: DictConfig, dataclass, mapping or ``None``) read as the schema's
    :class:`ActorConfig` with :func:`typed`; an :class:`ActorConfig` is returned as it is (so the helpers
    below may call this again for free)."""
    return typed(ActorConfig, config)


def _clip_range(config: Any) -> tuple[float, float]:
    """``(eps_low, eps_high)``: ``actor.clip_ratio_low`` / ``clip_ratio_high``, each ``actor.clip_ratio``
    (0.2) when unset."""
    actor = _actor(config)
    clip_ratio = float(actor.clip_ratio)
    low = float(actor.clip_ratio_low if actor.clip_ratio_low is not None else clip_ratio)
    high = float(actor.clip_ratio_high if actor.clip_ratio_high is not None else clip_ratio)
    return low, high


def _check_shapes(old_log_probs, log_probs, advantages, response_mask) -> None:
    shapes = {
        "old_log_probs": tuple(old_log_probs.shape),
        "log_probs": tuple(log_probs.shape),
        "advantages": tuple(advantages.shape),
        "response_mask": tuple(response_mask.shape),
    }
    if len(set(shapes.values())) != 1:
        raise ValueError(f"policy loss inputs must all be (B, T); got {shapes}.")


def _weighted(
    per_token: torch.Tensor, rollout_is_weights: torch.Tensor | None, response_mask: torch.Tensor
) -> torch.Tensor:
    """``per_token * rollout_is_weights`` (detached weights, 0.0 on masked positions: a NaN there would
    reach the gradient through the product), or ``per_token`` without weights."""
    if rollout_is_weights is None:
        return per_token
    if rollout_is_weights.shape != per_token.shape:
        raise ValueError(
            f"rollout_is_weights has shape {tuple(rollout_is_weights.shape)} but the policy loss inputs are "
            f"{tuple(per_token.shape)}; both must be (B, T)."
        )
    w = rollout_is_weights.detach()
    return per_token * torch.where(response_mask != 0, w, torch.zeros((), dtype=w.dtype, device=w.device))


def _surrogate(old_log_probs, log_probs, advantages, config):
    """Per-token PPO terms: (ratio, L1, L2, max(L1, L2))."""
    low, high = _clip_range(config)
    log_ratio = torch.clamp(log_probs - old_log_probs, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    l1 = -advantages * ratio
    l2 = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    return l1, l2, torch.maximum(l1, l2)


def _ppo_metrics(l1, l2, old_log_probs, log_probs, response_mask, lower_clipped=None) -> dict[str, float]:
    """``pg_clipfrac`` (share of valid tokens where ``L2 > L1``), ``pg_clipfrac_lower`` (share where
    ``lower_clipped`` holds; 0.0 without a lower clip) and ``ppo_kl`` (masked mean of
    ``old_log_probs - log_probs``, nats); no gradient."""
    with torch.no_grad():
        lower = 0.0 if lower_clipped is None else float(masked_mean(lower_clipped.float(), response_mask).item())
        return {
            "pg_clipfrac": float(masked_mean((l2 > l1).float(), response_mask).item()),
            "pg_clipfrac_lower": lower,
            "ppo_kl": float(masked_mean(old_log_probs - log_probs, response_mask).item()),
        }


def vanilla_policy_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    config: Any = None,
    loss_agg_mode: str = "token-mean",
    normalizer: float | torch.Tensor | None = None,
    max_response_length: int | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate loss.

    ``ratio = exp(clamp(log_probs - old_log_probs, -20, 20))``, ``L1 = -A * ratio``,
    ``L2 = -A * clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)``, per-token loss
    ``max(L1, L2)``, aggregated by :func:`rlplug.algorithms.losses.agg_loss` with ``loss_agg_mode``,
    ``normalizer`` (global count of the whole mini-batch; ``None`` = this micro-batch is the
    whole mini-batch) and ``max_response_length`` (for ``seq-mean-token-sum-norm``).
    ``config``: the actor section (``clip_ratio`` 0.2; ``clip_ratio_low``/``clip_ratio_high``
    default to ``clip_ratio``), as DictConfig, dataclass or dict. ``rollout_is_weights``
    ``(B, T) float32`` (detached, truncated IS against the rollout engine) or ``None``: the
    per-token loss becomes ``w * max(L1, L2)`` before aggregation (verl's
    ``compute_policy_loss_vanilla`` with ``rollout_is_weights``); the metrics use the unweighted
    terms. Returns ``(loss, metrics)``; see the module docstring. Raises ``ValueError`` on
    mismatched shapes or a bad aggregation.
    """
    actor = _actor(config)
    old, new, adv = _prepare(old_log_probs, log_probs, advantages, response_mask)
    l1, l2, per_token = _surrogate(old, new, adv, actor)
    per_token = _weighted(per_token, rollout_is_weights, response_mask)
    loss = agg_loss(per_token, response_mask, loss_agg_mode, normalizer, seq_norm_length(actor, max_response_length))
    return loss, _ppo_metrics(l1, l2, old, new, response_mask)


def validate_dual_clip(config: Any) -> None:
    """Raise ``ValueError`` unless ``actor.clip_ratio_c`` (default 3.0) is > 1."""
    c = _actor(config).clip_ratio_c
    try:
        c = float(c)
    except (TypeError, ValueError):
        raise ValueError(f"actor.clip_ratio_c must be a number > 1 for the dual_clip policy loss, got {c!r}.") from None
    if not c > 1.0:
        raise ValueError(
            f"actor.clip_ratio_c = {c} but the dual_clip policy loss needs it > 1 "
            f"(the lower bound -A * clip_ratio_c must lie beyond the PPO clip); set actor.clip_ratio_c, e.g. 3.0."
        )


def dual_clip_policy_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    config: Any = None,
    loss_agg_mode: str = "token-mean",
    normalizer: float | torch.Tensor | None = None,
    max_response_length: int | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Dual-clip PPO loss (Ye et al. 2020).

    As :func:`vanilla_policy_loss`, and for tokens with ``A < 0`` the per-token loss is capped:
    ``min(max(L1, L2), -A * clip_ratio_c)`` (``clip_ratio_c`` from ``config``, default 3.0,
    must be > 1). ``pg_clipfrac_lower`` is the share of valid tokens with ``A < 0`` where the cap
    is active. ``rollout_is_weights`` (or ``None``) multiply the capped per-token loss before
    aggregation, as in :func:`vanilla_policy_loss` (verl's ``compute_policy_loss`` dual-clip
    branch with ``rollout_is_weights``). Raises ``ValueError`` for ``clip_ratio_c <= 1`` or
    mismatched shapes.
    """
    actor = _actor(config)
    validate_dual_clip(actor)
    old, new, adv = _prepare(old_log_probs, log_probs, advantages, response_mask)
    c = float(actor.clip_ratio_c)
    l1, l2, clipped = _surrogate(old, new, adv, actor)
    l3 = -adv * c
    negative = adv < 0
    per_token = torch.where(negative, torch.minimum(clipped, l3), clipped)
    per_token = _weighted(per_token, rollout_is_weights, response_mask)
    loss = agg_loss(per_token, response_mask, loss_agg_mode, normalizer, seq_norm_length(actor, max_response_length))
    return loss, _ppo_metrics(l1, l2, old, new, response_mask, lower_clipped=(clipped > l3) & negative)


# --------------------------------------------------------------------------- verl's other losses
def _ppo_kl(log_ratio: torch.Tensor, response_mask: torch.Tensor) -> float:
    """Masked mean of ``-log_ratio`` = ``old_log_probs - log_probs`` (nats), no gradient."""
    with torch.no_grad():
        return float(masked_mean(-log_ratio, response_mask).item())


def _share(flags: torch.Tensor, response_mask: torch.Tensor) -> float:
    """Share of the valid tokens where ``flags`` holds, no gradient."""
    with torch.no_grad():
        return float(masked_mean(flags.float(), response_mask).item())


def _prepare(old_log_probs, log_probs, advantages, response_mask):
    """Check the shapes and put 0.0 on masked positions of the three inputs (padding, and the
    environment's tokens inside a multi-turn response), so that garbage there (NaN, inf, huge
    log-ratios) reaches neither the loss nor, through ``exp``, the gradient."""
    _check_shapes(old_log_probs, log_probs, advantages, response_mask)
    valid = response_mask != 0
    zero = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
    return (
        torch.where(valid, old_log_probs, zero),
        torch.where(valid, log_probs, zero),
        torch.where(valid, advantages, zero),
    )


def _agg(per_token, response_mask, config, loss_agg_mode, normalizer, max_response_length, rollout_is_weights):
    """``agg_loss(w * per_token)`` with ``actor.loss_scale_factor`` honoured (see :func:`seq_norm_length`)."""
    per_token = _weighted(per_token, rollout_is_weights, response_mask)
    return agg_loss(per_token, response_mask, loss_agg_mode, normalizer, seq_norm_length(config, max_response_length))


def _number(value: Any, key: str, loss: str, expected: str) -> float:
    """``value`` (the setting ``actor.<key>``) as a float, else ``ValueError`` naming the key, the
    ``loss`` and the ``expected`` range."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"actor.{key} must be a number {expected} for the {loss} policy loss, got {value!r}."
        ) from None


def gspo_policy_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    config: Any = None,
    loss_agg_mode: str = "seq-mean-token-mean",
    normalizer: float | torch.Tensor | None = None,
    max_response_length: int | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"), its GSPO-token form.

    ``log s_i = mean over the valid tokens of (log_probs - old_log_probs)`` (no clamp), per token
    ``s_it = exp(min(sg(log s_i) + log_probs - sg(log_probs), 10))`` (value ``s_i``, the gradient of
    the token's own log-prob), ``L1 = -A s_it``, ``L2 = -A clamp(s_it, 1 - clip_ratio_low,
    1 + clip_ratio_high)``, per-token loss ``max(L1, L2)`` times ``rollout_is_weights`` (or not),
    aggregated with ``loss_agg_mode`` (the paper's and verl's is ``seq-mean-token-mean``; verl
    forces it whatever ``actor.loss_agg_mode`` says, rlplug honours the setting: the loss only gets
    the normaliser of the configured mode). GSPO's clip ranges are small (the recipe: 3e-4 / 4e-4).
    Metrics: ``pg_clipfrac`` (share where ``L2 > L1``), ``pg_clipfrac_lower`` 0.0, ``ppo_kl``.
    Source: verl ``compute_policy_loss_gspo``. Raises ``ValueError`` on mismatched shapes or a bad
    aggregation.
    """
    actor = _actor(config)
    old, new, adv = _prepare(old_log_probs, log_probs, advantages, response_mask)
    low, high = _clip_range(actor)
    log_ratio = new - old
    seq_log_ratio = masked_mean(log_ratio, response_mask, dim=-1)  # (B,)
    log_s = torch.clamp(new - new.detach() + seq_log_ratio.detach().unsqueeze(-1), max=10.0)
    s = torch.exp(log_s)
    l1 = -adv * s
    l2 = -adv * torch.clamp(s, 1.0 - low, 1.0 + high)
    per_token = torch.maximum(l1, l2)
    loss = _agg(per_token, response_mask, actor, loss_agg_mode, normalizer, max_response_length, rollout_is_weights)
    return loss, {
        "pg_clipfrac": _share(l2 > l1, response_mask),
        "pg_clipfrac_lower": 0.0,
        "ppo_kl": _ppo_kl(log_ratio, response_mask),
    }


def validate_sapo(config: Any) -> None:
    """Raise ``ValueError`` unless ``actor.tau_pos`` (1.0) and ``actor.tau_neg`` (1.05) are > 0
    (the gate divides by them)."""
    actor = _actor(config)
    for key, value, default in (("tau_pos", actor.tau_pos, 1.0), ("tau_neg", actor.tau_neg, 1.05)):
        tau = _number(value, key, "sapo", "> 0")
        if not tau > 0:
            raise ValueError(
                f"actor.{key} = {tau} but the sapo policy loss's gate sigmoid(tau (r - 1)) * 4 / tau needs it > 0; "
                f"set actor.{key}, e.g. {default} (the paper's value)."
            )


def sapo_policy_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    config: Any = None,
    loss_agg_mode: str = "seq-mean-token-mean",
    normalizer: float | torch.Tensor | None = None,
    max_response_length: int | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SAPO (Soft Adaptive Policy Optimization, arXiv 2511.20347): a soft gate instead of a clip.

    ``r = exp(clamp(log_probs - old_log_probs, -20, 20))``, ``tau = actor.tau_pos`` (1.0) where
    ``A > 0`` else ``actor.tau_neg`` (1.05), per-token loss ``-A * sigmoid(tau (r - 1)) * 4 / tau``
    (the gradient at ``r = 1`` is the policy gradient's, and it fades smoothly away from it) times
    ``rollout_is_weights`` (or not), aggregated with ``loss_agg_mode`` (verl forces
    ``seq-mean-token-mean``; rlplug honours the setting, see :func:`gspo_policy_loss`). Metrics:
    ``pg_clipfrac`` and ``pg_clipfrac_lower`` 0.0 (no clip), ``ppo_kl``. Source: verl
    ``compute_policy_loss_sapo``. Raises ``ValueError`` for ``tau <= 0``, mismatched shapes or a
    bad aggregation.
    """
    actor = _actor(config)
    validate_sapo(actor)
    old, new, adv = _prepare(old_log_probs, log_probs, advantages, response_mask)
    tau_pos = float(actor.tau_pos)
    tau_neg = float(actor.tau_neg)
    log_ratio = torch.clamp(new - old, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    per_token = -gate * adv
    loss = _agg(per_token, response_mask, actor, loss_agg_mode, normalizer, max_response_length, rollout_is_weights)
    return loss, {"pg_clipfrac": 0.0, "pg_clipfrac_lower": 0.0, "ppo_kl": _ppo_kl(log_ratio, response_mask)}


def gpg_policy_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    config: Any = None,
    loss_agg_mode: str = "token-mean",
    normalizer: float | torch.Tensor | None = None,
    max_response_length: int | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GPG (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline"): the plain
    policy gradient, per-token loss ``-A * log_probs`` times ``rollout_is_weights`` (or not),
    aggregated with ``loss_agg_mode``. No ratio and no clip: ``old_log_probs`` only feed ``ppo_kl``.
    Metrics: ``pg_clipfrac`` and ``pg_clipfrac_lower`` 0.0, ``ppo_kl`` **(verl returns no metrics)**.
    Source: verl ``compute_policy_loss_gpg``. Raises ``ValueError`` on mismatched shapes or a bad
    aggregation.
    """
    actor = _actor(config)
    old, new, adv = _prepare(old_log_probs, log_probs, advantages, response_mask)
    per_token = -new * adv
    loss = _agg(per_token, response_mask, actor, loss_agg_mode, normalizer, max_response_length, rollout_is_weights)
    return loss, {"pg_clipfrac": 0.0, "pg_clipfrac_lower": 0.0, "ppo_kl": _ppo_kl(new - old, response_mask)}


def geo_mean_policy_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    config: Any = None,
    loss_agg_mode: str = "seq-mean-token-mean",
    normalizer: float | torch.Tensor | None = None,
    max_response_length: int | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization"): the geometric mean of the
    token ratios of a sequence.

    Per token ``l = log_probs - old_log_probs`` (no clamp, as verl), ``c = clamp(l, -clip_ratio_low,
    clip_ratio_high)``, the pessimistic one ``l* = sgn(A) * min(sgn(A) l, sgn(A) c)`` (for ``A > 0``
    only a too-large ``l`` is clipped, for ``A < 0`` only a too-small one; 0 where ``A = 0``). Per
    sequence ``loss_i = -mean_t(A) * exp(mean_t(l*))`` over its valid tokens, times the geometric mean
    ``exp(mean_t(log(w + 1e-10)))`` of its ``rollout_is_weights`` (or not). Each of the sequence's
    valid tokens carries ``loss_i``, and ``loss_agg_mode`` aggregates them: ``seq-mean-token-mean``
    gives verl's mean over sequences **(verl ignores ``loss_agg_mode`` and takes the mean over the
    micro-batch's rows, empty ones included; rlplug divides by the whole mini-batch's count of
    non-empty sequences)**. The gradient of ``loss_i`` is the same on every unclipped token of the
    sequence (``-mean(A) exp(mean(l*)) / len_i``) and 0 on clipped ones. Metrics: ``pg_clipfrac``
    / ``pg_clipfrac_lower``: share of valid tokens with ``l != c`` and ``A > 0`` / ``A < 0``;
    ``ppo_kl``. Source: verl ``compute_policy_loss_geo_mean``. Raises ``ValueError`` on mismatched
    shapes or a bad aggregation.
    """
    actor = _actor(config)
    old, new, adv = _prepare(old_log_probs, log_probs, advantages, response_mask)
    low, high = _clip_range(actor)
    log_ratio = new - old
    clamped = torch.clamp(log_ratio, -low, high)
    sign = torch.sign(adv)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clamped)
    seq_ratio = torch.exp(masked_mean(pessimistic, response_mask, dim=-1))  # (B,)
    seq_adv = masked_mean(adv, response_mask, dim=-1)  # (B,)
    seq_loss = -seq_adv * seq_ratio
    if rollout_is_weights is not None:
        if rollout_is_weights.shape != log_probs.shape:
            raise ValueError(
                f"rollout_is_weights has shape {tuple(rollout_is_weights.shape)} but the policy loss inputs are "
                f"{tuple(log_probs.shape)}; both must be (B, T)."
            )
        w = rollout_is_weights.detach()
        seq_loss = seq_loss * torch.exp(masked_mean(torch.log(w + 1e-10), response_mask, dim=-1))
    per_token = seq_loss.unsqueeze(-1).expand_as(log_ratio)
    loss = _agg(per_token, response_mask, actor, loss_agg_mode, normalizer, max_response_length, None)
    clipped = log_ratio != clamped
    return loss, {
        "pg_clipfrac": _share(clipped & (adv > 0), response_mask),
        "pg_clipfrac_lower": _share(clipped & (adv < 0), response_mask),
        "ppo_kl": _ppo_kl(log_ratio, response_mask),
    }


def validate_dro(config: Any) -> None:
    """Raise ``ValueError`` unless ``actor.dro_beta`` (no default) is set and > 0."""
    actor = _actor(config)
    if actor.dro_beta is None:
        raise ValueError(
            "actor.dro_beta is not set, but the dro policy loss needs the coefficient of its quadratic log-ratio "
            "penalty 0.5 * dro_beta * (log_probs - old_log_probs)^2; set actor.dro_beta > 0, e.g. 0.1."
        )
    beta = _number(actor.dro_beta, "dro_beta", "dro", "> 0")
    if not beta > 0:
        raise ValueError(f"actor.dro_beta = {beta} but the dro policy loss needs it > 0; set actor.dro_beta, e.g. 0.1.")


def dro_policy_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    config: Any = None,
    loss_agg_mode: str = "token-mean",
    normalizer: float | torch.Tensor | None = None,
    max_response_length: int | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DRO (Direct Reward Optimisation, Richemond et al. 2024) with a quadratic log-ratio penalty.

    Per-token loss ``-(A * log_probs - 0.5 * beta * (log_probs - old_log_probs)^2)`` with ``beta =
    actor.dro_beta`` (must be set, > 0), times ``rollout_is_weights`` (or not), aggregated with
    ``loss_agg_mode``. Metrics: ``pg_clipfrac`` and ``pg_clipfrac_lower`` 0.0, ``ppo_kl``
    **(verl reports only ``ppo_kl``)**. Source: verl ``compute_policy_loss_dro`` (which reads
    ``actor.policy_loss.dro_beta``; rlplug's ``actor.policy_loss`` is the loss's name, so the leaf
    is ``actor.dro_beta``). Raises ``ValueError`` for a missing or non-positive ``dro_beta``,
    mismatched shapes or a bad aggregation.
    """
    actor = _actor(config)
    validate_dro(actor)
    beta = _number(actor.dro_beta, "dro_beta", "dro", "> 0")  # set and > 0: validate_dro
    old, new, adv = _prepare(old_log_probs, log_probs, advantages, response_mask)
    log_ratio = new - old
    per_token = -(new * adv - 0.5 * beta * log_ratio.square())
    loss = _agg(per_token, response_mask, actor, loss_agg_mode, normalizer, max_response_length, rollout_is_weights)
    return loss, {"pg_clipfrac": 0.0, "pg_clipfrac_lower": 0.0, "ppo_kl": _ppo_kl(log_ratio, response_mask)}


def cispo_policy_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    config: Any = None,
    loss_agg_mode: str = "token-mean",
    normalizer: float | torch.Tensor | None = None,
    max_response_length: int | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, MiniMax 2025, arXiv 2506.13585): clip the importance weight, keep every
    token's gradient.

    ``r = exp(clamp(log_probs - old_log_probs, -20, 20))``, per-token loss
    ``-sg(clamp(r, 1 - clip_ratio_low, 1 + clip_ratio_high)) * A * log_probs`` (the clipped weight
    is detached, so a clipped token still gets the gradient ``-clip(r) A``) times
    ``rollout_is_weights`` (or not), aggregated with ``loss_agg_mode``. Metrics: ``pg_clipfrac``
    (share where the clamp changed ``r``), ``pg_clipfrac_lower`` 0.0, ``ppo_kl``. Source: verl
    ``compute_policy_loss_cispo``. Raises ``ValueError`` on mismatched shapes or a bad aggregation.
    """
    actor = _actor(config)
    old, new, adv = _prepare(old_log_probs, log_probs, advantages, response_mask)
    low, high = _clip_range(actor)
    log_ratio = torch.clamp(new - old, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - low, 1.0 + high)
    per_token = -clipped.detach() * adv * new
    loss = _agg(per_token, response_mask, actor, loss_agg_mode, normalizer, max_response_length, rollout_is_weights)
    return loss, {
        "pg_clipfrac": _share(ratio != clipped, response_mask),
        "pg_clipfrac_lower": 0.0,
        "ppo_kl": _ppo_kl(log_ratio, response_mask),
    }


def validate_dppo(config: Any) -> None:
    """Raise ``ValueError`` unless ``actor.clip_ratio_c`` (3.0), the truncation of the DPPO
    importance weight, is > 0."""
    actor = _actor(config)
    c = _number(actor.clip_ratio_c, "clip_ratio_c", "dppo_tv / dppo_kl", "> 0")
    if not c > 0:
        raise ValueError(
            f"actor.clip_ratio_c = {c} but the DPPO losses truncate the importance weight at min(r, clip_ratio_c), "
            "which must be > 0; set actor.clip_ratio_c, e.g. 20.0 (a large threshold keeps the truncation bias small)."
        )


def _dppo(old_log_probs, log_probs, advantages, response_mask, config, divergence: str):
    """Shared DPPO terms: ``(per-token loss, log_ratio, ratio, trust-region mask v, clip_ratio_c)``."""
    actor = _actor(config)
    validate_dppo(actor)
    old, new, adv = _prepare(old_log_probs, log_probs, advantages, response_mask)
    low, high = _clip_range(actor)
    c = float(actor.clip_ratio_c)
    log_ratio = torch.clamp(new - old, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    with torch.no_grad():
        p, p_old = torch.exp(new), torch.exp(old)
        if divergence == "tv":
            inside_pos = (p - p_old) <= high
            inside_neg = (p - p_old) >= -low
        else:
            binary_kl = p_old * (old - new) + (1.0 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
            inside_pos = (binary_kl <= high) | (p <= p_old)
            inside_neg = (binary_kl <= low) | (p >= p_old)
        inside = torch.where(adv > 0, inside_pos, inside_neg).float()
    per_token = -adv * torch.clamp(ratio, max=c).detach() * new * inside
    return old, per_token, log_ratio, ratio, inside, c


def _dppo_loss(
    divergence,
    old_log_probs,
    log_probs,
    advantages,
    response_mask,
    *,
    config,
    loss_agg_mode,
    normalizer,
    max_response_length,
    rollout_is_weights,
):
    actor = _actor(config)
    _, per_token, log_ratio, ratio, inside, c = _dppo(
        old_log_probs, log_probs, advantages, response_mask, actor, divergence
    )
    loss = _agg(per_token, response_mask, actor, loss_agg_mode, normalizer, max_response_length, rollout_is_weights)
    return loss, {
        "pg_clipfrac": _share(inside == 0, response_mask),
        "pg_clipfrac_lower": _share((ratio > c) & (inside > 0), response_mask),
        "ppo_kl": _ppo_kl(log_ratio, response_mask),
    }


def dppo_tv_policy_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    config: Any = None,
    loss_agg_mode: str = "token-mean",
    normalizer: float | torch.Tensor | None = None,
    max_response_length: int | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO-Binary-TV (Divergence PPO, arXiv 2602.04879): a trust region on the probability change.

    ``r = exp(clamp(log_probs - old_log_probs, -20, 20))``, ``p = exp(log_probs)``,
    ``p_old = exp(old_log_probs)``; a token stays in the update (``v = 1``, no gradient through
    ``v``) where ``p - p_old <= clip_ratio_high`` (``A > 0``) or ``p - p_old >= -clip_ratio_low``
    (``A <= 0``): the clip ratios are TV thresholds here, not ratio bounds. Per-token loss
    ``-A * sg(min(r, clip_ratio_c)) * log_probs * v`` (truncated IS instead of a dual clip; the
    paper recommends a large ``clip_ratio_c``, e.g. 20; rlplug's and verl's configured default is
    3.0) times ``rollout_is_weights`` (or not), aggregated with ``loss_agg_mode``. Metrics:
    ``pg_clipfrac`` (share with ``v = 0``), ``pg_clipfrac_lower`` (share with ``v = 1`` and
    ``r > clip_ratio_c``), ``ppo_kl``. Source: verl ``compute_policy_loss_dppo_tv``. Raises
    ``ValueError`` for ``clip_ratio_c <= 0``, mismatched shapes or a bad aggregation.
    """
    return _dppo_loss(
        "tv",
        old_log_probs,
        log_probs,
        advantages,
        response_mask,
        config=config,
        loss_agg_mode=loss_agg_mode,
        normalizer=normalizer,
        max_response_length=max_response_length,
        rollout_is_weights=rollout_is_weights,
    )


def dppo_kl_policy_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    config: Any = None,
    loss_agg_mode: str = "token-mean",
    normalizer: float | torch.Tensor | None = None,
    max_response_length: int | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO-Binary-KL (Divergence PPO, arXiv 2602.04879): a trust region on the binary KL.

    As :func:`dppo_tv_policy_loss` with the region ``KL_bin = p_old log(p_old / p) + (1 - p_old)
    log((1 - p_old + 1e-8) / (1 - p + 1e-8))``: a token with ``A > 0`` leaves it (``v = 0``) when
    ``KL_bin > clip_ratio_high`` and ``p > p_old``, a token with ``A <= 0`` when
    ``KL_bin > clip_ratio_low`` and ``p < p_old`` (moving back is always allowed). Source: verl
    ``compute_policy_loss_dppo_kl``. Raises ``ValueError`` for ``clip_ratio_c <= 0``, mismatched
    shapes or a bad aggregation.
    """
    return _dppo_loss(
        "kl",
        old_log_probs,
        log_probs,
        advantages,
        response_mask,
        config=config,
        loss_agg_mode=loss_agg_mode,
        normalizer=normalizer,
        max_response_length=max_response_length,
        rollout_is_weights=rollout_is_weights,
    )


# --------------------------------------------------------------------------- Clip-Cov / KL-Cov
# Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models"
# (arXiv 2505.22617). Both pick tokens by the centred covariance of advantage and log-prob over the
# WHOLE mini-batch (PolicyLoss.minibatch_stats), not per micro-batch as verl does.


def _ratio_in(setting: Any, key: str, default: float, loss: str, what: str) -> float:
    """``setting`` (``actor.<key>``, schema default ``default``) as a number in (0, 1], else ``ValueError``
    saying what it means."""
    value = _number(setting, key, loss, "in (0, 1]")
    if not (0.0 < value <= 1.0):
        raise ValueError(
            f"actor.{key} = {value} but the {loss} policy loss needs it in (0, 1]: it is the share of the "
            f"mini-batch's valid tokens {what}; set actor.{key}, e.g. {default}."
        )
    return value


def validate_clip_cov(config: Any) -> None:
    """Raise ``ValueError`` unless ``actor.clip_cov_ratio`` (0.0002) is in (0, 1] and
    ``actor.clip_cov_lb`` (1.0) < ``actor.clip_cov_ub`` (5.0), both finite numbers."""
    actor = _actor(config)
    _ratio_in(actor.clip_cov_ratio, "clip_cov_ratio", 0.0002, "clip_cov", "whose gradient is cut")
    lb = _number(actor.clip_cov_lb, "clip_cov_lb", "clip_cov", "below actor.clip_cov_ub")
    ub = _number(actor.clip_cov_ub, "clip_cov_ub", "clip_cov", "above actor.clip_cov_lb")
    if not (math.isfinite(lb) and math.isfinite(ub) and lb < ub):
        raise ValueError(
            f"actor.clip_cov_lb = {lb} and actor.clip_cov_ub = {ub}, but the clip_cov policy loss picks tokens with "
            "lb < covariance < ub, so it needs finite bounds with lb < ub; set them, e.g. clip_cov_lb=1.0 "
            "clip_cov_ub=5.0."
        )


def validate_kl_cov(config: Any) -> None:
    """Raise ``ValueError`` unless ``actor.kl_cov_ratio`` (0.0002) is in (0, 1] and
    ``actor.ppo_kl_coef`` (0.1) is a finite number >= 0."""
    actor = _actor(config)
    _ratio_in(actor.kl_cov_ratio, "kl_cov_ratio", 0.0002, "kl_cov", "that get the |log-ratio| penalty")
    coef = _number(actor.ppo_kl_coef, "ppo_kl_coef", "kl_cov", ">= 0")
    if not (math.isfinite(coef) and coef >= 0.0):
        raise ValueError(
            f"actor.ppo_kl_coef = {coef} but the kl_cov policy loss needs a finite coefficient >= 0 for its "
            "penalty ppo_kl_coef * |log_probs - old_log_probs|; set actor.ppo_kl_coef, e.g. 1.0 (the paper's)."
        )


def _centred_cov(adv: torch.Tensor, log_probs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``(A - mean(A)) * (log_probs - mean(log_probs))`` per token, the means over the valid tokens
    (no grad); ``(B, T) float32``, meaningless on padding."""
    mask = valid.to(adv.dtype)
    return (adv - masked_mean(adv, mask)) * (log_probs - masked_mean(log_probs, mask))


def clip_cov_generator(context: MiniBatchContext | None) -> torch.Generator:
    """The CPU ``torch.Generator`` of clip_cov's random pick: seeded with ``seed * 1_000_003 +
    optimizer_step`` of ``context`` (:class:`rlplug.contracts.types.MiniBatchContext`; ``None``: seed 0,
    step 0), so the pick depends on the run seed and the position in the run only, never on the
    global RNG (a resumed run picks the same tokens)."""
    ctx = context or MiniBatchContext()
    return torch.Generator(device="cpu").manual_seed((int(ctx.seed) * 1_000_003 + int(ctx.optimizer_step)) % (2**63))


def clip_cov_minibatch_stats(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    config: Any = None,
    context: MiniBatchContext | None = None,
) -> dict[str, torch.Tensor]:
    """Clip-Cov's token pick over a whole mini-batch: ``{"clip_cov_mask": (B, T) float32}``, 1.0 on
    the tokens whose gradient is cut.

    Inputs ``(B, T) float32`` (log-probs in nats; ``log_probs`` the current actor's, detached).
    Candidates: valid tokens that the PPO clip leaves alone (``L2 <= L1``, see
    :func:`vanilla_policy_loss`) with ``clip_cov_lb < cov < clip_cov_ub``, ``cov = (A - mean A) *
    (log_probs - mean log_probs)`` (means over the valid tokens). ``n = max(int(clip_cov_ratio *
    N), 1)`` of them (``N`` valid tokens) are picked uniformly at random (all of them when fewer):
    the candidates in row-major order, permuted by ``torch.randperm`` with
    :func:`clip_cov_generator` ``(context)``. Source: verl ``compute_policy_loss_clip_cov``
    **(which computes this per micro-batch with the global RNG)**. Raises ``ValueError`` for bad
    hyperparameters or mismatched shapes.
    """
    actor = _actor(config)
    validate_clip_cov(actor)
    with torch.no_grad():
        old, new, adv = _prepare(old_log_probs, log_probs.detach(), advantages, response_mask)
        valid = response_mask != 0
        l1, l2, _ = _surrogate(old, new, adv, actor)
        lb = float(actor.clip_cov_lb)
        ub = float(actor.clip_cov_ub)
        cov = _centred_cov(adv, new, valid)
        candidates = valid & ~(l2 > l1) & (cov > lb) & (cov < ub)
        picked = torch.zeros_like(new)
        n_valid = int(valid.sum())
        idx = torch.nonzero(candidates).cpu()  # (K, 2) row-major, as verl
        if n_valid and len(idx):
            n = max(int(float(actor.clip_cov_ratio) * n_valid), 1)
            chosen = idx[torch.randperm(len(idx), generator=clip_cov_generator(context))[:n]].to(picked.device)
            picked[chosen[:, 0], chosen[:, 1]] = 1.0
    return {"clip_cov_mask": picked}


def clip_cov_policy_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    config: Any = None,
    loss_agg_mode: str = "token-mean",
    normalizer: float | torch.Tensor | None = None,
    max_response_length: int | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    clip_cov_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clip-Cov (Cui et al. 2025, arXiv 2505.22617): PPO with the gradient of a few high-covariance
    tokens cut.

    Per-token loss ``max(L1, L2) * (1 - clip_cov_mask)`` (``L1``, ``L2`` as in
    :func:`vanilla_policy_loss`, with ``clip_ratio_low`` / ``clip_ratio_high``) times
    ``rollout_is_weights`` (or not), aggregated with ``loss_agg_mode``. ``clip_cov_mask`` ``(B, T)``
    (1.0: cut) is this micro-batch's rows of :func:`clip_cov_minibatch_stats` over the whole
    mini-batch (the update loop passes it); without it the pick is made on this call's inputs with
    :func:`clip_cov_generator` ``(None)`` (verl's per-call behaviour). Metrics: ``pg_clipfrac``:
    share of valid tokens cut (verl's), ``pg_clipfrac_lower`` 0.0, ``ppo_kl``. Source: verl
    ``compute_policy_loss_clip_cov`` **(whose ratio is not clamped to exp(+-20))**. Raises
    ``ValueError`` for bad hyperparameters (:func:`validate_clip_cov`), mismatched shapes or a bad
    aggregation.
    """
    actor = _actor(config)
    validate_clip_cov(actor)
    if clip_cov_mask is None:
        stats = clip_cov_minibatch_stats(old_log_probs, log_probs, advantages, response_mask, config=actor)
        clip_cov_mask = stats["clip_cov_mask"]
    old, new, adv = _prepare(old_log_probs, log_probs, advantages, response_mask)
    if clip_cov_mask.shape != new.shape:
        raise ValueError(
            f"clip_cov_mask has shape {tuple(clip_cov_mask.shape)} but the policy loss inputs are "
            f"{tuple(new.shape)}; pass this micro-batch's rows of clip_cov_minibatch_stats(...)['clip_cov_mask']."
        )
    cut = clip_cov_mask.detach().to(new.dtype)
    l1, l2, per_token = _surrogate(old, new, adv, actor)
    per_token = per_token * (1.0 - cut)
    loss = _agg(per_token, response_mask, actor, loss_agg_mode, normalizer, max_response_length, rollout_is_weights)
    return loss, {
        "pg_clipfrac": _share(cut != 0, response_mask),
        "pg_clipfrac_lower": 0.0,
        "ppo_kl": _ppo_kl(torch.clamp(new - old, -20.0, 20.0), response_mask),
    }


def kl_cov_minibatch_stats(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    config: Any = None,
    context: MiniBatchContext | None = None,
) -> dict[str, torch.Tensor]:
    """KL-Cov's token selection over a whole mini-batch: ``{"kl_cov_mask": (B, T) float32}``, 1.0 on
    the tokens that get the KL penalty.

    The ``k = max(1, int(kl_cov_ratio * N))`` valid tokens (``N`` of them) with the largest
    ``cov = (A - mean A) * (log_probs - mean log_probs)`` (means over the valid tokens;
    ``torch.topk`` on the CPU over the valid tokens in row-major order, as verl). Deterministic;
    ``context`` is not used. Source: verl ``compute_policy_loss_kl_cov`` **(which selects per
    micro-batch)**. Raises ``ValueError`` for bad hyperparameters or mismatched shapes.
    """
    actor = _actor(config)
    validate_kl_cov(actor)
    with torch.no_grad():
        _, new, adv = _prepare(old_log_probs, log_probs.detach(), advantages, response_mask)
        valid = response_mask != 0
        selected = torch.zeros_like(new)
        flat_valid = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
        n_valid = len(flat_valid)
        if n_valid:
            cov = _centred_cov(adv, new, valid).reshape(-1)[flat_valid].cpu()
            k = max(1, int(n_valid * float(actor.kl_cov_ratio)))
            top = flat_valid[torch.topk(cov, k, largest=True).indices.to(flat_valid.device)]
            selected.view(-1)[top] = 1.0
    return {"kl_cov_mask": selected}


def kl_cov_policy_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    config: Any = None,
    loss_agg_mode: str = "token-mean",
    normalizer: float | torch.Tensor | None = None,
    max_response_length: int | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    kl_cov_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-Cov (Cui et al. 2025, arXiv 2505.22617): the unclipped policy gradient with a KL penalty on
    the highest-covariance tokens.

    ``r = exp(clamp(log_probs - old_log_probs, -20, 20))``, per-token loss ``-A r +
    kl_cov_mask * ppo_kl_coef * |log_probs - old_log_probs|`` (no clip anywhere) times
    ``rollout_is_weights`` (or not), aggregated with ``loss_agg_mode``. ``kl_cov_mask`` ``(B, T)`` is
    this micro-batch's rows of :func:`kl_cov_minibatch_stats` over the whole mini-batch (the update
    loop passes it); without it the selection is made on this call's inputs (verl's per-call
    behaviour). Metrics: ``pg_clipfrac``: share of valid tokens penalised **(verl reports none)**,
    ``pg_clipfrac_lower`` 0.0, ``ppo_kl`` = masked mean of ``old_log_probs - log_probs`` **(verl
    reports the masked mean of ``|log_probs - old_log_probs|`` under that name)**. Source: verl
    ``compute_policy_loss_kl_cov``. Raises ``ValueError`` for bad hyperparameters
    (:func:`validate_kl_cov`), mismatched shapes or a bad aggregation.
    """
    actor = _actor(config)
    validate_kl_cov(actor)
    if kl_cov_mask is None:
        kl_cov_mask = kl_cov_minibatch_stats(old_log_probs, log_probs, advantages, response_mask, config=actor)[
            "kl_cov_mask"
        ]
    old, new, adv = _prepare(old_log_probs, log_probs, advantages, response_mask)
    if kl_cov_mask.shape != new.shape:
        raise ValueError(
            f"kl_cov_mask has shape {tuple(kl_cov_mask.shape)} but the policy loss inputs are "
            f"{tuple(new.shape)}; pass this micro-batch's rows of kl_cov_minibatch_stats(...)['kl_cov_mask']."
        )
    selected = kl_cov_mask.detach().to(new.dtype)
    coef = float(actor.ppo_kl_coef)
    log_ratio = new - old
    ratio = torch.exp(torch.clamp(log_ratio, -20.0, 20.0))
    per_token = -adv * ratio + selected * coef * log_ratio.abs()
    loss = _agg(per_token, response_mask, actor, loss_agg_mode, normalizer, max_response_length, rollout_is_weights)
    return loss, {
        "pg_clipfrac": _share(selected != 0, response_mask),
        "pg_clipfrac_lower": 0.0,
        "ppo_kl": _ppo_kl(torch.clamp(log_ratio, -20.0, 20.0), response_mask),
    }


# --------------------------------------------------------------------------- bypass mode (rollout correction)
#: the bypass_mode loss's rollout_corr/ metrics: masked means over valid tokens, so the update loop's
#: token-weighted mean over micro-batches is the mini-batch's value; always reported (0.0 when off)
_BYPASS_METRICS = ("kl", "k3_kl", "rollout_is_mean", "rollout_rs_masked_fraction")


def _bypass_settings(config: Any) -> Any:
    """The rollout-correction settings the ``actor`` section mirrors (``actor.rollout_correction``,
    an interpolation of ``algorithm.rollout_correction``) with ``actor.rollout_is_threshold`` applied;
    defaults when it is absent or unresolvable (a bare ``ActorConfig``: see :func:`_actor`)."""
    actor = _actor(config)
    node = actor.rollout_correction
    node = node if OmegaConf.is_config(node) or isinstance(node, dict) else None
    # actor.rollout_is_threshold (the older spelling) counts here too, as in the trainer's settings
    return with_threshold_alias(parse_rollout_correction(node), actor.rollout_is_threshold, node)


def validate_bypass_mode(config: Any) -> None:
    """Raise ``ValueError`` for a bad ``algorithm.rollout_correction`` section (as seen through
    ``actor.rollout_correction``) or ``rollout_is_batch_normalize=true``, which bypass mode refuses:
    its weights are computed per micro-batch, so a batch mean would depend on the split."""
    if _bypass_settings(config).batch_normalize:
        raise ValueError(
            "algorithm.rollout_correction.rollout_is_batch_normalize=true: the bypass_mode loss computes its weights "
            "per micro-batch, so normalising them would make the update depend on the micro-batch size. Set "
            "rollout_is_batch_normalize=false."
        )


def bypass_mode_policy_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    config: Any = None,
    loss_agg_mode: str = "token-mean",
    normalizer: float | torch.Tensor | None = None,
    max_response_length: int | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's bypass-mode loss: ``old_log_probs`` ARE the engine's log-probs (no old-log-prob pass).

    With ``algorithm.rollout_correction`` (read through ``config.rollout_correction``) it first
    computes, without gradient and per micro-batch against the CURRENT policy, the importance weights
    ``w = pi_theta / pi_rollout`` (``rollout_is``, :func:`rlplug.algorithms.rollout_correction.rollout_is_weights`
    of ``log_probs - old_log_probs``) and the rejection mask (``rollout_rs``), then by ``loss_type``:

    * ``ppo_clip``: :func:`vanilla_policy_loss` against the engine's log-probs on the mask after
      rejection; ``w`` is not applied (the ratio already is the correction; verl's metrics-only weights).
    * ``reinforce`` (verl's ``compute_policy_loss_reinforce``): per token ``-A * log_probs * w``
      (``w`` = 1 without ``rollout_is``), aggregated on the mask after rejection; ``pg_clipfrac`` and
      ``pg_clipfrac_lower`` are 0.0, ``ppo_kl`` the masked mean of ``old_log_probs - log_probs``.

    ``rollout_is_weights`` passed in (``None`` in bypass mode, where the trainer computes none) multiply
    each token's loss on top, as for every loss. The normaliser stays the mini-batch's (as verl's
    ``global_batch_info``, from the mask before rejection). Metrics add ``rollout_corr/kl``,
    ``rollout_corr/k3_kl``, ``rollout_corr/rollout_is_mean`` and ``rollout_corr/rollout_rs_masked_fraction``
    (token masked means of this micro-batch; 0.0 when off). Source: verl
    ``compute_policy_loss_bypass_mode`` (``core_algos.py``). Raises ``ValueError`` for mismatched shapes
    or a bad ``rollout_correction`` section.
    """
    _check_shapes(old_log_probs, log_probs, advantages, response_mask)
    actor = _actor(config)
    settings = _bypass_settings(actor)
    validate_bypass_mode(actor)
    extra = dict.fromkeys(_BYPASS_METRICS, 0.0)
    mask, w = response_mask, None
    if bool(response_mask.bool().any()):
        w, mask, m = compute_rollout_correction(
            log_probs.detach(), old_log_probs, response_mask, settings, with_offpolicy_metrics=False
        )
        m = {k.removeprefix("rollout_corr/"): v for k, v in m.items()}
        m.update(offpolicy_metrics(log_probs.detach(), old_log_probs, response_mask))
        extra.update({k: float(m[k]) for k in _BYPASS_METRICS if k in m})
    if settings.loss_type == "ppo_clip":
        loss, metrics = vanilla_policy_loss(
            old_log_probs,
            log_probs,
            advantages,
            mask,
            config=actor,
            loss_agg_mode=loss_agg_mode,
            normalizer=normalizer,
            max_response_length=max_response_length,
            rollout_is_weights=rollout_is_weights,
        )
    else:
        _, new, adv = _prepare(old_log_probs, log_probs, advantages, mask)
        per_token = -adv * new
        if w is not None:
            per_token = per_token * w
        per_token = _weighted(per_token, rollout_is_weights, mask)
        loss = agg_loss(per_token, mask, loss_agg_mode, normalizer, seq_norm_length(actor, max_response_length))
        metrics = {"pg_clipfrac": 0.0, "pg_clipfrac_lower": 0.0, "ppo_kl": _ppo_kl(log_probs - old_log_probs, mask)}
    metrics.update({f"rollout_corr/{k}": v for k, v in extra.items()})
    return loss, metrics


@hookimpl
def register_policy_losses(register):
    register(
        "vanilla",
        PolicyLoss(vanilla_policy_loss, description="PPO clipped surrogate (Schulman et al. 2017)"),
    )
    register(
        "dual_clip",
        PolicyLoss(
            dual_clip_policy_loss,
            validate=validate_dual_clip,
            description="PPO with the dual-clip bound -A*clip_ratio_c for A < 0 (Ye et al. 2020)",
        ),
    )
    register(
        "gspo",
        PolicyLoss(gspo_policy_loss, description="GSPO: sequence-level importance ratio, clipped (Zheng et al. 2025)"),
    )
    register(
        "sapo",
        PolicyLoss(
            sapo_policy_loss,
            validate=validate_sapo,
            description="SAPO: soft sigmoid gate on the ratio, tau_pos / tau_neg (arXiv 2511.20347)",
        ),
    )
    register("gpg", PolicyLoss(gpg_policy_loss, description="GPG: plain policy gradient -A*log_prob (Chu et al. 2025)"))
    register(
        "geo_mean",
        PolicyLoss(
            geo_mean_policy_loss, description="GMPO: geometric mean of the token ratios per sequence (Zhao et al. 2025)"
        ),
    )
    register(
        "dro",
        PolicyLoss(
            dro_policy_loss,
            validate=validate_dro,
            description="DRO: -A*log_prob + 0.5*dro_beta*log_ratio^2 (Richemond et al. 2024)",
        ),
    )
    register(
        "cispo",
        PolicyLoss(
            cispo_policy_loss, description="CISPO: clipped, detached IS weight times log_prob (MiniMax-M1 2025)"
        ),
    )
    register(
        "dppo_tv",
        PolicyLoss(
            dppo_tv_policy_loss,
            validate=validate_dppo,
            description="DPPO-Binary-TV: trust region on p - p_old, truncated IS (arXiv 2602.04879)",
        ),
    )
    register(
        "dppo_kl",
        PolicyLoss(
            dppo_kl_policy_loss,
            validate=validate_dppo,
            description="DPPO-Binary-KL: trust region on the binary KL, truncated IS (arXiv 2602.04879)",
        ),
    )
    register(
        "clip_cov",
        PolicyLoss(
            clip_cov_policy_loss,
            validate=validate_clip_cov,
            minibatch_stats=clip_cov_minibatch_stats,
            description="Clip-Cov: PPO, gradient cut on random high-covariance tokens (Cui et al. 2025)",
        ),
    )
    register(
        "kl_cov",
        PolicyLoss(
            kl_cov_policy_loss,
            validate=validate_kl_cov,
            minibatch_stats=kl_cov_minibatch_stats,
            description="KL-Cov: policy gradient, |log-ratio| penalty on top-covariance tokens (Cui et al. 2025)",
        ),
    )
    register(
        "bypass_mode",
        PolicyLoss(
            bypass_mode_policy_loss,
            validate=validate_bypass_mode,
            description="verl's bypass mode: engine log-probs as old, loss_type ppo_clip or IS-weighted reinforce",
            metrics=("actor/rollout_corr/*",),
            bypass_mode=True,
        ),
    )
