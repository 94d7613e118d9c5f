"""``debug=tiny`` exercises the update of every algorithm preset (issue 14, item 6).

The tiny random model never answers a question right, so its correctness score is 0 for every
response; with nothing else in the score, group-based estimators (GRPO, RLOO, ReMax, ...) get
all-zero advantages and the actor's gradient is exactly 0 (the KL terms are 0 too at the first
step, where the policy equals the reference). ``configs/debug/tiny.yaml`` therefore adds a
deterministic shaping term with spread on random output (``length_penalty`` with a linear,
practically unfloored slope: ``-chars / 100``). This test runs one step of every preset found in
``configs/algorithm/`` with ``debug=tiny`` and nothing else about the reward, and asserts that the
scores differ and the actor was updated.
"""

from __future__ import annotations

import pytest
from _helpers import fit

import rlplug
from rlplug.config.compose import compose
from rlplug.config.schema import config_dir
from rlplug.contracts.registry import get_registry
from rlplug.run.validate import validate_config

PRESETS = sorted(p.stem for p in (config_dir() / "algorithm").glob("*.yaml"))

#: speed only: one step, no validation, one CPU thread; the reward and the model stay the preset's
FAST = [
    "debug=tiny",
    "trainer.total_training_steps=1",
    "trainer.val_before_train=false",
    "trainer.test_freq=0",
    "trainer.num_threads=1",
    "trainer.device=cpu",
]


class _Last:
    def __init__(self) -> None:
        self.metrics: dict[str, float] = {}

    @rlplug.hookimpl
    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        self.metrics = dict(metrics)


def test_presets_are_discovered():
    # the seven packaged presets at the time of writing; new ones are picked up automatically
    assert {"ppo", "ppo_dual_clip", "grpo", "dr_grpo", "rloo", "reinforce_pp", "remax"} <= set(PRESETS)


def test_tiny_reward_has_spread_without_overrides():
    cfg = compose(["debug=tiny"])
    shaping = [dict(s) for s in cfg.reward.shaping]
    assert [s["name"] for s in shaping] == ["length_penalty"]
    from rlplug.rewards.manager import RewardManager

    rows = [{"data_source": "basic_arithmetic", "ground_truth": "7"}] * 3
    # -len/100: 5 chars -> -0.05, 30 -> -0.30, 250 -> -2.50 (no floor in reach of 16 tokens)
    scores, _, _ = RewardManager(cfg.reward).score(rows, ["a" * 5, "b" * 30, "c" * 250])
    assert scores == pytest.approx([-0.05, -0.30, -2.50])


@pytest.mark.parametrize("preset", PRESETS)
def test_debug_tiny_updates_the_actor(preset, tmp_path):
    rec = _Last()
    pm = get_registry().pm
    pm.register(rec)
    try:
        cfg = compose([*FAST, f"algorithm={preset}", f"trainer.default_local_dir={tmp_path}"])
        validate_config(cfg)
        assert fit(cfg) == "finished"
    finally:
        pm.unregister(rec)
    m = rec.metrics
    assert m["critic/score/max"] > m["critic/score/min"], f"{preset}: every response got the same score"
    assert m["critic/advantages/max"] > m["critic/advantages/min"], f"{preset}: all advantages equal"
    assert m["actor/grad_norm"] > 0, f"{preset}: the actor's gradient is 0 under debug=tiny"


def test_readme_algorithm_table_lists_every_preset_with_its_source():
    # issue 16's done line: the README's algorithm table names every preset and where it comes from
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 5:
            rows[cells[0].strip("`")] = cells[4]
    assert set(PRESETS) <= set(rows), sorted(set(PRESETS) - set(rows))
    for preset in PRESETS:
        assert "arXiv" in rows[preset], (preset, rows[preset])
