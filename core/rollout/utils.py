"""Library code for rollout backends: prompt checks, EOS ids, dtypes and weight transfer.

Public helpers that several rollout engines use (``hf``, ``vllm``, ``sglang`` and third-party
backends); they are part of the engine (``rlplug.rollout.utils``), not of any plugin.

* :func:`validate_prompts` -- check ``generate()`` input before an engine sees it.
* :func:`eos_ids` -- every token id that ends a response (tokenizer EOS plus extras).
* :func:`parse_dtype` -- ``rollout.dtype`` strings to torch dtypes.
* :func:`strip_wrapper_prefixes` -- HF parameter names from wrapped modules (DDP, compile, FSDP).
* :func:`checkpoint_shapes` / :func:`checked_weights` -- check pushed weights against the model
  checkpoint (names and shapes) and copy them in the engine's dtype, for engines that reload
  whole checkpoints (vLLM in-process and server, SGLang).
* :func:`shm_dir` -- where pushed weights are written (``/dev/shm`` when writable).
* :func:`sampling_params` -- the run config's sampling settings for a training step or for validation.
"""

from __future__ import annotations

import logging
import math
import os
import re
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from rlplug.base.processes import pid_alive
from rlplug.contracts.types import SamplingParams

if TYPE_CHECKING:
    from omegaconf import DictConfig

log = logging.getLogger("rlplug.rollout")

__all__ = [
    "COUNTED_ROLLOUT_METRICS",
    "merge_engine_metrics",
    "DTYPE_NAMES",
    "TORCH_DTYPES",
    "parse_dtype",
    "strip_wrapper_prefixes",
    "validate_prompts",
    "eos_ids",
    "checkpoint_shapes",
    "checked_weights",
    "shm_dir",
    "remove_dead_process_files",
    "sampling_params",
]

#: ``rollout.dtype`` spellings -> vLLM/SGLang dtype names
DTYPE_NAMES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp32": "float32",
    "float32": "float32",
    "fp16": "float16",
    "float16": "float16",
}
#: engine dtype names -> torch dtypes
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}

_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
}
_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def parse_dtype(name: Any) -> torch.dtype:
    """``rollout.dtype`` string (``bf16``/``fp32``/``fp16``) to a torch dtype; ``ValueError`` otherwise."""
    if isinstance(name, torch.dtype):
        return name
    key = str(name).lower()
    if key not in _DTYPES:
        raise ValueError(f"Unknown rollout.dtype '{name}'. Expected one of: bf16, fp32, fp16.")
    return _DTYPES[key]


def strip_wrapper_prefixes(name: str) -> str:
    """Remove wrapper prefixes (``module.``, ``_orig_mod.``, FSDP/checkpoint wrappers) from a parameter name."""
    changed = True
    while changed:
        changed = False
        for p in _WRAPPER_PREFIXES:
            if name.startswith(p):
                name, changed = name[len(p) :], True
        name = name.replace("._fsdp_wrapped_module.", ".").replace("._checkpoint_wrapped_module.", ".")
    return name


def validate_prompts(prompt_ids: Any, vocab_size: int | None, params: SamplingParams) -> list[list[int]]:
    """Check ``prompt_ids`` (non-empty list of non-empty int lists within the vocabulary) and ``params``.

    Raises ``ValueError`` naming the first bad prompt and what was expected.
    """
    if not isinstance(prompt_ids, (list, tuple)) or len(prompt_ids) == 0:
        raise ValueError(
            f"generate() needs a non-empty list of prompts (lists of token ids); got {type(prompt_ids).__name__} of length {len(prompt_ids) if hasattr(prompt_ids, '__len__') else '?'}."
        )
    out: list[list[int]] = []
    for i, p in enumerate(prompt_ids):
        if isinstance(p, torch.Tensor):
            p = p.tolist()
        if isinstance(p, str) or not hasattr(p, "__iter__"):
            raise ValueError(f"prompt {i} is a {type(p).__name__}; expected a list of token ids (tokenize it first).")
        p = [int(t) for t in p]
        if not p:
            raise ValueError(
                f"prompt {i} is empty; every prompt needs at least one token (e.g. the chat template's prefix)."
            )
        if vocab_size is not None and (min(p) < 0 or max(p) >= vocab_size):
            raise ValueError(
                f"prompt {i} has token ids outside [0, {vocab_size}): min {min(p)}, max {max(p)}; was it tokenized with this model's tokenizer?"
            )
        out.append(p)
    if int(params.n) < 1:
        raise ValueError(f"SamplingParams.n must be >= 1, got {params.n}.")
    if int(params.max_tokens) < 1:
        raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {params.max_tokens}.")
    if not params.greedy and not (0.0 < float(params.top_p) <= 1.0):
        raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {params.top_p}.")
    return out


