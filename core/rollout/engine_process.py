"""A rollout backend run in a process of its own: what the asynchronous modes generate with.

Why
---
Under ``trainer.async_mode=one_step_off`` or ``async`` (issue 34) generation and training run at
the same time. In one process they would share one torch thread pool and one set of cores, so
``rollout.num_threads`` and ``trainer.num_threads`` could not both hold, and an engine's Python
work would contend with the trainer's for the GIL. :class:`EngineProcess` runs any registered
rollout backend (``hf`` included) in a child process with its own thread count and cores;
:func:`build_engine` is what the trainer calls to get its engine, and keeps ``sync`` runs exactly
as before. Backends that already run outside the trainer (``vllm``'s engine child, the server
backends) declare ``runs_out_of_process = True`` (:func:`out_of_process`) and are used as they are.

The child
---------
``python -m rlplug.rollout.engine_process --engine-child READ_FD WRITE_FD PARENT_PID``, started
with :mod:`subprocess` (not :mod:`multiprocessing`, whose ``spawn`` re-imports the trainer's
``__main__``). Parent and child talk over two OS pipes wrapped in
:class:`multiprocessing.connection.Connection`: the parent sends pickled ``(command, payload)``
tuples, the child answers each with ``("ok", result)`` or ``("error", traceback text)``. The first
command, ``init``, carries the run config (resolved to plain containers), the tokenizer (pickled:
the trainer's own object, with whatever it changed) and the factory (pickled by reference when it
is a module-level class or function, else looked up by name in the child's plugin registry). Before
torch is imported the child binds itself to ``trainer.engine_cpus`` (``os.sched_setaffinity``; None:
the parent's cores) and runs ``rollout.num_threads`` torch threads (None: one per core it may use;
``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` are set in its environment to the same number). Its
stdout and stderr go to ``engine.log`` in a temp folder (``rlplug-engine-*``), whose last lines the
errors quote; the folder is deleted by :meth:`EngineProcess.close` unless the child failed.

The child exits on the ``close`` command, when the pipe closes, or when the parent dies (a watchdog
thread compares ``os.getppid()`` with the parent's pid once a second; ``PR_SET_PDEATHSIG`` is not
used, as it fires when the *thread* that started the child exits, and the async pipeline may start
it from a worker thread). It ignores SIGINT and SIGTERM sent to the process group (Ctrl-C, a
scheduler's cancel): those are for the trainer, which finishes its step and then closes the engine.

Weights
-------
:meth:`EngineProcess.update_weights` copies the tensors to the CPU (as they are: the backend casts),
writes them as one safetensors file to ``/dev/shm`` (:func:`rlplug.rollout.utils.shm_dir`; named
``rlplug-engine-weights-<trainer pid>-*``) and sends its path (and the names in the caller's order);
the child loads it and hands the dict to the backend's ``update_weights``. The parent keeps the latest
file for a restarted child (below): each push deletes the previous file before writing its own, so
there is at most one model copy there, and :meth:`EngineProcess.close` (or the object's finalizer)
deletes the last one. A trainer killed by SIGKILL cannot: the next :class:`EngineProcess` started on
the machine deletes every such file whose process is gone. Measured on the 2-core CPU machine
(torch 2.13.0+cpu, AMD EPYC; a push into a backend that copies every tensor into its parameters):
the tiny test model, 6.4M fp32 parameters (25 MB), 34 ms; 135M fp32 parameters (540 MB, SmolLM2-135M's
size) in 30 tensors, 0.5 s (0.7 s the first time, while the backend allocates), 0.27 s of it writing
and loading the file.
(torch's tensor sharing, :mod:`torch.multiprocessing`, needs a ``multiprocessing``-started child to
pass file descriptors or names; a file needs nothing, and is what the ``vllm`` backend pushes too.)

Calls
-----
One :class:`threading.Lock` serialises the commands: the async pipeline generates from a producer
thread and pushes weights from the trainer's; a second caller waits for the first to finish.
A failing backend call raises :class:`EngineProcessError` with the child's traceback, and the
child keeps serving. A child that does not answer within a command's timeout (``init``:
``RLPLUG_ENGINE_STARTUP_TIMEOUT_S``; ``memory``: 60 s) or whose call is interrupted (Ctrl-C) is
stopped, and every later call raises.

Restarts
--------
A child that dies during a command (``generate``, ``update_weights``, ``sleep``, ``wake_up``,
``memory``, ``call``; SIGKILL from the OOM killer, a crash) is restarted, at most
``rollout.max_restarts`` times in the object's life (default 3; 0: never): a warning names its exit
code or signal and quotes its log, a new child gets the same ``init`` (same config, tokenizer, cores
and threads; its output appended to the same log), loads the latest pushed weights file when there
was a push (so it holds the weights the dead one held, not the model's initial ones), is put back to
sleep when the last of :meth:`EngineProcess.sleep` / :meth:`EngineProcess.wake_up` was ``sleep``, and
is sent the interrupted command once more, under the same lock (for ``update_weights`` the new
child's loading of the pushed file is the retry). Backends that seed each call from
``SamplingParams.seed`` (``hf``: :mod:`rlplug.plugins.rollout.hf`) therefore return the same
``RolloutOutput`` as without the death: the batch does not depend on it. ``restarts`` counts them;
``generate`` reports the count as ``rollout/engine_restarts`` from the first restart on.

:class:`EngineProcessError` (quoting the log), and every later call raises too, when the child dies
and no restart is left, when it dies again on the retried command, when the new child fails to
start, when :meth:`EngineProcess.close` is in progress (it never restarts), or when no copy of the
dead child's weights exists, as a new child would then generate with other weights: a push deletes the
previous file before it writes its own, so from then until the push gets the lock (after the command
in progress: a ``generate`` in the asynchronous modes) the child holds weights that are in no file;
likewise after a failed push, until a push succeeds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Iterable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlplug.base.host_memory import heap_mib, malloc_trim, rss_bytes
from rlplug.base.processes import start_pipe_child, stop_pipe_child
from rlplug.config.schema import ModelConfig, RolloutConfig, TrainerConfig, typed
from rlplug.contracts.kinds import built_classes
from rlplug.contracts.registry import Registry, get_registry
from rlplug.contracts.types import RolloutOutput, SamplingParams

if TYPE_CHECKING:
    import torch

__all__ = ["EngineProcess", "EngineProcessError", "build_engine", "out_of_process"]

log = logging.getLogger(__name__)

#: ``trainer.async_mode`` values that run the engine in a process of its own
ASYNC_MODES = ("one_step_off", "async")
#: seconds to wait for the child to load the model and build the backend
STARTUP_TIMEOUT_S = float(os.environ.get("RLPLUG_ENGINE_STARTUP_TIMEOUT_S", "600"))
#: seconds :meth:`EngineProcess.close` waits for a running command before it kills the child
CLOSE_WAIT_S = 30.0
#: file-name prefix of pushed weights: ``rlplug-engine-weights-<trainer pid>-<random>.safetensors``
WEIGHTS_PREFIX = "rlplug-engine-weights-"


class EngineProcessError(RuntimeError):
    """The rollout engine's process failed: a backend call raised there (the message carries the
    child's traceback), the child died (its exit code and last log lines), or it did not start."""


