"""The public plugin API (``rlplug.plugin``) and the run context the engine hands plugins.

* The packaged plugins (``plugins/``) and the contrib example import rlplug names from
  ``rlplug.plugin`` only, and no ``_``-prefixed name (an AST scan of every ``.py`` file);
* every name ``rlplug.plugin`` exports resolves, and is the object of the module it comes from;
* a tracker and a training backend built by a run get a :class:`rlplug.plugin.RunContext` with the
  run's directory and the step it resumed after (a tiny run of one step, then a resumed second step);
* the older tracker factory forms (``factory(config)``, ``factory(config, resume_step=N)``) still work;
* :func:`rlplug.plugin.fault_point` is the crash tests' hook and counts with ``rlplug.run.checkpoint``'s.
"""

from __future__ import annotations

import ast
import dataclasses
import warnings
from pathlib import Path
from typing import Any

import pytest
from _helpers import TINY_CPU_RUN, fit, run_config

import rlplug.plugin
from rlplug.plugin import RunContext

ROOT = Path(__file__).resolve().parent.parent
SCANNED = (ROOT / "plugins", ROOT / "contrib")


# ============================================================================ (a) imports of plugins


def _absolute(node: ast.ImportFrom, path: Path) -> str:
    """The absolute module of ``from <node.module> import ...`` in ``path``; relative imports of files under
    ``plugins/`` resolve inside ``rlplug.plugins`` (``plugins/`` is installed as that package), those of
    other files to a name outside rlplug."""
    if node.level == 0:
        return node.module or ""
    try:
        parts = ["rlplug", "plugins", *path.relative_to(ROOT / "plugins").parent.parts]
    except ValueError:  # contrib: a relative import stays inside the contrib package itself
        return "." * node.level + (node.module or "")
    base = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
    return ".".join(base + ([node.module] if node.module else []))


def _is_rlplug(module: str) -> bool:
    return module == "rlplug" or module.startswith("rlplug.")


def import_violations(source: str, path: Path) -> list[str]:
    """Every import in ``source`` (the text of ``path``) that reaches rlplug other than ``from rlplug.plugin
    import <public name>``: ``import rlplug...``, ``from rlplug.<other> import ...`` (absolute or relative),
    a ``_``-prefixed or unexported name of ``rlplug.plugin``, ``import *``, and
    ``importlib.import_module("rlplug...")`` / ``__import__("rlplug...")``. As ``"<path>:<line>: <what>"``."""
    where = path.relative_to(ROOT) if path.is_absolute() and ROOT in path.parents else path
    exported = set(rlplug.plugin.__all__)
    out: list[str] = []
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, ast.Import):
            out += [f"{where}:{node.lineno}: import {a.name}" for a in node.names if _is_rlplug(a.name)]
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node, path)
            if not _is_rlplug(module):
                continue
            names = ", ".join(a.name for a in node.names)
            if module != "rlplug.plugin":
                out.append(f"{where}:{node.lineno}: from {module} import {names} (use rlplug.plugin)")
                continue
            for alias in node.names:
                if alias.name.startswith("_") or alias.name == "*" or alias.name not in exported:
                    out.append(f"{where}:{node.lineno}: from rlplug.plugin import {alias.name} (not exported)")
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            target = node.args[0].value
            if name in ("import_module", "__import__") and isinstance(target, str) and _is_rlplug(target):
                out.append(f"{where}:{node.lineno}: {name}({target!r})")
    return out


def _scanned_files() -> list[Path]:
    files = sorted(p for root in SCANNED for p in root.rglob("*.py") if "build" not in p.relative_to(root).parts)
    assert len(files) >= 20, files  # 19 modules under plugins/ alone: a wrong root would scan nothing
    return files


def test_plugins_and_contrib_import_rlplug_only_through_the_plugin_api():
    found = [v for path in _scanned_files() for v in import_violations(path.read_text(), path)]
    assert not found, "imports of rlplug outside rlplug.plugin:\n" + "\n".join(found)


def test_plugins_import_the_plugin_api():
    # the scan above would pass on plugins that import nothing: each registering module uses the API
    users = [p for p in _scanned_files() if "from rlplug.plugin import" in p.read_text()]
    hooks = [p for p in _scanned_files() if "@hookimpl" in p.read_text()]
    assert set(hooks) <= set(users), sorted(set(hooks) - set(users))
    assert len(hooks) >= 17  # 16 packaged plugin modules and the example plugin's __init__ register hooks


