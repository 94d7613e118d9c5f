"""Rollout correction (verl's ``algorithm.rollout_correction``) and the ``bypass_mode`` loss (issue 16).

Hand-derived weights, rejection masks and metrics of :mod:`rlplug.algorithms.rollout_correction`; the config
checks; the ``actor.rollout_is_threshold`` alias against the per-micro-batch path it replaced; the
``bypass_mode`` loss against the two-pass update; tiny runs with the correction and with bypass mode.

Log-ratios are ``l = log pi_train - log pi_rollout``, so a token with ratio ``w`` has ``l = ln w``.
"""

from __future__ import annotations

import math

import pytest
import torch
from _helpers import TINY_CPU_RUN, TINY_VOCAB, fit, fp32_atol, run_config, tiny_chain_terms
from omegaconf import OmegaConf

import rlplug
from rlplug.algorithms.rollout_correction import (
    apply_rollout_correction,
    compute_rollout_correction,
    offpolicy_metrics,
    parse_rollout_correction,
    rollout_correction_settings,
    rollout_is_weights,
    rollout_rejection_mask,
    use_rollout_log_probs_as_old,
)
from rlplug.config.compose import compose
from rlplug.config.schema import ConfigError, RunConfig, TinyModelConfig
from rlplug.conformance import check_policy_loss
from rlplug.contracts.batch import Batch
from rlplug.contracts.registry import get_registry
from rlplug.run.validate import plan_batch, validate_config
from rlplug.testing import reduction_tolerance

LN = math.log
RC = "algorithm.rollout_correction"

pytestmark = pytest.mark.numerics

#: elementwise float32 operations per token (log, difference, exp, clamp, products): with the tokens a
#: metric sums over, the n_terms of rlplug.testing.reduction_tolerance for the hand values below
OPS = 5


def _lr(*rows: list[float]) -> torch.Tensor:
    """Log-ratios of the given ratios (1.0 on padding)."""
    return torch.log(torch.tensor(rows, dtype=torch.float32))


# two responses: ratios (2, 0.5, 3 | pad) and (8, 2 | pad, pad)
RATIOS = _lr([2.0, 0.5, 3.0, 1.0], [8.0, 2.0, 1.0, 1.0])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])


# ============================================================================ importance weights


def test_token_is_weights_truncate_at_the_threshold():
    # w = min(ratio, 2): (2, 0.5, 2 | 0) and (2, 2 | 0, 0); 0 on padding
    w, m = rollout_is_weights(RATIOS, MASK, "token", 2.0)
    assert torch.equal(w, torch.tensor([[2.0, 0.5, 2.0, 0.0], [2.0, 2.0, 0.0, 0.0]]))
    assert not w.requires_grad
    # float32: exp of the logs and a mean over 5 tokens, at the raw weights' magnitude (8); the
    # truncated weights' metrics at theirs (<= 2, squared for the std and the ESS: 4)
    raw_tol, tol = fp32_atol(5 + OPS, 8.0), fp32_atol(5 + OPS, 2.0**2)
    # before truncation: mean (2 + .5 + 3 + 8 + 2) / 5 = 3.1, max 8, min .5; after: mean 8.5 / 5 = 1.7
    assert m["rollout_is_raw_mean"] == pytest.approx(3.1, abs=raw_tol)
    assert m["rollout_is_raw_max"] == pytest.approx(8.0, abs=raw_tol) and m["rollout_is_raw_min"] == pytest.approx(
        0.5, abs=tol
    )
    assert m["rollout_is_mean"] == pytest.approx(1.7, abs=tol)
    assert m["rollout_is_max"] == pytest.approx(2.0, abs=tol) and m["rollout_is_min"] == pytest.approx(0.5, abs=tol)
    # truncated: 3 and 8 of 5 tokens are above 2; none below 1/2 (0.5 is not below)
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(0.4)
    assert m["rollout_is_ratio_fraction_low"] == 0.0
    # std of (2, .5, 2, 2, 2): mean 1.7, E[w^2] = (4 * 4 + .25) / 5 = 3.25 -> sqrt(3.25 - 2.89) = 0.6
    # (the std is the square root of a difference of squares: their rounding over 2 x 0.6)
    assert m["rollout_is_std"] == pytest.approx(0.6, abs=tol / (2 * 0.6))
    # ESS = 1 / E[(w / 1.7)^2] = 1.7^2 / 3.25
    assert m["rollout_is_eff_sample_size"] == pytest.approx(1.7**2 / 3.25, abs=tol)
    # per response: means 4.5 / 3 = 1.5 and 2; raw means 5.5 / 3 and 5 -> both above 2? 1.83 no, 5 yes
    assert m["rollout_is_seq_mean"] == pytest.approx(1.75, abs=tol)
    assert m["rollout_is_seq_max"] == pytest.approx(2.0, abs=tol) and m["rollout_is_seq_min"] == pytest.approx(
        1.5, abs=tol
    )
    assert m["rollout_is_seq_max_deviation"] == pytest.approx(1.0, abs=tol)
    assert m["rollout_is_seq_fraction_high"] == pytest.approx(0.5)


