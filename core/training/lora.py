"""LoRA: low-rank adapters on a frozen base model, with ``peft`` (verl's ``model.lora_rank``).

With ``model.lora_rank > 0`` the training backend wraps the actor in a ``peft`` model: each target
layer ``W`` (``model.target_modules``, verl's default ``all-linear``: every linear layer but the
output head) gets ``W x + (lora_alpha / lora_rank) * B A x`` with ``A`` ``(r, in)`` (Kaiming-uniform)
and ``B`` ``(out, r)`` (zeros, so training starts from the base model), the base weights frozen and
the optimizer over ``A`` and ``B`` only (Hu et al. 2021, "LoRA", arXiv:2106.09685; verl's
``_build_lora_module``). ``critic.model.lora_rank > 0`` does the same to the critic's backbone
(its value head trains fully).

* The reference policy is the same module with the adapters switched off (peft's
  ``disable_adapter()``), so no second copy of the base weights is held (verl's ref-in-actor).
* The rollout engine gets merged weights, ``W + scaling * B A`` per target layer, computed as new
  tensors (:func:`merged_weights`); the trained module is not changed.
* A checkpoint holds the adapters (a PEFT folder, :data:`ADAPTER_DIR`), the optimizer state and a
  pointer to the base model (:data:`BASE_POINTER_FILE`: its path and :func:`base_fingerprint`).
  ``rlplug export`` merges them into a Hugging Face folder (:func:`rlplug.run.export.export_lora_checkpoint`),
  or with ``--adapter-only`` writes the PEFT adapter folder (:func:`rlplug.run.export.export_adapter`).

Functions: :func:`lora_settings` (config -> :class:`LoraSettings` or ``None``, checked),
:func:`check_lora_config` (the config-time check), :func:`check_target_modules` (before any weights
load), :func:`apply_lora`, :func:`merged_weights`, :func:`save_merged`, :func:`base_fingerprint`,
:func:`write_base_pointer` / :func:`check_base_pointer`, :func:`is_lora_checkpoint`,
:func:`lora_actor_dir`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from omegaconf import OmegaConf
from torch import nn

from rlplug.config.schema import ConfigError, CriticConfig, CriticModelConfig, ModelConfig, typed
from rlplug.contracts.kinds import built_classes
from rlplug.contracts.registry import PluginError
from rlplug.training.models import unique_state

__all__ = [
    "LORA_CAPABILITY",
    "ADAPTER_DIR",
    "BASE_POINTER_FILE",
    "TRAINABLE_FILE",
    "LoraSettings",
    "lora_settings",
    "check_lora_config",
    "linear_module_names",
    "check_target_modules",
    "apply_lora",
    "merged_weights",
    "save_merged",
    "base_fingerprint",
    "write_base_pointer",
    "check_base_pointer",
    "save_lora_state",
    "load_lora_state",
    "is_lora_role_dir",
    "is_lora_checkpoint",
    "lora_actor_dir",
]

#: the training-backend capability LoRA needs (:data:`rlplug.contracts.types.TRAINING_CAPABILITIES`)
LORA_CAPABILITY = "lora"
#: the PEFT adapter folder inside a role's checkpoint folder (``backend/actor/adapter``)
ADAPTER_DIR = "adapter"
#: the base-model pointer inside a role's checkpoint folder
BASE_POINTER_FILE = "base_model.json"
#: a LoRA critic's trained tensors (adapters and value head) inside ``backend/critic``
TRAINABLE_FILE = "trainable.safetensors"
#: bytes of the first tensor data hashed by :func:`base_fingerprint`
_FINGERPRINT_BYTES = 1 << 20
#: the name peft gives the one adapter
_ADAPTER = "default"


@dataclass(frozen=True)
class LoraSettings:
    """Checked LoRA settings of one model section (``key``: ``"model"`` or ``"critic.model"``).

    ``rank`` (> 0), ``alpha`` (> 0; the delta is scaled by ``alpha / rank``), ``target_modules``
    (``"all-linear"``, another string: a regular expression matched against the full module name,
    or a list of module-name suffixes), ``exclude_modules`` (``None``, a regex or a list of suffixes).
    """

    key: str
    rank: int
    alpha: int
    target_modules: str | tuple[str, ...]
    exclude_modules: str | tuple[str, ...] | None

    def peft_config(self, task_type: str | None) -> Any:
        """The ``peft.LoraConfig`` (no dropout, no bias training; verl's settings)."""
        from peft import LoraConfig  # deferred: peft

        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        exclude = self.exclude_modules if isinstance(self.exclude_modules, str | None) else list(self.exclude_modules)
        return LoraConfig(
            task_type=task_type,
            r=self.rank,
            lora_alpha=self.alpha,
            lora_dropout=0.0,
            target_modules=targets,
            exclude_modules=exclude,
            bias="none",
        )


def _names(value: Any, key: str) -> str | tuple[str, ...] | None:
    """``value`` of ``key`` (``target_modules`` / ``exclude_modules``) as a string, a tuple of names or None."""
    if value is None:
        return None
    if isinstance(value, str):
        if not value.strip():
            raise ConfigError(f"{key} is empty; use all-linear or a list of layer names such as [q_proj,v_proj].")
        if value != "all-linear":
            try:
                re.compile(value)
            except re.error as exc:
                raise ConfigError(
                    f"{key}={value!r} is not a valid regular expression ({exc}); a string other than all-linear is "
                    "matched against the full module names. Use a list of layer names such as [q_proj,v_proj]."
                ) from exc
        return value
    try:
        items = OmegaConf.to_container(value) if OmegaConf.is_config(value) else list(value)
    except TypeError:
        items = None
    if not isinstance(items, list) or not all(isinstance(x, str) and x for x in items):
        raise ConfigError(
            f"{key}={value!r}: expected all-linear, a regular expression, or a list of layer names such as "
            "[q_proj,k_proj,v_proj,o_proj]."
        )
    return tuple(items)


def lora_settings(model_cfg: Any, key: str = "model") -> LoraSettings | None:
    """The LoRA settings of the model section ``model_cfg`` (``model`` or ``critic.model``), or ``None`` when
    ``lora_rank`` is 0 / unset (full fine-tuning).

    Raises :class:`rlplug.config.schema.ConfigError` for a negative or non-integer rank, ``lora_alpha <= 0``, an
    empty or malformed ``target_modules`` / ``exclude_modules`` (``key`` names the section in the message).
    """
    section = (
        model_cfg
        if isinstance(model_cfg, ModelConfig | CriticModelConfig)
        else typed(CriticModelConfig if key == "critic.model" else ModelConfig, model_cfg)
    )
    raw = section.lora_rank
    try:
        rank = int(raw)
        if rank != float(raw):
            raise ValueError
    except (TypeError, ValueError):
        raise ConfigError(
            f"{key}.lora_rank={raw!r}: the LoRA rank must be an integer (0: off, e.g. 8 or 32)."
        ) from None
    if rank < 0:
        raise ConfigError(
            f"{key}.lora_rank={rank}: the LoRA rank must be >= 0 (0 trains every weight, a positive rank such as 8 "
            "or 32 trains low-rank adapters)."
        )
    if rank == 0:
        return None
    alpha = int(section.lora_alpha)
    if not alpha > 0:
        raise ConfigError(
            f"{key}.lora_alpha={alpha}: the adapter update is scaled by lora_alpha / lora_rank, so lora_alpha "
            "must be > 0 (verl's default 16)."
        )
    targets = _names(section.target_modules, f"{key}.target_modules")
    if not targets:
        raise ConfigError(f"{key}.target_modules is empty; use all-linear or a list such as [q_proj,v_proj].")
    exclude = _names(section.exclude_modules, f"{key}.exclude_modules")
    return LoraSettings(key, rank, alpha, targets, exclude or None)


def check_lora_config(cfg: Any, registry: Any = None) -> None:
    """The config-time LoRA check (from :func:`rlplug.run.validate.validate_config`; loads no weights).

    ``model.lora_rank`` / ``critic.model.lora_rank`` settings are checked (:func:`lora_settings`), and
    when either is on, every class ``trainer.backend`` builds must declare the capability
    :data:`LORA_CAPABILITY` (``local`` does; ``fsdp2`` does not). Raises :class:`rlplug.config.schema.ConfigError`.
    """
    critic_model = typed(CriticConfig, getattr(cfg, "critic", None)).model
    on = [s for s in (lora_settings(cfg.model), lora_settings(critic_model, "critic.model")) if s]
    if not on or registry is None:
        return
    name = str(cfg.trainer.backend)
    try:
        reg = registry.registration("training_backend", name)
    except PluginError as exc:
        raise ConfigError(f"trainer.backend={name}: {exc}") from exc
    classes = list(built_classes(reg.obj, reg.extra))
    lacking = [
        c.__qualname__ for c in classes if LORA_CAPABILITY not in frozenset(getattr(c, "capabilities", ()) or ())
    ]
    if lacking or not classes:
        keys = ", ".join(f"{s.key}.lora_rank={s.rank}" for s in on)
        raise ConfigError(
            f"{keys}: trainer.backend={name} ({', '.join(lacking) or 'its classes are not declared'}, "
            f"{reg.distribution} {reg.version}) does not support LoRA (no '{LORA_CAPABILITY}' capability). Use "
            "trainer=local for LoRA, or set the lora_rank to 0 to train every weight with this backend."
        )


# ============================================================================ building


def linear_module_names(model: nn.Module) -> list[str]:
    """Full names of the ``nn.Linear`` modules of ``model`` (``model.layers.0.self_attn.q_proj`` ...)."""
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]


