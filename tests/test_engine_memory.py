"""The vLLM engine child's host memory (issue 21): it trims its C heap after each weight push and
generation (``trainer.malloc_trim``), answers a ``memory`` command, and the trainer logs its
resident size as ``perf/rollout_rss_gb``. The real engine's figures: ``benchmarks/bench_engine_memory.py``."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
from multiprocessing.connection import Connection

import pytest

from rlplug.base.host_memory import _glibc, rss_bytes

glibc_only = pytest.mark.skipif(_glibc() is None, reason="needs glibc's mallinfo2")


@glibc_only
def test_heap_mib_counts_blocks_in_use_and_held_free():
    """1024 blocks of 64 KiB (64 MiB, under glibc's mmap threshold) raise the heap in use by 64 MiB;
    freeing every other one moves 32 MiB from in use to free (the blocks between keep the heap from
    shrinking). Run in a child so this process's heap does not blur the figures."""
    code = """
import ctypes, json
from rlplug.base.host_memory import heap_mib
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: 64 KiB blocks come from the heap
libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: no automatic trim
u0, f0 = heap_mib()
blocks = [libc.malloc(64 * 1024) for _ in range(1024)]
u1, f1 = heap_mib()
for b in blocks[::2]:
    libc.free(b)
u2, f2 = heap_mib()
print(json.dumps([u0, f0, u1, f1, u2, f2]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    u0, f0, u1, f1, u2, f2 = (float(x) for x in out.stdout.strip().strip("[]").split(","))
    assert 63.9 < u1 - u0 < 64.5  # 1024 x 64 KiB (+ 16 bytes of header each)
    assert 31.9 < u1 - u2 < 32.3 and 31.9 < f2 - f1 < 32.3  # half of them, now free


def _spawn_child(env_trim: str | None) -> tuple[subprocess.Popen, Connection, Connection]:
    p2c_r, p2c_w = os.pipe()
    c2p_r, c2p_w = os.pipe()
    env = dict(os.environ)
    env.pop("RLPLUG_MALLOC_TRIM", None)
    if env_trim is not None:
        env["RLPLUG_MALLOC_TRIM"] = env_trim
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlplug.plugins.rollout.vllm", "--engine-child", str(p2c_r), str(c2p_w)],
        pass_fds=(p2c_r, c2p_w),
        env=env,
    )
    os.close(p2c_r)
    os.close(c2p_w)
    return proc, Connection(p2c_w, readable=False), Connection(c2p_r, writable=False)


@pytest.mark.parametrize("env_trim, expected", [(None, True), ("1", True), ("0", False)])
def test_the_real_engine_child_reports_its_memory_before_init(env_trim, expected):
    """The engine child's own code (no vLLM needed before ``init``): ``memory`` gives its resident
    size, which matches what /proc says from outside, its heap, and whether it trims."""
    proc, send, recv = _spawn_child(env_trim)
    try:
        send.send(("memory", None))
        assert recv.poll(60)
        status, mem = recv.recv()
        assert status == "ok", mem
        outside = rss_bytes(proc.pid) / 2**20
        assert 10 < mem["rss_mib"] < 4096 and abs(mem["rss_mib"] - outside) < 16
        assert mem["malloc_trim"] is expected
        if _glibc() is not None:
            assert mem["heap_used_mib"] > 1 and mem["heap_free_mib"] >= 0
        send.send(("generate", {}))  # the engine is needed for this one
        status, err = recv.recv()
        assert status == "error" and "command 'generate' before 'init'" in err
        send.send(("close", None))
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the vllm backend checks vllm is importable")
@pytest.mark.parametrize("trim, expected", [("true", "1"), ("false", "0")])
def test_the_engine_child_trims_as_trainer_malloc_trim_says(model_path, tok, monkeypatch, trim, expected):
    from test_engine_child_death import FAKE_ARGV, OVERRIDES

    from rlplug.config.compose import compose
    from rlplug.plugins.rollout.vllm import VLLMRollout

    monkeypatch.setattr(VLLMRollout, "engine_argv", FAKE_ARGV)
    monkeypatch.setenv("FAKE_ENGINE_DIE", "")
    engine = VLLMRollout(compose([*OVERRIDES, f"trainer.malloc_trim={trim}"]), model_path, tok)
    try:
        assert engine._engine.env["RLPLUG_MALLOC_TRIM"] == expected
        assert "perf/rollout_rss_gb" in VLLMRollout.metrics  # declared: an alert rule may watch it
    finally:
        engine.close()


@pytest.fixture(scope="module")
def cfg():
    from test_engine_child_death import OVERRIDES

    from rlplug.config.compose import compose

    return compose(OVERRIDES)


def test_the_trainer_logs_the_rollout_engines_resident_memory():
    """``perf/rollout_rss_gb`` is the resident size of the process whose id the rollout backend
    gives (here a child holding 256 MiB), next to the trainer's ``perf/rss_gb``; a backend without a
    ``pid`` (hf, server URLs) logs none."""
    from omegaconf import OmegaConf

    from rlplug.run.trainer import Trainer

    code = "import sys, time; b = bytearray(256 << 20); b[::4096] = b'x' * len(b[::4096]); print('ready', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        fake = types.SimpleNamespace(cfg=OmegaConf.create({"trainer": {"malloc_trim": False}}))
        fake.rollout = types.SimpleNamespace(pid=proc.pid)
        out = Trainer._host_memory(fake)  # type: ignore[arg-type]
        expected = rss_bytes(proc.pid) / 2**30
        assert 0.25 < out["perf/rollout_rss_gb"] < 0.4 and abs(out["perf/rollout_rss_gb"] - expected) < 0.01
        assert out["perf/rss_gb"] == pytest.approx(rss_bytes() / 2**30, abs=0.05)
        fake.rollout = types.SimpleNamespace()  # no pid
        assert "perf/rollout_rss_gb" not in Trainer._host_memory(fake)  # type: ignore[arg-type]
        fake.rollout = types.SimpleNamespace(pid=None)  # closed
        assert "perf/rollout_rss_gb" not in Trainer._host_memory(fake)  # type: ignore[arg-type]
    finally:
        proc.kill()
        proc.wait()


def test_heap_mib_is_nan_without_glibc(monkeypatch):
    import math

    import rlplug.base.host_memory as hm

    monkeypatch.setattr(hm, "_mallinfo2", lambda: None)
    assert all(math.isnan(x) for x in hm.heap_mib())
