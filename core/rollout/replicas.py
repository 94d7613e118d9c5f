"""Several engine servers behind one server rollout backend (``rollout.server_urls``, ``rollout.num_replicas``).

:class:`ReplicaSet` is the request router and the failure handling of
:class:`rlplug.rollout.serving.ServerRollout`; a backend with one server is a set of one replica, so there
is a single code path.

* **Replicas.** ``rollout.server_urls=[http://h1:30000,http://h2:30000]`` lists servers started
  elsewhere (external replicas; ``rollout.server_url`` is the alias for a list of one), else
  rlplug starts ``rollout.num_replicas`` servers itself on ``rollout.server_host`` (each on its
  own free port; ``rollout.server_port``, when set, is the first one's port and the others follow).
* **Routing.** Each HTTP request (one response) goes to the live replica with the fewest
  requests in flight; ties go to the one that was sent fewer requests so far, then to the lower
  index, so equal servers get equal shares (:meth:`ReplicaSet.acquire`).
* **Failures.** A request that failed on a replica (timeout, refused connection, 5xx) reports it
  (:meth:`ReplicaSet.failed`). A replica whose process still runs and whose health check answers
  200 had a transient failure: the request is sent again (to whichever replica is least busy). A
  dead replica leaves the routing at once, so its in-flight requests are re-sent to the others,
  and

  - a replica rlplug started is restarted in the background (at most ``rollout.max_restarts``
    times per replica), given the latest pushed weights, and rejoins;
  - an external replica is dropped with a warning while other replicas are live (it rejoins at
    the next weight push if its health check answers again); the last one left is waited for
    (``rollout.server_timeout_s``) as a single external server is.

  When no replica is live and none is restarting, every waiting request fails with a
  :class:`ServerError` listing each replica and why it is down.
* **Weights** (:meth:`ReplicaSet.push`) are loaded into every live replica in parallel from the
  one folder the backend wrote (``rollout.weights_dir``, on a filesystem every server can read);
  a replica that comes back loads the latest folder before it takes requests.

Counters (:meth:`ReplicaSet.metrics`): ``rollout/live_replicas``, ``rollout/replicas``,
``rollout/replica_restarts`` (restarts of started replicas in the run) and, from the backend,
``rollout/resent_requests``.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

__all__ = ["Replica", "ReplicaSet", "ServerError", "LIVE", "RESTARTING", "DEAD"]

log = logging.getLogger("rlplug.rollout.serving")

#: states of a :class:`Replica`
LIVE, RESTARTING, DEAD = "live", "restarting", "dead"


class ServerError(RuntimeError):
    """The rollout server failed: did not start, rejected a request, or kept failing after retries.
    (Re-exported by :mod:`rlplug.rollout.serving` and :mod:`rlplug.plugin`: the same class.)"""


class Replica:
    """One engine server of a :class:`ReplicaSet` (plain state; the set's lock guards it).

    ``url``: base URL without a trailing slash (None until a started replica is up); ``external``:
    started elsewhere (never started or stopped by rlplug); ``server``: the
    :class:`rlplug.rollout.serving.ServerProcess` of a started replica; ``outstanding``: requests in
    flight; ``requests``: requests sent to it in the run; ``restarts``: times it was restarted;
    ``generation``: +1 each time it leaves the routing (a failure reported against an older
    generation was already handled); ``reason``: why it is down; ``weights``: the folder it serves.
    """

    def __init__(self, index: int, url: str | None, external: bool) -> None:
        self.index = index
        self.url = url.rstrip("/") if url else None
        self.external = external
        self.server: Any = None
        self.pid: int | None = None  # of the started server, recorded once it is healthy (for messages)
        self.state = LIVE
        self.outstanding = 0
        self.requests = 0
        self.restarts = 0
        self.generation = 0
        self.reason = ""
        self.weights: Path | None = None

    def __repr__(self) -> str:
        return f"Replica({self.index}, {self.url!r}, {self.state}, outstanding={self.outstanding})"


class ReplicaSet:
    """Routing, failure handling and weight pushes over the replicas of one backend (module docstring).

    ``ReplicaSet(replicas, engine=..., start=..., load=..., healthy=..., is_closed=..., max_restarts=...,
    wait_s=...)``: ``start(replica)`` (re)starts a started replica's server and blocks until it is
    healthy (setting ``replica.server`` and ``replica.url``), ``load(replica, folder)`` loads a
    weights folder into one replica, ``healthy(replica, timeout_s) -> bool`` is its health check,
    ``is_closed()`` tells whether the backend was closed; ``max_restarts`` restarts per started
    replica; ``wait_s`` seconds (``rollout.server_timeout_s``) to wait for an external replica that
    is the last one left.
    """

    def __init__(
        self,
        replicas: Sequence[Replica],
        *,
        engine: str,
        start: Callable[[Replica], None],
        load: Callable[[Replica, Path], None],
        healthy: Callable[[Replica, float], bool],
        is_closed: Callable[[], bool],
        max_restarts: int,
        wait_s: float,
    ) -> None:
        if not replicas:
            raise ValueError("a ReplicaSet needs at least one replica")
        self.replicas = list(replicas)
        self.engine = engine
        self._start, self._load, self._healthy, self._is_closed = start, load, healthy, is_closed
        self.max_restarts = int(max_restarts)
        self.wait_s = float(wait_s)
        self.cond = threading.Condition(threading.RLock())
        self.latest: Path | None = None

    # ------------------------------------------------------------------ views
    @property
    def live(self) -> list[Replica]:
        """The replicas that take requests now."""
        with self.cond:
            return [r for r in self.replicas if r.state == LIVE]

    @property
    def restarts(self) -> int:
        """Restarts of started replicas in the run (all replicas together)."""
        return sum(r.restarts for r in self.replicas)

    def metrics(self) -> dict[str, float]:
        """``rollout/live_replicas``, ``rollout/replicas`` and ``rollout/replica_restarts`` (run totals)."""
        with self.cond:
            return {
                "rollout/live_replicas": float(sum(r.state == LIVE for r in self.replicas)),
                "rollout/replicas": float(len(self.replicas)),
                "rollout/replica_restarts": float(self.restarts),
            }

    def down_error(self) -> Exception:
        """The :class:`ServerError` raised when no replica is left (each one's reason)."""
        lines = "\n".join(f"  replica {r.index} ({r.url}): {r.reason or r.state}" for r in self.replicas)
        return ServerError(
            f"No {self.engine} server is left to generate: all {len(self.replicas)} replica(s) "
            f"(rollout.server_urls / rollout.num_replicas) are down.\n{lines}"
        )

    # ------------------------------------------------------------------ start
    def start_all(self, pool: Executor) -> None:
        """Start every started replica (in parallel) and wait for every external one to be healthy.

        Raises the first startup error (:class:`ServerError` naming the replica); the
        caller stops whatever did start."""

        def up(r: Replica) -> None:
            if not r.external:
                self._start(r)
                return
            deadline = time.monotonic() + self.wait_s
            while not self._healthy(r, min(10.0, max(1.0, deadline - time.monotonic()))):
                if self._is_closed():
                    raise RuntimeError(f"This {self.engine} rollout backend was closed while it started.")
                if time.monotonic() > deadline:
                    raise ServerError(
                        f"The {self.engine} server at {r.url} (replica {r.index} of rollout.server_urls) did not "
                        f"answer its health check with 200 within {self.wait_s:.0f} s (rollout.server_timeout_s). "
                        "Start it first, or remove it from rollout.server_urls."
                    )
                time.sleep(0.25)

        if len(self.replicas) == 1:
            up(self.replicas[0])
            return
        futures = [pool.submit(up, r) for r in self.replicas]
        errors = [f.exception() for f in futures]  # waits for every one
        for exc in errors:
            if exc is not None:
                raise exc

    # ------------------------------------------------------------------ routing
    def acquire(self) -> Replica:
        """The live replica with the fewest requests in flight (then the fewest sent, then the lowest index),
        counted as busy until :meth:`release`. Blocks while replicas restart and none is live.

        Raises :class:`ServerError` (:meth:`down_error`) when no replica is live or
        restarting, ``RuntimeError`` once the backend is closed."""
        with self.cond:
            while True:
                if self._is_closed():
                    raise RuntimeError(f"This {self.engine} rollout backend was closed; create a new one to generate.")
                live = [r for r in self.replicas if r.state == LIVE]
                if live:
                    r = min(live, key=lambda x: (x.outstanding, x.requests, x.index))
                    r.outstanding += 1
                    r.requests += 1
                    return r
                if not any(r.state == RESTARTING for r in self.replicas):
                    raise self.down_error()
                self.cond.wait(0.5)

    def release(self, replica: Replica) -> None:
        """The request sent to ``replica`` by :meth:`acquire` is over (answered or failed)."""
        with self.cond:
            replica.outstanding -= 1

    def failed(self, replica: Replica, generation: int, reason: BaseException | str) -> None:
        """A request sent to ``replica`` (at ``generation``) failed with ``reason``: decide what to do.

        A replica whose process runs and that answers its health check keeps serving (transient
        failure: returns after 0.2 s). Otherwise it leaves the routing and is restarted (started
        replica, ``max_restarts`` times), dropped (external, others live) or waited for (external,
        the last one); see the module docstring. Returns at once in those cases: the caller sends
        the request again through :meth:`acquire`."""
        with self.cond:
            if replica.generation != generation or replica.state != LIVE:
                return  # another request already handled this failure
        process_alive = replica.server is None or replica.server.alive
        if process_alive and self._healthy(replica, min(30.0, self.wait_s)):
            time.sleep(0.2)  # busy server or dropped connection: send again shortly
            return
        with self.cond:
            if replica.generation != generation or replica.state != LIVE or self._is_closed():
                return
            replica.generation += 1
            what = "dead" if not process_alive else "not healthy"
            others = [r for r in self.replicas if r is not replica and r.state in (LIVE, RESTARTING)]
            if replica.external and others:
                replica.state, replica.reason = DEAD, f"dropped after: {reason}"
                log.warning(
                    "%s replica %d (%s) is %s (%s); dropped, %d replica(s) left; it rejoins at the next weight push "
                    "if it answers again",
                    self.engine,
                    replica.index,
                    replica.url,
                    what,
                    reason,
                    len(others),
                )
            elif replica.external:
                replica.state = RESTARTING
                log.warning(
                    "%s server at %s is %s (%s); waiting up to %.0f s for it to come back",
                    self.engine,
                    replica.url,
                    what,
                    reason,
                    self.wait_s,
                )
            elif replica.restarts >= self.max_restarts:
                server = replica.server
                replica.state = DEAD
                replica.reason = (
                    f"The {self.engine} server failed again ({reason}) and was already restarted {replica.restarts} "
                    f"times (rollout.max_restarts). Last lines of {server.log_path}:\n{server.log_tail()}"
                )
                log.warning("%s replica %d: %s", self.engine, replica.index, replica.reason)
            else:
                replica.restarts += 1
                replica.state = RESTARTING
                log.warning(
                    "%s server of replica %d (pid %s) is %s (%s); restarting it (%d/%d)",
                    self.engine,
                    replica.index,
                    replica.pid,
                    what,
                    reason,
                    replica.restarts,
                    self.max_restarts,
                )
            self.cond.notify_all()
            if replica.state == RESTARTING:
                threading.Thread(
                    target=self._revive,
                    args=(replica, replica.generation),
                    name=f"rlplug-{self.engine}-revive-{replica.index}",
                    daemon=True,
                ).start()

    def _revive(self, replica: Replica, generation: int) -> None:
        """Bring ``replica`` back (restart it, or wait for an external one), load the latest weights, rejoin."""
        try:
            if not replica.external:
                if replica.server is not None:
                    replica.server.stop()
                self._start(replica)
            else:
                deadline = time.monotonic() + self.wait_s
                while not self._healthy(replica, 5.0):
                    if self._is_closed():
                        return
                    if time.monotonic() > deadline:
                        raise ServerError(
                            f"it did not answer its health check within {self.wait_s:.0f} s (rollout.server_timeout_s)"
                        )
                    time.sleep(0.25)
            self._load_latest(replica, generation)
        except BaseException as exc:
            with self.cond:
                if replica.generation == generation:
                    replica.state = DEAD
                    replica.reason = f"could not be brought back: {exc}"
                    log.warning("%s replica %d (%s) %s", self.engine, replica.index, replica.url, replica.reason)
                self.cond.notify_all()

    def _load_latest(self, replica: Replica, generation: int) -> None:
        """Load the latest pushed weights into ``replica`` until no newer push came meanwhile, then mark it live."""
        while True:
            with self.cond:
                folder = self.latest
            try:
                if folder is not None:
                    self._load(replica, folder)
            except Exception as exc:
                with self.cond:
                    if self.latest == folder:
                        raise RuntimeError(
                            f"it came back but failed to load the latest weights ({folder}): {exc}"
                        ) from exc
                continue  # a newer push replaced (and deleted) that folder: load the newer one
            with self.cond:
                if replica.generation != generation:
                    return
                if self.latest == folder:
                    replica.weights, replica.state, replica.reason = folder, LIVE, ""
                    log.warning("%s replica %d (%s) is back", self.engine, replica.index, replica.url)
                    self.cond.notify_all()
                    return

    # ------------------------------------------------------------------ weights
    def push(self, folder: Path, load_one: Callable[[Replica], None], pool: Executor) -> None:
        """Make ``folder`` the latest weights and load it into every live replica in parallel.

        ``load_one(replica)`` loads ``folder`` into one replica with the backend's retries (a replica
        that dies meanwhile goes through :meth:`failed`, and loads the latest folder when it comes
        back). A dropped external replica whose health check answers again is given the weights and
        rejoins. Raises the first load error, and :meth:`down_error` when no replica is left."""
        with self.cond:
            self.latest = folder
            targets = [r for r in self.replicas if r.state == LIVE]
            dropped = [r for r in self.replicas if r.state == DEAD and r.external]

        def rejoin(r: Replica) -> None:
            if not self._healthy(r, 2.0):
                return
            gen = r.generation
            try:
                self._load(r, folder)
            except Exception as exc:
                log.warning(
                    "%s replica %d (%s) answers again but failed to load weights: %s", self.engine, r.index, r.url, exc
                )
                return
            with self.cond:
                if r.state == DEAD and r.generation == gen and self.latest == folder:
                    r.state, r.reason, r.weights = LIVE, "", folder
                    log.warning("%s replica %d (%s) rejoined", self.engine, r.index, r.url)
                    self.cond.notify_all()

        jobs: list[Callable[[], None]] = [functools.partial(load_one, r) for r in targets]
        jobs += [functools.partial(rejoin, r) for r in dropped]
        if len(jobs) == 1:
            jobs[0]()
        else:
            futures = [pool.submit(job) for job in jobs]
            errors = [f.exception() for f in futures]
            for exc in errors:
                if exc is not None:
                    raise exc
        with self.cond:
            for r in targets:
                if r.state == LIVE:
                    r.weights = folder
            if not any(r.state in (LIVE, RESTARTING) for r in self.replicas):
                raise self.down_error()

    def wake(self) -> None:
        """Wake every thread waiting in :meth:`acquire` (after the backend was closed)."""
        with self.cond:
            self.cond.notify_all()
