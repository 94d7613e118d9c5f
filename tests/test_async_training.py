"""Asynchronous training (issue 34): the equivalences that pin its semantics, on the tiny model.

* ``async`` at ``max_staleness=0`` (both stale policies) gives the same metrics and the same final weights as
  ``sync``, bit for bit (``rollout=hf``: one torch thread in the trainer, one in the engine's process; the same
  old-log-prob source: the trainer's pass, the engine's log-probs recorded, rollout_is=token in both);
* ``one_step_off`` equals a synchronous run whose engine is given, after each step, the weights of the step before
  (a hand-built sequence of sync steps whose rollouts use the previous step's weights);
* with a trainer slowed on purpose, ``stale_policy=drop`` regenerates and counts the stale groups and
  ``stale_policy=wait`` holds generation back and counts the waits; the staleness of every trained sample stays
  within the bound;
* the config checks refuse what an async mode cannot honour.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers import TINY_CPU_RUN, WALL_CLOCK, fake_server_cmd, run_config
from test_multi_turn_run import MULTI_TURN, echo_env  # noqa: F401 - echo_env: a fixture

from rlplug.config.schema import ConfigError
from rlplug.contracts.weights import DirectWeightTransfer
from rlplug.run.trainer import Trainer

#: the equivalence runs: 4 steps, 2 prompts x 2 responses, responses of 6 tokens, no validation
RUN = [
    *TINY_CPU_RUN,
    "rollout.num_threads=1",
    "rollout.n=2",
    "data.max_response_length=6",
    "trainer.total_training_steps=4",
    "trainer.save_freq=0",
    "trainer.logger=[console]",
]
#: the loss async modes use by default, given explicitly so that a sync run computes the same thing
DECOUPLED = [
    "rollout.calculate_log_probs=true",
    "actor.skip_old_log_prob_on_policy=false",
    "algorithm.rollout_correction.rollout_is=token",
]
#: metrics that only async runs report, or that measure time
SKIP = (*WALL_CLOCK, "async/", "wall_time")


def _train(cfg: Any, transfer: Any = None, slow_update_s: float = 0.0) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Train ``cfg``; returns the metrics of each step (from metrics.jsonl) and the final actor weights."""
    trainer = Trainer(cfg)
    try:
        if transfer is not None:
            trainer.weight_transfer = transfer
        if slow_update_s:
            update = trainer.backend.update_actor

            def slow(batch: Any) -> Any:
                time.sleep(slow_update_s)
                return update(batch)

            trainer.backend.update_actor = slow
        assert trainer.fit() == "finished"
        weights = {k: v.detach().clone() for k, v in trainer.backend.actor_weights()}
    finally:
        trainer.close()
    rows = [
        json.loads(line) for line in (Path(cfg.trainer.default_local_dir) / "metrics.jsonl").read_text().splitlines()
    ]
    return [r.get("metrics", r) for r in rows], weights


def _comparable(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith(SKIP)} for m in history]


def _assert_same(a: tuple[list[dict], dict], b: tuple[list[dict], dict]) -> None:
    ha, hb = _comparable(a[0]), _comparable(b[0])
    assert len(ha) == len(hb) == 4
    for step, (x, y) in enumerate(zip(ha, hb), 1):
        assert x.keys() == y.keys(), f"step {step}: {sorted(x.keys() ^ y.keys())}"
        diff = {k: (x[k], y[k]) for k in x if x[k] != y[k] and not (x[k] != x[k] and y[k] != y[k])}
        assert not diff, f"step {step} differs: {diff}"
    assert a[1].keys() == b[1].keys()
    for k in a[1]:
        assert torch.equal(a[1][k], b[1][k]), k


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], dict]:
    return _train(run_config([*RUN, *DECOUPLED], tmp_path_factory.mktemp("sync")))


@pytest.mark.parametrize("policy", ["wait", "drop"])
def test_async_at_staleness_zero_is_sync_bit_for_bit(sync_run, policy, tmp_path) -> None:
    cfg = run_config(
        [*RUN, *DECOUPLED, "trainer.async_mode=async", "trainer.max_staleness=0", f"trainer.stale_policy={policy}"],
        tmp_path,
    )
    got = _train(cfg)
    _assert_same(got, sync_run)
    assert all(m["async/staleness_max"] == 0.0 for m in got[0])
    if policy == "drop":  # the engine ran one batch ahead with the old weights: regenerated, counted
        assert sum(m["async/dropped"] for m in got[0]) >= 1


class _PreviousWeights(DirectWeightTransfer):
    """The hand-built one-step-off: each push gives the engine the weights of the push before (the initial model's
    at the first), so the rollouts of step k are made with the weights of step k - 2."""

    def __init__(self) -> None:
        super().__init__()
        self.previous: list[tuple[str, torch.Tensor]] | None = None

    def push(self, backend: Any, rollout: Any | None) -> None:
        now = [(k, v.detach().clone()) for k, v in backend.actor_weights()]
        if self.previous is not None:
            rollout.update_weights(iter(self.previous))
        self.previous = now
        self.version += 1


