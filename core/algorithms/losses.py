"""Pure tensor functions shared by the algorithm plugins: masked statistics, loss aggregation,
value loss, entropy, token-level scores, the in-reward KL penalty and the critic's value targets
(the Monte-Carlo return).

Shape letters: ``B`` responses, ``T`` padded response length, ``V`` vocabulary size.
``response_mask`` is ``(B, T)``, 1.0 on generated tokens and 0.0 elsewhere (a bool or integer
mask is accepted too). Log-probs are natural-log (nats).

The semantics follow ``docs/algorithms.md`` (reference: verl's
``verl/trainer/ppo/core_algos.py``). Where a function differs from verl its docstring says so.

Nothing here touches devices, process groups or global state: quantities such as the number of
valid tokens in the whole mini-batch are passed in as numbers (``normalizer``); the caller
all-reduces them when training on several processes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlplug.config.schema import ActorConfig, CriticConfig, config_get, typed
from rlplug.contracts.registry import get_plugin

__all__ = [
    "LOSS_AGG_MODES",
    "VALUE_LOSS_TYPES",
    "config_value",
    "typed_actor",
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "agg_loss",
    "agg_normalizer",
    "seq_norm_length",
    "value_loss",
    "entropy_from_logits",
    "compute_token_level_scores",
    "apply_kl_penalty",
    "mc_returns",
    "value_targets",
]

#: The loss aggregation modes (``actor.loss_agg_mode`` / ``critic.loss_agg_mode``).
LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)

#: The value losses of :func:`value_loss` (``critic.loss_type``).
VALUE_LOSS_TYPES: tuple[str, ...] = ("mse", "huber")


# --------------------------------------------------------------------------- config access
#: The old name of :func:`rlplug.config.schema.config_get` (kept for code that imports it from here).
config_value = config_get


def typed_actor(config: Any) -> ActorConfig:
    """``config`` (the ``actor`` section: DictConfig, dataclass, mapping or ``None``) read as the schema's
    :class:`rlplug.config.schema.ActorConfig`: :func:`rlplug.config.schema.typed` (each field the config's
    value, or the schema's default where the key is absent, ``None`` or an unresolvable interpolation)."""
    return typed(ActorConfig, config)


# --------------------------------------------------------------------------- masked statistics
def _valid(mask: torch.Tensor) -> torch.Tensor:
    return mask != 0


def _as_float_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool or not mask.is_floating_point():
        return mask.to(like.dtype if like.is_floating_point() else torch.float32)
    return mask


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x * mask`` over ``dim`` (all elements when ``None``).

    ``x`` and ``mask`` broadcast together (typically both ``(B, T)``). Entries where the mask is 0
    contribute exactly 0 even when ``x`` holds NaN/inf there (padding garbage never leaks).
    """
    m = _as_float_mask(mask, x)
    prod = torch.where(_valid(mask), x * m, torch.zeros((), dtype=x.dtype, device=x.device))
    return prod.sum() if dim is None else prod.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``masked_sum(x, mask, dim) / mask.sum(dim)``; 0.0 where the mask sums to 0 (no NaN).

    Differs from verl (which adds 1e-8 to the denominator) only in returning exactly 0 for an
    empty mask.
    """
    m = _as_float_mask(mask, x)
    total = masked_sum(x, mask, dim)
    count = m.sum() if dim is None else m.sum(dim=dim)
    return torch.where(
        count > 0, total / torch.where(count > 0, count, torch.ones_like(count)), torch.zeros_like(total)
    )


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the valid entries of ``x`` (scalar tensor).

    ``unbiased=True`` applies Bessel's correction ``n / (n - 1)`` with ``n = mask.sum()``. With
    ``n <= 1`` (no spread can be measured) the unbiased variance is defined as 0.0 rather than
    raising like verl's ``masked_var``.
    """
    mean = masked_mean(x, mask)
    centered = torch.where(_valid(mask), x - mean, torch.zeros((), dtype=x.dtype, device=x.device))
    var = masked_mean(centered * centered, mask)
    if unbiased:
        n = _as_float_mask(mask, x).sum()
        bessel = torch.where(n > 1, n / torch.where(n > 1, n - 1, torch.ones_like(n)), torch.zeros_like(n))
        var = var * bessel
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` with mean and unbiased variance over the valid entries of
    the whole tensor, then multiplied by the mask (0.0 exactly where the mask is 0).

    ``shift_mean=False`` adds the mean back (scale only). Shapes: ``x``, ``mask`` ``(B, T)``;
    result ``(B, T)``, dtype of ``x``. Source: verl ``masked_whiten`` **(differs from verl, which
    leaves ``-mean/std`` on padding)**.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(
        _valid(mask), whitened * _as_float_mask(mask, x), torch.zeros((), dtype=x.dtype, device=x.device)
    )


# --------------------------------------------------------------------------- aggregation
def _check_mode(loss_agg_mode: str) -> None:
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"Unknown loss_agg_mode {loss_agg_mode!r}. Available: {', '.join(LOSS_AGG_MODES)} "
            f"(set actor.loss_agg_mode / critic.loss_agg_mode to one of them)."
        )


def agg_normalizer(mask: torch.Tensor, loss_agg_mode: str) -> float:
    """The normaliser :func:`agg_loss` divides by, for the mask of a whole mini-batch.

    ``token-mean``: number of valid tokens; every ``seq-mean-*`` mode: number of sequences with at
    least one valid token; ``token-sum``: the number of valid tokens too, although :func:`agg_loss`
    does not divide by it (it only tells the update loop whether the mini-batch has a valid token).
    ``mask`` ``(B, T)``. Returns a Python float (the caller all-reduces it
    across ranks in multi-process training). Raises ``ValueError`` for an unknown mode.
    """
    _check_mode(loss_agg_mode)
    valid = _valid(mask)
    if loss_agg_mode in ("token-mean", "token-sum"):
        return float(_as_float_mask(mask, torch.empty((), dtype=torch.float32)).sum().item())
    return float(valid.any(dim=-1).sum().item())


def seq_norm_length(config: object, max_response_length: int | None) -> int | None:
    """The divisor of ``seq-mean-token-sum-norm``: ``actor.loss_scale_factor`` when it is set,
    else ``max_response_length`` (``data.max_response_length``, tokens).

    ``config`` is the ``actor`` section (DictConfig, dataclass, dict or ``None``). verl's
    ``agg_loss(..., loss_scale_factor)`` falls back to the padded length of the micro-batch
    instead **(differs from verl: a constant, so the loss does not depend on how the batch was
    padded or split)**. Raises ``ValueError`` for a ``loss_scale_factor`` that is not a positive
    integer (tokens; verl's type is ``int`` too).
    """
    factor = typed_actor(config).loss_scale_factor
    if factor is None:
        return max_response_length
    if isinstance(factor, bool) or not float(factor).is_integer() or not float(factor) > 0:
        raise ValueError(
            f"actor.loss_scale_factor = {factor} but it divides the seq-mean-token-sum-norm loss and must be a "
            "positive integer (tokens, e.g. data.max_response_length), or null for data.max_response_length."
        )
    return int(factor)


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    normalizer: float | torch.Tensor | None = None,
    max_response_length: int | None = None,
) -> torch.Tensor:
    """This micro-batch's contribution to the mini-batch loss (scalar tensor).

    ``loss_mat`` ``(B, T)`` per-token loss, ``mask`` ``(B, T)``. ``normalizer`` is the count for
    the WHOLE mini-batch (all micro-batches and ranks; see :func:`agg_normalizer`); ``None``
    means this micro-batch is the whole mini-batch. Modes (``M`` the mask, sums over valid
    sequences only, i.e. rows with at least one valid token):

    * ``token-mean``: ``sum(L*M) / normalizer`` (normalizer = valid tokens).
    * ``token-sum``: ``sum(L*M)``; the normaliser is not used (verl's ``token-sum``: the sum over
      every valid token of the mini-batch, whatever the split).
    * ``seq-mean-token-sum``: ``sum_i sum_t L*M / normalizer`` (normalizer = valid sequences).
    * ``seq-mean-token-mean``: ``sum_i (sum_t L*M / sum_t M) / normalizer``.
    * ``seq-mean-token-sum-norm`` (Dr.GRPO): ``sum_i (sum_t L*M / max_response_length) / normalizer``
      **(differs from verl, which divides by the padded length unless ``loss_scale_factor`` is set)**;
      pass :func:`seq_norm_length` ``(actor_config, data.max_response_length)`` as
      ``max_response_length`` to honour ``actor.loss_scale_factor``.

    Because every contribution uses the global normaliser, summing them over any split of the
    mini-batch gives the full mini-batch loss and gradient **(differs from verl's default worker,
    which normalises each micro-batch by its own count)**.

    Raises ``ValueError`` for an unknown mode, a missing/non-positive ``max_response_length``
    with ``seq-mean-token-sum-norm``, a non-positive ``normalizer``, or mismatched shapes.
    """
    _check_mode(loss_agg_mode)
    if loss_mat.shape != mask.shape:
        raise ValueError(
            f"agg_loss: loss_mat has shape {tuple(loss_mat.shape)} but mask has {tuple(mask.shape)}; "
            f"both must be (B, T)."
        )
    if normalizer is None:
        normalizer = agg_normalizer(mask, loss_agg_mode)
        if normalizer == 0:  # nothing valid: contribute an exact, differentiable zero
            return (loss_mat * 0.0).sum()
    elif float(normalizer) <= 0:
        raise ValueError(
            f"agg_loss: normalizer must be > 0 (the number of valid tokens/sequences in the whole "
            f"mini-batch), got {float(normalizer)}; skip mini-batches without valid tokens."
        )
    if loss_agg_mode == "token-mean":
        return masked_sum(loss_mat, mask) / normalizer
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, mask)
    seq_sum = masked_sum(loss_mat, mask, dim=-1)  # (B,)
    valid_seq = _valid(mask).any(dim=-1)  # (B,)
    if loss_agg_mode == "seq-mean-token-sum":
        per_seq = seq_sum
    elif loss_agg_mode == "seq-mean-token-mean":
        count = _as_float_mask(mask, loss_mat).sum(dim=-1)
        per_seq = seq_sum / torch.where(count > 0, count, torch.ones_like(count))
    else:  # seq-mean-token-sum-norm
        if max_response_length is None or max_response_length <= 0:
            raise ValueError(
                "loss_agg_mode 'seq-mean-token-sum-norm' needs max_response_length > 0 "
                f"(data.max_response_length, in tokens), got {max_response_length!r}."
            )
        per_seq = seq_sum / float(max_response_length)
    per_seq = torch.where(valid_seq, per_seq, torch.zeros_like(per_seq))
    return per_seq.sum() / normalizer


# --------------------------------------------------------------------------- value loss
def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cliprange_value: float = 0.5,
    loss_agg_mode: str = "token-mean",
    normalizer: float | torch.Tensor | None = None,
    max_response_length: int | None = None,
    loss_type: str = "mse",
    huber_delta: float = 1.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss (PPO critic).

    ``values`` ``(B, T) float32`` current critic predictions, ``old_values`` ``(B, T)`` the
    critic's values before the update, ``returns`` ``(B, T)`` targets. Per token
    ``v_clip = clamp(v, v_old - cliprange_value, v_old + cliprange_value)`` and
    ``max(l(v - R), l(v_clip - R))``, aggregated with :func:`agg_loss`, where ``l`` is, by
    ``loss_type``: ``"mse"`` ``0.5 * e^2`` (verl ``compute_value_loss``); ``"huber"`` the Huber loss
    with threshold ``huber_delta`` ``d`` (``torch.nn.functional.huber_loss``): ``0.5 * e^2`` for
    ``|e| <= d``, ``d * (|e| - 0.5 * d)`` beyond, so a large error pulls with a bounded gradient
    ``d`` (not in verl; it equals ``"mse"`` for ``d`` larger than every error). Metric
    ``vf_clipfrac``: share of valid tokens of this micro-batch where the clipped term is larger.
    Raises ``ValueError`` for mismatched shapes, an unknown ``loss_type`` or ``huber_delta <= 0``.
    """
    if loss_type not in VALUE_LOSS_TYPES:
        raise ValueError(f"value_loss: loss_type={loss_type!r}; use one of {', '.join(VALUE_LOSS_TYPES)}.")
    if loss_type == "huber" and not huber_delta > 0:
        raise ValueError(f"value_loss: huber_delta={huber_delta} must be > 0 (the Huber threshold, in return units).")
    for name, t in (("old_values", old_values), ("returns", returns), ("response_mask", response_mask)):
        if t.shape != values.shape:
            raise ValueError(
                f"value_loss: {name} has shape {tuple(t.shape)}, values has {tuple(values.shape)}; all must be (B, T)."
            )
    # masked positions (padding, environment tokens of a multi-turn response) hold 0.0 before any
    # arithmetic, so whatever they held (NaN, inf) reaches neither the loss nor the gradient
    valid = _valid(response_mask)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    values = torch.where(valid, values, zero)
    old_values = torch.where(valid, old_values, zero)
    returns = torch.where(valid, returns, zero)
    v_clip = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    if loss_type == "huber":
        l1 = torch.nn.functional.huber_loss(values, returns, reduction="none", delta=float(huber_delta))
        l2 = torch.nn.functional.huber_loss(v_clip, returns, reduction="none", delta=float(huber_delta))
        per_token = torch.maximum(l1, l2)
    else:  # verl's form, kept operation for operation (bitwise the values it always gave)
        l1 = (values - returns) ** 2
        l2 = (v_clip - returns) ** 2
        per_token = 0.5 * torch.maximum(l1, l2)
    loss = agg_loss(per_token, response_mask, loss_agg_mode, normalizer, max_response_length)
    with torch.no_grad():
        clipfrac = masked_mean((l2 > l1).float(), response_mask)
    return loss, {"vf_clipfrac": float(clipfrac.item())}


# --------------------------------------------------------------------------- entropy
def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy (nats) of ``softmax(logits)`` over the last dimension.

    ``logits`` ``(..., V)`` (divide by the sampling temperature first); result ``(...)`` float32.
    Computed stably as ``logsumexp(l) - sum(softmax(l) * l)`` on ``l = logits - max(logits)``; ``-inf`` logits (masked vocabulary
    entries) contribute 0. Source: verl ``entropy_from_logits``.
    """
    l = logits.float()
    # entropy is shift-invariant: centre on the row max for precision with large logits
    l = l - l.max(dim=-1, keepdim=True).values.detach()
    l = l.clamp(min=torch.finfo(torch.float32).min)  # -inf -> finite, so 0 * l stays 0
    lse = torch.logsumexp(l, dim=-1)
    p = torch.softmax(l, dim=-1)
    return lse - (p * l).sum(dim=-1)


# --------------------------------------------------------------------------- rewards
def compute_token_level_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence score on its last valid response token.

    ``scores`` ``(B,) float32``, ``response_mask`` ``(B, T)``; result ``(B, T) float32`` with
    ``scores[i]`` at the last position where the mask is nonzero (index ``len_i - 1`` for a
    contiguous mask) and 0 elsewhere. Rows without a valid token (empty responses) get nothing.
    Raises ``ValueError`` on mismatched shapes.
    """
    if response_mask.dim() != 2 or scores.shape != response_mask.shape[:1]:
        raise ValueError(
            f"compute_token_level_scores: scores must be (B,) and response_mask (B, T); got "
            f"{tuple(scores.shape)} and {tuple(response_mask.shape)}."
        )
    valid = _valid(response_mask)
    T = response_mask.shape[1]
    out = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    if T == 0:
        return out
    has = valid.any(dim=-1)
    last = (T - 1) - valid.flip(-1).to(torch.int8).argmax(dim=-1)  # last nonzero column
    src = torch.where(has, scores.to(torch.float32), torch.zeros((), dtype=torch.float32, device=scores.device))
    out.scatter_(1, last.unsqueeze(1), src.unsqueeze(1))
    return out


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kl_fn: Callable[..., torch.Tensor] | str,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL penalty in the reward: ``token_level_rewards = token_level_scores - kl_coef * kl * M``.

    ``token_level_scores``, ``log_probs`` (actor, nats), ``ref_log_probs`` (reference, nats),
    ``response_mask``: all ``(B, T)``. ``kl_fn(log_probs, ref_log_probs) -> (B, T)`` is a per-token
    KL estimator (a :class:`rlplug.contracts.types.KLPenalty` or any callable), or its registered name (looked
    up in the ``kl_penalty`` registry). ``kl_coef`` is ``beta`` (from the KL
    controller; the caller updates the controller with the returned metric and ``n_steps = B``).

    Returns ``(token_level_rewards (B, T) float32, metrics)`` with
    ``actor/reward_kl_penalty``: the mean over sequences of each sequence's mean KL over its valid
    tokens (nats; sequences without valid tokens are left out, 0.0 if there are none), and
    ``actor/reward_kl_penalty_coeff``: ``kl_coef``. Source: verl ``apply_kl_penalty``.
    """
    if isinstance(kl_fn, str):
        kl_fn = get_plugin("kl_penalty", kl_fn)
    assert callable(kl_fn)
    for name, t in (("log_probs", log_probs), ("ref_log_probs", ref_log_probs), ("response_mask", response_mask)):
        if t.shape != token_level_scores.shape:
            raise ValueError(
                f"apply_kl_penalty: {name} has shape {tuple(t.shape)}, token_level_scores has "
                f"{tuple(token_level_scores.shape)}; all must be (B, T)."
            )
    kld = kl_fn(log_probs, ref_log_probs)
    valid = _valid(response_mask)
    kld = torch.where(
        valid, kld * _as_float_mask(response_mask, kld), torch.zeros((), dtype=kld.dtype, device=kld.device)
    )
    rewards = (token_level_scores - kl_coef * kld).to(torch.float32)
    with torch.no_grad():
        per_seq = masked_mean(kld.detach(), response_mask, dim=-1)  # (B,)
        current_kl = masked_mean(per_seq, valid.any(dim=-1))
    return rewards, {
        "actor/reward_kl_penalty": float(current_kl.item()),
        "actor/reward_kl_penalty_coeff": float(kl_coef),
    }


# --------------------------------------------------------------------------- value targets
def mc_returns(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Monte-Carlo returns ``G_k = sum_{j >= k} gamma^(j - k) r_j`` over each response's valid tokens,
    ``(B, T) float32``, 0.0 where ``response_mask`` (``(B, T)``) is 0. ``token_level_rewards`` ``(B, T)``
    float32, reward units per token. ``k``, ``j`` count valid tokens: masked positions inside a
    response (the environment's tokens of a multi-turn response) are skipped, neither discounted
    nor a reset, as in the packaged ``gae`` estimator. GAE with
    ``lam = 1`` gives the same returns whatever the values (Schulman et al. 2016, eq. 18; verl's
    ``compute_gae_advantage_return`` with lam=1)."""
    valid = response_mask > 0
    rewards = torch.where(
        valid, token_level_rewards.float(), torch.zeros_like(token_level_rewards, dtype=torch.float32)
    )
    if gamma == 1.0:
        returns = rewards.flip(-1).cumsum(-1).flip(-1)
    else:  # masked positions are skipped: the discount counts the model's own tokens only
        returns = torch.zeros_like(rewards)
        running = torch.zeros(rewards.shape[0], dtype=torch.float32, device=rewards.device)
        for t in reversed(range(rewards.shape[1])):
            running = torch.where(valid[:, t], rewards[:, t] + gamma * running, running)
            returns[:, t] = running
    return torch.where(valid, returns, torch.zeros_like(returns))


def value_targets(batch: Any, cfg: Any) -> None:
    """With ``critic.value_target=mc_return``, replace ``batch["returns"]`` (the critic's regression
    targets, ``(B, T) float32``) by :func:`mc_returns` of ``batch["token_level_rewards"]`` with
    ``algorithm.gamma``; with ``returns`` (default) leave the estimator's. A critic-free estimator's
    ``returns`` are no value targets (GRPO's equal its advantages), so a critic trained beside one (the
    GRPO phase of ``experiment=grpo_to_ppo``) regresses on the Monte-Carlo return instead; failed rows
    have zero rewards and are masked out of the update anyway."""
    if str(typed(CriticConfig, cfg.critic).value_target) == "mc_return":
        batch["returns"] = mc_returns(batch["token_level_rewards"], batch["response_mask"], float(cfg.algorithm.gamma))
