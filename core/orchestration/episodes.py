"""Multi-turn episodes: the engine samples a turn, the environment answers, until the episode ends.

:class:`EpisodeEngine` turns dataset rows into trajectories (``rollout.n`` per row, one environment
instance each, kind ``environment``), runs them, and returns one :class:`rlplug.contracts.types.RolloutOutput`
whose response ``i`` is trajectory ``i``'s whole multi-turn response:

* the ids the engine sampled, exactly, with their log-probs (``response_masks`` 1), and between the turns the
  environment's replies and the template tokens the engine did not sample (``response_masks`` 0), computed
  by :class:`rlplug.orchestration.chat.TurnRenderer` (token-in-token-out; never a re-tokenized history);
* a step reward of the environment at the position of its turn's last sampled token (``step_rewards``);
* the last assistant message as the text the reward functions score (``solutions``), the conversation as
  ``transcripts``.

An episode ends when the environment says ``done`` (``tool_agent``: a message with no tool call), at
``rollout.multi_turn.max_assistant_turns`` / ``max_user_turns`` (the turn cap), when
``data.max_response_length`` tokens are used (an observation that does not fit is cut or ends the episode:
``on_overflow``), at ``episode_timeout_s``, or when the environment raises. Tool calls run in worker processes
(:class:`rlplug.orchestration.tool_workers.ToolRunner`) under ``tool_timeout_s`` and the episode's deadline.

Generation: with an in-process engine the turns run in lockstep (one ``generate`` call per turn for the
trajectories still running); with a server engine (``rollout.mode=server``) every trajectory runs on its own,
so a slow tool holds only its own trajectory. Seeds: turn ``k`` of the lockstep is sampled with
``params.seed + k * TURN_SEED_STRIDE``; trajectory ``i``'s turn ``k`` on a server with
``params.seed + i * TURN_SEED_STRIDE + k``; environment ``i`` gets :func:`episode_seed`. All derive from the
step's seed, so a resumed run repeats the episodes exactly when every tool call finishes inside its timeout
(a timeout depends on wall time: a resumed run may time out elsewhere).

Metrics, per step: verl's ``num_turns/{mean,max,min}`` (assistant turns + observation turns + 1, as verl's agent
loop counts them); ``multi_turn/*``: ``turns_mean`` / ``turns_max`` (assistant turns per trajectory),
``tool_calls``, ``tool_errors``, ``tool_timeouts``, ``tool_crashes``, ``malformed_calls``, ``ended_by_done``,
``ended_by_turn_cap``, ``ended_by_length``, ``ended_by_timeout``, ``env_errors``, ``overflow``
(observations cut or refused for length), ``masked_token_share`` (environment tokens / response tokens).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import dataclasses
import hashlib
import inspect
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlplug.algorithms.losses import compute_token_level_scores
from rlplug.base.threads import in_daemon_thread
from rlplug.config.schema import MultiTurnConfig, typed
from rlplug.contracts.agents import EnvironmentContext, EnvStep, ToolResult
from rlplug.contracts.types import RolloutOutput, SamplingParams
from rlplug.orchestration.chat import TurnRenderer
from rlplug.orchestration.tool_workers import ToolRunner

__all__ = [
    "EpisodeEngine",
    "EpisodeError",
    "MULTI_TURN_METRICS",
    "TURN_SEED_STRIDE",
    "agent_name",
    "episode_engine_for_run",
    "episode_seed",
    "rows_for_scoring",
    "run_coroutine",
    "solution_texts",
    "token_level_scores",
]

log = logging.getLogger(__name__)

#: seed offset between turns (lockstep) and between trajectories (server engines)
TURN_SEED_STRIDE = 1_000_033

#: the per-step metrics of multi-turn episodes (module docstring)
MULTI_TURN_METRICS: tuple[str, ...] = ("num_turns/mean", "num_turns/max", "num_turns/min") + tuple(
    f"multi_turn/{k}"
    for k in (
        "turns_mean",
        "turns_max",
        "tool_calls",
        "tool_errors",
        "tool_timeouts",
        "tool_crashes",
        "malformed_calls",
        "ended_by_done",
        "ended_by_turn_cap",
        "ended_by_length",
        "ended_by_timeout",
        "env_errors",
        "overflow",
        "masked_token_share",
    )
)

_INFO_COUNTS = {
    "tool_calls": "tool_calls",
    "tool_errors": "tool_errors",
    "tool_timeouts": "tool_timeouts",
    "tool_crashes": "tool_crashes",
    "malformed_calls": "malformed_calls",
}


class EpisodeError(RuntimeError):
    """An environment could not start an episode (its ``reset`` raised or returned no messages): a bug in the
    environment or the row, reported with the row's index and the environment's name."""


def agent_name(row: Mapping[str, Any]) -> str | None:
    """The environment a row asks for (verl's convention): its ``agent_name`` column, else
    ``extra_info["agent_name"]``; None when neither is set."""
    name = row.get("agent_name")
    if not name:
        extra = row.get("extra_info")
        name = extra.get("agent_name") if isinstance(extra, Mapping) else None
    return str(name) if name else None


def episode_seed(step_seed: int | None, index: int) -> int:
    """The seed of trajectory ``index``'s environment for a step sampled with ``step_seed`` (a 63-bit int,
    a hash of both, so neighbouring steps and trajectories get unrelated seeds)."""
    digest = hashlib.sha256(f"{step_seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def episode_engine_for_run(
    config: Any,
    registry: Any,
    tokenizer: Any,
    generate: Callable[[list[list[int]], SamplingParams], RolloutOutput],
    *datasets: Any,
) -> EpisodeEngine | None:
    """The run's :class:`EpisodeEngine` when ``rollout.multi_turn.enable`` is on, else None.

    Trajectories run one per request with a server engine (``rollout.mode=server``), in lockstep otherwise.
    Every row of ``datasets`` (the training and validation data; None entries skipped) has its environment
    resolved now. Raises :class:`rlplug.orchestration.chat.TemplateError` for a chat template that cannot be
    extended turn by turn and :class:`EpisodeError` for a row whose ``agent_name`` names no environment, both
    before any model loads."""
    if not config.rollout.multi_turn.enable:
        return None
    engine = EpisodeEngine(config, registry, tokenizer, generate, per_trajectory=config.rollout.mode == "server")
    for ds, where in zip(datasets, ("the training data", "the validation data", "the data")):
        if ds is not None:
            engine.check_rows(ds, where)
    return engine


def solution_texts(out: RolloutOutput, tokenizer: Any) -> list[str]:
    """The texts the reward functions score (``solution_str``): a trajectory's last assistant message
    (:attr:`RolloutOutput.solutions`), else each response decoded without special tokens."""
    if out.solutions is not None:
        return list(out.solutions)
    return list(tokenizer.batch_decode(out.response_ids, skip_special_tokens=True))


def rows_for_scoring(rows: Sequence[Mapping[str, Any]], out: RolloutOutput) -> list[Mapping[str, Any]]:
    """The dataset row of each response (``rows[out.prompt_index[i]]``); for a multi-turn trajectory a copy
    whose ``extra_info`` also holds ``messages`` (the transcript) and ``step_rewards`` (the environment's
    rewards per turn), as the reward functions receive them."""
    picked = [rows[i] for i in out.prompt_index]
    if out.transcripts is None:
        return picked
    result: list[Mapping[str, Any]] = []
    for i, row in enumerate(picked):
        extra = row.get("extra_info")
        extra = dict(extra) if isinstance(extra, Mapping) else {}
        extra["messages"] = out.transcripts[i]
        extra["step_rewards"] = [r for _, r in out.step_rewards[i]] if out.step_rewards is not None else []
        result.append({**row, "extra_info": extra})
    return result


def token_level_scores(
    scores: torch.Tensor, response_mask: torch.Tensor, out: Any, scored: torch.Tensor | None = None
) -> torch.Tensor:
    """``(B, T) float32``: each response's score ``scores`` ``(B,)`` on its last model token
    (:func:`rlplug.algorithms.losses.compute_token_level_scores`), plus, for multi-turn trajectories, each
    environment step reward of ``out.step_rewards`` at its position (the last sampled token of the turn
    that earned it). ``scored`` ``(B,) bool``: rows whose reward failed get no step reward either."""
    result = compute_token_level_scores(scores, response_mask)
    if getattr(out, "step_rewards", None) is None:
        return result
    for i, rewards in enumerate(out.step_rewards):
        if scored is not None and not bool(scored[i]):
            continue
        for position, reward in rewards:
            result[i, position] += float(reward)
    return result


def _env_stops(env: Any) -> list[str]:
    """An environment's stop strings (its ``stop`` attribute: a sequence of strings, or one string; none when absent).
    Raises ``TypeError`` for anything else, naming the environment."""
    stop = getattr(env, "stop", None)
    if stop is None:
        return []
    if isinstance(stop, str):  # one string, not one stop per character
        return [stop]
    stops = list(stop) if isinstance(stop, Iterable) else None
    if stops is None or not all(isinstance(x, str) and x for x in stops):
        raise TypeError(
            f"{type(env).__name__}.stop must be a string or a list of non-empty strings (where the engine stops a "
            f"turn), got {stop!r}."
        )
    return stops


def run_coroutine(coro: Awaitable[Any]) -> Any:
    """Run ``coro`` to completion from synchronous code, in a new event loop (in a helper thread when the
    calling thread already runs one, e.g. in a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)  # type: ignore[arg-type]
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)  # type: ignore[arg-type]
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name="rlplug-episodes")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


