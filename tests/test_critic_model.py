"""A separate critic model (issue 18): ``critic.model.path`` / ``critic.model.source``.

* a tiny PPO run whose critic is another tiny model (other hidden size than the actor's) trains
  that critic, checkpoints it, resumes with it, and refuses a resume with another critic model;
* unset, the critic is the actor's model (same folder, same config) and the fingerprint is unchanged;
* a critic folder whose tokenizer differs (an added token, another pad id) is a ConfigError naming
  both folders and the difference, raised before any weights load; a missing folder is an error
  at validation and at backend start;
* verl's ``critic.model.path`` maps onto ``critic.model.path``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from _helpers import TINY_CPU_RUN, run_config
from omegaconf import OmegaConf
from transformers import AutoConfig

from rlplug import models
from rlplug.config.compose import compose
from rlplug.config.schema import ConfigError, RunConfig
from rlplug.run.checkpoint import CheckpointManager, run_fingerprint
from rlplug.run.export import export_checkpoint
from rlplug.run.validate import validate_config
from rlplug.training.models import ModelPreparationError, load_tokenizer, resolve_critic_model_path, resolve_model_path

#: a critic twice as wide as debug=tiny's actor (hidden 64, intermediate 128), one layer
CRITIC_TINY = {"num_hidden_layers": 1, "hidden_size": 128, "intermediate_size": 256}
CRITIC_OVERRIDES = ["critic.model.source=tiny", *(f"critic.model.tiny.{k}={v}" for k, v in CRITIC_TINY.items())]
PPO_RUN = [*TINY_CPU_RUN, "algorithm=ppo", "trainer.critic_warmup=0", "trainer.logger=[console]"]


def _cfg(**overrides):
    """The schema's config on the tiny actor (CPU, fp32), with dotted-key ``overrides``."""
    cfg = OmegaConf.structured(RunConfig)
    cfg.model.source = "tiny"
    cfg.trainer.device = "cpu"
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg


@pytest.fixture(scope="module")
def actor_path() -> str:
    return resolve_model_path(_cfg().model)


@pytest.fixture(scope="module")
def wide_critic_path() -> str:
    """The tiny folder of :data:`CRITIC_TINY` (its tokenizer is the actor's)."""
    return str(models.tiny_model_dir({**OmegaConf.to_container(_cfg().model.tiny), **CRITIC_TINY}))


def _copy_with_tokenizer(src: str, dst: Path, edit) -> Path:
    """``src``'s config and weights in ``dst``, with ``src``'s tokenizer changed by ``edit(tokenizer)``."""
    dst.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(Path(src) / f, dst / f)
    tok = load_tokenizer(src)
    edit(tok)
    tok.save_pretrained(str(dst))
    return dst


def _fit(cfg):
    from rlplug.run.trainer import Trainer

    trainer = Trainer(cfg)
    try:
        status = trainer.fit()
        critic = trainer.backend.critic.model
        return status, critic.config.hidden_size, {k: v.detach().clone() for k, v in critic.state_dict().items()}
    finally:
        trainer.close()


# ---------------------------------------------------------------------------- a critic of another size


def test_a_wider_critic_trains_checkpoints_and_resumes(tmp_path, wide_critic_path):
    initial = models.load_value_model(wide_critic_path).state_dict()
    cfg = run_config([*PPO_RUN, *CRITIC_OVERRIDES], tmp_path, "trainer.total_training_steps=1")
    status, hidden, trained = _fit(cfg)
    assert status == "finished" and hidden == 128  # the actor is 64 wide
    assert trained["value_head.weight"].shape == (1, 128)
    changed = [k for k in initial if not torch.equal(initial[k], trained[k])]
    assert "value_head.weight" in changed and any(k.startswith("backbone.") for k in changed)

    ckpt = CheckpointManager(tmp_path).latest()
    # rlplug export writes the actor (64 wide), not the critic
    exported = export_checkpoint(tmp_path, tmp_path / "export")
    assert AutoConfig.from_pretrained(exported).hidden_size == 64
    fp = run_fingerprint(cfg)["critic.model"]
    assert (fp["source"], fp["path"], fp["tiny"]["hidden_size"]) == ("tiny", None, 128)

    # resume one more step: the 128-wide critic state loads into the 128-wide critic
    cfg2 = run_config([*PPO_RUN, *CRITIC_OVERRIDES], tmp_path, "trainer.total_training_steps=2")
    status2, hidden2, _ = _fit(cfg2)
    assert status2 == "finished" and hidden2 == 128
    assert CheckpointManager(tmp_path).complete_steps()[-1] == 2 and ckpt is not None

    # the actor's model as the critic is another run: refused on resume, naming critic.model
    cfg3 = run_config([*PPO_RUN], tmp_path, "trainer.total_training_steps=3")
    with pytest.raises(ConfigError, match=r"another run.*\n  critic\.model: \{.*\} -> null"):
        _fit(cfg3)


def test_critic_model_path_to_another_folder_is_loaded(wide_critic_path, actor_path):
    from rlplug.plugins.training.local import LocalTrainingBackend

    cfg = _cfg(**{"critic.model.path": wide_critic_path})
    backend = LocalTrainingBackend(cfg, actor_path, use_critic=True, use_ref=False, total_steps=1)
    try:
        assert backend.critic_model_path == str(Path(wide_critic_path).resolve())
        assert backend.critic.model.config.hidden_size == 128
        assert backend.actor.model.config.hidden_size == 64
    finally:
        backend.close()


# ---------------------------------------------------------------------------- the default