def out_of_process(factory: Any, registry: Registry | None = None) -> bool:
    """Whether the rollout factory ``factory`` already runs its engine outside the calling process.

    True when ``factory`` itself, or a class it builds, has ``runs_out_of_process = True`` (a class
    attribute, or an attribute of a factory function). The classes it builds: ``factory`` when it is
    a class, its ``builds`` attribute, and the ``builds=`` of every registration of ``factory`` as a
    ``rollout_backend`` in ``registry`` (None: the process-wide :func:`get_registry`). The packaged
    ``vllm`` backend (an engine child), ``vllm`` in server mode and ``sglang`` (servers) are; ``hf``
    is not.
    """
    registry = registry if registry is not None else get_registry()
    classes = list(built_classes(factory))
    for reg in registry.entries.get("rollout_backend", {}).values():
        if reg.obj is factory:
            classes += built_classes(reg.obj, reg.extra)
    return any(getattr(obj, "runs_out_of_process", False) is True for obj in (factory, *classes))


def build_engine(cfg: Any, registry: Registry, model_path: str, tokenizer: Any, *, own_process: bool = False) -> Any:
    """The run's rollout engine (a :class:`rlplug.contracts.types.RolloutBackend`).

    ``trainer.async_mode=sync`` (the default): ``registry.get("rollout_backend", cfg.rollout.name)(cfg,
    model_path, tokenizer)``, the backend in this process as ever. ``one_step_off`` / ``async``, or
    ``own_process`` (an engine per rank, :mod:`rlplug.rollout.colocate`): an :class:`EngineProcess` running that
    backend, unless it already runs outside this process (:func:`out_of_process`), in which case the factory's
    object as in ``sync``. Raises ``ValueError`` for another ``async_mode``; what the factory or
    :class:`EngineProcess` raise.
    """
    name = str(cfg.rollout.name)
    factory = registry.get("rollout_backend", name)
    mode = str(typed(TrainerConfig, cfg.trainer).async_mode)
    if mode == "sync" and not own_process:
        return factory(cfg, model_path, tokenizer)
    if mode not in (*ASYNC_MODES, "sync"):
        raise ValueError(f"trainer.async_mode={mode!r} is not a mode; use 'sync', 'one_step_off' or 'async'.")
    if out_of_process(factory, registry):
        return factory(cfg, model_path, tokenizer)
    return EngineProcess(cfg, name, model_path, factory=factory, tokenizer=tokenizer)