@pytest.mark.parametrize(
    "source, rel, expected",
    [
        ("import rlplug\n", "plugins/x/a.py", ["plugins/x/a.py:1: import rlplug"]),
        (
            "from rlplug.run.checkpoint import _fault_point\n",
            "plugins/x/a.py",
            ["plugins/x/a.py:1: from rlplug.run.checkpoint import _fault_point (use rlplug.plugin)"],
        ),
        (
            "def f():\n    from rlplug.run.metrics import tracker_name\n",
            "contrib/p/a.py",
            ["contrib/p/a.py:2: from rlplug.run.metrics import tracker_name (use rlplug.plugin)"],
        ),
        (  # plugins/x/a.py is rlplug.plugins.x.a: three dots reach rlplug itself
            "from ...trainer import run_dir_for\n",
            "plugins/x/a.py",
            ["plugins/x/a.py:1: from rlplug.trainer import run_dir_for (use rlplug.plugin)"],
        ),
        (
            "from rlplug.plugin import hookimpl, _TESTING, nothing_such\n",
            "plugins/x/a.py",
            [
                "plugins/x/a.py:1: from rlplug.plugin import _TESTING (not exported)",
                "plugins/x/a.py:1: from rlplug.plugin import nothing_such (not exported)",
            ],
        ),
        ("import importlib\nimportlib.import_module('rlplug.run.trainer')\n", "plugins/x/a.py", None),
        ("from rlplug.plugin import hookimpl, tracker_name\nfrom .rewards import f\n", "contrib/p/a.py", []),
    ],
)
def test_the_import_scan_finds_each_kind_of_violation(source, rel, expected):
    found = import_violations(source, ROOT / rel)
    if expected is None:
        expected = [f"{rel}:2: import_module('rlplug.run.trainer')"]
    assert found == expected


# ============================================================================ (b) the exported names


def test_every_exported_name_resolves_to_its_source_object():
    import rlplug
    import rlplug.base.faults
    import rlplug.run.checkpoint
    import rlplug.run.metrics
    import rlplug.testing
    import rlplug.training.backend

    names = rlplug.plugin.__all__
    assert len(names) == len(set(names)) and not [n for n in names if n.startswith("_")]
    missing = [n for n in names if not hasattr(rlplug.plugin, n)]
    assert not missing
    namespace: dict[str, Any] = {}
    exec("from rlplug.plugin import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(names)
    # re-exports, not copies: the plugin API hands out the engine's own objects
    assert rlplug.plugin.hookimpl is rlplug.hookimpl
    assert rlplug.plugin.TrainingBackendBase is rlplug.training.backend.TrainingBackendBase
    assert rlplug.plugin.tracker_name is rlplug.run.metrics.tracker_name
    assert rlplug.plugin.make_batch is rlplug.testing.make_batch  # imported on first use
    assert rlplug.plugin.check_tracker is rlplug.testing.check_tracker
    assert rlplug.plugin.fault_point is rlplug.base.faults.fault_point
    assert rlplug.plugin.apply_umask is rlplug.run.checkpoint.apply_umask  # its old home keeps working
    with pytest.raises(AttributeError, match="no attribute 'run_dir_for'"):
        rlplug.plugin.run_dir_for  # noqa: B018 - the run layer's own helpers are not part of the API


def test_the_names_the_packaged_plugins_use_are_documented_in_the_index():
    # the module docstring is the plugin author's index: every group the plugins draw from is named there
    doc = rlplug.plugin.__doc__ or ""
    for group in ("Registration", "Contracts", "The run", "Algorithm math", "Rewards", "Rollout backends"):
        assert f"**{group}**" in doc
    for group in ("Training backends", "Trackers", "Configuration", "Testing"):
        assert f"**{group}**" in doc


# ============================================================================ the run context


def test_run_context_is_frozen_and_checked():
    run = RunContext("some/dir", 3)
    assert run.run_dir == Path("some/dir") and run.resume_step == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.resume_step = 4  # type: ignore[misc]
    assert RunContext(Path("d")).resume_step == 0 and RunContext(Path("d"), None).resume_step is None
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="resume_step must be a global step >= 0 or None"):
            RunContext(Path("d"), bad)  # type: ignore[arg-type]


