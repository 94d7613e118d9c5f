"""Settings changed on resume take effect or are refused, and every resume says what changed.

The bug (issue 31, item 2): a tiny PPO run checkpointed at step 3 and resumed with
``actor.optim.lr=5e-5`` (was 1e-4) logged ``actor/lr`` 1e-4 and ended with the weights of an
unchanged resume, while the new checkpoint's ``config.yaml`` said 5e-5: the optimizer's and the
scheduler's saved rates won over the config, silently.

Runs are in-process (``Trainer(cfg).fit()``), the tiny 1-layer model, hf rollout, local backend
(``fsdp2`` on one in-process rank for its own load path), as in ``tests/test_resume.py``. A module
fixture trains each base run once; every test resumes a copy of its run directory. Expected values
are derived by hand in the comments (the LR schedule: :func:`rlplug.training.backend.build_lr_lambda`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import signal

import pytest
import torch
from _helpers import LENGTH_SHAPING, TINY_CPU_RUN, run_config

import rlplug
from rlplug.config.schema import ConfigError
from rlplug.contracts.registry import get_registry
from rlplug.run.checkpoint import CheckpointManager, open_run_dir
from rlplug.run.trainer import Trainer

BASE = TINY_CPU_RUN + [  # CPU: deterministic kernels, so an unchanged resume is bitwise the same
    "algorithm=ppo",
    "trainer.critic_warmup=0",  # the actor updates from step 1
    "actor.ppo_mini_batch_size=2",  # = data.train_batch_size: one optimizer step per training step
    "actor.micro_batch_size_per_device=1",
    "actor.optim.lr=1e-4",
    "critic.optim.lr=1e-4",
    "trainer.save_freq=1",
    "trainer.max_ckpt_to_keep=null",
    "trainer.logger=[]",
    *LENGTH_SHAPING,  # scores differ between responses, so every update moves the weights
]


class _Recorder:
    """Keeps every step's metrics; sends SIGTERM to this process after step ``stop_after`` (the trainer's
    graceful stop: it finishes the step, saves and returns ``"interrupted"``)."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.stop_after = stop_after
        self.steps: dict[int, dict[str, float]] = {}

    @rlplug.hookimpl
    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        self.steps[step] = dict(metrics)
        if step == self.stop_after:
            os.kill(os.getpid(), signal.SIGTERM)


def _train(overrides: list[str], run_dir, stop_after: int | None = None):
    """One run in ``run_dir``; returns (status, metrics per step, actor and critic weights, the trainer's
    resume changes). The trainer is closed."""
    cfg = run_config(overrides, run_dir, validate=False)
    rec = _Recorder(stop_after)
    get_registry().pm.register(rec)
    trainer = Trainer(cfg)
    try:
        status = trainer.fit()
        weights = {f"actor/{k}": v.detach().clone() for k, v in trainer.backend.actor.model.state_dict().items()}
        if trainer.backend.critic is not None:
            weights.update(
                {f"critic/{k}": v.detach().clone() for k, v in trainer.backend.critic.model.state_dict().items()}
            )
    finally:
        get_registry().pm.unregister(rec)
        trainer.close()
    return status, rec.steps, weights, getattr(trainer, "resume_changes", None)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], prefix: str) -> bool:
    keys = [k for k in a if k.startswith(prefix)]
    assert keys
    return all(torch.equal(a[k], b[k]) for k in keys)


def _copy(src, tmp_path, name: str):
    dest = tmp_path / name
    shutil.copytree(src, dest)
    return dest


def _scheduler(run_dir, step: int, role: str) -> dict:
    return torch.load(run_dir / f"global_step_{step}" / "backend" / role / "scheduler.pt", weights_only=True)


def _optimizer_lrs(run_dir, step: int, role: str) -> list[float]:
    state = torch.load(run_dir / f"global_step_{step}" / "backend" / role / "optimizer.pt", weights_only=True)
    return [g["lr"] for g in state["param_groups"]]


# ============================================================================ the runs resumed


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory):
    """The issue's run: PPO (actor and critic), constant LRs 1e-4, 3 steps, a checkpoint every step."""
    run_dir = tmp_path_factory.mktemp("ppo") / "run"
    status, metrics, _, _ = _train(BASE + ["trainer.total_training_steps=3"], run_dir)
    assert status == "finished" and CheckpointManager(run_dir).complete_steps() == [1, 2, 3]
    assert [metrics[s]["actor/lr"] for s in (1, 2, 3)] == [1e-4] * 3
    return run_dir


