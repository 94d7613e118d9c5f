"""rlplug.config.schema.typed: a config section read as the schema's dataclass, defaults from the schema."""

from __future__ import annotations

from types import SimpleNamespace

from omegaconf import OmegaConf

from rlplug.config.schema import ActorConfig, OptimConfig, RunConfig, config_get, typed


def test_a_partial_mapping_takes_the_schema_defaults_and_none_means_absent() -> None:
    actor = typed(ActorConfig, {"clip_ratio": 0.3, "clip_ratio_c": None, "optim": {"lr": 5e-5}, "unknown": 1})
    assert isinstance(actor, ActorConfig) and isinstance(actor.optim, OptimConfig)
    assert actor.clip_ratio == 0.3
    assert actor.clip_ratio_c == ActorConfig.clip_ratio_c == 3.0  # None: the schema's default, as config_get
    assert actor.optim.lr == 5e-5 and actor.optim.weight_decay == OptimConfig().weight_decay
    assert not hasattr(actor, "unknown")


def test_it_agrees_with_config_get_on_the_composed_run_config() -> None:
    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), {"actor": {"clip_ratio_low": 0.1, "optim": {"lr": 2e-6}}})
    actor = typed(ActorConfig, cfg.actor)
    for key in ("clip_ratio", "clip_ratio_low", "ppo_epochs", "loss_agg_mode", "optim.lr", "optim.betas"):
        want = config_get(cfg.actor, key)
        got = actor
        for part in key.split("."):
            got = getattr(got, part)
        assert got == want, key


def test_other_inputs() -> None:
    assert typed(OptimConfig, None) == OptimConfig()
    assert typed(OptimConfig, SimpleNamespace(lr=0.5)).lr == 0.5
    same = OptimConfig(lr=1.0)
    assert typed(OptimConfig, same) is same


def test_a_bare_structured_section_whose_interpolation_points_outside_it_takes_the_default() -> None:
    bare = OmegaConf.structured(ActorConfig)  # rollout_correction: ${algorithm.rollout_correction}
    actor = typed(ActorConfig, bare)
    assert actor.clip_ratio == 0.2 and actor.rollout_correction == ActorConfig.rollout_correction
