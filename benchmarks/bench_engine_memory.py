"""The vLLM engine child's resident memory over many weight pushes and generations, with and without
the C-heap trim after each command (``trainer.malloc_trim``; issue 21).

Workload: the default experiment's model (SmolLM2-135M-Instruct) and rollout settings
(``rollout=vllm``, the default dtype), prompts of its task (``basic_arithmetic``), and per
iteration what a training step asks of the engine: one weight push (the model's own weights, every
tensor, as the trainer sends them) and one generation of ``--prompts`` prompts x ``rollout.n``
samples. The trainer itself does nothing else, so what grows is the engine's own. Variants, one after
the other in this run, each with a fresh engine child: ``trim`` (the default) and ``no_trim``
(``trainer.malloc_trim=false``).

Prints per variant and iteration the child's resident size and its C heap in use / held free
(the child's ``memory`` command: :meth:`rlplug.plugins.rollout.vllm.VLLMRollout.memory`), then the
slope of the resident size over the iterations after ``--warmup`` (MiB per iteration, least squares)
and the time per push and generation. Writes the rows and the summary with ``--out``.

    OMP_NUM_THREADS=1 python benchmarks/bench_engine_memory.py --iterations 12 --out benchmarks/results/engine_memory.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _variant(name: str, args: argparse.Namespace, overrides: list[str]) -> dict:
    from safetensors.torch import load_file

    from rlplug.config.compose import compose
    from rlplug.data.dataset import read_dataset
    from rlplug.data.prepare import prepare_dataset
    from rlplug.plugins.rollout.vllm import VLLMRollout
    from rlplug.run.trainer import sampling_params
    from rlplug.training.models import load_tokenizer, resolve_model_path

    cfg = compose(["rollout=vllm", *overrides, *(["trainer.malloc_trim=false"] if name == "no_trim" else [])])
    model_path = resolve_model_path(cfg.model)
    tok = load_tokenizer(model_path)
    with tempfile.TemporaryDirectory(prefix="rlplug-bench-engine-") as tmp:
        files = prepare_dataset(
            str(cfg.data.task), tmp, train_size=args.prompts * args.iterations, test_size=1, seed=0,
            instruction=cfg.data.instruction,
        )  # fmt: skip
        ds = read_dataset(files["train_path"], tokenizer=tok, max_prompt_length=int(cfg.data.max_prompt_length))
        prompts = [list(ds[i]["prompt_ids"]) for i in range(len(ds))]
    weights = load_file(str(Path(model_path) / "model.safetensors"))
    params = sampling_params(cfg, step=0)
    engine = VLLMRollout(cfg, model_path, tok)
    rows = []
    try:
        start = engine.memory()
        print(f"[{name}] engine started in {engine.startup_s:.1f} s: rss {start['rss_mib']:.0f} MiB", flush=True)
        for it in range(args.iterations):
            t0 = time.perf_counter()
            engine.update_weights(weights)
            t1 = time.perf_counter()
            batch = prompts[it * args.prompts : (it + 1) * args.prompts]
            out = engine.generate(batch, params)
            t2 = time.perf_counter()
            mem = engine.memory()
            tokens = sum(len(r) for r in out.response_ids)
            row = {
                "iteration": it + 1,
                "rss_mib": mem["rss_mib"],
                "heap_used_mib": mem["heap_used_mib"],
                "heap_free_mib": mem["heap_free_mib"],
                "push_s": t1 - t0,
                "generate_s": t2 - t1,
                "response_tokens": tokens,
            }
            rows.append(row)
            print(
                f"[{name}] it {it + 1}: rss {row['rss_mib']:.0f} MiB, heap used {row['heap_used_mib']:.0f} / free "
                f"{row['heap_free_mib']:.0f} MiB; push {row['push_s']:.1f} s, generate {row['generate_s']:.1f} s "
                f"({tokens} tokens)",
                flush=True,
            )
    finally:
        engine.close()
    later = [r for r in rows if r["iteration"] > args.warmup]
    slope = (
        float(np.polyfit([r["iteration"] for r in later], [r["rss_mib"] for r in later], 1)[0])
        if len(later) > 1
        else None
    )
    return {
        "variant": name,
        "malloc_trim": name == "trim",
        "rss_at_start_mib": start["rss_mib"],
        "rss_first_mib": rows[0]["rss_mib"],
        "rss_last_mib": rows[-1]["rss_mib"],
        "rss_max_mib": max(r["rss_mib"] for r in rows),
        "rss_slope_mib_per_iteration": slope,
        "median_push_s": float(np.median([r["push_s"] for r in rows])),
        "median_generate_s": float(np.median([r["generate_s"] for r in rows])),
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=12, help="weight push + generation rounds per variant")
    p.add_argument("--prompts", type=int, default=16, help="prompts per generation (x rollout.n samples)")
    p.add_argument("--warmup", type=int, default=3, help="iterations left out of the slope")
    p.add_argument("--variants", default="trim,no_trim")
    p.add_argument("--out", type=Path, help="write the results JSON here")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for the run config (e.g. rollout.n=2)")
    args = p.parse_args(argv)

    import torch
    from learning_check import cpu_model  # benchmarks/ is this script's folder, first on sys.path

    print(
        f"CPU: {cpu_model()}; torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}; "
        f"{args.iterations} iterations of {args.prompts} prompts",
        flush=True,
    )
    results = [_variant(v, args, list(args.overrides)) for v in args.variants.split(",")]
    for r in results:
        s = r["rss_slope_mib_per_iteration"]
        print(
            f"{r['variant']}: rss {r['rss_first_mib']:.0f} -> {r['rss_last_mib']:.0f} MiB (max {r['rss_max_mib']:.0f}); "
            f"slope after iteration {args.warmup}: {'n/a' if s is None else f'{s:+.1f}'} MiB/iteration; "
            f"median push {r['median_push_s']:.1f} s, generate {r['median_generate_s']:.1f} s",
            flush=True,
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        summary = {
            "cpu": cpu_model(),
            "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "iterations": args.iterations,
            "prompts": args.prompts,
            "warmup": args.warmup,
            "overrides": list(args.overrides),
            "command": " ".join(
                ["python", "benchmarks/bench_engine_memory.py", *(argv if argv is not None else sys.argv[1:])]
            ),
            "variants": results,
        }
        args.out.write_text(json.dumps(summary, indent=1))
        print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
