"""The Python entry points: :func:`train` (for TRL users) and :func:`score_response` (``rlplug reward``).

::

    import rlplug
    from datasets import Dataset

    def brevity(prompts, completions, **columns):          # TRL's reward-function contract
        return [-len(c) / 100 for c in completions]

    ds = Dataset.from_dict({"prompt": ["2 + 3 =", "7 - 4 ="], "answer": ["5", "3"]})
    result = rlplug.train(["algorithm=grpo", "debug=tiny"], train_dataset=ds, reward_funcs=[brevity])
    result.run_dir, result.metrics["critic/score/mean"]

:func:`train` takes the config as Hydra override strings (``["algorithm=grpo", "rollout.n=4"]``, verl's
key names too), as a dict / ``DictConfig`` of values merged onto the default config (``{"rollout": {"n":
4}}``; a dict may hold ``"overrides"``: a list of override strings composed first, for config groups such
as ``debug=tiny``), or as a config composed with :func:`rlplug.config.compose.compose`.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from rlplug.config.compose import compose
from rlplug.config.schema import ConfigError, ShapingConfig
from rlplug.config.verl_keys import override_target
from rlplug.contracts.agents import ToolSchemaError
from rlplug.contracts.registry import get_registry
from rlplug.contracts.reward_contract import RewardContractError, as_reward_function, callable_name, required_columns
from rlplug.data.dataset import DatasetError
from rlplug.orchestration.python_env import TRLEnvironmentFactory, as_tool
from rlplug.rewards.manager import FAILED, RewardManager
from rlplug.run.metrics import read_metrics_jsonl

__all__ = [
    "TrainResult",
    "train",
    "score_response",
    "build_config",
    "dataset_to_parquet",
    "register_reward_funcs",
    "register_tools",
    "register_environment",
    "reward_weights_for",
]

#: the data_source of rows from a dataset without a ``data_source`` column
DEFAULT_DATA_SOURCE = "trl"
#: the distribution name of reward functions registered by :func:`train`
_DIST = "rlplug.train"


@dataclass
class TrainResult:
    """What :func:`train` returns: the run directory, how the run ended (``status``: ``"finished"`` or
    ``"interrupted"``), the last global step, the final model folder (None unless finished), ``metrics``
    (every metric logged at the last step, verl's names: ``critic/score/mean``, ``actor/pg_loss`` ...) and
    ``history`` (the run's ``metrics.jsonl`` records, one dict per logged step)."""

    run_dir: Path
    status: str
    global_step: int
    final_model: Path | None
    metrics: dict[str, float] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)


def build_config(config_or_overrides: Any = None) -> Any:
    """The run config (composed, writable, not yet validated) from what :func:`train` accepts (see the
    module docstring). Raises :class:`rlplug.config.schema.ConfigError` for an unknown key or a bad value, and
    ``TypeError`` for another kind of argument."""

    if config_or_overrides is None:
        config_or_overrides = []
    if isinstance(config_or_overrides, str):
        raise TypeError(f"train() takes a list of override strings, not one string: use [{config_or_overrides!r}].")
    if (
        isinstance(config_or_overrides, DictConfig)
        and "trainer" in config_or_overrides
        and "data" in config_or_overrides
    ):
        cfg = config_or_overrides.copy()  # already composed
        OmegaConf.set_readonly(cfg, False)
        return cfg
    if isinstance(config_or_overrides, (Mapping, DictConfig)):
        values = OmegaConf.to_container(OmegaConf.create(dict(config_or_overrides)), resolve=False)
        assert isinstance(values, dict)
        overrides = values.pop("overrides", []) or []
        cfg = compose([str(o) for o in overrides])
        OmegaConf.set_readonly(cfg, False)
        try:
            merged = OmegaConf.merge(cfg, values)
        except OmegaConfBaseException as exc:
            raise ConfigError(f"train(): the config dict does not fit the schema: {exc}") from exc
        return merged
    if isinstance(config_or_overrides, Sequence):
        cfg = compose([str(o) for o in config_or_overrides])
        OmegaConf.set_readonly(cfg, False)
        return cfg
    raise TypeError(
        f"train() takes a list of override strings, a dict or a DictConfig; got {type(config_or_overrides).__name__}."
    )


def dataset_to_parquet(dataset: Any, path: str | Path) -> Path:
    """Write ``dataset`` (a Hugging Face ``datasets.Dataset``, a list of dicts or a dict of columns, in TRL's
    layout) as a parquet file in verl's row schema (:mod:`rlplug.data.dataset`) at ``path``; returns ``path``.

    Each example needs a ``prompt``: a string or a list of ``{role, content}`` messages (TRL's standard and
    conversational formats). ``data_source`` and ``reward_model`` (``{ground_truth}``) columns are used when
    present (else ``data_source="trl"`` and a ``ground_truth`` column, or ""); ``extra_info`` gets the
    example's ``extra_info`` entries, every other column, and the prompt as it was under ``"prompt"``, so a
    TRL-contract reward function receives the prompts and columns TRL would pass
    (:mod:`rlplug.contracts.reward_contract`).

    Raises:
        rlplug.data.dataset.DatasetError: an empty dataset or an example without a ``prompt``.
    """
    return _write_rows(_verl_rows(dataset), Path(path))


def _verl_rows(dataset: Any, what: str = "the dataset") -> list[dict[str, Any]]:
    """``dataset`` as a list of rows in verl's schema (:func:`dataset_to_parquet`); raises ``DatasetError``
    naming ``what`` (``train_dataset``, ``eval_dataset``)."""

    if isinstance(dataset, Mapping) and all(isinstance(v, list) for v in dataset.values()):  # columns
        dataset = [dict(zip(dataset, values)) for values in zip(*dataset.values())]
    elif hasattr(dataset, "keys") and hasattr(dataset, "values") and not hasattr(dataset, "to_list"):
        raise DatasetError(
            f"train(): got a {type(dataset).__name__} of splits {sorted(dataset.keys())}; pass one split, e.g. "
            "train_dataset=ds['train'], eval_dataset=ds['test']."
        )
    examples = dataset.to_list() if hasattr(dataset, "to_list") else list(dataset)
    if not examples:
        raise DatasetError(
            f"train(): {what} has no rows; give it at least one example with a 'prompt' (an eval_dataset may be "
            "left out instead)."
        )
    rows = []
    for i, ex in enumerate(examples):
        if not isinstance(ex, Mapping) or "prompt" not in ex:
            cols = sorted(ex) if isinstance(ex, Mapping) else type(ex).__name__
            raise DatasetError(
                f"train(): {what} row {i} has no 'prompt' (columns: {cols}); TRL's convention is a 'prompt' column "
                "holding a string or a list of {role, content} messages. Rename the column or add it."
            )
        prompt = ex["prompt"]
        others = {k: v for k, v in ex.items() if k not in ("prompt", "data_source", "reward_model", "extra_info")}
        rm = ex.get("reward_model")
        gt = rm.get("ground_truth") if isinstance(rm, Mapping) else ex.get("ground_truth")
        rows.append(
            {
                "data_source": str(ex.get("data_source") or DEFAULT_DATA_SOURCE),
                "prompt": prompt,
                "reward_model": {"style": "rule", "ground_truth": "" if gt is None else str(gt)},
                "extra_info": {**dict(ex.get("extra_info") or {}), **others, "prompt": prompt},
            }
        )
    return rows


def _write_rows(rows: list[dict[str, Any]], path: Path) -> Path:
    """Write ``rows`` to ``path`` atomically (a temp file, then ``os.replace``); returns ``path``."""
    import pyarrow as pa  # deferred: pyarrow
    import pyarrow.parquet as pq  # deferred: pyarrow

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    os.replace(tmp, path)
    return path


def dataset_file_name(rows: list[dict[str, Any]], stem: str) -> str:
    """The content-addressed file name of ``rows`` (verl-schema rows): ``<stem>-<16 hex>.parquet``, the hex
    digits the start of the sha256 of the rows as canonical JSON (sorted keys; values JSON cannot hold as
    their ``repr``). The same data always gets the same name, different data another one, so
    :func:`train` never overwrites a file an earlier run of the same run dir read, and the run fingerprint
    (which holds ``data.train_files``) changes with the data: resuming with other data is refused."""
    blob = json.dumps(rows, sort_keys=True, default=repr, ensure_ascii=False).encode()
    return f"{stem}-{hashlib.sha256(blob).hexdigest()[:16]}.parquet"


def _data_files(data: Any, folder: Path, stem: str, what: str = "the dataset") -> list[str]:
    """``data`` as ``data.*_files``: path(s) as given, else a dataset written to ``folder`` under its
    content-addressed name (:func:`dataset_file_name`; an existing file of that name already holds it)."""
    if isinstance(data, (str, os.PathLike)):
        return [str(data)]
    if isinstance(data, Sequence) and data and all(isinstance(x, (str, os.PathLike)) for x in data):
        return [str(x) for x in data]
    rows = _verl_rows(data, what)
    path = folder / dataset_file_name(rows, stem)
    return [str(path if path.is_file() else _write_rows(rows, path))]


def register_reward_funcs(reward_funcs: Sequence[Any], registry: Any = None, contract: str = "auto") -> list[str]:
    """Register ``reward_funcs`` (functions, with TRL's or verl's contract, or names of registered reward
    functions) as kind ``reward_function`` and return their names. A function is registered under its
    ``__name__`` (``reward_func_<i>`` for a lambda; ``<name>_<i>`` for the ``i``-th entry when an earlier one
    has its name) with the contract :func:`rlplug.contracts.reward_contract.as_reward_function` finds (or ``contract``);
    a name registered by an earlier :func:`train` call in this process is replaced.

    Raises:
        rlplug.config.schema.ConfigError: the name is taken by an installed plugin (rename the function), or a
            contract cannot be told (:class:`rlplug.contracts.reward_contract.RewardContractError` as the cause).
    """

    registry = registry or get_registry()
    names: list[str] = []
    for i, fn in enumerate(reward_funcs):
        if isinstance(fn, str):
            names.append(fn)
            continue
        try:
            obj = as_reward_function(fn, contract)
        except RewardContractError as exc:
            raise ConfigError(f"train(reward_funcs[{i}]): {exc}") from exc
        name = str(getattr(obj, "name", None) or callable_name(fn))
        if not name.isidentifier():
            name = f"reward_func_{i}"
        if name in names:  # two functions of one name (TRL allows it): each needs its own registry entry
            name = f"{name}_{i}"
        existing = registry.entries["reward_function"].get(name)
        if existing is not None and existing.distribution != _DIST:
            raise ConfigError(
                f"train(): a reward function named '{name}' is already registered by {existing.distribution}; "
                "rename your function (the name selects it in reward.reward_fn_map / reward.shaping)."
            )
        registry.entries["reward_function"].pop(name, None)
        registry.register("reward_function", name, obj, distribution=_DIST)
        names.append(name)
    return names


def _register_runtime(registry: Any, kind: str, name: str, obj: Any, what: str, **extra: Any) -> None:
    """Register ``obj`` as ``name`` in ``kind`` for this process's :func:`train` calls, replacing one an earlier
    call registered; raises :class:`ConfigError` when an installed plugin has the name."""
    existing = registry.entries[kind].get(name)
    if existing is not None and existing.distribution != _DIST:
        raise ConfigError(
            f"train(): a {kind.replace('_', ' ')} named '{name}' is already registered by {existing.distribution}; "
            f"rename your {what}."
        )
    registry.entries[kind].pop(name, None)
    registry.register(kind, name, obj, distribution=_DIST, **extra)


def register_tools(tools: Sequence[Any], registry: Any = None) -> list[str]:
    """Register TRL's ``tools=`` (plain or ``async`` functions with type hints and a docstring, tool objects, or
    names of registered tools) as kind ``tool`` and return their names: a function becomes
    :class:`rlplug.contracts.agents.FunctionTool` (its name, its docstring's summary, its signature's schema).

    Raises:
        rlplug.config.schema.ConfigError: a function that cannot be described as a tool (the cause says which
            parameter), two tools of one name, or a name an installed plugin has.
    """
    registry = registry or get_registry()
    names: list[str] = []
    for i, fn in enumerate(tools):
        if isinstance(fn, str):
            names.append(fn)
            continue
        try:
            tool = as_tool(fn)
        except ToolSchemaError as exc:
            raise ConfigError(f"train(tools[{i}]): {exc}") from exc
        if tool.name in names:
            raise ConfigError(f"train(tools=...): two tools are named '{tool.name}'; the model calls a tool by name.")
        _register_runtime(registry, "tool", tool.name, tool, "tool function")
        names.append(tool.name)
    return names


def register_environment(environment_factory: Any, registry: Any = None) -> TRLEnvironmentFactory:
    """Register TRL's ``environment_factory`` (a class, or a function returning an instance) as kind
    ``environment`` under the factory's ``__name__`` (:class:`rlplug.orchestration.python_env.TRLEnvironmentFactory`,
    which builds one probe instance to read its tools); returns the registered factory.

    Raises:
        rlplug.config.schema.ConfigError: a dict of factories (TRL's multi-environment form; register each as an
            environment plugin and give the rows an ``agent_name`` instead), an instance without ``reset`` or with
            a public method that cannot be described as a tool, or a name an installed plugin has.
    """
    if isinstance(environment_factory, Mapping):
        raise ConfigError(
            "train(environment_factory={...}): TRL's dict of environments is not taken here; register each as an "
            "environment plugin (register_environments) and give each row an agent_name column naming its "
            "environment (verl's convention)."
        )
    try:
        factory = TRLEnvironmentFactory(environment_factory)
    except ToolSchemaError as exc:
        raise ConfigError(f"train(environment_factory=...): {exc}") from exc
    _register_runtime(registry or get_registry(), "environment", factory.name, factory, "environment class")
    return factory


def _zero_reward(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """No reward of its own: the environment's ``get_reward()`` (a step reward) is the whole score."""
    return 0.0


def reward_weights_for(reward_weights: Any, names: Sequence[str]) -> list[float]:
    """TRL's ``reward_weights`` for the reward functions ``names``: one finite number per function (None:
    1.0 each, TRL's default), as floats.

    Raises:
        rlplug.config.schema.ConfigError: not a list of numbers, a non-finite number, or another length than ``names``.
    """

    if reward_weights is None:
        return [1.0] * len(names)
    if hasattr(reward_weights, "tolist") and not isinstance(reward_weights, (str, bytes)):
        reward_weights = reward_weights.tolist()  # a numpy array or a tensor
    if isinstance(reward_weights, (str, bytes, Mapping)) or not isinstance(reward_weights, Sequence):
        raise ConfigError(
            f"train(reward_weights={reward_weights!r:.60}): expected a list of numbers, one per reward function "
            f"({', '.join(names)})."
        )
    if len(reward_weights) != len(names):
        raise ConfigError(
            f"train(reward_weights=...) has {len(reward_weights)} weights for {len(names)} reward functions "
            f"({', '.join(names)}); give one weight per function, in the order of reward_funcs (TRL's rule)."
        )
    out = []
    for name, w in zip(names, reward_weights):
        if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(float(w)):
            raise ConfigError(
                f"train(reward_weights=...): the weight of reward function '{name}' is {w!r:.60}; expected a finite "
                "number."
            )
        out.append(float(w))
    return out


def _data_columns(data: Any) -> set[str] | None:
    """The columns a TRL-contract reward function receives for ``data`` (a dataset, or parquet path(s) in
    verl's schema): ``data_source``, ``ground_truth`` and the ``extra_info`` keys but ``prompt``; None when
    they cannot be told without reading the data (an unreadable file, ``extra_info`` stored as a map)."""
    keys = {"data_source", "ground_truth"}
    if isinstance(data, (str, os.PathLike)) or (
        isinstance(data, Sequence) and data and all(isinstance(x, (str, os.PathLike)) for x in data)
    ):
        import pyarrow as pa  # deferred: pyarrow
        import pyarrow.parquet as pq  # deferred: pyarrow

        for path in [data] if isinstance(data, (str, os.PathLike)) else data:
            try:
                schema = pq.read_schema(path)
            except (pa.ArrowException, OSError):
                return None
            if "extra_info" in schema.names:
                field_type = schema.field("extra_info").type
                if not pa.types.is_struct(field_type):
                    return None
                keys |= {field_type.field(i).name for i in range(field_type.num_fields)}
        return keys - {"prompt"}
    for row in _verl_rows(data):
        keys |= set(row["extra_info"])
    return keys - {"prompt"}


def _check_columns(names: Sequence[str], columns: set[str] | None, cfg: Any, registry: Any = None) -> None:
    """Check before any model loads that every TRL-contract function of ``names`` gets the dataset columns it
    names as parameters (:func:`rlplug.contracts.reward_contract.required_columns`) from ``columns`` or its
    ``reward.kwargs.<name>``; raises :class:`rlplug.config.schema.ConfigError` naming the function and the column."""

    if columns is None:
        return
    registry = registry or get_registry()
    for name in names:
        fn = registry.get("reward_function", name)
        if getattr(fn, "contract", None) != "trl":
            continue
        settings = set((cfg.reward.kwargs or {}).get(name) or {})
        missing = [c for c in required_columns(fn) if c not in columns and c not in settings]
        if missing:
            raise ConfigError(
                f"train(): reward function '{name}' takes {', '.join(missing)}, which the training data has no "
                f"column for (it has: {', '.join(sorted(columns))}; TRL passes every column but 'prompt' by name). "
                "Add the column, rename the parameter, or give it a default."
            )


def _format_given(config_or_overrides: Any) -> bool:
    """Whether the config :func:`train` got sets ``rollout.multi_turn.format`` itself (in any spelling); a
    composed config counts as setting every key."""
    if isinstance(config_or_overrides, DictConfig) and "trainer" in config_or_overrides:
        return True
    if isinstance(config_or_overrides, (Mapping, DictConfig)):
        values = OmegaConf.to_container(OmegaConf.create(dict(config_or_overrides)), resolve=False)
        assert isinstance(values, dict)
        if OmegaConf.select(OmegaConf.create(values), "rollout.multi_turn.format") is not None:
            return True
        config_or_overrides = values.get("overrides") or []
    if isinstance(config_or_overrides, Sequence) and not isinstance(config_or_overrides, str):
        return any(override_target(str(o)) == "rollout.multi_turn.format" for o in config_or_overrides)
    return False


def _multi_turn_settings(
    cfg: Any, config_or_overrides: Any, tools: Sequence[Any] | None, environment_factory: Any, no_reward_funcs: bool
) -> None:
    """Register ``tools`` / ``environment_factory`` and select them in ``cfg.rollout.multi_turn`` (:func:`train`)."""
    mt = cfg.rollout.multi_turn
    if tools is not None:
        listed = [tools] if callable(tools) or isinstance(tools, str) else list(tools)
        mt.tools = register_tools(listed)
    if environment_factory is not None:
        factory = register_environment(environment_factory)
        clash = sorted(set(factory.tool_names) & set(mt.tools))
        if clash:
            raise ConfigError(
                f"train(): {factory.name}'s method(s) {', '.join(clash)} share the name of a tool in tools=; rename "
                "one of them (the model calls a tool by name)."
            )
        mt.environment = factory.name
        if no_reward_funcs and factory.has_reward:  # TRL: get_reward() alone may score
            _register_runtime(get_registry(), "reward_function", "environment_reward_only", _zero_reward, "function")
            cfg.reward.reward_fn_map = {}
            cfg.reward.default = "environment_reward_only"
            cfg.reward.custom_reward_function.path = None
            cfg.reward.shaping = []
    mt.enable = True
    if not _format_given(config_or_overrides):
        mt.format = "hermes"


def train(
    config_or_overrides: Any = None,
    train_dataset: Any = None,
    eval_dataset: Any = None,
    reward_funcs: Sequence[Any] | Callable[..., Any] | None = None,
    reward_weights: Sequence[float] | None = None,
    tools: Sequence[Any] | None = None,
    environment_factory: Any = None,
) -> TrainResult:
    """Train with rlplug from Python, TRL-style; returns a :class:`TrainResult`.

    Args:
        config_or_overrides: Hydra override strings, a dict / ``DictConfig`` (module docstring), or None
            (the default experiment).
        train_dataset: a ``datasets.Dataset`` (or list of dicts) with a ``prompt`` column, written to
            ``<run dir>/datasets/train-<hash of the data>.parquet`` (:func:`dataset_file_name`: never
            overwritten, so a live or earlier run's data stays as it read it), or parquet path(s) in verl's
            schema; sets ``data.train_files`` (``data.task`` is then unused). None: the config's data.
        eval_dataset: the same for validation (``data.val_files``); needs ``train_dataset`` or
            ``data.train_files`` (a prepared ``data.task`` brings its own test split).
        reward_funcs: reward functions with TRL's batched contract (``fn(completions, **kwargs)``,
            ``fn(prompts, completions, answer, **kwargs) -> list[float | None]``, :mod:`rlplug.contracts.reward_contract`)
            or verl's ``compute_score(data_source, solution_str, ground_truth, extra_info)`` (told apart by
            :func:`rlplug.contracts.reward_contract.as_reward_function`), or registered names. They score every data
            source: the first is the correctness function (``reward.default``, with ``reward.reward_fn_map``
            emptied), the others are ``reward.shaping`` terms, so the score is TRL's weighted sum (a
            ``None`` adds nothing). None: the config's reward.
        reward_weights: TRL's ``reward_weights``: one weight per function of ``reward_funcs`` (None: 1.0
            each). The first is ``reward.correctness_weight``, the others the shaping terms' weights.
        tools: TRL's ``tools``: functions (type hints and a Google-style docstring; sync or ``async``), tool
            objects or registered tool names, registered as kind ``tool`` (:func:`register_tools`) and selected as
            ``rollout.multi_turn.tools``; multi-turn episodes are turned on (``rollout.multi_turn.enable``) with
            ``rollout.multi_turn.format=hermes`` (JSON tool calls through the chat template, as TRL), unless the
            config gives the format. A function runs in a tool worker process, so it must be picklable (defined at
            a module's top level).
        environment_factory: TRL's ``environment_factory``: a class (or function) whose instance, one per
            rollout, gets ``reset(**example)`` (a returned string is appended to the prompt), exposes its public
            methods as tools and may define ``get_reward()`` (the episode's reward, beside ``reward_funcs``;
            :mod:`rlplug.orchestration.python_env`). Registered as kind ``environment`` under its ``__name__``
            and selected as ``rollout.multi_turn.environment``. Without ``reward_funcs`` (and an environment with
            ``get_reward``) the data's reward function scores 0, so ``get_reward()`` is the whole score.

    Raises:
        rlplug.config.schema.ConfigError: a bad config, a reward-function name clash or contract problem, a TRL
            function naming a column the training data lacks, ``reward_weights`` that are not one number per
            function (or given without ``reward_funcs``, or next to ``reward.correctness_weight``), or eval
            data without training files.
        rlplug.data.dataset.DatasetError: a dataset without rows or prompts.
        rlplug.base.exit_codes.TrainingStopped: the run stopped early (non-finite steps, reward failures, an
            alert); its checkpoint is intact.
    """

    from rlplug.run.trainer import Trainer, run_dir_for  # deferred: torch
    from rlplug.run.validate import validate_config  # deferred: torch

    cfg = build_config(config_or_overrides)
    run_dir = run_dir_for(cfg)
    if reward_weights is not None and reward_funcs is None:
        raise ConfigError(
            "train(reward_weights=...) needs reward_funcs: the weights are those of the functions given there "
            "(for the config's reward, set reward.correctness_weight and reward.shaping[i].weight)."
        )
    with open_dict(cfg):
        if train_dataset is not None:
            cfg.data.train_files = _data_files(train_dataset, run_dir / "datasets", "train", "train_dataset")
            cfg.data.prompt_key = "prompt"
        if eval_dataset is not None:
            if not cfg.data.train_files:
                raise ConfigError(
                    "train(eval_dataset=...) needs train_dataset (or data.train_files): with data.task the "
                    "validation set is the task's prepared test split."
                )
            cfg.data.val_files = _data_files(eval_dataset, run_dir / "datasets", "eval", "eval_dataset")
        if reward_funcs is not None:
            funcs = [reward_funcs] if callable(reward_funcs) or isinstance(reward_funcs, str) else list(reward_funcs)
            if not funcs:
                raise ConfigError(
                    "train(reward_funcs=[]): give at least one reward function, or None for the config's."
                )
            names = register_reward_funcs(funcs)
            weights = reward_weights_for(reward_weights, names)
            if reward_weights is not None and cfg.reward.correctness_weight is not None:
                raise ConfigError(
                    f"train(): reward_weights and reward.correctness_weight={cfg.reward.correctness_weight} both "
                    f"set the weight of '{names[0]}'; give it once (reward_weights[0])."
                )
            if train_dataset is not None:
                _check_columns(names, _data_columns(train_dataset), cfg)
            cfg.reward.reward_fn_map = {}
            cfg.reward.default = names[0]
            cfg.reward.custom_reward_function.path = None
            if reward_weights is not None:
                cfg.reward.correctness_weight = weights[0]
            cfg.reward.shaping = [ShapingConfig(name=n, weight=w) for n, w in zip(names[1:], weights[1:])]
        if tools is not None or environment_factory is not None:
            _multi_turn_settings(cfg, config_or_overrides, tools, environment_factory, reward_funcs is None)
    validate_config(cfg)

    OmegaConf.set_readonly(cfg, False)
    trainer = Trainer(cfg)
    try:
        status = trainer.fit()
        step = trainer.global_step
    finally:
        trainer.close()
    history = read_metrics_jsonl(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    metrics: dict[str, float] = {}
    for record in history:
        if record.get("step") == step:
            metrics.update({k: v for k, v in record.items() if k not in ("step", "wall_time")})
    final = run_dir / "final_model"
    return TrainResult(
        run_dir=run_dir,
        status=status,
        global_step=step,
        final_model=final if status == "finished" and final.is_dir() else None,
        metrics=metrics,
        history=history,
    )


def score_response(
    cfg: Any,
    *,
    data_source: str,
    response: str,
    ground_truth: Any = None,
    extra_info: Mapping[str, Any] | None = None,
    prompt: str | None = None,
    response_length: int | None = None,
    registry: Any = None,
) -> dict[str, Any]:
    """Score one ``response`` with the run config's reward pipeline (``cfg.reward``: the data source's
    correctness function, the ``reward.shaping`` terms, the overlong penalty when
    ``reward.overlong_buffer.enable``), as training does (:meth:`rlplug.rewards.manager.RewardManager.score`).

    ``response_length`` (tokens, EOS included) feeds the overlong penalty; None: the response's token count
    under the config's tokenizer plus one for the EOS (loaded only when the penalty is on). ``prompt`` (one
    user message) is passed as the row's chat messages (a reward model or a TRL-contract function reads it).

    Returns a dict: ``total`` (the score), ``function`` (the correctness function and the setting that chose
    it), ``terms`` (a list of ``{name, value, weight, contribution}``: ``correctness``, each
    ``shaping/<name>``, ``overlong_reward``; the contributions sum to ``total``; a TRL-contract function's
    ``None`` is a NaN ``value`` contributing 0), ``reported`` (the other
    values the functions reported: ``acc``, ``format`` ...), ``failed`` and ``error`` (a reward failure's
    message, the score is then ``reward.fallback_score``), ``response_length``.

    Raises:
        rlplug.rewards.manager.RewardConfigError: no reward function for ``data_source`` (the message lists the
            choices), or a bad reward config.
    """

    row: dict[str, Any] = {
        "data_source": data_source,
        "ground_truth": ground_truth,
        "extra_info": dict(extra_info or {}),
        "messages": [{"role": "user", "content": prompt}] if prompt is not None else None,
    }
    with RewardManager(cfg.reward, registry=registry) as reward:
        reward.check_data_sources([data_source])
        if reward.overlong is not None and response_length is None:
            from rlplug.training.models import load_tokenizer, resolve_model_path  # deferred: torch

            tok = load_tokenizer(resolve_model_path(cfg.model), trust_remote_code=bool(cfg.model.trust_remote_code))
            response_length = len(tok(response, add_special_tokens=False)["input_ids"]) + 1
        lengths = [int(response_length)] if response_length is not None else None
        scores, extra, _ = reward.score([row], [response], lengths=lengths)
        cw = float(getattr(reward, "correctness_weight", 1.0))
        terms: list[dict[str, Any]] = [{"name": "correctness", "value": extra["correctness"][0], "weight": cw}]
        terms += [
            {"name": f"shaping/{label}", "value": extra[f"shaping/{label}"][0], "weight": w}
            for label, _, w, _ in reward.shaping
        ]
        if "overlong_reward" in extra:
            terms.append({"name": "overlong_reward", "value": extra["overlong_reward"][0], "weight": 1.0})
        for t in terms:  # a TRL-contract function's None (NaN here) adds nothing, as TRL's nansum
            t["contribution"] = 0.0 if math.isnan(t["value"]) else t["weight"] * t["value"]
        shown = {t["name"] for t in terms} | {FAILED, "overlong"}
        reported = {k: v[0] for k, v in extra.items() if k not in shown}
        return {
            "total": scores[0],
            "function": f"{reward.fn_name_for(data_source)} (chosen by {reward.chosen_by(data_source)})",
            "terms": terms,
            "reported": reported,
            "failed": bool(extra[FAILED][0]),
            "error": reward.last_error,
            "response_length": response_length,
        }


def print_score(result: Mapping[str, Any], console: Any) -> None:
    """Print :func:`score_response`'s result with ``console`` (a ``rich.console.Console``): the function,
    a table of the terms (value, weight, contribution), the other reported values and the total."""
    from rich.table import Table  # deferred: rich

    console.print(f"correctness function: {result['function']}", markup=False, highlight=False)
    table = Table()
    for col in ("term", "value", "weight", "contribution"):
        table.add_column(col)
    for t in result["terms"]:
        value = "n/a (None)" if math.isnan(t["value"]) else f"{t['value']:g}"
        table.add_row(t["name"], value, f"{t['weight']:g}", f"{t['contribution']:g}")
    table.add_row("total", "", "", f"{result['total']:g}")
    console.print(table)
    if result["reported"]:
        console.print(
            "also reported: "
            + ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in result["reported"].items()),
            markup=False,
            highlight=False,
        )
    if result["response_length"] is not None:
        console.print(f"response length: {result['response_length']} tokens", markup=False, highlight=False)
    if result["failed"]:
        console.print(f"reward FAILED: {result['error']}", markup=False, highlight=False)
    console.print(f"total: {result['total']:g}", markup=False, highlight=False)
