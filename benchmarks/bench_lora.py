"""Full fine-tuning vs LoRA: peak memory and step time of real training steps.

Workload: ``rlplug train`` on the default task (``experiment=default``: PPO-style defaults, the
basic-arithmetic data, the default model SmolLM2-135M-Instruct) for ``--steps`` steps, no
validation, no checkpoints. Variants, each in its own subprocess (so peak memory is its own):

* ``full``: every weight trains (``model.lora_rank=0``), with a separate reference model when the
  algorithm needs one;
* ``lora``: ``model.lora_rank=--rank`` (``lora_alpha=2 * rank``, ``target_modules=all-linear``): the
  adapters train, the reference is the base (adapters off, no second copy), the rollout engine gets
  merged weights each step (:mod:`rlplug.training.lora`).

Per variant: the mean wall time of a step after the first (``timing_s/step``) and of its actor
update (``timing_s/update_actor``), the trainable parameter count, the process's peak resident
memory (psutil, sampled every 10 ms from the start, model loading included) and the resident
memory once the models are built; with CUDA also ``torch.cuda.max_memory_allocated``. ``--tiny``
uses the tiny random 2-layer model (``debug=tiny``: a smoke run of the script in seconds). Prints
the CPU model and writes a JSON result (``--out``, default ``benchmarks/results/lora.json``).

    python benchmarks/bench_lora.py --steps 4 --threads 2
    python benchmarks/bench_lora.py --tiny --out lora_tiny.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "lora.json"


def _overrides(args: argparse.Namespace, run_dir: str) -> list[str]:
    rank = 0 if args.variant == "full" else args.rank
    out = [
        *(["debug=tiny"] if args.tiny else []),
        f"trainer.total_training_steps={args.steps}",
        "trainer.save_freq=0",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "trainer.logger=[]",
        f"trainer.num_threads={args.threads}",
        f"trainer.default_local_dir={run_dir}",
        f"model.lora_rank={rank}",
        f"model.lora_alpha={2 * rank if rank else 16}",
        *args.override,
    ]
    return out


def _variant(args: argparse.Namespace) -> dict:
    import tempfile

    import psutil
    import torch

    import rlplug
    from rlplug.config.compose import compose
    from rlplug.contracts.registry import get_registry
    from rlplug.run.trainer import Trainer
    from rlplug.run.validate import validate_config

    proc = psutil.Process()
    peak = [proc.memory_info().rss]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.01)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    steps: list[dict[str, float]] = []

    class Recorder:
        @rlplug.hookimpl
        def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
            steps.append(dict(metrics))

    with tempfile.TemporaryDirectory(prefix="bench_lora_") as run_dir:
        cfg = compose(_overrides(args, run_dir))
        validate_config(cfg)
        get_registry().pm.register(Recorder())
        trainer = Trainer(cfg)
        built_rss = proc.memory_info().rss
        model = trainer.backend.actor.model
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        try:
            trainer.fit()
        finally:
            trainer.close()
    done.set()
    th.join()
    timed = steps[1:] or steps

    def mean(key: str) -> float | None:
        values = [s[key] for s in timed if key in s]
        return round(sum(values) / len(values), 3) if values else None

    result = {
        "variant": args.variant,
        "lora_rank": 0 if args.variant == "full" else args.rank,
        "steps": len(steps),
        "step_s": mean("timing_s/step"),
        "update_actor_s": mean("timing_s/update_actor"),
        "trainable_params": trainable,
        "actor_params": total,
        "peak_rss_mib": round(peak[0] / 2**20, 1),
        "rss_after_build_mib": round(built_rss / 2**20, 1),
    }
    if torch.cuda.is_available():
        result["cuda_max_allocated_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4, help="training steps per variant (the first is not timed)")
    p.add_argument("--rank", type=int, default=32, help="LoRA rank of the lora variant")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tiny", action="store_true", help="the tiny random model (debug=tiny): a smoke run")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("override", nargs="*", help="extra Hydra overrides for both variants (e.g. algorithm=grpo)")
    p.add_argument("--variant", choices=["full", "lora"], default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.variant:
        print("RESULT " + json.dumps(_variant(args)), flush=True)
        return {}
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from learning_check import cpu_model

    cpu = cpu_model()
    model = "tiny random 2-layer model" if args.tiny else "SmolLM2-135M-Instruct"
    print(f"CPU: {cpu}, {os.cpu_count()} cores, {args.threads} threads; {model}, {args.steps} steps per variant")
    results = []
    for variant in ("full", "lora"):
        cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--variant", variant]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            raise SystemExit(f"variant {variant} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        res = json.loads(lines[-1][len("RESULT ") :])
        results.append(res)
        print(
            f"{variant:>4}: step {res['step_s']} s, update_actor {res['update_actor_s']} s, trainable "
            f"{res['trainable_params']:,} of {res['actor_params']:,} params, peak RSS {res['peak_rss_mib']} MiB "
            f"(after build {res['rss_after_build_mib']} MiB)",
            flush=True,
        )
    out = {"cpu_model": cpu, "cores": os.cpu_count(), "threads": args.threads, "model": model, "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    main()
