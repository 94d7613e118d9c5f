"""Preference pairs: reading them (``rlplug rm train``) and building them from sampled responses
(``rlplug data pairs``: :func:`rlplug.run.make_pairs.make_pairs`).

A pairs file is a parquet table with one pair per row::

    prompt         list<struct{role, content}>   the chat messages (a plain string is one user message)
    chosen         str                           the preferred response
    rejected       str                           the other response
    chosen_source  str (optional)                "sample" (a sampled response the rule reward scored
                                                 correct) or "reference" (the task's answer, formatted)
    data_source, ground_truth  str (optional)    the task row the pair comes from

:func:`build_pairs` labels sampled responses with the rule reward (a response is correct when its
correctness function reports ``acc`` 1): for each prompt the first correct sample is ``chosen`` and
an incorrect one ``rejected``. With ``match_format`` (the default) the rejected response is the first
incorrect sample in the same form as the chosen one (both with a ``####`` answer line, or both
without), falling back to the first incorrect sample: a pair then differs in the answer, not in the
format, so the reward model cannot score well by learning the format alone (with the first incorrect
sample, most pairs of a weak policy are "formatted and right" against "unformatted", and PPO against
such a model learns the format and loses the arithmetic: ``docs/reward_models.md``). When no sample
of a prompt is correct, ``chosen`` is, with ``match_format``, the rejected sample with its answer after
``####`` replaced by the reference answer (``chosen_source`` ``corrected``: the pair differs in that
number only), else the reference answer in the recipe's format (``#### <answer>``,
:func:`reference_answer`; ``chosen_source`` ``reference``). A prompt whose samples are all correct
gives no pair.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rlplug.data.dataset import ALLOWED_ROLES
from rlplug.rewards.manager import FAILED
from rlplug.rewards.reward_model import RewardModelError

__all__ = [
    "PAIR_COLUMNS",
    "build_pairs",
    "corrected_answer",
    "read_pairs",
    "reference_answer",
    "write_pairs",
]

#: the columns ``rlplug rm train`` needs
PAIR_COLUMNS = ("prompt", "chosen", "rejected")


def _messages(prompt: Any, where: str) -> list[dict[str, str]]:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise RewardModelError(f"{where}: the prompt is empty; each pair needs the prompt its responses answer.")
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, Sequence) and prompt and all(isinstance(m, Mapping) for m in prompt):
        for j, m in enumerate(prompt):
            role, content = m.get("role"), m.get("content")
            if not isinstance(role, str) or role not in ALLOWED_ROLES:
                raise RewardModelError(
                    f"{where}: message {j} of the prompt has role {role!r}; allowed roles: {', '.join(ALLOWED_ROLES)}."
                )
            if content is not None and not isinstance(content, str):
                raise RewardModelError(
                    f"{where}: message {j} of the prompt has content {type(content).__name__} {content!r:.60}; "
                    "expected a string."
                )
        msgs = [{"role": str(m["role"]), "content": m.get("content") or ""} for m in prompt]
        if all(not m["content"].strip() for m in msgs):
            raise RewardModelError(f"{where}: every message of the prompt is empty.")
        return msgs
    raise RewardModelError(
        f"{where}: the prompt is {type(prompt).__name__} {prompt!r:.60}; expected a string or a list of "
        "{role, content} messages."
    )


def read_pairs(path: str | Path) -> list[dict[str, Any]]:
    """The pairs of a parquet file as ``[{prompt: messages, chosen: str, rejected: str}, ...]``.

    Raises:
        RewardModelError: a missing or unreadable file, a missing column (the message lists the
            columns found), an empty prompt / chosen / rejected, a non-string response, a prompt message
            with a role outside :data:`rlplug.data.dataset.ALLOWED_ROLES` or non-string content, or a pair whose
            chosen and rejected responses are the same text (it carries no preference).
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise RewardModelError(f"--pairs {p}: no such file. Build one with `rlplug data pairs TASK --out {p}`.")
    try:
        table = pq.read_table(str(p))
    except (pa.ArrowException, OSError) as exc:
        raise RewardModelError(f"--pairs {p}: not a readable parquet file ({exc}).") from exc
    missing = [c for c in PAIR_COLUMNS if c not in table.column_names]
    if missing:
        raise RewardModelError(
            f"--pairs {p} lacks the column(s) {missing}; found {table.column_names}. A pairs file needs "
            f"{', '.join(PAIR_COLUMNS)} (prompt: a string or chat messages; chosen/rejected: the two responses)."
        )
    cols = {c: table.column(c).to_pylist() for c in PAIR_COLUMNS}
    rows = []
    for i in range(table.num_rows):
        where = f"--pairs {p} row {i}"
        prompt = _messages(cols["prompt"][i], where)
        texts = {}
        for c in ("chosen", "rejected"):
            v = cols[c][i]
            if not isinstance(v, str) or not v.strip():
                raise RewardModelError(f"{where}: '{c}' is {v!r:.60}; expected a non-empty response string.")
            texts[c] = v
        if texts["chosen"].strip() == texts["rejected"].strip():
            raise RewardModelError(
                f"{where}: chosen and rejected are the same text ({texts['chosen']!r:.60}), so the pair prefers "
                "nothing. Drop the row or give it a different rejected response."
            )
        rows.append({"prompt": prompt, **texts})
    if not rows:
        raise RewardModelError(f"--pairs {p} has no rows.")
    return rows


