"""Async training survives kill -9 with nothing lost and nothing repeated (issue 34).

Chain A, ``trainer.async_mode=async`` (``max_staleness=2``, ``stale_policy=wait``: the producer generates up to
three batches ahead of training): one epoch of 12 prompts in 6 steps, a checkpoint every step. Each run SIGKILLs
itself at the chain's next point (``RLPLUG_TEST_KILL_AT``: in the producer's generation, in the passes, in a
checkpoint's write, right after a resume ...) and the next run resumes from what it left; the last one finishes.
The rollout dumps of the 6 steps then hold every prompt of the epoch (its ``extra_info.index``) exactly once, in
the order an uninterrupted run trains them: the checkpoint's data cursor covers what was trained or queued, never
what the producer had drawn ahead, and the queued rollouts come back from the checkpoint.

Chain B (slow step), ``one_step_off``: killed at three points, resumed; its final weights equal an uninterrupted
one-step-off run's bit for bit (the rollout queued at a checkpoint, made with the previous weights, is restored).

The runs are forked from tests/test_kill_resume.py's zygote (imports paid once); the engine's process is a fresh
interpreter each time and dies with its trainer.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from test_kill_resume import Zygote

BASE = [
    "debug=tiny",
    "algorithm=grpo",
    "rollout.n=2",
    "model.tiny.num_hidden_layers=1",
    "data.train_size=12",
    "data.train_batch_size=2",
    "actor.ppo_mini_batch_size=2",
    "data.max_response_length=6",
    "trainer.total_training_steps=6",
    "trainer.save_freq=1",
    "trainer.max_ckpt_to_keep=2",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
    "trainer.logger=[console]",
    "trainer.num_threads=1",
    "rollout.num_threads=1",
    "trainer.device=cpu",
    "trainer.resume_mode=auto",
    "trainer.dump_rollouts=true",
]
ASYNC = [*BASE, "trainer.async_mode=async", "trainer.max_staleness=2", "trainer.stale_policy=wait"]
OFF = [*BASE, "trainer.async_mode=one_step_off"]

#: ten points, in the order the chain meets them (each run resumes where the one before left)
CHAIN_A = [
    "rollout:2",  # the producer's second batch, generated ahead while step 1 trains
    "update_actor:1",
    "ckpt_state:1",  # inside step 1's checkpoint: a partial directory
    "step_end:2",
    "rollout:1",  # the first batch generated after a resume
    "ckpt_renamed:1",
    "resumed:1",
    "old_log_prob:1",
    "reward:1",
    "update_weights:1",
]
CHAIN_B = ["rollout:3", "update_actor:2", "ckpt_pointer:1"]


def _trained_prompts(run_dir: Path, n_steps: int = 6) -> list[list[int]]:
    """Per step 1..n_steps, the dataset indices of the prompts its dump holds (one per group)."""
    steps = []
    for step in range(1, n_steps + 1):
        rows = pq.read_table(run_dir / "rollouts" / f"step_{step:06d}.parquet").to_pylist()
        seen: dict[str, int] = {}
        for r in rows:
            seen.setdefault(r["uid"], int(json.loads(r["extra_info"])["index"]))
        steps.append(list(seen.values()))
    return steps


def _chain(zygote: Zygote, run_dir: Path, overrides: list[str], points: list[str]) -> list[str]:
    """Run the chain; returns the problems found (empty: every run died where it should, the last finished)."""
    problems = []
    for point in points:
        run = zygote.train(run_dir, point, overrides)
        if run.returncode != -9:
            problems.append(f"{point}: exit {run.returncode}, expected -9\n{run.stderr[-2000:]}")
    last = zygote.train(run_dir, None, overrides)
    if last.returncode != 0:
        problems.append(f"final run: exit {last.returncode}\n{last.stdout[-1500:]}\n{last.stderr[-3000:]}")
    return problems


def _actor_state(run_dir: Path) -> dict[str, torch.Tensor]:
    """The last checkpoint's actor weights and optimizer state, and the exported model."""
    from safetensors.torch import load_file

    ckpt = run_dir / "global_step_6" / "backend" / "actor"
    out = {f"actor/{k}": v for k, v in load_file(str(ckpt / "model.safetensors")).items()}
    for pid, st in torch.load(ckpt / "optimizer.pt", weights_only=True)["state"].items():
        out.update({f"optim/{pid}/{k}": torch.as_tensor(v) for k, v in st.items()})
    out.update({f"final/{k}": v for k, v in load_file(str(run_dir / "final_model" / "model.safetensors")).items()})
    return out


def _with_reference(tmp_path: Path, overrides: list[str], points: list[str]) -> None:
    """The chain on one zygote, an uninterrupted run (``ref``) beside it on another."""
    zygotes = [Zygote(tmp_path / "logs_chain"), Zygote(tmp_path / "logs_ref")]
    try:
        with ThreadPoolExecutor(2) as pool:
            chain = pool.submit(_chain, zygotes[0], tmp_path / "chain", overrides, points)
            ref = pool.submit(zygotes[1].train, tmp_path / "ref", None, overrides)
            problems = chain.result()
            assert ref.result().returncode == 0, ref.result().stderr[-3000:]
        assert not problems, "\n\n".join(problems)
    finally:
        for z in zygotes:
            z.close()


def test_async_kill_resume_loses_and_repeats_no_prompt(tmp_path) -> None:
    _with_reference(tmp_path, ASYNC, CHAIN_A)
    killed, uninterrupted = _trained_prompts(tmp_path / "chain"), _trained_prompts(tmp_path / "ref")
    flat = [p for step in killed for p in step]
    assert sorted(flat) == list(range(12)), f"each of the epoch's 12 prompts exactly once: {killed}"
    assert killed == uninterrupted  # and in the loader's order


@pytest.mark.slow
def test_one_step_off_resumes_bit_for_bit_after_kills(tmp_path) -> None:
    _with_reference(tmp_path, OFF, CHAIN_B)
    got, want = _actor_state(tmp_path / "chain"), _actor_state(tmp_path / "ref")
    assert got.keys() == want.keys() and len(want) > 0
    for k in want:
        assert torch.equal(got[k], want[k]), f"one_step_off after kills: {k} differs"
