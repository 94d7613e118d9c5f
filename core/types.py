"""The objects plugins register, one type per plugin kind.

Shape letters used throughout rlplug:

* ``B`` -- responses in a batch (prompts x ``rollout.n`` samples per prompt)
* ``T`` -- padded response length (tokens)
* ``P`` -- padded prompt length (tokens)
* ``V`` -- vocabulary size

Every kind has exactly one call signature, documented here and on the
registration hook in :mod:`rlplug.hookspecs`; the trainer never special-cases
a plugin by name.  New inputs go on the batch, not into the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

if TYPE_CHECKING:  # torch is imported lazily so reward worker processes start fast
    import torch

__all__ = [
    "AdvantageEstimator",
    "PolicyLoss",
    "KLPenalty",
    "RewardFunction",
    "SamplingParams",
    "RolloutOutput",
    "RolloutBackend",
    "TrainingBackend",
    "Tracker",
    "MissingInputError",
]


class MissingInputError(ValueError):
    """An algorithm plugin was called without an input it needs.

    The message names the missing input and the configuration that provides it.
    """


# --------------------------------------------------------------------------- advantage estimators
AdvantageFn = Callable[..., "tuple[torch.Tensor, torch.Tensor]"]


@dataclass(frozen=True)
class AdvantageEstimator:
    """An advantage estimator (kind ``advantage_estimator``).

    ``fn(data, config) -> (advantages, returns)`` where

    * ``data`` is a mapping of tensor name to tensor; always present:
      ``token_level_rewards`` ``(B, T) float32`` and ``response_mask`` ``(B, T) float32``
      (1.0 on generated tokens); on request (see ``requires``): ``values`` ``(B, T) float32``
      from the critic, ``index`` ``(B,) int64`` group ids (responses to one prompt share one id),
      ``reward_baselines`` ``(B,) float32`` (e.g. the greedy response's score for ReMax).
    * ``config`` is the ``algorithm`` config section (``gamma``, ``lam``,
      ``norm_adv_by_std_in_grpo``, ...), a mapping or attribute object.
    * returns ``advantages`` and ``returns``, both ``(B, T) float32`` and exactly 0.0
      where ``response_mask`` is 0.

    ``requires`` names the optional inputs the function needs; the trainer uses it
    to decide what to compute (e.g. ``values`` means a critic is trained,
    ``reward_baselines`` means a greedy baseline rollout is generated) and
    :meth:`__call__` raises :class:`MissingInputError` when one is absent.
    ``group_based`` estimators need ``rollout.n >= 2`` (a config error otherwise).
    """

    fn: AdvantageFn
    requires: tuple[str, ...] = ()
    group_based: bool = False
    description: str = ""

    @property
    def uses_critic(self) -> bool:
        return "values" in self.requires

    def __call__(self, data: Mapping[str, torch.Tensor], config: Any) -> tuple[torch.Tensor, torch.Tensor]:
        provider = {
            "values": "a critic (it is enabled automatically for this estimator; check critic.* settings)",
            "index": "group ids from rollout.n >= 2 (the trainer fills data['index'] with the prompt id)",
            "reward_baselines": "a baseline rollout (the trainer generates a greedy response per prompt for ReMax)",
        }
        for key in ("token_level_rewards", "response_mask", *self.requires):
            if key not in data or data[key] is None:
                raise MissingInputError(
                    f"advantage estimator needs input '{key}' but the batch has none; "
                    f"it is provided by {provider.get(key, 'the trainer')}. Present inputs: {sorted(k for k in data if data[k] is not None)}"
                )
        return self.fn(data, config)


# --------------------------------------------------------------------------- policy losses
@dataclass(frozen=True)
class PolicyLoss:
    """A policy loss (kind ``policy_loss``).

    ``fn(old_log_probs, log_probs, advantages, response_mask, *, config, loss_agg_mode,
    normalizer, max_response_length=None) -> (loss, metrics)`` where the first four are ``(B, T) float32``
    (log-probs in nats of the sampled tokens), ``config`` is the ``actor`` config section
    (``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high``, ``clip_ratio_c``, ...),
    ``normalizer`` is the global count the aggregation divides by (valid tokens or
    sequences of the whole mini-batch, over all micro-batches and ranks), ``max_response_length``
    (tokens) is the constant ``seq-mean-token-sum-norm`` divides by, and the result is a
    scalar ``loss`` tensor plus ``metrics`` ``dict[str, float]`` with at least
    ``pg_clipfrac``, ``pg_clipfrac_lower`` and ``ppo_kl``.

    ``validate(config)`` is called once at config time and raises ``ValueError`` for
    invalid settings (e.g. ``clip_ratio_c <= 1``).
    """

    fn: Callable[..., "tuple[torch.Tensor, dict[str, float]]"]
    validate: Callable[[Any], None] | None = None
    description: str = ""

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, dict[str, float]]:
        return self.fn(*args, **kwargs)


# --------------------------------------------------------------------------- KL penalties
@dataclass(frozen=True)
class KLPenalty:
    """A per-token KL estimator (kind ``kl_penalty``).

    ``fn(log_probs, ref_log_probs, *, logits=None, ref_logits=None) -> kl`` with
    log-probs ``(B, T) float32`` in nats and the result ``(B, T) float32`` (nats, not masked).
    ``needs_logits`` estimators (``full``) also need ``logits``/``ref_logits`` ``(B, T, V)``.
    """

    fn: Callable[..., torch.Tensor]
    needs_logits: bool = False
    description: str = ""

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.fn(*args, **kwargs)


# --------------------------------------------------------------------------- reward functions
class RewardFunction(Protocol):
    """verl's reward contract (kind ``reward_function``).

    ``fn(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None,
    **kwargs) -> float | dict``. A dict carries ``"score"`` (float) and any other values to
    log. ``kwargs`` come from ``reward.kwargs.<name>`` in the config. Any plain function
    with this signature can be registered, so a verl custom reward works unchanged.
    """

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None, **kwargs: Any
    ) -> float | dict: ...


# --------------------------------------------------------------------------- rollout backends
@dataclass
class SamplingParams:
    """Sampling settings for one ``generate`` call.

    ``top_k = -1`` disables top-k; ``temperature = 0`` means greedy.
    ``max_tokens`` is the response length limit in tokens. ``ignore_eos`` makes every response
    exactly ``max_tokens`` tokens long (EOS and the other stop tokens are suppressed, like vLLM's
    ``min_tokens = max_tokens``); it is for benchmarks that need a fixed length (verl's
    ``rollout.ignore_eos``), not for training.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    seed: int | None = None
    logprobs: bool = False
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class RolloutOutput:
    """What every rollout backend returns for ``len(prompts) * n`` responses.

    Responses are ordered prompt-major: the ``n`` samples of prompt 0 first.

    * ``response_ids``: list of ``B`` lists of int token ids (EOS included when generated,
      no padding).
    * ``finish_reasons``: ``"stop"`` (EOS generated) or ``"length"`` (hit ``max_tokens``).
    * ``log_probs``: optional list of ``B`` lists of float (nats) from the engine, aligned with
      ``response_ids``; used only for the optional importance-sampling correction.
    * ``prompt_index``: ``B`` ints, the index of the prompt each response answers.
    """

    response_ids: list[list[int]]
    finish_reasons: list[str]
    prompt_index: list[int]
    log_probs: list[list[float]] | None = None

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if len(self.finish_reasons) != n or len(self.prompt_index) != n:
            raise ValueError(
                f"RolloutOutput fields disagree in length: response_ids {n}, finish_reasons "
                f"{len(self.finish_reasons)}, prompt_index {len(self.prompt_index)}"
            )

    @property
    def response_lengths(self) -> list[int]:
        return [len(r) for r in self.response_ids]

    @property
    def eos_flags(self) -> list[bool]:
        return [f == "stop" for f in self.finish_reasons]

    @property
    def truncated_flags(self) -> list[bool]:
        return [f == "length" for f in self.finish_reasons]


class RolloutBackend(Protocol):
    """A rollout engine (kind ``rollout_backend``); the registered object is a factory.

    ``factory(config, model_path: str, tokenizer) -> RolloutBackend`` where ``config`` is the
    whole run config (the backend reads ``rollout.*``). Instances provide:

    * ``generate(prompt_ids: list[list[int]], params: SamplingParams) -> RolloutOutput``
    * ``update_weights(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None``: load the
      actor's current weights (HF parameter names) without restarting the engine.
    * ``sleep()`` / ``wake_up()``: release compute while training runs (may be no-ops).
    * ``close()``: stop the engine and free its memory; idempotent.
    """

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> RolloutOutput: ...

    def update_weights(self, named_tensors: Any) -> None: ...

    def close(self) -> None: ...


class TrainingBackend(Protocol):
    """A training backend (kind ``training_backend``); the registered object is a factory.

    ``factory(config, model_path, *, use_critic, use_ref, total_steps) -> TrainingBackend``
    (``total_steps``: training steps of the run, for LR schedules). It owns the actor, critic
    and reference models, their optimizers and schedulers, devices and process groups. The
    methods the training loop calls are listed in :mod:`rlplug.trainer`'s docstring.
    """


class Tracker(Protocol):
    """An experiment tracker (kind ``tracker``); the registered object is a factory.

    ``factory(config) -> Tracker`` with ``log_params(dict)``, ``log_metrics(dict[str, float], step)``,
    ``log_table(name, rows: list[dict], step)``, ``log_artifact(path, artifact_path=None)``,
    ``close()``.
    """


@dataclass
class Registration:
    """One registered plugin object and where it came from (used by ``rlplug plugins``)."""

    kind: str
    name: str
    obj: Any
    plugin: str
    distribution: str
    version: str
    extra: dict = field(default_factory=dict)

