"""The reward manager: scores responses with the reward functions chosen per data source.

For each response, the correctness function is ``reward.reward_fn_map[data_source]`` (else
``reward.default``), and the final score is::

    score = correctness + sum(weight * shaping_fn(...) for each reward.shaping entry)

Functions are looked up by name in the plugin registry (kind ``reward_function``), called with
verl's contract ``fn(data_source, solution_str, ground_truth, extra_info, **reward.kwargs.<name>)``.

Failures: a call that raises, returns a non-finite value (NaN/inf) or a dict without a finite
``"score"``, or runs longer than ``reward.timeout_s`` seconds, is given ``reward.fallback_score``,
logged once per distinct message (with the sample), and counted in ``reward/failures`` (all of
these) and ``reward/timeouts`` (the timed-out ones) for that call.

Where calls run:

* ``num_workers == 0``: in this process, one call at a time. With a timeout, each call runs in a
  short-lived daemon thread joined with ``timeout_s``; a call that times out is abandoned (Python
  cannot kill a thread: it keeps running in the background until it returns). ``math_verify``
  sees it is off the main thread and turns its ``signal.alarm`` timeouts off (they raise in
  threads). Use worker processes for rewards that can truly hang.
* ``num_workers > 0`` (``-1``: one per core): a process pool (``spawn`` by default), created on
  the first call and reused until :meth:`RewardManager.close`. Each call runs on the worker's
  main thread under a ``SIGALRM`` interval timer of ``timeout_s``; as a backstop, if the batch has
  not finished in time the pool is killed (and rebuilt on the next call) and the unfinished calls
  count as timeouts. Results are identical to serial scoring. Functions must be picklable
  (module-level); others are failures with a message saying so. ``spawn`` re-imports the main
  module in each worker: a script that scores with workers needs the
  ``if __name__ == "__main__":`` guard (the ``rlplug`` command has it).
"""

from __future__ import annotations

import concurrent.futures as cf
import inspect
import logging
import math
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from .config import ConfigError

if TYPE_CHECKING:  # torch is imported lazily so reward worker processes start fast
    import torch

__all__ = ["RewardManager", "RewardConfigError", "components_tensor"]

logger = logging.getLogger("rlplug.reward")

_KIND = "reward_function"


class RewardConfigError(ConfigError):
    """The ``reward`` config cannot score the data: unmapped data source, unknown function name,
    or keyword arguments the function does not accept."""


class _RewardTimeout(BaseException):
    """Raised by the worker's interval timer; a BaseException so ``except Exception`` in a reward
    function does not swallow it."""


# ============================================================================ calling one function
# A result is (status, value): ("ok", return value) | ("error", message) | ("timeout", message).


def _call(fn: Callable, args: tuple, kwargs: dict) -> tuple[str, Any]:
    try:
        return "ok", fn(*args, **kwargs)
    except _RewardTimeout as exc:
        return "timeout", str(exc)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # a broken reward (even one calling sys.exit) must not stop training
        return "error", f"{type(exc).__name__}: {exc}"


def _call_in_thread(fn: Callable, args: tuple, kwargs: dict, timeout_s: float | None) -> tuple[str, Any]:
    """Serial mode: run in a daemon thread, wait at most ``timeout_s`` seconds."""
    if not timeout_s or timeout_s <= 0:
        return _call(fn, args, kwargs)
    box: list = []
    t = threading.Thread(target=lambda: box.append(_call(fn, args, kwargs)), daemon=True, name="rlplug-reward")
    t.start()
    t.join(timeout_s)
    if not box:
        return "timeout", f"timed out after {timeout_s:g} s"
    return box[0]


def _on_alarm(signum, frame):  # pragma: no cover - runs in worker processes
    raise _RewardTimeout("timed out (worker interval timer)")


def _run_chunk(calls: list[tuple[Callable, tuple, dict]], timeout_s: float | None) -> list[tuple[str, Any]]:
    """Worker process: run calls one by one, each under a ``SIGALRM`` interval timer."""
    use_timer = timeout_s is not None and timeout_s > 0 and threading.current_thread() is threading.main_thread()
    out = []
    for fn, args, kwargs in calls:
        if not use_timer:
            out.append(_call(fn, args, kwargs))
            continue
        previous = signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, float(timeout_s or 0.0))
        try:
            status, value = _call(fn, args, kwargs)
        except _RewardTimeout as exc:  # fired between the call and the reset
            status, value = "timeout", str(exc)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        if status == "timeout":
            value = f"timed out after {timeout_s:g} s"
        out.append((status, value))
    return out


