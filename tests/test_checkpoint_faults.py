"""Faults a run survives without losing a finished step (issue 21; ``docs/reliability.md``).

Each fault is injected for real and the test asserts what is left:

* two runs on one run directory: a second ``rlplug train`` is refused before any model loads, naming
  the live run's pid and host; a crashed run's stale lock is taken over with a warning
  (``rlplug.run.run_lock``);
* a full disk while writing a checkpoint (``ENOSPC``, injected with ``RLPLUG_TEST_KILL_AT=...:ENOSPC``
  or raised by the writer): the partial save is removed, the previous checkpoint stays complete and
  ``latest`` names it, the run stops with exit code 74 and a message naming the space needed and
  free;
* a corrupted checkpoint (truncated, bit-flipped, missing file): ``checksums.json`` catches it, resume
  warns naming the file and falls back to the previous intact checkpoint; ``rlplug checkpoint
  verify`` prints one line per step.

The end-to-end test chains the disk-full stop and the corrupted checkpoint in one run directory and
checks that the final weights equal an uninterrupted run's bit for bit.
"""

from __future__ import annotations

import errno
import gc
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from _helpers import LENGTH_SHAPING, TINY_CPU_RUN

from rlplug import checkpoint
from rlplug.base.exit_codes import DiskFullStopped, ExitCode
from rlplug.cli import main
from rlplug.config.schema import ConfigError
from rlplug.run.checkpoint import CHECKSUMS, COMPLETE, LATEST, CheckpointManager, verify_checkpoint
from rlplug.run.run_lock import LOCK_FILE, acquire_run_lock, lock_holder

# ============================================================================ helpers


def _writer(files: dict[str, bytes]):
    """A ``write(tmp)`` for :meth:`CheckpointManager.save` that writes ``files`` (relative path -> bytes)."""

    def write(tmp: Path) -> None:
        for rel, data in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_bytes(data)

    return write


FILES = {"backend/actor/model.safetensors": b"w" * 3000, "trainer_state.json": b'{"global_step": 1}'}


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


_HOLDER = r"""
import sys
from rlplug.run.run_lock import acquire_run_lock
lock = acquire_run_lock(sys.argv[1])
print("LOCKED", flush=True)
sys.stdin.read()  # hold the lock until the test closes stdin
lock.release()
"""


