"""The ``ds4.expert_major.v2`` store: a 256-byte header, 224-byte layer descriptors, then per layer
``experts`` records ``gate | up | down``, each layer starting on a 4,096-byte boundary of the store.

Field by field description: docs/expert-major.md. All integers little-endian.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, replace

from forge.errors import ForgeError
from forge.gguf_file import align_up
from forge.layout.gguf_raw import type_geometry
from forge.layout.records import PAGE, Component, LayerRecords, check_component, check_ffn_shape
from forge.layout.source import DENSE_LEAD_FAMILIES, FAMILY_NAMES

TENSOR_NAME = "ds4.expert_major.v2"
MAGIC = b"DS4EXPV2"
VERSION = 2
HEADER_BYTES = 256
DESCRIPTOR_BYTES = 224
STORAGE_GGML = 0
MANIFEST_FIELD = slice(168, 200)

# magic, version, header bytes, family, experts used, layers, experts; 8 u64; 2 digests; storage,
# group; manifest digest; 56 reserved bytes.
_HEADER = struct.Struct("<8sIIIIII8Q32s32sII32s56s")
_LAYER = struct.Struct("<IIQQQ")  # layer, experts, record bytes, data offset, data size
_COMPONENT = struct.Struct("<IIII3QQQ")  # role, type, n_dims, block elements, dims, bytes, offset
_EXTENSION = struct.Struct("<3Q")  # descriptor bytes 200..223: forge source positions + 1, or zero
_COMPONENT_AT = (32, 88, 144)
MAX_LAYERS, MAX_EXPERTS, MAX_LAYER_INDEX = 1024, 4096, 4095
assert _HEADER.size == HEADER_BYTES and _COMPONENT.size == 56


@dataclass(frozen=True)
class HeaderV2:
    family: int
    experts_used: int
    layer_count: int
    experts: int
    source_tensor_count: int
    data_offset: int
    data_size: int
    store_size: int
    source_size: int
    source_sha256: bytes
    payload_sha256: bytes
    manifest_sha256: bytes = bytes(32)
    storage: int = STORAGE_GGML
    group_size: int = 0
    descriptor_offset: int = HEADER_BYTES
    reserved: bytes = bytes(56)
    magic: bytes = MAGIC
    version: int = VERSION
    header_bytes: int = HEADER_BYTES
    descriptor_count: int | None = None
    descriptor_bytes: int | None = None

    def encode(self) -> bytes:
        n = self.layer_count
        return _HEADER.pack(
            self.magic,
            self.version,
            self.header_bytes,
            self.family,
            self.experts_used,
            n,
            self.experts,
            self.source_tensor_count,
            n if self.descriptor_count is None else self.descriptor_count,
            DESCRIPTOR_BYTES * n if self.descriptor_bytes is None else self.descriptor_bytes,
            self.descriptor_offset,
            self.data_offset,
            self.data_size,
            self.store_size,
            self.source_size,
            self.source_sha256,
            self.payload_sha256,
            self.storage,
            self.group_size,
            self.manifest_sha256,
            self.reserved,
        )

    @classmethod
    def decode(cls, raw: bytes) -> HeaderV2:
        f = _HEADER.unpack(raw)
        return cls(
            magic=f[0], version=f[1], header_bytes=f[2], family=f[3], experts_used=f[4], layer_count=f[5],
            experts=f[6], source_tensor_count=f[7], descriptor_count=f[8], descriptor_bytes=f[9],
            descriptor_offset=f[10], data_offset=f[11], data_size=f[12], store_size=f[13], source_size=f[14],
            source_sha256=f[15], payload_sha256=f[16], storage=f[17], group_size=f[18], manifest_sha256=f[19],
            reserved=f[20],
        )  # fmt: skip


def encode_descriptor(lr: LayerRecords, record_source_index: bool) -> bytes:
    out = bytearray(DESCRIPTOR_BYTES)
    _LAYER.pack_into(out, 0, lr.layer, lr.experts, lr.record_bytes, lr.data_offset, lr.data_size)
    for c, at in zip(lr.components, _COMPONENT_AT, strict=True):
        _COMPONENT.pack_into(
            out, at, c.role, c.ggml_type, 3, c.block_elements, *c.dims, c.expert_bytes, c.record_offset
        )
    if record_source_index:
        assert lr.source_index is not None
        _EXTENSION.pack_into(out, 200, *(i + 1 for i in lr.source_index))
    return bytes(out)


def decode_descriptor(raw: bytes, where: str) -> tuple[LayerRecords, tuple[int, int, int], tuple[int, ...]]:
    """(layer records, raw (layer data size, record bytes, n_dims...), source positions or ())."""
    layer, experts, record_bytes, data_offset, data_size = _LAYER.unpack_from(raw, 0)
    comps, n_dims, blocks = [], [], []
    for at in _COMPONENT_AT:
        role, ggml_type, nd, block, d0, d1, d2, nbytes, offset = _COMPONENT.unpack_from(raw, at)
        comps.append(Component(role, ggml_type, (d0, d1, d2), nbytes, offset))
        n_dims.append(nd)
        blocks.append(block)
    ext = _EXTENSION.unpack_from(raw, 200)
    source_index = tuple(i - 1 for i in ext) if any(ext) else None
    if source_index is not None and min(ext) == 0:
        raise ForgeError(f"{where}: source-position extension (bytes 200..223) partly zero")
    lr = LayerRecords(layer, experts, tuple(comps), data_offset, record_bytes, source_index)  # type: ignore[arg-type]
    return lr, (data_size, record_bytes), (*n_dims, *blocks)


def layout_layers(
    layers: list[tuple[int, tuple[Component, Component, Component]]],
    experts: int,
    source_index: list[tuple[int, int, int]] | None,
) -> tuple[list[LayerRecords], int, int]:
    """Place the layers: (records, data_offset, store_size)."""
    data_offset = align_up(HEADER_BYTES + DESCRIPTOR_BYTES * len(layers), PAGE)
    out, pos = [], data_offset
    for i, (layer, comps) in enumerate(layers):
        pos = align_up(pos, PAGE)
        record = sum(c.expert_bytes for c in comps)
        out.append(
            LayerRecords(layer, experts, comps, pos, record, source_index[i] if source_index else None)
        )
        pos += record * experts
    return out, data_offset, pos


def manifest_digest(header: bytes, descriptors: bytes) -> bytes:
    h = bytearray(header)
    h[MANIFEST_FIELD] = bytes(32)
    return hashlib.sha256(bytes(h) + descriptors).digest()


@dataclass(frozen=True)
class StoreV2:
    header: HeaderV2
    layers: tuple[LayerRecords, ...]
    descriptors: bytes

    @property
    def source_index_recorded(self) -> bool:
        return self.layers[0].source_index is not None


def parse_store(buf: memoryview | bytes, where: str) -> StoreV2:
    """Validate a v2 store's header, manifest digest and descriptors (not the payload digest)."""
    size = len(buf)
    if size < HEADER_BYTES:
        raise ForgeError(f"{where}: store of {size} bytes is shorter than its {HEADER_BYTES}-byte header")
    header_raw = bytes(buf[:HEADER_BYTES])
    h = HeaderV2.decode(header_raw)
    if h.magic != MAGIC:
        raise ForgeError(f"{where}: bad magic {h.magic!r}, expected {MAGIC!r}")
    if h.version != VERSION or h.header_bytes != HEADER_BYTES:
        raise ForgeError(f"{where}: version {h.version} / header bytes {h.header_bytes}, expected 2 / 256")
    if h.family not in FAMILY_NAMES:
        raise ForgeError(f"{where}: unknown family id {h.family:#x}")
    n = h.layer_count
    if not 1 <= n <= MAX_LAYERS or not 1 <= h.experts <= MAX_EXPERTS or not 1 <= h.experts_used <= h.experts:
        raise ForgeError(
            f"{where}: header limits: layers {n}, experts {h.experts}, experts used {h.experts_used}"
        )
    if (
        h.descriptor_count != n
        or h.descriptor_bytes != DESCRIPTOR_BYTES * n
        or h.descriptor_offset != HEADER_BYTES
    ):
        raise ForgeError(
            f"{where}: descriptor count/bytes/offset {h.descriptor_count}/{h.descriptor_bytes}/{h.descriptor_offset} "
            f"do not match {n} layers"
        )
    if h.source_tensor_count <= 3 * n or h.source_size == 0:
        raise ForgeError(
            f"{where}: source tensor count {h.source_tensor_count} / size {h.source_size} invalid for {n} layers"
        )
    if h.data_offset % PAGE or h.data_offset != align_up(HEADER_BYTES + DESCRIPTOR_BYTES * n, PAGE):
        raise ForgeError(
            f"{where}: data offset {h.data_offset} is not the first 4,096 boundary after the descriptors"
        )
    if h.store_size != size or h.data_offset + h.data_size != h.store_size:
        raise ForgeError(
            f"{where}: data offset {h.data_offset} + data size {h.data_size} != store size {h.store_size} "
            f"(tensor holds {size})"
        )
    if h.storage != STORAGE_GGML or h.group_size != 0:
        raise ForgeError(
            f"{where}: storage format {h.storage} / group size {h.group_size} not supported (GGML blocks only)"
        )
    if any(h.reserved):
        raise ForgeError(f"{where}: reserved header bytes 200..255 are not zero")
    desc_end = HEADER_BYTES + DESCRIPTOR_BYTES * n
    descriptors = bytes(buf[HEADER_BYTES:desc_end])
    if manifest_digest(header_raw, descriptors) != h.manifest_sha256:
        raise ForgeError(f"{where}: manifest digest mismatch (header or descriptors corrupted)")
    layers = []
    pos = h.data_offset
    for i in range(n):
        lw = f"{where}: descriptor {i}"
        lr, (data_size, record_bytes), meta = decode_descriptor(
            descriptors[i * DESCRIPTOR_BYTES : (i + 1) * DESCRIPTOR_BYTES], lw
        )
        lw = f"{where}: layer {lr.layer}"
        _check_layer(h, lr, data_size, record_bytes, meta, lw)
        if layers and lr.layer <= layers[-1].layer:
            raise ForgeError(f"{lw}: layer indices not strictly increasing")
        if layers and (lr.source_index is None) != (layers[0].source_index is None):
            raise ForgeError(f"{lw}: source-position extension present on some layers only")
        if lr.data_offset < pos:
            raise ForgeError(f"{lw}: data at {lr.data_offset} overlaps the previous extent ending at {pos}")
        if lr.data_offset != align_up(pos, PAGE):
            raise ForgeError(
                f"{lw}: data at {lr.data_offset}, expected the next 4,096 boundary {align_up(pos, PAGE)}"
            )
        pos = lr.data_offset + lr.data_size
        if pos > h.store_size:
            raise ForgeError(f"{lw}: data ends at {pos}, beyond the store's {h.store_size} bytes")
        layers.append(lr)
    if pos != h.store_size:
        raise ForgeError(f"{where}: descriptors cover the payload up to {pos}, store ends at {h.store_size}")
    # ds4: layer index == position except for GLM, whose routed layers follow its dense prefix.
    if h.family not in DENSE_LEAD_FAMILIES and [lr.layer for lr in layers] != list(range(n)):
        raise ForgeError(f"{where}: {FAMILY_NAMES[h.family]} routed layers must be 0..{n - 1}")
    return StoreV2(h, tuple(layers), descriptors)


