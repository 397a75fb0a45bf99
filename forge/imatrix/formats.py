"""llama.cpp's two imatrix file formats, read and written exactly as llama-imatrix does.

GGUF (default): KVs ``general.type = imatrix``, ``imatrix.datasets``, ``imatrix.chunk_count``,
``imatrix.chunk_size``; per weight tensor ``<name>.in_sum2`` F32 ne {n_per_row, n_mat} (raw sums of x²)
and ``<name>.counts`` F32 ne {1, n_mat} (rows per expert), names byte-sorted.

Legacy ``.dat`` (little endian): int32 entry count; per entry int32 name length, name bytes, int32
ncall, int32 nval, float32 values[nval]; then int32 chunk count, int32 dataset-name length, bytes.
A value is ``sum / count * ncall`` with ``ncall = ceil(max(counts) / chunk_size)``, so
``value / ncall`` is the weight the quantizer uses. One ncall per entry: per-expert counts are lost.

Round trips. The quantizer's weight (``importance.importance_for``) survives every conversion bit
for bit:

- GGUF -> ``.dat``: llama-imatrix's rounding (``rounding="llamacpp"``) loses it for ~10% of values
  (``(v * 11) / 11 != v`` in float32). Our default ``rounding="exact"`` rounds ncall down to a power of
  two, where ``(v * ncall) / ncall == v`` exactly (checked; ncall 1 if even that fails).
- ``.dat`` -> GGUF: ``in_sum2`` = the stored values, ``counts`` = ncall, ``imatrix.chunk_size = 0``
  (unknown, as llama.cpp's legacy loader records it); llama-quantize then computes the same
  ``stored / ncall``, and writing ``.dat`` again stores the values verbatim.

What ``.dat`` cannot hold: per-expert counts (so which experts went unseen; they carry weight 1),
the raw sums, ``.in_sum``, and all dataset names but the last.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from forge.atomic import atomic_output
from forge.errors import ForgeError
from forge.gguf_file import KV, TensorSpec, check_input_file, open_gguf, write_gguf
from forge.imatrix.model import Imatrix

Format = Literal["gguf", "dat"]
Rounding = Literal["exact", "llamacpp"]

KV_DATASETS = "imatrix.datasets"
KV_CHUNK_COUNT = "imatrix.chunk_count"
KV_CHUNK_SIZE = "imatrix.chunk_size"
# ours, written only into the snapshots of an unfinished collection (llama.cpp ignores unknown keys)
KV_CHUNKS_PLANNED = "forge.imatrix.chunks_planned"
_SUFFIXES = (".in_sum2", ".counts", ".in_sum")
_MAX_NAME = 4096
_F32 = GGMLQuantizationType.F32


def detect_format(path: str | os.PathLike[str]) -> Format:
    """``gguf`` when the file starts with the GGUF magic, else ``dat`` (llama.cpp tries GGUF first too)."""
    path = Path(path)
    check_input_file(path, "an imatrix file")
    with open(path, "rb") as f:
        return "gguf" if f.read(4) == b"GGUF" else "dat"


def format_for_path(path: str | os.PathLike[str]) -> Format:
    """Output format from a file name: ``.dat`` -> dat, anything else -> gguf (llama-imatrix's default)."""
    return "dat" if str(path).lower().endswith(".dat") else "gguf"


def read_imatrix(path: str | os.PathLike[str]) -> Imatrix:
    """Read either format, detected from the content."""
    return read_gguf_imatrix(path) if detect_format(path) == "gguf" else read_dat_imatrix(path)


def write_imatrix(
    im: Imatrix, path: str | os.PathLike[str], fmt: Format | None = None, rounding: Rounding = "exact"
) -> None:
    """Write atomically; ``fmt`` defaults to the one the file name suggests."""
    if (fmt or format_for_path(path)) == "dat":
        write_dat_imatrix(im, path, rounding)
    else:
        write_gguf_imatrix(im, path)


# ------------------------------------------------------------------------------------------- GGUF


def read_gguf_imatrix(path: str | os.PathLike[str]) -> Imatrix:
    g = open_gguf(path)
    gtype = g.kv("general.type")
    if gtype is not None and gtype != "imatrix":
        raise ForgeError(f"{path}: general.type is {gtype!r}, not an imatrix")
    missing = [k for k in (KV_DATASETS, KV_CHUNK_COUNT, KV_CHUNK_SIZE) if k not in g.kvs]
    if missing:
        raise ForgeError(
            f"{path}: missing imatrix metadata {', '.join(missing)} (llama-quantize refuses it too)"
        )
    datasets = g.kv(KV_DATASETS)
    if not isinstance(datasets, list) or not all(isinstance(d, str) for d in datasets):
        raise ForgeError(f"{path}: {KV_DATASETS} must be an array of strings")
    parts: dict[str, dict[str, np.ndarray]] = {}
    for t in g.tensors.values():
        suffix = next((s for s in _SUFFIXES if t.name.endswith(s)), None)
        if suffix is None:
            raise ForgeError(f"{path}: unexpected tensor {t.name} in an imatrix")
        if t.ggml_type != _F32:
            raise ForgeError(f"{path}: tensor {t.name} is {t.ggml_type.name}, must be F32")
        parts.setdefault(t.name.removesuffix(suffix), {})[suffix] = (
            g.array(t.name).astype(np.float32).reshape(-1)
        )
    if not parts:
        raise ForgeError(f"{path}: no imatrix entries")
    im = Imatrix(
        datasets=list(datasets), chunk_count=int(g.kv(KV_CHUNK_COUNT)), chunk_size=int(g.kv(KV_CHUNK_SIZE)),
        chunks_planned=int(g.kv(KV_CHUNKS_PLANNED, 0)),
    )  # fmt: skip
    for name, p in parts.items():
        if ".in_sum2" not in p or ".counts" not in p:
            raise ForgeError(f"{path}: entry {name} lacks its .in_sum2 or .counts tensor")
        raw_counts, sums = p[".counts"], p[".in_sum2"]
        n_mat = raw_counts.size
        if n_mat == 0 or sums.size == 0 or sums.size % n_mat:
            raise ForgeError(f"{path}: entry {name}: {sums.size} sums do not split into {n_mat} counts")
        if not np.isfinite(raw_counts).all() or (raw_counts < 0).any():
            raise ForgeError(f"{path}: entry {name}: counts must be finite and non-negative")
        if not np.isfinite(sums).all():
            raise ForgeError(f"{path}: entry {name}: non-finite sums")
        # llama.cpp rounds the float counts with lround (half away from zero)
        im.sums[name] = sums.reshape(n_mat, -1)
        im.counts[name] = np.floor(raw_counts.astype(np.float64) + 0.5).astype(np.int64)
        if ".in_sum" in p:
            if p[".in_sum"].size != sums.size:
                raise ForgeError(f"{path}: entry {name}: .in_sum and .in_sum2 sizes differ")
            im.in_sum[name] = p[".in_sum"].reshape(n_mat, -1)
    im.check()
    return im


def _ggml_dims(n_mat: int, n_cols: int) -> tuple[int, ...]:
    """numpy shape of a 2-D ggml tensor ne {n_cols, n_mat}: GGUF drops trailing ne of 1."""
    return (n_mat, n_cols) if n_mat > 1 else (n_cols,)


def gguf_kvs(im: Imatrix) -> list[KV]:
    kvs = [
        KV("general.type", "imatrix", GGUFValueType.STRING),
        KV(KV_DATASETS, list(im.datasets), GGUFValueType.ARRAY, GGUFValueType.STRING),
        KV(KV_CHUNK_COUNT, int(im.chunk_count), GGUFValueType.UINT32),
        KV(KV_CHUNK_SIZE, int(im.chunk_size), GGUFValueType.UINT32),
    ]
    if im.partial:
        kvs.append(KV(KV_CHUNKS_PLANNED, int(im.chunks_planned), GGUFValueType.UINT32))
    return kvs


def _gguf_tensors(im: Imatrix) -> list[tuple[TensorSpec, np.ndarray]]:
    out = []
    for name in im.names():
        n_mat, n_per_row = im.shape(name)
        out.append((TensorSpec(f"{name}.in_sum2", _ggml_dims(n_mat, n_per_row), _F32), im.sums[name]))
        counts = im.counts[name].astype(np.float32)  # the (float) cast llama-imatrix applies
        out.append((TensorSpec(f"{name}.counts", _ggml_dims(n_mat, 1), _F32), counts))
        if name in im.in_sum:
            out.append((TensorSpec(f"{name}.in_sum", _ggml_dims(n_mat, n_per_row), _F32), im.in_sum[name]))
    return out


def _tensor_data(tensors: list[tuple[TensorSpec, np.ndarray]]) -> Iterator[np.ndarray]:
    for _, data in tensors:
        yield np.ascontiguousarray(data, dtype="<f4")


def write_gguf_imatrix(im: Imatrix, path: str | os.PathLike[str]) -> None:
    im.check()
    if not im.sums:
        raise ForgeError(f"{path}: refusing to write an empty imatrix")
    tensors = _gguf_tensors(im)
    write_gguf(path, gguf_kvs(im), [spec for spec, _ in tensors], _tensor_data(tensors))


# -------------------------------------------------------------------------------------------- .dat


class _Cursor:
    """Bounds-checked little-endian reads; running out of bytes is a truncated file."""

    def __init__(self, buf: memoryview, path: str | os.PathLike[str]) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise ForgeError(f"{self.path}: truncated .dat imatrix (while reading {what})")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def i32(self, what: str) -> int:
        return struct.unpack("<i", self.take(4, what))[0]

    @property
    def left(self) -> int:
        return len(self.buf) - self.pos


def _check_dat_start(cur: _Cursor, path: Path) -> None:
    """A file that does not start like a ``.dat`` (entry count, first name) is neither format.

    A plausible start cut short (count and name length fine, name incomplete) stays a truncated ``.dat``.
    """
    try:
        n_entries = cur.i32("the entry count")
        if n_entries < 1:
            raise ForgeError(f"entry count {n_entries}")
        n = cur.i32("entry 1's name length")
        if not 1 <= n <= _MAX_NAME:
            raise ForgeError(f"entry 1's name length {n}")
        name = cur.take(n, "entry 1's name") if cur.left >= n else None
        if name is not None:
            bytes(name).decode("utf-8")
    except (ForgeError, UnicodeDecodeError) as e:
        why = str(e).removeprefix(f"{path}: ") if isinstance(e, ForgeError) else "entry 1's name is not UTF-8"
        raise ForgeError(f"{path}: neither a GGUF nor a .dat imatrix ({why})") from None
    cur.pos = 0


def read_dat_imatrix(path: str | os.PathLike[str]) -> Imatrix:
    """Entries come back flat, (1, nval) with counts [ncall]: ``.dat`` does not record n_mat."""
    path = Path(path)
    check_input_file(path, "an imatrix file")
    data = path.read_bytes()
    cur = _Cursor(memoryview(data), path)
    _check_dat_start(cur, path)
    n_entries = cur.i32("the entry count")
    im = Imatrix(chunk_size=0)
    for i in range(n_entries):
        n = cur.i32(f"entry {i + 1}'s name length")
        if not 1 <= n <= _MAX_NAME:
            raise ForgeError(f"{path}: entry {i + 1}: bad name length {n} (not an imatrix, or corrupt)")
        try:
            name = bytes(cur.take(n, f"entry {i + 1}'s name")).decode("utf-8")
        except UnicodeDecodeError:
            raise ForgeError(
                f"{path}: entry {i + 1}: name is not UTF-8 (not an imatrix, or corrupt)"
            ) from None
        ncall, nval = cur.i32(f"{name}'s ncall"), cur.i32(f"{name}'s value count")
        if ncall < 1 or nval < 1:
            raise ForgeError(f"{path}: entry {name}: ncall {ncall}, nval {nval} (both must be positive)")
        values = np.frombuffer(cur.take(4 * nval, f"{name}'s values"), dtype="<f4").astype(np.float32)
        if not np.isfinite(values).all():
            raise ForgeError(f"{path}: entry {name}: non-finite values")
        if name in im.sums:
            raise ForgeError(f"{path}: entry {name} appears twice")
        im.sums[name] = values.reshape(1, nval)
        im.counts[name] = np.array([ncall], dtype=np.int64)
    if cur.left:  # optional trailer: chunk count, dataset name
        im.chunk_count = cur.i32("the chunk count")
        n = cur.i32("the dataset name length")
        if n < 0:
            raise ForgeError(f"{path}: bad dataset name length {n}")
        dataset = bytes(cur.take(n, "the dataset name")).decode("utf-8", errors="replace")
        if dataset:
            im.datasets.append(dataset)
        if cur.left:
            raise ForgeError(f"{path}: {cur.left} unexpected bytes after the end of the imatrix")
    im.check()
    return im


def dat_entry(im: Imatrix, name: str, rounding: Rounding = "exact") -> tuple[int, np.ndarray]:
    """(ncall, float32 values) of one ``.dat`` entry."""
    sums, counts = im.sums[name], im.counts[name]
    if im.counts_are_ncall and (counts == counts[0]).all() and counts[0] > 0:
        return int(counts[0]), sums.reshape(-1)  # already in .dat units: verbatim
    chunk = max(im.chunk_size, 1)
    ncall = int(-(-int(counts.max()) // chunk))
    seen = (counts > 0)[:, None]
    # llama-imatrix: an expert with no rows is stored as value 1, count 1
    c = np.where(seen, counts[:, None].astype(np.float32), np.float32(1))
    mean_sq = np.where(seen, sums, np.float32(1)) / c
    if rounding == "llamacpp":
        return ncall, (mean_sq * np.float32(ncall)).reshape(-1)
    for n in (1 << (ncall.bit_length() - 1), 1):
        stored = mean_sq * np.float32(n)
        if np.array_equal((stored / np.float32(n)).view(np.uint32), mean_sq.view(np.uint32)):
            return n, stored.reshape(-1)
    raise AssertionError("dividing by 1 is exact")


def _dat_chunks(im: Imatrix, rounding: Rounding) -> Iterator[bytes]:
    names = [n for n in im.names() if im.counts[n].any()]  # llama-imatrix skips entries with no data
    yield struct.pack("<i", len(names))
    for name in names:
        raw = name.encode("utf-8")
        ncall, values = dat_entry(im, name, rounding)
        yield struct.pack("<i", len(raw)) + raw + struct.pack("<ii", ncall, values.size)
        yield np.ascontiguousarray(values, dtype="<f4").tobytes()
    dataset = (im.datasets[-1] if im.datasets else "").encode("utf-8")
    yield struct.pack("<ii", int(im.chunk_count), len(dataset)) + dataset


def write_dat_imatrix(im: Imatrix, path: str | os.PathLike[str], rounding: Rounding = "exact") -> None:
    """``rounding="llamacpp"`` reproduces llama-imatrix's bytes; ``"exact"`` keeps weights bit for bit."""
    im.check()
    if not any(c.any() for c in im.counts.values()):
        raise ForgeError(f"{path}: refusing to write an imatrix with no data")
    with atomic_output(path) as f:
        for chunk in _dat_chunks(im, rounding):
            f.write(chunk)
