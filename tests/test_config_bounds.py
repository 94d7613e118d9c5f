"""Impossible run lengths and batch counts are refused at config time (issue 31, item 5).

``rlplug train trainer.total_training_steps=-1`` exited 0 with "Training finished at step 0" and a
``final_model`` equal to the start; ``trainer.total_epochs=0`` was accepted too. Each count below is
refused at 0 and below, before any model loads, with what it counts and an example; the values the
schema documents (``trainer.total_training_steps=null``: from the epochs; ``rollout.top_k=-1``: no top-k;
``trainer.test_freq=-1``: never) keep their meaning.
"""

from __future__ import annotations

import pytest

from rlplug.base.exit_codes import ExitCode
from rlplug.cli import main
from rlplug.config.compose import compose
from rlplug.config.schema import ConfigError
from rlplug.run.validate import validate_config

#: key -> the message after "<key>=<value>: " (rlplug.run.validate.COUNT_KEYS)
EXPECTED = {
    "trainer.total_training_steps": (
        "the number of training steps must be an integer >= 1 (e.g. 100, or null to train trainer.total_epochs "
        "passes over the data)."
    ),
    "trainer.total_epochs": "the number of passes over the training data must be an integer >= 1 (e.g. 1).",
    "data.train_batch_size": "the prompts per training step must be an integer >= 1 (e.g. 8).",
    "actor.ppo_mini_batch_size": (
        "the prompts per optimizer step of the actor must be an integer >= 1 (e.g. a divisor of data.train_batch_size)."
    ),
    "actor.ppo_epochs": "the passes of the actor's update over each batch must be an integer >= 1 (e.g. 1).",
    "rollout.n": "the responses sampled per prompt must be an integer >= 1 (e.g. 1 for PPO, 4 for GRPO).",
    "critic.ppo_epochs": (
        "the passes of the critic's update over each batch must be an integer >= 1 (e.g. 1, or null for "
        "actor.ppo_epochs)."
    ),
}
VERL = {
    "actor.ppo_mini_batch_size": "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor.ppo_epochs": "actor_rollout_ref.actor.ppo_epochs",
    "rollout.n": "actor_rollout_ref.rollout.n",
}


@pytest.mark.parametrize("key", sorted(EXPECTED))
@pytest.mark.parametrize("value", [0, -1])
def test_a_count_below_one_is_refused_with_what_it_counts(key, value):
    verl = f" (verl's {VERL[key]})" if key in VERL else ""
    with pytest.raises(ConfigError) as info:
        validate_config(compose(["debug=tiny", f"{key}={value}"]))
    assert str(info.value) == f"{key}={value}{verl}: {EXPECTED[key]}"


def test_verls_spelling_lands_on_the_same_check_and_documented_values_keep_their_meaning():
    with pytest.raises(ConfigError) as info:
        validate_config(compose(["debug=tiny", "actor_rollout_ref.actor.ppo_epochs=0"]))
    assert (
        str(info.value)
        == f"actor.ppo_epochs=0 (verl's actor_rollout_ref.actor.ppo_epochs): {EXPECTED['actor.ppo_epochs']}"
    )
    with pytest.raises(ConfigError, match=r"^rollout\.n=0 \(verl's actor_rollout_ref\.rollout\.n\): "):
        validate_config(
            compose(["debug=tiny", "algorithm=grpo", "actor_rollout_ref.rollout.n=0"])
        )  # before grpo's n >= 2
    for documented in (
        ["trainer.total_training_steps=null", "trainer.total_epochs=2"],  # from the epochs, as verl
        ["rollout.top_k=-1", "rollout.val_kwargs.top_k=-1"],  # no top-k
        ["trainer.test_freq=-1"],  # never validate
        ["data.val_max_samples=-1"],  # verl's -1: every row (null here)
        ["critic.ppo_epochs=null"],  # the actor's
    ):
        validate_config(compose(["debug=tiny", *documented]))


def test_the_cli_refuses_a_negative_step_count_before_training(tmp_path, capsys):
    # the command: it exited 0 with "Training finished at step 0"
    rc = main(["train", "debug=tiny", "trainer.total_training_steps=-1", f"trainer.default_local_dir={tmp_path}"])
    out = capsys.readouterr()
    assert rc == ExitCode.BAD_INPUT
    assert "trainer.total_training_steps=-1: the number of training steps must be an integer >= 1" in out.err
    assert "Training finished" not in out.out and not (tmp_path / "final_model").exists()
