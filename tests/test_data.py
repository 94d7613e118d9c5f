"""read_dataset (schema validation, verl GSM8K files, prompt-length filtering) and StatefulDataLoader."""

from __future__ import annotations

import json
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlplug.config.schema import RewardConfig
from rlplug.data.dataset import DatasetError, StatefulDataLoader, read_dataset
from rlplug.rewards.manager import RewardManager

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


# ---------------------------------------------------------------------------- helpers


def char_tokenizer():
    """A character-level HF fast tokenizer with a ChatML-like template (no download).

    Token count of a prompt with messages m_1..m_k and the generation prompt:
    sum_j (1 + len(role_j) + 1 + len(content_j) + 1 + 1) + (1 + len("assistant") + 1);
    for one user message with content of L characters: (1 + 4 + 1 + L + 1 + 1) + 11 = 19 + L.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for c in [chr(i) for i in range(32, 127)] + ["\n"]:
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    t = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    t.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return t


PROMPT_T = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
RM_T = pa.struct([("style", pa.string()), ("ground_truth", pa.string())])


def write(path, columns: dict, types: dict | None = None):
    types = types or {}
    defaults = {"data_source": pa.string(), "prompt": PROMPT_T, "ability": pa.string(), "reward_model": RM_T}
    arrays = {k: pa.array(v, type=types.get(k, defaults.get(k))) for k, v in columns.items()}
    pq.write_table(pa.table(arrays), path)
    return str(path)


def simple_rows(n=3, contents=None):
    contents = contents or [f"What is {i} + {i}?" for i in range(n)]
    return {
        "data_source": ["toy"] * len(contents),
        "prompt": [[{"role": "user", "content": c}] for c in contents],
        "ability": ["math"] * len(contents),
        "reward_model": [{"style": "rule", "ground_truth": str(2 * i)} for i in range(len(contents))],
    }


# ---------------------------------------------------------------------------- verl's GSM8K file

GSM8K_ROWS = [
    (
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?",
        "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72",
        "72",
    ),
    (
        "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?",
        "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10",
        "10",
    ),
    (
        "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total does it take?",
        "It takes 2/2=<<2/2=1>>1 bolt of white fiber\nSo the total amount of fabric is 2+1=<<2+1=3>>3 bolts of fabric\n#### 3",
        "3",
    ),
]


def write_verl_gsm8k(path, split="test"):
    """A parquet file exactly as verl's examples/data_preprocess/gsm8k.py writes it (field order included)."""
    schema = pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
            (
                "extra_info",
                pa.struct(
                    [("answer", pa.string()), ("index", pa.int64()), ("question", pa.string()), ("split", pa.string())]
                ),
            ),
        ]
    )
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"content": f"{q} {GSM8K_INSTRUCTION}", "role": "user"}],
            "ability": "math",
            "reward_model": {"ground_truth": gt, "style": "rule"},
            "extra_info": {"answer": a, "index": i, "question": q, "split": split},
        }
        for i, (q, a, gt) in enumerate(GSM8K_ROWS)
    ]
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return str(path)


def test_verl_gsm8k_file_reads_unchanged_and_scores_end_to_end(tmp_path):
    path = write_verl_gsm8k(tmp_path / "test.parquet")
    tok = char_tokenizer()
    ds = read_dataset([path], tokenizer=tok, max_prompt_length=1024)
    assert len(ds) == 3 and ds.data_sources == {"openai/gsm8k"} and ds.num_filtered == 0
    row = ds[0]
    assert row["messages"] == [{"role": "user", "content": f"{GSM8K_ROWS[0][0]} {GSM8K_INSTRUCTION}"}]
    assert row["ground_truth"] == "72" and row["ability"] == "math"
    assert row["extra_info"] == {"answer": GSM8K_ROWS[0][1], "index": 0, "question": GSM8K_ROWS[0][0], "split": "test"}
    assert (
        row["prompt_ids"]
        == tok.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=True)["input_ids"]
    )
    assert len(row["prompt_ids"]) == 19 + len(row["messages"][0]["content"])  # see char_tokenizer
    # scored by the default reward map (openai/gsm8k -> gsm8k, strict)
    responses = ["48/2 = 24, 48 + 24 = 72\n#### 72", "She earned $10.\n#### $10.00", "The answer is 3."]
    scores, extra, metrics = RewardManager(RewardConfig()).score(list(ds), responses)
    assert scores == [1.0, 1.0, 0.0]  # the third has no "####" (strict)
    assert extra["acc"] == [1.0, 1.0, 0.0] and metrics["reward/failures"] == 0.0


