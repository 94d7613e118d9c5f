"""Reward normalisation (``reward.normalize``): sequence scores standardised with running statistics.

A reward model's scores (or a shaped sum of rewards) often drift in scale during training, and a
critic trained on returns of one scale lags when the scale moves. With ``reward.normalize.enable``
each training step's sequence scores are replaced, before anything else reads them (the in-reward
KL, the advantage estimator, the critic's returns), by::

    z = clamp((score - mean) / (std + eps), -clip, +clip)

where ``mean`` and ``std = sqrt(var)`` are exponential moving statistics of the scores of all steps
so far, this step's included (:meth:`ScoreNormalizer.update` runs first, then the scores are
normalised with the updated statistics). The update with momentum ``m`` and this step's scored
responses ``x`` (batch mean ``mu_b``, population variance ``var_b``, in float64) is::

    first update:  mean = mu_b;  var = var_b
    later:         d = mu_b - mean
                   mean = m * mean + (1 - m) * mu_b
                   var  = m * var + (1 - m) * var_b + m * (1 - m) * d^2

The variance is that of the mixture "old statistics with weight ``m``, this batch with weight
``1 - m``" (the Welford / Chan et al. combination of two groups, with EMA weights instead of
counts), so a shift of the mean shows as variance. Initialising from the first batch instead of
from zero leaves no start-up bias, so no bias correction is needed. Before the first update the
statistics read mean 0 and std 1; nothing is normalised with them (a step without a scored
response neither updates nor normalises anything).

Only the scored rows (:func:`rlplug.rewards.manager.scored_rows`: reward succeeded, ReMax baseline finite)
enter the statistics; the others keep their score of 0 and are left out of training anyway.
ReMax's greedy ``reward_baselines`` are normalised with the same statistics (they do not update
them), so ``score - baseline`` stays on one scale. The logged ``critic/score/*`` stay the raw
scores; ``critic/rewards/*`` show the normalised ones.

verl has no counterpart; OpenRLHF's ``--normalize_reward`` uses a reward model's fixed statistics
and TRL's ``RunningMoments`` equal-weight running moments. The EMA form here follows the issue's
request (momentum 0.9-0.99) so old statistics fade as the policy moves.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from rlplug.config.schema import ConfigError, RewardNormalizeConfig, typed

__all__ = ["ScoreNormalizer", "check_normalize_config"]


def check_normalize_config(section: Any, key: str = "reward.normalize") -> tuple[bool, float, float, float]:
    """``(enable, momentum, clip, eps)`` of the ``reward.normalize`` section (DictConfig, dataclass,
    mapping or None: off), checked.

    Raises:
        ConfigError: ``momentum`` outside ``[0.9, 1)`` (practitioners use 0.9-0.99; 1 would never
            update, below 0.9 the statistics follow single batches), ``clip <= 0`` or ``eps <= 0``.
    """
    norm = typed(RewardNormalizeConfig, section)
    enable = bool(norm.enable)
    momentum, clip = float(norm.momentum), float(norm.clip)
    eps = float(norm.eps)
    if not 0.9 <= momentum < 1.0:
        raise ConfigError(
            f"{key}.momentum={momentum}: the weight of the old statistics in the moving average must be in "
            "[0.9, 1) (0.9-0.99 is the range used in practice: 0.9 remembers about 10 steps, 0.99 about 100; "
            "1.0 would never update). E.g. reward.normalize.momentum=0.95."
        )
    if not clip > 0.0:
        raise ConfigError(
            f"{key}.clip={clip}: normalised scores are clipped to +-clip, so it must be > 0 (3-10 is usual, "
            "e.g. 5.0; a large value such as 1e9 turns the clipping off)."
        )
    if not eps > 0.0:
        raise ConfigError(f"{key}.eps={eps}: it guards the division by the running std, so it must be > 0 (e.g. 1e-6).")
    return enable, momentum, clip, eps


class ScoreNormalizer:
    """Running mean/variance of the training scores and the normalisation they give (module docstring).

    Args:
        section: the ``reward.normalize`` config section (``enable``, ``momentum``, ``clip``,
            ``eps``); None or ``enable=false``: calling the object returns the scores unchanged.

    The statistics (``mean``, ``var`` as Python floats, ``count`` of updates) are part of the
    checkpoint (:meth:`state_dict`, stored as JSON, which keeps floats exactly), so a resumed run
    normalises exactly as an uninterrupted one. Raises :class:`rlplug.config.schema.ConfigError` for bad
    settings (:func:`check_normalize_config`).
    """

    #: checkpoints written before the normaliser existed resume with fresh statistics
    optional_state = True

    def __init__(self, section: Any = None) -> None:
        self.enable, self.momentum, self.clip, self.eps = check_normalize_config(section)
        self.mean, self.var, self.count = 0.0, 1.0, 0

    @property
    def std(self) -> float:
        """The running standard deviation ``sqrt(var)`` (score units)."""
        return math.sqrt(self.var)

    def update(self, scores: torch.Tensor, scored: torch.Tensor) -> None:
        """Fold the ``scored`` rows (``(B,) bool``) of ``scores`` (``(B,) float32``) into the statistics
        (the update of the module docstring); no scored row: nothing changes."""
        x = scores.detach().cpu().double()[scored.cpu().bool()]
        if x.numel() == 0:
            return
        mu_b, var_b = float(x.mean()), float(x.var(unbiased=False))
        if self.count == 0:
            self.mean, self.var = mu_b, var_b
        else:
            m, d = self.momentum, mu_b - self.mean
            self.mean = m * self.mean + (1.0 - m) * mu_b
            self.var = m * self.var + (1.0 - m) * var_b + m * (1.0 - m) * d * d
        self.count += 1

    def normalize(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(z, clipped)``: ``clamp((values - mean) / (std + eps), -clip, clip)`` with the current
        statistics, computed in float64 and returned in ``values``' dtype, and the ``bool`` mask of the
        entries that were clipped (``|z| > clip`` before the clamp). NaN stays NaN. Same shape."""
        z = (values.detach().double() - self.mean) / (self.std + self.eps)
        return z.clamp(-self.clip, self.clip).to(values.dtype), z.abs() > self.clip

    def __call__(
        self, scores: torch.Tensor, scored: torch.Tensor, batch: Any, metrics: dict[str, float]
    ) -> torch.Tensor:
        """One training step: update with the ``scored`` rows of ``scores`` (``(B,) float32``), then
        return the normalised scores ``(B,) float32`` (unscored rows: 0.0) and replace
        ``batch["reward_baselines"]`` (when present, ``(B,) float32``) by its normalisation. Adds
        ``critic/score_norm/mean`` and ``/std`` (the statistics used this step) and ``/clipfrac``
        (share of the scored rows clipped) to ``metrics``. Disabled: returns ``scores`` itself."""
        if not self.enable:
            return scores
        scored = scored.cpu().bool()
        self.update(scores, scored)
        z, clipped = self.normalize(scores)
        if batch is not None and batch.get("reward_baselines") is not None:
            batch["reward_baselines"] = self.normalize(batch["reward_baselines"])[0]
        n = int(scored.sum())
        metrics["critic/score_norm/mean"] = self.mean
        metrics["critic/score_norm/std"] = self.std
        metrics["critic/score_norm/clipfrac"] = float(clipped[scored].sum()) / n if n else 0.0
        return torch.where(scored, z, torch.zeros_like(z))

    def state_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.mean, self.var, self.count = float(state["mean"]), float(state["var"]), int(state["count"])
