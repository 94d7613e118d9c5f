"""Where a run's files go: the run directory of a config and the names of the files in it.

The run directory is ``trainer.default_local_dir``, else ``checkpoints/<project_name>/<experiment_name>``
(:func:`run_dir_for`, as verl), with an unset ``experiment_name`` made of what the run trains
(:func:`experiment_name_for`). Under it the run writes its metric log (:data:`METRICS_FILE`,
:class:`rlplug.run.metrics.MetricsLog`), the sample generations of each validation
(:data:`VALIDATION_SAMPLES_FILE`, :mod:`rlplug.run.report`) and the rollout dumps (:data:`DUMP_DIR`,
:mod:`rlplug.run.dump`), beside the checkpoints (:mod:`rlplug.run.checkpoint`).

These names live here, in the configuration layer, because the composition of a config
(:func:`rlplug.config.compose.compose` names the run), the checkpoints, the metrics and the trackers all need
them; their old homes (:func:`rlplug.run.trainer.run_dir_for`, :func:`rlplug.run.checkpoint.experiment_name_for`,
:data:`rlplug.run.dump.DUMP_DIR`, ...) import them from here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from rlplug.base.run_context import RunContext
from rlplug.config.schema import RunConfig, config_get, typed

__all__ = [
    "COMPLETE",
    "DUMP_DIR",
    "LATEST",
    "METRICS_FILE",
    "STEP_DIR_PATTERN",
    "TRAINER_STATE_FILE",
    "VALIDATION_SAMPLES_FILE",
    "checkpoint_step",
    "complete_steps",
    "experiment_name_for",
    "resumed_step",
    "run_context_for",
    "run_dir_for",
    "tracker_resume_step",
]

#: The file under the run directory that holds every logged step's metrics, one JSON object a line.
METRICS_FILE = "metrics.jsonl"
#: The file under the run directory with the sample generations of each validation, one JSON object a line.
VALIDATION_SAMPLES_FILE = "validation_samples.jsonl"
#: The folder of the rollout dumps under the run directory (:mod:`rlplug.run.dump`).
DUMP_DIR = "rollouts"
#: The pointer file under the run directory naming the latest checkpoint's step (verl's name).
LATEST = "latest_checkpointed_iteration.txt"
#: The marker file a checkpoint directory holds once every file of it is written (:mod:`rlplug.run.checkpoint`).
COMPLETE = "COMPLETE"
#: The trainer's state file inside a ``global_step_N`` checkpoint directory (its ``global_step`` ...).
TRAINER_STATE_FILE = "trainer_state.json"
#: A checkpoint directory's name, ``global_step_<N>``; group 1 is the step.
STEP_DIR_PATTERN = re.compile(r"^global_step_(\d+)$")


def experiment_name_for(config: Any, algorithm: str | None = None, *, prefix: str | None = None) -> str:
    """``trainer.experiment_name``, or, when it is unset, a name made of what the run trains:
    ``<algorithm>_<data>``, the last part of the run directory ``checkpoints/<project>/<name>``.

    ``algorithm`` is the chosen ``algorithm=`` preset (:func:`rlplug.config.compose.compose` passes Hydra's
    choice, so ``ppo``, ``grpo``, ``dr_grpo`` ...), else ``algorithm.adv_estimator``. The data part is
    ``data.task``, else the folder of the first ``data.train_files`` entry (``gsm8k`` for
    ``~/data/gsm8k/train.parquet``), else that file's stem. So ``rlplug train`` and ``rlplug train
    algorithm=grpo`` write to different directories (``ppo_basic_arithmetic``,
    ``grpo_basic_arithmetic``). ``prefix`` (the chosen ``debug=`` preset) comes first, so smoke runs
    never share a directory with real ones (``tiny_ppo_basic_arithmetic``). Characters other than
    letters, digits and ``_ . -`` become ``_``.
    """
    run = typed(RunConfig, config)
    if run.trainer.experiment_name:
        return str(run.trainer.experiment_name)
    # free-form: a config without an estimator is named "run" (not the schema's gae), data.task=null means
    # no task (not the schema's basic_arithmetic)
    algo = algorithm or config_get(config, "algorithm.adv_estimator", "run")
    task, files = config_get(config, "data.task"), list(run.data.train_files or [])
    data = "data"
    if task:
        data = str(task)
    elif files:
        first = Path(str(files[0])).expanduser()
        data = first.parent.name or first.stem
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{prefix + '_' if prefix else ''}{algo}_{data}")


def run_dir_for(cfg: DictConfig) -> Path:
    """``trainer.default_local_dir`` or ``checkpoints/<project_name>/<experiment_name>`` (as verl).

    It holds the ``global_step_N`` checkpoints, the local MLflow store and ``final_model``. An unset
    ``experiment_name`` (a config not made by :func:`rlplug.config.compose.compose`, which fills it in) is
    named after the run's estimator and data (:func:`experiment_name_for`).
    """
    if cfg.trainer.default_local_dir:
        return Path(str(cfg.trainer.default_local_dir)).expanduser()
    return Path("checkpoints") / cfg.trainer.project_name / experiment_name_for(cfg)


# ---------------------------------------------------------------- reading a run directory's checkpoints
# What a tracker or another plugin needs to know of the run it joins (the step it resumes after), read
# from the files alone, without the checkpoint machinery of the run layer (rlplug.run.checkpoint re-exports
# these under their old names).


def complete_steps(root: str | Path) -> list[int]:
    """The steps of the complete checkpoints (``global_step_N`` directories holding :data:`COMPLETE`) under
    the run directory ``root``, ascending; ``[]`` when ``root`` is not a directory."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for p in root.iterdir():
        m = STEP_DIR_PATTERN.match(p.name)
        if m and (p / COMPLETE).is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def resumed_step(trainer_config: Any, root: str | Path) -> int:
    """The global step of the checkpoint a run in the run directory ``root`` resumes after, read cheaply
    and silently for the trackers (which are opened after the trainer resumed): ``trainer.resume_from_path``'s
    step for ``resume_mode=resume_path``; for ``auto`` the step the ``latest`` pointer names when it is
    complete, else the highest complete step (as :meth:`rlplug.run.checkpoint.CheckpointManager.latest`, without its messages and
    without :func:`rlplug.run.checkpoint.verify_checkpoint`); 0 for ``disable``, for no checkpoint, and when nothing is readable."""
    mode = str(getattr(trainer_config, "resume_mode", None) or "auto")
    if mode == "disable":
        return 0
    if mode == "resume_path":
        return checkpoint_step(str(getattr(trainer_config, "resume_from_path", "") or "")) or 0
    steps = complete_steps(root)
    try:
        pointed = int((Path(root) / LATEST).read_text().strip())
    except (OSError, ValueError):
        pointed = -1
    return pointed if pointed in steps else (steps[-1] if steps else 0)


