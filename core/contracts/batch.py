"""The batch that flows through the training loop.

A :class:`Batch` holds tensors that all share the first dimension ``B`` (responses) and
per-row Python lists (``meta``: data_source, ground_truth, prompt text, ...).

Tensors the trainer puts on the batch (``P`` padded prompt length, ``T`` padded response
length, ``K`` named columns; prompts are left-padded, responses right-padded). Each is there
when the stage that produces it runs; :data:`rlplug.contracts.types.BATCH_FIELD_PRODUCERS` says which
stage that is and what turns it on:

=======================  ================  ==========================================================
name                     shape, dtype      meaning
=======================  ================  ==========================================================
``input_ids``            (B, P+T) int64    prompt + response tokens
``attention_mask``       (B, P+T) int64    1 on real tokens
``position_ids``         (B, P+T) int64    positions counting real tokens only
``responses``            (B, T) int64      response tokens (pad after the end)
``response_mask``        (B, T) float32    1.0 up to and including the first EOS, never on padding
``index``                (B,) int64        prompt id; responses to one prompt share it (groups)
``rollout_log_probs``    (B, T) float32    engine log-probs (with ``rollout.calculate_log_probs``)
``rollout_is_weights``   (B, T) float32    detached importance weights old / rollout, once per step
                                           (``algorithm.rollout_correction.rollout_is``), 0 on padding
``reward_baselines``     (B,) float32      greedy baseline score (ReMax)
``old_log_probs``        (B, T) float32    actor log-probs (nats) before the update
``entropy``              (B, T) float32    actor token entropies (nats) before the update
``sum_pi_squared``       (B, T) float32    sum over the vocabulary of the squared token probabilities
``ref_log_probs``        (B, T) float32    reference-model log-probs (nats)
``values``               (B, T) float32    critic values before the update
``token_level_scores``   (B, T) float32    reward-function score on the last valid token
``reward_components``    (B, K) float32    the named values the reward functions report (``acc``,
                                           ``correctness``, ``shaping/<name>``, ``format``, ...);
                                           NaN where a response's reward did not report one;
                                           ``reward_failed`` 1.0 where its reward failed;
                                           column names in ``batch.columns["reward_components"]``
``token_level_rewards``  (B, T) float32    scores minus the in-reward KL penalty
``advantages``           (B, T) float32    estimator output, 0 where the mask is 0
``returns``              (B, T) float32    critic targets
=======================  ================  ==========================================================

``entropy`` and ``sum_pi_squared`` are on the batch only when a selected plugin requires them.

Responses whose reward failed (:mod:`rlplug.rewards.manager`) are not shown to the advantage estimator:
it receives the scored rows only (:func:`estimate_on_rows`), and the updates see them with a
zero ``response_mask`` (:func:`rows_left_out`).

Named columns: a ``(B, K)`` field may name its ``K`` columns. :meth:`Batch.set_columns` stores
the tensor with its names, ``batch.columns[key]`` gives the names (a tuple, in column order) and
:meth:`Batch.column` one column by name. Replacing the tensor with ``batch[key] = ...`` drops
its names. :meth:`Batch.fields` is what plugins receive: every tensor by name, a plain ``dict``
that also carries the ``columns``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


class Fields(dict):
    """A batch's tensors by name (a plain ``dict[str, Tensor]``) plus ``columns``: the column
    names of its named ``(B, K)`` fields (``{"reward_components": ("acc", ...)}``)."""

    def __init__(self, tensors: dict[str, torch.Tensor], columns: dict[str, tuple[str, ...]] | None = None) -> None:
        super().__init__(tensors)
        self.columns: dict[str, tuple[str, ...]] = dict(columns or {})


@dataclass
class Batch:
    """Tensors sharing the first dimension plus per-row metadata lists; ``columns`` names the
    columns of ``(B, K)`` tensors (see the module docstring)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, list[Any]] = field(default_factory=dict)
    columns: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        sizes = {k: int(v.shape[0]) for k, v in self.tensors.items()}
        sizes.update({k: len(v) for k, v in self.meta.items()})
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch fields disagree on the batch size: {sizes}")
        self.columns = {k: tuple(v) for k, v in self.columns.items() if k in self.tensors}

    def __len__(self) -> int:
        for v in self.tensors.values():
            return int(v.shape[0])
        for values in self.meta.values():
            return len(values)
        return 0

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        if len(self) and int(value.shape[0]) != len(self):
            raise ValueError(f"tensor '{key}' has {value.shape[0]} rows, the batch has {len(self)}")
        self.tensors[key] = value
        self.columns.pop(key, None)

    def set_columns(self, key: str, value: torch.Tensor, names: Sequence[str]) -> None:
        """Store ``value`` ``(B, K)`` as ``key`` with its ``K`` column names (``batch.columns[key]``).

        Raises ``ValueError`` when ``value`` is not 2-D, ``len(names) != K``, names repeat, or the
        rows differ from the batch's.
        """
        names = tuple(str(n) for n in names)
        if value.dim() != 2 or int(value.shape[1]) != len(names):
            raise ValueError(
                f"set_columns('{key}'): a (B, {len(names)}) tensor for columns {list(names)}, "
                f"got shape {tuple(value.shape)}"
            )
        if len(set(names)) != len(names):
            raise ValueError(f"set_columns('{key}'): column names repeat: {list(names)}")
        self[key] = value
        self.columns[key] = names

    def column(self, key: str, name: str) -> torch.Tensor:
        """Column ``name`` of the named field ``key``, ``(B,)``; ``KeyError`` names the columns there are."""
        names = self.columns.get(key)
        if names is None or name not in names:
            raise KeyError(f"batch field '{key}' has no column '{name}'; columns: {list(names or ())}")
        return self.tensors[key][:, names.index(name)]

    def fields(self) -> Fields:
        """Every tensor by name (a new dict; the tensors are shared) with the column names."""
        return Fields(self.tensors, self.columns)

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.meta

    def get(self, key: str, default: Any = None) -> Any:
        """The tensor ``key``, else the metadata list ``key``, else ``default``."""
        return self.tensors.get(key, self.meta.get(key, default))

    def select(self, idx: Sequence[int] | torch.Tensor) -> Batch:
        """Rows ``idx`` (in that order) as a new batch; tensors are indexed, not copied twice."""
        index = torch.as_tensor(idx, dtype=torch.long)
        ids = index.tolist()
        return Batch(
            {k: v.index_select(0, index.to(v.device)) for k, v in self.tensors.items()},
            {k: [v[i] for i in ids] for k, v in self.meta.items()},
            dict(self.columns),
        )

    def slice(self, start: int, stop: int) -> Batch:
        """Rows ``start:stop`` as a new batch; tensors are views (no copy), metadata lists are copied."""
        return Batch(
            {k: v[start:stop] for k, v in self.tensors.items()},
            {k: v[start:stop] for k, v in self.meta.items()},
            dict(self.columns),
        )

    def split(self, size: int) -> Iterator[Batch]:
        """Consecutive chunks of at most ``size`` rows."""
        if size <= 0:
            raise ValueError(f"split size must be positive, got {size}")
        for start in range(0, len(self), size):
            yield self.slice(start, start + size)

    def split_sizes(self, sizes: Sequence[int]) -> Iterator[Batch]:
        """Consecutive chunks of ``sizes[0]``, ``sizes[1]`` ... rows (they must sum to ``len(self)``)."""
        if sum(sizes) != len(self) or any(n <= 0 for n in sizes):
            raise ValueError(f"split sizes {list(sizes)} must be positive and sum to the {len(self)} rows")
        start = 0
        for n in sizes:
            yield self.slice(start, start + n)
            start += n

    def to(self, device: torch.device | str) -> Batch:
        """Every tensor moved to ``device`` (a no-op for tensors already there); metadata shared."""
        return Batch({k: v.to(device) for k, v in self.tensors.items()}, dict(self.meta), dict(self.columns))

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Row-wise concatenation; every batch must have the same keys and trailing shapes (column
        names are the first batch's)."""
        if not batches:
            return Batch()
        keys = batches[0].tensors.keys()
        return Batch(
            {k: torch.cat([b.tensors[k] for b in batches], dim=0) for k in keys},
            {k: [x for b in batches for x in b.meta[k]] for k in batches[0].meta},
            dict(batches[0].columns),
        )


def build_batch(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    prompt_index: Sequence[int],
    pad_id: int,
    *,
    response_masks: Sequence[Sequence[int]] | None = None,
    response_prompts: Sequence[Sequence[int]] | None = None,
) -> Batch:
    """Pack prompts (left-padded) and responses (right-padded) into the rollout's batch tensors:
    ``input_ids``, ``attention_mask``, ``position_ids``, ``responses``, ``response_mask`` and
    ``index`` (the table above). Response ``i`` answers ``prompt_ids[prompt_index[i]]``, or
    ``response_prompts[i]`` when given (a multi-turn environment rewrote its prompt).

    ``response_mask`` is 1.0 on each response's own tokens (EOS included when generated) and
    0.0 on padding -- built from lengths, never from ``ids != pad_id`` (pad may equal EOS). With
    ``response_masks`` (multi-turn trajectories: 0/1 per response token) it is that mask: 0.0 on the
    environment's tokens inside a response too; ``attention_mask`` is 1 on every response token.
    """
    B = len(response_ids)
    if response_prompts is not None:
        prompts = [list(p) for p in response_prompts]
    else:
        prompts = [list(prompt_ids[i]) for i in prompt_index]
    P = max(len(p) for p in prompts)
    T = max(1, max(len(r) for r in response_ids))
    input_ids = torch.full((B, P + T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, P + T), dtype=torch.long)
    response_mask = torch.zeros((B, T), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, response_ids)):
        input_ids[i, P - len(p) : P] = torch.tensor(p, dtype=torch.long)
        attention_mask[i, P - len(p) : P] = 1
        if r:
            input_ids[i, P : P + len(r)] = torch.tensor(r, dtype=torch.long)
            attention_mask[i, P : P + len(r)] = 1
            if response_masks is None:
                response_mask[i, : len(r)] = 1.0
            else:
                response_mask[i, : len(r)] = torch.tensor(list(response_masks[i]), dtype=torch.float32)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return Batch(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "responses": input_ids[:, P:].clone(),
            "response_mask": response_mask,
            "index": torch.tensor(list(prompt_index), dtype=torch.long),
        }
    )