def _meta_model(model_path: str | os.PathLike, trust_remote_code: bool, value_model: bool) -> nn.Module:
    """The model of ``model_path``'s ``config.json`` on the meta device (no weights read)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM  # deferred: transformers

    config = AutoConfig.from_pretrained(str(model_path), trust_remote_code=trust_remote_code)
    auto = AutoModel if value_model else AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(config, trust_remote_code=trust_remote_code)


def check_target_modules(
    settings: LoraSettings,
    model: nn.Module | str | os.PathLike,
    *,
    trust_remote_code: bool = False,
    value_model: bool = False,
) -> list[str]:
    """The full names of the modules of ``model`` that ``settings.target_modules`` selects (peft's own
    matching, ``peft.tuners.tuners_utils.check_target_module_exists``, ``exclude_modules`` applied).

    ``model`` is a module or a model folder (then built from its ``config.json`` on the meta device,
    no weights read; ``value_model``: its ``AutoModel`` backbone, as the critic loads it). Raises
    :class:`rlplug.config.schema.ConfigError` when nothing matches, listing the linear layer names the model
    has (their last name part, e.g. ``q_proj``), so the check fails before any training compute.
    """
    from peft.tuners.tuners_utils import check_target_module_exists  # deferred: peft

    if not isinstance(model, nn.Module):
        model = _meta_model(model, trust_remote_code, value_model)
    linear = linear_module_names(model)
    suffixes = sorted({n.rsplit(".", 1)[-1] for n in linear})
    if settings.target_modules == "all-linear":
        matched = [n for n in linear if not n.endswith("lm_head")]
    else:
        config = settings.peft_config(None)
        matched = [
            n
            for n, _ in model.named_modules()
            if n and (hit := check_target_module_exists(config, n)) and type(hit).__name__ != "_ExcludedModule"
        ]
    if not matched:
        shown = settings.target_modules if isinstance(settings.target_modules, str) else list(settings.target_modules)
        raise ConfigError(
            f"{settings.key}.target_modules={shown} matches no layer of the model"
            f"{' once ' + settings.key + '.exclude_modules is applied' if settings.exclude_modules else ''}. Its "
            f"linear layers are named {suffixes}: give a list of these (e.g. {settings.key}.target_modules="
            f"[{','.join(suffixes[:2])}]) or all-linear."
        )
    return matched


def apply_lora(model: nn.Module, settings: LoraSettings, *, seed: int = 0, task_type: str | None = "CAUSAL_LM") -> Any:
    """``model`` wrapped with LoRA adapters (``peft.get_peft_model``): base weights frozen, the adapters trainable.

    ``task_type``: ``"CAUSAL_LM"`` for the actor (a ``PeftModelForCausalLM``), ``None`` for the critic's
    backbone. The adapters' ``A`` matrices are drawn with ``torch.manual_seed(seed)`` in a forked RNG, so
    they do not depend on what was drawn before and the caller's RNG is untouched. The target modules are
    checked first (:func:`check_target_modules`). Raises :class:`rlplug.config.schema.ConfigError` when none match.
    """
    from peft import get_peft_model  # deferred: peft

    check_target_modules(settings, model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        return get_peft_model(model, settings.peft_config(task_type))


def _lora_layers(peft_model: Any) -> dict[str, Any]:
    """``{module name in the base model: peft LoRA layer}``."""
    from peft.tuners.lora import LoraLayer  # deferred: peft

    base = peft_model.get_base_model()
    return {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}


@torch.no_grad()
def merged_weights(peft_model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` of the merged model, as in a Hugging Face checkpoint of the base model.

    Each adapted layer's weight is ``W + delta`` with ``delta = (lora_alpha / r) * B @ A`` (peft's
    ``get_delta_weight``, the same sum peft's ``merge_and_unload`` computes, so the values are equal
    bit for bit); it is a new tensor, the trained module is unchanged. Every other tensor is a detached
    view of the live parameter (no copy); tied weights once, under the embedding's name. Names lose
    peft's ``.base_layer`` part; the adapter tensors themselves are not yielded.
    """
    deltas = {name: layer.get_delta_weight(_ADAPTER) for name, layer in _lora_layers(peft_model).items()}
    for name, tensor in unique_state(peft_model.get_base_model()).items():
        if ".lora_" in name:
            continue
        if ".base_layer." in name:
            module, _, leaf = name.rpartition(".base_layer.")
            name = f"{module}.{leaf}"
            if leaf == "weight" and module in deltas:
                tensor = tensor + deltas[module].to(tensor.dtype)
        yield name, tensor