class EngineProcess:
    """A rollout backend hosted in a child process (see the module docstring); a ``RolloutBackend``.

    ``EngineProcess(cfg, factory_name, model_path, *, factory=None, tokenizer=None)``: ``cfg`` is the
    whole run config (``DictConfig`` or mapping), ``factory_name`` the registered ``rollout_backend``
    name, ``factory`` the registered object when the caller has it (sent pickled when it pickles by
    reference, a module-level class or function; else the child looks ``factory_name`` up in its
    registry), ``tokenizer`` the trainer's tokenizer (None, or one that does not pickle: the child loads
    ``model_path``'s, with ``model.trust_remote_code``, left padding and EOS as pad). Reads ``rollout.num_threads`` (torch
    threads in the child; None: ``len(trainer.engine_cpus)`` when set, else ``os.cpu_count()``),
    ``rollout.max_restarts`` (restarts of a child that died, in the object's life; 0: none),
    ``trainer.engine_cpus`` (the child's cores; None: the parent's), ``trainer.malloc_trim`` (the child
    returns its free heap to the OS after each generate and push) and whatever the backend reads.
    Blocks until the backend is built (``startup_s``: seconds).

    A child that dies during a command is restarted (see the module docstring's "Restarts"): a new
    child gets the same ``init``, the latest pushed weights and the last :meth:`sleep` / :meth:`wake_up`
    state, and the command is sent to it once more.

    Attributes: ``pid`` (the live child's, a new one after a restart; None once closed or gone: the
    trainer logs its resident size as ``perf/rollout_rss_gb``), ``restarts`` (children restarted so
    far), ``max_restarts``, ``metrics`` (the backend's ``metrics`` names plus ``rollout/engine_restarts``
    and ``perf/rollout_rss_gb``), ``num_threads`` and ``cpus`` (as the child reports them),
    ``last_update_s`` (seconds of the latest :meth:`update_weights`), ``log_path`` (every child's output,
    one after another).

    Raises ``ValueError`` when ``trainer.engine_cpus`` names cores this process may not use or
    ``rollout.max_restarts`` is negative, and :class:`EngineProcessError` when the child fails to start
    (its traceback or log quoted).
    """

    #: the engine is a child process: :func:`out_of_process` is true, so it is never wrapped twice
    runs_out_of_process = True

    def __init__(
        self,
        cfg: Any,
        factory_name: str,
        model_path: str,
        *,
        factory: Any = None,
        tokenizer: Any = None,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
    ) -> None:
        from omegaconf import DictConfig, OmegaConf  # deferred: omegaconf

        from rlplug.rollout.utils import shm_dir  # deferred: torch (rlplug.rollout.utils imports it)

        self.factory_name = str(factory_name)
        self.model_path = str(model_path)
        rollout = typed(RolloutConfig, cfg["rollout"] if "rollout" in cfg else None)
        trainer = typed(TrainerConfig, cfg["trainer"] if "trainer" in cfg else None)
        cpus_raw = trainer.engine_cpus
        allowed = os.sched_getaffinity(0)
        cpus: list[int] | None = None
        if cpus_raw is not None:
            cpus = sorted({int(c) for c in cpus_raw})
            if not cpus or not set(cpus) <= allowed:
                raise ValueError(
                    f"trainer.engine_cpus={list(cpus_raw)} must name cores this process may use: {sorted(allowed)}. "
                    "Pick a subset, or leave it unset to give the engine every core."
                )
        if rollout.num_threads is not None:
            threads = int(rollout.num_threads)
        else:
            threads = len(cpus) if cpus is not None else (os.cpu_count() or 1)
        if threads < 1:
            raise ValueError(f"rollout.num_threads must be >= 1 (or None: one per core), got {threads}.")
        self.max_restarts = int(rollout.max_restarts)
        if self.max_restarts < 0:
            raise ValueError(f"rollout.max_restarts must be >= 0 (0: never restart), got {self.max_restarts}.")
        container = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
        trust = bool(typed(ModelConfig, cfg["model"] if "model" in cfg else None).trust_remote_code)
        #: the ``init`` command's payload, sent again to a restarted child
        self._payload = {
            "cfg": container,
            "factory_name": self.factory_name,
            "factory": _pickled_reference(factory),
            "model_path": self.model_path,
            "tokenizer": _pickled_tokenizer(tokenizer),
            "trust_remote_code": trust,
            "num_threads": threads,
            "cpus": cpus,
            "sys_path": list(sys.path),
            "malloc_trim": bool(trainer.malloc_trim),
        }
        self._env = dict(os.environ)
        self._env["OMP_NUM_THREADS"] = self._env["MKL_NUM_THREADS"] = str(threads)
        self._startup_timeout_s = float(startup_timeout_s)
        self.last_update_s = 0.0
        self.restarts = 0
        self._lock = threading.Lock()  # one command at a time
        self._push_lock = threading.Lock()  # one update_weights at a time (its file is written outside _lock)
        self._files_lock = threading.Lock()  # the weights file's bookkeeping against a restart loading it
        self._closed = False
        self._closing = False
        self._dead: str | None = None
        self._asleep = False  # the latest successful sleep() / wake_up(), restored in a restarted child
        #: the latest pushed weights, ``[(path, names)]`` or ``[]`` (none, or its copy is gone): what a
        #: restarted child loads. A list shared with the finalizer, which deletes the file.
        self._weights: list[tuple[str, list[str]]] = []
        #: True while the child holds pushed weights of which no file exists (a push in progress or failed):
        #: a restart then would generate with other weights, so it is refused
        self._weights_missing = False
        self._weights_dir = shm_dir()
        _remove_stale_weights(self._weights_dir)
        self._weights_finalizer = weakref.finalize(self, _remove_weights, self._weights)
        self._finalizer: weakref.finalize | None = None
        self.log_dir = Path(tempfile.mkdtemp(prefix="rlplug-engine-"))
        self.log_path = self.log_dir / "engine.log"
        t0 = time.perf_counter()
        try:
            info = self._start()
        except BaseException:
            self._close(keep_logs=True)
            raise
        self.startup_s = time.perf_counter() - t0
        self.num_threads = int(info["num_threads"])
        self.cpus: list[int] = list(info["cpus"])
        own = ("rollout/engine_restarts", "perf/rollout_rss_gb")
        backend_metrics = info["metrics"]
        if backend_metrics is not None:  # forwarded only where the backend declares some, as its own attribute
            self.metrics: tuple[str, ...] = tuple(dict.fromkeys([*backend_metrics, *own]))
        else:
            self.metrics = own

    # ------------------------------------------------------------------ RolloutBackend
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> RolloutOutput:
        """The backend's ``generate`` in the child (see :class:`rlplug.contracts.types.RolloutBackend`).

        After a restart (:attr:`restarts` > 0) the output's ``metrics`` carry ``rollout/engine_restarts``,
        the restarts so far (absent before the first, so a run without deaths logs what ``sync`` logs).
        A batch interrupted by the child's death is generated again by the restarted child with the same
        weights and ``params`` (seed included): the same output as without the death.
        Raises :class:`EngineProcessError` (the backend raised: its traceback; or the child died and was
        not restarted, or died again)."""
        out = self._call("generate", ([list(map(int, p)) for p in prompt_ids], params))
        assert isinstance(out, RolloutOutput)
        if self.restarts:
            out.metrics["rollout/engine_restarts"] = float(self.restarts)
        return out

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | dict[str, torch.Tensor]) -> None:
        """Send the actor's weights (HF names, any dtype/device) to the backend's ``update_weights``.

        The tensors are copied to the CPU and written to one safetensors file in ``/dev/shm`` before
        the lock is taken (so a running ``generate`` is not held up by the copy); the child loads it.
        The file is kept, for a restarted child, until the next push, which deletes it before writing
        its own (one model copy at most), or :meth:`close`. A child that dies while loading it is
        restarted and loads it (that is the retry). ``last_update_s``: seconds, copy included. Raises
        :class:`EngineProcessError` (the backend rejected them -- unknown names or shapes -- or the
        child died and was not restarted); a failed push deletes its file, and a child that dies later
        is not restarted (no copy of the weights it holds exists) until a push succeeds."""
        import safetensors.torch  # deferred: safetensors (imports torch)

        self._check_open()
        with self._push_lock:
            t0 = time.perf_counter()
            tensors = _cpu_tensors(named_tensors)
            with self._files_lock:  # the previous copy goes first: at most one on disk / in RAM
                had_push = bool(self._weights)
                _remove_weights(self._weights)
                self._weights_missing = self._weights_missing or had_push
            fd, path = tempfile.mkstemp(
                prefix=f"{WEIGHTS_PREFIX}{os.getpid()}-", suffix=".safetensors", dir=self._weights_dir
            )
            os.close(fd)
            try:
                safetensors.torch.save_file(tensors, path)
                names = list(tensors)  # the file keeps its own order; the backend gets the caller's (tied weights)
                del tensors
                with self._lock:
                    self._check_open()
                    with self._files_lock:  # a death while loading it: the restarted child loads it
                        self._weights.append((path, names))
                        self._weights_missing = False
                    self._command("update_weights", (path, names), None)
            except BaseException:
                with self._files_lock:
                    self._weights_missing = True
                    _remove_weights(self._weights)
                with contextlib.suppress(OSError):
                    os.unlink(path)
                raise
            self.last_update_s = time.perf_counter() - t0

    def sleep(self) -> None:
        """The backend's ``sleep`` in the child (and in a child restarted later)."""
        self._call("sleep")

    def wake_up(self) -> None:
        """The backend's ``wake_up`` in the child."""
        self._call("wake_up")

    def memory(self) -> dict[str, float]:
        """The child's memory in MiB: ``rss_mib`` (resident size), ``heap_used_mib`` / ``heap_free_mib``
        (its C heap in use / held free; NaN where the C library is not glibc)."""
        return dict(self._call("memory", timeout=60.0))

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``backend.<method>(*args, **kwargs)`` in the child, for a backend's methods beyond the
        protocol (arguments and result pickled; sent again to a restarted child when the child died
        during it). Raises :class:`EngineProcessError`."""
        return self._call("call", (str(method), args, kwargs))

    @property
    def pid(self) -> int | None:
        """The live child's process id (a new one after a restart; None once closed or gone)."""
        return None if self._closed or self._dead is not None else int(self._proc.pid)

    def close(self) -> None:
        """Stop the child (``close``, then SIGTERM, then SIGKILL), delete the kept weights file and the log
        folder (kept when the child was gone); idempotent.

        A command running in another thread is waited for up to :data:`CLOSE_WAIT_S` seconds, then the
        child is killed at once (that command raises :class:`EngineProcessError`, "was closed"; it is
        not restarted)."""
        if self._closed:
            return
        self._closing = True
        got = self._lock.acquire(timeout=CLOSE_WAIT_S)
        try:
            if not got:  # a command still runs, so the child would read 'close' only after it: kill it now
                with contextlib.suppress(OSError):
                    self._proc.kill()
            self._close(keep_logs=self._dead is not None)
        finally:
            if got:
                self._lock.release()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ plumbing
    def _start(self) -> dict:
        """Start a child (its output appended to ``log_path``), send it ``init`` and return its answer.
        Raises :class:`EngineProcessError` (the backend failed to build, the child died, or
        :meth:`close` began meanwhile)."""
        argv = [sys.executable, "-m", "rlplug.rollout.engine_process", "--engine-child"]
        proc, send, recv = start_pipe_child(argv, self.log_path, env=self._env, tail=[str(os.getpid())])
        self._proc, self._send, self._recv = proc, send, recv
        self._finalizer = weakref.finalize(self, stop_pipe_child, proc, send, recv)
        if self._closing:  # close() from another thread may have stopped the previous child, not this one
            self._finalizer()
            raise EngineProcessError(
                f"The rollout engine process (backend '{self.factory_name}') was closed while it was restarted."
            )
        return dict(self._exchange("init", self._payload, self._startup_timeout_s))

    def _stop_child(self) -> None:
        """Stop the current child and close its pipes (:func:`rlplug.base.processes.stop_pipe_child`; once per child)."""
        if self._finalizer is not None:
            self._finalizer()

    def _close(self, *, keep_logs: bool) -> None:
        self._closed = True
        self._stop_child()
        self._weights_finalizer()  # the kept weights file
        if not keep_logs:
            import shutil  # deferred: only at close

            shutil.rmtree(self.log_dir, ignore_errors=True)

    def _check_open(self) -> None:
        if self._dead is not None:
            raise EngineProcessError(f"The rollout engine process is gone. {self._dead}")
        if self._closed:
            raise EngineProcessError(
                f"This rollout engine process ('{self.factory_name}') was closed; build a new one to generate."
            )

    def _call(self, cmd: str, payload: Any = None, timeout: float | None = None) -> Any:
        with self._lock:
            self._check_open()
            return self._command(cmd, payload, timeout)

    def _command(self, cmd: str, payload: Any, timeout: float | None) -> Any:
        """Send ``cmd`` and return the child's answer; a child that dies meanwhile is restarted and
        ``cmd`` sent again once (``update_weights``: the restarted child loaded the file, which is the
        retry). Called with ``_lock`` held. Raises :class:`EngineProcessError`."""
        try:
            result = self._exchange(cmd, payload, timeout)
        except _ChildDied as died:
            loaded = self._restart(cmd, died)
            if cmd == "update_weights":
                return loaded
            try:
                result = self._exchange(cmd, payload, timeout)
            except _ChildDied as again:
                self._dead = (
                    f"{again.headline} It had been restarted ({self.restarts} of rollout.max_restarts="
                    f"{self.max_restarts}) after dying on '{cmd}', which is not retried twice."
                )
                raise EngineProcessError(self._with_log(self._dead)) from again
        if cmd in ("sleep", "wake_up"):
            self._asleep = cmd == "sleep"
        return result

    def _restart(self, cmd: str, died: _ChildDied) -> Any:
        """Start a new child in place of the one that died on ``cmd`` and give it the latest pushed weights
        and the sleep state; returns the answer to the weights' ``update_weights`` (None without a push).
        Called with ``_lock`` held. Raises :class:`EngineProcessError` when :meth:`close` is in progress,
        no restart is left, no copy of the dead child's weights exists, or the new child fails."""
        if self._closing:
            self._dead = died.headline
            raise EngineProcessError(str(died)) from died
        with self._files_lock:  # a push waits here before deleting the file this restart loads
            if self.restarts >= self.max_restarts:
                why = (
                    f"It is not restarted: all rollout.max_restarts={self.max_restarts} restarts are used up "
                    f"({self.restarts} done)."
                )
            elif self._weights_missing:
                why = (
                    "It is not restarted: the weights it held have no copy (a push was in progress or failed), "
                    "and a new child would generate with other weights."
                )
            else:
                why = ""
            if why:
                self._dead = f"{died.headline} {why}"
                raise EngineProcessError(self._with_log(self._dead)) from died
            self.restarts += 1
            weights = self._weights[0] if self._weights else None
            log.warning(
                "%s Restarting it (%d of rollout.max_restarts=%d) with %s. Last lines of its log %s:\n%s",
                died.headline,
                self.restarts,
                self.max_restarts,
                "the latest pushed weights" if weights is not None else "the model's own weights (none pushed)",
                self.log_path,
                self.log_tail(),
            )
            t0 = time.perf_counter()
            try:
                self._start()
                loaded = None if weights is None else self._exchange("update_weights", weights, None)
                if self._asleep:
                    self._exchange("sleep", None, None)
            except EngineProcessError as exc:
                self._stop_child()
                self._dead = (
                    f"{died.headline} Its restart ({self.restarts} of rollout.max_restarts={self.max_restarts}) "
                    f"failed: {exc}"
                )
                raise EngineProcessError(self._dead) from exc
            except BaseException:  # interrupted: the new child's answers may be out of step
                self._stop_child()
                self._dead = f"{died.headline} Its restart was interrupted."
                raise
        log.warning(
            "Rollout engine process restarted in %.1f s (pid %d, backend '%s').",
            time.perf_counter() - t0,
            self._proc.pid,
            self.factory_name,
        )
        return loaded

    def _exchange(self, cmd: str, payload: Any, timeout: float | None) -> Any:
        proc, send, recv = self._proc, self._send, self._recv
        try:
            send.send((cmd, payload))
        except (BrokenPipeError, OSError) as exc:
            raise self._died(cmd) from exc
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not recv.poll(0.2):
                if proc.poll() is not None:
                    raise self._died(cmd)
                if deadline is not None and time.monotonic() > deadline:
                    self._dead = f"It did not answer '{cmd}' within {timeout:.0f} s and was stopped."
                    self._stop_child()
                    raise EngineProcessError(
                        f"The rollout engine process (pid {proc.pid}, backend '{self.factory_name}') did not answer "
                        f"'{cmd}' within {timeout:.0f} s; it was stopped. Last lines of its log {self.log_path}:\n"
                        f"{self.log_tail()}"
                    )
            status, result = recv.recv()
        except EOFError as exc:
            raise self._died(cmd) from exc
        except EngineProcessError:
            raise
        except BaseException as exc:
            if self._closing:  # close() from another thread killed the child and closed the pipes under us
                raise EngineProcessError(
                    f"The rollout engine process (pid {proc.pid}, backend '{self.factory_name}') was closed while "
                    f"handling '{cmd}'."
                ) from exc
            # interrupted mid-command: the answers are out of step with the commands, so the child goes
            self._dead = f"A call to '{cmd}' was interrupted and the child stopped."
            self._stop_child()
            raise
        if status == "error":
            raise EngineProcessError(
                f"The rollout backend '{self.factory_name}' failed on '{cmd}' in its engine process "
                f"(pid {proc.pid}):\n{result}"
            )
        return result

    def _died(self, cmd: str) -> _ChildDied:
        """Stop the child that died while handling ``cmd`` (reap it, close the pipes) and return the error
        describing it: exit code or signal, and its log's last lines."""
        proc = self._proc
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        code = proc.poll()
        if self._closing:
            how = f"was closed (exit code {code})"
        elif code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            how = f"was killed by {name} (exit code {code})"
            if -code == signal.SIGKILL:
                how += "; the OOM killer sends SIGKILL: check the machine's memory"
        else:
            how = f"exited with code {code}"
        headline = (
            f"The rollout engine process (pid {proc.pid}, backend '{self.factory_name}') {how} while handling '{cmd}'."
        )
        self._stop_child()
        return _ChildDied(headline, self._with_log(headline))

    def _with_log(self, text: str) -> str:
        """``text`` followed by the last lines of the log."""
        return f"{text} Last lines of its log {self.log_path}:\n{self.log_tail()}"

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the child's output."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:]) or "(empty)"


