"""The training loop.

One loop runs every algorithm preset; the plugins decide the math::

    rollout -> [reward scoring on a thread, overlapping:] old log-probs -> ref log-probs -> values
            -> in-reward KL -> advantages
            -> critic update -> actor update (after critic_warmup) -> push weights to rollout
            -> validation (every trainer.test_freq) -> checkpoint (every trainer.save_freq)

The trainer talks to a training backend (kind ``training_backend``) through these methods::

    backend = factory(config, model_path, use_critic=bool, use_ref=bool, total_steps=int)
    backend.compute_log_probs(batch, which="actor"|"ref", with_entropy=False) -> {"log_probs": (B, T), ...}
    backend.compute_values(batch) -> (B, T) float32
    backend.update_actor(batch) -> dict[str, float]      # actor/* metrics
    backend.update_critic(batch) -> dict[str, float]     # critic/* metrics
    backend.actor_weights() -> Iterator[(hf_name, tensor)]
    backend.save(dir) / backend.load(dir) / backend.export_hf(dir, tokenizer) / backend.close()
    backend.consecutive_bad_steps: int                   # non-finite optimizer steps in a row
    backend.world_size / is_main_process / broadcast_object(obj)   # multi-process backends only (fsdp2)

and to a rollout backend (kind ``rollout_backend``, see :class:`rlplug.types.RolloutBackend`).
Metric names follow verl (``actor/pg_loss``, ``critic/score/mean``, ``timing_s/gen`` ...).
Every step is deterministic given the seed and the checkpointed state (data position, RNG
states, optimizer, KL controller), so a resumed run reproduces an uninterrupted one.

``_fault_point("<label>")`` calls mark where the crash tests stop the process (a testing aid
that does nothing unless ``RLPLUG_TEST_KILL_AT`` is set; see :func:`rlplug.checkpoint._fault_point`).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import pickle
import random
import signal
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from .batch import Batch
from .checkpoint import CheckpointManager, _fault_point
from .config import ConfigError, default_cache_dir
from .registry import Registry, get_registry
from .types import SamplingParams
from .validate import uses_critic

log = logging.getLogger("rlplug")


class TrainingStopped(RuntimeError):
    """Training stopped on purpose (e.g. too many consecutive non-finite steps); the message says why."""


# ============================================================================ helpers


def run_dir_for(cfg: DictConfig) -> Path:
    """``trainer.default_local_dir`` or ``checkpoints/<project_name>/<experiment_name>`` (as verl).

    It holds the ``global_step_N`` checkpoints, the local MLflow store and ``final_model``.
    """
    if cfg.trainer.default_local_dir:
        return Path(str(cfg.trainer.default_local_dir)).expanduser()
    return Path("checkpoints") / cfg.trainer.project_name / cfg.trainer.experiment_name


#: bump when data_prepare changes how prompts or ground truths are written
DATA_FORMAT_VERSION = 1


def prepared_data_files(cfg: DictConfig) -> tuple[list[str], list[str]]:
    """The train/val parquet files: ``data.train_files`` or a cached preparation of ``data.task``."""
    d = cfg.data
    if d.train_files:
        return [str(Path(f).expanduser()) for f in d.train_files], [str(Path(f).expanduser()) for f in (d.val_files or [])]
    from . import data_prepare

    # The key covers everything that shapes the files, including rlplug's task defaults and format
    # version, so a change there never silently reuses stale data.
    spec = {"task": d.task, "train": d.train_size, "test": d.test_size, "seed": d.data_seed,
            "kwargs": OmegaConf.to_container(d.task_kwargs, resolve=True), "instruction": d.instruction,
            "defaults": data_prepare.TASK_DEFAULTS.get(d.task), "format": DATA_FORMAT_VERSION}
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
    out = default_cache_dir() / "data" / f"{d.task}-{key}"
    train, test = out / "train.parquet", out / "test.parquet"
    if not (train.is_file() and test.is_file()):
        tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
        data_prepare.prepare_dataset(d.task, tmp, train_size=d.train_size, test_size=d.test_size, seed=d.data_seed,
                        task_kwargs=spec["kwargs"] or None, instruction=d.instruction)
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(tmp, out)
        except OSError:  # another process won the race; use its files
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    val = [str(Path(f).expanduser()) for f in d.val_files] if d.val_files else [str(test)]
    return [str(train)], val


def set_threads(n: int | None) -> None:
    """Use ``n`` torch threads (None: all cores); thread counts are set explicitly (MACHINE_NOTES)."""
    n = n or os.cpu_count() or 1
    torch.set_num_threads(n)
    os.environ.setdefault("OMP_NUM_THREADS", str(n))


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global RNGs with ``seed``."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """RNG states as tensors and plain types (loadable with ``torch.load(weights_only=True)``)."""
    py = random.getstate()
    np_state = np.random.get_state()
    return {
        "python_version": py[0],
        "python_state": torch.tensor(py[1], dtype=torch.int64),
        "python_gauss": py[2] if py[2] is not None else float("nan"),
        "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_pos": int(np_state[2]),
        "numpy_has_gauss": int(np_state[3]),
        "numpy_gauss": float(np_state[4]),
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the RNG states saved by :func:`rng_state`."""
    gauss = state["python_gauss"]
    random.setstate((state["python_version"], tuple(int(x) for x in state["python_state"].tolist()),
                     None if isinstance(gauss, float) and math.isnan(gauss) else gauss))
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), state["numpy_pos"],
                         state["numpy_has_gauss"], state["numpy_gauss"]))
    torch.set_rng_state(state["torch"])


