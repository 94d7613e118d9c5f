"""Composing the run configuration the Hydra way: ``configs/`` plus the command line's overrides.

:func:`compose` translates verl's key names (:mod:`rlplug.config.verl_keys`), spells the entries of the schema's
open maps so Hydra accepts them (:func:`rlplug.config.schema.rewrite_overrides`), composes ``configs/config.yaml``
against the structured schema (:class:`rlplug.config.schema.RunConfig`), and then makes a preset's critic follow the
advantage estimator (:func:`critic_follows_estimator`) and names the run (:func:`run_algorithm_name`,
:func:`rlplug.config.run_paths.experiment_name_for`). Hydra's errors become :class:`rlplug.config.schema.ConfigError`
messages that list the valid keys (:func:`explain_compose_error`).

The schema itself (the dataclasses, :class:`~rlplug.config.schema.ConfigError`, :func:`~rlplug.config.schema.config_get`)
is :mod:`rlplug.config.schema`, which imports nothing of this module; the result of :func:`compose` is checked by
:func:`rlplug.run.validate.validate_config`.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import sys
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from rlplug.config.async_mode import async_defaults, check_sync_settings
from rlplug.config.run_paths import experiment_name_for
from rlplug.config.schema import (
    ConfigError,
    RunConfig,
    config_dir,
    open_map_fields,
    register_schema,
    rewrite_overrides,
    typed,
)
from rlplug.config.verl_keys import suggest as verl_suggest
from rlplug.config.verl_keys import translate_overrides
from rlplug.contracts.registry import PluginError, get_registry

__all__ = [
    "compose",
    "critic_follows_estimator",
    "critic_values_needed",
    "explain_compose_error",
    "preset_setting",
    "run_algorithm_name",
]


def compose(overrides: list[str] | None = None, config_name: str = "config") -> DictConfig:
    """Compose the run config the Hydra way from ``configs/`` and ``overrides``.

    ``overrides`` are Hydra override strings (``algorithm=grpo``, ``rollout.n=4``); verl's key names
    (``actor_rollout_ref.actor.ppo_mini_batch_size=64``) are translated first and the notes of the inert
    ones printed to stderr (:func:`rlplug.config.verl_keys.translate_overrides`, ``docs/verl.md``). Entries of the
    schema's open maps need no ``+`` and may use keys Hydra's key grammar cannot hold
    (``reward.reward_fn_map.openai/gsm8k=math_verify``): see :func:`rlplug.config.schema.rewrite_overrides`.
    Raises :class:`rlplug.config.schema.ConfigError` for an unknown key, an unknown group option or a bad value,
    listing the valid choices. After composing:

    * verl's deprecated global micro-batch sizes given are divided by the number of training processes
      (:meth:`rlplug.config.verl_keys.Translation.apply_deprecated`, :func:`rlplug.config.schema.training_world_size`),
      with a warning;
    * the critic follows the advantage estimator unless the user gives ``critic.enable``: a preset's
      ``critic.enable`` and ``trainer.critic_warmup`` that disagree with it are changed, with one line
      printed (:func:`critic_follows_estimator`);
    * in ``trainer.async_mode=one_step_off`` / ``async``, the decoupled-PPO settings the user did not give are set,
      with one line printed (:func:`rlplug.config.async_mode.async_defaults`);
    * an unset ``trainer.experiment_name`` is filled in from the chosen ``algorithm=`` preset, or the
      estimator that replaced the preset's own (:func:`run_algorithm_name`), and the data
      (:func:`rlplug.config.run_paths.experiment_name_for`), so each algorithm trains in a run directory of its own.

    The result is not yet validated; see :func:`rlplug.run.validate.validate_config`.
    """
    from hydra import compose as hydra_compose  # deferred: hydra
    from hydra import initialize_config_dir  # deferred: hydra
    from hydra.core.global_hydra import GlobalHydra  # deferred: hydra
    from hydra.errors import HydraException  # deferred: hydra

    register_schema()
    translation = translate_overrides(overrides or [])  # verl's key names -> rlplug's (docs/verl.md)
    rewritten = rewrite_overrides(translation.overrides)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            cfg = hydra_compose(config_name=config_name, overrides=rewritten, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as exc:
        msg = _quote_as_given(explain_compose_error(exc), translation.sources, rewritten)
        raise ConfigError(msg) from exc
    finally:
        GlobalHydra.instance().clear()
    chosen = OmegaConf.select(cfg, "hydra.runtime.choices")  # group -> option, e.g. {algorithm: ppo, debug: None}
    choices: dict[str, Any] = dict(OmegaConf.to_container(chosen)) if chosen is not None else {}  # type: ignore[arg-type]
    with open_dict(cfg):
        del cfg["hydra"]
    translation.print_notes()  # the inert verl keys given: one line per reason, each key once
    for line in translation.apply_deprecated(cfg):  # verl's deprecated global micro-batch sizes, per device
        print(line, file=sys.stderr)
    for line in critic_follows_estimator(cfg, translation.keys, choices):  # a preset's critic vs the estimator
        print(line, file=sys.stderr)
    for line in async_defaults(cfg, translation.keys):  # trainer.async_mode: the decoupled-PPO loss's settings
        print(line, file=sys.stderr)
    check_sync_settings(cfg, translation.keys, translation.sources)  # sync: no staleness settings
    if not cfg.trainer.experiment_name:
        name = run_algorithm_name(cfg, choices.get("algorithm"))  # the preset, or the estimator that replaced its own
        cfg.trainer.experiment_name = experiment_name_for(cfg, name, prefix=choices.get("debug"))
    return cfg


def _quote_as_given(msg: str, given: Sequence[str], sent: Sequence[str]) -> str:
    """``msg`` (Hydra's error) with each override Hydra was sent replaced by the override the user wrote
    (``sent[i]`` came from ``given[i]``). At each place the longest override that matches wins, so one
    override that is a prefix of another (``actor.x=2`` of ``actor.x=2.0``) is not replaced inside it."""
    spelled: dict[str, str] = {}
    for g, s in zip(given, sent):
        if s:
            spelled.setdefault(s, g)
    if not spelled or all(g == s for s, g in spelled.items()):
        return msg
    pattern = "|".join(re.escape(s) for s in sorted(spelled, key=len, reverse=True))
    return re.sub(pattern, lambda m: spelled[m.group(0)], msg)


def explain_compose_error(exc: Exception) -> str:
    """Hydra's or OmegaConf's error ``exc`` as a message: an unknown key names the valid keys of its section
    (and close names, verl's spellings among them); a bad value says why; a path starting with an unquoted
    ``~`` says to quote it. Other messages are returned as they are."""
    msg = str(exc)
    key = None
    m = re.search(r"Could not override '([^']+)'", msg) or re.search(
        r"Could not append to config\. An item is already at '([^']+)'", msg
    )
    if m:
        key = m.group(1)
    cause = exc.__cause__ or exc.__context__
    if key is None:
        key = getattr(exc, "full_key", None) or getattr(cause, "full_key", None)
    unknown = "not in" in msg or "not in" in str(cause or "") or "Could not override" in msg
    if not (key and unknown):
        if msg.startswith("Error merging override") and cause is not None:  # say why (the bad value)
            return f"{msg}: {str(cause).splitlines()[0]}"
        if "LexerNoViableAlt" in msg and re.search(r"[=\[,]\s*~", msg):
            return (
                f"{msg}\nHydra reads an unquoted ~ as its delete operator: quote a path that starts with ~, "
                "e.g. \"data.train_files=['~/data/train.parquet']\" or \"model.path='~/models/x'\" (rlplug expands ~)."
            )
        return msg
    key = key.lstrip("+~")
    parts = key.split(".")
    try:
        node: Any = OmegaConf.structured(RunConfig)
    except Exception:  # pragma: no cover - best effort listing
        return msg
    depth = 0  # walk down the schema to the first part it lacks
    while depth < len(parts) - 1 and isinstance(node, DictConfig) and parts[depth] in node:
        node, depth = node[parts[depth]], depth + 1
    parent = ".".join(parts[:depth])
    if not isinstance(node, DictConfig):
        return (
            f"Unknown config key '{key}': '{parent}' is a single value ({type(node).__name__}), not a section "
            f"with keys; set '{parent}' itself."
        )
    if parts[depth] in node:  # the key exists: the error is about something else
        return _explain_value_key(msg, key, cause)
    if parent in open_map_fields():
        return f"Could not set '{key}' in the map '{parent}': {msg}"
    missing = ".".join(parts[: depth + 1])
    valid = sorted(str(k) for k in node.keys())
    where = f"'{parent}'" if parent else "the top level"
    close = [f"'{parent + '.' if parent else ''}{c}'" for c in difflib.get_close_matches(parts[depth], valid, n=3)]
    close += [f"verl's '{k}' (docs/verl.md)" for k in verl_suggest(key) if f"'{k}'" not in close]
    hint = (" Did you mean " + " or ".join(close) + "?") if close else ""
    return f"Unknown config key '{missing}'.{hint} Valid keys in {where}: {', '.join(valid)}."


def _explain_value_key(msg: str, key: str, cause: BaseException | None) -> str:
    """Hydra's ``Could not override 'KEY'`` for an existing ``KEY`` whose value (a mapping, a list of
    mappings) holds a key the schema lacks (``algorithm.schedule=[{until: 1, bogus: 2}]``): name that key
    and the valid ones instead of Hydra's advice to append with ``+``. Other messages: unchanged."""
    if cause is None or not msg.startswith("Could not override") or " not in " not in str(cause):
        return msg
    inner = str(cause).splitlines()[0]
    obj = getattr(cause, "object_type", None)
    valid = ""
    if isinstance(obj, type) and dataclasses.is_dataclass(obj):
        valid = f" Valid keys there: {', '.join(f.name for f in dataclasses.fields(obj))}."
    return f"Could not set '{key}': its value has an unknown key ({inner}).{valid}"


# ============================================================================ the critic follows the estimator


def preset_setting(choices: Mapping[str, Any], key: str) -> tuple[str, Any] | None:
    """Which chosen preset file sets ``key``, and to what: ``("configs/algorithm/ppo.yaml", True)`` for
    ``critic.enable`` under the default config; None when no chosen file sets it (the schema's default).

    ``choices`` maps each config group to its chosen option (Hydra's ``hydra.runtime.choices``, e.g.
    ``{"algorithm": "ppo", "experiment": "default", "debug": None}``). The files are searched in the reverse
    order of ``configs/config.yaml``'s defaults list (``debug`` before ``experiment`` before ``algorithm``),
    the order in which the last one wins when Hydra composes them. A file with ``# @package _global_`` holds
    top-level keys; another holds its group's keys under the group's name (Hydra's default package).
    """
    root = config_dir()
    for group in reversed(_group_order(root)):
        choice = choices.get(group)
        path = root / group / f"{choice}.yaml"
        if not choice or not path.is_file():
            continue
        text = path.read_text()
        try:
            node: Any = OmegaConf.create(text)
        except Exception:  # pragma: no cover - Hydra has read it already
            continue
        if node is None or not _global_package(text):
            node = OmegaConf.create({group: node})
        with open_dict(node):
            node.pop("defaults", None)
        missing = object()
        try:
            value = OmegaConf.select(node, key, default=missing)
        except Exception:  # an interpolation that resolves only in the whole config: the file sets the key
            value = OmegaConf.select(node, key, default=missing, throw_on_resolution_failure=False)
        if value is not missing:
            return f"configs/{group}/{choice}.yaml", value
    return None


def _global_package(text: str) -> bool:
    """Whether a config file's header (its leading comment lines) says ``# @package _global_``."""
    for line in text.splitlines():
        if not line.startswith("#"):
            return False
        if re.fullmatch(r"#\s*@package\s+_global_\s*", line.strip()):
            return True
    return False


@functools.cache
def _group_order(root: Path) -> tuple[str, ...]:
    """The config groups in the order ``root/config.yaml``'s defaults list composes them."""
    loaded = OmegaConf.load(root / "config.yaml")
    defaults = loaded.get("defaults", []) if isinstance(loaded, DictConfig) else []
    out: list[str] = []
    for entry in defaults:
        if isinstance(entry, DictConfig):
            out += [str(k).lstrip("/").split("@", 1)[0] for k in entry.keys() if not str(k).startswith("override ")]
    return tuple(out)


def critic_values_needed(cfg: Any) -> tuple[bool, list[str]] | None:
    """Whether the selected plugins need a critic: ``(needed, who)`` with ``who`` the settings whose plugin
    requires the batch field ``values`` (``["algorithm.adv_estimator=gae"]``), from the registry's
    ``requires`` of ``algorithm.adv_estimator`` and ``actor.policy_loss`` (the rule of
    :func:`rlplug.run.validate.plan_batch`; verl's ``need_critic`` is the same rule for its estimators: on for
    ``gae`` only). None when a name does not resolve (validation reports it)."""
    registry = get_registry()
    who = []
    run = typed(RunConfig, cfg)
    for kind, key, name in (
        ("advantage_estimator", "algorithm.adv_estimator", run.algorithm.adv_estimator),
        ("policy_loss", "actor.policy_loss", run.actor.policy_loss),
    ):
        try:
            plugin = registry.registration(kind, str(name)).obj
        except PluginError:
            return None
        if "values" in tuple(getattr(plugin, "requires", ()) or ()):
            who.append(f"{key}={name}")
    return bool(who), who


def critic_follows_estimator(cfg: DictConfig, given: Collection[str], choices: Mapping[str, Any]) -> list[str]:
    """Make a preset's critic settings follow the advantage estimator, as verl's ``need_critic`` does;
    returns the line to print for what it changed (none or one).

    verl trains a critic when ``critic.enable`` is true, or, with it unset (its default), when the estimator
    is ``gae`` (``verl/trainer/ppo/utils.py::need_critic``); rlplug's presets set ``critic.enable``
    (``configs/algorithm/ppo.yaml``: true), so ``algorithm.adv_estimator=grpo`` on the default config would
    keep PPO's critic. Here a ``critic.enable`` that the user did not give (``given``: the rlplug keys the
    overrides set, :attr:`rlplug.config.verl_keys.Translation.keys`) and that disagrees with what the estimator and
    the policy loss require (:func:`critic_values_needed`) is set to that, and a ``trainer.critic_warmup > 0``
    that the user did not give is set to 0 when no critic is trained (a warm-up without a critic would keep
    the actor frozen for nothing). Values the user gives are kept (``critic.enable=true`` beside a critic-free
    estimator trains a critic; an explicit warm-up without a critic is refused by
    :func:`rlplug.run.validate.validate_config`). ``choices``: the chosen config groups, to name the preset file
    a changed value came from (:func:`preset_setting`). Nothing changes when a plugin name does not resolve.
    """
    decided = critic_values_needed(cfg)
    if decided is None:
        return []
    needed, who = decided
    changes: list[str] = []

    def change(key: str, old: Any, new: Any) -> None:
        found = preset_setting(choices, key)
        where = f"from {found[0]}" if found is not None else "from the config files"
        changes.append(f"{key}: {_yaml(old)} ({where}) -> {_yaml(new)}")
        OmegaConf.update(cfg, key, new, merge=False)

    enable = cfg.critic.enable
    if "critic.enable" not in given and enable is not None and bool(enable) != needed:
        change("critic.enable", enable, needed)
        enable = needed
    trained = bool(enable) if enable is not None else needed
    warmup = cfg.trainer.critic_warmup
    if not trained and "trainer.critic_warmup" not in given and isinstance(warmup, int) and warmup > 0:
        change("trainer.critic_warmup", warmup, 0)
    if not changes:
        return []
    estimator = f"algorithm.adv_estimator={cfg.algorithm.adv_estimator}"
    if needed:
        why = f"{' and '.join(who)} requires values, which only a critic produces"
    elif "critic.enable" in given:
        why = "critic.enable=false: no critic is trained, so a warm-up would keep the actor frozen for nothing"
    else:
        why = f"{estimator} needs no critic (no selected plugin requires values; verl decides the same way)"
    tail = "; set critic.enable=true to keep it" if any(c.startswith("critic.enable: true") for c in changes) else ""
    return [f"{', '.join(changes)}: {why}{tail}."]


def run_algorithm_name(cfg: Any, preset: str | None) -> str | None:
    """The algorithm part of the run's name (:func:`rlplug.config.run_paths.experiment_name_for`): the chosen
    ``algorithm=`` preset (``ppo``, ``dr_grpo``), unless ``algorithm.adv_estimator`` is not the preset's own
    estimator (``algorithm.adv_estimator=grpo`` on the default config): then the estimator (``grpo``), so the
    run is named after what it trains. None without a preset (the estimator then)."""
    if not preset:
        return None
    found = preset_setting({"algorithm": preset}, "algorithm.adv_estimator")
    estimator = typed(RunConfig, cfg).algorithm.adv_estimator
    if found is not None and estimator is not None and str(found[1]) != str(estimator):
        return str(estimator)
    return str(preset)


def _yaml(value: Any) -> str:
    """``value`` as YAML writes a scalar (``true``, ``3``, ``null``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
