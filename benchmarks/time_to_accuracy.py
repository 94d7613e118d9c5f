"""Time to accuracy: wall time from the first validation until held-out strict accuracy reaches a target.

    python benchmarks/time_to_accuracy.py                         # default experiment, 3 seeds, 40%
    python benchmarks/time_to_accuracy.py --seeds 1 --test-freq 3 -- actor.optim.lr=1e-5   # a trial
    python benchmarks/time_to_accuracy.py --summarize             # table + plot from the saved runs

Each seed is a fresh ``rlplug train`` of the recipe (``learning_check.RECIPES``; default ``ppo``,
the default experiment) with ``trainer.seed`` and ``data.seed`` set to the seed and the machine's
default threads (every core for the trainer and the engine, which take turns), validating before
training and every ``--test-freq`` steps. Seeds run one after the other, on an otherwise idle
machine. A seed stops at the first validation at or above ``--target`` (the trainer saves and
exits) or after ``--steps`` steps.

The figure is ``wall_s(first validation >= target) - wall_s(validation at step 0)``: the clock
starts when the first validation has been printed (model conversion, engine start-up and that
validation are excluded) and includes the training steps and the later validations. The mean
over seeds is compared with ``--minutes``. Writes ``benchmarks/results/time_to_accuracy/``:
``summary.json`` (per seed: steps and minutes to the target, the curve) and ``curves.png``
(accuracy against minutes since the first validation).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _machine import describe  # noqa: E402
from learning_check import METRICS, RECIPES, read_history, run_seed  # noqa: E402

OUT = HERE / "results" / "time_to_accuracy"


def seed_summary(history: dict[int, dict[str, float]], walls: dict[int, float], key: str, target: float) -> dict:
    """Steps and minutes (since the step-0 validation) to the first validation >= ``target``."""
    t0 = walls.get(0)
    curve = [
        {"step": s, "acc": history[s].get(key), "minutes": (walls[s] - t0) / 60 if t0 is not None else None}
        for s in sorted(history)
    ]
    hit = next((c for c in curve if c["acc"] is not None and c["acc"] >= target), None)
    return {
        "curve": curve,
        "steps_to_target": hit["step"] if hit else None,
        "minutes_to_target": hit["minutes"] if hit else None,
    }


def load_walls(path: Path) -> dict[int, float]:
    walls: dict[int, float] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            walls.setdefault(int(row["step"]), float(row["wall_s"]))
    return walls


def summarize(out: Path, key: str, target: float, minutes: float) -> dict:
    seeds = {}
    for folder in sorted(out.glob("seed_*")):
        hist = folder / "validations.jsonl"
        if hist.is_file():
            seeds[folder.name] = seed_summary(read_history(hist), load_walls(hist), key, target)
    reached = [s["minutes_to_target"] for s in seeds.values()]
    mean = statistics.mean(reached) if reached and None not in reached else None
    summary = {"metric": key, "target": target, "minutes_target": minutes, "seeds": seeds, "mean_minutes": mean}
    lines = [f"| seed | steps to {100 * target:.0f}% | minutes from the first validation | accuracy per validation |"]
    lines.append("|---|---|---|---|")
    for name, s in seeds.items():
        accs = ", ".join(f"{c['step']}: {100 * c['acc']:.1f}%" for c in s["curve"] if c["acc"] is not None)
        m = s["minutes_to_target"]
        lines.append(f"| {name} | {s['steps_to_target']} | {'not reached' if m is None else f'{m:.1f}'} | {accs} |")
    verdict = (
        "not reached by every seed"
        if mean is None
        else f"mean {mean:.1f} min: {'PASS' if mean < minutes else 'FAIL'} (target < {minutes:g} min)"
    )
    lines.append("")
    lines.append(verdict)
    summary["table"] = "\n".join(lines)
    _plot(seeds, target, out / "curves.png")
    return summary


def _plot(seeds: dict, target: float, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib comes with the bench extra
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, s in seeds.items():
        pts = [(c["minutes"], 100 * c["acc"]) for c in s["curve"] if c["acc"] is not None and c["minutes"] is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=name)
    ax.axhline(100 * target, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("minutes since the first validation")
    ax.set_ylabel("held-out strict accuracy (%)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="ppo", choices=sorted(RECIPES))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--first-seed", type=int, default=1)
    p.add_argument("--steps", type=int, default=40, help="stop a seed after this many steps")
    p.add_argument("--test-freq", type=int, default=4)
    p.add_argument("--target", type=float, default=0.40)
    p.add_argument("--minutes", type=float, default=12.0, help="the target for the mean over seeds")
    p.add_argument("--runs", default="checkpoints/time_to_accuracy", help="run directories (checkpoints)")
    p.add_argument("--out", default=str(OUT), help="results: summary, curves, each seed's validations")
    p.add_argument("--summarize", action="store_true", help="train nothing: summarize the runs under --out")
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    key = METRICS["acc"][0]
    out = Path(args.out)
    if not args.summarize:
        info = describe()
        print(f"CPU: {info['cpu_model']} ({', '.join(info['isa_flags'])}), {info['cores']} cores", flush=True)
        out.mkdir(parents=True, exist_ok=True)
        (out / "machine.json").write_text(json.dumps({**info, "overrides": extra, "recipe": args.recipe}, indent=1))
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            run_dir = Path(args.runs) / args.recipe / f"seed_{seed}"
            if run_dir.exists():  # a resumed run would mix code versions and clocks
                p.error(f"{run_dir} exists from an earlier run: delete it (or pass another --runs) to time a fresh run")
            r = run_seed(
                args.recipe,
                seed,
                args.steps,
                Path(args.runs),
                extra,
                key,
                threads=None,
                test_freq=args.test_freq,
                stop_when=lambda row: (row["metrics"].get(key) or 0.0) >= args.target and row["step"] > 0,
            )
            print(f"seed {seed}: exit {r['exit_code']}, {r['wall_s']:.0f} s", flush=True)
            kept = out / f"seed_{seed}"
            kept.mkdir(exist_ok=True)
            src = Path(args.runs) / args.recipe / f"seed_{seed}" / "validations.jsonl"
            (kept / "validations.jsonl").write_text(src.read_text())
    summary = summarize(out, key, args.target, args.minutes)
    print(summary["table"])
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0 if summary["mean_minutes"] is not None and summary["mean_minutes"] < args.minutes else 1


if __name__ == "__main__":
    sys.exit(main())
