"""Metric names and values as trackers record them: :func:`tracker_name`, :func:`metric_value`,
:func:`source_tags`.

:func:`tracker_name` is the one mapping of metric and param names to the characters a tracker accepts
(``@`` -> ``_at_``, :data:`TRACKER_NAME_CHARS`); :func:`metric_value` turns a logged value into a float;
:func:`source_tags` says which rlplug ran (version, git commit). Trackers (plugins, through
:mod:`rlplug.plugin`) and the run's metrics (:mod:`rlplug.run.metrics`, which re-exports these) share them.
Imports nothing from rlplug but its version.
"""

from __future__ import annotations

import functools
import hashlib
import re
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from rlplug._version import __version__

__all__ = ["TRACKER_NAME_CHARS", "metric_value", "source_tags", "tracker_name"]


def metric_value(value: Any) -> float | None:
    """``value`` as a Python float (bools, ints, floats, torch/numpy scalars), or None when it is not a number."""
    if isinstance(value, (bool, int, float)):
        return float(value)
    item = getattr(value, "item", None)
    if callable(item):
        try:
            v = item()
        except (ValueError, RuntimeError):  # a tensor with several elements
            return None
        return float(v) if isinstance(v, (bool, int, float)) else None
    return None


#: The characters :func:`tracker_name` keeps by default (a regex character-class body): letters, digits,
#: ``_ - . / :`` and space, the set MLflow accepts in metric and param names.
TRACKER_NAME_CHARS = r"\w.\- :/"
#: Characters with a spelled-out replacement, applied before any other mapping.
_NAME_REPLACEMENTS = {"@": "_at_"}


@functools.lru_cache(maxsize=16)
def _bad_chars(allowed: str) -> re.Pattern[str]:
    return re.compile(f"[^{allowed}]")


def tracker_name(name: str, *, allowed: str = TRACKER_NAME_CHARS, max_length: int | None = 250) -> str:
    """A metric or param name in the characters a tracker accepts: the one mapping every tracker uses.

    1. ``@`` becomes ``_at_`` (verl's ``mean@N``: ``val-core/gsm8k/acc/mean@8`` ->
       ``val-core/gsm8k/acc/mean_at_8``);
    2. every other character outside ``allowed`` (a regex character-class body, default
       :data:`TRACKER_NAME_CHARS`) becomes ``_``;
    3. when ``/`` is allowed, names are paths: empty and ``.`` segments are dropped and ``..`` becomes
       ``__`` (MLflow rejects them);
    4. a result longer than ``max_length`` characters (None: no limit) is cut and ends in ``-`` and 8 hex
       digits of the SHA-1 of the original name, so long names stay distinct.

    An empty result is ``_``. A tracker that accepts every character (``console``) logs names
    unchanged; one with a stricter set passes its own ``allowed`` (e.g. ``"A-Za-z0-9_:"`` for
    Prometheus: ``actor/pg_loss`` -> ``actor_pg_loss``), so the same name maps the same way everywhere.
    """
    clean = str(name)
    for char, replacement in _NAME_REPLACEMENTS.items():
        clean = clean.replace(char, replacement)
    clean = _bad_chars(allowed).sub("_", clean)
    if "/" in clean:  # "/" survived: the tracker takes path-like names
        clean = "/".join(("__" if p == ".." else p) for p in clean.split("/") if p not in ("", "."))
    clean = clean or "_"
    if max_length is not None and len(clean) > max_length:
        digest = hashlib.sha1(str(name).encode()).hexdigest()[:8]
        clean = clean[: max_length - 9].rstrip("/") + "-" + digest
    return clean


def _git(root: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


@functools.lru_cache(maxsize=1)
def _source_tags() -> tuple[tuple[str, str], ...]:

    try:
        version = metadata.version("rlplug")
    except metadata.PackageNotFoundError:
        version = __version__
    tags = {"rlplug.version": version}
    root = Path(__file__).resolve().parents[2]  # the source tree of an editable install (core/ is rlplug)
    top = _git(root, "rev-parse", "--show-toplevel") if (root / ".git").exists() else None
    if top is not None and Path(top).resolve() == root:
        commit = _git(root, "rev-parse", "HEAD")
        if commit:
            tags["rlplug.git_commit"] = commit
            dirty = _git(root, "status", "--porcelain", "--untracked-files=no")
            if dirty is not None:
                tags["rlplug.git_dirty"] = "true" if dirty else "false"
    return tuple(tags.items())


def source_tags() -> dict[str, str]:
    """Which rlplug ran, for trackers to record as tags: ``rlplug.version`` (the installed distribution's
    version) and, when rlplug runs from a git checkout (an editable install), ``rlplug.git_commit`` (the
    ``HEAD`` commit) and ``rlplug.git_dirty`` (``"true"`` when tracked files differ from it). The git keys
    are absent for a wheel install, without ``git``, or when git fails; this never raises. Computed once
    per process."""
    return dict(_source_tags())
