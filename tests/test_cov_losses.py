"""Clip-Cov and KL-Cov (Cui et al. 2025, arXiv 2505.22617) and the whole-mini-batch statistics
contract (``PolicyLoss.minibatch_stats``) they need.

Hand values (derivations in the comments), equality with a line-by-line re-implementation of verl's
``compute_policy_loss_clip_cov`` / ``_kl_cov`` (1dda039b9) for one micro-batch with every candidate
picked, the seeded pick, micro-batch invariance and resume through the ``local`` backend on the tiny
model, the conformance kit (and that it catches per-micro-batch selection), config errors.
"""

from __future__ import annotations

import math

import pytest
import torch
from _helpers import assert_updates_close, fp32_atol
from test_local_backend import UPDATE_TERMS, make_cfg

import rlplug
from rlplug.algorithms.losses import agg_normalizer
from rlplug.algorithms.objective import actor_objective
from rlplug.config.compose import compose
from rlplug.config.schema import ActorConfig, ConfigError, TinyModelConfig
from rlplug.contracts.batch import Batch
from rlplug.contracts.types import MiniBatchContext, PolicyLoss
from rlplug.plugins.algorithms.policy_loss import (
    clip_cov_minibatch_stats,
    clip_cov_policy_loss,
    kl_cov_minibatch_stats,
    kl_cov_policy_loss,
    validate_kl_cov,
)
from rlplug.run.validate import validate_config
from rlplug.testing import check_policy_loss, make_batch

LN = math.log

pytestmark = pytest.mark.numerics

# Float tolerances (rlplug.testing.reduction_tolerance via _helpers.fp32_atol): a float32 loss is a
# mean over the N valid tokens of a chain of a few elementwise operations (log-ratio, exp, products,
# clamp): N + OPS terms, at the magnitude of the inputs (log-probs, advantages) and of the terms.
OPS = 6


def _run(name, old, new, adv, mask, config, *, mode="token-mean", weights=None, stats=None):
    """(loss, metrics, d loss / d new) of the registered loss on one micro-batch = the whole batch;
    ``stats=None`` computes the loss's minibatch_stats on it first, as the update loop does."""
    loss_obj = rlplug.get_plugin("policy_loss", name)
    if stats is None:
        stats = loss_obj.minibatch_stats(old, new, adv, mask, config=config, context=MiniBatchContext())
    new = new.clone().requires_grad_(True)
    loss, metrics = loss_obj(
        old,
        new,
        adv,
        mask,
        config=config,
        loss_agg_mode=mode,
        normalizer=agg_normalizer(mask, mode),
        max_response_length=mask.shape[1],
        rollout_is_weights=weights,
        **stats,
    )
    (grad,) = torch.autograd.grad(loss, new)
    return loss.detach(), metrics, grad


# --------------------------------------------------------------------------- clip_cov by hand
# mask [[1, 1, 1], [1, 1, 0]]: N = 5 valid tokens
# A        [[2, 2, -1], [-1, -2, pad]]          mean(A) = 0
# log_prob [[-1, -1, -4], [-3, -6, pad]]        mean = -15 / 5 = -3, centred [[2, 2, -1], [0, -3]]
# cov = (A - 0) * centred = [[4, 4, 1], [0, 6]]
# old = log_prob except token (0, 1): old = -1 - ln 1.5, so r = 1.5 > 1 + 0.2 with A = 2 > 0:
#   L1 = -3, L2 = -2.4 > L1: clipped by PPO, never a candidate
# candidates (1 < cov < 5, bounds exclusive, unclipped): (0, 0) only ((0, 2) has cov = 1 exactly,
#   (1, 1) has 6 >= 5); n = max(int(0.5 * 5), 1) = 2 >= 1 candidate: (0, 0) is cut
# per-token loss: (0, 0) cut 0; (0, 1) -2.4 (constant); (0, 2) -A = 1; (1, 0) 1; (1, 1) 2
# token-mean = (-2.4 + 1 + 1 + 2) / 5 = 0.32
# gradient -A r / 5 on the uncut unclipped tokens: (0, 2) 0.2, (1, 0) 0.2, (1, 1) 0.4; 0 elsewhere
# pg_clipfrac = 1 cut / 5 = 0.2; ppo_kl = mean(old - new) = -ln 1.5 / 5
CC_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
CC_ADV = torch.tensor([[2.0, 2.0, -1.0], [-1.0, -2.0, 9.0]])
CC_NEW = torch.tensor([[-1.0, -1.0, -4.0], [-3.0, -6.0, 5.0]])
CC_OLD = torch.tensor([[-1.0, -1.0 - LN(1.5), -4.0], [-3.0, -6.0, -7.0]])
CC_CFG = {"clip_ratio": 0.2, "clip_cov_ratio": 0.5, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0}


