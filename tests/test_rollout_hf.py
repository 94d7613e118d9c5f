"""Rollout backend ``hf`` on the tiny random-weight model (fp32 unless stated)."""

from __future__ import annotations

import copy

import pytest
import torch
from _helpers import PROMPTS, TINY_VOCAB, fp32_atol, manual_greedy, reference_log_probs, tiny_chain_terms

import rlplug
from rlplug.config.compose import compose
from rlplug.contracts.types import SamplingParams
from rlplug.plugins.rollout.hf import HFRollout, create_hf_rollout
from rlplug.training.models import load_causal_lm

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def cfg():
    return compose(["model=tiny", "rollout.dtype=fp32", "rollout.micro_batch_size=8", "trainer.seed=7"])


@pytest.fixture()
def backend(cfg, model_path, tok):
    with HFRollout(cfg, model_path, tok) as b:
        yield b


def test_registered_through_the_plugin_registry() -> None:
    assert rlplug.get_plugin("rollout_backend", "hf") is create_hf_rollout


@pytest.mark.numerics  # greedy tokens: argmax of logits from other kernels and shapes
def test_greedy_equals_manual_argmax_loop(backend, ref_model) -> None:
    out = backend.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10))
    expected = [manual_greedy(ref_model, p, 10) for p in PROMPTS]
    assert out.response_ids == expected
    assert out.finish_reasons == ["length", "length"] and out.prompt_index == [0, 1]
    assert len(set(expected[0])) > 3  # the tiny model does not just repeat one token


@pytest.mark.numerics  # greedy tokens: argmax of logits from other kernels and shapes
def test_left_padding_and_micro_batching_do_not_change_greedy_output(cfg, model_path, tok, backend) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12)
    batched = backend.generate(PROMPTS, params).response_ids
    single = [backend.generate([p], params).response_ids[0] for p in PROMPTS]
    assert batched == single
    one_at_a_time = HFRollout(
        compose(["model=tiny", "rollout.dtype=fp32", "rollout.micro_batch_size=1"]), model_path, tok
    )
    assert one_at_a_time.generate(PROMPTS, params).response_ids == batched


def test_n_samples_are_prompt_major(backend) -> None:
    greedy = backend.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6)).response_ids
    out = backend.generate(PROMPTS, SamplingParams(n=3, temperature=0.0, max_tokens=6))
    assert out.prompt_index == [0, 0, 0, 1, 1, 1]
    assert out.response_ids == [greedy[0]] * 3 + [greedy[1]] * 3
    sampled = backend.generate(PROMPTS, SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=0))
    assert len(sampled.response_ids) == 6 and len({tuple(r) for r in sampled.response_ids}) == 6


def test_response_is_cut_after_the_first_eos(cfg, model_path, tok, ref_model) -> None:
    """Make the 3rd greedy token of prompt 0 an EOS token: prompt 0 stops there (EOS kept, nothing
    after), while prompt 1 in the same batch keeps going to max_tokens."""
    g0 = manual_greedy(ref_model, PROMPTS[0], 8)
    g1 = manual_greedy(ref_model, PROMPTS[1], 8)
    stop = g0[2]
    assert stop not in g1  # otherwise pick another prompt
    k = g0.index(stop)  # first occurrence (== 2 unless it appeared earlier)
    tok2 = copy.deepcopy(tok)
    tok2.eos_token = tok.convert_ids_to_tokens(stop)
    with HFRollout(cfg, model_path, tok2) as b:
        out = b.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, logprobs=True))
    assert out.response_ids == [g0[: k + 1], g1]
    assert out.finish_reasons == ["stop", "length"]
    assert [len(lp) for lp in out.log_probs] == [k + 1, 8]
    # the real EOS (<|im_end|>, id 2) still counts as EOS too
    assert 2 in b.eos_ids and stop in b.eos_ids


def test_ignore_eos_generates_exactly_max_tokens(cfg, model_path, tok, ref_model) -> None:
    """``ignore_eos`` masks the EOS tokens until max_tokens: prompt 0 follows greedy up to the token
    declared EOS, then takes another one and runs to 8 tokens; prompt 1 is unchanged."""
    g0 = manual_greedy(ref_model, PROMPTS[0], 8)
    g1 = manual_greedy(ref_model, PROMPTS[1], 8)
    stop = g0[2]
    k = g0.index(stop)
    tok2 = copy.deepcopy(tok)
    tok2.eos_token = tok.convert_ids_to_tokens(stop)
    with HFRollout(cfg, model_path, tok2) as b:
        out = b.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert [len(r) for r in out.response_ids] == [8, 8]
    assert out.finish_reasons == ["length", "length"]
    assert out.response_ids[0][:k] == g0[:k] and stop not in out.response_ids[0]
    assert out.response_ids[1] == g1


