"""Export a run's learning curve from its local MLflow store to CSV, and plot one or more CSVs.

    python benchmarks/learning_curve.py export RUN_DIR --out benchmarks/results/ppo_arithmetic.csv
    python benchmarks/learning_curve.py plot benchmarks/results/ppo_arithmetic.csv \
        benchmarks/results/grpo_arithmetic.csv --out benchmarks/results/learning_curves.png
    python benchmarks/learning_curve.py seeds benchmarks/results/learning_check/ppo/curve_acc.json \
        benchmarks/results/learning_check/grpo/curve_acc.json --out benchmarks/results/learning_check/curves.png

``seeds`` plots the curves over seeds that ``benchmarks/learning_check.py --summarize DIR`` writes
(``DIR/curve_<metric>.json``): the mean over seeds per validation step and the min-max band, one
line per recipe (the JSON's folder name), against steps.

The CSV has one row per training step: ``step``, ``wall_s`` (seconds since the run started,
from MLflow's metric timestamps), ``reward`` (``critic/score/mean``: the training reward incl.
shaping), ``train_acc`` (``critic/acc/mean``) and ``val_acc`` (``val-core/<source>/acc/mean@1``
at the steps where validation ran, step 0 = before training; empty elsewhere).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path


def export(run_dir: str, out: str, experiment: str | None = None) -> Path:
    """Read the latest MLflow run under ``run_dir`` (``mlflow.db``) and write the curve CSV."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{Path(run_dir).resolve() / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exps = [e for e in client.search_experiments() if experiment is None or e.name == experiment]
    runs = client.search_runs([e.experiment_id for e in exps], order_by=["attributes.start_time DESC"], max_results=1)
    if not runs:
        raise SystemExit(f"No MLflow run found in {uri}")
    run = runs[0]
    t0 = run.info.start_time
    keys = list(run.data.metrics)
    val_key = next((k for k in keys if k.startswith("val-core/") and "/acc/" in k), None)
    wanted = {"reward": "critic/score/mean", "train_acc": "critic/acc/mean"}
    rows: dict[int, dict] = {}
    for col, key in wanted.items():
        for m in client.get_metric_history(run.info.run_id, key):
            r = rows.setdefault(m.step, {"step": m.step})
            r[col] = m.value
            r["wall_s"] = max(r.get("wall_s", 0.0), (m.timestamp - t0) / 1000.0)
    if val_key:
        for m in client.get_metric_history(run.info.run_id, val_key):
            r = rows.setdefault(m.step, {"step": m.step})
            r["val_acc"] = m.value
            r.setdefault("wall_s", (m.timestamp - t0) / 1000.0)
    out_p = Path(out)
    out_p.parent.mkdir(parents=True, exist_ok=True)
    cols = ["step", "wall_s", "reward", "train_acc", "val_acc"]
    with open(out_p, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for step in sorted(rows):
            r = rows[step]
            w.writerow({c: (f"{r[c]:.4f}" if isinstance(r.get(c), float) else r.get(c, "")) for c in cols})
    return out_p


def plot(csvs: list[str], out: str) -> Path:
    """Plot training reward and validation accuracy against wall-clock minutes for each CSV."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for path in csvs:
        label = Path(path).stem
        with open(path) as f:
            data = list(csv.DictReader(f))
        tr = [(float(r["wall_s"]) / 60, float(r["reward"])) for r in data if r["reward"]]
        va = [(float(r["wall_s"]) / 60, float(r["val_acc"])) for r in data if r["val_acc"]]
        if tr:
            ax1.plot(*zip(*tr), label=label, alpha=0.8)
        if va:
            ax2.plot(*zip(*va), marker="o", label=label)
    ax1.set(xlabel="wall-clock minutes", ylabel="training reward (mean per step)", title="Training reward")
    ax2.set(xlabel="wall-clock minutes", ylabel="held-out accuracy (strict ####, greedy)", title="Validation accuracy")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    out_p = Path(out)
    fig.savefig(out_p, dpi=110)
    return out_p


def plot_seeds(curves: list[str], out: str) -> Path:
    """Plot mean and min-max band over seeds for each ``curve_<metric>.json`` against steps."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    metric = ""
    for path in curves:
        data = json.loads(Path(path).read_text())
        metric = data["metric"]
        n = max(r["n_seeds"] for r in data["rows"])
        rows = [r for r in data["rows"] if r["n_seeds"] == n]  # steps every seed reached
        steps = [r["step"] for r in rows]
        line = ax.plot(steps, [r["mean"] for r in rows], marker="o", label=f"{Path(path).parent.name} ({n} seeds)")
        ax.fill_between(
            steps, [r["min"] for r in rows], [r["max"] for r in rows], color=line[0].get_color(), alpha=0.2, linewidth=0
        )
    ax.set(xlabel="training step", ylabel=metric, title="Held-out metric: mean and min-max over seeds")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out_p = Path(out)
    fig.savefig(out_p, dpi=110)
    return out_p


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("run_dir")
    e.add_argument("--out", required=True)
    e.add_argument("--experiment", default=None)
    pl = sub.add_parser("plot")
    pl.add_argument("csvs", nargs="+")
    pl.add_argument("--out", required=True)
    ps = sub.add_parser("seeds")
    ps.add_argument("curves", nargs="+")
    ps.add_argument("--out", required=True)
    args = p.parse_args()
    if args.cmd == "export":
        print(export(args.run_dir, args.out, args.experiment))
    elif args.cmd == "plot":
        print(plot(args.csvs, args.out))
    else:
        print(plot_seeds(args.curves, args.out))


if __name__ == "__main__":
    main()
