"""Crash-safe checkpoints.

Layout under ``trainer.default_local_dir``::

    global_step_10/                   complete checkpoint (has COMPLETE)
        COMPLETE                      written last inside the directory, then fsync'ed
        backend/                      written by the training backend (weights, optimizer, ...)
        rng_state.pt                  python/numpy/torch RNG states (tensors only)
        hf_meta/                      model config + tokenizer, so the checkpoint exports alone
        trainer_state.json            global step, data loader position, KL controller
        run_fingerprint.json          what makes the run (algorithm, reward, model, data): checked on resume
        config.yaml                   the run config (for reading; resuming uses the command's)
    latest_checkpointed_iteration.txt the step of the latest complete checkpoint (verl's name): resume
                                      and export follow it
    global_step_20.partial-1234/      a save that was interrupted: ignored, removed on next save
    final_model/                      the exported actor of a finished run (written by the trainer)
    overwritten/20250102-030405/      what ``trainer.overwrite=true`` moved aside: the earlier run's
                                      checkpoints, pointer and final_model (never deleted)

:func:`save_checkpoint` writes one (files in the order above) and :func:`load_checkpoint` reads
one back; :func:`resume_checkpoint` finds the one ``trainer.resume_mode`` selects, and
:func:`open_run_dir` decides, before any model loads, how a run starts in its directory: it
refuses to resume a checkpoint whose :func:`run_fingerprint` differs from the command's, and to
start fresh in a directory that holds another run's checkpoints unless ``trainer.overwrite=true``
(then they are moved aside). The RNG capture (:func:`seed_everything`, :func:`rng_state`,
:func:`set_rng_state`) lives here too, so a resumed run draws the same random numbers as an
uninterrupted one. Everything is loaded with ``torch.load(weights_only=True)``, JSON or
safetensors: nothing is unpickled.

A save writes into ``global_step_N.partial-<pid>``, fsyncs every file in it, marks it COMPLETE,
renames it to ``global_step_N`` (atomic on POSIX) and only then replaces the ``latest`` pointer
(write to a temp file + ``os.replace``). A kill at any moment leaves either the previous
checkpoint as latest or the new one, never a half-written one. Directories are never deleted in
place: a checkpoint to remove (an old one beyond ``max_to_keep``, or an earlier save of the same
step being replaced) is first renamed to a ``.partial-`` name, so a kill in the middle of the
deletion leaves a directory that is recognised as partial, never one that still looks complete.

Testing aid: :func:`_fault_point` marks the places where the kill tests
(``tests/test_kill_resume.py``) stop the process; it does nothing unless the environment
variable ``RLPLUG_TEST_KILL_AT`` is set.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pickle
import random
import re
import shutil
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

__all__ = [
    "CheckpointManager",
    "save_checkpoint",
    "load_checkpoint",
    "resume_checkpoint",
    "export_checkpoint",
    "apply_umask",
    "find_checkpoint",
    "checkpoint_step",
    "run_fingerprint",
    "fingerprint_diff",
    "check_fingerprint",
    "experiment_name_for",
    "RunStart",
    "open_run_dir",
    "set_aside_checkpoints",
    "seed_everything",
    "rng_state",
    "set_rng_state",
    "atomic_write_text",
    "LATEST",
    "COMPLETE",
]

LATEST = "latest_checkpointed_iteration.txt"
COMPLETE = "COMPLETE"
#: the exported model of a finished run, in the run directory
FINAL_MODEL = "final_model"
#: where ``trainer.overwrite=true`` moves an earlier run's checkpoints (a dated folder inside)
OVERWRITTEN = "overwritten"
#: the run's own metric log (:class:`rlplug.metrics.MetricsLog`), set aside with the checkpoints
METRICS_LOG = "metrics.jsonl"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


# ============================================================================ testing aid

#: ``label:n[:SIGNAL][,label:n[:SIGNAL]...]``, e.g. ``ckpt_renamed:2`` or ``update_actor:1:SIGTERM``
FAULT_ENV = "RLPLUG_TEST_KILL_AT"
_fault_counts: dict[str, int] = {}


def _fault_point(label: str) -> None:
    """Testing aid: send a signal to this process at the ``n``-th time ``label`` is reached.

    With ``RLPLUG_TEST_KILL_AT=<label>:<n>[:<SIGNAL>]`` (comma-separated for several), the
    ``n``-th call with ``label`` (counted per process, 1-based) prints a line naming the point
    to stderr and sends ``SIGNAL`` (default ``SIGKILL``; e.g. ``SIGTERM`` to test the graceful
    stop) to the current process. Used by the crash tests to stop a run at exact places (during
    rollout, between checkpoint rename and the ``latest`` pointer, ...). When the variable is
    unset the cost is one environment lookup. The labels are listed in ``tests/test_kill_resume.py``.
    """
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    count = _fault_counts[label] = _fault_counts.get(label, 0) + 1
    for item in spec.split(","):
        parts = item.strip().split(":")
        if parts[0] != label or count != (int(parts[1]) if len(parts) > 1 and parts[1] else 1):
            continue
        signame = parts[2] if len(parts) > 2 else "SIGKILL"
        print(f"{FAULT_ENV}: {signame} at {label}:{count}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os.kill(os.getpid(), getattr(signal, signame))


# ============================================================================ files


def _fsync(path: Path | str) -> None:
    """fsync the file or directory ``path``, best effort (a file system that refuses is skipped)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (so COMPLETE never precedes the data on disk)."""
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            _fsync(os.path.join(dirpath, name))
        _fsync(Path(dirpath))


def _umask() -> int:
    """The process umask: from ``/proc/self/status`` on Linux, else set (to a stricter one) and restored."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)  # os.umask can only be read by setting it: stricter, never looser, meanwhile
    os.umask(mask)
    return mask


