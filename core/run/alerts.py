"""Metric alerts (``trainer.alerts``) and the KL guard.

A rule watches one logged metric of every training step and acts when the metric leaves a band::

    trainer:
      alerts:
        - {name: kl_guard, metric: actor/kl_seq_sum, max: 10.0, action: stop}
        - {metric: actor/grad_norm, max: 5.0, action: scale_lr, factor: 0.5, patience: 3}

Keys of a rule (:data:`RULE_KEYS`):

* ``metric``: a metric name as logged (``actor/ppo_kl``, ``val-core/<data_source>/acc/mean@1`` ...);
* ``max`` or ``min`` (exactly one): the condition holds when the value is above ``max`` (``>``) or
  below ``min`` (``<``). A non-finite value (NaN, inf) or a metric missing from the step never holds,
  and resets the count. A rule whose threshold is ``null`` is off: a preset can leave a floor for
  the user to set;
* ``action``: ``warn`` | ``stop`` | ``scale_lr`` | ``scale_kl_coef`` (below);
* ``factor``: for the two scale actions, the multiplier (``> 0``, e.g. 0.5);
* ``patience`` (default 1): the rule fires on the step its condition has held for ``patience``
  consecutive steps; the count then starts again from 0, so a condition that keeps holding fires
  again every ``patience`` steps;
* ``name`` (default ``<metric>_max`` / ``<metric>_min`` with ``/`` as ``_``): unique; the metric
  ``alerts/<name>`` is 1.0 on the steps the rule fires, else 0.0;
* ``role`` (``scale_lr``): ``actor`` or ``critic``; default: the role the metric belongs to
  (``critic`` for the critic update's metrics, :data:`CRITIC_ROLE_METRICS`; else ``actor``);
* ``optional`` (default false): a rule whose metric this run does not log is dropped (an info line)
  instead of being a config error; the preset ``alerts=default`` marks every rule so.

Actions:

* ``warn``: a console warning line, ``alerts/<name>`` = 1.0 and a tracker tag
  ``rlplug.alert.<name>`` (trackers with a ``set_tags`` method: ``mlflow``);
* ``stop``: the checkpoint of the finished step is saved, then :class:`AlertStopped` ends the run
  with exit code 5 (:attr:`rlplug.base.exit_codes.ExitCode.ALERT_STOP`) and a message naming the rule,
  the value, how to resume (the same command resumes; the counts of every rule are in the
  checkpoint, and the rule that fired starts from 0) and what to change first, e.g. the override
  that halves the learning rate (:func:`lower_lr`), which the resume applies;
* ``scale_lr``: the role's learning rate is multiplied by ``factor`` from the next step on
  (the backend's ``scale_lr``, :meth:`rlplug.training.backend.TrainingBackendBase.scale_lr`, scales the
  schedule's base rates, which its checkpoint holds); ``alerts/lr_scale/<role>`` logs the product.
  A resume with another ``<role>.optim.lr`` keeps the factors: the rate is then the new one times the
  schedule's multiplier times the factors in force at the checkpoint;
* ``scale_kl_coef``: multiplies every active KL coefficient: ``actor.kl_loss_coef`` when
  ``actor.use_kl_loss`` and the in-reward controller's value (:mod:`rlplug.algorithms.kl_control`) when
  ``algorithm.use_kl_in_reward``; ``alerts/kl_coef_scale`` logs the product. The controller's value
  is in its own checkpoint state; the KL-loss scale is in this module's (re-applied on resume).

Names are checked at start (:func:`check_alert_config`, run by :func:`rlplug.run.validate.validate_config`):
a rule's metric must be declared by the trainer (:data:`TRAINER_METRICS`, conditional ones in
:func:`declared_metrics`) or by a selected plugin (an optional ``metrics`` attribute of patterns on the
plugin object or the class a factory builds, matched with :func:`fnmatch.fnmatchcase`); an undeclared
name is a :class:`rlplug.config.schema.ConfigError` listing close names (:mod:`difflib`). Names made at run
time (:data:`DYNAMIC_METRICS`: per data source, per reward component, per stage) are checked at the
first step that logs any name of the same pattern: absent then, the run stops with the same error.

The KL guard is the metric ``actor/kl_seq_sum`` (:func:`kl_seq_sum_metrics`), logged whenever a
reference model is in use. This module never imports a plugin.
"""

