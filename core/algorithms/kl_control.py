"""KL coefficient controllers for the KL penalty in the reward (``algorithm.kl_ctrl``).

``beta`` (``controller.value``) multiplies the per-token KL subtracted from the token-level
scores (see :func:`rlplug.algorithms.losses.apply_kl_penalty`). After each step the trainer calls
``controller.update(current_kl, n_steps)`` with the step's mean KL (nats) and the number of
responses in the step.

Controllers hold plain Python floats, so ``state_dict()`` is JSON-serialisable and goes into the
trainer checkpoint.
"""

from __future__ import annotations

import logging
from typing import Any

from rlplug.config.schema import KLControlConfig, typed

__all__ = ["FixedKLController", "AdaptiveKLController", "make_kl_controller", "KL_CONTROLLER_TYPES"]

#: Values accepted by ``algorithm.kl_ctrl.type``.
KL_CONTROLLER_TYPES: tuple[str, ...] = ("fixed", "adaptive")


class FixedKLController:
    """A constant coefficient: ``value == kl_coef`` forever (verl ``FixedKLController``)."""

    type = "fixed"

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (the coefficient is fixed)."""

    def state_dict(self) -> dict[str, Any]:
        return {"type": self.type, "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``value`` from :meth:`state_dict`; raises ``ValueError`` for another controller type's state."""
        _check_state(self.type, state)
        self.value = float(state["value"])

    def __repr__(self) -> str:
        return f"FixedKLController(kl_coef={self.value})"


class AdaptiveKLController:
    """Adaptive coefficient of Ziegler et al. 2019, "Fine-Tuning Language Models from Human
    Preferences" (verl ``AdaptiveKLController``).

    On ``update(current_kl, n_steps)``::

        err = clip(current_kl / target_kl - 1, -0.2, 0.2)
        value *= 1 + err * n_steps / horizon

    ``current_kl`` in nats (mean per-token KL of the step), ``n_steps`` the number of responses
    in the step, ``horizon`` in responses. Raises ``ValueError`` when ``target_kl <= 0`` or
    ``horizon <= 0``.
    """

    type = "adaptive"

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if not horizon or horizon <= 0:
            raise ValueError(f"algorithm.kl_ctrl.horizon must be > 0 for the adaptive KL controller, got {horizon!r}.")
        if not target_kl or target_kl <= 0:
            raise ValueError(
                f"algorithm.kl_ctrl.target_kl must be > 0 for the adaptive KL controller, got {target_kl!r}."
            )
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move ``value`` towards keeping ``current_kl`` near ``target_kl`` (see the class docstring)."""
        err = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * float(n_steps) / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"type": self.type, "value": self.value, "target_kl": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``value`` from :meth:`state_dict`.

        ``target_kl`` and ``horizon`` are settings, so the current config wins over the
        checkpoint; a difference is logged (warning) so a changed setting is never silent.
        """
        _check_state(self.type, state)
        self.value = float(state["value"])
        for key, mine in (("target_kl", self.target), ("horizon", self.horizon)):
            saved = state.get(key)
            if saved is not None and float(saved) != float(mine):
                logging.getLogger(__name__).warning(
                    "algorithm.kl_ctrl.%s is %g in the config but %g in the checkpoint; using the config's value",
                    key,
                    mine,
                    float(saved),
                )

    def __repr__(self) -> str:
        return f"AdaptiveKLController(value={self.value}, target_kl={self.target}, horizon={self.horizon:g})"


def _check_state(expected: str, state: dict[str, Any]) -> None:
    if "value" not in state:
        raise ValueError(f"KL controller state has no 'value' key: {state!r}")
    got = state.get("type", expected)
    if got != expected:
        raise ValueError(
            f"Cannot load a '{got}' KL controller state into a '{expected}' controller; "
            f"algorithm.kl_ctrl.type changed since the checkpoint was written."
        )


def make_kl_controller(kl_ctrl_config: Any) -> FixedKLController | AdaptiveKLController:
    """Build the controller described by ``algorithm.kl_ctrl`` (DictConfig, dataclass or dict).

    Keys: ``type`` (``fixed`` | ``adaptive``, default ``fixed``), ``kl_coef`` (initial/fixed
    beta, default 0.001), ``target_kl`` (0.1) and ``horizon`` (10000) for ``adaptive``.
    Raises ``ValueError`` for an unknown type (listing the types) or a bad adaptive setting.
    """
    ctrl = typed(KLControlConfig, kl_ctrl_config)
    kind = ctrl.type
    kl_coef = float(ctrl.kl_coef)
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(
            kl_coef,
            float(ctrl.target_kl),
            ctrl.horizon,
        )
    raise ValueError(
        f"Unknown KL controller type {kind!r} (algorithm.kl_ctrl.type). Available: {', '.join(KL_CONTROLLER_TYPES)}."
    )
