"""Compare recipes' held-out accuracy over seeds, by step and by wall time, and the time to a target.

    python benchmarks/compare_recipes.py benchmarks/results/learning_check/ppo_2026-12-02 \
        benchmarks/results/learning_check/grpo benchmarks/results/learning_check/grpo_to_ppo \
        benchmarks/results/learning_check/ppo_same_conditions \
        --target 0.40 --out benchmarks/results/learning_check/compare

Each folder is a recipe's ``benchmarks/learning_check.py`` output (``seed_<S>/validations.jsonl`` of a
run directory, or ``seed_<S>_validations.jsonl`` copied into ``benchmarks/results``). A validation
line may carry ``wall_s``, the seconds that seed has run (learning_check writes it since the
grpo_to_ppo comparison; a resumed seed continues from its last recorded validation, so the tail of a
killed attempt after it is not counted; older seeds lack it, and their wall times are not reported).

Prints, per recipe: held-out strict accuracy (``--metric``, default the arithmetic task's
``val-core/basic_arithmetic/acc/mean@1``) at each validation step as mean and min-max over seeds,
and per seed the first validation step at which it reached ``--target`` and the wall time there.
Writes ``<out>.md`` (the tables) and ``<out>.png`` (accuracy against steps, and against wall time
where recorded; mean line and min-max band over seeds).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

DEFAULT_METRIC = "val-core/basic_arithmetic/acc/mean@1"


def read_seeds(folder: Path) -> dict[int, list[dict]]:
    """``{seed: [{"step", "metrics", "wall_s"?}, ...]}`` sorted by step (a step seen twice keeps the last)."""
    out: dict[int, list[dict]] = {}
    for path in sorted(folder.glob("seed_*")):
        m = re.fullmatch(r"seed_(\d+)(?:_validations\.jsonl)?", path.name)
        file = path / "validations.jsonl" if path.is_dir() else path
        if m is None or not file.is_file():
            continue
        by_step: dict[int, dict] = {}
        for line in file.read_text().splitlines():
            if line.strip():
                item = json.loads(line)
                by_step[int(item["step"])] = item
        if by_step:
            out[int(m.group(1))] = [by_step[s] for s in sorted(by_step)]
    return out


def first_reaching(rows: list[dict], metric: str, target: float) -> tuple[int | None, float | None]:
    """``(step, wall_s)`` of the first validation at or above ``target`` (``(None, None)``: never)."""
    for r in rows:
        if r["metrics"].get(metric, float("-inf")) >= target - 1e-12:
            return int(r["step"]), r.get("wall_s")
    return None, None


def summarize(recipes: dict[str, dict[int, list[dict]]], metric: str, target: float) -> str:
    """The markdown tables: accuracy per step over seeds, then time to ``target`` per seed."""
    steps = sorted({r["step"] for seeds in recipes.values() for rows in seeds.values() for r in rows})
    lines = [f"Held-out `{metric}`: mean (min - max) over seeds at each validation step.", ""]
    lines.append("| step | " + " | ".join(f"{name} ({len(s)} seeds)" for name, s in recipes.items()) + " |")
    lines.append("|---|" + "---|" * len(recipes))
    for step in steps:
        cells = []
        for seeds in recipes.values():
            v = [r["metrics"][metric] for rows in seeds.values() for r in rows if r["step"] == step]
            part = f", {len(v)} of {len(seeds)} seeds" if v and len(v) < len(seeds) else ""
            cells.append(
                f"**{100 * sum(v) / len(v):.1f}%** ({100 * min(v):.1f} - {100 * max(v):.1f}{part})" if v else ""
            )
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"First validation step at or above {100 * target:.0f}% (wall time there, s since the run started):",
        "",
    ]
    lines.append(
        "| recipe | " + " | ".join(f"seed {s}" for s in sorted({s for x in recipes.values() for s in x})) + " |"
    )
    all_seeds = sorted({s for x in recipes.values() for s in x})
    lines.append("|---|" + "---|" * len(all_seeds))
    for name, seeds in recipes.items():
        cells = []
        for s in all_seeds:
            if s not in seeds:
                cells.append("")
                continue
            step, wall = first_reaching(seeds[s], metric, target)
            last = seeds[s][-1]["step"]
            if step is None:
                cells.append(f"not by step {last}")
            else:
                cells.append(f"step {step}" + (f" ({wall:.0f} s)" if wall is not None else " (no wall time)"))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(recipes: dict[str, dict[int, list[dict]]], metric: str, target: float, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax_s, ax_t) = plt.subplots(1, 2, figsize=(12, 4.2))
    for name, seeds in recipes.items():
        steps = sorted(set.intersection(*({r["step"] for r in rows} for rows in seeds.values())))
        v = np.array(
            [[next(r for r in rows if r["step"] == st)["metrics"][metric] for st in steps] for rows in seeds.values()]
        )
        line = ax_s.plot(steps, v.mean(0), marker="o", label=f"{name} ({len(seeds)} seeds)")
        ax_s.fill_between(steps, v.min(0), v.max(0), color=line[0].get_color(), alpha=0.2, linewidth=0)
        timed = {s: rows for s, rows in seeds.items() if all("wall_s" in r for r in rows)}
        for i, rows in enumerate(timed.values()):
            ax_t.plot(
                [r["wall_s"] / 60 for r in rows],
                [r["metrics"][metric] for r in rows],
                marker="o",
                color=line[0].get_color(),
                alpha=0.8,
                label=f"{name} ({len(timed)} seeds)" if i == 0 else None,
            )
    for ax in (ax_s, ax_t):
        ax.axhline(target, color="grey", linestyle="--", linewidth=1)
        ax.grid(alpha=0.3)
        ax.set_ylabel("held-out strict accuracy")
    ax_s.set(xlabel="training step", title="By step: mean and min-max over seeds")
    ax_t.set(xlabel="wall time since the run started (min)", title="By wall time: one line per seed (where timed)")
    ax_s.legend()
    ax_t.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folders", nargs="+", type=Path, help="one learning_check folder per recipe (its name labels it)")
    p.add_argument("--metric", default=DEFAULT_METRIC)
    p.add_argument("--target", type=float, default=0.40, help="accuracy whose first reaching is reported")
    p.add_argument("--out", type=Path, default=None, help="write <out>.md and <out>.png")
    args = p.parse_args(argv)
    recipes = {}
    names = [f.name for f in args.folders]
    for folder in args.folders:
        seeds = read_seeds(folder)
        if not seeds:
            p.error(f"no seed_<S>/validations.jsonl or seed_<S>_validations.jsonl under {folder}")
        for seed, rows in seeds.items():
            if any(args.metric not in r["metrics"] for r in rows):
                known = sorted({k for r in rows for k in r["metrics"]})
                p.error(f"seed {seed} under {folder} has validations without {args.metric}; its metrics: {known}")
        # two folders of one name (a/ppo, b/ppo) are labelled by their parent too
        label = folder.name if names.count(folder.name) == 1 else f"{folder.parent.name}/{folder.name}"
        recipes[label] = seeds
    text = summarize(recipes, args.metric, args.target)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text(text + "\n")
        plot(recipes, args.metric, args.target, args.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
