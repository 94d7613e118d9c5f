"""Training schedules: algorithm phases (``algorithm.schedule``) and the group size (``rollout.n_schedule``).

A schedule is config only: each phase of ``algorithm.schedule`` is the run's config with an algorithm
preset's keys (``configs/algorithm/<name>.yaml``) and the phase's ``overrides`` merged on top, in that
order, the same OmegaConf merge into the structured schema that composing uses (so a misspelled key
or a bad value fails the same way). Every phase is composed and checked with
:func:`rlplug.validate.validate_config` before any model loads, once for every ``rollout.n`` it will
train with; the errors name the phase. The loop never tests an algorithm name: at each step
:meth:`Schedule.enter` swaps in that step's config (the trainer's ``cfg``, batch plan, estimator,
in-reward KL) and gives the training backend the phase's actor and critic settings
(``apply_phase``, a declared capability). What the phases need is built once at start: a critic if
any phase trains one, a reference model if any phase uses KL (:attr:`Schedule.plan`, the union of
the phases' :class:`rlplug.validate.BatchPlan`).

Rules (``docs/schedules.md``):

* Phase ``i`` covers the steps after the previous phase's last step up to its own ``until``: an int
  is a step, a float in (0, 1] a share of the run's steps, ``floor(until * total_steps + 1/2)``
  (halves rounded up, in exact decimal arithmetic); the last phase may omit it. A phase left without
  steps by that rounding is checked but never entered (said at start).
* A phase may change only the keys matched by :data:`PHASE_KEYS` (not :data:`RUN_KEYS`, but
  :data:`LR_KEYS`): the
  algorithm, the actor's and the critic's loss settings, ``rollout.n``, the learning rates and
  ``trainer.critic_warmup``, which counts from the phase's first step. Models, optimizers (their
  state is kept), data, reward, the KL controller and the batch split are the run's.
* ``rollout.n_schedule`` ``{type: linear, start, end}`` gives step ``s`` of ``N`` the group size
  ``floor(start + (end - start) * (s - 1) / (N - 1) + 1/2)``; a phase whose ``overrides`` set
  ``rollout.n`` keeps that n (a preset's ``rollout.n`` does not count: the run's schedule wins).
* ``critic.value_target=mc_return`` trains the critic on the Monte-Carlo return of the token-level
  rewards (:func:`value_targets`), e.g. beside GRPO, whose ``returns`` are its advantages.

Logged: ``training/phase`` (the 0-based phase index, with ``algorithm.schedule``) and
``training/rollout_n`` (the step's group size, with either schedule). The checkpoint holds the phase
(``trainer_state.json`` ``schedule``); the run fingerprint covers the declared ``algorithm.schedule`` and
``rollout.n_schedule`` (:func:`rlplug.checkpoint.run_fingerprint`), not the current phase.
"""

from __future__ import annotations

import copy
import difflib
import fnmatch
import math
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from .config import ConfigError, _explain_compose_error, config_dir, config_get