def _holder(run_dir: Path) -> subprocess.Popen:
    """Another process that takes ``run_dir``'s lock and holds it (until its stdin closes)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(run_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "LOCKED"
    return proc


# ============================================================================ 1. two runs, one directory


def test_a_second_train_on_a_live_runs_directory_is_refused_before_any_model_loads(tmp_path, monkeypatch, capsys):
    import rlplug.training.models

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded although the run directory is locked")

    monkeypatch.setattr(rlplug.training.models, "resolve_model_path", no_model)
    run_dir = tmp_path / "run"
    holder = _holder(run_dir)
    try:
        record = lock_holder(run_dir)
        assert record["pid"] == holder.pid and record["host"] == socket.gethostname()
        rc = main(["train", *TINY_CPU_RUN, f"trainer.default_local_dir={run_dir}"])
        err = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
        assert rc == ExitCode.BAD_INPUT == 2
        assert f"in use by another run: pid {holder.pid} on host {socket.gethostname()}, started" in err
        assert "trainer.default_local_dir=<another directory>" in err
    finally:
        holder.stdin.close()
        assert holder.wait(timeout=60) == 0
    # released cleanly: the file stays, empty, and the next run takes it without a warning
    assert (run_dir / LOCK_FILE).read_text() == ""
    lock = acquire_run_lock(run_dir)
    assert lock is not None and lock.taken_over is None
    assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert "stale" not in capsys.readouterr().err


def test_a_crashed_runs_stale_lock_is_taken_over_with_a_warning(tmp_path, capsys):
    run_dir = tmp_path / "run"
    holder = _holder(run_dir)
    holder.kill()  # SIGKILL: no clean release, the record stays in the file; the kernel drops the flock
    assert holder.wait(timeout=60) == -signal.SIGKILL
    assert lock_holder(run_dir)["pid"] == holder.pid
    lock = acquire_run_lock(run_dir)
    try:
        err = capsys.readouterr().err
        assert lock is not None and lock.taken_over["pid"] == holder.pid
        assert f"WARNING: taking over the stale lock {(run_dir / LOCK_FILE).resolve()} of a run" in err
        assert f"pid {holder.pid} on host {socket.gethostname()}" in err and "(no longer running)" in err
        assert lock_holder(run_dir)["pid"] == os.getpid()
        refused = subprocess.run(
            [sys.executable, "-c", _HOLDER, str(run_dir)], capture_output=True, text=True, timeout=120
        )
        assert refused.returncode == 1 and "RunDirLocked" in refused.stderr  # now held: another process is refused
        assert f"in use by another run: pid {os.getpid()} on host {socket.gethostname()}" in refused.stderr
    finally:
        lock.release()


def test_one_process_shares_its_lock_and_only_rank_zero_locks(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    first = acquire_run_lock(run_dir)
    second = acquire_run_lock(run_dir)  # a second Trainer in this process (after the first): shared, counted
    assert second is first and first.held
    first.release()
    assert first.held and lock_holder(run_dir)["pid"] == os.getpid()
    second.release()
    assert not first.held and lock_holder(run_dir) == {}
    dropped = acquire_run_lock(run_dir)  # dropped unreleased (a Trainer whose construction failed): unlocked
    assert lock_holder(run_dir)["pid"] == os.getpid()
    del dropped
    gc.collect()
    assert lock_holder(run_dir) == {}
    monkeypatch.setenv("RANK", "1")  # torchrun's other ranks belong to rank 0's run: no lock
    assert acquire_run_lock(run_dir) is None and lock_holder(run_dir) == {}


def test_open_run_dir_holds_the_lock_until_the_manager_closes(tmp_path):
    from _helpers import run_config

    cfg = run_config(TINY_CPU_RUN, tmp_path / "run", validate=False)
    manager, start = checkpoint.open_run_dir(cfg, tmp_path / "run")
    assert start.resume_from is None and manager.lock.held
    assert lock_holder(tmp_path / "run")["pid"] == os.getpid()
    manager.close()
    assert lock_holder(tmp_path / "run") == {}


# ============================================================================ 2. disk full


def test_the_fault_point_raises_an_errno(monkeypatch):
    monkeypatch.setattr(checkpoint, "_fault_counts", {})
    monkeypatch.setenv("RLPLUG_TEST_KILL_AT", "ckpt_backend:2:ENOSPC")
    checkpoint._fault_point("ckpt_backend")
    with pytest.raises(OSError) as info:
        checkpoint._fault_point("ckpt_backend")
    assert info.value.errno == errno.ENOSPC and "ckpt_backend:2" in str(info.value)


def test_disk_full_while_saving_keeps_the_previous_checkpoint_and_names_the_sizes(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path / "run", max_to_keep=1)
    first = manager.save(1, _writer(FILES))
    size = _dir_bytes(first)  # 3000 + 18 bytes of files, checksums.json, COMPLETE
    assert size > 3018

    def fills_the_disk(tmp: Path) -> None:
        (tmp / "backend").mkdir()
        (tmp / "backend" / "half.bin").write_bytes(b"x" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1234, 1234))
    with pytest.raises(DiskFullStopped) as info:
        manager.save(2, fills_the_disk)
    msg = str(info.value)
    assert info.value.exit_code == ExitCode.NO_SPACE == 74
    assert msg.startswith(f"Cannot write the checkpoint of step 2 in {manager.root}: No space left on device (ENOSPC).")
    assert (
        f"A checkpoint needs about {size / 1e3:.2f} kB ({size} bytes) (the size of the previous checkpoint, step 1)"
        in msg
    )
    assert "1.23 kB (1234 bytes) is free on that file system" in msg
    assert f"The previous checkpoint, step 1 ({first}), is complete and {LATEST} names it" in msg
    # nothing finished is lost, nothing half-written is left
    assert manager.latest() == first and (manager.root / LATEST).read_text() == "1"
    assert manager.partial_dirs() == [] and manager.complete_steps() == [1]
    assert sorted(p.name for p in manager.root.iterdir()) == ["global_step_1", LATEST]
    assert verify_checkpoint(first).ok


def test_the_writers_ways_of_saying_the_disk_is_full_are_recognised(tmp_path, monkeypatch):
    """What safetensors and torch.save raised on a real full tmpfs (130 MB, tiny run)."""
    safetensors_full = RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")
    torch_full = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 3392 vs 3284")
    wrapped = RuntimeError("save failed")
    wrapped.__cause__ = OSError(errno.EDQUOT, "Disk quota exceeded")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: usage(10**12, 10**11, 10**11))
    assert checkpoint._out_of_space(safetensors_full, tmp_path) and checkpoint._out_of_space(wrapped, tmp_path)
    assert not checkpoint._out_of_space(torch_full, tmp_path)  # 100 GB free: a real error, re-raised
    assert not checkpoint._out_of_space(OSError(errno.EIO, "Input/output error"), tmp_path)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: usage(10**9, 10**9, 3284))
    assert checkpoint._out_of_space(torch_full, tmp_path)  # torch names no errno: the free space tells


def test_disk_full_in_the_first_save_gives_what_was_written_as_a_lower_bound(tmp_path):
    manager = CheckpointManager(tmp_path / "run")

    def fills_the_disk(tmp: Path) -> None:
        (tmp / "a.bin").write_bytes(b"x" * 2500)
        raise OSError(errno.EDQUOT, "Disk quota exceeded")

    with pytest.raises(DiskFullStopped, match=r"needs more than 2.50 kB \(2500 bytes\) \(what was written"):
        manager.save(1, fills_the_disk)
    assert list(manager.root.iterdir()) == []


def test_a_failed_save_on_the_main_process_stops_the_other_processes_too(tmp_path):
    """fsdp2: the main process broadcasts the failure where the others wait for a path."""

    class _Coordinator:
        def __init__(self, is_main: bool, channel: list) -> None:
            self.is_main, self.world_size, self.channel, self.read = is_main, 2, channel, 0

        def broadcast(self, obj):
            if self.is_main:
                self.channel.append(obj)
                return obj
            self.read += 1
            return self.channel[self.read - 1]

    class _FullDisk:
        def save(self, directory: Path) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

    channel: list = []
    files = {"stateful": {}, "tokenizer": None, "model_path": tmp_path, "config": None}
    manager = CheckpointManager(tmp_path / "run")
    with pytest.raises(DiskFullStopped):
        checkpoint.save_checkpoint(manager, 1, backend=_FullDisk(), coordinator=_Coordinator(True, channel), **files)
    assert ".partial-" in channel[0] and channel[1]["type"] == "DiskFullStopped"

    class _Shard:
        def save(self, directory: Path) -> None:
            pass

    with pytest.raises(DiskFullStopped, match="Cannot write the checkpoint of step 1"):
        checkpoint.save_checkpoint(manager, 1, backend=_Shard(), coordinator=_Coordinator(False, channel))


# ============================================================================ 3. corrupted checkpoints


def test_checksums_json_records_every_files_size_and_sha256_before_complete(tmp_path):
    path = CheckpointManager(tmp_path / "run").save(1, _writer(FILES))
    assert json.loads((path / CHECKSUMS).read_text()) == {
        "algorithm": "sha256",
        "files": {rel: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()} for rel, data in FILES.items()},
    }
    assert json.loads((path / COMPLETE).read_text()) == {"step": 1, "checksums": CHECKSUMS}
    report = verify_checkpoint(path)
    assert report.ok and report.checked == 2 and report.line() == "global_step_1: ok (2 files, sha256)"


def _truncate(f: Path) -> None:
    os.truncate(f, 1000)


def _flip_a_bit(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[1234] ^= 0x01
    f.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, problem",
    [
        (_truncate, "backend/actor/model.safetensors: truncated: 1000 of 3000 bytes"),
        (
            _flip_a_bit,
            f"backend/actor/model.safetensors: sha256 differs from {CHECKSUMS} (the content changed: a flipped bit?)",
        ),
        (Path.unlink, "backend/actor/model.safetensors: missing"),
    ],
    ids=["truncated", "bit_flip", "missing"],
)
def test_verify_names_the_damaged_file(tmp_path, damage, problem):
    path = CheckpointManager(tmp_path / "run").save(1, _writer(FILES))
    damage(path / "backend/actor/model.safetensors")
    report = verify_checkpoint(path)
    assert report.problems == [problem]
    rel, _, why = problem.partition(": ")
    assert report.line() == f"global_step_1: corrupt: {rel} ({why})"


def test_a_checkpoint_without_checksums_is_checked_by_its_safetensors_sizes(tmp_path):
    """Saved before rlplug wrote checksums.json: COMPLETE holds only the step."""
    from safetensors.torch import save_file

    path = tmp_path / "global_step_3"
    (path / "backend" / "actor").mkdir(parents=True)
    weights = path / "backend" / "actor" / "model.safetensors"
    save_file({"w": torch.zeros(10, 10)}, str(weights))
    (path / COMPLETE).write_text('{"step": 3}')
    report = verify_checkpoint(path)
    assert report.ok and report.method == "structure" and report.checked == 1
    assert report.line() == (
        f"global_step_3: ok (1 files, structure); no {CHECKSUMS} (saved before rlplug recorded checksums): "
        "safetensors sizes checked only"
    )
    full = weights.stat().st_size
    os.truncate(weights, full - 4)
    assert verify_checkpoint(path).problems == [
        f"backend/actor/model.safetensors: truncated: {full - 4} bytes, its header says {full}"
    ]


def test_resume_falls_back_to_the_newest_intact_checkpoint(tmp_path, capsys):
    manager = CheckpointManager(tmp_path / "run")
    for step in (1, 2, 3):
        manager.save(step, _writer(FILES))

    class _Trainer:
        resume_mode, resume_from_path = "auto", None

    assert checkpoint.resume_checkpoint(_Trainer, manager) == manager.step_dir(3)
    _truncate(manager.step_dir(3) / "backend/actor/model.safetensors")
    (manager.step_dir(2) / "trainer_state.json").unlink()
    assert checkpoint.resume_checkpoint(_Trainer, manager) == manager.step_dir(1)
    out = capsys.readouterr().out
    assert (
        f"WARNING: checkpoint {manager.step_dir(3)} is corrupt: backend/actor/model.safetensors: truncated: "
        "1000 of 3000 bytes." in out
    )
    assert f"WARNING: checkpoint {manager.step_dir(2)} is corrupt: trainer_state.json: missing." in out
    assert f"WARNING: resuming from the previous intact checkpoint, {manager.step_dir(1)} (step 1)." in out
    # the corrupt ones are renamed aside (kept), the pointer names the one resumed from
    two, three = manager.corrupt_dirs()
    assert two.name.startswith("global_step_2.corrupt-") and three.name.startswith("global_step_3.corrupt-")
    assert manager.complete_steps() == [1] and (manager.root / LATEST).read_text() == "1"
    # resume_path names its checkpoint: a corrupt one is refused, not replaced by another
    _Trainer.resume_mode, _Trainer.resume_from_path = "resume_path", str(three)
    with pytest.raises(ConfigError, match=r"corrupt-\S+ is corrupt: backend/actor/model.safetensors: truncated"):
        checkpoint.resume_checkpoint(_Trainer, manager)
    # none intact: refused, each one's problem named, nothing renamed
    for step in (2, 3):
        manager.save(step, _writer(FILES))
        _flip_a_bit(manager.step_dir(step) / "backend/actor/model.safetensors")
    _Trainer.resume_mode = "auto"
    _flip_a_bit(manager.step_dir(1) / "backend/actor/model.safetensors")
    with pytest.raises(ConfigError, match="No intact checkpoint to resume from") as info:
        checkpoint.resume_checkpoint(_Trainer, manager)
    assert str(info.value).count(": sha256 differs") == 3 and manager.complete_steps() == [1, 2, 3]


def test_rlplug_checkpoint_verify_prints_one_line_per_step(tmp_path, capsys):
    manager = CheckpointManager(tmp_path / "run")
    for step in (1, 2):
        manager.save(step, _writer(FILES))
    (manager.root / "global_step_3.partial-77").mkdir()
    assert main(["checkpoint", "verify", str(manager.root)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "global_step_1: ok (2 files, sha256)",
        "global_step_2: ok (2 files, sha256) [latest]",
        "global_step_3.partial-77: incomplete (an interrupted save; ignored by resume, removed by the next save)",
    ]
    _flip_a_bit(manager.step_dir(2) / "backend/actor/model.safetensors")
    assert main(["checkpoint", "verify", str(manager.root)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == (
        f"global_step_2: corrupt: backend/actor/model.safetensors (sha256 differs from {CHECKSUMS} (the content "
        "changed: a flipped bit?)) [latest]"
    )
    assert lines[-1].startswith("1 of 2 checkpoints are corrupt")
    assert main(["checkpoint", "verify", str(manager.step_dir(1))]) == 0  # one step directory
    assert capsys.readouterr().out.splitlines() == ["global_step_1: ok (2 files, sha256)"]
    assert main(["checkpoint", "verify", str(tmp_path / "empty")]) == ExitCode.BAD_INPUT
    assert "No complete checkpoint at" in capsys.readouterr().err


# ============================================================================ end to end

RUN = TINY_CPU_RUN + [
    "actor.ppo_mini_batch_size=1",
    "actor.micro_batch_size_per_device=1",
    "trainer.total_training_steps=3",
    "trainer.save_freq=1",
    "trainer.logger=[]",
    *LENGTH_SHAPING,  # scores differ between responses: the updates change the weights
]


def _actor(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / f"global_step_{step}" / "backend" / "actor" / "model.safetensors"))


def test_disk_full_then_a_truncated_checkpoint_lose_no_finished_step(tmp_path, monkeypatch, capsys):
    """Run 1 saves steps 1 and 2, then the disk fills while step 3 is saved: exit 74, step 2 is the
    latest. Then step 2's weights are truncated (the bug: a raw ``SafetensorError: invalid header
    length`` traceback). Run 2 warns naming the file, resumes from step 1, trains steps 2 and 3:
    the weights equal an uninterrupted run's bit for bit, and every checkpoint verifies."""
    run_dir, ref_dir = tmp_path / "run", tmp_path / "reference"
    monkeypatch.setattr(checkpoint, "_fault_counts", {})
    monkeypatch.setenv("RLPLUG_TEST_KILL_AT", "ckpt_backend:3:ENOSPC")
    assert main(["train", *RUN, f"trainer.default_local_dir={run_dir}"]) == ExitCode.NO_SPACE
    out = " ".join(capsys.readouterr().out.split())
    assert f"Training stopped: Cannot write the checkpoint of step 3 in {run_dir}: No space left on device" in out
    assert "(the size of the previous checkpoint, step 2)" in out and "is free on that file system" in out
    manager = CheckpointManager(run_dir)
    assert manager.latest() == manager.step_dir(2) and manager.partial_dirs() == []
    assert manager.complete_steps() == [1, 2] and not (run_dir / "final_model").exists()
    assert lock_holder(run_dir) == {}  # the stopped run released its lock

    monkeypatch.delenv("RLPLUG_TEST_KILL_AT")
    os.truncate(manager.step_dir(2) / "backend" / "actor" / "model.safetensors", 1000)
    assert main(["train", *RUN, f"trainer.default_local_dir={run_dir}"]) == 0
    out = capsys.readouterr().out
    assert (
        f"WARNING: checkpoint {manager.step_dir(2)} is corrupt: backend/actor/model.safetensors: truncated: 1000 of"
        in out
    )
    assert f"Resumed from {manager.step_dir(1)} (step 1)." in out and "Training finished at step 3" in out

    assert main(["train", *RUN, f"trainer.default_local_dir={ref_dir}"]) == 0  # uninterrupted
    capsys.readouterr()
    for step in (2, 3):
        ref, got = _actor(ref_dir, step), _actor(run_dir, step)
        assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref), f"step {step} differs"
    assert not all(torch.equal(a, b) for a, b in zip(_actor(ref_dir, 1).values(), _actor(ref_dir, 3).values()))
    assert main(["checkpoint", "verify", str(run_dir)]) == 0
    assert capsys.readouterr().out.count(": ok (") == 3


