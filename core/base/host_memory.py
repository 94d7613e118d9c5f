"""Host (CPU) memory of the training process: its resident size, and giving the C heap's free
memory back to the operating system after each step (``trainer.malloc_trim``).

Why: the trainer frees and allocates tensors of many sizes every step. glibc keeps freed heap
memory mapped for reuse, fragmented between live blocks, so the resident size of a real-model run
grows for about 20 steps although no tensor or Python object is kept alive (measured with
``benchmarks/soak.py --diagnose``: 3.8 GiB of an 8.2 GiB trainer was heap held as free;
``benchmarks/results/soak_real_diagnose.txt``). ``malloc_trim(0)`` returns the free pages of every
arena (``madvise(MADV_DONTNEED)``), so what the process holds follows what it uses.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import time
from typing import Any

__all__ = ["heap_mib", "keep_freed_memory", "malloc_trim", "rss_bytes"]


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (glibc >= 2.33): sizes in bytes."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


@functools.cache
def _mallinfo2() -> Any:
    """glibc's ``mallinfo2`` (a ctypes function), or None where the C library has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.argtypes = []
    fn.restype = _MallInfo2
    return fn


def heap_mib() -> tuple[float, float]:
    """``(in_use, free)``: MiB of this process's C heap in use (``uordblks + hblkhd``: allocated blocks,
    mmapped ones included) and held free by malloc (``fordblks``; :func:`malloc_trim` gives their pages back to the OS, but
    malloc still counts them here),
    over every arena, from glibc's ``mallinfo2``. ``(nan, nan)`` where the C library has none."""
    fn = _mallinfo2()
    if fn is None:
        return float("nan"), float("nan")
    mi = fn()
    return (mi.uordblks + mi.hblkhd) / 2**20, mi.fordblks / 2**20


@functools.cache
def _glibc() -> Any:
    """glibc's ``malloc_trim`` (a ctypes function), or None where the C library is not glibc (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def malloc_trim() -> float | None:
    """Return the free memory of the C heap (every malloc arena) to the OS: glibc's ``malloc_trim(0)``.

    Returns the seconds it took (tens of milliseconds for a few GiB of free heap), or None where the
    C library has no ``malloc_trim`` (then nothing is done). It frees nothing that is in use, so it
    cannot change results; memory it returns is faulted in again (zeroed) when reused.
    """
    fn = _glibc()
    if fn is None:
        return None
    t0 = time.perf_counter()
    fn(0)
    return time.perf_counter() - t0


#: glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


@functools.cache
def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse instead of giving it back to the OS at every ``free``.

    Why: a training step allocates and frees tensors of tens to hundreds of MB many times (a
    micro-batch's activations, a chunk of ``(rows, vocabulary)`` logits). glibc serves every block
    above its mmap threshold (at most 32 MiB) with a fresh ``mmap`` and ``munmap``s it when freed, so
    each such tensor is page-faulted in (and zeroed by the kernel) again: on the 2-core machine
    behind this project one SmolLM2 micro-batch (8 x 175 tokens, forward + backward) took 3.2 s
    with ~360,000 page faults, 2.5 s with none (a one-off profile; the committed
    ``benchmarks/results/update_mfu.md`` measures 5-8% on the compiled updates, variant
    ``no-heap-reuse``).

    This sets ``mallopt(M_MMAP_MAX, 0)`` (large blocks come from the heap too) and
    ``mallopt(M_TRIM_THRESHOLD, 2 GiB)`` (free memory at the heap top is not returned at each
    ``free``), for this process only. Memory is still given back once per step by
    :func:`malloc_trim` (``trainer.malloc_trim``), so the resident size follows what the process uses
    between steps. Called once by the training backends (``trainer.malloc_keep_freed``); returns
    True when both settings took, False where the C library is not glibc (nothing is changed).
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallopt
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return bool(fn(_M_MMAP_MAX, 0)) and bool(fn(_M_TRIM_THRESHOLD, 2**31 - 1))


def rss_bytes(pid: int | None = None) -> int:
    """The resident set size of process ``pid`` (default: this one) in bytes, from ``/proc/<pid>/statm``
    (Linux); 0 where that file cannot be read."""
    try:
        with open(f"/proc/{pid or 'self'}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
