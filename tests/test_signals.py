"""SIGTERM / Ctrl-C: finish the current step, write a checkpoint, exit 0 with a resume hint.

Signals are sent at exact places with the testing aid ``RLPLUG_TEST_KILL_AT=<label>:<n>:<SIGNAL>``
(see ``rlplug.run.checkpoint._fault_point``): the process signals itself there, so the trainer's
handler runs in the middle of that stage. One test uses a real ``python -m rlplug train``
subprocess; the others run ``rlplug.run.trainer.run(cfg)`` in this process (the handlers are
installed for the duration of ``fit`` and restored afterwards).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from _helpers import TINY_CPU_RUN, run_config

from rlplug.run.checkpoint import CheckpointManager
from rlplug.run.trainer import run

OVERRIDES = TINY_CPU_RUN + [
    "algorithm=grpo",
    "rollout.n=2",
    "actor.ppo_mini_batch_size=1",
    "actor.micro_batch_size_per_device=1",
    "trainer.total_training_steps=4",
    "trainer.save_freq=0",  # a checkpoint only because of the signal (and at the end)
    "trainer.logger=[console]",
]


@pytest.fixture(autouse=True)
def _fresh_fault_counts(monkeypatch):
    """The fault points count per process; each in-process run here starts from zero."""
    from rlplug import checkpoint

    monkeypatch.setattr(checkpoint, "_fault_counts", {})


def _cfg(run_dir, *extra: str):
    return run_config(OVERRIDES, run_dir, *extra)


def _state_step(checkpoint_dir) -> int:
    return json.loads((checkpoint_dir / "trainer_state.json").read_text())["global_step"]


def test_sigterm_subprocess_saves_exits_75_then_resume_finishes(tmp_path):
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        RLPLUG_TEST_KILL_AT="update_actor:2:SIGTERM",
    )  # in the middle of step 2's updates
    cmd = [sys.executable, "-m", "rlplug", "train", *OVERRIDES, f"trainer.default_local_dir={tmp_path}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    # a distinct code, so a scheduler does not take a stopped run for a finished one
    assert proc.returncode == 75, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "RLPLUG_TEST_KILL_AT: SIGTERM at update_actor:2" in proc.stderr
    assert "Received SIGTERM: finishing the current step, then saving a checkpoint" in proc.stdout
    assert (
        f"Stopped after step 2 (a signal); checkpoint saved in {tmp_path}. "
        "Resume with the same command (trainer.resume_mode=auto). Exit code 75."
    ) in proc.stdout
    manager = CheckpointManager(tmp_path)
    assert manager.complete_steps() == [2] and manager.partial_dirs() == []
    assert _state_step(manager.latest()) == 2
    assert not (tmp_path / "final_model").exists()

    # the same command again (here in-process) resumes at step 3 and finishes
    assert run(_cfg(tmp_path)) == 0
    assert manager.complete_steps() == [2, 4]
    assert (tmp_path / "final_model" / "model.safetensors").is_file()


def test_ctrl_c_in_rollout_finishes_the_step_and_restores_handlers(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RLPLUG_TEST_KILL_AT", "rollout:3:SIGINT")
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    assert run(_cfg(tmp_path, "trainer.save_freq=2")) == 75
    out = capsys.readouterr().out
    assert "Received SIGINT" in out and "Stopped after step 3 (a signal)" in out
    manager = CheckpointManager(tmp_path)
    assert manager.complete_steps() == [2, 3]  # save_freq=2, then the signal's checkpoint
    assert _state_step(manager.latest()) == 3
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_second_signal_stops_at_once_leaving_the_last_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("RLPLUG_TEST_KILL_AT", "rollout:2:SIGINT,update_actor:2:SIGTERM")  # not one delivered twice
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        run(_cfg(tmp_path, "trainer.save_freq=1"))
    manager = CheckpointManager(tmp_path)
    assert manager.complete_steps() == [1] and manager.partial_dirs() == []
    assert signal.getsignal(signal.SIGINT) == before


def test_signal_during_a_checkpoint_save_completes_it_then_stops(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RLPLUG_TEST_KILL_AT", "ckpt_backend:1:SIGTERM")  # inside step 1's save
    assert run(_cfg(tmp_path, "trainer.save_freq=1")) == 75
    assert "Stopped after step 1 (a signal)" in capsys.readouterr().out
    manager = CheckpointManager(tmp_path)
    assert manager.complete_steps() == [1] and manager.partial_dirs() == []
    assert _state_step(manager.latest()) == 1


def test_signal_in_the_last_step_just_finishes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RLPLUG_TEST_KILL_AT", "update_actor:2:SIGTERM")
    assert run(_cfg(tmp_path, "trainer.total_training_steps=2")) == 0
    out = capsys.readouterr().out
    assert "Training finished at step 2" in out and "Stopped after" not in out
    assert CheckpointManager(tmp_path).complete_steps() == [2]
    assert (tmp_path / "final_model" / "model.safetensors").is_file()


def test_one_signal_delivered_twice_is_one_request_and_a_later_second_stops_at_once(monkeypatch) -> None:
    """GNU ``timeout`` sends SIGTERM to the trainer and to its process group: two deliveries microseconds
    apart. That is one request (finish the step, save); a second one 0.1 s or more later, or another
    signal, stops now."""
    import types

    import rlplug.run.trainer as trainer_mod
    from rlplug.run.trainer import Trainer

    clock = [100.0]
    monkeypatch.setattr(trainer_mod.time, "monotonic", lambda: clock[0])
    t = types.SimpleNamespace(_stop_signal=None, _stop_signal_at=float("-inf"))
    Trainer._handle_signal(t, signal.SIGTERM, None)  # type: ignore[arg-type]
    assert t._stop_signal == signal.SIGTERM
    clock[0] += 0.001
    try:
        Trainer._handle_signal(t, signal.SIGTERM, None)  # type: ignore[arg-type]  # the group's copy: ignored
    except KeyboardInterrupt:
        pytest.fail("one SIGTERM delivered twice (GNU timeout) was taken as a second request")
    assert t._stop_signal == signal.SIGTERM
    with pytest.raises(KeyboardInterrupt):
        Trainer._handle_signal(t, signal.SIGINT, None)  # type: ignore[arg-type]  # another signal: now
    clock[0] += 0.2
    with pytest.raises(KeyboardInterrupt):
        Trainer._handle_signal(t, signal.SIGTERM, None)  # type: ignore[arg-type]  # the same, 0.2 s on: now