# ---------------------------------------------------------------------------- validation errors


def _error(path, **kw) -> str:
    with pytest.raises(DatasetError) as e:
        read_dataset([path], **kw)
    return str(e.value)


def test_missing_column_names_file_and_column(tmp_path):
    cols = simple_rows()
    del cols["reward_model"]
    p = write(tmp_path / "a.parquet", cols)
    msg = _error(p)
    assert p in msg and "column 'reward_model'" in msg and "missing required column" in msg
    assert "Columns present: data_source, prompt, ability" in msg


def test_prompt_key_selects_the_column(tmp_path):
    cols = simple_rows()
    cols["question_msgs"] = cols.pop("prompt")
    p = write(tmp_path / "a.parquet", cols, {"question_msgs": PROMPT_T})
    assert "data.prompt_key" in _error(p)
    assert len(read_dataset(p, prompt_key="question_msgs")) == 3


@pytest.mark.parametrize(
    "column, values, typ, expected",
    [
        ("data_source", [1, 2, 3], pa.int64(), "expected string"),
        (
            "prompt",
            [["a"], ["b"], ["c"]],
            pa.list_(pa.string()),
            "expected list<struct<role: string, content: string>>",
        ),
        ("reward_model", ["1", "2", "3"], pa.string(), "expected struct<style: string, ground_truth: string>"),
        ("ability", [1, 2, 3], pa.int64(), "expected string"),
    ],
)
def test_wrong_column_type(tmp_path, column, values, typ, expected):
    cols = simple_rows()
    cols[column] = values
    p = write(tmp_path / "a.parquet", cols, {column: typ})
    msg = _error(p)
    assert p in msg and f"column '{column}'" in msg and expected in msg


@pytest.mark.parametrize(
    "contents_row1, expected",
    [
        ([{"role": "user", "content": "   \n"}], "empty or whitespace only"),
        ([], "empty list"),
        ([{"role": "system", "content": "be nice"}], "empty or whitespace only"),
        ([{"role": "bot", "content": "hi"}], "role 'bot'; allowed roles: system, user, assistant, tool"),
        ([{"role": "user", "content": None}], "expected a string"),
        ([{"role": "user", "content": "ring\x07bell"}], "control character U+0007 at position 4"),
    ],
)
def test_bad_prompt_rows_name_the_row(tmp_path, contents_row1, expected):
    cols = simple_rows()
    cols["prompt"][1] = contents_row1
    p = write(tmp_path / "a.parquet", cols)
    msg = _error(p)
    assert f"{p}, row 1, column 'prompt" in msg and expected in msg


def test_ground_truth_numbers_are_converted_other_types_rejected(tmp_path):
    cols = simple_rows()
    cols["reward_model"] = [{"style": "rule", "ground_truth": v} for v in (72, 3, -5)]
    p = write(
        tmp_path / "int.parquet",
        cols,
        {"reward_model": pa.struct([("style", pa.string()), ("ground_truth", pa.int64())])},
    )
    assert [r["ground_truth"] for r in read_dataset(p)] == ["72", "3", "-5"]
    cols["reward_model"] = [{"style": "rule", "ground_truth": v} for v in (72.0, 0.5, 1e20)]
    p = write(
        tmp_path / "float.parquet",
        cols,
        {"reward_model": pa.struct([("style", pa.string()), ("ground_truth", pa.float64())])},
    )
    assert [r["ground_truth"] for r in read_dataset(p)] == ["72", "0.5", "100000000000000000000"]
    cols["reward_model"] = [{"style": "rule", "ground_truth": v} for v in ([1], [2], [3])]
    p = write(
        tmp_path / "list.parquet",
        cols,
        {"reward_model": pa.struct([("style", pa.string()), ("ground_truth", pa.list_(pa.int64()))])},
    )
    msg = _error(p)
    assert f"{p}, row 0, column 'reward_model.ground_truth'" in msg and "expected a string" in msg
    cols["reward_model"] = [{"style": "rule", "ground_truth": v} for v in ("1", None, "3")]
    p = write(tmp_path / "null.parquet", cols)
    assert "row 1, column 'reward_model.ground_truth'" in _error(p)
    cols["reward_model"] = [{"style": "rule", "ground_truth": v} for v in (1.0, 2.0, float("nan"))]
    p = write(
        tmp_path / "nan.parquet",
        cols,
        {"reward_model": pa.struct([("style", pa.string()), ("ground_truth", pa.float64())])},
    )
    assert "row 2" in _error(p)


