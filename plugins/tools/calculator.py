"""The ``calculator`` tool (kind ``tool``): integer arithmetic for a model that cannot do it in its head.

``calculator(expression)`` evaluates an expression of integer literals with ``+``, ``-``, ``*``, ``//``
(floor division, Python's: ``-7 // 2 == -4``), parentheses and unary ``-`` / ``+``, and returns the integer as
text (``"12*(3+4)-5//2"`` -> ``"82"``). The expression is parsed with :mod:`ast` and only those nodes are
evaluated, never ``eval``: names, calls, attributes, strings, floats, ``**``, ``%``, ``/``, comparisons and
everything else are refused. Bounded so that no call can take long or grow large (``**`` is not offered:
``9**9**9`` would not finish):

* the expression is at most :data:`MAX_EXPRESSION_CHARS` characters;
* every integer literal and every intermediate and final value is at most :data:`MAX_MAGNITUDE` in magnitude
  (so each multiplication multiplies numbers of at most 31 digits);
* parentheses and unary signs nest at most :data:`MAX_DEPTH` deep.

A refused or failing expression (division by zero included) raises :class:`rlplug.plugin.ToolError` with a
message the model sees as the tool's reply, saying what is allowed.
"""

from __future__ import annotations

import ast

from rlplug.plugin import FunctionTool, ToolError, hookimpl

__all__ = ["calculator", "calculator_tool", "MAX_EXPRESSION_CHARS", "MAX_MAGNITUDE", "MAX_DEPTH"]

#: the longest expression accepted, in characters
MAX_EXPRESSION_CHARS = 200
#: the largest magnitude of a literal, an intermediate value or the result
MAX_MAGNITUDE = 10**30
#: the deepest nesting of operators accepted (an AST depth)
MAX_DEPTH = 32

_ALLOWED = "integers with + - * // and parentheses"
_BINARY = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.FloorDiv: "//"}
_REFUSED_BINARY = {ast.Pow: "**", ast.Div: "/", ast.Mod: "%", ast.MatMult: "@", ast.LShift: "<<", ast.RShift: ">>"}


def _bounded(value: int) -> int:
    if abs(value) > MAX_MAGNITUDE:
        raise ToolError(
            f"a value exceeds the calculator's limit of 10**30 in magnitude ({len(str(abs(value)))} digits)"
        )
    return value


def _evaluate(node: ast.AST, depth: int) -> int:
    if depth > MAX_DEPTH:
        raise ToolError(f"the expression nests deeper than {MAX_DEPTH} levels")
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int):
            raise ToolError(f"only integers are allowed, got {node.value!r}; use {_ALLOWED}")
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand, depth + 1)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        op = type(node.op)
        if op not in _BINARY:
            shown = _REFUSED_BINARY.get(op, op.__name__)
            raise ToolError(f"the operator {shown} is not allowed; use {_ALLOWED}")
        left = _evaluate(node.left, depth + 1)
        right = _evaluate(node.right, depth + 1)
        if op is ast.Add:
            return _bounded(left + right)
        if op is ast.Sub:
            return _bounded(left - right)
        if op is ast.Mult:
            return _bounded(left * right)
        if right == 0:
            raise ToolError("division by zero")
        return _bounded(left // right)
    what = {ast.Name: "names", ast.Call: "function calls", ast.Attribute: "attributes"}.get(type(node))
    raise ToolError(f"{what or type(node).__name__ + ' expressions'} are not allowed; use {_ALLOWED}")


def calculator(expression: str) -> str:
    """Evaluate integer arithmetic exactly: + - * // (floor division) and parentheses, e.g. 12*(3+4)-5//2.

    Args:
        expression: The expression, at most 200 characters, of integers up to 10**30 in magnitude.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"the expression has {len(expression)} characters; at most {MAX_EXPRESSION_CHARS} are allowed")
    if not expression.strip():
        raise ToolError(f"the expression is empty; give {_ALLOWED}, e.g. 12*(3+4)")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # ValueError: a null byte
        raise ToolError(f"{expression!r} is not a valid expression; use {_ALLOWED}") from None
    return str(_evaluate(tree.body, 0))


#: the registered tool: :func:`calculator` with its schema
calculator_tool = FunctionTool(calculator)


@hookimpl
def register_tools(register):
    """Register the ``calculator`` tool."""
    register("calculator", calculator_tool)