def apply_umask(root: str | Path, pattern: str = "*.safetensors") -> None:
    """Give the files under ``root`` (recursively) whose names match ``pattern`` the mode a plain
    ``open()`` gives them: ``0o666 & ~umask`` (``0o644``, readable by everyone, under the usual umask
    ``022``; ``0o640`` under ``027``), so an inference server running as another user can read a model.

    safetensors' writer (``save_file``, which ``save_pretrained`` uses) writes through a temporary
    file renamed into place, created ``0o600`` whatever the umask. Folders made with ``mkdir`` and
    files written with ``open()`` already follow the umask and are left as they are, as are files of
    other names. The exports (the final model, ``rlplug export``) and the checkpoints call this.
    """
    mode = 0o666 & ~_umask()
    for path in Path(root).rglob(pattern):
        if path.is_file() and not path.is_symlink():
            path.chmod(mode)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so a reader sees the old or the new content, never a mix."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    _fault_point("pointer_tmp_written")
    os.replace(tmp, path)
    _fsync(path.parent)


class CheckpointManager:
    """Saves and finds checkpoints under ``root``; keeps at most ``max_to_keep`` (None: all)."""

    def __init__(self, root: str | Path, max_to_keep: int | None = None) -> None:
        self.root = Path(root)
        self.max_to_keep = max_to_keep

    def step_dir(self, step: int) -> Path:
        return self.root / f"global_step_{step}"

    def complete_steps(self) -> list[int]:
        """Steps of complete checkpoints, ascending."""
        if not self.root.is_dir():
            return []
        steps = []
        for p in self.root.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and (p / COMPLETE).is_file():
                steps.append(int(m.group(1)))
        return sorted(steps)

    def partial_dirs(self) -> list[Path]:
        """Directories of interrupted saves (``*.partial-*`` or step dirs without COMPLETE)."""
        if not self.root.is_dir():
            return []
        out = []
        for p in self.root.iterdir():
            if not p.is_dir():
                continue
            if ".partial-" in p.name and p.name.startswith("global_step_"):
                out.append(p)
            elif _STEP_DIR.match(p.name) and not (p / COMPLETE).is_file():
                out.append(p)
        return sorted(out)

    def latest(self) -> Path | None:
        """The checkpoint to resume from (and to export): the one the ``latest`` pointer names, or None.

        The pointer is replaced only after a save is complete, so it always names the run's last
        finished save: when it names a complete checkpoint, that one is returned, even when a higher
        complete step exists beside it. Such a step is a save killed between its rename and the
        pointer update (resuming from the pointer replays that step exactly), or one left over from
        an earlier run in the same directory; it is reported loudly (a logged warning and a printed
        line) and not used. Only when the pointer is missing, unreadable or names no complete
        checkpoint is the highest complete step returned (with a warning when a pointer was there).
        Partial directories are reported in the log and ignored.
        """
        for p in self.partial_dirs():
            log.warning("Ignoring incomplete checkpoint %s (an interrupted save; removed on the next save)", p)
        steps = self.complete_steps()
        if not steps:
            return None
        pointer = self.root / LATEST
        if not pointer.is_file():
            return self.step_dir(steps[-1])  # e.g. the first save was killed before its pointer was written
        try:
            step = int(pointer.read_text().strip())
        except ValueError:
            step = -1
        if step not in steps:
            log.warning(
                "Checkpoint pointer %s says %s; using the latest complete checkpoint, step %d", pointer, step, steps[-1]
            )
            return self.step_dir(steps[-1])
        newer = [s for s in steps if s > step]
        if newer:
            msg = (
                f"WARNING: the checkpoint pointer {pointer} names step {step}, but newer complete checkpoints "
                f"exist beside it: {', '.join(str(self.step_dir(s)) for s in newer)} (a save killed before the "
                "pointer was updated, or left over from an earlier run in this directory). Using step "
                f"{step}, as the pointer says. To use another one, pass its directory: trainer.resume_mode="
                "resume_path trainer.resume_from_path=<dir> (training), or rlplug export <dir>."
            )
            log.warning(msg)
            print(msg, flush=True)
        return self.step_dir(step)

    def save(self, step: int, write: Callable[[Path], None]) -> Path:
        """Write a checkpoint for ``step``: ``write(tmp_dir)`` fills it; returns the final path.

        Raises whatever ``write`` raises; in that case nothing but a partial dir is left behind,
        and the previous checkpoint stays the latest.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.step_dir(step)
        tmp = self.root / f"global_step_{step}.partial-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        _fault_point("ckpt_tmp_created")
        write(tmp)
        apply_umask(tmp)  # safetensors writes its files 0600: model files follow the umask
        _fault_point("ckpt_written")
        _fsync_tree(tmp)
        marker = tmp / COMPLETE
        with open(marker, "w") as f:
            f.write(json.dumps({"step": step}))
            f.flush()
            os.fsync(f.fileno())
        _fsync(tmp)
        _fault_point("ckpt_marked")
        if final.exists():  # an older save of the same step (e.g. after resume_path): move it aside first
            self._discard(final)
            _fault_point("ckpt_old_moved")
        os.replace(tmp, final)
        _fsync(self.root)
        _fault_point("ckpt_renamed")
        atomic_write_text(self.root / LATEST, str(step))
        _fault_point("ckpt_pointer")
        self._cleanup(keep=final)
        return final

    def _discard(self, path: Path) -> None:
        """Remove a checkpoint directory crash-safely: rename it to a partial name, then delete.

        A kill during ``rmtree`` of a complete checkpoint in place could leave a directory that
        still holds COMPLETE but lacks files; after the rename it is only ever seen as partial.
        """
        doomed = self.root / f"{path.name}.partial-discard-{os.getpid()}"
        if doomed.exists():
            shutil.rmtree(doomed, ignore_errors=True)
        os.replace(path, doomed)
        _fsync(self.root)
        shutil.rmtree(doomed, ignore_errors=True)

    def _cleanup(self, keep: Path) -> None:
        for p in self.partial_dirs():
            if p != keep:
                shutil.rmtree(p, ignore_errors=True)
                _fault_point("ckpt_cleanup")
        for p in self.root.glob(f".{LATEST}.tmp-*"):  # pointer temp files of interrupted saves
            p.unlink(missing_ok=True)
        if self.max_to_keep is not None and self.max_to_keep > 0:
            steps = self.complete_steps()
            for s in steps[: max(0, len(steps) - self.max_to_keep)]:
                d = self.step_dir(s)
                if d != keep:
                    self._discard(d)
                    _fault_point("ckpt_cleanup")


# ============================================================================ RNG state


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global RNGs with ``seed``."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """The global RNG states (Python, NumPy, torch CPU) as tensors and plain types, loadable with
    ``torch.load(weights_only=True)``; :func:`set_rng_state` restores them."""
    import numpy as np
    import torch

    py = random.getstate()
    np_state: Any = np.random.get_state()  # the legacy tuple (MT19937, keys, pos, has_gauss, gauss)
    return {
        "python_version": py[0],
        "python_state": torch.tensor(py[1], dtype=torch.int64),
        "python_gauss": py[2] if py[2] is not None else float("nan"),
        "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_pos": int(np_state[2]),
        "numpy_has_gauss": int(np_state[3]),
        "numpy_gauss": float(np_state[4]),
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore the RNG states saved by :func:`rng_state`."""
    import numpy as np
    import torch

    gauss = state["python_gauss"]
    random.setstate(
        (
            state["python_version"],
            tuple(int(x) for x in state["python_state"].tolist()),
            None if isinstance(gauss, float) and math.isnan(gauss) else gauss,
        )
    )
    np.random.set_state(
        (
            "MT19937",
            state["numpy_keys"].numpy().astype(np.uint32),
            state["numpy_pos"],
            state["numpy_has_gauss"],
            state["numpy_gauss"],
        )
    )
    torch.set_rng_state(state["torch"])


