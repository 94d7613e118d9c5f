"""Processes by pid and child processes over two pipes. :func:`pid_alive`: what the stale-file sweeps and the run
lock ask of a pid they recorded. :func:`pin_process`: every thread of this process on given cores.
:func:`start_pipe_child` / :func:`stop_pipe_child`: the engine children (the
``hf`` engine's :class:`rlplug.rollout.engine_process.EngineProcess` and the ``vllm`` backend's engine child) are
started and stopped the same way. Imports nothing from rlplug, so any layer may use it."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from pathlib import Path

__all__ = ["pid_alive", "pin_process", "start_pipe_child", "stop_pipe_child"]


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host and is not a zombie (a zombie has exited: its parent has not yet
    collected it). Another user's process counts as alive (``PermissionError``). Never raises."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OSError, OverflowError, ValueError):
        return False
    try:
        return not Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[-1].startswith("Z")
    except OSError:
        return True


def pin_process(cpus: set[int]) -> None:
    """Bind every thread of this process to ``cpus`` (CPU ids), and so the threads it starts later (they inherit
    the mask of the thread that starts them). ``os.sched_setaffinity(0, ...)`` binds only the calling thread on
    Linux: torch's worker threads, started when a model loaded, kept every core. Threads listed in
    ``/proc/self/task``; without ``/proc``, the calling thread alone. A thread that ends meanwhile is skipped.
    Raises ``OSError`` (``EINVAL``) when no id in ``cpus`` is usable."""
    os.sched_setaffinity(0, cpus)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return
    for tid in tids:
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(tid, cpus)


def start_pipe_child(
    argv: Sequence[str],
    log_path: str | os.PathLike[str],
    env: Mapping[str, str] | None = None,
    tail: Sequence[str] = (),
) -> tuple[subprocess.Popen[bytes], Connection, Connection]:
    """Start ``[*argv, <read fd>, <write fd>, *tail]``: the child reads commands from the first file descriptor and
    writes answers to the second (``multiprocessing.connection.Connection`` framing, e.g. ``Connection(int(fd))``);
    its stdout and stderr are appended to ``log_path``, stdin is ``/dev/null``, no other descriptor is inherited.

    Returns ``(proc, send, recv)``: the ``Popen``, the connection that writes to the child and the one that reads
    from it. Raises what ``subprocess.Popen`` raises (``OSError``: the program is missing), with every pipe closed.
    Stop the child with :func:`stop_pipe_child`."""
    p2c_r, p2c_w = os.pipe()
    c2p_r, c2p_w = os.pipe()
    try:
        with open(log_path, "ab") as logf:
            proc = subprocess.Popen(
                [*argv, str(p2c_r), str(c2p_w), *tail],
                pass_fds=(p2c_r, c2p_w),
                env=None if env is None else dict(env),
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                close_fds=True,
            )
    except BaseException:
        os.close(p2c_w)
        os.close(c2p_r)
        raise
    finally:  # the child's ends: the child holds its own copies
        os.close(p2c_r)
        os.close(c2p_w)
    return proc, Connection(p2c_w, readable=False), Connection(c2p_r, writable=False)


def stop_pipe_child(
    proc: subprocess.Popen[bytes],
    send: Connection | None,
    recv: Connection | None,
    close_wait_s: float = 10.0,
    term_wait_s: float = 2.0,
) -> None:
    """Stop a child of :func:`start_pipe_child`: send it ``("close", None)`` and wait up to ``close_wait_s`` seconds
    for it to exit; then SIGTERM and ``term_wait_s`` seconds; then SIGKILL. Closes both connections. Best effort
    (a dead child's broken pipe, an interrupt during the wait): never raises for the child's sake; safe to call
    again. Use it as a ``weakref.finalize`` callback so an abandoned owner still stops its child."""
    if proc.poll() is None and send is not None:
        with contextlib.suppress(BaseException):
            send.send(("close", None))
        with contextlib.suppress(BaseException):
            proc.wait(timeout=close_wait_s)
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=term_wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    for conn in (send, recv):
        if conn is not None:
            with contextlib.suppress(BaseException):
                conn.close()
