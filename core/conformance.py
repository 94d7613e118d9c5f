"""Conformance kits: the checks every plugin of a kind must pass (re-exported by ``rlplug.testing``).

One function per kind, for rlplug's own plugins and third-party ones alike::

    from rlplug.testing import check_advantage_estimator, check_policy_loss

    def test_my_estimator():
        check_advantage_estimator(my_estimator)          # the object you register

Each kit first checks the object against its kind's Protocol (:mod:`rlplug.contracts.kinds`, the same
check the registry runs when the plugin is selected), then calls it on small seeded inputs
(:func:`make_batch`) and on degenerate ones: a single response token, all-equal
rewards, empty responses (rows whose ``response_mask`` is all 0). It asserts shapes and dtypes,
finiteness, exact zeros on padding, that inputs are not modified in place, and per kind:

* policy losses: padding values cannot change the loss or its gradient; splitting a mini-batch
  into micro-batches with the global ``normalizer`` gives the same loss and gradient (every
  ``loss_agg_mode``); ``rollout_is_weights`` of 1 change nothing and weights of 0 zero the loss;
* reward functions: a float or a dict with a finite ``"score"``; picklable (worker processes);
* rollout / training backends and trackers: the built class's methods, then a live instance when
  you pass one (or the arguments to build one);
* tools: the schema, a call with arguments built from it returns text (awaited for an ``async``
  tool), a call without a required argument raises; picklable. :class:`LookupTool` is a tool for
  tests (it returns a stored value verbatim);
* environments: built from a context whose tools run in this process (:func:`environment_context`), one
  episode of scripted assistant replies: ``reset`` returns messages, each ``step`` an ``EnvStep`` of
  observation messages, a finite reward or ``None`` and a ``done`` flag; ``close`` is called.

Every check raises ``AssertionError`` with a message saying what was wrong and what was expected.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import math
import pickle
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from rlplug.config.schema import ActorConfig, AlgorithmConfig, MultiTurnConfig, typed
from rlplug.contracts.agents import (
    EnvironmentContext,
    EnvStep,
    ToolArgumentError,
    ToolError,
    ToolResult,
    validate_arguments,
)
from rlplug.contracts.kinds import CONTRACTS, built_classes, check_object
from rlplug.contracts.registry import get_plugin, get_registry
from rlplug.contracts.types import Coordinator, MiniBatchContext, RolloutOutput, SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "REWARD_COMPONENT_NAMES",
    "make_batch",
    "algorithm_config",
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
    "InProcessTools",
    "DEFAULT_ENVIRONMENT_ROW",
]

LOSS_METRICS = ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl")


# ============================================================================ batches


#: Column names of :func:`make_batch`'s ``reward_components``.
REWARD_COMPONENT_NAMES = ("acc", "format")


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
    import torch  # deferred: torch

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

    cfg = OmegaConf.structured(AlgorithmConfig)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


# ============================================================================ protocol


def check_protocol(kind: str, obj: Any, *, builds: Any = None) -> None:
    """Assert that ``obj`` implements ``kind``'s Protocol (the registry's resolve-time check).

    For factory kinds (``rollout_backend``, ``training_backend``, ``tracker``) ``obj`` is the
    class, or a factory with ``builds`` (the class or classes it returns) given here or as an
    attribute, or an instance (checked as its class). Raises ``AssertionError`` listing every
    missing, misnamed or wrongly-called member.
    """
    if kind not in CONTRACTS:
        raise AssertionError(f"unknown plugin kind {kind!r}; kinds: {', '.join(CONTRACTS)}")
    contract = CONTRACTS[kind]
    problems: list[str] = []
    if contract.factory:
        if not inspect.isclass(obj) and not (builds or getattr(obj, "builds", None)) and not inspect.isfunction(obj):
            obj = type(obj)  # an instance: check its class
        classes = built_classes(obj, {"builds": builds} if builds is not None else None)
        assert classes, (
            f"{kind}: {obj!r} is a factory that does not declare the class it builds; pass "
            "builds=TheClass (and register it the same way: register(name, factory, builds=TheClass))"
        )
        for cls in classes:
            problems += check_object(kind, cls, is_class=True)
    else:
        problems += check_object(kind, obj)
    assert not problems, f"{kind} does not implement {contract.protocol.__qualname__}: " + "; ".join(problems)


def _resolve(kind: str, obj: Any) -> Any:
    if isinstance(obj, str):
        return get_plugin(kind, obj)
    return obj


def _clone(data: Mapping[str, Any]) -> dict[str, Any]:
    import torch  # deferred: torch

    return {k: (v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)) for k, v in data.items()}


def _assert_unmodified(before: Mapping[str, Any], after: Mapping[str, Any], what: str) -> None:
    import torch  # deferred: torch

    for key, old in before.items():
        if isinstance(old, torch.Tensor):
            assert torch.equal(after[key], old), f"{what} modified its input '{key}' in place"


def _degenerate_batches(make: Callable[..., dict], group_size: int) -> list[tuple[str, dict]]:
    """Name and data of the degenerate inputs every algorithm kit runs."""
    import torch  # deferred: torch

    B = 2 * group_size
    out = [
        ("a random batch", make(batch_size=B, response_length=6, group_size=group_size, seed=0)),
        ("a single response token", make(batch_size=B, response_length=1, group_size=group_size, seed=1)),
    ]
    equal = make(batch_size=B, response_length=5, group_size=group_size, seed=2)
    lengths = equal["response_mask"].sum(-1).long()
    equal["token_level_scores"] = torch.zeros_like(equal["token_level_scores"])
    equal["token_level_scores"][torch.arange(B), lengths - 1] = 1.0
    equal["token_level_rewards"] = equal["token_level_scores"].clone()
    equal["scores"] = torch.ones(B)
    equal["reward_baselines"] = torch.ones(B)
    out.append(("all-equal rewards", equal))
    empty = make(batch_size=B, response_length=5, group_size=group_size, seed=3)
    # the last response of every group is empty (an engine that stopped at once)
    rows = torch.arange(group_size - 1, B, group_size)
    for key in (
        "response_mask",
        "token_level_scores",
        "token_level_rewards",
        "values",
        "old_log_probs",
        "log_probs",
        "ref_log_probs",
        "advantages",
        "returns",
        "sum_pi_squared",
        "entropy",
    ):
        if key in empty:
            empty[key][rows] = 0.0
    empty["response_lengths"][rows] = 0
    out.append(("empty responses", empty))
    return out


def _check_pair(result: Any, mask: Any, what: str) -> None:
    import torch  # deferred: torch

    assert isinstance(result, tuple) and len(result) == 2, (
        f"{what} must return (advantages, returns), got {type(result).__name__}"
    )
    for name, t in zip(("advantages", "returns"), result):
        assert isinstance(t, torch.Tensor), f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}"
        assert t.shape == mask.shape, (
            f"{what}: {name} has shape {tuple(t.shape)}, expected (B, T) = {tuple(mask.shape)}"
        )
        assert t.dtype == torch.float32, f"{what}: {name} has dtype {t.dtype}, expected torch.float32"
        assert bool(torch.isfinite(t).all()), f"{what}: {name} has non-finite values: {t}"
        off = t[mask == 0]
        assert bool((off == 0).all()), (
            f"{what}: {name} must be exactly 0.0 where response_mask is 0; found "
            f"{int((off != 0).sum())} non-zero padded position(s)"
        )


# ============================================================================ algorithm kinds


def check_advantage_estimator(estimator: Any, config: Any = None, *, group_size: int = 4) -> None:
    """Run the advantage-estimator kit on ``estimator`` (the registered object, or its name).

    ``config``: the ``algorithm`` section (default :func:`algorithm_config`). The
    inputs hold every field of :func:`make_batch` (so any ``requires`` of the
    trainer's standard fields is met). Checks on a random batch, a single token, all-equal
    rewards and empty responses: the Protocol, the ``(advantages, returns)`` pair, ``(B, T)``
    float32, finite, 0.0 on padding, inputs unchanged; and that the same inputs give the same
    outputs (no hidden global RNG use).
    """

    estimator = _resolve("advantage_estimator", estimator)
    check_protocol("advantage_estimator", estimator)
    assert all(isinstance(r, str) for r in estimator.requires), (
        f"requires must be a tuple of field names, got {estimator.requires!r}"
    )
    config = algorithm_config() if config is None else config
    import torch  # deferred: torch

    for label, data in _degenerate_batches(make_batch, group_size):
        before = _clone(data)
        result = estimator(data, config)
        what = f"advantage estimator on {label}"
        _check_pair(result, data["response_mask"], what)
        _assert_unmodified(before, data, what)
        again = estimator(_clone(before), config)
        assert all(torch.equal(a, b) for a, b in zip(result, again)), f"{what}: the same inputs gave different outputs"


def _loss_call(
    loss: Any,
    data: Mapping[str, Any],
    mask: Any,
    *,
    mode: str,
    normalizer: Any,
    config: Any,
    weights: Any = None,
    stats: Mapping[str, Any] | None = None,
) -> tuple[Any, dict]:
    extra = {k: data[k] for k in getattr(loss, "requires", ())}
    extra.update(stats or {})
    return loss(
        data["old_log_probs"],
        data["log_probs"],
        data["advantages"],
        mask,
        config=config,
        loss_agg_mode=mode,
        normalizer=normalizer,
        max_response_length=int(mask.shape[1]),
        rollout_is_weights=weights,
        **extra,
    )


def _policy_loss_stats(loss: Any, data: Mapping[str, Any], config: Any, what: str, step: int = 0) -> dict:
    """The loss's ``minibatch_stats`` on the whole of ``data`` (``{}`` for a loss without them),
    checked: a mapping of detached ``(B, T)`` finite tensors, the same for the same context, none
    named like an input the objective passes."""
    import torch  # deferred: torch

    from rlplug.algorithms.objective import _RESERVED  # deferred: torch

    stats_fn = getattr(loss, "minibatch_stats", None)
    if stats_fn is None:
        return {}
    assert callable(stats_fn), f"{what}: minibatch_stats must be a callable or None, got {type(stats_fn).__name__}"
    mask = data["response_mask"]

    def call() -> Any:
        return stats_fn(
            data["old_log_probs"].detach(),
            data["log_probs"].detach(),
            data["advantages"].detach(),
            mask,
            config=config,
            context=MiniBatchContext(seed=1, optimizer_step=step),
        )

    stats = call()
    assert isinstance(stats, Mapping), f"{what}: minibatch_stats must return a dict, got {type(stats).__name__}"
    clash = sorted(set(stats) & (_RESERVED | set(getattr(loss, "requires", ()) or ())))
    assert not clash, f"{what}: minibatch_stats returned {clash}, names the objective passes itself; rename them"
    again = call()
    for key, value in stats.items():
        assert isinstance(value, torch.Tensor) and value.shape == mask.shape, (
            f"{what}: minibatch_stats[{key!r}] must be a (B, T) = {tuple(mask.shape)} tensor, got "
            f"{getattr(value, 'shape', type(value).__name__)}"
        )
        assert not value.requires_grad, f"{what}: minibatch_stats[{key!r}] must be detached"
        assert bool(torch.isfinite(value).all()), f"{what}: minibatch_stats[{key!r}] is not finite"
        assert torch.equal(value, again[key]), (
            f"{what}: minibatch_stats[{key!r}] differs between two calls with the same context; seed its "
            "randomness from the MiniBatchContext, not the global RNG"
        )
    return dict(stats)


def check_policy_loss(loss: Any, config: Any = None, *, modes: Iterable[str] | None = None, atol: float = 1e-5) -> None:
    """Run the policy-loss kit on ``loss`` (the registered object, or its name).

    ``config``: the ``actor`` section (default: rlplug's ``ActorConfig`` defaults). For every
    ``loss_agg_mode`` in ``modes`` (default: all of :data:`rlplug.algorithms.losses.LOSS_AGG_MODES`) and the
    degenerate inputs: a finite scalar loss with a finite gradient, ``metrics`` a ``dict`` of floats
    with at least ``pg_clipfrac``, ``pg_clipfrac_lower`` and ``ppo_kl``; values on padded positions
    change neither the loss nor the gradient; two micro-batches with the whole mini-batch's
    ``normalizer`` sum to the whole-batch loss and gradient; ``rollout_is_weights`` of 1.0 equal
    ``None`` and weights of 0.0 give a zero loss and gradient; inputs unchanged. A loss with
    ``minibatch_stats`` gets them computed on the whole batch (checked: ``(B, T)`` detached finite
    tensors, deterministic for a context, not named like the objective's inputs) and passed as
    keyword arguments, sliced by rows for the two micro-batches, as the update loop does, so the
    micro-batch check covers its whole-mini-batch statistics.
    """
    import torch  # deferred: torch

    from rlplug.algorithms.losses import LOSS_AGG_MODES, agg_normalizer  # deferred: torch

    loss = _resolve("policy_loss", loss)
    check_protocol("policy_loss", loss)
    config = OmegaConf.structured(ActorConfig) if config is None else config
    if getattr(loss, "validate", None) is not None:
        loss.validate(config)
    for label, data in _degenerate_batches(make_batch, group_size=2):
        mask = data["response_mask"]
        B = mask.shape[0]
        for mode in modes or LOSS_AGG_MODES:
            what = f"policy loss ({mode}) on {label}"
            norm = agg_normalizer(mask, mode)
            if norm <= 0:
                continue
            before = _clone(data)
            lp = data["log_probs"].clone().requires_grad_(True)
            run = dict(data, log_probs=lp)
            stats = _policy_loss_stats(loss, data, config, what)
            value, metrics = _loss_call(loss, run, mask, mode=mode, normalizer=norm, config=config, stats=stats)
            assert isinstance(value, torch.Tensor) and value.dim() == 0, f"{what}: the loss must be a scalar tensor"
            assert bool(torch.isfinite(value)), f"{what}: loss {value} is not finite"
            assert isinstance(metrics, dict), f"{what}: metrics must be a dict, got {type(metrics).__name__}"
            for key in LOSS_METRICS:
                assert key in metrics, f"{what}: metrics lack '{key}' (have {sorted(metrics)})"
            for key, v in metrics.items():
                assert isinstance(v, float) and math.isfinite(v), f"{what}: metric {key}={v!r} is not a finite float"
            (grad,) = torch.autograd.grad(value, lp, allow_unused=True)
            grad = torch.zeros_like(lp) if grad is None else grad
            assert bool(torch.isfinite(grad).all()), f"{what}: non-finite gradient"
            assert bool((grad[mask == 0] == 0).all()), f"{what}: the gradient is non-zero on padded positions"
            _assert_unmodified(before, data, what)
            # padding garbage changes nothing
            noisy = _clone(data)
            pad = mask == 0
            for key in ("old_log_probs", "log_probs", "advantages"):
                noisy[key] = torch.where(pad, torch.full_like(noisy[key], 7.0), noisy[key])
            lp2 = noisy["log_probs"].clone().requires_grad_(True)
            noisy_stats = _policy_loss_stats(loss, noisy, config, what)
            v2, _ = _loss_call(
                loss, dict(noisy, log_probs=lp2), mask, mode=mode, normalizer=norm, config=config, stats=noisy_stats
            )
            (g2,) = torch.autograd.grad(v2, lp2, allow_unused=True)
            g2 = torch.zeros_like(lp2) if g2 is None else g2
            assert torch.allclose(v2.detach(), value.detach(), atol=atol), (
                f"{what}: values on padded positions changed the loss ({value.item()} -> {v2.item()})"
            )
            assert torch.allclose(g2, grad, atol=atol), f"{what}: values on padded positions changed the gradient"
            # micro-batch invariance with the global normaliser
            total = torch.zeros(())
            grads = torch.zeros_like(lp)
            for rows in (torch.arange(0, B // 2), torch.arange(B // 2, B)):
                sub = {k: v[rows] for k, v in data.items() if isinstance(v, torch.Tensor) and v.shape[:1] == (B,)}
                lp3 = sub["log_probs"].clone().requires_grad_(True)
                part, _ = _loss_call(
                    loss,
                    dict(sub, log_probs=lp3),
                    sub["response_mask"],
                    mode=mode,
                    normalizer=norm,
                    config=config,
                    stats={k: v[rows] for k, v in stats.items()},
                )
                (g3,) = torch.autograd.grad(part, lp3, allow_unused=True)
                total = total + part.detach()
                if g3 is not None:
                    grads[rows] += g3
            assert torch.allclose(total, value.detach(), atol=atol), (
                f"{what}: two micro-batches with the mini-batch's normalizer give {total.item()}, the whole batch "
                f"{value.item()}; aggregate with rlplug.algorithms.losses.agg_loss(..., normalizer)"
            )
            assert torch.allclose(grads, grad, atol=atol), f"{what}: micro-batching changed the gradient"
            # rollout importance weights: 1 changes nothing, 0 removes every token
            ones, _ = _loss_call(
                loss, data, mask, mode=mode, normalizer=norm, config=config, weights=torch.ones_like(mask), stats=stats
            )
            assert torch.allclose(ones.detach(), value.detach(), atol=atol), (
                f"{what}: rollout_is_weights of 1.0 changed the loss ({value.item()} -> {ones.item()})"
            )
            lp4 = data["log_probs"].clone().requires_grad_(True)
            zero, _ = _loss_call(
                loss,
                dict(data, log_probs=lp4),
                mask,
                mode=mode,
                normalizer=norm,
                config=config,
                weights=torch.zeros_like(mask),
                stats=stats,
            )
            assert abs(float(zero.detach())) <= atol, (
                f"{what}: rollout_is_weights of 0.0 left a loss of {float(zero.detach())}; apply them"
            )
            (g4,) = torch.autograd.grad(zero, lp4, allow_unused=True)
            assert g4 is None or float(g4.abs().max()) <= atol, f"{what}: rollout_is_weights of 0.0 left a gradient"


def check_kl_penalty(penalty: Any) -> None:
    """Run the KL-estimator kit on ``penalty`` (the registered object, or its name).

    Checks: the Protocol; ``penalty(log_probs, ref_log_probs)`` is ``(B, T) float32`` and finite,
    also for far-apart log-probs (|d| = 30 nats) and a single token; exactly 0 where the two
    log-probs are equal; the gradient is finite; inputs unchanged.
    """
    import torch  # deferred: torch

    penalty = _resolve("kl_penalty", penalty)
    check_protocol("kl_penalty", penalty)
    g = torch.Generator().manual_seed(0)
    cases = {
        "random log-probs": (-torch.rand(4, 6, generator=g) * 3, -torch.rand(4, 6, generator=g) * 3),
        "far-apart log-probs": (torch.tensor([[-30.0, 0.0, -0.1]]), torch.tensor([[0.0, -30.0, -0.1]])),
        "a single token": (torch.tensor([[-1.0]]), torch.tensor([[-2.0]])),
    }
    for label, (lp, ref) in cases.items():
        what = f"KL penalty on {label}"
        lp_g = lp.clone().requires_grad_(True)
        out = penalty(lp_g, ref.clone())
        assert isinstance(out, torch.Tensor) and out.shape == lp.shape, (
            f"{what}: expected a (B, T) = {tuple(lp.shape)} tensor, got {getattr(out, 'shape', type(out))}"
        )
        assert out.dtype == torch.float32, f"{what}: dtype {out.dtype}, expected torch.float32"
        assert bool(torch.isfinite(out).all()), f"{what}: non-finite values {out}"
        (grad,) = torch.autograd.grad(out.sum(), lp_g, allow_unused=True)
        assert grad is None or bool(torch.isfinite(grad).all()), f"{what}: non-finite gradient"
        same = penalty(lp.clone(), lp.clone())
        assert bool((same.abs() <= 1e-7).all()), f"{what}: KL of a policy with itself must be 0, got {same}"


def check_batch_filter(batch_filter: Any, config: Any = None, *, group_size: int = 4) -> None:
    """Run the batch-filter kit on ``batch_filter`` (the registered object, or its name).

    ``config``: the ``algorithm`` section (default :func:`algorithm_config` with
    ``filter_groups.metric=score``). The inputs are :func:`make_batch` batches with
    the fields a filter receives (``index``, ``response_mask``, ``token_level_scores``,
    ``token_level_rewards``, ``reward_components`` with the columns ``acc``, ``format``,
    ``reward_failed``), on a random batch, a single token, all-equal rewards and empty responses.
    Checks the Protocol, that the result is a ``(B,) bool`` tensor, inputs unchanged, and that the
    same inputs give the same result (no hidden global RNG use).
    """
    import torch  # deferred: torch

    from rlplug.contracts.batch import Fields  # deferred: torch

    batch_filter = _resolve("batch_filter", batch_filter)
    check_protocol("batch_filter", batch_filter)
    if config is None:
        config = algorithm_config()
        config.filter_groups.metric = "score"
    names = (*REWARD_COMPONENT_NAMES, "reward_failed")
    keys = ("index", "response_mask", "token_level_scores", "token_level_rewards", "reward_components")
    for label, raw in _degenerate_batches(make_batch, group_size):
        B = raw["response_mask"].shape[0]
        comps = torch.cat([raw["reward_components"], torch.zeros(B, 1)], dim=1)
        tensors = {k: raw[k] for k in keys[:-1]}

        def fields(rows: torch.Tensor, tensors: dict = tensors, comps: torch.Tensor = comps) -> Fields:
            t = {k: v[rows].clone() for k, v in tensors.items()}
            return Fields({**t, "reward_components": comps[rows].clone()}, {"reward_components": names})

        what = f"batch filter on {label}"
        data = fields(torch.arange(B))
        before = _clone(data)
        keep = batch_filter(data, config)
        assert isinstance(keep, torch.Tensor) and keep.dtype == torch.bool and tuple(keep.shape) == (B,), (
            f"{what} must return a (B,) = ({B},) bool tensor, got "
            + (f"{keep.dtype} {tuple(keep.shape)}" if isinstance(keep, torch.Tensor) else type(keep).__name__)
        )
        _assert_unmodified(before, data, what)
        assert torch.equal(batch_filter(fields(torch.arange(B)), config), keep), (
            f"{what}: the same inputs gave different outputs"
        )
        for g in data["index"].unique().tolist():
            group = keep[data["index"] == g]
            assert bool(group.all()) or not bool(group.any()), (
                f"{what}: keeps only part of group {g} ({group.tolist()}); keep or drop whole groups"
            )


def check_reward_function(
    fn: Any,
    cases: Iterable[tuple[str, str, str, Any]] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    *,
    picklable: bool = True,
) -> None:
    """Run the reward-function kit on ``fn`` (the registered function, or its name).

    ``cases``: ``(data_source, solution_str, ground_truth, extra_info)`` tuples (default: a right,
    a wrong, an empty and an unusual-unicode answer for ground truth ``"7"``); ``kwargs`` the
    function's ``reward.kwargs.<name>``. Checks: the Protocol (verl's call signature); every result
    is a float (or int) or a dict with a finite float ``"score"`` and float-convertible extras;
    the same call gives the same result; with ``picklable`` (needed by ``reward.num_workers > 0``)
    ``pickle`` round-trips it. A function with the optional ``prepare(kwargs)`` method (start-up
    work the reward manager runs once, outside ``reward.timeout_s``: see
    :class:`rlplug.contracts.types.RewardFunction`) has it called with ``kwargs`` twice before the cases (it
    must accept one mapping, return None and be idempotent).
    """
    fn = _resolve("reward_function", fn)
    check_protocol("reward_function", fn)
    prepare = getattr(fn, "prepare", None)
    if prepare is not None:
        assert callable(prepare), f"the reward function's 'prepare' must be a method, got {type(prepare).__name__}"
        for _ in range(2):  # idempotent: the manager calls it again after a close
            assert prepare(dict(kwargs or {})) is None, "prepare(kwargs) must return None"
    cases = list(
        cases
        or [
            ("openai/gsm8k", "3 + 4 = 7\n#### 7", "7", None),
            ("openai/gsm8k", "#### 8", "7", {}),
            ("openai/gsm8k", "", "7", None),
            ("openai/gsm8k", "\u2212\u00bd \U0001f600 ####", "7", None),
        ]
    )
    kwargs = dict(kwargs or {})
    for case in cases:
        what = f"reward function on {case[:3]!r}"
        out = fn(*case, **kwargs)
        if isinstance(out, dict):
            assert "score" in out, f"{what}: a dict result needs a 'score' key, got {sorted(out)}"
            score = out["score"]
            for key, value in out.items():
                if key != "score":
                    try:
                        float(value)
                    except (TypeError, ValueError):
                        raise AssertionError(f"{what}: extra value {key}={value!r} is not a number") from None
        else:
            score = out
        assert isinstance(score, (int, float)) and not isinstance(score, bool), (
            f"{what}: the score must be a float, got {type(score).__name__}"
        )
        assert math.isfinite(float(score)), f"{what}: score {score} is not finite"
        assert fn(*case, **kwargs) == out, f"{what}: the same call gave a different result"
    if picklable:
        try:
            pickle.loads(pickle.dumps(fn))
        except Exception as exc:
            raise AssertionError(
                f"the reward function cannot be pickled ({type(exc).__name__}: {exc}); reward.num_workers > 0 runs it "
                "in worker processes: define it at module level"
            ) from exc


# ============================================================================ factory kinds


def check_rollout_backend(
    backend: Any,
    *,
    builds: Any = None,
    prompts: list[list[int]] | None = None,
    max_tokens: int = 4,
    n: int = 2,
    vocab_size: int | None = None,
    tokenizer: Any = None,
) -> None:
    """Run the rollout-backend kit.

    ``backend``: the class (or factory with ``builds``) -- only the Protocol is checked -- or a
    live instance, which is also exercised and then closed: ``generate`` on ``prompts`` (default
    two short prompts of token ids below ``vocab_size`` or 100) with ``n`` samples returns a
    :class:`rlplug.contracts.types.RolloutOutput` with ``len(prompts) * n`` prompt-major responses, each at
    most ``max_tokens`` long (exactly that long when the reason is ``"length"``), finish reasons
    ``"stop"``/``"length"``, and engine log-probs aligned with the tokens when requested; greedy
    generation is deterministic; ``sleep``/``wake_up`` work around it; ``close`` is idempotent.

    Stop strings (``SamplingParams.stop``): a string is cut from the middle of the first greedy
    response's decoded text (``tokenizer``, default the backend's ``tokenizer`` attribute; decoded
    with special tokens kept), spanning two tokens where it can; generating again with it as the
    stop string must give the first response's ids up to and including the first token at which
    the decoded prefix contains it, finish reason ``"stop"``. Skipped with a ``UserWarning``
    giving the reason when there is no tokenizer or the greedy response is shorter than 3 tokens.
    Raises ``AssertionError`` naming the first violated property.
    """

    if inspect.isclass(backend) or inspect.isfunction(backend):
        check_protocol("rollout_backend", backend, builds=builds)
        return
    check_protocol("rollout_backend", type(backend))
    top = vocab_size or 100
    prompts = prompts or [[1, min(5, top - 1), min(7, top - 1)], [1, min(3, top - 1)]]
    try:
        backend.wake_up()
        params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, seed=0, logprobs=True)
        out = backend.generate(prompts, params)
        assert isinstance(out, RolloutOutput), f"generate() must return a RolloutOutput, got {type(out).__name__}"
        B = len(prompts) * n
        assert len(out.response_ids) == B, f"generate() returned {len(out.response_ids)} responses, expected {B}"
        assert out.prompt_index == [i for i in range(len(prompts)) for _ in range(n)], (
            f"responses must be prompt-major (the n samples of prompt 0 first); prompt_index={out.prompt_index}"
        )
        for j, (ids, reason) in enumerate(zip(out.response_ids, out.finish_reasons)):
            assert reason in ("stop", "length"), f"response {j}: finish reason {reason!r}, expected 'stop' or 'length'"
            assert len(ids) <= max_tokens, f"response {j} has {len(ids)} tokens, more than max_tokens={max_tokens}"
            if reason == "length":
                assert len(ids) == max_tokens, f"response {j} stopped for 'length' at {len(ids)} of {max_tokens} tokens"
            assert all(isinstance(t, int) for t in ids), f"response {j}: token ids must be ints"
        if out.log_probs is not None:
            for j, (ids, lps) in enumerate(zip(out.response_ids, out.log_probs)):
                assert len(lps) == len(ids), f"response {j}: {len(lps)} log-probs for {len(ids)} tokens"
                assert all(math.isfinite(x) and x <= 1e-6 for x in lps), (
                    f"response {j}: log-probs must be finite and <= 0"
                )
        greedy = SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens)
        first, second = backend.generate(prompts, greedy), backend.generate(prompts, greedy)
        assert first.response_ids == second.response_ids, "greedy generation gave different tokens on the same prompts"
        _check_stop_strings(backend, prompts, first.response_ids[0], max_tokens, tokenizer)
        backend.sleep()
        backend.wake_up()
    finally:
        backend.close()
    backend.close()  # idempotent


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))


def _stop_string_for(tokenizer: Any, ids: list[int]) -> str | None:
    """A stop string from the middle of ``decode(ids)``: the last character before token ``m =
    len(ids) // 2`` and token ``m``'s text less its last character (two tokens, ending inside the
    second) where those exist; None when no clean string can be cut."""
    m = len(ids) // 2
    prev, cur = _decode(tokenizer, ids[:m]), _decode(tokenizer, ids[: m + 1])
    if not cur.startswith(prev) or len(cur) == len(prev):
        return None
    new = cur[len(prev) :]
    stop = prev[-1:] + (new[:-1] if len(new) > 1 else new)
    return stop if stop.strip() and "\ufffd" not in stop else None


def _check_stop_strings(
    backend: Any, prompts: list[list[int]], ids: list[int], max_tokens: int, tokenizer: Any
) -> None:
    import warnings

    tokenizer = tokenizer if tokenizer is not None else getattr(backend, "tokenizer", None)
    if tokenizer is None:
        warnings.warn("check_rollout_backend: stop-string check skipped: no tokenizer", UserWarning, stacklevel=3)
        return
    if len(ids) < 3:
        warnings.warn(
            f"check_rollout_backend: stop-string check skipped: the greedy response has {len(ids)} tokens (< 3)",
            UserWarning,
            stacklevel=3,
        )
        return
    stop = _stop_string_for(tokenizer, ids)
    if stop is None:
        warnings.warn(
            "check_rollout_backend: stop-string check skipped: no clean string in the greedy response's text",
            UserWarning,
            stacklevel=3,
        )
        return
    k = next(k for k in range(1, len(ids) + 1) if stop in _decode(tokenizer, ids[:k]))
    out = backend.generate(prompts[:1], SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens, stop=(stop,)))
    got, reason = out.response_ids[0], out.finish_reasons[0]
    assert got == ids[:k], (
        f"stop={stop!r}: the response must be the sampled ids up to and including the token completing the string "
        f"(the first {k} of {ids}), got {got}"
    )
    assert reason == "stop", f"stop={stop!r}: finish reason {reason!r}, expected 'stop'"


def check_training_backend(backend: Any, *, builds: Any = None, batch: Any = None, update: bool = True) -> None:
    """Run the training-backend kit.

    ``backend``: the class (or factory with ``builds``) -- only the Protocol is checked -- or a
    live instance, exercised with ``batch`` (a :class:`rlplug.contracts.batch.Batch` with the sequence
    tensors, ``responses`` and ``response_mask``; required for an instance): ``compute_log_probs``
    gives ``(B, T) float32`` log-probs <= 0, 0.0 after each response's end, plus ``entropy`` and
    every name in ``per_token_outputs`` when asked; ``compute_values`` (with a critic) ``(B, T)``;
    the coordinator conforms; ``capabilities`` are known; with ``update``, ``update_actor`` on the
    batch (given ``advantages``) returns finite ``actor/*`` float metrics and changes the
    log-probs; ``consecutive_bad_steps`` is an int.
    """

    import torch  # deferred: torch

    if inspect.isclass(backend) or inspect.isfunction(backend):
        check_protocol("training_backend", backend, builds=builds)
        return
    check_protocol("training_backend", type(backend))
    assert batch is not None, "check_training_backend on an instance needs batch=Batch(...)"
    assert isinstance(backend.coordinator, Coordinator), (
        "backend.coordinator does not implement rlplug.contracts.types.Coordinator"
    )
    assert isinstance(backend.consecutive_bad_steps, int), "consecutive_bad_steps must be an int"
    mask = batch["response_mask"]
    extras = tuple(sorted(set(backend.per_token_outputs) - {"entropy"}))
    res = backend.compute_log_probs(batch, which="actor", with_entropy=True, extras=extras)
    for key in ("log_probs", "entropy", *extras):
        assert key in res, f"compute_log_probs did not return '{key}' (returned {sorted(res)})"
        t = res[key]
        assert t.shape == mask.shape and t.dtype == torch.float32, (
            f"compute_log_probs['{key}'] has {tuple(t.shape)} {t.dtype}; expected (B, T) = {tuple(mask.shape)} float32"
        )
        assert bool(torch.isfinite(t).all()), f"compute_log_probs['{key}'] is not finite"
        assert bool((t[mask == 0] == 0).all()), f"compute_log_probs['{key}'] must be 0.0 after each response's end"
    assert bool((res["log_probs"] <= 1e-6).all()), "log-probs must be <= 0 (nats)"
    if update:
        from rlplug.contracts.batch import Batch  # deferred: torch

        train = Batch(dict(batch.tensors), dict(batch.meta))
        train["old_log_probs"] = res["log_probs"]
        if "advantages" not in train.tensors:
            g = torch.Generator().manual_seed(0)
            train["advantages"] = torch.randn(mask.shape, generator=g) * mask
        metrics = backend.update_actor(train)
        assert isinstance(metrics, dict) and metrics, "update_actor must return a non-empty dict of metrics"
        for key, value in metrics.items():
            assert key.startswith("actor/"), f"update_actor metric '{key}' is not named actor/<metric>"
            assert isinstance(value, float), f"update_actor metric {key}={value!r} is not a float"
        after = backend.compute_log_probs(batch, which="actor")["log_probs"]
        assert not torch.equal(after, res["log_probs"]), "update_actor did not change the actor's log-probs"


def check_tracker(tracker: Any, *, builds: Any = None, artifact: Any = None) -> None:
    """Run the tracker kit.

    ``tracker``: the class (or factory with ``builds``) -- only the Protocol is checked -- or a
    live instance, which is then driven through a short run and closed twice: ``log_params`` with
    nested and long values, ``log_metrics`` with NaN/inf and odd names, ``log_table``,
    ``log_artifact`` (of ``artifact``, a file path, when given) and ``close`` must not raise.
    """

    if inspect.isclass(tracker) or inspect.isfunction(tracker):
        check_protocol("tracker", tracker, builds=builds)
        return
    check_protocol("tracker", type(tracker))
    tracker.log_params({"algorithm.adv_estimator": "grpo", "data.train_files": ["a.parquet"], "long": "x" * 10_000})
    tracker.log_metrics(
        {
            "actor/pg_loss": 0.5,
            "critic/score/mean": float("nan"),
            "perf/throughput": float("inf"),
            "val-core/openai/gsm8k/acc/mean@1": 0.25,
        },
        step=1,
    )
    tracker.log_metrics({"actor/pg_loss": 0.25}, step=2)
    tracker.log_table("val_generations/step_000002.json", [{"prompt": "1+1?", "response": "2", "score": 1.0}], step=2)
    if artifact is not None:
        tracker.log_artifact(artifact)
    tracker.close(status="FINISHED")
    tracker.close(status="FINISHED")


# ============================================================================ tools

#: a value of each JSON type, for the arguments :func:`check_tool` builds from a schema
_SAMPLE_VALUES: dict[str, Any] = {
    "string": "1",
    "integer": 1,
    "number": 1.0,
    "boolean": True,
    "array": [],
    "object": {},
    "null": None,
}


class LookupTool:
    """A tool for tests (kind ``tool``): ``lookup(key)`` returns the value stored under ``key`` verbatim (as text).

    ``table``: key -> value (values are returned through ``str()``); ``name`` and ``description`` as the
    model sees them. An unknown key raises :class:`rlplug.contracts.agents.ToolError` (``no entry for 'k'``);
    a call without ``key``, with another argument or a non-string key raises
    :class:`rlplug.contracts.agents.ToolArgumentError`. Given the answers to a task it is the tool of the
    leak test: a trainer that learns from tool tokens learns to copy them.
    """

    def __init__(self, table: Mapping[str, Any], *, name: str = "lookup", description: str | None = None) -> None:
        self.table = dict(table)
        self.name = name
        self.description = description or "Look up the value stored under a key; returns the value verbatim."
        self.parameters: dict[str, Any] = {
            "type": "object",
            "properties": {"key": {"type": "string", "description": "The key to look up."}},
            "required": ["key"],
        }

    def __call__(self, **arguments: Any) -> str:
        key = validate_arguments(self.name, self.parameters, arguments)["key"]
        if key not in self.table:
            raise ToolError(f"{self.name}: no entry for {key!r}")
        return str(self.table[key])


def _call_tool(tool: Any, arguments: Mapping[str, Any]) -> Any:
    """``tool(**arguments)``, awaited (in a new event loop) when it returns an awaitable."""
    result = tool(**arguments)
    if inspect.isawaitable(result):

        async def wait() -> Any:
            return await result

        return asyncio.run(wait())
    return result


def check_tool(tool: Any, arguments: Mapping[str, Any] | None = None, *, picklable: bool = True) -> None:
    """Run the tool kit on ``tool`` (the registered object, or its name).

    Checks: the Protocol and the schema, as the registry does (``name``, a non-empty ``description``,
    ``parameters`` a JSON schema object: ``type: object``, a ``properties`` dict, ``required`` among them, and
    ``__call__`` accepting those keywords); a call with ``arguments`` -- by default one value per required
    parameter, by type (``"1"``, ``1``, ``1.0``, ``true``, ``[]``) -- returns a ``str``, awaiting an ``async``
    tool; for each required parameter, a call without it raises an exception with a message (what the model
    would read); with ``picklable`` (tools run in worker processes) ``pickle`` round-trips it. Pass
    ``arguments`` for a tool that refuses the default ones (e.g. a key the tool knows).
    """
    tool = _resolve("tool", tool)
    check_protocol("tool", tool)
    parameters = tool.parameters
    properties = parameters["properties"]
    required = list(parameters.get("required", ()))
    if arguments is None:
        arguments = {}
        for name in required:
            types = properties[name].get("type", "string")
            first = types if isinstance(types, str) else next(iter(types), "string")
            arguments[name] = copy.deepcopy(_SAMPLE_VALUES.get(first, "1"))
    what = f"tool {tool.name!r}"
    try:
        out = _call_tool(tool, dict(arguments))
    except Exception as exc:
        raise AssertionError(
            f"{what}: the call with {dict(arguments)!r} raised {type(exc).__name__}: {exc}; a tool must accept "
            "arguments that match its schema (pass check_tool(tool, arguments={...}) with ones it accepts)"
        ) from exc
    assert isinstance(out, str), f"{what} must return the result as text (str), got {type(out).__name__}: {out!r}"
    for name in required:
        partial = {k: v for k, v in arguments.items() if k != name}
        try:
            bad = _call_tool(tool, partial)
        except Exception as exc:
            assert str(exc).strip(), (
                f"{what}: a call without the required argument {name!r} raised {type(exc).__name__} with no "
                "message; the model reads it, so say what is missing"
            )
            continue
        raise AssertionError(
            f"{what}: a call without the required argument {name!r} returned {bad!r}; it must raise "
            "(rlplug.plugin.ToolArgumentError, e.g. through rlplug.contracts.agents.validate_arguments)"
        )
    if picklable:
        try:
            copied = pickle.loads(pickle.dumps(tool))
        except Exception as exc:
            raise AssertionError(
                f"{what} cannot be pickled ({type(exc).__name__}: {exc}); tools run in worker processes: define "
                "the function (and any class) at module level"
            ) from exc
        assert copied.parameters == parameters, f"{what}: its parameters changed when pickled"


# ============================================================================ environments

#: the row :func:`check_environment` resets an environment with by default (verl's row schema)
DEFAULT_ENVIRONMENT_ROW: dict[str, Any] = {
    "prompt": [{"role": "user", "content": "What is 12*7? Answer with the number."}],
    "data_source": "check_environment",
    "reward_model": {"style": "rule", "ground_truth": "84"},
    "extra_info": {"index": 0},
}

_MESSAGE_ROLES = ("system", "user", "assistant", "tool")
_OBSERVATION_ROLES = ("tool", "user", "system")


class InProcessTools:
    """``call_tool(name, arguments)`` of an :class:`rlplug.contracts.agents.EnvironmentContext` that runs the tools
    in this process (for kits and tests; a run's calls go to the engine's tool worker processes instead).

    ``tools``: name -> tool (:class:`rlplug.contracts.agents.ToolProtocol`). ``settings``: the
    ``rollout.multi_turn`` section (:class:`rlplug.config.schema.MultiTurnConfig`, or ``None`` for its
    defaults): ``max_tool_response_length`` characters cut a reply, ``tool_timeout_s`` bounds an ``async``
    tool (a plain tool runs to completion in the event loop's thread: this class cannot stop it).

    Awaiting a call returns a :class:`rlplug.contracts.agents.ToolResult` and never raises: an unknown name is
    ``unknown_tool``; arguments that do not match the tool's schema
    (:func:`rlplug.contracts.agents.validate_arguments`) or a tool raising ``ToolArgumentError`` are
    ``bad_arguments``; a tool raising ``ToolError`` is ``error`` with its message as the text, any other
    exception ``error`` with ``"<name>: <ExceptionType>: <message>"``; an ``async`` tool past
    ``tool_timeout_s`` seconds is ``timeout``. ``calls`` records every ``(name, arguments, result)``.
    """

    def __init__(self, tools: Mapping[str, Any], settings: Any = None) -> None:
        self.tools = dict(tools)
        self.settings = typed(MultiTurnConfig, settings)
        self.calls: list[tuple[str, dict[str, Any], ToolResult]] = []

    async def __call__(self, name: str, arguments: Mapping[str, Any]) -> ToolResult:
        start = time.monotonic()
        text, status = await self._run(name, arguments)
        limit = self.settings.max_tool_response_length
        truncated = limit > 0 and len(text) > limit
        result = ToolResult(text[:limit] if truncated else text, status, time.monotonic() - start, truncated)
        self.calls.append((name, dict(arguments) if isinstance(arguments, Mapping) else {}, result))
        return result

    async def _run(self, name: str, arguments: Mapping[str, Any]) -> tuple[str, str]:
        tool = self.tools.get(name)
        if tool is None:
            listing = ", ".join(sorted(self.tools)) or "none"
            return f"unknown tool {name!r}; the tools are: {listing}", "unknown_tool"
        timeout = self.settings.tool_timeout_s
        try:
            checked = validate_arguments(name, tool.parameters, arguments)
            out = tool(**checked)
            if inspect.isawaitable(out):
                out = await asyncio.wait_for(_awaited(out), timeout=timeout if timeout > 0 else None)
        except ToolArgumentError as exc:
            return str(exc), "bad_arguments"
        except ToolError as exc:
            return str(exc), "error"
        except TimeoutError:
            return f"{name}: the call took longer than {timeout:g} s and was stopped", "timeout"
        except Exception as exc:
            return f"{name}: {type(exc).__name__}: {exc}", "error"
        return (out if isinstance(out, str) else str(out)), "ok"


async def _awaited(value: Any) -> Any:
    return await value


def environment_context(
    tools: Any = None, settings: Any = None, *, seed: int = 0, index: int = 0
) -> EnvironmentContext:
    """An :class:`rlplug.contracts.agents.EnvironmentContext` whose ``call_tool`` runs the tools in this process
    (:class:`InProcessTools`), for building an environment in a test: ``factory(environment_context([...]))``.

    ``tools``: ``None`` (none), a mapping name -> tool, or a sequence of tools and registered tool names (a
    name is resolved through the registry). ``settings``: the ``rollout.multi_turn`` section or a partial
    mapping of it (``{"format": "hermes"}``); passed on as a :class:`rlplug.config.schema.MultiTurnConfig`,
    the schema's defaults filling the rest. ``seed`` / ``index``: the trajectory's seed and batch index.
    """
    if tools is None:
        selected: dict[str, Any] = {}
    elif isinstance(tools, Mapping):
        selected = dict(tools)
    else:
        resolved = [_resolve("tool", t) for t in tools]
        selected = {t.name: t for t in resolved}
    config = typed(MultiTurnConfig, settings)
    return EnvironmentContext(
        tools=selected, call_tool=InProcessTools(selected, config), settings=config, seed=seed, index=index
    )


def _check_messages(messages: Any, roles: tuple[str, ...], what: str) -> list[dict[str, Any]]:
    """``messages`` as a list of dicts, or ``AssertionError`` naming the first message that is not a chat message
    with a ``role`` among ``roles`` and a ``str`` ``content``."""
    assert isinstance(messages, (list, tuple)), (
        f"{what} must be a list of messages ({{'role': ..., 'content': ...}} dicts), got {type(messages).__name__}"
    )
    out = []
    for i, message in enumerate(messages):
        assert isinstance(message, Mapping), f"{what}[{i}] must be a message dict, got {type(message).__name__}"
        role, content = message.get("role"), message.get("content")
        assert role in roles, f"{what}[{i}] has role {role!r}; expected one of {roles}"
        assert isinstance(content, str), f"{what}[{i}] content must be a str, got {type(content).__name__}"
        out.append(dict(message))
    return out


def _check_step(result: Any, what: str) -> EnvStep:
    assert isinstance(result, EnvStep), (
        f"{what} must return an EnvStep(observations, reward, done, info), got {type(result).__name__}: {result!r}"
    )
    _check_messages(list(result.observations), _OBSERVATION_ROLES, f"{what}.observations")
    reward = result.reward
    if reward is not None:
        assert isinstance(reward, (int, float)) and not isinstance(reward, bool), (
            f"{what}.reward must be None or a float, got {type(reward).__name__}: {reward!r}"
        )
        assert math.isfinite(reward), f"{what}.reward must be finite, got {reward!r}"
    assert isinstance(result.done, bool), f"{what}.done must be a bool, got {type(result.done).__name__}"
    assert isinstance(result.info, Mapping), f"{what}.info must be a mapping, got {type(result.info).__name__}"
    return result


def check_environment(
    environment: Any,
    row: Mapping[str, Any] | None = None,
    replies: Iterable[Any] | None = None,
    *,
    tools: Any = None,
    settings: Any = None,
    builds: Any = None,
) -> tuple[list[dict[str, Any]], list[EnvStep]]:
    """Run the environment kit: build one environment and play one episode with scripted assistant replies.

    ``environment``: the registered factory (a class, or a function with ``builds``), its registered name, or an
    environment already built. ``row``: the dataset row to ``reset`` with (default
    :data:`DEFAULT_ENVIRONMENT_ROW`, verl's row schema). ``replies``: the assistant turns, each a string (the
    content) or a message dict (default one final answer, ``"The answer is 84."``). ``tools`` and ``settings``:
    the context's tools and ``rollout.multi_turn`` settings (:func:`environment_context`; tools run in this
    process, :class:`InProcessTools`).

    Checks: the Protocol on the class it builds (``reset(row)``, ``step(assistant_message)``, optional
    ``close()`` and ``stop``, as the registry does); ``factory(context)`` builds it; ``stop``, when set, is a
    tuple of non-empty strings; ``reset(row)`` returns a non-empty list of messages (``role`` system / user /
    assistant / tool, ``content`` a ``str``); each ``step(reply)`` returns an
    :class:`rlplug.contracts.agents.EnvStep` whose observations are messages with role tool / user / system and
    ``str`` content, ``reward`` ``None`` or a finite float, ``done`` a bool and ``info`` a mapping; the steps
    go on until ``done`` or the replies run out; ``close()``, when present, is called at the end (also after a
    failure). ``async def`` methods are awaited. Environments live in the trainer process: no pickling.

    Returns ``(initial_messages, steps)`` for further assertions. Raises ``AssertionError`` naming what was
    wrong (a method that raised is named with its exception).
    """
    extra_builds = builds
    if isinstance(environment, str):
        reg = get_registry().registration("environment", environment)
        environment, extra_builds = reg.obj, builds if builds is not None else reg.extra.get("builds")
    built = hasattr(environment, "reset") and not inspect.isclass(environment)
    if built:
        check_protocol("environment", type(environment))
        env = environment
    else:
        check_protocol("environment", environment, builds=extra_builds)
        context = environment_context(tools, settings)
        try:
            env = environment(context)
        except Exception as exc:
            raise AssertionError(
                f"building the environment, {_name_of(environment)}(context), raised {type(exc).__name__}: {exc}"
            ) from exc
        check_protocol("environment", type(env))
    label = type(env).__qualname__
    stop = getattr(env, "stop", None)
    if stop is not None:
        assert isinstance(stop, (list, tuple)) and all(isinstance(s, str) and s for s in stop), (
            f"{label}.stop must be a tuple of non-empty stop strings, got {stop!r}"
        )
    script = ["The answer is 84."] if replies is None else list(replies)
    row = DEFAULT_ENVIRONMENT_ROW if row is None else row

    async def call(method: str, *args: Any) -> Any:
        try:
            out = getattr(env, method)(*args)
            return await out if inspect.isawaitable(out) else out
        except Exception as exc:
            raise AssertionError(f"{label}.{method}() raised {type(exc).__name__}: {exc}") from exc

    async def episode() -> tuple[list[dict[str, Any]], list[EnvStep]]:
        steps: list[EnvStep] = []
        try:
            initial = _check_messages(
                await call("reset", copy.deepcopy(dict(row))), _MESSAGE_ROLES, f"{label}.reset(row)"
            )
            assert initial, f"{label}.reset(row) returned no message; it must return the prompt's messages at least"
            for i, reply in enumerate(script):
                message = {"role": "assistant", "content": reply} if isinstance(reply, str) else dict(reply)
                steps.append(_check_step(await call("step", message), f"{label}.step() (turn {i})"))
                if steps[-1].done:
                    break
        finally:
            if callable(getattr(env, "close", None)):
                await call("close")
        return initial, steps

    return asyncio.run(episode())


def _name_of(obj: Any) -> str:
    return str(getattr(obj, "__qualname__", None) or type(obj).__qualname__)
