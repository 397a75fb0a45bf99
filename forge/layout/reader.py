"""Read expert-major GGUF files: one expert of one layer is one contiguous slice of the file.

Runtime API::

    if is_expert_major(path):
        store = open_expert_store(path)          # validates; refuses a corrupted file
        gate, up, down = store.expert(layer, e)  # zero-copy memoryviews of the mmap
        off, n = store.record_span(layer, e)     # absolute file range of the record, for pread
        for name, ggml_type, dims in store.routed_tensors(): ...   # logical canonical tensors
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from forge.errors import ForgeError
from forge.layout import store_v1, store_v2
from forge.layout.gguf_raw import RawGGUF, RawTensor, open_gguf
from forge.layout.records import PAGE, LayerRecords
from forge.layout.source import FAMILY_NAMES, STORE_TENSOR_NAMES, is_routed_name, rebuild_order

GGML_TYPE_I8 = 24
HASH_CHUNK = 64 << 20


@dataclass
class ExpertStore:
    """An opened, validated expert-major file. ``layers`` maps the model layer index to its records."""

    raw: RawGGUF
    version: int  # 1 or 2
    family: int
    experts: int
    experts_used: int
    layers: dict[int, LayerRecords]
    store_start: int  # absolute file offset of the store tensor's first byte
    store_size: int
    payload_offset: int  # from store_start
    header: store_v1.HeaderV1 | store_v2.HeaderV2

    @property
    def family_name(self) -> str:
        return FAMILY_NAMES[self.family]

    @property
    def path(self) -> Path:
        return self.raw.path

    def record_span(self, layer: int, expert: int) -> tuple[int, int]:
        """(absolute file offset, byte count) of the record ``gate | up | down``."""
        lr = self._layer(layer)
        if not 0 <= expert < lr.experts:
            raise ForgeError(f"{self.path}: layer {layer} has no expert {expert} (0..{lr.experts - 1})")
        return self.store_start + lr.data_offset + expert * lr.stride, lr.record_bytes

    def record(self, layer: int, expert: int) -> memoryview:
        start, n = self.record_span(layer, expert)
        return memoryview(self.raw.mm)[start : start + n]

    def expert(self, layer: int, expert: int) -> tuple[memoryview, memoryview, memoryview]:
        """(gate, up, down) bytes of one expert, each in its GGML type's block layout."""
        rec = self.record(layer, expert)
        comps = self._layer(layer).components
        return tuple(rec[c.record_offset : c.record_offset + c.expert_bytes] for c in comps)  # type: ignore[return-value]

    def layer_records(self, layer: int) -> np.ndarray:
        """Read-only uint8 (experts, record_bytes) view of a layer's records (rows ``stride`` apart)."""
        lr = self._layer(layer)
        start = self.store_start + lr.data_offset
        base = np.frombuffer(self.raw.mm, np.uint8, (lr.experts - 1) * lr.stride + lr.record_bytes, start)
        return np.lib.stride_tricks.as_strided(
            base, (lr.experts, lr.record_bytes), (lr.stride, 1), writeable=False
        )

    def routed_tensors(self) -> list[tuple[str, int, tuple[int, int, int]]]:
        """(canonical name, GGML type, GGUF dims) of every routed tensor the store replaces."""
        return [
            (lr.canonical_name(c.role), c.ggml_type, c.dims)
            for lr in self.layers.values()
            for c in lr.components
        ]

    def canonical_order(self) -> list[str]:
        """The canonical file's tensor directory order, rebuilt from the kept names and the store."""
        routed_index: dict[str, int | None] = {}
        for lr in self.layers.values():
            for role in range(3):
                routed_index[lr.canonical_name(role)] = (
                    None if lr.source_index is None else lr.source_index[role]
                )
        kept_names = [t.name for t in self.non_routed_tensors()]
        return rebuild_order(kept_names, routed_index, self.header.source_tensor_count, str(self.path))

    def non_routed_tensors(self) -> list[RawTensor]:
        return self.raw.tensors[:-1]

    def _layer(self, layer: int) -> LayerRecords:
        try:
            return self.layers[layer]
        except KeyError:
            raise ForgeError(f"{self.path}: layer {layer} has no routed experts in the store") from None

    def close(self) -> None:
        self.raw.close()

    def __enter__(self) -> ExpertStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def store_tensor(raw: RawGGUF) -> RawTensor | None:
    """The store tensor of an expert-major file; None for a canonical file; ForgeError if malformed."""
    found = [t for t in raw.tensors if t.name in STORE_TENSOR_NAMES]
    if not found:
        return None
    t = found[-1]
    if len(found) > 1:
        raise ForgeError(f"{raw.path}: holds {len(found)} expert-major store tensors")
    if raw.tensors[-1] is not t:
        raise ForgeError(f"{raw.path}: store tensor {t.name} is not the last tensor of the directory")
    if t.ggml_type != GGML_TYPE_I8 or len(t.dims) != 1:
        raise ForgeError(f"{raw.path}: store tensor {t.name} must be 1-D I8")
    routed = [x.name for x in raw.tensors if is_routed_name(x.name)]
    if routed:
        raise ForgeError(
            f"{raw.path}: holds both the store {t.name} and canonical routed tensors ({routed[0]}, ...)"
        )
    return t


