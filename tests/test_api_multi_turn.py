"""``rlplug.train(tools=..., environment_factory=...)`` as TRL's GRPOTrainer takes them (issue 33): the
adapters of :mod:`rlplug.orchestration.python_env` driven directly (reset / step with an in-process
``call_tool``), the registrations and config :func:`rlplug.train` makes, two tiny training steps through the
episode engine (the random model, and a scripted policy that calls a tool), and the tool-call parser against
the ``tool_agent`` plugin's."""

from __future__ import annotations

import asyncio
import json

import pytest

from rlplug.api import _multi_turn_settings, build_config, register_environment, register_tools
from rlplug.config.schema import ConfigError
from rlplug.conformance import environment_context
from rlplug.contracts.agents import FunctionTool
from rlplug.contracts.registry import get_registry
from rlplug.orchestration.python_env import TRLEnvironmentFactory, parse_tool_calls, trl_example


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


class Counter:
    """A TRL-style environment: state across tool calls, a reward read from it."""

    def __init__(self) -> None:
        self.total = 0
        self.target = 0
        self.seen: dict = {}

    def reset(self, **example):
        self.seen = example
        self.target = int(example["target"])
        return f" Reach {self.target}."

    def add(self, n: int) -> str:
        """Add n to the counter.

        Args:
            n: how much to add
        """
        self.total += n
        return str(self.total)

    def get_reward(self) -> float:
        return 1.0 if self.total == self.target else 0.0

    def _helper(self) -> None:  # private: not a tool
        pass