def test_without_critic_model_the_critic_is_the_actors_model(actor_path):
    from rlplug.plugins.training.local import LocalTrainingBackend

    cfg = _cfg()
    assert cfg.critic.model.path is None and cfg.critic.model.source is None
    backend = LocalTrainingBackend(cfg, actor_path, use_critic=True, use_ref=False, total_steps=1)
    try:
        assert backend.critic_model_path == actor_path
        critic_cfg, actor_cfg = backend.critic.model.config.to_dict(), backend.actor.model.model.config.to_dict()
        assert actor_cfg.pop("use_cache") is False  # the backend turns the actor's generation cache off
        assert {k: v for k, v in critic_cfg.items() if k != "use_cache"} == actor_cfg
        assert (critic_cfg["hidden_size"], critic_cfg["num_hidden_layers"]) == (64, 2)
        actor_sd = backend.actor.model.model.state_dict()
        critic_sd = backend.critic.model.backbone.state_dict()
        assert set(critic_sd) == set(actor_sd) and all(torch.equal(critic_sd[k], actor_sd[k]) for k in actor_sd)
    finally:
        backend.close()
    # the actor's own folder given as critic.model.path is the default too; the fingerprint is unchanged
    assert resolve_critic_model_path(_cfg(**{"critic.model.path": actor_path}), actor_path) == actor_path
    assert run_fingerprint(compose([]))["critic.model"] is None
    fp = run_fingerprint(compose(["critic.model.path=/models/critic"]))["critic.model"]
    assert fp == {"source": None, "path": "/models/critic", "tiny": None}


# ---------------------------------------------------------------------------- bad input


def test_a_critic_with_an_added_token_is_refused_before_any_weights_load(tmp_path, actor_path, monkeypatch):
    from rlplug.plugins.training.local import LocalTrainingBackend

    critic = _copy_with_tokenizer(actor_path, tmp_path / "critic", lambda t: t.add_tokens(["<critic_extra>"]))

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were loaded before the tokenizer check")

    monkeypatch.setattr(models, "load_causal_lm", no_weights)
    monkeypatch.setattr(models, "load_value_model", no_weights)
    cfg = _cfg(**{"critic.model.path": str(critic)})
    with pytest.raises(ConfigError) as err:
        LocalTrainingBackend(cfg, actor_path, use_critic=True, use_ref=False, total_steps=1)
    msg = str(err.value)
    assert str(critic) in msg and actor_path in msg
    # SmolLM2's vocabulary: 49,152 tokens; the critic's one more, at id 49,152
    assert "vocabulary sizes 49152 (actor) and 49153 (critic)" in msg
    assert "1 token(s) only in the critic's, e.g. ['<critic_extra>']" in msg


def test_a_critic_with_another_pad_token_is_refused(tmp_path, actor_path):
    def pad_endoftext(tok):
        tok.pad_token = "<|endoftext|>"  # id 0; SmolLM2's pad is <|im_end|>, id 2

    critic = _copy_with_tokenizer(actor_path, tmp_path / "critic", pad_endoftext)
    with pytest.raises(ConfigError, match=r"pad_token_id 2 \(actor\) vs 0 \(critic\)"):
        resolve_critic_model_path(_cfg(**{"critic.model.path": str(critic)}), actor_path)


def test_a_missing_critic_folder_is_an_error(tmp_path, actor_path):
    missing = tmp_path / "no-such-critic"
    cfg = compose(["algorithm=ppo", f"critic.model.path={missing}"])
    with pytest.raises(ConfigError, match=rf"critic\.model\.path '{missing}' is not an existing folder"):
        validate_config(cfg)
    validate_config(compose(["algorithm=grpo", f"critic.model.path={missing}"]))  # no critic: not used
    with pytest.raises(ModelPreparationError, match=r"critic\.model\.path .* is not an existing folder"):
        resolve_critic_model_path(_cfg(**{"critic.model.path": str(missing)}), actor_path)
    with pytest.raises(ConfigError, match=r"critic\.model\.path .* has no config\.json"):
        validate_config(compose(["algorithm=ppo", f"critic.model.path={tmp_path}"]))
    with pytest.raises(ConfigError, match=r"Unknown critic\.model\.source 'huge'"):
        validate_config(compose(["algorithm=ppo", "critic.model.source=huge"]))
    with pytest.raises(ConfigError, match=r"critic\.model\.path=.* and critic\.model\.source=tiny"):
        validate_config(compose(["algorithm=ppo", "critic.model.source=tiny", f"critic.model.path={tmp_path}"]))
    with pytest.raises(ConfigError, match=r"critic\.model\.source=path needs critic\.model\.path"):
        validate_config(compose(["algorithm=ppo", "critic.model.source=path"]))


def test_a_schedule_phase_may_not_change_the_critic_model():
    phases = "algorithm.schedule=[{until:1,algorithm:grpo,overrides:{critic.model.source:tiny}},{algorithm:ppo}]"
    with pytest.raises(
        ConfigError, match=r"phase 1/2, grpo\): critic\.model\.source='tiny' .* set once for the whole run"
    ):
        validate_config(compose(["debug=tiny", phases]))


# ---------------------------------------------------------------------------- verl's key


def test_verls_critic_model_path_maps():
    cfg = compose(["actor_rollout_ref.model.path=/m", "critic.model.path=/c"])
    assert cfg.model.path == "/m" and cfg.critic.model.path == "/c"
    with pytest.raises(ConfigError, match=r"critic\.model\.tokenizer_path=/c: .*drop critic\.model\.tokenizer_path"):
        compose(["critic.model.tokenizer_path=/c"])
