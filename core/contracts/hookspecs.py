"""Hook specifications: every way a plugin can extend or observe rlplug.

Hooks are grouped by phase. A plugin is any module or object with functions decorated by
:data:`rlplug.hookimpl` whose names match the specs below; it is found through the
``rlplug`` entry-point group (see ``pyproject.toml``), the packaged plugins included.

Registration phase
    ``register_<kind>s(register)``: called once per plugin when the registry loads. ``register``
    is ``register(name: str, obj, **extra) -> None`` (``builds=Class`` for factories); the engine
    records which distribution supplied the name and rejects duplicates. One hook per kind; the
    Protocol per kind is in :mod:`rlplug.contracts.types` and is checked when a name is resolved
    (:mod:`rlplug.contracts.kinds`).

Run lifecycle phase
    Observers called by the trainer. They receive plain data (config, step numbers,
    ``dict[str, float]`` metrics, paths); return values are ignored. No hook is ``firstresult``.

Set ``RLPLUG_TRACE_HOOKS=1`` to print every hook call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

PROJECT = "rlplug"

hookspec = pluggy.HookspecMarker(PROJECT)
#: Decorate plugin hook implementations with this marker.
hookimpl = pluggy.HookimplMarker(PROJECT)

Register = Callable[[str, Any], None]

# ============================================================================ registration phase


@hookspec
def register_advantage_estimators(register: Register) -> None:
    """Register advantage estimators.

    Called once when the registry loads. Call ``register(name, estimator)`` with a
    :class:`rlplug.contracts.types.AdvantageEstimator` (contract:
    :class:`rlplug.contracts.types.AdvantageEstimatorProtocol`); its ``fn(data, config)`` receives the
    batch tensors by name (``token_level_rewards (B, T) float32``, ``response_mask (B, T)
    float32``, and every field listed in ``requires``, e.g. ``values (B, T) float32``, ``index
    (B,) int64``, ``reward_baselines (B,) float32``, ``sum_pi_squared (B, T) float32``,
    ``reward_components (B, K) float32``; see :data:`rlplug.contracts.types.BATCH_FIELD_PRODUCERS`) and the
    ``algorithm`` config section, and returns ``(advantages, returns)``, both ``(B, T) float32``,
    zero where the mask is zero. Selected by ``algorithm.adv_estimator``.
    """


@hookspec
def register_policy_losses(register: Register) -> None:
    """Register policy losses.

    Call ``register(name, loss)`` with a :class:`rlplug.contracts.types.PolicyLoss` (contract:
    :class:`rlplug.contracts.types.PolicyLossProtocol`): ``fn(old_log_probs, log_probs, advantages,
    response_mask, *, config, loss_agg_mode, normalizer, max_response_length=None,
    rollout_is_weights=None) -> (loss: scalar tensor, metrics: dict[str, float])``; the loss
    applies the per-token ``rollout_is_weights (B, T) float32`` when given. A loss whose
    per-token terms need statistics of the whole mini-batch sets ``PolicyLoss(minibatch_stats=...)``:
    ``minibatch_stats(old_log_probs, log_probs, advantages, response_mask, *, config, context) ->
    {name: (B_mini, T) tensor}``, called once per mini-batch with the whole mini-batch's detached
    tensors (``log_probs`` from a no-grad forward with the current weights) and a
    :class:`rlplug.contracts.types.MiniBatchContext` (``seed``, ``optimizer_step``, ``epoch``,
    ``mini_batch``: seed any randomness from it); its tensors reach ``fn`` sliced by rows with the
    micro-batches, as keyword arguments ``name=``. Selected by ``actor.policy_loss``.
    """


@hookspec
def register_kl_penalties(register: Register) -> None:
    """Register per-token KL estimators.

    Call ``register(name, penalty)`` with a :class:`rlplug.contracts.types.KLPenalty` (contract:
    :class:`rlplug.contracts.types.KLPenaltyProtocol`): ``fn(log_probs, ref_log_probs) -> (B, T) float32``
    (nats, not masked).
    Selected by ``algorithm.kl_penalty`` (KL in the reward) and ``actor.kl_loss_type``
    (KL as a loss).
    """


@hookspec
def register_batch_filters(register: Register) -> None:
    """Register batch filters (dynamic sampling).

    Call ``register(name, batch_filter)`` with a :class:`rlplug.contracts.types.BatchFilter` (contract:
    :class:`rlplug.contracts.types.BatchFilterProtocol`): ``fn(data, config) -> keep (B,) bool`` (the same
    value for every response of a group: whole groups are kept or dropped), where ``data`` holds one scored generation batch (``index (B,) int64``, ``response_mask``,
    ``token_level_scores`` and ``token_level_rewards`` ``(B, T) float32``, ``reward_components
    (B, K) float32``) and ``config`` is the ``algorithm`` section. The trainer generates more
    batches until ``data.train_batch_size`` prompts are kept (at most
    ``algorithm.filter_groups.max_num_gen_batches``). Selected by ``algorithm.batch_filter``, or by
    ``algorithm.filter_groups`` with ``enable=true`` (verl's spelling, which selects ``filter_groups``).
    """


@hookspec
def register_reward_functions(register: Register) -> None:
    """Register reward functions.

    Call ``register(name, fn)`` with a callable following verl's contract
    (:class:`rlplug.contracts.types.RewardFunction`)
    ``fn(data_source, solution_str, ground_truth, extra_info, **kwargs) -> float | dict``
    (a dict carries ``"score"`` and extra values to log). Chosen per row through
    ``reward.reward_fn_map`` (data_source -> name) or ``reward.default``.
    """


@hookspec
def register_tools(register: Register) -> None:
    """Register tools a multi-turn episode can call.

    Call ``register(name, tool)`` with an object implementing
    :class:`rlplug.contracts.agents.ToolProtocol` (``name`` equal to the registered name,
    ``description``, ``parameters`` a JSON schema object, and ``__call__(**arguments) -> str`` or an
    ``async`` one); :class:`rlplug.contracts.agents.FunctionTool` builds one from a plain or async
    function, its schema from the signature and docstring. The schema is checked when the name is
    resolved. A tool raises :class:`rlplug.contracts.agents.ToolError` with a message for the model.
    Selected by the list ``rollout.multi_turn.tools``.
    """


@hookspec
def register_environments(register: Register) -> None:
    """Register environments a multi-turn episode talks to.

    Call ``register(name, factory)`` with the class, or ``register(name, factory, builds=TheClass)`` for a
    factory function; ``factory(context)`` gets a :class:`rlplug.contracts.agents.EnvironmentContext` (the
    selected tools, ``call_tool(name, arguments)`` returning a :class:`rlplug.contracts.agents.ToolResult`,
    the ``rollout.multi_turn`` settings, the trajectory's seed) and returns one object per trajectory
    implementing :class:`rlplug.contracts.agents.EnvironmentProtocol`: ``reset(row)`` -> the initial messages,
    ``step(assistant_message)`` -> an :class:`rlplug.contracts.agents.EnvStep`, optional ``close()`` and
    ``stop`` strings (plain or ``async`` methods; checked on the class when the name is resolved). Selected
    per row by the row's ``agent_name`` (its own column or ``extra_info.agent_name``, verl's convention),
    else by ``rollout.multi_turn.environment``.
    """


@hookspec
def register_rollout_backends(register: Register) -> None:
    """Register rollout engines.

    Call ``register(name, factory)`` with the class, or ``register(name, factory,
    builds=TheClass)`` for a factory function; ``factory(config, model_path, tokenizer)`` returns
    an object implementing :class:`rlplug.contracts.types.RolloutBackend` (checked on the class when the
    name is resolved). Selected by ``rollout.name``.
    """


@hookspec
def register_training_backends(register: Register) -> None:
    """Register training backends.

    Call ``register(name, factory)`` with the class, or ``register(name, factory,
    builds=TheClass)``; ``factory(config, model_path, *, use_critic: bool, use_ref: bool,
    total_steps: int)`` returns an object implementing :class:`rlplug.contracts.types.TrainingBackend`
    (checked on the class when the name is resolved). Selected by ``trainer.backend`` (Hydra
    group ``trainer=``).
    """


@hookspec
def register_trackers(register: Register) -> None:
    """Register experiment trackers.

    Call ``register(name, factory)`` with the class, or ``register(name, factory,
    builds=TheClass)``; ``factory(config)`` returns an object implementing
    :class:`rlplug.contracts.types.Tracker`. Selected by the list ``trainer.logger``.
    """


# ============================================================================ run lifecycle phase


@hookspec
def on_train_start(config: Any, run_dir: str) -> None:
    """Called once after models are built and before the first step.

    ``config``: the resolved run config (an OmegaConf ``DictConfig``, read-only).
    ``run_dir``: the run's output directory.
    """


@hookspec
def on_step_end(step: int, metrics: dict[str, float]) -> None:
    """Called after every training step, after metrics are logged.

    ``step``: the global step just finished (1-based). ``metrics``: that step's metrics,
    named ``<group>/<metric>`` (e.g. ``actor/pg_loss``, ``timing_s/gen``).
    """


@hookspec
def on_validation_end(step: int, metrics: dict[str, float], samples: list[dict]) -> None:
    """Called after each validation.

    ``step``: the global step validated (0 for ``val_before_train``). ``metrics``:
    ``val-core/<data_source>/acc/mean@N`` (``.../reward/mean@N`` when the reward reports no
    accuracy; :func:`rlplug.run.metrics.validation_metrics`) and friends. ``samples``: a few generations as
    dicts with ``prompt``, ``response``, ``score``, ``data_source``.
    """


@hookspec
def on_checkpoint_saved(step: int, path: str) -> None:
    """Called after a checkpoint is complete (renamed into place and ``latest`` updated).

    ``step``: the global step saved. ``path``: the ``global_step_N`` directory.
    """


@hookspec
def on_train_end(step: int, status: str) -> None:
    """Called once when training stops.

    ``step``: the last completed global step. ``status``: ``"finished"``, ``"interrupted"``
    (SIGTERM/Ctrl-C, a checkpoint was written) or ``"failed"``.
    """
