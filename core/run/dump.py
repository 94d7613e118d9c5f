"""Rollout dumps (``trainer.dump_rollouts``) and ``rlplug replay``: rewards and advantages again, offline.

With ``trainer.dump_rollouts=true`` every ``trainer.dump_rollouts_freq``-th training step writes its batch
to ``<run dir>/rollouts/step_<NNNNNN>.parquet`` (:func:`dump_rollouts`, pyarrow, one row per response):

====================================  ===================  ==================================================
column                                type                 meaning
====================================  ===================  ==================================================
``step``, ``sample``                  int64                the global step; the response's row in the batch
``index``                             int64                the batch's group id (responses to one prompt share it)
``uid``                               string               ``"<step>-<index>"``: the group id across the run (verl's ``uid``)
``data_source``, ``ground_truth``     string               the reward function's inputs (``reward_model.ground_truth``)
``extra_info``                        string               the row's ``extra_info`` as JSON
``prompt``                            string               the prompt's chat messages as JSON
``prompt_text``, ``prompt_ids``       string, list<int64>  the prompt after the chat template (as generated from)
``response``                          string               the decoded response the reward function scored
``response_ids``, ``response_length`` list<int64>, int64   its tokens (EOS included when generated)
``finish_reason``                     string               ``stop`` or ``length``
``score``                             float64              the reward manager's score (correctness + shaping + overlong)
``token_level_scores_sum``            float32              the row sums of ``token_level_scores`` ...
``token_level_rewards_sum``           float32              ... and of ``token_level_rewards`` (minus the in-reward KL)
``reward_components/<name>``          float32              each named reward value (``correctness``, ``acc``,
                                                           ``shaping/<name>``, ``overlong_reward``, ``reward_failed`` ...)
every other batch tensor              float32 / int64      ``(B,)`` fields as scalars (``reward_baselines``),
                                                           ``(B, T)`` fields as lists of ``T`` values: ``response_mask``
                                                           (after rollout rejection), ``old_log_probs``,
                                                           ``ref_log_probs``, ``rollout_log_probs``, ``values``,
                                                           ``entropy``, ``token_level_scores``, ``token_level_rewards``,
                                                           ``advantages``, ``returns``, ``rollout_is_weights`` ...
====================================  ===================  ==================================================

A multi-turn batch (``rollout.multi_turn.enable``: :attr:`rlplug.contracts.types.RolloutOutput.multi_turn`) is
dumped with dump version 2 and these differences: ``response`` is the last assistant message (the text the
reward functions scored), ``prompt_ids`` / ``prompt_text`` are the prompt the episode started from (an
environment's ``reset`` may rewrite it), and four more columns:

====================================  ===================  ==================================================
``rollout_mask``                      list<int64>          per response token: 1 sampled by the engine, 0 the
                                                           environment's (tool results, template tokens)
``step_rewards``                      string               the environment's rewards as JSON ``[[position, reward], ...]``
                                                           (position: the turn's last sampled token)
``transcript``                        string               the conversation as JSON (``[{"role", "content"}, ...]``,
                                                           the prompt included)
``response_marked``                   string               the whole response decoded with special tokens, each
                                                           environment span in ``⟦`` ``⟧``
                                                           (:func:`rlplug.run.metrics.marked_response`)
====================================  ===================  ==================================================

A single-turn dump is written exactly as before (version 1).

So a dump holds every batch field an advantage estimator may declare in ``requires`` that the run
produced (the prompt-side ``input_ids``/``attention_mask``/``position_ids`` are rebuilt from
``prompt_ids`` and ``response_ids``). The schema metadata holds the step's config (YAML, resolved;
under a schedule the phase's), the dump version and the field layout. Only the main process writes.
Each file is written whole and renamed into place; a resumed run rewrites the steps it trains again, and
its first dump deletes the dumps of every step from there on (superseded by the resumed run).

:func:`replay` (``rlplug replay DUMP [overrides]``) recomputes the rewards and advantages of one dump or a
folder of them with the dumped config plus Hydra-style ``key=value`` overrides (e.g.
``algorithm.adv_estimator=rloo`` or another ``reward.*``), the way the trainer does, with no model and no
generation: :meth:`rlplug.rewards.manager.RewardManager.score` on the dumped responses, the in-reward KL of the
dump (``token_level_scores - token_level_rewards``) subtracted again, the estimator on the scored rows
(:func:`rlplug.contracts.batch.estimate_on_rows`) and ``critic.value_target``. Limits: ``reward.normalize`` starts
from a fresh running mean per dump file, a ReMax baseline (``reward_baselines``) is the dumped one, and
an estimator that needs a field the run did not produce (``values`` of a critic-free run) is refused.
"""

from __future__ import annotations

