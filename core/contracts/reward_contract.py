"""Reward functions with TRL's batched contract, next to verl's per-sample one.

Two contracts can be registered as kind ``reward_function``:

* ``"verl"`` (the default, :class:`rlplug.contracts.types.RewardFunction`): one call per response,
  ``fn(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float | dict``.
* ``"trl"`` (the reward functions of TRL's ``GRPOTrainer``, TRL 1.16): one call per batch, with keywords,
  ``fn(prompts=..., completions=..., completion_ids=..., trainer_state=..., log_metric=..., **columns)
  -> list[float | None]``, one value per completion. ``None`` (or NaN) means "does not apply to this sample".
  Register it wrapped, so the registry holds a :class:`BatchedRewardFunction` and knows its contract:
  ``register("my_reward", rlplug.trl_reward(fn))``, or decorate the function with ``@rlplug.trl_reward``.
  :func:`as_reward_function` (used by :func:`rlplug.train` for ``reward_funcs``) also takes plain
  functions and, without an explicit ``contract=``, tells the two apart by their parameter names
  (a function that fits neither or both is an error asking for ``contract=``).

What a TRL-contract function receives (:meth:`BatchedRewardFunction.score_batch`), as TRL passes it:

* ``prompts``: per sample the dataset's prompt as it was (a string, or a list of ``{role, content}``
  messages): ``extra_info["prompt"]`` when the row has it (:func:`rlplug.train` stores it there),
  else the row's chat messages;
* ``completions``: the decoded responses, as strings for string prompts, as
  ``[{"role": "assistant", "content": text}]`` for conversational ones (TRL's conversational format);
* ``completion_ids``: the responses' token ids (lists of ints, EOS included when generated), when the
  caller has them (the trainer passes them; ``rlplug reward`` has none and leaves the keyword out);
* ``**columns``: ``data_source``, ``ground_truth`` and every key of the rows' ``extra_info`` (the
  dataset's other columns, with their values as the dataset had them, for data from :func:`rlplug.train`),
  each a list with one value per sample (``None`` where a row lacks the key), plus the function's
  ``reward.kwargs.<name>`` as plain keywords;
* ``trainer_state``: a ``transformers.TrainerState`` with ``global_step`` (optimizer steps done before
  this batch), ``max_steps`` and ``epoch``, when the caller passes one (the trainer does);
* ``log_metric``: ``log_metric(name, value)`` logs a scalar as ``reward/<name>`` (averaged over the calls
  of one scoring call), as TRL's ``log_metric`` does.

TRL's ``log_extra`` (a column of its completions table) and ``environments`` are not passed: rlplug has
no completions table or environments. A function without ``**kwargs`` gets only the keywords it names. An
``async def`` function is awaited (on an event loop of its own), as TRL awaits it.

The reward manager (:meth:`rlplug.rewards.manager.RewardManager.score`) calls each TRL-contract function once
per :meth:`~rlplug.rewards.manager.RewardManager.score` call with all its samples, in this process (not in the
``reward.num_workers`` pool), through :meth:`BatchedRewardFunction.score_batch`. It combines the functions as
TRL does (``nansum`` of the weighted values: a ``None`` adds nothing), and a sample for which every function
returned ``None`` is unscorable (TRL 1.16): it is left out of training like a failed reward, with a warning
(:mod:`rlplug.rewards.manager`). As the correctness function (:func:`rlplug.rewards.manager.run_batched`) a TRL-contract function runs under
a timeout of ``reward.timeout_s`` per sample, an exception or a timeout is a reward failure of every sample
of the call, and a return value that is not one number (or ``None``) per completion raises
:class:`RewardContractError` at once (a bug in the function, not a failure to score a response). As a
``reward.shaping`` term it goes through the manager's batched shaping call, where that error fails the
rewards of every response of the call (the run stops after ``trainer.max_consecutive_bad_steps`` such
steps with the message).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
    "CONTRACTS",
    "TRL_ARGUMENTS",
    "BatchedRewardFunction",
    "RewardContractError",
    "MetricLog",
    "as_reward_function",
    "trl_reward",
    "required_columns",
    "trainer_state",
    "attach_trainer",
    "trainer_state_of",
    "trl_ids",
    "trl_inputs",
]

#: the reward-function contracts and their call signatures
CONTRACTS = {
    "verl": "fn(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float | dict",
    "trl": "fn(prompts, completions, **kwargs) -> list[float | None]",
}

#: the keywords TRL's GRPOTrainer passes besides the dataset's columns (TRL 1.16 ``_calculate_rewards``);
#: ``log_extra`` and ``environments`` are TRL's too but rlplug has nothing to pass for them
TRL_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments")


class RewardContractError(TypeError):
    """A reward function does not follow its contract (:data:`CONTRACTS`): a TRL-contract function
    returned the wrong number of values or non-numbers, needs an argument nobody passes, or a function's
    contract cannot be told."""


class ScoresOneAsABatch:
    """Mixin for batched reward functions: calling the object on one response (verl's per-sample
    contract, :class:`rlplug.contracts.types.RewardFunction`) scores a batch of one through ``score_batch``;
    a ``messages=`` keyword is that response's prompt messages. Returns the one float."""

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **kwargs: Any
    ) -> float:
        messages = kwargs.pop("messages", None)
        return self.score_batch(  # type: ignore[attr-defined]
            [data_source], [solution_str], [ground_truth], [extra_info], messages=[messages], **kwargs
        )[0]


