"""Model files follow the user's umask (issue 14, item 9).

safetensors writes a file through a temporary file renamed into place, so ``model.safetensors``
came out ``0600`` whatever the umask, and an inference server running as another user could not
read an exported or final model. Every model file rlplug writes (the final model, ``rlplug
export``, checkpoints) now gets the mode a plain ``open()`` gives: ``0o666 & ~umask``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from _helpers import TINY_CPU_RUN, run_config

from rlplug.run.checkpoint import CheckpointManager
from rlplug.run.export import export_checkpoint


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask():
    """Set the process umask for the test (``umask(0o022)``) and restore the previous one afterwards."""
    previous = os.umask(0o022)
    os.umask(previous)

    def set_mask(mask: int) -> None:
        os.umask(mask)

    yield set_mask
    os.umask(previous)


def test_exported_final_and_checkpointed_model_files_follow_the_umask(tmp_path: Path, umask) -> None:
    from rlplug.run.trainer import Trainer

    umask(0o022)
    cfg = run_config(TINY_CPU_RUN, tmp_path / "run", "trainer.logger=[]")
    trainer = Trainer(cfg)
    try:
        ckpt = trainer.save_checkpoint()  # step 0: the untrained actor
        trainer._finish()  # what a finished run does: final_model/ via the backend's export_hf
        umask(0o027)  # a stricter umask: the export must follow it, not a fixed 0644
        strict = trainer.backend.export_hf(tmp_path / "strict", trainer.tokenizer)
    finally:
        trainer.close()
    umask(0o022)
    exported = export_checkpoint(ckpt, tmp_path / "exported")  # rlplug export

    final = tmp_path / "run" / "final_model"
    # 0o666 & ~0o022 = 0o644 (rw-r--r--), 0o777 & ~0o022 = 0o755 (rwxr-xr-x)
    assert _mode(final / "model.safetensors") == 0o644
    assert _mode(final) == 0o755
    assert _mode(exported / "model.safetensors") == 0o644
    assert _mode(exported) == 0o755
    assert _mode(ckpt / "backend" / "actor" / "model.safetensors") == 0o644
    # every other file already followed the umask: the tokenizer and config files are untouched
    assert {p.name: _mode(p) for p in final.iterdir()} == {p.name: 0o644 for p in final.iterdir()}
    # 0o666 & ~0o027 = 0o640 (rw-r-----), 0o777 & ~0o027 = 0o750
    assert _mode(strict / "model.safetensors") == 0o640
    assert _mode(strict) == 0o750


def test_apply_umask_sets_matching_files_only(tmp_path: Path, umask) -> None:
    from rlplug.run.checkpoint import apply_umask

    umask(0o002)  # a group-writable umask: 0o666 & ~0o002 = 0o664
    (tmp_path / "sub").mkdir()
    weights, private = tmp_path / "sub" / "model-00001.safetensors", tmp_path / "notes.txt"
    for f in (weights, private):
        f.write_text("x")
        f.chmod(0o600)
    apply_umask(tmp_path)
    assert _mode(weights) == 0o664
    assert _mode(private) == 0o600  # not a model file: left as it is


def test_checkpoint_manager_applies_the_umask_to_what_the_writer_wrote(tmp_path: Path, umask) -> None:
    import torch
    from safetensors.torch import save_file

    umask(0o022)

    def write(d: Path) -> None:
        (d / "backend").mkdir()
        save_file({"w": torch.zeros(2)}, str(d / "backend" / "model.safetensors"))

    path = CheckpointManager(tmp_path).save(3, write)
    assert _mode(path / "backend" / "model.safetensors") == 0o644