# ============================================================================ the manager


def components_tensor(extra: Mapping[str, Sequence[float | None]], n: int) -> tuple[torch.Tensor, tuple[str, ...]]:
    """:meth:`RewardManager.score`'s named per-response values (``extra``, lists of ``n`` floats) as
    one ``(n, K) float32`` tensor and its ``K`` column names, in ``extra``'s order; NaN where a
    value is NaN or ``None`` (the response's reward did not report that name). This is the batch
    field ``reward_components`` (see :mod:`rlplug.batch`)."""
    import torch

    names = tuple(str(k) for k in extra)
    cols = [[math.nan if v is None else float(v) for v in extra[k]] for k in extra]
    if any(len(c) != n for c in cols):
        raise ValueError(f"reward components need {n} values each; got {dict(zip(names, map(len, cols)))}")
    return torch.tensor(cols, dtype=torch.float32).reshape(len(cols), n).T.contiguous(), names


def _section(config: Any) -> dict:
    if config is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(config, DictConfig):
            return OmegaConf.to_container(config, resolve=True)  # type: ignore[return-value]
    except ImportError:  # pragma: no cover
        pass
    if isinstance(config, Mapping):
        return dict(config)
    import dataclasses

    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    return dict(vars(config))


def _finite(x: Any) -> bool:
    """A bool, or an int/float that is finite (values that can be logged as metrics)."""
    if isinstance(x, bool):
        return True
    return isinstance(x, (int, float)) and math.isfinite(x)


