"""Whether a process is still there, by pid: what the stale-file sweeps and the run lock ask of a pid they
recorded. Imports nothing from rlplug, so any layer may use it."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["pid_alive"]


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
