"""benchmarks/async_modes.py: the figures it derives from ``metrics.jsonl`` records (hand-made numbers), the
configurations' overrides, the learning table of a resumable run directory, and the /proc thread sampler."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import async_modes as am


def _records() -> list[dict]:
    # step 0: the validation before training (no timing); step 1: warm-up, left out of every figure
    return [
        {"step": 0, "wall_time": 90.0, "val-core/basic_arithmetic/acc/mean@1": 0.1},
        {
            "step": 1,
            "wall_time": 100.0,
            "timing_s/step": 10.0,
            "response_length/mean": 50.0,
            "async/overlap_share": 0.9,
        },
        {"step": 2, "wall_time": 105.0, "timing_s/step": 4.0, "response_length/mean": 40.0, "async/overlap_share": 0.2},
        {"step": 3, "wall_time": 111.0, "timing_s/step": 6.0, "response_length/mean": 60.0, "async/overlap_share": 0.4},
        {"step": 4, "wall_time": 118.0, "timing_s/step": 7.0, "response_length/mean": 50.0, "async/overlap_share": 0.6},
    ]


def test_speed_summary_leaves_out_step_one_and_counts_tokens_per_response() -> None:
    s = am.speed_summary(_records(), responses_per_step=32, critic_warmup=2)
    assert s["steps"] == [2, 3, 4]
    assert s["step_s_mean"] == pytest.approx(17 / 3)
    assert s["step_s_median"] == 6.0
    assert s["wall_s_per_step"] == pytest.approx((118 - 100) / 3)
    assert s["response_tokens"] == [1280.0, 1920.0, 1600.0]
    assert s["s_per_1k_tokens"] == pytest.approx(1000 * 17 / 4800)
    # steps 3 and 4 come after the critic warm-up of 2 steps
    assert s["after_warmup"]["steps"] == 2
    assert s["after_warmup"]["step_s_mean"] == pytest.approx(6.5)
    assert s["after_warmup"]["s_per_1k_tokens"] == pytest.approx(1000 * 13 / 3520)
    assert s["async"]["async/overlap_share"] == pytest.approx(0.4)  # step 1's 0.9 left out
    assert "async/wait_push_s" not in s["async"]


def test_speed_summary_without_the_batch_size_counts_tokens_through_the_generation_rate() -> None:
    recs = [
        {"step": 1, "timing_s/step": 9.0, "perf/gen_tokens_per_s": 50.0, "timing_s/gen": 1.0},
        {"step": 2, "timing_s/step": 3.0, "perf/gen_tokens_per_s": 100.0, "timing_s/gen": 2.5},
    ]
    s = am.speed_summary(recs, responses_per_step=None)
    assert s["response_tokens"] == [250.0]
    assert s["s_per_1k_tokens"] == pytest.approx(12.0)
    with pytest.raises(ValueError, match="No training step after step 1"):
        am.speed_summary(recs[:1], responses_per_step=4)


def test_mode_overrides_give_the_engine_the_first_core_and_the_trainer_the_second() -> None:
    assert am.mode_overrides("sync", [0, 1]) == ["trainer.async_mode=sync", "trainer.num_threads=2"]
    got = am.mode_overrides("async", [2, 5])
    assert "trainer.engine_cpus=[2]" in got and "trainer.trainer_cpus=[5]" in got
    assert "trainer.max_staleness=1" in got and "trainer.stale_policy=wait" in got and "rollout.num_threads=1" in got
    assert am.thread_env(got)["OMP_NUM_THREADS"] == "1"
    with pytest.raises(ValueError, match="a core each"):
        am.mode_overrides("one_step_off", [0])
    with pytest.raises(ValueError, match="Unknown mode 'sync2'"):
        am.mode_overrides("sync2", [0, 1])


def test_learning_table_reads_the_curve_the_minutes_and_whether_a_run_finished(tmp_path: Path) -> None:
    key = "val-core/basic_arithmetic/acc/mean@1"
    done = tmp_path / "ppo" / "sync" / "seed_0"
    done.mkdir(parents=True)
    lines = [
        {"step": 0, "wall_time": 1000.0, key: 0.1},
        {"step": 1, "wall_time": 1030.0, "timing_s/step": 30.0},
        {"step": 2, "wall_time": 1120.0, "timing_s/step": 30.0, key: 0.25},
    ]
    (done / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 3, "wall')
    attempts = [{"wall_s": 60.0, "exit_code": 75}, {"wall_s": 90.0, "exit_code": 0}]
    (done / am.META).write_text(json.dumps({"overrides": [], "attempts": attempts}))
    cut = tmp_path / "ppo" / "one_step_off" / "seed_0"  # stopped after step 1: not finished
    cut.mkdir(parents=True)
    (cut / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines[:2]))
    info = {"date": "d", "cpu_model": "c", "isa_flags": [], "cores": 2, "matmul_peak_bf16_gflops": 1.0, "torch": "t"}
    info["loadavg_at_start"] = 0.0
    doc = am.write_learning(tmp_path, ["ppo"], ["sync", "one_step_off"], [0], 2, 1, info, "cmd", True, tmp_path / "r")
    first, second = doc["runs"]
    assert first["finished"] and not second["finished"]
    assert first["acc"] == {"0": 0.1, "2": 0.25} and second["acc"] == {"0": 0.1}
    assert first["minutes"] == 2.5 and first["minutes_from_step0_validation"] == 2.0 and first["step_minutes"] == 1.0
    assert first["exit_codes"] == [75, 0]
    assert first["date"] == "1970-01-01 00:16 UTC"  # when its step-0 validation was recorded (wall time 1000 s)
    assert "| ppo | sync | 0 | 10.0% |  | 25.0% | 2.5 | 1.0 |" in doc["table"]
    assert "| **ppo** | **sync** | mean | 10.0% |  | 25.0% | 2.5 | 1.0 |" in doc["table"]
    assert json.loads((tmp_path / "r.json").read_text())["runs"][0]["metric"] == key
    assert doc["table"] in (tmp_path / "r.md").read_text()


def test_learning_rows_carry_over_sessions_only_on_the_same_cpu_kind_and_settings(tmp_path: Path) -> None:
    info = {"date": "now", "cpu_model": "EPYC", "isa_flags": ["avx2"], "cores": 2, "torch": "t"}
    info |= {"matmul_peak_bf16_gflops": 1.0, "loadavg_at_start": 0.0}
    here = {"cpu_model": "EPYC", "isa_flags": ["avx2"], "cores": 2}
    other = {"cpu_model": "Xeon", "isa_flags": ["amx_tile"], "cores": 2}
    row = {"recipe": "ppo", "mode": "sync", "finished": True, "overrides": ["a=1"], "acc": {"0": 0.5}}
    runs = [
        {**row, "seed": 0, "machine": here, "date": "then"},
        {**row, "seed": 1, "machine": other},  # another CPU kind: rerun
        {**row, "seed": 2, "machine": here, "finished": False},  # unfinished: rerun
    ]
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps({"steps": 30, "test_freq": 10, "runs": runs}))
    carried = am.carried_runs(path, info, 30, 10)
    assert list(carried) == [("ppo", "sync", 0)]
    assert am.carried_runs(path, info, 20, 10) == {}  # other step count: nothing carried
    # the run directory is gone (a new session): the table takes the carried row and says so
    doc = am.write_learning(
        tmp_path / "gone", ["ppo"], ["sync"], [0, 1], 30, 10, info, "cmd", False, tmp_path / "r", carried
    )
    first, second = doc["runs"]
    assert first["carried"] and first["acc"] == {"0": 0.5} and not second["finished"]
    assert "ppo sync 0 (then)" in (tmp_path / "r.md").read_text()
    assert am._portable(["x=1", "trainer.default_local_dir=/somewhere"]) == ["x=1"]


def test_a_finished_run_drops_its_checkpoints_and_keeps_its_records(tmp_path: Path) -> None:
    run = tmp_path / "grpo" / "sync" / "seed_0"
    for step, size in ((10, 300), (20, 500)):
        (run / f"global_step_{step}" / "actor").mkdir(parents=True)
        (run / f"global_step_{step}" / "actor" / "model.safetensors").write_bytes(b"x" * size)
    (run / "final_model").mkdir()
    (run / "final_model" / "model.safetensors").write_bytes(b"y" * 7)
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "global_step_notes.txt").write_text("a file, not a checkpoint")
    assert am.drop_checkpoints(run) == 800
    assert sorted(p.name for p in run.iterdir()) == ["final_model", "global_step_notes.txt", "metrics.jsonl"]
    assert am.drop_checkpoints(run) == 0


def test_tree_sampler_counts_this_process_cpu_time_on_the_cores_it_ran_on() -> None:
    sampler = am.TreeSampler(os.getpid())
    sampler.start_window()
    c0 = time.process_time()
    while time.process_time() - c0 < 0.5:
        pass
    sampler.sample()
    spent = time.process_time() - c0
    rep = sampler.report()
    me = rep["processes"]["trainer"]
    assert me["cpu_s"] == pytest.approx(spent, abs=0.06)  # clock ticks of 10 ms, per thread
    assert set(int(c) for c in me["cpu_s_by_core"]) <= set(os.sched_getaffinity(0))
    assert rep["machine_cpu_s"] >= rep["tree_cpu_s"] - 0.06 and rep["other_cpu_s"] >= 0.0
