"""Real multi-turn training runs (issue 33): the tiny random model, hf rollout, local backend, CPU.

The random model never writes a tool call, so the runs use the test environment ``test_echo``
(:class:`multi_turn_tools.EchoEnvironment`): it answers every assistant message with the same tool message and
a step reward of 0.25, never ``done``, so each episode runs to the turn cap (3 assistant turns) or the length
budget; its stop strings (``e``, ``a``) end a random model's turn after a few tokens.

* One real step: the batch the actor is updated on carries ``response_mask`` 0 exactly on the environment's
  tokens (as the episode engine laid them out), the step rewards on the model's tokens, and inside the real
  update (PPO with the entropy bonus and the KL loss on) the loss's gradient with respect to every masked
  token's log-prob and entropy is exactly 0, and overwriting every per-token input at masked positions
  leaves the loss bitwise unchanged: the per-token loss at every masked position is exactly 0.
* Kill-and-resume: a run SIGKILLed in the middle of step 3's episodes (at the environment's own fault point,
  between two turns) and resumed from step 2's checkpoint ends with every metric of every step and every
  weight bitwise equal to an uninterrupted run's. Every "tool" call here finishes at once (no timeout can
  fire), so nothing depends on wall time. (``slow``: about a minute, a fresh interpreter for the killed run.)
* The same, cheaply and in-process: a graceful stop (SIGTERM from the same fault point) in the middle of step
  1's episodes; the step finishes and is saved, and the resumed step 2 equals an uninterrupted run's.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import multi_turn_tools as mt
import pytest
import torch
from _helpers import TINY_CPU_RUN, WALL_CLOCK, run_config

import rlplug
import rlplug.training.backend as backend_module
from rlplug.base import faults
from rlplug.contracts.registry import get_registry
from rlplug.run.checkpoint import CheckpointManager
from rlplug.run.metrics import read_metrics_jsonl
from rlplug.run.trainer import Trainer

TESTS = Path(__file__).resolve().parent
ENV_NAME = "test_echo"
MULTI_TURN = [
    "rollout.multi_turn.enable=true",
    f"rollout.multi_turn.environment={ENV_NAME}",
    "rollout.multi_turn.max_assistant_turns=3",
    "rollout.multi_turn.max_user_turns=3",
    "data.max_response_length=48",
    "trainer.logger=[]",
]


@pytest.fixture
def echo_env() -> Any:
    registry = get_registry()
    mt.register_echo(registry, ENV_NAME)
    try:
        yield ENV_NAME
    finally:
        registry.entries["environment"].pop(ENV_NAME, None)


def _spans(mask: list[int]) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of 0 between two 1s (the environment's spans)."""
    last = max(i for i, m in enumerate(mask) if m)
    spans, start = [], None
    for i, m in enumerate(mask[: last + 1]):
        if m == 0 and start is None:
            start = i
        elif m == 1 and start is not None:
            spans.append((start, i))
            start = None
    return spans


