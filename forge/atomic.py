"""Transactional output files: nothing half-written is ever visible under a real name.

On Linux the data goes to an anonymous ``O_TMPFILE`` inode in the destination folder, which is
linked into the folder only after it is complete and fsynced; a process killed mid-write (even by
SIGKILL) leaves nothing behind. Elsewhere a named temporary file is used and removed on any error.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from forge.errors import ForgeError

_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000


def check_output_path(dest: str | os.PathLike[str], need_bytes: int = 0) -> Path:
    """Refuse a destination whose folder is missing or not writable, or that lacks ``need_bytes`` of space."""
    dest = Path(dest)
    parent = dest.parent if str(dest.parent) else Path(".")
    if not parent.is_dir():
        raise ForgeError(f"{dest}: output folder {parent} does not exist")
    if dest.is_dir():
        raise ForgeError(f"{dest}: is a folder, expected a file name")
    if not os.access(parent, os.W_OK):
        reason = "read-only file system" if _read_only_fs(parent) else "permission denied"
        raise ForgeError(f"{dest}: cannot write to folder {parent} ({reason})")
    if need_bytes:
        free = shutil.disk_usage(parent).free
        if free < need_bytes:
            raise ForgeError(f"{dest}: needs {need_bytes:,} bytes, only {free:,} free in {parent}")
    return dest


def _read_only_fs(folder: Path) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def same_file(a: Path, b: Path) -> bool:
    """``a`` and ``b`` name one file: the same path after links, or one inode (a hard link)."""
    if a.resolve() == b.resolve():
        return True
    try:
        sa, sb = a.stat(), b.stat()
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def refuse_overwriting_inputs(outputs: list[tuple[str, Path]], inputs: list[tuple[str, Path]]) -> None:
    """The output guard of every writing command, checked before any work.

    An output may not be an input (same path, symlink or hard link), nor lie inside an input folder where
    it would replace one of its files or write into a Hugging Face checkpoint (a folder with config.json).
    Each pair is (option name, path), for the message.
    """
    for out_opt, out in outputs:
        for in_opt, src in inputs:
            if same_file(out, src):
                raise ForgeError(f"{out_opt} {out} is the input {src} ({in_opt}); choose another output path")
            # the folder the name lands in, links resolved, but not the name itself (a symlinked shard)
            inside = src.is_dir() and (out.parent.resolve() / out.name).is_relative_to(src.resolve())
            if inside and (out.exists() or (src / "config.json").is_file()):
                raise ForgeError(
                    f"{out_opt} {out} would write into the input folder {src} ({in_opt}); "
                    "choose another output path"
                )


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _materialize(f: BinaryIO, name: str) -> None:
    """Give the anonymous file ``f`` the name ``name`` (same folder)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.linkat(f.fileno(), b"", _AT_FDCWD, os.fsencode(name), _AT_EMPTY_PATH) == 0:
        return
    try:
        os.link(f"/proc/self/fd/{f.fileno()}", name, follow_symlinks=True)
        return
    except OSError:
        pass
    # Neither link form is allowed here: copy into a named file (rare; still all-or-nothing).
    size = f.seek(0, os.SEEK_END)
    out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        offset = 0
        while offset < size:
            offset += os.sendfile(out, f.fileno(), offset, min(size - offset, 1 << 30))
        os.fsync(out)
    except BaseException:
        os.close(out)
        os.unlink(name)
        raise
    os.close(out)


@contextlib.contextmanager
def atomic_output(dest: str | os.PathLike[str], need_bytes: int = 0) -> Iterator[BinaryIO]:
    """Yield a binary file; on clean exit it is fsynced and renamed onto ``dest``.

    On any exception the destination is untouched and no temporary file remains.
    """
    dest = check_output_path(dest, need_bytes)
    folder = dest.parent if str(dest.parent) else Path(".")
    anonymous = hasattr(os, "O_TMPFILE")
    fd = -1
    tmp_name = ""
    if anonymous:
        try:
            fd = os.open(folder, os.O_TMPFILE | os.O_RDWR, 0o644)
        except OSError:
            anonymous = False
    if not anonymous:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w+b") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
            if anonymous:
                tmp_name = str(folder / f".{dest.name}.{os.getpid()}.tmp")
                _materialize(f, tmp_name)
        os.replace(tmp_name, dest)
        tmp_name = ""
        fsync_dir(folder)
    except OSError as e:  # disk full, quota, I/O error: name the file being written, not a temp inode
        raise ForgeError(f"{e.filename or dest}: {e.strerror or e} (nothing written)") from None
    finally:
        if tmp_name:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_name)
