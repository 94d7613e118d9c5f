"""The weight-transfer contract: how the trained actor's weights reach the rollout engine.

After each actor update (and after a resume) the run moves the actor's weights from the training backend
(:meth:`rlplug.contracts.types.TrainingBackend.actor_weights`, an iterator of ``(name, tensor)`` pairs in the
Hugging Face model's names, full tensors gathered from any shards) to the rollout engine
(:meth:`rlplug.contracts.types.RolloutBackend.update_weights`). A :class:`WeightTransfer` owns that move, so
that the asynchronous pipeline (a weight version per push, engines in other processes) and engines on every
rank (each loading from local shards) can replace how it is done without touching the loop.

Every process calls :meth:`WeightTransfer.push` at the same point (``actor_weights`` may be a collective
under a multi-process backend); ``rollout`` is ``None`` on a process that owns no engine.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["WeightTransfer", "DirectWeightTransfer"]


@runtime_checkable
class WeightTransfer(Protocol):
    """Moves the actor's weights from a training backend to a rollout engine; counts the pushes."""

    #: pushes done by this process so far (the weight version the engine holds; 0 before the first)
    version: int

    def push(self, backend: Any, rollout: Any | None) -> None: ...


class DirectWeightTransfer:
    """The synchronous transfer: ``rollout.update_weights(backend.actor_weights())`` in this process.

    ``backend.actor_weights()`` is called on every process (it may gather shards collectively), the engine is
    updated only where ``rollout`` is not ``None``; whatever the engine left of the iterator is drained, so every
    process joins every gather. :attr:`version` counts this process's pushes (not checkpointed).
    """

    def __init__(self) -> None:
        self.version = 0

    def push(self, backend: Any, rollout: Any | None) -> None:
        weights = backend.actor_weights()
        if rollout is not None:
            rollout.update_weights(weights)
        for _ in weights:  # a process without an engine, or an engine that stopped early: join the remaining gathers
            pass
        self.version += 1
