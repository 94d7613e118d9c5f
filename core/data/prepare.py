"""Prepare train/test parquet files in verl's row schema from reasoning-gym tasks (offline).

``rlplug data prepare TASK --out DIR`` calls :func:`prepare_dataset`. Each row::

    data_source   str                               the task name, e.g. "basic_arithmetic"
    prompt        list<struct{role, content}>       one user message: question + answer-format instruction
    ability       str                               "math"
    reward_model  struct{style: "rule", ground_truth: str}
    extra_info    struct{split: str, index: int64, question: str, answer: str,
                         rg_task: str, rg_metadata: str (JSON), rg_config: str (JSON)}

``extra_info.question``/``answer`` are reasoning-gym's own question and answer, and
``rg_task``/``rg_metadata``/``rg_config`` are what the ``reasoning_gym`` reward needs to rebuild
the task's entry and call the task's own ``score_answer``.

Ground truth: the task's answer string for the numeric tasks (scored by ``gsm8k`` after
``####``); for ``countdown`` a JSON object ``{"numbers": [...], "target": N}`` (scored by
``reasoning_gym``, which can rebuild the entry from it alone).

Train/test separation: reasoning-gym draws item ``i`` from ``Random(seed + i)``, so the train
split uses seed ``seed * 1_000_003 + 1`` and the test split a seed 10**9 above it; then every
train item whose question text also occurs in the test split is dropped and replaced by the next
item, until ``train_size`` rows are collected (the number dropped is reported as
``overlap_removed``). Duplicates *within* a split are kept (easy tasks have few distinct
questions: that is their distribution); ``*_unique`` in the result counts distinct questions.

Task defaults (rlplug's, merged under ``task_kwargs``; any generator field can be overridden):

==================  =======================================================================
basic_arithmetic    2 terms, 1-2 digits (each operand in 0..10 or 0..100), ``+``/``-`` only, no
                    parentheses/negation: "Calculate 37 - 5." (easy; a 135M model gets ~16%
                    zero-shot on 2-digit addition). Harder: ``max_terms=3..6``,
                    ``max_digits=3..4``, ``operators=['+','-','*','/']``,
                    ``allow_parentheses=true``, ``allow_negation=true`` (reasoning-gym's own
                    defaults are 2-6 terms, 1-4 digits, all four operators, parentheses).
chain_sum           2-4 terms, 1-2 digits, ``+``/``-`` (reasoning-gym: 2-6 terms, 1-4 digits).
countdown           3-4 numbers in 1..25, target 10..100 (reasoning-gym: 4-6 numbers in
                    1..100, target 100..999).
gsm_symbolic        GSM8K-style word problems (85 templates); only ``difficulty=1.0`` exists.
calc_arith          not reasoning-gym: multi-digit integer arithmetic for the ``calculator`` tool
                    (:mod:`rlplug.data.calc_arith`, its settings and defaults there).
==================  =======================================================================
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from rlplug.config.schema import default_cache_dir
from rlplug.data import calc_arith

__all__ = [
    "TASKS",
    "TASK_DEFAULTS",
    "GSM8K_INSTRUCTION",
    "DATA_FORMAT_VERSION",
    "prepare_dataset",
    "prepared_data_files",
    "build_rows",
    "parquet_schema",
]

logger = logging.getLogger("rlplug.data.dataset")

#: verl's GSM8K instruction (examples/data_preprocess/gsm8k.py), appended after the question.
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
COUNTDOWN_INSTRUCTION = (
    'Use + - * / and parentheses. Think step by step, then output the final expression (no "=") after "####".'
)

#: rlplug's default generator kwargs per task (see the module docstring for difficulty levels).
TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "basic_arithmetic": {
        "min_terms": 2,
        "max_terms": 2,
        "min_digits": 1,
        "max_digits": 2,
        "operators": ["+", "-"],
        "allow_parentheses": False,
        "allow_negation": False,
        "format_style": "simple",
        "whitespace": "single",
    },
    "chain_sum": {"min_terms": 2, "max_terms": 4, "min_digits": 1, "max_digits": 2},
    "countdown": {
        "min_numbers": 3,
        "max_numbers": 4,
        "min_value": 1,
        "max_value": 25,
        "min_target": 10,
        "max_target": 100,
    },
    "gsm_symbolic": {},
}

#: Task names :func:`prepare_dataset` accepts.
TASKS: tuple[str, ...] = tuple(sorted(TASK_DEFAULTS))

_INSTRUCTIONS = {
    "basic_arithmetic": GSM8K_INSTRUCTION,
    "chain_sum": GSM8K_INSTRUCTION,
    "gsm_symbolic": GSM8K_INSTRUCTION,
    "countdown": COUNTDOWN_INSTRUCTION,
    calc_arith.TASK: calc_arith.INSTRUCTION,
}

#: bump when this module changes how prompts or ground truths are written: part of the cache key of
#: :func:`prepared_data_files`, so files written by an older version are never reused
DATA_FORMAT_VERSION = 1

_SEED_STRIDE = 1_000_003
_TEST_OFFSET = 10**9
#: items drawn per requested row at most (a task with few distinct questions stops early)
_MAX_DRAW_FACTOR = 5


def parquet_schema():
    """The pyarrow schema of the files :func:`prepare_dataset` writes (verl's row schema)."""
    import pyarrow as pa  # deferred: pyarrow

    return pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
            (
                "extra_info",
                pa.struct(
                    [
                        ("split", pa.string()),
                        ("index", pa.int64()),
                        ("question", pa.string()),
                        ("answer", pa.string()),
                        ("rg_task", pa.string()),
                        ("rg_metadata", pa.string()),
                        ("rg_config", pa.string()),
                    ]
                ),
            ),
        ]
    )


