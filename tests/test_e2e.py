"""End to end on CPU: every algorithm preset trains 3 steps through the real loop.

Tiny random-weight model (1 layer, the real SmolLM2 tokenizer), ``hf`` rollout, ``local``
backend, 2 prompts per step, responses of at most 8 tokens. Metrics are captured by a plugin
implementing ``on_step_end`` registered on the process registry, as a third-party plugin would.
Each preset must produce finite losses, the verl metric names, checkpoints and a final model
whose weights moved away from the initial ones. The score is the gsm8k correctness plus a
length shaping term, so responses get different scores and every estimator has a signal.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import rlplug
from rlplug.config.compose import compose
from rlplug.contracts.registry import get_registry
from rlplug.run.checkpoint import CheckpointManager
from rlplug.run.trainer import Trainer
from rlplug.run.validate import validate_config

BASE = [
    "debug=tiny",
    "model.tiny.num_hidden_layers=1",
    "data.train_size=64",
    "data.train_batch_size=2",
    "actor.ppo_mini_batch_size=1",
    "actor.micro_batch_size_per_device=1",
    "data.max_response_length=8",
    "data.val_max_samples=4",
    "trainer.total_training_steps=3",
    "trainer.save_freq=2",
    "trainer.test_freq=3",
    "trainer.val_before_train=false",
    "trainer.logger=[console]",
    "trainer.num_threads=1",
    "trainer.device=cpu",  # the CPU path on every machine (auto would pick a GPU)
    "actor.optim.lr=1e-4",  # pinned: asserted below, whatever debug=tiny/experiment defaults become
    "actor.optim.lr_warmup_steps=0",
    # A random model never answers right (correctness 0 for all), which gives group estimators
    # all-zero advantages; a length shaping term (-chars/50, floored at -1) makes scores differ.
    "reward.shaping=[{name:length_penalty,weight:1.0}]",
    "+reward.kwargs.length_penalty={target_chars:0,scale_chars:50.0}",
]

PRESETS = ["ppo", "ppo_dual_clip", "grpo", "dr_grpo", "rloo", "reinforce_pp", "remax"]

# Every preset; values must be finite (the losses among them).
COMMON = [
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/grad_norm",
    "actor/lr",
    "critic/score/mean",
    "critic/advantages/mean",
    "critic/returns/mean",
    "response_length/mean",
    "timing_s/gen",
    "timing_s/step",
    "perf/throughput",
    "training/global_step",
    "training/epoch",
]
CRITIC = [
    "critic/vf_loss",
    "critic/vf_clipfrac",
    "critic/grad_norm",
    "critic/lr",
    "critic/values/mean",
    "critic/vf_explained_var",
]
PER_PRESET = {
    "ppo": CRITIC,
    "ppo_dual_clip": CRITIC,
    "grpo": ["actor/kl_loss", "timing_s/ref"],  # KL to the reference as a loss term
    "dr_grpo": [],
    "rloo": ["actor/reward_kl_penalty", "actor/kl_coef", "timing_s/ref"],  # KL in the reward
    "reinforce_pp": ["actor/reward_kl_penalty", "actor/kl_coef", "timing_s/ref"],
    "remax": ["actor/reward_kl_penalty", "actor/kl_coef", "timing_s/ref", "timing_s/gen_baseline"],
}
VAL_KEY = "val-core/basic_arithmetic/acc/mean@1"


class StepRecorder:
    """A plugin object recording each step's metrics (``on_step_end``) and saved checkpoints."""

    def __init__(self) -> None:
        self.steps: dict[int, dict[str, float]] = {}
        self.saved: list[tuple[int, str]] = []

    @rlplug.hookimpl
    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        self.steps[step] = dict(metrics)

    @rlplug.hookimpl
    def on_checkpoint_saved(self, step: int, path: str) -> None:
        self.saved.append((step, path))


@pytest.fixture
def recorder():
    rec = StepRecorder()
    pm = get_registry().pm
    pm.register(rec)
    try:
        yield rec
    finally:
        pm.unregister(rec)