def test_invalid_utf8_names_the_row(tmp_path):
    cols = simple_rows()
    # .view() reinterprets bytes as string without validating: how a broken writer produces such a file
    cols["data_source"] = pa.array([b"ok", b"\xff\xfebad", b"ok"], pa.binary()).view(pa.string())
    p = str(tmp_path / "a.parquet")
    pq.write_table(
        pa.table(
            {
                k: (
                    v
                    if isinstance(v, pa.Array)
                    else pa.array(v, type={"prompt": PROMPT_T, "reward_model": RM_T}.get(k))
                )
                for k, v in cols.items()
            }
        ),
        p,
    )
    msg = _error(p)
    assert f"{p}, row 1, column 'data_source'" in msg and "not valid UTF-8" in msg


def test_empty_data_source_and_control_chars_in_ground_truth(tmp_path):
    cols = simple_rows()
    cols["data_source"][2] = " "
    assert "row 2, column 'data_source'" in _error(write(tmp_path / "a.parquet", cols))
    cols = simple_rows()
    cols["reward_model"][0]["ground_truth"] = "7\x00"
    assert "row 0, column 'reward_model.ground_truth'" in _error(write(tmp_path / "b.parquet", cols))


def test_unreadable_files(tmp_path):
    assert "file not found" in _error(str(tmp_path / "nope.parquet"))
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"this is not parquet")
    assert "not a readable parquet file" in _error(str(bad))
    empty = write(tmp_path / "empty.parquet", simple_rows(contents=["x"]))
    pq.write_table(pq.read_table(empty).slice(0, 0), empty)
    assert "no rows" in _error(empty)


# ---------------------------------------------------------------------------- rows, prompts, lengths


def test_rows_from_several_files_system_prompt_and_plain_string_prompts(tmp_path):
    a = write(tmp_path / "a.parquet", simple_rows(2))
    cols = simple_rows(2)
    cols["prompt"] = ["plain question one", "plain question two"]
    cols["data_source"] = ["other", "other"]
    b = write(tmp_path / "b.parquet", cols, {"prompt": pa.string()})
    c_cols = simple_rows(1)
    c_cols["prompt"] = [[{"role": "system", "content": "own"}, {"role": "user", "content": "q"}]]
    c = write(tmp_path / "c.parquet", c_cols)
    ds = read_dataset([a, b, c], system_prompt="Be brief.")
    assert len(ds) == 5 and ds.data_sources == {"toy", "other"}
    assert [r["index"] for r in ds] == [0, 1, 2, 3, 4]
    assert ds[2]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "plain question one"},
    ]
    assert ds[4]["messages"][0] == {"role": "system", "content": "own"}  # a row's own system message is kept
    assert ds[0]["extra_info"] == {} and ds[3]["source"] == f"{b}#1"
    assert "prompt_ids" not in ds[0]


def test_overlong_prompts_filtered_and_counted(tmp_path, caplog):
    # contents of 3, 6, 7 and 20 characters -> 22, 25, 26, 39 tokens (19 + L); limit 25 keeps two
    p = write(tmp_path / "a.parquet", simple_rows(contents=["abc", "abcdef", "abcdefg", "a" * 20]))
    tok = char_tokenizer()
    with caplog.at_level(logging.WARNING, logger="rlplug.data.dataset"):
        ds = read_dataset(p, tokenizer=tok, max_prompt_length=25)
    assert len(ds) == 2 and ds.num_filtered == 2
    assert [len(r["prompt_ids"]) for r in ds] == [22, 25]
    assert any("filtered 2 of 4 prompts longer than max_prompt_length=25" in r.getMessage() for r in caplog.records)
    msg = _error(p, tokenizer=tok, max_prompt_length=25, filter_overlong_prompts=False)
    assert f"{p}, row 2, column 'prompt'" in msg and "26 tokens" in msg
    assert "all 4 prompts are longer" in _error(p, tokenizer=tok, max_prompt_length=5)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        read_dataset(p, max_prompt_length=25)


