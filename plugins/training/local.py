"""The ``local`` training backend (kind ``training_backend``): one process, torch on CPU or one GPU.

It owns the actor (trained policy), the optional reference model (a frozen copy of the initial
actor) and the optional critic (:class:`rlplug.training.models.ValueModel`), their AdamW optimizers and
learning-rate schedules, and implements :class:`rlplug.contracts.types.TrainingBackend`::

    backend = LocalTrainingBackend(config, model_path, use_critic=..., use_ref=..., total_steps=...)
    backend.compute_log_probs(batch, which="actor" | "ref", with_entropy=False, extras=())
    backend.compute_values(batch)
    backend.update_actor(batch) / backend.update_critic(batch)
    backend.actor_weights() / save(dir) / load(dir) / export_hf(dir, tokenizer) / close()
    backend.coordinator  # rlplug.contracts.coordinator.SINGLE_PROCESS

Everything is the library's :class:`rlplug.training.backend.TrainingBackendBase` with its single-process
defaults (see there for the update loop, the numerics and the checkpoint layout); the objectives
are :func:`rlplug.algorithms.objective.actor_objective` and :func:`rlplug.algorithms.objective.critic_objective`. This
module only names the backend, gives it its logger (``rlplug.plugins.training.local``) and
registers it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from rlplug.plugin import SINGLE_PROCESS, TrainingBackendBase, build_lr_lambda, hookimpl

__all__ = ["LocalTrainingBackend", "build_lr_lambda"]

logger = logging.getLogger(__name__)


class LocalTrainingBackend(TrainingBackendBase):
    """Training backend for one process (``trainer.backend=local``).

    Same arguments, methods, attributes and errors as :class:`rlplug.training.backend.TrainingBackendBase`:
    ``capabilities = {"reuses_on_policy_log_probs", "policy_loss_minibatch_stats", "scale_lr", "apply_phase"}``,
    ``per_token_outputs = {"entropy", "sum_pi_squared"}``, ``coordinator = SINGLE_PROCESS``, ``consecutive_bad_steps`` (property).
    """

    backend_name = "local"
    log = logger
    coordinator = SINGLE_PROCESS


@hookimpl
def register_training_backends(register: Callable[..., None]) -> None:
    register("local", LocalTrainingBackend)
