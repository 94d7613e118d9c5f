"""Tool calls in worker processes: :class:`ToolRunner`, the pool behind ``EnvironmentContext.call_tool``.

A multi-turn episode calls its tools (kind ``tool``, :class:`rlplug.contracts.agents.ToolProtocol`) through one
:class:`ToolRunner` per run. Every call runs in a small pool of worker processes, so that a tool that hangs,
crashes, eats memory, floods its output or returns megabytes fails *its call* with a message the model reads
(a :class:`rlplug.contracts.agents.ToolResult`), and training goes on. The peers run tools inline with no timeout
(verl's ``_call_tool``, TRL's sync tools; ``PEERS_AGENTIC_ASYNC.md``); this module is the guard they lack.

What a call does (``await runner.call(name, arguments)``; it never raises, except ``CancelledError``):

* an unknown ``name`` -> ``unknown_tool``, listing the tools; arguments that do not match the tool's schema
  (:func:`rlplug.contracts.agents.validate_arguments`, checked in the parent before dispatch, or a
  :class:`~rlplug.contracts.agents.ToolArgumentError` the tool raises) -> ``bad_arguments``;
* the tool runs in a worker process; an exception -> ``error``, text ``"Error: " + message`` (a
  :class:`~rlplug.contracts.agents.ToolError`'s message verbatim, any other exception ``"TypeName: message"``);
* past the call's timeout the worker's process group is SIGKILLed and replaced -> ``timeout``;
* the worker dies during the call (SIGKILL from outside, a segfault, the kernel's OOM killer) -> ``crash``,
  naming the signal; the worker is replaced;
* a reply (result or error text) longer than ``max_chars`` characters is cut *in the worker*, before it is sent
  back (a tool returning 10 MB costs a few hundred bytes of IPC), to ``max_chars`` characters including the
  visible marker ``...[truncated N chars]`` (N: the characters removed; the head is kept) -> ``truncated``.
  When ``max_chars`` is shorter than the marker the text is cut to ``max_chars`` without one.
  Every non-``ok`` text starts with ``"Error: "``.

Workers:

* **Started as fresh interpreters** (``sys.executable -c ...``, the equivalent of multiprocessing's "spawn"
  context without its re-import of the parent's ``__main__``, which in a training script imports torch): a
  worker imports ``rlplug`` (its package ``__init__``, no torch, about 0.3 s), this module and whatever
  unpickling the tools imports
  (a tool defined in a module that imports torch still brings torch in; the packaged ``calculator`` imports
  ``rlplug.plugin``, which imports no torch, so its worker starts in about 0.5-1 s; a tool defined beside light
  imports in about 0.4 s). The tools are pickled once, in the constructor; the worker
  gets the parent's ``sys.path``. A tool that cannot be pickled (a closure, a lambda, a class defined in
  ``__main__``) makes the whole pool fall back to ``os.fork`` of the parent, with a :class:`RuntimeWarning`:
  a forked worker shares the parent's memory image (torch included) and inherits its locks, so a tool that
  uses torch or threads there may deadlock; define tools at module level to avoid it.
* **Started lazily** (at the first call needing one, up to ``workers``) or all at once by :meth:`start`;
  reused across calls; the start (a few tenths of a second) does not count against a call's timeout.
* **Isolated by a guard, not a sandbox**: stdout and stderr go to ``/dev/null`` (a tool printing 10 MB
  neither floods the trainer's output nor blocks on a full pipe); ``RLIMIT_AS`` is ``memory_mb`` MiB when
  > 0, set after the tools are loaded, so it counts the interpreter and the tools' imports (a worker whose
  address space already exceeds it refuses to start, saying so; a forked worker, which holds the trainer's whole
  image, may add ``memory_mb`` to it); a ``MemoryError`` is the call's ``error``
  and the worker is replaced after it. A tool without ``needs_network = True`` (on the tool, or on a
  :class:`~rlplug.contracts.agents.FunctionTool`'s function) gets a ``PermissionError`` naming the attribute
  when it creates an ``AF_INET``/``AF_INET6`` socket through :mod:`socket` (``socket.socket``,
  ``socket.create_connection``: urllib, http.client, asyncio and requests go through them). Code that calls
  ``_socket`` directly or starts a subprocess is not stopped: this guards against accidents, it does not
  contain hostile code. Each worker is its own session (a timeout kills the tool's subprocesses with it),
  ignores SIGINT (the parent decides), and exits when the parent dies (it checks its parent every 0.5 s).

Concurrency and time: up to ``workers`` calls run at once; more wait, in order, for a free worker. The
timeout (``timeout_s``, else the runner's default) bounds the tool's *run* in the worker, not the wait
(so a burst of calls queued behind a slow one does not time out tools that never ran); pass ``deadline``
(a :func:`time.monotonic` instant: the episode's end) to bound the whole call, wait included -- a call still
waiting at its deadline ends with ``timeout`` without running, and a running one gets at most the time left.
:meth:`ToolRunner.call` hands the blocking work to a thread pool of ``workers`` threads, so the event loop is
never blocked and a sleeping tool holds only its own worker. Cancelling the awaiting task (``asyncio.wait_for``)
kills a running call's worker and drops a waiting one.

Cost of a call to a healthy, started worker (thread hop, two pickled messages over pipes, the tool itself):
median 0.12 ms for a trivial sync tool through :meth:`ToolRunner.call_sync`, 0.16 ms through ``await
call(...)``, 0.30 ms for a trivial ``async`` tool (``asyncio.run`` in the worker); measured over 200 calls each
on this project's 2-core CPU machine (Python 3.11), shared with other jobs. Starting a worker: about 0.4 s
for tools in a module with light imports (1 s under load), 0.8-1.3 s under load for the packaged
``calculator``, whose import is rlplug's package ``__init__`` (Hydra through ``rlplug.api``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Mapping
from typing import Any

from rlplug.contracts.agents import ToolArgumentError, ToolError, ToolProtocol, ToolResult, validate_arguments

__all__ = ["ToolRunner", "truncate_text", "WORKER_START_TIMEOUT_S"]

_log = logging.getLogger(__name__)

#: seconds a worker may take to start (import, unpickle the tools) before its call fails with ``crash``
WORKER_START_TIMEOUT_S = 120.0
#: how often a waiting call checks for cancellation or the runner's close (seconds)
_POLL_S = 0.05
_STAT_KEYS = ("calls", "ok", "error", "bad_arguments", "unknown_tool", "timeout", "crash", "truncated")

# the worker's bootstrap: stdlib only until the parent's sys.path is in place, and any failure reported back
_BOOTSTRAP = """
import sys
from multiprocessing.connection import Connection
requests = Connection(int(sys.argv[1]), writable=False)
replies = Connection(int(sys.argv[2]), readable=False)
try:
    setup = requests.recv()
    sys.path[:] = setup["sys_path"]
    from rlplug.orchestration.tool_workers import _serve