class MetricLog:
    """TRL's ``log_metric(name, value)`` for reward functions: collects scalars (thread-safe) until
    :meth:`drain` returns each name's mean as ``reward/<name>``.

    Raises (when called): :class:`RewardContractError` for a name that is not a non-empty string, one of the
    manager's own metric names (``reserved``), or a value that is not a finite number."""

    def __init__(self, reserved: Sequence[str] = ()) -> None:
        self._values: dict[str, list[float]] = {}
        self._lock = threading.Lock()
        self.reserved = set(reserved)

    def __call__(self, name: str, value: float) -> None:
        if not isinstance(name, str) or not name:
            raise RewardContractError(f"log_metric(name, value): name must be a non-empty string, got {name!r:.60}.")
        if f"reward/{name}" in self.reserved:
            raise RewardContractError(
                f"log_metric({name!r}, ...): reward/{name} is one of rlplug's own reward metrics; choose another name."
            )
        try:
            v = float(value)
        except (TypeError, ValueError):
            raise RewardContractError(f"log_metric({name!r}, {value!r:.60}): the value must be a number.") from None
        if not math.isfinite(v):
            raise RewardContractError(f"log_metric({name!r}, {v}): the value must be finite.")
        with self._lock:
            self._values.setdefault(name, []).append(v)

    def drain(self) -> dict[str, float]:
        """``{"reward/<name>": mean of the values logged since the last drain}``; clears them."""
        with self._lock:
            values, self._values = self._values, {}
        return {f"reward/{k}": sum(v) / len(v) for k, v in values.items()}


def trainer_state(global_step: int, max_steps: int, epoch: float) -> Any:
    """What TRL passes as ``trainer_state``: a ``transformers.TrainerState`` with ``global_step`` (optimizer
    steps done before the scored batch), ``max_steps`` (the run's steps) and ``epoch``."""
    from transformers import TrainerState  # deferred: transformers

    return TrainerState(global_step=int(global_step), max_steps=int(max_steps), epoch=float(epoch))


def trl_ids(reward: Any, out: Any) -> dict[str, Any]:
    """``{"completion_ids": out.response_ids}`` (a :class:`rlplug.contracts.types.RolloutOutput`'s token ids, EOS
    included when generated, as TRL's) when the reward manager ``reward`` uses a TRL-contract function
    (:attr:`rlplug.rewards.manager.RewardManager.uses_trl`), else ``{}``: the keywords validation adds to ``score``."""
    return {"completion_ids": out.response_ids} if getattr(reward, "uses_trl", False) else {}


def trl_inputs(trainer: Any, out: Any) -> dict[str, Any]:
    """The keywords the trainer adds to :meth:`rlplug.rewards.manager.RewardManager.score` for TRL-contract functions:
    :func:`trl_ids` of ``trainer.reward`` (``trainer_state`` comes from :func:`attach_trainer`)."""
    return trl_ids(getattr(trainer, "reward", None), out)


