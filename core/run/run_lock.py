"""One run per run directory: an OS lock on ``<run dir>/run.lock``.

Two ``rlplug train`` processes writing checkpoints into the same directory would interleave their
saves (and one's ``max_ckpt_to_keep`` cleanup would delete the other's checkpoints). So a run takes
an exclusive, non-blocking ``fcntl.flock`` on ``run.lock`` in its run directory before anything
else happens there (:func:`rlplug.run.checkpoint.open_run_dir`, before any model loads), and the lock
file holds who took it, as JSON::

    {"pid": 12345, "host": "node-3", "started": "2026-12-02T00:40:12Z", "argv": ["rlplug", "train", ...]}

* A second run on the directory is refused at once with :class:`RunDirLocked` (a
  :class:`rlplug.config.schema.ConfigError`: exit code 2, nothing was trained), whose message names the
  other run's pid, host and start time.
* The kernel releases a ``flock`` when its process dies, however it dies (SIGKILL, OOM, a crash),
  so a crashed run never blocks the next one. A clean exit empties the file before unlocking; a
  lock file that still names a run but is not locked is that run's, left by a crash: it is taken
  over, with a warning naming the dead run (``pid ... on this host is no longer running``).
* Multi-process runs (``trainer=fsdp2`` under torchrun): only rank 0 (``RANK`` unset or ``0``)
  takes the lock; the other ranks are part of the same run.
* Within one process the lock is counted: a second :func:`acquire_run_lock` of the same directory
  (a second ``Trainer`` built in a test or a notebook, after the first) shares it, and the file is
  unlocked when the last holder releases it, or when the :class:`RunLock` is garbage-collected
  unreleased (a ``Trainer`` whose construction failed).
* A file system without ``flock`` support (``ENOLCK``/``EOPNOTSUPP``, some network mounts) falls
  back to the pid recorded in the file: a live pid on this host is refused, anything else taken
  over, with a warning that the directory is not protected against runs on other hosts.

The file is never deleted (deleting a lock file lets two processes lock two different files of
the same name); ``trainer.overwrite=true`` leaves it in place.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlplug.base.processes import pid_alive
from rlplug.config.schema import ConfigError

log = logging.getLogger(__name__)

__all__ = ["LOCK_FILE", "RunDirLocked", "RunLock", "acquire_run_lock", "lock_holder"]

#: the lock file inside the run directory
LOCK_FILE = "run.lock"


class RunDirLocked(ConfigError):
    """Another live run holds the run directory's lock; ``holder`` is its lock record (pid, host,
    started, argv; empty when it was not written yet)."""

    def __init__(self, message: str, holder: dict[str, Any]) -> None:
        super().__init__(message)
        self.holder = holder


@dataclass
class RunLock:
    """A held run-directory lock (:func:`acquire_run_lock`); :meth:`release` (or ``with``) gives it back.

    ``path``: the lock file; ``info``: what this process wrote into it; ``taken_over``: the record of
    a crashed run whose stale lock was taken over (None when the file was free)."""

    path: Path
    info: dict[str, Any]
    taken_over: dict[str, Any] | None = None
    _fd: int | None = field(default=None, repr=False)
    _count: int = field(default=1, repr=False)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Give the lock back (empty the file, unlock, close); idempotent. In-process sharers
        (:func:`acquire_run_lock` twice) unlock only with the last release."""
        if self._fd is None:
            return
        self._count -= 1
        if self._count > 0:
            return
        fd, self._fd = self._fd, None
        _HELD.pop(str(self.path), None)
        try:
            os.ftruncate(fd, 0)  # a clean exit: the next run finds no stale record
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:
            pass
        finally:
            os.close(fd)

    close = release

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:  # dropped unreleased (e.g. a Trainer whose construction failed): unlock
        if self._fd is not None:
            self._count = 1
            self.release()


#: the locks this process holds, by lock-file path (weakly: a lock nobody references is released)
_HELD: weakref.WeakValueDictionary[str, RunLock] = weakref.WeakValueDictionary()


def _is_rank_zero() -> bool:
    """Rank 0 of a torchrun job, or a single process (``RANK`` unset)."""
    try:
        return int(os.environ.get("RANK", "0")) == 0
    except ValueError:
        return True


def _read_record(fd: int) -> dict[str, Any]:
    """The JSON record in the lock file (``{}`` when empty or unreadable)."""
    try:
        size = os.fstat(fd).st_size
        raw = os.pread(fd, max(size, 1), 0) if size else b""
        data = json.loads(raw.decode()) if raw.strip() else {}
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError, UnicodeDecodeError):
        return {}


