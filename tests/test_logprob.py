"""Chunked log-probs / entropy (rlplug.algorithms.logprob) against the naive full-logits computation."""

from __future__ import annotations

import math

import pytest
import torch
from _helpers import fp32_atol

from rlplug.algorithms.logprob import (
    lm_head_of,
    log_probs_from_hidden,
    response_log_probs,
    response_token_stats,
    token_stats_from_hidden,
    trim_padding_columns,
)
from rlplug.testing import reduction_tolerance


def naive(hidden, weight, labels, temperature=1.0, bias=None):
    """Reference: full (N, V) logits, log_softmax, gather; entropy -sum p log p."""
    logits = torch.nn.functional.linear(hidden, weight, bias).float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, labels[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


pytestmark = pytest.mark.numerics


def head_terms(h: int, v: int, tokens: int = 0) -> int:
    """float32 reduction lengths along the head's chain (``rlplug.testing.reduction_tolerance``):
    the logits' dot product over the hidden size ``h``, then the log-sum-exp and the entropy's sum
    over the vocabulary ``v``; with ``tokens`` the backward retraces the chain and the weight
    gradient sums over the tokens."""
    forward = h + 2 * v
    return 2 * forward + tokens if tokens else forward


def assert_fp32_close(got, ref, n_terms, *extra_scale, **kw):
    """Two float32 evaluations of the same quantity in another operation order (chunks, fused
    backward, another kernel): equal up to the rounding of ``n_terms`` terms at the magnitude of
    ``ref`` (and of ``extra_scale``, e.g. the logits a log-prob is a difference of)."""
    torch.testing.assert_close(got, ref, rtol=0, atol=fp32_atol(n_terms, ref, *extra_scale), **kw)


def _inputs(n=37, h=16, v=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * 0.5
    labels = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, labels


def test_uniform_logits_hand_value():
    # Zero weights give equal logits over V = 8 tokens: log p = -ln 8 for every label and the
    # entropy is ln 8 (the maximum), whatever the temperature.
    hidden = torch.randn(5, 3)
    weight = torch.zeros(8, 3)
    labels = torch.tensor([0, 7, 3, 3, 1])
    lp, ent = log_probs_from_hidden(hidden, weight, labels, temperature=0.7, chunk_size=2, with_entropy=True)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    torch.testing.assert_close(lp, torch.full((5,), -math.log(8.0)))
    torch.testing.assert_close(ent, torch.full((5,), math.log(8.0)))


def test_two_token_hand_value():
    # V = 2, logits (h.w0, h.w1) = (2, 0) for h = [1], w = [[2], [0]]; temperature 2 -> (1, 0).
    # log p(token 0) = 1 - ln(e + 1) = -0.31326...; log p(token 1) = -ln(e + 1) = -1.31326...
    # entropy = -(p0 ln p0 + p1 ln p1) with p0 = e/(e+1) = 0.73106.
    hidden = torch.tensor([[1.0], [1.0]])
    weight = torch.tensor([[2.0], [0.0]])
    lp, ent = log_probs_from_hidden(hidden, weight, torch.tensor([0, 1]), temperature=2.0, with_entropy=True)
    p0 = math.e / (math.e + 1)
    torch.testing.assert_close(lp, torch.tensor([1 - math.log(math.e + 1), -math.log(math.e + 1)]))
    h = -(p0 * math.log(p0) + (1 - p0) * math.log(1 - p0))
    torch.testing.assert_close(ent, torch.tensor([h, h]))


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 37, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_values_match_naive(chunk_size, temperature):
    hidden, weight, labels = _inputs()
    bias = torch.randn(weight.shape[0], dtype=torch.float64)
    for b in (None, bias):
        lp, ent = log_probs_from_hidden(
            hidden.float(),
            weight.float(),
            labels,
            temperature=temperature,
            chunk_size=chunk_size,
            with_entropy=True,
            lm_head_bias=None if b is None else b.float(),
        )
        ref_lp, ref_ent = naive(hidden, weight, labels, temperature, b)
        logits = torch.nn.functional.linear(hidden, weight, b) / temperature
        assert_fp32_close(lp, ref_lp.float(), head_terms(16, 50), logits)
        assert_fp32_close(ent, ref_ent.float(), head_terms(16, 50), logits)
    lp2, none = log_probs_from_hidden(hidden.float(), weight.float(), labels, chunk_size=chunk_size)
    assert none is None
    ref_lp2 = naive(hidden, weight, labels)[0].float()
    assert_fp32_close(lp2, ref_lp2, head_terms(16, 50), torch.nn.functional.linear(hidden, weight))


@pytest.mark.parametrize("chunk_size", [1, 7, 37, 100])
def test_gradients_match_naive(chunk_size):
    # float64 inputs, but both paths compute the logits' softmax in float32: they agree to float32
    # rounding of the head's forward and backward over the 37 tokens.
    hidden, weight, labels = _inputs(seed=1)
    g = torch.Generator().manual_seed(2)
    w_lp = torch.randn(hidden.shape[0], generator=g, dtype=torch.float64)
    w_ent = torch.randn(hidden.shape[0], generator=g, dtype=torch.float64)

    def grads(fn):
        h = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        lp, ent = fn(h, w)
        ((lp.double() * w_lp).sum() + (ent.double() * w_ent).sum()).backward()
        return h.grad, w.grad

    def ours(h, w):
        # keep float64 through the chunk: the function casts logits to float32, so compare in fp32
        return log_probs_from_hidden(h, w, labels, temperature=0.8, chunk_size=chunk_size, with_entropy=True)

    gh, gw = grads(ours)
    rh, rw = grads(lambda h, w: naive(h, w, labels, 0.8))
    assert_fp32_close(gh, rh, head_terms(16, 50, 37))
    assert_fp32_close(gw, rw, head_terms(16, 50, 37))


def test_no_vocab_sized_tensor_is_kept_for_the_backward():
    # With autograd on, the fused function keeps nothing of shape (rows, V) for the backward pass
    # (it recomputes each chunk's logits there). The same hook on the naive computation does see (N, V) tensors, which shows
    # the hook observes what autograd saves.
    hidden, weight, labels = _inputs(n=12, h=4, v=300)

    def saved_shapes(fn):
        h = hidden.float().requires_grad_(True)
        w = weight.float().requires_grad_(True)
        saved: list[tuple[int, ...]] = []

        def pack(t):
            saved.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            lp, ent = fn(h, w)
        (lp.sum() + ent.sum()).backward()
        assert h.grad is not None and w.grad is not None
        return saved

    naive_saved = saved_shapes(lambda h, w: naive(h, w, labels))
    assert (12, 300) in naive_saved
    ours_saved = saved_shapes(lambda h, w: log_probs_from_hidden(h, w, labels, chunk_size=4, with_entropy=True))
    assert not any(s and s[-1] == 300 for s in ours_saved), f"vocabulary-sized tensor kept: {ours_saved}"
    # one chunk holding every row keeps none either: the fused backward recomputes the chunk's logits
    single = saved_shapes(lambda h, w: log_probs_from_hidden(h, w, labels, chunk_size=12, with_entropy=True))
    assert not any(s and s[-1] == 300 for s in single), f"vocabulary-sized tensor kept: {single}"
    # what it keeps: hidden (12, 4), W (300, 4), and (12,) log-sum-exp and entropy
    assert sorted(single) == sorted([(12, 4), (300, 4), (12,), (12,), (12,)])


def test_bad_inputs_raise_clear_errors():
    hidden, weight, labels = _inputs(n=4, h=3, v=5)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        log_probs_from_hidden(hidden, weight, labels, temperature=0.0)
    with pytest.raises(ValueError, match=r"labels must be token ids in \[0, 5\)"):
        log_probs_from_hidden(hidden, weight, torch.tensor([0, 1, 5, 2]))
    with pytest.raises(ValueError, match="expects hidden"):
        log_probs_from_hidden(hidden[None], weight, labels)
    with pytest.raises(ValueError, match="shapes disagree"):
        log_probs_from_hidden(hidden, weight[:, :2], labels)
    with pytest.raises(ValueError, match="chunk_size"):
        log_probs_from_hidden(hidden, weight, labels, chunk_size=0)


# --------------------------------------------------------------------------- with a tiny HF model
@pytest.fixture(scope="module")
def tiny_lm():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg).eval()


def tiny_lm_terms(seq_len: int = 7, tokens: int = 0) -> int:
    """float32 reduction lengths along ``tiny_lm``'s longest chain (as ``_helpers.tiny_chain_terms``
    counts them): per layer the norm, q/k/v, attention scores (head size 8), softmax and weighted
    sum (2 x ``seq_len``), output projection, second norm, gate/up (hidden 32) and down (64); then
    the final norm, the head and the log-sum-exp over the 97-token vocabulary. With ``tokens``, the
    backward retraces it and a weight gradient sums over the tokens."""
    forward = 2 * (5 * 32 + 8 + 2 * seq_len + 64) + 2 * 32 + 97
    return 2 * forward + tokens if tokens else forward


def _prompt_response_batch(vocab=97):
    # 3 responses, left-padded prompts (P = 4), right-padded responses (T = 3)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, vocab, (3, 7), generator=g)
    attn = torch.ones(3, 7, dtype=torch.long)
    attn[1, :2] = 0  # prompt of row 1 has 2 real tokens
    attn[2, 6] = 0  # response of row 2 has 2 tokens
    ids[attn == 0] = 0
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": attn, "position_ids": pos}


def test_response_log_probs_match_model_logits(tiny_lm):
    batch = _prompt_response_batch()
    assert lm_head_of(tiny_lm) is not None
    with torch.no_grad():
        lp, ent = response_log_probs(tiny_lm, batch, 3, temperature=0.9, chunk_size=4, with_entropy=True)
        logits = tiny_lm(**batch).logits.float() / 0.9  # (B, L, V)
    # position p predicts token p+1: positions 3..5 predict response tokens 4..6
    ref_logp = torch.log_softmax(logits[:, 3:6], -1)
    ref_lp = ref_logp.gather(-1, batch["input_ids"][:, 4:7, None]).squeeze(-1)
    ref_ent = -(ref_logp.exp() * ref_logp).sum(-1)
    assert lp.shape == (3, 3) and ent.shape == (3, 3)
    real = batch["attention_mask"][:, 4:].bool()
    assert_fp32_close(lp[real], ref_lp[real], tiny_lm_terms(), logits)
    assert_fp32_close(ent[real], ref_ent[real], tiny_lm_terms(), logits)
    # the one padding position (row 2's 3rd response token) is not computed: 0.0
    assert lp[2, 2] == 0.0 and ent[2, 2] == 0.0 and int((~real).sum()) == 1


def test_all_padding_columns_are_trimmed_and_outputs_unchanged(tiny_lm):
    """Widen the batch with a prompt column and a response column that are padding in every
    row: the forward runs on the original 7 columns and every real position gets the same values."""
    batch = _prompt_response_batch()
    wide = {
        k: torch.cat([torch.zeros(3, 1, dtype=v.dtype), v, torch.zeros(3, 1, dtype=v.dtype)], dim=1)
        for k, v in batch.items()
    }
    trimmed, t = trim_padding_columns(wide, 4)
    assert t == 3 and all(torch.equal(trimmed[k], batch[k]) for k in batch)
    with torch.no_grad():
        lp, ent = response_log_probs(tiny_lm, batch, 3, with_entropy=True)
        lp_w, ent_w = response_log_probs(tiny_lm, wide, 4, with_entropy=True)
    assert lp_w.shape == (3, 4)
    assert_fp32_close(lp_w[:, :3], lp, tiny_lm_terms(8), lp)  # the wide batch's attention sums over 8 columns
    assert_fp32_close(ent_w[:, :3], ent, tiny_lm_terms(8), lp)
    assert torch.all(lp_w[:, 3] == 0) and torch.all(ent_w[:, 3] == 0)
    # without position_ids the model numbers positions by column: only trailing columns may go
    no_pos = {k: v for k, v in wide.items() if k != "position_ids"}
    trimmed, t = trim_padding_columns(no_pos, 4)
    assert (
        t == 3 and trimmed["input_ids"].shape == (3, 8) and torch.equal(trimmed["input_ids"], wide["input_ids"][:, :8])
    )
    # a response region that is all padding keeps one column (it is what the last prompt token predicts)
    empty = {k: v.clone() for k, v in batch.items()}
    empty["attention_mask"][:, 4:] = 0
    assert trim_padding_columns(empty, 3)[1] == 1


def test_response_log_probs_fallback_path(tiny_lm, monkeypatch):
    # A model with soft-capped logits must go through its own logits; here we fake one by setting
    # the config attribute, and check both paths agree while the soft-capping value is inert.
    batch = _prompt_response_batch()
    with torch.no_grad():
        fast, _ = response_log_probs(tiny_lm, batch, 3)
    monkeypatch.setattr(tiny_lm.config, "final_logit_softcapping", 30.0, raising=False)
    assert lm_head_of(tiny_lm) is None
    with torch.no_grad():
        slow, ent = response_log_probs(tiny_lm, batch, 3, with_entropy=True)
    real = batch["attention_mask"][:, 4:].bool()
    assert_fp32_close(fast[real], slow[real], tiny_lm_terms())
    assert ent.shape == (3, 3)


def test_response_log_probs_gradient_matches_full_logits(tiny_lm):
    batch = _prompt_response_batch()
    mask = batch["attention_mask"][:, 4:].float()
    lp, _ = response_log_probs(tiny_lm, batch, 3, chunk_size=2)
    (lp * mask).sum().backward()
    ours = {n: p.grad.clone() for n, p in tiny_lm.named_parameters()}
    tiny_lm.zero_grad()
    logits = tiny_lm(**batch).logits.float()
    ref = torch.log_softmax(logits[:, 3:6], -1).gather(-1, batch["input_ids"][:, 4:7, None]).squeeze(-1)
    (ref * mask).sum().backward()
    ref_grads = {n: p.grad for n, p in tiny_lm.named_parameters()}
    for n, p in tiny_lm.named_parameters():
        # relative to the whole model's gradient: a parameter's gradient is a chain of the others'
        assert_fp32_close(ours[n], p.grad, tiny_lm_terms(tokens=21), *ref_grads.values(), msg=n)
    tiny_lm.zero_grad()


def test_response_length_checked(tiny_lm):
    batch = _prompt_response_batch()
    with pytest.raises(ValueError, match="response_length must be between 1 and L - 1 = 6"):
        response_log_probs(tiny_lm, batch, 7)


# --------------------------------------------------------------------------- sum_pi_squared (extras)
def test_sum_pi_squared_hand_values():
    # Zero weights: V = 8 equal logits, p = 1/8 each, sum p^2 = 8 / 64 = 1/8 (the minimum).
    # V = 2 with logits (2, 0) at temperature 2 -> (1, 0): p0 = e / (e + 1) = 0.73106, p1 = 1 - p0,
    # sum p^2 = p0^2 + p1^2 = 0.60669...
    out = token_stats_from_hidden(
        torch.randn(5, 3),
        torch.zeros(8, 3),
        torch.tensor([0, 7, 3, 3, 1]),
        temperature=0.7,
        chunk_size=2,
        extras=("sum_pi_squared",),
    )
    assert set(out) == {"log_probs", "sum_pi_squared"}
    assert out["sum_pi_squared"].dtype == torch.float32
    torch.testing.assert_close(out["sum_pi_squared"], torch.full((5,), 1 / 8))
    p0 = math.e / (math.e + 1)
    out = token_stats_from_hidden(
        torch.tensor([[1.0]]),
        torch.tensor([[2.0], [0.0]]),
        torch.tensor([1]),
        temperature=2.0,
        extras=("sum_pi_squared", "entropy"),
    )
    torch.testing.assert_close(out["sum_pi_squared"], torch.tensor([p0**2 + (1 - p0) ** 2]))
    torch.testing.assert_close(out["entropy"], torch.tensor([-(p0 * math.log(p0) + (1 - p0) * math.log(1 - p0))]))


@pytest.mark.parametrize("chunk_size", [1, 5, 1024])
def test_sum_pi_squared_matches_naive_and_leaves_log_probs_unchanged(chunk_size):
    hidden, weight, labels = _inputs()
    hidden, weight = hidden.float(), weight.float()
    out = token_stats_from_hidden(
        hidden, weight, labels, temperature=0.6, chunk_size=chunk_size, with_entropy=True, extras=("sum_pi_squared",)
    )
    p = torch.softmax(torch.nn.functional.linear(hidden.double(), weight.double()) / 0.6, dim=-1)
    # float32 against a float64 reference: a dot product over the hidden size, softmax and sum over V
    assert_fp32_close(out["sum_pi_squared"].double(), (p * p).sum(-1), head_terms(16, 50), 1.0)
    # the extra does not change what the two-output form computes, bit for bit
    lp, ent = log_probs_from_hidden(hidden, weight, labels, temperature=0.6, chunk_size=chunk_size, with_entropy=True)
    assert torch.equal(out["log_probs"], lp) and torch.equal(out["entropy"], ent)


def test_unknown_extra_names_the_valid_ones():
    hidden, weight, labels = _inputs(n=4)
    with pytest.raises(
        ValueError, match=r"unknown per-token quantity \['sum_pi_sq'\].*valid: \['entropy', 'sum_pi_squared'\]"
    ):
        token_stats_from_hidden(hidden, weight, labels, extras=("sum_pi_sq",))


def test_response_sum_pi_squared_matches_model_logits(tiny_lm, monkeypatch):
    # against the model's full (B, L, V) logits: per response token, sum_v softmax(logits / 0.9)_v^2;
    # 0.0 at the padding position, as the log-probs
    batch = _prompt_response_batch()
    with torch.no_grad():
        out = response_token_stats(tiny_lm, batch, 3, temperature=0.9, chunk_size=4, extras=("sum_pi_squared",))
        probs = torch.softmax(tiny_lm(**batch).logits.float()[:, 3:6] / 0.9, -1)  # positions 3..5 predict 4..6
        lp, _ = response_log_probs(tiny_lm, batch, 3, temperature=0.9, chunk_size=4)
    assert set(out) == {"log_probs", "sum_pi_squared"} and out["sum_pi_squared"].shape == (3, 3)
    real = batch["attention_mask"][:, 4:].bool()
    assert_fp32_close(out["sum_pi_squared"][real], (probs * probs).sum(-1)[real], tiny_lm_terms(), 1.0)
    assert out["sum_pi_squared"][2, 2] == 0.0
    assert torch.equal(out["log_probs"], lp)
    # the full-logits fallback (as for a soft-capped head; the attribute is inert in Llama) agrees
    monkeypatch.setattr(tiny_lm.config, "final_logit_softcapping", 30.0, raising=False)
    assert lm_head_of(tiny_lm) is None
    with torch.no_grad():
        slow = response_token_stats(tiny_lm, batch, 3, temperature=0.9, extras=("sum_pi_squared",))
    assert_fp32_close(slow["sum_pi_squared"], out["sum_pi_squared"], tiny_lm_terms(), 1.0)
    assert slow["sum_pi_squared"][2, 2] == 0.0


@pytest.mark.parametrize("chunk_size", [1, 8, 1024])
def test_fused_bias_gradient_and_bf16_autocast_match_the_naive_graph(chunk_size):
    # The fused function's hand-written backward against autograd through the naive formula: with a
    # bias (float64: exact up to rounding), and under bf16 autocast, where both run the projection in
    # bf16 and the softmax in float32 (so they agree to bf16 rounding of the logits and gradients).
    hidden, weight, labels = _inputs(n=23, h=8, v=40, seed=3)
    g = torch.Generator().manual_seed(4)
    bias = torch.randn(40, generator=g, dtype=torch.float64)
    w_lp, w_ent = torch.randn(23, generator=g, dtype=torch.float64), torch.randn(23, generator=g, dtype=torch.float64)

    def grads(fn, h0, w0, b0):
        h, w, b = (t.clone().requires_grad_(True) for t in (h0, w0, b0))
        lp, ent = fn(h, w, b)
        ((lp.double() * w_lp).sum() + (ent.double() * w_ent).sum()).backward()
        return lp.detach(), ent.detach(), h.grad, w.grad, b.grad

    def fused(h, w, b):
        return log_probs_from_hidden(
            h, w, labels, temperature=0.7, chunk_size=chunk_size, with_entropy=True, lm_head_bias=b
        )

    def reference(h, w, b):
        return naive(h, w, labels, 0.7, b)

    ours = grads(fused, hidden, weight, bias)
    ref = grads(reference, hidden, weight, bias)
    logits = torch.nn.functional.linear(hidden, weight, bias).abs().max() / 0.7
    for a, r in zip(ours, ref):  # float64 inputs, softmax in float32 on both paths
        assert_fp32_close(a.double(), r.double(), head_terms(8, 40, 23), logits)

    h32, w32, b32 = hidden.float(), weight.float(), bias.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours16 = grads(fused, h32, w32, b32)
        ref16 = grads(reference, h32, w32, b32)
    for a, r in zip(ours16, ref16):
        assert a.dtype == r.dtype == torch.float32  # gradients come back in the parameters' dtype
        # both round the logits and the gradients' matmul inputs to bfloat16 (accumulating in
        # float32): they may differ by bf16 roundings at the magnitude of the logits or the result
        tol = reduction_tolerance(
            torch.bfloat16,
            head_terms(8, 40, 23),
            max(float(logits), float(r.abs().max())),
            accumulate_dtype=torch.float32,
        )
        torch.testing.assert_close(a, r, rtol=0, atol=tol)


@pytest.mark.parametrize("use", ["log_probs", "entropy"])
def test_fused_gradient_of_one_output_alone_matches_naive(use):
    # only one output reaches the loss (the other is unused, as the entropy with entropy_coeff 0):
    # its gradient arrives as None and the backward takes its one-output branch
    hidden, weight, labels = _inputs(n=19, h=8, v=30, seed=5)
    g = torch.Generator().manual_seed(6)
    w_out = torch.randn(19, generator=g, dtype=torch.float64)

    def grads(fn):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        lp, ent = fn(h, w)
        ((lp if use == "log_probs" else ent) * w_out).sum().backward()
        return h.grad, w.grad

    ours = grads(lambda h, w: log_probs_from_hidden(h, w, labels, temperature=1.3, chunk_size=7, with_entropy=True))
    ref = grads(lambda h, w: naive(h, w, labels, 1.3))
    for a, r in zip(ours, ref):  # float64 inputs, softmax in float32 on both paths
        assert_fp32_close(a, r, head_terms(8, 30, 19))