class _ChildDied(EngineProcessError):
    """The child died during a command (``headline``: what happened; the message adds its log's last lines)."""

    def __init__(self, headline: str, message: str) -> None:
        super().__init__(message)
        self.headline = headline


def _remove_weights(files: list[tuple[str, list[str]]]) -> None:
    """Delete the pushed weights files in ``files`` and empty the list (missing files ignored)."""
    while files:
        path, _ = files.pop()
        with contextlib.suppress(OSError):
            os.unlink(path)


def _remove_stale_weights(directory: str) -> list[str]:
    """Delete the ``rlplug-engine-weights-<pid>-*.safetensors`` files in ``directory`` whose process
    ``<pid>`` is gone: the kept copy of a trainer killed by SIGKILL (a whole model, in RAM in ``/dev/shm``).
    Files of live processes (another user's included) are kept. Returns the deleted paths; never raises."""
    import re  # deferred: only here

    from rlplug.rollout.utils import remove_dead_process_files  # deferred: torch (rlplug.rollout.utils imports it)

    pattern = re.compile(re.escape(WEIGHTS_PREFIX) + r"(\d+)-[^/]*\.safetensors$")
    return remove_dead_process_files(directory, [pattern], "rollout engine weights")


def _pickled_reference(factory: Any) -> bytes | None:
    """``factory`` pickled when it pickles by reference into something the child can import (a
    module-level class or function outside ``__main__``); None otherwise (the child then looks the
    factory up by name)."""
    if factory is None or getattr(factory, "__module__", "__main__") == "__main__":
        return None
    try:
        return pickle.dumps(factory)
    except Exception:  # a local class, a lambda, a bound method of an unpicklable object
        return None


