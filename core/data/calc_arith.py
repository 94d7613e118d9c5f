"""``calc_arith``: multi-digit integer arithmetic for the ``calculator`` tool task (issue 33), generated offline.

A problem is a random expression over integer operands, e.g. ``347 * 29 + 512``; the prompt explains the tag
protocol of ``rollout.multi_turn.format=tags`` once, with one worked example, and asks for the answer after
``####`` (scored by the ``gsm8k`` reward, verl's strict extraction; ``configs/data/calc_arith.yaml`` maps the data
source to it). Rows go through :func:`rlplug.data.prepare.prepare_dataset` like the reasoning-gym tasks (same
parquet schema, disjoint train/test splits, cache key): this module only draws the items.

Items are drawn the way reasoning-gym draws them: item ``i`` of a generator with seed ``s`` comes from
``random.Random(s + i)`` alone, so an item does not depend on the size asked for or on the items before it.
Each item is reasoning-gym's shape, ``{"question", "answer", "metadata"}``::

    question   "Calculate 347 * 29 + 512."           (operators spaced; ``//`` is Python's floor division)
    answer     "10575"                                (the exact integer, str)
    metadata   {"expression": "347*29+512",           (the calculator's syntax: no spaces, Python's precedence)
                "digits": 3, "ops": 2,                (the operand size drawn, the number of binary operators)
                "operands": [347, 29, 512], "operators": ["*", "+"]}   (left to right as written)

Settings (``data.task_kwargs``; :data:`DEFAULTS` fills the rest):

==============  ============================================================================================
``digits``      operand sizes to draw from, one per problem (every operand of a problem has that many
                digits: ``3`` -> 100..999; ``1`` -> 1..9, never 0). Default ``[3]``.
``ops``         numbers of binary operators to draw from, one per problem (1: ``a*b``; 2: ``a*b+c``,
                ``(a+b)*c`` ...). Default ``[1, 2]``.
``operators``   the operators an expression may use, from ``+ - * //``. Default ``["+", "-", "*"]``.
``min_mul``     at least this many of a problem's operators are ``*`` (so the task is not mostly
                additions a small model can do in its head). Default 1.
``allow_negative``  false (default): a problem whose value is negative is redrawn (from the same RNG).
==============  ============================================================================================

Bounds: ``digits`` in 1..9, ``ops`` in 1..4 and ``max(digits) * (max(ops) + 1) <= 30`` so that every value
stays within the calculator's ``10**30`` limit (``plugins/tools/calculator.py``).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

__all__ = [
    "TASK",
    "DEFAULTS",
    "FORMAT_VERSION",
    "INSTRUCTION",
    "SYSTEM",
    "DEMONSTRATION",
    "prompt_messages",
    "OPERATORS",
    "CalcArithDataset",
    "check_kwargs",
    "draw_problem",
]

#: the task's name: ``data.task`` and every row's ``data_source``
TASK = "calc_arith"

#: the generator settings used where ``data.task_kwargs`` gives none (see the module docstring)
DEFAULTS: dict[str, Any] = {
    "digits": [3],
    "ops": [1, 2],
    "operators": ["+", "-", "*"],
    "min_mul": 1,
    "allow_negative": False,
}

#: bump when this module changes the items or the prompt it writes for the same settings (part of the data
#: cache key, :func:`rlplug.data.prepare.prepared_data_files`)
FORMAT_VERSION = 2

#: the system message: the ``tags`` protocol and the answer format, once
SYSTEM = (
    "You are a helpful assistant with a calculator. To compute, write <calculator>expression</calculator> "
    "(integers, + - * and parentheses) and wait for the result. Then give the final answer as: #### number"
)

#: one worked example as a conversation before the question: the call, the calculator's reply, the answer.
#: The 135M default model does not follow the protocol from a description alone (the pilot,
#: benchmarks/results/calc_tool_pilot*.json: 1% of its responses called the tool); shown as turns, it does.
DEMONSTRATION: tuple[dict[str, str], ...] = (
    {"role": "user", "content": "Calculate 12 * 34 + 5."},
    {"role": "assistant", "content": "<calculator>12*34+5</calculator>"},
    {"role": "tool", "content": "413"},
    {"role": "assistant", "content": "#### 413"},
)

#: kept for callers of the first version: the protocol as one sentence (the prompt now uses SYSTEM and
#: DEMONSTRATION; ``data.instruction``, when set, is appended to the question instead)
INSTRUCTION = ""


def prompt_messages(question: str, instruction: str | None = None) -> list[dict[str, str]]:
    """The prompt of one problem: :data:`SYSTEM`, the :data:`DEMONSTRATION` turns, then the question as the
    last user message (``instruction``, ``data.instruction`` when set, appended to it)."""
    text = question.strip() if not instruction else f"{question.strip()} {instruction.strip()}"
    return [{"role": "system", "content": SYSTEM}, *(dict(m) for m in DEMONSTRATION), {"role": "user", "content": text}]


#: the operators a problem may use, with Python's precedence (higher binds tighter)
OPERATORS: dict[str, int] = {"+": 1, "-": 1, "*": 2, "//": 2}

_MAX_DIGITS = 9
_MAX_OPS = 4
#: the calculator's limit on every value, in decimal digits (its MAX_MAGNITUDE is 10**30)
_MAX_TOTAL_DIGITS = 30
#: draws of one item before giving up (a redraw happens for a negative value or a division by zero)
_MAX_REDRAWS = 1000


def _int_list(name: str, value: Any, low: int, high: int) -> list[int]:
    values = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if (
        not isinstance(values, (list, tuple))
        or not values
        or not all(isinstance(v, int) and not isinstance(v, bool) and low <= v <= high for v in values)
    ):
        raise ValueError(
            f"task_kwargs '{name}' must be an integer or a non-empty list of integers in {low}..{high}, got {value!r}."
        )
    return sorted(set(values))


def check_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``kwargs`` (``data.task_kwargs`` over :data:`DEFAULTS`) checked and normalised (``digits``/``ops`` as
    sorted lists, ``operators`` as a list).

    Raises:
        ValueError: an unknown key (the valid ones listed), a value out of range, an operator outside
            ``+ - * //``, ``min_mul`` above the smallest ``ops`` or without ``*``, or sizes whose values could
            pass the calculator's ``10**30`` limit.
    """
    unknown = sorted(set(kwargs) - set(DEFAULTS))
    if unknown:
        raise ValueError(
            f"Unknown task_kwargs for task '{TASK}': {', '.join(unknown)}. Valid keys: {', '.join(DEFAULTS)}."
        )
    merged = {**DEFAULTS, **dict(kwargs)}
    digits = _int_list("digits", merged["digits"], 1, _MAX_DIGITS)
    ops = _int_list("ops", merged["ops"], 1, _MAX_OPS)
    operators = merged["operators"]
    if (
        not isinstance(operators, (list, tuple))
        or not operators
        or not all(isinstance(o, str) and o in OPERATORS for o in operators)
    ):
        raise ValueError(
            f"task_kwargs 'operators' must be a non-empty list from {', '.join(OPERATORS)}, got {operators!r}."
        )
    min_mul = merged["min_mul"]
    if not isinstance(min_mul, int) or isinstance(min_mul, bool) or not 0 <= min_mul <= min(ops):
        raise ValueError(
            f"task_kwargs 'min_mul' must be an integer in 0..{min(ops)} (the smallest 'ops'), got {min_mul!r}."
        )
    if min_mul and "*" not in operators:
        raise ValueError(f"task_kwargs 'min_mul'={min_mul} needs '*' in 'operators', got {list(operators)}.")
    if max(digits) * (max(ops) + 1) > _MAX_TOTAL_DIGITS:
        raise ValueError(
            f"task_kwargs digits={digits}, ops={ops}: a product of {max(ops) + 1} operands of {max(digits)} digits "
            f"can exceed the calculator's limit of 10**30; keep max(digits) * (max(ops) + 1) <= {_MAX_TOTAL_DIGITS}."
        )
    if not isinstance(merged["allow_negative"], bool):
        raise ValueError(f"task_kwargs 'allow_negative' must be true or false, got {merged['allow_negative']!r}.")
    return {
        "digits": digits,
        "ops": ops,
        "operators": list(operators),
        "min_mul": min_mul,
        "allow_negative": merged["allow_negative"],
    }


