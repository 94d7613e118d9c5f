"""What the engine tells a plugin about the run it is built for: :class:`RunContext`.

A plugin that needs to know where the run lives or where it resumes (a tracker continuing its run
after a restart, a training backend writing next to the checkpoints) gets both from the engine
when the engine builds it, instead of computing them from the config or importing them from the
loop. The factory of a ``tracker`` or a ``training_backend`` declares a keyword parameter named
``run``, and the engine passes a :class:`RunContext`::

    from rlplug.plugin import RunContext

    class MyTracker:
        def __init__(self, config, *, run: RunContext) -> None:
            self.folder = run.run_dir / "mytracker"
            self.continued = bool(run.resume_step)     # 0: a fresh start

A factory without a ``run`` parameter is built as before (a tracker: ``factory(config)``, or
``factory(config, resume_step=N)`` when it takes ``resume_step``, which is deprecated; a training
backend: ``factory(config, model_path, use_critic=..., use_ref=..., total_steps=...)``).

This module imports nothing from rlplug: the type sits below every layer that builds or uses it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["RunContext", "takes_run_context"]


@dataclass(frozen=True)
class RunContext:
    """The run a plugin is built for, as the engine knows it (immutable).

    ``run_dir``: the run directory (``trainer.default_local_dir``, else
    ``checkpoints/<trainer.project_name>/<trainer.experiment_name>``): it holds the checkpoints
    ``global_step_N/``, ``metrics.jsonl`` and the trackers' local stores. It exists when a plugin is
    built by a run; the path is as the config gives it (relative to the working directory when the
    config's is), not resolved.

    ``resume_step``: the global step of the checkpoint the run resumes after, 0 for a fresh start.
    Trackers are built after the checkpoint is loaded, so theirs is the step actually resumed from
    (also after a fall back from a corrupt latest checkpoint to an earlier one). A training backend
    is built before: its value is the step of the checkpoint the run selected, and None on the
    processes of a multi-process job other than rank 0, which learn it from rank 0 once the process
    group exists; the backend's ``load(directory)`` then gets that checkpoint.
    """

    run_dir: Path
    resume_step: int | None = 0

    def __post_init__(self) -> None:
        """``run_dir`` as a ``Path``; raises ``ValueError`` for a ``resume_step`` that is not an int >= 0 or None."""
        object.__setattr__(self, "run_dir", Path(self.run_dir))
        step = self.resume_step
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(f"RunContext.resume_step must be a global step >= 0 or None, got {step!r}.")


def takes_run_context(factory: Any) -> bool:
    """Whether ``factory`` (a class or a callable) declares a parameter named ``run`` that can be passed
    by keyword, so the engine passes it a :class:`RunContext` (``**kwargs`` alone does not count: such
    factories are built the way they were before ``run`` existed). False when ``factory`` has no
    inspectable signature (a builtin). Raises nothing."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    param = params.get("run")
    return param is not None and param.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
