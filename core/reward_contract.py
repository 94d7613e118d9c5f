"""Reward functions with TRL's batched contract, next to verl's per-sample one.

Two contracts can be registered as kind ``reward_function``:

* ``"verl"`` (the default, :class:`rlplug.types.RewardFunction`): one call per response,
  ``fn(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float | dict``.
* ``"trl"`` (TRL's ``GRPOTrainer`` reward functions): one call per batch,
  ``fn(prompts, completions, **columns) -> list[float]``, one value (or ``None``: the function does not
  apply to that sample, counted as 0.0 as TRL's sum over functions does) per completion. Register it
  wrapped, so the registry holds a :class:`BatchedRewardFunction` and knows its contract:
  ``register("my_reward", rlplug.trl_reward(fn))``, or decorate the function with ``@rlplug.trl_reward``.
  :func:`as_reward_function` (used by :func:`rlplug.train` for ``reward_funcs``) also takes plain
  functions and, without an explicit ``contract=``, tells the two apart by their parameter names
  (checked: a function that fits neither or both is an error asking for ``contract=``).

What a TRL-contract function receives (:meth:`BatchedRewardFunction.score_batch`), as TRL passes it:

* ``prompts``: per sample the dataset's prompt as it was (a string, or a list of ``{role, content}``
  messages): ``extra_info["prompt"]`` when the row has it (:func:`rlplug.train` stores it there),
  else the row's chat messages;
* ``completions``: the decoded responses, as strings for string prompts, as
  ``[{"role": "assistant", "content": text}]`` for conversational ones;
* ``**columns``: ``data_source``, ``ground_truth`` and every key of the rows' ``extra_info`` (the
  dataset's other columns, for data from :func:`rlplug.train`), each a list with one value per sample
  (``None`` where a row lacks the key), plus the function's ``reward.kwargs.<name>`` as plain keywords.

The reward manager (:meth:`rlplug.reward.RewardManager.score`) calls each TRL-contract function once
per :meth:`~rlplug.reward.RewardManager.score` call with all its samples, in this process (not in the
``reward.num_workers`` pool), through :meth:`BatchedRewardFunction.score_batch` (the signature every
batched reward function has there). As the correctness function (:func:`run_batched`) it runs under a
timeout of ``reward.timeout_s`` per sample, an exception or a timeout is a reward failure of every sample
of the call, and a return value that is not one number (or ``None``) per completion raises
:class:`RewardContractError` at once (a bug in the function, not a failure to score a response). As a
``reward.shaping`` term it goes through the manager's batched shaping call, where that error fails the
rewards of every response of the call (the run stops after ``trainer.max_consecutive_bad_steps`` such
steps with the message).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
    "CONTRACTS",
    "BatchedRewardFunction",
    "RewardContractError",
    "as_reward_function",
    "trl_reward",
    "run_batched",
]

#: the reward-function contracts and their call signatures
CONTRACTS = {
    "verl": "fn(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float | dict",
    "trl": "fn(prompts, completions, **columns) -> list[float]",
}


class RewardContractError(TypeError):
    """A reward function does not follow its contract (:data:`CONTRACTS`): a TRL-contract function
    returned the wrong number of values or non-numbers, or a function's contract cannot be told."""


class ScoresOneAsABatch:
    """Mixin for batched reward functions: calling the object on one response (verl's per-sample
    contract, :class:`rlplug.types.RewardFunction`) scores a batch of one through ``score_batch``;
    a ``messages=`` keyword is that response's prompt messages. Returns the one float."""

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **kwargs: Any
    ) -> float:
        messages = kwargs.pop("messages", None)
        return self.score_batch(  # type: ignore[attr-defined]
            [data_source], [solution_str], [ground_truth], [extra_info], messages=[messages], **kwargs
        )[0]


