"""Data: preparing the tasks' parquet files and loading them in verl's row schema.

Layer of ``core/`` (CONTRIBUTING.md, "Layers"): a module here imports only from its own layer and the
layers below; ``pyproject.toml``'s import-linter contract checks it.
"""

from typing import Any

from rlplug._moved import forward


def __getattr__(name: str) -> Any:
    # rlplug.data was a module before the layer packages: its names still resolve, with a DeprecationWarning
    return forward(__name__, name)
