"""The ``local`` training backend on the tiny random model (fp32 compute, CPU).

Batches here: 4 prompts x rollout.n = 2 responses = 8 rows; prompts left-padded to P = 5,
responses right-padded to T = 6 with ragged lengths; ``ppo_mini_batch_size = 2`` prompts, so one
``update_actor`` call takes 2 optimizer steps of 4 responses each.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from _helpers import TINY_VOCAB, assert_updates_close, fp32_atol, tiny_chain_terms
from omegaconf import OmegaConf

import rlplug
from rlplug.config.schema import RunConfig, TinyModelConfig
from rlplug.contracts.batch import Batch
from rlplug.plugins.training.local import LocalTrainingBackend, build_lr_lambda
from rlplug.testing import reduction_tolerance

B, P, T, N_SAMPLES = 8, 5, 6, 2
PAD = 2

#: float32 rounding chains (rlplug.testing.reduction_tolerance) of the tiny model over P + T
#: tokens: the forward with the log-sum-exp over the vocabulary; the critic's forward; the forward
#: and backward of an update, whose weight gradients sum over the batch's B x (P + T) tokens. Two
#: micro-batchings (or a hand-written reference) run the same rows in other matmul shapes, so they
#: agree to rounding only; a bug moves values by orders more.
LOG_PROB_TERMS = tiny_chain_terms(P + T, vocab_size=TINY_VOCAB)
VALUE_TERMS = tiny_chain_terms(P + T)
UPDATE_TERMS = tiny_chain_terms(P + T, vocab_size=TINY_VOCAB, backward_tokens=B * (P + T))
CRITIC_UPDATE_TERMS = tiny_chain_terms(P + T, backward_tokens=B * (P + T))


@pytest.fixture(scope="module")
def model_path() -> str:
    from rlplug.training.models import tiny_model_dir

    return str(tiny_model_dir(TinyModelConfig()))


def make_cfg(**overrides):
    """A RunConfig for the tiny model; ``overrides`` are dotted keys (``actor.optim.lr=...``)."""
    cfg = OmegaConf.structured(RunConfig)
    cfg.model.source = "tiny"
    cfg.model.compute_dtype = "fp32"
    cfg.trainer.device = "cpu"
    cfg.data.train_batch_size = B // N_SAMPLES
    cfg.data.max_response_length = T
    cfg.rollout.n = N_SAMPLES
    cfg.rollout.temperature = 0.8
    cfg.actor.ppo_mini_batch_size = 2
    cfg.actor.micro_batch_size_per_device = 4
    cfg.actor.optim.lr = 1e-2
    # eps = 1 makes AdamW's first steps nearly proportional to the gradient, so a wrongly scaled
    # gradient changes the parameters (with eps = 1e-8 Adam's update is ~lr * sign(g)).
    cfg.actor.optim.eps = 1.0
    cfg.critic.optim.eps = 1.0
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg


def make_batch(seed: int = 0, vocab: int = 49152) -> Batch:
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.tensor([5, 5, 3, 3, 4, 4, 2, 2])
    resp_len = torch.tensor([6, 3, 1, 6, 4, 2, 5, 6])
    ids = torch.full((B, P + T), PAD, dtype=torch.long)
    attn = torch.zeros(B, P + T, dtype=torch.long)
    for i in range(B):
        ids[i, P - prompt_len[i] : P] = torch.randint(3, 500, (int(prompt_len[i]),), generator=g)
        ids[i, P : P + resp_len[i]] = torch.randint(3, vocab, (int(resp_len[i]),), generator=g)
        attn[i, P - prompt_len[i] : P + resp_len[i]] = 1
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    mask = (torch.arange(T)[None] < resp_len[:, None]).float()
    adv = torch.randn(B, T, generator=g) * mask
    return Batch(
        {
            "input_ids": ids,
            "attention_mask": attn,
            "position_ids": pos,
            "responses": ids[:, P:],
            "response_mask": mask,
            "advantages": adv,
            "returns": torch.randn(B, T, generator=g) * mask,
            "index": torch.arange(B) // N_SAMPLES,
        }
    )


def prepared_batch(backend: LocalTrainingBackend, seed: int = 0, noise: float = 0.3) -> Batch:
    """A batch with old log-probs perturbed away from the current policy (so clipping happens)
    and reference log-probs from the reference model when there is one."""
    batch = make_batch(seed)
    lp = backend.compute_log_probs(batch)["log_probs"]
    g = torch.Generator().manual_seed(seed + 100)
    batch["old_log_probs"] = (lp + noise * torch.randn(lp.shape, generator=g)) * batch["response_mask"]
    if backend.ref is not None:
        batch["ref_log_probs"] = backend.compute_log_probs(batch, which="ref")["log_probs"]
    if backend.critic is not None:
        batch["values"] = backend.compute_values(batch) * batch["response_mask"]
    return batch


def params(backend: LocalTrainingBackend, role: str = "actor") -> dict[str, torch.Tensor]:
    model = getattr(backend, role).model
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# --------------------------------------------------------------------------- registration, schedule
def test_registered_as_local_training_backend():
    assert rlplug.get_plugin("training_backend", "local") is LocalTrainingBackend


def test_lr_schedule_hand_values():
    # warmup 2 of 6 steps: step 0 -> 1/2, step 1 -> 2/2; cosine over the remaining 4 steps:
    # step 2 -> progress 0 -> 1.0; step 4 -> progress 0.5 -> 0.5 * (1 + cos(pi/2)) = 0.5;
    # step 6 -> progress 1 -> min_lr_ratio 0.1; beyond the end it stays there.
    f = build_lr_lambda(2, 6, "cosine", min_lr_ratio=0.1)
    expected = {0: 0.5, 1: 1.0, 2: 1.0, 4: 0.1 + 0.9 * 0.5, 6: 0.1, 9: 0.1}
    for step, value in expected.items():
        assert f(step) == pytest.approx(value), step
    c = build_lr_lambda(0, 10, "constant")
    assert [c(s) for s in (0, 5, 50)] == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="warmup_style"):
        build_lr_lambda(0, 10, "linear")


# --------------------------------------------------------------------------- inference
@pytest.mark.numerics
def test_compute_log_probs_match_full_logits_and_ref(model_path):
    backend = LocalTrainingBackend(
        make_cfg(**{"actor.micro_batch_size_per_device": 3}), model_path, use_critic=False, use_ref=True, total_steps=2
    )
    batch = make_batch()
    out = backend.compute_log_probs(batch, with_entropy=True)
    assert out["log_probs"].shape == (B, T) and out["entropy"].shape == (B, T)
    with torch.no_grad():
        logits = (
            backend.actor.model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
            ).logits
            / 0.8
        )
    # position p predicts token p + 1: positions P-1 .. P+T-2 predict the response
    logp = torch.log_softmax(logits[:, P - 1 : P + T - 1], -1)
    ref_lp = logp.gather(-1, batch["responses"][..., None]).squeeze(-1)
    # micro-batches of 3 rows grouped by length, each trimmed to its own columns; padding -> 0.0
    real = batch["response_mask"].bool()
    # a log-prob is a difference of logits: rounding at the magnitude of both
    atol = fp32_atol(LOG_PROB_TERMS, ref_lp[real], logits)
    torch.testing.assert_close(out["log_probs"][real], ref_lp[real], rtol=0, atol=atol)
    torch.testing.assert_close(out["entropy"][real], -(logp.exp() * logp).sum(-1)[real], rtol=0, atol=atol)
    assert torch.all(out["log_probs"][~real] == 0) and torch.all(out["entropy"][~real] == 0)
    # the reference model is the initial actor
    assert torch.equal(backend.compute_log_probs(batch, which="ref")["log_probs"], out["log_probs"])
    with pytest.raises(ValueError, match="which must be 'actor' or 'ref'"):
        backend.compute_log_probs(batch, which="critic")
    backend.close()


@pytest.mark.numerics
def test_compute_log_probs_sum_pi_squared_matches_full_logits(model_path):
    # extras=("sum_pi_squared",): per response token sum_v p_v^2 with p = softmax(logits / 0.8),
    # computed in the chunked pass; against the model's full (B, L, V) logits. Micro-batches of 3
    # rows (grouped by length, then put back in batch order); 0.0 after each response's end.
    backend = LocalTrainingBackend(
        make_cfg(**{"actor.micro_batch_size_per_device": 3}), model_path, use_critic=False, use_ref=True, total_steps=1
    )
    batch = make_batch()
    out = backend.compute_log_probs(batch, extras=("sum_pi_squared",))
    assert set(out) == {"log_probs", "sum_pi_squared"} and out["sum_pi_squared"].dtype == torch.float32
    with torch.no_grad():
        logits = (
            backend.actor.model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
            ).logits
            / 0.8
        )
    probs = torch.softmax(logits[:, P - 1 : P + T - 1].double(), -1)
    real = batch["response_mask"].bool()
    # float32 against a float64 softmax: the model's chain, terms p_v^2 <= 1
    torch.testing.assert_close(
        out["sum_pi_squared"][real].double(), (probs * probs).sum(-1)[real], rtol=0, atol=fp32_atol(LOG_PROB_TERMS, 1.0)
    )
    assert torch.all(out["sum_pi_squared"][~real] == 0)
    # the other outputs are what they are without the extra, bit for bit; "entropy" as an extra
    # is with_entropy; the reference model takes extras too
    both = backend.compute_log_probs(batch, with_entropy=True, extras=("sum_pi_squared",))
    plain = backend.compute_log_probs(batch, with_entropy=True)
    assert torch.equal(both["log_probs"], plain["log_probs"]) and torch.equal(both["entropy"], plain["entropy"])
    assert torch.equal(both["sum_pi_squared"], out["sum_pi_squared"])
    as_extra = backend.compute_log_probs(batch, extras=("entropy",))
    assert set(as_extra) == {"log_probs", "entropy"} and torch.equal(as_extra["entropy"], plain["entropy"])
    ref = backend.compute_log_probs(batch, which="ref", extras=("sum_pi_squared",))
    assert torch.equal(ref["sum_pi_squared"], out["sum_pi_squared"])  # the reference is the initial actor
    with pytest.raises(
        ValueError, match=r"unknown per-token quantity \['pi_squared'\].*\['entropy', 'sum_pi_squared'\]"
    ):
        backend.compute_log_probs(batch, extras=("pi_squared",))
    backend.close()


def test_meets_the_training_backend_protocol(model_path):
    from rlplug.contracts.coordinator import SINGLE_PROCESS
    from rlplug.contracts.types import PER_TOKEN_QUANTITIES, TrainingBackend

    reg = rlplug.get_registry()
    reg.registration("training_backend", "local")  # raises PluginContractError when a member is missing
    assert LocalTrainingBackend.capabilities == frozenset(
        {"reuses_on_policy_log_probs", "policy_loss_minibatch_stats", "scale_lr", "apply_phase", "lora"}
    )
    assert LocalTrainingBackend.per_token_outputs == frozenset(PER_TOKEN_QUANTITIES)
    backend = LocalTrainingBackend(make_cfg(), model_path, use_critic=False, use_ref=False, total_steps=1)
    assert isinstance(backend, TrainingBackend)
    assert backend.coordinator is SINGLE_PROCESS
    c = backend.coordinator
    assert (c.world_size, c.is_main) == (1, True) and c.broadcast(obj := object()) is obj
    assert backend.consecutive_bad_steps == 0
    backend.close()


def test_policy_loss_requires_reaches_the_loss_row_aligned(model_path):
    # A policy loss that requires a batch field gets, in every micro-batch, the rows of that field
    # that match the other inputs (micro-batches are regrouped by length): here the field is
    # 2 * advantages, so the loss can check the alignment. Without the field: a clear error.
    from rlplug.contracts.types import PolicyLoss

    calls = []

    def checking_loss(
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
        sum_pi_squared,
    ):
        calls.append(len(advantages))
        assert torch.equal(sum_pi_squared, 2 * advantages)
        return rlplug.get_plugin("policy_loss", "vanilla")(
            old_log_probs,
            log_probs,
            advantages,
            response_mask,
            config=config,
            loss_agg_mode=loss_agg_mode,
            normalizer=normalizer,
            max_response_length=max_response_length,
        )

    backend = LocalTrainingBackend(
        make_cfg(**{"actor.micro_batch_size_per_device": 3}), model_path, use_critic=False, use_ref=False, total_steps=1
    )
    backend.policy_loss = PolicyLoss(checking_loss, requires=("sum_pi_squared",))
    batch = prepared_batch(backend)
    with pytest.raises(ValueError, match=r"missing \['sum_pi_squared'\].*old-log-prob pass"):
        backend.update_actor(batch)
    batch["sum_pi_squared"] = 2 * batch["advantages"]
    metrics = backend.update_actor(batch)
    assert calls == [3, 1, 3, 1] and metrics["actor/nonfinite_skipped"] == 0.0  # 2 mini-batches of 4 = 3 + 1
    backend.close()


# --------------------------------------------------------------------------- micro-batch invariance
@pytest.mark.numerics
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_update_actor_micro_batch_invariance(model_path, mode):
    # The same mini-batches (4 responses) processed as one micro-batch, as 4 of 1, and as 3 + 1
    # must give the same parameters, losses and gradient norms (ALGORITHMS.md: micro-batching is
    # memory only). The loss includes the KL loss and an entropy bonus so all terms are covered.
    results = []
    start = None
    for micro in (4, 1, 3):
        cfg = make_cfg(
            **{
                "actor.loss_agg_mode": mode,
                "actor.micro_batch_size_per_device": micro,
                "actor.use_kl_loss": True,
                "actor.kl_loss_type": "low_var_kl",
                "actor.kl_loss_coef": 0.5,
                "actor.entropy_coeff": 0.01,
            }
        )
        backend = LocalTrainingBackend(cfg, model_path, use_critic=False, use_ref=True, total_steps=2)
        start = start or params(backend)  # every backend starts from the same tiny weights
        batch = prepared_batch(backend)
        metrics = backend.update_actor(batch)
        results.append((params(backend), metrics))
        backend.close()
    (p_ref, m_ref) = results[0]
    assert m_ref["actor/pg_clipfrac"] > 0, "the test batch should exercise clipping"
    for p, m in results[1:]:
        assert_updates_close(p, p_ref, start, UPDATE_TERMS)
        for key in (
            "actor/pg_loss",
            "actor/kl_loss",
            "actor/entropy",
            "actor/grad_norm",
            "actor/pg_clipfrac",
            "actor/ppo_kl",
        ):  # means over the tokens of O(1) terms
            assert m[key] == pytest.approx(m_ref[key], rel=0, abs=fp32_atol(UPDATE_TERMS, m_ref[key], floor=1.0)), key


@pytest.mark.numerics
def test_on_policy_update_without_old_log_probs_equals_the_two_pass_update(model_path):
    """One mini-batch, one epoch: an update without ``old_log_probs`` (its own detached log-probs)
    moves the weights exactly like one given the log-probs of a separate pass; the ratio is 1, so
    nothing is clipped. Off-policy (two mini-batches) it still refuses to guess them."""
    results = []
    start = old = None
    for reuse in (False, True):
        cfg = make_cfg(
            **{
                "actor.ppo_mini_batch_size": B // N_SAMPLES,
                "actor.micro_batch_size_per_device": 3,
                "actor.use_kl_loss": True,
                "actor.kl_loss_coef": 0.5,
                "actor.entropy_coeff": 0.01,
            }
        )
        backend = LocalTrainingBackend(cfg, model_path, use_critic=False, use_ref=True, total_steps=2)
        assert "reuses_on_policy_log_probs" in backend.capabilities
        start = start or params(backend)
        batch = make_batch(0)
        batch["ref_log_probs"] = backend.compute_log_probs(batch, which="ref")["log_probs"] + 0.1
        if not reuse:
            batch["old_log_probs"] = old = backend.compute_log_probs(batch)["log_probs"]
        results.append((params(backend), backend.update_actor(batch)))
        backend.close()
    (p_two, m_two), (p_one, m_one) = results
    # the separate pass's log-probs may differ from the update's forward by rounding only
    assert_updates_close(p_one, p_two, start, UPDATE_TERMS)
    assert m_one["actor/ppo_kl"] == 0.0 and m_one["actor/pg_clipfrac"] == 0.0
    assert abs(m_two["actor/ppo_kl"]) <= fp32_atol(LOG_PROB_TERMS, old)  # a mean of old - lp: rounding of the pass
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        assert m_one[key] == pytest.approx(m_two[key], rel=0, abs=fp32_atol(UPDATE_TERMS, m_two[key], floor=1.0)), key

    backend = LocalTrainingBackend(make_cfg(), model_path, use_critic=False, use_ref=False, total_steps=1)
    with pytest.raises(ValueError, match=r"missing \['old_log_probs'\]"):
        backend.update_actor(make_batch(0))  # 2 mini-batches of 4: the second would be off-policy
    backend.close()


@pytest.mark.numerics
def test_micro_batch_of_empty_responses_trains_like_one_big_micro_batch(model_path):
    """Two responses are empty (EOS-less, zero tokens); grouped by length they form a micro-batch
    of their own with nothing to score. The update still runs, and equals the one-micro-batch one."""
    results = []
    start = None
    for micro in (8, 2):
        cfg = make_cfg(**{"actor.ppo_mini_batch_size": B // N_SAMPLES, "actor.micro_batch_size_per_device": micro})
        backend = LocalTrainingBackend(cfg, model_path, use_critic=False, use_ref=False, total_steps=1)
        start = start or params(backend)
        batch = make_batch(0)
        for row in (2, 5):  # shortest prompts too, so the two rows sort first
            batch["attention_mask"][row, P:] = 0
            batch["input_ids"][row, P:] = PAD
            batch["response_mask"][row] = 0.0
            batch["advantages"][row] = 0.0
        batch["position_ids"] = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        batch["responses"] = batch["input_ids"][:, P:]
        lp = backend.compute_log_probs(batch)["log_probs"]
        assert torch.all(lp[[2, 5]] == 0)
        batch["old_log_probs"] = lp
        metrics = backend.update_actor(batch)
        assert metrics["actor/nonfinite_skipped"] == 0 and math.isfinite(metrics["actor/pg_loss"])
        results.append(params(backend))
        backend.close()
    assert_updates_close(results[1], results[0], start, UPDATE_TERMS)


def test_metrics_are_means_over_mini_batches(model_path):
    # With lr = 0 the parameters never move, so each mini-batch's loss is what an update on that
    # mini-batch alone reports; a call over both mini-batches and 2 epochs must report the MEAN
    # of the two (not their sum, and not 4 terms).
    cfg = make_cfg(**{"actor.optim.lr": 0.0, "actor.ppo_epochs": 2})
    backend = LocalTrainingBackend(cfg, model_path, use_critic=False, use_ref=False, total_steps=1)
    batch = prepared_batch(backend)
    before = params(backend)
    both = backend.update_actor(batch)
    first = backend.update_actor(batch.slice(0, 4))
    second = backend.update_actor(batch.slice(4, 8))
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl", "actor/entropy"):
        assert both[key] == pytest.approx((first[key] + second[key]) / 2, rel=1e-5), key
    assert all(torch.equal(before[k], v) for k, v in params(backend).items())


@pytest.mark.numerics
def test_truncated_importance_sampling_scales_the_policy_loss(model_path):
    # actor.rollout_is_threshold = 2: the objective hands the token weight min(exp(old - rollout), 2)
    # to the policy loss, which multiplies each token's surrogate loss by it. rollout = old + ln 2
    # gives weight 1/2 everywhere -> pg_loss halves; rollout = old - ln 4 gives 4, truncated to 2
    # -> pg_loss doubles. lr = 0 keeps the policy fixed between the calls.
    cfg = make_cfg(**{"actor.optim.lr": 0.0, "actor.rollout_is_threshold": 2.0})
    backend = LocalTrainingBackend(cfg, model_path, use_critic=False, use_ref=False, total_steps=1)
    batch = prepared_batch(backend)
    with pytest.raises(ValueError, match="rollout.calculate_log_probs=true"):
        backend.update_actor(batch)
    # each weight exp(old - rollout) is computed from log-probs of magnitude |old| + ln 4: the shift,
    # the difference and exp round at that magnitude (relative error of the weight); the metric and
    # the loss are means over a mini-batch's 4 x T tokens (per-token losses O(1))
    log_scale = float(batch["old_log_probs"].abs().max()) + math.log(4.0)
    rel = reduction_tolerance(torch.float32, 3, log_scale) + reduction_tolerance(torch.float32, 4 * T, 1.0)
    losses = {}
    for name, shift in (("one", 0.0), ("half", math.log(2.0)), ("capped", -math.log(4.0))):
        batch["rollout_log_probs"] = batch["old_log_probs"] + shift
        m = backend.update_actor(batch)
        losses[name] = m["actor/pg_loss"]
        assert m["actor/rollout_is_weight"] == pytest.approx({"one": 1.0, "half": 0.5, "capped": 2.0}[name], rel=rel)
    per_token = max(1.0, abs(losses["one"]))
    assert losses["half"] == pytest.approx(0.5 * losses["one"], rel=0, abs=0.5 * rel * per_token)
    assert losses["capped"] == pytest.approx(2.0 * losses["one"], rel=0, abs=2.0 * rel * per_token)
    backend.close()


# --------------------------------------------------------------------------- one step by hand
@pytest.mark.numerics
def test_one_step_against_hand_computed_adamw(model_path):
    # One mini-batch (ppo_mini_batch_size = 4 prompts = all 8 responses), one micro-batch, token-mean.
    # Loss = PPO clipped surrogate (clip 0.15) + 0.3 * low_var_kl(lp, ref) - 0.01 * entropy, grad clip
    # 0.05, AdamW with weight decay, warmup 2 steps (first step at lr / 2). Reference written out
    # here: full-logits forward; per token
    #   ratio = exp(lp - old), pg = max(-A ratio, -A clamp(ratio, 1 - 0.15, 1 + 0.15)),
    #   kl = exp(x) - x - 1 with x = ref - lp (Schulman's k3), entropy = -sum_v p log p;
    # torch's clip_grad_norm_ rule (scale = max_norm / (norm + 1e-6) when below 1) and the AdamW
    # formulas (Loshchilov & Hutter) for step 1:
    #   m = (1 - b1) g, v = (1 - b2) g^2, m_hat = m / (1 - b1), v_hat = v / (1 - b2)
    #   p <- p * (1 - lr * wd) - lr * m_hat / (sqrt(v_hat) + eps)
    lr, wd, eps, b1, b2, clip, max_norm, kl_coef, ent_coef = 2e-3, 0.1, 1e-3, 0.8, 0.9, 0.15, 0.05, 0.3, 0.01
    cfg = make_cfg(
        **{
            "actor.ppo_mini_batch_size": 4,
            "actor.micro_batch_size_per_device": 8,
            "actor.optim.lr": lr,
            "actor.optim.weight_decay": wd,
            "actor.optim.eps": eps,
            "actor.optim.betas": [b1, b2],
            "actor.optim.lr_warmup_steps": 2,
            "actor.clip_ratio": clip,
            "actor.grad_clip": max_norm,
            "actor.use_kl_loss": True,
            "actor.kl_loss_type": "low_var_kl",
            "actor.kl_loss_coef": kl_coef,
            "actor.entropy_coeff": ent_coef,
        }
    )
    backend = LocalTrainingBackend(cfg, model_path, use_critic=False, use_ref=False, total_steps=3)
    batch = prepared_batch(backend)
    g = torch.Generator().manual_seed(7)
    batch["ref_log_probs"] = batch["old_log_probs"] + 0.2 * torch.randn(B, T, generator=g)

    from rlplug.training.models import load_causal_lm

    model = load_causal_lm(model_path)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    logits = (
        model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).logits.float()
        / 0.8
    )
    logp = torch.log_softmax(logits[:, P - 1 : P + T - 1], -1)
    lp = logp.gather(-1, batch["responses"][..., None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    mask, adv, old, ref = batch["response_mask"], batch["advantages"], batch["old_log_probs"], batch["ref_log_probs"]
    ratio = torch.exp(lp - old)
    pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip, 1 + clip))
    x = ref - lp
    kl = torch.exp(x) - x - 1
    n_tokens = mask.sum()
    pg_loss, kl_loss, ent = (
        (pg * mask).sum() / n_tokens,
        (kl * mask).sum() / n_tokens,
        (entropy * mask).sum() / n_tokens,
    )
    (pg_loss + kl_coef * kl_loss - ent_coef * ent).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values()))
    scale = min(1.0, max_norm / (float(norm) + 1e-6))
    step_lr = lr * 0.5  # warmup: (0 + 1) / 2
    expected = {}
    for n, p in model.named_parameters():
        g = grads[n] * scale
        m_hat = (1 - b1) * g / (1 - b1)
        v_hat = (1 - b2) * g * g / (1 - b2)
        expected[n] = p.detach() * (1 - step_lr * wd) - step_lr * m_hat / (v_hat.sqrt() + eps)

    metrics = backend.update_actor(batch)
    # the backend's micro-batch against this full-batch reference: float32 rounding of the forward,
    # then a mean over the B x T tokens, at the magnitude of the log-probs the terms are made of
    loss_tol = fp32_atol(LOG_PROB_TERMS + B * T, lp.detach(), logits.detach(), floor=1.0)
    assert metrics["actor/pg_loss"] == pytest.approx(float(pg_loss.detach()), rel=0, abs=loss_tol)
    assert metrics["actor/kl_loss"] == pytest.approx(float(kl_loss.detach()), rel=0, abs=loss_tol)
    assert metrics["actor/entropy"] == pytest.approx(float(ent.detach()), rel=0, abs=loss_tol)
    # the gradient's chain, then clip_grad_norm_'s float32 sum of squares over the largest tensor
    norm_terms = UPDATE_TERMS + max(p.numel() for p in start.values())
    assert metrics["actor/grad_norm"] == pytest.approx(float(norm), rel=0, abs=fp32_atol(norm_terms, norm))
    assert metrics["actor/lr"] == pytest.approx(step_lr)
    assert metrics["actor/nonfinite_skipped"] == 0.0
    assert_updates_close(params(backend), expected, start, UPDATE_TERMS)
    backend.close()


# --------------------------------------------------------------------------- non-finite handling
def test_nan_advantages_skip_the_step(model_path, caplog):
    cfg = make_cfg(**{"actor.ppo_mini_batch_size": 4})  # one mini-batch
    backend = LocalTrainingBackend(cfg, model_path, use_critic=False, use_ref=False, total_steps=2)
    batch = prepared_batch(backend)
    batch["advantages"] = batch["advantages"].clone()
    batch["advantages"][0, 0] = float("nan")
    before = params(backend)
    with caplog.at_level(logging.WARNING, logger="rlplug.plugins.training.local"):
        metrics = backend.update_actor(batch)
    assert metrics["actor/nonfinite_skipped"] == 1.0
    assert backend.consecutive_bad_steps == 1
    assert "actor loss" in caplog.text
    assert all(torch.equal(before[k], v) for k, v in params(backend).items())
    assert not backend.actor.optimizer.state, "a skipped step must leave no optimizer state"
    # a good batch afterwards steps and resets the counter
    good = prepared_batch(backend)
    metrics = backend.update_actor(good)
    assert metrics["actor/nonfinite_skipped"] == 0.0 and backend.consecutive_bad_steps == 0
    assert not all(torch.equal(before[k], v) for k, v in params(backend).items())
    backend.close()


def test_nonfinite_gradient_skips_the_step(model_path, caplog):
    # finite loss, NaN gradient (injected by a hook on one parameter): the grad-norm stage skips
    cfg = make_cfg(**{"actor.ppo_mini_batch_size": 4})
    backend = LocalTrainingBackend(cfg, model_path, use_critic=False, use_ref=False, total_steps=2)
    batch = prepared_batch(backend)
    param = backend.actor.model.model.norm.weight
    handle = param.register_hook(lambda g: g * float("nan"))
    before = params(backend)
    with caplog.at_level(logging.WARNING, logger="rlplug.plugins.training.local"):
        metrics = backend.update_actor(batch)
    handle.remove()
    assert metrics["actor/nonfinite_skipped"] == 1.0 and backend.consecutive_bad_steps == 1
    assert "actor gradient norm" in caplog.text
    assert all(torch.equal(before[k], v) for k, v in params(backend).items())
    backend.close()


def test_batch_not_divisible_by_mini_batch(model_path):
    backend = LocalTrainingBackend(make_cfg(), model_path, use_critic=False, use_ref=False, total_steps=1)
    batch = prepared_batch(backend).slice(0, 6)
    with pytest.raises(ValueError, match="6 responses, which does not split into mini-batches of 4"):
        backend.update_actor(batch)
    del batch.tensors["old_log_probs"]
    with pytest.raises(ValueError, match=r"missing \['old_log_probs'\]"):
        backend.update_actor(batch)
    with pytest.raises(ValueError, match="compute_log_probs: the batch is empty"):
        backend.compute_log_probs(batch.slice(0, 0))
    backend.close()


# --------------------------------------------------------------------------- critic
@pytest.mark.numerics
def test_critic_values_and_update(model_path):
    results = []
    start = None
    for micro in (4, 3):
        cfg = make_cfg(**{"critic.micro_batch_size_per_device": micro, "critic.optim.lr": 1e-2})
        backend = LocalTrainingBackend(cfg, model_path, use_critic=True, use_ref=False, total_steps=1)
        start = start or params(backend, "critic")
        batch = prepared_batch(backend)
        with torch.no_grad():
            full = backend.critic.model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
        # value of response token j is read at position P - 1 + j (micro-batches against the full batch)
        want = full[:, P - 1 : P + T - 1] * batch["response_mask"]
        torch.testing.assert_close(batch["values"], want, rtol=0, atol=fp32_atol(VALUE_TERMS, want))
        metrics = backend.update_critic(batch)
        assert set(metrics) == {
            "critic/vf_loss",
            "critic/vf_clipfrac",
            "critic/grad_norm",
            "critic/lr",
            "critic/nonfinite_skipped",
        }
        results.append((params(backend, "critic"), metrics))
        backend.close()
    (p0, m0), (p1, m1) = results
    assert_updates_close(p1, p0, start, CRITIC_UPDATE_TERMS, what="critic ")
    for key in ("critic/vf_loss", "critic/grad_norm"):  # means over the tokens of O(1) terms
        assert m1[key] == pytest.approx(m0[key], rel=0, abs=fp32_atol(CRITIC_UPDATE_TERMS, m0[key], floor=1.0)), key


@pytest.mark.numerics
def test_critic_follows_actor_loss_scale_factor(model_path):
    # seq-mean-token-sum-norm divides each sequence's token sum by H: H = data.max_response_length (T)
    # by default, actor.loss_scale_factor when set (verl's critic defaults to the actor's factor), so
    # H = 4 T gives a quarter of the value loss on the same batch.
    losses = []
    for factor in (None, 4 * T):
        cfg = make_cfg(**{"critic.loss_agg_mode": "seq-mean-token-sum-norm", "actor.loss_scale_factor": factor})
        backend = LocalTrainingBackend(cfg, model_path, use_critic=True, use_ref=False, total_steps=1)
        losses.append(backend.update_critic(prepared_batch(backend))["critic/vf_loss"])
        backend.close()
    # the same forward and backward, only the final division differs: one rounding
    assert losses[1] == pytest.approx(losses[0] / 4, rel=0, abs=reduction_tolerance(torch.float32, 1, losses[0] / 4))


# --------------------------------------------------------------------------- weights, save/load, export
def test_actor_weights_are_hf_names_without_tied_duplicate(model_path):
    backend = LocalTrainingBackend(make_cfg(), model_path, use_critic=False, use_ref=False, total_steps=1)
    weights = dict(backend.actor_weights())
    state = backend.actor.model.state_dict()
    # tied embeddings: lm_head.weight is the embedding matrix and appears once, as in HF files
    assert set(state) - set(weights) == {"lm_head.weight"}
    assert all(weights[k].data_ptr() == state[k].data_ptr() for k in weights), "weights must not be copied"
    backend.close()


def test_save_load_continues_bitwise(model_path, tmp_path):
    cfg = make_cfg(**{"actor.optim.eps": 1e-8, "actor.optim.lr_warmup_steps": 3, "actor.optim.warmup_style": "cosine"})
    batches = [make_batch(seed) for seed in range(3)]
    a = LocalTrainingBackend(cfg, model_path, use_critic=True, use_ref=False, total_steps=3)

    def step(backend, batch):
        batch = Batch(dict(batch.tensors))
        batch["old_log_probs"] = backend.compute_log_probs(batch)["log_probs"] - 0.1
        batch["values"] = backend.compute_values(batch)
        backend.update_critic(batch)
        return backend.update_actor(batch)

    lrs = [step(a, batches[0])["actor/lr"], step(a, batches[1])["actor/lr"]]
    a.save(tmp_path / "ckpt")
    last_a = step(a, batches[2])
    # schedule: 3 steps x 2 mini-batches = 6 optimizer steps, warmup 3, then cosine to 0 over 3;
    # per optimizer step the factors are 1/3, 2/3 | 1, 1 | 0.5(1 + cos(pi/3)) = 0.75,
    # 0.5(1 + cos(2 pi/3)) = 0.25, and each call reports the mean of its two.
    lr = cfg.actor.optim.lr
    assert lrs + [last_a["actor/lr"]] == pytest.approx([0.5 * lr, 1.0 * lr, 0.5 * lr])
    b = LocalTrainingBackend(cfg, model_path, use_critic=True, use_ref=False, total_steps=3)
    b.load(tmp_path / "ckpt")
    last_b = step(b, batches[2])
    for role in ("actor", "critic"):
        pa, pb = params(a, role), params(b, role)
        assert all(torch.equal(pa[k], pb[k]) for k in pa), role
    assert last_a == last_b  # identical metrics, including the scheduled learning rate
    a.close()
    b.close()


def test_export_hf_loads_with_identical_logits(model_path, tmp_path):
    from transformers import AutoModelForCausalLM

    from rlplug.training.models import load_tokenizer

    backend = LocalTrainingBackend(make_cfg(), model_path, use_critic=False, use_ref=False, total_steps=1)
    backend.update_actor(prepared_batch(backend))
    out = backend.export_hf(tmp_path / "hf", load_tokenizer(model_path))
    assert (out / "tokenizer_config.json").is_file() and (out / "config.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    # model.attn_implementation=auto trains with eager attention on a CPU; compare with the same kernel
    assert backend.attn_implementation == "eager"
    loaded.set_attn_implementation("eager")
    batch = make_batch(5)
    kwargs = dict(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
    )
    with torch.no_grad():
        assert torch.equal(loaded(**kwargs).logits, backend.actor.model(**kwargs).logits)
    backend.close()


def test_saved_actor_is_what_rlplug_export_reads(model_path, tmp_path):
    # rlplug.run.export.export_checkpoint rebuilds the HF model from backend/actor/model.safetensors
    # plus hf_meta/ (config + tokenizer); the result must reproduce the trained actor exactly.
    import shutil

    from transformers import AutoModelForCausalLM

    from rlplug.run.export import export_checkpoint
    from rlplug.training.models import load_tokenizer

    backend = LocalTrainingBackend(make_cfg(), model_path, use_critic=False, use_ref=False, total_steps=1)
    backend.update_actor(prepared_batch(backend))
    ckpt = tmp_path / "global_step_1"
    backend.save(ckpt / "backend")
    (ckpt / "hf_meta").mkdir()
    shutil.copy(f"{model_path}/config.json", ckpt / "hf_meta" / "config.json")
    load_tokenizer(model_path).save_pretrained(ckpt / "hf_meta")
    (ckpt / "COMPLETE").write_text("")
    out = export_checkpoint(ckpt, tmp_path / "exported")
    loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    loaded.set_attn_implementation(backend.attn_implementation)  # eager: the backend's kernel on a CPU
    batch = make_batch(6)
    kwargs = dict(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
    )
    with torch.no_grad():
        assert torch.equal(loaded(**kwargs).logits, backend.actor.model(**kwargs).logits)
    backend.close()


# --------------------------------------------------------------------------- precision, checkpointing
@pytest.mark.numerics
def test_gradient_checkpointing_gives_the_same_update(model_path):
    # activation checkpointing recomputes the same forward: same parameters after an update
    results = []
    start = None
    for ckpt in (False, True):
        cfg = make_cfg(**{"model.enable_gradient_checkpointing": ckpt, "actor.micro_batch_size_per_device": 2})
        backend = LocalTrainingBackend(cfg, model_path, use_critic=True, use_ref=False, total_steps=1)
        assert backend.actor.model.is_gradient_checkpointing == ckpt
        start = start or (params(backend), params(backend, "critic"))
        batch = prepared_batch(backend)
        backend.update_critic(batch)
        backend.update_actor(batch)
        results.append((params(backend), params(backend, "critic")))
        backend.close()
    for a, b, begin, terms in zip(results[0], results[1], start, (UPDATE_TERMS, CRITIC_UPDATE_TERMS)):
        assert_updates_close(b, a, begin, terms)


@pytest.mark.numerics
def test_bf16_autocast_keeps_fp32_master_weights(model_path):
    fp32 = LocalTrainingBackend(make_cfg(), model_path, use_critic=False, use_ref=False, total_steps=1)
    bf16 = LocalTrainingBackend(
        make_cfg(**{"model.compute_dtype": "bf16"}), model_path, use_critic=False, use_ref=False, total_steps=1
    )
    assert bf16.autocast_dtype == torch.bfloat16  # CPU supports bf16 autocast
    batch = make_batch()
    lp32 = fp32.compute_log_probs(batch)["log_probs"]
    lp16 = bf16.compute_log_probs(batch)["log_probs"]
    assert lp16.dtype == torch.float32
    assert not torch.equal(lp16, lp32)  # really computed in bf16 ...
    # ... and close: bf16 keeps ~3 significant digits, so most log-probs agree to 0.02 nats; the tiny
    # random model has large logits (init std 0.2), where a rare token can be off by a few tenths.
    diff = (lp16 - lp32).abs()
    assert diff.median() < 0.02 and diff.max() < 0.5, (diff.median(), diff.max())
    batch["old_log_probs"] = lp16
    metrics = bf16.update_actor(batch)
    assert math.isfinite(metrics["actor/grad_norm"]) and metrics["actor/nonfinite_skipped"] == 0
    assert all(p.dtype == torch.float32 for p in bf16.actor.model.parameters())
    fp32.close()
    bf16.close()
