"""What machine a benchmark ran on: CPU model, the ISA features that decide bf16 speed, and the
machine's own matmul throughput (the denominator of every MFU figure in ``benchmarks/``).

The CPU behind this project changes between runs (an AMD EPYC with AVX-512, Intel Xeons with
AMX-BF16 of different speeds), so a model-FLOPs utilisation is only comparable as a share of the
peak measured on the same machine in the same run: :func:`matmul_peak` times plain ``torch.mm``
on a few shapes (square, and the shapes of SmolLM2's projections at ~1-2k tokens) and reports
the best, in GFLOP/s.
"""

from __future__ import annotations

import functools
import os
import platform
import time

#: /proc/cpuinfo flags that decide how fast bf16 and fp32 matmuls run
ISA_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx512_fp16", "avx2", "fma")

#: (M, K, N) shapes timed by matmul_peak: square, and the projections of a 576-wide model
PEAK_SHAPES = ((2048, 2048, 2048), (2048, 576, 1536), (2048, 1536, 576), (1536, 2048, 576))


def cpu_model() -> str:
    """``model name`` from /proc/cpuinfo (``platform.processor()`` elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def isa_flags() -> list[str]:
    """The :data:`ISA_FLAGS` this CPU has."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [flag for flag in ISA_FLAGS if flag in have]
    except OSError:
        pass
    return []


def gflops(fn, flops: float, windows: int = 3, seconds: float = 0.2) -> float:
    """Throughput of ``fn()`` in GFLOP/s, counting ``flops`` per call: 3 warm-up calls, then the
    best of ``windows`` windows of at least ``seconds`` and 3 calls each (the best: the host's noise
    only slows a window down)."""
    for _ in range(3):
        fn()
    best = 0.0
    for _ in range(windows):
        reps, t0 = 0, time.perf_counter()
        while True:
            fn()
            reps += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= seconds and reps >= 3:
                break
        best = max(best, flops * reps / elapsed / 1e9)
    return best


def matmul_peak(dtype: str = "bf16", threads: int | None = None, seconds: float = 0.6) -> dict:
    """Best ``torch.mm`` throughput over :data:`PEAK_SHAPES`, in GFLOP/s (``2 M K N`` per product).

    ``dtype``: ``"bf16"`` or ``"fp32"``; ``threads``: torch threads (default: the current setting).
    Each shape is timed by :func:`gflops` over about ``seconds`` (three windows). Returns
    ``{"gflops": best, "per_shape": {"MxKxN": gflops}, "threads": n, "dtype": dtype}``.
    """
    import torch

    if threads:
        torch.set_num_threads(int(threads))
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    per_shape = {}
    for m, k, n in PEAK_SHAPES:
        a = torch.randn(m, k).to(dt)
        b = torch.randn(k, n).to(dt)
        per_shape[f"{m}x{k}x{n}"] = gflops(functools.partial(torch.mm, a, b), 2.0 * m * k * n, seconds=seconds / 3)
    return {
        "gflops": max(per_shape.values()),
        "per_shape": per_shape,
        "threads": torch.get_num_threads(),
        "dtype": dtype,
    }


def describe() -> dict:
    """CPU model, ISA flags, cores this process may use, load average, torch version."""
    import torch

    return {
        "cpu_model": cpu_model(),
        "isa_flags": isa_flags(),
        "cores": len(os.sched_getaffinity(0)),
        "loadavg_at_start": os.getloadavg()[0],
        "torch": torch.__version__,
    }