def test_clip_cov_hand_values():
    stats = clip_cov_minibatch_stats(CC_OLD, CC_NEW, CC_ADV, CC_MASK, config=CC_CFG)
    assert torch.equal(stats["clip_cov_mask"], torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    loss, m, g = _run("clip_cov", CC_OLD, CC_NEW, CC_ADV, CC_MASK, CC_CFG)
    tol = fp32_atol(5 + OPS, CC_OLD, CC_NEW, CC_ADV)
    assert loss.item() == pytest.approx(0.32, abs=tol)
    torch.testing.assert_close(g, torch.tensor([[0.0, 0.0, 0.2], [0.2, 0.4, 0.0]]), rtol=0, atol=tol)
    assert m["pg_clipfrac"] == pytest.approx(0.2) and m["pg_clipfrac_lower"] == 0.0
    assert m["ppo_kl"] == pytest.approx(-LN(1.5) / 5, abs=tol)
    # without the cut this is vanilla: (0, 0) adds -2 -> (0.32 * 5 - 2) / 5 = -0.08
    vanilla, _, _ = _run("vanilla", CC_OLD, CC_NEW, CC_ADV, CC_MASK, CC_CFG, stats={})
    assert vanilla.item() == pytest.approx(-0.08, abs=tol)


def test_clip_cov_random_pick_is_seeded_by_the_context():
    # widen the window to (0.5, 5): candidates (0, 0) and (0, 2)? (0, 2) has cov 1 > 0.5: yes; two
    # candidates, n = max(int(0.2 * 5), 1) = 1 pick: which one depends on the generator only
    cfg = {**CC_CFG, "clip_cov_ratio": 0.2, "clip_cov_lb": 0.5}
    picks = {}
    for step in range(12):
        ctx = MiniBatchContext(seed=7, optimizer_step=step)
        first = clip_cov_minibatch_stats(CC_OLD, CC_NEW, CC_ADV, CC_MASK, config=cfg, context=ctx)["clip_cov_mask"]
        torch.manual_seed(step)  # the global RNG plays no part
        torch.rand(5)
        again = clip_cov_minibatch_stats(CC_OLD, CC_NEW, CC_ADV, CC_MASK, config=cfg, context=ctx)["clip_cov_mask"]
        assert torch.equal(first, again), step
        assert first.sum() == 1 and (first[0, 0] + first[0, 2]) == 1, first
        picks[step] = (int(first[0, 0]), int(first[0, 2]))
    assert len(set(picks.values())) == 2, f"the pick never changed across steps: {picks}"
    other_seed = [
        clip_cov_minibatch_stats(
            CC_OLD, CC_NEW, CC_ADV, CC_MASK, config=cfg, context=MiniBatchContext(seed=8, optimizer_step=s)
        )["clip_cov_mask"][0, 0].item()
        for s in range(12)
    ]
    assert other_seed != [picks[s][0] for s in range(12)], "the run seed does not change the pick"


# --------------------------------------------------------------------------- kl_cov by hand
# one row, 4 valid tokens; A = [1, -1, 2, -2] (mean 0); log_prob = [-0.5, -3, -1, -3.5] (mean -2),
# centred [1.5, -1, 1, -1.5]; cov = [1.5, 1, 2, 3]; kl_cov_ratio 0.5: k = max(1, int(4 * 0.5)) = 2,
# the top 2 are tokens 3 (cov 3) and 2 (cov 2)
# log-ratios l = [0.1, -0.2, 0.3, -0.4], r = e^l, ppo_kl_coef 1:
#   loss = (-e^0.1 + e^-0.2 + (-2 e^0.3 + 0.3) + (2 e^-0.4 + 0.4)) / 4
#   gradient = [-e^0.1, e^-0.2, -2 e^0.3 + 1, 2 e^-0.4 - 1] / 4  (d|l|/dl = sign(l))
# pg_clipfrac = 2 / 4 penalised; ppo_kl = mean(-l) = 0.2 / 4 = 0.05
KC_ADV = torch.tensor([[1.0, -1.0, 2.0, -2.0]])
KC_NEW = torch.tensor([[-0.5, -3.0, -1.0, -3.5]])
KC_L = torch.tensor([[0.1, -0.2, 0.3, -0.4]])
KC_CFG = {"kl_cov_ratio": 0.5, "ppo_kl_coef": 1.0}


def test_kl_cov_hand_values():
    mask = torch.ones(1, 4)
    old = KC_NEW - KC_L
    assert torch.equal(
        kl_cov_minibatch_stats(old, KC_NEW, KC_ADV, mask, config=KC_CFG)["kl_cov_mask"],
        torch.tensor([[0.0, 0.0, 1.0, 1.0]]),
    )
    loss, m, g = _run("kl_cov", old, KC_NEW, KC_ADV, mask, KC_CFG)
    e = math.exp
    tol = fp32_atol(4 + OPS, old, KC_NEW, KC_ADV)
    assert loss.item() == pytest.approx((-e(0.1) + e(-0.2) - 2 * e(0.3) + 0.3 + 2 * e(-0.4) + 0.4) / 4, abs=tol)
    expected = torch.tensor([[-e(0.1), e(-0.2), -2 * e(0.3) + 1, 2 * e(-0.4) - 1]]) / 4
    torch.testing.assert_close(g, expected, rtol=0, atol=tol)
    assert m["pg_clipfrac"] == pytest.approx(0.5) and m["pg_clipfrac_lower"] == 0.0
    assert m["ppo_kl"] == pytest.approx(0.05, abs=tol)
    # ppo_kl_coef 0 leaves the plain unclipped -A r
    loss0, _, _ = _run("kl_cov", old, KC_NEW, KC_ADV, mask, {**KC_CFG, "ppo_kl_coef": 0.0})
    assert loss0.item() == pytest.approx((-e(0.1) + e(-0.2) - 2 * e(0.3) + 2 * e(-0.4)) / 4, abs=tol)


# --------------------------------------------------------------------------- equality with verl
def _verl_masked_mean(x, mask):
    return (x * mask).sum() / (mask.sum() + 1e-8)


def _verl_agg(loss_mat, mask, mode):
    if mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum()
    seq = (loss_mat * mask).sum(-1) / mask.sum(-1)  # seq-mean-token-mean over non-empty rows
    return seq[mask.sum(-1) > 0].mean()


def _verl_clip_cov(old_log_prob, log_prob, advantages, response_mask, cfg, mode, rollout_is_weights=None):
    """verl's compute_policy_loss_clip_cov (1dda039b9), line by line, for one micro-batch."""
    cliprange_low = cliprange_high = cfg["clip_ratio"]
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    corr = torch.ones_like(advantages)
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_by_origin = (pg_losses2 > pg_losses1) & (response_mask > 0)
    cov_all = (advantages - _verl_masked_mean(advantages, response_mask)) * (
        log_prob - _verl_masked_mean(log_prob.detach(), response_mask)
    )
    cov_all[response_mask == 0] = -torch.inf
    cov_all[clip_by_origin] = -torch.inf
    clip_num = max(int(cfg["clip_cov_ratio"] * response_mask.sum().item()), 1)
    top_k_idx = (cov_all < cfg["clip_cov_ub"]) & (cov_all > cfg["clip_cov_lb"]) & (response_mask > 0)
    top_k_idx = torch.nonzero(top_k_idx)
    if len(top_k_idx) > 0:
        perm = torch.randperm(len(top_k_idx))
        top_k_idx = top_k_idx[perm[: min(clip_num, len(top_k_idx))]]
    else:
        top_k_idx = torch.empty((0, 2), dtype=torch.long)
    corr[top_k_idx[:, 0], top_k_idx[:, 1]] = 0
    pg_clipfrac = _verl_masked_mean((corr == 0).float(), response_mask)
    pg_losses = torch.maximum(pg_losses1, pg_losses2) * corr
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    return _verl_agg(pg_losses, response_mask, mode), float(pg_clipfrac), int(len(top_k_idx))


def _verl_kl_cov(old_log_prob, log_prob, advantages, response_mask, cfg, mode, rollout_is_weights=None):
    """verl's compute_policy_loss_kl_cov (1dda039b9), line by line, for one micro-batch."""
    negative_approx_kl = log_prob - old_log_prob
    abs_kl = negative_approx_kl.abs()
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses_kl = -advantages * ratio + cfg["ppo_kl_coef"] * abs_kl
    pg_losses = pg_losses1
    all_valid = response_mask > 0
    all_valid_idx = torch.nonzero(all_valid.reshape(-1), as_tuple=True)[0]
    all_valid_adv = advantages[all_valid].detach().reshape(-1).cpu()
    all_valid_logp = log_prob[all_valid].detach().reshape(-1).cpu()
    k = min(cfg["kl_cov_ratio"], len(all_valid_adv))
    if k != 0:
        cov_lst_all = (all_valid_adv - all_valid_adv.mean()) * (all_valid_logp - all_valid_logp.mean())
        k_percent_nums = max(1, int(len(cov_lst_all) * cfg["kl_cov_ratio"]))
        large_cov_idxs = torch.topk(cov_lst_all, k_percent_nums, largest=True).indices
        if len(large_cov_idxs) != 0:
            large_cov_idxs = all_valid_idx[large_cov_idxs]
            w = advantages.shape[1]
            pg_losses[large_cov_idxs // w, large_cov_idxs % w] = pg_losses_kl[large_cov_idxs // w, large_cov_idxs % w]
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    return _verl_agg(pg_losses, response_mask, mode)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clip_cov_equals_verl_with_one_micro_batch_and_every_candidate_picked(mode, weighted, seed):
    data = make_batch(batch_size=8, response_length=7, seed=seed, kl_scale=0.3)
    mask, adv, old = data["response_mask"], data["advantages"], data["old_log_probs"]
    # a window around the positive covariances and a ratio of 1: every candidate is cut, so verl's
    # global-RNG permutation does not matter
    cfg = {"clip_ratio": 0.2, "clip_cov_ratio": 1.0, "clip_cov_lb": 0.05, "clip_cov_ub": 0.6}
    weights = torch.rand(mask.shape, generator=torch.Generator().manual_seed(seed)) + 0.5 if weighted else None
    new_v = data["log_probs"].clone().requires_grad_(True)
    ref, ref_frac, n_cut = _verl_clip_cov(old, new_v, adv, mask, cfg, mode, weights)
    (ref_grad,) = torch.autograd.grad(ref, new_v)
    assert 0 < n_cut < int(mask.sum()), "the batch should have some candidates, not all tokens"
    loss, m, g = _run("clip_cov", old, data["log_probs"], adv, mask, cfg, mode=mode, weights=weights)
    # the same formulas in another order: the 56 tokens' mean of the per-token chain
    tol = fp32_atol(mask.numel() + OPS, old, data["log_probs"], adv, 1.5 * adv)
    assert loss.item() == pytest.approx(ref.item(), abs=tol)
    torch.testing.assert_close(g, ref_grad, rtol=0, atol=tol)
    assert m["pg_clipfrac"] == pytest.approx(ref_frac, abs=1e-6)  # a count / N: one rounding


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kl_cov_equals_verl_with_one_micro_batch(mode, weighted, seed):
    data = make_batch(batch_size=8, response_length=7, seed=seed, kl_scale=0.3)
    mask, adv, old = data["response_mask"], data["advantages"], data["old_log_probs"]
    cfg = {"kl_cov_ratio": 0.3, "ppo_kl_coef": 1.0}
    weights = torch.rand(mask.shape, generator=torch.Generator().manual_seed(seed)) + 0.5 if weighted else None
    new_v = data["log_probs"].clone().requires_grad_(True)
    ref = _verl_kl_cov(old, new_v, adv, mask, cfg, mode, weights)
    (ref_grad,) = torch.autograd.grad(ref, new_v)
    loss, _, g = _run("kl_cov", old, data["log_probs"], adv, mask, cfg, mode=mode, weights=weights)
    tol = fp32_atol(mask.numel() + OPS, old, data["log_probs"], adv, 1.5 * adv)  # as for clip_cov
    assert loss.item() == pytest.approx(ref.item(), abs=tol)
    torch.testing.assert_close(g, ref_grad, rtol=0, atol=tol)


def test_without_stats_the_losses_select_on_their_own_inputs_like_verl():
    # called without the mask (not through the update loop), the loss picks on this call's rows
    old = KC_NEW - KC_L
    loss, _ = kl_cov_policy_loss(old, KC_NEW, KC_ADV, torch.ones(1, 4), config=KC_CFG, normalizer=4.0)
    ref, _, _ = _run("kl_cov", old, KC_NEW, KC_ADV, torch.ones(1, 4), KC_CFG)
    assert loss.item() == pytest.approx(ref.item())
    loss, m = clip_cov_policy_loss(CC_OLD, CC_NEW, CC_ADV, CC_MASK, config=CC_CFG, normalizer=5.0)
    tol = fp32_atol(5 + OPS, CC_OLD, CC_NEW, CC_ADV)
    assert loss.item() == pytest.approx(0.32, abs=tol) and m["pg_clipfrac"] == pytest.approx(0.2)


# --------------------------------------------------------------------------- the contract
def test_actor_objective_passes_the_stats_and_refuses_clashing_names():
    mask = torch.ones(1, 4)
    tensors = {"old_log_probs": KC_NEW - KC_L, "advantages": KC_ADV, "response_mask": mask}
    loss_obj = rlplug.get_plugin("policy_loss", "kl_cov")
    kwargs = dict(policy_loss=loss_obj, config=KC_CFG, loss_agg_mode="token-mean", normalizer=4.0)
    # a mask selecting nothing: the plain -A r whatever the covariance says
    loss, parts = actor_objective(
        KC_NEW.clone(), None, tensors, minibatch_stats={"kl_cov_mask": torch.zeros(1, 4)}, **kwargs
    )
    e = math.exp
    tol = fp32_atol(4 + OPS, tensors["old_log_probs"], KC_NEW, KC_ADV)
    assert loss.item() == pytest.approx((-e(0.1) + e(-0.2) - 2 * e(0.3) + 2 * e(-0.4)) / 4, abs=tol)
    assert parts["mean:pg_clipfrac"] == 0.0
    with pytest.raises(ValueError, match=r"minibatch_stats returned \['advantages'\]"):
        actor_objective(KC_NEW.clone(), None, tensors, minibatch_stats={"advantages": KC_ADV}, **kwargs)


def test_registered_with_minibatch_stats_and_verl_defaults():
    for name in ("clip_cov", "kl_cov"):
        loss = rlplug.get_plugin("policy_loss", name)
        assert loss.minibatch_stats is not None and loss.validate is not None and loss.description
    assert rlplug.get_plugin("policy_loss", "vanilla").minibatch_stats is None
    a = ActorConfig()
    # verl's actor.yaml / PolicyLossConfig defaults (ppo_kl_coef 0.1 there; the function's 1.0 is a fallback)
    assert (a.clip_cov_ratio, a.clip_cov_lb, a.clip_cov_ub, a.kl_cov_ratio, a.ppo_kl_coef) == (
        0.0002,
        1.0,
        5.0,
        0.0002,
        0.1,
    )


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
def test_conformance_kit(name):
    check_policy_loss(name)  # rlplug's defaults: a token or none selected on the kit's batches
    # a config that selects many tokens, so the kit's micro-batch split meets a real selection
    check_policy_loss(
        name, {"clip_ratio": 0.2, "clip_cov_ratio": 0.5, "clip_cov_lb": -5.0, "clip_cov_ub": 5.0, "kl_cov_ratio": 0.5}
    )


def test_conformance_kit_catches_per_micro_batch_selection_and_global_rng():
    cfg = {"kl_cov_ratio": 0.5, "ppo_kl_coef": 1.0}
    per_micro = PolicyLoss(kl_cov_policy_loss, validate=validate_kl_cov)  # verl's behaviour: no minibatch_stats
    with pytest.raises(AssertionError, match="micro-batch"):
        check_policy_loss(per_micro, cfg, modes=["token-mean"])

    def global_rng_stats(old, new, adv, mask, *, config, context):
        return {"clip_cov_mask": (torch.rand(mask.shape) < 0.3).float()}

    unseeded = PolicyLoss(clip_cov_policy_loss, minibatch_stats=global_rng_stats)
    with pytest.raises(AssertionError, match="differs between two calls with the same context"):
        check_policy_loss(unseeded, modes=["token-mean"])


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["algorithm=clip_cov", "actor.clip_cov_ratio=0"],
            "actor.policy_loss=clip_cov: actor.clip_cov_ratio = 0.0 but the clip_cov policy loss needs it in (0, 1]",
        ),
        (
            ["algorithm=clip_cov", "actor.clip_cov_lb=5.0"],
            "actor.policy_loss=clip_cov: actor.clip_cov_lb = 5.0 and actor.clip_cov_ub = 5.0, but",
        ),
        (
            ["algorithm=kl_cov", "actor.kl_cov_ratio=1.5"],
            "actor.policy_loss=kl_cov: actor.kl_cov_ratio = 1.5 but the kl_cov policy loss needs it in (0, 1]",
        ),
        (
            ["algorithm=kl_cov", "actor.ppo_kl_coef=-1"],
            "actor.policy_loss=kl_cov: actor.ppo_kl_coef = -1.0 but the kl_cov policy loss needs a finite coefficient",
        ),
    ],
)
def test_bad_hyperparameters_are_config_errors(overrides, expected):
    with pytest.raises(ConfigError) as info:
        validate_config(compose(overrides))
    assert str(info.value).startswith(expected), str(info.value)


