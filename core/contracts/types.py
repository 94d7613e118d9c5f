"""The objects plugins register, one type per plugin kind.

Shape letters used throughout rlplug:

* ``B`` -- responses in a batch (prompts x ``rollout.n`` samples per prompt)
* ``T`` -- padded response length (tokens)
* ``P`` -- padded prompt length (tokens)
* ``V`` -- vocabulary size

Every kind has exactly one call signature, documented here and on the
registration hook in :mod:`rlplug.contracts.hookspecs`; the trainer never special-cases
a plugin by name.  New inputs go on the batch, not into the trainer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # torch is imported lazily so reward worker processes start fast
    import torch

__all__ = [
    "AdvantageEstimator",
    "AdvantageEstimatorProtocol",
    "PolicyLoss",
    "PolicyLossProtocol",
    "MiniBatchContext",
    "KLPenalty",
    "KLPenaltyProtocol",
    "BatchFilter",
    "BatchFilterProtocol",
    "RewardFunction",
    "Coordinator",
    "SamplingParams",
    "RolloutOutput",
    "RolloutBackend",
    "TrainingBackend",
    "Tracker",
    "BATCH_FIELD_PRODUCERS",
    "PER_TOKEN_QUANTITIES",
    "TRAINING_CAPABILITIES",
    "MissingInputError",
]


class MissingInputError(ValueError):
    """An algorithm plugin was called without an input it needs.

    The message names the missing input and the configuration that provides it.
    """


# --------------------------------------------------------------------------- advantage estimators
AdvantageFn = Callable[..., "tuple[torch.Tensor, torch.Tensor]"]

#: Where each batch field an algorithm plugin may declare in ``requires`` comes from. The config
#: check (:func:`rlplug.run.validate.validate_config`) rejects a field that is not listed here (nothing
#: would produce it) and names the producer in its errors; the trainer turns producers on when a
#: selected plugin asks for their field (``values``: the critic; ``ref_log_probs``: the reference
#: model; ``reward_baselines``: a greedy baseline rollout; per-token quantities: the training
#: backend's old-log-prob pass).
BATCH_FIELD_PRODUCERS: dict[str, str] = {
    "input_ids": "the rollout (prompt + response tokens)",
    "attention_mask": "the rollout",
    "position_ids": "the rollout",
    "responses": "the rollout",
    "response_mask": "the rollout (1.0 on generated tokens)",
    "index": "the data loader (group ids: responses to one prompt share one id; rollout.n >= 2 for groups)",
    "token_level_scores": "the reward manager (reward.*)",
    "token_level_rewards": "the reward manager, minus the in-reward KL penalty (algorithm.use_kl_in_reward)",
    "reward_components": "the reward manager: the named values reward functions report in their dict",
    "old_log_probs": "the training backend's old-log-prob pass (actor log-probs before the update)",
    "entropy": "the training backend's old-log-prob pass",
    "ref_log_probs": "the reference model (turned on by actor.use_kl_loss, algorithm.use_kl_in_reward or a plugin that requires it)",
    "values": "the critic (turned on by an estimator that requires values, or critic.enable=true)",
    "reward_baselines": "a greedy baseline rollout, scored like the samples (turned on by an estimator that requires it)",
    "rollout_log_probs": "the rollout engine (set rollout.calculate_log_probs=true)",
    "rollout_is_weights": "the rollout correction, once per step from old_log_probs and rollout_log_probs "
    "(algorithm.rollout_correction.rollout_is or actor.rollout_is_threshold; rlplug.algorithms.rollout_correction)",
    "sum_pi_squared": "the training backend's old-log-prob pass (sum over the vocabulary of the squared token probabilities)",
}

#: The per-token quantities a training backend may compute in its log-prob pass besides
#: ``log_probs`` (declared in :attr:`TrainingBackend.per_token_outputs`).
PER_TOKEN_QUANTITIES: tuple[str, ...] = ("entropy", "sum_pi_squared")


@runtime_checkable
class AdvantageEstimatorProtocol(Protocol):
    """What an advantage estimator registers (kind ``advantage_estimator``).

    ``requires`` names the batch fields it needs besides ``token_level_rewards`` and
    ``response_mask`` (keys of :data:`BATCH_FIELD_PRODUCERS`); ``group_based`` estimators need
    ``rollout.n >= 2``. Calling it with ``(data, config)`` returns ``(advantages, returns)``,
    both ``(B, T) float32`` and 0.0 where ``response_mask`` is 0. :class:`AdvantageEstimator`
    implements it around a plain function.
    """

    requires: tuple[str, ...]
    group_based: bool

    def __call__(self, data: Mapping[str, torch.Tensor], config: Any) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class AdvantageEstimator:
    """An advantage estimator (kind ``advantage_estimator``).

    ``fn(data, config) -> (advantages, returns)`` where

    * ``data`` maps tensor names to the batch's tensors: always ``token_level_rewards``
      ``(B, T) float32`` and ``response_mask`` ``(B, T) float32`` (1.0 on generated tokens), plus
      every field named in ``requires`` -- for example ``values`` ``(B, T) float32`` from the
      critic, ``index`` ``(B,) int64`` group ids (responses to one prompt share one id),
      ``reward_baselines`` ``(B,) float32`` (the greedy response's score, ReMax),
      ``old_log_probs`` / ``ref_log_probs`` / ``sum_pi_squared`` ``(B, T) float32`` or
      ``reward_components`` ``(B, K) float32`` (its column names in ``data.columns["reward_components"]``,
      an :class:`rlplug.contracts.batch.Fields`). :data:`BATCH_FIELD_PRODUCERS` lists every field.
    * ``config`` is the ``algorithm`` config section (``gamma``, ``lam``,
      ``norm_adv_by_std_in_grpo``, ...), a mapping or attribute object.
    * returns ``advantages`` and ``returns``, both ``(B, T) float32`` and exactly 0.0
      where ``response_mask`` is 0.

    ``requires`` names the inputs the function needs; the trainer uses it to decide what to
    compute (``values`` trains a critic, ``reward_baselines`` generates a greedy baseline rollout,
    ``ref_log_probs`` loads the reference model) and :meth:`__call__` raises
    :class:`MissingInputError` when one is absent. A field no stage produces is a config error.
    ``group_based`` estimators need ``rollout.n >= 2`` (a config error otherwise).
    ``validate(algorithm_config)`` (or ``None``) runs at config time and raises ``ValueError``.

    Responses whose reward failed are not in ``data``: the trainer calls ``fn`` on the scored rows
    only (``B`` counts those, so a group may hold fewer than ``rollout.n`` responses, or one) and
    gives the others advantage 0 (:func:`rlplug.contracts.batch.estimate_on_rows`); when no reward
    succeeded, ``fn`` is not called that step.
    """

    fn: AdvantageFn
    requires: tuple[str, ...] = ()
    group_based: bool = False
    description: str = ""
    validate: Callable[[Any], None] | None = None

    @property
    def uses_critic(self) -> bool:
        return "values" in self.requires

    def __call__(self, data: Mapping[str, torch.Tensor], config: Any) -> tuple[torch.Tensor, torch.Tensor]:
        for key in ("token_level_rewards", "response_mask", *self.requires):
            if key not in data or data[key] is None:
                raise MissingInputError(
                    f"advantage estimator needs input '{key}' but the batch has none; "
                    f"it is provided by {BATCH_FIELD_PRODUCERS.get(key, 'the trainer')}. "
                    f"Present inputs: {sorted(k for k in data if data[k] is not None)}"
                )
        return self.fn(data, config)


# --------------------------------------------------------------------------- policy losses
@runtime_checkable
class PolicyLossProtocol(Protocol):
    """What a policy loss registers (kind ``policy_loss``); :class:`PolicyLoss` implements it.

    Called as ``loss(old_log_probs, log_probs, advantages, response_mask, config=...,
    loss_agg_mode=..., normalizer=..., max_response_length=..., rollout_is_weights=...,
    **{field: tensor for field in requires})`` and returns ``(loss, metrics)``; see
    :class:`PolicyLoss`. ``validate(actor_config)`` (or ``None``) runs at config time.
    ``minibatch_stats`` (or ``None``) computes per-token inputs from the whole mini-batch once
    before its micro-batches; see :class:`PolicyLoss`.
    """

    requires: tuple[str, ...]
    validate: Callable[[Any], None] | None
    minibatch_stats: Callable[..., Mapping[str, torch.Tensor]] | None

    def __call__(
        self,
        old_log_probs: torch.Tensor,
        log_probs: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        *,
        config: Any,
        loss_agg_mode: str,
        normalizer: float | None,
        max_response_length: int | None = None,
        rollout_is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]: ...


@dataclass(frozen=True)
class PolicyLoss:
    """A policy loss (kind ``policy_loss``).

    ``fn(old_log_probs, log_probs, advantages, response_mask, *, config, loss_agg_mode,
    normalizer, max_response_length=None, rollout_is_weights=None) -> (loss, metrics)`` where
    the first four are ``(B, T) float32`` (log-probs in nats of the sampled tokens), ``config`` is
    the ``actor`` config section (``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high``,
    ``clip_ratio_c``, ...), ``normalizer`` is the global count the aggregation divides by (valid
    tokens or sequences of the whole mini-batch, over all micro-batches and ranks),
    ``max_response_length`` (tokens) is the constant ``seq-mean-token-sum-norm`` divides by, and
    ``rollout_is_weights`` ``(B, T) float32`` or ``None`` are detached per-token importance
    weights against the rollout engine (truncated IS, ``actor.rollout_is_threshold``) that the
    loss applies to each token's loss, as verl's losses do. The result is a scalar ``loss``
    tensor plus ``metrics`` ``dict[str, float]`` with at least ``pg_clipfrac``,
    ``pg_clipfrac_lower`` and ``ppo_kl``.

    ``requires`` names extra batch fields (e.g. ``entropy``) passed to ``fn`` as keyword
    arguments of the same name. ``validate(config)`` is called once at config time and raises
    ``ValueError`` for invalid settings (e.g. ``clip_ratio_c <= 1``).

    ``minibatch_stats`` (optional) is for losses whose per-token terms depend on statistics of
    the whole mini-batch (e.g. a covariance over all its tokens, a top-k selection): called as
    ``minibatch_stats(old_log_probs, log_probs, advantages, response_mask, *, config, context)``
    ONCE per mini-batch (per epoch) with the whole mini-batch's detached ``(B_mini, T) float32``
    tensors (``log_probs``: the current actor's, from a no-grad forward before the micro-batch
    passes; with data parallelism, the global mini-batch on every rank), the ``actor`` config
    and a :class:`MiniBatchContext`, it returns ``{name: (B_mini, T) tensor}``. The update loop
    slices each tensor by rows with the micro-batches and passes it to ``fn`` as the keyword
    argument ``name``, so micro-batching cannot change what it selects. It must be deterministic
    given its inputs and ``context`` (randomness from a ``torch.Generator`` seeded from
    ``context``, never the global RNG), so a resumed run is bitwise equal. Training backends
    declare the capability ``"policy_loss_minibatch_stats"`` when they call it (the config check
    refuses a loss that has one with a backend that does not).

    ``metrics`` (optional) declares the step metric names (or ``fnmatch`` patterns) the loss adds
    beyond the update's own ``actor/*`` metrics, so ``trainer.alerts`` rules can watch them.
    """

    fn: Callable[..., tuple[torch.Tensor, dict[str, float]]]
    validate: Callable[[Any], None] | None = None
    description: str = ""
    requires: tuple[str, ...] = ()
    minibatch_stats: Callable[..., Mapping[str, torch.Tensor]] | None = None
    metrics: tuple[str, ...] = ()
    #: a loss for verl's bypass mode (``algorithm.rollout_correction.bypass_mode=true``): it computes the
    #: rollout correction itself, with the engine's log-probs as the old ones; the config check pairs
    #: such a loss with bypass mode, and bypass mode with such a loss
    bypass_mode: bool = False

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, dict[str, float]]:
        return self.fn(*args, **kwargs)


@dataclass(frozen=True)
class MiniBatchContext:
    """Where a mini-batch sits in the run, for :attr:`PolicyLoss.minibatch_stats`.

    ``seed``: ``trainer.seed``. ``optimizer_step``: the actor's optimizer steps planned before
    this mini-batch over the whole run (taken or skipped; the count of its learning-rate schedule,
    restored from checkpoints), unique per (training step, epoch, mini-batch). ``epoch``: the
    ``ppo_epochs`` pass of this update (0-based). ``mini_batch``: the mini-batch's index within the
    epoch (0-based). A loss seeds its ``torch.Generator`` from ``(seed, optimizer_step)``.
    """

    seed: int = 0
    optimizer_step: int = 0
    epoch: int = 0
    mini_batch: int = 0


# --------------------------------------------------------------------------- KL penalties
@runtime_checkable
class KLPenaltyProtocol(Protocol):
    """What a KL estimator registers (kind ``kl_penalty``); :class:`KLPenalty` implements it.

    ``penalty(log_probs, ref_log_probs) -> (B, T) float32`` (nats, not masked).
    """

    def __call__(self, log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class KLPenalty:
    """A per-token KL estimator (kind ``kl_penalty``).

    ``fn(log_probs, ref_log_probs) -> kl`` with log-probs ``(B, T) float32`` in nats (the
    sampled tokens under the actor and the reference model) and the result ``(B, T) float32``
    (nats, not masked).
    """

    fn: Callable[..., torch.Tensor]
    description: str = ""

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.fn(*args, **kwargs)


# --------------------------------------------------------------------------- batch filters
@runtime_checkable
class BatchFilterProtocol(Protocol):
    """What a batch filter registers (kind ``batch_filter``); :class:`BatchFilter` implements it.

    ``batch_filter(data, config) -> keep`` with ``keep`` a ``(B,) bool`` tensor (True: the response
    stays), the same for every response of a group (``index``): whole groups are kept or dropped,
    anything else is a ``ValueError``; see :class:`BatchFilter`. ``validate(algorithm_config)`` (or ``None``) runs at config time.
    """

    validate: Callable[[Any], None] | None

    def __call__(self, data: Mapping[str, torch.Tensor], config: Any) -> torch.Tensor: ...


@dataclass(frozen=True)
class BatchFilter:
    """A batch filter (kind ``batch_filter``): it sits between the reward and the advantages and
    may make the trainer generate more (DAPO's dynamic sampling, Yu et al. 2025).

    ``fn(data, config) -> keep`` where

    * ``data`` maps field names to the tensors of one generation batch, scored but before any
      log-prob pass: ``index`` ``(B,) int64`` (group ids), ``response_mask`` ``(B, T) float32``,
      ``token_level_scores`` ``(B, T) float32`` (the score on the last valid token),
      ``token_level_rewards`` ``(B, T) float32`` (equal to the scores: the in-reward KL comes
      later) and ``reward_components`` ``(B, K) float32`` (its column names in
      ``data.columns["reward_components"]``: ``acc``, ``correctness``, ``reward_failed`` ...).
    * ``config`` is the ``algorithm`` config section (e.g. ``config.filter_groups.metric``).
    * ``keep`` is ``(B,) bool``: the responses that stay. The trainer counts a prompt (a group)
      as kept when any of its responses is, and keeps generating batches of the next prompts
      (``algorithm.filter_groups.max_num_gen_batches`` of them at most, 0: no limit) until
      ``data.train_batch_size`` prompts are kept, then trims to exactly that many
      (:func:`rlplug.run.batch_filter.collect_rollouts`).

    It is a pure function of its inputs (no global state, deterministic), like every algorithm
    plugin. ``validate(algorithm_config)`` (or ``None``) runs at config time and raises ``ValueError``.
    """

    fn: Callable[..., torch.Tensor]
    validate: Callable[[Any], None] | None = None
    description: str = ""

    def __call__(self, data: Mapping[str, torch.Tensor], config: Any) -> torch.Tensor:
        return self.fn(data, config)


# --------------------------------------------------------------------------- reward functions
@runtime_checkable
class RewardFunction(Protocol):
    """verl's reward contract (kind ``reward_function``).

    ``fn(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None,
    **kwargs) -> float | dict``. A dict carries ``"score"`` (float) and any other values to
    log (they become ``reward_components`` on the batch). ``kwargs`` come from
    ``reward.kwargs.<name>`` in the config. Any plain function with this signature can be
    registered, so a verl custom reward works unchanged. With ``reward.num_workers > 0`` it runs
    in worker processes and must be picklable (a module-level function).

    Accuracy: a correctness function that judges answers right or wrong reports it, either with an
    ``"acc"`` key in its dict (1.0 correct, 0.0 wrong; the packaged ``gsm8k``, ``math_verify`` and
    ``reasoning_gym`` do), or, when it returns a plain 0/1 float (e.g. verl's strict gsm8k score),
    by declaring itself binary: ``fn.binary = True`` (its score is then its accuracy). Validation
    and ``rlplug eval`` then headline ``val-core/<data_source>/acc/mean@N``; for any other reward
    (a continuous score, a shaping term) they report the score as ``val-core/<data_source>/reward/mean@N``
    (verl's names; :func:`rlplug.run.metrics.validation_metrics`).

    Optional methods, looked up with ``getattr``: ``validate_kwargs(kwargs)`` (config-time check,
    raises ``ValueError``), ``prepare(kwargs) -> None`` (start-up work such as starting a judge
    server or loading a model, called once per kwargs by :meth:`rlplug.rewards.manager.RewardManager.prepare`
    at the trainer's setup, in the manager's process and with no ``reward.timeout_s``; must be
    idempotent) and ``close()`` (release what ``prepare`` or a call acquired; the manager calls it
    when it closes).
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

    ``stop``: stop strings (a tuple of non-empty ``str``; a list is turned into a tuple). A
    response ends after the first sampled token at which its decoded text (special tokens
    included) contains one of them; the stopping text is kept, like vLLM's
    ``include_stop_str_in_output=True``: the token ids are exactly the sampled ids up to and
    including the token that completed the string (never re-tokenized or trimmed, so a string
    ending inside a token keeps that whole token), and the finish reason is ``"stop"``. Empty (the
    default): only EOS stops. Raises ``ValueError`` for a bare string or an empty or non-string
    entry.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    seed: int | None = None
    logprobs: bool = False
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        stop = self.stop
        if isinstance(stop, (str, bytes)) or not isinstance(stop, Iterable):
            raise ValueError(
                f"SamplingParams.stop must be a tuple of stop strings, got {type(stop).__name__} {stop!r}; "
                f"write stop=({stop!r},) for one string."
            )
        stop = tuple(stop)
        for i, s in enumerate(stop):
            if not isinstance(s, str) or not s:
                raise ValueError(
                    f"SamplingParams.stop[{i}] is {type(s).__name__} {s!r}; every stop string must be a non-empty str."
                )
        self.stop = stop

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class RolloutOutput:
    """What every rollout backend returns for ``len(prompts) * n`` responses.

    Responses are ordered prompt-major: the ``n`` samples of prompt 0 first.

    * ``response_ids``: list of ``B`` lists of int token ids (EOS included when generated,
      no padding).
    * ``finish_reasons``: ``"stop"`` (EOS generated, or a stop string of :attr:`SamplingParams.stop`
      completed) or ``"length"`` (hit ``max_tokens``).
    * ``log_probs``: optional list of ``B`` lists of float (nats) from the engine, aligned with
      ``response_ids``; used only for the optional importance-sampling correction.
    * ``prompt_index``: ``B`` ints, the index of the prompt each response answers.
    * ``metrics``: optional numbers about the engine (``rollout/<name>``, run totals or gauges such as
      ``rollout/resent_requests`` and ``rollout/live_replicas`` of the server backends), logged with
      the step's metrics; a backend declares their names in its ``metrics`` attribute.

    Multi-turn episodes (:mod:`rlplug.orchestration.episodes`; a rollout backend leaves these ``None``): a
    response is the whole trajectory after the prompt, the engine's turns and the environment's replies.

    * ``response_masks``: ``B`` lists of 0/1 aligned with ``response_ids``: 1 on tokens the engine
      sampled, 0 on the environment's (tool results, template tokens); the batch's ``response_mask``.
    * ``prompts``: ``B`` prompt id lists, one per response, when an environment's ``reset`` rewrote the
      prompt (else the dataset's prompt of ``prompt_index`` is the response's).
    * ``step_rewards``: ``B`` lists of ``(position, reward)``: an environment's reward for a turn, at the
      position (in ``response_ids``) of that turn's last sampled token; added to the final reward there.
    * ``solutions``: ``B`` texts the reward functions score (``solution_str``): the last assistant message.
    * ``transcripts``: ``B`` lists of chat messages (the conversation, prompt included), given to the reward
      functions as ``extra_info["messages"]`` and shown in dumps and reports.

    Asynchronous training (:mod:`rlplug.run.async_pipeline`; a rollout backend leaves it ``None``):

    * ``versions``: ``B`` lists of ints aligned with ``response_ids``: the weight version (actor updates
      pushed to the engine before it sampled the token) of each token. A partial rollout, continued under
      newer weights after a push, carries two or more versions; a sample's staleness is the trainer's
      version minus the smallest of them.
    """

    response_ids: list[list[int]]
    finish_reasons: list[str]
    prompt_index: list[int]
    log_probs: list[list[float]] | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    response_masks: list[list[int]] | None = None
    prompts: list[list[int]] | None = None
    step_rewards: list[list[tuple[int, float]]] | None = None
    solutions: list[str] | None = None
    transcripts: list[list[dict]] | None = None
    versions: list[list[int]] | None = None

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if len(self.finish_reasons) != n or len(self.prompt_index) != n:
            raise ValueError(
                f"RolloutOutput fields disagree in length: response_ids {n}, finish_reasons "
                f"{len(self.finish_reasons)}, prompt_index {len(self.prompt_index)}"
            )
        for name in ("response_masks", "prompts", "step_rewards", "solutions", "transcripts", "versions"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"RolloutOutput.{name} has {len(value)} entries for {n} responses")
        if self.response_masks is not None:
            for i, (ids, mask) in enumerate(zip(self.response_ids, self.response_masks)):
                if len(ids) != len(mask):
                    raise ValueError(
                        f"RolloutOutput.response_masks[{i}] has {len(mask)} entries for {len(ids)} response ids"
                    )
        if self.versions is not None:
            for i, (ids, ver) in enumerate(zip(self.response_ids, self.versions)):
                if len(ids) != len(ver):
                    raise ValueError(f"RolloutOutput.versions[{i}] has {len(ver)} entries for {len(ids)} response ids")

    #: the optional fields with one entry per response (None, or a list aligned with ``response_ids``)
    PER_RESPONSE_OPTIONAL = (
        "log_probs",
        "response_masks",
        "prompts",
        "step_rewards",
        "solutions",
        "transcripts",
        "versions",
    )

    def take(self, responses: Sequence[int], prompt_index: Sequence[int]) -> RolloutOutput:
        """The responses ``responses`` (indices, in that order) with new ``prompt_index`` values; every
        per-response field follows; ``metrics`` are copied."""
        picked = {
            name: (None if getattr(self, name) is None else [getattr(self, name)[i] for i in responses])
            for name in self.PER_RESPONSE_OPTIONAL
        }
        return RolloutOutput(
            response_ids=[self.response_ids[i] for i in responses],
            finish_reasons=[self.finish_reasons[i] for i in responses],
            prompt_index=list(prompt_index),
            metrics=dict(self.metrics),
            **picked,
        )

    @staticmethod
    def join(parts: Sequence[RolloutOutput], prompt_index: Sequence[int], metrics: dict[str, float]) -> RolloutOutput:
        """``parts`` one after another with the given ``prompt_index`` and ``metrics``; an optional field
        is kept only when every part has it."""
        joined: dict[str, Any] = {}
        for name in RolloutOutput.PER_RESPONSE_OPTIONAL:
            values = [getattr(p, name) for p in parts]
            joined[name] = None if any(v is None for v in values) else [x for v in values for x in v]
        return RolloutOutput(
            response_ids=[r for p in parts for r in p.response_ids],
            finish_reasons=[f for p in parts for f in p.finish_reasons],
            prompt_index=list(prompt_index),
            metrics=dict(metrics),
            **joined,
        )

    @property
    def multi_turn(self) -> bool:
        """The responses are multi-turn trajectories (:attr:`response_masks` is set)."""
        return self.response_masks is not None

    @property
    def response_lengths(self) -> list[int]:
        return [len(r) for r in self.response_ids]

    @property
    def eos_flags(self) -> list[bool]:
        return [f == "stop" for f in self.finish_reasons]

    @property
    def truncated_flags(self) -> list[bool]:
        return [f == "length" for f in self.finish_reasons]


@runtime_checkable
class RolloutBackend(Protocol):
    """A rollout engine (kind ``rollout_backend``); the registered object is a factory.

    ``factory(config, model_path: str, tokenizer) -> RolloutBackend`` where ``config`` is the
    whole run config (the backend reads ``rollout.*``). Register the class itself, or a factory
    function with the class(es) it builds: ``register(name, factory, builds=MyRollout)``, so the
    methods below are checked when the plugin is selected. Instances provide:

    * ``generate(prompt_ids: list[list[int]], params: SamplingParams) -> RolloutOutput``
    * ``update_weights(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None``: load the
      actor's current weights (HF parameter names) without restarting the engine.
    * ``sleep()`` / ``wake_up()``: release compute while training runs and take it back before
      generating (no-ops for engines that hold nothing while idle).
    * ``close()``: stop the engine and free its memory; idempotent.
    """

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> RolloutOutput: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class Coordinator(Protocol):
    """How the processes of one run agree (supplied by the training backend as ``backend.coordinator``).

    A single-process backend supplies :data:`rlplug.contracts.coordinator.SINGLE_PROCESS` (``world_size`` 1,
    ``is_main`` true, ``broadcast`` returns its argument). A multi-process backend (``fsdp2`` under
    ``torchrun``) runs the trainer on every rank: rank 0 alone generates, scores, logs and writes
    checkpoint metadata, and ``broadcast(obj)`` (a collective every rank calls) returns rank 0's
    ``obj`` on every rank. With ``rollout.colocate`` every rank generates its share of the rollout
    (:mod:`rlplug.rollout.colocate`) and the shares are joined with ``all_gather``.
    """

    world_size: int
    is_main: bool

    def broadcast(self, obj: Any) -> Any: ...

    # Optional (colocated generation, ``rollout.colocate``; rlplug.rollout.colocate): ``rank`` (0-based) and
    # ``all_gather(obj) -> list`` (every rank's ``obj`` in rank order; a collective every rank calls). A coordinator
    # without them gets rank-0 generation.


@runtime_checkable
class TrainingBackend(Protocol):
    """A training backend (kind ``training_backend``); the registered object is a factory.

    ``factory(config, model_path, *, use_critic, use_ref, total_steps) -> TrainingBackend``
    (``total_steps``: training steps of the run, for LR schedules). It owns the actor, critic
    and reference models, their optimizers and schedulers, devices and process groups, and runs
    the objectives of :mod:`rlplug.algorithms.objective` (it does not define the math). Register the class
    itself, or a factory with ``builds=Class``. Members:

    * ``compute_log_probs(batch, *, which="actor"|"ref", with_entropy=False, extras=())`` ->
      ``{"log_probs": (B, T) float32, "entropy": (B, T) float32 (with_entropy), <extra>: (B, T)
      float32 for each name in extras}``; nats, 0.0 after each response's end.
    * ``compute_values(batch)`` -> ``(B, T) float32`` critic values.
    * ``update_actor(batch)`` / ``update_critic(batch)`` -> ``dict[str, float]`` (``actor/*``,
      ``critic/*`` metrics).
    * ``actor_weights()`` -> iterator of ``(hf_name, tensor)`` for the rollout engine.
    * ``save(directory)`` / ``load(directory)`` (bitwise resume), ``export_hf(directory,
      tokenizer)`` (a Hugging Face folder), ``close()``.
    * ``consecutive_bad_steps: int``: optimizer steps skipped in a row (non-finite loss/gradient).
    * ``coordinator: Coordinator``: see :class:`Coordinator`.
    * ``per_token_outputs: frozenset[str]``: the names (of :data:`PER_TOKEN_QUANTITIES`)
      ``compute_log_probs`` can return; a plugin requiring another one is a config error.
    * ``capabilities: frozenset[str]``: optional behaviours, checked at config time. Known:
      ``"reuses_on_policy_log_probs"`` (``update_actor`` accepts an on-policy batch without
      ``old_log_probs``; the trainer then skips the old-log-prob pass),
      ``"policy_loss_minibatch_stats"`` (``update_actor`` calls :attr:`PolicyLoss.minibatch_stats`
      once per mini-batch and passes its micro-batch rows to the loss), ``"scale_lr"`` (a method
      ``scale_lr(role, factor) -> float`` multiplies the ``"actor"`` or ``"critic"`` learning rate
      from the next step on, kept in its checkpoint; the ``trainer.alerts`` action ``scale_lr``),
      ``"apply_phase"`` (a method ``apply_phase(config)`` takes a whole run config's actor and critic
      settings for the following updates, keeping models and optimizer states; ``algorithm.schedule``
      and ``rollout.n_schedule``, :mod:`rlplug.run.schedule`), ``"lora"`` (``model.lora_rank > 0`` /
      ``critic.model.lora_rank > 0`` train peft adapters, :mod:`rlplug.training.lora`).
    * optional ``metrics: tuple[str, ...]``: the metric names (or :mod:`fnmatch` patterns) the
      updates log, which ``trainer.alerts`` rules may watch (:func:`rlplug.run.alerts.declared_metrics`).
    """

    consecutive_bad_steps: int
    coordinator: Coordinator
    per_token_outputs: frozenset[str]
    capabilities: frozenset[str]

    def compute_log_probs(
        self, batch: Any, *, which: str = "actor", with_entropy: bool = False, extras: tuple[str, ...] = ()
    ) -> dict[str, torch.Tensor]: ...

    def compute_values(self, batch: Any) -> torch.Tensor: ...

    def update_actor(self, batch: Any) -> dict[str, float]: ...

    def update_critic(self, batch: Any) -> dict[str, float]: ...

    def actor_weights(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    def save(self, directory: Any) -> None: ...

    def load(self, directory: Any) -> None: ...

    def export_hf(self, directory: Any, tokenizer: Any = None) -> Any: ...

    def close(self) -> None: ...


#: The capabilities a training backend may declare (see :class:`TrainingBackend`).
TRAINING_CAPABILITIES: tuple[str, ...] = (
    "reuses_on_policy_log_probs",
    "policy_loss_minibatch_stats",
    "scale_lr",
    "apply_phase",
    "lora",
)


@runtime_checkable
class Tracker(Protocol):
    """An experiment tracker (kind ``tracker``); the registered object is a factory.

    ``factory(config) -> Tracker`` (the class itself, or a factory with ``builds=Class``):

    * ``log_params(params: dict)``: the flattened run config, once.
    * ``log_metrics(metrics: dict[str, float], step: int)``: one step's metrics.
    * ``log_table(name: str, rows: list[dict], step: int)``: e.g. validation samples.
    * ``log_artifact(path, artifact_path=None)``: a file to keep with the run.
    * ``close(status="FINISHED")``: ``FINISHED``, ``KILLED`` or ``FAILED``; idempotent.
    * optional ``set_tags(tags: dict[str, str])``: run tags (the ``trainer.alerts`` warnings,
      ``rlplug.alert.<name>``); a tracker without it gets no tags.

    Names: metrics are named ``<group>/<metric>`` as verl names them (``val-core/gsm8k/acc/mean@8``).
    A tracker that rejects some characters maps names with :func:`rlplug.run.metrics.tracker_name`, the
    one mapping all trackers share (``@`` becomes ``_at_``, other rejected characters ``_``; pass the
    tracker's own ``allowed`` set), so a metric has the same name in every tracker that must change
    it; a tracker that accepts every character logs names unchanged. :func:`rlplug.run.metrics.source_tags`
    gives the rlplug version and git commit to record with the run.
    """

    def log_params(self, params: dict) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def log_table(self, name: str, rows: list[dict], step: int) -> None: ...

    def log_artifact(self, path: Any, artifact_path: str | None = None) -> None: ...

    def close(self, status: str = "FINISHED") -> None: ...


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
