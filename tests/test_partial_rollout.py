"""Partial rollouts (rlplug.rollout.partial, issue 34): chunked generation, per-token weight versions, stop
strings across a chunk boundary. Scripted engine calls for the bookkeeping; rollout=hf on the tiny model for the
equivalences with a plain generate and with greedy decoding under pushed weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _helpers import PROMPTS, TINY_VOCAB, fp32_atol, manual_greedy, tiny_chain_terms

from rlplug.config.compose import compose
from rlplug.contracts.types import RolloutOutput, SamplingParams
from rlplug.plugins.rollout.hf import HFRollout
from rlplug.rollout.partial import chunk_seed, generate_partial
from rlplug.training.models import load_causal_lm

torch.set_num_threads(1)


# ---------------------------------------------------------------------------- scripted engine calls (no model)
class CharTokenizer:
    """One character (or a named special token) per id: decoding is concatenation."""

    TABLE = {1: "a", 2: "b", 3: "<", 4: "/", 5: ">", 6: "c", 7: "\n", 8: "<eos>"}

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=True):
        assert skip_special_tokens is False and clean_up_tokenization_spaces is False  # the backends' rule
        return "".join(self.TABLE[i] for i in ids)


class ScriptedCall:
    """``call`` for generate_partial: round k returns ``rounds[k]`` (one ``(ids, reason)`` per prompt it is given),
    log-probs ``-(10 * round + position in the response)`` and version ``k``; records what it was asked."""

    def __init__(self, rounds, *, strict=True):
        self.rounds = rounds
        self.strict = strict  # False: a misbehaving engine (another number of responses than prompts)
        self.asked: list[tuple[list[list[int]], SamplingParams]] = []

    def __call__(self, prompts, params):
        k = len(self.asked)
        self.asked.append((prompts, params))
        script = self.rounds[k]
        assert len(script) == len(prompts) or not self.strict
        out = RolloutOutput(
            response_ids=[list(ids) for ids, _ in script],
            finish_reasons=[reason for _, reason in script],
            prompt_index=list(range(len(script))),
            log_probs=[[-(10.0 * k + t) for t in range(len(ids))] for ids, _ in script] if params.logprobs else None,
            metrics={"rollout/live_replicas": float(10 + k)},
        )
        return out, k


P0, P1, P2, P3 = [50], [51, 52], [53], [54]


def test_stop_string_across_a_chunk_boundary_is_cut_at_the_token_that_completes_it() -> None:
    """chunk 3, max_tokens 8 (rounds ask 3, 3, 2), stop strings "</a>" and "c\\n":

    * P0: "a</" | "a>c": "</a>" completes at the 5th token (">") -> [1, 3, 4, 1, 5], "stop";
    * P1: "ccc" | "\\nb<eos>" (the engine stopped at EOS): "c\\n" completes at the chunk's first token, before the
      EOS -> [6, 6, 6, 7], "stop";
    * P2: no stop string: 3 + 3 + 2 tokens, "length", three versions;
    * P3: the engine stopped in the first chunk: finished there, never sent again.
    """
    call = ScriptedCall(
        [
            [([1, 3, 4], "length"), ([6, 6, 6], "length"), ([1, 1, 1], "length"), ([6, 8], "stop")],
            [([1, 5, 6], "length"), ([7, 2, 8], "stop"), ([2, 2, 2], "length")],
            [([1, 2], "length")],
        ]
    )
    params = SamplingParams(max_tokens=8, seed=5, logprobs=True, stop=("</a>", "c\n"), temperature=0.8)
    out = generate_partial(call, [P0, P1, P2, P3], params, chunk_tokens=3, tokenizer=CharTokenizer())
    assert out.response_ids == [[1, 3, 4, 1, 5], [6, 6, 6, 7], [1, 1, 1, 2, 2, 2, 1, 2], [6, 8]]
    assert out.finish_reasons == ["stop", "stop", "length", "stop"]
    assert out.prompt_index == [0, 1, 2, 3]
    assert out.versions == [[0, 0, 0, 1, 1], [0, 0, 0, 1], [0, 0, 0, 1, 1, 1, 2, 2], [0, 0]]
    assert out.log_probs == [
        [0.0, -1.0, -2.0, -10.0, -11.0],
        [0.0, -1.0, -2.0, -10.0],
        [0.0, -1.0, -2.0, -10.0, -11.0, -12.0, -20.0, -21.0],
        [0.0, -1.0],
    ]
    # what the engine was asked: prompt + tokens so far for the running sequences, n=1, the remaining budget
    assert [prompts for prompts, _ in call.asked] == [
        [P0, P1, P2, P3],
        [P0 + [1, 3, 4], P1 + [6, 6, 6], P2 + [1, 1, 1]],
        [P2 + [1, 1, 1, 2, 2, 2]],
    ]
    asked = [p for _, p in call.asked]
    assert [(p.n, p.max_tokens) for p in asked] == [(1, 3), (1, 3), (1, 2)]
    assert [p.seed for p in asked] == [5, chunk_seed(5, 1), chunk_seed(5, 2)]
    assert len({5, chunk_seed(5, 1), chunk_seed(5, 2)}) == 3
    assert all(dataclasses.replace(p, n=1, max_tokens=8, seed=5) == dataclasses.replace(params, n=1) for p in asked)
    assert out.metrics == {
        "rollout/live_replicas": 12.0,  # the engine's gauges: the last call's
        "rollout/partial_chunks": 3.0,
        "rollout/partial_multi_version": 3.0,
    }


def test_stop_string_completed_by_the_last_allowed_token_still_stops() -> None:
    call = ScriptedCall([[([6, 6, 3], "length")], [([4, 1, 5], "length")]])
    out = generate_partial(
        call, [P0], SamplingParams(max_tokens=6, stop=("</a>",)), chunk_tokens=3, tokenizer=CharTokenizer()
    )
    assert out.response_ids == [[6, 6, 3, 4, 1, 5]] and out.finish_reasons == ["stop"]
    assert out.log_probs is None and out.versions == [[0, 0, 0, 1, 1, 1]]


def test_ignore_eos_disables_stop_strings_and_needs_no_tokenizer() -> None:
    call = ScriptedCall([[([1, 3, 4], "length")], [([1, 5, 6], "length")]])
    out = generate_partial(call, [P0], SamplingParams(max_tokens=6, stop=("</a>",), ignore_eos=True), chunk_tokens=3)
    assert out.response_ids == [[1, 3, 4, 1, 5, 6]] and out.finish_reasons == ["length"]


def test_n_samples_are_separate_sequences_in_prompt_major_order() -> None:
    """n=2 of two prompts: four n=1 sequences [P0, P0, P1, P1]; sample 0 of P1 stops first, sample 1 of P0 runs
    into an engine limit ("length" with fewer tokens than asked: finished, not resent)."""
    call = ScriptedCall(
        [
            [([1, 1], "length"), ([2, 2], "length"), ([3, 8], "stop"), ([4, 4], "length")],
            [([1, 8], "stop"), ([2], "length"), ([4, 4], "length")],
            [([4, 8], "stop")],
        ]
    )
    out = generate_partial(call, [P0, P1], SamplingParams(n=2, max_tokens=7, seed=None), chunk_tokens=2)
    assert out.prompt_index == [0, 0, 1, 1]
    assert out.response_ids == [[1, 1, 1, 8], [2, 2, 2], [3, 8], [4, 4, 4, 4, 4, 8]]
    assert out.finish_reasons == ["stop", "length", "stop", "stop"]
    assert out.versions == [[0, 0, 1, 1], [0, 0, 1], [0, 0], [0, 0, 1, 1, 2, 2]]
    assert [prompts for prompts, _ in call.asked] == [
        [P0, P0, P1, P1],
        [P0 + [1, 1], P0 + [2, 2], P1 + [4, 4]],
        [P1 + [4, 4, 4, 4]],
    ]
    assert [(p.n, p.max_tokens, p.seed) for _, p in call.asked] == [(1, 2, None)] * 3  # seed None stays None
    assert out.metrics["rollout/partial_chunks"] == 3.0 and out.metrics["rollout/partial_multi_version"] == 3.0


def test_bad_settings_raise() -> None:
    call = ScriptedCall([])
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="rollout.partial_chunk_tokens must be an int >= 1"):
            generate_partial(call, [P0], SamplingParams(), chunk_tokens=bad)
    with pytest.raises(ValueError, match="needs generate_partial.*tokenizer="):
        generate_partial(call, [P0], SamplingParams(stop=("x",)), chunk_tokens=4)
    with pytest.raises(ValueError, match="n must be >= 1"):
        generate_partial(call, [P0], SamplingParams(n=0), chunk_tokens=4)
    assert call.asked == []  # nothing reached the engine
    short = ScriptedCall([[([1, 1], "length")]], strict=False)
    with pytest.raises(RuntimeError, match="returned 1 responses for 2 prompts"):
        generate_partial(short, [P0, P1], SamplingParams(max_tokens=4), chunk_tokens=2)
    too_long = ScriptedCall([[([1, 1, 1], "length")]])
    with pytest.raises(RuntimeError, match="3 tokens, more than max_tokens=2"):
        generate_partial(too_long, [P0], SamplingParams(max_tokens=4), chunk_tokens=2)


# ---------------------------------------------------------------------------- rollout=hf on the tiny model
@pytest.fixture(scope="module")
def cfg():
    return compose(["model=tiny", "rollout.dtype=fp32", "rollout.micro_batch_size=8", "trainer.seed=7"])


@pytest.fixture()
def backend(cfg, model_path, tok):
    with HFRollout(cfg, model_path, tok) as b:
        yield b


def _fixed_version(backend, version=0):
    def call(prompts, params):
        return backend.generate(prompts, params), version

    return call


@pytest.mark.numerics  # greedy tokens: argmax of logits computed by a prefill of the prefix vs a cached decode
def test_greedy_partial_rollout_equals_a_plain_generate(backend) -> None:
    """Temperature 0, chunks of 3 over 10 tokens (4 calls): the same tokens and finish reasons as one call, n=2
    included; the log-probs are the same float32 quantity computed in another order (a chunk's prefill of
    prompt + prefix instead of the cached decode): the tiny model's chain over at most 8 + 10 tokens and the
    log-sum-exp over the vocabulary, at the log-probs' magnitude."""
    params = SamplingParams(n=2, temperature=0.0, max_tokens=10, logprobs=True)
    plain = backend.generate(PROMPTS, params)
    part = generate_partial(_fixed_version(backend), PROMPTS, params, chunk_tokens=3)
    assert part.response_ids == plain.response_ids
    assert part.finish_reasons == plain.finish_reasons == ["length"] * 4
    assert part.prompt_index == plain.prompt_index == [0, 0, 1, 1]
    assert part.versions == [[0] * 10] * 4
    assert part.metrics == {"rollout/partial_chunks": 4.0, "rollout/partial_multi_version": 0.0}
    terms = tiny_chain_terms(max(len(p) for p in PROMPTS) + 10, vocab_size=TINY_VOCAB)
    want = torch.tensor(plain.log_probs)
    torch.testing.assert_close(torch.tensor(part.log_probs), want, rtol=0, atol=fp32_atol(terms, want))


