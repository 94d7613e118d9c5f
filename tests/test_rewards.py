"""The packaged reward functions: answer extraction edge cases and scores (hand-checked values)."""

from __future__ import annotations

import json
import threading
import time

import pytest

import rlplug
from rlplug.plugins.rewards.rules import (
    extract_answer_text,
    extract_hash_answer,
    format_reward,
    gsm8k,
    length_penalty,
    math_verify,
    parse_number,
    reasoning_gym,
)

DS = "openai/gsm8k"


# ---------------------------------------------------------------------------- registry


def test_every_reward_is_registered_through_the_entry_point():
    names = rlplug.get_registry().names("reward_function")
    for name in ("gsm8k", "math_verify", "reasoning_gym", "length_penalty", "format"):
        assert name in names
    assert rlplug.get_registry().get("reward_function", "format") is format_reward
    assert rlplug.get_registry().get("reward_function", "gsm8k") is gsm8k


# ---------------------------------------------------------------------------- gsm8k


@pytest.mark.parametrize(
    "response, gt, expected_acc",
    [
        ("so 9 * 8 = 72\n#### 72", "72", 1.0),
        ("#### 72.0", "72", 1.0),  # compared as numbers
        ("#### 72", "72.00", 1.0),
        ("#### 1,000", "1000", 1.0),  # thousands separator
        ("#### 1000", "1,000", 1.0),
        ("#### 1,234,567", "1234567", 1.0),
        ("#### -5", "-5", 1.0),  # negative
        ("#### 5", "-5", 0.0),  # sign matters
        ("#### \u22125", "-5", 1.0),  # unicode minus is a minus
        ("#### $18.", "18", 1.0),  # dollar and trailing period
        ("#### 72 apples in total.", "72", 1.0),  # trailing text
        ("####    72   ", "72", 1.0),  # whitespace
        ("####\t72", "72", 1.0),
        ("#### **72**", "72", 1.0),  # markdown bold
        ("#### 0.5", ".5", 1.0),  # decimals
        ("#### 2.50", "2.5", 1.0),
        ("#### 720", "72", 0.0),  # no substring credit
        ("#### 3\nwait, no\n#### 4", "4", 1.0),  # several ####: the last one
        ("#### 3\nwait, no\n#### 4", "3", 0.0),
        ("The answer is 72.", "72", 0.0),  # strict: no ####
        ("#### The answer is 72", "72", 0.0),  # strict: text after ####
        ("", "72", 0.0),
    ],
)
def test_gsm8k_strict(response, gt, expected_acc):
    out = gsm8k(DS, response, gt)
    assert (out["score"], out["acc"]) == (expected_acc, expected_acc)


@pytest.mark.parametrize(
    "response, gt, expected",
    [
        ("The answer is 72.", "72", 1.0),  # last number anywhere
        ("#### The answer is 72", "72", 1.0),
        ("10-2 = 8", "8", 1.0),  # "-2" of "10-2" is not the last number: 8 is
        ("10-2", "2", 1.0),  # "-" between digits is an operator, not a sign
        ("3 - 5 = -2", "-2", 1.0),  # a real negative
        ("costs $1,500.", "1500", 1.0),
        ("first 7 then 9", "7", 0.0),
        ("no digits here", "7", 0.0),
    ],
)
def test_gsm8k_flexible(response, gt, expected):
    assert gsm8k(DS, response, gt, method="flexible")["score"] == expected


def test_gsm8k_format_score_and_score_like_verl():
    # wrong but well-formed answer -> format_score; no answer at all -> 0 (verl's compute_score)
    diag = {"format": 1.0, "correct_unformatted": 0.0}
    assert gsm8k(DS, "#### 71", "72", format_score=0.1) == {"score": 0.1, "acc": 0.0, **diag, "pred": "71"}
    assert gsm8k(DS, "no answer", "72", format_score=0.1) == {"score": 0.0, "acc": 0.0, **diag, "format": 0.0}
    assert gsm8k(DS, "#### 72", "72", score=2.0) == {"score": 2.0, "acc": 1.0, **diag, "pred": "72"}


