"""Reading RL prompt datasets (parquet in verl's row schema) and a resumable batch loader.

Row schema (verl's, e.g. ``examples/data_preprocess/gsm8k.py``)::

    data_source   string                          required; selects the reward function
    prompt        list<struct{role, content}>     required (column name: ``prompt_key``);
                                                  a plain string is taken as one user message
    reward_model  struct{style, ground_truth}     required; ground_truth a string (ints and
                                                  floats are converted with ``str``)
    ability       string                          optional
    extra_info    struct / map                    optional; passed to the reward function as is

Files are read with pyarrow only (no pandas, nothing is ever unpickled). Every row is validated
up front; the first problem raises :class:`DatasetError` naming the file, the row (0-based) and
the column, what was expected and what to do. A file with 0 rows says so (before its columns are
checked: pandas writes the columns of an empty DataFrame without a type), also at config time
(:func:`check_data_config`).

Chat control tokens in the text: a message whose text holds a special-token string of the tokenizer
(``<|im_end|>``, ``<|im_start|>`` ...) would become a real control token when the chat template's text
is tokenized. The rows are counted; ``data.special_tokens_in_text`` (``keep``, the default and verl's
behaviour: one warning with the count and an example; ``escape``: rendered as plain text; ``error``:
refused) decides what happens (:func:`read_dataset`).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from rlplug.config.schema import ConfigError
from rlplug.data.prepare import prepared_data_files

__all__ = [
    "DatasetError",
    "RLDataset",
    "read_dataset",
    "read_run_datasets",
    "check_data_config",
    "dataset_read_kwargs",
    "special_token_strings",
    "SPECIAL_TOKENS_IN_TEXT",
    "StatefulDataLoader",
    "WeightedMixLoader",
    "check_train_weights",
    "make_train_loader",
    "ALLOWED_ROLES",
]

logger = logging.getLogger("rlplug.data.dataset")

#: message roles a prompt may contain
ALLOWED_ROLES = ("system", "user", "assistant", "tool")

# C0 controls except tab, newline, carriage return; DEL; C1 controls; lone surrogates
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")

_SCHEMA_HELP = (
    "Expected verl's row schema: data_source (string), prompt (list of {role, content}), "
    "reward_model ({style, ground_truth}), optional ability (string) and extra_info (struct); "
    "'rlplug data prepare TASK --out DIR' writes such files."
)


class DatasetError(ValueError):
    """A dataset file is missing, unreadable or does not follow the row schema.

    The message names the file, the row (0-based) and the column where applicable.
    """


# ============================================================================ dataset


class RLDataset(Sequence):
    """The validated rows of one or more parquet files, in file order.

    Each row is a dict:

    * ``data_source`` (str), ``ability`` (str, "" when absent)
    * ``messages``: list of ``{"role", "content"}`` dicts (system prompt applied)
    * ``prompt_ids``: list[int], the chat template applied with ``add_generation_prompt=True``
      (only when a tokenizer was given)
    * ``ground_truth`` (str), ``extra_info`` (dict, {} when absent)
    * ``index`` (int): position in this dataset; ``source``: ``"file#row"`` it came from
    * ``agent_name`` (str), only when the file has verl's ``agent_name`` column and the row a value: the
      environment of the row's multi-turn episodes (:func:`rlplug.orchestration.episodes.agent_name`)

    ``num_filtered`` counts prompts dropped for being longer than ``max_prompt_length``;
    ``file_stats`` maps each file to ``{"rows": rows read, "kept": rows kept, "shortest_filtered": token
    count of its shortest dropped prompt or None}``; ``special_token_rows`` counts the rows whose messages'
    text holds a special-token string of the tokenizer (``data.special_tokens_in_text``).
    """

    def __init__(
        self,
        rows: list[dict],
        files: list[str] | None = None,
        num_filtered: int = 0,
        *,
        file_stats: dict[str, dict[str, Any]] | None = None,
        special_token_rows: int = 0,
    ) -> None:
        self.rows = rows
        self.files = list(files or [])
        self.num_filtered = num_filtered
        self.file_stats = dict(file_stats or {})
        self.special_token_rows = special_token_rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):  # type: ignore[override]
        return self.rows[i]

    def __iter__(self) -> Iterator[dict]:
        return iter(self.rows)

    @property
    def data_sources(self) -> set[str]:
        """The distinct ``data_source`` values (check them against the reward map before training)."""
        return {r["data_source"] for r in self.rows}

    def __repr__(self) -> str:
        return f"RLDataset({len(self.rows)} rows, data_sources={sorted(self.data_sources)}, num_filtered={self.num_filtered})"


def _err(path: str, row: int | None, column: str | None, what: str) -> DatasetError:
    where = path
    if row is not None:
        where += f", row {row}"
    if column is not None:
        where += f", column '{column}'"
    return DatasetError(f"{where}: {what}")


def _check_text(text: str, path: str, row: int, column: str) -> None:
    m = _CONTROL.search(text)
    if m:
        ch = m.group(0)
        raise _err(
            path,
            row,
            column,
            f"contains control character U+{ord(ch):04X} at position {m.start()}; expected printable UTF-8 "
            "text (tab, newline and carriage return are allowed). Remove the character and rewrite the file.",
        )


def _is_str_type(t) -> bool:
    import pyarrow as pa  # deferred: pyarrow

    if pa.types.is_dictionary(t):
        t = t.value_type
    return (
        pa.types.is_string(t) or pa.types.is_large_string(t) or getattr(pa.types, "is_string_view", lambda _: False)(t)
    )


def _check_schema(path: str, schema, prompt_key: str) -> None:
    import pyarrow as pa  # deferred: pyarrow

    names = set(schema.names)
    for col in ("data_source", prompt_key, "reward_model", "ability", "extra_info"):
        if schema.names.count(col) > 1:
            raise _err(
                path,
                None,
                col,
                f"appears {schema.names.count(col)} times; expected one column of that name. "
                "Rename or drop the duplicates and rewrite the file.",
            )
    for col in ("data_source", prompt_key, "reward_model"):
        if col not in names:
            hint = ""
            if col == prompt_key and prompt_key != "prompt" and "prompt" in names:
                hint = " (data.prompt_key is set to it; the file has a 'prompt' column)"
            elif col == prompt_key:
                hint = " (set data.prompt_key if the prompt column has another name)"
            raise _err(
                path,
                None,
                col,
                f"missing required column{hint}. Columns present: {', '.join(schema.names) or 'none'}. {_SCHEMA_HELP}",
            )

    def bad(col: str, expected: str) -> DatasetError:
        return _err(path, None, col, f"has type {schema.field(col).type}; expected {expected}. {_SCHEMA_HELP}")

    if not _is_str_type(schema.field("data_source").type):
        raise bad("data_source", "string")
    pt = schema.field(prompt_key).type
    if not _is_str_type(pt):
        ok = (pa.types.is_list(pt) or pa.types.is_large_list(pt)) and pa.types.is_struct(pt.value_type)
        if ok:
            fields = {pt.value_type.field(i).name for i in range(pt.value_type.num_fields)}
            ok = {"role", "content"} <= fields
        if not ok:
            raise bad(prompt_key, "list<struct<role: string, content: string>> (chat messages) or string")
    rt = schema.field("reward_model").type
    if not pa.types.is_struct(rt) or rt.get_field_index("ground_truth") < 0:
        raise bad("reward_model", "struct<style: string, ground_truth: string>")
    if "ability" in names:
        at = schema.field("ability").type
        if not (_is_str_type(at) or pa.types.is_null(at)):
            raise bad("ability", "string")
    if "extra_info" in names:
        et = schema.field("extra_info").type
        if not (pa.types.is_struct(et) or pa.types.is_map(et) or pa.types.is_null(et)):
            raise bad("extra_info", "struct (or map) of per-row values for the reward function")


def _column_values(path: str, table, name: str) -> list:
    """``table[name].to_pylist()``; on invalid UTF-8 finds the row and raises :class:`DatasetError`."""
    col = table.column(name)
    try:
        return col.to_pylist()
    except (UnicodeDecodeError, ValueError) as exc:
        for i in range(len(col)):
            try:
                col[i].as_py()
            except (UnicodeDecodeError, ValueError) as row_exc:
                raise _err(
                    path,
                    i,
                    name,
                    f"is not valid UTF-8 ({row_exc}); expected UTF-8 text. Re-encode the text as UTF-8 and rewrite the file.",
                ) from row_exc
        raise _err(path, None, name, f"could not be read: {exc}") from exc


def _ground_truth(value: Any, path: str, row: int) -> str:
    col = "reward_model.ground_truth"
    if isinstance(value, str):
        _check_text(value, path, row, col)
        return value
    if isinstance(value, bool) or value is None:
        pass
    elif isinstance(value, int):
        return str(value)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise _err(path, row, col, f"is {value}; expected a string answer (or a finite number).")
        return str(int(value)) if value.is_integer() else repr(value)
    raise _err(
        path,
        row,
        col,
        f"is {type(value).__name__} {value!r:.80}; expected a string (ints and floats are converted). "
        "Store the answer as text, e.g. JSON for structured answers.",
    )


def _messages(value: Any, path: str, row: int, column: str) -> list[dict]:
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    if value is None or not isinstance(value, list):
        raise _err(path, row, column, f"is {value!r:.80}; expected a non-empty list of {{role, content}} messages.")
    if not value:
        raise _err(
            path, row, column, "is an empty list; expected at least one message with text. Remove the row or fill it."
        )
    msgs = []
    for j, m in enumerate(value):
        role, content = (m.get("role"), m.get("content")) if isinstance(m, dict) else (None, None)
        if role not in ALLOWED_ROLES:
            raise _err(
                path,
                row,
                column,
                f"message {j} has role {role!r}; allowed roles: {', '.join(ALLOWED_ROLES)}.",
            )
        if not isinstance(content, str):
            raise _err(path, row, column, f"message {j} ({role}) has content {content!r:.80}; expected a string.")
        _check_text(content, path, row, f"{column}[{j}].content")
        msgs.append({"role": role, "content": content})
    if not any(m["content"].strip() for m in msgs if m["role"] != "system"):
        raise _err(path, row, column, "is empty or whitespace only; expected question text. Remove the row or fill it.")
    return msgs


def _chat_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], list):  # batched form
        out = out[0]
    return [int(t) for t in out]


def _chat_text(tokenizer: Any, messages: list[dict]) -> str:
    """The chat template's text for ``messages`` with the generation prompt (``tokenize=False``)."""
    return str(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))