# ============================================================================ the run's checkpoint

#: file names inside a ``global_step_N`` directory (see the module docstring)
BACKEND_DIR, RNG_FILE, META_DIR, STATE_FILE, CONFIG_FILE = (
    "backend",
    "rng_state.pt",
    "hf_meta",
    "trainer_state.json",
    "config.yaml",
)
#: what makes the run (:func:`run_fingerprint`), written into every checkpoint, compared on resume
FINGERPRINT_FILE = "run_fingerprint.json"


def write_checkpoint(
    directory: Path,
    *,
    step: int,
    backend: Any,
    stateful: Mapping[str, Any],
    tokenizer: Any,
    model_path: str | Path,
    config: Any,
) -> None:
    """Fill ``directory`` (an empty partial dir) with one checkpoint, in the layout's order.

    ``backend`` writes ``backend/`` (:meth:`rlplug.types.TrainingBackend.save`); ``stateful``
    maps names to objects with ``state_dict()`` (JSON-serialisable; the trainer passes its data
    loader and KL controller), saved with ``step`` in ``trainer_state.json``; ``tokenizer`` and
    the model's ``config.json`` go to ``hf_meta/``; ``config`` (a DictConfig) to ``config.yaml``, and
    its :func:`run_fingerprint` to ``run_fingerprint.json``.
    """
    import torch
    from omegaconf import OmegaConf

    backend.save(directory / BACKEND_DIR)
    _fault_point("ckpt_backend")
    torch.save(rng_state(), directory / RNG_FILE)
    _fault_point("ckpt_rng")
    meta = directory / META_DIR
    meta.mkdir()
    tokenizer.save_pretrained(meta)
    cfg_json = Path(model_path) / "config.json"
    if cfg_json.is_file():
        (meta / "config.json").write_text(cfg_json.read_text())
    _fault_point("ckpt_meta")
    state = {"global_step": step, **{name: obj.state_dict() for name, obj in stateful.items()}}
    (directory / STATE_FILE).write_text(json.dumps(state, indent=1))
    _fault_point("ckpt_state")
    (directory / FINGERPRINT_FILE).write_text(json.dumps(run_fingerprint(config), indent=1, sort_keys=True))
    (directory / CONFIG_FILE).write_text(OmegaConf.to_yaml(config))


