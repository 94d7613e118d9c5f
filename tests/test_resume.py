"""Exact resume: 4 steps in one go == 2 steps, stop, resume, 2 more -- bit for bit.

Runs are in-process (``Trainer(cfg).fit()``, tiny 1-layer model, hf rollout, local backend). The
stop is the real graceful-stop path: a plugin's ``on_step_end`` sends SIGTERM to this process
after step 2, the trainer's handler lets the step finish, writes a checkpoint and returns
``"interrupted"``; a new Trainer on the same directory resumes (``trainer.resume_mode=auto``).

Compared per step: every metric except wall-clock ones (``timing_s/*``, ``perf/throughput``,
``perf/gen_tokens_per_s``), the data rows served, and at the end every parameter of the actor
and the critic (``torch.equal``). The cases make each piece of checkpointed state matter:

* PPO with a critic, KL penalty in the reward with the adaptive controller, ``critic_warmup=3``
  (actor frozen for 3 steps), epochs of 2 steps, stopped exactly at the epoch boundary;
* a GRPO variant whose advantage estimator adds noise from the global torch/numpy/python RNGs
  (so an unrestored RNG changes the result), a cosine learning-rate schedule with warmup
  (scheduler state), epochs of 3 steps, stopped mid-epoch so the resumed run crosses the boundary;
* ``trainer.resume_mode=resume_path`` from an older checkpoint of a finished run, which replays
  (and re-saves) steps 2..4 and must reproduce them.
"""

from __future__ import annotations

import math
import os
import random
import signal

import numpy as np
import pytest
import torch
from _helpers import LENGTH_SHAPING, TINY_CPU_RUN, WALL_CLOCK, run_config

import rlplug
from rlplug.contracts.registry import get_registry
from rlplug.contracts.types import AdvantageEstimator
from rlplug.run.checkpoint import CheckpointManager
from rlplug.run.trainer import Trainer

BASE = TINY_CPU_RUN + [  # on CPU: bitwise comparisons need its deterministic kernels
    "actor.ppo_mini_batch_size=1",
    "actor.micro_batch_size_per_device=1",
    "trainer.total_training_steps=4",
    "trainer.save_freq=0",  # checkpoints only when stopping and at the end
    "trainer.logger=[]",
    *LENGTH_SHAPING,  # scores differ between responses
]


class _Recorder:
    def __init__(self, stop_after: int | None) -> None:
        self.stop_after = stop_after
        self.steps: dict[int, dict[str, float]] = {}

    @rlplug.hookimpl
    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        self.steps[step] = dict(metrics)
        if step == self.stop_after:
            os.kill(os.getpid(), signal.SIGTERM)  # handled by the trainer: finish the step, save, stop


def _run(overrides: list[str], run_dir, stop_after: int | None = None):
    """One training run; returns (status, metrics per step, rows served per step, final weights)."""
    cfg = run_config(overrides, run_dir)
    rec = _Recorder(stop_after)
    get_registry().pm.register(rec)
    rows_served: dict[int, tuple[int, list[int]]] = {}
    trainer = Trainer(cfg)
    try:
        serve = trainer.loader.next_batch

        def recording_next_batch():
            rows, epoch = serve()
            rows_served[trainer.global_step + 1] = (epoch, [r["index"] for r in rows])
            return rows, epoch

        trainer.loader.next_batch = recording_next_batch
        status = trainer.fit()
        weights = {f"actor/{k}": v.detach().clone() for k, v in trainer.backend.actor.model.state_dict().items()}
        if trainer.backend.critic is not None:
            weights.update(
                {f"critic/{k}": v.detach().clone() for k, v in trainer.backend.critic.model.state_dict().items()}
            )
    finally:
        get_registry().pm.unregister(rec)
        trainer.close()
    return status, rec.steps, rows_served, weights


