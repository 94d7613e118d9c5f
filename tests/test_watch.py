"""Watching a run: the run's own metric log (metrics.jsonl, resume truncation), the tensorboard, wandb
(offline) and prometheus trackers read back from what they wrote or served during tiny runs, the
Prometheus name mapping, and the progress bar."""

from __future__ import annotations

import io
import json
import math
import socket
import sys
import urllib.request
from pathlib import Path

import pytest

import rlplug
from rlplug.config.schema import ConfigError
from rlplug.plugins.tracking.prometheus_tracker import PrometheusTracker, prometheus_name
from rlplug.plugins.tracking.tensorboard_tracker import table_markdown
from rlplug.plugins.tracking.wandb_tracker import table_key
from rlplug.run.metrics import METRICS_FILE, MetricsLog, ProgressBar, read_metrics_jsonl, tracker_names

# ============================================================================ helpers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(url: str) -> dict[str, float]:
    """The samples of a Prometheus text exposition, parsed with prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def _wandb_records(path: Path) -> list:
    """The protobuf records of a W&B offline run file (``run-<id>.wandb``): a 7-byte header (``:W&B``, the
    magic 0xBEE1, a version byte), then LevelDB-log records in 32 KiB blocks, each with a 7-byte header
    (CRC32, little-endian length, type 1 full / 2 first / 3 middle / 4 last); a block tail shorter than a
    header is padding."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending + chunk if kind == 4 else chunk)
            out.append(record)
            pending = b""
        elif kind in (2, 3):
            pending += chunk
    return out


def _wandb_history(run_dir: Path) -> dict[int, dict[str, float]]:
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    history: dict[int, dict[str, float]] = {}
    for record in _wandb_records(files[0]):
        if record.WhichOneof("record_type") == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
            history[int(items["_step"])] = items
    return history


def _tb_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


class _Recorder:
    """A plugin recording every step's metrics (what the trackers got) and, when given a URL, scraping the
    Prometheus endpoint at the end of each step (after the trackers logged it)."""

    def __init__(self, url: str | None = None, fail_at: int | None = None) -> None:
        self.url, self.fail_at = url, fail_at
        self.steps: dict[int, dict[str, float]] = {}
        self.scrapes: dict[int, dict[str, float]] = {}

    @rlplug.hookimpl
    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        self.steps[step] = dict(metrics)
        if self.url:
            self.scrapes[step] = _scrape(self.url)
        if step == self.fail_at:
            raise RuntimeError(f"simulated crash after step {step}")


def _train(cfg, recorder: _Recorder) -> str:
    from rlplug.contracts.registry import Registry
    from rlplug.run.trainer import Trainer

    registry = Registry()
    assert registry.add_plugin(recorder, name="recorder"), registry.broken
    trainer = Trainer(cfg, registry=registry)
    try:
        return trainer.fit()
    finally:
        trainer.close()


def _numbers_equal(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-6, abs=1e-7)


# ============================================================================ names


@pytest.mark.parametrize(
    "name, expected",
    [
        ("actor/pg_loss", "rlplug_actor_pg_loss"),
        ("val-core/openai/gsm8k/acc/mean@8", "rlplug_val_core_openai_gsm8k_acc_mean_at_8"),
        ("timing_s/gen", "rlplug_timing_s_gen"),
        ("perf/gen_tokens_per_s", "rlplug_perf_gen_tokens_per_s"),
        ("training/phase", "rlplug_training_phase"),
        ("ns:x y.z", "rlplug_ns:x_y_z"),  # ':' is allowed by Prometheus, ' ' and '.' are not
        ("1st/é", "rlplug_1st__"),  # a leading digit is fine after the prefix; non-ASCII becomes '_'
        ("", "rlplug__"),
    ],
)
def test_prometheus_name(name, expected):
    import re

    out = prometheus_name(name)
    assert out == expected
    assert re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", out)  # Prometheus' metric name rule


