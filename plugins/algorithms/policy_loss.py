"""Policy losses (kind ``policy_loss``): PPO's clipped surrogate and its dual-clip variant.

Both have the one policy-loss signature (:class:`rlplug.types.PolicyLoss`)::

    fn(old_log_probs, log_probs, advantages, response_mask, *, config, loss_agg_mode, normalizer,
       max_response_length=None, rollout_is_weights=None) -> (loss, metrics)

``old_log_probs``, ``log_probs``, ``advantages``, ``response_mask`` are ``(B, T) float32``
(log-probs in nats of the sampled tokens), ``config`` is the ``actor`` config section,
``loss_agg_mode`` / ``normalizer`` / ``max_response_length`` go to :func:`rlplug.losses.agg_loss`
(``normalizer``: the whole mini-batch's count), and ``rollout_is_weights`` ``(B, T) float32`` or
``None`` are detached truncated importance weights against the rollout engine
(``actor.rollout_is_threshold``, computed by :func:`rlplug.objective.truncated_is_weights`): each
token's loss is multiplied by its weight before aggregation, as verl's ``compute_policy_loss_*``
do. They return a scalar loss tensor (this micro-batch's contribution to the mini-batch loss) and
``dict[str, float]`` metrics computed as masked means over THIS micro-batch's valid tokens (the
caller weights them), from the unweighted per-token terms:

* ``pg_clipfrac``: share of valid tokens where the clipped term is the larger one (``L2 > L1``);
* ``pg_clipfrac_lower``: share of valid tokens with ``A < 0`` where the dual-clip bound
  ``-A * clip_ratio_c`` is active (always 0.0 for ``vanilla``, which has no such bound);
* ``ppo_kl``: masked mean of ``old_log_probs - log_probs`` (nats).

Source: verl ``compute_policy_loss_vanilla`` (``verl/trainer/ppo/core_algos.py``); PPO
(Schulman et al. 2017); dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with
Deep Reinforcement Learning"). Unlike verl, ``vanilla`` has no dual clip; ``dual_clip`` adds it.
"""

from __future__ import annotations

from typing import Any

import torch

import rlplug
from rlplug.config import config_get
from rlplug.losses import agg_loss, masked_mean
from rlplug.types import PolicyLoss

__all__ = ["vanilla_policy_loss", "dual_clip_policy_loss", "validate_dual_clip"]


def _clip_range(config: Any) -> tuple[float, float]:
    clip_ratio = float(config_get(config, "clip_ratio", 0.2))
    low = float(config_get(config, "clip_ratio_low", clip_ratio))
    high = float(config_get(config, "clip_ratio_high", clip_ratio))
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


def _weighted(per_token: torch.Tensor, rollout_is_weights: torch.Tensor | None) -> torch.Tensor:
    """``per_token * rollout_is_weights`` (detached weights), or ``per_token`` without weights."""
    if rollout_is_weights is None:
        return per_token
    if rollout_is_weights.shape != per_token.shape:
        raise ValueError(
            f"rollout_is_weights has shape {tuple(rollout_is_weights.shape)} but the policy loss inputs are "
            f"{tuple(per_token.shape)}; both must be (B, T)."
        )
    return per_token * rollout_is_weights.detach()


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
    ``max(L1, L2)``, aggregated by :func:`rlplug.losses.agg_loss` with ``loss_agg_mode``,
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
    _check_shapes(old_log_probs, log_probs, advantages, response_mask)
    l1, l2, per_token = _surrogate(old_log_probs, log_probs, advantages, config)
    per_token = _weighted(per_token, rollout_is_weights)
    loss = agg_loss(per_token, response_mask, loss_agg_mode, normalizer, max_response_length)
    return loss, _ppo_metrics(l1, l2, old_log_probs, log_probs, response_mask)


def validate_dual_clip(config: Any) -> None:
    """Raise ``ValueError`` unless ``actor.clip_ratio_c`` (default 3.0) is > 1."""
    c = config_get(config, "clip_ratio_c", 3.0)
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
    validate_dual_clip(config)
    _check_shapes(old_log_probs, log_probs, advantages, response_mask)
    c = float(config_get(config, "clip_ratio_c", 3.0))
    l1, l2, clipped = _surrogate(old_log_probs, log_probs, advantages, config)
    l3 = -advantages * c
    negative = advantages < 0
    per_token = torch.where(negative, torch.minimum(clipped, l3), clipped)
    per_token = _weighted(per_token, rollout_is_weights)
    loss = agg_loss(per_token, response_mask, loss_agg_mode, normalizer, max_response_length)
    return loss, _ppo_metrics(l1, l2, old_log_probs, log_probs, response_mask, lower_clipped=(clipped > l3) & negative)


@rlplug.hookimpl
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