# ============================================================================ review findings (round 4)


def test_a_non_writer_error_on_a_nearly_full_disk_is_not_a_full_disk(tmp_path, monkeypatch):
    """Finding 10: with < 64 MiB free, a plugin's TypeError was reported as a full disk (exit 74) and its
    partial save deleted. Only the writers' error types (OSError, RuntimeError, SafetensorError) count."""
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: usage(10**9, 10**9, 3284))
    assert not checkpoint._out_of_space(TypeError("save() got an unexpected keyword argument 'x'"), tmp_path)
    assert checkpoint._out_of_space(RuntimeError("[enforce fail at inline_container.cc:672]"), tmp_path)
    manager = CheckpointManager(tmp_path / "run")

    def plugin_bug(tmp: Path) -> None:
        (tmp / "half.bin").write_bytes(b"x" * 10)
        raise TypeError("save() got an unexpected keyword argument 'x'")

    with pytest.raises(TypeError, match="unexpected keyword argument"):
        manager.save(1, plugin_bug)
    assert [p.name for p in manager.partial_dirs()] == [f"global_step_1.partial-{os.getpid()}"]  # kept to inspect


def test_overwrite_moves_the_earlier_runs_rollout_dumps_aside(tmp_path):
    """Finding 7: trainer.overwrite=true left rollouts/ in place, and the new run's first dump deleted them."""
    from omegaconf import OmegaConf

    from rlplug.run.checkpoint import set_aside_checkpoints
    from rlplug.run.dump import dump_rollouts

    manager = CheckpointManager(tmp_path)
    manager.save(3, _writer(FILES))
    (tmp_path / "rollouts").mkdir()
    (tmp_path / "rollouts" / "step_000003.parquet").write_bytes(b"the earlier run's dump")
    aside = set_aside_checkpoints(manager)
    assert aside is not None and (aside / "rollouts" / "step_000003.parquet").read_bytes() == b"the earlier run's dump"

    class _T:
        cfg = OmegaConf.create({"trainer": {"dump_rollouts": True, "dump_rollouts_freq": 2}})
        run_dir, is_main = tmp_path, True

    dump_rollouts(_T(), 1, [], [], None, None, None)  # the new run's first step (not dumped: freq 2) prunes
    assert (aside / "rollouts" / "step_000003.parquet").is_file()


