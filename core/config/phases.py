"""Composing and checking a run's schedules: the phases of ``algorithm.schedule`` and ``rollout.n_schedule``.

Config only, before any model loads (``docs/schedules.md``): :func:`compose_phases` composes each phase (the
run's config, an algorithm preset's keys, the phase's ``overrides``), :func:`phase_ends` and
:func:`n_schedule_value` say which steps a phase covers and which group size a step takes, and
:func:`check_schedule_config` checks every phase for every ``rollout.n`` it will train with. The rules are
those of :mod:`rlplug.run.schedule`, whose :class:`~rlplug.run.schedule.Schedule` applies the phases during the run.

This module belongs to the configuration layer: the check of one run config
(:func:`rlplug.run.validate.validate_config`) is handed to :func:`check_schedule_config` by its caller.
"""

from __future__ import annotations

import copy
import difflib
import fnmatch
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from rlplug.config.compose import explain_compose_error
from rlplug.config.schema import ConfigError, RunConfig, config_dir, typed
from rlplug.contracts.kinds import built_classes
from rlplug.contracts.registry import PluginError, get_registry

__all__ = [
    "CAPABILITY",
    "LR_KEYS",
    "PHASE_KEYS",
    "RUN_KEYS",
    "VALUE_TARGETS",
    "Phase",
    "check_schedule_config",
    "compose_phases",
    "n_schedule_of",
    "n_schedule_value",
    "phase_ends",
]

#: the keys a phase may set to another value than the run's (:mod:`fnmatch` patterns), except :data:`RUN_KEYS`
PHASE_KEYS: tuple[str, ...] = ("algorithm.*", "actor.*", "critic.*", "rollout.n", "trainer.critic_warmup")
#: keys under :data:`PHASE_KEYS` that stay the run's: built once (optimizers, KL controller) or fixing the
#: number of optimizer steps per training step (the learning-rate schedule's length); the learning rates
#: themselves may change (``actor.optim.lr``, ``critic.optim.lr``)
RUN_KEYS: tuple[str, ...] = (
    "algorithm.kl_ctrl.*",
    "actor.optim.*",
    "critic.optim.*",
    "actor.ppo_mini_batch_size",
    "actor.ppo_epochs",
    "critic.ppo_mini_batch_size",
    "critic.ppo_epochs",
    "critic.model.*",
    "actor.logprob_chunk_size",
)
#: the keys of :data:`RUN_KEYS` a phase may change all the same: the learning rates (applied to the schedule's
#: base rates, :meth:`rlplug.run.schedule.Schedule.enter`)
LR_KEYS: tuple[str, ...] = ("actor.optim.lr", "critic.optim.lr")
#: ``critic.value_target`` choices: the estimator's ``returns`` (verl), or the Monte-Carlo return
VALUE_TARGETS: tuple[str, ...] = ("returns", "mc_return")
#: the backend capability a schedule needs (:meth:`rlplug.training.backend.TrainingBackendBase.apply_phase`)
CAPABILITY = "apply_phase"


# ============================================================================ pure pieces


def _round_half_up(x: Fraction) -> int:
    return math.floor(x + Fraction(1, 2))


def _until_kind(where: str, until: Any, last: bool) -> None:
    """Raise :class:`ConfigError` unless ``until`` is an int step >= 1, a float in (0, 1], or (last phase) None."""
    if until is None:
        if not last:
            raise ConfigError(
                f"{where}.until is missing: every phase but the last ends somewhere. Set until to a step "
                "(an int, e.g. 30) or a share of trainer.total_training_steps (a float in (0, 1], e.g. 0.2)."
            )
        return
    if isinstance(until, bool) or not isinstance(until, (int, float)):
        raise ConfigError(f"{where}.until={until!r}: use an int step (e.g. 30) or a float in (0, 1] (e.g. 0.2).")
    if isinstance(until, int) and until < 1:
        raise ConfigError(f"{where}.until={until}: a step count must be >= 1 (steps are 1-based).")
    if isinstance(until, float) and not 0.0 < until <= 1.0:
        raise ConfigError(
            f"{where}.until={until}: a float is a share of the run's steps and must be in (0, 1]; "
            "write a step as an int (e.g. until: 30)."
        )


