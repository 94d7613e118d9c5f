"""``pip install .`` (not editable) into a fresh virtualenv installs every package of the source tree (issue 32).

The wheel's package list is discovered (setup.py, from pyproject.toml's ``[tool.setuptools] package-dir``), so a
new subpackage of core/ or plugins/ cannot be left out of a release silently. How the test checks it:

* The sources (pyproject.toml, setup.py, README.md, LICENSE, core/, plugins/, configs/) are copied to a temporary
  folder, and three made-up subpackages are added to the copy (:data:`NEW_PACKAGES`: a subpackage of core/, one
  nested in it, one of plugins/), standing for the subpackages the next changes add. Building from a copy also
  keeps pip's in-tree ``build/`` and ``*.egg-info`` out of the checkout.
* This environment's pip builds a wheel of the copy (``--no-deps --no-build-isolation --no-index``: no network,
  this environment's setuptools) and installs it into a fresh environment (``python -m venv --without-pip``,
  ``pip --python <venv> install --no-deps``: what ``pip install .`` does, in two steps). The fresh
  environment finds the dependencies (torch, hydra, ...) through a ``.pth`` line naming this environment's
  site-packages: that folder comes after its own site-packages on ``sys.path`` and its ``.pth`` files are not
  run, so rlplug's editable-install finder is not active and ``import rlplug`` can only find the installed copy.
* The fresh interpreter imports, as its ``rlplug...`` name, every folder of the copy's core/ and plugins/ that
  holds an ``__init__.py`` (core/a/b/ is ``rlplug.a.b``, plugins/a/ is ``rlplug.plugins.a``) and every module
  there (core/a/m.py is ``rlplug.a.m``; not ``__main__``); each must come from the fresh environment. The installed ``.py`` files are those of core/ and plugins/, the ``.yaml`` files
  those of configs/, and ``rlplug.config.schema.config_dir()`` is the installed ``rlplug.configs``, from which a config
  composes (``trainer=fsdp2``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: what the build needs from the checkout (pyproject.toml's readme, setup.py's package discovery, the packages)
SOURCES = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "core", "plugins", "configs")
#: where each package's folder is (as [tool.setuptools] package-dir says; this test does not read it from there)
FOLDERS = {"core": "rlplug", "plugins": "rlplug.plugins"}
#: made-up subpackages added to the copy: a new subpackage must reach the wheel with no edit of a list
NEW_PACKAGES = ("core/zz_new_layer", "core/zz_new_layer/inner", "plugins/zz_new_kind")

#: runs in the fresh environment: imports each package named in argv[1], prints what it found as JSON
CHECK = r"""
import importlib, json, sys
from pathlib import Path

found = {"files": {}, "errors": {}}
for name in json.loads(sys.argv[1]):
    try:
        found["files"][name] = importlib.import_module(name).__file__
    except Exception as exc:
        found["errors"][name] = f"{type(exc).__name__}: {exc}"
import rlplug.config.compose
import rlplug.config.schema

root = Path(rlplug.__file__).parent
found["installed"] = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.suffix in (".py", ".yaml"))
found["config_dir"] = str(rlplug.config.schema.config_dir())
found["backend"] = rlplug.config.compose.compose(["trainer=fsdp2"]).trainer.backend
print(json.dumps(found))
"""


def source_packages(src: Path) -> list[str]:
    """The ``rlplug...`` name of every folder under ``src``'s core/ and plugins/ that holds an ``__init__.py``."""
    names = ["rlplug.configs"]
    for folder, package in FOLDERS.items():
        for init in sorted((src / folder).rglob("__init__.py")):
            parts = init.parent.relative_to(src / folder).parts
            names.append(".".join((package, *parts)))
    return sorted(names)


def source_modules(src: Path) -> list[str]:
    """The ``rlplug...`` name of every module (``.py`` file) under ``src``'s core/ and plugins/ but
    ``__main__.py`` (importing it runs the command line)."""
    names = []
    for folder, package in FOLDERS.items():
        for path in sorted((src / folder).rglob("*.py")):
            parts = path.relative_to(src / folder).with_suffix("").parts
            if parts[-1] not in ("__init__", "__main__"):
                names.append(".".join((package, *parts)))
    return sorted(names)


def expected_files(src: Path) -> list[str]:
    """The ``.py`` and ``.yaml`` files the installed ``rlplug`` folder must hold, relative to it."""
    files = [p.relative_to(src / "core").as_posix() for p in (src / "core").rglob("*.py")]
    files += ["plugins/" + p.relative_to(src / "plugins").as_posix() for p in (src / "plugins").rglob("*.py")]
    files += ["configs/" + p.relative_to(src / "configs").as_posix() for p in (src / "configs").rglob("*.yaml")]
    files.append("configs/__init__.py")
    return sorted(files)


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """Run ``cmd``; on failure, the assertion shows its output."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kwargs)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """Copy the sources, install the copy into a fresh virtualenv and import every package there."""
    tmp = tmp_path_factory.mktemp("install")
    start = time.perf_counter()
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(ROOT / name, src / name)
    for folder in NEW_PACKAGES:
        (src / folder).mkdir()
        (src / folder / "__init__.py").write_text(f'"""A made-up package ({folder}) of tests/test_install.py."""\n')

    venv = tmp / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--quiet", "--no-cache-dir"]
    run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "--wheel-dir", str(tmp / "dist"), str(src)])
    (wheel,) = (tmp / "dist").glob("rlplug-*.whl")
    run([*pip, "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)])
    site = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(site, "zz_test_install_deps.pth").write_text("".join(f"{d}\n" for d in sorted(deps)))

    packages, modules = source_packages(src), source_modules(src)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = run([str(python), "-c", CHECK, json.dumps(packages + modules)], cwd=tmp, env=env)
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    found.update(src=src, venv=venv, packages=packages, modules=modules, seconds=time.perf_counter() - start)
    return found


def test_the_packages_of_the_copy_are_checked(installed):
    """The list of packages is the source tree's, and holds the made-up new ones."""
    packages = installed["packages"]
    assert {"rlplug", "rlplug.plugins", "rlplug.plugins.training", "rlplug.configs"} <= set(packages)
    assert {"rlplug.zz_new_layer", "rlplug.zz_new_layer.inner", "rlplug.plugins.zz_new_kind"} <= set(packages)
    assert source_packages(ROOT) == sorted(set(packages) - {p for p in packages if "zz_new" in p})


def test_every_package_and_module_imports_from_the_installed_copy(installed):
    assert installed["errors"] == {}
    assert sorted(installed["files"]) == sorted(installed["packages"] + installed["modules"])
    assert {"rlplug.run.trainer", "rlplug.plugins.training.fsdp2"} <= set(installed["modules"])
    venv = installed["venv"].resolve()
    outside = {n: f for n, f in installed["files"].items() if not Path(f).resolve().is_relative_to(venv)}
    assert outside == {}, f"imported from outside the fresh virtualenv {venv}"
    assert Path(installed["files"]["rlplug"]).resolve().parent.parent.name == "site-packages"


def test_the_installed_files_are_the_sources(installed):
    assert installed["installed"] == expected_files(installed["src"])


def test_the_configs_are_found_in_the_installed_copy(installed):
    config_dir = Path(installed["config_dir"]).resolve()
    assert config_dir == Path(installed["files"]["rlplug.configs"]).resolve().parent
    assert (config_dir / "config.yaml").is_file() and (config_dir / "trainer" / "fsdp2.yaml").is_file()
    # a config composes from there, with a group file: configs/trainer/fsdp2.yaml sets trainer.backend
    assert installed["backend"] == "fsdp2"