from __future__ import annotations

import difflib
import logging
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from omegaconf import open_dict, read_write

from rlplug.base.exit_codes import AlertStopped
from rlplug.config.schema import ConfigError, RunConfig, config_get, typed
from rlplug.contracts.kinds import built_classes

__all__ = [
    "ALERT_ACTIONS",
    "RULE_KEYS",
    "KL_SEQ_SUM",
    "TRAINER_METRICS",
    "DYNAMIC_METRICS",
    "CRITIC_ROLE_METRICS",
    "AlertRule",
    "AlertEngine",
    "parse_rules",
    "declared_metrics",
    "check_alert_config",
    "kl_seq_sum_metrics",
    "needs_old_log_probs",
    "lower_lr",
]

log = logging.getLogger("rlplug")

#: the keys a rule may have (others are a config error)
RULE_KEYS: tuple[str, ...] = ("metric", "max", "min", "action", "factor", "patience", "name", "role", "optional")

#: the values of a rule's ``action``
ALERT_ACTIONS: tuple[str, ...] = ("warn", "stop", "scale_lr", "scale_kl_coef")

#: the KL guard metric (:func:`kl_seq_sum_metrics`)
KL_SEQ_SUM = "actor/kl_seq_sum"

#: what the trainer logs on every run (names or :mod:`fnmatch` patterns); see also :func:`declared_metrics`
TRAINER_METRICS: tuple[str, ...] = (
    "training/global_step",
    "training/epoch",
    "training/*",
    "timing_s/step",
    "timing_s/gen",
    "timing_s/reward",
    "timing_s/reward_wait",
    "timing_s/adv",
    "timing_s/update_actor",
    "timing_s/update_weights",
    "perf/total_num_tokens",
    "perf/throughput",
    "perf/gen_tokens_per_s",
    "perf/rss_gb",
    "timing_s/malloc_trim",
    "critic/score/mean",
    "critic/score/max",
    "critic/score/min",
    "critic/rewards/mean",
    "critic/rewards/max",
    "critic/rewards/min",
    "critic/advantages/mean",
    "critic/advantages/max",
    "critic/advantages/min",
    "critic/returns/mean",
    "critic/returns/max",
    "critic/returns/min",
    "response_length/mean",
    "response_length/max",
    "response_length/min",
    "response_length/clip_ratio",
    "response_length/empty",
    "prompt_length/mean",
    "prompt_length/max",
    "prompt_length/min",
    "reward/failures",
    "reward/timeouts",
    "reward/failed_samples",
    "reward/worker_restarts",
)

#: names made at run time, checked at the first step that logs a name of the same pattern
DYNAMIC_METRICS: tuple[str, ...] = (
    "val-core/*",  # per data source: val-core/<data_source>/acc/mean@N
    "val-aux/*",
    "critic/*/mean",  # per reward component: critic/<name>/mean
    "timing_s/*",  # one per stage that ran
    "rollout_corr/*",
    "batch_filter/*",
)

#: the critic update's metrics: a ``scale_lr`` rule on one of these scales the critic's learning rate
CRITIC_ROLE_METRICS: tuple[str, ...] = (
    "critic/vf_loss",
    "critic/vf_clipfrac",
    "critic/grad_norm",
    "critic/lr",
    "critic/nonfinite_skipped",
    "critic/vf_explained_var",
    "critic/values/*",
)


@dataclass(frozen=True)
class AlertRule:
    """One checked rule of ``trainer.alerts`` (see the module docstring for the keys; :func:`parse_rules`)."""

    name: str
    metric: str
    threshold: float
    above: bool  #: True: ``max`` (fires above), False: ``min`` (fires below)
    action: str
    factor: float = 1.0
    patience: int = 1
    role: str = "actor"
    optional: bool = False

    def holds(self, value: float | None) -> bool:
        """Whether ``value`` is outside the band: ``> max`` or ``< min``; never for None or non-finite."""
        if value is None or not math.isfinite(value):
            return False
        return value > self.threshold if self.above else value < self.threshold

    def describe(self, value: float) -> str:
        """``"actor/ppo_kl = 0.05 above max 0.03"``."""
        return f"{self.metric} = {value:.6g} {'above max' if self.above else 'below min'} {self.threshold:g}"


