"""OpenMP teams: let go of the calling thread's (``release``), or never make one (``serial``).

A thread that has run a parallel region (a numba kernel, a torch CPU product) keeps its team's threads for good.
libgomp counts every team's threads, and while they outnumber the cores it has each team's threads sleep
between its regions instead of spinning for the next one. The hybrid executor's CPU worker opens two regions
a decode layer; with the model thread's team (made while the model loads) beside the worker's, on the 16-core
H200 host an empty region on the worker cost ~35 us instead of ~7, and a layer's CPU call ~150-170 us + ~30
per missed expert instead of ~65-80 + ~30 (decode at 4 GiB, trace routing: 60-64 -> 71-81 tok/s, session 28,
``benchmarks/hybrid_cpu_step.py --main-team torch|released`` and ``hybrid_experts.py``). ``release`` uses
OpenMP 5's ``omp_pause_resource_all``, which frees the team of a thread outside any region (its next region
makes a new one), in each libgomp loaded when ``find`` last looked (torch's wheel may carry its own)."""

from __future__ import annotations

import contextlib
import ctypes
from pathlib import Path

import torch

OMP_PAUSE_HARD = 2
PR_SET_NAME = 15
_libs: list[ctypes.CDLL] = []  # the loaded libgomps with omp_pause_resource_all, as ``find`` last saw them


def find() -> int:
    """Look up every libgomp this process has loaded (the mapped files, now) that has
    ``omp_pause_resource_all`` (libgomp from GCC 10 on); returns how many."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:  # not Linux
        maps = []
    libs = []
    for path in sorted({line.split()[-1] for line in maps if "/libgomp" in line}):
        try:
            lib = ctypes.CDLL(path)
            lib.omp_pause_resource_all, lib.omp_set_num_threads  # noqa: B018  # both there, or skip it
        except (OSError, AttributeError):
            continue
        libs.append(lib)
    _libs[:] = libs
    return len(libs)


def release() -> None:
    """Free the calling thread's OpenMP team in each library ``find`` found (nothing where it has none)."""
    for lib in _libs:
        lib.omp_pause_resource_all(OMP_PAUSE_HARD)


def name_thread(name: str) -> None:
    """Name the calling thread ``name`` (15 bytes at most) as ``top -H`` and ``/proc/PID/task/*/comm`` show it;
    the threads of a team it makes later take the name too."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def serial(name: str) -> None:
    """Name the calling thread ``name`` and have its torch CPU work (copies, indexing, elementwise: ATen's own
    loops; MKL's products keep their own thread count) run on it alone, with no OpenMP team: a
    ``ThreadPoolExecutor`` initializer for a helper thread whose copies need not be spread over the cores."""
    name_thread(name)
    if not _libs:
        find()
    torch.get_num_threads()  # torch sets a thread's OpenMP count at the thread's first use of it: before ours
    for lib in _libs:
        lib.omp_set_num_threads(1)