def lock_holder(run_dir: str | Path) -> dict[str, Any]:
    """The lock record in ``run_dir/run.lock`` (pid, host, started, argv), ``{}`` when there is none.

    Only reads the file: whether that run is alive is what :func:`acquire_run_lock` finds out."""
    path = Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return {}
    try:
        return _read_record(fd)
    finally:
        os.close(fd)


def _pid_alive(pid: Any) -> bool:
    """Whether process ``pid`` (a recorded value: anything but a positive int counts as gone) exists on this host
    (:func:`rlplug.base.processes.pid_alive`: a zombie counts as gone, another user's process as alive)."""
    return isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 and pid_alive(pid)


def _describe(record: dict[str, Any]) -> str:
    if not record:
        return "a run that has not written its record yet (it is starting)"
    return f"pid {record.get('pid')} on host {record.get('host')}, started {record.get('started')}"


def _stale_note(record: dict[str, Any], host: str) -> str:
    if record.get("host") != host:
        return f"on host {record.get('host')}, not this one ({host}), and it no longer holds the lock"
    if record.get("pid") == os.getpid():
        return "this process's own record (a forked or re-executed process), not locked"
    return "no longer running" if not _pid_alive(record.get("pid")) else "alive, but not holding the lock (pid reused)"


def acquire_run_lock(run_dir: str | Path, *, rank_zero: bool | None = None) -> RunLock | None:
    """Take the exclusive lock of ``run_dir`` (created if missing) for this run; returns the
    :class:`RunLock`, or None on the ranks other than 0 of a multi-process run (``rank_zero``
    defaults to ``RANK`` unset or ``0``), which do not lock.

    Raises :class:`RunDirLocked` (exit code 2) naming the holder's pid, host and start time when
    another live process holds it, with the ways out. A stale record (a run that crashed: the file
    names it, but nobody holds the lock) is taken over with a logged and printed warning naming
    that run; :attr:`RunLock.taken_over` keeps its record.
    """
    if not (_is_rank_zero() if rank_zero is None else rank_zero):
        return None
    root = Path(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    path = (root / LOCK_FILE).resolve()
    mine = _HELD.get(str(path))
    if mine is not None and mine.held:  # this process already runs here (a second Trainer): share it
        mine._count += 1
        return mine
    host = socket.gethostname()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    no_os_lock = False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_record(fd)
        os.close(fd)
        raise RunDirLocked(
            f"The run directory {root} is in use by another run: {_describe(holder)}"
            f"{' (command: ' + ' '.join(map(str, holder['argv'])) + ')' if holder.get('argv') else ''}. "
            f"Two runs writing checkpoints into one directory would overwrite and delete each other's. "
            f"Wait for that run to finish, stop it (kill {holder.get('pid', '<pid>')} on {holder.get('host', 'its host')}: "
            "it saves a checkpoint on SIGTERM), or train this one in another directory "
            "(trainer.experiment_name=<a new name> or trainer.default_local_dir=<another directory>).",
            holder,
        ) from None
    except OSError as exc:
        if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
            os.close(fd)
            raise
        no_os_lock = True
    previous = _read_record(fd)
    if no_os_lock:
        if previous.get("host") == host and previous.get("pid") != os.getpid() and _pid_alive(previous.get("pid")):
            os.close(fd)
            raise RunDirLocked(
                f"The run directory {root} is in use by another run: {_describe(previous)} (its file system does not "
                "support flock, so rlplug checked the recorded pid, which is alive). Wait for it to finish or train "
                "in another directory (trainer.default_local_dir=<another directory>).",
                previous,
            )
        msg = (
            f"WARNING: the file system of {root} does not support file locks (flock); rlplug cannot stop a run on "
            "another host from using this directory at the same time."
        )
        log.warning(msg)
        print(msg, file=sys.stderr, flush=True)
    info = {
        "pid": os.getpid(),
        "host": host,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "argv": list(sys.argv),
    }
    taken_over = previous or None
    if taken_over:
        msg = (
            f"WARNING: taking over the stale lock {path} of a run that did not stop cleanly: "
            f"{_describe(previous)} ({_stale_note(previous, host)})."
        )
        log.warning(msg)
        print(msg, file=sys.stderr, flush=True)
    data = json.dumps(info).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)
    lock = RunLock(path, info, taken_over, fd)
    _HELD[str(path)] = lock
    return lock
