"""Contracts of the multi-turn kinds: the ``environment`` an episode talks to and the ``tool`` it calls.

Their place in the layers is fixed here, with the other contracts, before the kinds are wired into the run
(issue 33 registers them through the hooks ``register_environments`` / ``register_tools``, selects them with
``rollout.multi_turn.*`` and adds their conformance kits). Episodes themselves -- turns, tool workers, token
bookkeeping -- belong to :mod:`rlplug.orchestration`, the layer above the rollout library.

A *message* is a chat message as chat templates take it: a mapping with ``role`` (``"system"``, ``"user"``,
``"assistant"`` or ``"tool"``) and ``content`` (text); a tool message may carry ``name`` / ``tool_call_id``.

* :class:`EnvironmentProtocol`: one instance per trajectory. ``reset(row)`` gets the dataset row (verl's row
  schema) and returns the initial messages (it may rewrite the prompt); ``step(assistant_message)`` returns an
  :class:`EnvStep`: the observation messages to append, this turn's reward (``None``: none) and whether the
  episode is over. ``close()`` is optional. Methods may be ``async def``; the engine runs plain ones in a thread.
* :class:`ToolProtocol`: a named callable with a JSON schema of its parameters (what a chat template's
  ``tools=`` takes, as verl's function tools and TRL's ``tools=`` describe them); calling it with the
  parameters returns the result as text, or raises. ``__call__`` may be ``async def``.
* :class:`FunctionTool`: a plain or ``async`` function as a tool, its schema taken from the signature and the
  docstring; it checks the model's arguments against that schema (:func:`validate_arguments`) and raises
  :class:`ToolArgumentError`, a :class:`ToolError`: an error whose message is meant for the model.
* :func:`tool_problems`: what the registry and ``check_tool`` find wrong with a tool's ``name``, ``description``
  and ``parameters`` (:func:`schema_problems`).
"""

from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "Message",
    "EnvStep",
    "EnvironmentProtocol",
    "ToolProtocol",
    "ToolError",
    "ToolArgumentError",
    "ToolSchemaError",
    "FunctionTool",
    "ToolResult",
    "TOOL_STATUSES",
    "EnvironmentContext",
    "JSON_TYPES",
    "TOOL_NAME_PATTERN",
    "schema_problems",
    "tool_problems",
    "validate_arguments",
]

#: a chat message: {"role": ..., "content": ...} (plus "name" / "tool_call_id" on tool messages)
Message = Mapping[str, Any]


@dataclass(frozen=True)
class EnvStep:
    """What one environment step returns.

    ``observations``: messages to append after the assistant's (tool results, a user's reply); may be empty.
    ``reward``: this turn's reward (float), or ``None`` when the environment scores only at the end (the reward
    functions then score the whole trajectory). ``done``: the episode is over; no further assistant turn.
    ``info``: free-form diagnostics, logged, never trained on.
    """

    observations: Sequence[Message] = ()
    reward: float | None = None
    done: bool = False
    info: Mapping[str, Any] = field(default_factory=dict)


@runtime_checkable
class EnvironmentProtocol(Protocol):
    """One trajectory's environment (kind ``environment``). Methods may be coroutines (``async def``).

    The registered object is a factory, ``factory(context: EnvironmentContext) -> EnvironmentProtocol``,
    called once per trajectory. Optional members: ``close()`` (called once when the episode ends, also
    after an error or a timeout); ``stop`` (a stop string, or a sequence of them, the engine ends an assistant turn
    at, e.g. ``("</calculator>",)`` so that a tool call is answered before the model goes on; the stopping
    text is kept in the turn); ``tools`` (a mapping by name of objects with ``name``, ``description``,
    ``parameters``: the environment's own tools, given to the chat template with ``format=hermes``);
    ``final_reward()`` (a number or None: called when the engine, not the environment, ended the episode --
    at the length budget, the turn cap or the deadline -- and placed on the last sampled token).
    """

    def reset(self, row: Mapping[str, Any]) -> Sequence[Message] | Awaitable[Sequence[Message]]: ...

    def step(self, assistant_message: Message) -> EnvStep | Awaitable[EnvStep]: ...


