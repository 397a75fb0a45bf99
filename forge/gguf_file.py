"""GGUF files: read through the ``gguf`` package's mmap reader, write transactionally.

The writer knows every tensor's name, shape, type and byte size before the first byte is written
(the *plan*), so it lays out the header and offsets up front and then streams tensor data one
tensor at a time: memory stays bounded by the largest tensor, and a dry run knows the exact size.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_MAGIC, GGUF_VERSION, GGMLQuantizationType, GGUFValueType

from forge.atomic import atomic_output
from forge.errors import ForgeError

DEFAULT_ALIGNMENT = 32
T = GGUFValueType


@dataclass(frozen=True)
class KV:
    """One metadata entry. ``vtype`` is the GGUF value type; arrays also name their item type."""

    key: str
    value: Any
    vtype: GGUFValueType
    item_type: GGUFValueType | None = None


@dataclass(frozen=True)
class TensorSpec:
    """A tensor as it will sit in the file. ``shape`` is numpy order (the reverse of ggml ne)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.shape, self.ggml_type)


def tensor_nbytes(shape: Sequence[int], ggml_type: int, what: str = "") -> int:
    """Bytes of a tensor of ``shape`` (numpy order) in ``ggml_type``; ``what`` prefixes the error."""
    try:
        qtype = GGMLQuantizationType(ggml_type)
        block, size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise ForgeError(f"{what + ': ' if what else ''}unknown GGML tensor type id {ggml_type}") from None
    n_per_row = shape[-1] if shape else 1
    if n_per_row % block:
        raise ForgeError(
            f"{what + ': ' if what else ''}row length {n_per_row} is not a multiple of {qtype.name}'s block "
            f"size {block}"
        )
    return int(np.prod(shape, dtype=np.int64)) // block * size


def align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


# ---------------------------------------------------------------------------------------- reading


_SCALAR_FMT = {
    T.UINT8: "<B", T.INT8: "<b", T.UINT16: "<H", T.INT16: "<h", T.UINT32: "<I", T.INT32: "<i",
    T.FLOAT32: "<f", T.UINT64: "<Q", T.INT64: "<q", T.FLOAT64: "<d", T.BOOL: "<?",
}  # fmt: skip

GGUF_MAGIC_BYTES = b"GGUF"
HEADER_BYTES = 24  # magic, version, tensor count, KV count
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
_MIN_KV_BYTES = 8 + 4 + 1  # empty key, value type, one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # empty name, n_dims, one dim, type, offset
_INT64_MAX = (1 << 63) - 1


def check_input_file(path: Path, what: str = "a GGUF file") -> int:
    """The size of the regular file ``path``; ForgeError for a missing path, a folder or an empty file."""
    try:
        st = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        raise ForgeError(f"{path}: no such file") from None
    except OSError as e:
        raise ForgeError(f"{path}: cannot read ({e.strerror or e})") from None
    if stat.S_ISDIR(st.st_mode):
        raise ForgeError(f"{path}: is a folder, not {what}")
    if not stat.S_ISREG(st.st_mode):
        raise ForgeError(f"{path}: not a regular file, not {what}")
    if st.st_size == 0:
        raise ForgeError(f"{path}: empty file")
    return st.st_size


def read_header(path: Path, buf: Any, size: int) -> tuple[int, int, int]:
    """(version, tensor count, KV count) from a GGUF's first 24 bytes.

    ForgeError for a bad magic, a file shorter than the header, or counts that the file could not hold
    (so that no parser loops over billions of entries of a damaged header).
    """
    if size < 4 or bytes(buf[:4]) != GGUF_MAGIC_BYTES:
        raise ForgeError(f"{path}: not a GGUF file (bad magic)")
    if size < HEADER_BYTES:
        raise ForgeError(f"{path}: truncated GGUF ({size} bytes)")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    least = HEADER_BYTES + n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES
    if least > size:
        raise ForgeError(
            f"{path}: truncated or damaged GGUF (the header announces {n_tensors:,} tensors and {n_kv:,} "
            f"metadata keys, more than a file of {size:,} bytes can hold)"
        )
    return version, n_tensors, n_kv