def _call(name, **arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


ROW = {
    "data_source": "trl",
    "prompt": [{"role": "user", "content": "Count."}],
    "reward_model": {"style": "rule", "ground_truth": "5"},
    "extra_info": {"prompt": [{"role": "user", "content": "Count."}], "target": 5, "level": "easy"},
}


def _episode(settings=None, tools=None):
    factory = TRLEnvironmentFactory(Counter)
    ctx = environment_context(tools, {"format": "hermes", **(settings or {})})
    return factory, factory(ctx)


# ---------------------------------------------------------------------------- the environment adapter


def test_reset_gets_the_rows_columns_and_appends_its_string_to_the_prompt():
    factory, env = _episode()
    assert factory.name == "Counter" and factory.tool_names == ["add"] and factory.has_reward
    messages = asyncio.run(env.reset(ROW))
    assert messages == [{"role": "user", "content": "Count. Reach 5."}]
    assert env.instance.seen == {"prompt": [{"role": "user", "content": "Count."}], "target": 5, "level": "easy"}
    assert trl_example({"prompt": "p", "extra_info": None}) == {"prompt": "p"}


def test_method_calls_share_the_instance_and_get_reward_scores_the_end():
    _, env = _episode({"max_assistant_turns": 5, "max_user_turns": 5})
    asyncio.run(env.reset(ROW))
    step = asyncio.run(env.step({"role": "assistant", "content": _call("add", n=2)}))
    assert not step.done and step.reward is None
    assert list(step.observations) == [{"role": "tool", "name": "add", "content": "2"}]
    step = asyncio.run(env.step({"role": "assistant", "content": "more " + _call("add", n=3)}))
    assert list(step.observations) == [{"role": "tool", "name": "add", "content": "5"}]
    final = asyncio.run(env.step({"role": "assistant", "content": "The total is 5."}))
    assert final.done and final.reward == 1.0 and final.observations == ()
    assert env.rewards == [1.0]


def test_the_turn_cap_ends_the_episode_without_running_its_calls():
    _, env = _episode({"max_assistant_turns": 2})
    asyncio.run(env.reset(ROW))
    asyncio.run(env.step({"role": "assistant", "content": _call("add", n=2)}))
    final = asyncio.run(env.step({"role": "assistant", "content": _call("add", n=3)}))
    assert final.done and env.instance.total == 2 and final.reward == 0.0
    assert final.info["tool_calls_not_run"] == 1


def test_bad_calls_become_messages_and_standalone_tools_go_through_call_tool():
    _, env = _episode({"max_parallel_calls": 3}, tools=[FunctionTool(multiply)])
    asyncio.run(env.reset(ROW))
    assert set(env.tools) == {"add", "multiply"}
    text = _call("multiply", a=6, b=7) + _call("add", n="x") + "<tool_call>{not json</tool_call>"
    step = asyncio.run(env.step({"role": "assistant", "content": text}))
    contents = [m["content"] for m in step.observations]
    assert contents[0] == "42"  # the standalone tool, through the context's call_tool
    assert contents[1] == "add: argument 'n' must be an integer, got a string 'x'"
    assert "is not valid JSON" in contents[2]
    assert step.info["tool_statuses"] == ["ok", "bad_arguments", "bad_arguments"]
    assert env.instance.total == 0
    step = asyncio.run(env.step({"role": "assistant", "content": _call("nope")}))
    assert "unknown tool 'nope'" in step.observations[0]["content"]


def test_calls_past_max_parallel_calls_are_not_run():
    _, env = _episode({"max_parallel_calls": 1})
    asyncio.run(env.reset(ROW))
    step = asyncio.run(env.step({"role": "assistant", "content": _call("add", n=1) + _call("add", n=1)}))
    assert env.instance.total == 1 and "at most 1 tool call" in step.observations[1]["content"]


def test_a_long_reply_is_cut_and_a_raising_method_is_a_message():
    class Talker:
        def reset(self, **example):
            return None

        def shout(self, word: str) -> str:
            """Repeat a word.

            Args:
                word: the word
            """
            if word == "boom":
                raise RuntimeError("exploded")
            return word * 100

    env = TRLEnvironmentFactory(Talker)(environment_context(None, {"format": "tags", "max_tool_response_length": 8}))
    assert asyncio.run(env.reset(ROW)) == [{"role": "user", "content": "Count."}]  # None: the prompt as it is
    step = asyncio.run(env.step({"role": "assistant", "content": "<shout>ab</shout>"}))
    assert step.observations[0]["content"] == "abababab"
    step = asyncio.run(env.step({"role": "assistant", "content": "<shout>boom</shout>"}))
    assert step.observations[0]["content"] == "shout: R"  # "shout: RuntimeError: exploded", cut to 8 characters
    final = asyncio.run(env.step({"role": "assistant", "content": "done"}))
    assert final.done and final.reward is None  # no get_reward: the reward functions score alone


def test_parse_tool_calls():
    tools = {"add": FunctionTool(Counter().add), "multiply": FunctionTool(multiply)}
    calls = parse_tool_calls('x <tool_call>{"name": "add", "arguments": "{\\"n\\": 2}"}</tool_call>', "hermes", tools)
    assert [(c.name, c.arguments) for c in calls] == [("add", {"n": 2})]
    calls = parse_tool_calls("<multiply>3</multiply> <add>4</add>", "tags", tools)
    assert [(c.name, c.arguments) for c in calls] == [("multiply", None), ("add", {"n": "4"})]
    assert "takes 2: a, b" in calls[0].error
    with pytest.raises(ValueError, match="use hermes or tags"):
        parse_tool_calls("", "llama3_json", tools)


def test_an_environment_that_cannot_be_described_is_refused():
    class NoReset:
        def add(self, n: int) -> int:
            """Add."""
            return n

    class Undocumented:
        def reset(self, **example):
            return None

        def act(self, n):
            return n

    with pytest.raises(ConfigError, match=r"must define a callable reset"):
        register_environment(NoReset)
    with pytest.raises(ConfigError, match=r"Undocumented\.act: every public method .* no type annotation"):
        register_environment(Undocumented)
    with pytest.raises(ConfigError, match=r"TRL's dict of environments"):
        register_environment({"a": Counter})


# ---------------------------------------------------------------------------- what train() registers and sets


def test_train_registers_the_tools_and_the_environment_and_selects_them():
    cfg = build_config(["debug=tiny"])
    _multi_turn_settings(cfg, ["debug=tiny"], [multiply], Counter, no_reward_funcs=True)
    mt = cfg.rollout.multi_turn
    assert (mt.enable, list(mt.tools), mt.environment, mt.format) == (True, ["multiply"], "Counter", "hermes")
    registry = get_registry()
    assert registry.registration("tool", "multiply").distribution == "rlplug.train"
    assert isinstance(registry.get("environment", "Counter"), TRLEnvironmentFactory)
    # get_reward() alone scores: the data's reward function adds 0
    assert cfg.reward.default == "environment_reward_only" and dict(cfg.reward.reward_fn_map) == {}
    assert registry.get("reward_function", "environment_reward_only")("trl", "x", "5", {}) == 0.0
    # the config's format wins over the API's default; registering again replaces this process's entries
    cfg = build_config(["debug=tiny", "rollout.multi_turn.format=tags"])
    _multi_turn_settings(cfg, ["debug=tiny", "rollout.multi_turn.format=tags"], [multiply], None, True)
    assert cfg.rollout.multi_turn.format == "tags" and cfg.rollout.multi_turn.environment == "tool_agent"
    assert _multi_turn_settings is not None and register_tools(["calculator"]) == ["calculator"]


def test_a_tool_name_taken_twice_is_refused():
    def add(n: int) -> int:
        """Add."""
        return n

    with pytest.raises(ConfigError, match=r"two tools are named 'multiply'"):
        register_tools([multiply, multiply])
    with pytest.raises(ConfigError, match=r"Counter's method\(s\) add share the name of a tool"):
        _multi_turn_settings(build_config(["debug=tiny"]), [], [add], Counter, True)
    with pytest.raises(ConfigError, match=r"train\(tools\[0\]\): .*no type annotation"):
        register_tools([lambda x: x])


TINY_TRAIN = [
    "algorithm=grpo",
    "rollout.n=2",
    "trainer.total_training_steps=2",
    "actor.ppo_mini_batch_size=2",
    "actor.micro_batch_size_per_device=2",
    "trainer.logger=[console]",
    "data.max_response_length=64",
]


def _brevity(completions, **kwargs):
    """TRL's contract: -characters / 100."""
    return [-len(str(c)) / 100 for c in completions]


def test_train_with_tools_and_an_environment_factory_runs_two_tiny_steps(tmp_path):
    """The tiny random model through the real engine: its turns run into the length cap (no tool call)."""
    from _helpers import TINY_CPU_RUN

    import rlplug

    ds = {"prompt": ["Count to 5 with add.", "Count to 3 with add."], "target": [5, 3]}
    result = rlplug.train(
        [*TINY_CPU_RUN, *TINY_TRAIN, f"trainer.default_local_dir={tmp_path}"],
        train_dataset=ds,
        reward_funcs=[_brevity],
        tools=[multiply],
        environment_factory=Counter,
    )
    assert result.status == "finished" and result.global_step == 2
    assert [r["step"] for r in result.history if "multi_turn/turns_mean" in r] == [1, 2]
    m = result.metrics
    # 2 prompts x rollout.n=2 trajectories, each ended after its first turn (length 64 or the model's EOS)
    assert m["multi_turn/ended_by_length"] + m["multi_turn/ended_by_done"] == 4.0
    assert m["multi_turn/turns_mean"] == 1.0


from rlplug.orchestration.episodes import EpisodeEngine as _REAL_ENGINE


class _ScriptedEngine:
    """Wraps the trainer's :class:`EpisodeEngine` so that its rollout generates the real tiny model's turn and
    then replaces the ids with a script (turn 0: a hermes call ``add(n=5)`` in even trajectories, ``add(n=3)``
    in odd ones; turn 1: ``Done.``), each ended by
    EOS; the log-probs are zeros (used only by the optional importance-sampling correction, off here)."""

    def __new__(cls, config, registry, tokenizer, generate, **kwargs):
        from rlplug.contracts.types import RolloutOutput

        calls = {"k": 0}

        def scripted(prompt_ids, params):
            real = generate(prompt_ids, params)  # the real rollout runs (shapes, sampling path)
            first = calls["k"] % 2 == 0  # lockstep: one call per turn, two turns per episode
            calls["k"] += 1
            texts = [_call("add", n=5 if k % 2 == 0 else 3) if first else "Done." for k in range(len(prompt_ids))]
            ids = [tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id] for t in texts]
            return RolloutOutput(
                response_ids=ids,
                finish_reasons=["stop"] * len(ids),
                prompt_index=list(real.prompt_index),
                log_probs=[[0.0] * len(x) for x in ids] if real.log_probs is not None else None,
            )

        return _REAL_ENGINE(config, registry, tokenizer, scripted, **kwargs)


