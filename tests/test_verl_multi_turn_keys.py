"""verl's multi-turn keys (``actor_rollout_ref.rollout.multi_turn.*``, ``actor_rollout_ref.rollout.agent.*``)
compose onto ``rollout.multi_turn.*`` (issue 33), or are refused with the reason.

These tests compose (``rlplug.config.compose.compose``, which translates verl's keys) and stop there: the run's
validation refuses ``rollout.multi_turn.enable=true`` until the episode engine lands.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlplug.config.compose import compose
from rlplug.config.schema import ConfigError
from rlplug.config.verl_keys import file_overrides, lookup, translate_overrides
from rlplug.contracts.registry import get_registry

MT = "actor_rollout_ref.rollout.multi_turn"
AGENT = "actor_rollout_ref.rollout.agent"
KEYS_FIXTURE = Path(__file__).resolve().parent / "fixtures" / "verl_ppo_trainer_keys.txt"


def _mt(cfg):
    return OmegaConf.to_container(cfg.rollout.multi_turn)


def _write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


# ---------------------------------------------------------------------------- mapped keys


def test_verls_multi_turn_keys_land_on_rlplugs():
    cfg = compose(
        [
            f"{MT}.enable=true",
            f"{MT}.max_assistant_turns=3",
            f"{MT}.max_user_turns=4",
            f"{MT}.max_parallel_calls=2",
            f"{MT}.max_tool_response_length=512",
            f"{MT}.format=hermes",
        ]
    )
    mt = _mt(cfg)
    assert mt["enable"] is True
    assert (mt["max_assistant_turns"], mt["max_user_turns"], mt["max_parallel_calls"]) == (3, 4, 2)
    assert mt["max_tool_response_length"] == 512 and mt["format"] == "hermes"


def test_verls_null_turn_caps_keep_rlplugs_caps():
    default = _mt(compose([]))
    mt = _mt(compose([f"{MT}.enable=true", f"{MT}.max_assistant_turns=null", f"{MT}.max_user_turns=null"]))
    assert (mt["max_assistant_turns"], mt["max_user_turns"]) == (default["max_assistant_turns"], 5) == (5, 5)


def test_a_verl_key_and_its_rlplug_key_must_agree():
    with pytest.raises(ConfigError, match=r"both set rollout\.multi_turn\.max_parallel_calls"):
        compose([f"{MT}.max_parallel_calls=2", "rollout.multi_turn.max_parallel_calls=3"])


def test_default_agent_loop_selects_the_environment_and_turns_multi_turn_on():
    mt = _mt(compose([f"{AGENT}.default_agent_loop=tool_agent"]))
    assert mt["environment"] == "tool_agent" and mt["enable"] is True
    mt = _mt(compose([f"{AGENT}.default_agent_loop=my_loop"]))
    assert mt["environment"] == "my_loop" and mt["enable"] is True
    # verl's default: one turn per row; nothing set (multi-turn stays off)
    assert _mt(compose([f"{AGENT}.default_agent_loop=single_turn_agent"])) == _mt(compose([]))
    # a tool loop with multi-turn switched off in the same overrides contradicts itself
    with pytest.raises(ConfigError, match=r"both set rollout\.multi_turn\.enable"):
        compose([f"{AGENT}.default_agent_loop=tool_agent", f"{MT}.enable=false"])


def test_verls_default_format_is_not_set_while_multi_turn_is_off():
    default = _mt(compose([]))
    assert default["format"] == "tags"
    assert _mt(compose([f"{MT}.format=hermes"]))["format"] == "tags"  # verl's default, multi-turn off: dropped
    assert _mt(compose([f"{MT}.format=hermes", f"{MT}.enable=true"]))["format"] == "hermes"
    assert _mt(compose([f"{MT}.format=hermes", f"{AGENT}.default_agent_loop=tool_agent"]))["format"] == "hermes"
    assert _mt(compose([f"{MT}.format=tags"]))["format"] == "tags"
    with pytest.raises(ConfigError, match=rf"^{MT}\.format=llama3_json: rlplug reads tool calls as hermes"):
        compose([f"{MT}.format=llama3_json", f"{MT}.enable=true"])


def test_verls_whole_config_sets_no_multi_turn_key():
    lines = [ln for ln in KEYS_FIXTURE.read_text().splitlines() if ln and not ln.startswith("#")]
    overrides = [ln for ln in lines if not ln.endswith("=???")]
    assert f"{MT}.format='hermes'" in overrides and f"{AGENT}.default_agent_loop='single_turn_agent'" in overrides
    assert _mt(compose(overrides)) == _mt(compose([]))


# ---------------------------------------------------------------------------- refused keys and values


@pytest.mark.parametrize(
    ("override", "reason"),
    [
        (f"{MT}.use_inference_chat_template=true", "never re-renders the history"),
        (f"{MT}.tokenization_sanity_check_mode=disable", "the check cannot be turned off"),
        (f"{MT}.num_repeat_rollouts=2", "use rollout.n"),
        (f"{MT}.function_tool_path=tools.py", r"FunctionTool\(fn\) in a register_tools hook"),
        (f"{MT}.interaction_config_path=interaction.yaml", "write an environment plugin"),
        (f"{MT}.tool_config_path=true", "give the path of verl's tool config YAML"),
        (f"{AGENT}.agent_loop_config_path=3", "give the path of verl's agent loop YAML"),
        (f"{AGENT}.custom_async_server.path=server.py", "custom async inference server"),
        ("data.tool_config_path=tools.yaml", rf"{MT}\.tool_config_path"),
    ],
)
def test_a_multi_turn_setting_rlplug_cannot_honour_is_refused(override, reason):
    key = override.split("=", 1)[0]
    with pytest.raises(ConfigError, match=rf"^{key.replace('.', chr(92) + '.')}=.*{reason}"):
        translate_overrides([override])


def test_verls_defaults_of_the_refused_keys_are_accepted():
    for override in (
        f"{MT}.use_inference_chat_template=false",
        f"{MT}.tokenization_sanity_check_mode=strict",
        f"{MT}.num_repeat_rollouts=null",
        f"{MT}.function_tool_path=null",
        f"{MT}.interaction_config_path=null",
        f"{MT}.tool_config_path=null",
        f"{AGENT}.agent_loop_config_path=null",
    ):
        t = translate_overrides([override])
        assert t.overrides == [] and [k for keys in t.inert.values() for k in keys] == [override.split("=")[0]]


def test_no_unknown_multi_turn_key_is_accepted_silently():
    assert lookup(f"{MT}.some_future_key") is None
    with pytest.raises(ConfigError, match=r"Unknown config key .*max_assistant_turns"):
        compose([f"{MT}.max_assistant_turn=3"])


def test_the_truncate_side_must_be_rlplugs_when_multi_turn_is_on():
    compose([f"{MT}.tool_response_truncate_side=middle"])  # verl's default, multi-turn off: no effect
    compose([f"{MT}.tool_response_truncate_side=right", f"{MT}.enable=true"])
    for side in ("middle", "left"):
        with pytest.raises(ConfigError, match=rf"truncate_side={side}: rlplug keeps the first"):
            compose([f"{MT}.tool_response_truncate_side={side}", f"{MT}.enable=true"])


# ---------------------------------------------------------------------------- verl's tool config file


VERL_TOOL_CONFIG = """\
tools:
  - class_name: verl.tools.gsm8k_tool.Gsm8kTool
    config:
      type: native
    tool_schema:
      type: function
      function:
        name: {name}
        description: A tool
        parameters: {{type: object, properties: {{}}, required: []}}
