"""The training library: model files, models, LoRA, the training backend base and reward-model training.

Layer of ``core/`` (CONTRIBUTING.md, "Layers"): a module here imports only from its own layer and the
layers below; ``pyproject.toml``'s import-linter contract checks it.
"""

from typing import Any

from rlplug._moved import forward


def __getattr__(name: str) -> Any:
    # rlplug.training was a module before the layer packages: its names still resolve, with a DeprecationWarning
    return forward(__name__, name)
