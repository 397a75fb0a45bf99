"""canonical -> expert-major v1/v2 and back, byte for byte, through transactional writes."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from forge.atomic import atomic_output
from forge.errors import ForgeError
from forge.gguf_file import align_up, pack_tensor_info
from forge.layout import store_v1, store_v2
from forge.layout.gguf_raw import RawGGUF, encode_header, open_gguf, packed_offsets
from forge.layout.reader import GGML_TYPE_I8, parse_native
from forge.layout.records import PAGE, LayerRecords, components_from_source
from forge.layout.source import (
    SourcePlan,
    file_aligned_offset,
    plan_source,
    source_order_is_derivable,
)
from forge.layout.streams import HashPipe, Sink, sha256_async
from forge.layout.verify import verify_native

# Test hook: seconds to sleep after each layer's records are written (used to kill a conversion mid-write).
PAUSE_ENV = "FORGE_LAYOUT_PAUSE_S"


@dataclass(frozen=True)
class ConvertResult:
    dest: Path
    output_bytes: int
    source_sha256: str
    payload_sha256: str | None
    verified: bool
    source_order: str = "derived"  # "recorded": v2 uses the gguf-forge source-position extension


def _pause_hook(layer: int) -> None:
    pause = os.environ.get(PAUSE_ENV)
    if pause:
        print(f"forge-layout: wrote layer {layer}", file=sys.stderr, flush=True)
        time.sleep(float(pause))


@dataclass(frozen=True)
class NativePlan:
    """Where everything goes in the expert-major file built from ``source``."""

    source: SourcePlan
    version: int
    layers: list[LayerRecords]
    payload_offset: int  # from the store start
    store_size: int
    meta: bytes  # v2: the descriptors; v1: the index followed by the layer table
    entries: list[tuple[str, tuple[int, ...], int]]  # directory: name, dims, type
    offsets: list[int]  # data-section offsets, store last
    data_start: int
    out_size: int

    @property
    def store_start(self) -> int:
        return self.data_start + self.offsets[-1]


def plan_native(plan: SourcePlan, version: int) -> NativePlan:
    raw = plan.raw
    if version not in (1, 2):
        raise ForgeError(f"unknown expert-major version {version}")
    if version == 1 and plan.family not in store_v1.V1_FAMILIES:
        raise ForgeError(f"{raw.path}: v1 supports qwen35moe and qwen3moe only, not {plan.arch}")
    comps = components_from_source(plan)
    positions = [rl.source_index for rl in plan.layers]
    if version == 2:
        record_positions = not source_order_is_derivable(plan)
        layers, payload_offset, store_size = store_v2.layout_layers(comps, plan.experts, positions)
        meta = b"".join(store_v2.encode_descriptor(lr, record_positions) for lr in layers)
    else:
        layers, payload_offset, store_size = store_v1.layout_layers(comps, plan.experts, positions)
        meta = store_v1.encode_index(layers) + store_v1.encode_table(layers)
    tensor_name = store_v2.TENSOR_NAME if version == 2 else store_v1.TENSOR_NAME
    kept = list(plan.kept)
    offsets = packed_offsets([t.nbytes for t in kept] + [store_size], raw.alignment)
    entries = [(t.name, t.dims, t.ggml_type) for t in kept] + [(tensor_name, (store_size,), GGML_TYPE_I8)]
    dir_bytes = sum(len(pack_tensor_info(n, d, ty, 0)) for n, d, ty in entries)
    data_start = align_up(24 + len(raw.kv_block) + dir_bytes, raw.alignment)
    if version == 1:
        offsets[-1] = file_aligned_offset(data_start, offsets[-1], raw.alignment, PAGE)
    out_size = data_start + align_up(offsets[-1] + store_size, raw.alignment)
    return NativePlan(
        plan, version, layers, payload_offset, store_size, meta, entries, offsets, data_start, out_size
    )


def to_expert_major(
    src: str | os.PathLike[str], dest: str | os.PathLike[str], version: int, verify: bool = True
) -> ConvertResult:
    """Write ``dest``: canonical GGUF ``src`` with its routed experts moved into a v1/v2 store."""
    with open_gguf(src) as raw:
        plan = plan_source(raw)
        np_ = plan_native(plan, version)
        layers, payload_offset, store_size, meta = np_.layers, np_.payload_offset, np_.store_size, np_.meta
        kept, entries, offsets = list(plan.kept), np_.entries, np_.offsets
        data_start, out_size, store_start = np_.data_start, np_.out_size, np_.store_start

        source_digest = sha256_async(raw.mm, 0, raw.size)
        payload_hash = HashPipe()
        with atomic_output(dest, need_bytes=out_size) as f:
            out = Sink(f.fileno())
            out.write(encode_header(len(entries), raw.n_kv))
            out.write(raw.kv_block)
            out.write(
                b"".join(
                    pack_tensor_info(n, d, ty, o) for (n, d, ty), o in zip(entries, offsets, strict=True)
                )
            )
            src_fd = os.open(raw.path, os.O_RDONLY)
            try:
                for t, off in zip(kept, offsets[:-1], strict=True):
                    out.pad_to(data_start + off)
                    out.copy_from(src_fd, raw.mm, raw.data_start + t.offset, t.nbytes)
                out.pad_to(store_start)
                out.zeros(256)  # the header, written last once the digests are known
                out.write(meta)
                out.pad_to(store_start + payload_offset)
                out.hasher = payload_hash
                _write_payload(raw, plan, layers, src_fd, store_start, out)
                out.hasher = None
            finally:
                os.close(src_fd)
            if out.pos != store_start + store_size:
                raise AssertionError(f"payload ends at {out.pos - store_start}, store size {store_size}")
            out.pad_to(out_size)

            payload_sha, source_sha = payload_hash.digest(), source_digest.result()
            if version == 2:
                header = store_v2.with_digests(
                    store_v2.HeaderV2(
                        plan.family, plan.experts_used, len(layers), plan.experts, len(raw.tensors), payload_offset,
                        store_size - payload_offset, store_size, raw.size, source_sha, payload_sha,
                    ),
                    payload_sha, meta,
                )  # fmt: skip
            else:
                header = store_v1.with_digests(
                    store_v1.HeaderV1(
                        plan.family, plan.experts_used, len(layers), plan.experts, payload_offset,
                        store_size - payload_offset, store_size, raw.size, len(raw.tensors), source_sha, payload_sha,
                    ),
                    payload_sha, meta[: len(meta) - store_v1.TABLE_ENTRY_BYTES * len(layers)],
                    meta[len(meta) - store_v1.TABLE_ENTRY_BYTES * len(layers) :],
                )  # fmt: skip
            os.pwrite(f.fileno(), header, store_start)
            if verify:
                with open_gguf(f"/proc/self/fd/{f.fileno()}") as native:
                    native.path = Path(dest)
                    verify_native(raw, native, source_sha256=source_sha, written_payload_sha256=payload_sha)
    recorded = version == 1 or meta[200:224] != bytes(24)  # v2: descriptor 0 extension bytes
    order = "recorded" if recorded else "derived"
    return ConvertResult(Path(dest), out_size, source_sha.hex(), payload_sha.hex(), verify, order)


def _write_payload(
    raw: RawGGUF, plan: SourcePlan, layers: list[LayerRecords], src_fd: int, store_start: int, out: Sink
) -> None:
    """Each record ``gate | up | down`` copied from the canonical tensors, in the kernel, one slice
    per (expert, component); zero padding between layers (v2) or records (v1)."""
    for pos, lr in enumerate(layers):
        out.pad_to(store_start + lr.data_offset)
        starts = [raw.data_start + t.offset for t in plan.layers[pos].tensors]
        tail = lr.stride - lr.record_bytes
        for e in range(lr.experts):
            for c, start in zip(lr.components, starts, strict=True):
                out.copy_from(src_fd, raw.mm, start + e * c.expert_bytes, c.expert_bytes)
            if tail and not (pos == len(layers) - 1 and e == lr.experts - 1):  # v1: none after the last
                out.zeros(tail)
        _pause_hook(lr.layer)


def to_canonical(
    src: str | os.PathLike[str], dest: str | os.PathLike[str], verify: bool = True
) -> ConvertResult:
    """Rebuild the canonical GGUF an expert-major file came from; checked against its source SHA-256."""
    with open_gguf(src) as raw:
        store = parse_native(raw)
        order = store.canonical_order()
        kept = {t.name: t for t in store.non_routed_tensors()}
        routed = {lr.canonical_name(c.role): (lr, c) for lr in store.layers.values() for c in lr.components}
        infos, sizes = [], []
        for name in order:
            if name in kept:
                t = kept[name]
                infos.append((name, t.dims, t.ggml_type))
                sizes.append(t.nbytes)
            else:
                lr, c = routed[name]
                infos.append((name, c.dims, c.ggml_type))
                sizes.append(c.expert_bytes * lr.experts)
        offsets = packed_offsets(sizes, raw.alignment)
        directory = b"".join(
            pack_tensor_info(n, d, ty, o) for (n, d, ty), o in zip(infos, offsets, strict=True)
        )
        data_start = align_up(24 + len(raw.kv_block) + len(directory), raw.alignment)
        out_size = store.header.source_size
        if not 0 <= out_size - (data_start + offsets[-1] + sizes[-1]) < raw.alignment:
            raise ForgeError(f"{raw.path}: recorded source size {out_size:,} does not fit the rebuilt layout")

        hasher = HashPipe() if verify else None
        with atomic_output(dest, need_bytes=out_size) as f:
            out = Sink(f.fileno(), hasher)
            out.write(encode_header(len(order), raw.n_kv))
            out.write(raw.kv_block)
            out.write(directory)
            src_fd = os.open(raw.path, os.O_RDONLY)
            try:
                for name, off in zip(order, offsets, strict=True):
                    out.pad_to(data_start + off)
                    if name in kept:
                        t = kept[name]
                        out.copy_from(src_fd, raw.mm, raw.data_start + t.offset, t.nbytes)
                        continue
                    lr, c = routed[name]
                    first = store.store_start + lr.data_offset + c.record_offset
                    for e in range(lr.experts):
                        out.copy_from(src_fd, raw.mm, first + e * lr.stride, c.expert_bytes)
            finally:
                os.close(src_fd)
            out.pad_to(out_size)
            if hasher is not None and hasher.digest() != store.header.source_sha256:
                raise ForgeError(
                    f"{raw.path}: rebuilt canonical file differs from the recorded source SHA-256"
                )
    return ConvertResult(Path(dest), out_size, store.header.source_sha256.hex(), None, verify)


def convert(
    src: str | os.PathLike[str], dest: str | os.PathLike[str], to: str, verify: bool = True
) -> ConvertResult:
    """``to``: "v2", "v1" or "canonical"."""
    if to == "canonical":
        return to_canonical(src, dest, verify)
    if to in ("v1", "v2"):
        return to_expert_major(src, dest, int(to[1]), verify)
    raise ForgeError(f"unknown layout {to!r} (v2, v1 or canonical)")
