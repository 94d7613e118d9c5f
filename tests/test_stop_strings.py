"""``SamplingParams.stop``: stop strings in the ``hf`` backend (tiny random-weight model, fp32), the
rollout kit's stop-string check, and the stop fields the vLLM / SGLang backends send."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
from _helpers import PROMPTS

from rlplug.config.compose import compose
from rlplug.conformance import check_rollout_backend
from rlplug.contracts.types import RolloutOutput, SamplingParams
from rlplug.plugins.rollout.hf import HFRollout
from rlplug.plugins.rollout.sglang import SGLangRollout
from rlplug.plugins.rollout.vllm import VLLMRollout, VLLMServerRollout, _stop_kwargs

torch.set_num_threads(1)

MAX = 16


@pytest.fixture(scope="module")
def cfg():
    return compose(["model=tiny", "rollout.dtype=fp32", "rollout.micro_batch_size=8", "trainer.seed=7"])


@pytest.fixture(scope="module")
def backend(cfg, model_path, tok):
    with HFRollout(cfg, model_path, tok) as b:
        yield b


@pytest.fixture(scope="module")
def base(backend) -> RolloutOutput:
    """Greedy responses without stop strings (both prompts, ``MAX`` tokens, log-probs)."""
    return backend.generate(PROMPTS, SamplingParams(n=1, temperature=0.0, max_tokens=MAX, logprobs=True))


def decode(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def first_hit(tok, ids: list[int], stop: str) -> int | None:
    return next((k for k in range(1, len(ids) + 1) if stop in decode(tok, ids[:k])), None)


def stopped(backend, stop: tuple[str, ...], **kw) -> RolloutOutput:
    return backend.generate(
        PROMPTS, SamplingParams(n=1, temperature=0.0, max_tokens=MAX, logprobs=True, stop=stop, **kw)
    )


def two_token_stop(tok, ids: list[int], m: int) -> str:
    """The last character of tokens ``< m`` plus token ``m``'s text less its last character."""
    prev, cur = decode(tok, ids[:m]), decode(tok, ids[: m + 1])
    new = cur[len(prev) :]
    assert len(new) >= 2, "pick a token with at least 2 characters"
    return prev[-1] + new[:-1]


