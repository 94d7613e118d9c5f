"""Picking a reward per data source (issue 14, item 1).

* the command-line spellings users try compose: ``reward.reward_fn_map.openai/gsm8k=...`` (a data
  source with ``/``), ``reward.kwargs.<name>.<key>=...`` and the other open maps without ``+``;
* the fix every error message suggests composes when copied;
* precedence: ``reward.custom_reward_function`` (a function from a file), then
  ``reward.reward_fn_map``, then ``reward.default``; a shadowed ``reward.default`` is reported
  once, and the run logs which function scores each data source and why;
* ``reward.custom_reward_function`` fails before any model loads on a missing file, a missing or
  non-callable function, or kwargs the function does not accept, and works in worker processes.
"""

from __future__ import annotations

import logging
import re
import shlex
import textwrap

import pytest
from omegaconf import OmegaConf

from rlplug.config.compose import compose
from rlplug.config.schema import ConfigError, map_entry_override, open_map_fields, rewrite_overrides
from rlplug.contracts.registry import Registry
from rlplug.rewards.manager import FileRewardFunction, RewardConfigError, RewardManager, load_custom_reward_function
from rlplug.run.validate import validate_config

DEFAULT_MAP = {
    "openai/gsm8k": "gsm8k",
    "gsm_symbolic": "gsm8k",
    "basic_arithmetic": "gsm8k",
    "chain_sum": "gsm8k",
    "countdown": "reasoning_gym",
}