def test_one_step_off_equals_sync_steps_on_the_previous_weights(tmp_path) -> None:
    off = _train(run_config([*RUN, *DECOUPLED, "trainer.async_mode=one_step_off"], tmp_path / "off"))
    hand = _train(run_config([*RUN, *DECOUPLED], tmp_path / "hand"), transfer=_PreviousWeights())
    _assert_same(off, hand)
    assert [m["async/staleness_max"] for m in off[0]] == [0.0, 1.0, 1.0, 1.0]
    # and it is not the synchronous run: the rollouts did lag
    sync = _train(run_config([*RUN, *DECOUPLED], tmp_path / "sync"))
    assert not torch.equal(next(iter(sync[1].values())), next(iter(off[1].values())))


@pytest.mark.parametrize("policy", ["drop", "wait"])
def test_a_slow_trainer_has_stale_samples_dropped_or_waited_for(policy, tmp_path) -> None:
    cfg = run_config(
        [*RUN, "trainer.async_mode=async", "trainer.max_staleness=1", f"trainer.stale_policy={policy}"], tmp_path
    )
    history, _ = _train(cfg, slow_update_s=0.5)
    assert all(m["async/staleness_max"] <= 1.0 for m in history)
    dropped = sum(m["async/dropped"] for m in history)
    waited = sum(m["async/waited"] for m in history)
    if policy == "drop":
        # the engine ran two batches ahead while the trainer slept: the batch made two versions back was regenerated
        assert dropped >= 1
    else:
        assert dropped == 0 and waited >= 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.async_mode=later"], "trainer.async_mode=later is not one of"),
        (["trainer.async_mode=async", "trainer.max_staleness=-1"], "must be an integer >= 0"),
        (["trainer.async_mode=async", "trainer.stale_policy=skip"], "trainer.stale_policy=skip"),
        (["trainer.async_mode=one_step_off", "trainer.max_staleness=2"], "staleness 1"),
        (["trainer.async_mode=async", "rollout.calculate_log_probs=false"], "needs the engine's log-probs"),
        (["trainer.async_mode=async", "actor.skip_old_log_prob_on_policy=true"], "samples are off-policy"),
        (["rollout.partial_rollout=true"], "apply to the asynchronous modes only"),
        (["trainer.engine_cpus=[0]"], "apply to the asynchronous modes only"),
        (["trainer.max_staleness=2"], r"trainer.max_staleness bound the staleness of trainer.async_mode=async"),
        (["trainer.stale_policy=drop"], r"trainer.stale_policy bound the staleness of trainer.async_mode=async"),
        (["trainer.async_mode=one_step_off", "rollout.partial_rollout=true"], "only trainer.async_mode=async"),
        (["trainer.async_mode=async", "trainer.engine_cpus=[4096]"], "not among the usable CPUs"),
        (
            ["trainer.async_mode=async", "rollout.n_schedule.type=linear", "rollout.n_schedule.start=2"],
            "cannot be followed",
        ),
    ],
)
def test_async_settings_that_cannot_take_effect_are_refused(overrides, message, tmp_path) -> None:
    with pytest.raises(ConfigError, match=message):
        run_config([*RUN, *overrides], tmp_path)


def test_async_modes_default_to_the_decoupled_loss(tmp_path, capsys) -> None:
    cfg = run_config([*RUN, "trainer.async_mode=async"], tmp_path)
    assert cfg.rollout.calculate_log_probs is True
    assert cfg.actor.skip_old_log_prob_on_policy is False
    assert cfg.algorithm.rollout_correction.rollout_is == "token"
    assert "decoupled PPO" in capsys.readouterr().err
    bypass = run_config(
        [
            *RUN,
            "trainer.async_mode=async",
            "algorithm.rollout_correction.bypass_mode=true",
            "actor.policy_loss=bypass_mode",
        ],
        tmp_path / "b",
    )
    assert bypass.algorithm.rollout_correction.rollout_is is None  # bypass: the engine's log-probs are the old ones


