"""Fault injection for the crash tests: :func:`fault_point`, a marked place where a test can stop or fail
the process.

The engine marks its places (rollout, each stage of a step, each write of a checkpoint; the labels are
listed in ``tests/test_kill_resume.py``); a plugin marks its own with a label of its own, e.g. the
``fsdp2`` training backend's ``fsdp2_full_weights`` inside its checkpoint save::

    from rlplug.plugin import fault_point

    fault_point("myplugin_upload")   # nothing happens unless RLPLUG_TEST_KILL_AT names this label

A test sets ``RLPLUG_TEST_KILL_AT=<label>:<n>[:<SIGNAL>|<ERRNO>]`` (comma-separated for several) in the
environment of the process it starts; the ``n``-th time that process reaches ``label`` it kills itself
(``SIGKILL`` by default, or the named signal) or raises ``OSError(errno.<ERRNO>)`` there, as a failing
write would. Unset, a fault point costs one environment lookup.

This module imports nothing from rlplug, so any layer may mark a fault point.
:func:`rlplug.run.checkpoint._fault_point` is the same hook under its old name.
"""

from __future__ import annotations

import errno
import os
import signal
import sys

__all__ = ["FAULT_ENV", "fault_counts", "fault_point"]

#: ``label:n[:SIGNAL|ERRNO][,...]``, e.g. ``ckpt_renamed:2``, ``update_actor:1:SIGTERM`` or ``ckpt_backend:2:ENOSPC``
FAULT_ENV = "RLPLUG_TEST_KILL_AT"
#: how many times each label was reached in this process (counted only while :data:`FAULT_ENV` is set)
fault_counts: dict[str, int] = {}


def fault_point(label: str, *, counts: dict[str, int] | None = None) -> None:
    """Testing aid: send a signal to this process, or raise an ``OSError``, at the ``n``-th time
    ``label`` is reached.

    With ``RLPLUG_TEST_KILL_AT=<label>:<n>[:<SIGNAL>|<ERRNO>]`` (comma-separated for several; ``n``
    defaults to 1), the ``n``-th call with ``label`` (counted per process, 1-based, in ``counts``,
    default :data:`fault_counts`) prints a line naming the point to stderr and sends ``SIGNAL``
    (default ``SIGKILL``; e.g. ``SIGTERM`` to test the graceful stop) to the current process, or,
    for an ``errno`` name (``ENOSPC``, ``EDQUOT``, ``EIO``), raises ``OSError(errno.<ERRNO>, ...)``
    there. Used by the crash tests to stop a run at exact places (during rollout, between a
    checkpoint's rename and its ``latest`` pointer, ...). When the variable is unset nothing is
    counted and the cost is one environment lookup.

    Raises ``OSError`` (only for an ``errno`` name in the variable) and ``ValueError`` when ``n``
    is not an integer.
    """
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    counts = fault_counts if counts is None else counts
    count = counts[label] = counts.get(label, 0) + 1
    for item in spec.split(","):
        parts = item.strip().split(":")
        if parts[0] != label or count != (int(parts[1]) if len(parts) > 1 and parts[1] else 1):
            continue
        signame = parts[2] if len(parts) > 2 else "SIGKILL"
        print(f"{FAULT_ENV}: {signame} at {label}:{count}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        if signame.startswith("E") and hasattr(errno, signame):
            code = getattr(errno, signame)
            raise OSError(code, f"{os.strerror(code)} ({FAULT_ENV} at {label}:{count})")
        os.kill(os.getpid(), getattr(signal, signame))
