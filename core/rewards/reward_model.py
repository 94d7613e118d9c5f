"""Discriminative reward models: a Hugging Face ``AutoModelForSequenceClassification`` with one label
scores each (prompt, response) pair; ``rlplug rm train`` trains one from preference pairs.

Configuration (verl's current names, ``reward.reward_model.*``; verl's legacy top-level
``reward_model.*`` spellings are aliases, :mod:`rlplug.config.verl_keys`)::

    reward.reward_model.enable=true
    reward.reward_model.model_path=/path/to/rm          # an AutoModelForSequenceClassification folder
    reward.reward_model.micro_batch_size_per_device=8   # responses per RM forward pass
    reward.reward_model.max_length=null                 # RM input tokens (longer: cut on the right, as verl)

The reward model enters the score as the ``reward.shaping`` entry named ``reward_model``
(:func:`shaping_entries`)::

    score = reward.correctness_weight * correctness + sum(weight * shaping value)

``reward.reward_model.weight=0.3 reward.correctness_weight=0.7`` (the ``reward=reward_model`` preset)
mixes 0.7 rule correctness with 0.3 reward model. ``reward.reward_model.enable=true`` alone replaces
the correctness score with the reward model (weight 1, correctness weight 0: verl, whose reward
manager returns the ``rm_scores`` when a reward model is on); other ``reward.shaping`` terms stay
(``reward.shaping=[]`` drops them). A ``reward.shaping`` entry ``{name: reward_model, weight: w}``
places the term explicitly (correctness weight 1 unless set). Each term is logged: ``critic/correctness/mean``,
``critic/shaping/reward_model/mean`` (unweighted). Validation keeps the rule reward (correctness,
weight 1, and the other shaping terms) unless ``reward.val_reward_model=true`` (verl's
``val_reward_fn``; a documented difference: verl scores validation with the reward model too).

Scoring (the ``reward_model`` plugin, :mod:`rlplug.plugins.rewards.reward_model`, on the input format and forward
pass of :class:`RewardModelBase`, which ``rlplug rm train`` trains with): each response (the actor's decoded text) is appended to its
prompt's messages as an ``assistant`` turn and templated with the **reward model's own** tokenizer
and chat template (``apply_chat_template(..., add_generation_prompt=False, tokenize=False)``, then
tokenized without added special tokens, as verl's ``RewardLoopWorker._preprocess_reward_inputs``),
so its vocabulary may differ from the actor's. Inputs go ``micro_batch_size_per_device`` at a time,
right-padded, on the training device (``trainer.device``); the score is the model's single logit
at the last token of the templated text (raw, no sigmoid), and the trainer puts it on the last
response token (``token_level_scores``, :func:`rlplug.algorithms.losses.compute_token_level_scores`).

Training (:func:`rlplug.training.rm_train.train_reward_model`): the Bradley-Terry loss ``-log sigmoid(r_chosen - r_rejected)``
(Ouyang et al. 2022, "InstructGPT", Eq. 1) on ``prompt``/``chosen``/``rejected`` pairs
(:mod:`rlplug.rewards.pairs`), a held-out split whose pairwise accuracy (``r_chosen > r_rejected``) is
printed and written to ``<out>/metrics.json``.

What stays here is what the engine needs without the plugin: the config-time checks (no weights loaded,
no transformers import), the error type, the shaping entries the reward manager builds, and the model
input format and forward pass (:class:`RewardModelBase`) that ``rlplug rm train`` trains and the plugin
scores with -- one definition, so a trained model is scored on exactly the inputs it was trained on.
Loading a model folder, the per-process scorer cache and the reward function moved to the plugin; their
old names here (``RewardModelScorer``, ``get_scorer``, ``RewardModelFunction``) are forwarded there with a
``DeprecationWarning`` for one release (:data:`rlplug._moved.MOVED_NAMES`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from rlplug._moved import forward_name
from rlplug.config.schema import ConfigError

if TYPE_CHECKING:  # torch is imported when a model is scored (reward worker processes start without it)
    import torch

__all__ = [
    "RM_NAME",
    "RM_KWARGS",
    "RewardModelBase",
    "RewardModelError",
    "check_reward_model_folder",
    "check_reward_model_config",
    "check_reward_model_settings",
    "reward_model_device",
    "shaping_entries",
]

logger = logging.getLogger("rlplug.rewards.reward_model")

#: the name the packaged reward model is registered under (kind ``reward_function``)
RM_NAME = "reward_model"
#: the settings of ``reward.reward_model`` passed to the ``reward_model`` function as keyword arguments
RM_KWARGS = ("model_path", "micro_batch_size_per_device", "max_length", "device", "dtype", "trust_remote_code")
_KEY = "reward.reward_model.model_path"
_TRAIN_HINT = (
    "Train one from preference pairs with `rlplug rm train --pairs PAIRS.parquet --out DIR` (it adds a "
    "one-label score head to a causal LM), or point it at an AutoModelForSequenceClassification folder with one label."
)


class RewardModelError(ConfigError):
    """The reward model setting cannot be used: a missing folder, not a sequence-classification model,
    ``num_labels != 1``, no tokenizer or chat template, bad pairs, or bad settings."""


# ============================================================================ config


def _plain(x: Any) -> dict:
    if isinstance(x, Mapping):
        return dict(x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.asdict(x)
    return dict(vars(x))


def shaping_entries(reward: Mapping[str, Any]) -> tuple[list[dict], float]:
    """The ``reward.shaping`` entries with the reward model's, and the weight of the correctness score.

    ``reward`` is the ``reward`` section as a plain mapping. An entry named ``reward_model`` without
    its own ``kwargs`` gets the ``reward.reward_model`` settings (:data:`RM_KWARGS`) as keyword
    arguments; ``reward.reward_model.enable=true`` with no such entry appends ``{name: reward_model,
    weight: reward.reward_model.weight}`` (default 1.0). The correctness weight is
    ``reward.correctness_weight``, or when that is unset (None) 0.0 with that appended entry (the
    reward model replaces the correctness score, as verl) and 1.0 otherwise.

    Raises:
        RewardModelError: a ``reward_model`` entry takes its settings from ``reward.reward_model`` but
            ``reward.reward_model.enable`` is false.
    """
    entries = [_plain(s) for s in reward.get("shaping") or []]
    rm = _plain(reward.get("reward_model") or {})
    enabled = bool(rm.get("enable"))
    settings = {k: rm[k] for k in RM_KWARGS if rm.get(k) is not None}
    named = [e for e in entries if e.get("name") == RM_NAME]
    for i, e in enumerate(entries):
        if e.get("name") != RM_NAME or e.get("kwargs"):
            continue
        if not enabled:
            raise RewardModelError(
                f"reward.shaping[{i}] is the reward model, but reward.reward_model.enable=false. Set "
                "reward.reward_model.enable=true and reward.reward_model.model_path=<folder>, or give the entry "
                "its own kwargs: {model_path: <folder>}."
            )
        e["kwargs"] = dict(settings)
    if enabled and not named:
        weight = 1.0 if rm.get("weight") is None else float(rm["weight"])
        entries.append({"name": RM_NAME, "weight": weight, "kwargs": dict(settings)})
    cw = reward.get("correctness_weight")
    if cw is None:
        cw = 0.0 if enabled and not named else 1.0
    return entries, float(cw)


def check_reward_model_folder(path: Any, key: str = _KEY) -> Path:
    """``path`` resolved, if it is a Hugging Face sequence-classification folder with one label and a
    tokenizer; reads ``config.json`` only (no weights, no transformers import).

    Raises:
        RewardModelError: unset path, missing folder, no ``config.json``, an architecture that is not
            ``*ForSequenceClassification`` (e.g. a causal LM), ``num_labels != 1``, or no tokenizer files.
    """
    if path is None or str(path) in ("", "???"):
        raise RewardModelError(
            f"The reward model needs {key}: the folder of an AutoModelForSequenceClassification (config.json, "
            f"weights, tokenizer). Set {key}=/path/to/rm. {_TRAIN_HINT}"
        )
    p = Path(str(path)).expanduser()
    if not p.is_dir():
        raise RewardModelError(f"{key}={p}: no such folder. {_TRAIN_HINT}")
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        found = sorted(x.name for x in p.iterdir())[:20]
        raise RewardModelError(
            f"{key}={p} has no config.json, so it is not a Hugging Face model folder (it holds: {found}). "
            f"Point it at the folder written by save_pretrained. {_TRAIN_HINT}"
        )
    try:
        config = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as exc:
        raise RewardModelError(f"{key}={p}: config.json cannot be read ({exc}).") from exc
    arch = list(config.get("architectures") or [])
    if not any(str(a).endswith("ForSequenceClassification") for a in arch):
        causal = any(str(a).endswith(("ForCausalLM", "LMHeadModel")) for a in arch)
        what = "a causal LM" if causal else "not a reward model"
        raise RewardModelError(
            f"{key}={p} is a {', '.join(arch) or 'model without architectures in config.json'} ({what}); a "
            f"reward model is an AutoModelForSequenceClassification (architectures: *ForSequenceClassification). "
            f"{_TRAIN_HINT}"
        )
    n_labels = len(config["id2label"]) if isinstance(config.get("id2label"), Mapping) else config.get("num_labels", 2)
    if int(n_labels) != 1:
        raise RewardModelError(
            f"{key}={p} is a {arch[0]} with num_labels={n_labels}; a reward model gives one score per "
            "response (num_labels=1). Use a one-label model (save it with num_labels=1), or train one: " + _TRAIN_HINT
        )
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        raise RewardModelError(
            f"{key}={p} has no tokenizer (tokenizer.json / tokenizer_config.json): the reward model re-templates "
            "each response with its own tokenizer and chat template. Save the tokenizer into the folder "
            "(tokenizer.save_pretrained)."
        )
    return p.resolve()


def check_reward_model_settings(kwargs: Mapping[str, Any], where: str = "reward.reward_model") -> None:
    """Config-time check of the reward model's settings ``kwargs`` (the keys of :data:`RM_KWARGS`); ``where``
    names them in the message. Reads no folder.

    Raises:
        RewardModelError: an unknown setting, ``micro_batch_size_per_device < 1``, ``max_length < 2``, or a
            device other than ``auto``, ``cpu``, ``cuda[:N]``.
    """
    unknown = sorted(set(kwargs) - set(RM_KWARGS))
    if unknown:
        raise RewardModelError(f"{where}: unknown setting(s) {unknown}; the reward model takes {', '.join(RM_KWARGS)}.")
    mb = kwargs.get("micro_batch_size_per_device")
    if mb is not None and int(mb) < 1:
        raise RewardModelError(f"{where}.micro_batch_size_per_device={mb}: must be >= 1 (responses per forward pass).")
    ml = kwargs.get("max_length")
    if ml is not None and int(ml) < 2:
        raise RewardModelError(f"{where}.max_length={ml}: must be >= 2 tokens, or null (no limit).")
    if str(kwargs.get("device", "auto")) not in ("auto", "cpu", "cuda") and not str(kwargs["device"]).startswith(
        "cuda:"
    ):
        raise RewardModelError(f"{where}.device={kwargs['device']}: expected auto, cpu or cuda[:N].")


def check_reward_model_config(reward: Any) -> None:
    """Config-time check of the reward model (``reward`` section): every ``reward_model`` shaping entry's
    settings and folder (:func:`check_reward_model_folder`); nothing when no entry uses it.

    Raises:
        RewardModelError: what :func:`shaping_entries`, :func:`check_reward_model_folder` raise, or bad settings.
    """
    section = _plain(reward) if not hasattr(reward, "_get_node") else _omega(reward)
    given = [_plain(s) for s in section.get("shaping") or []]
    entries, _ = shaping_entries(section)
    for i, e in enumerate(entries):
        if e.get("name") == RM_NAME:
            own = i < len(given) and bool(given[i].get("kwargs"))
            where = f"reward.shaping[{i}].kwargs" if own else "reward.reward_model"
            kwargs = dict(e.get("kwargs") or {})
            check_reward_model_settings(kwargs, where)
            check_reward_model_folder(kwargs.get("model_path"), f"{where}.model_path")


def _omega(node: Any) -> dict:
    return OmegaConf.to_container(node, resolve=True)  # type: ignore[return-value]


# ============================================================================ model inputs and forward pass


def reward_model_device(name: Any) -> str:
    """The torch device name of the setting ``name``: ``auto`` (or None) and ``cuda`` are ``cuda:<N>`` with ``N``
    the calling thread's current CUDA device (a torchrun rank's own GPU once the backend set it) when a GPU is
    visible, ``auto`` else ``cpu``; any other name is returned unchanged (``cpu``, ``cuda:N``). The index is fixed
    here because scoring runs on other threads, whose current device is GPU 0 whatever the rank's."""
    import torch  # deferred: torch

    name = str(name or "auto")
    if name == "auto" and not torch.cuda.is_available():
        return "cpu"
    if name in ("auto", "cuda") and torch.cuda.is_available():
        return f"cuda:{torch.cuda.current_device()}"
    return name