def test_a_backend_without_the_capability_is_a_config_error(rlplug_full_registry):
    from rlplug.plugins.training.local import LocalTrainingBackend

    class NoStats(LocalTrainingBackend):
        capabilities = frozenset({"reuses_on_policy_log_probs"})

    class Plugin:
        @rlplug.hookimpl
        def register_training_backends(self, register):
            register("nostats", NoStats)

    assert rlplug_full_registry.add_plugin(Plugin(), name="nostats"), rlplug_full_registry.broken
    validate_config(compose(["trainer.backend=nostats"]))  # a loss without minibatch_stats: fine
    with pytest.raises(ConfigError, match="does not declare the capability 'policy_loss_minibatch_stats'"):
        validate_config(compose(["algorithm=kl_cov", "trainer.backend=nostats"]))


# --------------------------------------------------------------------------- through the local backend
B, P, T, N_SAMPLES, PAD = 8, 5, 6, 2, 2


@pytest.fixture(scope="module")
def model_path() -> str:
    from rlplug.training.models import tiny_model_dir

    return str(tiny_model_dir(TinyModelConfig()))


def _cfg(**overrides):
    """The tiny model, 4 prompts x 2 responses, mini-batches of 2 prompts (4 rows, 2 optimizer steps):
    test_local_backend's config (AdamW eps 1, so its first steps are ~ proportional to the gradient)."""
    return make_cfg(**overrides)


