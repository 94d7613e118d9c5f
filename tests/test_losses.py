"""rlplug.algorithms.losses: masked statistics, aggregation modes, value loss, entropy, token-level scores,
the in-reward KL penalty. Values are derived by hand in the comments."""

import math

import pytest
import torch
from _helpers import fp32_atol

from rlplug.algorithms.losses import (
    LOSS_AGG_MODES,
    agg_loss,
    agg_normalizer,
    apply_kl_penalty,
    compute_token_level_scores,
    entropy_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    seq_norm_length,
    value_loss,
)

pytestmark = pytest.mark.numerics

#: elementwise float32 operations per entry (differences, squares, products, exp/log, divisions):
#: with the entries a result sums over, the n_terms of rlplug.testing.reduction_tolerance below.
#: Sums of small integers and single roundings keep pytest.approx's default (rel 1e-6 > 16 u).
OPS = 5

X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
M = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def test_masked_statistics_hand_values():
    # valid entries 1, 2, 4: sum 7, mean 7/3
    assert masked_sum(X, M).item() == pytest.approx(7.0)
    assert masked_mean(X, M).item() == pytest.approx(7 / 3)
    # per row: (1+2)/2 = 1.5 and 4/1 = 4
    assert torch.allclose(masked_mean(X, M, dim=-1), torch.tensor([1.5, 4.0]))
    assert torch.allclose(masked_sum(X, M, dim=-1), torch.tensor([3.0, 4.0]))
    # deviations -4/3, -1/3, 5/3 -> squares sum 42/9; biased /3 = 14/9, unbiased /2 = 7/3
    # (float32: 3 entries, a few operations each, at the magnitude of the entries (4) and squares)
    tol = fp32_atol(3 + OPS, 4.0**2)
    assert masked_var(X, M, unbiased=True).item() == pytest.approx(7 / 3, abs=tol)
    assert masked_var(X, M, unbiased=False).item() == pytest.approx(14 / 9, abs=tol)
    w = masked_whiten(X, M)
    std = math.sqrt(7 / 3 + 1e-8)
    expected = torch.tensor([[(1 - 7 / 3) / std, (2 - 7 / 3) / std, 0.0], [(4 - 7 / 3) / std, 0.0, 0.0]])
    torch.testing.assert_close(w, expected, rtol=0, atol=tol / std)
    # shift_mean=False adds the mean back on valid entries only
    w2 = masked_whiten(X, M, shift_mean=False)
    torch.testing.assert_close(w2, expected + 7 / 3 * M, rtol=0, atol=tol / std + fp32_atol(1, 4.0))


def test_masked_statistics_ignore_garbage_and_empty_masks():
    x = X.clone()
    x[0, 2] = float("nan")
    x[1, 1] = float("inf")
    assert masked_sum(x, M).item() == pytest.approx(7.0)
    assert torch.isfinite(masked_whiten(x, M)).all()
    assert masked_whiten(x, M)[0, 2].item() == 0.0
    empty = torch.zeros_like(M)
    assert masked_mean(X, empty).item() == 0.0
    assert masked_var(X, empty).item() == 0.0
    assert torch.equal(masked_whiten(X, empty), torch.zeros_like(X))
    # one valid entry: unbiased variance undefined -> 0, whitened value 0
    one = torch.zeros_like(M)
    one[1, 0] = 1.0
    assert masked_var(X, one).item() == 0.0
    assert torch.equal(masked_whiten(X, one), torch.zeros_like(X))
    # row with no valid token: per-row mean 0, not NaN
    assert torch.equal(masked_mean(X, torch.tensor([[1.0, 0, 0], [0, 0, 0]]), dim=-1), torch.tensor([1.0, 0.0]))