import json
import math
import os
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from rlplug.config.run_paths import DUMP_DIR  # the folder of the dumps under the run directory
from rlplug.config.schema import ConfigError, RunConfig, TrainerConfig, typed
from rlplug.contracts.registry import PluginError, get_registry
from rlplug.rewards.manager import RewardManager, components_tensor, scored_rows

__all__ = [
    "DUMP_DIR",
    "DUMP_VERSION",
    "DumpError",
    "RolloutDump",
    "ReplayStep",
    "ReplayResult",
    "dump_path",
    "check_dump_config",
    "dump_rollouts",
    "write_dump",
    "read_dump",
    "dump_files",
    "replay_config",
    "replay",
]

#: bumped when the layout changes; :func:`read_dump` refuses newer files. 2: multi-turn columns (a
#: single-turn dump is still written as version 1, its layout unchanged)
DUMP_VERSION = 2
#: batch tensors not dumped: the prompt side is rebuilt from prompt_ids / response_ids
_NOT_DUMPED = ("input_ids", "attention_mask", "position_ids", "responses")
_META = {
    "version": b"rlplug.dump_version",
    "step": b"rlplug.step",
    "config": b"rlplug.config.schema",
    "fields": b"rlplug.fields",
}
#: trainers whose first dump already removed the superseded dumps (a resumed run's later steps)
_STARTED: weakref.WeakSet = weakref.WeakSet()


class DumpError(ValueError):
    """A rollout dump is missing, unreadable, of another version, or lacks what a replay needs."""


def check_dump_config(cfg: Any) -> None:
    """Config-time check of ``trainer.dump_rollouts_freq`` (an int >= 1); raises
    :class:`rlplug.config.schema.ConfigError` otherwise."""
    freq = typed(RunConfig, cfg).trainer.dump_rollouts_freq
    if isinstance(freq, bool) or not isinstance(freq, int) or freq < 1:
        raise ConfigError(
            f"trainer.dump_rollouts_freq={freq!r}: dump every N-th training step, N an integer >= 1 "
            "(1: every step); turn dumps off with trainer.dump_rollouts=false."
        )


def dump_path(run_dir: str | Path, step: int) -> Path:
    """``<run_dir>/rollouts/step_<step:06d>.parquet``."""
    return Path(run_dir) / DUMP_DIR / f"step_{int(step):06d}.parquet"


# ============================================================================ writing


def dump_rollouts(
    trainer: Any,
    step: int,
    rows: Sequence[dict],
    prompt_ids: Sequence[Sequence[int]],
    out: Any,
    batch: Any,
    scores: Any,
) -> Path | None:
    """Write training step ``step``'s batch to :func:`dump_path` when ``trainer.dump_rollouts`` is on and
        ``step`` is a multiple of ``trainer.dump_rollouts_freq`` (main process only); else do nothing.

        ``trainer`` is the :class:`rlplug.run.trainer.Trainer` (its ``cfg``, ``run_dir``, ``is_main``,
        ``tokenizer``); ``rows`` and ``prompt_ids`` the step's prompts; ``out`` its
        :class:`rlplug.contracts.types.RolloutOutput`; ``batch`` the finished :class:`rlplug.contracts.batch.Batch` (advantages
        and returns set); ``scores`` the ``B`` reward-manager scores. Returns the file written, or None. A
    multi-turn ``out`` is dumped with its masks, step rewards and transcripts (the module docstring).
        The first call of a trainer deletes the dumps of ``step`` and later (superseded after a resume).
    """
    settings = typed(TrainerConfig, trainer.cfg.trainer)  # once per step: the one section
    if not settings.dump_rollouts or not trainer.is_main:
        return None
    folder = Path(trainer.run_dir) / DUMP_DIR
    if trainer not in _STARTED:
        _STARTED.add(trainer)
        for old in dump_files(folder, missing_ok=True):
            if _file_step(old) >= step:
                old.unlink(missing_ok=True)
    freq = int(settings.dump_rollouts_freq or 1)
    if step % freq:
        return None
    if out.solutions is not None:  # multi-turn: the last assistant message, the text the reward functions scored
        texts = list(out.solutions)
    else:
        texts = trainer.tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
    prompt_texts = trainer.tokenizer.batch_decode(prompt_ids, skip_special_tokens=False)
    return write_dump(
        dump_path(trainer.run_dir, step),
        step,
        trainer.cfg,
        rows,
        prompt_ids,
        prompt_texts,
        out,
        texts,
        batch,
        scores,
        tokenizer=trainer.tokenizer,
    )