def _first(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0


def _second(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    return 2.0 + bonus


def registry() -> Registry:
    reg = Registry(load_entry_points=False)
    reg.register("reward_function", "first", _first)
    reg.register("reward_function", "second", _second)
    return reg


def section(**over):
    base = {"reward_fn_map": {}, "default": None, "kwargs": {}, "shaping": [], "timeout_s": None, "num_workers": 0}
    return {**base, **over}


# ---------------------------------------------------------------------------- the command line


def test_open_maps_are_derived_from_the_schema():
    maps = open_map_fields()
    assert set(maps) == {
        "data.task_kwargs",
        "reward.reward_fn_map",
        "reward.kwargs",
        "reward.custom_reward_function.reward_kwargs",
        "reward.reward_kwargs",  # verl's spelling of the overlong shaping (overlong_buffer_cfg)
        "trainer.backend_kwargs",
    }
    assert maps["reward.reward_fn_map"] is str


def test_data_source_with_a_slash_maps_from_the_command_line_and_keeps_the_other_entries():
    # before: "mismatched input '/' expecting EQUAL"
    cfg = compose(["reward.reward_fn_map.openai/gsm8k=math_verify"])
    assert dict(cfg.reward.reward_fn_map) == {**DEFAULT_MAP, "openai/gsm8k": "math_verify"}
    # a new source, one with a dot (one key, not a nesting) and one with characters Hydra escapes
    cfg = compose(["reward.reward_fn_map.hendrycks/math.l5=math_verify", "reward.reward_fn_map.a:b c=gsm8k"])
    assert dict(cfg.reward.reward_fn_map) == {**DEFAULT_MAP, "hendrycks/math.l5": "math_verify", "a:b c": "gsm8k"}
    assert rewrite_overrides(["reward.reward_fn_map.a:b c=gsm8k"]) == ["++reward.reward_fn_map={a\\:b\\ c:gsm8k}"]
    # a later override wins, as Hydra's do
    cfg = compose(["reward.reward_fn_map.openai/gsm8k=math_verify", "reward.reward_fn_map.openai/gsm8k=gsm8k"])
    assert cfg.reward.reward_fn_map["openai/gsm8k"] == "gsm8k"


def test_documented_kwargs_path_and_other_open_maps_need_no_plus():
    # before: "Unknown config key 'reward.kwargs'. Did you mean 'reward.kwargs'?"
    cfg = compose(["reward.kwargs.gsm8k.method=flexible", "reward.kwargs.gsm8k.format_score=0.1"])
    assert OmegaConf.to_container(cfg.reward.kwargs) == {"gsm8k": {"method": "flexible", "format_score": 0.1}}
    # merged into a preset's kwargs, and a '+' written by habit still works
    cfg = compose(
        ["reward=flexible", "reward.kwargs.gsm8k.format_score=0.1", "+reward.kwargs.format.require_number=false"]
    )
    assert OmegaConf.to_container(cfg.reward.kwargs) == {
        "gsm8k": {"method": "flexible", "format_score": 0.1},
        "format": {"require_number": False},
    }
    cfg = compose(
        [
            "data.task_kwargs.max_terms=3",
            "trainer.backend_kwargs.offload.params=true",
            "reward.custom_reward_function.reward_kwargs.scale=2",
        ]
    )
    assert OmegaConf.to_container(cfg.data.task_kwargs) == {"max_terms": 3}
    assert OmegaConf.to_container(cfg.trainer.backend_kwargs) == {"offload": {"params": True}}
    assert OmegaConf.to_container(cfg.reward.custom_reward_function.reward_kwargs) == {"scale": 2}


def test_errors_never_suggest_the_key_that_failed_and_quote_what_was_typed():
    with pytest.raises(ConfigError) as e:
        compose(["reward.kwargs.gsm8k=flexible"])  # a string where the map wants a map
    msg = str(e.value)
    assert "Did you mean" not in msg and "++" not in msg
    assert msg == "Error merging override reward.kwargs.gsm8k=flexible: Cannot assign str to Dict[str, Any]"
    with pytest.raises(ConfigError, match=r"^Unknown config key 'reward\.custom_reward_function\.pth'\. Did you mean"):
        compose(["reward.custom_reward_function.pth=x.py"])


def test_unknown_key_explanation_never_suggests_an_existing_key():
    # what Hydra reports for a key under a map or a plain value (the overrides compose() no longer
    # sends for maps): before, both ended in "Did you mean '<that same key>'?"
    from hydra.errors import ConfigCompositionException

    from rlplug.config.compose import explain_compose_error as _explain_compose_error

    def explain(key):
        return _explain_compose_error(ConfigCompositionException(f"Could not override '{key}'."))

    assert explain("reward.kwargs.gsm8k.method").startswith(
        "Could not set 'reward.kwargs.gsm8k.method' in the map 'reward.kwargs': Could not override"
    )
    assert explain("actor.optim.lr.foo") == (
        "Unknown config key 'actor.optim.lr.foo': 'actor.optim.lr' is a single value (float), not a section "
        "with keys; set 'actor.optim.lr' itself."
    )
    assert explain("actor.optim.learnin_rate").startswith("Unknown config key 'actor.optim.learnin_rate'. Valid")


@pytest.mark.parametrize("source", ["openai/gsm8k", "plain_name", "math.level5", "a b", "x=y", "k:v", "foo@bar", "42"])
def test_the_fix_the_unmapped_source_error_suggests_composes(source):
    reg = registry()
    m = RewardManager(section(reward_fn_map={"other": "first"}), registry=reg)
    with pytest.raises(RewardConfigError) as e:
        m.check_data_sources({source})
    msg = str(e.value)
    fix = re.search(r"Fix: (.+) \(any function listed above\), or (reward\.default=\S+) \(", msg)
    assert fix, msg
    for suggestion in fix.groups():
        (override,) = shlex.split(suggestion)  # as the shell hands it over
        cfg = compose([override])
        if override.startswith("reward.default"):
            assert cfg.reward.default == "first"
        else:
            assert cfg.reward.reward_fn_map[source] == "first"
            assert cfg.reward.reward_fn_map["countdown"] == "reasoning_gym"  # merged, not replaced


def test_map_entry_override_gives_none_for_keys_hydra_cannot_hold():
    assert (
        map_entry_override("reward.reward_fn_map", "openai/gsm8k", "gsm8k") == "reward.reward_fn_map.openai/gsm8k=gsm8k"
    )
    assert map_entry_override("reward.reward_fn_map", "it's", "gsm8k") is None  # no quotes in Hydra dict keys
    # a dict literal would read these as a float / bool key, a dotted key would split "1.5"
    assert [map_entry_override("reward.reward_fn_map", k, "x") for k in ("1.5", "2e3", "true", "null")] == [None] * 4
    reg = registry()
    with pytest.raises(RewardConfigError, match=r"Fix: map it in a reward config file, or set reward.default=first"):
        RewardManager(section(), registry=reg).check_data_sources({"it's"})


# ---------------------------------------------------------------------------- precedence


CUSTOM = """
    def compute_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
        return {"score": scale * len(solution_str), "acc": 0.0}

    def other(data_source, solution_str, ground_truth, extra_info=None):
        return -1.0

    NOT_A_FUNCTION = 3
"""


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent(CUSTOM))
    return path


def test_precedence_custom_then_map_then_default(reward_file, caplog):
    reg = registry()
    rows = [{"data_source": "mapped", "ground_truth": "x"}, {"data_source": "unmapped", "ground_truth": "x"}]
    # map, then default: mapped -> second (2.0), unmapped -> first (1.0)
    m = RewardManager(section(reward_fn_map={"mapped": "second"}, default="first"), registry=reg)
    assert m.score(rows, ["abc", "abc"])[0] == [2.0, 1.0]
    assert [m.chosen_by(r["data_source"]) for r in rows] == ["reward.reward_fn_map.mapped", "reward.default"]
    # the custom function scores every source: 2.0 * len("abc") = 6.0, reward_fn_map and default unused
    crf = {"path": str(reward_file), "name": "compute_score", "reward_kwargs": {"scale": 2.0}}
    m = RewardManager(
        section(reward_fn_map={"mapped": "second"}, default="first", custom_reward_function=crf), registry=reg
    )
    with caplog.at_level(logging.INFO, logger="rlplug.rewards.manager"):
        scores, extra, _ = m.score(rows, ["abc", "abc"])
    assert scores == [6.0, 6.0] and extra["acc"] == [0.0, 0.0]
    assert m.fn_name_for("anything") == "custom_reward_function(my_reward.py:compute_score)"
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert lines == [
        f"reward for data_source {ds}: custom_reward_function(my_reward.py:compute_score) (chosen by "
        f"reward.custom_reward_function.path={reward_file}: it scores every data source; reward_fn_map and "
        "default are unused)"
        for ds in ("mapped", "unmapped")
    ]
    # the default is set but never reached: reported once
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("reward.default=first is set but scores no data source")
    assert "unset reward.custom_reward_function.path" in warnings[0]


def test_one_line_per_data_source_says_which_function_and_why(caplog):
    m = RewardManager(
        section(reward_fn_map={"a/b": "second"}, default="first", shaping=[{"name": "first", "weight": 0.5}]),
        registry=registry(),
    )
    with caplog.at_level(logging.INFO, logger="rlplug.rewards.manager"):
        m.check_data_sources({"a/b", "c"})
        m.check_data_sources({"a/b", "c"})  # already reported: nothing new
    assert [r.getMessage() for r in caplog.records] == [
        "reward for data_source a/b: second (chosen by reward.reward_fn_map.a/b), plus shaping 0.5 x first",
        "reward for data_source c: first (chosen by reward.default; c is not in reward.reward_fn_map), "
        "plus shaping 0.5 x first",
    ]


def test_shadowed_default_warns_once_with_the_winning_mapping_and_a_fix_that_composes(caplog):
    # before: reward.default=my_reward was accepted and silently did nothing for mapped sources
    m = RewardManager(section(reward_fn_map={"openai/gsm8k": "second"}, default="first"), registry=registry())
    with caplog.at_level(logging.WARNING, logger="rlplug.rewards.manager"):
        m.check_data_sources({"openai/gsm8k"})
        m.check_data_sources({"openai/gsm8k"})
    (msg,) = [r.getMessage() for r in caplog.records]
    assert msg == (
        "reward.default=first is set but scores no data source: a setting of higher precedence chooses the "
        "function of each (reward.custom_reward_function, then reward.reward_fn_map, then reward.default): "
        "openai/gsm8k -> second (reward.reward_fn_map.openai/gsm8k). To score with first, map a source to it "
        "instead, e.g. reward.reward_fn_map.openai/gsm8k=first."
    )
    fix = msg.rsplit("e.g. ", 1)[1].rstrip(".")
    assert compose([fix]).reward.reward_fn_map["openai/gsm8k"] == "first"
    # a default that some source reaches: no warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rlplug.rewards.manager"):
        RewardManager(section(reward_fn_map={"a": "second"}, default="first"), registry=registry()).check_data_sources(
            {"a", "b"}
        )
    assert caplog.records == []


def test_kwargs_for_a_function_nothing_uses_are_reported(caplog):
    m = RewardManager(
        section(reward_fn_map={"a": "first"}, kwargs={"second": {"bonus": 1.0}, "first": {}}), registry=registry()
    )
    with caplog.at_level(logging.WARNING, logger="rlplug.rewards.manager"):
        m.check_data_sources({"a"})
    assert [r.getMessage() for r in caplog.records] == [
        "reward.kwargs.second is set but no data source or reward.shaping entry uses the reward function second "
        "(data sources: a -> first); these settings have no effect."
    ]
    # a shaping entry without its own kwargs takes reward.kwargs.<name>: used
    caplog.clear()
    m = RewardManager(
        section(reward_fn_map={"a": "first"}, kwargs={"second": {"bonus": 1.0}}, shaping=[{"name": "second"}]),
        registry=registry(),
    )
    with caplog.at_level(logging.WARNING, logger="rlplug.rewards.manager"):
        assert m.score([{"data_source": "a", "ground_truth": ""}], ["x"])[0] == [1.0 + 3.0]
    assert caplog.records == []


# ---------------------------------------------------------------------------- custom_reward_function


def test_custom_reward_function_errors_are_config_errors(reward_file, tmp_path):
    def load(**crf):
        return load_custom_reward_function({"path": str(reward_file), "name": "compute_score", **crf})

    with pytest.raises(RewardConfigError, match=r"custom_reward_function.path=.*nope\.py: no such file"):
        load(path=str(tmp_path / "nope.py"))
    with pytest.raises(
        RewardConfigError, match=r"has no function 'score' .*functions defined there: compute_score, other"
    ):
        load(name="score")
    with pytest.raises(RewardConfigError, match=r"has a int, not a function, named 'NOT_A_FUNCTION'"):
        load(name="NOT_A_FUNCTION")
    with pytest.raises(
        RewardConfigError,
        match=r"cannot be called as compute_score\(data_source, solution_str, "
        r"ground_truth, extra_info, scal=\.\.\.\) \(got an unexpected keyword argument 'scal'\)",
    ):
        load(reward_kwargs={"scal": 2})
    broken = tmp_path / "broken.py"
    broken.write_text("raise ImportError('needs a package')\n")
    with pytest.raises(RewardConfigError, match=r"importing the file failed with ImportError: needs a package"):
        load(path=str(broken))
    assert load_custom_reward_function({"path": None}) is None


def test_validate_config_checks_custom_reward_function_before_any_model_loads(reward_file):
    cfg = compose(
        ["debug=tiny", f"reward.custom_reward_function.path={reward_file}", "reward.custom_reward_function.name=scor"]
    )
    with pytest.raises(ConfigError, match="has no function 'scor'"):
        validate_config(cfg)
    cfg = compose(["debug=tiny", f"reward.custom_reward_function.path={reward_file}"])
    validate_config(cfg)


def test_custom_reward_function_runs_in_worker_processes(reward_file):
    crf = {"path": str(reward_file), "reward_kwargs": {"scale": 0.5}}
    rows = [{"data_source": "any", "ground_truth": ""}] * 3
    serial = RewardManager(section(custom_reward_function=crf), registry=registry())
    with RewardManager(section(custom_reward_function=crf, num_workers=1), registry=registry()) as pooled:
        got, _, metrics = pooled.score(rows, ["a", "bb", "cccc"])
    assert got == serial.score(rows, ["a", "bb", "cccc"])[0] == [0.5, 1.0, 2.0]  # 0.5 * length
    assert metrics["reward/failures"] == 0.0
    import pickle

    fn = pickle.loads(pickle.dumps(FileRewardFunction(reward_file, "other")))
    assert fn("d", "s", "g") == -1.0 and fn.path == str(reward_file.resolve())


def test_every_command_in_the_rewards_doc_composes():
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "rewards.md").read_text()
    commands = [
        shlex.split(line, comments=True)
        for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S)
        for line in block.replace("\\\n", " ").splitlines()  # join continued lines
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert len(commands) == 10  # + the TRL-contract function from a file
    for argv in commands:
        assert argv[:2] == ["rlplug", "train"], argv
        compose(argv[2:])
    cfg = compose(shlex.split("'reward.reward_fn_map={openai/gsm8k:math_verify,gsm_symbolic:math_verify}'"))
    assert dict(cfg.reward.reward_fn_map) == {
        **DEFAULT_MAP,
        "openai/gsm8k": "math_verify",
        "gsm_symbolic": "math_verify",
    }


