"""Advantage estimator plugins: hand-derived values, a slow pure-Python reference vs the
vectorised implementations on random ragged batches, properties (padding exactly 0, GRPO group
sums ~0, masked values do not change GAE), config forms, missing inputs, the registry."""

import math
import statistics

import pytest
import torch
from omegaconf import OmegaConf

import rlplug
from rlplug.config.schema import AlgorithmConfig

# hand values through torch's float32 kernels; the tolerances (allclose's rtol 1e-5 plus atol) are
# above reduction_tolerance's bound for these few-term chains
pytestmark = pytest.mark.numerics

ALL = ["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"]
#: every name the module registers: ALL plus verl's further estimators (tests/test_advantage_zoo.py)
REGISTERED = [
    *ALL,
    "grpo_vectorized",
    "rloo_vectorized",
    "opo",
    "grpo_passk",
    "gpg",
    "gdpo",
    "optimal_token_baseline",
    "tir_optimal_token_baseline",
]


def est(name):
    return rlplug.get_plugin("advantage_estimator", name)


def whiten_ref(x):
    """(x - mean) / sqrt(unbiased var + 1e-8) of a list of floats."""
    if len(x) < 2:
        return [0.0] * len(x)
    mu = statistics.fmean(x)
    sd = math.sqrt(statistics.variance(x) + 1e-8)
    return [(v - mu) / sd for v in x]


# ------------------------------------------------------------------ hand-derived values
def test_gae_hand_values_with_a_skipped_token():
    # Row 0: r = [0, 1, 2], V = [1, 2, 3], gamma 0.9, lam 0.8 (gamma*lam = 0.72):
    #   t=2: delta = 2 + 0.9*0 - 3 = -1            gae = -1
    #   t=1: delta = 1 + 0.9*3 - 2 = 1.7           gae = 1.7 + 0.72*(-1) = 0.98
    #   t=0: delta = 0 + 0.9*2 - 1 = 0.8           gae = 0.8 + 0.72*0.98 = 1.5056
    #   returns = gae + V = [2.5056, 2.98, 2]
    # Row 1 is row 0 with a masked (tool) token inserted at t=2 holding garbage; it is skipped,
    # so row 1 valid positions get the same numbers, 0 at t=2 and at the padding t=4.
    rewards = torch.tensor([[0.0, 1.0, 2.0, 0.0, 0.0], [0.0, 1.0, 55.0, 2.0, 9.0]])
    values = torch.tensor([[1.0, 2.0, 3.0, 7.0, 7.0], [1.0, 2.0, float("nan"), 3.0, 1e6]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 1.0, 0.0]])
    adv, ret = est("gae")(
        {"token_level_rewards": rewards, "values": values, "response_mask": mask}, {"gamma": 0.9, "lam": 0.8}
    )
    gae = [1.5056, 0.98, -1.0]
    expected_ret = torch.tensor([[2.5056, 2.98, 2.0, 0, 0], [2.5056, 2.98, 0, 2.0, 0]])
    assert torch.allclose(ret, expected_ret, atol=1e-5)
    w = whiten_ref(gae + gae)  # whitened over the 6 valid tokens of the batch
    expected_adv = torch.tensor([[w[0], w[1], w[2], 0, 0], [w[3], w[4], 0, w[5], 0]])
    assert torch.allclose(adv, expected_adv, atol=1e-5)
    assert adv.dtype == ret.dtype == torch.float32


def test_gae_defaults_gamma_lam_one():
    # gamma = lam = 1: gae_t = sum_{t'>=t} r_t' - V_t.  r = [0, 0, 1], V = [0.5, 0.25, 0.5]
    # -> gae = [0.5, 0.75, 0.5], returns = [1, 1, 1]
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.25, 0.5]])
    m = torch.ones(1, 3)
    adv, ret = est("gae")({"token_level_rewards": r, "values": v, "response_mask": m}, None)
    assert torch.allclose(ret, torch.ones(1, 3))
    assert torch.allclose(adv, torch.tensor([whiten_ref([0.5, 0.75, 0.5])]), atol=1e-5)


GROUP_MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.float32)
GROUP_INDEX = torch.tensor([7, 7, 7, 3, 3, 9])  # groups: rows 0-2, rows 3-4, singleton row 5


def _outcome_rewards(scores):
    from rlplug.algorithms.losses import compute_token_level_scores

    return compute_token_level_scores(torch.tensor(scores), GROUP_MASK)


