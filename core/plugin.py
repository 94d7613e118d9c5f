"""The public plugin API: everything a plugin imports from rlplug, in one place.

A plugin (a packaged one under ``rlplug.plugins``, ``contrib/rlplug-example-plugin`` or a
third-party package) imports rlplug names from this module only::

    from rlplug.plugin import AdvantageEstimator, hookimpl, masked_whiten

    @hookimpl
    def register_advantage_estimators(register):
        register("my_adv", AdvantageEstimator(fn=my_advantage, requires=("index",), group_based=True))

What is here is supported: a name keeps its meaning, and a change to it is announced with a
``DeprecationWarning`` one release ahead. The modules these names are defined in are the engine's
own layout, which changes (``tests/test_plugin_api.py`` checks that the packaged plugins and the
example plugin import nothing else). The groups, by what a plugin author uses them for:

**Registration** (every plugin): :func:`hookimpl` marks the ``register_<kind>s(register)`` hook
functions (``CONTRIBUTING.md``, "Writing a plugin"); :func:`get_plugin` and :func:`plugin_names`
look registered plugins up (e.g. in a plugin's tests).

**Contracts** (one per plugin kind, :mod:`rlplug.contracts.types`): the wrapper types a plugin registers
(:class:`AdvantageEstimator`, :class:`PolicyLoss`, :class:`KLPenalty`, :class:`BatchFilter`), the
runtime-checkable Protocols the registry checks each kind against (``*Protocol``,
:class:`RewardFunction`, :class:`RolloutBackend`, :class:`TrainingBackend`, :class:`Tracker`,
:class:`Coordinator`) and the types they exchange (:class:`SamplingParams`,
:class:`RolloutOutput`, :class:`MiniBatchContext`, :class:`MissingInputError`, the field and
capability tables). :class:`Batch` and :class:`Fields` are the batch a training backend and an
advantage estimator receive. The multi-turn contracts (:mod:`rlplug.contracts.agents`:
:class:`EnvironmentProtocol`, :class:`EnvStep`, :class:`ToolProtocol`, :data:`Message`; what an environment
factory gets, :class:`EnvironmentContext`, whose ``call_tool`` returns a :class:`ToolResult` with one of the
:data:`TOOL_STATUSES`; for tools
:class:`FunctionTool`, a function as a tool with its schema from the signature and docstring, and the errors
whose message the model reads, :class:`ToolError` and :class:`ToolArgumentError`, besides
:class:`ToolSchemaError` for a function that cannot be described) and the
weight-transfer contract (:mod:`rlplug.contracts.weights`: :class:`WeightTransfer`,
:class:`DirectWeightTransfer`).

**The run** (trackers, training backends): :class:`RunContext`, the run directory and the step a
resumed run starts after, which the engine passes to a factory that declares a ``run`` keyword
(:mod:`rlplug.base.run_context`); :func:`run_context_for` builds the same for a plugin built outside
``rlplug train`` (a test, a notebook).

**Algorithm math** (advantage estimators, policy losses, KL penalties, batch filters): the masked
statistics and the loss aggregation (:func:`masked_mean`, :func:`masked_whiten`, :func:`agg_loss`
with its ``normalizer``, :func:`seq_norm_length` ...), the PPO objectives a training backend runs
(:func:`actor_objective`, :func:`critic_objective`) and the rollout-correction helpers a policy
loss applies (:func:`parse_rollout_correction`, :func:`compute_rollout_correction`,
:func:`rollout_is_weights`, :func:`offpolicy_metrics` ...).

**Rewards** (reward functions): :class:`BatchedRewardFunction` and :func:`trl_reward` (TRL's batched
contract), :class:`ScoresOneAsABatch` (a batched function called on one response); for a reward model
(the ``reward_model`` plugin), :data:`RM_NAME` (its registered name), :class:`RewardModelBase` (the input
format and forward pass ``rlplug rm train`` trains with), :class:`RewardModelError` and the config-time
checks :func:`check_reward_model_folder`, :func:`check_reward_model_settings`, :func:`reward_model_device`.
``RewardModelFunction`` moved to the plugin (:mod:`rlplug.plugins.rewards.reward_model`); the old name here
is forwarded there with a ``DeprecationWarning`` for one release.

**Rollout backends**: :class:`ServerRollout` (the base of HTTP-server engines, with
:class:`ServerProcess`, :class:`ServerError`, :class:`Retryable`, :func:`server_urls`,
:func:`free_port`), the prompt, EOS and weight-transfer helpers of :mod:`rlplug.rollout.utils`
(:func:`validate_prompts`, :func:`eos_ids`, :func:`checked_weights` ...), :func:`resolve_dtype`,
:func:`load_causal_lm`, the host-memory probes (:func:`rss_bytes`, :func:`heap_mib`,
:func:`malloc_trim`) and an engine child over two pipes (:func:`start_pipe_child`, :func:`stop_pipe_child`).

**Training backends**: :class:`TrainingBackendBase` (the single-process backend to subclass), its
:class:`Role`, the coordinators (:data:`SINGLE_PROCESS`, :class:`TorchDistributedCoordinator`),
:data:`STATE_FILE`, :func:`resolve_device`, :func:`build_lr_lambda`, :func:`token_budgets`,
:func:`response_token_stats`; :func:`apply_umask` for model files a backend writes itself.

**Trackers**: :func:`tracker_name`, the one mapping of metric names to the characters a tracker
accepts (:data:`TRACKER_NAME_CHARS`), :func:`metric_value` (a logged value as a float) and
:func:`source_tags` (the rlplug version and git commit to record with a run).

**Configuration**: :func:`typed` (a config section read as the schema's dataclass, e.g.
``typed(ActorConfig, config)``, so mypy checks each read and the defaults come from the schema), the
schema's section dataclasses (:class:`RunConfig`, :class:`ActorConfig`, :class:`RolloutConfig` ...),
:func:`config_get` (only for a plugin's own free-form keys, which the schema does not know) and
:class:`ConfigError` (what a plugin raises for a bad setting).

**Testing** (a plugin's own tests): the conformance kit of each kind (:func:`check_advantage_estimator`
... :func:`check_tracker`, :func:`check_tool`, :func:`check_environment`, :func:`check_protocol`) with its inputs (:func:`make_batch`,
:func:`algorithm_config`), the helpers of :mod:`rlplug.testing` (:func:`assert_advantage_contract`,
:func:`reduction_tolerance`; imported when first used, as that module needs pytest) and
:func:`fault_point`, where the crash tests stop or fail a process (``RLPLUG_TEST_KILL_AT``,
:data:`FAULT_ENV`).

**Import cost**: ``import rlplug.plugin`` does not import torch. The names defined in modules that do (the
algorithm math, :class:`Batch`, the rollout and training-backend helpers: :data:`_LAZY`) are imported from
their module when first used (a module ``__getattr__``); ``from rlplug.plugin import masked_whiten`` works as
before and imports torch then. So a plugin that needs none of them, a tool such as ``calculator``, loads
without torch (a tool worker process starts faster).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlplug._moved import forward_name
from rlplug.base.faults import FAULT_ENV, fault_point
from rlplug.base.file_modes import apply_umask
from rlplug.base.host_memory import heap_mib, keep_freed_memory, malloc_trim, rss_bytes
from rlplug.base.processes import start_pipe_child, stop_pipe_child
from rlplug.base.run_context import RunContext
from rlplug.config.run_paths import run_context_for
from rlplug.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    ConfigError,
    CriticConfig,
    DataConfig,
    KLControlConfig,
    ModelConfig,
    MultiTurnConfig,
    OptimConfig,
    PrometheusConfig,
    RewardConfig,
    RewardModelConfig,
    RolloutConfig,
    RolloutCorrectionConfig,
    RunConfig,
    TrainerConfig,
    config_get,
    typed,
    typed_section,
)
from rlplug.conformance import (
    algorithm_config,
    check_advantage_estimator,
    check_batch_filter,
    check_environment,
    check_kl_penalty,
    check_policy_loss,
    check_protocol,
    check_reward_function,
    check_rollout_backend,
    check_tool,
    check_tracker,
    check_training_backend,
    make_batch,
)
from rlplug.contracts.agents import (
    TOOL_STATUSES,
    EnvironmentContext,
    EnvironmentProtocol,
    EnvStep,
    FunctionTool,
    Message,
    ToolArgumentError,
    ToolError,
    ToolProtocol,
    ToolResult,
    ToolSchemaError,
)
from rlplug.contracts.coordinator import SINGLE_PROCESS, SingleProcessCoordinator
from rlplug.contracts.hookspecs import hookimpl
from rlplug.contracts.metric_names import TRACKER_NAME_CHARS, metric_value, source_tags, tracker_name
from rlplug.contracts.registry import get_plugin, plugin_names
from rlplug.contracts.reward_contract import BatchedRewardFunction, ScoresOneAsABatch, trl_reward
from rlplug.contracts.types import (
    BATCH_FIELD_PRODUCERS,
    PER_TOKEN_QUANTITIES,
    TRAINING_CAPABILITIES,
    AdvantageEstimator,
    AdvantageEstimatorProtocol,
    BatchFilter,
    BatchFilterProtocol,
    Coordinator,
    KLPenalty,
    KLPenaltyProtocol,
    MiniBatchContext,
    MissingInputError,
    PolicyLoss,
    PolicyLossProtocol,
    RewardFunction,
    RolloutBackend,
    RolloutOutput,
    SamplingParams,
    Tracker,
    TrainingBackend,
)
from rlplug.contracts.weights import DirectWeightTransfer, WeightTransfer
from rlplug.rewards.reward_model import (
    RM_NAME,
    RewardModelBase,
    RewardModelError,
    check_reward_model_folder,
    check_reward_model_settings,
    reward_model_device,
)
from rlplug.rollout.serving import Retryable, ServerError, ServerProcess, ServerRollout, free_port, server_urls

if TYPE_CHECKING:  # imported when first used (module __getattr__): torch, and pytest for rlplug.testing
    from rlplug.algorithms.logprob import response_token_stats
    from rlplug.algorithms.losses import (
        LOSS_AGG_MODES,
        agg_loss,
        agg_normalizer,
        masked_mean,
        masked_sum,
        masked_var,
        masked_whiten,
        seq_norm_length,
    )
    from rlplug.algorithms.objective import actor_objective, critic_objective
    from rlplug.algorithms.rollout_correction import (
        RolloutCorrectionSettings,
        compute_rollout_correction,
        offpolicy_metrics,
        parse_rollout_correction,
        rollout_is_weights,
        with_threshold_alias,
    )
    from rlplug.algorithms.token_budget import token_budgets
    from rlplug.base.precision import resolve_dtype
    from rlplug.contracts.batch import Batch, Fields
    from rlplug.rollout.utils import (
        DTYPE_NAMES,
        TORCH_DTYPES,
        checked_weights,
        checkpoint_shapes,
        eos_ids,
        parse_dtype,
        remove_dead_process_files,
        shm_dir,
        strip_wrapper_prefixes,
        validate_prompts,
    )
    from rlplug.testing import assert_advantage_contract, reduction_tolerance
    from rlplug.training.backend import (
        STATE_FILE,
        Role,
        TorchDistributedCoordinator,
        TrainingBackendBase,
        build_lr_lambda,
        resolve_device,
    )
    from rlplug.training.models import load_causal_lm

__all__ = [
    # registration
    "hookimpl",
    "get_plugin",
    "plugin_names",
    # contracts
    "AdvantageEstimator",
    "AdvantageEstimatorProtocol",
    "PolicyLoss",
    "PolicyLossProtocol",
    "MiniBatchContext",
    "KLPenalty",
    "KLPenaltyProtocol",
    "BatchFilter",
    "BatchFilterProtocol",
    "MissingInputError",
    "RewardFunction",
    "RolloutBackend",
    "EnvironmentProtocol",
    "EnvironmentContext",
    "EnvStep",
    "Message",
    "ToolProtocol",
    "FunctionTool",
    "ToolError",
    "ToolArgumentError",
    "ToolSchemaError",
    "ToolResult",
    "TOOL_STATUSES",
    "WeightTransfer",
    "DirectWeightTransfer",
    "SamplingParams",
    "RolloutOutput",
    "TrainingBackend",
    "Coordinator",
    "Tracker",
    "BATCH_FIELD_PRODUCERS",
    "PER_TOKEN_QUANTITIES",
    "TRAINING_CAPABILITIES",
    "Batch",
    "Fields",
    # the run
    "RunContext",
    "run_context_for",
    # algorithm math
    "LOSS_AGG_MODES",
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "agg_loss",
    "agg_normalizer",
    "seq_norm_length",
    "actor_objective",
    "critic_objective",
    "RolloutCorrectionSettings",
    "parse_rollout_correction",
    "with_threshold_alias",
    "compute_rollout_correction",
    "rollout_is_weights",
    "offpolicy_metrics",
    # rewards
    "BatchedRewardFunction",
    "trl_reward",
    "ScoresOneAsABatch",
    "RM_NAME",
    "RewardModelBase",
    "RewardModelError",
    "check_reward_model_folder",
    "check_reward_model_settings",
    "reward_model_device",
    # rollout backends
    "ServerRollout",
    "ServerProcess",
    "ServerError",
    "Retryable",
    "server_urls",
    "free_port",
    "DTYPE_NAMES",
    "TORCH_DTYPES",
    "parse_dtype",
    "strip_wrapper_prefixes",
    "validate_prompts",
    "eos_ids",
    "checkpoint_shapes",
    "checked_weights",
    "shm_dir",
    "remove_dead_process_files",
    "resolve_dtype",
    "load_causal_lm",
    "rss_bytes",
    "heap_mib",
    "malloc_trim",
    "keep_freed_memory",
    "start_pipe_child",
    "stop_pipe_child",
    # training backends
    "TrainingBackendBase",
    "Role",
    "SingleProcessCoordinator",
    "SINGLE_PROCESS",
    "TorchDistributedCoordinator",
    "STATE_FILE",
    "resolve_device",
    "build_lr_lambda",
    "token_budgets",
    "response_token_stats",
    "apply_umask",
    # trackers
    "tracker_name",
    "TRACKER_NAME_CHARS",
    "metric_value",
    "source_tags",
    # configuration
    "config_get",
    "typed",
    "typed_section",
    "ActorConfig",
    "AlgorithmConfig",
    "CriticConfig",
    "DataConfig",
    "KLControlConfig",
    "ModelConfig",
    "MultiTurnConfig",
    "OptimConfig",
    "PrometheusConfig",
    "RewardConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "RunConfig",
    "TrainerConfig",
    "ConfigError",
    # testing
    "check_protocol",
    "check_advantage_estimator",
    "check_policy_loss",
    "check_kl_penalty",
    "check_batch_filter",
    "check_reward_function",
    "check_rollout_backend",
    "check_training_backend",
    "check_tracker",
    "check_tool",
    "check_environment",
    "make_batch",
    "assert_advantage_contract",
    "algorithm_config",
    "reduction_tolerance",
    "fault_point",
    "FAULT_ENV",
]

#: the names imported from their module when first asked for (:func:`__getattr__`): those of the modules that
#: import torch, so that ``import rlplug.plugin`` (every plugin; a tool worker importing its tool) does not load
#: torch, and those of :mod:`rlplug.testing` (it imports pytest)
_LAZY: dict[str, str] = {
    "response_token_stats": "rlplug.algorithms.logprob",
    "LOSS_AGG_MODES": "rlplug.algorithms.losses",
    "agg_loss": "rlplug.algorithms.losses",
    "agg_normalizer": "rlplug.algorithms.losses",
    "masked_mean": "rlplug.algorithms.losses",
    "masked_sum": "rlplug.algorithms.losses",
    "masked_var": "rlplug.algorithms.losses",
    "masked_whiten": "rlplug.algorithms.losses",
    "seq_norm_length": "rlplug.algorithms.losses",
    "actor_objective": "rlplug.algorithms.objective",
    "critic_objective": "rlplug.algorithms.objective",
    "RolloutCorrectionSettings": "rlplug.algorithms.rollout_correction",
    "compute_rollout_correction": "rlplug.algorithms.rollout_correction",
    "offpolicy_metrics": "rlplug.algorithms.rollout_correction",
    "parse_rollout_correction": "rlplug.algorithms.rollout_correction",
    "rollout_is_weights": "rlplug.algorithms.rollout_correction",
    "with_threshold_alias": "rlplug.algorithms.rollout_correction",
    "token_budgets": "rlplug.algorithms.token_budget",
    "resolve_dtype": "rlplug.base.precision",
    "Batch": "rlplug.contracts.batch",
    "Fields": "rlplug.contracts.batch",
    "DTYPE_NAMES": "rlplug.rollout.utils",
    "TORCH_DTYPES": "rlplug.rollout.utils",
    "checked_weights": "rlplug.rollout.utils",
    "checkpoint_shapes": "rlplug.rollout.utils",
    "eos_ids": "rlplug.rollout.utils",
    "parse_dtype": "rlplug.rollout.utils",
    "shm_dir": "rlplug.rollout.utils",
    "remove_dead_process_files": "rlplug.rollout.utils",
    "strip_wrapper_prefixes": "rlplug.rollout.utils",
    "validate_prompts": "rlplug.rollout.utils",
    "STATE_FILE": "rlplug.training.backend",
    "Role": "rlplug.training.backend",
    "TorchDistributedCoordinator": "rlplug.training.backend",
    "TrainingBackendBase": "rlplug.training.backend",
    "build_lr_lambda": "rlplug.training.backend",
    "resolve_device": "rlplug.training.backend",
    "load_causal_lm": "rlplug.training.models",
    "assert_advantage_contract": "rlplug.testing",
    "reduction_tolerance": "rlplug.testing",
}


def __getattr__(name: str) -> Any:
    """A name of :data:`_LAZY` (torch's modules, :mod:`rlplug.testing`), imported from its module when first
    asked for and kept here; a name that moved to a plugin (``RewardModelFunction``), forwarded there with a
    ``DeprecationWarning`` (:func:`rlplug._moved.forward_name`); raises ``AttributeError`` for any other
    missing name."""
    module = _LAZY.get(name)
    if module is not None:
        import importlib  # deferred: torch or pytest, by the module named

        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    return forward_name(__name__, name)


def __dir__() -> list[str]:
    """Every name of the module, the lazy ones (:data:`_LAZY`) included before they are first used."""
    return sorted(set(globals()) | set(__all__))