def trainer_state_of(trainer: Any) -> Any:
    """:func:`trainer_state` of ``trainer`` now: its ``global_step`` (optimizer steps done), ``total_steps`` and
    epoch ``global_step / loader.steps_per_epoch``; None when ``trainer`` lacks them."""
    done, total = getattr(trainer, "global_step", None), getattr(trainer, "total_steps", None)
    per_epoch = getattr(getattr(trainer, "loader", None), "steps_per_epoch", None)
    if isinstance(done, int) and isinstance(total, int) and isinstance(per_epoch, int):
        return trainer_state(done, total, done / max(1, per_epoch))
    return None


def attach_trainer(trainer: Any) -> None:
    """Give the trainer's reward managers (``trainer.reward``, ``trainer.val_reward``) the source of TRL's
    ``trainer_state`` (:attr:`rlplug.rewards.manager.RewardManager.trainer_state_fn`): :func:`trainer_state_of` the
    trainer at each scoring call, in training and validation."""
    for name in ("reward", "val_reward"):
        manager = getattr(trainer, name, None)
        if manager is not None and hasattr(manager, "trainer_state_fn"):
            manager.trainer_state_fn = lambda: trainer_state_of(trainer)


def callable_name(fn: Any) -> str:
    """The name TRL gives a reward function: ``__name__``, through ``functools.partial`` wrappers; a callable
    object's class name."""

    while isinstance(fn, functools.partial):
        fn = fn.func
    return str(getattr(fn, "__name__", type(fn).__name__))


