"""Where a run's files go: the run directory of a config and the names of the files in it.

The run directory is ``trainer.default_local_dir``, else ``checkpoints/<project_name>/<experiment_name>``
(:func:`run_dir_for`, as verl), with an unset ``experiment_name`` made of what the run trains
(:func:`experiment_name_for`). Under it the run writes its metric log (:data:`METRICS_FILE`,
:class:`rlplug.metrics.MetricsLog`), the sample generations of each validation
(:data:`VALIDATION_SAMPLES_FILE`, :mod:`rlplug.report`) and the rollout dumps (:data:`DUMP_DIR`,
:mod:`rlplug.dump`), beside the checkpoints (:mod:`rlplug.checkpoint`).

These names live here, in the configuration layer, because the composition of a config
(:func:`rlplug.compose.compose` names the run), the checkpoints, the metrics and the trackers all need
them; their old homes (:func:`rlplug.trainer.run_dir_for`, :func:`rlplug.checkpoint.experiment_name_for`,
:data:`rlplug.dump.DUMP_DIR`, ...) import them from here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from .config import config_get

__all__ = ["DUMP_DIR", "METRICS_FILE", "VALIDATION_SAMPLES_FILE", "experiment_name_for", "run_dir_for"]

#: The file under the run directory that holds every logged step's metrics, one JSON object a line.
METRICS_FILE = "metrics.jsonl"
#: The file under the run directory with the sample generations of each validation, one JSON object a line.
VALIDATION_SAMPLES_FILE = "validation_samples.jsonl"
#: The folder of the rollout dumps under the run directory (:mod:`rlplug.dump`).
DUMP_DIR = "rollouts"


def experiment_name_for(config: Any, algorithm: str | None = None, *, prefix: str | None = None) -> str:
    """``trainer.experiment_name``, or, when it is unset, a name made of what the run trains:
    ``<algorithm>_<data>``, the last part of the run directory ``checkpoints/<project>/<name>``.

    ``algorithm`` is the chosen ``algorithm=`` preset (:func:`rlplug.compose.compose` passes Hydra's
    choice, so ``ppo``, ``grpo``, ``dr_grpo`` ...), else ``algorithm.adv_estimator``. The data part is
    ``data.task``, else the folder of the first ``data.train_files`` entry (``gsm8k`` for
    ``~/data/gsm8k/train.parquet``), else that file's stem. So ``rlplug train`` and ``rlplug train
    algorithm=grpo`` write to different directories (``ppo_basic_arithmetic``,
    ``grpo_basic_arithmetic``). ``prefix`` (the chosen ``debug=`` preset) comes first, so smoke runs
    never share a directory with real ones (``tiny_ppo_basic_arithmetic``). Characters other than
    letters, digits and ``_ . -`` become ``_``.
    """
    name = config_get(config, "trainer.experiment_name")
    if name:
        return str(name)
    algo = algorithm or config_get(config, "algorithm.adv_estimator", "run")
    task, files = config_get(config, "data.task"), list(config_get(config, "data.train_files", []) or [])
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
    ``experiment_name`` (a config not made by :func:`rlplug.compose.compose`, which fills it in) is
    named after the run's estimator and data (:func:`experiment_name_for`).
    """
    if cfg.trainer.default_local_dir:
        return Path(str(cfg.trainer.default_local_dir)).expanduser()
    return Path("checkpoints") / cfg.trainer.project_name / experiment_name_for(cfg)
