"""calc_arith (issue 33's tool task): generated rows, splits, ground truths, the calculator, the reward, the preset."""

from __future__ import annotations

import json
import random
import re

import pyarrow.parquet as pq
import pytest

from rlplug.config.compose import compose
from rlplug.config.schema import ConfigError
from rlplug.data import calc_arith
from rlplug.data.calc_arith import CalcArithDataset, check_kwargs, draw_problem
from rlplug.data.prepare import parquet_schema, prepare_dataset, prepared_data_files
from rlplug.plugins.rewards.rules import gsm8k
from rlplug.plugins.tools.calculator import calculator
from rlplug.rewards.manager import RewardManager

_QUESTION = re.compile(r"Calculate ([\d+\-*/() ]+)\.")


def _rows(path):
    return pq.read_table(path).to_pylist()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Mixed sizes and operator counts, small splits."""
    kw = {"digits": [2, 3, 4], "ops": [1, 2, 3], "operators": ["+", "-", "*", "//"]}
    info = prepare_dataset(
        "calc_arith", tmp_path_factory.mktemp("calc"), train_size=300, test_size=60, seed=7, task_kwargs=kw
    )
    return info, _rows(info["train_path"]), _rows(info["test_path"])


def test_rows_are_verl_schema_with_the_protocol_shown_once_as_a_worked_example(prepared):
    info, train, test = prepared
    assert pq.read_schema(info["train_path"]).equals(parquet_schema(), check_metadata=False)
    assert (len(train), len(test)) == (300, 60)
    for split, rows in (("train", train), ("test", test)):
        for i, r in enumerate(rows):
            assert r["data_source"] == "calc_arith" and r["ability"] == "math"
            assert r["extra_info"]["split"] == split and r["extra_info"]["index"] == i
            msgs = [dict(m) for m in r["prompt"]]
            assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant", "user"]
            assert msgs[-1]["content"] == r["extra_info"]["question"]
            # the protocol shown once: the system message, one worked call with its reply, one answer line
            assert (
                msgs[0]["content"] == calc_arith.SYSTEM and "<calculator>expression</calculator>" in msgs[0]["content"]
            )
            assert msgs[2]["content"] == "<calculator>12*34+5</calculator>" and msgs[3]["content"] == "413"
            assert msgs[4]["content"] == "#### 413"
    assert calculator("12*34+5") == "413"  # the prompt's worked example is right


def test_ground_truth_is_pythons_value_and_the_calculators(prepared):
    _, train, test = prepared
    for r in train + test:
        meta = json.loads(r["extra_info"]["rg_metadata"])
        gt = r["reward_model"]["ground_truth"]
        shown = _QUESTION.fullmatch(r["extra_info"]["question"]).group(1)
        assert shown.replace(" ", "") == meta["expression"]
        assert (
            gt == r["extra_info"]["answer"] == str(eval(meta["expression"]))
        )  # the expression holds digits and + - * // ( ) only
        assert calculator(meta["expression"]) == gt
        assert int(gt) >= 0  # allow_negative=false
        assert len(meta["operands"]) == meta["ops"] + 1 == len(meta["operators"]) + 1
        assert all(len(str(x)) == meta["digits"] for x in meta["operands"])
        assert "*" in meta["operators"]  # min_mul=1


def test_settings_are_covered(prepared):
    _, train, _ = prepared
    metas = [json.loads(r["extra_info"]["rg_metadata"]) for r in train]
    assert {m["digits"] for m in metas} == {2, 3, 4}
    assert {m["ops"] for m in metas} == {1, 2, 3}
    assert {o for m in metas for o in m["operators"]} == {"+", "-", "*", "//"}
    assert any("(" in m["expression"] for m in metas)  # trees other than left-to-right chains


def test_splits_are_disjoint_and_deterministic(prepared, tmp_path):
    info, train, test = prepared
    assert not {r["extra_info"]["question"] for r in train} & {r["extra_info"]["question"] for r in test}
    again = prepare_dataset(
        "calc_arith", tmp_path / "a", train_size=300, test_size=60, seed=7, task_kwargs=info["task_kwargs"]
    )
    assert _rows(again["train_path"]) == train and _rows(again["test_path"]) == test
    other = prepare_dataset(
        "calc_arith", tmp_path / "b", train_size=300, test_size=60, seed=8, task_kwargs=info["task_kwargs"]
    )
    assert _rows(other["train_path"]) != train
    # item i depends on (seed + i) only: a larger dataset starts with the same items
    small, big = CalcArithDataset({}, seed=3, size=5), CalcArithDataset({}, seed=3, size=50)
    assert [small[i] for i in range(5)] == [big[i] for i in range(5)]


def test_overlap_with_the_test_split_is_removed(tmp_path):
    # 1-digit a*b: 81 distinct questions, so a train split of 60 beside a test split of 40 must skip repeats
    kw = {"digits": [1], "ops": [1], "operators": ["*"]}
    info = prepare_dataset("calc_arith", tmp_path, train_size=60, test_size=40, seed=0, task_kwargs=kw)
    train, test = _rows(info["train_path"]), _rows(info["test_path"])
    test_q = {r["extra_info"]["question"] for r in test}
    assert info["overlap_removed"] > 0 and not test_q & {r["extra_info"]["question"] for r in train}


def test_minimal_parentheses_keep_the_value():
    # hand-built trees: (op, left, right)
    cases = {
        ("*", ("+", 12, 34), 5): "(12+34)*5",
        ("+", 12, ("*", 34, 5)): "12+34*5",
        ("-", 12, ("+", 34, 5)): "12-(34+5)",
        ("+", 12, ("-", 34, 5)): "12+34-5",
        ("*", 12, ("//", 34, 5)): "12*(34//5)",
        ("*", 12, ("*", 34, 5)): "12*(34*5)",
        ("*", 12, ("*", ("//", 34, 5), 6)): "12*(34//5*6)",  # 12*34//5*6 would be 486, not 432
        ("+", 12, ("+", ("-", 34, 5), 6)): "12+34-5+6",
        ("//", ("*", 12, 34), 5): "12*34//5",
    }
    for tree, text in cases.items():
        assert calc_arith._render(tree, "") == text
        assert eval(text) == calc_arith._value(tree)


def test_draws_are_seeded_and_sized():
    a = draw_problem(random.Random(5), check_kwargs({"digits": 5, "ops": 1, "operators": ["*"]}))
    b = draw_problem(random.Random(5), check_kwargs({"digits": 5, "ops": 1, "operators": ["*"]}))
    assert a == b
    x, y = a["metadata"]["operands"]
    assert 10_000 <= x <= 99_999 and 10_000 <= y <= 99_999
    assert a["answer"] == str(x * y) and a["question"] == f"Calculate {x} * {y}."


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"digit": 3}, r"Unknown task_kwargs for task 'calc_arith': digit\. Valid keys: digits, ops"),
        ({"digits": [0]}, r"'digits' must be .* in 1\.\.9"),
        ({"ops": []}, r"'ops' must be"),
        ({"operators": ["**"]}, r"'operators' must be a non-empty list from \+, -, \*, //"),
        ({"ops": [1], "min_mul": 2}, r"'min_mul' must be an integer in 0\.\.1"),
        ({"operators": ["+"]}, r"'min_mul'=1 needs '\*'"),
        ({"digits": [8], "ops": [4]}, r"10\*\*30"),
    ],
)
def test_bad_settings_say_what_is_allowed(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        prepare_dataset("calc_arith", tmp_path, train_size=5, test_size=5, task_kwargs=kwargs)


def test_unknown_task_lists_calc_arith(tmp_path):
    with pytest.raises(ValueError, match=r"Did you mean 'calc_arith'.*Available tasks:.*calc_arith"):
        prepare_dataset("calc_arith_", tmp_path)


def test_the_largest_settings_stay_inside_the_calculators_limit():
    kw = check_kwargs({"digits": [6], "ops": [4], "operators": ["*"], "min_mul": 4})
    item = draw_problem(random.Random(0), kw)
    assert len(item["answer"]) >= 26 and calculator(item["metadata"]["expression"]) == item["answer"]


def test_reward_scores_the_last_message_strictly(prepared):
    _, _, test = prepared
    row = test[0]
    gt = row["reward_model"]["ground_truth"]
    expr = json.loads(row["extra_info"]["rg_metadata"])["expression"]
    assert gsm8k("calc_arith", f"#### {gt}", gt)["score"] == 1.0
    assert gsm8k("calc_arith", f"The result is {gt}.\n#### {gt}", gt)["acc"] == 1.0
    assert gsm8k("calc_arith", f"#### {int(gt) + 1}", gt)["score"] == 0.0
    assert gsm8k("calc_arith", f"<calculator>{expr}</calculator>", gt)["score"] == 0.0  # a call is no answer
    assert gsm8k("calc_arith", gt, gt)["score"] == 0.0  # strict: no "####" line


def test_the_preset_maps_the_data_source_to_gsm8k(prepared):
    _, _, test = prepared
    cfg = compose(["experiment=calc_tool"])
    rows = [
        {
            "data_source": r["data_source"],
            "ground_truth": r["reward_model"]["ground_truth"],
            "extra_info": r["extra_info"],
        }
        for r in test[:6]
    ]
    responses = [f"#### {r['ground_truth']}" for r in rows[:3]] + ["#### 1", "no answer", "#### -5"]
    with RewardManager(cfg.reward) as manager:
        assert manager.fn_name_for("calc_arith") == "gsm8k"
        _, extra, _ = manager.score(rows, responses)
    assert extra["acc"] == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]


def test_preset_composes_with_the_pilot_settings():
    cfg = compose(["experiment=calc_tool"])
    assert cfg.data.task == "calc_arith" and cfg.algorithm.adv_estimator == "grpo"
    assert (cfg.rollout.n, cfg.rollout.temperature, cfg.data.test_size) == (8, 0.8, 200)
    mt = cfg.rollout.multi_turn
    assert (mt.enable, list(mt.tools), mt.format, mt.environment, mt.max_assistant_turns) == (
        True,
        ["calculator"],
        "tags",
        "tool_agent",
        3,
    )
    assert cfg.data.max_response_length == 256 and cfg.trainer.seed == 0
    assert cfg.trainer.experiment_name == "calc_tool" and cfg.trainer.total_training_steps == 100
    other = compose(
        ["experiment=calc_tool", "trainer.seed=2", "rollout.multi_turn.enable=false", "data.task_kwargs.digits=[4]"]
    )
    assert other.trainer.seed == 2 and not other.rollout.multi_turn.enable
    assert dict(other.data.task_kwargs) == {"digits": [4], "ops": [1, 2]}


def test_preset_data_prepares_through_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RLPLUG_CACHE", str(tmp_path))
    cfg = compose(["experiment=calc_tool", "data.train_size=50", "data.test_size=20"])
    train, val = prepared_data_files(cfg)
    assert train[0].startswith(str(tmp_path)) and len(_rows(train[0])) == 50 and len(_rows(val[0])) == 20
    # a different operand size is a different cache entry
    bigger = compose(["experiment=calc_tool", "data.train_size=50", "data.test_size=20", "data.task_kwargs.digits=[4]"])
    train4, _ = prepared_data_files(bigger)
    assert train4 != train
    assert {json.loads(r["extra_info"]["rg_metadata"])["digits"] for r in _rows(train4[0])} == {4}


def test_preset_passes_validation_but_for_multi_turn():
    # The preset's only config error today is core/run/validate.py::_check_multi_turn refusing multi-turn
    # episodes until the engine lands (issue 33); any other error (batch sizes, reward map ...) fails here.
    from rlplug.run.validate import validate_config

    cfg = compose(["experiment=calc_tool", "rollout=hf"])
    try:
        validate_config(cfg)
    except ConfigError as exc:
        assert str(exc).startswith("rollout.multi_turn"), exc


def _pilot():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "calc_tool_pilot.py"
    spec = importlib.util.spec_from_file_location("calc_tool_pilot", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_no_tool_baseline_validates():
    from rlplug.run.validate import validate_config

    pilot = _pilot()
    cfg = compose(pilot.overrides_for(3, "no_tools", 200, ["rollout=hf"]))
    assert not cfg.rollout.multi_turn.enable
    # the preset's tools are named as having no effect, and the config is valid
    with pytest.warns(UserWarning, match=r"no effect: rollout.multi_turn.tools=\['calculator'\]"):
        validate_config(cfg)


def test_pilot_arguments_and_summary():
    pilot = _pilot()
    args, extra = pilot.parse_args(["--digits", "2,4", "--modes", "no_tools", "--", "rollout=hf"])
    assert (args.digits, args.modes, args.problems, args.n, args.temperature) == ([2, 4], ["no_tools"], 200, 8, 0.8)
    assert extra == ["rollout=hf"]
    with pytest.raises(SystemExit):
        pilot.parse_args(["--modes", "tool"])
    assert pilot.overrides_for(4, "tools", 200)[:3] == [
        "experiment=calc_tool",
        "data.task_kwargs.digits=[4]",
        "data.test_size=200",
    ]
    assert pilot.count_calls("<calculator>1*2</calculator> 2 <calculator>3</calculator> <calculator>4") == 2
    msgs = [
        {"role": "user", "content": "<calculator>9*9</calculator>"},  # the prompt's example is not a call
        {"role": "assistant", "content": "<calculator>12*34</calculator>"},
        {"role": "tool", "content": "408"},
        {"role": "assistant", "content": "#### 408"},
    ]
    assert pilot.transcript_calls(msgs) == 1
    demo = [{"role": "assistant", "content": "<calculator>12*34+5</calculator>"}, {"role": "tool", "content": "413"}]
    assert pilot.transcript_calls(demo + msgs, prompt_messages=2) == 1  # the prompt's demonstration is not counted
    # 2 problems x 2 samples: problem 0 mixed (1, 0), problem 1 all wrong; 3 responses call the tool, one twice
    records = [
        {"prompt": 0, "acc": 1.0, "score": 1.0, "calls": 1},
        {"prompt": 0, "acc": 0.0, "score": 0.0, "calls": 2},
        {"prompt": 1, "acc": 0.0, "score": 0.0, "calls": 0},
        {"prompt": 1, "acc": 0.0, "score": 0.0, "calls": 1},
    ]
    got = pilot.summarize(records)
    assert got == {
        "problems": 2,
        "responses": 4,
        "accuracy": 0.25,
        "pass_at_n": 0.5,
        "tool_call_rate": 0.75,
        "calls_per_response": 1.0,
        "mixed_groups": 0.5,
    }
    assert pilot.eligible({"tools": got, "no_tools": {**got, "accuracy": 0.04}}) is True
    assert pilot.eligible({"tools": got, "no_tools": {**got, "accuracy": 0.05}}) is False
    assert pilot.eligible({"tools": {**got, "mixed_groups": 0.19}, "no_tools": {**got, "accuracy": 0.0}}) is False
    assert pilot.eligible({"tools": got}) is None