def test_grpo_hand_values():
    # scores [1, 0, 0 | 1, 1 | 5]; group 7: mean 1/3, deviations (2/3, -1/3, -1/3),
    # unbiased var (4/9 + 1/9 + 1/9) / 2 = 1/3, std = 1/sqrt(3)
    #   a = (2/3) / (1/sqrt 3 + 1e-6), (-1/3) / (1/sqrt 3 + 1e-6) twice
    # group 3: equal scores -> 0; group 9: singleton -> 0
    data = {
        "token_level_rewards": _outcome_rewards([1.0, 0.0, 0.0, 1.0, 1.0, 5.0]),
        "response_mask": GROUP_MASK,
        "index": GROUP_INDEX,
    }
    adv, ret = est("grpo")(data, {"norm_adv_by_std_in_grpo": True})
    s = 1 / math.sqrt(3) + 1e-6
    per_row = torch.tensor([(2 / 3) / s, (-1 / 3) / s, (-1 / 3) / s, 0.0, 0.0, 0.0])
    assert torch.allclose(adv, per_row.unsqueeze(1) * GROUP_MASK, atol=1e-6)
    assert torch.equal(ret, adv)
    # Dr.GRPO: no std division -> (2/3, -1/3, -1/3, 0, 0, 0)
    adv, _ = est("grpo")(data, {"norm_adv_by_std_in_grpo": False})
    per_row = torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0])
    assert torch.allclose(adv, per_row.unsqueeze(1) * GROUP_MASK, atol=1e-6)


def test_grpo_equal_non_representable_scores_give_exact_zero():
    # 0.1 is not exact in binary; group statistics in float64 keep (s - mean)/(std + 1e-6) ~ 0
    data = {
        "token_level_rewards": _outcome_rewards([0.1, 0.1, 0.1, 0.7, 0.7, 0.3]),
        "response_mask": GROUP_MASK,
        "index": GROUP_INDEX,
    }
    adv, _ = est("grpo")(data, None)
    assert adv.abs().max().item() < 1e-6


def test_rloo_hand_values():
    # group 7 scores (1, 0, 0): a_0 = 1 - (0+0)/2 = 1, a_1 = 0 - (1+0)/2 = -0.5, a_2 = -0.5
    # group 3 (1, 1): 0, 0; singleton: 0
    data = {
        "token_level_rewards": _outcome_rewards([1.0, 0.0, 0.0, 1.0, 1.0, 5.0]),
        "response_mask": GROUP_MASK,
        "index": GROUP_INDEX,
    }
    adv, ret = est("rloo")(data, None)
    per_row = torch.tensor([1.0, -0.5, -0.5, 0.0, 0.0, 0.0])
    assert torch.allclose(adv, per_row.unsqueeze(1) * GROUP_MASK, atol=1e-6)
    assert torch.equal(ret, adv)


