"""Config validation: every check that can fail before a model loads.

:func:`validate_config` resolves every plugin named in the config through the registry (so a
misspelled name fails in seconds with the available names listed) and checks batch-size
arithmetic and algorithm constraints. It raises :class:`rlplug.config.schema.ConfigError` naming the
key, the bad value, what was expected and what to do.

:func:`plan_batch` decides which stages of the training step run, from what the selected
plugins require (``AdvantageEstimator.requires``, ``PolicyLoss.requires``; the producers are
listed in :data:`rlplug.contracts.types.BATCH_FIELD_PRODUCERS`). The trainer runs exactly that plan, and
a field that no stage would produce under the config is a :class:`ConfigError` here.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from rlplug.algorithms.kl_control import KL_CONTROLLER_TYPES
from rlplug.algorithms.losses import LOSS_AGG_MODES, VALUE_LOSS_TYPES
from rlplug.algorithms.reward_norm import check_normalize_config
from rlplug.algorithms.rollout_correction import (
    bypasses_old_log_probs,
    rollout_correction_requires,
    validate_rollout_correction,
)
from rlplug.algorithms.token_budget import token_budgets
from rlplug.base.precision import DTYPE_CHOICES
from rlplug.config.async_mode import check_async_config
from rlplug.config.phases import check_schedule_config
from rlplug.config.schema import ConfigError, MultiTurnConfig, config_get
from rlplug.config.verl_keys import MAPPED, TABLE
from rlplug.contracts.kinds import built_classes
from rlplug.contracts.registry import PluginError, Registry, get_registry
from rlplug.contracts.types import BATCH_FIELD_PRODUCERS, PER_TOKEN_QUANTITIES
from rlplug.data.dataset import check_data_config, check_train_weights
from rlplug.rewards.manager import _section, load_custom_reward_function, overlong_config
from rlplug.rewards.reward_model import check_reward_model_config
from rlplug.rollout.colocate import check_colocate_config
from rlplug.run.alerts import check_alert_config, needs_old_log_probs
from rlplug.run.dump import check_dump_config
from rlplug.run.metrics import tracker_names
from rlplug.training.lora import check_lora_config

__all__ = ["PluginChoice", "BatchPlan", "plan_batch", "skips_old_log_probs", "uses_critic", "validate_config"]


@dataclass
class PluginChoice:
    kind: str
    key: str
    name: str
    distribution: str
    version: str

    def __str__(self) -> str:
        return f"{self.key}={self.name} ({self.distribution} {self.version})".replace(" )", ")")


def _resolve(registry: Registry, kind: str, key: str, name: Any, out: list[PluginChoice]) -> Any:
    try:
        reg = registry.registration(kind, str(name))
    except PluginError as exc:
        raise ConfigError(f"{key}={name}: {exc}") from exc
    out.append(PluginChoice(kind, key, reg.name, reg.distribution, reg.version))
    return reg.obj


def uses_critic(cfg: DictConfig, estimator: Any) -> bool:
    """Whether a critic is trained: ``critic.enable`` if set, else whether the estimator needs values."""
    if cfg.critic.enable is not None:
        return bool(cfg.critic.enable)
    return "values" in getattr(estimator, "requires", ())


@dataclass(frozen=True)
class BatchPlan:
    """The stages of the training step that run, decided from the config and from what the
    selected plugins require (:func:`plan_batch`).

    * ``requires``: the batch fields the advantage estimator and the policy loss declare, then
      those the rollout correction reads (:func:`rlplug.algorithms.rollout_correction.rollout_correction_requires`:
      ``old_log_probs`` and ``rollout_log_probs`` with weights or rejection, which keeps the
      old-log-prob pass on), in declaration order, without repeats.
    * ``use_critic``: train a critic and put ``values`` on the batch (``critic.enable``, else
      whether ``values`` is required).
    * ``use_ref``: load the reference model and put ``ref_log_probs`` on the batch
      (``actor.use_kl_loss``, ``algorithm.use_kl_in_reward`` or required).
    * ``baseline``: generate and score a greedy baseline rollout (``reward_baselines`` required).
    * ``per_token``: the per-token quantities (:data:`rlplug.contracts.types.PER_TOKEN_QUANTITIES`) to keep
      on the batch from the old-log-prob pass.
    * ``needs_old_log_prob_pass``: a plugin reads ``old_log_probs`` or a per-token quantity before
      the update, so the pass always runs (never skipped on-policy).
    """

    requires: tuple[str, ...] = ()
    use_critic: bool = False
    use_ref: bool = False
    baseline: bool = False
    per_token: tuple[str, ...] = ()

    @property
    def needs_old_log_prob_pass(self) -> bool:
        return "old_log_probs" in self.requires or bool(self.per_token)


#: fields a policy loss may require that the advantage stage puts on the batch before the update
_BEFORE_UPDATE = {
    "advantages": "the advantage estimator (algorithm.adv_estimator)",
    "returns": "the advantage estimator (algorithm.adv_estimator)",
}


def plan_batch(cfg: DictConfig, registry: Registry | None = None) -> BatchPlan:
    """Which stages run, from ``cfg`` and the ``requires`` of the selected advantage estimator and
    policy loss; checks that every required field is produced.

    Raises :class:`ConfigError` (before any model loads) naming the plugin, the field and what
    would produce it, when a required field is one no stage produces (not a key of
    :data:`rlplug.contracts.types.BATCH_FIELD_PRODUCERS`), is ``rollout_log_probs`` with
    ``rollout.calculate_log_probs=false``, is ``values`` with ``critic.enable=false``, or is a
    per-token quantity that the training backend's class does not list in ``per_token_outputs``
    (the class comes from the registration: :func:`rlplug.contracts.kinds.built_classes`). A name that
    does not resolve raises :class:`ConfigError` as in :func:`validate_config`.
    """
    registry = registry or get_registry()
    choices: list[PluginChoice] = []
    a = cfg.actor
    users = [
        (
            "algorithm.adv_estimator",
            cfg.algorithm.adv_estimator,
            "advantage estimator",
            {},
            _resolve(registry, "advantage_estimator", "algorithm.adv_estimator", cfg.algorithm.adv_estimator, choices),
        ),
        (
            "actor.policy_loss",
            a.policy_loss,
            "policy loss",
            _BEFORE_UPDATE,
            _resolve(registry, "policy_loss", "actor.policy_loss", a.policy_loss, choices),
        ),
    ]
    requires: list[str] = []
    for key, name, what, later, plugin in users:
        for f in tuple(getattr(plugin, "requires", ()) or ()):
            _check_producible(cfg, registry, f"{key}={name}", what, str(f), later)
            if f not in requires:
                requires.append(str(f))
    for f in rollout_correction_requires(cfg):  # algorithm.rollout_correction reads these (once per step)
        _check_producible(cfg, registry, "algorithm.rollout_correction", "rollout correction", f, {})
        if f not in requires:
            requires.append(f)
    use_critic = bool(cfg.critic.enable) if cfg.critic.enable is not None else "values" in requires
    return BatchPlan(
        requires=tuple(requires),
        use_critic=use_critic,
        use_ref=bool(a.use_kl_loss or cfg.algorithm.use_kl_in_reward or "ref_log_probs" in requires),
        baseline="reward_baselines" in requires,
        per_token=tuple(f for f in requires if f in PER_TOKEN_QUANTITIES),
    )


def skips_old_log_probs(cfg: DictConfig, plan: BatchPlan, capabilities: frozenset[str]) -> bool:
    """Whether the old-log-prob pass is skipped (``actor.skip_old_log_prob_on_policy``): one optimizer
    step over the whole batch, nothing reading ``old_log_probs`` or a per-token quantity before the
    update (the in-reward KL, a plugin's ``requires``, a KL-guard alert without the engine's log-probs:
    :func:`rlplug.run.alerts.needs_old_log_probs`), and a backend declaring
    ``"reuses_on_policy_log_probs"``: the actor update then uses its own detached log-probs. Also
    skipped in bypass mode (``algorithm.rollout_correction.bypass_mode``), where the engine's
    log-probs are the old ones (:func:`rlplug.algorithms.rollout_correction.use_rollout_log_probs_as_old`)."""
    return bypasses_old_log_probs(cfg) or bool(
        cfg.actor.skip_old_log_prob_on_policy
        and int(cfg.actor.ppo_epochs) == 1
        and int(cfg.actor.ppo_mini_batch_size) == int(cfg.data.train_batch_size)
        and not cfg.algorithm.use_kl_in_reward
        and not plan.needs_old_log_prob_pass
        and "reuses_on_policy_log_probs" in capabilities
        and not needs_old_log_probs(cfg, plan.use_ref)  # the KL guard (trainer.alerts) compares them with ref
    )


def _check_producible(cfg: DictConfig, registry: Registry, who: str, what: str, f: str, later: dict[str, str]) -> None:
    if f in later:
        return
    if f not in BATCH_FIELD_PRODUCERS:
        known = "; ".join(f"{k}: {v}" for k, v in BATCH_FIELD_PRODUCERS.items())
        raise ConfigError(
            f"{who} requires the batch field '{f}', but no stage produces it. The fields and what produces them: "
            f"{known}. Fix the {what}'s requires (a typo?) or choose another {what}."
        )
    producer = BATCH_FIELD_PRODUCERS[f]
    if f == "rollout_log_probs" and not cfg.rollout.calculate_log_probs:
        raise ConfigError(
            f"{who} requires the batch field 'rollout_log_probs', produced by {producer}, but "
            "rollout.calculate_log_probs=false. Set rollout.calculate_log_probs=true."
        )
    if f == "values" and cfg.critic.enable is not None and not cfg.critic.enable:
        raise ConfigError(
            f"{who} requires the batch field 'values', produced by {producer}, but critic.enable=false. "
            "Set critic.enable=true, or leave it unset (null) so the critic follows the plugins' requires."
        )
    if f in PER_TOKEN_QUANTITIES:
        name = cfg.trainer.backend
        reg, classes = _backend_classes(cfg, registry)
        lacking = [c for c in classes if f not in frozenset(getattr(c, "per_token_outputs", ()) or ())]
        if lacking or not classes:
            outputs = sorted(frozenset(getattr(lacking[0], "per_token_outputs", ()) or ())) if lacking else []
            label = ", ".join(c.__qualname__ for c in lacking) or repr(reg.obj)
            raise ConfigError(
                f"{who} requires the batch field '{f}', produced by {producer}, but trainer.backend={name} "
                f"({label}, {reg.distribution} {reg.version}) does not compute it: its per_token_outputs lists "
                f"{outputs or 'nothing'}. Choose a training backend that lists '{f}' in per_token_outputs, "
                f"or another {what}."
            )


def _backend_classes(cfg: DictConfig, registry: Registry) -> tuple[Any, list[type]]:
    """``trainer.backend``'s registration and the classes it builds; :class:`ConfigError` for an unknown name."""
    name = cfg.trainer.backend
    try:
        reg = registry.registration("training_backend", str(name))
    except PluginError as exc:
        raise ConfigError(f"trainer.backend={name}: {exc}") from exc
    return reg, list(built_classes(reg.obj, reg.extra))