def test_sequence_is_is_the_geometric_mean_over_valid_tokens_never_exp_of_the_sum():
    # response 1: exp(mean(ln 2, ln .5, ln 3)) = 3 ** (1/3) = 1.4422 on its 3 tokens;
    # response 2: exp(mean(ln 8, ln 2)) = sqrt(16) = 4 (exp(sum) would be 16, capped at 5)
    w, m = rollout_is_weights(RATIOS, MASK, "sequence", 5.0)
    g = 3.0 ** (1.0 / 3.0)
    # float32: a mean of 3 logs (|ln 8| at most), exp: the weight's relative error is the log-mean's
    # absolute one (plus exp's rounding), at the weight's magnitude (4)
    tol = 4.0 * fp32_atol(3 + OPS, LN(8.0))
    torch.testing.assert_close(w, torch.tensor([[g, g, g, 0.0], [4.0, 4.0, 0.0, 0.0]]), rtol=0, atol=tol)
    assert m["rollout_is_max"] == pytest.approx(4.0, abs=tol) and m["rollout_is_min"] == pytest.approx(g, abs=tol)
    # a cap of 2 truncates response 2 only: fraction of responses above = 1/2
    w2, m2 = rollout_is_weights(RATIOS, MASK, "sequence", 2.0)
    torch.testing.assert_close(w2[1, :2], torch.tensor([2.0, 2.0]), rtol=0, atol=0)  # the cap itself
    torch.testing.assert_close(w2[0, :3], torch.full((3,), g), rtol=0, atol=tol)
    assert m2["rollout_is_ratio_fraction_high"] == pytest.approx(0.5)
    # a long response with a small per-token drift keeps a sane weight: 200 tokens of ratio 1.05
    long = torch.full((1, 200), LN(1.05))
    w3, _ = rollout_is_weights(long, torch.ones(1, 200), "sequence", 2.0)
    # exp(sum) = 1.05 ** 200 = 17292; the mean of 200 logs (rounded ln 1.05 each), then exp
    torch.testing.assert_close(w3, torch.full((1, 200), 1.05), rtol=0, atol=1.05 * fp32_atol(200 + OPS, LN(1.05)))


def test_icepop_threshold_zeroes_weights_outside_the_bounds():
    # "0.6_2.5": ratios 0.5 and 3 and 8 fall out (0), 2 stays
    w, m = rollout_is_weights(RATIOS, MASK, "token", 2.5, 0.6)
    assert torch.equal(w, torch.tensor([[2.0, 0.0, 0.0, 0.0], [0.0, 2.0, 0.0, 0.0]]))
    assert m["rollout_is_oob_ratio"] == pytest.approx(0.6)
    s = parse_rollout_correction({"rollout_is": "token", "rollout_is_threshold": "0.6_2.5"})
    assert (s.is_lower, s.is_upper) == (0.6, 2.5)


def test_batch_normalisation_divides_by_the_batch_mean():
    # token level: truncated weights (2, .5, 2, 2, 2) have mean 1.7 -> w / 1.7, mean 1 over valid tokens
    w, m = rollout_is_weights(RATIOS, MASK, "token", 2.0, batch_normalize=True)
    tol = fp32_atol(5 + OPS, 8.0)  # a mean over 5 tokens of weights from logs, then a division
    want = torch.tensor([[2.0, 0.5, 2.0, 0.0], [2.0, 2.0, 0.0, 0.0]]) / 1.7
    torch.testing.assert_close(w, want, rtol=0, atol=tol)
    assert m["rollout_is_batch_norm_factor"] == pytest.approx(1.7, abs=tol)
    assert m["rollout_is_mean"] == pytest.approx(1.7, abs=tol)  # the metrics are from before the normalisation
    # sequence level: the mean over responses of (3 ** (1/3), 4) = 2.7211
    ws, ms = rollout_is_weights(RATIOS, MASK, "sequence", 5.0, batch_normalize=True)
    factor = (3.0 ** (1.0 / 3.0) + 4.0) / 2
    tol = 4.0 * fp32_atol(3 + 2 + OPS, LN(8.0))  # the sequence weights' rounding, a mean of 2, a division
    assert ms["rollout_is_batch_norm_factor"] == pytest.approx(factor, abs=tol)
    assert ws[1, 0].item() == pytest.approx(4.0 / factor, abs=tol)