def _pickled_tokenizer(tokenizer: Any) -> bytes | None:
    """The trainer's tokenizer pickled (ca. 1.5 MB and 0.1 s for SmolLM2's), or None when there is none
    or it does not pickle (some remote-code tokenizers): the child then loads the model folder's."""
    if tokenizer is None:
        return None
    try:
        return pickle.dumps(tokenizer)
    except Exception:
        return None


def _cpu_tensors(named_tensors: Any) -> dict[str, Any]:
    """``{name: tensor}`` on the CPU, contiguous, each with a storage of its own (safetensors refuses
    tensors that share memory: tied embeddings, views of a flat buffer), otherwise not copied."""
    items = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors
    out: dict[str, Any] = {}
    seen: set[int] = set()
    for name, tensor in items:
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        t = t.contiguous()
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() != t.numel() * t.element_size():
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[str(name)] = t
    return out


# ============================================================================ the child


def _exit_with_parent(parent: int) -> None:
    """End the child when the parent (pid ``parent``) dies, even in the middle of a long ``generate``."""

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="rlplug-parent-watchdog", daemon=True).start()


def _load_tokenizer(model_path: str, trust_remote_code: bool) -> Any:
    """``model_path``'s tokenizer set up as :func:`rlplug.training.models.load_tokenizer` does (left
    padding, EOS as pad when there is no pad token); that module is a layer above this one."""
    from transformers import AutoTokenizer  # deferred: transformers

    tok = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def _child_init(payload: dict) -> tuple[Any, dict]:
    """Bind cores and threads, then build the backend; returns it and the ``init`` answer."""
    t0 = time.perf_counter()
    for entry in payload["sys_path"]:  # the parent's import path: a factory from a test or script folder
        if entry not in sys.path:
            sys.path.append(entry)
    if payload["cpus"] is not None:
        os.sched_setaffinity(0, payload["cpus"])  # before torch starts its thread pool
    import torch  # deferred: torch (after the affinity and OMP_NUM_THREADS are set)
    from omegaconf import OmegaConf  # deferred: omegaconf

    torch.set_num_threads(int(payload["num_threads"]))
    cfg = OmegaConf.create(payload["cfg"])
    if payload["tokenizer"] is not None:
        tokenizer = pickle.loads(payload["tokenizer"])
    else:
        tokenizer = _load_tokenizer(payload["model_path"], bool(payload["trust_remote_code"]))
    factory = None
    if payload["factory"] is not None:
        try:
            factory = pickle.loads(payload["factory"])
        except Exception:  # not importable here (e.g. defined beside a script): the registry has it by name
            traceback.print_exc()
    if factory is None:
        factory = get_registry().get("rollout_backend", payload["factory_name"])
    backend = factory(cfg, payload["model_path"], tokenizer)
    metrics = getattr(backend, "metrics", None)
    info = {
        "pid": os.getpid(),
        "num_threads": torch.get_num_threads(),
        "cpus": sorted(os.sched_getaffinity(0)),
        "metrics": tuple(metrics) if isinstance(metrics, (tuple, list)) else None,
        "startup_s": time.perf_counter() - t0,
    }
    print(
        f"rlplug engine process {info['pid']}: backend '{payload['factory_name']}' ({type(backend).__name__}), "
        f"{info['num_threads']} threads, cores {info['cpus']}, built in {info['startup_s']:.1f} s",
        flush=True,
    )
    return backend, info


