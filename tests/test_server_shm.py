"""A server killed with SIGKILL cannot unlink its shared-memory segments (vLLM's message queues are
``/dev/shm/psm_*``); the rlplug supervisor removes the ones its group mapped once the group is gone."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest

from rlplug.rollout.serving import ServerProcess

pytestmark = pytest.mark.skipif(
    not (os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) and os.path.isdir("/proc/self/fd")),
    reason="needs a writable /dev/shm and /proc (Linux)",
)

# a "server" that maps a 1 MiB segment in /dev/shm and its child that maps another, then waits
SERVER = """
import mmap, os, subprocess, sys, time
def seg(path):
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, 1 << 20)
    m = mmap.mmap(fd, 1 << 20)
    os.close(fd)
    m[:5] = b"hello"
    return m
keep = seg(sys.argv[1])
if sys.argv[2] != "-":
    subprocess.Popen([sys.executable, "-c", sys.argv[3], sys.argv[2], "-", sys.argv[3]])  # its child: segment b
print("ready", flush=True)
time.sleep(600)
"""


def _wait(cond, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


@contextlib.contextmanager
def _server_with_segments(tmp_path: Path, pause_s: float):
    """Start the fake server, wait until both segments exist, wait ``pause_s``, SIGKILL the server and
    wait for its supervisor to end; yields ``(srv, mine, childs)``. Leftover segments are removed after."""
    tag = uuid.uuid4().hex[:10]
    mine, childs = f"/dev/shm/psm_rlplugtest_{tag}_a", f"/dev/shm/psm_rlplugtest_{tag}_b"
    srv = ServerProcess([sys.executable, "-c", SERVER, mine, childs, SERVER], dict(os.environ), tmp_path / "log")
    try:
        assert _wait(lambda: os.path.exists(mine) and os.path.exists(childs), 30), srv.log_tail()
        time.sleep(pause_s)
        pid = srv.server_pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)  # as the test of a real vLLM server kill does
        assert _wait(lambda: not srv.alive, 30)
        yield srv, mine, childs
    finally:
        srv.stop()
        for p in (mine, childs):
            if os.path.exists(p):
                os.unlink(p)


def test_segments_of_a_sigkilled_server_and_its_child_are_removed_and_others_kept(tmp_path: Path):
    bystander = Path(f"/dev/shm/psm_rlplugtest_{uuid.uuid4().hex[:10]}_other")  # not mapped by the server's group
    bystander.write_bytes(b"x")
    try:
        # 3 s: the supervisor looks at its group's mappings about once a second, so 2-3 looks before the kill
        with _server_with_segments(tmp_path, pause_s=3.0) as (srv, mine, childs):
            assert not os.path.exists(mine) and not os.path.exists(childs)  # the group's: removed
            assert bystander.exists()  # anyone else's: kept
            assert srv.group_pids() == []
    finally:
        bystander.unlink(missing_ok=True)


def test_a_server_killed_at_once_still_has_its_childrens_segments_removed(tmp_path: Path):
    """No pause after the segments appear: the supervisor's once-a-second look may not have seen the
    child's segment yet, so it looks again at the members still alive before ending them."""
    with _server_with_segments(tmp_path, pause_s=0.0) as (srv, _, childs):
        assert not os.path.exists(childs)  # mapped by a member still alive when the server died
        assert srv.group_pids() == []
