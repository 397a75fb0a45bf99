"""Holding a device stream until the host has answered: ``wait_for_host(done, i, step, fault)`` queues work
that ends when ``done[i]`` (page-locked host memory, written by a host thread) equals the device value
``step[0]``. On CUDA it is one single-thread Triton kernel reading ``done[i]`` over the bus (volatile loads)
until it matches, so a CUDA graph can hold a host round trip without the host driving the stream; it gives
up after ``limit`` reads (seconds), sets ``fault[0]`` and lets the stream go on. On a CPU "device" the
calling thread itself waits, yielding the GIL.
"""

from __future__ import annotations

import os
import time

import torch

from runtime.backends.triton_launch import launch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - machines without triton
    triton = tl = None

#: reads of the host flag before the kernel gives up (each read crosses the bus: ~1 us)
LIMIT = 10_000_000
#: seconds a CPU "device" waits before giving up
CPU_TIMEOUT = 30.0

if triton is not None:

    @triton.jit
    def _wait_kernel(done, step, i, fault, limit):
        want = tl.load(step)
        seen = tl.load(done + i, volatile=True)
        n = 0
        while (seen != want) & (n < limit):
            seen = tl.load(done + i, volatile=True)
            n += 1
        if seen != want:
            tl.store(fault, 1)


def wait_for_host(done: torch.Tensor, i: int, step: torch.Tensor, fault: torch.Tensor) -> None:
    """Queue a wait until ``done[i] == step[0]`` (int32 tensors; ``done`` and ``fault`` page-locked on the
    host, ``step`` on the stream's device)."""
    if step.device.type == "cuda":
        launch(_wait_kernel, (1,), done, step, i, fault, LIMIT, num_warps=1)
        return
    want, t0 = int(step[0]), time.monotonic()
    flags = done.numpy()
    while flags[i] != want:
        if time.monotonic() - t0 > CPU_TIMEOUT:
            fault.numpy()[0] = 1
            return
        os.sched_yield()


__all__ = ["LIMIT", "wait_for_host"]
