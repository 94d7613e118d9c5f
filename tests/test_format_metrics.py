"""Collapse detection: the share of responses with the answer format, in training and validation.

Issue 15's GRPO collapse (held-out strict accuracy 6.5% -> 0% while the flexible term rose: the
policy answered ``2 + 3 = 5`` and dropped the ``#### 5`` line) shows in these metrics within a few
steps: ``critic/format/mean`` falls and ``critic/correct_unformatted/mean`` rises.
"""

from __future__ import annotations

import pytest

from rlplug.contracts.registry import get_registry
from rlplug.rewards.manager import RewardManager
from rlplug.run.metrics import ScoredResponse, validation_metrics


def test_the_reward_manager_passes_the_format_diagnostics_on_as_components():
    manager = RewardManager(
        {
            "reward_fn_map": {"basic_arithmetic": "gsm8k"},
            "shaping": [{"name": "gsm8k", "weight": 0.5, "kwargs": {"method": "flexible"}}],
        },
        registry=get_registry(),
    )
    rows = [{"data_source": "basic_arithmetic", "ground_truth": "5"}] * 4
    responses = ["2 + 3 = 5\n#### 5", "2 + 3 = 5", "2 + 3 = 6", "#### 6"]
    scores, extra, _ = manager.score(rows, responses)
    assert scores == [1.5, 0.5, 0.0, 0.0]  # strict + 0.5 x flexible: correct-but-unformatted earns 0.5
    assert extra["format"] == [1.0, 0.0, 0.0, 1.0]
    assert extra["correct_unformatted"] == [0.0, 1.0, 0.0, 0.0]


def test_validation_reports_the_format_rate_per_data_source():
    row_a, row_b = {"data_source": "a"}, {"data_source": "b"}
    scored = [
        ScoredResponse(row_a, 0, "", 1.5, 1.0, True, {"format": 1.0, "correct_unformatted": 0.0}),
        ScoredResponse(row_a, 1, "", 0.5, 0.0, True, {"format": 0.0, "correct_unformatted": 1.0}),
        ScoredResponse(row_a, 2, "", 0.5, 0.0, True, {"format": 0.0, "correct_unformatted": 1.0}),
        ScoredResponse(row_b, 3, "", 1.0, 1.0, True, {}),  # a reward without the diagnostics
    ]
    m = validation_metrics(scored, n=1)
    assert m["val-core/a/acc/mean@1"] == pytest.approx(1 / 3)
    assert m["val-aux/a/format/mean@1"] == pytest.approx(1 / 3)
    assert m["val-aux/a/correct_unformatted/mean@1"] == pytest.approx(2 / 3)
    assert not any(k.startswith("val-aux/b/format") for k in m)
