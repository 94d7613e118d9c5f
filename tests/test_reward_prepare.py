"""RewardManager.prepare: a reward function's start-up work (a judge's server, a reward model's
weights) runs once, before the first batch and outside ``reward.timeout_s`` (issue 18: a judge that
started its server inside the first sample's call had every sample time out while it loaded)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from rlplug.contracts.registry import Registry
from rlplug.plugins.rewards.judge import close_judges, judge
from rlplug.rewards.manager import RewardManager

HERE = Path(__file__).parent


class SlowStart:
    """A reward function whose ``prepare`` takes ``delay_s`` seconds; records its calls."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.prepared: list[dict] = []
        self.closed = 0

    def prepare(self, kwargs):
        time.sleep(self.delay_s)
        self.prepared.append(dict(kwargs))

    def __call__(self, data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        assert self.prepared, "called before prepare"
        return float(solution_str == ground_truth) * kwargs.get("scale", 1.0)

    def close(self):
        self.closed += 1


def tiny_run_cfg(run_dir, *extra: str):
    """A one-step tiny PPO run in ``run_dir`` (console only, one thread), with Hydra overrides ``extra``."""
    from rlplug.config.compose import compose

    return compose(
        [
            "debug=tiny",
            "model.tiny.num_hidden_layers=1",
            "data.train_batch_size=2",
            "actor.ppo_mini_batch_size=1",
            "actor.micro_batch_size_per_device=1",
            "data.max_response_length=4",
            "trainer.total_training_steps=1",
            "trainer.logger=[console]",
            "trainer.num_threads=1",
            "trainer.device=cpu",
            f"trainer.default_local_dir={run_dir}",
            *extra,
        ]
    )


def _manager(fn, conf):
    reg = Registry(load_entry_points=False)
    reg.register("reward_function", "slow", fn)
    reg.register("reward_function", "plain", lambda data_source, solution_str, ground_truth, extra_info=None: 0.5)
    return RewardManager(conf, registry=reg)


def test_prepare_runs_once_per_kwargs_outside_the_timeout_and_again_after_close():
    fn = SlowStart(delay_s=1.0)
    conf = {
        "reward_fn_map": {"a": "slow", "b": "plain"},
        "kwargs": {"slow": {"scale": 2.0}},
        "shaping": [{"name": "slow", "weight": 0.5, "kwargs": {"scale": 3.0}}, {"name": "slow", "weight": 0.1}],
        "timeout_s": 0.5,  # shorter than prepare (1 s): charging it to a call would fail every sample
        "fallback_score": -1.0,
    }
    m = _manager(fn, conf)
    rows = [{"data_source": "a", "ground_truth": "x"}, {"data_source": "b", "ground_truth": "x"}]
    # score() prepares first when nobody has: the correctness kwargs and the two shaping entries' (one
    # of which repeats the correctness kwargs: prepared once)
    scores, extra, metrics = m.score(rows, ["x", "x"])
    assert sorted(p["scale"] for p in fn.prepared) == [2.0, 3.0]
    assert metrics["reward/timeouts"] == 0.0 and metrics["reward/failures"] == 0.0
    # a: 2.0 (correctness) + 0.5 * 3.0 + 0.1 * 2.0; b: 0.5 + 0.5 * 3.0 + 0.1 * 2.0
    assert scores == [pytest.approx(2.0 + 1.5 + 0.2), pytest.approx(0.5 + 1.5 + 0.2)]
    m.prepare()
    m.score(rows, ["x", "y"])
    assert len(fn.prepared) == 2  # idempotent
    m.close()
    assert fn.closed == 1
    m.prepare()  # after close (the judge stopped its server) it prepares again, for the data sources seen
    assert len(fn.prepared) == 4
    m.close()


def test_a_failing_prepare_raises_unchanged_and_unused_functions_are_not_started(tmp_path):
    class Broken(SlowStart):
        def prepare(self, kwargs):
            raise RuntimeError("the judge server exited while starting")

    reg = Registry(load_entry_points=False)
    reg.register("reward_function", "broken", Broken(0.0))
    unused = SlowStart(0.0)
    reg.register("reward_function", "unused", unused)
    m = RewardManager({"reward_fn_map": {"a": "broken", "b": "unused"}}, registry=reg)
    m.prepare({"b"})  # only the functions of these data sources start
    assert len(unused.prepared) == 1
    with pytest.raises(RuntimeError, match="exited while starting"):
        m.prepare({"a"})
    with pytest.raises(RuntimeError, match="exited while starting"):  # not marked prepared: tried again
        m.score([{"data_source": "a", "ground_truth": "x"}], ["x"])
    m.prepare({"b"})
    assert len(unused.prepared) == 1
    # a custom reward file scores every data source: its own prepare is called, the map's functions are not
    f = tmp_path / "my_reward.py"
    f.write_text(
        "calls = []\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n"
        "    return 1.0 if calls else -5.0\n"
        "def _prepare(kwargs):\n"
        "    calls.append(dict(kwargs))\n"
        "compute_score.prepare = _prepare\n"
    )
    conf = {
        "reward_fn_map": {"a": "broken"},
        "custom_reward_function": {"path": str(f), "name": "compute_score", "reward_kwargs": {"k": 1}},
    }
    m = RewardManager(conf, registry=reg)
    scores, _, _ = m.score([{"data_source": "a", "ground_truth": "x"}], ["x"])
    assert scores == [1.0] and m.custom is not None and m.custom.fn.__globals__["calls"] == [{"k": 1}]


def test_the_trainer_prepares_its_reward_managers_at_setup_before_any_rollout(tmp_path, monkeypatch):
    """A reward function that cannot start fails the run at setup, and the trainer closes what it built."""
    from rlplug.run.trainer import Trainer

    cfg = tiny_run_cfg(tmp_path)
    calls: list[str] = []

    def failing_prepare(self, data_sources=None):
        calls.append("prepare")
        raise RuntimeError("judge server did not start")

    monkeypatch.setattr(RewardManager, "prepare", failing_prepare)
    with pytest.raises(RuntimeError, match="judge server did not start"):
        Trainer(cfg)
    assert calls == ["prepare"]
    monkeypatch.undo()
    # the failed trainer released its run directory's lock and closed its engines: a new one starts there
    prepared: list[str] = []
    real = RewardManager.prepare

    def recording(self, data_sources=None):
        prepared.append(sorted(data_sources))
        real(self, data_sources)

    monkeypatch.setattr(RewardManager, "prepare", recording)
    trainer = Trainer(cfg)
    try:
        # the rule reward's manager (validation shares it here), for the train and validation files' sources
        assert prepared == [sorted(trainer.reward.seen_data_sources)] and prepared[0]
    finally:
        trainer.close()


def test_a_slow_starting_judge_server_is_not_charged_to_the_first_responses_timeouts():
    """The judge's server takes 5 s to listen (a model loading), the per-response timeout is 2 s:
    every response still gets its score, none times out, and no second server is started."""
    from rlplug.plugins.rewards import judge as judge_module

    cmd = [sys.executable, str(HERE / "fake_openai_server.py"), "--host", "{host}", "--port", "{port}"]
    cmd += ["--startup-delay", "5"]
    reg = Registry(load_entry_points=False)
    reg.register("reward_function", "judge", judge)
    kwargs = {"model_path": "fake-model", "server_cmd": cmd, "server_timeout_s": 120.0}
    conf = {"reward_fn_map": {"qa": "judge"}, "kwargs": {"judge": kwargs}, "fallback_score": -1.0, "timeout_s": 2.0}
    m = RewardManager(conf, registry=reg)
    rows = [{"data_source": "qa", "ground_truth": "4", "messages": [{"role": "user", "content": "2+2?"}]}] * 2
    try:
        t0 = time.perf_counter()
        m.prepare({"qa"})
        assert time.perf_counter() - t0 >= 5.0  # the server's start was waited for here
        (client,) = judge_module._CLIENTS.values()
        t0 = time.perf_counter()
        scores, extra, metrics = m.score(rows, ["4 [[score:9]]", "5 [[score:2]]"])
        assert time.perf_counter() - t0 < 4.0  # the batch's budget: 2 x 2 s, less than the server's start
        assert scores == [pytest.approx(0.9), pytest.approx(0.2)]
        assert metrics["reward/timeouts"] == 0.0 and metrics["reward/failures"] == 0.0
        assert list(judge_module._CLIENTS.values()) == [client]
        assert judge_module.judge_stats()["requests"] == 2
    finally:
        m.close()
        close_judges()
    assert judge_module._CLIENTS == {}
