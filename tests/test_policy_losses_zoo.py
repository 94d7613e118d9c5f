"""verl's other policy losses as rlplug plugins (gspo, sapo, gpg, geo_mean, dro, cispo, dppo_tv,
dppo_kl), ``token-sum`` and ``actor.loss_scale_factor``: hand values (derivations in the comments),
gradients, padding, single tokens, micro-batch invariance for every loss x every aggregation mode
with and without rollout importance weights, validation, presets, and the conformance kit.

Every loss was also compared with verl's ``compute_policy_loss_*`` at commit 1dda039b9 (loss,
gradient and metrics, with and without ``rollout_is_weights``, every mode verl honours): equal to
float32 rounding. The numbers below are derived by hand instead, so the tests run without verl.
"""

from __future__ import annotations

import math

import pytest
import torch
from _helpers import fp32_atol
from omegaconf import OmegaConf

import rlplug
from rlplug.algorithms.losses import LOSS_AGG_MODES, agg_normalizer
from rlplug.algorithms.objective import actor_objective
from rlplug.config.compose import compose
from rlplug.config.schema import ActorConfig, ConfigError
from rlplug.run.validate import validate_config
from rlplug.testing import check_policy_loss

LN = math.log
NEW_LOSSES = ("gspo", "sapo", "gpg", "geo_mean", "dro", "cispo", "dppo_tv", "dppo_kl")
#: rlplug's defaults and the one hyperparameter without a default (verl's dro_beta: null)
CFG = {"clip_ratio": 0.2, "clip_ratio_c": 3.0, "tau_pos": 1.0, "tau_neg": 1.05, "dro_beta": 0.5}

pytestmark = pytest.mark.numerics

#: elementwise float32 operations per token in a loss's chain (log-ratio, exp, clamp, products,
#: gate); with the mean over the valid tokens they make the n_terms of reduction_tolerance
OPS = 6


def _magnitude(old, new, adv, mask, weights=None) -> float:
    """The largest magnitude along a loss's chain on the valid tokens: the inputs and the per-token
    terms A r w and A log_prob w."""
    ratio = torch.exp((new - old) * mask)
    w = torch.ones_like(mask) if weights is None else weights
    return max(float((t * mask).abs().max()) for t in (old, new, adv, adv * ratio * w, adv * new * w))


def _tol(old, new, adv, mask, weights=None, extra: float = 0.0) -> float:
    """float32 tolerance (rlplug.testing.reduction_tolerance) of a loss or its gradient against a
    hand value or another evaluation order: the valid tokens plus OPS terms, at the chain's largest
    magnitude (:func:`_magnitude`, or ``extra``: a gate's or truncation's factor)."""
    return fp32_atol(int(mask.sum()) + OPS, _magnitude(old, new, adv, mask, weights), extra)


def _run(name, old, new, adv, mask, *, mode="token-mean", config=None, weights=None, mrl=None):
    """(loss, metrics, d loss / d new) of the registered loss on the whole batch."""
    new = new.clone().requires_grad_(True)
    loss, metrics = rlplug.get_plugin("policy_loss", name)(
        old,
        new,
        adv,
        mask,
        config=CFG if config is None else config,
        loss_agg_mode=mode,
        normalizer=agg_normalizer(mask, mode),
        max_response_length=mrl or mask.shape[1],
        rollout_is_weights=weights,
    )
    (grad,) = torch.autograd.grad(loss, new, allow_unused=True)
    return loss.detach(), metrics, torch.zeros_like(new) if grad is None else grad


