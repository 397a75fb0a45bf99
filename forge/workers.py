"""Worker processes that cannot outlive their parent, and a pool that stops at once when told to.

A worker asks the kernel for SIGKILL when its parent dies (Linux ``PR_SET_PDEATHSIG``), so a parent killed
with SIGKILL leaves no worker blocked on a pipe; it ignores SIGINT, which the terminal sends to the whole
process group, because the parent alone decides what an interrupt means.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from concurrent.futures import ProcessPoolExecutor

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """In a child: be killed when ``parent`` exits (Linux); exit now if it already has."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def worker_pool(workers: int) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(max_workers=workers, initializer=die_with_parent, initargs=(os.getpid(),))


def stop_pool(pool: ProcessPoolExecutor) -> None:
    """Cancel queued work and kill the workers now (an interrupt or an error: nothing more is wanted)."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    for proc in processes:
        if proc.is_alive():
            proc.kill()
    for proc in processes:
        proc.join()
    # the pool's manager thread sees its workers gone and ends; waiting for it leaves nothing for Python's
    # exit hook to wake through a closed pipe
    pool.shutdown(wait=True, cancel_futures=True)
