"""Configuration: the structured schema, verl's key names, run paths, composition and phases.
Imports only the contracts and the base.

Layer of ``core/`` (CONTRIBUTING.md, "Layers"): a module here imports only from its own layer and the
layers below; ``pyproject.toml``'s import-linter contract checks it.
"""

from typing import Any

from rlplug._moved import forward


def __getattr__(name: str) -> Any:
    # rlplug.config was a module before the layer packages: its names still resolve, with a DeprecationWarning
    return forward(__name__, name)
