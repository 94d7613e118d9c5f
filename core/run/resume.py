"""Resuming a run with changed settings: refuse what cannot take effect, apply and list the rest.

:func:`check_resume_lr` runs before any model loads; :func:`apply_resume_changes` after the checkpoint is
loaded. Both take the :class:`rlplug.run.trainer.Trainer` that calls them (from ``Trainer.__init__`` and
``Trainer._resume``) and read its registry, plan, schedule, backend, alerts and KL controller; it is typed
``Any`` here because the trainer imports this module. What a resumed run may not change at all was refused
earlier, by :func:`rlplug.run.checkpoint.check_fingerprint`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from rlplug.config.schema import ConfigError
from rlplug.contracts.kinds import built_classes
from rlplug.run.checkpoint import config_changes, describe_change

__all__ = ["check_resume_lr", "apply_resume_changes"]

log = logging.getLogger("rlplug")


def check_resume_lr(trainer: Any, cfg: DictConfig) -> None:
    """Before any model loads (on the process that selected the checkpoint): refuse a resume whose
    ``actor.optim.lr`` / ``critic.optim.lr`` differs from the checkpoint's when it cannot be applied: the
    training backend does not declare the capability ``scale_lr`` (:class:`rlplug.contracts.types.TrainingBackend`),
    or the checkpoint's rate is not > 0 (the schedule's rates are scaled by new / old). Raises
    :class:`rlplug.config.schema.ConfigError` naming the key, both values and what to do."""
    path = trainer.start.resume_from
    if path is None:
        return
    roles = ("actor", "critic") if trainer.plan.use_critic else ("actor",)
    changed = [(k, o, n) for k, o, n in config_changes(path, cfg) or [] if k in {f"{r}.optim.lr" for r in roles}]
    if not changed:
        return
    for key, old, new in changed:
        if not (isinstance(old, (int, float)) and old > 0 and isinstance(new, (int, float)) and new >= 0):
            raise ConfigError(
                f"Cannot resume from {path} with {key} {describe_change(old, new)}: the resumed rates are the "
                "checkpoint's times new / old, which needs a checkpoint rate > 0 and a new one >= 0. Start a new "
                "run instead (trainer.resume_mode=disable trainer.overwrite=true, or another directory)."
            )
    reg = trainer.registry.registration("training_backend", str(cfg.trainer.backend))
    lacking = [
        c.__qualname__ for c in built_classes(reg.obj, reg.extra) if "scale_lr" not in getattr(c, "capabilities", ())
    ]
    if lacking:
        keys = ", ".join(f"{k} {describe_change(o, n)}" for k, o, n in changed)
        raise ConfigError(
            f"Cannot resume from {path} with {keys}: trainer.backend={cfg.trainer.backend} ({', '.join(lacking)}, "
            f"{reg.distribution} {reg.version}) does not declare the capability 'scale_lr', so the checkpoint's "
            "learning rates would go on unchanged. Set it back to the checkpoint's value, or use a backend "
            "that declares it (local, fsdp2)."
        )


def apply_resume_changes(trainer: Any, path: Path, configured: Any) -> None:
    """After the checkpoint ``path`` is loaded: make the settings of this run's config that differ from the
    checkpoint's (:func:`rlplug.run.checkpoint.config_changes`, ``configured`` being this run's config as given)
    take effect where the checkpointed state would keep the old value, and list them all (printed on the
    main process, logged, and logged as tracker params ``resume.step_<N>.<key>`` by :meth:`rlplug.run.trainer.Trainer.fit`).

    :func:`rlplug.run.checkpoint.check_fingerprint` already refused the settings a resumed run cannot change.
    Most others are read from the config at every step and hold as they are. The ones a checkpoint holds:

    * ``<role>.optim.lr`` (actor, critic): each role's rates are multiplied by new / old
      (:meth:`rlplug.run.schedule.Schedule.resume_lr_ratios`, the backend's ``scale_lr``), so from the first
      resumed step the rate is the new base times the LR schedule's multiplier at that step times the
      ``trainer.alerts`` ``scale_lr`` factors in force at the checkpoint (``optimizer.param_groups``,
      the scheduler's ``base_lrs`` and the logged ``<role>/lr`` agree). The other ``optim`` settings, AdamW's
      and the schedule's shape, are the backend's (:meth:`rlplug.training.backend.TrainingBackendBase.load`);
    * ``algorithm.kl_ctrl.kl_coef``: the KL controller's value is multiplied by new / old (the adaptive
      controller's progress and a ``scale_kl_coef`` factor kept); from 0, it becomes new x the alerts' factor.
    """
    changes = config_changes(path, configured, saved_overrides=trainer.alerts.configured_at_checkpoint())
    step = trainer.global_step + 1
    if changes is None:
        msg = (
            f"WARNING: {path} has no readable config.yaml, so the settings changed since the checkpoint cannot be "
            "listed, and the checkpoint's learning rates go on (a changed actor.optim.lr / critic.optim.lr is not "
            "applied)."
        )
        log.warning(msg)
        if trainer.is_main:
            print(msg, flush=True)
        return
    trainer.resume_changes = changes
    if not changes:
        log.info("Settings unchanged since the checkpoint %s.", path)
        if trainer.is_main:
            print("Settings unchanged since the checkpoint.", flush=True)
        return
    old = {k: o for k, o, _n in changes}
    notes = []
    roles = ["actor"] + (["critic"] if trainer.use_critic else [])
    saved_lrs = {r: float(old[f"{r}.optim.lr"]) for r in roles if f"{r}.optim.lr" in old}
    for role, ratio in trainer.schedule.resume_lr_ratios(saved_lrs).items():
        rate = trainer.backend.scale_lr(role, ratio) if ratio != 1.0 else None
        base, factor = trainer.schedule.carried_lr(role), trainer.alerts.lr_scale.get(role, 1.0)
        if rate is None:
            notes.append(f"{role} learning rate: unchanged (this phase of algorithm.schedule sets its own)")
            continue
        multiplier = rate / (base * factor) if base * factor else 1.0
        notes.append(
            f"{role} learning rate from step {step}: {rate:.6g} = {role}.optim.lr {base:g} x {multiplier:.6g} "
            f"(the LR schedule's multiplier at this step) x {factor:g} (trainer.alerts scale_lr factors)"
        )
    if "algorithm.kl_ctrl.kl_coef" in old:
        before, after = old["algorithm.kl_ctrl.kl_coef"], float(trainer.schedule.run_cfg.algorithm.kl_ctrl.kl_coef)
        if isinstance(before, (int, float)) and before > 0:
            trainer.kl_ctrl.value *= after / float(before)
        else:
            trainer.kl_ctrl.value = after * trainer.alerts.kl_scale
        notes.append(f"KL controller's coefficient from step {step}: {trainer.kl_ctrl.value:.6g}")
    lines = [f"  {key}: {describe_change(o, n)}" for key, o, n in changes] + [f"  -> {n}" for n in notes]
    msg = "Settings changed since the checkpoint (checkpoint -> this command), in effect from step " + (
        f"{step}:\n" + "\n".join(lines)
    )
    log.info(msg)
    if trainer.is_main:
        print(msg, flush=True)