def test_table_names_are_mapped_like_metric_names():
    assert table_key("val_generations/step_000010.json") == "tables/val_generations"
    assert table_key("train_generations/step_000002.json") == "tables/train_generations"
    assert table_key("my table@1.json") == "tables/my table_at_1"
    assert table_markdown([{"a": 1, "b": "x|y\nz"}, {"c": 0.5}]) == (
        "| a | b | c |\n|---|---|---|\n| 1 | x\\|y<br>z |  |\n|  |  | 0.5 |"
    )
    assert table_markdown([]) == "(no rows)"


# ============================================================================ config


def test_tracker_names_add_prometheus_with_a_port_and_check_it():
    from omegaconf import OmegaConf

    def trainer(**kw):
        return OmegaConf.create({"logger": kw.pop("logger", ["console"]), "prometheus": kw})

    assert tracker_names(trainer(port=None)) == ["console"]
    assert tracker_names(trainer(port=9400)) == ["console", "prometheus"]
    assert tracker_names(trainer(logger=["prometheus"], port=9400)) == ["prometheus"]  # listed once
    assert tracker_names(trainer(logger="console", port=None)) == ["console"]  # verl's string form
    with pytest.raises(ConfigError, match=r"trainer.logger lists 'prometheus' but trainer.prometheus.port is null"):
        tracker_names(trainer(logger=["console", "prometheus"], port=None))
    for bad in (70000, -1, "9400", True):
        with pytest.raises(ConfigError, match=r"trainer.prometheus.port=.*expected a TCP port, an integer in 0..65535"):
            tracker_names(trainer(port=bad))


def test_validate_config_resolves_the_prometheus_tracker(monkeypatch):
    from rlplug.config.compose import compose
    from rlplug.run.validate import validate_config

    validate_config(compose(["debug=tiny", "trainer.prometheus.port=9400"]))  # registered: passes
    monkeypatch.setenv("RLPLUG_DISABLE_PLUGINS", "prometheus")
    from rlplug.contracts.registry import Registry

    with pytest.raises(Exception, match=r"trainer.prometheus.port"):
        validate_config(compose(["debug=tiny", "trainer.prometheus.port=9400"]), Registry())


# ============================================================================ metrics.jsonl units


def test_metrics_log_lines_nonfinite_values_and_cut_short_last_line(tmp_path):
    log = MetricsLog(tmp_path, 0)
    log.write({"actor/pg_loss": 0.5, "x/nan": math.nan, "x/inf": -math.inf, "text": "skipped", "flag": True}, 1)
    log.write({"actor/pg_loss": 0.25}, 2)
    log.close()
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[0])["x/nan"] == "NaN"  # strict JSON on disk
    records = read_metrics_jsonl(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    first = records[0]
    assert first["actor/pg_loss"] == 0.5 and math.isnan(first["x/nan"]) and first["x/inf"] == -math.inf
    assert first["flag"] == 1.0 and "text" not in first and isinstance(first["wall_time"], float)
    # a kill -9 in the middle of a write leaves a cut-short last line: the reader skips it
    with open(tmp_path / METRICS_FILE, "a") as f:
        f.write('{"step": 3, "actor/pg')
    assert [r["step"] for r in read_metrics_jsonl(tmp_path / METRICS_FILE)] == [1, 2]
    # resuming after step 1 drops step 2 and the cut-short line; the rest of the file is unchanged bytes
    MetricsLog(tmp_path, 1).close()
    assert (tmp_path / METRICS_FILE).read_text() == lines[0] + "\n"
    # a fresh start drops everything
    MetricsLog(tmp_path, 0).close()
    assert read_metrics_jsonl(tmp_path) == []


def test_read_metrics_jsonl_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"No metrics log at .*metrics.jsonl: every rlplug training run"):
        read_metrics_jsonl(tmp_path)
    (tmp_path / METRICS_FILE).write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2 is not a metrics record"):
        read_metrics_jsonl(tmp_path)


# ============================================================================ one watched tiny run


