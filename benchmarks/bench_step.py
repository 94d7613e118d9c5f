"""Training-step time of rlplug: per-stage breakdown and how the cost scales.

Each configuration runs in a fresh subprocess (``bench_step.py worker``): it builds the
:class:`rlplug.run.trainer.Trainer` exactly as ``rlplug train`` does, runs ``--steps`` training steps
(no validation, checkpoints or trackers) and writes every step's metrics, the start-up time and
the peak resident memory of the whole process tree (trainer + vLLM engine processes, summed,
sampled every 0.2 s) as JSON. Figures are medians over the steps after the first (the first
step pays one-time costs: kernel warm-up, allocator growth).

Modes::

    python benchmarks/bench_step.py breakdown   # default PPO experiment, per-stage seconds
    python benchmarks/bench_step.py scaling     # step time vs prompts per step and response length
    python benchmarks/bench_step.py breakdown --steps 4 -- rollout=hf   # extra Hydra overrides

``breakdown``: the default experiment (``rlplug train``: PPO with GAE and a critic, vLLM rollout,
32 prompts per step, up to 128 response tokens) with ``trainer.critic_warmup=0`` so every
measured step also updates the actor. It reports ``timing_s/<stage>`` (gen, old_log_prob,
values, reward: scored on a thread while the passes run, reward_wait: what the step waited for it
afterwards, adv, update_critic, update_actor, update_weights), generation tokens/s (response
tokens / ``gen``), training tokens/s (prompt + response tokens / ``update_actor``) and the peak
memory.

``scaling``: the same experiment with ``rollout.ignore_eos=true`` so every response has exactly
``max_response_length`` tokens (otherwise the model's short arithmetic answers would hide the
length axis): prompts per step 8, 16, 32, 64 at 128 tokens, and 64, 128, 256, 512 tokens at 16
prompts, always two mini-batches per step (``ppo_mini_batch_size`` = half the prompts, as the
default experiment's 32/16), so every point runs the same stages. Writes a table (markdown +
CSV) and a stacked-bar plot of the stages.

Results go to ``benchmarks/results/step_{breakdown,scaling}.*``. The machine's core count and
load average are recorded with them; other processes change the figures a lot on a small machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

#: what every benchmark run turns off: validation, checkpoints, trackers, the wall-time budget
QUIET = [
    "trainer.test_freq=0",
    "trainer.save_freq=0",
    "trainer.val_before_train=false",
    "trainer.logger=[]",
    "trainer.max_wall_time_s=null",
    "trainer.resume_mode=disable",
]

#: the stages of a step, in order (``timing_s/<stage>``); ``reward`` overlaps the passes before it
STAGES = [
    "gen",
    "old_log_prob",
    "ref",
    "values",
    "reward_wait",
    "adv",
    "update_critic",
    "update_actor",
    "update_weights",
]


# ----------------------------------------------------------------------------- worker (subprocess)
class PeakRSS:
    """Sample the summed RSS of this process and all its descendants every ``interval`` seconds."""

    def __init__(self, interval: float = 0.2) -> None:
        import psutil

        self.proc, self.interval, self.peak = psutil.Process(), interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="peak-rss")

    def _sample(self) -> int:
        total = 0
        for p in [self.proc, *self.proc.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except Exception:
                pass
        return total

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self._sample())

    def start(self) -> PeakRSS:
        """Take a first sample and start sampling in a daemon thread; returns ``self``."""
        self.peak = self._sample()
        self._thread.start()
        return self

    def stop(self) -> int:
        """Stop sampling; returns the peak (bytes), counting a last sample."""
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._sample())
        return self.peak

    def __enter__(self) -> PeakRSS:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def worker(overrides: list[str], steps: int, out: str) -> int:
    """Build the trainer from ``overrides``, run ``steps`` steps, write the JSON result to ``out``."""
    t0 = time.perf_counter()
    # OpenMP waiting as the rlplug CLI leaves it: libgomp's default, as in the engine child
    from omegaconf import OmegaConf

    from rlplug.config.compose import compose
    from rlplug.run.trainer import Trainer
    from rlplug.run.validate import validate_config

    with tempfile.TemporaryDirectory(prefix="rlplug-bench-") as run_dir, PeakRSS() as rss:
        cfg = compose([*QUIET, *overrides, f"trainer.default_local_dir={run_dir}"])
        validate_config(cfg)
        OmegaConf.set_readonly(cfg, False)
        trainer = Trainer(cfg)
        startup = time.perf_counter() - t0
        with open(Path(trainer.model_path) / "config.json") as f:
            mc = json.load(f)
        vocab, hidden = int(mc["vocab_size"]), int(mc["hidden_size"])
        n_params = sum(p.numel() for p in trainer.backend.actor.model.parameters())  # tied head counted once
        model_info = {"nonemb_params": n_params - vocab * hidden, "vocab": vocab, "hidden": hidden}
        records = []
        try:
            for _ in range(steps):
                m = trainer.train_step()
                m["bench/rss_gib"] = rss.peak / 2**30
                records.append({k: float(v) for k, v in m.items()})
                print(f"step {len(records)}: {m['timing_s/step']:.1f} s", file=sys.stderr, flush=True)
        finally:
            trainer.close()
        cfg_summary = {
            "algorithm": cfg.algorithm.adv_estimator,
            "rollout": cfg.rollout.name,
            "train_batch_size": cfg.data.train_batch_size,
            "n": cfg.rollout.n,
            "max_response_length": cfg.data.max_response_length,
            "ppo_mini_batch_size": cfg.actor.ppo_mini_batch_size,
            "micro_batch_size_per_device": cfg.actor.micro_batch_size_per_device,
        }
    import torch

    result = {
        "overrides": overrides,
        "model": model_info,
        "config": cfg_summary,
        "startup_s": startup,
        "steps": records,
        "peak_rss_gib": rss.peak / 2**30,
        "torch_threads": torch.get_num_threads(),
    }
    Path(out).write_text(json.dumps(result, indent=1))
    return 0


# ----------------------------------------------------------------------------- driver
def machine() -> dict:
    return {"cores": len(os.sched_getaffinity(0)), "loadavg_at_start": os.getloadavg()[0]}


def run_json_worker(cmd: list[str], what: str, timeout_s: float = 3600) -> dict:
    """Run ``cmd + ["--out", FILE]`` in a fresh process and return the JSON it wrote to FILE.

    Raises ``RuntimeError`` naming ``what`` with the tail of the worker's stderr when it exits
    non-zero, ``subprocess.TimeoutExpired`` after ``timeout_s`` seconds.
    """
    with tempfile.TemporaryDirectory(prefix="rlplug-bench-") as tmp:
        out = Path(tmp) / "result.json"
        proc = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def run_config(overrides: list[str], steps: int, timeout_s: float = 3600) -> dict:
    """Run :func:`worker` with ``overrides`` for ``steps`` steps in a fresh process; its JSON result."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "worker", "--steps", str(steps), *overrides]
    return run_json_worker(cmd, f"rlplug worker for {overrides}", timeout_s)


