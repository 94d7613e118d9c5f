"""The step pipeline: what one training step does, as a seam another pipeline can replace.

:meth:`rlplug.run.trainer.Trainer.train_step` enters the step's schedule phase, then calls
``trainer.pipeline.run(trainer, step, metrics)``: any object with that method
(:class:`StepPipeline`) may stand in, e.g. an asynchronous pipeline that overlaps generation with
training. The packaged one, :class:`SyncStepPipeline`, runs the stages one after the other, as verl's
``RayPPOTrainer.fit`` does:

1. :meth:`~SyncStepPipeline.generate`: rollouts of the step's prompts (a batch filter generates and
   scores more until enough are kept, :func:`rlplug.run.batch_filter.collect_rollouts`), the batch, scoring
   started on the reward thread;
2. :meth:`~SyncStepPipeline.prepare`: old / reference log-probs and values, the scores joined, the
   token-level rewards, advantages and returns, rollout correction;
3. :meth:`~SyncStepPipeline.update`: the critic and actor updates, then the new weights pushed to the
   rollout engine;
4. :meth:`~SyncStepPipeline.record`: the step's metrics, rollout dumps and logged generations.

The trainer object gives the pipeline what the run built (backend, reward manager, schedule, ...).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from omegaconf import DictConfig

from rlplug.algorithms.losses import apply_kl_penalty, masked_mean, value_targets
from rlplug.algorithms.rollout_correction import apply_rollout_correction, use_rollout_log_probs_as_old
from rlplug.base.exit_codes import TrainingStopped
from rlplug.contracts.batch import estimate_on_rows, padded_rows, rollout_batch, rows_left_out
from rlplug.contracts.types import RolloutOutput
from rlplug.orchestration.episodes import token_level_scores
from rlplug.rewards.manager import components_tensor, scored_rows
from rlplug.run.alerts import kl_seq_sum_metrics, lower_lr
from rlplug.run.batch_filter import collect_rollouts
from rlplug.run.dump import dump_rollouts
from rlplug.run.metrics import progress_metrics, stage, step_metrics, throughput_metrics

__all__ = ["StepPipeline", "StepState", "SyncStepPipeline", "check_bad_steps", "token_level_rewards"]


@runtime_checkable
class StepPipeline(Protocol):
    """One training step of a :class:`rlplug.run.trainer.Trainer`.

    ``run(trainer, step, metrics)`` trains global step ``step`` (1-based) and adds the step's metrics
    (verl's names, floats) to ``metrics``, which holds the schedule phase's entries already. It must leave
    the run resumable: the trainer saves a checkpoint after it returns. Exceptions propagate to
    :meth:`rlplug.run.trainer.Trainer.fit` (``TrainingStopped`` stops the run with its exit code)."""

    def run(self, trainer: Any, step: int, metrics: dict[str, float]) -> None: ...


@dataclass
class StepState:
    """What one step carries from stage to stage of :class:`SyncStepPipeline`.

    ``rows``: the step's dataset rows (one per prompt); ``prompt_ids``: their token ids; ``out``: the
    rollout (:class:`rlplug.contracts.types.RolloutOutput`, responses in prompt order); ``batch``: the training
    batch (:class:`rlplug.contracts.batch.Batch`, ``(B, T)`` tensors); ``scoring``: the reward future until joined;
    ``scores`` / ``extra``: per-response scores and reward components; ``scored``: ``(B,) bool``, the
    responses whose reward succeeded; ``t_start``: ``time.perf_counter()`` at the step's start."""

    step: int
    epoch: int
    rows: list[dict]
    prompt_ids: list[list[int]]
    out: RolloutOutput
    batch: Any
    scoring: Any
    t_start: float
    scores: list[float] = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    scored: torch.Tensor | None = None


class SyncStepPipeline:
    """The synchronous step: generate -> score -> prepare -> update -> push weights (module docstring)."""

    def run(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        state = self.generate(trainer, step, metrics)
        self.prepare(trainer, state, metrics)
        self.update(trainer, state, metrics)
        self.record(trainer, state, metrics)

    def generate(self, trainer: Any, step: int, metrics: dict[str, float]) -> StepState:
        """Rollouts, the batch, and the scoring started (it overlaps the log-prob passes of :meth:`prepare`)."""
        t_start = time.perf_counter()
        # a batch filter (algorithm.batch_filter) generates and scores more prompts until enough are kept
        rows, epoch, prompt_ids, out, scoring = self.rollouts(trainer, step, metrics)
        batch = rollout_batch(prompt_ids, out, trainer.pad_id)  # multi-turn: environment tokens masked
        if trainer.plan.baseline:
            with stage(metrics, "gen_baseline", fault=None):
                batch["reward_baselines"] = trainer._baseline_scores(rows, prompt_ids, out)
        scoring = scoring or trainer._start_scoring(rows, out)  # joined before the advantages
        if out.log_probs is not None:
            batch["rollout_log_probs"] = padded_rows(out.log_probs, batch["response_mask"].shape[1])
        return StepState(step, epoch, rows, prompt_ids, out, batch, scoring, t_start)

    def rollouts(self, trainer: Any, step: int, metrics: dict[str, float]) -> tuple[Any, ...]:
        """``(rows, epoch, prompt_ids, out, scoring)`` of the step: :func:`rlplug.run.batch_filter.collect_rollouts`
        over the data loader, generating now (the asynchronous pipeline takes them from its producer)."""
        return collect_rollouts(trainer, step, metrics)

    def attach(self, trainer: Any) -> None:
        """Called once when the trainer is built (its engine and weight transfer exist): nothing to do here."""

    def checkpointed(self, trainer: Any) -> dict[str, Any]:
        """Objects whose state joins (or replaces, by name) the trainer's in every checkpoint: none here."""
        return {}

    def close(self) -> None:
        """Stop what the pipeline runs beside the trainer: nothing here."""

    def prepare(self, trainer: Any, state: StepState, metrics: dict[str, float]) -> None:
        """Old / reference log-probs and values; the scores; token-level rewards, advantages, returns."""
        cfg, batch = trainer.cfg, state.batch
        if not trainer.skip_old_log_prob:
            with stage(metrics, "old_log_prob"):
                self.old_log_probs(trainer, batch, metrics)
        use_rollout_log_probs_as_old(batch, cfg)  # bypass mode only: the engine's log-probs are the old ones
        if trainer.use_ref:
            with stage(metrics, "ref"):
                batch["ref_log_probs"] = trainer.backend.compute_log_probs(batch, which="ref")["log_probs"]
        if trainer.use_critic:
            with stage(metrics, "values"):
                batch["values"] = trainer.backend.compute_values(batch) * batch["response_mask"]
        with stage(metrics, "reward_wait", fault="reward"):
            scores, extra, reward_metrics = trainer._finish_scoring(state.scoring, metrics)
        metrics.update(reward_metrics)
        scored = scored_rows(extra, len(scores), batch.get("reward_baselines"))  # failed: left out of training
        seq_scores = trainer.score_norm(torch.tensor(scores, dtype=torch.float32), scored, batch, metrics)
        # the score on each response's last model token; a multi-turn environment's step rewards at their turns
        batch["token_level_scores"] = token_level_scores(seq_scores * scored, batch["response_mask"], state.out, scored)
        batch.set_columns("reward_components", *components_tensor(extra, len(scores)))
        with stage(metrics, "adv"):
            token_level_rewards(batch, metrics, trainer.kl_in_reward, trainer.kl_ctrl, scored)
            metrics.update(kl_seq_sum_metrics(batch))  # the KL guard (with a reference model)
            batch["advantages"], batch["returns"] = estimate_on_rows(trainer.estimator, batch, cfg.algorithm, scored)
            value_targets(batch, cfg)  # critic.value_target=mc_return: the critic regresses on the MC return
            # IS weights and rejection, once per step, after the estimator: a rejected last token keeps its score
            metrics.update(apply_rollout_correction(batch, cfg))
        state.scores, state.extra, state.scored = scores, extra, scored

    def old_log_probs(self, trainer: Any, batch: Any, metrics: dict[str, float]) -> None:
        """``old_log_probs`` (and the per-token quantities the plugins require) from the actor."""
        res = trainer.backend.compute_log_probs(batch, which="actor", with_entropy=True, extras=trainer.plan.per_token)
        batch["old_log_probs"] = res["log_probs"]
        for name in trainer.plan.per_token:
            batch[name] = res[name]
        if "entropy" in res:
            metrics["actor/entropy_rollout"] = masked_mean(res["entropy"], batch["response_mask"]).item()

    def update(self, trainer: Any, state: StepState, metrics: dict[str, float]) -> None:
        """The critic, then (after the phase's critic warm-up) the actor; the new weights to the engine."""
        cfg, batch, step, scored = trainer.cfg, state.batch, state.step, state.scored
        assert scored is not None, "prepare() runs before update()"
        first_error = first_reward_error(trainer)  # a collective, called only when the guard needs the message
        update = trainer.reward_guard.allows_update(scored, step, first_error, trainer.ckpt.root)
        with rows_left_out(batch, ~scored):
            if trainer.use_critic and update:
                with stage(metrics, "update_critic"):
                    metrics.update(trainer.backend.update_critic(batch))
            if step > trainer.schedule.phase_start + cfg.trainer.critic_warmup and update:  # counted in the phase
                with stage(metrics, "update_actor"):
                    metrics.update(trainer.backend.update_actor(batch))
                check_bad_steps(
                    trainer.backend.consecutive_bad_steps, cfg.trainer, trainer.ckpt.root, trainer.schedule.run_cfg
                )
                with stage(metrics, "update_weights"):
                    trainer._push_weights()

    def record(self, trainer: Any, state: StepState, metrics: dict[str, float]) -> None:
        """The step's metrics (rewards, lengths, progress, throughput), rollout dumps, logged generations."""
        cfg, batch, out, step = trainer.cfg, state.batch, state.out, state.step
        metrics.update(
            step_metrics(
                batch,
                scores=state.scores,
                components=state.extra,
                rollout=out,
                prompt_ids=state.prompt_ids,
                use_critic=trainer.use_critic,
                scored=state.scored,
            )
        )
        kl_on = trainer.kl_in_reward is not None or cfg.algorithm.kl_ctrl.type == "adaptive"
        metrics.update(progress_metrics(step, state.epoch, kl_coef=trainer.kl_ctrl.value if kl_on else None))
        step_time = time.perf_counter() - state.t_start
        metrics.update(throughput_metrics(batch, step_time=step_time, gen_time=metrics["timing_s/gen"]))
        dump_rollouts(trainer, step, state.rows, state.prompt_ids, out, batch, state.scores)  # rlplug.run.dump
        trainer.trackers.log_train_generations(
            step, cfg.trainer, state.rows, out, state.scores, batch, trainer.tokenizer
        )


def first_reward_error(trainer: Any) -> Callable[[], str | None]:
    """The reward guard's ``first_error()``: the first reward failure's message, the same on every process (rank 0's,
    broadcast; colocated, where every rank scored its share, the lowest rank's that has one, all-gathered)."""
    coordinator, reward = trainer.coordinator, trainer.reward
    if getattr(trainer, "colocated", False):
        return lambda: next((e for e in coordinator.all_gather(reward.last_error) if e), None)
    return functools.partial(coordinator.broadcast, reward.last_error)


def check_bad_steps(bad: int, trainer_cfg: DictConfig, checkpoint_root: Path, cfg: DictConfig | None = None) -> None:
    """Raise :class:`TrainingStopped` when ``bad`` (the backend's ``consecutive_bad_steps``) reached
    ``trainer.max_consecutive_bad_steps``; its message suggests the override that halves the learning rate of
    ``cfg`` (the run config, :func:`rlplug.run.alerts.lower_lr`), which a resume applies."""
    limit = trainer_cfg.max_consecutive_bad_steps
    if bad >= limit:
        raise TrainingStopped(
            f"{bad} consecutive optimizer steps had a non-finite loss or gradient (limit "
            f"trainer.max_consecutive_bad_steps={limit}); stopping. The last good "
            f"checkpoint is intact under {checkpoint_root}. Lower the learning rate, e.g. add {lower_lr(cfg)} (or a "
            "lower critic.optim.lr) to the command and rerun it: it resumes from that checkpoint with the new rate "
            "and lists every setting changed since. Or check the data/reward."
        )


def token_level_rewards(
    batch: Any, metrics: dict[str, float], kl_penalty: Callable | None, kl_ctrl: Any, scored: torch.Tensor
) -> None:
    """Set ``batch["token_level_rewards"]`` ``(B, T) float32``: the ``token_level_scores``, minus the
    in-reward KL penalty ``kl_ctrl.value * kl_penalty(old_log_probs, ref_log_probs)`` when
    ``kl_penalty`` is given (``algorithm.use_kl_in_reward``; verl's ``apply_kl_penalty``), whose
    metrics go to ``metrics`` and whose mean KL updates the controller ``kl_ctrl``. Only the
    ``scored`` rows (``(B,) bool``, the responses whose reward succeeded) count; with none, the
    penalty and the controller are left alone (the step does not update)."""
    if kl_penalty is None or not bool(scored.any()):
        batch["token_level_rewards"] = batch["token_level_scores"]
        return
    mask = batch["response_mask"] * scored.to(batch["response_mask"].dtype).unsqueeze(-1)
    rewards, kl_metrics = apply_kl_penalty(
        batch["token_level_scores"], batch["old_log_probs"], batch["ref_log_probs"], mask, kl_ctrl.value, kl_penalty
    )
    batch["token_level_rewards"] = rewards
    metrics.update(kl_metrics)
    kl_ctrl.update(kl_metrics["actor/reward_kl_penalty"], n_steps=int(scored.sum()))
