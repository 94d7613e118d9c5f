"""Leak test for multi-turn batches (issue 33): environment tokens never reach a loss, a gradient,
an advantage or a metric.

In a multi-turn batch ONE row holds a whole trajectory: the model's tokens (``response_mask`` 1)
interleaved with environment tokens (tool results, chat-template tokens the engine never sampled:
``response_mask`` 0), so the mask has interior zero spans besides the padding tail. The batch here
is hand-built the way the engine lays one out (B = 4, T = 12, two interior masked spans per row,
a padding tail on three rows, a step reward on the last model token of the first turn and the
outcome reward on the last model token, GRPO groups of two).

The pipeline run on it is the real one, function by function: the in-reward KL
(:func:`rlplug.algorithms.losses.apply_kl_penalty`), every packaged advantage estimator, the trainer's
rollout correction (:func:`rlplug.algorithms.rollout_correction.compute_rollout_correction`), the actor's
and the critic's per-micro-batch objectives that the training backends backpropagate
(:func:`rlplug.algorithms.objective.actor_objective` / ``critic_objective``, with every packaged policy
loss, the KL loss, the entropy bonus and both importance-weight paths), the critic's Monte-Carlo
targets, and the step metrics (:func:`rlplug.run.metrics.step_metrics`, ``kl_seq_sum_metrics``,
``train_generation_samples``). Then every per-token input (current, old, reference and rollout
log-probs, entropies, values, sum_pi_squared, token-level scores) is overwritten AT MASKED
POSITIONS ONLY with large random values (and, in a second pass, with NaN / +-inf), and everything
must be bitwise equal: the losses, the gradients at the model's tokens, the advantages and returns
at the model's tokens, every metric. The gradients at masked positions are exactly 0.

A second group of tests derives by hand that a step reward on an earlier turn counts: GRPO sums
it with the outcome reward, GAE (gamma 0.9, lambda 1) discounts it through the masked spans
without resetting there.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import rlplug
from rlplug.algorithms.losses import agg_normalizer, apply_kl_penalty, mc_returns
from rlplug.algorithms.objective import actor_objective, critic_objective
from rlplug.algorithms.rollout_correction import compute_rollout_correction, parse_rollout_correction
from rlplug.contracts.batch import Batch
from rlplug.contracts.types import RolloutOutput
from rlplug.run.alerts import kl_seq_sum_metrics
from rlplug.run.metrics import step_metrics, train_generation_samples

#: response_mask of the four trajectories: turn 1, an observation span, turn 2, an observation
#: span, turn 3, then padding (rows 0, 1 and 3). Row 2 ends on a model token (no padding).
MASK_ROWS = (
    (1, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 0),
    (1, 1, 0, 0, 0, 1, 1, 1, 0, 1, 0, 0),
    (1, 1, 1, 1, 0, 0, 1, 0, 0, 1, 1, 1),
    (1, 0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 0),
)
#: the attention mask of the response part: environment tokens are real (attended) tokens, only the
#: padding tail is 0 (the last model token is the end of the trajectory)
ATTENTION_ROWS = tuple(
    tuple(1 if t <= max(i for i, m in enumerate(row) if m) else 0 for t in range(12)) for row in MASK_ROWS
)
B, T, P = 4, 12, 3
INDEX = (0, 0, 1, 1)
#: the last model token of turn 1 (step reward) and of the trajectory (outcome reward)
FIRST_TURN_END = (2, 1, 3, 0)
LAST_TOKEN = (10, 9, 11, 9)
STEP_REWARD = (0.5, 0.0, 0.25, 0.5)
FINAL_REWARD = (1.0, 0.0, 0.0, 1.0)

ESTIMATORS = (
    "gae",
    "gdpo",
    "gpg",
    "grpo",
    "grpo_passk",
    "grpo_vectorized",
    "opo",
    "optimal_token_baseline",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "rloo",
    "rloo_vectorized",
    "tir_optimal_token_baseline",
)
LOSSES = (
    "bypass_mode",
    "cispo",
    "clip_cov",
    "dppo_kl",
    "dppo_tv",
    "dro",
    "dual_clip",
    "geo_mean",
    "gpg",
    "gspo",
    "kl_cov",
    "sapo",
    "vanilla",
)
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_TYPES = ("k1", "k2", "low_var_kl", "abs", "mse")

ALGORITHM = {"gamma": 0.9, "lam": 0.95, "norm_adv_by_std_in_grpo": True}
ROLLOUT_CORRECTION = {
    "rollout_is": "token",
    "rollout_is_threshold": 1.5,
    "rollout_rs": "token_k1,seq_mean_k3",
    "rollout_rs_threshold": "0.9_1.1,0.05",
}


def _actor(loss: str, *, tis: bool, kl_type: str = "low_var_kl") -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "policy_loss": loss,
        "clip_ratio": 0.2,
        "clip_ratio_c": 3.0,
        "tau_pos": 1.0,
        "tau_neg": 1.05,
        "dro_beta": 0.5,
        "entropy_coeff": 0.01,
        "use_kl_loss": True,
        "kl_loss_coef": 0.1,
        "kl_loss_type": kl_type,
        "clip_cov_ratio": 0.3,
        "kl_cov_ratio": 0.3,
    }
    if tis:
        cfg["rollout_is_threshold"] = 1.5
    if loss == "bypass_mode":
        cfg["rollout_correction"] = {**ROLLOUT_CORRECTION, "bypass_mode": True}
    return cfg


def _mask() -> torch.Tensor:
    return torch.tensor(MASK_ROWS, dtype=torch.float32)


def clean_inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    """The per-token inputs of the batch, plausible values everywhere (masked positions included)."""
    g = torch.Generator().manual_seed(seed)
    old = -2.0 * torch.rand(B, T, generator=g) - 0.05
    scores = torch.zeros(B, T)
    for i in range(B):
        scores[i, FIRST_TURN_END[i]] += STEP_REWARD[i]
        scores[i, LAST_TOKEN[i]] += FINAL_REWARD[i]
    return {
        "old_log_probs": old,
        # some ratios leave the clip range [0.8, 1.2], so every clip branch is exercised
        "log_probs": old + 0.3 * torch.randn(B, T, generator=g),
        "ref_log_probs": old + 0.1 * torch.randn(B, T, generator=g),
        "rollout_log_probs": old + 0.05 * torch.randn(B, T, generator=g),
        "entropy": 3.0 * torch.rand(B, T, generator=g),
        "values": torch.randn(B, T, generator=g),
        "new_values": torch.randn(B, T, generator=g),
        "sum_pi_squared": torch.rand(B, T, generator=g),
        "token_level_scores": scores,
    }


def corrupt(inputs: dict[str, torch.Tensor], kind: str, seed: int = 1) -> dict[str, torch.Tensor]:
    """``inputs`` with every field overwritten at the masked positions: ``"large"`` random values of
    magnitude up to 1e4, ``"nonfinite"`` NaN, +inf and -inf in turn."""
    masked = _mask() == 0
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, x in inputs.items():
        if kind == "large":
            garbage = (torch.rand(B, T, generator=g) * 2.0 - 1.0) * 1e4
        else:
            pattern = torch.tensor([math.nan, math.inf, -math.inf])
            garbage = pattern[(torch.arange(B * T) + len(key)) % 3].reshape(B, T)
        out[key] = torch.where(masked, garbage, x)
    return out


class _Tokenizer:
    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(map(str, row)) for row in ids]


def pipeline(
    inputs: dict[str, torch.Tensor],
    *,
    estimator: str = "gae",
    loss: str = "vanilla",
    mode: str = "token-mean",
    tis: bool = False,
    kl_type: str = "low_var_kl",
) -> dict[str, Any]:
    """One training step's algorithm side on the multi-turn batch; every output the step produces."""
    mask = _mask()
    kl_fn = rlplug.get_plugin("kl_penalty", kl_type)
    out: dict[str, Any] = {}
    # the reward: scores plus the in-reward KL penalty (algorithm.use_kl_in_reward)
    rewards, m = apply_kl_penalty(
        inputs["token_level_scores"], inputs["old_log_probs"], inputs["ref_log_probs"], mask, 0.05, kl_fn
    )
    out["metrics/kl_in_reward"] = m
    data = {
        "token_level_rewards": rewards,
        "response_mask": mask,
        "values": inputs["values"],
        "index": torch.tensor(INDEX),
        "reward_baselines": torch.tensor([0.5, 0.5, 0.25, 0.25]),
        "old_log_probs": inputs["old_log_probs"],
        "sum_pi_squared": inputs["sum_pi_squared"],
        "reward_components": torch.tensor([STEP_REWARD, FINAL_REWARD]).t().contiguous(),
    }
    advantages, returns = rlplug.get_plugin("advantage_estimator", estimator)(data, ALGORITHM)
    out["advantages"], out["returns"] = advantages, returns
    out["mc_returns"] = mc_returns(rewards, mask, gamma=0.9)
    # the trainer's rollout correction: token IS weights and token + sequence rejection
    tensors: dict[str, torch.Tensor] = {
        "advantages": advantages,
        "old_log_probs": inputs["old_log_probs"],
        "ref_log_probs": inputs["ref_log_probs"],
        "rollout_log_probs": inputs["rollout_log_probs"],
    }
    if tis:  # actor.rollout_is_threshold: the objective's own truncated weights, no rejection
        loss_mask = mask
    else:
        weights, loss_mask, m = compute_rollout_correction(
            inputs["old_log_probs"], inputs["rollout_log_probs"], mask, parse_rollout_correction(ROLLOUT_CORRECTION)
        )
        out["metrics/rollout_corr"] = m
        tensors["rollout_is_weights"] = weights
    out["loss_mask"] = loss_mask
    tensors["response_mask"] = loss_mask
    # the actor objective, as the training backend calls it per micro-batch
    actor_cfg = _actor(loss, tis=tis, kl_type=kl_type)
    policy_loss = rlplug.get_plugin("policy_loss", loss)
    log_probs = inputs["log_probs"].clone().requires_grad_(True)
    entropy = inputs["entropy"].clone().requires_grad_(True)
    stats = None
    if getattr(policy_loss, "minibatch_stats", None) is not None:
        stats = policy_loss.minibatch_stats(
            tensors["old_log_probs"], log_probs.detach(), advantages, loss_mask, config=actor_cfg, context=None
        )
    normalizer = agg_normalizer(loss_mask, mode)
    actor_loss, parts = actor_objective(
        log_probs,
        entropy,
        tensors,
        policy_loss=policy_loss,
        config=actor_cfg,
        loss_agg_mode=mode,
        normalizer=normalizer,
        max_response_length=T,
        kl_penalty=kl_fn,
        minibatch_stats=stats,
    )
    actor_loss.backward()
    out["actor_loss"], out["metrics/actor"] = actor_loss.detach(), parts
    out["grad/log_probs"], out["grad/entropy"] = log_probs.grad, entropy.grad
    # the critic objective
    new_values = inputs["new_values"].clone().requires_grad_(True)
    critic_loss, parts = critic_objective(
        new_values,
        {"values": inputs["values"], "returns": returns, "response_mask": mask},
        cliprange_value=0.5,
        loss_agg_mode=mode,
        normalizer=agg_normalizer(mask, mode),
        max_response_length=T,
    )
    critic_loss.backward()
    out["critic_loss"], out["metrics/critic"] = critic_loss.detach(), parts
    out["grad/values"] = new_values.grad
    # the step metrics
    response_ids = [[100 + t for t in range(T) if ATTENTION_ROWS[i][t]] for i in range(B)]
    rollout = RolloutOutput(response_ids=response_ids, finish_reasons=["stop"] * B, prompt_index=[0, 0, 1, 1])
    batch = Batch(
        {
            "response_mask": loss_mask,
            "attention_mask": torch.cat([torch.ones(B, P), torch.tensor(ATTENTION_ROWS, dtype=torch.float32)], 1),
            "token_level_rewards": rewards,
            "advantages": advantages,
            "returns": returns,
            "values": inputs["values"],
            "old_log_probs": inputs["old_log_probs"],
            "ref_log_probs": inputs["ref_log_probs"],
        }
    )
    sequence_scores = [STEP_REWARD[i] + FINAL_REWARD[i] for i in range(B)]
    out["metrics/step"] = step_metrics(
        batch,
        scores=sequence_scores,
        components={"acc": list(FINAL_REWARD)},
        rollout=rollout,
        prompt_ids=[[1, 2, 3]] * B,
        use_critic=True,
    )
    out["metrics/kl_seq_sum"] = kl_seq_sum_metrics(batch)
    rows = [{"data_source": "calc", "messages": [{"content": "q"}], "ground_truth": "1"}] * 2
    out["metrics/samples"] = {
        f"{j}/{k}": v
        for j, row in enumerate(train_generation_samples(rows, rollout, sequence_scores, batch, _Tokenizer(), B))
        for k, v in row.items()
        if isinstance(v, float)
    }
    return out