def reference_answer(row: Mapping[str, Any]) -> str:
    """The task's own answer in the recipe's format (the ``####`` line the default instructions ask
    for): ``#### <extra_info.answer>``, or the ground truth when the row has no answer."""
    return f"#### {_answer(row)}"


def _answer(row: Mapping[str, Any]) -> str:
    """The row's answer: ``extra_info.answer``, else its ground truth, stripped."""
    extra = row.get("extra_info") or {}
    answer = extra.get("answer") if isinstance(extra, Mapping) else None
    if answer is None or not str(answer).strip():
        answer = row.get("ground_truth")
    return str(answer).strip()


#: the answer after the last ``####`` of a response (the recipes' answer line), a number
_ANSWER_LINE = re.compile(r"(####\s*)([-+]?[0-9][0-9,]*(?:\.[0-9]+)?)")


def corrected_answer(text: str, row: Mapping[str, Any]) -> str | None:
    """``text`` with the number after its last ``####`` replaced by the row's reference answer
    (:func:`reference_answer`'s), or None when ``text`` has no ``#### <number>``. E.g. ``"2 + 5 = 8\n#### 8"``
    for ground truth 7 gives ``"2 + 5 = 8\n#### 7"``."""
    found = list(_ANSWER_LINE.finditer(text))
    if not found:
        return None
    m = found[-1]
    return text[: m.start(2)] + _answer(row) + text[m.end(2) :]


def build_pairs(
    rows: Sequence[Mapping[str, Any]],
    sample: Callable[[Sequence[Mapping[str, Any]]], Sequence[Sequence[str]]],
    reward: Any,
    *,
    match_format: bool = True,
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Preference pairs for ``rows`` (dataset rows with ``messages``, ``data_source``, ``ground_truth``).

    ``sample(rows)`` returns the sampled responses of each row (a list per row); ``reward`` is a
    :class:`rlplug.rewards.manager.RewardManager` (the rule reward) that labels them: ``acc >= 0.5`` correct,
    else incorrect (a response whose reward failed is neither). See the module docstring for the
    choice and ``match_format``. Returns ``(pairs, counts)``: pairs with the columns of the module
    docstring, counts ``prompts``, ``pairs``, ``chosen_from_reference``, ``chosen_corrected``,
    ``all_correct`` (prompts without a pair).
    """
    samples = [list(s) for s in sample(rows)]
    if len(samples) != len(rows):
        raise ValueError(f"sample() returned responses for {len(samples)} prompts; expected {len(rows)}")
    flat_rows = [rows[i] for i, s in enumerate(samples) for _ in s]
    flat = [t for s in samples for t in s]
    _, extra, _ = reward.score(flat_rows, flat, report_acc=True) if flat else ([], {"acc": []}, {})
    acc, failed = list(extra["acc"]), list(extra.get(FAILED) or [0.0] * len(flat))
    pairs: list[dict[str, Any]] = []
    counts = {"prompts": len(rows), "pairs": 0, "chosen_from_reference": 0, "chosen_corrected": 0, "all_correct": 0}
    pos = 0
    for row, texts in zip(rows, samples):
        labels = [(t, acc[pos + j] >= 0.5, bool(failed[pos + j])) for j, t in enumerate(texts)]
        pos += len(texts)
        correct = [t for t, ok, bad in labels if ok and not bad]
        wrong = [t for t, ok, bad in labels if not ok and not bad and t.strip()]
        if not wrong:
            counts["all_correct"] += 1
            continue
        if correct:
            source, chosen = "sample", correct[0]
            rejected = _pick_rejected(wrong, chosen, match_format)
        else:
            source, chosen = "reference", reference_answer(row)
            rejected = _pick_rejected(wrong, chosen, match_format)  # differs from the reference
            fixed = corrected_answer(rejected, row) if match_format and rejected is not None else None
            if fixed is not None and fixed.strip() != str(rejected).strip():
                source, chosen = "corrected", fixed
        if rejected is None:
            continue
        counts["chosen_from_reference"] += source == "reference"
        counts["chosen_corrected"] += source == "corrected"
        pairs.append(
            {
                "prompt": [{"role": str(m["role"]), "content": str(m["content"])} for m in row["messages"]],
                "chosen": chosen,
                "rejected": rejected,
                "chosen_source": source,
                "data_source": str(row["data_source"]),
                "ground_truth": str(row["ground_truth"]),
            }
        )
    counts["pairs"] = len(pairs)
    return pairs, counts


def _pick_rejected(wrong: Sequence[str], chosen: str, match_format: bool) -> str | None:
    """The first of ``wrong`` that differs from ``chosen``, preferring (``match_format``) one that has a
    ``#### <number>`` answer line exactly when ``chosen`` has one."""
    others = [t for t in wrong if t.strip() != chosen.strip()]
    if match_format:
        form = _ANSWER_LINE.search(chosen) is not None
        same = [t for t in others if (_ANSWER_LINE.search(t) is not None) == form]
        if same:
            return same[0]
    return others[0] if others else None


def write_pairs(pairs: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Write ``pairs`` (:func:`build_pairs`) to the parquet file ``path`` (folders created)."""
    msg = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    schema = pa.schema(
        [("prompt", msg)]
        + [(c, pa.string()) for c in ("chosen", "rejected", "chosen_source", "data_source", "ground_truth")]
    )
    out = Path(path).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist([dict(p) for p in pairs], schema=schema), str(out))
    return out