def test_masked_whiten_matches_torch_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 9, generator=g) * 3 + 1
    m = (torch.rand(6, 9, generator=g) > 0.4).float()
    v = x[m.bool()]
    std = torch.sqrt(v.var(unbiased=True) + 1e-8)
    ref = (x - v.mean()) / std * m
    # another summation order over the 54 entries: the mean's and the variance's rounding at the
    # entries' (and their squares') magnitude, divided by the std
    tol = fp32_atol(x.numel() + OPS, x**2) / float(std)
    torch.testing.assert_close(masked_whiten(x, m), ref, rtol=0, atol=tol)


# ------------------------------------------------------------------ aggregation
L = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
LM = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    "mode,expected,norm",
    [
        # valid losses 1, 2, 4 over 3 tokens
        ("token-mean", 7 / 3, 3.0),
        # verl's token-sum: 1 + 2 + 4, never divided (the normaliser, 3 tokens, only says "not empty")
        ("token-sum", 7.0, 3.0),
        # sequence sums 3 and 4 over the 2 valid sequences (row 3 is empty and left out)
        ("seq-mean-token-sum", (3 + 4) / 2, 2.0),
        # per-sequence means 3/2 and 4/1 -> (1.5 + 4) / 2
        ("seq-mean-token-mean", (1.5 + 4) / 2, 2.0),
        # per-sequence sums / max_response_length 4 -> (0.75 + 1) / 2
        ("seq-mean-token-sum-norm", (3 / 4 + 4 / 4) / 2, 2.0),
    ],
)
def test_agg_loss_hand_values(mode, expected, norm):
    assert agg_normalizer(LM, mode) == norm
    got = agg_loss(L, LM, mode, agg_normalizer(LM, mode), max_response_length=4)
    assert got.item() == pytest.approx(expected)
    # normalizer=None means "this is the whole mini-batch"
    assert agg_loss(L, LM, mode, None, max_response_length=4).item() == pytest.approx(expected)
    # garbage on padding changes nothing
    garbage = L.clone()
    garbage[2] = float("nan")
    garbage[0, 2] = 1e30
    assert agg_loss(garbage, LM, mode, norm, max_response_length=4).item() == pytest.approx(expected)


def test_agg_loss_errors():
    with pytest.raises(ValueError) as e:
        agg_loss(L, LM, "seq-mean", 1.0)
    for mode in LOSS_AGG_MODES:
        assert mode in str(e.value)
    with pytest.raises(ValueError, match="seq-mean"):
        agg_normalizer(LM, "token_mean")
    with pytest.raises(ValueError, match="max_response_length"):
        agg_loss(L, LM, "seq-mean-token-sum-norm", 2.0)
    with pytest.raises(ValueError, match="normalizer"):
        agg_loss(L, LM, "token-mean", 0.0)
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        agg_loss(L, LM[:, :2], "token-mean", 1.0)
    assert agg_loss(L, torch.zeros_like(LM), "token-mean", None).item() == 0.0


def test_token_sum_ignores_the_normalizer():
    # any split of the mini-batch adds up to the sum over its valid tokens: 3 + 4
    assert agg_loss(L, LM, "token-sum", 123.0).item() == pytest.approx(7.0)
    parts = [agg_loss(L[rows], LM[rows], "token-sum", 3.0) for rows in ([0], [1, 2])]
    assert sum(p.item() for p in parts) == pytest.approx(7.0)


def test_loss_scale_factor_replaces_max_response_length():
    # seq-mean-token-sum-norm: sequence sums 3 and 4; divided by loss_scale_factor 2 -> (1.5 + 2) / 2
    assert seq_norm_length({"loss_scale_factor": 2}, 4) == 2.0
    assert seq_norm_length({"loss_scale_factor": None}, 4) == 4
    assert seq_norm_length(None, 4) == 4
    horizon = seq_norm_length({"loss_scale_factor": 2}, 4)
    assert agg_loss(L, LM, "seq-mean-token-sum-norm", 2.0, horizon).item() == pytest.approx(1.75)
    with pytest.raises(ValueError, match="actor.loss_scale_factor = 0 but it divides"):
        seq_norm_length({"loss_scale_factor": 0}, 4)
    with pytest.raises(ValueError, match="must be a positive integer"):
        seq_norm_length({"loss_scale_factor": 2.5}, 4)


