"""The ``tool_agent`` environment (kind ``environment``): the model calls tools, the environment runs them.

One :class:`ToolAgentEnvironment` per trajectory (as verl's ``ToolAgentLoop``). ``reset(row)`` returns the row's
prompt messages unchanged. ``step(assistant_message)`` reads the tool calls in the message's text, in the format
``rollout.multi_turn.format`` names:

* ``tags``: ``<NAME>ARG</NAME>`` for each selected tool ``NAME`` (``<calculator>12*7</calculator>``); the tool
  must take exactly one required string parameter, which gets ``ARG`` stripped of surrounding whitespace. A
  simple protocol a small model can learn from one example in its prompt. ``stop``: ``</NAME>`` for each tool,
  so the engine ends the turn right after a call.
* ``hermes``: ``<tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>`` (the
  Hermes / Qwen chat templates' tool calls; ``arguments`` may also be a JSON string holding the object, as
  OpenAI's API sends it). ``stop``: ``</tool_call>``.

Each call runs through the context's ``call_tool`` (the engine's tool workers: timeouts, limits, never an
exception), at most ``rollout.multi_turn.max_parallel_calls`` per message, concurrently; each result becomes one
tool message ``{"role": "tool", "content": result.text, "name": NAME}``, in the order of the calls. The content is
the tool's text as is (no ``<result>`` wrapping: the chat template's tool turn delimits it). A call that cannot
be read (an unclosed tag, JSON that does not parse, no ``name``, a tool that is not selected) is not run: its tool
message says what was wrong and how a call is written. Calls past ``max_parallel_calls`` are not run either: their
tool message says so. A message with no call is the model's answer: the step returns ``done=True`` and no
observation. The reward is always ``None`` (the reward function scores the final answer).

``EnvStep.info`` counts, for the engine's metrics: ``tool_calls`` (every call found, run or not),
``tool_errors`` (calls that did not succeed for a reason other than a timeout or a crash: statuses ``error``,
``bad_arguments``, ``unknown_tool``, malformed calls and calls past the limit), ``tool_timeouts``,
``tool_crashes``, ``malformed_calls`` (calls that could not be read) and ``calls_over_limit``.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rlplug.plugin import (
    ConfigError,
    EnvironmentContext,
    EnvStep,
    Message,
    MultiTurnConfig,
    ToolResult,
    hookimpl,
    typed,
)

__all__ = [
    "FORMATS",
    "ParsedCall",
    "parse_tag_calls",
    "parse_hermes_calls",
    "tag_argument",
    "ToolAgentEnvironment",
]

#: the values of ``rollout.multi_turn.format`` this environment reads
FORMATS = ("tags", "hermes")

_HERMES_OPEN = "<tool_call>"
_HERMES_CLOSE = "</tool_call>"
_HERMES_EXAMPLE = '<tool_call>{"name": "TOOL", "arguments": {...}}</tool_call>'


@dataclass(frozen=True)
class ParsedCall:
    """One tool call found in an assistant message.

    ``name``: the tool named (``None`` when the call is too malformed to name one). ``arguments``: the decoded
    JSON arguments of a ``hermes`` call (``{}`` for a ``tags`` call and a malformed one). ``argument``: the text
    between the tags of a ``tags`` call, stripped (``None`` otherwise). ``error``: ``None`` for a call that can be
    run, else the message the model reads instead of a result (what was wrong and how a call is written).
    ``text``: the call's text as it appears in the message.
    """

    name: str | None
    arguments: dict[str, Any] = field(default_factory=dict)
    argument: str | None = None
    error: str | None = None
    text: str = ""


def parse_tag_calls(text: str, tool_names: Iterable[str]) -> list[ParsedCall]:
    """The calls ``<NAME>ARG</NAME>`` in ``text`` for each ``NAME`` in ``tool_names``, in the order they open.

    Each call's ``argument`` is ``ARG`` stripped (the caller passes it as the tool's one string parameter,
    :func:`tag_argument`); ``ARG`` is everything up to the first ``</NAME>`` after the opening
    tag, so ``<calc>1+<calc>2</calc>`` passes ``"1+<calc>2"``. An opening tag with no closing one is a malformed
    call (``error`` set) that takes the rest of the text. Tags naming no tool in ``tool_names`` are plain text
    (an answer may contain markup): this format cannot tell an unknown tool from prose.
    """
    names = sorted({n for n in tool_names if n}, key=len, reverse=True)
    if not names:
        return []
    opening = re.compile("<(" + "|".join(re.escape(n) for n in names) + ")>")
    calls: list[ParsedCall] = []
    pos = 0
    while True:
        match = opening.search(text, pos)
        if match is None:
            return calls
        name = match.group(1)
        close = f"</{name}>"
        end = text.find(close, match.end())
        if end < 0:
            calls.append(
                ParsedCall(
                    name,
                    error=f"{name}: the call <{name}> is not closed; write a call as <{name}>ARGUMENT</{name}>",
                    text=text[match.start() :],
                )
            )
            return calls
        argument = text[match.end() : end].strip()
        calls.append(ParsedCall(name, argument=argument, text=text[match.start() : end + len(close)]))
        pos = end + len(close)


def parse_hermes_calls(text: str) -> list[ParsedCall]:
    """The calls ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in ``text``, in order.

    The body between the tags must be a JSON object with a string ``name`` and, optionally, ``arguments``: an
    object, or a string holding one as JSON (missing: ``{}``). A call whose body does not parse, lacks the name
    or has arguments of another type, and an opening tag with no closing one (the call then takes the rest of
    the text) are malformed calls (``error`` set; ``name`` when one could be read). Whether the name is a
    selected tool is for the caller to check.
    """
    calls: list[ParsedCall] = []
    pos = 0
    while True:
        start = text.find(_HERMES_OPEN, pos)
        if start < 0:
            return calls
        body_start = start + len(_HERMES_OPEN)
        end = text.find(_HERMES_CLOSE, body_start)
        if end < 0:
            calls.append(
                ParsedCall(
                    None, error=f"the tool call is not closed; write a call as {_HERMES_EXAMPLE}", text=text[start:]
                )
            )
            return calls
        calls.append(_hermes_call(text[body_start:end], text[start : end + len(_HERMES_CLOSE)]))
        pos = end + len(_HERMES_CLOSE)


def _hermes_call(body: str, raw: str) -> ParsedCall:
    how = f"write a call as {_HERMES_EXAMPLE}"
    try:
        decoded = json.loads(body)
    except (ValueError, RecursionError) as exc:
        return ParsedCall(None, error=f"the tool call is not valid JSON ({exc}); {how}", text=raw)
    if not isinstance(decoded, dict):
        return ParsedCall(None, error=f"the tool call must be a JSON object; {how}", text=raw)
    name = decoded.get("name")
    if not isinstance(name, str) or not name:
        return ParsedCall(None, error=f'the tool call has no "name" (a string); {how}', text=raw)
    arguments = decoded.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError) as exc:
            return ParsedCall(name, error=f"{name}: the arguments string is not valid JSON ({exc}); {how}", text=raw)
    if not isinstance(arguments, dict):
        return ParsedCall(name, error=f'{name}: "arguments" must be a JSON object of named parameters; {how}', text=raw)
    return ParsedCall(name, arguments, text=raw)


def tag_argument(tool: Any) -> str:
    """The one parameter the ``tags`` format passes a tool's text to: its only required parameter, which must be a
    string. Raises :class:`rlplug.plugin.ConfigError` naming the tool otherwise (use ``format=hermes``)."""
    parameters = getattr(tool, "parameters", {}) or {}
    required = list(parameters.get("required", ()))
    properties = parameters.get("properties", {})
    schema = properties.get(required[0], {}) if len(required) == 1 else {}
    if len(required) != 1 or schema.get("type") != "string":
        shown = ", ".join(f"{n} ({properties.get(n, {}).get('type', 'any')})" for n in required) or "none"
        raise ConfigError(
            f"rollout.multi_turn.format=tags passes a tool the text between its tags as its one required string "
            f"parameter, but the tool {getattr(tool, 'name', tool)!r} has the required parameters: {shown}. Use "
            f"rollout.multi_turn.format=hermes (JSON tool calls) for it"
        )
    return str(required[0])


class ToolAgentEnvironment:
    """One trajectory of the ``tool_agent`` environment (see the module docstring); built by the engine as
    ``ToolAgentEnvironment(context)``.

    Raises :class:`rlplug.plugin.ConfigError` when ``context.settings.format`` is not one of :data:`FORMATS`, or
    when the format is ``tags`` and a selected tool does not take exactly one required string parameter.
    """

    def __init__(self, context: EnvironmentContext) -> None:
        self.context = context
        self.settings = typed(MultiTurnConfig, context.settings)
        self.format = self.settings.format
        if self.format not in FORMATS:
            raise ConfigError(f"rollout.multi_turn.format must be one of {list(FORMATS)}, got {self.format!r}")
        self.tool_names = list(context.tools)
        self.tag_arguments = {n: tag_argument(t) for n, t in context.tools.items()} if self.format == "tags" else {}
        stop = [f"</{n}>" for n in self.tool_names] if self.format == "tags" else [_HERMES_CLOSE]
        self.stop: tuple[str, ...] = tuple(stop)

    def reset(self, row: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The row's ``prompt`` messages, as a list of dicts (verl's row stores them as a list, or a numpy array
        of dicts after a parquet read; a plain string is one user message). Raises ``ValueError`` for a row
        without a prompt."""
        prompt = row.get("prompt")
        if prompt is None:
            raise ValueError(f"tool_agent: the row has no 'prompt' (a list of chat messages); its keys: {list(row)}")
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        return [dict(message) for message in prompt]

    async def step(self, assistant_message: Message) -> EnvStep:
        """Run the tool calls of ``assistant_message`` (see the module docstring); ``done`` when it has none."""
        text = assistant_message.get("content") or ""
        if self.format == "tags":
            calls = parse_tag_calls(text, self.tool_names)
        else:
            calls = parse_hermes_calls(text)
        counts = dict.fromkeys(
            ("tool_calls", "tool_errors", "tool_timeouts", "tool_crashes", "malformed_calls", "calls_over_limit"), 0
        )
        if not calls:
            return EnvStep(observations=(), reward=None, done=True, info=counts)
        limit = max(self.settings.max_parallel_calls, 1)
        counts["tool_calls"] = len(calls)
        results: list[ToolResult | None] = [None] * len(calls)
        pending: list[tuple[int, ParsedCall]] = []
        for i, call in enumerate(calls):
            error = self._problem(call)
            if i >= limit:
                counts["calls_over_limit"] += 1
                error = (
                    f"{call.name or 'this call'}: not run; at most {limit} tool call(s) are run per message. Wait for "
                    f"the results before making more calls"
                )
            elif error is not None:
                counts["malformed_calls"] += 1
            if error is not None:
                results[i] = ToolResult(error, "bad_arguments")
            else:
                pending.append((i, call))
        done = await asyncio.gather(*(self._run(call) for _, call in pending))
        for (i, _), result in zip(pending, done):
            results[i] = result
        observations: list[dict[str, Any]] = []
        for call, result in zip(calls, results):
            assert result is not None
            if result.status == "timeout":
                counts["tool_timeouts"] += 1
            elif result.status == "crash":
                counts["tool_crashes"] += 1
            elif result.status != "ok":
                counts["tool_errors"] += 1
            message: dict[str, Any] = {"role": "tool", "content": result.text}
            if call.name is not None:
                message["name"] = call.name
            observations.append(message)
        return EnvStep(observations=observations, reward=None, done=False, info=counts)

    def _problem(self, call: ParsedCall) -> str | None:
        if call.error is not None:
            return call.error
        if call.name not in self.context.tools:
            listing = ", ".join(self.tool_names) or "none"
            return f"unknown tool {call.name!r}; the tools are: {listing}. Write a call as {_HERMES_EXAMPLE}"
        return None

    async def _run(self, call: ParsedCall) -> ToolResult:
        assert call.name is not None
        arguments: Mapping[str, Any] = call.arguments
        if self.format == "tags":
            arguments = {self.tag_arguments[call.name]: call.argument or ""}
        return await self.context.call_tool(call.name, arguments)


@hookimpl
def register_environments(register):
    """Register the ``tool_agent`` environment."""
    register("tool_agent", ToolAgentEnvironment)
