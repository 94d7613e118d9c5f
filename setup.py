"""The package list of rlplug's wheel, discovered from the source tree (everything else is in pyproject.toml).

``[tool.setuptools] package-dir`` in pyproject.toml maps each top-level package to its folder: ``rlplug`` to core/,
``rlplug.plugins`` to plugins/, ``rlplug.configs`` to configs/. setuptools' ``packages.find`` names a package after
its folder (it finds ``core.x``, never ``rlplug.x``), so it cannot list these; this file does: each mapped package,
and every folder below its folder that holds an ``__init__.py`` under the package's name (core/a/b/ is
``rlplug.a.b``). A new subpackage is in the wheel without editing a list; tests/test_install.py checks it.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent


def discover_packages() -> list[str]:
    """Every package of the wheel, e.g. ``["rlplug", "rlplug.configs", "rlplug.plugins", ...]``."""
    package_dir: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    packages = []
    for name, folder in package_dir.items():
        packages.append(name)
        packages += [f"{name}.{sub}" for sub in find_packages(str(ROOT / folder))]
    return sorted(packages)


setup(packages=discover_packages())