def summarize(result: dict, skip: int = 1) -> dict:
    """Medians over the steps after the first ``skip``: stage seconds, step seconds, tokens/s."""
    steps = result["steps"][skip:] or result["steps"]

    def med(key: str) -> float:
        vals = [s.get(key, 0.0) for s in steps]
        return statistics.median(vals)

    out = {stage: med(f"timing_s/{stage}") for stage in [*STAGES, "reward"]}
    out["step"] = med("timing_s/step")
    out["gen_tokens_per_s"] = med("perf/gen_tokens_per_s")
    out["train_tokens_per_s"] = statistics.median(
        s["perf/total_num_tokens"] / s["timing_s/update_actor"] for s in steps if s.get("timing_s/update_actor")
    )
    out["tokens_per_step"] = med("perf/total_num_tokens")
    out["response_length"] = med("response_length/mean")
    out["peak_rss_gib"] = result["peak_rss_gib"]
    out["startup_s"] = result["startup_s"]
    if "model" in result:
        out["model_tflop"] = statistics.median(step_model_flops(s, result) for s in steps) / 1e12
    return out


def step_model_flops(step: dict, result: dict) -> float:
    """Model FLOPs of one PPO step (the issue's convention: no recomputation, no optimizer step).

    With ``N`` non-embedding parameters, ``VH`` the LM-head size, ``tok`` prompt + response tokens
    and ``resp`` response tokens of the step: generation ``2 N resp + 2 VH resp`` (one forward per
    generated token; the prompt prefill ``2 N (tok - resp)``), the old-log-prob pass
    ``2 N tok + 2 VH resp`` (when it ran), the value pass ``2 N tok``, the critic update ``6 N tok``
    and the actor update ``6 N tok + 6 VH resp``. Attention's L^2 terms are left out (under 3% at
    these lengths).
    """
    m = result["model"]
    n, vh = m["nonemb_params"], m["vocab"] * m["hidden"]
    rows = result["config"]["train_batch_size"] * result["config"]["n"]
    tok, resp = step["perf/total_num_tokens"], step["response_length/mean"] * rows
    flops = 2 * n * tok + 2 * vh * resp  # generation: prefill + decode
    if step.get("timing_s/old_log_prob", 0.0) > 0:
        flops += 2 * n * tok + 2 * vh * resp
    if step.get("timing_s/values", 0.0) > 0:
        flops += 2 * n * tok
    if step.get("timing_s/update_critic", 0.0) > 0:
        flops += 6 * n * tok
    if step.get("timing_s/update_actor", 0.0) > 0:
        flops += 6 * n * tok + 6 * vh * resp
    return flops


