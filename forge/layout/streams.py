"""Large sequential writes, in-kernel copies and SHA-256 off the main thread.

hashlib releases the GIL on large buffers, so a digest computed in a worker thread overlaps the
main thread's copies and comparisons.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

HASH_CHUNK = 64 << 20
Buffer = Any  # anything exporting the buffer protocol: bytes, memoryview, mmap, numpy array
_ZEROS = bytes(1 << 20)


def sha256_async(buf: Buffer, start: int, end: int) -> Future[bytes]:
    """SHA-256 of ``buf[start:end]`` computed in a worker thread."""

    def run() -> bytes:
        h, mv = hashlib.sha256(), memoryview(buf)
        for pos in range(start, end, HASH_CHUNK):
            h.update(mv[pos : min(pos + HASH_CHUNK, end)])
        return h.digest()

    pool = ThreadPoolExecutor(max_workers=1)
    fut = pool.submit(run)
    pool.shutdown(wait=False)
    return fut


class HashPipe:
    """SHA-256 of a sequence of buffers fed in order, hashed by a worker thread.

    The caller must not modify a buffer after feeding it.
    """

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self._q: queue.Queue[memoryview | None] = queue.Queue(maxsize=8)
        self._error: BaseException | None = None
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while (buf := self._q.get()) is not None:
            try:
                self._h.update(buf)
            except BaseException as e:  # surfaced by digest()
                self._error = e

    def feed(self, buf: Buffer) -> None:
        mv = memoryview(buf).cast("B")
        if mv.nbytes:
            self._q.put(mv)

    def digest(self) -> bytes:
        self._q.put(None)
        self._t.join()
        if self._error:
            raise self._error
        return self._h.digest()


def _sync_file_range() -> Callable[[int, int, int], None] | None:
    """Linux sync_file_range(fd, offset, n, SYNC_FILE_RANGE_WRITE): start writeback, do not wait."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]

    def start_writeback(fd: int, offset: int, n: int) -> None:
        fn(fd, offset, n, 2)  # best effort: a failure only means the final fsync does all the work

    return start_writeback


_START_WRITEBACK = _sync_file_range()
WRITEBACK_BYTES = 64 << 20


class Sink:
    """Sequential positional writer on a raw file descriptor; optionally feeds every byte to a
    HashPipe. Writeback to the disk is started every 64 MiB, so that the final fsync does not find
    the whole file dirty (the disk works while the CPU copies and hashes)."""

    def __init__(self, fd: int, hasher: HashPipe | None = None) -> None:
        self.fd, self.pos, self.hasher = fd, 0, hasher
        self._cfr = hasattr(os, "copy_file_range")
        self._flushed = 0

    def _advance(self, n: int) -> None:
        self.pos += n
        if _START_WRITEBACK and self.pos - self._flushed >= WRITEBACK_BYTES:
            _START_WRITEBACK(self.fd, self._flushed, self.pos - self._flushed)
            self._flushed = self.pos

    def _put(self, mv: memoryview) -> None:
        done = 0
        while done < mv.nbytes:
            done += os.pwrite(self.fd, mv[done:], self.pos + done)
        self._advance(mv.nbytes)

    def write(self, buf: Buffer) -> None:
        mv = memoryview(buf).cast("B")
        if self.hasher:
            self.hasher.feed(mv)
        self._put(mv)

    def zeros(self, n: int) -> None:
        while n > 0:
            k = min(n, len(_ZEROS))
            self.write(memoryview(_ZEROS)[:k])
            n -= k

    def pad_to(self, pos: int) -> None:
        if pos < self.pos:
            raise AssertionError(f"writer at {self.pos} asked to pad back to {pos}")
        self.zeros(pos - self.pos)

    def copy_from(self, src_fd: int, src_buf: Buffer, offset: int, n: int) -> None:
        """Copy ``n`` bytes at ``offset`` of a source open as ``src_fd`` and mapped as ``src_buf``.

        The bytes move inside the kernel (copy_file_range) when it can; the hasher reads them from
        the mapping, in a worker thread.
        """
        src = memoryview(src_buf)[offset : offset + n]
        if self.hasher:
            self.hasher.feed(src)
        done = 0
        if self._cfr:
            try:
                while done < n:
                    k = os.copy_file_range(src_fd, self.fd, n - done, offset + done, self.pos + done)
                    if k == 0:
                        raise OSError(errno.EIO, "copy_file_range copied nothing")
                    done += k
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EIO):
                    raise
                self._cfr = False
        self._advance(done)
        for pos in range(done, n, HASH_CHUNK):
            self._put(src[pos : min(pos + HASH_CHUNK, n)])