def _signature(fn: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _trl_callable(sig: inspect.Signature) -> str | None:
    """Why ``sig`` cannot be called as TRL calls a reward function (keywords only, ``completions`` among
    them), or None when it can: it accepts ``completions`` (by name or ``**kwargs``) and has no required
    positional-only parameter."""
    params = sig.parameters.values()
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if "completions" not in names and not var_kw:
        return "it takes no `completions` keyword (nor **kwargs)"
    positional = [p.name for p in params if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if positional:
        return f"TRL passes every argument by keyword, and {', '.join(positional)} are positional-only"
    return None


def required_columns(fn: Any) -> list[str]:
    """The dataset columns a TRL-contract function needs: its parameters without a default that are not
    TRL's own arguments (:data:`TRL_ARGUMENTS`), e.g. ``["answer"]`` for ``fn(prompts, completions, answer,
    **kwargs)``. ``fn`` may be a :class:`BatchedRewardFunction`."""
    sig = _signature(getattr(fn, "fn", fn))
    if sig is None:
        return []
    return [
        p.name
        for p in sig.parameters.values()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty and p.name not in TRL_ARGUMENTS
    ]


class BatchedRewardFunction(ScoresOneAsABatch):
    """A reward function with TRL's batched contract (``contract = "trl"``), as the registry holds it.

    ``fn(prompts, completions, **kwargs) -> list[float | None]`` (see the module docstring); ``name`` names
    it in messages and metrics (default ``fn.__name__``). Calling the object itself follows verl's per-sample
    contract (:class:`rlplug.contracts.types.RewardFunction`), scoring a batch of one (the prompt from
    ``extra_info["prompt"]``, else ``None``; a ``None`` from ``fn`` is 0.0 there), so code that scores one
    response at a time (``rlplug.testing.check_reward_function``) works; the reward manager calls
    :meth:`score_batch`. Pickles as ``(fn, name)``: a module-level ``fn`` makes it picklable.
    """

    contract = "trl"

    def __init__(self, fn: Callable[..., Any], name: str | None = None) -> None:
        if not callable(fn):
            raise RewardContractError(f"trl_reward() needs a function, got {type(fn).__name__} {fn!r:.60}.")
        self.fn = fn
        self.name: str = str(name or callable_name(fn))
        # the function's names and docs, but no __wrapped__: inspect.signature must see verl's __call__
        for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
            if hasattr(fn, attr):
                setattr(self, attr, getattr(fn, attr))

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **kwargs: Any
    ) -> float:
        value = super().__call__(data_source, solution_str, ground_truth, extra_info, **kwargs)
        return 0.0 if value is None else value

    def score_batch(
        self,
        data_sources: Sequence[str],
        solution_strs: Sequence[str],
        ground_truths: Sequence[Any],
        extra_infos: Sequence[Any],
        messages: Sequence[Any] | None = None,
        *,
        completion_ids: Sequence[Sequence[int]] | None = None,
        trainer_state: Any = None,
        log_metric: Callable[[str, float], None] | None = None,
        **kwargs: Any,
    ) -> list[float | None]:
        """Call ``fn`` once for the ``B`` decoded responses ``solution_strs`` with TRL's keywords (the module
        docstring): ``data_sources``, ``ground_truths``, ``extra_infos`` and the prompts' chat ``messages``
        (``B`` each) make ``prompts``, ``completions`` and the columns; ``completion_ids`` (``B`` lists of token
        ids), ``trainer_state`` and ``log_metric`` are passed when given; ``kwargs`` are its ``reward.kwargs``.
        A function without ``**kwargs`` gets only the keywords it names.

        Returns ``B`` values in order: floats, or ``None`` where ``fn`` returned ``None`` or NaN (the function
        does not apply to that sample, TRL's meaning). Numbers of any kind (``bool``, ``int``, numpy and torch
        scalars, a tensor or array of ``B``) are converted to float, as TRL's ``torch.tensor(..., float32)`` does.

        Raises:
            RewardContractError: ``fn`` returned something other than ``B`` numbers or ``None``, it needs an
                argument that is neither TRL's nor a column of these rows, or a ``reward.kwargs`` setting or a
                data column has the name of one of TRL's arguments or of another column.
        """
        n = len(solution_strs)
        msgs = list(messages) if messages is not None else [None] * n
        rows = [
            {"data_source": d, "ground_truth": g, "extra_info": e, "messages": m}
            for d, g, e, m in zip(data_sources, ground_truths, extra_infos, msgs)
        ]
        prompts = [_prompt_of(r) for r in rows]
        completions: list[Any] = [
            [{"role": "assistant", "content": t}] if isinstance(p, list) else t for p, t in zip(prompts, solution_strs)
        ]
        columns = _columns(rows)
        clash = sorted(set(columns) & set(TRL_ARGUMENTS))
        if clash:
            raise RewardContractError(
                f"reward function '{self.name}': the data has column(s) {clash}, which are names of TRL's reward "
                f"arguments ({', '.join(TRL_ARGUMENTS)}); rename the column(s) in the dataset."
            )
        clash = sorted((set(columns) | set(TRL_ARGUMENTS)) & set(kwargs))
        if clash:
            raise RewardContractError(
                f"reward function '{self.name}': reward.kwargs.{self.name} sets {clash}, which are also data columns "
                "or TRL's arguments passed to it; rename the setting or the column."
            )
        call: dict[str, Any] = {"prompts": prompts, "completions": completions}
        if completion_ids is not None:
            if len(completion_ids) != n:
                raise ValueError(f"score_batch(): {len(completion_ids)} completion_ids for {n} completions.")
            call["completion_ids"] = [[int(t) for t in ids] for ids in completion_ids]
        call.update(columns)
        call.update(kwargs)
        if trainer_state is not None:
            call["trainer_state"] = trainer_state
        if log_metric is not None:
            call["log_metric"] = log_metric
        out = self.fn(**self._accepted(call))
        if inspect.isawaitable(out):  # an async reward function (TRL 1.16 awaits those)
            out = _run_coroutine(out)
        return _check_values(self.name, out, n)

    def _accepted(self, call: dict[str, Any]) -> dict[str, Any]:
        """``call`` narrowed to the keywords ``fn`` accepts (all with ``**kwargs``); raises
        :class:`RewardContractError` for a required parameter ``call`` lacks."""
        sig = _signature(self.fn)
        if sig is None or any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
            accepted = call
        else:
            accepted = {k: v for k, v in call.items() if k in sig.parameters}
        missing = [c for c in required_columns(self.fn) if c not in call]
        for name in TRL_ARGUMENTS:
            p = sig.parameters.get(name) if sig is not None else None
            if p is not None and p.default is p.empty and p.kind is not p.VAR_KEYWORD and name not in call:
                missing.append(name)
        if missing:
            available = sorted(k for k in call if k not in TRL_ARGUMENTS)
            notes = {
                "completion_ids": "completion_ids and trainer_state come from the trainer only (not `rlplug reward`)",
                "trainer_state": "completion_ids and trainer_state come from the trainer only (not `rlplug reward`)",
                "log_extra": "rlplug passes no log_extra or environments (it has no completions table or environments)",
                "environments": "rlplug passes no log_extra or environments (it has no completions table or environments)",
            }
            why = sorted({notes[m] for m in missing if m in notes})
            raise RewardContractError(
                f"reward function '{self.name}' needs {', '.join(missing)}, which this call does not have. "
                f"Columns of the data: {', '.join(available) or 'none'}"
                + "".join(f"; {w}" for w in why)
                + ". Add the column to the dataset, give the parameter a default, or take it from **kwargs."
            )
        return accepted

    def __reduce__(self) -> tuple[Any, tuple[Any, str]]:
        return (BatchedRewardFunction, (self.fn, self.name))

    def __repr__(self) -> str:
        return f"BatchedRewardFunction({self.name}, contract='trl')"


def _run_coroutine(awaitable: Any) -> Any:
    """The result of an async reward function's ``awaitable``: run on a new event loop, in this thread, or in a
    helper thread when this one already runs a loop (a notebook)."""

    async def wait() -> Any:
        return await awaitable

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(wait())
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(("ok", asyncio.run(wait())))
        except BaseException as exc:  # handed to the caller's thread
            box.append(("error", exc))

    t = threading.Thread(target=run, name="rlplug-async-reward", daemon=True)
    t.start()
    t.join()
    status, value = box[0]
    if status == "error":
        raise value
    return value


def _prompt_of(row: Mapping[str, Any]) -> Any:
    extra = row.get("extra_info")
    if isinstance(extra, Mapping) and "prompt" in extra:
        return extra["prompt"]
    if row.get("messages") is not None:
        return row["messages"]
    return row.get("prompt")


def _columns(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """The rows' columns as TRL passes them: ``data_source``, ``ground_truth`` and every ``extra_info`` key
    but ``prompt``, one list each; a column the dataset had itself (an ``extra_info`` key) keeps its values
    as they were (``ground_truth`` is a string in ``reward_model``, the column may hold numbers)."""
    columns: dict[str, list[Any]] = {
        "data_source": [r.get("data_source") for r in rows],
        "ground_truth": [_ground_truth(r) for r in rows],
    }
    keys: list[str] = []
    for r in rows:
        extra = r.get("extra_info")
        if isinstance(extra, Mapping):
            keys += [k for k in extra if k not in keys and k != "prompt"]
    for k in keys:
        if k in columns and not all(isinstance(r.get("extra_info"), Mapping) and k in r["extra_info"] for r in rows):
            continue  # data_source / ground_truth: the dataset's own column only where every row has it
        columns[k] = [r["extra_info"].get(k) if isinstance(r.get("extra_info"), Mapping) else None for r in rows]
    return columns


def _ground_truth(row: Mapping[str, Any]) -> Any:
    gt = row.get("ground_truth")
    if gt is None and isinstance(row.get("reward_model"), Mapping):
        gt = row["reward_model"].get("ground_truth")
    return gt


def _check_values(name: str, out: Any, n: int) -> list[float | None]:
    how = f"reward function '{name}' (TRL contract {CONTRACTS['trl']})"
    if hasattr(out, "tolist") and not isinstance(out, (str, bytes)):
        out = out.tolist()  # a tensor or numpy array
    if not isinstance(out, Sequence) or isinstance(out, (str, bytes, Mapping)):
        raise RewardContractError(
            f"{how} returned {type(out).__name__} {out!r:.60}; return a list of {n} floats (None: not applicable)."
        )
    if len(out) != n:
        raise RewardContractError(
            f"{how} returned {len(out)} values for {n} completions; return one float (or None) per completion, "
            "in the order of `completions`."
        )
    values: list[float | None] = []
    for i, v in enumerate(out):
        if v is None:
            values.append(None)
            continue
        if hasattr(v, "item") and not isinstance(v, (str, bytes)):
            v = v.item()  # a numpy or torch scalar
        if isinstance(v, (str, bytes)) or not isinstance(v, (bool, int, float)):
            raise RewardContractError(
                f"{how} returned {type(v).__name__} {v!r:.60} for completion {i}; expected a float (or None)."
            )
        try:
            f = float(v)
        except OverflowError:
            raise RewardContractError(
                f"{how} returned an int of {len(str(abs(int(v))))} digits for completion {i}; expected a float."
            ) from None
        values.append(None if math.isnan(f) else f)  # NaN: TRL's nansum treats it as None
    return values


def trl_reward(fn: Callable[..., Any] | None = None, *, name: str | None = None) -> Any:
    """Mark ``fn`` as a TRL-contract reward function: returns a :class:`BatchedRewardFunction`. Use as
    ``@rlplug.trl_reward``, ``@rlplug.trl_reward(name="x")`` or ``register("x", rlplug.trl_reward(fn))``."""
    if fn is None:
        return lambda f: BatchedRewardFunction(f, name)
    return BatchedRewardFunction(fn, name)


_VERL_NAMES = ("data_source", "solution_str", "ground_truth", "extra_info")
#: parameter names that say "TRL's contract" (any one of them, by name)
_TRL_NAMES = ("prompts", "completions", "completion_ids")


def _binds(sig: inspect.Signature, *args: Any, **kwargs: Any) -> bool:
    try:
        sig.bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def as_reward_function(fn: Any, contract: str = "auto") -> Callable[..., Any]:
    """``fn`` ready to register as kind ``reward_function``: a :class:`BatchedRewardFunction` for TRL's
    contract, ``fn`` itself for verl's.

    ``contract``: ``"trl"``, ``"verl"`` or ``"auto"``. With ``"auto"`` an explicit marker wins (a
    :class:`BatchedRewardFunction`, or a ``reward_contract`` attribute of ``"trl"`` or ``"verl"`` on the
    function); otherwise the signature decides: a parameter named ``prompts``, ``completions`` or
    ``completion_ids`` makes it TRL's (``fn(completions, **kwargs)``, ``fn(prompts, completions, answer,
    **kwargs)``: other required parameters are dataset columns, :func:`required_columns`), verl's two leading
    parameters (``data_source, solution_str``) verl's.

    Raises:
        RewardContractError: an unknown ``contract``, a function whose signature fits neither contract or
            both (``fn(*args, **kwargs)``: pass ``contract=``), or an explicit contract it cannot be called with
            (TRL's: it must accept ``completions`` by keyword, by name or ``**kwargs``).
    """
    if contract not in ("auto", *CONTRACTS):
        raise RewardContractError(f"contract={contract!r}; expected one of 'auto', {', '.join(map(repr, CONTRACTS))}.")
    if isinstance(fn, BatchedRewardFunction):
        if contract == "verl":
            raise RewardContractError(
                f"{fn!r} is marked as a TRL-contract function; it cannot be registered as verl's."
            )
        return fn
    if not callable(fn):
        raise RewardContractError(f"a reward function must be callable, got {type(fn).__name__} {fn!r:.60}.")
    name = callable_name(fn)
    if contract == "auto":
        contract = str(getattr(fn, "reward_contract", "auto"))
    sig = _signature(fn)
    if sig is not None:
        trl_why = _trl_callable(sig)
        verl_ok = _binds(sig, "data_source", "solution_str", "ground_truth", None)
        params = [p.name for p in sig.parameters.values() if p.kind is not p.VAR_POSITIONAL]
        if contract == "auto":
            named_trl = trl_why is None and any(p in params for p in _TRL_NAMES)
            named_verl = verl_ok and params[:2] == list(_VERL_NAMES[:2])
            if named_trl != named_verl:
                contract = "trl" if named_trl else "verl"
        if contract == "trl" and trl_why is not None:
            raise RewardContractError(
                f"reward function '{name}'{sig} cannot be called with the trl contract {CONTRACTS['trl']}: {trl_why}."
            )
        if contract == "verl" and not verl_ok:
            raise RewardContractError(
                f"reward function '{name}'{sig} cannot be called with the verl contract {CONTRACTS['verl']}."
            )
    if contract == "auto":
        raise RewardContractError(
            f"cannot tell the contract of reward function '{name}'{sig if sig is not None else ''}: name its parameters "
            f"as one of the contracts does ({CONTRACTS['trl']} for TRL, {CONTRACTS['verl']} for verl) or pass "
            "contract='trl' / contract='verl' (or decorate it with @rlplug.trl_reward)."
        )
    return BatchedRewardFunction(fn, name) if contract == "trl" else fn