def test_two_tiny_steps_with_a_tool_call_score_get_reward_as_a_step_reward(tmp_path, monkeypatch):
    """A scripted policy calls the environment's method, then answers: the method runs on the episode's
    instance, ``get_reward()`` lands on the last sampled token and the reward functions score the last message."""
    from _helpers import TINY_CPU_RUN

    import rlplug
    import rlplug.orchestration.episodes as episodes_module

    monkeypatch.setattr(episodes_module, "EpisodeEngine", _ScriptedEngine)  # what episode_engine_for_run builds
    ds = {"prompt": ["Count to 5 with add.", "Count to 3 with add."], "target": [5, 3]}
    result = rlplug.train(
        [*TINY_CPU_RUN, *TINY_TRAIN, f"trainer.default_local_dir={tmp_path}", "data.shuffle=false"],
        train_dataset=ds,
        reward_funcs=[_brevity],
        tools=[multiply],
        environment_factory=Counter,
    )
    assert result.status == "finished" and result.global_step == 2
    for record in result.history:
        if "multi_turn/turns_mean" not in record:
            continue
        assert record["multi_turn/turns_mean"] == 2.0 and record["multi_turn/ended_by_done"] == 4.0
        assert record["multi_turn/tool_calls"] == 4.0 and record["multi_turn/tool_errors"] == 0.0
        assert 0.0 < record["multi_turn/masked_token_share"] < 1.0
        # the reward functions score "Done." (-0.05); get_reward() adds 1 where the call reached the row's
        # target (trajectory 0: add(5) for 5; 3: add(3) for 3) and 0 elsewhere: rewards 0.95, -0.05, -0.05,
        # 0.95, mean 0.45, max 0.95, min -0.05; each group has a spread, so the update has a gradient
        assert record["critic/score/mean"] == pytest.approx(-0.05)
        assert record["critic/rewards/mean"] == pytest.approx(0.45)
        assert (record["critic/rewards/max"], record["critic/rewards/min"]) == pytest.approx((0.95, -0.05))
        assert record["actor/grad_norm"] > 0


