"""The reward manager: scores responses with the reward functions chosen per data source.

For each response, the correctness function is chosen by its row's ``data_source``; the first
of these that applies wins:

1. ``reward.custom_reward_function.path`` set: the function ``reward.custom_reward_function.name``
   (default ``compute_score``) of that Python file scores every data source (verl's semantics),
   called with ``**reward.custom_reward_function.reward_kwargs``. The file is imported by path
   (:class:`FileRewardFunction`), so its top-level code runs with the trainer's permissions;
2. ``reward.reward_fn_map[data_source]``: a registered function name;
3. ``reward.default``: a registered function name, for sources missing from the map.

A source none of them covers is a :class:`RewardConfigError` before training starts. When the run
starts, :meth:`RewardManager.check_data_sources` logs one line per data source naming its
function and the rule that chose it, and warns once when ``reward.default`` is set but no source
reaches it (or when ``reward.kwargs.<name>`` names a function nothing uses). The final score is::

    score = reward.correctness_weight * correctness + sum(weight * shaping_fn(...) for each reward.shaping entry)

A reward model (a learned scorer, registered as a reward function) enters only as a
``reward.shaping`` entry; correctness always comes from the rules above. ``reward.reward_model``
(verl's keys) adds the ``reward_model`` entry and sets the correctness weight
(:func:`rlplug.rewards.reward_model.shaping_entries`, ``docs/reward_models.md``). A shaping function with a
``score_batch`` method is called once per batch (:meth:`RewardManager._run_batched`, with the main slot's
timeout of ``reward.timeout_s`` per response unless it is model-based); one with
``model_based = True`` is left out of validation unless ``reward.val_reward_model=true``. Registered functions are
looked up by name in the plugin registry (kind ``reward_function``) and called with verl's
contract ``fn(data_source, solution_str, ground_truth, extra_info, **reward.kwargs.<name>)``.

A TRL-contract function (:mod:`rlplug.contracts.reward_contract`) may return ``None`` (or NaN) for a response: it does
not apply there and adds nothing to the score (TRL's ``nansum``); a response every function skips is
unscorable and treated as a failed one below (``reward/unscorable``; :meth:`RewardManager.score`).

Failures: a call that raises, returns a non-finite value (NaN/inf), ``None`` or a dict without a
finite ``"score"``, or runs longer than ``reward.timeout_s`` seconds, is a failure: logged once
per distinct message (with the sample), counted in ``reward/failures`` (all of these) and
``reward/timeouts`` (the timed-out ones) for that call, and its response is marked in
``extra["reward_failed"]``. Validation and ``rlplug eval`` score a failed response
``reward.fallback_score`` (it counts as wrong). Training leaves it out altogether: it is not part
of any group baseline, whitening or batch statistic, its advantage is 0 and it adds nothing to
the losses; a step in which every response failed skips the update and counts toward
``trainer.max_consecutive_bad_steps`` (:class:`RewardFailureGuard`), which ends the run with
exit code 4 and the first error.

Where calls run:

* ``num_workers == 0``: in this process, one call at a time. With a timeout, each call runs in a
  short-lived daemon thread joined with ``timeout_s``; a call that times out is abandoned (Python
  cannot kill a thread: it keeps running in the background until it returns). ``math_verify``
  sees it is off the main thread and turns its ``signal.alarm`` timeouts off (they raise in
  threads). Use worker processes for rewards that can truly hang.
* ``num_workers > 0`` (``-1``: one per core): worker processes (:class:`RewardWorkerPool`,
  ``spawn`` by default), started on the first call and reused until :meth:`RewardManager.close`.
  Each worker runs one call at a time, so the pool always knows which sample a worker is
  scoring: every call runs exactly once, and a fault fails its own sample only. A call runs on
  the worker's main thread under a ``SIGALRM`` interval timer of ``timeout_s`` (a timeout; the
  worker stays); a call that ignores the timer (C code, blocked signals) is killed
  ``backstop_slack_s`` seconds later (a timeout), and a worker that dies mid-call (SIGKILL from
  the OOM killer, a segfault) fails that sample with a message naming the signal. Either way a
  new worker replaces the old one, counted in ``reward/worker_restarts``, and the other samples
  go on. Results are identical to serial scoring. Functions must be picklable
  (module-level); others are failures with a message saying so. ``spawn`` re-imports the main
  module in each worker: a script that scores with workers needs the
  ``if __name__ == "__main__":`` guard (the ``rlplug`` command has it).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import hashlib
import importlib.util
import inspect
import logging
import math
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from omegaconf import DictConfig, OmegaConf

from rlplug.base.exit_codes import RewardFailuresStopped
from rlplug.config.schema import ConfigError, RewardConfig, map_entry_override, typed
from rlplug.contracts.registry import get_registry
from rlplug.contracts.reward_contract import BatchedRewardFunction, MetricLog, RewardContractError, as_reward_function
from rlplug.rewards.reward_model import shaping_entries

if TYPE_CHECKING:  # torch is imported lazily so reward worker processes start fast
    import torch

__all__ = [
    "FileRewardFunction",
    "FileTrlRewardFunction",
    "load_custom_reward_function",
    "RewardManager",
    "RewardConfigError",
    "RewardFailureGuard",
    "RewardWorkerPool",
    "components_tensor",
    "overlong_config",
    "overlong_penalty",
    "scored_rows",
    "run_batched",
    "trl_call_kwargs",
    "validation_reward",
    "FAILED",
]

logger = logging.getLogger("rlplug.rewards.manager")

_KIND = "reward_function"

#: The key of :meth:`RewardManager.score`'s ``extra`` (and the ``reward_components`` column) that is
#: 1.0 for a response whose reward failed (raised, timed out, or returned NaN/inf/None/no score).
FAILED = "reward_failed"
#: The key of :meth:`RewardManager.score`'s ``extra`` with ``report_acc=True``: 1.0 for a response whose
#: correctness function reported an accuracy (an ``acc`` key, or ``fn.binary = True``), else 0.0.
ACC_REPORTED = "acc_reported"
#: The key of :meth:`RewardManager.score`'s ``extra`` with ``report_acc=True`` holding each response's extracted
#: answer: the ``pred`` string of the correctness function's dict (verl's key), else None (validation's ``maj@N``).
PRED = "pred"


class RewardConfigError(ConfigError):
    """The ``reward`` config cannot score the data: unmapped data source, unknown function name,
    or keyword arguments the function does not accept."""


# ============================================================================ a function from a file
_CRF = "reward.custom_reward_function"
#: modules imported from reward.custom_reward_function.path in this process, by absolute path
_FILE_MODULES: dict[str, Any] = {}


def _import_file(path: str) -> Any:
    """Import the Python file ``path`` (absolute) as a module, once per process."""
    module = _FILE_MODULES.get(path)
    if module is not None:
        return module
    p = Path(path)
    if p.is_dir():
        raise RewardConfigError(
            f"{_CRF}.path={path} is a directory; point it at the Python file (.py) in it that defines the reward "
            f"function (e.g. {_CRF}.path={p / 'my_reward.py'})."
        )
    if not p.is_file():
        raise RewardConfigError(
            f"{_CRF}.path={path}: no such file. Point it at the Python file (.py) that defines the reward "
            f"function, or unset {_CRF}.path to choose functions with reward.reward_fn_map / reward.default."
        )
    if p.suffix != ".py":
        raise RewardConfigError(
            f"{_CRF}.path={path}: expected a Python source file ending in .py; point {_CRF}.path at the .py "
            "file that defines the reward function."
        )
    # a stable module name per file, registered in sys.modules so dataclasses and pickling inside it work
    name = f"rlplug_custom_reward_{hashlib.sha256(path.encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(name, p)
    if spec is None or spec.loader is None:  # pragma: no cover - .py files always get a loader
        raise RewardConfigError(f"{_CRF}.path={path}: Python cannot import this file.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        sys.modules.pop(name, None)
        raise RewardConfigError(
            f"{_CRF}.path={path}: importing the file failed with {type(exc).__name__}: {exc}. Fix the file "
            f"(`python {path}` shows the full traceback), or unset {_CRF}.path."
        ) from exc
    _FILE_MODULES[path] = module
    return module


class FileRewardFunction:
    """The reward function ``name`` defined in the Python file ``path`` (``reward.custom_reward_function``).

    Calling the object calls the function (verl's contract ``fn(data_source, solution_str,
    ground_truth, extra_info=None, **kwargs) -> float | dict``). The file is imported by its path
    (``~`` expanded), once per process, under a module name derived from the path; importing runs
    its top-level code with the trainer's permissions. The object pickles as ``(path, name)``, so
    it can go to reward worker processes (``reward.num_workers > 0``): each worker imports the file
    itself on first use.

    Raises:
        RewardConfigError: the file does not exist, is not a ``.py`` file or fails to import, or it
            has no callable ``name`` (the message lists the functions it defines).
    """

    def __init__(self, path: str | os.PathLike, name: str = "compute_score") -> None:
        self.path = str(Path(path).expanduser().resolve())
        self.name = str(name)
        module = _import_file(self.path)
        fn = getattr(module, self.name, None)
        if fn is None or not callable(fn):
            defined = sorted(
                k for k, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module.__name__
            )
            what = "no function" if fn is None else f"a {type(fn).__name__}, not a function, named"
            raise RewardConfigError(
                f"{_CRF}.path={self.path} has {what} '{self.name}' ({_CRF}.name); functions defined there: "
                f"{', '.join(defined) or 'none'}. Set {_CRF}.name=<one of them> (the default is compute_score)."
            )
        self.fn: Callable = fn

    @property
    def label(self) -> str:
        """How logs and errors name this function: ``custom_reward_function(<file>:<name>)``."""
        return f"custom_reward_function({Path(self.path).name}:{self.name})"

    @property
    def binary(self) -> bool:
        """The file's function's own ``binary`` declaration (:class:`rlplug.contracts.types.RewardFunction`)."""
        return bool(getattr(self.fn, "binary", False))

    @property
    def prepare(self) -> Callable[[dict], None] | None:
        """The file function's own ``prepare(kwargs)`` (:meth:`RewardManager.prepare`), or None."""
        prep = getattr(self.fn, "prepare", None)
        return prep if callable(prep) else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (FileRewardFunction, (self.path, self.name))

    def __repr__(self) -> str:
        return f"FileRewardFunction(path={self.path!r}, name={self.name!r})"


