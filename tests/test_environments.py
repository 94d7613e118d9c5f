"""The ``environment`` plugin kind: the registry's contract check, the ``check_environment`` kit with its in-process
tools, and the packaged ``tool_agent`` environment (its two call formats, parsers, limits and counts)."""

from __future__ import annotations

import asyncio
import types
from typing import Any

import numpy as np
import pytest

import rlplug
import rlplug.plugin
import rlplug.testing
from rlplug.contracts.registry import PluginContractError, Registry
from rlplug.plugin import ConfigError, EnvironmentContext, EnvStep, FunctionTool, ToolResult
from rlplug.plugins.environments.tool_agent import (
    ParsedCall,
    ToolAgentEnvironment,
    parse_hermes_calls,
    parse_tag_calls,
)
from rlplug.plugins.tools.calculator import calculator_tool
from rlplug.testing import LookupTool, check_environment, environment_context

NO_CALL = {
    "tool_calls": 0,
    "tool_errors": 0,
    "tool_timeouts": 0,
    "tool_crashes": 0,
    "malformed_calls": 0,
    "calls_over_limit": 0,
}


def counts(**changed: int) -> dict[str, int]:
    return {**NO_CALL, **changed}


def play(env: Any, content: str) -> EnvStep:
    return asyncio.run(env.step({"role": "assistant", "content": content}))


# ============================================================================ the contract check


class NoStep:
    def __init__(self, context: Any) -> None: ...

    def reset(self, row: Any) -> list:
        return []

    def stpe(self, assistant_message: Any) -> Any: ...


def _registry_with(name: str, obj: Any, **extra: Any) -> Registry:
    registry = Registry(load_entry_points=False)
    hook = rlplug.hookimpl(lambda register: register(name, obj, **extra))
    plugin = types.SimpleNamespace(register_environments=hook)
    assert registry.add_plugin(plugin, name="p", distribution="rlplug-envs", version="0.1")
    return registry


def test_the_contract_check_refuses_an_environment_without_step():
    with pytest.raises(PluginContractError) as err:
        _registry_with("bad", NoStep).get("environment", "bad")
    message = str(err.value)
    assert message.startswith(
        "The environment 'bad' (rlplug-envs 0.1, plugin p) does not implement "
        "rlplug.contracts.agents.EnvironmentProtocol: NoStep has no method step() (found 'stpe': misnamed?)"
    )
    assert "rlplug.testing.check_environment" in message


def test_the_contract_check_covers_close_stop_and_factories():
    class BadOptional:
        stop = "</calculator>"  # a bare string would be read as its characters

        def __init__(self, context: Any) -> None: ...

        def reset(self, row: Any) -> list:
            return []

        async def step(self, assistant_message: Any) -> Any: ...

        def close(self, status: str) -> None: ...

    with pytest.raises(PluginContractError) as err:
        _registry_with("opt", BadOptional).get("environment", "opt")
    assert err.value.problems == [
        "BadOptional.close(status) cannot be called as BadOptional.close(): missing a required argument: 'status'",
        "BadOptional.stop must be a tuple of stop strings, e.g. ('</calculator>',), got '</calculator>'",
    ]

    def make(context: Any) -> Any:
        return ToolAgentEnvironment(context)

    with pytest.raises(PluginContractError, match="does not declare the class it builds"):
        _registry_with("f", make).get("environment", "f")
    assert _registry_with("f", make, builds=ToolAgentEnvironment).get("environment", "f") is make
    # a step without "stop" near it: no misleading hint, "stop" being an optional member
    no_step = type("NoStepAtAll", (), {"stop": ("x",), "reset": lambda self, row: []})
    with pytest.raises(PluginContractError, match=r"NoStepAtAll has no method step\(\)\. Fix"):
        _registry_with("n", no_step).get("environment", "n")


def test_the_registry_resolves_tool_agent_through_its_entry_point(rlplug_full_registry):
    reg = rlplug_full_registry.registration("environment", "tool_agent")
    assert (reg.distribution, reg.plugin) == ("rlplug", "tool_agent")
    assert reg.obj is ToolAgentEnvironment
    assert "tool_agent" in rlplug.plugin.plugin_names("environment")


def test_the_environment_names_are_exported_where_plugins_and_tests_find_them():
    assert rlplug.plugin.check_environment is rlplug.testing.check_environment
    assert {"check_environment", "EnvironmentContext", "ToolResult", "TOOL_STATUSES", "MultiTurnConfig"} <= set(
        rlplug.plugin.__all__
    )
    assert {"check_environment", "environment_context"} <= set(rlplug.testing.__all__)


# ============================================================================ the kit on tool_agent


