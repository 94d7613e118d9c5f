"""verl's further advantage estimators as rlplug plugins (issue 16): opo, grpo_passk, gpg, gdpo,
optimal_token_baseline, tir_optimal_token_baseline, and the names grpo_vectorized / rloo_vectorized.

Hand-derived values (derivations in the comments), a naive per-group reference for the optimal
token baseline on real ``sum_pi_squared`` values (from :func:`rlplug.algorithms.logprob.token_stats_from_hidden`,
the training backend's producer), properties (padding exactly 0, singleton groups 0, finite on
all-equal and single-token groups, groups of unequal size in any order), GDPO's config and
first-step errors, and the conformance kit on each estimator.
"""

from __future__ import annotations

import math

import pytest
import torch
from _helpers import fp32_atol

import rlplug
from rlplug.config.compose import compose
from rlplug.config.schema import ConfigError
from rlplug.contracts.batch import Fields
from rlplug.contracts.types import AdvantageEstimator
from rlplug.run.validate import validate_config
from rlplug.testing import REWARD_COMPONENT_NAMES, algorithm_config, check_advantage_estimator, make_batch

NEW = ["opo", "grpo_passk", "gpg", "gdpo", "optimal_token_baseline", "tir_optimal_token_baseline"]
ALIASES = {"grpo_vectorized": "grpo", "rloo_vectorized": "rloo"}
OTB = ["optimal_token_baseline", "tir_optimal_token_baseline"]

pytestmark = pytest.mark.numerics

# Float tolerances: the estimators compute their group statistics in float64 and round the result to
# float32 once, so the hand values keep small absolute tolerances (above that rounding). Where a
# float32 chain runs (log-probs from logits, whitening over the batch), the tolerance comes from
# rlplug.testing.reduction_tolerance: the terms summed plus OPS elementwise operations.
OPS = 5


def est(name):
    return rlplug.get_plugin("advantage_estimator", name)


def outcome(scores, lengths, index, T=None):
    """A batch with each row's score on its last valid token (right-padded masks)."""
    T = T or max(lengths)
    B = len(scores)
    mask = (torch.arange(T).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).float()
    rewards = torch.zeros(B, T)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        if n:
            rewards[i, n - 1] = s
    return {"token_level_rewards": rewards, "response_mask": mask, "index": torch.tensor(index)}


def close(x, expected, atol=1e-6):
    want = torch.tensor(expected, dtype=torch.float64)
    assert torch.allclose(x.double(), want, atol=atol), f"{x.tolist()} != {want.tolist()}"


def per_row(adv):
    """The value each row carries (outcome estimators broadcast one value over the valid tokens)."""
    return adv[:, 0].tolist()


# ------------------------------------------------------------------ hand-derived values
def test_opo_length_weighted_baseline():
    # group 0: lengths L = [1, 2, 3], scores s = [1, 0, 2]
    #   b = (1*1 + 2*0 + 3*2) / (1 + 2 + 3) = 7/6; a = s - b = [-1/6, -7/6, 5/6]
    # group 1 is a singleton: 0 (verl would give it s = 4)
    data = outcome([1.0, 0.0, 2.0, 4.0], [1, 2, 3, 2], [0, 0, 0, 1])
    adv, ret = est("opo")(data, algorithm_config())
    assert per_row(adv) == pytest.approx([-1 / 6, -7 / 6, 5 / 6, 0.0], abs=1e-6)
    assert adv[1].tolist() == pytest.approx([-7 / 6, -7 / 6, 0.0], abs=1e-6)  # broadcast, 0 on padding
    assert torch.equal(adv, ret)
    # equal lengths: the baseline is the plain mean (= GRPO without std): [1, 0, 2] -> mean 1
    same = outcome([1.0, 0.0, 2.0], [2, 2, 2], [0, 0, 0])
    assert per_row(est("opo")(same, None)[0]) == pytest.approx([0.0, -1.0, 1.0], abs=1e-6)


