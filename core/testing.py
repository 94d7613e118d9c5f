"""pytest fixtures and checks for plugin authors (loaded automatically as a pytest plugin).

rlplug declares this module under the ``pytest11`` entry-point group, so once rlplug is installed
every pytest session gets these fixtures without a ``conftest.py``:

``rlplug_registry``
    A clean :class:`rlplug.contracts.registry.Registry` with no plugin loaded, installed as the process-wide
    registry for the duration of the test (``rlplug.get_plugin`` and ``rlplug.plugin_names`` see
    it) and restored afterwards. Add your plugin module with ``rlplug_registry.add_plugin(module)``.
``rlplug_full_registry``
    A fresh registry with every installed entry point loaded (what ``rlplug train`` sees), also
    installed process-wide for the test and restored afterwards.
``make_batch``
    :func:`make_batch`: small random ``(B, T)`` tensors with the names the trainer uses.
``assert_advantage_contract``
    :func:`assert_advantage_contract`: the checks every advantage estimator must pass.

Besides the fixtures, :func:`reduction_tolerance` says how large ``atol`` must be to compare two
evaluations of a floating-point computation (another kernel, CPU kind or batch split), from its
dtype, its reduction length and its magnitude, instead of one machine's observed difference.

Example (a third-party plugin's test)::

    import my_plugin

    def test_my_estimator(rlplug_registry, make_batch, assert_advantage_contract):
        assert rlplug_registry.add_plugin(my_plugin), rlplug_registry.broken
        est = rlplug.get_plugin("advantage_estimator", "my_adv")
        adv, ret = assert_advantage_contract(est, make_batch(group_size=4), {"norm_adv_by_std_in_grpo": True})

Disable the plugin with ``pytest -p no:rlplug``. Heavy imports (torch, the registry) happen
inside the fixtures, so loading this module costs nothing for unrelated test suites.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from rlplug.contracts.registry import Registry

import math

from rlplug.conformance import (  # make_batch, algorithm_config, REWARD_COMPONENT_NAMES: defined there
    REWARD_COMPONENT_NAMES,
    LookupTool,
    algorithm_config,
    check_advantage_estimator,
    check_batch_filter,
    check_environment,
    check_kl_penalty,
    check_policy_loss,
    check_protocol,
    check_reward_function,
    check_rollout_backend,
    check_tool,
    check_tracker,
    check_training_backend,
    environment_context,
    make_batch,
)
from rlplug.contracts.registry import Registry, get_plugin, set_registry

__all__ = [
    "make_batch",
    "assert_advantage_contract",
    "algorithm_config",
    "REWARD_COMPONENT_NAMES",
    "check_protocol",
    "check_advantage_estimator",
    "check_policy_loss",
    "check_kl_penalty",
    "check_batch_filter",
    "check_reward_function",
    "check_rollout_backend",
    "check_training_backend",
    "check_tracker",
    "check_tool",
    "LookupTool",
    "check_environment",
    "environment_context",
    "reduction_tolerance",
]


def assert_advantage_contract(
    estimator: Any,
    data: Mapping[str, torch.Tensor],
    config: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Call ``estimator(data, config)`` and check the advantage-estimator contract.

    ``estimator`` is an :class:`rlplug.contracts.types.AdvantageEstimator` (or its registered name, looked
    up in the current registry); ``data`` a mapping such as :func:`make_batch` returns (needs
    ``token_level_rewards`` and ``response_mask`` ``(B, T) float32`` plus the estimator's
    ``requires``); ``config`` the ``algorithm`` section (default: :func:`algorithm_config`).

    Checks, each failing with an ``AssertionError`` that says what was wrong:

    * the result is a pair ``(advantages, returns)`` of tensors;
    * both are ``(B, T)`` with the mask's shape and ``float32`` dtype;
    * both are finite and exactly ``0.0`` wherever ``response_mask`` is 0;
    * the inputs are not modified in place.

    Returns ``(advantages, returns)`` for further, estimator-specific assertions.
    """
    import torch  # deferred: torch

    if isinstance(estimator, str):
        estimator = get_plugin("advantage_estimator", estimator)
    if config is None:
        config = algorithm_config()
    before = {k: v.clone() for k, v in data.items() if isinstance(v, torch.Tensor)}
    result = estimator(data, config)
    assert isinstance(result, tuple) and len(result) == 2, (
        f"an advantage estimator must return (advantages, returns), got {type(result).__name__}"
        + (f" of length {len(result)}" if isinstance(result, (tuple, list)) else "")
    )
    mask = data["response_mask"]
    for what, t in zip(("advantages", "returns"), result):
        assert isinstance(t, torch.Tensor), f"{what} must be a torch.Tensor, got {type(t).__name__}"
        assert t.shape == mask.shape, (
            f"{what} has shape {tuple(t.shape)}, expected (B, T) = {tuple(mask.shape)} like response_mask"
        )
        assert t.dtype == torch.float32, f"{what} has dtype {t.dtype}, expected torch.float32"
        assert bool(torch.isfinite(t).all()), f"{what} has non-finite values: {t}"
        off = t[mask == 0]
        assert bool((off == 0).all()), (
            f"{what} must be exactly 0.0 where response_mask is 0; found {int((off != 0).sum())} "
            f"non-zero padded position(s), e.g. {off[off != 0][:5].tolist()}"
        )
    for key, old in before.items():
        assert torch.equal(data[key], old), f"the estimator modified its input '{key}' in place"
    return result  # type: ignore[return-value]