def eos_ids(tokenizer: Any, *extra: Any) -> list[int]:
    """Sorted token ids that end a response: ``tokenizer.eos_token_id`` (an int or a list) plus
    ``extra`` ids or lists (e.g. a generation config's ``eos_token_id``). Raises ``ValueError``
    when there is none."""
    ids: set[int] = set()
    for src in (getattr(tokenizer, "eos_token_id", None), *extra):
        if src is None:
            continue
        if isinstance(src, (list, tuple, set)):
            ids.update(int(x) for x in src)
        else:
            ids.add(int(src))
    if not ids:
        raise ValueError("The tokenizer has no eos_token_id, so responses could never stop; set tokenizer.eos_token.")
    return sorted(ids)


def checkpoint_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of the model folder's safetensors checkpoint (headers only)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                shapes[k] = tuple(fh.get_slice(k).get_shape())
    return shapes


def checked_weights(
    named_tensors: Iterable[tuple[str, Any]] | dict[str, Any],
    shapes: dict[str, tuple[int, ...]],
    *,
    dtype: Any,
    tie_word_embeddings: bool,
    model_path: str,
    reloads: str,
) -> dict[str, Any]:
    """The actor's weights ready for an engine that reloads the whole checkpoint (this backend and
    :class:`rlplug.rollout.serving.ServerRollout`).

    ``named_tensors``: ``(name, tensor)`` pairs or a dict, Hugging Face names (wrapper prefixes
    such as ``module.`` are stripped), any dtype/device. ``shapes``: the checkpoint's names and
    shapes (:func:`checkpoint_shapes` of ``model_path``). Returns ``{name: tensor}``, each a
    contiguous CPU copy in ``dtype``; ``lm_head.weight`` is dropped when embeddings are tied.

    Raises ``KeyError`` for a name the checkpoint has no tensor for, ``ValueError`` for a shape
    mismatch or a missing tensor (``reloads`` says why every tensor is needed, e.g. "the vllm
    backend reloads whole layers"); all checked before the caller sends anything.
    """
    items = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors
    tensors: dict[str, Any] = {}
    for raw, t in items:
        name = strip_wrapper_prefixes(raw)
        if name == "lm_head.weight" and tie_word_embeddings:
            continue  # tied to the embedding, which is sent too
        if name not in shapes:
            raise KeyError(
                f"update_weights got '{raw}', which the model checkpoint at {model_path} has no tensor for. "
                f"Expected Hugging Face names such as '{next(iter(shapes))}'."
            )
        if tuple(t.shape) != shapes[name]:
            raise ValueError(f"update_weights: '{name}' has shape {tuple(t.shape)}, the engine expects {shapes[name]}.")
        tensors[name] = t.detach().to(device="cpu", dtype=dtype, copy=True).contiguous()
    missing = sorted(set(shapes) - set(tensors) - ({"lm_head.weight"} if tie_word_embeddings else set()))
    if missing:
        raise ValueError(
            f"update_weights got {len(tensors)} of {len(shapes)} tensors; {reloads} and needs all of them. "
            f"Missing: {missing[:5]}{' ...' if len(missing) > 5 else ''}."
        )
    return tensors