# ============================================================================ special tokens in the text

#: the values of ``data.special_tokens_in_text``: what a special-token string inside a message's text becomes
SPECIAL_TOKENS_IN_TEXT = ("keep", "escape", "error")


def special_token_strings(tokenizer: Any) -> tuple[str, ...]:
    """The strings of ``tokenizer``'s special tokens, longest first.

    ``tokenizer.all_special_tokens`` plus every added token marked special
    (``tokenizer.added_tokens_decoder[id].special``), e.g. ``<|im_start|>``, ``<|im_end|>``,
    ``<|endoftext|>`` for SmolLM2 and Qwen. Strings that are empty or whitespace only are left out (they
    would match any text). Added tokens not marked special (e.g. Qwen3's ``<think>``) are ordinary
    vocabulary and are not included.
    """
    found = {str(t) for t in (getattr(tokenizer, "all_special_tokens", None) or [])}
    for added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(added, "special", False):
            found.add(str(getattr(added, "content", added)))
    return tuple(sorted((s for s in found if s.strip()), key=lambda s: (-len(s), s)))


class _SpecialTokens:
    """The special-token strings of a tokenizer, their ids and a pattern that finds them in text.

    The pattern lists the strings longest first, so a search finds the leftmost, longest one, as the
    tokenizers' added-token split does (``tokenizers.AddedVocabulary``: leftmost-longest matching).
    """

    def __init__(self, tokenizer: Any) -> None:
        strings = special_token_strings(tokenizer)
        self.ids = {s: int(tokenizer.convert_tokens_to_ids(s)) for s in strings}
        self.pattern = re.compile("|".join(map(re.escape, strings))) if strings else None

    def first(self, messages: list[dict]) -> tuple[int, str, int] | None:
        """``(message index, token, character position)`` of the first special-token string in the
        messages' text, or None."""
        if self.pattern is not None:
            for j, m in enumerate(messages):
                found = self.pattern.search(m["content"])
                if found:
                    return j, found.group(0), found.start()
        return None


