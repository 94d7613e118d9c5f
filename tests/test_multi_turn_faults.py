"""Fault tests of multi-turn episodes (issue 33): failing tools and misbehaving models end their call or their
episode with the right metric, the batch comes back whole, and nothing waits past the configured timeouts.

End to end below the trainer: :class:`rlplug.orchestration.episodes.EpisodeEngine` with the packaged
``tool_agent`` environment (from the real registry), a real :class:`rlplug.orchestration.tool_workers.ToolRunner`
(worker processes) and a scripted engine standing in for the model: it answers each trajectory's turns with
fixed texts, recognising the trajectory by its user message ``Q<k>``. The tools are module-level functions of
``tests/multi_turn_tools.py`` (workers unpickle them by reference).

One batch holds six trajectories, each meeting one fault on its first turn (``tags`` format):

====  ========================================  ===================================================
 Q0   ``<sleep_forever>x</sleep_forever>``       the call ends with ``timeout`` after tool_timeout_s
 Q1   ``<fail>boom</fail>``                     ``error``; the model reads ``Error: ValueError: boom``
 Q2   ``<flood>10</flood>`` (10 MiB printed)     ``ok``: the reply is ``flooded``, the output goes nowhere
 Q3   ``<die>now</die>`` (worker SIGKILLs self)  ``crash``, naming the signal; the worker is replaced
 Q4   ``<calc>1+1`` (unclosed, then EOS)         malformed: not run, the model reads how to write a call
 Q5   ``<calc>1+1</calc>`` at every turn         ended by the turn cap (max_assistant_turns = 3)
====  ========================================  ===================================================

Q0-Q4 answer ``Done.`` on their second turn (an episode goes on after a failed call). A second test runs
the ``hermes`` format with a call whose JSON does not parse, then a valid one.
"""

from __future__ import annotations

import time
from typing import Any

import multi_turn_tools as mt
import pytest

from rlplug.contracts.agents import FunctionTool
from rlplug.contracts.registry import get_registry
from rlplug.contracts.types import RolloutOutput, SamplingParams
from rlplug.orchestration.chat import TurnRenderer
from rlplug.orchestration.episodes import EpisodeEngine
from rlplug.training.models import default_model_dir, load_tokenizer

TOOL_TIMEOUT_S = 1.5
EPISODE_TIMEOUT_S = 20.0
#: seconds a call may take past its timeout (the kill, a reply over a pipe, a thread hop on a loaded machine)
SLACK_S = 2.0
TOOLS = {name: FunctionTool(getattr(mt, name)) for name in ("calc", "sleep_forever", "fail", "flood", "die")}
PARAMS = SamplingParams(n=1, temperature=1.0, max_tokens=200, seed=11, logprobs=True)


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer(default_model_dir())


class ScriptedModel:
    """``generate`` answers each prompt with the next text of its trajectory's script (the trajectory is the
    one whose user message ``Q<k>`` is in the context; the turn is the number of assistant turns already
    there). A text containing a stop string ends right after it (no EOS, as an engine honouring ``stop``
    returns it); any other text ends with EOS."""

    def __init__(self, tok: Any, scripts: dict[str, list[str]]) -> None:
        self.tok, self.scripts = tok, scripts
        self.calls = 0

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> RolloutOutput:
        self.calls += 1
        ids, finish, logps = [], [], []
        for p in prompt_ids:
            text = self.tok.decode(p)
            key = next(k for k in self.scripts if f"\n{k}<|im_end|>" in text)
            turn = text.count("<|im_start|>assistant") - 1
            reply = self.scripts[key][min(turn, len(self.scripts[key]) - 1)]
            cut = [reply.index(s) + len(s) for s in params.stop if s in reply]
            if cut:
                reply = reply[: min(cut)]
            r = self.tok(reply, add_special_tokens=False)["input_ids"]
            if not cut:
                r = [*r, self.tok.eos_token_id]
            reason = "length" if len(r) > params.max_tokens else "stop"
            r = r[: params.max_tokens]
            ids.append(r)
            finish.append(reason)
            logps.append([-1.0] * len(r))
        return RolloutOutput(ids, finish, list(range(len(prompt_ids))), logps if params.logprobs else None)


