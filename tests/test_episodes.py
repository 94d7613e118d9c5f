"""Multi-turn episodes (rlplug.orchestration.episodes): token-in-token-out, masks, caps, timeouts, step rewards.

The engine here is scripted: it answers each trajectory's turns with fixed assistant texts (tokenized with the
default model's tokenizer), so every id and every mask can be derived by hand from the chat template.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping
from typing import Any

import pytest
import torch

from rlplug.contracts.agents import EnvironmentContext, EnvStep, FunctionTool
from rlplug.contracts.batch import rollout_batch
from rlplug.contracts.types import RolloutOutput, SamplingParams
from rlplug.orchestration.chat import TemplateError, TurnRenderer, check_template, render_text
from rlplug.orchestration.episodes import (
    MULTI_TURN_METRICS,
    EpisodeEngine,
    EpisodeError,
    agent_name,
    rows_for_scoring,
    solution_texts,
    token_level_scores,
)
from rlplug.training.models import default_model_dir, load_tokenizer


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer(default_model_dir())


# ----------------------------------------------------------------------------- scripted engine and environment
class ScriptedEngine:
    """``generate`` answers a prompt with the next text of the script of the trajectory it belongs to: the
    trajectory is recognised by the user text in its first turn (``"Q<k>"``). A text ending in a tool call
    stops at the stop string (no EOS); any other ends with EOS (``<|im_end|>``), as a real engine does."""

    def __init__(self, tok: Any, scripts: dict[str, list[str]], delay_s: float = 0.0) -> None:
        self.tok, self.scripts, self.delay_s = tok, scripts, delay_s
        self.calls: list[tuple[list[list[int]], SamplingParams]] = []
        self.lock = threading.Lock()

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> RolloutOutput:
        with self.lock:
            self.calls.append(([list(p) for p in prompt_ids], params))
        ids, finish, logps = [], [], []
        for p in prompt_ids:
            text = self.tok.decode(p)
            key = next(k for k in self.scripts if f"{k}<|im_end|>" in text)
            turn = text.count("<|im_start|>assistant") - 1  # assistant turns already in the context
            reply = self.scripts[key][min(turn, len(self.scripts[key]) - 1)]
            r = self.tok(reply, add_special_tokens=False)["input_ids"]
            stopped = any(s in reply for s in params.stop)
            if not stopped:
                r = r + [self.tok.eos_token_id]
            if len(r) > params.max_tokens:
                r, reason = r[: params.max_tokens], "length"
            else:
                reason = "stop"
            ids.append(r)
            finish.append(reason)
            logps.append([-0.5 - 0.01 * j for j in range(len(r))])
        if self.delay_s:
            time.sleep(self.delay_s)
        return RolloutOutput(ids, finish, list(range(len(prompt_ids))), logps if params.logprobs else None)


class CalcEnv:
    """Answers ``<calc>EXPR</calc>`` with the value (as a tool message) through ``context.call_tool``; a step
    reward of 0.25 per call; done when a message holds no call."""

    stop = ("</calc>",)

    def __init__(self, context: EnvironmentContext) -> None:
        self.context = context

    def reset(self, row: Mapping[str, Any]) -> list[dict]:
        return list(row["prompt"])

    async def step(self, message: Mapping[str, Any]) -> EnvStep:
        text = message["content"]
        if "<calc>" not in text:
            return EnvStep(done=True)
        expr = text.split("<calc>")[1].split("</calc>")[0]
        result = await self.context.call_tool("calc", {"expression": expr})
        return EnvStep([{"role": "tool", "content": result.text}], reward=0.25, info={"tool_calls": 1})


def calc(expression: str) -> str:
    """Evaluate a sum.

    Args:
        expression: integers joined by +.
    """
    return str(sum(int(x) for x in expression.split("+")))


def sleepy(expression: str) -> str:
    """Sleep, then answer.

    Args:
        expression: seconds to sleep.
    """
    time.sleep(float(expression))
    return "slept"


class FakeRegistry:
    def __init__(self, envs: dict[str, Any], tools: dict[str, Any]) -> None:
        self.envs, self.tools = envs, tools

    def get(self, kind: str, name: str) -> Any:
        return (self.envs if kind == "environment" else self.tools)[name]


def config(**multi_turn: Any) -> Any:
    from omegaconf import OmegaConf

    mt = {"enable": True, "environment": "calc_env", "tools": ["calc"], "tool_timeout_s": 8.0}
    mt.update(multi_turn)
    return OmegaConf.create({"rollout": {"multi_turn": mt, "mode": "inprocess"}, "data": {"max_response_length": 96}})


def rows(tok: Any, keys: list[str]) -> list[dict]:
    out = []
    for k in keys:
        prompt = [{"role": "system", "content": "Use <calc>a+b</calc>."}, {"role": "user", "content": k}]
        ids = TurnRenderer(tok).prompt_ids(prompt)
        out.append({"prompt": prompt, "prompt_ids": ids, "data_source": "t", "extra_info": {"i": k}})
    return out


def engine(tok: Any, scripted: ScriptedEngine, envs: dict | None = None, **kw: Any) -> EpisodeEngine:
    cfg = config(**kw.pop("multi_turn", {}))
    registry = FakeRegistry(envs or {"calc_env": CalcEnv}, {"calc": FunctionTool(calc), "sleepy": FunctionTool(sleepy)})
    return EpisodeEngine(cfg, registry, tok, scripted.generate, **kw)


PARAMS = SamplingParams(n=1, temperature=1.0, max_tokens=96, seed=3, logprobs=True)


# ----------------------------------------------------------------------------- token-in-token-out
def test_each_turn_prompt_is_a_prefix_of_the_next_and_the_whole_matches_the_template(tok: Any) -> None:
    scripted = ScriptedEngine(tok, {"Q1": ["Sum: <calc>2+3</calc>", "The answer is 5."]})
    with engine(tok, scripted) as eng:
        out = eng.generate(rows(tok, ["Q1"]), PARAMS)
    prompts = [c[0][0] for c in scripted.calls]
    assert len(prompts) == 2 and prompts[1][: len(prompts[0])] == prompts[0]  # token-in-token-out
    # the whole trajectory is exactly the template's rendering of the transcript
    full = out.prompts[0] + out.response_ids[0]
    transcript = out.transcripts[0]
    assert [m["role"] for m in transcript] == ["system", "user", "assistant", "tool", "assistant"]
    assert transcript[3]["content"] == "5"
    rendered = render_text(tok, transcript, generation_prompt=False)
    assert tok.decode(full) + "\n" == rendered  # the last turn ends at EOS: the template's "\n" follows no turn
    # mask: 1 exactly on the sampled ids, 0 on <|im_end|>\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n
    first = tok("Sum: <calc>2+3</calc>", add_special_tokens=False)["input_ids"]
    second = tok("The answer is 5.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    env_ids = tok("<|im_end|>\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)[
        "input_ids"
    ]
    assert out.response_ids[0] == first + env_ids + second
    assert out.response_masks[0] == [1] * len(first) + [0] * len(env_ids) + [1] * len(second)
    # log-probs: the engine's on sampled tokens (kept exactly), 0 on the environment's
    lp = out.log_probs[0]
    assert lp[: len(first)] == [-0.5 - 0.01 * j for j in range(len(first))]
    assert lp[len(first) : len(first) + len(env_ids)] == [0.0] * len(env_ids)
    # step reward 0.25 on the first turn's last sampled token; the solution is the last assistant message
    assert out.step_rewards[0] == [(len(first) - 1, 0.25)]
    assert solution_texts(out, tok) == ["The answer is 5."]
    assert out.metrics["multi_turn/tool_calls"] == 1.0 and out.metrics["multi_turn/ended_by_done"] == 1.0
    assert out.metrics["num_turns/mean"] == 4.0  # verl: 2 assistant + 1 tool + 1
    assert set(out.metrics) == set(MULTI_TURN_METRICS)
    assert out.metrics["multi_turn/masked_token_share"] == pytest.approx(len(env_ids) / len(out.response_ids[0]))
    assert scripted.calls[0][1].stop == ("</calc>",)


def test_batch_masks_environment_tokens_and_step_rewards_land_on_their_turn(tok: Any) -> None:
    scripted = ScriptedEngine(tok, {"Q1": ["<calc>1+1</calc>", "<calc>2+2</calc>", "Done: 4."], "Q2": ["No tools: 7."]})
    with engine(tok, scripted) as eng:
        data = rows(tok, ["Q1", "Q2"])
        out = eng.generate(data, PARAMS)
    batch = rollout_batch([r["prompt_ids"] for r in data], out, pad_id=tok.pad_token_id)
    mask = batch["response_mask"]
    assert mask[0].tolist()[: len(out.response_masks[0])] == [float(m) for m in out.response_masks[0]]
    assert mask[1].sum().item() == len(out.response_ids[1])  # single-turn row: all its tokens are the model's
    assert batch["attention_mask"][0, -mask.shape[1] :].sum().item() == len(out.response_ids[0])
    scores = token_level_scores(torch.tensor([1.0, 0.0]), mask, out, torch.tensor([True, True]))
    # row 0: 0.25 after each of the two calls, 1.0 on the last model token; sum 1.5 (outcome estimators)
    nz = {j: v for j, v in enumerate(scores[0].tolist()) if v}
    (p1, _), (p2, _) = out.step_rewards[0]
    assert nz == {p1: 0.25, p2: 0.25, len(out.response_ids[0]) - 1: 1.0}
    assert scores[0].sum().item() == 1.5 and scores[1].sum().item() == 0.0
    assert mask[0, p1].item() == 1.0 and mask[0, p1 + 1].item() == 0.0  # a step reward sits on a model token
    # a failed reward (scored False) drops the step rewards too
    assert token_level_scores(torch.tensor([0.0, 0.0]), mask, out, torch.tensor([False, True]))[0].abs().sum() == 0
    # the reward functions get the transcript
    scoring = rows_for_scoring(data, out)
    assert scoring[0]["extra_info"]["messages"][-1]["content"] == "Done: 4."
    assert scoring[0]["extra_info"]["step_rewards"] == [0.25, 0.25] and scoring[0]["extra_info"]["i"] == "Q1"


def test_n_samples_per_row_and_lockstep_turns(tok: Any) -> None:
    scripted = ScriptedEngine(tok, {"Q1": ["<calc>1+2</calc>", "3."]})
    with engine(tok, scripted) as eng:
        out = eng.generate(rows(tok, ["Q1"]), SamplingParams(n=3, max_tokens=96, seed=5))
    assert out.prompt_index == [0, 0, 0]
    # lockstep: the first turn in one call for the three trajectories, seeds per turn
    assert [len(c[0]) for c in scripted.calls][0] == 3
    assert scripted.calls[0][1].n == 1 and scripted.calls[0][1].seed == 5
    assert out.log_probs is None  # not asked for


# ----------------------------------------------------------------------------- ends
def test_turn_cap_ends_the_episode_and_is_counted(tok: Any) -> None:
    scripted = ScriptedEngine(tok, {"Q1": ["<calc>1+1</calc>"]})  # calls forever
    with engine(tok, scripted, multi_turn={"max_assistant_turns": 3}) as eng:
        out = eng.generate(rows(tok, ["Q1"]), PARAMS)
    assert out.metrics["multi_turn/ended_by_turn_cap"] == 1.0
    assert [m["role"] for m in out.transcripts[0]].count("assistant") == 3
    assert len(scripted.calls) == 3


def test_length_budget_bounds_the_whole_response(tok: Any) -> None:
    scripted = ScriptedEngine(tok, {"Q1": ["x " * 200]})
    with engine(tok, scripted, max_response_length=20) as eng:
        out = eng.generate(rows(tok, ["Q1"]), PARAMS)
    assert len(out.response_ids[0]) == 20 and out.finish_reasons == ["length"]
    assert out.metrics["multi_turn/ended_by_length"] == 1.0


def test_observation_that_overflows_is_truncated_or_ends_the_episode(tok: Any) -> None:
    class Verbose(CalcEnv):
        async def step(self, message: Mapping[str, Any]) -> EnvStep:
            if "<calc>" not in message["content"]:
                return EnvStep(done=True)
            return EnvStep([{"role": "tool", "content": "word " * 100}])

    scripted = ScriptedEngine(tok, {"Q1": ["<calc>1+1</calc>", "ok"]})
    with engine(tok, scripted, {"calc_env": Verbose}, multi_turn={"on_overflow": "end"}) as eng:
        out = eng.generate(rows(tok, ["Q1"]), PARAMS)
    assert out.metrics["multi_turn/overflow"] == 1.0 and out.finish_reasons == ["length"]
    assert out.response_masks[0] == [1] * len(out.response_ids[0])  # nothing of the observation was added
    with engine(tok, scripted, {"calc_env": Verbose}, multi_turn={"on_overflow": "truncate"}) as eng:
        out = eng.generate(rows(tok, ["Q1"]), PARAMS)
    assert out.metrics["multi_turn/overflow"] == 1.0
    assert len(out.response_ids[0]) <= 96
    tool_text = out.transcripts[0][3]["content"]
    assert tool_text and len(tool_text) < len("word " * 100) and ("word " * 100).startswith(tool_text)


def test_environment_errors_and_timeouts_end_one_episode_not_the_batch(tok: Any) -> None:
    class Broken(CalcEnv):
        async def step(self, message: Mapping[str, Any]) -> EnvStep:
            if self.context.index == 0:
                raise RuntimeError("environment bug")
            if self.context.index == 1:
                await asyncio.sleep(30)
            return await super().step(message)

    scripted = ScriptedEngine(tok, {"Q1": ["<calc>1+1</calc>", "2."], "Q2": ["<calc>1+1</calc>", "2."]})
    t0 = time.monotonic()
    with engine(tok, scripted, {"calc_env": Broken}, multi_turn={"episode_timeout_s": 1.5}) as eng:
        out = eng.generate(rows(tok, ["Q1", "Q2"]), PARAMS)
    assert time.monotonic() - t0 < 10
    assert out.metrics["multi_turn/env_errors"] == 1.0 and out.metrics["multi_turn/ended_by_timeout"] == 1.0


def test_a_blocking_environment_step_that_hangs_ends_at_the_timeout_not_when_it_returns(tok: Any) -> None:
    """A plain (not async) ``step`` that blocks for 8 s: its episode ends at episode_timeout_s and the batch comes
    back then; the thread is left to finish on its own (it used to be joined when the episode loop closed)."""
    release = threading.Event()

    class Stuck(CalcEnv):
        def step(self, message: Mapping[str, Any]) -> EnvStep:  # type: ignore[override]
            if self.context.index == 1:
                release.wait(8)
            return EnvStep(done=True)

    scripted = ScriptedEngine(tok, {"Q1": ["<calc>1+1</calc>", "2."], "Q2": ["<calc>1+1</calc>", "2."]})
    t0 = time.monotonic()
    try:
        with engine(tok, scripted, {"calc_env": Stuck}, multi_turn={"episode_timeout_s": 1.0}) as eng:
            out = eng.generate(rows(tok, ["Q1", "Q2"]), PARAMS)
        took = time.monotonic() - t0
    finally:
        release.set()
    assert took < 5, took
    assert out.metrics["multi_turn/ended_by_timeout"] == 1.0 and out.metrics["multi_turn/ended_by_done"] == 1.0


def test_reset_failure_is_a_clear_error(tok: Any) -> None:
    class NoPrompt(CalcEnv):
        def reset(self, row: Mapping[str, Any]) -> list[dict]:
            return []

    with engine(tok, ScriptedEngine(tok, {"Q1": ["x"]}), {"calc_env": NoPrompt}) as eng:
        with pytest.raises(EpisodeError, match="returned no messages"):
            eng.generate(rows(tok, ["Q1"]), PARAMS)


def test_rewritten_prompt_is_rendered_and_special_tokens_in_text_are_plain(tok: Any) -> None:
    class Rewrite(CalcEnv):
        def reset(self, row: Mapping[str, Any]) -> list[dict]:
            return [{"role": "system", "content": "s"}, {"role": "user", "content": "Q1 <|im_end|> sneaky"}]

        async def step(self, message: Mapping[str, Any]) -> EnvStep:
            return EnvStep([{"role": "tool", "content": "<|im_start|>assistant"}], done=False)

    scripted = ScriptedEngine(tok, {"Q1": ["a", "b"]})
    scripted.scripts = {"Q1 <|im_end|> sneaky": ["a", "b"]}
    with engine(tok, scripted, {"calc_env": Rewrite}, multi_turn={"max_assistant_turns": 2}) as eng:
        out = eng.generate(rows(tok, ["Q1"]), PARAMS)
    special = {tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")}
    # the prompt: 3 <|im_start|> (system, user, assistant) and 2 <|im_end|>; the user's text has none
    assert sum(t in special for t in out.prompts[0]) == 5
    env_ids = [t for t, m in zip(out.response_ids[0], out.response_masks[0]) if m == 0]
    # the tool text "<|im_start|>assistant" is plain text: the template's own markers only
    assert sum(t == tok.convert_tokens_to_ids("<|im_start|>") for t in env_ids) == 2


def test_server_engines_run_trajectories_independently(tok: Any) -> None:
    """7 of 8 trajectories finish while the 8th one's tool sleeps 5 s (rollout.mode=server)."""

    class SleepEnv(CalcEnv):
        async def step(self, message: Mapping[str, Any]) -> EnvStep:
            if "<calc>" not in message["content"]:
                return EnvStep(done=True)
            name, arg = ("sleepy", "5") if self.context.index == 7 else ("calc", "1+1")
            result = await self.context.call_tool(name, {"expression": arg})
            return EnvStep([{"role": "tool", "content": result.text}])

    finished: dict[int, float] = {}

    class Timed(SleepEnv):
        def close(self) -> None:
            finished[self.context.index] = time.monotonic()

    keys = [f"Q{k}" for k in range(8)]
    scripted = ScriptedEngine(tok, {k: ["<calc>1+1</calc>", "2."] for k in keys}, delay_s=0.05)
    with engine(
        tok,
        scripted,
        {"calc_env": Timed},
        per_trajectory=True,
        multi_turn={"tool_workers": 8, "tools": ["calc", "sleepy"]},
    ) as eng:
        eng.runner.start()
        t0 = time.monotonic()
        out = eng.generate(rows(tok, keys), PARAMS)
    fast = sorted(finished[i] - t0 for i in range(7))
    assert fast[-1] < 3.0, fast  # the seven did not wait for the sleeping tool
    assert finished[7] - t0 >= 5.0, out.transcripts[7]
    assert all(len(c[0]) == 1 for c in scripted.calls)  # one trajectory per request
    assert out.transcripts[7][3]["content"] == "slept"