def test_same_seed_same_output_and_default_seed_is_trainer_seed(backend) -> None:
    p = dict(n=2, temperature=1.0, top_p=0.9, max_tokens=10)
    a = backend.generate(PROMPTS, SamplingParams(**p, seed=11))
    b = backend.generate(PROMPTS, SamplingParams(**p, seed=11))
    c = backend.generate(PROMPTS, SamplingParams(**p, seed=12))
    assert a.response_ids == b.response_ids
    assert a.response_ids != c.response_ids
    # seed None -> trainer.seed (7 in this config)
    assert (
        backend.generate(PROMPTS, SamplingParams(**p)).response_ids
        == backend.generate(PROMPTS, SamplingParams(**p, seed=7)).response_ids
    )
    # the caller's global RNG is not consumed
    torch.manual_seed(0)
    expected = torch.rand(2)
    torch.manual_seed(0)
    backend.generate(PROMPTS, SamplingParams(**p, seed=3))
    assert torch.equal(torch.rand(2), expected)


def test_top_k_1_sampling_is_greedy(backend) -> None:
    greedy = backend.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8)).response_ids
    assert (
        backend.generate(PROMPTS, SamplingParams(temperature=1.5, top_k=1, max_tokens=8, seed=5)).response_ids == greedy
    )


@pytest.mark.numerics
def test_log_probs_equal_log_softmax_of_logits_over_temperature(backend, ref_model) -> None:
    """With top_p=1, top_k=-1: engine log-prob of token t = log_softmax(logits / T)[t], recomputed here
    by one teacher-forced forward over prompt + response. The engine decodes with a KV cache and
    left padding (other shapes): float32 rounding of the tiny model's chain over at most 8 + 6 tokens
    with the log-sum-exp over the vocabulary, at the magnitude of the log-probs."""
    T = 0.7
    terms = tiny_chain_terms(max(len(p) for p in PROMPTS) + 6, vocab_size=TINY_VOCAB)
    out = backend.generate(PROMPTS, SamplingParams(n=2, temperature=T, max_tokens=6, logprobs=True, seed=1))
    for i, resp in enumerate(out.response_ids):
        expected = reference_log_probs(ref_model, PROMPTS[out.prompt_index[i]], resp, T)
        torch.testing.assert_close(torch.tensor(out.log_probs[i]), expected, rtol=0, atol=fp32_atol(terms, expected))
    greedy = backend.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=4, logprobs=True))
    ids = torch.tensor([PROMPTS[0] + greedy.response_ids[0]])
    with torch.no_grad():
        logits = ref_model(ids).logits[0, len(PROMPTS[0]) - 1 : -1]
    expected = torch.log_softmax(logits, -1).max(-1).values  # greedy token = argmax, T treated as 1
    torch.testing.assert_close(torch.tensor(greedy.log_probs[0]), expected, rtol=0, atol=fp32_atol(terms, expected))


@pytest.mark.numerics  # greedy tokens: argmax of logits from other kernels and shapes
def test_update_weights_changes_outputs_to_match(backend, ref_model, model_path) -> None:
    before = backend.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8)).response_ids
    new = load_causal_lm(model_path)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    # named_parameters() drops the tied lm_head; send as an iterator with a wrapper prefix
    backend.update_weights(("module." + n, p) for n, p in new.named_parameters())
    after = backend.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8)).response_ids
    assert after != before
    assert after == [manual_greedy(new, p, 8) for p in PROMPTS]
    # pushing the original weights back restores the original outputs
    backend.update_weights(ref_model.state_dict())
    assert backend.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8)).response_ids == before


def test_update_weights_rejects_unknown_names_and_shapes(backend) -> None:
    with pytest.raises(KeyError, match="no parameter for"):
        backend.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(128, 64))])
    with pytest.raises(ValueError, match=r"shape \(3, 3\)"):
        backend.update_weights({"model.norm.weight": torch.zeros(3, 3)})


def test_bf16_keeps_its_own_bf16_copy(model_path, tok, ref_model) -> None:
    cfg16 = compose(["model=tiny", "rollout.dtype=bf16"])
    with HFRollout(cfg16, model_path, tok) as b:
        assert {p.dtype for p in b.model.parameters()} == {torch.bfloat16}
        sd = {k: v.clone() for k, v in ref_model.state_dict().items()}  # fp32
        sd["model.norm.weight"] += 1.0
        b.update_weights(sd)
        assert b.model.model.norm.weight.dtype == torch.bfloat16
        # the engine's copy is the bf16 rounding of the pushed fp32 weight, bit for bit
        assert torch.equal(b.model.model.norm.weight.float(), sd["model.norm.weight"].bfloat16().float())
        out = b.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=4))
        assert [len(r) for r in out.response_ids] == [4, 4]


def test_bad_inputs_and_close(cfg, model_path, tok) -> None:
    b = create_hf_rollout(cfg, model_path, tok)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        b.generate([[1, 2], []], SamplingParams())
    with pytest.raises(ValueError, match="outside"):
        b.generate([[1, 49152]], SamplingParams())
    with pytest.raises(ValueError, match="tokenize it first"):
        b.generate(["hello"], SamplingParams())
    with pytest.raises(ValueError, match="n must be >= 1"):
        b.generate([[1]], SamplingParams(n=0))
    b.close()
    b.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        b.generate([[1]], SamplingParams())
    with pytest.raises(ValueError, match="rollout.dtype='int8': expected one of auto, bf16"):
        HFRollout(compose(["model=tiny", "rollout.dtype=int8"]), model_path, tok)