def phase_ends(schedule: Any, total_steps: int) -> list[int]:
    """The last step of each phase of ``schedule`` (a list of phases with ``until``) in a run of
    ``total_steps`` steps: an int ``until`` as it is, a float ``f`` as ``floor(f * total_steps + 1/2)``
    (``Fraction(str(f))``, so 0.29 x 100 is 29, not 28.999...), a missing last ``until`` as
    ``total_steps``. E.g. ``[0.2, 0.7, None]`` over 10 steps -> ``[2, 7, 10]``, over 5 -> ``[1, 4, 5]``
    (3.5 rounds up), over 3 -> ``[1, 2, 3]``.

    Raises :class:`ConfigError` for a bad ``until`` (:func:`_until_kind`), a phase ending before the one
    before it, or a last phase ending before the run does (the steps after it would have no phase).
    """
    ends: list[int] = []
    for i, phase in enumerate(schedule):
        where, until = f"algorithm.schedule[{i}]", _get(phase, "until")
        last = i == len(schedule) - 1
        _until_kind(where, until, last)
        if until is None:
            end = int(total_steps)
        elif isinstance(until, float):
            end = _round_half_up(Fraction(str(until)) * int(total_steps))
        else:
            end = int(until)
        if ends and end < ends[-1]:
            raise ConfigError(
                f"{where}.until={until} ends at step {end}, before the phase before it (step {ends[-1]}, "
                f"with {total_steps} steps in the run). List the phases in the order they run."
            )
        if last and end < total_steps:
            raise ConfigError(
                f"{where}.until={until}: the last phase ends at step {end}, but the run has {total_steps} steps "
                "(trainer.total_training_steps), which would leave the rest without a phase. Omit until in the "
                "last phase (it runs to the end) or add a phase after it."
            )
        ends.append(end)
    return ends


def n_schedule_value(n_schedule: Any, step: int, total_steps: int) -> int:
    """``rollout.n_schedule``'s group size at ``step`` (1-based) of ``total_steps``; ``type: linear``:
    ``floor(start + (end - start) * (step - 1) / (total_steps - 1) + 1/2)`` (exact fractions, halves
    rounded up; ``start`` with a single step). E.g. start 4, end 16 over 5 steps: 4, 7, 10, 13, 16;
    start 2, end 4 over 4 steps: 2, 3 (2.67), 3 (3.33), 4. Raises :class:`ConfigError` for an unknown
    type or a start / end below 1 (:func:`_check_n_schedule`)."""
    _check_n_schedule(n_schedule)
    start, end = int(n_schedule.start), int(n_schedule.end)
    if total_steps <= 1:
        return start
    return _round_half_up(start + Fraction(end - start) * (step - 1) / (total_steps - 1))


def n_schedule_of(cfg: Any) -> Any:
    """``cfg.rollout.n_schedule`` when it is on (its ``type`` set), else None."""
    ns = _get(_get(cfg, "rollout"), "n_schedule")
    return ns if ns is not None and _get(ns, "type") is not None else None


def _check_n_schedule(n_schedule: Any) -> None:
    kind = str(_get(n_schedule, "type"))
    if kind != "linear":
        raise ConfigError(f"rollout.n_schedule.type={kind}: the only type is 'linear' ({{type: linear, start, end}}).")
    for key in ("start", "end"):
        value = _get(n_schedule, key)
        if value is None or int(value) < 1:
            raise ConfigError(
                f"rollout.n_schedule.{key}={value}: a group size, so an int >= 1 (e.g. start: 4, end: 16)."
            )


