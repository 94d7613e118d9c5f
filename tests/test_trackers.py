"""Trackers: name sanitizing, param flattening, the console line, and the MLflow tracker against a
real local SQLite store (params, metrics, tables, artifacts, status, resume, URI override)."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from rlplug.config.compose import compose
from rlplug.plugins.tracking.trackers import (
    MAX_NAME_LENGTH,
    MAX_PARAM_VALUE_LENGTH,
    ConsoleTracker,
    MlflowTracker,
    flatten_params,
    run_dir,
    sanitize_name,
)

# ============================================================================ helpers


@pytest.mark.parametrize(
    "name, expected",
    [
        ("actor/pg_loss", "actor/pg_loss"),
        ("val-core/basic_arithmetic/acc/mean@8", "val-core/basic_arithmetic/acc/mean_at_8"),
        ("timing_s/gen time: 1", "timing_s/gen time: 1"),  # spaces and colons are allowed
        ("a//b/./c/", "a/b/c"),  # empty and '.' segments are not unique paths for MLflow
        ("/abs/../x", "abs/__/x"),
        ("reward (gsm8k)+kl=ok?", "reward _gsm8k__kl_ok_"),
        ("", "_"),
    ],
)
def test_sanitize_name(name, expected):
    assert sanitize_name(name) == expected


def test_sanitized_names_pass_mlflows_own_validation():
    from mlflow.utils.validation import _validate_metric_name, _validate_param_name

    names = ["val-core/x/acc/mean@8", "a//b/./c/", "/../..", "x" * 400, "é/ü", "tab\there", "a\nb"]
    for name in names:
        clean = sanitize_name(name)
        _validate_metric_name(clean)  # raises MlflowException if invalid
        _validate_param_name(clean)
        assert len(clean) <= MAX_NAME_LENGTH
    # long names stay distinct after cutting (a hash of the full name ends them)
    a, b = sanitize_name("p" * 300 + "a"), sanitize_name("p" * 300 + "b")
    assert a != b and len(a) == len(b) == MAX_NAME_LENGTH


def test_flatten_params():
    cfg = OmegaConf.create({"a": {"b": 1, "c": [1, "x"], "d": None, "e": {}}, "f": 0.5})
    assert flatten_params(cfg) == {"a.b": "1", "a.c": '[1, "x"]', "a.d": "None", "a.e": "{}", "f": "0.5"}
    assert flatten_params({"x": {"y": {"z": True}}}) == {"x.y.z": "True"}


def test_run_dir(tmp_path):
    cfg = compose([f"trainer.default_local_dir={tmp_path}/here"])
    assert run_dir(cfg) == tmp_path / "here"
    cfg = compose(["trainer.project_name=p", "trainer.experiment_name=e"])
    # same folder the trainer writes checkpoints to
    from rlplug.run.trainer import run_dir_for

    assert run_dir(cfg) == Path(run_dir_for(cfg)) and run_dir(cfg).parts[-2:] == ("p", "e")


# ============================================================================ console


def test_console_line():
    out = io.StringIO()
    from rich.console import Console

    tracker = ConsoleTracker(compose(["trainer.experiment_name=ppo_arithmetic"]), console=Console(file=out, width=300))
    metrics = {
        "actor/pg_loss": torch.tensor(-0.01234),
        "critic/score/mean": 0.25,
        "timing_s/step": 12.3456,
        "val-core/basic_arithmetic/acc/mean@1": 0.5,
        "actor/unlisted": 3.0,  # not a key metric: not shown
        "text": "not a number",
    }
    tracker.log_metrics(metrics, step=3)
    tracker.log_table("val_generations", [{"a": 1}, {"a": 2}], step=3)
    tracker.close("KILLED")
    tracker.close("FINISHED")  # idempotent: printed once
    assert out.getvalue().splitlines() == [
        "step 3 | score 0.2500 | pg_loss -0.0123 | step_s 12.35 | basic_arithmetic/acc/mean@1 0.5000",
        "run rlplug/ppo_arithmetic: KILLED",
    ]


def test_console_line_without_known_metrics_and_cap():
    tracker = ConsoleTracker(None, console=io.StringIO(), max_fields=2)
    assert tracker.summary({"b": 2.0, "a": 1e-5, "c": 1e6}, 7) == "step 7 | a 1.000e-05 | b 2 | (+1 more)"


# ============================================================================ mlflow


@pytest.fixture
def mlflow_cfg(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)  # nothing may be written to the working directory
    return compose(
        [f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.project_name=proj", "trainer.experiment_name=exp1"]
    )


def _artifact_json(tracker: MlflowTracker, path: str) -> dict:
    local = tracker.client.download_artifacts(tracker.run_id, path)
    return json.loads(Path(local).read_text())


def test_mlflow_end_to_end(mlflow_cfg, tmp_path, caplog, capfd):
    tracker = MlflowTracker(mlflow_cfg)
    run_path = tmp_path / "run"
    assert tracker.tracking_uri == f"sqlite:///{run_path / 'mlflow.db'}" and (run_path / "mlflow.db").is_file()
    assert json.loads((run_path / "mlflow_run.json").read_text())["run_id"] == tracker.run_id
    assert not tracker.resumed
    assert "Creating initial MLflow database tables" not in capfd.readouterr().err  # mlflow is quiet

    # params: the config, flattened, at construction
    run = tracker.client.get_run(tracker.run_id)
    assert run.info.run_name == "exp1"
    assert tracker.client.get_experiment(run.info.experiment_id).name == "proj"
    params = run.data.params
    assert params["actor.clip_ratio"] == "0.2" and params["trainer.logger"] == '["console", "mlflow"]'
    assert params["reward.reward_fn_map.openai/gsm8k"] == "gsm8k"
    assert len(params) == len(flatten_params(mlflow_cfg))
    # long values are truncated to MLflow's limit; same value again is a no-op, a new value is refused
    tracker.log_params({"notes": {"long": "x" * 7000}, "actor": {"clip_ratio": 0.2}})
    with caplog.at_level(logging.WARNING, logger="rlplug.trackers"):
        tracker.log_params({"actor.clip_ratio": 0.3})
    assert "already '0.2'" in caplog.text
    params = tracker.client.get_run(tracker.run_id).data.params
    assert len(params["notes.long"]) == MAX_PARAM_VALUE_LENGTH and params["notes.long"].endswith(
        "[truncated, 7000 chars]"
    )
    assert params["actor.clip_ratio"] == "0.2"

    # metrics: per step, names sanitized, tensors accepted, text skipped
    tracker.log_metrics({"val-core/src/acc/mean@8": 0.5, "actor/pg_loss": torch.tensor(1.5), "note": "x"}, step=1)
    tracker.log_metrics({"actor/pg_loss": 0.75}, step=2)
    hist = tracker.client.get_metric_history(tracker.run_id, "actor/pg_loss")
    assert [(m.step, m.value) for m in hist] == [(1, 1.5), (2, 0.75)]
    assert [
        (m.step, m.value) for m in tracker.client.get_metric_history(tracker.run_id, "val-core/src/acc/mean_at_8")
    ] == [(1, 0.5)]
    assert "note" not in tracker.client.get_run(tracker.run_id).data.metrics

    # tables: JSON with a step column; a second call to the same name appends
    tracker.log_table("val_generations", [{"prompt": "1+1", "response": "2", "score": 1.0}], step=1)
    tracker.log_table("val_generations", [{"prompt": "2+2", "response": "5", "score": 0.0, "extra": [1]}], step=2)
    table = _artifact_json(tracker, "tables/val_generations.json")
    assert table["columns"] == ["step", "prompt", "response", "score", "extra"]
    assert table["data"] == [[1, "1+1", "2", 1.0, None], [2, "2+2", "5", 0.0, "[1]"]]

    # artifacts: files and folders; the config as YAML
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "w.txt").write_text("weights")
    tracker.log_artifact(tmp_path / "folder", artifact_path="final_model")
    assert [a.path for a in tracker.client.list_artifacts(tracker.run_id, "final_model")] == ["final_model/w.txt"]
    assert (
        OmegaConf.create(Path(tracker.client.download_artifacts(tracker.run_id, "config.yaml")).read_text())
        == mlflow_cfg
    )
    with pytest.raises(FileNotFoundError, match="does not exist"):
        tracker.log_artifact(tmp_path / "nope.bin")

    with pytest.raises(ValueError, match="use 'FINISHED', 'KILLED' or 'FAILED'"):
        tracker.close("done")
    tracker.close("interrupted")  # the trainer's word for KILLED
    tracker.close("FAILED")  # idempotent: the first status stays
    assert tracker.client.get_run(tracker.run_id).info.status == "KILLED"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "run"]  # nothing else written


def test_mlflow_resume_continues_the_run_only_from_a_checkpoint(mlflow_cfg, tmp_path):
    first = MlflowTracker(mlflow_cfg)
    first.log_metrics({"actor/pg_loss": 1.0}, step=1)
    first.close("KILLED")

    # no checkpoint yet: the trainer starts from step 0, so a new MLflow run starts too
    second = MlflowTracker(mlflow_cfg)
    assert second.run_id != first.run_id and not second.resumed
    second.log_table("samples", [{"response": "007"}], step=1)
    second.close("KILLED")

    # a complete checkpoint: the trainer resumes, and so does the run recorded last
    (tmp_path / "run" / "global_step_2").mkdir()
    (tmp_path / "run" / "global_step_2" / "COMPLETE").write_text("")
    third = MlflowTracker(mlflow_cfg)
    assert third.run_id == second.run_id and third.resumed
    assert third.client.get_run(third.run_id).info.status == "RUNNING"
    third.log_metrics({"actor/pg_loss": 0.5}, step=3)
    assert [m.step for m in third.client.get_metric_history(third.run_id, "actor/pg_loss")] == [3]
    # a table logged before the interruption is extended, not replaced (and "007" stays text)
    third.log_table("samples", [{"response": "8", "score": 1.0}], step=3)
    table = _artifact_json(third, "tables/samples.json")
    assert table == {"columns": ["step", "response", "score"], "data": [[1, "007", None], [3, "8", 1.0]]}
    third.close()
    assert third.client.get_run(third.run_id).info.status == "FINISHED"

    # resume_mode=disable never continues
    OmegaConf.update(mlflow_cfg, "trainer.resume_mode", "disable")
    fourth = MlflowTracker(mlflow_cfg)
    assert fourth.run_id != third.run_id and not fourth.resumed
    fourth.close()
    runs = fourth.client.search_runs([fourth.experiment_id])
    assert len(runs) == 3


def test_mlflow_tracking_uri_env_overrides_the_local_store(mlflow_cfg, tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'shared.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    tracker = MlflowTracker(mlflow_cfg)
    assert tracker.tracking_uri == uri
    assert (tmp_path / "shared.db").is_file() and not (tmp_path / "run" / "mlflow.db").exists()
    tracker.log_metrics({"a": 1.0}, step=1)
    tracker.close()
    assert tracker.client.get_run(tracker.run_id).data.metrics == {"a": 1.0, "trainer/attempt": 1.0}


# ============================================================================ issue 14, item 8: MLflow content


@pytest.mark.parametrize(
    "name, kwargs, expected",
    [
        ("val-core/gsm8k/acc/mean@8", {}, "val-core/gsm8k/acc/mean_at_8"),
        ("a//b/./c/", {}, "a/b/c"),
        ("reward (gsm8k)+kl=ok?", {}, "reward _gsm8k__kl_ok_"),
        # a stricter tracker (Prometheus' [a-zA-Z0-9_:]) passes its own set: same @ rule, "/" is not a path
        ("val-core/gsm8k/acc/mean@8", {"allowed": "A-Za-z0-9_:"}, "val_core_gsm8k_acc_mean_at_8"),
        ("x" * 20, {"max_length": 12}, "xxx-" + __import__("hashlib").sha1(b"x" * 20).hexdigest()[:8]),
        ("x" * 300, {"max_length": None}, "x" * 300),
    ],
)
def test_tracker_name_is_one_core_mapping(name, kwargs, expected):
    from rlplug.run.metrics import tracker_name

    assert tracker_name(name, **kwargs) == expected
    if not kwargs:  # the MLflow tracker maps with it
        assert sanitize_name(name) == expected


def test_mlflow_tables_are_readable_with_mlflow_load_table(mlflow_cfg):
    import mlflow

    tracker = MlflowTracker(mlflow_cfg)
    name = "val_generations/step_000002.json"
    tracker.log_table(name, [{"prompt": "1+1?", "response": "two", "score": 1.0}], step=2)
    tracker.log_table(name, [{"prompt": "2+2?", "response": "007", "score": 0.0, "extra": "x"}], step=2)
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(tracker.tracking_uri)  # load_table searches runs through the global client
    try:
        mlflow.set_experiment(experiment_id=tracker.experiment_id)
        frame = mlflow.load_table(f"tables/{name}", run_ids=[tracker.run_id])
    finally:
        mlflow.set_tracking_uri(previous)
    assert list(frame.columns) == ["step", "prompt", "response", "score", "extra"]
    assert frame["prompt"].tolist() == ["1+1?", "2+2?"] and frame["step"].tolist() == [2, 2]
    assert frame["score"].tolist() == [1.0, 0.0]
    # the file itself keeps text as text (pandas' reader guesses "007" is 7; the stored JSON does not)
    raw = _artifact_json(tracker, f"tables/{name}")
    assert raw["data"] == [[2, "1+1?", "two", 1.0, None], [2, "2+2?", "007", 0.0, "x"]]
    tracker.close()


def test_mlflow_run_is_tagged_with_the_rlplug_version_and_git_commit(mlflow_cfg):
    import importlib.metadata
    import subprocess

    import rlplug

    root = Path(rlplug.__file__).resolve().parent.parent
    tracker = MlflowTracker(mlflow_cfg)
    tags = tracker.client.get_run(tracker.run_id).data.tags
    tracker.close()
    assert tags["rlplug.version"] == importlib.metadata.version("rlplug")
    if (root / ".git").exists():  # an editable install from a checkout (as in this repository)
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
        assert tags["rlplug.git_commit"] == head.stdout.strip() and len(tags["rlplug.git_commit"]) == 40
        assert tags["rlplug.git_dirty"] in ("true", "false")
    else:
        assert "rlplug.git_commit" not in tags


def test_source_tags_without_git(monkeypatch):
    from rlplug import metric_names as metrics

    metrics._source_tags.cache_clear()
    monkeypatch.setenv("PATH", "/nonexistent")  # no git executable: the commit is absent, nothing raises
    try:
        tags = metrics.source_tags()
    finally:
        metrics._source_tags.cache_clear()
    assert set(tags) == {"rlplug.version"}


def test_training_run_logs_rollouts_validation_tables_and_a_final_model_pointer(tmp_path, monkeypatch):
    """A 2-step tiny run with the MLflow tracker: training rollouts (trainer.log_train_generations=1),
    validation samples as tables mlflow.load_table reads, and the final model as a pointer artifact."""
    import mlflow
    from _helpers import TINY_CPU_RUN, run_config

    from rlplug.run.trainer import Trainer

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = run_config(
        TINY_CPU_RUN,
        tmp_path / "run",
        "algorithm=grpo",
        "rollout.n=2",
        "trainer.logger=[mlflow]",
        "trainer.total_training_steps=2",
        "trainer.test_freq=2",
        "trainer.save_freq=0",
        "data.val_max_samples=2",
        "trainer.log_train_generations=1",
        "trainer.train_samples_to_log=3",
    )
    trainer = Trainer(cfg)
    try:
        assert trainer.fit() == "finished"
    finally:
        trainer.close()
    tracker = MlflowTracker(cfg)  # the store of the run (continued: it has a checkpoint)
    run = tracker.client.get_run(tracker.run_id)
    assert tracker.resumed and run.data.tags["rlplug.version"]
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(tracker.tracking_uri)
    try:
        mlflow.set_experiment(experiment_id=tracker.experiment_id)
        train = [
            mlflow.load_table(f"tables/train_generations/step_00000{s}.json", run_ids=[tracker.run_id]) for s in (1, 2)
        ]
        val = mlflow.load_table("tables/val_generations/step_000002.json", run_ids=[tracker.run_id])
    finally:
        mlflow.set_tracking_uri(previous)
    for step, frame in zip((1, 2), train):
        assert len(frame) == 3 and frame["step"].tolist() == [step] * 3
        assert list(frame.columns)[:1] == ["step"]
        assert {"prompt", "response", "score", "advantage", "ground_truth", "data_source"} <= set(frame.columns)
        # GRPO, 2 responses per prompt (the first 2 rows are one group, scores s1, s2): the advantage is
        # (s - mean) / (std + 1e-6) with std the unbiased |s1 - s2| / sqrt(2), so +-sqrt(2)/2 (0 if s1 == s2)
        (s1, s2), (a1, a2) = frame["score"].tolist()[:2], frame["advantage"].tolist()[:2]
        sign = (s1 > s2) - (s1 < s2)
        assert (a1, a2) == pytest.approx((sign * 2**-0.5, -sign * 2**-0.5), abs=1e-4)
    assert len(val) == 2 and val["step"].tolist() == [2, 2]  # data.val_max_samples=2, rollout.val_kwargs.n=1
    pointer = json.loads(Path(tracker.client.download_artifacts(tracker.run_id, "final_model.json")).read_text())
    final = (tmp_path / "run" / "final_model").resolve()
    assert pointer["final_model_path"] == str(final) == run.data.params["final_model_path"]
    assert pointer["global_step"] == 2
    assert pointer["files"]["model.safetensors"] == (final / "model.safetensors").stat().st_size
    assert not [a.path for a in tracker.client.list_artifacts(tracker.run_id) if a.path == "final_model"]  # no copy
    tracker.close()