def _row_columns(
    step: int,
    rows: Sequence[dict],
    prompt_ids: Sequence[Sequence[int]],
    prompt_texts: Sequence[str],
    out: Any,
    texts: Sequence[str],
    scores: Sequence[float],
    index: Sequence[int],
) -> dict[str, list]:
    """The per-response columns that are not batch tensors (see the module docstring)."""
    cols: dict[str, list] = {k: [] for k in ("step", "sample", "index", "uid", "data_source", "ground_truth")}
    cols.update({k: [] for k in ("extra_info", "prompt", "prompt_text", "prompt_ids", "response", "response_ids")})
    cols.update({k: [] for k in ("response_length", "finish_reason", "score")})
    for i, p in enumerate(out.prompt_index):
        row = rows[p]
        gt = row.get("ground_truth")
        if gt is None and isinstance(row.get("reward_model"), dict):
            gt = row["reward_model"].get("ground_truth")
        cols["step"].append(int(step))
        cols["sample"].append(i)
        cols["index"].append(int(index[i]))
        cols["uid"].append(f"{int(step)}-{int(index[i])}")
        cols["data_source"].append(str(row.get("data_source", "")))
        cols["ground_truth"].append(None if gt is None else str(gt))
        cols["extra_info"].append(json.dumps(row.get("extra_info") or {}, default=str))
        cols["prompt"].append(json.dumps(row.get("messages", row.get("prompt")), default=str))
        cols["prompt_text"].append(prompt_texts[p])
        cols["prompt_ids"].append([int(t) for t in prompt_ids[p]])
        cols["response"].append(texts[i])
        cols["response_ids"].append([int(t) for t in out.response_ids[i]])
        cols["response_length"].append(len(out.response_ids[i]))
        cols["finish_reason"].append(str(out.finish_reasons[i]))
        cols["score"].append(float(scores[i]))
    return cols


def _multi_turn_columns(out: Any, tokenizer: Any) -> dict[str, list]:
    """The columns of a multi-turn dump (module docstring): ``rollout_mask``, ``step_rewards``,
    ``transcript`` and, with a ``tokenizer``, ``response_marked``."""
    from rlplug.run.metrics import marked_response  # the sample rows' rendering of the environment's spans

    B = len(out.response_ids)
    cols: dict[str, list] = {
        "rollout_mask": [[int(m) for m in mask] for mask in out.response_masks],
        "step_rewards": [
            json.dumps([[int(p), float(r)] for p, r in (out.step_rewards[i] if out.step_rewards is not None else [])])
            for i in range(B)
        ],
        "transcript": [
            json.dumps(out.transcripts[i] if out.transcripts is not None else [], default=str, ensure_ascii=False)
            for i in range(B)
        ],
    }
    if tokenizer is not None:
        cols["response_marked"] = [
            marked_response(out.response_ids[i], out.response_masks[i], tokenizer) for i in range(B)
        ]
    return cols


def write_dump(
    path: str | Path,
    step: int,
    cfg: Any,
    rows: Sequence[dict],
    prompt_ids: Sequence[Sequence[int]],
    prompt_texts: Sequence[str],
    out: Any,
    texts: Sequence[str],
    batch: Any,
    scores: Sequence[float],
    *,
    tokenizer: Any = None,
) -> Path:
    """Write one step's dump to ``path`` (the layout of the module docstring; written to a temporary
    name in the same folder, then renamed, so a reader never sees half a file). ``cfg`` is the step's
    config, stored as resolved YAML in the schema metadata. A multi-turn ``out`` adds its columns
    (``response_marked`` only with a ``tokenizer``) and takes each response's prompt from ``out.prompts``
    when an environment rewrote it. Returns ``path``."""
    import pyarrow as pa  # deferred: pyarrow
    import pyarrow.parquet as pq  # deferred: pyarrow
    import torch  # deferred: torch

    path = Path(path)
    tensors = {k: v.detach().cpu() for k, v in batch.tensors.items() if k not in _NOT_DUMPED}
    cols: dict[str, Any] = _row_columns(
        step, rows, prompt_ids, prompt_texts, out, texts, scores, tensors["index"].tolist()
    )
    multi_turn = bool(getattr(out, "multi_turn", False))
    if multi_turn:
        if out.prompts is not None:  # the prompt each episode started from (reset may rewrite it)
            cols["prompt_ids"] = [[int(t) for t in p] for p in out.prompts]
            if tokenizer is not None:
                cols["prompt_text"] = list(tokenizer.batch_decode(out.prompts, skip_special_tokens=False))
        cols.update(_multi_turn_columns(out, tokenizer))
    mask = tensors["response_mask"]
    for key in ("token_level_scores", "token_level_rewards"):
        if key in tensors:
            cols[f"{key}_sum"] = pa.array((tensors[key] * mask).sum(-1).numpy(), type=pa.float32())
    layout: dict[str, dict[str, Any]] = {}
    for key, t in tensors.items():
        if key == "index":
            continue
        dtype = "int64" if not torch.is_floating_point(t) else "float32"
        arr = t.to(torch.int64 if dtype == "int64" else torch.float32).numpy()
        names = batch.columns.get(key)
        if t.dim() == 1:
            cols[key] = pa.array(arr)
        elif names is not None:  # a named (B, K) field: one column per name
            for j, name in enumerate(names):
                cols[f"{key}/{name}"] = pa.array(arr[:, j])
        else:
            cols[key] = pa.array(list(arr), type=pa.list_(pa.int64() if dtype == "int64" else pa.float32()))
        layout[key] = {"dtype": dtype, "dim": int(t.dim()), "columns": list(names) if names is not None else None}
    config_yaml = OmegaConf.to_yaml(cfg, resolve=True) if OmegaConf.is_config(cfg) else json.dumps(cfg)
    meta = {
        _META["version"]: str(DUMP_VERSION if multi_turn else 1).encode(),
        _META["step"]: str(int(step)).encode(),
        _META["config"]: config_yaml.encode(),
        _META["fields"]: json.dumps(layout).encode(),
    }
    table = pa.table(cols)
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), **meta})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    pq.write_table(table, tmp)
    os.replace(tmp, path)
    return path