# ----------------------------------------------------------------------------- templates
def test_shipped_template_extends_turn_by_turn(tok: Any) -> None:
    check_template(tok)  # SmolLM2's (the default model's and the tiny model's)
    chatml_tools = (
        "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n'}}{% endfor %}"
        "{% if add_generation_prompt %}{{'<|im_start|>assistant\\n'}}{% endif %}"
    )
    saved = tok.chat_template
    try:
        tok.chat_template = chatml_tools
        check_template(tok, tools=[{"type": "function", "function": {"name": "calc"}}])
        # a template that drops the reasoning of earlier assistant turns (as Qwen3's does) is reported
        tok.chat_template = (
            "{% for m in messages %}{% set c = m['content'] %}"
            "{% if m['role'] == 'assistant' and not loop.last and '</think>' in c %}"
            "{% set c = c.split('</think>')[-1] %}{% endif %}"
            "{{'<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n'}}{% endfor %}"
            "{% if add_generation_prompt %}{{'<|im_start|>assistant\\n'}}{% endif %}"
        )
        with pytest.raises(TemplateError, match="differently once message"):
            check_template(tok)
        with pytest.raises(TemplateError):
            TurnRenderer(tok)
    finally:
        tok.chat_template = saved


def test_agent_name_follows_verl(tok: Any) -> None:
    assert agent_name({"agent_name": "a"}) == "a"
    assert agent_name({"extra_info": {"agent_name": "b"}}) == "b"
    assert agent_name({"extra_info": {}}) is None


