"""Old module paths (before the layer packages) still work for one release, with a DeprecationWarning."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

from rlplug import _moved


def test_every_old_path_names_a_real_new_module_and_no_file_is_left_behind() -> None:
    from pathlib import Path

    core = Path(__file__).parents[1] / "core"
    for old, new in {**_moved.MOVED, **_moved.PACKAGE_FORWARDS}.items():
        assert importlib.util.find_spec(new) is not None, new
        if old in _moved.MOVED:
            # the old flat module is gone: the alias is the only way to reach the old name
            assert not (core / (old.removeprefix("rlplug.") + ".py")).exists(), old


def test_an_old_module_path_is_the_same_module_with_a_deprecation_warning() -> None:
    # a fresh interpreter: this process may already have imported the old name
    code = (
        "import warnings, sys\n"
        "warnings.simplefilter('error', DeprecationWarning)\n"
        "import rlplug.algorithms.losses as new\n"
        "try:\n"
        "    import rlplug.losses\n"
        "except DeprecationWarning as w:\n"
        "    print('warned:', w)\n"
        "warnings.simplefilter('ignore', DeprecationWarning)\n"
        "import rlplug.losses as old\n"
        "from rlplug.trainer import Trainer\n"
        "from rlplug.run.trainer import Trainer as T2\n"
        "print(old is new, Trainer is T2, new.__spec__.name)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "warned: rlplug.losses moved to rlplug.algorithms.losses" in out
    assert out.strip().endswith("True True rlplug.algorithms.losses")


@pytest.mark.parametrize(
    ("package", "name", "home"),
    [
        ("rlplug.config", "ConfigError", "rlplug.config.schema"),
        ("rlplug.contracts", "check_registration", "rlplug.contracts.kinds"),
        ("rlplug.training", "TrainingBackendBase", "rlplug.training.backend"),
    ],
)
def test_an_old_module_that_became_a_package_forwards_its_names(package: str, name: str, home: str) -> None:
    pkg = importlib.import_module(package)
    with pytest.warns(DeprecationWarning, match=f"{package}.{name} moved to {home}.{name}"):
        value = getattr(pkg, name)
    assert value is getattr(importlib.import_module(home), name)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        pkg.no_such_name  # noqa: B018


def test_the_engine_itself_uses_no_old_path() -> None:
    # importing the whole engine and the packaged plugins triggers no alias
    code = (
        "import warnings\n"
        "warnings.filterwarnings('error', message='.*moved to rlplug', category=DeprecationWarning)\n"
        "import pkgutil, importlib, rlplug\n"
        "for m in pkgutil.walk_packages(rlplug.__path__, 'rlplug.'):\n"
        "    if m.name.startswith(('rlplug.configs', 'rlplug.__main__')):\n"
        "        continue\n"
        "    try:\n"
        "        importlib.import_module(m.name)\n"
        "    except ImportError:\n"
        "        pass  # an optional library (vllm, sglang) not installed\n"
        "print('clean')\n"
    )
    with warnings.catch_warnings():
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "clean", out.stderr[-2000:]
