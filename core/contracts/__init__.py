"""Contracts: the plugin kinds' Protocols and types, the batch, hook specs, plugin errors, the per-kind
contract checks, the reward contract, the registry, the process coordinator and metric names.
Imports only :mod:`rlplug.base`.

Layer of ``core/`` (CONTRIBUTING.md, "Layers"): a module here imports only from its own layer and the
layers below; ``pyproject.toml``'s import-linter contract checks it.
"""

from typing import Any

from rlplug._moved import forward


def __getattr__(name: str) -> Any:
    # rlplug.contracts was a module before the layer packages: its names still resolve, with a DeprecationWarning
    return forward(__name__, name)
