"""``auto`` compute dtype: bf16 only where bf16 matmuls are fast (rlplug.base.precision)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from rlplug import precision
from rlplug.config.compose import compose
from rlplug.config.schema import ConfigError, RunConfig
from rlplug.plugins.rollout.hf import HFRollout
from rlplug.plugins.training.local import LocalTrainingBackend
from rlplug.run.validate import validate_config
from rlplug.training.models import tiny_model_dir


@pytest.fixture
def slow_bf16(monkeypatch):
    """Pretend to be an AVX2-only CPU (no oneDNN bf16 path)."""
    monkeypatch.setattr(precision, "_cpu_bf16_supported", lambda: False)
    precision._warn_slow_bf16.cache_clear()


@pytest.fixture
def fast_bf16(monkeypatch):
    monkeypatch.setattr(precision, "_cpu_bf16_supported", lambda: True)


def test_defaults_are_auto() -> None:
    cfg = compose([])
    assert cfg.model.compute_dtype == "auto" and cfg.rollout.dtype == "auto"
    assert compose(["rollout=vllm"]).rollout.dtype == "auto"


def test_auto_follows_the_cpu_capability(slow_bf16) -> None:
    assert precision.resolve_dtype("auto", "cpu", "model.compute_dtype") == "fp32"
    assert precision.resolve_dtype("float32", "cpu", "rollout.dtype") == "fp32"
    assert precision.resolve_dtype("BFloat16", "cpu", "rollout.dtype") == "bf16"


def test_auto_is_bf16_where_bf16_is_fast(fast_bf16) -> None:
    assert precision.resolve_dtype("auto", "cpu", "model.compute_dtype") == "bf16"
    assert precision.resolve_dtype("fp16", "cpu", "rollout.dtype") == "fp16"


def test_the_real_probe_matches_the_cpu_flags() -> None:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo")
    flags = cpuinfo.read_text().split()
    has_avx512 = {"avx512bw", "avx512vl", "avx512dq"} <= set(flags)
    # oneDNN's bf16 path needs at least AVX-512 BW/VL/DQ; an AVX2-only CPU has none
    if not has_avx512:
        assert precision.bf16_is_fast("cpu") is False
        assert precision.resolve_dtype("auto", "cpu", "k") == "fp32"


def test_explicit_bf16_on_a_slow_cpu_warns_once(slow_bf16, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="rlplug.base.precision"):
        assert precision.resolve_dtype("bf16", "cpu", "rollout.dtype") == "bf16"
        assert precision.resolve_dtype("bf16", "cpu", "rollout.dtype") == "bf16"
    warnings = [r.getMessage() for r in caplog.records if "100x slower" in r.getMessage()]
    assert len(warnings) == 1 and "rollout.dtype=auto" in warnings[0]


def test_unknown_dtype_is_an_error_before_anything_runs() -> None:
    with pytest.raises(ValueError, match="model.compute_dtype='int8': expected one of auto, bf16"):
        precision.resolve_dtype("int8", "cpu", "model.compute_dtype")
    with pytest.raises(ConfigError, match="rollout.dtype=int8: use one of auto"):
        validate_config(compose(["rollout.dtype=int8"]))
    with pytest.raises(ConfigError, match="model.compute_dtype=fp16: use 'auto'"):
        validate_config(compose(["model.compute_dtype=fp16"]))


def test_backends_compute_in_fp32_on_a_slow_cpu_and_bf16_on_a_fast_one(slow_bf16, monkeypatch) -> None:
    path = str(tiny_model_dir(compose(["model=tiny"]).model.tiny))
    cfg = OmegaConf.structured(RunConfig)
    cfg.model.source, cfg.trainer.device = "tiny", "cpu"
    from rlplug.training.models import load_tokenizer

    tok = load_tokenizer(path)
    with HFRollout(cfg, path, tok) as rollout:
        assert {p.dtype for p in rollout.model.parameters()} == {torch.float32}
    backend = LocalTrainingBackend(cfg, path, use_critic=False, use_ref=False, total_steps=1)
    assert backend.autocast_dtype is None
    backend.close()
    monkeypatch.setattr(precision, "_cpu_bf16_supported", lambda: True)
    with HFRollout(cfg, path, tok) as rollout:
        assert {p.dtype for p in rollout.model.parameters()} == {torch.bfloat16}
    backend = LocalTrainingBackend(cfg, path, use_critic=False, use_ref=False, total_steps=1)
    assert backend.autocast_dtype == torch.bfloat16
    backend.close()
