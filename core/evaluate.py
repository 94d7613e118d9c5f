"""``rlplug eval`` and ``rlplug rollout``: generation and scoring without training."""

from __future__ import annotations

import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig

from .types import SamplingParams


def _model_path(cfg: DictConfig, checkpoint: str | None, stack: ExitStack) -> str:
    from .models import resolve_model_path

    if checkpoint is None:
        return resolve_model_path(cfg.model)
    ckpt = Path(checkpoint)
    if (ckpt / "config.json").is_file():  # already a HF folder (e.g. final_model)
        return str(ckpt)
    from .checkpoint import export_checkpoint

    tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="rlplug-eval-"))
    return str(export_checkpoint(ckpt, tmp))


def evaluate(
    cfg: DictConfig, checkpoint: str | None = None, k: int = 1, temperature: float | None = None
) -> list[dict[str, Any]]:
    """mean@k and pass@k per data source on the validation files.

    ``k`` samples per prompt; greedy when ``k == 1`` and ``temperature`` is None, else
    ``temperature`` (default ``rollout.temperature``). A sample is correct when its ``acc``
    (or its score, for rewards without ``acc``) is >= 1. Returns rows with ``data_source``,
    ``n`` (prompts), ``mean`` (mean@k) and ``pass`` (pass@k).
    """
    from .data import read_dataset
    from .data_prepare import prepared_data_files
    from .models import load_tokenizer
    from .registry import get_registry
    from .reward import RewardManager

    with ExitStack() as stack:
        path = _model_path(cfg, checkpoint, stack)
        tok = load_tokenizer(path)
        _, val_files = prepared_data_files(cfg)
        ds = read_dataset(
            val_files,
            tokenizer=tok,
            max_prompt_length=cfg.data.max_prompt_length,
            filter_overlong_prompts=cfg.data.filter_overlong_prompts,
            prompt_key=cfg.data.prompt_key,
            system_prompt=cfg.data.system_prompt,
        )
        rows = [ds[i] for i in range(len(ds))][: cfg.data.val_max_samples or None]
        reward = stack.enter_context(RewardManager(cfg.reward))  # its worker pool is shut down on any exit
        reward.check_data_sources({r["data_source"] for r in rows})
        temp = temperature if temperature is not None else (0.0 if k == 1 else cfg.rollout.temperature)
        rollout = get_registry().get("rollout_backend", cfg.rollout.name)(cfg, path, tok)
        try:
            out = rollout.generate(
                [r["prompt_ids"] for r in rows],
                SamplingParams(
                    n=k,
                    temperature=temp,
                    top_p=cfg.rollout.top_p,
                    top_k=cfg.rollout.top_k,
                    max_tokens=cfg.data.max_response_length,
                    seed=cfg.trainer.seed,
                ),
            )
        finally:
            rollout.close()
        texts = tok.batch_decode(out.response_ids, skip_special_tokens=True)
        scores, extra, _ = reward.score([rows[i] for i in out.prompt_index], texts)
    correct = np.array([float(a) >= 1.0 for a in extra.get("acc", scores)], dtype=np.float64)
    by_prompt: dict[int, list[float]] = {}
    for j, i in enumerate(out.prompt_index):
        by_prompt.setdefault(i, []).append(correct[j])
    result = []
    for src in sorted({r["data_source"] for r in rows}):
        ids = [i for i, r in enumerate(rows) if r["data_source"] == src]
        result.append(
            {
                "data_source": src,
                "n": len(ids),
                "mean": float(np.mean([np.mean(by_prompt[i]) for i in ids])),
                "pass": float(np.mean([max(by_prompt[i]) for i in ids])),
            }
        )
    return result


def debug_rollout(
    cfg: DictConfig,
    prompts: list[str],
    ground_truth: str | None = None,
    data_source: str | None = None,
    checkpoint: str | None = None,
) -> list[dict[str, Any]]:
    """Generate (greedy, ``rollout.val_kwargs``) for ``prompts`` and score each with the configured reward.

    Returns dicts with ``prompt``, ``response``, ``score`` and ``breakdown`` (the reward's extra values).
    """
    from .data import _chat_ids
    from .models import load_tokenizer
    from .registry import get_registry
    from .reward import RewardManager

    source = data_source or (cfg.data.task or "openai/gsm8k")
    with ExitStack() as stack:
        path = _model_path(cfg, checkpoint, stack)
        tok = load_tokenizer(path)
        ids = [_chat_ids(tok, [{"role": "user", "content": p}]) for p in prompts]  # as the training data is tokenized
        v = cfg.rollout.val_kwargs
        rollout = get_registry().get("rollout_backend", cfg.rollout.name)(cfg, path, tok)
        try:
            out = rollout.generate(
                ids,
                SamplingParams(
                    n=1,
                    temperature=v.temperature,
                    top_p=v.top_p,
                    top_k=v.top_k,
                    max_tokens=cfg.data.max_response_length,
                    seed=cfg.trainer.seed,
                ),
            )
        finally:
            rollout.close()
        texts = tok.batch_decode(out.response_ids, skip_special_tokens=True)
    items = []
    if ground_truth is None:
        return [
            {"prompt": prompts[i], "response": t, "score": None, "breakdown": {}}
            for i, t in zip(out.prompt_index, texts)
        ]
    rows: list[dict[str, Any]] = [
        {"data_source": source, "ground_truth": ground_truth, "extra_info": {}, "messages": [], "prompt_ids": []}
        for _ in prompts
    ]
    with RewardManager(cfg.reward) as reward:
        scores, extra, _ = reward.score([rows[i] for i in out.prompt_index], texts)
    for j, i in enumerate(out.prompt_index):
        items.append(
            {
                "prompt": prompts[i],
                "response": texts[j],
                "score": scores[j],
                "breakdown": {k: v[j] for k, v in extra.items()},
            }
        )
    return items
