"""What each tracker shows after a kill and a resume (docs/trackers.md, "After a resume").

The scenario, per tracker: attempt 1 logs steps 1-4 (``actor/pg_loss`` = 0.1 ... 0.4) after saving the
checkpoint of step 2, then dies; attempt 2 resumes from that checkpoint and logs steps 3-4 again with
other values (3.0, 4.0). An uninterrupted run would show 0.1, 0.2, 3.0, 4.0. The resumed attempt also
logs a value at step 2 itself first (as a validation at the resumed step would), which must not wipe
attempt 1's step 2.

* ``metrics.jsonl`` is truncated at the resume: it holds exactly the clean series;
* TensorBoard purges with ``purge_step = 3``: its event reader returns the clean series only;
* MLflow and W&B cannot delete points: the raw history holds both attempts' values at steps 3-4, each
  point tagged with ``trainer/attempt``, and ``clean_history`` returns the clean series;
* console prints both attempts' lines (the last line per step is the clean value); Prometheus serves the
  latest values.
"""

from __future__ import annotations

import io
import json
import time
import urllib.request
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlplug.run.metrics import MetricsLog, read_metrics_jsonl

FIRST = {1: 0.1, 2: 0.2, 3: 0.3, 4: 0.4}
SECOND = {3: 3.0, 4: 4.0}
CLEAN = [(1, 0.1), (2, 0.2), (3, 3.0), (4, 4.0)]
KEY = "actor/pg_loss"
VAL = {"val-core/x/acc/mean@1": 0.5}  # what attempt 2 logs at the resumed step 2 before step 3


def _cfg(run_dir: Path, **trainer):
    return OmegaConf.create(
        {
            "trainer": {
                "default_local_dir": str(run_dir),
                "project_name": "history",
                "experiment_name": "resume",
                "resume_mode": "auto",
                "resume_from_path": None,
                **trainer,
            }
        }
    )


