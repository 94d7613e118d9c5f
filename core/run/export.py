"""Faithful exports: a checkpoint's actor as the Hugging Face folder it came from, with new weights.

An export (``rlplug export``, :func:`export_checkpoint`; and the ``final_model`` of a finished run,
:func:`finish_export`) is the source model folder with the trained weights in it:

* every file of the source folder that is not weights (``generation_config.json``, ``tokenizer.json``,
  ``tokenizer_config.json``, ``special_tokens_map.json``, ``chat_template.jinja``, ``vocab.json``,
  ``merges.txt``, ``tokenizer.model``, ``preprocessor_config.json``, ``processor_config.json``, custom
  code ...) is copied byte for byte, so a model whose generation config lists two EOS ids and sampling
  defaults (the Qwen and Llama-3 chat models) keeps them, and the tokenizer is the source's, not a
  re-serialisation (which would carry the training-time ``padding_side="left"``);
* ``config.json`` is the source's too, byte for byte, unless the weights are written in another dtype
  than the source's: then only its ``dtype`` (and ``torch_dtype``, when present) field changes;
* the weights are written (``save_pretrained``, safetensors) in the source's dtype by default
  (``dtype="auto"``: the dtype of most of the source's floating-point weights, read from the
  safetensors headers, else ``config.json``'s ``dtype``/``torch_dtype``, else float32), or in the
  ``dtype`` asked for (``bf16``, ``fp16``, ``fp32``). Training keeps fp32 master weights; the cast
  is ``Tensor.to(dtype)`` (round to nearest even), the same cast the rollout engines apply, so the
  export generates what the trainer's engine generated.

Which files are carried: every regular file at the top level of the source folder except weights
(:data:`WEIGHT_SUFFIXES`, the ``*.index.json`` weight maps), hidden files and ``rlplug_source.json``
(rlplug's note on how it built a cached model folder). Sub-folders are not carried.

Where they come from: :func:`write_hf_meta` (:mod:`rlplug.training.model_files`, re-exported here) copies them into the checkpoint's ``hf_meta/`` when the
checkpoint is saved, with the manifest ``hf_meta/source.json`` (the source folder, its dtype and the
SHA-256 of each carried file), so a checkpoint exports alone even when the source folder has moved.
A checkpoint written before this manifest existed exports from what its ``hf_meta/`` holds (a
``config.json`` copy and a re-serialised tokenizer) and a warning says what could not be kept.

A LoRA checkpoint (adapters and a pointer to the base model, :mod:`rlplug.training.lora`) exports merged
(:func:`export_lora_checkpoint`, which :func:`export_checkpoint` calls for it), or as the PEFT adapter
folder alone (:func:`export_adapter`, ``rlplug export --adapter-only``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from rlplug.base.file_modes import apply_umask
from rlplug.run.checkpoint import BACKEND_DIR, META_DIR, find_checkpoint
from rlplug.training.lora import ADAPTER_DIR, check_base_pointer, is_lora_checkpoint, lora_actor_dir
from rlplug.training.model_files import (  # re-exported: their home before rlplug.training.model_files
    _TORCH_NAMES,
    SOURCE_MANIFEST,
    WEIGHT_SUFFIXES,
    _config_dtype,
    _sha256,
    carried_files,
    source_dtype,
    write_hf_meta,
)

log = logging.getLogger(__name__)

__all__ = [
    "EXPORT_DTYPES",
    "SOURCE_MANIFEST",
    "WEIGHT_SUFFIXES",
    "carried_files",
    "export_adapter",
    "export_checkpoint",
    "export_lora_checkpoint",
    "finish_export",
    "resolve_export_dtype",
    "source_dtype",
    "write_hf_meta",
]

#: ``--dtype`` choices of ``rlplug export`` (``auto``: the source's dtype) -> torch dtypes
EXPORT_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}


def resolve_export_dtype(dtype: str | torch.dtype | None, source: torch.dtype) -> torch.dtype:
    """``dtype`` (``auto``/None: ``source``; ``bf16``, ``fp16``, ``fp32`` or the long spellings, or a
    torch dtype) as a torch dtype. Raises ``ValueError`` for anything else."""
    if isinstance(dtype, torch.dtype):
        return dtype
    key = "auto" if dtype is None else str(dtype).lower()
    if key not in EXPORT_DTYPES:
        raise ValueError(
            f"Unknown export dtype {dtype!r}: expected one of auto, bf16, fp16, fp32 (auto: the source model's "
            f"dtype, {_TORCH_NAMES.get(source, source)} here). Use e.g. rlplug export CKPT --out DIR --dtype bf16."
        )
    return EXPORT_DTYPES[key] or source


# ============================================================================ writing the folder


def _cast(state: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}


def _copy_source_files(out: Path, src_dir: Path, names: Iterable[str], dtype: torch.dtype) -> None:
    """Copy ``names`` from ``src_dir`` into ``out`` byte for byte; ``config.json`` gets ``dtype`` in its
    dtype field(s) when it names another (the only change)."""
    for name in names:
        if name == "config.json" and _config_dtype(src_dir / name) not in (None, dtype):
            cfg = json.loads((src_dir / name).read_text())
            for key in ("dtype", "torch_dtype"):
                if key in cfg:
                    cfg[key] = _TORCH_NAMES[dtype]
            (out / name).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        elif name == "config.json" and _config_dtype(src_dir / name) is None and dtype != torch.float32:
            cfg = json.loads((src_dir / name).read_text())  # no dtype field: transformers would assume float32
            cfg["dtype"] = _TORCH_NAMES[dtype]
            (out / name).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        else:
            shutil.copyfile(src_dir / name, out / name)


def _source_of_checkpoint(meta: Path) -> tuple[list[str], torch.dtype]:
    """The carried file names in ``hf_meta`` and the source dtype, from its manifest; for a checkpoint
    without one, every file ``hf_meta`` holds and the dtype ``config.json`` names (with a warning).
    Raises ``ValueError`` when a carried file no longer matches its recorded SHA-256."""
    manifest_path = meta / SOURCE_MANIFEST
    if not manifest_path.is_file():
        log.warning(
            "%s has no %s (the checkpoint predates faithful exports): exporting the config.json and the "
            "re-serialised tokenizer it holds; generation_config.json is derived from config.json, so extra EOS "
            "ids and sampling defaults of the source model are lost. Copy them from the source model folder.",
            meta,
            SOURCE_MANIFEST,
        )
        names = [p.name for p in carried_files(meta)]
        return names, _config_dtype(meta / "config.json") or torch.float32
    manifest = json.loads(manifest_path.read_text())
    for name, digest in manifest["files"].items():
        if not (meta / name).is_file() or _sha256(meta / name) != digest:
            raise ValueError(
                f"{meta / name} does not match the copy of {manifest['model_path']}/{name} recorded when the "
                "checkpoint was saved (missing or changed SHA-256): the checkpoint is damaged. Export another "
                "checkpoint, or restore the file from the source model folder."
            )
    return list(manifest["files"]), getattr(torch, manifest["dtype"])


def export_checkpoint(checkpoint: str | Path, out: str | Path, dtype: str | torch.dtype | None = "auto") -> Path:
    """Write the actor of ``checkpoint`` (a ``global_step_N`` dir, or a run dir: the checkpoint its
    ``latest`` pointer names, see :func:`rlplug.run.checkpoint.find_checkpoint`) as a Hugging Face folder
    ``out``: the source model's files from ``hf_meta/`` and the weights in ``dtype`` (``auto``: the
    source's; see the module docstring). Returns ``out``.

    The result loads with ``AutoModelForCausalLM.from_pretrained`` and vLLM. Raises
    ``FileNotFoundError`` when no complete checkpoint is found there, and ``ValueError`` for an unknown
    ``dtype``, a damaged ``hf_meta/`` file, or saved weights that do not fit the model described by
    ``hf_meta/config.json`` (missing or unexpected tensor names), instead of writing a folder with
    uninitialised weights; nothing is written then.
    """
    from safetensors.torch import load_file  # deferred: torch
    from transformers import AutoConfig, AutoModelForCausalLM  # deferred: transformers

    ckpt = find_checkpoint(checkpoint)
    if is_lora_checkpoint(ckpt):  # adapters + a pointer to the base model: merged (rlplug.training.lora)
        return export_lora_checkpoint(ckpt, out, dtype)
    meta = ckpt / META_DIR
    weights = ckpt / BACKEND_DIR / "actor" / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(
            f"{weights} is missing: this checkpoint was not written by a backend that rlplug export understands."
        )
    names, src_dtype = _source_of_checkpoint(meta)
    target = resolve_export_dtype(dtype, src_dtype)
    config = AutoConfig.from_pretrained(meta)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    state = _cast(load_file(str(weights)), target)
    result = model.load_state_dict(state, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()  # the tied output projection is saved once, under the embedding's name
    # every parameter must now hold saved data: one still on the meta device was never loaded
    missing = sorted(name for name, p in model.named_parameters() if p.is_meta)
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{weights} does not match the model in {meta / 'config.json'}: missing {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}, unexpected {sorted(result.unexpected_keys)[:5]}. The checkpoint's "
            "backend must save the actor under Hugging Face parameter names (as the local and fsdp2 backends do)."
        )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    _copy_source_files(out, meta, names, target)
    apply_umask(out)  # readable by an inference server of another user, as the umask allows
    return out


def _recast_folder(folder: Path, dtype: torch.dtype) -> None:
    """Rewrite the ``*.safetensors`` files of ``folder`` with their floating-point tensors in ``dtype``
    (the shard index's ``total_size`` follows)."""
    from safetensors.torch import load_file, save_file  # deferred: torch

    total = 0
    for file in sorted(folder.glob("*.safetensors")):
        state = _cast(load_file(str(file)), dtype)
        save_file(state, str(file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in state.values())
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data.setdefault("metadata", {})["total_size"] = total
        index.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def finish_export(folder: str | Path, model_path: str | Path, dtype: str | torch.dtype | None = "auto") -> Path:
    """Make the folder a training backend's ``export_hf`` wrote (the run's ``final_model``) faithful to
    the source model folder ``model_path``: weights recast to ``dtype`` (``auto``: the source's) when
    they are in another, then the source's :func:`carried_files` copied over the re-serialised ones
    (see the module docstring). ``model_path`` may also be a checkpoint's ``hf_meta/`` folder: then the
    files and dtype its ``source.json`` records are used (``ValueError`` for a damaged copy, as in
    :func:`export_checkpoint`). Main process only. Returns ``folder``."""
    folder, src = Path(folder), Path(model_path)
    if (src / SOURCE_MANIFEST).is_file():  # a checkpoint's hf_meta/: its recorded files and dtype (checked)
        names, src_dtype = _source_of_checkpoint(src)
    else:
        names, src_dtype = [p.name for p in carried_files(src)], source_dtype(src)
    target = resolve_export_dtype(dtype, src_dtype)
    if source_dtype(folder) != target:
        _recast_folder(folder, target)
    _copy_source_files(folder, src, names, target)
    apply_umask(folder)
    return folder


# ============================================================================ LoRA checkpoints


def export_lora_checkpoint(checkpoint: str | os.PathLike, out: str | os.PathLike, dtype: Any = "auto") -> Path:
    """Write the LoRA actor of the complete checkpoint ``checkpoint`` (a ``global_step_N`` dir) to ``out`` as a
    merged Hugging Face folder: the base model of the checkpoint's pointer (checked by
    :func:`rlplug.training.lora.check_base_pointer`) with the adapters merged (peft's ``merge_and_unload``:
    ``W + (alpha / r) B A``), then the source model's files and dtype as every export (:func:`finish_export`
    with the checkpoint's ``hf_meta/``). Loads with ``AutoModelForCausalLM.from_pretrained`` and vLLM. Raises
    ``FileNotFoundError`` / ``ValueError`` as :func:`rlplug.training.lora.check_base_pointer`, and
    ``FileNotFoundError`` for a checkpoint without adapters."""
    from peft import PeftModel  # deferred: torch
    from transformers import AutoModelForCausalLM  # deferred: transformers

    actor = lora_actor_dir(checkpoint)
    base_path = check_base_pointer(actor)
    base = AutoModelForCausalLM.from_pretrained(str(base_path), dtype=torch.float32)
    merged: Any = PeftModel.from_pretrained(base, str(actor / ADAPTER_DIR)).merge_and_unload()
    dest = Path(out)
    dest.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(str(dest), safe_serialization=True)
    return finish_export(dest, Path(checkpoint) / META_DIR, dtype)


def export_adapter(checkpoint: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the PEFT adapter folder of the LoRA checkpoint ``checkpoint`` (a ``global_step_N`` dir, or a run
    dir: its latest checkpoint) to ``out`` (``rlplug export --adapter-only``): ``adapter_config.json``,
    ``adapter_model.safetensors`` (fp32) and the tokenizer files, so ``PeftModel.from_pretrained(base, out)``
    loads it on the base model (the config's ``base_model_name_or_path``). Raises ``FileNotFoundError`` for a
    checkpoint without adapters, or when no complete checkpoint is found there."""
    ckpt = find_checkpoint(Path(checkpoint))
    adapter = lora_actor_dir(ckpt) / ADAPTER_DIR
    dest = Path(out)
    dest.mkdir(parents=True, exist_ok=True)
    for f in carried_files(ckpt / META_DIR):
        if "token" in f.name or f.name in ("vocab.json", "merges.txt", "chat_template.jinja"):
            shutil.copyfile(f, dest / f.name)
    for f in adapter.iterdir():
        if f.is_file():
            shutil.copyfile(f, dest / f.name)
    apply_umask(dest)
    return dest