# ============================================================================ tolerances


def reduction_tolerance(
    dtype: torch.dtype,
    n_terms: int,
    scale: float | torch.Tensor = 1.0,
    *,
    accumulate_dtype: torch.dtype | None = None,
    lam: float = 10.0,
) -> float:
    """Absolute tolerance for two evaluations of one floating-point computation that may differ
    in the order of their operations (another kernel, CPU kind, blocking, micro-batch split).

    Use it as ``atol`` (with ``rtol=0``)::

        tol = reduction_tolerance(torch.float32, n_terms=hidden, scale=ref.abs().max())
        torch.testing.assert_close(got, ref, rtol=0, atol=tol)

    Args:
        dtype: the floating dtype the terms and the result are stored in (``torch.float32``,
            ``torch.bfloat16``, ...).
        n_terms: ``n``, the number of terms of the reduction (the ``K`` of a matmul, the length
            summed over). For a chain of computations (a network's forward, a forward and
            backward), the sum of the reduction lengths along the longest chain (see below).
        scale: a bound on the magnitudes the rounding errors are relative to: ``sum |x_i|`` of a
            sum, ``sum |x_i y_i|`` of a dot product; in practice the largest magnitude of the
            compared values or of the intermediate quantities (``ref.abs().max()``). A number or
            a 0-dim tensor.
        accumulate_dtype: the dtype the sum is accumulated in, when wider than ``dtype`` (bf16
            matmuls accumulate in ``torch.float32``); default ``dtype``.
        lam: ``lambda`` of the probabilistic bound below (default 10).

    Returns:
        ``2 * (gamma(n, u_acc) + u) * scale``, a float (same unit as ``scale``), where ``u`` and
        ``u_acc`` are the unit roundoffs ``eps / 2`` of ``dtype`` and ``accumulate_dtype``
        (float32: ``2**-24``; bfloat16: ``2**-8``; float16: ``2**-11``; float64: ``2**-53``).

    Derivation. A sum of ``n`` floating-point terms, added in any order (sequentially, pairwise,
    blocked, in SIMD lanes), satisfies ``|s_hat - s| <= gamma_{n-1} * sum |x_i|``, and a dot
    product ``|fl(x . y) - x . y| <= gamma_n * sum |x_i y_i|``, with ``gamma_n = n u / (1 - n u)``
    (N. J. Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., SIAM 2002,
    Lemma 3.1 and eqs. (3.4)-(3.5), and eq. (4.4) for any summation order). This worst case
    grows like ``n``; when rounding errors are modelled as independent, mean-zero random
    variables, ``|s_hat - s| <= gamma~_n(lam) * sum |x_i y_i|`` with
    ``gamma~_n(lam) = exp(lam sqrt(n) u + n u^2 / (1 - u)) - 1 ~= lam sqrt(n) u``, which fails
    with probability at most ``2 n exp(-lam^2 (1 - u)^2 / 2)`` (N. J. Higham and T. Mary, "A New
    Approach to Probabilistic Rounding Error Analysis", SIAM J. Sci. Comput. 41(5), 2019,
    Theorem 2.4, and section 3 for inner products; for ``lam = 10``: ``< 4e-22 n``). Both are valid, so ``gamma`` is
    the smaller: the worst case for ``n < lam**2``, the probabilistic bound above. Storing the
    result in ``dtype`` adds one rounding, ``u``. Each evaluation is within
    ``(gamma + u) * scale`` of the exact value, so two evaluations differ by at most twice that;
    an evaluation against an exact (e.g. float64) reference is covered with a factor 2 to spare.

    Chains. Errors of successive stages add; under the probabilistic model their variances
    add, i.e. the lengths add under the square root. So a chain of reductions of lengths
    ``n_1, ..., n_k`` is counted as ``n = n_1 + ... + n_k``, with ``scale`` the largest magnitude
    along the chain. This assumes each stage does not amplify errors much (normalised layers,
    softmax, moderate logits): an estimate for networks, not a theorem; the factor ``lam``
    leaves room for moderate amplification. For values near zero by cancellation the error is
    still relative to the terms, which is why the tolerance is absolute at ``scale``.

    A comparison that should be bitwise (one code path against itself: determinism, resume)
    should not use this; use ``torch.equal`` or ``rtol=0, atol=0``.

    Raises ``ValueError`` when ``dtype`` or ``accumulate_dtype`` is not a floating dtype,
    ``n_terms < 1``, ``scale`` is negative or not finite, ``lam <= 0``, or when the bound is 1
    or more (``gamma >= 1``: rounding may be as large as the terms themselves, so no tolerance
    can tell a bug from rounding; accumulate in a wider dtype or compare fewer terms).
    """

    import torch  # deferred: torch

    for name, dt in (("dtype", dtype), ("accumulate_dtype", accumulate_dtype)):
        if dt is not None and not (isinstance(dt, torch.dtype) and dt.is_floating_point):
            raise ValueError(
                f"reduction_tolerance: {name} must be a floating torch.dtype (torch.float32, torch.bfloat16, ...), "
                f"got {dt!r}."
            )
    if isinstance(n_terms, bool) or not isinstance(n_terms, int) or n_terms < 1:
        raise ValueError(f"reduction_tolerance: n_terms must be an int >= 1 (the reduction length), got {n_terms!r}.")
    scale_value = float(scale)
    if not math.isfinite(scale_value) or scale_value < 0:
        raise ValueError(
            f"reduction_tolerance: scale must be a finite number >= 0 (the magnitude of the terms), got {scale!r}."
        )
    if not lam > 0:
        raise ValueError(f"reduction_tolerance: lam must be > 0, got {lam!r}.")
    u = torch.finfo(dtype).eps / 2
    u_acc = torch.finfo(accumulate_dtype if accumulate_dtype is not None else dtype).eps / 2
    n = n_terms
    worst = n * u_acc / (1 - n * u_acc) if n * u_acc < 1 else math.inf
    probabilistic = math.expm1(lam * math.sqrt(n) * u_acc + n * u_acc**2 / (1 - u_acc))
    gamma = min(worst, probabilistic)
    if gamma >= 1:
        raise ValueError(
            f"reduction_tolerance: a reduction of {n} terms accumulated in {accumulate_dtype or dtype} has a rounding "
            f"bound of {gamma:.3g} times the terms (>= 1): no tolerance tells a bug from rounding. Accumulate in a "
            "wider dtype (accumulate_dtype=torch.float32) or compare a smaller computation."
        )
    return 2.0 * (gamma + u) * scale_value


