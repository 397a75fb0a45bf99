"""Byte-level GGUF structure: where the KV block, the tensor directory and each tensor's bytes lie.

The layout tools never decode tensor data and never re-serialize KVs: they copy byte ranges. This
module parses only what they need (header counts, the raw KV block, the directory, a few scalar
KVs) and encodes directory entries for the files they write. GGUF v3 only (what llama.cpp writes).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from forge.errors import ForgeError
from forge.gguf_file import (
    GGUF_MAGIC_BYTES,
    HEADER_BYTES,
    align_up,
    check_input_file,
    read_header,
    read_tensor_directory,
)

GGUF_MAGIC = GGUF_MAGIC_BYTES  # the layout tools' name for it
DEFAULT_ALIGNMENT = 32

# Fixed byte sizes of the scalar GGUF value types (8 = string, 9 = array are variable).
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_SCALAR_FORMATS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


def type_geometry(ggml_type: int) -> tuple[int, int]:
    """(block elements, block bytes) of a GGML type; ForgeError for an unknown id."""
    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise ForgeError(f"unknown GGML tensor type id {ggml_type}") from None


def type_name(ggml_type: int) -> str:
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type{ggml_type}"


def tensor_nbytes(ggml_type: int, dims: tuple[int, ...], what: str = "tensor") -> int:
    """Byte size of a tensor with ``dims`` in GGUF order (ne0 first)."""
    block, size = type_geometry(ggml_type)
    if not dims or dims[0] % block:
        raise ForgeError(
            f"{what}: ne0={dims[0] if dims else 0} is not a multiple of {type_name(ggml_type)}'s block of {block}"
        )
    n = dims[0] // block * size
    for d in dims[1:]:
        n *= d
    return n


@dataclass(frozen=True)
class RawTensor:
    name: str
    dims: tuple[int, ...]  # GGUF order: ne0, ne1, ...
    ggml_type: int
    offset: int  # relative to the start of the data section
    nbytes: int


@dataclass
class RawGGUF:
    """A parsed GGUF file kept open as a read-only mmap; ``mm`` spans the whole file."""

    path: Path
    size: int
    version: int
    n_kv: int
    kv_start: int  # first byte of the KV block (right after the 24-byte header)
    kv_end: int
    dir_end: int  # end of the tensor directory
    data_start: int
    alignment: int
    tensors: list[RawTensor]
    kv: dict[str, object]  # scalar and string KVs (arrays omitted)
    mm: mmap.mmap | bytes

    @property
    def kv_block(self) -> memoryview:
        return memoryview(self.mm)[self.kv_start : self.kv_end]

    def tensor_view(self, t: RawTensor) -> memoryview:
        start = self.data_start + t.offset
        return memoryview(self.mm)[start : start + t.nbytes]

    def by_name(self) -> dict[str, RawTensor]:
        return {t.name: t for t in self.tensors}

    def data_end(self) -> int:
        """End of the last tensor's bytes (file offset)."""
        if not self.tensors:
            return self.data_start
        return max(self.data_start + t.offset + t.nbytes for t in self.tensors)

    def close(self) -> None:
        if isinstance(self.mm, mmap.mmap):
            # A caller may still hold a view; the mapping then goes away with the last view.
            with contextlib.suppress(BufferError):
                self.mm.close()

    def __enter__(self) -> RawGGUF:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Cursor:
    def __init__(self, buf: mmap.mmap | bytes, pos: int, path: Path) -> None:
        self.buf, self.pos, self.path, self.end = buf, pos, path, len(buf)

    def take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > self.end:
            raise ForgeError(
                f"{self.path}: truncated GGUF (header wants bytes up to {start + n:,}, file has {self.end:,})"
            )
        self.pos = start + n
        return start

    def unpack(self, fmt: str, n: int) -> object:
        return struct.unpack_from(fmt, self.buf, self.take(n))[0]

    def u32(self) -> int:
        return self.unpack("<I", 4)  # type: ignore[return-value]

    def u64(self) -> int:
        return self.unpack("<Q", 8)  # type: ignore[return-value]

    def string(self) -> str:
        n = self.u64()
        start = self.take(n)
        try:
            return bytes(self.buf[start : start + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise ForgeError(f"{self.path}: invalid UTF-8 string at byte {start}") from None

    def skip_value(self, vtype: int) -> object:
        if vtype in _SCALAR_SIZES:
            return self.unpack(_SCALAR_FORMATS[vtype], _SCALAR_SIZES[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.u32(), self.u64()
            if etype in _SCALAR_SIZES:
                self.take(_SCALAR_SIZES[etype] * count)
            else:
                if self.pos + 8 * count > self.end:  # every item is at least a string length
                    raise ForgeError(f"{self.path}: truncated GGUF (an array of {count:,} items)")
                for _ in range(count):
                    self.skip_value(etype)
            return None
        raise ForgeError(f"{self.path}: unknown GGUF value type {vtype} at byte {self.pos - 4}")


def open_gguf(path: str | os.PathLike[str]) -> RawGGUF:
    """Parse ``path``'s header, KV block and tensor directory; check every tensor lies in the file."""
    path = Path(path)
    check_input_file(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:  # ValueError: mmap of a file emptied since the check
        raise ForgeError(f"{path}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    try:
        return _parse(path, mm, size)
    except BaseException:
        mm.close()
        raise


def _parse(path: Path, mm: mmap.mmap | bytes, size: int) -> RawGGUF:
    version, n_tensors, n_kv = read_header(path, mm, size)
    if version != 3:
        raise ForgeError(f"{path}: GGUF version {version} is not supported (only 3)")
    cur = _Cursor(mm, HEADER_BYTES, path)
    kv_start = cur.pos
    kv: dict[str, object] = {}
    for _ in range(n_kv):
        key = cur.string()
        kv[key] = cur.skip_value(cur.u32())
    kv_end = cur.pos
    alignment = kv.get("general.alignment", DEFAULT_ALIGNMENT)
    entries, dir_end, data_start = read_tensor_directory(path, mm, kv_end, n_tensors, alignment, size)
    assert isinstance(alignment, int)  # checked by read_tensor_directory
    tensors = [RawTensor(e.name, e.ne, e.ggml_type, e.offset, e.nbytes) for e in entries]
    return RawGGUF(
        path,
        size,
        version,
        n_kv,
        kv_start,
        kv_end,
        dir_end,
        data_start,
        alignment,
        tensors,
        kv,
        mm,
    )


def encode_header(n_tensors: int, n_kv: int) -> bytes:
    return GGUF_MAGIC + struct.pack("<IQQ", 3, n_tensors, n_kv)


def packed_offsets(sizes: list[int], alignment: int) -> list[int]:
    """Data-section offsets of tensors written back to back, each start aligned (llama.cpp's rule)."""
    offsets, pos = [], 0
    for n in sizes:
        offsets.append(pos)
        pos = align_up(pos + n, alignment)
    return offsets
