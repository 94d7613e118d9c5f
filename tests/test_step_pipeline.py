"""The step pipeline seam: ``Trainer.train_step`` runs whatever ``trainer.pipeline`` is.

The packaged synchronous pipeline is the default; a second, trivial pipeline (generate only, no update)
runs through the same seam with the loop's checkpoints and metric log around it, and leaves the
actor's weights exactly as they were.
"""

from __future__ import annotations

from typing import Any

import torch
from _helpers import TINY_CPU_RUN, run_config

from rlplug.run.metrics import read_metrics_jsonl
from rlplug.run.step_pipeline import StepPipeline, SyncStepPipeline
from rlplug.run.trainer import Trainer


class GenerateOnly:
    """A trivial pipeline: samples the step's prompts greedily and records the response lengths."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def run(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        params = trainer.sampling_params(validation=True)
        out = trainer._generate([[1, 2, 3], [4, 5]], params, label="rollout")
        metrics["pipeline/step"] = float(step)
        metrics["pipeline/responses"] = float(len(out.response_ids))
        self.steps.append(step)


def test_the_default_pipeline_is_the_synchronous_one(tmp_path) -> None:
    trainer = Trainer(run_config([*TINY_CPU_RUN, "trainer.total_training_steps=1", "trainer.logger=[]"], tmp_path))
    try:
        assert type(trainer.pipeline) is SyncStepPipeline
        assert isinstance(trainer.pipeline, StepPipeline) and isinstance(GenerateOnly(), StepPipeline)
        metrics = trainer.train_step()
        assert trainer.global_step == 1 and "actor/pg_loss" in metrics and "timing_s/gen" in metrics
    finally:
        trainer.close()


def test_a_second_pipeline_runs_through_the_seam(tmp_path) -> None:
    cfg = run_config(
        [*TINY_CPU_RUN, "trainer.total_training_steps=3", "trainer.save_freq=3", "trainer.logger=[]"], tmp_path
    )
    trainer = Trainer(cfg)
    try:
        before = {k: v.detach().clone() for k, v in trainer.backend.actor.model.state_dict().items()}
        pipeline = GenerateOnly()
        trainer.pipeline = pipeline
        assert trainer.fit() == "finished"
        after = trainer.backend.actor.model.state_dict()
    finally:
        trainer.close()
    assert pipeline.steps == [1, 2, 3]
    # nothing trained: the actor's weights are the initial ones, bit for bit
    assert sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)
    records = {r["step"]: r for r in read_metrics_jsonl(tmp_path)}
    assert [records[s]["pipeline/step"] for s in (1, 2, 3)] == [1.0, 2.0, 3.0]
    assert all(records[s]["pipeline/responses"] == 2.0 for s in (1, 2, 3))
    assert "actor/pg_loss" not in records[3]  # the synchronous pipeline did not run
    assert (tmp_path / "global_step_3" / "COMPLETE").is_file()  # the loop's checkpoint around the pipeline