def cmd_breakdown(args: argparse.Namespace) -> int:
    from _machine import describe, matmul_peak

    overrides = ["trainer.critic_warmup=0", *args.overrides]
    info = {**machine(), **describe()}
    peak = matmul_peak("bf16")
    result = run_config(overrides, args.steps)
    s = summarize(result)
    s["bf16_peak_gflops"] = peak["gflops"]
    lines = [
        f"# Step breakdown: default PPO experiment ({' '.join(overrides)})",
        "",
        f"{info['cores']} cores, load average at start {info['loadavg_at_start']:.2f}; {args.steps} steps, "
        f"medians of steps 2-{args.steps}; {result['config']}",
        "",
        "| stage | seconds | share of step |",
        "|---|---|---|",
    ]
    for stage in STAGES:
        if s[stage] > 0:
            lines.append(f"| {stage} | {s[stage]:.2f} | {100 * s[stage] / s['step']:.0f}% |")
    lines += [
        f"| **step** | **{s['step']:.2f}** | |",
        "",
        f"- reward scoring took {s['reward']:.3f} s on its thread, overlapped with the passes; the step waited "
        f"{s['reward_wait']:.3f} s for it",
        f"- generation: {s['gen_tokens_per_s']:.0f} response tokens/s; training (update_actor): "
        f"{s['train_tokens_per_s']:.0f} tokens/s ({s['tokens_per_step']:.0f} prompt+response tokens per step, "
        f"mean response {s['response_length']:.1f} tokens)",
        f"- peak resident memory (trainer + engine processes): {s['peak_rss_gib']:.2f} GiB; start-up {s['startup_s']:.0f} s",
        f"- whole step: {s['model_tflop']:.2f} TFLOP of model FLOPs (generation, passes and updates; "
        f"`step_model_flops`) in {s['step']:.1f} s = {1000 * s['model_tflop'] / s['step']:.0f} GFLOP/s, "
        f"**MFU {100 * 1000 * s['model_tflop'] / s['step'] / peak['gflops']:.0f}%** of the measured bf16 matmul "
        f"peak ({peak['gflops']:.0f} GFLOP/s, {info['cpu_model']}, {', '.join(info['isa_flags'])})",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_save:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "step_breakdown.md").write_text(text)
        (args.out_dir / "step_breakdown.json").write_text(
            json.dumps({"machine": info, "summary": s, "raw": result}, indent=1)
        )
    return 0


