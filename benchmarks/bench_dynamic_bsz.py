"""Actor update on a batch of mixed response lengths: fixed micro-batches vs a token budget.

Workload: the default model (SmolLM2-135M-Instruct, fp32 on CPUs without fast bf16, else the
``auto`` dtype), one actor update (``ppo_epochs=1``, one mini-batch) on ``--rows`` responses whose
lengths are drawn uniformly from ``--min-len`` .. ``--max-len`` tokens (prompt 48 tokens), random
token ids and advantages. Variants, each in its own subprocess (so peak memory is its own):

* ``fixed``: ``actor.micro_batch_size_per_device=--micro`` rows per forward/backward;
* ``dynamic``: ``actor.use_dynamic_bsz=true``, ``actor.max_token_len_per_device=--budget`` padded
  tokens per pass (``rlplug.algorithms.token_budget``).

Prints per variant the wall time of the update (after one warm-up update), the number of passes,
the largest pass in padded tokens, and the peak resident memory above the level before the update
(sampled every 5 ms with psutil; the warm-up update ran first, so the allocator's cache is warm), plus
the parameters' largest difference between the two variants (they must agree: micro-batching never
changes results). Writes ``benchmarks/results/dynamic_bsz.json`` with ``--out``.

    python benchmarks/bench_dynamic_bsz.py --threads 2 --out benchmarks/results/dynamic_bsz.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PROMPT = 48


def _variant(args: argparse.Namespace) -> dict:
    import psutil
    import torch
    from omegaconf import OmegaConf

    torch.set_num_threads(args.threads)
    from rlplug.algorithms.token_budget import packed_cost, row_lengths
    from rlplug.config.schema import RunConfig
    from rlplug.contracts.batch import Batch
    from rlplug.plugins.training.local import LocalTrainingBackend
    from rlplug.training.models import resolve_model_path

    cfg = OmegaConf.structured(RunConfig)
    cfg.trainer.device = "cpu"
    cfg.data.train_batch_size = args.rows
    cfg.data.max_prompt_length = PROMPT
    cfg.data.max_response_length = args.max_len
    cfg.actor.ppo_mini_batch_size = args.rows
    cfg.actor.micro_batch_size_per_device = args.micro
    cfg.actor.optim.lr = 1e-6
    if args.variant == "dynamic":
        cfg.actor.use_dynamic_bsz = True
        cfg.actor.max_token_len_per_device = args.budget
    backend = LocalTrainingBackend(cfg, resolve_model_path(cfg.model), use_critic=False, use_ref=False, total_steps=4)

    g = torch.Generator().manual_seed(0)
    b, t = args.rows, args.max_len
    lengths = torch.randint(args.min_len, args.max_len + 1, (b,), generator=g)
    ids = torch.randint(100, 40000, (b, PROMPT + t), generator=g)
    attn = torch.zeros(b, PROMPT + t, dtype=torch.long)
    for i in range(b):
        attn[i, : PROMPT + int(lengths[i])] = 1
    mask = (torch.arange(t)[None] < lengths[:, None]).float()
    batch = Batch(
        {
            "input_ids": ids,
            "attention_mask": attn,
            "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, PROMPT:],
            "response_mask": mask,
            "advantages": torch.randn(b, t, generator=g) * mask,
        }
    )
    batch["old_log_probs"] = backend.compute_log_probs(batch)["log_probs"]
    backend.update_actor(batch)  # warm-up (allocator, kernels)

    micros, _ = backend._micro_batches(batch, backend.actor.micro_batch, backend.actor.token_budget)
    costs = [packed_cost(*row_lengths(m["attention_mask"], t)) for m in micros]
    proc = psutil.Process()
    base = proc.memory_info().rss
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.005)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t0 = time.perf_counter()
    backend.update_actor(batch)
    wall = time.perf_counter() - t0
    done.set()
    th.join()
    params = torch.cat([p.detach().flatten() for p in backend.actor.model.parameters()])
    torch.save(params, args.params_out)
    return {
        "variant": args.variant,
        "update_s": round(wall, 2),
        "passes": len(micros),
        "rows_per_pass": [len(m) for m in micros],
        "largest_pass_tokens": max(costs),
        "peak_rss_above_start_mib": round((peak[0] - base) / 2**20, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--micro", type=int, default=8, help="fixed variant: rows per pass")
    p.add_argument("--budget", type=int, default=2048, help="dynamic variant: padded tokens per pass")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    p.add_argument("--variant", choices=["fixed", "dynamic"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--params-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        print(json.dumps(_variant(args)))
        return
    import torch
    from learning_check import cpu_model  # benchmarks/ is this script's folder, first on sys.path

    cpu = cpu_model()
    print(
        f"CPU: {cpu}, {os.cpu_count()} cores, {args.threads} threads; {args.rows} responses of {args.min_len}-{args.max_len} tokens"
    )
    results, params = [], []
    tmp = tempfile.TemporaryDirectory(prefix="bench_dynamic_bsz_")
    for variant in ("fixed", "dynamic"):
        out = Path(tmp.name) / f"{variant}.pt"
        cmd = [sys.executable, __file__, *sys.argv[1:], "--variant", variant, "--params-out", str(out)]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        line = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout.strip().splitlines()[-1]
        r = json.loads(line)
        results.append(r)
        params.append(torch.load(out))
        print(
            f"{variant:8s} update {r['update_s']:7.2f} s  passes {r['passes']:3d}  largest pass {r['largest_pass_tokens']:6d} "
            f"tokens  peak +{r['peak_rss_above_start_mib']:.0f} MiB"
        )
    tmp.cleanup()
    diff = float((params[0] - params[1]).abs().max())
    print(f"largest parameter difference fixed vs dynamic: {diff:.3g}")
    if args.out:
        Path(args.out).write_text(
            json.dumps({"cpu": cpu, "args": vars(args), "results": results, "max_param_diff": diff}, indent=1)
        )


if __name__ == "__main__":
    main()
