"""Crash-safe checkpoints.

Layout under ``trainer.default_local_dir``::

    global_step_10/                   complete checkpoint (has COMPLETE)
        COMPLETE                      written last inside the directory, then fsync'ed
        backend/                      written by the training backend (weights, optimizer, ...)
        rng_state.pt                  python/numpy/torch RNG states (tensors only)
        hf_meta/                      the source model's files (config, tokenizer, generation config ...)
                                      and source.json, so the checkpoint exports alone (rlplug.run.export)
        trainer_state.json            global step, data loader position, KL controller
        run_fingerprint.json          what makes the run (algorithm, reward, model, data): checked on resume
        config.yaml                   the run config (resuming uses the command's: the settings that differ
                                      are listed, and refused where a resumed run cannot change them)
        checksums.json                size and sha256 of every file above, written after them (before
                                      COMPLETE): verified on resume and by ``rlplug checkpoint verify``
    latest_checkpointed_iteration.txt the step of the latest complete checkpoint (verl's name): resume
                                      and export follow it
    global_step_20.partial-1234/      a save that was interrupted: ignored, removed on next save
    final_model/                      the exported actor of a finished run (written by the trainer)
    overwritten/20250102-030405/      what ``trainer.overwrite=true`` moved aside: the earlier run's
                                      checkpoints, pointer, final_model, metric logs and rollouts/ dumps
                                      (never deleted)
    run.lock                          the live run's OS lock (pid, host, start time): a second run on the
                                      directory is refused (:mod:`rlplug.run.run_lock`)

:func:`save_checkpoint` writes one (files in the order above) and :func:`load_checkpoint` reads
one back; :func:`resume_checkpoint` finds the one ``trainer.resume_mode`` selects, and
:func:`open_run_dir` decides, before any model loads, how a run starts in its directory: it
refuses to resume a checkpoint whose :func:`run_fingerprint` differs from the command's, or with a
setting changed that a resumed run cannot change (:data:`RESUME_FIXED`, :func:`config_changes`), and to
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

Faults survived without losing a finished step (``docs/reliability.md``): a full disk during a save
(``ENOSPC``/``EDQUOT``) removes the partial save and stops the run with
:class:`rlplug.base.exit_codes.DiskFullStopped` (exit code 74), naming the space needed and free; a
checkpoint whose files no longer match its ``checksums.json`` (truncated, bit-flipped, missing) is
reported by name and resume falls back to the previous verified one (:func:`verify_checkpoint`,
:func:`resume_checkpoint`); a second run on a live run's directory is refused before any model
loads (:func:`open_run_dir`, :mod:`rlplug.run.run_lock`).

Testing aid: :func:`_fault_point` (:func:`rlplug.base.faults.fault_point`) marks the places where the kill tests
(``tests/test_kill_resume.py``) stop the process, or where the fault tests
(``tests/test_checkpoint_faults.py``) raise an ``OSError`` such as ``ENOSPC``; it does nothing
unless the environment variable ``RLPLUG_TEST_KILL_AT`` is set.
"""

from __future__ import annotations

import errno
import fnmatch
import hashlib
import itertools
import json
import logging
import math
import os
import pickle
import random
import re
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlplug.base import exit_codes
from rlplug.base.exit_codes import DiskFullStopped
from rlplug.base.faults import FAULT_ENV, fault_counts, fault_point  # noqa: F401 - FAULT_ENV: its old home
from rlplug.base.file_modes import _umask, apply_umask  # noqa: F401 - their old home (rlplug.base.file_modes)
from rlplug.config.run_paths import (  # noqa: F401 - the checkpoint readers' old home (rlplug.config.run_paths)
    COMPLETE,
    DUMP_DIR,
    LATEST,
    TRAINER_STATE_FILE,
    VALIDATION_SAMPLES_FILE,
    checkpoint_step,
    complete_steps,
    experiment_name_for,
    resumed_step,
    tracker_resume_step,
)
from rlplug.config.run_paths import (
    METRICS_FILE as METRICS_LOG,  # the run's own metric log, set aside with the checkpoints
)
from rlplug.config.run_paths import STEP_DIR_PATTERN as _STEP_DIR
from rlplug.config.schema import ConfigError, RunConfig, TrainerConfig, config_get, typed
from rlplug.run.run_lock import _is_rank_zero, acquire_run_lock

log = logging.getLogger(__name__)

__all__ = [
    "CheckpointManager",
    "CheckpointReport",
    "verify_checkpoint",
    "verify_run",
    "verify_summary",
    "write_checksums",
    "save_checkpoint",
    "load_checkpoint",
    "resume_checkpoint",
    "apply_umask",
    "find_checkpoint",
    "checkpoint_step",
    "run_fingerprint",
    "fingerprint_diff",
    "check_fingerprint",
    "config_changes",
    "read_saved_config",
    "refused_changes",
    "format_changes",
    "describe_change",
    "RESUME_FIXED",
    "RESUME_FREE",
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

#: size and sha256 of every file of a checkpoint (:func:`write_checksums`), written just before COMPLETE
CHECKSUMS = "checksums.json"
#: the exported model of a finished run, in the run directory
FINAL_MODEL = "final_model"
#: where ``trainer.overwrite=true`` moves an earlier run's checkpoints (a dated folder inside)
OVERWRITTEN = "overwritten"
#: a checkpoint a resume found corrupt and renamed (:meth:`CheckpointManager.set_corrupt_aside`)
_CORRUPT_DIR = re.compile(r"^global_step_(\d+)\.corrupt-")


# ============================================================================ testing aid

#: this module's count of each fault label reached (the same dict as :data:`rlplug.base.faults.fault_counts`;
#: the tests reset it here)
_fault_counts: dict[str, int] = fault_counts


def _fault_point(label: str) -> None:
    """:func:`rlplug.base.faults.fault_point` (the crash tests' hook) under its old name, counting in
    :data:`_fault_counts` (so tests that replace that dict or this function keep working)."""
    fault_point(label, counts=_fault_counts)


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


def _tree_size(root: Path) -> int:
    """Bytes in the regular files under ``root`` (0 when it is missing)."""
    total = 0
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


#: what the writers say when the disk is full: ``OSError``'s text, safetensors' ``(os error 28)``
_NO_SPACE_TEXT = ("No space left on device", "Disk quota exceeded", "os error 28", "os error 122")
#: below this many free bytes, a failed write is taken for a full disk whatever it says: torch.save
#: reports ENOSPC as ``RuntimeError: [enforce fail at inline_container.cc:...] unexpected pos ...``
_NEARLY_FULL = 64 << 20


def _writer_error(exc: BaseException) -> bool:
    """Whether ``exc`` is of a type the checkpoint writers raise for a failed write: ``OSError``,
    ``RuntimeError`` (torch.save, safetensors' ``save_file``) or safetensors' ``SafetensorError``."""
    return isinstance(exc, (OSError, RuntimeError)) or type(exc).__name__ == "SafetensorError"


def _out_of_space(exc: BaseException, root: Path) -> bool:
    """Whether ``exc``, raised while writing a checkpoint under ``root``, means the disk (or quota)
    is full: an ``OSError`` ``ENOSPC``/``EDQUOT`` in its chain, a message saying so (safetensors:
    ``I/O error: No space left on device (os error 28)``), or a writer's error (:func:`_writer_error`:
    ``OSError``, ``RuntimeError``, ``SafetensorError``) while the file system has less than 64 MiB free
    (torch.save's message names no errno). Any other error (a ``TypeError`` in a plugin's save, ...)
    is never taken for a full disk: it is re-raised as it is, whatever the free space."""
    seen: BaseException | None = exc
    for _ in range(8):  # the exception chain: __cause__, else __context__
        if seen is None:
            break
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(seen) for text in _NO_SPACE_TEXT):
            return True
        seen = seen.__cause__ or seen.__context__
    if not _writer_error(exc):
        return False
    try:
        return shutil.disk_usage(root).free < _NEARLY_FULL
    except OSError:
        return False


