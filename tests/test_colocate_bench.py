"""benchmarks/colocate.py: the figures it derives from ``metrics.jsonl`` records (hand-made numbers), the record
comparison of its kill-and-resume check, and the /proc memory sampler's roles."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import colocate as cb


def test_summary_leaves_out_step_one_and_averages_the_rest() -> None:
    records = [
        {"step": 1, "timing_s/step": 50.0, "timing_s/gen": 40.0},
        {"step": 2, "timing_s/step": 10.0, "timing_s/gen": 4.0, "rollout/gen_s_rank_max": 3.0},
        {"step": 3, "timing_s/step": 14.0, "timing_s/gen": 6.0, "rollout/gen_s_rank_max": 5.0},
    ]
    s = cb.summary(records)
    assert s["steps"] == [2, 3] and s["timing_s/step"] == 12.0 and s["timing_s/gen"] == 5.0
    assert s["rollout/gen_s_rank_max"] == 4.0 and s["rollout/gen_s_rank_min"] is None


def test_numbers_drop_clocks_and_memory_but_keep_the_training_numbers() -> None:
    rec = {"step": 3, "timing_s/gen": 1.0, "perf/rss_gb": 2.0, "wall_time": 5.0, "actor/pg_loss": 0.25}
    assert cb.numbers(rec) == {"step": 3, "actor/pg_loss": 0.25}


def test_memory_sampler_puts_a_child_with_rank_in_its_environment_under_that_rank() -> None:
    env = {"RANK": "1", "PATH": "/usr/bin:/bin"}
    child = subprocess.Popen([sys.executable, "-c", "import time; x = bytearray(50 * 2**20); time.sleep(30)"], env=env)
    try:
        sampler = cb.MemorySampler(root=os.getpid())
        deadline = time.time() + 20
        while time.time() < deadline and sampler.peak.get("rank 1", 0.0) < 50:
            sampler.sample()
            time.sleep(0.2)
        assert sampler.peak["rank 1"] >= 50  # the child's 50 MiB buffer, in MiB
        assert sampler.peak["launcher"] > 0 and sampler.peak_total >= sampler.peak["rank 1"]
    finally:
        child.kill()
        child.wait()
