"""The conformance kits of ``rlplug.testing`` run on every packaged plugin, and they catch plugins
that break the contract (a kit that nothing can fail would not be a test)."""

from __future__ import annotations

import pytest
import torch

import rlplug
from rlplug.algorithms.losses import agg_loss, masked_mean
from rlplug.contracts.registry import get_registry
from rlplug.contracts.types import AdvantageEstimator, KLPenalty, PolicyLoss
from rlplug.testing import (
    algorithm_config,
    check_advantage_estimator,
    check_batch_filter,
    check_kl_penalty,
    check_policy_loss,
    check_protocol,
    check_reward_function,
    check_rollout_backend,
    check_tracker,
    check_training_backend,
    make_batch,
)


def _names(kind: str) -> list[str]:
    return get_registry().names(kind)


# ============================================================================ packaged plugins


@pytest.mark.parametrize("name", _names("advantage_estimator"))
@pytest.mark.parametrize("norm", [True, False])
def test_packaged_advantage_estimators(name, norm):
    check_advantage_estimator(name, algorithm_config(norm_adv_by_std_in_grpo=norm, gamma=0.9, lam=0.8))


@pytest.mark.parametrize("name", _names("policy_loss"))
def test_packaged_policy_losses(name):
    from omegaconf import OmegaConf

    from rlplug.config.schema import ActorConfig

    # rlplug's defaults, plus the one hyperparameter without a default (dro's, verl's dro_beta: null)
    check_policy_loss(name, OmegaConf.structured(ActorConfig(dro_beta=0.1)))


@pytest.mark.parametrize("name", _names("kl_penalty"))
def test_packaged_kl_penalties(name):
    check_kl_penalty(name)


@pytest.mark.parametrize("name", _names("batch_filter"))
def test_packaged_batch_filters(name):
    check_batch_filter(name)


RG_EXTRA = {"rg_task": "basic_arithmetic", "question": "Calculate 1 + 2.", "answer": "3"}
REWARD_CASES = {
    "reasoning_gym": [
        ("basic_arithmetic", "#### 3", "3", RG_EXTRA),
        ("basic_arithmetic", "", "3", RG_EXTRA),
        ("basic_arithmetic", "#### \u2212\u00bd \U0001f600", "3", RG_EXTRA),
    ],
}


#: reward functions that need a server or a model to score: their file runs the kit with one
KIT_ELSEWHERE = {
    "judge": "tests/test_judge.py runs it against a fake OpenAI-compatible server",
    "reward_model": "tests/test_reward_model.py runs it with a tiny sequence-classification model",
}


@pytest.mark.parametrize("name", _names("reward_function"))
def test_packaged_reward_functions(name):
    if name in KIT_ELSEWHERE:
        pytest.skip(KIT_ELSEWHERE[name])
    check_reward_function(name, REWARD_CASES.get(name))


@pytest.mark.parametrize("kind", ["rollout_backend", "training_backend", "tracker"])
def test_packaged_factories_build_conforming_classes(kind):
    reg = get_registry()
    for name in reg.names(kind):
        r = reg.registration(kind, name)
        kit = {
            "rollout_backend": check_rollout_backend,
            "training_backend": check_training_backend,
            "tracker": check_tracker,
        }[kind]
        kit(r.obj, builds=r.extra.get("builds"))


@pytest.fixture(scope="module")
def tiny_model_path() -> str:
    from rlplug.config.schema import TinyModelConfig
    from rlplug.training.models import tiny_model_dir

    return str(tiny_model_dir(TinyModelConfig()))


def test_hf_rollout_instance_passes_the_kit(tiny_model_path):
    from rlplug.config.compose import compose
    from rlplug.plugins.rollout.hf import HFRollout
    from rlplug.training.models import load_tokenizer

    cfg = compose(["model=tiny", "rollout.dtype=fp32", "trainer.seed=3"])
    torch.set_num_threads(1)
    check_rollout_backend(HFRollout(cfg, tiny_model_path, load_tokenizer(tiny_model_path)), max_tokens=4, n=2)


