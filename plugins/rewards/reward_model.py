"""The ``reward_model`` reward function: a discriminative reward model (a local
AutoModelForSequenceClassification with one label), configured with ``reward.reward_model.*``.

The scoring is library code in :mod:`rlplug.rewards.reward_model`; this entry point registers it the way a
third-party package would (``docs/reward_models.md``).
"""

from __future__ import annotations

from rlplug.plugin import RM_NAME, RewardModelFunction, hookimpl


@hookimpl
def register_reward_functions(register):
    """Register ``reward_model`` (selected by ``reward.reward_model.enable`` or a ``reward.shaping`` entry)."""
    register(RM_NAME, RewardModelFunction())
