"""The ``exact_match`` reward function (verl's reward contract)."""

from __future__ import annotations

from typing import Any

ANSWER_MARKER = "####"


def extract_answer(text: str, marker: str = ANSWER_MARKER) -> str:
    """The text after the last ``marker`` (whole text when absent), stripped of whitespace.

    ``extract_answer("so 3 + 4 = 7\\n#### 7") == "7"``; ``extract_answer(" 7 ") == "7"``.
    """
    text = str(text)
    if marker and marker in text:
        text = text.rsplit(marker, 1)[1]
    return text.strip()


def exact_match(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict | None = None,
    *,
    ignore_case: bool = False,
    marker: str = ANSWER_MARKER,
    **kwargs: Any,
) -> float:
    """1.0 when the response's final answer equals the ground truth exactly, else 0.0.

    verl's reward contract: ``fn(data_source, solution_str, ground_truth, extra_info=None,
    **kwargs) -> float``. The answer is the text after the last ``marker`` (default ``####``) or
    the whole response, stripped of surrounding whitespace; the ground truth is stripped too.
    ``ignore_case=True`` compares case-insensitively. ``data_source`` and ``extra_info`` are
    unused. Options come from the config: ``reward.kwargs.exact_match.ignore_case=true``.

    A ``None`` response or ground truth scores 0.0 (no exception).
    """
    if solution_str is None or ground_truth is None:
        return 0.0
    answer, truth = extract_answer(solution_str, marker), str(ground_truth).strip()
    if ignore_case:
        answer, truth = answer.casefold(), truth.casefold()
    return 1.0 if answer == truth else 0.0