def _check_capability(cfg: DictConfig, registry: Registry, who: str, capability: str) -> None:
    """Raise :class:`ConfigError` unless every class ``trainer.backend`` builds declares ``capability``."""
    name = cfg.trainer.backend
    reg, classes = _backend_classes(cfg, registry)
    lacking = [c for c in classes if capability not in frozenset(getattr(c, "capabilities", ()) or ())]
    if lacking or not classes:
        label = ", ".join(c.__qualname__ for c in lacking) or repr(reg.obj)
        raise ConfigError(
            f"{who} computes statistics of the whole mini-batch (PolicyLoss.minibatch_stats), but trainer.backend="
            f"{name} ({label}, {reg.distribution} {reg.version}) does not declare the capability '{capability}', "
            "so it would never call them. Choose a training backend that declares it (local, fsdp2: they build on "
            "rlplug.training.backend.TrainingBackendBase) or another policy loss."
        )


def validate_config(cfg: DictConfig, registry: Registry | None = None) -> list[PluginChoice]:
    """Check ``cfg`` and resolve its plugins; return the choices with their providers.

    Raises :class:`ConfigError` on the first problem found.
    """
    registry = registry or get_registry()
    choices: list[PluginChoice] = []
    a, d, r = cfg.actor, cfg.data, cfg.rollout
    check_counts(cfg)  # the run's length and batch counts: impossible values first, before anything is built

    estimator = _resolve(
        registry, "advantage_estimator", "algorithm.adv_estimator", cfg.algorithm.adv_estimator, choices
    )
    loss = _resolve(registry, "policy_loss", "actor.policy_loss", a.policy_loss, choices)
    kl_keys = []
    if a.use_kl_loss:
        kl_keys.append(("actor.kl_loss_type", a.kl_loss_type))
    if cfg.algorithm.use_kl_in_reward:
        kl_keys.append(("algorithm.kl_penalty", cfg.algorithm.kl_penalty))
    for key, name in kl_keys:
        _resolve(registry, "kl_penalty", key, name, choices)
    _resolve(registry, "rollout_backend", "rollout.name", r.name, choices)
    _resolve(registry, "training_backend", "trainer.backend", cfg.trainer.backend, choices)
    for i, name in enumerate(tracker_names(cfg.trainer)):  # + prometheus when trainer.prometheus.port is set
        key = "trainer.prometheus.port" if name == "prometheus" else f"trainer.logger[{i}]"
        _resolve(registry, "tracker", key, name, choices)
    reward_names = {f"reward.reward_fn_map.{k}": v for k, v in cfg.reward.reward_fn_map.items()}
    if cfg.reward.default:
        reward_names["reward.default"] = cfg.reward.default
    for i, s in enumerate(cfg.reward.shaping):
        reward_names[f"reward.shaping[{i}].name"] = s.name
    for key, name in reward_names.items():
        _resolve(registry, "reward_function", key, name, choices)
    load_custom_reward_function(cfg.reward.custom_reward_function)  # its file, function and reward_kwargs
    check_reward_model_config(cfg.reward)  # reward.reward_model: a one-label sequence classifier's folder
    _check_batch_filter(cfg, registry, choices)
    _check_multi_turn(cfg, registry, choices)
    check_async_config(cfg)  # trainer.async_mode and what goes with it (rlplug.run.async_pipeline)
    check_colocate_config(cfg)  # rollout.colocate, rollout.tensor_model_parallel_size (rlplug.rollout.colocate)
    plan = plan_batch(cfg, registry)  # every required batch field has a producer
    # algorithm.rollout_correction and its alias; a loss with PolicyLoss.bypass_mode pairs with bypass mode
    validate_rollout_correction(cfg, plan.per_token, loss_is_bypass=bool(getattr(loss, "bypass_mode", False)))
    check_alert_config(cfg, plan, registry)  # trainer.alerts: rules and the metrics they name
    # algorithm.schedule, rollout.n_schedule: every phase, every n, each checked by this function
    check_schedule_config(cfg, registry, validate=validate_config)
    check_lora_config(cfg, registry)  # model.lora_rank / critic.model.lora_rank: settings, backend capability
    check_dump_config(cfg)  # trainer.dump_rollouts_freq (rlplug.run.dump)

    # ---- algorithm constraints
    if getattr(estimator, "group_based", False) and r.n < 2:
        raise ConfigError(
            f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} compares responses within a group, but "
            f"rollout.n={r.n}: a group of one response has no baseline. Set rollout.n to 2 or more (e.g. rollout.n=4)."
        )
    _check_critic_warmup(cfg, plan)
    if getattr(estimator, "validate", None) is not None:
        try:
            estimator.validate(cfg.algorithm)
        except ValueError as exc:
            raise ConfigError(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator}: {exc}") from exc
    if loss.validate is not None:
        try:
            loss.validate(a)
        except ValueError as exc:
            raise ConfigError(f"actor.policy_loss={a.policy_loss}: {exc}") from exc
    if getattr(loss, "minibatch_stats", None) is not None:
        _check_capability(cfg, registry, f"actor.policy_loss={a.policy_loss}", "policy_loss_minibatch_stats")
    for key, mode in (("actor.loss_agg_mode", a.loss_agg_mode), ("critic.loss_agg_mode", cfg.critic.loss_agg_mode)):
        if mode is not None and mode not in LOSS_AGG_MODES:
            raise ConfigError(f"{key}={mode} is not a loss aggregation mode. Use one of: {', '.join(LOSS_AGG_MODES)}.")
    if a.loss_scale_factor is not None and not a.loss_scale_factor > 0:
        raise ConfigError(
            f"actor.loss_scale_factor={a.loss_scale_factor}: it divides the seq-mean-token-sum-norm loss, so it must "
            "be > 0 (tokens, e.g. data.max_response_length), or null for data.max_response_length."
        )
    if cfg.algorithm.kl_ctrl.type not in KL_CONTROLLER_TYPES:
        raise ConfigError(
            f"algorithm.kl_ctrl.type={cfg.algorithm.kl_ctrl.type}: use one of {', '.join(KL_CONTROLLER_TYPES)}."
        )
    if cfg.algorithm.kl_ctrl.type == "adaptive" and cfg.algorithm.kl_ctrl.horizon <= 0:
        raise ConfigError(
            f"algorithm.kl_ctrl.horizon={cfg.algorithm.kl_ctrl.horizon}: the adaptive controller needs horizon > 0."
        )

    # ---- batch sizes (prompts, as verl); data.train_batch_size, rollout.n, ppo_* counts: check_counts
    _positive(a.micro_batch_size_per_device, "actor.micro_batch_size_per_device")
    budgets = token_budgets(cfg)  # actor.use_dynamic_bsz: micro_batch_size_per_device is not used
    a_micro = 1 if budgets["actor"] is not None else a.micro_batch_size_per_device
    _check_minibatch("actor", d.train_batch_size, a.ppo_mini_batch_size, a_micro, r.n)
    if plan.use_critic:
        c = cfg.critic
        mini = c.ppo_mini_batch_size if c.ppo_mini_batch_size is not None else a.ppo_mini_batch_size
        micro = (
            c.micro_batch_size_per_device
            if c.micro_batch_size_per_device is not None
            else a.micro_batch_size_per_device
        )
        _positive(mini, "critic.ppo_mini_batch_size")
        _positive(micro, "critic.micro_batch_size_per_device")
        _check_minibatch("critic", d.train_batch_size, mini, 1 if budgets["critic"] is not None else micro, r.n)
    _positive(d.max_response_length, "data.max_response_length")
    _positive(d.max_prompt_length, "data.max_prompt_length")
    longest = d.max_prompt_length + d.max_response_length
    budget_keys = {
        "actor": "actor.max_token_len_per_device",
        "log_prob": "actor.log_prob_max_token_len_per_device (None: actor.max_token_len_per_device)",
        "critic": "critic.max_token_len_per_device (None: actor.max_token_len_per_device)",
        "values": "critic.forward_max_token_len_per_device (None: critic.max_token_len_per_device)",
    }
    for role, budget in budgets.items():
        if budget is not None and (role in ("actor", "log_prob") or plan.use_critic) and budget < longest:
            raise ConfigError(
                f"{budget_keys[role]} = {budget} tokens is smaller than the longest sequence a batch can hold: "
                f"data.max_prompt_length + data.max_response_length = {d.max_prompt_length} + "
                f"{d.max_response_length} = {longest}. With use_dynamic_bsz=true every micro-batch holds at least "
                f"one whole sequence: set the budget to at least {longest} (e.g. {4 * longest})."
            )
    if not r.temperature > 0.0:
        raise ConfigError(
            f"rollout.temperature={r.temperature}: training samples responses and computes their log-probs at this "
            "temperature, so it must be > 0 (e.g. 1.0). Greedy decoding is for validation: rollout.val_kwargs.temperature=0."
        )
    if not 0.0 < r.top_p <= 1.0:
        raise ConfigError(f"rollout.top_p={r.top_p} must be in (0, 1].")
    if a.rollout_is_threshold is not None:
        if not a.rollout_is_threshold > 0:
            raise ConfigError(
                f"actor.rollout_is_threshold={a.rollout_is_threshold} must be > 0 (the cap of the importance weight, "
                "e.g. 2.0), or null to turn the correction off."
            )
        if not r.calculate_log_probs:
            raise ConfigError(
                "actor.rollout_is_threshold is set but rollout.calculate_log_probs=false, so the rollout engine returns "
                "no log-probs to correct against. Set rollout.calculate_log_probs=true."
            )

    # ---- model and data sources
    m = cfg.model
    if m.source not in ("default", "path", "tiny"):
        raise ConfigError(f"model.source={m.source}: use 'default', 'path' or 'tiny'.")
    if m.compute_dtype not in ("auto", "bf16", "fp32"):
        raise ConfigError(
            f"model.compute_dtype={m.compute_dtype}: use 'auto' (bf16 where bf16 matmuls are fast, else fp32), "
            "'bf16' (autocast, fp32 master weights) or 'fp32'."
        )
    if str(cfg.rollout.dtype).lower() not in DTYPE_CHOICES:
        raise ConfigError(f"rollout.dtype={cfg.rollout.dtype}: use one of {', '.join(DTYPE_CHOICES)}.")
    for key, optim in (("actor.optim", a.optim), ("critic.optim", cfg.critic.optim)):
        if optim.warmup_style not in ("constant", "cosine"):
            raise ConfigError(f"{key}.warmup_style={optim.warmup_style}: use 'constant' or 'cosine'.")
        _check_lr_schedule(key, optim)
    check_normalize_config(cfg.reward.normalize)  # reward.normalize: momentum, clip, eps
    _check_critic_loss(cfg.critic)
    if plan.use_critic:
        _check_critic_model(cfg.critic.model)
    device = str(cfg.trainer.device)
    if device not in ("auto", "cpu", "cuda") and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise ConfigError(
            f"trainer.device={device}: use 'auto' (cuda when available, else cpu), 'cpu', 'cuda' or 'cuda:N'."
        )
    if m.source == "path" or (m.source == "default" and m.path):
        if not m.path:
            raise ConfigError(
                "model.source=path needs model.path: the folder of a Hugging Face model (config.json, weights, tokenizer)."
            )
        p = Path(str(m.path)).expanduser()
        if not (p / "config.json").is_file():
            raise ConfigError(
                f"model.path={m.path}: no Hugging Face model folder there (expected {p / 'config.json'}). "
                "Pass the folder that holds config.json, the weights and the tokenizer."
            )
    if m.source == "tiny" and m.path and not Path(str(m.path)).expanduser().exists():
        raise ConfigError(
            f"model.path={m.path} does not exist, and model.source=tiny (debug=tiny or model=tiny) replaces it with "
            "the tiny random-weight model anyway. Remove model.path, or fix it and drop debug=tiny / model=tiny."
        )
    if not d.train_files and not d.task:
        raise ConfigError(
            "No training data: set data.train_files=[...] (parquet in verl's schema) or data.task=<reasoning-gym task>."
        )
    check_train_weights(list(d.train_files or []), list(d.train_weights or []))  # data.train_weights: before any file
    for key in ("train_files", "val_files"):
        for f in d[key]:
            if not Path(str(f)).expanduser().is_file():
                raise ConfigError(
                    f"data.{key}: file {f} does not exist. Prepare one with 'rlplug data prepare TASK --out DIR'."
                )
    check_data_config(cfg)  # data.special_tokens_in_text; a file with 0 rows says so (parquet footer only)
    if cfg.trainer.max_ckpt_to_keep is not None and cfg.trainer.max_ckpt_to_keep < 1:
        raise ConfigError(
            f"trainer.max_ckpt_to_keep={cfg.trainer.max_ckpt_to_keep}: keep at least 1 checkpoint, "
            "or set it to null to keep them all."
        )
    if cfg.trainer.resume_mode not in ("auto", "disable", "resume_path"):
        raise ConfigError(f"trainer.resume_mode={cfg.trainer.resume_mode}: use 'auto', 'disable' or 'resume_path'.")
    if cfg.trainer.resume_mode == "resume_path" and not cfg.trainer.resume_from_path:
        raise ConfigError("trainer.resume_mode=resume_path needs trainer.resume_from_path=<checkpoint dir>.")
    if cfg.trainer.overwrite and cfg.trainer.resume_mode != "disable":
        raise ConfigError(
            f"trainer.overwrite=true moves the run directory's checkpoints aside to start a fresh run, but "
            f"trainer.resume_mode={cfg.trainer.resume_mode} resumes one. To start fresh, add trainer.resume_mode=disable; "
            "to resume, drop trainer.overwrite."
        )
    return choices


