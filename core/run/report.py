"""``rlplug report RUN_DIR``: a self-contained HTML report of a run, from the run's own store.

The report reads what every training run writes into its run directory (``trainer.default_local_dir``):

* ``metrics.jsonl`` (:class:`rlplug.run.metrics.MetricsLog`: one JSON line per logged step, every metric under
  its verl name, ``wall_time`` in Unix seconds; truncated to the resumed step at a resume, so it reads like
  an uninterrupted run);
* ``validation_samples.jsonl`` (:func:`log_validation_samples`: one line per validation with its first
  ``trainer.val_samples_to_log`` responses: prompt, response, ground truth and score; a multi-turn response
  also its ``transcript`` and ``step_rewards``, :func:`rlplug.run.metrics.validation_samples`).

It writes ``report.html`` and one PNG per figure next to it (``report_<figure>.png``, referenced by relative
paths; no script, stylesheet or font from the network), with matplotlib's ``Agg`` backend (no display).
Figures, each against the step and against the wall time since the run's first record: reward, validation
(``val-core/*``), KL, entropy, response length, clip fractions, gradient norm and the per-stage timing
breakdown (``timing_s/*``, stacked). A figure whose metrics the run did not log is left out (and listed). The
samples of each validation are a table; when they are multi-turn it has a ``transcript`` column (every message
as ``[role] content``, the environment's messages, whose tokens carry no loss, in ``⟦`` ``⟧`` on a tinted
background: :func:`transcript_parts`) and a ``step_rewards`` column.

:func:`metric_series` turns the records into per-metric series (the parsing the figures use);
:func:`write_report` writes the report.
"""

from __future__ import annotations

import html
import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import numpy as np

from rlplug.config.run_paths import (
    VALIDATION_SAMPLES_FILE,  # the sample generations of each validation, under the run directory
)
from rlplug.run.metrics import metrics_jsonl_path, parse_step_records, read_metrics_jsonl

__all__ = [
    "VALIDATION_SAMPLES_FILE",
    "REPORT_FILE",
    "Series",
    "FIGURES",
    "metric_series",
    "read_validation_samples",
    "log_validation_samples",
    "transcript_parts",
    "write_report",
]

#: The report's default file name, in the run directory.
REPORT_FILE = "report.html"


# ============================================================================ the run's validation samples


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    item = getattr(value, "item", None)
    return _json_safe(item()) if callable(item) else str(value)


def log_validation_samples(trackers: Any, run_dir: str | Path, samples: Sequence[Mapping[str, Any]], step: int) -> None:
    """Log one validation's sample generations: as the table ``val_generations/step_<step:06d>.json`` to the
    trackers (``trackers.log_table``), and, on the process that writes ``metrics.jsonl`` (the main one:
    ``trackers.metrics_log`` is set), as one line ``{"step", "wall_time", "samples": [...]}`` appended to
    ``<run_dir>/validation_samples.jsonl`` (:data:`VALIDATION_SAMPLES_FILE`) in one write.

    ``samples`` are :func:`rlplug.run.metrics.validation_samples` rows (``data_source``, ``prompt``, ``response``,
    ``ground_truth``, ``score``); non-finite floats are written as ``"NaN"``/``"Infinity"`` (strict JSON). A
    validation repeated after a resume appends a second line for its step: :func:`read_validation_samples`
    keeps the last one.
    """
    trackers.log_table(f"val_generations/step_{int(step):06d}.json", list(samples), int(step))
    if getattr(trackers, "metrics_log", None) is None:
        return
    path = Path(run_dir) / VALIDATION_SAMPLES_FILE
    record = {"step": int(step), "wall_time": time.time(), "samples": _json_safe(list(samples))}
    line = (json.dumps(record, allow_nan=False, ensure_ascii=False) + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        data = memoryview(line)
        while data:
            data = data[os.write(fd, data) :]
    finally:
        os.close(fd)


def read_validation_samples(run_dir: str | Path, last_step: int | None = None) -> list[dict[str, Any]]:
    """The validations of ``<run_dir>/validation_samples.jsonl``, one ``{"step", "wall_time", "samples"}`` per
    step, sorted by step; ``[]`` when the file does not exist (a run from before this file, or without
    validation). A step written twice (a validation repeated after a resume) keeps its last line; steps after
    ``last_step`` (the last step of ``metrics.jsonl``: written by an attempt that stopped before its metrics
    line and never resumed past it) are dropped, so the samples match the metrics log. A cut-short last line
    (a kill mid-write) is skipped.

    Raises ``ValueError`` naming the line when a line other than the last is not such a record.
    """
    path = Path(run_dir) / VALIDATION_SAMPLES_FILE
    if not path.is_file():
        return []
    text = path.read_text(encoding="utf-8", errors="replace")
    by_step: dict[int, dict[str, Any]] = {}
    for record, _ in parse_step_records(text, path, what="validation-samples record", list_key="samples"):
        if last_step is None or record["step"] <= last_step:
            by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


# ============================================================================ metric series


@dataclass
class Series:
    """One metric over the run: ``steps`` (ints), ``wall`` (seconds since the run's first record) and
    ``values`` (floats, NaN kept: a gap in the plot), aligned, in step order."""

    steps: list[int] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)


