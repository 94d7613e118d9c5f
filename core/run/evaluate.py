"""``rlplug eval`` and ``rlplug rollout``: generation and scoring without training."""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from omegaconf import DictConfig

from rlplug.contracts.registry import get_registry
from rlplug.contracts.reward_contract import trl_ids
from rlplug.contracts.types import RolloutOutput, SamplingParams
from rlplug.data.dataset import _chat_ids, dataset_read_kwargs, read_dataset
from rlplug.data.prepare import prepared_data_files
from rlplug.orchestration.episodes import episode_engine_for_run, rows_for_scoring, solution_texts
from rlplug.rewards.manager import ACC_REPORTED, FAILED, PRED, RewardManager
from rlplug.run.metrics import (  # noqa: F401 - verl's statistics: their old home (rlplug.run.metrics)
    BOOTSTRAP_SEED,
    N_BOOTSTRAP,
    ScoredResponse,
    core_metric,
    majority_values,
    prompt_statistics,
    source_statistics,
    subset_sizes,
    validation_metrics,
)

if TYPE_CHECKING:
    from rlplug.rewards.manager import RewardManager


def _model_path(cfg: DictConfig, checkpoint: str | None, stack: ExitStack) -> str:
    from rlplug.training.models import resolve_model_path  # deferred: torch

    if checkpoint is None:
        return resolve_model_path(cfg.model)
    ckpt = Path(checkpoint)
    if (ckpt / "config.json").is_file():  # already a HF folder (e.g. final_model)
        return str(ckpt)
    from rlplug.run.export import export_checkpoint  # deferred: torch

    tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="rlplug-eval-"))
    return str(export_checkpoint(ckpt, tmp))


def score_responses(
    rows: Sequence[Mapping[str, Any]],
    generate: Callable[[list[Mapping[str, Any]]], RolloutOutput],
    decode: Callable[[RolloutOutput], list[str]],
    reward: RewardManager,
    *,
    batch_size: int | None = None,
) -> list[ScoredResponse]:
    """Generate for ``rows`` and score every response: the validation pass, shared by the trainer's
    validation and ``rlplug eval`` so both report the same numbers for the same model.

    ``rows`` are dataset rows with ``prompt_ids`` (and ``data_source``, ``ground_truth``);
    ``generate(rows)`` returns the :class:`rlplug.contracts.types.RolloutOutput` for a list of rows (its
    sampling settings fixed by the caller; multi-turn episodes need the rows, a plain engine their ``prompt_ids``); ``decode`` turns it into the response texts; ``reward`` scores
    them (``score(..., report_acc=True)``); a multi-turn response's score adds its environment's step rewards
    (``RolloutOutput.step_rewards``), as its training return does (not for a response whose reward failed). Prompts go ``batch_size`` at a time (``data.val_batch_size``;
    None: all at once). Returns one :class:`rlplug.run.metrics.ScoredResponse` per response, in prompt order;
    :func:`rlplug.run.metrics.validation_metrics` turns them into the metrics.
    """

    skip = {"acc", "correctness", FAILED, ACC_REPORTED, PRED}  # reported by the fields of ScoredResponse itself
    rows = list(rows)
    size = int(batch_size or len(rows) or 1)
    scored: list[ScoredResponse] = []
    for start in range(0, len(rows), size):
        chunk = rows[start : start + size]
        out = generate(chunk)
        texts = decode(out)
        rows_out = rows_for_scoring(chunk, out)
        scores, extra, _ = reward.score(rows_out, texts, report_acc=True, **trl_ids(reward, out))
        names = [k for k in extra if k not in skip and not k.startswith("shaping/")]
        failed = extra.get(FAILED) or [False] * len(texts)
        if out.step_rewards is not None:  # multi-turn: the return trained on adds the environment's step rewards
            scores = [
                float(s) + (0.0 if failed[j] else sum(float(r) for _, r in out.step_rewards[j]))
                for j, s in enumerate(scores)
            ]
        for j, i in enumerate(out.prompt_index):
            components = {k: float(extra[k][j]) for k in names if extra[k][j] is not None}
            scored.append(
                ScoredResponse(
                    rows_out[j],  # the row as scored: a multi-turn trajectory's carries its transcript
                    start + i,
                    texts[j],
                    scores[j],
                    extra["acc"][j],
                    bool(extra[ACC_REPORTED][j]),
                    components,
                    cast(Any, extra.get(PRED, [None] * len(texts)))[j],
                )
            )
    return scored


def eval_sampling_params(cfg: DictConfig, k: int | None = None, temperature: float | None = None) -> SamplingParams:
    """The sampling settings of ``rlplug eval``: validation's (``rollout.val_kwargs`` and its seed,
    :func:`rlplug.run.trainer.sampling_params`), so by default eval reproduces the trainer's validation, with
    ``k`` samples per prompt (None: ``rollout.val_kwargs.n``) and ``temperature`` when given. When
    validation is greedy and a ``k > 1`` is given without a ``temperature``, the rollout's sampling
    (``rollout.temperature``, ``top_p``, ``top_k``) is used instead: ``k`` greedy samples would be one
    sample ``k`` times.

    Raises ``ValueError`` for ``k < 1`` or a negative ``temperature``.
    """
    from rlplug.rollout.utils import sampling_params  # deferred: torch

    params = sampling_params(cfg, validation=True)
    if k is not None and int(k) < 1:
        raise ValueError(f"--k must be at least 1 (samples per prompt), got {k}.")
    if temperature is not None and float(temperature) < 0:
        raise ValueError(f"--temperature must be >= 0 (0: greedy), got {temperature}.")
    if k is not None:
        params.n = int(k)
    if temperature is not None:
        params.temperature = float(temperature)
    elif k is not None and params.n > 1 and params.temperature == 0.0:
        r = cfg.rollout
        params.temperature, params.top_p, params.top_k = float(r.temperature), float(r.top_p), int(r.top_k)
    return params