# ---------------------------------------------------------------------------- loader


class _Rows(list):
    pass


def _dataset(n):
    return _Rows({"index": i, "ground_truth": str(i)} for i in range(n))


def _ids(batch):
    return [r["index"] for r in batch]


def test_loader_epochs_are_seeded_permutations():
    ds = _dataset(10)
    loader = StatefulDataLoader(ds, batch_size=3, seed=7, drop_last=True)
    assert loader.steps_per_epoch == 3 and len(loader) == 3
    batches = [loader.next_batch() for _ in range(6)]
    assert [e for _, e in batches] == [0, 0, 0, 1, 1, 1]
    for epoch in (0, 1):
        order = np.random.default_rng([7, epoch]).permutation(10).tolist()
        got = sum((_ids(b) for b, e in batches if e == epoch), [])
        assert got == order[:9]  # drop_last: the 10th row of the epoch is skipped
    assert sum((_ids(b) for b, e in batches if e == 0), []) != sum((_ids(b) for b, e in batches if e == 1), [])
    other = StatefulDataLoader(ds, batch_size=3, seed=7)
    assert [_ids(other.next_batch()[0]) for _ in range(6)] == [_ids(b) for b, _ in batches]


def test_loader_keep_last_and_no_shuffle():
    loader = StatefulDataLoader(_dataset(7), batch_size=3, shuffle=False, drop_last=False)
    assert loader.steps_per_epoch == 3
    assert [_ids(b) for b in loader] == [[0, 1, 2], [3, 4, 5], [6]]
    assert loader.epoch == 0 and loader.index == 3
    assert [_ids(b) for b in loader] == [[0, 1, 2], [3, 4, 5], [6]]  # next epoch
    assert loader.epoch == 1


def test_loader_resume_continues_with_the_exact_next_batch_across_epochs():
    ds = _dataset(11)
    ref = StatefulDataLoader(ds, batch_size=4, seed=3)  # 2 steps per epoch, 3 rows dropped each epoch
    expected = [(_ids(b), e) for b, e in (ref.next_batch() for _ in range(9))]
    for k in range(8):  # k = 2, 4, 6: exactly at an epoch boundary
        first = StatefulDataLoader(ds, batch_size=4, seed=3)
        for _ in range(k):
            first.next_batch()
        state = json.loads(json.dumps(first.state_dict()))  # as stored in a checkpoint
        resumed = StatefulDataLoader(ds, batch_size=4, seed=3)
        resumed.load_state_dict(state)
        got = [(_ids(b), e) for b, e in (resumed.next_batch() for _ in range(9 - k))]
        assert got == expected[k:], k
    boundary = StatefulDataLoader(ds, batch_size=4, seed=3)
    boundary.load_state_dict({"epoch": 0, "index": 2})
    assert [_ids(b) for b in boundary] == [expected[2][0], expected[3][0]]  # iterating continues into epoch 1


def test_loader_state_mismatch_and_bad_settings():
    loader = StatefulDataLoader(_dataset(10), batch_size=3)
    state = loader.state_dict()
    with pytest.raises(ValueError, match="batch_size: saved 3, now 2.*data.train_batch_size"):
        StatefulDataLoader(_dataset(10), batch_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="out of range"):
        loader.load_state_dict({"epoch": 0, "index": 4})
    with pytest.raises(ValueError, match="'epoch' and 'index'"):
        loader.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match="fewer than batch_size=16"):
        StatefulDataLoader(_dataset(10), batch_size=16)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        StatefulDataLoader(_dataset(10), batch_size=0)


def test_loader_batches_are_copies():
    ds = _dataset(4)
    batch, _ = StatefulDataLoader(ds, batch_size=2).next_batch()
    batch[0]["response"] = "x"
    assert all("response" not in r for r in ds)