def test_grpo_passk_only_the_best_gets_its_margin():
    # group 0: s = [1, 3, 2, 0]; best = row 1 (3), second best 2, margin 1
    #   unbiased std: mean 1.5, squares .25 + 2.25 + .25 + 2.25 = 5, var 5/3, std 1.2909944
    #   a_best = 1 / (1.2909944 + 1e-6) = 0.7745963; every other row 0
    # group 1: s = [2, 0, 2] (a tie for the best): margin 0, all 0; group 2 singleton: 0
    data = outcome([1.0, 3.0, 2.0, 0.0, 2.0, 0.0, 2.0, 5.0], [2, 3, 1, 2, 3, 3, 1, 2], [0, 0, 0, 0, 1, 1, 1, 2])
    adv, ret = est("grpo_passk")(data, algorithm_config())
    std = math.sqrt(5 / 3)
    assert per_row(adv) == pytest.approx([0.0, 1 / (std + 1e-6), 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], abs=1e-6)
    assert adv[1].tolist() == pytest.approx([1 / (std + 1e-6)] * 3, abs=1e-6)
    assert torch.equal(adv, ret)
    raw, _ = est("grpo_passk")(data, algorithm_config(norm_adv_by_std_in_grpo=False))
    assert per_row(raw) == pytest.approx([0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], abs=1e-6)


def test_gpg_alpha_over_nonzero_scores():
    # groups A = [1, 0], B = [0, 0, 3], C = [4] (singleton); B = 6 rows, 3 non-zero scores: alpha = 2
    #   A: mean 0.5 -> 2 * [0.5, -0.5] = [1, -1]; B: mean 1 -> 2 * [-1, -1, 2] = [-2, -2, 4]; C: 0
    data = outcome([1.0, 0.0, 0.0, 0.0, 3.0, 4.0], [1, 2, 2, 1, 2, 2], [0, 0, 1, 1, 1, 2])
    adv, ret = est("gpg")(data, algorithm_config())
    assert per_row(adv) == pytest.approx([1.0, -1.0, -2.0, -2.0, 4.0, 0.0], abs=1e-6)
    assert torch.equal(adv, ret)
    # all scores 0: alpha = B / max(1, 0) and every centred score is 0
    zero = outcome([0.0] * 4, [1, 2, 1, 2], [0, 0, 1, 1])
    assert torch.equal(est("gpg")(zero, None)[0], torch.zeros(4, 2))


