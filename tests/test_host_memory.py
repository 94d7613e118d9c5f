"""trainer.malloc_trim: the C heap's free memory goes back to the OS after each step."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from rlplug.base.host_memory import _glibc, malloc_trim, rss_bytes

glibc_only = pytest.mark.skipif(_glibc() is None, reason="needs glibc's malloc_trim")


def test_rss_bytes_reads_this_process():
    import resource

    rss = rss_bytes()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # bytes (Linux: kB)
    assert 10 * 2**20 < rss <= peak * 1.01


@glibc_only
def test_malloc_trim_returns_fragmented_free_heap_to_the_os():
    """256 MiB of 64 KiB heap blocks (below glibc's mmap threshold) are freed except one block on top,
    which keeps glibc from shrinking the heap by itself: the RSS stays up until malloc_trim(0) gives the
    free pages back (madvise), so it drops by at least 200 MiB. In a child: this process's heap is left alone."""
    code = textwrap.dedent(
        """
        import ctypes, json
        from rlplug.base.host_memory import malloc_trim, rss_bytes
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc.restype = ctypes.c_void_p
        libc.malloc.argtypes = [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        libc.mallopt(-1, 1 << 20)  # M_TRIM_THRESHOLD: no automatic trim of a small top chunk
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: the 64 KiB blocks come from the heap
        blocks = []
        for _ in range(4096):
            p = libc.malloc(64 * 1024)
            ctypes.memset(p, 1, 64 * 1024)  # touch the pages: resident
            blocks.append(p)
        pin = libc.malloc(64 * 1024)  # a live block above them all
        ctypes.memset(pin, 1, 64 * 1024)
        before = rss_bytes()
        for p in blocks:
            libc.free(p)
        freed = rss_bytes()
        took = malloc_trim()
        after = rss_bytes()
        print(json.dumps({"before": before, "freed": freed, "after": after, "took": took}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    mib = 2**20
    assert r["freed"] > r["before"] - 16 * mib  # free() alone kept the memory resident
    assert r["freed"] - r["after"] > 200 * mib, r  # the trim gave it back
    assert 0.0 <= r["took"] < 5.0


@glibc_only
def test_malloc_trim_reports_its_time():
    took = malloc_trim()
    assert took is not None and 0.0 <= took < 5.0


def test_a_tiny_run_logs_rss_and_trim_time_and_the_switch_turns_the_trim_off(tmp_path):
    from test_reward_prepare import tiny_run_cfg

    from rlplug.run.metrics import read_metrics_jsonl
    from rlplug.run.trainer import Trainer
    from rlplug.run.validate import validate_config

    def run(sub: str, *extra: str) -> list[dict]:
        cfg = tiny_run_cfg(
            tmp_path / sub, "trainer.save_freq=0", "trainer.test_freq=0", "trainer.val_before_train=false", *extra
        )
        validate_config(cfg)
        trainer = Trainer(cfg)
        try:
            assert trainer.fit() == "finished"
        finally:
            trainer.close()
        return [r for r in read_metrics_jsonl(trainer.ckpt.root) if r["step"] > 0]

    (on,) = run("on")
    assert 0.05 < on["perf/rss_gb"] < 64  # GiB: this process's resident size
    if _glibc() is not None:
        assert 0.0 <= on["timing_s/malloc_trim"] < 5.0
    (off,) = run("off", "trainer.malloc_trim=false")
    assert "timing_s/malloc_trim" not in off and off["perf/rss_gb"] > 0.05
