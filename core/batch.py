"""The batch that flows through the training loop.

A :class:`Batch` holds tensors that all share the first dimension ``B`` (responses) and
per-row Python lists (``meta``: data_source, ground_truth, prompt text, ...).

Tensors the trainer puts on the batch (``P`` padded prompt length, ``T`` padded response
length; prompts are left-padded, responses right-padded):

=====================  ================  ==========================================================
name                   shape, dtype      meaning
=====================  ================  ==========================================================
``input_ids``          (B, P+T) int64    prompt + response tokens
``attention_mask``     (B, P+T) int64    1 on real tokens
``position_ids``       (B, P+T) int64    positions counting real tokens only
``responses``          (B, T) int64      response tokens (pad after the end)
``response_mask``      (B, T) float32    1.0 up to and including the first EOS, never on padding
``index``              (B,) int64        prompt id; responses to one prompt share it (groups)
``token_level_scores`` (B, T) float32    reward-function score on the last valid token
``token_level_rewards`` (B, T) float32   scores minus the in-reward KL penalty
``old_log_probs``      (B, T) float32    actor log-probs (nats) before the update
``ref_log_probs``      (B, T) float32    reference-model log-probs (nats)
``values``             (B, T) float32    critic values before the update
``advantages``         (B, T) float32    estimator output, 0 where the mask is 0
``returns``            (B, T) float32    critic targets
``reward_baselines``   (B,) float32      greedy baseline score (ReMax)
``rollout_log_probs``  (B, T) float32    engine log-probs (optional)
=====================  ================  ==========================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch


@dataclass
class Batch:
    """Tensors sharing the first dimension plus per-row metadata lists."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, list[Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        sizes = {k: int(v.shape[0]) for k, v in self.tensors.items()}
        sizes.update({k: len(v) for k, v in self.meta.items()})
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch fields disagree on the batch size: {sizes}")

    def __len__(self) -> int:
        for v in self.tensors.values():
            return int(v.shape[0])
        for v in self.meta.values():
            return len(v)
        return 0

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        if len(self) and int(value.shape[0]) != len(self):
            raise ValueError(f"tensor '{key}' has {value.shape[0]} rows, the batch has {len(self)}")
        self.tensors[key] = value

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.meta

    def get(self, key: str, default: Any = None) -> Any:
        """The tensor ``key``, else the metadata list ``key``, else ``default``."""
        return self.tensors.get(key, self.meta.get(key, default))

    def select(self, idx: Sequence[int] | torch.Tensor) -> "Batch":
        """Rows ``idx`` (in that order) as a new batch; tensors are indexed, not copied twice."""
        index = torch.as_tensor(idx, dtype=torch.long)
        ids = index.tolist()
        return Batch(
            {k: v.index_select(0, index.to(v.device)) for k, v in self.tensors.items()},
            {k: [v[i] for i in ids] for k, v in self.meta.items()},
        )

    def slice(self, start: int, stop: int) -> "Batch":
        """Rows ``start:stop`` as a new batch; tensors are views (no copy), metadata lists are copied."""
        return Batch({k: v[start:stop] for k, v in self.tensors.items()}, {k: v[start:stop] for k, v in self.meta.items()})

    def split(self, size: int) -> Iterator["Batch"]:
        """Consecutive chunks of at most ``size`` rows."""
        if size <= 0:
            raise ValueError(f"split size must be positive, got {size}")
        for start in range(0, len(self), size):
            yield self.slice(start, start + size)

    def to(self, device: torch.device | str) -> "Batch":
        """Every tensor moved to ``device`` (a no-op for tensors already there); metadata shared."""
        return Batch({k: v.to(device) for k, v in self.tensors.items()}, dict(self.meta))

    @staticmethod
    def concat(batches: Sequence["Batch"]) -> "Batch":
        """Row-wise concatenation; every batch must have the same keys and trailing shapes."""
        if not batches:
            return Batch()
        keys = batches[0].tensors.keys()
        return Batch(
            {k: torch.cat([b.tensors[k] for b in batches], dim=0) for k in keys},
            {k: [x for b in batches for x in b.meta[k]] for k in batches[0].meta},
        )