#: what became of one tool call (:attr:`ToolResult.status`): ``ok``; ``error`` (the tool raised, its message is the
#: text); ``bad_arguments`` (the call did not match the schema, or could not be parsed); ``unknown_tool``;
#: ``timeout`` (past ``rollout.multi_turn.tool_timeout_s`` or the episode's deadline: the worker is killed);
#: ``crash`` (the worker process died: a signal, out of memory)
TOOL_STATUSES: tuple[str, ...] = ("ok", "error", "bad_arguments", "unknown_tool", "timeout", "crash")


@dataclass(frozen=True)
class ToolResult:
    """The outcome of one tool call, as the engine's tool workers return it (never an exception).

    ``text``: what the model reads as the tool's reply (the result, or the error message), already cut to
    ``rollout.multi_turn.max_tool_response_length`` characters. ``status``: one of :data:`TOOL_STATUSES`.
    ``seconds``: wall time of the call. ``truncated``: the text was cut.
    """

    text: str
    status: str = "ok"
    seconds: float = 0.0
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(frozen=True)
class EnvironmentContext:
    """What an environment factory gets for one trajectory (kind ``environment``):
    ``factory(context) -> EnvironmentProtocol``.

    ``tools``: the selected tools by name (``rollout.multi_turn.tools``; their ``name``, ``description`` and
    ``parameters`` for prompts and parsing). ``call_tool(name, arguments)``: a coroutine running the call in a
    tool worker process under the configured timeout and limits; it returns a :class:`ToolResult` and never
    raises (an unknown name, bad arguments, a timeout or a crash come back as a status and a message for the
    model). ``settings``: the ``rollout.multi_turn`` section (``format``, ``max_parallel_calls`` ...).
    ``seed``: this trajectory's seed (from the run seed, the step and the trajectory's index, so a resumed
    run gives every environment the same seed). ``index``: the trajectory's index in the step's batch.
    """

    tools: Mapping[str, Any]
    call_tool: Callable[[str, Mapping[str, Any]], Awaitable[ToolResult]]
    settings: Any = None
    seed: int = 0
    index: int = 0


@runtime_checkable
class ToolProtocol(Protocol):
    """A tool (kind ``tool``): ``name``, ``description``, ``parameters`` (a JSON schema object with
    ``type: object``, ``properties`` and ``required``) and the call itself, with those parameters as keywords;
    returns the result as text (a coroutine for an ``async`` tool)."""

    name: str
    description: str
    parameters: Mapping[str, Any]

    def __call__(self, **arguments: Any) -> str | Awaitable[str]: ...


# ============================================================================ tools: errors


class ToolError(Exception):
    """An error a tool raises for the model to read: its message (``str(exc)``) becomes the tool message, so it
    says what was wrong with the call and how to make a valid one. A tool raises it for bad input (a malformed
    expression, a key it does not know); the engine turns any other exception into a tool message too."""