# --------------------------------------------------------------------------- gspo
def test_gspo_hand_values_and_one_gradient_per_sequence():
    # seq 0: log-ratios ln 1.5, ln 0.6 -> s = exp((ln 1.5 + ln 0.6) / 2) = sqrt(0.9) = 0.948683, inside
    #        [0.8, 1.2]: each token's loss -A s = -0.948683 (A = +1), token mean -0.948683
    # seq 1: one token, log-ratio ln 2 -> s = 2 > 1.2: max(-2, -1.2) = -1.2 (clipped), the third column
    #        is padding (garbage)
    # seq-mean-token-mean = (-0.948683 - 1.2) / 2 = -1.0743416; pg_clipfrac = 1 of 3 valid tokens
    # gradient: d(-A s_it)/d log_prob_t = -A s (s_it has the value s and the token's own log-prob's
    # gradient), / 2 tokens / 2 sequences = -0.2371708 on BOTH tokens of seq 0 although their token
    # ratios (1.5, 0.6) differ (vanilla: 0 for the clipped 1.5, -0.6 / 3 for 0.6); 0 on seq 1's clipped token
    old = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    new = torch.tensor([[LN(1.5), LN(0.6), 5.0], [LN(2.0), 9.0, -9.0]])
    adv = torch.tensor([[1.0, 1.0, 7.0], [1.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss, m, g = _run("gspo", old, new, adv, mask, mode="seq-mean-token-mean")
    tol = _tol(old, new, adv, mask)
    assert loss.item() == pytest.approx(-(math.sqrt(0.9) + 1.2) / 2, abs=tol)
    assert m["pg_clipfrac"] == pytest.approx(1 / 3) and m["pg_clipfrac_lower"] == 0.0
    assert m["ppo_kl"] == pytest.approx(-(LN(1.5) + LN(0.6) + LN(2.0)) / 3, abs=tol)
    expected = torch.tensor([[-math.sqrt(0.9) / 4] * 2 + [0.0], [0.0] * 3])
    torch.testing.assert_close(g, expected, rtol=0, atol=tol)


def test_gspo_is_vanilla_for_single_token_sequences():
    # one token per sequence: the sequence ratio is the token ratio, so gspo = the PPO clip
    g = torch.Generator().manual_seed(0)
    old, new = -torch.rand(5, 1, generator=g), -torch.rand(5, 1, generator=g)
    adv, mask = torch.randn(5, 1, generator=g), torch.ones(5, 1)
    a = _run("gspo", old, new, adv, mask, mode="seq-mean-token-mean")
    b = _run("vanilla", old, new, adv, mask, mode="seq-mean-token-mean")
    tol = _tol(old, new, adv, mask)  # two formulas of the same numbers
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=tol)
    torch.testing.assert_close(a[2], b[2], rtol=0, atol=tol)


# --------------------------------------------------------------------------- sapo
def test_sapo_hand_values_and_the_policy_gradient_at_ratio_one():
    # gate f(r) = sigmoid(tau (r - 1)) * 4 / tau; loss -A f(r)
    # tok 1: r = 1, A = +1, tau_pos 1: f = 0.5 * 4 = 2 -> -2; gradient d/dlogp = -A f'(1) r
    #        = -A * tau * 0.25 * 4 / tau = -1 (the plain policy gradient at r = 1)
    # tok 2: r = 2, A = -1, tau_neg 1.05: f = sigmoid(1.05) * 4 / 1.05 -> +f; gradient
    #        = -A * sigmoid(1.05) (1 - sigmoid(1.05)) * 4 * r
    old = torch.tensor([[0.0, 0.0]])
    new = torch.tensor([[0.0, LN(2.0)]])
    adv = torch.tensor([[1.0, -1.0]])
    mask = torch.ones(1, 2)
    sig = 1 / (1 + math.exp(-1.05))
    tol = _tol(old, new, adv, mask, extra=4 * 2)  # the gate 4 / tau times r = 2
    loss, m, g = _run("sapo", old, new, adv, mask, mode="token-sum")
    assert loss.item() == pytest.approx(-2.0 + sig * 4 / 1.05, abs=tol)
    torch.testing.assert_close(g, torch.tensor([[-1.0, sig * (1 - sig) * 4 * 2]]), rtol=0, atol=tol)
    assert m["pg_clipfrac"] == 0.0 and m["pg_clipfrac_lower"] == 0.0
    # tau_pos 2 for the first token: f(1) = 0.5 * 4 / 2 = 1 -> loss -1 (the gradient at r = 1 stays -1)
    loss, _, g = _run("sapo", old, new, adv, mask, mode="token-sum", config={**CFG, "tau_pos": 2.0})
    assert loss.item() == pytest.approx(-1.0 + sig * 4 / 1.05, abs=tol)
    assert g[0, 0].item() == pytest.approx(-1.0, abs=tol)


# --------------------------------------------------------------------------- gpg
def test_gpg_hand_values():
    # loss -A log_prob: (-2 * -1) + (-1 * -2) = 4 over 2 tokens -> token-mean 2; gradient -A / 2
    old = torch.tensor([[-1.5, -2.5, 0.0]])
    new = torch.tensor([[-1.0, -2.0, 3.0]])
    adv = torch.tensor([[2.0, 1.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, m, g = _run("gpg", old, new, adv, mask)
    assert loss.item() == pytest.approx(2.0)
    assert torch.allclose(g, torch.tensor([[-1.0, -0.5, 0.0]]))
    assert m["ppo_kl"] == pytest.approx(-0.5)  # old - new = -0.5 on both tokens


# --------------------------------------------------------------------------- geo_mean
GM_OLD = torch.tensor([[0.0, 0.0], [0.0, 0.0]])
GM_NEW = torch.tensor([[0.1, 0.5], [-0.5, 4.0]])
GM_ADV = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
GM_MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0]])


def test_geo_mean_hand_values_and_gradient():
    # clip_ratio 0.2 on the log-ratio l
    # seq 0 (A = +1): only a too-large l is clipped: l* = (0.1, min(0.5, 0.2)) = (0.1, 0.2);
    #   loss_0 = -1 * exp((0.1 + 0.2) / 2) = -exp(0.15)
    # seq 1 (A = -1, one valid token): only a too-small l is clipped: l* = max(-0.5, -0.2) = -0.2;
    #   loss_1 = +exp(-0.2)
    # seq-mean-token-mean = (-exp(0.15) + exp(-0.2)) / 2
    # gradient of seq 0: -exp(0.15) / 2 tokens / 2 sequences on the unclipped token, 0 on the clipped
    # one; seq 1's only token is clipped: 0. pg_clipfrac 1/3 (A > 0), pg_clipfrac_lower 1/3 (A < 0)
    loss, m, g = _run("geo_mean", GM_OLD, GM_NEW, GM_ADV, GM_MASK, mode="seq-mean-token-mean")
    tol = _tol(GM_OLD, GM_NEW, GM_ADV, GM_MASK)
    assert loss.item() == pytest.approx((-math.exp(0.15) + math.exp(-0.2)) / 2, abs=tol)
    torch.testing.assert_close(g, torch.tensor([[-math.exp(0.15) / 4, 0.0], [0.0, 0.0]]), rtol=0, atol=tol)
    assert m["pg_clipfrac"] == pytest.approx(1 / 3) and m["pg_clipfrac_lower"] == pytest.approx(1 / 3)
    # a wide clip (0.6): nothing clipped, loss_0 = -exp(0.3), and the gradient is the same on both
    # tokens of seq 0 (-exp(0.3) / 4) although their ratios differ
    loss, m, g = _run(
        "geo_mean", GM_OLD, GM_NEW, GM_ADV, GM_MASK, mode="seq-mean-token-mean", config={"clip_ratio": 0.6}
    )
    assert loss.item() == pytest.approx((-math.exp(0.3) + math.exp(-0.5)) / 2, abs=tol)
    assert g[0, 0].item() == pytest.approx(g[0, 1].item(), abs=tol) == pytest.approx(-math.exp(0.3) / 4, abs=tol)
    assert m["pg_clipfrac"] == 0.0


def test_geo_mean_weights_are_the_geometric_mean_per_sequence():
    # weights (0.25, 1.0) on seq 0 -> sqrt(0.25 * 1) = 0.5; seq 1 -> 2 (its padding weight is ignored)
    w = torch.tensor([[0.25, 1.0], [2.0, 0.0]])
    loss, _, _ = _run("geo_mean", GM_OLD, GM_NEW, GM_ADV, GM_MASK, mode="seq-mean-token-mean", weights=w)
    tol = _tol(GM_OLD, GM_NEW, GM_ADV, GM_MASK, weights=w)
    assert loss.item() == pytest.approx((-0.5 * math.exp(0.15) + 2 * math.exp(-0.2)) / 2, abs=tol)


# --------------------------------------------------------------------------- dro
def test_dro_hand_values():
    # beta 0.5, log_prob -1, old -1.2 (log-ratio 0.2), A = 1:
    # loss = -(A log_prob - 0.5 beta 0.2^2) = -(-1 - 0.01) = 1.01; gradient -(A - beta * 0.2) = -0.9
    old, new, one = torch.tensor([[-1.2]]), torch.tensor([[-1.0]]), torch.ones(1, 1)
    loss, m, g = _run("dro", old, new, one, one)
    tol = _tol(old, new, one, one)
    assert loss.item() == pytest.approx(1.01, abs=tol)
    assert g.item() == pytest.approx(-0.9, abs=tol)
    assert m["ppo_kl"] == pytest.approx(-0.2, abs=tol)


# --------------------------------------------------------------------------- cispo
def test_cispo_keeps_the_gradient_of_clipped_tokens():
    # tok 1: r = 0.6 / 0.4 = 1.5 -> clamp 1.2 (detached); loss -1.2 * 1 * ln 0.6 = 0.612984,
    #        gradient -1.2 * A = -1.2 (the PPO clip would give 0 here)
    # tok 2: r = 1, A = -2: loss -1 * -2 * ln 0.5 = -1.386294, gradient +2
    # token-mean = (0.612984 - 1.386294) / 2; pg_clipfrac 1/2
    old = torch.tensor([[LN(0.4), LN(0.5)]])
    new = torch.tensor([[LN(0.6), LN(0.5)]])
    adv = torch.tensor([[1.0, -2.0]])
    loss, m, g = _run("cispo", old, new, adv, torch.ones(1, 2))
    tol = _tol(old, new, adv, torch.ones(1, 2))
    assert loss.item() == pytest.approx((-1.2 * LN(0.6) + 2 * LN(0.5)) / 2, abs=tol)
    torch.testing.assert_close(g, torch.tensor([[-0.6, 1.0]]), rtol=0, atol=tol)
    assert m["pg_clipfrac"] == pytest.approx(0.5)
    # the cispo preset's clip_ratio_low 10: no lower bound (r = 0.1 stays 0.1)
    old, new, one = torch.tensor([[LN(0.5)]]), torch.tensor([[LN(0.05)]]), torch.ones(1, 1)
    loss, m, _ = _run("cispo", old, new, one, one, config={"clip_ratio_low": 10.0, "clip_ratio_high": 0.2})
    assert loss.item() == pytest.approx(-0.1 * LN(0.05), abs=_tol(old, new, one, one)) and m["pg_clipfrac"] == 0.0


# --------------------------------------------------------------------------- dppo
# p_old, p, A per token:
#   1: 0.4 -> 0.5, A +1: TV 0.1 <= 0.2 in; r 1.25; loss -1.25 ln 0.5 = 0.866434, gradient -1.25
#   2: 0.4 -> 0.7, A +1: TV 0.3 > 0.2 out (v 0): loss 0, gradient 0;
#      binary KL 0.4 ln(0.4/0.7) + 0.6 ln(0.6/0.3) = 0.192042 <= 0.2: in for dppo_kl:
#      loss -1.75 ln 0.7 = 0.624179, gradient -1.75
#   3: 0.4 -> 0.1, A -1: TV -0.3 < -0.2 out; binary KL 0.4 ln 4 + 0.6 ln(0.6/0.9) = 0.311225 > 0.2
#      and p < p_old: out for dppo_kl too
#   4: 0.1 -> 0.5, A -1: moving up is allowed for A < 0 (TV 0.4 >= -0.2; dppo_kl: p >= p_old);
#      r = 5 truncated at clip_ratio_c 3: loss +3 ln 0.5 = -2.079442, gradient +3; pg_clipfrac_lower
DP_OLD = torch.tensor([[LN(0.4), LN(0.4), LN(0.4), LN(0.1)]])
DP_NEW = torch.tensor([[LN(0.5), LN(0.7), LN(0.1), LN(0.5)]])
DP_ADV = torch.tensor([[1.0, 1.0, -1.0, -1.0]])


def test_dppo_tv_hand_values():
    loss, m, g = _run("dppo_tv", DP_OLD, DP_NEW, DP_ADV, torch.ones(1, 4), mode="token-sum")
    tol = _tol(DP_OLD, DP_NEW, DP_ADV, torch.ones(1, 4))
    assert loss.item() == pytest.approx(-1.25 * LN(0.5) + 3 * LN(0.5), abs=tol)
    torch.testing.assert_close(g, torch.tensor([[-1.25, 0.0, 0.0, 3.0]]), rtol=0, atol=tol)
    assert m["pg_clipfrac"] == pytest.approx(0.5) and m["pg_clipfrac_lower"] == pytest.approx(0.25)


def test_dppo_kl_hand_values():
    assert 0.4 * LN(0.4 / 0.7) + 0.6 * LN(0.6 / 0.3) == pytest.approx(0.192042, abs=1e-6)
    loss, m, g = _run("dppo_kl", DP_OLD, DP_NEW, DP_ADV, torch.ones(1, 4), mode="token-sum")
    tol = _tol(DP_OLD, DP_NEW, DP_ADV, torch.ones(1, 4))
    assert loss.item() == pytest.approx(-1.25 * LN(0.5) - 1.75 * LN(0.7) + 3 * LN(0.5), abs=tol)
    torch.testing.assert_close(g, torch.tensor([[-1.25, -1.75, 0.0, 3.0]]), rtol=0, atol=tol)
    assert m["pg_clipfrac"] == pytest.approx(0.25) and m["pg_clipfrac_lower"] == pytest.approx(0.25)


# --------------------------------------------------------------------------- properties of every loss
def _batch(seed: int, B: int = 6, T: int = 5):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 1, 3, 0, 4, 2])[:B]  # a single token and an empty row
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    old = -torch.rand(B, T, generator=g) * 2 - 0.05
    new = (old + torch.randn(B, T, generator=g) * 0.3).clamp(max=-0.01)
    adv = torch.randn(B, 1, generator=g).expand(B, T) * mask
    w = torch.rand(B, T, generator=g) * 1.5 + 0.1
    return old, new, adv, mask, w


