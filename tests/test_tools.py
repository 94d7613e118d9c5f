"""The ``tool`` plugin kind: FunctionTool's schema and argument checks, the packaged ``calculator``, the
registry's contract check, the ``check_tool`` kit and the ``LookupTool`` test tool."""

from __future__ import annotations

import asyncio
import types
from typing import Any

import pytest

import rlplug
import rlplug.plugin
import rlplug.testing
from rlplug.contracts.agents import ToolProtocol
from rlplug.contracts.registry import PluginContractError, Registry
from rlplug.plugin import FunctionTool, ToolArgumentError, ToolError, ToolSchemaError
from rlplug.plugins.tools.calculator import calculator_tool
from rlplug.testing import LookupTool, check_tool

# ============================================================================ FunctionTool: the schema


def order_pizza(size: int, toppings: list[str], price: float, extra_cheese: bool = False, note: str = "") -> str:
    """Order a pizza for delivery.

    The kitchen closes at 23:00.

    Args:
        size (int): Diameter in centimetres,
            one of 26, 32 or 40.
        toppings: Names of the toppings.
        extra_cheese: Whether to add cheese.

    Returns:
        The order number.
    """
    return f"{size}:{','.join(toppings)}:{price}:{extra_cheese}:{note}"


def test_the_schema_comes_from_the_signature_and_the_docstring():
    tool = FunctionTool(order_pizza)
    assert tool.name == "order_pizza"
    assert tool.description == "Order a pizza for delivery."
    assert tool.parameters == {
        "type": "object",
        "properties": {
            "size": {"type": "integer", "description": "Diameter in centimetres, one of 26, 32 or 40."},
            "toppings": {"type": "array", "items": {"type": "string"}, "description": "Names of the toppings."},
            "price": {"type": "number"},
            "extra_cheese": {"type": "boolean", "description": "Whether to add cheese."},
            "note": {"type": "string"},
        },
        "required": ["size", "toppings", "price"],
    }
    assert isinstance(tool, ToolProtocol)
    # a price given as a JSON integer reaches the function as a float
    assert tool(size=32, toppings=["ham", "olive"], price=12) == "32:ham,olive:12.0:False:"


def test_name_and_description_can_be_given_and_a_bare_list_has_no_items():
    def f(values: list) -> int:
        return len(values)

    tool = FunctionTool(f, name="count", description="Count the values.")
    assert (tool.name, tool.description) == ("count", "Count the values.")
    assert tool.parameters == {"type": "object", "properties": {"values": {"type": "array"}}, "required": ["values"]}
    assert tool(values=[1, "a"]) == "2"  # a non-str result is returned through str()


@pytest.mark.parametrize(
    ("annotation", "match"),
    [
        ("dict", r"parameter 'x' is annotated dict"),
        ("int | None", r"parameter 'x' is annotated int \| None"),
        ("", "'x' has no"),
    ],
)
def test_an_annotation_without_a_json_type_is_refused_naming_the_parameter(annotation, match):
    namespace: dict[str, Any] = {}
    exec(f"def f(x{': ' + annotation if annotation else ''}):\n    'Doc.'\n    return ''", namespace)
    with pytest.raises(ToolSchemaError, match=match):
        FunctionTool(namespace["f"])


def test_functions_that_cannot_be_described_are_refused():
    def star(*values: int) -> str:
        """Doc."""
        return ""

    def undocumented(x: int) -> str:
        return ""

    def stray(x: int) -> str:
        """Doc.

        Args:
            y: not a parameter.
        """
        return ""

    with pytest.raises(ToolSchemaError, match=r"'values' is \*args/\*\*kwargs"):
        FunctionTool(star)
    with pytest.raises(ToolSchemaError, match="description must be a non-empty string"):
        FunctionTool(undocumented)
    assert FunctionTool(undocumented, description="Doc.").description == "Doc."
    with pytest.raises(ToolSchemaError, match=r"Args: section names \['y'\]"):
        FunctionTool(stray)


# ============================================================================ FunctionTool: argument checks


def test_arguments_are_checked_with_messages_for_the_model():
    tool = FunctionTool(order_pizza)
    with pytest.raises(ToolArgumentError) as err:
        tool(size="32", toppings=["ham", 3], colour="red")
    assert str(err.value) == (
        "order_pizza: missing required argument 'price' (a number); "
        "argument 'size' must be an integer, got a string '32'; "
        "argument 'toppings[1]' must be a string, got an integer 3; "
        "unknown argument 'colour' (the parameters are: size, toppings, price, extra_cheese, note)"
    )
    assert len(err.value.problems) == 4
    assert isinstance(err.value, ToolError) and isinstance(err.value, ValueError)
    with pytest.raises(ToolArgumentError, match="'extra_cheese' must be a boolean \\(true or false\\), got an integer"):
        tool(size=26, toppings=[], price=1.0, extra_cheese=1)
    with pytest.raises(ToolArgumentError, match="'size' must be an integer, got a boolean True"):
        tool(size=True, toppings=[], price=1.0)