def _check_batch_filter(cfg: DictConfig, registry: Registry, choices: list[PluginChoice]) -> None:
    """Resolve and validate the batch filter (``algorithm.batch_filter``, or ``filter_groups`` with
    ``algorithm.filter_groups.enable``; :func:`rlplug.run.batch_filter.batch_filter_name`) and the overlong
    shaping settings (:func:`rlplug.rewards.manager.overlong_config`); raises :class:`ConfigError`."""
    from rlplug.run.batch_filter import batch_filter_name  # deferred: torch

    overlong_config(_section(cfg.reward))
    name = batch_filter_name(cfg.algorithm)
    if name is None:
        return
    # algorithm.filter_groups.enable=true is verl's spelling of algorithm.batch_filter=filter_groups
    setting = f"algorithm.batch_filter={name}" if cfg.algorithm.batch_filter else "algorithm.filter_groups.enable=true"
    batch_filter = _resolve(registry, "batch_filter", "algorithm.batch_filter", name, choices)
    if getattr(batch_filter, "validate", None) is not None:
        try:
            batch_filter.validate(cfg.algorithm)
        except ValueError as exc:
            raise ConfigError(f"{setting}: {exc}") from exc


#: the values of rollout.multi_turn.format and rollout.multi_turn.on_overflow
MULTI_TURN_FORMATS = ("tags", "hermes")
ON_OVERFLOW = ("truncate", "end")


