"""Asynchronous training: generation overlapped with training under a staleness bound (``docs/async.md``).

``trainer.async_mode`` picks the step pipeline (:func:`pipeline_for`):

* ``sync`` (default): :class:`rlplug.run.step_pipeline.SyncStepPipeline`, generate then train.
* ``one_step_off``: the rollouts of step ``k + 1`` are generated while step ``k`` trains, with the weights of
  step ``k - 1``; the weights of step ``k`` are pushed when both the update and that generation have ended
  (verl's one-step-off policy). Deterministic: it equals a sequence of synchronous steps whose rollouts use the
  previous step's weights, and it resumes bit for bit.
* ``async``: a producer thread generates ahead continuously; ``trainer.max_staleness`` bounds how many weight
  versions a trained sample may lag. ``trainer.stale_policy=wait``: a generation batch is started only when it
  will be fresh enough when trained (admission control, counted in ``async/waited``); ``drop``: the engine runs
  one batch further ahead, and at training time the groups past the bound are regenerated under the current
  weights (``async/dropped``). Which weights a batch gets depends on the engine's and the trainer's timing, so an
  ``async`` run is not bitwise reproducible, except at ``max_staleness=0`` where it equals ``sync``.

Versions. The engine holds the weights of trainer step ``version`` (0: the initial model; after a resume, the
resumed step). A token's version is the one the engine held when it was sampled (``RolloutOutput.versions``); a
sample's staleness, when step ``s`` trains on it, is ``(s - 1) - min(versions)``. With ``rollout.partial_rollout``
a response is generated in chunks (:func:`rlplug.rollout.partial.generate_partial`) and a push lands between two
chunks, so one response can carry two versions.

Processes. In ``one_step_off`` and ``async`` the engine runs in a process of its own
(:func:`rlplug.rollout.engine_process.build_engine`: the ``hf`` engine too, with ``rollout.num_threads`` threads
and ``trainer.engine_cpus``), and the trainer process is pinned to ``trainer.trainer_cpus``. The producer thread of
the trainer process only waits on the engine. Under ``trainer=fsdp2`` rank 0 owns the engine and the producer and
broadcasts each batch.

Nothing lost, nothing repeated. The data loader is drawn by the producer, ahead of training. A checkpoint records
(:meth:`RolloutFeed.state_dict`) the generation batches already finished and queued (their rollouts, and the loader
position each was drawn at), and as the data loader's state the position after the last trained batch. A resume
restores the queued batches (drawing each at its position, which leaves the loader after the last of them) and
re-issues a batch that was still being generated; a resume in ``sync`` mode generates the queued ones again. So
after a kill every prompt is trained on exactly once (or counted once by a batch filter), whatever the engine was
doing.

The loss. Async modes record the engine's log-probs (``rollout.calculate_log_probs``), recompute
``old_log_probs`` with the trainer's current weights (the proximal policy of decoupled PPO, Hilton et al. 2022,
"Batch size-invariance for policy optimization", arXiv 2110.00641; AReaL's ``decoupled`` loss) and weight each token
by ``pi_old / pi_rollout`` truncated at ``algorithm.rollout_correction.rollout_is_threshold``
(``rollout_is=token``): the defaults :func:`rlplug.config.async_mode.async_defaults` sets. Bypass mode
(``algorithm.rollout_correction.bypass_mode=true``: the engine's log-probs are the old ones) and the rest of the
rollout-correction family are config choices.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from rlplug.base.faults import fault_point
from rlplug.base.processes import pin_process
from rlplug.contracts.types import RolloutOutput, SamplingParams
from rlplug.rollout.utils import merge_engine_metrics
from rlplug.run.batch_filter import collect_rollouts
from rlplug.run.step_pipeline import SyncStepPipeline

__all__ = [
    "AsyncStepPipeline",
    "EngineGate",
    "GatedTransfer",
    "GenBatch",
    "RolloutFeed",
    "pipeline_for",
    "staleness_of",
]


def pipeline_for(cfg: DictConfig) -> Any:
    """The step pipeline of ``trainer.async_mode``: :class:`SyncStepPipeline` or :class:`AsyncStepPipeline`."""
    mode = cfg.trainer.get("async_mode", "sync")
    return SyncStepPipeline() if mode == "sync" else AsyncStepPipeline(cfg)


# ============================================================================ the engine, shared


class EngineGate:
    """The rollout engine shared by the producer thread (generation) and the trainer thread (weight pushes,
    validation, ReMax baselines), and the weight version it holds.

    Two locks. :attr:`lock` (re-entrant) fixes the weights: a push and a version change hold it, and so does the
    producer for a whole generation batch (a multi-turn batch keeps one version) or one partial-rollout chunk.
    ``generate`` does not take it, only :attr:`call_lock`, one engine call at a time, so the calls a batch makes
    from other threads (a server engine's multi-turn episodes run one thread per trajectory) and the trainer's own
    generations go through while the producer holds :attr:`lock`. ``concurrent=True`` (server engines, which
    answer concurrent HTTP requests) lets calls overlap. Lock order: :attr:`lock`, then :attr:`call_lock`.

    It stands in for the engine as ``trainer.rollout`` (the :class:`rlplug.contracts.types.RolloutBackend`
    methods): ``sleep``/``wake_up`` do nothing, since in async modes the engine has its own process and
    generates while the trainer trains."""

    def __init__(self, engine: Any, version: int = 0, *, concurrent: bool = False) -> None:
        self.engine = engine
        self.lock = threading.RLock()
        self.call_lock: Any = contextlib.nullcontext() if concurrent else threading.RLock()
        self.version = version
        #: (start, end) perf_counter intervals in which the engine generated, for the overlap metrics
        self.busy: collections.deque[tuple[float, float]] = collections.deque(maxlen=4096)

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> RolloutOutput:
        with self.call_lock:
            t0 = time.perf_counter()
            try:
                return self.engine.generate(prompt_ids, params)
            finally:
                self.busy.append((t0, time.perf_counter()))

    def update_weights(self, named_tensors: Any) -> None:
        with self.lock, self.call_lock:
            self.engine.update_weights(named_tensors)

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass

    def close(self) -> None:
        self.engine.close()

    @property
    def pid(self) -> Any:
        return getattr(self.engine, "pid", None)

    @property
    def metrics(self) -> Any:
        return getattr(self.engine, "metrics", ())

    def __getattr__(self, name: str) -> Any:  # memory(), restarts ...: the engine's
        return getattr(self.__dict__["engine"], name)


class GatedTransfer:
    """The weight transfer of async modes: the wrapped transfer's push, done under the engine's locks (it waits for
    the producer's batch in progress, or its chunk with partial rollouts), then the engine's version set to the step whose weights it now holds
    (:attr:`step`, set by the pipeline before the update; None: the trainer's ``global_step``, as at a resume). In
    ``one_step_off`` it first waits until the producer has generated every batch it may generate with the
    current weights (the next step's), so each batch's version is fixed by the schedule, not by timing."""

    def __init__(self, inner: Any, trainer: Any, gate: EngineGate | None, feed: RolloutFeed | None) -> None:
        self.inner, self.trainer, self.gate, self.feed = inner, trainer, gate, feed
        self.version = getattr(inner, "version", 0)
        self.step: int | None = None
        self.wait_s = 0.0  # seconds pushes waited (the lock and, in one_step_off, the generation)
        #: (start, end) perf_counter intervals the pushes waited, for the overlap metrics (the pipeline empties it)
        self.waits: list[tuple[float, float]] = []

    def push(self, backend: Any, rollout: Any) -> None:
        t0 = time.perf_counter()
        if self.feed is not None:
            self.feed.before_push()
        if self.gate is None:  # a rank without the engine: join the gathers
            self.inner.push(backend, None)
        else:
            with self.gate.lock, self.gate.call_lock:
                t1 = time.perf_counter()
                self.wait_s += t1 - t0
                self.waits.append((t0, t1))
                self.inner.push(backend, self.gate.engine)
                self.gate.version = self.step if self.step is not None else int(self.trainer.global_step)
        self.version += 1


# ============================================================================ the producer


@dataclass
class GenBatch:
    """One generation batch of the producer: draw ``draw`` (1-based over the run) of the data loader.

    ``rows`` (one per prompt) and ``epoch`` as ``loader.next_batch()`` gave them; ``before`` / ``after``: the
    loader's ``state_dict()`` before and after the draw; ``out``: the rollout, with ``out.versions`` set;
    ``gen_s``: seconds of generation."""

    draw: int
    rows: list[dict]
    epoch: int
    before: dict
    after: dict
    out: RolloutOutput
    gen_s: float = 0.0


def staleness_of(out: RolloutOutput, version: int) -> list[int]:
    """Per response: ``version - min(out.versions[i])``, in weight versions (0 for an empty response).

    Raises ``ValueError`` when ``out.versions`` is None (set it with :func:`with_versions`)."""
    if out.versions is None:
        raise ValueError("staleness_of needs RolloutOutput.versions (the weight version of each token); got None")
    return [version - min(v) if v else 0 for v in out.versions]


def with_versions(out: RolloutOutput, version: int) -> RolloutOutput:
    """``out`` with every token's version ``version`` where the engine gave none."""
    if out.versions is None:
        out.versions = [[version] * len(r) for r in out.response_ids]
    return out


class RolloutFeed:
    """The producer: a thread that draws the data loader and generates ahead of training (module docstring).

    ``depth``: how many draws may be generated beyond those whose step has finished training (``max_staleness + 1``,
    one more with ``stale_policy=drop``); ``pinned`` (one_step_off): a push first waits until every admissible draw
    is generated. ``limit``: the last draw worth generating (the run's last step without a batch filter; None:
    bounded by ``depth`` only). Counters go into the step's metrics via :meth:`step_metrics`."""

    def __init__(
        self,
        trainer: Any,
        gate: EngineGate,
        *,
        bound: int,
        policy: str,
        pinned: bool,
        limit: int | None,
        partial_chunk_tokens: int | None = None,
    ) -> None:
        self.trainer, self.gate = trainer, gate
        self.bound, self.policy, self.pinned, self.limit = bound, policy, pinned, limit
        self.depth = bound + (2 if policy == "drop" else 1)
        self.partial_chunk_tokens = partial_chunk_tokens
        self.cond = threading.Condition()
        self.queue: collections.deque[GenBatch] = collections.deque()
        self.next_draw: int | None = None  # the draw the producer starts next
        self.in_flight: int | None = None
        self.done_draws = 0  # draws consumed by steps that finished training
        #: the draw the step in progress waits for with nothing queued (a batch filter that needs more draws than the
        #: bound lets the producer start): admitted whatever the bound, since it is trained at once (staleness 0)
        self.demand = 0
        self.taken: list[GenBatch] = []  # draws taken by the step in progress
        #: (start, end) perf_counter intervals the trainer waited for a batch, for the overlap metrics
        self.waits: list[tuple[float, float]] = []
        self.trained_cursor: dict | None = None  # loader state after the last draw of a finished step
        self.restored: list[dict] = []  # queued batches of a checkpoint, rebuilt on start
        self.error: BaseException | None = None
        self.stopping = False
        self.thread: threading.Thread | None = None
        self.counts = {"waited": 0.0, "waited_s": 0.0, "dropped": 0.0, "regen_s": 0.0}
        self.optional_state = True  # a checkpoint of a sync run has none: start from the loader's position

    # ------------------------------------------------------------------ lifecycle
    def start(self, first_draw: int) -> None:
        with self.cond:
            if self.next_draw is None:
                self.next_draw = first_draw
                self.done_draws = first_draw - 1
            if self.trained_cursor is None:
                self.trained_cursor = self.trainer.loader.state_dict()
            for saved in self.restored:  # the checkpoint's queued batches: their rows from the loader, as drawn
                self.trainer.loader.load_state_dict(saved["before"])
                rows, epoch = self.trainer.loader.next_batch()
                out = _output_from_json(saved["out"])
                after = self.trainer.loader.state_dict()
                self.queue.append(
                    GenBatch(saved["draw"], rows, epoch, saved["before"], after, out, float(saved.get("gen_s", 0.0)))
                )
            self.restored = []
        self.thread = threading.Thread(target=self._run, name="rlplug-rollout-producer", daemon=True)
        self.thread.start()

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join(timeout=120)  # the generation call in progress ends first

    # ------------------------------------------------------------------ producer thread
    def _admissible(self, draw: int) -> bool:
        ahead = draw <= self.done_draws + self.depth or draw <= self.demand
        return ahead and (self.limit is None or draw <= self.limit)

    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    assert self.next_draw is not None
                    t_wait = None
                    while not self.stopping and not self._admissible(self.next_draw):
                        if t_wait is None:
                            t_wait = time.perf_counter()
                            if self.limit is None or self.next_draw <= self.limit:
                                self.counts["waited"] += 1  # ready, but the bound holds it back
                        self.cond.wait()
                    if t_wait is not None and (self.limit is None or self.next_draw <= self.limit):
                        self.counts["waited_s"] += time.perf_counter() - t_wait
                    if self.stopping:
                        return
                    draw = self.next_draw
                    self.in_flight = draw
                    before = self.trainer.loader.state_dict()
                    rows, epoch = self.trainer.loader.next_batch()
                    after = self.trainer.loader.state_dict()
                t0 = time.perf_counter()
                out = self._generate(rows, self.trainer.sampling_params(step=draw))
                batch = GenBatch(draw, rows, epoch, before, after, out, time.perf_counter() - t0)
                with self.cond:
                    self.queue.append(batch)
                    self.in_flight = None
                    self.next_draw = draw + 1
                    self.cond.notify_all()
        except BaseException as exc:  # handed to the trainer thread, which raises it
            with self.cond:
                self.error = exc
                self.in_flight = None
                self.cond.notify_all()

    def _generate(self, rows: list[dict], params: SamplingParams) -> RolloutOutput:
        """One batch's rollout with the engine's current weights: the whole call under the engine's lock (a
        multi-turn batch keeps one version), or chunk by chunk with ``rollout.partial_rollout``."""
        if self.partial_chunk_tokens:
            from rlplug.rollout.partial import generate_partial  # deferred: torch

            def call(ids: list[list[int]], p: SamplingParams) -> tuple[RolloutOutput, int]:
                with self.gate.lock:
                    fault_point("rollout")
                    return self.gate.generate(ids, p), self.gate.version

            return generate_partial(
                call,
                [list(r["prompt_ids"]) for r in rows],
                params,
                chunk_tokens=self.partial_chunk_tokens,
                tokenizer=self.trainer.tokenizer,
            )
        with self.gate.lock:
            version = self.gate.version
            out = self.trainer._rollout(rows, params, main=True)  # fault point "rollout", multi-turn episodes
        return with_versions(out, version)

    # ------------------------------------------------------------------ trainer thread
    def take(self, metrics: dict[str, float]) -> GenBatch:
        """The next generation batch (waiting for it), stale groups regenerated per the policy."""
        t0 = time.perf_counter()
        with self.cond:
            while not self.queue and self.error is None:
                if self.in_flight is None and self.next_draw is not None and not self._admissible(self.next_draw):
                    # this step needs another draw (a batch filter refilling) and the bound holds the producer back:
                    # the draw is generated now with the current weights and trained at once, so it is never stale
                    self.demand = self.next_draw
                    self.cond.notify_all()
                self.cond.wait()
            if self.error is not None:
                raise RuntimeError(f"the rollout producer thread failed: {self.error!r}") from self.error
            batch = self.queue.popleft()
        t1 = time.perf_counter()
        metrics["async/wait_batch_s"] = metrics.get("async/wait_batch_s", 0.0) + t1 - t0
        self.waits.append((t0, t1))
        self.taken.append(batch)
        self._refresh_stale(batch, metrics)
        return batch

    def _refresh_stale(self, batch: GenBatch, metrics: dict[str, float]) -> None:
        """Regenerate the groups of ``batch`` whose oldest token lags the trainer by more than ``max_staleness``
        versions, under the current weights (with ``wait`` this happens only when a partial response outlived the
        bound); count them in ``async/dropped``."""
        out, version = batch.out, self.gate.version
        late = staleness_of(out, version)
        stale = sorted({out.prompt_index[i] for i, s in enumerate(late) if s > self.bound})
        if not stale:
            return
        t0 = time.perf_counter()
        params = self.trainer.sampling_params(step=batch.draw)
        if len(stale) == len(batch.rows):
            fresh = self._generate(batch.rows, params)
            batch.out = fresh
        else:
            sub = [batch.rows[p] for p in stale]
            fresh = self._generate(
                sub, dataclasses.replace(params, seed=None if params.seed is None else params.seed + 1)
            )
            keep = [i for i, p in enumerate(out.prompt_index) if p not in set(stale)]
            parts = [out.take(keep, [out.prompt_index[i] for i in keep]), fresh]
            index = [out.prompt_index[i] for i in keep] + [stale[p] for p in fresh.prompt_index]
            # the engine's numbers over everything generated for the batch, the replaced groups included
            metrics = merge_engine_metrics(
                [(out.metrics, len(out.response_ids)), (fresh.metrics, len(fresh.response_ids))]
            )
            joined = RolloutOutput.join(parts, index, metrics)
            order = sorted(range(len(index)), key=lambda i: index[i])  # prompt-major again, responses in order
            batch.out = joined.take(order, [index[i] for i in order])
        spent = time.perf_counter() - t0
        self.counts["dropped"] += len(stale)
        self.counts["regen_s"] += spent
        batch.gen_s += spent

    def step_done(self) -> None:
        """The step that took :attr:`taken` finished training: its draws count as trained (the loader cursor
        moves past them) and the producer may go ahead."""
        with self.cond:
            if self.taken:
                self.done_draws = self.taken[-1].draw
                self.trained_cursor = self.taken[-1].after
            self.taken = []
            self.cond.notify_all()

    def before_push(self) -> None:
        """``one_step_off``: wait until the producer has generated every draw it may generate now (so the next
        step's rollouts are made with the weights being replaced) or has stopped."""
        if not self.pinned:
            return
        with self.cond:
            while (
                self.error is None
                and not self.stopping
                and self.thread is not None
                and (self.in_flight is not None or (self.next_draw is not None and self._admissible(self.next_draw)))
            ):
                self.cond.wait()

    def step_metrics(self, step_version: int, trained: RolloutOutput) -> dict[str, float]:
        """``async/*`` of one step, ``trained`` the rollout it trained on (a batch filter's kept groups, not every
        draw it took); resets the counters."""
        late = staleness_of(trained, step_version)
        with self.cond:
            counts, self.counts = self.counts, dict.fromkeys(self.counts, 0.0)
            queued = len(self.queue)
        return {
            "async/staleness_mean": sum(late) / max(len(late), 1),
            "async/staleness_max": float(max(late, default=0)),
            "async/dropped": counts["dropped"],
            "async/waited": counts["waited"],
            "async/waited_s": counts["waited_s"],
            "async/regenerate_s": counts["regen_s"],
            "async/queued": float(queued),
            "async/multi_version": float(sum(1 for v in trained.versions or [] if len(set(v)) > 1)),
        }

    # ------------------------------------------------------------------ checkpoint
    def _snapshot(self) -> tuple[dict, dict]:
        """``(cursor, state)`` taken together under the lock: the finished, untrained batches (rollouts and the
        loader state each was drawn at), the next draw, and the loader state after them."""
        with self.cond:
            saved = list(self.queue)
            cursor = self.trained_cursor  # a sync resume regenerates the queued batches from here; an async one
            # restores them (drawing each at its position, which leaves the loader after the last)
            state = {
                "next_draw": saved[-1].draw + 1 if saved else self.done_draws + 1,
                "done_draws": self.done_draws,
                "queue": [
                    {"draw": b.draw, "before": b.before, "gen_s": b.gen_s, "out": _output_to_json(b.out)} for b in saved
                ],
            }
        return (cursor if cursor is not None else self.trainer.loader.state_dict()), state

    def _pending(self) -> tuple[dict, dict]:
        """One snapshot per checkpoint, whichever of :meth:`cursor` and :meth:`state_dict` is called first."""
        snap = self.__dict__.pop("_snap", None)
        if snap is None:
            snap = self._snap = self._snapshot()
        return snap

    def state_dict(self) -> dict:
        return self._pending()[1]

    def cursor(self) -> dict:
        """The data loader's state to checkpoint: the position after the batches trained."""
        return self._pending()[0]

    def load_state_dict(self, state: dict) -> None:
        self.next_draw = int(state["next_draw"])
        self.done_draws = int(state["done_draws"])
        self.restored = list(state.get("queue", []))


class _CursorView:
    """What a checkpoint saves as ``data_loader`` in async modes: the position after the batches trained
    (:meth:`RolloutFeed.cursor`), not the live loader's, which the producer has moved further. The queued batches
    are the feed's own state; a resume in ``sync`` mode generates them again from this position."""

    def __init__(self, loader: Any, feed: RolloutFeed) -> None:
        self.loader, self.feed = loader, feed

    def state_dict(self) -> dict:
        return self.feed.cursor()

    def load_state_dict(self, state: Any) -> None:
        self.loader.load_state_dict(state)
        self.feed.trained_cursor = self.loader.state_dict()


def _output_to_json(out: RolloutOutput) -> dict:
    return dataclasses.asdict(out)


def _output_from_json(data: dict) -> RolloutOutput:
    data = dict(data)
    if data.get("step_rewards") is not None:
        data["step_rewards"] = [[(int(p), float(r)) for p, r in x] for x in data["step_rewards"]]
    return RolloutOutput(**data)


# ============================================================================ the pipeline


def _covered(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] covered by the union of ``intervals``."""
    total, end = 0.0, lo
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


class AsyncStepPipeline(SyncStepPipeline):
    """The step of ``one_step_off`` and ``async``: the batches come from :class:`RolloutFeed`; the rest of the
    step (scoring, passes, update) is the synchronous one; pushes go through :class:`GatedTransfer`."""

    def __init__(self, cfg: DictConfig) -> None:
        t = cfg.trainer
        self.mode = str(t.async_mode)
        self.bound = 1 if self.mode == "one_step_off" else int(t.max_staleness)
        self.policy = "wait" if self.mode == "one_step_off" else str(t.stale_policy)
        self.feed: RolloutFeed | None = None
        self.gate: EngineGate | None = None
        self.transfer: GatedTransfer | None = None

    # ------------------------------------------------------------------ setup
    def attach(self, trainer: Any) -> None:
        """Put the engine behind an :class:`EngineGate`, pushes through a :class:`GatedTransfer`, the trainer
        process on ``trainer.trainer_cpus``; build the producer (started by the first step)."""
        cfg = trainer.cfg
        cpus = cfg.trainer.get("trainer_cpus")
        if cpus:  # every thread: torch's workers started when the model loaded, before this
            pin_process({int(c) for c in cpus})
        if trainer.is_main:
            # a server engine answers concurrent requests (its multi-turn episodes run one thread per trajectory)
            self.gate = EngineGate(trainer.rollout, concurrent=cfg.rollout.get("mode") == "server")
            trainer.rollout = self.gate
            no_filter = not cfg.algorithm.get("batch_filter") and not cfg.algorithm.filter_groups.enable
            partial = int(cfg.rollout.partial_chunk_tokens) if cfg.rollout.get("partial_rollout") else None
            self.feed = RolloutFeed(
                trainer,
                self.gate,
                bound=self.bound,
                policy=self.policy,
                pinned=self.mode == "one_step_off",
                limit=trainer.total_steps if no_filter else None,
                partial_chunk_tokens=partial,
            )
        self.transfer = GatedTransfer(trainer.weight_transfer, trainer, self.gate, self.feed)
        trainer.weight_transfer = self.transfer

    def checkpointed(self, trainer: Any) -> dict[str, Any]:
        """What replaces the data loader in the checkpoint, and the producer's state (main process)."""
        if self.feed is None:
            return {}
        return {"data_loader": _CursorView(trainer.loader, self.feed), "async_feed": self.feed}

    def close(self) -> None:
        if self.feed is not None:
            self.feed.close()

    # ------------------------------------------------------------------ one step
    def run(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        if self.feed is not None and self.feed.thread is None:
            self.feed.start(step)
        start = time.perf_counter()
        push_wait0 = self.transfer.wait_s if self.transfer is not None else 0.0
        state = self.generate(trainer, step, metrics)
        self.prepare(trainer, state, metrics)
        if self.transfer is not None:
            self.transfer.step = step
        self.update(trainer, state, metrics)
        if self.gate is not None:
            with self.gate.lock:  # no push this step (critic warm-up, a skipped update): the weights are unchanged
                self.gate.version = step
        if self.transfer is not None:
            self.transfer.step = None
            metrics["async/wait_push_s"] = self.transfer.wait_s - push_wait0
        waits: list[tuple[float, float]] = []  # when the trainer waited: for batches, for pushes
        for source in (self.feed, self.transfer):
            if source is not None:
                waits += source.waits
                source.waits = []
        if self.feed is not None:
            taken = list(self.feed.taken)
            self.feed.step_done()
            metrics.update(self.feed.step_metrics(step - 1, state.out))
            metrics["timing_s/gen"] = sum(b.gen_s for b in taken)  # the engine's seconds for this step's batches
        self.record(trainer, state, metrics)
        metrics.update(overlap_metrics(start, time.perf_counter(), waits, list(self.gate.busy) if self.gate else []))

    def rollouts(self, trainer: Any, step: int, metrics: dict[str, float]) -> tuple[Any, ...]:
        """As the synchronous stage, with the generation batches taken from the producer (rank 0) and broadcast;
        the sampling settings are the producer's (each draw's step seed), not ``params``."""
        feed = self.feed

        def source(k: int, params: SamplingParams) -> tuple[list[dict], int, RolloutOutput]:
            got = None
            if feed is not None:
                b = feed.take(metrics)
                got = (b.rows, b.epoch, b.out)
            return trainer.coordinator.broadcast(got)

        return collect_rollouts(trainer, step, metrics, source=source)


def overlap_metrics(
    start: float, end: float, waits: list[tuple[float, float]], engine_busy: list[tuple[float, float]]
) -> dict[str, float]:
    """The step's ``[start, end]`` (perf_counter seconds) split by who was busy: ``async/trainer_idle_share`` (the
    trainer waiting for a batch or a push: ``waits``), ``async/generator_idle_share`` (the engine not generating:
    ``engine_busy``), ``async/overlap_share`` (both busy at once: what separate devices turn into speed)."""
    wall = max(end - start, 1e-9)
    busy_trainer = _complement(waits, start, end)
    both = [(max(a, c), min(b, d)) for a, b in engine_busy for c, d in busy_trainer if min(b, d) > max(a, c)]
    return {
        "async/trainer_idle_share": _covered(waits, start, end) / wall,
        "async/generator_idle_share": 1.0 - _covered(engine_busy, start, end) / wall,
        "async/overlap_share": _covered(both, start, end) / wall,
    }


def _complement(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    out, at = [], lo
    for a, b in sorted(intervals):
        if a > at:
            out.append((at, min(a, hi)))
        at = max(at, b)
    if at < hi:
        out.append((at, hi))
    return out