def test_an_async_function_becomes_an_async_tool():
    async def add(a: int, b: int) -> int:
        """Add two integers."""
        await asyncio.sleep(0)
        return a + b

    tool = FunctionTool(add)
    assert tool.is_async
    assert asyncio.run(tool(a=2, b=40)) == "42"
    with pytest.raises(ToolArgumentError, match="missing required argument 'b'"):
        tool(a=2)  # raised before any coroutine is made
    check_tool(tool, picklable=False)  # a local function: not picklable


# ============================================================================ the calculator


@pytest.mark.parametrize(
    ("expression", "result"),
    [
        ("12*(3+4)-5//2", "82"),
        ("-7 // 2", "-4"),
        ("-(2 - 5) * +3", "9"),
        ("123456789 * 987654321", "121932631112635269"),
        ("1000000000000000 * 1000000000000000", str(10**30)),
    ],
)
def test_the_calculator_evaluates_integer_arithmetic(expression, result):
    assert calculator_tool(expression=expression) == result


@pytest.mark.parametrize(
    ("expression", "match"),
    [
        ("2**10", r"the operator \*\* is not allowed"),
        ("__import__('os')", "function calls are not allowed"),
        ("x + 1", "names are not allowed"),
        ("7 / 2", "the operator / is not allowed"),
        ("1.5 * 2", "only integers are allowed, got 1.5"),
        ("'a' * 3", "only integers are allowed"),
        ("1+" * 149 + "12", "the expression has 300 characters; at most 200"),
        ("1" + "0" * 31, r"exceeds the calculator's limit of 10\*\*30"),
        ("1000000000000000 * 1000000000000000 * 10", r"limit of 10\*\*30 in magnitude \(32 digits\)"),
        ("5 // (3 - 3)", "division by zero"),
        ("-" * 40 + "1", "nests deeper than 32 levels"),
        ("1 +", "not a valid expression"),
        ("", "the expression is empty"),
        ("1 < 2", "Compare expressions are not allowed"),
    ],
)
def test_the_calculator_refuses_with_a_message_for_the_model(expression, match):
    with pytest.raises(ToolError, match=match):
        calculator_tool(expression=expression)


def test_the_calculator_passes_the_tool_kit():
    check_tool(calculator_tool)
    check_tool("calculator")  # by name, through the registry


def test_the_registry_resolves_the_calculator_through_its_entry_point(rlplug_full_registry):
    reg = rlplug_full_registry.registration("tool", "calculator")
    assert (reg.distribution, reg.plugin) == ("rlplug", "calculator")
    assert reg.obj is calculator_tool and reg.obj.name == "calculator"
    assert "calculator" in rlplug.plugin.plugin_names("tool")


# ============================================================================ the contract check


class _Broken:
    name = "broken"
    description = "Refuses to say."
    parameters = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}

    def __call__(self, **arguments: Any) -> Any:
        return 42  # not text, and no argument check


def _registry_with(name: str, tool: Any) -> Registry:
    registry = Registry(load_entry_points=False)
    plugin = types.SimpleNamespace(register_tools=rlplug.hookimpl(lambda register: register(name, tool)))
    assert registry.add_plugin(plugin, name="p", distribution="rlplug-tools", version="0.1")
    return registry


def test_the_contract_check_refuses_a_tool_without_a_schema():
    class NoSchema:
        name = "search"
        description = "Search the web."

        def __call__(self, query: str) -> str:
            return query

    with pytest.raises(PluginContractError) as err:
        _registry_with("search", NoSchema()).get("tool", "search")
    message = str(err.value)
    assert message.startswith(
        "The tool 'search' (rlplug-tools 0.1, plugin p) does not implement rlplug.contracts.agents.ToolProtocol: "
    )
    assert "search has no attribute 'parameters'" in message
    assert "search(query) cannot be called as search()" in message
    assert "rlplug.testing.check_tool" in message


