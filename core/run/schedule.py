"""Training schedules: algorithm phases (``algorithm.schedule``) and the group size (``rollout.n_schedule``).

A schedule is config only: each phase of ``algorithm.schedule`` is the run's config with an algorithm
preset's keys (``configs/algorithm/<name>.yaml``) and the phase's ``overrides`` merged on top, in that
order, the same OmegaConf merge into the structured schema that composing uses (so a misspelled key
or a bad value fails the same way). Every phase is composed and checked with
:func:`rlplug.run.validate.validate_config` before any model loads, once for every ``rollout.n`` it will
train with; the errors name the phase. The loop never tests an algorithm name: at each step
:meth:`Schedule.enter` swaps in that step's config (the trainer's ``cfg``, batch plan, estimator,
in-reward KL) and gives the training backend the phase's actor and critic settings
(``apply_phase``, a declared capability). What the phases need is built once at start: a critic if
any phase trains one, a reference model if any phase uses KL (:attr:`Schedule.plan`, the union of
the phases' :class:`rlplug.run.validate.BatchPlan`).

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
``rollout.n_schedule`` (:func:`rlplug.run.checkpoint.run_fingerprint`), not the current phase.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig

from rlplug.algorithms.losses import mc_returns, value_targets
from rlplug.config.phases import (
    CAPABILITY,
    LR_KEYS,
    PHASE_KEYS,
    RUN_KEYS,
    VALUE_TARGETS,
    Phase,
    _cleared,
    _copy,
    _step_ranges,
    _with_n,
    check_schedule_config,
    compose_phases,
    n_schedule_of,
    n_schedule_value,
    phase_ends,
)
from rlplug.run.validate import BatchPlan, plan_batch, skips_old_log_probs, validate_config

__all__ = [
    "CAPABILITY",
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

#: the trainer's metrics: the phase index (with ``algorithm.schedule``) and the step's group size
PHASE_METRIC, N_METRIC = "training/phase", "training/rollout_n"


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
        self.run_cfg, self.registry, self.total_steps = cfg, registry, int(total_steps)
        self.n_schedule = n_schedule_of(cfg)
        self.phases = check_schedule_config(cfg, registry, self.total_steps, validate=validate_config)
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