def save_checkpoint(manager: CheckpointManager, step: int, *, backend: Any, coordinator: Any, **files: Any) -> Path:
    """Save checkpoint ``step`` crash-safely (:meth:`CheckpointManager.save` around
    :func:`write_checkpoint`, which takes ``files``) and return its path, on every process.

    ``coordinator`` (:class:`rlplug.types.Coordinator`): the main process owns the directory and
    writes everything; it broadcasts the partial directory's path so every other process writes
    its shards of ``backend/`` there, then the final path. Every process must call this.
    """
    if not coordinator.is_main:
        backend.save(Path(coordinator.broadcast(None)) / BACKEND_DIR)
        return Path(coordinator.broadcast(None))

    def write(tmp: Path) -> None:
        coordinator.broadcast(str(tmp))  # the other processes write their shards into the same folder
        write_checkpoint(tmp, step=step, backend=backend, **files)

    path = manager.save(step, write)
    coordinator.broadcast(str(path))
    return path


def resume_checkpoint(trainer_config: Any, manager: CheckpointManager) -> Path | None:
    """The checkpoint ``trainer.resume_mode`` selects: ``None`` for ``disable`` (or when ``auto``
    finds none), ``trainer.resume_from_path`` for ``resume_path``, else the latest complete one.

    Raises :class:`rlplug.config.ConfigError` when the selected directory is not a complete
    checkpoint (no COMPLETE marker).
    """
    from .config import ConfigError

    mode = trainer_config.resume_mode
    if mode == "disable":
        return None
    path = Path(str(trainer_config.resume_from_path)) if mode == "resume_path" else manager.latest()
    if path is not None and not (path / COMPLETE).is_file():
        raise ConfigError(f"trainer.resume_from_path={path} is not a complete checkpoint (no COMPLETE marker).")
    return path


def load_checkpoint(path: Path, *, backend: Any, stateful: Mapping[str, Any]) -> int:
    """Restore the checkpoint at ``path`` written by :func:`write_checkpoint`: the backend's state,
    the RNG states and each ``stateful`` object's ``load_state_dict``; returns its global step.

    Raises :class:`rlplug.config.ConfigError` when a file holds pickled objects other than tensors
    and plain containers (nothing is unpickled), or when a ``stateful`` object rejects its state
    (the data or KL settings differ from the checkpointed run).
    """
    import torch

    from .config import ConfigError

    state = json.loads((path / STATE_FILE).read_text())
    try:
        backend.load(path / BACKEND_DIR)
        set_rng_state(torch.load(path / RNG_FILE, weights_only=True))
    except pickle.UnpicklingError as exc:  # torch.load(weights_only=True) met a non-tensor object
        lines = str(exc).splitlines() or [""]
        detail = next((ln.strip() for ln in lines if "Unsupported" in ln), lines[0]).split(" Please use")[0]
        raise ConfigError(
            f"Refusing to resume from {path}: a file in it holds pickled Python objects other than tensors and "
            f"plain containers ({detail}). rlplug loads checkpoints with torch.load(weights_only=True) and "
            "safetensors only, because unpickling arbitrary objects can run code. Resume from a checkpoint "
            "written by rlplug, or start fresh with trainer.resume_mode=disable trainer.overwrite=true (the old "
            "checkpoints are moved aside)."
        ) from exc
    try:
        for name, obj in stateful.items():
            if name not in state and getattr(obj, "optional_state", False):
                continue  # state added after this checkpoint was written: the object keeps its fresh state
            obj.load_state_dict(state[name])
    except (ValueError, KeyError) as exc:
        raise ConfigError(
            f"Cannot resume from {path}: {str(exc).rstrip('.')}. The data or KL settings differ from the checkpointed run; "
            "restore them, or start fresh with trainer.resume_mode=disable trainer.overwrite=true (the old checkpoints "
            "are moved aside), or train in another directory (trainer.experiment_name or trainer.default_local_dir)."
        ) from exc
    return int(state["global_step"])