def _check_multi_turn(cfg: DictConfig, registry: Registry, choices: list[PluginChoice]) -> None:
    """``rollout.multi_turn``: with ``enable``, the environment and every tool resolve to registered plugins
    that pass their contracts, the format and overflow policy are known, the caps and timeouts positive.
    Without it, the settings that differ from the default are named in a ``UserWarning`` (a preset's no-tool
    baseline: ``experiment=calc_tool rollout.multi_turn.enable=false``), never dropped silently."""
    mt = cfg.rollout.multi_turn
    defaults = MultiTurnConfig()
    if not mt.enable:
        changed = [k for k in mt if k != "enable" and mt[k] != getattr(defaults, str(k), None)]
        if changed:
            # a preset's multi-turn settings with enable=false (its no-tool baseline): said, never silently dropped
            warnings.warn(
                "rollout.multi_turn.enable is false, so no multi-turn episode runs and these settings have no effect: "
                + ", ".join(f"rollout.multi_turn.{k}={mt[k]}" for k in changed)
                + ". Add rollout.multi_turn.enable=true to use them.",
                UserWarning,
                stacklevel=2,
            )
        return
    _resolve(registry, "environment", "rollout.multi_turn.environment", mt.environment, choices)
    for i, name in enumerate(mt.tools):
        _resolve(registry, "tool", f"rollout.multi_turn.tools[{i}]", name, choices)
    if mt.format not in MULTI_TURN_FORMATS:
        raise ConfigError(
            f"rollout.multi_turn.format={mt.format}: use one of {', '.join(MULTI_TURN_FORMATS)} (tags: "
            '<calculator>12*7</calculator>; hermes: <tool_call>{{"name": ..., "arguments": ...}}</tool_call>).'
        )
    if mt.on_overflow not in ON_OVERFLOW:
        raise ConfigError(f"rollout.multi_turn.on_overflow={mt.on_overflow}: use one of {', '.join(ON_OVERFLOW)}.")
    for key in (
        "max_assistant_turns",
        "max_user_turns",
        "max_parallel_calls",
        "max_tool_response_length",
        "tool_workers",
    ):
        if int(mt[key]) < 1:
            raise ConfigError(f"rollout.multi_turn.{key}={mt[key]}: must be at least 1.")
    for key in ("tool_timeout_s", "episode_timeout_s"):
        if not float(mt[key]) > 0:
            raise ConfigError(
                f"rollout.multi_turn.{key}={mt[key]}: must be > 0 seconds (a tool call or an episode without a "
                "deadline can hang training)."
            )
    if int(mt.tool_memory_mb) < 0:
        raise ConfigError(f"rollout.multi_turn.tool_memory_mb={mt.tool_memory_mb}: MiB >= 0 (0: no limit).")


