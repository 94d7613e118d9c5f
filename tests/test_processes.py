"""rlplug.base.processes: a child over two pipes (what the hf engine process and the vllm engine child use) and
``pid_alive``. The children are tiny Python scripts, so each test takes well under a second except the one whose
child ignores every polite signal (it waits out the short timeouts it is given)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

from rlplug.base.processes import pid_alive, start_pipe_child, stop_pipe_child

# answers each command with (command, payload * 2, the tail argument); exits on ("close", None)
ECHO = """
import sys
from multiprocessing.connection import Connection
recv = Connection(int(sys.argv[1]), writable=False)
send = Connection(int(sys.argv[2]), readable=False)
print("child started", flush=True)
while True:
    cmd, payload = recv.recv()
    if cmd == "close":
        print("child closed", flush=True)
        break
    send.send((cmd, payload * 2, sys.argv[3:]))
"""

# ignores 'close', SIGTERM and SIGINT: only SIGKILL ends it
STUBBORN = """
import signal, sys, time
from multiprocessing.connection import Connection
for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, signal.SIG_IGN)
recv = Connection(int(sys.argv[1]), writable=False)
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""


def _fds() -> set[int]:
    return {int(n) for n in os.listdir("/proc/self/fd")}


def test_a_child_answers_over_the_pipes_logs_to_the_file_and_exits_on_close(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    log.write_text("earlier\n")  # appended to, not replaced
    before = _fds()
    proc, send, recv = start_pipe_child([sys.executable, "-c", ECHO], log, env=dict(os.environ), tail=["x", "y"])
    send.send(("double", 21))
    assert recv.poll(30) and recv.recv() == ("double", 42, ["x", "y"])
    stop_pipe_child(proc, send, recv)
    assert proc.returncode == 0  # it took 'close', no signal was needed
    assert log.read_text().splitlines() == ["earlier", "child started", "child closed"]
    assert send.closed and recv.closed
    assert _fds() == before  # no pipe end left open here
    stop_pipe_child(proc, send, recv)  # again: nothing to do, no error


def test_a_child_that_ignores_close_and_sigterm_is_killed(tmp_path: Path) -> None:
    proc, send, recv = start_pipe_child([sys.executable, "-c", STUBBORN], tmp_path / "log")
    deadline = time.monotonic() + 30
    while "ready" not in (tmp_path / "log").read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.monotonic()
    stop_pipe_child(proc, send, recv, close_wait_s=0.3, term_wait_s=0.3)
    assert proc.returncode == -signal.SIGKILL
    assert time.monotonic() - t0 < 10  # the two short waits, then SIGKILL
    assert not pid_alive(proc.pid)


def test_an_abandoned_owner_stops_its_child_through_the_finalizer(tmp_path: Path) -> None:
    class Owner:
        pass

    owner = Owner()
    proc, send, recv = start_pipe_child([sys.executable, "-c", ECHO], tmp_path / "log")
    fin = weakref.finalize(owner, stop_pipe_child, proc, send, recv)
    del owner  # CPython frees it here: the finalizer runs
    assert not fin.alive
    assert proc.returncode == 0


def test_a_missing_program_raises_and_leaves_no_pipe_open(tmp_path: Path) -> None:
    before = _fds()
    try:
        start_pipe_child([str(tmp_path / "no-such-program")], tmp_path / "log")
    except OSError:
        pass
    else:  # pragma: no cover - a failing assertion below says what happened
        raise AssertionError("a missing program did not raise")
    assert _fds() == before


def test_pid_alive_tells_a_running_an_exited_and_a_zombie_child_apart() -> None:
    assert pid_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert pid_alive(child.pid)
        child.kill()
        deadline = time.monotonic() + 10
        # killed and not yet collected: a zombie, which has exited
        while pid_alive(child.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not pid_alive(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not pid_alive(child.pid)
    assert pid_alive(2**40) is False


def test_pin_process_binds_threads_started_before_and_after() -> None:
    import threading

    from rlplug.base.processes import pin_process

    allowed = sorted(os.sched_getaffinity(0))
    target = {allowed[-1]}
    started, stop = threading.Event(), threading.Event()
    tids: list[int] = []

    def worker() -> None:  # a thread started before the pin, as torch's workers are
        tids.append(threading.get_native_id())
        started.set()
        stop.wait(30)

    before = threading.Thread(target=worker, daemon=True)
    before.start()
    started.wait(10)
    try:
        pin_process(target)
        assert os.sched_getaffinity(0) == target
        assert os.sched_getaffinity(tids[0]) == target  # sched_setaffinity(0) alone would have left it on every core
        later: list[set[int]] = []
        after = threading.Thread(target=lambda: later.append(os.sched_getaffinity(0)))
        after.start()
        after.join(10)
        assert later == [target]
    finally:
        stop.set()
        before.join(10)
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), set(allowed))
            except ProcessLookupError:
                pass
    assert os.sched_getaffinity(0) == set(allowed)
