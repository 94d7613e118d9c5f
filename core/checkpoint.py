"""Crash-safe checkpoints.

Layout under ``trainer.default_local_dir``::

    global_step_10/                   complete checkpoint (has COMPLETE)
        COMPLETE                      written last inside the directory, then fsync'ed
        backend/                      written by the training backend (weights, optimizer, ...)
        rng_state.pt                  python/numpy/torch RNG states (tensors only)
        hf_meta/                      model config + tokenizer, so the checkpoint exports alone
        trainer_state.json            global step, data loader position, KL controller
        config.yaml                   the run config (for reading; resuming uses the command's)
    latest_checkpointed_iteration.txt the step of the latest complete checkpoint (verl's name)
    global_step_20.partial-1234/      a save that was interrupted: ignored, removed on next save

:func:`save_checkpoint` writes one (files in the order above) and :func:`load_checkpoint` reads
one back; :func:`resume_checkpoint` finds the one ``trainer.resume_mode`` selects. The RNG
capture (:func:`seed_everything`, :func:`rng_state`, :func:`set_rng_state`) lives here too, so
a resumed run draws the same random numbers as an uninterrupted one. Everything is loaded with
``torch.load(weights_only=True)``, JSON or safetensors: nothing is unpickled.

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
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

__all__ = [
    "CheckpointManager",
    "save_checkpoint",
    "load_checkpoint",
    "resume_checkpoint",
    "export_checkpoint",
    "seed_everything",
    "rng_state",
    "set_rng_state",
    "atomic_write_text",
    "LATEST",
    "COMPLETE",
]

LATEST = "latest_checkpointed_iteration.txt"
COMPLETE = "COMPLETE"
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
        """The latest complete checkpoint, or None.

        Trusts the ``latest`` pointer when it names a complete checkpoint; otherwise (pointer
        missing, stale or naming a partial dir) falls back to the highest complete step.
        Partial directories are reported in the log and ignored.
        """
        for p in self.partial_dirs():
            log.warning("Ignoring incomplete checkpoint %s (an interrupted save; removed on the next save)", p)
        steps = self.complete_steps()
        pointer = self.root / LATEST
        if pointer.is_file():
            try:
                step = int(pointer.read_text().strip())
            except ValueError:
                step = -1
            if step in steps and step == steps[-1]:
                return self.step_dir(step)
            if steps:
                log.warning(
                    "Checkpoint pointer %s says %s; using the latest complete checkpoint, step %d",
                    pointer,
                    step,
                    steps[-1],
                )
        return self.step_dir(steps[-1]) if steps else None

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
    the model's ``config.json`` go to ``hf_meta/``; ``config`` (a DictConfig) to ``config.yaml``.
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
            "written by rlplug, or start fresh with trainer.resume_mode=disable."
        ) from exc
    try:
        for name, obj in stateful.items():
            obj.load_state_dict(state[name])
    except (ValueError, KeyError) as exc:
        raise ConfigError(
            f"Cannot resume from {path}: {exc}. The data or KL settings differ from the checkpointed run; "
            "restore them, or start fresh with trainer.resume_mode=disable (or another trainer.default_local_dir)."
        ) from exc
    return int(state["global_step"])


def export_checkpoint(checkpoint: str | Path, out: str | Path) -> Path:
    """Write the actor of ``checkpoint`` (a ``global_step_N`` dir or a run dir) as a HF folder.

    The result loads with ``AutoModelForCausalLM.from_pretrained`` and vLLM.
    Raises ``FileNotFoundError`` when no complete checkpoint is found there, and ``ValueError``
    when the saved weights do not fit the model described by ``hf_meta/config.json`` (missing or
    unexpected tensor names), instead of writing a folder with uninitialised weights.
    """
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    ckpt = Path(checkpoint)
    if not (ckpt / COMPLETE).is_file():
        latest = CheckpointManager(ckpt).latest()
        if latest is None:
            raise FileNotFoundError(
                f"No complete checkpoint at {ckpt}: expected a global_step_N directory containing {COMPLETE}, "
                f"or a run directory that holds one."
            )
        ckpt = latest
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
    return out
