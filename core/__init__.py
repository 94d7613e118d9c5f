"""rlplug: reinforcement-learning post-training of language models, every piece a plugin.

Public API::

    import rlplug

    @rlplug.hookimpl
    def register_reward_functions(register):
        register("my_reward", my_reward_fn)

    rlplug.plugin_names("advantage_estimator")   # ['gae', 'grpo', ...]
    rlplug.get_plugin("advantage_estimator", "grpo")

    rlplug.train(["algorithm=grpo"], train_dataset=ds, reward_funcs=[fn])   # TRL-style (rlplug.api)
"""

from rlplug import _moved
from rlplug._version import __version__ as __version__
from rlplug.api import TrainResult, train
from rlplug.contracts.hookspecs import hookimpl
from rlplug.contracts.registry import (
    PluginConflictError,
    PluginContractError,
    PluginError,
    PluginLoadError,
    UnknownKindError,
    UnknownPluginError,
    get_plugin,
    get_registry,
    plugin_names,
)
from rlplug.contracts.reward_contract import BatchedRewardFunction, trl_reward
from rlplug.contracts.types import (
    AdvantageEstimator,
    BatchFilter,
    KLPenalty,
    MiniBatchContext,
    MissingInputError,
    PolicyLoss,
    RolloutOutput,
    SamplingParams,
)

_moved.install()  # old module paths (rlplug.trainer, rlplug.losses, ...) with a DeprecationWarning

__all__ = [
    "hookimpl",
    "train",
    "TrainResult",
    "trl_reward",
    "BatchedRewardFunction",
    "plugin_names",
    "get_plugin",
    "get_registry",
    "UnknownPluginError",
    "PluginConflictError",
    "PluginContractError",
    "PluginError",
    "PluginLoadError",
    "UnknownKindError",
    "AdvantageEstimator",
    "PolicyLoss",
    "MiniBatchContext",
    "KLPenalty",
    "BatchFilter",
    "MissingInputError",
    "RolloutOutput",
    "SamplingParams",
]
