"""The files of a Hugging Face model folder that travel with its weights: which are carried, its dtype.

A checkpoint keeps the source model folder's own files (:func:`write_hf_meta` into ``hf_meta/``,
with the manifest :data:`SOURCE_MANIFEST`), so an export (:mod:`rlplug.run.export`) writes the source
folder with the trained weights in it even when that folder has moved.

Which files are carried (:func:`carried_files`): every regular file at the top level of the source
folder except weights (:data:`WEIGHT_SUFFIXES`, the ``*.index.json`` weight maps), hidden files and
``rlplug_source.json`` (rlplug's note on how it built a cached model folder). Sub-folders are not
carried. The source dtype (:func:`source_dtype`) is the dtype of most of the folder's floating-point
weights, read from the safetensors headers, else ``config.json``'s ``dtype``/``torch_dtype``, else
float32.

Training-library code: imports nothing from rlplug.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

__all__ = [
    "SOURCE_MANIFEST",
    "WEIGHT_SUFFIXES",
    "carried_files",
    "source_dtype",
    "write_hf_meta",
]

#: the manifest of the carried source files inside ``hf_meta/``
SOURCE_MANIFEST = "source.json"
#: file endings of weights and training state: never carried from the source folder
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx", ".npz")
#: rlplug's own record of how it built a cached model folder (tiny, GGUF conversion): not part of the model
_NOT_CARRIED = {"rlplug_source.json", SOURCE_MANIFEST}
#: safetensors dtype names -> torch dtypes (the floating-point ones: what decides the source dtype)
_SAFETENSORS_FLOATS = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}
_TORCH_NAMES = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float64: "float64",
}


def carried_files(model_dir: str | Path) -> list[Path]:
    """The files of the model folder ``model_dir`` an export carries, sorted by name: every regular
    top-level file except weights (:data:`WEIGHT_SUFFIXES`, ``*.index.json``), hidden files and
    ``rlplug_source.json``."""
    out = []
    for p in sorted(Path(model_dir).iterdir()):
        name = p.name
        if not p.is_file() or name.startswith(".") or name in _NOT_CARRIED:
            continue
        if name.endswith(WEIGHT_SUFFIXES) or name.endswith(".index.json"):
            continue
        out.append(p)
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _config_dtype(config_json: Path) -> torch.dtype | None:
    try:
        cfg = json.loads(config_json.read_text())
    except (OSError, ValueError):
        return None
    for key in ("dtype", "torch_dtype"):
        value = cfg.get(key) if isinstance(cfg, dict) else None
        if isinstance(value, str) and getattr(torch, value, None) in _TORCH_NAMES:
            return getattr(torch, value)  # type: ignore[no-any-return]
    return None


def source_dtype(model_dir: str | Path) -> torch.dtype:
    """The dtype of the model folder's weights: the floating-point dtype holding most elements in its
    ``*.safetensors`` files (headers only are read), else ``config.json``'s ``dtype`` / ``torch_dtype``,
    else ``torch.float32``. A mixed folder (e.g. bf16 with fp32 norms) counts as its majority dtype."""
    counts: dict[torch.dtype, int] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                dt = _SAFETENSORS_FLOATS.get(sl.get_dtype())
                if dt is not None:
                    n = 1
                    for d in sl.get_shape():
                        n *= int(d)
                    counts[dt] = counts.get(dt, 0) + n
    if counts:
        return max(counts, key=lambda d: counts[d])
    return _config_dtype(Path(model_dir) / "config.json") or torch.float32


def write_hf_meta(meta: Path, model_path: str | Path, tokenizer: Any = None) -> None:
    """Fill a checkpoint's ``hf_meta/`` folder ``meta`` (created if missing): the tokenizer as
    ``save_pretrained`` writes it (when given), then every :func:`carried_files` file of the source
    folder ``model_path`` copied byte for byte over it, and the manifest ``source.json``:
    ``{"model_path": absolute source folder, "dtype": "bfloat16", "files": {name: sha256}}``."""
    meta = Path(meta)
    meta.mkdir(parents=True, exist_ok=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(meta)
    src = Path(model_path)
    files = {}
    for p in carried_files(src):
        shutil.copyfile(p, meta / p.name)
        files[p.name] = _sha256(meta / p.name)
    manifest = {"model_path": str(src.resolve()), "dtype": _TORCH_NAMES[source_dtype(src)], "files": files}
    (meta / SOURCE_MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
