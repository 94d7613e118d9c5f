"""Experiment trackers (kind ``tracker``): ``console`` and ``mlflow``.

(``tensorboard``, ``wandb`` and ``prometheus`` live in their own modules beside this one, each with its
own entry point; every run also writes ``<run_dir>/metrics.jsonl``, :class:`rlplug.run.metrics.MetricsLog`.)

Selected by the list ``trainer.logger`` (default ``[console, mlflow]``). Each registered object
is a factory ``factory(config) -> tracker`` taking the whole resolved run config (a factory that also
declares a ``run`` keyword gets the run's :class:`rlplug.plugin.RunContext`: the run directory and the step
the trainer resumed from, 0 for a fresh start); a tracker has

* ``log_params(params: dict) -> None``: run settings (nested dicts are flattened with ``.``);
* ``log_metrics(metrics: dict[str, float], step: int) -> None``: one step's metrics, named
  ``<group>/<metric>`` (``actor/pg_loss``, ``val-core/<data_source>/acc/mean@N`` ...);
* ``log_table(name: str, rows: list[dict], step: int) -> None``: e.g. validation generations;
* ``log_artifact(path, artifact_path=None) -> None``: a file or folder;
* ``close(status="FINISHED") -> None``: ``"FINISHED"``, ``"KILLED"`` or ``"FAILED"``; idempotent;
* optional ``set_tags(tags: dict[str, str]) -> None``: run tags (``mlflow``; the alert rules of
  ``trainer.alerts`` tag a warning as ``rlplug.alert.<name>``).

``console`` prints one line per step with the key metrics (the trainer owns the progress bar).

``mlflow`` writes to a local SQLite store in the run directory,
``sqlite:///<run_dir>/mlflow.db``, with artifacts in ``<run_dir>/mlflow-artifacts`` (no server
needed; browse with ``mlflow ui --backend-store-uri sqlite:///<run_dir>/mlflow.db``). The
environment variable ``MLFLOW_TRACKING_URI`` overrides the store (e.g. a shared server). The
experiment is ``trainer.project_name``, the run name ``trainer.experiment_name``. The run id is
kept in ``<run_dir>/mlflow_run.json``; when the trainer will resume from a checkpoint
(``trainer.resume_mode=auto`` with a complete ``global_step_N`` checkpoint in the run directory,
or ``resume_mode=resume_path``) that MLflow run is continued, so a resumed training keeps one
metric history; otherwise (a fresh start) a new run is created.

Attempts: MLflow cannot delete metric points, so after a kill and a resume from the checkpoint of step
``N`` the steps the lost attempt logged after ``N`` hold two values each (the lost attempt's and the
resumed one's). Each attempt is numbered (1 for a fresh run, +1 per resume): the tag ``rlplug.attempt``
holds the latest, ``rlplug.attempt.<n>.resume_step`` the step attempt ``n`` resumed after, and every
logged step carries the metric ``trainer/attempt`` (the attempt number, logged with the same timestamp as
the step's other metrics). :func:`clean_history` reads a metric's series as an uninterrupted run logs it
(per step, the value of the last attempt that logged the step); ``<run_dir>/metrics.jsonl`` holds the
same clean history for every metric (:func:`rlplug.run.metrics.read_metrics_jsonl`).

What a run holds in MLflow: the flattened config as params (and the artifact ``config.yaml``);
the tags ``rlplug.version``, ``rlplug.git_commit`` and ``rlplug.git_dirty`` (the git keys only
when rlplug runs from a git checkout, :func:`rlplug.plugin.source_tags`); every step's metrics;
the tables ``tables/val_generations/step_<N>.json`` (validation samples) and, with
``trainer.log_train_generations``, ``tables/train_generations/step_<N>.json`` (training rollouts
with score and advantage), both readable with ``mlflow.load_table``; and for a finished run the
param ``final_model_path`` and the artifact ``final_model.json``, a pointer to the exported folder
(path, step, files and sizes; the weights are not copied).

Names: MLflow restricts keys to letters, digits, ``_ - . / :`` and space, 250 characters. Every
tracker that restricts names maps them with the one function :func:`rlplug.plugin.tracker_name`
(``console`` prints them unchanged): ``@`` becomes ``_at_`` (``val-core/x/acc/mean@8`` is logged as
``val-core/x/acc/mean_at_8``), other characters ``_``. Parameter values longer than 6000
characters are truncated (the full config is also logged as the artifact ``config.yaml``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import posixpath
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from rich.console import Console

from rlplug.plugin import (
    TRACKER_NAME_CHARS,
    RunContext,
    TrainerConfig,
    hookimpl,
    run_context_for,
    source_tags,
    tracker_name,
    typed_section,
)

__all__ = [
    "ConsoleTracker",
    "MlflowTracker",
    "run_dir",
    "flatten_params",
    "sanitize_name",
    "KEY_METRICS",
    "MAX_PARAM_VALUE_LENGTH",
    "MAX_NAME_LENGTH",
    "MLFLOW_NAME_CHARS",
    "ATTEMPT_TAG",
    "ATTEMPT_METRIC",
    "clean_history",
    "clean_history_of_run_dir",
]

log = logging.getLogger("rlplug.trackers")

#: MLflow's limits (``mlflow.utils.validation``): parameter value length and key/metric name length.
MAX_PARAM_VALUE_LENGTH = 6000
MAX_NAME_LENGTH = 250
_MAX_PARAMS_PER_BATCH = 100
_MAX_METRICS_PER_BATCH = 1000
_RUN_FILE = "mlflow_run.json"
_STATUSES = {"finished": "FINISHED", "killed": "KILLED", "interrupted": "KILLED", "failed": "FAILED"}
#: the run tag holding the latest attempt number (1: never resumed)
ATTEMPT_TAG = "rlplug.attempt"
#: the metric logged at every step with the number of the attempt that logged it
ATTEMPT_METRIC = "trainer/attempt"


# ============================================================================ helpers


def _trainer(config: Any) -> TrainerConfig:
    """``config``'s ``trainer`` section as the schema's :class:`TrainerConfig` (a key missing or None takes the
    schema's default); ``config`` is the run config, a plain mapping or None."""
    return typed_section(TrainerConfig, config, "trainer")


def run_dir(config: Any) -> Path:
    """The run directory of ``config`` for a tracker built outside a run: ``trainer.default_local_dir``, else
    :func:`rlplug.plugin.run_context_for`'s (the trainer's folder, ``<default>/<trainer.project_name>/
    <trainer.experiment_name>``), else, for a config the trainer cannot read (a plain mapping),
    ``checkpoints/<trainer.project_name>/<trainer.experiment_name>``. The folder is not created. A tracker
    built by a run uses the run context's ``run_dir`` instead.
    """
    trainer = _trainer(config)
    local = trainer.default_local_dir
    if local:
        return Path(str(local)).expanduser()
    try:
        return run_context_for(config, resume_step=0).run_dir  # resume_step given: the folder is not read
    except Exception:  # config is a plain mapping, or has no trainer section
        return (
            Path("checkpoints")
            / str(trainer.project_name)
            / str(trainer.experiment_name if trainer.experiment_name is not None else "default")
        )


def _to_plain(obj: Any) -> Any:
    """OmegaConf containers and dataclasses -> plain dicts/lists (resolved)."""
    if isinstance(obj, (DictConfig, ListConfig)):
        return OmegaConf.to_container(obj, resolve=True)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    return obj


def flatten_params(params: Any, prefix: str = "") -> dict[str, str]:
    """Flatten nested mappings into ``{"a.b.c": str(value)}``.

    Lists and tuples become JSON text (``'["console", "mlflow"]'``), ``None`` becomes ``"None"``,
    other leaves ``str(value)``. Accepts dicts, OmegaConf ``DictConfig`` and dataclasses.
    """
    params = _to_plain(params)
    out: dict[str, str] = {}
    if isinstance(params, Mapping):
        if not params and prefix:
            out[prefix[:-1]] = "{}"
        for key, value in params.items():
            out.update(flatten_params(value, f"{prefix}{key}."))
        return out
    key = prefix[:-1]
    if isinstance(params, (list, tuple)):
        try:
            out[key] = json.dumps(params, default=str)
        except (TypeError, ValueError):
            out[key] = str(params)
    else:
        out[key] = str(params)
    return out


#: The characters MLflow accepts in metric and param keys (``mlflow.utils.validation``).
MLFLOW_NAME_CHARS = TRACKER_NAME_CHARS


def sanitize_name(name: str) -> str:
    """Make ``name`` a valid MLflow metric/param key: :func:`rlplug.plugin.tracker_name` with MLflow's
    characters (letters, digits, ``_ - . / :`` and space) and its 250-character limit.

    ``@`` becomes ``_at_``, any other character ``_``; empty, ``.`` and ``..`` path segments (which
    MLflow rejects) are dropped or escaped; longer names are cut and end in a short hash so they stay
    distinct. Example: ``val-core/gsm8k/acc/mean@8`` -> ``val-core/gsm8k/acc/mean_at_8``.
    """
    return tracker_name(name, allowed=MLFLOW_NAME_CHARS, max_length=MAX_NAME_LENGTH)


def _truncate(value: str, limit: int = MAX_PARAM_VALUE_LENGTH) -> str:
    if len(value) <= limit:
        return value
    marker = f"...[truncated, {len(value)} chars]"
    return value[: limit - len(marker)] + marker


def _as_float(value: Any) -> float | None:
    """A metric value as float, or None when it is not a number (str, None, multi-element tensor)."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    item = getattr(value, "item", None)  # torch / numpy scalars
    if callable(item):
        try:
            v = item()
        except (ValueError, RuntimeError):
            return None
        return float(v) if isinstance(v, (int, float, bool)) else None
    return None


def _will_resume(config: Any, directory: Path) -> bool:
    """Whether the trainer will resume: ``resume_mode=resume_path``, or ``auto`` with a complete checkpoint.

    A checkpoint is complete when ``global_step_N/COMPLETE`` exists (see :mod:`rlplug.run.checkpoint`).
    """
    mode = str(_trainer(config).resume_mode)
    if mode == "resume_path":
        return True
    if mode != "auto":
        return False
    return any(p.parent.name.startswith("global_step_") for p in directory.glob("global_step_*/COMPLETE"))


def _json_scalar(value: Any) -> Any:
    """``value`` when it is a JSON scalar (str, int, float, bool, None), else ``str(value)``."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    return str(value)


# ============================================================================ console


#: (metric, label) pairs the console tracker shows when present, in this order (verl's names).
KEY_METRICS: tuple[tuple[str, str], ...] = (
    ("critic/score/mean", "score"),
    ("critic/rewards/mean", "reward"),
    ("actor/pg_loss", "pg_loss"),
    ("actor/kl_loss", "kl_loss"),
    ("actor/ppo_kl", "ppo_kl"),
    ("actor/entropy", "entropy"),
    ("actor/pg_clipfrac", "clipfrac"),
    ("actor/grad_norm", "grad_norm"),
    ("critic/vf_loss", "vf_loss"),
    ("response_length/mean", "resp_len"),
    ("timing_s/step", "step_s"),
)


def _fmt(value: float) -> str:
    if math.isnan(value) or math.isinf(value):
        return str(value)
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
        return f"{value:.3e}"
    return f"{value:.4g}" if abs(value) >= 1 else f"{value:.4f}"


class ConsoleTracker:
    """Prints one line per step with the key metrics (:data:`KEY_METRICS` and every ``val-core/*``).

    ``factory(config)``: ``config`` is the run config (only ``trainer.project_name`` and
    ``trainer.experiment_name`` are read). ``console`` is a ``rich.console.Console`` (default: one
    writing to the current ``sys.stdout``, so a progress bar that redirects stdout keeps working).
    ``max_fields`` caps the number of values per line. Parameters, tables and artifacts are not
    printed; :meth:`close` prints the final status once.
    """

    def __init__(self, config: Any = None, console: Any = None, max_fields: int = 12) -> None:
        self.console = console if console is not None else Console(highlight=False, soft_wrap=True)
        self.max_fields = max_fields
        trainer = _trainer(config)
        self.project = trainer.project_name
        self.experiment = trainer.experiment_name if trainer.experiment_name is not None else "default"
        self.closed = False

    def summary(self, metrics: Mapping[str, Any], step: int) -> str:
        """The line :meth:`log_metrics` prints, e.g. ``step 3 | score 0.2500 | pg_loss -0.0120``."""
        fields: list[str] = []
        values = {k: v for k, v in ((k, _as_float(v)) for k, v in metrics.items()) if v is not None}
        for key, label in KEY_METRICS:
            if key in values:
                fields.append(f"{label} {_fmt(values[key])}")
        for key in sorted(values):
            if key.startswith("val-core/"):
                fields.append(f"{key[len('val-core/') :]} {_fmt(values[key])}")
        if not fields:  # unknown naming: show the first metrics alphabetically
            fields = [f"{k} {_fmt(values[k])}" for k in sorted(values)]
        if len(fields) > self.max_fields:
            fields = fields[: self.max_fields] + [f"(+{len(fields) - self.max_fields} more)"]
        return " | ".join([f"step {step}", *fields])

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Print nothing (``rlplug train`` and ``rlplug config`` print the config)."""
        return None

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Print :meth:`summary` for ``metrics`` at global step ``step``."""
        self.console.print(self.summary(metrics, step), markup=False, highlight=False)

    def log_table(self, name: str, rows: list[dict], step: int) -> None:
        """Print nothing: one line per step stays one line (tables go to file-based trackers)."""
        return None

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Artifacts already live on disk: nothing to print."""
        return None

    def close(self, status: str = "FINISHED") -> None:
        """Print the final status once (``FINISHED``, ``KILLED`` or ``FAILED``)."""
        if not self.closed:
            self.closed = True
            self.console.print(f"run {self.project}/{self.experiment}: {status}", markup=False, highlight=False)


# ============================================================================ mlflow


def _quiet_mlflow() -> None:
    """Warnings only from MLflow, no telemetry, no artifact progress bars (user settings win)."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    import mlflow  # noqa: F401  # deferred: mlflow (configures its loggers on import; adjusted below)

    level = getattr(logging, os.environ["MLFLOW_LOGGING_LEVEL"].upper(), logging.WARNING)
    for name in ("mlflow", "alembic", "sqlalchemy.engine"):
        logging.getLogger(name).setLevel(max(level, logging.WARNING) if name != "mlflow" else level)


class MlflowTracker:
    """Logs params, metrics, tables and artifacts to MLflow (see the module docstring for the store).

    ``factory(config, tracking_uri=None, resume_step=None, *, run=None)``: ``config`` is the resolved run config;
    ``tracking_uri`` overrides ``MLFLOW_TRACKING_URI`` and the local default; ``run`` the
    :class:`rlplug.plugin.RunContext` a run builds it with: its ``run_dir`` holds the store and its
    ``resume_step`` is the step the trainer resumed from (0: a fresh start, a new MLflow run). Without ``run``
    (a tracker built outside a run) the run directory is :func:`run_dir`'s and the step ``resume_step``
    (deprecated; None: whether a run there would resume is read from the run directory). On construction it
    opens (or continues) the run and logs the flattened config as params plus ``config.yaml``.

    Attributes: ``run_id``, ``tracking_uri``, ``experiment_id``, ``run_dir`` (Path),
    ``resumed`` (True when an earlier run was continued), ``client`` (``MlflowClient``).

    Raises ``mlflow.exceptions.MlflowException`` when the store cannot be opened.
    """

    def __init__(
        self,
        config: Any,
        tracking_uri: str | None = None,
        resume_step: int | None = None,
        *,
        run: RunContext | None = None,
    ) -> None:
        _quiet_mlflow()
        from mlflow.tracking import MlflowClient  # deferred: mlflow

        self.run_dir = (run.run_dir if run is not None else run_dir(config)).resolve()
        given = run.resume_step if run is not None else resume_step
        self.run_dir.mkdir(parents=True, exist_ok=True)
        env_uri = os.environ.get("MLFLOW_TRACKING_URI")
        self.tracking_uri = tracking_uri or env_uri or f"sqlite:///{self.run_dir / 'mlflow.db'}"
        local_store = not (tracking_uri or env_uri)
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        trainer = _trainer(config)
        project = str(trainer.project_name)
        run_name = str(trainer.experiment_name if trainer.experiment_name is not None else "default")
        self.experiment_id = self._experiment(project, local_store)
        self.resumed = False
        self.closed = False
        self._params: dict[str, str] | None = None
        self._warned: set[str] = set()
        self._tables: dict[str, dict] = {}
        self._previous_attempt = 0
        resuming = given > 0 if given is not None else _will_resume(config, self.run_dir)
        run_id = self._continue_run() if resuming else None
        if run_id is None:
            run = self.client.create_run(
                self.experiment_id, run_name=run_name, tags={"rlplug.run_dir": str(self.run_dir)}
            )
            run_id = run.info.run_id
            self._params = {}
        self.run_id: str = run_id
        #: this attempt's number: 1 for a fresh run, one more than the continued run's last attempt
        self.attempt = self._previous_attempt + 1
        if self.resumed and given is None:  # built outside a run: the step a run there resumes after
            given = run_context_for(config, run_dir=self.run_dir).resume_step
        step = int(given or 0) if self.resumed else 0
        self.set_tags({ATTEMPT_TAG: str(self.attempt), f"{ATTEMPT_TAG}.{self.attempt}.resume_step": str(step)})
        self._log_source_tags()
        (self.run_dir / _RUN_FILE).write_text(
            json.dumps({"run_id": self.run_id, "tracking_uri": self.tracking_uri, "experiment_id": self.experiment_id})
        )
        if config is not None:
            plain = _to_plain(config)
            if isinstance(plain, Mapping):
                self.log_params(plain)
                self._log_config_yaml(config)

    # ------------------------------------------------------------------ setup
    def _experiment(self, name: str, local_store: bool) -> str:
        from mlflow.exceptions import MlflowException  # deferred: mlflow

        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        location = (self.run_dir / "mlflow-artifacts").as_uri() if local_store else None
        try:
            return self.client.create_experiment(name, artifact_location=location)
        except MlflowException:  # created concurrently by another process
            exp = self.client.get_experiment_by_name(name)
            if exp is None:
                raise
            return exp.experiment_id

    def _continue_run(self) -> str | None:
        """The stored run id when that run can be continued (same store and experiment, not deleted)."""
        path = self.run_dir / _RUN_FILE
        if not path.is_file():
            return None
        try:
            stored = json.loads(path.read_text())
            if stored.get("tracking_uri") != self.tracking_uri:
                return None
            run = self.client.get_run(stored["run_id"])
        except Exception as exc:  # unreadable file or run missing from the store: start afresh
            log.warning("Not continuing the MLflow run recorded in %s: %s", path, exc)
            return None
        if run.info.lifecycle_stage != "active" or run.info.experiment_id != self.experiment_id:
            return None
        self.client.update_run(run.info.run_id, status="RUNNING")
        self.resumed = True
        self._params = dict(run.data.params)
        try:
            self._previous_attempt = int(run.data.tags.get(ATTEMPT_TAG, "1"))
        except ValueError:  # a hand-edited tag: count this as the second attempt
            self._previous_attempt = 1
        return run.info.run_id

    def _log_source_tags(self) -> None:
        """Tag the run with :func:`rlplug.plugin.source_tags` (``rlplug.version``, ``rlplug.git_commit``,
        ``rlplug.git_dirty``); a resumed run gets the tags of the code that continues it."""
        from mlflow.entities import RunTag  # deferred: mlflow

        tags = [RunTag(k, v) for k, v in source_tags().items()]
        self.client.log_batch(self.run_id, tags=tags, synchronous=True)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Set run tags (e.g. ``rlplug.alert.<name>`` when a ``trainer.alerts`` rule warns); keys are
        sanitized (:func:`sanitize_name`), values truncated to 5000 characters (MLflow's tag limit)."""
        from mlflow.entities import RunTag  # deferred: mlflow

        batch = [RunTag(sanitize_name(k), str(v)[:5000]) for k, v in tags.items()]
        if batch:
            self.client.log_batch(self.run_id, tags=batch, synchronous=True)

    def _log_config_yaml(self, config: Any) -> None:
        try:
            text = OmegaConf.to_yaml(config, resolve=True)
        except Exception:
            text = json.dumps(_to_plain(config), indent=2, default=str)
        self.client.log_text(self.run_id, text, "config.yaml")

    # ------------------------------------------------------------------ logging
    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log ``params`` (nested values flattened with ``.``) as MLflow params.

        Keys are sanitized (:func:`sanitize_name`), values truncated to 6000 characters. MLflow
        params are immutable: a key already logged with the same value is skipped, one with a
        different value (e.g. a changed setting on resume) is skipped with a warning.
        """
        from mlflow.entities import Param  # deferred: mlflow

        if self._params is None:
            self._params = dict(self.client.get_run(self.run_id).data.params)
        todo: dict[str, str] = {}
        for key, value in flatten_params(params).items():
            k, v = sanitize_name(key), _truncate(value)
            old = self._params.get(k, todo.get(k))
            if old is None:
                todo[k] = v
            elif old != v:
                log.warning("MLflow param '%s' is already %r for this run; not logging %r.", k, old, v)
        items = [Param(k, v) for k, v in todo.items()]
        for i in range(0, len(items), _MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[i : i + _MAX_PARAMS_PER_BATCH], synchronous=True)
        self._params.update(todo)

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log ``metrics`` at ``step`` (names sanitized; non-numeric values skipped with a warning), and
        ``trainer/attempt`` (:attr:`attempt`) at the same step and timestamp."""
        from mlflow.entities import Metric  # deferred: mlflow

        now = int(time.time() * 1000)
        items = []
        for key, value in metrics.items():
            v = _as_float(value)
            if v is None:
                if key not in self._warned:
                    self._warned.add(key)
                    log.warning("Metric '%s' is not a number (%r); not logged to MLflow.", key, type(value).__name__)
                continue
            items.append(Metric(sanitize_name(key), v, now, int(step)))
        if items:
            items.append(Metric(ATTEMPT_METRIC, float(self.attempt), now, int(step)))
        for i in range(0, len(items), _MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=items[i : i + _MAX_METRICS_PER_BATCH], synchronous=True)

    def clean_history(self, key: str) -> list[tuple[int, float]]:
        """:func:`clean_history` of the metric ``key`` (a verl name; sanitized here) in this run."""
        return clean_history(self.client, self.run_id, sanitize_name(key))

    def log_table(self, name: str, rows: list[dict], step: int) -> None:
        """Log ``rows`` as the MLflow table ``tables/<name>`` (``.json`` added if missing), with a
        leading ``step`` column.

        It is written with ``MlflowClient.log_table``, so ``mlflow.load_table("tables/<name>",
        run_ids=[run_id])`` reads it back as a ``pandas.DataFrame`` and the UI shows it as a table
        (the file is pandas' ``orient="split"`` JSON: ``{"columns": [...], "data": [[...], ...]}``).
        Logging to the same name again appends rows (also after a resume): the whole table is
        rewritten from the rows kept here, not through MLflow's own append, which re-reads the old
        rows with pandas' type guessing (``"007"`` would become ``7``). Values that are not JSON
        scalars are stored as text; text stays text in the file (``load_table`` itself reads with
        pandas, which guesses types).
        """
        artifact = posixpath.join("tables", "/".join(p for p in str(name).split("/") if p not in ("", ".", "..")))
        if not artifact.endswith(".json"):
            artifact += ".json"
        table = self._tables.get(artifact)
        if table is None:
            table = self._tables[artifact] = self._existing_table(artifact)
        columns, data = table["columns"], table["data"]
        for row in rows:
            for key in row:
                if str(key) not in columns:
                    columns.append(str(key))
                    for old in data:
                        old.append(None)
        for row in rows:
            values = {str(k): v for k, v in row.items()}
            values["step"] = int(step)
            data.append([_json_scalar(values.get(c)) for c in columns])
        self._write_table(artifact, table)

    def _write_table(self, artifact: str, table: dict) -> None:
        import pandas as pd  # deferred: pandas (heavy; mlflow's table format)

        frame = pd.DataFrame(table["data"], columns=table["columns"], dtype=object)  # object: no type guessing
        if not table.get("exists"):  # the first write registers it as a table (what mlflow.load_table finds)
            self.client.log_table(self.run_id, data=frame, artifact_file=artifact)
            table["exists"] = True
            return
        with tempfile.TemporaryDirectory(prefix="rlplug-table-") as tmp:  # replace the file with the whole table
            local = Path(tmp) / posixpath.basename(artifact)
            frame.to_json(local, orient="split", index=False)
            self.client.log_artifact(self.run_id, str(local), posixpath.dirname(artifact))

    def _existing_table(self, artifact: str) -> dict:
        """The table already logged under ``artifact`` (e.g. before a resume), or an empty one; ``exists``
        says whether the artifact file is there (then it is rewritten whole, see :meth:`log_table`)."""
        empty: dict = {"columns": ["step"], "data": [], "exists": False}
        try:
            folder = posixpath.dirname(artifact)
            if artifact not in {a.path for a in self.client.list_artifacts(self.run_id, folder)}:
                return empty
            empty["exists"] = True
            with tempfile.TemporaryDirectory() as tmp:
                local = self.client.download_artifacts(self.run_id, artifact, tmp)
                table = json.loads(Path(local).read_text())
            if list(table.get("columns", []))[:1] == ["step"] and isinstance(table.get("data"), list):
                return {"columns": list(table["columns"]), "data": [list(r) for r in table["data"]], "exists": True}
        except Exception as exc:  # unreadable: start a new table (the old file is overwritten)
            log.warning("Could not read the existing MLflow table %s (%s); starting it afresh.", artifact, exc)
        return empty

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Copy a file or a folder (recursively) into the run's artifacts under ``artifact_path``.

        Raises ``FileNotFoundError`` when ``path`` does not exist.
        """
        p = Path(path)
        if p.is_dir():
            self.client.log_artifacts(self.run_id, str(p), artifact_path)
        elif p.is_file():
            self.client.log_artifact(self.run_id, str(p), artifact_path)
        else:
            raise FileNotFoundError(f"log_artifact: {p} does not exist; pass an existing file or folder.")

    def close(self, status: str = "FINISHED") -> None:
        """End the run with ``status`` (``FINISHED``, ``KILLED``/``interrupted``, ``FAILED``); idempotent."""
        if self.closed:
            return
        mlflow_status = _STATUSES.get(str(status).lower())
        if mlflow_status is None:
            raise ValueError(f"close(status={status!r}): use 'FINISHED', 'KILLED' or 'FAILED'.")
        self.client.set_terminated(self.run_id, status=mlflow_status)
        self.closed = True


# ============================================================================ reading the history back


def clean_history(client: Any, run_id: str, key: str) -> list[tuple[int, float]]:
    """The series of the metric ``key`` (the name as logged: :func:`sanitize_name` of the verl name) of
    the MLflow run ``run_id``, as an uninterrupted run would have logged it: ``[(step, value), ...]``
    sorted by step, one value per step, the one logged by the last attempt that logged that step.

    ``client`` is an ``mlflow.tracking.MlflowClient``. A point's attempt is the ``trainer/attempt`` value
    logged at the same step with the same timestamp (:meth:`MlflowTracker.log_metrics` logs them in one
    batch); points without one (runs logged before attempts were numbered) count as attempt 0, and among
    equal attempts the later timestamp wins. Raises ``mlflow.exceptions.MlflowException`` for an unknown run.
    """
    attempt_of = {(m.step, m.timestamp): m.value for m in client.get_metric_history(run_id, ATTEMPT_METRIC)}
    best: dict[int, tuple[tuple[float, int, int], float]] = {}
    for order, m in enumerate(client.get_metric_history(run_id, key)):
        rank = (attempt_of.get((m.step, m.timestamp), 0.0), m.timestamp, order)
        if m.step not in best or rank > best[m.step][0]:
            best[m.step] = (rank, m.value)
    return [(step, value) for step, (_, value) in sorted(best.items())]


def clean_history_of_run_dir(directory: str | os.PathLike, key: str) -> list[tuple[int, float]]:
    """:func:`clean_history` of the verl metric name ``key`` in the MLflow run recorded in
    ``<directory>/mlflow_run.json`` (the run directory of a training). Raises ``FileNotFoundError`` when
    the run directory has no MLflow run."""
    _quiet_mlflow()
    from mlflow.tracking import MlflowClient  # deferred: mlflow

    path = Path(directory) / _RUN_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: no MLflow run was logged in {directory} (trainer.logger without mlflow?). "
            "Read <run_dir>/metrics.jsonl instead (rlplug.run.metrics.read_metrics_jsonl)."
        )
    stored = json.loads(path.read_text())
    return clean_history(MlflowClient(tracking_uri=stored["tracking_uri"]), stored["run_id"], sanitize_name(key))


# ============================================================================ registration


@hookimpl
def register_trackers(register):
    register("console", ConsoleTracker)
    register("mlflow", MlflowTracker)
