"""Which float type to compute in: ``auto`` picks bf16 only where bf16 matmuls are fast.

``model.compute_dtype`` and ``rollout.dtype`` default to ``auto``. On CUDA, ``auto`` is bf16 when
the GPU supports it. On a CPU it is bf16 only when oneDNN has a bf16 matmul path (AVX-512
BW/VL/DQ, AVX-512 BF16 or AMX-BF16: ``torch.ops.mkldnn._is_mkldnn_bf16_supported()``); on an
AVX2-only CPU a bf16 matmul falls back to a scalar kernel that ran about 100x slower than fp32
on the AMD EPYC (AVX2) behind this project (0.8 against 95 GFLOP/s, 2 threads, 1024^3), which
turned a one-minute training step into a quarter of an hour. ``auto`` then computes in fp32.

The rule reads CPU capabilities, not a timing, so a machine always resolves the same way and a
resumed run keeps its numerics. An explicit ``bf16`` is honoured with a warning on such a CPU.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

__all__ = ["DTYPE_CHOICES", "bf16_is_fast", "resolve_dtype"]

log = logging.getLogger("rlplug.base.precision")

#: spellings accepted by ``model.compute_dtype`` / ``rollout.dtype`` besides ``auto``
DTYPE_CHOICES = ("auto", "bf16", "bfloat16", "fp32", "float32", "fp16", "float16")
_CANONICAL = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}


@functools.cache
def _cpu_bf16_supported() -> bool:
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if probe is None or not torch.backends.mkldnn.is_available():  # pragma: no cover - other builds
        return False
    try:
        return bool(probe())
    except RuntimeError:  # pragma: no cover
        return False


def bf16_is_fast(device: torch.device | str) -> bool:
    """True when bf16 matmuls on ``device`` run at least as fast as fp32.

    CUDA: ``torch.cuda.is_bf16_supported()``. CPU: oneDNN's bf16 path is available
    (``torch.ops.mkldnn._is_mkldnn_bf16_supported()``: AVX-512 or AMX); False on AVX2-only CPUs.
    Other device types: False.
    """
    kind = torch.device(device).type
    if kind == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if kind == "cpu":
        return _cpu_bf16_supported()
    return False


def resolve_dtype(name: Any, device: torch.device | str, key: str) -> str:
    """``auto``/``bf16``/``fp32``/``fp16`` (or the long spellings) -> ``"bf16"``, ``"fp32"`` or ``"fp16"``.

    ``auto`` is ``"bf16"`` where :func:`bf16_is_fast`, else ``"fp32"``. An explicit bf16 on a
    device where bf16 is slow is kept and logged as a warning naming ``key`` (the config key).
    Raises ``ValueError`` for any other spelling.
    """
    text = str(name).lower()
    if text not in DTYPE_CHOICES:
        raise ValueError(
            f"{key}={name!r}: expected one of {', '.join(DTYPE_CHOICES)}. Set {key}=auto (bf16 where bf16 "
            "matmuls are fast, else fp32), or bf16/fp32 explicitly."
        )
    if text == "auto":
        return "bf16" if bf16_is_fast(device) else "fp32"
    text = _CANONICAL.get(text, text)
    if text == "bf16" and torch.device(device).type == "cpu" and not bf16_is_fast(device):
        _warn_slow_bf16(key)
    return text


@functools.cache
def _warn_slow_bf16(key: str) -> None:
    log.warning(
        "%s=bf16 on a CPU without a bf16 matmul path (AVX2 only: no AVX-512 or AMX); bf16 matmuls run "
        "about 100x slower than fp32 here. Use %s=auto (fp32 on this CPU) or fp32.",
        key,
        key,
    )
