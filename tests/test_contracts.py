"""Plugin contracts as code: every kind's Protocol is checked when a plugin is resolved.

A plugin that misses or misnames a method fails when the registry resolves it (``rlplug train``
/ ``rlplug config`` resolve every selected plugin before any model loads), with a message naming
the member, the kind and the distribution that supplied it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import rlplug
from rlplug.contracts.kinds import CONTRACTS, check_object, protocol_members
from rlplug.contracts.registry import PluginContractError, PluginError, Registry
from rlplug.contracts.types import AdvantageEstimator, PolicyLoss, RolloutOutput

ROOT = Path(__file__).resolve().parent.parent


class GoodRollout:
    def __init__(self, config, model_path, tokenizer):
        pass

    def generate(self, prompt_ids, params):
        return RolloutOutput([[1]] * len(prompt_ids), ["stop"] * len(prompt_ids), list(range(len(prompt_ids))))

    def update_weights(self, named_tensors):
        pass

    def sleep(self):
        pass

    def wake_up(self):
        pass

    def close(self):
        pass


class MisnamedRollout(GoodRollout):
    wake_up = None  # type: ignore[assignment]

    def wakeup(self):
        pass


def _registry_with(kind: str, obj, **extra) -> Registry:
    reg = Registry(load_entry_points=False)
    reg.register(kind, "thing", obj, distribution="rlplug-thing", version="0.3.0", **extra)
    return reg


def test_every_kind_has_a_protocol_with_members():
    from rlplug.contracts.registry import KINDS

    assert set(CONTRACTS) == set(KINDS)
    methods, attrs = protocol_members(CONTRACTS["rollout_backend"].protocol)
    assert set(methods) == {"generate", "update_weights", "sleep", "wake_up", "close"} and attrs == set()
    methods, attrs = protocol_members(CONTRACTS["training_backend"].protocol)
    assert {
        "compute_log_probs",
        "compute_values",
        "update_actor",
        "update_critic",
        "actor_weights",
        "save",
        "load",
        "export_hf",
        "close",
    } == set(methods)
    assert attrs == {"consecutive_bad_steps", "coordinator", "per_token_outputs", "capabilities"}


def test_conforming_factory_class_resolves():
    reg = _registry_with("rollout_backend", GoodRollout)
    assert reg.get("rollout_backend", "thing") is GoodRollout


def test_missing_method_names_method_kind_and_distribution():
    reg = _registry_with(
        "rollout_backend",
        type(
            "Half",
            (),
            {
                "generate": GoodRollout.generate,
                "update_weights": GoodRollout.update_weights,
                "close": GoodRollout.close,
            },
        ),
    )
    with pytest.raises(PluginContractError) as exc:
        reg.get("rollout_backend", "thing")
    msg = str(exc.value)
    assert msg.startswith(
        "The rollout backend 'thing' (rlplug-thing 0.3.0, plugin <direct>) does not implement "
        "rlplug.contracts.types.RolloutBackend: "
    )
    assert "Half has no method sleep()" in msg and "Half has no method wake_up()" in msg
    assert exc.value.problems == ["Half has no method sleep()", "Half has no method wake_up()"]
    assert isinstance(exc.value, PluginError)  # the config check reports it like any plugin problem


def test_misnamed_method_is_pointed_out():
    reg = _registry_with("rollout_backend", MisnamedRollout)
    with pytest.raises(PluginContractError, match=r"MisnamedRollout\.wake_up is a NoneType, not a method"):
        reg.get("rollout_backend", "thing")

    class Renamed:
        def generate(self, prompt_ids, params): ...
        def update_weight(self, named_tensors): ...  # noqa: E704
        def sleep(self): ...  # noqa: E704
        def wake_up(self): ...  # noqa: E704
        def close(self): ...  # noqa: E704

    problems = check_object("rollout_backend", Renamed, is_class=True)
    assert problems == ["Renamed has no method update_weights() (found 'update_weight': misnamed?)"]


def test_wrong_signature_is_reported_with_the_engine_call():
    class OneArg(GoodRollout):
        def generate(self, prompt_ids):  # no params
            return None

    (problem,) = check_object("rollout_backend", OneArg, is_class=True)
    assert problem.startswith("OneArg.generate(prompt_ids) cannot be called as OneArg.generate(prompt_ids, params): ")


def test_factory_function_must_declare_what_it_builds():
    def make(config, model_path, tokenizer):
        return GoodRollout(config, model_path, tokenizer)

    with pytest.raises(
        PluginContractError,
        match=r"does not declare the class it builds; register the class itself or "
        r"register\(name, factory, builds=TheClass\)",
    ):
        _registry_with("rollout_backend", make).get("rollout_backend", "thing")
    assert _registry_with("rollout_backend", make, builds=GoodRollout).get("rollout_backend", "thing") is make
    with pytest.raises(PluginContractError, match="MisnamedRollout"):
        _registry_with("rollout_backend", make, builds=(GoodRollout, MisnamedRollout)).get("rollout_backend", "thing")


def test_unknown_training_capability_is_rejected():
    from rlplug.plugins.training.local import LocalTrainingBackend

    class Odd(LocalTrainingBackend):
        capabilities = frozenset({"reuses_on_policy_log_probs", "time_travel"})

    problems = check_object("training_backend", Odd, is_class=True)
    assert problems == [
        "Odd.capabilities lists unknown ['time_travel']; known: "
        "['reuses_on_policy_log_probs', 'policy_loss_minibatch_stats', 'scale_lr', 'apply_phase', 'lora']"
    ]


def test_algorithm_objects_are_checked_through_their_function():
    def adv(data):  # config missing
        return data["token_level_rewards"], data["token_level_rewards"]

    with pytest.raises(PluginContractError, match=r"adv\(data\) cannot be called as adv\(data, config\)"):
        _registry_with("advantage_estimator", AdvantageEstimator(adv)).get("advantage_estimator", "thing")

    def loss(old_log_probs, log_probs, advantages, response_mask, *, config, loss_agg_mode, normalizer):
        return torch.zeros(()), {}

    with pytest.raises(PluginContractError, match="unexpected keyword argument 'max_response_length'"):
        _registry_with("policy_loss", PolicyLoss(loss)).get("policy_loss", "thing")

    def flexible(old_log_probs, log_probs, advantages, response_mask, **kwargs):
        return torch.zeros(()), {}

    _registry_with("policy_loss", PolicyLoss(flexible)).get("policy_loss", "thing")  # **kwargs accepts the call
    with pytest.raises(PluginContractError, match="has no attribute 'requires'"):
        _registry_with("advantage_estimator", adv).get("advantage_estimator", "thing")


def test_reward_function_needs_verl_call_signature():
    def two(data_source, solution_str):
        return 0.0

    with pytest.raises(
        PluginContractError,
        match=r"two\(data_source, solution_str\) cannot be called as "
        r"two\(data_source, solution_str, ground_truth, extra_info=\.\.\.\)",
    ):
        _registry_with("reward_function", two).get("reward_function", "thing")


def test_every_packaged_plugin_meets_its_contract(rlplug_full_registry):
    for kind in CONTRACTS:
        for name in rlplug_full_registry.names(kind):
            rlplug_full_registry.registration(kind, name)  # raises PluginContractError otherwise


def test_third_party_plugin_missing_a_method_fails_at_train_resolve_time(tmp_path):
    """A pip-installed distribution (an entry point in a dist-info folder on PYTHONPATH) whose rollout
    backend lacks ``sleep``/``wake_up`` is rejected by ``rlplug train`` before any model loads."""
    site = tmp_path / "site"
    pkg = site / "rlplug_halfroll"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        textwrap.dedent("""
        import rlplug

        class HalfRollout:
            def __init__(self, config, model_path, tokenizer): ...
            def generate(self, prompt_ids, params): ...
            def update_weights(self, named_tensors): ...
            def wakeup(self): ...
            def close(self): ...

        @rlplug.hookimpl
        def register_rollout_backends(register):
            register("halfroll", HalfRollout)
    """)
    )
    info = site / "rlplug_halfroll-0.2.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rlplug-halfroll\nVersion: 0.2.0\n")
    (info / "entry_points.txt").write_text("[rlplug]\nhalfroll = rlplug_halfroll\n")
    (info / "RECORD").write_text("")
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
        COLUMNS="200",
    )
    env.pop("RLPLUG_DISABLE_PLUGINS", None)
    start = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlplug",
            "train",
            "rollout.name=halfroll",
            f"trainer.default_local_dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=tmp_path,
    )
    seconds = time.perf_counter() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert (
        "rollout.name=halfroll: The rollout backend 'halfroll' (rlplug-halfroll 0.2.0, plugin halfroll) does not "
        "implement rlplug.contracts.types.RolloutBackend: HalfRollout has no method sleep(); HalfRollout has no method "
        "wake_up() (found 'wakeup': misnamed?)"
    ) in out, out
    assert "Traceback" not in out, out
    assert not (tmp_path / "run").exists()  # nothing was started
    # no model or data was touched: about 3 s here (the 5 s target is measured, not timed, in the
    # issue notes); the bound only catches a regression that loads something heavy first
    assert seconds < 30.0, f"took {seconds:.1f} s"


def test_rlplug_types_protocols_are_runtime_checkable():
    from rlplug.contracts.types import RolloutBackend

    assert isinstance(GoodRollout(None, "", None), RolloutBackend)
    assert not isinstance(object(), RolloutBackend)
    assert rlplug.PluginContractError is PluginContractError
