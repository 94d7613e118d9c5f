"""The engine's behaviour, frozen: 5 real steps compared bit for bit with a committed fixture.

Recorded before the architecture round (issue 32) moved ``core/`` into layers, so that any move
which changes a result shows here. The run is the issue's command,
``rlplug train rollout=hf actor.use_torch_compile=false trainer.total_training_steps=5
data.train_batch_size=8``, with the sizes that make it fit (PPO mini-batch 8, no validation or
checkpoint) and with every setting that makes floats depend on the machine pinned, so that one
fixture holds on every CPU kind where the kernels allow it:

- fp32 everywhere (``model.compute_dtype=fp32``, ``rollout.dtype=fp32``): ``auto`` picks bf16 on
  AVX-512/AMX CPUs and fp32 on AVX2-only ones;
- one thread for the trainer and the engine (a reduction's order depends on the thread count);
- ATen's portable kernels (``ATEN_CPU_CAPABILITY=default``), oneDNN limited to AVX2 and MKL's
  conditional-reproducibility mode (``MKL_CBWR=COMPATIBLE``).

Floats can still differ between CPU kinds (MKL's and oneDNN's kernels are chosen at run time), so the
fixture file holds one record per *kernel signature*: the SHA-256 of a small canary computation (fp32
matmuls, softmax, log-softmax, a normal draw) run under the same settings. A machine whose signature
has a record must reproduce it bit for bit; one whose signature has none skips, saying so and how to
add it (``python tests/test_behaviour_fixture.py --record`` on the commit the fixture was recorded at,
``BASE_COMMIT`` below, so that the record describes the engine before the moves).

Every metric of every step is compared except the ones that measure time, speed or memory
(:func:`is_machine_metric`).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

FIXTURE = Path(__file__).parent / "fixtures" / "behaviour_metrics.json"
#: the commit whose engine the fixture's records describe (the last one before issue 32's moves)
BASE_COMMIT = "3d2d6b0"

PINNED_ENV = {
    "ATEN_CPU_CAPABILITY": "default",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_CBWR": "COMPATIBLE",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "PYTHONHASHSEED": "0",
    "PYTHONUNBUFFERED": "1",
}

OVERRIDES = [
    "rollout=hf",
    "actor.use_torch_compile=false",
    "trainer.total_training_steps=5",
    "data.train_batch_size=8",
    # the sizes that make it fit: one PPO mini-batch of 8, no validation, no checkpoint, no tracker
    "actor.ppo_mini_batch_size=8",
    "actor.micro_batch_size_per_device=8",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
    "trainer.logger=[console]",
    "trainer.device=cpu",
    # the machine-dependent settings, pinned (module docstring)
    "model.compute_dtype=fp32",
    "rollout.dtype=fp32",
    "trainer.num_threads=1",
    "rollout.num_threads=1",
]

_MACHINE_PREFIXES = ("timing_s/", "timing/", "perf/", "memory/", "host_memory/", "system/")
_MACHINE_WORDS = ("time", "per_s", "rss", "heap", "mfu", "memory", "_gb", "_gib", "_mib")


def is_machine_metric(name: str) -> bool:
    """True for a metric that measures the machine (time, throughput, memory), not the computation."""
    low = name.lower()
    return low.startswith(_MACHINE_PREFIXES) or any(word in low for word in _MACHINE_WORDS)


def kernel_signature() -> str:
    """SHA-256 (first 16 hex digits) of a canary computation run under :data:`PINNED_ENV` in a child.

    Two machines with the same signature ran the same kernels on these shapes; the canary covers what
    the run's floats go through (fp32 matmuls of the model's sizes, softmax and log-softmax along a
    49,152-wide vocabulary, seeded normal draws).
    """
    code = (
        "import hashlib, torch\n"
        "torch.set_num_threads(1); torch.manual_seed(0)\n"
        "h = hashlib.sha256()\n"
        "a = torch.randn(64, 576); w = torch.randn(576, 1536) / 24\n"
        "for t in (a @ w, torch.nn.functional.linear(a, w.T), torch.randn(8, 49152).log_softmax(-1),\n"
        "          torch.randn(4, 9, 128, 128).softmax(-1), torch.empty(1000).normal_(0, 0.02),\n"
        "          torch.nn.functional.silu(a) * a, torch.rsqrt(a.pow(2).mean(-1) + 1e-5)):\n"
        "    h.update(t.contiguous().numpy().tobytes())\n"
        "print(h.hexdigest()[:16])\n"
    )
    env = dict(os.environ, **PINNED_ENV)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def run_fixture_command(run_dir: Path) -> list[dict[str, Any]]:
    """Run the fixture's command in a child process; its metric records (``metrics.jsonl``), step by step."""
    from rlplug.run.metrics import read_metrics_jsonl

    cmd = [sys.executable, "-m", "rlplug", "train", *OVERRIDES, f"trainer.default_local_dir={run_dir}"]
    env = dict(os.environ, **PINNED_ENV)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return read_metrics_jsonl(run_dir)


