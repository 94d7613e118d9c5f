"""Plugin contracts as code: each kind's Protocol, and the check run when a plugin is selected.

Every plugin kind has a runtime-checkable ``typing.Protocol`` in :mod:`rlplug.contracts.types` for the
object its registrations build:

===================== ====================================== ======================================
kind                  protocol                               the registered object
===================== ====================================== ======================================
advantage_estimator   :class:`~rlplug.contracts.types.AdvantageEstimatorProtocol`  the estimator itself
policy_loss           :class:`~rlplug.contracts.types.PolicyLossProtocol`          the loss itself
kl_penalty            :class:`~rlplug.contracts.types.KLPenaltyProtocol`           the estimator itself
batch_filter          :class:`~rlplug.contracts.types.BatchFilterProtocol`         the filter itself
reward_function       :class:`~rlplug.contracts.types.RewardFunction`              the function itself
rollout_backend       :class:`~rlplug.contracts.types.RolloutBackend`              a factory (class or ``builds=``)
training_backend      :class:`~rlplug.contracts.types.TrainingBackend`             a factory (class or ``builds=``)
tracker               :class:`~rlplug.contracts.types.Tracker`                     a factory (class or ``builds=``)
tool                  :class:`~rlplug.contracts.agents.ToolProtocol`               the tool itself
environment           :class:`~rlplug.contracts.agents.EnvironmentProtocol`        a factory (class or ``builds=``)
===================== ====================================== ======================================

:func:`check_registration` runs when the registry resolves a name (``rlplug train`` and
``rlplug config`` resolve every selected plugin before any model loads). For factory kinds it
checks the class the factory builds -- the registered class itself, or the class(es) declared
with ``register(name, factory, builds=Class)`` -- with :mod:`inspect`, without building
anything. It checks that every member of the Protocol exists (methods callable with the
arguments the engine passes, attributes present), suggests the intended name for a misspelled
one, and raises :class:`rlplug.contracts.registry.PluginContractError` naming the kind, the plugin name, the distribution
that supplied it and every problem found. A tool is also checked for what the Protocol cannot say
(:func:`rlplug.contracts.agents.tool_problems`): a valid ``name`` equal to the registered one, a
non-empty ``description``, ``parameters`` a JSON schema object (``type: object``, ``properties``,
``required`` among them), and a ``__call__`` that accepts those parameters as keywords. An environment's
class is also checked for its optional members (:func:`environment_class_problems`): ``close()`` callable
with no argument, ``stop`` (when set on the class) a sequence of non-empty strings.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlplug.contracts import types as T
from rlplug.contracts.agents import EnvironmentProtocol, ToolProtocol, schema_problems, tool_problems
from rlplug.contracts.plugin_errors import PluginContractError

__all__ = [
    "KindContract",
    "CONTRACTS",
    "check_registration",
    "check_object",
    "built_classes",
    "protocol_members",
    "environment_class_problems",
]


@dataclass(frozen=True)
class KindContract:
    """What a kind's registrations must provide.

    ``protocol``: the Protocol from :mod:`rlplug.contracts.types`. ``factory``: the registered object
    builds instances (check the class it builds, not the object). ``call_target``: for wrapper
    objects, a function giving the callable whose signature to check (e.g. a ``PolicyLoss``'s
    ``fn``). ``capabilities``: the optional behaviours the kind may declare in a
    ``capabilities`` attribute. ``call_keywords``: for objects the engine calls with keyword
    arguments they describe themselves (a tool's ``parameters``), a function giving those names, or
    ``None`` when the object does not describe them validly. ``extra_check``: a function giving the
    problems the Protocol cannot express (e.g. a tool's schema); ``class_check`` the same for the class a
    factory builds (e.g. an environment's optional ``close`` and ``stop``). ``named``: the object carries its
    own ``name``, which must equal the registered name. ``optional``: members the Protocol leaves out but the
    engine uses when present (never suggested as the misspelling of a missing member: ``stop`` for ``step``).
    """

    kind: str
    protocol: type
    factory: bool = False
    call_target: Callable[[Any], Any] | None = None
    capabilities: tuple[str, ...] = ()
    call_keywords: Callable[[Any], list[str] | None] | None = None
    extra_check: Callable[[Any], list[str]] | None = None
    class_check: Callable[[type], list[str]] | None = None
    named: bool = False
    optional: tuple[str, ...] = ()


def _wrapped_fn(obj: Any) -> Any:
    # rlplug's wrapper dataclasses (AdvantageEstimator, PolicyLoss, KLPenalty) forward __call__ to fn
    if isinstance(obj, (T.AdvantageEstimator, T.PolicyLoss, T.KLPenalty, T.BatchFilter)):
        return obj.fn
    return obj


def _tool_keywords(tool: Any) -> list[str] | None:
    # a tool is called with the parameters its schema declares, as keywords
    parameters: Any = getattr(tool, "parameters", None)
    if schema_problems(parameters):
        return None
    return list(parameters["properties"])


def environment_class_problems(cls: type) -> list[str]:
    """Problems of an environment class's optional members (empty: none): ``close``, when present, must be a
    method callable with no argument; ``stop``, when set on the class (not a property), must be a list or tuple
    of non-empty strings (a bare string would be read as its characters)."""
    problems: list[str] = []
    label = _name(cls)
    close = getattr(cls, "close", None)
    if close is not None:
        member = inspect.getattr_static(cls, "close")
        if not callable(close):
            problems.append(f"{label}.close is a {type(member).__name__}, not a method")
        else:
            static = isinstance(member, (staticmethod, classmethod))
            problem = _bind_problem(close, f"{label}.close", ([], []), drop_self=not static)
            if problem:
                problems.append(problem)
    stop = inspect.getattr_static(cls, "stop", None)
    if stop is not None and not isinstance(stop, (property, staticmethod, classmethod)) and not callable(stop):
        if isinstance(stop, str) or not isinstance(stop, (list, tuple)):
            problems.append(f"{label}.stop must be a tuple of stop strings, e.g. ('</calculator>',), got {stop!r}")
        elif not all(isinstance(s, str) and s for s in stop):
            problems.append(f"{label}.stop must hold non-empty strings only, got {stop!r}")
    return problems


CONTRACTS: dict[str, KindContract] = {
    "advantage_estimator": KindContract("advantage_estimator", T.AdvantageEstimatorProtocol, call_target=_wrapped_fn),
    "policy_loss": KindContract("policy_loss", T.PolicyLossProtocol, call_target=_wrapped_fn),
    "kl_penalty": KindContract("kl_penalty", T.KLPenaltyProtocol, call_target=_wrapped_fn),
    "batch_filter": KindContract("batch_filter", T.BatchFilterProtocol, call_target=_wrapped_fn),
    "reward_function": KindContract("reward_function", T.RewardFunction),
    "rollout_backend": KindContract("rollout_backend", T.RolloutBackend, factory=True),
    "training_backend": KindContract(
        "training_backend", T.TrainingBackend, factory=True, capabilities=T.TRAINING_CAPABILITIES
    ),
    "tracker": KindContract("tracker", T.Tracker, factory=True),
    "tool": KindContract("tool", ToolProtocol, call_keywords=_tool_keywords, extra_check=tool_problems, named=True),
    "environment": KindContract(
        "environment",
        EnvironmentProtocol,
        factory=True,
        class_check=environment_class_problems,
        optional=("close", "stop"),
    ),
}


# ============================================================================ protocol members


def protocol_members(protocol: type) -> tuple[dict[str, inspect.Signature], set[str]]:
    """``(methods, attributes)`` of a Protocol: method name -> signature (``self`` dropped), and
    the names of its annotated attributes. Members starting with ``_`` are skipped, except
    ``__call__``."""
    methods: dict[str, inspect.Signature] = {}
    attributes: set[str] = set()
    for klass in reversed(protocol.__mro__):
        if klass in (object,) or klass.__module__ == "typing":
            continue
        attributes.update(n for n in vars(klass).get("__annotations__", {}) if not n.startswith("_"))
        for name, value in vars(klass).items():
            if (name.startswith("_") and name != "__call__") or not inspect.isfunction(value):
                continue
            sig = inspect.signature(value)
            params = list(sig.parameters.values())[1:]  # drop self
            methods[name] = sig.replace(parameters=params)
    return methods, attributes


def _call_pattern(sig: inspect.Signature) -> tuple[list[str], list[str]]:
    """How the engine calls a member: positional names (no default) and keyword names."""
    positional, keywords = [], []
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.kind == p.POSITIONAL_ONLY or (p.kind == p.POSITIONAL_OR_KEYWORD and p.default is p.empty):
            positional.append(p.name)
        else:
            keywords.append(p.name)
    return positional, keywords


def _fmt_call(name: str, positional: list[str], keywords: list[str]) -> str:
    return f"{name}({', '.join(positional + [f'{k}=...' for k in keywords])})"


def _fmt_params(sig: inspect.Signature) -> str:
    """``(a, b, *, c=...)``: the parameter names without annotations."""
    out, star = [], False
    for p in sig.parameters.values():
        if p.kind == p.VAR_POSITIONAL:
            out.append(f"*{p.name}")
            star = True
        elif p.kind == p.VAR_KEYWORD:
            out.append(f"**{p.name}")
        else:
            if p.kind == p.KEYWORD_ONLY and not star:
                out.append("*")
                star = True
            out.append(p.name if p.default is p.empty else f"{p.name}=...")
    return f"({', '.join(out)})"


def _bind_problem(fn: Any, label: str, pattern: tuple[list[str], list[str]], *, drop_self: bool) -> str | None:
    """``None`` when ``fn`` accepts the engine's call, else a sentence saying why not."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return None
    params = list(sig.parameters.values())
    if drop_self and params:
        params = params[1:]
        sig = sig.replace(parameters=params)
    positional, keywords = pattern
    try:
        sig.bind(*positional, **{k: None for k in keywords})
    except TypeError as exc:
        return f"{label}{_fmt_params(sig)} cannot be called as {_fmt_call(label, positional, keywords)}: {exc}"
    return None


# ============================================================================ checks


def _name(obj: Any) -> str:
    """A readable name: the qualified name without ``<locals>`` parts."""
    name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return name.split("<locals>.")[-1]


def built_classes(obj: Any, extra: dict | None = None) -> list[type]:
    """The classes a factory registration builds: the registered class itself, or what it declares
    with ``register(name, factory, builds=Class or (Class, ...))`` (or a ``builds`` attribute on the
    factory). Empty when nothing is declared."""
    if inspect.isclass(obj):
        return [obj]
    declared = (extra or {}).get("builds", getattr(obj, "builds", None))
    if declared is None:
        return []
    items = declared if isinstance(declared, (tuple, list)) else (declared,)
    return [c for c in items if inspect.isclass(c)]


def _has_attribute(target: Any, name: str, is_class: bool) -> bool:
    if hasattr(target, name):
        return True
    if is_class:  # declared as an annotation (set in __init__)
        return any(name in vars(k).get("__annotations__", {}) for k in getattr(target, "__mro__", ()))
    return False


def check_object(kind: str, target: Any, *, is_class: bool = False, label: str | None = None) -> list[str]:
    """Problems of ``target`` against ``kind``'s Protocol (empty: it conforms).

    ``target`` is the object itself (algorithm and reward kinds) or, with ``is_class``, the class a
    factory builds (its methods are checked unbound). ``label`` names it in the messages.
    """
    contract = CONTRACTS[kind]
    methods, attributes = protocol_members(contract.protocol)
    own_name = getattr(target, "name", None) if contract.named and not is_class else None
    label = label or (own_name if isinstance(own_name, str) and own_name else _name(target))
    problems: list[str] = []
    public = sorted({n for n in dir(target) if not n.startswith("_")})
    missing: list[str] = []
    for name, sig in methods.items():
        pattern = _call_pattern(sig)
        if name == "__call__":  # inspect.signature of a function, bound method or callable instance
            keywords = contract.call_keywords(target) if contract.call_keywords is not None else None
            if keywords is not None:
                pattern = (pattern[0], keywords)
            fn = contract.call_target(target) if contract.call_target is not None else target
            if not callable(fn):
                problems.append(f"{label} is not callable; expected {_fmt_call('obj', *pattern)}")
                continue
            problem = _bind_problem(fn, label, pattern, drop_self=False)
            if problem:
                problems.append(problem)
            continue
        if not hasattr(target, name):
            missing.append(name)
            continue
        member = getattr(target, name)
        if not callable(member):
            problems.append(f"{label}.{name} is a {type(member).__name__}, not a method")
            continue
        static = is_class and isinstance(inspect.getattr_static(target, name, None), (staticmethod, classmethod))
        problem = _bind_problem(member, f"{label}.{name}", pattern, drop_self=is_class and not static)
        if problem:
            problems.append(problem)
    for name in sorted(attributes):
        if not _has_attribute(target, name, is_class):
            missing.append(name)
    for name in missing:
        what = f"method {name}()" if name in methods else f"attribute '{name}'"
        close = [
            c
            for c in difflib.get_close_matches(name, public, n=2, cutoff=0.75)
            if c not in methods and c not in attributes and c not in contract.optional
        ]
        hint = f" (found {' / '.join(repr(c) for c in close)}: misnamed?)" if close else ""
        problems.append(f"{label} has no {what}{hint}")
    if contract.capabilities and "capabilities" in attributes and hasattr(target, "capabilities"):
        try:
            declared = set(target.capabilities)
        except TypeError:
            declared = set()
            problems.append(f"{label}.capabilities must be a set of strings")
        unknown = sorted(declared - set(contract.capabilities))
        if unknown:
            problems.append(f"{label}.capabilities lists unknown {unknown}; known: {list(contract.capabilities)}")
    if contract.extra_check is not None and not is_class:
        problems += [f"{label}: {p}" for p in contract.extra_check(target)]
    if contract.class_check is not None and is_class:
        problems += contract.class_check(target)
    return problems


def check_registration(reg: T.Registration) -> None:
    """Check one registration against its kind's Protocol; raises :class:`rlplug.contracts.registry.PluginContractError`.

    The message names the kind, the name, the distribution (and plugin) that registered it and
    every problem, e.g. ``The rollout backend 'myroll' (rlplug-myroll 0.1.0, plugin myroll) does
    not implement rlplug.contracts.types.RolloutBackend: MyRollout has no method sleep(); ...``.
    """
    contract = CONTRACTS.get(reg.kind)
    if contract is None:
        return
    problems: list[str] = []
    if contract.factory:
        if not callable(reg.obj):
            problems.append(f"the registered object {reg.obj!r} is not a factory (a class or a function)")
        else:
            classes = built_classes(reg.obj, reg.extra)
            if not classes:
                problems.append(
                    f"the factory {_name(reg.obj)!r} does not declare the class it builds; "
                    f"register the class itself or register(name, factory, builds=TheClass) so its methods can be checked"
                )
            for cls in classes:
                problems += check_object(reg.kind, cls, is_class=True, label=_name(cls))
    elif contract.named:
        problems += check_object(reg.kind, reg.obj, label=reg.name)
        own = getattr(reg.obj, "name", reg.name)
        if isinstance(own, str) and own != reg.name:
            problems.append(
                f"it is registered as {reg.name!r} but its name is {own!r}; the model calls it by its name, "
                f"so register it under that name"
            )
    else:
        problems += check_object(
            reg.kind, reg.obj, label=_name(_wrapped_fn(reg.obj)) if callable(reg.obj) else reg.name
        )
    if problems:
        kind_words = reg.kind.replace("_", " ")
        proto = contract.protocol
        dist = f"{reg.distribution} {reg.version}".strip()
        raise PluginContractError(
            f"The {kind_words} '{reg.name}' ({dist}, plugin {reg.plugin}) does not implement "
            f"{proto.__module__}.{proto.__qualname__}: "
            + "; ".join(problems)
            + f". Fix the plugin (see the {proto.__qualname__} docstring and rlplug.testing.check_{reg.kind}), "
            f"or uninstall {reg.distribution} / disable it with RLPLUG_DISABLE_PLUGINS.",
            problems,
        )
