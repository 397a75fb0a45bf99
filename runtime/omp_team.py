"""Let go of the calling thread's OpenMP team.

A thread that has run a parallel region (a numba kernel, a torch CPU product) keeps its team's threads for good,
asleep between regions. libgomp counts every team's threads, and while they outnumber the cores it has each
team's threads sleep between its regions instead of spinning for the next one: on the 16-core H200 host, with
the main thread's team beside the hybrid worker's, an empty region on the worker cost ~42 us instead of ~8,
and a decode layer's CPU call (two regions) ~100 us more (``benchmarks/hybrid_cpu_step.py --main-team torch``
against ``none``, session 28). The main thread of a GPU run gets its team while the model loads; ``release``
frees it: OpenMP 5's ``omp_pause_resource_all`` on a thread outside any region frees that thread's team (the
next region on it makes a new one). Each loaded libgomp is asked (torch's wheel may carry its own), the ones
loaded when ``find`` last looked."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable
from pathlib import Path

import torch

OMP_PAUSE_HARD = 2
PR_SET_NAME = 15
_pause: list[Callable[[int], int]] = []
_set_threads: list[Callable[[int], None]] = []


def find() -> int:
    """Look up ``omp_pause_resource_all`` in every libgomp this process has loaded (the mapped files, now);
    returns how many have it (libgomp from GCC 10 on)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:  # not Linux
        maps = []
    paths = sorted({line.split()[-1] for line in maps if "/libgomp" in line})
    pause, set_threads = [], []
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
            fn, count = lib.omp_pause_resource_all, lib.omp_set_num_threads
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        count.argtypes, count.restype = [ctypes.c_int], None
        pause.append(fn)
        set_threads.append(count)
    _pause[:], _set_threads[:] = pause, set_threads
    return len(pause)


def release() -> None:
    """Free the calling thread's OpenMP team in each library ``find`` found (nothing where it has none)."""
    for fn in _pause:
        fn(OMP_PAUSE_HARD)


def name_thread(name: str) -> None:
    """Name the calling thread ``name`` (15 bytes at most) as ``top -H`` and ``/proc/PID/task/*/comm`` show it;
    the threads of a team it makes later take the name too."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def serial(name: str) -> None:
    """Name the calling thread ``name`` and have its torch CPU work run on it alone, with no OpenMP team: a
    ``ThreadPoolExecutor`` initializer for a helper thread whose copies need not be spread over the cores."""
    name_thread(name)
    if not _set_threads:
        find()
    torch.get_num_threads()  # torch sets a thread's OpenMP count at the thread's first use of it: before ours
    for fn in _set_threads:
        fn(1)
