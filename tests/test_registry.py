"""The plugin registry: registration, conflicts, unknown names, entry points, broken plugins,
misspelled hooks and RLPLUG_DISABLE_PLUGINS."""

from __future__ import annotations

import sys
import tomllib
import types
from pathlib import Path

import pluggy
import pytest

import rlplug
from rlplug.contracts.registry import (
    KINDS,
    PluginConflictError,
    PluginLoadError,
    Registry,
    UnknownKindError,
    UnknownPluginError,
    get_registry,
    plugin_names,
)
from rlplug.contracts.types import AdvantageEstimator

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
BROKEN = FIXTURES / "broken_plugin"
MISSPELLED = FIXTURES / "misspelled_plugin"


def make_plugin(**hooks):
    """A plugin object whose attributes are hook implementations (like a plugin module)."""
    return types.SimpleNamespace(**{name: rlplug.hookimpl(fn) for name, fn in hooks.items()})


def registering(kind_hook: str, *names: str, obj=None):
    """A plugin registering ``names`` through the hook ``kind_hook``."""

    def hook(register):
        for n in names:
            register(n, obj if obj is not None else f"object {n}")

    return make_plugin(**{kind_hook: hook})


@pytest.fixture
def fixture_dists(monkeypatch):
    """Put the broken and misspelled fixture distributions on sys.path for one test."""
    monkeypatch.syspath_prepend(str(BROKEN))
    monkeypatch.syspath_prepend(str(MISSPELLED))
    yield
    for mod in ("rlplug_broken_plugin", "rlplug_misspelled_plugin"):
        sys.modules.pop(mod, None)


# ============================================================================ registration


def test_register_and_lookup(rlplug_registry):
    est = AdvantageEstimator(fn=lambda data, config: None, requires=("index",), group_based=True)
    rlplug_registry.register("advantage_estimator", "mine", est, distribution="my-dist", version="1.2")
    assert rlplug_registry.get("advantage_estimator", "mine") is est
    reg = rlplug_registry.registration("advantage_estimator", "mine")
    assert (reg.kind, reg.name, reg.distribution, reg.version) == ("advantage_estimator", "mine", "my-dist", "1.2")
    # the fixture installed this registry process-wide
    assert get_registry() is rlplug_registry
    assert plugin_names("advantage_estimator") == ["mine"]
    assert rlplug.get_plugin("advantage_estimator", "mine") is est
    assert plugin_names("policy_loss") == []


class _NullTracker:
    """A tracker that conforms to rlplug.contracts.types.Tracker (the registry checks it when resolved)."""

    def __init__(self, config=None): ...
    def log_params(self, params): ...  # noqa: E704
    def log_metrics(self, metrics, step): ...  # noqa: E704
    def log_table(self, name, rows, step): ...  # noqa: E704
    def log_artifact(self, path, artifact_path=None): ...  # noqa: E704
    def close(self, status="FINISHED"): ...  # noqa: E704


def test_add_plugin_records_distribution_and_hooks(rlplug_registry):
    plugin = make_plugin(
        register_reward_functions=lambda register: (register("r1", len), register("r2", max)),
        register_trackers=lambda register: register("t1", _NullTracker),
    )
    assert rlplug_registry.add_plugin(plugin, name="p", distribution="dist-p", version="0.3")
    assert rlplug_registry.names("reward_function") == ["r1", "r2"]
    assert rlplug_registry.get("reward_function", "r2") is max
    assert rlplug_registry.get("tracker", "t1") is _NullTracker
    info = rlplug_registry.plugins[-1]
    assert (info.name, info.distribution, info.version) == ("p", "dist-p", "0.3")
    assert info.hooks == ["register_reward_functions", "register_trackers"]
    desc = rlplug_registry.describe()
    assert desc["distributions"]["dist-p"] == {
        "version": "0.3",
        "plugins": ["p"],
        "registers": {"reward_function": ["r1", "r2"], "tracker": ["t1"]},
    }
    assert desc["broken"] == [] and desc["conflicts"] == []


def test_direct_register_collision_names_both_distributions(rlplug_registry):
    rlplug_registry.register("policy_loss", "vanilla", object(), distribution="rlplug")
    with pytest.raises(PluginConflictError) as info:
        rlplug_registry.register("policy_loss", "vanilla", object(), distribution="other-dist")
    msg = str(info.value)
    assert "policy loss name 'vanilla'" in msg and "by rlplug and by other-dist" in msg
    assert (info.value.first, info.value.second) == ("rlplug", "other-dist")


