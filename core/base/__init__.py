"""The base layer: exit codes, fault-injection points, file modes, precision and host-memory helpers, the run
context handed to plugins. Imports nothing else of rlplug.

Layer of ``core/`` (CONTRIBUTING.md, "Layers"): a module here imports only from its own layer and the
layers below; ``pyproject.toml``'s import-linter contract checks it.
"""
