"""Does a recipe learn? Train it for N steps on several seeds and compare held-out accuracy.

    python benchmarks/learning_check.py ppo  --seeds 3 --steps 20          # the default experiment
    python benchmarks/learning_check.py grpo --seeds 3 --steps 20          # experiment=grpo_arithmetic
    python benchmarks/learning_check.py grpo --seeds 2 --jobs 2 -- actor.optim.lr=5e-6   # extra overrides

Each seed is a fresh run of the recipe's committed command (``rlplug train <recipe overrides>``)
with ``trainer.seed`` (sampling) and ``data.seed`` (data order) both set to the seed, one torch
thread and a one-thread rollout engine, validation before training and at step N. The run
directory is ``<out>/<recipe>/seed_<S>``: rerunning the same command resumes an interrupted seed
from its checkpoint (validations already seen are kept in ``validations.jsonl`` there).

Prints per seed the held-out metric before and after (``--metric acc``, the default:
``val-core/<source>/acc/mean@1``, verl's strict accuracy; ``format``: the share of answers with a
``#### <number>`` line; ``reward``: the training reward) and a PASS/FAIL line: every seed must gain at least ``--threshold`` percentage
points. Writes ``<out>/<recipe>/summary.json``. Exit code
0 when every seed passes, 1 otherwise.

``--jobs`` seeds run at once (each with one thread): on a 2-core machine ``--jobs 2`` halves the
wall time at the cost of runs that overlap (say so when reporting the figures).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

#: recipe -> (rlplug train overrides, default threshold for the default metric)
RECIPES: dict[str, tuple[list[str], float]] = {
    "ppo": ([], 10.0),
    "grpo": (["experiment=grpo_arithmetic"], 10.0),
    # GRPO for the first 20% of steps (critic trained as a value regressor), then PPO (issue 17)
    "grpo_to_ppo": (["experiment=grpo_to_ppo"], 10.0),
}
#: ``--metric`` -> (validation metric, whether it is a rate reported in percentage points)
METRICS: dict[str, tuple[str, bool]] = {
    # verl's strict score: "#### <right answer>" (the metric the recipes are judged by)
    "acc": ("val-core/basic_arithmetic/acc/mean@1", True),
    # share of answers with a "#### <number>" line: rises within a few steps, the short check's metric
    "format": ("val-aux/basic_arithmetic/format/mean@1", True),
    # the training reward (correctness plus shaping) on the held-out set
    "reward": ("val-aux/basic_arithmetic/reward/mean@1", False),
}
_VAL = re.compile(r"^validation @ step (\d+): (.*)$")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def parse_validation(line: str) -> tuple[int, dict[str, float]] | None:
    """``(step, metrics)`` of a trainer line ``validation @ step N: key=value, ...``, else None."""
    m = _VAL.match(line.strip())
    if not m:
        return None
    metrics = {}
    for part in m.group(2).split(", "):
        key, _, value = part.rpartition("=")
        try:
            metrics[key] = float(value)
        except ValueError:
            continue
    return int(m.group(1)), metrics


def run_seed(
    recipe: str,
    seed: int,
    steps: int,
    out: Path,
    extra: list[str],
    key: str,
    threads: int | None = 1,
    test_freq: int | None = None,
    stop_when: Callable[[dict], bool] | None = None,
) -> dict:
    """Train one seed (resuming its directory), return ``{seed, before, after, log}`` of metric ``key``.

    ``threads``: torch and engine threads (None: the defaults, every core); ``test_freq``: validate
    every N steps (default: only at ``steps``); ``stop_when(row)``: called with every validation row
    (``{step, metrics, wall_s}``), the run is stopped (SIGTERM: it saves and exits) when it returns True.
    """
    overrides, _ = RECIPES[recipe]
    run_dir = out / recipe / f"seed_{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "rlplug",
        "train",
        *overrides,
        f"trainer.seed={seed}",
        f"data.seed={seed}",
        f"trainer.total_training_steps={steps}",
        f"trainer.test_freq={test_freq or steps}",
        f"trainer.save_freq={max(1, min(5, steps))}",
        "trainer.max_wall_time_s=null",
        *([f"trainer.num_threads={threads}", f"rollout.num_threads={threads}"] if threads else []),
        "trainer.logger=[console]",
        f"trainer.default_local_dir={run_dir}",
        *extra,
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    history = run_dir / "validations.jsonl"
    log_path = run_dir / "train.log"
    t0 = time.time()
    # a resumed seed's clock continues from its last recorded validation (the killed attempt's tail
    # after that validation is not counted)
    lines = history.read_text().splitlines() if history.is_file() else []
    t_offset = max((json.loads(x).get("wall_s") or 0.0 for x in lines if x.strip()), default=0.0)
    with (
        open(log_path, "a", buffering=1) as log,  # line-buffered: tail -f works
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc,
    ):
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            parsed = parse_validation(line)
            if parsed is not None:
                with open(history, "a") as h:
                    # wall_s: seconds this seed has run (attempts added up, see t_offset)
                    row = {"step": parsed[0], "metrics": parsed[1], "wall_s": round(t_offset + time.time() - t0, 1)}
                    h.write(json.dumps(row) + "\n")
                if stop_when is not None and stop_when(row) and proc.poll() is None:
                    proc.terminate()  # the trainer saves a checkpoint and exits (exit code 75)
        rc = proc.wait()
    vals = read_history(history)
    before, after = vals.get(0, {}).get(key), vals.get(steps, {}).get(key)
    return {
        "seed": seed,
        "exit_code": rc,
        "before": before,
        "after": after,
        "wall_s": round(time.time() - t0, 1),
        "log": str(log_path),
    }


def read_history(path: Path) -> dict[int, dict[str, float]]:
    """``{step: metrics}`` from a ``validations.jsonl`` (one ``{"step", "metrics"}`` object per line).

    A step seen twice (a seed resumed after its validation was logged) keeps the last line.
    """
    vals: dict[int, dict[str, float]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                item = json.loads(line)
                vals[int(item["step"])] = item["metrics"]
    return vals


def seed_histories(folder: Path) -> dict[int, dict[int, dict[str, float]]]:
    """Every seed's validations under ``folder``: ``seed_<S>/validations.jsonl`` (a run directory
    of this script) or ``seed_<S>_validations.jsonl`` (copied into ``benchmarks/results``)."""
    out: dict[int, dict[int, dict[str, float]]] = {}
    for path in sorted(folder.glob("seed_*")):
        m = re.fullmatch(r"seed_(\d+)(?:_validations\.jsonl)?", path.name)
        if m is None:
            continue
        hist = read_history(path / "validations.jsonl" if path.is_dir() else path)
        if hist:
            out[int(m.group(1))] = hist
    return out


def curve(histories: dict[int, dict[int, dict[str, float]]], key: str) -> list[dict]:
    """Per validation step: the mean, min and max of ``key`` over the seeds that reached it.

    Returns ``[{"step", "n_seeds", "mean", "min", "max", "per_seed": {seed: value}}]`` sorted by
    step; a step only some seeds reached reports those (``n_seeds`` says how many).
    """
    steps = sorted({s for h in histories.values() for s in h})
    rows = []
    for step in steps:
        per_seed = {seed: h[step][key] for seed, h in sorted(histories.items()) if key in h.get(step, {})}
        if not per_seed:
            continue
        v = list(per_seed.values())
        rows.append(
            {
                "step": step,
                "n_seeds": len(v),
                "mean": sum(v) / len(v),
                "min": min(v),
                "max": max(v),
                "per_seed": per_seed,
            }
        )
    return rows


def curve_markdown(rows: list[dict], scale: float) -> str:
    """A markdown table of :func:`curve` rows (values times ``scale``: 100 for rates in %)."""
    unit = "%" if scale == 100.0 else ""
    fmt = (lambda x: f"{x * scale:.1f}{unit}") if scale == 100.0 else (lambda x: f"{x:.3f}")
    seeds = sorted({s for r in rows for s in r["per_seed"]})
    head = "| step | seeds | mean | min - max | " + " | ".join(f"seed {s}" for s in seeds) + " |"
    sep = "|" + "---|" * (4 + len(seeds))
    lines = [head, sep]
    for r in rows:
        cells = [fmt(r["per_seed"][s]) if s in r["per_seed"] else "" for s in seeds]
        lines.append(
            f"| {r['step']} | {r['n_seeds']} | **{fmt(r['mean'])}** | {fmt(r['min'])} - {fmt(r['max'])} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", choices=sorted(RECIPES))
    p.add_argument("--seeds", type=int, default=3, help="seeds 0 .. N-1")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--metric", choices=sorted(METRICS), default="acc", help="held-out metric judged (default: acc)")
    p.add_argument(
        "--threshold", type=float, default=None, help="minimum gain per seed (default: the recipe's, for acc)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch and engine threads per seed (default 1)")
    p.add_argument("--jobs", type=int, default=1, help="seeds trained at once")
    p.add_argument("--out", default="checkpoints/learning_check")
    p.add_argument(
        "--summarize",
        metavar="DIR",
        default=None,
        help="train nothing: print the curve (mean, min-max per step) of the seeds under DIR "
        "(seed_<S>/validations.jsonl or seed_<S>_validations.jsonl) and write DIR/curve_<metric>.json",
    )
    p.add_argument("overrides", nargs="*", help="extra rlplug overrides (after --)")
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    args.overrides = [*args.overrides, *extra]
    _, default_threshold = RECIPES[args.recipe]
    key, is_rate = METRICS[args.metric]
    if args.threshold is None and args.metric != "acc" and args.summarize is None:
        p.error(f"--metric {args.metric} needs --threshold (the default threshold is for acc)")
    threshold = default_threshold if args.threshold is None else args.threshold
    scale = 100.0 if is_rate else 1.0  # rates in percentage points
    if args.summarize is not None:
        folder = Path(args.summarize)
        histories = seed_histories(folder)
        if not histories:
            p.error(f"no seed_<S>/validations.jsonl or seed_<S>_validations.jsonl under {folder}")
        rows = curve(histories, key)
        print(f"{key} over seeds {sorted(histories)} ({folder}):")
        print(curve_markdown(rows, scale))
        (folder / f"curve_{args.metric}.json").write_text(json.dumps({"metric": key, "rows": rows}, indent=1))
        return 0
    out = Path(args.out)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; recipe {args.recipe}, {args.steps} steps, seeds {seeds}")
    print(f"metric: {key}; pass: every seed gains >= {threshold:g}{' points' if scale == 100 else ''}", flush=True)
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(
            pool.map(lambda s: run_seed(args.recipe, s, args.steps, out, args.overrides, key, args.threads), seeds)
        )
    ok = True
    for r in results:
        if r["before"] is None or r["after"] is None:
            ok = False
            print(f"seed {r['seed']}: no result (exit code {r['exit_code']}; see {r['log']})")
            continue
        gain = (r["after"] - r["before"]) * scale
        r["gain"] = gain
        ok &= gain >= threshold
        d = 1 if scale == 100.0 else 3
        print(
            f"seed {r['seed']}: {r['before'] * scale:.{d}f} -> {r['after'] * scale:.{d}f} (gain {gain:+.{d}f}) "
            f"in {r['wall_s']:.0f} s{'' if gain >= threshold else '  <- below the threshold'}"
        )
    gains = [r["gain"] for r in results if "gain" in r]
    if gains:
        d = 1 if scale == 100.0 else 3
        print(f"gain: mean {sum(gains) / len(gains):+.{d}f}, min {min(gains):+.{d}f}, max {max(gains):+.{d}f}")
    print(f"{'PASS' if ok else 'FAIL'}: {args.recipe}, {len(seeds)} seeds, {args.steps} steps, threshold {threshold:g}")
    summary = {
        "recipe": args.recipe,
        "steps": args.steps,
        "metric": key,
        "threshold": threshold,
        "cpu": cpu_model(),
        "jobs": args.jobs,
        "threads": args.threads,
        "overrides": args.overrides,
        "results": results,
        "pass": ok,
    }
    (out / args.recipe).mkdir(parents=True, exist_ok=True)
    (out / args.recipe / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
