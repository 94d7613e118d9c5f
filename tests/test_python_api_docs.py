"""Every ``python`` example of docs/python_api.md runs as written (issue 31: "the docs' examples are tests").

Each fenced ``python`` block runs as a script (``__name__ == "__main__"``) in this process, from a fresh
working directory; ``rlplug.train`` gets the tiny overrides appended (the tiny model, one step, the CPU: what
the example sets is composed and validated as written, only the sizes are the tiny model's) and its run
directory under the test's ``tmp_path``. tests/test_docs_examples.py runs every page's examples as
subprocesses; this module checks what the python_api examples print and return as well.
"""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest
from _helpers import TINY_CPU_RUN

import rlplug
import rlplug.api

PAGE = Path(__file__).resolve().parent.parent / "docs" / "python_api.md"
FENCE = re.compile(r"^```python\n(?P<code>.*?)^```$", re.S | re.M)


def python_blocks() -> list[str]:
    return [m.group("code") for m in FENCE.finditer(PAGE.read_text())]


def test_the_page_has_these_examples():
    firsts = [next(ln for ln in b.splitlines() if ln.strip()) for b in python_blocks()]
    # the quick start, conversational data with None and trainer_state, a plugin, as_reward_function
    assert firsts == [
        "import rlplug",
        "import rlplug",
        "import rlplug",
        "from rlplug.contracts.reward_contract import as_reward_function",
    ]


def test_every_python_example_runs(tmp_path, monkeypatch, capsys):
    runs: list[tuple[int, rlplug.TrainResult]] = []
    real_train = rlplug.api.train

    def tiny_train(config_or_overrides=None, *args, **kwargs):
        assert isinstance(config_or_overrides, list), "the examples pass override lists"
        overrides = [*config_or_overrides, *TINY_CPU_RUN, "trainer.total_training_steps=1", "trainer.logger=[console]"]
        overrides.append(f"trainer.default_local_dir={tmp_path / f'run{len(runs)}'}")
        result = real_train(overrides, *args, **kwargs)
        runs.append((block, result))
        return result

    monkeypatch.setattr(rlplug, "train", tiny_train)
    monkeypatch.setattr(rlplug.api, "train", tiny_train)
    printed = []
    for block, code in enumerate(python_blocks()):
        workdir = tmp_path / f"block{block}"
        workdir.mkdir()
        monkeypatch.chdir(workdir)
        script = workdir / "example.py"
        script.write_text(code)
        try:
            runpy.run_path(str(script), run_name="__main__")
        except Exception as exc:
            pytest.fail(f"python example {block} of {PAGE.name} failed: {type(exc).__name__}: {exc}\n{code}")
        printed.append(capsys.readouterr().out.strip().splitlines()[-1:])
    assert [b for b, _ in runs] == [0, 1]  # the two training examples trained, once each
    assert all(r.status == "finished" and r.global_step == 1 for _, r in runs)
    quick, chat = runs[0][1], runs[1][1]
    # what the quick start prints: run dir, status, score; then TRL's per-function mean and std
    assert printed[0] == [f"{quick.metrics['reward/exact/mean']} {quick.metrics['reward/reward_len/std']}"]
    assert "reward/correct/mean" in chat.metrics and "reward/brevity/mean" in chat.metrics
    # as_reward_function(contract="trl"): 4 characters / 100
    assert printed[3] == ["trl [0.04]"]
