"""Library code for rollout backends that run their engine as an HTTP server.

:class:`ServerRollout` is the public base of ``rollout=sglang``
(:mod:`rlplug.plugins.rollout.sglang`) and of ``rollout=vllm rollout.mode=server``
(:class:`rlplug.plugins.rollout.vllm.VLLMServerRollout`); a third-party engine with an HTTP
server subclasses it the same way. It implements the :class:`rlplug.contracts.types.RolloutBackend`
protocol over HTTP; :class:`ServerProcess` and the supervisor (``python -m rlplug.rollout.serving
--supervise``) are the process supervision it uses.

Server process
--------------
* With ``rollout.server_url`` unset, the backend starts the engine's own server on
  ``rollout.server_host:rollout.server_port`` (port 0: a free port) with the engine's launch
  command (or ``rollout.server_cmd``, whose items may use ``{python}``, ``{model_path}``,
  ``{host}`` and ``{port}``; ``rollout.server_args`` are appended) and waits up to
  ``rollout.server_timeout_s`` seconds for its health endpoint to answer 200.
  With ``rollout.server_url`` set, it connects to that server instead (which must serve the same
  model) and never starts or stops it.
* Several servers (replicas, :mod:`rlplug.rollout.replicas`, ``docs/scale_out.md``):
  ``rollout.server_urls=[url, ...]`` (``server_url`` is the alias of a list of one) connects to
  running servers, ``rollout.num_replicas=N`` starts ``N`` servers (each on its own port;
  ``rollout.server_cmd`` may use ``{replica}``, the replica's index). Requests go to the least
  busy replica; weights go to all of them.
* The server runs under a small supervisor (``python -m rlplug.rollout.serving
  --supervise``) that leads its own process group. The group (supervisor, server and every
  process the server starts, e.g. vLLM's engine core) is killed when the backend is closed, when
  the interpreter exits (``atexit``), when the backend is garbage-collected, and -- by the
  supervisor, within a second -- when the training process dies without cleaning up (SIGKILL,
  crash); the supervisor then also deletes the backend's folders (server logs, pushed weights in
  ``/dev/shm``). So no engine or model copy outlives the run. The server's output goes to a log
  file whose last lines are quoted in startup errors.

Requests
--------
One HTTP request per response (prompt ``i``, sample ``j``): ``len(prompts) * n`` requests, at
most ``rollout.max_concurrency`` in flight per replica, sent from a thread pool over one ``httpx.Client``
(the engine batches them itself: continuous batching, prefix cache shared between the samples
of a prompt). Results are stored by ``(i, j)``, so the output is prompt-major whatever order the
answers come in, and a request that is sent again replaces nothing else: no sample is lost or
duplicated.

Failures: a request that times out (``rollout.request_timeout_s``), cannot connect, or gets a
5xx/408/429 answer (or an aborted generation) is retried up to ``rollout.max_retries`` times, on
whichever replica is least busy then. Before each retry the backend checks the replica: one whose
process exited or whose health check fails leaves the routing (its in-flight requests go to the
other replicas) and is restarted in the background (at most ``rollout.max_restarts`` times per
replica), or, for an external server, dropped with a warning while other replicas are live and
waited for when it is the last one; the latest pushed weights are loaded into a replica before it
takes requests again (:class:`rlplug.rollout.replicas.ReplicaSet`). When no replica is left, the error lists
each one and why it is down. A 4xx answer (bad request) is not retried: the error names the
endpoint and quotes the server's message.

Weights
-------
:meth:`ServerRollout.update_weights` checks names and shapes against the model checkpoint (as
the ``vllm`` backend does), writes the tensors (cast to ``rollout.dtype``) as a Hugging Face
folder (``model.safetensors`` plus links to the model's config and tokenizer files) under
``/dev/shm`` (RAM; the temp dir when ``/dev/shm`` is missing or too small), or under
``rollout.weights_dir`` (a filesystem every server can read, for servers on other machines), and
asks every replica to load it, in parallel (the subclass's :meth:`ServerRollout._load_weights`). The latest folder is kept
until the next push (one model copy in RAM) so that a restarted server can be given the same
weights; older folders are deleted.

Sampling: temperature 0 is greedy; ``top_k = -1`` disables top-k. A seed reaches the engine
only where per-request seeds work (vLLM on GPU); otherwise sampled responses are not
reproducible from the seed in server mode (requests are scheduled in arrival order), greedy
ones are.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import psutil

from rlplug.config.schema import RunConfig, typed
from rlplug.contracts.types import RolloutOutput, SamplingParams
from rlplug.rollout.replicas import LIVE, Replica, ReplicaSet, ServerError  # ServerError: re-exported, defined there

__all__ = [
    "ServerRollout",
    "ServerError",
    "ServerProcess",
    "Retryable",
    "free_port",
    "server_urls",
]

log = logging.getLogger("rlplug.rollout.serving")

#: files of the model folder linked into each pushed weights folder (config, tokenizer, ...)
_META_SUFFIXES = (".json", ".txt", ".model", ".tiktoken", ".jinja", ".py")


class Retryable(Exception):
    """A failed attempt that may succeed when sent again (after a health check / restart)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def server_urls(config: Any) -> list[str]:
    """The external servers of ``rollout.server_urls`` (a list, or one comma-separated string), or
    ``[rollout.server_url]`` (its alias for one server); ``[]`` when rlplug starts the servers.

    URLs lose their trailing ``/``. Raises ``ValueError`` when both keys are set to different
    servers, or for a URL that does not start with ``http://`` / ``https://``."""
    rollout = typed(RunConfig, config).rollout
    urls: Any = rollout.server_urls or []
    if isinstance(urls, str):
        urls = [u for u in urls.split(",") if u.strip()]
    urls = [str(u).strip().rstrip("/") for u in urls]
    one = rollout.server_url
    if one:
        one = str(one).strip().rstrip("/")
        if urls and urls != [one]:
            raise ValueError(
                f"rollout.server_url={one} and rollout.server_urls={urls} are both set; server_url is the alias of "
                "a list of one server: set only rollout.server_urls=[...]."
            )
        urls = [one]
    bad = [u for u in urls if not u.startswith(("http://", "https://"))]
    if bad:
        raise ValueError(
            f"rollout.server_urls: {bad} are not server addresses; expected http://host:port (the engine server's "
            "base URL, e.g. http://10.0.0.2:30000)."
        )
    if len(set(urls)) != len(urls):
        raise ValueError(f"rollout.server_urls={urls} lists a server twice; list each server once.")
    return urls