def metric_series(records: Sequence[Mapping[str, Any]]) -> dict[str, Series]:
    """Per-metric series from ``metrics.jsonl`` records (:func:`rlplug.run.metrics.read_metrics_jsonl`).

    Each record holds ``step`` (int), ``wall_time`` (Unix seconds) and metrics (floats). A metric's series
    has one point per record that holds it, at the record's step and at ``wall_time`` minus the smallest
    ``wall_time`` of all records (seconds; 0.0 for a record without one); non-numeric values are skipped, NaN
    and infinities kept as NaN. When a step appears in several records (a log written by hand, or an older
    run's log appended to), the last record of that step wins, as after a resume. Series are sorted by step.
    Example: records ``{"step": 1, "wall_time": 100.0, "a": 0.5}``, ``{"step": 2, "wall_time": 103.5, "a": 0.25}``
    give ``{"a": Series(steps=[1, 2], wall=[0.0, 3.5], values=[0.5, 0.25])}``.
    """
    times = [float(r["wall_time"]) for r in records if isinstance(r.get("wall_time"), (int, float))]
    t0 = min(times) if times else 0.0
    points: dict[str, dict[int, tuple[float, float]]] = {}
    for r in records:
        step = int(r["step"])
        wall = float(r["wall_time"]) - t0 if isinstance(r.get("wall_time"), (int, float)) else 0.0
        for key, value in r.items():
            if key in ("step", "wall_time") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            v = float(value)
            points.setdefault(key, {})[step] = (wall, v if math.isfinite(v) else math.nan)
    out: dict[str, Series] = {}
    for key, by_step in sorted(points.items()):
        s = Series()
        for step in sorted(by_step):
            wall, v = by_step[step]
            s.steps.append(step)
            s.wall.append(wall)
            s.values.append(v)
        out[key] = s
    return out


# ============================================================================ figures


@dataclass(frozen=True)
class Figure:
    """A figure of the report: ``key`` (the PNG's and the section's name), ``title``, the metric name patterns
    (``fnmatch``) it draws, in order, and whether the lines are stacked (the timing breakdown)."""

    key: str
    title: str
    patterns: tuple[str, ...]
    stacked: bool = False
    exclude: tuple[str, ...] = ()


#: The report's figures, in order. Every metric matching a pattern is drawn (a run logs the ones its
#: plugins produce: a critic's ``critic/vf_clipfrac``, the KL loss's ``actor/kl_loss`` ...).
FIGURES: tuple[Figure, ...] = (
    Figure("reward", "Reward", ("critic/score/mean", "critic/rewards/mean")),
    Figure("validation", "Validation (val-core)", ("val-core/*",), exclude=("val-core/*/std",)),
    Figure("kl", "KL", ("actor/ppo_kl", "actor/kl_loss", "actor/reward_kl_penalty", "actor/kl_coef")),
    Figure("entropy", "Entropy", ("actor/entropy",)),
    Figure("response_length", "Response length (tokens)", ("response_length/mean", "response_length/max")),
    Figure(
        "clip_fractions",
        "Clip fractions",
        ("actor/pg_clipfrac", "actor/pg_clipfrac_lower", "critic/vf_clipfrac", "response_length/clip_ratio"),
    ),
    Figure("grad_norm", "Gradient norm", ("actor/grad_norm", "critic/grad_norm")),
    Figure("timing", "Time per stage (s)", ("timing_s/*",), stacked=True, exclude=("timing_s/step",)),
)


def _figure_metrics(fig: Figure, names: Sequence[str]) -> list[str]:
    chosen: list[str] = []
    for pattern in fig.patterns:
        for name in names:
            if fnmatchcase(name, pattern) and name not in chosen and not any(fnmatchcase(name, x) for x in fig.exclude):
                chosen.append(name)
    return chosen