def _text_ids(tokenizer: Any, text: str) -> list[int]:
    """``text`` tokenized as plain text: a special-token string in it becomes ordinary tokens
    (``split_special_tokens=True``), and no BOS/EOS is added."""
    if not text:
        return []
    return [int(t) for t in tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]]


def _escaped_chat_ids(tokenizer: Any, messages: list[dict], special: _SpecialTokens, where: str) -> list[int]:
    """Token ids of the chat template applied to ``messages`` (with the generation prompt) in which every
    message's text is plain text: a special-token string inside a message is tokenized as ordinary tokens,
    while the special tokens the template writes itself (role markers, end of turn) keep their ids.

    How: the template is rendered with the real messages and once more with a placeholder (private-use
    characters absent from the prompt) for each message's text; the placeholders locate each message's
    text in the rendered prompt. The prompt is then cut at the template's own special tokens, as the
    tokenizer cuts a text at its added tokens, and each piece between two cuts is tokenized as plain text
    (:func:`_text_ids`). Decoding the ids gives the rendered prompt back.

    Checks, each raising :class:`DatasetError` prefixed with ``where``: the template inserts every message's
    text unchanged (else the text cannot be located); the same cut, with the messages' special-token
    strings cut too, reproduces the tokenizer's own ids for the prompt (so the pieces tokenize as they do
    in a whole prompt: true for HF fast tokenizers whose added-token split is a plain string match, e.g.
    byte-level BPE as SmolLM2, Qwen, Llama 3); and the result holds exactly the template's special tokens.
    """
    assert special.pattern is not None
    what = "data.special_tokens_in_text=escape"
    rendered = _chat_text(tokenizer, messages)
    base = next((chr(c) for c in range(0xE000, 0xF900) if chr(c) not in rendered), None)
    if base is None:
        raise DatasetError(f"{where}: {what} needs a private-use character absent from the prompt; none is.")
    marks = [f"{base}{k}{base}" for k in range(len(messages))]
    skeleton = _chat_text(tokenizer, [{**m, "content": mark} for m, mark in zip(messages, marks)])
    pieces: list[tuple[str, bool]] = []  # (text, True for a message's text)
    pos = 0
    for m, mark in zip(messages, marks):
        at = skeleton.find(mark, pos)
        if at >= 0:  # else the template leaves this message out
            pieces += [(skeleton[pos:at], False), (m["content"], True)]
            pos = at + len(mark)
    pieces.append((skeleton[pos:], False))
    if any(base in text for text, is_msg in pieces if not is_msg) or "".join(t for t, _ in pieces) != rendered:
        raise DatasetError(
            f"{where}: {what} cannot locate the messages' text in the prompt: this chat template changes the "
            "text it inserts (e.g. trims it). Remove the special tokens from the data, or set "
            "data.special_tokens_in_text=keep (they stay control tokens) or error (refuse such rows)."
        )

    def cut(escape: bool) -> list[int]:
        ids: list[int] = []
        text = ""  # plain text not yet tokenized
        for piece, is_msg in pieces:
            if is_msg and escape:
                text += piece
                continue
            start = 0
            for found in special.pattern.finditer(piece):  # type: ignore[union-attr]
                ids += _text_ids(tokenizer, text + piece[start : found.start()])
                ids.append(special.ids[found.group(0)])
                text, start = "", found.end()
            text += piece[start:]
        return ids + _text_ids(tokenizer, text)

    if cut(escape=False) != _chat_ids(tokenizer, messages):
        raise DatasetError(
            f"{where}: {what} cannot tokenize this prompt piecewise the way this tokenizer tokenizes it whole "
            f"({type(tokenizer).__name__}: its added-token split is not a plain string match, or pieces tokenize "
            "differently alone). Remove the special tokens from the data, or set data.special_tokens_in_text=keep "
            "or error."
        )
    ids = cut(escape=True)
    template_specials = sum(len(special.pattern.findall(t)) for t, is_msg in pieces if not is_msg)
    special_ids = set(special.ids.values())
    if sum(t in special_ids for t in ids) != template_specials:
        raise DatasetError(
            f"{where}: {what}: tokenizing the message text as plain text still gave special token ids (the "
            "tokenizer's vocabulary reaches them by merges). Remove the special tokens from the data."
        )
    return ids


# ============================================================================ reading


def _no_rows_error(path: str, setting: str | None, schema: Any = None, weighted: bool = False) -> DatasetError:
    """The error for a file with 0 rows, naming ``setting`` (the config key that lists it)."""
    import pyarrow as pa  # deferred: pyarrow

    where = setting or "data.train_files / data.val_files"
    untyped = [
        f"{f.name}: {f.type}"
        for f in (schema if schema is not None else [])
        if pa.types.is_null(f.type) or pa.types.is_floating(f.type)
    ]
    note = (
        f" and its columns lack verl's types ({', '.join(untyped)}), as pandas writes the columns of an empty DataFrame"
        if untyped
        else ""
    )
    drop = f"remove it from {where}" + (" and its weight from data.train_weights" if weighted else "")
    return DatasetError(
        f"{path} ({where}): the file has no rows (0 rows){note}. Write its rows in verl's row schema "
        f"('rlplug data prepare TASK --out DIR' writes such files), or {drop}."
    )


def _check_has_rows(path: str, setting: str | None = None, weighted: bool = False, unreadable_ok: bool = False) -> None:
    """Raise :func:`_no_rows_error` when ``path``'s parquet footer counts 0 rows (nothing else is read).

    Raises :class:`DatasetError` for a file with 0 rows, and for an unreadable file unless ``unreadable_ok``
    (then the reader reports it later)."""
    import pyarrow as pa  # deferred: pyarrow
    import pyarrow.parquet as pq  # deferred: pyarrow

    try:
        meta = pq.read_metadata(path)
    except (pa.ArrowException, OSError) as exc:
        if unreadable_ok:
            return
        raise DatasetError(f"{path}: not a readable parquet file ({exc}). {_SCHEMA_HELP}") from exc
    if meta.num_rows == 0:
        try:
            schema = meta.schema.to_arrow_schema()
        except (pa.ArrowException, OSError):
            schema = None
        raise _no_rows_error(path, setting, schema, weighted)