# ============================================================================ reading


def _file_step(p: Path) -> int:
    try:
        return int(p.stem.split("_", 1)[1])
    except (IndexError, ValueError):
        return -1


def dump_files(path: str | Path, *, missing_ok: bool = False) -> list[Path]:
    """The dump files of ``path``: the file itself, or a folder's ``step_*.parquet`` in step order (a run
    directory's ``rollouts/`` is looked into). Raises :class:`DumpError` when there is none (unless
    ``missing_ok``)."""
    p = Path(path).expanduser()
    if p.is_dir() and not any(p.glob("step_*.parquet")) and (p / DUMP_DIR).is_dir():
        p = p / DUMP_DIR
    if p.is_file():
        return [p]
    files = sorted((f for f in p.glob("step_*.parquet") if _file_step(f) >= 0), key=_file_step) if p.is_dir() else []
    if not files and not missing_ok:
        raise DumpError(
            f"No rollout dump at {p}: expected a step_NNNNNN.parquet file, or a folder (a run's rollouts/ folder, "
            "or the run directory) holding them. Train with trainer.dump_rollouts=true to write them."
        )
    return files


@dataclass
class RolloutDump:
    """One step's dump read back: ``step``; ``config`` (the step's run config, a ``DictConfig``);
    ``rows`` (one dict per response with ``data_source``, ``ground_truth``, ``extra_info``, ``messages``:
    what :meth:`rlplug.rewards.manager.RewardManager.score` reads); ``responses`` (decoded texts) and
    ``lengths`` (tokens, ``B`` ints); ``scores`` (``B`` dumped scores); ``tensors``: the dumped batch
    fields as they were (``(B,)`` and ``(B, T)`` tensors; ``index`` int64; named fields ``(B, K)``);
    ``columns``: the names of the named fields; ``table``: the pyarrow table. A multi-turn dump also has
    ``masks`` (``B`` lists of 0/1: the rollout's ``response_masks``), ``step_rewards`` (``B`` lists of
    ``(position, reward)``) and ``transcripts`` (``B`` lists of chat messages), and each row's ``extra_info``
    holds ``messages`` and ``step_rewards`` as the reward functions received them; None for single-turn."""

    path: Path
    step: int
    config: Any
    rows: list[dict]
    responses: list[str]
    lengths: list[int]
    scores: list[float]
    tensors: dict[str, Any]
    columns: dict[str, tuple[str, ...]]
    table: Any = field(repr=False, default=None)
    masks: list[list[int]] | None = None
    step_rewards: list[list[tuple[int, float]]] | None = None
    transcripts: list[list[dict]] | None = None

    @property
    def multi_turn(self) -> bool:
        """The dump is of multi-turn trajectories (:attr:`masks` is set)."""
        return self.masks is not None

    def rollout_mask(self) -> Any:
        """``(B, T) float32``: 1.0 on each response's tokens, as the rollout built it (before any rollout
        rejection; :func:`rlplug.contracts.batch.build_batch`); for a multi-turn dump the rollout's
        ``response_masks`` (0.0 on the environment's tokens)."""
        import torch  # deferred: torch

        T = int(self.tensors["response_mask"].shape[1])
        if self.masks is not None:
            mask = torch.zeros((len(self.masks), T), dtype=torch.float32)
            for i, m in enumerate(self.masks):
                mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
            return mask
        pos = torch.arange(T).unsqueeze(0)
        return (pos < torch.tensor(self.lengths).unsqueeze(1)).to(torch.float32)