@pytest.fixture(scope="module")
def unchanged(ppo_run, tmp_path_factory):
    """``ppo_run`` resumed for step 4 with nothing changed but the step count: (metrics, weights, run dir)."""
    run_dir = _copy(ppo_run, tmp_path_factory.mktemp("unchanged"), "run")
    status, metrics, weights, _ = _train(BASE + ["trainer.total_training_steps=4"], run_dir)
    assert status == "finished" and sorted(metrics) == [4]
    return metrics, weights, run_dir


def test_a_new_actor_lr_takes_effect_from_the_first_resumed_step(ppo_run, unchanged, tmp_path, capsys):
    run_dir = _copy(ppo_run, tmp_path, "run")
    status, metrics, weights, changes = _train(
        BASE + ["trainer.total_training_steps=4", "actor.optim.lr=5e-5"], run_dir
    )
    assert status == "finished" and sorted(metrics) == [4]
    # bug: 1e-4 (the checkpoint's rate); now the new base x 1 (constant schedule) x 1 (no alert)
    assert metrics[4]["actor/lr"] == pytest.approx(5e-5, rel=1e-12)
    assert unchanged[0][4]["actor/lr"] == 1e-4
    assert metrics[4]["critic/lr"] == unchanged[0][4]["critic/lr"] == 1e-4  # the critic's is not touched
    assert not _same(weights, unchanged[1], "actor/")  # bug: bitwise the unchanged resume's weights
    # the optimizer's rate, the scheduler's base rate and the config recorded agree in the new checkpoint
    assert _scheduler(run_dir, 4, "actor")["base_lrs"] == [pytest.approx(5e-5, rel=1e-12)]
    assert _optimizer_lrs(run_dir, 4, "actor") == [pytest.approx(5e-5, rel=1e-12)]
    assert "lr: 5.0e-05" in (run_dir / "global_step_4" / "config.yaml").read_text()
    out = capsys.readouterr().out
    assert "  actor.optim.lr: 0.0001 -> 5e-05\n" in out
    assert "actor learning rate from step 4: 5e-05 = actor.optim.lr 5e-05 x 1 (" in out
    assert ("actor.optim.lr", 1e-4, 5e-5) in changes


def test_a_new_critic_lr_takes_effect_from_the_first_resumed_step(ppo_run, unchanged, tmp_path):
    run_dir = _copy(ppo_run, tmp_path, "run")
    _, metrics, weights, _ = _train(BASE + ["trainer.total_training_steps=4", "critic.optim.lr=2e-4"], run_dir)
    assert metrics[4]["critic/lr"] == pytest.approx(2e-4, rel=1e-12)  # bug: 1e-4
    assert metrics[4]["actor/lr"] == 1e-4
    assert not _same(weights, unchanged[1], "critic/")
    assert _scheduler(run_dir, 4, "critic")["base_lrs"] == [pytest.approx(2e-4, rel=1e-12)]
    assert _optimizer_lrs(run_dir, 4, "critic") == [pytest.approx(2e-4, rel=1e-12)]


def test_an_unchanged_resume_says_so_and_is_bitwise_the_same(tmp_path, capsys):
    # the same command again, from the checkpoint of step 1 (trainer.resume_from_path: how this start finds its
    # checkpoint, not a setting of the run): step 2 is trained again, exactly as the first time
    command, run_dir = BASE + ["trainer.total_training_steps=2"], tmp_path / "run"
    assert _train(command, run_dir)[0] == "finished"
    first = {
        r: (run_dir / "global_step_2" / "backend" / r / "model.safetensors").read_bytes() for r in ("actor", "critic")
    }
    resume = ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={run_dir / 'global_step_1'}"]
    _, metrics, _, changes = _train(command + resume, run_dir)
    assert changes == [] and sorted(metrics) == [2]
    out = capsys.readouterr().out
    assert "Settings unchanged since the checkpoint.\n" in out and "Settings changed" not in out
    for role in ("actor", "critic"):
        assert (run_dir / "global_step_2" / "backend" / role / "model.safetensors").read_bytes() == first[role], role


