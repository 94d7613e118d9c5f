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
    from rlplug.config.compose import compose
    from rlplug.run.validate import validate_config

    cfg = compose([*overrides, f"trainer.default_local_dir={run_dir}", *extra])
    if validate:
        validate_config(cfg)
    OmegaConf.set_readonly(cfg, False)
    return cfg


def fit(cfg: Any) -> str:
    """Build a :class:`rlplug.run.trainer.Trainer` for ``cfg``, train (``fit``) and close it; returns
    ``fit``'s status (``"finished"`` or ``"interrupted"``)."""
    from rlplug.run.trainer import Trainer

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


# ---------------------------------------------------------------------------- float tolerances
# Two code paths that compute the same float32 quantity in a different order (another kernel,
# micro-batch split, chunking, CPU kind) agree only up to rounding: the tolerances below come from
# rlplug.testing.reduction_tolerance (the dtype, the length of the reductions, their magnitude),
# not from one machine's observed difference. CONTRIBUTING.md ("Float tolerances") says when to
# use which.

#: vocabulary size of the tiny model (the SmolLM2 tokenizer's)
TINY_VOCAB = 49152


def tiny_chain_terms(seq_len: int, *, layers: int | None = None, vocab_size: int = 0, backward_tokens: int = 0) -> int:
    """``n_terms`` for :func:`rlplug.testing.reduction_tolerance` of the tiny Llama model's float32
    forward over ``seq_len`` tokens: the reduction lengths along its longest chain. Per layer:
    the input RMSNorm (H), the q/k/v projections (H), the attention scores (head size), the
    softmax's normaliser and the weighted sum of values (2 x ``seq_len``), the output projection
    (H), the second RMSNorm (H), gate/up (H) and down (I) projections; then the final norm (H),
    the head's dot product (H) and, with ``vocab_size``, the log-sum-exp over the vocabulary.
    With ``backward_tokens`` (the tokens a weight gradient sums over) the backward retraces the
    chain and each weight gradient adds that sum. ``layers`` defaults to the tiny config's."""
    from rlplug.config.schema import TinyModelConfig

    cfg = TinyModelConfig()
    h, i = cfg.hidden_size, cfg.intermediate_size
    head = h // cfg.num_attention_heads
    n_layers = cfg.num_hidden_layers if layers is None else layers
    forward = n_layers * (5 * h + head + 2 * seq_len + i) + 2 * h + vocab_size
    return 2 * forward + backward_tokens if backward_tokens else forward


def fp32_atol(n_terms: int, *refs: Any, floor: float = 0.0) -> float:
    """``reduction_tolerance(float32, n_terms, scale)`` with ``scale`` the largest ``|value|`` of
    ``refs`` (tensors or numbers), at least ``floor`` (1.0 for scalar metrics whose terms are O(1)
    even when their mean is near 0)."""
    from rlplug.testing import reduction_tolerance

    scale = max([floor, *(float(torch.as_tensor(r).abs().max()) for r in refs)])
    return reduction_tolerance(torch.float32, n_terms, scale)


def assert_updates_close(
    got: dict[str, torch.Tensor],
    want: dict[str, torch.Tensor],
    start: dict[str, torch.Tensor],
    n_terms: int,
    what: str = "",
) -> None:
    """Parameters after the same update computed two ways (micro-batch split, token budget,
    backend): each tensor's update ``want - start`` may differ by rounding of the gradient's
    chain (``n_terms`` float32 terms) relative to the update's largest entry, plus one rounding of
    the parameter itself. The optimizer must be Lipschitz in the gradient for this to hold (the
    tests' AdamW has ``eps = 1``; with ``eps = 1e-8`` the first update is ``lr * sign(g)``)."""
    from rlplug.testing import reduction_tolerance

    for name, w in want.items():
        tol = reduction_tolerance(torch.float32, n_terms, (w - start[name]).abs().max()) + reduction_tolerance(
            torch.float32, 1, w.abs().max()
        )
        torch.testing.assert_close(got[name], w, rtol=0, atol=tol, msg=f"{what}{name}")


#: the stand-in SGLang / vLLM server of the server-engine tests (tests/fake_sglang_server.py)
FAKE_SERVER = Path(__file__).with_name("fake_sglang_server.py")


def fake_server_cmd(log: Path | None = None, *flags: str) -> list[str]:
    """``rollout.server_cmd`` starting :data:`FAKE_SERVER` (its requests written to ``log`` when given), ``flags``
    appended (``--delay 0.6``, ``--die-after 1`` ...)."""
    cmd = ["{python}", str(FAKE_SERVER), "--model-path", "{model_path}", "--host", "{host}", "--port", "{port}"]
    return [*cmd, *(["--log", str(log)] if log is not None else []), *flags]
