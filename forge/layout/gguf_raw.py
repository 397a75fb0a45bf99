"""The layout tools' byte-level view of a GGUF: where the KV block, the tensor directory and each tensor's
bytes lie (read by forge.gguf_file, the one GGUF reader), and the directory encoding of the files they write.

The layout tools never decode tensor data and never re-serialize KVs: they copy byte ranges. GGUF v3 only
(what llama.cpp writes).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from forge.errors import ForgeError
from forge.gguf_file import GGUF_MAGIC_BYTES, HEADER_BYTES, GGUFFile, align_up

GGUF_MAGIC = GGUF_MAGIC_BYTES  # the layout tools' name for it
DEFAULT_ALIGNMENT = 32


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


@dataclass(frozen=True)
class RawTensor:
    name: str
    dims: tuple[int, ...]  # GGUF order: ne0, ne1, ...
    ggml_type: int
    offset: int  # relative to the start of the data section
    nbytes: int


@dataclass
class RawGGUF:
    """A parsed GGUF file; ``mm`` is a read-only uint8 memmap of the whole file."""

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
    mm: np.ndarray

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
        """Drop this view's mapping (it goes away with the last view a caller still holds)."""
        self.mm = np.zeros(0, np.uint8)

    def __enter__(self) -> RawGGUF:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_gguf(path: str | os.PathLike[str]) -> RawGGUF:
    """The layout tools' view of a GGUF v3 file, read (and every tensor checked) by forge.gguf_file."""
    f = GGUFFile(path)
    if f.version != 3:
        raise ForgeError(f"{f.path}: GGUF version {f.version} is not supported (only 3)")
    tensors = [
        RawTensor(t.name, tuple(reversed(t.shape)), int(t.ggml_type), t.offset - f.data_offset, t.nbytes)
        for t in f.tensors.values()
    ]
    scalars = {k: e.value for k, e in f.kvs.items() if e.vtype != GGUFValueType.ARRAY}
    return RawGGUF(f.path, f.size, f.version, len(f.kvs), HEADER_BYTES, f.kv_end, f.header_end, f.data_offset,
                   f.alignment, tensors, scalars, f.mapped())  # fmt: skip


def encode_header(n_tensors: int, n_kv: int) -> bytes:
    return GGUF_MAGIC + struct.pack("<IQQ", 3, n_tensors, n_kv)


def packed_offsets(sizes: list[int], alignment: int) -> list[int]:
    """Data-section offsets of tensors written back to back, each start aligned (llama.cpp's rule)."""
    offsets, pos = [], 0
    for n in sizes:
        offsets.append(pos)
        pos = align_up(pos + n, alignment)
    return offsets