def _unknown_task(task: str) -> ValueError:

    choices = (*TASKS, calc_arith.TASK)
    close = difflib.get_close_matches(str(task), choices, n=2, cutoff=0.5)
    hint = (" Did you mean " + " or ".join(f"'{c}'" for c in close) + "?") if close else ""
    return ValueError(
        f"Unknown task '{task}'.{hint} Available tasks: {', '.join(choices)}. "
        "For other data, write parquet files in verl's schema and pass them as data.train_files/data.val_files."
    )


def _task_kwargs(task: str, task_kwargs: dict | None) -> dict[str, Any]:
    kwargs = dict(calc_arith.DEFAULTS if task == calc_arith.TASK else TASK_DEFAULTS[task])
    for key, value in dict(task_kwargs or {}).items():
        if key in ("seed", "size"):
            raise ValueError(
                f"task_kwargs may not set '{key}': prepare_dataset chooses it (use the seed/train_size/test_size "
                "arguments instead)."
            )
        kwargs[key] = list(value) if isinstance(value, tuple) else value
    return kwargs


def _make_generator(task: str, kwargs: dict[str, Any], seed: int, size: int):
    if task == calc_arith.TASK:  # rlplug's own generator, indexable like reasoning-gym's
        return calc_arith.CalcArithDataset(kwargs, seed, size)
    import reasoning_gym  # deferred: reasoning_gym
    from reasoning_gym.factory import DATASETS  # deferred: reasoning_gym

    config_cls = DATASETS[task][1]
    valid = [f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")]
    unknown = sorted(set(kwargs) - set(valid))
    if unknown:
        raise ValueError(
            f"Unknown task_kwargs for task '{task}': {', '.join(unknown)}. Valid keys: {', '.join(valid)}."
        )
    call_kwargs = {k: (tuple(v) if isinstance(v, list) else v) for k, v in kwargs.items()}
    try:
        return reasoning_gym.create_dataset(task, seed=seed, size=size, **call_kwargs)
    except (AssertionError, ValueError, TypeError) as exc:
        raise ValueError(
            f"Invalid task_kwargs for task '{task}' {kwargs}: {str(exc).rstrip('.') or type(exc).__name__}. Valid keys: {', '.join(valid)}."
        ) from exc


def _prompt_text(task: str, question: str, instruction: str | None) -> str:
    if task == "countdown":
        # drop reasoning-gym's "no other text" instructions, which contradict the #### format
        question = question.split("\n\nFinal answer format instructions")[0].strip()
    instr = _INSTRUCTIONS[task] if instruction is None else instruction
    return f"{question.strip()} {instr}".strip() if instr else question.strip()


def _ground_truth(task: str, item: dict) -> str:
    if task == "countdown":
        meta = item["metadata"]
        return json.dumps({"numbers": list(meta["numbers"]), "target": meta["target"]})
    return str(item["answer"])


def build_rows(task: str, items: list[dict], split: str, config: dict, instruction: str | None = None) -> list[dict]:
    """Turn reasoning-gym items (``{"question", "answer", "metadata"}``) into verl-schema rows."""
    rows = []
    config_json = json.dumps(config, sort_keys=True, default=str)
    for index, item in enumerate(items):
        rows.append(
            {
                "data_source": task,
                "prompt": calc_arith.prompt_messages(item["question"], instruction)
                if task == calc_arith.TASK
                else [{"role": "user", "content": _prompt_text(task, item["question"], instruction)}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": _ground_truth(task, item)},
                "extra_info": {
                    "split": split,
                    "index": index,
                    "question": item["question"],
                    "answer": str(item["answer"]),
                    "rg_task": task,
                    "rg_metadata": json.dumps(item.get("metadata", {}), default=str),
                    "rg_config": config_json,
                },
            }
        )
    return rows


def _draw(task: str, kwargs: dict, seed: int, wanted: int, exclude: set[str]) -> tuple[list[dict], int, int]:
    """Draw items ``0, 1, ...`` from ``seed`` skipping questions in ``exclude``.

    Returns ``(items, skipped, drawn)``; stops at ``wanted`` items or after
    ``_MAX_DRAW_FACTOR * wanted + 100`` draws.
    """
    cap = _MAX_DRAW_FACTOR * wanted + 100
    gen = _make_generator(task, kwargs, seed, cap)
    items: list[dict] = []
    skipped = 0
    drawn = 0
    while len(items) < wanted and drawn < cap:
        try:
            item = gen[drawn]
        except Exception as exc:  # e.g. countdown cannot reach a target range
            raise ValueError(
                f"reasoning-gym task '{task}' failed to generate item {drawn} with settings {kwargs}: "
                f"{type(exc).__name__}: {str(exc).rstrip('.')}. Check task_kwargs (ranges may be impossible to satisfy)."
            ) from exc
        drawn += 1
        if item["question"] in exclude:
            skipped += 1
            continue
        items.append(item)
    return items, skipped, drawn


def _write(rows: list[dict], path: Path) -> None:
    import pyarrow as pa  # deferred: pyarrow
    import pyarrow.parquet as pq  # deferred: pyarrow

    table = pa.Table.from_pylist(rows, schema=parquet_schema())
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def prepare_dataset(
    task: str,
    out_dir: str | Path,
    train_size: int = 2000,
    test_size: int = 200,
    seed: int = 0,
    task_kwargs: dict | None = None,
    *,
    instruction: str | None = None,
) -> dict:
    """Generate ``train.parquet`` and ``test.parquet`` for a reasoning-gym task, offline.

    Args:
        task: one of :data:`TASKS`.
        out_dir: folder to write into (created); existing files are replaced atomically.
        train_size / test_size: rows wanted per split (>= 1). The train split can come out
            smaller only when the task has too few distinct questions outside the test split.
        seed: data seed; the splits use seeds ``seed * 1_000_003 + 1`` and that plus ``10**9``.
        task_kwargs: generator settings merged over :data:`TASK_DEFAULTS` (``seed``/``size`` not allowed).
        instruction: answer-format sentence appended to each question (None: the task's default,
            verl's GSM8K instruction for numeric tasks).

    Returns:
        ``{"task", "train_path", "test_path", "train_size", "test_size", "overlap_removed",
        "train_unique", "test_unique", "task_kwargs", "seeds", "instruction"}`` (absolute paths as
        str); also written to ``out_dir/info.json`` (there with paths relative to ``out_dir``).

    Raises:
        ValueError: unknown task (lists the available ones), bad sizes, or invalid ``task_kwargs``
            (lists the valid keys).
    """
    if task not in TASK_DEFAULTS and task != calc_arith.TASK:
        raise _unknown_task(task)
    for name, value in (("train_size", train_size), ("test_size", test_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}.")
    kwargs = _task_kwargs(task, task_kwargs)
    train_seed = seed * _SEED_STRIDE + 1
    test_seed = train_seed + _TEST_OFFSET

    test_items, _, _ = _draw(task, kwargs, test_seed, test_size, set())
    test_questions = {it["question"] for it in test_items}
    train_items, removed, drawn = _draw(task, kwargs, train_seed, train_size, test_questions)
    if not train_items:
        raise ValueError(
            f"Task '{task}' with task_kwargs {kwargs} produced no train question outside the test split "
            f"({drawn} drawn): the settings allow too few distinct questions; make the task larger "
            "(e.g. more digits or terms) or the test split smaller."
        )
    if len(train_items) < train_size:
        logger.warning(
            "task %s: only %d of %d train rows outside the test split after %d draws (few distinct questions)",
            task,
            len(train_items),
            train_size,
            drawn,
        )
    if removed:
        logger.info("task %s: removed %d train items whose question is in the test split", task, removed)

    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    train_path, test_path = out / "train.parquet", out / "test.parquet"
    _write(build_rows(task, train_items, "train", kwargs, instruction), train_path)
    _write(build_rows(task, test_items, "test", kwargs, instruction), test_path)
    info = {
        "task": task,
        "train_path": str(train_path),
        "test_path": str(test_path),
        "train_size": len(train_items),
        "test_size": len(test_items),
        "overlap_removed": removed,
        "train_unique": len({it["question"] for it in train_items}),
        "test_unique": len(test_questions),
        "task_kwargs": kwargs,
        "seeds": {"seed": seed, "train": train_seed, "test": test_seed},
        "instruction": instruction,
    }
    # file names relative to out_dir, so the folder can be moved (e.g. renamed into a cache)
    stored = {**info, "train_path": train_path.name, "test_path": test_path.name}
    (out / "info.json").write_text(json.dumps(stored, indent=2, default=str) + "\n")
    return info


def prepared_data_files(cfg: Any) -> tuple[list[str], list[str]]:
    """The run's train and validation parquet files: ``data.train_files`` / ``data.val_files`` (``~``
    expanded), or a cached preparation of ``data.task``.

    The cache lives in ``<cache dir>/data/<task>-<key>/{train,test}.parquet``
    (:func:`rlplug.config.schema.default_cache_dir`), where ``key`` hashes everything that shapes the
    files: the task, sizes, seed, ``data.task_kwargs``, ``data.instruction``, rlplug's
    :data:`TASK_DEFAULTS` for the task and :data:`DATA_FORMAT_VERSION`, so a change to any of them
    never silently reuses stale data. A missing preparation is written to a temporary folder and
    renamed into place (concurrent runs: the first rename wins, the others use its files). The
    validation files default to the prepared test split.
    """

    d = cfg.data
    if d.train_files:
        return [str(Path(f).expanduser()) for f in d.train_files], [
            str(Path(f).expanduser()) for f in (d.val_files or [])
        ]
    spec = {
        "task": d.task,
        "train": d.train_size,
        "test": d.test_size,
        "seed": d.data_seed,
        "kwargs": OmegaConf.to_container(d.task_kwargs, resolve=True),
        "instruction": d.instruction,
        "defaults": TASK_DEFAULTS.get(d.task),
        "format": DATA_FORMAT_VERSION,
    }
    if d.task == calc_arith.TASK:
        spec.update(defaults=calc_arith.DEFAULTS, calc_arith_format=calc_arith.FORMAT_VERSION)
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
    out = default_cache_dir() / "data" / f"{d.task}-{key}"
    train, test = out / "train.parquet", out / "test.parquet"
    if not (train.is_file() and test.is_file()):
        tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
        prepare_dataset(
            d.task,
            tmp,
            train_size=d.train_size,
            test_size=d.test_size,
            seed=d.data_seed,
            task_kwargs=spec["kwargs"] or None,
            instruction=d.instruction,
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(tmp, out)
        except OSError:  # another process won the race; use its files
            shutil.rmtree(tmp, ignore_errors=True)
    val = [str(Path(f).expanduser()) for f in d.val_files] if d.val_files else [str(test)]
    return [str(train)], val
