"""Each corruption of an expert-major file is caught by verify and refused by the reader."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import pytest

from forge.errors import ForgeError
from forge.gguf_file import align_up, pack_tensor_info
from forge.layout import store_v1, store_v2
from forge.layout.convert import convert
from forge.layout.gguf_raw import encode_header, open_gguf, packed_offsets
from forge.layout.reader import open_expert_store
from forge.layout.verify import verify_files
from tests.test_layout import mixed_qwen3moe


def _store_start(path: Path) -> int:
    with open_gguf(path) as raw:
        return raw.data_start + raw.tensors[-1].offset


def _patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _read(path: Path, offset: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(n)


def _flip_payload(path: Path, version: int) -> None:
    with open_expert_store(path, verify_payload=False) as store:
        lr = store.layers[1]
        down = lr.components[2]
        at = store.store_start + lr.data_offset + 5 * lr.stride + down.record_offset + 7
    _patch(path, at, bytes([_read(path, at, 1)[0] ^ 0x10]))


def _change_header_field(path: Path, version: int) -> None:
    _patch(path, _store_start(path) + 20, struct.pack("<I", 3))  # experts used: 2 -> 3


def _wrong_manifest_digest(path: Path, version: int) -> None:
    at = _store_start(path) + (170 if version == 2 else 195)  # v2 manifest digest; v1 index digest
    _patch(path, at, bytes([_read(path, at, 1)[0] ^ 0xFF]))


def _overlapping_descriptor(path: Path, version: int) -> None:
    """Move one extent onto another and re-seal every digest, so only the geometry checks can see it."""
    start = _store_start(path)
    if version == 2:
        d1 = start + store_v2.HEADER_BYTES + store_v2.DESCRIPTOR_BYTES  # layer 1's descriptor
        layer0_offset = struct.unpack("<Q", _read(path, start + store_v2.HEADER_BYTES + 16, 8))[0]
        _patch(path, d1 + 16, struct.pack("<Q", layer0_offset + 4096))
        header = bytearray(_read(path, start, 256))
        descriptors = _read(path, start + 256, 3 * store_v2.DESCRIPTOR_BYTES)
        _patch(path, start + 168, store_v2.manifest_digest(bytes(header), descriptors))
    else:
        index_at = start + store_v1.HEADER_BYTES
        entry0_offset = _read(path, index_at, 8)
        _patch(path, index_at + store_v1.ENTRY_BYTES, entry0_offset)  # expert 1 at expert 0's offset
        h = store_v1.HeaderV1.decode(_read(path, start, 256))
        index = _read(path, index_at, h.table_offset - store_v1.HEADER_BYTES)  # type: ignore[operator]
        _patch(path, start + 192, hashlib.sha256(index).digest())
        table = _read(path, start + h.table_offset, 3 * store_v1.TABLE_ENTRY_BYTES)  # type: ignore[operator]
        _patch(path, start + 224, store_v1.table_digest(_read(path, start, 256), table))


def _both_canonical_and_store(path: Path, version: int, src: Path) -> None:
    """Rewrite ``path`` as the canonical tensors plus the store tensor, same KVs."""
    with open_gguf(src) as s, open_gguf(path) as n:
        store = n.tensors[-1]
        parts = [(t.name, t.dims, t.ggml_type, bytes(s.tensor_view(t))) for t in s.tensors]
        parts.append((store.name, store.dims, store.ggml_type, bytes(n.tensor_view(store))))
        kv, n_kv, alignment = bytes(n.kv_block), n.n_kv, n.alignment
    offsets = packed_offsets([len(p[3]) for p in parts], alignment)
    head = encode_header(len(parts), n_kv) + kv
    head += b"".join(
        pack_tensor_info(name, d, ty, o) for (name, d, ty, _), o in zip(parts, offsets, strict=True)
    )
    out = bytearray(head + bytes(align_up(len(head), alignment) - len(head)))
    base = len(out)
    for (_, _, _, data), o in zip(parts, offsets, strict=True):
        out += bytes(base + o - len(out)) + data
    path.write_bytes(bytes(out))


def _truncate(path: Path, version: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 5000])


CASES = {
    # name: (corrupt, verify message, reader message)
    "flipped payload byte": (_flip_payload, "layer 1 expert 5 down", "payload digest mismatch"),
    "changed header field": (_change_header_field, "digest mismatch", "digest mismatch"),
    "wrong manifest digest": (_wrong_manifest_digest, "digest mismatch", "digest mismatch"),
    "overlapping descriptor": (_overlapping_descriptor, "overlap", "overlap"),
    "canonical and store": (None, "both the store", "both the store"),
    "truncated": (_truncate, "truncated", "truncated"),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("corrupt")
    src = mixed_qwen3moe(tmp / "mixed.gguf")
    out = {"src": src}
    for version in ("v2", "v1"):
        out[version] = tmp / f"{version}.gguf"
        convert(src, out[version], version)
    return out


@pytest.mark.parametrize("version", [2, 1])
def test_good_files_pass(built: dict[str, Path], version: int) -> None:
    report = verify_files(built["src"], built[f"v{version}"])
    assert (report.version, report.layers, report.experts) == (version, 3, 8)
    with open_expert_store(built[f"v{version}"]) as store:
        assert store.version == version


@pytest.mark.parametrize("version", [2, 1])
@pytest.mark.parametrize("case", list(CASES))
def test_corruption_is_detected_and_refused(
    built: dict[str, Path], tmp_path: Path, version: int, case: str
) -> None:
    corrupt, verify_msg, reader_msg = CASES[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(built[f"v{version}"].read_bytes())
    if corrupt is None:
        _both_canonical_and_store(path, version, built["src"])
    else:
        corrupt(path, version)
    with pytest.raises(ForgeError, match=verify_msg) as err:
        verify_files(built["src"], path)
    assert "\n" not in str(err.value)
    with pytest.raises(ForgeError, match=reader_msg):
        open_expert_store(path)


def test_version_1_overlap_names_layer_and_expert(built: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(built["v1"].read_bytes())
    _overlapping_descriptor(path, 1)
    with pytest.raises(ForgeError, match="layer 0 expert 1"):
        open_expert_store(path)