except BaseException:
    import traceback
    replies.send(("startup_error", traceback.format_exc()))
    raise SystemExit(1)
_serve(requests, replies, setup)
"""


def truncate_text(text: str, max_chars: int) -> tuple[str, bool]:
    """``(text, truncated)``: ``text`` cut to at most ``max_chars`` characters, the head kept and the marker
    ``...[truncated N chars]`` (N: the characters removed) counted inside ``max_chars``; when the marker alone
    does not fit, a plain cut. ``max_chars <= 0``: no limit."""
    if max_chars <= 0 or len(text) <= max_chars:
        return text, False
    keep = max_chars
    for _ in range(3):  # the marker's length depends on N's digits, which depend on the cut: a fixed point
        marker = f"...[truncated {len(text) - keep} chars]"
        keep = max_chars - len(marker)
    if keep < 0:
        return text[:max_chars], True
    return text[:keep] + f"...[truncated {len(text) - keep} chars]", True


def _seconds(value: float) -> str:
    return f"{value:g}"


# ============================================================================ the worker's side


def _guard_network(allowed: bool, tool_name: str, originals: dict[str, Any]) -> None:
    """Put back the original :mod:`socket` functions (``allowed``), or replace them with ones refusing
    ``AF_INET``/``AF_INET6`` sockets with a ``PermissionError`` naming ``tool_name``."""
    import socket

    if allowed:
        socket.socket = originals["socket"]  # type: ignore[misc]
        socket.create_connection = originals["create_connection"]
        return
    message = f"tool {tool_name!r} has no network access; set needs_network = True on the tool to allow it"
    base = originals["socket"]
    inet = (-1, socket.AF_INET, socket.AF_INET6)

    class GuardedSocket(base):  # type: ignore[misc, valid-type]
        def __init__(self, family: int = -1, type: int = -1, proto: int = -1, fileno: Any = None) -> None:
            if fileno is None and family in inet:  # -1: socket.socket's default family, AF_INET
                raise PermissionError(message)
            super().__init__(family, type, proto, fileno)

    def create_connection(*args: Any, **kwargs: Any) -> Any:
        raise PermissionError(message)

    socket.socket = GuardedSocket  # type: ignore[misc]
    socket.create_connection = create_connection


def _needs_network(tool: Any) -> bool:
    if getattr(tool, "needs_network", False):
        return True
    return bool(getattr(getattr(tool, "fn", None), "needs_network", False))


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _run_one(
    tools: Mapping[str, Any], name: str, arguments: Mapping[str, Any], max_chars: int, memory_mb: int
) -> tuple[str, str, bool, bool]:
    """Run one call in the worker: ``(status, text, truncated, retire)``; ``retire``: replace this worker."""
    import socket

    originals = {"socket": socket.socket, "create_connection": socket.create_connection}
    tool = tools[name]
    retire = False
    try:
        _guard_network(_needs_network(tool), name, originals)
        try:
            result = tool(**arguments)
            if inspect.isawaitable(result):
                result = asyncio.run(_awaited(result))
        finally:
            _guard_network(True, name, originals)
        status, text = "ok", result if isinstance(result, str) else str(result)
    except ToolArgumentError as exc:
        status, text = "bad_arguments", f"Error: {exc}"
    except ToolError as exc:
        status, text = "error", f"Error: {exc}"
    except MemoryError as exc:
        limit = f" (the worker's limit is {memory_mb} MiB)" if memory_mb > 0 else ""
        status, text, retire = "error", f"Error: MemoryError: the tool ran out of memory{limit} {exc}".rstrip(), True
    except BaseException as exc:  # SystemExit, KeyboardInterrupt from a tool too: the call fails, not the worker
        message = str(exc)
        status = "error"
        text = f"Error: {type(exc).__name__}: {message}" if message else f"Error: {type(exc).__name__}"
        retire = not isinstance(exc, Exception)
    text, truncated = truncate_text(text, max_chars)
    return status, text, truncated, retire


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(70)


def _address_space_mib() -> float:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _serve(requests: Any, replies: Any, setup: Mapping[str, Any]) -> None:
    """The worker's loop: load the tools, set the limits, answer ``(name, arguments)`` requests until EOF."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        tools = setup["tools"] if "tools" in setup else pickle.loads(setup["tools_pickle"])
        threading.Thread(target=_watch_parent, args=(setup["parent"],), daemon=True).start()
        memory_mb = int(setup["memory_mb"])
        if memory_mb > 0:
            import resource

            used = _address_space_mib()
            if "tools" in setup:  # a fork holds the trainer's whole image: the limit is what it may add to it
                memory_mb += int(used)
            if used > memory_mb:
                raise MemoryError(
                    f"the tool worker already uses {used:.0f} MiB of address space after loading the tools, above "
                    f"its limit of {memory_mb} MiB (rollout.multi_turn.tool_memory_mb); raise the limit, or define "
                    "the tools in a module with lighter imports"
                )
            limit = memory_mb * 1024 * 1024
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except BaseException:
        replies.send(("startup_error", traceback.format_exc()))
        return
    replies.send(("ready", os.getpid()))
    max_chars = int(setup["max_chars"])
    while True:
        try:
            request = requests.recv()
        except (EOFError, OSError):
            return
        if request is None:
            return
        name, arguments = request
        try:
            reply = _run_one(tools, name, arguments, max_chars, int(setup["memory_mb"]))
            replies.send(reply)
        except MemoryError:
            replies.send(("error", "Error: MemoryError: the tool's reply did not fit in memory", False, True))