def test_a_changed_clip_ratio_is_listed_printed_and_logged(ppo_run, tmp_path, capsys, caplog):
    run_dir = _copy(ppo_run, tmp_path, "run")
    with caplog.at_level(logging.INFO, logger="rlplug"):
        _, metrics, _, changes = _train(
            BASE + ["trainer.total_training_steps=4", "actor.clip_ratio=0.3", "trainer.logger=[console]"], run_dir
        )
    out = capsys.readouterr().out
    block = (
        "Settings changed since the checkpoint (checkpoint -> this command), in effect from step 4:\n"
        "  actor.clip_ratio: 0.2 -> 0.3\n"
        "  trainer.total_training_steps: 3 -> 4\n"
        f'  trainer.default_local_dir: "{ppo_run}" -> "{run_dir}"\n'
        '  trainer.logger: [] -> ["console"]\n'
    )  # in the config's order
    assert block in out + "\n"
    assert block.rstrip("\n") in caplog.text  # the run's log
    assert changes[0] == ("actor.clip_ratio", 0.2, 0.3)
    assert metrics[4]["actor/lr"] == 1e-4  # nothing else applied on top


def test_the_learning_rate_follows_the_new_base_and_a_cosine_schedule(tmp_path):
    """Warmup then cosine: 6 training steps of one optimizer step each, stopped after step 3, resumed at half
    the rate. build_lr_lambda(warmup=2, total=6, cosine, min_lr_ratio=0.1) at the optimizer step s the
    training step 4 takes (s = 3 steps taken): progress = (3 - 2) / (6 - 2) = 0.25, multiplier
    0.1 + 0.9 * 0.5 * (1 + cos(pi / 4)) = 0.868198. Steps 1..3 used (1/2, 2/2, 1.0) then
    0.1 + 0.45 * (1 + cos(pi * 0 / 4)) = 1.0 at s = 2."""
    cosine = BASE + [
        "trainer.total_training_steps=6",
        "actor.optim.warmup_style=cosine",
        "actor.optim.lr_warmup_steps=2",
        "actor.optim.min_lr_ratio=0.1",
    ]
    run_dir = tmp_path / "run"
    status, first, _, _ = _train(cosine, run_dir, stop_after=3)
    assert status == "interrupted"
    assert [first[s]["actor/lr"] for s in (1, 2, 3)] == pytest.approx([0.5e-4, 1e-4, 1e-4], rel=1e-12)
    status, metrics, _, _ = _train(cosine + ["actor.optim.lr=5e-5"], run_dir, stop_after=4)
    assert status == "interrupted" and sorted(metrics) == [4]
    multiplier = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 1 / 4))
    assert multiplier == pytest.approx(0.868198, abs=1e-6)
    assert metrics[4]["actor/lr"] == pytest.approx(5e-5 * multiplier, rel=1e-12)  # bug: 1e-4 * multiplier
    # the scheduler goes on from the new base: step 5 at s = 4, progress 0.5, multiplier 0.1 + 0.45 = 0.55
    _, metrics, _, _ = _train(cosine + ["actor.optim.lr=5e-5"], run_dir, stop_after=5)
    assert metrics[5]["actor/lr"] == pytest.approx(5e-5 * 0.55, rel=1e-12)
    assert _scheduler(run_dir, 5, "actor")["base_lrs"] == [pytest.approx(5e-5, rel=1e-12)]


def test_a_longer_run_on_resume_moves_the_cosine_from_the_first_resumed_step(tmp_path):
    """trainer.total_training_steps 6 -> 10 stretches the cosine: at s = 3 the multiplier is
    0.1 + 0.45 * (1 + cos(pi * (3 - 2) / (10 - 2))) = 0.1 + 0.45 * (1 + cos(pi / 8)) = 0.965749 from the
    first resumed step (it was 0.868198 for 6 steps, which the checkpoint's rate would have kept for a step)."""
    cosine = BASE + ["actor.optim.warmup_style=cosine", "actor.optim.lr_warmup_steps=2", "actor.optim.min_lr_ratio=0.1"]
    run_dir = tmp_path / "run"
    assert _train(cosine + ["trainer.total_training_steps=6"], run_dir, stop_after=3)[0] == "interrupted"
    _, metrics, _, _ = _train(cosine + ["trainer.total_training_steps=10"], run_dir, stop_after=4)
    assert metrics[4]["actor/lr"] == pytest.approx(1e-4 * (0.1 + 0.45 * (1 + math.cos(math.pi / 8))), rel=1e-12)