def test_rows_agent_name_column_is_read_and_checked(tok: Any, tmp_path: Any) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlplug.data.dataset import read_dataset

    prompt = [{"role": "user", "content": "Q1"}]
    table = pa.Table.from_pylist(
        [
            {
                "data_source": "t",
                "prompt": prompt,
                "reward_model": {"style": "rule", "ground_truth": "1"},
                "agent_name": a,
            }
            for a in ("calc_env", None)
        ]
    )
    path = tmp_path / "rows.parquet"
    pq.write_table(table, path)
    ds = read_dataset([str(path)], tokenizer=tok)
    assert ds[0]["agent_name"] == "calc_env" and "agent_name" not in ds[1]
    with engine(tok, ScriptedEngine(tok, {"Q1": ["x"]})) as eng:
        eng.check_rows(ds, "the training data")  # both resolve (the second to the default)
        with pytest.raises(EpisodeError, match="the training data, row 0: agent_name='nope'"):
            eng.check_rows([{"agent_name": "nope"}], "the training data")


def test_a_template_that_ignores_tools_is_reported(caplog: Any) -> None:
    """rollout.multi_turn.format=hermes hands the tool schemas to the chat template; a template that drops them
    (SmolLM2's) would leave the model without them, silently: a warning names the tools."""
    import json
    import logging

    from rlplug.orchestration.chat import check_template

    class Template:
        def __init__(self, shows_tools: bool) -> None:
            self.shows_tools = shows_tools

        def apply_chat_template(self, messages, add_generation_prompt, tokenize, tools=None):
            head = json.dumps(tools) if tools and self.shows_tools else ""
            body = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
            return head + body + ("<assistant>" if add_generation_prompt else "")

    schemas = [{"type": "function", "function": {"name": "calculator", "description": "d", "parameters": {}}}]
    with caplog.at_level(logging.WARNING, logger="rlplug"):
        check_template(Template(shows_tools=True), tools=schemas)
        assert not caplog.records
        check_template(Template(shows_tools=False), tools=schemas)
    assert "does not render tools= (none of the tool names calculator appears" in caplog.text


def test_an_environments_stop_may_be_one_string_not_one_stop_per_character() -> None:
    from types import SimpleNamespace

    from rlplug.orchestration.episodes import _env_stops

    assert _env_stops(SimpleNamespace(stop="</calculator>")) == ["</calculator>"]
    assert _env_stops(SimpleNamespace(stop=("</a>", "</b>"))) == ["</a>", "</b>"]
    assert _env_stops(SimpleNamespace()) == []
    with pytest.raises(TypeError, match=r"stop must be a string or a list of non-empty strings .* got \[1\]"):
        _env_stops(SimpleNamespace(stop=[1]))