def _batch(backend, seed: int = 0) -> Batch:
    """Ragged prompts and responses, random advantages, old log-probs perturbed off the policy."""
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.tensor([5, 5, 3, 3, 4, 4, 2, 2])
    resp_len = torch.tensor([6, 3, 1, 6, 4, 2, 5, 6])
    ids = torch.full((B, P + T), PAD, dtype=torch.long)
    attn = torch.zeros(B, P + T, dtype=torch.long)
    for i in range(B):
        ids[i, P - prompt_len[i] : P] = torch.randint(3, 500, (int(prompt_len[i]),), generator=g)
        ids[i, P : P + resp_len[i]] = torch.randint(3, 49152, (int(resp_len[i]),), generator=g)
        attn[i, P - prompt_len[i] : P + resp_len[i]] = 1
    mask = (torch.arange(T)[None] < resp_len[:, None]).float()
    batch = Batch(
        {
            "input_ids": ids,
            "attention_mask": attn,
            "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, P:],
            "response_mask": mask,
            "advantages": torch.randn(B, T, generator=g) * 3 * mask,
        }
    )
    lp = backend.compute_log_probs(batch)["log_probs"]
    batch["old_log_probs"] = (lp + 0.3 * torch.randn(lp.shape, generator=g)) * mask
    return batch