def test_the_contract_check_refuses_a_bad_schema_a_plain_function_and_a_wrong_name():
    class BadSchema(_Broken):
        parameters = {"type": "object", "properties": {"q": {"type": "text"}}, "required": ["query"]}

    with pytest.raises(PluginContractError) as err:
        _registry_with("broken", BadSchema()).get("tool", "broken")
    assert err.value.problems == [
        "broken: parameters.properties['q'] has the unknown type(s) ['text']; use "
        "('string', 'integer', 'number', 'boolean', 'array', 'object', 'null')",
        'broken: parameters "required" names [\'query\'], which are not in "properties"',
    ]

    def search(query: str) -> str:
        """Search."""
        return query

    with pytest.raises(PluginContractError, match=r"wrap it, FunctionTool\(fn\)"):
        _registry_with("search", search).get("tool", "search")
    with pytest.raises(PluginContractError, match="registered as 'find' but its name is 'search'"):
        _registry_with("find", FunctionTool(search)).get("tool", "find")
    assert _registry_with("search", FunctionTool(search)).get("tool", "search")(query="q") == "q"


# ============================================================================ the kit


def test_check_tool_fails_on_a_broken_tool():
    with pytest.raises(AssertionError, match="must return the result as text \\(str\\), got int: 42"):
        check_tool(_Broken())

    class NoCheck(_Broken):
        def __call__(self, **arguments: Any) -> str:
            return "ok"

    with pytest.raises(AssertionError, match="a call without the required argument 'q' returned 'ok'; it must raise"):
        check_tool(NoCheck())

    def closure_tool() -> FunctionTool:
        def ask(q: str) -> str:
            """Ask."""
            return q

        return FunctionTool(ask)

    check_tool(closure_tool(), picklable=False)
    with pytest.raises(AssertionError, match="cannot be pickled"):
        check_tool(closure_tool())
    with pytest.raises(AssertionError, match="does not implement ToolProtocol"):
        check_tool(types.SimpleNamespace(name="x", description="y"))


def test_the_lookup_tool_returns_the_value_verbatim():
    lookup = LookupTool({"capital of Freedonia": "Fredville", "answer": 42})
    assert lookup(key="capital of Freedonia") == "Fredville"
    assert lookup(key="answer") == "42"
    with pytest.raises(ToolError, match="lookup: no entry for 'Sylvania'"):
        lookup(key="Sylvania")
    with pytest.raises(ToolArgumentError, match="lookup: missing required argument 'key'"):
        lookup()
    with pytest.raises(AssertionError, match="raised ToolError: lookup: no entry for '1'"):
        check_tool(lookup)  # the default argument "1" is not a key
    check_tool(lookup, {"key": "answer"})


def test_the_tool_names_are_exported_where_plugins_and_tests_find_them():
    assert rlplug.plugin.check_tool is rlplug.testing.check_tool
    assert rlplug.plugin.FunctionTool is FunctionTool
    assert {"FunctionTool", "ToolError", "ToolArgumentError", "ToolSchemaError", "check_tool"} <= set(
        rlplug.plugin.__all__
    )
    assert {"check_tool", "LookupTool"} <= set(rlplug.testing.__all__)


def test_rollout_multi_turn_resolves_its_plugins_and_names_settings_without_enable() -> None:
    import pytest as _pytest
    from _helpers import run_config

    from rlplug.config.schema import ConfigError
    from rlplug.run.validate import validate_config

    def cfg(*overrides: str):
        return run_config(["debug=tiny", *overrides], "unused", validate=False)

    validate_config(cfg())  # the default: off, no tools
    on = "rollout.multi_turn.enable=true"
    validate_config(cfg(on, "rollout.multi_turn.tools=[calculator]"))
    with _pytest.raises(ConfigError, match=r"rollout.multi_turn.tools\[0\]=no_such_tool"):
        validate_config(cfg(on, "rollout.multi_turn.tools=[no_such_tool]"))
    with _pytest.raises(ConfigError, match="rollout.multi_turn.environment=no_such_env"):
        validate_config(cfg(on, "rollout.multi_turn.environment=no_such_env"))
    # a setting without enable has no effect: said (a preset's no-tool baseline), never dropped silently
    with _pytest.warns(UserWarning, match=r"no effect: rollout.multi_turn.tools=\['calculator'\]"):
        validate_config(cfg("rollout.multi_turn.tools=[calculator]"))
    with _pytest.raises(ConfigError, match="format=json: use one of tags, hermes"):
        validate_config(cfg(on, "rollout.multi_turn.format=json"))
    with _pytest.raises(ConfigError, match="tool_timeout_s=0.0: must be > 0 seconds"):
        validate_config(cfg(on, "rollout.multi_turn.tool_timeout_s=0.0"))
    with _pytest.raises(ConfigError, match="on_overflow=drop: use one of truncate, end"):
        validate_config(cfg(on, "rollout.multi_turn.on_overflow=drop"))