def test_local_training_backend_instance_passes_the_kit(tiny_model_path):
    from omegaconf import OmegaConf

    from rlplug.config.schema import RunConfig
    from rlplug.contracts.batch import Batch
    from rlplug.plugins.training.local import LocalTrainingBackend

    cfg = OmegaConf.structured(RunConfig)
    cfg.model.source, cfg.model.compute_dtype, cfg.trainer.device = "tiny", "fp32", "cpu"
    cfg.data.train_batch_size, cfg.data.max_response_length, cfg.rollout.n = 2, 4, 2
    cfg.actor.ppo_mini_batch_size, cfg.actor.micro_batch_size_per_device, cfg.actor.optim.lr = 2, 2, 1e-2
    backend = LocalTrainingBackend(cfg, tiny_model_path, use_critic=False, use_ref=False, total_steps=2)
    # 4 responses of lengths 4, 2, 1, 3 after left-padded prompts of lengths 3, 3, 2, 2
    P, T = 3, 4
    ids = torch.full((4, P + T), 2, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, (p, r) in enumerate([(3, 4), (3, 2), (2, 1), (2, 3)]):
        ids[i, P - p : P + r] = torch.arange(10 + i, 10 + i + p + r)
        attn[i, P - p : P + r] = 1
    mask = (torch.arange(T)[None] < torch.tensor([4, 2, 1, 3])[:, None]).float()
    batch = Batch(
        {
            "input_ids": ids,
            "attention_mask": attn,
            "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, P:],
            "response_mask": mask,
        }
    )
    try:
        check_training_backend(backend, batch=batch)
    finally:
        backend.close()


@pytest.mark.parametrize("name", ["console", "mlflow"])
def test_packaged_tracker_instances_pass_the_kit(name, tmp_path, monkeypatch):
    from rlplug.config.compose import compose

    monkeypatch.chdir(tmp_path)
    cfg = compose(["debug=tiny", f"trainer.default_local_dir={tmp_path / 'run'}"])
    artifact = tmp_path / "notes.txt"
    artifact.write_text("hello")
    check_tracker(get_registry().get("tracker", name)(cfg), artifact=artifact)


# ============================================================================ the kits catch bad plugins


def test_estimator_kit_catches_padding_and_dtype_errors():
    def leaky(data, config):  # whitened rewards everywhere, padding included
        r = data["token_level_rewards"]
        return r - r.mean(), r - r.mean()

    with pytest.raises(AssertionError, match="must be exactly 0.0 where response_mask is 0"):
        check_advantage_estimator(AdvantageEstimator(leaky))

    def half(data, config):
        r = data["token_level_rewards"].half()
        return r, r

    with pytest.raises(AssertionError, match="dtype torch.float16, expected torch.float32"):
        check_advantage_estimator(AdvantageEstimator(half))

    def nan_on_equal(data, config):  # divides by the spread, which is 0 for all-equal rewards
        r = data["token_level_rewards"]
        m = data["response_mask"]
        scores = (r * m).sum(-1)
        adv = ((scores - scores.mean()) / (scores.std() - scores.std().detach()))[:, None] * m
        return adv, adv

    with pytest.raises(AssertionError, match="non-finite values"):
        check_advantage_estimator(AdvantageEstimator(nan_on_equal))


def _per_micro_batch_mean(
    old_log_probs,
    log_probs,
    advantages,
    response_mask,
    *,
    config,
    loss_agg_mode,
    normalizer,
    max_response_length=None,
    rollout_is_weights=None,
):
    # verl's old default: each micro-batch normalised by its own token count
    per_token = -advantages * torch.exp(log_probs - old_log_probs)
    if rollout_is_weights is not None:
        per_token = per_token * rollout_is_weights
    return masked_mean(per_token, response_mask), {"pg_clipfrac": 0.0, "pg_clipfrac_lower": 0.0, "ppo_kl": 0.0}


def _ignores_weights(
    old_log_probs,
    log_probs,
    advantages,
    response_mask,
    *,
    config,
    loss_agg_mode,
    normalizer,
    max_response_length=None,
    rollout_is_weights=None,
):
    per_token = -advantages * torch.exp(log_probs - old_log_probs)
    loss = agg_loss(per_token, response_mask, loss_agg_mode, normalizer, max_response_length)
    return loss, {"pg_clipfrac": 0.0, "pg_clipfrac_lower": 0.0, "ppo_kl": 0.0}


def test_policy_loss_kit_catches_micro_batch_dependence_and_ignored_weights():
    with pytest.raises(AssertionError, match="two micro-batches with the mini-batch's normalizer give"):
        check_policy_loss(PolicyLoss(_per_micro_batch_mean), modes=["token-mean"])
    with pytest.raises(AssertionError, match="rollout_is_weights of 0.0 left a loss"):
        check_policy_loss(PolicyLoss(_ignores_weights), modes=["token-mean"])

    def no_metrics(*args, **kwargs):
        loss, _ = _ignores_weights(*args, **kwargs)
        return loss, {}

    with pytest.raises(AssertionError, match="metrics lack 'pg_clipfrac'"):
        check_policy_loss(PolicyLoss(no_metrics), modes=["token-mean"])


def test_kl_kit_catches_nonzero_self_kl():
    with pytest.raises(AssertionError, match="KL of a policy with itself must be 0"):
        check_kl_penalty(KLPenalty(lambda lp, ref: (lp - ref) ** 2 + 0.1))


def test_reward_kit_catches_bad_scores_and_unpicklable_functions():
    def no_score(data_source, solution_str, ground_truth, extra_info=None):
        return {"acc": 1.0}

    with pytest.raises(AssertionError, match="a dict result needs a 'score' key"):
        check_reward_function(no_score)

    def text_score(data_source, solution_str, ground_truth, extra_info=None):
        return "1.0"

    with pytest.raises(AssertionError, match="the score must be a float, got str"):
        check_reward_function(text_score)

    closure = lambda data_source, solution_str, ground_truth, extra_info=None: 1.0  # noqa: E731
    with pytest.raises(AssertionError, match="cannot be pickled"):
        check_reward_function(closure)
    check_reward_function(closure, picklable=False)


def test_protocol_kit_on_a_factory_class():
    class Tracker:
        def log_params(self, params): ...
        def log_metrics(self, metrics, step): ...  # noqa: E704
        def log_table(self, name, rows, step): ...  # noqa: E704
        def close(self, status="FINISHED"): ...  # noqa: E704

    with pytest.raises(AssertionError, match=r"Tracker has no method log_artifact\(\)"):
        check_protocol("tracker", Tracker)
    Tracker.log_artifact = lambda self, path, artifact_path=None: None
    check_protocol("tracker", Tracker)
    check_tracker(Tracker())


def test_make_batch_extra_fields():
    data = make_batch(batch_size=4, response_length=5, group_size=2, seed=0)
    mask = data["response_mask"]
    assert data["reward_components"].shape == (4, 2)
    assert torch.equal(data["reward_components"][:, 0], data["scores"])
    assert bool((data["sum_pi_squared"][mask > 0] > 0).all() and (data["sum_pi_squared"] <= 1).all())
    assert bool((data["entropy"][mask == 0] == 0).all() and (data["entropy"][mask > 0] > 0).all())
    assert rlplug.testing.REWARD_COMPONENT_NAMES == ("acc", "format")
