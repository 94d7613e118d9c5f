"""The critic follows the advantage estimator, as in verl (issue 31, item 3).

verl trains a critic when ``critic.enable`` is true, or, with it unset, when the estimator is ``gae``
(``verl/trainer/ppo/utils.py::need_critic``). rlplug's default config takes the ``ppo`` preset, which
sets ``critic.enable: true`` and ``trainer.critic_warmup: 3``; before this change
``algorithm.adv_estimator=grpo`` on it kept both (a critic trained for nothing, the actor frozen for 3
steps) and the run was named ``ppo_*``. Now a preset's value that disagrees with the estimator follows
the estimator, with one line on stderr; a value the user gives is kept.
"""

from __future__ import annotations

import pytest

import rlplug
from rlplug.config.compose import compose
from rlplug.config.schema import ConfigError
from rlplug.config.verl_keys import file_overrides, merge_file_and_command_line
from rlplug.contracts.registry import get_registry
from rlplug.run.validate import plan_batch, validate_config

PPO_YAML = "configs/algorithm/ppo.yaml"
GRPO_LINE = (
    f"critic.enable: true (from {PPO_YAML}) -> false, trainer.critic_warmup: 3 (from {PPO_YAML}) -> 0: "
    "algorithm.adv_estimator=grpo needs no critic (no selected plugin requires values; verl decides the same way); "
    "set critic.enable=true to keep it."
)


def _lines(capsys) -> list[str]:
    return [ln for ln in capsys.readouterr().err.splitlines() if ln]


def test_a_critic_free_estimator_on_the_default_config_trains_no_critic(capsys):
    capsys.readouterr()
    cfg = compose(["algorithm.adv_estimator=grpo", "rollout.n=4"])
    assert _lines(capsys) == [GRPO_LINE]  # one line, naming the preset file each value came from
    assert cfg.critic.enable is False and cfg.trainer.critic_warmup == 0
    assert cfg.trainer.experiment_name == "grpo_basic_arithmetic"  # named after the estimator, not ppo_*
    assert plan_batch(cfg).use_critic is False
    validate_config(cfg)
    # verl's spelling of the same key, and the other critic-free estimators, the same way
    cfg = compose(["algorithm.adv_estimator=rloo", "actor_rollout_ref.rollout.n=2"])
    assert (cfg.critic.enable, cfg.trainer.critic_warmup, cfg.trainer.experiment_name) == (
        False,
        0,
        "rloo_basic_arithmetic",
    )
    # the preset's own estimator changes nothing and prints nothing
    capsys.readouterr()
    cfg = compose(["algorithm.adv_estimator=gae"])
    assert (cfg.critic.enable, cfg.trainer.critic_warmup, cfg.trainer.experiment_name) == (
        True,
        3,
        "ppo_basic_arithmetic",
    )
    assert _lines(capsys) == []


def test_a_critic_enable_the_user_gives_is_kept(tmp_path, capsys):
    # grpo_to_ppo's way: a critic beside a critic-free estimator (experiment=grpo_to_ppo, docs/schedules.md)
    capsys.readouterr()
    cfg = compose(["algorithm.adv_estimator=grpo", "rollout.n=4", "critic.enable=true"])
    assert cfg.critic.enable is True and cfg.trainer.critic_warmup == 3  # with a critic the warm-up stays
    assert cfg.trainer.experiment_name == "grpo_basic_arithmetic"
    assert _lines(capsys) == [] and plan_batch(cfg).use_critic is True
    validate_config(cfg)
    # in verl's spelling, from the user's own config file (--config-path/--config-name)
    (tmp_path / "mine.yaml").write_text("critic:\n  enable: true\nalgorithm:\n  adv_estimator: grpo\n")
    cfg = compose(merge_file_and_command_line(file_overrides(tmp_path / "mine.yaml"), ["rollout.n=4"]))
    assert cfg.critic.enable is True and cfg.trainer.critic_warmup == 3
    # an explicit false keeps false, and the preset's warm-up (which needs a critic) goes
    capsys.readouterr()
    cfg = compose(["algorithm.adv_estimator=grpo", "rollout.n=4", "critic.enable=false"])
    assert cfg.critic.enable is False and cfg.trainer.critic_warmup == 0
    assert _lines(capsys) == [
        f"trainer.critic_warmup: 3 (from {PPO_YAML}) -> 0: critic.enable=false: no critic is trained, so a "
        "warm-up would keep the actor frozen for nothing."
    ]
    validate_config(cfg)
    # the experiment that trains a critic in its GRPO phase keeps it there
    from rlplug.run.schedule import compose_phases

    cfg = compose(["experiment=grpo_to_ppo"])
    assert cfg.critic.enable is True and [p.cfg.critic.enable for p in compose_phases(cfg)] == [True, True, True]