def gdpo_data():
    # 2 groups of 2, T = 2, every token valid (so the batch whitening sees each row twice)
    data = outcome([0.0] * 4, [2, 2, 2, 2], [0, 0, 1, 1])
    comps = torch.tensor([[1.0, 1.0, 0.2], [0.0, 0.0, 0.4], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    return Fields({**data, "reward_components": comps}, {"reward_components": ("acc", "format", "shaping/x")})


def test_gdpo_normalises_each_component_then_whitens():
    # keys acc (weight 1) and shaping/* (weight 0.5); format is not chosen.
    # acc: group 0 [1, 0]: mean .5, unbiased std sqrt(.5) -> [+1/sqrt2, -1/sqrt2]; group 1 [1, 1] -> 0
    # shaping/x: group 0 [.2, .4]: mean .3, std sqrt(.02) -> [-1/sqrt2, +1/sqrt2]; group 1 [0, 0] -> 0
    # sum: [1/sqrt2 - .5/sqrt2, -(...), 0, 0] = [0.35355, -0.35355, 0, 0]
    # whiten over the 8 valid tokens: mean 0, unbiased var = 4 * 0.125 / 7 = 1/14
    #   -> +-0.35355 * sqrt(14) = +-sqrt(7)/2 = +-1.3228757 (the 1e-6 and 1e-8 terms are below 1e-5)
    cfg = algorithm_config(gdpo_reward_keys=["acc", "shaping/*"], gdpo_reward_weights=[1.0, 0.5])
    adv, ret = est("gdpo")(gdpo_data(), cfg)
    h = math.sqrt(7) / 2
    close(adv, [[h, h], [-h, -h], [0.0, 0.0], [0.0, 0.0]], atol=1e-5)
    assert torch.equal(adv, ret)
    # equal weights and the format column too: format group 0 [1, 0] -> [+1/sqrt2, -1/sqrt2],
    # group 1 [0, 1] -> [-1/sqrt2, +1/sqrt2]; sum [1/sqrt2, -1/sqrt2, -1/sqrt2, 1/sqrt2]
    # (acc and shaping cancel in group 0); whitened: each +-1/sqrt2 / sqrt(8 * .5 / 7) = +-sqrt(7/8)
    cfg = algorithm_config(gdpo_reward_keys=["acc", "format", "shaping/x"])
    adv, _ = est("gdpo")(gdpo_data(), cfg)
    q = math.sqrt(7 / 8)
    assert per_row(adv) == pytest.approx([q, -q, -q, q], abs=1e-5)


def test_gdpo_without_keys_is_grpo_whitened():
    # verl's fallback when the function gets no keys: the one component is the sequence score
    data = make_batch(batch_size=8, response_length=5, group_size=4, seed=4, scores="normal")
    grpo, _ = est("grpo")(data, algorithm_config())
    adv, _ = est("gdpo")(data, algorithm_config())
    from rlplug.algorithms.losses import masked_whiten

    # whitened in float32 over the batch's tokens in another order: their sum at the values' magnitude
    want = masked_whiten(grpo, data["response_mask"])
    torch.testing.assert_close(adv, want, rtol=0, atol=fp32_atol(want.numel() + OPS, want))


def test_gdpo_errors_name_the_components():
    data = gdpo_data()
    with pytest.raises(ValueError, match=r"'correctness'.*Components this step: \['acc', 'format', 'shaping/x'\]"):
        est("gdpo")(data, algorithm_config(gdpo_reward_keys=["correctness"]))
    with pytest.raises(ValueError, match="no named 'reward_components'"):
        est("gdpo")(dict(data), algorithm_config(gdpo_reward_keys=["acc"]))
    nan = Fields({**data, "reward_components": data["reward_components"].clone()}, data.columns)
    nan["reward_components"][2, 1] = float("nan")
    with pytest.raises(ValueError, match=r"\['format'\] are NaN for 1 of 4 responses"):
        est("gdpo")(nan, algorithm_config(gdpo_reward_keys=["acc", "format"]))
    with pytest.raises(ValueError, match="2 weights for 1 gdpo_reward_keys"):
        est("gdpo")(data, algorithm_config(gdpo_reward_keys=["acc"], gdpo_reward_weights=[1.0, 2.0]))


def test_gdpo_config_errors_before_any_model_loads():
    cfg = compose(["algorithm=grpo", "algorithm.adv_estimator=gdpo"])
    with pytest.raises(ConfigError, match=r"algorithm.adv_estimator=gdpo: .*needs algorithm.gdpo_reward_keys"):
        validate_config(cfg)
    cfg = compose(["algorithm=gdpo", "algorithm.gdpo_reward_weights=[1.0,2.0]"])
    with pytest.raises(ConfigError, match="2 weights for 3 gdpo_reward_keys"):
        validate_config(cfg)
    validate_config(compose(["algorithm=gdpo"]))


def test_gdpo_preset_keys_exist_in_the_default_and_tiny_rewards():
    # the preset's keys (correctness, format, shaping/*) against what the two rewards really report
    from rlplug.rewards.manager import RewardManager, components_tensor

    rows = [{"data_source": "basic_arithmetic", "ground_truth": "7"}] * 2
    for overrides in ([], ["debug=tiny"]):
        cfg = compose(["algorithm=gdpo", *overrides])
        _, extra, _ = RewardManager(cfg.reward).score(rows, ["#### 7", "8"])
        comps, names = components_tensor(extra, 2)
        data = Fields({**outcome([0.0, 0.0], [1, 1], [0, 0]), "reward_components": comps}, {"reward_components": names})
        adv, _ = est("gdpo")(data, cfg.algorithm)
        assert torch.isfinite(adv).all() and adv[0, 0] > 0 > adv[1, 0], overrides  # the right answer wins


def test_otb_hand_values_with_zero_tail():
    # one group of 2, T = 3. pi = 0.5 everywhere, so w = 1 - 2*0.5 + sum_pi_squared = sum_pi_squared.
    # row 0: length 3, score 1 at t=2: G = [1, 1, 1]; w = [.5, .5, .5] -> W = [.5, 1, 1.5]
    # row 1: length 2, score 2 at t=1: G = [2, 2, -]; w = [1, .5]     -> W = [1, 1.5]
    # t=0: B = (1*.5 + 2*1) / (.5 + 1) = 5/3;  t=1: B = (1*1 + 2*1.5) / (1 + 1.5) = 1.6
    # t=2: row 0 is strictly the longest (3 > 2): zero tail, B = 0
    # A row 0 = [1 - 5/3, 1 - 1.6, 1] = [-2/3, -0.6, 1]; row 1 = [2 - 5/3, 2 - 1.6, 0] = [1/3, 0.4, 0]
    data = outcome([1.0, 2.0], [3, 2], [0, 0])
    data["old_log_probs"] = torch.log(torch.full((2, 3), 0.5)) * data["response_mask"]
    data["sum_pi_squared"] = torch.tensor([[0.5, 0.5, 0.5], [1.0, 0.5, 0.0]])
    for name in OTB:  # no gaps in the masks: both variants agree
        adv, ret = est(name)(data, algorithm_config())
        close(adv, [[-2 / 3, -0.6, 1.0], [1 / 3, 0.4, 0.0]])
        close(ret, [[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]])


def test_tir_otb_aligns_by_valid_token():
    # the test above with a tool-output gap at t=1 of row 0 (mask [1, 0, 1, 1], a reward of 9 in
    # the gap is ignored): aligned by valid token, row 0's tokens are k = 0, 1, 2 as before, so the
    # TIR advantages are the same numbers placed at t = 0, 2, 3. optimal_token_baseline aligns by t
    # instead: at t=1 only row 1 is valid (B = G, A = 0), at t=0 it is unchanged.
    data = outcome([1.0, 2.0], [4, 2], [0, 0])
    data["response_mask"][0, 1] = 0.0
    data["token_level_rewards"][0, 1] = 9.0
    data["old_log_probs"] = torch.log(torch.full((2, 4), 0.5))
    data["sum_pi_squared"] = torch.tensor([[0.5, 7.0, 0.5, 0.5], [1.0, 0.5, 0.0, 0.0]])
    adv, ret = est("tir_optimal_token_baseline")(data, algorithm_config())
    close(adv, [[-2 / 3, 0.0, -0.6, 1.0], [1 / 3, 0.4, 0.0, 0.0]])
    close(ret, [[1.0, 0.0, 1.0, 1.0], [2.0, 2.0, 0.0, 0.0]])
    by_t, _ = est("optimal_token_baseline")(data, algorithm_config())
    close(by_t[:, :2], [[-2 / 3, 0.0], [1 / 3, 0.0]])


def naive_otb(G, W, mask, index):
    """Per group, per position, loops only: B_t = sum G W M / (sum W M + 1e-8), zero tail, A = (G - B) M."""
    B, T = G.shape
    adv = torch.zeros(B, T, dtype=torch.float64)
    for g in set(index):
        rows = [i for i in range(B) if index[i] == g and mask[i].sum() > 0]
        if len(rows) < 2:
            continue
        lengths = {i: int(mask[i].sum()) for i in rows}
        top = max(lengths.values())
        longest = [i for i in rows if lengths[i] == top]
        second = sorted(lengths.values())[-2]
        for t in range(T):
            num = sum(float(G[i, t] * W[i, t] * mask[i, t]) for i in rows)
            den = sum(float(W[i, t] * mask[i, t]) for i in rows) + 1e-8
            for i in rows:
                b = 0.0 if (len(longest) == 1 and i == longest[0] and top > second and t >= second) else num / den
                adv[i, t] = (float(G[i, t]) - b) * float(mask[i, t])
    return adv


def test_otb_with_real_sum_pi_squared():
    # sum_pi_squared and old_log_probs from the training backend's own producer on random logits
    from rlplug.algorithms.logprob import token_stats_from_hidden

    g = torch.Generator().manual_seed(0)
    B, T, H, V = 6, 5, 8, 11
    hidden = torch.randn(B * T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 2.0
    probs = torch.softmax(hidden @ weight.T, dim=-1)
    labels = torch.multinomial(probs, 1, generator=g).squeeze(-1)
    stats = token_stats_from_hidden(hidden, weight, labels, extras=("sum_pi_squared",))
    lengths = [5, 3, 4, 5, 2, 1]
    data = outcome([1.0, 0.0, 1.0, 0.5, 0.0, 2.0], lengths, [0, 0, 0, 1, 1, 2], T=T)
    mask = data["response_mask"]
    data["old_log_probs"] = stats["log_probs"].view(B, T) * mask
    data["sum_pi_squared"] = stats["sum_pi_squared"].view(B, T) * mask
    # the per-token weight is ||onehot(label) - p||^2 >= 0 for real distributions
    w = 1 - 2 * data["old_log_probs"].exp() + data["sum_pi_squared"]
    direct = ((torch.nn.functional.one_hot(labels, V) - probs) ** 2).sum(-1).view(B, T)
    # two float32 chains from the logits: the hidden dot product, the log-sum-exp and sum over V,
    # at the logits' magnitude (p = exp(log p) carries log p's absolute error)
    tol = fp32_atol(H + 2 * V + OPS, hidden @ weight.T)
    torch.testing.assert_close(w * mask, direct * mask, rtol=0, atol=tol)
    assert bool((direct >= 0).all())
    G = (data["token_level_rewards"] * mask).flip(-1).cumsum(-1).flip(-1) * mask
    W = (w.double() * mask).cumsum(-1)
    expected = naive_otb(G.double(), W, mask, data["index"].tolist())
    adv, ret = est("optimal_token_baseline")(data, algorithm_config())
    assert torch.allclose(adv.double(), expected, atol=1e-5)
    assert torch.allclose(ret, G)
    assert torch.equal(adv[5], torch.zeros(T))  # row 5 is a singleton group
    # rows 0 and 3 are the unique longest of their groups: past the second-longest length A = G
    assert torch.allclose(adv[0, 4:], G[0, 4:]) and torch.allclose(adv[3, 2:], G[3, 2:])
    tir, _ = est("tir_optimal_token_baseline")(data, algorithm_config())
    assert torch.allclose(tir, adv, atol=1e-6)  # no gaps: the same


def test_otb_scales_the_weights_by_rollout_is_weights_squared():
    # w * rho^2 with rho = 2 for row 1: the 5/3 and 1.6 above become (.5 + 2*4)/(.5 + 4) = 17/9 and
    # (1 + 2*6)/(1 + 6) = 13/7 (row 1's W is multiplied by 4)
    data = outcome([1.0, 2.0], [3, 2], [0, 0])
    data["old_log_probs"] = torch.log(torch.full((2, 3), 0.5))
    data["sum_pi_squared"] = torch.tensor([[0.5, 0.5, 0.5], [1.0, 0.5, 0.0]])
    data["rollout_is_weights"] = torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]])
    adv, _ = est("optimal_token_baseline")(data, None)
    assert adv[0].tolist() == pytest.approx([1 - 17 / 9, 1 - 13 / 7, 1.0], abs=1e-6)


