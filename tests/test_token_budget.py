"""Token-budget micro-batches (``actor.use_dynamic_bsz``, verl's dynamic batch size).

* the packing: hand-derived groups (fewest micro-batches under the budget, then the most balanced),
  and the error for a sequence longer than the budget;
* results equal fixed micro-batching: the parameters and metrics of an actor update for every
  ``loss_agg_mode`` and every registered policy loss, the critic update, and the log-prob and value
  passes (the losses use the whole mini-batch's normaliser, so the grouping is memory only);
* the config check: a budget below ``max_prompt_length + max_response_length`` fails at start.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _helpers import TINY_VOCAB, assert_updates_close, fp32_atol, tiny_chain_terms
from test_local_backend import P, T, make_batch, make_cfg, params, prepared_batch

from rlplug.algorithms.token_budget import pack_rows, packed_cost, row_lengths
from rlplug.config.compose import compose
from rlplug.config.schema import ConfigError
from rlplug.contracts.registry import get_registry
from rlplug.plugins.training.local import LocalTrainingBackend
from rlplug.run.validate import validate_config


@pytest.fixture(scope="module")
def tiny_path() -> str:
    from rlplug.config.schema import TinyModelConfig
    from rlplug.training.models import tiny_model_dir

    return str(tiny_model_dir(TinyModelConfig()))


def test_pack_rows_hand_values():
    # totals 4, 5, 8, 11 (prompt 3 each); budget 24: the fewest micro-batches is 2 (greedy 3 + 1,
    # costs 3 x 8 = 24 and 11); the balanced cut is 2 + 2: costs 2 x 5 = 10 and 2 x 11 = 22
    order, sizes = pack_rows([3, 3, 3, 3], [8, 1, 5, 2], 24)
    assert order.tolist() == [1, 3, 2, 0] and sizes == [2, 2]
    assert packed_cost([3, 3], [1, 2]) == 10 and packed_cost([3, 3], [5, 8]) == 22
    # everything fits one pass: one micro-batch
    assert pack_rows([3, 3, 3, 3], [8, 1, 5, 2], 44)[1] == [4]
    # a budget of the longest row: one row per micro-batch... except rows that fit two by two
    assert pack_rows([1, 1, 1], [1, 1, 9], 10)[1] == [2, 1]
    # the width is the longest prompt plus the longest response, not the longest row
    assert packed_cost([5, 1], [1, 5]) == 2 * (5 + 5)
    assert pack_rows([5, 1], [1, 5], 19)[1] == [1, 1]


def test_pack_rows_rejects_a_row_longer_than_the_budget():
    with pytest.raises(
        ValueError, match=r"a sequence of 12 tokens \(prompt 4 \+ response 8\) does not fit the token budget of 10"
    ):
        pack_rows([3, 4], [2, 8], 10)


def test_row_lengths_split_prompt_and_response():
    batch = make_batch()
    prompt, resp = row_lengths(batch["attention_mask"], T)
    assert prompt == [5, 5, 3, 3, 4, 4, 2, 2] and resp == [6, 3, 1, 6, 4, 2, 5, 6]


def _updates(tiny_path, budgets, **overrides):
    """One actor update of the same prepared batch from the same start per budget (None: fixed
    micro-batches of 4): a single backend whose weights, optimizer and schedule are restored
    between the updates. Returns ``[(params, metrics, start params)]`` in the order of ``budgets``."""
    cfg = make_cfg(**overrides)
    backend = LocalTrainingBackend(cfg, tiny_path, use_critic=False, use_ref=True, total_steps=2)
    batch = prepared_batch(backend)
    batch["rollout_log_probs"] = batch["old_log_probs"].clone()
    role = backend.actor
    start = (
        copy.deepcopy(role.model.state_dict()),
        copy.deepcopy(role.optimizer.state_dict()),
        copy.deepcopy(role.scheduler.state_dict()),
    )
    out = []
    for budget in budgets:
        role.model.load_state_dict(start[0])
        role.optimizer.load_state_dict(start[1])
        role.scheduler.load_state_dict(start[2])
        role.token_budget = budget
        metrics = backend.update_actor(batch)
        out.append((params(backend), metrics))
    backend.close()
    return [(p, m, {k: v.clone() for k, v in start[0].items()}) for p, m in out]


#: float32 rounding chains (rlplug.testing.reduction_tolerance): the forward with the log-sum-exp
#: over the vocabulary; the critic's forward; the forward and backward of an update, whose weight
#: gradients sum over the batch's B x (P + T) tokens. The packings run the same rows in other
#: matmul shapes, so they agree to rounding only; a packing bug moves values by orders more.
LOG_PROB_TERMS = tiny_chain_terms(P + T, vocab_size=TINY_VOCAB)
VALUE_TERMS = tiny_chain_terms(P + T)
UPDATE_TERMS = tiny_chain_terms(P + T, vocab_size=TINY_VOCAB, backward_tokens=8 * (P + T))


def _assert_same(a, b):
    (p_ref, m_ref, start), (p, m, _) = a, b
    assert_updates_close(p, p_ref, start, UPDATE_TERMS)
    assert set(m) == set(m_ref)
    for key in m_ref:
        if key != "actor/lr":  # means over the tokens of O(1) terms
            assert m[key] == pytest.approx(m_ref[key], rel=0, abs=fp32_atol(UPDATE_TERMS, m_ref[key], floor=1.0)), key


@pytest.mark.numerics
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_update_equals_fixed_micro_batches_for_every_loss_agg_mode(tiny_path, mode):
    over = {
        "actor.loss_agg_mode": mode,
        "actor.use_kl_loss": True,
        "actor.kl_loss_coef": 0.5,
        "actor.entropy_coeff": 0.01,
    }
    # one row per pass (budget P + T), 2-3 rows, most rows: the sweep once, one budget for the others
    budgets = [None, P + T, 20, 33] if mode == "token-mean" else [None, 20]
    fixed, *packed = _updates(tiny_path, budgets, **over)
    for result in packed:
        _assert_same(fixed, result)


POLICY_LOSS_SETTINGS = {
    "dro": {"actor.dro_beta": 0.1},
    "clip_cov": {"actor.clip_cov_ratio": 0.5, "actor.clip_cov_lb": -10.0, "actor.clip_cov_ub": 10.0},
    "kl_cov": {"actor.kl_cov_ratio": 0.5},
}


@pytest.mark.numerics
@pytest.mark.parametrize("loss", sorted(get_registry().names("policy_loss")))
def test_update_equals_fixed_micro_batches_for_every_policy_loss(tiny_path, loss):
    over = {"actor.policy_loss": loss, **POLICY_LOSS_SETTINGS.get(loss, {})}
    _assert_same(*_updates(tiny_path, [None, 20], **over))


@pytest.mark.numerics
def test_log_probs_values_and_critic_update_equal_fixed_micro_batches(tiny_path):
    results = []
    start = None
    for budget in (None, 14, 25):
        cfg = make_cfg(**{"critic.optim.lr": 1e-2})
        if budget is not None:
            cfg.actor.use_dynamic_bsz = True
            cfg.actor.log_prob_max_token_len_per_device = budget
            cfg.critic.max_token_len_per_device = budget + 3
            cfg.critic.forward_max_token_len_per_device = budget
        backend = LocalTrainingBackend(cfg, tiny_path, use_critic=True, use_ref=True, total_steps=1)
        assert backend.budgets["values"] == budget and backend.critic.token_budget == (budget and budget + 3)
        start = start or params(backend, "critic")  # every backend starts from the same tiny weights
        batch = make_batch()
        lp = backend.compute_log_probs(batch, with_entropy=True)
        ref = backend.compute_log_probs(batch, which="ref")["log_probs"]
        batch["values"] = backend.compute_values(batch) * batch["response_mask"]
        metrics = backend.update_critic(batch)
        results.append((lp, ref, batch["values"], params(backend, "critic"), metrics))
        backend.close()
    lp0, ref0, v0, p0, m0 = results[0]
    for lp, ref, v, p, m in results[1:]:
        for key in ("log_probs", "entropy"):
            torch.testing.assert_close(lp[key], lp0[key], rtol=0, atol=fp32_atol(LOG_PROB_TERMS, lp0[key]))
        torch.testing.assert_close(ref, ref0, rtol=0, atol=fp32_atol(LOG_PROB_TERMS, ref0))
        torch.testing.assert_close(v, v0, rtol=0, atol=fp32_atol(VALUE_TERMS, v0))
        critic_terms = tiny_chain_terms(P + T, backward_tokens=8 * (P + T))
        assert_updates_close(p, p0, start, critic_terms, what="critic ")
        vf = m0["critic/vf_loss"]
        assert m["critic/vf_loss"] == pytest.approx(vf, rel=0, abs=fp32_atol(critic_terms, vf, floor=1.0))


def test_micro_batches_follow_the_budget():
    from rlplug.training.backend import TrainingBackendBase

    batch = make_batch()
    micros, order = TrainingBackendBase._micro_batches(batch, 4, 20)
    assert order is not None and sum(len(m) for m in micros) == len(batch)
    for m in micros:
        prompt, resp = row_lengths(m["attention_mask"], T)
        assert packed_cost(prompt, resp) <= 20
    # the fixed path is unchanged: 4 rows per micro-batch
    assert [len(m) for m in TrainingBackendBase._micro_batches(batch, 4)[0]] == [4, 4]


def test_budget_smaller_than_the_longest_sequence_is_a_config_error():
    base = ["debug=tiny", "actor.use_dynamic_bsz=true", "data.max_prompt_length=128", "data.max_response_length=16"]
    validate_config(compose([*base, "actor.max_token_len_per_device=144"]))  # exactly one sequence fits
    with pytest.raises(ConfigError, match=r"actor\.max_token_len_per_device = 100 tokens is smaller than .* = 144"):
        validate_config(compose([*base, "actor.max_token_len_per_device=100"]))
    with pytest.raises(ConfigError, match=r"critic\.forward_max_token_len_per_device .* = 50 tokens"):
        validate_config(compose([*base, "algorithm=ppo", "critic.forward_max_token_len_per_device=50"]))
    # with use_dynamic_bsz off the budgets are not used, and micro_batch_size_per_device is checked as before
    validate_config(compose(["debug=tiny", "actor.max_token_len_per_device=10"]))