def test_reinforce_plus_plus_hand_values():
    # gamma 0.5. Row 0: r = [1, 0, 2] -> G2 = 2, G1 = 0 + 0.5*2 = 1, G0 = 1 + 0.5*1 = 1.5
    # Row 1: r = [0, 4, pad] -> G1 = 4, G0 = 0 + 0.5*4 = 2
    r = torch.tensor([[1.0, 0.0, 2.0], [0.0, 4.0, 8.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = est("reinforce_plus_plus")({"token_level_rewards": r, "response_mask": m}, {"gamma": 0.5})
    assert torch.allclose(ret, torch.tensor([[1.5, 1.0, 2.0], [2.0, 4.0, 0.0]]))
    w = whiten_ref([1.5, 1.0, 2.0, 2.0, 4.0])
    assert torch.allclose(adv, torch.tensor([[w[0], w[1], w[2]], [w[3], w[4], 0.0]]), atol=1e-5)


def test_reinforce_plus_plus_baseline_hand_values():
    # index (0, 0, 1), scores (1, 3, 5): group means 2, 2, 5 -> centred (-1, 1, 0)
    # lengths (2, 1, 3): valid token values (-1, -1 | 1 | 0, 0, 0), whitened over these 6
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    r = torch.tensor([[0.0, 1.0, 0.0], [3.0, 0.0, 0.0], [0.0, 0.0, 5.0]])
    data = {"token_level_rewards": r, "response_mask": m, "index": torch.tensor([0, 0, 1])}
    adv, ret = est("reinforce_plus_plus_baseline")(data, None)
    w = whiten_ref([-1.0, -1.0, 1.0, 0.0, 0.0, 0.0])
    assert torch.allclose(adv, torch.tensor([[w[0], w[1], 0.0], [w[2], 0.0, 0.0], [w[3], w[4], w[5]]]), atol=1e-5)
    assert torch.equal(ret, adv)


def test_remax_hand_values():
    # r = [0, 1, 2, pad 9]: returns = suffix sums over valid tokens [3, 3, 2, 0]; b = 0.5
    # advantages = returns - b on valid tokens = [2.5, 2.5, 1.5, 0]
    r = torch.tensor([[0.0, 1.0, 2.0, 9.0]])
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    adv, ret = est("remax")(
        {"token_level_rewards": r, "response_mask": m, "reward_baselines": torch.tensor([0.5])}, None
    )
    assert torch.equal(ret, torch.tensor([[3.0, 3.0, 2.0, 0.0]]))
    assert torch.equal(adv, torch.tensor([[2.5, 2.5, 1.5, 0.0]]))


# ------------------------------------------------------------------ slow reference loops
def ref_gae(r, v, m, gamma, lam):
    B, T = len(r), len(r[0])
    gae = [[0.0] * T for _ in range(B)]
    for i in range(B):
        nextvalue, last = 0.0, 0.0
        for t in reversed(range(T)):
            if not m[i][t]:
                continue
            delta = r[i][t] + gamma * nextvalue - v[i][t]
            last = delta + gamma * lam * last
            nextvalue = v[i][t]
            gae[i][t] = last
    ret = [[(gae[i][t] + v[i][t]) if m[i][t] else 0.0 for t in range(T)] for i in range(B)]
    return _whiten_valid(gae, m), ret


def _whiten_valid(x, m):
    flat = [x[i][t] for i in range(len(x)) for t in range(len(x[0])) if m[i][t]]
    w = iter(whiten_ref(flat))
    return [[next(w) if m[i][t] else 0.0 for t in range(len(x[0]))] for i in range(len(x))]


def _groups(index):
    groups = {}
    for i, g in enumerate(index):
        groups.setdefault(g, []).append(i)
    return groups


def _scores(r, m):
    return [sum(r[i][t] for t in range(len(r[0])) if m[i][t]) for i in range(len(r))]


def ref_grpo(r, m, index, norm):
    s = _scores(r, m)
    a = [0.0] * len(s)
    for rows in _groups(index).values():
        if len(rows) < 2:
            continue
        vals = [s[i] for i in rows]
        mu, sd = statistics.fmean(vals), statistics.stdev(vals)
        for i in rows:
            a[i] = (s[i] - mu) / (sd + 1e-6) if norm else s[i] - mu
    adv = [[a[i] if m[i][t] else 0.0 for t in range(len(r[0]))] for i in range(len(r))]
    return adv, adv


def ref_rloo(r, m, index):
    s = _scores(r, m)
    a = [0.0] * len(s)
    for rows in _groups(index).values():
        if len(rows) < 2:
            continue
        for i in rows:
            a[i] = s[i] - statistics.fmean([s[j] for j in rows if j != i])
    adv = [[a[i] if m[i][t] else 0.0 for t in range(len(r[0]))] for i in range(len(r))]
    return adv, adv


def ref_rpp(r, m, gamma):
    B, T = len(r), len(r[0])
    G = [[0.0] * T for _ in range(B)]
    for i in range(B):
        running = 0.0
        for t in reversed(range(T)):
            if m[i][t]:
                running = r[i][t] + gamma * running
                G[i][t] = running
    return _whiten_valid(G, m), G


def ref_rpp_baseline(r, m, index):
    s = _scores(r, m)
    c = [0.0] * len(s)
    for rows in _groups(index).values():
        mu = statistics.fmean([s[i] for i in rows])
        for i in rows:
            c[i] = s[i] - mu
    x = [[c[i] if m[i][t] else 0.0 for t in range(len(r[0]))] for i in range(len(r))]
    adv = _whiten_valid(x, m)
    return adv, adv


def ref_remax(r, m, b):
    B, T = len(r), len(r[0])
    ret = [[0.0] * T for _ in range(B)]
    adv = [[0.0] * T for _ in range(B)]
    for i in range(B):
        acc = 0.0
        for t in reversed(range(T)):
            if m[i][t]:
                acc += r[i][t]
                ret[i][t] = acc
                adv[i][t] = acc - b[i]
    return adv, ret


def random_batch(seed, B, T, holes, group_size):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = T  # at least one full-length row
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).float()
    if holes:  # observation/tool tokens inside responses
        mask = mask * (torch.rand(B, T, generator=g) > 0.2).float()
    rewards = torch.randn(B, T, generator=g)
    # outcome-style rows: binary score on the last token for about half of the rows, to exercise ties
    binary = torch.rand(B, generator=g) < 0.5
    rewards[binary] = 0.0
    last = (lengths - 1).clamp(min=0)
    rewards[binary, last[binary]] = (torch.rand(int(binary.sum()), generator=g) < 0.5).float()
    rewards = rewards + 100.0 * (1 - mask)  # garbage on masked positions
    values = torch.randn(B, T, generator=g)
    perm = torch.randperm(B, generator=g)
    index = perm // group_size  # shuffled groups, last one possibly smaller
    baselines = torch.randn(B, generator=g)
    return {
        "token_level_rewards": rewards,
        "response_mask": mask,
        "values": values,
        "index": index,
        "reward_baselines": baselines,
    }


CASES = [(0, 8, 5, 4), (1, 13, 17, 3), (2, 32, 9, 5), (3, 3, 1, 2), (4, 24, 31, 1)]


@pytest.mark.parametrize("seed,B,T,group_size", CASES)
@pytest.mark.parametrize("holes", [False, True])
def test_vectorised_matches_reference_loops(seed, B, T, group_size, holes):
    data = random_batch(seed, B, T, holes, group_size)
    r = data["token_level_rewards"].tolist()
    m = [[bool(x) for x in row] for row in data["response_mask"].tolist()]
    v = data["values"].tolist()
    idx = data["index"].tolist()
    b = data["reward_baselines"].tolist()
    refs = {
        ("gae", 0.95, 0.9): ref_gae(r, v, m, 0.95, 0.9),
        ("gae", 1.0, 1.0): ref_gae(r, v, m, 1.0, 1.0),
        ("grpo", True): ref_grpo(r, m, idx, True),
        ("grpo", False): ref_grpo(r, m, idx, False),
        ("rloo",): ref_rloo(r, m, idx),
        ("reinforce_plus_plus", 0.9): ref_rpp(r, m, 0.9),
        ("reinforce_plus_plus_baseline",): ref_rpp_baseline(r, m, idx),
        ("remax",): ref_remax(r, m, b),
    }
    configs = {
        ("gae", 0.95, 0.9): {"gamma": 0.95, "lam": 0.9},
        ("gae", 1.0, 1.0): {},
        ("grpo", True): {"norm_adv_by_std_in_grpo": True},
        ("grpo", False): {"norm_adv_by_std_in_grpo": False},
        ("rloo",): {},
        ("reinforce_plus_plus", 0.9): {"gamma": 0.9},
        ("reinforce_plus_plus_baseline",): {},
        ("remax",): {},
    }
    for key, (ref_adv, ref_ret) in refs.items():
        adv, ret = est(key[0])(data, configs[key])
        assert torch.allclose(adv, torch.tensor(ref_adv), rtol=1e-4, atol=1e-4), key
        assert torch.allclose(ret, torch.tensor(ref_ret), rtol=1e-4, atol=1e-4), key


# ------------------------------------------------------------------ properties
@pytest.mark.parametrize("name", ALL)
def test_padding_is_exactly_zero(name):
    data = random_batch(7, 16, 12, holes=True, group_size=4)
    adv, ret = est(name)(data, None)
    invalid = data["response_mask"] == 0
    assert invalid.any()
    assert adv.shape == ret.shape == data["response_mask"].shape
    assert adv.dtype == ret.dtype == torch.float32
    assert torch.equal(adv[invalid], torch.zeros(int(invalid.sum())))
    assert torch.equal(ret[invalid], torch.zeros(int(invalid.sum())))
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_group_sums_are_zero(norm):
    data = random_batch(8, 40, 6, holes=False, group_size=5)
    data["response_mask"][:, 0] = 1.0  # every response non-empty, so each carries its advantage
    adv, _ = est("grpo")(data, {"norm_adv_by_std_in_grpo": norm})
    per_row = adv[:, 0]
    sums = torch.zeros(8).index_add(0, data["index"], per_row)
    assert sums.abs().max().item() < 1e-4
    assert per_row.abs().sum() > 1.0  # not trivially zero


def test_gae_ignores_values_and_rewards_at_masked_positions():
    data = random_batch(9, 10, 15, holes=True, group_size=2)
    adv0, ret0 = est("gae")(data, {"gamma": 0.9, "lam": 0.95})
    invalid = data["response_mask"] == 0
    changed = dict(data)
    changed["values"] = torch.where(invalid, torch.full_like(data["values"], float("nan")), data["values"])
    changed["token_level_rewards"] = torch.where(
        invalid, torch.full_like(data["values"], -1e4), data["token_level_rewards"]
    )
    adv1, ret1 = est("gae")(changed, {"gamma": 0.9, "lam": 0.95})
    assert torch.equal(adv0, adv1) and torch.equal(ret0, ret1)
    # and changing a valid value does change them (row 0 is full length: V_0 enters delta_0)
    changed["values"] = data["values"].clone()
    changed["values"][0, 0] += 1.0
    assert not torch.equal(est("gae")(changed, {"gamma": 0.9, "lam": 0.95})[0], adv0)


@pytest.mark.parametrize(
    "config",
    [
        {"gamma": 0.9, "lam": 0.7, "norm_adv_by_std_in_grpo": False},
        AlgorithmConfig(gamma=0.9, lam=0.7, norm_adv_by_std_in_grpo=False),
        OmegaConf.structured(AlgorithmConfig(gamma=0.9, lam=0.7, norm_adv_by_std_in_grpo=False)),
    ],
    ids=["dict", "dataclass", "dictconfig"],
)
def test_config_forms_agree(config):
    data = random_batch(10, 12, 7, holes=False, group_size=3)
    for name in ("gae", "grpo", "reinforce_plus_plus"):
        adv, ret = est(name)(data, config)
        adv_ref, ret_ref = est(name)(data, {"gamma": 0.9, "lam": 0.7, "norm_adv_by_std_in_grpo": False})
        assert torch.equal(adv, adv_ref) and torch.equal(ret, ret_ref)
    # and they are not the defaults
    assert not torch.equal(est("gae")(data, config)[1], est("gae")(data, None)[1])


def test_string_group_labels_like_verl_uids():
    data = {"token_level_rewards": _outcome_rewards([1.0, 0.0, 0.0, 1.0, 1.0, 5.0]), "response_mask": GROUP_MASK}
    by_int = est("grpo")({**data, "index": GROUP_INDEX}, None)[0]
    by_str = est("grpo")({**data, "index": ["a", "a", "a", "b", "b", "c"]}, None)[0]
    assert torch.equal(by_int, by_str)


@pytest.mark.parametrize(
    "name,missing",
    [
        ("gae", "values"),
        ("grpo", "index"),
        ("rloo", "index"),
        ("reinforce_plus_plus_baseline", "index"),
        ("remax", "reward_baselines"),
    ],
)
def test_missing_input_raises(name, missing):
    data = random_batch(11, 4, 3, holes=False, group_size=2)
    del data[missing]
    with pytest.raises(rlplug.MissingInputError, match=f"'{missing}'"):
        est(name)(data, None)
    data[missing] = None
    with pytest.raises(rlplug.MissingInputError, match=f"'{missing}'"):
        est(name)(data, None)


def test_bad_shapes_are_reported():
    data = random_batch(12, 4, 3, holes=False, group_size=2)
    with pytest.raises(ValueError, match="values"):
        est("gae")({**data, "values": data["values"][:, :2]}, None)
    with pytest.raises(ValueError, match="index"):
        est("grpo")({**data, "index": data["index"][:3]}, None)
    with pytest.raises(ValueError, match="reward_baselines"):
        est("remax")({**data, "reward_baselines": torch.zeros(4, 1)}, None)
    with pytest.raises(ValueError, match="response_mask"):
        est("rloo")({**data, "response_mask": data["response_mask"][:, :1]}, None)


def test_registry_lists_estimators_with_requirements():
    reg = rlplug.get_registry()
    assert set(ALL) <= set(reg.names("advantage_estimator"))
    expected = {
        "gae": (("values",), False),
        "grpo": (("index",), True),
        "rloo": (("index",), True),
        "reinforce_plus_plus": ((), False),
        "reinforce_plus_plus_baseline": (("index",), True),
        "remax": (("reward_baselines",), False),
    }
    for name, (requires, group_based) in expected.items():
        obj = reg.get("advantage_estimator", name)
        assert isinstance(obj, rlplug.AdvantageEstimator)
        assert obj.requires == requires and obj.group_based == group_based
        assert reg.registration("advantage_estimator", name).distribution == "rlplug"
    assert reg.get("advantage_estimator", "gae").uses_critic


@pytest.mark.parametrize("name", ALL)
def test_shared_plugin_contract(name, rlplug_registry, make_batch, assert_advantage_contract):
    """Our estimators pass the same contract check third-party plugins are tested with
    (the ``rlplug.testing`` pytest plugin), loaded into a clean registry like a third-party module."""
    import rlplug.plugins.algorithms.advantage as module

    assert rlplug_registry.add_plugin(module), rlplug_registry.broken
    assert rlplug.plugin_names("advantage_estimator") == sorted(REGISTERED)
    data = make_batch(batch_size=12, response_length=7, group_size=4, seed=3)
    assert_advantage_contract(name, data)
