"""Contracts of the multi-turn kinds: the ``environment`` an episode talks to and the ``tool`` it calls.

Their place in the layers is fixed here, with the other contracts, before the kinds are wired into the run
(issue 33 registers them through the hooks ``register_environments`` / ``register_tools``, selects them with
``rollout.multi_turn.*`` and adds their conformance kits). Episodes themselves -- turns, tool workers, token
bookkeeping -- belong to :mod:`rlplug.orchestration`, the layer above the rollout library.

A *message* is a chat message as chat templates take it: a mapping with ``role`` (``"system"``, ``"user"``,
``"assistant"`` or ``"tool"``) and ``content`` (text); a tool message may carry ``name`` / ``tool_call_id``.

* :class:`EnvironmentProtocol`: one instance per trajectory. ``reset(row)`` gets the dataset row (verl's row
  schema) and returns the initial messages (it may rewrite the prompt); ``step(assistant_message)`` returns an
  :class:`EnvStep`: the observation messages to append, this turn's reward (``None``: none) and whether the
  episode is over. ``close()`` is optional. Methods may be ``async def``; the engine runs plain ones in a thread.
* :class:`ToolProtocol`: a named callable with a JSON schema of its parameters (what a chat template's
  ``tools=`` takes, as verl's function tools and TRL's ``tools=`` describe them); calling it with the
  parameters returns the result as text, or raises. ``__call__`` may be ``async def``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = ["Message", "EnvStep", "EnvironmentProtocol", "ToolProtocol"]

#: a chat message: {"role": ..., "content": ...} (plus "name" / "tool_call_id" on tool messages)
Message = Mapping[str, Any]


@dataclass(frozen=True)
class EnvStep:
    """What one environment step returns.

    ``observations``: messages to append after the assistant's (tool results, a user's reply); may be empty.
    ``reward``: this turn's reward (float), or ``None`` when the environment scores only at the end (the reward
    functions then score the whole trajectory). ``done``: the episode is over; no further assistant turn.
    ``info``: free-form diagnostics, logged, never trained on.
    """

    observations: Sequence[Message] = ()
    reward: float | None = None
    done: bool = False
    info: Mapping[str, Any] = field(default_factory=dict)


@runtime_checkable
class EnvironmentProtocol(Protocol):
    """One trajectory's environment (kind ``environment``). Methods may be coroutines (``async def``)."""

    def reset(self, row: Mapping[str, Any]) -> Sequence[Message] | Awaitable[Sequence[Message]]: ...

    def step(self, assistant_message: Message) -> EnvStep | Awaitable[EnvStep]: ...


@runtime_checkable
class ToolProtocol(Protocol):
    """A tool (kind ``tool``): ``name``, ``description``, ``parameters`` (a JSON schema object with
    ``type: object``, ``properties`` and ``required``) and the call itself, with those parameters as keywords;
    returns the result as text (a coroutine for an ``async`` tool)."""

    name: str
    description: str
    parameters: Mapping[str, Any]

    def __call__(self, **arguments: Any) -> str | Awaitable[str]: ...
