"""Generation inside the training loop against the bare vLLM engine, same batch, lengths and threads.

Workload: ``bench_vs_trl.py``'s GRPO batch (4 arithmetic prompts x 4 samples, temperature 1.0), every
response exactly ``--tokens`` tokens long (rlplug ``rollout.ignore_eos=true``, vLLM ``ignore_eos``),
so both sides generate the same number of tokens, bf16, eager (no CUDA graphs / compile), every core.

* ``bare``: ``vllm.LLM`` in a fresh process, nothing else (vLLM's defaults; threads bound to every
  core with ``VLLM_CPU_OMP_THREADS_BIND`` as rlplug does), ``generate`` of the same prompts with
  ``n=4``, ``--reps`` times, first dropped: tokens / wall seconds of one call.
* ``inloop``: ``rlplug train algorithm=grpo rollout=vllm`` (``bench_step.py``'s worker) for
  ``--steps`` steps: response tokens / ``timing_s/gen`` of each step after the first. ``timing_s/gen``
  is the step's whole generation stage (building the requests, the engine call through the pipe,
  turning the outputs into the batch); the weight push is its own stage (``update_weights``).

    python benchmarks/bench_gen_inloop.py            # writes benchmarks/results/gen_inloop.{md,json}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _machine import describe  # noqa: E402
from bench_step import run_config, run_json_worker  # noqa: E402
from bench_vs_trl import RLPLUG_BASE, write_parquet  # noqa: E402


def bare_worker(tokens: int, reps: int, out: str) -> int:
    """vllm.LLM alone: ``reps`` generate calls of the workload; writes seconds per call to ``out``."""
    cores = sorted(os.sched_getaffinity(0))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from _trl_worker import arithmetic_workload
    from vllm import LLM, SamplingParams

    from rlplug.training.models import default_model_dir, load_tokenizer

    path = str(default_model_dir())
    tok = load_tokenizer(path)
    prompts = []
    for item in arithmetic_workload(4, 0):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": item["question"]}], add_generation_prompt=True, tokenize=True
        )
        prompts.append({"prompt_token_ids": list(ids["input_ids"] if hasattr(ids, "keys") else ids)})
    t0 = time.perf_counter()
    llm = LLM(model=path, dtype="bfloat16", enforce_eager=True, seed=0)
    startup = time.perf_counter() - t0
    params = SamplingParams(n=4, temperature=1.0, max_tokens=tokens, ignore_eos=True)
    seconds, generated = [], []
    for _ in range(reps):
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - t)
        generated.append(sum(len(c.token_ids) for o in outs for c in o.outputs))
    Path(out).write_text(json.dumps({"seconds": seconds, "tokens": generated, "startup_s": startup}))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", nargs="?", default="run", choices=["run", "bare"])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    if args.mode == "bare":
        return bare_worker(args.tokens, args.reps, args.out)
    info = describe()
    bare = run_json_worker(
        [sys.executable, str(Path(__file__).resolve()), "bare", "--tokens", str(args.tokens), "--reps", str(args.reps)],
        "bare vLLM",
    )
    bare_tps = [t / s for t, s in zip(bare["tokens"][1:], bare["seconds"][1:])]
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "train.parquet"
        write_parquet(data)
        overrides = [*RLPLUG_BASE, f"data.train_files=[{data}]", "rollout=vllm", "rollout.ignore_eos=true"]
        overrides += [f"data.max_response_length={args.tokens}"]
        loop = run_config(overrides, args.steps)
    steps = loop["steps"][1:]
    loop_tps = [s["response_length/mean"] * 16 / s["timing_s/gen"] for s in steps]
    ratio = statistics.median(loop_tps) / statistics.median(bare_tps)
    lines = [
        "# Generation inside the loop vs the bare vLLM engine",
        "",
        f"CPU: {info['cpu_model']} ({', '.join(info['isa_flags'])}); {info['cores']} cores, load average at start "
        f"{info['loadavg_at_start']:.2f}. 4 prompts x 4 samples, exactly {args.tokens} tokens each, bf16, eager.",
        "",
        "| side | tokens/s (median) | per call / step |",
        "|---|---|---|",
        f"| bare `vllm.LLM.generate` | {statistics.median(bare_tps):.0f} | {', '.join(f'{x:.0f}' for x in bare_tps)} |",
        f"| rlplug loop (`timing_s/gen`) | {statistics.median(loop_tps):.0f} | "
        f"{', '.join(f'{x:.0f}' for x in loop_tps)} |",
        "",
        f"In-loop / bare: **{100 * ratio:.0f}%** (target >= 90%). Weight push per step (its own stage): "
        f"{statistics.median(s['timing_s/update_weights'] for s in steps):.2f} s; actor update per step "
        f"{statistics.median(s['timing_s/update_actor'] for s in steps):.2f} s (the engine idles meanwhile).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_save:
        res = HERE / "results"
        (res / "gen_inloop.md").write_text(text)
        (res / "gen_inloop.json").write_text(
            json.dumps({"machine": info, "bare": bare, "loop_tokens_per_s": loop_tps, "ratio": ratio}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
