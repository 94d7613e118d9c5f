"""Soak test: does the training loop leak memory over many steps?

Usage::

    OMP_NUM_THREADS=1 python benchmarks/soak.py [--steps 200] [--warmup 20] [--tolerance-mb 0.5]
        [--out benchmarks/results/soak_tiny.csv] [OVERRIDES ...]

Runs ``--steps`` training steps of the tiny-model experiment in this process through the Trainer
API (``debug=tiny``: random-weight 2-layer model with the real SmolLM2 tokenizer, PPO with a
critic, ``hf`` rollout, ``local`` backend, 4 prompts per step, responses of at most 16 tokens;
validation and a checkpoint every 25 steps, at most 2 kept; the console and MLflow trackers).
After every step a plugin's ``on_step_end`` records the resident set size (psutil RSS, MiB),
the Python heap objects count and the step's wall-clock time into ``--out`` (CSV: step, rss_mib,
py_objects, step_s). The slope of RSS over steps ``--warmup``..``--steps`` (least squares, MiB
per step) is printed with PASS when it is below ``--tolerance-mb``, else FAIL (exit code 1);
the slope over the second half is printed too (a leak keeps its slope, allocator growth levels
off). The default warm-up, 30 steps, includes the first validation and checkpoint (step 25),
whose one-time allocations are not leaks. A summary line goes to ``<out without .csv>.txt``.

Extra arguments are Hydra overrides (e.g. ``algorithm=grpo rollout.n=4``).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

import rlplug
from rlplug.config import compose
from rlplug.registry import get_registry
from rlplug.trainer import Trainer
from rlplug.validate import validate_config

RESULTS = Path(__file__).resolve().parent / "results"


class RssRecorder:
    """Records RSS (MiB), Python object count and step time after every training step."""

    def __init__(self) -> None:
        self.proc = psutil.Process()
        self.rows: list[tuple[int, float, int, float]] = []
        self.last = time.perf_counter()

    @rlplug.hookimpl
    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        now = time.perf_counter()
        rss = self.proc.memory_info().rss / 2**20
        self.rows.append((step, rss, len(gc.get_objects()), now - self.last))
        self.last = now


def slope(steps: np.ndarray, values: np.ndarray) -> float:
    """Least-squares slope of ``values`` over ``steps`` (units of values per step)."""
    return float(np.polyfit(steps.astype(float), values.astype(float), 1)[0])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=30, help="steps excluded from the slope")
    p.add_argument("--tolerance-mb", type=float, default=0.5, help="largest acceptable RSS slope, MiB/step")
    p.add_argument("--out", type=Path, default=RESULTS / "soak_tiny.csv")
    p.add_argument("--run-dir", type=Path, default=None, help="default: a temporary directory")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)

    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="rlplug-soak-"))
    overrides = [
        "debug=tiny",
        f"trainer.total_training_steps={args.steps}",
        "trainer.save_freq=25",
        "trainer.test_freq=25",
        "trainer.max_ckpt_to_keep=2",
        "trainer.val_before_train=false",
        "trainer.logger=[console,mlflow]",
        "data.val_max_samples=8",
        "trainer.num_threads=1",
        f"trainer.default_local_dir={run_dir}",
        *args.overrides,
    ]
    cfg = compose(overrides)
    validate_config(cfg)
    recorder = RssRecorder()
    get_registry().pm.register(recorder)
    start = time.perf_counter()
    trainer = Trainer(cfg)
    try:
        status = trainer.fit()
    finally:
        trainer.close()
    wall = time.perf_counter() - start

    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        f.write("step,rss_mib,py_objects,step_s\n")
        for step, rss, objs, dt in recorder.rows:
            f.write(f"{step},{rss:.2f},{objs},{dt:.4f}\n")
    data = np.array([(s, r, o) for s, r, o, _ in recorder.rows], dtype=float)
    tail = data[data[:, 0] >= args.warmup]
    rss_slope = slope(tail[:, 0], tail[:, 1])
    obj_slope = slope(tail[:, 0], tail[:, 2])
    half = data[data[:, 0] >= data[-1, 0] / 2]
    half_slope = slope(half[:, 0], half[:, 1])
    verdict = "PASS" if rss_slope < args.tolerance_mb and status == "finished" else "FAIL"
    summary = (
        f"soak {verdict}: {len(recorder.rows)} steps ({status}) in {wall:.0f} s; RSS {data[0, 1]:.0f} MiB after step 1, "
        f"{tail[0, 1]:.0f} MiB at step {int(tail[0, 0])}, {data[-1, 1]:.0f} MiB at step {int(data[-1, 0])} "
        f"(max {data[:, 1].max():.0f}); slope over steps {args.warmup}..{int(data[-1, 0])}: {rss_slope:+.4f} MiB/step "
        f"(tolerance < {args.tolerance_mb} MiB/step); over steps {int(half[0, 0])}..{int(data[-1, 0])}: "
        f"{half_slope:+.4f} MiB/step; Python objects {obj_slope:+.1f}/step; "
        f"median step {np.median([r[3] for r in recorder.rows]):.2f} s. "
        f"Overrides: {' '.join(overrides[:-1] + ['trainer.default_local_dir=<tmp>'])}. "
        f"Host: {os.cpu_count()} cores, torch threads 1."
    )
    print(summary)
    args.out.with_suffix(".txt").write_text(summary + "\n")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
