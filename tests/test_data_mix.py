"""Weighted mixes of training files: ``data.train_files`` with ``data.train_weights`` (issue 19, item 3).

Each prompt of a batch draws its file with the weights (seeded by ``data.seed`` and the batch number), and
the file serves its next row; the loader's state (batches served, rows served per file) is checkpointed,
so a resumed run continues with the very next batch. Bad weights are config errors before any model loads.
"""

from __future__ import annotations

import json
import math
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from rlplug.config.schema import ConfigError
from rlplug.data.dataset import (
    StatefulDataLoader,
    WeightedMixLoader,
    check_train_weights,
    make_train_loader,
    read_dataset,
)


def _source(name: str, n: int) -> list[dict]:
    return [{"source": f"{name}#{i}", "index": i} for i in range(n)]


def _mix(seed: int = 3, weights=(0.7, 0.3), batch_size: int = 8) -> WeightedMixLoader:
    return WeightedMixLoader([_source("a", 10), _source("b", 30)], list(weights), batch_size=batch_size, seed=seed)


def _ids(batch: list[dict]) -> list[str]:
    return [r["source"] for r in batch]


def test_the_empirical_mix_matches_the_weights():
    # 2000 batches x 8 prompts = 16000 draws of "a" with p = 0.7: the share's std is sqrt(0.7 * 0.3 / 16000)
    # = 0.0036, so a tolerance of 0.015 is over 4 standard deviations (the seed is fixed: the test is exact)
    loader, counts = _mix(), Counter()
    for _ in range(2000):
        counts.update(s.split("#")[0] for s in _ids(loader.next_batch()[0]))
    share_a = counts["a"] / 16000
    assert abs(share_a - 0.7) < 0.015, share_a
    assert math.sqrt(0.7 * 0.3 / 16000) < 0.004


def test_each_file_serves_all_its_rows_before_repeating_one():
    # file a (10 rows) is drawn about 0.7 x 8 = 5.6 times a batch: its first 10 draws are its 10 rows
    loader, served = _mix(), []
    while len(served) < 20:
        served += [s for s in _ids(loader.next_batch()[0]) if s.startswith("a#")]
    assert sorted(served[:10]) == sorted(f"a#{i}" for i in range(10))
    assert sorted(served[10:20]) == sorted(f"a#{i}" for i in range(10))
    assert served[:10] != served[10:20]  # the second pass is another permutation


def test_a_zero_weight_leaves_the_file_out_and_the_epoch_counts_the_weighted_rows():
    loader = _mix(weights=(1.0, 0.0))
    assert all(s.startswith("a#") for _ in range(50) for s in _ids(loader.next_batch()[0]))
    # steps_per_epoch: the rows of the weighted files over the batch size: 10 // 8 = 1; with both 40 // 8 = 5
    assert loader.steps_per_epoch == 1 and _mix().steps_per_epoch == 5
    loader = _mix()
    epochs = [loader.next_batch()[1] for _ in range(11)]
    assert epochs == [0] * 5 + [1] * 5 + [2]


def test_the_order_is_a_function_of_the_seed():
    a, b, c = _mix(seed=3), _mix(seed=3), _mix(seed=4)
    first = [_ids(a.next_batch()[0]) for _ in range(5)]
    assert first == [_ids(b.next_batch()[0]) for _ in range(5)]
    assert first != [_ids(c.next_batch()[0]) for _ in range(5)]


def test_resume_gives_the_same_order():
    ref = _mix()
    expected = [_ids(ref.next_batch()[0]) for _ in range(17)]
    first = _mix()
    for _ in range(7):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))  # as trainer_state.json stores it
    resumed = _mix()
    resumed.load_state_dict(state)
    assert [_ids(resumed.next_batch()[0]) for _ in range(10)] == expected[7:]


def test_resume_refuses_other_data_settings():
    state = _mix().state_dict()
    with pytest.raises(ValueError, match=r"weights: saved \[0.7, 0.3\], now \[0.5, 0.5\]"):
        _mix(weights=(0.5, 0.5)).load_state_dict(state)
    with pytest.raises(ValueError, match="seed: saved 3, now 4"):
        _mix(seed=4).load_state_dict(state)
    plain = StatefulDataLoader(_source("a", 10), batch_size=2)
    with pytest.raises(ValueError, match="checkpoint samples a weighted mix .* no data.train_weights"):
        plain.load_state_dict(state)
    with pytest.raises(ValueError, match="run without data.train_weights"):
        _mix().load_state_dict(plain.state_dict())


