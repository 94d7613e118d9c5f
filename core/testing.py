"""pytest fixtures and checks for plugin authors (loaded automatically as a pytest plugin).

rlplug declares this module under the ``pytest11`` entry-point group, so once rlplug is installed
every pytest session gets these fixtures without a ``conftest.py``:

``rlplug_registry``
    A clean :class:`rlplug.registry.Registry` with no plugin loaded, installed as the process-wide
    registry for the duration of the test (``rlplug.get_plugin`` and ``rlplug.plugin_names`` see
    it) and restored afterwards. Add your plugin module with ``rlplug_registry.add_plugin(module)``.
``rlplug_full_registry``
    A fresh registry with every installed entry point loaded (what ``rlplug train`` sees), also
    installed process-wide for the test and restored afterwards.
``make_batch``
    :func:`make_batch`: small random ``(B, T)`` tensors with the names the trainer uses.
``assert_advantage_contract``
    :func:`assert_advantage_contract`: the checks every advantage estimator must pass.

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

    from .registry import Registry

from .conformance import (
    check_advantage_estimator,
    check_batch_filter,
    check_kl_penalty,
    check_policy_loss,
    check_protocol,
    check_reward_function,
    check_rollout_backend,
    check_tracker,
    check_training_backend,
)

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
]

#: Column names of :func:`make_batch`'s ``reward_components``.
REWARD_COMPONENT_NAMES = ("acc", "format")


# ============================================================================ batches


def make_batch(
    batch_size: int = 8,
    response_length: int = 6,
    *,
    group_size: int = 4,
    seed: int = 0,
    min_length: int = 1,
    full_length_rows: int = 1,
    scores: str = "binary",
    kl_scale: float = 0.05,
) -> dict[str, torch.Tensor]:
    """Small random tensors with the trainer's names, as a ``dict[str, Tensor]``.

    With ``B = batch_size`` and ``T = response_length``:

    =======================  =============  ==================================================
    key                      shape, dtype   content
    =======================  =============  ==================================================
    ``response_mask``        (B, T) float   1.0 on a prefix of each row (ragged lengths drawn
                                            uniformly in ``[min_length, T]``; the first
                                            ``full_length_rows`` rows have length ``T``)
    ``response_lengths``     (B,) int64     the number of 1.0 in each mask row
    ``index``                (B,) int64     ``i // group_size``: consecutive rows form groups
    ``token_level_scores``   (B, T) float   the row's score on its last valid token, 0 elsewhere
    ``token_level_rewards``  (B, T) float   equal to ``token_level_scores`` (no KL in reward)
    ``scores``               (B,) float     the per-row score (``binary``: 0/1; ``normal``: N(0,1))
    ``values``               (B, T) float   N(0, 1) critic values, 0 on padding
    ``old_log_probs``        (B, T) float   log-probs in nats, ``-Exp(1)``, 0 on padding
    ``log_probs``            (B, T) float   ``old_log_probs + kl_scale * N(0, 1)``, 0 on padding
    ``ref_log_probs``        (B, T) float   ``old_log_probs + kl_scale * N(0, 1)``, 0 on padding
    ``advantages``           (B, T) float   N(0, 1), 0 on padding
    ``returns``              (B, T) float   N(0, 1), 0 on padding
    ``reward_baselines``     (B,) float     a baseline score per row (same distribution as scores)
    ``entropy``              (B, T) float   token entropies in nats, ``Exp(1)``, 0 on padding
    ``sum_pi_squared``       (B, T) float   sum of squared token probabilities, in (0, 1], 0 on
                                            padding
    ``reward_components``    (B, 2) float   named reward parts (``REWARD_COMPONENT_NAMES``:
                                            ``acc`` = the score, ``format`` in {0, 1})
    =======================  =============  ==================================================

    All floats are ``float32`` on CPU. The same arguments give the same tensors (a private
    ``torch.Generator`` seeded with ``seed``; global RNG state is untouched).

    Raises ``ValueError`` for non-positive sizes, ``batch_size`` not a multiple of
    ``group_size``, ``min_length`` outside ``[1, T]`` or an unknown ``scores`` kind.
    """
    import torch

    B, T = int(batch_size), int(response_length)
    if B <= 0 or T <= 0:
        raise ValueError(f"make_batch: batch_size and response_length must be positive, got B={B}, T={T}.")
    if group_size <= 0 or B % group_size:
        raise ValueError(
            f"make_batch: batch_size={B} must be a positive multiple of group_size={group_size} "
            "(each prompt has group_size responses)."
        )
    if not 1 <= min_length <= T:
        raise ValueError(f"make_batch: min_length={min_length} must be in [1, response_length={T}].")
    if scores not in ("binary", "normal"):
        raise ValueError(f"make_batch: scores={scores!r}; use 'binary' (0/1) or 'normal' (N(0,1)).")

    g = torch.Generator().manual_seed(int(seed))
    lengths = torch.randint(min_length, T + 1, (B,), generator=g)
    lengths[: max(0, min(full_length_rows, B))] = T
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.float32)  # (B, T)

    def draw_scores() -> torch.Tensor:
        if scores == "binary":
            return torch.randint(0, 2, (B,), generator=g).to(torch.float32)
        return torch.randn(B, generator=g)

    row_scores = draw_scores()
    token_scores = torch.zeros(B, T)
    token_scores[torch.arange(B), lengths - 1] = row_scores

    def masked_normal() -> torch.Tensor:
        return torch.randn(B, T, generator=g) * mask

    old_log_probs = torch.where(mask > 0, -torch.empty(B, T).exponential_(1.0, generator=g), torch.zeros(()))
    return {
        "response_mask": mask,
        "response_lengths": lengths.to(torch.int64),
        "index": torch.arange(B, dtype=torch.int64) // group_size,
        "token_level_scores": token_scores,
        "token_level_rewards": token_scores.clone(),
        "scores": row_scores,
        "values": masked_normal(),
        "old_log_probs": old_log_probs,
        "log_probs": old_log_probs + kl_scale * masked_normal(),
        "ref_log_probs": old_log_probs + kl_scale * masked_normal(),
        "advantages": masked_normal(),
        "returns": masked_normal(),
        "reward_baselines": draw_scores(),
        # drawn after the fields above, so adding them left those values unchanged
        "entropy": torch.where(mask > 0, torch.empty(B, T).exponential_(1.0, generator=g), torch.zeros(())),
        "sum_pi_squared": torch.rand(B, T, generator=g).clamp(min=1e-3) * mask,
        "reward_components": torch.stack([row_scores, torch.randint(0, 2, (B,), generator=g).to(torch.float32)], dim=1),
    }


def algorithm_config(**overrides: Any) -> Any:
    """The ``algorithm`` config section with rlplug's defaults, as an OmegaConf ``DictConfig``.

    Keyword arguments override fields (``algorithm_config(gamma=0.99, lam=0.95)``); an unknown
    field raises ``omegaconf.errors.ConfigAttributeError`` / ``ConfigKeyError`` naming it.
    """
    from omegaconf import OmegaConf

    from .config import AlgorithmConfig

    cfg = OmegaConf.structured(AlgorithmConfig)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def assert_advantage_contract(
    estimator: Any,
    data: Mapping[str, torch.Tensor],
    config: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Call ``estimator(data, config)`` and check the advantage-estimator contract.

    ``estimator`` is an :class:`rlplug.types.AdvantageEstimator` (or its registered name, looked
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
    import torch

    if isinstance(estimator, str):
        from .registry import get_plugin

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


# ============================================================================ fixtures


@pytest.fixture
def rlplug_registry() -> Iterator[Registry]:
    """A clean registry (no entry points loaded), process-wide for the test, restored after."""
    from .registry import Registry, set_registry

    registry = Registry(load_entry_points=False)
    previous = set_registry(registry)
    try:
        yield registry
    finally:
        set_registry(previous)


@pytest.fixture
def rlplug_full_registry() -> Iterator[Registry]:
    """A fresh registry with every installed ``rlplug`` entry point loaded, process-wide for the test."""
    from .registry import Registry, set_registry

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