class BatchedRewardFunction(ScoresOneAsABatch):
    """A reward function with TRL's batched contract (``contract = "trl"``), as the registry holds it.

    ``fn(prompts, completions, **columns) -> list[float]`` (see the module docstring); ``name`` names it
    in messages (default ``fn.__name__``). Calling the object itself follows verl's per-sample contract
    (:class:`rlplug.types.RewardFunction`), scoring a batch of one (the prompt from
    ``extra_info["prompt"]``, else ``None``), so code that scores one response at a time
    (``rlplug.testing.check_reward_function``) works; the reward manager calls :meth:`score_batch`.
    Pickles as ``(fn, name)``: a module-level ``fn`` makes it picklable.
    """

    contract = "trl"

    def __init__(self, fn: Callable[..., Any], name: str | None = None) -> None:
        if not callable(fn):
            raise RewardContractError(f"trl_reward() needs a function, got {type(fn).__name__} {fn!r:.60}.")
        self.fn = fn
        self.name: str = str(name or getattr(fn, "__name__", type(fn).__name__))
        # the function's names and docs, but no __wrapped__: inspect.signature must see verl's __call__
        for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
            if hasattr(fn, attr):
                setattr(self, attr, getattr(fn, attr))

    def score_batch(
        self,
        data_sources: Sequence[str],
        solution_strs: Sequence[str],
        ground_truths: Sequence[Any],
        extra_infos: Sequence[Any],
        messages: Sequence[Any] | None = None,
        **kwargs: Any,
    ) -> list[float]:
        """Call ``fn`` once for the ``B`` decoded responses ``solution_strs`` (the reward manager's batched
        call, as for the other batched reward functions: ``data_sources``, ``ground_truths``,
        ``extra_infos`` and the prompts' chat ``messages``, ``B`` each; ``kwargs`` its
        ``reward.kwargs``). Returns ``B`` floats, ``None`` counted as 0.0 (the function does not apply).

        Raises:
            RewardContractError: ``fn`` returned something other than ``B`` numbers or ``None``, or a
                ``reward.kwargs`` setting has the name of a data column.
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
        clash = sorted(set(columns) & set(kwargs))
        if clash:
            raise RewardContractError(
                f"reward function '{self.name}': reward.kwargs.{self.name} sets {clash}, which are also data columns "
                "passed to it; rename the setting or the column."
            )
        out = self.fn(prompts=prompts, completions=completions, **columns, **kwargs)
        return [0.0 if v is None else v for v in _check_values(self.name, out, n)]

    def __reduce__(self) -> tuple[Any, tuple[Any, str]]:
        return (BatchedRewardFunction, (self.fn, self.name))

    def __repr__(self) -> str:
        return f"BatchedRewardFunction({self.name}, contract='trl')"


def _prompt_of(row: Mapping[str, Any]) -> Any:
    extra = row.get("extra_info")
    if isinstance(extra, Mapping) and "prompt" in extra:
        return extra["prompt"]
    if row.get("messages") is not None:
        return row["messages"]
    return row.get("prompt")


def _columns(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    columns: dict[str, list[Any]] = {
        "data_source": [r.get("data_source") for r in rows],
        "ground_truth": [_ground_truth(r) for r in rows],
    }
    keys: list[str] = []
    for r in rows:
        extra = r.get("extra_info")
        if isinstance(extra, Mapping):
            keys += [k for k in extra if k not in keys and k != "prompt" and k not in columns]
    for k in keys:
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
        raise RewardContractError(f"{how} returned {type(out).__name__} {out!r:.60}; return a list of {n} floats.")
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
        if isinstance(v, bool) or not isinstance(v, (int, float)) and not hasattr(v, "__float__"):
            raise RewardContractError(
                f"{how} returned {type(v).__name__} {v!r:.60} for completion {i}; expected a float."
            )
        values.append(float(v))
    return values


def trl_reward(fn: Callable[..., Any] | None = None, *, name: str | None = None) -> Any:
    """Mark ``fn`` as a TRL-contract reward function: returns a :class:`BatchedRewardFunction`. Use as
    ``@rlplug.trl_reward``, ``@rlplug.trl_reward(name="x")`` or ``register("x", rlplug.trl_reward(fn))``."""
    if fn is None:
        return lambda f: BatchedRewardFunction(f, name)
    return BatchedRewardFunction(fn, name)


_VERL_NAMES = ("data_source", "solution_str", "ground_truth", "extra_info")


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
    function); otherwise the signature decides: parameters named ``prompts`` and ``completions`` (called as
    keywords, as TRL does) make it TRL's, verl's four leading parameters (``data_source``,
    ``solution_str``, ...) verl's.

    Raises:
        RewardContractError: an unknown ``contract``, a function whose signature fits neither contract or
            both (``fn(*args, **kwargs)``: pass ``contract=``), or an explicit contract it cannot be called with.
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
    name = getattr(fn, "__name__", type(fn).__name__)
    if contract == "auto":
        contract = str(getattr(fn, "reward_contract", "auto"))
    try:
        sig: inspect.Signature | None = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        trl_ok = _binds(sig, prompts=[], completions=[])
        verl_ok = _binds(sig, "data_source", "solution_str", "ground_truth", None)
        params = list(sig.parameters)
        if contract == "auto":
            named_trl = trl_ok and "prompts" in params and "completions" in params
            named_verl = verl_ok and params[:2] == list(_VERL_NAMES[:2])
            if named_trl != named_verl:
                contract = "trl" if named_trl else "verl"
        bad = (contract == "trl" and not trl_ok) or (contract == "verl" and not verl_ok)
        if bad:
            raise RewardContractError(
                f"reward function '{name}'{sig} cannot be called with the {contract} contract {CONTRACTS[contract]}."
            )
    if contract == "auto":
        raise RewardContractError(
            f"cannot tell the contract of reward function '{name}'{sig if sig is not None else ''}: name its parameters "
            f"as one of the contracts does ({CONTRACTS['trl']} for TRL, {CONTRACTS['verl']} for verl) or pass "
            "contract='trl' / contract='verl' (or decorate it with @rlplug.trl_reward)."
        )
    return BatchedRewardFunction(fn, name) if contract == "trl" else fn


def run_batched(
    calls: Sequence[tuple[str, int, str]],
    payload: Sequence[tuple[Callable, tuple, dict]],
    rows_or_fields: Any,
    run: Callable[[list[tuple[Callable, tuple, dict]]], list[tuple[str, Any]]],
    timeout_s: float | None,
) -> list[tuple[str, Any]]:
    """The results ``(status, value)`` of the reward manager's ``payload`` (one ``(fn, (data_source,
    response, ground_truth, extra_info), kwargs)`` per entry of ``calls``: ``(name, sample, slot)``):
    per-sample functions through ``run`` (the manager's serial or pool execution), each TRL-contract
    function (:class:`BatchedRewardFunction`, with the same kwargs) once for all its samples, in a thread
    joined after ``timeout_s`` seconds per sample. Raises :class:`RewardContractError` (see the module docstring)."""
    from .reward import _call_in_thread

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
        score_batch = fn.score_batch  # type: ignore[attr-defined]  # a BatchedRewardFunction (checked above)
        status, value = _call_in_thread(score_batch, args, {"messages": messages, **kwargs}, timeout)
        if status == "error" and value.startswith(f"{RewardContractError.__name__}:"):
            raise RewardContractError(value.split(": ", 1)[1])
        for k, j in enumerate(js):
            results[j] = (status, value) if status != "ok" else ("ok", value[k])
    return results


def _rows(rows_or_fields: Any) -> list[dict]:
    """One dict per sample: the rows themselves, or a dict of lists turned into rows."""
    if isinstance(rows_or_fields, Mapping):
        keys = list(rows_or_fields)
        n = len(rows_or_fields[keys[0]]) if keys else 0
        return [{k: rows_or_fields[k][i] for k in keys if rows_or_fields[k] is not None} for i in range(n)]
    return [dict(r) for r in rows_or_fields]
