"""The plugin registry: pluggy + the ``rlplug`` entry-point group.

Every plugin -- packaged or third-party -- is found through ``importlib.metadata`` entry points
in the group ``rlplug``; this module never imports a plugin by name. Each entry point is loaded
on its own, so one that fails to import is recorded as broken (``rlplug plugins`` shows it)
instead of taking the CLI down. After each plugin is added, ``check_pending`` catches hook
implementations whose names match no spec (a misspelled hook), and that plugin is rejected
with the error.

Environment:
    ``RLPLUG_DISABLE_PLUGINS=name,...``  entry-point or distribution names not to load.
    ``RLPLUG_TRACE_HOOKS=1``             print every hook call.
"""

from __future__ import annotations

import difflib
import importlib.metadata as md
import os
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pluggy

from rlplug.contracts import hookspecs
from rlplug.contracts.kinds import check_registration

# the error classes live in the leaf module plugin_errors; rlplug.contracts.registry.<name> is the same class
from rlplug.contracts.plugin_errors import PluginConflictError, PluginLoadError, UnknownKindError, UnknownPluginError
from rlplug.contracts.plugin_errors import PluginContractError as PluginContractError
from rlplug.contracts.plugin_errors import PluginError as PluginError
from rlplug.contracts.reward_contract import as_reward_function
from rlplug.contracts.types import Registration

ENTRY_POINT_GROUP = "rlplug"

#: kind -> name of its registration hook
KINDS: dict[str, str] = {
    "advantage_estimator": "register_advantage_estimators",
    "policy_loss": "register_policy_losses",
    "kl_penalty": "register_kl_penalties",
    "batch_filter": "register_batch_filters",
    "reward_function": "register_reward_functions",
    "rollout_backend": "register_rollout_backends",
    "training_backend": "register_training_backends",
    "tracker": "register_trackers",
    "tool": "register_tools",
    "environment": "register_environments",
}

_KIND_WORDS = {k: k.replace("_", " ") for k in KINDS}


@dataclass
class BrokenPlugin:
    """An entry point that could not be loaded (import error, bad hook, registration error)."""

    name: str
    distribution: str
    version: str
    value: str
    error: BaseException

    @property
    def message(self) -> str:
        return f"{type(self.error).__name__}: {self.error}"


@dataclass
class PluginInfo:
    """One loaded plugin (entry point or directly added object)."""

    name: str
    distribution: str
    version: str
    hooks: list[str] = field(default_factory=list)