# ============================================================================ rejection


def _keep(options: str, threshold, ratios=RATIOS, mask=MASK) -> torch.Tensor:
    s = parse_rollout_correction({"rollout_rs": options, "rollout_rs_threshold": threshold})
    kept, _ = rollout_rejection_mask(torch.as_tensor(ratios), mask, s.rollout_rs, s.rs_bounds)
    return kept


def test_token_k1_rejects_tokens_outside_the_ratio_bounds():
    # threshold 2: keep ln(1/2) <= -l <= ln 2, i.e. ratio in [0.5, 2]: 3 and 8 are rejected
    assert torch.equal(_keep("token_k1", 2.0), torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]))
    # the older name 'token' is token_k1
    assert torch.equal(_keep("token", 2.0), _keep("token_k1", 2.0))
    # asymmetric "0.4_1.9" bounds -l = log(pi_rollout / pi_train), the INVERSE ratio (verl's k1): 1/ratio is
    # .5, 2, .333 | .125, .5 -> kept where in [0.4, 1.9]: ratios 2 (1/2 = .5) in both responses only. (Bounds on
    # the ratio itself would keep 0.5 and reject both 2s.)
    assert torch.equal(_keep("token_k1", "0.4_1.9"), torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]))


def test_sequence_rejection_modes_reject_whole_responses():
    # seq_sum_k1 ('sequence'): -sum l = -ln 3 (resp 1), -ln 16 (resp 2); threshold "0.1_10" keeps
    # ln .1 <= . <= ln 10: resp 1 kept, resp 2 rejected
    expected = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert torch.equal(_keep("seq_sum_k1", "0.1_10"), expected)
    assert torch.equal(_keep("sequence", "0.1_10"), expected)
    # seq_mean_k1 ('geometric'): -mean l = -ln(3)/3 = ln(1/1.442), -ln 4; threshold 2 keeps [ln .5, ln 2]
    assert torch.equal(_keep("seq_mean_k1", 2.0), expected)
    assert torch.equal(_keep("geometric", 2.0), expected)
    # seq_max_k2: max 0.5 l^2 = 0.5 (ln 3)^2 = 0.603 and 0.5 (ln 8)^2 = 2.16; bound 1 keeps resp 1
    assert torch.equal(_keep("seq_max_k2", 1.0), expected)
    # seq_mean_k3: mean of w - 1 - l: resp 1 (2-1-ln2 + .5-1+ln2 + 3-1-ln3) / 3 = (2.5 - ln 3) / 3 = 0.467,
    # resp 2 (8-1-ln8 + 2-1-ln2) / 2 = (8 - ln 16) / 2 = 2.61; bound 0.5 keeps resp 1
    assert torch.equal(_keep("seq_mean_k3", 0.5), expected)
    # seq_sum_k2 with a bound above both sums (0.5 (ln2^2 + ln2^2 + ln3^2) = 1.08; 0.5 (ln8^2 + ln2^2) = 2.40)
    assert torch.equal(_keep("seq_sum_k2", 3.0), MASK)


def test_token_k3_and_chained_options():
    # token_k3 = w - 1 - ln w: ratio 2 -> .307, .5 -> .193, 3 -> .901, 8 -> 4.92; bound .5 rejects 3 and 8
    assert torch.equal(_keep("token_k3", 0.5), torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]))
    # every option must pass: token_k3 (bound .25 also rejects ratio 2) and seq_sum_k1 ("0.1_10")
    both = _keep("token_k3,seq_sum_k1", "0.25,0.1_10")
    assert torch.equal(both, torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))


def test_rejection_metrics():
    s = parse_rollout_correction({"rollout_rs": "token_k1", "rollout_rs_threshold": 2.0})
    _, m = rollout_rejection_mask(RATIOS, MASK, s.rollout_rs, s.rs_bounds)
    # 2 of 5 valid tokens rejected, in both responses
    assert m["rollout_rs_token_k1_masked_fraction"] == pytest.approx(0.4)
    assert m["rollout_rs_masked_fraction"] == pytest.approx(0.4)
    assert m["rollout_rs_seq_masked_fraction"] == pytest.approx(1.0)
    # k1 = -l: max -ln .5 = ln 2, min -ln 8 (one float32 log each)
    tol = fp32_atol(1, LN(8.0))
    assert m["rollout_rs_token_k1_max"] == pytest.approx(LN(2.0), abs=tol)
    assert m["rollout_rs_token_k1_min"] == pytest.approx(-LN(8.0), abs=tol)


# ============================================================================ all together, metrics


