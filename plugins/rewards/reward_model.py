"""The ``reward_model`` reward function: a discriminative reward model (a local
AutoModelForSequenceClassification with one label), configured with ``reward.reward_model.*``.

The engine keeps what it needs without this plugin (``docs/reward_models.md``): the config-time checks of
``reward.reward_model`` (no weights loaded), :class:`RewardModelError`, the ``reward.shaping`` entry the reward
manager builds for the reward model, and :class:`RewardModelBase`, the input format and forward pass that
``rlplug rm train`` trains with. This plugin loads a model folder (:class:`RewardModelScorer`), keeps one
scorer per settings in the process (:func:`get_scorer`) and registers the reward function
(:class:`RewardModelFunction`) under :data:`RM_NAME`, the way a third-party package would.

Scoring: each response (the actor's decoded text) is appended to its prompt's messages as an ``assistant``
turn and templated with the **reward model's own** tokenizer and chat template, inputs go
``micro_batch_size_per_device`` at a time on ``device``, and the score is the model's single logit at the
last token of the templated text (raw, no sigmoid): :class:`RewardModelBase`.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from rlplug.plugin import (
    RM_NAME,
    RewardModelBase,
    ScoresOneAsABatch,
    check_reward_model_folder,
    check_reward_model_settings,
    hookimpl,
    reward_model_device,
)

__all__ = ["RewardModelScorer", "RewardModelFunction", "get_scorer"]

#: ``reward.reward_model.dtype`` -> the torch dtype the model is loaded in
_DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}
_DTYPES |= {"fp16": "float16", "float16": "float16"}


class RewardModelScorer(RewardModelBase):
    """A loaded reward model: templates, tokenizes and scores (prompt messages, response) pairs.

    Args:
        model_path: a folder :func:`rlplug.plugin.check_reward_model_folder` accepts.
        device: ``auto`` (cuda when available, else cpu), ``cpu`` or ``cuda[:N]``.
        micro_batch_size_per_device: responses per forward pass.
        max_length: RM input tokens at most (None: no limit); a longer input keeps its first
            ``max_length`` tokens (verl's default right truncation) and is scored at its last kept token.
        dtype: ``fp32`` (default), ``bf16`` or ``fp16``.
        trust_remote_code: passed to transformers.
        model, tokenizer: an already-built model and tokenizer instead of loading.

    Raises:
        RewardModelError: see :func:`rlplug.plugin.check_reward_model_folder`; a tokenizer without a chat template.
    """

    def __init__(
        self,
        model_path: Any = None,
        *,
        device: Any = "auto",
        micro_batch_size_per_device: int = 8,
        max_length: int | None = None,
        dtype: str = "fp32",
        trust_remote_code: bool = False,
        model: Any = None,
        tokenizer: Any = None,
    ) -> None:
        device = reward_model_device(device)
        if model is None:
            import torch  # deferred: torch
            from transformers import AutoModelForSequenceClassification, AutoTokenizer  # deferred: transformers

            folder = check_reward_model_folder(model_path)
            tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
            torch_dtype = getattr(torch, _DTYPES.get(str(dtype), "float32"))
            model = AutoModelForSequenceClassification.from_pretrained(
                str(folder), dtype=torch_dtype, trust_remote_code=trust_remote_code
            )
            model = model.to(device).eval()
        super().__init__(
            model,
            tokenizer,
            device=device,
            micro_batch_size_per_device=micro_batch_size_per_device,
            max_length=max_length,
            model_path=model_path,
        )
        self._lock = threading.Lock()

    def score(self, messages: Sequence[Sequence[Mapping[str, str]]], responses: Sequence[str]) -> list[float]:
        """The reward of each response to its prompt's ``messages`` (``B`` floats, the raw logit), without
        gradients; one scoring at a time per scorer. Raises ``ValueError`` when the lengths differ."""
        import torch  # deferred: torch

        if len(messages) != len(responses):
            raise ValueError(f"{len(messages)} prompts for {len(responses)} responses")
        ids = self.encode([self.template(m, r) for m, r in zip(messages, responses)])
        with self._lock, torch.no_grad():
            return [float(x) for x in self.forward_ids(ids).cpu()]


_SCORERS: dict[tuple, RewardModelScorer] = {}
_SCORERS_LOCK = threading.Lock()


def get_scorer(**kwargs: Any) -> RewardModelScorer:
    """The process's :class:`RewardModelScorer` for these settings (``reward.reward_model``'s keys,
    :data:`rlplug.rewards.reward_model.RM_KWARGS`), loaded once."""
    key = tuple(sorted((k, str(v)) for k, v in kwargs.items()))
    with _SCORERS_LOCK:
        scorer = _SCORERS.get(key)
        if scorer is None:
            scorer = _SCORERS[key] = RewardModelScorer(**kwargs)
        return scorer


class RewardModelFunction(ScoresOneAsABatch):
    """The ``reward_model`` reward function (kind ``reward_function``): a batched, model-based scorer.

    ``score_batch(data_sources, solution_strs, ground_truths, extra_infos, *, messages, **settings)``
    returns ``B`` floats: the reward model's score of each response after its prompt ``messages``
    (the rows' chat messages); the reward manager calls it once per batch. ``settings`` are
    ``reward.reward_model``'s keys (``model_path``, ``micro_batch_size_per_device``, ``max_length``,
    ``device``, ``dtype``, ``trust_remote_code``). ``model_based = True``: left out of validation unless
    ``reward.val_reward_model=true``. Calling it on one response works too, with ``messages=`` (its
    prompt's messages) among the keyword arguments.
    """

    model_based = True

    def score_batch(
        self,
        data_sources: Sequence[str],
        solution_strs: Sequence[str],
        ground_truths: Sequence[Any],
        extra_infos: Sequence[Any],
        *,
        messages: Sequence[Any],
        **kwargs: Any,
    ) -> list[float]:
        """See the class docstring. Raises ``ValueError`` when a row has no prompt messages."""
        missing = [i for i, m in enumerate(messages) if not m]
        if missing:
            raise ValueError(
                f"the reward model needs each response's prompt (the row's chat messages); rows {missing[:5]} have "
                "none. Score rows read with rlplug.data.dataset.read_dataset (their 'messages'), or pass messages=."
            )
        return get_scorer(**kwargs).score(messages, solution_strs)

    def prepare(self, kwargs: Mapping[str, Any]) -> None:
        """Load the reward model for these settings now (at the trainer's setup, with no per-response
        timeout: the reward manager's ``prepare``); the scorer is shared with later calls.
        A ``messages`` entry (a per-call argument, not a setting) is ignored."""
        get_scorer(**{k: v for k, v in kwargs.items() if k != "messages"})

    def validate_kwargs(self, kwargs: Mapping[str, Any]) -> None:
        """Config-time check of the settings and the folder (no weights loaded); raises ``RewardModelError``."""
        check_reward_model_settings(kwargs)
        check_reward_model_folder(kwargs.get("model_path"))


@hookimpl
def register_reward_functions(register):
    """Register ``reward_model`` (selected by ``reward.reward_model.enable`` or a ``reward.shaping`` entry)."""
    register(RM_NAME, RewardModelFunction())
