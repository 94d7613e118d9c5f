"""Nothing from a checkpoint, a model folder or the config can make rlplug run foreign code.

* Checkpoints load with ``torch.load(weights_only=True)`` or safetensors: a pickle payload in
  ``optimizer.pt`` / ``rng_state.pt`` / ``model.safetensors`` fails to load, and its code never
  runs (the payload writes a marker file when unpickled; a control shows it does with
  ``weights_only=False``).
* ``model.trust_remote_code`` is off by default: a model folder whose config points at its own
  Python code is refused without importing that code; turning it on warns.
* Plugin names in the config are looked up in the registry only: ``os.system``,
  ``module.path:attr`` or an importable module name is an unknown plugin, never imported.
"""

from __future__ import annotations

import builtins
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from _helpers import TINY_CPU_RUN, fit, run_config

from rlplug.config.compose import compose
from rlplug.config.schema import ConfigError
from rlplug.contracts.registry import KINDS, UnknownPluginError, get_registry
from rlplug.run.trainer import Trainer
from rlplug.run.validate import validate_config

BASE = TINY_CPU_RUN + [
    "algorithm=grpo",
    "rollout.n=2",
    "actor.use_kl_loss=false",
    "actor.ppo_mini_batch_size=2",
    "actor.micro_batch_size_per_device=2",
    "trainer.logger=[]",
]


