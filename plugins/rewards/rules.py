"""Packaged reward functions (kind ``reward_function``), verl's contract::

    fn(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float | dict

Correctness rewards return ``{"score": float, "acc": float}`` (``acc`` is 1.0 exactly when the
answer is judged correct); shaping rewards return a float. Keyword arguments come from
``reward.kwargs.<name>``; the functions take no ``**kwargs``, so a misspelled setting is a config
error (the reward manager checks them against the signature before training).

* ``gsm8k``: the answer after ``####`` (verl's ``gsm8k.compute_score`` semantics, numbers compared
  as numbers).
* ``math_verify``: math-verify's ``parse``/``verify`` on the answer in ``<answer>`` tags, after
  ``####``, or anywhere in the response (boxed / last expression).
* ``reasoning_gym``: the reasoning-gym task's own ``score_answer`` on the answer in ``<answer>``
  tags or after ``####``.
* ``length_penalty`` and ``format``: shaping terms (see ``reward.shaping``).

All functions are module-level, so they can be sent to reward worker processes.
"""

from __future__ import annotations

import json
import re
import threading
from decimal import Decimal, InvalidOperation
from functools import lru_cache

from rlplug.plugin import hookimpl

__all__ = [
    "gsm8k",
    "math_verify",
    "reasoning_gym",
    "length_penalty",
    "format_reward",
    "extract_hash_answer",
    "extract_tagged_answer",
    "extract_answer_text",
    "parse_number",
    "too_costly_to_evaluate",
]

# ---------------------------------------------------------------------------- extraction helpers

# a number: thousands-grouped ("1,000,000") or plain digits, optional decimals; or ".5"
_NUM = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+"
# a sign only when it is not the binary operator of "10-2" (no digit/letter/dot right before it)
_SIGNED = rf"(?:(?<![\w.])[-+\u2212])?(?:{_NUM})"
# "#### <number>": spaces/tabs, an optional "$" or "**" (markdown bold), a sign, the number
_STRICT = re.compile(rf"####[ \t]*(?:\*\*)?[ \t]*\$?[ \t]*([-+\u2212]?[ \t]*\$?(?:{_NUM}))")
_FLEX = re.compile(_SIGNED)
_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def parse_number(text: str | None) -> Decimal | None:
    """``text`` as an exact number, tolerating ``,`` separators, ``$``, ``+``, spaces, a trailing
    period and the unicode minus; None when it is not a number (``"72.0"`` -> ``Decimal("72.0")``,
    equal to ``Decimal("72")``)."""
    if text is None:
        return None
    s = str(text).strip().replace(",", "").replace("$", "").replace(" ", "").replace("\u2212", "-")
    s = s.rstrip(".") if len(s) > 1 else s
    if s.startswith("+"):
        s = s[1:]
    if not s or not re.fullmatch(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?", s):
        return None
    try:
        return Decimal(s)
    except InvalidOperation:
        return None


def extract_hash_answer(solution_str: str, method: str = "strict") -> str | None:
    """The predicted number as text, or None.

    ``strict`` (verl's default): the last ``#### <number>`` in the response (``####  $1,000.``
    gives ``"1000"``); text after ``####`` that is not a number gives None. ``flexible``: the last
    number anywhere in the response. Commas and ``$`` are removed; a leading ``-`` is kept.
    """
    if method == "strict":
        matches = _STRICT.findall(solution_str)
    elif method == "flexible":
        matches = _FLEX.findall(solution_str)
    else:
        raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}.")
    if not matches:
        return None
    return re.sub(r"[\s,$+]", "", matches[-1]).replace("\u2212", "-")


def extract_tagged_answer(solution_str: str) -> str | None:
    """The stripped content of the last ``<answer>...</answer>``, or None."""
    matches = _TAG.findall(solution_str)
    return matches[-1].strip() if matches else None


def extract_answer_text(solution_str: str) -> str | None:
    """Free-form answer text: the last ``<answer>`` tag's content if present, else the rest of the
    line after the last ``####`` (a trailing period and surrounding ``**``/``$`` removed), else None."""
    tagged = extract_tagged_answer(solution_str)
    if tagged is not None:
        return tagged
    pos = solution_str.rfind("####")
    if pos < 0:
        return None
    line = solution_str[pos + 4 :].strip().split("\n", 1)[0].strip()
    line = line.strip("*").strip()
    if len(line) > 1 and line.startswith("$") and line.endswith("$"):
        line = line[1:-1].strip()
    if len(line) > 1 and line.endswith("."):
        line = line[:-1].rstrip()
    return line


