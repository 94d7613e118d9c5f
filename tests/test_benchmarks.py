"""The benchmark scripts keep working: a tiny run through ``bench_step.py``, the TRL-comparison
table from hand-made timings, and the workload both sides of that comparison train on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_vs_trl
from _trl_worker import arithmetic_workload, last_integer_reward


def test_breakdown_runs_a_tiny_experiment_and_reports_every_stage(tmp_path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH / "bench_step.py"),
            "breakdown",
            "--steps",
            "2",
            "--out-dir",
            str(tmp_path),
            "--",
            "debug=tiny",
            "model.tiny.num_hidden_layers=1",
            "trainer.num_threads=1",
            "trainer.device=cpu",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "step_breakdown.json").read_text())
    steps = result["raw"]["steps"]
    assert len(steps) == 2
    s = result["summary"]
    # the summary is step 2's figures (medians over the steps after the first)
    assert s["step"] == pytest.approx(steps[1]["timing_s/step"])
    assert s["gen"] == pytest.approx(steps[1]["timing_s/gen"]) and s["update_actor"] > 0
    assert s["train_tokens_per_s"] == pytest.approx(
        steps[1]["perf/total_num_tokens"] / steps[1]["timing_s/update_actor"]
    )
    assert 0 < s["peak_rss_gib"] < 64
    assert "| update_actor |" in (tmp_path / "step_breakdown.md").read_text()


def test_trl_comparison_table_from_hand_made_timings() -> None:
    runs = {
        # first step of each run dropped: trl 30, 32 | 28, 30 -> median 30; tokens 1000 each
        "trl": [
            {"seconds": [99, 30, 32], "response_tokens": [1, 1000, 1000], "peak_rss_gib": 6.0, "startup_s": 8},
            {"seconds": [99, 28, 30], "response_tokens": [1, 1000, 1000], "peak_rss_gib": 6.5, "startup_s": 9},
        ],
        # 10 s for 500 tokens and 10 s for 1000 tokens: median 10 s/step, 15 s per 1k tokens
        "rlplug-vllm": [
            {
                "seconds": [99, 10, 10],
                "response_tokens": [1, 500, 1000],
                "peak_rss_gib": 8.0,
                "startup_s": 14,
                "stages": {"timing_s/gen": [9, 3, 5], "timing_s/update_actor": [9, 6, 4]},
            }
        ],
    }
    text, summary = bench_vs_trl.render(runs, {"cores": 2, "loadavg_at_start": 0.0}, 2, 3)
    assert summary["trl"]["median_s_per_step"] == 30 and summary["trl"]["s_per_1k_response_tokens"] == 30
    assert summary["rlplug-vllm"]["median_s_per_step"] == 10
    assert summary["rlplug-vllm"]["s_per_1k_response_tokens"] == 15  # median of 20 and 10
    assert summary["trl"]["peak_rss_gib"] == 6.5
    row = next(line for line in text.splitlines() if line.startswith("| rlplug-vllm"))
    assert "| 3.00x | 2.00x |" in row
    assert "- rlplug-vllm: generation 4.00 s, actor update 5.00 s, weight push 0.00 s" in text
    # with TRL in bf16 as well, the ratios are against the faster TRL variant (20 s/step, 20 s per 1k)
    runs["trl-bf16"] = [
        {"seconds": [99, 20, 20], "response_tokens": [1, 1000, 1000], "peak_rss_gib": 6, "startup_s": 9}
    ]
    text, _ = bench_vs_trl.render(runs, {"cores": 2, "loadavg_at_start": 0.0}, 2, 3)
    row = next(line for line in text.splitlines() if line.startswith("| rlplug-vllm"))
    assert "| 2.00x | 1.33x |" in row


def test_both_sides_train_on_the_same_prompts_and_reward(tmp_path) -> None:
    import pyarrow.parquet as pq

    items = arithmetic_workload(64, seed=0)
    path = tmp_path / "w.parquet"
    bench_vs_trl.write_parquet(path)
    rows = pq.read_table(path).to_pylist()
    assert [r["prompt"][0]["content"] for r in rows] == [i["question"] for i in items]
    assert [r["reward_model"]["ground_truth"] for r in rows] == [i["answer"] for i in items]
    q = items[0]["question"]
    a, b = (int(x) for x in q.split("What is ")[1].split("?")[0].split(" + "))
    assert items[0]["answer"] == str(a + b)
    completions = [
        [{"role": "assistant", "content": f"{a} + {b} = {a + b}\n#### {a + b}"}],
        [{"role": "assistant", "content": f"#### {a + b + 1}"}],
    ]
    assert last_integer_reward(completions, [items[0]["answer"]] * 2) == [1.0, 0.0]


def _write_history(path: Path, points: dict[int, float], key: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"step": s, "metrics": {key: v}}) + "\n" for s, v in points.items()))


def test_learning_check_curve_over_seeds_from_run_dirs_and_copied_files(tmp_path) -> None:
    """Mean and min-max per step over seeds; a seed that stopped early counts only where it got;
    a step logged twice (a resumed seed) keeps the last value; both folder layouts are read."""
    import learning_check

    key = "val-core/basic_arithmetic/acc/mean@1"
    _write_history(tmp_path / "seed_1_validations.jsonl", {0: 0.075, 10: 0.255, 20: 0.38}, key)
    _write_history(tmp_path / "seed_2" / "validations.jsonl", {0: 0.075, 10: 0.19}, key)
    with open(tmp_path / "seed_2" / "validations.jsonl", "a") as f:  # resumed: step 10 seen again
        f.write(json.dumps({"step": 10, "metrics": {key: 0.2}}) + "\n")
    _write_history(tmp_path / "seed_3" / "validations.jsonl", {0: 0.075, 10: 0.31, 20: 0.30}, key)
    (tmp_path / "seed_x").mkdir()  # not a seed folder: ignored

    rows = learning_check.curve(learning_check.seed_histories(tmp_path), key)
    assert [r["step"] for r in rows] == [0, 10, 20]
    assert rows[1]["per_seed"] == {1: 0.255, 2: 0.2, 3: 0.31}
    assert rows[1]["mean"] == pytest.approx((0.255 + 0.2 + 0.31) / 3)
    assert (rows[1]["min"], rows[1]["max"], rows[1]["n_seeds"]) == (0.2, 0.31, 3)
    assert rows[2]["n_seeds"] == 2 and rows[2]["mean"] == pytest.approx(0.34)
    table = learning_check.curve_markdown(rows, 100.0)
    assert "| 10 | 3 | **25.5%** | 20.0% - 31.0% | 25.5% | 20.0% | 31.0% |" in table

    # the CLI writes the curve next to the seeds and prints the table
    out = subprocess.run(
        [sys.executable, str(BENCH / "learning_check.py"), "grpo", "--summarize", str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "| 20 | 2 | **34.0%** | 30.0% - 38.0% |" in out
    saved = json.loads((tmp_path / "curve_acc.json").read_text())
    assert saved["metric"] == key and [r["step"] for r in saved["rows"]] == [0, 10, 20]


def test_soak_summary_from_a_csv_gives_the_hand_computed_slopes(tmp_path):
    """``soak.py --summarize``: RSS 1000 + 2 * step MiB after a jump at step 3 -> slope +2.0 MiB/step from
    the warm-up on; a warm-up past the run's end is lowered to the step a third of the way in."""
    import soak

    csv = tmp_path / "soak_real.csv"
    rows = ["step,rss_mib,py_objects,step_s,tree_rss_mib,tree_fds,tree_procs,shm_files,shm_mib"]
    for step in range(1, 13):
        rss = 500.0 if step < 3 else 1000.0 + 2.0 * step
        rows.append(f"{step},{rss},{1000 + step},10.0,{rss + 4000.0},69,2,1,256.0")
    csv.write_text("\n".join(rows) + "\n")
    assert soak.summarize_csv(csv, warmup=3, tolerance_mb=0.5) == 1  # +2 MiB/step: FAIL
    text = csv.with_suffix(".txt").read_text()
    assert "slope over steps 3..12: +2.0000 MiB/step" in text and "+1.0/step" in text
    assert "12 steps in 120 s" in text and "open fds 69 after step 1, 69 at the last step" in text
    assert soak.fit_warmup(np.arange(1, 13, dtype=float), 20) == 5  # steps[12 // 3]
    assert soak.fit_warmup(np.arange(1, 13, dtype=float), 3) == 3
    flat = tmp_path / "flat.csv"
    flat.write_text("step,rss_mib,py_objects,step_s\n" + "".join(f"{s},700.0,5,1.0\n" for s in range(1, 9)))
    assert soak.summarize_csv(flat, warmup=2, tolerance_mb=0.5) == 0