class ToolArgumentError(ToolError, ValueError):
    """The arguments of a tool call do not match the tool's ``parameters`` schema: a required argument is
    missing, an argument is unknown, or a value has the wrong JSON type. ``problems`` lists each one; the
    message (all of them, prefixed with the tool's name) is meant for the model."""

    def __init__(self, message: str, problems: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.problems = list(problems)


class ToolSchemaError(TypeError):
    """A function cannot be described as a tool (raised by :class:`FunctionTool` when it is built, so at import
    or registration time, never during a run): a parameter without a type annotation or with one that has no
    JSON-schema type, ``*args`` / ``**kwargs``, no description, or a docstring ``Args:`` entry naming no
    parameter. The message names the function and the parameter."""


# ============================================================================ tools: schemas

#: Python annotation -> JSON-schema type of a :class:`FunctionTool` parameter (``list[X]`` is ``array``)
JSON_TYPES: dict[type, str] = {int: "integer", float: "number", str: "string", bool: "boolean"}

#: the names chat templates and OpenAI-style function calling accept for a tool
TOOL_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"

_KNOWN_TYPES = ("string", "integer", "number", "boolean", "array", "object", "null")
_TYPE_WORDS = {
    "string": "a string",
    "integer": "an integer",
    "number": "a number",
    "boolean": "a boolean (true or false)",
    "array": "an array",
    "object": "an object",
    "null": "null",
}


def _json_kind(value: Any) -> str:
    """The JSON type of a decoded argument value (``"integer"`` for ``3``, ``"string"`` for ``"3"`` ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__


def _type_names(schema: Mapping[str, Any]) -> list[str]:
    declared = schema.get("type")
    if declared is None:
        return []
    return [declared] if isinstance(declared, str) else [str(t) for t in declared]


def _describe_type(schema: Mapping[str, Any]) -> str:
    names = _type_names(schema)
    if not names:
        return "any value"
    words = []
    for name in names:
        word = _TYPE_WORDS.get(name, name)
        if name == "array" and isinstance(schema.get("items"), Mapping) and _type_names(schema["items"]):
            word += " of " + " or ".join(_type_names(schema["items"]))
        words.append(word)
    return " or ".join(words)


def schema_problems(parameters: Any) -> list[str]:
    """Problems of a tool's ``parameters`` as a JSON schema of keyword arguments (empty: it is one).

    It must be a mapping with ``"type": "object"``, a ``"properties"`` mapping of parameter name -> schema
    mapping (each ``"type"``, when given, one of the JSON types or a list of them) and, when given, a
    ``"required"`` list of names that are all in ``properties``.
    """
    if not isinstance(parameters, Mapping):
        return [f"parameters must be a JSON schema (a dict with type, properties, required), got {parameters!r}"]
    problems: list[str] = []
    if parameters.get("type") != "object":
        problems.append(f'parameters must have "type": "object", got {parameters.get("type")!r}')
    properties = parameters.get("properties")
    if not isinstance(properties, Mapping):
        problems.append(f'parameters must have a "properties" dict (name -> schema), got {properties!r}')
        properties = {}
    for name, schema in properties.items():
        if not isinstance(name, str) or not isinstance(schema, Mapping):
            problems.append(f"parameters.properties[{name!r}] must map a name to a schema dict, got {schema!r}")
            continue
        unknown = [t for t in _type_names(schema) if t not in _KNOWN_TYPES]
        if unknown:
            problems.append(f"parameters.properties[{name!r}] has the unknown type(s) {unknown}; use {_KNOWN_TYPES}")
    required = parameters.get("required", [])
    if not isinstance(required, (list, tuple)) or not all(isinstance(r, str) for r in required):
        problems.append(f'parameters "required" must be a list of parameter names, got {required!r}')
    else:
        absent = [r for r in required if r not in properties]
        if absent:
            problems.append(f'parameters "required" names {absent}, which are not in "properties"')
    return problems


def tool_problems(tool: Any) -> list[str]:
    """Problems of a tool's ``name`` (a string matching :data:`TOOL_NAME_PATTERN`), ``description`` (a non-empty
    string: the model reads it to decide when to call the tool) and ``parameters`` (:func:`schema_problems`).
    A missing member is left to the Protocol check, except that a plain function gets the hint to wrap it in
    :class:`FunctionTool`."""
    problems: list[str] = []
    if not hasattr(tool, "parameters") and (inspect.isfunction(tool) or inspect.ismethod(tool)):
        problems.append(
            "a plain function is not a tool: wrap it, FunctionTool(fn), to take its name, description and "
            "parameters schema from its signature and docstring"
        )
    if hasattr(tool, "name"):
        name = tool.name
        if not isinstance(name, str) or not re.match(TOOL_NAME_PATTERN, name):
            problems.append(f"name must be 1-64 letters, digits, '_' or '-', got {name!r}")
    if hasattr(tool, "description"):
        description = tool.description
        if not isinstance(description, str) or not description.strip():
            problems.append(f"description must be a non-empty string (the model reads it), got {description!r}")
    if hasattr(tool, "parameters"):
        problems += schema_problems(tool.parameters)
    return problems


# ============================================================================ tools: argument checks


def _check_value(value: Any, schema: Mapping[str, Any], where: str, problems: list[str]) -> Any:
    """``value`` as the schema's type (an integer for a ``number`` becomes a float), or a problem appended."""
    names = _type_names(schema)
    kind = _json_kind(value)
    if not names or kind in names:
        if kind == "array" and isinstance(schema.get("items"), Mapping):
            return [_check_value(v, schema["items"], f"{where}[{i}]", problems) for i, v in enumerate(value)]
        return list(value) if kind == "array" else value
    if kind == "integer" and "number" in names:
        return float(value)
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    got = "a boolean" if kind == "boolean" else _TYPE_WORDS.get(kind, kind)
    problems.append(f"argument '{where}' must be {_describe_type(schema)}, got {got} {shown}")
    return value