@pytest.mark.parametrize(
    "response, method, fmt, unformatted",
    [
        ("3 + 4 = 7\n#### 7", "strict", 1.0, 0.0),  # right and formatted
        ("3 + 4 = 7", "strict", 0.0, 1.0),  # right but no answer line: the GRPO collapse of issue 15
        ("3 + 4 = 7", "flexible", 0.0, 1.0),  # the diagnostics do not depend on the method
        ("3 + 4 = 8", "strict", 0.0, 0.0),  # wrong, unformatted
        ("#### 8", "flexible", 1.0, 0.0),  # wrong, formatted
        ("#### seven", "strict", 0.0, 0.0),  # no number after ####: not the format
    ],
)
def test_gsm8k_reports_the_format_and_correct_but_unformatted_answers(response, method, fmt, unformatted):
    out = gsm8k(DS, response, "7", method=method)
    assert (out["format"], out["correct_unformatted"]) == (fmt, unformatted)


def test_gsm8k_rejects_unknown_method():
    with pytest.raises(ValueError, match="strict.*flexible"):
        gsm8k(DS, "#### 1", "1", method="lenient")
    with pytest.raises(ValueError, match="reward.kwargs.gsm8k.method"):
        gsm8k.validate_kwargs({"method": "lenient"})


def test_extraction_helpers():
    assert extract_hash_answer("#### $1,000.", "strict") == "1000"
    assert extract_hash_answer("#### -3.5", "strict") == "-3.5"
    assert extract_hash_answer("nothing", "strict") is None
    assert extract_hash_answer("a 1 b 2,000 c", "flexible") == "2000"
    assert parse_number(" +1,000.00 ") == parse_number("1000")
    assert parse_number("abc") is None and parse_number("1.2.3") is None
    assert extract_answer_text("<answer> 5 </answer> then <answer>6</answer>") == "6"
    assert extract_answer_text("work\n#### (1 + 2) * 3.\nmore text") == "(1 + 2) * 3"
    assert extract_answer_text("#### **7**") == "7"
    assert extract_answer_text("no answer") is None


# ---------------------------------------------------------------------------- math_verify


@pytest.mark.parametrize(
    "response, gt, expected",
    [
        ("<answer>72</answer>", "72", 1.0),
        ("<answer>73</answer>", "72", 0.0),
        ("work... #### 1/2", "0.5", 1.0),  # #### handled, fraction == decimal
        ("#### 0.5", "\\frac{1}{2}", 1.0),
        ("The answer is $\\boxed{72}$.", "72", 1.0),
        ("<answer>\\frac{3}{4}</answer>", "0.75", 1.0),
        ("#### 1,000", "1000", 1.0),
        ("I do not know.", "72", 0.0),
        ("", "72", 0.0),
    ],
)
def test_math_verify(response, gt, expected):
    assert math_verify("math", response, gt) == {"score": expected, "acc": expected}


def test_math_verify_works_off_the_main_thread():
    # math-verify's signal-based timeouts raise in threads; the reward turns them off there
    out = {}
    t = threading.Thread(target=lambda: out.update(r=math_verify("math", "#### 72", "72")))
    t.start()
    t.join(30)
    assert out["r"] == {"score": 1.0, "acc": 1.0}


# ---------------------------------------------------------------------------- reasoning_gym

CD_GT = json.dumps({"numbers": [9, 23, 15], "target": 17})