def _get(node: Any, key: str) -> Any:
    return node.get(key) if isinstance(node, Mapping) or isinstance(node, DictConfig) else getattr(node, key, None)


# ============================================================================ composing phases


@dataclass(frozen=True)
class Phase:
    """One composed phase: ``index`` (0-based), ``name`` (its preset, or None), ``overrides`` (plain
    dict as declared), ``cfg`` (its effective run config, ``algorithm.schedule`` emptied and
    ``rollout.n_schedule`` off), ``n`` (the ``rollout.n`` its overrides set, else None: the run's
    n schedule or the phase's ``rollout.n``)."""

    index: int
    name: str | None
    overrides: dict[str, Any]
    cfg: DictConfig
    n: int | None

    @property
    def label(self) -> str:
        return self.name or "no preset"


def _presets() -> list[str]:
    return sorted(p.stem for p in (config_dir() / "algorithm").glob("*.yaml"))


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(node, dict):
        for k, v in node.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    out[prefix[:-1]] = node
    return out


def _cleared(cfg: DictConfig) -> DictConfig:
    """A copy of ``cfg`` without its schedules (so a phase config is one plain run config)."""
    out = _copy(cfg)
    with open_dict(out):
        out.algorithm.schedule = []
        out.rollout.n_schedule.type = None
    return out


def _copy(cfg: DictConfig) -> DictConfig:
    """A deep, writable copy (``DictConfig.copy`` is shallow: nested sections would be shared)."""
    out = copy.deepcopy(cfg)
    OmegaConf.set_readonly(out, False)
    return out


def _phase_key(key: str) -> bool:
    return (
        key in LR_KEYS
        or any(fnmatch.fnmatchcase(key, p) for p in PHASE_KEYS)
        and not any(fnmatch.fnmatchcase(key, p) for p in RUN_KEYS)
    )


def _check_fixed_keys(where: str, run: DictConfig, phase: DictConfig, overrides: Mapping[str, Any], name: Any) -> None:
    a, b = _flat(OmegaConf.to_container(run, resolve=True)), _flat(OmegaConf.to_container(phase, resolve=True))
    for key in sorted(set(a) | set(b)):
        if a.get(key) == b.get(key) or _phase_key(key):
            continue
        source = (
            "its overrides"
            if any(key == k or key.startswith(f"{k}.") for k in overrides)
            else f"the preset configs/algorithm/{name}.yaml"
        )
        raise ConfigError(
            f"{where}: {key}={b.get(key)!r} (from {source}) differs from the run's {key}={a.get(key)!r}, but it is "
            "set once for the whole run (models, optimizers, data, reward, the KL controller and the batch split "
            "are built at start). A phase may change the algorithm.*, actor.* and critic.* loss settings, "
            "rollout.n, actor.optim.lr / critic.optim.lr and trainer.critic_warmup. Set it for the whole run, or "
            "drop it from the phase."
        )