@contextlib.contextmanager
def timer(metrics: dict[str, float], name: str) -> Iterator[None]:
    """Add the block's wall time (seconds) to ``metrics["timing_s/<name>"]``."""
    start = time.perf_counter()
    yield
    metrics[f"timing_s/{name}"] = metrics.get(f"timing_s/{name}", 0.0) + time.perf_counter() - start


def _stats(prefix: str, x: torch.Tensor, mask: torch.Tensor | None = None) -> dict[str, float]:
    if mask is not None:
        x = x[mask.bool()]
    if x.numel() == 0:
        return {}
    x = x.float()
    return {f"{prefix}/mean": x.mean().item(), f"{prefix}/max": x.max().item(), f"{prefix}/min": x.min().item()}


def build_batch(prompt_ids: list[list[int]], out_response_ids: list[list[int]], prompt_index: list[int],
                pad_id: int) -> Batch:
    """Pack prompts (left-padded) and responses (right-padded) into the batch tensors.

    ``response_mask`` is 1.0 on each response's own tokens (EOS included when generated) and
    0.0 on padding -- built from lengths, never from ``ids != pad_id`` (pad may equal EOS).
    """
    B = len(out_response_ids)
    prompts = [prompt_ids[i] for i in prompt_index]
    P = max(len(p) for p in prompts)
    T = max(1, max(len(r) for r in out_response_ids))
    input_ids = torch.full((B, P + T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, P + T), dtype=torch.long)
    response_mask = torch.zeros((B, T), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, out_response_ids)):
        input_ids[i, P - len(p):P] = torch.tensor(p, dtype=torch.long)
        attention_mask[i, P - len(p):P] = 1
        if r:
            input_ids[i, P:P + len(r)] = torch.tensor(r, dtype=torch.long)
            attention_mask[i, P:P + len(r)] = 1
            response_mask[i, :len(r)] = 1.0
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return Batch({
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "responses": input_ids[:, P:].clone(),
        "response_mask": response_mask,
        "index": torch.tensor(prompt_index, dtype=torch.long),
    })


def _rank0_then_broadcast(method: Any) -> Any:
    """Multi-process backends (``backend.world_size > 1``): run ``method`` on rank 0 only and return
    its result on every rank, so all ranks train on the same rollouts and rewards."""

    @functools.wraps(method)
    def wrapper(self: "Trainer", *args: Any, **kwargs: Any) -> Any:
        if not getattr(self, "distributed", False):
            return method(self, *args, **kwargs)
        return self.backend.broadcast_object(method(self, *args, **kwargs) if self.is_main else None)

    return wrapper


# ============================================================================ trainer