def test_a_partial_rollout_carries_two_weight_versions(tmp_path) -> None:
    """rollout.partial_rollout: an engine slower than the trainer is interrupted by pushes between chunks; the
    responses continue under the new weights and their tokens carry both versions."""
    cfg = run_config(
        [
            *RUN,
            "trainer.async_mode=async",
            "trainer.max_staleness=1",
            "rollout.partial_rollout=true",
            "rollout.partial_chunk_tokens=2",
            "trainer.dump_rollouts=true",
        ],
        tmp_path,
    )
    trainer = Trainer(cfg)
    engine = trainer.rollout.engine  # behind the EngineGate
    generate = engine.generate

    def slow(prompt_ids: Any, params: Any) -> Any:
        time.sleep(0.3)  # each chunk; a step trains in about 0.2 s
        return generate(prompt_ids, params)

    engine.generate = slow
    versions: list[list[int]] = []
    take = trainer.pipeline.feed.take

    def spy(metrics: dict) -> Any:
        batch = take(metrics)
        versions.extend(batch.out.versions)
        return batch

    trainer.pipeline.feed.take = spy
    try:
        assert trainer.fit() == "finished"
    finally:
        trainer.close()
    history = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    multi = [v for v in versions if len(set(v)) > 1]
    assert multi, versions
    for v in multi:  # one switch to a newer version, never back
        assert v == sorted(v) and len(set(v)) == 2
    assert sum(m.get("metrics", m)["async/multi_version"] for m in history) == len(multi)
    assert all(m.get("metrics", m)["async/staleness_max"] <= 1.0 for m in history)


@pytest.mark.usefixtures("echo_env")
def test_multi_turn_episodes_run_in_async_modes(tmp_path) -> None:
    """The producer thread runs the environments' episodes; at staleness 0 they give the synchronous run's metrics
    and weights, bit for bit."""
    mt = [*RUN, *DECOUPLED, *MULTI_TURN, "trainer.logger=[console]", "trainer.total_training_steps=4"]
    sync = _train(run_config(mt, tmp_path / "sync"))
    got = _train(run_config([*mt, "trainer.async_mode=async", "trainer.max_staleness=0"], tmp_path / "async"))
    _assert_same(got, sync)
    assert all(m["multi_turn/turns_mean"] > 1.0 for m in got[0])


def test_verl_v1_trainer_keys_select_the_async_mode(tmp_path) -> None:
    cfg = run_config(
        [
            *RUN,
            "trainer.v1.trainer_mode=separate_async",
            "trainer.v1.sampler.max_off_policy_threshold=3",
            "trainer.v1.sampler.max_off_policy_strategy=drop",
        ],
        tmp_path,
    )
    assert (cfg.trainer.async_mode, cfg.trainer.max_staleness, cfg.trainer.stale_policy) == ("async", 3, "drop")
    assert run_config([*RUN, "trainer.v1.trainer_mode=sync"], tmp_path / "s").trainer.async_mode == "sync"
    # verl's whole config carries the sampler keys with trainer_mode=sync: accepted there, as in verl
    quiet = run_config([*RUN, "trainer.v1.sampler.max_off_policy_threshold=8"], tmp_path / "q")
    assert (quiet.trainer.async_mode, quiet.trainer.max_staleness) == ("sync", 8)
    with pytest.raises(ConfigError, match="trainer.async_mode=fully_async is not one of"):
        run_config([*RUN, "trainer.v1.trainer_mode=fully_async"], tmp_path / "f")


def test_an_async_checkpoint_resumed_in_sync_mode_skips_no_prompt(tmp_path, monkeypatch) -> None:
    """Stopped (SIGTERM) after step 1 of an async run with batches queued, resumed with async_mode=sync: the
    queued prompts are generated again, so the 4 steps train the epoch's 8 prompts once each, in order."""
    from test_async_kill import _trained_prompts

    from rlplug.base import faults

    base = [o for o in RUN if not o.startswith("trainer.total_training_steps")]
    common = [*base, *DECOUPLED, "data.train_size=8", "trainer.total_training_steps=4", "trainer.dump_rollouts=true"]
    monkeypatch.setenv(faults.FAULT_ENV, "update_actor:1:SIGTERM")
    faults.fault_counts.clear()
    trainer = Trainer(run_config([*common, "trainer.async_mode=async", "trainer.max_staleness=2"], tmp_path / "run"))
    try:
        assert trainer.fit() == "interrupted"
        queued = len(trainer.pipeline.feed.queue)
    finally:
        trainer.close()
    monkeypatch.delenv(faults.FAULT_ENV)
    state = json.loads((tmp_path / "run" / "global_step_1" / "trainer_state.json").read_text())
    assert len(state["async_feed"]["queue"]) == queued >= 1
    _train(run_config(common, tmp_path / "run"))
    _train(run_config(common, tmp_path / "ref"))
    steps = _trained_prompts(tmp_path / "run", 4)
    assert sorted(p for s in steps for p in s) == list(range(8))
    assert steps == _trained_prompts(tmp_path / "ref", 4)


