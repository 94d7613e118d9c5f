"""Step metrics, named as verl names them.

:func:`stage` times one stage of the training step into ``timing_s/<name>``; :func:`step_metrics`
computes the per-step statistics of the batch (``critic/score/mean``, ``critic/advantages/max``,
``response_length/clip_ratio``, ...) and :func:`throughput_metrics` the step time and token rates
(``timing_s/step``, ``perf/throughput``, ...). The trainer merges them with the backends'
``actor/*`` / ``critic/*`` metrics and logs the result once per step.

:func:`validation_metrics` names the scored validation responses (``val-core/<data_source>/acc/mean@N``
when the reward reports an accuracy, else ``val-core/<data_source>/reward/mean@N``); the trainer's
validation and ``rlplug eval`` both use it. :class:`Trackers` is the run's group of trackers;
:func:`tracker_name` is the one mapping of names to the characters a tracker accepts (``@`` ->
``_at_``) and :func:`source_tags` the rlplug version and git commit trackers record.

All values are Python floats. Statistics over ``(B, T)`` tensors count valid response tokens only
(``response_mask``); ``/mean``, ``/max`` and ``/min`` are left out when nothing is valid.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import re
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

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
    "ScoredResponse",
    "core_metric",
    "validation_metrics",
    "validation_samples",
    "train_generation_samples",
    "tracker_name",
    "TRACKER_NAME_CHARS",
    "source_tags",
    "Trackers",
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
    scored: torch.Tensor | None = None,
) -> dict[str, float]:
    """The batch statistics of one training step (verl's names).

    ``batch`` holds ``response_mask``, ``token_level_rewards``, ``advantages`` and ``returns``
    ``(B, T) float32`` (and ``values`` with ``use_critic``); ``scores`` are the ``B`` sequence
    scores; ``components`` the reward's named values per response (``RewardManager.score``'s
    ``extra``: lists of ``B`` floats, NaN or ``None`` where a response's reward did not report the
    name); ``rollout`` and ``prompt_ids`` the step's generation and its prompts (token ids);
    ``scored`` ``(B,) bool`` the responses whose reward succeeded (None: all): the score, reward,
    advantage, return, value and reward-component statistics count those only, the length and
    throughput statistics every response.

    Returns ``critic/score/*`` (sequence scores), ``critic/rewards/*`` (summed token-level rewards,
    after the in-reward KL), ``critic/advantages/*`` and ``critic/returns/*`` (valid tokens),
    with a critic ``critic/values/*``, ``critic/vf_explained_var`` (``1 - Var(returns - values)
    / Var(returns)`` over valid tokens, as verl) and ``critic/value_r2`` (``1 - SS_res / SS_tot`` =
    ``1 - mean((returns - values)^2) / Var(returns)`` over valid tokens, +1e-8 in the denominator;
    not in verl), ``critic/<name>/mean`` per reward component
    (the mean of the finite values, in float64), ``response_length/*`` (tokens),
    ``response_length/clip_ratio`` (share of responses cut at ``max_tokens``),
    ``response_length/empty`` (count of empty responses) and ``prompt_length/*`` (tokens).
    """
    import numpy as np
    import torch

    from .reward import FAILED

    full_mask = batch["response_mask"]
    keep = torch.ones(full_mask.shape[0], dtype=torch.bool) if scored is None else scored.bool().cpu()
    mask = full_mask * keep.to(full_mask.device, full_mask.dtype).unsqueeze(-1)
    advantages, returns = batch["advantages"], batch["returns"]
    out: dict[str, float] = {}
    out.update(stats("critic/score", torch.tensor(list(scores), dtype=torch.float32)[keep]))
    out.update(stats("critic/rewards", (batch["token_level_rewards"] * mask).sum(-1)[keep.to(mask.device)]))
    out.update(stats("critic/advantages", advantages, mask))
    out.update(stats("critic/returns", returns, mask))
    if use_critic:
        out.update(stats("critic/values", batch["values"], mask))
        valid = mask.bool()
        if bool(valid.any()):
            ret, val = returns[valid], batch["values"][valid]
            var_r = ret.var(unbiased=False)
            out["critic/vf_explained_var"] = (1.0 - (ret - val).var(unbiased=False) / (var_r + 1e-8)).item()
            # R^2 = 1 - SS_res / SS_tot (both divided by the token count): unlike the explained variance
            # it also counts a constant offset of the values
            out["critic/value_r2"] = (1.0 - ((ret - val) ** 2).mean() / (var_r + 1e-8)).item()
    kept = keep.tolist()
    for name, values in components.items():
        pool = values if name == FAILED else [v for v, k in zip(values, kept) if k]  # the failure rate: all rows
        finite = [v for v in pool if v is not None and not math.isnan(v)]
        if finite:
            out[f"critic/{name}/mean"] = float(np.mean(finite))
    # from the attention mask, as verl does: rollout correction's rejection (rollout_rs) zeroes
    # response_mask tokens, which must not shorten the reported lengths
    attention = batch["attention_mask"][:, -full_mask.shape[1] :] if "attention_mask" in batch else full_mask
    out.update(stats("response_length", attention.sum(-1)))
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


class ScoredResponse(NamedTuple):
    """One scored validation response (built by :func:`rlplug.evaluate.score_responses`)."""

    #: the prompt's dataset row (``data_source``, ``messages``, ``ground_truth`` ...)
    row: Mapping[str, Any]
    #: the prompt's position among the scored prompts: the ``n`` responses to one prompt share it
    prompt: int
    #: the decoded response text
    response: str
    #: the sequence score: correctness + weighted shaping (``RewardManager.score``'s ``scores``)
    score: float
    #: ``RewardManager.score``'s ``extra["acc"]``: the reward's ``acc``, else its correctness score; 0.0 on failure
    acc: float
    #: whether the correctness function reported an accuracy (an ``acc`` key, or ``fn.binary = True``)
    acc_reported: bool
    #: the other numbers the correctness function reported (``format``, ``correct_unformatted`` ...)
    components: Mapping[str, float] = {}


def core_metric(scored: Sequence[ScoredResponse]) -> str:
    """The name of the headline validation metric of one data source's responses: ``"acc"`` when any of
    their reward functions reported an accuracy (returned an ``acc`` key, or is declared binary with
    ``fn.binary = True``), else ``"reward"`` (the sequence score), as verl chooses (``ray_trainer._validate``:
    ``core_var = "acc" if "acc" in var2metric2val else "reward"``)."""
    return "acc" if any(s.acc_reported for s in scored) else "reward"


def validation_metrics(scored: Sequence[ScoredResponse], n: int) -> dict[str, float]:
    """The validation metrics of the scored responses, per data source (sorted); ``rlplug eval`` prints
    the same numbers (one definition, one code path: :func:`rlplug.evaluate.score_responses` then this).

    For each data source, with ``<m>`` = :func:`core_metric` (``acc`` or ``reward``) and ``n`` the
    responses per prompt:

    * ``val-core/<data_source>/<m>/mean@<n>``: the mean over prompts of the mean over each prompt's
      responses (verl's ``mean@N``; with ``n`` responses per prompt, the mean over all responses);
    * ``val-core/<data_source>/<m>/best@<n>`` (``n > 1``): the mean over prompts of the best of each
      prompt's ``n`` values; for a 0/1 ``acc`` this is pass@n. verl's ``best@N/mean`` estimates the
      same quantity by bootstrap resampling; rlplug reports the exact maximum over the ``n`` responses;
    * when ``<m>`` is ``acc``, the score too: ``val-aux/<data_source>/reward/mean@<n>`` (and ``best@<n>``);
    * ``val-aux/<data_source>/<name>/mean@<n>`` for every other number the reward reported
      (:attr:`ScoredResponse.components`, e.g. gsm8k's ``format``), over the responses that report it.

    ``acc`` values are the reward's ``acc`` (:attr:`ScoredResponse.acc`; a response whose reward failed
    counts 0.0); ``reward`` values are the sequence scores. Returns ``{}`` for no responses.
    """
    import numpy as np

    metrics: dict[str, float] = {}
    for src in sorted({s.row["data_source"] for s in scored}):
        mine = [s for s in scored if s.row["data_source"] == src]
        core = core_metric(mine)
        for var in (core,) if core == "reward" else ("acc", "reward"):
            per_prompt: dict[int, list[float]] = {}
            for s in mine:
                per_prompt.setdefault(s.prompt, []).append(float(s.acc if var == "acc" else s.score))
            name = f"{'val-core' if var == core else 'val-aux'}/{src}/{var}"
            metrics[f"{name}/mean@{n}"] = float(np.mean([np.mean(v) for v in per_prompt.values()]))
            if n > 1:
                metrics[f"{name}/best@{n}"] = float(np.mean([max(v) for v in per_prompt.values()]))
        for comp in sorted({k for s in mine for k in s.components}):
            values = [s.components[comp] for s in mine if comp in s.components and math.isfinite(s.components[comp])]
            if values:
                metrics[f"val-aux/{src}/{comp}/mean@{n}"] = float(np.mean(values))
    return metrics


def validation_samples(scored: Sequence[ScoredResponse]) -> list[dict[str, Any]]:
    """The scored validation responses as the rows trackers log: ``data_source``, ``prompt`` (the last
    message's text), ``response``, ``ground_truth`` and ``score``."""
    return [
        {
            "data_source": s.row["data_source"],
            "prompt": s.row["messages"][-1]["content"],
            "response": s.response,
            "ground_truth": str(s.row["ground_truth"]),
            "score": s.score,
        }
        for s in scored
    ]


def train_generation_samples(
    rows: Sequence[Mapping[str, Any]],
    rollout: RolloutOutput,
    scores: Sequence[float],
    batch: Batch,
    tokenizer: Any,
    k: int,
) -> list[dict[str, Any]]:
    """The first ``k`` responses of a training step as the rows trackers log (``trainer.log_train_generations``).

    ``rows`` are the step's prompt rows, ``rollout`` its generation (``prompt_index`` maps each of the
    ``B`` responses to its row; prompt-major, so with ``rollout.n > 1`` whole groups come first),
    ``scores`` the ``B`` sequence scores, ``batch`` holds ``advantages`` and ``response_mask`` ``(B, T)
    float32``. Each row: ``data_source``, ``prompt`` (the last message's text), ``response`` (decoded with
    ``tokenizer``, special tokens removed), ``ground_truth``, ``score`` and ``advantage`` (the mean of the
    response's token advantages: the advantage itself for outcome-reward estimators such as GRPO; 0.0 for
    an empty response).
    """
    k = max(0, min(int(k), len(rollout.response_ids)))
    if k == 0:
        return []
    mask = batch["response_mask"][:k].float()
    adv = (batch["advantages"][:k].float() * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    texts = tokenizer.batch_decode(rollout.response_ids[:k], skip_special_tokens=True)
    out = []
    for j in range(k):
        row = rows[rollout.prompt_index[j]]
        out.append(
            {
                "data_source": row["data_source"],
                "prompt": row["messages"][-1]["content"],
                "response": texts[j],
                "ground_truth": str(row["ground_truth"]),
                "score": float(scores[j]),
                "advantage": float(adv[j]),
            }
        )
    return out


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


#: The characters :func:`tracker_name` keeps by default (a regex character-class body): letters, digits,
#: ``_ - . / :`` and space, the set MLflow accepts in metric and param names.
TRACKER_NAME_CHARS = r"\w.\- :/"
#: Characters with a spelled-out replacement, applied before any other mapping.
_NAME_REPLACEMENTS = {"@": "_at_"}


@functools.lru_cache(maxsize=16)
def _bad_chars(allowed: str) -> re.Pattern[str]:
    return re.compile(f"[^{allowed}]")


def tracker_name(name: str, *, allowed: str = TRACKER_NAME_CHARS, max_length: int | None = 250) -> str:
    """A metric or param name in the characters a tracker accepts: the one mapping every tracker uses.

    1. ``@`` becomes ``_at_`` (verl's ``mean@N``: ``val-core/gsm8k/acc/mean@8`` ->
       ``val-core/gsm8k/acc/mean_at_8``);
    2. every other character outside ``allowed`` (a regex character-class body, default
       :data:`TRACKER_NAME_CHARS`) becomes ``_``;
    3. when ``/`` is allowed, names are paths: empty and ``.`` segments are dropped and ``..`` becomes
       ``__`` (MLflow rejects them);
    4. a result longer than ``max_length`` characters (None: no limit) is cut and ends in ``-`` and 8 hex
       digits of the SHA-1 of the original name, so long names stay distinct.

    An empty result is ``_``. A tracker that accepts every character (``console``) logs names
    unchanged; one with a stricter set passes its own ``allowed`` (e.g. ``"A-Za-z0-9_:"`` for
    Prometheus: ``actor/pg_loss`` -> ``actor_pg_loss``), so the same name maps the same way everywhere.
    """
    clean = str(name)
    for char, replacement in _NAME_REPLACEMENTS.items():
        clean = clean.replace(char, replacement)
    clean = _bad_chars(allowed).sub("_", clean)
    if "/" in clean:  # "/" survived: the tracker takes path-like names
        clean = "/".join(("__" if p == ".." else p) for p in clean.split("/") if p not in ("", "."))
    clean = clean or "_"
    if max_length is not None and len(clean) > max_length:
        digest = hashlib.sha1(str(name).encode()).hexdigest()[:8]
        clean = clean[: max_length - 9].rstrip("/") + "-" + digest
    return clean


def _git(root: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


@functools.lru_cache(maxsize=1)
def _source_tags() -> tuple[tuple[str, str], ...]:
    from importlib import metadata

    try:
        version = metadata.version("rlplug")
    except metadata.PackageNotFoundError:
        from . import __version__ as version
    tags = {"rlplug.version": version}
    root = Path(__file__).resolve().parent.parent  # the source tree of an editable install (core/ is rlplug)
    top = _git(root, "rev-parse", "--show-toplevel") if (root / ".git").exists() else None
    if top is not None and Path(top).resolve() == root:
        commit = _git(root, "rev-parse", "HEAD")
        if commit:
            tags["rlplug.git_commit"] = commit
            dirty = _git(root, "status", "--porcelain", "--untracked-files=no")
            if dirty is not None:
                tags["rlplug.git_dirty"] = "true" if dirty else "false"
    return tuple(tags.items())


def source_tags() -> dict[str, str]:
    """Which rlplug ran, for trackers to record as tags: ``rlplug.version`` (the installed distribution's
    version) and, when rlplug runs from a git checkout (an editable install), ``rlplug.git_commit`` (the
    ``HEAD`` commit) and ``rlplug.git_dirty`` (``"true"`` when tracked files differ from it). The git keys
    are absent for a wheel install, without ``git``, or when git fails; this never raises. Computed once
    per process."""
    return dict(_source_tags())


class Trackers:
    """The run's trackers (``trainer.logger``, kind ``tracker``) as one: every call goes to each.

    :meth:`open` builds them (on the main process only; the others keep an empty group) and logs
    the flattened, resolved config as params; :meth:`close` maps the run status ``finished`` /
    ``interrupted`` / anything else to ``FINISHED`` / ``KILLED`` / ``FAILED`` and ignores errors,
    so no MLflow run is left ``RUNNING``. If building one fails, those already open are closed.
    :meth:`log_train_generations` logs a few training rollouts every ``trainer.log_train_generations``
    steps and :meth:`log_final_model` records the exported model as a param and a pointer artifact.
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

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        for t in self.items:
            t.log_artifact(path, artifact_path)

    def set_tags(self, tags: dict[str, str]) -> None:
        """Set run tags on the trackers that have the optional ``set_tags`` method (``mlflow``); others skip them."""
        for t in self.items:
            set_tags = getattr(t, "set_tags", None)
            if callable(set_tags):
                set_tags(tags)

    def log_train_generations(
        self,
        step: int,
        trainer_cfg: Any,
        rows: Sequence[Mapping[str, Any]],
        rollout: Any,
        scores: Any,
        batch: Any,
        tok: Any,
    ) -> None:
        """Every ``trainer.log_train_generations`` steps (0: never), log ``trainer.train_samples_to_log``
        responses of training step ``step`` (:func:`train_generation_samples`) as the table
        ``train_generations/step_<step:06d>.json``; nothing on processes without trackers."""
        every = int(trainer_cfg.get("log_train_generations", 0) or 0)
        if not self.items or every <= 0 or step % every:
            return
        k = int(trainer_cfg.get("train_samples_to_log", 4))
        samples = train_generation_samples(rows, rollout, scores, batch, tok, k)
        self.log_table(f"train_generations/step_{step:06d}.json", samples, step)

    def log_final_model(self, path: str | Path, step: int) -> None:
        """Record the exported final model of step ``step``: the param ``final_model_path`` (absolute) and the
        artifact ``final_model.json``, a pointer holding that path, the step and the folder's files with their
        sizes in bytes. The folder itself is not copied into the tracker (a second copy of the weights, 0.5 GB
        for the default model, buys nothing: the run directory keeps it)."""
        if not self.items:
            return
        folder = Path(path).resolve()
        self.log_params({"final_model_path": str(folder)})
        files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
        pointer = {"final_model_path": str(folder), "global_step": int(step), "files": files}
        with tempfile.TemporaryDirectory(prefix="rlplug-final-model-") as tmp:
            file = Path(tmp) / "final_model.json"
            file.write_text(json.dumps(pointer, indent=1))
            self.log_artifact(file)

    def close(self, status: str) -> None:
        label = {"finished": "FINISHED", "interrupted": "KILLED"}.get(status, "FAILED")
        for t in self.items:
            with contextlib.suppress(Exception):
                t.close(status=label)