def rollout_batch(prompt_ids: Sequence[Sequence[int]], out: Any, pad_id: int) -> Batch:
    """:func:`build_batch` for a :class:`rlplug.contracts.types.RolloutOutput` ``out`` answering the prompts
    ``prompt_ids`` (one per prompt): multi-turn trajectories bring their own prompts and response masks."""
    return build_batch(
        prompt_ids,
        out.response_ids,
        out.prompt_index,
        pad_id,
        response_masks=out.response_masks,
        response_prompts=out.prompts,
    )


def padded_rows(rows: Sequence[Sequence[float]], width: int) -> torch.Tensor:
    """``(len(rows), width) float32``: each row of floats (e.g. a response's engine log-probs)
    followed by 0.0 up to ``width``."""
    return torch.tensor([list(r) + [0.0] * (width - len(r)) for r in rows], dtype=torch.float32)


def estimate_on_rows(
    estimator: Callable[..., tuple[torch.Tensor, torch.Tensor]], batch: Batch, config: Any, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)``, both ``(B, T) float32``, from ``estimator(fields, config)`` run on
    the rows of ``batch`` where ``rows`` (``(B,) bool``) is True only; 0.0 on the other rows.

    The trainer passes the responses whose reward succeeded, so a failed response is part of no
    group baseline, whitening or normalisation (any estimator, ours or a third party's) and gets
    advantage 0. All rows kept: a plain call on the whole batch. No row kept: zeros, no call.
    """
    mask = batch["response_mask"]
    if bool(rows.all()):
        return estimator(batch.fields(), config)
    advantages = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    returns = torch.zeros_like(advantages)
    if bool(rows.any()):
        idx = rows.nonzero().squeeze(-1)
        sub_adv, sub_ret = estimator(batch.select(idx).fields(), config)
        idx = idx.to(mask.device)
        advantages[idx], returns[idx] = sub_adv.to(torch.float32), sub_ret.to(torch.float32)
    return advantages, returns


@contextlib.contextmanager
def rows_left_out(batch: Batch, rows: torch.Tensor) -> Iterator[None]:
    """Inside the block, ``response_mask`` is 0 on the rows where ``rows`` (``(B,) bool``) is True,
    so the updates give them no weight (no policy, KL, entropy or value loss, not counted in any
    normaliser); the full mask comes back afterwards."""
    if not bool(rows.any()):
        yield
        return
    mask = batch["response_mask"]
    batch["response_mask"] = mask * (~rows).to(mask.dtype, copy=False).to(mask.device).unsqueeze(-1)
    try:
        yield
    finally:
        batch["response_mask"] = mask
