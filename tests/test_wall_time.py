"""``trainer.max_wall_time_s``: reaching the time budget ends the run like its last step."""

from __future__ import annotations

from pathlib import Path

from rlplug.config.compose import compose
from rlplug.run.checkpoint import CheckpointManager
from rlplug.run.trainer import Trainer
from rlplug.run.validate import validate_config


def test_time_budget_validates_saves_and_exports(tmp_path: Path, capsys) -> None:
    cfg = compose(
        [
            "debug=tiny",
            "model.tiny.num_hidden_layers=1",
            "data.train_batch_size=2",
            "actor.ppo_mini_batch_size=1",
            "actor.micro_batch_size_per_device=1",
            "data.max_response_length=8",
            "data.val_max_samples=4",
            "trainer.total_training_steps=5",
            "trainer.save_freq=0",
            "trainer.test_freq=100",
            "trainer.val_before_train=false",
            "trainer.logger=[console]",
            "trainer.num_threads=1",
            "trainer.device=cpu",
            # any positive budget is exceeded after the first step of a ~1 s step
            "trainer.max_wall_time_s=0.001",
            f"trainer.default_local_dir={tmp_path}",
        ]
    )
    validate_config(cfg)
    trainer = Trainer(cfg)
    try:
        status = trainer.fit()
    finally:
        trainer.close()
    out = capsys.readouterr().out
    assert status == "finished"
    assert trainer.global_step == 1  # stopped after the first step, not at total_training_steps=5
    assert "Reached trainer.max_wall_time_s=0.001 after step 1" in out
    assert "validation @ step 1:" in out  # validated although step 1 is no multiple of test_freq (last step)
    assert CheckpointManager(tmp_path).complete_steps() == [1]  # saved although save_freq=0
    assert (tmp_path / "final_model" / "config.json").is_file()