def test_a_default_equal_to_every_winning_function_is_not_reported(caplog):
    # reward=math_verify maps every packaged source to math_verify and sets the default to it too
    cfg = compose(["reward=math_verify", "reward.shaping=[]"])
    reg = Registry(load_entry_points=False)
    reg.register("reward_function", "math_verify", _first)
    with caplog.at_level(logging.WARNING, logger="rlplug.rewards.manager"):
        RewardManager(cfg.reward, registry=reg).check_data_sources({"basic_arithmetic", "openai/gsm8k"})
    assert caplog.records == []


def test_a_custom_file_function_declared_binary_reports_an_accuracy(tmp_path):
    from rlplug.rewards.manager import ACC_REPORTED

    path = tmp_path / "binary_reward.py"
    path.write_text(
        textwrap.dedent(
            """
            def compute_score(data_source, solution_str, ground_truth, extra_info=None):
                return float(solution_str == ground_truth)

            compute_score.binary = True
            """
        )
    )
    m = RewardManager(section(custom_reward_function={"path": str(path)}), registry=registry())
    rows = [{"data_source": "any", "ground_truth": "7"}] * 2
    _, extra, _ = m.score(rows, ["7", "8"], report_acc=True)
    # the declaration on the file's function counts, not the wrapper's (validation names it acc, not reward)
    assert extra[ACC_REPORTED] == [1.0, 1.0] and extra["acc"] == [1.0, 0.0]