def test_tool_agent_passes_the_kit_in_the_tags_format():
    initial, steps = check_environment(
        "tool_agent",
        tools=["calculator"],
        replies=["I will compute it. <calculator> 12*7 </calculator>", "The answer is 84.", "never reached"],
    )
    assert initial == [{"role": "user", "content": "What is 12*7? Answer with the number."}]
    assert [s.observations for s in steps] == [[{"role": "tool", "content": "84", "name": "calculator"}], ()]
    assert [s.done for s in steps] == [False, True]
    assert [s.reward for s in steps] == [None, None]
    assert [dict(s.info) for s in steps] == [counts(tool_calls=1), counts()]


def test_tool_agent_passes_the_kit_in_the_hermes_format():
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "(3+4)*5-6//4"}}\n</tool_call>'
    initial, steps = check_environment(
        ToolAgentEnvironment, tools=[calculator_tool], settings={"format": "hermes"}, replies=[call, "It is 34."]
    )
    # (3+4)*5 - 6//4 = 35 - 1 = 34
    assert steps[0].observations == [{"role": "tool", "content": "34", "name": "calculator"}]
    assert (steps[0].done, steps[1].done, steps[1].observations) == (False, True, ())
    # an environment already built is played as it is
    built = ToolAgentEnvironment(environment_context([calculator_tool], {"format": "hermes"}))
    _, steps = check_environment(built, replies=[call.replace("6//4", "6//5")])
    assert steps[0].observations == [{"role": "tool", "content": "34", "name": "calculator"}]  # 35 - 1


# ============================================================================ the kit on broken environments


class Scripted:
    """An environment returning what the test sets on the class; records its close()."""

    initial: Any = [{"role": "user", "content": "hi"}]
    result: Any = EnvStep()
    closed: list[bool] = []

    def __init__(self, context: Any) -> None:
        self.context = context

    def reset(self, row: Any) -> Any:
        return self.initial

    async def step(self, assistant_message: Any) -> Any:
        return self.result

    def close(self) -> None:
        self.closed.append(True)


@pytest.mark.parametrize(
    ("initial", "result", "match"),
    [
        ([], EnvStep(), r"Scripted.reset\(row\) returned no message"),
        ([{"role": "user", "content": 3}], EnvStep(), r"reset\(row\)\[0\] content must be a str, got int"),
        (None, ([], None, True), r"step\(\) \(turn 0\) must return an EnvStep"),
        (None, EnvStep([{"role": "assistant", "content": "x"}]), r"observations\[0\] has role 'assistant'"),
        (None, EnvStep(reward=float("nan")), r"reward must be finite, got nan"),
        (None, EnvStep(reward=True), r"reward must be None or a float, got bool"),
        (None, EnvStep(done=1), r"done must be a bool, got int"),  # type: ignore[arg-type]
    ],
)
def test_check_environment_names_what_is_wrong_and_still_closes(initial, result, match):
    env_cls = type(
        "Scripted",
        (Scripted,),
        {"initial": Scripted.initial if initial is None else initial, "result": result, "closed": []},
    )
    with pytest.raises(AssertionError, match=match):
        check_environment(env_cls)
    assert env_cls.closed == [True]


def test_check_environment_reports_a_method_that_raises():
    class Raising(Scripted):
        def reset(self, row: Any) -> Any:
            raise KeyError("prompt")

    with pytest.raises(AssertionError, match=r"Raising.reset\(\) raised KeyError: 'prompt'"):
        check_environment(Raising)
    with pytest.raises(AssertionError, match="does not implement EnvironmentProtocol: NoStep has no method step"):
        check_environment(NoStep)


# ============================================================================ in-process tool calls


