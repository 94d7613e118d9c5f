"""Reward faults in worker processes (issue 21): a reward that hangs, a worker killed with SIGKILL.

Every call goes to one worker of :class:`rlplug.rewards.manager.RewardWorkerPool`, so a fault fails its own
sample only: that sample gets ``reward.fallback_score`` and is counted (``reward/failures``,
``reward/timeouts``, ``reward/worker_restarts``), every other sample gets its real score, and no
sample is scored twice or dropped. The reward functions below append the response they score to
a file (``O_APPEND``, one line per call) before doing anything else, so the file counts the calls
even of a worker that is killed right after.
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from _helpers import TINY_CPU_RUN, fit, run_config

import rlplug
from rlplug.contracts.batch import Batch, estimate_on_rows
from rlplug.contracts.registry import Registry, get_registry
from rlplug.rewards.manager import FAILED, RewardFailureGuard, RewardManager, RewardWorkerPool, scored_rows
from rlplug.testing import REWARD_COMPONENT_NAMES, algorithm_config, make_batch


def _record(log: str, text: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (text.replace("\n", " ") + "\n").encode())
    finally:
        os.close(fd)


def killer(data_source, solution_str, ground_truth, extra_info=None, log=None):
    """Scores ``len(response)``; the response ``"kill"`` SIGKILLs its own worker (as the OOM killer does)."""
    _record(log, solution_str)
    if solution_str == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    return float(len(solution_str))


def hanger(data_source, solution_str, ground_truth, extra_info=None, log=None):
    """Scores ``len(response)``; ``"hang"`` sleeps past the timeout with SIGALRM blocked (a call stuck in
    C code, which the worker's timer cannot interrupt), ``"slow"`` sleeps past it interruptibly."""
    _record(log, solution_str)
    if solution_str == "hang":
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
        time.sleep(120)
    if solution_str == "slow":
        time.sleep(120)
    return float(len(solution_str))


def kill_first_call(data_source, solution_str, ground_truth, extra_info=None, log=None):
    """GSM8K-style 1/0 by the answer's last characters; the very first call of the run SIGKILLs its worker."""
    first = not os.path.exists(log)
    _record(log, solution_str)
    if first:
        os.kill(os.getpid(), signal.SIGKILL)
    return float(solution_str.strip().endswith(str(ground_truth)))


def _manager(fn, log: Path, start_method: str = "fork", **cfg) -> RewardManager:
    reg = Registry(load_entry_points=False)
    reg.register("reward_function", "f", fn)
    conf = {"reward_fn_map": {"src": "f"}, "kwargs": {"f": {"log": str(log)}}, "fallback_score": -1.0, **cfg}
    return RewardManager(conf, registry=reg, start_method=start_method, backstop_slack_s=1.0)


def _calls(log: Path) -> Counter:
    return Counter(log.read_text().splitlines())


RESPONSES = ["a", "bb", "ccc", "kill", "ddddd", "eeeeee", "fffffff", "gggggggg"]


# spawn (the default) re-imports this module in each worker: a minute on a busy 2-core machine
@pytest.mark.parametrize("start_method", [pytest.param("spawn", marks=pytest.mark.slow), "fork"])
def test_a_worker_killed_with_sigkill_fails_exactly_its_sample_and_each_sample_is_scored_once(tmp_path, start_method):
    log = tmp_path / "calls.txt"
    with _manager(killer, log, start_method, num_workers=2, timeout_s=30.0) as m:
        rows = [{"data_source": "src", "ground_truth": ""}] * len(RESPONSES)
        scores, extra, metrics = m.score(rows, RESPONSES)
        # real scores are the lengths; "kill" (index 3) gets the fallback -1.0
        assert scores == [1.0, 2.0, 3.0, -1.0, 5.0, 6.0, 7.0, 8.0]
        assert extra[FAILED] == [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
        assert metrics == {
            "reward/failures": 1.0,
            "reward/timeouts": 0.0,
            "reward/failed_samples": 1.0,
            "reward/worker_restarts": 1.0,
        }
        assert "killed by SIGKILL" in (m.last_error or "") and "OOM killer" in (m.last_error or "")
        assert _calls(log) == Counter(RESPONSES)  # every sample called exactly once, the killed one too
        # the pool goes on with a new worker: the next batch is scored normally
        assert m.score(rows[:2], ["xy", "z"])[0] == [2.0, 1.0]
        assert m._pool is not None and len(m._pool.pids) == 2 and m.total_worker_restarts == 1


def test_a_hang_the_timer_cannot_stop_is_killed_counted_as_a_timeout_and_only_that_sample_fails(tmp_path):
    log = tmp_path / "calls.txt"
    responses = ["a", "hang", "ccc", "slow", "ddddd"]
    with _manager(hanger, log, num_workers=2, timeout_s=0.5) as m:
        t0 = time.perf_counter()
        scores, extra, metrics = m.score([{"data_source": "src", "ground_truth": ""}] * 5, responses)
        assert time.perf_counter() - t0 < 30  # each hang costs timeout_s (+ backstop_slack_s for "hang")
        # "hang": killed by the pool's backstop (worker replaced); "slow": the worker's timer (worker kept)
        assert scores == [1.0, -1.0, 3.0, -1.0, 5.0]
        assert extra[FAILED] == [0.0, 1.0, 0.0, 1.0, 0.0]
        assert metrics == {
            "reward/failures": 2.0,
            "reward/timeouts": 2.0,
            "reward/failed_samples": 2.0,
            "reward/worker_restarts": 1.0,
        }
        assert _calls(log) == Counter(responses)


def test_the_pool_runs_every_call_once_in_order_and_replaces_a_worker_dead_while_idle(tmp_path):
    log = tmp_path / "calls.txt"
    pool = RewardWorkerPool(2, "fork")
    try:
        payload = [(killer, ("src", text, "", None), {"log": str(log)}) for text in ["a", "bb", "ccc"]]
        assert pool.run(payload, None, 1.0) == [("ok", 1.0), ("ok", 2.0), ("ok", 3.0)]
        for pid in pool.pids:  # both workers die between two batches; no pause: their pipes may still be
            os.kill(pid, signal.SIGKILL)  # open when the next calls are sent, and those calls never start
        assert pool.run(payload[:2], None, 1.0) == [("ok", 1.0), ("ok", 2.0)]
        assert pool.restarts == 2 and _calls(log) == Counter({"a": 2, "bb": 2, "ccc": 1})
    finally:
        pool.close()
    assert pool.pids == []
    with pytest.raises(ValueError, match="at least one worker"):
        RewardWorkerPool(0)


class _ExitOnUnpickle:
    """Kills the worker process that unpickles it (``os._exit(3)``), before the call can start."""

    def __reduce__(self):
        return (os._exit, (3,))


def test_a_call_whose_worker_dies_before_starting_it_is_sent_once_more_then_failed(tmp_path):
    log = tmp_path / "calls.txt"
    pool = RewardWorkerPool(1, "fork")
    try:
        payload = [
            (killer, ("src", "a", "", None), {"log": str(log)}),
            (killer, ("src", "bb", "", _ExitOnUnpickle()), {"log": str(log)}),
            (killer, ("src", "ccc", "", None), {"log": str(log)}),
        ]
        results = pool.run(payload, None, 1.0)
        assert results[0] == ("ok", 1.0) and results[2] == ("ok", 3.0)
        status, msg = results[1]  # sent to two workers, both died unpickling it: failed, not looped
        assert status == "error" and "exited with code 3 before it started scoring this sample" in msg
        assert pool.restarts == 2 and _calls(log) == Counter({"a": 1, "ccc": 1})
    finally:
        pool.close()


# ----------------------------------------------------------------------------- the step goes on


@pytest.mark.slow  # a tiny training run with a spawned reward worker: minutes on a busy 2-core machine
def test_a_training_step_goes_on_when_a_reward_worker_is_killed(tmp_path):
    """A tiny GRPO run (4 prompts x 4 responses) whose first reward call kills its worker: that one
    response fails (left out of training), the 15 others are scored once each, and the run finishes."""
    registry = get_registry()
    registry.entries["reward_function"].pop("test_kill_first_call", None)
    registry.register("reward_function", "test_kill_first_call", kill_first_call)
    log = tmp_path / "calls.txt"
    steps: list[dict] = []

    class Collect:
        @rlplug.hookimpl
        def on_step_end(self, step: int, metrics: dict) -> None:
            steps.append(dict(metrics))

    collector = Collect()
    registry.pm.register(collector)
    try:
        cfg = run_config(
            [*TINY_CPU_RUN, "algorithm=grpo", "rollout.n=4", "actor.use_kl_loss=false", "trainer.logger=[]"],
            tmp_path / "run",
            "reward.reward_fn_map.basic_arithmetic=test_kill_first_call",
            f"+reward.kwargs.test_kill_first_call.log={log}",
            "reward.num_workers=1",
            "trainer.total_training_steps=1",
            "trainer.save_freq=0",
            "trainer.val_before_train=false",
            "trainer.test_freq=0",
        )
        assert fit(cfg) == "finished"
    finally:
        registry.pm.unregister(collector)
        registry.entries["reward_function"].pop("test_kill_first_call", None)
    (m,) = steps
    batch = int(cfg.data.train_batch_size) * 4
    assert m["reward/failed_samples"] == 1.0 and m["reward/failures"] == 1.0
    assert m["reward/worker_restarts"] == 1.0
    assert sum(_calls(log).values()) == batch  # each response scored once, the killed one included


# ----------------------------------------------------------------------------- NaN / None rewards, every estimator

ESTIMATORS = sorted(get_registry().names("advantage_estimator"))
FAILED_ROW = 2  # in the first group of four


def _batch_with_a_failed_reward(value: float) -> tuple[Batch, torch.Tensor]:
    """make_batch's 2 groups x 4 responses (every producer's field present), row 2's reward ``value``
    (NaN: what a NaN or None reward would put there if it were not caught); and the scored rows."""
    data = make_batch(batch_size=8, response_length=4, group_size=4, seed=3)
    last = int(data["response_lengths"][FAILED_ROW]) - 1
    for key in ("token_level_scores", "token_level_rewards"):
        data[key][FAILED_ROW, last] = value
    data["reward_components"][FAILED_ROW] = value
    batch = Batch(dict(data), columns={"reward_components": REWARD_COMPONENT_NAMES})
    keep = torch.ones(8, dtype=torch.bool)
    keep[FAILED_ROW] = False
    return batch, keep


@pytest.mark.parametrize("name", ESTIMATORS)
def test_a_failed_reward_in_a_group_changes_no_other_advantage(name):
    """For every registered estimator: the responses next to a failed one (its reward NaN) get exactly
    the advantages of the batch without that response, the failed one gets 0, and nothing is NaN."""
    est = get_registry().get("advantage_estimator", name)
    config = algorithm_config()
    batch, keep = _batch_with_a_failed_reward(math.nan)
    adv, ret = estimate_on_rows(est, batch, config, keep)
    without = batch.select(keep.nonzero().squeeze(-1))  # the group of three the estimator should see
    ref_adv, ref_ret = est(without.fields(), config)
    assert torch.equal(adv[keep], ref_adv.float()) and torch.equal(ret[keep], ref_ret.float())
    assert not adv[FAILED_ROW].any() and not ret[FAILED_ROW].any()
    assert bool(torch.isfinite(adv).all()) and bool(torch.isfinite(ret).all())
    # the fallback score in the failed row instead of NaN: the same advantages (it is left out, not scored)
    batch0, _ = _batch_with_a_failed_reward(0.0)
    adv0, _ = estimate_on_rows(est, batch0, config, keep)
    assert torch.equal(adv0, adv)


@pytest.mark.parametrize("name", ESTIMATORS)
def test_a_step_without_a_scored_response_calls_no_estimator_and_skips_the_update(name):
    calls: list[int] = []
    est = get_registry().get("advantage_estimator", name)

    def recording(data, config):
        calls.append(1)
        return est(data, config)

    batch, _ = _batch_with_a_failed_reward(math.nan)
    none = torch.zeros(8, dtype=torch.bool)
    adv, ret = estimate_on_rows(recording, batch, algorithm_config(), none)
    assert calls == [] and not adv.any() and not ret.any()
    guard = RewardFailureGuard(limit=3)
    assert guard.allows_update(none, 1, "reward function 'f': NaN") is False and guard.consecutive == 1


def test_nan_and_none_rewards_are_the_failed_rows_the_estimators_leave_out(tmp_path):
    """The reward manager turns a NaN or None reward into a failed row, which ``scored_rows`` leaves out."""
    m = _manager(nan_or_none, tmp_path / "calls.txt")
    scores, extra, metrics = m.score([{"data_source": "src", "ground_truth": ""}] * 4, ["ab", "nan", "none", "abc"])
    assert scores == [2.0, -1.0, -1.0, 3.0]
    assert scored_rows(extra, 4).tolist() == [True, False, False, True]
    assert metrics["reward/failures"] == 2.0 and metrics["reward/failed_samples"] == 2.0


def nan_or_none(data_source, solution_str, ground_truth, extra_info=None, log=None):
    return {"nan": math.nan, "none": None}.get(solution_str, float(len(solution_str)))


def _slow_to_unpickle(seconds: float) -> float:
    time.sleep(seconds)  # runs in the worker while it unpickles the call, before it reports starting
    return seconds


class _SlowUnpickle:
    def __reduce__(self):
        return (_slow_to_unpickle, (0.2,))


def dies_after_logging(data_source, solution_str, ground_truth, extra_info=None, log=None):
    _record(log, solution_str)
    os._exit(7)


def test_a_call_that_started_is_never_sent_again_even_when_its_report_is_read_late(tmp_path, monkeypatch):
    """The parent polls a worker's pipe while the call is still unpickling (nothing to read), is held up,
    and meanwhile the worker reports starting, runs the call and dies. Its report is still in the pipe:
    the call ran, so it fails once and is not sent to the replacement (a second run would log it twice)."""
    import rlplug.rewards.manager as reward_mod

    log = tmp_path / "calls.txt"
    real_poll = reward_mod._poll

    def late_poll(conn):
        ready = real_poll(conn)
        if not ready:
            time.sleep(0.5)  # a descheduled parent: the worker starts, runs and exits meanwhile
        return ready

    monkeypatch.setattr(reward_mod, "_poll", late_poll)
    pool = RewardWorkerPool(2, "fork")
    try:
        payload = [
            (killer, ("src", "a", "", None), {"log": str(log)}),  # answers at once: wakes the parent
            (dies_after_logging, ("src", "bb", "", _SlowUnpickle()), {"log": str(log)}),
        ]
        results = pool.run(payload, None, 1.0)
        assert results[0] == ("ok", 1.0)
        status, msg = results[1]
        assert status == "error" and "exited with code 7 while scoring this sample" in msg
        assert _calls(log) == Counter({"a": 1, "bb": 1}) and pool.restarts == 1
    finally:
        pool.close()