# ---------------------------------------------------------------------------- the parser, as the plugin's

PARSER_CASES = [
    _call("add", n=2) + " then " + _call("multiply", a=2, b=3),
    '<tool_call>{"name": "add", "arguments": "{\\"n\\": 4}"}</tool_call>',  # arguments as a JSON string
    '<tool_call>{"name": "add", "arguments": ""}</tool_call>',  # an empty string: no arguments
    '<tool_call>{"name": "add"}</tool_call>',  # no arguments at all
    "<tool_call>{not json</tool_call>",
    '<tool_call>["add"]</tool_call>',  # JSON, not an object
    '<tool_call>{"name": 5, "arguments": {}}</tool_call>',  # a name that is not a string
    '<tool_call>{"name": "add", "arguments": [1]}</tool_call>',
    '<tool_call>{"name": "add", "arguments": "{broken"}</tool_call>',
    _call("add", n=1) + ' <tool_call>{"name": "add", "arguments": {"n": 2}}',  # the second never closed
    "no call at all </tool_call>",
]


def test_hermes_parser_agrees_with_the_tool_agent_plugin():
    from rlplug.plugins.environments.tool_agent import parse_hermes_calls

    tools = {"add": FunctionTool(Counter().add), "multiply": FunctionTool(multiply)}
    for text in PARSER_CASES:
        ours = parse_tool_calls(text, "hermes", tools)
        theirs = parse_hermes_calls(text)
        assert len(ours) == len(theirs), text
        for a, b in zip(ours, theirs):
            # the same call, runnable or not; a runnable one with the same name and arguments
            assert (a.arguments is None) == (b.error is not None), text
            if b.error is None:
                assert (a.name, a.arguments) == (b.name, b.arguments), text
    assert [(c.name, c.arguments) for c in parse_tool_calls(PARSER_CASES[0], "hermes", tools)] == [
        ("add", {"n": 2}),
        ("multiply", {"a": 2, "b": 3}),
    ]