# ------------------------------------------------------------------ aliases
@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_vectorized_names_equal_the_estimators(alias):
    data = make_batch(batch_size=12, response_length=6, group_size=3, seed=5, scores="normal")
    for norm in (True, False):
        cfg = algorithm_config(norm_adv_by_std_in_grpo=norm)
        a, r = est(alias)(data, cfg)
        b, s = est(ALIASES[alias])(data, cfg)
        assert torch.equal(a, b) and torch.equal(r, s)
    reg = rlplug.get_registry()
    assert reg.get("advantage_estimator", alias).requires == ("index",)
    assert reg.get("advantage_estimator", alias).group_based


# ------------------------------------------------------------------ properties
def components(data):
    return Fields(data, {"reward_components": REWARD_COMPONENT_NAMES})


def gdpo_cfg(**kw):
    return algorithm_config(gdpo_reward_keys=list(REWARD_COMPONENT_NAMES), **kw)


def call(name, data, **kw):
    if name == "gdpo":
        return est(name)(components(data), gdpo_cfg(**kw))
    return est(name)(data, algorithm_config(**kw))


@pytest.mark.parametrize("name", NEW)
def test_zero_on_padding_and_singletons_unequal_groups(name):
    # groups of 1, 2, 3 and 4 responses, shuffled: a row's advantage depends on its group only
    data = make_batch(batch_size=10, response_length=6, group_size=1, seed=6, scores="normal")
    index = torch.tensor([7, 3, 3, 9, 9, 9, 4, 4, 4, 4])
    perm = torch.tensor([3, 0, 8, 1, 5, 9, 2, 6, 4, 7])
    data["index"] = index
    adv, ret = call(name, data)
    mask = data["response_mask"]
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert torch.equal(adv * (1 - mask), torch.zeros_like(adv)) and torch.equal(ret * (1 - mask), torch.zeros_like(ret))
    assert torch.equal(adv[0], torch.zeros(6)), "a group of one response gets 0"
    assert adv[1:].abs().sum() > 0
    shuffled = {k: (v[perm] if isinstance(v, torch.Tensor) else v) for k, v in data.items()}
    adv2, _ = call(name, shuffled)
    # another row order: the float32 sums (whitening) in another order, at the values' magnitude
    tol = fp32_atol(adv.numel() + OPS, adv)
    torch.testing.assert_close(adv2, adv[perm], rtol=0, atol=tol, msg="the row order changed the advantages")