def test_a_scale_lr_alert_in_force_at_the_checkpoint_is_kept_on_the_new_base(tmp_path):
    """A rule that holds at every step (actor/lr below 1) with patience 3 fires once in 3 steps, after step 3
    (before its checkpoint): the actor's rate is halved from step 4 on. Resumed at step 4 with
    actor.optim.lr=5e-5, the rate is 5e-5 x 1 (constant schedule) x 0.5 (the alert's factor) = 2.5e-5; resumed
    unchanged, 1e-4 x 0.5 = 5e-5. (The rule's count is 1 after step 4: it does not fire there.)"""
    alert = ["trainer.alerts=[{name:halve,metric:actor/lr,min:1.0,action:scale_lr,factor:0.5,patience:3}]"]
    run_dir = tmp_path / "run"
    _, first, _, _ = _train(BASE + alert + ["trainer.total_training_steps=3"], run_dir)
    assert [first[s]["actor/lr"] for s in (1, 2, 3)] == [1e-4] * 3
    assert [first[s]["alerts/halve"] for s in (1, 2, 3)] == [0.0, 0.0, 1.0]
    copy = _copy(run_dir, tmp_path, "copy")
    _, kept, _, _ = _train(BASE + alert + ["trainer.total_training_steps=4"], copy)
    assert kept[4]["actor/lr"] == pytest.approx(5e-5, rel=1e-12) and kept[4]["alerts/lr_scale/actor"] == 0.5
    _, metrics, _, _ = _train(BASE + alert + ["trainer.total_training_steps=4", "actor.optim.lr=5e-5"], run_dir)
    assert metrics[4]["actor/lr"] == pytest.approx(2.5e-5, rel=1e-12)  # bug: 5e-5 (the checkpoint's rate)
    assert metrics[4]["alerts/lr_scale/actor"] == 0.5
    assert _scheduler(run_dir, 4, "actor")["base_lrs"] == [pytest.approx(2.5e-5, rel=1e-12)]


# ============================================================================ refused, before any model loads