def _draw(fig: Figure, metrics: list[str], series: Mapping[str, Series], path: Path) -> None:
    """Draw ``metrics`` of ``fig`` against the step (left) and the wall time in minutes (right) into ``path``."""
    import matplotlib  # deferred: matplotlib (the Agg backend must be chosen before pyplot is imported)

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt  # deferred: matplotlib
    from matplotlib.ticker import MaxNLocator  # deferred: matplotlib

    figure, axes = plt.subplots(1, 2, figsize=(11, 3.6), constrained_layout=True)
    try:
        for ax, x_label, attr in ((axes[0], "step", "steps"), (axes[1], "wall time (min)", "wall")):
            if fig.stacked:
                steps = sorted({s for m in metrics for s in series[m].steps})
                xs = {s: x for m in metrics for s, x in zip(series[m].steps, getattr(series[m], attr))}
                x = np.asarray([xs[s] / (60.0 if attr == "wall" else 1.0) for s in steps], dtype=float)
                ys = []
                for m in metrics:
                    by_step = dict(zip(series[m].steps, series[m].values))
                    ys.append([0.0 if math.isnan(by_step.get(s, math.nan)) else by_step[s] for s in steps])
                if len(x) == 1:  # one point: bars, a stack plot of one point is invisible
                    bottom = 0.0
                    for m, y in zip(metrics, ys):
                        ax.bar(x, y, bottom=bottom, width=0.6 if attr == "steps" else 0.05, label=m)
                        bottom += y[0]
                else:
                    ax.stackplot(x, np.asarray(ys, dtype=float), labels=metrics)
            else:
                for m in metrics:
                    s = series[m]
                    x = np.asarray(getattr(s, attr), dtype=float) / (60.0 if attr == "wall" else 1.0)
                    ax.plot(x, np.asarray(s.values, dtype=float), marker="o", markersize=3, label=m)
            ax.set_xlabel(x_label)
            ax.grid(True, alpha=0.3)
            if attr == "steps":
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes[0].set_title(fig.title)
        axes[1].set_title(f"{fig.title}, against wall time")
        axes[1].legend(fontsize=7, loc="best")
        figure.savefig(path, dpi=80)
    finally:
        plt.close(figure)


# ============================================================================ HTML


_STYLE = """
body { font-family: sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; border-bottom: 1px solid #ccc; padding-bottom: 0.2em; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em 0; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.5em; vertical-align: top; text-align: left; }
td.text { white-space: pre-wrap; max-width: 40em; font-family: monospace; }
img { max-width: 100%; }
.muted { color: #777; }
"""


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _summary_rows(records: Sequence[Mapping[str, Any]], series: Mapping[str, Series]) -> list[tuple[str, str]]:
    rows = [("records", str(len(records)))]
    if records:
        steps = [int(r["step"]) for r in records]
        rows.append(("steps", f"{min(steps)} .. {max(steps)}"))
        times = [float(r["wall_time"]) for r in records if isinstance(r.get("wall_time"), (int, float))]
        if times:
            rows.append(("first record", time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(min(times)))))
            rows.append(("wall time", f"{(max(times) - min(times)) / 60.0:.2f} min"))
    for name in ("critic/score/mean", *sorted(n for n in series if n.startswith("val-core/") and "/mean@" in n)):
        s = series.get(name)
        if s is not None and s.values:
            rows.append((f"last {name}", f"{_fmt(s.values[-1])} (step {s.steps[-1]})"))
    return rows


def transcript_parts(messages: Sequence[Mapping[str, Any]]) -> list[tuple[str, bool]]:
    """A multi-turn transcript as text pieces ``(text, environment)``: one per message, ``"[role] content"``;
    ``environment`` is True for the messages the environment added (every
    message after the first assistant message that is not the assistant's: tool results, an environment's
    user turns), whose tokens are masked out of training. The report shows them in ``⟦`` ``⟧``."""
    parts: list[tuple[str, bool]] = []
    seen_assistant = False
    for m in messages:
        role = str(m.get("role", "")) if isinstance(m, Mapping) else ""
        content = m.get("content", "") if isinstance(m, Mapping) else m
        is_env = seen_assistant and role != "assistant"
        seen_assistant = seen_assistant or role == "assistant"
        parts.append((f"[{role}] {content if content is not None else ''}", is_env))
    return parts


def _transcript_html(messages: Any) -> str:
    if not isinstance(messages, Sequence) or isinstance(messages, str):
        return _e(_fmt(messages))
    return "\n\n".join(  # a blank line between messages (the cell keeps white space)
        f'<span class="env" style="background:#e8eefc">\u27e6{_e(text)}\u27e7</span>' if is_env else _e(text)
        for text, is_env in transcript_parts(messages)
    )


