"""Per-token KL estimators between the actor and the reference policy (kind ``kl_penalty``).

With ``d = log_probs - ref_log_probs`` (nats, ``(B, T) float32``, log-probs of the sampled tokens
under the actor and the reference model), the registered estimators are:

==================  ============================================================================
name                value
==================  ============================================================================
``k1`` / ``kl``     ``d`` (unbiased, high variance, can be negative)
``abs``             ``|d|``
``k2`` / ``mse``    ``0.5 * d^2``
``k3`` /            ``clamp(exp(x) - x - 1, -10, 10)`` with ``x = clamp(-d, -20, 20)``
``low_var_kl``      (Schulman, "Approximating KL divergence", 2020; non-negative, low variance)
``<name>+``         straight-through: the value of ``<name>``, the gradient of ``k2``
                    (``k2(d) + (base - k2(d)).detach()``), for every name above **(differs from
                    verl, where ``k1+``/``k3+`` raise NotImplementedError)**
==================  ============================================================================

Results are ``(B, T) float32`` in nats and NOT masked (the caller masks and aggregates).
Source: verl ``kl_penalty`` in ``verl/trainer/ppo/core_algos.py``. verl's ``full`` (the exact KL
over the vocabulary from ``(B, T, V)`` logits) is not registered: rlplug's log-prob pass never
keeps the logits of the actor and the reference model at once **(differs from verl)**.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlplug.plugin import KLPenalty, hookimpl

__all__ = ["kl_penalty", "KL_NAMES", "BASE_KL_NAMES"]


def _check(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> None:
    if log_probs.shape != ref_log_probs.shape:
        raise ValueError(
            f"KL penalty: log_probs has shape {tuple(log_probs.shape)} but ref_log_probs has "
            f"{tuple(ref_log_probs.shape)}; both must be (B, T) log-probs of the same sampled tokens."
        )


def _k1(log_probs, ref_log_probs):
    return log_probs - ref_log_probs


def _abs(log_probs, ref_log_probs):
    return (log_probs - ref_log_probs).abs()


def _k2(log_probs, ref_log_probs):
    d = log_probs - ref_log_probs
    return 0.5 * d * d


def _k3(log_probs, ref_log_probs):
    x = torch.clamp(ref_log_probs - log_probs, -20.0, 20.0)
    return torch.clamp(torch.exp(x) - x - 1.0, -10.0, 10.0)


_BASE: dict[str, tuple[Callable[..., torch.Tensor], str]] = {
    "k1": (_k1, "k1: log_probs - ref_log_probs"),
    "kl": (_k1, "alias of k1: log_probs - ref_log_probs"),
    "abs": (_abs, "|log_probs - ref_log_probs|"),
    "k2": (_k2, "k2: 0.5 * (log_probs - ref_log_probs)^2"),
    "mse": (_k2, "alias of k2: 0.5 * (log_probs - ref_log_probs)^2"),
    "k3": (_k3, "k3 (Schulman 2020): exp(-d) + d - 1, clamped"),
    "low_var_kl": (_k3, "alias of k3 (Schulman 2020): exp(-d) + d - 1, clamped"),
}

#: Base estimator names (aliases included), without the straight-through ``+`` variants.
BASE_KL_NAMES: tuple[str, ...] = tuple(_BASE)
#: Every registered name.
KL_NAMES: tuple[str, ...] = BASE_KL_NAMES + tuple(f"{n}+" for n in BASE_KL_NAMES)


def kl_penalty(name: str, log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """Per-token KL estimate ``(B, T) float32`` (nats, unmasked) of kind ``name``.

    ``log_probs``/``ref_log_probs`` ``(B, T) float32``: log-probs of the sampled tokens under the
    actor and the reference. ``name`` is one of :data:`KL_NAMES` (see the module docstring). A trailing ``+`` returns the
    base value with the gradient of ``k2``.

    Raises ``ValueError`` for an unknown name (listing the names) or mismatched shapes.
    """
    straight_through = name.endswith("+")
    base = name[:-1] if straight_through else name
    if base not in _BASE:
        raise ValueError(f"Unknown KL penalty {name!r}. Available: {', '.join(KL_NAMES)}.")
    _check(log_probs, ref_log_probs)
    value = _BASE[base][0](log_probs, ref_log_probs)
    if not straight_through:
        return value
    k2 = _k2(log_probs, ref_log_probs)
    return k2 + (value - k2).detach()


def _make(name: str) -> Callable[..., torch.Tensor]:
    def fn(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
        return kl_penalty(name, log_probs, ref_log_probs)

    fn.__name__ = f"kl_{name.replace('+', '_plus')}"
    fn.__doc__ = f"KL penalty {name!r}; see :func:`rlplug.plugins.algorithms.kl.kl_penalty`."
    return fn


@hookimpl
def register_kl_penalties(register):
    for base, (_, desc) in _BASE.items():
        register(base, KLPenalty(_make(base), description=desc))
        register(
            f"{base}+", KLPenalty(_make(f"{base}+"), description=f"straight-through: value of {base}, gradient of k2")
        )