def _lock_pad(ids: Sequence[Sequence[int]], preferred: int | None) -> int:
    """A pad id that is no row's last token: the model's pooling takes the rightmost token that is not
    the pad id, so a row ending in the pad id (e.g. ``eos == pad``) would be scored one token early."""
    last = {int(r[-1]) for r in ids if len(r)}
    if preferred is not None and int(preferred) not in last:
        return int(preferred)
    return next(i for i in range(len(last) + 1) if i not in last)


class RewardModelBase:
    """A built reward model's input format and forward pass: templates and tokenizes (prompt messages,
    response) pairs and returns the one-label logit of each.

    ``rlplug rm train`` (:func:`rlplug.training.rm_train.train_reward_model`) trains through it, and the
    ``reward_model`` plugin's scorer (:class:`rlplug.plugins.rewards.reward_model.RewardModelScorer`)
    subclasses it to load a model folder and score without gradients, so both see the same inputs.

    Args:
        model: a one-label ``AutoModelForSequenceClassification`` (or any module with ``.config`` and a
            forward returning ``.logits`` of shape ``(N, 1)``), already on ``device``.
        tokenizer: its tokenizer, with a chat template.
        device: ``auto`` (cuda when available, else cpu), ``cpu`` or ``cuda[:N]``
            (:func:`reward_model_device`).
        micro_batch_size_per_device: rows per forward pass.
        max_length: input tokens at most (None: no limit); a longer input keeps its first ``max_length``
            tokens (verl's default right truncation) and is scored at its last kept token.
        model_path: the folder the model came from, named in error messages.

    Raises:
        RewardModelError: a tokenizer without a chat template.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        device: Any = "auto",
        micro_batch_size_per_device: int = 8,
        max_length: int | None = None,
        model_path: Any = None,
    ) -> None:
        self.device = reward_model_device(device)
        self.micro_batch_size = int(micro_batch_size_per_device)
        self.max_length = None if max_length is None else int(max_length)
        if getattr(tokenizer, "chat_template", None) is None:
            raise RewardModelError(
                f"The reward model's tokenizer ({model_path}) has no chat template: responses are templated as "
                "an assistant turn after the prompt with it. Save a tokenizer with a chat_template into the folder."
            )
        self.model, self.tokenizer = model, tokenizer
        self._truncated_warned = False

    def template(self, messages: Sequence[Mapping[str, str]], response: str) -> str:
        """The RM's input text: ``messages`` plus ``{"role": "assistant", "content": response}`` in the
        RM tokenizer's chat template (no generation prompt)."""
        chat = [{"role": str(m["role"]), "content": str(m["content"])} for m in messages]
        chat.append({"role": "assistant", "content": response})
        return str(self.tokenizer.apply_chat_template(chat, add_generation_prompt=False, tokenize=False))

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each templated text (no special tokens added: the template has them), at most
        ``max_length`` each."""
        ids = [list(x) for x in self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]]
        if self.max_length is not None and any(len(x) > self.max_length for x in ids):
            if not self._truncated_warned:
                self._truncated_warned = True
                logger.warning(
                    "reward model inputs longer than reward.reward_model.max_length=%d tokens are cut on the "
                    "right (verl's truncation) and scored at their last kept token; raise max_length to score "
                    "whole responses (longest: %d tokens).",
                    self.max_length,
                    max(map(len, ids)),
                )
            ids = [x[: self.max_length] for x in ids]
        return ids

    def forward_ids(self, ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """``(N,) float32`` logits of the rows ``ids`` (token id lists), one forward per
        ``micro_batch_size`` rows, right-padded, at each row's last token; keeps the graph when grad
        is enabled (``rm train``). Raises ``ValueError`` for a row with no tokens."""
        import torch  # deferred: torch

        if any(len(r) == 0 for r in ids):
            raise ValueError("a reward model input has no tokens")
        out = []
        for lo in range(0, len(ids), self.micro_batch_size):
            chunk = ids[lo : lo + self.micro_batch_size]
            width = max(len(r) for r in chunk)
            pad = _lock_pad(chunk, self.tokenizer.pad_token_id)
            input_ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for j, r in enumerate(chunk):
                input_ids[j, : len(r)] = torch.tensor(list(r), dtype=torch.long)
                mask[j, : len(r)] = 1
            text_cfg = self.model.config.get_text_config() if hasattr(self.model.config, "get_text_config") else None
            cfg = text_cfg or self.model.config
            old, cfg.pad_token_id = cfg.pad_token_id, pad
            try:
                logits = self.model(
                    input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False
                ).logits
            finally:
                cfg.pad_token_id = old
            out.append(logits[:, 0].float())
        return torch.cat(out) if out else torch.zeros(0)


def __getattr__(name: str) -> Any:
    """The scorer, its cache and the reward function moved to the ``reward_model`` plugin: forwarded there with
    a ``DeprecationWarning`` (:func:`rlplug._moved.forward_name`); ``AttributeError`` for any other name."""
    return forward_name(__name__, name)