def _numbers_equal(pred: str | None, ground_truth: str) -> bool:
    if pred is None:
        return False
    a, b = parse_number(pred), parse_number(ground_truth)
    if a is not None and b is not None:
        return a == b
    return pred.strip() == str(ground_truth).strip()


# ---------------------------------------------------------------------------- gsm8k


def gsm8k(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict | None = None,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> dict:
    """GSM8K-style correctness: the answer after ``####`` equals the ground truth as a number.

    verl: ``verl/utils/reward_score/gsm8k.py::compute_score``. ``method="strict"`` reads the last
    ``#### <number>``; ``"flexible"`` the last number in the response. Returns
    ``{"score": score if correct, format_score if a number was extracted but wrong, else 0.0,
    "acc": 1.0 or 0.0, "format": ..., "correct_unformatted": ..., "pred": ...}``, ``pred`` (only when a number
    was extracted) being the extracted answer as a canonical number string (``"72.0"`` -> ``"72"``), verl's key
    for validation's majority vote (``maj@N``). ``format`` and ``correct_unformatted`` are diagnostics
    whatever the ``method`` (they do not change the score): ``format`` is 1.0 when the response
    has a ``#### <number>`` answer line, ``correct_unformatted`` 1.0 when it has none but its last
    number is the right answer. Their batch means (``critic/format/mean``,
    ``critic/correct_unformatted/mean``; ``val-aux/<source>/format/mean@N`` in validation) show a
    policy drifting away from the answer format within a few steps. Differs from verl: numbers are
    compared as numbers (``72.0 == 72``, ``1,000 == 1000``), spaces/``$``/``**`` after ``####``
    are tolerated, and in ``10-2`` the ``-`` is an operator, not a sign; verl returns a float.
    """
    pred = extract_hash_answer(solution_str, method)
    strict = pred if method == "strict" else extract_hash_answer(solution_str, "strict")
    formatted = strict is not None
    diagnostics: dict[str, float | str] = {
        "format": 1.0 if formatted else 0.0,
        "correct_unformatted": 0.0
        if formatted
        else float(_numbers_equal(extract_hash_answer(solution_str, "flexible"), ground_truth)),
    }
    if pred is not None:  # the extracted answer, one spelling per number ("72.0", "72" -> "72"): validation's maj@N
        number = parse_number(pred)
        diagnostics["pred"] = format(number.normalize(), "f") if number is not None else pred
    if _numbers_equal(pred, ground_truth):
        return {"score": float(score), "acc": 1.0, **diagnostics}
    return {"score": float(format_score) if pred is not None else 0.0, "acc": 0.0, **diagnostics}


def _validate_gsm8k(kwargs: dict) -> None:
    method = kwargs.get("method", "strict")
    if method not in ("strict", "flexible"):
        raise ValueError(f"reward.kwargs.gsm8k.method must be 'strict' or 'flexible', got {method!r}.")


gsm8k.validate_kwargs = _validate_gsm8k  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------- math_verify

# Expressions whose exact value sympy would compute for minutes (big-integer arithmetic in C,
# which holds the GIL: no thread or signal timeout can stop it): a power tower with a numeric
# inner base (``9^{9^9}``, ``9**9**9``), exponents with more than 6 digits in all
# (``9^{9999999}``, ``(9^{999})^{9999}``), a factorial of a 6+ digit number or of a power.
_POW_OP = r"(?:\^|\*\*)"
_TOWER = re.compile(rf"{_POW_OP}\s*(?:\{{\s*\d[\d,.]*\s*{_POW_OP}|\(\s*\d[\d,.]*\s*{_POW_OP}|\d[\d,.]*\s*{_POW_OP})")
_EXPONENT = re.compile(rf"{_POW_OP}\s*[{{(]?\s*(\d[\d,]*)")
_BIG_FACTORIAL = re.compile(r"(?:\d{6,}|\{\s*\d{6,}\s*\}|\([^()]*(?:\^|\*\*)[^()]*\))\s*!")
_MAX_EXPONENT_DIGITS = 6


def too_costly_to_evaluate(text: str) -> bool:
    """Whether ``text`` holds arithmetic whose exact value is too large to compute.

    Flags a power tower with a numeric inner base (``9^{9^9}``, ``9**9**9``), exponent literals
    with more than 6 digits in all (``9^{9999999}``, ``(9^{999})^{9999}``) and a factorial of a
    6+ digit number or of a power (``(10^9)!``). A cheap regex screen (a heuristic, not a
    bound) run before math-verify parses a prediction or a ground truth: such answers score 0
    (not verifiable) instead of hanging the training process. Ordinary answers (``2^{2017}``,
    ``e^{x^2}``, ``10000!``) pass.
    """
    if _TOWER.search(text) or _BIG_FACTORIAL.search(text):
        return True
    digits = sum(len(m.group(1).replace(",", "")) for m in _EXPONENT.finditer(text))
    return digits > _MAX_EXPONENT_DIGITS


def math_verify(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict | None = None,
    timeout_s: float | None = 5,
) -> dict:
    """Correctness by math-verify (``math_verify.parse`` / ``verify``; verl's ``math_verify.compute_score``).

    The prediction is the last ``<answer>`` tag's content, else the text after the last ``####``,
    else the whole response (math-verify then finds a ``\\boxed{}`` or the last expression). The
    ground truth is parsed as ``\\boxed{ground_truth}``. math-verify's own timeouts use
    ``signal.alarm`` and work only on a main thread: they are used (``timeout_s`` seconds) when
    this runs on the main thread and turned off otherwise (the reward manager then guards time).
    Returns ``{"score": 1.0/0.0, "acc": same}``. Answers (or ground truths) that
    :func:`too_costly_to_evaluate` flags (power towers, huge exponents or factorials) score 0
    without being parsed: evaluating them would hang the process beyond any timeout's reach.
    """
    from math_verify import parse, verify  # deferred: math_verify

    timeout = timeout_s if threading.current_thread() is threading.main_thread() else None
    timeout = int(max(1, round(timeout))) if timeout else None
    candidate = extract_answer_text(solution_str)
    gt = str(ground_truth).strip()
    if too_costly_to_evaluate(candidate if candidate is not None else solution_str) or too_costly_to_evaluate(gt):
        return {"score": 0.0, "acc": 0.0}  # e.g. 9^{9^{9}}: sympy would compute it for minutes
    gold_text = gt if ("\\boxed" in gt or "$" in gt) else "\\boxed{" + gt + "}"
    gold = parse(gold_text, parsing_timeout=timeout) or parse(gt, parsing_timeout=timeout)
    pred = parse(candidate if candidate is not None else solution_str, parsing_timeout=timeout)
    if candidate is not None and not pred:
        pred = parse(f"${candidate}$", parsing_timeout=timeout)
    ok = bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=timeout)
    return {"score": 1.0 if ok else 0.0, "acc": 1.0 if ok else 0.0}


