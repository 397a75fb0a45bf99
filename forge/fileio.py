"""Reading a user's text file with one clear error, byte copies between files that stay in the kernel
where the OS allows (copy_file_range), and dropping a read-only mapping's pages once they are read."""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np

_CHUNK = 64 << 20
_FAULT_AROUND = 64 << 10


def read_text(path: str | os.PathLike[str]) -> str:
    """A UTF-8 text file's contents; ForgeError for a missing path, a folder or bytes that are not UTF-8."""
    from forge.errors import ForgeError

    p = Path(path)
    if p.is_dir():
        raise ForgeError(f"{p}: is a folder, not a text file")
    if not p.is_file():
        raise ForgeError(f"{p}: no such file")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ForgeError(f"{p}: not UTF-8 text") from None


def drop_pages(mapping: np.memmap, offset: int, nbytes: int) -> None:
    """Take the pages of ``mapping[offset : offset + nbytes]`` out of this process's resident set (a read-only
    file mapping: the OS page cache keeps them, and a later read maps them again). A quantize that has read
    a tensor drops it, so its RSS stays bounded by what it holds, not by the size of the source it has read."""
    mm = getattr(mapping, "_mmap", None)
    if mm is None or nbytes <= 0 or not hasattr(mmap, "MADV_DONTNEED"):
        return
    # a read fault maps the pages around it too (Linux's fault-around, 64 KiB): those go with the range
    start = max(0, (offset - _FAULT_AROUND) // mmap.PAGESIZE * mmap.PAGESIZE)
    end = min(len(mm), -(-(offset + nbytes + _FAULT_AROUND) // mmap.PAGESIZE) * mmap.PAGESIZE)
    if end > start:
        mm.madvise(mmap.MADV_DONTNEED, start, end - start)


def copy_ranges(dst: BinaryIO, ranges: Sequence[tuple[str | Path, int, int]]) -> None:
    """Append ``(path, offset, nbytes)`` ranges to ``dst`` at its current position, in order."""
    dst.flush()
    pos = dst.tell()
    fd = dst.fileno()
    for path, offset, nbytes in ranges:
        src = os.open(path, os.O_RDONLY)
        try:
            done = 0
            while done < nbytes:
                n = 0
                with contextlib.suppress(AttributeError, OSError):
                    n = os.copy_file_range(src, fd, min(nbytes - done, 1 << 30), offset + done, pos + done)
                if n <= 0:  # not supported here: a plain read/write loop with a reusable buffer
                    _copy_plain(src, fd, offset + done, pos + done, nbytes - done)
                    done = nbytes
                    break
                done += n
        finally:
            os.close(src)
        pos += nbytes
    dst.seek(pos)


def _copy_plain(src: int, dst: int, src_off: int, dst_off: int, nbytes: int) -> None:
    buf = bytearray(min(_CHUNK, nbytes))
    view = memoryview(buf)
    while nbytes:
        n = os.preadv(src, [view[: min(len(buf), nbytes)]], src_off)
        if n <= 0:
            raise OSError(f"short read at offset {src_off}")
        written = 0
        while written < n:
            written += os.pwrite(dst, view[written:n], dst_off + written)
        src_off, dst_off, nbytes = src_off + n, dst_off + n, nbytes - n