@pytest.mark.parametrize("name", NEW)
def test_finite_on_single_responses_and_equal_scores(name):
    one = make_batch(batch_size=4, response_length=3, group_size=1, seed=7)
    adv, _ = call(name, one)
    assert torch.equal(adv, torch.zeros_like(adv)), "every group is a single response"
    equal = outcome([1.0] * 6, [1, 2, 3, 3, 2, 1], [0, 0, 0, 1, 1, 1])
    equal.update({k: make_batch(6, 3, group_size=3, seed=8)[k] for k in ("old_log_probs", "sum_pi_squared")})
    equal["reward_components"] = torch.ones(6, 2)
    adv, ret = call(name, equal)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    if name in ("opo", "grpo_passk", "gpg", "gdpo"):  # equal outcomes, no signal
        assert torch.equal(adv, torch.zeros_like(adv))
    single_token = make_batch(batch_size=8, response_length=1, group_size=4, seed=9)
    assert torch.isfinite(call(name, single_token)[0]).all()


# ------------------------------------------------------------------ registry and conformance
def test_registered_with_requirements():
    expected = {
        "opo": ("index",),
        "grpo_passk": ("index",),
        "gpg": ("index",),
        "gdpo": ("index", "reward_components"),
        "optimal_token_baseline": ("index", "old_log_probs", "sum_pi_squared"),
        "tir_optimal_token_baseline": ("index", "old_log_probs", "sum_pi_squared"),
    }
    reg = rlplug.get_registry()
    for name, requires in expected.items():
        obj = reg.get("advantage_estimator", name)
        assert isinstance(obj, AdvantageEstimator) and obj.requires == requires and obj.group_based, name
        assert reg.registration("advantage_estimator", name).distribution == "rlplug"
    assert reg.get("advantage_estimator", "gdpo").validate is not None


@pytest.mark.parametrize("name", [*NEW, *ALIASES])
@pytest.mark.parametrize("norm", [True, False])
def test_conformance_kit(name, norm):
    cfg = algorithm_config(norm_adv_by_std_in_grpo=norm)
    check_advantage_estimator(name, cfg)
    if name == "gdpo":
        # the kit's batches are plain dicts; the trainer's carry the column names, as this adapter does
        real = est("gdpo")
        named = AdvantageEstimator(lambda d, c: real(components(d), c), requires=real.requires, group_based=True)
        check_advantage_estimator(named, gdpo_cfg(norm_adv_by_std_in_grpo=norm))