# An expression tree: an int (an operand) or (operator, left, right).
_Node = Any


def _tree(rng: random.Random, operators: list[str], leaves: list[int]) -> _Node:
    """A random binary tree over ``leaves`` in order, the internal nodes taking ``operators`` in order."""
    if len(leaves) == 1:
        return leaves[0]
    split = rng.randint(1, len(leaves) - 1)  # left subtree: leaves[:split], operators[:split-1]
    return (
        operators[split - 1],
        _tree(rng, operators[: split - 1], leaves[:split]),
        _tree(rng, operators[split:], leaves[split:]),
    )


def _value(node: _Node) -> int:
    if isinstance(node, int):
        return node
    op, left, right = node
    a, b = _value(left), _value(right)
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return a // b  # ZeroDivisionError: the caller redraws


def _render(node: _Node, sep: str) -> str:
    """The expression with the fewest parentheses Python's precedence needs (``sep`` around operators)."""
    if isinstance(node, int):
        return str(node)
    op, left, right = node
    prec = OPERATORS[op]
    lhs, rhs = _render(left, sep), _render(right, sep)
    if not isinstance(left, int) and OPERATORS[left[0]] < prec:
        lhs = f"({lhs})"
    if not isinstance(right, int):
        rprec = OPERATORS[right[0]]
        # a right operand of equal precedence keeps its parentheses unless regrouping is exact: integer + and -
        # reassociate (a+(b-c+d) = a+b-c+d), but a-(b+c), a*(b//c), a//(b*c) and a*(b//c*d) differ, so
        # a*(b*c) keeps its parentheses too rather than look inside the right operand
        if rprec < prec or (rprec == prec and op != "+"):
            rhs = f"({rhs})"
    return f"{lhs}{sep}{op}{sep}{rhs}"