def _params(backend):
    return {n: p.detach().clone() for n, p in backend.actor.model.named_parameters()}


#: selections that pick some tokens of each mini-batch of the test batch (the tiny model's
#: log-probs spread by ~1 nat, the advantages by ~3): clip_cov picks 3 of ~16 tokens at random
#: among the candidates, kl_cov penalises the top 30% with a large coefficient
SELECTING = {
    "clip_cov": {"actor.clip_cov_ratio": 0.2, "actor.clip_cov_lb": 0.0, "actor.clip_cov_ub": 100.0},
    "kl_cov": {"actor.kl_cov_ratio": 0.3, "actor.ppo_kl_coef": 5.0},
}


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
def test_update_actor_micro_batch_invariance(model_path, name):
    # the same two mini-batches of 4 responses as one micro-batch, 4 of 1 and 3 + 1 give the same
    # selection (pg_clipfrac), loss, gradient norm and parameters: the statistics come from the
    # whole mini-batch. The same loss WITHOUT minibatch_stats (verl's per-micro-batch selection)
    # differs, so the check can fail.
    results = {}
    start = None
    for micro, with_stats in ((4, True), (1, True), (3, True), (1, False)):
        cfg = _cfg(**{"actor.policy_loss": name, "actor.micro_batch_size_per_device": micro, **SELECTING[name]})
        backend = rlplug.get_plugin("training_backend", "local")(
            cfg, model_path, use_critic=False, use_ref=False, total_steps=2
        )
        start = start or _params(backend)  # every backend starts from the same tiny weights
        if not with_stats:
            loss = backend.policy_loss
            backend.policy_loss = PolicyLoss(loss.fn, validate=loss.validate)
        results[(micro, with_stats)] = (_params(backend), backend.update_actor(_batch(backend)))
        backend.close()
    p_ref, m_ref = results[(4, True)]
    assert m_ref["actor/pg_clipfrac"] > 0, "the test batch should select tokens"
    for key in ((1, True), (3, True)):
        p, m = results[key]
        assert_updates_close(p, p_ref, start, UPDATE_TERMS, what=f"{key} ")
        for k in ("actor/pg_loss", "actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl"):
            # means over the tokens of O(1) terms
            assert m[k] == pytest.approx(m_ref[k], rel=0, abs=fp32_atol(UPDATE_TERMS, m_ref[k], floor=1.0)), (key, k)
    p_verl, m_verl = results[(1, False)]
    try:  # more than rounding apart
        assert_updates_close(p_verl, p_ref, start, UPDATE_TERMS)
        same_params = True
    except AssertionError:
        same_params = False
    assert m_verl["actor/pg_clipfrac"] != pytest.approx(m_ref["actor/pg_clipfrac"]) or not same_params, (
        "per-micro-batch selection should differ from the whole mini-batch's"
    )


