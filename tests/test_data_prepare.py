"""prepare_dataset: verl-schema parquet from reasoning-gym, disjoint splits, task settings."""

from __future__ import annotations

import json
import re

import pyarrow.parquet as pq
import pytest
import reasoning_gym

from rlplug.config.schema import RewardConfig
from rlplug.data.dataset import read_dataset
from rlplug.data.prepare import GSM8K_INSTRUCTION, TASKS, parquet_schema, prepare_dataset
from rlplug.rewards.manager import RewardManager


def _rows(path):
    return pq.read_table(path).to_pylist()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Every task prepared once, small."""
    out = {}
    for task in TASKS:
        d = tmp_path_factory.mktemp(task)
        out[task] = prepare_dataset(task, d, train_size=120, test_size=30, seed=3)
    return out


def test_required_tasks_are_available():
    assert {"gsm_symbolic", "basic_arithmetic", "chain_sum", "countdown"} <= set(TASKS)


@pytest.mark.parametrize("task", TASKS)
def test_schema_counts_and_disjoint_splits(prepared, task):
    info = prepared[task]
    assert pq.read_schema(info["train_path"]).equals(parquet_schema(), check_metadata=False)
    train, test = _rows(info["train_path"]), _rows(info["test_path"])
    assert (len(train), len(test)) == (info["train_size"], info["test_size"]) == (120, 30)
    train_q = {r["extra_info"]["question"] for r in train}
    test_q = {r["extra_info"]["question"] for r in test}
    assert not train_q & test_q  # disjoint by question text
    assert info["train_unique"] == len(train_q) and info["test_unique"] == len(test_q)
    for split, rows in (("train", train), ("test", test)):
        for i, r in enumerate(rows):
            assert r["data_source"] == task and r["ability"] == "math"
            assert r["reward_model"]["style"] == "rule" and r["reward_model"]["ground_truth"].strip()
            assert r["extra_info"]["split"] == split and r["extra_info"]["index"] == i
            assert r["extra_info"]["rg_task"] == task
            (msg,) = r["prompt"]
            assert msg["role"] == "user" and '"####"' in msg["content"]
    saved = json.loads((__import__("pathlib").Path(info["train_path"]).parent / "info.json").read_text())
    assert saved["train_path"] == "train.parquet" and saved["overlap_removed"] == info["overlap_removed"]


@pytest.mark.parametrize("task", TASKS)
def test_prepared_answers_score_one_with_the_default_reward_map(prepared, task):
    # The task's own answer given after "####" must be judged correct by the reward the default
    # config maps this data source to (gsm8k for numeric tasks, reasoning_gym for countdown).
    ds = read_dataset([prepared[task]["test_path"]])
    responses = [f"Let me think.\n#### {r['extra_info']['answer']}" for r in ds]
    manager = RewardManager(RewardConfig())
    scores, extra, metrics = manager.score(list(ds), responses)
    assert extra["acc"] == [1.0] * len(ds)
    assert metrics["reward/failures"] == 0.0
    wrong = manager.score(list(ds)[:5], ["#### 123456789"] * 5)[1]["acc"]
    assert wrong == [0.0] * 5


def test_numeric_prompts_use_verls_gsm8k_instruction(prepared):
    row = _rows(prepared["basic_arithmetic"]["train_path"])[0]
    assert row["prompt"][0]["content"] == f"{row['extra_info']['question']} {GSM8K_INSTRUCTION}"
    assert GSM8K_INSTRUCTION == 'Let\'s think step by step and output the final answer after "####".'


def test_countdown_ground_truth_is_self_contained(prepared):
    row = _rows(prepared["countdown"]["train_path"])[0]
    gt = json.loads(row["reward_model"]["ground_truth"])
    meta = json.loads(row["extra_info"]["rg_metadata"])
    assert gt == {"numbers": meta["numbers"], "target": meta["target"]}
    assert "Do not include any other text" not in row["prompt"][0]["content"]  # contradicts ####


def test_basic_arithmetic_defaults_are_easy(prepared):
    rows = _rows(prepared["basic_arithmetic"]["train_path"])
    digits = set()
    for r in rows:
        m = re.fullmatch(r"Calculate (\d+) ([+-]) (\d+)\.", r["extra_info"]["question"])
        assert m, r["extra_info"]["question"]
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        assert 0 <= a <= 100 and 0 <= b <= 100
        assert r["reward_model"]["ground_truth"] == str(a + b if op == "+" else a - b)
        digits.add(json.loads(r["extra_info"]["rg_metadata"])["num_digits"])
    assert digits == {1, 2}


def test_task_kwargs_change_difficulty_and_instruction(tmp_path):
    info = prepare_dataset(
        "basic_arithmetic",
        tmp_path,
        train_size=60,
        test_size=10,
        task_kwargs={"min_terms": 3, "max_terms": 3, "operators": ["*"]},
        instruction="Answer after ####.",
    )
    row = _rows(info["train_path"])[0]
    q = row["extra_info"]["question"]
    assert re.fullmatch(r"Calculate \d+ \* \d+ \* \d+\.", q), q
    assert row["prompt"][0]["content"] == f"{q} Answer after ####."
    assert json.loads(row["extra_info"]["rg_config"])["operators"] == ["*"]


def test_overlap_removed_matches_an_independent_recount(tmp_path):
    # 2 one-digit terms with "+" only: 11 * 11 = 121 distinct questions, so the splits collide often
    kw = {"min_digits": 1, "max_digits": 1, "operators": ["+"]}
    info = prepare_dataset("basic_arithmetic", tmp_path, train_size=40, test_size=40, seed=5, task_kwargs=kw)
    test_q = {r["extra_info"]["question"] for r in _rows(info["test_path"])}
    gen_kw = {**info["task_kwargs"], "operators": ("+",)}
    gen = reasoning_gym.create_dataset("basic_arithmetic", seed=info["seeds"]["train"], size=1000, **gen_kw)
    kept, skipped, i = 0, 0, 0
    while kept < 40:
        if gen[i]["question"] in test_q:
            skipped += 1
        else:
            kept += 1
        i += 1
    assert skipped > 0 and info["overlap_removed"] == skipped
    assert not test_q & {r["extra_info"]["question"] for r in _rows(info["train_path"])}


def test_deterministic_per_seed(tmp_path):
    a = prepare_dataset("chain_sum", tmp_path / "a", train_size=30, test_size=5, seed=1)
    b = prepare_dataset("chain_sum", tmp_path / "b", train_size=30, test_size=5, seed=1)
    c = prepare_dataset("chain_sum", tmp_path / "c", train_size=30, test_size=5, seed=2)
    assert _rows(a["train_path"]) == _rows(b["train_path"])
    assert _rows(a["train_path"]) != _rows(c["train_path"])


def test_unknown_task_lists_the_available_ones(tmp_path):
    with pytest.raises(ValueError) as e:
        prepare_dataset("chain_sums", tmp_path)
    assert "Unknown task 'chain_sums'" in str(e.value) and "Did you mean 'chain_sum'" in str(e.value)
    for t in TASKS:
        assert t in str(e.value)


def test_bad_task_kwargs_and_sizes(tmp_path):
    with pytest.raises(ValueError, match="Unknown task_kwargs.*max_digit.*Valid keys:.*max_digits"):
        prepare_dataset("basic_arithmetic", tmp_path, task_kwargs={"max_digit": 3})
    with pytest.raises(ValueError, match="may not set 'seed'"):
        prepare_dataset("basic_arithmetic", tmp_path, task_kwargs={"seed": 3})
    with pytest.raises(ValueError, match="Invalid task_kwargs.*max_terms must be >= min_terms"):
        prepare_dataset("basic_arithmetic", tmp_path, task_kwargs={"min_terms": 3, "max_terms": 2})
    with pytest.raises(ValueError, match="train_size must be a positive integer"):
        prepare_dataset("basic_arithmetic", tmp_path, train_size=0)


def test_too_few_distinct_questions_is_a_clear_error(tmp_path):
    # one term, one digit: only "Calculate 0." .. "Calculate 10." -> the test split takes them all
    with pytest.raises(ValueError, match="too few distinct questions"):
        prepare_dataset(
            "basic_arithmetic",
            tmp_path,
            train_size=10,
            test_size=200,
            task_kwargs={"min_terms": 1, "max_terms": 1, "min_digits": 1, "max_digits": 1},
        )