class RewardManager:
    """Scores responses with the configured reward functions.

    Args:
        config: the ``reward`` section of the run config (DictConfig, dataclass or dict) with
            ``reward_fn_map``, ``default``, ``kwargs``, ``shaping`` (``[{name, weight}]``),
            ``fallback_score``, ``timeout_s`` (seconds; None or <= 0: no limit), ``num_workers``.
        registry: where names are looked up (default: ``rlplug.get_registry()``).
        start_method: multiprocessing start method of the worker pool (``spawn``, ``forkserver``
            or ``fork``).
        backstop_slack_s: seconds added to the pool's batch deadline (worker start-up, scheduling)
            before unfinished calls count as timeouts and the pool is killed.

    Raises:
        RewardConfigError: a shaping function name is unknown, or bad ``num_workers``.
    """

    def __init__(
        self, config: Any, registry: Any = None, *, start_method: str = "spawn", backstop_slack_s: float = 30.0
    ) -> None:
        cfg = _section(config)
        self.fn_map: dict[str, str] = dict(cfg.get("reward_fn_map") or {})
        self.default: str | None = cfg.get("default")
        self.fn_kwargs: dict[str, dict] = {k: dict(v or {}) for k, v in (cfg.get("kwargs") or {}).items()}
        # (label, function name, weight, kwargs); the label names the metric ``shaping/<label>``
        self.shaping: list[tuple[str, str, float, dict]] = []
        for i, s in enumerate(cfg.get("shaping") or []):
            s = _section(s)
            if not s.get("name"):
                raise RewardConfigError(f"reward.shaping[{i}] needs a 'name' (a reward function); got {s}.")
            name = str(s["name"])
            label = name if all(x[1] != name for x in self.shaping) else f"{name}_{i}"
            kw = s.get("kwargs")
            kwargs = dict(kw) if kw else dict(self.fn_kwargs.get(name, {}))
            self.shaping.append((label, name, float(s.get("weight", 1.0)), kwargs))
        self.fallback_score = float(cfg.get("fallback_score", 0.0))
        timeout = cfg.get("timeout_s", 10.0)
        self.timeout_s: float | None = float(timeout) if timeout is not None and float(timeout) > 0 else None
        workers = int(cfg.get("num_workers", 0) or 0)
        if workers < -1:
            raise RewardConfigError(f"reward.num_workers must be -1 (one per core), 0 (serial) or > 0, got {workers}.")
        self.num_workers = (os.cpu_count() or 1) if workers == -1 else workers
        self.start_method = start_method
        self.backstop_slack_s = float(backstop_slack_s)
        if registry is None:
            import rlplug

            registry = rlplug.get_registry()
        self.registry = registry
        self._fns: dict[str, Callable] = {}
        self._checked: set[str] = set()
        self._pool: cf.ProcessPoolExecutor | None = None
        self._thread: cf.ThreadPoolExecutor | None = None  # score_async's background thread
        self._logged: set[str] = set()
        self.total_failures = 0
        self.total_timeouts = 0
        for i, (_, name, _, kwargs) in enumerate(self.shaping):
            self._resolve(name, f"reward.shaping[{i}]", kwargs)

    # ------------------------------------------------------------------ resolution
    def _resolve(self, name: str, where: str, kwargs: dict | None = None) -> Callable:
        fn = self._fns.get(name)
        if fn is not None and kwargs is None:
            return fn
        try:
            fn = self.registry.get(_KIND, name)
        except Exception as exc:  # UnknownPluginError / PluginLoadError / PluginConflictError
            raise RewardConfigError(f"{where}: {exc}") from exc
        kwargs = self.fn_kwargs.get(name, {}) if kwargs is None else kwargs
        kw_key = f"{where}.kwargs" if where.startswith("reward.shaping") else f"reward.kwargs.{name}"
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            sig = None
        if sig is not None and not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
            params = [
                p for p in sig.parameters if p not in ("data_source", "solution_str", "ground_truth", "extra_info")
            ]
            unknown = sorted(set(kwargs) - set(params))
            if unknown:
                raise RewardConfigError(
                    f"{kw_key} has unknown setting(s) {', '.join(unknown)}; reward function '{name}' "
                    f"accepts: {', '.join(params) or 'none'}."
                )
        validate = getattr(fn, "validate_kwargs", None)
        if callable(validate):
            try:
                validate(kwargs)
            except ValueError as exc:
                raise RewardConfigError(str(exc)) from exc
        self._fns[name] = fn
        return fn

    def fn_name_for(self, data_source: str) -> str | None:
        """The correctness function name for ``data_source`` (map, then default), or None."""
        return self.fn_map.get(data_source, self.default)

    def check_data_sources(self, data_sources: set[str] | Sequence[str]) -> None:
        """Check before training that every data source maps to a registered function.

        Raises:
            RewardConfigError: a data source has no function (lists the sources found, the
                functions available and the override to add), a mapped name is not registered,
                or its ``reward.kwargs`` do not fit its signature.
        """
        sources = sorted(set(data_sources))
        missing = [ds for ds in sources if self.fn_name_for(ds) is None]
        if missing:
            try:
                available = ", ".join(self.registry.names(_KIND)) or "none"
            except Exception:  # pragma: no cover
                available = "?"
            example = missing[0]
            raise RewardConfigError(
                f"No reward function for data source(s) {', '.join(repr(m) for m in missing)}. "
                f"Data sources found: {', '.join(sources)}. Mapped: "
                f"{', '.join(f'{k}->{v}' for k, v in sorted(self.fn_map.items())) or 'none'}; reward.default: {self.default}. "
                f"Reward functions available: {available}. Fix: reward.reward_fn_map.{example}=<name> "
                f"(e.g. reward.reward_fn_map.{example}=gsm8k) or reward.default=<name>."
            )
        for ds in sources:
            if ds in self._checked:
                continue
            name = self.fn_name_for(ds)
            where = f"reward.reward_fn_map.{ds}={name}" if ds in self.fn_map else f"reward.default={name} (for {ds})"
            self._resolve(name, where)  # type: ignore[arg-type]
            self._checked.add(ds)

    # ------------------------------------------------------------------ scoring
    @staticmethod
    def _fields(rows_or_fields: Any, n: int) -> tuple[list[str], list[str], list[dict | None]]:
        if isinstance(rows_or_fields, Mapping):
            f = rows_or_fields
            ds = list(f["data_source"])
            gts = list(f["ground_truth"])
            extras = list(f["extra_info"]) if f.get("extra_info") is not None else [None] * len(ds)
        else:
            ds, gts, extras = [], [], []
            for row in rows_or_fields:
                ds.append(row["data_source"])
                gt = row.get("ground_truth")
                if gt is None and isinstance(row.get("reward_model"), Mapping):
                    gt = row["reward_model"].get("ground_truth")
                gts.append(gt)
                extras.append(row.get("extra_info"))
        if not (len(ds) == len(gts) == len(extras) == n):
            raise ValueError(
                f"score() needs one row per response: got {len(ds)} data_source, {len(gts)} ground_truth, "
                f"{len(extras)} extra_info for {n} responses (repeat each prompt's row rollout.n times)."
            )
        return ds, gts, extras

    def score(
        self, rows_or_fields: Any, responses: Sequence[str]
    ) -> tuple[list[float], dict[str, list[float]], dict[str, float]]:
        """Score ``responses`` (decoded text, special tokens removed) against their rows.

        Args:
            rows_or_fields: a list of rows (dicts with ``data_source``, ``ground_truth`` or
                ``reward_model.ground_truth``, optional ``extra_info``), one per response, or a
                dict of equal-length lists with those keys.
            responses: ``B`` strings.

        Returns:
            ``(scores, extra, metrics)``: ``scores`` ``B`` floats (correctness + weighted shaping);
            ``extra`` per-sample lists of ``B`` floats: ``acc`` (the function's ``acc``, else its
            score; 0.0 on failure), ``correctness`` (correctness score), ``shaping/<name>``
            (unweighted), and every other numeric key of returned dicts (NaN where a sample's
            function did not return it or failed); ``metrics``: ``reward/failures`` and
            ``reward/timeouts`` (counts for this call, as floats).

        Raises:
            RewardConfigError: a data source without a reward function.
            ValueError: rows and responses differ in number.
        """
        responses = list(responses)
        n = len(responses)
        ds, gts, extras = self._fields(rows_or_fields, n)
        self.check_data_sources(set(ds))
        for i, r in enumerate(responses):
            if not isinstance(r, str):
                raise TypeError(f"responses[{i}] is {type(r).__name__}; expected decoded text (str).")

        # every data source has a function (check_data_sources above raised otherwise)
        slots = [cast(str, self.fn_name_for(d)) for d in ds]
        calls: list[tuple[str, int, str]] = []  # (function name, sample, slot: "main" or "shape")
        payload: list[tuple[Callable, tuple, dict]] = []
        for i in range(n):
            info = extras[i]
            extra = dict(info) if isinstance(info, Mapping) else info
            calls.append((slots[i], i, "main"))  # type: ignore[arg-type]
            payload.append(
                (self._fns[slots[i]], (ds[i], responses[i], gts[i], extra), self.fn_kwargs.get(slots[i], {}))
            )
            for label, name, _, kwargs in self.shaping:
                calls.append((name, i, label))
                payload.append(
                    (
                        self._fns[name],
                        (ds[i], responses[i], gts[i], dict(extra) if isinstance(extra, dict) else extra),
                        kwargs,
                    )
                )
        results = self._run(payload)

        correctness = [self.fallback_score] * n
        acc = [0.0] * n
        shaping_vals = {label: [0.0] * n for label, _, _, _ in self.shaping}
        other: dict[str, list[float]] = {}
        failures = timeouts = 0
        for (name, i, slot), (status, value) in zip(calls, results):
            val, extra_vals, error = self._interpret(status, value)
            if error is not None:
                failures += 1
                timeouts += status == "timeout"
                self._log_failure(name, error, ds[i], responses[i], gts[i])
                val = self.fallback_score
            if slot == "main":
                correctness[i] = val
                if error is None:
                    acc[i] = float(extra_vals.pop("acc", val))
                    for k, v in extra_vals.items():
                        other.setdefault(k, [math.nan] * n)[i] = v
            else:
                shaping_vals[slot][i] = val
        scores = [correctness[i] + sum(w * shaping_vals[label][i] for label, _, w, _ in self.shaping) for i in range(n)]
        extra_out: dict[str, list[float]] = {"acc": acc, "correctness": correctness}
        for label, _, _, _ in self.shaping:
            extra_out[f"shaping/{label}"] = shaping_vals[label]
        for k, values in other.items():
            extra_out.setdefault(k, values)
        self.total_failures += failures
        self.total_timeouts += timeouts
        return scores, extra_out, {"reward/failures": float(failures), "reward/timeouts": float(timeouts)}

    def score_async(
        self, rows_or_fields: Any, responses: Sequence[str] | Callable[[], Sequence[str]], *, overlap: bool = True
    ) -> cf.Future[tuple[tuple[list[float], dict[str, list[float]], dict[str, float]], float]]:
        """Start :meth:`score` on a background thread and return its future, so scoring overlaps
        other work (the trainer's log-prob and value passes).

        ``responses`` are the decoded texts, or a function returning them (called on the thread
        too, e.g. to decode token ids there). The future's result is ``(score's result, seconds)``,
        the seconds counted from this call to the end of scoring; ``future.result()`` raises what
        scoring raised. Reward functions are plain Python or run in ``reward.num_workers``
        processes, and torch releases the GIL inside its kernels, so both proceed together. One
        thread serves the manager: calls run one after another. With ``overlap=False`` the scoring
        runs here, before returning (an error raises here), and the future is already done.
        :meth:`close` waits for a running call.
        """
        t0 = time.perf_counter()

        def work() -> tuple[tuple[list[float], dict[str, list[float]], dict[str, float]], float]:
            texts = responses() if callable(responses) else responses
            return self.score(rows_or_fields, texts), time.perf_counter() - t0

        if not overlap:
            done: cf.Future = cf.Future()
            done.set_result(work())
            return done
        if self._thread is None:
            self._thread = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlplug-score")
        return self._thread.submit(work)

    @staticmethod
    def _interpret(status: str, value: Any) -> tuple[float, dict[str, float], str | None]:
        if status != "ok":
            return 0.0, {}, value
        extra: dict[str, float] = {}
        if isinstance(value, Mapping):
            if "score" not in value:
                return 0.0, {}, f"returned a dict without 'score' (keys: {sorted(value)})"
            for k, v in value.items():
                if k != "score" and _finite(v):
                    extra[str(k)] = float(v)
            value = value["score"]
        try:
            score = float(value)
        except (TypeError, ValueError):
            return 0.0, {}, f"returned {type(value).__name__} {value!r:.60}; expected a float or a dict with 'score'"
        if not math.isfinite(score):
            return 0.0, {}, f"returned a non-finite score ({score})"
        return score, extra, None

    def _log_failure(self, name: str, error: str, data_source: str, response: str, ground_truth: Any) -> None:
        key = f"{name}: {error}"
        if key in self._logged:
            return
        self._logged.add(key)
        logger.warning(
            "reward function '%s' failed on data_source=%s: %s; using fallback_score=%g "
            "(logged once per distinct message). Sample: response=%r ground_truth=%r",
            name,
            data_source,
            error,
            self.fallback_score,
            response[:300],
            str(ground_truth)[:200],
        )

    # ------------------------------------------------------------------ execution
    def _run(self, payload: list[tuple[Callable, tuple, dict]]) -> list[tuple[str, Any]]:
        if not payload:
            return []
        if self.num_workers <= 0:
            return [_call_in_thread(fn, args, kwargs, self.timeout_s) for fn, args, kwargs in payload]
        return self._run_pool(payload)

    def _get_pool(self) -> cf.ProcessPoolExecutor:
        if self._pool is None:
            self._pool = cf.ProcessPoolExecutor(
                max_workers=self.num_workers, mp_context=mp.get_context(self.start_method)
            )
        return self._pool

    def _run_pool(self, payload: list[tuple[Callable, tuple, dict]]) -> list[tuple[str, Any]]:
        pool = self._get_pool()
        n = len(payload)
        chunk = max(1, -(-n // (self.num_workers * 4)))
        bounds = [(lo, min(n, lo + chunk)) for lo in range(0, n, chunk)]
        futures = [pool.submit(_run_chunk, payload[lo:hi], self.timeout_s) for lo, hi in bounds]
        deadline = None
        if self.timeout_s:
            rounds = -(-len(bounds) // self.num_workers)
            # each call is bounded by the worker timer; generous slack for start-up and scheduling
            deadline = time.monotonic() + self.timeout_s * chunk * rounds + self.backstop_slack_s
        results: list[tuple[str, Any]] = [("timeout", "")] * n
        broken = False
        for (lo, hi), fut in zip(bounds, futures):
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                results[lo:hi] = fut.result(timeout=remaining)
            except cf.TimeoutError:
                broken = True
                results[lo:hi] = [("timeout", f"timed out after {self.timeout_s:g} s (worker killed)")] * (hi - lo)
            except cf.process.BrokenProcessPool as exc:
                broken = True
                results[lo:hi] = [("error", f"reward worker process died: {exc}")] * (hi - lo)
            except Exception as exc:  # e.g. the function could not be pickled
                msg = f"{type(exc).__name__}: {exc}"
                if "pickle" in msg.lower() or "Can't get" in msg:
                    msg += (
                        " (reward functions run in worker processes must be module-level; or set reward.num_workers=0)"
                    )
                results[lo:hi] = [("error", msg)] * (hi - lo)
        if broken:
            self._kill_pool()
        return results

    def _kill_pool(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        for p in list(getattr(pool, "_processes", {}).values()):
            try:
                p.kill()
            except Exception:  # pragma: no cover
                pass
        pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Wait for a running :meth:`score_async` call (bounded by ``timeout_s`` per call), then shut the
        worker pool down (idempotent). The manager can still score afterwards (a new pool starts)."""
        thread, self._thread = self._thread, None
        if thread is not None:  # before the pool below: the running call may be using it
            thread.shutdown(wait=True, cancel_futures=True)
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