@pytest.fixture(scope="module")
def watched_run(tmp_path_factory):
    """3 tiny GRPO steps with the tensorboard and wandb trackers and the Prometheus endpoint, validating at
    step 2 and 3 (the last step); the recorder keeps what each step logged and what /metrics served then."""
    from _helpers import LENGTH_SHAPING, TINY_CPU_RUN, run_config

    root = tmp_path_factory.mktemp("watched")
    port = _free_port()
    cfg = run_config(
        TINY_CPU_RUN,
        root / "run",
        "algorithm=grpo",
        "rollout.n=2",
        *LENGTH_SHAPING,
        "trainer.logger=[tensorboard,wandb]",
        f"trainer.prometheus.port={port}",
        "trainer.total_training_steps=3",
        "trainer.test_freq=2",
        "trainer.save_freq=0",
        "data.val_max_samples=2",
    )
    recorder = _Recorder(url=f"http://127.0.0.1:{port}/metrics")
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_SILENT", "true")
    mp.delenv("WANDB_MODE", raising=False)
    try:
        assert _train(cfg, recorder) == "finished"
    finally:
        mp.undo()
    return root / "run", recorder, port


def test_metrics_jsonl_has_one_line_per_step_with_what_the_trackers_got(watched_run):
    run_dir, recorder, _ = watched_run
    records = read_metrics_jsonl(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        got = recorder.steps[record["step"]]
        assert set(record) - {"step", "wall_time"} == set(got)
        assert all(_numbers_equal(record[k], v) for k, v in got.items())
    assert "val-core/basic_arithmetic/acc/mean@1" in records[1] and "actor/pg_loss" in records[0]
    assert records[0]["wall_time"] <= records[1]["wall_time"] <= records[2]["wall_time"]


def test_tensorboard_events_hold_the_step_metrics(watched_run):
    run_dir, recorder, _ = watched_run
    scalars = _tb_scalars(run_dir / "tensorboard")
    for step, metrics in recorder.steps.items():
        assert scalars["actor/pg_loss"][step] == pytest.approx(metrics["actor/pg_loss"], rel=1e-6)
        assert scalars["critic/score/mean"][step] == pytest.approx(metrics["critic/score/mean"], rel=1e-6)
    # '@' is mapped as in every tracker (rlplug.run.metrics.tracker_name); float32 in the event file
    val = recorder.steps[2]["val-core/basic_arithmetic/acc/mean@1"]
    assert scalars["val-core/basic_arithmetic/acc/mean_at_1"] == pytest.approx(
        {2: val, 3: recorder.steps[3]["val-core/basic_arithmetic/acc/mean@1"]}
    )
    assert sorted(scalars["actor/pg_loss"]) == [1, 2, 3]


def test_wandb_offline_run_holds_the_step_metrics(watched_run):
    run_dir, recorder, _ = watched_run
    history = _wandb_history(run_dir)
    assert sorted(history) == [1, 2, 3]
    for step, metrics in recorder.steps.items():
        for key in ("actor/pg_loss", "critic/score/mean", "timing_s/step"):
            assert history[step][key] == pytest.approx(metrics[key], rel=1e-9)
    assert history[2]["val-core/basic_arithmetic/acc/mean_at_1"] == pytest.approx(
        recorder.steps[2]["val-core/basic_arithmetic/acc/mean@1"]
    )
    assert json.loads((run_dir / "wandb_run.json").read_text())["mode"] == "offline"


def test_prometheus_served_each_steps_metrics_during_the_run(watched_run):
    _, recorder, port = watched_run
    assert sorted(recorder.scrapes) == [1, 2, 3]
    for step, served in recorder.scrapes.items():
        metrics = recorder.steps[step]
        assert served["rlplug_step"] == step
        assert served["rlplug_actor_pg_loss"] == pytest.approx(metrics["actor/pg_loss"], rel=1e-12)
        assert served["rlplug_perf_gen_tokens_per_s"] == pytest.approx(metrics["perf/gen_tokens_per_s"], rel=1e-12)
        assert served["rlplug_timing_s_step"] == pytest.approx(metrics["timing_s/step"], rel=1e-12)
        assert served["rlplug_critic_score_mean"] == pytest.approx(metrics["critic/score/mean"], rel=1e-12)
        for key in ("actor/ppo_kl", "actor/grad_norm", "critic/rewards/mean", "training/global_step"):
            assert served[prometheus_name(key)] == pytest.approx(metrics[key], rel=1e-12), key
    # a validation value stays served until the next validation (step 3 validates again: the last step)
    assert recorder.scrapes[2]["rlplug_val_core_basic_arithmetic_acc_mean_at_1"] == pytest.approx(
        recorder.steps[2]["val-core/basic_arithmetic/acc/mean@1"]
    )
    assert "rlplug_val_core_basic_arithmetic_acc_mean_at_1" not in recorder.scrapes[1]
    with pytest.raises(OSError):  # the endpoint is gone with the run (port freed)
        _scrape(f"http://127.0.0.1:{port}/metrics")


# ============================================================================ resume


def test_resume_truncates_metrics_jsonl_and_purges_tensorboard(tmp_path):
    """4 steps, a checkpoint every 2: the first attempt crashes after logging step 3 (and leaves a cut-short
    line, as a kill -9 mid-write would); the resumed attempt continues from step 2's checkpoint. Both logs
    then hold steps 1..4 once, step 3 with the resumed attempt's values."""
    from _helpers import LENGTH_SHAPING, TINY_CPU_RUN, run_config

    cfg = run_config(
        TINY_CPU_RUN,
        tmp_path / "run",
        "algorithm=grpo",
        "rollout.n=2",
        *LENGTH_SHAPING,
        "trainer.logger=[tensorboard]",
        "trainer.total_training_steps=4",
        "trainer.save_freq=2",
    )
    first = _Recorder(fail_at=3)
    with pytest.raises(RuntimeError, match="simulated crash after step 3"):
        _train(cfg, first)
    path = tmp_path / "run" / METRICS_FILE
    assert [r["step"] for r in read_metrics_jsonl(path)] == [1, 2, 3]
    with open(path, "a") as f:
        f.write('{"step":4,"wall_ti')  # cut short
    second = _Recorder()
    assert _train(cfg, second) == "finished"
    assert sorted(second.steps) == [3, 4]  # resumed after step 2
    records = read_metrics_jsonl(path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert path.read_text().endswith("\n") and len(path.read_text().splitlines()) == 4
    by_step = {r["step"]: r for r in records}
    for step in (1, 2):
        assert by_step[step]["actor/pg_loss"] == first.steps[step]["actor/pg_loss"]
    for step in (3, 4):
        assert by_step[step]["actor/pg_loss"] == second.steps[step]["actor/pg_loss"]
        assert by_step[step]["timing_s/step"] == second.steps[step]["timing_s/step"]
    assert by_step[3]["timing_s/step"] != first.steps[3]["timing_s/step"]  # not the crashed attempt's line
    tb = _tb_scalars(tmp_path / "run" / "tensorboard")["timing_s/step"]
    assert sorted(tb) == [1, 2, 3, 4]  # the crashed attempt's step 3 is purged
    assert tb[3] == pytest.approx(second.steps[3]["timing_s/step"], rel=1e-6)
    assert tb[1] == pytest.approx(first.steps[1]["timing_s/step"], rel=1e-6)


# ============================================================================ trackers alone


def test_packaged_watch_trackers_pass_the_kit(tmp_path, monkeypatch):
    from rlplug.config.compose import compose
    from rlplug.contracts.registry import get_registry
    from rlplug.testing import check_tracker

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = compose(["debug=tiny", f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.prometheus.port=0"])
    artifact = tmp_path / "notes.txt"
    artifact.write_text("hello")
    for name in ("tensorboard", "wandb", "prometheus"):
        check_tracker(get_registry().get("tracker", name)(cfg), artifact=artifact)


def test_prometheus_port_taken_and_missing_packages_say_what_to_do(tmp_path, monkeypatch):
    from rlplug.config.compose import compose

    cfg = compose(["debug=tiny", f"trainer.default_local_dir={tmp_path}", "trainer.prometheus.port=0"])
    first = PrometheusTracker(cfg)
    try:
        taken = compose(
            ["debug=tiny", f"trainer.default_local_dir={tmp_path}", f"trainer.prometheus.port={first.port}"]
        )
        with pytest.raises(OSError, match=rf"trainer.prometheus.port={first.port}: cannot serve /metrics on 127.0.0.1"):
            PrometheusTracker(taken)
        first.log_metrics({"actor/grad_norm": 2.5, "x/nan": math.nan, "training/phase": 1.0}, step=7)
        first.log_metrics({"actor/grad_norm": 1.5, "x/inf": math.inf}, step=8)
        served = _scrape(first.url)
        assert served["rlplug_actor_grad_norm"] == 1.5 and served["rlplug_step"] == 8  # the latest values
        assert served["rlplug_training_phase"] == 1.0  # kept from step 7 until logged again
        assert math.isnan(served["rlplug_x_nan"]) and served["rlplug_x_inf"] == math.inf
        assert served["rlplug_run_info"] == 1.0
    finally:
        first.close()
    from rlplug.plugins.tracking import tensorboard_tracker, wandb_tracker

    for module in ("wandb", "prometheus_client", "torch.utils.tensorboard"):
        monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    with pytest.raises(ImportError, match=r"needs the Python package 'wandb'.*pip install wandb"):
        wandb_tracker.WandbTracker(cfg)
    with pytest.raises(
        ImportError, match=r"needs the Python package 'prometheus_client'.*pip install prometheus_client"
    ):
        PrometheusTracker(cfg)
    with pytest.raises(ImportError, match=r"needs the Python package 'tensorboard'.*pip install tensorboard"):
        tensorboard_tracker.TensorBoardTracker(cfg)


# ============================================================================ progress bar


def test_progress_bar_off_without_a_terminal_and_on_with_one(monkeypatch):
    bar = ProgressBar(total=4, initial=1)  # pytest captures stdout: not a terminal
    assert bar.bar.disable
    bar.update(2, {"critic/score/mean": 0.5})
    bar.close()

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    term = Tty()  # stdout and stderr on one terminal, as in a shell
    monkeypatch.setattr(sys, "stdout", term)
    monkeypatch.setattr(sys, "stderr", term)
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    bar = ProgressBar(total=4, initial=1)
    assert not bar.bar.disable and sys.stdout is not term  # prints go above the bar
    print("step 2 | score 0.5000")
    bar.update(2, {"critic/score/mean": 0.5, "val-core/a/acc/mean@4": 0.25, "val-core/b/acc/mean@4": 0.75})
    bar.update(3, {"critic/score/mean": 0.125, "actor/pg_loss": -0.01})
    assert bar.bar.n == 3 and bar.last_validation == {"val_acc": 0.5}  # the mean over data sources, kept
    assert "3/4" in str(bar.bar) and str(bar.bar).endswith("score=0.125, val_acc=0.5, pg_loss=-0.01]")
    bar.close()
    assert sys.stdout is term
    text = term.getvalue()
    # the bar was drawn, then cleared (its line blanked, the cursor back at the start) before the printed
    # line, which therefore starts its own terminal line instead of continuing the bar's
    assert text.startswith("\rtrain:") and "\rstep 2 | score 0.5000\n" in text
    assert text.index("step 2 |") > text.index("1/4")


def test_grafana_dashboard_queries_the_gauges_the_endpoint_serves():
    """Every gauge the dashboard names is prometheus_name() of a verl metric name the trainer logs (or one
    of the endpoint's own gauges), so a renamed metric or a changed mapping breaks this test, not the panel."""
    import re

    dashboard = json.loads((Path(__file__).parents[1] / "contrib" / "grafana" / "rlplug.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    names = {n for e in exprs for n in re.findall(r"\brlplug_[A-Za-z0-9_:]+", e) if not n.endswith("_")}
    verl = [
        "critic/score/mean", "critic/rewards/mean", "actor/ppo_kl", "actor/kl_loss", "actor/reward_kl_penalty",
        "actor/grad_norm", "critic/grad_norm", "perf/gen_tokens_per_s", "timing_s/step", "training/epoch",
        "training/phase",
    ]  # fmt: skip
    assert names == {prometheus_name(n) for n in verl} | {"rlplug_step"}
    assert {'{__name__=~"rlplug_val_core_.*_mean_at_.*", instance=~"$instance"}'} <= set(exprs)
    assert prometheus_name("val-core/gsm8k/acc/mean@8").startswith("rlplug_val_core_") and "_mean_at_" in (
        prometheus_name("val-core/gsm8k/acc/mean@8")
    )