def test_a_batch_filter_takes_its_generation_batches_from_the_producer(tmp_path) -> None:
    """DAPO's dynamic sampling in async mode: the filter draws as many queued batches as it needs; every batch
    trained keeps the staleness bound."""
    cfg = run_config(
        [
            *RUN,
            "algorithm.filter_groups.enable=true",
            "algorithm.filter_groups.metric=score",
            "trainer.async_mode=async",
            "trainer.max_staleness=1",
            "data.train_size=64",
            "trainer.total_training_steps=2",
        ],
        tmp_path,
    )
    history, _ = _train(cfg)
    assert len(history) == 2
    assert all(m["batch_filter/num_gen_batches"] >= 1 for m in history)
    assert all(m["async/staleness_max"] <= 1.0 for m in history)


def test_the_vllm_engine_binds_its_threads_to_engine_cpus(tmp_path) -> None:
    from rlplug.plugin import RunConfig, typed
    from rlplug.plugins.rollout.vllm import engine_cores

    cfg = run_config([*RUN, "trainer.async_mode=async", "trainer.engine_cpus=[0]"], tmp_path)
    assert engine_cores(typed(RunConfig, cfg)) == [0]
    assert engine_cores(typed(RunConfig, run_config(RUN, tmp_path / "s"))) == sorted(os.sched_getaffinity(0))


def test_the_trainer_runs_one_torch_thread_per_core_of_trainer_cpus_unless_told(monkeypatch) -> None:
    from rlplug.run.trainer import set_threads

    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "2"))  # set_threads may set it: restored
    before = torch.get_num_threads()
    try:
        set_threads(None, [0])
        assert torch.get_num_threads() == 1  # trainer.trainer_cpus=[0], trainer.num_threads unset
        set_threads(2, [0])
        assert torch.get_num_threads() == 2  # trainer.num_threads given: it is used
        set_threads(None)
        assert torch.get_num_threads() == (os.cpu_count() or 1)
    finally:
        torch.set_num_threads(before)


def _train_within(cfg: Any, seconds: float) -> list[dict]:
    """:func:`_train` on a daemon thread; fails when it has not finished in ``seconds`` (a deadlock)."""
    import threading

    box: dict[str, Any] = {}

    def main() -> None:
        try:
            box["history"] = _train(cfg)[0]
        except BaseException as exc:  # handed to the test's thread
            box["error"] = exc

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"training did not finish in {seconds} s: a deadlock"
    if "error" in box:
        raise box["error"]
    return box["history"]


@pytest.mark.parametrize("bound", [0, pytest.param(1, marks=pytest.mark.slow)])  # bound 1: CI's slow step
def test_a_batch_filter_that_needs_more_draws_than_the_bound_lets_ahead_does_not_hang(
    tmp_path, rlplug_full_registry, bound
) -> None:
    """A filter that keeps every third generation batch: each step needs 3 draws, more than the producer may run
    ahead of training (1 at max_staleness=0, 2 at 1). The step's extra draws are generated on demand with the
    current weights, so they are trained at staleness 0 and the bound holds."""
    from rlplug.contracts.types import BatchFilter

    calls: list[int] = []

    def every_third(data: Any, config: Any) -> torch.Tensor:
        calls.append(1)
        return torch.full((data["index"].shape[0],), len(calls) % 3 == 0, dtype=torch.bool)

    rlplug_full_registry.register("batch_filter", "every_third", BatchFilter(every_third))
    cfg = run_config(
        [
            *RUN,
            "algorithm.batch_filter=every_third",
            "trainer.async_mode=async",
            f"trainer.max_staleness={bound}",
            "data.train_size=64",
            "trainer.total_training_steps=2",
        ],
        tmp_path,
    )
    history = _train_within(cfg, 300)
    assert [m["batch_filter/num_gen_batches"] for m in history] == [3.0, 3.0]
    assert len(calls) == 6
    # the batch trained is each step's third draw, generated on demand with the step's weights: staleness 0
    assert [m["async/staleness_max"] for m in history] == [0.0, 0.0]


@pytest.mark.slow  # a fake server and 2 async steps (CI's slow step)
def test_multi_turn_episodes_with_a_server_engine_run_in_async_mode(tmp_path, echo_env) -> None:  # noqa: F811
    """A server engine runs a multi-turn batch's trajectories on threads of their own, each calling the engine
    while the producer holds the batch's weight version: the calls go through (they used to wait for the
    producer, which waited for them). The fake SGLang server of tests/fake_sglang_server.py."""
    from omegaconf import OmegaConf

    cfg = run_config(
        [
            *RUN,
            *MULTI_TURN,
            "rollout=sglang",
            "trainer.logger=[console]",
            "trainer.async_mode=async",
            "trainer.max_staleness=1",
            "trainer.total_training_steps=2",
        ],
        tmp_path,
    )
    OmegaConf.set_readonly(cfg, False)
    cfg.rollout.server_cmd = fake_server_cmd()
    history = _train_within(cfg, 300)
    assert len(history) == 2
    assert all(m["multi_turn/turns_mean"] > 1.0 for m in history)
    assert all(m["async/staleness_max"] <= 1.0 for m in history)