class _Payload:
    """Unpickling this object runs ``exec`` of code that writes ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (builtins.exec, (f"open({str(self.marker)!r}, 'w').write('code ran')",))


def _cfg(tmp_path, *extra: str):
    return run_config(BASE, tmp_path, *extra, validate=False)


@pytest.fixture(scope="module")
def one_step_checkpoint(tmp_path_factory) -> Path:
    """A run directory with a complete checkpoint of step 1 (copied per test before tampering)."""
    run_dir = tmp_path_factory.mktemp("clean_run")
    assert fit(_cfg(run_dir, "trainer.total_training_steps=1", "trainer.save_freq=1")) == "finished"
    return run_dir


def _tampered_copy(one_step_checkpoint: Path, tmp_path: Path, rel: str, payload_bytes: bytes) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(one_step_checkpoint, run_dir)
    (run_dir / "global_step_1" / rel).write_bytes(payload_bytes)
    # checksums.json is no signature: a tamperer rewrites it too, so the load itself must refuse the payload
    from rlplug.run.checkpoint import write_checksums

    write_checksums(run_dir / "global_step_1")
    return run_dir


def _pickled_payload(tmp_path: Path, marker: Path, wrap_like: str) -> bytes:
    path = tmp_path / "payload.pt"
    if wrap_like == "optimizer":  # looks like an optimizer state dict, one value is the payload
        torch.save({"state": {0: {"step": _Payload(marker)}}, "param_groups": []}, path)
    else:
        torch.save({"torch": torch.get_rng_state(), "extra": _Payload(marker)}, path)
    return path.read_bytes()


def test_the_payload_really_runs_code_when_unpickled_unsafely(tmp_path):
    """Control: with weights_only=False the payload executes (so the tests below can fail)."""
    marker = tmp_path / "marker"
    (tmp_path / "p.pt").write_bytes(_pickled_payload(tmp_path, marker, "optimizer"))
    torch.load(tmp_path / "p.pt", weights_only=False)
    assert marker.read_text() == "code ran"


@pytest.mark.parametrize(("rel", "kind"), [("backend/actor/optimizer.pt", "optimizer"), ("rng_state.pt", "rng")])
def test_checkpoint_with_a_pickled_object_is_refused_not_executed(one_step_checkpoint, tmp_path, rel, kind):
    marker = tmp_path / "marker"
    run_dir = _tampered_copy(one_step_checkpoint, tmp_path, rel, _pickled_payload(tmp_path, marker, kind))
    with pytest.raises(
        ConfigError, match=r"Refusing to resume from .*global_step_1: .*Unsupported global: GLOBAL exec"
    ) as info:
        fit(_cfg(run_dir, "trainer.total_training_steps=2"))
    assert "trainer.resume_mode=disable" in str(info.value)
    assert "weights_only=False" not in str(info.value)  # torch's advice to unpickle anyway is not passed on
    assert "safe_globals" not in str(info.value)
    assert not marker.exists()


def test_weights_file_holding_a_pickle_is_refused_not_executed(one_step_checkpoint, tmp_path):
    marker = tmp_path / "marker"
    payload = _pickled_payload(tmp_path, marker, "optimizer")
    run_dir = _tampered_copy(one_step_checkpoint, tmp_path, "backend/actor/model.safetensors", payload)
    with pytest.raises(Exception) as info:  # safetensors rejects the header; nothing is unpickled
        fit(_cfg(run_dir, "trainer.total_training_steps=2"))
    assert "safetensor" in type(info.value).__name__.lower() or "header" in str(info.value).lower()
    assert not marker.exists()


def test_untampered_checkpoint_resumes(one_step_checkpoint, tmp_path):
    """The same copy without tampering resumes fine (the refusals above are about the payload)."""
    run_dir = _tampered_copy(
        one_step_checkpoint, tmp_path, "COMPLETE", (one_step_checkpoint / "global_step_1" / "COMPLETE").read_bytes()
    )
    assert fit(_cfg(run_dir, "trainer.total_training_steps=2")) == "finished"


# ============================================================================ remote code


@pytest.fixture
def model_with_code(tmp_path) -> tuple[Path, Path]:
    """A model folder (the tiny model) whose config.json maps Auto* classes to its own module."""
    from rlplug.training.models import resolve_model_path

    tiny = Path(resolve_model_path(compose(BASE).model))
    folder, marker = tmp_path / "model_with_code", tmp_path / "code_ran"
    shutil.copytree(tiny, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "rlplug_test_custom"
    cfg["auto_map"] = {
        "AutoConfig": "custom_code.CustomConfig",
        "AutoModel": "custom_code.CustomModel",
        "AutoModelForCausalLM": "custom_code.CustomModel",
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "custom_code.py").write_text(
        f"open({str(marker)!r}, 'w').write('imported')\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "class CustomConfig(LlamaConfig):\n    model_type = 'rlplug_test_custom'\n"
        "class CustomModel(LlamaForCausalLM):\n    config_class = CustomConfig\n"
    )
    return folder, marker


def test_trust_remote_code_is_off_by_default(model_with_code, tmp_path):
    folder, marker = model_with_code
    cfg = _cfg(tmp_path / "run", "model.source=path", f"model.path={folder}", "trainer.total_training_steps=1")
    assert cfg.model.trust_remote_code is False
    with pytest.raises(ValueError, match="trust_remote_code"):
        Trainer(cfg)
    assert not marker.exists()


def test_trust_remote_code_from_config_warns(tmp_path):
    cfg = _cfg(tmp_path, "model.trust_remote_code=true", "trainer.total_training_steps=1")
    with pytest.warns(UserWarning, match="trust_remote_code=True: Python code shipped with the model"):
        trainer = Trainer(cfg)
    trainer.close()


# ============================================================================ plugin names


@pytest.fixture
def importable_module(tmp_path, monkeypatch):
    """A module on sys.path that writes a marker when imported (it must never be)."""
    marker = tmp_path / "imported"
    (tmp_path / "rlplug_test_evil_mod.py").write_text(f"open({str(marker)!r}, 'w').write('imported')\nattr = print\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield marker
    sys.modules.pop("rlplug_test_evil_mod", None)


HOSTILE_NAMES = [
    "os.system",
    "os:system",
    "builtins:exec",
    "rlplug_test_evil_mod",
    "rlplug_test_evil_mod:attr",
    "rlplug_test_evil_mod.attr",
    "rlplug.plugins.algorithms.advantage:compute_gae",
    "../../etc/passwd",
]


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_registry_never_imports_a_name(importable_module, name):
    registry = get_registry()
    for kind in KINDS:
        with pytest.raises(UnknownPluginError, match="Run 'rlplug plugins'"):
            registry.get(kind, name)
    assert not importable_module.exists() and "rlplug_test_evil_mod" not in sys.modules


CONFIG_KEYS = [
    "algorithm.adv_estimator={}",
    "actor.policy_loss={}",
    "rollout.name={}",
    "trainer.backend={}",
    "trainer.logger=[{}]",
    "reward.reward_fn_map.basic_arithmetic={}",
    "reward.default={}",
]


@pytest.mark.parametrize("key", CONFIG_KEYS)
@pytest.mark.parametrize("name", ["os.system", "rlplug_test_evil_mod:attr"])
def test_config_plugin_names_resolve_through_the_registry_only(importable_module, key, name):
    cfg = compose(BASE + [key.format(f"'{name}'")])
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    assert isinstance(info.value.__cause__, UnknownPluginError)
    assert name in str(info.value) and "Available:" in str(info.value)
    assert not importable_module.exists() and "rlplug_test_evil_mod" not in sys.modules


def test_kl_names_and_cli_refuse_import_paths(importable_module, capsys):
    for overrides in (
        ["actor.use_kl_loss=true", "actor.kl_loss_type='rlplug_test_evil_mod:attr'"],
        ["algorithm.use_kl_in_reward=true", "algorithm.kl_penalty='rlplug_test_evil_mod:attr'"],
    ):
        with pytest.raises(ConfigError, match="Unknown kl penalty 'rlplug_test_evil_mod:attr'"):
            validate_config(compose(BASE + overrides))
    from rlplug.cli import main

    assert main(["train", *BASE, "algorithm.adv_estimator='rlplug_test_evil_mod:attr'"]) == 2
    assert "Unknown advantage estimator 'rlplug_test_evil_mod:attr'" in capsys.readouterr().err
    assert not importable_module.exists() and "rlplug_test_evil_mod" not in sys.modules
