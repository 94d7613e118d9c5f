"""verl's validation statistics: ``std@N``, bootstrap ``best@k`` / ``worst@k`` / ``maj@k`` (issue 19, item 2).

verl's ``process_validation_metrics`` (``verl/trainer/ppo/metric_utils.py``) computes, per prompt, the mean
and population std of its ``N`` values, and for ``k`` in 2, 4, ..., ``N`` the mean and std over 1000 bootstrap
subsets of ``k`` values (drawn with replacement after ``np.random.seed(42)``) of the subset's max, min and
majority-vote value (``calc_maj_val``: the most common ``pred``, ties to the first seen, its first value);
then averages over prompts. Before this, rlplug reported ``mean@N`` and an exact ``best@N`` only.
"""

from __future__ import annotations

import numpy as np
import pytest

from rlplug.run.evaluate import majority_values, prompt_statistics, source_statistics, subset_sizes
from rlplug.run.metrics import ScoredResponse, validation_metrics


def test_subset_sizes_are_verls_powers_of_two_then_n():
    assert subset_sizes(1) == []
    assert subset_sizes(2) == [2]
    assert subset_sizes(6) == [2, 4, 6]
    assert subset_sizes(8) == [2, 4, 8]


def test_mean_and_std_are_exact():
    # values 1, 0, 0, 1: mean 0.5; population std sqrt(mean((x - 0.5)^2)) = 0.5
    out = prompt_statistics([1.0, 0.0, 0.0, 1.0])
    assert out["mean@4"] == 0.5 and out["std@4"] == 0.5
    assert prompt_statistics([0.3]) == {"mean@1": 0.3}  # one response: no spread, no bootstrap


def test_constant_values_have_no_bootstrap_spread():
    out = prompt_statistics([0.7, 0.7, 0.7], ["a", "b", "c"])
    for k in (2, 3):
        for stat in ("best", "worst", "maj"):
            assert out[f"{stat}@{k}/mean"] == pytest.approx(0.7) and out[f"{stat}@{k}/std"] == pytest.approx(
                0.0, abs=1e-12
            )


def test_best_and_worst_of_two_follow_the_bootstrap_draws():
    # values [0, 1]: a subset of 2 drawn with replacement has max 1 unless both draws are index 0 (p = 1/4),
    # so best@2/mean -> 3/4 and worst@2/mean -> 1/4; and max + min = the sum of the two draws, so
    # best + worst = 2 x the mean of the drawn values (about 1).
    out = prompt_statistics([0.0, 1.0])
    idx = np.random.RandomState(42).choice(2, size=(1000, 2), replace=True)  # verl's draws: np.random.seed(42)
    both_zero = float(np.mean((idx == 0).all(axis=1)))
    assert out["best@2/mean"] == pytest.approx(1.0 - both_zero)
    assert out["worst@2/mean"] == pytest.approx(float(np.mean((idx == 1).all(axis=1))))
    assert out["best@2/mean"] == pytest.approx(0.75, abs=0.05)  # 1000 draws: 3.5 sigma of 0.0137
    assert out["best@2/mean"] + out["worst@2/mean"] == pytest.approx(2 * float(idx.mean()))
    # std of a 0/1 max with P(1) = q: sqrt(q (1 - q))
    q = out["best@2/mean"]
    assert out["best@2/std"] == pytest.approx(np.sqrt(q * (1 - q)))


def test_majority_vote_ties_go_to_the_first_answer_seen():
    # counts: [A, B, B] -> B has 2 votes, its first value is 0.2; [A, B] tie -> A (seen first) -> 1.0;
    # [C, A, A, C] tie of 2 and 2 -> C (seen first), its first value 0.5
    values = np.array([[1.0, 0.2, 0.3], [1.0, 0.0, 0.0]])
    votes = np.array([[0, 1, 1], [0, 1, 2]])
    assert majority_values(values, votes).tolist() == [0.2, 1.0]
    assert majority_values(np.array([[0.5, 1.0, 1.0, 0.0]]), np.array([[2, 0, 0, 2]])).tolist() == [0.5]
    # maj@2 of answers [A, B] with values [1, 0]: every pair's majority is its first draw (a tie or a
    # repeat), so maj@2/mean is the mean value of the first column of the draws
    out = prompt_statistics([1.0, 0.0], ["A", "B"])
    idx = np.random.RandomState(42).choice(2, size=(1000, 2), replace=True)
    assert out["maj@2/mean"] == pytest.approx(float(np.mean(idx[:, 0] == 0)))


def test_majority_of_three_with_two_right_answers():
    # answers [7, 7, 9] correct [1, 1, 0]: 3 draws with replacement have majority 7 iff at least 2 draws
    # are a 7 (p = 2/3 each): 3 (2/3)^2 (1/3) + (2/3)^3 = 20/27 = 0.741; no answer (None) votes too
    out = prompt_statistics([1.0, 1.0, 0.0], ["7", "7", None])
    assert out["maj@3/mean"] == pytest.approx(20 / 27, abs=0.05)
    assert "maj@2/mean" in out and "worst@3/mean" in out