# ----------------------------------------------------------------------------- one real step
def test_one_real_multi_turn_step_masks_environment_tokens_and_their_loss_is_zero(tmp_path, echo_env, monkeypatch):
    overrides = (
        TINY_CPU_RUN
        + MULTI_TURN
        + [
            "trainer.total_training_steps=1",
            "trainer.save_freq=0",
            "actor.ppo_mini_batch_size=2",
            "actor.micro_batch_size_per_device=2",
            "actor.entropy_coeff=0.01",  # the entropy bonus and the KL loss too: every term of the actor's loss
            "actor.use_kl_loss=true",
            "actor.kl_loss_coef=0.1",
        ]
    )
    cfg = run_config(overrides, tmp_path / "run")
    outputs: list[Any] = []
    batches: list[Any] = []
    micro: list[dict[str, Any]] = []
    real_objective = backend_module.actor_objective

    def checked_objective(log_probs, entropy, tensors, **kwargs):
        """The real objective; on the side, its gradient at each token (hooks on the real backward) and the
        loss with every per-token input overwritten at masked positions."""
        loss, parts = real_objective(log_probs, entropy, tensors, **kwargs)
        mask = tensors["response_mask"]
        record: dict[str, Any] = {"mask": mask.clone(), "loss": loss.detach().clone(), "grads": {}}
        for name, x in (("log_probs", log_probs), ("entropy", entropy)):
            if x is not None and x.requires_grad:
                x.register_hook(lambda g, name=name: record["grads"].__setitem__(name, g.detach().clone()))
        gen = torch.Generator().manual_seed(len(micro))
        masked = mask == 0

        def garbage(x: torch.Tensor) -> torch.Tensor:
            return torch.where(masked, 1e3 * torch.randn(x.shape, generator=gen), x.detach())

        tampered = {
            k: garbage(v) if k in {"old_log_probs", "ref_log_probs", "advantages"} else v for k, v in tensors.items()
        }
        with torch.no_grad():
            record["tampered_loss"], _ = real_objective(
                garbage(log_probs), None if entropy is None else garbage(entropy), tampered, **kwargs
            )
        micro.append(record)
        return loss, parts

    monkeypatch.setattr(backend_module, "actor_objective", checked_objective)
    trainer = Trainer(cfg)
    try:
        generate, update = trainer.episodes.generate, trainer.backend.update_actor
        trainer.episodes.generate = lambda *a, **k: outputs.append(generate(*a, **k)) or outputs[-1]
        trainer.backend.update_actor = lambda batch: batches.append(batch) or update(batch)
        assert trainer.fit() == "finished"
        tokenizer = trainer.tokenizer
    finally:
        trainer.close()

    (out,), (batch,) = outputs, batches
    assert out.metrics["multi_turn/ended_by_turn_cap"] + out.metrics["multi_turn/ended_by_length"] == 2
    mask = batch["response_mask"]
    responses = batch["responses"]
    observation = tokenizer(mt.ECHO_TEXT, add_special_tokens=False)["input_ids"]
    interior = 0
    for i, (ids, want) in enumerate(zip(out.response_ids, out.response_masks)):
        # the batch's mask is the engine's, padded with 0; the response ids are the engine's
        assert mask[i].tolist() == [float(m) for m in want] + [0.0] * (mask.shape[1] - len(want))
        assert responses[i, : len(ids)].tolist() == ids
        # each interior masked span is exactly one environment reply: the template's tokens and the echo text
        spans = _spans(want)
        assert len(spans) == [m["role"] for m in out.transcripts[i]].count("tool") >= 1
        for start, end in spans:
            text = ids[start:end]
            k = next(j for j in range(len(text)) if text[j : j + len(observation)] == observation)
            assert tokenizer.decode(text[:k]).endswith("<|im_start|>tool\n")
            assert tokenizer.decode(text[k + len(observation) :]) == "<|im_end|>\n<|im_start|>assistant\n"
            interior += 1
        # the step rewards sit on the last model token of each turn, right before an environment span
        positions = [p for p, r in out.step_rewards[i]]
        assert all(r == mt.ECHO_REWARD for _, r in out.step_rewards[i])
        assert [p + 1 for p in positions[: len(spans)]] == [s for s, _ in spans]
        scores = batch["token_level_scores"][i]
        last = max(p for p, m in enumerate(want) if m)  # the outcome score's place
        nonzero = [p for p in range(scores.shape[0]) if scores[p] != 0]
        assert set(nonzero) <= {*positions, last} and all(mask[i, p] == 1 for p in nonzero)
        assert all(scores[p].item() == mt.ECHO_REWARD for p in positions if p != last)
    assert interior >= 2  # both trajectories had at least two turns: masks with interior zeros

    # inside the real update: the loss's gradient is exactly 0 at every masked token, and not at model tokens
    assert micro, "the actor objective was not called"
    for record in micro:
        assert record["tampered_loss"].item() == record["loss"].item() and torch.equal(
            record["tampered_loss"], record["loss"]
        )
        masked = record["mask"] == 0
        assert masked.any()
        assert set(record["grads"]) == {"log_probs", "entropy"}
        for name, grad in record["grads"].items():
            assert torch.count_nonzero(grad[masked]) == 0, name
            assert torch.count_nonzero(grad[~masked]) > 0, name


# ----------------------------------------------------------------------------- kill and resume
KILL_RUN = [
    *TINY_CPU_RUN,
    *MULTI_TURN,
    "actor.ppo_mini_batch_size=1",
    "actor.micro_batch_size_per_device=1",
    "data.train_size=5",  # 2 steps per epoch: the resumed steps are in the second epoch
    "trainer.total_training_steps=4",
    "trainer.save_freq=1",
    "trainer.resume_mode=auto",
]

KILLED = r"""
import sys
sys.path.insert(0, sys.argv[1])
from _helpers import fit, run_config
import multi_turn_tools
from rlplug.contracts.registry import get_registry
multi_turn_tools.register_echo(get_registry(), sys.argv[2])
fit(run_config(sys.argv[4:], sys.argv[3]))
"""


class _Counter:
    """Records, at each step's end, how many times the echo environment's fault point was reached."""

    def __init__(self) -> None:
        self.at_step_end: dict[int, int] = {}

    @rlplug.hookimpl
    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        self.at_step_end[step] = faults.fault_counts.get(mt.ECHO_FAULT_LABEL, 0)