@pytest.mark.parametrize("weighted", [False, True], ids=["no-weights", "weights"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("name", NEW_LOSSES)
def test_micro_batches_with_the_global_normalizer_add_up(name, mode, weighted):
    old, new, adv, mask, w = _batch(1)
    weights = w if weighted else None
    loss, _, grad = _run(name, old, new, adv, mask, mode=mode, weights=weights)
    norm = agg_normalizer(mask, mode)
    total, grads = torch.zeros(()), torch.zeros_like(new)
    fn = rlplug.get_plugin("policy_loss", name)
    for rows in ([0, 1], [2], [3, 4, 5]):
        lp = new[rows].clone().requires_grad_(True)
        part, _ = fn(
            old[rows],
            lp,
            adv[rows],
            mask[rows],
            config=CFG,
            loss_agg_mode=mode,
            normalizer=norm,
            max_response_length=mask.shape[1],
            rollout_is_weights=None if weights is None else weights[rows],
        )
        part.backward()
        total, grads[rows] = total + part.detach(), lp.grad
    # the parts' sum against the whole: another summation order
    tol = _tol(old, new, adv, mask, weights)
    torch.testing.assert_close(total, loss, rtol=0, atol=tol)
    torch.testing.assert_close(grads, grad, rtol=0, atol=tol)
    assert bool(torch.isfinite(grad).all()) and bool((grad[mask == 0] == 0).all())


@pytest.mark.parametrize("name", NEW_LOSSES)
def test_padding_values_change_nothing_and_single_tokens_are_finite(name):
    old, new, adv, mask, w = _batch(2)
    base = _run(name, old, new, adv, mask, mode="seq-mean-token-mean", weights=w)
    pad = mask == 0
    garbage = [torch.where(pad, torch.full_like(t, v), t) for t, v in ((old, -1e4), (new, 30.0), (adv, 1e6))]
    w_garbage = torch.where(pad, torch.full_like(w, 1e9), w)
    noisy = _run(name, *garbage, mask, mode="seq-mean-token-mean", weights=w_garbage)
    tol = _tol(old, new, adv, mask, w)
    torch.testing.assert_close(base[0], noisy[0], rtol=0, atol=tol)
    torch.testing.assert_close(base[2], noisy[2], rtol=0, atol=tol)
    assert base[1] == noisy[1]
    # one token per sequence, far-apart log-probs
    one = _run(
        name,
        torch.tensor([[-15.0], [-0.1]]),
        torch.tensor([[-0.1], [-15.0]]),
        torch.tensor([[1.0], [-1.0]]),
        torch.ones(2, 1),
    )
    assert bool(torch.isfinite(one[0])) and bool(torch.isfinite(one[2]).all())
    assert all(math.isfinite(v) for v in one[1].values())


@pytest.mark.parametrize("name", NEW_LOSSES)
def test_unit_weights_change_nothing_and_weights_scale_the_token_losses(name):
    old, new, adv, mask, w = _batch(3)
    plain = _run(name, old, new, adv, mask, mode="token-mean")
    ones = _run(name, old, new, adv, mask, mode="token-mean", weights=torch.ones_like(mask))
    tol = _tol(old, new, adv, mask)
    torch.testing.assert_close(plain[0], ones[0], rtol=0, atol=tol)
    torch.testing.assert_close(plain[2], ones[2], rtol=0, atol=tol)
    if name != "geo_mean":  # per token: w * loss_t, so a constant weight c scales the loss by c
        half = _run(name, old, new, adv, mask, mode="token-mean", weights=torch.full_like(mask, 0.5))
        assert half[0].item() == pytest.approx(0.5 * plain[0].item(), abs=tol)


@pytest.mark.parametrize("name", NEW_LOSSES)
def test_conformance_kit(name):
    check_policy_loss(name, OmegaConf.structured(ActorConfig(dro_beta=0.1)))


def test_registered_with_descriptions():
    assert set(NEW_LOSSES) <= set(rlplug.plugin_names("policy_loss"))
    for name in NEW_LOSSES:
        assert rlplug.get_plugin("policy_loss", name).description


# --------------------------------------------------------------------------- validation and config
@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["actor.policy_loss=dro"], "actor.policy_loss=dro: actor.dro_beta is not set"),
        (
            ["actor.policy_loss=dro", "actor.dro_beta=0"],
            "actor.policy_loss=dro: actor.dro_beta = 0.0 but the dro policy loss needs it > 0",
        ),
        (
            ["actor.policy_loss=sapo", "actor.tau_neg=0"],
            "actor.policy_loss=sapo: actor.tau_neg = 0.0 but the sapo policy loss's gate",
        ),
        (
            ["actor.policy_loss=dppo_tv", "actor.clip_ratio_c=-1"],
            "actor.policy_loss=dppo_tv: actor.clip_ratio_c = -1.0 but the DPPO losses",
        ),
        (
            ["actor.policy_loss=dppo_kl", "actor.clip_ratio_c=0"],
            "actor.policy_loss=dppo_kl: actor.clip_ratio_c = 0.0 but the DPPO losses",
        ),
        (["actor.loss_scale_factor=0"], "actor.loss_scale_factor=0: it divides the seq-mean-token-sum-norm loss"),
    ],
)
def test_bad_hyperparameters_are_config_errors(overrides, expected):
    with pytest.raises(ConfigError) as info:
        validate_config(compose(overrides))
    assert str(info.value).startswith(expected), str(info.value)


