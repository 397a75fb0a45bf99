"""Reading a user's text file with one clear error, and byte copies between files that stay in the kernel
where the OS allows (copy_file_range)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

_CHUNK = 64 << 20


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
