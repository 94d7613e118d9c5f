"""Policy loss plugins (vanilla PPO clip, dual clip): hand values, config forms, the dual-clip
bound, validation, micro-batch invariance for every aggregation mode, the registry."""

import math
from dataclasses import dataclass

import pytest
import torch
from _helpers import fp32_atol
from omegaconf import OmegaConf

import rlplug
from rlplug.algorithms.losses import LOSS_AGG_MODES, agg_loss, agg_normalizer
from rlplug.plugins.algorithms.policy_loss import dual_clip_policy_loss, vanilla_policy_loss

LN = math.log

pytestmark = pytest.mark.numerics

#: elementwise float32 operations per token (log-ratio, exp, clamps, products, max/min): with the
#: tokens a loss sums over, the n_terms of rlplug.testing.reduction_tolerance below
OPS = 6

# Four valid tokens (old log-prob 0, so ratio = exp(new)) and two padding tokens (garbage):
#   tok  ratio  A    L1=-A*r  L2=-A*clamp(r, .8, 1.2)  max     L2 > L1
#   1    1.5   +1    -1.5     -1.2                     -1.2    yes
#   2    0.5   +1    -0.5     -0.8                     -0.5    no
#   3    1.5   -1     1.5      1.2                      1.5    no
#   4    0.5   -1     0.5      0.8                      0.8    yes
# token-mean = (-1.2 - 0.5 + 1.5 + 0.8) / 4 = 0.15; pg_clipfrac = 2/4
# ppo_kl = mean(old - new) = -(2 ln 1.5 + 2 ln 0.5) / 4 = -0.5 ln 0.75
OLD = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, -3.0]])
NEW = torch.tensor([[LN(1.5), LN(0.5), 7.0], [LN(1.5), LN(0.5), 2.0]])
ADV = torch.tensor([[1.0, 1.0, 5.0], [-1.0, -1.0, -9.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])


@dataclass
class ActorCfg:
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0


CONFIG_FORMS = [
    {"clip_ratio": 0.2},
    ActorCfg(),
    OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": None, "clip_ratio_high": None, "clip_ratio_c": 3.0}),
    OmegaConf.structured(ActorCfg),
    None,  # all defaults
]


@pytest.mark.parametrize("config", CONFIG_FORMS, ids=["dict", "dataclass", "dictconfig", "structured", "none"])
def test_vanilla_hand_values(config):
    loss, metrics = vanilla_policy_loss(OLD, NEW, ADV, MASK, config=config, loss_agg_mode="token-mean", normalizer=4.0)
    tol = fp32_atol(4 + OPS, 1.5)  # 4 tokens, terms A r up to 1.5
    assert loss.item() == pytest.approx(0.15, abs=tol)
    assert metrics["pg_clipfrac"] == pytest.approx(0.5)
    assert metrics["pg_clipfrac_lower"] == 0.0
    assert metrics["ppo_kl"] == pytest.approx(-0.5 * LN(0.75), abs=tol)
    assert all(type(v) is float for v in metrics.values())


def test_vanilla_asymmetric_clip_and_seq_modes():
    # clip_ratio_low 0.1, clip_ratio_high 0.3: token 1: L2 = -1.3 > -1.5 -> -1.3; token 4: L2 = 0.9 -> 0.9
    # tokens 2, 3 unchanged (-0.5, 1.5): token-mean = (-1.3 - 0.5 + 1.5 + 0.9) / 4 = 0.15
    cfg = {"clip_ratio": 0.2, "clip_ratio_low": 0.1, "clip_ratio_high": 0.3}
    tol = fp32_atol(4 + OPS, 2 * 1.5)  # 4 tokens, terms A r up to 1.5, row sums of 2
    loss, _ = vanilla_policy_loss(OLD, NEW, ADV, MASK, config=cfg, loss_agg_mode="token-mean", normalizer=4.0)
    assert loss.item() == pytest.approx(0.15, abs=tol)
    # seq-mean-token-sum with the default clip: row sums -1.7 and 2.3 -> (-1.7 + 2.3) / 2 = 0.3
    loss, _ = vanilla_policy_loss(OLD, NEW, ADV, MASK, config=None, loss_agg_mode="seq-mean-token-sum", normalizer=2.0)
    assert loss.item() == pytest.approx(0.3, abs=tol)
    # seq-mean-token-sum-norm with max_response_length 10: (-0.17 + 0.23) / 2 = 0.03
    loss, _ = vanilla_policy_loss(
        OLD,
        NEW,
        ADV,
        MASK,
        config=None,
        loss_agg_mode="seq-mean-token-sum-norm",
        normalizer=2.0,
        max_response_length=10,
    )
    assert loss.item() == pytest.approx(0.03, abs=tol)


def test_dual_clip_hand_values():
    #   ratio  A    L1    L2 (clamp .8..1.2)  max(L1,L2)  A<0: min(., -A*3=3)   L2>L1  cap active
    #   5     -1    5     1.2                 5           3                     no     yes
    #   5     +1   -5    -1.2                -1.2         (A>0) -1.2            yes    no
    #   2     -1    2     1.2                 2           2                     no     no
    # token-mean = (3 - 1.2 + 2) / 3; pg_clipfrac = 1/3; pg_clipfrac_lower = 1/3
    old = torch.zeros(1, 4)
    new = torch.tensor([[LN(5.0), LN(5.0), LN(2.0), 0.0]])
    adv = torch.tensor([[-1.0, 1.0, -1.0, -100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, m = dual_clip_policy_loss(old, new, adv, mask, config=ActorCfg(), loss_agg_mode="token-mean", normalizer=3.0)
    tol = fp32_atol(3 + OPS, 5.0)  # 3 tokens, ratios up to 5
    assert loss.item() == pytest.approx(3.8 / 3, abs=tol)
    assert m["pg_clipfrac"] == pytest.approx(1 / 3)
    assert m["pg_clipfrac_lower"] == pytest.approx(1 / 3)
    assert m["ppo_kl"] == pytest.approx(-(2 * LN(5.0) + LN(2.0)) / 3, abs=tol)
    # vanilla on the same tokens has no cap: (5 - 1.2 + 2) / 3
    vloss, _ = vanilla_policy_loss(old, new, adv, mask, config=ActorCfg(), loss_agg_mode="token-mean", normalizer=3.0)
    assert vloss.item() == pytest.approx(5.8 / 3, abs=tol)


def test_dual_clip_bounded_by_minus_a_times_c():
    g = torch.Generator().manual_seed(5)
    n = 64
    old = torch.randn(n, 1, generator=g)
    new = old + torch.randn(n, 1, generator=g) * 4  # ratios from e^-12 to e^12
    adv = -torch.rand(n, 1, generator=g) * 3 - 0.01  # all negative
    mask = torch.ones(n, 1)
    c = 2.5
    # seq-mean-token-sum with normalizer 1 and one token per row: the loss is the sum of per-token
    # losses; the per-token loss of row i is its gradient-free contribution, obtained row by row
    per_token = torch.stack(
        [
            dual_clip_policy_loss(
                old[i : i + 1],
                new[i : i + 1],
                adv[i : i + 1],
                mask[i : i + 1],
                config={"clip_ratio_c": c},
                loss_agg_mode="seq-mean-token-sum",
                normalizer=1.0,
            )[0]
            for i in range(n)
        ]
    )
    bound = -adv[:, 0] * c
    assert (per_token <= bound + fp32_atol(1, bound)).all()  # the cap -A c: one rounding
    assert (per_token == bound).any()  # the cap is reached for some large ratios
    _, m = dual_clip_policy_loss(
        old, new, adv, mask, config={"clip_ratio_c": c}, loss_agg_mode="token-mean", normalizer=n
    )
    assert m["pg_clipfrac_lower"] == pytest.approx(float((per_token == bound).float().mean()), abs=1e-6)


@pytest.mark.parametrize("bad", [1.0, 0.5, -3.0])
def test_dual_clip_validate(bad):
    obj = rlplug.get_plugin("policy_loss", "dual_clip")
    with pytest.raises(ValueError) as e:
        obj.validate({"clip_ratio_c": bad})
    msg = str(e.value)
    assert str(bad) in msg and "> 1" in msg and "actor.clip_ratio_c" in msg
    with pytest.raises(ValueError, match="actor.clip_ratio_c"):
        obj(OLD, NEW, ADV, MASK, config={"clip_ratio_c": bad}, loss_agg_mode="token-mean", normalizer=4.0)
    obj.validate(OmegaConf.structured(ActorCfg))  # the default 3.0 is fine
    obj.validate({"clip_ratio_c": 1.0001})


def test_shape_mismatch_is_reported():
    with pytest.raises(ValueError, match="advantages"):
        vanilla_policy_loss(OLD, NEW, ADV[:, :2], MASK, config=None, loss_agg_mode="token-mean", normalizer=4.0)


@pytest.mark.parametrize("name", ["vanilla", "dual_clip"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batch_invariance(name, mode):
    """The gradient of one mini-batch equals the sum of the gradients of any split into
    micro-batches, each aggregated with the global normaliser."""
    loss_obj = rlplug.get_plugin("policy_loss", name)
    g = torch.Generator().manual_seed(11)
    B, T = 7, 6
    lengths = torch.tensor([6, 1, 0, 4, 3, 6, 2])  # ragged, with an empty response
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).float()
    old = torch.randn(B, T, generator=g) * 0.1 - 1
    new0 = old + torch.randn(B, T, generator=g) * 0.5  # part of the tokens clipped
    adv = torch.randn(B, T, generator=g) * mask
    cfg = {"clip_ratio": 0.2, "clip_ratio_c": 1.5}
    norm = agg_normalizer(mask, mode)
    splits = [[list(range(B))], [[0, 1, 2], [3], [4, 5, 6]], [[i] for i in range(B)], [[5, 0], [6, 2, 1, 4, 3]]]
    results = []
    for split in splits:
        new = new0.clone().requires_grad_(True)
        total = torch.zeros(())
        for rows in split:
            idx = torch.tensor(rows)
            loss, _ = loss_obj(
                old[idx],
                new[idx],
                adv[idx],
                mask[idx],
                config=cfg,
                loss_agg_mode=mode,
                normalizer=norm,
                max_response_length=T,
            )
            total = total + loss
        total.backward()
        results.append((total.item(), new.grad.clone()))
    full_loss, full_grad = results[0]
    assert full_grad.abs().sum() > 0
    assert torch.equal(full_grad[mask == 0], torch.zeros(int((mask == 0).sum())))
    # the splits sum the same per-token terms in another order: the loss to the rounding of that
    # reduction at the mode's aggregation of |A| max(r, 1.2) (Higham's sum |x_i|); each gradient
    # entry is its own token's few operations
    terms = adv.abs() * torch.exp(new0 - old).clamp(min=1.2) * mask
    tol = fp32_atol(B * T + OPS, agg_loss(terms, mask, mode, norm, max_response_length=T))
    for loss, grad in results[1:]:
        assert loss == pytest.approx(full_loss, abs=tol)
        torch.testing.assert_close(grad, full_grad, rtol=0, atol=fp32_atol(OPS, full_grad))


def test_registry_lists_policy_losses():
    reg = rlplug.get_registry()
    assert {"vanilla", "dual_clip"} <= set(reg.names("policy_loss"))
    for name in ("vanilla", "dual_clip"):
        obj = reg.get("policy_loss", name)
        assert isinstance(obj, rlplug.PolicyLoss)
        assert reg.registration("policy_loss", name).distribution == "rlplug"
    assert reg.get("policy_loss", "vanilla").validate is None
