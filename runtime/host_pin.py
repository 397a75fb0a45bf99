"""Page-locking ranges of the mapped model file, so that copies from them to the GPU run at DMA speed.

A copy to the GPU from pageable memory passes through the driver's own staging buffers: on the H200 machine
7.5 GB/s from the mapped file against 55 GB/s from page-locked memory. ``cudaHostRegister`` page-locks
memory that is already mapped (read-only pages: ``cudaHostRegisterReadOnly``), the file's pages included, so
the hybrid executor's copies of whole layers and of single experts read the file at the link's speed without
a pass through pinned staging buffers. Registering faults the pages in and keeps them resident until
``release``: done only when they fit in the host's available memory with room to spare.

A registration outlives the mapping it was made on: were the file unmapped while registered, a later mapping
at the same addresses would be copied from the stale registration (NaNs, or "invalid argument"). So the
ranges hold the tensors they lock, and are released when they are dropped unreleased.
"""

from __future__ import annotations

import mmap
import os
import time
import weakref
from typing import Any

import torch

#: cudaHostRegisterReadOnly: the pages are only read by the device (what a read-only mapping allows)
_READ_ONLY = 8
#: ranges closer than this are registered as one (fewer registrations; the gap's pages are locked too)
MERGE_GAP = 16 << 20
#: page-lock only when the ranges take at most this share of the host's available memory
MAX_SHARE = 0.7


class PinnedRanges:
    """Page-locked byte ranges of host memory (registered with the CUDA driver) under ``keep`` (held, so the
    memory stays mapped while locked), released by ``release`` or else when this object is dropped."""

    def __init__(self, ranges: list[tuple[int, int]], seconds: float, keep: list[torch.Tensor]) -> None:
        self.ranges, self.seconds, self._keep = ranges, seconds, keep
        self._release = weakref.finalize(self, _unregister, [ptr for ptr, _ in ranges])

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.ranges)

    def release(self) -> None:
        self._release()
        self.ranges, self._keep = [], []


def _unregister(ptrs: list[int]) -> None:
    """Unlock the ranges starting at ``ptrs`` once no copy queued on any device can still read them."""
    if ptrs:
        for device in range(torch.cuda.device_count()):
            torch.cuda.synchronize(device)
        cudart = torch.cuda.cudart()
        for ptr in ptrs:
            cudart.cudaHostUnregister(ptr)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The first and past-the-last byte address that ``t`` (any strides >= 0) reads."""
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def merged_pages(tensors: list[torch.Tensor], gap: int = MERGE_GAP) -> list[tuple[int, int]]:
    """The page-aligned (start, bytes) ranges covering what ``tensors`` read, ranges less than ``gap`` apart
    merged."""
    page = mmap.PAGESIZE
    spans = sorted((lo // page * page, -(-hi // page) * page) for lo, hi in map(_span, tensors) if hi > lo)
    out: list[list[int]] = []
    for lo, hi in spans:
        if out and lo <= out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi - lo) for lo, hi in out]


def pin(tensors: list[torch.Tensor], available: int) -> PinnedRanges | None:
    """Page-lock the host memory under ``tensors`` (CPU tensors, e.g. views of the mapped file) when it takes at most ``MAX_SHARE`` of ``available`` bytes; None when it does not, when
    FORGE_HYBRID_PIN=0, or when the driver refuses (what was registered is released again)."""
    if os.environ.get("FORGE_HYBRID_PIN") == "0" or not torch.cuda.is_available():
        return None
    ranges = merged_pages(tensors)
    if sum(n for _, n in ranges) > MAX_SHARE * available:
        return None
    cudart = torch.cuda.cudart()
    t0, done = time.perf_counter(), []
    for ptr, n in ranges:
        if _failed(cudart.cudaHostRegister(ptr, n, _READ_ONLY)):
            clear = getattr(cudart, "cudaGetLastError", None)
            if clear is not None:  # the failure is not left for the next kernel launch's check to find
                clear()
            PinnedRanges(done, 0.0, tensors).release()
            return None
        done.append((ptr, n))
    return PinnedRanges(done, time.perf_counter() - t0, tensors)


def _failed(err: Any) -> bool:
    return int(getattr(err, "value", err)) != 0


__all__ = ["MAX_SHARE", "MERGE_GAP", "PinnedRanges", "merged_pages", "pin"]
