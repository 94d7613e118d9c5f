"""Which run a run directory holds, and what may resume or start there (issue 14, items 2 and 3).

* Presets do not leak: ``rlplug train algorithm=grpo`` gets a run directory of its own (the default
  experiment no longer names it ``ppo_arithmetic``) and no critic warm-up (it comes with the PPO
  presets; ``critic_warmup > 0`` without a critic is a config error).
* Every checkpoint records a :func:`rlplug.run.checkpoint.run_fingerprint`; resuming one written by
  another algorithm, reward, model or data is refused before any model loads, naming the keys.
* A fresh start (``trainer.resume_mode=disable``) in a directory that holds checkpoints is refused
  unless ``trainer.overwrite=true``, which moves them aside; resume and ``rlplug export`` follow
  the ``latest`` pointer, warning loudly about newer complete steps beside it.

The training runs are tiny (``debug=tiny``, one layer, CPU); one PPO run of 3 steps with a
checkpoint per step is made once per module and copied per test.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from _helpers import TINY_CPU_RUN, fit, run_config
from safetensors.torch import load_file

from rlplug.config.compose import compose
from rlplug.config.schema import ConfigError
from rlplug.run.checkpoint import (
    FINGERPRINT_FILE,
    LATEST,
    CheckpointManager,
    fingerprint_diff,
    open_run_dir,
    run_fingerprint,
    set_aside_checkpoints,
)
from rlplug.run.trainer import Trainer, run_dir_for
from rlplug.run.validate import validate_config

PPO = TINY_CPU_RUN + [
    "algorithm=ppo",
    "actor.ppo_mini_batch_size=1",
    "actor.micro_batch_size_per_device=1",
    "trainer.logger=[]",
    "trainer.total_training_steps=3",
    "trainer.save_freq=1",
]
GRPO = TINY_CPU_RUN + [
    "algorithm=grpo",
    "rollout.n=2",
    "actor.ppo_mini_batch_size=1",
    "actor.micro_batch_size_per_device=1",
    "trainer.logger=[]",
    "trainer.total_training_steps=3",
]


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory) -> Path:
    """A finished PPO run: complete checkpoints of steps 1, 2, 3, the pointer at 3, final_model."""
    run_dir = tmp_path_factory.mktemp("ppo_run")
    assert fit(run_config(PPO, run_dir)) == "finished"
    assert CheckpointManager(run_dir).complete_steps() == [1, 2, 3]
    return run_dir


@pytest.fixture
def used_dir(ppo_run, tmp_path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(ppo_run, run_dir)
    return run_dir


def _no_model_loads(monkeypatch) -> None:
    """Make loading the tokenizer or resolving the model fail loudly: a check that raises
    ConfigError before them ran before any model loads."""
    import rlplug.training.models

    def boom(*args, **kwargs):
        raise AssertionError("a model was loaded before the run directory was checked")

    monkeypatch.setattr(rlplug.training.models, "load_tokenizer", boom)
    monkeypatch.setattr(rlplug.training.models, "resolve_model_path", boom)


# ============================================================================ item 2: presets do not leak


def test_each_algorithm_gets_a_run_directory_of_its_own():
    # bug: `rlplug train algorithm=grpo` kept the default experiment's experiment_name=ppo_arithmetic
    assert compose([]).trainer.experiment_name == "ppo_basic_arithmetic"
    assert compose(["algorithm=grpo"]).trainer.experiment_name == "grpo_basic_arithmetic"
    assert compose(["algorithm=dr_grpo"]).trainer.experiment_name == "dr_grpo_basic_arithmetic"
    assert run_dir_for(compose([])) == Path("checkpoints/rlplug/ppo_basic_arithmetic")
    assert run_dir_for(compose(["algorithm=grpo"])) == Path("checkpoints/rlplug/grpo_basic_arithmetic")
    assert compose(["data=chain_sum"]).trainer.experiment_name == "ppo_chain_sum"
    files = ['data.train_files=["/data/gsm8k/train.parquet"]', "data.val_files=[]"]
    assert compose(["data=files", *files]).trainer.experiment_name == "ppo_gsm8k"  # the files' folder
    # a named experiment, or a name given, still names its directory
    assert compose(["experiment=grpo_arithmetic"]).trainer.experiment_name == "grpo_arithmetic"
    # smoke runs never share a directory with real runs, nor with another algorithm's smoke run
    assert compose(["debug=tiny"]).trainer.experiment_name == "tiny_ppo_basic_arithmetic"
    assert compose(["debug=tiny", "algorithm=rloo"]).trainer.experiment_name == "tiny_rloo_basic_arithmetic"
    assert compose(["experiment=gsm_symbolic", "algorithm=grpo"]).trainer.experiment_name == "grpo_gsm_symbolic"
    assert compose(["algorithm=grpo", "trainer.experiment_name=mine"]).trainer.experiment_name == "mine"


def test_the_critic_warm_up_comes_with_the_ppo_presets_only():
    # bug: the default experiment's critic_warmup=3 reached GRPO, which then trained nothing for 3 steps
    assert compose([]).trainer.critic_warmup == 3
    assert compose(["algorithm=ppo_dual_clip"]).trainer.critic_warmup == 3
    for algorithm in ("grpo", "dr_grpo", "rloo", "remax", "reinforce_pp"):
        assert compose([f"algorithm={algorithm}"]).trainer.critic_warmup == 0, algorithm
    validate_config(compose(["algorithm=grpo"]))  # `rlplug train algorithm=grpo` is a valid run
    validate_config(compose(["algorithm=grpo", "critic.enable=true", "trainer.critic_warmup=2"]))  # with a critic


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["algorithm=grpo", "critic.enable=null", "trainer.critic_warmup=2"],
            "trainer.critic_warmup=2 keeps the actor frozen for the first 2 steps while the critic learns the "
            "reward scale, but no critic is trained here (algorithm.adv_estimator=grpo needs no values and "
            "critic.enable is unset), so those steps would train nothing. Set trainer.critic_warmup=0, or train a "
            "critic (critic.enable=true, or an estimator that needs values, e.g. algorithm=ppo).",
        ),
        (
            ["algorithm=grpo", "trainer.critic_warmup=1"],  # the preset sets critic.enable=false
            "no critic is trained here (critic.enable=false)",
        ),
        (["trainer.critic_warmup=-1"], "trainer.critic_warmup=-1 must be >= 0"),
        (
            ["trainer.overwrite=true"],
            "trainer.overwrite=true moves the run directory's checkpoints aside to start a fresh run, but "
            "trainer.resume_mode=auto resumes one. To start fresh, add trainer.resume_mode=disable; to resume, "
            "drop trainer.overwrite.",
        ),
    ],
)
def test_config_errors(overrides, expected):
    with pytest.raises(ConfigError) as info:
        validate_config(compose(overrides))
    assert expected in str(info.value)


# ============================================================================ item 2: the fingerprint


def test_fingerprint_of_the_default_run():
    fp = run_fingerprint(compose([]))
    # from configs/algorithm/ppo.yaml, configs/experiment/default.yaml and the schema's defaults
    assert {k: fp[k] for k in list(fp)[:9]} == {
        "algorithm.adv_estimator": "gae",
        "algorithm.norm_adv_by_std_in_grpo": True,
        "actor.policy_loss": "vanilla",
        "actor.loss_agg_mode": "token-mean",
        "critic.enable": True,
        "actor.use_kl_loss": False,
        "actor.kl_loss_type": None,  # the KL-loss estimator only counts when the loss is on
        "algorithm.use_kl_in_reward": False,
        "algorithm.kl_penalty": None,
    }
    assert fp["reward.shaping"] == [{"name": "gsm8k", "weight": 0.5, "kwargs": {"method": "flexible"}}]
    assert fp["reward.reward_fn_map"]["basic_arithmetic"] == "gsm8k"
    assert (fp["model.source"], fp["model.path"], fp["model.tiny"]) == ("default", None, None)
    assert (fp["data.task"], fp["data.train_size"], fp["data.test_size"], fp["data.train_files"]) == (
        "basic_arithmetic",
        4000,
        200,
        [],
    )
    json.dumps(fp)  # stored as JSON


def test_fingerprint_leaves_out_what_may_change_between_a_stop_and_a_resume():
    base = run_fingerprint(compose([]))
    changed = [
        "trainer.total_training_steps=500",
        "trainer.total_epochs=3",
        "trainer.save_freq=5",
        "trainer.test_freq=1",
        "trainer.max_wall_time_s=10",
        "trainer.logger=[console]",
        "trainer.num_threads=1",
        "trainer.device=cpu",
        "rollout.num_threads=1",
        "actor.micro_batch_size_per_device=2",
        "actor.optim.lr=1e-3",
        "actor.clip_ratio=0.3",
        "algorithm.kl_ctrl.kl_coef=0.01",
        "trainer.critic_warmup=1",
    ]
    assert run_fingerprint(compose(changed)) == base


def test_fingerprint_diff_names_each_differing_key():
    ppo, grpo = run_fingerprint(compose([])), run_fingerprint(compose(["algorithm=grpo"]))
    # configs/algorithm/grpo.yaml against ppo.yaml: the estimator, no critic, the KL loss with its estimator
    assert fingerprint_diff(ppo, grpo) == [
        ("algorithm.adv_estimator", "gae", "grpo"),
        ("critic.enable", True, False),
        ("actor.use_kl_loss", False, True),
        ("actor.kl_loss_type", None, "low_var_kl"),
    ]
    # nested values are compared key by key; a side without the key shows as (unset)
    other = run_fingerprint(
        compose(["reward=flexible", "reward.shaping=[{name:gsm8k,weight:1.0,kwargs:{method:flexible}}]"])
    )
    assert [(k, repr(a), repr(b)) for k, a, b in fingerprint_diff(ppo, other)] == [
        ("reward.kwargs.gsm8k", "(unset)", "{'method': 'flexible'}"),
        ("reward.shaping[0].weight", "0.5", "1.0"),
    ]
    # a key the checkpoint's rlplug did not record is not compared (older checkpoints keep resuming)
    older = {k: v for k, v in grpo.items() if k != "critic.enable"}
    assert [k for k, _, _ in fingerprint_diff(older, ppo)] == [
        "algorithm.adv_estimator",
        "actor.use_kl_loss",
        "actor.kl_loss_type",
    ]


def test_a_checkpoint_of_another_algorithm_is_refused_before_any_model_loads(used_dir, monkeypatch):
    # bug: the GRPO run resumed the PPO run's checkpoint without a word
    cfg = run_config(GRPO, used_dir)
    _no_model_loads(monkeypatch)
    with pytest.raises(ConfigError) as info:
        Trainer(cfg)
    msg = str(info.value)
    assert msg.startswith(
        f"Cannot resume from {used_dir / 'global_step_3'}: it was written by another run. What differs "
        "(checkpoint -> this command):\n"
        '  algorithm.adv_estimator: "gae" -> "grpo"\n'
        "  critic.enable: true -> false\n"
        "  actor.use_kl_loss: false -> true\n"
        '  actor.kl_loss_type: null -> "low_var_kl"\n'
    )
    assert (
        "Either train in a new directory: trainer.default_local_dir=<another directory>, or start fresh in this "
        "one: trainer.resume_mode=disable trainer.overwrite=true (the old checkpoints are moved aside, not deleted)."
    ) in msg
    assert CheckpointManager(used_dir).complete_steps() == [1, 2, 3]  # nothing touched


def test_another_reward_or_data_is_refused_and_the_way_out_names_experiment_name(used_dir):
    cfg = run_config(PPO, used_dir, "reward=flexible", "data.train_size=32", validate=False)
    with pytest.raises(ConfigError) as info:
        open_run_dir(cfg, used_dir)
    assert (':\n  reward.kwargs.gsm8k: (unset) -> {"method": "flexible"}\n  data.train_size: 64 -> 32\nEither') in str(
        info.value
    )  # debug=tiny generates 64 rows
    # without trainer.default_local_dir the directory comes from the experiment name
    cfg.trainer.default_local_dir = None
    cfg.trainer.experiment_name = "debug"
    assert "trainer.experiment_name=<a new name> (this run's is 'debug')" in str(
        pytest.raises(ConfigError, open_run_dir, cfg, used_dir).value
    )


def test_resuming_with_more_steps_and_other_logging_is_the_same_run(used_dir, capsys):
    cfg = run_config(PPO, used_dir, "trainer.total_training_steps=5", "trainer.logger=[console]", "trainer.save_freq=2")
    manager, start = open_run_dir(cfg, used_dir)
    assert start.resume_from == used_dir / "global_step_3" and not start.set_aside
    assert manager.max_to_keep == cfg.trainer.max_ckpt_to_keep
    assert "WARNING" not in capsys.readouterr().out


def test_a_checkpoint_without_a_fingerprint_resumes_with_a_warning(used_dir, capsys, caplog):
    for step in (1, 2, 3):  # as rlplug wrote them then: no fingerprint, no checksums.json (docs/reliability.md)
        (used_dir / f"global_step_{step}" / FINGERPRINT_FILE).unlink()
        (used_dir / f"global_step_{step}" / "checksums.json").unlink()
        (used_dir / f"global_step_{step}" / "COMPLETE").write_text(f'{{"step": {step}}}')
    # even another algorithm: there is no fingerprint to compare with (its config.yaml still holds the settings a
    # resume cannot change, such as rollout.n, which REINFORCE++ keeps at 1: tests/test_resume_changes.py)
    cfg = run_config([o if o != "algorithm=ppo" else "algorithm=reinforce_pp" for o in PPO], used_dir)
    with caplog.at_level(logging.WARNING, logger="rlplug.run.checkpoint"):
        _, start = open_run_dir(cfg, used_dir)
    assert start.resume_from == used_dir / "global_step_3"
    expected = (
        f"WARNING: {used_dir / 'global_step_3'} has no run_fingerprint.json (written before rlplug recorded run "
        "fingerprints): resuming without checking that its algorithm, reward, model and data are this command's."
    )
    assert expected in capsys.readouterr().out and expected in caplog.text


# ============================================================================ item 3: a fresh start in a used directory


def test_a_fresh_start_in_a_used_directory_is_refused(used_dir, monkeypatch):
    # bug: resume_mode=disable wrote a new step 1 beside the old 2 and 3; the next auto-resume took the stale 3
    cfg = run_config(PPO, used_dir, "trainer.resume_mode=disable", "trainer.total_training_steps=1")
    _no_model_loads(monkeypatch)
    with pytest.raises(ConfigError) as info:
        Trainer(cfg)
    assert str(info.value) == (
        f"trainer.resume_mode=disable starts a fresh run, but the run directory {used_dir} already holds an earlier "
        "run: complete checkpoints of steps 1, 2, 3 and final_model. Starting fresh beside them would mix two runs (a "
        "later resume or 'rlplug export' could pick up the old checkpoints). Choose one: trainer.overwrite=true "
        f"(move them aside into {used_dir / 'overwritten'}/<date>/ and start fresh; nothing is deleted), "
        "trainer.default_local_dir=<another directory> (train in a new directory), or trainer.resume_mode=auto "
        "(resume the earlier run from step 3)."
    )
    assert CheckpointManager(used_dir).complete_steps() == [1, 2, 3]


def test_overwrite_moves_the_old_run_aside_and_starts_fresh(used_dir, capsys):
    old_weights = (used_dir / "global_step_3" / "backend" / "actor" / "model.safetensors").read_bytes()
    (used_dir / "global_step_9.partial-1").mkdir()  # an interrupted save goes aside too
    cfg = run_config(
        PPO, used_dir, "trainer.resume_mode=disable", "trainer.overwrite=true", "trainer.total_training_steps=1"
    )
    assert fit(cfg) == "finished"
    out = capsys.readouterr().out
    assert "Resumed from" not in out
    (aside,) = (used_dir / "overwritten").iterdir()
    assert (
        f"trainer.overwrite=true: moved the earlier run in {used_dir} ({LATEST}, final_model, metrics.jsonl, "
        f"global_step_1, global_step_2, global_step_3, global_step_9.partial-1) to {aside}; nothing was deleted."
    ) in out
    steps = ["global_step_1", "global_step_2", "global_step_3", "global_step_9.partial-1"]
    assert sorted(p.name for p in aside.iterdir()) == sorted([LATEST, "final_model", "metrics.jsonl", *steps])
    # the earlier run's metric log went aside whole (steps 1..3); the new run's log holds its one step
    from rlplug.run.metrics import read_metrics_jsonl

    assert [r["step"] for r in read_metrics_jsonl(aside)] == [1, 2, 3]
    assert [r["step"] for r in read_metrics_jsonl(used_dir)] == [1]
    assert (aside / "global_step_3" / "backend" / "actor" / "model.safetensors").read_bytes() == old_weights
    assert (aside / LATEST).read_text() == "3"
    # the new run: one step, its own pointer and final model
    manager = CheckpointManager(used_dir)
    assert manager.complete_steps() == [1] and (used_dir / LATEST).read_text() == "1"
    assert manager.latest() == used_dir / "global_step_1" and (used_dir / "final_model" / "config.json").is_file()


def test_set_aside_keeps_the_tracker_store_and_deletes_nothing(tmp_path):
    manager = CheckpointManager(tmp_path)
    for step in (1, 2):
        manager.save(step, lambda d: (d / "x").write_text("x"))
    (tmp_path / "mlflow.db").write_text("db")
    first = set_aside_checkpoints(manager)
    assert first is not None and first.parent == tmp_path / "overwritten"
    assert sorted(p.name for p in first.iterdir()) == ["global_step_1", "global_step_2", LATEST]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db", "overwritten"]
    assert set_aside_checkpoints(manager) is None  # nothing left to move
    manager.save(3, lambda d: (d / "x").write_text("x"))
    second = set_aside_checkpoints(manager)  # within the same second: a folder of its own
    assert second is not None and second != first and (second / "global_step_3" / "x").read_text() == "x"


def test_latest_follows_the_pointer_and_warns_loudly_about_newer_steps(tmp_path, capsys, caplog):
    # the directory the bug left: a fresh run's step 2 (pointer 2) beside an older run's steps 4 and 6
    manager = CheckpointManager(tmp_path, max_to_keep=None)
    for step in (2, 4, 6):
        manager.save(step, lambda d: (d / "x").write_text("x"))
    (tmp_path / LATEST).write_text("2")
    with caplog.at_level(logging.WARNING, logger="rlplug.run.checkpoint"):
        assert manager.latest() == tmp_path / "global_step_2"  # was global_step_6
    expected = (
        f"WARNING: the checkpoint pointer {tmp_path / LATEST} names step 2, but newer complete checkpoints exist "
        f"beside it: {tmp_path / 'global_step_4'}, {tmp_path / 'global_step_6'} (a save killed before the pointer "
        "was updated, or left over from an earlier run in this directory). Using step 2, as the pointer says."
    )
    assert expected in capsys.readouterr().out and expected in caplog.text


def test_auto_resume_and_export_follow_the_pointer_and_export_says_which_step(used_dir, tmp_path, capsys):
    from rlplug.cli import main

    (used_dir / LATEST).write_text("2")  # step 3 complete beside it, as after a kill before the pointer update
    _, start = open_run_dir(run_config(PPO, used_dir, "trainer.total_training_steps=4"), used_dir)
    assert start.resume_from == used_dir / "global_step_2"
    capsys.readouterr()
    assert main(["export", str(used_dir), "--out", str(tmp_path / "exported")]) == 0
    out = capsys.readouterr().out
    assert f"newer complete checkpoints exist beside it: {used_dir / 'global_step_3'}" in out
    assert (
        f"Exported step 2 ({used_dir / 'global_step_2'}): wrote a Hugging Face model folder to {tmp_path / 'exported'}"
    ) in out
    exported = load_file(str(tmp_path / "exported" / "model.safetensors"))
    saved = load_file(str(used_dir / "global_step_2" / "backend" / "actor" / "model.safetensors"))
    assert exported and exported.keys() <= saved.keys()
    assert all(torch.equal(exported[k], saved[k]) for k in exported)
    # a global_step_N directory exports itself
    assert main(["export", str(used_dir / "global_step_3"), "--out", str(tmp_path / "e3")]) == 0
    assert f"Exported step 3 ({used_dir / 'global_step_3'})" in capsys.readouterr().out


def test_a_map_entry_for_another_source_or_an_unset_critic_enable_is_the_same_run(used_dir):
    # the run's data source is basic_arithmetic: mapping another source changes nothing it trains on
    cfg = run_config(PPO, used_dir, "reward.reward_fn_map.my/other=math_verify", "critic.enable=true")
    _, start = open_run_dir(cfg, used_dir)
    assert start.resume_from == used_dir / "global_step_3"
    # ... but remapping its own source is another reward, and another GRPO normalisation another estimator
    for override in ("reward.reward_fn_map.basic_arithmetic=math_verify", "algorithm.norm_adv_by_std_in_grpo=false"):
        cfg = run_config(PPO, used_dir, override, validate=False)
        with pytest.raises(ConfigError, match="it was written by another run"):
            open_run_dir(cfg, used_dir)


def test_a_mismatch_under_resume_path_suggests_what_works_for_an_explicit_checkpoint(used_dir):
    ckpt = used_dir / "global_step_2"
    cfg = run_config(
        PPO, used_dir, "reward=flexible", "trainer.resume_mode=resume_path", f"trainer.resume_from_path={ckpt}"
    )
    with pytest.raises(ConfigError) as info:
        open_run_dir(cfg, used_dir)
    msg = str(info.value)
    # a new experiment name would pick the same explicit checkpoint again: not offered
    assert "trainer.experiment_name" not in msg and "trainer.default_local_dir" not in msg
    assert (
        "Point trainer.resume_from_path at a checkpoint of this run, or start a new run from that checkpoint's "
        f"weights: rlplug export {ckpt} --out DIR, then model=path model.path=DIR trainer.resume_mode=disable."
    ) in msg