def test_time_to_accuracy_counts_from_the_first_validation(tmp_path) -> None:
    """Minutes to the first validation at or above the target, counted from the step-0 validation
    (wall_s 30 s); a seed that never reaches it has no mean; the verdict compares the mean."""
    import time_to_accuracy as tta

    key = "val-core/basic_arithmetic/acc/mean@1"
    rows = {1: [(0, 30.0, 0.065), (4, 150.0, 0.23), (8, 270.0, 0.41), (12, 390.0, 0.39)]}
    rows[2] = [(0, 20.0, 0.07), (5, 320.0, 0.40)]  # exactly the target counts
    for seed, points in rows.items():
        (tmp_path / f"seed_{seed}").mkdir()
        with open(tmp_path / f"seed_{seed}" / "validations.jsonl", "w") as f:
            for step, wall, acc in points:
                f.write(json.dumps({"step": step, "metrics": {key: acc}, "wall_s": wall}) + "\n")
    s = tta.summarize(tmp_path, key, 0.40, 6.0)
    assert s["seeds"]["seed_1"]["steps_to_target"] == 8
    assert s["seeds"]["seed_1"]["minutes_to_target"] == pytest.approx((270 - 30) / 60)  # 4.0
    assert s["seeds"]["seed_2"]["minutes_to_target"] == pytest.approx(5.0)
    assert s["mean_minutes"] == pytest.approx(4.5)
    assert "mean 4.5 min: PASS (target < 6 min)" in s["table"]
    assert "| seed_1 | 8 | 4.0 | 0: 6.5%, 4: 23.0%, 8: 41.0%, 12: 39.0% |" in s["table"]
    (tmp_path / "seed_3").mkdir()
    (tmp_path / "seed_3" / "validations.jsonl").write_text(json.dumps({"step": 0, "metrics": {key: 0.1}, "wall_s": 9}))
    s = tta.summarize(tmp_path, key, 0.40, 6.0)
    assert s["mean_minutes"] is None and "not reached by every seed" in s["table"]