def _assert_same_metrics(expected: dict[int, dict], got: dict[int, dict]) -> None:
    assert sorted(got) == sorted(expected)
    for step in expected:
        keys = {k for k in expected[step] if not k.startswith(WALL_CLOCK)}
        assert keys == {k for k in got[step] if not k.startswith(WALL_CLOCK)}, step
        differ = {
            k: (expected[step][k], got[step][k])
            for k in keys
            if not (expected[step][k] == got[step][k] or (math.isnan(expected[step][k]) and math.isnan(got[step][k])))
        }
        assert not differ, f"step {step}: {differ}"


def _assert_same_weights(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == got.keys()
    differ = [k for k in expected if not torch.equal(expected[k], got[k])]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[:5]}"


def _stop_and_resume(overrides, tmp_path, stop_after: int, capsys):
    full = _run(overrides, tmp_path / "full")
    status1, m1, rows1, _ = _run(overrides, tmp_path / "resumed", stop_after=stop_after)
    out = capsys.readouterr().out
    assert status1 == "interrupted"
    assert f"Stopped after step {stop_after} (a signal)" in out and "trainer.resume_mode=auto" in out
    assert CheckpointManager(tmp_path / "resumed").complete_steps() == [stop_after]
    status2, m2, rows2, weights = _run(overrides, tmp_path / "resumed")
    assert (
        f"Resumed from {tmp_path / 'resumed' / f'global_step_{stop_after}'} (step {stop_after})"
        in capsys.readouterr().out
    )
    assert full[0] == "finished" and status2 == "finished"
    assert sorted(m1) == list(range(1, stop_after + 1)) and sorted(m2) == list(range(stop_after + 1, 5))
    _assert_same_metrics(full[1], {**m1, **m2})
    assert {**rows1, **rows2} == full[2]
    _assert_same_weights(full[3], weights)
    return full


def test_resume_ppo_critic_adaptive_kl_warmup_at_epoch_boundary(tmp_path, capsys):
    overrides = BASE + [
        "algorithm=ppo",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.horizon=8",  # moves the coefficient by up to 2*0.2/8 = 5% per step
        "trainer.critic_warmup=3",
        "data.train_size=5",  # 2 steps per epoch
    ]
    _, metrics, rows, _ = _stop_and_resume(overrides, tmp_path, stop_after=2, capsys=capsys)
    # the epochs: steps 1-2 in epoch 0, 3-4 in epoch 1 (stopped exactly at the boundary)
    assert [rows[s][0] for s in (1, 2, 3, 4)] == [0, 0, 1, 1]
    assert [metrics[s]["training/epoch"] for s in (1, 2, 3, 4)] == [0, 0, 1, 1]
    # the documented order: epoch e serves default_rng([data.seed, e]).permutation(n) in batches
    perm = [np.random.default_rng([1, e]).permutation(5).tolist() for e in (0, 1)]
    assert [rows[s][1] for s in (1, 2, 3, 4)] == [perm[0][0:2], perm[0][2:4], perm[1][0:2], perm[1][2:4]]
    # critic warmup: the actor is updated only from step 4 on; the critic every step
    assert ["actor/pg_loss" in metrics[s] for s in (1, 2, 3, 4)] == [False, False, False, True]
    assert all("critic/vf_loss" in metrics[s] for s in (1, 2, 3, 4))
    # the adaptive coefficient changed every step (so its checkpointed state mattered)
    coefs = [metrics[s]["actor/kl_coef"] for s in (1, 2, 3, 4)]
    assert len(set(coefs)) == 4 and all(c != 0.001 for c in coefs)


def _noisy_grpo(data, config):
    """GRPO advantages plus noise from the three global RNGs (a test plugin, impure on purpose)."""
    adv, ret = get_registry().get("advantage_estimator", "grpo")(data, config)
    mask = data["response_mask"]
    noise = 0.1 * torch.randn(adv.shape) + 0.01 * float(np.random.rand()) + 0.01 * random.random()
    return (adv + noise) * mask, (ret + noise) * mask


@pytest.fixture
def noisy_estimator():
    registry = get_registry()
    registry.register(
        "advantage_estimator",
        "test_noisy_grpo",
        AdvantageEstimator(fn=_noisy_grpo, requires=("index",), group_based=True),
    )
    try:
        yield "test_noisy_grpo"
    finally:
        registry.entries["advantage_estimator"].pop("test_noisy_grpo", None)


