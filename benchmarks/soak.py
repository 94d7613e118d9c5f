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

``--real-minutes M`` soaks the default experiment instead (the real SmolLM2-135M-Instruct, PPO
with a critic, the vLLM rollout engine in its child process, the reward worker pool): as many
steps as fit in ``M`` minutes (``trainer.max_wall_time_s``), validation on 32 held-out problems
and a checkpoint every 10 steps (2 kept), MLflow on. There each row also holds the resident
memory of the whole process tree (the trainer plus the vLLM engine and reward workers), the open
file descriptors of the tree and the files and bytes in ``/dev/shm``; the summary gives them at
start and end. Results go to ``benchmarks/results/soak_real.csv`` and ``.txt`` by default.

``--diagnose`` tells a leak from allocator growth: after every step it also writes, to
``<out without .csv>_memory.csv``, the trainer's RSS split into anonymous, file-backed and
shared-memory pages (``/proc/self/status``: RssAnon, RssFile, RssShmem), glibc's heap in use and
held-but-free (``mallinfo2``: uordblks + hblkhd, and fordblks), and the bytes of live torch
tensors the garbage collector can reach (unique storages, MiB). Growing free heap with flat
tensor bytes is fragmentation; growing tensor bytes is a live reference; growing RssShmem is
shared memory (the weight pushes to the engine). ``--trim`` calls glibc's ``malloc_trim(0)``
after each step's record and logs the RSS after it too (it returns freed heap to the system). The
trainer itself trims after every step unless ``trainer.malloc_trim=false`` (:mod:`rlplug.base.host_memory`);
pass that override to measure the allocator's growth without it.

Extra arguments are Hydra overrides (e.g. ``algorithm=grpo rollout.n=4``).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import psutil

import rlplug
from rlplug.base.host_memory import heap_mib, malloc_trim
from rlplug.config.compose import compose
from rlplug.contracts.registry import get_registry
from rlplug.run.trainer import Trainer
from rlplug.run.validate import validate_config

RESULTS = Path(__file__).resolve().parent / "results"


def tree_usage(proc: psutil.Process) -> tuple[float, int, int]:
    """``(rss_mib, open_fds, processes)`` summed over ``proc`` and its live descendants."""
    rss, fds, n = 0.0, 0, 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            rss += p.memory_info().rss / 2**20
            fds += p.num_fds()
            n += 1
        except psutil.Error:  # a child that ended between the listing and the read
            continue
    return rss, fds, n


def shm_usage(root: Path = Path("/dev/shm")) -> tuple[int, float]:
    """``(files, MiB)`` in ``root`` (0, 0.0 where it does not exist)."""
    files, size = 0, 0
    if root.is_dir():
        for f in root.rglob("*"):
            try:
                if f.is_file():
                    files += 1
                    size += f.stat().st_size
            except OSError:
                continue
    return files, size / 2**20


def status_mib(fields: tuple[str, ...] = ("RssAnon", "RssFile", "RssShmem")) -> list[float]:
    """The named ``/proc/self/status`` sizes of this process in MiB (NaN where absent)."""
    found: dict[str, float] = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in fields:
                found[key] = float(rest.split()[0]) / 1024  # kB
    except OSError:
        pass
    return [found.get(f, float("nan")) for f in fields]


def live_tensor_mib() -> float:
    """MiB of the unique storages of the torch tensors the garbage collector tracks."""
    import torch

    seen: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance on some module objects warns (torch.distributed.reduce_op)
        warnings.simplefilter("ignore")
        objects = gc.get_objects()
        tensors = [o for o in objects if isinstance(o, torch.Tensor)]
    del objects
    for obj in tensors:
        try:
            if obj.device.type == "cpu":
                st = obj.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
        except Exception:
            continue
    return sum(seen.values()) / 2**20