def check_data_config(cfg: Any) -> None:
    """The config-time data checks, from :func:`rlplug.run.validate.validate_config` (before any model loads):
    ``data.special_tokens_in_text`` is one of :data:`SPECIAL_TOKENS_IN_TEXT`, and every existing file of
    ``data.train_files`` / ``data.val_files`` that is a readable parquet file has rows (read from its footer
    only; an unreadable file is reported by :func:`read_dataset` when the data is read).

    Raises :class:`rlplug.config.schema.ConfigError` for an unknown ``data.special_tokens_in_text`` and
    :class:`DatasetError` for a file with 0 rows (naming the file and its setting).
    """

    d = cfg.data
    mode = d.get("special_tokens_in_text", "keep")
    if mode not in SPECIAL_TOKENS_IN_TEXT:
        raise ConfigError(
            f"data.special_tokens_in_text={mode!r}: use 'keep' (a chat control token such as <|im_end|> inside the "
            "data's text stays a control token, as in verl), 'escape' (it is rendered as plain text) or 'error' "
            "(such data is refused)."
        )
    weighted = bool(d.get("train_weights"))
    for key in ("train_files", "val_files"):
        for f in d.get(key) or []:
            path = str(Path(str(f)).expanduser())
            if Path(path).is_file():
                _check_has_rows(path, f"data.{key}", weighted and key == "train_files", unreadable_ok=True)


def dataset_read_kwargs(cfg: Any) -> dict[str, Any]:
    """The :func:`read_dataset` keyword arguments of the run's ``data.*`` settings (all but the tokenizer):
    ``max_prompt_length``, ``filter_overlong_prompts``, ``prompt_key``, ``system_prompt``,
    ``special_tokens_in_text``."""
    d = cfg.data
    return dict(
        max_prompt_length=d.max_prompt_length,
        filter_overlong_prompts=d.filter_overlong_prompts,
        prompt_key=d.prompt_key,
        system_prompt=d.system_prompt,
        special_tokens_in_text=d.get("special_tokens_in_text", "keep"),
    )