def _fit(run_dir: Path, overrides: list[str] = KILL_RUN, status: str = "finished") -> dict[str, torch.Tensor]:
    trainer = Trainer(run_config(overrides, run_dir))
    try:
        assert trainer.fit() == status
        weights = {f"actor/{k}": v.detach().clone() for k, v in trainer.backend.actor.model.state_dict().items()}
        if trainer.backend.critic is not None:
            weights.update(
                {f"critic/{k}": v.detach().clone() for k, v in trainer.backend.critic.model.state_dict().items()}
            )
        return weights
    finally:
        trainer.close()


def _history(run_dir: Path) -> dict[int, dict[str, float]]:
    return {
        r["step"]: {k: v for k, v in r.items() if k != "wall_time" and not k.startswith(WALL_CLOCK)}
        for r in read_metrics_jsonl(run_dir)
    }


def _same(a: float, b: float) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def _assert_same_runs(full: dict[int, dict], got: dict[int, dict], full_weights: dict, weights: dict) -> None:
    assert sorted(got) == sorted(full)
    for step in full:
        assert set(got[step]) == set(full[step]), step
        differ = {k: (full[step][k], got[step][k]) for k in full[step] if not _same(full[step][k], got[step][k])}
        assert not differ, f"step {step}: {differ}"
    assert full_weights.keys() == weights.keys()
    differ = [k for k in full_weights if not torch.equal(full_weights[k], weights[k])]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[:5]}"


def test_stop_signal_in_the_middle_of_a_multi_turn_step_then_resume_is_bitwise(tmp_path, echo_env, monkeypatch, capsys):
    """The cheap in-process variant of the kill test below: SIGTERM (the graceful stop) from the environment's
    fault point in the middle of step 1's episodes; the step finishes, is saved, and the resumed run's step 2
    equals an uninterrupted run's, bit for bit."""
    changed = ("trainer.total_training_steps=", "trainer.save_freq=")
    overrides = [o for o in KILL_RUN if not o.startswith(changed)]
    overrides += ["trainer.total_training_steps=2", "trainer.save_freq=0"]  # a checkpoint when stopped
    full_weights = _fit(tmp_path / "full", overrides)
    run_dir = tmp_path / "resumed"
    monkeypatch.setenv(faults.FAULT_ENV, f"{mt.ECHO_FAULT_LABEL}:2:SIGTERM")  # after the 2nd episode's 1st turn
    faults.fault_counts.clear()
    capsys.readouterr()
    _fit(run_dir, overrides, status="interrupted")
    monkeypatch.delenv(faults.FAULT_ENV)
    captured = capsys.readouterr()
    assert f"SIGTERM at {mt.ECHO_FAULT_LABEL}:2" in captured.err
    assert "Stopped after step 1 (a signal)" in captured.out
    assert CheckpointManager(run_dir).complete_steps() == [1]
    weights = _fit(run_dir, overrides)
    assert f"Resumed from {run_dir / 'global_step_1'} (step 1)" in capsys.readouterr().out
    _assert_same_runs(_history(tmp_path / "full"), _history(run_dir), full_weights, weights)


@pytest.mark.slow
def test_kill_in_the_middle_of_a_multi_turn_step_then_resume_is_bitwise(tmp_path, echo_env, monkeypatch, capsys):
    # the uninterrupted run; the fault point counts (a label that never fires) to find step 3's episodes
    monkeypatch.setenv(faults.FAULT_ENV, f"{mt.ECHO_FAULT_LABEL}:1000000")
    faults.fault_counts.clear()
    counter = _Counter()
    get_registry().pm.register(counter)
    try:
        full_weights = _fit(tmp_path / "full")
    finally:
        get_registry().pm.unregister(counter)
        monkeypatch.delenv(faults.FAULT_ENV)
    full = _history(tmp_path / "full")
    assert sorted(full) == [1, 2, 3, 4]
    assert all(full[s]["multi_turn/turns_mean"] > 1 for s in full)  # every step's episodes had several turns
    # kill at the second environment step of step 3: its episodes are between their first and second turns
    kill_at = counter.at_step_end[2] + 2
    assert kill_at < counter.at_step_end[3]

    run_dir = tmp_path / "resumed"
    env = {**os.environ, faults.FAULT_ENV: f"{mt.ECHO_FAULT_LABEL}:{kill_at}", "OMP_NUM_THREADS": "1"}
    killed = subprocess.run(
        [sys.executable, "-c", KILLED, str(TESTS), ENV_NAME, str(run_dir), *KILL_RUN],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert f"SIGKILL at {mt.ECHO_FAULT_LABEL}:{kill_at}" in killed.stderr
    assert CheckpointManager(run_dir).complete_steps()[-1] == 2
    assert sorted(_history(run_dir)) == [1, 2]

    capsys.readouterr()
    weights = _fit(run_dir)
    assert f"Resumed from {run_dir / 'global_step_2'} (step 2)" in capsys.readouterr().out
    _assert_same_runs(full, _history(run_dir), full_weights, weights)
