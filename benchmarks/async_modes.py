"""Asynchronous training modes (issue 34) measured: step time, time per response token, overlap, and learning.

    python benchmarks/async_modes.py speed                       # default experiment, 6 steps per configuration
    python benchmarks/async_modes.py speed --steps 8 --modes sync,one_step_off
    python benchmarks/async_modes.py speed --tiny                # wiring check: tiny model, rollout=hf, 3 steps
    python benchmarks/async_modes.py learn --recipes ppo,grpo --modes sync,one_step_off --seeds 0,1,2 --steps 30
    python benchmarks/async_modes.py learn --tiny                # wiring check: 2 steps, validation every step

Every run is a fresh ``rlplug train`` subprocess (``python -m rlplug train <overrides>``), one after the other,
never two at once, each in its own run directory under ``--out``; the figures come from its ``metrics.jsonl``.

Configurations (``--modes``; :data:`MODES`):

* ``sync``: ``trainer.async_mode=sync``, ``trainer.num_threads=<every core>``, the engine on every core too (its
  default): generation, then training, each with the whole machine, as users run today.
* ``sync1``: ``sync`` with ``trainer.num_threads=1 rollout.num_threads=1``: what each side gets in the async
  modes, taking turns.
* ``one_step_off``: ``trainer.async_mode=one_step_off``, one thread each, the engine on one core and the trainer
  on the other (``trainer.engine_cpus`` / ``trainer.trainer_cpus``).
* ``async``: ``trainer.async_mode=async trainer.max_staleness=1 trainer.stale_policy=wait``, threads and cores
  as ``one_step_off``.

Cores. ``trainer.engine_cpus=[0] trainer.trainer_cpus=[1]``: the ``vllm`` backend binds its engine's OpenMP threads
to ``trainer.engine_cpus`` (``VLLM_CPU_OMP_THREADS_BIND``, with ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` and
``OMP_NUM_THREADS``), the ``hf`` engine's process (:class:`rlplug.rollout.engine_process.EngineProcess`) pins itself
there, and the trainer process pins itself to ``trainer.trainer_cpus`` once the engine has started. Each run
records where its processes' threads ran (:class:`TreeSampler`: every second, each thread's CPU time since the last sample, put on the core it last ran on; and its ``Cpus_allowed_list``), so
the tables show whether the engine and the trainer really kept to their cores.

``speed``: the default experiment (``rlplug train`` with no algorithm overrides: PPO with a critic, ``rollout=vllm``,
SmolLM2-135M) for ``--steps`` steps (no validation, no checkpoint before the end, console logging only). Step 1 is
warm-up (``torch.compile``, the engine's first calls) and is left out: the figures are over steps 2..N.
Per configuration: ``timing_s/step`` (mean, median), the wall clock between the step-1 and step-N records divided by
N - 1 (what a run's throughput is, whatever the step timer covers), response tokens per step
(``response_length/mean`` x responses per step, ``data.train_batch_size`` x ``rollout.n`` from the checkpoint's
``config.yaml``), seconds per 1000 response tokens (summed step seconds / summed tokens), the stage means
(``timing_s/gen``, ``update_actor`` ...), in async modes the means of ``async/overlap_share``,
``async/trainer_idle_share``, ``async/generator_idle_share``, ``async/wait_batch_s``, ``async/wait_push_s``,
``async/staleness_mean``, and the speed-up over ``sync`` (per step and per token). The PPO preset trains only the
critic in its first ``trainer.critic_warmup`` steps (3): those steps push no new weights, so the means over the
steps after the warm-up are given apart (``--steps 6`` leaves steps 4..6). What ran beside each run is measured:
the machine's busy CPU time (``/proc/stat``) minus the run's own, as a share of the cores over steps 2..N.
Writes ``<results>/async_modes.{json,md}`` (``--tiny``: ``async_modes_tiny.*``).

``learn``: per recipe (``ppo``: the default experiment; ``grpo``: ``experiment=grpo_arithmetic``, GRPO on the same
data, prompt and reward) x mode x seed (``trainer.seed`` and ``data.seed``), ``--steps`` steps validating before
training and every ``--test-freq`` steps (checkpoints at the same steps), recording the held-out accuracy
(``val-core/<source>/acc/mean@1``) at each validation and the run's wall time (its attempts added up). Resumable:
a run whose ``metrics.jsonl`` reaches the last step is read, not rerun; an interrupted one resumes from its
checkpoint (``trainer.resume_mode=auto``). The default ``--out`` is fixed (``<tmp>/rlplug_async_modes/learn``) so
that rerunning the same command continues. Writes ``<results>/async_learning.{json,md}`` after every run
(``--tiny``: ``async_learning_tiny.*``). Runs go seed-major (each seed's modes one after the other), so a stopped
comparison leaves whole pairs. Across sessions (the run directories gone): a run recorded as finished in the
committed ``async_learning.json`` with the same overrides, steps and CPU (model and ISA flags) is carried over, not
rerun; one from another CPU kind is rerun, so every row of a table comes from one kind of machine.
``--beside TEXT`` records what ran beside the runs (held-out accuracy does not depend on it: ``sync`` and
``one_step_off`` runs are deterministic whatever the load; the minutes do); ``--report-only`` rewrites the tables
from what is there without running anything.

Both print and record the machine (CPU model, ISA flags, cores, bf16 matmul peak of ``torch.mm``, load average at
the start of each run) and the command. Run them on an otherwise idle machine: on 2 cores another process changes
the figures a lot (``../shared/MACHINE_NOTES.md``, "Threads: the biggest trap").
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))

from _machine import describe, matmul_peak  # noqa: E402

#: the async/* metrics averaged per configuration (rlplug.run.async_pipeline)
ASYNC_KEYS = (
    "async/overlap_share",
    "async/trainer_idle_share",
    "async/generator_idle_share",
    "async/wait_batch_s",
    "async/wait_push_s",
    "async/staleness_mean",
    "async/staleness_max",
    "async/waited",
    "async/dropped",
)
#: the stages whose mean seconds are reported (timing_s/<stage>)
STAGES = ("gen", "old_log_prob", "values", "update_critic", "update_actor", "update_weights")
#: the overrides that say how a configuration runs (shown with where its threads ran)
THREAD_KEYS = (
    "trainer.async_mode",
    "trainer.max_staleness",
    "trainer.stale_policy",
    "trainer.num_threads",
    "rollout.num_threads",
    "trainer.engine_cpus",
    "trainer.trainer_cpus",
)
#: learn recipes -> rlplug train overrides (benchmarks/learning_check.py's names)
RECIPES: dict[str, list[str]] = {"ppo": [], "grpo": ["experiment=grpo_arithmetic"]}
#: written into each run directory by this script: its command and attempts (a directory without it is not ours)
META = "async_modes_run.json"


def usable_cores() -> list[int]:
    """The CPU ids this process may run on, sorted."""
    return sorted(os.sched_getaffinity(0))


def mode_overrides(mode: str, cores: list[int]) -> list[str]:
    """The ``rlplug train`` overrides of configuration ``mode`` (see the module docstring) on ``cores``.

    Raises ``ValueError`` for an unknown mode, or an async mode with fewer than 2 cores (each side needs its own).
    """
    if mode == "sync":
        return ["trainer.async_mode=sync", f"trainer.num_threads={len(cores)}"]
    if mode == "sync1":
        return ["trainer.async_mode=sync", "trainer.num_threads=1", "rollout.num_threads=1"]
    if mode in ("one_step_off", "async"):
        if len(cores) < 2:
            raise ValueError(f"--modes {mode} gives the engine and the trainer a core each; this process has {cores}.")
        # the vllm engine binds the first usable core (module docstring, "Cores"): name it the engine's
        pinned = ["trainer.num_threads=1", "rollout.num_threads=1"]
        pinned += [f"trainer.engine_cpus=[{cores[0]}]", f"trainer.trainer_cpus=[{cores[1]}]"]
        if mode == "one_step_off":
            return ["trainer.async_mode=one_step_off", *pinned]
        return ["trainer.async_mode=async", "trainer.max_staleness=1", "trainer.stale_policy=wait", *pinned]
    raise ValueError(f"Unknown mode {mode!r}: choose among sync, sync1, one_step_off, async.")


def thread_env(overrides: list[str]) -> dict[str, str]:
    """The subprocess environment: unbuffered output, ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` equal to
    ``trainer.num_threads`` when the overrides set it (a user's shell setting would otherwise win)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for o in overrides:
        if o.startswith("trainer.num_threads="):
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = o.split("=", 1)[1]
    return env


# ============================================================================ reading a run


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """The records of ``<run_dir>/metrics.jsonl`` (one dict per logged step; a cut-short last line skipped);
    ``[]`` when there is none. A step logged twice keeps its last record."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        by_step[int(rec["step"])] = {k: _number(v) for k, v in rec.items()}
    return [by_step[s] for s in sorted(by_step)]


def _number(v: Any) -> Any:
    return float(v) if v in ("NaN", "Infinity", "-Infinity") else v


def run_config(run_dir: Path) -> dict[str, Any]:
    """The resolved config of the run's latest checkpoint (``global_step_<N>/config.yaml``), ``{}`` when none."""
    ckpts = sorted(run_dir.glob("global_step_*/config.yaml"), key=lambda p: int(p.parent.name.rsplit("_", 1)[1]))
    if not ckpts:
        return {}
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(ckpts[-1]), resolve=False)  # type: ignore[return-value]


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def speed_summary(records: list[dict[str, Any]], responses_per_step: int | None, critic_warmup: int = 0) -> dict:
    """The speed figures of one run from its ``metrics.jsonl`` records (training steps 1..N; a step-0 record,
    the validation before training, is ignored).

    Step 1 is warm-up: every figure is over steps 2..N. ``responses_per_step``: ``data.train_batch_size`` x
    ``rollout.n`` (None: response tokens are taken as ``perf/gen_tokens_per_s`` x ``timing_s/gen``, the same
    count through the generation rate). Returns ``steps`` (the measured step numbers), ``step_s`` (their
    ``timing_s/step``), ``step_s_mean`` / ``step_s_median``, ``wall_s_per_step`` ((wall_time of step N - of step 1)
    / (N - 1): logging and whatever runs between the step timers included), ``response_tokens`` per step and
    their mean, ``s_per_1k_tokens`` (sum of step seconds / sum of response tokens x 1000), ``after_warmup``
    (``step_s_mean`` and ``s_per_1k_tokens`` over the steps after ``critic_warmup``, None when there are none),
    ``stages`` (mean ``timing_s/<stage>``) and ``async`` (mean of each :data:`ASYNC_KEYS` present).
    Raises ``ValueError`` when no step after step 1 was logged.
    """
    train = [r for r in records if int(r["step"]) >= 1 and "timing_s/step" in r]
    measured = [r for r in train if int(r["step"]) >= 2]
    if not measured:
        raise ValueError(f"No training step after step 1 in the records (steps {[r['step'] for r in records]}).")
    step_s = [float(r["timing_s/step"]) for r in measured]

    def tokens(r: dict[str, Any]) -> float:
        if responses_per_step:
            return float(r["response_length/mean"]) * responses_per_step
        return float(r["perf/gen_tokens_per_s"]) * max(float(r["timing_s/gen"]), 1e-9)

    toks = [tokens(r) for r in measured]
    first = next((r for r in train if int(r["step"]) == 1), None)
    wall = None
    if first is not None and "wall_time" in first:
        wall = (float(measured[-1]["wall_time"]) - float(first["wall_time"])) / (int(measured[-1]["step"]) - 1)
    late = [(s, t) for r, s, t in zip(measured, step_s, toks) if int(r["step"]) > critic_warmup]
    return {
        "steps": [int(r["step"]) for r in measured],
        "step_s": step_s,
        "step_s_mean": statistics.fmean(step_s),
        "step_s_median": statistics.median(step_s),
        "wall_s_per_step": wall,
        "response_tokens": toks,
        "response_tokens_mean": statistics.fmean(toks),
        "s_per_1k_tokens": 1000.0 * sum(step_s) / sum(toks) if sum(toks) > 0 else None,
        "after_warmup": {
            "critic_warmup": critic_warmup,
            "steps": len(late),
            "step_s_mean": _mean([s for s, _ in late]),
            "s_per_1k_tokens": 1000.0 * sum(s for s, _ in late) / sum(t for _, t in late) if late else None,
        },
        "stages": {k: _mean([float(r[f"timing_s/{k}"]) for r in measured if f"timing_s/{k}" in r]) for k in STAGES},
        "async": {
            k: _mean([float(r[k]) for r in measured if k in r]) for k in ASYNC_KEYS if any(k in r for r in measured)
        },
    }


def accuracy_key(records: list[dict[str, Any]]) -> str | None:
    """The held-out strict accuracy's name in the records: the first ``val-core/<source>/acc/mean@1``."""
    for r in records:
        for k in sorted(r):
            if k.startswith("val-core/") and k.endswith("/acc/mean@1"):
                return k
    return None


def accuracy_curve(records: list[dict[str, Any]]) -> dict[int, float]:
    """``{step: held-out accuracy}`` at every validation of the run (:func:`accuracy_key`)."""
    key = accuracy_key(records)
    return {int(r["step"]): float(r[key]) for r in records if key and key in r}


# ============================================================================ watching a run


@dataclass
class TreeSampler:
    """Where the threads of a process tree ran: call :meth:`sample` every second or so.

    Each sample reads ``/proc/<pid>/task/<tid>/stat`` of ``root`` and its descendants: the CPU time (utime +
    stime) a thread used since the last sample is put on the core it last ran on (field 39, ``processor``), so
    the split is right when threads stay on one core between samples (a pinned thread always does). Processes are
    labelled ``trainer`` (the root) or ``child <pid>: <command>``; each keeps the ``Cpus_allowed_list`` of its
    busiest thread. Also sums the machine's busy time from ``/proc/stat`` (user + nice + system + irq + softirq),
    so that ``other_cpu_s`` = machine - tree is what ran beside the run (this script's own polling included).
    :meth:`start_window` resets the counts: the figures then cover what follows (steps 2..N).
    """

    root: int
    tick: float = field(default_factory=lambda: float(os.sysconf("SC_CLK_TCK")))
    last: dict[tuple[int, int], int] = field(default_factory=dict)
    cpu: dict[str, dict[int, float]] = field(default_factory=dict)
    allowed: dict[str, tuple[float, str]] = field(default_factory=dict)
    labels: dict[int, str] = field(default_factory=dict)
    machine0: float | None = None
    machine1: float | None = None
    t0: float = 0.0
    t1: float = 0.0

    def tree(self) -> list[int]:
        """``root`` and every descendant alive now."""
        parent: dict[int, int] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
        out, todo = [], [self.root]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo += [p for p, pp in parent.items() if pp == pid]
        return out

    def label(self, pid: int) -> str:
        if pid not in self.labels:
            if pid == self.root:
                self.labels[pid] = "trainer"
            else:
                try:
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
                except OSError:
                    argv = ["?"]
                # python -m <module> ...: the module names it (rlplug.plugins.rollout.vllm: the vllm engine child)
                what = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else " ".join(argv)[:60]
                self.labels[pid] = f"child {pid} ({what})"
        return self.labels[pid]

    @staticmethod
    def machine_busy() -> float:
        """Busy jiffies of all CPUs (``/proc/stat`` line ``cpu``: user nice system idle iowait irq softirq ...)."""
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return float(v[0] + v[1] + v[2] + v[5] + v[6])

    def start_window(self) -> None:
        """Forget the counts so far: the figures cover the time from now on."""
        self.sample()
        self.cpu.clear()
        self.allowed.clear()
        self.machine0, self.t0 = self.machine_busy(), time.time()

    def sample(self) -> None:
        for pid in self.tree():
            name = self.label(pid)
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                try:
                    with open(f"/proc/{pid}/task/{tid}/stat") as f:
                        rest = f.read().rsplit(")", 1)[1].split()
                    ticks, core = int(rest[11]) + int(rest[12]), int(rest[36])
                except (OSError, IndexError, ValueError):
                    continue
                delta = ticks - self.last.get((pid, int(tid)), 0)
                self.last[(pid, int(tid))] = ticks
                if delta <= 0:
                    continue
                per = self.cpu.setdefault(name, {})
                per[core] = per.get(core, 0.0) + delta / self.tick
                if delta / self.tick > self.allowed.get(name, (0.0, ""))[0]:
                    try:
                        status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
                        cpus = next(
                            x.split(":", 1)[1].strip() for x in status.splitlines() if x.startswith("Cpus_allowed_list")
                        )
                    except (OSError, StopIteration):
                        cpus = "?"
                    self.allowed[name] = (delta / self.tick, cpus)
        if self.machine0 is None:
            self.machine0, self.t0 = self.machine_busy(), time.time()
        self.machine1, self.t1 = self.machine_busy(), time.time()

    def report(self) -> dict[str, Any]:
        """``processes``: per process its CPU seconds per core and busiest thread's allowed cores;
        ``tree_cpu_s``, ``machine_cpu_s``, ``other_cpu_s``, ``other_share`` (of the cores over the window; None
        for a window under 2 s), ``window_s``."""
        tree = sum(sum(c.values()) for c in self.cpu.values())
        machine = ((self.machine1 or 0.0) - (self.machine0 or 0.0)) / self.tick
        window = max(self.t1 - self.t0, 1e-9)
        procs = {
            name: {
                "cpu_s_by_core": {str(k): round(v, 2) for k, v in sorted(per.items())},
                "cpu_s": round(sum(per.values()), 2),
                "busiest_thread_cpus_allowed": self.allowed.get(name, (0.0, "?"))[1],
            }
            for name, per in self.cpu.items()
            if sum(per.values()) >= 0.05
        }
        other = max(0.0, machine - tree)
        return {
            "processes": procs,
            "tree_cpu_s": round(tree, 2),
            "machine_cpu_s": round(machine, 2),
            "other_cpu_s": round(other, 2),
            # under 2 s (steps shorter than the sampling period) the share says nothing
            "other_share": round(other / (window * len(usable_cores())), 4) if window >= 2.0 else None,
            "window_s": round(window, 1),
        }


def launch(overrides: list[str], run_dir: Path, env: dict[str, str], watch_until: int | None = None) -> dict[str, Any]:
    """Run ``python -m rlplug train <overrides>`` to the end, its output appended to ``<run_dir>/train.log``.

    ``watch_until``: sample the process tree (:class:`TreeSampler`) every second from when step 1's record appears
    in ``metrics.jsonl`` until step ``watch_until``'s does (the measured steps 2..N; the final checkpoint and the
    exit are left out). Ctrl-C (KeyboardInterrupt) stops the run (SIGTERM: it saves a checkpoint and exits) and
    returns with ``interrupted`` true. Returns ``{exit_code, interrupted, wall_s, loadavg_at_start, cmd, threads}``
    (``threads``: the sampler's report, with ``watch_until``)."""
    cmd = [sys.executable, "-m", "rlplug", "train", *overrides]
    run_dir.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    t0 = time.time()
    with open(run_dir / "train.log", "a", buffering=1) as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        sampler = TreeSampler(proc.pid) if watch_until is not None else None
        windowed = done = interrupted = False
        try:
            while proc.poll() is None:
                time.sleep(1.0)
                if sampler is None or done:
                    continue
                last = max((int(r["step"]) for r in read_records(run_dir)), default=0)
                if not windowed and last >= 1:
                    sampler.start_window()
                    windowed = True
                elif proc.poll() is None:
                    sampler.sample()
                done = watch_until is not None and last >= watch_until
        except KeyboardInterrupt:  # Ctrl-C: the trainer saves and exits; the caller records the attempt, then stops
            proc.terminate()
            proc.wait()
            interrupted = True
        except BaseException:
            proc.terminate()
            proc.wait()
            raise
    return {
        "exit_code": proc.returncode,
        "interrupted": interrupted,
        "wall_s": round(time.time() - t0, 1),
        "loadavg_at_start": round(load, 2),
        "cmd": shlex.join(cmd),
        **({"threads": sampler.report()} if sampler is not None else {}),
    }


def machine_info() -> dict[str, Any]:
    """:func:`_machine.describe` plus the bf16 ``torch.mm`` peak (GFLOP/s) on every usable core; printed."""
    info = describe()
    info["matmul_peak_bf16_gflops"] = round(matmul_peak("bf16", threads=len(usable_cores()))["gflops"], 1)
    info["date"] = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"CPU: {info['cpu_model']} ({', '.join(info['isa_flags'])}), {info['cores']} cores, "
        f"bf16 matmul peak {info['matmul_peak_bf16_gflops']:.0f} GFLOP/s, load average {info['loadavg_at_start']:.2f}",
        flush=True,
    )
    if info["loadavg_at_start"] > 1.0:
        print("WARNING: load average above 1.0: something else is running; the figures will be off.", flush=True)
    return info


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "" if x is None else format(x, spec)


# ============================================================================ speed


def speed(args: argparse.Namespace, command: str) -> int:
    cores = usable_cores()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        mode_overrides(m, cores)  # unknown names fail before anything runs
    steps = args.steps or (3 if args.tiny else 6)
    if steps < 2:
        raise SystemExit("--steps must be >= 2: step 1 is warm-up and left out.")
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="rlplug-async-speed-"))
    base = ["debug=tiny"] if args.tiny else []
    info = machine_info()
    results: dict[str, Any] = {}
    for mode in modes:
        run_dir = out / "speed" / mode
        if run_dir.exists():
            if not (run_dir / META).is_file():
                raise SystemExit(f"{run_dir} exists and was not made by this script: pass another --out.")
            shutil.rmtree(run_dir)  # an earlier attempt of ours: timings are only taken from a fresh run
        overrides = [
            *base,
            *mode_overrides(mode, cores),
            "trainer.val_before_train=false",
            "trainer.test_freq=0",
            "trainer.save_freq=0",
            f"trainer.total_training_steps={steps}",
            "trainer.logger=[console]",
            "trainer.max_wall_time_s=null",
            "trainer.resume_mode=disable",
            f"trainer.default_local_dir={run_dir}",
            *args.overrides,
        ]
        run_dir.mkdir(parents=True)
        (run_dir / META).write_text(json.dumps({"overrides": overrides}, indent=1))
        print(f"[{mode}] {len(overrides)} overrides; log: {run_dir / 'train.log'}", flush=True)
        run = launch(overrides, run_dir, thread_env(overrides), watch_until=steps)
        if run["interrupted"]:
            raise SystemExit(f"Interrupted during {mode}; nothing written to {args.results}.")
        entry: dict[str, Any] = {"overrides": overrides, "run_dir": str(run_dir), **run}
        try:
            cfg = run_config(run_dir)
            per_step = int(cfg["data"]["train_batch_size"]) * int(cfg["rollout"]["n"]) if cfg else None
            warm = int(cfg.get("trainer", {}).get("critic_warmup", 0)) if cfg else 0
            entry["responses_per_step"] = per_step
            entry.update(speed_summary(read_records(run_dir), per_step, warm))
        except (ValueError, KeyError) as e:
            entry["error"] = f"{e}; last lines of the log:\n" + _tail(run_dir / "train.log")
            print(f"[{mode}] FAILED (exit {run['exit_code']}): {e}\n{_tail(run_dir / 'train.log')}", flush=True)
        results[mode] = entry
        if "step_s_mean" in entry:
            print(f"[{mode}] " + _speed_line(entry), flush=True)
    base_entry = results.get("sync", {})
    for entry in results.values():
        if "step_s_mean" in entry and "step_s_mean" in base_entry:
            entry["speedup_vs_sync"] = base_entry["step_s_mean"] / entry["step_s_mean"]
            if entry.get("s_per_1k_tokens") and base_entry.get("s_per_1k_tokens"):
                entry["speedup_per_token_vs_sync"] = base_entry["s_per_1k_tokens"] / entry["s_per_1k_tokens"]
            if entry.get("wall_s_per_step") and base_entry.get("wall_s_per_step"):
                entry["speedup_wall_vs_sync"] = base_entry["wall_s_per_step"] / entry["wall_s_per_step"]
    doc = {"machine": info, "command": command, "steps": steps, "tiny": bool(args.tiny), "runs_dir": str(out)}
    doc["ran_beside"] = "nothing started by this benchmark; other_cpu_s per run measures what did"
    doc["configurations"] = results
    name = "async_modes_tiny" if args.tiny else "async_modes"
    results_dir = Path(args.results)
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    md = speed_markdown(doc)
    (results_dir / f"{name}.md").write_text(md)
    print(md)
    return 0 if all("step_s_mean" in e for e in results.values()) else 1


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _speed_line(e: dict[str, Any]) -> str:
    a = e.get("async") or {}
    line = (
        f"step {e['step_s_mean']:.2f} s mean, {e['step_s_median']:.2f} s median (steps {e['steps'][0]}..{e['steps'][-1]}), "
        f"wall {_fmt(e.get('wall_s_per_step'))} s/step, {e['response_tokens_mean']:.0f} response tokens/step, "
        f"{_fmt(e.get('s_per_1k_tokens'))} s per 1k tokens"
    )
    if a:
        line += (
            f"; overlap {_fmt(a.get('async/overlap_share'))}, trainer idle {_fmt(a.get('async/trainer_idle_share'))}, "
            f"generator idle {_fmt(a.get('async/generator_idle_share'))}, staleness {_fmt(a.get('async/staleness_mean'))}"
        )
    return line


def _cores_line(threads: dict[str, Any]) -> str:
    if not threads.get("processes"):
        return "not sampled (the measured steps took less than the 1 s sampling period)"
    parts = []
    for name, p in threads.get("processes", {}).items():
        by = ", ".join(f"core {c}: {s:.1f} s" for c, s in p["cpu_s_by_core"].items())
        parts.append(f"{name} ({by}; allowed {p['busiest_thread_cpus_allowed']})")
    return "; ".join(parts)


def speed_markdown(doc: dict[str, Any]) -> str:
    m, runs = doc["machine"], doc["configurations"]
    lines = [
        f"# Async modes: seconds per step and per response token{' (tiny wiring check)' if doc['tiny'] else ''}",
        "",
        f"{m['date']}. CPU: {m['cpu_model']} ({', '.join(m['isa_flags'])}); {m['cores']} cores; "
        f"bf16 matmul peak {m['matmul_peak_bf16_gflops']:.0f} GFLOP/s; torch {m['torch']}. "
        f"Load average at the start: {m['loadavg_at_start']:.2f}. Nothing else was started beside the runs; "
        "`other CPU` is the machine's busy time not used by the run (over steps 2..N, share of all cores).",
        "",
        f"Command: `{doc['command']}`. {doc['steps']} steps per configuration, run one after the other; "
        "figures over steps 2..N (step 1: compile and engine warm-up).",
        "",
        "| configuration | s/step mean | median | wall s/step | response tokens/step | s per 1k tokens | "
        "speed-up vs sync (step / token) | after critic warm-up: s/step, s per 1k | other CPU |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, e in runs.items():
        if "step_s_mean" not in e:
            lines.append(f"| {mode} | failed (exit {e.get('exit_code')}) | | | | | | | |")
            continue
        aw = e["after_warmup"]
        warm = f"{_fmt(aw['step_s_mean'])}, {_fmt(aw['s_per_1k_tokens'])} ({aw['steps']} steps)" if aw["steps"] else "-"
        speedup = (
            f"{_fmt(e.get('speedup_vs_sync'))}x / {_fmt(e.get('speedup_per_token_vs_sync'))}x"
            if "speedup_vs_sync" in e
            else ""
        )
        other = e.get("threads", {}).get("other_share")
        lines.append(
            f"| {mode} | {e['step_s_mean']:.2f} | {e['step_s_median']:.2f} | {_fmt(e.get('wall_s_per_step'))} | "
            f"{e['response_tokens_mean']:.0f} | {_fmt(e.get('s_per_1k_tokens'))} | {speedup} | {warm} | "
            f"{'' if other is None else f'{100 * other:.1f}%'} |"
        )
    lines += ["", "Stage means (seconds) and the async metrics (means over steps 2..N):", ""]
    lines += [
        "| configuration | " + " | ".join(STAGES) + " | overlap | trainer idle | generator idle | wait batch s | "
        "wait push s | staleness mean |",
        "|---|" + "---|" * (len(STAGES) + 6),
    ]
    for mode, e in runs.items():
        if "step_s_mean" not in e:
            continue
        a = e["async"]
        cells = [_fmt(e["stages"].get(s)) for s in STAGES]
        cells += [_fmt(a.get(k)) for k in ASYNC_KEYS[:6]]  # the table's columns: overlap ... staleness_mean
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    lines += ["", "Where the threads ran (CPU seconds per core over steps 2..N, per process):", ""]
    for mode, e in runs.items():
        shown = " ".join(o for o in e["overrides"] if o.split("=")[0] in THREAD_KEYS)
        lines.append(f"- {mode}: `{shown}`: {_cores_line(e.get('threads', {}))}")
    lines += [
        "",
        "The vllm engine child binds its OpenMP threads (`VLLM_CPU_OMP_THREADS_BIND`) to `trainer.engine_cpus`; its "
        "other threads (Python, tokenizer) may run on any core (`allowed`); the trainer process pins itself to "
        "`trainer.trainer_cpus`.",
        "",
    ]
    return "\n".join(lines)


# ============================================================================ learn


def learn(args: argparse.Namespace, command: str) -> int:
    cores = usable_cores()
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    for r in recipes:
        if r not in RECIPES:
            raise SystemExit(f"Unknown recipe {r!r}: choose among {', '.join(RECIPES)}.")
    for m in modes:
        mode_overrides(m, cores)
    steps = args.steps or (2 if args.tiny else 30)
    test_freq = args.test_freq or (1 if args.tiny else 10)
    out = (
        Path(args.out)
        if args.out
        else Path(tempfile.gettempdir()) / "rlplug_async_modes" / ("learn_tiny" if args.tiny else "learn")
    )
    base = ["debug=tiny"] if args.tiny else []
    name = "async_learning_tiny" if args.tiny else "async_learning"
    results_dir = Path(args.results)
    results_dir.mkdir(parents=True, exist_ok=True)
    info = machine_info()
    if args.report_only:  # nothing runs now: keep the figures measured when the runs started (same CPU kind)
        info = _recorded_machine(results_dir / f"{name}.json", info)
    # seed-major: each seed's modes run one after the other, so a stopped comparison leaves whole pairs
    todo = [(r, m, s) for r in recipes for s in seeds for m in modes]
    earlier = carried_runs(results_dir / f"{name}.json", info, steps, test_freq)
    status = 0
    for i, (recipe, mode, seed) in enumerate(todo, 1):
        run_dir = out / recipe / mode / f"seed_{seed}"
        overrides = [
            *base,
            *RECIPES[recipe],
            *mode_overrides(mode, cores),
            f"trainer.seed={seed}",
            f"data.seed={seed}",
            f"trainer.total_training_steps={steps}",
            "trainer.val_before_train=true",
            f"trainer.test_freq={test_freq}",
            f"trainer.save_freq={test_freq}",
            "trainer.logger=[console]",
            "trainer.max_wall_time_s=null",
            f"trainer.default_local_dir={run_dir}",
            *args.overrides,
        ]
        meta_path = run_dir / META
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {"overrides": overrides, "attempts": []}
        if run_dir.exists() and not meta_path.is_file():
            raise SystemExit(f"{run_dir} exists and was not made by this script: pass another --out.")
        if _finished(read_records(run_dir), steps):
            print(f"[{i}/{len(todo)}] {recipe} {mode} seed {seed}: finished earlier, read from {run_dir}", flush=True)
            continue
        carried = earlier.get((recipe, mode, seed))
        if carried is not None and carried["overrides"] != _portable(overrides):
            del earlier[(recipe, mode, seed)]  # other settings: rerun here, not carried into the tables
        elif carried is not None:
            print(
                f"[{i}/{len(todo)}] {recipe} {mode} seed {seed}: finished in an earlier session, recorded in "
                f"{results_dir / name}.json ({carried.get('date', '?')})",
                flush=True,
            )
            continue
        if args.report_only:
            continue
        if meta["overrides"] != overrides:
            raise SystemExit(
                f"{run_dir} holds an unfinished run with other overrides ({meta['overrides']}); delete it or pass "
                "another --out."
            )
        run_dir.mkdir(parents=True, exist_ok=True)
        meta_path.write_text(json.dumps(meta, indent=1))
        print(f"[{i}/{len(todo)}] {recipe} {mode} seed {seed}: log {run_dir / 'train.log'}", flush=True)
        run = launch(overrides, run_dir, thread_env(overrides))
        run["beside"] = args.beside
        meta["attempts"].append(run)
        meta_path.write_text(json.dumps(meta, indent=1))
        if run["interrupted"]:
            write_learning(
                out,
                recipes,
                modes,
                seeds,
                steps,
                test_freq,
                info,
                command,
                bool(args.tiny),
                results_dir / name,
                earlier,
            )
            print(f"Interrupted: {run_dir} saved; rerun the same command to continue.", flush=True)
            return 130
        curve = accuracy_curve(read_records(run_dir))
        print(
            f"[{i}/{len(todo)}] exit {run['exit_code']}, {run['wall_s'] / 60:.1f} min; held-out accuracy "
            + ", ".join(f"@{s}: {100 * a:.1f}%" for s, a in sorted(curve.items())),
            flush=True,
        )
        if run["exit_code"] != 0:
            print(_tail(run_dir / "train.log"), flush=True)
            status = 1
        elif _finished(read_records(run_dir), steps):
            freed = drop_checkpoints(run_dir)
            print(f"[{i}/{len(todo)}] checkpoints of the finished run deleted ({freed / 2**30:.1f} GiB)", flush=True)
        write_learning(
            out, recipes, modes, seeds, steps, test_freq, info, command, bool(args.tiny), results_dir / name, earlier
        )
    doc = write_learning(
        out, recipes, modes, seeds, steps, test_freq, info, command, bool(args.tiny), results_dir / name, earlier
    )
    print(doc["table"])
    unfinished = [row for row in doc["runs"] if not row["finished"]]
    return 1 if status or unfinished else 0


def drop_checkpoints(run_dir: Path) -> int:
    """Delete the ``global_step_*`` checkpoints of a finished run in ``run_dir`` (about 1.6 GB each with the default
    model; they only serve a resume). The metrics, logs, validation samples and ``final_model`` stay. Returns the
    bytes freed."""
    freed = 0
    for ckpt in sorted(run_dir.glob("global_step_*")):
        if ckpt.is_dir():
            freed += sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
            shutil.rmtree(ckpt)
    return freed


def _finished(records: list[dict[str, Any]], steps: int) -> bool:
    return any(int(r["step"]) == steps and "timing_s/step" in r for r in records)


def _started(run_dir: Path) -> str | None:
    """When the run in ``run_dir`` recorded its first metrics (its step-0 validation), UTC; None without records."""
    walls = [float(r["wall_time"]) for r in read_records(run_dir) if "wall_time" in r]
    return datetime.fromtimestamp(min(walls), UTC).strftime("%Y-%m-%d %H:%M UTC") if walls else None


def _recorded_machine(path: Path, info: dict[str, Any]) -> dict[str, Any]:
    """The ``machine`` of the document at ``path`` when it was recorded on this CPU kind (its matmul peak and load
    measured when its runs started, not while something else runs beside a table rewrite), else ``info``."""
    if not path.is_file():
        return info
    recorded = json.loads(path.read_text()).get("machine") or {}
    return recorded if _cpu_kind(recorded) == _cpu_kind(info) else info


def _portable(overrides: list[str]) -> list[str]:
    """``overrides`` without the run directory (a local path), as the results record them."""
    return [o for o in overrides if not o.startswith("trainer.default_local_dir=")]


def _cpu_kind(info: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
    return str(info.get("cpu_model")), tuple(info.get("isa_flags") or ())


def carried_runs(path: Path, info: dict[str, Any], steps: int, test_freq: int) -> dict[tuple[str, str, int], dict]:
    """The finished runs recorded in an earlier ``async_learning.json`` at ``path`` on this CPU kind (model and ISA
    flags; :func:`_cpu_kind`) with the same ``steps`` and ``test_freq``: ``{(recipe, mode, seed): row}``. A row from
    another CPU kind is not carried: its run is redone here."""
    if not path.is_file():
        return {}
    doc = json.loads(path.read_text())
    if doc.get("steps") != steps or doc.get("test_freq") != test_freq:
        return {}
    out = {}
    for row in doc.get("runs", []):
        machine = row.get("machine") or doc.get("machine", {})
        if row.get("finished") and "overrides" in row and _cpu_kind(machine) == _cpu_kind(info):
            out[(row["recipe"], row["mode"], int(row["seed"]))] = row
    return out


def learning_row(recipe: str, mode: str, seed: int, run_dir: Path, steps: int) -> dict[str, Any]:
    """One run of the learning comparison: its accuracy curve, whether it finished, its minutes (every attempt's
    process wall time added up), the minutes from the step-0 validation record to the last step's (``metrics.jsonl``
    wall times: start-up excluded; the time between a stopped attempt and its resume included) and the step minutes
    (the steps' ``timing_s/step`` added up: start-up, validation and the time between attempts left out)."""
    records = read_records(run_dir)
    meta_path = run_dir / META
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    attempts = meta.get("attempts", [])
    walls = {int(r["step"]): float(r["wall_time"]) for r in records if "wall_time" in r}
    train_min = (walls[steps] - walls[0]) / 60 if 0 in walls and steps in walls else None
    step_s = {int(r["step"]): float(r["timing_s/step"]) for r in records if "timing_s/step" in r}
    step_min = sum(step_s.values()) / 60 if step_s else None
    return {
        "recipe": recipe,
        "mode": mode,
        "seed": seed,
        "run_dir": "/".join(run_dir.parts[-3:]),  # relative to --out
        "overrides": _portable(meta.get("overrides", [])),
        "finished": _finished(records, steps),
        "metric": accuracy_key(records),
        "acc": {str(k): v for k, v in sorted(accuracy_curve(records).items())},
        "minutes": round(sum(a["wall_s"] for a in attempts) / 60, 2) if attempts else None,
        "minutes_from_step0_validation": None if train_min is None else round(train_min, 2),
        "step_minutes": None if step_min is None else round(step_min, 2),
        "attempts": len(attempts),
        "exit_codes": [a["exit_code"] for a in attempts],
        "beside": sorted({a.get("beside", "nothing") for a in attempts}),
        "loadavg_at_start": [a.get("loadavg_at_start") for a in attempts],
    }


def write_learning(
    out: Path,
    recipes: list[str],
    modes: list[str],
    seeds: list[int],
    steps: int,
    test_freq: int,
    info: dict[str, Any],
    command: str,
    tiny: bool,
    stem: Path,
    earlier: dict[tuple[str, str, int], dict] | None = None,
) -> dict[str, Any]:
    """Read every run under ``out`` and write ``<stem>.json`` and ``<stem>.md``; returns the JSON document. A run
    not finished there is taken from ``earlier`` (:func:`carried_runs`) when it holds it."""
    rows = []
    for recipe in recipes:
        for mode in modes:
            for seed in seeds:
                row = learning_row(recipe, mode, seed, out / recipe / mode / f"seed_{seed}", steps)
                if row["finished"]:
                    row["machine"] = {k: info[k] for k in ("cpu_model", "isa_flags", "cores")}
                    row["date"] = _started(out / recipe / mode / f"seed_{seed}") or info["date"]
                elif earlier and (recipe, mode, seed) in earlier:
                    row = {**earlier[(recipe, mode, seed)], "carried": True}
                rows.append(row)
    val_steps = sorted({0, *range(test_freq, steps + 1, test_freq), steps})
    head = "| recipe | mode | seed | " + " | ".join(f"acc@{s}" for s in val_steps) + " | minutes | step minutes |"
    lines = [head, "|---" * (5 + len(val_steps)) + "|"]

    def pct(x: float | None) -> str:
        return "" if x is None else f"{100 * x:.1f}%"

    for row in rows:
        accs = [pct(row["acc"].get(str(s))) for s in val_steps]
        lines.append(
            f"| {row['recipe']} | {row['mode']} | {row['seed']} | "
            + " | ".join(accs)
            + f" | {_fmt(row.get('minutes'), '.1f')} | "
            f"{_fmt(row.get('step_minutes'), '.1f')} |"
        )
    for recipe in recipes:
        for mode in modes:
            group = [r for r in rows if r["recipe"] == recipe and r["mode"] == mode]
            means = []
            for s in val_steps:
                vals = [r["acc"][str(s)] for r in group if str(s) in r["acc"]]
                means.append(pct(_mean(vals)) + (f" (n={len(vals)})" if vals and len(vals) < len(group) else ""))
            mins = [r["minutes"] for r in group if r.get("minutes") is not None and r["finished"]]
            tmins = [r["step_minutes"] for r in group if r.get("step_minutes") is not None and r["finished"]]
            lines.append(
                f"| **{recipe}** | **{mode}** | mean | " + " | ".join(means) + f" | {_fmt(_mean(mins), '.1f')} | "
                f"{_fmt(_mean(tmins), '.1f')} |"
            )
    table = "\n".join(lines)
    doc = {
        "machine": info,
        "command": command,
        "steps": steps,
        "test_freq": test_freq,
        "tiny": tiny,
        "ran_beside": "one run at a time; what else ran on the machine: each row's `beside`",
        "recipes": {r: RECIPES[r] for r in recipes},
        "runs": rows,
        "table": table,
    }
    m = info
    md = [
        f"# Held-out accuracy under the async modes{' (tiny wiring check)' if tiny else ''}",
        "",
        f"{m['date']}. CPU: {m['cpu_model']} ({', '.join(m['isa_flags'])}); {m['cores']} cores; bf16 matmul peak "
        f"{m['matmul_peak_bf16_gflops']:.0f} GFLOP/s; torch {m['torch']}; load average at the start "
        f"{m['loadavg_at_start']:.2f}. Runs one after the other. Beside them: "
        + "; ".join(sorted({b for r in rows for b in r.get("beside", [])}) or ["nothing"])
        + " (accuracy does not depend on it; the minutes do). Rows carried from an earlier session on the same CPU "
        "kind: "
        + (
            ", ".join(f"{r['recipe']} {r['mode']} {r['seed']} ({r.get('date')})" for r in rows if r.get("carried"))
            or "none"
        )
        + ".",
        "",
        f"Command: `{command}`. {steps} steps, validation (held-out strict accuracy, `{_metric_name(rows)}`) before "
        f"training and every {test_freq} steps. Recipes: "
        + "; ".join(f"{r}: `rlplug train {' '.join(RECIPES[r]) or '(default experiment)'}`" for r in recipes)
        + ". Modes as in `benchmarks/async_modes.py` (sync: every core, taking turns; one_step_off: one core each). "
        "`minutes`: the process's wall time (attempts added up); `step minutes`: the steps' own seconds "
        "(`timing_s/step` added up: start-up, validation and any time between a stopped attempt and its resume left "
        "out).",
        "",
        table,
        "",
    ]
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    stem.with_suffix(".md").write_text("\n".join(md))
    return doc


def _metric_name(rows: list[dict[str, Any]]) -> str:
    return next((r["metric"] for r in rows if r.get("metric")), "val-core/<source>/acc/mean@1")


# ============================================================================ main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    sp = sub.add_parser("speed", help="seconds per step and per response token of each mode")
    sp.add_argument("--steps", type=int, default=None, help="steps per configuration (default 6; --tiny: 3)")
    sp.add_argument("--modes", default="sync,sync1,one_step_off,async")
    sp.add_argument("--tiny", action="store_true", help="debug=tiny (tiny random model, rollout=hf): a wiring check")
    sp.add_argument("--out", default=None, help="run directories (default: a new temp dir)")
    sp.add_argument("--results", default=str(RESULTS), help="where async_modes.{json,md} go")
    lp = sub.add_parser("learn", help="held-out accuracy per recipe x mode x seed")
    lp.add_argument("--recipes", default="ppo,grpo")
    lp.add_argument("--modes", default="sync,one_step_off")
    lp.add_argument("--seeds", default="0,1,2")
    lp.add_argument("--steps", type=int, default=None, help="default 30; --tiny: 2")
    lp.add_argument("--test-freq", type=int, default=None, help="default 10; --tiny: 1")
    lp.add_argument("--tiny", action="store_true", help="debug=tiny: a wiring check")
    lp.add_argument("--out", default=None, help="run directories (default <tmp>/rlplug_async_modes/learn)")
    lp.add_argument("--results", default=str(RESULTS), help="where async_learning.{json,md} go")
    lp.add_argument("--beside", default="nothing", help="what runs on the machine beside the runs (recorded)")
    lp.add_argument("--report-only", action="store_true", help="rewrite the tables from what is there; run nothing")
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    args.overrides = extra
    command = "python benchmarks/async_modes.py " + shlex.join(argv)
    return speed(args, command) if args.command == "speed" else learn(args, command)


if __name__ == "__main__":
    sys.exit(main())
