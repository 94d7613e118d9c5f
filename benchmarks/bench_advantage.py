"""Time the vectorised advantage estimators on CPU.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/bench_advantage.py [--batch 512] [--length 1024] [--reps 5] [--threads 1]

Builds a batch of ``B`` responses with ragged lengths (uniform in [1, T]), outcome rewards on the
last token, random critic values and groups of ``--group-size`` responses, then times each
estimator ``--reps`` times after one warm-up call and prints the median and min wall-clock
milliseconds per call.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import rlplug
from rlplug.algorithms.losses import compute_token_level_scores


def make_batch(B: int, T: int, group_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).float()
    scores = (torch.rand(B, generator=g) < 0.4).float()
    return {
        "token_level_rewards": compute_token_level_scores(scores, mask),
        "response_mask": mask,
        "values": torch.randn(B, T, generator=g) * mask,
        "index": torch.arange(B) // group_size,
        "reward_baselines": torch.rand(B, generator=g),
    }


def time_call(fn, reps: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--estimators",
        default="gae,grpo",
        help="comma-separated names (default gae,grpo; 'all' for every registered one)",
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    data = make_batch(args.batch, args.length, args.group_size)
    names = rlplug.plugin_names("advantage_estimator") if args.estimators == "all" else args.estimators.split(",")
    config = {"gamma": 1.0, "lam": 0.95, "norm_adv_by_std_in_grpo": True}
    print(
        f"advantage estimators, (B, T) = ({args.batch}, {args.length}), group size {args.group_size}, "
        f"valid tokens {int(data['response_mask'].sum())}, torch {torch.__version__}, {args.threads} thread(s), "
        f"{args.reps} reps"
    )
    print(f"{'estimator':<30} {'median ms':>10} {'min ms':>10}")
    for name in names:
        est = rlplug.get_plugin("advantage_estimator", name)
        times = time_call(lambda est=est: est(data, config), args.reps)
        print(f"{name:<30} {statistics.median(times):>10.1f} {min(times):>10.1f}")


if __name__ == "__main__":
    main()
