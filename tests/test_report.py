"""``rlplug report RUN_DIR``: the run's curves, timing and validation samples as one HTML page (issue 19, item 1).

A tiny real run (``debug=tiny``, 3 steps, validation before training and after every step) makes the run
directory; the report built from it is opened in a real headless Chromium (``selenium`` with Debian's
``chromium`` and ``chromium-driver``; skipped when they are not installed): the page loads, every image
decodes (``naturalWidth > 0``), the sections are there and the console logs no error.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from _helpers import TINY_CPU_RUN, fit, run_config

from rlplug.run.report import (
    FIGURES,
    REPORT_FILE,
    VALIDATION_SAMPLES_FILE,
    log_validation_samples,
    metric_series,
    read_validation_samples,
    write_report,
)

# ============================================================================ parsing, with hand numbers


def test_metric_series_from_records():
    records = [
        {"step": 0, "wall_time": 100.0, "val-core/x/acc/mean@1": 0.25},
        {"step": 1, "wall_time": 103.5, "critic/score/mean": 0.5, "timing_s/gen": 2.0, "note": "text"},
        {"step": 2, "wall_time": 110.0, "critic/score/mean": math.nan, "timing_s/gen": 1.5, "flag": True},
        {"step": 2, "wall_time": 112.0, "critic/score/mean": -1.0, "timing_s/gen": 1.0},  # a step again: last wins
    ]
    s = metric_series(records)
    assert sorted(s) == ["critic/score/mean", "timing_s/gen", "val-core/x/acc/mean@1"]  # no text, no bools
    assert s["critic/score/mean"].steps == [1, 2]
    assert s["critic/score/mean"].wall == [3.5, 12.0]  # seconds since the first record (100.0)
    assert s["critic/score/mean"].values == [0.5, -1.0]
    assert s["val-core/x/acc/mean@1"].steps == [0] and s["val-core/x/acc/mean@1"].wall == [0.0]
    assert s["timing_s/gen"].values == [2.0, 1.0]
    gap = metric_series([{"step": 1, "wall_time": 5.0, "a": math.inf}, {"step": 2, "wall_time": 6.0, "a": 1.0}])
    assert math.isnan(gap["a"].values[0]) and gap["a"].values[1] == 1.0  # non-finite: a gap in the plot


class _Trackers:
    def __init__(self, main: bool) -> None:
        self.metrics_log = object() if main else None
        self.tables: list[tuple[str, int]] = []

    def log_table(self, name, rows, step):
        self.tables.append((name, step))


def test_validation_samples_are_stored_and_read_back_like_the_metrics_log(tmp_path):
    rows = [{"data_source": "d", "prompt": "1+1?", "response": "#### 2", "ground_truth": "2", "score": 1.0}]
    t = _Trackers(main=True)
    for step in (0, 2, 4):
        log_validation_samples(t, tmp_path, rows, step)
    assert t.tables == [("val_generations/step_000000.json", 0), ("val_generations/step_000002.json", 2),
                        ("val_generations/step_000004.json", 4)]  # fmt: skip
    # a resume from step 2 repeats the validation of step 4 (with another response): the last line wins
    log_validation_samples(t, tmp_path, [{**rows[0], "response": "#### 3", "score": math.nan}], 4)
    with (tmp_path / VALIDATION_SAMPLES_FILE).open("a") as f:
        f.write('{"step": 6, "samp')  # a write cut short by a kill
    got = read_validation_samples(tmp_path)
    assert [v["step"] for v in got] == [0, 2, 4]
    assert got[2]["samples"][0]["response"] == "#### 3" and got[2]["samples"][0]["score"] == "NaN"
    # a validation after the last step of metrics.jsonl (its attempt died before logging it) is dropped
    assert [v["step"] for v in read_validation_samples(tmp_path, last_step=2)] == [0, 2]
    other = tmp_path / "other"
    other.mkdir()
    log_validation_samples(_Trackers(main=False), other, rows, 0)  # not the main process: trackers only
    assert read_validation_samples(other) == []


def test_a_corrupt_samples_line_is_named(tmp_path):
    (tmp_path / VALIDATION_SAMPLES_FILE).write_text(
        '{"step": 0, "samples": []}\nnot json\n{"step": 1, "samples": []}\n'
    )
    with pytest.raises(ValueError, match=f"{VALIDATION_SAMPLES_FILE}:2 is not a validation-samples record"):
        read_validation_samples(tmp_path)


def test_report_without_metrics_says_what_to_pass(tmp_path, capsys):
    from rlplug.cli import main

    assert main(["report", str(tmp_path)]) == 2
    assert "No metrics log at" in capsys.readouterr().err


# ============================================================================ a tiny real run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("report-run")
    overrides = [
        *TINY_CPU_RUN,
        "trainer.total_training_steps=3",
        "trainer.test_freq=1",
        "trainer.val_before_train=true",
        "trainer.save_freq=0",
        "data.val_max_samples=3",
    ]
    cfg = run_config(overrides, root / "run")
    assert fit(cfg) == "finished"
    return root / "run"


def test_the_run_stores_its_validation_samples(run_dir):
    validations = read_validation_samples(run_dir)
    assert [v["step"] for v in validations] == [0, 1, 2, 3]  # before training, then after every step
    for v in validations:
        assert len(v["samples"]) == 3  # data.val_max_samples=3 prompts, 1 response each (val_samples_to_log: 8)
        assert set(v["samples"][0]) == {"data_source", "prompt", "response", "ground_truth", "score"}


@pytest.fixture(scope="module")
def report(run_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("report-out") / "my_report.html"
    from rlplug.cli import main

    assert main(["report", str(run_dir), "--out", str(out)]) == 0
    return out


def test_the_report_is_self_contained_with_every_figure(report, run_dir):
    page = report.read_text()
    assert "http://" not in page and "https://" not in page and "<script" not in page  # nothing from the network
    for fig in FIGURES:
        png = report.with_name(f"my_report_{fig.key}.png")
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", fig.key
        assert f'src="{png.name}"' in page  # relative: the folder can be moved
    for section in ("summary", "figures", "samples", "metrics"):
        assert f'id="{section}"' in page
    for step in (0, 1, 2, 3):
        assert f'id="samples-step-{step}"' in page
    first = read_validation_samples(run_dir)[0]["samples"][0]
    import html

    assert html.escape(first["prompt"], quote=True) in page  # the sample table holds the prompt text
    # the default output: RUN_DIR/report.html
    assert write_report(run_dir) == run_dir / REPORT_FILE and (run_dir / "report_timing.png").is_file()


def _chrome():
    """A headless Chromium driven by selenium, or skip: needs selenium, chromium and chromedriver."""
    webdriver = pytest.importorskip("selenium.webdriver")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        pytest.skip("no chromium/chromedriver installed (Debian: apt install chromium chromium-driver)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    try:
        return webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    except Exception as exc:  # a broken browser install: say so rather than fail the suite
        pytest.skip(f"chromium did not start: {type(exc).__name__}: {str(exc)[:200]}")


def test_the_report_renders_in_a_real_browser(report):
    from selenium.webdriver.common.by import By

    driver = _chrome()
    try:
        driver.get(report.as_uri())
        assert driver.title.startswith("rlplug report")
        assert driver.execute_script("return document.readyState") == "complete"
        images = driver.find_elements(By.TAG_NAME, "img")
        assert len(images) == len(FIGURES)
        widths = driver.execute_script(
            "return Array.from(document.images).map(i => [i.getAttribute('src'), i.complete, i.naturalWidth])"
        )
        assert all(complete and width > 0 for _, complete, width in widths), widths
        for section in ("summary", "figures", "samples", "metrics"):
            assert driver.find_element(By.ID, section).is_displayed()
        for fig in FIGURES:
            assert driver.find_element(By.ID, f"figure-{fig.key}")
        rows = driver.find_elements(By.CSS_SELECTOR, "table.samples tr")
        assert len(rows) == 4 * (1 + 3)  # 4 validations: a header and 3 samples each
        errors = [e for e in driver.get_log("browser") if e.get("level") in ("SEVERE", "ERROR")]
        assert errors == []
        # the check can fail: a page with a broken image logs an error
        broken = report.with_name("broken.html")
        broken.write_text('<!DOCTYPE html><html><head><title>b</title></head><body><img src="nope.png"></body></html>')
        driver.get(broken.as_uri())
        assert driver.execute_script("return document.images[0].naturalWidth") == 0
        assert any("nope.png" in e.get("message", "") for e in driver.get_log("browser"))
    finally:
        driver.quit()


def test_metrics_of_the_run_are_in_the_report_table(report, run_dir):
    from rlplug.run.metrics import read_metrics_jsonl

    last = read_metrics_jsonl(run_dir)[-1]
    page = report.read_text()
    assert last["step"] == 3
    assert "<td>critic/score/mean</td>" in page and "<td>timing_s/gen</td>" in page
    assert json.dumps(sorted(metric_series(read_metrics_jsonl(run_dir))["critic/score/mean"].steps)) == "[1, 2, 3]"


def test_overwrite_moves_the_samples_aside_with_the_metric_log(tmp_path):
    from rlplug.run.checkpoint import CheckpointManager, set_aside_checkpoints

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "wall_time": 1.0}\n')
    log_validation_samples(_Trackers(main=True), tmp_path, [{"prompt": "old run"}], 1)
    aside = set_aside_checkpoints(CheckpointManager(tmp_path))
    assert aside is not None and sorted(p.name for p in aside.iterdir()) == ["metrics.jsonl", VALIDATION_SAMPLES_FILE]
    assert read_validation_samples(tmp_path) == []  # the new run starts without the old run's samples