def read_dump(path: str | Path) -> RolloutDump:
    """Read one dump file written by :func:`write_dump`.

    Raises:
        DumpError: not a readable parquet file, no rlplug dump metadata, or a newer dump version.
    """
    import pyarrow as pa  # deferred: pyarrow
    import pyarrow.parquet as pq  # deferred: pyarrow
    import torch  # deferred: torch

    p = Path(path).expanduser()
    try:
        table = pq.read_table(p)
    except (pa.ArrowException, OSError) as exc:
        raise DumpError(f"{p}: not a readable parquet file ({exc}).") from exc
    meta = table.schema.metadata or {}
    if _META["version"] not in meta:
        raise DumpError(f"{p}: not an rlplug rollout dump (no {_META['version'].decode()} metadata).")
    version = int(meta[_META["version"]])
    if version > DUMP_VERSION:
        raise DumpError(f"{p}: dump version {version}, this rlplug reads up to {DUMP_VERSION}; upgrade rlplug.")
    layout = json.loads(meta[_META["fields"]])
    data = table.to_pydict()
    tensors: dict[str, Any] = {"index": torch.tensor(data["index"], dtype=torch.int64)}
    columns: dict[str, tuple[str, ...]] = {}
    for key, spec in layout.items():
        dtype = torch.int64 if spec["dtype"] == "int64" else torch.float32
        if spec["columns"] is not None:
            names = tuple(spec["columns"])
            cols = [torch.tensor(data[f"{key}/{n}"], dtype=dtype) for n in names]
            tensors[key] = torch.stack(cols, dim=1) if cols else torch.zeros((len(data["index"]), 0), dtype=dtype)
            columns[key] = names
        elif spec["dim"] == 1:
            tensors[key] = torch.tensor(data[key], dtype=dtype)
        else:
            import numpy as np  # deferred: numpy

            tensors[key] = torch.from_numpy(
                np.asarray(data[key], dtype=np.int64 if spec["dtype"] == "int64" else np.float32)
            )
    rows = [
        {
            "data_source": ds,
            "ground_truth": gt,
            "extra_info": json.loads(ei) if ei else {},
            "messages": json.loads(pr) if pr else None,
        }
        for ds, gt, ei, pr in zip(data["data_source"], data["ground_truth"], data["extra_info"], data["prompt"])
    ]
    masks = step_rewards = transcripts = None
    if "rollout_mask" in data:  # a multi-turn dump (version 2)
        masks = [[int(m) for m in mask] for mask in data["rollout_mask"]]
        step_rewards = [[(int(p), float(r)) for p, r in json.loads(sr)] for sr in data["step_rewards"]]
        transcripts = [json.loads(t) for t in data["transcript"]]
        for row, rewards, messages in zip(rows, step_rewards, transcripts):  # as rows_for_scoring hands them on
            row["extra_info"] = {**row["extra_info"], "messages": messages, "step_rewards": [r for _, r in rewards]}
    return RolloutDump(
        path=p,
        step=int(meta[_META["step"]]),
        config=OmegaConf.create(meta[_META["config"]].decode()),
        rows=rows,
        responses=list(data["response"]),
        lengths=[int(n) for n in data["response_length"]],
        scores=[float(s) for s in data["score"]],
        tensors=tensors,
        columns=columns,
        table=table,
        masks=masks,
        step_rewards=step_rewards,
        transcripts=transcripts,
    )


# ============================================================================ replay