async def _sleepy(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: How long to sleep.
    """
    await asyncio.sleep(seconds)
    return "awake"


def _crash(x: str) -> str:
    """Fail with a plain exception.

    Args:
        x: Ignored.
    """
    raise RuntimeError("disk on fire")


def test_in_process_calls_turn_every_failure_into_a_status():
    lookup = LookupTool({"k": "v" * 10})
    context = environment_context(
        [lookup, FunctionTool(_sleepy), FunctionTool(_crash)],
        {"tool_timeout_s": 0.05, "max_tool_response_length": 4},
    )

    def call(tool: str, **arguments: Any) -> ToolResult:
        return asyncio.run(context.call_tool(tool, arguments))

    ok = call("lookup", key="k")
    assert (ok.text, ok.status, ok.truncated) == ("vvvv", "ok", True)  # 10 characters cut to 4
    assert call("lookup", key="k2").status == "error"  # ToolError: no entry for 'k2', cut to 4 characters
    assert call("search", q="x").status == "unknown_tool"
    assert call("lookup", name="k").status == "bad_arguments"
    assert call("_sleepy", seconds=5.0).status == "timeout"
    assert call("_crash", x="a").status == "error"
    full = environment_context([FunctionTool(_crash), lookup]).call_tool
    assert asyncio.run(full("_crash", {"x": "a"})).text == "_crash: RuntimeError: disk on fire"
    assert asyncio.run(full("lookup", {"key": "q"})).text == "lookup: no entry for 'q'"
    assert asyncio.run(full("nope", {})).text == "unknown tool 'nope'; the tools are: _crash, lookup"
    assert asyncio.run(full("lookup", {})).text == "lookup: missing required argument 'key' (a string)"


# ============================================================================ parsers


def test_parse_tag_calls_finds_each_call_in_order():
    text = "a <lookup>x</lookup> then <calculator> 1+2 </calculator><calculator>3</calculator> <search>q</search>"
    assert parse_tag_calls(text, ["calculator", "lookup"]) == [
        ParsedCall("lookup", argument="x", text="<lookup>x</lookup>"),
        ParsedCall("calculator", argument="1+2", text="<calculator> 1+2 </calculator>"),
        ParsedCall("calculator", argument="3", text="<calculator>3</calculator>"),
    ]  # <search> names no tool: plain text
    assert parse_tag_calls("no call here", ["calculator"]) == []
    assert parse_tag_calls("<calculator>1</calculator>", []) == []
    # the argument runs to the first closing tag
    assert parse_tag_calls("<c>1+<c>2</c>", ["c"]) == [ParsedCall("c", argument="1+<c>2", text="<c>1+<c>2</c>")]


def test_parse_tag_calls_reports_an_unclosed_tag():
    calls = parse_tag_calls("<calculator>1+1</calculator> and <calculator>2*", ["calculator"])
    assert calls[0] == ParsedCall("calculator", argument="1+1", text="<calculator>1+1</calculator>")
    assert calls[1] == ParsedCall(
        "calculator",
        error="calculator: the call <calculator> is not closed; write a call as <calculator>ARGUMENT</calculator>",
        text="<calculator>2*",
    )


def test_parse_hermes_calls_reads_objects_and_argument_strings():
    text = (
        'x <tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
        '<tool_call>{"name": "lookup", "arguments": "{\\"key\\": \\"k\\"}"}</tool_call>'
        '<tool_call>{"name": "now"}</tool_call>'
    )
    calls = parse_hermes_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculator", {"expression": "1+1"}, None),
        ("lookup", {"key": "k"}, None),
        ("now", {}, None),
    ]
    assert calls[0].text == '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'


@pytest.mark.parametrize(
    ("body", "name", "error"),
    [
        ('{"name": "calculator", "arguments": {', None, "the tool call is not valid JSON (Expecting"),
        ('["calculator"]', None, "the tool call must be a JSON object"),
        ('{"arguments": {}}', None, 'the tool call has no "name" (a string)'),
        ('{"name": "lookup", "arguments": "{key"}', "lookup", "lookup: the arguments string is not valid JSON"),
        ('{"name": "lookup", "arguments": [1]}', "lookup", 'lookup: "arguments" must be a JSON object'),
    ],
)
def test_parse_hermes_calls_reports_malformed_calls(body, name, error):
    (call,) = parse_hermes_calls(f"<tool_call>{body}</tool_call>")
    assert (call.name, call.arguments) == (name, {})
    assert call.error is not None and call.error.startswith(error)
    assert call.error.endswith('write a call as <tool_call>{"name": "TOOL", "arguments": {...}}</tool_call>')


def test_parse_hermes_calls_reports_an_unclosed_call():
    (call,) = parse_hermes_calls('<tool_call>{"name": "calculator"')
    assert (call.name, call.text) == (None, '<tool_call>{"name": "calculator"')
    assert call.error is not None and call.error.startswith("the tool call is not closed")


# ============================================================================ tool_agent


def test_tool_agent_stops_after_a_call_and_refuses_tools_the_tags_cannot_call():
    lookup = LookupTool({"k": "v"})
    assert ToolAgentEnvironment(environment_context([calculator_tool, lookup])).stop == (
        "</calculator>",
        "</lookup>",
    )
    assert ToolAgentEnvironment(environment_context([lookup], {"format": "hermes"})).stop == ("</tool_call>",)

    def add(a: int, b: int) -> int:
        """Add.

        Args:
            a: One.
            b: Two.
        """
        return a + b

    with pytest.raises(ConfigError, match=r"the tool 'add' has the required parameters: a \(integer\), b \(integer\)"):
        ToolAgentEnvironment(environment_context([FunctionTool(add)]))
    with pytest.raises(ConfigError, match="Use rollout.multi_turn.format=hermes"):
        ToolAgentEnvironment(environment_context([FunctionTool(add)], {"format": "tags"}))
    ToolAgentEnvironment(environment_context([FunctionTool(add)], {"format": "hermes"}))  # JSON calls: fine
    with pytest.raises(ConfigError, match=r"format must be one of \['tags', 'hermes'\], got 'xml'"):
        ToolAgentEnvironment(environment_context([], {"format": "xml"}))


def test_tool_agent_reset_accepts_verl_rows():
    env = ToolAgentEnvironment(environment_context([calculator_tool]))
    messages = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "2+2?"}]
    # a parquet read gives the prompt as a numpy object array of dicts
    assert env.reset({"prompt": np.array(messages, dtype=object)}) == messages
    assert env.reset({"prompt": "2+2?"}) == [{"role": "user", "content": "2+2?"}]
    with pytest.raises(ValueError, match="the row has no 'prompt'"):
        env.reset({"question": "2+2?"})


def test_tool_agent_answers_malformed_and_unknown_calls_with_the_format():
    env = ToolAgentEnvironment(environment_context([calculator_tool], {"format": "hermes", "max_parallel_calls": 3}))
    step = play(
        env,
        '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>'
        "<tool_call>{oops}</tool_call>",
    )
    assert [m.get("name") for m in step.observations] == ["search", "calculator", None]
    assert step.observations[0]["content"] == (
        "unknown tool 'search'; the tools are: calculator. Write a call as "
        '<tool_call>{"name": "TOOL", "arguments": {...}}</tool_call>'
    )
    # a call to a known tool with wrong arguments runs: the tool's schema check answers it
    assert step.observations[1]["content"] == (
        "calculator: missing required argument 'expression' (a string); unknown argument 'expr' (the parameters "
        "are: expression)"
    )
    assert step.observations[2]["content"].startswith("the tool call is not valid JSON")
    assert dict(step.info) == counts(tool_calls=3, tool_errors=3, malformed_calls=2)
    assert step.done is False and step.reward is None

    tags = ToolAgentEnvironment(environment_context([calculator_tool]))
    unclosed = play(tags, "<calculator>12*")
    assert unclosed.observations == [
        {
            "role": "tool",
            "content": "calculator: the call <calculator> is not closed; write a call as "
            "<calculator>ARGUMENT</calculator>",
            "name": "calculator",
        }
    ]
    assert dict(unclosed.info) == counts(tool_calls=1, tool_errors=1, malformed_calls=1)
    refused = play(tags, "<calculator>2**8</calculator>")  # the tool's own error: a ToolError message
    assert (
        refused.observations[0]["content"]
        == "the operator ** is not allowed; use integers with + - * // and parentheses"
    )
    assert dict(refused.info) == counts(tool_calls=1, tool_errors=1)


def test_tool_agent_runs_at_most_max_parallel_calls_concurrently():
    started: list[str] = []
    gate: dict[str, asyncio.Event] = {}

    async def call_tool(name: str, arguments: Any) -> ToolResult:
        started.append(arguments["expression"])
        if len(started) == 2:
            gate["both started"].set()
        # run one after the other, the first call would time out here waiting for the second
        await asyncio.wait_for(gate["both started"].wait(), timeout=2)
        return ToolResult(f"ran {arguments['expression']}")

    context = EnvironmentContext({"calculator": calculator_tool}, call_tool, settings={"max_parallel_calls": 2})
    env = ToolAgentEnvironment(context)

    async def main() -> EnvStep:
        gate["both started"] = asyncio.Event()
        text = "<calculator>1</calculator><calculator>2</calculator><calculator>3</calculator>"
        return await env.step({"role": "assistant", "content": text})

    step = asyncio.run(main())
    assert started == ["1", "2"]  # the third call never reached the tools
    assert [m["content"] for m in step.observations] == [
        "ran 1",
        "ran 2",
        "calculator: not run; at most 2 tool call(s) are run per message. Wait for the results before making "
        "more calls",
    ]
    assert dict(step.info) == counts(tool_calls=3, tool_errors=1, calls_over_limit=1)


def test_tool_agent_counts_timeouts_and_crashes_from_the_workers():
    statuses = {"1": "timeout", "2": "crash", "3": "error", "4": "ok"}

    async def call_tool(name: str, arguments: Any) -> ToolResult:
        return ToolResult(f"status {statuses[arguments['expression']]}", statuses[arguments["expression"]])

    context = EnvironmentContext({"calculator": calculator_tool}, call_tool, settings={"max_parallel_calls": 4})
    step = play(ToolAgentEnvironment(context), "".join(f"<calculator>{i}</calculator>" for i in "1234"))
    assert [m["content"] for m in step.observations] == ["status timeout", "status crash", "status error", "status ok"]
    assert dict(step.info) == counts(tool_calls=4, tool_errors=1, tool_timeouts=1, tool_crashes=1)


def test_a_message_without_a_call_ends_the_episode():
    env = ToolAgentEnvironment(environment_context([calculator_tool]))
    step = play(env, "The answer is <b>84</b>.")
    assert (step.observations, step.reward, step.done, dict(step.info)) == ((), None, True, counts())