def test_collision_between_plugins(rlplug_registry):
    a = registering("register_kl_penalties", "k1", "shared")
    b = registering("register_kl_penalties", "shared", "k9")
    assert rlplug_registry.add_plugin(a, name="a", distribution="dist-a", version="1.0")
    assert rlplug_registry.add_plugin(b, name="b", distribution="dist-b", version="2.0")
    # the contested name is unusable (neither silently wins), the others stay available
    assert rlplug_registry.names("kl_penalty") == ["k1", "k9"]
    with pytest.raises(PluginConflictError) as info:
        rlplug_registry.get("kl_penalty", "shared")
    assert "dist-a" in str(info.value) and "dist-b" in str(info.value)
    assert "RLPLUG_DISABLE_PLUGINS" in str(info.value)
    # a third registration of the same name keeps the first distribution in the message
    c = registering("register_kl_penalties", "shared")
    assert rlplug_registry.add_plugin(c, name="c", distribution="dist-c")
    err = rlplug_registry.conflicts[("kl_penalty", "shared")]
    assert (err.first, err.second) == ("dist-a", "dist-c")
    assert rlplug_registry.describe()["conflicts"] == [str(err)]


def test_unknown_name_message(rlplug_registry):
    rlplug_registry.add_plugin(
        registering("register_advantage_estimators", "grpo", "gae"), name="core", distribution="rlplug", version="0.1.0"
    )
    rlplug_registry.add_plugin(
        registering("register_advantage_estimators", "my_adv"),
        name="mine",
        distribution="rlplug-myplugin",
        version="0.1.0",
    )
    with pytest.raises(UnknownPluginError) as info:
        rlplug_registry.get("advantage_estimator", "grp")
    assert str(info.value) == (
        "Unknown advantage estimator 'grp'. Did you mean 'grpo'? "
        "Available: gae (rlplug 0.1.0), grpo (rlplug 0.1.0), my_adv (rlplug-myplugin 0.1.0). "
        "Run 'rlplug plugins' to see what is installed (the plugin may not be installed)."
    )
    assert isinstance(info.value, KeyError)  # callers catching KeyError keep working


def test_unknown_name_with_nothing_registered(rlplug_registry):
    with pytest.raises(UnknownPluginError, match=r"Unknown tracker 'wandb'\. No tracker is registered\."):
        rlplug_registry.get("tracker", "wandb")


def test_unknown_kind(rlplug_registry):
    with pytest.raises(UnknownKindError, match="Unknown plugin kind 'advantage'.*advantage_estimator"):
        rlplug_registry.names("advantage")


@pytest.mark.parametrize(
    "hook, expected_error",
    [
        (lambda register: register("", 1), "non-empty string name"),
        (lambda register: 1 / 0, "ZeroDivisionError"),
    ],
)
def test_registration_hook_errors_make_the_plugin_broken(rlplug_registry, hook, expected_error):
    good = registering("register_trackers", "ok")
    bad = make_plugin(register_trackers=hook)
    assert rlplug_registry.add_plugin(good, name="good")
    assert not rlplug_registry.add_plugin(bad, name="bad", distribution="bad-dist")
    assert rlplug_registry.names("tracker") == ["ok"]
    (broken,) = rlplug_registry.broken
    assert broken.name == "bad" and broken.distribution == "bad-dist"
    assert expected_error in broken.message
    # nothing of the failed plugin stays registered with pluggy
    assert rlplug_registry.pm.get_plugin("bad") is None


# ============================================================================ misspelled hooks


def test_misspelled_hook_is_rejected_with_pluggys_error(rlplug_registry, fixture_dists):
    import rlplug_misspelled_plugin

    assert not rlplug_registry.add_plugin(rlplug_misspelled_plugin, name="misspelled")
    (broken,) = rlplug_registry.broken
    assert isinstance(broken.error, pluggy.PluginValidationError)
    assert "unknown hook 'register_reward_function'" in broken.message
    assert rlplug_registry.names("reward_function") == []
    assert rlplug_registry.pm.get_plugin("misspelled") is None
    # a correct plugin added afterwards is not blamed for the earlier misspelling
    assert rlplug_registry.add_plugin(registering("register_reward_functions", "fine"), name="fine")
    assert rlplug_registry.names("reward_function") == ["fine"]


# ============================================================================ entry points


def _declared_entry_points() -> dict[str, str]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return data["project"]["entry-points"]["rlplug"]