def _train(overrides: list[str]):
    cfg = compose(overrides)
    validate_config(cfg)
    OmegaConf.set_readonly(cfg, False)
    trainer = Trainer(cfg)
    try:
        status = trainer.fit()
        use_critic = trainer.use_critic
    finally:
        trainer.close()
    return cfg, status, use_critic


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_trains_three_steps(preset, recorder, tmp_path):
    from safetensors.torch import load_file

    from rlplug.training.models import resolve_model_path

    cfg, status, use_critic = _train(BASE + [f"algorithm={preset}", f"trainer.default_local_dir={tmp_path}"])
    assert status == "finished"
    assert use_critic == (preset in ("ppo", "ppo_dual_clip"))
    assert sorted(recorder.steps) == [1, 2, 3]

    for step, m in recorder.steps.items():
        expected = COMMON + PER_PRESET[preset] + ([VAL_KEY] if step == 3 else [])
        missing = [k for k in expected if k not in m]
        assert not missing, f"{preset} step {step}: missing metrics {missing}"
        bad = {k: m[k] for k in expected if not math.isfinite(m[k])}
        assert not bad, f"{preset} step {step}: non-finite {bad}"
        if not use_critic:
            assert "critic/vf_loss" not in m
        assert m["training/global_step"] == step
        assert m["actor/lr"] == pytest.approx(1e-4)  # constant lr 1e-4, no warmup
        assert m["actor/nonfinite_skipped"] == 0
        assert m["actor/grad_norm"] > 0
        assert 0.0 <= m["actor/pg_clipfrac"] <= 1.0
        assert 1.0 <= m["response_length/mean"] <= 8.0  # max_response_length=8
        assert -1.0 <= m["critic/score/mean"] <= 1.0  # correctness 0/1 + shaping in [-1, 0]
        assert m["critic/shaping/length_penalty/mean"] < 0  # every response has characters
        assert m["perf/throughput"] > 0 and m["timing_s/gen"] > 0
        assert m["training/epoch"] == 0  # debug=tiny: 64 rows, 32 steps per epoch at batch 2
    assert 0.0 <= recorder.steps[3][VAL_KEY] <= 1.0

    # checkpoints at save_freq=2 and at the last step, complete, announced to plugins
    manager = CheckpointManager(tmp_path)
    assert manager.complete_steps() == [2, 3] and manager.partial_dirs() == []
    assert [s for s, _ in recorder.saved] == [2, 3]
    assert manager.latest() == tmp_path / "global_step_3"
    ckpt_actor = load_file(str(tmp_path / "global_step_3" / "backend" / "actor" / "model.safetensors"))
    assert (tmp_path / "global_step_3" / "backend" / "critic").is_dir() == use_critic

    # the exported final model is the last checkpoint's actor, and training moved it
    final = load_file(str(tmp_path / "final_model" / "model.safetensors"))
    initial = load_file(str(Path(resolve_model_path(cfg.model)) / "model.safetensors"))
    for name, tensor in ckpt_actor.items():
        assert torch.equal(final[name], tensor), name
    moved = [k for k in initial if not torch.equal(initial[k], final[k])]
    assert moved, f"{preset}: 3 updates at lr 1e-4 left every weight unchanged"


def test_rlplug_train_cli_debug_tiny_runs(tmp_path):
    """The documented smoke command, in-process through the CLI entry point (exit code 0)."""
    from rlplug.cli import main

    rc = main(
        [
            "train",
            "debug=tiny",
            "model.tiny.num_hidden_layers=1",
            "data.max_response_length=8",
            "trainer.logger=[console]",
            "trainer.num_threads=1",
            f"trainer.default_local_dir={tmp_path}",
        ]
    )
    assert rc == 0
    assert CheckpointManager(tmp_path).complete_steps() == [2]  # debug=tiny: 2 steps, save_freq=2
    assert (tmp_path / "final_model" / "config.json").is_file()
