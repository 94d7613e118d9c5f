"""Generation on every rank (issue 35) measured: two torchrun ranks, colocated engines against rank-0 generation.

    python benchmarks/colocate.py                       # default experiment, rollout=vllm, 3 steps per configuration
    python benchmarks/colocate.py --steps 4 --modes colocated,rank0
    python benchmarks/colocate.py --kill-resume         # also: colocated, SIGKILL in step 3, resume; bitwise check
    python benchmarks/colocate.py --tiny                # wiring check: debug=tiny, rollout=hf

Each configuration is one ``torchrun --standalone --nproc_per_node=2 -m rlplug train trainer=fsdp2 <overrides>``
run (never two at once):

* ``colocated``: ``rollout.colocate=true``: each rank's own engine (``rollout=vllm``: a vLLM engine child per rank,
  one OpenMP thread, bound to the rank's core) generates its global micro-batches (``rollout.micro_batch_size``,
  by default half a step's sequences, so each rank gets one) and the parts are all-gathered;
* ``rank0``: ``rollout.colocate=false``: rank 0's engine (one thread, as each colocated engine has) generates the
  whole batch while rank 1 waits, then broadcasts it (rlplug's behaviour before issue 35);
* ``rank0_all_cores``: ``rank0`` with the engine on every core of the machine (``--modes`` to add it).

Figures, from rank 0's ``metrics.jsonl`` over steps 2..N (step 1 is warm-up): ``timing_s/gen`` (the step's
generation as the trainer waits for it: colocated, the slowest rank's share plus the all-gather), ``timing_s/step``,
and colocated ``rollout/gen_s_rank_max`` / ``_min`` (each rank's own generation seconds). Memory: every process of
the run is sampled every 0.5 s (``/proc/<pid>/status`` ``VmRSS``); the peak resident size per role, ``rank R``
(the training process with ``RANK=R`` in its environment), ``rank R engine`` (its engine processes: the vLLM
child, or rlplug's engine process) and ``rank R other`` (other descendants, e.g. compile workers), and of the
whole run (the sum at each sample). Host memory, not a GPU's: on this CPU machine the engines and the
training share the RAM.

``--kill-resume``: the colocated configuration twice more for ``--kill-steps`` steps (default 5: the default PPO
preset trains only the critic in its first 3 steps, so steps 4 and 5 update the actor and load its weights into
both engines) with ``trainer.save_freq=1``: once straight through, once with ``RLPLUG_TEST_KILL_AT=--kill-at``
(default ``update_actor:2``: both ranks SIGKILL themselves in their second actor update, step 5) and then the same
command again (it resumes from the last checkpoint); the last step's records (numbers only: timings excepted) and
the final actor weights must be bitwise equal.

A configuration whose run directory under ``--out`` holds its ``bench_run.json`` (written when it finished) is
read, not run again, so ``--kill-resume`` can be added to an earlier command with the same ``--out``.

Writes ``benchmarks/results/colocate.{json,md}`` (``--tiny``: ``colocate_tiny.*``) with the machine (CPU model,
flags, bf16 matmul peak, load average at the start). Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from async_modes import machine_info, read_records  # noqa: E402

MODES = {
    "colocated": ["rollout.colocate=true"],
    "rank0": ["rollout.colocate=false"],
    # rank 0's engine on every core (rank 1 idles while it generates): the best rank-0 generation on one machine
    "rank0_all_cores": ["rollout.colocate=false", f"rollout.num_threads={len(os.sched_getaffinity(0))}"],
}
#: metrics that differ between two runs of the same numbers (clocks, memory)
TIMING_PREFIXES = ("timing_s/", "perf/", "wall_time", "rollout/gen_s_rank", "throughput/", "timing_per_token_ms/")


class MemorySampler(threading.Thread):
    """Every ``period`` seconds, the resident size (MiB) of each process under ``root``, by role (module docstring);
    keeps the peak per role and of the sum."""

    def __init__(self, root: int, period: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.root, self.period = root, period
        self.peak: dict[str, float] = {}
        self.peak_total = 0.0
        self.stop = threading.Event()

    @staticmethod
    def _children() -> dict[int, list[int]]:
        kids: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                kids.setdefault(ppid, []).append(int(entry))
        return kids

    @staticmethod
    def _rss_mib(pid: int) -> float:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0

    @staticmethod
    def _rank(pid: int) -> str | None:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            return None
        return next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"RANK=")), None)

    @staticmethod
    def _engine(pid: int) -> bool:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            return False
        return "engine" in argv or "vllm" in argv  # rlplug.rollout.engine_process, the vllm engine child

    def sample(self) -> None:
        kids = self._children()
        usage = {"launcher": self._rss_mib(self.root)}
        for child in kids.get(self.root, []):  # torchrun's workers: the ranks
            rank = self._rank(child) or "?"
            usage[f"rank {rank}"] = usage.get(f"rank {rank}", 0.0) + self._rss_mib(child)
            stack = list(kids.get(child, []))
            while stack:  # the rank's descendants: its engine, or other helpers (compile workers)
                pid = stack.pop()
                role = f"rank {rank} engine" if self._engine(pid) else f"rank {rank} other"
                usage[role] = usage.get(role, 0.0) + self._rss_mib(pid)
                stack += kids.get(pid, [])
        for role, mib in usage.items():
            self.peak[role] = max(self.peak.get(role, 0.0), mib)
        self.peak_total = max(self.peak_total, sum(usage.values()))

    def run(self) -> None:
        while not self.stop.is_set():
            self.sample()
            self.stop.wait(self.period)


def torchrun(overrides: list[str], run_dir: Path, env_extra: dict[str, str] | None = None) -> dict[str, Any]:
    """One 2-rank ``rlplug train`` run to its end; its output appended to ``<run_dir>/train.log``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "rlplug",
           "train", *overrides, f"trainer.default_local_dir={run_dir}"]  # fmt: skip
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **(env_extra or {})}
    t0 = time.time()
    with open(run_dir / "train.log", "a", buffering=1) as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        sampler = MemorySampler(proc.pid)
        sampler.start()
        proc.wait()
        sampler.stop.set()
        sampler.join()
    return {
        "exit_code": proc.returncode,
        "wall_s": round(time.time() - t0, 1),
        "peak_rss_mib": {k: round(v) for k, v in sorted(sampler.peak.items())},
        "peak_total_rss_mib": round(sampler.peak_total),
    }


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over steps 2..N of the figures of the module docstring (step 1 left out: warm-up)."""
    steps = [r for r in records if int(r.get("step", 0)) >= 2 and "timing_s/step" in r]
    keys = (
        "timing_s/gen",
        "timing_s/step",
        "rollout/gen_s_rank_max",
        "rollout/gen_s_rank_min",
        "timing_s/update_actor",
    )
    return {
        "steps": [int(r["step"]) for r in steps],
        **{k: _mean([float(r[k]) for r in steps if k in r]) for k in keys},
    }


def numbers(record: dict[str, Any]) -> dict[str, Any]:
    """A step record without its clocks and memory gauges (what two runs of the same numbers share)."""
    return {k: v for k, v in record.items() if not k.startswith(TIMING_PREFIXES)}


def kill_resume(base: list[str], out: Path, steps: int, kill_at: str) -> dict[str, Any]:
    """The bitwise check of ``--kill-resume`` (module docstring)."""
    from safetensors.torch import load_file

    args = [*base, *MODES["colocated"], "trainer.save_freq=1", f"trainer.total_training_steps={steps}"]
    straight = torchrun(args, out / "straight")
    killed = torchrun(args, out / "killed", {"RLPLUG_TEST_KILL_AT": kill_at})
    resumed = torchrun(args, out / "killed")
    a, b = read_records(out / "straight"), read_records(out / "killed")
    last = max(int(r["step"]) for r in a)
    ra, rb = (next(r for r in recs if int(r["step"]) == last) for recs in (a, b))
    wa = load_file(str(out / "straight" / "final_model" / "model.safetensors"))
    wb = load_file(str(out / "killed" / "final_model" / "model.safetensors"))
    same_weights = wa.keys() == wb.keys() and all(bool((wa[k] == wb[k]).all()) for k in wa)
    return {
        "kill_at": kill_at,
        "exit_codes": [straight["exit_code"], killed["exit_code"], resumed["exit_code"]],
        "killed_after_step": max((int(r["step"]) for r in b if int(r["step"]) < last), default=0),
        "last_step": last,
        "resumed": "Resumed from" in (out / "killed" / "train.log").read_text(),
        "same_step_numbers": numbers(ra) == numbers(rb),
        "differing_keys": sorted(k for k in numbers(ra) if numbers(ra).get(k) != numbers(rb).get(k))[:10],
        "same_final_weights": same_weights,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--modes", default="colocated,rank0")
    p.add_argument("--kill-resume", action="store_true")
    p.add_argument("--kill-steps", type=int, default=5, help="steps of the kill-and-resume runs")
    p.add_argument("--kill-at", default="update_actor:2", help="RLPLUG_TEST_KILL_AT of the killed run")
    p.add_argument("--tiny", action="store_true", help="debug=tiny, rollout=hf: a wiring check")
    p.add_argument("--out", default=None, help="run directories (default: a new temp dir)")
    p.add_argument("--results", default=str(HERE / "results"))
    args, extra = p.parse_known_args(argv)
    info = machine_info()
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="rlplug_colocate_"))
    base = ["trainer=fsdp2", "debug=tiny"] if args.tiny else ["trainer=fsdp2", "rollout=vllm"]
    base += [
        "rollout.num_threads=1",
        f"trainer.total_training_steps={args.steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=0",
        "trainer.logger=[console]",
        "trainer.max_wall_time_s=null",
        *extra,
    ]
    from rlplug.config.compose import compose  # the run's batch: a micro-batch per rank

    run_cfg = compose([o for o in base if not o.startswith("trainer=")])
    sequences = int(run_cfg.data.train_batch_size) * max(1, int(run_cfg.rollout.n))
    if not any(o.startswith("rollout.micro_batch_size=") for o in extra):
        base.append(f"rollout.micro_batch_size={-(-sequences // 2)}")
    doc: dict[str, Any] = {"machine": info, "command": shlex.join(["python", "benchmarks/colocate.py", *(argv or sys.argv[1:])]),
                           "overrides": base, "runs": {}}  # fmt: skip
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        done = out / mode / "bench_run.json"
        if done.is_file():
            run = json.loads(done.read_text())
            print(f"{mode}: finished earlier, read from {done}", flush=True)
        else:
            run = torchrun([*base, *MODES[mode], "trainer.save_freq=0"], out / mode)
            run["summary"] = summary(read_records(out / mode))
            done.write_text(json.dumps(run, indent=1))
        doc["runs"][mode] = run
        print(f"{mode}: {json.dumps(run)}", flush=True)
    name = "colocate_tiny" if args.tiny else "colocate"
    results = Path(args.results)
    if args.kill_resume:
        doc["kill_resume"] = kill_resume(base, out / "kill_resume", args.kill_steps, args.kill_at)
        doc["kill_resume"]["date"] = info["date"]
        print(f"kill-resume: {json.dumps(doc['kill_resume'])}", flush=True)
    elif (results / f"{name}.json").is_file():  # an earlier check is kept (with its date), not dropped
        earlier = json.loads((results / f"{name}.json").read_text()).get("kill_resume")
        if earlier is not None:
            doc["kill_resume"] = earlier
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    (results / f"{name}.md").write_text(markdown(doc))
    print(markdown(doc))
    failed = [m for m, r in doc["runs"].items() if r["exit_code"] != 0]
    kr = doc.get("kill_resume")
    bad_resume = kr is not None and not (kr["same_step_numbers"] and kr["same_final_weights"] and kr["resumed"])
    return 1 if failed or bad_resume else 0


def _f(x: float | None, spec: str = ".2f") -> str:
    return "" if x is None else format(x, spec)


def markdown(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    lines = [
        "# Generation on every rank: colocated engines against rank-0 generation (2 torchrun ranks)",
        "",
        f"{m['date']}. CPU: {m['cpu_model']} ({', '.join(m['isa_flags'])}); {m['cores']} cores; bf16 matmul peak "
        f"{m['matmul_peak_bf16_gflops']:.0f} GFLOP/s; torch {m['torch']}; load average at the start "
        f"{m['loadavg_at_start']:.2f}. Command: `{doc['command']}`; overrides `{' '.join(doc['overrides'])}`.",
        "",
        "| configuration | gen s (step waits) | rank gen s max / min | step s | peak RSS rank 0 / engine | "
        "rank 1 / engine | whole run | exit |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in doc["runs"].items():
        s, pk = r["summary"], r["peak_rss_mib"]

        def gib(role: str, pk: dict = pk) -> str:
            return _f(pk[role] / 1024) if role in pk else "-"

        lines.append(
            f"| {mode} | {_f(s['timing_s/gen'])} | {_f(s['rollout/gen_s_rank_max'])} / {_f(s['rollout/gen_s_rank_min'])}"
            f" | {_f(s['timing_s/step'])} | {gib('rank 0')} / {gib('rank 0 engine')} GiB | {gib('rank 1')} / "
            f"{gib('rank 1 engine')} GiB | {_f(r['peak_total_rss_mib'] / 1024)} GiB | {r['exit_code']} |"
        )
    lines.append("")
    lines.append(f"Means over steps {doc['runs'][next(iter(doc['runs']))]['summary']['steps']} (step 1: warm-up).")
    if "kill_resume" in doc:
        kr = doc["kill_resume"]
        verdict = (
            "bitwise equal" if kr["same_step_numbers"] and kr["same_final_weights"] and kr["resumed"] else "NOT equal"
        )
        lines += [
            "",
            f"Kill and resume (colocated, {kr.get('date', '')}): killed at `{kr['kill_at']}` after step "
            f"{kr.get('killed_after_step')}, resumed to step {kr['last_step']}: step {kr['last_step']}'s numbers and the "
            f"final actor weights are {verdict} to an uninterrupted run (`{json.dumps(kr)}`).",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