def test_verl_defaults():
    a = ActorConfig()
    assert (a.tau_pos, a.tau_neg, a.dro_beta, a.loss_scale_factor) == (1.0, 1.05, None, None)
    validate_config(compose(["actor.policy_loss=dro", "actor.dro_beta=0.1", "actor.loss_agg_mode=token-sum"]))


@pytest.mark.parametrize("name", ["vanilla", "gspo"])
def test_loss_scale_factor_in_every_term_of_the_objective(name):
    # seq-mean-token-sum-norm divides by loss_scale_factor (4) instead of max_response_length (100):
    # the policy term, the entropy term and the KL term all scale by 100 / 4 alike
    old, new, adv, mask, _ = _batch(4)
    tensors = {"old_log_probs": old, "advantages": adv, "response_mask": mask, "ref_log_probs": old - 0.1}
    kl = rlplug.get_plugin("kl_penalty", "low_var_kl")
    out = {}
    for factor in (None, 4):
        cfg = {**CFG, "entropy_coeff": 0.01, "kl_loss_coef": 0.1, "loss_scale_factor": factor}
        out[factor] = actor_objective(
            new,
            torch.ones_like(new),
            tensors,
            policy_loss=rlplug.get_plugin("policy_loss", name),
            config=cfg,
            loss_agg_mode="seq-mean-token-sum-norm",
            normalizer=agg_normalizer(mask, "seq-mean-token-sum-norm"),
            max_response_length=100,
            kl_penalty=kl,
        )
    (l_none, p_none), (l_four, p_four) = out[None], out[4]
    # the same token sums divided by 4 or by 100 (not a power of two: rounded), then summed over the
    # 6 sequences and into the objective: a few terms at a sequence's magnitude (T tokens / 4)
    tol = fp32_atol(len(mask) + 3, _magnitude(old, new, adv, mask) * mask.shape[1] / 4)
    assert l_four.item() == pytest.approx(25 * l_none.item(), abs=tol)
    for key in ("pg_loss", "entropy", "kl_loss"):
        assert p_four[key] == pytest.approx(25 * p_none[key], abs=tol)


# --------------------------------------------------------------------------- presets
@pytest.mark.parametrize(
    "preset, loss, mode",
    [
        ("gspo", "gspo", "seq-mean-token-mean"),
        ("sapo", "sapo", "seq-mean-token-mean"),
        ("cispo", "cispo", "token-mean"),
        ("gpg", "gpg", "token-mean"),
        ("gmpo", "geo_mean", "seq-mean-token-mean"),
    ],
)
def test_presets_select_the_loss(preset, loss, mode):
    cfg = compose([f"algorithm={preset}"])
    assert (cfg.actor.policy_loss, cfg.actor.loss_agg_mode) == (loss, mode)
    validate_config(cfg)