def _ragged_mask(B, T, g, min_len=0):
    lengths = torch.randint(min_len, T + 1, (B,), generator=g)
    return (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).float()


SPLITS = [[[0, 1, 2, 3, 4, 5, 6]], [[0, 1, 2], [3], [4, 5, 6]], [[i] for i in range(7)], [[0, 1, 2, 3, 4, 5], [6]]]


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_value_loss_micro_batch_invariance(mode):
    g = torch.Generator().manual_seed(1)
    B, T = 7, 6
    mask = _ragged_mask(B, T, g)
    mask[3] = 0.0  # an empty response
    values = torch.randn(B, T, generator=g)
    old_values = values + 0.8 * torch.randn(B, T, generator=g)  # part of the tokens get clipped
    returns = torch.randn(B, T, generator=g)
    norm = agg_normalizer(mask, mode)
    grads = []
    losses = []
    for split in SPLITS:
        v = values.clone().requires_grad_(True)
        total = 0.0
        for rows in split:
            idx = torch.tensor(rows)
            loss, _ = value_loss(
                v[idx],
                old_values[idx],
                returns[idx],
                mask[idx],
                cliprange_value=0.5,
                loss_agg_mode=mode,
                normalizer=norm,
                max_response_length=T,
            )
            total = total + loss
        total.backward()
        losses.append(float(total.detach()))
        grads.append(v.grad.clone())
    # the splits sum the same per-token terms in another order: the loss to the rounding of that
    # reduction at the aggregated magnitude of the terms (the mode's aggregation of |term|, Higham's
    # sum |x_i|); each gradient entry is its own token's few operations
    v_clip = old_values + (values - old_values).clamp(-0.5, 0.5)
    terms = 0.5 * torch.maximum((values - returns) ** 2, (v_clip - returns) ** 2)
    scale = float(agg_loss(terms.abs(), mask, mode, norm, max_response_length=T))
    for loss, grad in zip(losses[1:], grads[1:]):
        assert loss == pytest.approx(losses[0], abs=fp32_atol(B * T + OPS, scale))
        torch.testing.assert_close(grad, grads[0], rtol=0, atol=fp32_atol(OPS, grads[0]))
    assert grads[0].abs().sum() > 0
    assert torch.equal(grads[0][mask == 0], torch.zeros(int((mask == 0).sum())))