def test_tag_parser_agrees_with_the_tool_agent_plugin():
    from rlplug.plugins.environments.tool_agent import parse_tag_calls

    def echo(text: str) -> str:
        """Echo.

        Args:
            text: what to echo
        """
        return text

    def echo_all(text: str) -> str:
        """Echo all.

        Args:
            text: what to echo
        """
        return text

    tools = {"echo": FunctionTool(echo), "echo_all": FunctionTool(echo_all)}
    cases = [
        "<echo> a </echo> and <echo_all>b</echo_all>",  # names that overlap: the longest one wins
        "<echo>1+<echo>2</echo> <echo>3</echo>",  # the text runs to the first closing tag
        "<echo_all>x</echo> <echo_all>y</echo_all>",
        "<echo>never closed",
        "<other>plain text</other> <echo>",
        "",
    ]
    for text in cases:
        ours = parse_tool_calls(text, "tags", tools)
        theirs = parse_tag_calls(text, tools)
        assert [(c.name, None if c.arguments is None else c.arguments["text"]) for c in ours] == [
            (c.name, None if c.error else c.argument) for c in theirs
        ], text
    assert [(c.name, c.arguments) for c in parse_tool_calls(cases[1], "tags", tools)] == [
        ("echo", {"text": "1+<echo>2"}),
        ("echo", {"text": "3"}),
    ]


# ---------------------------------------------------------------------------- get_reward at every end


def test_get_reward_is_given_once_and_when_the_engine_ends_the_episode():
    _, env = _episode({"max_assistant_turns": 5})
    asyncio.run(env.reset(ROW))
    asyncio.run(env.step({"role": "assistant", "content": _call("add", n=5)}))
    # the engine ends the episode itself (length, timeout): it asks for the reward
    assert asyncio.run(env.final_reward()) == 1.0 and asyncio.run(env.final_reward()) is None
    assert env.rewards == [1.0]
    _, env = _episode()
    asyncio.run(env.reset(ROW))
    assert asyncio.run(env.step({"role": "assistant", "content": "no call"})).reward == 0.0
    assert asyncio.run(env.final_reward()) is None and env.rewards == [0.0]  # already given by the last step


def test_step_counts_what_the_engines_metrics_read():
    _, env = _episode({"max_parallel_calls": 2})
    asyncio.run(env.reset(ROW))
    text = _call("add", n=1) + "<tool_call>{bad</tool_call>" + _call("add", n=1)
    info = asyncio.run(env.step({"role": "assistant", "content": text})).info
    assert info["tool_statuses"] == ["ok", "bad_arguments", "error"]  # the third: past max_parallel_calls
    assert (info["tool_calls"], info["tool_errors"], info["malformed_calls"]) == (3, 2, 1)
    assert (info["tool_timeouts"], info["tool_crashes"]) == (0, 0)


class _Registry:
    def __init__(self, envs, tools):
        self.envs, self.tools = envs, tools

    def get(self, kind, name):
        return (self.envs if kind == "environment" else self.tools)[name]