class MemoryDiagnosis:
    """Per-step RSS split, glibc heap in use / free and live tensor MiB (``--diagnose``)."""

    header = (
        "step,rss_mib,rss_anon_mib,rss_file_mib,rss_shmem_mib,heap_used_mib,heap_free_mib,tensor_mib,rss_after_trim_mib"
    )

    def __init__(self, trim: bool, recorder: RssRecorder) -> None:
        self.recorder = recorder  # its step clock is moved past this hook's own time
        self.proc = psutil.Process()
        self.has_heap = not math.isnan(heap_mib()[0])
        self.trim = trim and self.has_heap
        if not self.has_heap:
            print(
                "--diagnose: no glibc mallinfo2/malloc_trim here (not glibc, or older than 2.33): heap columns NaN, no trim"
            )
        self.rows: list[tuple[float, ...]] = []

    @rlplug.hookimpl(trylast=True)
    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        start = time.perf_counter()
        rss = self.proc.memory_info().rss / 2**20
        anon, file_, shmem = status_mib()
        used, free = heap_mib()
        tensors = live_tensor_mib()
        after = float("nan")
        if self.trim:
            malloc_trim()
            after = self.proc.memory_info().rss / 2**20
        self.rows.append((step, rss, anon, file_, shmem, used, free, tensors, after))
        self.recorder.last += time.perf_counter() - start  # the gc scan and trim are not the step's time
        print(
            f"memory @ step {step}: rss {rss:.0f} (anon {anon:.0f}, file {file_:.0f}, shmem {shmem:.0f}) MiB; "
            f"heap used {used:.0f}, free {free:.0f} MiB; live tensors {tensors:.0f} MiB; after trim {after:.0f} MiB",
            flush=True,
        )


class RssRecorder:
    """Records RSS (MiB), Python object count and step time after every training step; with
    ``tree=True`` also the process tree's RSS and open fds and ``/dev/shm`` (:func:`tree_usage`)."""

    def __init__(self, tree: bool = False) -> None:
        self.proc = psutil.Process()
        self.tree = tree
        self.rows: list[tuple[int, float, int, float]] = []
        self.tree_rows: list[tuple[float, int, int, int, float]] = []
        self.last = time.perf_counter()

    @rlplug.hookimpl
    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        now = time.perf_counter()
        rss = self.proc.memory_info().rss / 2**20
        self.rows.append((step, rss, len(gc.get_objects()), now - self.last))
        if self.tree:
            self.tree_rows.append((*tree_usage(self.proc), *shm_usage()))
        self.last = now


def slope(steps: np.ndarray, values: np.ndarray) -> float:
    """Least-squares slope of ``values`` over ``steps`` (units of values per step)."""
    return float(np.polyfit(steps.astype(float), values.astype(float), 1)[0])