def _mfu_data(variants: dict, rounds: int = 1) -> dict:
    """``bench_update_mfu.render``'s input with a 1000 GFLOP/s bf16 peak and the given variants."""
    return {
        "machine": {"cpu_model": "X", "isa_flags": ["amx_bf16"], "cores": 2, "loadavg_at_start": 0.1, "torch": "2"},
        "peak": {
            "bf16": {"gflops": 1000.0, "threads": 2, "per_shape": {"2048x2048x2048": 1000.0}},
            "fp32": {"gflops": 250.0},
        },
        "rows": 32,
        "tokens": 4000,
        "response_tokens": 2000,
        "responses": "mixed",
        "reps": 3,
        "rounds": rounds,
        "variants": variants,
    }


def test_update_mfu_table_from_hand_made_timings() -> None:
    """MFU = model FLOPs / median seconds (first call dropped) / the measured bf16 peak."""
    import bench_update_mfu

    default = {
        "times": {"update_critic": [30.0, 4.0, 6.0], "update_actor": [9.0, 8.0, 8.0]},
        "flops": {"update_critic": 2.0e12, "update_actor": 3.2e12},
        "build_s": 3.0,
    }
    data = _mfu_data({"default": default})
    table = bench_update_mfu.render(data)
    # critic: median of (4, 6) = 5 s -> 400 GFLOP/s -> 40%; actor: 8 s -> 400 GFLOP/s -> 40%
    assert "| default | " in table and "| 5.00 | 400 | 40% | 8.00 | 400 | 40% | 3 |" in table
    assert "bf16 1000 GFLOP/s" in table


