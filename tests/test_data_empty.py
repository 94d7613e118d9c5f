"""An empty dataset says it is empty: a train or validation file with 0 rows (written by pandas, whose
empty columns lack verl's types, or by pyarrow), a file of a weighted mix, and a filter that leaves
nothing. The message names the file, its setting, 0 rows and what to do; the config-time check
(``validate_config``, which ``rlplug train`` runs first) refuses an empty file before any model is built.
"""

from __future__ import annotations

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _helpers import TINY_CPU_RUN
from omegaconf import OmegaConf

from rlplug.config.compose import compose
from rlplug.data.dataset import DatasetError, read_dataset, read_run_datasets
from rlplug.data.prepare import parquet_schema

VERL_COLUMNS = ("data_source", "prompt", "ability", "reward_model", "extra_info")


def verl_rows(contents: list[str]) -> list[dict]:
    """One row in verl's schema per user message text."""
    return [
        {
            "data_source": "toy",
            "prompt": [{"role": "user", "content": c}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "1"},
            "extra_info": {"split": "train", "index": i},
        }
        for i, c in enumerate(contents)
    ]


def write_rows(path, contents: list[str]) -> str:
    pq.write_table(pa.Table.from_pylist(verl_rows(contents)), path)
    return str(path)


#: the ways a user writes an empty file in verl's row schema
EMPTY_WRITERS = {
    # pd.DataFrame({"prompt": [], ...}): pandas 3 types the empty columns float64 (pandas 2: object -> null)
    "pandas-empty-lists": lambda path: pd.DataFrame({c: [] for c in VERL_COLUMNS}).to_parquet(path),
    # object columns: pyarrow's null type
    "pandas-object": lambda path: pd.DataFrame({c: pd.Series([], dtype=object) for c in VERL_COLUMNS}).to_parquet(path),
    # a frame of real rows filtered down to none: string columns keep a type, the nested ones become null
    "pandas-filtered": lambda path: pd.DataFrame(verl_rows(["q"])).iloc[:0].to_parquet(path),
    # pyarrow with verl's schema (what 'rlplug data prepare' writes)
    "pyarrow": lambda path: pq.write_table(pa.Table.from_pylist([], schema=parquet_schema()), path),
}


@pytest.fixture(scope="module")
def cfg():
    """The tiny test model's run config (its tokenizer is the ``tok`` fixture of conftest.py)."""
    return compose([*TINY_CPU_RUN])


@pytest.mark.parametrize("writer", sorted(EMPTY_WRITERS))
@pytest.mark.parametrize("setting", ["data.train_files", "data.val_files"])
def test_an_empty_file_says_it_has_no_rows(tmp_path, writer, setting):
    empty = tmp_path / "empty.parquet"
    EMPTY_WRITERS[writer](empty)
    assert pq.read_metadata(empty).num_rows == 0
    good = write_rows(tmp_path / "good.parquet", ["What is 1+1?"])
    with pytest.raises(DatasetError) as info:
        read_dataset([good, str(empty)], setting=setting)
    msg = str(info.value)
    assert msg.startswith(f"{empty} ({setting}): the file has no rows (0 rows)")
    assert f"or remove it from {setting}." in msg
    assert ("as pandas writes the columns of an empty DataFrame" in msg) == writer.startswith("pandas")
    assert "has type" not in msg  # not a column-type complaint


@pytest.mark.parametrize("writer", ["pandas-empty-lists", "pandas-object", "pyarrow"])
@pytest.mark.parametrize("key", ["train_files", "val_files"])
def test_rlplug_train_refuses_an_empty_file_before_building_a_model(tmp_path, monkeypatch, capsys, writer, key):
    """``rlplug train`` with an empty train or validation file: exit code BAD_INPUT and the message,
    from the config-time check, before the (tiny) model is built or the tokenizer is loaded."""
    from rlplug import cli, models
    from rlplug.base.exit_codes import ExitCode

    def no_model(*args, **kwargs):
        raise AssertionError("a model was built before the empty file was refused")

    monkeypatch.setattr(models, "tiny_model_dir", no_model)
    monkeypatch.setattr(models, "load_tokenizer", no_model)
    empty = tmp_path / "empty.parquet"
    EMPTY_WRITERS[writer](empty)
    good = write_rows(tmp_path / "good.parquet", ["What is 1+1?", "What is 2+2?"])
    files = {"train_files": good, "val_files": good, key: str(empty)}
    code = cli.main(
        [
            "train",
            *TINY_CPU_RUN,
            "data.task=null",
            f"data.train_files=[{files['train_files']}]",
            f"data.val_files=[{files['val_files']}]",
            f"trainer.default_local_dir={tmp_path / 'run'}",
        ]
    )
    err = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert code == ExitCode.BAD_INPUT
    assert f"{empty} (data.{key}): the file has no rows (0 rows)" in err
    assert f"remove it from data.{key}." in err