def _child_update_weights(backend: Any, path: str, names: list[str]) -> float:
    """Load the pushed file (the parent keeps it, for a restarted child, and deletes it) and pass its
    tensors to the backend in the caller's order (``names``: where two names share one parameter, tied
    embeddings, the later one wins, as in-process). Returns seconds."""
    import safetensors.torch  # deferred: safetensors (imports torch)

    t0 = time.perf_counter()
    loaded = safetensors.torch.load_file(path)
    backend.update_weights({name: loaded[name] for name in names})
    return time.perf_counter() - t0


def _child_main(read_fd: int, write_fd: int, parent: int) -> int:
    _exit_with_parent(parent)
    for sig in (signal.SIGINT, signal.SIGTERM):  # for the trainer, which closes this child when it stops
        signal.signal(sig, signal.SIG_IGN)
    recv = Connection(read_fd, writable=False)
    send = Connection(write_fd, readable=False)
    backend: Any = None
    trim = False
    while True:
        try:
            cmd, payload = recv.recv()
        except (EOFError, OSError):
            break
        if cmd == "close":
            break
        try:
            result: Any = None
            if cmd == "init":
                backend, result = _child_init(payload)
                trim = bool(payload["malloc_trim"])
            elif cmd == "pid":
                result = os.getpid()
            elif cmd == "memory":
                used, free = heap_mib()
                result = {"rss_mib": rss_bytes() / 2**20, "heap_used_mib": used, "heap_free_mib": free}
            elif backend is None:
                raise RuntimeError(f"command '{cmd}' before 'init'")
            elif cmd == "generate":
                prompts, params = payload
                result = backend.generate(prompts, params)
            elif cmd == "update_weights":
                result = _child_update_weights(backend, *payload)
            elif cmd in ("sleep", "wake_up"):
                getattr(backend, cmd)()
            elif cmd == "call":
                method, args, kwargs = payload
                result = getattr(backend, method)(*args, **kwargs)
            else:
                raise ValueError(f"unknown command '{cmd}'")
            if trim and cmd in ("generate", "update_weights"):
                malloc_trim()
            send.send(("ok", result))
        except BaseException:  # report and keep serving; a failed init ends the child
            try:
                send.send(("error", traceback.format_exc()))
            except (BrokenPipeError, OSError):
                return 1
            if cmd == "init":
                return 1
    if backend is not None:
        with contextlib.suppress(BaseException):
            backend.close()
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--engine-child":
        sys.exit(_child_main(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
    print(
        "usage: python -m rlplug.rollout.engine_process --engine-child READ_FD WRITE_FD PARENT_PID "
        "(started by rlplug, not by hand)",
        file=sys.stderr,
    )
    sys.exit(2)