def _in_order(node: _Node, operands: list[int], operators: list[str]) -> None:
    if isinstance(node, int):
        operands.append(node)
        return
    _in_order(node[1], operands, operators)
    operators.append(node[0])
    _in_order(node[2], operands, operators)


def draw_problem(rng: random.Random, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """One problem from ``rng`` under checked settings (:func:`check_kwargs`): reasoning-gym's item shape
    ``{"question", "answer", "metadata"}`` (the module docstring shows one).

    Raises:
        ValueError: no valid problem in 1000 draws (e.g. only ``-`` and ``//`` with ``allow_negative=false``).
    """
    for _ in range(_MAX_REDRAWS):
        digits = rng.choice(kwargs["digits"])
        ops = rng.choice(kwargs["ops"])
        operators = [rng.choice(kwargs["operators"]) for _ in range(ops)]
        missing = kwargs["min_mul"] - operators.count("*")
        if missing > 0:
            for i in rng.sample([i for i, o in enumerate(operators) if o != "*"], missing):
                operators[i] = "*"
        leaves = [rng.randint(10 ** (digits - 1), 10**digits - 1) for _ in range(ops + 1)]
        tree = _tree(rng, operators, leaves)
        try:
            value = _value(tree)
        except ZeroDivisionError:
            continue
        if value < 0 and not kwargs["allow_negative"]:
            continue
        operands: list[int] = []
        in_order: list[str] = []
        _in_order(tree, operands, in_order)
        return {
            "question": f"Calculate {_render(tree, ' ')}.",
            "answer": str(value),
            "metadata": {
                "expression": _render(tree, ""),
                "digits": digits,
                "ops": ops,
                "operands": operands,
                "operators": in_order,
            },
        }
    raise ValueError(
        f"task '{TASK}' found no valid problem in {_MAX_REDRAWS} draws with settings {dict(kwargs)}: every draw was "
        "negative or divided by zero; allow_negative=true or add '+' / '*' to 'operators'."
    )


class CalcArithDataset:
    """Items ``0 .. size-1`` of the task with ``seed`` (item ``i`` from ``random.Random(seed + i)``), indexable
    like a reasoning-gym dataset (what :func:`rlplug.data.prepare.prepare_dataset` reads).

    Raises:
        ValueError: invalid ``kwargs`` (:func:`check_kwargs`).
    """

    def __init__(self, kwargs: Mapping[str, Any], seed: int, size: int) -> None:
        self.config = check_kwargs(kwargs)
        self.seed = int(seed)
        self.size = int(size)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < self.size:
            raise IndexError(f"item {index} of a {TASK} dataset of size {self.size}")
        return draw_problem(random.Random(self.seed + index), self.config)
