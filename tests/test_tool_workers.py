"""rlplug.orchestration.tool_workers: tool calls in worker processes, each ending in a ToolResult.

The tools are module-level functions (workers unpickle them by reference, importing this module: it imports
nothing heavy at module level, so a worker starts in a few tenths of a second).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import threading
import time

import pytest

from rlplug.contracts.agents import FunctionTool, ToolError
from rlplug.orchestration.tool_workers import ToolRunner, truncate_text

# ============================================================================ the tools (module level: picklable)


def echo(text: str) -> str:
    """Return the text unchanged.

    Args:
        text: The text.
    """
    return text


async def async_echo(text: str, repeat: int = 1) -> str:
    """Return the text repeated, after awaiting.

    Args:
        text: The text.
        repeat: How many times.
    """
    await asyncio.sleep(0.01)
    return text * repeat


def sleep_for(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return f"slept {seconds}"


def raise_value_error(text: str) -> str:
    """Raise ValueError.

    Args:
        text: The message.
    """
    raise ValueError(text)


def raise_tool_error(text: str) -> str:
    """Raise ToolError.

    Args:
        text: The message.
    """
    raise ToolError(text)


def print_flood(megabytes: int) -> str:
    """Print megabytes to stdout and stderr.

    Args:
        megabytes: How many MiB to each stream.
    """
    line = "x" * 1023 + "\n"
    for _ in range(megabytes * 1024):
        sys.stdout.write(line)
        sys.stderr.write(line)
    sys.stdout.flush()
    os.write(1, b"straight to fd 1\n")
    return "printed"


def big_result(chars: int) -> str:
    """Return that many characters.

    Args:
        chars: How many.
    """
    return "x" * chars


def pid_then_sleep(path: str) -> str:
    """Write this process's pid to a file, then sleep a long time.

    Args:
        path: The file.
    """
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    time.sleep(60)
    return "woke up"


def allocate(megabytes: int) -> str:
    """Allocate and touch memory.

    Args:
        megabytes: How many MiB.
    """
    block = bytearray(megabytes * 1024 * 1024)
    return str(len(block))


def connect(port: int) -> str:
    """Connect to 127.0.0.1:port and read one line.

    Args:
        port: The port.
    """
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        return conn.recv(100).decode()


def loaded_modules(names: list[str]) -> str:
    """Which of these modules the worker has imported.

    Args:
        names: Module names.
    """
    return ",".join(n for n in names if n in sys.modules)


connect_with_network = FunctionTool(connect, name="connect_net")
connect_with_network.needs_network = True  # type: ignore[attr-defined]

TOOLS = {
    tool.name: tool
    for tool in [
        FunctionTool(echo),
        FunctionTool(async_echo),
        FunctionTool(sleep_for),
        FunctionTool(raise_value_error),
        FunctionTool(raise_tool_error),
        FunctionTool(print_flood),
        FunctionTool(big_result),
        FunctionTool(pid_then_sleep),
        FunctionTool(allocate),
        FunctionTool(connect),
        connect_with_network,
        FunctionTool(loaded_modules),
    ]
}


@pytest.fixture(scope="module")
def runner():
    with ToolRunner(TOOLS, timeout_s=5.0, max_chars=256, memory_mb=256, workers=2) as pool:
        pool.start()
        yield pool


def _recovers(pool: ToolRunner) -> None:
    result = pool.call_sync("echo", {"text": "still here"})
    assert (result.status, result.text) == ("ok", "still here")


# ============================================================================ results


def test_calculator_through_a_worker():
    from rlplug.plugins.tools.calculator import calculator_tool

    # the calculator's module imports rlplug.plugin (and torch): 1024 MiB of address space, not 256
    with ToolRunner({"calculator": calculator_tool}, max_chars=256, memory_mb=1024, workers=1) as pool:
        assert pool.call_sync("calculator", {"expression": "12*(3+4)-5//2"}).text == "82"  # 84 - 2
        refused = pool.call_sync("calculator", {"expression": "2**10"})
        assert refused.status == "error"
        assert refused.text == "Error: the operator ** is not allowed; use integers with + - * // and parentheses"


def test_lookup_tool_and_async_tool(runner):
    from rlplug.conformance import LookupTool

    with ToolRunner({"lookup": LookupTool({"capital of Zorbia": "Quenth"})}, memory_mb=256, workers=1) as pool:
        assert pool.call_sync("lookup", {"key": "capital of Zorbia"}).text == "Quenth"
        missing = pool.call_sync("lookup", {"key": "x"})
        assert (missing.status, missing.text) == ("error", "Error: lookup: no entry for 'x'")
    result = asyncio.run(runner.call("async_echo", {"text": "ab", "repeat": 3}))
    assert (result.status, result.text, result.truncated) == ("ok", "ababab", False)


def test_worker_does_not_import_torch(runner):
    result = runner.call_sync("loaded_modules", {"names": ["torch", "rlplug.contracts.agents"]})
    assert result.text == "rlplug.contracts.agents"


def test_unknown_tool_and_bad_arguments(runner):
    unknown = runner.call_sync("calculater", {"expression": "1"})
    assert unknown.status == "unknown_tool"
    assert unknown.text.startswith("Error: unknown tool 'calculater'; the tools are: allocate, async_echo, big_result")
    bad = runner.call_sync("echo", {"txt": "a"})
    assert bad.status == "bad_arguments"
    assert bad.text == (
        "Error: echo: missing required argument 'text' (a string); unknown argument 'txt' (the parameters are: text)"
    )


def test_exceptions_become_messages(runner):
    value = runner.call_sync("raise_value_error", {"text": "bad value 7"})
    assert (value.status, value.text) == ("error", "Error: ValueError: bad value 7")
    tool = runner.call_sync("raise_tool_error", {"text": "no such key; use one of a, b"})
    assert (tool.status, tool.text) == ("error", "Error: no such key; use one of a, b")


def test_truncate_text_counts_the_marker():
    assert truncate_text("abc", 3) == ("abc", False)
    # 20 chars, max 16: marker "...[truncated N chars]" is 22 chars > 16, so a plain cut
    assert truncate_text("y" * 20, 16) == ("y" * 16, True)
    # 100 chars, max 30: marker with N=2 digits is 23 chars, keep 7, N = 93
    assert truncate_text("z" * 100, 30) == ("z" * 7 + "...[truncated 93 chars]", True)


def test_huge_result_is_cut_in_the_worker(runner):
    before = runner.stats["bytes_received"]
    result = runner.call_sync("big_result", {"chars": 10_000_000})
    # marker "...[truncated 9999772 chars]" is 28 chars; 256 - 28 = 228 kept; 10_000_000 - 228 = 9_999_772
    assert result.status == "ok" and result.truncated
    assert result.text == "x" * 228 + "...[truncated 9999772 chars]"
    assert len(result.text) == 256
    assert runner.stats["bytes_received"] - before < 2000  # the 10 MB never crossed the pipe


def test_printing_10_mb_floods_nothing(runner, capfd):
    capfd.readouterr()
    result = runner.call_sync("print_flood", {"megabytes": 10})
    assert (result.status, result.text) == ("ok", "printed")
    out, err = capfd.readouterr()
    assert len(out) + len(err) < 4096, (len(out), len(err))


# ============================================================================ faults


def test_timeout_kills_the_worker_and_the_pool_goes_on(runner):
    starts = runner.stats["worker_starts"]
    t0 = time.monotonic()
    result = runner.call_sync("sleep_for", {"seconds": 1e6}, timeout_s=1.0)
    elapsed = time.monotonic() - t0
    assert result.status == "timeout"
    assert result.text == "Error: the call to tool 'sleep_for' took longer than 1 s and was stopped"
    assert 1.0 <= elapsed < 2.0
    _recovers(runner)

    async def both():  # two calls at once: the pool has two workers again, one of them new
        return await asyncio.gather(*(runner.call("sleep_for", {"seconds": 0.2}) for _ in range(2)))

    assert [r.text for r in asyncio.run(both())] == ["slept 0.2", "slept 0.2"]
    assert runner.stats["worker_starts"] == starts + 1  # the killed worker was replaced, once


def test_worker_killed_from_outside_is_a_crash(runner, tmp_path):
    path = str(tmp_path / "pid")
    results = []
    thread = threading.Thread(target=lambda: results.append(runner.call_sync("pid_then_sleep", {"path": path})))
    thread.start()
    deadline = time.monotonic() + 10
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(int(open(path).read()), signal.SIGKILL)
    thread.join(10)
    (result,) = results
    assert result.status == "crash"
    assert result.text.startswith("Error: the process running tool 'pid_then_sleep' died by SIGKILL")
    assert result.seconds < 4.0  # noticed at once, not at the 5 s timeout
    _recovers(runner)


def test_memory_hog_fails_its_call(runner):
    result = runner.call_sync("allocate", {"megabytes": 4096})
    assert result.status in ("error", "crash")
    assert "MemoryError" in result.text or "died" in result.text
    assert "256 MiB" in result.text or result.status == "crash"
    assert runner.call_sync("allocate", {"megabytes": 8}).text == str(8 * 1024 * 1024)  # under the limit
    _recovers(runner)


def test_network_only_for_tools_that_declare_it(runner):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        refused = runner.call_sync("connect", {"port": port})
        assert refused.status == "error"
        assert refused.text == (
            "Error: PermissionError: tool 'connect' has no network access; set needs_network = True on the tool "
            "to allow it"
        )

        def answer():
            conn, _ = server.accept()
            with conn:
                conn.sendall(b"hello")

        thread = threading.Thread(target=answer)
        thread.start()
        allowed = runner.call_sync("connect_net", {"port": port})
        thread.join(5)
    assert (allowed.status, allowed.text) == ("ok", "hello")


# ============================================================================ concurrency


def test_one_sleeping_tool_does_not_hold_the_others(runner):
    runner.start()  # earlier tests killed workers; replace them now, so that no start is timed below

    async def timed(name, arguments):
        t0 = time.monotonic()
        result = await runner.call(name, arguments)
        return result, time.monotonic() - t0

    async def main():
        slow = asyncio.create_task(timed("sleep_for", {"seconds": 3.0}))
        await asyncio.sleep(0.05)  # the sleeper holds one worker
        quick = [asyncio.create_task(timed("echo", {"text": str(i)})) for i in range(3)]
        return await slow, await asyncio.gather(*quick)

    t0 = time.monotonic()
    (slow, slow_s), quick = asyncio.run(main())
    assert slow.text == "slept 3.0" and 3.0 <= slow_s < 4.0
    assert [r.text for r, _ in quick] == ["0", "1", "2"]
    assert max(s for _, s in quick) < 1.0, quick  # the three share the free worker while the sleeper sleeps
    assert time.monotonic() - t0 < 4.0


def test_deadline_bounds_the_wait_and_timeout_must_be_positive():
    with ToolRunner(TOOLS, memory_mb=256, workers=1) as pool:
        pool.start()

        async def main():
            slow = asyncio.create_task(pool.call("sleep_for", {"seconds": 1.5}))
            await asyncio.sleep(0.05)
            waiting = await pool.call("echo", {"text": "late"}, deadline=time.monotonic() + 0.3)
            return await slow, waiting

        slow, waiting = asyncio.run(main())
        assert slow.status == "ok"
        assert waiting.status == "timeout" and "waited for a free tool worker" in waiting.text
        assert waiting.seconds < 1.0
        assert pool.call_sync("echo", {"text": "a"}, timeout_s=0).status == "timeout"
    assert pool.call_sync("echo", {"text": "a"}).text == "Error: the tool runner is closed"
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        ToolRunner(TOOLS, timeout_s=0)


def test_stats_count_statuses():
    with ToolRunner(TOOLS, memory_mb=256, workers=1) as pool:
        pool.call_sync("echo", {"text": "a"})
        pool.call_sync("raise_value_error", {"text": "b"})
        pool.call_sync("nope", {})
        pool.call_sync("big_result", {"chars": 300})
        stats = pool.stats
    assert {k: stats[k] for k in ("calls", "ok", "error", "unknown_tool", "truncated", "crash")} == {
        "calls": 4,
        "ok": 2,
        "error": 1,
        "unknown_tool": 1,
        "truncated": 1,
        "crash": 0,
    }


def test_cancelling_a_running_call_kills_its_worker(runner):
    starts = runner.stats["worker_starts"]

    async def main():
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(runner.call("sleep_for", {"seconds": 1e6}), 0.3)
        t0 = time.monotonic()  # both workers free again within a poll: the sleeper's was killed
        results = await asyncio.gather(*(runner.call("sleep_for", {"seconds": 0.2}) for _ in range(2)))
        return results, time.monotonic() - t0

    results, seconds = asyncio.run(main())
    assert [r.text for r in results] == ["slept 0.2", "slept 0.2"]
    assert seconds < 2.0
    assert runner.stats["worker_starts"] == starts + 1


def test_memory_limit_below_the_worker_itself_says_so(caplog):
    with ToolRunner(TOOLS, memory_mb=16, max_chars=1000, workers=1) as pool:
        result = pool.call_sync("echo", {"text": "a"})
    assert "Traceback" in caplog.text  # the whole story is logged for the operator
    assert result.status == "crash"
    assert result.text.startswith("Error: the worker process for tool 'echo' could not start: it failed while starting")
    assert "above its limit of 16 MiB (rollout.multi_turn.tool_memory_mb); raise the limit" in result.text
    assert "Traceback" not in result.text


def test_unpicklable_tool_runs_in_a_forked_worker(capfd):
    def shout(text: str) -> str:
        """Shout, printing a lot on the way.

        Args:
            text: The text.
        """
        print("z" * 1_000_000)
        return text.upper()

    with pytest.warns(RuntimeWarning, match=r"cannot be pickled.*shout.*forks of this process"):
        pool = ToolRunner({"shout": FunctionTool(shout), "sleep_for": FunctionTool(sleep_for)}, workers=1)
    with pool:
        capfd.readouterr()
        assert pool.call_sync("shout", {"text": "hey"}).text == "HEY"
        assert len("".join(capfd.readouterr())) < 4096
        timed_out = pool.call_sync("sleep_for", {"seconds": 1e6}, timeout_s=0.5)
        assert timed_out.status == "timeout"
        assert pool.call_sync("shout", {"text": "again"}).text == "AGAIN"


def test_worker_killed_while_idle_is_replaced_before_the_call():
    with ToolRunner(TOOLS, memory_mb=256, workers=1) as pool:
        assert pool.call_sync("echo", {"text": "first"}).text == "first"
        (worker,) = pool._idle
        os.kill(worker.pid, signal.SIGKILL)
        worker.popen.wait(5)
        result = pool.call_sync("echo", {"text": "fresh"})
        assert (result.status, result.text) == ("ok", "fresh")
        assert pool.stats["worker_starts"] == 2
