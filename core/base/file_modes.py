"""File permissions of written models: :func:`apply_umask`.

safetensors' writer creates its files ``0o600`` whatever the umask, so a model written by one user
cannot be read by an inference server running as another. The exports (the final model, ``rlplug
export``), the checkpoints and training backends that write model files themselves call
:func:`apply_umask` on what they wrote. This module imports nothing from rlplug.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["apply_umask"]


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
    other names and symbolic links. The exports (the final model, ``rlplug export``) and the
    checkpoints call this. Raises ``OSError`` when a matching file cannot be changed (not its owner).
    """
    mode = 0o666 & ~_umask()
    for path in Path(root).rglob(pattern):
        if path.is_file() and not path.is_symlink():
            path.chmod(mode)
