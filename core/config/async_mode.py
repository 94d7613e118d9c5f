"""``trainer.async_mode`` and its settings: the checks (:func:`check_async_config`) and the defaults an
asynchronous mode brings (:func:`async_defaults`); the pipeline itself is :mod:`rlplug.run.async_pipeline`."""

from __future__ import annotations

import os
from collections.abc import Collection

from omegaconf import DictConfig, OmegaConf

from rlplug.config.schema import ConfigError

__all__ = ["ASYNC_MODES", "STALE_POLICIES", "async_defaults", "check_async_config", "check_sync_settings"]

#: the values of trainer.async_mode
ASYNC_MODES = ("sync", "one_step_off", "async")
#: the values of trainer.stale_policy
STALE_POLICIES = ("wait", "drop")


def async_defaults(cfg: DictConfig, given: Collection[str]) -> list[str]:
    """In ``one_step_off`` / ``async``, the loss of decoupled PPO unless the user chose otherwise; returns the
    line to print for what it changed (none or one).

    * ``rollout.calculate_log_probs`` -> true (the behaviour policy's log-probs, per token);
    * ``actor.skip_old_log_prob_on_policy`` -> false (samples are off-policy: ``old_log_probs`` is recomputed by
      the trainer, the proximal policy);
    * ``algorithm.rollout_correction.rollout_is`` -> ``token`` (weights ``pi_old / pi_rollout`` truncated at
      ``rollout_is_threshold``, 2.0 by default), unless bypass mode is on or rollout correction is configured.

    A value the user gave (``given``: the rlplug keys of the overrides) is kept; a contradicting one is then refused
    by :func:`check_async_config` with its reason.
    """
    if cfg.trainer.get("async_mode", "sync") == "sync":
        return []
    rc = cfg.algorithm.rollout_correction
    changes = []
    wanted: list[tuple[str, object]] = [
        ("rollout.calculate_log_probs", True),
        ("actor.skip_old_log_prob_on_policy", False),
    ]
    if not rc.bypass_mode and rc.rollout_is is None and rc.rollout_rs is None:
        wanted.append(("algorithm.rollout_correction.rollout_is", "token"))
    for key, value in wanted:
        old = OmegaConf.select(cfg, key)
        if key not in given and old != value:
            OmegaConf.update(cfg, key, value, merge=False)
            changes.append(f"{key}: {old} -> {value}")
    if not changes:
        return []
    return [
        f"{', '.join(changes)}: trainer.async_mode={cfg.trainer.async_mode} trains on samples of older weights "
        "(decoupled PPO: the engine's log-probs are the behaviour policy, old_log_probs the proximal one; docs/async.md)."
    ]


#: the settings of trainer.async_mode=async alone, with a default (so check_async_config cannot tell them given)
ASYNC_ONLY_WITH_DEFAULTS = ("trainer.max_staleness", "trainer.stale_policy")


def check_sync_settings(cfg: DictConfig, given: Collection[str], sources: Collection[str]) -> None:
    """In ``sync``, ``trainer.max_staleness`` / ``trainer.stale_policy`` given by the user in rlplug's spelling (an
    override in ``sources``, as the user wrote them, starts with the key) raise :class:`ConfigError`: nothing reads
    them, and they have defaults, so :func:`check_async_config` cannot tell them given. Through verl's
    ``trainer.v1.sampler.max_off_policy_*`` they pass, as in verl, where a whole config carries them with
    ``trainer.v1.trainer_mode=sync``. ``given``: the rlplug keys of the overrides."""
    if cfg.trainer.get("async_mode", "sync") != "sync":
        return
    direct = [
        k for k in ASYNC_ONLY_WITH_DEFAULTS if k in given and any(s.lstrip("+~").startswith(f"{k}=") for s in sources)
    ]
    if direct:
        raise ConfigError(
            f"{', '.join(direct)} bound the staleness of trainer.async_mode=async (one_step_off is staleness 1, "
            "waiting), and trainer.async_mode=sync (every sample is made with the current weights). Add "
            "trainer.async_mode=async, or drop them."
        )