def _check_critic_warmup(cfg: DictConfig, plan: BatchPlan) -> None:
    """``trainer.critic_warmup`` (steps in which only the critic is updated) needs a critic.

    Raises :class:`ConfigError` for a negative value, and for a positive one when no critic is
    trained (``plan.use_critic`` false): those steps would update nothing. A preset's warm-up
    never gets here without a critic (:func:`rlplug.config.compose.critic_follows_estimator` sets it to 0
    when composing), so this refuses a warm-up the user gave.
    """
    warmup, c = int(cfg.trainer.critic_warmup), cfg.critic
    if warmup < 0:
        raise ConfigError(f"trainer.critic_warmup={warmup} must be >= 0 (steps in which only the critic is updated).")
    if warmup > 0 and not plan.use_critic:
        why = (
            "critic.enable=false"
            if c.enable is not None
            else f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} needs no values and critic.enable is unset"
        )
        raise ConfigError(
            f"trainer.critic_warmup={warmup} keeps the actor frozen for the first {warmup} steps while the critic "
            f"learns the reward scale, but no critic is trained here ({why}), so those steps would "
            "train nothing. Set trainer.critic_warmup=0, or train a critic (critic.enable=true, or an estimator "
            "that needs values, e.g. algorithm=ppo)."
        )