def _module_file(value: str) -> Path:
    assert value.startswith("rlplug.plugins."), value
    return ROOT / "plugins" / (value.removeprefix("rlplug.plugins.").replace(".", "/") + ".py")


def test_every_packaged_plugin_on_disk_loads(rlplug_full_registry):
    declared = _declared_entry_points()
    loaded = {p.name: p for p in rlplug_full_registry.plugins if p.distribution == "rlplug"}
    broken = {b.name: b for b in rlplug_full_registry.broken if b.distribution == "rlplug"}
    present = [name for name, value in declared.items() if _module_file(value).is_file()]
    assert "trackers" in present
    for name in present:
        assert name not in broken, f"packaged plugin '{name}' failed to load: {broken[name].message}"
        assert name in loaded, f"packaged plugin '{name}' was not loaded"
        assert loaded[name].hooks, f"packaged plugin '{name}' implements no hook"
        assert loaded[name].version == rlplug.__version__
    for name in declared:  # declared but not written yet: reported, not fatal
        if name not in present:
            assert name in broken and "ModuleNotFoundError" in broken[name].message
    # every loaded packaged plugin registers what its hooks promise
    regs = [r for kind in KINDS for r in rlplug_full_registry.entries[kind].values() if r.distribution == "rlplug"]
    for name in present:
        if any(h.startswith("register_") for h in loaded[name].hooks):
            assert any(r.plugin == name for r in regs), f"packaged plugin '{name}' registered nothing"
    assert rlplug_full_registry.names("tracker")[:2] == ["console", "mlflow"]
    assert rlplug_full_registry.registration("tracker", "mlflow").plugin == "trackers"


def test_broken_entry_point_is_reported_not_fatal(fixture_dists):
    registry = Registry()
    broken = {b.name: b for b in registry.broken}
    b = broken["broken_estimator"]
    assert (b.distribution, b.version, b.value) == ("rlplug-broken-plugin", "0.0.1", "rlplug_broken_plugin")
    assert isinstance(b.error, ImportError) and "nonexistent-dependency" in b.message
    m = broken["misspelled"]
    assert m.distribution == "rlplug-misspelled-plugin" and "unknown hook 'register_reward_function'" in m.message
    # the other plugins still loaded
    assert "console" in registry.names("tracker")
    # selecting the broken plugin's name fails with its import error
    with pytest.raises(PluginLoadError) as info:
        registry.get("advantage_estimator", "broken_estimator")
    msg = str(info.value)
    assert "rlplug-broken-plugin 0.0.1" in msg and "failed to load" in msg and "nonexistent-dependency" in msg
    assert isinstance(info.value.__cause__, ImportError)
    # an unknown name mentions the broken plugins, since one of them may have provided it
    with pytest.raises(UnknownPluginError) as info:
        registry.get("advantage_estimator", "from_the_broken_one")
    assert "broken_estimator (rlplug-broken-plugin): ImportError" in str(info.value)


def test_disable_plugins_by_entry_point_and_distribution(fixture_dists, monkeypatch):
    # the trackers are four entry points (trackers: console and mlflow; tensorboard; wandb; prometheus)
    monkeypatch.setenv(
        "RLPLUG_DISABLE_PLUGINS", "trackers, rlplug-broken-plugin,misspelled,tensorboard,wandb,prometheus"
    )
    registry = Registry()
    assert registry.names("tracker") == []
    assert "trackers" not in [p.name for p in registry.plugins]
    assert {b.name for b in registry.broken}.isdisjoint({"broken_estimator", "misspelled"})
    with pytest.raises(UnknownPluginError, match="No tracker is registered"):
        registry.get("tracker", "console")
    monkeypatch.setenv("RLPLUG_DISABLE_PLUGINS", "rlplug")  # the whole packaged distribution
    registry = Registry()
    assert all(p.distribution != "rlplug" for p in registry.plugins)
    assert all(registry.names(kind) == [] for kind in KINDS)


def test_trace_hooks_env_prints_hook_calls(monkeypatch, capsys):
    monkeypatch.setenv("RLPLUG_TRACE_HOOKS", "1")
    registry = Registry(load_entry_points=False)
    seen = []
    registry.add_plugin(make_plugin(on_step_end=lambda step, metrics: seen.append((step, metrics))), name="obs")
    registry.hook.on_step_end(step=3, metrics={"a/b": 1.0})
    assert seen == [(3, {"a/b": 1.0})]
    assert "on_step_end" in capsys.readouterr().err