def read_dataset(
    files: str | Path | Sequence[str | Path],
    *,
    tokenizer: Any = None,
    max_prompt_length: int | None = None,
    filter_overlong_prompts: bool = True,
    prompt_key: str = "prompt",
    system_prompt: str | None = None,
    special_tokens_in_text: str = "keep",
    setting: str | None = None,
) -> RLDataset:
    """Read and validate parquet files in verl's row schema.

    Args:
        files: one path or a list of paths (``~`` expanded), read in order.
        tokenizer: a HF tokenizer with a chat template; when given, ``prompt_ids`` is computed with
            ``apply_chat_template(messages, add_generation_prompt=True, tokenize=True)``.
        max_prompt_length: prompt length limit in tokens (needs ``tokenizer``).
        filter_overlong_prompts: drop longer prompts (counted in ``num_filtered`` and logged);
            if False a longer prompt raises :class:`DatasetError` naming the first such row.
        prompt_key: name of the prompt column.
        system_prompt: prepended as a system message to prompts that do not start with one
            (rows with their own system message keep it).
        special_tokens_in_text: what a special-token string of the tokenizer
            (:func:`special_token_strings`, e.g. ``<|im_end|>``) inside a message's text becomes
            (``data.special_tokens_in_text``): ``"keep"`` a real special token, as the chat template's text
            is tokenized (verl's and TRL's behaviour; the rows are counted and one warning names the count
            and an example); ``"escape"`` plain text (:func:`_escaped_chat_ids`: ordinary tokens, the
            template's own role tokens stay special; decoding gives the text back); ``"error"`` a
            :class:`DatasetError` with the count and the first row. Needs ``tokenizer`` unless ``"keep"``.
            The rows with such text are counted in ``RLDataset.special_token_rows``.
        setting: the config key that lists ``files`` (e.g. ``"data.train_files"``), named in errors.

    Returns:
        :class:`RLDataset`.

    Raises:
        DatasetError: missing/unreadable file, a file with 0 rows, missing column, wrong column type,
            empty prompt, unknown message role, non-text ground truth, invalid UTF-8 or control
            characters, an overlong prompt when not filtering, no rows left after filtering, special
            tokens in the text with ``special_tokens_in_text="error"``, or a prompt ``"escape"`` cannot render.
        ValueError: ``max_prompt_length`` or ``special_tokens_in_text`` other than ``"keep"`` without a
            tokenizer, or an unknown ``special_tokens_in_text``.
    """
    import pyarrow as pa  # deferred: pyarrow
    import pyarrow.parquet as pq  # deferred: pyarrow

    paths: list[str] = [str(Path(f).expanduser()) for f in ([files] if isinstance(files, (str, Path)) else files)]
    where = setting or "data.train_files / data.val_files"
    if not paths:
        raise DatasetError("No data files given; set data.train_files / data.val_files or data.task.")
    if max_prompt_length is not None and tokenizer is None:
        raise ValueError("max_prompt_length needs a tokenizer to count prompt tokens; pass tokenizer=.")
    if max_prompt_length is not None and max_prompt_length < 1:
        raise ValueError(f"max_prompt_length must be >= 1 token, got {max_prompt_length}.")
    if special_tokens_in_text not in SPECIAL_TOKENS_IN_TEXT:
        raise ValueError(
            f"special_tokens_in_text={special_tokens_in_text!r}; expected one of {', '.join(SPECIAL_TOKENS_IN_TEXT)}."
        )
    if special_tokens_in_text != "keep" and tokenizer is None:
        raise ValueError(
            f"special_tokens_in_text={special_tokens_in_text!r} needs the tokenizer whose special tokens to look "
            "for; pass tokenizer=."
        )

    # ---- 1. every row of every file validated (no tokenization yet)
    candidates: list[tuple[dict[str, Any], str, int, bool]] = []  # (row, file, row in file, system_prompt added)
    file_stats: dict[str, dict[str, Any]] = {}
    for path in paths:
        if not Path(path).is_file():
            raise DatasetError(f"{path}: file not found. Check {where}.")
        _check_has_rows(path, setting)  # a file with 0 rows says so before its (possibly untyped) columns are checked
        try:
            schema = pq.read_schema(path)
        except (pa.ArrowException, OSError) as exc:
            raise DatasetError(f"{path}: not a readable parquet file ({exc}). {_SCHEMA_HELP}") from exc
        _check_schema(path, schema, prompt_key)
        names = ("data_source", prompt_key, "ability", "reward_model", "extra_info", "agent_name")
        columns = [c for c in names if c in schema.names]
        try:
            table = pq.read_table(path, columns=columns)
        except (pa.ArrowException, OSError) as exc:
            raise DatasetError(f"{path}: could not read the parquet data ({exc}).") from exc
        if table.num_rows == 0:
            raise _no_rows_error(path, setting, schema)
        file_stats[path] = {"rows": table.num_rows, "kept": 0, "shortest_filtered": None}
        values = {c: _column_values(path, table, c) for c in columns}
        for i in range(table.num_rows):
            ds = values["data_source"][i]
            if not isinstance(ds, str) or not ds.strip():
                raise _err(path, i, "data_source", f"is {ds!r}; expected a non-empty string naming the data source.")
            _check_text(ds, path, i, "data_source")
            messages = _messages(values[prompt_key][i], path, i, prompt_key)
            added = system_prompt is not None and messages[0]["role"] != "system"
            if added:
                messages = [{"role": "system", "content": system_prompt}, *messages]
            rm = values["reward_model"][i]
            if not isinstance(rm, dict):
                raise _err(path, i, "reward_model", f"is {rm!r:.80}; expected {{style, ground_truth}}.")
            gt = _ground_truth(rm.get("ground_truth"), path, i)
            ability = values["ability"][i] if "ability" in values else None
            extra = values["extra_info"][i] if "extra_info" in values else None
            if isinstance(extra, list):  # map type -> list of (key, value) pairs
                extra = dict(extra)
            row: dict[str, Any] = {
                "data_source": ds,
                "messages": messages,
                "ground_truth": gt,
                "extra_info": extra if isinstance(extra, dict) else {},
                "ability": ability if isinstance(ability, str) else "",
                "source": f"{path}#{i}",
            }
            agent = values["agent_name"][i] if "agent_name" in values else None
            if agent is not None:  # verl's column: the multi-turn environment of this row
                if not isinstance(agent, str) or not agent.strip():
                    raise _err(path, i, "agent_name", f"is {agent!r:.80}; expected an environment's name or null.")
                row["agent_name"] = agent
            candidates.append((row, path, i, added))
    total = len(candidates)

    # ---- 2. special-token strings in the messages' text: counted; refused, warned about or escaped
    special = _SpecialTokens(tokenizer) if tokenizer is not None else None
    hits: dict[int, tuple[int, str, int]] = {}
    if special is not None:
        for k, (row, _, _, _) in enumerate(candidates):
            hit = special.first(row["messages"])
            if hit is not None:
                hits[k] = hit
    if hits:
        k = min(hits)
        row, path, i, added = candidates[k]
        j, token, at = hits[k]
        role = row["messages"][j]["role"]
        if added and j == 0:
            column, message = "data.system_prompt", "the system message of data.system_prompt"
        else:
            column, message = prompt_key, f"message {j - int(added)} ({role})"
        example = f"{message} holds '{token}' at character {at}"
        count = f"{len(hits)} of {total} rows of {', '.join(paths)} have"
        if special_tokens_in_text == "error":
            raise _err(
                path,
                i,
                column,
                f"{example}, a control token of the tokenizer; {count} such tokens in their text "
                "(data.special_tokens_in_text=error). Remove them from the data, or set "
                "data.special_tokens_in_text=escape to render them as plain text (keep: as control tokens, as verl).",
            )
        if special_tokens_in_text == "keep":
            logger.warning(
                "%s a control token of the tokenizer in their text, e.g. %s, row %d, %s; with "
                "data.special_tokens_in_text=keep (the default, as verl) each becomes a real control token in "
                "the prompt (e.g. a fake end of turn or a new system turn). Set data.special_tokens_in_text=escape "
                "to render them as plain text, or error to refuse such rows.",
                count,
                path,
                i,
                example,
            )
        else:
            logger.info(
                "%s a control token of the tokenizer in their text (e.g. %s, row %d, %s), rendered as plain text "
                "(data.special_tokens_in_text=escape)",
                count,
                path,
                i,
                example,
            )

    # ---- 3. the prompts' token ids and the length filter
    rows: list[dict] = []
    filtered = 0
    for k, (row, path, i, _) in enumerate(candidates):
        if tokenizer is not None:
            if k in hits and special_tokens_in_text == "escape":
                assert special is not None
                ids = _escaped_chat_ids(tokenizer, row["messages"], special, f"{path}, row {i}, column '{prompt_key}'")
            else:
                ids = _chat_ids(tokenizer, row["messages"])
            if max_prompt_length is not None and len(ids) > max_prompt_length:
                if not filter_overlong_prompts:
                    raise _err(
                        path,
                        i,
                        prompt_key,
                        f"prompt is {len(ids)} tokens after the chat template, longer than max_prompt_length="
                        f"{max_prompt_length}. Raise data.max_prompt_length or set data.filter_overlong_prompts=true.",
                    )
                filtered += 1
                stats = file_stats[path]
                stats["shortest_filtered"] = min(len(ids), stats["shortest_filtered"] or len(ids))
                continue
            row["prompt_ids"] = ids
        row["index"] = len(rows)
        file_stats[path]["kept"] += 1
        rows.append(row)
    if filtered:
        logger.warning(
            "filtered %d of %d prompts longer than max_prompt_length=%d tokens (%s)",
            filtered,
            total,
            max_prompt_length,
            ", ".join(paths),
        )
    if not rows:
        shortest = min(s["shortest_filtered"] for s in file_stats.values())
        raise DatasetError(
            f"{', '.join(paths)} ({where}): no rows left, all {total} prompts are longer than data.max_prompt_length="
            f"{max_prompt_length} tokens after the chat template (the shortest is {shortest} tokens). Raise "
            f"data.max_prompt_length to at least {shortest}, or use shorter prompts."
        )
    return RLDataset(rows, paths, filtered, file_stats=file_stats, special_token_rows=len(hits))