def _check_lr_schedule(key: str, optim: Any) -> None:
    """The ratios of an ``optim`` section (``actor.optim`` / ``critic.optim``, named ``key``):
    ``lr_warmup_steps_ratio`` and ``lr_hold_ratio`` in [0, 1) with a sum of at most 1,
    ``min_lr_ratio`` in [0, 1] (verl asserts the same), and a hold only with the cosine schedule
    (the constant one has no floor to hold). Raises :class:`ConfigError`."""
    warmup, hold, floor = float(optim.lr_warmup_steps_ratio), float(optim.lr_hold_ratio), float(optim.min_lr_ratio)
    for name, value in (("lr_warmup_steps_ratio", warmup), ("lr_hold_ratio", hold)):
        if not 0.0 <= value < 1.0:
            raise ConfigError(
                f"{key}.{name}={value}: a share of the run's optimizer steps, so it must be in [0, 1) (e.g. 0.1)."
            )
    if not 0.0 <= floor <= 1.0:
        raise ConfigError(
            f"{key}.min_lr_ratio={floor}: the cosine floor as a share of lr must be in [0, 1] (e.g. 0.1)."
        )
    if hold > 0 and optim.warmup_style != "cosine":
        raise ConfigError(
            f"{key}.lr_hold_ratio={hold} holds the learning rate at the cosine schedule's floor (min_lr_ratio), but "
            f"{key}.warmup_style={optim.warmup_style} has no floor. Set {key}.warmup_style=cosine, or lr_hold_ratio=0."
        )
    if int(optim.lr_warmup_steps) <= 0 and warmup + hold > 1.0:
        raise ConfigError(
            f"{key}.lr_warmup_steps_ratio={warmup} + lr_hold_ratio={hold} > 1: warmup and hold would overlap. "
            "Lower one of them so that they leave room for the cosine decay."
        )


