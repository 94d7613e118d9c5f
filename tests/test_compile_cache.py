"""torch's compile cache lives in rlplug's cache (``RLPLUG_CACHE``), not in the system temp folder.

The first compiled step on a fresh machine spends minutes compiling; torch's default cache folder
(``<tmp>/torchinductor_<user>``) is lost with a reboot or a clean container, the converted model
in ``RLPLUG_CACHE`` is not. Each check runs in a fresh interpreter: Inductor keeps its cache
folder for the life of the process once it has picked one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import os, sys, torch
from rlplug.training.backend import compile_decoder_layers

class Layer(torch.nn.Module):  # a decoder-layer stand-in: a bare nn.Linear compiles to a library call only
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
    def forward(self, x):
        return torch.nn.functional.silu(self.lin(x)) * x + 1

class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Layer() for _ in range(2)])
    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

torch.manual_seed(0)
model = Tiny()
assert compile_decoder_layers(model, "actor") == 2
model(torch.randn(3, 8)).sum().backward()
print("CACHE=" + os.environ["TORCHINDUCTOR_CACHE_DIR"])
"""


def _run(env_extra: dict[str, str], tmp_path: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(env_extra)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return next(line[len("CACHE=") :] for line in out.stdout.splitlines() if line.startswith("CACHE="))


def test_compiled_layers_are_cached_under_rlplug_cache(tmp_path):
    cache = tmp_path / "rlplug-cache"
    used = _run({"RLPLUG_CACHE": str(cache)}, tmp_path)
    assert Path(used) == cache / "torch_compile"
    written = [p for p in (cache / "torch_compile").rglob("*") if p.is_file()]
    # Inductor wrote its compiled graphs there (not into <tmp>/torchinductor_<user>)
    assert written, "nothing was written to the compile cache under RLPLUG_CACHE"


def test_a_compile_cache_the_user_set_is_kept(tmp_path):
    mine = tmp_path / "my-inductor-cache"
    used = _run({"RLPLUG_CACHE": str(tmp_path / "rlplug-cache"), "TORCHINDUCTOR_CACHE_DIR": str(mine)}, tmp_path)
    assert Path(used) == mine
    assert any(p.is_file() for p in mine.rglob("*"))
    assert not (tmp_path / "rlplug-cache" / "torch_compile").exists()
