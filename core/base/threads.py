"""Blocking user code called from an event loop without ever joining it: :func:`in_daemon_thread`. Imports nothing
from rlplug, so any layer may use it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["MAX_CONCURRENT_CALLS", "in_daemon_thread"]

#: calls of :func:`in_daemon_thread` that run at once in a process (others wait for a slot in their own thread, as
#: ``asyncio.to_thread``'s pool bounds them); a call that never returns keeps its slot
MAX_CONCURRENT_CALLS = 64
_slots = threading.BoundedSemaphore(MAX_CONCURRENT_CALLS)


def _settle(future: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if future.done():  # cancelled: the caller stopped waiting (a timeout)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


async def in_daemon_thread(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` on a daemon thread of its own, awaited; raises what ``fn`` raises.

    Unlike ``asyncio.to_thread`` (the loop's default executor, which ``asyncio.run`` joins when it ends, and which
    holds a few threads only), a call that never returns holds up nothing once the caller stops waiting for it
    (``asyncio.wait_for`` past its timeout, a cancellation): the loop, ``asyncio.run`` and the other callers go on,
    and the thread ends with the process or when ``fn`` does. A Python thread cannot be stopped, so such a call
    keeps its thread (and what it holds) until then. At most :data:`MAX_CONCURRENT_CALLS` calls run at once; the
    others wait in their threads for a slot (the caller's timeout covers that wait)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def target() -> None:
        value: Any = None
        error: BaseException | None = None
        try:
            with _slots:
                value = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the awaiting coroutine
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits any more
            loop.call_soon_threadsafe(_settle, future, value, error)

    threading.Thread(target=target, name=f"rlplug-call-{getattr(fn, '__name__', 'fn')}", daemon=True).start()
    return await future