class Registry:
    """The real registry's ``tool_agent`` environment; the test tools."""

    def __init__(self) -> None:
        self.real = get_registry()

    def get(self, kind: str, name: str) -> Any:
        return TOOLS[name] if kind == "tool" else self.real.get(kind, name)


def make_engine(tok: Any, model: ScriptedModel, **multi_turn: Any) -> EpisodeEngine:
    from omegaconf import OmegaConf

    settings = {
        "enable": True,
        "environment": "tool_agent",
        "tools": list(TOOLS),
        "format": "tags",
        "tool_timeout_s": TOOL_TIMEOUT_S,
        "episode_timeout_s": EPISODE_TIMEOUT_S,
        "max_assistant_turns": 3,
        "max_user_turns": 3,
        "tool_workers": 6,
        **multi_turn,
    }
    cfg = OmegaConf.create(
        {"rollout": {"multi_turn": settings, "mode": "inprocess"}, "data": {"max_response_length": 400}}
    )
    return EpisodeEngine(cfg, Registry(), tok, model.generate)


def make_rows(tok: Any, keys: list[str], tools: Any = None) -> list[dict]:
    rows = []
    for k in keys:
        prompt = [{"role": "system", "content": "Call a tool as <NAME>ARG</NAME>."}, {"role": "user", "content": k}]
        ids = TurnRenderer(tok, tools=tools).prompt_ids(prompt)
        rows.append({"prompt": prompt, "prompt_ids": ids, "data_source": "t", "extra_info": {"key": k}})
    return rows


def record_calls(engine: EpisodeEngine) -> list[tuple[str, Any, float]]:
    """Wrap the engine's tool runner so that each call's (name, result, wall seconds) is recorded."""
    calls: list[tuple[str, Any, float]] = []
    original = engine.runner.call

    async def call(name: str, arguments: Any, **kwargs: Any) -> Any:
        t0 = time.monotonic()
        result = await original(name, arguments, **kwargs)
        calls.append((name, result, time.monotonic() - t0))
        return result

    engine.runner.call = call  # type: ignore[method-assign]
    return calls


def roles(messages: list[dict]) -> list[str]:
    return [m["role"] for m in messages]