@pytest.mark.parametrize(
    ("override", "old", "new"),
    [
        ("data.train_batch_size=4", "2", "4"),
        ("rollout.n=2", "1", "2"),
        ("trainer.seed=7", "42", "7"),
        ("trainer.backend=fsdp2", '"local"', '"fsdp2"'),
        ("model.compute_dtype=bf16", '"fp32"', '"bf16"'),
        ("model.trust_remote_code=true", "false", "true"),
        ("algorithm.kl_ctrl.type=adaptive", '"fixed"', '"adaptive"'),
        ("data.seed=5", "1", "5"),
        ("data.shuffle=false", "true", "false"),
    ],
)
def test_a_setting_a_resume_cannot_change_is_refused_naming_it(ppo_run, tmp_path, monkeypatch, override, old, new):
    import rlplug.training.models

    key = override.split("=")[0]
    run_dir = _copy(ppo_run, tmp_path, "run")
    cfg = run_config(BASE + ["trainer.total_training_steps=4", override], run_dir, validate=False)
    monkeypatch.setattr(rlplug.training.models, "load_tokenizer", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(ConfigError) as info:
        Trainer(cfg)
    msg = str(info.value)
    assert msg.startswith(
        f"Cannot resume from {run_dir / 'global_step_3'} with this setting changed (checkpoint -> this command):\n"
        f"  {key}: {old} -> {new} ("
    )
    back = f"{key}={json.loads(old)}".replace("True", "true").replace("False", "false")
    assert f"To resume, set it back: {back}. To train with the new value, start a new run: " in msg
    assert f"rlplug export {run_dir / 'global_step_3'} --out DIR" in msg


def test_refused_settings_are_named_together_and_the_others_are_allowed(ppo_run, tmp_path):
    run_dir = _copy(ppo_run, tmp_path, "run")
    cfg = run_config(BASE + ["model.tiny.hidden_size=32"], run_dir, validate=False)  # a fingerprint field
    with pytest.raises(ConfigError, match="it was written by another run.*\n  model.tiny.hidden_size: 64 -> 32"):
        open_run_dir(cfg, run_dir)
    cfg = run_config(BASE + ["trainer.seed=7", "data.train_batch_size=4"], run_dir, validate=False)
    msg = str(pytest.raises(ConfigError, open_run_dir, cfg, run_dir).value)
    assert "with these settings changed (checkpoint -> this command):\n  data.train_batch_size: 2 -> 4 (" in msg
    assert "\n  trainer.seed: 42 -> 7 (" in msg
    assert "set them back: data.train_batch_size=2 trainer.seed=42." in msg
    # what does not make another run, or only changes how the same model is computed, is not refused
    allowed = [
        "trainer.total_training_steps=10",
        "trainer.logger=[console]",
        "trainer.save_freq=5",
        "trainer.test_freq=3",
        "trainer.max_ckpt_to_keep=2",
        "actor.optim.lr=5e-5",
        "actor.optim.weight_decay=0.01",
        "actor.clip_ratio=0.3",
        "algorithm.kl_ctrl.kl_coef=0.01",
        "model.enable_gradient_checkpointing=true",
        "model.attn_implementation=sdpa",
    ]
    manager, start = open_run_dir(run_config(BASE + allowed, run_dir, validate=False), run_dir)
    manager.close()
    assert start.resume_from == run_dir / "global_step_3"


# ============================================================================ the README's and the alerts' advice


def test_following_the_alert_stop_advice_lowers_the_learning_rate_on_resume(tmp_path, capsys):
    """README, exit code 5: a trainer.alerts stop rule saves and stops; its message says to lower the learning
    rate and rerun the command. Done literally (the override it prints added to the same command), the resumed
    step trains at that rate."""
    from rlplug.run.trainer import run

    guard = ["trainer.alerts=[{name:guard,metric:actor/grad_norm,max:1.0e-12,action:stop}]"]  # fires at step 1
    command = BASE + guard + ["trainer.total_training_steps=3"]
    run_dir = tmp_path / "run"
    rec = _Recorder()
    get_registry().pm.register(rec)
    try:
        assert run(run_config(command, run_dir, validate=False)) == 5  # ExitCode.ALERT_STOP
        out = capsys.readouterr().out
        advice = re.search(r"a lower learning rate, (\S+) added to the command", out)
        assert advice is not None, out
        assert advice.group(1) == "actor.optim.lr=5e-05"  # half of 1e-4
        assert rec.steps[1]["actor/lr"] == 1e-4
        assert run(run_config(command + [advice.group(1)], run_dir, validate=False)) == 5  # fires again at step 2
    finally:
        get_registry().pm.unregister(rec)
    out = capsys.readouterr().out
    assert "Resumed from" in out and "  actor.optim.lr: 0.0001 -> 5e-05\n" in out
    assert rec.steps[2]["actor/lr"] == pytest.approx(5e-5, rel=1e-12)
    assert "a lower learning rate, actor.optim.lr=2.5e-05 added to the command" in out  # halves the new rate


def test_the_exit_code_3_message_gives_the_override_to_resume_with(tmp_path):
    from omegaconf import OmegaConf

    from rlplug.base.exit_codes import TrainingStopped
    from rlplug.run.trainer import check_bad_steps

    cfg = OmegaConf.create({"actor": {"optim": {"lr": 1e-4}}, "trainer": {"max_consecutive_bad_steps": 2}})
    with pytest.raises(TrainingStopped) as info:
        check_bad_steps(2, cfg.trainer, tmp_path, cfg)
    assert info.value.exit_code == 3
    assert "Lower the learning rate, e.g. add actor.optim.lr=5e-05 (or a lower critic.optim.lr) to the command " in (
        str(info.value)
    )


# ============================================================================ the backends keep this run's settings


def _backend(cls, **overrides):
    import fsdp2_worker as W

    from rlplug.training.models import tiny_model_dir

    cfg = W.make_cfg(**{"trainer.backend": "local", **overrides})
    return cls(cfg, str(tiny_model_dir(cfg.model.tiny)), use_critic=True, use_ref=False, total_steps=4)


def test_optimizer_settings_and_the_schedule_shape_of_the_config_win_over_the_checkpoint(tmp_path):
    """AdamW's betas, eps and weight_decay, the gradient clip and the LR schedule's shape: a checkpoint saved
    with one config and loaded by a backend built with another trains with the other's."""
    import fsdp2_worker as W

    from rlplug.plugins.training.local import LocalTrainingBackend

    saved = _backend(LocalTrainingBackend, **{"actor.optim.lr_warmup_steps": 4})
    saved.update_actor(W.prepare(saved, W.make_batch(0)))  # 2 optimizer steps: warmup 1/4 then 2/4
    assert saved.actor.lr == pytest.approx(5e-2 * 3 / 4, rel=1e-12)
    saved.save(tmp_path / "ckpt")
    saved.close()
    changed = {
        "actor.optim.betas": [0.5, 0.6],
        "actor.optim.eps": 0.25,
        "actor.optim.weight_decay": 0.125,
        "actor.grad_clip": 0.5,
        "actor.optim.lr_warmup_steps": 8,  # the warmup now ends later: (2 + 1) / 8 at the next optimizer step
    }
    loaded = _backend(LocalTrainingBackend, **changed)
    loaded.load(tmp_path / "ckpt")
    group = loaded.actor.optimizer.param_groups[0]
    assert (tuple(group["betas"]), group["eps"], group["weight_decay"]) == ((0.5, 0.6), 0.25, 0.125)
    assert loaded.actor.grad_clip == 0.5
    assert loaded.actor.scheduler.last_epoch == 2  # the position is the checkpoint's ...
    assert loaded.actor.lr == pytest.approx(5e-2 * 3 / 8, rel=1e-12)  # ... the shape this config's (bug: 3/4)
    assert loaded.actor.scheduler.get_last_lr() == [loaded.actor.lr]
    # the critic, whose settings did not change, keeps the checkpoint's values exactly
    assert loaded.critic.optimizer.param_groups[0]["betas"] == (0.9, 0.999)
    assert loaded.critic.lr == 5e-2 * 1 / 1
    loaded.close()


# ============================================================================ fsdp2


def test_fsdp2_on_one_rank_applies_a_new_actor_lr_on_resume(tmp_path):
    """The fsdp2 backend loads through torch.distributed.checkpoint (its own path): one in-process rank."""
    fsdp2 = BASE + ["trainer=fsdp2", "trainer.device=cpu", "trainer.total_training_steps=3"]
    run_dir = tmp_path / "run"
    assert _train(fsdp2, run_dir)[0] == "finished"
    _, metrics, _, _ = _train(fsdp2 + ["trainer.total_training_steps=4", "actor.optim.lr=5e-5"], run_dir)
    assert metrics[4]["actor/lr"] == pytest.approx(5e-5, rel=1e-12)  # bug: 1e-4
    assert metrics[4]["critic/lr"] == 1e-4


@pytest.mark.slow  # two torchrun launches of 2 gloo ranks: about two minutes on the 2-core test machine
@pytest.mark.timeout(900)
def test_fsdp2_on_two_ranks_applies_a_new_actor_lr_on_resume(tmp_path):
    """``torchrun --nproc_per_node=2 -m rlplug train trainer=fsdp2``: 2 steps, then the same command resumed
    with actor.optim.lr=5e-5 for a third: every rank scales its optimizer shards' rates (constant schedule,
    no alert: actor/lr = 5e-5 exactly), and the rank-0 log lists the change."""
    import subprocess
    import sys

    from rlplug.run.metrics import read_metrics_jsonl

    run_dir = tmp_path / "run"
    common = [
        "trainer=fsdp2",
        "debug=tiny",
        f"trainer.default_local_dir={run_dir}",
        "trainer.val_before_train=false",
        "trainer.test_freq=0",
        "actor.optim.lr=1e-4",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("WORLD_SIZE", None)

    def launch(*extra: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        cmd += ["-m", "rlplug", "train", *common, *extra]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        return proc

    launch("trainer.total_training_steps=2")
    proc = launch("trainer.total_training_steps=3", "actor.optim.lr=5e-5")
    assert proc.stdout.count("  actor.optim.lr: 0.0001 -> 5e-05\n") == 1  # rank 0 prints it
    lrs = {int(row["step"]): row["actor/lr"] for row in read_metrics_jsonl(run_dir / "metrics.jsonl")}
    assert lrs[2] == 1e-4 and lrs[3] == pytest.approx(5e-5, rel=1e-12)
