"""Full check of an expert-major file against the canonical GGUF it was built from."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from forge.errors import ForgeError
from forge.layout import store_v1, store_v2
from forge.layout.gguf_raw import RawGGUF, open_gguf, type_name
from forge.layout.reader import ExpertStore, parse_native
from forge.layout.records import components_from_source
from forge.layout.source import ROLES, SourcePlan, plan_source
from forge.layout.streams import sha256_async

COMPARE_BYTES = 16 << 20


@dataclass(frozen=True)
class VerifyReport:
    version: int
    family: str
    layers: int
    experts: int
    payload_bytes: int


def _first_diff_row(a: np.ndarray, b: np.ndarray) -> int | None:
    """Index of the first row where two (rows, n) uint8 arrays differ, or None."""
    step = max(1, COMPARE_BYTES // max(a.shape[1], 1))
    for r0 in range(0, a.shape[0], step):
        x, y = a[r0 : r0 + step], b[r0 : r0 + step]
        if not np.array_equal(x, y):
            return r0 + int(np.flatnonzero((x != y).any(axis=1))[0])
    return None


def _rows(buf: object, start: int, rows: int, width: int, stride: int) -> np.ndarray:
    base = np.frombuffer(buf, np.uint8, (rows - 1) * stride + width, start)  # type: ignore[call-overload]
    return np.lib.stride_tricks.as_strided(base, (rows, width), (stride, 1), writeable=False)


def _check_zero(native: RawGGUF, start: int, end: int, what: str) -> None:
    if end > start and np.count_nonzero(np.frombuffer(native.mm, np.uint8, end - start, start)):
        raise ForgeError(f"{native.path}: {what} (bytes {start}..{end}) is not zero")


def verify_native(
    src: RawGGUF,
    native: RawGGUF,
    source_sha256: bytes | None = None,
    written_payload_sha256: bytes | None = None,
) -> VerifyReport:
    """Every check of the format; ForgeError naming the layer, expert and component on a mismatch.

    ``source_sha256``: the source's digest when the caller has just computed it (skips one pass).
    ``written_payload_sha256``: the digest of the payload bytes the caller wrote. The byte-for-byte
    comparison below covers every payload byte (each component slice, each padding byte), so once
    it passes the file's payload digest equals this one: the converter passes it to skip a pass.
    """
    source_digest = None if source_sha256 is not None else sha256_async(src.mm, 0, src.size)
    if native.n_kv != src.n_kv or bytes(native.kv_block) != bytes(src.kv_block):
        raise ForgeError(f"{native.path}: KV block differs from the source's")
    store = parse_native(native)
    h = store.header
    payload_start = store.store_start + store.payload_offset
    payload_digest = (
        None
        if written_payload_sha256 is not None
        else sha256_async(native.mm, payload_start, store.store_start + store.store_size)
    )
    plan = plan_source(src)

    identity = [
        ("family", store.family, plan.family),
        ("experts", store.experts, plan.experts),
        ("experts used", store.experts_used, plan.experts_used),
        ("routed layers", len(store.layers), len(plan.layers)),
        ("source tensor count", h.source_tensor_count, len(src.tensors)),
        ("source size", h.source_size, src.size),
    ]
    for what, got, want in identity:
        if got != want:
            raise ForgeError(f"{native.path}: header {what} is {got}, the source gives {want}")
    for (layer, comps), rl in zip(components_from_source(plan), plan.layers, strict=True):
        lr = store.layers.get(layer)
        if lr is None:
            raise ForgeError(f"{native.path}: layer {layer} is missing from the store")
        for c, mine in zip(comps, lr.components, strict=True):
            if c != mine:
                raise ForgeError(
                    f"{native.path}: layer {layer} {ROLES[c.role]}: store says {type_name(mine.ggml_type)} "
                    f"{list(mine.dims)}, source has {type_name(c.ggml_type)} {list(c.dims)}"
                )
        if lr.source_index is not None and lr.source_index != rl.source_index:
            raise ForgeError(
                f"{native.path}: layer {layer}: recorded source positions {lr.source_index} != {rl.source_index}"
            )

    if store.canonical_order() != [t.name for t in src.tensors]:
        raise ForgeError(f"{native.path}: the source tensor order cannot be rebuilt from this file")

    kept = native.tensors[:-1]
    if len(kept) != len(plan.kept):
        raise ForgeError(f"{native.path}: {len(kept)} non-routed tensors, the source has {len(plan.kept)}")
    for mine, theirs in zip(kept, plan.kept, strict=True):
        if (mine.name, mine.dims, mine.ggml_type) != (theirs.name, theirs.dims, theirs.ggml_type):
            raise ForgeError(
                f"{native.path}: non-routed tensor {mine.name} differs from source tensor {theirs.name}"
            )
        a, b = native.tensor_view(mine), src.tensor_view(theirs)
        if _first_diff_row(np.frombuffer(a, np.uint8)[None], np.frombuffer(b, np.uint8)[None]) is not None:
            raise ForgeError(f"{native.path}: bytes of non-routed tensor {mine.name} differ from the source")

    _verify_payload(src, native, store, plan)

    got_payload = written_payload_sha256 if payload_digest is None else payload_digest.result()
    if h.payload_sha256 != got_payload:
        raise ForgeError(f"{native.path}: payload digest mismatch (expert data corrupted)")
    got_source = source_sha256 if source_sha256 is not None else source_digest.result()  # type: ignore[union-attr]
    if h.source_sha256 != got_source:
        raise ForgeError(f"{native.path}: recorded source SHA-256 does not match {src.path}")
    payload = store.store_size - store.payload_offset
    return VerifyReport(store.version, store.family_name, len(store.layers), store.experts, payload)


def _verify_payload(src: RawGGUF, native: RawGGUF, store: ExpertStore, plan: SourcePlan) -> None:
    base = store.store_start
    layers = list(store.layers.values())
    if store.version == 2:
        meta_end = base + store_v2.HEADER_BYTES + store_v2.DESCRIPTOR_BYTES * len(layers)
    else:
        meta_end = (
            base
            + store_v1.HEADER_BYTES
            + (store_v1.ENTRY_BYTES * store.experts + store_v1.TABLE_ENTRY_BYTES) * len(layers)
        )
    _check_zero(native, meta_end, base + store.payload_offset, "store padding before the payload")
    pos = base + store.payload_offset
    for k, lr in enumerate(layers):
        start = base + lr.data_offset
        _check_zero(native, pos, start, f"padding before layer {lr.layer}")
        records = store.layer_records(lr.layer)
        rl = plan.layers[k]
        for c, t in zip(lr.components, rl.tensors, strict=True):
            canonical = _rows(src.mm, src.data_start + t.offset, lr.experts, c.expert_bytes, c.expert_bytes)
            e = _first_diff_row(records[:, c.record_offset : c.record_offset + c.expert_bytes], canonical)
            if e is not None:
                raise ForgeError(
                    f"{native.path}: layer {lr.layer} expert {e} {ROLES[c.role]}: bytes differ from {t.name}"
                )
        tail = lr.stride - lr.record_bytes
        last = k == len(layers) - 1
        n_tails = lr.experts - 1 if last else lr.experts
        if tail and n_tails:
            tails = _rows(native.mm, start + lr.record_bytes, n_tails, tail, lr.stride)
            if np.count_nonzero(tails):
                e = int(np.flatnonzero(tails.any(axis=1))[0])
                raise ForgeError(
                    f"{native.path}: layer {lr.layer} expert {e}: padding after the record is not zero"
                )
        pos = start + (lr.experts - 1) * lr.stride + lr.record_bytes + (0 if last else tail)


def verify_files(src: str | os.PathLike[str], native: str | os.PathLike[str]) -> VerifyReport:
    with open_gguf(src) as s, open_gguf(native) as n:
        return verify_native(s, n)
