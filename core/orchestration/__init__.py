"""Rollout orchestration: episodes above the rollout library.

This layer will own what turns one generation call into a trajectory: multi-turn episodes that alternate the
engine's turns with an environment's observations (:mod:`rlplug.contracts.agents`), tool workers with their
timeouts, and the token bookkeeping that keeps the sampled ids and masks exact. It sits above the rollout
library (:mod:`rlplug.rollout`) and the rewards, below the run (:mod:`rlplug.run`), so that episodes do not grow
the loop. Its modules arrive with the multi-turn work (issue 33); today the package holds none.

Layer of ``core/`` (CONTRIBUTING.md, "Layers"): a module here imports only from its own layer and the layers
below; ``pyproject.toml``'s import-linter contract checks it.
"""