def _check_critic_loss(critic: Any) -> None:
    """``critic.loss_type`` is ``mse`` or ``huber``, and ``critic.huber_delta > 0``. Raises :class:`ConfigError`."""
    if critic.loss_type not in VALUE_LOSS_TYPES:
        raise ConfigError(
            f"critic.loss_type={critic.loss_type}: use one of {', '.join(VALUE_LOSS_TYPES)} (mse: verl's clipped "
            "squared error; huber: the clipped Huber loss with threshold critic.huber_delta)."
        )
    if critic.loss_type == "huber" and not float(critic.huber_delta) > 0:
        raise ConfigError(
            f"critic.huber_delta={critic.huber_delta}: the Huber threshold (in return units) must be > 0 (e.g. 1.0)."
        )


def _check_critic_model(critic_model: Any) -> None:
    """``critic.model`` names a known source and, with ``path`` set, an existing model folder (cheap:
    no tokenizer or weights load; the tokenizer is checked when the backend starts,
    :func:`rlplug.training.models.resolve_critic_model_path`). Raises :class:`ConfigError`."""
    from rlplug.training.models import ModelPreparationError, critic_model_folder  # deferred: torch

    if critic_model.source == "tiny" and not critic_model.path:
        return  # a valid tiny critic: its folder is built (once) when the backend starts
    try:
        critic_model_folder(critic_model)
    except (ModelPreparationError, ValueError) as exc:
        raise ConfigError(str(exc)) from exc


