"""KL penalty plugins: hand values for every estimator, aliases, straight-through '+' variants,
and the registry ('full' is not registered)."""

import math

import pytest
import torch

import rlplug
from rlplug.plugins.algorithms.kl import BASE_KL_NAMES, KL_NAMES, kl_penalty

# hand values through torch's float32 kernels; the tolerances (allclose's rtol 1e-5 plus atol) are
# above reduction_tolerance's bound for these few-term chains
pytestmark = pytest.mark.numerics

# d = log_probs - ref_log_probs = [1, 0, -2]
LP = torch.tensor([[0.0, -1.0, -2.0]])
REF = torch.tensor([[-1.0, -1.0, 0.0]])

HAND = {
    "k1": [1.0, 0.0, -2.0],
    "abs": [1.0, 0.0, 2.0],
    "k2": [0.5, 0.0, 2.0],  # 0.5 * d^2
    # x = -d = [-1, 0, 2]: exp(x) - x - 1 = [e^-1, 0, e^2 - 3]
    "k3": [math.exp(-1.0), 0.0, math.exp(2.0) - 3.0],
}
ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


@pytest.mark.parametrize("name", ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"])
def test_hand_values(name):
    expected = torch.tensor([HAND[ALIASES.get(name, name)]])
    assert torch.allclose(kl_penalty(name, LP, REF), expected, atol=1e-6)
    # the registered object gives the same, with the KLPenalty call signature
    obj = rlplug.get_plugin("kl_penalty", name)
    assert torch.allclose(obj(LP, REF), expected, atol=1e-6)


def test_k3_clamps():
    # d = -30: x = clamp(30, -20, 20) = 20, e^20 - 21 > 10 -> 10
    # d = +30: x = -20, e^-20 + 20 - 1 = 19.000... > 10 -> 10
    # d = -2.5: x = 2.5, e^2.5 - 3.5 = 8.682... (inside the clamp)
    lp = torch.tensor([[-30.0, 30.0, -2.5]])
    out = kl_penalty("k3", lp, torch.zeros_like(lp))
    assert torch.allclose(out, torch.tensor([[10.0, 10.0, math.exp(2.5) - 3.5]]), atol=1e-5)


def test_full_is_not_registered():
    # verl's exact vocabulary KL needs (B, T, V) logits of both models at once, which the chunked
    # log-prob pass never keeps: the name is not offered (docs/algorithms.md)
    assert "full" not in KL_NAMES and "full+" not in KL_NAMES
    with pytest.raises(ValueError, match="Unknown KL penalty 'full'"):
        kl_penalty("full", LP, REF)
    with pytest.raises(rlplug.UnknownPluginError, match="Unknown kl penalty 'full'"):
        rlplug.get_plugin("kl_penalty", "full")


def test_unknown_name_and_shape_errors():
    with pytest.raises(ValueError) as e:
        kl_penalty("k4", LP, REF)
    assert "k3" in str(e.value) and "low_var_kl+" in str(e.value)
    with pytest.raises(ValueError, match="ref_log_probs"):
        kl_penalty("k1", LP, REF[:, :2])


@pytest.mark.parametrize("base", BASE_KL_NAMES)
def test_straight_through_value_of_base_gradient_of_k2(base):
    g = torch.Generator().manual_seed(3)
    lp0 = torch.randn(3, 5, generator=g)
    ref0 = torch.randn(3, 5, generator=g)
    kwargs: dict = {}
    weights = torch.rand(3, 5, generator=g)

    lp = lp0.clone().requires_grad_(True)
    ref = ref0.clone().requires_grad_(True)
    plus = rlplug.get_plugin("kl_penalty", base + "+")(lp, ref, **kwargs)
    (plus * weights).sum().backward()

    # value: that of the base estimator
    assert torch.allclose(plus.detach(), kl_penalty(base, lp0, ref0, **kwargs), atol=1e-6)
    # gradient of k2 = 0.5 d^2: d/d(lp) = d, d/d(ref) = -d
    d = lp0 - ref0
    assert torch.allclose(lp.grad, weights * d, atol=1e-6)
    assert torch.allclose(ref.grad, -weights * d, atol=1e-6)


def test_registry_lists_every_kl_name():
    reg = rlplug.get_registry()
    names = set(reg.names("kl_penalty"))
    expected = {"k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"}
    expected |= {n + "+" for n in expected}
    assert expected <= names
    assert set(KL_NAMES) == expected
    for name in expected:
        obj = reg.get("kl_penalty", name)
        assert isinstance(obj, rlplug.KLPenalty)
        assert reg.registration("kl_penalty", name).distribution == "rlplug"
