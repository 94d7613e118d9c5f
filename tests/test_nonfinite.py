"""Numerical faults: a non-finite loss or gradient skips the optimizer step; too many in a row stop.

Faults are injected through a registered test advantage estimator that wraps a real one
(``grpo`` or ``gae``) and, at chosen training steps, replaces the advantages (and returns) on
response tokens with a poison value: NaN or inf (the loss is non-finite) or 1e30 (the loss is
finite but the gradient norm overflows float32). The local backend must skip those optimizer
steps (weights and Adam state untouched), count them in ``<role>/nonfinite_skipped`` and log the
stage; ``trainer.max_consecutive_bad_steps`` skipped optimizer steps in a row stop the run with
exit code 3 from ``rlplug.run.trainer.run``, and the checkpoints already written stay intact.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from _helpers import LENGTH_SHAPING, TINY_CPU_RUN, run_config

import rlplug
from rlplug.contracts.registry import get_registry
from rlplug.contracts.types import AdvantageEstimator
from rlplug.run.checkpoint import CheckpointManager
from rlplug.run.trainer import Trainer, run

BASE = TINY_CPU_RUN + [
    "actor.ppo_mini_batch_size=1",  # 2 optimizer steps per training step
    "actor.micro_batch_size_per_device=1",
    "trainer.logger=[]",
    *LENGTH_SHAPING,  # scores differ: non-zero advantages
]
NAME = "test_poisoned"


class Poison:
    """Wraps estimator ``base``; the advantages/returns of the listed training steps become ``value``."""

    def __init__(self, base: str, steps: set[int] | None, value: float) -> None:
        self.base = get_registry().get("advantage_estimator", base)
        self.steps, self.value, self.calls = steps, value, 0

    def __call__(self, data, config):
        self.calls += 1  # the trainer calls the estimator once per training step
        adv, ret = self.base(data, config)
        if self.steps is None or self.calls in self.steps:
            mask = data["response_mask"].bool()
            adv = adv.masked_fill(mask, self.value)
            ret = ret.masked_fill(mask, self.value)
        return adv, ret


@pytest.fixture
def poison():
    registry = get_registry()

    def install(base: str, steps: set[int] | None, value: float) -> Poison:
        p = Poison(base, steps, value)
        registry.entries["advantage_estimator"].pop(NAME, None)
        registry.register(
            "advantage_estimator",
            NAME,
            AdvantageEstimator(fn=p, requires=p.base.requires, group_based=p.base.group_based),
        )
        return p

    yield install
    registry.entries["advantage_estimator"].pop(NAME, None)


class _Snapshots:
    """Per step: metrics, and copies of the actor/critic weights and Adam step counts."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.metrics: dict[int, dict[str, float]] = {}
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        self.adam_steps: dict[int, list[float]] = {}

    @rlplug.hookimpl
    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        self.metrics[step] = dict(metrics)
        backend = self.trainer.backend
        roles = [backend.actor] + ([backend.critic] if backend.critic is not None else [])
        self.weights[step] = {
            f"{r.name}/{k}": v.detach().clone() for r in roles for k, v in r.model.state_dict().items()
        }
        self.adam_steps[step] = [float(s["step"]) for r in roles for s in r.optimizer.state.values()]


def _cfg(tmp_path, *extra: str):
    return run_config(BASE, tmp_path, *extra)


def _train_with_snapshots(cfg) -> tuple[str, _Snapshots]:
    snaps = _Snapshots()
    get_registry().pm.register(snaps)
    trainer = Trainer(cfg)
    snaps.trainer = trainer
    try:
        return trainer.fit(), snaps
    finally:
        get_registry().pm.unregister(snaps)
        trainer.close()


