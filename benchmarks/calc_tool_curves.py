"""Summarise ``experiment=calc_tool`` runs: held-out accuracy per validation step, training curves, the machine.

Usage::

    python benchmarks/calc_tool_curves.py RUN_DIR[=LABEL] ... --out benchmarks/results/calc_tool_runs

Each ``RUN_DIR`` is a run's ``trainer.default_local_dir`` (its ``metrics.jsonl``). Writes ``<out>.md`` (a table:
held-out accuracy ``val-core/calc_arith/acc/mean@1`` at every validation step, the training score and the
multi-turn metrics per step) and ``<out>.jsonl`` (every run's metrics, one JSON line per logged record with its
label), and prints the table. Prints the CPU model first (runs are only compared on one CPU kind).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _machine import cpu_model

VAL = "val-core/calc_arith/acc/mean@1"
TRAIN = ("critic/score/mean", "multi_turn/tool_calls", "num_turns/mean", "multi_turn/masked_token_share")


def read_run(path: Path) -> list[dict[str, Any]]:
    """The records of a run's ``metrics.jsonl`` (one dict per line, ``step`` included)."""
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()]


def summary(label: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    """Held-out accuracy by step and the per-step training numbers of one run."""
    val = {int(r["step"]): float(r[VAL]) for r in records if VAL in r}
    train = {int(r["step"]): {k: r[k] for k in TRAIN if k in r} for r in records if "critic/score/mean" in r}
    return {"label": label, "val": val, "train": train}


def table(runs: list[dict[str, Any]]) -> str:
    steps = sorted({s for r in runs for s in r["val"]})
    lines = ["| run | " + " | ".join(f"held-out acc @ {s}" for s in steps) + " |", "|---" * (len(steps) + 1) + "|"]
    for r in runs:
        cells = [f"{100 * r['val'][s]:.1f}%" if s in r["val"] else "" for s in steps]
        lines.append(f"| {r['label']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| run | step | train score | tool calls | num_turns/mean | masked share |",
        "|---|---|---|---|---|---|",
    ]
    for r in runs:
        for step, t in sorted(r["train"].items()):
            lines.append(
                f"| {r['label']} | {step} | {t.get('critic/score/mean', float('nan')):.3f} | "
                f"{t.get('multi_turn/tool_calls', 0):.0f} | {t.get('num_turns/mean', 1.0):.2f} | "
                f"{t.get('multi_turn/masked_token_share', 0.0):.3f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="RUN_DIR or RUN_DIR=LABEL")
    parser.add_argument("--out", default="benchmarks/results/calc_tool_runs")
    args = parser.parse_args(argv)
    machine = f"CPU: {cpu_model()}"
    print(machine)
    runs, raw = [], []
    for spec in args.runs:
        path, _, label = spec.partition("=")
        records = read_run(Path(path))
        runs.append(summary(label or Path(path).name, records))
        raw += [{"run": label or Path(path).name, **r} for r in records]
    text = table(runs)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(f"# calc_tool runs\n\n{machine}\n\n{text}\n")
    out.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in raw))


if __name__ == "__main__":
    main()
