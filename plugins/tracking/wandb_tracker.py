"""The ``wandb`` tracker (kind ``tracker``): a Weights & Biases run, offline by default.

Selected by ``trainer.logger=[console,wandb]``; needs the ``wandb`` package (``pip install wandb``, or
``pip install 'rlplug[watch]'``). No network and no account are needed: the run is written in W&B's offline
mode to ``<run_dir>/wandb/offline-run-<date>-<id>/`` and uploaded later with
``wandb sync <run_dir>/wandb/offline-run-*`` (after ``wandb login``). The environment variable
``WANDB_MODE`` overrides the mode (``online`` logs live; ``disabled`` writes nothing); other ``WANDB_*``
variables (``WANDB_ENTITY``, ``WANDB_BASE_URL`` ...) work as usual. The project is
``trainer.project_name``, the run name ``trainer.experiment_name``, the run config the resolved config.

What it logs: every step's metrics with ``step=`` the global step, named with
:func:`rlplug.plugin.tracker_name` (the mapping every tracker shares: ``val-core/x/acc/mean@8`` ->
``val-core/x/acc/mean_at_8``, as in MLflow and TensorBoard); tables as ``wandb.Table`` under
``tables/<name>`` (``tables/val_generations``, one per step); artifacts as W&B artifacts of type ``file``
(copied when logged); the optional tags (``trainer.alerts`` warnings) as summary values.

Resume: the run id is kept in ``<run_dir>/wandb_run.json``. When the trainer resumes from a checkpoint
(``trainer.resume_mode=auto`` with a complete checkpoint, or ``resume_path``), the same id is used with
``resume="allow"``, so ``wandb sync`` puts both attempts into one W&B run. W&B cannot delete logged points
(and in offline mode nothing can be rewound): the steps the lost attempt logged after the checkpoint stay
in its offline folder. Each attempt is numbered (1 for a fresh run, +1 per resume, kept in
``wandb_run.json``): the run config holds ``rlplug.attempt`` and ``rlplug.resume_step`` of the latest, and
every logged step carries the metric ``trainer/attempt``. :func:`clean_history` reads the offline folders
of the run back (``run-<id>.wandb``, W&B's LevelDB-style record log of protobuf records) and returns every
metric's series as an uninterrupted run logs it: per step, the values of the last attempt that logged the
step. ``<run_dir>/metrics.jsonl`` (:func:`rlplug.run.metrics.read_metrics_jsonl`) holds the same clean history.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from rlplug.plugin import RunContext, TrainerConfig, hookimpl, run_context_for, tracker_name, typed_section
from rlplug.plugin import metric_value as _number

__all__ = ["WandbTracker", "table_key", "ATTEMPT_METRIC", "history_records", "clean_history"]

_RUN_FILE = "wandb_run.json"
#: the metric logged at every step with the number of the attempt that logged it
ATTEMPT_METRIC = "trainer/attempt"


def _import_wandb() -> Any:
    try:
        return importlib.import_module("wandb")
    except ImportError as exc:
        raise ImportError(
            f"The 'wandb' tracker (trainer.logger) needs the Python package 'wandb', which is not installed "
            f"({exc}). Install it with `pip install wandb` (or `pip install 'rlplug[watch]'`), or drop 'wandb' "
            "from trainer.logger."
        ) from exc


def _scalar(value: Any) -> Any:
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    return str(value)


def table_key(name: str) -> str:
    """The W&B key of the tracker table ``name``: ``tables/`` + the name without a trailing
    ``/step_<N>.json`` (the step is W&B's own axis), e.g. ``val_generations/step_000010.json`` ->
    ``tables/val_generations``."""
    base = re.sub(r"/step_\d+\.json$", "", str(name))
    base = base[: -len(".json")] if base.endswith(".json") else base
    return "tables/" + tracker_name(base)


def _trainer(config: Any) -> TrainerConfig:
    """``config``'s ``trainer`` section as the schema's :class:`TrainerConfig` (a key missing or None takes the
    schema's default); ``config`` is the run config, a plain mapping or None."""
    return typed_section(TrainerConfig, config, "trainer")


class WandbTracker:
    """Logs to a W&B run (offline by default; see the module docstring).

    ``factory(config, resume_step=None, *, run=None)``: ``config`` is the resolved run config; ``run`` the
    :class:`rlplug.plugin.RunContext` a run builds it with (its run directory, and the step the trainer
    resumed from, 0: fresh). Without ``run`` (a tracker built outside a run) both come from
    :func:`rlplug.plugin.run_context_for` of ``config``, with ``resume_step`` (deprecated) as the step when
    given. Attributes: ``run`` (the ``wandb`` run),
    ``run_id``, ``run_dir`` (Path), ``mode`` (``offline`` unless ``WANDB_MODE`` says otherwise),
    ``resumed`` (True when the run id of an earlier attempt was reused) and ``attempt`` (1 for a fresh run,
    one more than the earlier attempt's on a resume).

    Raises ``ImportError`` naming the pip package when ``wandb`` is not installed.
    """

    def __init__(self, config: Any, resume_step: int | None = None, *, run: RunContext | None = None) -> None:
        wandb = _import_wandb()
        self._wandb = wandb
        if run is None:  # built outside a run: the run directory and resume step a run of config would have
            run = run_context_for(config, resume_step=resume_step)
        self.run_dir = run.run_dir.resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.mode = os.environ.get("WANDB_MODE") or "offline"
        self.closed = False
        run_id, self.resumed, self.attempt = None, False, 1
        stored = self.run_dir / _RUN_FILE
        step = int(run.resume_step or 0)
        if stored.is_file() and step > 0:
            try:
                record = json.loads(stored.read_text())
                run_id = str(record["run_id"])
                self.resumed, self.attempt = True, int(record.get("attempt", 1)) + 1
            except (ValueError, KeyError, TypeError):
                run_id = None
        plain: Any = {}
        try:
            plain = OmegaConf.to_container(config, resolve=True) if config is not None else {}
        except Exception:
            plain = dict(config) if isinstance(config, Mapping) else {}
        trainer = _trainer(config)
        self.run = wandb.init(
            project=str(trainer.project_name),
            name=str(trainer.experiment_name if trainer.experiment_name is not None else "default"),
            dir=str(self.run_dir),
            mode=self.mode,
            id=run_id,
            resume="allow" if run_id else None,
            config=plain,
            # no capture of stdout/stderr (the progress bar and the console line own them), no git probing
            settings=wandb.Settings(console="off", silent=True, disable_git=True, save_code=False),
            reinit="create_new",
        )
        self.run_id: str = str(self.run.id)
        self.run.config.update(
            {"rlplug.attempt": self.attempt, "rlplug.resume_step": step if self.resumed else 0}, allow_val_change=True
        )
        stored.write_text(
            json.dumps({"run_id": self.run_id, "mode": self.mode, "dir": str(self.run.dir), "attempt": self.attempt})
        )

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Add the settings to the run config (the resolved config is already there); keys as logged."""
        if not self.closed:
            self.run.config.update({str(k): _scalar(v) for k, v in params.items()}, allow_val_change=True)

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """The numeric metrics at ``step`` (names mapped with :func:`rlplug.plugin.tracker_name`), and
        ``trainer/attempt`` (:attr:`attempt`) in the same row."""
        if self.closed:
            return
        values = {tracker_name(k): v for k, v in ((k, _number(v)) for k, v in metrics.items()) if v is not None}
        if values:
            values[ATTEMPT_METRIC] = self.attempt
        self.run.log(values, step=int(step))

    def log_table(self, name: str, rows: list[dict], step: int) -> None:
        """``rows`` as a ``wandb.Table`` under :func:`table_key` at ``step`` (values that are not JSON scalars as text)."""
        if self.closed:
            return
        columns: list[str] = []
        for row in rows:
            columns.extend(str(k) for k in row if str(k) not in columns)
        data = [[_scalar({str(k): v for k, v in row.items()}.get(c)) for c in columns] for row in rows]
        self.run.log({table_key(name): self._wandb.Table(columns=columns, data=data)}, step=int(step))

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """A file or folder as a W&B artifact of type ``file`` (copied now; named after the file without its
        suffix). Raises ``FileNotFoundError`` when ``path`` does not exist."""
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"log_artifact: {p} does not exist; pass an existing file or folder.")
        if self.closed:
            return
        artifact = self._wandb.Artifact(tracker_name(p.stem, allowed=r"\w.\-", max_length=128), type="file")
        if p.is_dir():
            artifact.add_dir(str(p), name=artifact_path)
        else:
            artifact.add_file(str(p), name=f"{artifact_path}/{p.name}" if artifact_path else None)
        self.run.log_artifact(artifact)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """The tags (``rlplug.alert.<name>``: the warning) as run summary values."""
        if not self.closed:
            self.run.summary.update({tracker_name(k): str(v) for k, v in tags.items()})

    def close(self, status: str = "FINISHED") -> None:
        """Finish the run: exit code 0 for ``FINISHED``, 1 otherwise (W&B shows it as failed); idempotent."""
        if not self.closed:
            self.closed = True
            self.run.finish(exit_code=0 if str(status).upper() == "FINISHED" else 1)


# ============================================================================ reading the history back

_BLOCK = 32768  # the LevelDB log block size W&B's record files use
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(path: Path) -> Iterator[bytes]:
    """The raw records of a W&B run file (``run-<id>.wandb``): a 7-byte header (``:W&B``, a 2-byte magic,
    a version byte), then LevelDB log blocks of 32 KiB whose records carry a 7-byte header (CRC-32,
    length, type: full / first / middle / last fragment). W&B's Python package no longer ships a reader
    (its Go core writes the file), hence this one. A record cut short by a kill ends the scan."""
    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file (it does not start with ':W&B').")
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < 7:  # a block's tail too short for a header is zero padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:  # zero padding up to the block end
            pos += room
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if len(chunk) < length:
            return
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk
            pending = b""


def history_records(run_dir: str | os.PathLike, run_id: str | None = None) -> list[dict[str, Any]]:
    """Every history row W&B recorded for the run ``run_id`` (default: the one in ``<run_dir>/wandb_run.json``)
    under ``<run_dir>/wandb/``, attempt after attempt (folders in the order of their start time, rows in
    logging order), as ``{"_step": step, name: value, ...}`` dicts, values JSON-decoded. Raises
    ``FileNotFoundError`` when there is no such run there."""
    from wandb.proto import wandb_internal_pb2  # deferred: wandb

    root = Path(run_dir)
    if run_id is None:
        stored = root / _RUN_FILE
        if not stored.is_file():
            raise FileNotFoundError(f"{stored} is missing: no W&B run was logged in {root}.")
        run_id = str(json.loads(stored.read_text())["run_id"])
    files = sorted(root.glob(f"wandb/*-{run_id}/run-{run_id}.wandb"), key=lambda p: p.parent.name.split("-")[-2])
    if not files:
        raise FileNotFoundError(f"No W&B run files for run {run_id} under {root / 'wandb'}.")
    rows = []
    for file in files:
        for raw in _records(file):
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]  # generated protobuf module
            record.ParseFromString(raw)
            if record.WhichOneof("record_type") != "history":
                continue
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return rows


def clean_history(run_dir: str | os.PathLike, run_id: str | None = None) -> dict[str, list[tuple[int, float]]]:
    """Each metric's series in the W&B run of ``run_dir`` (:func:`history_records`) as an uninterrupted run
    logs it: ``{name: [(step, value), ...]}`` sorted by step, per metric and step the value logged by the
    last attempt that logged it (``trainer/attempt``; rows without it count as attempt 0; among rows of one
    attempt, the later wins).
    W&B's own keys (``_step``, ``_timestamp``, ``_runtime``) and non-numeric values (tables) are left out."""
    best: dict[tuple[str, int], tuple[float, float]] = {}  # (name, step) -> (attempt, value)
    for row in history_records(run_dir, run_id):
        step, attempt = int(row.get("_step", -1)), float(row.get(ATTEMPT_METRIC, 0))
        for key, value in row.items():
            number = _number(value) if not isinstance(value, str) else _nonfinite(value)
            if key.startswith("_") or number is None:
                continue
            if (key, step) not in best or attempt >= best[key, step][0]:  # equal: the later row wins
                best[key, step] = (attempt, number)
    out: dict[str, list[tuple[int, float]]] = {}
    for (key, step), (_, value) in sorted(best.items()):
        out.setdefault(key, []).append((step, value))
    return out


def _nonfinite(text: str) -> float | None:
    return float(text) if text in ("NaN", "Infinity", "-Infinity", "nan", "inf", "-inf") else None


@hookimpl
def register_trackers(register):
    register("wandb", WandbTracker)