# ============================================================================ processes


def _group_members(pgid: int) -> list[int]:
    """Pids of the live (non-zombie) processes in process group ``pgid``, read from /proc."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != b"Z" and int(fields[2]) == pgid:  # state, ppid, pgrp
            pids.append(int(entry))
    return pids


def _kill_group(pgid: int, sig: int) -> None:
    if _group_members(pgid):  # never signal a group id that may have been reused
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class ServerProcess:
    """An engine server started under the rlplug supervisor in its own process group.

    ``ServerProcess(cmd, env, log_path, cleanup)`` starts ``python -m rlplug.rollout.serving
    --supervise <this pid> [--cleanup DIR]... -- cmd...`` with stdout/stderr appended to
    ``log_path``; the supervisor deletes the ``cleanup`` folders if this process dies first.
    :meth:`stop` ends the whole group (SIGTERM, then SIGKILL after ``grace_s`` seconds).
    """

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: Path, cleanup: Iterable[str] = ()) -> None:
        self.cmd = list(cmd)
        self.log_path = Path(log_path)
        extra = [a for d in cleanup for a in ("--cleanup", str(d))]
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rlplug.rollout.serving", "--supervise", str(os.getpid()), *extra, "--", *cmd],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        self.pgid = self.proc.pid  # the supervisor leads a new session, hence its own group

    @property
    def alive(self) -> bool:
        """Whether the supervisor still runs (it exits as soon as the server exits)."""
        return self.proc.poll() is None

    @property
    def server_pid(self) -> int | None:
        """Pid of the server process itself (the supervisor's child); None when it is gone."""
        try:
            children = psutil.Process(self.proc.pid).children()
        except Exception:
            return None
        return children[0].pid if children else None

    def group_pids(self) -> list[int]:
        """Pids of every live process of the server's group (supervisor included)."""
        return _group_members(self.pgid)

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop the server and everything it started; returns once the group is gone (idempotent)."""
        _kill_group(self.pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + grace_s
        while _group_members(self.pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        _kill_group(self.pgid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be ignored
            pass
        deadline = time.monotonic() + 10
        while _group_members(self.pgid) and time.monotonic() < deadline:
            time.sleep(0.05)


def _supervise(parent_pid: int, cmd: list[str], cleanup: Iterable[str] = ()) -> int:
    """Run ``cmd`` in this process group; end the group when it exits, on SIGTERM, or when the parent dies.

    When the parent died (it could not clean up), the ``cleanup`` folders (server logs, pushed
    weights in ``/dev/shm``) are deleted too."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    child = subprocess.Popen(cmd)
    orphaned = False
    me, pgid = os.getpid(), os.getpgid(0)
    segments: set[str] = set()  # the group's shared-memory segments (psm_* in /dev/shm) seen so far
    polls = 0
    while not stop.wait(0.2):
        if child.poll() is not None:
            break
        if os.getppid() != parent_pid:
            orphaned = True
            break
        polls += 1
        if polls % 5 == 1:  # about once a second
            segments |= _shm_segments_of([p for p in _group_members(pgid) if p != me])
    # Once more before anything is ended: the members still alive may have mapped segments since the last
    # look (a server killed less than a second after its engine mapped one would otherwise leak it).
    segments |= _shm_segments_of([p for p in _group_members(pgid) if p != me])
    if orphaned:
        for d in cleanup:
            shutil.rmtree(d, ignore_errors=True)
    if child.poll() is None:
        child.terminate()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    # the server's own children (engine core, workers, ...): SIGTERM, a short grace, then SIGKILL
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    others = [p for p in _group_members(pgid) if p != me]
    if others:
        os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        while [p for p in _group_members(pgid) if p != me] and time.monotonic() < deadline:
            time.sleep(0.05)
    left = [p for p in _group_members(pgid) if p != me]
    for p in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while [p for p in _group_members(pgid) if p != me] and time.monotonic() < deadline:
        time.sleep(0.05)
    _remove_segments(segments)  # (a segment still mapped by a straggler is freed when it ends)
    if [p for p in _group_members(pgid) if p != me]:
        os.killpg(pgid, signal.SIGKILL)  # a straggler (started after the list above): ends this supervisor too
    rc = child.poll()
    return 0 if rc is None else (rc if rc >= 0 else 128 - rc)


def _shm_segments_of(pids: Iterable[int]) -> set[str]:
    """The Python shared-memory segments (``/dev/shm/psm_*``, ``multiprocessing.shared_memory``'s names,
    which vLLM's message queues use) that processes ``pids`` map or hold open."""
    found: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    i = line.find("/dev/shm/psm_")
                    if i >= 0:
                        found.add(line[i:].rstrip("\n").removesuffix(" (deleted)"))
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("/dev/shm/psm_"):
                        found.add(target.removesuffix(" (deleted)"))
    return found


def _remove_segments(segments: Iterable[str]) -> None:
    """Unlink the server group's shared-memory segments that are still there once the group is gone: a
    server killed with SIGKILL cannot unlink its own (vLLM's message queues left 400 MiB in /dev/shm)."""
    for path in sorted(segments):
        if os.path.dirname(path) == "/dev/shm" and os.path.basename(path).startswith("psm_"):
            with contextlib.suppress(OSError):
                os.unlink(path)


# live backends, closed at interpreter exit
_LIVE: weakref.WeakSet[ServerRollout] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for backend in list(_LIVE):
        try:
            backend.close()
        except Exception:  # pragma: no cover - best effort at exit
            pass


def _finalize(state: dict) -> None:
    """Release what a backend holds (also run when it is garbage-collected without close())."""
    pool = state.pop("pool", None)
    if pool is not None:
        pool.shutdown(wait=False, cancel_futures=True)
    client = state.pop("client", None)
    if client is not None:
        try:
            client.close()
        except Exception:
            pass
    servers = list(state.pop("servers", {}).values())
    stoppers = [threading.Thread(target=srv.stop, daemon=True) for srv in servers]  # in parallel: a fleet
    for t in stoppers:
        t.start()
    for t in stoppers:
        t.join()
    for key in ("weights_root", "log_dir"):
        d = state.pop(key, None)
        if d is not None:
            shutil.rmtree(d, ignore_errors=True)


def _shm_dir(nbytes: int) -> str:
    """/dev/shm when it exists, is writable and has room for ``nbytes`` twice; else the temp dir."""
    d = "/dev/shm"
    try:
        if os.path.isdir(d) and os.access(d, os.W_OK):
            st = os.statvfs(d)
            if st.f_bavail * st.f_frsize > 2 * nbytes:
                return d
    except OSError:
        pass
    return tempfile.gettempdir()


# ============================================================================ base class


class ServerRollout:
    """Base of the HTTP rollout backends (see the module docstring).

    Subclasses set :attr:`engine` and :attr:`health_path` and implement
    :meth:`_launch_command`, :meth:`_launch_env`, :meth:`_request` (prompt -> endpoint + JSON),
    :meth:`_parse` (JSON -> token ids, finish reason, log-probs) and :meth:`_load_weights`.

    :meth:`_load_weights` talks to the server through :meth:`_control`, which reaches the replica
    being loaded (the base class calls it once per replica).

    ``ServerRollout(config, model_path, tokenizer)`` reads ``rollout.*`` (``dtype``,
    ``server_urls`` / ``server_url``, ``num_replicas``, ``server_host``, ``server_port``,
    ``server_cmd``, ``server_args``, ``server_timeout_s``, ``request_timeout_s``, ``max_retries``,
    ``max_restarts``, ``max_concurrency``, ``weights_dir``), ``trainer.seed`` and ``trainer.device``,
    and blocks until every replica is healthy (``startup_s``: seconds it took). Raises
    ``ValueError`` for bad settings and :class:`ServerError` when a server does not start.

    Counters: ``retries`` (requests sent again), ``restarts`` (servers restarted),
    ``last_update_s`` (seconds the latest weight push took), ``replicas``
    (:class:`rlplug.rollout.replicas.ReplicaSet`); each :meth:`generate` reports :meth:`counters` in
    ``RolloutOutput.metrics`` (the names in :attr:`metrics`).
    """

    #: engine name used in messages and file names
    engine = "server"
    #: GET endpoint that answers 200 once the server can generate
    health_path = "/health"
    #: metrics every generate() reports (RolloutOutput.metrics, logged with the step's metrics)
    metrics = ("rollout/resent_requests", "rollout/live_replicas", "rollout/replicas", "rollout/replica_restarts")
    runs_out_of_process = True  # a server (rlplug.rollout.engine_process.out_of_process)

    def __init__(self, config: Any, model_path: str, tokenizer: Any) -> None:
        import httpx  # deferred: httpx (server rollouts only; not a declared dependency of rlplug)
        import torch  # deferred: torch (the server supervisor imports this module without it)

        from rlplug.base.precision import resolve_dtype  # deferred: torch (imported there)
        from rlplug.rollout.utils import DTYPE_NAMES, TORCH_DTYPES, checkpoint_shapes, eos_ids  # deferred: torch

        self.config = config
        self.model_path = str(model_path)
        run = typed(RunConfig, config)
        rollout = run.rollout
        self.seed = int(run.trainer.seed)
        device = str(run.trainer.device)
        self.on_gpu = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        dtype_key = resolve_dtype(rollout.dtype, "cuda" if self.on_gpu else "cpu", "rollout.dtype")
        self.dtype_name = DTYPE_NAMES[dtype_key]
        self.dtype = TORCH_DTYPES[self.dtype_name]
        cfg_path = Path(self.model_path) / "config.json"
        if not cfg_path.is_file():
            raise ValueError(
                f"rollout={self.engine}: no Hugging Face model folder at {self.model_path} (expected {cfg_path})."
            )
        self.hf_config = json.loads(cfg_path.read_text())
        self.tie_word_embeddings = bool(self.hf_config.get("tie_word_embeddings", False))
        self.vocab_size = int(self.hf_config.get("vocab_size", 0)) or None
        self.shapes = checkpoint_shapes(self.model_path)
        self.eos_ids = eos_ids(tokenizer, self.hf_config.get("eos_token_id"))

        self.server_urls = server_urls(config)
        self.num_replicas = int(rollout.num_replicas)
        self.host = str(rollout.server_host)
        self.port = int(rollout.server_port)
        cmd = rollout.server_cmd
        self.server_cmd = [str(c) for c in cmd] if cmd else None
        self.server_args = [str(a) for a in (rollout.server_args or [])]
        self.server_timeout_s = float(rollout.server_timeout_s)
        self.request_timeout_s = float(rollout.request_timeout_s)
        self.max_retries = int(rollout.max_retries)
        self.max_restarts = int(rollout.max_restarts)
        self.max_concurrency = int(rollout.max_concurrency)
        weights_dir = rollout.weights_dir
        self.weights_dir = str(Path(str(weights_dir)).expanduser()) if weights_dir else None
        for key, value, low in (
            ("server_timeout_s", self.server_timeout_s, 0),
            ("request_timeout_s", self.request_timeout_s, 0),
            ("max_retries", self.max_retries, -1),
            ("max_restarts", self.max_restarts, -1),
            ("max_concurrency", self.max_concurrency, 0),
            ("num_replicas", self.num_replicas, 0),
            ("server_port", self.port, -1),
        ):
            if not value > low:
                raise ValueError(f"rollout.{key}={value} must be {'> 0' if low == 0 else '>= 0'}.")
        if self.server_urls and self.num_replicas != 1:
            raise ValueError(
                f"rollout.num_replicas={self.num_replicas} is the number of servers rlplug starts, but "
                f"rollout.server_urls lists {len(self.server_urls)} servers started elsewhere; set one of the two "
                "(with server_urls, the replicas are the listed servers)."
            )
        n_replicas = len(self.server_urls) or self.num_replicas
        if not self.port + (n_replicas - 1 if self.port else 0) < 65536:
            raise ValueError(
                f"rollout.server_port={self.port} (+ {n_replicas - 1} for the other replicas) is not a TCP port "
                "(use 0 to pick free ones)."
            )

        self.retries = 0
        self.last_update_s: float | None = None
        self._closed = False
        self._lock = threading.RLock()  # guards the counters
        self._tls = threading.local()  # .replica: the replica _control talks to in this thread
        self._weights_count = 0
        self._state: dict[str, Any] = {"servers": {}}
        for name in ("httpx", "httpcore"):  # one INFO line per request would flood the training log
            if logging.getLogger(name).level == logging.NOTSET:
                logging.getLogger(name).setLevel(logging.WARNING)
        in_flight = self.max_concurrency * n_replicas  # rollout.max_concurrency per replica
        self._client = httpx.Client(
            timeout=httpx.Timeout(self.request_timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight),
            trust_env=False,  # never route loopback traffic through an HTTP proxy from the environment
        )
        self._pool = ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix=f"rlplug-{self.engine}")
        self._state.update(client=self._client, pool=self._pool)
        self._finalizer = weakref.finalize(self, _finalize, self._state)
        _LIVE.add(self)
        external = bool(self.server_urls)
        self.replicas = ReplicaSet(
            [Replica(i, url, external) for i, url in enumerate(self.server_urls or [None] * n_replicas)],
            engine=self.engine,
            start=self._start_server,
            load=self._load_into,
            healthy=self._replica_healthy,
            is_closed=lambda: self._closed,
            max_restarts=self.max_restarts,
            wait_s=self.server_timeout_s,
        )

        t0 = time.perf_counter()
        try:
            if not external:
                self._state["log_dir"] = tempfile.mkdtemp(prefix=f"rlplug-{self.engine}-server-")
                self._weights_root()
            self.replicas.start_all(self._pool)
        except BaseException:
            self.close()
            raise
        self.startup_s = time.perf_counter() - t0

    # ------------------------------------------------------------------ subclass hooks
    def _launch_command(self, host: str, port: int) -> list[str]:
        """The engine's own server command (``rollout.server_args`` are appended by the caller)."""
        raise NotImplementedError

    def _launch_env(self) -> dict[str, str]:
        """Environment of the server process."""
        return dict(os.environ)

    def _request(self, prompt: list[int], params: SamplingParams, seed: int) -> tuple[str, dict]:
        """``(endpoint, JSON body)`` of one generation request for one response to ``prompt``."""
        raise NotImplementedError

    def _parse(self, body: Any, params: SamplingParams) -> tuple[list[int], str, list[float] | None]:
        """``(token ids, "stop" | "length", log-probs or None)`` from one generation answer.

        Raise :class:`Retryable` for an aborted generation (it is sent again)."""
        raise NotImplementedError

    def _load_weights(self, folder: Path) -> None:
        """Make the server load the weights folder (``model.safetensors`` + config links)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ server lifecycle
    @property
    def base_url(self) -> str:
        """Base URL of the first replica (the only one unless ``rollout.server_urls`` / ``num_replicas``)."""
        return self.replicas.replicas[0].url or ""

    @property
    def restarts(self) -> int:
        """Servers restarted in the run (all replicas together)."""
        return self.replicas.restarts

    @property
    def server_pid(self) -> int | None:
        """Pid of the first replica's server process (None for an external server or when none runs)."""
        server = self.replicas.replicas[0].server
        return server.server_pid if server is not None else None

    def server_pids(self) -> list[int | None]:
        """Pid of each replica's server process, in replica order (None: external, or not running)."""
        return [r.server.server_pid if r.server is not None else None for r in self.replicas.replicas]

    def server_group_pids(self) -> list[int]:
        """Pids of every process of the launched servers (supervisors, servers, engine processes)."""
        return [p for r in self.replicas.replicas if r.server is not None for p in r.server.group_pids()]

    def _command(self, host: str, port: int, replica: int = 0) -> list[str]:
        if self.server_cmd:
            fill = {
                "python": sys.executable,
                "model_path": self.model_path,
                "host": host,
                "port": str(port),
                "replica": str(replica),
            }
            try:
                cmd = [c.format(**fill) for c in self.server_cmd]
            except (KeyError, IndexError, ValueError) as exc:
                raise ValueError(
                    f"rollout.server_cmd={self.server_cmd}: bad placeholder ({exc!r}); use {{python}}, {{model_path}}, "
                    "{host}, {port}, {replica}."
                ) from exc
        else:
            cmd = self._launch_command(host, port)
        return cmd + self.server_args

    def _start_server(self, replica: Replica) -> None:
        """(Re)start the server of a replica rlplug runs and wait until it is healthy."""
        port = self.port + replica.index if self.port else free_port(self.host)
        cmd = self._command(self.host, port, replica.index)
        log_path = Path(self._state["log_dir"]) / f"server-{replica.index}-{replica.restarts}.log"
        env = self._launch_env()
        env.setdefault("PYTHONUNBUFFERED", "1")
        self._check_open()
        server = ServerProcess(cmd, env, log_path, cleanup=[self._state["log_dir"], self._weights_root()])
        try:
            with self._lock:
                replica.server, replica.url = server, f"http://{self.host}:{port}"
                self._state.setdefault("servers", {})[replica.index] = server  # stopped by close()
            self._wait_healthy(self.server_timeout_s, server, replica)
            replica.pid = server.server_pid
            self._check_open()  # closed (e.g. Ctrl-C in the trainer) while a thread was restarting it
        except BaseException:
            server.stop()
            raise

    def _wait_healthy(self, timeout_s: float, server: ServerProcess, replica: Replica) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_open()
            if not server.alive:
                raise ServerError(
                    f"The {self.engine} server exited with code {server.proc.returncode} before it became healthy. "
                    f"Command: {' '.join(server.cmd)}\nLast lines of {server.log_path}:\n{server.log_tail()}"
                )
            if self._replica_healthy(replica, min(10.0, max(1.0, deadline - time.monotonic()))):
                return
            if time.monotonic() > deadline:
                raise ServerError(
                    f"The {self.engine} server at {replica.url} did not answer {self.health_path} with 200 within "
                    f"{timeout_s:.0f} s (rollout.server_timeout_s). Command: {' '.join(server.cmd)}\n"
                    f"Last lines of {server.log_path}:\n{server.log_tail()}"
                )
            time.sleep(0.25)

    def _replica_healthy(self, replica: Replica, timeout: float = 10.0) -> bool:
        try:
            return self._client.get(f"{replica.url}{self.health_path}", timeout=timeout).status_code == 200
        except Exception:
            return False

    # ------------------------------------------------------------------ HTTP with retries
    def _post(
        self,
        path: str,
        body: dict,
        timeout: float,
        parse: Callable[[Any], Any] = lambda b: b,
        cancel: threading.Event | None = None,
    ) -> Any:
        """POST ``body`` to ``path`` on the least busy replica and return ``parse(answer JSON)``, retrying
        (on any live replica) as the module docstring says."""
        import httpx  # deferred: httpx (server rollouts only; not a declared dependency of rlplug)

        last: BaseException | str = "no attempt"
        for attempt in range(self.max_retries + 1):
            if cancel is not None and cancel.is_set():
                raise ServerError(f"{self.engine}: request to {path} cancelled (another request of the batch failed)")
            self._check_open()
            replica = self.replicas.acquire()
            generation, url = replica.generation, f"{replica.url}{path}"
            try:
                r = self._client.post(url, json=body, timeout=timeout)
                if r.status_code in (408, 429) or r.status_code >= 500:
                    raise Retryable(f"HTTP {r.status_code}: {r.text[:300]}")
                if r.status_code >= 400:
                    raise ServerError(
                        f"The {self.engine} server rejected {path} with HTTP {r.status_code}: {r.text[:2000]}"
                    )
                try:
                    payload = r.json() if r.content else None
                except ValueError as exc:
                    raise Retryable(f"answer is not JSON: {r.text[:300]!r}") from exc
                return parse(payload)
            except httpx.TimeoutException as exc:
                last = f"no answer within {timeout:.0f} s ({type(exc).__name__})"
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
            except Retryable as exc:
                last = str(exc)
            finally:
                self.replicas.release(replica)
            if attempt < self.max_retries:
                with self._lock:
                    self.retries += 1
                self.replicas.failed(replica, generation, last)
        raise ServerError(
            f"{self.engine}: POST {path} failed {self.max_retries + 1} times (rollout.max_retries={self.max_retries}); last error: {last}"
        )

    # ------------------------------------------------------------------ generate
    def _unit_seed(self, seed: int, prompt_index: int, sample_index: int) -> int:
        """A distinct 63-bit seed per response, a pure function of (seed, prompt, sample)."""
        return (int(seed) * 1_000_003 + int(prompt_index) * 7_919 + int(sample_index) * 104_729 + 0x5EED) % (2**63 - 1)

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> RolloutOutput:
        """``len(prompt_ids) * params.n`` responses, prompt-major (see :class:`rlplug.contracts.types.RolloutOutput`).

        Each response ends with the EOS token when one was generated (``"stop"``), else has
        ``params.max_tokens`` tokens (``"length"``). Raises ``ValueError`` for bad prompts or
        settings, :class:`ServerError` when the server rejects a request or a request keeps failing
        after retries and restarts, ``RuntimeError`` after :meth:`close`.
        """
        from rlplug.rollout.utils import validate_prompts  # deferred: torch (imported there)

        self._check_open()
        prompts = validate_prompts(prompt_ids, self.vocab_size, params)
        n = int(params.n)
        seed = int(params.seed) if params.seed is not None else self.seed
        units = [(i, j) for i in range(len(prompts)) for j in range(n)]
        cancel = threading.Event()

        def one(i: int, j: int) -> tuple[list[int], str, list[float] | None]:
            path, body = self._request(prompts[i], params, self._unit_seed(seed, i, j))
            return self._post(path, body, self.request_timeout_s, parse=lambda b: self._parse(b, params), cancel=cancel)

        futures: list[Future] = [self._pool.submit(one, i, j) for i, j in units]
        try:
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            for f in done:  # the first failure, before waiting on anything still running
                if not f.cancelled() and f.exception() is not None:
                    raise f.exception()  # type: ignore[misc]
            results = [f.result() for f in futures]
        except BaseException:
            cancel.set()
            for f in futures:
                f.cancel()
            raise
        eos = set(self.eos_ids)
        responses: list[list[int]] = []
        reasons: list[str] = []
        lps: list[list[float]] | None = [] if params.logprobs else None
        for (i, j), (ids, reason, lp) in zip(units, results):
            ids = [int(t) for t in ids]
            cut = next((k + 1 for k, t in enumerate(ids) if t in eos), None)
            if cut is not None:
                ids, reason = ids[:cut], "stop"
                lp = lp[:cut] if lp is not None else None
            elif reason == "stop" and params.stop:
                pass  # a stop string (SamplingParams.stop) ended it: the ids end with the token that completed it
            elif reason == "length":
                if len(ids) > params.max_tokens:
                    raise ServerError(
                        f"{self.engine} returned {len(ids)} tokens for prompt {i}, more than max_tokens={params.max_tokens}."
                    )
            else:
                raise ServerError(
                    f"{self.engine} finished prompt {i} sample {j} with reason '{reason}' but no EOS token {sorted(eos)} in its "
                    f"{len(ids)} tokens; expected 'stop' with EOS (or a stop string of SamplingParams.stop) or 'length'."
                )
            responses.append(ids)
            reasons.append(reason)
            if lps is not None:
                if lp is None or len(lp) != len(ids):
                    raise ServerError(
                        f"{self.engine} returned {None if lp is None else len(lp)} log-probs for the {len(ids)} tokens of "
                        f"prompt {i} sample {j}; expected one per token."
                    )
                lps.append([float(x) for x in lp])
        index = [i for i, _ in units]
        return RolloutOutput(
            response_ids=responses, finish_reasons=reasons, prompt_index=index, log_probs=lps, metrics=self.counters()
        )

    def counters(self) -> dict[str, float]:
        """Run totals: ``rollout/resent_requests`` (requests and weight loads sent again after a failure,
        to the same or another replica), ``rollout/live_replicas``, ``rollout/replicas`` and
        ``rollout/replica_restarts`` (:meth:`rlplug.rollout.replicas.ReplicaSet.metrics`)."""
        with self._lock:
            resent = float(self.retries)
        return {"rollout/resent_requests": resent, **self.replicas.metrics()}

    # ------------------------------------------------------------------ weights
    def update_weights(self, named_tensors: Iterable[tuple[str, Any]] | dict[str, Any]) -> None:
        """Load the actor's weights (HF names, any dtype/device) into the server.

        Every checkpoint tensor must be present (``lm_head.weight`` may be absent when embeddings
        are tied; wrapper prefixes such as ``module.`` are stripped). Raises ``KeyError`` for
        unknown names and ``ValueError`` for missing names or shape mismatches (checked before
        anything is written), :class:`ServerError` if the server fails to load them. Seconds
        taken: ``last_update_s``.
        """
        from safetensors.torch import save_file  # deferred: torch (imported by safetensors.torch)

        from rlplug.rollout.utils import checked_weights  # deferred: torch (imported there)

        self._check_open()
        t0 = time.perf_counter()
        tensors = checked_weights(
            named_tensors,
            self.shapes,
            dtype=self.dtype,
            tie_word_embeddings=self.tie_word_embeddings,
            model_path=self.model_path,
            reloads=f"the {self.engine} server reloads the whole model",
        )
        self._weights_count += 1
        folder = Path(self._weights_root()) / f"v{self._weights_count:06d}"
        folder.mkdir()
        for f in Path(self.model_path).iterdir():
            if f.is_file() and f.suffix in _META_SUFFIXES and not f.name.endswith(".safetensors.index.json"):
                os.symlink(f.resolve(), folder / f.name)
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        previous = self.replicas.latest
        self.replicas.push(folder, lambda replica: self._push_one(replica, folder), self._pool)
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)
        self.last_update_s = time.perf_counter() - t0

    def _weights_root(self) -> str:
        """The private folder that holds pushed weights: under ``rollout.weights_dir`` when set (a filesystem
        every server can read), else in /dev/shm when it has room for two model copies."""
        root = self._state.get("weights_root")
        if root is None:
            nbytes = sum(math.prod(shape) for shape in self.shapes.values()) * self.dtype.itemsize
            base = self.weights_dir or _shm_dir(nbytes)
            os.makedirs(base, exist_ok=True)
            root = self._state["weights_root"] = tempfile.mkdtemp(
                prefix=f"rlplug-{self.engine}-weights-{os.getpid()}-", dir=base
            )
        return root

    def _push_one(self, replica: Replica, folder: Path) -> None:
        """Load ``folder`` into one live replica; a replica that dies meanwhile is handed to the replica set
        (it loads the latest weights when it comes back)."""
        import httpx  # deferred: httpx (server rollouts only; not a declared dependency of rlplug)

        last: BaseException | str = "no attempt"
        for attempt in range(self.max_retries + 1):
            self._check_open()
            with self.replicas.cond:
                if replica.state != LIVE:
                    return
                generation = replica.generation
            try:
                self._load_into(replica, folder)
                return
            except (httpx.TransportError, Retryable) as exc:
                last = exc
            if attempt < self.max_retries:
                with self._lock:
                    self.retries += 1
                self.replicas.failed(replica, generation, last)
        raise ServerError(
            f"{self.engine}: loading the weights into replica {replica.index} ({replica.url}) failed "
            f"{self.max_retries + 1} times; last error: {last}"
        )

    def _load_into(self, replica: Replica, folder: Path) -> None:
        """The subclass's :meth:`_load_weights` against ``replica`` (:meth:`_control` talks to it)."""
        before = getattr(self._tls, "replica", None)
        self._tls.replica = replica
        try:
            self._load_weights(folder)
        finally:
            self._tls.replica = before

    def _control(self, method: str, path: str, body: Any = None) -> Any:
        """One control request (no retry here) to the replica being loaded in this thread (else the first);
        5xx / transport errors raise :class:`Retryable`."""
        import httpx  # deferred: httpx (server rollouts only; not a declared dependency of rlplug)

        replica = getattr(self._tls, "replica", None)
        base = replica.url if replica is not None else self.base_url
        try:
            r = self._client.request(method, f"{base}{path}", json=body, timeout=self.server_timeout_s)
        except httpx.TimeoutException as exc:
            raise Retryable(f"{path}: no answer within {self.server_timeout_s:.0f} s") from exc
        if r.status_code >= 500:
            raise Retryable(f"{path}: HTTP {r.status_code}: {r.text[:300]}")
        if r.status_code >= 400:
            raise ServerError(f"The {self.engine} server rejected {path} with HTTP {r.status_code}: {r.text[:2000]}")
        try:
            return r.json() if r.content else None
        except ValueError:
            return r.text

    # ------------------------------------------------------------------ lifecycle
    def sleep(self) -> None:
        """No-op: an idle server blocks in its event loop (OpenMP threads passive), leaving the cores free."""

    def wake_up(self) -> None:
        """No-op (see :meth:`sleep`)."""

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"This {self.engine} rollout backend was closed; create a new one to generate.")

    def close(self) -> None:
        """Stop the server this backend started (its whole process group) and delete its files; idempotent."""
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        if hasattr(self, "replicas"):
            self.replicas.wake()  # requests waiting for a replica fail now
        self._finalizer()

    def __enter__(self) -> ServerRollout:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


if __name__ == "__main__":
    argv = sys.argv[1:]
    if len(argv) >= 4 and argv[0] == "--supervise" and "--" in argv:
        sep = argv.index("--")
        opts, command = argv[2:sep], argv[sep + 1 :]
        if command and len(opts) % 2 == 0 and all(o == "--cleanup" for o in opts[::2]):
            sys.exit(_supervise(int(argv[1]), command, opts[1::2]))
    print(
        "usage: python -m rlplug.rollout.serving --supervise PARENT_PID [--cleanup DIR]... -- COMMAND...  (started by rlplug)",
        file=sys.stderr,
    )
    sys.exit(2)