def validation_rows(cfg: Any, tokenizer: Any) -> list[dict[str, Any]]:
    """The run's validation rows as :func:`evaluate` and the trainer's validation use them: the prepared
    validation files (``data.val_files``, else the task's; :func:`rlplug.data.prepare.prepared_data_files`)
    read with the run's prompt settings (``data.max_prompt_length``, ``filter_overlong_prompts``,
    ``prompt_key``, ``system_prompt``, ``special_tokens_in_text``: :func:`rlplug.data.dataset.dataset_read_kwargs`),
    at most ``data.val_max_samples`` rows. Raises what :func:`rlplug.data.dataset.read_dataset` raises
    (``DatasetError`` for a bad file or row)."""

    _, val_files = prepared_data_files(cfg)
    setting = "data.val_files" if cfg.data.val_files else f"the files prepared for data.task={cfg.data.task}"
    ds = read_dataset(val_files, tokenizer=tokenizer, setting=setting, **dataset_read_kwargs(cfg))
    return [ds[i] for i in range(len(ds))][: cfg.data.val_max_samples or None]


def evaluate(
    cfg: DictConfig, checkpoint: str | None = None, k: int | None = None, temperature: float | None = None
) -> list[dict[str, Any]]:
    """The validation metrics of a model or checkpoint on the validation files, per data source.

    Runs the trainer's validation pass (:func:`score_responses`, then
    :func:`rlplug.run.metrics.validation_metrics`) with :func:`eval_sampling_params` (``k`` samples per prompt,
    ``temperature``), so on the same checkpoint, data and config it gives the numbers the trainer's
    validation logs. ``checkpoint``: a ``global_step_N`` folder, a run folder (its latest checkpoint) or a
    Hugging Face folder; None: ``model``.

    Returns one row per data source (sorted): ``data_source``, ``n`` (prompts), ``k`` (samples per
    prompt), ``metric`` (``"acc"`` when the reward reports an accuracy, else ``"reward"``:
    :func:`rlplug.run.metrics.core_metric`), ``name`` (the metric's full name,
    ``val-core/<data_source>/<metric>/mean@<k>``), ``mean`` (mean@k), ``best`` (best@k: the mean over
    prompts of the best of ``k`` samples, pass@k for ``acc``; mean@1 for ``k = 1``), ``maj`` (verl's bootstrap
    ``maj@k/mean``, the majority answer's value, :func:`source_statistics`; None for ``k = 1`` or when the reward
    reports no ``pred``) and ``metrics`` (every ``val-*`` metric of the data source, verl's ``std@k``,
    ``best@k/mean``, ``worst@k/mean`` ... included).
    """
    from rlplug.training.models import load_tokenizer  # deferred: torch

    with ExitStack() as stack:
        path = _model_path(cfg, checkpoint, stack)
        tok = load_tokenizer(path, trust_remote_code=bool(cfg.model.trust_remote_code))
        rows = validation_rows(cfg, tok)
        # validation's reward (the rule reward unless reward.val_reward_model); its pool is shut down on any exit
        reward = stack.enter_context(RewardManager(cfg.reward, validation=True))
        reward.check_data_sources({r["data_source"] for r in rows})
        params = eval_sampling_params(cfg, k, temperature)
        registry = get_registry()
        rollout = registry.get("rollout_backend", cfg.rollout.name)(cfg, path, tok)
        stack.callback(rollout.close)
        episodes = episode_engine_for_run(cfg, registry, tok, rollout.generate)  # as the trainer's validation runs
        generate: Callable[[list[Mapping[str, Any]]], RolloutOutput]
        if episodes is not None:
            stack.callback(episodes.close)  # before the engine's close (last in, first out)
            generate = functools.partial(episodes.generate, params=params)
        else:
            generate = lambda chunk: rollout.generate([list(r["prompt_ids"]) for r in chunk], params)  # noqa: E731
        scored = score_responses(
            rows, generate, lambda out: solution_texts(out, tok), reward, batch_size=cfg.data.val_batch_size
        )
    result = []
    for src in sorted({s.row["data_source"] for s in scored}):
        mine = [s for s in scored if s.row["data_source"] == src]
        metric, metrics = core_metric(mine), validation_metrics(mine, n=params.n)
        name = f"val-core/{src}/{metric}/mean@{params.n}"
        result.append(
            {
                "data_source": src,
                "n": len({s.prompt for s in mine}),
                "k": params.n,
                "metric": metric,
                "name": name,
                "mean": metrics[name],
                "best": metrics.get(f"val-core/{src}/{metric}/best@{params.n}", metrics[name]),
                "maj": metrics.get(f"val-core/{src}/{metric}/maj@{params.n}/mean"),
                "metrics": metrics,
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
    from rlplug.training.models import load_tokenizer  # deferred: torch

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