def _samples_html(validations: Sequence[Mapping[str, Any]]) -> str:
    if not validations:
        return (
            f'<p class="muted">No sample generations: the run has no {VALIDATION_SAMPLES_FILE} (no validation ran, '
            "or the run is older than this file).</p>"
        )
    parts = []
    for v in validations:
        cols: tuple[str, ...] = ("data_source", "prompt", "response", "ground_truth", "score")
        if any(isinstance(s, Mapping) and "transcript" in s for s in v["samples"]):  # multi-turn responses
            cols += ("step_rewards", "transcript")
        parts.append(f'<h3 id="samples-step-{int(v["step"])}">Validation at step {int(v["step"])}</h3>')
        parts.append('<table class="samples"><tr>' + "".join(f"<th>{c}</th>" for c in cols) + "</tr>")
        for s in v["samples"]:
            cells = []
            for c in cols:
                value = s.get(c, "") if isinstance(s, Mapping) else ""
                cls = ' class="text"' if c in ("prompt", "response", "transcript") else ""
                if c == "transcript":
                    cells.append(f"<td{cls}>{_transcript_html(value)}</td>")
                    continue
                if c == "step_rewards" and isinstance(value, list):
                    value = ", ".join(_fmt(float(r)) for r in value)
                cells.append(f"<td{cls}>{_e(_fmt(value))}</td>")
            parts.append("<tr>" + "".join(cells) + "</tr>")
        parts.append("</table>")
    return "\n".join(parts)


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the HTML report of the run in ``run_dir`` to ``out`` (default ``<run_dir>/report.html``), with one
    PNG per figure next to it (``<stem>_<figure>.png``, referenced relatively, so the folder can be moved or
    served as is); returns the HTML file's path.

    The page has the sections ``summary`` (steps, wall time, last score and validation numbers), ``figures``
    (:data:`FIGURES`, each against the step and the wall time; figures with no logged metric are listed as
    missing), ``samples`` (one table per validation, :func:`read_validation_samples`) and ``metrics`` (every
    metric's last value). It loads nothing from the network.

    Raises ``FileNotFoundError`` when ``run_dir`` has no ``metrics.jsonl``, ``ValueError`` for a corrupt line
    (naming it), and ``ImportError`` with what to install when matplotlib is missing.
    """
    run_dir = Path(run_dir)
    records = read_metrics_jsonl(run_dir)
    try:
        import matplotlib  # noqa: F401  # deferred: matplotlib (the trainer imports this module)
    except ImportError as exc:  # pragma: no cover - matplotlib is installed with rlplug's test/bench extras
        raise ImportError(
            "rlplug report draws its figures with matplotlib, which is not installed: pip install matplotlib."
        ) from exc
    out_path = Path(out) if out is not None else run_dir / REPORT_FILE
    if out_path.is_dir():
        out_path = out_path / REPORT_FILE
    out_path.parent.mkdir(parents=True, exist_ok=True)
    series = metric_series(records)
    last_step = max((int(r["step"]) for r in records), default=None)
    validations = read_validation_samples(run_dir, last_step)

    figures_html, missing = [], []
    for fig in FIGURES:
        metrics = _figure_metrics(fig, list(series))
        if not metrics:
            missing.append(fig.title)
            continue
        png = out_path.with_name(f"{out_path.stem}_{fig.key}.png")
        _draw(fig, metrics, series, png)
        figures_html.append(
            f'<div class="figure" id="figure-{fig.key}"><h3>{_e(fig.title)}</h3>'
            f'<img src="{_e(png.name)}" alt="{_e(fig.title)}: {_e(", ".join(metrics))}"></div>'
        )
    if missing:
        figures_html.append(f'<p class="muted">Not logged by this run: {_e(", ".join(missing))}.</p>')

    summary = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in _summary_rows(records, series))
    last_values = "".join(
        f"<tr><td>{_e(name)}</td><td>{_e(_fmt(s.values[-1]))}</td><td>{s.steps[-1]}</td></tr>"
        for name, s in series.items()
        if s.values
    )
    page = f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>rlplug report: {_e(run_dir.name)}</title>
<style>{_STYLE}</style>
</head>
<body>
<h1>rlplug report: {_e(run_dir.name)}</h1>
<p class="muted">{_e(metrics_jsonl_path(run_dir).resolve())}</p>
<section id="summary"><h2>Summary</h2><table>{summary}</table></section>
<section id="figures"><h2>Figures</h2>
{"".join(figures_html)}
</section>
<section id="samples"><h2>Sample generations per validation</h2>
{_samples_html(validations)}
</section>
<section id="metrics"><h2>Last value of every metric</h2>
<table><tr><th>metric</th><th>last value</th><th>step</th></tr>{last_values}</table>
</section>
</body>
</html>
"""
    tmp = out_path.with_name(out_path.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, out_path)
    return out_path
