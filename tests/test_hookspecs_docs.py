"""Every hook is documented (like datasette's test_docs): each hookspec has a docstring naming
each of its arguments, each registration hook names the config key that selects its plugins,
and CONTRIBUTING.md mentions every hook."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlplug import hookspecs
from rlplug.config.schema import RunConfig
from rlplug.contracts.registry import KINDS

ROOT = Path(__file__).resolve().parent.parent
SPEC_ATTR = f"{hookspecs.PROJECT}_spec"
SPECS = {name: fn for name, fn in vars(hookspecs).items() if inspect.isfunction(fn) and hasattr(fn, SPEC_ATTR)}

#: the config key that selects plugins of each kind (as read by rlplug.run.validate)
SELECTED_BY = {
    "advantage_estimator": "algorithm.adv_estimator",
    "policy_loss": "actor.policy_loss",
    "kl_penalty": "algorithm.kl_penalty",
    "reward_function": "reward.reward_fn_map",
    "rollout_backend": "rollout.name",
    "training_backend": "trainer.backend",
    "tracker": "trainer.logger",
    "batch_filter": "algorithm.filter_groups",
    "tool": "rollout.multi_turn.tools",
    "environment": "rollout.multi_turn.environment",
}


def test_specs_found():
    assert set(SPECS) >= set(KINDS.values()) | {"on_train_start", "on_step_end", "on_train_end"}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_hookspec_documents_every_argument(name):
    fn = SPECS[name]
    doc = inspect.getdoc(fn)
    assert doc and len(doc.split()) >= 10, f"hook {name} needs a docstring saying when it is called and what it gets"
    for arg in inspect.signature(fn).parameters:
        # an argument is documented when it appears in code markup: ``arg`` or ``arg(...)``
        assert re.search(rf"``{arg}(``|\()", doc), f"hook {name}: the docstring does not describe argument '{arg}'"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_no_hook_is_firstresult(name):
    # the module docstring promises it: every implementation of a hook is called
    assert not getattr(SPECS[name], SPEC_ATTR).get("firstresult", False)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_registration_hook_per_kind(kind):
    hook = KINDS[kind]
    assert hook in SPECS, f"kind {kind}: no hookspec {hook}"
    assert hook.startswith("register_")
    doc = inspect.getdoc(SPECS[hook])
    key = SELECTED_BY[kind]
    assert OmegaConf.select(OmegaConf.structured(RunConfig), key) is not None, f"{key} is not a config key"
    assert f"``{key}``" in doc, f"{hook} should say that ``{key}`` selects its plugins"


def test_every_registration_hook_is_a_kind():
    register_hooks = {n for n in SPECS if n.startswith("register_")}
    assert register_hooks == set(KINDS.values())


@pytest.mark.parametrize("name", sorted(SPECS))
def test_contributing_mentions_every_hook(name):
    text = (ROOT / "CONTRIBUTING.md").read_text()
    assert f"`{name}" in text, f"CONTRIBUTING.md does not document the hook {name}"