def replay_config(config: Any, overrides: Sequence[str]) -> Any:
    """The dumped ``config`` with Hydra-style ``key=value`` overrides applied (Hydra's value grammar:
    ``reward.shaping=[{name:length_penalty,weight:0.5}]``; ``+key=value`` adds a key, ``~key`` deletes
    one), type-checked against the schema (:class:`rlplug.config.schema.RunConfig`).

    Raises:
        rlplug.config.schema.ConfigError: a config-group override (``algorithm=rloo``: a dump has no Hydra
            defaults to re-compose; set the keys, e.g. ``algorithm.adv_estimator=rloo``), an unknown key
            or a bad value.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser  # deferred: hydra

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception as exc:  # hydra.errors.OverrideParseException
        raise ConfigError(f"rlplug replay: cannot parse the overrides {list(overrides)}: {exc}") from exc
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), config)
        _keep_dumped_maps(cfg, config)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"the dumped config does not fit this rlplug's schema: {exc}") from exc
    for ov in parsed:
        key = ov.key_or_group
        if "." not in key and OmegaConf.is_dict(OmegaConf.select(cfg, key)) and not ov.is_delete():
            raise ConfigError(
                f"rlplug replay: '{ov.input_line}' selects a config group; a dump stores the composed config, so "
                f"set its keys instead, e.g. algorithm.adv_estimator=rloo or reward.shaping=[...]."
            )
        try:
            if ov.is_delete():
                parent, _, leaf = key.rpartition(".")
                node = OmegaConf.select(cfg, parent) if parent else cfg
                if not OmegaConf.is_dict(node):
                    raise ConfigError(f"rlplug replay: '{ov.input_line}': {parent or 'the config'} is not a mapping.")
                with open_dict(node):
                    node.pop(leaf)  # type: ignore[union-attr,arg-type]
                continue
            value = ov.value()
            if ov.is_add():
                with open_dict(cfg):
                    OmegaConf.update(cfg, key, value, merge=False, force_add=True)
            else:
                if OmegaConf.select(cfg, key, default="__missing__") == "__missing__":
                    raise ConfigError(
                        f"rlplug replay: unknown key '{key}' in '{ov.input_line}'; the config has no such setting "
                        "(add it with '+' if it is an open map entry)."
                    )
                # a list of mappings into a list of structured entries (reward.shaping=[{name: ...}]) is converted
                # only by a merge; a merged list is replaced as a whole, as the assignment would
                OmegaConf.update(cfg, key, value, merge=isinstance(value, list))
        except OmegaConfBaseException as exc:
            raise ConfigError(f"rlplug replay: '{ov.input_line}': {exc}") from exc
    return cfg


def _keep_dumped_maps(cfg: Any, dumped: Any, prefix: str = "") -> None:
    """Give every open map of ``cfg`` (a schema field typed ``dict``, e.g. ``reward.reward_fn_map``) the dumped
    value as a whole: merging the schema's defaults with the dump would add back the default entries a run had
    removed (a Python-API run empties ``reward.reward_fn_map``). A map the dump lacks (a newer schema) keeps
    its default."""
    for key in list(cfg.keys()) if OmegaConf.is_dict(cfg) else []:
        node, path = OmegaConf.select(cfg, str(key), throw_on_missing=False), f"{prefix}{key}"
        if not OmegaConf.is_dict(node):
            continue
        if OmegaConf.get_type(node) is dict:
            value = OmegaConf.select(dumped, path, default=None)
            if OmegaConf.is_dict(value):
                cfg[key] = OmegaConf.to_container(value, resolve=True)
        else:
            _keep_dumped_maps(node, dumped, f"{path}.")


@dataclass
class ReplayStep:
    """One replayed dump: the step, ``n`` responses, ``scored`` (responses whose reward succeeded),
    ``mean_score`` (over the scored ones), the advantage statistics over valid tokens (``adv_mean``,
    ``adv_std``, ``adv_min``, ``adv_max``), ``same_config`` (the replay's ``reward``, ``algorithm`` and
    ``critic.value_target`` equal the dump's), and the largest absolute differences to the dumped values:
    ``max_abs_diff_score`` (scores), ``max_abs_diff_advantages`` and ``max_abs_diff_returns`` (0.0 means
    reproduced bit for bit)."""

    step: int
    n: int
    scored: int
    mean_score: float
    adv_mean: float
    adv_std: float
    adv_min: float
    adv_max: float
    same_config: bool
    max_abs_diff_score: float
    max_abs_diff_advantages: float
    max_abs_diff_returns: float
    #: per response: the replay's scores (``B`` floats) and advantages / returns (``(B, T) float32``)
    scores: list[float] = field(default_factory=list, repr=False)
    advantages: Any = field(default=None, repr=False)
    returns: Any = field(default=None, repr=False)


@dataclass
class ReplayResult:
    """:func:`replay`'s result: the ``steps`` (one :class:`ReplayStep` per dump file), the estimator used,
    and ``summary``: the same statistics over every response of every file."""

    estimator: str
    steps: list[ReplayStep]
    summary: dict[str, float]


def _same(a: Any, b: Any, key: str) -> bool:

    x, y = OmegaConf.select(a, key), OmegaConf.select(b, key)
    to = lambda v: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v  # noqa: E731
    return to(x) == to(y)


def _max_abs_diff(a: Any, b: Any) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def _replay_one(dump: RolloutDump, overrides: Sequence[str], registry: Any) -> ReplayStep:
    import torch  # deferred: torch

    from rlplug.algorithms.losses import compute_token_level_scores, value_targets  # deferred: torch
    from rlplug.algorithms.reward_norm import ScoreNormalizer  # deferred: torch
    from rlplug.contracts.batch import Batch, estimate_on_rows  # deferred: torch
    from rlplug.orchestration.episodes import token_level_scores  # deferred: torch

    cfg = replay_config(dump.config, overrides)
    name = str(cfg.algorithm.adv_estimator)
    estimator = registry.get("advantage_estimator", name)
    missing = [k for k in getattr(estimator, "requires", ()) if k not in dump.tensors and k != "reward_components"]
    if missing:
        raise DumpError(
            f"{dump.path}: the advantage estimator '{name}' requires {missing}, which the dumped run did not produce "
            f"(dumped fields: {sorted(dump.tensors)}). Replay with an estimator that needs only these, or dump a run "
            f"that produces them (values: a critic, e.g. algorithm=ppo)."
        )
    if bool(cfg.algorithm.use_kl_in_reward) and not bool(dump.config.algorithm.use_kl_in_reward):
        raise DumpError(
            f"{dump.path}: algorithm.use_kl_in_reward=true, but the dumped run had no in-reward KL penalty to "
            "replay (it is taken from the dump: token_level_scores - token_level_rewards). Replay without it."
        )
    mask = dump.rollout_mask()
    batch = Batch({k: v for k, v in dump.tensors.items() if k not in ("reward_components",)})
    batch["response_mask"] = mask
    with RewardManager(cfg.reward, registry=registry) as reward:
        scores, extra, _ = reward.score(dump.rows, dump.responses, lengths=dump.lengths)
    scored = scored_rows(extra, len(scores), batch.get("reward_baselines"))
    seq = ScoreNormalizer(cfg.reward.normalize)(torch.tensor(scores, dtype=torch.float32), scored, batch, {})
    # the score on the last model token, plus a multi-turn dump's step rewards at their positions
    batch["token_level_scores"] = (
        token_level_scores(seq * scored, mask, dump, scored)
        if dump.multi_turn
        else compute_token_level_scores(seq * scored, mask)
    )
    batch.set_columns("reward_components", *components_tensor(extra, len(scores)))
    tlr = batch["token_level_scores"]
    if bool(cfg.algorithm.use_kl_in_reward):  # the dumped step's penalty: scores - rewards (same KL coefficient)
        old_tls, old_tlr = dump.tensors["token_level_scores"], dump.tensors["token_level_rewards"]
        # rows scored as in the dump keep the dumped rewards bit for bit (s - (s - r) may differ from r in float32)
        unchanged = (tlr == old_tls).all(dim=-1, keepdim=True)
        tlr = torch.where(unchanged, old_tlr, tlr - (old_tls - old_tlr))
    batch["token_level_rewards"] = tlr
    batch["advantages"], batch["returns"] = estimate_on_rows(estimator, batch, cfg.algorithm, scored)
    value_targets(batch, cfg)
    adv, ret = batch["advantages"], batch["returns"]
    valid = mask.bool()
    vals = adv[valid]
    same = all(_same(cfg, dump.config, k) for k in ("reward", "algorithm", "critic.value_target"))
    sc = torch.tensor(scores, dtype=torch.float64)
    return ReplayStep(
        step=dump.step,
        n=len(scores),
        scored=int(scored.sum()),
        mean_score=float(sc[scored].mean()) if bool(scored.any()) else math.nan,
        adv_mean=float(vals.mean()) if vals.numel() else 0.0,
        adv_std=float(vals.std(unbiased=False)) if vals.numel() else 0.0,
        adv_min=float(vals.min()) if vals.numel() else 0.0,
        adv_max=float(vals.max()) if vals.numel() else 0.0,
        same_config=same,
        max_abs_diff_score=_max_abs_diff(sc, torch.tensor(dump.scores, dtype=torch.float64)),
        max_abs_diff_advantages=_max_abs_diff(adv, dump.tensors["advantages"])
        if "advantages" in dump.tensors
        else math.nan,
        max_abs_diff_returns=_max_abs_diff(ret, dump.tensors["returns"]) if "returns" in dump.tensors else math.nan,
        scores=list(scores),
        advantages=adv,
        returns=ret,
    )


def replay(
    path: str | Path, overrides: Iterable[str] = (), *, registry: Any = None, out: str | Path | None = None
) -> ReplayResult:
    """Recompute the rewards and advantages of the dump(s) at ``path`` (a file, a folder of them or a run
    directory) with the dumped config plus ``overrides`` (:func:`replay_config`); no model, no generation.
    With ``out``, write one parquet row per response (``step``, ``sample``, ``index``, ``data_source``,
    ``response``, ``score``, ``score_dumped``, ``advantages`` and ``returns`` as lists of ``T`` float32,
    ``advantages_dumped``) there. See the module docstring for what is replayed and the limits.

    Raises:
        DumpError: no dump at ``path``, an unreadable or newer one, or an estimator needing a field the
            dumped run did not produce.
        rlplug.config.schema.ConfigError: a bad override (:func:`replay_config`), an unknown plugin name, or a
            reward config that cannot score the dumped data sources.
    """

    registry = registry or get_registry()
    overrides = list(overrides)
    steps, dumps = [], []
    for f in dump_files(path):
        dump = read_dump(f)
        try:
            steps.append(_replay_one(dump, overrides, registry))
        except PluginError as exc:
            raise ConfigError(str(exc)) from exc
        dumps.append(dump)
    import torch  # deferred: torch

    n = sum(s.n for s in steps)
    scored = sum(s.scored for s in steps)
    valid = [s.advantages[d.rollout_mask().bool()] for d, s in zip(dumps, steps)]
    tokens = torch.cat(valid) if valid else torch.zeros(0)
    summary = {
        "files": float(len(steps)),
        "responses": float(n),
        "scored": float(scored),
        "mean_score": sum(s.mean_score * s.scored for s in steps if s.scored) / scored if scored else math.nan,
        "adv_mean": float(tokens.mean()) if tokens.numel() else 0.0,
        "adv_std": float(tokens.std(unbiased=False)) if tokens.numel() else 0.0,
        "adv_min": float(tokens.min()) if tokens.numel() else 0.0,
        "adv_max": float(tokens.max()) if tokens.numel() else 0.0,
        "max_abs_diff_score": max((s.max_abs_diff_score for s in steps), default=0.0),
        "max_abs_diff_advantages": max((s.max_abs_diff_advantages for s in steps), default=0.0),
        "max_abs_diff_returns": max((s.max_abs_diff_returns for s in steps), default=0.0),
        "same_config": float(all(s.same_config for s in steps)),
    }
    estimator = str(replay_config(dumps[0].config, overrides).algorithm.adv_estimator) if dumps else ""
    if out is not None:
        _write_replay(Path(out), dumps, steps)
    return ReplayResult(estimator=estimator, steps=steps, summary=summary)


def _write_replay(path: Path, dumps: Sequence[RolloutDump], steps: Sequence[ReplayStep]) -> None:
    import pyarrow as pa  # deferred: pyarrow
    import pyarrow.parquet as pq  # deferred: pyarrow

    cols: dict[str, list] = {k: [] for k in ("step", "sample", "index", "data_source", "response")}
    cols.update({k: [] for k in ("score", "score_dumped", "advantages", "returns", "advantages_dumped")})
    for d, s in zip(dumps, steps):
        dumped_adv = d.tensors.get("advantages")
        for i in range(s.n):
            cols["step"].append(s.step)
            cols["sample"].append(i)
            cols["index"].append(int(d.tensors["index"][i]))
            cols["data_source"].append(d.rows[i]["data_source"])
            cols["response"].append(d.responses[i])
            cols["score"].append(float(s.scores[i]))
            cols["score_dumped"].append(d.scores[i])
            cols["advantages"].append(s.advantages[i].tolist())
            cols["returns"].append(s.returns[i].tolist())
            cols["advantages_dumped"].append(None if dumped_adv is None else dumped_adv[i].tolist())
    types = {k: pa.list_(pa.float32()) for k in ("advantages", "returns", "advantages_dumped")}
    table = pa.table({k: pa.array(v, type=types.get(k)) for k, v in cols.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)


def print_replay(result: ReplayResult, console: Any) -> None:
    """Print :func:`replay`'s result with ``console`` (a ``rich.console.Console``): one table row per dump
    file, then the summary; the differences to the dumped values are shown when the config is the dump's
    (otherwise they are expected)."""
    from rich.table import Table  # deferred: rich

    table = Table(title=f"replay ({result.estimator})")
    for col in ("step", "responses", "scored", "mean reward", "adv mean", "adv std", "adv min", "adv max"):
        table.add_column(col)
    table.add_column("max |adv - dumped|")
    for s in result.steps:
        diff = (
            f"{s.max_abs_diff_advantages:.3g}"
            if s.same_config
            else f"({s.max_abs_diff_advantages:.3g}, config differs)"
        )
        table.add_row(
            str(s.step),
            str(s.n),
            str(s.scored),
            f"{s.mean_score:.4f}",
            f"{s.adv_mean:.4f}",
            f"{s.adv_std:.4f}",
            f"{s.adv_min:.4f}",
            f"{s.adv_max:.4f}",
            diff,
        )
    console.print(table)
    m = result.summary
    line = (
        f"{int(m['files'])} file(s), {int(m['responses'])} responses ({int(m['scored'])} scored): "
        f"mean reward {m['mean_score']:.4f}; advantages mean {m['adv_mean']:.4f} std {m['adv_std']:.4f} "
        f"min {m['adv_min']:.4f} max {m['adv_max']:.4f}"
    )
    if m["same_config"]:
        line += (
            f"; same config as the dump: max |adv - dumped| {m['max_abs_diff_advantages']:.3g}, "
            f"max |returns - dumped| {m['max_abs_diff_returns']:.3g}, max |score - dumped| {m['max_abs_diff_score']:.3g}"
        )
    console.print(line, markup=False, highlight=False)