class FileTrlRewardFunction(BatchedRewardFunction):
    """A reward function with TRL's batched contract from ``reward.custom_reward_function`` (the file's
    function ``name`` at ``path``, as :class:`FileRewardFunction` loads it; :mod:`rlplug.contracts.reward_contract`).
    ``label`` and ``path`` as :class:`FileRewardFunction`'s; pickles as ``(path, name)``."""

    def __init__(self, path: str | os.PathLike, name: str = "compute_score") -> None:
        loaded = FileRewardFunction(path, name)
        fn = loaded.fn.fn if isinstance(loaded.fn, BatchedRewardFunction) else loaded.fn
        super().__init__(fn, loaded.name)
        self.path = loaded.path

    @property
    def label(self) -> str:
        """How logs and errors name this function: ``custom_reward_function(<file>:<name>)``."""
        return f"custom_reward_function({Path(self.path).name}:{self.name})"

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:  # type: ignore[override]
        return (FileTrlRewardFunction, (self.path, self.name))

    def __repr__(self) -> str:
        return f"FileTrlRewardFunction(path={self.path!r}, name={self.name!r}, contract='trl')"


def load_custom_reward_function(section: Any) -> FileRewardFunction | FileTrlRewardFunction | None:
    """The function ``reward.custom_reward_function`` selects (``section``: that config node, a
    mapping or dataclass with ``path``, ``name``, ``reward_kwargs``), checked so a run fails before
    any model loads; None when ``path`` is not set.

    The function follows verl's contract, or TRL's (:mod:`rlplug.contracts.reward_contract`): decorated with
    ``@rlplug.trl_reward``, marked ``reward_contract = "trl"``, or with TRL's parameter names
    (``fn(completions, **kwargs)``, ``fn(prompts, completions, answer, **kwargs)``: told apart as
    :func:`rlplug.contracts.reward_contract.as_reward_function` does; a signature that fits neither, such as
    ``fn(*args, **kwargs)``, is taken as verl's, as before). A TRL-contract function is returned as a
    :class:`FileTrlRewardFunction`; ``reward_kwargs`` are then passed as plain keywords. Otherwise
    ``fn(data_source, solution_str, ground_truth, extra_info, **reward_kwargs)`` must bind to the
    function's signature.

    Raises:
        RewardConfigError: a missing or broken file, a missing or non-callable function, a function
            marked as TRL's that cannot be called so, or ``reward_kwargs`` (or the four positional
            arguments) the function does not accept.
    """
    crf = _section(section)
    if not crf.get("path"):
        return None
    fn = FileRewardFunction(str(crf["path"]), str(crf.get("name") or "compute_score"))
    kwargs = dict(crf.get("reward_kwargs") or {})
    try:
        as_trl = isinstance(as_reward_function(fn.fn), BatchedRewardFunction)
    except RewardContractError as exc:
        if isinstance(fn.fn, BatchedRewardFunction) or getattr(fn.fn, "reward_contract", None) == "trl":
            raise RewardConfigError(f"{_CRF}: {exc}") from exc
        as_trl = False  # fits neither by its names: verl's, checked below as before
    if as_trl:
        trl = FileTrlRewardFunction(fn.path, fn.name)
        sig = _signature_of(trl.fn)
        if sig is not None and not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
            unknown = sorted(set(kwargs) - set(sig.parameters))
            if unknown:
                raise RewardConfigError(
                    f"{_CRF}.reward_kwargs sets {', '.join(unknown)}, which {trl.name}{sig} in {trl.path} (TRL's "
                    "contract: reward_kwargs are passed as keywords) does not accept; add the parameter(s) or "
                    "**kwargs, or fix the setting."
                )
        return trl
    sig = _signature_of(fn.fn)
    if sig is None:  # pragma: no cover - builtins without a signature
        return fn
    try:
        sig.bind("data_source", "solution_str", "ground_truth", None, **kwargs)
    except TypeError as exc:
        raise RewardConfigError(
            f"{_CRF}: {fn.name}{sig} in {fn.path} cannot be called as "
            f"{fn.name}(data_source, solution_str, ground_truth, extra_info"
            + (f", {', '.join(f'{k}=...' for k in kwargs)}" if kwargs else "")
            + f") ({exc}). Give the function verl's signature (data_source, solution_str, ground_truth, "
            f"extra_info=None, **kwargs), or fix {_CRF}.reward_kwargs."
        ) from exc
    return fn


class _RewardTimeout(BaseException):
    """Raised by the worker's interval timer; a BaseException so ``except Exception`` in a reward
    function does not swallow it."""


# ============================================================================ calling one function
# A result is (status, value): ("ok", return value) | ("error", message) | ("timeout", message).