async def _call(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``: awaited when it is a coroutine function; a plain one runs on a daemon thread of its own
    (:func:`rlplug.base.threads.in_daemon_thread`: an environment's blocking code must not stall the other
    trajectories, and one that never returns must not hold up the batch past its episode's timeout), its result
    awaited if it is awaitable."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    result = await in_daemon_thread(fn, *args)
    if inspect.isawaitable(result):
        result = await result
    return result


def _messages(value: Any) -> list[dict[str, Any]]:
    """A sequence of chat messages (dicts; verl rows may hold a numpy array of them) as a list of dicts."""
    return [dict(m) for m in list(value)]


@dataclass
class _Trajectory:
    index: int
    prompt_index: int
    row: Mapping[str, Any]
    env: Any
    env_name: str
    deadline: float
    prompt_ids: list[int] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    step_rewards: list[tuple[int, float]] = field(default_factory=list)
    assistant_turns: int = 0
    user_turns: int = 0
    finish_reason: str = "stop"
    end: str | None = None  # done | turn_cap | length | timeout | env_error
    counts: dict[str, float] = field(default_factory=dict)
    solution: str = ""
    closed: bool = False
    renderer: Any = None  # the TurnRenderer of this episode (EpisodeEngine.renderer_for)

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


class EpisodeEngine:
    """Multi-turn episodes over a rollout engine (module docstring).

    ``generate(prompt_ids, params) -> RolloutOutput`` is the rollout backend's ``generate`` (thread-safe when
    ``per_trajectory``: server engines); ``registry`` resolves the environments (kind ``environment``) and the
    tools (kind ``tool``) of ``config.rollout.multi_turn``; ``max_response_length`` bounds each whole
    multi-turn response (``data.max_response_length``). Building it checks the chat template
    (:class:`rlplug.orchestration.chat.TemplateError`) and starts no process; tool workers start at the first
    call. :meth:`close` stops them.
    """

    def __init__(
        self,
        config: Any,
        registry: Any,
        tokenizer: Any,
        generate: Callable[[list[list[int]], SamplingParams], RolloutOutput],
        *,
        per_trajectory: bool = False,
        max_response_length: int | None = None,
    ) -> None:
        self.settings = typed(MultiTurnConfig, config.rollout.multi_turn)
        self.registry, self.tokenizer, self._generate = registry, tokenizer, generate
        self.per_trajectory = per_trajectory
        self.max_response_length = int(max_response_length or config.data.max_response_length)
        self.tools = {name: registry.get("tool", name) for name in self.settings.tools}
        self.renderer = TurnRenderer(tokenizer, tools=self._schemas(self.tools))
        #: renderers for environments with their own ``tools`` (format hermes), by their tool names
        self._renderers: dict[tuple[str, ...], TurnRenderer] = {tuple(self.tools): self.renderer}
        s = self.settings
        self.runner = ToolRunner(
            self.tools,
            timeout_s=s.tool_timeout_s,
            max_chars=s.max_tool_response_length,
            memory_mb=s.tool_memory_mb,
            workers=s.tool_workers,
        )
        self._factories: dict[str, Any] = {}

    def _schemas(self, tools: Mapping[str, Any]) -> list[dict[str, Any]] | None:
        """The chat template's ``tools=`` for ``tools`` (by name): their JSON schemas with
        ``rollout.multi_turn.format=hermes``, else None (the tag protocol is shown in the prompt)."""
        if self.settings.format != "hermes" or not tools:
            return None
        return [
            {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
            for t in tools.values()
        ]

    def renderer_for(self, env: Any) -> TurnRenderer:
        """The renderer of ``env``'s episode: an environment with its own ``tools`` attribute (a mapping by name
        of objects with ``name``, ``description``, ``parameters``, e.g. a TRL environment's methods) has them
        given to the chat template; any other gets :attr:`renderer` (the selected tools). One renderer per set
        of tool names, built once (building checks the template: :class:`TemplateError`)."""
        tools = getattr(env, "tools", None)
        if not isinstance(tools, Mapping):
            return self.renderer
        key = tuple(tools)
        if key not in self._renderers:
            self._renderers[key] = TurnRenderer(self.tokenizer, tools=self._schemas(tools))
        return self._renderers[key]

    def close(self) -> None:
        """Stop the tool workers; idempotent."""
        self.runner.close()

    def __enter__(self) -> EpisodeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check_rows(self, rows: Any, where: str) -> None:
        """Resolve the environment of every row of ``rows`` now (a row's ``agent_name``, else
        ``rollout.multi_turn.environment``), so that an unknown name fails before any model loads; raises the
        registry's error prefixed with ``where`` and the row."""
        seen: set[str] = set()
        for i, row in enumerate(rows):
            name = agent_name(row) or self.settings.environment
            if name in seen:
                continue
            try:
                self.factory(name)
            except Exception as exc:
                raise EpisodeError(
                    f"{where}, row {i}: agent_name={name!r} names no usable environment plugin ({exc}). Register an "
                    "environment of that name (hook register_environments) or fix the row's agent_name."
                ) from exc
            seen.add(name)

    def factory(self, name: str) -> Any:
        if name not in self._factories:
            self._factories[name] = self.registry.get("environment", name)
        return self._factories[name]

    # ------------------------------------------------------------------ one batch
    def generate(self, rows: Sequence[Mapping[str, Any]], params: SamplingParams, *, step: int = 0) -> RolloutOutput:
        """Run ``params.n`` episodes per row (prompt-major: row 0's first) and return them as one
        :class:`~rlplug.contracts.types.RolloutOutput` (module docstring); its ``metrics`` hold
        :data:`MULTI_TURN_METRICS`. Raises :class:`EpisodeError` when an environment cannot start."""
        return run_coroutine(self._run(list(rows), params, step))

    async def _run(self, rows: list[Mapping[str, Any]], params: SamplingParams, step: int) -> RolloutOutput:
        s = self.settings
        start = time.monotonic()
        trajectories: list[_Trajectory] = []
        for p, row in enumerate(rows):
            for _ in range(max(1, int(params.n))):
                i = len(trajectories)
                name = agent_name(row) or s.environment
                context = EnvironmentContext(
                    tools=self.tools,
                    call_tool=self._tool_caller(i, trajectories),
                    settings=s,
                    seed=episode_seed(params.seed if params.seed is not None else step, i),
                    index=i,
                )
                env = self.factory(name)(context)
                trajectories.append(_Trajectory(i, p, row, env, name, start + float(s.episode_timeout_s)))
        try:
            await asyncio.gather(*(self._reset(t) for t in trajectories))
            stops = tuple(dict.fromkeys([*params.stop, *(x for t in trajectories for x in _env_stops(t.env))]))
            turn_params = dataclasses.replace(params, n=1, stop=stops)
            if self.per_trajectory:
                pool = cf.ThreadPoolExecutor(max_workers=min(256, max(1, len(trajectories))))
                try:
                    await asyncio.gather(*(self._run_one(t, turn_params, pool) for t in trajectories))
                finally:
                    pool.shutdown(wait=False)
            else:
                await self._lockstep(trajectories, turn_params)
        finally:
            await asyncio.gather(*(self._close_env(t) for t in trajectories))
        return self._output(trajectories, params)

    def _tool_caller(self, i: int, trajectories: list[_Trajectory]) -> Callable[..., Awaitable[ToolResult]]:
        async def call_tool(name: str, arguments: Mapping[str, Any]) -> ToolResult:
            # rollout.multi_turn.tool_timeout_s, and never past the episode's deadline
            return await self.runner.call(name, arguments, deadline=trajectories[i].deadline)

        return call_tool

    async def _reset(self, t: _Trajectory) -> None:
        # environments get verl's row schema: the prompt messages under "prompt" (rlplug's dataset rows hold
        # them as "messages", already tokenized as "prompt_ids")
        row = t.row if t.row.get("prompt") is not None else {**t.row, "prompt": t.row.get("messages")}
        try:
            messages = _messages(await asyncio.wait_for(_call(t.env.reset, row), timeout=max(0.001, t.remaining())))
        except Exception as exc:
            raise EpisodeError(
                f"environment {t.env_name!r} failed to start the episode of row {t.prompt_index} "
                f"({type(exc).__name__}: {exc}); an environment's reset(row) must return the prompt messages."
            ) from exc
        if not messages:
            raise EpisodeError(
                f"environment {t.env_name!r} returned no messages from reset(row) for row {t.prompt_index}; it "
                "must return the prompt as a list of chat messages."
            )
        t.messages = messages
        t.renderer = self.renderer_for(t.env)
        row_prompt = row.get("prompt")
        # the dataset rendered the row's prompt_ids without tools=: with tool schemas the prompt is rendered here
        same = row_prompt is not None and "prompt_ids" in t.row and _same_messages(messages, row_prompt)
        same = same and t.renderer.tools is None
        t.prompt_ids = list(t.row["prompt_ids"]) if same else t.renderer.prompt_ids(messages)

    async def _close_env(self, t: _Trajectory) -> None:
        """``env.close()`` once, as soon as the episode ends (also after an error); a failure is logged. Before
        it, an episode the engine ended (length, turn cap, timeout: ``step`` returned no ``done``) gets the
        environment's optional ``final_reward()`` (a number or None, e.g. a TRL environment's ``get_reward()``)
        as a step reward on its last sampled token; it runs under ``tool_timeout_s``, a failure is logged and
        counted as ``env_errors``."""
        if t.closed:
            return
        t.closed = True
        final = getattr(t.env, "final_reward", None)
        if t.end in ("length", "turn_cap", "timeout") and callable(final) and 1 in t.mask:
            try:
                limit = float(self.settings.tool_timeout_s)
                value = await asyncio.wait_for(_call(final), timeout=limit if limit > 0 else None)
                if value is not None:
                    position = len(t.mask) - 1 - t.mask[::-1].index(1)
                    t.step_rewards.append((position, float(value)))
            except Exception as exc:  # the episode's tokens stay; only this reward is lost
                log.warning("environment %r final_reward() raised %s: %s", t.env_name, type(exc).__name__, exc)
                t.counts["env_errors"] = t.counts.get("env_errors", 0.0) + 1
        close = getattr(t.env, "close", None)
        if callable(close):
            try:
                await _call(close)
            except Exception as exc:  # a failing close must not lose the batch
                log.warning("environment %r close() raised %s: %s", t.env_name, type(exc).__name__, exc)

    # ------------------------------------------------------------------ turns
    async def _lockstep(self, trajectories: list[_Trajectory], params: SamplingParams) -> None:
        turn = 0
        while True:
            active = [t for t in trajectories if t.end is None]
            for t in active:
                if t.remaining() <= 0:
                    self._end(t, "timeout")
            active = [t for t in active if t.end is None]
            if not active:
                return
            budget = [self.max_response_length - len(t.response_ids) for t in active]
            seed = None if params.seed is None else params.seed + turn * TURN_SEED_STRIDE
            p = dataclasses.replace(params, max_tokens=max(budget), seed=seed)
            out = self._generate([t.context for t in active], p)
            for k, t in enumerate(active):
                logps = out.log_probs[k] if out.log_probs is not None else None
                self._add_sampled(t, out.response_ids[k], logps, out.finish_reasons[k], budget[k])
            await asyncio.gather(*(self._step_env(t) for t in active if t.end is None))
            await asyncio.gather(*(self._close_env(t) for t in active if t.end is not None))
            turn += 1

    async def _run_one(self, t: _Trajectory, params: SamplingParams, pool: cf.Executor) -> None:
        loop = asyncio.get_running_loop()
        turn = 0
        while t.end is None:
            if t.remaining() <= 0:
                self._end(t, "timeout")
                return
            budget = self.max_response_length - len(t.response_ids)
            seed = None if params.seed is None else params.seed + t.index * TURN_SEED_STRIDE + turn
            p = dataclasses.replace(params, max_tokens=budget, seed=seed)
            out = await loop.run_in_executor(pool, self._generate, [t.context], p)
            logps = out.log_probs[0] if out.log_probs is not None else None
            self._add_sampled(t, out.response_ids[0], logps, out.finish_reasons[0], budget)
            if t.end is None:
                await self._step_env(t)
            turn += 1
        await self._close_env(t)

    def _add_sampled(
        self, t: _Trajectory, ids: Sequence[int], logps: Sequence[float] | None, finish: str, budget: int
    ) -> None:
        ids = list(ids)[:budget]
        if logps is not None:
            logps = list(logps)[: len(ids)]
        t.response_ids += ids
        t.mask += [1] * len(ids)
        t.log_probs += list(logps) if logps is not None else [0.0] * len(ids)
        t.assistant_turns += 1
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        t.messages.append({"role": "assistant", "content": text})
        t.solution = text
        if finish == "length" or len(t.response_ids) >= self.max_response_length:
            t.finish_reason = "length"
            self._end(t, "length")

    async def _step_env(self, t: _Trajectory) -> None:
        s = self.settings
        last = len(t.response_ids) - 1
        try:
            result = await asyncio.wait_for(_call(t.env.step, t.messages[-1]), timeout=max(0.001, t.remaining()))
        except TimeoutError:
            self._end(t, "timeout")
            return
        except Exception as exc:  # one environment's failure ends its episode, not the step
            log.warning("environment %r step() raised %s: %s", t.env_name, type(exc).__name__, exc)
            t.counts["env_errors"] = t.counts.get("env_errors", 0.0) + 1
            self._end(t, "env_error")
            return
        if not isinstance(result, EnvStep):
            result = EnvStep(*result) if isinstance(result, tuple) else result
        for key, name in _INFO_COUNTS.items():
            value = (result.info or {}).get(key)
            if isinstance(value, (int, float)):
                t.counts[name] = t.counts.get(name, 0.0) + float(value)
        if result.reward is not None and last >= 0:
            t.step_rewards.append((last, float(result.reward)))
        observations = _messages(result.observations or ())
        if result.done or not observations:
            self._end(t, "done")
            return
        if t.assistant_turns >= s.max_assistant_turns or t.user_turns >= s.max_user_turns:
            self._end(t, "turn_cap")
            return
        sampled = t.response_ids[len(t.response_ids) - _last_turn_length(t) :]
        ids = t.renderer.close_turn(sampled) + t.renderer.observation_ids(observations)
        room = self.max_response_length - len(t.response_ids) - 1  # at least one token for the next turn
        if len(ids) > room:
            t.counts["overflow"] = t.counts.get("overflow", 0.0) + 1
            cut = self._cut(t.renderer, sampled, observations, room) if s.on_overflow == "truncate" else None
            if cut is None:
                t.finish_reason = "length"
                self._end(t, "length")
                return
            ids, observations = cut
        t.response_ids += ids
        t.mask += [0] * len(ids)
        t.log_probs += [0.0] * len(ids)
        t.messages += observations
        t.user_turns += 1

    def _cut(
        self, renderer: TurnRenderer, sampled: Sequence[int], observations: list[dict[str, Any]], room: int
    ) -> tuple[list[int], list[dict[str, Any]]] | None:
        """The observation with its last message's text cut (whole tokens) so that its ids fit in ``room``;
        None when even an empty text does not fit."""
        last = observations[-1]
        text_ids = renderer.plain_ids(str(last.get("content", "")))
        lo, hi = 0, len(text_ids)
        best: tuple[list[int], list[dict[str, Any]]] | None = None
        while lo <= hi:  # the longest prefix of the text whose rendering fits
            mid = (lo + hi) // 2
            cut = [*observations[:-1], {**last, "content": self.tokenizer.decode(text_ids[:mid])}]
            ids = renderer.close_turn(sampled) + renderer.observation_ids(cut)
            if len(ids) <= room:
                best, lo = (ids, cut), mid + 1
            else:
                hi = mid - 1
        return best

    def _end(self, t: _Trajectory, reason: str) -> None:
        if t.end is None:
            t.end = reason

    # ------------------------------------------------------------------ the batch
    def _output(self, trajectories: list[_Trajectory], params: SamplingParams) -> RolloutOutput:
        n = len(trajectories)
        counts: dict[str, float] = {}
        for t in trajectories:
            for k, v in t.counts.items():
                counts[k] = counts.get(k, 0.0) + v
        tokens = sum(len(t.response_ids) for t in trajectories)
        masked = sum(len(t.mask) - sum(t.mask) for t in trajectories)
        turns = [t.assistant_turns for t in trajectories] or [0]
        # verl's num_turns (its agent loop's __num_turns__): assistant turns + observation turns + 1 (the prompt)
        num_turns = [t.assistant_turns + t.user_turns + 1 for t in trajectories] or [0]
        metrics = {
            "num_turns/mean": sum(num_turns) / max(1, n),
            "num_turns/max": float(max(num_turns)),
            "num_turns/min": float(min(num_turns)),
            "multi_turn/turns_mean": sum(turns) / max(1, n),
            "multi_turn/turns_max": float(max(turns)),
            **{f"multi_turn/{k}": counts.get(k, 0.0) for k in (*_INFO_COUNTS.values(), "env_errors", "overflow")},
            **{f"multi_turn/ended_by_{r}": float(sum(t.end == r for t in trajectories)) for r in _END_REASONS},
            "multi_turn/masked_token_share": masked / tokens if tokens else 0.0,
        }
        return RolloutOutput(
            response_ids=[t.response_ids for t in trajectories],
            finish_reasons=[t.finish_reason for t in trajectories],
            prompt_index=[t.prompt_index for t in trajectories],
            log_probs=[t.log_probs for t in trajectories] if params.logprobs else None,
            metrics=metrics,
            response_masks=[t.mask for t in trajectories],
            prompts=[t.prompt_ids for t in trajectories],
            step_rewards=[t.step_rewards for t in trajectories],
            solutions=[t.solution for t in trajectories],
            transcripts=[t.messages for t in trajectories],
        )


_END_REASONS = ("done", "turn_cap", "length", "timeout")


def _last_turn_length(t: _Trajectory) -> int:
    """Tokens of the trajectory's last sampled turn (the trailing run of mask 1)."""
    k = 0
    for m in reversed(t.mask):
        if m != 1:
            break
        k += 1
    return k


def _same_messages(a: Sequence[Mapping[str, Any]], b: Any) -> bool:
    try:
        other = _messages(b)
    except TypeError:
        return False
    if len(a) != len(other):
        return False
    return all(x.get("role") == y.get("role") and x.get("content") == y.get("content") for x, y in zip(a, other))