def find_checkpoint(checkpoint: str | Path) -> Path:
    """The complete checkpoint ``checkpoint`` names: itself when it is a ``global_step_N`` directory
    with COMPLETE, else the run directory's :meth:`CheckpointManager.latest` (the one the ``latest``
    pointer names, with a loud warning when a newer complete step exists beside it).

    Raises ``FileNotFoundError`` when there is no complete checkpoint there.
    """
    ckpt = Path(checkpoint)
    if (ckpt / COMPLETE).is_file():
        return ckpt
    latest = CheckpointManager(ckpt).latest()
    if latest is None:
        raise FileNotFoundError(
            f"No complete checkpoint at {ckpt}: expected a global_step_N directory containing {COMPLETE}, "
            f"or a run directory that holds one."
        )
    return latest


def checkpoint_step(checkpoint: str | Path) -> int | None:
    """The global step of the checkpoint directory ``checkpoint``: ``global_step`` of its
    ``trainer_state.json``, else the ``N`` of its ``global_step_N`` name, else None."""
    path = Path(checkpoint)
    try:
        return int(json.loads((path / STATE_FILE).read_text())["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        m = _STEP_DIR.match(path.name)
        return int(m.group(1)) if m else None


def export_checkpoint(checkpoint: str | Path, out: str | Path) -> Path:
    """Write the actor of ``checkpoint`` (a ``global_step_N`` dir, or a run dir: the checkpoint its
    ``latest`` pointer names, see :func:`find_checkpoint`) as a HF folder.

    The result loads with ``AutoModelForCausalLM.from_pretrained`` and vLLM.
    Raises ``FileNotFoundError`` when no complete checkpoint is found there, and ``ValueError``
    when the saved weights do not fit the model described by ``hf_meta/config.json`` (missing or
    unexpected tensor names), instead of writing a folder with uninitialised weights.
    """
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    ckpt = find_checkpoint(checkpoint)
    meta = ckpt / "hf_meta"
    weights = ckpt / "backend" / "actor" / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(
            f"{weights} is missing: this checkpoint was not written by a backend that rlplug export understands."
        )
    config = AutoConfig.from_pretrained(meta)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    state = load_file(str(weights))
    result = model.load_state_dict(state, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()  # the tied output projection is saved once, under the embedding's name
    # every parameter must now hold saved data: one still on the meta device was never loaded
    missing = sorted(name for name, p in model.named_parameters() if p.is_meta)
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{weights} does not match the model in {meta / 'config.json'}: missing {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}, unexpected {sorted(result.unexpected_keys)[:5]}. The checkpoint's "
            "backend must save the actor under Hugging Face parameter names (as the local and fsdp2 backends do)."
        )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(meta).save_pretrained(out)
    apply_umask(out)  # readable by an inference server of another user, as the umask allows
    return out


# ============================================================================ run identity


def experiment_name_for(config: Any, algorithm: str | None = None, *, prefix: str | None = None) -> str:
    """``trainer.experiment_name``, or, when it is unset, a name made of what the run trains:
    ``<algorithm>_<data>``, the last part of the run directory ``checkpoints/<project>/<name>``.

    ``algorithm`` is the chosen ``algorithm=`` preset (:func:`rlplug.config.compose` passes Hydra's
    choice, so ``ppo``, ``grpo``, ``dr_grpo`` ...), else ``algorithm.adv_estimator``. The data part is
    ``data.task``, else the folder of the first ``data.train_files`` entry (``gsm8k`` for
    ``~/data/gsm8k/train.parquet``), else that file's stem. So ``rlplug train`` and ``rlplug train
    algorithm=grpo`` write to different directories (``ppo_basic_arithmetic``,
    ``grpo_basic_arithmetic``). ``prefix`` (the chosen ``debug=`` preset) comes first, so smoke runs
    never share a directory with real ones (``tiny_ppo_basic_arithmetic``). Characters other than
    letters, digits and ``_ . -`` become ``_``.
    """
    from .config import config_get

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


def _plain(value: Any) -> Any:
    """OmegaConf containers as plain (resolved) dicts and lists; other values unchanged."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _abspath(path: Any) -> str:
    return str(Path(str(path)).expanduser().resolve())


def _critic_model_key(get: Callable[[str], Any]) -> dict[str, Any]:
    """``critic.model`` in :func:`run_fingerprint`: its source, absolute path and (``source=tiny``) tiny settings."""
    source, path = get("critic.model.source"), get("critic.model.path")
    return {
        "source": source,
        "path": _abspath(path) if path else None,
        "tiny": get("critic.model.tiny") if source == "tiny" else None,
    }


def run_fingerprint(config: Any) -> dict[str, Any]:
    """What makes a run this run: ``{config key: JSON value}``, written into every checkpoint as
    ``run_fingerprint.json`` and compared on resume (:func:`check_fingerprint`).

    A checkpoint of another run in the same directory (another algorithm, reward, model or data) is
    then refused with the differing keys named, instead of being trained on under a different
    objective. The keys:

    * algorithm: ``algorithm.adv_estimator``, ``actor.policy_loss``, ``actor.loss_agg_mode``,
      ``critic.enable`` (with the estimator it decides whether a critic is trained, whose state the
      checkpoint holds), ``actor.use_kl_loss`` with ``actor.kl_loss_type`` and
      ``algorithm.use_kl_in_reward`` with ``algorithm.kl_penalty`` (the KL estimator is ``None`` when
      its term is off), ``critic.loss_type``: which pieces and which terms make the objective;
    * schedule: ``algorithm.schedule`` as declared (every phase's until, preset and overrides) and
      ``rollout.n_schedule``, each only when it is set (so runs without one keep their fingerprints); the current phase is not part of
      it (it is checkpointed state, :class:`rlplug.schedule.Schedule`);
    * reward: ``reward.reward_fn_map`` (data source -> function), ``reward.default``, ``reward.kwargs``,
      ``reward.shaping`` (each entry's name, weight and kwargs), ``reward.normalize.enable`` and, when
      its ``path`` is set, ``reward.custom_reward_function`` (absolute path, name, reward_kwargs);
    * model: ``model.source``, ``model.path`` (absolute) and ``model.tiny`` (only for ``source=tiny``);
      ``critic.model`` (``source``, absolute ``path``, ``tiny`` only for ``source=tiny``; ``None`` when
      neither ``path`` nor ``source`` is set: the critic starts from the actor's model);
    * data: ``data.train_files`` (absolute paths) or, for generated data (no files), ``data.task``,
      ``data.train_size``, ``data.test_size``, ``data.data_seed``, ``data.task_kwargs`` and
      ``data.instruction``; ``data.system_prompt`` (it changes every prompt).

    Left out on purpose, because changing them between a stop and a resume does not make another
    run: the length and rhythm of training (``trainer.total_training_steps``, ``total_epochs``,
    ``save_freq``, ``test_freq``, ``max_wall_time_s``), logging, devices, threads and memory-only
    sizes (micro-batches, chunks), and numeric coefficients one may tune on purpose (learning
    rates, clip ratios, KL and entropy coefficients, ``gamma``, ``lam``). Batch sizes and the data
    order are checked by the data loader's own state (:func:`load_checkpoint`). Keys missing from
    ``config`` (e.g. a partial test config) read as ``None``.
    """
    from .config import config_get

    def get(key: str) -> Any:
        return _plain(config_get(config, key))

    files = [_abspath(f) for f in get("data.train_files") or []]
    generated = not files
    kl_loss, kl_reward = bool(get("actor.use_kl_loss")), bool(get("algorithm.use_kl_in_reward"))
    custom = get("reward.custom_reward_function")
    custom = {**custom, "path": _abspath(custom["path"])} if isinstance(custom, dict) and custom.get("path") else None
    return {
        "algorithm.adv_estimator": get("algorithm.adv_estimator"),
        "algorithm.norm_adv_by_std_in_grpo": get("algorithm.norm_adv_by_std_in_grpo"),
        "actor.policy_loss": get("actor.policy_loss"),
        "actor.loss_agg_mode": get("actor.loss_agg_mode"),
        "critic.enable": get("critic.enable"),
        "actor.use_kl_loss": kl_loss,
        "actor.kl_loss_type": get("actor.kl_loss_type") if kl_loss else None,
        "algorithm.use_kl_in_reward": kl_reward,
        "algorithm.kl_penalty": get("algorithm.kl_penalty") if kl_reward else None,
        "critic.loss_type": get("critic.loss_type"),
        "reward.reward_fn_map": get("reward.reward_fn_map") or {},
        "reward.default": get("reward.default"),
        "reward.kwargs": get("reward.kwargs") or {},
        "reward.shaping": get("reward.shaping") or [],
        "reward.custom_reward_function": custom,
        "reward.normalize.enable": bool(get("reward.normalize.enable")),
        "model.source": get("model.source"),
        "model.path": _abspath(get("model.path")) if get("model.path") else None,
        "model.tiny": get("model.tiny") if get("model.source") == "tiny" else None,
        "critic.model": _critic_model_key(get) if get("critic.model.path") or get("critic.model.source") else None,
        "data.train_files": files,
        "data.task": get("data.task") if generated else None,
        "data.train_size": get("data.train_size") if generated else None,
        "data.test_size": get("data.test_size") if generated else None,
        "data.data_seed": get("data.data_seed") if generated else None,
        "data.task_kwargs": (get("data.task_kwargs") or {}) if generated else None,
        "data.instruction": get("data.instruction") if generated else None,
        "data.system_prompt": get("data.system_prompt"),
        **({"algorithm.schedule": get("algorithm.schedule")} if get("algorithm.schedule") else {}),
        **({"rollout.n_schedule": get("rollout.n_schedule")} if get("rollout.n_schedule.type") else {}),
    }


class _Unset:
    """A nested key one side of a fingerprint lacks."""

    def __repr__(self) -> str:
        return "(unset)"


_UNSET = _Unset()


def fingerprint_diff(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """The differences between two :func:`run_fingerprint` results as ``(key, saved value, current
    value)``, in ``current``'s key order, nested values compared key by key (``reward.kwargs.gsm8k.method``,
    ``reward.shaping[0].weight``; a side that lacks a nested key shows ``(unset)``).

    Only top-level keys present on both sides are compared, so a checkpoint written by an rlplug
    that recorded fewer keys still resumes. ``current`` is compared as JSON would store it. Two
    differences do not count: a ``reward.reward_fn_map`` entry only one side has (a mapping added
    for another data source, or a default entry a newer rlplug ships, leaves this run's functions
    as they were), and ``critic.enable`` unset (decided by the estimator) on one side.
    """
    now = json.loads(json.dumps(dict(current)))
    out: list[tuple[str, Any, Any]] = []
    for key, value in now.items():
        if key in saved:
            _diff(key, saved[key], value, out)
    return [
        (k, a, b)
        for k, a, b in out
        if not (k.startswith("reward.reward_fn_map.") and _UNSET in (a, b))
        and not (k == "critic.enable" and None in (a, b))
    ]


def _diff(key: str, a: Any, b: Any, out: list[tuple[str, Any, Any]]) -> None:
    if a == b:
        return
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            _diff(f"{key}.{k}", a.get(k, _UNSET), b.get(k, _UNSET), out)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _diff(f"{key}[{i}]", x, y, out)
    else:
        out.append((key, a, b))


def _show(value: Any) -> str:
    return repr(value) if value is _UNSET else json.dumps(value)


def _new_dir_option(config: Any) -> str:
    """The override that gives a run a directory of its own."""
    from .config import config_get

    if config_get(config, "trainer.default_local_dir"):
        return "trainer.default_local_dir=<another directory>"
    return f"trainer.experiment_name=<a new name> (this run's is {experiment_name_for(config)!r})"


def check_fingerprint(path: Path, config: Any) -> None:
    """Refuse to resume ``config``'s run from the checkpoint ``path`` when it was written by another
    run: compares its ``run_fingerprint.json`` with :func:`run_fingerprint` of ``config``.

    Raises :class:`rlplug.config.ConfigError` naming every differing key with the checkpoint's and
    the command's values, and the ways out (a new ``trainer.experiment_name``, or a fresh start in
    this directory with ``trainer.resume_mode=disable trainer.overwrite=true``), or when the file
    is unreadable. A checkpoint without the file (written before rlplug recorded fingerprints)
    resumes, with a warning logged and printed.
    """
    from .config import ConfigError

    file = path / FINGERPRINT_FILE
    if not file.is_file():
        msg = (
            f"WARNING: {path} has no {FINGERPRINT_FILE} (written before rlplug recorded run fingerprints): resuming "
            "without checking that its algorithm, reward, model and data are this command's."
        )
        log.warning(msg)
        print(msg, flush=True)
        return
    from .config import config_get

    ways = (
        f"Either train in a new directory: {_new_dir_option(config)}, or start fresh in this one: "
        "trainer.resume_mode=disable trainer.overwrite=true (the old checkpoints are moved aside, not deleted)."
    )
    if config_get(config, "trainer.resume_mode") == "resume_path":  # the directory does not pick the checkpoint
        ways = (
            "Point trainer.resume_from_path at a checkpoint of this run, or start a new run from that "
            f"checkpoint's weights: rlplug export {path} --out DIR, then model=path model.path=DIR "
            "trainer.resume_mode=disable."
        )
    try:
        saved = json.loads(file.read_text())
        if not isinstance(saved, dict):
            raise ValueError(f"expected a JSON object, got {type(saved).__name__}")
    except (OSError, ValueError) as exc:
        raise ConfigError(f"Cannot resume from {path}: {file} is unreadable ({exc}). {ways}") from exc
    diffs = fingerprint_diff(saved, run_fingerprint(config))
    if diffs:
        lines = "\n".join(f"  {key}: {_show(old)} -> {_show(new)}" for key, old, new in diffs)
        raise ConfigError(
            f"Cannot resume from {path}: it was written by another run. What differs (checkpoint -> this "
            f"command):\n{lines}\n{ways} To continue the checkpointed run instead, restore the settings above."
        )


def set_aside_checkpoints(manager: CheckpointManager) -> Path | None:
    """Move an earlier run out of the way (``trainer.overwrite=true``): its ``latest`` pointer,
    ``final_model``, its ``metrics.jsonl`` and every ``global_step_N`` directory (complete or partial) go into
    ``<run dir>/overwritten/<YYYYmmdd-HHMMSS>/``, by renames on the same file system; nothing is
    deleted. Prints (and logs) where they went; returns that folder, or None when there was nothing.

    The pointer moves first, so a kill in the middle leaves no pointer naming a checkpoint that is
    gone; running the same command again moves what is left into a folder of its own.
    """
    root = manager.root
    if not root.is_dir():
        return None
    steps = [p for p in sorted(root.iterdir()) if p.is_dir() and p.name.startswith("global_step_")]
    items = [p for p in (root / LATEST, root / FINAL_MODEL, root / METRICS_LOG) if p.exists()] + steps
    if not items:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest, n = root / OVERWRITTEN / stamp, 1
    while dest.exists():
        dest, n = root / OVERWRITTEN / f"{stamp}-{n}", n + 1
    dest.mkdir(parents=True)
    for p in items:
        os.replace(p, dest / p.name)
    _fsync(dest)
    _fsync(root)
    msg = (
        f"trainer.overwrite=true: moved the earlier run in {root} ({', '.join(p.name for p in items)}) "
        f"to {dest}; nothing was deleted."
    )
    log.warning(msg)
    print(msg, flush=True)
    return dest


@dataclass
class RunStart:
    """How a run starts in its directory, decided by :func:`open_run_dir` before any model loads.

    ``resume_from``: the checkpoint to resume from (None: a fresh start); ``set_aside``: the
    directory holds an earlier run that ``trainer.overwrite=true`` moves aside
    (:func:`set_aside_checkpoints`) when training begins (:meth:`begin`).
    """

    manager: CheckpointManager
    resume_from: Path | None = None
    set_aside: bool = False

    def begin(self, is_main: bool = True) -> Path | None:
        """Move the earlier run aside when planned (by the main process only: ``is_main``; the others
        never read the directory on a fresh start) and return :attr:`resume_from`."""
        if self.set_aside and is_main:
            set_aside_checkpoints(self.manager)
            self.set_aside = False
        return self.resume_from


def open_run_dir(config: Any, run_dir: str | Path) -> tuple[CheckpointManager, RunStart]:
    """Create the run directory and decide how the run starts there, before any model loads.

    ``trainer.resume_mode=auto`` (or ``resume_path``): resume from the checkpoint
    :func:`resume_checkpoint` selects (the ``latest`` pointer's), after :func:`check_fingerprint`
    made sure it is this run's. ``trainer.resume_mode=disable`` (a fresh start): when the directory
    already holds complete checkpoints or a ``final_model``, refuse unless ``trainer.overwrite=true``,
    which moves them aside when training begins; a fresh run beside them would mix two runs (its
    step 2 next to the old steps 4 and 6). Returns the :class:`CheckpointManager` (keeping
    ``trainer.max_ckpt_to_keep``) and the :class:`RunStart`.

    Raises :class:`rlplug.config.ConfigError` for another run's checkpoint (the differing keys
    named), for a fresh start in a used directory (the directory, its steps and the ways out named),
    and for a ``trainer.resume_from_path`` that is not a complete checkpoint.
    """
    from .config import ConfigError, config_get

    manager = CheckpointManager(run_dir, config_get(config, "trainer.max_ckpt_to_keep"))
    manager.root.mkdir(parents=True, exist_ok=True)
    trainer = config.trainer
    if trainer.resume_mode != "disable":
        path = resume_checkpoint(trainer, manager)
        if path is not None:
            check_fingerprint(path, config)
        return manager, RunStart(manager, path)
    steps, final = manager.complete_steps(), (manager.root / FINAL_MODEL).exists()
    if not (steps or final):
        return manager, RunStart(manager)
    if config_get(config, "trainer.overwrite"):
        return manager, RunStart(manager, set_aside=True)
    held = " and ".join(
        ([f"complete checkpoints of steps {', '.join(map(str, steps))}"] if steps else [])
        + ([FINAL_MODEL] if final else [])
    )
    latest = manager.latest()  # the pointer's checkpoint: what a resume would continue from
    resume = (
        f", or trainer.resume_mode=auto (resume the earlier run from step {checkpoint_step(latest)})" if latest else ""
    )
    raise ConfigError(
        f"trainer.resume_mode=disable starts a fresh run, but the run directory {manager.root} already holds an "
        f"earlier run: {held}. Starting fresh beside them would mix two runs (a later resume or 'rlplug export' "
        f"could pick up the old checkpoints). Choose one: trainer.overwrite=true (move them aside into "
        f"{manager.root / OVERWRITTEN}/<date>/ and start fresh; nothing is deleted), {_new_dir_option(config)} "
        f"(train in a new directory){resume}."
    )
