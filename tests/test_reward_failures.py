"""A reward that raises, hangs or returns NaN/None is a failure, not a score.

Failed responses are counted (``reward/failures``, ``reward/failed_samples``), left out of the
group baselines, whitening and batch statistics (advantage 0, no weight in the losses), and a
step in which every reward failed skips the update; ``trainer.max_consecutive_bad_steps`` such
steps stop the run with exit code 4 and the first error. The tiny runs are
``_helpers.TINY_CPU_RUN`` (tiny random model, CPU, fp32).
"""

from __future__ import annotations

import math
import time

import pytest
import torch
from _helpers import TINY_CPU_RUN, fit, run_config

import rlplug
from rlplug.base.exit_codes import ExitCode
from rlplug.contracts.batch import Batch, estimate_on_rows, rows_left_out
from rlplug.contracts.registry import Registry, get_registry
from rlplug.contracts.types import AdvantageEstimator, RolloutOutput
from rlplug.rewards.manager import FAILED, RewardFailureGuard, RewardManager, scored_rows
from rlplug.run.checkpoint import CheckpointManager
from rlplug.run.metrics import step_metrics
from rlplug.run.trainer import run

# ----------------------------------------------------------------------------- reward functions


def flaky(data_source, solution_str, ground_truth, extra_info=None):
    """Fails four ways, by the first character of the response; otherwise its length / 10."""
    head = solution_str[:1]
    if head == "r":
        raise RuntimeError("boom on r")
    if head == "n":
        return math.nan
    if head == "0":
        return None
    if head == "h":
        time.sleep(2.0)  # longer than the test's reward.timeout_s
    return len(solution_str) / 10.0


def always_raises(data_source, solution_str, ground_truth, extra_info=None):
    raise ValueError(f"cannot parse ground truth {ground_truth!r}")


def odd_length_raises(data_source, solution_str, ground_truth, extra_info=None):
    """Fails on responses of odd length (in characters), else scores the length / 10."""
    if len(solution_str) % 2:
        raise KeyError("odd")
    return len(solution_str) / 10.0


def _manager(fn, **cfg) -> RewardManager:
    reg = Registry(load_entry_points=False)
    reg.register("reward_function", "f", fn)
    return RewardManager({"reward_fn_map": {"src": "f"}, **cfg}, registry=reg)


