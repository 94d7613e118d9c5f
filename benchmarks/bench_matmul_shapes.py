"""How fast the update's own matmuls run, against the machine's measured bf16 peak.

The update MFU (``bench_update_mfu.py``) is capped by its matmuls: this times each matmul a
SmolLM2-135M decoder layer runs in a training micro-batch (``--tokens`` rows, default 1400, about
a micro-batch of 8 of the default experiment), in bf16, in the three layouts autograd uses for a
linear layer ``y = x W^T``: the forward ``x W^T``, the input gradient ``gy W`` and the weight
gradient ``gy^T x`` (the reduction runs over the tokens), plus the attention scores ``q k^T``
(8 rows x 9 heads, 175 positions, head size 64). Figures are GFLOP/s and their share of the peak
measured in the same run by :func:`_machine.matmul_peak`, which times its shapes with the same
function (:func:`_machine.gflops`, best of three windows).

    python benchmarks/bench_matmul_shapes.py              # writes benchmarks/results/matmul_shapes.md
    python benchmarks/bench_matmul_shapes.py --tokens 2800 --no-save
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _machine import describe, gflops, matmul_peak  # noqa: E402

#: SmolLM2-135M's projections: name -> (out features, in features)
PROJECTIONS = {
    "q_proj / o_proj": (576, 576),
    "k_proj / v_proj": (192, 576),
    "gate / up": (1536, 576),
    "down": (576, 1536),
}


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
    return out


def render(info: dict, peak: dict, tokens: int, res: dict) -> str:
    """The markdown table of :func:`measure`'s ``res`` against ``peak`` (:func:`_machine.matmul_peak`)."""
    p = peak["gflops"]
    lines = [
        "# The update's matmuls at their own shapes (bf16)",
        "",
        f"CPU: {info['cpu_model']} ({', '.join(info['isa_flags'])}); {info['cores']} cores; torch {info['torch']}, "
        f"{peak['threads']} threads. bf16 peak, timed the same way in the same run: **{p:.0f} GFLOP/s** (best of "
        + ", ".join(f"{shape}: {v:.0f}" for shape, v in peak["per_shape"].items())
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
    info, peak = describe(), matmul_peak("bf16")
    text = render(info, peak, args.tokens, measure(args.tokens))
    print(text)
    if not args.no_save:
        (HERE / "results").mkdir(exist_ok=True)
        (HERE / "results" / "matmul_shapes.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
