"""Constants and reference computations shared by the test modules.

pytest puts ``tests/`` on ``sys.path`` (no ``__init__.py``, rootdir-based import mode), so a test
module imports these with ``from _helpers import ...``. Fixtures live in ``tests/conftest.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

#: Two prompts (token ids of the SmolLM2 tokenizer) of different lengths, so batching them needs
#: left padding.
PROMPTS = [[1, 9690, 198, 2683, 314, 253, 5248, 30], [1, 4093, 28, 540]]

#: Overrides shared by the small training runs: the tiny model with one layer, 2 prompts per step,
#: responses of at most 8 tokens, no validation, one thread, CPU (``debug=tiny`` also turns the
#: critic warm-up off, so the actor updates from step 1). Modules add their algorithm, batch
#: split, logger and step count.
TINY_CPU_RUN = [
    "debug=tiny",
    "model.tiny.num_hidden_layers=1",
    "data.train_batch_size=2",
    "data.max_response_length=8",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
    "trainer.num_threads=1",
    "trainer.device=cpu",  # the CPU path on every machine (auto would pick a GPU); deterministic kernels
]

#: Overrides giving responses different scores (so advantages are not all zero).
#: metric-name prefixes whose values vary from run to run (wall clock, throughput, memory): left out when
#: two runs' histories are compared for equality
WALL_CLOCK = (
    "timing_s/",
    "perf/throughput",
    "perf/gen_tokens_per_s",
    "perf/rss_gb",
    "perf/rollout_rss_gb",
)

LENGTH_SHAPING = [
    "reward.shaping=[{name:length_penalty,weight:1.0}]",
    "+reward.kwargs.length_penalty={target_chars:0,scale_chars:50.0}",
]


def run_config(overrides: list[str], run_dir: str | Path, *extra: str, validate: bool = True) -> Any:
    """``compose(overrides + [trainer.default_local_dir=run_dir, *extra])``, checked with
    ``validate_config`` unless ``validate=False``, and made writable (tests patch it)."""
    from rlplug.config import compose
    from rlplug.validate import validate_config

    cfg = compose([*overrides, f"trainer.default_local_dir={run_dir}", *extra])
    if validate:
        validate_config(cfg)
    OmegaConf.set_readonly(cfg, False)
    return cfg


def fit(cfg: Any) -> str:
    """Build a :class:`rlplug.trainer.Trainer` for ``cfg``, train (``fit``) and close it; returns
    ``fit``'s status (``"finished"`` or ``"interrupted"``)."""
    from rlplug.trainer import Trainer

    trainer = Trainer(cfg)
    try:
        return trainer.fit()
    finally:
        trainer.close()


def manual_greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    """Reference greedy decoding: argmax of the full-sequence logits, one token at a time, no KV
    cache, no padding. Returns the ``steps`` new token ids."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def reference_log_probs(
    model: torch.nn.Module, prompt: list[int], response: list[int], temperature: float = 1.0
) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` of each response token, ``(len(response),) float32``
    (nats), from one teacher-forced forward over ``prompt + response``: the log-prob a sampler with
    ``top_p=1, top_k=-1`` reports."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]  # (T_resp, V)
    return torch.log_softmax(logits.float() / temperature, dim=-1).gather(1, torch.tensor(response)[:, None]).squeeze(1)
