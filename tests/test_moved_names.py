"""Names that moved from an engine module to a packaged plugin (issue 32, "Engine and plugins") still resolve
from their old module for one release, with a DeprecationWarning naming the new home."""

from __future__ import annotations

import importlib

import pytest

from rlplug import _moved


@pytest.mark.parametrize(("module", "name"), [(m, n) for m, names in _moved.MOVED_NAMES.items() for n in sorted(names)])
def test_a_name_moved_to_a_plugin_is_forwarded_with_a_deprecation_warning(module: str, name: str) -> None:
    target = _moved.MOVED_NAMES[module][name]
    old = importlib.import_module(module)
    assert name not in getattr(old, "__all__", ()), "a forwarded name is no longer exported"
    with pytest.warns(DeprecationWarning, match=f"{module}.{name} moved to {target}.{name}"):
        value = getattr(old, name)
    assert value is getattr(importlib.import_module(target), name)


def test_a_name_that_did_not_move_is_still_an_attribute_error() -> None:
    old = importlib.import_module("rlplug.rewards.reward_model")
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        old.no_such_name  # noqa: B018
