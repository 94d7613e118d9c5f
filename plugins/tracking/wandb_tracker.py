"""The ``wandb`` tracker (kind ``tracker``): a Weights & Biases run, offline by default.

Selected by ``trainer.logger=[console,wandb]``; needs the ``wandb`` package (``pip install wandb``, or
``pip install 'rlplug[watch]'``). No network and no account are needed: the run is written in W&B's offline
mode to ``<run_dir>/wandb/offline-run-<date>-<id>/`` and uploaded later with
``wandb sync <run_dir>/wandb/offline-run-*`` (after ``wandb login``). The environment variable
``WANDB_MODE`` overrides the mode (``online`` logs live; ``disabled`` writes nothing); other ``WANDB_*``
variables (``WANDB_ENTITY``, ``WANDB_BASE_URL`` ...) work as usual. The project is
``trainer.project_name``, the run name ``trainer.experiment_name``, the run config the resolved config.

What it logs: every step's metrics with ``step=`` the global step, named with
:func:`rlplug.metrics.tracker_name` (the mapping every tracker shares: ``val-core/x/acc/mean@8`` ->
``val-core/x/acc/mean_at_8``, as in MLflow and TensorBoard); tables as ``wandb.Table`` under
``tables/<name>`` (``tables/val_generations``, one per step); artifacts as W&B artifacts of type ``file``
(copied when logged); the optional tags (``trainer.alerts`` warnings) as summary values.

Resume: the run id is kept in ``<run_dir>/wandb_run.json``. When the trainer resumes from a checkpoint
(``trainer.resume_mode=auto`` with a complete checkpoint, or ``resume_path``), the same id is used with
``resume="allow"``, so ``wandb sync`` puts both attempts into one W&B run. W&B keeps a step it already has,
so steps an earlier attempt logged after its last checkpoint keep that attempt's values there;
``<run_dir>/metrics.jsonl`` (:func:`rlplug.metrics.read_metrics_jsonl`) is the clean history.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import rlplug
from rlplug.config import config_get
from rlplug.metrics import metric_value as _number
from rlplug.metrics import tracker_name

__all__ = ["WandbTracker", "table_key"]

_RUN_FILE = "wandb_run.json"


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


def _resuming(config: Any, run_dir: Path) -> bool:
    """Whether the trainer continues a checkpoint of ``run_dir`` (:func:`rlplug.checkpoint.resume_checkpoint`)."""
    from rlplug.checkpoint import CheckpointManager, resume_checkpoint

    trainer = config_get(config, "trainer")
    if trainer is None:
        return False
    try:
        return resume_checkpoint(trainer, CheckpointManager(run_dir)) is not None
    except Exception:  # an unreadable or missing resume path: the trainer reports it; start a new run here
        return False


class WandbTracker:
    """Logs to a W&B run (offline by default; see the module docstring).

    ``factory(config)``: ``config`` is the resolved run config. Attributes: ``run`` (the ``wandb`` run),
    ``run_id``, ``run_dir`` (Path), ``mode`` (``offline`` unless ``WANDB_MODE`` says otherwise) and
    ``resumed`` (True when the run id of an earlier attempt was reused).

    Raises ``ImportError`` naming the pip package when ``wandb`` is not installed.
    """

    def __init__(self, config: Any) -> None:
        from rlplug.trainer import run_dir_for

        wandb = _import_wandb()
        self._wandb = wandb
        self.run_dir = Path(run_dir_for(config)).resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.mode = os.environ.get("WANDB_MODE") or "offline"
        self.closed = False
        run_id, self.resumed = None, False
        stored = self.run_dir / _RUN_FILE
        if stored.is_file() and _resuming(config, self.run_dir):
            try:
                run_id = str(json.loads(stored.read_text())["run_id"])
                self.resumed = True
            except (ValueError, KeyError):
                run_id = None
        plain: Any = {}
        try:
            from omegaconf import OmegaConf

            plain = OmegaConf.to_container(config, resolve=True) if config is not None else {}
        except Exception:
            plain = dict(config) if isinstance(config, Mapping) else {}
        self.run = wandb.init(
            project=str(config_get(config, "trainer.project_name", "rlplug")),
            name=str(config_get(config, "trainer.experiment_name", "default")),
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
        stored.write_text(json.dumps({"run_id": self.run_id, "mode": self.mode, "dir": str(self.run.dir)}))

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Add the settings to the run config (the resolved config is already there); keys as logged."""
        if not self.closed:
            self.run.config.update({str(k): _scalar(v) for k, v in params.items()}, allow_val_change=True)

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """The numeric metrics at ``step`` (names mapped with :func:`rlplug.metrics.tracker_name`)."""
        if self.closed:
            return
        values = {tracker_name(k): v for k, v in ((k, _number(v)) for k, v in metrics.items()) if v is not None}
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


@rlplug.hookimpl
def register_trackers(register):
    register("wandb", WandbTracker)