def test_an_estimator_that_needs_values_turns_a_presets_critic_on(capsys):
    capsys.readouterr()
    cfg = compose(["algorithm=grpo", "algorithm.adv_estimator=gae"])
    assert _lines(capsys) == [
        "critic.enable: false (from configs/algorithm/grpo.yaml) -> true: algorithm.adv_estimator=gae requires "
        "values, which only a critic produces."
    ]
    assert cfg.critic.enable is True and cfg.trainer.experiment_name == "gae_basic_arithmetic"
    assert plan_batch(cfg).use_critic is True
    validate_config(cfg)


def test_a_warm_up_the_user_gives_without_a_critic_is_refused():
    cfg = compose(["algorithm.adv_estimator=grpo", "rollout.n=4", "trainer.critic_warmup=2"])
    assert cfg.trainer.critic_warmup == 2  # given: kept, and refused with the reason
    with pytest.raises(ConfigError, match=r"^trainer\.critic_warmup=2 keeps the actor frozen for the first 2 steps"):
        validate_config(cfg)


class _Steps:
    def __init__(self) -> None:
        self.metrics: dict[int, dict[str, float]] = {}

    @rlplug.hookimpl
    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        self.metrics[step] = dict(metrics)


def test_a_tiny_run_builds_no_critic_and_updates_the_actor_at_step_1(tmp_path):
    # not debug=tiny: that preset sets trainer.critic_warmup=0 itself; here the ppo preset's 3 must go
    from rlplug.run.trainer import Trainer

    cfg = compose(
        [
            "model=tiny",
            "rollout=hf",
            "model.tiny.num_hidden_layers=1",
            "data.train_size=8",
            "data.test_size=4",
            "data.train_batch_size=2",
            "data.max_response_length=8",
            "actor.ppo_mini_batch_size=2",
            "actor.micro_batch_size_per_device=2",
            "actor.use_torch_compile=false",
            "algorithm.adv_estimator=grpo",
            "rollout.n=2",
            # -chars/100 (debug=tiny's term): responses of different lengths score differently, so the
            # group advantages are not all 0
            "reward.shaping=[{name:length_penalty,weight:1.0,kwargs:{target_chars:0,scale_chars:100.0,min_value:-100.0}}]",
            "trainer.total_training_steps=1",
            "trainer.val_before_train=false",
            "trainer.test_freq=0",
            "trainer.max_wall_time_s=null",
            "trainer.logger=[console]",
            "trainer.num_threads=1",
            "trainer.device=cpu",
            f"trainer.default_local_dir={tmp_path}",
        ]
    )
    validate_config(cfg)
    rec = _Steps()
    get_registry().pm.register(rec)
    trainer = Trainer(cfg)
    try:
        assert trainer.use_critic is False and trainer.backend.critic is None  # no critic model is built
        assert trainer.fit() == "finished"
    finally:
        trainer.close()
        get_registry().pm.unregister(rec)
    step1 = rec.metrics[1]
    assert step1["actor/grad_norm"] > 0  # the actor is updated at step 1: no warm-up
    assert not [k for k in step1 if k.startswith(("critic/vf_", "critic/values"))]