def test_value_loss_hand_values():
    # token a: v=1, v_old=0, R=0 -> v_clip=0.5; (1-0)^2=1 vs 0.25 -> 0.5*1 = 0.5, not clipped
    # token b: v=1, v_old=0, R=2 -> v_clip=0.5; (1-2)^2=1 vs (0.5-2)^2=2.25 -> 1.125, clipped
    # token c: v=2, v_old=2, R=3 -> v_clip=2; 1 vs 1 -> 0.5, not clipped (equal is not >)
    # token d: padding (garbage)
    values = torch.tensor([[1.0, 1.0], [2.0, 99.0]])
    old = torch.tensor([[0.0, 0.0], [2.0, -50.0]])
    ret = torch.tensor([[0.0, 2.0], [3.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, m = value_loss(values, old, ret, mask, cliprange_value=0.5, loss_agg_mode="token-mean", normalizer=3.0)
    assert loss.item() == pytest.approx((0.5 + 1.125 + 0.5) / 3)
    assert m == {"vf_clipfrac": pytest.approx(1 / 3)}
    assert isinstance(m["vf_clipfrac"], float)
    # seq-mean-token-mean: row means (0.5+1.125)/2 and 0.5 -> (0.8125 + 0.5) / 2
    loss, _ = value_loss(
        values, old, ret, mask, cliprange_value=0.5, loss_agg_mode="seq-mean-token-mean", normalizer=2.0
    )
    assert loss.item() == pytest.approx((0.8125 + 0.5) / 2)
    with pytest.raises(ValueError, match="returns"):
        value_loss(values, old, ret[:, :1], mask, cliprange_value=0.5, loss_agg_mode="token-mean", normalizer=3.0)


# ------------------------------------------------------------------ entropy
def test_entropy_hand_values():
    logits = torch.tensor(
        [
            [0.0, 0.0, 0.0, 0.0],  # uniform over 4: ln 4
            [0.0, math.log(3.0), -float("inf"), -float("inf")],  # p = (1/4, 3/4): -(.25 ln .25 + .75 ln .75)
            [1000.0, 1000.0, -1000.0, -float("inf")],  # two equal huge logits: ln 2, no overflow
            [5.0, -float("inf"), -float("inf"), -float("inf")],  # deterministic: 0
        ]
    )
    h = entropy_from_logits(logits)
    expected = torch.tensor([math.log(4), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), math.log(2), 0.0])
    assert h.dtype == torch.float32 and h.shape == (4,)
    # float32: a log-sum-exp and a sum over 4 logits after the max is subtracted; terms p log p and
    # the log-normaliser at most ln 4
    torch.testing.assert_close(h, expected, rtol=0, atol=fp32_atol(4 + OPS, math.log(4)))


def test_entropy_matches_categorical_and_keeps_leading_dims():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 5, 11, generator=g, dtype=torch.float64) * 4
    h = entropy_from_logits(logits)
    ref = torch.distributions.Categorical(logits=logits).entropy()
    assert h.shape == (3, 5) and h.dtype == torch.float32
    # float32 against float64: a log-sum-exp and a sum over 11 logits, at the logits' magnitude
    torch.testing.assert_close(h.double(), ref, rtol=0, atol=fp32_atol(11 + OPS, logits))
    bf = entropy_from_logits(logits.to(torch.bfloat16))
    assert bf.dtype == torch.float32


# ------------------------------------------------------------------ token-level scores
def test_compute_token_level_scores():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    scores = torch.tensor([1.0, 2.0, 3.0, 4.0])
    out = compute_token_level_scores(scores, mask)
    # lengths 3, 1, 0, 4 -> positions 2, 0, none, 3
    expected = torch.zeros(4, 4)
    expected[0, 2], expected[1, 0], expected[3, 3] = 1.0, 2.0, 4.0
    assert torch.equal(out, expected)
    assert out.dtype == torch.float32
    assert torch.equal(compute_token_level_scores(scores, mask.bool()), expected)
    with pytest.raises(ValueError, match=r"\(B,\)"):
        compute_token_level_scores(scores[:3], mask)


# ------------------------------------------------------------------ KL in the reward
def test_apply_kl_penalty_hand_values():
    lp = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, 0.0, 0.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.0, 5.0], [-3.0, 9.0, 9.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    scores = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    k1 = lambda a, b: a - b  # noqa: E731
    rewards, metrics = apply_kl_penalty(scores, lp, ref, mask, 0.1, k1)
    # d = lp - ref = [[0.5, -1, x], [2, x, x], [x, x, x]]; rewards = scores - 0.1 * d on valid tokens
    expected = torch.tensor([[-0.05, 1.1, 0.0], [1.8, 0.0, 0.0], [0.0, 0.0, 0.0]])
    tol = fp32_atol(OPS, lp * mask, ref * mask, scores)  # a few float32 operations per token
    torch.testing.assert_close(rewards, expected, rtol=0, atol=tol)
    # per-sequence mean KL: (0.5 - 1)/2 = -0.25 and 2; the empty row is left out -> 0.875
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.875)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1
    # by registered name, through the registry
    rewards2, metrics2 = apply_kl_penalty(scores, lp, ref, mask, 0.1, "kl")
    torch.testing.assert_close(rewards2, expected, rtol=0, atol=tol)
    assert metrics2 == metrics
