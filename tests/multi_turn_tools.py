"""Tools and a test environment for the multi-turn end-to-end tests (tests/test_multi_turn_faults.py,
tests/test_multi_turn_run.py).

The tools are module-level functions: a tool worker is a fresh interpreter that unpickles them by reference,
importing this module by name (pytest puts ``tests/`` on ``sys.path``; the worker gets the parent's
``sys.path``). The module imports nothing heavy, so a worker starts in a few tenths of a second. Every tool
takes exactly one required string parameter, as ``rollout.multi_turn.format=tags`` passes it.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Mapping
from typing import Any

from rlplug.contracts.agents import EnvironmentContext, EnvStep

#: the label of the fault point :class:`EchoEnvironment` marks before each step (``RLPLUG_TEST_KILL_AT``)
ECHO_FAULT_LABEL = "echo_env_step"
#: the text of every observation of :class:`EchoEnvironment`
ECHO_TEXT = "echo: keep going"
#: the step reward of every :class:`EchoEnvironment` step
ECHO_REWARD = 0.25


def calc(expression: str) -> str:
    """Add integers.

    Args:
        expression: integers joined by +.
    """
    return str(sum(int(x) for x in expression.split("+")))


def sleep_forever(seconds: str) -> str:
    """Sleep far longer than any timeout of the tests (an hour), whatever the argument says.

    Args:
        seconds: ignored.
    """
    time.sleep(3600)
    return "woke up"


def fail(message: str) -> str:
    """Raise ValueError(message).

    Args:
        message: the exception's message.
    """
    raise ValueError(message)


def flood(megabytes: str) -> str:
    """Print that many MiB to stdout and to stderr, then return "flooded".

    Args:
        megabytes: how many MiB to each stream (an integer).
    """
    line = "x" * 1023 + "\n"
    for _ in range(int(megabytes) * 1024):
        sys.stdout.write(line)
        sys.stderr.write(line)
    sys.stdout.flush()
    sys.stderr.flush()
    return "flooded"


def die(reason: str) -> str:
    """SIGKILL this process (the tool's worker) in the middle of the call.

    Args:
        reason: ignored.
    """
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
    return "not reached"


class EchoEnvironment:
    """An environment that answers every assistant message with the tool message :data:`ECHO_TEXT` and a step
    reward of :data:`ECHO_REWARD`, never ``done``: the turn cap (``rollout.multi_turn.max_assistant_turns``)
    or the length budget ends its episodes. A random model never writes a tool call, so this is how a real
    training run gets several turns. ``stop``: common letters, so that each of a random model's turns ends
    after a few tokens. Marks the fault point :data:`ECHO_FAULT_LABEL` before each step."""

    stop = ("e", "a")

    def __init__(self, context: EnvironmentContext) -> None:
        self.context = context

    def reset(self, row: Mapping[str, Any]) -> list[dict[str, Any]]:
        return [dict(m) for m in row["prompt"]]

    def step(self, message: Mapping[str, Any]) -> EnvStep:
        from rlplug.base.faults import fault_point

        fault_point(ECHO_FAULT_LABEL)
        return EnvStep([{"role": "tool", "content": ECHO_TEXT}], reward=ECHO_REWARD, done=False)


def register_echo(registry: Any, name: str = "test_echo") -> str:
    """Register :class:`EchoEnvironment` as environment ``name`` in ``registry`` (replacing an earlier one);
    returns ``name``."""
    registry.entries["environment"].pop(name, None)
    registry.register("environment", name, EchoEnvironment)
    return name