def validate_arguments(tool_name: str, parameters: Mapping[str, Any], arguments: Any) -> dict[str, Any]:
    """Check a tool call's ``arguments`` (the decoded JSON object of the call) against the tool's
    ``parameters`` schema; returns them as keyword arguments (``integer`` values given for a ``number``
    parameter as floats).

    Raises :class:`ToolArgumentError` naming every problem, e.g. ``calculator: missing required argument
    'expression' (a string); unknown argument 'expr' (the parameters are: expression)``: arguments that are not
    an object, missing required ones, unknown names, values of the wrong JSON type (``true`` is not an
    integer; ``3`` is a number).
    """
    properties: Mapping[str, Any] = parameters.get("properties", {})
    if not isinstance(arguments, Mapping):
        what = _TYPE_WORDS.get(_json_kind(arguments), type(arguments).__name__)
        problem = f"the arguments must be a JSON object of named parameters, got {what}"
        raise ToolArgumentError(f"{tool_name}: {problem}", [problem])
    problems: list[str] = []
    listing = ", ".join(properties) or "none"
    for name in properties:
        if name in parameters.get("required", ()) and name not in arguments:
            problems.append(f"missing required argument '{name}' ({_describe_type(properties[name])})")
    checked: dict[str, Any] = {}
    for name, value in arguments.items():
        if name not in properties:
            problems.append(f"unknown argument {str(name)!r} (the parameters are: {listing})")
            continue
        checked[name] = _check_value(value, properties[name], name, problems)
    if problems:
        raise ToolArgumentError(f"{tool_name}: " + "; ".join(problems), problems)
    return checked


# ============================================================================ tools: functions as tools

