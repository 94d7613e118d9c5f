"""rlplug.testing.reduction_tolerance: hand values of the bound, and that it bounds real
differences between summation orders and kernels (and is not vacuous)."""

from __future__ import annotations

import math

import pytest
import torch

from rlplug.testing import reduction_tolerance

U32 = 2.0**-24  # unit roundoff of float32
U16 = 2.0**-8  # unit roundoff of bfloat16


def test_hand_values():
    # n < lam^2 = 100: Higham's worst case gamma_n = n u / (1 - n u), plus the result's rounding u,
    # twice (two evaluations)
    assert reduction_tolerance(torch.float32, 1) == pytest.approx(2 * (U32 / (1 - U32) + U32), rel=1e-12)
    assert reduction_tolerance(torch.float32, 30, 3.0) == pytest.approx(2 * (30 * U32 / (1 - 30 * U32) + U32) * 3.0)
    # n > lam^2: the probabilistic bound exp(lam sqrt(n) u + n u^2 / (1 - u)) - 1 is the smaller
    n = 10_000
    want = 2 * (math.expm1(10 * 100 * U32 + n * U32**2 / (1 - U32)) + U32)
    assert reduction_tolerance(torch.float32, n) == pytest.approx(want, rel=1e-12)
    assert want < 2 * (n * U32 / (1 - n * U32) + U32)  # below the worst case
    # lam sets the crossover: with lam = 2 the probabilistic bound is already the smaller at n = 30
    assert reduction_tolerance(torch.float32, 30, lam=2.0) == pytest.approx(
        2 * (math.expm1(2 * math.sqrt(30) * U32 + 30 * U32**2 / (1 - U32)) + U32), rel=1e-12
    )
    # bf16 terms accumulated in fp32: fp32's gamma plus bf16's rounding of the result
    assert reduction_tolerance(torch.bfloat16, 64, 2.0, accumulate_dtype=torch.float32) == pytest.approx(
        2 * (64 * U32 / (1 - 64 * U32) + U16) * 2.0
    )
    # linear in scale, zero for zero terms, float64 far tighter than float32
    assert reduction_tolerance(torch.float32, 50, torch.tensor(4.0)) == pytest.approx(
        4 * reduction_tolerance(torch.float32, 50)
    )
    assert reduction_tolerance(torch.float32, 50, 0.0) == 0.0
    assert reduction_tolerance(torch.float64, 50) < 1e-8 * reduction_tolerance(torch.float32, 50)


@pytest.mark.parametrize("n", [7, 100, 4097, 100_000])
def test_bounds_sums_in_any_order(n):
    # float32 sums of the same n terms in four orders (torch's vectorised sum, sequential, reversed
    # sequential, sorted by magnitude) stay within the tolerance of each other and of the float64 sum
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g) * 10
    tol = reduction_tolerance(torch.float32, n, x.abs().double().sum())
    exact = x.double().sum().item()
    seq = torch.cumsum(x, 0)[-1].item()  # left to right, one rounding per addition
    rev = torch.cumsum(x.flip(0), 0)[-1].item()
    small_first = torch.cumsum(x[x.abs().argsort()], 0)[-1].item()
    results = [x.sum().item(), seq, rev, small_first]
    for a in results:
        assert abs(a - exact) <= tol / 2  # one evaluation against the exact value: half the tolerance
        for b in results:
            assert abs(a - b) <= tol


def test_worst_case_accumulation_is_covered_for_short_sums():
    # sequential sums of n copies of float32(0.1): every rounding error has the same sign, the case
    # the probabilistic model does not cover; up to n = lam^2 the worst-case bound applies and holds
    for n in (10, 50, 100):
        x = torch.full((n,), 0.1)
        got = torch.cumsum(x, 0)[-1].item()
        exact = n * float(x[0])
        assert abs(got - exact) > 0  # the roundings are real
        assert abs(got - exact) <= reduction_tolerance(torch.float32, n, n * float(x[0])) / 2


@pytest.mark.parametrize("k", [16, 256, 4096])
def test_bounds_bf16_matmuls_against_fp32(k):
    # a bf16 matmul (fp32 accumulation, bf16 result) against the float64 product of the same
    # bf16-rounded inputs: within bf16's rounding of the result plus fp32's accumulation over K
    g = torch.Generator().manual_seed(k)
    a = torch.randn(32, k, generator=g).bfloat16()
    b = torch.randn(k, 24, generator=g).bfloat16()
    exact = a.double() @ b.double()
    got = (a @ b).double()
    scale = (a.double().abs() @ b.double().abs()).max()
    tol = reduction_tolerance(torch.bfloat16, k, scale, accumulate_dtype=torch.float32)
    assert (got - exact).abs().max().item() <= tol


def test_not_vacuous():
    # the tolerance is below what a typical bug changes: dropping any one of n = 4096 terms in
    # [0.5, 1.5) changes the sum by >= 0.5, while the tolerance for sum |x| ~ 4096 is ~0.31 in
    # float32 (2 lam sqrt(n) u relative); for the tiny model's chains (n ~ 1e3, values ~ 1) it is ~4e-5
    g = torch.Generator().manual_seed(0)
    x = torch.rand(4096, generator=g) + 0.5
    tol = reduction_tolerance(torch.float32, 4096, x.abs().sum())
    assert tol < float(x.min())
    assert reduction_tolerance(torch.float32, 1000, 1.0) < 5e-5


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dtype": torch.int64, "n_terms": 3}, r"dtype must be a floating torch\.dtype"),
        ({"dtype": "float32", "n_terms": 3}, r"dtype must be a floating torch\.dtype"),
        ({"dtype": torch.bfloat16, "n_terms": 3, "accumulate_dtype": torch.int32}, r"accumulate_dtype must be"),
        ({"dtype": torch.float32, "n_terms": 0}, r"n_terms must be an int >= 1"),
        ({"dtype": torch.float32, "n_terms": 2.5}, r"n_terms must be an int >= 1"),
        ({"dtype": torch.float32, "n_terms": 3, "scale": -1.0}, r"scale must be a finite number >= 0"),
        ({"dtype": torch.float32, "n_terms": 3, "scale": float("nan")}, r"scale must be a finite number >= 0"),
        ({"dtype": torch.float32, "n_terms": 3, "lam": 0.0}, r"lam must be > 0"),
        # bf16 accumulation over 10^4 terms: the rounding may be as large as the terms themselves
        ({"dtype": torch.bfloat16, "n_terms": 10_000}, r"no tolerance tells a bug from rounding.*accumulate_dtype"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        reduction_tolerance(**kwargs)