def _signature_of(fn: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature
        return None


def _call(fn: Callable, args: tuple, kwargs: dict) -> tuple[str, Any]:
    try:
        return "ok", fn(*args, **kwargs)
    except _RewardTimeout as exc:
        return "timeout", str(exc)
    except TimeoutError as exc:  # the function's own timeout (a judge server that did not answer): a timeout
        return "timeout", f"{type(exc).__name__}: {exc}"
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # a broken reward (even one calling sys.exit) must not stop training
        return "error", f"{type(exc).__name__}: {exc}"


def _item_result(result: tuple[str, Any]) -> tuple[str, Any]:
    """A batched function's per-sample exception (``score_batch`` returned it in that sample's place,
    e.g. the ``judge``'s) as that sample's failure: ``timeout`` for a ``TimeoutError``, else ``error``."""
    status, value = result
    if status == "ok" and isinstance(value, BaseException):
        return ("timeout" if isinstance(value, TimeoutError) else "error"), f"{type(value).__name__}: {value}"
    return result


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


def run_batched(
    calls: Sequence[tuple[str, int, str]],
    payload: Sequence[tuple[Callable, tuple, dict]],
    rows_or_fields: Any,
    run: Callable[[list[tuple[Callable, tuple, dict]]], list[tuple[str, Any]]],
    timeout_s: float | None,
    trl_kwargs: Mapping[str, Any] | None = None,
) -> list[tuple[str, Any]]:
    """The results ``(status, value)`` of the reward manager's ``payload`` (one ``(fn, (data_source,
    response, ground_truth, extra_info), kwargs)`` per entry of ``calls``: ``(name, sample, slot)``):
    per-sample functions through ``run`` (the manager's serial or pool execution), each batched function
    (:class:`BatchedRewardFunction`, with the same kwargs) once for all its samples, in a thread
    joined after ``timeout_s`` seconds per sample. ``trl_kwargs`` go to TRL-contract functions only
    (``contract == "trl"``): ``completion_ids`` (one list per sample of the whole call, indexed by the
    sample), ``trainer_state`` and ``log_metric``. Raises :class:`RewardContractError` (see the module docstring)."""
    batched = [j for j, (fn, _, _) in enumerate(payload) if isinstance(fn, BatchedRewardFunction)]
    if not batched:
        return run(list(payload))
    results: list[tuple[str, Any]] = [("error", "not run")] * len(payload)
    plain = [j for j in range(len(payload)) if not isinstance(payload[j][0], BatchedRewardFunction)]
    for j, res in zip(plain, run([payload[j] for j in plain])):
        results[j] = res
    rows = _rows(rows_or_fields)
    groups: dict[tuple[int, str], list[int]] = {}
    for j in batched:
        fn, _, kwargs = payload[j]
        groups.setdefault((id(fn), repr(sorted(kwargs.items()))), []).append(j)
    for js in groups.values():
        fn, _, kwargs = payload[js[0]]
        ds, texts, gts, extras = (list(x) for x in zip(*(payload[j][1] for j in js)))
        messages = [rows[calls[j][1]].get("messages") for j in js]
        timeout = timeout_s * len(js) if timeout_s else None
        args = (ds, texts, gts, extras)
        extra_kw = trl_call_kwargs(fn, trl_kwargs, [calls[j][1] for j in js])
        score_batch = fn.score_batch  # type: ignore[attr-defined]  # a BatchedRewardFunction (checked above)
        status, value = _call_in_thread(score_batch, args, {"messages": messages, **kwargs, **extra_kw}, timeout)
        if status == "error" and value.startswith(f"{RewardContractError.__name__}:"):
            raise RewardContractError(value.split(": ", 1)[1])
        for k, j in enumerate(js):
            results[j] = (status, value) if status != "ok" else ("ok", value[k])
    return results


def trl_call_kwargs(fn: Any, trl_kwargs: Mapping[str, Any] | None, samples: Sequence[int]) -> dict[str, Any]:
    """The keywords of ``fn.score_batch`` for a TRL-contract ``fn`` (``contract == "trl"``) from ``trl_kwargs``
    (``completion_ids`` of every sample, ``trainer_state``, ``log_metric``; None values left out), the
    ``completion_ids`` of ``samples`` only; ``{}`` for other functions."""
    if getattr(fn, "contract", None) != "trl" or not trl_kwargs:
        return {}
    out = {k: v for k, v in trl_kwargs.items() if v is not None}
    if out.get("completion_ids") is not None:
        ids = out["completion_ids"]
        out["completion_ids"] = [ids[i] for i in samples]
    return out


def _rows(rows_or_fields: Any) -> list[dict]:
    """One dict per sample: the rows themselves, or a dict of lists turned into rows."""
    if isinstance(rows_or_fields, Mapping):
        keys = list(rows_or_fields)
        n = len(rows_or_fields[keys[0]]) if keys else 0
        return [{k: rows_or_fields[k][i] for k in keys if rows_or_fields[k] is not None} for i in range(n)]
    return [dict(r) for r in rows_or_fields]


_ALARM_MESSAGE = "timed out (worker interval timer)"


def _on_alarm(signum, frame):  # pragma: no cover - runs in worker processes
    raise _RewardTimeout(_ALARM_MESSAGE)


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
        if status == "timeout" and value == _ALARM_MESSAGE:
            value = f"timed out after {timeout_s:g} s"
        out.append((status, value))
    return out


# ============================================================================ the worker pool


def _worker_main(conn: Any, parent_pid: int) -> None:  # pragma: no cover - runs in worker processes
    """A reward worker: answer ``(index, pickled call, timeout_s)`` requests one at a time with
    ``(index, (status, value))`` until the pipe closes; exit when the parent process is gone."""

    def watch() -> None:  # a call that hangs in C code must not outlive the trainer
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="rlplug-reward-parent-watchdog", daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    while True:
        try:
            index, blob, timeout_s = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            return
        try:
            fn, args, kwargs = pickle.loads(blob)
        except BaseException as exc:
            result: tuple[str, Any] = ("error", _pickle_advice(f"{type(exc).__name__}: {exc}"))
        else:
            try:
                conn.send((index, _STARTED))  # the parent's backstop deadline starts now, not at start-up
            except (EOFError, OSError):
                return
            result = _run_chunk([(fn, args, kwargs)], timeout_s)[0]
        try:
            conn.send((index, result))
        except (EOFError, OSError):
            return
        except BaseException as exc:  # the value cannot be pickled back
            conn.send((index, ("error", f"returned a value that cannot be sent back ({type(exc).__name__}: {exc})")))


#: a worker's message that it has unpickled a call (its module imported) and starts running it
_STARTED = "started"
#: seconds a call may take to reach a worker and be unpickled (worker start-up, module imports)
_STARTUP_S = 600.0


def _pickle_advice(msg: str) -> str:
    return msg + " (reward functions run in worker processes must be module-level; or set reward.num_workers=0)"


def _death_message(exitcode: int | None, pid: int | None, started: bool = True) -> str:
    when = "while scoring this sample" if started else "before it started scoring this sample"
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        why = " (the OOM killer sends SIGKILL)" if -exitcode == signal.SIGKILL else ""
        return f"the reward worker process (pid {pid}) was killed by {name}{why} {when}"
    return f"the reward worker process (pid {pid}) exited with code {exitcode} {when}"


class _Worker:
    """One worker process and its end of the pipe; ``task`` is ``(call index, deadline)`` while busy."""

    def __init__(self, ctx: Any) -> None:
        parent_end, child_end = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(
            target=_worker_main, args=(child_end, os.getpid()), daemon=True, name="rlplug-reward-worker"
        )
        self.proc.start()
        child_end.close()
        self.conn = parent_end
        self.task: tuple[int, float | None] | None = None

    def kill(self) -> None:
        with _quiet():
            self.proc.kill()
        with _quiet():
            self.proc.join(5.0)
        with _quiet():
            self.conn.close()

    def stop(self, grace_s: float = 5.0) -> None:
        with _quiet():
            self.conn.close()  # the worker's recv() ends: it returns
        self.proc.join(grace_s)
        if self.proc.is_alive():
            self.kill()


def _quiet() -> Any:
    return contextlib.suppress(Exception)


class RewardWorkerPool:
    """``size`` reward worker processes that run one call at a time each (``reward.num_workers``).

    The pool knows which call each worker is running, so a failure is pinned on its own sample: a
    call runs at most once (one a worker reported starting is never sent again) and is never dropped.

    * A call longer than ``timeout_s`` seconds is stopped by the worker's ``SIGALRM`` interval timer
      (``("timeout", ...)``; the worker stays). One that ignores the timer (blocked signals, C code)
      is killed by the pool ``backstop_slack_s`` seconds later, counts as a timeout, and a new
      worker replaces the killed one.
    * A worker that dies while running a call (SIGKILL from the OOM killer, a segfault, ``os._exit``)
      fails that call only (``("error", "...killed by SIGKILL...")``); a new worker replaces it and
      the other calls go on.
    * A worker that dies before it reports starting a call (killed while idle, its pipe not yet
      closed when the call was sent; or a crash while unpickling the call) has not run it: the call
      goes to the replacement worker, once; dying again before starting fails it as above.

    ``restarts`` counts the workers replaced so far. Workers start on first use (``start_method``:
    ``spawn``, ``forkserver`` or ``fork``), exit when their pipe closes (:meth:`close`) or within a
    second of the parent process dying.
    """

    def __init__(self, size: int, start_method: str = "spawn") -> None:
        if size < 1:
            raise ValueError(f"a reward worker pool needs at least one worker, got size={size}")
        self.size = int(size)
        self._ctx = mp.get_context(start_method)
        self._workers: list[_Worker] = []
        self.restarts = 0

    @property
    def pids(self) -> list[int]:
        """Process ids of the live workers."""
        return [w.proc.pid for w in self._workers if w.proc.pid is not None and w.proc.is_alive()]

    def run(
        self, payload: Sequence[tuple[Callable, tuple, dict]], timeout_s: float | None, backstop_slack_s: float
    ) -> list[tuple[str, Any]]:
        """Run every ``(fn, args, kwargs)`` of ``payload`` once; one ``(status, value)`` per call, in order
        (``status`` ``"ok"``, ``"error"`` or ``"timeout"``, as :func:`_call` returns)."""
        results: list[tuple[str, Any] | None] = [None] * len(payload)
        queue = list(range(len(payload)))[::-1]  # popped from the end: in order
        while len(self._workers) < min(self.size, len(payload)):
            self._workers.append(_Worker(self._ctx))
        backstop = None if timeout_s is None else timeout_s + backstop_slack_s
        started: set[int] = set()  # calls a worker reported starting (never sent again)
        resent: set[int] = set()  # calls sent again after their worker died before starting them
        while queue or any(w.task is not None for w in self._workers):
            for w in list(self._workers):  # hand out work
                while w.task is None and queue:
                    i = queue.pop()
                    try:
                        blob = pickle.dumps(payload[i])
                    except Exception as exc:
                        results[i] = ("error", _pickle_advice(f"{type(exc).__name__}: {exc}"))
                        continue
                    try:
                        w.conn.send((i, blob, timeout_s))
                    except (OSError, EOFError):  # died while idle: the call waits for its replacement
                        queue.append(i)
                        self._replace(w, "it had died while idle")
                        break
                    w.task = (i, None if backstop is None else time.monotonic() + _STARTUP_S + backstop)
            busy = [w for w in self._workers if w.task is not None]
            if not busy:
                continue
            deadlines = [w.task[1] for w in busy if w.task is not None and w.task[1] is not None]
            wait_s = None if not deadlines else max(0.0, min(deadlines) - time.monotonic())
            multiprocessing.connection.wait([w.conn for w in busy] + [w.proc.sentinel for w in busy], timeout=wait_s)
            now = time.monotonic()
            for w in busy:
                assert w.task is not None
                i, deadline = w.task
                done = False
                # Alive or not is read before the pipe is drained: a worker seen dead has already written
                # everything it will (its _STARTED report included), so a call it started is never resent.
                alive = w.proc.is_alive()
                while not done and _poll(w.conn):
                    try:
                        index, result = w.conn.recv()
                    except (EOFError, OSError):
                        break  # died mid-answer: handled as a death below
                    if result == _STARTED:  # the call runs from now on: timeout_s + backstop_slack_s
                        deadline = None if backstop is None else time.monotonic() + backstop
                        w.task = (i, deadline)
                        started.add(i)
                    else:
                        results[index], w.task, done = result, None, True
                if done:
                    continue
                if not alive:
                    w.proc.join(1.0)
                    msg = _death_message(w.proc.exitcode, w.proc.pid, started=i in started)
                    if i not in started and i not in resent:  # it never ran: the replacement runs it
                        resent.add(i)
                        queue.append(i)
                        self._replace(w, f"{msg}; sending it again")
                        continue
                    results[i] = ("error", msg)
                    self._replace(w, f"{msg}; scoring it with reward.fallback_score")
                elif deadline is not None and now >= deadline:
                    results[i] = ("timeout", f"timed out after {timeout_s:g} s (worker killed)")
                    self._replace(w, f"a reward call ran {timeout_s:g} + {backstop_slack_s:g} s, ignoring its timer")
        return [r if r is not None else ("error", "not run") for r in results]

    def _replace(self, worker: _Worker, why: str | None) -> None:
        worker.kill()
        self._workers.remove(worker)
        self._workers.append(_Worker(self._ctx))
        self.restarts += 1
        logger.warning(
            "reward worker (pid %s) replaced by a new one (pid %s)%s; %d worker restart(s) so far",
            worker.proc.pid,
            self._workers[-1].proc.pid,
            f": {why}" if why else "",
            self.restarts,
        )

    def kill(self) -> None:
        """Kill every worker now (the next :meth:`run` starts new ones)."""
        workers, self._workers = self._workers, []
        for w in workers:
            w.kill()

    def close(self) -> None:
        """Let every worker exit (killed after 5 s); idempotent."""
        workers, self._workers = self._workers, []
        for w in workers:
            w.stop()


def _poll(conn: Any) -> bool:
    try:
        return bool(conn.poll())
    except (EOFError, OSError):
        return False


# ============================================================================ the manager


def components_tensor(extra: Mapping[str, Sequence[float | None]], n: int) -> tuple[torch.Tensor, tuple[str, ...]]:
    """:meth:`RewardManager.score`'s named per-response values (``extra``, lists of ``n`` floats) as
    one ``(n, K) float32`` tensor and its ``K`` column names, in ``extra``'s order; NaN where a
    value is NaN or ``None`` (the response's reward did not report that name). This is the batch
    field ``reward_components`` (see :mod:`rlplug.contracts.batch`)."""
    import torch  # deferred: torch (reward worker processes start without it)

    names = tuple(str(k) for k in extra)
    cols = [[math.nan if v is None else float(v) for v in extra[k]] for k in extra]
    if any(len(c) != n for c in cols):
        raise ValueError(f"reward components need {n} values each; got {dict(zip(names, map(len, cols)))}")
    return torch.tensor(cols, dtype=torch.float32).reshape(len(cols), n).T.contiguous(), names


def _section(config: Any) -> dict:
    if config is None:
        return {}
    if isinstance(config, DictConfig):
        return OmegaConf.to_container(config, resolve=True)  # type: ignore[return-value]
    if isinstance(config, Mapping):
        return dict(config)
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    return dict(vars(config))


#: the largest float32 (the trainer holds the scores as float32): a larger score is a failure, not inf
_FLOAT32_MAX = 3.4028234663852886e38


def _finite(x: Any) -> bool:
    """A bool, or an int/float that is finite (values that can be logged as metrics)."""
    if isinstance(x, bool):
        return True
    try:
        return isinstance(x, (int, float)) and math.isfinite(x)
    except OverflowError:  # an int beyond any float (10**400)
        return False


def _nz(x: float) -> float:
    """``x``, or 0.0 for NaN (a TRL-contract function's ``None``: TRL's ``nansum`` adds nothing for it)."""
    return 0.0 if math.isnan(x) else x


def _mean_std(prefix: str, values: Sequence[float]) -> dict[str, float]:
    """``<prefix>/mean`` and, for two or more values, ``<prefix>/std`` with Bessel's correction (TRL's
    ``nanstd``: ``sqrt(sum((x - mean)^2) / (n - 1))``), in float64."""
    n = len(values)
    mean = math.fsum(values) / n
    out = {f"{prefix}/mean": mean}
    if n > 1:
        out[f"{prefix}/std"] = math.sqrt(math.fsum((x - mean) ** 2 for x in values) / (n - 1))
    return out


#: the metrics RewardManager.score writes itself, ``reward/<name>`` (TRL's log_metric cannot take these names)
_OWN_METRICS = ("failures", "timeouts", "failed_samples", "worker_restarts", "unscorable")


def overlong_penalty(length: int, max_resp_len: int, buffer_len: int, penalty_factor: float) -> float:
    """DAPO's overlong reward shaping (Yu et al. 2025, "DAPO", Eq. 13; verl's ``DAPORewardManager``):
    ``min(-(length - (max_resp_len - buffer_len)) / buffer_len * penalty_factor, 0)``.

    ``length`` is the response's length in tokens (EOS included when generated, verl's
    ``valid_response_length``), ``max_resp_len`` the generation limit (``data.max_response_length``)
    and ``buffer_len`` (tokens, > 0) the stretch before it in which the penalty falls linearly from 0
    to ``-penalty_factor``. E.g. 16, 8, 1.0: 8 tokens -> 0, 12 -> -0.5, 16 -> -1.0.
    """
    return min(-(length - (max_resp_len - buffer_len)) / buffer_len * penalty_factor, 0.0)


def overlong_config(reward: Mapping[str, Any]) -> dict[str, Any] | None:
    """The overlong shaping settings of the ``reward`` section (a plain dict, resolved), or ``None``
    when it is off: ``reward.overlong_buffer`` (``enable``, ``len``, ``penalty_factor``, ``log``,
    ``max_resp_len``: default ``data.max_response_length``) or verl's spelling
    ``reward.reward_kwargs.overlong_buffer_cfg`` (with ``reward.reward_kwargs.max_resp_len``).

    Raises :class:`RewardConfigError` for both spellings enabled at once, an unknown
    ``reward.reward_kwargs`` key, ``len <= 0``, or ``len > max_resp_len`` (verl's checks).
    """
    own = dict(reward.get("overlong_buffer") or {})
    rk = dict(reward.get("reward_kwargs") or {})
    unknown = sorted(set(rk) - {"overlong_buffer_cfg", "max_resp_len"})
    if unknown:
        raise RewardConfigError(
            f"reward.reward_kwargs has {unknown}; rlplug reads only verl's overlong_buffer_cfg and max_resp_len "
            "there (DAPO's overlong shaping, also spelled reward.overlong_buffer). Per-function keyword arguments "
            "go in reward.kwargs.<function name>."
        )
    alias = dict(rk.get("overlong_buffer_cfg") or {})
    if alias.get("enable") and own.get("enable"):
        raise RewardConfigError(
            "The overlong shaping is enabled twice: reward.overlong_buffer.enable and "
            "reward.reward_kwargs.overlong_buffer_cfg.enable (verl's spelling of the same thing). Keep one."
        )
    where = "reward.reward_kwargs.overlong_buffer_cfg" if alias.get("enable") else "reward.overlong_buffer"
    chosen = alias if alias.get("enable") else own
    if not chosen.get("enable"):
        return None
    max_len = rk.get("max_resp_len") if alias.get("enable") else None
    max_len = max_len if max_len is not None else own.get("max_resp_len", chosen.get("max_resp_len"))
    if max_len is None:
        raise RewardConfigError(
            f"{where}.enable=true needs the generation limit: set data.max_response_length (or reward.overlong_buffer."
            "max_resp_len when the reward section is used on its own)."
        )
    # len unset: a fifth of the limit, the proportion of DAPO's recipe (4096 of 20480 tokens)
    buf = int(max_len) // 5 if chosen.get("len") is None else int(chosen["len"])
    factor = float(chosen.get("penalty_factor", 1.0))
    if buf <= 0 or buf > int(max_len):
        raise RewardConfigError(
            f"{where}.len={buf}: the overlong buffer must be > 0 and at most max_resp_len={max_len} tokens "
            f"(e.g. len={max(1, int(max_len) // 4)}); to turn the penalty off set {where}.enable=false."
        )
    return {"len": buf, "penalty_factor": factor, "log": bool(chosen.get("log", False)), "max_resp_len": int(max_len)}


class RewardManager:
    """Scores responses with the configured reward functions.

    Args:
        config: the ``reward`` section of the run config (DictConfig, dataclass or dict) with
            ``reward_fn_map``, ``default``, ``kwargs``, ``custom_reward_function`` (``{path, name,
            reward_kwargs}``), ``shaping`` (``[{name, weight}]``), ``fallback_score``,
            ``timeout_s`` (seconds; None or <= 0: no limit), ``num_workers``.
        registry: where names are looked up (default: ``rlplug.get_registry()``).
        start_method: multiprocessing start method of the worker pool (``spawn``, ``forkserver``
            or ``fork``).
        backstop_slack_s: seconds added to the pool's batch deadline (worker start-up, scheduling)
            before unfinished calls count as timeouts and the pool is killed.
        validation: score validation (verl's ``val_reward_fn``): unless ``reward.val_reward_model`` is
            true, the model-based shaping terms (``fn.model_based``, the reward model) are left out and,
            when there were any, correctness weighs 1.0 (:func:`validation_reward`).

    Raises:
        RewardConfigError: a shaping function name is unknown, a bad ``num_workers``, or what
            :func:`load_custom_reward_function` raises. :class:`rlplug.rewards.reward_model.RewardModelError`
            (a ``RewardConfigError``'s sibling, both ``ConfigError``): a ``reward_model`` entry without
            ``reward.reward_model.enable``, or a bad reward-model folder.
    """

    def __init__(
        self,
        config: Any,
        registry: Any = None,
        *,
        start_method: str = "spawn",
        backstop_slack_s: float = 30.0,
        validation: bool = False,
    ) -> None:
        cfg = _section(config)
        self.fn_map: dict[str, str] = dict(cfg.get("reward_fn_map") or {})
        self.default: str | None = cfg.get("default")
        self.fn_kwargs: dict[str, dict] = {k: dict(v or {}) for k, v in (cfg.get("kwargs") or {}).items()}
        # (label, function name, weight, kwargs); the label names the metric ``shaping/<label>``
        self.shaping: list[tuple[str, str, float, dict]] = []
        self._kwargs_users: set[str] = set()  # functions that take their kwargs from reward.kwargs.<name>
        # reward.reward_model (verl's keys) adds a reward_model entry; the weight of correctness: shaping_entries()
        shaping_cfg, self.correctness_weight = shaping_entries(cfg)
        for i, s in enumerate(shaping_cfg):
            s = _section(s)
            if not s.get("name"):
                raise RewardConfigError(f"reward.shaping[{i}] needs a 'name' (a reward function); got {s}.")
            name = str(s["name"])
            label = name if all(x[1] != name for x in self.shaping) else f"{name}_{i}"
            kw = s.get("kwargs")
            kwargs = dict(kw) if kw else dict(self.fn_kwargs.get(name, {}))
            if not kw:
                self._kwargs_users.add(name)
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
            registry = get_registry()
        self.registry = registry
        self._fns: dict[str, Callable] = {}
        self._checked: set[str] = set()
        self._pool: RewardWorkerPool | None = None
        self._thread: cf.ThreadPoolExecutor | None = None  # score_async's background thread
        self._logged: set[str] = set()
        self.total_failures = 0
        self.total_timeouts = 0
        #: reward worker processes replaced (killed, died or hung) in the last score() call and in all
        self.last_worker_restarts = 0
        self.total_worker_restarts = 0
        #: the first failure of the last :meth:`score` call ("reward function 'x' on data_source=y: error"), or None
        self.last_error: str | None = None
        #: TRL's ``log_metric`` for TRL-contract functions; drained into each :meth:`score` call's metrics
        self._metric_log = MetricLog()
        #: where :meth:`score` gets TRL's ``trainer_state`` when not given one (the trainer sets it:
        #: :func:`rlplug.contracts.reward_contract.attach_trainer`); None: not passed
        self.trainer_state_fn: Callable[[], Any] | None = None
        for i, (_, name, _, kwargs) in enumerate(self.shaping):
            self._resolve(name, f"reward.shaping[{i}]", kwargs)
        if validation and not cfg.get("val_reward_model", False):  # verl's val_reward_fn: the rule reward alone
            rules = [s for s in self.shaping if not getattr(self._fns[s[1]], "model_based", False)]
            if len(rules) < len(self.shaping):
                self.shaping, self.correctness_weight = rules, 1.0
        # precedence 1: a function from a file scores every data source (its slot in _fns is its label)
        self.custom: FileRewardFunction | FileTrlRewardFunction | None = load_custom_reward_function(
            cfg.get("custom_reward_function")
        )
        if self.custom is not None:
            self._fns[self.custom.label] = self.custom
            self.fn_kwargs[self.custom.label] = dict(_section(cfg["custom_reward_function"]).get("reward_kwargs") or {})
        self._reported = False  # check_data_sources' one-time warnings
        self._prepared: set[tuple[int, str]] = set()  # (function, kwargs) prepare() ran for; close() clears
        #: DAPO's overlong shaping ({len, penalty_factor, log, max_resp_len}) or None (off): overlong_config()
        self.overlong = overlong_config(cfg)

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
        """The correctness function for ``data_source``, or None: the custom function's label when
        ``reward.custom_reward_function.path`` is set, else ``reward.reward_fn_map[data_source]``,
        else ``reward.default``."""
        if self.custom is not None:
            return self.custom.label
        return self.fn_map.get(data_source, self.default)

    def chosen_by(self, data_source: str) -> str | None:
        """The setting that chooses ``data_source``'s function (``reward.custom_reward_function``,
        ``reward.reward_fn_map.<data_source>`` or ``reward.default``), or None when none does."""
        if self.custom is not None:
            return _CRF
        if data_source in self.fn_map:
            return f"reward.reward_fn_map.{data_source}"
        return "reward.default" if self.default else None

    @property
    def uses_trl(self) -> bool:
        """Whether a function resolved so far (the shaping terms, the custom function, and the correctness
        functions of the data sources :meth:`check_data_sources` has seen) follows TRL's contract."""
        return any(getattr(fn, "contract", None) == "trl" for fn in self._fns.values())

    @property
    def seen_data_sources(self) -> frozenset[str]:
        """The data sources :meth:`check_data_sources` has checked so far (the trainer's train and validation files)."""
        return frozenset(self._checked)

    def check_data_sources(self, data_sources: set[str] | Sequence[str]) -> None:
        """Check before training that every data source has a reward function, and report the choice.

        The first call logs one line per data source (later calls: per new data source) naming
        the function that scores it and the setting that chose it (see the precedence in this
        module's docstring), and warns once when ``reward.default`` is set but every data source
        has a function of higher precedence, another one than the default for at least one of
        them (``reward=math_verify`` maps every source to its default too, which is harmless), or
        when ``reward.kwargs.<name>`` names a function that neither a data source nor a
        ``reward.shaping`` entry uses.

        Raises:
            RewardConfigError: a data source has no function (lists the sources found, the
                functions available and an override to add, in a spelling the command line
                accepts), a mapped name is not registered, or its ``reward.kwargs`` do not fit its
                signature.
        """
        sources = sorted(set(data_sources))
        missing = [ds for ds in sources if self.fn_name_for(ds) is None]
        if missing:
            try:
                names = list(self.registry.names(_KIND))
            except Exception:  # pragma: no cover
                names = []
            example = "gsm8k" if "gsm8k" in names or not names else names[0]
            fix = map_entry_override("reward.reward_fn_map", missing[0], example)
            fix = f"{fix} (any function listed above), or" if fix else "map it in a reward config file, or set"
            raise RewardConfigError(
                f"No reward function for data source(s) {', '.join(repr(m) for m in missing)}. "
                f"Data sources found: {', '.join(sources)}. Mapped: "
                f"{', '.join(f'{k}->{v}' for k, v in sorted(self.fn_map.items())) or 'none'}; reward.default: {self.default}. "
                f"Reward functions available: {', '.join(names) or 'none'}. "
                f"Fix: {fix} reward.default={example} (every source missing from the map)."
            )
        for ds in sources:
            if ds in self._checked:
                continue
            name = self.fn_name_for(ds)
            if self.custom is None:
                where = (
                    f"reward.reward_fn_map.{ds}={name}" if ds in self.fn_map else f"reward.default={name} (for {ds})"
                )
                self._resolve(name, where)  # type: ignore[arg-type]
            self._checked.add(ds)
            logger.info("reward for data_source %s: %s", ds, self._describe(ds))
        if sources and not self._reported:
            self._reported = True
            self._warn_unused(sources)

    def _describe(self, data_source: str) -> str:
        name, why = self.fn_name_for(data_source), self.chosen_by(data_source)
        if self.custom is not None:
            why = f"{_CRF}.path={self.custom.path}: it scores every data source; reward_fn_map and default are unused"
        elif why == "reward.default":
            why = f"reward.default; {data_source} is not in reward.reward_fn_map"
        shaping = " + ".join(f"{w:g} x {n}" for _, n, w, _ in self.shaping)
        cw = self.correctness_weight  # reward.correctness_weight
        weight = "" if cw == 1.0 else f"{cw:g} x "
        return f"{weight}{name} (chosen by {why})" + (f", plus shaping {shaping}" if shaping else "")

    def _warn_unused(self, sources: Sequence[str]) -> None:
        """The one-time warnings of :meth:`check_data_sources` about settings no data source reaches."""
        shadowed = all(self.chosen_by(ds) != "reward.default" for ds in sources)
        if self.default and shadowed and any(self.fn_name_for(ds) != self.default for ds in sources):
            winners = "; ".join(f"{ds} -> {self.fn_name_for(ds)} ({self.chosen_by(ds)})" for ds in sources)
            if self.custom is not None:
                how = f"unset {_CRF}.path to use reward.reward_fn_map and reward.default"
            else:
                how = "map a source to it instead, e.g. " + (
                    map_entry_override("reward.reward_fn_map", sources[0], self.default)
                    or f"reward.reward_fn_map entry {sources[0]!r}: {self.default}"
                )
            logger.warning(
                "reward.default=%s is set but scores no data source: a setting of higher precedence chooses the "
                "function of each (reward.custom_reward_function, then reward.reward_fn_map, then reward.default): "
                "%s. To score with %s, %s.",
                self.default,
                winners,
                self.default,
                how,
            )
        used = {self.fn_name_for(ds) for ds in sources} | self._kwargs_users
        custom = self.custom.label if self.custom is not None else None
        for name in sorted(k for k in self.fn_kwargs if k != custom and k not in used):
            logger.warning(
                "reward.kwargs.%s is set but no data source or reward.shaping entry uses the reward function %s "
                "(data sources: %s); these settings have no effect.",
                name,
                name,
                ", ".join(f"{ds} -> {self.fn_name_for(ds)}" for ds in sources),
            )

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
        self,
        rows_or_fields: Any,
        responses: Sequence[str],
        *,
        report_acc: bool = False,
        lengths: Sequence[int] | None = None,
        completion_ids: Sequence[Sequence[int]] | None = None,
        trainer_state: Any = None,
    ) -> tuple[list[float], dict[str, list[float]], dict[str, float]]:
        """Score ``responses`` (decoded text, special tokens removed) against their rows.

        Args:
            rows_or_fields: a list of rows (dicts with ``data_source``, ``ground_truth`` or
                ``reward_model.ground_truth``, optional ``extra_info``), one per response, or a
                dict of equal-length lists with those keys.
            responses: ``B`` strings.
            report_acc: also return ``extra["acc_reported"]`` (:data:`ACC_REPORTED`): 1.0 where the
                response's correctness function reported an accuracy (returned a dict with an ``acc``
                key, or is declared binary: ``fn.binary = True``, see :class:`rlplug.contracts.types.RewardFunction`),
                else 0.0 (its ``acc`` is then only its score). Validation and ``rlplug eval`` ask for it
                to name their metric ``acc`` or ``reward`` (:func:`rlplug.run.metrics.validation_metrics`),
                and ``extra["pred"]`` (:data:`PRED`): the extracted answer strings (None where not reported).
            lengths: the ``B`` response lengths in tokens (EOS included when generated). With the
                overlong shaping on (``reward.overlong_buffer.enable``), each score gets
                :func:`overlong_penalty` added and ``extra`` gets ``overlong_reward`` (and ``overlong``,
                1.0 where the penalty is < 0, with ``log``). ``None`` (validation, ``rlplug eval``): no penalty.
            completion_ids: the ``B`` responses' token ids, passed to TRL-contract functions as
                ``completion_ids`` (:mod:`rlplug.contracts.reward_contract`); None: not passed.
            trainer_state: passed to TRL-contract functions as ``trainer_state``
                (:func:`rlplug.contracts.reward_contract.trainer_state`); None: :attr:`trainer_state_fn`'s, if set.

        TRL-contract functions (``contract == "trl"``) may return ``None`` (or NaN) for a response: "does not
        apply". Such a value adds nothing to the score (TRL's ``nansum`` over the weighted functions) and is
        NaN in ``extra`` (``correctness``, ``shaping/<name>``; ``acc`` 0.0); a response for which every
        function returned ``None`` is unscorable (TRL 1.16): marked in ``extra["reward_failed"]`` (so training
        leaves it out, as TRL gives it no advantage), scored ``reward.fallback_score``, counted in
        ``reward/unscorable`` and warned about once. With a TRL-contract function in use ``metrics`` also
        holds TRL's per-function statistics ``reward/<name>/mean`` and ``reward/<name>/std`` (over the
        responses the function returned a number for; ``std`` with Bessel's correction, as TRL's ``nanstd``,
        given two or more numbers; ``<name>`` the function's name, a shaping term's label), and the values its
        functions logged with ``log_metric(name, value)`` as ``reward/<name>`` (their mean).

        Returns:
            ``(scores, extra, metrics)``: ``scores`` ``B`` floats (correctness + weighted shaping);
            ``extra`` per-sample lists of ``B`` floats: ``acc`` (the function's ``acc``, else its
            score; 0.0 on failure), ``correctness`` (correctness score), ``shaping/<name>``
            (unweighted), and every other numeric key of returned dicts (NaN where a sample's
            function did not return it or failed), and ``reward_failed`` (:data:`FAILED`: 1.0 where
            any of the response's calls failed, else 0.0; a failed response's score is
            ``reward.fallback_score`` and training leaves it out); ``metrics``: ``reward/failures``
            (failed calls), ``reward/timeouts`` (timed-out calls) and ``reward/failed_samples``
            (responses with a failed call), counts for this call as floats, and with
            ``reward.num_workers > 0`` ``reward/worker_restarts`` (workers replaced after dying or
            hanging). The first failure's message is kept in :attr:`last_error`.

        Raises:
            RewardConfigError: a data source without a reward function.
            ValueError: rows and responses differ in number.
        """
        responses = list(responses)
        n = len(responses)
        ds, gts, extras = self._fields(rows_or_fields, n)
        self.prepare(set(ds))  # checks the data sources; start-up work (a judge's server) outside every timeout
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
                if hasattr(self._fns[name], "score_batch"):  # one call for the whole batch: _run_batched
                    continue
                calls.append((name, i, label))
                payload.append(
                    (
                        self._fns[name],
                        (ds[i], responses[i], gts[i], dict(extra) if isinstance(extra, dict) else extra),
                        kwargs,
                    )
                )
        self.last_worker_restarts = 0
        trl_labels = self._trl_labels(slots)
        if trainer_state is None and trl_labels and self.trainer_state_fn is not None:
            trainer_state = self.trainer_state_fn()
        self._metric_log.reserved = {f"reward/{k}" for k in _OWN_METRICS} | {
            f"reward/{lab}/{stat}" for lab in trl_labels.values() for stat in ("mean", "std")
        }
        trl_kwargs = {"completion_ids": completion_ids, "trainer_state": trainer_state, "log_metric": self._metric_log}
        if completion_ids is not None and len(completion_ids) != n:
            raise ValueError(f"score(): {len(completion_ids)} completion_ids for {n} responses; pass one per response.")
        results = run_batched(calls, payload, rows_or_fields, self._run, self.timeout_s, trl_kwargs)
        calls, results = self._run_batched(rows_or_fields, responses, calls, list(results), trl_kwargs)
        results = [_item_result(r) for r in results]

        correctness = [self.fallback_score] * n
        acc = [0.0] * n
        acc_reported = [1.0 if getattr(self._fns[s], "binary", False) else 0.0 for s in slots]
        shaping_vals = {label: [0.0] * n for label, _, _, _ in self.shaping}
        other: dict[str, list[float]] = {}
        failures = timeouts = 0
        failed = [0.0] * n  # 1.0 where any of the sample's calls failed
        preds: list[str | None] = [None] * n  # the main function's "pred" strings (report_acc only)
        applies = [0] * n  # calls per sample that returned a value (not TRL's None) or failed
        trl_values: dict[str, list[float]] = {lab: [] for lab in trl_labels.values()}
        self.last_error = None
        for (name, i, slot), (status, value) in zip(calls, results):
            trl = getattr(self._fns[name], "contract", None) == "trl"
            if trl and status == "ok" and value is None:  # TRL: does not apply to this sample (nansum)
                if slot == "main":
                    correctness[i] = math.nan
                else:
                    shaping_vals[slot][i] = math.nan
                continue
            applies[i] += 1
            val, extra_vals, error = self._interpret(status, value)
            if trl and error is None:
                trl_values[trl_labels[(name, slot)]].append(val)
            if error is not None:
                failures += 1
                timeouts += status == "timeout"
                failed[i] = 1.0
                if self.last_error is None:
                    self.last_error = f"reward function '{name}' on data_source={ds[i]}: {error}"
                self._log_failure(name, error, ds[i], responses[i], gts[i])
                val = self.fallback_score
            if slot == "main":
                correctness[i] = val
                if error is None:
                    acc_reported[i] = max(acc_reported[i], float("acc" in extra_vals))
                    acc[i] = float(extra_vals.pop("acc", val))
                    if isinstance(value, Mapping) and isinstance(value.get(PRED), str):
                        preds[i] = value[PRED]
                    for k, v in extra_vals.items():
                        other.setdefault(k, [math.nan] * n)[i] = v
            else:
                shaping_vals[slot][i] = val
        unscorable = [i for i in range(n) if applies[i] == 0]  # every function returned TRL's None
        for i in unscorable:
            failed[i] = 1.0
            correctness[i] = self.fallback_score
            if self.last_error is None:
                self.last_error = (
                    f"every reward function returned None (does not apply) for a response on data_source={ds[i]}"
                )
            self._log_failure(
                "all",
                "every reward function returned None (TRL: unscorable, left out of training)",
                ds[i],
                responses[i],
                gts[i],
            )
        cw = self.correctness_weight
        scores = [
            cw * _nz(correctness[i]) + sum(w * _nz(shaping_vals[label][i]) for label, _, w, _ in self.shaping)
            for i in range(n)
        ]
        for i in unscorable:
            scores[i] = self.fallback_score
        extra_out: dict[str, list[float]] = {"acc": acc, "correctness": correctness}
        for label, _, _, _ in self.shaping:
            extra_out[f"shaping/{label}"] = shaping_vals[label]
        if self.overlong is not None and lengths is not None:
            if len(lengths) != n:
                raise ValueError(f"score(): {len(lengths)} lengths for {n} responses; pass one length per response.")
            ov = self.overlong
            penalty = [overlong_penalty(int(L), ov["max_resp_len"], ov["len"], ov["penalty_factor"]) for L in lengths]
            scores = [x + p for x, p in zip(scores, penalty)]
            extra_out["overlong_reward"] = penalty
            if ov["log"]:
                extra_out["overlong"] = [float(p < 0) for p in penalty]
        for k, values in other.items():
            extra_out.setdefault(k, values)
        extra_out[FAILED] = failed
        if report_acc:
            extra_out[ACC_REPORTED] = acc_reported
            extra_out[PRED] = cast(Any, preds)  # strings: validation's majority vote (rlplug.run.evaluate)
        self.total_failures += failures
        self.total_timeouts += timeouts
        metrics = {
            "reward/failures": float(failures),
            "reward/timeouts": float(timeouts),
            "reward/failed_samples": float(sum(failed)),
        }
        if self.num_workers > 0:
            metrics["reward/worker_restarts"] = float(self.last_worker_restarts)
        if trl_labels:
            metrics["reward/unscorable"] = float(len(unscorable))
            for lab, vals in trl_values.items():
                if vals:
                    metrics.update(_mean_std(f"reward/{lab}", vals))
        metrics.update(self._metric_log.drain())
        return scores, extra_out, metrics

    def _trl_labels(self, slots: Sequence[str]) -> dict[tuple[str, str], str]:
        """``{(function key, slot): metric label}`` of the TRL-contract functions this call uses: a correctness
        function by its name (``fn.name``), a shaping term by its label (``<label>_shaping`` when a correctness
        function has that name too)."""
        out: dict[tuple[str, str], str] = {}
        for key in dict.fromkeys(slots):
            fn = self._fns[key]
            if getattr(fn, "contract", None) == "trl":
                out[(key, "main")] = str(getattr(fn, "name", key))
        main_names = set(out.values())
        for label, name, _, _ in self.shaping:
            if getattr(self._fns[name], "contract", None) == "trl":
                out[(name, label)] = f"{label}_shaping" if label in main_names else label
        return out

    def score_async(
        self,
        rows_or_fields: Any,
        responses: Sequence[str] | Callable[[], Sequence[str]],
        *,
        overlap: bool = True,
        lengths: Sequence[int] | None = None,
        completion_ids: Sequence[Sequence[int]] | None = None,
        trainer_state: Any = None,
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
        :meth:`close` waits for a running call. ``lengths``, ``completion_ids`` and ``trainer_state`` as in
        :meth:`score`.
        """
        t0 = time.perf_counter()

        def work() -> tuple[tuple[list[float], dict[str, list[float]], dict[str, float]], float]:
            texts = responses() if callable(responses) else responses
            result = self.score(
                rows_or_fields, texts, lengths=lengths, completion_ids=completion_ids, trainer_state=trainer_state
            )
            return result, time.perf_counter() - t0

        if not overlap:
            done: cf.Future = cf.Future()
            done.set_result(work())
            return done
        if self._thread is None:
            self._thread = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlplug-score")
        return self._thread.submit(work)

    def _run_batched(
        self,
        rows_or_fields: Any,
        responses: list[str],
        calls: list,
        results: list,
        trl_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[list[tuple[str, int, str]], list[tuple[str, Any]]]:
        """Call each shaping function with a ``score_batch`` method (a TRL-contract function, the
        ``judge``, a model-based reward such as ``reward_model``: :mod:`rlplug.plugins.rewards.reward_model`) once for
        all ``B`` responses, in this process, as ``fn.score_batch(data_sources, solution_strs,
        ground_truths, extra_infos, messages=<B prompt message lists>, **kwargs) -> B floats or dicts``;
        ``calls`` and ``results`` get one entry per response (a call that raises, or returns another
        number of values, fails every response).

        Timeout: the main slot's (:func:`run_batched`): the call runs in a
        thread joined after ``reward.timeout_s * B`` seconds (a timeout of every response), so a
        function gets the same time as a shaping term as in ``reward.default``. Functions marked
        ``model_based = True`` (a model forward, whose time is the model's, not a hang's) have none.
        TRL-contract functions also get ``trl_kwargs`` (:func:`trl_call_kwargs`)."""
        batched = [(label, name, kw) for label, name, _, kw in self.shaping if hasattr(self._fns[name], "score_batch")]
        if not batched:
            return calls, results
        n = len(responses)
        ds, gts, extras = self._fields(rows_or_fields, n)
        if isinstance(rows_or_fields, Mapping):
            messages = list(rows_or_fields.get("messages") or [None] * n)
        else:
            messages = [row.get("messages") for row in rows_or_fields]
        for label, name, kwargs in batched:
            infos = [dict(e) if isinstance(e, Mapping) else e for e in extras]
            fn: Any = self._fns[name]
            timeout = None if getattr(fn, "model_based", False) or not self.timeout_s else self.timeout_s * n
            args, kw = (ds, responses, gts, infos), {"messages": messages, **kwargs}
            kw.update(trl_call_kwargs(fn, trl_kwargs, range(n)))
            status, value = _call_in_thread(fn.score_batch, args, kw, timeout)
            if status == "ok" and (not isinstance(value, Sequence) or len(value) != n):
                status, value = "error", f"score_batch returned {type(value).__name__} for {n} responses"
            calls += [(name, i, label) for i in range(n)]
            results += [("ok", value[i]) for i in range(n)] if status == "ok" else [(status, value)] * n
        return calls, results

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
        except OverflowError:  # an int beyond any float (10**400)
            return 0.0, {}, f"returned an int of {len(str(abs(value)))} digits, beyond float32's range"
        except (TypeError, ValueError):
            return 0.0, {}, f"returned {type(value).__name__} {value!r:.60}; expected a float or a dict with 'score'"
        if not math.isfinite(score):
            return 0.0, {}, f"returned a non-finite score ({score})"
        if abs(score) > _FLOAT32_MAX:  # the trainer's float32 score tensor would hold inf
            return 0.0, {}, f"returned the score {score:g}, beyond float32's range (|score| <= {_FLOAT32_MAX:.4g})"
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

    def _get_pool(self) -> RewardWorkerPool:
        if self._pool is None:
            self._pool = RewardWorkerPool(self.num_workers, self.start_method)
        return self._pool

    def _run_pool(self, payload: list[tuple[Callable, tuple, dict]]) -> list[tuple[str, Any]]:
        pool = self._get_pool()
        before = pool.restarts
        results = pool.run(payload, self.timeout_s, self.backstop_slack_s)
        self.last_worker_restarts = pool.restarts - before
        self.total_worker_restarts += self.last_worker_restarts
        return results

    def _kill_pool(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.kill()

    def prepare(self, data_sources: set[str] | Sequence[str] | None = None) -> None:
        """Call ``fn.prepare(kwargs)`` once on every reward function in use that has a ``prepare``
        method (the ``judge`` starts its server, the reward model loads), with the kwargs it scores
        with: the correctness function of each data source (``data_sources``, default: every one
        :meth:`check_data_sources` has seen: the trainer's train and validation files) with
        ``reward.kwargs.<name>`` (the custom function with its ``reward_kwargs``), and each
        ``reward.shaping`` entry with its own. A function no data source uses is not started.

        It runs in this process with **no** ``reward.timeout_s``: start-up work that takes minutes must
        not be charged to the first responses' timeouts (which would turn every one of them into a
        fallback score). The trainer calls it at setup, before any rollout, so a function that cannot
        start fails the run before compute is spent; :meth:`score` calls it for its batch's data
        sources (a no-op for those already prepared). Each (function, kwargs) is prepared once until
        :meth:`close`. Functions run per sample in ``reward.num_workers`` worker processes get their
        ``prepare`` here too, in this process: start-up they need inside a worker is theirs to do.

        Raises:
            whatever a ``prepare`` raises (e.g. :class:`rlplug.plugins.rewards.judge.JudgeServerError`
            for a judge server that does not start), unchanged: it is a setup failure, not a
            failure to score one response. :class:`RewardConfigError` for a data source without a
            function (:meth:`check_data_sources`).
        """
        sources = self._checked if data_sources is None else set(data_sources)
        if data_sources is not None:
            self.check_data_sources(sources)
        entries: list[tuple[str, Callable, dict]] = []
        for name in sorted({cast(str, self.fn_name_for(ds)) for ds in sources}):
            entries.append((name, self._fns[name], self.fn_kwargs.get(name, {})))
        entries += [(label, self._fns[name], kwargs) for label, name, _, kwargs in self.shaping]
        for label, fn, kwargs in entries:
            prep = getattr(fn, "prepare", None)
            key = (id(fn), repr(sorted(kwargs.items(), key=lambda kv: str(kv[0]))))
            if not callable(prep) or key in self._prepared:
                continue
            t0 = time.perf_counter()
            prep(dict(kwargs))
            self._prepared.add(key)
            logger.info("reward function '%s' prepared in %.1f s", label, time.perf_counter() - t0)

    def close(self) -> None:
        """Wait for a running :meth:`score_async` call (bounded by ``timeout_s`` per call), then shut the
        worker pool down and call ``close()`` on each reward function object that has one (the ``judge``
        stops the server it started); idempotent. The manager can still score afterwards (a new pool
        starts, a judge starts its server again)."""
        thread, self._thread = self._thread, None
        if thread is not None:  # before the pool below: the running call may be using it
            thread.shutdown(wait=True, cancel_futures=True)
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()
        self._prepared.clear()  # a later score() prepares again (the judge's server was stopped below)
        for fn in {id(f): f for f in self._fns.values()}.values():
            closer = getattr(fn, "close", None)  # a function holding resources (the judge's server)
            if callable(closer):
                try:
                    closer()
                except Exception as exc:  # closing must not hide the run's outcome
                    logger.warning("reward function %r: close() failed: %s: %s", fn, type(exc).__name__, exc)

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ============================================================================ failures in training


def validation_reward(manager: Any, reward: Any) -> Any:
    """The reward manager validation scores with (verl's ``val_reward_fn``): ``manager`` itself when
    ``reward.val_reward_model`` is true or no shaping term is model-based (``fn.model_based``, as the
    reward model), else a :class:`rlplug.rewards.manager.RewardManager` of the rule reward alone (correctness
    with weight 1 and the other shaping terms), so a run trained on a reward model reports accuracy."""
    fns = getattr(manager, "_fns", {})
    model_based = any(getattr(fns.get(name), "model_based", False) for _, name, _, _ in manager.shaping)
    if bool(typed(RewardConfig, reward).val_reward_model) or not model_based:
        return manager
    return RewardManager(reward, registry=manager.registry, validation=True)


def scored_rows(
    extra: Mapping[str, Sequence[float | None]], n: int, baselines: torch.Tensor | None = None
) -> torch.Tensor:
    """``(n,) bool``: True for the responses whose reward succeeded, from :meth:`RewardManager.score`'s
    ``extra`` (its :data:`FAILED` list; every response counts as scored when it is absent, e.g. for
    scores that did not come from a :class:`RewardManager`) and, when given, whose baseline score
    (``baselines`` ``(n,) float32``, ReMax's ``reward_baselines``; NaN where it failed) is finite."""
    import torch  # deferred: torch (reward worker processes start without it)

    flags = extra.get(FAILED)
    if flags is not None and len(flags) != n:
        raise ValueError(f"extra['{FAILED}'] has {len(flags)} values for {n} responses")
    ok = torch.ones(n, dtype=torch.bool) if flags is None else torch.tensor([not v for v in flags], dtype=torch.bool)
    if baselines is not None:
        ok &= torch.isfinite(baselines.detach().cpu().float())
    return ok


class RewardFailureGuard:
    """Counts the training steps in a row in which no response's reward succeeded.

    Such a step has nothing to learn from: the trainer skips its updates. ``limit`` steps in a
    row (``trainer.max_consecutive_bad_steps``) raise :class:`rlplug.base.exit_codes.RewardFailuresStopped`
    (exit code 4) with the first error of the streak. A step with at least one scored response
    resets the count. The count is part of the checkpoint (``state_dict``), so a resumed run
    stops where an uninterrupted one would.
    """

    #: checkpoints written before this guard existed resume with a count of 0
    optional_state = True

    def __init__(self, limit: int) -> None:
        self.limit = int(limit)
        self.consecutive = 0
        self.first_error: str | None = None

    def allows_update(
        self,
        scored: torch.Tensor,
        step: int,
        error: str | Callable[[], str | None] | None,
        checkpoint_root: Any = None,
    ) -> bool:
        """Whether step ``step`` may update, given its ``scored`` rows (``(B,) bool``, the same on
        every process) and the first reward error of the step: ``error``, or a function returning
        it, called only when no row was scored (the trainer passes a broadcast from the main
        process, which scored). Raises :class:`rlplug.base.exit_codes.RewardFailuresStopped` at the limit."""
        if bool(scored.any()):
            self.consecutive, self.first_error = 0, None
            return True
        self.consecutive += 1
        self.first_error = self.first_error or (error() if callable(error) else error)
        where = f" The last good checkpoint is intact under {checkpoint_root}." if checkpoint_root else ""
        if self.consecutive >= self.limit:
            first = (self.first_error or "unknown").rstrip(".")
            raise RewardFailuresStopped(
                f"the reward failed for every response in {self.consecutive} steps in a row (limit "
                f"trainer.max_consecutive_bad_steps={self.limit}). First error: {first}. "
                f"Fix the reward function (try it on one response with `rlplug rollout --prompt ...`).{where}"
            )
        msg = (
            f"step {step}: the reward failed for all {scored.numel()} responses "
            f"({self.first_error or 'see the warning above'}); skipping the update "
            f"({self.consecutive}/{self.limit} before the run stops)."
        )
        logger.warning(msg)
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"consecutive": self.consecutive, "first_error": self.first_error}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.consecutive = int(state.get("consecutive", 0))
        self.first_error = state.get("first_error")
