"""KL coefficient controllers: fixed, adaptive (Ziegler et al. 2019) vs hand-computed values,
state save/restore, the factory and its errors."""

import json

import pytest
from omegaconf import OmegaConf

from rlplug.algorithms.kl_control import AdaptiveKLController, FixedKLController, make_kl_controller
from rlplug.config.schema import KLControlConfig


def test_fixed_controller_never_moves():
    c = FixedKLController(0.05)
    for kl in (0.0, 1.0, 100.0):
        c.update(kl, n_steps=512)
    assert c.value == 0.05
    d = FixedKLController(1.0)
    d.load_state_dict(c.state_dict())
    assert d.value == 0.05


def test_adaptive_controller_hand_values():
    c = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.05, horizon=1000)
    # kl 0.06: err = clip(0.06/0.05 - 1 = 0.2, -0.2, 0.2) = 0.2; beta *= 1 + 0.2*64/1000 = 1.0128
    c.update(0.06, n_steps=64)
    assert c.value == pytest.approx(0.1 * 1.0128)
    # kl 0.5: 0.5/0.05 - 1 = 9, clipped to 0.2; beta *= 1.0128 again
    c.update(0.5, n_steps=64)
    assert c.value == pytest.approx(0.1 * 1.0128**2)
    # kl 0: err = -1 clipped to -0.2; beta *= 1 - 0.2*100/1000 = 0.98
    c.update(0.0, n_steps=100)
    assert c.value == pytest.approx(0.1 * 1.0128**2 * 0.98)
    # kl 0.045: err = 0.9 - 1 = -0.1 (inside the clip); beta *= 1 - 0.1*10/1000 = 0.999
    c.update(0.045, n_steps=10)
    assert c.value == pytest.approx(0.1 * 1.0128**2 * 0.98 * 0.999)
    # at the target: err = 0, unchanged
    before = c.value
    c.update(0.05, n_steps=1000)
    assert c.value == pytest.approx(before)


def test_adaptive_state_save_restore():
    c = AdaptiveKLController(0.2, target_kl=0.1, horizon=500)
    for kl in (0.3, 0.05, 0.12):
        c.update(kl, n_steps=32)
    state = json.loads(json.dumps(c.state_dict()))  # JSON-serialisable
    restored = AdaptiveKLController(0.9, target_kl=0.1, horizon=500)
    restored.load_state_dict(state)
    assert restored.value == c.value
    for kl in (0.01, 0.4):
        c.update(kl, n_steps=16)
        restored.update(kl, n_steps=16)
    assert restored.value == c.value
    with pytest.raises(ValueError, match="fixed"):
        FixedKLController(0.1).load_state_dict(state)


def test_adaptive_settings_come_from_the_config_on_resume(caplog):
    saved = AdaptiveKLController(0.2, target_kl=0.1, horizon=500).state_dict()
    restored = AdaptiveKLController(0.9, target_kl=0.05, horizon=1000)  # the config changed since
    with caplog.at_level("WARNING"):
        restored.load_state_dict(saved)
    assert restored.value == 0.2 and restored.target == 0.05 and restored.horizon == 1000
    assert "target_kl is 0.05 in the config but 0.1 in the checkpoint" in caplog.text
    # value 0.2, kl 0.1 vs target 0.05: err = clip(0.1/0.05 - 1, -.2, .2) = 0.2; 0.2 * (1 + 0.2 * 100/1000) = 0.204
    restored.update(0.1, n_steps=100)
    assert restored.value == pytest.approx(0.204)


@pytest.mark.parametrize(
    "cfg",
    [
        {"type": "adaptive", "kl_coef": 0.1, "target_kl": 0.05, "horizon": 1000},
        KLControlConfig(type="adaptive", kl_coef=0.1, target_kl=0.05, horizon=1000),
        OmegaConf.structured(KLControlConfig(type="adaptive", kl_coef=0.1, target_kl=0.05, horizon=1000)),
    ],
    ids=["dict", "dataclass", "dictconfig"],
)
def test_factory_adaptive(cfg):
    c = make_kl_controller(cfg)
    assert isinstance(c, AdaptiveKLController)
    c.update(0.06, n_steps=64)
    assert c.value == pytest.approx(0.1 * 1.0128)


def test_factory_fixed_and_defaults():
    c = make_kl_controller(KLControlConfig())
    assert isinstance(c, FixedKLController) and c.value == 0.001
    assert make_kl_controller({"kl_coef": 0.3}).value == 0.3


@pytest.mark.parametrize("horizon", [0, -5])
def test_factory_rejects_bad_horizon(horizon):
    with pytest.raises(ValueError, match="horizon"):
        make_kl_controller({"type": "adaptive", "horizon": horizon})


def test_factory_rejects_bad_target_and_unknown_type():
    with pytest.raises(ValueError, match="target_kl"):
        make_kl_controller({"type": "adaptive", "target_kl": 0.0})
    with pytest.raises(ValueError) as e:
        make_kl_controller({"type": "adaptve"})
    assert "adaptve" in str(e.value) and "fixed" in str(e.value) and "adaptive" in str(e.value)
