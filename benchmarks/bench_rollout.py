"""Rollout throughput: generated tokens per second of the ``hf`` and ``vllm`` backends.

Real SmolLM2-135M-Instruct, chat-templated arithmetic prompts, sampling at temperature 1.0
(seed 0), up to 128 new tokens, batches of 16 and 64 prompts. Tokens/s counts the tokens
actually generated (a response may stop at EOS before 128) over the wall time of one
``generate`` call, after a small warm-up call. For vLLM it also reports engine startup and the
time to push a full set of weights.

    python benchmarks/bench_rollout.py                       # hf-fp32, hf-bf16, vllm-bf16
    python benchmarks/bench_rollout.py --backends vllm-fp32,vllm-bf16-compile --batches 64

Backends: hf-fp32, hf-bf16, vllm-fp32, vllm-bf16, vllm-bf16-compile (enforce_eager=false).
Uses every core this process may use (``--threads`` to change); the machine's load average is
printed, since other processes on a small machine change the figures a lot.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time


def _prompts(tok, n: int) -> list[list[int]]:
    rng = random.Random(0)
    out = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        msgs = [{"role": "user", "content": f"What is {a} + {b}? Explain your steps, then give the answer after ####."}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        out.append(list(ids))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="hf-fp32,hf-bf16,vllm-bf16")
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None, help="threads per engine (default: all usable cores)")
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    args = ap.parse_args(argv)

    import torch

    from rlplug import get_plugin
    from rlplug.config.compose import compose
    from rlplug.contracts.types import SamplingParams
    from rlplug.training.models import default_model_dir, load_causal_lm, load_tokenizer

    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    path = str(default_model_dir())
    tok = load_tokenizer(path)
    batches = [int(b) for b in args.batches.split(",")]
    prompts = _prompts(tok, max(batches))
    print(f"model {path}\nthreads {threads}, load average at start {os.getloadavg()}", flush=True)
    results = []
    for spec in args.backends.split(","):
        name, _, variant = spec.partition("-")
        dtype = "bf16" if variant.startswith("bf16") else "fp32"
        overrides = [
            f"rollout={name}",
            f"rollout.dtype={dtype}",
            "rollout.micro_batch_size=64",
            f"rollout.num_threads={threads}",
            "rollout.kv_cache_space_gib=2",
        ]
        if variant.endswith("compile"):
            overrides.append("rollout.enforce_eager=false")
        cfg = compose(overrides)
        t0 = time.perf_counter()
        backend = get_plugin("rollout_backend", name)(cfg, path, tok)
        startup = time.perf_counter() - t0
        row: dict = {"backend": spec, "startup_s": round(startup, 1)}
        try:
            backend.generate(prompts[:2], SamplingParams(temperature=1.0, max_tokens=8, seed=0))  # warm-up
            if name == "vllm":
                weights = load_causal_lm(path).state_dict()
                t0 = time.perf_counter()
                backend.update_weights(weights)
                row["weight_push_s"] = round(time.perf_counter() - t0, 2)
                del weights
            for b in batches:
                params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=0)
                t0 = time.perf_counter()
                out = backend.generate(prompts[:b], params)
                dt = time.perf_counter() - t0
                ntok = sum(out.response_lengths)
                row[f"b{b}_tokens_per_s"] = round(ntok / dt, 1)
                row[f"b{b}_mean_len"] = round(ntok / b, 1)
                row[f"b{b}_s"] = round(dt, 1)
                print(
                    f"{spec:18s} batch {b:3d}: {ntok:6d} tokens in {dt:6.1f} s = {ntok / dt:7.1f} tokens/s "
                    f"(mean length {ntok / b:.0f}; load {os.getloadavg()[0]:.2f})",
                    flush=True,
                )
        finally:
            backend.close()
        print(
            f"{spec:18s} startup {startup:.1f} s"
            + (f", weight push {row['weight_push_s']} s" if "weight_push_s" in row else ""),
            flush=True,
        )
        results.append(row)
    print(f"load average at end {os.getloadavg()}")
    print(json.dumps(results, indent=1))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"threads": threads, "max_tokens": args.max_tokens, "results": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