# ---------------------------------------------------------------------------- reasoning_gym

_COUNTDOWN_SAFE = re.compile(r"[\d\s+\-*/().]+")


@lru_cache(maxsize=64)
def _rg_dataset(task: str, config_json: str):
    import reasoning_gym  # deferred: reasoning_gym

    config = json.loads(config_json) if config_json else {}
    config = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}
    try:
        return reasoning_gym.create_dataset(task, seed=0, size=1, **config)
    except Exception:  # the scorer rarely depends on the config: fall back to the task's defaults
        return reasoning_gym.create_dataset(task, seed=0, size=1)


def _rg_entry(data_source: str, ground_truth: str, extra_info: dict | None, task: str | None) -> tuple[str, dict, str]:
    extra = dict(extra_info or {})
    task = task or extra.get("rg_task") or data_source
    meta_json = extra.get("rg_metadata")
    metadata = json.loads(meta_json) if isinstance(meta_json, str) and meta_json else dict(extra.get("metadata") or {})
    answer = extra.get("answer")
    gt_obj = None
    if isinstance(ground_truth, str) and ground_truth.lstrip().startswith("{"):
        try:
            gt_obj = json.loads(ground_truth)
        except json.JSONDecodeError:
            gt_obj = None
    if isinstance(gt_obj, dict):
        metadata.update({k: v for k, v in gt_obj.items() if k not in ("answer", "question")})
        answer = gt_obj.get("answer", answer)
    elif answer is None:
        answer = ground_truth
    entry = {
        "question": extra.get("question", ""),
        "answer": "" if answer is None else str(answer),
        "metadata": metadata,
    }
    return task, entry, extra.get("rg_config") or ""