def test_source_statistics_names_and_sections_like_verl():
    # 2 prompts x 2 responses; core variable: mean@2, best@2/*, maj@2/* in val-core; std@2 and worst@2/* aux
    out = source_statistics("math/acc", [0, 0, 1, 1], [1.0, 0.0, 1.0, 1.0], ["3", "4", "5", "5"], core=True)
    assert out["val-core/math/acc/mean@2"] == pytest.approx(0.75)  # (0.5 + 1) / 2
    assert out["val-aux/math/acc/std@2"] == pytest.approx(0.25)  # (0.5 + 0) / 2
    assert {"/".join(k.split("/")[:3]) for k in out} == {"val-core/math/acc", "val-aux/math/acc"}
    core = sorted(k.split("/", 3)[3] for k in out if k.startswith("val-core/"))
    assert core == ["best@2/mean", "best@2/std", "maj@2/mean", "maj@2/std", "mean@2"]
    # prompt 1 is always right: its maj and best are 1 with no spread; prompt 0 as in the test above
    p0 = prompt_statistics([1.0, 0.0], ["3", "4"])
    assert out["val-core/math/acc/maj@2/mean"] == pytest.approx((p0["maj@2/mean"] + 1.0) / 2)
    # no answers reported (None everywhere): no maj@
    assert not any("maj@" in k for k in source_statistics("m/acc", [0, 0], [1.0, 0.0], [None, None], core=True))


def test_validation_metrics_reports_the_statistics_with_the_extracted_answers():
    row = {"data_source": "gsm8k"}
    scored = [
        ScoredResponse(row, 0, "#### 7", 1.0, 1.0, True, {}, "7"),
        ScoredResponse(row, 0, "#### 7", 1.0, 1.0, True, {}, "7"),
        ScoredResponse(row, 0, "#### 9", 0.0, 0.0, True, {}, "9"),
        ScoredResponse(row, 0, "none", 0.0, 0.0, True, {}, None),
    ]
    m = validation_metrics(scored, n=4)
    assert m["val-core/gsm8k/acc/mean@4"] == 0.5
    assert m["val-core/gsm8k/acc/best@4"] == 1.0  # rlplug's exact pass@4, kept next to verl's estimate
    assert m["val-aux/gsm8k/acc/std@4"] == 0.5
    assert m["val-core/gsm8k/acc/maj@4/mean"] == pytest.approx(
        prompt_statistics([1.0, 1.0, 0.0, 0.0], ["7", "7", "9", None])["maj@4/mean"]
    )
    assert "val-aux/gsm8k/acc/maj@2/mean" in m and "val-aux/gsm8k/reward/maj@4/mean" in m


def test_gsm8k_reports_the_extracted_answer_and_validation_votes_on_it():
    from rlplug.plugins.rewards.rules import gsm8k

    # "72.0" and "72" are one answer for the vote
    assert gsm8k("gsm8k", "#### 72.0", "72")["pred"] == "72" and gsm8k("gsm8k", "#### 1,000", "7")["pred"] == "1000"
    assert "pred" not in gsm8k("gsm8k", "no number", "72")


def test_reward_manager_passes_the_pred_to_validation():
    from rlplug.rewards.manager import PRED, RewardManager

    section = {"reward_fn_map": {"gsm8k": "gsm8k"}, "default": None, "kwargs": {}, "shaping": [], "num_workers": 0}
    with RewardManager(section) as manager:
        _, extra, _ = manager.score(
            [{"data_source": "gsm8k", "ground_truth": "7"}] * 2, ["#### 7.0", "x"], report_acc=True
        )
        assert extra[PRED] == ["7", None]
        _, extra, _ = manager.score([{"data_source": "gsm8k", "ground_truth": "7"}], ["#### 7"])
        assert PRED not in extra  # training: numbers only


VERL_MIRROR = "/work/.mirror/verl-project+verl/repo"


def _verl_functions() -> dict:
    """verl's ``bootstrap_metric``, ``calc_maj_val`` and ``process_validation_metrics`` at commit 1dda039b9, read
    from a local git mirror of verl (the test skips without one); only these functions are compiled, the module's
    imports (torch, verl) are not needed."""
    import ast
    import subprocess
    from collections import defaultdict
    from collections.abc import Callable
    from functools import partial
    from typing import Any

    try:
        src = subprocess.run(
            ["git", "-C", VERL_MIRROR, "show", "1dda039b9:verl/trainer/ppo/metric_utils.py"],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        pytest.skip(f"no verl mirror at {VERL_MIRROR}")
    names = {"bootstrap_metric", "calc_maj_val", "process_validation_metrics"}
    nodes = [n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name in names]
    env: dict = {"np": np, "defaultdict": defaultdict, "partial": partial, "Any": Any, "Callable": Callable}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), "verl/trainer/ppo/metric_utils.py", "exec"), env)
    return env


def test_equal_to_verls_process_validation_metrics():
    verl = _verl_functions()
    rng = np.random.default_rng(0)
    prompts, n = 5, 6  # subset sizes 2, 4, 6
    uids = [p for p in range(prompts) for _ in range(n)]
    acc = rng.integers(0, 2, prompts * n).astype(float).tolist()
    score = rng.normal(size=prompts * n).tolist()
    pred = [str(x) for x in rng.integers(0, 3, prompts * n)]
    ref = verl["process_validation_metrics"](
        ["ds"] * len(uids), [str(u) for u in uids], {"acc": acc, "reward": score, "pred": pred}
    )
    mine = source_statistics("ds/acc", uids, acc, pred, core=True)
    mine.update(source_statistics("ds/reward", uids, score, pred, core=False))
    for var in ("acc", "reward"):
        for metric, value in ref["ds"][var].items():
            (key,) = [k for k in mine if k.endswith(f"/ds/{var}/{metric}")]
            assert mine[key] == pytest.approx(value, abs=1e-12), key
    assert len(mine) == sum(len(ref["ds"][v]) for v in ("acc", "reward"))
