"""The ``tensorboard`` tracker (kind ``tracker``): TensorBoard event files under the run directory.

Selected by ``trainer.logger=[console,tensorboard]``. It writes with ``torch.utils.tensorboard.SummaryWriter``
(needs the ``tensorboard`` package: ``pip install tensorboard``, or ``pip install 'rlplug[watch]'``) into
``<run_dir>/tensorboard/``; view with ``tensorboard --logdir <run_dir>/tensorboard`` (or a parent folder to
compare runs). Any TensorBoard reads the files, and so does
``tensorboard.backend.event_processing.event_accumulator.EventAccumulator``.

What it writes:

* every step's metrics as scalars at ``global_step=step``, named with :func:`rlplug.plugin.tracker_name`
  (the mapping every tracker shares: ``val-core/x/acc/mean@8`` -> ``val-core/x/acc/mean_at_8``, the name
  MLflow and W&B show too);
* the resolved config as the text ``config`` (a YAML block), and the tables (validation samples, training
  rollouts) as markdown text under their name without ``.json`` (``val_generations/step_000010``);
* artifacts are not copied (TensorBoard has no artifact store; the files stay in the run directory).

Resume: a run resumed from the checkpoint of step ``N`` (:func:`rlplug.run.checkpoint.resume_checkpoint`) opens
its writer with ``purge_step=N + 1``, so TensorBoard discards the events of steps ``> N`` that an earlier
attempt wrote after its last checkpoint, and the curves read like an uninterrupted run: one value per step,
the resumed attempt's. A fresh start opens it with ``purge_step`` = the first step it logs, which discards
every earlier event in the same folder the same way. The writer is opened when the first step is logged.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import Any

from omegaconf import OmegaConf

from rlplug.plugin import RunContext, hookimpl, run_context_for, tracker_name
from rlplug.plugin import metric_value as _number

__all__ = ["TensorBoardTracker", "table_markdown"]


def _import(module: str, package: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"The 'tensorboard' tracker (trainer.logger) needs the Python package '{package}', which is not "
            f"installed ({exc}). Install it with `pip install {package}` (or `pip install 'rlplug[watch]'`), "
            "or drop 'tensorboard' from trainer.logger."
        ) from exc


def _cell(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value) if isinstance(value, float) else str(value)
    return text.replace("|", "\\|").replace("\r", " ").replace("\n", "<br>")


def table_markdown(rows: list[dict]) -> str:
    """``rows`` as a markdown table (TensorBoard renders text summaries as markdown): one column per key in
    order of first appearance, ``|`` escaped, newlines as ``<br>``; ``"(no rows)"`` for none."""
    columns: list[str] = []
    for row in rows:
        columns.extend(str(k) for k in row if str(k) not in columns)
    if not columns:
        return "(no rows)"
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        values = {str(k): v for k, v in row.items()}
        lines.append("| " + " | ".join(_cell(values.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


class TensorBoardTracker:
    """Writes TensorBoard event files to ``<run_dir>/tensorboard`` (see the module docstring).

    ``factory(config, resume_step=None, *, run=None)``: ``config`` is the resolved run config; ``run`` the
    :class:`rlplug.plugin.RunContext` a run builds it with (its run directory, and the step the trainer
    resumed from, 0: fresh). Without ``run`` (a tracker built outside a run) both come from
    :func:`rlplug.plugin.run_context_for` of ``config``, with ``resume_step`` (deprecated) as the step when
    given. Attributes: ``log_dir`` (Path), ``writer`` (the
    ``SummaryWriter``, None until the first step is logged), ``resume_step`` (the checkpoint's step the run
    resumes after, 0 for a fresh start) and ``purge_step`` (the writer's: ``resume_step + 1`` on a resume,
    else the first step logged).

    Raises ``ImportError`` naming the pip package when ``tensorboard`` is not installed.
    """

    def __init__(self, config: Any, resume_step: int | None = None, *, run: RunContext | None = None) -> None:
        self._summary = _import("torch.utils.tensorboard", "tensorboard")
        if run is None:  # built outside a run: the run directory and resume step a run of config would have
            run = run_context_for(config, resume_step=resume_step)
        self.log_dir = run.run_dir.resolve() / "tensorboard"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.resume_step = int(run.resume_step or 0)
        self.writer: Any = None
        self.purge_step: int | None = None
        self.closed = False
        self._config_text: str | None = None
        if config is not None:
            try:
                self._config_text = OmegaConf.to_yaml(config, resolve=True)
            except Exception:  # a plain mapping: log_params gives the flattened settings
                self._config_text = None

    def _open(self, step: int) -> Any:
        if self.writer is None:
            self.purge_step = self.resume_step + 1 if self.resume_step > 0 else int(step)
            self.writer = self._summary.SummaryWriter(log_dir=str(self.log_dir), purge_step=self.purge_step)
            if self._config_text is not None:
                self.writer.add_text("config", "```yaml\n" + self._config_text + "\n```", global_step=self.purge_step)
        return self.writer

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Keep the settings for the ``config`` text (written with the first step) when no config was given."""
        if self._config_text is None:
            self._config_text = "\n".join(f"{k}: {v}" for k, v in sorted(params.items()))

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """One scalar per numeric metric at ``global_step=step`` (NaN and infinities included); then flush."""
        if self.closed:
            return
        writer = self._open(step)
        for key, value in metrics.items():
            v = _number(value)
            if v is not None:
                writer.add_scalar(tracker_name(key), v, global_step=int(step))
        writer.flush()

    def log_table(self, name: str, rows: list[dict], step: int) -> None:
        """``rows`` as markdown text named ``name`` without its ``.json`` suffix, at ``step``."""
        if self.closed:
            return
        tag = tracker_name(name[: -len(".json")] if name.endswith(".json") else name)
        self._open(step).add_text(tag, table_markdown(rows), global_step=int(step))

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Nothing: TensorBoard has no artifact store (the run directory keeps the files)."""
        return None

    def close(self, status: str = "FINISHED") -> None:
        """Flush and close the event file; idempotent."""
        if not self.closed and self.writer is not None:
            self.writer.close()
        self.closed = True


@hookimpl
def register_trackers(register):
    register("tensorboard", TensorBoardTracker)