def test_turn_cap_in_the_engine_lands_get_reward_on_the_last_sampled_token():
    """Through :class:`EpisodeEngine` (scripted turns): the model calls add on every turn; at
    ``max_assistant_turns=3`` the third turn's call is not run and ``get_reward()`` (the total 2 + 3 = 5 is the
    target: 1.0) sits on the last token the engine sampled."""
    from omegaconf import OmegaConf

    from rlplug.contracts.types import RolloutOutput, SamplingParams
    from rlplug.orchestration.episodes import EpisodeEngine
    from rlplug.training.models import default_model_dir, load_tokenizer

    tok = load_tokenizer(default_model_dir())
    script = [_call("add", n=2), _call("add", n=3), _call("add", n=7)]
    seen = []

    def generate(prompt_ids, params):
        turn = len(seen)
        seen.append(tok.decode(prompt_ids[0]))
        ids = tok(script[turn], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return RolloutOutput([ids], ["stop"], [0], [[-0.1] * len(ids)])

    mt = {"enable": True, "environment": "Counter", "tools": [], "format": "hermes", "max_assistant_turns": 3}
    cfg = OmegaConf.create({"rollout": {"multi_turn": mt, "mode": "inprocess"}, "data": {"max_response_length": 200}})
    registry = _Registry({"Counter": TRLEnvironmentFactory(Counter)}, {})
    with EpisodeEngine(cfg, registry, tok, generate) as engine:
        out = engine.generate([ROW], SamplingParams(n=1, max_tokens=200, seed=0, logprobs=True))
    assert len(seen) == 3 and "Count. Reach 5." in seen[0]  # reset's string appended to the prompt
    tools = [m["content"] for m in out.transcripts[0] if m["role"] == "tool"]
    assert tools == ["2", "5"]  # the third call (add 7) was not run
    mask = out.response_masks[0]
    last_sampled = max(i for i, m in enumerate(mask) if m == 1)
    assert last_sampled == len(mask) - 1
    assert out.step_rewards[0] == [(last_sampled, 1.0)]
    assert out.metrics["multi_turn/tool_calls"] == 2.0 and out.metrics["multi_turn/turns_mean"] == 3.0
    # the environment ends the episode at the cap itself (done, with its reward), so the engine counts it as
    # ended by done, not by the turn cap
    assert out.metrics["multi_turn/ended_by_done"] == 1.0 and out.metrics["multi_turn/ended_by_turn_cap"] == 0.0


# ---------------------------------------------------------------------------- proposed engine changes
# An environment's own ``tools`` in the chat template, and ``final_reward()`` when the engine ends an episode
# itself: proposed for rlplug.orchestration.episodes (EpisodeEngine.renderer_for and _close_env) with a fix of
# rlplug.orchestration.chat (TurnRenderer renders its reference history with tools=). Skipped until they land.

_CHATML_TOOLS = (
    "{% if tools %}{{'<|im_start|>system\\nTOOLS:' + (tools | map(attribute='function') | map(attribute='name')"
    " | join(',')) + '<|im_end|>\\n'}}{% endif %}"
    "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\\n'}}{% endif %}"
)


def _engine_patched() -> bool:
    from rlplug.orchestration.episodes import EpisodeEngine

    return hasattr(EpisodeEngine, "renderer_for")


def _counter_engine(tok, script):
    from omegaconf import OmegaConf

    from rlplug.contracts.types import RolloutOutput
    from rlplug.orchestration.episodes import EpisodeEngine

    seen = []

    def generate(prompt_ids, params):
        seen.append(tok.decode(prompt_ids[0]))
        ids = tok(script[min(len(seen), len(script)) - 1], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        if len(ids) > params.max_tokens:
            return RolloutOutput([ids[: params.max_tokens]], ["length"], [0], None)
        return RolloutOutput([ids], ["stop"], [0], None)

    mt = {"enable": True, "environment": "Counter", "tools": [], "format": "hermes"}
    cfg = OmegaConf.create({"rollout": {"multi_turn": mt, "mode": "inprocess"}, "data": {"max_response_length": 200}})
    return EpisodeEngine(cfg, _Registry({"Counter": TRLEnvironmentFactory(Counter)}, {}), tok, generate), seen


@pytest.mark.skipif(not _engine_patched(), reason="needs EpisodeEngine.renderer_for (proposed)")
def test_an_environments_own_tools_reach_the_chat_template():
    from rlplug.contracts.types import SamplingParams
    from rlplug.training.models import default_model_dir, load_tokenizer

    tok = load_tokenizer(default_model_dir())
    saved = tok.chat_template
    try:
        tok.chat_template = _CHATML_TOOLS
        engine, seen = _counter_engine(tok, [_call("add", n=5), "Done."])
        with engine:
            out = engine.generate([ROW], SamplingParams(n=1, max_tokens=200, seed=0))
        assert seen[0].startswith("<|im_start|>system\nTOOLS:add<|im_end|>")  # the method, as a tool schema
        assert seen[1].startswith(seen[0])  # token-in-token-out with that renderer
        assert out.step_rewards[0][-1][1] == 1.0 and engine.renderer.tools is None
    finally:
        tok.chat_template = saved


@pytest.mark.skipif(not _engine_patched(), reason="needs EpisodeEngine._close_env to ask final_reward() (proposed)")
def test_an_episode_ended_by_length_still_gets_get_reward():
    from rlplug.contracts.types import SamplingParams
    from rlplug.training.models import default_model_dir, load_tokenizer

    tok = load_tokenizer(default_model_dir())
    engine, _ = _counter_engine(tok, [_call("add", n=5), "x " * 400])  # the answer runs out of tokens
    with engine:
        out = engine.generate([ROW], SamplingParams(n=1, max_tokens=200, seed=0))
    assert out.metrics["multi_turn/ended_by_length"] == 1.0
    assert out.step_rewards[0] == [(len(out.response_ids[0]) - 1, 1.0)]  # total 5 == target: 1.0, last token