def compose_phases(cfg: DictConfig) -> list[Phase]:
    """Compose every phase of ``cfg.algorithm.schedule`` (``[]`` without one): the run's config, then the
    phase's preset (``configs/algorithm/<algorithm>.yaml``, loaded with OmegaConf and merged into the
    structured config), then its ``overrides`` (dotted keys, set with ``OmegaConf.update``).

    Raises :class:`ConfigError` naming the phase for an unknown preset (with close names and the list),
    an override key the schema lacks (the same message as compose's unknown-key errors), a value of the
    wrong type, or a key outside :data:`PHASE_KEYS` set to another value than the run's.
    """
    schedule = list(typed(RunConfig, cfg).algorithm.schedule or [])
    if not schedule:
        return []
    run, phases = _cleared(cfg), []
    for i, spec in enumerate(schedule):
        name, given = _get(spec, "algorithm"), _get(spec, "overrides") or {}
        raw = OmegaConf.to_container(given, resolve=True) if isinstance(given, DictConfig) else dict(given)
        overrides: dict[str, Any] = {str(k): v for k, v in raw.items()}  # type: ignore[union-attr]
        where = f"algorithm.schedule[{i}] (phase {i + 1}/{len(schedule)}, {name or 'no preset'})"
        merged = run
        if name is not None:
            path = config_dir() / "algorithm" / f"{name}.yaml"
            presets = _presets()
            if str(name) not in presets:  # a preset's name (a file of configs/algorithm), never a path (../config)
                close = difflib.get_close_matches(str(name), presets, n=3, cutoff=0.6)
                hint = (" Did you mean " + " or ".join(f"'{c}'" for c in close) + "?") if close else ""
                raise ConfigError(
                    f"{where}: unknown algorithm preset '{name}'.{hint} Available options in 'algorithm': "
                    f"{', '.join(presets)} (configs/algorithm/)."
                )
            try:
                merged = OmegaConf.merge(run, OmegaConf.load(path))  # type: ignore[assignment]
            except OmegaConfBaseException as exc:
                raise ConfigError(f"{where}: configs/algorithm/{name}.yaml: {explain_compose_error(exc)}") from exc
        merged = _copy(merged)
        for key, value in overrides.items():
            try:
                OmegaConf.update(merged, str(key), value, merge=True)
            except OmegaConfBaseException as exc:
                raise ConfigError(f"{where}: overrides: {explain_compose_error(exc).splitlines()[0]}") from exc
        _check_fixed_keys(where, run, merged, overrides, name)
        for role in ("actor", "critic"):  # phase changes scale the base LR by new / old: a 0 LR has no ratio
            lr = float(merged[role].optim.lr)
            if not lr > 0:
                raise ConfigError(
                    f"{where}: {role}.optim.lr={lr}, but every phase needs a learning rate > 0 (a phase change "
                    f"scales the LR schedule by the ratio of the phases' rates). To keep the actor frozen in a "
                    f"phase, set trainer.critic_warmup in that phase's overrides instead."
                )
        n = overrides.get("rollout.n", (overrides.get("rollout") or {}).get("n"))
        phases.append(Phase(i, None if name is None else str(name), overrides, merged, None if n is None else int(n)))
    return phases


def _with_n(cfg: DictConfig, n: int) -> DictConfig:
    if int(cfg.rollout.n) == n:
        return cfg
    out = _copy(cfg)
    out.rollout.n = n
    return out


def _check_value_target(cfg: Any) -> None:
    target = str(typed(RunConfig, cfg).critic.value_target)
    if target not in VALUE_TARGETS:
        raise ConfigError(
            f"critic.value_target={target}: use 'returns' (the advantage estimator's returns, as verl) or "
            "'mc_return' (the Monte-Carlo return of the token-level rewards, for a critic beside a critic-free "
            "estimator)."
        )


def _check_capability(cfg: Any, registry: Any) -> None:
    try:
        reg = registry.registration("training_backend", str(cfg.trainer.backend))
    except PluginError as exc:
        raise ConfigError(f"trainer.backend={cfg.trainer.backend}: {exc}") from exc
    classes = list(built_classes(reg.obj, reg.extra))
    lacking = [c.__qualname__ for c in classes if CAPABILITY not in frozenset(getattr(c, "capabilities", ()) or ())]
    if lacking or not classes:
        raise ConfigError(
            f"algorithm.schedule / rollout.n_schedule change the actor and critic settings during the run, but "
            f"trainer.backend={cfg.trainer.backend} ({', '.join(lacking) or 'its classes are not declared'}, "
            f"{reg.distribution} {reg.version}) does not declare the capability '{CAPABILITY}'. Use a backend built "
            "on rlplug.training.backend.TrainingBackendBase (local, fsdp2), or train without a schedule."
        )


def _step_ranges(ends: list[int]) -> list[range]:
    return [range((ends[i - 1] if i else 0) + 1, end + 1) for i, end in enumerate(ends)]