def test_clip_cov_resume_is_bitwise_and_ignores_the_global_rng(model_path, tmp_path):
    # two updates in one backend == one update, save, load into a fresh backend, one update (with
    # the global RNG disturbed in between): the pick is seeded by trainer.seed and the optimizer
    # step restored from the checkpoint, so the parameters are bitwise equal
    cfg = _cfg(**{"actor.policy_loss": "clip_cov", "actor.micro_batch_size_per_device": 2, **SELECTING["clip_cov"]})
    local = rlplug.get_plugin("training_backend", "local")
    a = local(cfg, model_path, use_critic=False, use_ref=False, total_steps=4)
    batch0, batch1 = _batch(a, 0), _batch(a, 1)
    assert a.update_actor(batch0)["actor/pg_clipfrac"] > 0
    a.save(tmp_path / "ckpt")
    a.update_actor(batch1)
    expected = _params(a)
    a.close()
    b = local(cfg, model_path, use_critic=False, use_ref=False, total_steps=4)
    b.load(tmp_path / "ckpt")
    torch.manual_seed(12345)
    torch.rand(100)
    b.update_actor(batch1)
    got = _params(b)
    b.close()
    for n in expected:
        assert torch.equal(got[n], expected[n]), n


# --------------------------------------------------------------------------- fsdp2: global statistics
@pytest.mark.slow  # over a minute on 2 cores: the slow CI step runs it
def test_fsdp2_two_ranks_select_on_the_global_mini_batch(model_path, tmp_path):
    # 2 gloo ranks, each holding half of every mini-batch (rows 2 | 2 with very unequal token
    # counts, fsdp2_worker.RESP_LEN), micro-batches of 1, against the local backend with one
    # micro-batch: the same parameters and metrics, so each rank's selection used the WHOLE
    # mini-batch's covariance, top-k and random pick (a per-rank selection would differ)
    import json
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here))
    import fsdp2_worker as W

    from rlplug.plugins.training.local import LocalTrainingBackend

    settings = {
        "kl_cov": {"actor.policy_loss": "kl_cov", **SELECTING["kl_cov"]},
        "clip_cov": {"actor.policy_loss": "clip_cov", **SELECTING["clip_cov"]},
    }
    local, jobs = {}, []
    for name, overrides in settings.items():
        backend = LocalTrainingBackend(
            W.make_cfg(**overrides), model_path, use_critic=True, use_ref=True, total_steps=4
        )
        initial = W.full_params(backend, "actor")
        batch = W.prepare(backend, W.make_batch())
        batch["advantages"] = batch["advantages"] * 3
        torch.save(dict(batch.tensors), tmp_path / f"batch-{name}.pt")
        backend.update_critic(batch)
        local[name] = (backend.update_actor(batch), W.full_params(backend, "actor"), initial)
        backend.close()
        jobs.append(
            {
                "kind": "step",
                "name": name,
                "batch": str(tmp_path / f"batch-{name}.pt"),
                "overrides": {**overrides, "actor.micro_batch_size_per_device": 1},
            }
        )
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model_path": model_path, "out": str(tmp_path), "jobs": jobs}))
    env = {k: v for k, v in __import__("os").environ.items() if k != "WORLD_SIZE"}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.run(
        [*cmd, str(here / "fsdp2_worker.py"), str(spec)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    for name in settings:
        metrics, params, initial = local[name]
        dist = torch.load(tmp_path / f"{name}.pt", weights_only=False)
        assert metrics["actor/pg_clipfrac"] > 0, f"{name}: the batch should select tokens"
        for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/grad_norm"):
            tol = fp32_atol(UPDATE_TERMS, metrics[key], floor=1.0)  # means over the tokens of O(1) terms
            assert dist["actor_metrics"][key] == pytest.approx(metrics[key], rel=0, abs=tol), (name, key)
        assert set(dist["actor"]) == set(params)
        assert_updates_close(dist["actor"], params, initial, UPDATE_TERMS, what=f"{name} ")
