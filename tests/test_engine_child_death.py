"""The in-process ``vllm`` backend's engine child dying mid-generation (issue 21).

The supervision (:class:`rlplug.plugins.rollout.vllm.EngineChild`) is tested with a stub child: this
file run as ``python tests/test_engine_child_death.py --fake-engine-child READ_FD WRITE_FD`` speaks
the engine child's pipe protocol without vLLM. Its "model" is the sha256 of the last weights file it
loaded ("initial" before any): every generated token is ``3 + int(sha[:8], 16) % 50``, so a test can
tell which weights a (restarted) child has. ``FAKE_ENGINE_DIE`` in its environment: ``always``
(SIGKILL itself on every ``generate``), ``once:<file>`` (only while ``<file>`` does not exist; it is
created first), unset: never. A first prompt starting with token id -1 makes it answer an error.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
FAKE_ARGV = (sys.executable, str(HERE), "--fake-engine-child")


def _token(weights_id: str) -> int:
    return 3 + int(hashlib.sha256(weights_id.encode()).hexdigest()[:8], 16) % 50


def _file_id(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _fake_child_main(read_fd: int, write_fd: int) -> int:  # pragma: no cover - runs as the child
    from multiprocessing.connection import Connection

    recv, send = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    weights = "initial"
    while True:
        try:
            cmd, payload = recv.recv()
        except (EOFError, OSError):
            return 0
        if cmd == "close":
            return 0
        print(f"fake engine {os.getpid()}: {cmd}", flush=True)
        if cmd == "init":
            send.send(("ok", {"pid": os.getpid(), "startup_s": 0.0, "vllm_version": "fake"}))
        elif cmd == "update_weights":
            folder = Path(payload).parent
            held = sorted(f.name for f in folder.iterdir() if f.name.startswith("rlplug-vllm-weights-"))
            print(f"fake engine: weights files while loading: {len(held)}", flush=True)
            weights = _file_id(payload)
            send.send(("ok", 0.0))
        elif cmd == "generate":
            die = os.environ.get("FAKE_ENGINE_DIE", "")
            if die == "always" or (die.startswith("once:") and not os.path.exists(die[5:])):
                if die.startswith("once:"):
                    Path(die[5:]).touch()
                print("fake engine: CUDA out of memory (pretend), the kernel kills us", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if payload["prompts"][0][:1] == [-1]:
                send.send(("error", "Traceback (most recent call last):\nValueError: a bad request"))
                continue
            k = len(payload["prompts"]) * payload["n"]
            ids = [[_token(weights)] * payload["max_tokens"] for _ in range(k)]
            send.send(("ok", {"token_ids": ids, "finish_reasons": ["length"] * k, "log_probs": [None] * k}))
        else:
            send.send(("error", f"unknown command {cmd}"))


REQUEST = {"prompts": [[5, 6]], "n": 2, "max_tokens": 3}


def _child(tmp_path: Path, die: str = "", **kw):
    from rlplug.plugins.rollout.vllm import EngineChild

    env = {**os.environ, "FAKE_ENGINE_DIE": die}
    child = EngineChild(list(FAKE_ARGV), env, {"model": "fake"}, log_dir=str(tmp_path / "logs"), **kw)
    child.start()
    return child


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z")


def test_a_child_killed_mid_generation_is_restarted_with_the_latest_weights_and_the_batch_sent_again(tmp_path):
    child = _child(tmp_path, die=f"once:{tmp_path / 'died'}")
    try:
        weights = tmp_path / "w.safetensors"
        weights.write_bytes(b"pushed weights v1")
        child.call("update_weights", str(weights))
        child.weights_path = str(weights)
        first_pid = child.pid
        res = child.call("generate", REQUEST, restart=True)
        # the new child answered with the pushed weights, not the initial ones
        assert res["token_ids"] == [[_token(_file_id(weights))] * 3] * 2
        assert _token(_file_id(weights)) != _token("initial")
        assert child.restarts == 1 and child.pid != first_pid and _gone(first_pid)
        assert "the kernel kills us" in (tmp_path / "logs" / "engine-0.log").read_text()
        assert "update_weights" in (tmp_path / "logs" / "engine-1.log").read_text()  # replayed
    finally:
        child.close()
    assert child.pid is None and not (tmp_path / "logs").exists()


def test_a_second_death_is_a_clear_error_with_the_engines_last_log_lines_and_leaves_no_process(tmp_path):
    from rlplug.plugins.rollout.vllm import EngineDied

    child = _child(tmp_path, die="always")
    pid = child.pid
    with pytest.raises(EngineDied) as err:
        child.call("generate", REQUEST, restart=True)
    msg = str(err.value)
    assert "died again after a restart, on 'generate'" in msg
    assert "was killed by SIGKILL (the OOM killer sends SIGKILL" in msg
    assert "Last lines of its log" in msg and "fake engine: CUDA out of memory (pretend)" in msg
    assert child.restarts == 1 and child.closed and pid is not None and _gone(pid)
    with pytest.raises(RuntimeError, match="closed"):
        child.call("generate", REQUEST)


def test_no_restart_left_or_a_command_without_restart_raises_at_the_first_death(tmp_path):
    from rlplug.plugins.rollout.vllm import EngineDied

    child = _child(tmp_path, die="always", max_restarts=0)
    with pytest.raises(EngineDied, match=r"already restarted 0 times \(rollout.max_restarts=0\)"):
        child.call("generate", REQUEST, restart=True)
    child = _child(tmp_path / "b", die="always")
    with pytest.raises(EngineDied, match=r"killed by SIGKILL \(the OOM killer.*\) while handling 'generate'"):
        child.call("generate", REQUEST)  # restart=False (e.g. update_weights)
    assert child.restarts == 0 and child.closed


def test_an_engine_error_answer_is_not_a_death_and_the_child_keeps_serving(tmp_path):
    from rlplug.plugins.rollout.vllm import EngineError

    child = _child(tmp_path)
    try:
        pid = child.pid
        with pytest.raises(EngineError, match=r"(?s)failed on 'generate'.*ValueError: a bad request"):
            child.call("generate", {**REQUEST, "prompts": [[-1]]}, restart=True)
        assert child.call("generate", REQUEST)["token_ids"] == [[_token("initial")] * 3] * 2
        assert child.restarts == 0 and child.pid == pid
    finally:
        child.close()


# ----------------------------------------------------------------------------- the backend with the stub child

OVERRIDES = [
    "model=tiny",
    "model.tiny.num_attention_heads=2",
    "model.tiny.num_key_value_heads=1",
    "rollout=vllm",
    "rollout.dtype=fp32",
    "trainer.seed=7",
    "trainer.device=cpu",
]


@pytest.fixture(scope="module")
def cfg():
    from rlplug.config.compose import compose

    return compose(OVERRIDES)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the vllm backend checks vllm is importable")
def test_vllm_rollout_survives_its_engine_child_being_killed(cfg, model_path, tok, monkeypatch, tmp_path):
    from safetensors.torch import load_file

    from rlplug.contracts.types import SamplingParams
    from rlplug.plugins.rollout.vllm import VLLMRollout

    monkeypatch.setattr(VLLMRollout, "engine_argv", FAKE_ARGV)
    monkeypatch.setenv("FAKE_ENGINE_DIE", "")
    engine = VLLMRollout(cfg, model_path, tok)
    try:
        weights = load_file(str(Path(model_path) / "model.safetensors"))
        engine.update_weights(weights)
        kept = engine._engine.weights_path
        assert kept is not None and Path(kept).exists()  # kept for a restart
        params = SamplingParams(n=2, max_tokens=3, temperature=1.0)
        expected = [[_token(_file_id(kept))] * 3] * 2
        first = engine.generate([[5, 6]], params)
        assert first.response_ids == expected and "rollout/engine_restarts" not in first.metrics
        pid = engine.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)  # the OOM killer, between two steps
        time.sleep(0.2)
        out = engine.generate([[5, 6]], params)
        assert out.response_ids == expected and out.finish_reasons == ["length", "length"]
        assert engine.restarts == 1 and engine.pid != pid
        assert out.metrics["rollout/engine_restarts"] == 1.0  # logged from the first restart on
        engine.update_weights(weights)  # the next push replaces the kept file
        assert not Path(kept).exists() and Path(engine._engine.weights_path).exists()
    finally:
        last = engine._engine.weights_path
        engine.close()
    assert last is not None and not Path(last).exists() and engine.pid is None


def test_a_restart_refuses_when_no_copy_of_the_engines_weights_exists(tmp_path):
    from rlplug.plugins.rollout.vllm import EngineDied

    child = _child(tmp_path, die=f"once:{tmp_path / 'died'}")
    child.weights_missing = True  # what a failed push leaves
    with pytest.raises(EngineDied, match="cannot be restarted: the last weight push failed"):
        child.call("generate", REQUEST, restart=True)
    assert child.restarts == 0 and child.closed


def _dead_pid() -> int:
    import subprocess

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_weights_of_dead_processes_are_deleted_and_live_ones_kept(tmp_path):
    from rlplug.plugins.rollout.vllm import remove_stale_weights

    dead, live, host = _dead_pid(), os.getpid(), socket.gethostname()
    names = [
        f"rlplug-vllm-weights-{host}-{dead}-abc_1x.safetensors",  # a SIGKILLed trainer's copy, this machine
        f"rlplug-vllm-weights-{dead}-def.safetensors",  # the same from an earlier version (no host)
        f"rlplug-vllm-weights-{host}-{live}-ghi.safetensors",  # this process's own
        f"rlplug-vllm-weights-other-host-{dead}-jkl.safetensors",  # another machine's (shared weights_dir)
        f"rlplug-vllm-weights-{host}-{dead}-abc.txt",  # not ours
        "other.safetensors",
    ]
    for n in names:
        (tmp_path / n).write_bytes(b"x")
    assert remove_stale_weights(str(tmp_path)) == [str(tmp_path / names[0])]
    assert remove_stale_weights(str(tmp_path), legacy=True) == [str(tmp_path / names[1])]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:])
    assert remove_stale_weights(str(tmp_path / "missing")) == []


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the vllm backend checks vllm is importable")
def test_a_push_holds_at_most_one_weights_file_and_a_failed_push_leaves_none(model_path, tok, monkeypatch, tmp_path):
    import safetensors.torch
    from safetensors.torch import load_file

    from rlplug.config.compose import compose
    from rlplug.plugins.rollout.vllm import VLLMRollout

    wdir = tmp_path / "weights"
    wdir.mkdir()
    stale = wdir / f"rlplug-vllm-weights-{socket.gethostname()}-{_dead_pid()}-x.safetensors"
    stale.write_bytes(b"left by a SIGKILLed run")
    monkeypatch.setattr(VLLMRollout, "engine_argv", FAKE_ARGV)
    monkeypatch.setenv("FAKE_ENGINE_DIE", "")
    engine = VLLMRollout(compose([*OVERRIDES, f"rollout.weights_dir={wdir}"]), model_path, tok)
    try:
        assert not stale.exists()  # deleted at startup
        weights = load_file(str(Path(model_path) / "model.safetensors"))
        for _ in range(3):
            engine.update_weights(weights)
            assert len(list(wdir.iterdir())) == 1
        log_text = Path(engine._engine.log_path).read_text()
        assert log_text.count("weights files while loading: 1") == 3 and "while loading: 2" not in log_text

        def full(*a, **k):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(safetensors.torch, "save_file", full)
        with pytest.raises(OSError, match="No space left"):
            engine.update_weights(weights)
        assert list(wdir.iterdir()) == [] and engine._engine.weights_path is None
        assert engine._engine.weights_missing
    finally:
        engine.close()
    assert list(wdir.iterdir()) == []


# ----------------------------------------------------------------------------- real vLLM (not run here)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_real_vllm_engine_killed_mid_generation_restarts_with_the_pushed_weights(cfg, model_path, tok):
    """A real engine child SIGKILLed while generating: the batch is generated again by a new child
    holding the pushed weights, so greedy output equals that of an engine that never died.

    The kill is sent right after the generate request is written to the child's pipe, before its
    answer can be read: a timer (the first version) raced a fast machine's generation and fired
    after the batch was done (CI: ``restarts == 0``)."""
    from safetensors.torch import load_file

    from rlplug.contracts.types import SamplingParams
    from rlplug.plugins.rollout import vllm as vllm_mod
    from rlplug.plugins.rollout.vllm import VLLMRollout

    weights = {
        k: v * 1.01 if v.dim() == 2 else v for k, v in load_file(str(Path(model_path) / "model.safetensors")).items()
    }
    params = SamplingParams(n=1, max_tokens=64, temperature=0.0, ignore_eos=True)  # greedy
    prompts = [[5, 6, 7, 8]] * 32
    shm = Path("/dev/shm")
    before = set(os.listdir(shm)) if shm.is_dir() else set()
    with VLLMRollout(cfg, model_path, tok) as engine:
        engine.update_weights(weights)
        want = engine.generate(prompts, params).response_ids
        pid = engine.pid
        assert pid is not None
        child = engine._engine
        real_send, sent = child._send_conn, []

        class KillAfterSend:
            """The child's request pipe, killing the child once a generate request is in it."""

            def send(self, obj):
                real_send.send(obj)
                if obj[0] == "generate" and not sent:
                    sent.append(obj[0])
                    os.kill(pid, signal.SIGKILL)  # the request is in flight: no answer has been read

            def __getattr__(self, name):
                return getattr(real_send, name)

        child._send_conn = KillAfterSend()
        got = engine.generate(prompts, params).response_ids
        assert sent == ["generate"], "the kill was not sent with the generate request"
        assert engine.restarts == 1 and engine.pid != pid
        assert got == want
    # nothing of the killed child, its successor or the pushed weights is left in shared memory (the
    # in-process engine's semaphores are unlinked at creation; a vLLM *server* leaves psm_* segments,
    # which core/rollout/serving.py's supervisor removes: tests/test_server_shm.py)
    # (machine-wide: the slow tests run one at a time, so no other test's engine makes entries meanwhile)
    left = sorted(set(os.listdir(shm)) - before) if shm.is_dir() else []
    assert not [n for n in left if n.startswith(("psm_", "sem.", vllm_mod.weights_file_prefix()))], left


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--fake-engine-child":
        sys.exit(_fake_child_main(int(sys.argv[2]), int(sys.argv[3])))
    sys.exit("usage: python tests/test_engine_child_death.py --fake-engine-child READ_FD WRITE_FD")