def _n_values(cfg: DictConfig, phase: Phase | None, steps: range | None, total: int | None) -> list[int]:
    """The group sizes a phase (None: the run without phases) trains with: its own override, else the n
    schedule's values over its steps (every n between start and end when the steps are not known yet),
    else its config's ``rollout.n``."""
    own = phase.cfg if phase is not None else cfg
    if phase is not None and phase.n is not None:
        return [phase.n]
    ns = n_schedule_of(cfg)
    if ns is None:
        return [int(own.rollout.n)]
    if steps is None or total is None:
        lo, hi = sorted((int(ns.start), int(ns.end)))
        return list(range(lo, hi + 1))
    # a phase left without steps is still checked once, with its own rollout.n
    return sorted({n_schedule_value(ns, s, total) for s in steps}) or [int(own.rollout.n)]


def check_schedule_config(
    cfg: DictConfig,
    registry: Any = None,
    total_steps: int | None = None,
    *,
    validate: Callable[[DictConfig, Any], object],
) -> list[Phase]:
    """Check ``critic.value_target``, ``rollout.n_schedule`` and ``algorithm.schedule`` of ``cfg`` and
    return the composed phases (:func:`compose_phases`). Every phase, and the run itself under an n
    schedule, is checked with :func:`rlplug.run.validate.validate_config` for every ``rollout.n`` it will take
    (exactly, when ``total_steps`` or ``trainer.total_training_steps`` is known, else every n between
    the n schedule's start and end): batch sizes that stop dividing, a group estimator with n = 1, a
    warm-up without a critic ... The error names the phase and the n. ``registry``: the plugin registry
    (default: the global one). ``validate``: the check of one run config, ``validate(cfg, registry)``
    raising :class:`ConfigError` (:func:`rlplug.run.validate.validate_config`, which passes itself: the run
    layer's check is handed down, so this module imports nothing above the configuration layer).

    Raises :class:`ConfigError` (also for a training backend without the ``apply_phase`` capability).
    """
    registry = registry or get_registry()
    _check_value_target(cfg)
    ns = n_schedule_of(cfg)
    if ns is not None:
        _check_n_schedule(ns)
    phases = compose_phases(cfg)
    if not phases and ns is None:
        return phases
    _check_capability(cfg, registry)
    total = total_steps or cfg.trainer.total_training_steps
    for i, spec in enumerate(cfg.algorithm.schedule):  # checked even when the run's length is not known yet
        _until_kind(f"algorithm.schedule[{i}]", _get(spec, "until"), i == len(cfg.algorithm.schedule) - 1)
    ends = phase_ends(cfg.algorithm.schedule, int(total)) if phases and total else None
    ranges: list[range | None] = list(_step_ranges(ends)) if ends else [None] * len(phases)
    checks: list[tuple[str, DictConfig, list[int]]] = []
    if not phases:
        checks.append(
            (
                "rollout.n_schedule",
                _cleared(cfg),
                _n_values(cfg, None, range(1, int(total) + 1) if total else None, total),
            )
        )
    for phase, steps in zip(phases, ranges):
        span = f", steps {steps.start}-{steps.stop - 1}" if steps is not None and len(steps) else ""
        where = f"algorithm.schedule[{phase.index}] (phase {phase.index + 1}/{len(phases)}, {phase.label}{span})"
        checks.append((where, phase.cfg, _n_values(cfg, phase, steps, total)))
    for where, phase_cfg, ns_taken in checks:
        for n in ns_taken:
            checked = _copy(_with_n(phase_cfg, n))
            with open_dict(checked):
                checked.trainer.alerts = []  # the run's rules are checked once, against the union of the phases
            try:
                validate(checked, registry)
            except ConfigError as exc:
                raise ConfigError(f"{where} with rollout.n={n}: {exc}") from exc
    return phases