def _same_number(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def assert_no_leak(clean: dict[str, Any], dirty: dict[str, Any]) -> None:
    """Everything the step produces is bitwise equal, compared at the model's tokens; the
    gradients, advantages and returns are exactly 0 at masked positions in both runs."""
    valid = _mask() != 0
    assert torch.equal(clean["loss_mask"], dirty["loss_mask"])
    for key in ("actor_loss", "critic_loss"):
        assert torch.isfinite(clean[key]), key
        assert torch.equal(clean[key], dirty[key]), f"{key}: {clean[key]!r} != {dirty[key]!r}"
    for key in ("grad/log_probs", "grad/entropy", "grad/values", "advantages", "returns", "mc_returns"):
        a, b = clean[key], dirty[key]
        assert torch.isfinite(a).all(), key
        assert torch.equal(a[valid], b[valid]), f"{key} differs at model tokens: {a[valid] - b[valid]}"
        assert torch.equal(a[~valid], torch.zeros_like(a[~valid])), f"{key} nonzero at masked positions (clean)"
        assert torch.equal(b[~valid], torch.zeros_like(b[~valid])), f"{key} nonzero at masked positions: {b[~valid]}"
    metric_keys = sorted(k for k in clean if k.startswith("metrics/"))
    assert metric_keys == sorted(k for k in dirty if k.startswith("metrics/"))
    for group in metric_keys:
        a, b = clean[group], dirty[group]
        assert sorted(a) == sorted(b), group
        for name in a:
            assert _same_number(a[name], b[name]), f"{group} {name}: {a[name]!r} != {b[name]!r}"


@pytest.fixture(scope="module")
def inputs() -> dict[str, torch.Tensor]:
    return clean_inputs()


def test_batch_is_multi_turn() -> None:
    """The hand-built batch has what makes it multi-turn: two interior masked spans per row, a
    padding tail on three rows, environment tokens attended, rewards on model tokens only."""
    mask = _mask()
    for i, row in enumerate(MASK_ROWS):
        text = "".join(map(str, row)).rstrip("0")
        spans = [s for s in text.split("1") if s]
        assert len(spans) == 2, (i, text)
        assert row[FIRST_TURN_END[i]] == 1 and row[FIRST_TURN_END[i] + 1] == 0
        assert row[LAST_TOKEN[i]] == 1 and not any(row[LAST_TOKEN[i] + 1 :])
    assert [T - len("".join(map(str, r)).rstrip("0")) for r in MASK_ROWS] == [1, 2, 0, 2]
    assert ((torch.tensor(ATTENTION_ROWS) == 1) & (mask == 0)).sum() == 4 * 4 + 0  # 16 attended environment tokens
    assert torch.equal(clean_inputs()["token_level_scores"] * (1 - mask), torch.zeros(B, T))


def test_registered_names_are_covered() -> None:
    """Every packaged estimator and policy loss is in the lists above (a new one must be added)."""
    assert set(ESTIMATORS) <= set(rlplug.plugin_names("advantage_estimator"))
    assert set(LOSSES) <= set(rlplug.plugin_names("policy_loss"))
    from rlplug.plugins.algorithms import advantage, policy_loss

    registered: dict[str, list[str]] = {"advantage_estimator": [], "policy_loss": []}
    advantage.register_advantage_estimators(lambda name, obj, **_: registered["advantage_estimator"].append(name))
    policy_loss.register_policy_losses(lambda name, obj, **_: registered["policy_loss"].append(name))
    assert sorted(registered["advantage_estimator"]) == sorted(ESTIMATORS)
    assert sorted(registered["policy_loss"]) == sorted(LOSSES)


@pytest.mark.parametrize("kind", ["large", "nonfinite"])
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_no_leak_through_estimators(inputs, estimator: str, kind: str) -> None:
    clean = pipeline(inputs, estimator=estimator)
    assert_no_leak(clean, pipeline(corrupt(inputs, kind), estimator=estimator))


@pytest.mark.parametrize("kind", ["large", "nonfinite"])
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("loss", LOSSES)
def test_no_leak_through_policy_losses(inputs, loss: str, mode: str, kind: str) -> None:
    clean = pipeline(inputs, estimator="grpo", loss=loss, mode=mode)
    assert_no_leak(clean, pipeline(corrupt(inputs, kind), estimator="grpo", loss=loss, mode=mode))


@pytest.mark.parametrize("kind", ["large", "nonfinite"])
@pytest.mark.parametrize("loss", ["vanilla", "gspo", "dual_clip"])
@pytest.mark.parametrize("estimator", ["gae", "grpo", "rloo", "reinforce_plus_plus", "remax"])
def test_no_leak_estimator_and_loss(inputs, estimator: str, loss: str, kind: str) -> None:
    """The brief's cross product, with the objective's truncated IS weights (actor.rollout_is_threshold)."""
    for tis in (False, True):
        clean = pipeline(inputs, estimator=estimator, loss=loss, tis=tis)
        assert_no_leak(clean, pipeline(corrupt(inputs, kind), estimator=estimator, loss=loss, tis=tis))


@pytest.mark.parametrize("kind", ["large", "nonfinite"])
@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_no_leak_through_kl_estimators(inputs, kl_type: str, kind: str) -> None:
    clean = pipeline(inputs, kl_type=kl_type)
    assert_no_leak(clean, pipeline(corrupt(inputs, kind), kl_type=kl_type))


def test_the_leak_test_can_fail(inputs) -> None:
    """The comparison notices a change at a single model token (the test is not vacuous)."""
    changed = {k: v.clone() for k, v in inputs.items()}
    changed["old_log_probs"][0, 5] += 1e-3
    with pytest.raises(AssertionError):
        assert_no_leak(pipeline(inputs), pipeline(changed))
    changed = {k: v.clone() for k, v in inputs.items()}
    changed["token_level_scores"][1, 9] += 1.0
    with pytest.raises(AssertionError):
        assert_no_leak(pipeline(inputs, estimator="grpo"), pipeline(changed, estimator="grpo"))


# --------------------------------------------------------------------------- step rewards on earlier turns
def _rewards_only() -> dict[str, torch.Tensor]:
    scores = torch.zeros(B, T)
    for i in range(B):
        scores[i, FIRST_TURN_END[i]] += STEP_REWARD[i]
        scores[i, LAST_TOKEN[i]] += FINAL_REWARD[i]
    return {"token_level_rewards": scores, "response_mask": _mask(), "index": torch.tensor(INDEX)}


def test_grpo_uses_the_sum_of_step_and_outcome_rewards() -> None:
    """Sequence scores s = [1.5, 0, 0.25, 1.5]; groups {0, 1} and {2, 3} of two: mean 0.75 / 0.875,
    unbiased std 1.5 / sqrt(2) and 1.25 / sqrt(2), so a = +-(0.75 / (1.0606601... + 1e-6)) and
    +-(0.625 / (0.8838834... + 1e-6)), broadcast over the model tokens only."""
    mask = _mask()
    adv, _ = rlplug.get_plugin("advantage_estimator", "grpo")(_rewards_only(), {})
    expected = torch.tensor(
        [
            0.75 / (1.5 / math.sqrt(2) + 1e-6),
            -0.75 / (1.5 / math.sqrt(2) + 1e-6),
            -0.625 / (1.25 / math.sqrt(2) + 1e-6),
            0.625 / (1.25 / math.sqrt(2) + 1e-6),
        ]
    )
    assert torch.allclose(adv, expected.unsqueeze(-1) * mask, rtol=0, atol=1e-6)
    assert torch.equal(adv[mask == 0], torch.zeros(int((mask == 0).sum())))
    # without the step reward the scores would be [1, 0, 0, 1]: row 2 would get a negative advantage
    for name in ("rloo", "opo", "gpg", "reinforce_plus_plus_baseline"):
        adv, _ = rlplug.get_plugin("advantage_estimator", name)(_rewards_only(), {})
        assert float(adv[2, 0]) < 0 < float(adv[3, 0]), name  # 0.25 < 1.5 within group 1
        assert float(adv[0, 0]) > 0 > float(adv[1, 0]), name


def test_gae_discounts_a_step_reward_through_masked_spans() -> None:
    """Row 0, mask 111 00 11 00 11 0, step reward 0.5 at t = 2, outcome 1.0 at t = 10, values V_t = 0.1 t
    (t + 1 on masked positions, which must not matter), gamma 0.9, lambda 1.

    With lambda = 1 the GAE return is the discounted return over the model's own tokens, counted in
    model steps k (t = 0, 1, 2, 5, 6, 9, 10 are k = 0..6): G_k = sum_{j >= k} 0.9^(j - k) r_j, so
    G(t=10) = 1, G(9) = 0.9, G(6) = 0.81, G(5) = 0.729, G(2) = 0.5 + 0.9^4 = 1.1561,
    G(1) = 0.9 * 1.1561 = 1.04049, G(0) = 0.936441; the advantage before whitening is G - V."""
    mask = _mask()[:1]
    rewards = torch.zeros(1, T)
    rewards[0, 2], rewards[0, 10] = 0.5, 1.0
    t = torch.arange(T, dtype=torch.float32)
    values = torch.where(mask[0] != 0, 0.1 * t, t + 1.0).unsqueeze(0)
    data = {"token_level_rewards": rewards, "response_mask": mask, "values": values}
    adv, returns = rlplug.get_plugin("advantage_estimator", "gae")(data, {"gamma": 0.9, "lam": 1.0})
    expected = torch.zeros(1, T)
    for pos, g in {0: 0.936441, 1: 1.04049, 2: 1.1561, 5: 0.729, 6: 0.81, 9: 0.9, 10: 1.0}.items():
        expected[0, pos] = g
    assert torch.allclose(returns, expected, rtol=0, atol=1e-6)
    # the advantages are the whitened G - V over the 7 model tokens
    valid = mask != 0
    raw = (expected - values)[valid]
    whitened = (raw - raw.mean()) / torch.sqrt(raw.var(unbiased=True) + 1e-8)
    assert torch.allclose(adv[valid], whitened, rtol=0, atol=1e-5)
    assert torch.equal(adv[~valid], torch.zeros(int((~valid).sum())))
    # REINFORCE++ and the critic's Monte-Carlo targets discount the same way (no reset, no extra
    # discount across the masked spans)
    _, g = rlplug.get_plugin("advantage_estimator", "reinforce_plus_plus")(data, {"gamma": 0.9})
    assert torch.allclose(g, expected, rtol=0, atol=1e-6)
    assert torch.allclose(mc_returns(rewards, mask, gamma=0.9), expected, rtol=0, atol=1e-6)


def test_remax_and_otb_returns_carry_a_step_reward_through_masked_spans() -> None:
    """Undiscounted reward-to-go on row 0 (step 0.5 at t = 2, outcome 1 at t = 10): 1.5 up to the
    first turn's end, 1.0 on the later turns; 0 on masked positions."""
    data = _rewards_only()
    data["reward_baselines"] = torch.zeros(B)
    _, returns = rlplug.get_plugin("advantage_estimator", "remax")(data, {})
    expected = torch.tensor([1.5, 1.5, 1.5, 0, 0, 1, 1, 0, 0, 1, 1, 0])
    assert torch.equal(returns[0], expected)


def test_the_remax_baseline_of_an_episode_adds_its_environment_step_rewards() -> None:
    """ReMax's baseline is the greedy episode's return, scored as the sampled ones are: the reward's score plus the
    environment's step rewards (without them the advantages were biased up by the mean step reward)."""
    from types import SimpleNamespace

    from rlplug.contracts.types import RolloutOutput
    from rlplug.rewards.manager import FAILED
    from rlplug.run.trainer import Trainer

    greedy = RolloutOutput(
        response_ids=[[4, 5], [6], [7]],
        finish_reasons=["stop"] * 3,
        prompt_index=[0, 1, 2],
        step_rewards=[[(0, 0.5), (1, 0.25)], [], [(0, 2.0)]],
    )
    stub = SimpleNamespace(
        cfg=SimpleNamespace(data=SimpleNamespace(max_response_length=8)),
        _rollout=lambda rows, params, label: greedy,
        _score=lambda rows, out: ([1.0, 0.0, 3.0], {FAILED: [0.0, 0.0, 1.0]}, {}),
    )
    sampled = RolloutOutput(response_ids=[[1]] * 6, finish_reasons=["stop"] * 6, prompt_index=[0, 0, 1, 1, 2, 2])
    got = Trainer._baseline_scores(stub, [{}, {}, {}], [[1], [2], [3]], sampled)  # type: ignore[arg-type]
    # prompt 0: 1.0 + 0.5 + 0.25; prompt 1: 0.0; prompt 2: its score failed -> NaN (left out of training)
    assert got[:4].tolist() == [1.75, 1.75, 0.0, 0.0] and torch.isnan(got[4:]).all()