def test_update_mfu_rounds_pool_the_kept_times_and_the_profile_splits_the_update() -> None:
    """Rounds: each round's first call dropped, the rest pooled; profile: matmul rate and the rest."""
    import bench_update_mfu

    data = _mfu_data(
        {
            "default": {
                "times": {"update_critic": [30.0, 4.0, 4.0], "update_actor": [9.0, 8.0, 8.0]},
                "round_times": [
                    {"update_critic": [30.0, 4.0, 4.0], "update_actor": [9.0, 8.0, 8.0]},
                    {"update_critic": [99.0, 6.0, 6.0], "update_actor": [9.0, 16.0, 16.0]},
                ],
                "flops": {"update_critic": 2.0e12, "update_actor": 3.2e12},
                "build_s": 3.0,
                "profile": {
                    "update_critic": {
                        "wall_s": 6.0,
                        "matmul_s": 2.0,
                        "matmul_flops": 1.0e12,
                        "compiled_elementwise_s": 1.5,
                        "optimizer_s": 0.5,
                    }
                },
            }
        },
        rounds=2,
    )
    table = bench_update_mfu.render(data)
    # critic: median of (4, 4, 6, 6) = 5 s -> 400 GFLOP/s = 40%; actor: median of (8, 8, 16, 16) = 12 s
    assert "| default | " in table and "| 5.00 | 400 | 40% | 12.00 | 267 | 27% | 3 |" in table
    assert "over 2 rounds" in table and "| default | 4.00 / 8.00 | 6.00 / 16.00 |" in table
    # 1e12 FLOP in 2 s of matmuls = 500 GFLOP/s = 50% of the peak; rest = 6 - 2 - 1.5 - 0.5 = 2
    assert "| default | critic | 6.00 | 2.00 | 500 (50%) | 1.50 | 0.50 | 2.00 |" in table
    # a failed round: its cell says so and the pooled median uses the rounds that ran
    data["variants"]["default"]["round_times"].insert(1, None)
    data["rounds"] = 3
    table = bench_update_mfu.render(data)
    assert "| default | 4.00 / 8.00 | failed | 6.00 / 16.00 |" in table
    assert "| 5.00 | 400 | 40% | 12.00 | 267 | 27% | 3 |" in table
    # every round failed: the variant's row says failed
    data["variants"]["eager"] = {"round_times": [None, None, None], "error": "variant eager failed (exit 1)"}
    assert "| eager | no torch.compile | failed: variant eager failed (exit 1) |" in bench_update_mfu.render(data)


def test_matmul_shapes_table_gives_each_layout_as_a_share_of_the_peak() -> None:
    import bench_matmul_shapes as bms

    info = {"cpu_model": "X", "isa_flags": ["amx_bf16"], "cores": 2, "torch": "2"}
    res = {
        "projections": {
            name: {"forward x W^T": 1800.0, "input grad gy W": 1000.0, "weight grad gy^T x": 500.0}
            for name in bms.PROJECTIONS
        },
        "attention q k^T": 700.0,
        "attention shape": "72 x 175 x 175 x 64",
    }
    peak = {"gflops": 2000.0, "threads": 2, "per_shape": {"2048x2048x2048": 1900.0, "2048x576x1536": 2000.0}}
    table = bms.render(info, peak, 1400, res)
    assert "| k_proj / v_proj (192 x 576) | 1800 (90%) | 1000 (50%) | 500 (25%) |" in table
    assert "700 GFLOP/s (35%)" in table and "Rows: 1400 tokens" in table and "**2000 GFLOP/s**" in table
    # the timer: a call that does nothing counted as 1 GFLOP runs far above any real rate
    assert bms.gflops(lambda: None, 1e9, windows=1, seconds=0.01) > 1e5  # _machine.gflops, imported there