def fit_warmup(steps: np.ndarray, warmup: int) -> int:
    """``warmup``, or, when fewer than 5 steps come after it (a slow machine's short run), the step
    that leaves the last two thirds of the run for the slope (printed)."""
    if int((steps >= warmup).sum()) >= 5:
        return warmup
    lowered = int(steps[len(steps) // 3]) if len(steps) else warmup
    print(f"only {int((steps >= warmup).sum())} steps after --warmup {warmup}: the slope starts at step {lowered}")
    return lowered


def summarize_csv(csv: Path, warmup: int, tolerance_mb: float) -> int:
    """The summary of a finished soak recomputed from its CSV (``--summarize``); 0 for PASS, 1 for FAIL."""
    table = np.genfromtxt(csv, delimiter=",", names=True)
    steps, rss = table["step"], table["rss_mib"]
    warmup = fit_warmup(steps, warmup)
    tail = steps >= warmup
    half = steps >= steps[-1] / 2
    rss_slope, half_slope = slope(steps[tail], rss[tail]), slope(steps[half], rss[half])
    obj_slope = slope(steps[tail], table["py_objects"][tail])
    parts = [
        f"{len(steps)} steps in {table['step_s'].sum():.0f} s of steps; RSS {rss[0]:.0f} MiB after step 1, "
        f"{rss[tail][0]:.0f} MiB at step {int(steps[tail][0])}, {rss[-1]:.0f} MiB at step {int(steps[-1])} "
        f"(max {rss.max():.0f}); slope over steps {warmup}..{int(steps[-1])}: {rss_slope:+.4f} MiB/step "
        f"(tolerance < {tolerance_mb} MiB/step); over steps {int(steps[half][0])}..{int(steps[-1])}: "
        f"{half_slope:+.4f} MiB/step; Python objects {obj_slope:+.1f}/step; median step {np.median(table['step_s']):.2f} s."
    ]
    leak = rss_slope >= tolerance_mb
    if "tree_rss_mib" in (table.dtype.names or ()):
        tree = table["tree_rss_mib"]
        tree_slope = slope(steps[tail], tree[tail])
        leak = leak or tree_slope >= tolerance_mb
        parts.append(
            f"Process tree (trainer + engine + reward workers): RSS {tree[0]:.0f} MiB after step 1, {tree[-1]:.0f} MiB "
            f"at the end (max {tree.max():.0f}), slope over steps {warmup}..{int(steps[-1])}: {tree_slope:+.3f} MiB/step; "
            f"open fds {int(table['tree_fds'][0])} after step 1, {int(table['tree_fds'][-1])} at the last step; /dev/shm "
            f"{int(table['shm_files'][0])} files ({table['shm_mib'][0]:.1f} MiB) after step 1, "
            f"{int(table['shm_files'][-1])} ({table['shm_mib'][-1]:.1f} MiB) at the last step."
        )
    summary = f"soak {'FAIL' if leak else 'PASS'} (recomputed from {csv.name}): " + " ".join(parts)
    print(summary)
    csv.with_suffix(".txt").write_text(summary + "\n")
    return 1 if leak else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=30, help="steps excluded from the slope")
    p.add_argument("--tolerance-mb", type=float, default=0.5, help="largest acceptable RSS slope, MiB/step")
    p.add_argument(
        "--out", type=Path, default=None, help="default: results/soak_tiny.csv (soak_real.csv with --real-minutes)"
    )
    p.add_argument("--run-dir", type=Path, default=None, help="default: a temporary directory")
    p.add_argument(
        "--real-minutes", type=float, default=None, help="soak the default experiment (real model) for this long"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads of the trainer (and the vLLM engine)")
    p.add_argument("--diagnose", action="store_true", help="also write <out>_memory.csv (RSS split, heap, tensors)")
    p.add_argument("--trim", action="store_true", help="with --diagnose: malloc_trim(0) after each step")
    p.add_argument(
        "--summarize",
        type=Path,
        default=None,
        help="recompute the summary from a soak's CSV (with --warmup); fds and /dev/shm before and after the run "
        "were not recorded there. Writes <csv without .csv>.txt",
    )
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    if args.summarize is not None:
        return summarize_csv(args.summarize, args.warmup, args.tolerance_mb)
    if args.trim and not args.diagnose:
        p.error("--trim needs --diagnose (it logs the RSS after the trim there)")
    real = args.real_minutes is not None
    if args.out is None:
        args.out = RESULTS / ("soak_real.csv" if real else "soak_tiny.csv")

    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="rlplug-soak-"))
    if args.real_minutes is not None:
        sized = [
            "trainer.total_training_steps=100000",  # the wall-clock limit ends the run
            f"trainer.max_wall_time_s={args.real_minutes * 60:.0f}",
            "trainer.save_freq=10",
            "trainer.test_freq=10",
            "data.val_max_samples=32",
            f"rollout.num_threads={args.threads}",
        ]
    else:
        sized = [
            "debug=tiny",
            f"trainer.total_training_steps={args.steps}",
            "trainer.save_freq=25",
            "trainer.test_freq=25",
            "data.val_max_samples=8",
        ]
    overrides = [
        *sized,
        "trainer.max_ckpt_to_keep=2",
        "trainer.val_before_train=false",
        "trainer.logger=[console,mlflow]",
        f"trainer.num_threads={args.threads}",
        f"trainer.default_local_dir={run_dir}",
        *args.overrides,
    ]
    cfg = compose(overrides)
    validate_config(cfg)
    recorder = RssRecorder(tree=real)
    get_registry().pm.register(recorder)
    diagnosis = MemoryDiagnosis(args.trim, recorder) if args.diagnose else None
    if diagnosis is not None:
        get_registry().pm.register(diagnosis)
    fds0, shm0 = psutil.Process().num_fds(), shm_usage()
    start = time.perf_counter()
    trainer = Trainer(cfg)
    try:
        status = trainer.fit()
    finally:
        trainer.close()
    wall = time.perf_counter() - start

    args.out.parent.mkdir(parents=True, exist_ok=True)
    fds1, shm1 = psutil.Process().num_fds(), shm_usage()  # after close: what the run left behind
    with open(args.out, "w") as f:
        if real:
            f.write("step,rss_mib,py_objects,step_s,tree_rss_mib,tree_fds,tree_procs,shm_files,shm_mib\n")
            for (step, rss, objs, dt), (trss, tfds, tn, sf, sm) in zip(recorder.rows, recorder.tree_rows):
                f.write(f"{step},{rss:.2f},{objs},{dt:.4f},{trss:.2f},{tfds},{tn},{sf},{sm:.2f}\n")
        else:
            f.write("step,rss_mib,py_objects,step_s\n")
            for step, rss, objs, dt in recorder.rows:
                f.write(f"{step},{rss:.2f},{objs},{dt:.4f}\n")
    if diagnosis is not None:
        with open(args.out.with_name(args.out.stem + "_memory.csv"), "w") as f:
            f.write(diagnosis.header + "\n")
            for row in diagnosis.rows:
                f.write(",".join(f"{v:.2f}" if i else str(int(v)) for i, v in enumerate(row)) + "\n")
    data = np.array([(s, r, o) for s, r, o, _ in recorder.rows], dtype=float)
    args.warmup = fit_warmup(data[:, 0], args.warmup)
    tail = data[data[:, 0] >= args.warmup]
    rss_slope = slope(tail[:, 0], tail[:, 1])
    obj_slope = slope(tail[:, 0], tail[:, 2])
    half = data[data[:, 0] >= data[-1, 0] / 2]
    half_slope = slope(half[:, 0], half[:, 1])
    tree = np.array(recorder.tree_rows, dtype=float) if recorder.tree_rows else None
    tree_slope = None
    if tree is not None:
        t_tail = tree[data[:, 0] >= args.warmup]
        tree_slope = slope(tail[:, 0], t_tail[:, 0])
    leak = rss_slope >= args.tolerance_mb or (tree_slope is not None and tree_slope >= args.tolerance_mb)
    verdict = "PASS" if not leak and status == "finished" else "FAIL"
    # the run directory (a temporary one unless --run-dir) is shown as <tmp>
    tmp = args.run_dir is None
    shown = [
        o if not (tmp and o.startswith("trainer.default_local_dir=")) else "trainer.default_local_dir=<tmp>"
        for o in overrides
    ]
    head = f"real-model soak ({args.real_minutes:g} min limit)" if real else "soak"
    summary = (
        f"{head} {verdict}: {len(recorder.rows)} steps ({status}) in {wall:.0f} s; RSS {data[0, 1]:.0f} MiB after step 1, "
        f"{tail[0, 1]:.0f} MiB at step {int(tail[0, 0])}, {data[-1, 1]:.0f} MiB at step {int(data[-1, 0])} "
        f"(max {data[:, 1].max():.0f}); slope over steps {args.warmup}..{int(data[-1, 0])}: {rss_slope:+.4f} MiB/step "
        f"(tolerance < {args.tolerance_mb} MiB/step); over steps {int(half[0, 0])}..{int(data[-1, 0])}: "
        f"{half_slope:+.4f} MiB/step; Python objects {obj_slope:+.1f}/step; "
        f"median step {np.median([r[3] for r in recorder.rows]):.2f} s. "
        f"Overrides: {' '.join(shown)}. "
        f"Host: {os.cpu_count()} cores, torch threads {args.threads}; "
        f"trainer.malloc_trim={str(bool(cfg.trainer.malloc_trim)).lower()}."
    )
    if tree is not None:
        summary += (
            f" Process tree (trainer + engine + reward workers): RSS {tree[0, 0]:.0f} MiB after step 1, "
            f"{tree[-1, 0]:.0f} MiB at the end (max {tree[:, 0].max():.0f}), slope over steps {args.warmup}.."
            f"{int(data[-1, 0])}: {tree_slope:+.3f} MiB/step; open fds {fds0} at start, {int(tree[0, 1])} after "
            f"step 1, {int(tree[-1, 1])} at the last step, {fds1} after close; /dev/shm {shm0[0]} files "
            f"({shm0[1]:.1f} MiB) at start, {int(tree[-1, 3])} ({tree[-1, 4]:.1f} MiB) at the last step, "
            f"{shm1[0]} ({shm1[1]:.1f} MiB) after close."
        )
    print(summary)
    args.out.with_suffix(".txt").write_text(summary + "\n")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