def cmd_scaling(args: argparse.Namespace) -> int:
    info = machine()
    grid = [(b, 128) for b in args.batches] + [(16, t) for t in args.lengths if t != 128 or 16 not in args.batches]
    rows = []
    for b, t in grid:
        overrides = [
            "trainer.critic_warmup=0",
            "rollout.ignore_eos=true",
            f"data.train_batch_size={b}",
            f"data.max_response_length={t}",
            f"actor.ppo_mini_batch_size={b // 2}",
            f"actor.micro_batch_size_per_device={min(8, b // 2)}",
            *args.overrides,
        ]
        print(f"batch {b}, response length {t} ...", flush=True)
        s = summarize(run_config(overrides, args.steps))
        rows.append({"prompts": b, "max_response_length": t, **s})
        print(
            f"  step {s['step']:.1f} s (gen {s['gen']:.1f}, update_actor {s['update_actor']:.1f}), "
            f"peak {s['peak_rss_gib']:.1f} GiB",
            flush=True,
        )
    header = [
        "prompts",
        "max_response_length",
        "step",
        *[st for st in STAGES if any(r[st] > 0 for r in rows)],
        "gen_tokens_per_s",
        "train_tokens_per_s",
        "peak_rss_gib",
    ]
    md = [
        "# Step time scaling: default PPO experiment, responses forced to max length (rollout.ignore_eos=true)",
        "",
        f"{info['cores']} cores, load average at start {info['loadavg_at_start']:.2f}; medians of steps 2-{args.steps}; "
        "seconds unless stated",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    md += [
        "| " + " | ".join(f"{r[h]:.2f}" if isinstance(r[h], float) else str(r[h]) for h in header) + " |" for r in rows
    ]
    text = "\n".join(md) + "\n"
    print(text)
    if args.no_save:
        return 0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "step_scaling.md").write_text(text)
    (args.out_dir / "step_scaling.csv").write_text(
        "\n".join(
            [",".join(header)]
            + [",".join(f"{r[h]:.4f}" if isinstance(r[h], float) else str(r[h]) for h in header) for r in rows]
        )
        + "\n"
    )
    plot_scaling(rows, args.out_dir / "step_scaling.png")
    return 0


def plot_scaling(rows: list[dict], path: Path) -> None:
    """Two panels of stacked bars (seconds per stage): vs prompts per step, vs response length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("prompts per step (128 tokens each)", [r for r in rows if r["max_response_length"] == 128], "prompts"),
        ("max response length (16 prompts)", [r for r in rows if r["prompts"] == 16], "max_response_length"),
    ]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, (title, sub, key) in zip(axes, panels):
        sub = sorted(sub, key=lambda r: r[key])
        xs = [str(r[key]) for r in sub]
        bottom = [0.0] * len(sub)
        for stage in STAGES:
            vals = [r[stage] for r in sub]
            if any(v > 0.05 for v in vals):
                ax.bar(xs, vals, bottom=bottom, label=stage)
                bottom = [b + v for b, v in zip(bottom, vals)]
        for x, r in zip(xs, sub):
            ax.annotate(f"{r['step']:.0f} s", (x, r["step"]), ha="center", va="bottom", fontsize=8)
        ax.set_title(title)
        ax.set_ylabel("seconds per step")
    axes[0].legend(fontsize=8)
    fig.suptitle("rlplug PPO step time on a 2-core CPU (SmolLM2-135M, vLLM rollout)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    w = sub.add_parser("worker", help="(internal) run one configuration")
    w.add_argument("--steps", type=int, required=True)
    w.add_argument("--out", required=True)
    w.add_argument("overrides", nargs="*")
    b = sub.add_parser("breakdown", help="per-stage timing of the default PPO experiment")
    b.add_argument("--steps", type=int, default=5)
    b.add_argument("--no-save", action="store_true", help="print only; do not write result files")
    b.add_argument("--out-dir", type=Path, default=RESULTS)
    b.add_argument("overrides", nargs="*", help="extra Hydra overrides (after --)")
    s = sub.add_parser("scaling", help="step time vs prompts per step and response length")
    s.add_argument("--steps", type=int, default=3)
    s.add_argument("--batches", type=lambda v: [int(x) for x in v.split(",")], default=[8, 16, 32, 64])
    s.add_argument("--lengths", type=lambda v: [int(x) for x in v.split(",")], default=[64, 128, 256, 512])
    s.add_argument("--no-save", action="store_true")
    s.add_argument("--out-dir", type=Path, default=RESULTS)
    s.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    if args.mode == "worker":
        return worker(args.overrides, args.steps, args.out)
    return cmd_breakdown(args) if args.mode == "breakdown" else cmd_scaling(args)


if __name__ == "__main__":
    sys.exit(main())