def test_build_tracker_passes_the_run_context_to_factories_that_declare_run():
    from rlplug.base.run_context import takes_run_context
    from rlplug.run.metrics import build_tracker

    run = RunContext(Path("/runs/r"), 5)

    def new(config, *, run):
        return ("new", config, run)

    def legacy(config, resume_step=None):
        return ("legacy", config, resume_step)

    def plain(config):
        return ("plain", config)

    assert [takes_run_context(f) for f in (new, legacy, plain, lambda config, **kw: kw, len)] == [
        True,
        False,
        False,
        False,
        False,
    ]
    assert build_tracker(new, "cfg", resume_step=5, run=run) == ("new", "cfg", run)
    with pytest.warns(DeprecationWarning, match="declare a keyword parameter 'run' instead"):
        assert build_tracker(legacy, "cfg", resume_step=5, run=run) == ("legacy", "cfg", 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a factory that needs nothing from the run is not deprecated
        assert build_tracker(plain, "cfg", resume_step=5, run=run) == ("plain", "cfg")


def test_run_context_for_a_plugin_built_outside_a_run(tmp_path):
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(
        {"trainer": {"default_local_dir": str(tmp_path), "resume_mode": "auto", "resume_from_path": None}}
    )
    assert rlplug.plugin.run_context_for(cfg) == RunContext(tmp_path, 0)  # no checkpoint: a fresh start
    (tmp_path / "global_step_3").mkdir()
    (tmp_path / "global_step_3" / "COMPLETE").write_text("")
    assert rlplug.plugin.run_context_for(cfg) == RunContext(tmp_path, 3)  # a run there would resume after 3
    assert rlplug.plugin.run_context_for(cfg, resume_step=2) == RunContext(tmp_path, 2)  # given: kept


class _Spy:
    """A test plugin: the tracker ``spy`` and the training backend ``spy`` (the packaged ``local`` one,
    built through a factory that declares ``run``), each recording the run context it was given."""

    def __init__(self) -> None:
        self.tracker_runs: list[RunContext] = []
        self.backend_runs: list[RunContext] = []

    @rlplug.plugin.hookimpl
    def register_trackers(self, register):
        spy = self

        class SpyTracker:
            def __init__(self, config: Any, *, run: RunContext) -> None:
                spy.tracker_runs.append(run)

            def log_params(self, params: dict) -> None: ...

            def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

            def log_table(self, name: str, rows: list[dict], step: int) -> None: ...

            def log_artifact(self, path: Any, artifact_path: str | None = None) -> None: ...

            def close(self, status: str = "FINISHED") -> None: ...

        register("spy", SpyTracker)

    @rlplug.plugin.hookimpl
    def register_training_backends(self, register):
        from rlplug.plugins.training.local import LocalTrainingBackend

        def spy_backend(config, model_path, *, use_critic, use_ref, total_steps, run):
            self.backend_runs.append(run)
            return LocalTrainingBackend(
                config, model_path, use_critic=use_critic, use_ref=use_ref, total_steps=total_steps, run=run
            )

        register("spy", spy_backend, builds=LocalTrainingBackend)


def test_a_resumed_run_hands_its_tracker_and_training_backend_the_run_dir_and_resume_step(
    tmp_path, rlplug_full_registry
):
    spy = _Spy()
    assert rlplug_full_registry.add_plugin(spy, name="spy"), rlplug_full_registry.broken
    run_dir = tmp_path / "run"
    overrides = [
        *TINY_CPU_RUN,
        "algorithm=grpo",
        "rollout.n=2",
        "trainer.backend=spy",
        "trainer.logger=[spy]",
        "trainer.save_freq=1",
    ]
    assert fit(run_config(overrides, run_dir, "trainer.total_training_steps=1")) == "finished"
    assert fit(run_config(overrides, run_dir, "trainer.total_training_steps=2")) == "finished"  # resumes after 1
    assert spy.tracker_runs == [RunContext(run_dir, 0), RunContext(run_dir, 1)]
    assert spy.backend_runs == [RunContext(run_dir, 0), RunContext(run_dir, 1)]
    assert (run_dir / "global_step_2" / "COMPLETE").is_file()  # the second run did continue the first


def test_the_packaged_trackers_use_the_run_context_they_are_given(tmp_path):
    # given a context, a tracker takes the run directory and resume step from it, not from the config
    pytest.importorskip("tensorboard")
    from omegaconf import OmegaConf

    from rlplug.plugins.tracking.tensorboard_tracker import TensorBoardTracker

    cfg = OmegaConf.create({"trainer": {"default_local_dir": str(tmp_path / "elsewhere"), "resume_mode": "auto"}})
    tracker = TensorBoardTracker(cfg, run=RunContext(tmp_path / "given", 4))
    tracker.log_metrics({"actor/pg_loss": 1.0}, 5)
    tracker.close()
    assert tracker.log_dir == (tmp_path / "given" / "tensorboard").resolve()
    assert (tracker.resume_step, tracker.purge_step) == (4, 5)
    assert not (tmp_path / "elsewhere").exists()


# ============================================================================ the fault hook


def test_fault_point_of_the_plugin_api_is_the_crash_tests_hook(monkeypatch):
    import rlplug.base.faults
    import rlplug.run.checkpoint

    monkeypatch.setattr(rlplug.base.faults, "fault_counts", {})
    monkeypatch.setattr(rlplug.run.checkpoint, "_fault_counts", rlplug.base.faults.fault_counts)
    monkeypatch.delenv(rlplug.plugin.FAULT_ENV, raising=False)
    rlplug.plugin.fault_point("myplugin_write")  # unset: nothing happens, nothing is counted
    assert rlplug.base.faults.fault_counts == {}
    monkeypatch.setenv("RLPLUG_TEST_KILL_AT", "myplugin_write:2:ENOSPC")
    rlplug.plugin.fault_point("myplugin_write")
    with pytest.raises(OSError, match=r"No space left on device \(RLPLUG_TEST_KILL_AT at myplugin_write:2\)"):
        rlplug.run.checkpoint._fault_point("myplugin_write")  # the old name counts in the same place
    assert rlplug.base.faults.fault_counts == {"myplugin_write": 2}