def shm_dir() -> str:
    """``/dev/shm`` when it is a writable folder (RAM), else the temp dir."""
    d = "/dev/shm"
    return d if os.path.isdir(d) and os.access(d, os.W_OK) else tempfile.gettempdir()


def remove_dead_process_files(directory: str, patterns: Sequence[re.Pattern[str]], what: str) -> list[str]:
    """Delete the files in ``directory`` whose name matches one of ``patterns`` (group 1: the pid of the process
    that wrote it) and whose process is gone (:func:`rlplug.base.processes.pid_alive`): what a process killed by SIGKILL left behind,
    e.g. a kept copy of pushed weights (a whole model, in RAM when ``directory`` is ``/dev/shm``). Files of live
    processes (another user's included) are kept. Each deletion is logged as ``what`` left by the process.
    Returns the deleted paths; never raises (a missing folder: none)."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = next((m for m in (p.match(name) for p in patterns) if m is not None), None)
        if m is None or pid_alive(int(m.group(1))):
            continue
        path = os.path.join(directory, name)
        try:
            os.unlink(path)
        except OSError:
            continue
        removed.append(path)
        log.warning("Deleted %s: %s left by process %s, which is gone.", path, what, m.group(1))
    return removed


def sampling_params(cfg: DictConfig, *, validation: bool = False, step: int = 0) -> SamplingParams:
    """The rollout's sampling settings for training step ``step`` (``rollout.*``, a seed per step),
    or for validation (``rollout.val_kwargs``, one fixed seed)."""
    r, max_tokens = cfg.rollout, cfg.data.max_response_length
    if validation:
        v = r.val_kwargs
        return SamplingParams(
            n=v.n,
            temperature=v.temperature,
            top_p=v.top_p,
            top_k=v.top_k,
            max_tokens=max_tokens,
            seed=cfg.trainer.seed + 7919,
        )
    return SamplingParams(
        n=r.n,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_tokens=max_tokens,
        seed=cfg.trainer.seed * 1_000_003 + step,
        logprobs=r.calculate_log_probs,
        ignore_eos=bool(r.ignore_eos),
    )


#: rollout metrics that count events of one generate call (multi-turn episodes: tool calls and their failures,
#: environment errors, overflows, how episodes ended; ``fnmatch`` patterns): added up when calls are merged
COUNTED_ROLLOUT_METRICS = (
    "multi_turn/tool_*",
    "multi_turn/malformed_calls",
    "multi_turn/env_errors",
    "multi_turn/overflow",
    "multi_turn/ended_by_*",
)


def merge_engine_metrics(parts: Sequence[tuple[dict[str, float], int]]) -> dict[str, float]:
    """The engine metrics of one rollout made of several generate calls, ``parts`` = ``[(metrics, responses), ...]``:
    per name, over the parts that report it, the sum for the counts of :data:`COUNTED_ROLLOUT_METRICS`, the largest
    value for names ending in ``/max`` or ``_max``, the smallest for ``/min`` or ``_min``, else the mean weighted by
    the parts' responses (an engine reports its gauges and per-call means; NaN when the parts that report a name
    have no responses)."""
    from fnmatch import fnmatchcase  # deferred: only when calls are merged

    merged: dict[str, float] = {}
    for name in dict.fromkeys(m for metrics, _ in parts for m in metrics):
        have = [(float(metrics[name]), n) for metrics, n in parts if name in metrics]
        if any(fnmatchcase(name, pattern) for pattern in COUNTED_ROLLOUT_METRICS):
            merged[name] = sum(v for v, _ in have)
        elif name.endswith(("/max", "_max")):
            merged[name] = max(v for v, _ in have)
        elif name.endswith(("/min", "_min")):
            merged[name] = min(v for v, _ in have)
        else:
            weight = sum(n for _, n in have)
            merged[name] = sum(v * n for v, n in have) / weight if weight else math.nan
    return merged