def test_resume_rng_scheduler_mid_epoch_then_across_the_boundary(tmp_path, capsys, noisy_estimator):
    overrides = BASE + [
        "algorithm=grpo",
        f"algorithm.adv_estimator={noisy_estimator}",
        "rollout.n=2",
        "actor.optim.lr=1e-4",
        "actor.optim.warmup_style=cosine",
        "actor.optim.lr_warmup_steps=3",
        "actor.optim.min_lr_ratio=0.1",
        "data.train_size=7",  # 3 steps per epoch
    ]
    _, metrics, rows, _ = _stop_and_resume(overrides, tmp_path, stop_after=2, capsys=capsys)
    assert [rows[s][0] for s in (1, 2, 3, 4)] == [0, 0, 0, 1]
    # 2 optimizer steps per training step (2 prompts, mini-batch 1): warmup (1/3, 2/3, 1) then cosine
    lrs = [metrics[s]["actor/lr"] for s in (1, 2, 3, 4)]
    assert len(set(lrs)) == 4
    assert lrs[0] == pytest.approx(1e-4 * (1 / 3 + 2 / 3) / 2)


def test_resume_path_from_an_older_checkpoint_replays_the_same_steps(tmp_path):
    overrides = BASE + ["algorithm=ppo", "trainer.save_freq=1", "trainer.max_ckpt_to_keep=null", "data.train_size=5"]
    status, full_metrics, full_rows, full_weights = _run(overrides, tmp_path)
    assert status == "finished"
    manager = CheckpointManager(tmp_path)
    assert manager.complete_steps() == [1, 2, 3, 4]
    status, metrics, rows, weights = _run(
        overrides + ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={tmp_path / 'global_step_1'}"],
        tmp_path,
    )
    assert status == "finished" and sorted(metrics) == [2, 3, 4]
    _assert_same_metrics({s: full_metrics[s] for s in (2, 3, 4)}, metrics)
    assert rows == {s: full_rows[s] for s in (2, 3, 4)}
    _assert_same_weights(full_weights, weights)
    # steps 2..4 were saved again (replacing the old directories), nothing partial left
    assert manager.complete_steps() == [1, 2, 3, 4] and manager.partial_dirs() == []


def test_resume_path_to_an_incomplete_checkpoint_is_a_config_error(tmp_path):
    from rlplug.config.schema import ConfigError

    partial = tmp_path / "global_step_1.partial-1"
    partial.mkdir(parents=True)
    cfg = run_config(
        BASE,
        tmp_path,
        "algorithm=grpo",
        "rollout.n=2",
        "trainer.resume_mode=resume_path",
        f"trainer.resume_from_path={partial}",
        validate=False,
    )
    with pytest.raises(ConfigError, match="not a complete checkpoint"):
        Trainer(cfg)  # refused while the run directory is opened, before any model loads


def test_training_starts_from_the_seeded_rng_state_whatever_construction_draws(tmp_path, monkeypatch):
    """Libraries may draw from the global RNGs while the trainer builds things (the first tokenizer
    load in a process changes Python's ``random`` state): the run must not depend on that."""
    import rlplug.training.models
    from rlplug.run.checkpoint import rng_state, seed_everything

    real_load = rlplug.training.models.load_tokenizer

    def load_tokenizer_that_draws(*args, **kwargs):
        random.random(), np.random.rand(), torch.rand(1)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(rlplug.training.models, "load_tokenizer", load_tokenizer_that_draws)
    cfg = run_config(BASE, tmp_path, "algorithm=grpo", "rollout.n=2", "trainer.seed=7", validate=False)
    trainer = Trainer(cfg)
    try:
        after_init = rng_state()
    finally:
        trainer.close()
    seed_everything(7)
    seeded = rng_state()
    for key, value in seeded.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, after_init[key]), key
        else:  # python_gauss is NaN when no Gaussian is cached
            assert value == after_init[key] or (math.isnan(value) and math.isnan(after_init[key])), key
