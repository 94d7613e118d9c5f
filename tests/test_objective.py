"""rlplug.algorithms.objective: the actor and critic objectives as pure tensor functions.

Hand values (derivations in the comments), the truncated-IS weights' single owner (the objective
computes them, the policy loss applies them), ``PolicyLoss.requires``, and bitwise equivalence
with the micro-batch loss the ``local`` backend computed before the objective moved to core.
"""

from __future__ import annotations

import math

import pytest
import torch
from _helpers import fp32_atol

import rlplug
from rlplug.algorithms.losses import agg_loss, agg_normalizer, masked_mean, value_loss
from rlplug.algorithms.objective import actor_input_fields, actor_objective, critic_objective, truncated_is_weights
from rlplug.contracts.types import MissingInputError, PolicyLoss

LN = math.log

pytestmark = pytest.mark.numerics

#: elementwise float32 operations per token (log-ratio, exp, clamp, products, the KL): with the
#: valid tokens a mean sums over, the n_terms of rlplug.testing.reduction_tolerance below. Exact
#: sums of small binary fractions keep pytest.approx's default.
OPS = 6

# The four valid tokens of tests/test_policy_loss.py (old log-prob 0, so ratio = exp(new)) and two
# padding tokens (garbage):
#   tok  ratio  A    L1=-A*r  L2=-A*clamp(r, .8, 1.2)  max(L1, L2)
#   1    1.5   +1    -1.5     -1.2                     -1.2
#   2    0.5   +1    -0.5     -0.8                     -0.5
#   3    1.5   -1     1.5      1.2                      1.5
#   4    0.5   -1     0.5      0.8                      0.8
# token-mean pg_loss = (-1.2 - 0.5 + 1.5 + 0.8) / 4 = 0.15
OLD = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, -3.0]])
NEW = torch.tensor([[LN(1.5), LN(0.5), 7.0], [LN(1.5), LN(0.5), 2.0]])
ADV = torch.tensor([[1.0, 1.0, 5.0], [-1.0, -1.0, -9.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
ENT = torch.tensor([[1.0, 2.0, 50.0], [3.0, 4.0, -50.0]])  # valid mean 2.5
REF = torch.tensor([[LN(1.5), LN(0.5), 0.0], [LN(1.5) - 1.0, LN(0.5) + 1.0, 0.0]])  # ref - new: 0, 0, -1, +1


def _vanilla():
    return rlplug.get_plugin("policy_loss", "vanilla")


def _tensors(**extra):
    return {"old_log_probs": OLD, "advantages": ADV, "response_mask": MASK, **extra}


# --------------------------------------------------------------------------- hand values
def test_actor_objective_hand_values_with_kl_and_entropy():
    # entropy bonus: coeff 0.1 x token-mean entropy 2.5 = 0.25.
    # KL loss "kl" (k1 = log_probs - ref_log_probs): per valid token 0, 0, 1, -1 -> mean 0;
    # "abs" (|k1|): 0, 0, 1, 1 -> mean 0.5, coefficient 0.4 -> 0.2.
    # loss = 0.15 - 0.25 + 0.2 = 0.1
    kl = rlplug.get_plugin("kl_penalty", "abs")
    cfg = {"clip_ratio": 0.2, "entropy_coeff": 0.1, "kl_loss_coef": 0.4}
    loss, parts = actor_objective(
        NEW,
        ENT,
        _tensors(ref_log_probs=REF),
        policy_loss=_vanilla(),
        config=cfg,
        loss_agg_mode="token-mean",
        normalizer=4.0,
        kl_penalty=kl,
    )
    tol = fp32_atol(4 + OPS, ENT * MASK, 1.5)  # 4 tokens; entropies up to 4, ratios up to 1.5
    assert loss.item() == pytest.approx(0.1, abs=tol)
    assert parts["pg_loss"] == pytest.approx(0.15, abs=tol)
    assert parts["entropy"] == pytest.approx(2.5, abs=tol)
    assert parts["kl_loss"] == pytest.approx(0.5, abs=tol)
    # masked means (the loop weights them by the micro-batch's token share): clipfrac 2/4,
    # ppo_kl = mean(old - new) = -(2 ln 1.5 + 2 ln 0.5) / 4
    assert parts["mean:pg_clipfrac"] == pytest.approx(0.5)
    assert parts["mean:pg_clipfrac_lower"] == 0.0
    assert parts["mean:ppo_kl"] == pytest.approx(-0.5 * LN(0.75), abs=tol)
    assert "mean:rollout_is_weight" not in parts
    assert set(parts) == {"pg_loss", "entropy", "kl_loss", "mean:pg_clipfrac", "mean:pg_clipfrac_lower", "mean:ppo_kl"}
    assert all(type(v) is float for v in parts.values())


def test_actor_objective_gradient_and_half_normalizer():
    # normalizer 8 (this micro-batch is half of a mini-batch with 8 valid tokens): every term halves.
    # d loss / d new for token 2 (ratio 0.5, A = +1, unclipped: L1 = -A r): -A * r / 8 = -0.0625;
    # token 1 is clipped (L2 is constant in new): gradient 0; padding: 0.
    new = NEW.clone().requires_grad_(True)
    loss, parts = actor_objective(
        new,
        None,
        _tensors(),
        policy_loss=_vanilla(),
        config={"clip_ratio": 0.2},
        loss_agg_mode="token-mean",
        normalizer=8.0,
    )
    # 4 tokens of ratios up to 1.5 over 8; each gradient entry its own token's few operations
    assert loss.item() == pytest.approx(0.075, abs=fp32_atol(4 + OPS, 1.5 / 8)) and "entropy" not in parts
    loss.backward()
    assert new.grad[0, 1].item() == pytest.approx(-0.0625, abs=fp32_atol(OPS, 0.5 / 8))
    assert new.grad[0, 0].item() == 0.0 and new.grad[0, 2].item() == 0.0 and new.grad[1, 2].item() == 0.0


def test_on_policy_reuse_uses_the_detached_log_probs():
    # without old_log_probs: old = new.detach(), so ratio = 1 everywhere, nothing is clipped,
    # ppo_kl = 0 and pg_loss = mean(-A) = -(1 + 1 - 1 - 1) / 4 = 0; d loss / d new = -A / 4.
    new = NEW.clone().requires_grad_(True)
    tensors = {"advantages": ADV, "response_mask": MASK}
    loss, parts = actor_objective(
        new,
        None,
        tensors,
        policy_loss=_vanilla(),
        config={},
        loss_agg_mode="token-mean",
        normalizer=4.0,
        on_policy_reuse=True,
    )
    assert parts["pg_loss"] == 0.0 and parts["mean:ppo_kl"] == 0.0 and parts["mean:pg_clipfrac"] == 0.0
    loss.backward()
    torch.testing.assert_close(new.grad, -ADV * MASK / 4)
    with pytest.raises(MissingInputError, match="'old_log_probs'.*old-log-prob pass"):
        actor_objective(
            NEW, None, tensors, policy_loss=_vanilla(), config={}, loss_agg_mode="token-mean", normalizer=4.0
        )


def test_entropy_coeff_without_entropy_is_an_error():
    with pytest.raises(ValueError, match="entropy_coeff = 0.01 but no entropy"):
        actor_objective(
            NEW,
            None,
            _tensors(),
            policy_loss=_vanilla(),
            config={"entropy_coeff": 0.01},
            loss_agg_mode="token-mean",
            normalizer=4.0,
        )


def test_critic_objective_hand_values():
    # the tokens of test_losses.test_value_loss_hand_values: per-token losses 0.5, 1.125 (clipped),
    # 0.5 -> token-mean (0.5 + 1.125 + 0.5) / 3; clipfrac 1/3
    values = torch.tensor([[1.0, 1.0], [2.0, 99.0]])
    tensors = {
        "values": torch.tensor([[0.0, 0.0], [2.0, -50.0]]),
        "returns": torch.tensor([[0.0, 2.0], [3.0, 7.0]]),
        "response_mask": torch.tensor([[1.0, 1.0], [1.0, 0.0]]),
    }
    loss, parts = critic_objective(values, tensors, cliprange_value=0.5, loss_agg_mode="token-mean", normalizer=3.0)
    assert loss.item() == pytest.approx((0.5 + 1.125 + 0.5) / 3)
    assert parts == {"vf_loss": pytest.approx((0.5 + 1.125 + 0.5) / 3), "mean:vf_clipfrac": pytest.approx(1 / 3)}
    with pytest.raises(MissingInputError, match="'returns'"):
        critic_objective(
            values,
            {k: v for k, v in tensors.items() if k != "returns"},
            cliprange_value=0.5,
            loss_agg_mode="token-mean",
            normalizer=3.0,
        )


# --------------------------------------------------------------------------- truncated IS
def test_truncated_is_weights_hand_values():
    # old - rollout = ln 0.5 -> 0.5; ln 4 -> 4, capped at 2; 30 -> clamp 20 -> e^20, capped at 2;
    # -30 -> clamp -20 -> e^-20 (never 0)
    old = torch.zeros(1, 4, requires_grad=True)
    rollout = torch.tensor([[-LN(0.5), -LN(4.0), -30.0, 30.0]])
    w = truncated_is_weights(old, rollout, 2.0)
    torch.testing.assert_close(w, torch.tensor([[0.5, 2.0, 2.0, math.exp(-20.0)]]))
    assert not w.requires_grad


def test_the_objective_passes_tis_weights_to_the_loss_and_does_not_scale_advantages():
    seen = {}

    def recording_loss(
        old_log_probs,
        log_probs,
        advantages,
        response_mask,
        *,
        config,
        loss_agg_mode,
        normalizer,
        max_response_length=None,
        rollout_is_weights=None,
    ):
        seen.update(advantages=advantages, weights=rollout_is_weights)
        return (log_probs * response_mask).sum() * 0.0, {"ppo_kl": 0.0}

    # rollout = old - ln 0.5 on row 0 (weight 0.5) and old - ln 4 on row 1 (weight 4, capped at 3)
    rollout = OLD - torch.tensor([[LN(0.5)], [LN(4.0)]])
    _, parts = actor_objective(
        NEW,
        None,
        _tensors(rollout_log_probs=rollout),
        policy_loss=PolicyLoss(recording_loss),
        config={"rollout_is_threshold": 3.0},
        loss_agg_mode="token-mean",
        normalizer=4.0,
    )
    assert seen["advantages"] is ADV  # untouched: the loss applies the weights
    torch.testing.assert_close(seen["weights"], torch.tensor([[0.5, 0.5, 0.5], [3.0, 3.0, 3.0]]))
    # masked mean over the 4 valid tokens: (0.5 + 0.5 + 3 + 3) / 4
    assert parts["mean:rollout_is_weight"] == pytest.approx(1.75)
    seen.clear()
    actor_objective(
        NEW,
        None,
        _tensors(rollout_log_probs=rollout),
        policy_loss=PolicyLoss(recording_loss),
        config={},
        loss_agg_mode="token-mean",
        normalizer=4.0,
    )
    assert seen["weights"] is None  # no threshold: no weights, whatever the batch holds
    with pytest.raises(MissingInputError, match="'rollout_log_probs'.*rollout.calculate_log_probs=true"):
        actor_objective(
            NEW,
            None,
            _tensors(),
            policy_loss=_vanilla(),
            config={"rollout_is_threshold": 2.0},
            loss_agg_mode="token-mean",
            normalizer=4.0,
        )


@pytest.mark.parametrize("name", ["vanilla", "dual_clip"])
def test_tis_in_the_loss_equals_the_old_advantage_scaling(name):
    """Weighting each token's loss (now) equals scaling the advantages by the weight (the local
    backend before): the weights are positive. Same loss and gradient up to rounding, same
    clip metrics."""
    g = torch.Generator().manual_seed(3)
    B, T = 6, 5
    mask = (torch.arange(T)[None] < torch.tensor([5, 1, 3, 0, 4, 2])[:, None]).float()
    old = torch.randn(B, T, generator=g) * 0.3 - 1
    new0 = old + torch.randn(B, T, generator=g) * 0.5
    adv = torch.randn(B, T, generator=g) * 2 * mask
    rollout = old + torch.randn(B, T, generator=g)
    cfg = {"clip_ratio": 0.2, "clip_ratio_c": 2.0, "rollout_is_threshold": 1.5}
    w = truncated_is_weights(old, rollout, 1.5)
    loss_obj = rlplug.get_plugin("policy_loss", name)
    for mode in ("token-mean", "seq-mean-token-mean"):
        norm = agg_normalizer(mask, mode)
        new = new0.clone().requires_grad_(True)
        loss, parts = actor_objective(
            new,
            None,
            {"old_log_probs": old, "advantages": adv, "response_mask": mask, "rollout_log_probs": rollout},
            policy_loss=loss_obj,
            config=cfg,
            loss_agg_mode=mode,
            normalizer=norm,
        )
        loss.backward()
        ref_new = new0.clone().requires_grad_(True)
        ref_loss, ref_m = loss_obj(old, ref_new, adv * w, mask, config=cfg, loss_agg_mode=mode, normalizer=norm)
        ref_loss.backward()
        # the same per-token terms in another order of products (w A r vs A w r): the mean over
        # the tokens at the magnitude of the inputs and of the terms
        terms = adv * w * torch.exp(new0 - old) * mask
        tol = fp32_atol(mask.numel() + OPS, terms, old * mask, new0 * mask)
        assert loss.item() == pytest.approx(ref_loss.item(), abs=tol)
        torch.testing.assert_close(new.grad, ref_new.grad, rtol=0, atol=tol)
        for key in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
            assert parts["mean:" + key] == pytest.approx(ref_m[key], abs=tol), key
        assert ref_m["pg_clipfrac"] > 0


def test_vanilla_and_dual_clip_weights_hand_values():
    # vanilla, weights 2, 0.5, 1, 1 on the four tokens: (2 * -1.2 + 0.5 * -0.5 + 1.5 + 0.8) / 4 = -0.0875
    w = torch.tensor([[2.0, 0.5, 7.0], [1.0, 1.0, 7.0]])
    loss, m = _vanilla()(
        OLD, NEW, ADV, MASK, config=None, loss_agg_mode="token-mean", normalizer=4.0, rollout_is_weights=w
    )
    assert loss.item() == pytest.approx(-0.0875, abs=fp32_atol(4 + OPS, 2.0 * 1.5))  # w A r up to 3
    assert m["pg_clipfrac"] == pytest.approx(0.5)  # the metrics use the unweighted terms
    # dual clip (c = 3): per-token losses 3 (capped), -1.2, 2 (tests/test_policy_loss.py), weights
    # 0.5, 2, 1: (1.5 - 2.4 + 2) / 3
    old, new = torch.zeros(1, 4), torch.tensor([[LN(5.0), LN(5.0), LN(2.0), 0.0]])
    adv, mask = torch.tensor([[-1.0, 1.0, -1.0, -100.0]]), torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    dual = rlplug.get_plugin("policy_loss", "dual_clip")
    loss, m = dual(
        old,
        new,
        adv,
        mask,
        config={"clip_ratio_c": 3.0},
        loss_agg_mode="token-mean",
        normalizer=3.0,
        rollout_is_weights=torch.tensor([[0.5, 2.0, 1.0, 9.0]]),
    )
    assert loss.item() == pytest.approx(1.1 / 3, abs=fp32_atol(3 + OPS, 2.0 * 5.0))  # w and r up to 2 and 5
    assert m["pg_clipfrac_lower"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="rollout_is_weights has shape"):
        _vanilla()(
            OLD, NEW, ADV, MASK, config=None, loss_agg_mode="token-mean", normalizer=4.0, rollout_is_weights=w[:, :2]
        )


# --------------------------------------------------------------------------- PolicyLoss.requires
def test_required_fields_reach_the_loss_as_keywords():
    seen = {}

    def entropy_loss(
        old_log_probs,
        log_probs,
        advantages,
        response_mask,
        *,
        config,
        loss_agg_mode,
        normalizer,
        max_response_length=None,
        rollout_is_weights=None,
        entropy,
    ):
        seen["entropy"] = entropy
        return agg_loss(-advantages * entropy, response_mask, loss_agg_mode, normalizer), {}

    obj = PolicyLoss(entropy_loss, requires=("entropy",))
    batch_entropy = torch.tensor([[1.0, 3.0, 0.0], [2.0, 2.0, 0.0]])
    # A = 1 on the valid tokens, whose batch entropies are 1, 3, 2, 2: token-mean of -A * H = -8 / 4 = -2
    tensors = {"old_log_probs": OLD, "advantages": MASK.clone(), "response_mask": MASK, "entropy": batch_entropy}
    loss, parts = actor_objective(
        NEW, ENT, tensors, policy_loss=obj, config={}, loss_agg_mode="token-mean", normalizer=4.0
    )
    assert seen["entropy"] is batch_entropy  # the batch field, not the current entropy (ENT)
    assert parts["pg_loss"] == pytest.approx(-2.0)
    assert not any(k.startswith("mean:pg") for k in parts)  # the loss reported no clip metrics
    del tensors["entropy"]
    with pytest.raises(MissingInputError, match="'entropy'.*old-log-prob pass"):
        actor_objective(NEW, ENT, tensors, policy_loss=obj, config={}, loss_agg_mode="token-mean", normalizer=4.0)
    bad = PolicyLoss(entropy_loss, requires=("advantages",))
    with pytest.raises(ValueError, match=r"requires \['advantages'\], which the actor objective passes"):
        actor_objective(NEW, ENT, tensors, policy_loss=bad, config={}, loss_agg_mode="token-mean", normalizer=4.0)


def test_actor_input_fields():
    obj = PolicyLoss(lambda *a, **k: None, requires=("sum_pi_squared", "advantages"))
    assert actor_input_fields({}, obj) == (
        "input_ids",
        "attention_mask",
        "position_ids",
        "response_mask",
        "advantages",
        "old_log_probs",
        "sum_pi_squared",
    )
    kl = rlplug.get_plugin("kl_penalty", "kl")
    assert actor_input_fields({"rollout_is_threshold": 2.0}, _vanilla(), kl_penalty=kl, on_policy_reuse=True) == (
        "input_ids",
        "attention_mask",
        "position_ids",
        "response_mask",
        "advantages",
        "ref_log_probs",
        "rollout_log_probs",
    )


# --------------------------------------------------------------------------- the old closure, bitwise
def _old_local_micro_loss(log_probs, entropy, tensors, *, policy_loss, kl_loss, cfg, mode, normalizer, mrl, reuse):
    """The ``micro_loss`` of ``LocalTrainingBackend.update_actor`` before the objective moved to
    rlplug.algorithms.objective (commit 47749ff), verbatim but for the names; the reference for the
    no-TIS path, which must stay bitwise identical."""
    entropy_coeff = float(cfg.get("entropy_coeff", 0.0))
    kl_coef = float(cfg.get("kl_loss_coef", 0.0))
    mask = tensors["response_mask"]
    old_log_probs = log_probs.detach() if reuse else tensors["old_log_probs"]
    advantages = tensors["advantages"]
    parts = {}
    pg_loss, pg_metrics = policy_loss(
        old_log_probs,
        log_probs,
        advantages,
        mask,
        config=cfg,
        loss_agg_mode=mode,
        normalizer=normalizer,
        max_response_length=mrl,
    )
    entropy_agg = agg_loss(entropy if entropy_coeff else entropy.detach(), mask, mode, normalizer, mrl)
    loss = pg_loss - entropy_coeff * entropy_agg if entropy_coeff else pg_loss
    parts["pg_loss"] = float(pg_loss.detach())
    parts["entropy"] = float(entropy_agg.detach())
    for key in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
        if key in pg_metrics:
            parts["mean:" + key] = float(pg_metrics[key])
    if kl_loss is not None:
        kl = kl_loss(log_probs, tensors["ref_log_probs"])
        kl_agg = agg_loss(kl, mask, mode, normalizer, mrl)
        loss = loss + kl_coef * kl_agg
        parts["kl_loss"] = float(kl_agg.detach())
    return loss, parts


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("variant", ["kl+entropy", "plain", "reuse"])
@pytest.mark.parametrize("name", ["vanilla", "dual_clip"])
def test_no_tis_path_is_bitwise_the_old_backend_closure(mode, variant, name):
    g = torch.Generator().manual_seed(17)
    B, T = 5, 7
    mask = (torch.arange(T)[None] < torch.tensor([7, 2, 5, 1, 6])[:, None]).float()
    old = torch.randn(B, T, generator=g) * 0.5 - 2
    new0 = old + torch.randn(B, T, generator=g) * 0.4
    ent0 = torch.rand(B, T, generator=g) * 3
    tensors = {
        "old_log_probs": old,
        "advantages": torch.randn(B, T, generator=g) * mask,
        "response_mask": mask,
        "ref_log_probs": old + torch.randn(B, T, generator=g) * 0.2,
    }
    cfg = {"clip_ratio": 0.2, "clip_ratio_c": 2.5}
    kl = None
    if variant == "kl+entropy":
        cfg.update(entropy_coeff=0.013, kl_loss_coef=0.37)
        kl = rlplug.get_plugin("kl_penalty", "low_var_kl")
    loss_obj = rlplug.get_plugin("policy_loss", name)
    norm = agg_normalizer(mask, mode)
    results = []
    for fn in ("new", "old"):
        new, ent = new0.clone().requires_grad_(True), ent0.clone().requires_grad_(True)
        if fn == "new":
            loss, parts = actor_objective(
                new,
                ent,
                tensors,
                policy_loss=loss_obj,
                config=cfg,
                loss_agg_mode=mode,
                normalizer=norm,
                max_response_length=T,
                kl_penalty=kl,
                on_policy_reuse=variant == "reuse",
            )
        else:
            loss, parts = _old_local_micro_loss(
                new,
                ent,
                tensors,
                policy_loss=loss_obj,
                kl_loss=kl,
                cfg=cfg,
                mode=mode,
                normalizer=norm,
                mrl=T,
                reuse=variant == "reuse",
            )
        loss.backward()
        results.append((loss.detach(), parts, new.grad, ent.grad))
    (l_new, p_new, g_new, e_new), (l_old, p_old, g_old, e_old) = results
    assert torch.equal(l_new, l_old)
    assert p_new == p_old and list(p_new) == list(p_old)  # same values and the same key order
    assert torch.equal(g_new, g_old)
    assert (e_new is None and e_old is None) or torch.equal(e_new, e_old)
    assert masked_mean(g_new.abs(), mask) > 0


def test_critic_objective_is_value_loss():
    g = torch.Generator().manual_seed(2)
    mask = (torch.arange(4)[None] < torch.tensor([4, 1, 3])[:, None]).float()
    values, old, ret = (torch.randn(3, 4, generator=g) for _ in range(3))
    loss, parts = critic_objective(
        values,
        {"values": old, "returns": ret, "response_mask": mask},
        cliprange_value=0.2,
        loss_agg_mode="seq-mean-token-mean",
        normalizer=3.0,
    )
    ref, m = value_loss(
        values, old, ret, mask, cliprange_value=0.2, loss_agg_mode="seq-mean-token-mean", normalizer=3.0
    )
    assert torch.equal(loss, ref) and parts == {"vf_loss": float(ref), "mean:vf_clipfrac": m["vf_clipfrac"]}