def _checkpoint(run_dir: Path, step: int) -> None:
    """A complete checkpoint of ``step`` as far as the trackers look (COMPLETE, trainer_state, pointer)."""
    d = run_dir / f"global_step_{step}"
    d.mkdir(parents=True)
    (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (d / "COMPLETE").write_text("")
    (run_dir / "latest_checkpointed_iteration.txt").write_text(str(step))


def _two_attempts(make, run_dir: Path, close_first: bool = False):
    """Attempt 1 (fresh): steps 1-2, checkpoint 2, steps 3-4, dies. Attempt 2 (resumed): VAL at 2, steps 3-4."""
    first = make()
    for step in (1, 2):
        first.log_metrics({KEY: FIRST[step]}, step)
    _checkpoint(run_dir, 2)
    for step in (3, 4):
        first.log_metrics({KEY: FIRST[step]}, step)
    if close_first:
        first.close("KILLED")
    # W&B names an offline attempt's folder by the second it started (offline-run-<YYYYmmdd_HHMMSS>-<id>):
    # a real attempt lasts longer than a second, these two would not, so start the second in a later one
    time.sleep(1.05 - time.time() % 1)
    second = make()
    second.log_metrics(VAL, 2)
    for step, value in SECOND.items():
        second.log_metrics({KEY: value}, step)
    second.close("FINISHED")
    return first, second


def test_metrics_jsonl_is_truncated_at_the_resume(tmp_path):
    first = MetricsLog(tmp_path, 0)
    for step, value in FIRST.items():
        first.write({KEY: value}, step)
    # killed: no close; the resumed run opens the log at its checkpoint's step
    second = MetricsLog(tmp_path, 2)
    second.write(VAL, 2)
    for step, value in SECOND.items():
        second.write({KEY: value}, step)
    second.close()
    records = read_metrics_jsonl(tmp_path)
    assert [(r["step"], r[KEY]) for r in records if KEY in r] == CLEAN
    assert [r["step"] for r in records] == [1, 2, 2, 3, 4]  # step 2: attempt 1's line, then the resumed VAL


def test_console_prints_both_attempts_and_the_last_line_per_step_is_clean(tmp_path):
    from rich.console import Console

    from rlplug.plugins.tracking.trackers import ConsoleTracker

    buf = io.StringIO()
    console = Console(file=buf, width=200, highlight=False)
    _two_attempts(lambda: ConsoleTracker(_cfg(tmp_path), console=console), tmp_path)
    lines = [ln for ln in buf.getvalue().splitlines() if ln.startswith("step ") and "pg_loss" in ln]
    assert lines == [
        "step 1 | pg_loss 0.1000",
        "step 2 | pg_loss 0.2000",
        "step 3 | pg_loss 0.3000",
        "step 4 | pg_loss 0.4000",
        "step 3 | pg_loss 3",
        "step 4 | pg_loss 4",
    ]
    last = {int(ln.split()[1]): float(ln.rsplit(" ", 1)[1]) for ln in lines}
    assert sorted(last.items()) == CLEAN


def test_tensorboard_purges_the_lost_attempts_steps(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rlplug.plugins.tracking.tensorboard_tracker import TensorBoardTracker

    first, second = _two_attempts(lambda: TensorBoardTracker(_cfg(tmp_path)), tmp_path)
    assert (first.purge_step, second.purge_step, second.resume_step) == (1, 3, 2)
    first.writer.close()  # the killed attempt's file handle (a real kill closes it with the process)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    series = [(e.step, round(e.value, 6)) for e in acc.Scalars(KEY)]
    # before the purge step came from the checkpoint, attempt 2 purged at its first logged step (2): the
    # checkpointed step 2 of attempt 1 vanished
    assert series == CLEAN
    assert [(e.step, e.value) for e in acc.Scalars("val-core/x/acc/mean_at_1")] == [(2, 0.5)]


def test_mlflow_keeps_both_attempts_and_clean_history_reads_the_last(tmp_path):
    pytest.importorskip("mlflow")
    from rlplug.plugins.tracking.trackers import (
        ATTEMPT_METRIC,
        MlflowTracker,
        clean_history,
        clean_history_of_run_dir,
    )

    first, second = _two_attempts(lambda: MlflowTracker(_cfg(tmp_path)), tmp_path)
    assert second.run_id == first.run_id and second.resumed
    assert (first.attempt, second.attempt) == (1, 2)
    client, run_id = second.client, second.run_id
    raw = sorted((m.step, m.value) for m in client.get_metric_history(run_id, KEY))
    assert raw == [(1, 0.1), (2, 0.2), (3, 0.3), (3, 3.0), (4, 0.4), (4, 4.0)]  # MLflow deletes nothing
    attempts = sorted((m.step, m.value) for m in client.get_metric_history(run_id, ATTEMPT_METRIC))
    assert attempts == [(1, 1.0), (2, 1.0), (2, 2.0), (3, 1.0), (3, 2.0), (4, 1.0), (4, 2.0)]
    tags = client.get_run(run_id).data.tags
    assert tags["rlplug.attempt"] == "2"
    assert (tags["rlplug.attempt.1.resume_step"], tags["rlplug.attempt.2.resume_step"]) == ("0", "2")
    assert clean_history(client, run_id, KEY) == CLEAN
    assert second.clean_history(KEY) == CLEAN
    assert clean_history_of_run_dir(tmp_path, KEY) == CLEAN
    assert clean_history_of_run_dir(tmp_path, "val-core/x/acc/mean@1") == [(2, 0.5)]


def test_mlflow_clean_history_without_attempt_points_takes_the_latest(tmp_path):
    # a run logged before attempts were numbered: the later timestamp wins
    pytest.importorskip("mlflow")
    from mlflow.entities import Metric

    from rlplug.plugins.tracking.trackers import MlflowTracker, clean_history

    tracker = MlflowTracker(_cfg(tmp_path))
    points = [Metric(KEY, 0.3, 1000, 3), Metric(KEY, 3.0, 2000, 3), Metric(KEY, 0.1, 1000, 1)]
    tracker.client.log_batch(tracker.run_id, metrics=points, synchronous=True)
    assert clean_history(tracker.client, tracker.run_id, KEY) == [(1, 0.1), (3, 3.0)]
    tracker.close()


def test_wandb_offline_keeps_both_attempts_and_clean_history_reads_the_last(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    from rlplug.plugins.tracking.wandb_tracker import WandbTracker, clean_history, history_records

    first, second = _two_attempts(lambda: WandbTracker(_cfg(tmp_path)), tmp_path, close_first=True)
    assert second.run_id == first.run_id and (first.attempt, second.attempt) == (1, 2)
    assert len(list((tmp_path / "wandb").glob(f"offline-run-*-{first.run_id}"))) == 2  # one folder per attempt
    rows = history_records(tmp_path)
    raw = [(r["_step"], r[KEY], r["trainer/attempt"]) for r in rows if KEY in r]
    assert raw == [(1, 0.1, 1), (2, 0.2, 1), (3, 0.3, 1), (4, 0.4, 1), (3, 3.0, 2), (4, 4.0, 2)]
    clean = clean_history(tmp_path)
    assert clean[KEY] == CLEAN
    assert clean["trainer/attempt"] == [(1, 1.0), (2, 2.0), (3, 2.0), (4, 2.0)]
    assert clean["val-core/x/acc/mean_at_1"] == [(2, 0.5)]
    assert json.loads((tmp_path / "wandb_run.json").read_text())["attempt"] == 2


def test_prometheus_serves_the_resumed_attempts_latest_values(tmp_path):
    pytest.importorskip("prometheus_client")
    from rlplug.plugins.tracking.prometheus_tracker import PrometheusTracker

    trackers = []

    def make():
        trackers.append(PrometheusTracker(_cfg(tmp_path, prometheus={"port": 0, "host": "127.0.0.1"})))
        return trackers[-1]

    first = make()
    for step, value in FIRST.items():
        first.log_metrics({KEY: value}, step)
    first.close("KILLED")
    second = make()
    for step, value in SECOND.items():
        second.log_metrics({KEY: value}, step)
    with urllib.request.urlopen(second.url, timeout=10) as resp:
        text = resp.read().decode()
    second.close()
    values = dict(ln.split(" ", 1) for ln in text.splitlines() if ln and not ln.startswith("#"))
    assert float(values["rlplug_actor_pg_loss"]) == 4.0 and float(values["rlplug_step"]) == 4.0


def test_trackers_use_the_step_the_trainer_resumed_from_after_a_fallback(tmp_path):
    # review finding 1: the pointer names step 4, but step 4 failed verification and the trainer fell back to
    # step 2. Before the fix the trackers re-read the pointer: TensorBoard purged from 5 (attempt 1's steps
    # 3-4 stayed beside attempt 2's) and the MLflow tag said resume_step 4.
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rlplug.plugins.tracking.tensorboard_tracker import TensorBoardTracker
    from rlplug.plugins.tracking.trackers import MlflowTracker, clean_history
    from rlplug.run.metrics import Trackers

    class Registry:
        def get(self, kind, name):
            return {"tensorboard": TensorBoardTracker, "mlflow": MlflowTracker}[name]

    cfg = _cfg(tmp_path, logger=["tensorboard", "mlflow"])
    first = Trackers()
    first.open(cfg, Registry(), model_path="m", is_main=True, step=0)
    for step, value in FIRST.items():
        first.log_metrics({KEY: value}, step)
        if step in (2, 4):
            _checkpoint(tmp_path, step)  # the pointer ends at 4
    first.close("interrupted")
    second = Trackers()
    second.open(cfg, Registry(), model_path="m", is_main=True, step=2)  # the trainer resumed from step 2
    tb, ml = second.items
    assert (tb.resume_step, tb.purge_step) == (2, None)
    for step, value in SECOND.items():
        second.log_metrics({KEY: value}, step)
    assert tb.purge_step == 3
    tags = ml.client.get_run(ml.run_id).data.tags
    assert (tags["rlplug.attempt"], tags["rlplug.attempt.2.resume_step"]) == ("2", "2")
    assert clean_history(ml.client, ml.run_id, KEY) == CLEAN
    second.close("finished")
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars(KEY)] == CLEAN


def test_build_tracker_passes_resume_step_only_to_factories_that_take_it():
    from rlplug.run.metrics import build_tracker

    def plain(config):
        return ("plain", config)

    def keyword(config, resume_step=None):
        return ("keyword", config, resume_step)

    assert build_tracker(plain, "cfg", resume_step=7) == ("plain", "cfg")
    assert build_tracker(keyword, "cfg", resume_step=7) == ("keyword", "cfg", 7)
    assert build_tracker(lambda config, **kw: kw, "cfg", resume_step=3) == {"resume_step": 3}