def computed_metrics(records: list[dict[str, Any]]) -> dict[str, dict[str, float | str]]:
    """``{step: {metric: value}}`` without the machine metrics; floats as ``float.hex`` (bit-exact, NaN-safe)."""
    out: dict[str, dict[str, float | str]] = {}
    for rec in records:
        step = str(rec["step"])
        out[step] = {
            k: (float(v).hex() if isinstance(v, float) and not math.isnan(v) else repr(v))
            for k, v in sorted(rec.items())
            if k not in ("step", "wall_time") and not is_machine_metric(k)
        }
    return out


def load_fixture() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text()) if FIXTURE.is_file() else {"records": {}}


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_five_real_steps_reproduce_the_fixture_bit_for_bit(tmp_path: Path) -> None:
    fixture = load_fixture()
    signature = kernel_signature()
    record = fixture["records"].get(signature)
    if record is None:
        pytest.skip(
            f"no behaviour record for this machine's kernel signature {signature} (recorded: "
            f"{sorted(fixture['records'])}): its fp32 kernels round differently from the machines recorded. "
            f"Add one from the engine before the moves: check out {BASE_COMMIT} in a worktree and run "
            "`python tests/test_behaviour_fixture.py --record` there, then copy the record over."
        )
    got = computed_metrics(run_fixture_command(tmp_path / "run"))
    want = record["metrics"]
    assert sorted(got, key=int) == sorted(want, key=int), (sorted(got), sorted(want))
    for step in want:
        assert sorted(got[step]) == sorted(want[step]), f"step {step}: metric names differ"
        diff = {k: (want[step][k], got[step][k]) for k in want[step] if got[step][k] != want[step][k]}
        assert not diff, f"step {step}: {len(diff)} metrics differ from the fixture (want, got): {diff}"
    # the run did something worth freezing: the critic trained, then the actor (critic warm-up 3)
    assert "critic/vf_loss" in want["1"] and "actor/pg_loss" in want["5"]


def test_machine_metric_filter_keeps_the_computed_ones() -> None:
    for name in ("timing_s/gen", "perf/throughput", "perf/rss_gb", "perf/gen_tokens_per_s", "actor/update_time_s"):
        assert is_machine_metric(name), name
    for name in ("actor/pg_loss", "critic/vf_loss", "actor/grad_norm", "response_length/mean", "actor/lr"):
        assert not is_machine_metric(name), name


def _record() -> None:
    signature = kernel_signature()
    with tempfile.TemporaryDirectory() as d:
        metrics = computed_metrics(run_fixture_command(Path(d) / "run"))
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    fixture = load_fixture()
    fixture["records"][signature] = {
        "commit": head,
        "torch": __import__("torch").__version__,
        "cpu": _cpu_model(),
        "metrics": metrics,
    }
    fixture["command"] = "rlplug train " + " ".join(OVERRIDES)
    fixture["env"] = PINNED_ENV
    FIXTURE.write_text(json.dumps(fixture, indent=1, sort_keys=True) + "\n")
    print(f"recorded {len(metrics)} steps for kernel signature {signature} at {head} -> {FIXTURE}")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python tests/test_behaviour_fixture.py --record")
    _record()