@dataclass(frozen=True)
class DirectoryEntry:
    """One validated tensor directory entry, as stored (GGUF order, offset relative to the data section)."""

    name: str
    ne: tuple[int, ...]  # fastest dimension first
    ggml_type: int
    offset: int
    nbytes: int


def read_tensor_directory(
    path: Path, buf: Any, pos: int, n_tensors: int, alignment: object, size: int
) -> tuple[list[DirectoryEntry], int, int]:
    """Parse the tensor directory at ``pos`` and check it against the file (both GGUF readers use this).

    Returns (entries, directory end, data section start). Every tensor must have 1..4 dimensions of at
    least 1 element, a known GGML type, rows that are whole blocks, an element count that fits int64,
    an offset aligned to ``general.alignment`` (a power of two), and bytes inside the file that no
    other tensor's bytes overlap (offsets are unsigned and relative to the data section, so none starts
    before it). Any failure is one ForgeError naming the file and the tensor.
    """
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0:
        raise ForgeError(f"{path}: general.alignment {alignment!r} is not a power of two")
    if alignment & (alignment - 1):
        raise ForgeError(f"{path}: general.alignment {alignment} is not a power of two")
    raw = []
    for i in range(n_tensors):
        if pos + 12 > size:
            raise ForgeError(f"{path}: truncated GGUF (tensor directory entry {i + 1} of {n_tensors})")
        (n,) = struct.unpack_from("<Q", buf, pos)
        if pos + 8 + n + 4 > size:
            raise ForgeError(f"{path}: truncated GGUF (tensor directory entry {i + 1} of {n_tensors})")
        try:
            name = bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise ForgeError(f"{path}: tensor name at byte {pos:,} is not UTF-8 (damaged GGUF)") from None
        pos += 8 + n
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        if not 1 <= n_dims <= MAX_DIMS:
            raise ForgeError(f"{path}: tensor {name} has {n_dims} dimensions (1..{MAX_DIMS} allowed)")
        if pos + 4 + 8 * n_dims + 12 > size:
            raise ForgeError(f"{path}: truncated GGUF (in the directory entry of tensor {name})")
        ne = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        raw.append((name, ne, ggml_type, offset))
    dir_end = pos
    data_start = align_up(dir_end, alignment)
    return _check_tensors(path, raw, alignment, data_start, size), dir_end, data_start


def _check_tensors(
    path: Path, raw: list[tuple[str, tuple[int, ...], int, int]], alignment: int, data_start: int, size: int
) -> list[DirectoryEntry]:
    entries, seen = [], set()
    for name, ne, ggml_type, offset in raw:
        if name in seen:
            raise ForgeError(f"{path}: tensor {name} appears twice in the tensor directory")
        seen.add(name)
        shape = "x".join(str(d) for d in ne)
        if min(ne) < 1:
            raise ForgeError(f"{path}: tensor {name} has an empty dimension (ne {shape})")
        try:
            qtype = GGMLQuantizationType(ggml_type)
        except ValueError:
            raise ForgeError(f"{path}: tensor {name} has unknown GGML type id {ggml_type}") from None
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        if ne[0] % block:
            raise ForgeError(
                f"{path}: tensor {name}: row length {ne[0]} is not a multiple of {qtype.name}'s block size {block}"
            )
        count = 1
        for d in ne:
            count *= d
        if count > _INT64_MAX:
            raise ForgeError(f"{path}: tensor {name}: element count (ne {shape}) overflows int64")
        start = data_start + offset
        if offset % alignment:
            raise ForgeError(
                f"{path}: tensor {name} at offset {start:,} is not aligned to {alignment} bytes "
                "(damaged or not a GGUF)"
            )
        nbytes = count // block * block_bytes
        if start + nbytes > size:
            raise ForgeError(
                f"{path}: truncated or damaged GGUF: tensor {name} (bytes {start:,}..{start + nbytes:,}) "
                f"ends past the end of the file ({size:,} bytes)"
            )
        entries.append(DirectoryEntry(name, tuple(ne), ggml_type, offset, nbytes))
    ordered = sorted(entries, key=lambda e: e.offset)
    for a, b in zip(ordered, ordered[1:], strict=False):
        if a.offset + a.nbytes > b.offset:
            raise ForgeError(
                f"{path}: tensors {a.name} and {b.name} overlap (bytes {data_start + b.offset:,}.."
                f"{data_start + min(a.offset + a.nbytes, b.offset + b.nbytes):,}; damaged GGUF)"
            )
    return entries


