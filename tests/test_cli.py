"""The ``rlplug`` command line: ``plugins`` (text and JSON), config errors, fast failure of
``train`` on a bad config, and a broken third-party plugin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import rlplug
from rlplug import cli

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def run_cli(*args: str, pythonpath: list[Path] = (), env: dict | None = None, timeout: float = 120):
    """``python -m rlplug ARGS`` in a subprocess; returns (CompletedProcess, seconds)."""
    e = dict(os.environ)
    e.pop("RLPLUG_DISABLE_PLUGINS", None)
    e.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", COLUMNS="200", NO_COLOR="1", **(env or {}))
    if pythonpath:
        e["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "rlplug", *args], capture_output=True, text=True, env=e, timeout=timeout
    )
    return proc, time.perf_counter() - start


def _plugin(**hooks):
    import types

    return types.SimpleNamespace(**{k: rlplug.hookimpl(v) for k, v in hooks.items()})


@pytest.fixture
def small_registry(rlplug_registry):
    rlplug_registry.add_plugin(
        _plugin(register_trackers=lambda register: (register("console", dict), register("mlflow", dict))),
        name="trackers",
        distribution="rlplug",
        version="0.1.0",
    )
    rlplug_registry.add_plugin(
        _plugin(register_reward_functions=lambda register: register("exact", len)),
        name="ex",
        distribution="rlplug-ex",
        version="0.2.0",
    )
    rlplug_registry.add_plugin(
        _plugin(register_reward_function=lambda register: None), name="typo", distribution="rlplug-typo", version="9.9"
    )

    def needs_extra(register):
        raise ImportError("install the [gpu] extra: pip install 'rlplug-ex[gpu]'")

    rlplug_registry.add_plugin(
        _plugin(register_rollout_backends=needs_extra),
        name="fast",
        distribution="rlplug-ex",
        version="0.2.0",
        value="rlplug_ex.fast",
    )
    return rlplug_registry


def test_plugins_text(small_registry, capsys):
    assert cli.main(["plugins"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:5] == [
        "rlplug 0.1.0",
        "  tracker: console, mlflow",
        "rlplug-ex 0.2.0",
        "  reward_function: exact",
        "Plugins that failed to load",
    ]
    assert out[5].startswith(
        "  typo (rlplug-typo 9.9, entry point ): PluginValidationError: unknown hook 'register_reward_function'"
    )
    # error text is printed verbatim (square brackets are not taken as rich markup)
    assert (
        out[6]
        == "  fast (rlplug-ex 0.2.0, entry point rlplug_ex.fast): ImportError: install the [gpu] extra: pip install 'rlplug-ex[gpu]'"
    )
    assert len(out) == 7


def test_plugins_json(small_registry, capsys):
    assert cli.main(["plugins", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["distributions"] == {
        "rlplug": {"version": "0.1.0", "plugins": ["trackers"], "registers": {"tracker": ["console", "mlflow"]}},
        "rlplug-ex": {"version": "0.2.0", "plugins": ["ex"], "registers": {"reward_function": ["exact"]}},
    }
    broken, fast = data["broken"]
    assert fast["entry_point"] == "rlplug_ex.fast" and fast["error"].startswith("ImportError: install the [gpu] extra")
    assert broken["name"] == "typo" and broken["distribution"] == "rlplug-typo" and broken["version"] == "9.9"
    assert "register_reward_function" in broken["error"]
    assert data["conflicts"] == []


def test_plugins_shows_conflicts(rlplug_registry, capsys):
    for dist in ("dist-a", "dist-b"):
        rlplug_registry.add_plugin(
            _plugin(register_trackers=lambda register: register("same", dict)), name=dist, distribution=dist
        )
    assert cli.main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "Conflicts\n  The tracker name 'same' is registered twice: by dist-a and by dist-b." in out


def test_config_error_exit_code_and_message(capsys):
    assert cli.main(["config", "actor.ppo_mini_batchsize=4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "Config error: Unknown config key 'actor.ppo_mini_batchsize'. Did you mean 'actor.ppo_mini_batch_size'?"
    )


def test_config_unknown_plugin_in_process(small_registry, capsys):
    assert cli.main(["config", "trainer.logger=[consol]"]) == 2
    err = capsys.readouterr().err
    # plugins are resolved in a fixed order: the advantage estimator (default gae) first
    assert (
        "algorithm.adv_estimator=gae: Unknown advantage estimator 'gae'" in err
        and "No advantage estimator is registered" in err
    )
    assert "rlplug-typo" in err  # broken plugins are listed: one of them may have provided it


def test_data_prepare_bad_input_is_a_message_not_a_traceback(tmp_path, capsys):
    out = tmp_path / "d"
    assert cli.main(["data", "prepare", "basic_arithmetc", "--out", str(out)]) == 2
    assert capsys.readouterr().err.startswith(
        "Config error: Unknown task 'basic_arithmetc'. Did you mean 'basic_arithmetic'"
    )
    assert cli.main(["data", "prepare", "basic_arithmetic", "--out", str(out), "--task-kwargs", "{min_terms: 2}"]) == 2
    assert capsys.readouterr().err.startswith("Config error: --task-kwargs is not valid JSON")
    assert not out.exists()


def test_export_without_checkpoint_is_a_message(tmp_path, capsys):
    assert cli.main(["export", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith(f"Error: No complete checkpoint at {tmp_path}: expected a global_step_N")


def test_dataset_error_is_a_message(monkeypatch, capsys):
    from rlplug.data.dataset import DatasetError

    def broken(args):
        raise DatasetError("train.parquet, row 3, column 'prompt': is an empty list")

    monkeypatch.setattr(cli, "cmd_config", broken)
    assert cli.main(["config"]) == 2
    assert capsys.readouterr().err == "Error: train.parquet, row 3, column 'prompt': is an empty list\n"


# ============================================================================ subprocesses (real entry points)


def test_plugins_json_subprocess_lists_packaged_plugins():
    proc, _ = run_cli("plugins", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    core = data["distributions"]["rlplug"]
    assert core["version"] == rlplug.__version__
    assert core["registers"]["tracker"] == ["console", "mlflow", "prometheus", "tensorboard", "wandb"]
    assert {"trackers", "tensorboard", "wandb", "prometheus"} <= set(core["plugins"])


def test_train_unknown_algorithm_fails_fast():
    proc, seconds = run_cli("train", "algorithm=nosuch")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Could not find 'algorithm/nosuch'" in proc.stderr
    assert "Available options in 'algorithm'" in proc.stderr and "grpo" in proc.stderr
    assert seconds < 5.0, f"rlplug train with a bad config took {seconds:.1f} s (no model may load before validation)"


def test_broken_plugin_does_not_take_the_cli_down():
    path = [FIXTURES / "broken_plugin", FIXTURES / "misspelled_plugin"]
    proc, _ = run_cli("plugins", pythonpath=path)
    assert proc.returncode == 0, proc.stderr
    assert "Plugins that failed to load" in proc.stdout
    assert (
        "broken_estimator (rlplug-broken-plugin 0.0.1, entry point rlplug_broken_plugin): ImportError: "
        "rlplug_broken_plugin needs the package 'nonexistent-dependency'" in proc.stdout
    )
    assert (
        "misspelled (rlplug-misspelled-plugin 0.0.2, entry point rlplug_misspelled_plugin): "
        "PluginValidationError: unknown hook 'register_reward_function'" in proc.stdout
    )
    assert "tracker: console, mlflow, prometheus, tensorboard, wandb" in proc.stdout  # the healthy ones are listed

    proc, _ = run_cli("plugins", "--json", pythonpath=path)
    broken = {b["name"]: b for b in json.loads(proc.stdout)["broken"]}
    assert broken["broken_estimator"]["distribution"] == "rlplug-broken-plugin"

    # selecting a name from the broken plugin fails with its import error (exit 2: config error)
    proc, _ = run_cli("config", "algorithm.adv_estimator=broken_estimator", pythonpath=path)
    assert proc.returncode == 2
    assert (
        "algorithm.adv_estimator=broken_estimator: The advantage estimator 'broken_estimator' comes from plugin "
        "'broken_estimator' (rlplug-broken-plugin 0.0.1), which failed to load: ImportError:" in proc.stderr
    )

    # and disabling it by distribution name removes it from the report
    proc, _ = run_cli("plugins", pythonpath=path, env={"RLPLUG_DISABLE_PLUGINS": "rlplug-broken-plugin,misspelled"})
    assert proc.returncode == 0, proc.stderr
    assert "rlplug-broken-plugin" not in proc.stdout and "rlplug-misspelled-plugin" not in proc.stdout


def test_config_prints_the_composed_config_and_providers():
    proc, _ = run_cli("config", "debug=tiny", "algorithm=grpo")
    assert proc.returncode == 0, proc.stderr
    assert "adv_estimator: grpo" in proc.stdout and "source: tiny" in proc.stdout
    assert "algorithm.adv_estimator=grpo (rlplug 0.1.0)" in proc.stdout
    assert "trainer.logger[0]=console (rlplug 0.1.0)" in proc.stdout