def test_raise_nan_none_and_timeout_are_failed_samples_with_the_first_error():
    m = _manager(flaky, fallback_score=-1.0, timeout_s=1.0)  # "h" sleeps 2 s; others need slack when loaded
    responses = ["ok!", "r", "n", "0", "h", "fine"]
    rows = [{"data_source": "src", "ground_truth": "x"}] * len(responses)
    scores, extra, metrics = m.score(rows, responses)
    assert extra[FAILED] == [0.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    assert scores == [0.3, -1.0, -1.0, -1.0, -1.0, 0.4]  # validation still sees the fallback score
    assert metrics == {"reward/failures": 4.0, "reward/timeouts": 1.0, "reward/failed_samples": 4.0}
    assert m.last_error == "reward function 'f' on data_source=src: RuntimeError: boom on r"
    assert scored_rows(extra, 6).tolist() == [True, False, False, False, False, True]
    _, extra, _ = m.score(rows[:1], ["good"])
    assert extra[FAILED] == [0.0] and m.last_error is None


def test_a_failing_shaping_term_fails_its_sample():
    reg = Registry(load_entry_points=False)
    reg.register("reward_function", "fine", lambda data_source, solution_str, ground_truth, extra_info=None: 1.0)
    reg.register("reward_function", "odd", odd_length_raises)
    m = RewardManager({"reward_fn_map": {"src": "fine"}, "shaping": [{"name": "odd", "weight": 0.5}]}, registry=reg)
    _, extra, metrics = m.score([{"data_source": "src", "ground_truth": "x"}] * 2, ["ab", "abc"])
    assert extra[FAILED] == [0.0, 1.0] and metrics["reward/failed_samples"] == 1.0


# ----------------------------------------------------------------------------- estimators see scored rows only


def _batch(scores: list[float], index: list[int], T: int = 3) -> Batch:
    mask = torch.ones(len(scores), T)
    rewards = torch.zeros(len(scores), T)
    rewards[:, -1] = torch.tensor(scores)
    return Batch({"token_level_rewards": rewards, "response_mask": mask, "index": torch.tensor(index)})


def test_grpo_group_baseline_leaves_the_failed_response_out():
    grpo = get_registry().get("advantage_estimator", "grpo")
    # one group of four; response 2 failed (its fallback score 0.0 must not enter the baseline)
    batch = _batch([1.0, 0.0, 0.0, 1.0], [0, 0, 0, 0])
    keep = torch.tensor([True, True, False, True])
    adv, ret = estimate_on_rows(grpo, batch, {"norm_adv_by_std_in_grpo": True}, keep)
    # scored group {1, 0, 1}: mean 2/3, unbiased std sqrt(((1/3)^2 * 2 + (2/3)^2) / 2) = sqrt(1/3)
    std = math.sqrt(1.0 / 3.0)
    expected = [(1 - 2 / 3) / (std + 1e-6), (0 - 2 / 3) / (std + 1e-6), 0.0, (1 - 2 / 3) / (std + 1e-6)]
    assert adv[:, 0].tolist() == pytest.approx(expected, abs=1e-6)
    assert torch.equal(adv[2], torch.zeros(3)) and torch.equal(ret[2], torch.zeros(3))
    # with the fallback counted (the old behaviour) the group mean would be 1/2: not what we got
    plain, _ = grpo(batch.fields(), {"norm_adv_by_std_in_grpo": True})
    assert plain[0, 0].item() != pytest.approx(adv[0, 0].item(), abs=1e-3)


def test_the_estimator_is_called_on_the_scored_rows_only_and_not_at_all_when_none_is():
    seen: list[int] = []

    def recorder(data, config):
        seen.append(int(data["response_mask"].shape[0]))
        return data["token_level_rewards"] + 1.0, data["token_level_rewards"] + 2.0

    batch = _batch([1.0, 2.0, 3.0], [0, 0, 1])
    adv, ret = estimate_on_rows(recorder, batch, None, torch.tensor([True, False, True]))
    assert seen == [2]
    assert adv[:, -1].tolist() == [2.0, 0.0, 4.0] and ret[:, 0].tolist() == [2.0, 0.0, 2.0]
    adv, _ = estimate_on_rows(recorder, batch, None, torch.zeros(3, dtype=torch.bool))
    assert seen == [2] and not adv.any()
    estimate_on_rows(recorder, batch, None, torch.ones(3, dtype=torch.bool))
    assert seen == [2, 3]


def test_rows_left_out_zero_the_mask_inside_the_block_only():
    batch = _batch([1.0, 2.0], [0, 1])
    with rows_left_out(batch, torch.tensor([False, True])):
        assert batch["response_mask"].tolist() == [[1.0] * 3, [0.0] * 3]
    assert batch["response_mask"].tolist() == [[1.0] * 3, [1.0] * 3]


def test_step_statistics_count_scored_responses_only():
    batch = _batch([1.0, 5.0, 3.0], [0, 0, 1])
    batch["token_level_rewards"] = batch["token_level_rewards"] * torch.tensor([[1.0], [0.0], [1.0]])
    batch["advantages"] = torch.tensor([[1.0] * 3, [9.0] * 3, [-1.0] * 3])
    batch["returns"] = batch["advantages"].clone()
    rollout = RolloutOutput(response_ids=[[1, 2, 3]] * 3, finish_reasons=["stop"] * 3, prompt_index=[0, 0, 1])
    out = step_metrics(
        batch,
        scores=[1.0, 5.0, 3.0],
        components={"acc": [1.0, 1.0, 0.0], FAILED: [0.0, 1.0, 0.0]},
        rollout=rollout,
        prompt_ids=[[1], [2]],
        use_critic=False,
        scored=torch.tensor([True, False, True]),
    )
    assert out["critic/score/mean"] == 2.0 and out["critic/score/max"] == 3.0
    assert out["critic/advantages/max"] == 1.0 and out["critic/acc/mean"] == 0.5
    assert out[f"critic/{FAILED}/mean"] == pytest.approx(1 / 3)
    assert out["response_length/mean"] == 3.0  # lengths count every response


def test_the_guard_counts_steps_without_a_scored_response_and_stops_at_the_limit(tmp_path):
    guard = RewardFailureGuard(limit=2)
    none, some = torch.zeros(4, dtype=torch.bool), torch.tensor([False, True, False, False])
    assert guard.allows_update(none, 1, "reward function 'f': E1") is False
    assert guard.allows_update(some, 2, None) is True and guard.consecutive == 0
    assert guard.allows_update(none, 3, "first") is False
    restored = RewardFailureGuard(limit=2)
    restored.load_state_dict(guard.state_dict())
    with pytest.raises(rlplug.base.exit_codes.RewardFailuresStopped, match=r"2 steps in a row.*First error: first"):
        restored.allows_update(none, 4, "second")


# ----------------------------------------------------------------------------- tiny training runs


@pytest.fixture
def reward():
    registry = get_registry()
    names = []

    def install(name, fn):
        registry.entries["reward_function"].pop(name, None)
        registry.register("reward_function", name, fn)
        names.append(name)
        return name

    yield install
    for name in names:
        registry.entries["reward_function"].pop(name, None)


GRPO = [*TINY_CPU_RUN, "algorithm=grpo", "rollout.n=4", "actor.use_kl_loss=false", "trainer.logger=[]"]


def test_every_reward_failing_skips_the_updates_then_stops_with_exit_code_4(tmp_path, reward, capsys):
    reward("test_always_raises", always_raises)
    cfg = run_config(
        GRPO,
        tmp_path,
        "reward.reward_fn_map.basic_arithmetic=test_always_raises",
        "trainer.total_training_steps=5",
        "trainer.save_freq=1",
        "trainer.max_consecutive_bad_steps=2",
    )
    assert run(cfg) == ExitCode.REWARD_FAILURES == 4
    out = capsys.readouterr().out
    assert "Training stopped: the reward failed for every response in 2 steps in a row" in out
    assert (
        "First error: reward function 'test_always_raises' on data_source=basic_arithmetic: ValueError: cannot parse"
        in out
    )
    assert not (tmp_path / "final_model").exists()
    # step 1 was skipped (and saved), step 2 reached the limit: no step 2 checkpoint
    assert CheckpointManager(tmp_path).complete_steps() == [1]


def test_partly_failing_rewards_train_on_the_scored_responses(tmp_path, reward):
    reward("test_odd_raises", odd_length_raises)
    calls: list[dict] = []
    grpo = get_registry().get("advantage_estimator", "grpo")

    def recording(data, config):
        calls.append({"rows": int(data["index"].shape[0]), "scores": (data["token_level_rewards"].sum(-1)).tolist()})
        return grpo(data, config)

    registry = get_registry()
    registry.entries["advantage_estimator"].pop("test_rec", None)
    registry.register(
        "advantage_estimator", "test_rec", AdvantageEstimator(recording, requires=("index",), group_based=True)
    )

    class Collect:
        @rlplug.hookimpl
        def on_step_end(self, step: int, metrics: dict) -> None:
            # the estimator call of this step, if it was called (not when no reward succeeded)
            called = len(calls) > sum(1 for _, c in collected if c is not None)
            collected.append((dict(metrics), calls[-1] if called else None))

    collected: list[tuple[dict, dict | None]] = []
    collector = Collect()
    registry.pm.register(collector)
    try:
        cfg = run_config(
            GRPO,
            tmp_path,
            "algorithm.adv_estimator=test_rec",
            "data.max_response_length=16",
            "reward.reward_fn_map.basic_arithmetic=test_odd_raises",
            "trainer.total_training_steps=3",
            "trainer.save_freq=0",
        )
        assert fit(cfg) == "finished"
    finally:
        registry.pm.unregister(collector)
        registry.entries["advantage_estimator"].pop("test_rec", None)
    assert len(collected) == 3
    failed_total = sum(m["reward/failed_samples"] for m, _ in collected)
    assert failed_total > 0, "the tiny model wrote no odd-length response: the test does not test anything"
    for m, call in collected:
        rows = 8 - m["reward/failed_samples"]
        assert m["reward/failures"] == m["reward/failed_samples"]
        if rows == 0:
            assert call is None  # nothing scored: the estimator is not called, the update skipped
            continue
        assert call is not None and call["rows"] == rows  # the estimator saw the scored responses only
        assert m["critic/score/mean"] == pytest.approx(sum(call["scores"]) / rows, abs=1e-6)
    assert any(m.get("actor/grad_norm", 0.0) > 0 for m, _ in collected)


def test_a_failed_baseline_leaves_the_responses_to_its_prompt_out():
    extra = {FAILED: [0.0, 0.0, 1.0, 0.0]}
    baselines = torch.tensor([0.5, math.nan, 0.5, 0.25])  # the second prompt's greedy response failed
    assert scored_rows(extra, 4, baselines).tolist() == [True, False, False, True]


def test_remax_with_failing_rewards_never_sees_a_failed_baseline(tmp_path, reward):
    reward("test_odd_raises", odd_length_raises)
    remax = get_registry().get("advantage_estimator", "remax")
    seen: list[torch.Tensor] = []

    def recording(data, config):
        seen.append(data["reward_baselines"].clone())
        return remax(data, config)

    registry = get_registry()
    registry.entries["advantage_estimator"].pop("test_remax_rec", None)
    registry.register(
        "advantage_estimator", "test_remax_rec", AdvantageEstimator(recording, requires=("reward_baselines",))
    )
    try:
        cfg = run_config(
            [*TINY_CPU_RUN, "algorithm=remax", "rollout.n=2", "trainer.logger=[]"],
            tmp_path,
            "algorithm.adv_estimator=test_remax_rec",
            "data.max_response_length=16",
            "reward.reward_fn_map.basic_arithmetic=test_odd_raises",
            "trainer.total_training_steps=3",
            "trainer.save_freq=0",
        )
        assert run(cfg) == 0
    finally:
        registry.entries["advantage_estimator"].pop("test_remax_rec", None)
    assert all(bool(torch.isfinite(b).all()) for b in seen)


def test_the_in_reward_kl_counts_scored_responses_and_a_skipped_step_leaves_the_controller():
    from rlplug.algorithms.kl_control import make_kl_controller
    from rlplug.run.trainer import token_level_rewards

    kl = get_registry().get("kl_penalty", "kl")
    batch = _batch([1.0, 1.0], [0, 0], T=2)
    batch["old_log_probs"] = torch.tensor([[-1.0, -1.0], [-3.0, -3.0]])
    batch["ref_log_probs"] = torch.tensor([[-1.5, -1.5], [-1.0, -1.0]])
    batch["token_level_scores"] = batch["token_level_rewards"].clone()
    ctrl = make_kl_controller({"type": "adaptive", "kl_coef": 0.1, "target_kl": 0.1, "horizon": 10})
    metrics: dict[str, float] = {}
    token_level_rewards(batch, metrics, kl, ctrl, torch.tensor([True, False]))
    # only row 0 counts: its per-token KL is -1 - (-1.5) = 0.5 nats (row 1's would be -2)
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.5)
    assert batch["token_level_rewards"][0].tolist() == pytest.approx([-0.05, 1.0 - 0.05])
    value = ctrl.value
    token_level_rewards(batch, metrics, kl, ctrl, torch.zeros(2, dtype=torch.bool))
    assert ctrl.value == value and torch.equal(batch["token_level_rewards"], batch["token_level_scores"])
