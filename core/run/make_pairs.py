"""``rlplug data pairs``: preference pairs sampled from a task with the run's model and rollout backend.

:func:`make_pairs` prepares the reasoning-gym task's training prompts, samples responses with the
configured rollout backend, labels them with the rule reward and writes the pairs
(:func:`rlplug.rewards.pairs.build_pairs`, :func:`rlplug.rewards.pairs.write_pairs`; the file format and the choice
of ``chosen`` and ``rejected`` are described in :mod:`rlplug.rewards.pairs`).
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlplug.config.compose import compose
from rlplug.contracts.registry import get_registry
from rlplug.data.dataset import read_dataset
from rlplug.data.prepare import prepare_dataset
from rlplug.rewards.manager import RewardManager
from rlplug.rewards.pairs import build_pairs, write_pairs
from rlplug.rollout.utils import sampling_params
from rlplug.training.models import load_tokenizer, resolve_model_path

__all__ = ["make_pairs"]

logger = logging.getLogger("rlplug.rewards.pairs")  # the logger of rlplug data pairs' messages, as before the move


def make_pairs(
    task: str,
    out: str | Path,
    *,
    overrides: Sequence[str] = (),
    size: int = 256,
    n: int = 4,
    match_format: bool = True,
) -> dict[str, Any]:
    """``rlplug data pairs TASK --out PAIRS.parquet``: sample ``n`` responses for each of ``size`` training
    prompts of the reasoning-gym ``task`` with the run's model and rollout backend (``overrides``: the
    run config, e.g. ``debug=tiny``, ``rollout.temperature``), label them with the rule reward
    (``reward.*``, the reward model off) and write the pairs (:func:`build_pairs` with ``match_format``,
    :func:`write_pairs`).

    Returns the counts of :func:`build_pairs` with ``path``. Raises ``ConfigError`` for a bad config or task.
    """
    cfg = compose([*overrides, f"data.task={task}", "reward.reward_model.enable=false"])
    registry = get_registry()
    reward = RewardManager(cfg.reward, registry=registry)
    model_path = resolve_model_path(cfg.model)
    tokenizer = load_tokenizer(model_path, trust_remote_code=bool(cfg.model.trust_remote_code))
    with tempfile.TemporaryDirectory(prefix="rlplug-pairs-") as tmp:
        d = cfg.data
        kwargs = dict(d.task_kwargs) if d.get("task_kwargs") else None
        files = prepare_dataset(
            task,
            tmp,
            train_size=size,
            test_size=1,
            seed=int(d.seed or 0),
            task_kwargs=kwargs,
            instruction=d.instruction,
        )
        ds = read_dataset(files["train_path"], tokenizer=tokenizer, max_prompt_length=int(d.max_prompt_length))
        rows = [ds[i] for i in range(len(ds))]
    params = sampling_params(cfg, step=0)
    params.n = int(n)
    rollout = registry.get("rollout_backend", cfg.rollout.name)(cfg, model_path, tokenizer)

    def sample(batch: Sequence[Mapping[str, Any]]) -> list[list[str]]:
        got: list[list[str]] = [[] for _ in batch]
        step = int(cfg.data.train_batch_size)
        for lo in range(0, len(batch), step):
            chunk = batch[lo : lo + step]
            rollout.wake_up()
            try:
                res = rollout.generate([list(r["prompt_ids"]) for r in chunk], params)
            finally:
                rollout.sleep()
            texts = tokenizer.batch_decode(res.response_ids, skip_special_tokens=True)
            for i, t in zip(res.prompt_index, texts):
                got[lo + i].append(t)
        return got

    try:
        pairs, counts = build_pairs(rows, sample, reward, match_format=match_format)
    finally:
        rollout.close()
        reward.close()
    path = write_pairs(pairs, out)
    if counts["chosen_corrected"]:
        logger.info(
            "%d of %d pairs have as chosen the rejected sample with its answer corrected (no sample of their prompt "
            "was correct; column chosen_source=corrected).",
            counts["chosen_corrected"],
            counts["pairs"],
        )
    if counts["chosen_from_reference"]:
        logger.warning(
            "%d of %d pairs have the reference answer as chosen (no sample of their prompt was correct; column "
            "chosen_source=reference).",
            counts["chosen_from_reference"],
            counts["pairs"],
        )
    return {**counts, "path": str(path)}