def _human(n: int) -> str:
    """``n`` bytes for a message: ``1.23 GB (1234567890 bytes)``."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit} ({n} bytes)"
    return f"{n} bytes"


# ============================================================================ checksums

_HASH_CHUNK = 8 << 20  # 8 MiB reads: constant memory for files of any size


def _sha256(path: Path) -> str:
    """The sha256 hex digest of the file ``path``, read in 8 MiB chunks (hashlib releases the GIL,
    so several files hash in parallel threads)."""
    h = hashlib.sha256()
    buf = bytearray(_HASH_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _checkpoint_files(root: Path) -> Iterator[str]:
    """The files of checkpoint directory ``root`` the checksums cover: every regular file, as a path
    relative to ``root`` with ``/`` separators, except COMPLETE and ``checksums.json`` themselves."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            full = Path(dirpath) / name
            rel = full.relative_to(root).as_posix()
            if rel in (COMPLETE, CHECKSUMS) or full.is_symlink():
                continue
            yield rel


def _hash_files(root: Path, rels: list[str]) -> dict[str, str]:
    """``{rel: sha256}`` of the files ``rels`` under ``root``, hashed by up to 4 threads."""
    workers = max(1, min(4, os.cpu_count() or 1, len(rels)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(zip(rels, pool.map(lambda rel: _sha256(root / rel), rels)))


def write_checksums(directory: Path) -> Path:
    """Write ``directory/checksums.json``: the size (bytes) and sha256 of every file of the checkpoint
    in ``directory`` (``{"algorithm": "sha256", "files": {"backend/actor/model.safetensors": {"size": n,
    "sha256": "..."}, ...}}``, paths relative to ``directory``), fsync'ed. Returns its path.

    :meth:`CheckpointManager.save` calls it after every file is written and fsync'ed and before
    COMPLETE, so a complete checkpoint always has one. Cost: one read of every file, in 8 MiB chunks
    by up to 4 threads (the files were just written, so they are read from the page cache); a
    540 MB file (a 135M-parameter model in fp32) takes 0.6-0.8 s of CPU time on this project's test
    machine (``docs/reliability.md``). Raises ``OSError`` as reading or writing does.
    """
    rels = list(_checkpoint_files(directory))
    digests = _hash_files(directory, rels)
    files = {rel: {"size": (directory / rel).stat().st_size, "sha256": digests[rel]} for rel in rels}
    out = directory / CHECKSUMS
    with open(out, "w") as f:
        f.write(json.dumps({"algorithm": "sha256", "files": files}, indent=1, sort_keys=True))
        f.flush()
        os.fsync(f.fileno())
    return out


@dataclass
class CheckpointReport:
    """What :func:`verify_checkpoint` found in one checkpoint directory.

    ``problems``: one entry per bad file, ``"<relative path>: <what is wrong>"`` (empty: ok);
    ``checked``: how many files were checked; ``method``: ``"sha256"`` (against ``checksums.json``)
    or ``"structure"`` (a checkpoint written before rlplug recorded checksums: only the safetensors
    files' headers and sizes are checked); ``note``: a remark to show with the result."""

    path: Path
    problems: list[str] = field(default_factory=list)
    checked: int = 0
    method: str = "sha256"
    note: str = ""

    @property
    def ok(self) -> bool:
        return not self.problems

    def line(self) -> str:
        """One line for ``rlplug checkpoint verify``: ``global_step_4: ok (9 files, sha256)`` or
        ``global_step_4: corrupt: backend/actor/model.safetensors (truncated: ...)``."""
        if self.ok:
            return f"{self.path.name}: ok ({self.checked} files, {self.method}){'; ' + self.note if self.note else ''}"
        first, *rest = self.problems
        name, _, why = first.partition(": ")
        more = f"; and {len(rest)} more: {'; '.join(rest)}" if rest else ""
        return f"{self.path.name}: corrupt: {name} ({why}){more}"


def _safetensors_problem(path: Path) -> str | None:
    """Why the safetensors file ``path`` cannot be whole, from its own header (the 8-byte header
    length, the JSON header, the end of the last tensor's data = the file size), or None."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"truncated: {size} bytes, shorter than the 8-byte header length"
            n = int.from_bytes(head, "little")
            if n > size - 8:
                return f"truncated: {size} bytes, its header alone claims {n + 8}"
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        return f"unreadable safetensors header ({exc})"
    ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    expected = 8 + n + max(ends, default=0)
    if size != expected:
        return f"{'truncated' if size < expected else 'too long'}: {size} bytes, its header says {expected}"
    return None


#: verification results by checkpoint, keyed by the files' (name, size, mtime, inode): a process that
#: verifies the same unchanged checkpoint again (``rlplug checkpoint verify`` after a resume, a test) hashes
#: each file once
_VERIFIED: dict[tuple, CheckpointReport] = {}


def _stat_key(path: Path) -> tuple:
    items = []
    for dirpath, _dirnames, filenames in os.walk(path):
        for name in filenames:
            try:
                st = os.stat(os.path.join(dirpath, name))
            except OSError:
                continue
            items.append((os.path.join(dirpath, name), st.st_size, st.st_mtime_ns, st.st_ino))
    return (str(path.resolve()), tuple(sorted(items)))


def verify_checkpoint(path: str | Path) -> CheckpointReport:
    """Check that the complete checkpoint ``path`` (a ``global_step_N`` directory) holds the files it
    was saved with: every file in its ``checksums.json`` exists with the recorded size and sha256.

    A file that is missing, shorter or longer (truncated), or whose sha256 differs (a flipped bit) is
    one entry of :attr:`CheckpointReport.problems`, e.g. ``backend/actor/model.safetensors: truncated:
    1000 of 12732320 bytes``. A COMPLETE that names ``checksums.json`` with the file missing or
    unreadable is a problem too. A checkpoint without checksums (COMPLETE naming none: written before
    rlplug recorded them) is checked by structure only: each ``*.safetensors`` file's size must be
    what its header says (this catches truncation, not flipped bits); ``note`` says so. Cost: one
    read of every file (see :func:`write_checksums`); results are cached per file sizes and times.
    """
    path = Path(path)
    key = _stat_key(path)
    cached = _VERIFIED.get(key)
    if cached is not None:
        return cached
    report = CheckpointReport(path)
    try:
        marker = json.loads((path / COMPLETE).read_text() or "{}")
    except (OSError, ValueError):
        marker = {}
    manifest = path / CHECKSUMS
    if not (isinstance(marker, dict) and marker.get("checksums")) and not manifest.is_file():
        report.method = "structure"
        report.note = f"no {CHECKSUMS} (saved before rlplug recorded checksums): safetensors sizes checked only"
        for rel in _checkpoint_files(path):
            if rel.endswith(".safetensors"):
                report.checked += 1
                problem = _safetensors_problem(path / rel)
                if problem:
                    report.problems.append(f"{rel}: {problem}")
        _VERIFIED[key] = report
        return report
    try:
        files = json.loads(manifest.read_text())["files"]
        if not isinstance(files, dict):
            raise ValueError("'files' is not an object")
    except FileNotFoundError:
        report.problems.append(f"{CHECKSUMS}: missing (COMPLETE says the checkpoint has one)")
        return report
    except (OSError, ValueError, KeyError, TypeError) as exc:
        report.problems.append(f"{CHECKSUMS}: unreadable ({exc})")
        return report
    present = []
    for rel, entry in sorted(files.items()):
        report.checked += 1
        f = path / rel
        if not f.is_file():
            report.problems.append(f"{rel}: missing")
            continue
        size, want = f.stat().st_size, int(entry["size"])
        if size != want:
            report.problems.append(f"{rel}: {'truncated' if size < want else 'too long'}: {size} of {want} bytes")
            continue
        present.append(rel)
    digests = _hash_files(path, present)
    for rel in present:
        if digests[rel] != files[rel]["sha256"]:
            report.problems.append(f"{rel}: sha256 differs from {CHECKSUMS} (the content changed: a flipped bit?)")
    report.problems.sort()
    _VERIFIED[key] = report
    return report


def verify_run(path: str | Path) -> tuple[list[CheckpointReport], list[Path]]:
    """Verify every complete checkpoint of a run (:func:`verify_checkpoint`): ``path`` is a run
    directory (each ``global_step_N`` with COMPLETE, ascending) or one checkpoint directory.
    Returns the reports and the partial directories (interrupted saves, never resumed) beside them.

    Raises ``FileNotFoundError`` when ``path`` holds no complete checkpoint.
    """
    path = Path(path)
    if (path / COMPLETE).is_file():
        return [verify_checkpoint(path)], []
    manager = CheckpointManager(path)
    steps = manager.complete_steps()
    if not steps:
        raise FileNotFoundError(
            f"No complete checkpoint at {path}: expected a global_step_N directory containing {COMPLETE}, "
            "or a run directory that holds one."
        )
    return [verify_checkpoint(manager.step_dir(s)) for s in steps], manager.partial_dirs()


def verify_summary(path: str | Path) -> tuple[list[str], int]:
    """``rlplug checkpoint verify PATH``: one line per checkpoint (:meth:`CheckpointReport.line`; the
    one the ``latest`` pointer names is marked ``[latest]``), one per partial directory (ignored by
    resume), and the exit code: 0 when every checkpoint is intact, 1 when one is corrupt.

    Raises ``FileNotFoundError`` (exit code 2 in the CLI) when ``path`` holds no complete checkpoint.
    """
    path = Path(path)
    reports, partial = verify_run(path)
    pointed = CheckpointManager(path)._pointed_step() if len(reports) > 1 or not (path / COMPLETE).is_file() else None
    lines = [
        r.line() + (" [latest]" if pointed is not None and r.path.name == f"global_step_{pointed}" else "")
        for r in reports
    ]
    lines += [
        f"{p.name}: incomplete (an interrupted save; ignored by resume, removed by the next save)" for p in partial
    ]
    if not (path / COMPLETE).is_file():
        lines += [
            f"{p.name}: set aside as corrupt by a resume (never resumed or removed; delete it once inspected)"
            for p in CheckpointManager(path).corrupt_dirs()
        ]
    bad = [r for r in reports if not r.ok]
    if bad:
        lines.append(
            f"{len(bad)} of {len(reports)} checkpoints are corrupt; a resume (trainer.resume_mode=auto) falls back to "
            "the newest intact one before the latest pointer's."
        )
    return lines, 0 if not bad else 1


class CheckpointManager:
    """Saves and finds checkpoints under ``root``; keeps at most ``max_to_keep`` (None: all).

    ``lock``: the run directory's :class:`rlplug.run.run_lock.RunLock` when :func:`open_run_dir` took
    it (None otherwise); :meth:`close` releases it."""

    def __init__(self, root: str | Path, max_to_keep: int | None = None) -> None:
        self.root = Path(root)
        self.max_to_keep = max_to_keep
        self.lock: Any = None

    def close(self) -> None:
        """Release the run directory's lock (:mod:`rlplug.run.run_lock`), if this manager holds it; idempotent."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def step_dir(self, step: int) -> Path:
        return self.root / f"global_step_{step}"

    def complete_steps(self) -> list[int]:
        """Steps of complete checkpoints, ascending (:func:`rlplug.config.run_paths.complete_steps`)."""
        return complete_steps(self.root)

    def corrupt_dirs(self) -> list[Path]:
        """Checkpoints a resume found corrupt and renamed (``global_step_N.corrupt-*``,
        :meth:`set_corrupt_aside`), sorted: never resumed, exported or removed by the cleanup."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.is_dir() and _CORRUPT_DIR.match(p.name))

    def set_corrupt_aside(self, path: Path) -> Path:
        """Rename the corrupt checkpoint ``path`` (a ``global_step_N`` directory of this run) to
        ``global_step_N.corrupt-<YYYYmmdd-HHMMSS>-<pid>`` beside it and return the new path, so that
        neither :meth:`latest` nor :meth:`complete_steps` sees it (a later ``max_ckpt_to_keep`` cleanup
        would otherwise count it as complete and delete an intact older one instead); nothing is deleted."""
        base = self.root / f"{path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        dest, n = base, 1
        while dest.exists():
            dest, n = base.with_name(f"{base.name}-{n}"), n + 1
        os.replace(path, dest)
        _fsync(self.root)
        return dest

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

        After ``write``, every file gets its size and sha256 in ``checksums.json``
        (:func:`write_checksums`), then COMPLETE is written. Raises whatever ``write`` raises; in that
        case nothing but a partial dir is left behind, and the previous checkpoint stays the latest.
        A full disk (``OSError`` ``ENOSPC`` or ``EDQUOT`` while writing, hashing or marking) removes
        the partial dir and raises :class:`rlplug.base.exit_codes.DiskFullStopped` (exit code 74), whose
        message names the space needed (the size of the previous checkpoint; without one, what was
        written before the error, as a lower bound), the space free and the checkpoint to resume from.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.step_dir(step)
        tmp = self.root / f"global_step_{step}.partial-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        try:
            tmp.mkdir(parents=True)
            _fault_point("ckpt_tmp_created")
            write(tmp)
            apply_umask(tmp)  # safetensors writes its files 0600: model files follow the umask
            _fault_point("ckpt_written")
            _fsync_tree(tmp)
            write_checksums(tmp)
            _fault_point("ckpt_checksums")
            marker = tmp / COMPLETE
            with open(marker, "w") as f:
                f.write(json.dumps({"step": step, "checksums": CHECKSUMS}))
                f.flush()
                os.fsync(f.fileno())
            _fsync(tmp)
        except Exception as exc:
            if not _out_of_space(exc, self.root):
                raise
            raise self._disk_full(step, tmp, exc) from exc
        _fault_point("ckpt_marked")
        if final.exists():  # an older save of the same step (e.g. after resume_path): move it aside first
            self._discard(final)
            _fault_point("ckpt_old_moved")
        os.replace(tmp, final)
        _fsync(self.root)
        _fault_point("ckpt_renamed")
        try:
            atomic_write_text(self.root / LATEST, str(step))
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise self._pointer_not_updated(step, exc) from exc
        _fault_point("ckpt_pointer")
        self._cleanup(keep=final)
        return final

    def _disk_full(self, step: int, tmp: Path, exc: BaseException) -> Exception:
        """Remove the partial save ``tmp`` of ``step`` after ``exc`` (no space) and build the
        :class:`rlplug.base.exit_codes.DiskFullStopped` to raise, with the sizes in its message."""

        written = _tree_size(tmp)
        shutil.rmtree(tmp, ignore_errors=True)  # frees what it held; a partial dir is never resumed anyway
        _fsync(self.root)
        previous = self._pointed_step()
        if previous is not None:
            needed = _tree_size(self.step_dir(previous))
            estimate = f"about {_human(needed)} (the size of the previous checkpoint, step {previous})"
            kept = (
                f"The previous checkpoint, step {previous} ({self.step_dir(previous)}), is complete and "
                f"{LATEST} names it: nothing saved is lost. "
            )
            resume = f"rerun the same command to resume from step {previous}"
        else:
            estimate = f"more than {_human(written)} (what was written before the disk filled up)"
            kept = "There is no earlier checkpoint of this run. "
            resume = "rerun the same command"
        try:
            free = _human(shutil.disk_usage(self.root).free)
        except OSError:
            free = "unknown"
        code = exc.errno if isinstance(exc, OSError) else None
        if isinstance(exc, OSError) and code is not None and code in errno.errorcode:
            error = f"{exc.strerror} ({errno.errorcode[code]})"
        else:  # a writer's own error (safetensors, torch.save) on a full disk
            error = f"{type(exc).__name__}: {exc}"
        return DiskFullStopped(
            f"Cannot write the checkpoint of step {step} in {self.root}: {error}. A checkpoint needs {estimate}; "
            f"{free} is free on that file system. The partial save was removed. {kept}Free space there (or lower "
            f"trainer.max_ckpt_to_keep: old checkpoints are removed only after a new one is complete), then {resume}."
        )

    def _pointer_not_updated(self, step: int, exc: OSError) -> Exception:
        """The :class:`rlplug.base.exit_codes.DiskFullStopped` for a full disk while replacing the
        ``latest`` pointer after checkpoint ``step`` was renamed into place (it is complete)."""

        for p in self.root.glob(f".{LATEST}.tmp-*"):
            p.unlink(missing_ok=True)
        try:
            free = _human(shutil.disk_usage(self.root).free)
        except OSError:
            free = "unknown"
        pointed = (self.root / LATEST).read_text().strip() if (self.root / LATEST).is_file() else None
        return DiskFullStopped(
            f"The checkpoint of step {step} is complete in {self.step_dir(step)}, but the file system of {self.root} "
            f"ran out of space ({exc.strerror or exc}; {free} free) while {LATEST} was being updated: it still names "
            f"{'step ' + pointed if pointed else 'no step'}, so a resume continues from there "
            f"(or pass trainer.resume_mode=resume_path trainer.resume_from_path={self.step_dir(step)}). Free space, "
            "then rerun the same command."
        )

    def _pointed_step(self) -> int | None:
        """The step :meth:`latest` would return, found quietly (no warnings), or None."""
        steps = self.complete_steps()
        try:
            step = int((self.root / LATEST).read_text().strip())
        except (OSError, ValueError):
            step = -1
        return step if step in steps else (steps[-1] if steps else None)

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
    import numpy as np  # deferred: numpy
    import torch  # deferred: torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """The global RNG states (Python, NumPy, torch CPU) as tensors and plain types, loadable with
    ``torch.load(weights_only=True)``; :func:`set_rng_state` restores them."""
    import numpy as np  # deferred: numpy
    import torch  # deferred: torch

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
    import numpy as np  # deferred: numpy
    import torch  # deferred: torch

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
    TRAINER_STATE_FILE,
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

    ``backend`` writes ``backend/`` (:meth:`rlplug.contracts.types.TrainingBackend.save`); ``stateful``
    maps names to objects with ``state_dict()`` (JSON-serialisable; the trainer passes its data
    loader and KL controller), saved with ``step`` in ``trainer_state.json``; ``tokenizer`` and
    the model's ``config.json`` go to ``hf_meta/``; ``config`` (a DictConfig) to ``config.yaml``, and
    its :func:`run_fingerprint` to ``run_fingerprint.json``.
    """
    import torch  # deferred: torch

    backend.save(directory / BACKEND_DIR)
    _fault_point("ckpt_backend")
    torch.save(rng_state(), directory / RNG_FILE)
    _fault_point("ckpt_rng")
    from rlplug.training.model_files import write_hf_meta  # deferred: it imports torch

    meta = directory / META_DIR
    meta.mkdir()
    write_hf_meta(meta, model_path, tokenizer)  # the tokenizer, then the source's own files byte for byte
    _fault_point("ckpt_meta")
    state = {"global_step": step, **{name: obj.state_dict() for name, obj in stateful.items()}}
    (directory / STATE_FILE).write_text(json.dumps(state, indent=1))
    _fault_point("ckpt_state")
    (directory / FINGERPRINT_FILE).write_text(json.dumps(run_fingerprint(config), indent=1, sort_keys=True))
    (directory / CONFIG_FILE).write_text(OmegaConf.to_yaml(config))


def save_checkpoint(manager: CheckpointManager, step: int, *, backend: Any, coordinator: Any, **files: Any) -> Path:
    """Save checkpoint ``step`` crash-safely (:meth:`CheckpointManager.save` around
    :func:`write_checkpoint`, which takes ``files``) and return its path, on every process.

    ``coordinator`` (:class:`rlplug.contracts.types.Coordinator`): the main process owns the directory and
    writes everything; it broadcasts the partial directory's path so every other process writes
    its shards of ``backend/`` there, then the final path. Every process must call this. When the
    main process's save fails (e.g. :class:`rlplug.base.exit_codes.DiskFullStopped`), it broadcasts the
    failure in place of the next path and every other process raises the same error (a
    :class:`rlplug.base.exit_codes.TrainingStopped` of the same class, else ``RuntimeError``) instead of
    waiting for a path that never comes.

    ``backend.save`` is a collective of its own and must raise on every process when any process's
    part failed (the ``fsdp2`` backend agrees on the outcome before it returns): then the main process
    turns its error into the run's (a full disk: ``DiskFullStopped``) and broadcasts it, and the others,
    whose ``backend.save`` raised too, wait for that broadcast and raise the same error.
    """
    if not coordinator.is_main:
        tmp = Path(_received_path(coordinator.broadcast(None)))
        try:
            backend.save(tmp / BACKEND_DIR)
        except Exception:
            _received_path(coordinator.broadcast(None))  # the main process's verdict: raises it (DiskFullStopped ...)
            raise
        return Path(_received_path(coordinator.broadcast(None)))

    sent = 0

    def write(tmp: Path) -> None:
        nonlocal sent
        coordinator.broadcast(str(tmp))  # the other processes write their shards into the same folder
        sent = 1
        write_checkpoint(tmp, step=step, backend=backend, **files)

    try:
        path = manager.save(step, write)
    except Exception as exc:
        if getattr(coordinator, "world_size", 1) > 1:
            failure = {"save_failed": str(exc), "type": type(exc).__name__}
            for _ in range(2 - sent):  # what the other processes still wait for: both paths, or the final one
                coordinator.broadcast(failure)
        raise
    coordinator.broadcast(str(path))
    return path


def _received_path(msg: Any) -> str:
    """A path broadcast by the main process's :func:`save_checkpoint`, or raise the failure it sent."""
    if isinstance(msg, dict) and "save_failed" in msg:
        cls = getattr(exit_codes, str(msg.get("type")), None)
        if isinstance(cls, type) and issubclass(cls, exit_codes.TrainingStopped):
            raise cls(msg["save_failed"])
        raise RuntimeError(f"The main process failed to save the checkpoint: {msg['save_failed']}")
    return str(msg)


def resume_checkpoint(trainer_config: Any, manager: CheckpointManager) -> Path | None:
    """The checkpoint ``trainer.resume_mode`` selects: ``None`` for ``disable`` (or when ``auto``
    finds none), ``trainer.resume_from_path`` for ``resume_path``, else the latest complete one
    that passes :func:`verify_checkpoint`.

    ``auto``: the ``latest`` pointer's checkpoint (:meth:`CheckpointManager.latest`) is verified
    against its ``checksums.json``; when a file is missing, truncated or changed, a warning naming
    the file is logged and printed and the previous complete checkpoints are tried, newest first,
    until one verifies. Each broken one is renamed ``global_step_N.corrupt-<date>-<pid>``
    (:meth:`CheckpointManager.set_corrupt_aside`: kept for inspection, never resumed, exported or
    removed by ``trainer.max_ckpt_to_keep``, listed by ``rlplug checkpoint verify``) and the ``latest``
    pointer is set to the one resumed from. Only the process that owns the run directory calls this
    (:func:`open_run_dir`: rank 0 of a torchrun job). Raises :class:`rlplug.config.schema.ConfigError` when the selected directory is not a
    complete checkpoint (no COMPLETE marker), when ``resume_path``'s checkpoint fails verification,
    and when no complete checkpoint of the run verifies (each one's problem named).
    """

    mode = trainer_config.resume_mode
    if mode == "disable":
        return None
    path = Path(str(trainer_config.resume_from_path)) if mode == "resume_path" else manager.latest()
    if path is not None and not (path / COMPLETE).is_file():
        raise ConfigError(f"trainer.resume_from_path={path} is not a complete checkpoint (no COMPLETE marker).")
    if path is None:
        return None
    report = verify_checkpoint(path)
    if report.note:
        log.info("%s: %s", path, report.note)
    if report.ok:
        return path
    if mode == "resume_path":
        raise ConfigError(
            f"trainer.resume_from_path={path} is corrupt: {'; '.join(report.problems)}. Point it at another "
            f"checkpoint (rlplug checkpoint verify {path.parent} lists which are intact), or restore the file."
        )
    return _fall_back(manager, path, report)


def _fall_back(manager: CheckpointManager, path: Path, report: CheckpointReport) -> Path:
    """The newest complete checkpoint before ``path`` (which failed ``report``) that verifies, with
    a printed and logged warning for each one that does not; raises ConfigError when none does."""

    failed: list[CheckpointReport] = []
    m = _STEP_DIR.match(path.name)
    step = int(m.group(1)) if m else checkpoint_step(path)
    candidates = [manager.step_dir(s) for s in reversed(manager.complete_steps()) if step is None or s < step]
    for got in itertools.chain([report], map(verify_checkpoint, candidates)):  # lazily: stop at the first intact
        if got.ok:
            for bad in failed:  # only now: when none verifies, nothing is renamed and the error names them all
                aside = manager.set_corrupt_aside(bad.path)
                msg = f"WARNING: renamed the corrupt checkpoint {bad.path} to {aside.name} (kept for inspection)."
                log.warning(msg)
                print(msg, flush=True)
            good = checkpoint_step(got.path)
            if failed and _STEP_DIR.match(got.path.name):  # the pointer names the checkpoint resumed from
                atomic_write_text(manager.root / LATEST, got.path.name.removeprefix("global_step_"))
            msg = f"WARNING: resuming from the previous intact checkpoint, {got.path} (step {good})."
            log.warning(msg)
            print(msg, flush=True)
            return got.path
        failed.append(got)
        msg = f"WARNING: checkpoint {got.path} is corrupt: {'; '.join(got.problems)}."
        log.warning(msg)
        print(msg, flush=True)
    lines = "\n".join(f"  {r.path}: {'; '.join(r.problems)}" for r in failed)
    raise ConfigError(
        f"No intact checkpoint to resume from in {manager.root}: every complete checkpoint failed verification:\n"
        f"{lines}\nRestore the files, or start fresh: trainer.resume_mode=disable trainer.overwrite=true (the "
        "checkpoints are moved aside, not deleted)."
    )


def load_checkpoint(path: Path, *, backend: Any, stateful: Mapping[str, Any]) -> int:
    """Restore the checkpoint at ``path`` written by :func:`write_checkpoint`: the backend's state,
    the RNG states and each ``stateful`` object's ``load_state_dict``; returns its global step.

    Raises :class:`rlplug.config.schema.ConfigError` when a file holds pickled objects other than tensors
    and plain containers (nothing is unpickled), when the backend's load raises ``ValueError`` or
    ``FileNotFoundError`` (its files do not fit this run's model: other LoRA settings, a moved or
    changed base), or when a ``stateful`` object rejects its state (the data or KL settings differ
    from the checkpointed run).
    """
    import torch  # deferred: torch

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
    except (ValueError, FileNotFoundError) as exc:  # e.g. rlplug.training.lora: adapters of another shape, a moved base
        raise ConfigError(
            f"Cannot resume from {path}: the training backend cannot load its {BACKEND_DIR}/ ({str(exc).rstrip('.')}). "
            "The model settings (model.*, critic.model.*: the LoRA rank, alpha, target modules, the base model "
            "folder) must be the checkpointed run's; restore them, or start fresh with trainer.resume_mode=disable "
            "trainer.overwrite=true (the old checkpoints are moved aside), or train in another directory "
            "(trainer.experiment_name or trainer.default_local_dir)."
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


# ============================================================================ run identity


def _plain(value: Any) -> Any:
    """OmegaConf containers as plain (resolved) dicts and lists; other values unchanged."""

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


def _lora_key(get: Callable[[str], Any], section: str) -> dict[str, Any] | None:
    """``model.lora`` / ``critic.model.lora`` in :func:`run_fingerprint`: ``lora_rank``, ``lora_alpha``,
    ``target_modules`` and ``exclude_modules`` of ``section`` when its ``lora_rank`` > 0 (the checkpoint holds
    adapters of that shape on that base), else None (full fine-tuning)."""
    rank = get(f"{section}.lora_rank") or 0
    if not rank:
        return None
    return {
        "lora_rank": rank,
        "lora_alpha": get(f"{section}.lora_alpha"),
        "target_modules": get(f"{section}.target_modules"),
        "exclude_modules": get(f"{section}.exclude_modules"),
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
      it (it is checkpointed state, :class:`rlplug.run.schedule.Schedule`);
    * reward: ``reward.reward_fn_map`` (data source -> function), ``reward.default``, ``reward.kwargs``,
      ``reward.shaping`` (each entry's name, weight and kwargs), ``reward.normalize.enable`` and, when
      its ``path`` is set, ``reward.custom_reward_function`` (absolute path, name, reward_kwargs);
    * model: ``model.source``, ``model.path`` (absolute) and ``model.tiny`` (only for ``source=tiny``);
      ``critic.model`` (``source``, absolute ``path``, ``tiny`` only for ``source=tiny``; ``None`` when
      neither ``path`` nor ``source`` is set: the critic starts from the actor's model); ``model.lora`` and
      ``critic.model.lora`` (``lora_rank``, ``lora_alpha``, ``target_modules``, ``exclude_modules``; ``None``
      without LoRA): a checkpoint's adapters fit only the LoRA settings they were trained with;
    * data: ``data.train_files`` (absolute paths) or, for generated data (no files), ``data.task``,
      ``data.train_size``, ``data.test_size``, ``data.data_seed``, ``data.task_kwargs`` and
      ``data.instruction``; ``data.system_prompt`` (it changes every prompt).

    Left out on purpose, because changing them between a stop and a resume does not make another
    run: the length and rhythm of training (``trainer.total_training_steps``, ``total_epochs``,
    ``save_freq``, ``test_freq``, ``max_wall_time_s``), logging, devices, threads and memory-only
    sizes (micro-batches, chunks), and numeric coefficients one may tune on purpose (learning
    rates, clip ratios, KL and entropy coefficients, ``gamma``, ``lam``): a resume applies and lists
    them. Some settings that do not make another run cannot change on resume all the same (the batch
    size, ``rollout.n``, the seed, ``model.*``, the backend: :data:`RESUME_FIXED`, refused by
    :func:`check_fingerprint` from the saved ``config.yaml``); the data order is also checked by the
    data loader's own state (:func:`load_checkpoint`). Keys missing from ``config`` (e.g. a partial test
    config) read as ``None``.
    """

    def get(key: str) -> Any:
        # free-form: the fingerprint records what the config holds (missing or null: None), not the schema default
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
        "model.lora": _lora_key(get, "model"),
        "critic.model.lora": _lora_key(get, "critic.model"),
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


# ============================================================================ settings changed on resume

#: settings a resumed run cannot change, beside the run fingerprint's (:func:`run_fingerprint`), as
#: (:mod:`fnmatch` pattern, why); :func:`check_fingerprint` refuses a change of any of them before any model loads
RESUME_FIXED: tuple[tuple[str, str], ...] = (
    (
        "data.train_batch_size",
        "the data loader's position and the learning-rate schedule's length are counted in batches of this size",
    ),
    (
        "rollout.n",
        "it sets the group of responses every prompt gets (the groups of group-based estimators, the number of "
        "responses per step); to change it during a run, declare rollout.n_schedule from the start",
    ),
    ("trainer.seed", "every step's sampling seed and the checkpointed random states follow from it"),
    ("trainer.backend", "the checkpoint's backend/ folder is in its training backend's own format"),
    ("model.*", "the checkpoint's weights and optimizer states belong to this model as configured"),
    ("algorithm.kl_ctrl.type", "the KL controller's checkpointed state is of this type"),
    ("data.seed", "the data loader's order follows from it"),
    ("data.shuffle", "the data loader's order follows from it"),
    ("data.train_weights", "the data loader's mix and position follow from it"),
)
#: keys matched by :data:`RESUME_FIXED` that a resume may change all the same: how the model is computed
#: (memory, attention kernel), not what it is
RESUME_FREE: tuple[str, ...] = ("model.enable_gradient_checkpointing", "model.attn_implementation")
#: keys that say how this start finds its checkpoint, not what the run trains: never listed as changes
START_KEYS: tuple[str, ...] = ("trainer.resume_mode", "trainer.resume_from_path", "trainer.overwrite")


def _config_container(config: Any) -> dict[str, Any]:
    """``config`` (a DictConfig, or a mapping) as plain, resolved, JSON-like containers; interpolations that do
    not resolve stay as written."""

    if not isinstance(config, DictConfig):
        config = OmegaConf.create(dict(config))
    try:
        out = OmegaConf.to_container(config, resolve=True)
    except OmegaConfBaseException:
        out = OmegaConf.to_container(config, resolve=False)
    return json.loads(json.dumps(out, default=str))


def _ordered_diff(key: str, a: Any, b: Any, out: list[tuple[str, Any, Any]]) -> None:
    """:func:`_diff` with the keys of nested mappings in ``b``'s order, then those only ``a`` has."""
    if a == b:
        return
    if isinstance(a, dict) and isinstance(b, dict):
        for k in [*b, *(k for k in a if k not in b)]:
            _ordered_diff(f"{key}.{k}" if key else str(k), a.get(k, _UNSET), b.get(k, _UNSET), out)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and any(isinstance(x, dict) for x in a):
        for i, (x, y) in enumerate(zip(a, b)):  # lists of mappings (trainer.alerts, reward.shaping) entry by entry
            _ordered_diff(f"{key}[{i}]", x, y, out)
    else:
        out.append((key, a, b))


def read_saved_config(path: Path) -> dict[str, Any] | None:
    """The run config saved in the checkpoint ``path`` (its ``config.yaml``) as plain resolved containers, or
    None when it has none or it is unreadable (a checkpoint of an older rlplug, a damaged file)."""

    file = Path(path) / CONFIG_FILE
    try:
        loaded = OmegaConf.load(file)
    except (OSError, ValueError, OmegaConfBaseException) as exc:
        if file.exists():
            log.warning("%s is unreadable (%s): the settings changed since the checkpoint cannot be listed", file, exc)
        return None
    saved = _config_container(loaded)
    return saved if isinstance(saved, dict) else None


def config_changes(
    path: Path, config: Any, saved_overrides: Mapping[str, Any] | None = None
) -> list[tuple[str, Any, Any]] | None:
    """The settings of ``config`` (the command's run config) that differ from the checkpoint ``path``'s saved
    ``config.yaml``, as ``(dotted key, checkpoint's value, this command's value)`` in the config's order.

    Both sides are compared resolved; nested mappings key by key (``actor.optim.lr``), lists as whole values
    (``actor.optim.betas``) except lists of mappings, entry by entry (``trainer.alerts[0].max``); a key one side
    lacks shows ``(unset)``. :data:`START_KEYS` (how this start finds its checkpoint) are left out.
    ``saved_overrides`` (dotted key -> value) replaces saved values that the run changed on its own, to compare
    what was configured (the trainer passes the ``actor.kl_loss_coef`` a ``trainer.alerts`` ``scale_kl_coef``
    scaled: :meth:`rlplug.run.alerts.AlertEngine.configured_at_checkpoint`). Returns None when the checkpoint has
    no readable ``config.yaml`` (:func:`read_saved_config`): nothing to compare with."""
    saved = read_saved_config(path)
    if saved is None:
        return None
    if saved_overrides:
        node = OmegaConf.create(saved)
        for key, value in saved_overrides.items():
            if OmegaConf.select(node, key, default=_UNSET) is not _UNSET:
                OmegaConf.update(node, key, value, merge=False)
        saved = _config_container(node)
    out: list[tuple[str, Any, Any]] = []
    _ordered_diff("", saved, _config_container(config), out)
    return [c for c in out if not any(fnmatch.fnmatchcase(c[0], k) for k in START_KEYS)]


def _irrelevant_model_change(key: str, old: Any, new: Any, config: Any) -> bool:
    """Whether a ``model.*`` change leaves the model as it was (the same reading as :func:`run_fingerprint`):
    ``model.tiny.*`` unless ``model.source=tiny``, the LoRA settings without LoRA (rank 0), and ``model.path``
    naming the same folder."""
    model = typed(RunConfig, config).model
    if key.startswith("model.tiny.") and model.source != "tiny":
        return True
    if key in ("model.lora_alpha", "model.target_modules", "model.exclude_modules") or key.startswith(
        ("model.target_modules[", "model.exclude_modules[")
    ):
        return not model.lora_rank
    if key == "model.path" and isinstance(old, str) and isinstance(new, str):
        return _abspath(old) == _abspath(new)
    return False


def refused_changes(changes: list[tuple[str, Any, Any]], config: Any) -> list[tuple[str, Any, Any, str]]:
    """The ``changes`` (of :func:`config_changes`) a resume refuses: those :data:`RESUME_FIXED` matches (not
    :data:`RESUME_FREE`, nor ``model.*`` changes that leave the model as it was), with the reason."""
    out = []
    for key, old, new in changes:
        if key in RESUME_FREE:
            continue
        why = next((w for pattern, w in RESUME_FIXED if fnmatch.fnmatchcase(key, pattern)), None)
        if why is None or (key.startswith("model.") and _irrelevant_model_change(key, old, new, config)):
            continue
        out.append((key, old, new, why))
    return out


def _override(key: str, value: Any) -> str:
    """``key=value`` as a command-line override would give it (Hydra's grammar for plain values)."""
    if value is _UNSET:
        return f"~{key}"
    if value is None:
        return f"{key}=null"
    if isinstance(value, bool):
        return f"{key}={str(value).lower()}"
    if isinstance(value, (int, float)):
        return f"{key}={value}"
    if isinstance(value, str):
        return f"{key}={value}" if value and re.fullmatch(r"[\w./@:+-]+", value) else f"{key}={json.dumps(value)}"
    return f"{key}={json.dumps(value).replace(' ', '')}"


def describe_change(old: Any, new: Any) -> str:
    """``old -> new`` as the change lists show it (values as JSON, a side without the key ``(unset)``)."""
    return f"{_show(old)} -> {_show(new)}"


def format_changes(changes: list[tuple[str, Any, Any]]) -> str:
    """One line per change, ``  key: old -> new`` (:func:`describe_change`)."""
    return "\n".join(f"  {key}: {describe_change(old, new)}" for key, old, new in changes)


def _new_dir_option(config: Any) -> str:
    """The override that gives a run a directory of its own."""
    if typed(RunConfig, config).trainer.default_local_dir:
        return "trainer.default_local_dir=<another directory>"
    return f"trainer.experiment_name=<a new name> (this run's is {experiment_name_for(config)!r})"


def check_fingerprint(path: Path, config: Any) -> None:
    """Refuse to resume ``config``'s run from the checkpoint ``path`` when it was written by another
    run, or with a setting changed that a resumed run cannot change: the resume compatibility check,
    run by :func:`open_run_dir` before any model loads.

    First its ``run_fingerprint.json`` is compared with :func:`run_fingerprint` of ``config``; a difference
    raises :class:`rlplug.config.schema.ConfigError` naming every differing key with the checkpoint's and the
    command's values, and the ways out (a new ``trainer.experiment_name``, or a fresh start in this directory
    with ``trainer.resume_mode=disable trainer.overwrite=true``); so does an unreadable file. A checkpoint
    without the file (written before rlplug recorded fingerprints) resumes, with a warning logged and printed.

    Then its ``config.yaml`` is compared with ``config`` (:func:`config_changes`): a change of a key of
    :data:`RESUME_FIXED` (``data.train_batch_size``, ``rollout.n``, ``trainer.seed``, ``trainer.backend``,
    ``model.*`` but :data:`RESUME_FREE`, the KL controller's type, the data order's settings) raises
    :class:`rlplug.config.schema.ConfigError` naming each such key, its checkpoint's and its new value and why it
    cannot change, with the overrides that set them back and how to start a new run instead. Every other
    change is allowed: the trainer applies and lists it (:func:`rlplug.run.resume.apply_resume_changes`).
    """

    file = path / FINGERPRINT_FILE
    if not file.is_file():
        msg = (
            f"WARNING: {path} has no {FINGERPRINT_FILE} (written before rlplug recorded run fingerprints): resuming "
            "without checking that its algorithm, reward, model and data are this command's."
        )
        log.warning(msg)
        print(msg, flush=True)
    else:
        ways = (
            f"Either train in a new directory: {_new_dir_option(config)}, or start fresh in this one: "
            "trainer.resume_mode=disable trainer.overwrite=true (the old checkpoints are moved aside, not deleted)."
        )
        if typed(RunConfig, config).trainer.resume_mode == "resume_path":  # the directory does not pick the checkpoint
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
            raise ConfigError(
                f"Cannot resume from {path}: it was written by another run. What differs (checkpoint -> this "
                f"command):\n{format_changes(diffs)}\n{ways} To continue the checkpointed run instead, restore the "
                "settings above."
            )
    refused = refused_changes(config_changes(path, config) or [], config)
    if refused:
        lines = "\n".join(f"  {key}: {_show(old)} -> {_show(new)} ({why})" for key, old, new, why in refused)
        back = " ".join(_override(key, old) for key, old, _new, _why in refused)
        one = len(refused) == 1
        raise ConfigError(
            f"Cannot resume from {path} with {'this setting' if one else 'these settings'} changed (checkpoint -> "
            f"this command):\n{lines}\nA resume continues the checkpointed run, which needs "
            f"{'it' if one else 'them'} as {'it was' if one else 'they were'}. To resume, set "
            f"{'it' if one else 'them'} back: {back}. To train with the new {'value' if one else 'values'}, start a "
            f"new run: {_new_dir_option(config)} (or trainer.resume_mode=disable trainer.overwrite=true in this "
            f"directory, which moves its checkpoints aside); to start it from this checkpoint's weights, export them "
            f"first: rlplug export {path} --out DIR, then model=path model.path=DIR."
        )


def set_aside_checkpoints(manager: CheckpointManager) -> Path | None:
    """Move an earlier run out of the way (``trainer.overwrite=true``): its ``latest`` pointer,
    ``final_model``, its ``metrics.jsonl`` and ``validation_samples.jsonl``, its rollout dumps (``rollouts/``,
    :mod:`rlplug.run.dump`: the new run's first dump would otherwise delete every earlier dump of a step at or
    after its own) and every ``global_step_N`` directory (complete or partial) go into
    ``<run dir>/overwritten/<YYYYmmdd-HHMMSS>/``, by renames on the same file system; nothing is
    deleted. Prints (and logs) where they went; returns that folder, or None when there was nothing.

    The pointer moves first, so a kill in the middle leaves no pointer naming a checkpoint that is
    gone; running the same command again moves what is left into a folder of its own.
    """
    root = manager.root
    if not root.is_dir():
        return None
    steps = [p for p in sorted(root.iterdir()) if p.is_dir() and p.name.startswith("global_step_")]
    logs = (root / METRICS_LOG, root / VALIDATION_SAMPLES_FILE, root / DUMP_DIR)
    items = [p for p in (root / LATEST, root / FINAL_MODEL, *logs) if p.exists()] + steps
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
    (:func:`set_aside_checkpoints`) when training begins (:meth:`begin`); ``select``: on the ranks
    other than 0 of a torchrun job, the resume selection they skipped (rank 0 alone verifies the
    checkpoints; :meth:`begin` gives the others its choice), run by :meth:`begin` only when there is no
    group to get rank 0's choice from.
    """

    manager: CheckpointManager
    resume_from: Path | None = None
    set_aside: bool = False
    select: Callable[[], Path | None] | None = None

    @property
    def resume_step(self) -> int | None:
        """The global step of :attr:`resume_from` (0: a fresh start); None while this process waits for rank
        0's choice (:attr:`select` is set: a rank other than 0 of a torchrun job, before :meth:`begin`)."""
        if self.resume_from is None:
            return None if self.select is not None else 0
        return checkpoint_step(self.resume_from) or 0

    def begin(self, is_main: bool = True, coordinator: Any = None) -> Path | None:
        """Move the earlier run aside when planned (by the main process only: ``is_main``; the others
        never read the directory on a fresh start) and return the checkpoint to resume from.

        With a multi-process ``coordinator`` (:class:`rlplug.contracts.types.Coordinator`, ``world_size > 1``;
        collective: every process calls this) it is rank 0's :attr:`resume_from`, broadcast, so every rank
        loads the checkpoint rank 0 verified (and, after a fallback, renamed the corrupt ones beside)."""
        if coordinator is not None:
            is_main = bool(coordinator.is_main)
        if self.set_aside and is_main:
            set_aside_checkpoints(self.manager)
            self.set_aside = False
        if coordinator is not None and getattr(coordinator, "world_size", 1) > 1:
            chosen = coordinator.broadcast(str(self.resume_from) if self.resume_from is not None else None)
            self.resume_from, self.select = (Path(chosen) if chosen else None), None
        elif self.select is not None:  # RANK set but no process group: select here after all
            self.resume_from, self.select = self.select(), None
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

    First it takes the run directory's lock (:func:`rlplug.run.run_lock.acquire_run_lock`, held by
    ``manager.lock`` until :meth:`CheckpointManager.close`): another live run on the directory is
    refused here, naming its pid and host; a crashed run's stale lock is taken over with a warning.
    Under torchrun only rank 0 (``RANK`` unset or 0) verifies and selects the checkpoint to resume
    (hashing it once per job, not once per rank); the other ranks get its choice from
    :meth:`RunStart.begin`, a broadcast once the process group exists.

    Raises :class:`rlplug.run.run_lock.RunDirLocked` (a ConfigError) when another run holds the
    directory, and :class:`rlplug.config.schema.ConfigError` for another run's checkpoint (the differing
    keys named), for a fresh start in a used directory (the directory, its steps and the ways out
    named), for a ``trainer.resume_from_path`` that is not a complete checkpoint, and when no
    checkpoint of the run passes :func:`verify_checkpoint`.
    """

    # by attribute, not typed(): null (keep every checkpoint) must not become the schema's 3
    manager = CheckpointManager(run_dir, config.trainer.max_ckpt_to_keep)
    manager.root.mkdir(parents=True, exist_ok=True)
    manager.lock = acquire_run_lock(manager.root)  # another live run here: refused (rank 0 of torchrun locks)
    try:
        return _plan_start(config, manager)
    except BaseException:
        manager.close()
        raise


def _plan_start(config: Any, manager: CheckpointManager) -> tuple[CheckpointManager, RunStart]:
    """:func:`open_run_dir`'s decision, once the directory is locked."""

    trainer = config.trainer
    if trainer.resume_mode != "disable":
        if not _is_rank_zero():  # rank 0 verifies (hashes) and picks; RunStart.begin gives the others its choice

            def select() -> Path | None:
                path = resume_checkpoint(trainer, manager)
                if path is not None:
                    check_fingerprint(path, config)
                return path

            return manager, RunStart(manager, select=select)
        path = resume_checkpoint(trainer, manager)
        if path is not None:
            check_fingerprint(path, config)
        return manager, RunStart(manager, path)
    steps, final = manager.complete_steps(), (manager.root / FINAL_MODEL).exists()
    if not (steps or final):
        return manager, RunStart(manager)
    if typed(TrainerConfig, trainer).overwrite:
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