@pytest.mark.parametrize(
    "response, expected_acc",
    [
        ("23 - 15 = 8, 8 + 9 = 17\n#### 23 - 15 + 9", 1.0),
        ("<answer>23 - 15 + 9</answer>", 1.0),
        ("#### 23 - 15 + 9.", 1.0),  # trailing period
        ("#### (23 - 15) + 9\nDone.", 1.0),  # rest of the line only
        ("#### 23 + 15 - 9", 0.0),  # = 29
        ("#### 23 - 6", 0.0),  # wrong numbers
        ("#### 9**9**9**9", 0.0),  # never evaluated
        ("#### import os", 0.0),
        ("23 - 15 + 9", 0.0),  # no #### and no <answer>: no answer
    ],
)
def test_reasoning_gym_countdown_from_ground_truth_alone(response, expected_acc):
    reasoning_gym("countdown", "#### 1", CD_GT, None)  # imports reasoning_gym (seconds when loaded) before the clock
    t0 = time.perf_counter()
    out = reasoning_gym("countdown", response, CD_GT, None)
    assert out == {"score": expected_acc, "acc": expected_acc}
    assert time.perf_counter() - t0 < 5


def test_reasoning_gym_partial_credit_only_on_request():
    # countdown's scorer gives 0.05 for an expression with the right numbers and a wrong value
    assert reasoning_gym("countdown", "#### 23 + 15 - 9", CD_GT, None) == {"score": 0.0, "acc": 0.0}
    assert reasoning_gym("countdown", "#### 23 + 15 - 9", CD_GT, None, partial_credit=True) == {
        "score": 0.05,
        "acc": 0.0,
    }
    # basic_arithmetic's default scorer: oracle "3" inside "3 apples" -> len("3")/len("3 apples") = 1/8
    extra = {"rg_task": "basic_arithmetic", "question": "Calculate 1 + 2.", "answer": "3"}
    assert reasoning_gym("basic_arithmetic", "#### 3 apples", "3", extra) == {"score": 0.0, "acc": 0.0}
    assert reasoning_gym("basic_arithmetic", "#### 3 apples", "3", extra, partial_credit=True) == {
        "score": 0.125,
        "acc": 0.0,
    }
    assert reasoning_gym("basic_arithmetic", "#### 3", "3", extra) == {"score": 1.0, "acc": 1.0}


def test_reasoning_gym_numeric_tasks_and_sign():
    # chain_sum compares decimals: -4 is right, 4 is wrong (no credit for a dropped sign)
    assert reasoning_gym("chain_sum", "#### -4", "-4", None)["acc"] == 1.0
    assert reasoning_gym("chain_sum", "#### 4", "-4", None, partial_credit=True)["score"] == 0.0
    assert reasoning_gym("gsm_symbolic", "so... #### 288", "288", None)["acc"] == 1.0


def test_reasoning_gym_unknown_task_says_how_to_fix():
    with pytest.raises(ValueError, match="not a reasoning-gym task.*reward.kwargs.reasoning_gym.task"):
        reasoning_gym("my/source", "#### 1", "1", None)
    assert reasoning_gym("my/source", "#### 1", "1", None, task="chain_sum")["acc"] == 1.0


# ---------------------------------------------------------------------------- shaping


def test_length_penalty():
    # -max(0, len - target) / scale, floored at min_value
    assert length_penalty(DS, "x" * 300, "") == 0.0
    assert length_penalty(DS, "x" * 500, "") == pytest.approx(-100 / 400)
    assert length_penalty(DS, "x" * 2000, "") == -1.0
    assert length_penalty(DS, "x" * 150, "", target_chars=100, scale_chars=10, min_value=-10) == -5.0
    with pytest.raises(ValueError, match="scale_chars"):
        length_penalty(DS, "x", "", scale_chars=0)


def test_format_reward():
    assert format_reward(DS, "work\n#### 42", "") == 1.0
    assert format_reward(DS, "#### -1,000.5", "") == 1.0
    assert format_reward(DS, "42", "") == 0.0
    assert format_reward(DS, "#### forty-two", "") == 0.0
    assert format_reward(DS, "#### forty-two", "", require_number=False) == 1.0
    assert format_reward(DS, "####   ", "", require_number=False) == 0.0
