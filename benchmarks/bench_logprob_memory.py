"""Peak memory of token log-probs + entropy, forward and backward: naive full logits vs chunked.

Workload: ``B x T = 16 x 384`` response tokens (N = 6144 rows), vocabulary ``V = 49152`` and hidden
size ``H = 576`` (SmolLM2-135M), random fp32 hidden states and output projection, both requiring
grad. Loss = ``sum(w1 * log_probs) + sum(w2 * entropy)`` with random weights, then backward.

* naive: ``log_softmax(hidden @ W.T / temperature)`` over all rows, gather, ``-sum(p log p)``.
* chunked: :func:`rlplug.algorithms.logprob.log_probs_from_hidden` (the fused function: ``chunk_size`` rows
  at a time, each chunk's logits recomputed in its hand-written backward).

Each variant runs in its own subprocess. Peak memory is measured as resident-set size above the
level after the inputs were created, both by sampling ``psutil`` RSS every 5 ms in a thread and
by the kernel's high-water mark (``ru_maxrss``); the larger of the two is reported. (tracemalloc
cannot see torch's allocations.)

Usage::

    OMP_NUM_THREADS=1 python benchmarks/bench_logprob_memory.py [--chunk-size 1024] [--threads 1]

Prints both peaks, the ratio chunked/naive (target <= 0.25) and the wall time of each.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time

B, T, V, H = 16, 384, 49152, 576
TEMPERATURE = 0.8


def _rss_bytes(proc) -> int:
    return int(proc.memory_info().rss)


def run_variant(variant: str, chunk_size: int, threads: int) -> dict:
    import psutil
    import torch

    torch.set_num_threads(threads)
    from rlplug.algorithms.logprob import log_probs_from_hidden

    n = B * T
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(n, H, generator=g) * 1.0).requires_grad_(True)
    weight = (torch.randn(V, H, generator=g) * 0.02).requires_grad_(True)
    labels = torch.randint(0, V, (n,), generator=g)
    w1 = torch.randn(n, generator=g)
    w2 = torch.randn(n, generator=g)
    # pre-allocate the gradients so that both variants start from the same resident level
    hidden.grad = torch.zeros_like(hidden)
    weight.grad = torch.zeros_like(weight)

    proc = psutil.Process()
    base_rss = _rss_bytes(proc)
    base_max = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    peak = [base_rss]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_bytes(proc))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    if variant == "naive":
        logits = (hidden @ weight.T) / TEMPERATURE  # (N, V)
        logp = torch.log_softmax(logits, dim=-1)
        lp = logp.gather(-1, labels[:, None]).squeeze(-1)
        ent = -(logp.exp() * logp).sum(-1)
    else:
        lp, ent = log_probs_from_hidden(
            hidden, weight, labels, temperature=TEMPERATURE, chunk_size=chunk_size, with_entropy=True
        )
    loss = (w1 * lp).sum() + (w2 * ent).sum()
    loss.backward()
    wall = time.perf_counter() - t0
    stop.set()
    sampler.join()
    peak[0] = max(peak[0], _rss_bytes(proc))
    high_water = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # ru_maxrss is a high-water mark of the whole process: it only tells about this computation
    # when it rose above what the process had reached before (it always does here).
    hw_delta = max(0, high_water - max(base_max, base_rss))
    return {
        "variant": variant,
        "peak_extra_bytes": max(peak[0] - base_rss, hw_delta),
        "sampled_extra_bytes": peak[0] - base_rss,
        "high_water_extra_bytes": hw_delta,
        "wall_s": wall,
        "loss": float(loss.detach()),
        "grad_w_norm": float(weight.grad.norm()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk-size", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--variant", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.chunk_size, args.threads)))
        return
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    results = {}
    for variant in ("naive", "chunked"):
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--variant",
                variant,
                "--chunk-size",
                str(args.chunk_size),
                "--threads",
                str(args.threads),
            ],
            check=True,
            capture_output=True,
            text=True,
            env=env,
        )
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    gib = 1024**3
    naive, ours = results["naive"], results["chunked"]
    print(
        f"log-probs + entropy, forward + backward: B x T = {B} x {T}, V = {V}, H = {H}, fp32, "
        f"{args.threads} thread(s), chunk_size = {args.chunk_size}"
    )
    for name, r in (("naive full logits", naive), ("chunked, fused", ours)):
        print(
            f"  {name:22s} peak extra RSS {r['peak_extra_bytes'] / gib:6.2f} GiB "
            f"(sampled {r['sampled_extra_bytes'] / gib:.2f}, high-water {r['high_water_extra_bytes'] / gib:.2f})  "
            f"time {r['wall_s']:6.1f} s"
        )
    ratio = ours["peak_extra_bytes"] / naive["peak_extra_bytes"]
    print(f"  ratio chunked / naive = {ratio:.3f} (target <= 0.25: {'met' if ratio <= 0.25 else 'NOT met'})")
    print(
        f"  same result: loss {naive['loss']:.6g} vs {ours['loss']:.6g}; "
        f"|grad W| {naive['grad_w_norm']:.6g} vs {ours['grad_w_norm']:.6g}"
    )


if __name__ == "__main__":
    main()
