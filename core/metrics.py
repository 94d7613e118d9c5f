"""Step metrics, named as verl names them.

:func:`stage` times one stage of the training step into ``timing_s/<name>``; :func:`step_metrics`
computes the per-step statistics of the batch (``critic/score/mean``, ``critic/advantages/max``,
``response_length/clip_ratio``, ...) and :func:`throughput_metrics` the step time and token rates
(``timing_s/step``, ``perf/throughput``, ...). The trainer merges them with the backends'
``actor/*`` / ``critic/*`` metrics and logs the result once per step.

All values are Python floats. Statistics over ``(B, T)`` tensors count valid response tokens only
(``response_mask``); ``/mean``, ``/max`` and ``/min`` are left out when nothing is valid.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from .batch import Batch
    from .types import RolloutOutput

__all__ = [
    "stats",
    "stage",
    "step_metrics",
    "progress_metrics",
    "throughput_metrics",
    "validation_metrics",
    "validation_samples",
]


def stats(prefix: str, x: torch.Tensor, mask: torch.Tensor | None = None) -> dict[str, float]:
    """``{<prefix>/mean, <prefix>/max, <prefix>/min}`` of ``x`` (any shape; in float32), over the
    entries where ``mask`` (same shape, nonzero = valid) is set; ``{}`` when none is."""
    if mask is not None:
        x = x[mask.bool()]
    if x.numel() == 0:
        return {}
    x = x.float()
    return {f"{prefix}/mean": x.mean().item(), f"{prefix}/max": x.max().item(), f"{prefix}/min": x.min().item()}


@contextlib.contextmanager
def stage(metrics: dict[str, float], name: str, *, fault: str | bool | None = True) -> Iterator[None]:
    """Time the block into ``metrics["timing_s/<name>"]`` (seconds, added to what is there), then
    reach the fault point ``fault`` (``True``: ``name``; ``None``/``False``: none).

    The fault point is the crash tests' hook (:func:`rlplug.checkpoint._fault_point`): it comes
    after the stage's work and its timing, and only when the block did not raise. A block that
    raises records no time.
    """
    from .checkpoint import _fault_point

    start = time.perf_counter()
    yield
    metrics[f"timing_s/{name}"] = metrics.get(f"timing_s/{name}", 0.0) + time.perf_counter() - start
    if fault:
        _fault_point(name if fault is True else fault)


def step_metrics(
    batch: Batch,
    *,
    scores: Sequence[float],
    components: Mapping[str, Sequence[float | None]],
    rollout: RolloutOutput,
    prompt_ids: Sequence[Sequence[int]],
    use_critic: bool,
) -> dict[str, float]:
    """The batch statistics of one training step (verl's names).

    ``batch`` holds ``response_mask``, ``token_level_rewards``, ``advantages`` and ``returns``
    ``(B, T) float32`` (and ``values`` with ``use_critic``); ``scores`` are the ``B`` sequence
    scores; ``components`` the reward's named values per response (``RewardManager.score``'s
    ``extra``: lists of ``B`` floats, NaN or ``None`` where a response's reward did not report the
    name); ``rollout`` and ``prompt_ids`` the step's generation and its prompts (token ids).

    Returns ``critic/score/*`` (sequence scores), ``critic/rewards/*`` (summed token-level rewards,
    after the in-reward KL), ``critic/advantages/*`` and ``critic/returns/*`` (valid tokens),
    with a critic ``critic/values/*`` and ``critic/vf_explained_var`` (``1 - Var(returns - values)
    / Var(returns)`` over valid tokens, as verl), ``critic/<name>/mean`` per reward component
    (the mean of the finite values, in float64), ``response_length/*`` (tokens),
    ``response_length/clip_ratio`` (share of responses cut at ``max_tokens``),
    ``response_length/empty`` (count of empty responses) and ``prompt_length/*`` (tokens).
    """
    import numpy as np
    import torch

    mask = batch["response_mask"]
    advantages, returns = batch["advantages"], batch["returns"]
    out: dict[str, float] = {}
    out.update(stats("critic/score", torch.tensor(list(scores), dtype=torch.float32)))
    out.update(stats("critic/rewards", (batch["token_level_rewards"] * mask).sum(-1)))
    out.update(stats("critic/advantages", advantages, mask))
    out.update(stats("critic/returns", returns, mask))
    if use_critic:
        out.update(stats("critic/values", batch["values"], mask))
        valid = mask.bool()
        ret, val = returns[valid], batch["values"][valid]
        var_r = ret.var(unbiased=False)
        out["critic/vf_explained_var"] = (1.0 - (ret - val).var(unbiased=False) / (var_r + 1e-8)).item()
    for name, values in components.items():
        finite = [v for v in values if v is not None and not math.isnan(v)]
        if finite:
            out[f"critic/{name}/mean"] = float(np.mean(finite))
    out.update(stats("response_length", mask.sum(-1)))
    out["response_length/clip_ratio"] = float(np.mean(rollout.truncated_flags))
    out["response_length/empty"] = float(sum(1 for n in rollout.response_lengths if n == 0))
    out.update(stats("prompt_length", torch.tensor([len(p) for p in prompt_ids], dtype=torch.float32)))
    return out


def progress_metrics(step: int, epoch: int, kl_coef: float | None = None) -> dict[str, float]:
    """``training/global_step`` (1-based), ``training/epoch`` and, when given, ``actor/kl_coef`` (the
    KL controller's current coefficient)."""
    out = {"training/global_step": float(step), "training/epoch": float(epoch)}
    if kl_coef is not None:
        out["actor/kl_coef"] = float(kl_coef)
    return out


def throughput_metrics(batch: Batch, *, step_time: float, gen_time: float) -> dict[str, float]:
    """``timing_s/step`` (``step_time``, seconds), ``perf/total_num_tokens`` (prompt + response
    tokens of the batch), ``perf/throughput`` (those tokens per second of the step) and
    ``perf/gen_tokens_per_s`` (response tokens per second of generation, ``gen_time``)."""
    n_tokens = float(batch["attention_mask"].sum().item())
    return {
        "timing_s/step": step_time,
        "perf/total_num_tokens": n_tokens,
        "perf/throughput": n_tokens / step_time,
        "perf/gen_tokens_per_s": float(batch["response_mask"].sum(-1).sum().item()) / max(gen_time, 1e-9),
    }


def validation_metrics(scored: Sequence[tuple[Mapping[str, Any], str, float, float]], n: int) -> dict[str, float]:
    """Per data source (sorted), over the scored validation responses ``(row, response, score, acc)``:
    ``val-core/<data_source>/acc/mean@<n>`` (the mean ``acc``) and ``val-aux/<data_source>/reward/mean@<n>``
    (the mean score), ``n`` responses per prompt (verl's names)."""
    import numpy as np

    metrics: dict[str, float] = {}
    for src in sorted({row["data_source"] for row, *_ in scored}):
        mine = [(score, acc) for row, _, score, acc in scored if row["data_source"] == src]
        metrics[f"val-core/{src}/acc/mean@{n}"] = float(np.mean([acc for _, acc in mine]))
        metrics[f"val-aux/{src}/reward/mean@{n}"] = float(np.mean([score for score, _ in mine]))
    return metrics


def validation_samples(scored: Sequence[tuple[Mapping[str, Any], str, float, float]]) -> list[dict[str, Any]]:
    """The scored validation responses as the rows trackers log: ``data_source``, ``prompt`` (the last
    message's text), ``response``, ``ground_truth`` and ``score``."""
    return [
        {
            "data_source": row["data_source"],
            "prompt": row["messages"][-1]["content"],
            "response": response,
            "ground_truth": str(row["ground_truth"]),
            "score": score,
        }
        for row, response, score, _ in scored
    ]


def progress_postfix(metrics: dict[str, float]) -> dict[str, float]:
    """The few step metrics the progress bar shows (score, policy loss, response length), short-named."""
    keys = ("critic/score/mean", "actor/pg_loss", "response_length/mean")
    return {(k.split("/")[-2] if k.count("/") > 1 else k): round(v, 3) for k, v in metrics.items() if k in keys}


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    else:
        out[prefix[:-1]] = d
    return out


class Trackers:
    """The run's trackers (``trainer.logger``, kind ``tracker``) as one: every call goes to each.

    :meth:`open` builds them (on the main process only; the others keep an empty group) and logs
    the flattened, resolved config as params; :meth:`close` maps the run status ``finished`` /
    ``interrupted`` / anything else to ``FINISHED`` / ``KILLED`` / ``FAILED`` and ignores errors,
    so no MLflow run is left ``RUNNING``. If building one fails, those already open are closed.
    """

    def __init__(self) -> None:
        self.items: list[Any] = []

    def open(self, cfg: Any, registry: Any, *, model_path: str, is_main: bool) -> None:
        if not is_main:
            return
        from omegaconf import OmegaConf

        try:
            for name in cfg.trainer.logger:
                self.items.append(registry.get("tracker", name)(cfg))
        except BaseException:
            self.close("failed")
            raise
        flat = _flatten(OmegaConf.to_container(cfg, resolve=True))
        flat["model.resolved_path"] = str(model_path)
        self.log_params(flat)

    def log_params(self, params: dict[str, Any]) -> None:
        for t in self.items:
            t.log_params(params)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for t in self.items:
            t.log_metrics(metrics, step)

    def log_table(self, name: str, rows: list[dict], step: int) -> None:
        for t in self.items:
            t.log_table(name, rows, step)

    def close(self, status: str) -> None:
        label = {"finished": "FINISHED", "interrupted": "KILLED"}.get(status, "FAILED")
        for t in self.items:
            with contextlib.suppress(Exception):
                t.close(status=label)