def test_default_stop_is_empty_and_validation() -> None:
    assert SamplingParams().stop == ()
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stop=\\('x',\\)"):
        SamplingParams(stop="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"stop\[1\].*non-empty str"):
        SamplingParams(stop=("a", ""))
    with pytest.raises(ValueError, match=r"stop\[0\].*non-empty str"):
        SamplingParams(stop=(3,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tuple of stop strings"):
        SamplingParams(stop=None)  # type: ignore[arg-type]


def test_stop_string_spanning_two_tokens_keeps_the_sampled_ids(backend, base, tok) -> None:
    ids = base.response_ids[0]
    assert base.finish_reasons[0] == "length" and len(ids) == MAX  # random weights: no EOS in 16 tokens
    stop = two_token_stop(tok, ids, 5)  # ends inside token 5
    k = first_hit(tok, ids, stop)
    assert k is not None and k <= 6
    out = stopped(backend, (stop,))
    assert out.response_ids[0] == ids[:k]  # the sampled ids, the completing token whole
    assert out.finish_reasons[0] == "stop"
    assert out.log_probs is not None and base.log_probs is not None
    assert out.log_probs[0] == base.log_probs[0][:k]
    assert stop in decode(tok, out.response_ids[0]) and stop not in decode(tok, out.response_ids[0][:-1])
    # the other row does not contain the string: unchanged, bitwise
    assert first_hit(tok, base.response_ids[1], stop) is None
    assert out.response_ids[1] == base.response_ids[1] and out.finish_reasons[1] == base.finish_reasons[1]
    assert out.log_probs[1] == base.log_probs[1]


def test_each_row_stops_at_its_own_first_hit_and_the_earliest_string_wins(backend, base, tok) -> None:
    a, b = base.response_ids
    s_a, s_b = decode(tok, a[3:4]).strip(), decode(tok, b[9:10]).strip()
    late = decode(tok, a[12:13]).strip()
    stops = (late, s_a, s_b)
    out = stopped(backend, stops)
    for row, ids in enumerate((a, b)):
        hits = [h for h in (first_hit(tok, ids, s) for s in stops) if h is not None]
        k = min(hits)
        assert out.response_ids[row] == ids[:k] and out.finish_reasons[row] == "stop"
        assert out.log_probs is not None and out.log_probs[row] == base.log_probs[row][:k]  # type: ignore[index]


def test_absent_stop_string_leaves_output_bitwise_unchanged(backend, base, tok) -> None:
    absent = "\u2603never-in-this-text\u2603"
    assert all(absent not in decode(tok, ids) for ids in base.response_ids)
    out = stopped(backend, (absent,))
    assert out.response_ids == base.response_ids
    assert out.finish_reasons == base.finish_reasons
    assert out.log_probs == base.log_probs


def test_sampled_rows_and_ignore_eos(backend, tok) -> None:
    params = SamplingParams(n=3, temperature=1.0, max_tokens=MAX, seed=3, logprobs=True)
    ref = backend.generate(PROMPTS, params)
    stop = two_token_stop(tok, ref.response_ids[0], 4) if len(decode(tok, ref.response_ids[0][4:5])) >= 2 else None
    stop = stop or decode(tok, ref.response_ids[0][4:5])
    out = backend.generate(PROMPTS, SamplingParams(**{**params.__dict__, "stop": (stop,)}))
    for j, ids in enumerate(ref.response_ids):
        k = first_hit(tok, ids, stop)
        want = ids[:k] if k is not None else ids
        assert out.response_ids[j] == want
        assert out.finish_reasons[j] == ("stop" if k is not None else ref.finish_reasons[j])
        assert len(out.log_probs[j]) == len(want)  # type: ignore[index]
    # ignore_eos: every response is exactly max_tokens long, stop strings included
    fixed = backend.generate(
        PROMPTS, SamplingParams(n=1, temperature=0.0, max_tokens=MAX, ignore_eos=True, stop=(stop,))
    )
    assert all(len(r) == MAX for r in fixed.response_ids) and set(fixed.finish_reasons) == {"length"}


def test_rollout_kit_stop_string_check_passes_on_hf(cfg, model_path, tok) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the stop-string check must run, not be skipped
        check_rollout_backend(HFRollout(cfg, model_path, tok), max_tokens=6, n=2)


def test_rollout_kit_catches_a_backend_that_ignores_stop(cfg, model_path, tok) -> None:
    class IgnoresStop(HFRollout):
        def generate(self, prompt_ids, params):  # type: ignore[no-untyped-def]
            return super().generate(prompt_ids, SamplingParams(**{**params.__dict__, "stop": ()}))

    with pytest.raises(AssertionError, match="stop="):
        check_rollout_backend(IgnoresStop(cfg, model_path, tok), max_tokens=6, n=2)


def test_rollout_kit_skips_with_a_reason_when_the_response_is_short(cfg, model_path, tok) -> None:
    with pytest.warns(UserWarning, match="stop-string check skipped.*< 3"):
        check_rollout_backend(HFRollout(cfg, model_path, tok), max_tokens=2, n=1)


# ----------------------------------------------------------------------------- vLLM / SGLang requests
def test_vllm_inprocess_request_and_engine_kwargs() -> None:
    eng = VLLMRollout.__new__(VLLMRollout)
    eng.vocab_size, eng.seed, eng.eos_ids = 100, 0, [2]
    eng._engine = SimpleNamespace(restarts=0)  # type: ignore[assignment]  # the engine child: never restarted
    sent: list[dict] = []

    def call(cmd, payload=None, timeout=None, restart=False):  # type: ignore[no-untyped-def]
        sent.append(payload)
        n = len(payload["prompts"]) * payload["n"]
        return {
            "token_ids": [[5, 6, 7]] * n,
            "finish_reasons": ["stop" if payload["stop"] else "length"] * n,
            "log_probs": [None] * n,
        }

    eng._call = call  # type: ignore[method-assign]
    out = eng.generate([[1, 2]], SamplingParams(n=1, temperature=0.0, max_tokens=8, stop=("ab",)))
    assert sent[-1]["stop"] == ["ab"]
    assert out.response_ids == [[5, 6, 7]] and out.finish_reasons == ["stop"]  # a stop string: no EOS needed
    eng.generate([[1, 2]], SamplingParams(n=1, temperature=0.0, max_tokens=8))
    assert sent[-1]["stop"] == []
    assert _stop_kwargs([]) == {"detokenize": False}  # the default run: unchanged engine settings
    kw = _stop_kwargs(["ab", "c"])
    assert kw["stop"] == ["ab", "c"] and kw["include_stop_str_in_output"] is True and kw["detokenize"] is True
    assert kw["skip_special_tokens"] is False


def test_vllm_sampling_params_accept_the_stop_kwargs() -> None:
    vllm = pytest.importorskip("vllm")
    sp = vllm.SamplingParams(n=1, temperature=0.0, max_tokens=8, stop_token_ids=[2], **_stop_kwargs(["ab"]))
    assert sp.stop == ["ab"] and sp.include_stop_str_in_output


def test_vllm_server_request_carries_stop_and_include_stop_str() -> None:
    srv = VLLMServerRollout.__new__(VLLMServerRollout)
    srv.eos_ids, srv.on_gpu = [2], False
    _, body = srv._request([1, 2], SamplingParams(max_tokens=8, stop=("ab", "\n")), seed=0)
    assert body["stop"] == ["ab", "\n"] and body["include_stop_str_in_output"] is True
    _, plain = srv._request([1, 2], SamplingParams(max_tokens=8), seed=0)
    assert "stop" not in plain and "include_stop_str_in_output" not in plain
    ids, reason, _ = srv._parse(
        {"choices": [{"token_ids": [5, 6], "finish_reason": "stop", "stop_reason": "ab"}]}, SamplingParams(stop=("ab",))
    )
    assert ids == [5, 6] and reason == "stop"


def test_sglang_request_carries_stop_without_trimming() -> None:
    srv = SGLangRollout.__new__(SGLangRollout)
    srv.eos_ids, srv.on_gpu = [2], False
    _, body = srv._request([1, 2], SamplingParams(max_tokens=8, stop=("ab",)), seed=0)
    assert body["sampling_params"]["stop"] == ["ab"] and body["sampling_params"]["no_stop_trim"] is True
    _, plain = srv._request([1, 2], SamplingParams(max_tokens=8), seed=0)
    assert "stop" not in plain["sampling_params"]


@pytest.mark.vllm
def test_vllm_inprocess_engine_stops_like_hf_and_passes_the_kit(tok) -> None:
    pytest.importorskip("vllm")
    from rlplug.plugins.rollout.vllm import create_vllm_rollout
    from rlplug.training.models import resolve_model_path

    vcfg = compose(
        [
            "model=tiny",
            "model.tiny.num_attention_heads=2",
            "model.tiny.num_key_value_heads=1",
            "rollout=vllm",
            "rollout.dtype=fp32",
            "rollout.kv_cache_space_gib=1",
            "trainer.seed=7",
        ]
    )
    mp = resolve_model_path(vcfg.model)  # 2 heads: a head size vLLM-CPU supports (test_rollout_vllm.py)
    with HFRollout(vcfg, mp, tok) as h, create_vllm_rollout(vcfg, mp, tok) as v:
        ids = h.generate(PROMPTS, SamplingParams(n=1, temperature=0.0, max_tokens=MAX)).response_ids[0]
        stop = two_token_stop(tok, ids, 5)
        params = SamplingParams(n=1, temperature=0.0, max_tokens=MAX, stop=(stop,))
        a, b = h.generate(PROMPTS, params), v.generate(PROMPTS, params)
        k = first_hit(tok, ids, stop)
        assert a.response_ids[0] == ids[:k] and a.finish_reasons[0] == "stop"
        assert b.response_ids == a.response_ids and b.finish_reasons == a.finish_reasons
        check_rollout_backend(v, max_tokens=6, n=2, tokenizer=tok)
