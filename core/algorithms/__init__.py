"""The algorithm math, pure functions on tensors: log-probs, reward normalisation, token budgets, losses,
rollout correction, KL control and the objective. Imports configuration, contracts and the base.

Layer of ``core/`` (CONTRIBUTING.md, "Layers"): a module here imports only from its own layer and the
layers below; ``pyproject.toml``'s import-linter contract checks it.
"""
