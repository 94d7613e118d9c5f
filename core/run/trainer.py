"""The training loop.

One loop runs every algorithm preset; the plugins decide the math::

    rollout [-> greedy baseline rollout] -> [reward scoring on a thread, overlapping:] old log-probs
            -> ref log-probs -> values -> in-reward KL -> rollout correction -> advantages
            -> critic update -> actor update (after critic_warmup) -> push weights to rollout
            -> validation (every trainer.test_freq) -> checkpoint (every trainer.save_freq)

A batch filter (kind ``batch_filter``, :mod:`rlplug.run.batch_filter`) changes only the first part: each
generation batch is scored before the next, and prompts are generated until the filter keeps
``data.train_batch_size`` of them (DAPO's dynamic sampling); the passes then run on the kept batch.

Which of these stages run follows from the config and from what the selected plugins require
(:func:`rlplug.run.validate.plan_batch`); the trainer never special-cases a plugin by name. Under a
schedule (``algorithm.schedule`` phases, ``rollout.n_schedule``) that config is the step's own:
:meth:`rlplug.run.schedule.Schedule.enter` swaps it in at the start of each step. It talks
to a training backend (kind ``training_backend``, :class:`rlplug.contracts.types.TrainingBackend`: log-prob
and value passes, the updates, weights, checkpoints, ``coordinator`` for multi-process runs) and
a rollout backend (kind ``rollout_backend``, :class:`rlplug.contracts.types.RolloutBackend`). Pieces that
are not the loop live elsewhere: data preparation in :mod:`rlplug.data.dataset` /
:mod:`rlplug.data.prepare`, the checkpoint layout and RNG capture in :mod:`rlplug.run.checkpoint`,
the scoring thread in :class:`rlplug.rewards.manager.RewardManager`, step metrics in :mod:`rlplug.run.metrics`.

Metric names follow verl (``actor/pg_loss``, ``critic/score/mean``, ``timing_s/gen`` ...).
Every step is deterministic given the seed and the checkpointed state (data position, RNG
states, optimizer, KL controller), so a resumed run reproduces an uninterrupted one.

Fault points (``_fault_point("<label>")``, reached mostly through :func:`rlplug.run.metrics.stage`)
mark where the crash tests stop the process: a testing aid that does nothing unless
``RLPLUG_TEST_KILL_AT`` is set (see :func:`rlplug.run.checkpoint._fault_point`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from rlplug.algorithms.kl_control import make_kl_controller
from rlplug.algorithms.reward_norm import ScoreNormalizer
from rlplug.base.exit_codes import ExitCode, TrainingStopped
from rlplug.base.run_context import RunContext, takes_run_context
from rlplug.config.run_paths import run_dir_for
from rlplug.contracts.registry import Registry, get_registry
from rlplug.contracts.reward_contract import attach_trainer, trl_inputs
from rlplug.contracts.types import RolloutOutput, SamplingParams
from rlplug.contracts.weights import DirectWeightTransfer, WeightTransfer
from rlplug.data.dataset import make_train_loader, read_run_datasets
from rlplug.data.prepare import DATA_FORMAT_VERSION, prepared_data_files  # noqa: F401 - their old home
from rlplug.orchestration.episodes import episode_engine_for_run, rows_for_scoring, solution_texts
from rlplug.rewards.manager import RewardFailureGuard, RewardManager, scored_rows, validation_reward
from rlplug.rollout.utils import sampling_params  # also rlplug.run.trainer.sampling_params, its old home
from rlplug.run import evaluate  # evaluate.score_responses: looked up at call time (tests patch it)
from rlplug.run.alerts import AlertEngine
from rlplug.run.async_pipeline import pipeline_for
from rlplug.run.checkpoint import (  # noqa: F401
    CheckpointManager,
    _fault_point,
    config_changes,
    describe_change,
    experiment_name_for,
    load_checkpoint,
    open_run_dir,
    resume_checkpoint,
    rng_state,
    save_checkpoint,
    seed_everything,
    set_rng_state,
)
from rlplug.run.colocated import (
    colocated_rollout,
    colocated_scoring,
    join_rank_scores,
    start_engines,
    validation_rollouts,
)
from rlplug.run.export import finish_export
from rlplug.run.metrics import (
    Trackers,
    host_memory_metrics,
    stage,
    validation_metrics,
    validation_samples,
)
from rlplug.run.report import log_validation_samples
from rlplug.run.resume import apply_resume_changes, check_resume_lr
from rlplug.run.schedule import Schedule, value_targets  # noqa: F401 - value_targets: its old home
from rlplug.run.step_pipeline import (  # noqa: F401 - check_bad_steps, token_level_rewards: their old home
    StepPipeline,
    SyncStepPipeline,
    check_bad_steps,
    token_level_rewards,
)
from rlplug.run.validate import plan_batch, skips_old_log_probs
from rlplug.training.models import load_tokenizer, resolve_model_path

log = logging.getLogger("rlplug")


# ============================================================================ helpers


def set_threads(n: int | None, cpus: list[int] | None = None) -> None:
    """Use ``n`` torch threads (None: one per core of ``cpus`` when given, i.e. ``trainer.trainer_cpus``, else
    one per core); thread counts are set explicitly (MACHINE_NOTES)."""
    n = n or (len(cpus) if cpus else None) or os.cpu_count() or 1
    torch.set_num_threads(n)
    os.environ.setdefault("OMP_NUM_THREADS", str(n))


def checkpointed_state(trainer: Trainer) -> dict[str, Any]:
    """The objects whose ``state_dict`` goes into ``trainer_state.json`` of every checkpoint, by name:
    the data loader, the KL controller, the reward-failure guard and the score normaliser
    (``reward.normalize``, :class:`rlplug.algorithms.reward_norm.ScoreNormalizer`), the alert rules' counts and
    scales (``trainer.alerts``, :class:`rlplug.run.alerts.AlertEngine`) and, with a schedule, its phase
    (:class:`rlplug.run.schedule.Schedule`; without one the checkpoint is what it was before schedules)."""
    return {
        "data_loader": trainer.loader,
        "kl_ctrl": trainer.kl_ctrl,
        "reward_guard": trainer.reward_guard,
        "score_norm": trainer.score_norm,
        "alerts": trainer.alerts,
        **({"schedule": trainer.schedule} if trainer.schedule.active else {}),
        # async modes: the loader position after what is trained, and the queued rollouts
        **getattr(trainer.pipeline, "checkpointed", lambda t: {})(trainer),
    }


def on_main_then_broadcast(method: Callable) -> Callable:
    """Multi-process runs (``coordinator.world_size > 1``): run ``method`` on the main process only
    and return its result on every process, so all train on the same rollouts and rewards."""

    @functools.wraps(method)
    def wrapper(self: Trainer, *args: Any, **kwargs: Any) -> Any:
        if self.coordinator.world_size == 1:
            return method(self, *args, **kwargs)
        return self.coordinator.broadcast(method(self, *args, **kwargs) if self.is_main else None)

    return wrapper


@contextlib.contextmanager
def signals_handled(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """SIGTERM and SIGINT go to ``handler`` inside the block (main thread only); the previous
    handlers come back afterwards."""
    old = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            old[sig] = signal.signal(sig, handler)
        except ValueError:  # not in the main thread
            pass
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def stopped_message(step: int, root: Any) -> str:
    """What a run stopped by a signal prints (its checkpoint is saved)."""
    return (
        f"Stopped after step {step} (a signal); checkpoint saved in {root}. "
        f"Resume with the same command (trainer.resume_mode=auto). Exit code {int(ExitCode.STOPPED_BY_SIGNAL)}."
    )


# ============================================================================ trainer

#: seconds within which a repeated stop signal counts as the same one (see Trainer._handle_signal)
_SIGNAL_REPEAT_S = 0.1


class Trainer:
    """Owns the run: data, reward, backends, trackers, checkpoints; :meth:`fit` trains."""

    def __init__(self, cfg: DictConfig, registry: Registry | None = None) -> None:

        self.cfg, self.registry = cfg, registry or get_registry()  # cfg: this step's (rlplug.run.schedule)
        #: what one training step does (rlplug.run.step_pipeline; trainer.async_mode: rlplug.run.async_pipeline)
        self.pipeline: StepPipeline = pipeline_for(cfg)
        #: how the actor's weights reach the engine (rlplug.contracts.weights); another transfer may replace it
        self.weight_transfer: WeightTransfer = DirectWeightTransfer()
        self.run_dir = run_dir_for(cfg)  # another run's checkpoints there are refused now, before any model loads
        self.ckpt, self.start = open_run_dir(cfg, self.run_dir)
        set_threads(cfg.trainer.num_threads, cfg.trainer.get("trainer_cpus"))
        seed_everything(cfg.trainer.seed)

        # ---- everything that can fail cheaply comes before any model loads
        self.plan = plan_batch(cfg, self.registry)  # which stages run, from the plugins' requires
        self.estimator = self.registry.get("advantage_estimator", cfg.algorithm.adv_estimator)
        self.kl_in_reward = (
            self.registry.get("kl_penalty", cfg.algorithm.kl_penalty) if cfg.algorithm.use_kl_in_reward else None
        )
        self.reward = RewardManager(cfg.reward, registry=self.registry)
        self.val_reward = validation_reward(self.reward, cfg.reward)  # the rule reward unless reward.val_reward_model
        attach_trainer(self)  # TRL-contract reward functions get trainer_state
        self.model_path = resolve_model_path(cfg.model)
        self.tokenizer = load_tokenizer(self.model_path, trust_remote_code=bool(cfg.model.trust_remote_code))
        self.train_ds, self.val_ds = read_run_datasets(cfg, self.tokenizer, self.reward.check_data_sources)
        #: multi-turn episodes (None: one response per prompt), built now: a template or a row's agent_name they
        #: cannot use is refused before any model loads
        gen = lambda ids, p: self.rollout.generate(ids, p)  # noqa: E731 - the engine is built below
        self.episodes = episode_engine_for_run(cfg, self.registry, self.tokenizer, gen, self.train_ds, self.val_ds)
        self.loader = make_train_loader(cfg, self.train_ds)  # data.train_weights: a weighted mix of the files
        self.total_steps = int(
            cfg.trainer.total_training_steps or self.loader.steps_per_epoch * cfg.trainer.total_epochs
        )
        self.schedule = Schedule(cfg, self.registry, self.total_steps, self.plan)  # algorithm.schedule: checked now
        self.plan = self.schedule.plan  # what any phase needs is built (one phase without a schedule)
        self.use_critic, self.use_ref, self.needs_baseline = self.plan.use_critic, self.plan.use_ref, self.plan.baseline
        self.kl_ctrl = make_kl_controller(cfg.algorithm.kl_ctrl)
        self.reward_guard = RewardFailureGuard(cfg.trainer.max_consecutive_bad_steps)
        self.alerts = AlertEngine.from_config(cfg, self.plan, self.registry)  # trainer.alerts, checked names
        self.score_norm = ScoreNormalizer(cfg.reward.normalize)  # reward.normalize (off: scores unchanged)

        self.resume_changes: list[tuple[str, Any, Any]] = []  # settings changed since the checkpoint (_resume)
        check_resume_lr(self, cfg)  # a changed learning rate the backend cannot apply: refused before models load

        # ---- models and engines
        backend_factory = self.registry.get("training_backend", cfg.trainer.backend)
        self.run_context = RunContext(self.run_dir, self.start.resume_step)  # what the backend is told
        run = {"run": self.run_context} if takes_run_context(backend_factory) else {}  # rlplug.base.run_context
        self.backend = backend_factory(
            cfg, self.model_path, use_critic=self.use_critic, use_ref=self.use_ref, total_steps=self.total_steps, **run
        )
        self.skip_old_log_prob = skips_old_log_probs(cfg, self.plan, self.backend.capabilities)
        # A multi-process backend (trainer=fsdp2 under torchrun) runs this trainer on every process; the main one
        # logs, writes checkpoint metadata and (rank-0 generation) owns the engine (rlplug.run.colocated)
        self.coordinator = self.backend.coordinator
        self.distributed, self.is_main = self.coordinator.world_size > 1, bool(self.coordinator.is_main)
        self.rollout: Any = None
        try:  # rollout.colocate: an engine on every rank; rewards prepared where they score
            self.colocated, self.rollout = start_engines(self)
        except BaseException:
            self.close()  # the backend (and a process group) is already up: do not leak it
            raise
        self.pad_id = (
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        )
        self.global_step = 0
        self.trackers = Trackers()
        self._stop_signal: int | None = None
        self._stop_signal_at = float("-inf")  # time.monotonic() of the first stop signal
        self._last_val_samples: list[dict] = []
        getattr(self.pipeline, "attach", lambda trainer: None)(self)  # async: the engine behind a gate, the producer
        # Seed again now that everything is built: first-time imports and model loading above may
        # draw from the global RNGs (e.g. Python's ``random`` changed during the first Trainer of a
        # process only), so without this the same seed could give different runs in one process.
        seed_everything(cfg.trainer.seed)

    # ------------------------------------------------------------------ state
    def _stateful(self) -> dict[str, Any]:
        return checkpointed_state(self)

    def _resume(self) -> None:
        path = self.start.begin(coordinator=self.coordinator)  # overwrite=true moves the old run aside; rank 0's pick
        if path is None:
            return
        configured = OmegaConf.to_container(self.schedule.run_cfg, resolve=True)  # before the state may scale any
        self.global_step = load_checkpoint(path, backend=self.backend, stateful=self._stateful())
        log.info("Resumed from %s at step %d", path, self.global_step)
        print(f"Resumed from {path} (step {self.global_step}).", flush=True)
        apply_resume_changes(self, path, configured)
        self._push_weights()
        _fault_point("resumed")

    def _push_weights(self) -> None:
        self.weight_transfer.push(self.backend, self.rollout)  # rlplug.contracts.weights

    def save_checkpoint(self) -> Path:
        path = save_checkpoint(
            self.ckpt,
            self.global_step,
            backend=self.backend,
            coordinator=self.coordinator,
            stateful=self._stateful(),
            tokenizer=self.tokenizer,
            model_path=self.model_path,
            config=self.schedule.run_cfg,  # the run's config (and fingerprint), not the phase's
        )
        if self.is_main:
            self.registry.hook.on_checkpoint_saved(step=self.global_step, path=str(path))
        return path

    # ------------------------------------------------------------------ generation and scoring
    def sampling_params(self, validation: bool = False, step: int = 0) -> SamplingParams:
        return sampling_params(self.cfg, validation=validation, step=step)

    @on_main_then_broadcast
    def _generate(
        self, prompt_ids: list[list[int]], params: SamplingParams, label: str = "rollout", rows: list | None = None
    ) -> RolloutOutput:
        """The engine's responses to ``prompt_ids`` (woken for the call); given their dataset ``rows`` with
        ``rollout.multi_turn.enable``, the rows' multi-turn episodes (:class:`rlplug.orchestration.episodes.EpisodeEngine`)."""
        self.rollout.wake_up()
        try:
            _fault_point(label)
            if rows is not None and self.episodes is not None:
                return self.episodes.generate(rows, params, step=self.global_step + 1)
            return self.rollout.generate(prompt_ids, params)
        finally:
            self.rollout.sleep()

    def _rollout(self, rows: list[dict], params: SamplingParams, label: str = "rollout", main: bool = False) -> Any:
        """:meth:`_generate` for dataset ``rows`` (``main``: already on the main process alone, not broadcast); with
        :attr:`colocated`, every rank generates its share (:func:`colocated_rollout`), a collective."""
        if self.colocated and not main:
            return colocated_rollout(self, rows, params, label)
        generate = Trainer._generate.__wrapped__ if main else Trainer._generate  # type: ignore[attr-defined]
        return generate(self, [r["prompt_ids"] for r in rows], params, label, rows)

    def _decode(self, out: RolloutOutput) -> list[str]:
        """The texts the reward scores: each response's text, or a trajectory's last assistant message."""
        return solution_texts(out, self.tokenizer)

    @on_main_then_broadcast
    def _score(self, rows: list[dict], out: RolloutOutput) -> tuple[list[float], dict, dict]:
        return self.reward.score(rows_for_scoring(rows, out), self._decode(out), **trl_inputs(self, out))

    def _baseline_scores(self, rows: list[dict], prompt_ids: list[list[int]], out: RolloutOutput) -> torch.Tensor:
        """``(B,) float32``: the return of a greedy response to each response's prompt (ReMax's baseline): its score
        plus, for a multi-turn episode, its environment's step rewards, as the sampled returns have them; NaN where
        that score failed, which leaves the responses to that prompt out of training."""
        params = SamplingParams(n=1, temperature=0.0, max_tokens=self.cfg.data.max_response_length)
        greedy = self._rollout(rows, params, label="rollout_baseline")
        base, extra, _ = self._score(rows, greedy)
        env = [sum(r for _, r in steps) for steps in greedy.step_rewards or [[]] * len(base)]
        ok = scored_rows(extra, len(base)).tolist()
        return torch.tensor([base[i] + env[i] if ok[i] else math.nan for i in out.prompt_index], dtype=torch.float32)

    def _start_scoring(self, rows: list[dict], out: RolloutOutput) -> Any:
        """Decode and score ``out`` on the reward manager's thread (main process only; on the main
        thread with ``reward.overlap=false``); returns the future, joined by :meth:`_finish_scoring`. Colocated:
        every rank scores a share of whole groups (:func:`colocated_scoring`)."""
        if self.colocated:
            return colocated_scoring(self, rows, out)
        if not self.is_main:
            return None
        rows_out, overlap = rows_for_scoring(rows, out), bool(self.cfg.reward.overlap)
        return self.reward.score_async(
            rows_out, lambda: self._decode(out), overlap=overlap, lengths=out.response_lengths, **trl_inputs(self, out)
        )

    def _finish_scoring(self, future: Any, metrics: dict[str, float]) -> tuple[list[float], dict, dict]:
        """The scores of :meth:`_start_scoring` on every process; ``timing_s/reward`` is the scoring time
        itself (the part the passes did not cover shows in ``timing_s/reward_wait``)."""
        if self.colocated and (future is None or getattr(future, "rank_share", False)):  # each rank's share, joined
            return join_rank_scores(self, future, metrics)  # (a batch filter's future holds the whole batch's scores)
        result = None
        if future is not None:
            result, metrics["timing_s/reward"] = future.result()
        return self.coordinator.broadcast(result)  # in the main thread: collectives must not interleave

    # ------------------------------------------------------------------ one step
    def train_step(self) -> dict[str, float]:
        """One training step: the schedule's phase, then :attr:`pipeline` (generate -> score -> prepare ->
        update -> push weights, :class:`rlplug.run.step_pipeline.StepPipeline`); returns the step's metrics."""
        metrics = self.schedule.enter(self, self.global_step + 1)  # the step's phase and rollout.n: training/phase
        step = self.global_step + 1
        _fault_point("step_start")
        self.pipeline.run(self, step, metrics)
        self.global_step = step
        return metrics

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        """Generate for the validation prompts (``rollout.val_kwargs``) and score them, as ``rlplug eval`` does
        (:func:`rlplug.run.evaluate.score_responses`); the metrics are :func:`rlplug.run.metrics.validation_metrics`'
        (``val-core/<data_source>/acc/mean@N``, or ``.../reward/mean@N`` without an accuracy); keeps samples."""
        if self.val_ds is None or len(self.val_ds) == 0:
            return {}
        rows = [self.val_ds[i] for i in range(len(self.val_ds))][: self.cfg.data.val_max_samples or None]
        params = self.sampling_params(validation=True)
        # colocated: every rank generates its share of each batch first, rank 0 scores (rlplug.run.colocated)
        scored = self._validation_scores(rows, params, validation_rollouts(self, rows, params))
        self._last_val_samples = validation_samples(scored[: self.cfg.trainer.val_samples_to_log])
        return validation_metrics(scored, n=params.n)

    @on_main_then_broadcast
    def _validation_scores(self, rows: list[dict], params: SamplingParams, made: Callable | None = None) -> list[Any]:
        """Generate and score the validation rows on the main process (the one that owns the engine and
        has prepared the rewards: a judge's server starts there only); every process gets the result.
        ``made``: the batches' rollouts in order, generated already (colocated: by every rank)."""
        generate = made or functools.partial(self._rollout, params=params, label="validation", main=True)
        return evaluate.score_responses(
            rows, generate, self._decode, self.val_reward, batch_size=self.cfg.data.val_batch_size
        )

    # ------------------------------------------------------------------ main loop
    def _handle_signal(self, signum: int, frame: Any) -> None:
        """First SIGINT/SIGTERM: finish the step, save, stop. A second one stops at once, unless it is the
        same signal within ``_SIGNAL_REPEAT_S`` (0.1 s) of the first: GNU ``timeout`` (and launchers that
        signal both the process and its group) deliver one SIGTERM twice, microseconds apart, which is
        one request, not two."""
        now = time.monotonic()
        if self._stop_signal is not None:
            if signum == self._stop_signal and now - self._stop_signal_at < _SIGNAL_REPEAT_S:
                return  # the same request delivered twice
            raise KeyboardInterrupt  # second signal: stop now
        self._stop_signal, self._stop_signal_at = signum, now
        print(
            f"\nReceived {signal.Signals(signum).name}: finishing the current step, then saving a checkpoint "
            "(send it again to stop at once).",
            flush=True,
        )

    def fit(self) -> str:
        """Train until ``total_steps``; returns ``"finished"`` or ``"interrupted"``."""
        cfg = self.cfg
        self._resume()
        self.trackers.open(
            cfg, self.registry, model_path=self.model_path, is_main=self.is_main, step=self.global_step
        )  # step: metrics.jsonl keeps the lines up to the resumed step
        if self.resume_changes:  # what this resume changed, once per resumed step (tracker params are immutable)
            self.trackers.log_params(
                {f"resume.step_{self.global_step}.{k}": describe_change(o, n) for k, o, n in self.resume_changes}
            )
        status = "failed"
        t_start = time.time()
        try:
            with signals_handled(self._handle_signal):
                self.registry.hook.on_train_start(config=cfg, run_dir=str(self.run_dir))
                if cfg.trainer.val_before_train and self.global_step == 0:
                    self._run_validation()
                bar = self.trackers.progress(self.total_steps, self.global_step)  # drawn in a terminal only
                while self.global_step < self.total_steps:
                    metrics = self.train_step()
                    step = self.global_step
                    limit = cfg.trainer.max_wall_time_s
                    out_of_time = limit is not None and time.time() - t_start > limit
                    # every process must stop (and save) at the same step: the main one decides
                    self._stop_signal, out_of_time = self.coordinator.broadcast((self._stop_signal, out_of_time))
                    # the time budget is part of the experiment: reaching it ends the run like its last step
                    # (validation, checkpoint, final model)
                    last = step >= self.total_steps or out_of_time
                    if out_of_time and step < self.total_steps:
                        print(
                            f"Reached trainer.max_wall_time_s={limit} after step {step}: validating, saving and exporting.",
                            flush=True,
                        )
                    if cfg.trainer.test_freq > 0 and (step % cfg.trainer.test_freq == 0 or last):
                        with stage(metrics, "testing", fault=None):
                            metrics.update(self._run_validation(log_now=False))
                    metrics.update(self._host_memory())
                    metrics.update(self.alerts.observe(step, metrics, self))  # trainer.alerts: alerts/<name>
                    self.trackers.log_metrics(metrics, step)
                    self.registry.hook.on_step_end(step=step, metrics=metrics)
                    _fault_point("step_end")
                    bar.update(step, metrics)
                    self.alerts.stop_if_fired(self)  # a stop rule fired: save this step, raise AlertStopped
                    if (cfg.trainer.save_freq > 0 and step % cfg.trainer.save_freq == 0) or last or self._stop_signal:
                        with stage(metrics, "save_checkpoint", fault=None):
                            self.save_checkpoint()
                    if self._stop_signal is not None and not last:  # a stop in the last step just finishes
                        status = "interrupted"
                        print(stopped_message(step, self.ckpt.root), flush=True)
                        break
                    if out_of_time:
                        status = "finished"
                        break
                else:
                    status = "finished"
                bar.close()
                if status == "finished":
                    self._finish()
            return status
        finally:
            self.registry.hook.on_train_end(step=self.global_step, status=status)
            self.trackers.close(status)

    def _host_memory(self) -> dict[str, float]:
        """:func:`rlplug.run.metrics.host_memory_metrics` after a step (and its validation)."""
        return host_memory_metrics(self.cfg.trainer, self.rollout)

    def _finish(self) -> None:
        final = self.run_dir / "final_model"
        self.backend.export_hf(final, self.tokenizer)
        if self.is_main:  # the source model's files and dtype (rlplug.run.export)
            finish_export(final, self.model_path)
        _fault_point("export")
        # The model folder is referenced (a param and a pointer artifact), not copied: a 0.5 GB copy buys nothing.
        self.trackers.log_final_model(final, self.global_step)
        print(f"Training finished at step {self.global_step}; final model in {final}.", flush=True)

    def _run_validation(self, log_now: bool = True) -> dict[str, float]:
        metrics = self.validate()
        if not metrics:
            return {}
        samples, step = self._last_val_samples, self.global_step
        log_validation_samples(self.trackers, self.run_dir, samples, step)  # + <run_dir>/validation_samples.jsonl
        if log_now:
            self.trackers.log_metrics(metrics, step)
        print(f"validation @ step {step}: " + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()), flush=True)
        self.registry.hook.on_validation_end(step=self.global_step, metrics=metrics, samples=samples)
        return metrics

    def close(self) -> None:
        """Close the reward manager (after a running scoring, bounded by ``reward.timeout_s``), the rollout
        engine and the backend, then release the run directory's lock (``self.ckpt``); idempotent."""
        for obj in (
            getattr(self, "pipeline", None),  # an async producer stops before the engine closes
            self.reward,
            self.val_reward,
            getattr(self, "episodes", None),
            self.rollout,
            self.backend,
            self.ckpt,
        ):
            if obj is not None:
                with contextlib.suppress(Exception):
                    obj.close()


def run(cfg: DictConfig) -> int:
    """Train with ``cfg`` (composed and validated); returns the process exit code
    (:class:`rlplug.base.exit_codes.ExitCode`: 0 finished, 75 stopped by a signal after saving a
    checkpoint, 3/4 stopped by :class:`TrainingStopped`, 5 stopped by an alert rule)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with contextlib.suppress(Exception):
        import transformers  # deferred: transformers

        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
    trainer = Trainer(cfg)
    try:
        status = trainer.fit()
        return int(ExitCode.STOPPED_BY_SIGNAL if status == "interrupted" else ExitCode.FINISHED)
    except TrainingStopped as exc:
        print(f"Training stopped: {exc}", flush=True)
        return int(exc.exit_code)
    finally:
        trainer.close()