def test_compute_rollout_correction_prefixes_metrics_and_measures_the_mismatch():
    old = torch.tensor([[-1.0, -2.0]])
    rollout = torch.tensor([[-1.5, -1.5]])
    mask = torch.ones(1, 2)
    s = parse_rollout_correction({"rollout_is": "token", "rollout_is_threshold": 1.5})
    w, kept, m = compute_rollout_correction(old, rollout, mask, s)
    # l = (0.5, -0.5): w = (min(e^.5, 1.5), e^-.5) = (1.5, 0.6065); no rejection configured
    # float32: 2 tokens of a few elementwise operations on log-probs of magnitude 2, exps up to e^1.5
    tol = fp32_atol(2 + OPS, math.exp(1.5))
    torch.testing.assert_close(w, torch.tensor([[1.5, math.exp(-0.5)]]), rtol=0, atol=tol)
    assert torch.equal(kept, mask)
    assert all(k.startswith("rollout_corr/") for k in m)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(0.5)  # e^.5 = 1.65 > 1.5
    assert m["rollout_corr/kl"] == pytest.approx(0.0, abs=tol)  # mean of -l
    k3 = ((math.exp(0.5) - 1.5) + (math.exp(-0.5) - 0.5)) / 2
    assert m["rollout_corr/k3_kl"] == pytest.approx(k3, abs=tol)
    assert m["rollout_corr/training_ppl"] == pytest.approx(math.exp(1.5), abs=tol)
    assert m["rollout_corr/rollout_ppl"] == pytest.approx(math.exp(1.5), abs=tol)
    assert m["rollout_corr/chi2_token"] == pytest.approx((math.e + math.exp(-1)) / 2 - 1, abs=tol)
    assert m["rollout_corr/chi2_seq"] == pytest.approx(0.0, abs=tol)  # sum l = 0
    assert offpolicy_metrics(old, rollout, mask)["log_ppl_diff"] == pytest.approx(0.0, abs=tol)