#: the counts :func:`check_counts` refuses below 1: key -> (what it counts, an example); None is not allowed
#: for these keys except where the schema documents it (trainer.total_training_steps, critic.ppo_epochs)
COUNT_KEYS: dict[str, tuple[str, str]] = {
    "trainer.total_training_steps": (
        "the number of training steps",
        "100, or null to train trainer.total_epochs passes over the data",
    ),
    "trainer.total_epochs": ("the number of passes over the training data", "1"),
    "data.train_batch_size": ("the prompts per training step", "8"),
    "actor.ppo_mini_batch_size": ("the prompts per optimizer step of the actor", "a divisor of data.train_batch_size"),
    "actor.ppo_epochs": ("the passes of the actor's update over each batch", "1"),
    "rollout.n": ("the responses sampled per prompt", "1 for PPO, 4 for GRPO"),
    "critic.ppo_epochs": ("the passes of the critic's update over each batch", "1, or null for actor.ppo_epochs"),
}
#: keys of :data:`COUNT_KEYS` whose None the schema documents (a default taken from elsewhere)
_NULLABLE_COUNTS = ("trainer.total_training_steps", "critic.ppo_epochs")


def check_counts(cfg: Any) -> None:
    """Refuse a run length or batch count below 1 (:data:`COUNT_KEYS`): ``trainer.total_training_steps``
    (None: ``total_epochs`` x the steps per epoch), ``trainer.total_epochs``, ``data.train_batch_size``,
    ``actor.ppo_mini_batch_size``, ``actor.ppo_epochs``, ``rollout.n`` and ``critic.ppo_epochs`` (None: the
    actor's). verl's spellings (``actor_rollout_ref.rollout.n``, ``actor_rollout_ref.actor.ppo_epochs`` ...)
    land on these keys (:mod:`rlplug.config.verl_keys`). No key of these documents -1 or 0 (unlike
    ``rollout.top_k=-1``, ``trainer.test_freq=-1``, which keep their meaning): a run with 0 or -1 steps
    would end before its first step with an exit code of 0, and a count of 0 divides nothing.

    Raises :class:`ConfigError` naming the key, the value, what it counts and an example.
    """
    for key, (what, example) in COUNT_KEYS.items():
        value = config_get(cfg, key)  # free-form: a table of dotted keys, read raw (null is checked here)
        if value is None and key in _NULLABLE_COUNTS:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(
                f"{key}={_show(value)}{_verl_spelling(key)}: {what} must be an integer >= 1 (e.g. {example})."
            )


def _verl_spelling(key: str) -> str:
    """`` (verl's K)`` for an rlplug key that verl spells otherwise (the key table's mapped rows), else ``""``."""

    names = [r.key for r in TABLE if r.kind == MAPPED and r.target == key and r.key != key]
    return f" (verl's {' or '.join(names)})" if names else ""


def _show(value: Any) -> str:
    return "null" if value is None else str(value)


def _positive(value: Any, key: str) -> None:
    if value is None or int(value) <= 0:
        raise ConfigError(f"{key}={value} must be a positive integer.")


def _check_minibatch(role: str, train_batch_size: int, mini: int, micro: int, n: int) -> None:
    if mini > train_batch_size:
        raise ConfigError(
            f"{role}.ppo_mini_batch_size={mini} is larger than data.train_batch_size={train_batch_size} "
            f"(both count prompts). Set {role}.ppo_mini_batch_size to at most {train_batch_size}."
        )
    if train_batch_size % mini:
        raise ConfigError(
            f"data.train_batch_size={train_batch_size} is not a multiple of {role}.ppo_mini_batch_size={mini}; "
            f"each step must split into whole mini-batches. Choose a divisor of {train_batch_size}."
        )
    responses = mini * n
    if responses % micro:
        raise ConfigError(
            f"{role}.micro_batch_size_per_device={micro} does not divide the mini-batch of {responses} responses "
            f"({role}.ppo_mini_batch_size={mini} x rollout.n={n}). Choose a divisor of {responses}."
        )