__all__ = [
    "LR_KEYS",
    "PHASE_KEYS",
    "RUN_KEYS",
    "VALUE_TARGETS",
    "Phase",
    "Schedule",
    "check_schedule_config",
    "compose_phases",
    "mc_returns",
    "n_schedule_of",
    "n_schedule_value",
    "phase_ends",
    "value_targets",
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
#: base rates, :meth:`Schedule.enter`)
LR_KEYS: tuple[str, ...] = ("actor.optim.lr", "critic.optim.lr")
#: ``critic.value_target`` choices: the estimator's ``returns`` (verl), or the Monte-Carlo return
VALUE_TARGETS: tuple[str, ...] = ("returns", "mc_return")
#: the trainer's metrics: the phase index (with ``algorithm.schedule``) and the step's group size
PHASE_METRIC, N_METRIC = "training/phase", "training/rollout_n"
#: the backend capability a schedule needs (:meth:`rlplug.training.TrainingBackendBase.apply_phase`)
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


def mc_returns(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Monte-Carlo returns ``G_t = sum_{t' >= t} gamma^(t' - t) r_t'`` over each response's valid tokens,
    ``(B, T) float32``, 0.0 where ``response_mask`` (``(B, T)``) is 0. ``token_level_rewards`` ``(B, T)``
    float32, reward units per token. GAE with ``lam = 1`` gives the same returns whatever the values
    (Schulman et al. 2016, eq. 18; verl's ``compute_gae_advantage_return`` with lam=1)."""
    valid = response_mask > 0
    rewards = torch.where(
        valid, token_level_rewards.float(), torch.zeros_like(token_level_rewards, dtype=torch.float32)
    )
    if gamma == 1.0:
        returns = rewards.flip(-1).cumsum(-1).flip(-1)
    else:
        returns = torch.zeros_like(rewards)
        running = torch.zeros(rewards.shape[0], dtype=torch.float32, device=rewards.device)
        for t in reversed(range(rewards.shape[1])):
            running = rewards[:, t] + gamma * running
            returns[:, t] = running
    return torch.where(valid, returns, torch.zeros_like(returns))


def value_targets(batch: Any, cfg: Any) -> None:
    """With ``critic.value_target=mc_return``, replace ``batch["returns"]`` (the critic's regression
    targets, ``(B, T) float32``) by :func:`mc_returns` of ``batch["token_level_rewards"]`` with
    ``algorithm.gamma``; with ``returns`` (default) leave the estimator's. A critic-free estimator's
    ``returns`` are no value targets (GRPO's equal its advantages), so a critic trained beside one (the
    GRPO phase of ``experiment=grpo_to_ppo``) regresses on the Monte-Carlo return instead; failed rows
    have zero rewards and are masked out of the update anyway."""
    if str(config_get(cfg, "critic.value_target", "returns")) == "mc_return":
        batch["returns"] = mc_returns(batch["token_level_rewards"], batch["response_mask"], float(cfg.algorithm.gamma))


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
    from omegaconf.errors import OmegaConfBaseException

    schedule = list(config_get(cfg, "algorithm.schedule") or [])
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
                raise ConfigError(f"{where}: configs/algorithm/{name}.yaml: {_explain_compose_error(exc)}") from exc
        merged = _copy(merged)
        for key, value in overrides.items():
            try:
                OmegaConf.update(merged, str(key), value, merge=True)
            except OmegaConfBaseException as exc:
                raise ConfigError(f"{where}: overrides: {_explain_compose_error(exc).splitlines()[0]}") from exc
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
    target = str(config_get(cfg, "critic.value_target", "returns"))
    if target not in VALUE_TARGETS:
        raise ConfigError(
            f"critic.value_target={target}: use 'returns' (the advantage estimator's returns, as verl) or "
            "'mc_return' (the Monte-Carlo return of the token-level rewards, for a critic beside a critic-free "
            "estimator)."
        )


def _check_capability(cfg: Any, registry: Any) -> None:
    from .contracts import built_classes
    from .registry import PluginError

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
            "on rlplug.training.TrainingBackendBase (local, fsdp2), or train without a schedule."
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


def check_schedule_config(cfg: DictConfig, registry: Any = None, total_steps: int | None = None) -> list[Phase]:
    """Check ``critic.value_target``, ``rollout.n_schedule`` and ``algorithm.schedule`` of ``cfg`` and
    return the composed phases (:func:`compose_phases`). Every phase, and the run itself under an n
    schedule, is checked with :func:`rlplug.validate.validate_config` for every ``rollout.n`` it will take
    (exactly, when ``total_steps`` or ``trainer.total_training_steps`` is known, else every n between
    the n schedule's start and end): batch sizes that stop dividing, a group estimator with n = 1, a
    warm-up without a critic ... The error names the phase and the n. ``registry``: the plugin registry
    (default: the global one).

    Raises :class:`ConfigError` (also for a training backend without the ``apply_phase`` capability).
    """
    from .registry import get_registry
    from .validate import validate_config

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
                validate_config(checked, registry)
            except ConfigError as exc:
                raise ConfigError(f"{where} with rollout.n={n}: {exc}") from exc
    return phases


# ============================================================================ the run's schedule


class Schedule:
    """The schedule of one run (inactive without ``algorithm.schedule`` and ``rollout.n_schedule``:
    :meth:`enter` then does nothing and the run is the plain one, bit for bit).

    Built by the trainer before any model loads: composes and checks every phase
    (:func:`check_schedule_config` with the run's ``total_steps``), resolves the phase boundaries
    (:func:`phase_ends`) and the union :attr:`plan` (what to build). ``run_cfg`` is the run's own config
    (checkpoints and the fingerprint use it); :attr:`phase_start` is the step before the current phase's
    first (``trainer.critic_warmup`` counts from there; 0 without phases).

    Checkpointed as ``schedule`` in ``trainer_state.json``: ``{"phase": index of the phase whose
    settings (learning rates) the saved optimizers carry, or None; "step_phase": the phase of the saved
    step}``; a resumed run re-enters the phase of its next step from there.
    """

    optional_state = True  # checkpoints written before schedules existed load with a fresh state

    def __init__(self, cfg: DictConfig, registry: Any, total_steps: int, plan: Any) -> None:
        from .validate import BatchPlan, plan_batch

        self.run_cfg, self.registry, self.total_steps = cfg, registry, int(total_steps)
        self.n_schedule = n_schedule_of(cfg)
        self.phases = check_schedule_config(cfg, registry, self.total_steps)
        self.active = bool(self.phases) or self.n_schedule is not None
        self.ends = phase_ends(cfg.algorithm.schedule, self.total_steps) if self.phases else [self.total_steps]
        self.plans = [plan_batch(p.cfg, registry) for p in self.phases] or [plan]
        requires = tuple(dict.fromkeys(f for p in self.plans for f in p.requires))
        self.plan = (
            plan
            if not self.phases
            else BatchPlan(
                requires=requires,
                use_critic=any(p.use_critic for p in self.plans),
                use_ref=any(p.use_ref for p in self.plans),
                baseline=any(p.baseline for p in self.plans),
                per_token=tuple(dict.fromkeys(f for p in self.plans for f in p.per_token)),
            )
        )
        self.phase_start = 0
        self._key: tuple[int, int] | None = None  # (phase, n) applied to the trainer and backend
        self._lr_phase: int | None = None  # whose learning rates the optimizers carry (None: the run's)
        self._configs: dict[tuple[int, int], DictConfig] = {}
        for i, steps in enumerate(_step_ranges(self.ends) if self.phases else []):
            if not len(steps):
                print(
                    f"algorithm.schedule[{i}] ({self.phases[i].label}) has no steps in this run of {self.total_steps}."
                )

    # ------------------------------------------------------------------ lookup
    def phase_at(self, step: int) -> int:
        """The 0-based index of the phase training step ``step`` (1-based) is in (0 without phases)."""
        return next((i for i, end in enumerate(self.ends) if step <= end), len(self.ends) - 1)

    def n_at(self, step: int) -> int:
        """The ``rollout.n`` of step ``step``: the phase's override, else the n schedule's, else the config's."""
        i = self.phase_at(step)
        phase = self.phases[i] if self.phases else None
        if phase is not None and phase.n is not None:
            return phase.n
        if self.n_schedule is not None:
            return n_schedule_value(self.n_schedule, step, self.total_steps)
        return int((phase.cfg if phase is not None else self.run_cfg).rollout.n)

    def config_at(self, step: int) -> DictConfig:
        """The effective config of step ``step``: its phase's, with the step's ``rollout.n``."""
        key = (self.phase_at(step), self.n_at(step))
        if key not in self._configs:
            base = self.phases[key[0]].cfg if self.phases else _cleared(self.run_cfg)
            self._configs[key] = _with_n(base, key[1])
        return self._configs[key]

    # ------------------------------------------------------------------ the step
    def enter(self, trainer: Any, step: int) -> dict[str, float]:
        """Make ``trainer`` train step ``step`` with that step's config; returns the step's schedule metrics
        (``training/phase``, ``training/rollout_n``; ``{}`` when inactive). When the phase or n changed: sets the
        trainer's ``cfg``, ``plan``, ``estimator``, ``use_critic``, ``use_ref``, ``needs_baseline``,
        ``kl_in_reward`` and ``skip_old_log_prob`` as its constructor does for one config, gives the backend
        the config (``apply_phase``) and scales the learning rates from the phase that set them to this one
        (``backend.scale_lr``, so ``trainer.alerts`` scalings and the schedule's position stay); prints a line
        at a phase change."""
        if not self.active:
            return {}
        from .trainer import skips_old_log_probs

        i, n = self.phase_at(step), self.n_at(step)
        metrics = {N_METRIC: float(n), **({PHASE_METRIC: float(i)} if self.phases else {})}
        if self._key == (i, n):
            return metrics
        cfg = self.config_at(step)
        plan = self.plans[i]
        changed_phase = self._key is None or self._key[0] != i
        trainer.cfg, trainer.plan = cfg, plan
        trainer.estimator = self.registry.get("advantage_estimator", cfg.algorithm.adv_estimator)
        trainer.use_critic, trainer.use_ref, trainer.needs_baseline = plan.use_critic, plan.use_ref, plan.baseline
        use_kl = cfg.algorithm.use_kl_in_reward
        trainer.kl_in_reward = self.registry.get("kl_penalty", cfg.algorithm.kl_penalty) if use_kl else None
        trainer.skip_old_log_prob = skips_old_log_probs(cfg, plan, trainer.backend.capabilities)
        trainer.backend.apply_phase(cfg)
        self._scale_lrs(trainer.backend, i)
        self._key, self.phase_start = (i, n), (self.ends[i - 1] if i and self.phases else 0)
        if changed_phase and self.phases:
            p = self.phases[i]
            shown = ", ".join(f"{k}={v}" for k, v in p.overrides.items()) or "no overrides"
            print(
                f"phase {i + 1}/{len(self.phases)} ({p.label}, {PHASE_METRIC}={i}) from step {self.phase_start + 1}"
                f"{f' (resumed at step {step})' if step > self.phase_start + 1 else ''}: {shown}",
                flush=True,
            )
        return metrics

    def _lr_config(self, index: int | None) -> DictConfig:
        return self.run_cfg if index is None or not self.phases else self.phases[index].cfg

    def _scale_lrs(self, backend: Any, index: int) -> None:
        old, new = self._lr_config(self._lr_phase), self._lr_config(index)
        for role in ("actor", "critic"):
            if role == "critic" and getattr(backend, "critic", None) is None:
                continue
            before, after = float(old[role].optim.lr), float(new[role].optim.lr)
            if before != after:
                backend.scale_lr(role, after / before)
        self._lr_phase = index if self.phases else None

    def carried_lr(self, role: str) -> float:
        """The configured ``<role>.optim.lr`` the optimizers carry now: that of the phase they were last set for
        (:meth:`enter`; after a resume, the checkpoint's), else the run's."""
        return float(self._lr_config(self._lr_phase)[role].optim.lr)

    def resume_lr_ratios(self, saved_lrs: Mapping[str, float]) -> dict[str, float]:
        """After a resume whose checkpoint's run config had the learning rates ``saved_lrs`` (``{"actor": lr,
        "critic": lr}``, the roles whose ``<role>.optim.lr`` this run's config changed): by how much each role's
        rates must be multiplied so that the optimizers carry this config's rate, ``{role: new / old}``.

        The optimizers carry the rate of the phase they were last set for (the checkpointed ``phase``; the run's
        config without ``algorithm.schedule``), times the LR schedule's multiplier and the ``trainer.alerts``
        ``scale_lr`` factors, which the multiplication keeps. ``new`` is that phase's ``<role>.optim.lr`` now,
        ``old`` the same phase composed with the checkpoint's run rates: a phase whose ``overrides`` set its own
        rate gives 1.0 (a phase's rate is absolute, ``docs/schedules.md``). Call after the checkpoint's state
        is loaded (:meth:`load_state_dict`). Raises ``ValueError`` when an old rate is not > 0 or a new one < 0."""
        out: dict[str, float] = {}
        old_phase: DictConfig | None = None
        new_phase: DictConfig | None = None
        if self.phases and self._lr_phase is not None:
            old_cfg = _copy(self.run_cfg)
            for role, lr in saved_lrs.items():
                old_cfg[role].optim.lr = float(lr)
            old_phase = compose_phases(old_cfg)[self._lr_phase].cfg
            new_phase = self.phases[self._lr_phase].cfg
        for role, lr in saved_lrs.items():
            if old_phase is not None and new_phase is not None:
                old, new = float(old_phase[role].optim.lr), float(new_phase[role].optim.lr)
            else:
                old, new = float(lr), float(self.run_cfg[role].optim.lr)
            if not (old > 0 and new >= 0):
                raise ValueError(
                    f"{role}.optim.lr: {old} -> {new}: the checkpoint's rate must be > 0 (the schedule's rates are "
                    "scaled by new / old) and the new one >= 0"
                )
            out[role] = new / old
        return out

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"phase": self._lr_phase, "step_phase": self._key[0] if self._key and self.phases else None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`: the next :meth:`enter` applies its step's phase again, scaling the
        learning rates from the checkpointed phase's. Raises ``ValueError`` for a phase index this schedule
        does not have (the declared schedule changed: the run fingerprint names it first)."""
        phase = state.get("phase")
        if phase is not None and not 0 <= int(phase) < len(self.phases):
            raise ValueError(
                f"the checkpoint was in phase {phase} of algorithm.schedule, which has {len(self.phases)} phases now"
            )
        self._lr_phase = None if phase is None else int(phase)
        self._key = None