def reasoning_gym(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict | None = None,
    partial_credit: bool = False,
    task: str | None = None,
) -> dict:
    """Score with the reasoning-gym task's own ``score_answer``.

    The task is ``task`` (kwarg), else ``extra_info["rg_task"]``, else ``data_source``. The entry
    is rebuilt from ``extra_info`` (``question``, ``answer``, ``rg_metadata`` JSON, ``rg_config``
    JSON, as written by ``rlplug data prepare``) and ``ground_truth`` (a JSON object, e.g.
    countdown's ``{"numbers": [...], "target": N}``, is merged into the metadata; a plain string
    is the answer). The answer is the last ``<answer>...</answer>`` content, else the rest of the
    line after the last ``####``; none gives 0. For countdown, an answer with characters other
    than digits, ``+ - * / ( ) .`` and spaces, or with ``**``, scores 0 without being evaluated
    (sympy would evaluate ``9**9**9``). Scorers give partial credit (e.g. 0.01 for any answer);
    only an exact 1.0 counts unless ``partial_credit=True``. Returns ``{"score", "acc"}``;
    errors from the scorer propagate (the reward manager counts them).
    """
    task_name, entry, config_json = _rg_entry(data_source, ground_truth, extra_info, task)
    answer = extract_answer_text(solution_str)
    if answer is None or not answer.strip():
        return {"score": 0.0, "acc": 0.0}
    if task_name == "countdown" and (len(answer) > 200 or "**" in answer or not _COUNTDOWN_SAFE.fullmatch(answer)):
        return {"score": 0.0, "acc": 0.0}
    from reasoning_gym.factory import DATASETS  # deferred: reasoning_gym

    if task_name not in DATASETS:
        raise ValueError(
            f"'{task_name}' is not a reasoning-gym task (taken from the task kwarg, extra_info['rg_task'] or "
            "data_source); set reward.kwargs.reasoning_gym.task=<task> or write rows with 'rlplug data prepare'."
        )
    raw = float(_rg_dataset(task_name, config_json).score_answer(answer, entry))
    acc = 1.0 if raw == 1.0 else 0.0
    return {"score": raw if partial_credit else acc, "acc": acc}


# ---------------------------------------------------------------------------- shaping


def length_penalty(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict | None = None,
    target_chars: int = 400,
    scale_chars: float = 400.0,
    min_value: float = -1.0,
) -> float:
    """Shaping: ``max(min_value, -max(0, len(solution_str) - target_chars) / scale_chars)``.

    Lengths in characters (the reward contract has no tokenizer). 0 up to ``target_chars``,
    then linearly negative, floored at ``min_value``.
    """
    if scale_chars <= 0:
        raise ValueError(f"reward.kwargs.length_penalty.scale_chars must be > 0, got {scale_chars}.")
    return max(float(min_value), -max(0, len(solution_str) - int(target_chars)) / float(scale_chars))


def format_reward(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict | None = None,
    require_number: bool = True,
) -> float:
    """Shaping (registered as ``format``): 1.0 when the response gives its answer as ``#### <answer>``.

    With ``require_number`` (default) the strict gsm8k extraction must find a number after
    ``####``; otherwise any non-empty text after the last ``####`` counts. Correctness is not checked.
    """
    if require_number:
        return 1.0 if extract_hash_answer(solution_str, "strict") is not None else 0.0
    pos = solution_str.rfind("####")
    return 1.0 if pos >= 0 and solution_str[pos + 4 :].strip() else 0.0


@hookimpl
def register_reward_functions(register):
    register("gsm8k", gsm8k)
    register("math_verify", math_verify)
    register("reasoning_gym", reasoning_gym)
    register("length_penalty", length_penalty)
    register("format", format_reward)
