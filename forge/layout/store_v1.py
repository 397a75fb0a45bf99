"""The ``ds4.expert_major.v1`` pack: magic ``DS4QXPK1``, a 256-byte header, a checksummed index of
40-byte entries (one per layer and expert), a layer table (our definition: types and dims, which
ds4's fixed-geometry v1 never stored), then 4,096-aligned records ``gate | up | down``.

Field by field description: docs/expert-major.md. All integers little-endian.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, replace

import numpy as np

from forge.errors import ForgeError
from forge.gguf_file import align_up, tensor_nbytes
from forge.layout.records import PAGE, Component, LayerRecords, check_component, check_ffn_shape
from forge.layout.source import FAMILY_NAMES, FAMILY_QWEN3MOE, FAMILY_QWEN35MOE

TENSOR_NAME = "ds4.expert_major.v1"
MAGIC = b"DS4QXPK1"
VERSION = 1
HEADER_BYTES = 256
ENTRY_BYTES = 40
TABLE_ENTRY_BYTES = 80
V1_FAMILIES = (FAMILY_QWEN35MOE, FAMILY_QWEN3MOE)
INDEX_DIGEST_FIELD = slice(192, 224)
TABLE_DIGEST_FIELD = slice(224, 256)

_HEADER = struct.Struct("<8sIIIIII10Q32s32sII8s32s32s")
_TABLE = struct.Struct(
    "<II" + "IIQQ" * 3
)  # layer, reserved, then per component: type, source index, ne0, ne1
assert _HEADER.size == HEADER_BYTES and _TABLE.size == TABLE_ENTRY_BYTES


@dataclass(frozen=True)
class HeaderV1:
    family: int
    experts_used: int
    layer_count: int
    experts: int
    payload_offset: int
    payload_size: int
    pack_size: int
    source_size: int
    source_tensor_count: int
    source_sha256: bytes
    payload_sha256: bytes
    index_sha256: bytes = bytes(32)
    table_sha256: bytes = bytes(32)
    index_offset: int = HEADER_BYTES
    entry_bytes: int = ENTRY_BYTES
    entry_count: int | None = None
    table_offset: int | None = None
    table_entry_bytes: int = TABLE_ENTRY_BYTES
    record_alignment: int = PAGE
    storage: int = 0
    reserved: bytes = bytes(8)
    magic: bytes = MAGIC
    version: int = VERSION
    header_bytes: int = HEADER_BYTES

    def encode(self) -> bytes:
        count = self.layer_count * self.experts if self.entry_count is None else self.entry_count
        table_offset = HEADER_BYTES + ENTRY_BYTES * count if self.table_offset is None else self.table_offset
        return _HEADER.pack(
            self.magic, self.version, self.header_bytes, self.family, self.experts_used, self.layer_count,
            self.experts, self.index_offset, self.entry_bytes, count, table_offset, self.table_entry_bytes,
            self.payload_offset, self.payload_size, self.pack_size, self.source_size, self.source_tensor_count,
            self.source_sha256, self.payload_sha256, self.record_alignment, self.storage, self.reserved,
            self.index_sha256, self.table_sha256,
        )  # fmt: skip

    @classmethod
    def decode(cls, raw: bytes) -> HeaderV1:
        f = _HEADER.unpack(raw)
        return cls(
            magic=f[0], version=f[1], header_bytes=f[2], family=f[3], experts_used=f[4], layer_count=f[5],
            experts=f[6], index_offset=f[7], entry_bytes=f[8], entry_count=f[9], table_offset=f[10],
            table_entry_bytes=f[11], payload_offset=f[12], payload_size=f[13], pack_size=f[14], source_size=f[15],
            source_tensor_count=f[16], source_sha256=f[17], payload_sha256=f[18], record_alignment=f[19],
            storage=f[20], reserved=f[21], index_sha256=f[22], table_sha256=f[23],
        )  # fmt: skip


def payload_offset_for(layers: int, experts: int) -> int:
    return align_up(HEADER_BYTES + ENTRY_BYTES * layers * experts + TABLE_ENTRY_BYTES * layers, PAGE)


def layout_layers(
    layers: list[tuple[int, tuple[Component, Component, Component]]],
    experts: int,
    source_index: list[tuple[int, int, int]],
) -> tuple[list[LayerRecords], int, int]:
    """Place every record on a 4,096 boundary: (records, payload_offset, pack_size)."""
    payload_offset = payload_offset_for(len(layers), experts)
    out, pos = [], payload_offset
    for (layer, comps), src in zip(layers, source_index, strict=True):
        stride = align_up(sum(c.expert_bytes for c in comps), PAGE)
        out.append(LayerRecords(layer, experts, comps, pos, stride, src))
        pos += stride * experts
    last = out[-1]
    return out, payload_offset, pos - last.stride + last.record_bytes  # no padding after the last record


def encode_index(layers: list[LayerRecords] | tuple[LayerRecords, ...]) -> bytes:
    rows = []
    for lr in layers:
        idx = np.empty((lr.experts, 5), dtype="<u8")
        idx[:, 0] = lr.data_offset + lr.stride * np.arange(lr.experts, dtype=np.uint64)
        idx[:, 1] = lr.record_bytes
        idx[:, 2:] = [c.expert_bytes for c in lr.components]
        rows.append(idx)
    return np.concatenate(rows).tobytes()


def encode_table(layers: list[LayerRecords] | tuple[LayerRecords, ...]) -> bytes:
    out = bytearray()
    for lr in layers:
        assert lr.source_index is not None
        fields: list[int] = [lr.layer, 0]
        for c, src in zip(lr.components, lr.source_index, strict=True):
            fields += [c.ggml_type, src, c.dims[0], c.dims[1]]
        out += _TABLE.pack(*fields)
    return bytes(out)


def table_digest(header: bytes, table: bytes) -> bytes:
    h = bytearray(header)
    h[TABLE_DIGEST_FIELD] = bytes(32)
    return hashlib.sha256(bytes(h) + table).digest()


def with_digests(h: HeaderV1, payload_sha: bytes, index: bytes, table: bytes) -> bytes:
    h = replace(
        h, payload_sha256=payload_sha, index_sha256=hashlib.sha256(index).digest(), table_sha256=bytes(32)
    )
    return replace(h, table_sha256=table_digest(h.encode(), table)).encode()


@dataclass(frozen=True)
class StoreV1:
    header: HeaderV1
    layers: tuple[LayerRecords, ...]


def parse_store(buf: memoryview | bytes, where: str) -> StoreV1:
    """Validate a v1 pack's header, index (digest and every entry) and layer table."""
    size = len(buf)
    if size < HEADER_BYTES:
        raise ForgeError(f"{where}: pack of {size} bytes is shorter than its {HEADER_BYTES}-byte header")
    header_raw = bytes(buf[:HEADER_BYTES])
    h = HeaderV1.decode(header_raw)
    if h.magic != MAGIC or h.version != VERSION or h.header_bytes != HEADER_BYTES:
        raise ForgeError(f"{where}: bad magic/version/header size {h.magic!r}/{h.version}/{h.header_bytes}")
    if h.family not in V1_FAMILIES:
        raise ForgeError(f"{where}: family id {h.family:#x} is not a v1 family (qwen35moe, qwen3moe)")
    n, e = h.layer_count, h.experts
    if not 1 <= n <= 1024 or not 1 <= e <= 4096 or not 1 <= h.experts_used <= e:
        raise ForgeError(f"{where}: header limits: layers {n}, experts {e}, experts used {h.experts_used}")
    table_offset = HEADER_BYTES + ENTRY_BYTES * n * e
    if (h.index_offset, h.entry_bytes, h.entry_count, h.table_offset, h.table_entry_bytes) != (
        HEADER_BYTES,
        ENTRY_BYTES,
        n * e,
        table_offset,
        TABLE_ENTRY_BYTES,
    ):
        raise ForgeError(f"{where}: index/table offsets and sizes do not match {n} layers x {e} experts")
    if (
        h.payload_offset != payload_offset_for(n, e)
        or h.record_alignment != PAGE
        or h.storage != 0
        or any(h.reserved)
    ):
        raise ForgeError(
            f"{where}: payload offset {h.payload_offset} / record alignment / storage / reserved invalid"
        )
    if h.pack_size != size or h.payload_offset + h.payload_size != size:
        raise ForgeError(
            f"{where}: payload {h.payload_offset}+{h.payload_size} != pack size {h.pack_size} (tensor holds {size})"
        )
    if h.source_tensor_count <= 3 * n or h.source_size == 0:
        raise ForgeError(
            f"{where}: source tensor count {h.source_tensor_count} / size {h.source_size} invalid"
        )
    table_end = table_offset + TABLE_ENTRY_BYTES * n
    table = bytes(buf[table_offset:table_end])
    if table_digest(header_raw, table) != h.table_sha256:
        raise ForgeError(f"{where}: header/table digest mismatch (header or layer table corrupted)")
    index = bytes(buf[HEADER_BYTES:table_offset])
    if hashlib.sha256(index).digest() != h.index_sha256:
        raise ForgeError(f"{where}: index digest mismatch (index corrupted)")
    comps_list, sources = [], []
    for i in range(n):
        f = _TABLE.unpack_from(table, i * TABLE_ENTRY_BYTES)
        if f[1]:
            raise ForgeError(f"{where}: layer table entry {i} reserved field is not zero")
        comps, offset = [], 0
        for role in range(3):
            ggml_type, src, ne0, ne1 = f[2 + 4 * role : 6 + 4 * role]
            c = Component(role, ggml_type, (ne0, ne1, e), 0, offset)
            lw = f"{where}: layer {f[0]}"
            c = replace(c, expert_bytes=tensor_nbytes(tuple(reversed(c.dims)), ggml_type, lw) // e)
            check_component(c, role, e, lw)
            comps.append(c)
            offset += c.expert_bytes
        check_ffn_shape(tuple(comps), f"{where}: layer {f[0]}")  # type: ignore[arg-type]
        comps_list.append((f[0], tuple(comps)))
        sources.append(tuple(f[3::4]))
    if [c[0] for c in comps_list] != list(range(n)):
        raise ForgeError(f"{where}: {FAMILY_NAMES[h.family]} layers must be 0..{n - 1}")
    layers, _, pack_size = layout_layers(comps_list, e, sources)  # type: ignore[arg-type]
    expected = np.frombuffer(encode_index(layers), dtype="<u8").reshape(-1, 5)
    got = np.frombuffer(index, dtype="<u8").reshape(-1, 5)
    bad = np.flatnonzero((expected != got).any(axis=1))
    if bad.size:
        k = int(bad[0])
        row = got[k].tolist()
        raise ForgeError(
            f"{where}: index entry of layer {layers[k // e].layer} expert {k % e} is {row} "
            f"(offset, total, gate, up, down), expected {expected[k].tolist()} (overlapping or misplaced record)"
        )
    if pack_size != size:
        raise ForgeError(f"{where}: records end at {pack_size}, pack holds {size} bytes")
    return StoreV1(h, tuple(layers))