def save_merged(peft_model: Any, directory: str | os.PathLike, tokenizer: Any = None) -> Path:
    """Write the merged model (:func:`merged_weights`) to ``directory`` as a Hugging Face folder (safetensors,
    ``config.json`` of the base, the tokenizer when given), without changing ``peft_model``. Loads with
    ``AutoModelForCausalLM.from_pretrained``."""
    from transformers import AutoModelForCausalLM  # deferred: transformers

    base = peft_model.get_base_model()
    config = base.config
    with torch.device("meta"):
        model: Any = AutoModelForCausalLM.from_config(config)
    state = {k: v.detach().cpu() for k, v in merged_weights(peft_model)}
    model.load_state_dict(state, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    model.config.use_cache = True
    model.save_pretrained(str(out), safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out


# ============================================================================ checkpoints


def base_fingerprint(model_path: str | os.PathLike) -> dict[str, Any]:
    """What identifies the base model folder a LoRA checkpoint builds on, cheaply (no full read).

    ``config_sha256`` (of ``config.json``), ``weights_bytes`` (size of each ``*.safetensors`` file, by
    name) and ``first_tensor_sha256`` (sha-256 of the first MiB of tensor data of the first weights file,
    right after its header: the leading tensor's values). Raises ``FileNotFoundError`` when the folder has
    no ``config.json`` or no safetensors file.
    """
    root = Path(model_path)
    files = sorted(root.glob("*.safetensors"))
    if not (root / "config.json").is_file() or not files:
        raise FileNotFoundError(
            f"{root} is not a Hugging Face model folder with config.json and *.safetensors weights; a LoRA "
            "checkpoint needs its base model."
        )
    with open(files[0], "rb") as fh:
        header = int.from_bytes(fh.read(8), "little")
        fh.seek(8 + header)
        first = hashlib.sha256(fh.read(_FINGERPRINT_BYTES)).hexdigest()
    return {
        "config_sha256": hashlib.sha256((root / "config.json").read_bytes()).hexdigest(),
        "weights_bytes": {f.name: f.stat().st_size for f in files},
        "first_tensor_sha256": first,
    }


def write_base_pointer(directory: str | os.PathLike, model_path: str | os.PathLike) -> None:
    """Write :data:`BASE_POINTER_FILE` into ``directory``: the base folder's absolute path and its
    :func:`base_fingerprint`."""
    path = Path(model_path).resolve()
    body = {"path": str(path), "fingerprint": base_fingerprint(path)}
    (Path(directory) / BASE_POINTER_FILE).write_text(json.dumps(body, indent=1, sort_keys=True))


def check_base_pointer(directory: str | os.PathLike, model_path: str | os.PathLike | None = None) -> Path:
    """The base model folder a LoRA checkpoint folder ``directory`` (``backend/actor``) builds on, checked.

    ``model_path``: the folder to check against (a resumed run's model); ``None``: the recorded path.
    Raises ``FileNotFoundError`` for a missing pointer or base folder and ``ValueError`` when the base
    folder's :func:`base_fingerprint` differs from the recorded one (the adapters were trained on
    other weights).
    """
    pointer = Path(directory) / BASE_POINTER_FILE
    if not pointer.is_file():
        raise FileNotFoundError(f"{pointer} is missing: {directory} is not the actor folder of a LoRA checkpoint.")
    saved = json.loads(pointer.read_text())
    base = Path(model_path) if model_path is not None else Path(saved["path"])
    if not base.is_dir():
        raise FileNotFoundError(
            f"The LoRA checkpoint {directory} builds on the base model {base}, which does not exist any more. "
            "Restore that folder (the checkpoint holds only the adapters)."
        )
    current = base_fingerprint(base)
    if current != saved["fingerprint"]:
        diff = sorted(k for k in current if current[k] != saved["fingerprint"].get(k))
        raise ValueError(
            f"The LoRA checkpoint {directory} was trained on the base model {saved['path']}, but {base} differs "
            f"from it ({', '.join(diff)} changed): the adapters only make sense on their own base weights. Use the "
            "original base model folder (model.path), or start fresh with trainer.resume_mode=disable."
        )
    return base


def save_lora_state(model: Any, directory: str | os.PathLike, base_path: str | os.PathLike, role: str) -> None:
    """Write a LoRA role's trained tensors into its checkpoint folder ``directory`` (``backend/<role>``).

    The actor (a ``PeftModel``): the PEFT adapter folder :data:`ADAPTER_DIR` (``save_pretrained``:
    ``adapter_config.json``, ``adapter_model.safetensors``). The critic: :data:`TRAINABLE_FILE`, every
    trainable tensor (adapters and the value head) under its module name. Both: :data:`BASE_POINTER_FILE`
    for ``base_path`` (:func:`write_base_pointer`). The frozen base weights are not written.
    """
    out = Path(directory)
    if role == "actor":
        model.save_pretrained(str(out / ADAPTER_DIR), safe_serialization=True, save_embedding_layers=False)
    else:
        state = {n: p.detach().contiguous().cpu() for n, p in model.named_parameters() if p.requires_grad}
        safetensors.torch.save_file(state, str(out / TRAINABLE_FILE), metadata={"format": "pt"})
    write_base_pointer(out, base_path)


def load_lora_state(
    model: Any, directory: str | os.PathLike, base_path: str | os.PathLike, role: str, key: str, device: Any
) -> None:
    """Restore what :func:`save_lora_state` wrote into ``model`` (built with the same LoRA settings on
    ``base_path``), bit for bit.

    Raises ``ValueError`` when the checkpoint was written without LoRA, when its base model's fingerprint
    differs (:func:`check_base_pointer`), or when its tensors do not fit the adapters (another
    ``lora_rank`` or ``target_modules``; ``key`` names the setting), and ``FileNotFoundError`` for a
    missing file.
    """
    d = Path(directory)
    if not (d / BASE_POINTER_FILE).is_file():
        raise ValueError(
            f"{d} holds the {role}'s full weights (that run trained without LoRA), but {key}.lora_rank > 0 now. "
            f"Resume with {key}.lora_rank=0, or start a LoRA run fresh (trainer.resume_mode=disable)."
        )
    check_base_pointer(d, base_path)
    mismatch = (
        f"{d} does not fit this run's adapters: {{}}. Resume with the {key}.lora_rank, lora_alpha and "
        "target_modules of the checkpointed run."
    )
    if role == "actor":
        from peft import set_peft_model_state_dict  # deferred: peft

        state = safetensors.torch.load_file(str(d / ADAPTER_DIR / "adapter_model.safetensors"), device=str(device))
        expected = sum(1 for n, _ in model.named_parameters() if ".lora_" in n)
        try:
            result: Any = set_peft_model_state_dict(model, state)
        except RuntimeError as exc:
            raise ValueError(mismatch.format(str(exc).splitlines()[-1].strip())) from exc
        if result.unexpected_keys or len(state) != expected:
            raise ValueError(mismatch.format(f"{len(state)} adapter tensors saved, {expected} here"))
        return
    state = safetensors.torch.load_file(str(d / TRAINABLE_FILE), device=str(device))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    if set(state) != trainable:
        raise ValueError(mismatch.format(f"differing tensors {sorted(set(state) ^ trainable)[:4]}"))
    try:
        model.load_state_dict(state, strict=False)
    except RuntimeError as exc:
        raise ValueError(mismatch.format(str(exc).splitlines()[-1].strip())) from exc


def is_lora_role_dir(directory: str | os.PathLike) -> bool:
    """Whether a role's checkpoint folder (``backend/actor``) was written by :func:`save_lora_state`."""
    return (Path(directory) / BASE_POINTER_FILE).is_file()


def is_lora_checkpoint(checkpoint: str | os.PathLike) -> bool:
    """Whether the complete checkpoint ``checkpoint`` (a ``global_step_N`` dir) holds a LoRA actor."""
    return (Path(checkpoint) / "backend" / "actor" / ADAPTER_DIR / "adapter_config.json").is_file()


def lora_actor_dir(checkpoint: str | os.PathLike) -> Path:
    """``backend/actor`` of the complete LoRA checkpoint ``checkpoint`` (a ``global_step_N`` dir). Raises
    ``FileNotFoundError`` when it holds no PEFT adapter."""
    adapter = Path(checkpoint) / "backend" / "actor" / ADAPTER_DIR
    if not (adapter / "adapter_config.json").is_file():
        raise FileNotFoundError(
            f"{adapter} holds no PEFT adapter: {checkpoint} was trained without LoRA (model.lora_rank=0), so it "
            "has no adapter to export; export the whole model without --adapter-only."
        )
    return adapter.parent
