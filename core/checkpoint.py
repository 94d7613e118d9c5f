"""Crash-safe checkpoints.

Layout under ``trainer.default_local_dir``::

    global_step_10/                   complete checkpoint (has COMPLETE)
        COMPLETE                      written last inside the directory, then fsync'ed
        trainer_state.json            step, epoch, data loader position, KL controller, ...
        rng_state.pt                  python/numpy/torch RNG states (tensors only)
        backend/                      written by the training backend (weights, optimizer, ...)
        hf_meta/                      model config + tokenizer, so the checkpoint exports alone
    latest_checkpointed_iteration.txt the step of the latest complete checkpoint (verl's name)
    global_step_20.partial-1234/      a save that was interrupted: ignored, removed on next save

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
import os
import re
import shutil
import signal
import sys
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

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
                log.warning("Checkpoint pointer %s says %s; using the latest complete checkpoint, step %d", pointer, step, steps[-1])
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
        raise FileNotFoundError(f"{weights} is missing: this checkpoint was not written by a backend that rlplug export understands.")
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