class Registry:
    """Holds the pluggy manager and every registered object, per kind.

    Create one with :func:`get_registry` (loads entry points once, process-wide) or directly
    for tests: ``Registry(load_entry_points=False)`` then :meth:`add_plugin`.
    """

    def __init__(self, load_entry_points: bool = True) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.entries: dict[str, dict[str, Registration]] = {k: {} for k in KINDS}
        self.plugins: list[PluginInfo] = []
        self.broken: list[BrokenPlugin] = []
        self.conflicts: dict[tuple[str, str], PluginConflictError] = {}
        if os.environ.get("RLPLUG_TRACE_HOOKS"):
            self.pm.trace.root.setwriter(lambda msg: print(msg, end="", file=sys.stderr))
            self.pm.enable_tracing()
        if load_entry_points:
            self.load_entry_points()

    # ------------------------------------------------------------------ loading
    @staticmethod
    def disabled_names() -> set[str]:
        raw = os.environ.get("RLPLUG_DISABLE_PLUGINS", "")
        return {x.strip() for x in raw.split(",") if x.strip()}

    def load_entry_points(self) -> None:
        """Load every entry point of the ``rlplug`` group not disabled by the environment."""
        disabled = self.disabled_names()
        for ep in sorted(
            md.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: (e.dist.name if e.dist else "", e.name)
        ):
            dist = ep.dist.name if ep.dist is not None else "<unknown>"
            version = ep.dist.version if ep.dist is not None else ""
            if ep.name in disabled or dist in disabled:
                continue
            try:
                obj = ep.load()
            except BaseException as exc:
                if isinstance(exc, KeyboardInterrupt):
                    raise
                self.broken.append(BrokenPlugin(ep.name, dist, version, ep.value, exc))
                continue
            self.add_plugin(obj, name=ep.name, distribution=dist, version=version, value=ep.value)

    def add_plugin(
        self, obj: Any, name: str | None = None, distribution: str = "<local>", version: str = "", value: str = ""
    ) -> bool:
        """Add one plugin object (module, class or instance with hook implementations).

        Returns ``True`` when it loaded; on failure records a :class:`BrokenPlugin` and returns
        ``False``. Raises nothing for plugin errors, so one bad plugin never stops the others.
        """
        name = name or getattr(obj, "__name__", None) or repr(obj)
        try:
            self.pm.register(obj, name=name)
        except Exception as exc:  # e.g. ValueError for a duplicate plugin name, PluginValidationError
            self.broken.append(BrokenPlugin(name, distribution, version, value, exc))
            return False
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            self.pm.unregister(obj)
            self.broken.append(BrokenPlugin(name, distribution, version, value, exc))
            return False
        hooks = sorted(impl_name for impl_name in _hook_names(self.pm, obj))
        staged: list[Registration] = []
        try:
            for kind, hook_name in KINDS.items():
                for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                    if impl.plugin is not obj:
                        continue

                    def register(reg_name: str, reg_obj: Any, _kind: str = kind, **extra: Any) -> None:
                        if not isinstance(reg_name, str) or not reg_name:
                            raise TypeError(f"register() needs a non-empty string name, got {reg_name!r}")
                        reg_obj = _with_contract(_kind, reg_obj, extra)  # register(name, fn, contract="trl")
                        staged.append(Registration(_kind, reg_name, reg_obj, name, distribution, version, extra))

                    impl.function(register=register)
        except Exception as exc:  # a registration hook that raises makes the plugin broken
            self.pm.unregister(obj)
            self.broken.append(BrokenPlugin(name, distribution, version, value, exc))
            return False
        for reg in staged:
            self._insert(reg)
        self.plugins.append(PluginInfo(name, distribution, version, hooks))
        return True

    def register(
        self, kind: str, name: str, obj: Any, distribution: str = "<local>", version: str = "", **extra: Any
    ) -> None:
        """Register one object directly (for tests and interactive use); ``extra`` as in the hooks'
        ``register(name, obj, builds=Class)`` or, for a reward function, ``register(name, fn, contract="trl")``.

        Raises :class:`PluginConflictError` when ``name`` is already taken in ``kind``.
        """
        self._check_kind(kind)
        existing = self.entries[kind].get(name)
        if existing is not None:
            raise _conflict(kind, name, existing.distribution, distribution)
        obj = _with_contract(kind, obj, extra)
        self.entries[kind][name] = Registration(kind, name, obj, "<direct>", distribution, version, dict(extra))

    def _insert(self, reg: Registration) -> None:
        existing = self.entries[reg.kind].get(reg.name)
        if existing is not None or (reg.kind, reg.name) in self.conflicts:
            first = existing.distribution if existing else self.conflicts[(reg.kind, reg.name)].first
            err = _conflict(reg.kind, reg.name, first, reg.distribution)
            self.conflicts[(reg.kind, reg.name)] = err
            self.entries[reg.kind].pop(reg.name, None)
            return
        self.entries[reg.kind][reg.name] = reg

    # ------------------------------------------------------------------ lookup
    def _check_kind(self, kind: str) -> None:
        if kind not in KINDS:
            raise UnknownKindError(f"Unknown plugin kind '{kind}'. Kinds: {', '.join(KINDS)}.")

    def names(self, kind: str) -> list[str]:
        """Sorted names registered for ``kind`` (conflicting names excluded)."""
        self._check_kind(kind)
        return sorted(self.entries[kind])

    def registration(self, kind: str, name: str) -> Registration:
        """The :class:`Registration` for ``name`` in ``kind``, checked against the kind's Protocol
        (:func:`rlplug.contracts.kinds.check_registration`, once per registration); see :meth:`get` for
        errors."""
        self._check_kind(kind)
        if (kind, name) in self.conflicts:
            raise self.conflicts[(kind, name)]
        reg = self.entries[kind].get(name)
        if reg is not None:
            if not reg.extra.get("_contract_checked"):
                check_registration(reg)
                reg.extra["_contract_checked"] = True
            return reg
        for broken in self.broken:
            if broken.name == name:
                raise PluginLoadError(
                    f"The {_KIND_WORDS[kind]} '{name}' comes from plugin '{broken.name}' "
                    f"({broken.distribution} {broken.version}), which failed to load: {broken.message}"
                ) from broken.error
        raise UnknownPluginError(self._unknown_message(kind, name))

    def get(self, kind: str, name: str) -> Any:
        """The object registered as ``name`` in ``kind``.

        Raises :class:`UnknownPluginError` (no such name), :class:`PluginConflictError` (two
        distributions registered it), :class:`PluginLoadError` (its plugin failed to load),
        :class:`rlplug.contracts.registry.PluginContractError` (it does not implement the kind's Protocol:
        the message names the missing or misnamed members and the distribution) or
        :class:`UnknownKindError`.
        """
        return self.registration(kind, name).obj

    def _unknown_message(self, kind: str, name: str) -> str:
        available = self.entries[kind]
        word = _KIND_WORDS[kind]
        msg = f"Unknown {word} '{name}'."
        close = difflib.get_close_matches(str(name), list(available), n=3, cutoff=0.5)
        if close:
            msg += " Did you mean " + " or ".join(f"'{c}'" for c in close) + "?"
        if available:
            listing = ", ".join(f"{n} ({_dist_label(r.distribution, r.version)})" for n, r in sorted(available.items()))
            msg += f" Available: {listing}."
        else:
            msg += f" No {word} is registered."
        if self.broken:
            msg += (
                " Plugins that failed to load (one may provide it): "
                + "; ".join(f"{b.name} ({b.distribution}): {b.message}" for b in self.broken)
                + "."
            )
        msg += " Run 'rlplug plugins' to see what is installed (the plugin may not be installed)."
        return msg

    # ------------------------------------------------------------------ reporting
    def describe(self) -> dict:
        """A JSON-ready description: per distribution, its version and names per kind, plus broken plugins."""
        dists: dict[str, dict] = {}
        for info in self.plugins:
            d = dists.setdefault(info.distribution, {"version": info.version, "plugins": [], "registers": {}})
            d["plugins"].append(info.name)
        for kind, regs in self.entries.items():
            for reg in regs.values():
                d = dists.setdefault(reg.distribution, {"version": reg.version, "plugins": [], "registers": {}})
                d["registers"].setdefault(kind, []).append(reg.name)
        for d in dists.values():
            for names in d["registers"].values():
                names.sort()
        return {
            "distributions": dict(sorted(dists.items())),
            "broken": [
                {
                    "name": b.name,
                    "distribution": b.distribution,
                    "version": b.version,
                    "entry_point": b.value,
                    "error": b.message,
                }
                for b in self.broken
            ],
            "conflicts": [str(e) for e in self.conflicts.values()],
        }

    # ------------------------------------------------------------------ lifecycle hooks
    @property
    def hook(self) -> Any:
        """pluggy's hook relay, for the lifecycle hooks (``registry.hook.on_step_end(...)``)."""
        return self.pm.hook