# ============================================================================ fixtures


@pytest.fixture
def rlplug_registry() -> Iterator[Registry]:
    """A clean registry (no entry points loaded), process-wide for the test, restored after."""

    registry = Registry(load_entry_points=False)
    previous = set_registry(registry)
    try:
        yield registry
    finally:
        set_registry(previous)


@pytest.fixture
def rlplug_full_registry() -> Iterator[Registry]:
    """A fresh registry with every installed ``rlplug`` entry point loaded, process-wide for the test."""

    registry = Registry()
    previous = set_registry(registry)
    try:
        yield registry
    finally:
        set_registry(previous)


@pytest.fixture(name="make_batch")
def make_batch_fixture() -> Callable[..., dict]:
    """The :func:`make_batch` factory: ``make_batch(batch_size=8, response_length=6, group_size=4, seed=0)``."""
    return make_batch


@pytest.fixture(name="assert_advantage_contract")
def assert_advantage_contract_fixture() -> Callable[..., tuple]:
    """The :func:`assert_advantage_contract` checker: ``(estimator, data, config=None) -> (adv, ret)``."""
    return assert_advantage_contract


@pytest.fixture(name="algorithm_config")
def algorithm_config_fixture() -> Callable[..., Any]:
    """The :func:`algorithm_config` factory: ``algorithm_config(gamma=0.99)`` -> ``DictConfig``."""
    return algorithm_config