def _check_layer(
    h: HeaderV2, lr: LayerRecords, data_size: int, record_bytes: int, meta: tuple[int, ...], where: str
) -> None:
    if lr.layer > MAX_LAYER_INDEX or lr.experts != h.experts:
        raise ForgeError(f"{where}: layer index {lr.layer} / expert count {lr.experts} invalid")
    n_dims, blocks = meta[:3], meta[3:]
    offset = 0
    for role, c in enumerate(lr.components):
        check_component(c, role, h.experts, where)
        if n_dims[role] != 3 or blocks[role] != type_geometry(c.ggml_type)[0]:
            raise ForgeError(
                f"{where} component {role}: n_dims {n_dims[role]} / block elements {blocks[role]} invalid"
            )
        if c.record_offset != offset:
            raise ForgeError(f"{where} component {role}: record offset {c.record_offset}, expected {offset}")
        offset += c.expert_bytes
    check_ffn_shape(lr.components, where)
    if record_bytes != offset or data_size != record_bytes * h.experts:
        raise ForgeError(
            f"{where}: record bytes {record_bytes} / data size {data_size} do not match its components"
        )
    if lr.data_offset % PAGE:
        raise ForgeError(f"{where}: data offset {lr.data_offset} is not 4,096-aligned")


def with_digests(h: HeaderV2, payload_sha: bytes, descriptors: bytes) -> bytes:
    """Final header bytes: payload digest set, manifest digest computed over header + descriptors."""
    h = replace(h, payload_sha256=payload_sha, manifest_sha256=bytes(32))
    raw = h.encode()
    return replace(h, manifest_sha256=manifest_digest(raw, descriptors)).encode()