def test_a_fallback_renames_the_corrupt_checkpoint_so_the_cleanup_keeps_the_good_one(tmp_path, capsys):
    """Finding 8: after a fallback from the corrupt step 4 to step 2, saving step 3 with max_to_keep=2 deleted
    step 2 (the good one) and kept the corrupt step 4, which still counted as complete."""
    manager = CheckpointManager(tmp_path / "run", max_to_keep=2)
    for step in (2, 4):
        manager.save(step, _writer(FILES))
    _flip_a_bit(manager.step_dir(4) / "backend/actor/model.safetensors")

    class _Trainer:
        resume_mode, resume_from_path = "auto", None

    assert checkpoint.resume_checkpoint(_Trainer, manager) == manager.step_dir(2)
    (aside,) = manager.corrupt_dirs()
    assert aside.name.startswith("global_step_4.corrupt-") and aside.name.endswith(f"-{os.getpid()}")
    assert f"WARNING: renamed the corrupt checkpoint {manager.step_dir(4)} to {aside.name}" in capsys.readouterr().out
    assert manager.complete_steps() == [2] and (manager.root / LATEST).read_text() == "2"
    manager.save(3, _writer(FILES))
    assert manager.complete_steps() == [2, 3] and manager.corrupt_dirs() == [aside]  # nothing intact deleted
    assert main(["checkpoint", "verify", str(manager.root)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "global_step_2: ok (2 files, sha256)",
        "global_step_3: ok (2 files, sha256) [latest]",
        f"{aside.name}: set aside as corrupt by a resume (never resumed or removed; delete it once inspected)",
    ]
    # none intact: nothing is renamed, the error names them all
    _flip_a_bit(manager.step_dir(2) / "backend/actor/model.safetensors")
    _flip_a_bit(manager.step_dir(3) / "backend/actor/model.safetensors")
    with pytest.raises(ConfigError, match="No intact checkpoint"):
        checkpoint.resume_checkpoint(_Trainer, manager)
    assert manager.complete_steps() == [2, 3]


class _TwoRanks:
    """A coordinator of a two-process group whose broadcast hands out rank 0's ``sent`` object."""

    world_size, is_main = 2, False

    def __init__(self, sent):
        self.sent = sent

    def broadcast(self, obj):
        return self.sent


def test_only_rank_zero_verifies_the_checkpoint_it_resumes(tmp_path, monkeypatch):
    """Finding 4: every torchrun rank hashed the checkpoint on resume; now rank 0 verifies and broadcasts."""
    from rlplug.config.compose import compose
    from rlplug.run.checkpoint import open_run_dir

    run_dir = tmp_path / "run"
    manager = CheckpointManager(run_dir)
    manager.save(1, _writer(FILES))
    cfg = compose([f"trainer.default_local_dir={run_dir}"])
    calls: list[Path] = []
    real = checkpoint.verify_checkpoint
    monkeypatch.setattr(checkpoint, "verify_checkpoint", lambda p: calls.append(Path(p)) or real(p))
    monkeypatch.setenv("RANK", "1")
    ckpt, start = open_run_dir(cfg, run_dir)
    assert calls == [] and start.resume_from is None and ckpt.lock is None  # rank 1: no hashing, no lock
    assert start.begin(coordinator=_TwoRanks(str(manager.step_dir(1)))) == manager.step_dir(1)  # rank 0's pick
    assert calls == []
    _, alone = open_run_dir(cfg, run_dir)  # RANK set without a process group: it selects by itself
    assert alone.begin(coordinator=checkpoint_coordinator()) == manager.step_dir(1) and calls == [manager.step_dir(1)]
    monkeypatch.setenv("RANK", "0")
    ckpt, start = open_run_dir(cfg, run_dir)
    assert start.resume_from == manager.step_dir(1) and len(calls) == 2
    ckpt.close()


def checkpoint_coordinator():
    from rlplug.contracts.coordinator import SINGLE_PROCESS

    return SINGLE_PROCESS


def test_lora_settings_are_in_the_fingerprint_and_a_backend_load_error_is_a_config_error(tmp_path):
    """Finding 5: another model.lora_rank/alpha/targets resumed into a raw ValueError from rlplug.training.lora, and only
    after the models and the rollout engine loaded."""
    from rlplug.config.compose import compose
    from rlplug.run.checkpoint import fingerprint_diff, load_checkpoint, run_fingerprint

    full, lora = run_fingerprint(compose([])), run_fingerprint(compose(["model.lora_rank=8", "model.lora_alpha=32"]))
    assert full["model.lora"] is None and full["critic.model.lora"] is None
    assert lora["model.lora"] == {
        "lora_rank": 8,
        "lora_alpha": 32,
        "target_modules": "all-linear",
        "exclude_modules": None,
    }
    other = run_fingerprint(compose(["model.lora_rank=8", "model.lora_alpha=32", "model.target_modules=[q_proj]"]))
    assert fingerprint_diff(lora, other) == [("model.lora.target_modules", "all-linear", ["q_proj"])]
    critic = run_fingerprint(compose(["critic.model.lora_rank=4"]))["critic.model.lora"]
    assert critic == {"lora_rank": 4, "lora_alpha": 16, "target_modules": "all-linear", "exclude_modules": None}

    path = tmp_path / "global_step_1"
    path.mkdir()
    (path / "trainer_state.json").write_text('{"global_step": 1}')

    class _OtherShape:
        def load(self, directory):
            raise ValueError(
                "The LoRA adapters in backend/actor do not fit this model: 64 adapter tensors saved, 8 here"
            )

    with pytest.raises(
        ConfigError, match=r"Cannot resume from .*global_step_1: the training backend cannot load"
    ) as info:
        load_checkpoint(path, backend=_OtherShape(), stateful={})
    assert "64 adapter tensors saved, 8 here" in str(info.value) and "LoRA rank" in str(info.value)
