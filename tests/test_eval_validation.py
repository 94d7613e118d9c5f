"""``rlplug eval`` and the trainer's validation agree (issue 14, item 5).

Both run :func:`rlplug.run.evaluate.score_responses` and :func:`rlplug.run.metrics.validation_metrics`: the
headline metric is ``acc`` only when the reward reports an accuracy (an ``acc`` key, or a function
declared binary), otherwise it is the score, named ``reward`` (verl's name). Before, validation
called the score ``acc`` and eval counted a response only at ``acc >= 1``, so the same checkpoint
gave ``acc/mean@1 = -0.98`` in validation and ``0.000`` in eval with a continuous reward.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _helpers import TINY_CPU_RUN, run_config

from rlplug.rewards.manager import RewardManager

# ============================================================================ the naming rule


def _scored(src: str, prompt: int, score: float, acc: float, reported: bool) -> Any:
    from rlplug.run.metrics import ScoredResponse

    return ScoredResponse({"data_source": src}, prompt, "text", score, acc, reported)


def test_acc_only_when_the_reward_reports_it_else_reward():
    from rlplug.run.metrics import core_metric, validation_metrics

    scored = [
        # "math": a reward that reports acc; 2 prompts x 2 responses
        _scored("math", 0, 1.5, 1.0, True),
        _scored("math", 0, 0.5, 0.0, True),
        _scored("math", 1, 0.0, 0.0, True),
        _scored("math", 1, 0.2, 0.0, True),
        # "style": a continuous reward (its acc is only its score)
        _scored("style", 2, -0.4, -0.4, False),
        _scored("style", 2, -0.2, -0.2, False),
        _scored("style", 3, 0.6, 0.6, False),
        _scored("style", 3, 0.2, 0.2, False),
    ]
    assert core_metric(scored[:4]) == "acc" and core_metric(scored[4:]) == "reward"
    expected = {
        # acc per prompt: mean (1+0)/2 = 0.5 and 0, best 1 and 0 -> mean@2 = 0.25, best@2 (pass@2) = 0.5
        "val-core/math/acc/mean@2": 0.25,
        "val-core/math/acc/best@2": 0.5,
        # score per prompt: mean 1.0 and 0.1, best 1.5 and 0.2 -> 0.55 and 0.85
        "val-aux/math/reward/mean@2": 0.55,
        "val-aux/math/reward/best@2": 0.85,
        # no acc reported: the score is the headline metric; per prompt mean -0.3 and 0.4, best -0.2 and 0.6
        "val-core/style/reward/mean@2": 0.05,
        "val-core/style/reward/best@2": 0.2,
    }
    got = validation_metrics(scored, n=2)  # and verl's std@2, best@2/mean ... (tests/test_validation_stats.py)
    assert {k: got[k] for k in expected} == pytest.approx(expected)
    # one response per prompt: mean@1 only (the mean over responses)
    assert validation_metrics([_scored("style", i, s, s, False) for i, s in enumerate([0.1, 0.3])], n=1) == (
        pytest.approx({"val-core/style/reward/mean@1": 0.2})
    )


def _float_reward(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if solution_str == ground_truth else 0.0


def _binary_reward(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if solution_str == ground_truth else 0.0


_binary_reward.binary = True  # type: ignore[attr-defined]


def _dict_reward(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 2.0 if solution_str == ground_truth else 0.5, "acc": float(solution_str == ground_truth)}


def _broken_reward(data_source, solution_str, ground_truth, extra_info=None):
    raise RuntimeError("boom")


_broken_reward.binary = True  # type: ignore[attr-defined]


def test_reward_manager_reports_which_responses_have_an_accuracy(rlplug_registry):
    import types

    from rlplug.rewards.manager import ACC_REPORTED

    module = types.ModuleType("acc_rewards")

    def register_reward_functions(register):
        for name, fn in [("f", _float_reward), ("b", _binary_reward), ("d", _dict_reward), ("x", _broken_reward)]:
            register(name, fn)

    import rlplug

    module.register_reward_functions = rlplug.hookimpl(register_reward_functions)  # type: ignore[attr-defined]
    assert rlplug_registry.add_plugin(module), rlplug_registry.broken
    manager = RewardManager({"reward_fn_map": {"f": "f", "b": "b", "d": "d", "x": "x"}}, registry=rlplug_registry)
    rows = [{"data_source": ds, "ground_truth": "7"} for ds in ("f", "b", "d", "d", "x")]
    scores, extra, _ = manager.score(rows, ["7", "7", "7", "8", "7"], report_acc=True)
    assert scores == [1.0, 1.0, 2.0, 0.5, 0.0]
    # a float reward reports no accuracy unless declared binary; a dict reports it with its "acc" key;
    # a failed call of a binary function is a wrong answer (acc 0.0) that still counts as reported
    assert extra[ACC_REPORTED] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert extra["acc"] == [1.0, 1.0, 1.0, 0.0, 0.0]
    # without report_acc, score() returns what it always did
    assert ACC_REPORTED not in manager.score(rows, ["7"] * 5)[1]


def test_packaged_correctness_rewards_report_acc_and_shaping_does_not():
    from rlplug.plugins.rewards.rules import gsm8k, length_penalty

    assert "acc" in gsm8k("gsm8k", "#### 7", "7")  # dict with acc: validation names it acc
    assert isinstance(length_penalty("x", "abc", "7"), float) and not getattr(length_penalty, "binary", False)


# ============================================================================ eval == validation


def test_eval_prints_the_validation_number_of_the_same_checkpoint(tmp_path: Path):
    """One training step, then validation (in the trainer) and ``rlplug eval`` (from the checkpoint)
    with a continuous reward: the same metric name and the same value."""
    from rlplug.run.evaluate import evaluate
    from rlplug.run.trainer import Trainer

    cfg = run_config(
        TINY_CPU_RUN,
        tmp_path / "run",
        # the correctness "function" is itself continuous: max(-1, -chars/50); debug=tiny adds -chars/100
        "reward.reward_fn_map.basic_arithmetic=length_penalty",
        "+reward.kwargs.length_penalty={target_chars:0,scale_chars:50.0}",
        "data.val_max_samples=4",
        "data.val_batch_size=3",  # two generate calls (3 + 1 prompts): eval must batch the same way
        "trainer.val_samples_to_log=4",
        "trainer.logger=[]",
    )
    trainer = Trainer(cfg)
    try:
        trainer.train_step()
        ckpt = trainer.save_checkpoint()
        metrics = trainer.validate()
        samples = trainer._last_val_samples
    finally:
        trainer.close()

    key = "val-core/basic_arithmetic/reward/mean@1"
    assert set(metrics) == {key}  # no "acc": the reward reports none
    # the score of each response, derived from its text: max(-1, -chars/50) + max(-100, -chars/100)
    expected = [max(-1.0, -len(s["response"]) / 50) + max(-100.0, -len(s["response"]) / 100) for s in samples]
    assert [s["score"] for s in samples] == pytest.approx(expected)
    assert metrics[key] == pytest.approx(sum(expected) / 4) and metrics[key] < 0

    (row,) = evaluate(cfg, checkpoint=str(ckpt))
    assert (row["metric"], row["name"], row["n"], row["k"]) == ("reward", key, 4, 1)
    assert row["mean"] == metrics[key] and row["best"] == metrics[key]  # same number, bit for bit
    assert row["metrics"] == metrics
    assert f"{row['mean']:.4f}" == f"{metrics[key]:.4f}"  # what both print


def test_a_multi_turn_response_is_validated_on_its_whole_return(rlplug_registry):
    """Validation scores a trajectory as it is trained: the reward's score plus the environment's step rewards
    (a TRL environment's get_reward() may be the whole reward); not for a response whose reward failed."""
    from rlplug.contracts.types import RolloutOutput
    from rlplug.run.evaluate import score_responses

    rlplug_registry.register("reward_function", "f", _float_reward)
    reward = RewardManager({"reward_fn_map": {"calc": "f"}}, registry=rlplug_registry)
    rows = [{"data_source": "calc", "prompt_ids": [1], "ground_truth": "4"} for _ in range(2)]

    def generate(chunk: list) -> RolloutOutput:
        return RolloutOutput(
            response_ids=[[5, 6], [5, 7]],
            finish_reasons=["stop", "stop"],
            prompt_index=[0, 1],
            response_masks=[[1, 1], [1, 1]],
            prompts=[[1], [1]],
            step_rewards=[[(0, 0.25), (1, 0.5)], []],
            solutions=["4", "5"],
            transcripts=[[], []],
        )

    scored = score_responses(rows, generate, lambda out: ["4", "5"], reward)
    # response 0: correct (1.0) + step rewards 0.25 + 0.5; response 1: wrong (0.0), no step reward
    assert [s.score for s in scored] == [1.75, 0.0]