class Trainer:
    """Owns the run: data, reward, backends, trackers, checkpoints; :meth:`fit` trains."""

    def __init__(self, cfg: DictConfig, registry: Registry | None = None) -> None:
        from .losses import compute_token_level_scores  # noqa: F401 - fail early if missing
        from .models import load_tokenizer, resolve_model_path
        from .data import StatefulDataLoader, read_dataset
        from .kl_control import make_kl_controller
        from .reward import RewardManager

        self.cfg = cfg
        self.registry = registry or get_registry()
        self.run_dir = run_dir_for(cfg)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        set_threads(cfg.trainer.num_threads)
        seed_everything(cfg.trainer.seed)

        # ---- everything that can fail cheaply comes before any model loads
        self.estimator = self.registry.get("advantage_estimator", cfg.algorithm.adv_estimator)
        self.use_critic = uses_critic(cfg, self.estimator)
        self.use_ref = bool(cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward)
        self.needs_baseline = "reward_baselines" in self.estimator.requires
        self.kl_in_reward = (self.registry.get("kl_penalty", cfg.algorithm.kl_penalty)
                             if cfg.algorithm.use_kl_in_reward else None)
        self.reward = RewardManager(cfg.reward, registry=self.registry)
        self.model_path = resolve_model_path(cfg.model)
        self.tokenizer = load_tokenizer(self.model_path, trust_remote_code=bool(cfg.model.trust_remote_code))
        train_files, val_files = prepared_data_files(cfg)
        read_kwargs = dict(tokenizer=self.tokenizer, max_prompt_length=cfg.data.max_prompt_length,
                           filter_overlong_prompts=cfg.data.filter_overlong_prompts, prompt_key=cfg.data.prompt_key,
                           system_prompt=cfg.data.system_prompt)
        self.train_ds = read_dataset(train_files, **read_kwargs)
        self.val_ds = read_dataset(val_files, **read_kwargs) if val_files else None
        sources = set(self.train_ds.data_sources) | (set(self.val_ds.data_sources) if self.val_ds else set())
        self.reward.check_data_sources(sources)
        if len(self.train_ds) < cfg.data.train_batch_size:
            raise ConfigError(
                f"data.train_batch_size={cfg.data.train_batch_size} but the training set has only {len(self.train_ds)} "
                f"usable rows (files: {train_files}). Lower the batch size or add data."
            )
        self.loader = StatefulDataLoader(self.train_ds, batch_size=cfg.data.train_batch_size,
                                         shuffle=cfg.data.shuffle, seed=cfg.data.seed)
        self.total_steps = int(cfg.trainer.total_training_steps or self.loader.steps_per_epoch * cfg.trainer.total_epochs)
        self.kl_ctrl = make_kl_controller(cfg.algorithm.kl_ctrl)
        self.ckpt = CheckpointManager(self.run_dir, cfg.trainer.max_ckpt_to_keep)

        # ---- models and engines
        backend_factory = self.registry.get("training_backend", cfg.trainer.backend)
        self.backend = backend_factory(cfg, self.model_path, use_critic=self.use_critic, use_ref=self.use_ref,
                                       total_steps=self.total_steps)
        # one optimizer step over the whole batch, nothing reading old_log_probs before it (the
        # in-reward KL does), a backend that can do without them: the actor update uses its own
        # detached log-probs (see ActorConfig.skip_old_log_prob_on_policy)
        self.skip_old_log_prob = bool(
            cfg.actor.skip_old_log_prob_on_policy and int(cfg.actor.ppo_epochs) == 1
            and int(cfg.actor.ppo_mini_batch_size) == int(cfg.data.train_batch_size)
            and not cfg.algorithm.use_kl_in_reward and getattr(self.backend, "reuses_on_policy_log_probs", False))
        # Multi-process backends (trainer=fsdp2 under torchrun) run this trainer on every rank. Rank 0
        # alone owns the rollout engine, generates and scores (broadcast to the others by
        # _rank0_then_broadcast), pushes weights, logs to trackers and writes checkpoint metadata.
        self.distributed = getattr(self.backend, "world_size", 1) > 1
        self.is_main = not self.distributed or bool(self.backend.is_main_process)
        rollout_factory = self.registry.get("rollout_backend", cfg.rollout.name)
        try:
            self.rollout = rollout_factory(cfg, self.model_path, self.tokenizer) if self.is_main else None
        except BaseException:
            self.rollout = None
            self.close()  # the backend (and a process group) is already up: do not leak it
            raise
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.global_step = 0
        self.trackers: list[Any] = []
        self._stop_signal: int | None = None
        self._score_pool: cf.ThreadPoolExecutor | None = None
        # Seed again now that everything is built: first-time imports and model loading above may
        # draw from the global RNGs (e.g. Python's ``random`` changed during the first Trainer of a
        # process only), so without this the same seed could give different runs in one process.
        seed_everything(cfg.trainer.seed)

    # ------------------------------------------------------------------ state
    def _resume(self) -> None:
        mode = self.cfg.trainer.resume_mode
        if mode == "disable":
            return
        path = Path(str(self.cfg.trainer.resume_from_path)) if mode == "resume_path" else self.ckpt.latest()
        if path is None:
            return
        if not (path / "COMPLETE").is_file():
            raise ConfigError(f"trainer.resume_from_path={path} is not a complete checkpoint (no COMPLETE marker).")
        state = json.loads((path / "trainer_state.json").read_text())
        try:
            self.backend.load(path / "backend")
            set_rng_state(torch.load(path / "rng_state.pt", weights_only=True))
        except pickle.UnpicklingError as exc:  # torch.load(weights_only=True) met a non-tensor object
            lines = str(exc).splitlines() or [""]
            detail = next((ln.strip() for ln in lines if "Unsupported" in ln), lines[0]).split(" Please use")[0]
            raise ConfigError(
                f"Refusing to resume from {path}: a file in it holds pickled Python objects other than tensors and "
                f"plain containers ({detail}). rlplug loads checkpoints with torch.load(weights_only=True) and "
                "safetensors only, because unpickling arbitrary objects can run code. Resume from a checkpoint "
                "written by rlplug, or start fresh with trainer.resume_mode=disable."
            ) from exc
        try:
            self.loader.load_state_dict(state["data_loader"])
            self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        except (ValueError, KeyError) as exc:
            raise ConfigError(
                f"Cannot resume from {path}: {exc}. The data or KL settings differ from the checkpointed run; "
                "restore them, or start fresh with trainer.resume_mode=disable (or another trainer.default_local_dir)."
            ) from exc
        self.global_step = int(state["global_step"])
        self._push_weights()
        log.info("Resumed from %s at step %d", path, self.global_step)
        print(f"Resumed from {path} (step {self.global_step}).", flush=True)
        _fault_point("resumed")

    def _push_weights(self) -> None:
        weights = self.backend.actor_weights()
        if self.rollout is not None:
            self.rollout.update_weights(weights)
        for _ in weights:  # other ranks (or an engine that stopped early): join the remaining gathers
            pass

    def save_checkpoint(self) -> Path:
        step = self.global_step

        def write(tmp: Path) -> None:
            if self.distributed:  # the other ranks write their shards into the same folder
                self.backend.broadcast_object(str(tmp))
            self.backend.save(tmp / "backend")
            _fault_point("ckpt_backend")
            torch.save(rng_state(), tmp / "rng_state.pt")
            _fault_point("ckpt_rng")
            meta = tmp / "hf_meta"
            meta.mkdir()
            self.tokenizer.save_pretrained(meta)
            cfg_json = Path(self.model_path) / "config.json"
            if cfg_json.is_file():
                (meta / "config.json").write_text(cfg_json.read_text())
            _fault_point("ckpt_meta")
            state = {
                "global_step": step,
                "data_loader": self.loader.state_dict(),
                "kl_ctrl": self.kl_ctrl.state_dict(),
            }
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
            _fault_point("ckpt_state")
            (tmp / "config.yaml").write_text(OmegaConf.to_yaml(self.cfg))

        if self.distributed and not self.is_main:  # rank 0 owns the folder and its metadata (see write)
            self.backend.save(Path(self.backend.broadcast_object(None)) / "backend")
            return Path(self.backend.broadcast_object(None))
        path = self.ckpt.save(step, write)
        if self.distributed:
            self.backend.broadcast_object(str(path))
        self.registry.hook.on_checkpoint_saved(step=step, path=str(path))
        return path

    # ------------------------------------------------------------------ one step
    def sampling_params(self, validation: bool = False, step: int = 0) -> SamplingParams:
        r = self.cfg.rollout
        if validation:
            v = r.val_kwargs
            return SamplingParams(n=v.n, temperature=v.temperature, top_p=v.top_p, top_k=v.top_k,
                                  max_tokens=self.cfg.data.max_response_length, seed=self.cfg.trainer.seed + 7919)
        return SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_tokens=self.cfg.data.max_response_length,
                              seed=self.cfg.trainer.seed * 1_000_003 + step, logprobs=r.calculate_log_probs,
                              ignore_eos=bool(r.ignore_eos))

    @_rank0_then_broadcast
    def _generate(self, prompt_ids: list[list[int]], params: SamplingParams, label: str = "rollout"):
        wake = getattr(self.rollout, "wake_up", None)
        if wake:
            wake()
        try:
            _fault_point(label)
            return self.rollout.generate(prompt_ids, params)
        finally:
            sleep = getattr(self.rollout, "sleep", None)
            if sleep:
                sleep()

    def _score_here(self, rows: list[dict], out) -> tuple[list[float], dict, dict]:
        """Decode ``out``'s responses and score them in this process (rank 0's share of :meth:`_score`)."""
        texts = self.tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
        return self.reward.score([rows[i] for i in out.prompt_index], texts)

    @_rank0_then_broadcast
    def _score(self, rows: list[dict], out) -> tuple[list[float], dict, dict]:
        return self._score_here(rows, out)

    def _start_scoring(self, rows: list[dict], out) -> "cf.Future | None":
        """Start scoring ``out`` on a background thread (rank 0 only) and return its future.

        Scores are needed first by the advantage estimator, so decoding and scoring run while the
        actor computes old log-probs (and ref log-probs and values): the reward functions are plain
        Python or run in ``reward.num_workers`` processes, and torch releases the GIL inside its
        kernels, so the two proceed together. The future yields ``(result, seconds)``; an
        exception raised while scoring is raised by :meth:`_finish_scoring`. With
        ``reward.overlap=false`` the scoring runs here, on the main thread, before returning.
        """
        if not self.is_main:
            return None
        if not self.cfg.reward.overlap:  # score now, on the main thread
            done: cf.Future = cf.Future()
            t0 = time.perf_counter()
            done.set_result((self._score_here(rows, out), time.perf_counter() - t0))
            return done
        if self._score_pool is None:
            self._score_pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlplug-score")
        t0 = time.perf_counter()

        def work() -> tuple[tuple[list[float], dict, dict], float]:
            return self._score_here(rows, out), time.perf_counter() - t0

        return self._score_pool.submit(work)

    def _finish_scoring(self, future: "cf.Future | None", metrics: dict[str, float]) -> tuple[list[float], dict, dict]:
        """Wait for :meth:`_start_scoring`'s result and share it with every rank.

        ``timing_s/reward`` is the scoring time itself; ``timing_s/reward_wait`` is what the step
        waited for it after the log-prob/value passes (the part on the critical path).
        """
        with timer(metrics, "reward_wait"):
            result = None
            if future is not None:
                result, seconds = future.result()
                metrics["timing_s/reward"] = seconds
        if self.distributed:  # in the main thread: collectives must not interleave with the backend's
            result = self.backend.broadcast_object(result)
        return result

    def train_step(self) -> dict[str, float]:
        from .losses import apply_kl_penalty, compute_token_level_scores, masked_mean

        cfg = self.cfg
        metrics: dict[str, float] = {}
        step = self.global_step + 1
        t_step = time.perf_counter()
        _fault_point("step_start")
        rows, epoch = self.loader.next_batch()
        prompt_ids = [r["prompt_ids"] for r in rows]

        with timer(metrics, "gen"):
            out = self._generate(prompt_ids, self.sampling_params(step=step))
        batch = build_batch(prompt_ids, out.response_ids, out.prompt_index, self.pad_id)
        mask = batch["response_mask"]
        lengths = mask.sum(-1)

        if self.needs_baseline:
            with timer(metrics, "gen_baseline"):
                base_out = self._generate(prompt_ids, SamplingParams(n=1, temperature=0.0, max_tokens=cfg.data.max_response_length),
                                          label="rollout_baseline")
                base_scores, _, _ = self._score(rows, base_out)
            batch["reward_baselines"] = torch.tensor([base_scores[i] for i in out.prompt_index], dtype=torch.float32)
        scoring = self._start_scoring(rows, out)  # overlaps the passes below; joined before the advantages
        if out.log_probs is not None:
            T = mask.shape[1]
            batch["rollout_log_probs"] = torch.tensor([lp + [0.0] * (T - len(lp)) for lp in out.log_probs], dtype=torch.float32)

        if not self.skip_old_log_prob:
            with timer(metrics, "old_log_prob"):
                res = self.backend.compute_log_probs(batch, which="actor", with_entropy=True)
                batch["old_log_probs"] = res["log_probs"]
                if "entropy" in res:
                    metrics["actor/entropy_rollout"] = masked_mean(res["entropy"], mask).item()
            _fault_point("old_log_prob")
        if self.use_ref:
            with timer(metrics, "ref"):
                batch["ref_log_probs"] = self.backend.compute_log_probs(batch, which="ref")["log_probs"]
            _fault_point("ref")
        if self.use_critic:
            with timer(metrics, "values"):
                batch["values"] = self.backend.compute_values(batch) * mask
            _fault_point("values")

        scores, extra, reward_metrics = self._finish_scoring(scoring, metrics)
        _fault_point("reward")
        metrics.update(reward_metrics)
        score_t = torch.tensor(scores, dtype=torch.float32)
        batch["token_level_scores"] = compute_token_level_scores(score_t, mask)

        with timer(metrics, "adv"):
            if self.kl_in_reward is not None:
                kl_fn = self.kl_in_reward
                rewards, kl_metrics = apply_kl_penalty(batch["token_level_scores"], batch["old_log_probs"],
                                                       batch["ref_log_probs"], mask, self.kl_ctrl.value, kl_fn)
                batch["token_level_rewards"] = rewards
                metrics.update(kl_metrics)
                self.kl_ctrl.update(kl_metrics["actor/reward_kl_penalty"], n_steps=len(batch))
            else:
                batch["token_level_rewards"] = batch["token_level_scores"]
            data = {k: batch.tensors.get(k) for k in ("token_level_rewards", "response_mask", "values", "index", "reward_baselines")}
            advantages, returns = self.estimator(data, cfg.algorithm)
            batch["advantages"], batch["returns"] = advantages, returns
        _fault_point("adv")

        if self.use_critic:
            with timer(metrics, "update_critic"):
                metrics.update(self.backend.update_critic(batch))
            _fault_point("update_critic")
        if step > cfg.trainer.critic_warmup:
            with timer(metrics, "update_actor"):
                metrics.update(self.backend.update_actor(batch))
            _fault_point("update_actor")
            bad = getattr(self.backend, "consecutive_bad_steps", 0)
            if bad >= cfg.trainer.max_consecutive_bad_steps:
                raise TrainingStopped(
                    f"{bad} consecutive optimizer steps had a non-finite loss or gradient (limit "
                    f"trainer.max_consecutive_bad_steps={cfg.trainer.max_consecutive_bad_steps}); stopping. The last good "
                    f"checkpoint is intact under {self.ckpt.root}. Lower the learning rate or check the data/reward."
                )
            with timer(metrics, "update_weights"):
                self._push_weights()
            _fault_point("update_weights")

        # ---- metrics (verl's names)
        metrics.update(_stats("critic/score", score_t))
        seq_rewards = (batch["token_level_rewards"] * mask).sum(-1)
        metrics.update(_stats("critic/rewards", seq_rewards))
        metrics.update(_stats("critic/advantages", advantages, mask))
        metrics.update(_stats("critic/returns", returns, mask))
        if self.use_critic:
            metrics.update(_stats("critic/values", batch["values"], mask))
            valid = mask.bool()
            ret, val = returns[valid], batch["values"][valid]
            var_r = ret.var(unbiased=False)
            metrics["critic/vf_explained_var"] = (1.0 - (ret - val).var(unbiased=False) / (var_r + 1e-8)).item()
        for k, vals in extra.items():  # NaN marks samples whose reward did not report the key
            finite = [v for v in vals if v is not None and not math.isnan(v)]
            if finite:
                metrics[f"critic/{k}/mean"] = float(np.mean(finite))
        metrics.update(_stats("response_length", lengths))
        metrics["response_length/clip_ratio"] = float(np.mean(out.truncated_flags))
        metrics["response_length/empty"] = float(sum(1 for n in out.response_lengths if n == 0))
        prompt_lens = torch.tensor([len(p) for p in prompt_ids], dtype=torch.float32)
        metrics.update(_stats("prompt_length", prompt_lens))
        metrics["training/global_step"] = float(step)
        metrics["training/epoch"] = float(epoch)
        if self.kl_in_reward is not None or cfg.algorithm.kl_ctrl.type == "adaptive":
            metrics["actor/kl_coef"] = float(self.kl_ctrl.value)
        step_time = time.perf_counter() - t_step
        metrics["timing_s/step"] = step_time
        n_tokens = float(batch["attention_mask"].sum().item())
        metrics["perf/total_num_tokens"] = n_tokens
        metrics["perf/throughput"] = n_tokens / step_time
        metrics["perf/gen_tokens_per_s"] = float(lengths.sum().item()) / max(metrics["timing_s/gen"], 1e-9)
        self.global_step = step
        return metrics

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        if self.val_ds is None or len(self.val_ds) == 0:
            return {}
        cfg = self.cfg
        rows = [self.val_ds[i] for i in range(len(self.val_ds))]
        if cfg.data.val_max_samples:
            rows = rows[: cfg.data.val_max_samples]
        params = self.sampling_params(validation=True)
        bs = cfg.data.val_batch_size or len(rows)
        scores: list[float] = []
        accs: list[float] = []
        sources: list[str] = []
        samples: list[dict] = []
        for start in range(0, len(rows), bs):
            chunk = rows[start:start + bs]
            out = self._generate([r["prompt_ids"] for r in chunk], params, label="validation")
            texts = self.tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
            s, extra, _ = self.reward.score([chunk[i] for i in out.prompt_index], texts)
            scores += s
            accs += extra.get("acc", s)
            sources += [chunk[i]["data_source"] for i in out.prompt_index]
            for j in range(len(texts)):
                if len(samples) < cfg.trainer.val_samples_to_log:
                    r = chunk[out.prompt_index[j]]
                    samples.append({"data_source": r["data_source"], "prompt": r["messages"][-1]["content"],
                                    "response": texts[j], "ground_truth": str(r["ground_truth"]), "score": s[j]})
        n = params.n
        metrics: dict[str, float] = {}
        for src in sorted(set(sources)):
            idx = [i for i, x in enumerate(sources) if x == src]
            metrics[f"val-core/{src}/acc/mean@{n}"] = float(np.mean([accs[i] for i in idx]))
            metrics[f"val-aux/{src}/reward/mean@{n}"] = float(np.mean([scores[i] for i in idx]))
        self._last_val_samples = samples
        return metrics

    # ------------------------------------------------------------------ main loop
    def _open_trackers(self) -> None:
        if not getattr(self, "is_main", True):  # only rank 0 logs
            return
        for name in self.cfg.trainer.logger:
            self.trackers.append(self.registry.get("tracker", name)(self.cfg))
        flat = _flatten(OmegaConf.to_container(self.cfg, resolve=True))
        flat["model.resolved_path"] = str(self.model_path)
        for t in self.trackers:
            t.log_params(flat)

    def _log(self, metrics: dict[str, float], step: int) -> None:
        for t in self.trackers:
            t.log_metrics(metrics, step)

    def _handle_signal(self, signum: int, frame: Any) -> None:  # noqa: ARG002
        if self._stop_signal is not None:  # second signal: stop now
            raise KeyboardInterrupt
        self._stop_signal = signum
        print(f"\nReceived {signal.Signals(signum).name}: finishing the current step, then saving a checkpoint "
              f"(send it again to stop at once).", flush=True)

    def fit(self) -> str:
        """Train until ``total_steps``; returns ``"finished"`` or ``"interrupted"``."""
        from tqdm import tqdm

        cfg = self.cfg
        self._resume()
        try:
            self._open_trackers()
        except BaseException:
            for t in self.trackers:  # close those already open, so no MLflow run is left RUNNING
                with contextlib.suppress(Exception):
                    t.close(status="FAILED")
            raise
        old_handlers = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                old_handlers[sig] = signal.signal(sig, self._handle_signal)
            except ValueError:  # not in the main thread
                pass
        status = "failed"
        t_start = time.time()
        try:
            self.registry.hook.on_train_start(config=cfg, run_dir=str(self.run_dir))
            if cfg.trainer.val_before_train and self.global_step == 0:
                self._run_validation()
            bar = tqdm(total=self.total_steps, initial=self.global_step, desc="train", dynamic_ncols=True,
                       disable=None)
            while self.global_step < self.total_steps:
                metrics = self.train_step()
                step = self.global_step
                out_of_time = cfg.trainer.max_wall_time_s is not None and time.time() - t_start > cfg.trainer.max_wall_time_s
                if self.distributed:  # every rank must stop (and save) at the same step: rank 0 decides
                    self._stop_signal, out_of_time = self.backend.broadcast_object((self._stop_signal, out_of_time))
                # the time budget is part of the experiment: reaching it ends the run like its last step
                # (validation, checkpoint, final model)
                last = step >= self.total_steps or out_of_time
                if out_of_time and step < self.total_steps:
                    print(f"Reached trainer.max_wall_time_s={cfg.trainer.max_wall_time_s} after step {step}: "
                          "validating, saving and exporting.", flush=True)
                if cfg.trainer.test_freq > 0 and (step % cfg.trainer.test_freq == 0 or last):
                    with timer(metrics, "testing"):
                        metrics.update(self._run_validation(log_now=False))
                self._log(metrics, step)
                self.registry.hook.on_step_end(step=step, metrics=metrics)
                _fault_point("step_end")
                bar.update(1)
                bar.set_postfix({k.split("/")[-2] if k.count("/") > 1 else k: round(v, 3) for k, v in metrics.items()
                                 if k in ("critic/score/mean", "actor/pg_loss", "response_length/mean")})
                if (cfg.trainer.save_freq > 0 and step % cfg.trainer.save_freq == 0) or last or self._stop_signal:
                    with timer(metrics, "save_checkpoint"):
                        self.save_checkpoint()
                if self._stop_signal is not None and not last:  # a stop in the last step just finishes
                    status = "interrupted"
                    print(f"Stopped after step {step} (a signal); checkpoint saved in {self.ckpt.root}. "
                          f"Resume with the same command (trainer.resume_mode=auto).", flush=True)
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
            for sig, h in old_handlers.items():
                signal.signal(sig, h)
            self.registry.hook.on_train_end(step=self.global_step, status=status)
            for t in self.trackers:
                with contextlib.suppress(Exception):
                    t.close(status="FINISHED" if status == "finished" else ("KILLED" if status == "interrupted" else "FAILED"))

    def _finish(self) -> None:
        final = self.run_dir / "final_model"
        self.backend.export_hf(final, self.tokenizer)
        _fault_point("export")
        # The model folder is referenced, not copied: a second 0.5 GB copy in the run dir buys nothing.
        for t in self.trackers:
            t.log_params({"final_model_path": str(final.resolve())})
        print(f"Training finished at step {self.global_step}; final model in {final}.", flush=True)

    def _run_validation(self, log_now: bool = True) -> dict[str, float]:
        metrics = self.validate()
        if not metrics:
            return {}
        samples = getattr(self, "_last_val_samples", [])
        for t in self.trackers:
            t.log_table(f"val_generations/step_{self.global_step:06d}.json", samples, self.global_step)
        if log_now:
            self._log(metrics, self.global_step)
        print("validation @ step %d: %s" % (self.global_step, ", ".join(f"{k}={v:.4f}" for k, v in metrics.items())), flush=True)
        self.registry.hook.on_validation_end(step=self.global_step, metrics=metrics, samples=samples)
        return metrics

    def close(self) -> None:
        if self._score_pool is not None:  # wait for a running scoring (bounded by reward.timeout_s) before
            self._score_pool.shutdown(wait=True, cancel_futures=True)  # the reward pool below closes
            self._score_pool = None
        for obj in (getattr(self, "rollout", None), getattr(self, "backend", None), getattr(self, "reward", None)):
            close = getattr(obj, "close", None)
            if close:
                with contextlib.suppress(Exception):
                    close()


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    else:
        out[prefix[:-1]] = d
    return out


def run(cfg: DictConfig) -> int:
    """Train with ``cfg`` (composed and validated); returns a process exit code."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with contextlib.suppress(Exception):
        import transformers

        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
    trainer = Trainer(cfg)
    try:
        status = trainer.fit()
        return 0 if status in ("finished", "interrupted") else 1
    except TrainingStopped as exc:
        print(f"Training stopped: {exc}", flush=True)
        return 3
    finally:
        trainer.close()