def _with_contract(kind: str, obj: Any, extra: dict) -> Any:
    """A reward function registered with ``contract="trl"`` (or ``"verl"``) as the object of that contract
    (:func:`rlplug.contracts.reward_contract.as_reward_function`: TRL's batched functions are wrapped, so the registry
    holds what it knows the contract of); other registrations unchanged. Raises
    :class:`rlplug.contracts.reward_contract.RewardContractError` for an unknown contract or one the function cannot follow."""
    contract = extra.get("contract")
    if kind != "reward_function" or contract is None:
        return obj

    return as_reward_function(obj, str(contract))


def _hook_names(pm: pluggy.PluginManager, plugin: Any) -> Iterable[str]:
    callers = pm.get_hookcallers(plugin) or []
    return [c.name for c in callers]


def _dist_label(dist: str, version: str) -> str:
    return f"{dist} {version}".strip()


def _conflict(kind: str, name: str, first: str, second: str) -> PluginConflictError:
    return PluginConflictError(
        f"The {_KIND_WORDS[kind]} name '{name}' is registered twice: by {first} and by {second}. "
        f"Uninstall one of them or disable one with RLPLUG_DISABLE_PLUGINS.",
        first,
        second,
    )


_REGISTRY: Registry | None = None
_LOCK = threading.Lock()


def get_registry() -> Registry:
    """The process-wide registry, loading entry points on first use."""
    global _REGISTRY
    with _LOCK:
        if _REGISTRY is None:
            _REGISTRY = Registry()
        return _REGISTRY


def set_registry(registry: Registry | None) -> Registry | None:
    """Replace the process-wide registry (``None`` reloads on next use); returns the previous one."""
    global _REGISTRY
    with _LOCK:
        prev, _REGISTRY = _REGISTRY, registry
        return prev


def plugin_names(kind: str) -> list[str]:
    """Sorted names registered for ``kind`` (e.g. ``plugin_names("advantage_estimator")``)."""
    return get_registry().names(kind)


def get_plugin(kind: str, name: str) -> Any:
    """The object registered as ``name`` in ``kind``; raises :class:`UnknownPluginError` and friends."""
    return get_registry().get(kind, name)
