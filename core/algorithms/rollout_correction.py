"""Rollout correction: importance weights and rejection between the rollout engine and the trainer.

The rollout engine (vLLM, SGLang, the HF generator, possibly in another precision) samples from
``pi_rollout``; the trainer's old-log-prob pass scores the same tokens under ``pi_old``. Where the
two differ, the update is off-policy. verl's *rollout correction* (``algorithm.rollout_correction``,
``verl/trainer/ppo/rollout_corr_helper.py`` at verl 1dda039b9) corrects it with:

* **importance sampling** (``rollout_is``): per-token weights ``w = pi_old / pi_rollout`` that the
  policy loss multiplies into each token's loss (:func:`rollout_is_weights`), truncated at
  ``rollout_is_threshold`` (TIS) or zeroed outside ``[lower, upper]`` (IcePop, a ``"lower_upper"``
  string), optionally normalised to mean 1 over the batch (``rollout_is_batch_normalize``);
* **rejection sampling** (``rollout_rs``): tokens or whole sequences whose divergence estimate is
  out of bounds are removed from ``response_mask`` (:func:`rollout_rejection_mask`);
* **bypass mode** (``bypass_mode``): no old-log-prob pass at all, the engine's log-probs are the
  old log-probs (:func:`use_rollout_log_probs_as_old`), and the ``bypass_mode`` policy loss
  computes the weights and the rejection per micro-batch against the current policy.

The trainer calls :func:`apply_rollout_correction` once per step, after the old log-probs, the
in-reward KL and the advantage estimator **(verl runs ``compute_rollout_correction_and_add_to_batch``
before the advantages; rlplug's estimators sum the rewards over the response mask, so rejecting a
response's last token there would erase its score and its group's signal)**: it puts ``rollout_is_weights`` ``(B, T) float32`` (detached) on the batch, writes the
rejection into ``response_mask`` and returns the ``rollout_corr/*`` metrics. The policy losses
receive ``rollout_is_weights`` as they always did. ``actor.rollout_is_threshold = C`` (rlplug's
older key) is an alias of ``rollout_is=token, rollout_is_threshold=C``
(:func:`rollout_correction_settings`).

Differences from verl (also in ``docs/algorithms.md``): sequence-level IS uses the geometric mean of
the token ratios, ``exp(mean_t log w_t)`` over the valid tokens, not ``exp(sum_t log w_t)``
(whose value for a long response is almost always 0 or the cap); ``rollout_rs`` also accepts the
older names ``token``, ``sequence`` and ``geometric`` (= ``token_k1``, ``seq_sum_k1``,
``seq_mean_k1``); with ``bypass_mode`` the policy loss must be ``actor.policy_loss=bypass_mode``
(verl replaces the loss silently) and ``rollout_is_batch_normalize`` is refused (verl normalises
per micro-batch there, so the update would depend on the micro-batch size).

Shape letters: ``B`` responses, ``T`` response tokens. Log-probs are in nats.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from rlplug.algorithms.losses import masked_mean, masked_sum
from rlplug.config.schema import ConfigError, RolloutCorrectionConfig, RunConfig, typed

__all__ = [
    "SAFETY_BOUND",
    "ROLLOUT_IS_LEVELS",
    "ROLLOUT_RS_OPTIONS",
    "ROLLOUT_RS_ALIASES",
    "LOSS_TYPES",
    "RolloutCorrectionSettings",
    "parse_rollout_correction",
    "rollout_correction_settings",
    "validate_rollout_correction",
    "rollout_correction_requires",
    "bypasses_old_log_probs",
    "use_rollout_log_probs_as_old",
    "rollout_is_weights",
    "rollout_rejection_mask",
    "offpolicy_metrics",
    "compute_rollout_correction",
    "apply_rollout_correction",
]

#: log-ratios are clamped to [-SAFETY_BOUND, SAFETY_BOUND] before exponentiating (verl's bound)
SAFETY_BOUND = 20.0

#: the aggregation levels of ``rollout_is``
ROLLOUT_IS_LEVELS: tuple[str, ...] = ("token", "sequence")

#: verl's ``SUPPORTED_ROLLOUT_RS_OPTIONS``: ``<level>_k<estimator>`` with the level ``token``,
#: ``seq_sum``, ``seq_mean`` or ``seq_max`` and the divergence estimator k1 ``-log w``, k2
#: ``0.5 (log w)^2`` or k3 ``w - 1 - log w`` of ``w = pi_old / pi_rollout``
ROLLOUT_RS_OPTIONS: tuple[str, ...] = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)

#: the older verl names of ``rollout_rs`` (ratio bounds per token, on the product and on the
#: geometric mean of a sequence's ratios) and the option each means today
ROLLOUT_RS_ALIASES: dict[str, str] = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}

#: the losses of bypass mode (``loss_type``)
LOSS_TYPES: tuple[str, ...] = ("ppo_clip", "reinforce")

_KEY = "algorithm.rollout_correction"


@dataclass(frozen=True)
class RolloutCorrectionSettings:
    """The parsed ``algorithm.rollout_correction`` section (with the ``actor.rollout_is_threshold`` alias).

    * ``rollout_is``: ``None``, ``"token"`` or ``"sequence"``.
    * ``is_upper``: the weight cap (TIS) or the upper bound (IcePop), > 0.
    * ``is_lower``: ``None`` (TIS: truncate) or the IcePop lower bound (weights outside
      ``[is_lower, is_upper]`` become 0).
    * ``batch_normalize``: divide the weights by their batch mean.
    * ``rollout_rs``: the rejection options (canonical names of :data:`ROLLOUT_RS_OPTIONS`, in order,
      no repeats); empty: no rejection.
    * ``rs_bounds``: per option ``(lower, upper)``: for ``*_k1`` ratio bounds (both set), else
      ``(None, upper)`` on the divergence.
    * ``bypass_mode``, ``loss_type``: as in the config.
    """

    rollout_is: str | None = None
    is_upper: float = 2.0
    is_lower: float | None = None
    batch_normalize: bool = False
    rollout_rs: tuple[str, ...] = ()
    rs_bounds: Mapping[str, tuple[float | None, float]] = field(default_factory=dict)
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"

    @property
    def active(self) -> bool:
        """Whether weights or a rejection mask are computed."""
        return self.rollout_is is not None or bool(self.rollout_rs)


# ============================================================================ config


def _positive(value: str, what: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise ValueError(f"{what}: '{value}' is not a number.") from None
    if not (x > 0 and math.isfinite(x)):
        raise ValueError(f"{what}: {value} must be a positive finite number.")
    return x


def _parse_is_threshold(spec: Any) -> tuple[float, float | None]:
    """``(upper, lower)`` from ``rollout_is_threshold``: a number (TIS, lower ``None``) or a
    ``"lower_upper"`` string (IcePop). Raises ``ValueError``."""
    what = f"{_KEY}.rollout_is_threshold={spec!r}"
    if isinstance(spec, bool) or spec is None:
        raise ValueError(
            f"{what}: expected a positive number (the weight cap, e.g. 2.0) or 'lower_upper' (e.g. '0.5_5.0')."
        )
    if isinstance(spec, int | float):
        return _positive(str(spec), what), None
    text = str(spec).strip()
    if "_" not in text:
        return _positive(text, what), None
    low_s, up_s = text.split("_", 1)
    low, up = _positive(low_s, what), _positive(up_s, what)
    if low > up:
        raise ValueError(f"{what}: the lower bound {low} is above the upper bound {up}; write 'lower_upper'.")
    return up, low


def _parse_rs(options: Any, spec: Any) -> tuple[tuple[str, ...], dict[str, tuple[float | None, float]]]:
    """The rejection options and their bounds (verl's ``_parse_rollout_rs_thresholds``)."""
    names: list[str] = []
    for raw in str(options).split(","):
        opt = raw.strip()
        if not opt:
            continue
        opt = ROLLOUT_RS_ALIASES.get(opt, opt)
        if opt not in ROLLOUT_RS_OPTIONS:
            raise ValueError(
                f"{_KEY}.rollout_rs={options}: '{raw.strip()}' is not a rejection option. Use one of "
                f"{', '.join(ROLLOUT_RS_OPTIONS)} (or {', '.join(ROLLOUT_RS_ALIASES)}), several separated by commas, "
                "or null for no rejection."
            )
        if opt not in names:
            names.append(opt)
    if not names:
        raise ValueError(f"{_KEY}.rollout_rs={options!r} names no option; use null for no rejection.")
    if spec is None or isinstance(spec, bool):
        raise ValueError(
            f"{_KEY}.rollout_rs={options} needs {_KEY}.rollout_rs_threshold: 'lower_upper' ratio bounds for the "
            "*_k1 options (e.g. '0.999_1.001'; one number u means '1/u_u'), an upper bound on the divergence for "
            "k2/k3 (e.g. 0.01); one value for every option or one per option, comma separated."
        )
    specs = [s.strip() for s in str(spec).split(",") if s.strip()]
    if len(specs) == 1:
        specs = specs * len(names)
    if len(specs) != len(names):
        raise ValueError(
            f"{_KEY}.rollout_rs_threshold={spec!r} has {len(specs)} entries for {len(names)} rollout_rs options "
            f"({', '.join(names)}); give one shared value or exactly one per option."
        )
    bounds: dict[str, tuple[float | None, float]] = {}
    for opt, s in zip(names, specs, strict=True):
        what = f"{_KEY}.rollout_rs_threshold={spec!r} for {opt}"
        if opt.endswith("k1"):
            if "_" in s:
                low_s, up_s = s.split("_", 1)
                low, up = _positive(low_s, what), _positive(up_s, what)
            else:
                up = _positive(s, what)
                low = 1.0 / up
            if low > up:
                raise ValueError(f"{what}: the lower bound {low} is above the upper bound {up}; write 'lower_upper'.")
            bounds[opt] = (low, up)
        else:
            if "_" in s:
                raise ValueError(f"{what}: a k2/k3 option takes one upper bound on the divergence, not '{s}'.")
            bounds[opt] = (None, _positive(s, what))
    return tuple(names), bounds


def parse_rollout_correction(section: Any) -> RolloutCorrectionSettings:
    """Parse an ``algorithm.rollout_correction`` section (DictConfig, dataclass or mapping; ``None``:
    everything off) into :class:`RolloutCorrectionSettings`.

    Raises ``ValueError`` naming the key, the value and what is expected: ``rollout_is`` not in
    :data:`ROLLOUT_IS_LEVELS`, a threshold that is not positive or not ``lower <= upper``, an
    unknown ``rollout_rs`` option, ``rollout_rs`` without ``rollout_rs_threshold``, a ``loss_type``
    not in :data:`LOSS_TYPES`.
    """
    rc = typed(RolloutCorrectionConfig, section)
    level = rc.rollout_is
    if level is not None and level not in ROLLOUT_IS_LEVELS:
        raise ValueError(
            f"{_KEY}.rollout_is={level}: use 'token' (a weight per token), 'sequence' (one weight per response, "
            "the geometric mean of its token ratios) or null (no importance weights)."
        )
    upper, lower = _parse_is_threshold(rc.rollout_is_threshold)
    rs = rc.rollout_rs
    names, bounds = _parse_rs(rs, rc.rollout_rs_threshold) if rs is not None else ((), {})
    loss_type = str(rc.loss_type)
    if loss_type not in LOSS_TYPES:
        raise ValueError(
            f"{_KEY}.loss_type={loss_type}: use 'ppo_clip' (clipped surrogate against the engine's log-probs) or "
            "'reinforce' (importance-weighted REINFORCE)."
        )
    return RolloutCorrectionSettings(
        rollout_is=level,
        is_upper=upper,
        is_lower=lower,
        batch_normalize=bool(rc.rollout_is_batch_normalize),
        rollout_rs=names,
        rs_bounds=bounds,
        bypass_mode=bool(rc.bypass_mode),
        loss_type=loss_type,
    )


def rollout_correction_settings(cfg: Any) -> RolloutCorrectionSettings:
    """The run's settings: ``algorithm.rollout_correction``, with ``actor.rollout_is_threshold = C``
    read as ``rollout_is=token, rollout_is_threshold=C`` when ``rollout_is`` is null.

    ``cfg`` is the whole run config. Raises :class:`rlplug.config.schema.ConfigError` for a bad section
    (see :func:`parse_rollout_correction`) and when both spellings are set and disagree.
    """
    # once per step: the one section, not the whole config (cfg is the run's DictConfig)
    section = typed(RolloutCorrectionConfig, cfg.algorithm.rollout_correction)
    try:
        settings = parse_rollout_correction(section)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return with_threshold_alias(settings, cfg.actor.rollout_is_threshold, section)


def with_threshold_alias(
    settings: RolloutCorrectionSettings, alias: Any, section: Any = None
) -> RolloutCorrectionSettings:
    """``settings`` with ``actor.rollout_is_threshold = alias`` applied (``rollout_is=token`` capped at
    ``alias`` when ``rollout_is`` is null; unchanged for ``alias`` None). Used by the trainer's settings
    and by the ``bypass_mode`` loss, so both read the alias the same way. Raises
    :class:`rlplug.config.schema.ConfigError` for ``alias <= 0`` or a contradicting ``rollout_is``."""
    if alias is None:
        return settings
    alias = float(alias)
    if not alias > 0:
        raise ConfigError(
            f"actor.rollout_is_threshold={alias} must be > 0 (the cap of the importance weight, e.g. 2.0), "
            "or null to turn the correction off."
        )
    if settings.rollout_is is None:
        return dataclasses.replace(settings, rollout_is="token", is_upper=alias, is_lower=None)
    if settings.rollout_is != "token" or settings.is_lower is not None or settings.is_upper != alias:
        raise ConfigError(
            f"actor.rollout_is_threshold={alias} (token-level truncated IS capped at {alias}) contradicts "
            f"{_KEY}.rollout_is={settings.rollout_is}, rollout_is_threshold="
            f"{typed(RolloutCorrectionConfig, section).rollout_is_threshold}. actor.rollout_is_threshold is the older spelling "
            f"of {_KEY}.rollout_is=token with {_KEY}.rollout_is_threshold: set only one of them "
            "(remove actor.rollout_is_threshold)."
        )
    return settings


def bypasses_old_log_probs(cfg: Any) -> bool:
    """Whether the step skips the old-log-prob pass and uses the engine's log-probs instead
    (``algorithm.rollout_correction.bypass_mode``, verl's ``apply_bypass_mode``)."""
    return bool(typed(RolloutCorrectionConfig, cfg.algorithm.rollout_correction).bypass_mode)


def rollout_correction_requires(cfg: Any) -> tuple[str, ...]:
    """The batch fields the rollout correction reads: ``rollout_log_probs`` (bypass mode) or
    ``old_log_probs`` and ``rollout_log_probs`` (weights or rejection on); ``()`` when it is off.
    Used by :func:`rlplug.run.validate.plan_batch` (which turns the old-log-prob pass on and checks
    ``rollout.calculate_log_probs``)."""
    settings = rollout_correction_settings(cfg)
    if settings.bypass_mode:
        return ("rollout_log_probs",)
    return ("old_log_probs", "rollout_log_probs") if settings.active else ()


def validate_rollout_correction(
    cfg: Any, per_token: tuple[str, ...] = (), *, loss_is_bypass: bool | None = None
) -> None:
    """Config-time checks of the rollout correction; ``cfg`` is the whole run config and
    ``per_token`` the per-token quantities the plan keeps from the old-log-prob pass.

    Raises :class:`rlplug.config.schema.ConfigError` for a bad section, an inconsistent alias, weights or
    rejection or bypass mode with ``rollout.calculate_log_probs=false``, a bypass loss
    (``loss_is_bypass``: the selected :class:`rlplug.contracts.types.PolicyLoss` has ``bypass_mode=True``; None: the
    loss is the packaged ``bypass_mode``) without bypass mode, and in bypass mode: a policy loss that is
    not a bypass loss, ``rollout_is_batch_normalize=true``, or a plugin that needs a
    per-token quantity of the (skipped) old-log-prob pass.
    """
    settings = rollout_correction_settings(cfg)
    run = typed(RunConfig, cfg)
    loss_name = run.actor.policy_loss
    if loss_is_bypass is None:
        loss_is_bypass = loss_name == "bypass_mode"
    what = "bypass_mode=true" if settings.bypass_mode else "rollout_is / rollout_rs"
    if (settings.active or settings.bypass_mode) and not run.rollout.calculate_log_probs:
        raise ConfigError(
            f"{_KEY} ({what}) compares the trainer with the rollout engine's log-probs, but "
            "rollout.calculate_log_probs=false, so the engine returns none. Set rollout.calculate_log_probs=true."
        )
    if not settings.bypass_mode:
        if loss_is_bypass:
            raise ConfigError(
                f"actor.policy_loss={loss_name} uses the engine's log-probs as the old log-probs, but "
                f"{_KEY}.bypass_mode=false. Set {_KEY}.bypass_mode=true, or choose another policy loss."
            )
        return
    if not loss_is_bypass:
        raise ConfigError(
            f"{_KEY}.bypass_mode=true: the old log-probs are the engine's and the correction happens in the policy "
            f"loss, but actor.policy_loss={loss_name}. Set actor.policy_loss=bypass_mode "
            f"(verl switches to it silently), with {_KEY}.loss_type=ppo_clip or reinforce."
        )
    if settings.batch_normalize:
        raise ConfigError(
            f"{_KEY}.rollout_is_batch_normalize=true with bypass_mode=true: in bypass mode the weights are computed "
            "per micro-batch against the current policy, so a batch mean would depend on the micro-batch size. "
            "Set rollout_is_batch_normalize=false, or bypass_mode=false (weights once per step, normalised over the batch)."
        )
    if per_token:
        raise ConfigError(
            f"{_KEY}.bypass_mode=true skips the old-log-prob pass, but the selected plugins require "
            f"{', '.join(per_token)} from it. Set bypass_mode=false, or choose plugins that do not require them."
        )


def use_rollout_log_probs_as_old(batch: Any, cfg: Any) -> None:
    """Bypass mode: ``batch["old_log_probs"] = batch["rollout_log_probs"]`` (verl's ``apply_bypass_mode``);
    nothing otherwise. Raises ``ValueError`` when the batch has no ``rollout_log_probs``."""
    if not bypasses_old_log_probs(cfg):
        return
    if batch.get("rollout_log_probs") is None:
        raise ValueError(
            f"{_KEY}.bypass_mode=true needs the engine's log-probs (rollout_log_probs) but the rollout returned none; "
            "set rollout.calculate_log_probs=true and use a rollout backend that returns log-probs."
        )
    batch["old_log_probs"] = batch["rollout_log_probs"]


# ============================================================================ the math


def _item(x: torch.Tensor) -> float:
    return float(x.detach().float().item())


def _masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return x.masked_fill(~mask.bool(), float("-inf")).max()


def _masked_min(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return x.masked_fill(~mask.bool(), float("inf")).min()


def rollout_is_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    level: str = "token",
    upper: float = 2.0,
    lower: float | None = None,
    batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Importance weights ``pi_train / pi_rollout`` and their metrics (verl's ``compute_rollout_correction_weights``).

    Args:
        log_ratio: ``(B, T) float32`` ``log pi_train - log pi_rollout`` of the sampled tokens (nats).
        response_mask: ``(B, T)`` 1.0 on valid tokens; at least one must be valid.
        level: ``"token"``: ``w_t = exp(clamp(log_ratio_t, -20, 20))``; ``"sequence"``: every token of
            a response gets ``exp(clamp(mean_t log_ratio_t, -20, 20))``, the geometric mean of its
            token ratios over the valid tokens (verl: ``exp(sum_t)``; see the module docstring).
        upper, lower: ``lower=None``: truncate, ``min(w, upper)`` (TIS); else IcePop, ``w`` where
            ``lower <= w <= upper`` and 0 elsewhere.
        batch_normalize: divide by the batch mean of the weights (token level: over valid tokens;
            sequence level: over responses with a valid token), when it is > 1e-8.

    Returns:
        ``(weights, metrics)``: ``(B, T) float32`` detached weights, 0.0 on padding; metrics with
        verl's names (no prefix), computed before the batch normalisation: ``rollout_is_raw_mean``,
        ``_raw_max``, ``_raw_min`` (before truncation, rlplug's), ``rollout_is_mean`` (after),
        ``rollout_is_max`` / ``_min`` (after truncation at token level; before, from the log-ratio,
        at sequence level, as verl), ``rollout_is_ratio_fraction_high`` / ``_low`` (share above
        ``upper`` / below ``lower``, default ``1 / upper``: the truncated share; tokens, or
        responses at sequence level), ``rollout_is_std``, ``rollout_is_eff_sample_size``,
        ``rollout_is_seq_mean`` / ``_std`` / ``_max`` / ``_min`` / ``_max_deviation`` /
        ``_fraction_high`` / ``_fraction_low``, ``rollout_is_oob_ratio`` (IcePop) and
        ``rollout_is_batch_norm_factor`` (with ``batch_normalize``).

    Raises:
        ValueError: an unknown ``level``, an empty mask, or mismatched shapes.
    """
    if level not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"rollout_is level {level!r}: use one of {ROLLOUT_IS_LEVELS}.")
    if log_ratio.shape != response_mask.shape:
        raise ValueError(
            f"log_ratio {tuple(log_ratio.shape)} and response_mask {tuple(response_mask.shape)} must both be (B, T)."
        )
    if not bool(response_mask.bool().any()):
        raise ValueError("rollout_is_weights: response_mask has no valid token; there is nothing to weight.")
    with torch.no_grad():
        mask = response_mask.to(log_ratio.dtype)
        valid = mask.bool()
        if level == "token":
            metric_log_ratio = log_ratio
            raw = torch.exp(torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
        else:
            metric_log_ratio = masked_mean(log_ratio, mask, dim=-1)  # (B,) mean log-ratio per response
            raw = torch.exp(torch.clamp(metric_log_ratio, -SAFETY_BOUND, SAFETY_BOUND)).unsqueeze(-1).expand_as(mask)
        raw = torch.where(valid, raw, torch.zeros_like(raw))
        if lower is None:
            weights = raw.clamp(max=upper)
        else:
            weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
        low = 1.0 / upper if lower is None else lower
        m: dict[str, float] = {
            "rollout_is_raw_mean": _item(masked_mean(raw, mask)),
            "rollout_is_raw_max": _item(_masked_max(raw, mask)),
            "rollout_is_raw_min": _item(_masked_min(raw, mask)),
            "rollout_is_mean": _item(masked_mean(weights, mask)),
        }
        if level == "sequence":
            m["rollout_is_max"] = _item(torch.exp(torch.clamp(metric_log_ratio.max(), max=SAFETY_BOUND)))
            m["rollout_is_min"] = _item(torch.exp(metric_log_ratio.min()))
            m["rollout_is_ratio_fraction_high"] = _item((metric_log_ratio > math.log(upper)).float().mean())
            m["rollout_is_ratio_fraction_low"] = _item((metric_log_ratio < math.log(low)).float().mean())
        else:
            m["rollout_is_max"] = _item(_masked_max(weights, mask))
            m["rollout_is_min"] = _item(_masked_min(weights, mask))
            m["rollout_is_ratio_fraction_high"] = _item(masked_mean((raw > upper).float(), mask))
            m["rollout_is_ratio_fraction_low"] = _item(masked_mean((raw < low).float(), mask))
        capped = weights.clamp(min=0.0, max=upper)
        if mask.sum() > 1:
            mean_c = masked_mean(capped, mask)
            m["rollout_is_std"] = _item(
                torch.sqrt(torch.clamp(masked_mean(capped.square(), mask) - mean_c.square(), min=0.0))
            )
        else:
            m["rollout_is_std"] = 0.0
        normed = capped / (masked_mean(capped, mask) + 1e-8)
        m["rollout_is_eff_sample_size"] = 1.0 / _item(masked_mean(normed.square(), mask))
        seq = masked_mean(weights, mask, dim=-1)  # (B,)
        raw_seq = masked_mean(raw, mask, dim=-1)
        m["rollout_is_seq_mean"] = _item(seq.mean())
        m["rollout_is_seq_std"] = _item(seq.std()) if seq.numel() > 1 else 0.0
        m["rollout_is_seq_max"] = _item(seq.max())
        m["rollout_is_seq_min"] = _item(seq.min())
        m["rollout_is_seq_max_deviation"] = _item((seq - 1.0).abs().max())
        m["rollout_is_seq_fraction_high"] = _item((raw_seq > upper).float().mean())
        m["rollout_is_seq_fraction_low"] = _item((raw_seq < low).float().mean())
        if lower is not None:
            m["rollout_is_oob_ratio"] = _item(masked_mean(((raw < lower) | (raw > upper)).float(), mask))
        if batch_normalize:
            if level == "token":
                mean = masked_mean(weights, mask)
            else:
                has_token = (mask.sum(-1) > 0).to(weights.dtype)
                mean = (seq * has_token).sum() / has_token.sum().clamp_min(1e-8)
            if mean > 1e-8:
                weights = weights / mean
                m["rollout_is_batch_norm_factor"] = _item(mean)
            else:
                m["rollout_is_batch_norm_factor"] = 1.0
        return weights.detach(), m


def rollout_rejection_mask(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    options: tuple[str, ...],
    bounds: Mapping[str, tuple[float | None, float]],
) -> tuple[torch.Tensor, dict[str, float]]:
    """The response mask with rejected tokens and responses set to 0 (verl's ``compute_rollout_rejection_mask``).

    Per option (all must pass), with ``l = clamp(log_ratio, -20, 20)`` (``log pi_train - log
    pi_rollout``, ``(B, T) float32``) and the token divergences ``k1 = -l``, ``k2 = 0.5 l^2``,
    ``k3 = exp(l) - 1 - l``: ``token_kN`` tests each token's ``kN``; ``seq_sum_kN`` /
    ``seq_mean_kN`` / ``seq_max_kN`` test the masked sum / mean / max over a response's valid
    tokens and keep or reject the whole response. A ``*_k1`` option with ratio bounds
    ``(lower, upper)`` keeps ``log(lower) <= stat <= log(upper)``; a k2/k3 option ``(None, upper)``
    keeps ``stat <= upper``.

    Returns ``(mask, metrics)``: ``(B, T)`` ``response_mask * keep`` in ``response_mask``'s dtype, and
    (no prefix) ``rollout_rs_<option>_mean`` / ``_max`` / ``_min`` (the statistic over valid tokens,
    over responses for sequence options), ``rollout_rs_<option>_masked_fraction`` (share of valid
    tokens it rejects), ``rollout_rs_<option>_seq_masked_fraction`` (share of responses with a
    valid token that it touches), ``rollout_rs_masked_fraction`` (all options together, valid
    tokens) and ``rollout_rs_seq_masked_fraction`` (share of all responses that lost a token).
    Raises ``ValueError`` for an unknown option, a missing bound or mismatched shapes.
    """
    if log_ratio.shape != response_mask.shape:
        raise ValueError(
            f"log_ratio {tuple(log_ratio.shape)} and response_mask {tuple(response_mask.shape)} must both be (B, T)."
        )
    with torch.no_grad():
        mask = response_mask.to(log_ratio.dtype)
        valid = mask.bool()
        has_token = valid.any(-1)
        lr = torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
        token_stats = {"k1": -lr, "k2": 0.5 * lr.square(), "k3": torch.exp(lr) - 1.0 - lr}
        keep_all = torch.ones_like(mask)
        m: dict[str, float] = {}
        for opt in options:
            if opt not in ROLLOUT_RS_OPTIONS or opt not in bounds:
                raise ValueError(f"rollout_rs option {opt!r}: unknown or without bounds; use {ROLLOUT_RS_OPTIONS}.")
            low, up = bounds[opt]
            level, estimator = opt.rsplit("_", 1)
            per_token = token_stats[estimator]
            if level == "token":
                stat = per_token
            elif level == "seq_sum":
                stat = masked_sum(per_token, mask, dim=-1)
            elif level == "seq_mean":
                stat = masked_mean(per_token, mask, dim=-1)
            else:
                top = per_token.masked_fill(~valid, float("-inf")).max(dim=-1).values
                stat = torch.where(torch.isinf(top), torch.zeros_like(top), top)
            if estimator == "k1":
                if low is None:
                    raise ValueError(f"rollout_rs option {opt}: a k1 option needs (lower, upper) ratio bounds.")
                keep = (stat >= math.log(low)) & (stat <= math.log(up))
            else:
                keep = stat <= up
            keep_tok = keep if level == "token" else keep.unsqueeze(-1).expand_as(valid)
            keep_f = keep_tok.to(mask.dtype)
            keep_all = keep_all * keep_f
            if level == "token":
                m[f"rollout_rs_{opt}_mean"] = _item(masked_mean(stat, mask))
                m[f"rollout_rs_{opt}_max"] = _item(_masked_max(stat, mask))
                m[f"rollout_rs_{opt}_min"] = _item(_masked_min(stat, mask))
            else:
                m[f"rollout_rs_{opt}_mean"] = _item(stat[has_token].mean()) if bool(has_token.any()) else 0.0
                m[f"rollout_rs_{opt}_max"] = _item(stat[has_token].max()) if bool(has_token.any()) else 0.0
                m[f"rollout_rs_{opt}_min"] = _item(stat[has_token].min()) if bool(has_token.any()) else 0.0
            m[f"rollout_rs_{opt}_masked_fraction"] = _item(masked_mean(1.0 - keep_f, mask))
            seq_touched = (~keep_tok & valid).any(-1)
            m[f"rollout_rs_{opt}_seq_masked_fraction"] = (
                _item(seq_touched[has_token].float().mean()) if bool(has_token.any()) else 0.0
            )
        m["rollout_rs_masked_fraction"] = _item(masked_mean(1.0 - keep_all, mask))
        m["rollout_rs_seq_masked_fraction"] = _item(((keep_all < 0.5) & valid).any(-1).float().mean())
        return (response_mask * keep_all.to(response_mask.dtype)).to(response_mask.dtype), m


def offpolicy_metrics(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """Mismatch diagnostics between the trainer and the engine (verl's ``compute_offpolicy_metrics``), no prefix.

    ``old_log_probs`` / ``rollout_log_probs`` ``(B, T) float32`` nats, ``response_mask`` ``(B, T)``.
    With ``l = old_log_probs - rollout_log_probs`` and per-response means ``mean_t`` over valid
    tokens: ``kl`` = masked mean of ``-l`` (KL(rollout || train), nats), ``k3_kl`` = masked mean
    of ``exp(l) - l - 1``, ``training_ppl`` / ``rollout_ppl`` = batch mean of ``exp(-mean_t log p)``,
    ``training_log_ppl`` / ``rollout_log_ppl`` = batch mean of ``-mean_t log p``, ``log_ppl_diff``
    (mean, ``_abs_diff``, ``_max``, ``_min``) of ``mean_t rollout - mean_t old``, ``ppl_ratio`` =
    mean of ``exp(log_ppl_diff)``, ``chi2_token`` = masked mean of ``exp(2 clamp(l))`` - 1,
    ``chi2_seq`` = mean of ``exp(2 clamp(sum_t l))`` - 1 (clamps at +-20).
    """
    with torch.no_grad():
        mask = response_mask.to(old_log_probs.dtype)
        mean_old = masked_mean(old_log_probs, mask, dim=-1)
        mean_roll = masked_mean(rollout_log_probs, mask, dim=-1)
        lr = old_log_probs - rollout_log_probs
        diff = mean_roll - mean_old
        lr_safe = torch.clamp(lr, -SAFETY_BOUND, SAFETY_BOUND)
        seq_sum = torch.clamp(masked_sum(lr, mask, dim=-1), -SAFETY_BOUND, SAFETY_BOUND)
        return {
            "training_ppl": _item(torch.exp(-mean_old).mean()),
            "training_log_ppl": _item((-mean_old).mean()),
            "kl": _item(masked_mean(-lr, mask)),
            "k3_kl": _item(masked_mean(torch.exp(lr) - lr - 1.0, mask)),
            "rollout_ppl": _item(torch.exp(-mean_roll).mean()),
            "rollout_log_ppl": _item((-mean_roll).mean()),
            "log_ppl_diff": _item(diff.mean()),
            "log_ppl_abs_diff": _item(diff.abs().mean()),
            "log_ppl_diff_max": _item(diff.max()),
            "log_ppl_diff_min": _item(diff.min()),
            "ppl_ratio": _item(torch.exp(diff).mean()),
            "chi2_token": _item(masked_mean(torch.exp(lr_safe).square(), mask) - 1.0),
            "chi2_seq": _item(torch.exp(2.0 * seq_sum).mean() - 1.0),
        }


def compute_rollout_correction(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    settings: RolloutCorrectionSettings,
    *,
    with_offpolicy_metrics: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """Weights, rejection and metrics in one call (verl's ``compute_rollout_correction_and_rejection_mask``).

    ``old_log_probs`` (the trainer's, or the current policy's in bypass mode) and
    ``rollout_log_probs`` ``(B, T) float32`` nats; ``response_mask`` ``(B, T)`` with a valid token.
    The weights (:func:`rollout_is_weights` of ``old_log_probs - rollout_log_probs``) and the
    rejection (:func:`rollout_rejection_mask`) both use the given mask; the weights are not
    multiplied by the rejection (a rejected token's loss is masked anyway).

    Returns ``(weights or None, mask, metrics)``: ``(B, T) float32`` detached weights when
    ``settings.rollout_is`` is set, the response mask after rejection (the given one, cloned,
    without rejection) and every metric prefixed ``rollout_corr/`` (with
    :func:`offpolicy_metrics` unless ``with_offpolicy_metrics=False``). Raises ``ValueError`` for
    mismatched shapes or an empty mask.
    """
    if not (old_log_probs.shape == rollout_log_probs.shape == response_mask.shape):
        raise ValueError(
            f"old_log_probs {tuple(old_log_probs.shape)}, rollout_log_probs {tuple(rollout_log_probs.shape)} and "
            f"response_mask {tuple(response_mask.shape)} must all be (B, T); are the engine's log-probs padded to the "
            "response length?"
        )
    if not bool(response_mask.bool().any()):
        raise ValueError("rollout correction: response_mask has no valid token.")
    with torch.no_grad():
        log_ratio = old_log_probs.detach().float() - rollout_log_probs.detach().float()
        metrics: dict[str, float] = {}
        weights = None
        if settings.rollout_is is not None:
            weights, m = rollout_is_weights(
                log_ratio,
                response_mask,
                settings.rollout_is,
                settings.is_upper,
                settings.is_lower,
                settings.batch_normalize,
            )
            metrics.update(m)
        mask = response_mask.clone()
        if settings.rollout_rs:
            mask, m = rollout_rejection_mask(log_ratio, response_mask, settings.rollout_rs, settings.rs_bounds)
            metrics.update(m)
        if with_offpolicy_metrics:
            metrics.update(offpolicy_metrics(old_log_probs.float(), rollout_log_probs.float(), response_mask))
    return weights, mask, {f"rollout_corr/{k}": v for k, v in metrics.items()}


def apply_rollout_correction(batch: Any, cfg: Any) -> dict[str, float]:
    """The trainer's once-per-step rollout correction; returns its ``rollout_corr/*`` metrics.

    ``batch`` is the step's :class:`rlplug.contracts.batch.Batch` after the old log-probs and the in-reward
    KL; ``cfg`` the whole run config (:func:`rollout_correction_settings`). With weights or
    rejection configured (and not in bypass mode, where the ``bypass_mode`` loss does it per
    micro-batch) it puts ``rollout_is_weights`` ``(B, T) float32`` on the batch and replaces
    ``response_mask`` by the mask after rejection, as verl's
    ``compute_rollout_correction_and_add_to_batch`` does. With neither, but both log-probs on the
    batch, it only returns :func:`offpolicy_metrics` (verl logs them whenever the engine's
    log-probs are there). Otherwise it does nothing and returns ``{}``.

    Raises ``ValueError`` when the correction is configured but the batch lacks
    ``old_log_probs`` or ``rollout_log_probs``.
    """
    settings = rollout_correction_settings(cfg)
    old, rollout, mask = batch.get("old_log_probs"), batch.get("rollout_log_probs"), batch.get("response_mask")
    if settings.bypass_mode or mask is None or not bool(mask.bool().any()):
        return {}
    if not settings.active:
        if old is None or rollout is None:
            return {}
        return {f"rollout_corr/{k}": v for k, v in offpolicy_metrics(old, rollout, mask).items()}
    if old is None or rollout is None:
        missing = [k for k, v in (("old_log_probs", old), ("rollout_log_probs", rollout)) if v is None]
        raise ValueError(
            f"{_KEY} (rollout_is / rollout_rs) needs {' and '.join(missing)} on the batch; set "
            "rollout.calculate_log_probs=true (rollout_log_probs) and do not skip the old-log-prob pass."
        )
    weights, new_mask, metrics = compute_rollout_correction(old, rollout, mask, settings)
    batch["response_mask"] = new_mask
    if weights is not None:
        batch["rollout_is_weights"] = weights.to(torch.float32)
    return metrics