@pytest.mark.parametrize(
    "files, weights, message",
    [
        (["a", "b"], [0.7, -0.3], r"data.train_weights\[1\]=-0.3 \(for b\) must be a finite number >= 0"),
        (["a", "b"], [0.7, float("nan")], r"data.train_weights\[1\]=nan"),
        (["a", "b"], [1.0], r"has 1 weight\(s\) for 2 file\(s\).*data.train_weights=\[1.0,1.0\]"),
        (["a", "b"], [0, 0.0], "are all zero"),
        ([], [1.0], "no training files are set"),
        (["a", "a"], [0.5, 0.5], "lists a twice"),
    ],
)
def test_bad_weights_are_config_errors(files, weights, message):
    with pytest.raises(ConfigError, match=message):
        check_train_weights(files, weights)


def test_bad_weights_fail_in_validate_config_before_anything_loads(tmp_path):
    from rlplug.config.compose import compose
    from rlplug.run.validate import validate_config

    cfg = compose(
        ["debug=tiny", "data=files", "data.train_files=[a.parquet,b.parquet]", "data.val_files=[]",
         "data.train_weights=[0.7]", f"trainer.default_local_dir={tmp_path}"]
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"data.train_weights has 1 weight\(s\) for 2 file\(s\)"):
        validate_config(cfg)


def _write(path, n: int, source: str) -> str:
    prompt_t = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    rm_t = pa.struct([("style", pa.string()), ("ground_truth", pa.string())])
    table = pa.table(
        {
            "data_source": pa.array([source] * n),
            "prompt": pa.array([[{"role": "user", "content": f"{source} {i}"}] for i in range(n)], type=prompt_t),
            "reward_model": pa.array([{"style": "rule", "ground_truth": str(i)} for i in range(n)], type=rm_t),
        }
    )
    pq.write_table(table, path)
    return str(path)


def test_make_train_loader_groups_the_rows_by_file(tmp_path):
    a, b = _write(tmp_path / "a.parquet", 6, "a"), _write(tmp_path / "b.parquet", 4, "b")
    ds = read_dataset([a, b])
    cfg = OmegaConf.create(
        {
            "data": {
                "train_files": [a, b],
                "train_weights": [0.0, 2.0],
                "train_batch_size": 3,
                "shuffle": True,
                "seed": 1,
            }
        }
    )
    loader = make_train_loader(cfg, ds)
    assert isinstance(loader, WeightedMixLoader) and loader.names == [a, b]
    rows = [r for _ in range(4) for r in loader.next_batch()[0]]
    assert {r["data_source"] for r in rows} == {"b"}  # weight 0 for a
    assert sorted(r["source"] for r in rows[:4]) == sorted(f"{b}#{i}" for i in range(4))  # one pass over b
    cfg.data.train_weights = []
    assert isinstance(make_train_loader(cfg, ds), StatefulDataLoader)


def test_a_run_samples_the_mix_and_checkpoints_its_position(tmp_path):
    from _helpers import TINY_CPU_RUN, fit, run_config

    a = _write(tmp_path / "a.parquet", 8, "basic_arithmetic")
    b = _write(tmp_path / "b.parquet", 8, "chain_sum")
    cfg = run_config(
        [*TINY_CPU_RUN, "data=files", f"data.train_files=[{a},{b}]", "data.val_files=[]", "data.train_weights=[3,1]",
         "trainer.total_training_steps=2", "trainer.save_freq=1"],
        tmp_path / "run",
    )  # fmt: skip
    assert fit(cfg) == "finished"
    # the checkpoints hold the weighted loader's position: what a fresh loader has after 1 and 2 batches
    ds = read_dataset([a, b])
    ref = make_train_loader(cfg, ds)
    for step in (1, 2):
        ref.next_batch()
        saved = json.loads((tmp_path / "run" / f"global_step_{step}" / "trainer_state.json").read_text())
        assert saved["data_loader"] == json.loads(json.dumps(ref.state_dict()))
        assert saved["data_loader"]["batches"] == step and sum(saved["data_loader"]["cursors"]) == 2 * step