def test_sampled_rollout_in_one_chunk_is_the_plain_generate(backend) -> None:
    """A rollout that fits in one chunk is one call with params.seed: bitwise the plain sample (n=2, T=1). In
    several chunks it is reproducible, and the n samples of a prompt differ."""
    params = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=3, logprobs=True)
    plain = backend.generate(PROMPTS, params)
    one = generate_partial(_fixed_version(backend), PROMPTS, params, chunk_tokens=6)
    assert one.response_ids == plain.response_ids and one.log_probs == plain.log_probs
    a = generate_partial(_fixed_version(backend), PROMPTS, params, chunk_tokens=2)
    b = generate_partial(_fixed_version(backend), PROMPTS, params, chunk_tokens=2)
    assert a.response_ids == b.response_ids and a.log_probs == b.log_probs
    assert a.response_ids[0] != a.response_ids[1] and a.response_ids[2] != a.response_ids[3]


@pytest.mark.numerics  # greedy tokens: argmax of logits from other kernels and shapes
def test_weight_push_between_chunks_continues_under_the_new_weights(backend, ref_model, model_path) -> None:
    """The call wrapper pushes perturbed weights (version 1) after the first chunk: every response carries
    versions [0] * 3 + [1] * 5, its first 3 tokens are greedy under the old weights and the rest greedy under the
    new ones from that prefix (and not the old weights' continuation)."""
    new = load_causal_lm(model_path)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    version = [0]

    def call(prompts, params):
        out, v = backend.generate(prompts, params), version[0]
        if v == 0:  # the trainer's push lands between two chunks
            backend.update_weights(new.named_parameters())
            version[0] = 1
        return out, v

    out = generate_partial(call, PROMPTS, SamplingParams(temperature=0.0, max_tokens=8), chunk_tokens=3)
    assert out.finish_reasons == ["length", "length"]
    assert out.versions == [[0] * 3 + [1] * 5] * 2
    for prompt, resp in zip(PROMPTS, out.response_ids):
        assert resp[:3] == manual_greedy(ref_model, prompt, 3)
        assert resp[3:] == manual_greedy(new, prompt + resp[:3], 5)
        assert resp != manual_greedy(ref_model, prompt, 8)
    assert out.metrics == {"rollout/partial_chunks": 3.0, "rollout/partial_multi_version": 2.0}
