"""The PPO objectives, as pure tensor functions: what a training backend minimises.

Every training backend (``local``, ``fsdp2``, or a third-party one) computes the actor's and the
critic's per-micro-batch losses here and only does the placement around them: devices, the split
into mini- and micro-batches, the all-reduced normaliser, backward, gradient clipping and the
optimizer step. Nothing here touches devices, process groups, optimizers or logging; global
quantities (the mini-batch normaliser) come in as numbers.

* :func:`actor_objective`: the registered policy loss (``actor.policy_loss``) plus the KL loss
  (``actor.use_kl_loss``, the ``actor.kl_loss_type`` estimator) minus the entropy bonus
  (``actor.entropy_coeff``), every term aggregated with the whole mini-batch's normaliser
  (:func:`rlplug.algorithms.losses.agg_loss`). With ``actor.rollout_is_threshold`` it computes the truncated
  importance weights against the rollout engine (:func:`truncated_is_weights`) and hands them to
  the policy loss, which applies them to each token's loss.
* :func:`critic_objective`: the clipped value loss (:func:`rlplug.algorithms.losses.value_loss`).
* :func:`actor_input_fields` / :data:`CRITIC_INPUT_FIELDS`: the batch fields each needs, so a
  backend can check a batch before its first forward pass.

The ``parts`` both objectives return are the micro-batch's metrics in the form the update loop
sums (:class:`rlplug.training.backend.TrainingBackendBase`): a plain key (``pg_loss``, ``entropy``,
``kl_loss``, ``vf_loss``) is this micro-batch's contribution to the mini-batch value (contributions
add up over micro-batches and ranks), and a ``mean:`` key (``mean:pg_clipfrac``,
``mean:rollout_is_weight``, ...) is a masked mean over this micro-batch's valid tokens, which the
loop weights by the micro-batch's share of the mini-batch's valid tokens.

Shape letters: ``B`` responses of the micro-batch, ``T`` padded response length. Log-probs and
entropies are in nats.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from rlplug.algorithms.losses import agg_loss, masked_mean, seq_norm_length, typed_actor, value_loss
from rlplug.contracts.types import BATCH_FIELD_PRODUCERS, MissingInputError

if TYPE_CHECKING:
    from rlplug.contracts.types import KLPenaltyProtocol, PolicyLossProtocol

__all__ = [
    "actor_objective",
    "critic_objective",
    "truncated_is_weights",
    "actor_input_fields",
    "SEQUENCE_FIELDS",
    "CRITIC_INPUT_FIELDS",
]

#: The sequence tensors every forward pass needs (``(B, P + T)``).
SEQUENCE_FIELDS: tuple[str, ...] = ("input_ids", "attention_mask", "position_ids")

#: The batch fields :func:`critic_objective` and the critic's forward pass need.
CRITIC_INPUT_FIELDS: tuple[str, ...] = (*SEQUENCE_FIELDS, "response_mask", "values", "returns")

#: Names the actor objective passes to the policy loss itself (a plugin cannot ``require`` them).
_RESERVED = frozenset(
    {
        "old_log_probs",
        "log_probs",
        "advantages",
        "response_mask",
        "config",
        "loss_agg_mode",
        "normalizer",
        "max_response_length",
        "rollout_is_weights",
    }
)


def truncated_is_weights(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, threshold: float
) -> torch.Tensor:
    """Truncated importance-sampling weights against the rollout engine (verl's TIS).

    ``min(exp(clamp(old_log_probs - rollout_log_probs, -20, 20)), threshold)`` per token, detached:
    ``old_log_probs`` ``(B, T) float32`` are the trainer's log-probs of the sampled tokens before the
    update and ``rollout_log_probs`` ``(B, T) float32`` the engine's (nats); ``threshold`` is
    ``actor.rollout_is_threshold`` (> 0). Returns ``(B, T) float32`` weights in
    ``(0, threshold]``, not masked. Source: verl ``dp_actor`` (``rollout_is_weights`` from
    ``old_log_prob - rollout_log_probs``, clamped to ``rollout_is_threshold``).
    """
    with torch.no_grad():
        weight = torch.exp(torch.clamp(old_log_probs - rollout_log_probs, -20.0, 20.0))
        return torch.clamp(weight, max=float(threshold))


def actor_input_fields(
    config: Any, policy_loss: Any = None, *, kl_penalty: Any = None, on_policy_reuse: bool = False
) -> tuple[str, ...]:
    """The batch fields :func:`actor_objective` (and the actor's forward pass) need.

    The sequence tensors, ``response_mask``, ``advantages``, ``old_log_probs`` (unless
    ``on_policy_reuse``), ``ref_log_probs`` with a ``kl_penalty``, ``rollout_log_probs`` with
    ``actor.rollout_is_threshold`` (``config`` is the ``actor`` section) and the policy loss's
    ``requires``. In a fixed order, without duplicates.
    """
    keys = [*SEQUENCE_FIELDS, "response_mask", "advantages"]
    if not on_policy_reuse:
        keys.append("old_log_probs")
    if kl_penalty is not None:
        keys.append("ref_log_probs")
    if typed_actor(config).rollout_is_threshold is not None:
        keys.append("rollout_log_probs")
    keys += list(getattr(policy_loss, "requires", ()) or ())
    return tuple(dict.fromkeys(keys))


def _require(tensors: Mapping[str, torch.Tensor], key: str, why: str) -> torch.Tensor:
    value = tensors.get(key)
    if value is None:
        raise MissingInputError(
            f"actor_objective needs batch field '{key}' ({why}) but the micro-batch has none; it is provided by "
            f"{BATCH_FIELD_PRODUCERS.get(key, 'the trainer')}. Present: {sorted(k for k in tensors if tensors[k] is not None)}."
        )
    return value


def actor_objective(
    log_probs: torch.Tensor,
    entropy: torch.Tensor | None,
    tensors: Mapping[str, torch.Tensor],
    *,
    policy_loss: PolicyLossProtocol,
    config: Any,
    loss_agg_mode: str,
    normalizer: float,
    max_response_length: int | None = None,
    kl_penalty: KLPenaltyProtocol | None = None,
    on_policy_reuse: bool = False,
    minibatch_stats: Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """One micro-batch's contribution to the actor loss, and its metrics.

    ``loss = pg_loss - entropy_coeff * agg(entropy) + kl_loss_coef * agg(kl(log_probs, ref_log_probs))``
    where ``pg_loss`` is ``policy_loss(old_log_probs, log_probs, advantages, response_mask, config=...,
    loss_agg_mode=..., normalizer=..., max_response_length=..., rollout_is_weights=..., **requires)``
    and ``agg`` is :func:`rlplug.algorithms.losses.agg_loss` with the same mode and normaliser, so summing the
    contributions of any split of a mini-batch gives the mini-batch loss and gradient. Source: verl
    ``dp_actor.update_policy`` (``policy_loss - entropy_coeff * entropy_loss + kl_loss * kl_loss_coef``).

    Args:
        log_probs: ``(B, T) float32`` log-probs (nats) of the sampled tokens under the current
            actor, with grad.
        entropy: ``(B, T) float32`` entropies (nats) of the current actor's token distributions
            (with grad when ``actor.entropy_coeff`` is nonzero), or ``None`` (then no entropy
            metric, and ``actor.entropy_coeff`` must be 0).
        tensors: the micro-batch's fields: ``response_mask`` and ``advantages`` ``(B, T) float32``;
            ``old_log_probs`` (unless ``on_policy_reuse``), ``ref_log_probs`` (with ``kl_penalty``),
            ``rollout_log_probs`` (with ``actor.rollout_is_threshold``), all ``(B, T) float32``
            nats, and every field in ``policy_loss.requires`` (passed to the loss as a keyword
            argument of the same name).
        policy_loss: the registered policy loss (``actor.policy_loss``).
        config: the ``actor`` config section (``entropy_coeff``, ``kl_loss_coef``,
            ``rollout_is_threshold``, and whatever the policy loss reads, e.g. ``clip_ratio``).
        loss_agg_mode: ``actor.loss_agg_mode`` (see :data:`rlplug.algorithms.losses.LOSS_AGG_MODES`).
        normalizer: the WHOLE mini-batch's count (:func:`rlplug.algorithms.losses.agg_normalizer`, summed over
            the micro-batches and ranks); > 0.
        max_response_length: ``data.max_response_length`` (tokens), for ``seq-mean-token-sum-norm``;
            ``actor.loss_scale_factor``, when set, replaces it (:func:`rlplug.algorithms.losses.seq_norm_length`).
        kl_penalty: the KL estimator of the KL loss (``actor.kl_loss_type``), or ``None`` without
            ``actor.use_kl_loss``.
        on_policy_reuse: the batch has no ``old_log_probs`` because the update is on-policy (one
            epoch, one mini-batch): ``log_probs.detach()`` are the old log-probs (the weights have
            not moved yet; verl's ``on_policy`` shortcut).
        minibatch_stats: this micro-batch's rows of what ``policy_loss.minibatch_stats`` returned
            for the whole mini-batch (``{name: (B, T) tensor}``, see :class:`rlplug.contracts.types.PolicyLoss`),
            passed to the policy loss as keyword arguments; ``None`` for a loss without them.

    The batch field ``rollout_is_weights`` ``(B, T) float32`` (the trainer's rollout correction,
    computed once per step: :func:`rlplug.algorithms.rollout_correction.apply_rollout_correction`) goes to the
    policy loss as ``rollout_is_weights``; without it, ``actor.rollout_is_threshold = C`` gives the
    truncated weights :func:`truncated_is_weights` ``(old_log_probs, rollout_log_probs, C)`` per
    micro-batch (the same values: the formula is per token). The loss applies them (the objective
    never scales advantages or losses itself), and ``mean:rollout_is_weight`` reports their masked
    mean. Metrics the loss reports under ``rollout_corr/`` (the ``bypass_mode`` loss's masked means)
    are passed on as ``mean:rollout_corr/...``.

    Returns:
        ``(loss, parts)``: the scalar loss tensor to backpropagate, and ``dict[str, float]``
        ``pg_loss``, ``entropy`` (when ``entropy`` is given; before the coefficient), ``kl_loss``
        (with ``kl_penalty``; before the coefficient) as contributions, and ``mean:pg_clipfrac``,
        ``mean:pg_clipfrac_lower``, ``mean:ppo_kl`` (those the loss reports) and
        ``mean:rollout_is_weight`` (with TIS) as masked means over this micro-batch.

    Raises:
        MissingInputError: a field the configuration needs is not in ``tensors``.
        ValueError: ``entropy`` is ``None`` with a nonzero ``actor.entropy_coeff``, a policy
            loss ``requires`` a name the objective passes itself (or ``minibatch_stats`` repeats
            one of those names or a ``requires``); the loss's own errors
            (shapes, aggregation mode).
    """
    mask = _require(tensors, "response_mask", "the valid response tokens")
    actor = typed_actor(config)
    # actor.loss_scale_factor replaces data.max_response_length in every term (verl's global_batch_info)
    max_response_length = seq_norm_length(actor, max_response_length)
    old_log_probs = (
        log_probs.detach()
        if on_policy_reuse
        else _require(tensors, "old_log_probs", "the actor's log-probs before the update")
    )
    advantages = _require(tensors, "advantages", "the advantage estimator's output")
    entropy_coeff = float(actor.entropy_coeff)
    if entropy is None and entropy_coeff:
        raise ValueError(
            f"actor_objective: actor.entropy_coeff = {entropy_coeff} but no entropy was given; compute the "
            "entropies in the forward pass (with_entropy=True) or set actor.entropy_coeff=0."
        )
    parts: dict[str, float] = {}
    threshold = actor.rollout_is_threshold
    weights = tensors.get("rollout_is_weights")  # the trainer's, once per step (rlplug.algorithms.rollout_correction)
    if weights is not None:
        parts["mean:rollout_is_weight"] = float(masked_mean(weights, mask))
    elif threshold is not None:
        rollout_log_probs = _require(
            tensors,
            "rollout_log_probs",
            "truncated importance sampling, actor.rollout_is_threshold; set rollout.calculate_log_probs=true",
        )
        weights = truncated_is_weights(old_log_probs, rollout_log_probs, float(threshold))
        parts["mean:rollout_is_weight"] = float(masked_mean(weights, mask))
    requires = tuple(getattr(policy_loss, "requires", ()) or ())
    reserved = sorted(set(requires) & _RESERVED)
    if reserved:
        raise ValueError(
            f"the policy loss requires {reserved}, which the actor objective passes to every policy loss "
            "itself; remove them from PolicyLoss.requires."
        )
    extra = {key: _require(tensors, key, "required by the policy loss") for key in requires}
    clash = sorted(set(minibatch_stats or {}) & (_RESERVED | set(requires)))
    if clash:
        raise ValueError(
            f"the policy loss's minibatch_stats returned {clash}, names the actor objective already passes to the "
            "loss (its own inputs or its requires); rename them."
        )
    extra.update(minibatch_stats or {})
    pg_loss, pg_metrics = policy_loss(
        old_log_probs,
        log_probs,
        advantages,
        mask,
        config=config,
        loss_agg_mode=loss_agg_mode,
        normalizer=normalizer,
        max_response_length=max_response_length,
        rollout_is_weights=weights,
        **extra,
    )
    loss = pg_loss
    entropy_agg = None
    if entropy is not None:
        entropy_agg = agg_loss(
            entropy if entropy_coeff else entropy.detach(), mask, loss_agg_mode, normalizer, max_response_length
        )
        if entropy_coeff:
            loss = pg_loss - entropy_coeff * entropy_agg
    parts["pg_loss"] = float(pg_loss.detach())
    if entropy_agg is not None:
        parts["entropy"] = float(entropy_agg.detach())
    for key in (
        *("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"),
        *sorted(k for k in pg_metrics if k.startswith("rollout_corr/")),
    ):
        if key in pg_metrics:
            parts["mean:" + key] = float(pg_metrics[key])
    if kl_penalty is not None:
        ref_log_probs = _require(tensors, "ref_log_probs", "the KL loss, actor.use_kl_loss")
        # 0.0 on masked positions first: a NaN or inf there would reach the gradient through the
        # estimator's derivative (exp, square) even though agg_loss drops its value
        valid = mask != 0
        zero = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
        kl = kl_penalty(torch.where(valid, log_probs, zero), torch.where(valid, ref_log_probs, zero))
        kl_agg = agg_loss(kl, mask, loss_agg_mode, normalizer, max_response_length)
        # a partial config without actor.kl_loss_coef gets the schema default 0.001, as a composed run
        loss = loss + float(actor.kl_loss_coef) * kl_agg
        parts["kl_loss"] = float(kl_agg.detach())
    return loss, parts


def critic_objective(
    values: torch.Tensor,
    tensors: Mapping[str, torch.Tensor],
    *,
    cliprange_value: float,
    loss_agg_mode: str,
    normalizer: float,
    max_response_length: int | None = None,
    loss_type: str = "mse",
    huber_delta: float = 1.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """One micro-batch's contribution to the critic loss, and its metrics.

    The clipped value loss :func:`rlplug.algorithms.losses.value_loss`: per token
    ``0.5 * max((v - R)^2, (clamp(v, v_old - c, v_old + c) - R)^2)`` (``loss_type="mse"``,
    ``critic.loss_type``; with ``"huber"`` the max of the two Huber losses with threshold
    ``huber_delta``, ``critic.huber_delta``) aggregated with :func:`rlplug.algorithms.losses.agg_loss` and the
    whole mini-batch's ``normalizer``. Source: verl ``compute_value_loss`` (``dp_critic.update_critic``).

    Args:
        values: ``(B, T) float32`` current critic values, with grad.
        tensors: the micro-batch's ``values`` (the critic's values before the update, the
            clipping anchor), ``returns`` and ``response_mask``, all ``(B, T) float32``.
        cliprange_value: ``critic.cliprange_value`` ``c`` (in the units of the values).
        loss_agg_mode, normalizer, max_response_length: as in :func:`actor_objective`.

    Returns:
        ``(loss, parts)``: the scalar loss and ``{"vf_loss": contribution, "mean:vf_clipfrac":
        masked mean over this micro-batch}``.

    Raises:
        MissingInputError: ``values``, ``returns`` or ``response_mask`` is not in ``tensors``.
        ValueError: mismatched shapes or a bad aggregation (from ``value_loss``).
    """
    for key in ("values", "returns", "response_mask"):
        if tensors.get(key) is None:
            raise MissingInputError(
                f"critic_objective needs batch field '{key}' but the micro-batch has none; it is provided by "
                f"{BATCH_FIELD_PRODUCERS.get(key, 'the trainer (the advantage estimator)')}. Present: {sorted(tensors)}."
            )
    loss, m = value_loss(
        values,
        tensors["values"],
        tensors["returns"],
        tensors["response_mask"],
        cliprange_value=cliprange_value,
        loss_agg_mode=loss_agg_mode,
        normalizer=normalizer,
        max_response_length=max_response_length,
        loss_type=loss_type,
        huber_delta=huber_delta,
    )
    return loss, {"vf_loss": float(loss.detach()), "mean:vf_clipfrac": float(m["vf_clipfrac"])}
