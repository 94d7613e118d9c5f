"""The single-process :class:`rlplug.contracts.types.Coordinator`: how the trainer's processes agree.

A training backend supplies a coordinator as ``backend.coordinator``. In one process there is
nothing to agree on: :data:`SINGLE_PROCESS` says ``world_size = 1``, ``is_main = True`` and
``broadcast(obj)`` returns ``obj`` (``rank`` 0; ``all_gather(obj)`` returns ``[obj]``). Multi-process backends (``fsdp2``) supply their own, whose
``broadcast`` is a collective over the process group.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SingleProcessCoordinator", "SINGLE_PROCESS"]


class SingleProcessCoordinator:
    """The no-op coordinator of a backend that runs in one process."""

    world_size = 1
    rank = 0
    is_main = True

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order: here ``[obj]``."""
        return [obj]

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank: here, ``obj`` itself."""
        return obj

    def __repr__(self) -> str:
        return "SingleProcessCoordinator()"


#: The shared instance single-process backends return as ``coordinator``.
SINGLE_PROCESS = SingleProcessCoordinator()