def test_an_empty_file_of_a_weighted_mix_is_refused_at_config_time(tmp_path):
    from rlplug.run.validate import validate_config

    good = write_rows(tmp_path / "good.parquet", ["What is 1+1?", "What is 2+2?"])
    empty = tmp_path / "empty.parquet"
    EMPTY_WRITERS["pandas-object"](empty)
    cfg = compose(
        [
            *TINY_CPU_RUN,
            "data.task=null",
            f"data.train_files=[{good},{empty}]",
            "data.train_weights=[0.5,0.5]",
            f"trainer.default_local_dir={tmp_path / 'run'}",
        ]
    )
    with pytest.raises(DatasetError) as info:
        validate_config(cfg)
    msg = str(info.value)
    assert msg.startswith(f"{empty} (data.train_files): the file has no rows (0 rows)")
    assert msg.endswith("or remove it from data.train_files and its weight from data.train_weights.")


def _prompt_len(tok, content: str) -> int:
    """Tokens of a one-message prompt after the chat template (the reader's count, independently)."""
    out = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True)
    return len(out["input_ids"] if "input_ids" in out else out)


def test_a_weighted_file_whose_prompts_are_all_filtered_is_named(tmp_path, cfg, tok):
    short = ["What is 1+1?", "What is 2+2?", "What is 3+3?"]
    long = ["How much is " + "one plus " * k + "one?" for k in (20, 12, 30)]
    limit = max(_prompt_len(tok, c) for c in short)
    shortest = _prompt_len(tok, long[1])  # 12 repeats: the shortest of the long ones
    assert shortest > limit
    a = write_rows(tmp_path / "a.parquet", short)
    b = write_rows(tmp_path / "b.parquet", long)
    run = compose(
        [
            *TINY_CPU_RUN,
            "data.task=null",
            f"data.train_files=[{a},{b}]",
            "data.train_weights=[0.7,0.3]",
            f"data.max_prompt_length={limit}",
        ]
    )
    with pytest.raises(DatasetError) as info:
        read_run_datasets(run, tok)
    assert str(info.value) == (
        f"{b} (data.train_files[1]): 0 of 3 rows left, all its prompts are longer than data.max_prompt_length="
        f"{limit} tokens after the chat template (the shortest is {shortest} tokens), but data.train_weights[1]=0.3 "
        f"samples it. Raise data.max_prompt_length to at least {shortest}, or give the file the weight 0."
    )
    # with the weight 0 the file is left out, and the run's data loads (the short file's 3 rows)
    OmegaConf.set_readonly(run, False)
    run.data.train_weights = [0.7, 0.0]
    train, _ = read_run_datasets(run, tok)
    assert len(train) == 3 and train.file_stats[b] == {"rows": 3, "kept": 0, "shortest_filtered": shortest}


def test_a_validation_set_filtered_to_nothing_names_its_setting(tmp_path, cfg, tok):
    a = write_rows(tmp_path / "a.parquet", ["What is 1+1?", "What is 2+2?"])
    v = write_rows(tmp_path / "v.parquet", ["How much is " + "one plus " * k + "one?" for k in (9, 5)])
    limit = _prompt_len(tok, "What is 1+1?")
    shortest = _prompt_len(tok, "How much is " + "one plus " * 5 + "one?")
    run = compose(
        [
            *TINY_CPU_RUN,
            "data.task=null",
            f"data.train_files=[{a}]",
            f"data.val_files=[{v}]",
            f"data.max_prompt_length={limit}",
        ]
    )
    with pytest.raises(DatasetError) as info:
        read_run_datasets(run, tok)
    assert str(info.value) == (
        f"{v} (data.val_files): no rows left, all 2 prompts are longer than data.max_prompt_length={limit} tokens "
        f"after the chat template (the shortest is {shortest} tokens). Raise data.max_prompt_length to at least "
        f"{shortest}, or use shorter prompts."
    )
