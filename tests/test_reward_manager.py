"""RewardManager: dispatch, shaping, failure/NaN/timeout handling, serial vs process pool."""

from __future__ import annotations

import logging
import math
import signal
import time

import pytest

from rlplug.contracts.registry import Registry
from rlplug.plugins.rewards import rules as packaged
from rlplug.rewards.manager import RewardConfigError, RewardManager

# Test reward functions live at module level so worker processes can import them by reference.


def exact(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    """1.0 + bonus when the response equals the ground truth, with an extra logged value."""
    ok = solution_str.strip() == ground_truth
    return {"score": (1.0 if ok else 0.0) + bonus, "acc": 1.0 if ok else 0.0, "length": float(len(solution_str))}


def plain(data_source, solution_str, ground_truth, extra_info=None):
    return 0.5 if solution_str else 0.25


def raises(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "boom":
        raise RuntimeError("reward exploded")
    return 1.0


def nan_reward(data_source, solution_str, ground_truth, extra_info=None):
    return float("nan") if solution_str == "nan" else {"score": float("inf")} if solution_str == "inf" else 1.0


def sleepy(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "sleep":
        time.sleep(20)
    return 1.0


def sleepy_blocking_alarm(data_source, solution_str, ground_truth, extra_info=None):
    """Ignores SIGALRM (like a C extension that never returns to Python): only the pool backstop stops it."""
    if solution_str == "sleep":
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
        time.sleep(60)
    return 1.0


def registry_with(**fns) -> Registry:
    reg = Registry(load_entry_points=False)
    for name, fn in fns.items():
        reg.register("reward_function", name, fn)
    return reg


def cfg(**over):
    base = {
        "reward_fn_map": {},
        "default": None,
        "kwargs": {},
        "shaping": [],
        "fallback_score": 0.0,
        "timeout_s": 10.0,
        "num_workers": 0,
    }
    base.update(over)
    return base


# ---------------------------------------------------------------------------- dispatch


def test_unmapped_data_source_error_lists_sources_functions_and_fix():
    reg = registry_with(exact=exact, plain=plain)
    m = RewardManager(cfg(reward_fn_map={"a": "exact"}), registry=reg)
    with pytest.raises(RewardConfigError) as e:
        m.check_data_sources({"a", "b/src", "c"})
    msg = str(e.value)
    assert "'b/src'" in msg and "'c'" in msg  # the unmapped ones
    assert "Data sources found: a, b/src, c" in msg
    assert "Reward functions available: exact, plain" in msg
    # concrete spellings that compose (tests/test_reward_selection.py composes them)
    assert "Fix: reward.reward_fn_map.b/src=exact (any function listed above), or reward.default=exact" in msg
    # the default covers every source
    RewardManager(cfg(reward_fn_map={"a": "exact"}, default="plain"), registry=reg).check_data_sources({"a", "b", "c"})


def test_unknown_function_name_error_names_the_setting_and_choices():
    reg = registry_with(exact=exact, plain=plain)
    m = RewardManager(cfg(reward_fn_map={"a": "exakt"}), registry=reg)
    with pytest.raises(RewardConfigError) as e:
        m.check_data_sources({"a"})
    assert "reward.reward_fn_map.a=exakt" in str(e.value)
    assert "Did you mean 'exact'" in str(e.value) and "plain" in str(e.value)
    with pytest.raises(RewardConfigError, match="reward.shaping.*nope"):
        RewardManager(cfg(shaping=[{"name": "nope", "weight": 1.0}]), registry=reg)


def test_kwargs_checked_against_signature_and_validator():
    reg = registry_with(exact=exact)
    m = RewardManager(cfg(default="exact", kwargs={"exact": {"bonsu": 1}}), registry=reg)
    with pytest.raises(RewardConfigError, match=r"reward.kwargs.exact has unknown setting\(s\) bonsu.*accepts: bonus"):
        m.check_data_sources({"x"})
    reg2 = registry_with(gsm8k=packaged.gsm8k)
    m2 = RewardManager(cfg(default="gsm8k", kwargs={"gsm8k": {"method": "fuzzy"}}), registry=reg2)
    with pytest.raises(RewardConfigError, match="strict.*flexible"):
        m2.check_data_sources({"x"})


def test_score_dispatches_per_data_source_and_combines_shaping():
    reg = registry_with(exact=exact, plain=plain, length_penalty=packaged.length_penalty)
    m = RewardManager(
        cfg(
            reward_fn_map={"a": "exact", "b": "plain"},
            kwargs={"exact": {"bonus": 0.5}, "length_penalty": {"target_chars": 2, "scale_chars": 4}},
            shaping=[{"name": "length_penalty", "weight": 2.0}],
        ),
        registry=reg,
    )
    rows = [
        {"data_source": "a", "ground_truth": "42"},
        {"data_source": "a", "ground_truth": "42"},
        {"data_source": "b", "ground_truth": "x"},
    ]
    scores, extra, metrics = m.score(rows, ["42", "41234", ""])
    # row 0: exact 1 + bonus .5 = 1.5; length 2 -> penalty 0                     -> 1.5
    # row 1: exact 0 + .5 = .5; length 5 -> -(5-2)/4 = -.75, weight 2 -> -1.5    -> -1.0
    # row 2: plain("") = .25; length 0 -> 0                                      -> .25
    assert scores == pytest.approx([1.5, -1.0, 0.25])
    assert extra["acc"] == [1.0, 0.0, 0.25]  # plain returns a float: acc is its score
    assert extra["correctness"] == [1.5, 0.5, 0.25]
    assert extra["shaping/length_penalty"] == [0.0, -0.75, 0.0]
    assert extra["length"][:2] == [2.0, 5.0] and math.isnan(extra["length"][2])  # not reported by plain
    assert metrics == {"reward/failures": 0.0, "reward/timeouts": 0.0, "reward/failed_samples": 0.0}


def test_one_function_as_correctness_and_as_shaping_with_its_own_kwargs():
    # gsm8k strict is the correctness score; gsm8k flexible (last number) is a shaping term, weight 0.5.
    reg = registry_with(gsm8k=packaged.gsm8k)
    m = RewardManager(
        cfg(reward_fn_map={"a": "gsm8k"}, shaping=[{"name": "gsm8k", "weight": 0.5, "kwargs": {"method": "flexible"}}]),
        registry=reg,
    )
    rows = [{"data_source": "a", "ground_truth": "42"}] * 4
    scores, extra, _ = m.score(rows, ["6 * 7 = 42\n#### 42", "it is 42", "#### 41", "no idea"])
    # row 0: strict 1 + 0.5 * flexible 1 = 1.5; row 1: strict 0 (no ####) + 0.5 * 1 = 0.5;
    # row 2: strict wrong 0 + flexible 41 != 42 -> 0; row 3: nothing -> 0
    assert scores == pytest.approx([1.5, 0.5, 0.0, 0.0])
    assert extra["acc"] == [1.0, 0.0, 0.0, 0.0]  # acc comes from the correctness function only
    assert extra["shaping/gsm8k"] == [1.0, 1.0, 0.0, 0.0]
    with pytest.raises(RewardConfigError, match=r"reward\.shaping\[0\]\.kwargs has unknown setting"):
        RewardManager(
            cfg(reward_fn_map={"a": "gsm8k"}, shaping=[{"name": "gsm8k", "kwargs": {"nope": 1}}]), registry=reg
        )


def test_fields_dict_and_verl_rows_are_accepted_and_lengths_checked():
    m = RewardManager(cfg(default="exact"), registry=registry_with(exact=exact))
    fields = {"data_source": ["a", "a"], "ground_truth": ["1", "2"], "extra_info": [None, {}]}
    assert m.score(fields, ["1", "1"])[0] == [1.0, 0.0]
    verl_rows = [{"data_source": "a", "reward_model": {"ground_truth": "7", "style": "rule"}}]
    assert m.score(verl_rows, ["7"])[0] == [1.0]
    with pytest.raises(ValueError, match="one row per response"):
        m.score(fields, ["1"])


# ---------------------------------------------------------------------------- failures


def test_raising_and_nonfinite_rewards_get_fallback_are_counted_and_logged_once(caplog):
    reg = registry_with(raises=raises, nan_reward=nan_reward)
    m = RewardManager(cfg(reward_fn_map={"r": "raises", "n": "nan_reward"}, fallback_score=-1.0), registry=reg)
    rows = [{"data_source": "r", "ground_truth": ""}] * 3 + [{"data_source": "n", "ground_truth": ""}] * 3
    with caplog.at_level(logging.WARNING, logger="rlplug.rewards.manager"):
        scores, extra, metrics = m.score(rows, ["boom", "ok", "boom", "nan", "inf", "ok"])
        m.score(rows[:1], ["boom"])  # same message again: not logged again
    assert scores == [-1.0, 1.0, -1.0, -1.0, -1.0, 1.0]
    assert extra["acc"] == [0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert metrics == {"reward/failures": 4.0, "reward/timeouts": 0.0, "reward/failed_samples": 4.0}
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("reward exploded" in s for s in msgs) == 1
    assert sum("non-finite score (nan)" in s for s in msgs) == 1
    assert sum("non-finite score (inf)" in s for s in msgs) == 1
    assert any("response='boom'" in s for s in msgs)  # the sample is in the log line
    assert m.total_failures == 5


def test_serial_timeout_guard():
    m = RewardManager(cfg(default="sleepy", timeout_s=0.3, fallback_score=0.0), registry=registry_with(sleepy=sleepy))
    t0 = time.perf_counter()
    scores, _, metrics = m.score([{"data_source": "s", "ground_truth": ""}] * 2, ["sleep", "fast"])
    assert time.perf_counter() - t0 < 5
    assert scores == [0.0, 1.0]
    assert metrics == {"reward/failures": 1.0, "reward/timeouts": 1.0, "reward/failed_samples": 1.0}


# ---------------------------------------------------------------------------- process pool


def test_pool_results_identical_to_serial_and_pool_reused():
    reg = registry_with(
        gsm8k=packaged.gsm8k, reasoning_gym=packaged.reasoning_gym, format=packaged.format_reward, raises=raises
    )
    conf = dict(
        reward_fn_map={"g": "gsm8k", "countdown": "reasoning_gym", "r": "raises"},
        shaping=[{"name": "format", "weight": 0.25}],
        fallback_score=-0.5,
        timeout_s=120.0,  # a fresh worker's first call imports reasoning_gym: seconds on a loaded machine
    )
    cd = '{"numbers": [9, 23, 15], "target": 17}'
    rows, resp = [], []
    for i in range(30):
        rows += [
            {"data_source": "g", "ground_truth": str(i)},
            {"data_source": "countdown", "ground_truth": cd},
            {"data_source": "r", "ground_truth": ""},
        ]
        resp += [
            f"#### {i if i % 3 else i + 1}",
            "#### 23 - 15 + 9" if i % 2 else "#### 9 + 23",
            "boom" if i % 5 == 0 else "x",
        ]
    serial = RewardManager(cfg(**conf), registry=reg).score(rows, resp)
    with RewardManager(cfg(**conf, num_workers=2), registry=reg) as pooled:
        first = pooled.score(rows, resp)
        pool = pooled._pool
        second = pooled.score(rows, resp)
        assert pooled._pool is pool and pool is not None  # created once, reused
    restarts = {"reward/worker_restarts": 0.0}  # the pool's metric (no worker died or hung)
    assert first == (*serial[:2], {**serial[2], **restarts}) and second == first
    assert serial[2] == {
        "reward/failures": 6.0,
        "reward/timeouts": 0.0,
        "reward/failed_samples": 6.0,
    }  # "boom" at i = 0, 5, ..., 25
    assert pooled._pool is None  # closed


def test_pool_timeout_by_worker_timer_keeps_the_pool():
    with RewardManager(
        cfg(default="sleepy", timeout_s=0.5, num_workers=1), registry=registry_with(sleepy=sleepy), start_method="fork"
    ) as m:
        t0 = time.perf_counter()
        scores, _, metrics = m.score([{"data_source": "s", "ground_truth": ""}] * 3, ["fast", "sleep", "fast"])
        assert time.perf_counter() - t0 < 10
        assert scores == [1.0, 0.0, 1.0]
        assert metrics == {
            "reward/failures": 1.0,
            "reward/timeouts": 1.0,
            "reward/failed_samples": 1.0,
            "reward/worker_restarts": 0.0,
        }
        pool = m._pool
        assert m.score([{"data_source": "s", "ground_truth": ""}], ["fast"])[0] == [1.0]
        assert m._pool is pool


def test_pool_backstop_kills_a_worker_that_ignores_the_timer():
    m = RewardManager(
        cfg(default="blk", timeout_s=0.3, num_workers=1),
        registry=registry_with(blk=sleepy_blocking_alarm),
        start_method="fork",
    )
    m.backstop_slack_s = 1.0
    try:
        t0 = time.perf_counter()
        scores, _, metrics = m.score([{"data_source": "s", "ground_truth": ""}], ["sleep"])
        assert time.perf_counter() - t0 < 15
        assert scores == [0.0] and metrics["reward/timeouts"] == 1.0
        assert m._pool is not None and m._pool.restarts == 1  # killed and replaced by a new worker
        assert metrics["reward/worker_restarts"] == 1.0
        assert m.score([{"data_source": "s", "ground_truth": ""}], ["fast"])[0] == [1.0]
    finally:
        m.close()


def test_unpicklable_reward_in_pool_is_a_counted_failure_with_advice(caplog):
    m = RewardManager(
        cfg(default="lam", num_workers=1), registry=registry_with(lam=lambda *a, **k: 1.0), start_method="fork"
    )
    try:
        with caplog.at_level(logging.WARNING, logger="rlplug.rewards.manager"):
            scores, _, metrics = m.score([{"data_source": "s", "ground_truth": ""}], ["x"])
        assert scores == [0.0] and metrics["reward/failures"] == 1.0
        assert any("module-level" in r.getMessage() and "num_workers=0" in r.getMessage() for r in caplog.records)
    finally:
        m.close()


def test_score_async_scores_on_one_background_thread_and_close_waits_for_it():
    import threading

    from rlplug.rewards.manager import components_tensor

    m = RewardManager(cfg(default="exact"), registry=registry_with(exact=exact))
    rows = [{"data_source": "x", "ground_truth": "4"}, {"data_source": "x", "ground_truth": "5"}]
    threads = []
    release = threading.Event()

    def decode():  # called on the scoring thread; blocks until the test lets it go
        threads.append(threading.current_thread().name)
        release.wait(10)
        time.sleep(0.3)
        return ["4", "six"]

    future = m.score_async(rows, decode)
    assert not future.done()  # returned while decode is still blocked: not run on this thread
    release.set()
    m.close()  # waits for the running call
    assert future.done()
    (scores, extra, metrics), seconds = future.result()
    assert threads and threads[0].startswith("rlplug-score")
    assert (scores, extra, metrics) == m.score(rows, ["4", "six"])
    assert scores == [1.0, 0.0] and extra["length"] == [1.0, 3.0]
    assert seconds >= 0.3
    # the components as the batch field: (B, K) float32, names in order
    t, names = components_tensor(extra, 2)
    assert names == ("acc", "correctness", "length", "reward_failed") and t.dtype.is_floating_point
    assert t.tolist() == [[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 3.0, 0.0]]

    # overlap=False: scored here, before returning; an error raises here
    future = m.score_async(rows, ["4", "5"], overlap=False)
    assert future.done() and future.result()[0][0] == [1.0, 1.0]
    with pytest.raises(ValueError, match="one row per response"):
        m.score_async(rows, ["4"], overlap=False)
    # on the thread, an error comes out of result()
    with pytest.raises(ValueError, match="one row per response"):
        m.score_async(rows, ["4"]).result()
    m.close()


def test_components_tensor_marks_unreported_values_nan():
    from rlplug.rewards.manager import components_tensor

    t, names = components_tensor({"acc": [1.0, 0.0], "format": [math.nan, 1.0], "other": [None, 2.5]}, 2)
    assert names == ("acc", "format", "other")
    assert t[:, 0].tolist() == [1.0, 0.0] and t[1, 1:].tolist() == [1.0, 2.5]
    assert math.isnan(t[0, 1]) and math.isnan(t[0, 2])
    assert tuple(components_tensor({}, 3)[0].shape) == (3, 0)
    with pytest.raises(ValueError, match="need 2 values each"):
        components_tensor({"acc": [1.0]}, 2)