@pytest.mark.parametrize(
    ("preset", "value", "stage"),
    [
        ("grpo", math.nan, "non-finite actor loss (nan)"),
        ("grpo", math.inf, "non-finite actor loss"),
        ("grpo", 1e30, "non-finite actor gradient norm"),  # finite loss, overflowing gradient
        ("ppo", math.nan, "non-finite critic loss (nan)"),  # returns poisoned too: the critic skips as well
    ],
)
def test_bad_step_is_skipped_counted_and_logged(tmp_path, poison, caplog, preset, value, stage):
    base = "gae" if preset == "ppo" else "grpo"
    poison(base, steps={2}, value=value)
    extra = ["rollout.n=2"] if preset == "grpo" else []
    cfg = _cfg(
        tmp_path,
        f"algorithm={preset}",
        f"algorithm.adv_estimator={NAME}",
        "actor.use_kl_loss=false",
        "trainer.total_training_steps=3",
        "trainer.save_freq=0",
        *extra,
    )
    with caplog.at_level(logging.WARNING):
        status, snaps = _train_with_snapshots(cfg)
    assert status == "finished"
    roles = ["actor"] + (["critic"] if preset == "ppo" else [])
    for role in roles:
        # 2 optimizer steps per training step: both skipped in step 2, none otherwise
        assert [snaps.metrics[s][f"{role}/nonfinite_skipped"] for s in (1, 2, 3)] == [0.0, 2.0, 0.0]
        assert math.isnan(snaps.metrics[2][f"{role}/grad_norm"])  # no good mini-batch to average
    w = snaps.weights
    assert all(torch.equal(w[1][k], w[2][k]) for k in w[1])  # step 2 changed nothing...
    assert snaps.adam_steps[1] == snaps.adam_steps[2]  # ...not even Adam's state
    assert any(not torch.equal(w[2][k], w[3][k]) for k in w[2] if k.startswith("actor/"))  # step 3 trained
    assert all(torch.isfinite(t).all() for t in w[3].values())
    assert [s + 2 for s in snaps.adam_steps[1]] == snaps.adam_steps[3]
    assert stage in caplog.text and "optimizer step skipped (1 in a row)" in caplog.text


def test_consecutive_bad_steps_stop_with_exit_code_3_and_intact_checkpoints(tmp_path, poison, capsys):
    """NaN from step 3 on, limit 3: step 3 skips 2 optimizer steps (saved), step 4 reaches 4 -> stop."""
    from safetensors.torch import load_file

    poisoned = poison("grpo", steps=set(range(3, 100)), value=math.nan)
    cfg = _cfg(
        tmp_path,
        "algorithm=grpo",
        "rollout.n=2",
        f"algorithm.adv_estimator={NAME}",
        "actor.use_kl_loss=false",
        "trainer.total_training_steps=6",
        "trainer.save_freq=1",
        "trainer.max_ckpt_to_keep=null",
        "trainer.max_consecutive_bad_steps=3",
    )
    assert run(cfg) == 3
    out = capsys.readouterr().out
    assert (
        "Training stopped: 4 consecutive optimizer steps had a non-finite loss or gradient (limit "
        "trainer.max_consecutive_bad_steps=3); stopping. The last good checkpoint is intact under"
    ) in out
    manager = CheckpointManager(tmp_path)
    assert manager.complete_steps() == [1, 2, 3] and manager.partial_dirs() == []
    assert not (tmp_path / "final_model").exists()
    actor = {
        s: load_file(str(tmp_path / f"global_step_{s}" / "backend" / "actor" / "model.safetensors")) for s in (1, 2, 3)
    }
    assert all(torch.isfinite(t).all() for t in actor[3].values())
    assert any(not torch.equal(actor[1][k], actor[2][k]) for k in actor[1])  # step 2 trained
    assert all(torch.equal(actor[2][k], actor[3][k]) for k in actor[2])  # step 3 was all skipped

    # the last checkpoint is usable: once the estimator is healthy again the same run resumes and finishes
    # (the same estimator name: another one would be another run, refused by the run fingerprint)
    poisoned.steps = set()
    assert (
        run(
            _cfg(
                tmp_path,
                "algorithm=grpo",
                "rollout.n=2",
                f"algorithm.adv_estimator={NAME}",
                "actor.use_kl_loss=false",
                "trainer.total_training_steps=5",
                "trainer.save_freq=1",
                "trainer.max_ckpt_to_keep=null",
                "trainer.max_consecutive_bad_steps=3",
            )
        )
        == 0
    )
    assert "Resumed from" in capsys.readouterr().out and manager.complete_steps() == [1, 2, 3, 4, 5]