@dataclass(frozen=True)
class TensorInfo:
    """A tensor's directory entry; ``offset`` is absolute in the file."""

    name: str
    shape: tuple[int, ...]  # numpy order
    ggml_type: GGMLQuantizationType
    offset: int
    nbytes: int


class GGUFFile:
    """A fast read-only GGUF parser (header in one pass, tensor data as mmap views).

    The ``gguf`` package's reader builds a numpy view per array element, which takes seconds per
    hundred thousand vocabulary entries; this one decodes arrays in bulk. Opening validates the
    header and every tensor's directory entry (``read_tensor_directory``).
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.size = check_input_file(self.path)
        try:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
            with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as self._buf:
                self._parse()
        except ForgeError:
            raise
        except OSError as e:
            raise ForgeError(f"{self.path}: cannot read ({e.strerror or e})") from None
        except Exception as e:
            raise ForgeError(f"{self.path}: malformed or truncated GGUF ({type(e).__name__}: {e})") from None

    def _parse(self) -> None:
        buf = self._buf
        self.version, n_tensors, n_kv = read_header(self.path, buf, self.size)
        if self.version not in (2, 3):
            raise ForgeError(f"{self.path}: unsupported GGUF version {self.version}")
        pos = HEADER_BYTES
        self.kvs: dict[str, KV] = {}
        for _ in range(n_kv):
            key, pos = self._string(pos)
            (vtype,) = struct.unpack_from("<I", buf, pos)
            value, item, pos = self._value(self._vtype(vtype, key), pos + 4)
            self.kvs[key] = KV(key, value, T(vtype), item)
        self.kv_end = pos
        self.alignment = self.kv("general.alignment", DEFAULT_ALIGNMENT)
        entries, self.header_end, self.data_offset = read_tensor_directory(
            self.path, buf, pos, n_tensors, self.alignment, self.size
        )
        self.tensors: dict[str, TensorInfo] = {
            e.name: TensorInfo(
                e.name,
                tuple(reversed(e.ne)),
                GGMLQuantizationType(e.ggml_type),
                self.data_offset + e.offset,
                e.nbytes,
            )
            for e in entries
        }

    def _vtype(self, vtype: int, key: str) -> GGUFValueType:
        try:
            return T(vtype)
        except ValueError:
            raise ForgeError(f"{self.path}: unknown GGUF value type {vtype} for key {key!r}") from None

    def _string(self, pos: int) -> tuple[str, int]:
        if pos + 8 > self.size:
            raise ForgeError(f"{self.path}: truncated GGUF (in the metadata)")
        (n,) = struct.unpack_from("<Q", self._buf, pos)
        if pos + 8 + n > self.size:
            raise ForgeError(f"{self.path}: truncated GGUF (in the metadata)")
        return self._buf[pos + 8 : pos + 8 + n].decode("utf-8", "replace"), pos + 8 + n

    def _value(self, vtype: GGUFValueType, pos: int) -> tuple[Any, GGUFValueType | None, int]:
        if vtype == T.STRING:
            s, pos = self._string(pos)
            return s, None, pos
        if vtype != T.ARRAY:
            fmt = _SCALAR_FMT[vtype]
            return struct.unpack_from(fmt, self._buf, pos)[0], None, pos + struct.calcsize(fmt)
        item, count = struct.unpack_from("<IQ", self._buf, pos)
        item, pos = self._vtype(item, "(array item)"), pos + 12
        least = 8 if item == T.STRING else np.dtype(_NUMPY_ITEM.get(item, "u1")).itemsize
        if pos + least * count > self.size:
            raise ForgeError(f"{self.path}: truncated GGUF (an array of {count:,} items)")
        if item == T.STRING:
            out = []
            for _ in range(count):
                s, pos = self._string(pos)
                out.append(s)
            return out, item, pos
        if item == T.ARRAY:
            raise ForgeError(f"{self.path}: nested arrays are not supported")
        dt = np.dtype(_NUMPY_ITEM[item])
        arr = np.frombuffer(self._buf, dtype=dt, count=count, offset=pos)
        return arr.tolist(), item, pos + dt.itemsize * count

    def kv(self, key: str, default: Any = None) -> Any:
        entry = self.kvs.get(key)
        return default if entry is None else entry.value

    @property
    def architecture(self) -> str:
        return str(self.kv("general.architecture", "unknown"))

    def mapped(self) -> np.ndarray:
        """The whole file as a read-only uint8 memmap."""
        return self._mm

    def raw(self, name: str) -> np.ndarray:
        """A tensor's bytes as a uint8 memmap view (zero copy)."""
        t = self.tensors[name]
        return self._mm[t.offset : t.offset + t.nbytes]

    def array(self, name: str) -> np.ndarray:
        """A tensor as numpy: float types typed (BF16 as uint16 bits), quantized as uint8 rows."""
        t = self.tensors[name]
        data = self.raw(name)
        typed = {GGMLQuantizationType.F32: "<f4", GGMLQuantizationType.F16: "<f2",
                 GGMLQuantizationType.BF16: "<u2", GGMLQuantizationType.I8: "i1",
                 GGMLQuantizationType.I32: "<i4"}  # fmt: skip
        if t.ggml_type in typed:
            return data.view(typed[t.ggml_type]).reshape(t.shape)
        block, size = GGML_QUANT_SIZES[t.ggml_type]
        return data.reshape(*t.shape[:-1], t.shape[-1] // block * size)


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Open a GGUF file read-only. Any malformed file becomes one clear ForgeError."""
    return GGUFFile(path)


# ---------------------------------------------------------------------------------------- writing


def _pack_scalar(value: Any, vtype: GGUFValueType) -> bytes:
    if vtype == T.STRING:
        raw = value.encode("utf-8") if isinstance(value, str) else bytes(value)
        return struct.pack("<Q", len(raw)) + raw
    if vtype == T.BOOL:
        return struct.pack("<?", bool(value))
    fmt = {
        T.UINT8: "<B", T.INT8: "<b", T.UINT16: "<H", T.INT16: "<h", T.UINT32: "<I", T.INT32: "<i",
        T.FLOAT32: "<f", T.UINT64: "<Q", T.INT64: "<q", T.FLOAT64: "<d",
    }[vtype]  # fmt: skip
    return struct.pack(fmt, value)


_NUMPY_ITEM = {
    T.UINT8: "<u1", T.INT8: "<i1", T.UINT16: "<u2", T.INT16: "<i2", T.UINT32: "<u4", T.INT32: "<i4",
    T.FLOAT32: "<f4", T.UINT64: "<u8", T.INT64: "<i8", T.FLOAT64: "<f8", T.BOOL: "?",
}  # fmt: skip


def pack_kv(kv: KV) -> bytes:
    head = _pack_scalar(kv.key, T.STRING) + struct.pack("<I", int(kv.vtype))
    if kv.vtype != T.ARRAY:
        return head + _pack_scalar(kv.value, kv.vtype)
    assert kv.item_type is not None
    items = kv.value
    head += struct.pack("<IQ", int(kv.item_type), len(items))
    if kv.item_type == T.STRING:
        return head + b"".join(_pack_scalar(v, T.STRING) for v in items)
    return head + np.asarray(items, dtype=_NUMPY_ITEM[kv.item_type]).tobytes()


def pack_tensor_info(name: str, ne: Sequence[int], ggml_type: int, offset: int) -> bytes:
    """One tensor directory entry; ``ne`` in GGUF order (fastest dimension first)."""
    ne = tuple(ne) or (1,)
    return (
        _pack_scalar(name, T.STRING)
        + struct.pack(f"<I{len(ne)}Q", len(ne), *ne)
        + struct.pack("<IQ", int(ggml_type), offset)
    )


@dataclass
class GGUFLayout:
    """Byte layout of one GGUF file: header bytes, and each tensor's offset in the data section."""

    kvs: list[KV]
    tensors: list[TensorSpec]
    alignment: int = DEFAULT_ALIGNMENT
    header: bytes = field(init=False)
    offsets: list[int] = field(init=False)
    data_start: int = field(init=False)

    def __post_init__(self) -> None:
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ForgeError(f"duplicate tensor name {dup!r}")
        self.offsets, pos = [], 0
        for t in self.tensors:
            self.offsets.append(pos)
            pos = align_up(pos + t.nbytes, self.alignment)
        self._packed_kvs = [pack_kv(kv) for kv in self.kvs]
        parts = [struct.pack("<IIQQ", GGUF_MAGIC, GGUF_VERSION, len(self.tensors), len(self.kvs))]
        parts += self._packed_kvs
        parts += [
            pack_tensor_info(t.name, reversed(t.shape), t.ggml_type, o)
            for t, o in zip(self.tensors, self.offsets, strict=True)
        ]
        self.header = b"".join(parts)
        self.data_start = align_up(len(self.header), self.alignment)

    def kv_offset(self, key: str) -> int:
        """Byte offset (in the file) where ``key``'s entry starts."""
        pos = struct.calcsize("<IIQQ")
        for kv, packed in zip(self.kvs, self._packed_kvs, strict=True):
            if kv.key == key:
                return pos
            pos += len(packed)
        raise KeyError(key)

    @property
    def total_size(self) -> int:
        """The file's size: like llama.cpp's and gguf-py's writers, the last tensor is padded to the
        alignment too (llama.cpp's loaders expect the data section to be a whole number of aligned blocks)."""
        if not self.tensors:
            return self.data_start
        return self.data_start + align_up(self.offsets[-1] + self.tensors[-1].nbytes, self.alignment)


TensorData = np.ndarray | bytes | memoryview
#: Writes one tensor's bytes to the open file (for copies that bypass Python buffers).
TensorWriter = Callable[[Any], None]


def _write_tensor_bytes(f: Any, spec: TensorSpec, data: TensorData | TensorWriter) -> None:
    start = f.tell()
    if callable(data):
        data(f)
    else:
        buf = memoryview(np.ascontiguousarray(data) if isinstance(data, np.ndarray) else data).cast("B")
        f.write(buf)
    written = f.tell() - start
    if written != spec.nbytes:
        raise ForgeError(f"tensor {spec.name}: produced {written} bytes, planned {spec.nbytes}")


def write_gguf(
    dest: str | os.PathLike[str],
    kvs: list[KV],
    tensors: list[TensorSpec],
    data: Iterable[TensorData | TensorWriter],
    alignment: int = DEFAULT_ALIGNMENT,
    on_tensor: Callable[[TensorSpec], None] | None = None,
    finalize: Callable[[Any, GGUFLayout], None] | None = None,
) -> int:
    """Write one GGUF file transactionally; ``data`` yields each tensor's bytes in ``tensors`` order.

    ``finalize(file, layout)`` may patch fixed-size header fields (e.g. digests) before the file is
    committed. Returns the file size. On any error the destination is untouched, nothing left behind.
    """
    layout = GGUFLayout(kvs, tensors, alignment)
    with atomic_output(dest, need_bytes=layout.total_size) as f:
        _write_layout(f, layout, iter(data), on_tensor)
        if finalize:
            finalize(f, layout)
    return layout.total_size


def _write_layout(
    f: Any,
    layout: GGUFLayout,
    data: Iterator[TensorData | TensorWriter],
    on_tensor: Callable[[TensorSpec], None] | None,
) -> None:
    f.write(layout.header)
    f.write(b"\0" * (layout.data_start - len(layout.header)))
    for spec, offset in zip(layout.tensors, layout.offsets, strict=True):
        pad = layout.data_start + offset - f.tell()
        if pad:
            f.write(b"\0" * pad)
        try:
            item = next(data)
        except StopIteration:
            raise ForgeError(f"no data for tensor {spec.name}") from None
        _write_tensor_bytes(f, spec, item)
        if on_tensor:
            on_tensor(spec)
    f.write(b"\0" * (layout.total_size - f.tell()))


# ------------------------------------------------------------------------------------------ splits

SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"


def split_path(dest: Path, index: int, count: int) -> Path:
    """llama.cpp's gguf-split naming: ``model-00001-of-00003.gguf``."""
    stem = dest.name.removesuffix(".gguf")
    return dest.with_name(f"{stem}-{index + 1:05d}-of-{count:05d}.gguf")


def plan_splits(tensors: list[TensorSpec], max_bytes: int) -> list[list[TensorSpec]]:
    """Greedy split by tensor bytes: a shard closes before it would exceed ``max_bytes``."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def split_layouts(
    kvs: list[KV], tensors: list[TensorSpec], max_bytes: int, alignment: int = DEFAULT_ALIGNMENT
) -> list[GGUFLayout]:
    """Layouts of the shards: the first carries every KV, all carry the split.* keys."""
    shards = plan_splits(tensors, max_bytes)
    out = []
    for i, shard in enumerate(shards):
        split_kvs = [
            KV(SPLIT_NO, i, T.UINT16),
            KV(SPLIT_COUNT, len(shards), T.UINT16),
            KV(SPLIT_TENSORS, len(tensors), T.INT32),
        ]
        base = kvs if i == 0 else [kv for kv in kvs if kv.key == "general.architecture"]
        out.append(GGUFLayout(base + split_kvs, shard, alignment))
    return out


def write_gguf_split(
    dest: str | os.PathLike[str],
    kvs: list[KV],
    tensors: list[TensorSpec],
    data: Iterable[TensorData | TensorWriter],
    max_bytes: int,
    alignment: int = DEFAULT_ALIGNMENT,
    on_tensor: Callable[[TensorSpec], None] | None = None,
) -> list[Path]:
    """Write ``dest`` as ``-0000i-of-0000N`` shards; all appear together or none does."""
    dest = Path(dest)
    layouts = split_layouts(kvs, tensors, max_bytes, alignment)
    paths = [split_path(dest, i, len(layouts)) for i in range(len(layouts))]
    it = iter(data)
    with contextlib.ExitStack() as stack:
        for layout, path in zip(layouts, paths, strict=True):
            f = stack.enter_context(atomic_output(path, need_bytes=layout.total_size))
            _write_layout(f, layout, it, on_tensor)
    return paths


def parse_size(text: str) -> int:
    """'2G', '500M', '4096', '1.5GiB' -> bytes (powers of 1024 like gguf-split's M/G)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    num = t[:-1] if t[-1:] in "KMGT" else t
    try:
        value = int(float(num) * mult)
    except ValueError:
        raise ForgeError(f"cannot parse size {text!r} (examples: 4096, 500M, 2G)") from None
    if value <= 0:
        raise ForgeError(f"size must be positive: {text!r}")
    return value
