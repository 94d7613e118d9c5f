"""Slow end-to-end check (``-m slow``, its own CI step): 2 real steps of the default experiment.

The real SmolLM2-135M-Instruct (converted from the GGUF once), the vLLM rollout with weight
pushes, the critic, validation, a checkpoint and the final export, through the CLI exactly as a
user runs it, with only sizes reduced.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1800)]


def test_default_experiment_two_real_steps(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "rlplug",
        "train",
        "trainer.total_training_steps=2",
        "trainer.test_freq=2",
        "trainer.save_freq=2",
        "data.val_max_samples=16",
        "data.train_batch_size=16",
        "actor.ppo_mini_batch_size=8",
        "actor.micro_batch_size_per_device=8",
        "data.max_response_length=64",
        "trainer.critic_warmup=1",
        f"trainer.default_local_dir={run_dir}",
        "trainer.logger=[console,mlflow]",
        "trainer.device=cpu",
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    # the default experiment's plugins were resolved and reported
    assert "algorithm.adv_estimator=gae" in out and "rollout.name=vllm" in out
    # two training steps with finite metrics: the critic trains from step 1, the actor from step 2
    # (trainer.critic_warmup=1), a validation before and after training
    steps = {}
    for m in re.finditer(r"^step (\d+) \| (score .*)$", out, re.M):
        fields = dict(f.strip().split(" ", 1) for f in m.group(2).split("|") if " " in f.strip())
        steps[int(m.group(1))] = fields
    assert sorted(steps) == [1, 2], out[-3000:]
    assert "pg_loss" not in steps[1] and "vf_loss" in steps[1]
    for key in ("score", "vf_loss", "pg_loss", "grad_norm"):
        assert abs(float(steps[2][key])) < 1e6, steps[2]
    assert len(re.findall(r"^validation @ step (0|2):", out, re.M)) == 2
    ckpt = run_dir / "global_step_2"
    assert (ckpt / "COMPLETE").is_file() and (run_dir / "latest_checkpointed_iteration.txt").read_text() == "2"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    assert (run_dir / "final_model" / "config.json").is_file()
    assert (run_dir / "mlflow.db").is_file()
