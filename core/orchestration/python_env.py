"""TRL's ``tools=`` and ``environment_factory=`` as rlplug tools and an rlplug environment (:func:`rlplug.train`).

TRL's ``GRPOTrainer`` (huggingface/trl, ``trl/trainer/grpo_trainer.py``) takes

* ``tools``: plain (or ``async``) functions with type hints and a Google-style docstring; here each becomes a
  :class:`rlplug.contracts.agents.FunctionTool` (kind ``tool``) run by the engine's tool workers;
* ``environment_factory``: a callable returning a fresh environment instance per rollout. TRL calls
  ``instance.reset(**example)`` (every column of the dataset row) before generating: ``None``, or a string
  appended to the last prompt message; the instance's public methods (not ``_``-prefixed, not ``reset`` /
  ``get_reward``) are tools the model may call, run on that instance (so they share its state); an optional
  ``get_reward()`` (no argument, may be ``async``) scores the finished rollout, a reward source of weight 1
  beside ``reward_funcs``.

:class:`TRLEnvironment` is that instance as an rlplug environment (:class:`rlplug.contracts.agents.
EnvironmentProtocol`): ``reset(row)`` rebuilds TRL's example from the verl-schema row (``extra_info`` holds
the dataset's columns, :func:`rlplug.api.dataset_to_parquet`), calls ``reset(**example)`` and returns the
prompt messages; ``step(assistant_message)`` parses the tool calls (``rollout.multi_turn.format``), runs the
instance's methods in this process and any other tool through ``context.call_tool`` (the worker processes),
and returns the tool messages; a message without tool calls ends the episode, and so does the last turn the
turn caps allow (its calls are not run, as TRL's loop stops at ``max_tool_calling_iterations``). The step that
ends the episode carries ``get_reward()`` as its reward (the final reward functions add theirs).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlplug.base.threads import in_daemon_thread
from rlplug.config.schema import MultiTurnConfig, typed
from rlplug.contracts.agents import (
    EnvironmentContext,
    EnvStep,
    FunctionTool,
    Message,
    ToolArgumentError,
    ToolError,
    ToolResult,
    ToolSchemaError,
    validate_arguments,
)

__all__ = [
    "RESERVED_METHODS",
    "TRLEnvironment",
    "TRLEnvironmentFactory",
    "ToolCall",
    "as_tool",
    "environment_tools",
    "parse_tool_calls",
    "trl_example",
]

#: an environment's methods that are not tools (TRL's rule)
RESERVED_METHODS = ("reset", "get_reward")


def as_tool(fn: Any) -> Any:
    """A TRL ``tools=`` entry as an rlplug tool: an object that already is one (``name``, ``description``,
    ``parameters``) as it is, else ``FunctionTool(fn)``. Raises :class:`ToolSchemaError` (a parameter without a
    JSON type, no docstring ...)."""
    if all(hasattr(fn, a) for a in ("name", "description", "parameters")) and callable(fn):
        return fn
    return FunctionTool(fn)


def environment_tools(instance: Any) -> dict[str, FunctionTool]:
    """The tools of a TRL environment ``instance``: each public bound method but ``reset`` and ``get_reward``
    (TRL's ``inspect.getmembers(instance, inspect.ismethod)``), as a :class:`FunctionTool` on the bound method,
    by name. Raises :class:`ToolSchemaError` naming the class for a method that cannot be described."""
    tools: dict[str, FunctionTool] = {}
    for name, member in inspect.getmembers(instance, predicate=inspect.ismethod):
        if name.startswith("_") or name in RESERVED_METHODS:
            continue
        try:
            tools[name] = FunctionTool(member)
        except ToolSchemaError as exc:
            raise ToolSchemaError(
                f"{type(instance).__name__}.{name}: every public method of a TRL environment is a tool the model "
                f"may call, so it needs type hints and a docstring (or a leading '_' to hide it): {exc}"
            ) from exc
    return tools


def trl_example(row: Mapping[str, Any]) -> dict[str, Any]:
    """TRL's dataset example for a verl-schema ``row``: its ``extra_info`` (where :func:`rlplug.api.
    dataset_to_parquet` keeps every column and the prompt as given), ``prompt`` from the row when absent."""
    extra = row.get("extra_info")
    example = dict(extra) if isinstance(extra, Mapping) else {}
    example.setdefault("prompt", row.get("prompt"))
    return example


def _messages(prompt: Any) -> list[dict[str, Any]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, Sequence) and prompt and all(isinstance(m, Mapping) for m in prompt):
        return [dict(m) for m in prompt]
    raise ValueError(f"a row's prompt must be a string or a list of chat messages, got {prompt!r:.80}")


class ToolCall:
    """One parsed tool call: ``name``, ``arguments`` (a dict, or None when they could not be parsed) and
    ``error`` (why the call could not be read; the model reads it)."""

    __slots__ = ("name", "arguments", "error")

    def __init__(self, name: str, arguments: dict[str, Any] | None, error: str = "") -> None:
        self.name, self.arguments, self.error = name, arguments, error

    def __repr__(self) -> str:
        return f"ToolCall({self.name!r}, {self.arguments!r}, {self.error!r})"


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_HOW = 'write a call as <tool_call>{"name": "TOOL", "arguments": {...}}</tool_call>'


def parse_tool_calls(text: str, fmt: str, tools: Mapping[str, Any]) -> list[ToolCall]:
    """The tool calls in an assistant message's ``text``, in the order they open (the ``tool_agent`` plugin's
    rules, which core cannot import; ``tests/test_api_multi_turn.py`` checks that both read the same calls).

    ``hermes``: each ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; ``arguments`` may be absent
    (``{}``) or a JSON string holding the object (an empty string is ``{}``). A body that is not such JSON, a
    name that is not a non-empty string, and an opening tag never closed (the call takes the rest of the text)
    are calls with an ``error``. ``tags``: each ``<name>text</name>`` for a tool of ``tools``, scanned left to
    right (the text runs to the first closing tag, stripped; the longest name wins where names overlap); the
    text is the argument of a tool taking exactly one parameter, an ``error`` for another tool, and an opening
    tag never closed is an ``error`` too. Raises ``ValueError`` for another format.
    """
    calls: list[ToolCall] = []
    if fmt == "hermes":
        pos = 0
        while (start := text.find(_OPEN, pos)) >= 0:
            end = text.find(_CLOSE, start + len(_OPEN))
            if end < 0:
                calls.append(ToolCall("", None, f"the tool call is not closed; {_HOW}"))
                break
            calls.append(_hermes_call(text[start + len(_OPEN) : end]))
            pos = end + len(_CLOSE)
        return calls
    if fmt == "tags":
        names = sorted((n for n in tools if n), key=len, reverse=True)
        if not names:
            return calls
        opening = re.compile("<(" + "|".join(re.escape(n) for n in names) + ")>")
        pos = 0
        while (m := opening.search(text, pos)) is not None:
            name = m.group(1)
            end = text.find(f"</{name}>", m.end())
            if end < 0:
                calls.append(
                    ToolCall(name, None, f"{name}: the call <{name}> is not closed; write <{name}>TEXT</{name}>")
                )
                break
            props = list((getattr(tools[name], "parameters", None) or {}).get("properties", {}))
            if len(props) == 1:
                calls.append(ToolCall(name, {props[0]: text[m.end() : end].strip()}))
            else:
                why = f"the tag format passes one argument, but {name} takes {len(props)}: {', '.join(props)}"
                calls.append(ToolCall(name, None, why))
            pos = end + len(f"</{name}>")
        return calls
    raise ValueError(f"rollout.multi_turn.format={fmt!r}: use hermes or tags")


def _hermes_call(body: str) -> ToolCall:
    """One ``hermes`` call's JSON ``body`` as a :class:`ToolCall` (``error`` set when it cannot be run)."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:
        return ToolCall("", None, f"the tool call {body.strip()!r:.200} is not valid JSON: {exc}; {_HOW}")
    if not isinstance(data, dict):
        return ToolCall("", None, f"the tool call must be a JSON object; {_HOW}")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall("", None, f'the tool call has no "name" (a string); {_HOW}')
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError) as exc:
            return ToolCall(name, None, f"{name}: the arguments string is not valid JSON ({exc}); {_HOW}")
    if not isinstance(arguments, dict):
        return ToolCall(name, None, f"{name}: the arguments must be a JSON object of named parameters; {_HOW}")
    return ToolCall(name, arguments)


class TRLEnvironment:
    """A TRL-style environment instance as an rlplug environment (module docstring).

    ``instance``: what TRL's ``environment_factory()`` returned. ``context``: this trajectory's
    :class:`EnvironmentContext` (``settings``: the ``rollout.multi_turn`` section; ``call_tool`` runs the
    standalone tools). ``tools``: every tool the model may call in this episode by name (the instance's
    methods and the selected standalone tools), for the chat template's ``tools=``. ``rewards``: the
    ``get_reward()`` values returned (one at most). Raises :class:`ToolSchemaError` when built for an instance
    without a callable ``reset`` or with a method that cannot be described, or whose method shares a
    standalone tool's name.
    """

    def __init__(self, instance: Any, context: EnvironmentContext) -> None:
        if not callable(getattr(instance, "reset", None)):
            raise ToolSchemaError(
                f"{type(instance).__name__}: an environment_factory's instance must define a callable reset "
                "(TRL's contract: reset(**example) -> None or a string appended to the prompt)."
            )
        self.instance = instance
        self.context = context
        self.settings = typed(MultiTurnConfig, context.settings)
        self.methods = environment_tools(instance)
        clash = sorted(set(self.methods) & set(context.tools))
        if clash:
            raise ToolSchemaError(
                f"{type(instance).__name__}: the method(s) {', '.join(clash)} share the name of a tool given in "
                "tools=; rename one of them (the model calls a tool by name)."
            )
        self.tools: dict[str, Any] = {**dict(context.tools), **self.methods}
        self.assistant_turns = 0
        self.observation_turns = 0
        self.rewards: list[float] = []
        self.scored = False

    async def reset(self, row: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The prompt messages of ``row`` after ``instance.reset(**example)`` (:func:`trl_example`); a string
        it returns is appended to the last message's content, as TRL does."""
        messages = _messages(row.get("prompt") if row.get("prompt") is not None else trl_example(row)["prompt"])
        reset = self.instance.reset
        out = (
            reset(**trl_example(row))
            if inspect.iscoroutinefunction(reset)
            else await in_daemon_thread(reset, **trl_example(row))  # user code: off the event loop
        )
        if inspect.isawaitable(out):
            out = await out
        if out is not None:
            last = messages[-1]
            messages[-1] = {**last, "content": f"{last.get('content') or ''}{out}"}
        return messages

    async def step(self, assistant_message: Message) -> EnvStep:
        """Run the tool calls of ``assistant_message``; their results as ``tool`` messages (name, content), and
        in ``info`` the counts the engine's metrics read (``tool_calls``, ``tool_errors``, ``tool_timeouts``,
        ``tool_crashes``, ``malformed_calls``) and ``tool_statuses`` (one per call).

        The episode ends (``done``, reward ``get_reward()`` when defined) when the message calls no tool or when
        this was the last assistant turn (``max_assistant_turns``) or observation turn (``max_user_turns``)
        the settings allow. Calls past ``max_parallel_calls`` get an error message instead of running.
        """
        self.assistant_turns += 1
        content = assistant_message.get("content")
        calls = parse_tool_calls(content if isinstance(content, str) else "", self.settings.format, self.tools)
        s = self.settings
        if not calls or self.assistant_turns >= s.max_assistant_turns or self.observation_turns >= s.max_user_turns:
            return await self._end(calls)
        self.observation_turns += 1
        results = []
        for i, call in enumerate(calls):
            if i >= s.max_parallel_calls:
                text = f"not run: at most {s.max_parallel_calls} tool call(s) per message (rollout.multi_turn.max_parallel_calls)"
                results.append((call.name, ToolResult(text, "error")))
            else:
                results.append((call.name, await self._call(call)))
        observations = [{"role": "tool", "name": name, "content": r.text} for name, r in results]
        statuses = [r.status for _, r in results]
        info = {
            "tool_calls": len(calls),
            "tool_statuses": statuses,
            # the engine's metrics (multi_turn/*), counted as the tool_agent plugin counts them
            "tool_errors": sum(st not in ("ok", "timeout", "crash") for st in statuses),
            "tool_timeouts": statuses.count("timeout"),
            "tool_crashes": statuses.count("crash"),
            "malformed_calls": sum(c.arguments is None for c in calls[: s.max_parallel_calls]),
        }
        return EnvStep(observations=observations, reward=None, done=False, info=info)

    async def _end(self, calls: list[ToolCall]) -> EnvStep:
        reward = await self.final_reward()
        return EnvStep(observations=(), reward=reward, done=True, info={"tool_calls_not_run": len(calls)})

    async def final_reward(self) -> float | None:
        """``get_reward()`` of the instance, once per episode: the step that ends the episode carries it, and an
        engine that ends the episode itself (the length budget, the episode timeout: ``step`` is not called
        for the last turn) asks for it here. None when the instance has no ``get_reward``, it returned None,
        or the reward was already given. Raises what ``get_reward`` raises."""
        if self.scored:
            return None
        self.scored = True
        if not callable(getattr(self.instance, "get_reward", None)):
            return None
        get_reward = self.instance.get_reward
        value = get_reward() if inspect.iscoroutinefunction(get_reward) else await in_daemon_thread(get_reward)
        if inspect.isawaitable(value):
            value = await value
        if value is None:
            return None
        reward = float(value)
        self.rewards.append(reward)
        return reward

    async def _call(self, call: ToolCall) -> ToolResult:
        """One call: the instance's method in this process (a plain one in a thread, bounded by
        ``tool_timeout_s``: past it the model reads a timeout, though the thread cannot be stopped), any other
        name through ``context.call_tool``."""
        if call.arguments is None:
            return ToolResult(call.error, "bad_arguments")
        method = self.methods.get(call.name)
        if method is None:
            return await self.context.call_tool(call.name, call.arguments)
        timeout = self.settings.tool_timeout_s if self.settings.tool_timeout_s > 0 else None
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            checked = validate_arguments(call.name, method.parameters, call.arguments)
            if method.is_async:
                out = await asyncio.wait_for(method.fn(**checked), timeout)
            else:
                out = await asyncio.wait_for(in_daemon_thread(method.fn, **checked), timeout)
            text, status = (out if isinstance(out, str) else str(out)), "ok"
        except ToolArgumentError as exc:
            text, status = str(exc), "bad_arguments"
        except ToolError as exc:
            text, status = str(exc), "error"
        except TimeoutError:
            text, status = f"{call.name}: the call took longer than {timeout:g} s and was stopped", "timeout"
        except Exception as exc:
            text, status = f"{call.name}: {type(exc).__name__}: {exc}", "error"
        limit = self.settings.max_tool_response_length
        cut = limit > 0 and len(text) > limit
        return ToolResult(text[:limit] if cut else text, status, loop.time() - start, cut)

    def close(self) -> None:
        """Nothing to release: the instance is dropped with this object (TRL never closes it either)."""


class TRLEnvironmentFactory:
    """The registered object (kind ``environment``) for a TRL ``environment_factory``: called once per
    trajectory with its :class:`EnvironmentContext`, it builds ``factory()`` and wraps it in a
    :class:`TRLEnvironment`. ``name``: the environment's registered name (the factory's class name).
    ``tool_names``: the instance's method tools, from one probe instance built here (as TRL probes one),
    which also checks the class (raises :class:`ToolSchemaError`)."""

    builds = TRLEnvironment

    def __init__(self, factory: Callable[[], Any], name: str | None = None) -> None:
        if not callable(factory):
            raise ToolSchemaError(f"environment_factory must be a class or a function returning one, got {factory!r}")
        self.factory = factory
        probe = factory()
        if not callable(getattr(probe, "reset", None)):
            raise ToolSchemaError(
                f"{type(probe).__name__}: an environment_factory's instance must define a callable reset "
                "(TRL's contract: reset(**example) -> None or a string appended to the prompt)."
            )
        self.tool_names = sorted(environment_tools(probe))
        self.has_reward = callable(getattr(probe, "get_reward", None))
        self.name = name or getattr(factory, "__name__", None) or type(probe).__name__

    def __call__(self, context: EnvironmentContext) -> TRLEnvironment:
        return TRLEnvironment(self.factory(), context)

    def __repr__(self) -> str:
        return f"TRLEnvironmentFactory({self.name})"
