"""Crash safety: SIGKILL a real training process at 27 exact places, resume, compare.

Each run is ``rlplug train debug=tiny ...`` in its own process (PPO with a critic, the KL
penalty in the reward with the adaptive controller, hf rollout, local backend; 4 steps of 2
prompts, 2 steps per epoch, a checkpoint every step, at most 2 kept, validation every 2 steps).
``RLPLUG_TEST_KILL_AT=<label>:<n>`` makes the process SIGKILL itself the ``n``-th time it
reaches ``_fault_point("<label>")`` (rlplug.run.checkpoint).

Startup: importing torch + transformers + the plugins takes ~5 s of CPU per process, which for
~30 runs would dominate. So the runs are forked from a "zygote": a Python process started once
per chain that imports everything and then, per request, forks a child that runs exactly what
``python -m rlplug train ARGS`` runs (``rlplug.cli.main(["train", *ARGS])``) with its own
environment, stdout and stderr, and reports the child's exit status (``-9`` after SIGKILL). The
uninterrupted reference run is a fresh ``python -m rlplug train`` process, so the forked runs
are also checked against a real one. Labels::

    trainer   resumed, step_start, rollout, old_log_prob, ref, values, reward (scored on a thread
              during the passes before it), adv,
              update_critic (critic stepped, actor not yet), update_actor, update_weights,
              validation, step_end (after the step's hooks, before its checkpoint), export
    save      ckpt_tmp_created, ckpt_backend, ckpt_rng, ckpt_meta, ckpt_state (inside the
              partial dir), ckpt_written, ckpt_checksums (checksums.json written, COMPLETE not
              yet), ckpt_marked (COMPLETE written, not yet renamed),
              ckpt_renamed (renamed, ``latest`` pointer not yet updated), pointer_tmp_written
              (pointer's temp file written, not yet renamed), ckpt_pointer (pointer updated,
              cleanup not done), ckpt_cleanup (in the middle of removing old/partial dirs)

Two chains of runs share nothing but run side by side (one thread each; every process uses one
torch thread): each run of a chain resumes (``trainer.resume_mode=auto``) from what the killed
run before it left and is itself killed at the chain's next point. After every kill the test
checks which checkpoint ``CheckpointManager.latest`` picks (the last COMPLETE one, never a
partial directory), that the next run resumes from exactly that step and reports the partial
directories it ignores, and that a successful save removes them. The last run of each chain
finishes; its final weights (actor and critic, plus the optimizer states) must equal an
uninterrupted run's bit for bit.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from rlplug.run.checkpoint import CheckpointManager

OVERRIDES = [
    "debug=tiny",
    "algorithm=ppo",
    "algorithm.use_kl_in_reward=true",
    "algorithm.kl_ctrl.type=adaptive",
    "model.tiny.num_hidden_layers=1",
    "data.train_size=5",  # 2 steps per epoch (batch 2, last row dropped): epochs roll over at step 3
    "data.train_batch_size=2",
    "actor.ppo_mini_batch_size=1",
    "actor.micro_batch_size_per_device=1",
    "data.max_response_length=8",
    "data.val_max_samples=2",
    "trainer.total_training_steps=4",
    "trainer.save_freq=1",
    "trainer.max_ckpt_to_keep=2",
    "trainer.test_freq=2",
    "trainer.val_before_train=false",
    "trainer.logger=[console]",
    "trainer.num_threads=1",
    "trainer.device=cpu",  # bitwise comparisons: CPU kernels are deterministic
    "trainer.resume_mode=auto",
]

# (kill spec, step the run must resume from (None: fresh start), latest complete step after the
#  kill (None: none), whether partial checkpoint dirs are left after the kill)
CHAIN_A = [
    ("rollout:1", None, None, False),
    ("ckpt_tmp_created:1", None, None, True),
    ("ckpt_written:1", None, None, True),
    ("ckpt_renamed:1", None, 1, True),  # step 1 complete, no pointer yet: found by scanning
    ("resumed:1", 1, 1, True),
    ("old_log_prob:1", 1, 1, True),
    ("values:1", 1, 1, True),
    ("update_critic:1", 1, 1, True),
    ("ckpt_checksums:1", 1, 1, True),  # step 2's checksums.json written, no COMPLETE: a partial dir
    ("update_weights:1", 1, 1, True),
    ("validation:1", 1, 1, True),  # step 2's validation
    ("ckpt_state:1", 1, 1, True),
    ("ckpt_pointer:1", 1, 2, True),  # step 2 saved and pointed to; cleanup not reached
    ("ckpt_cleanup:1", 2, 3, True),  # step 3 saved; killed after removing the first stale dir
    ("export:1", 3, 4, False),  # all 4 steps saved, killed while exporting the final model
]
CHAIN_B = [
    ("step_start:1", None, None, False),
    ("reward:1", None, None, False),
    ("ckpt_backend:1", None, None, True),
    ("ckpt_marked:1", None, None, True),  # a partial dir WITH a COMPLETE marker: still ignored
    ("pointer_tmp_written:1", None, 1, True),
    ("ref:1", 1, 1, True),
    ("adv:1", 1, 1, True),
    ("update_actor:1", 1, 1, True),
    ("step_end:1", 1, 1, True),
    ("ckpt_rng:1", 1, 1, True),
    ("ckpt_meta:1", 1, 1, True),
    ("rollout:2", 1, 2, False),  # step 2 fully saved (stale dirs removed), killed in step 3's rollout
]

RUN_TIMEOUT_S = 180
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}

# The fork server: imports everything once, then forks one child per JSON request line.
ZYGOTE = r"""
import json, os, signal, sys, traceback
import rlplug.cli, rlplug.run.trainer, rlplug.plugins.training.local, rlplug.plugins.rollout.hf
from rlplug.contracts.registry import get_registry
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer  # the lazy imports
get_registry()
print("READY", flush=True)
for line in sys.stdin:
    req = json.loads(line)
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        rc = 1
        signal.alarm(req["timeout"])  # a hung run dies with SIGALRM (exit status -14) instead of blocking
        try:
            os.environ.pop("RLPLUG_TEST_KILL_AT", None)
            os.environ.update(req["env"])
            for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
            rc = rlplug.cli.main(["train", *req["args"]])
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(rc)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)
"""


class _Run:
    """What a finished run left: exit status (negative: killed by that signal), stdout, stderr."""

    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


class Zygote:
    """A pre-imported Python process that runs ``rlplug train`` in a forked child per call."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(log_dir / "zygote.err", "w"),
            text=True,
            env={**os.environ, **ENV},
        )
        ready = self.proc.stdout.readline()
        assert ready.strip() == "READY", (ready, (log_dir / "zygote.err").read_text()[-3000:])
        self.count = 0

    def train(self, run_dir: Path, kill_at: str | None, overrides: list[str] = OVERRIDES) -> _Run:
        """``rlplug train *overrides`` in ``run_dir`` (tests/test_schedule.py passes its own overrides)."""
        self.count += 1
        out, err = self.log_dir / f"{self.count}.out", self.log_dir / f"{self.count}.err"
        env = dict(ENV, **({"RLPLUG_TEST_KILL_AT": kill_at} if kill_at else {}))
        args = [*overrides, f"trainer.default_local_dir={run_dir}"]
        self.proc.stdin.write(
            json.dumps({"args": args, "env": env, "stdout": str(out), "stderr": str(err), "timeout": RUN_TIMEOUT_S})
            + "\n"
        )
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        assert reply, "the zygote died: " + (self.log_dir / "zygote.err").read_text()[-3000:]
        return _Run(json.loads(reply)["rc"], out.read_text(), err.read_text())

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _train_fresh(run_dir: Path, overrides: list[str] = OVERRIDES) -> subprocess.CompletedProcess:
    """A fresh ``python -m rlplug train *overrides`` process (the reference run)."""
    env = {k: v for k, v in os.environ.items() if k != "RLPLUG_TEST_KILL_AT"}
    cmd = [sys.executable, "-m", "rlplug", "train", *overrides, f"trainer.default_local_dir={run_dir}"]
    return subprocess.run(cmd, env={**env, **ENV}, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def _describe(proc, run_dir: Path) -> str:
    listing = sorted(p.name for p in run_dir.iterdir()) if run_dir.is_dir() else []
    return (
        f"rc={proc.returncode}\n--- dir: {listing}\n--- stdout (tail):\n{proc.stdout[-3000:]}\n"
        f"--- stderr (tail):\n{proc.stderr[-3000:]}"
    )


def _resumed_step(proc, run_dir: Path) -> int | None:
    m = re.search(r"Resumed from (\S+) \(step (\d+)\)", proc.stdout)
    if m is None:
        return None
    assert Path(m.group(1)) == run_dir / f"global_step_{m.group(2)}", m.group(0)
    return int(m.group(2))


def _run_chain(run_dir: Path, chain: list[tuple[str, int | None, int | None, bool]]) -> list[str]:
    """Run the chain; returns the kill points it went through (asserting after each)."""
    zygote = Zygote(run_dir.parent / f"{run_dir.name}_logs")
    try:
        return _run_chain_in(zygote, run_dir, chain)
    finally:
        zygote.close()


def _run_chain_in(zygote: Zygote, run_dir: Path, chain: list[tuple[str, int | None, int | None, bool]]) -> list[str]:
    manager = CheckpointManager(run_dir)
    done = []
    for spec, resume_from, latest_after, partial_after in chain:
        had_partials = bool(manager.partial_dirs())
        proc = zygote.train(run_dir, spec)
        where = f"[{run_dir.name} kill at {spec}] "
        label, n = spec.split(":")
        # killed exactly where asked, by SIGKILL (not by some other failure)
        assert proc.returncode == -signal.SIGKILL, where + _describe(proc, run_dir)
        assert f"RLPLUG_TEST_KILL_AT: SIGKILL at {label}:{n}" in proc.stderr, where + _describe(proc, run_dir)
        # resumed from the last complete checkpoint (or started fresh)
        assert _resumed_step(proc, run_dir) == resume_from, where + _describe(proc, run_dir)
        if had_partials:  # interrupted saves are reported when the next run looks for a checkpoint
            assert "Ignoring incomplete checkpoint" in proc.stderr, where + _describe(proc, run_dir)
        latest = manager.latest()
        assert (None if latest is None else int(latest.name.rsplit("_", 1)[1])) == latest_after, where + _describe(
            proc, run_dir
        )
        if latest is not None:
            assert (latest / "COMPLETE").is_file() and (latest / "trainer_state.json").is_file()
            assert (latest / "backend" / "actor" / "model.safetensors").is_file()
        assert bool(manager.partial_dirs()) == partial_after, where + _describe(proc, run_dir)
        done.append(spec)
    # the last run finishes from the latest complete checkpoint
    proc = zygote.train(run_dir, None)
    assert proc.returncode == 0, f"[{run_dir.name} final run] " + _describe(proc, run_dir)
    assert "Training finished at step 4" in proc.stdout
    assert manager.partial_dirs() == []
    assert manager.complete_steps() == [3, 4]  # max_ckpt_to_keep=2
    return done


def _final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    """Actor and critic weights and optimizer states of the last checkpoint, plus the exported model."""
    from safetensors.torch import load_file

    ckpt = run_dir / "global_step_4" / "backend"
    out: dict[str, torch.Tensor] = {}
    for role in ("actor", "critic"):
        for k, v in load_file(str(ckpt / role / "model.safetensors")).items():
            out[f"{role}/{k}"] = v
        opt = torch.load(ckpt / role / "optimizer.pt", weights_only=True)
        for pid, st in opt["state"].items():
            for k, v in st.items():
                out[f"{role}/optim/{pid}/{k}"] = torch.as_tensor(v)
    for k, v in load_file(str(run_dir / "final_model" / "model.safetensors")).items():
        out[f"final/{k}"] = v
    return out


# The default suite kills at 9 of the points (one chain: fresh start, interrupted saves, a
# checkpoint found by scanning, resume, the critic update, a save between its checksums and its
# COMPLETE, the pointer, cleanup, export); the whole 27-point matrix runs in the slow CI step.
CHAIN_SHORT = [CHAIN_A[i] for i in (0, 2, 3, 4, 7, 8, 12, 13, 14)]


def _kill_chains_match_uninterrupted(tmp_path: Path, chains: dict[str, list]) -> list[str]:
    from rlplug.config.compose import compose
    from rlplug.data.prepare import prepared_data_files
    from rlplug.training.models import resolve_model_path

    # build the tiny model and the data once, before the processes run in parallel
    cfg = compose(OVERRIDES)
    resolve_model_path(cfg.model)
    prepared_data_files(cfg)

    ref_dir = tmp_path / "reference"
    dirs = {name: tmp_path / name for name in chains}
    t0 = time.perf_counter()

    with ThreadPoolExecutor(max_workers=1 + len(chains)) as pool:
        fut_ref = pool.submit(_train_fresh, ref_dir)
        futs = [pool.submit(_run_chain, dirs[name], chain) for name, chain in chains.items()]
        done = [spec for fut in futs for spec in fut.result()]
        proc = fut_ref.result()
    assert proc.returncode == 0, "[reference run] " + _describe(proc, ref_dir)

    from safetensors.torch import load_file

    reference = _final_state(ref_dir)
    initial = load_file(str(Path(resolve_model_path(cfg.model)) / "model.safetensors"))
    trained = [k for k, v in initial.items() if not torch.equal(v, reference[f"actor/{k}"])]
    assert trained, "the reference run did not change the actor; the comparison below would be vacuous"
    for run_dir in dirs.values():
        got = _final_state(run_dir)
        assert got.keys() == reference.keys()
        differing = [k for k in reference if not torch.equal(reference[k], got[k])]
        assert differing == [], (
            f"{run_dir.name}: {len(differing)} tensors differ from the uninterrupted run, e.g. {differing[:5]}"
        )
    print(f"{len(done)} kills + resumes in {time.perf_counter() - t0:.1f} s")
    return done


def test_sigkill_at_9_points_then_resume_matches_uninterrupted(tmp_path):
    done = _kill_chains_match_uninterrupted(tmp_path, {"chain_short": CHAIN_SHORT})
    assert len(done) == 9 and len({s.split(":")[0] for s in done}) == 9 and "ckpt_checksums:1" in done


@pytest.mark.slow
def test_sigkill_at_27_points_then_resume_matches_uninterrupted(tmp_path):
    done = _kill_chains_match_uninterrupted(tmp_path, {"chain_a": CHAIN_A, "chain_b": CHAIN_B})
    assert len(done) == 27 and len({s.split(":")[0] for s in done}) == 26


def test_fault_point_is_inert_without_the_variable(monkeypatch):
    """Without RLPLUG_TEST_KILL_AT nothing happens and nothing is counted."""
    from rlplug import checkpoint

    monkeypatch.delenv("RLPLUG_TEST_KILL_AT", raising=False)
    before = dict(checkpoint._fault_counts)
    for _ in range(3):
        checkpoint._fault_point("rollout")
    assert checkpoint._fault_counts == before


def test_fault_point_sends_the_signal_at_the_nth_occurrence(monkeypatch):
    """``label:n:SIGNAL`` fires on the n-th call with that label only (counted per label)."""
    from rlplug import checkpoint

    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(checkpoint.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    monkeypatch.setattr(checkpoint, "_fault_counts", {})
    monkeypatch.setenv("RLPLUG_TEST_KILL_AT", "x:3:SIGTERM,y:1")
    for _ in range(5):
        checkpoint._fault_point("x")
    assert sent == [(os.getpid(), signal.SIGTERM)]
    checkpoint._fault_point("z")
    checkpoint._fault_point("y")
    assert sent[1:] == [(os.getpid(), signal.SIGKILL)]
    assert checkpoint._fault_counts == {"x": 5, "z": 1, "y": 1}