def tracker_resume_step(config: Any, root: str | Path, given: int | None = None) -> int:
    """The step a tracker's run resumed from, 0 for a fresh start: ``given`` (the trainer's own step,
    passed by :meth:`rlplug.run.metrics.Trackers.open`) when set, else :func:`resumed_step` of the
    ``trainer`` section of ``config`` for a tracker built on its own (which cannot know of a fallback
    from a corrupt checkpoint); 0 when ``config`` has no ``trainer`` section. Raises nothing."""
    if given is not None:
        return int(given)
    trainer = config.get("trainer") if isinstance(config, Mapping) else getattr(config, "trainer", None)
    return resumed_step(trainer, root) if trainer is not None else 0


def checkpoint_step(checkpoint: str | Path) -> int | None:
    """The global step of the checkpoint directory ``checkpoint``: ``global_step`` of its
    ``trainer_state.json``, else the ``N`` of its ``global_step_N`` name, else None."""
    path = Path(checkpoint)
    try:
        return int(json.loads((path / TRAINER_STATE_FILE).read_text())["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        m = STEP_DIR_PATTERN.match(path.name)
        return int(m.group(1)) if m else None


def run_context_for(config: Any, *, run_dir: str | Path | None = None, resume_step: int | None = None) -> RunContext:
    """The :class:`rlplug.base.run_context.RunContext` of the run ``config`` describes, for a plugin built outside
    ``rlplug train`` (a test, a notebook; a run hands its plugins its own): ``run_dir`` (default
    :func:`run_dir_for` of ``config``) and ``resume_step`` when given, else the step a run there would resume
    after, read from its checkpoints (:func:`tracker_resume_step`: 0 for a fresh start or a ``config`` without
    a ``trainer`` section). Raises ``AttributeError`` when ``run_dir`` is not given and ``config`` has no
    ``trainer`` section."""
    directory = Path(run_dir) if run_dir is not None else Path(run_dir_for(config))
    return RunContext(directory, tracker_resume_step(config, directory, resume_step))