# ============================================================================ the parent's side


class _Worker:
    """One worker process (a ``subprocess.Popen``, or a forked pid) and its two pipes."""

    def __init__(self, pid: int, popen: subprocess.Popen[bytes] | None, requests: Any, replies: Any) -> None:
        self.pid = pid
        self.popen = popen
        self.requests = requests
        self.replies = replies
        self.returncode: int | None = None

    def kill(self) -> None:
        """SIGKILL the worker's process group (the tool's own subprocesses too), reap it, close the pipes."""
        if self.returncode is None:
            for kill in (os.killpg, os.kill):
                try:
                    kill(self.pid, signal.SIGKILL)
                    break
                except (ProcessLookupError, PermissionError):
                    continue
            self.reap()
        for conn in (self.requests, self.replies):
            try:
                conn.close()
            except OSError:
                pass

    def reap(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        try:
            if self.popen is not None:
                self.returncode = self.popen.wait(timeout=10)
            else:
                _, status = os.waitpid(self.pid, 0)
                self.returncode = os.waitstatus_to_exitcode(status)
        except (subprocess.TimeoutExpired, ChildProcessError, OSError):
            return None
        return self.returncode

    def describe_death(self) -> str:
        code = self.reap()
        if code is None:
            return "for an unknown reason"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            extra = " (killed from outside, or by the kernel for lack of memory)" if -code == signal.SIGKILL else ""
            return f"by {name}{extra}"
        return f"with exit code {code}"


class _Job:
    def __init__(self, name: str, arguments: dict[str, Any], timeout_s: float, deadline: float | None) -> None:
        self.name = name
        self.arguments = arguments
        self.timeout_s = timeout_s
        self.deadline = deadline
        self.cancelled = False


class ToolRunner:
    """Run tool calls in a pool of worker processes, each call ending in a :class:`ToolResult` (see the module
    docstring for what happens to a failing, hanging, crashing, flooding or memory-hungry tool).

    ``tools``: name -> tool (:class:`~rlplug.contracts.agents.ToolProtocol`; the name the model calls it by).
    ``timeout_s``: default seconds a call may run in its worker (``rollout.multi_turn.tool_timeout_s``; > 0).
    ``max_chars``: longest reply in characters, marker included (``max_tool_response_length``; <= 0: no cut).
    ``memory_mb``: each worker's ``RLIMIT_AS`` in MiB (``tool_memory_mb``; 0: none). ``workers``: worker
    processes, the most calls running at once (``tool_workers``; >= 1).

    Raises ``ValueError`` for ``timeout_s <= 0``, ``workers < 1`` or ``memory_mb < 0``. Use it as a context
    manager, or call :meth:`close`; a runner that is garbage-collected kills its workers too.
    """

    def __init__(
        self,
        tools: Mapping[str, ToolProtocol],
        *,
        timeout_s: float = 10.0,
        max_chars: int = 256,
        memory_mb: int = 1024,
        workers: int = 2,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds (rollout.multi_turn.tool_timeout_s), got {timeout_s}")
        if workers < 1:
            raise ValueError(f"workers must be >= 1 (rollout.multi_turn.tool_workers), got {workers}")
        if memory_mb < 0:
            raise ValueError(
                f"memory_mb must be >= 0 MiB (0: no limit; rollout.multi_turn.tool_memory_mb), got {memory_mb}"
            )
        self.tools: dict[str, ToolProtocol] = dict(tools)
        self.timeout_s = float(timeout_s)
        self.max_chars = int(max_chars)
        self.memory_mb = int(memory_mb)
        self.workers = int(workers)
        self._tools_pickle: bytes | None = None
        unpicklable: list[str] = []
        try:
            self._tools_pickle = pickle.dumps(self.tools)
        except Exception:
            for name, tool in self.tools.items():
                try:
                    pickle.dumps(tool)
                except Exception as exc:
                    unpicklable.append(f"{name} ({type(exc).__name__}: {exc})")
        if self._tools_pickle is not None and b"__main__" in self._tools_pickle:
            self._tools_pickle = None  # a fresh interpreter has another __main__: only a fork can run these
            unpicklable.append("a tool defined in __main__")
        if self._tools_pickle is None:
            warnings.warn(
                f"ToolRunner: these tools cannot be pickled into a fresh worker: {', '.join(unpicklable)}; its "
                "workers are forks of this process instead (they share its memory image and locks: a tool using "
                "torch or threads may deadlock). Define tools at module level to avoid it.",
                RuntimeWarning,
                stacklevel=2,
            )
        self._lock = threading.Condition()
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self._starting = 0
        self._closed = False
        self._stats: dict[str, float] = dict.fromkeys(_STAT_KEYS, 0.0)
        self._stats.update(seconds=0.0, worker_starts=0.0, bytes_received=0.0)
        self._executor = concurrent.futures.ThreadPoolExecutor(self.workers, thread_name_prefix="rlplug-tool")

    # ------------------------------------------------------------------ public

    @property
    def stats(self) -> dict[str, float]:
        """Counts since creation: ``calls`` and one per status (``ok``, ``error``, ``bad_arguments``,
        ``unknown_tool``, ``timeout``, ``crash``), ``truncated`` (replies cut), ``seconds`` (summed wall time of
        the calls), ``worker_starts`` and ``bytes_received`` (pickled replies from the workers). A call whose
        awaiting task was cancelled while it ran counts as an ``error``."""
        with self._lock:
            return dict(self._stats)

    async def call(
        self, name: str, arguments: Mapping[str, Any], *, timeout_s: float | None = None, deadline: float | None = None
    ) -> ToolResult:
        """Call tool ``name`` with ``arguments`` (the decoded JSON object of the model's call) in a worker.

        ``timeout_s``: seconds the tool may run (default: the runner's); ``deadline``: a :func:`time.monotonic`
        instant bounding the whole call, the wait for a free worker included. Never raises (every failure is a
        status, see the module docstring) except ``asyncio.CancelledError`` when the awaiting task is cancelled
        (a running call's worker is then killed). Does not block the event loop.
        """
        started = time.monotonic()
        early = self._check(name, arguments, timeout_s, deadline, started)
        if isinstance(early, ToolResult):
            return early
        try:
            future = self._executor.submit(self._run_job, early, started)
        except RuntimeError:  # closed between the check and the submit
            return self._finish(ToolResult("Error: the tool runner is closed", "error"), started)
        waiting = asyncio.wrap_future(future)
        try:
            if early.deadline is not None:  # a call still queued at its deadline never runs
                await asyncio.wait({waiting}, timeout=max(early.deadline - time.monotonic(), 0.0))
                if not waiting.done() and future.cancel():
                    waiting.cancel()
                    return self._late(early, started)
            return await waiting
        except asyncio.CancelledError:
            early.cancelled = True
            future.cancel()
            raise

    def call_sync(
        self, name: str, arguments: Mapping[str, Any], *, timeout_s: float | None = None, deadline: float | None = None
    ) -> ToolResult:
        """:meth:`call` for synchronous callers (blocks the calling thread; never call it on an event loop)."""
        started = time.monotonic()
        early = self._check(name, arguments, timeout_s, deadline, started)
        if isinstance(early, ToolResult):
            return early
        try:
            future = self._executor.submit(self._run_job, early, started)
        except RuntimeError:
            return self._finish(ToolResult("Error: the tool runner is closed", "error"), started)
        if early.deadline is not None:
            concurrent.futures.wait([future], timeout=max(early.deadline - time.monotonic(), 0.0))
            if future.cancel():
                return self._late(early, started)
        return future.result()

    def start(self) -> None:
        """Start every worker now (in parallel) instead of at the first calls; returns when they are ready.
        A worker that fails to start is reported by the call that next needs one."""
        with self._lock:
            missing = self.workers - len(self._all) - self._starting
            self._starting += max(missing, 0)
        threads = [threading.Thread(target=self._start_idle_worker) for _ in range(max(missing, 0))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def close(self) -> None:
        """Kill every worker (running calls end with ``error``); later calls return ``error``. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers = list(self._all)
            self._all.clear()
            self._idle.clear()
            self._lock.notify_all()
        for worker in workers:
            worker.kill()
        self._executor.shutdown(wait=False)

    def __enter__(self) -> ToolRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # ------------------------------------------------------------------ internals

    def _finish(self, result: ToolResult, started: float) -> ToolResult:
        seconds = time.monotonic() - started
        result = ToolResult(result.text, result.status, seconds, result.truncated)
        with self._lock:
            self._stats["calls"] += 1
            self._stats[result.status] += 1
            self._stats["truncated"] += float(result.truncated)
            self._stats["seconds"] += seconds
        return result

    def _late(self, job: _Job, started: float) -> ToolResult:
        text = f"Error: the call to tool {job.name!r} waited for a free tool worker past its deadline"
        return self._error(text, "timeout", started)

    def _error(self, text: str, status: str, started: float) -> ToolResult:
        text, truncated = truncate_text(text, self.max_chars)
        return self._finish(ToolResult(text, status, truncated=truncated), started)

    def _check(
        self, name: str, arguments: Mapping[str, Any], timeout_s: float | None, deadline: float | None, started: float
    ) -> ToolResult | _Job:
        """A :class:`ToolResult` for a call that cannot run (closed, unknown tool, bad arguments), else its job."""
        if self._closed:
            return self._error("Error: the tool runner is closed", "error", started)
        if name not in self.tools:
            listing = ", ".join(sorted(self.tools)) or "none"
            return self._error(f"Error: unknown tool {name!r}; the tools are: {listing}", "unknown_tool", started)
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        if not timeout > 0:
            return self._error(
                f"Error: the call to tool {name!r} got no time (timeout {timeout} s)", "timeout", started
            )
        tool = self.tools[name]
        try:
            checked = validate_arguments(name, tool.parameters, arguments)
        except ToolArgumentError as exc:
            return self._error(f"Error: {exc}", "bad_arguments", started)
        except Exception:  # a tool with an unusual schema checks its own arguments in the worker
            checked = dict(arguments) if isinstance(arguments, Mapping) else {}
        return _Job(name, checked, timeout, deadline)

    def _spawn(self) -> _Worker:
        """Start one worker process (not yet ready: :meth:`_start_worker` waits for it)."""
        from multiprocessing.connection import Connection

        request_read, request_write = os.pipe()
        reply_read, reply_write = os.pipe()
        setup: dict[str, Any] = {
            "sys_path": list(sys.path),
            "parent": os.getpid(),
            "max_chars": self.max_chars,
            "memory_mb": self.memory_mb,
        }
        if self._tools_pickle is not None:
            env = dict(os.environ)
            env.setdefault("MALLOC_ARENA_MAX", "2")  # glibc's 64 MiB arenas per thread would count in RLIMIT_AS
            try:
                popen = subprocess.Popen(
                    [sys.executable, "-c", _BOOTSTRAP, str(request_read), str(reply_write)],
                    pass_fds=(request_read, reply_write),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                    env=env,
                )
            finally:
                os.close(request_read)
                os.close(reply_write)
            worker = _Worker(
                popen.pid, popen, Connection(request_write, readable=False), Connection(reply_read, writable=False)
            )
            worker.requests.send({**setup, "tools_pickle": self._tools_pickle})
            return worker
        pid = os.fork()
        if pid == 0:  # the forked worker: never return into the parent's code
            code = 0
            try:
                os.setsid()
                os.close(request_write)
                os.close(reply_read)
                devnull = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(devnull, fd)
                sys.stdout = sys.stderr = open(os.devnull, "w")  # lives as long as the worker
                _serve(
                    Connection(request_read, writable=False),
                    Connection(reply_write, readable=False),
                    {**setup, "tools": self.tools},
                )
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        os.close(request_read)
        os.close(reply_write)
        return _Worker(pid, None, Connection(request_write, readable=False), Connection(reply_read, writable=False))

    def _start_worker(self) -> _Worker:
        """A started, ready worker; raises ``RuntimeError`` saying why one could not start."""
        with self._lock:  # one start at a time: a fork must not inherit another start's pipe ends
            worker = self._spawn()
            self._stats["worker_starts"] += 1
        try:
            if not worker.replies.poll(WORKER_START_TIMEOUT_S):
                raise RuntimeError(f"it did not start within {_seconds(WORKER_START_TIMEOUT_S)} s")
            kind, detail = worker.replies.recv()
        except (EOFError, OSError):
            worker.kill()
            raise RuntimeError(f"it exited while starting ({worker.describe_death()})") from None
        except RuntimeError:
            worker.kill()
            raise
        if kind != "ready":
            worker.kill()
            last = str(detail).strip().splitlines()[-1] if str(detail).strip() else "no detail"
            _log.error("a tool worker failed while starting:\n%s", detail)
            raise RuntimeError(f"it failed while starting: {last}")
        return worker

    def _start_idle_worker(self) -> None:
        try:
            worker = self._start_worker()
        except Exception:
            worker = None
        with self._lock:
            self._starting -= 1
            if worker is not None and not self._closed:
                self._all.add(worker)
                self._idle.append(worker)
                self._lock.notify()
                return
        if worker is not None:
            worker.kill()

    def _acquire(self, job: _Job) -> _Worker | str:
        """A ready worker for ``job``, or the reason there is none (the runner closed, its deadline passed)."""
        with self._lock:
            while True:
                if self._closed:
                    return "Error: the tool runner is closed"
                if job.cancelled:
                    return "cancelled"
                if job.deadline is not None and time.monotonic() >= job.deadline:
                    return "late"
                if self._idle:
                    return self._idle.pop()
                if len(self._all) + self._starting < self.workers:
                    self._starting += 1
                    break
                self._lock.wait(_POLL_S)
        try:
            worker = self._start_worker()
        except Exception as exc:
            with self._lock:
                self._starting -= 1
            return f"Error: the worker process for tool {job.name!r} could not start: {exc}"
        with self._lock:
            self._starting -= 1
            if self._closed:
                worker.kill()
                return "Error: the tool runner is closed"
            self._all.add(worker)
        return worker

    def _release(self, worker: _Worker, healthy: bool) -> None:
        with self._lock:
            if healthy and not self._closed and worker in self._all:
                self._idle.append(worker)
                self._lock.notify()
                return
            self._all.discard(worker)
            self._lock.notify()
        worker.kill()

    def _run_job(self, job: _Job, started: float) -> ToolResult:
        """The blocking part of a call, on one of the runner's threads."""
        for attempt in range(2):  # a worker found dead while idle (killed from outside) is replaced once
            acquired = self._acquire(job)
            if isinstance(acquired, str):
                status = "crash" if "could not start" in acquired else "error"
                if acquired == "late":
                    return self._late(job, started)
                if acquired == "cancelled":
                    acquired = f"Error: the call to tool {job.name!r} was cancelled"
                return self._error(acquired, status, started)
            worker = acquired
            try:
                worker.requests.send((job.name, job.arguments))
                break
            except (OSError, ValueError):  # the worker died while idle: the tool has not run
                self._release(worker, healthy=False)
                if attempt:
                    why = worker.describe_death()
                    return self._error(f"Error: the process running tool {job.name!r} died {why}", "crash", started)
        budget = job.timeout_s
        if job.deadline is not None:
            budget = min(budget, job.deadline - time.monotonic())
        run_start = time.monotonic()
        while True:
            left = run_start + budget - time.monotonic()
            if left <= 0:
                self._release(worker, healthy=False)
                return self._error(
                    f"Error: the call to tool {job.name!r} took longer than {_seconds(budget)} s and was stopped",
                    "timeout",
                    started,
                )
            if self._closed or job.cancelled:
                self._release(worker, healthy=False)
                what = "the tool runner was closed" if self._closed else "the call was cancelled"
                return self._error(f"Error: {what} during the call to tool {job.name!r}", "error", started)
            try:
                ready = worker.replies.poll(min(_POLL_S, left))
            except (OSError, ValueError):
                ready = True
            if ready:
                break
        try:
            data = worker.replies.recv_bytes()
            status, text, truncated, retire = pickle.loads(data)
        except (EOFError, OSError, ValueError, pickle.UnpicklingError):
            self._release(worker, healthy=False)
            if self._closed:
                return self._error(
                    f"Error: the tool runner was closed during the call to tool {job.name!r}", "error", started
                )
            why = worker.describe_death()
            return self._error(
                f"Error: the process running tool {job.name!r} died {why} during the call", "crash", started
            )
        with self._lock:
            self._stats["bytes_received"] += len(data)
        self._release(worker, healthy=not retire)
        return self._finish(ToolResult(text, status, truncated=truncated), started)
