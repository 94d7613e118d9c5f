"""KL penalty plugins: hand values for every estimator, aliases, straight-through '+' variants,
the exact 'full' KL and the registry."""

import math

import pytest
import torch

import rlplug
from rlplug.plugins.kl import BASE_KL_NAMES, KL_NAMES, kl_penalty

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
    assert obj.needs_logits is False


def test_k3_clamps():
    # d = -30: x = clamp(30, -20, 20) = 20, e^20 - 21 > 10 -> 10
    # d = +30: x = -20, e^-20 + 20 - 1 = 19.000... > 10 -> 10
    # d = -2.5: x = 2.5, e^2.5 - 3.5 = 8.682... (inside the clamp)
    lp = torch.tensor([[-30.0, 30.0, -2.5]])
    out = kl_penalty("k3", lp, torch.zeros_like(lp))
    assert torch.allclose(out, torch.tensor([[10.0, 10.0, math.exp(2.5) - 3.5]]), atol=1e-5)


def test_full_hand_values_and_reference():
    # p = softmax(0, 0) = (1/2, 1/2), q = softmax(0, ln 3) = (1/4, 3/4):
    # KL = 1/2 ln(2) + 1/2 ln(2/3) = 1/2 ln(4/3)
    # p = (1, 0) [logit -inf], q = (1/2, 1/2): KL = ln 2 (the p = 0 entry contributes 0)
    # p = q = (1, 0) with -inf in both: 0, no NaN
    logits = torch.tensor([[[0.0, 0.0], [0.0, -float("inf")], [0.0, -float("inf")]]])
    ref_logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0], [0.0, -float("inf")]]])
    lp = torch.zeros(1, 3)
    out = kl_penalty("full", lp, lp, logits=logits, ref_logits=ref_logits)
    assert torch.allclose(out, torch.tensor([[0.5 * math.log(4 / 3), math.log(2.0), 0.0]]), atol=1e-6)
    # random logits: equals torch's kl_div(log q, log p, log_target) summed over V
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 4, 7, generator=g) * 3, torch.randn(2, 4, 7, generator=g) * 3
    ref = torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    got = rlplug.get_plugin("kl_penalty", "full")(torch.zeros(2, 4), torch.zeros(2, 4), logits=a, ref_logits=b)
    assert got.shape == (2, 4) and torch.allclose(got, ref, atol=1e-5)
    assert (got >= -1e-6).all()


def test_full_errors():
    with pytest.raises(ValueError, match="logits"):
        kl_penalty("full", LP, REF)
    with pytest.raises(ValueError, match=r"\(B, T, V\)"):
        kl_penalty("full", LP, REF, logits=torch.zeros(1, 2, 5), ref_logits=torch.zeros(1, 2, 5))


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
    kwargs = {}
    if base == "full":
        kwargs = {"logits": torch.randn(3, 5, 6, generator=g), "ref_logits": torch.randn(3, 5, 6, generator=g)}
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
    expected = {"k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl", "full"}
    expected |= {n + "+" for n in expected}
    assert expected <= names
    assert set(KL_NAMES) == expected
    for name in expected:
        obj = reg.get("kl_penalty", name)
        assert isinstance(obj, rlplug.KLPenalty)
        assert obj.needs_logits == name.startswith("full")
        assert reg.registration("kl_penalty", name).distribution == "rlplug"