def test_faulty_tools_and_models_end_their_call_or_episode_with_the_right_metric(tok: Any, capfd: Any) -> None:
    scripts = {
        "Q0": ["Wait. <sleep_forever>x</sleep_forever>", "Done."],
        "Q1": ["<fail>boom</fail>", "Done."],
        "Q2": ["<flood>10</flood>", "Done."],
        "Q3": ["<die>now</die>", "Done."],
        "Q4": ["<calc>1+1", "Done."],
        "Q5": ["<calc>1+1</calc>"],  # never stops calling
    }
    model = ScriptedModel(tok, scripts)
    with make_engine(tok, model) as engine:
        engine.runner.start()  # worker start-up is not what is timed
        calls = record_calls(engine)
        capfd.readouterr()
        t0 = time.monotonic()
        out = engine.generate(make_rows(tok, list(scripts)), PARAMS)
        elapsed = time.monotonic() - t0
    printed = capfd.readouterr()

    # the batch comes back whole, in order
    assert out.prompt_index == [0, 1, 2, 3, 4, 5] and len(out.response_ids) == 6
    transcripts = out.transcripts
    assert transcripts is not None
    # Q0-Q4: the failed call's message, then the model's next turn ends the episode
    for k in range(5):
        assert roles(transcripts[k]) == ["system", "user", "assistant", "tool", "assistant"], k
        assert transcripts[k][-1]["content"] == "Done."
    tool_text = [t[3]["content"] for t in transcripts]
    assert tool_text[0] == "Error: the call to tool 'sleep_forever' took longer than 1.5 s and was stopped"
    assert tool_text[1] == "Error: ValueError: boom"
    assert tool_text[2] == "flooded"
    assert tool_text[3].startswith("Error: the process running tool 'die' died by SIGKILL")
    assert tool_text[4].startswith("calc: the call <calc> is not closed") and "<calc>ARGUMENT</calc>" in tool_text[4]
    # Q5: three turns, each a call; the third call's reply is not added (no fourth turn reads it)
    assert roles(transcripts[5]) == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert [m["content"] for m in transcripts[5] if m["role"] == "tool"] == ["2", "2"]

    m = out.metrics
    assert m["multi_turn/tool_timeouts"] == 1.0
    assert m["multi_turn/tool_crashes"] == 1.0
    assert m["multi_turn/malformed_calls"] == 1.0
    assert m["multi_turn/tool_errors"] == 2.0  # the raising tool and the malformed call
    assert m["multi_turn/tool_calls"] == 8.0  # one each for Q0-Q4, three for Q5
    assert m["multi_turn/ended_by_turn_cap"] == 1.0 and m["multi_turn/ended_by_done"] == 5.0
    assert m["multi_turn/ended_by_timeout"] == 0.0 and m["multi_turn/ended_by_length"] == 0.0
    assert m["multi_turn/turns_mean"] == (5 * 2 + 3) / 6 and m["multi_turn/turns_max"] == 3.0
    assert m["multi_turn/env_errors"] == 0.0

    # what ran: the malformed call was not run; statuses and times as configured
    status = {name: result.status for name, result, _ in calls if name != "calc"}
    assert status == {"sleep_forever": "timeout", "fail": "error", "flood": "ok", "die": "crash"}
    # Q5's three calls (the third runs, for its step's reward and counts, though the cap drops its reply); Q4's
    # unclosed call never ran
    assert [name for name, _, _ in calls].count("calc") == 3
    seconds = {name: s for name, _, s in calls}
    assert TOOL_TIMEOUT_S <= seconds["sleep_forever"] < TOOL_TIMEOUT_S + SLACK_S, seconds
    assert max(s for n, s in seconds.items() if n != "sleep_forever") < TOOL_TIMEOUT_S + SLACK_S, seconds
    # the whole batch: two rounds of calls (the second round has only Q5's) plus generation
    assert elapsed < 2 * TOOL_TIMEOUT_S + 2 * SLACK_S, elapsed
    # 10 MiB printed to each stream by the tool: none of it reached this process's output
    assert len(printed.out) + len(printed.err) < 10_000, (len(printed.out), len(printed.err))
    # the turn that was never closed got EOS; every other failed turn was a whole stop-string-ended call
    assert out.response_masks is not None and all(m_[0] == 1 for m_ in out.response_masks)


#: a ChatML template that renders the tool schemas in a system turn of their own (as Qwen2.5's and Hermes'
#: templates do; SmolLM2's ignores them)
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\\n'}}{% endif %}"
)


@pytest.mark.parametrize(
    "template",
    [
        None,
        TOOLS_TEMPLATE,
    ],
    ids=["smollm2", "tools_in_template"],
)
def test_hermes_malformed_json_is_counted_and_the_model_may_try_again(tok: Any, template: str | None) -> None:
    saved = tok.chat_template
    if template is not None:
        tok.chat_template = template
    try:
        _hermes_malformed_then_valid(tok)
    finally:
        tok.chat_template = saved


def _hermes_malformed_then_valid(tok: Any) -> None:
    bad = '<tool_call>{"name": "calc", "arguments": {"expression": "1+1"</tool_call>'
    good = '<tool_call>{"name": "calc", "arguments": {"expression": "2+3"}}</tool_call>'
    model = ScriptedModel(tok, {"Q0": [bad, good, "Five."], "Q1": ["No call: 4."]})
    with make_engine(tok, model, format="hermes", tools=["calc"]) as engine:
        t0 = time.monotonic()
        out = engine.generate(make_rows(tok, ["Q0", "Q1"], tools=engine.renderer.tools), PARAMS)
        elapsed = time.monotonic() - t0
    transcripts = out.transcripts
    assert transcripts is not None
    assert roles(transcripts[0]) == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert transcripts[0][3]["content"].startswith("the tool call is not valid JSON")
    assert transcripts[0][5]["content"] == "5"
    assert roles(transcripts[1]) == ["system", "user", "assistant"]
    m = out.metrics
    assert m["multi_turn/malformed_calls"] == 1.0 and m["multi_turn/tool_errors"] == 1.0
    assert m["multi_turn/tool_calls"] == 2.0 and m["multi_turn/ended_by_done"] == 2.0
    assert elapsed < TOOL_TIMEOUT_S + 30.0  # one worker's start (torch-free) and one call