def _get(rule: Any, key: str) -> Any:
    if isinstance(rule, Mapping):
        return rule.get(key)
    return getattr(rule, key, None)


def _number(where: str, key: str, value: Any, *, integer: bool = False, hint: str = "") -> float:
    """``value`` of rule key ``key`` as a finite float (an int when ``integer``): a number or a numeric
    string. Raises :class:`rlplug.config.schema.ConfigError` naming the rule for anything else (a bool, a list,
    text, NaN/inf, a fraction where a count is expected); ``hint`` is appended to the message."""

    what = "an int" if integer else "a finite number"
    if integer and isinstance(value, int) and not isinstance(value, bool):
        return value
    try:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise TypeError
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{where}: {key}={value!r} is not a number; expected {what}{hint}.") from None
    if not math.isfinite(number) or (integer and not number.is_integer()):
        raise ConfigError(f"{where}: {key}={value!r}; expected {what}{hint}.")
    return int(number) if integer else number


def parse_rules(alerts: Iterable[Any] | None) -> list[AlertRule]:
    """The rules of ``trainer.alerts`` (a list of mappings with the keys :data:`RULE_KEYS`), checked.

    Rules whose threshold is ``null`` are off and left out (logged). Raises
    :class:`rlplug.config.schema.ConfigError` naming the rule (``trainer.alerts[i]``) for: no ``metric``; both
    ``max`` and ``min``; a key not in :data:`RULE_KEYS` (with the close key); an unknown ``action`` (listing :data:`ALERT_ACTIONS`); a scale action without a
    ``factor > 0``; ``patience < 1``; a ``role`` other than ``actor``/``critic``; a duplicate ``name``; a
    value of the wrong type (``metric``/``name`` not a string, ``max``/``min``/``factor`` not a finite number,
    ``patience`` not an int, ``optional`` not a bool).
    """

    rules: list[AlertRule] = []
    for i, raw in enumerate(alerts or ()):
        where = f"trainer.alerts[{i}]"
        if not isinstance(raw, Mapping) and not hasattr(raw, "keys"):
            raise ConfigError(f"{where} is {raw!r}; each rule is a mapping, e.g. {{metric: actor/ppo_kl, max: 0.03}}.")
        for key in raw.keys():
            if key not in RULE_KEYS:
                close = difflib.get_close_matches(str(key), RULE_KEYS, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ConfigError(f"{where} has the unknown key {key!r}.{hint} A rule's keys: {', '.join(RULE_KEYS)}.")
        metric = _get(raw, "metric")
        if not metric:
            raise ConfigError(
                f"{where} has no metric. Each rule needs e.g. {{metric: actor/ppo_kl, max: 0.03, action: warn}}."
            )
        if not isinstance(metric, str):
            raise ConfigError(
                f"{where}: metric={metric!r} is not a metric name; expected a string (e.g. actor/ppo_kl)."
            )
        hi, lo = _get(raw, "max"), _get(raw, "min")
        if hi is not None and lo is not None:
            raise ConfigError(
                f"{where} (metric {metric}) sets both max={hi} and min={lo}; a rule has exactly one. "
                "Write two rules for a band."
            )
        raw_action = _get(raw, "action")
        action = "warn" if raw_action is None else raw_action
        if not isinstance(action, str) or action not in ALERT_ACTIONS:
            raise ConfigError(
                f"{where}: action={action!r} is not an alert action. Use one of: {', '.join(ALERT_ACTIONS)}."
            )
        factor = _get(raw, "factor")
        if factor is not None:
            factor = _number(where, "factor", factor)
        if action.startswith("scale_"):
            if factor is None or not factor > 0:
                raise ConfigError(
                    f"{where}: action={action} multiplies by factor, which must be > 0 (e.g. factor: 0.5); got {factor}."
                )
        raw_patience = _get(raw, "patience")
        patience = 1 if raw_patience is None else int(_number(where, "patience", raw_patience, integer=True))
        if patience < 1:
            raise ConfigError(f"{where}: patience={patience} must be >= 1 (consecutive steps before the rule fires).")
        role = _get(raw, "role")
        if role is None:
            role = "critic" if any(fnmatchcase(metric, p) for p in CRITIC_ROLE_METRICS) else "actor"
        if role not in ("actor", "critic"):
            raise ConfigError(
                f"{where}: role={role} must be 'actor' or 'critic' (whose learning rate scale_lr scales)."
            )
        default_name = re.sub(r"[^\w.-]+", "_", metric) + ("_max" if lo is None else "_min")
        raw_name = _get(raw, "name")
        if raw_name is not None and (isinstance(raw_name, bool) or not isinstance(raw_name, (str, int))):
            raise ConfigError(f"{where}: name={raw_name!r}; a rule's name is a string or an int (e.g. name: kl_guard).")
        name = str(raw_name or default_name)
        if any(r.name == name for r in rules):
            raise ConfigError(f"{where}: the rule name {name!r} is used twice; give each rule its own name.")
        threshold = hi if hi is not None else lo
        if threshold is None:
            log.info("alert %s (%s): no threshold set (max/min null), so the rule is off", name, metric)
            continue
        off = " (to turn the rule off, set it to null)"
        threshold = _number(where, "max" if hi is not None else "min", threshold, hint=off)
        optional = _get(raw, "optional")
        if isinstance(optional, str) and optional.strip().lower() in ("true", "false"):  # ${oc.env:...} is a string
            optional = optional.strip().lower() == "true"
        if optional is not None and not isinstance(optional, bool):
            raise ConfigError(f"{where}: optional={optional!r}; expected true or false.")
        rules.append(
            AlertRule(
                name=name,
                metric=metric,
                threshold=threshold,
                above=hi is not None,
                action=action,
                factor=factor if factor is not None else 1.0,
                patience=patience,
                role=str(role),
                optional=bool(optional),
            )
        )
    return rules


# ============================================================================ declarations


def _plugin_metrics(obj: Any, extra: Mapping[str, Any] | None = None) -> list[str]:

    out = [str(m) for m in getattr(obj, "metrics", ()) or ()]
    for cls in built_classes(obj, dict(extra or {})):
        out += [str(m) for m in getattr(cls, "metrics", ()) or ()]
    return out


def trainer_metrics(cfg: Any, plan: Any) -> list[str]:
    """What the trainer itself logs in this run (names or :mod:`fnmatch` patterns): :data:`TRAINER_METRICS`,
    ``alerts/*``, ``actor/entropy_rollout``, with a critic ``critic/values/*``, ``critic/vf_explained_var`` and ``critic/value_r2``,
    with a reference model ``actor/kl_seq_sum``, with the in-reward KL ``actor/reward_kl_penalty`` and
    ``actor/reward_kl_penalty_coeff``, with an in-reward or adaptive KL ``actor/kl_coef``, with
    ``reward.normalize.enable`` ``critic/score_norm/*``, and the timings of the stages that run. ``plan`` is :func:`rlplug.run.validate.plan_batch`'s result."""
    names = [*TRAINER_METRICS, "alerts/*", "actor/entropy_rollout"]
    if plan.use_critic:
        names += ["critic/values/mean", "critic/values/max", "critic/values/min", "critic/vf_explained_var"]
        names += ["critic/value_r2"]
        names += ["timing_s/values", "timing_s/update_critic"]
    if plan.use_ref:
        names += [KL_SEQ_SUM, "timing_s/ref"]
    if cfg.algorithm.use_kl_in_reward or cfg.algorithm.kl_ctrl.type == "adaptive":
        names += ["actor/kl_coef"]
    if cfg.algorithm.use_kl_in_reward:
        names += ["actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff"]
    if typed(RunConfig, cfg).reward.normalize.enable:
        names += ["critic/score_norm/mean", "critic/score_norm/std", "critic/score_norm/clipfrac"]
    return names


def declared_metrics(cfg: Any, plan: Any, registry: Any) -> list[str]:
    """The metric names (or :mod:`fnmatch` patterns) this run declares up front: :func:`trainer_metrics`
    and the ``metrics`` attribute of every selected plugin (on the registered object or the classes a
    factory builds): the advantage estimator, the policy loss, the training and the rollout backend.
    ``registry`` is a :class:`rlplug.contracts.registry.Registry`."""
    names = trainer_metrics(cfg, plan)
    for kind, name in (
        ("advantage_estimator", cfg.algorithm.adv_estimator),
        ("policy_loss", cfg.actor.policy_loss),
        ("training_backend", cfg.trainer.backend),
        ("rollout_backend", cfg.rollout.name),
    ):
        try:
            reg = registry.registration(kind, str(name))
        except Exception:  # an unknown name is validate_config's error, raised elsewhere
            continue
        names += _plugin_metrics(reg.obj, reg.extra)
    return names


def _matches(metric: str, patterns: Iterable[str]) -> bool:
    return any(fnmatchcase(metric, p) for p in patterns)


def _unknown_metric(rule: AlertRule, known: Iterable[str], when: str) -> Exception:

    pool = sorted(set(known))
    close = difflib.get_close_matches(rule.metric, pool, n=5, cutoff=0.5)
    hint = f" Close names: {', '.join(close)}." if close else ""
    return ConfigError(
        f"trainer.alerts rule {rule.name!r} watches the metric {rule.metric!r}, which {when}.{hint} "
        "Fix the name (metric names are listed in docs/alerts.md), mark the rule optional: true to drop it "
        "when the run does not log the metric, or remove it."
    )


def check_alert_config(
    cfg: Any, plan: Any, registry: Any, backend_classes: Iterable[type] | None = None
) -> tuple[list[AlertRule], set[str]]:
    """The rules of ``cfg.trainer.alerts`` this run keeps, checked against what it logs, and the names of
    those whose metric only a :data:`DYNAMIC_METRICS` pattern matches (checked again at run time).

    A rule's metric must match a declared name or pattern (:func:`declared_metrics`) or a
    :data:`DYNAMIC_METRICS` pattern (checked again at run time, :meth:`AlertEngine.observe`); an
    ``optional`` rule on an undeclared metric is dropped. Also checks that ``scale_kl_coef`` has an active
    KL coefficient, a ``critic`` role a critic, and ``scale_lr`` a backend declaring the capability
    ``"scale_lr"`` (``backend_classes``: the classes ``trainer.backend`` builds; None: looked up in ``registry``).
    Raises :class:`rlplug.config.schema.ConfigError` (close names from :mod:`difflib`).
    """

    rules = parse_rules(cfg.trainer.get("alerts"))
    if not rules:
        return [], set()
    declared = declared_metrics(cfg, plan, registry)
    kept: list[AlertRule] = []
    pending: set[str] = set()
    for rule in rules:
        if _matches(rule.metric, declared):
            kept.append(rule)
        elif rule.optional:  # the preset's rules: kept only where the run logs their metric
            log.info("alert %s dropped: this run does not log %s", rule.name, rule.metric)
        elif _matches(rule.metric, DYNAMIC_METRICS):
            kept.append(rule)
            pending.add(rule.name)
        else:
            raise _unknown_metric(rule, declared, "no plugin or the trainer declares")
    for rule in kept:
        if rule.action == "scale_kl_coef" and not (cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward):
            raise ConfigError(
                f"trainer.alerts rule {rule.name!r} has action scale_kl_coef, but no KL coefficient is active "
                "(actor.use_kl_loss=false and algorithm.use_kl_in_reward=false). Turn one on, or use another action."
            )
        if rule.action == "scale_lr" and rule.role == "critic" and not plan.use_critic:
            raise ConfigError(
                f"trainer.alerts rule {rule.name!r} scales the critic's learning rate, but this run trains no critic. "
                "Set role: actor."
            )
        if rule.action == "scale_lr":
            if backend_classes is None:
                reg = registry.registration("training_backend", str(cfg.trainer.backend))
                backend_classes = built_classes(reg.obj, reg.extra)
            backend_classes = list(backend_classes)
            caps = [frozenset(getattr(c, "capabilities", ()) or ()) for c in backend_classes]
            lacking = [c.__qualname__ for c, cap in zip(backend_classes, caps) if "scale_lr" not in cap]
            if lacking or not caps:
                raise ConfigError(
                    f"trainer.alerts rule {rule.name!r} has action scale_lr, but trainer.backend={cfg.trainer.backend} "
                    f"({', '.join(lacking) or 'its classes are not declared'}) does not declare the capability "
                    "'scale_lr'. Use a backend built on rlplug.training.backend.TrainingBackendBase (local, fsdp2) or "
                    "another action."
                )
    return kept, pending


def lower_lr(cfg: Any, role: str = "actor") -> str:
    """The override that halves ``role``'s configured learning rate (``actor.optim.lr=5e-05`` for a run at
    ``1e-4``), the advice of the stop messages (an alert's ``stop``, exit code 3); ``<role>.optim.lr=<lower>``
    when ``cfg`` has no rate. A resume applies a changed rate (``docs/reliability.md``)."""
    # free-form: the role is a name (actor, critic), and a config without a rate must read as unset, not 1e-6
    lr = config_get(cfg, f"{role}.optim.lr") if cfg is not None else None
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not lr > 0:
        return f"{role}.optim.lr=<lower>"
    return f"{role}.optim.lr={float(lr) / 2:g}"


def needs_old_log_probs(cfg: Any, use_ref: bool) -> bool:
    """Whether a rule watches the KL guard of a run with a reference model (``use_ref``) while the rollout
    engine returns no log-probs: the old-log-prob pass must then run (it is what :func:`kl_seq_sum_metrics`
    compares with the reference)."""
    if not use_ref or cfg.rollout.calculate_log_probs:
        return False
    return any(r.metric == KL_SEQ_SUM for r in parse_rules(cfg.trainer.get("alerts")))  # rules that are on


# ============================================================================ the KL guard


def kl_seq_sum_metrics(batch: Any) -> dict[str, float]:
    """``{"actor/kl_seq_sum": mean_b sum_t (log pi(y_t) - log pi_ref(y_t)) * mask}``: the mean over the
    ``B`` responses of the sequence-summed per-token KL to the reference (nats per response), the
    ``log pi(y) / pi_ref(y)`` single-sample estimate of the sequence KL ``KL(pi || pi_ref)`` that
    TRL logs as ``objective/kl`` (the ``k1`` estimator summed over the response; verl logs only the
    token mean, ``actor/reward_kl_penalty``).

    ``batch`` holds ``ref_log_probs`` and ``response_mask`` ``(B, T) float32`` and the policy's
    log-probs: ``old_log_probs`` (the policy before the update), else ``rollout_log_probs`` (the
    engine's). Returns ``{}`` without ``ref_log_probs`` or without either policy log-probs.
    """
    if "ref_log_probs" not in batch:
        return {}
    policy = batch.get("old_log_probs")
    if policy is None:
        policy = batch.get("rollout_log_probs")
    if policy is None:
        return {}
    valid = batch["response_mask"].to(policy.device) != 0
    diff = policy.float() - batch["ref_log_probs"].float().to(policy.device)
    # masked_fill, not a product with the mask: whatever masked positions hold (NaN, inf) stays out
    per_seq = diff.masked_fill(~valid, 0.0).sum(-1)
    return {KL_SEQ_SUM: float(per_seq.mean().item())} if per_seq.numel() else {}


# ============================================================================ the engine


class AlertEngine:
    """Evaluates the rules after every step and applies what fires (see the module docstring).

    State (``state_dict``, in the checkpoint as ``alerts``): each rule's consecutive count, how
    often it fired, the learning-rate scale per role and the KL scale. ``optional_state``: a
    checkpoint written before alerts existed resumes with fresh counts. Build it with
    :meth:`from_config`; the trainer calls :meth:`observe` on each step's metrics before they are
    logged, then :meth:`stop_if_fired` (which saves the checkpoint of the step before it raises).
    """

    optional_state = True

    def __init__(
        self, rules: list[AlertRule], cfg: Any = None, pending: Iterable[str] = (), own: Iterable[str] = ()
    ) -> None:
        self.rules = list(rules)
        self.cfg = cfg
        self.counts = {r.name: 0 for r in self.rules}
        self.fired = {r.name: 0 for r in self.rules}
        self.lr_scale: dict[str, float] = {}
        self.kl_scale = 1.0
        self.stopping: str | None = None  # the stop message, once a stop rule fired
        self._base_kl_loss_coef = float(cfg.actor.kl_loss_coef) if cfg is not None else None
        self._saved_kl_loss_coef: float | None = None  # the checkpoint's configured coefficient (load_state_dict)
        #: rules whose metric only a DYNAMIC_METRICS pattern matches: checked when their pattern is first logged
        self.pending = {r.name: r for r in self.rules if r.name in set(pending)}
        self._own = list(own)  # what the trainer logs itself: not evidence that a pattern's producer ran

    @classmethod
    def from_config(cls, cfg: Any, plan: Any, registry: Any, backend: Any = None) -> AlertEngine:
        """The engine of ``cfg.trainer.alerts`` (:func:`check_alert_config`); with ``backend`` (built), its
        class is checked for the capability ``scale_lr`` when a rule needs it (else the registered classes)."""
        classes = [type(backend)] if backend is not None else None
        rules, pending = check_alert_config(cfg, plan, registry, classes)
        return cls(rules, cfg, pending, trainer_metrics(cfg, plan))

    def evaluate(self, step: int, metrics: Mapping[str, float]) -> list[tuple[AlertRule, float]]:
        """Update the counts with step ``step``'s ``metrics``; returns the rules that fire, with the value.

        Raises :class:`rlplug.config.schema.ConfigError` for a rule whose run-time metric is absent from a step
        that logs other names of its pattern (:data:`DYNAMIC_METRICS`)."""
        self._check_pending(metrics)
        out = []
        for rule in self.rules:
            value = metrics.get(rule.metric)
            if value is None:  # not logged this step (validation every test_freq, critic warm-up): no change
                continue
            if not rule.holds(value):
                self.counts[rule.name] = 0
                continue
            self.counts[rule.name] += 1
            if self.counts[rule.name] >= rule.patience:
                self.counts[rule.name] = 0
                self.fired[rule.name] += 1
                out.append((rule, float(value)))  # type: ignore[arg-type]
        return out

    def _check_pending(self, metrics: Mapping[str, float]) -> None:
        for name, rule in list(self.pending.items()):
            if rule.metric in metrics:
                del self.pending[name]
                continue
            families = [p for p in DYNAMIC_METRICS if fnmatchcase(rule.metric, p)]
            logged = [k for k in metrics if _matches(k, families) and not _matches(k, self._own)]
            if logged:
                raise _unknown_metric(
                    rule, metrics, f"this run does not log (checked at the first step logging {families[0]})"
                )

    def observe(self, step: int, metrics: Mapping[str, float], trainer: Any) -> dict[str, float]:
        """Evaluate step ``step`` (on the main process; the others get its decisions) and apply what fires
        to ``trainer`` (its ``backend``, ``kl_ctrl``, ``cfg``, ``trackers``, ``coordinator``); returns the
        ``alerts/*`` metrics to log with the step."""
        if not self.rules:
            return {}
        coordinator = trainer.coordinator
        fired = self.evaluate(step, metrics) if coordinator.is_main else None
        if coordinator.world_size > 1:  # every process applies the same actions and keeps the same counts
            fired, state = coordinator.broadcast((fired, self.state_dict() if coordinator.is_main else None))
            self._load_counts(state)
        out = {f"alerts/{r.name}": 0.0 for r in self.rules}
        for rule, value in fired or ():
            out[f"alerts/{rule.name}"] = 1.0
            self._apply(rule, value, step, trainer)
        out.update({f"alerts/lr_scale/{role}": s for role, s in self.lr_scale.items()})
        if any(r.action == "scale_kl_coef" for r in self.rules):
            out["alerts/kl_coef_scale"] = self.kl_scale
        return out

    def _apply(self, rule: AlertRule, value: float, step: int, trainer: Any) -> None:
        what = f"alert {rule.name!r} at step {step}: {rule.describe(value)}" + (
            f" for {rule.patience} steps" if rule.patience > 1 else ""
        )
        if rule.action == "warn":
            log.warning(what)
            print(f"WARNING {what}", flush=True)
            set_tags = getattr(trainer.trackers, "set_tags", None)
            if callable(set_tags):
                set_tags({f"rlplug.alert.{rule.name}": f"step {step}: {rule.describe(value)}"})
        elif rule.action == "stop":
            root = getattr(getattr(trainer, "ckpt", None), "root", "the run directory")
            self.stopping = (
                f"{what} (action stop). The checkpoint of step {step} is saved under {root}. Resume with the same "
                "command (trainer.resume_mode=auto); the rule starts counting again, so it fires again only if the "
                "condition holds again. Change the cause first: e.g. a lower learning rate, "
                f"{lower_lr(self.cfg, rule.role)} added to the command (the resume applies it and lists every setting "
                "changed since the checkpoint), or a higher KL coefficient; or raise the rule's threshold / remove it "
                "from trainer.alerts to continue as is."
            )
        elif rule.action == "scale_lr":
            new_lr = trainer.backend.scale_lr(rule.role, rule.factor)
            self.lr_scale[rule.role] = self.lr_scale.get(rule.role, 1.0) * rule.factor
            print(f"{what}: {rule.role} learning rate x{rule.factor:g} -> {new_lr:.3g} from the next step", flush=True)
        elif rule.action == "scale_kl_coef":
            self.kl_scale *= rule.factor
            parts = []
            if self.cfg is not None and self.cfg.actor.use_kl_loss:
                self._set_kl_loss_coef()
                parts.append(f"actor.kl_loss_coef -> {float(self.cfg.actor.kl_loss_coef):.3g}")
            if self.cfg is not None and self.cfg.algorithm.use_kl_in_reward:
                trainer.kl_ctrl.value *= rule.factor
                parts.append(f"in-reward KL coefficient -> {trainer.kl_ctrl.value:.3g}")
            print(f"{what}: KL coefficient x{rule.factor:g} ({'; '.join(parts)})", flush=True)

    def _set_kl_loss_coef(self) -> None:
        """``cfg.actor.kl_loss_coef = <its value at start> * kl_scale`` (the backend reads it each update)."""

        if self.cfg is None or self._base_kl_loss_coef is None:
            return
        with read_write(self.cfg.actor), open_dict(self.cfg.actor):
            self.cfg.actor.kl_loss_coef = self._base_kl_loss_coef * self.kl_scale

    def stop_if_fired(self, trainer: Any) -> None:
        """When a ``stop`` rule fired: save the checkpoint of the finished step (``trainer.save_checkpoint()``)
        and raise :class:`rlplug.base.exit_codes.AlertStopped` (exit code 5) with the stop message."""
        if self.stopping is None:
            return
        message, self.stopping = self.stopping, None
        trainer.save_checkpoint()
        raise AlertStopped(message)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "counts": dict(self.counts),
            "fired": dict(self.fired),
            "lr_scale": dict(self.lr_scale),
            "kl_scale": self.kl_scale,
            # the configured actor.kl_loss_coef: the run config (and its config.yaml) holds it times kl_scale
            **({"kl_loss_coef": self._base_kl_loss_coef} if self._base_kl_loss_coef is not None else {}),
        }

    def configured_at_checkpoint(self) -> dict[str, Any]:
        """After :meth:`load_state_dict`: the settings the checkpointed run had configured where its saved
        ``config.yaml`` holds what the rules made of them (``{"actor.kl_loss_coef": value}``: ``scale_kl_coef``
        multiplies the run config's coefficient), for :func:`rlplug.run.checkpoint.config_changes`; ``{}`` for a
        checkpoint that did not record it."""
        return {} if self._saved_kl_loss_coef is None else {"actor.kl_loss_coef": self._saved_kl_loss_coef}

    def _load_counts(self, state: Mapping[str, Any]) -> None:
        self.counts = {r.name: int(state.get("counts", {}).get(r.name, 0)) for r in self.rules}
        self.fired = {r.name: int(state.get("fired", {}).get(r.name, 0)) for r in self.rules}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; rules added since start from 0, removed ones are forgotten. The KL-loss
        scale is applied to ``actor.kl_loss_coef`` again (the learning-rate scale and the in-reward controller's
        value come back with the backend's and the controller's own states)."""
        self._load_counts(state)
        self.lr_scale = {str(k): float(v) for k, v in (state.get("lr_scale") or {}).items()}
        self.kl_scale = float(state.get("kl_scale", 1.0))
        saved = state.get("kl_loss_coef")
        self._saved_kl_loss_coef = None if saved is None else float(saved)
        if self.kl_scale != 1.0 and self.cfg is not None and self.cfg.actor.use_kl_loss:
            self._set_kl_loss_coef()
