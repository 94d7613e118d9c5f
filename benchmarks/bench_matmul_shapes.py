"""How fast the update's own matmuls run, against the machine's measured bf16 peak.

The update MFU (``bench_update_mfu.py``) is capped by its matmuls: this times each matmul a
SmolLM2-135M decoder layer runs in a training micro-batch (``--tokens`` rows, default 1400, about
a micro-batch of 8 of the default experiment), in bf16, in the three layouts autograd uses for a
linear layer ``y = x W^T``: the forward ``x W^T``, the input gradient ``gy W`` and the weight
gradient ``gy^T x`` (the reduction runs over the tokens), plus the attention scores ``q k^T``
(8 rows x 9 heads, 175 positions, head size 64). Figures are GFLOP/s and their share of the peak:
the best rate of :data:`_machine.PEAK_SHAPES` (the shapes of :func:`_machine.matmul_peak`), timed
in the same run by the same function as the model's shapes (best of three windows).

    python benchmarks/bench_matmul_shapes.py              # writes benchmarks/results/matmul_shapes.md
    python benchmarks/bench_matmul_shapes.py --tokens 2800 --no-save
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _machine import PEAK_SHAPES, describe  # noqa: E402

#: SmolLM2-135M's projections: name -> (out features, in features)
PROJECTIONS = {
    "q_proj / o_proj": (576, 576),
    "k_proj / v_proj": (192, 576),
    "gate / up": (1536, 576),
    "down": (576, 1536),
}


def gflops(fn, flops: float, windows: int = 3, seconds: float = 0.3) -> float:
    """``flops / time`` of ``fn`` in GFLOP/s: 3 warm-up calls, then the best of ``windows`` windows
    of ``seconds`` each (the best: the host's noise only slows)."""
    for _ in range(3):
        fn()
    best = 0.0
    for _ in range(windows):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            fn()
            n += 1
        best = max(best, flops * n / (time.perf_counter() - t0) / 1e9)
    return best


def measure(tokens: int) -> dict:
    """GFLOP/s per projection and layout, and of the attention-scores bmm, in bf16."""
    import torch

    torch.manual_seed(0)
    bf16 = torch.bfloat16
    out: dict = {"projections": {}}
    for name, (n_out, n_in) in PROJECTIONS.items():
        x, w, gy = (
            torch.randn(tokens, n_in, dtype=bf16),
            torch.randn(n_out, n_in, dtype=bf16),
            torch.randn(tokens, n_out, dtype=bf16),
        )
        flops = 2.0 * tokens * n_out * n_in
        out["projections"][name] = {
            "forward x W^T": gflops(partial(torch.nn.functional.linear, x, w), flops),
            "input grad gy W": gflops(partial(torch.mm, gy, w), flops),
            "weight grad gy^T x": gflops(partial(torch.mm, gy.t(), x), flops),
        }
    b, length, d = 72, 175, 64
    q, k = torch.randn(b, length, d, dtype=bf16), torch.randn(b, length, d, dtype=bf16)
    out["attention q k^T"] = gflops(lambda: torch.bmm(q, k.transpose(1, 2)), 2.0 * b * length * length * d)
    out["attention shape"] = f"{b} x {length} x {length} x {d}"
    out["peak"] = {}
    for m, kk, n in PEAK_SHAPES:
        a, w = torch.randn(m, kk, dtype=bf16), torch.randn(kk, n, dtype=bf16)
        out["peak"][f"{m}x{kk}x{n}"] = gflops(partial(torch.mm, a, w), 2.0 * m * kk * n)
    return out


def render(info: dict, threads: int, tokens: int, res: dict) -> str:
    p = max(res["peak"].values())
    lines = [
        "# The update's matmuls at their own shapes (bf16)",
        "",
        f"CPU: {info['cpu_model']} ({', '.join(info['isa_flags'])}); {info['cores']} cores; torch {info['torch']}, "
        f"{threads} threads. bf16 peak, timed the same way in the same run: **{p:.0f} GFLOP/s** (best of "
        + ", ".join(f"{shape}: {v:.0f}" for shape, v in res["peak"].items())
        + ").",
        f"Rows: {tokens} tokens. GFLOP/s (share of the peak).",
        "",
        "| projection (out x in) | forward x W^T | input grad gy W | weight grad gy^T x |",
        "|---|---|---|---|",
    ]
    for name, layouts in res["projections"].items():
        o, i = PROJECTIONS[name]
        cells = [f"{v:.0f} ({100 * v / p:.0f}%)" for v in layouts.values()]
        lines.append(f"| {name} ({o} x {i}) | " + " | ".join(cells) + " |")
    a = res["attention q k^T"]
    lines += ["", f"Attention scores q k^T ({res['attention shape']}, batched): {a:.0f} GFLOP/s ({100 * a / p:.0f}%)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1400)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    import torch

    info = describe()
    text = render(info, torch.get_num_threads(), args.tokens, measure(args.tokens))
    print(text)
    if not args.no_save:
        (HERE / "results").mkdir(exist_ok=True)
        (HERE / "results" / "matmul_shapes.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