def is_expert_major(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a GGUF holding an expert-major store tensor (cheap: directory only)."""
    with open_gguf(path) as raw:
        return any(t.name in STORE_TENSOR_NAMES for t in raw.tensors)


def parse_native(raw: RawGGUF) -> ExpertStore:
    """Validate ``raw`` as an expert-major file (structure, manifest, index; not the payload digest)."""
    t = store_tensor(raw)
    if t is None:
        raise ForgeError(
            f"{raw.path}: not an expert-major file (no {' or '.join(STORE_TENSOR_NAMES)} tensor)"
        )
    start = raw.data_start + t.offset
    view = memoryview(raw.mm)[start : start + t.nbytes]
    where = f"{raw.path}: {t.name}"
    if t.name == store_v2.TENSOR_NAME:
        s2 = store_v2.parse_store(view, where)
        h2 = s2.header
        return ExpertStore(
            raw, 2, h2.family, h2.experts, h2.experts_used, {lr.layer: lr for lr in s2.layers}, start, t.nbytes,
            h2.data_offset, h2,
        )  # fmt: skip
    if start % PAGE:
        raise ForgeError(f"{where}: pack starts at file byte {start}, not on a 4,096 boundary")
    s1 = store_v1.parse_store(view, where)
    h1 = s1.header
    return ExpertStore(
        raw, 1, h1.family, h1.experts, h1.experts_used, {lr.layer: lr for lr in s1.layers}, start, t.nbytes,
        h1.payload_offset, h1,
    )  # fmt: skip


def payload_digest(store: ExpertStore) -> bytes:
    h = hashlib.sha256()
    mv = memoryview(store.raw.mm)
    for pos in range(
        store.store_start + store.payload_offset, store.store_start + store.store_size, HASH_CHUNK
    ):
        h.update(mv[pos : min(pos + HASH_CHUNK, store.store_start + store.store_size)])
    return h.digest()


def check_payload(store: ExpertStore) -> None:
    if payload_digest(store) != store.header.payload_sha256:
        raise ForgeError(f"{store.path}: payload digest mismatch (expert data corrupted)")


def open_expert_store(path: str | os.PathLike[str], verify_payload: bool = True) -> ExpertStore:
    """Open and validate an expert-major v1/v2 GGUF for reading experts.

    Always checks the GGUF structure, the header, the manifest/index digests and every descriptor
    (cheap). ``verify_payload`` also re-hashes the payload (one pass over the expert bytes) so that a
    corrupted expert byte is refused at load; pass False for a fast start on a trusted file.
    """
    raw = open_gguf(path)
    try:
        store = parse_native(raw)
        if verify_payload:
            check_payload(store)
        return store
    except BaseException:
        raw.close()
        raise