"""


def test_verls_tool_config_selects_the_rlplug_tools_of_its_names(tmp_path):
    assert "calculator" in get_registry().names("tool")
    path = _write(tmp_path / "tool_config.yaml", VERL_TOOL_CONFIG.format(name="calculator"))
    cfg = compose([f"{MT}.enable=true", f"{MT}.tool_config_path={path}"])
    assert _mt(cfg)["tools"] == ["calculator"] and _mt(cfg)["enable"] is True
    # the same through a verl-layout YAML file of the whole run config
    run = _write(
        tmp_path / "run.yaml",
        f"""\
        actor_rollout_ref:
          rollout:
            multi_turn:
              enable: true
              format: hermes
              tool_config_path: {path}
        """,
    )
    mt = _mt(compose(file_overrides(run)))
    assert (mt["tools"], mt["format"], mt["enable"]) == (["calculator"], "hermes", True)


def test_an_unknown_verl_tool_is_refused_with_how_to_write_one(tmp_path):
    path = _write(tmp_path / "tool_config.yaml", VERL_TOOL_CONFIG.format(name="calc_gsm8k_reward"))
    with pytest.raises(ConfigError) as err:
        compose([f"{MT}.tool_config_path={path}"])
    msg = str(err.value)
    assert "calc_gsm8k_reward (verl.tools.gsm8k_tool.Gsm8kTool)" in msg
    assert "cannot run verl's BaseTool classes" in msg and "FunctionTool(fn)" in msg
    assert "Registered tools: " in msg and "calculator" in msg


def test_a_verl_tool_config_rlplug_would_half_read_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"no such file"):
        compose([f"{MT}.tool_config_path={tmp_path / 'missing.yaml'}"])
    settings = VERL_TOOL_CONFIG.format(name="calculator").replace("type: native", "type: native\n      rate_limit: 5")
    with pytest.raises(ConfigError, match=r"tools\[0\] \(calculator\) has config .*settings of verl's class"):
        compose([f"{MT}.tool_config_path={_write(tmp_path / 'a.yaml', settings)}"])
    mcp = "tools:\n  - class_name: verl.tools.mcp_search_tool.MCPSearchTool\n    config: {type: mcp}\n"
    with pytest.raises(ConfigError, match=r"has no tool_schema\.function\.name.*MCP tools"):
        compose([f"{MT}.tool_config_path={_write(tmp_path / 'b.yaml', mcp)}"])
    with pytest.raises(ConfigError, match=r"expected verl's tool config"):
        compose([f"{MT}.tool_config_path={_write(tmp_path / 'c.yaml', 'tools: []')}"])
    twice = VERL_TOOL_CONFIG.format(name="calculator")
    twice += twice.split("\n", 1)[1]
    with pytest.raises(ConfigError, match=r"listed twice"):
        compose([f"{MT}.tool_config_path={_write(tmp_path / 'd.yaml', twice)}"])


# ---------------------------------------------------------------------------- verl's agent loop file


def test_verls_agent_loops_must_be_rlplug_environments_of_their_names(tmp_path):
    assert "tool_agent" in get_registry().names("environment")
    known = _write(
        tmp_path / "loops.yaml", "- name: tool_agent\n  _target_: verl.experimental.agent_loop.ToolAgentLoop\n"
    )
    t = translate_overrides([f"{AGENT}.agent_loop_config_path={known}"])
    assert t.overrides == [] and t.inert == {}  # read and checked: the rows' agent_name selects it
    unknown = _write(tmp_path / "u.yaml", "- name: react_agent\n  _target_: recipe.react.ReactAgentLoop\n")
    with pytest.raises(ConfigError) as err:
        compose([f"{AGENT}.agent_loop_config_path={unknown}"])
    msg = str(err.value)
    assert "react_agent (recipe.react.ReactAgentLoop)" in msg and "cannot run verl's AgentLoopBase" in msg
    assert "Registered environments: " in msg and "tool_agent" in msg
    arguments = _write(tmp_path / "a.yaml", "- name: tool_agent\n  _target_: x.Loop\n  min_terms: 2\n")
    with pytest.raises(ConfigError, match=r"\(tool_agent\) sets min_terms: arguments of verl's class x\.Loop"):
        compose([f"{AGENT}.agent_loop_config_path={arguments}"])