def read_run_datasets(cfg: Any, tokenizer: Any, check_data_sources: Any = None) -> tuple[RLDataset, RLDataset | None]:
    """The run's training and validation sets (``None`` without validation files), read with the
    ``data.*`` settings (:func:`dataset_read_kwargs`) from :func:`rlplug.data.prepare.prepared_data_files`
    (preparing ``data.task`` first when needed). ``check_data_sources(set_of_names)`` (e.g.
    :meth:`rlplug.rewards.manager.RewardManager.check_data_sources`) is called with every data source of
    both sets before the size check.

    Raises :class:`DatasetError` for a bad or empty file, an empty set after filtering, or a file of
    ``data.train_files`` with a positive ``data.train_weights`` entry whose rows were all filtered; what
    ``check_data_sources`` raises; and :class:`rlplug.config.schema.ConfigError` when the training set has fewer
    usable rows than ``data.train_batch_size``.
    """

    d = cfg.data
    train_files, val_files = prepared_data_files(cfg)
    kwargs = dataset_read_kwargs(cfg)
    prepared = f"the files prepared for data.task={d.task}"
    train = read_dataset(
        train_files, tokenizer=tokenizer, setting="data.train_files" if d.train_files else prepared, **kwargs
    )
    val = (
        read_dataset(val_files, tokenizer=tokenizer, setting="data.val_files" if d.val_files else prepared, **kwargs)
        if val_files
        else None
    )
    weights = list(d.get("train_weights") or [])
    for i, (f, w) in enumerate(zip(train_files if d.train_files else [], weights)):
        stats = train.file_stats.get(f)
        if float(w) > 0 and stats is not None and stats["kept"] == 0:
            raise DatasetError(
                f"{f} (data.train_files[{i}]): 0 of {stats['rows']} rows left, all its prompts are longer than "
                f"data.max_prompt_length={d.max_prompt_length} tokens after the chat template (the shortest is "
                f"{stats['shortest_filtered']} tokens), but data.train_weights[{i}]={w} samples it. Raise "
                f"data.max_prompt_length to at least {stats['shortest_filtered']}, or give the file the weight 0."
            )
    if check_data_sources is not None:
        check_data_sources(set(train.data_sources) | (set(val.data_sources) if val else set()))
    if len(train) < d.train_batch_size:
        raise ConfigError(
            f"data.train_batch_size={d.train_batch_size} but the training set has only {len(train)} "
            f"usable rows (files: {train_files}). Lower the batch size or add data."
        )
    return train, val


# ============================================================================ loader


