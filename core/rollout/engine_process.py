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
``rlplug-engine-weights-<pid>-*``) and sends its path; the child loads it, hands the dict to the
backend's ``update_weights`` and deletes the file, which the parent deletes too should the child
die first. Measured on the 2-core CPU machine (torch 2.13.0+cpu, AMD EPYC; a push into a backend
that copies every tensor into its parameters): the tiny test model, 6.4M fp32 parameters (25 MB),
34 ms; 135M fp32 parameters (540 MB, SmolLM2-135M's size) in 30 tensors, 0.5 s (0.7 s the first time,
while the backend allocates), 0.27 s of it writing and loading the file.
(torch's tensor sharing, :mod:`torch.multiprocessing`, needs a ``multiprocessing``-started child to
pass file descriptors or names; a file needs nothing, and is what the ``vllm`` backend pushes too.)

Calls
-----
One :class:`threading.Lock` serialises the commands: the async pipeline generates from a producer
thread and pushes weights from the trainer's; a second caller waits for the first to finish.
A failing backend call raises :class:`EngineProcessError` with the child's traceback, and the
child keeps serving. A child that dies (SIGKILL from the OOM killer, a crash) raises
:class:`EngineProcessError` naming its exit code and quoting its log; every later call raises too
(the engine is not restarted: its weights died with it).
"""

from __future__ import annotations

import contextlib
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
from rlplug.config.schema import ModelConfig, RolloutConfig, TrainerConfig, typed
from rlplug.contracts.kinds import built_classes
from rlplug.contracts.registry import Registry, get_registry
from rlplug.contracts.types import RolloutOutput, SamplingParams

if TYPE_CHECKING:
    import torch

__all__ = ["EngineProcess", "EngineProcessError", "build_engine", "out_of_process"]

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
    ``trainer.engine_cpus`` (the child's cores; None: the parent's), ``trainer.malloc_trim`` (the child
    returns its free heap to the OS after each generate and push) and whatever the backend reads.
    Blocks until the backend is built (``startup_s``: seconds).

    Attributes: ``pid`` (the child's, None once closed: the trainer logs its resident size as
    ``perf/rollout_rss_gb``), ``metrics`` (the backend's ``metrics`` names plus
    ``perf/rollout_rss_gb``), ``num_threads`` and ``cpus`` (as the child reports them),
    ``last_update_s`` (seconds of the latest :meth:`update_weights`), ``log_path``.

    Raises ``ValueError`` when ``trainer.engine_cpus`` names cores this process may not use and
    :class:`EngineProcessError` when the child fails to start (its traceback or log quoted).
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
        container = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
        trust = bool(typed(ModelConfig, cfg["model"] if "model" in cfg else None).trust_remote_code)
        payload = {
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
        self.last_update_s = 0.0
        self._lock = threading.Lock()
        self._closed = False
        self._closing = False
        self._dead: str | None = None
        self.log_dir = Path(tempfile.mkdtemp(prefix="rlplug-engine-"))
        self.log_path = self.log_dir / "engine.log"
        env = dict(os.environ)
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
        p2c_r, p2c_w = os.pipe()
        c2p_r, c2p_w = os.pipe()
        argv = [sys.executable, "-m", "rlplug.rollout.engine_process", "--engine-child"]
        try:
            with open(self.log_path, "ab") as logf:
                self._proc = subprocess.Popen(
                    [*argv, str(p2c_r), str(c2p_w), str(os.getpid())],
                    pass_fds=(p2c_r, c2p_w),
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    close_fds=True,
                )
        finally:
            os.close(p2c_r)
            os.close(c2p_w)
        self._send = Connection(p2c_w, readable=False)
        self._recv = Connection(c2p_r, writable=False)
        self._finalizer = weakref.finalize(self, _shutdown, self._proc, self._send, self._recv)
        t0 = time.perf_counter()
        try:
            info = self._call("init", payload, timeout=startup_timeout_s)
        except BaseException:
            self._close(keep_logs=True)
            raise
        self.startup_s = time.perf_counter() - t0
        self.num_threads = int(info["num_threads"])
        self.cpus: list[int] = list(info["cpus"])
        backend_metrics = info["metrics"]
        if backend_metrics is not None:  # forwarded only where the backend declares some, as its own attribute
            self.metrics: tuple[str, ...] = tuple(dict.fromkeys([*backend_metrics, "perf/rollout_rss_gb"]))
        else:
            self.metrics = ("perf/rollout_rss_gb",)

    # ------------------------------------------------------------------ RolloutBackend
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> RolloutOutput:
        """The backend's ``generate`` in the child (see :class:`rlplug.contracts.types.RolloutBackend`).
        Raises :class:`EngineProcessError` (the backend raised: its traceback; or the child died)."""
        out = self._call("generate", ([list(map(int, p)) for p in prompt_ids], params))
        assert isinstance(out, RolloutOutput)
        return out

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | dict[str, torch.Tensor]) -> None:
        """Send the actor's weights (HF names, any dtype/device) to the backend's ``update_weights``.

        The tensors are copied to the CPU and written to one safetensors file in ``/dev/shm`` before
        the lock is taken (so a running ``generate`` is not held up by the copy), which the child
        loads and deletes. ``last_update_s``: seconds, copy included. Raises
        :class:`EngineProcessError` (the backend rejected them -- unknown names or shapes -- or the
        child died)."""
        import safetensors.torch  # deferred: safetensors (imports torch)

        from rlplug.rollout.utils import shm_dir  # deferred: torch (rlplug.rollout.utils imports it)

        self._check_open()
        t0 = time.perf_counter()
        tensors = _cpu_tensors(named_tensors)
        fd, path = tempfile.mkstemp(prefix=f"{WEIGHTS_PREFIX}{os.getpid()}-", suffix=".safetensors", dir=shm_dir())
        os.close(fd)
        try:
            safetensors.torch.save_file(tensors, path)
            names = list(tensors)  # the file keeps its own order; the backend gets the caller's (tied weights)
            del tensors
            self._call("update_weights", (path, names))
        finally:
            with contextlib.suppress(OSError):
                os.unlink(path)
        self.last_update_s = time.perf_counter() - t0

    def sleep(self) -> None:
        """The backend's ``sleep`` in the child."""
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
        protocol (arguments and result pickled). Raises :class:`EngineProcessError`."""
        return self._call("call", (str(method), args, kwargs))

    @property
    def pid(self) -> int | None:
        """The child's process id (None once closed or dead)."""
        return None if self._closed or self._dead is not None else int(self._proc.pid)

    def close(self) -> None:
        """Stop the child (``close``, then SIGTERM, then SIGKILL) and delete its log folder; idempotent.

        A command running in another thread is waited for up to :data:`CLOSE_WAIT_S` seconds, then the
        child is killed at once (that command raises :class:`EngineProcessError`, "was closed")."""
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
    def _close(self, *, keep_logs: bool) -> None:
        self._closed = True
        self._finalizer()
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
            return self._exchange(cmd, payload, timeout)

    def _exchange(self, cmd: str, payload: Any, timeout: float | None) -> Any:
        proc = self._proc
        try:
            self._send.send((cmd, payload))
        except (BrokenPipeError, OSError) as exc:
            raise self._died(cmd) from exc
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not self._recv.poll(0.2):
                if proc.poll() is not None:
                    raise self._died(cmd)
                if deadline is not None and time.monotonic() > deadline:
                    self._dead = f"It did not answer '{cmd}' within {timeout:.0f} s and was stopped."
                    self._finalizer()
                    raise EngineProcessError(
                        f"The rollout engine process (pid {proc.pid}, backend '{self.factory_name}') did not answer "
                        f"'{cmd}' within {timeout:.0f} s; it was stopped. Last lines of its log {self.log_path}:\n"
                        f"{self.log_tail()}"
                    )
            status, result = self._recv.recv()
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
            self._finalizer()
            raise
        if status == "error":
            raise EngineProcessError(
                f"The rollout backend '{self.factory_name}' failed on '{cmd}' in its engine process "
                f"(pid {proc.pid}):\n{result}"
            )
        return result

    def _died(self, cmd: str) -> EngineProcessError:
        """Record the child's death while handling ``cmd`` and return the error describing it."""
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
        msg = (
            f"The rollout engine process (pid {proc.pid}, backend '{self.factory_name}') {how} while handling "
            f"'{cmd}'. Last lines of its log {self.log_path}:\n{self.log_tail()}"
        )
        self._dead = msg
        self._finalizer()  # close the pipes, reap the child
        return EngineProcessError(msg)

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the child's output."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:]) or "(empty)"


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


def _shutdown(proc: subprocess.Popen, send: Connection, recv: Connection) -> None:
    """Ask the child to exit, then SIGTERM / SIGKILL it if it does not; close the pipes."""
    if proc.poll() is None:
        with contextlib.suppress(BaseException):
            send.send(("close", None))
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
    if proc.poll() is None:
        proc.terminate()  # ignored by the child (see _child_main); SIGKILL follows
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    for conn in (send, recv):
        with contextlib.suppress(BaseException):
            conn.close()


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
    """Load the pushed file, delete it, and pass its tensors to the backend in the caller's order
    (``names``: where two names share one parameter, tied embeddings, the later one wins, as in-process)."""
    import safetensors.torch  # deferred: safetensors (imports torch)

    t0 = time.perf_counter()
    try:
        loaded = safetensors.torch.load_file(path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
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
