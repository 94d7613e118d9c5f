"""The run: the loop (trainer, step pipeline, schedule), checkpoints, metrics, alerts, dumps, export,
report, batch filters, evaluation and validation.

Layer of ``core/`` (CONTRIBUTING.md, "Layers"): a module here imports only from its own layer and the
layers below; ``pyproject.toml``'s import-linter contract checks it.
"""