def check_async_config(cfg: DictConfig) -> None:
    """Check ``trainer.async_mode`` and what goes with it; raises :class:`ConfigError` naming the key.

    Refused: an unknown mode or policy; ``max_staleness < 0``; ``one_step_off`` with a ``max_staleness`` other
    than 1 or ``stale_policy=drop`` (it is staleness 1, waiting); in an async mode, ``rollout.calculate_log_probs=false``
    (the loss needs the engine's log-probs), ``actor.skip_old_log_prob_on_policy=true`` (samples are off-policy),
    a schedule (``algorithm.schedule``, ``rollout.n_schedule``: the producer generates ahead of the phase), a
    partial rollout with multi-turn episodes; in ``sync``, the settings that only async modes use
    (``rollout.partial_rollout``, ``trainer.engine_cpus``, ``trainer.trainer_cpus``) and CPU ids this process
    cannot use.
    """
    t, r = cfg.trainer, cfg.rollout
    mode, policy, bound = t.get("async_mode", "sync"), t.get("stale_policy", "wait"), t.get("max_staleness", 1)
    if mode not in ASYNC_MODES:
        raise ConfigError(f"trainer.async_mode={mode} is not one of {', '.join(ASYNC_MODES)}.")
    if policy not in STALE_POLICIES:
        raise ConfigError(f"trainer.stale_policy={policy} is not one of {', '.join(STALE_POLICIES)}.")
    if not isinstance(bound, int) or isinstance(bound, bool) or bound < 0:
        raise ConfigError(f"trainer.max_staleness={bound} must be an integer >= 0 (weight versions).")
    async_only = {
        "rollout.partial_rollout": bool(r.get("partial_rollout", False)),
        "trainer.engine_cpus": t.get("engine_cpus") is not None,
        "trainer.trainer_cpus": t.get("trainer_cpus") is not None,
    }
    if mode == "sync":
        given = [k for k, on in async_only.items() if on]
        if given:
            raise ConfigError(
                f"{', '.join(given)} apply to the asynchronous modes only, and trainer.async_mode=sync. "
                "Add trainer.async_mode=one_step_off or trainer.async_mode=async, or drop them."
            )
        return
    if mode == "one_step_off" and (bound != 1 or policy != "wait"):
        raise ConfigError(
            f"trainer.async_mode=one_step_off trains each step on rollouts made with the previous step's weights "
            f"(staleness 1, generation waits for the push), but trainer.max_staleness={bound} "
            f"trainer.stale_policy={policy}. Drop those settings, or use trainer.async_mode=async for another bound."
        )
    if not r.calculate_log_probs:
        raise ConfigError(
            f"trainer.async_mode={mode} trains on samples of older weights and needs the engine's log-probs, but "
            "rollout.calculate_log_probs=false. Drop that setting (async modes turn it on)."
        )
    if cfg.actor.get("skip_old_log_prob_on_policy", False):
        raise ConfigError(
            f"actor.skip_old_log_prob_on_policy=true skips the old-log-prob pass for on-policy samples, but in "
            f"trainer.async_mode={mode} samples are off-policy: the pass is the proximal policy of decoupled PPO. "
            "Drop that setting (async modes turn it off), or use bypass mode "
            "(algorithm.rollout_correction.bypass_mode=true) to take the engine's log-probs as the old ones."
        )
    if cfg.algorithm.get("schedule") or (cfg.rollout.get("n_schedule") or {}).get("type"):
        raise ConfigError(
            f"trainer.async_mode={mode} generates ahead of training, so a schedule that changes the algorithm or "
            "rollout.n per step (algorithm.schedule, rollout.n_schedule) cannot be followed by the rollouts. "
            "Use trainer.async_mode=sync with a schedule."
        )
    if async_only["rollout.partial_rollout"]:
        if mode != "async":
            raise ConfigError(
                "rollout.partial_rollout=true continues responses across weight pushes, which only "
                "trainer.async_mode=async does (one_step_off pushes between batches). Use async or drop it."
            )
        if r.multi_turn.enable:
            raise ConfigError(
                "rollout.partial_rollout=true and rollout.multi_turn.enable=true cannot be combined yet: an episode's "
                "turns run under one weight version. Drop one of them."
            )
        if int(r.get("partial_chunk_tokens", 64)) < 1:
            raise ConfigError(f"rollout.partial_chunk_tokens={r.partial_chunk_tokens} must be >= 1 (tokens per chunk).")
    usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    for key in ("trainer.engine_cpus", "trainer.trainer_cpus"):
        cpus = t.get(key.split(".")[1])
        if cpus is None:
            continue
        bad = [c for c in cpus if not isinstance(c, int) or c not in usable]
        if not cpus or bad:
            raise ConfigError(
                f"{key}={list(cpus)}: {'empty' if not cpus else f'{bad} not among the usable CPUs'}; this process "
                f"may use CPUs {sorted(usable)}. Give a non-empty list of them, e.g. {key}=[{min(usable)}]."
            )