_SECTION = re.compile(r"^(Args|Arguments|Parameters|Returns?|Raises|Yields?|Examples?|Notes?|Attributes):\s*$")
_ARG_ENTRY = re.compile(r"^\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """``(summary, {parameter: description})`` of a Google-style docstring: the first paragraph joined into one
    line, and the entries ``name (type): text`` / ``name: text`` of its ``Args:`` section (continuation lines,
    indented deeper, are joined on)."""
    lines = inspect.cleandoc(doc).splitlines() if doc else []
    summary: list[str] = []
    for line in lines:
        if not line.strip() or _SECTION.match(line.strip()):
            break
        summary.append(line.strip())
    args: dict[str, str] = {}
    for i, line in enumerate(lines):
        if line.strip() not in ("Args:", "Arguments:"):
            continue
        header = _indent(line)
        entry_indent: int | None = None
        current: str | None = None
        for body in lines[i + 1 :]:
            if not body.strip():
                continue
            if _indent(body) <= header:
                break
            entry_indent = _indent(body) if entry_indent is None else entry_indent
            match = _ARG_ENTRY.match(body.strip())
            if _indent(body) == entry_indent and match:
                current = match.group(1)
                args[current] = match.group(2).strip()
            elif current is not None:
                args[current] = (args[current] + " " + body.strip()).strip()
        break
    return " ".join(summary), args


def _annotation_schema(annotation: Any, where: str) -> dict[str, Any]:
    if annotation in JSON_TYPES:
        return {"type": JSON_TYPES[annotation]}
    if annotation is list or typing.get_origin(annotation) is list:
        items = typing.get_args(annotation)
        return {"type": "array", "items": _annotation_schema(items[0], where)} if items else {"type": "array"}
    shown = annotation.__name__ if isinstance(annotation, type) else str(annotation)
    raise ToolSchemaError(
        f"{where} is annotated {shown}, which has no JSON-schema type; use int, float, str, bool or list[...] of them"
    )


def _signature_schema(fn: Callable[..., Any], arg_docs: Mapping[str, str], label: str) -> dict[str, Any]:
    target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn).__call__
    try:
        hints = typing.get_type_hints(target)
    except Exception as exc:  # an annotation that names something undefined
        raise ToolSchemaError(f"tool {label}: its annotations cannot be resolved ({exc})") from exc
    properties: dict[str, Any] = {}
    required: list[str] = []
    for param in inspect.signature(fn).parameters.values():
        where = f"tool {label}: parameter '{param.name}'"
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ToolSchemaError(f"{where} is *args/**kwargs, which a JSON schema cannot describe; name each one")
        if param.kind == param.POSITIONAL_ONLY:
            raise ToolSchemaError(f"{where} is positional-only; a tool is called with keyword arguments")
        if param.name not in hints:
            raise ToolSchemaError(f"{where} has no type annotation; annotate it with int, float, str, bool or list")
        prop = _annotation_schema(hints[param.name], where)
        if param.name in arg_docs:
            prop["description"] = arg_docs[param.name]
        properties[param.name] = prop
        if param.default is param.empty:
            required.append(param.name)
    stray = sorted(set(arg_docs) - set(properties))
    if stray:
        raise ToolSchemaError(f"tool {label}: the docstring's Args: section names {stray}, which are not parameters")
    return {"type": "object", "properties": properties, "required": required}


class FunctionTool:
    """A plain or ``async`` function as a :class:`ToolProtocol` object (kind ``tool``), described the way verl's
    function tools and TRL's ``tools=`` describe one:

    * ``name``: the function's ``__name__`` (or ``name=``);
    * ``description``: the docstring's first paragraph, joined into one line (or ``description=``);
    * ``parameters``: ``{"type": "object", "properties": {...}, "required": [...]}`` from the signature, in its
      order: ``int`` -> ``integer``, ``float`` -> ``number``, ``str`` -> ``string``, ``bool`` -> ``boolean``,
      ``list[X]`` -> ``array`` with ``items`` (bare ``list``: no ``items``); each property's ``description``
      from the Google-style ``Args:`` section (``name (type): text``); ``required`` lists the parameters
      without a default.

    Calling it, ``tool(**arguments)``, checks the arguments against that schema (:func:`validate_arguments`:
    :class:`ToolArgumentError` for a missing, unknown or wrongly-typed one, before the function runs), calls the
    function and returns its result as text (a non-``str`` result through ``str()``); for an ``async``
    function it returns a coroutine. Picklable when the function is (a module-level one), so it can run in a
    worker process.

    Raises :class:`ToolSchemaError` when built for a function that cannot be described: a parameter without
    an annotation or with another type (``dict``, ``int | None`` ...), ``*args``/``**kwargs``, positional-only
    parameters, no docstring and no ``description=``, an ``Args:`` entry naming no parameter.
    """

    def __init__(self, fn: Callable[..., Any], *, name: str | None = None, description: str | None = None) -> None:
        if not callable(fn):
            raise ToolSchemaError(f"FunctionTool needs a function, got {fn!r}")
        self.fn = fn
        self.name: str = name if name is not None else getattr(fn, "__name__", type(fn).__name__)
        summary, arg_docs = _parse_docstring(inspect.getdoc(fn) or "")
        self.description: str = description if description is not None else summary
        self.parameters: dict[str, Any] = _signature_schema(fn, arg_docs, self.name)
        # an async function, or a callable object whose __call__ is one
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)
        problems = tool_problems(self)
        if problems:
            raise ToolSchemaError(f"tool {self.name!r} cannot be described: " + "; ".join(problems))

    def __call__(self, **arguments: Any) -> str | Awaitable[str]:
        checked = validate_arguments(self.name, self.parameters, arguments)
        if self.is_async:
            return self._call_async(checked)
        return _as_text(self.fn(**checked))

    async def _call_async(self, checked: dict[str, Any]) -> str:
        return _as_text(await self.fn(**checked))

    def __repr__(self) -> str:
        return f"FunctionTool({self.name}{inspect.signature(self.fn)})"


def _as_text(result: Any) -> str:
    return result if isinstance(result, str) else str(result)
