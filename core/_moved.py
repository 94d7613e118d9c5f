"""Old module paths of rlplug, kept working for one release with a ``DeprecationWarning``.

Issue 32 moved the engine's flat modules into layer packages (CONTRIBUTING.md, "Layers"):
``rlplug.losses`` is now ``rlplug.algorithms.losses``, ``rlplug.trainer`` is ``rlplug.run.trainer``
and so on (:data:`MOVED`). Third-party code that imports an old path still gets the module -- the
same module object, so a monkeypatch through either name is seen by both -- and a
``DeprecationWarning`` naming the new path. Four old modules became the packages of their layer
(``rlplug.config``, ``rlplug.contracts``, ``rlplug.data``, ``rlplug.training``); their names are
forwarded by the package's ``__getattr__`` (:func:`forward`). Both go away in the release after next.

Issue 32 also moved optional features out of the engine into packaged plugins: a name that left an engine
module which stays (the reward-model scorer left :mod:`rlplug.rewards.reward_model` for the ``reward_model``
plugin) is forwarded by that module's ``__getattr__`` (:data:`MOVED_NAMES`, :func:`forward_name`). The
engine names its plugins only here, as strings, and imports one only when an old name is asked for.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Any

__all__ = ["MOVED", "PACKAGE_FORWARDS", "MOVED_NAMES", "install", "forward", "forward_name"]

#: old module path -> new module path (the old module's whole content moved there unchanged)
MOVED: dict[str, str] = {
    # base
    "rlplug.exit_codes": "rlplug.base.exit_codes",
    "rlplug.faults": "rlplug.base.faults",
    "rlplug.file_modes": "rlplug.base.file_modes",
    "rlplug.precision": "rlplug.base.precision",
    "rlplug.host_memory": "rlplug.base.host_memory",
    "rlplug.run_context": "rlplug.base.run_context",
    # contracts
    "rlplug.types": "rlplug.contracts.types",
    "rlplug.batch": "rlplug.contracts.batch",
    "rlplug.hookspecs": "rlplug.contracts.hookspecs",
    "rlplug.plugin_errors": "rlplug.contracts.plugin_errors",
    "rlplug.reward_contract": "rlplug.contracts.reward_contract",
    "rlplug.registry": "rlplug.contracts.registry",
    "rlplug.coordinator": "rlplug.contracts.coordinator",
    "rlplug.metric_names": "rlplug.contracts.metric_names",
    # config
    "rlplug.verl_keys": "rlplug.config.verl_keys",
    "rlplug.run_paths": "rlplug.config.run_paths",
    "rlplug.compose": "rlplug.config.compose",
    "rlplug.phases": "rlplug.config.phases",
    # algorithms
    "rlplug.logprob": "rlplug.algorithms.logprob",
    "rlplug.reward_norm": "rlplug.algorithms.reward_norm",
    "rlplug.token_budget": "rlplug.algorithms.token_budget",
    "rlplug.losses": "rlplug.algorithms.losses",
    "rlplug.rollout_correction": "rlplug.algorithms.rollout_correction",
    "rlplug.kl_control": "rlplug.algorithms.kl_control",
    "rlplug.objective": "rlplug.algorithms.objective",
    # data
    "rlplug.data_prepare": "rlplug.data.prepare",
    # rewards
    "rlplug.reward_model": "rlplug.rewards.reward_model",
    "rlplug.reward": "rlplug.rewards.manager",
    "rlplug.pairs": "rlplug.rewards.pairs",
    # rollout
    "rlplug.replicas": "rlplug.rollout.replicas",
    "rlplug.rollout_utils": "rlplug.rollout.utils",
    "rlplug.serving": "rlplug.rollout.serving",
    # training
    "rlplug.model_files": "rlplug.training.model_files",
    "rlplug.models": "rlplug.training.models",
    "rlplug.lora": "rlplug.training.lora",
    "rlplug.rm_train": "rlplug.training.rm_train",
    # run
    "rlplug.run_lock": "rlplug.run.run_lock",
    "rlplug.checkpoint": "rlplug.run.checkpoint",
    "rlplug.export": "rlplug.run.export",
    "rlplug.metrics": "rlplug.run.metrics",
    "rlplug.report": "rlplug.run.report",
    "rlplug.alerts": "rlplug.run.alerts",
    "rlplug.dump": "rlplug.run.dump",
    "rlplug.batch_filter": "rlplug.run.batch_filter",
    "rlplug.evaluate": "rlplug.run.evaluate",
    "rlplug.make_pairs": "rlplug.run.make_pairs",
    "rlplug.step_pipeline": "rlplug.run.step_pipeline",
    "rlplug.validate": "rlplug.run.validate",
    "rlplug.schedule": "rlplug.run.schedule",
    "rlplug.trainer": "rlplug.run.trainer",
}

#: old module that became its layer's package -> the module now holding its content
PACKAGE_FORWARDS: dict[str, str] = {
    "rlplug.config": "rlplug.config.schema",
    "rlplug.contracts": "rlplug.contracts.kinds",
    "rlplug.data": "rlplug.data.dataset",
    "rlplug.training": "rlplug.training.backend",
}


_RM_PLUGIN = "rlplug.plugins.rewards.reward_model"

#: engine module that stays -> {name that moved to a plugin: the plugin module now defining it}
MOVED_NAMES: dict[str, dict[str, str]] = {
    "rlplug.rewards.reward_model": {
        "RewardModelScorer": _RM_PLUGIN,
        "get_scorer": _RM_PLUGIN,
        "RewardModelFunction": _RM_PLUGIN,
    },
    "rlplug.plugin": {"RewardModelFunction": _RM_PLUGIN},
}

_LAYERS = "rlplug's engine is split into layer packages, CONTRIBUTING.md 'Layers'"
_PLUGINS = "an optional feature moved from the engine to a packaged plugin, CONTRIBUTING.md 'Engine and plugins'"


def _warn(old: str, new: str, stacklevel: int, why: str = _LAYERS) -> None:
    warnings.warn(
        f"{old} moved to {new} ({why}); the old path works until the release after next: import {new} instead",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        _warn(spec.name, self.new, stacklevel=8)
        module = importlib.import_module(self.new)
        self._real_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system stamped the alias's spec on the real module: give it back its own
        module.__spec__ = self._real_spec


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(new))


def install() -> None:
    """Put the old-path finder on ``sys.meta_path`` (once; :mod:`rlplug` calls it on import)."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.append(_AliasFinder())


def forward(package: str, name: str) -> Any:
    """The package ``__getattr__`` of a layer package that replaced an old module: ``rlplug.config.<name>`` for a
    name of the old ``rlplug.config`` module, with a ``DeprecationWarning``. Raises ``AttributeError``
    for a name the old module did not have either."""
    target = PACKAGE_FORWARDS[package]
    module = importlib.import_module(target)
    if name.startswith("__") or not hasattr(module, name):
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    _warn(f"{package}.{name}", f"{target}.{name}", stacklevel=4)
    return getattr(module, name)


def forward_name(module: str, name: str) -> Any:
    """The ``__getattr__`` of an engine module some of whose names moved to a plugin: ``name`` from the plugin
    module :data:`MOVED_NAMES` gives for it, with a ``DeprecationWarning``. Raises ``AttributeError`` for a name
    that did not move (``module`` lacks it)."""
    target = MOVED_NAMES.get(module, {}).get(name)
    if target is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    _warn(f"{module}.{name}", f"{target}.{name}", stacklevel=4, why=_PLUGINS)
    return getattr(importlib.import_module(target), name)
