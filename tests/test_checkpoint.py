"""CheckpointManager: layout, the ``latest`` pointer, partial directories, and crash safety.

A crash is simulated in-process by making ``_fault_point(label)`` raise a BaseException at one
label: nothing in ``CheckpointManager.save`` catches it or cleans up, so the directory is left
exactly as a SIGKILL at that point would leave it (``tests/test_kill_resume.py`` does the real
SIGKILL in subprocesses). Every case then checks that ``latest()`` names a checkpoint whose
files are all there with the content written for that step.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from rlplug import checkpoint
from rlplug.run.checkpoint import COMPLETE, LATEST, CheckpointManager, atomic_write_text
from rlplug.run.export import export_checkpoint

FILES = ("backend/actor/model.safetensors", "backend/actor/optimizer.pt", "trainer_state.json", "rng_state.pt")


class _Crash(BaseException):
    """Stands in for SIGKILL: not an Exception, so nothing on the way up handles it."""


def _writer(step: int, tag: str = ""):
    """A ``write(tmp)`` callback filling the checkpoint with files whose content names ``step``."""

    def write(tmp: Path) -> None:
        for rel in FILES:
            f = tmp / rel
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(f"step={step}{tag} file={rel}")

    return write


def _assert_intact(path: Path, step: int, tag: str = "") -> None:
    assert path.name == f"global_step_{step}"
    assert (path / COMPLETE).is_file()
    for rel in FILES:
        assert (path / rel).read_text() == f"step={step}{tag} file={rel}", rel


def _crash_at(monkeypatch, label: str, nth: int = 1) -> None:
    seen = {"n": 0}

    def fault(lbl: str) -> None:
        if lbl == label:
            seen["n"] += 1
            if seen["n"] == nth:
                raise _Crash(label)

    monkeypatch.setattr(checkpoint, "_fault_point", fault)


def _step_of(path: Path | None) -> int | None:
    return None if path is None else int(path.name.rsplit("_", 1)[1])


# ============================================================================ normal operation


def test_save_writes_complete_dirs_pointer_and_keeps_the_newest(tmp_path):
    m = CheckpointManager(tmp_path, max_to_keep=2)
    assert m.latest() is None and m.complete_steps() == [] and m.partial_dirs() == []
    for step in (1, 2, 3):
        path = m.save(step, _writer(step))
        _assert_intact(path, step)
        assert (tmp_path / LATEST).read_text() == str(step)
    assert m.complete_steps() == [2, 3]  # step 1 removed: at most 2 kept
    _assert_intact(m.latest(), 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_2", "global_step_3", LATEST]


def test_max_to_keep_none_keeps_all(tmp_path):
    m = CheckpointManager(tmp_path, max_to_keep=None)
    for step in (1, 2, 3):
        m.save(step, _writer(step))
    assert m.complete_steps() == [1, 2, 3]


def test_pointer_missing_garbage_or_partial_falls_back_to_highest_complete(tmp_path, caplog):
    m = CheckpointManager(tmp_path, max_to_keep=None)
    for step in (1, 2):
        m.save(step, _writer(step))
    pointer = tmp_path / LATEST
    pointer.unlink()
    _assert_intact(m.latest(), 2)
    # garbage (read as -1), names no checkpoint
    for text, read_as in (("not a number", "-1"), ("7", "7")):
        pointer.write_text(text)
        with caplog.at_level(logging.WARNING, logger="rlplug.run.checkpoint"):
            caplog.clear()
            _assert_intact(m.latest(), 2)
        assert f"says {read_as}; using the latest complete checkpoint, step 2" in caplog.text
    # a pointer naming a step dir without COMPLETE is not trusted either
    (tmp_path / "global_step_9").mkdir()
    pointer.write_text("9")
    _assert_intact(m.latest(), 2)


def test_an_older_pointer_naming_a_complete_checkpoint_is_followed(tmp_path, caplog, capsys):
    """The pointer is the truth: a newer complete step beside it is reported, not used (issue 14)."""
    m = CheckpointManager(tmp_path, max_to_keep=None)
    for step in (1, 2):
        m.save(step, _writer(step))
    (tmp_path / LATEST).write_text("1")
    with caplog.at_level(logging.WARNING, logger="rlplug.run.checkpoint"):
        _assert_intact(m.latest(), 1)
    assert f"names step 1, but newer complete checkpoints exist beside it: {tmp_path / 'global_step_2'}" in caplog.text
    assert "Using step 1, as the pointer says" in capsys.readouterr().out


def test_partial_dirs_are_reported_ignored_and_removed_by_the_next_save(tmp_path, caplog):
    m = CheckpointManager(tmp_path, max_to_keep=None)
    m.save(1, _writer(1))
    stale = [tmp_path / "global_step_2.partial-999", tmp_path / "global_step_3"]  # interrupted save; no COMPLETE
    for d in stale:
        d.mkdir()
        (d / "trainer_state.json").write_text("{}")
    marked = tmp_path / "global_step_4.partial-998"  # COMPLETE written but never renamed
    marked.mkdir()
    (marked / COMPLETE).write_text("{}")
    assert m.partial_dirs() == sorted(stale + [marked])
    assert m.complete_steps() == [1]
    with caplog.at_level(logging.WARNING, logger="rlplug.run.checkpoint"):
        _assert_intact(m.latest(), 1)
    assert caplog.text.count("Ignoring incomplete checkpoint") == 3
    (tmp_path / f".{LATEST}.tmp-998").write_text("4")  # an interrupted pointer update
    m.save(2, _writer(2))
    assert m.partial_dirs() == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1", "global_step_2", LATEST]


def test_write_that_raises_leaves_the_previous_checkpoint_latest(tmp_path):
    m = CheckpointManager(tmp_path)
    m.save(1, _writer(1))

    def broken(tmp: Path) -> None:
        (tmp / "trainer_state.json").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        m.save(2, broken)
    _assert_intact(m.latest(), 1)
    assert [p.name for p in m.partial_dirs()] == [f"global_step_2.partial-{os.getpid()}"]
    m.save(2, _writer(2))  # the retry replaces its own partial dir
    _assert_intact(m.latest(), 2)
    assert m.partial_dirs() == []


def test_resaving_an_existing_step_replaces_it(tmp_path):
    m = CheckpointManager(tmp_path)
    m.save(1, _writer(1))
    m.save(2, _writer(2))
    m.save(2, _writer(2, tag="-again"))  # e.g. after resume_path from an older checkpoint
    _assert_intact(m.latest(), 2, tag="-again")
    assert m.partial_dirs() == []


def test_atomic_write_text(tmp_path):
    target = tmp_path / "f.txt"
    atomic_write_text(target, "one")
    atomic_write_text(target, "two")
    assert target.read_text() == "two"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]


# ============================================================================ crashes


# label -> (latest checkpoint after a crash while saving step 3, steps 1 and 2 saved before;
#           the complete steps after the next save, of step 4, with max_to_keep=2)
CRASH_POINTS = {
    "ckpt_tmp_created": (2, [2, 4]),
    "ckpt_written": (2, [2, 4]),
    "ckpt_marked": (2, [2, 4]),  # COMPLETE inside the partial dir: still not a checkpoint until renamed
    # renamed, pointer still says 2: the pointer is followed (a resume replays step 3); the
    # complete step 3 stays until max_to_keep removes the oldest
    "ckpt_renamed": (2, [3, 4]),
    "pointer_tmp_written": (2, [3, 4]),  # the new pointer is only a temp file
    "ckpt_pointer": (3, [3, 4]),
    "ckpt_cleanup": (3, [3, 4]),
}


@pytest.mark.parametrize("label", sorted(CRASH_POINTS))
def test_crash_while_saving_never_exposes_a_partial_checkpoint(tmp_path, monkeypatch, label):
    m = CheckpointManager(tmp_path, max_to_keep=2)
    m.save(1, _writer(1))
    m.save(2, _writer(2))
    (tmp_path / "global_step_7.partial-1").mkdir()  # a stale partial dir, so cleanup has work
    _crash_at(monkeypatch, label)
    with pytest.raises(_Crash):
        m.save(3, _writer(3))
    monkeypatch.setattr(checkpoint, "_fault_point", lambda label: None)
    expected, after_next_save = CRASH_POINTS[label]
    latest = m.latest()
    _assert_intact(latest, expected)
    for step in m.complete_steps():  # every directory that looks complete is complete
        _assert_intact(m.step_dir(step), step)
    # the next save succeeds and leaves a clean directory
    _assert_intact(m.save(4, _writer(4)), 4)
    assert m.partial_dirs() == []
    assert m.complete_steps() == after_next_save  # max_to_keep=2
    assert not list(tmp_path.glob(f".{LATEST}.tmp-*"))


def test_crash_while_replacing_an_existing_step_falls_back_to_the_older_one(tmp_path, monkeypatch):
    m = CheckpointManager(tmp_path, max_to_keep=None)
    m.save(1, _writer(1))
    m.save(2, _writer(2))
    _crash_at(monkeypatch, "ckpt_old_moved")
    with pytest.raises(_Crash):
        m.save(2, _writer(2, tag="-again"))
    monkeypatch.setattr(checkpoint, "_fault_point", lambda label: None)
    # the old step 2 is gone, the new one is only a partial dir: step 1 is the latest complete one
    _assert_intact(m.latest(), 1)
    assert m.complete_steps() == [1]


def test_crash_in_the_middle_of_deleting_an_old_checkpoint(tmp_path, monkeypatch):
    """A kill during the removal of a checkpoint beyond max_to_keep must not leave a directory that
    still has COMPLETE but lacks files (it would be taken as a complete checkpoint)."""
    m = CheckpointManager(tmp_path, max_to_keep=1)
    m.save(1, _writer(1))
    real_rmtree = checkpoint.shutil.rmtree

    def rmtree_killed_halfway(path, ignore_errors=False):
        files = sorted(Path(path).rglob("*.pt"))
        if files:  # delete one file, then "die"
            files[0].unlink()
            raise _Crash(str(path))
        real_rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", rmtree_killed_halfway)
    with pytest.raises(_Crash):
        m.save(2, _writer(2))
    monkeypatch.setattr(checkpoint.shutil, "rmtree", real_rmtree)
    assert m.complete_steps() == [2]  # the half-deleted step 1 does not look complete
    _assert_intact(m.latest(), 2)
    assert [p.name.split(".")[0] for p in m.partial_dirs()] == ["global_step_1"]
    m.save(3, _writer(3))
    assert m.partial_dirs() == [] and m.complete_steps() == [3]


def test_export_checkpoint_without_a_complete_checkpoint_says_so(tmp_path):
    (tmp_path / "global_step_1.partial-5").mkdir()
    with pytest.raises(FileNotFoundError, match="No complete checkpoint"):
        export_checkpoint(tmp_path, tmp_path / "out")


@pytest.mark.parametrize("damage", ["drop", "rename"])
def test_export_refuses_weights_that_do_not_fit_the_model(tmp_path, damage):
    # a dropped tensor would stay uninitialised (meta) and a renamed one (a wrapper prefix) would be
    # ignored by load_state_dict(strict=False): both must fail loudly, not write a broken folder
    import shutil

    from safetensors.torch import load_file, save_file

    from rlplug.config.schema import TinyModelConfig
    from rlplug.training.models import tiny_model_dir

    src = tiny_model_dir(TinyModelConfig())
    ckpt = tmp_path / "global_step_1"
    (ckpt / "hf_meta").mkdir(parents=True)
    (ckpt / "backend" / "actor").mkdir(parents=True)
    shutil.copy(src / "config.json", ckpt / "hf_meta" / "config.json")
    state = load_file(str(src / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    tensor = state.pop(name)
    if damage == "rename":
        state["_orig_mod." + name] = tensor
    save_file(state, str(ckpt / "backend" / "actor" / "model.safetensors"))
    (ckpt / COMPLETE).write_text("")
    expected = rf"missing \['{name}'\], unexpected \[{repr('_orig_mod.' + name) if damage == 'rename' else ''}\]"
    with pytest.raises(ValueError, match=expected):
        export_checkpoint(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------- the run's checkpoint


class _Backend:
    """Records save/load; ``save`` writes one file naming the process."""

    def __init__(self, rank: int = 0) -> None:
        self.rank, self.saved, self.loaded = rank, [], []

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"shard{self.rank}.txt").write_text(f"rank {self.rank}")
        self.saved.append(directory)

    def load(self, directory: Path) -> None:
        self.loaded.append(directory)


class _Tokenizer:
    def save_pretrained(self, directory: Path) -> None:
        (Path(directory) / "tokenizer.json").write_text("{}")


class _Stateful:
    def __init__(self, state: dict) -> None:
        self.state = dict(state)

    def state_dict(self) -> dict:
        return dict(self.state)

    def load_state_dict(self, state: dict) -> None:
        if set(state) != set(self.state):
            raise ValueError(f"keys {sorted(state)} differ")
        self.state = dict(state)


class _Coordinator:
    """A fake coordinator: broadcasts replay what the main process sent (``sent``)."""

    def __init__(self, is_main: bool, sent: list | None = None) -> None:
        self.world_size, self.is_main, self.sent, self.received = 2, is_main, sent if sent is not None else [], []

    def broadcast(self, obj):
        if self.is_main:
            self.sent.append(obj)
            return obj
        value = self.sent[len(self.received)]
        self.received.append(value)
        return value


def test_save_and_load_checkpoint_layout_state_and_rng(tmp_path):
    import random

    import torch
    from omegaconf import OmegaConf

    from rlplug.config.schema import ConfigError
    from rlplug.contracts.coordinator import SINGLE_PROCESS

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "llama"}')
    backend, stateful = (
        _Backend(),
        {"data_loader": _Stateful({"epoch": 1, "index": 2}), "kl_ctrl": _Stateful({"value": 0.1})},
    )
    manager = CheckpointManager(tmp_path / "run")
    checkpoint.seed_everything(3)
    path = checkpoint.save_checkpoint(
        manager,
        7,
        backend=backend,
        coordinator=SINGLE_PROCESS,
        stateful=stateful,
        tokenizer=_Tokenizer(),
        model_path=model_dir,
        config=OmegaConf.create({"a": 1}),
    )
    draws = [random.random(), torch.rand(1).item()]  # what the run draws after the save
    assert path == manager.step_dir(7) and manager.latest() == path
    assert sorted(p.name for p in path.iterdir()) == [
        "COMPLETE",
        "backend",
        "checksums.json",
        "config.yaml",
        "hf_meta",
        "rng_state.pt",
        "run_fingerprint.json",
        "trainer_state.json",
    ]
    assert (path / "hf_meta" / "config.json").read_text() == '{"model_type": "llama"}'
    assert (path / "config.yaml").read_text() == "a: 1\n"
    import json

    assert json.loads((path / "trainer_state.json").read_text()) == {
        "global_step": 7,
        "data_loader": {"epoch": 1, "index": 2},
        "kl_ctrl": {"value": 0.1},
    }
    fingerprint = json.loads((path / "run_fingerprint.json").read_text())  # of a config without the run's keys
    assert fingerprint == checkpoint.run_fingerprint(OmegaConf.create({"a": 1}))
    assert fingerprint["algorithm.adv_estimator"] is None and fingerprint["reward.shaping"] == []

    class _Trainer:  # the trainer config section resume_checkpoint reads
        resume_mode, resume_from_path = "auto", None

    assert checkpoint.resume_checkpoint(_Trainer, manager) == path
    _Trainer.resume_mode = "disable"
    assert checkpoint.resume_checkpoint(_Trainer, manager) is None
    _Trainer.resume_mode, _Trainer.resume_from_path = "resume_path", str(tmp_path)
    with pytest.raises(ConfigError, match="is not a complete checkpoint"):
        checkpoint.resume_checkpoint(_Trainer, manager)

    fresh = {"data_loader": _Stateful({"epoch": 0, "index": 0}), "kl_ctrl": _Stateful({"value": 0.0})}
    random.random(), torch.rand(3)  # move the RNGs on: loading must put them back
    assert checkpoint.load_checkpoint(path, backend=backend, stateful=fresh) == 7
    assert backend.loaded == [path / "backend"]
    assert fresh["data_loader"].state == {"epoch": 1, "index": 2} and fresh["kl_ctrl"].state == {"value": 0.1}
    assert [random.random(), torch.rand(1).item()] == draws
    with pytest.raises(ConfigError, match="The data or KL settings differ from the checkpointed run"):
        checkpoint.load_checkpoint(path, backend=backend, stateful={"kl_ctrl": _Stateful({"other": 1})})


def test_save_checkpoint_other_processes_write_their_shards_into_the_main_folder(tmp_path):
    """The main process broadcasts the partial folder, then the final one; another process saves its
    backend shard into the partial folder and returns the final path. The two run one after the other
    here: the main's backend save also plays the other process's first step."""
    from omegaconf import OmegaConf

    manager, sent = CheckpointManager(tmp_path / "run"), []
    main, other = _Backend(0), _Backend(1)
    main_save = main.save

    def save_then_other_process(directory: Path) -> None:
        main_save(directory)
        other.save(Path(_Coordinator(False, sent).broadcast(None)) / "backend")  # the other process's first step

    main.save = save_then_other_process
    path = checkpoint.save_checkpoint(
        manager,
        1,
        backend=main,
        coordinator=_Coordinator(True, sent),
        stateful={},
        tokenizer=_Tokenizer(),
        model_path=tmp_path,
        config=OmegaConf.create({}),
    )
    assert len(sent) == 2 and ".partial-" in sent[0] and sent[1] == str(path)
    assert sorted(p.name for p in (path / "backend").iterdir()) == ["shard0.txt", "shard1.txt"]
    # the other process's whole call: save into the broadcast partial folder, return the final path
    other2 = _Backend(1)
    got = checkpoint.save_checkpoint(
        manager,
        1,
        backend=other2,
        coordinator=_Coordinator(False, list(sent)),
        stateful={},
        tokenizer=None,
        model_path=tmp_path,
        config=None,
    )
    assert got == path and other2.saved == [Path(sent[0]) / "backend"]


def test_stage_times_the_block_then_reaches_its_fault_point(monkeypatch):
    import time

    from rlplug.run.metrics import stage

    reached: list[str] = []
    monkeypatch.setattr(checkpoint, "_fault_point", reached.append)
    metrics: dict[str, float] = {"timing_s/gen": 1.0}
    t0 = time.perf_counter()
    with stage(metrics, "gen"):
        time.sleep(0.05)
        assert reached == []  # the fault point comes after the work
    elapsed = time.perf_counter() - t0
    assert reached == ["gen"] and 1.05 <= metrics["timing_s/gen"] <= 1.0 + elapsed  # added to what was there
    with stage(metrics, "reward_wait", fault="reward"):
        pass
    with stage(metrics, "testing", fault=None):
        pass
    assert reached == ["gen", "reward"] and {"timing_s/reward_wait", "timing_s/testing"} <= set(metrics)
    with pytest.raises(RuntimeError):
        with stage(metrics, "adv"):
            raise RuntimeError("boom")
    assert "timing_s/adv" not in metrics and reached == ["gen", "reward"]  # a failed stage: no time, no point