class StatefulDataLoader:
    """Batches of rows over epochs, reproducible and exactly resumable.

    The order of epoch ``e`` is ``numpy.random.default_rng([seed, e]).permutation(len(dataset))``
    (identity when ``shuffle=False``); batch ``k`` of epoch ``e`` is rows
    ``order[k*B : (k+1)*B]``. With ``drop_last`` the incomplete last batch is skipped, otherwise
    it is yielded shorter.

    State is ``{"epoch": e, "index": k}``: ``k`` batches of epoch ``e`` were consumed.
    ``k == steps_per_epoch`` (just after an epoch's last batch) continues with epoch ``e + 1``.
    After :meth:`load_state_dict`, the next batch is exactly the one an uninterrupted loader
    would have produced.

    Usage::

        loader = StatefulDataLoader(dataset, batch_size=8, seed=1)
        rows, epoch = loader.next_batch()     # forever, across epochs
        for rows in loader: ...                # the rest of the current epoch
        state = loader.state_dict(); loader2.load_state_dict(state)

    Rows in a batch are shallow copies of the dataset's rows (adding keys does not change the dataset).
    """

    def __init__(
        self, dataset: Sequence[dict], batch_size: int, shuffle: bool = True, seed: int = 1, drop_last: bool = True
    ) -> None:
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer (prompts per batch), got {batch_size!r}.")
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}.")
        n = len(dataset)
        if n == 0:
            raise ValueError("The dataset is empty; nothing to load.")
        if drop_last and n < batch_size:
            raise ValueError(
                f"The dataset has {n} rows, fewer than batch_size={batch_size} with drop_last=True, so an epoch "
                "has no batch. Lower data.train_batch_size or use more data."
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.index = 0
        self._order_epoch: int | None = None
        self._order: list[int] = []

    @property
    def steps_per_epoch(self) -> int:
        """Batches per epoch: ``len // batch_size`` with ``drop_last``, else the ceiling."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __len__(self) -> int:
        return self.steps_per_epoch

    def epoch_order(self, epoch: int) -> list[int]:
        """Row indices of ``epoch`` in the order they are served."""
        if self._order_epoch != epoch:
            n = len(self.dataset)
            if self.shuffle:
                import numpy as np  # deferred: numpy

                self._order = np.random.default_rng([self.seed, epoch]).permutation(n).tolist()
            else:
                self._order = list(range(n))
            self._order_epoch = epoch
        return self._order

    def next_batch(self) -> tuple[list[dict], int]:
        """The next batch and the epoch it belongs to; rolls over into the next epoch forever."""
        if self.index >= self.steps_per_epoch:
            self.epoch += 1
            self.index = 0
        order = self.epoch_order(self.epoch)
        lo = self.index * self.batch_size
        batch = [dict(self.dataset[j]) for j in order[lo : lo + self.batch_size]]
        epoch = self.epoch
        self.index += 1
        return batch, epoch

    def __iter__(self) -> Iterator[list[dict]]:
        """The remaining batches of the current epoch (the next epoch if this one is finished)."""
        if self.index >= self.steps_per_epoch:
            self.epoch += 1
            self.index = 0
        epoch = self.epoch
        while self.epoch == epoch and self.index < self.steps_per_epoch:
            yield self.next_batch()[0]

    def state_dict(self) -> dict:
        """``{"epoch", "index"}`` plus the settings that must match on resume."""
        return {
            "epoch": self.epoch,
            "index": self.index,
            "batch_size": self.batch_size,
            "num_rows": len(self.dataset),
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`.

        Raises:
            ValueError: missing/invalid ``epoch``/``index``, or a setting (batch size, row count,
                seed, shuffle, drop_last) differing from this loader's, which would make the resumed
                order differ from the interrupted run's.
        """
        if "weights" in state:
            raise ValueError(
                f"Cannot resume the data loader: the checkpoint samples a weighted mix (data.train_weights="
                f"{list(state['weights'])}) and this run has no data.train_weights. Resume with the interrupted "
                "run's data settings or start a new run (trainer.resume_mode=disable)."
            )
        try:
            epoch, index = int(state["epoch"]), int(state["index"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"Loader state needs integer 'epoch' and 'index', got {dict(state)!r}.") from exc
        if epoch < 0 or not 0 <= index <= self.steps_per_epoch:
            raise ValueError(
                f"Loader state epoch={epoch}, index={index} is out of range (index 0..{self.steps_per_epoch})."
            )
        mine = self.state_dict()
        diffs = [
            f"{k}: saved {state[k]!r}, now {mine[k]!r}"
            for k in ("batch_size", "num_rows", "seed", "shuffle", "drop_last")
            if k in state and state[k] != mine[k]
        ]
        if diffs:
            raise ValueError(
                "Cannot resume the data loader exactly: "
                + "; ".join(diffs)
                + ". Restore the data settings of the interrupted run (data.train_batch_size, data files, data.seed, "
                "data.shuffle) or start a new run."
            )
        self.epoch, self.index = epoch, index


# ============================================================================ weighted mixes


def check_train_weights(train_files: Sequence[Any], weights: Sequence[Any]) -> list[float]:
    """``data.train_weights`` checked against ``data.train_files``: one finite weight ``>= 0`` per file, not
    all zero, and no file listed twice. Returns the weights as floats (unnormalised); ``[]`` when none are set.

    Raises :class:`rlplug.config.schema.ConfigError` naming the bad entry, what was expected and what to set.
    """

    weights = list(weights or [])
    if not weights:
        return []
    files = [str(f) for f in (train_files or [])]
    if not files:
        raise ConfigError(
            f"data.train_weights={weights} weighs data.train_files, but no training files are set (the data comes "
            "from data.task). Set data.train_files=[a.parquet,b.parquet] with one weight per file, or drop "
            "data.train_weights."
        )
    if len(weights) != len(files):
        raise ConfigError(
            f"data.train_weights has {len(weights)} weight(s) for {len(files)} file(s) in data.train_files "
            f"({', '.join(files)}): give one weight per file, in the same order, e.g. "
            f"data.train_weights=[{','.join(['1.0'] * len(files))}]."
        )
    out: list[float] = []
    for i, (f, w) in enumerate(zip(files, weights)):
        try:
            value = float(w)
        except (TypeError, ValueError):
            value = math.nan
        if isinstance(w, bool) or not math.isfinite(value) or value < 0:
            raise ConfigError(
                f"data.train_weights[{i}]={w!r} (for {f}) must be a finite number >= 0: the file's share of the "
                "sampled prompts, relative to the other weights (0 leaves the file out)."
            )
        out.append(value)
    if sum(out) <= 0:
        raise ConfigError(
            f"data.train_weights={weights} are all zero, so no file would ever be sampled. Give at least one "
            "file a positive weight."
        )
    seen: dict[str, int] = {}
    for i, f in enumerate(files):
        key = str(Path(f).expanduser())
        if key in seen:
            raise ConfigError(
                f"data.train_files lists {f} twice (entries {seen[key]} and {i}); with data.train_weights each file "
                "is one source. List it once and give it the sum of the two weights."
            )
        seen[key] = i
    return out


class WeightedMixLoader:
    """Batches whose prompts come from several sources (``data.train_files``) in proportion to ``weights``
    (``data.train_weights``): exactly reproducible from ``seed`` and exactly resumable.

    Each of the ``batch_size`` prompts of batch ``k`` (0-based, counted over the whole run) picks its source
    independently: ``numpy.random.default_rng([seed, 1, k]).choice(len(sources), size=batch_size, p=w)`` with
    ``w = weights / sum(weights)``; the chosen source serves its next row. Source ``i`` serves its rows in
    passes: pass ``e`` is ``numpy.random.default_rng([seed, 2, i, e]).permutation(len(sources[i]))`` (file order
    when ``shuffle=False``), and the next pass starts when a pass is used up, independently of the other
    sources (a small file with a large weight repeats sooner). Over ``K`` batches the share of source ``i``
    is ``w_i`` with a standard deviation of ``sqrt(w_i (1 - w_i) / (K * batch_size))``.

    An epoch is ``steps_per_epoch = sum(len(sources[i]) for w_i > 0) // batch_size`` batches (at least 1):
    as many prompts as the weighted files hold, so ``trainer.total_epochs`` keeps its meaning; the epoch of
    batch ``k`` is ``k // steps_per_epoch``.

    State is ``{"batches": k, "cursors": [rows served per source], ...}`` plus the settings that must match on
    resume (weights, source sizes, batch size, seed, shuffle). Same interface as :class:`StatefulDataLoader`
    (``next_batch``, ``steps_per_epoch``, ``state_dict``, ``load_state_dict``).

    Raises ``ValueError`` for a bad ``batch_size`` or ``seed``, ``weights`` of another length than ``sources``,
    negative, non-finite or all-zero weights, or an empty source with a positive weight.
    """

    def __init__(
        self,
        sources: Sequence[Sequence[dict]],
        weights: Sequence[float],
        batch_size: int,
        shuffle: bool = True,
        seed: int = 1,
        names: Sequence[str] | None = None,
    ) -> None:
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer (prompts per batch), got {batch_size!r}.")
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}.")
        self.names = [str(n) for n in (names or [f"source {i}" for i in range(len(sources))])]
        if len(weights) != len(sources) or len(self.names) != len(sources):
            raise ValueError(f"{len(weights)} weights and {len(self.names)} names for {len(sources)} sources.")
        w = [float(x) for x in weights]
        if any(not math.isfinite(x) or x < 0 for x in w) or sum(w) <= 0:
            raise ValueError(f"weights must be finite, >= 0 and not all zero, got {list(weights)}.")
        for name, src, x in zip(self.names, sources, w):
            if x > 0 and len(src) == 0:
                raise ValueError(
                    f"The training source {name} has no usable rows (all filtered as longer than "
                    f"data.max_prompt_length?) but a weight of {x}. Fix the file or give it the weight 0."
                )
        self.sources = list(sources)
        self.weights = w
        self.probs = [x / sum(w) for x in w]
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.batches = 0
        self.cursors = [0] * len(sources)
        self._orders: dict[tuple[int, int], list[int]] = {}

    @property
    def steps_per_epoch(self) -> int:
        """Batches per epoch: the rows of the sources with a positive weight, over ``batch_size`` (at least 1)."""
        rows = sum(len(s) for s, w in zip(self.sources, self.weights) if w > 0)
        return max(1, rows // self.batch_size)

    def __len__(self) -> int:
        return self.steps_per_epoch

    def source_picks(self, k: int) -> list[int]:
        """The source index of each of the ``batch_size`` prompts of batch ``k`` (0-based)."""
        import numpy as np  # deferred: numpy

        rng = np.random.default_rng([self.seed, 1, int(k)])
        return rng.choice(len(self.sources), size=self.batch_size, p=self.probs).tolist()

    def _order(self, i: int, e: int) -> list[int]:
        if (i, e) not in self._orders:
            n = len(self.sources[i])
            if self.shuffle:
                import numpy as np  # deferred: numpy

                order = np.random.default_rng([self.seed, 2, i, e]).permutation(n).tolist()
            else:
                order = list(range(n))
            self._orders = {key: v for key, v in self._orders.items() if key[0] != i}  # one pass per source kept
            self._orders[(i, e)] = order
        return self._orders[(i, e)]

    def next_batch(self) -> tuple[list[dict], int]:
        """The next batch (shallow copies of the rows) and its epoch; forever."""
        batch = []
        for i in self.source_picks(self.batches):
            n = len(self.sources[i])
            c = self.cursors[i]
            batch.append(dict(self.sources[i][self._order(i, c // n)[c % n]]))
            self.cursors[i] = c + 1
        epoch = self.batches // self.steps_per_epoch
        self.batches += 1
        return batch, epoch

    def state_dict(self) -> dict:
        """``{"batches", "cursors"}`` plus the settings that must match on resume."""
        return {
            "batches": self.batches,
            "cursors": list(self.cursors),
            "weights": list(self.weights),
            "source_sizes": [len(s) for s in self.sources],
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; afterwards the next batch is the one an uninterrupted loader gives.

        Raises:
            ValueError: a state written without weights (a checkpoint of a run without
                ``data.train_weights``), bad ``batches``/``cursors``, or a setting (weights, source sizes,
                batch size, seed, shuffle) that differs from this loader's.
        """
        if "weights" not in state:
            raise ValueError(
                "Cannot resume the data loader: the checkpoint comes from a run without data.train_weights, and "
                f"this run samples a weighted mix ({self.weights}). Resume with the interrupted run's data settings "
                "or start a new run (trainer.resume_mode=disable)."
            )
        try:
            batches, cursors = int(state["batches"]), [int(c) for c in state["cursors"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"Loader state needs an integer 'batches' and a list 'cursors', got {dict(state)!r}."
            ) from exc
        mine = self.state_dict()
        diffs = [
            f"{k}: saved {state[k]!r}, now {mine[k]!r}"
            for k in ("weights", "source_sizes", "batch_size", "seed", "shuffle")
            if k in state and list_or_value(state[k]) != list_or_value(mine[k])
        ]
        if diffs or batches < 0 or len(cursors) != len(self.sources) or min(cursors, default=0) < 0:
            raise ValueError(
                "Cannot resume the weighted data mix exactly: "
                + ("; ".join(diffs) or f"batches={batches}, cursors={cursors} do not fit {len(self.sources)} sources")
                + ". Restore the data settings of the interrupted run (data.train_files, data.train_weights, "
                "data.train_batch_size, data.seed, data.shuffle) or start a new run."
            )
        self.batches, self.cursors = batches, cursors


def list_or_value(x: Any) -> Any:
    """``x`` as a list when it is a sequence (a JSON round trip turns tuples into lists), else unchanged."""
    return list(x) if isinstance(x, (list, tuple)) else x


def make_train_loader(cfg: Any, dataset: RLDataset) -> StatefulDataLoader | WeightedMixLoader:
    """The run's training loader: a :class:`WeightedMixLoader` over the files of ``data.train_files`` (one
    source per file, its rows in ``dataset``) when ``data.train_weights`` is set, else the
    :class:`StatefulDataLoader` over ``dataset``; ``data.train_batch_size``, ``data.shuffle`` and ``data.seed``.

    Raises :class:`rlplug.config.schema.ConfigError` for bad weights (:func:`check_train_weights`) and ``ValueError``
    for a weighted file without usable rows.
    """
    d = cfg.data
    weights = check_train_weights(list(d.train_files or []), list(d.get("train_weights") or []))
    if not weights:
        return StatefulDataLoader(dataset, batch_size=d.train_batch_size, shuffle=d.shuffle, seed=d.seed)
    files = [str(Path(str(f)).expanduser()) for f in d.train_files]
    groups: dict[str, list[dict]] = {f: [] for f in files}
    for row in dataset:
        groups[str(row["source"]).rsplit("#", 1)[0]].append(row)
    return WeightedMixLoader(
        [groups[f] for f in files], weights, batch_size=d.train_batch_size, shuffle=d.shuffle, seed=d.seed, names=files
    )