def _batch(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> Batch:
    return Batch({"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask})


def test_apply_rollout_correction_puts_weights_and_the_rejection_on_the_batch():
    cfg = compose([f"{RC}.rollout_is=token", f"{RC}.rollout_rs=token_k1", f"{RC}.rollout_rs_threshold=2.5"])
    old = torch.log(torch.tensor([[0.2, 0.3, 0.9]]))
    rollout = torch.log(torch.tensor([[0.1, 0.3, 0.3]]))  # ratios 2, 1, 3
    batch = _batch(old, rollout, torch.ones(1, 3))
    metrics = apply_rollout_correction(batch, cfg)
    # cap 2.0 (verl's default); the ratio 1 from logs of 0.3 (float32 difference and exp)
    want = torch.tensor([[2.0, 1.0, 2.0]])
    torch.testing.assert_close(batch["rollout_is_weights"], want, rtol=0, atol=fp32_atol(OPS, LN(0.1)))
    assert batch["rollout_is_weights"].dtype == torch.float32
    assert torch.equal(batch["response_mask"], torch.tensor([[1.0, 1.0, 0.0]]))  # ratio 3 > 2.5 rejected
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 / 3)
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(5 / 3, abs=fp32_atol(3 + OPS, 2.0))
    # off: only the mismatch metrics, the batch untouched
    plain = _batch(old, rollout, torch.ones(1, 3))
    m = apply_rollout_correction(plain, compose([]))
    assert set(m) >= {"rollout_corr/kl", "rollout_corr/k3_kl"} and "rollout_is_weights" not in plain.tensors
    # bypass mode: old log-probs := the engine's, nothing else
    bypass = Batch({"rollout_log_probs": rollout, "response_mask": torch.ones(1, 3)})
    bcfg = compose([f"{RC}.bypass_mode=true", "actor.policy_loss=bypass_mode"])
    use_rollout_log_probs_as_old(bypass, bcfg)
    assert bypass["old_log_probs"] is rollout and apply_rollout_correction(bypass, bcfg) == {}


# ============================================================================ config


def _validated(*overrides: str):
    cfg = compose(["debug=tiny", *overrides])
    validate_config(cfg)
    return cfg


def test_alias_actor_rollout_is_threshold_is_token_level_tis():
    s = rollout_correction_settings(compose(["actor.rollout_is_threshold=3.0"]))
    assert (s.rollout_is, s.is_upper, s.is_lower) == ("token", 3.0, None)
    # both spellings, consistent: accepted
    both = compose(["actor.rollout_is_threshold=3.0", f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=3.0"])
    assert rollout_correction_settings(both).is_upper == 3.0
    # inconsistent: a clear error
    for extra in ([f"{RC}.rollout_is=token"], [f"{RC}.rollout_is=sequence", f"{RC}.rollout_is_threshold=3.0"]):
        with pytest.raises(ConfigError, match=r"actor.rollout_is_threshold=3.0 .*contradicts.*set only one of them"):
            rollout_correction_settings(compose(["actor.rollout_is_threshold=3.0", *extra]))


def test_config_errors():
    with pytest.raises(ConfigError, match=r"rollout_is=tok: use 'token'"):
        _validated("rollout.calculate_log_probs=true", f"{RC}.rollout_is=tok")
    with pytest.raises(ConfigError, match=r"rollout_rs=token_k9: 'token_k9' is not a rejection option"):
        _validated("rollout.calculate_log_probs=true", f"{RC}.rollout_rs=token_k9", f"{RC}.rollout_rs_threshold=2")
    with pytest.raises(ConfigError, match=r"rollout_rs=seq_mean_k1 needs .*rollout_rs_threshold"):
        _validated("rollout.calculate_log_probs=true", f"{RC}.rollout_rs=seq_mean_k1")
    with pytest.raises(ConfigError, match=r"k2/k3 option takes one upper bound"):
        _validated(
            "rollout.calculate_log_probs=true", f"{RC}.rollout_rs=token_k2", f"{RC}.rollout_rs_threshold='0.5_2'"
        )
    with pytest.raises(ConfigError, match=r"lower bound 3.0 is above the upper bound 2.0"):
        _validated("rollout.calculate_log_probs=true", f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold='3_2'")
    with pytest.raises(ConfigError, match=r"rollout.calculate_log_probs=false.*Set rollout.calculate_log_probs=true"):
        _validated(f"{RC}.rollout_is=token")
    with pytest.raises(ConfigError, match=r"loss_type=ppo: use 'ppo_clip'"):
        _validated("rollout.calculate_log_probs=true", f"{RC}.loss_type=ppo")
    on = ["rollout.calculate_log_probs=true", f"{RC}.bypass_mode=true"]
    with pytest.raises(
        ConfigError, match=r"bypass_mode=true: .*actor.policy_loss=vanilla. Set actor.policy_loss=bypass_mode"
    ):
        _validated(*on)
    with pytest.raises(ConfigError, match=r"actor.policy_loss=bypass_mode .*bypass_mode=false"):
        _validated("rollout.calculate_log_probs=true", "actor.policy_loss=bypass_mode")
    with pytest.raises(ConfigError, match=r"rollout_is_batch_normalize=true with bypass_mode=true"):
        _validated(
            *on, "actor.policy_loss=bypass_mode", f"{RC}.rollout_is=token", f"{RC}.rollout_is_batch_normalize=true"
        )
    with pytest.raises(
        ConfigError, match=r"rollout_correction requires the batch field 'rollout_log_probs'.*calculate_log_probs=false"
    ):
        _validated(f"{RC}.bypass_mode=true", "actor.policy_loss=bypass_mode")
    _validated(*on, "actor.policy_loss=bypass_mode", f"{RC}.loss_type=reinforce", f"{RC}.rollout_is=sequence")


def test_plan_turns_the_old_log_prob_pass_on_unless_bypass():
    reg = get_registry()
    plan = plan_batch(compose(["debug=tiny", "rollout.calculate_log_probs=true", f"{RC}.rollout_is=token"]), reg)
    assert plan.needs_old_log_prob_pass and "rollout_log_probs" in plan.requires
    assert plan_batch(
        compose(["debug=tiny", "rollout.calculate_log_probs=true", "actor.rollout_is_threshold=2.0"]), reg
    ).needs_old_log_prob_pass
    bypass = compose(["debug=tiny", "rollout.calculate_log_probs=true", f"{RC}.bypass_mode=true"])
    assert not plan_batch(bypass, reg).needs_old_log_prob_pass
    assert not plan_batch(compose(["debug=tiny"]), reg).needs_old_log_prob_pass


# ============================================================================ the actor update (local backend)

B, P, T, N = 8, 5, 6, 2


@pytest.fixture(scope="module")
def model_path() -> str:
    from rlplug.training.models import tiny_model_dir

    return str(tiny_model_dir(TinyModelConfig()))


def _cfg(**overrides):
    cfg = OmegaConf.structured(RunConfig)
    cfg.model.source, cfg.model.compute_dtype, cfg.trainer.device = "tiny", "fp32", "cpu"
    cfg.data.train_batch_size, cfg.data.max_response_length, cfg.rollout.n = B // N, T, N
    cfg.actor.ppo_mini_batch_size, cfg.actor.micro_batch_size_per_device = 2, 2
    cfg.actor.optim.lr, cfg.actor.optim.eps = 1e-2, 1.0
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg


def _tiny_batch(seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    prompt_len, resp_len = torch.tensor([5, 5, 3, 3, 4, 4, 2, 2]), torch.tensor([6, 3, 1, 6, 4, 2, 5, 6])
    ids, attn = torch.full((B, P + T), 2, dtype=torch.long), torch.zeros(B, P + T, dtype=torch.long)
    for i in range(B):
        ids[i, P - prompt_len[i] : P] = torch.randint(3, 500, (int(prompt_len[i]),), generator=g)
        ids[i, P : P + resp_len[i]] = torch.randint(3, 49152, (int(resp_len[i]),), generator=g)
        attn[i, P - prompt_len[i] : P + resp_len[i]] = 1
    mask = (torch.arange(T)[None] < resp_len[:, None]).float()
    return Batch(
        {
            "input_ids": ids,
            "attention_mask": attn,
            "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, P:],
            "response_mask": mask,
            "advantages": torch.randn(B, T, generator=g) * mask,
        }
    )


def _update(cfg, model_path, batch: Batch) -> tuple[dict[str, float], list[torch.Tensor]]:
    from rlplug.plugins.training.local import LocalTrainingBackend

    backend = LocalTrainingBackend(cfg, model_path, use_critic=False, use_ref=False, total_steps=1)
    try:
        metrics = backend.update_actor(batch)
        return metrics, [p.detach().clone() for p in backend.actor.model.parameters()]
    finally:
        backend.close()


def _with_log_probs(cfg, model_path, batch: Batch, noise: float = 0.4) -> Batch:
    from rlplug.plugins.training.local import LocalTrainingBackend

    backend = LocalTrainingBackend(cfg, model_path, use_critic=False, use_ref=False, total_steps=1)
    lp = backend.compute_log_probs(batch)["log_probs"]
    backend.close()
    g = torch.Generator().manual_seed(7)
    batch["old_log_probs"] = lp
    batch["rollout_log_probs"] = (lp + noise * torch.randn(lp.shape, generator=g)) * batch["response_mask"]
    return batch


def test_alias_gives_bitwise_the_update_of_the_per_micro_batch_path(model_path):
    # before: actor.rollout_is_threshold made the objective compute min(exp(old - rollout), C) per
    # micro-batch; now the trainer computes the weights once per step (apply_rollout_correction)
    # and the objective takes the batch field. The weights are per token, so the update is the same bit for bit.
    cfg = _cfg(**{"actor.rollout_is_threshold": 1.2})
    base = _with_log_probs(cfg, model_path, _tiny_batch())
    m_old, p_old = _update(cfg, model_path, Batch(dict(base.tensors)))
    once = Batch(dict(base.tensors))
    corr = apply_rollout_correction(once, cfg)
    assert "rollout_is_weights" in once.tensors and corr["rollout_corr/rollout_is_ratio_fraction_high"] > 0
    m_new, p_new = _update(cfg, model_path, once)
    assert all(torch.equal(a, b) for a, b in zip(p_old, p_new, strict=True))
    for key in ("actor/pg_loss", "actor/rollout_is_weight", "actor/pg_clipfrac", "actor/grad_norm"):
        assert m_new[key] == m_old[key], key


def test_bypass_mode_equals_the_two_pass_update_when_engine_and_trainer_agree(model_path):
    # engine log-probs == the trainer's old log-probs: bypass (old := rollout, loss bypass_mode with
    # ppo_clip) is the plain vanilla update against those old log-probs, bit for bit.
    cfg = _cfg()
    batch = _with_log_probs(cfg, model_path, _tiny_batch())
    batch["rollout_log_probs"] = batch["old_log_probs"].clone()
    m_two, p_two = _update(cfg, model_path, Batch(dict(batch.tensors)))
    bcfg = _cfg(**{f"{RC}.bypass_mode": True, "actor.policy_loss": "bypass_mode"})
    b = Batch({k: v for k, v in batch.tensors.items() if k != "old_log_probs"})
    use_rollout_log_probs_as_old(b, bcfg)
    m_by, p_by = _update(bcfg, model_path, b)
    assert all(torch.equal(x, y) for x, y in zip(p_two, p_by, strict=True))
    assert m_by["actor/pg_loss"] == m_two["actor/pg_loss"]
    assert m_by["actor/ppo_kl"] == m_two["actor/ppo_kl"]
    # KL(engine || current), measured per micro-batch: 0 before the first optimizer step, small after it
    assert 0.0 <= m_by["actor/rollout_corr/kl"] < 0.01


def test_bypass_reinforce_weights_the_policy_gradient(model_path):
    # loss_type=reinforce: -A * log_probs * w with w = min(exp(log_probs - rollout), C) per token (no
    # gradient). With rollout = current + ln 2 every w is 1/2 and the loss is half of gpg's -A * log_probs;
    # with C = 0.25 every weight is truncated to 0.25.
    base = _tiny_batch()
    plain = _cfg(**{"actor.policy_loss": "gpg", "actor.optim.lr": 0.0})
    batch = _with_log_probs(plain, model_path, base)
    ref, _ = _update(plain, model_path, Batch(dict(batch.tensors)))
    # the weight exp(log_probs - rollout) takes the update's log-probs against the separate pass's
    # (rounding of the tiny model's chain, at the log-probs' magnitude) and the shift ln 2 (rounded at
    # that magnitude): its relative error. The loss is a mean of -A log_prob w over the tokens.
    old = batch["old_log_probs"]
    rel = fp32_atol(tiny_chain_terms(P + T, vocab_size=TINY_VOCAB), old)
    rel += reduction_tolerance(torch.float32, 3, float(old.abs().max()) + LN(2.0))
    terms = float((batch["advantages"] * old).abs().max())
    for cap, factor in ((2.0, 0.5), (0.25, 0.25)):
        cfg = _cfg(
            **{
                "actor.policy_loss": "bypass_mode",
                "actor.optim.lr": 0.0,
                f"{RC}.bypass_mode": True,
                f"{RC}.loss_type": "reinforce",
                f"{RC}.rollout_is": "token",
                f"{RC}.rollout_is_threshold": cap,
            }
        )
        b = Batch({k: v for k, v in batch.tensors.items() if k != "old_log_probs"})
        b["rollout_log_probs"] = batch["old_log_probs"] + LN(2.0)
        use_rollout_log_probs_as_old(b, cfg)
        m, _ = _update(cfg, model_path, b)
        pg_tol = factor * (rel * terms + fp32_atol(B * T, terms))
        assert m["actor/pg_loss"] == pytest.approx(factor * ref["actor/pg_loss"], abs=pg_tol)
        assert m["actor/rollout_corr/rollout_is_mean"] == pytest.approx(factor, rel=rel + fp32_atol(B * T, 1.0))
        assert m["actor/pg_clipfrac"] == 0.0


def test_bypass_mode_loss_passes_the_conformance_kit():
    for loss_type, level in (("ppo_clip", None), ("reinforce", "token"), ("reinforce", "sequence")):
        cfg = OmegaConf.structured(RunConfig)
        cfg.algorithm.rollout_correction.loss_type = loss_type
        cfg.algorithm.rollout_correction.rollout_is = level
        cfg.algorithm.rollout_correction.rollout_rs = "token_k1"
        cfg.algorithm.rollout_correction.rollout_rs_threshold = 5.0
        check_policy_loss("bypass_mode", cfg.actor)
    check_policy_loss("bypass_mode")  # a bare ActorConfig: defaults (ppo_clip, no correction)


# ============================================================================ tiny runs


class _Metrics:
    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    @rlplug.hookimpl
    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        self.steps.append(dict(metrics))


def _run(tmp_path, *extra: str) -> list[dict[str, float]]:
    import rlplug.run.step_pipeline
    from rlplug.run.step_pipeline import SyncStepPipeline

    cfg = run_config(
        [*TINY_CPU_RUN, "trainer.total_training_steps=2", "trainer.logger=[]", "rollout.calculate_log_probs=true"],
        tmp_path,
        *extra,
    )
    seen = _Metrics()
    pm = get_registry().pm
    pm.register(seen)
    calls: list[str] = []
    magnitudes: list[float] = []
    original = SyncStepPipeline.old_log_probs
    as_old = rlplug.run.step_pipeline.use_rollout_log_probs_as_old

    def counting(self, trainer, batch, metrics):
        calls.append("old")
        return original(self, trainer, batch, metrics)

    def recording(batch, cfg):  # called every step: the engine's log-probs' magnitude
        magnitudes.append(float(batch["rollout_log_probs"].abs().max()))
        return as_old(batch, cfg)

    try:
        SyncStepPipeline.old_log_probs = counting  # type: ignore[method-assign]
        rlplug.run.step_pipeline.use_rollout_log_probs_as_old = recording
        assert fit(cfg) == "finished"
    finally:
        SyncStepPipeline.old_log_probs = original  # type: ignore[method-assign]
        rlplug.run.step_pipeline.use_rollout_log_probs_as_old = as_old
        pm.unregister(seen)
    for m in seen.steps:
        m["_old_log_prob_passes"] = float(len(calls))
        m["_max_abs_log_prob"] = max(magnitudes)
    return seen.steps


def _engine_vs_trainer_tol(m: dict[str, float]) -> float:
    """The engine's and the trainer's log-probs of the same fp32 model differ by rounding of the
    1-layer tiny model's chain (at most 128 + 8 tokens, log-sum-exp over the vocabulary) at the
    log-probs' magnitude; an IS weight exp(difference) ~ 1 differs from 1 by as much."""
    terms = tiny_chain_terms(128 + 8, layers=1, vocab_size=TINY_VOCAB)
    return fp32_atol(terms, m["_max_abs_log_prob"])


def test_tiny_run_with_rollout_correction(tmp_path):
    steps = _run(
        tmp_path,
        f"{RC}.rollout_is=sequence",
        f"{RC}.rollout_is_threshold=2.0",
        f"{RC}.rollout_rs=token_k1",
        f"{RC}.rollout_rs_threshold=10.0",
    )
    assert len(steps) == 2 and steps[-1]["_old_log_prob_passes"] == 2.0
    for m in steps:
        for key in ("rollout_is_mean", "rollout_is_raw_max", "rollout_rs_masked_fraction", "kl", "training_ppl"):
            assert math.isfinite(m[f"rollout_corr/{key}"]), key
        assert 0.0 < m["actor/rollout_is_weight"] <= 2.0
        # the HF engine and the trainer score the same fp32 model: weights are ~1, nothing rejected
        assert m["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=_engine_vs_trainer_tol(m))
        assert m["rollout_corr/rollout_rs_masked_fraction"] == 0.0


def test_tiny_run_in_bypass_mode_skips_the_old_log_prob_pass(tmp_path):
    steps = _run(
        tmp_path,
        f"{RC}.bypass_mode=true",
        "actor.policy_loss=bypass_mode",
        f"{RC}.loss_type=reinforce",
        f"{RC}.rollout_is=token",
        "actor.skip_old_log_prob_on_policy=false",  # on its own this would run the pass
    )
    assert len(steps) == 2 and steps[-1]["_old_log_prob_passes"] == 0.0
    for m in steps:
        assert math.isfinite(m["actor/pg_loss"]) and "timing_s/old_log_prob" not in m
        assert m["actor/rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=_engine_vs_trainer_tol(m))
        assert "rollout_corr/training_ppl" not in m  # the trainer-side correction is off in bypass mode


def test_rejected_tokens_still_count_in_the_response_lengths(tmp_path):
    # token_k1 with bounds [1.5, 2] on the ratio rejects every token (engine and trainer agree: ratio ~1);
    # the response_length/* metrics read the attention mask, as verl's do, so they still report the
    # generated lengths (the random tiny model never emits EOS: every response has TINY_CPU_RUN's
    # data.max_response_length=8 tokens; with lengths read from response_mask this was 0)
    steps = _run(tmp_path, f"{RC}.rollout_rs=token_k1", f"{RC}.rollout_rs_threshold='1.5_2'")
    for m in steps:
        assert m["rollout_corr/rollout_rs_masked_fraction"] == 1.0
        assert m["response_length/mean"] == 8.0


def test_bypass_mode_loss_reads_the_actor_rollout_is_threshold_alias():
    # the alias means rollout_is=token capped at C for the trainer; the bypass loss (which computes its
    # weights itself, against the current policy) must read it the same way, not as "no correction"
    from rlplug.plugins.algorithms.policy_loss import _bypass_settings

    cfg = compose([f"{RC}.bypass_mode=true", "actor.policy_loss=bypass_mode", "actor.rollout_is_threshold=2.0"])
    settings = _bypass_settings(cfg.actor)
    assert (settings.rollout_is, settings.is_upper, settings.is_lower) == ("token", 2.0, None)
    assert _bypass_settings(compose([f"{RC}.bypass_mode=true"]).actor).rollout_is is None


def test_a_third_party_bypass_loss_is_recognised_by_its_attribute_not_its_name():
    from rlplug.algorithms.rollout_correction import validate_rollout_correction
    from rlplug.contracts.types import PolicyLoss

    assert get_registry().get("policy_loss", "bypass_mode").bypass_mode is True
    assert PolicyLoss(lambda *a, **k: None).bypass_mode is False
    cfg = compose([f"{RC}.bypass_mode=true", "rollout.calculate_log_probs=true", "actor.policy_loss=my_bypass"])
    validate_rollout_correction(cfg, (), loss_is_bypass=True)  # PolicyLoss(..., bypass_mode=True): accepted
    with pytest.raises(ConfigError, match="actor.policy_loss=my_bypass. Set actor.policy_loss=bypass_mode"):
        validate_rollout_correction(cfg, (), loss_is_bypass=False)
    off = compose(["rollout.calculate_log_probs=true", "actor.policy_loss=my_bypass"])
    with pytest.raises(ConfigError, match="actor.policy_loss=my_bypass uses the engine's log-probs"):
        validate_rollout_correction(off, (), loss_is_bypass=True)
