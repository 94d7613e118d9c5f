"""Tests of the example plugin, written with the fixtures rlplug ships for plugin authors
(``rlplug_registry``, ``make_batch``, ``assert_advantage_contract``; see ``rlplug.testing``)."""

import pytest
import torch

import rlplug_example
from rlplug.plugin import MissingInputError, check_advantage_estimator, check_reward_function, get_plugin


@pytest.fixture
def registry(rlplug_registry):
    # add the plugin module the way the entry point would, into a clean registry
    assert rlplug_registry.add_plugin(rlplug_example, name="example"), rlplug_registry.broken
    return rlplug_registry


def test_registers_both_names(registry):
    assert registry.names("reward_function") == ["exact_match"]
    assert registry.names("advantage_estimator") == ["median_baseline"]
    # the process-wide lookup sees the fixture's registry
    assert get_plugin("reward_function", "exact_match") is rlplug_example.exact_match


@pytest.mark.parametrize(
    "response, truth, kwargs, expected",
    [
        ("3 + 4 = 7\n#### 7", "7", {}, 1.0),  # answer after the last ####
        ("#### 6\nno wait\n#### 7 ", " 7", {}, 1.0),  # the last marker wins, whitespace ignored
        ("#### 7.0", "7", {}, 0.0),  # exact: 7.0 is not 7
        ("Paris", "paris", {}, 0.0),
        ("Paris", "paris", {"ignore_case": True}, 1.0),
        ("the answer is 7", "7", {}, 0.0),  # no marker: the whole response must match
        (None, "7", {}, 0.0),
    ],
)
def test_exact_match(registry, response, truth, kwargs, expected):
    fn = get_plugin("reward_function", "exact_match")
    assert fn("basic_arithmetic", response, truth, None, **kwargs) == expected


def test_median_baseline_hand_values(registry, assert_advantage_contract):
    # two groups of 4; each row's score sits on its last valid token
    # group 0 scores [0, 0, 1, 1] -> median (0 + 1) / 2 = 0.5 -> advantages [-0.5, -0.5, 0.5, 0.5]
    # group 1 scores [0, 1, 1, 5] -> median (1 + 1) / 2 = 1.0 -> advantages [-1, 0, 0, 4]
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]] * 2, dtype=torch.float32)
    last = mask.sum(-1).long() - 1
    scores = torch.tensor([0, 0, 1, 1, 0, 1, 1, 5], dtype=torch.float32)
    rewards = torch.zeros(8, 3)
    rewards[torch.arange(8), last] = scores
    data = {"token_level_rewards": rewards, "response_mask": mask, "index": torch.tensor([0] * 4 + [1] * 4)}
    est = get_plugin("advantage_estimator", "median_baseline")
    adv, ret = assert_advantage_contract(est, data)
    expected = torch.tensor([-0.5, -0.5, 0.5, 0.5, -1.0, 0.0, 0.0, 4.0])
    torch.testing.assert_close(adv, expected[:, None] * mask)
    torch.testing.assert_close(ret, adv)


def test_median_baseline_contract_on_random_batches(registry, make_batch, assert_advantage_contract):
    est = get_plugin("advantage_estimator", "median_baseline")
    assert est.group_based and est.requires == ("index",)
    for seed in range(3):
        data = make_batch(batch_size=12, response_length=5, group_size=4, seed=seed, scores="normal")
        adv, _ = assert_advantage_contract(est, data)
        # per group, the median of the (constant per row) advantages is 0 by construction
        row_adv = adv.sum(-1) / data["response_mask"].sum(-1)
        for g in range(3):
            assert torch.quantile(row_adv[4 * g : 4 * g + 4], 0.5).abs().item() < 1e-6


def test_median_baseline_needs_groups(registry, make_batch):
    est = get_plugin("advantage_estimator", "median_baseline")
    data = make_batch()
    del data["index"]
    with pytest.raises(MissingInputError, match="index"):
        est(data, None)


def test_conformance_kits(registry):
    # the checks every plugin of these kinds must pass (the same kits rlplug runs on its own plugins):
    # the Protocol the registry checks at resolve time, then shapes, dtypes, zeros on padding and
    # degenerate inputs (single token, all-equal rewards, empty responses); rewards must pickle
    check_advantage_estimator("median_baseline")
    check_reward_function(
        "exact_match",
        [("basic_arithmetic", "#### 7", "7", None), ("x", "", "7", None), ("x", "\u00bd \U0001f600", "7", {"k": 1})],
    )
    check_reward_function("exact_match", kwargs={"ignore_case": True})
