"""A quantize that has read a tensor from its mapped source drops those pages from its resident set
(``fileio.drop_pages``), so its RSS is bounded by what it holds, not by how much of the source it has read."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from forge.fileio import drop_pages

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")


def _mapping_rss(path: Path) -> int:
    """Resident bytes of this process's mappings of ``path`` (/proc/self/smaps)."""
    rss, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[:1].isalnum() and "-" in line.split()[0]:
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            rss += int(line.split()[1]) * 1024
    return rss


@linux
def test_dropped_pages_leave_the_resident_set_and_read_back_the_same(tmp_path: Path) -> None:
    path = tmp_path / "source.bin"
    data = np.random.default_rng(0).integers(0, 256, 32 << 20, dtype=np.uint8)
    data.tofile(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    assert int(mm[::4096].sum()) >= 0  # touch every page
    assert _mapping_rss(path) >= 30 << 20
    drop_pages(mm, 1000, (16 << 20) - 1000)  # the first half, from an unaligned offset
    assert _mapping_rss(path) <= (17 << 20)
    drop_pages(mm, 16 << 20, 16 << 20)
    assert _mapping_rss(path) <= (1 << 20)
    np.testing.assert_array_equal(np.asarray(mm), data)  # read again from the page cache


def test_arrays_that_are_not_mappings_are_left_alone() -> None:
    a = np.arange(10, dtype=np.uint8)
    drop_pages(a, 0, 10)
    assert a.tolist() == list(range(10))


@linux
@pytest.mark.parametrize("kind", ["hf", "gguf"])
def test_a_quantize_source_drops_what_it_read(kind: str, example_bf16: Path) -> None:
    """Every tensor of the bundled model read as float32 and digested, as a quantize does, from the Hugging
    Face folder and from its bf16 GGUF: what stays resident of the source's mappings is a small remainder
    (pages the kernel maps around a fault), not the source (before: all of it)."""
    from conftest import EXAMPLE

    from forge.quant.jobs import open_source
    from forge.quant.source import source_ref

    where = EXAMPLE if kind == "hf" else example_bf16
    src = open_source(source_ref(where))
    for t in src.tensors():
        src.digest(t.name)
        src.float32(t.name)
    files = sorted(EXAMPLE.glob("*.safetensors")) if kind == "hf" else [example_bf16]
    total = sum(f.stat().st_size for f in files)
    assert sum(_mapping_rss(f) for f in files) < total // 10


def test_bf16_widening_and_finite_check_on_every_core_equal_numpys() -> None:
    """forge.bulk's threaded passes (above the size where they start threads) give numpy's results: the exact
    float32 of every bf16 pattern (NaNs and infinities too), into a given array as well, and the finite check
    finds a single NaN or infinity anywhere."""
    from forge.bulk import _SMALL, all_finite, bf16_to_f32

    rng = np.random.default_rng(0)
    bits = rng.integers(0, 1 << 16, size=(3, _SMALL), dtype=np.uint16)
    want = (bits.astype(np.uint32) << 16).view(np.float32)
    assert np.array_equal(bf16_to_f32(bits).view(np.uint32), want.view(np.uint32))
    out = np.empty((2, *bits.shape), np.float32)
    bf16_to_f32(bits, out[1])
    assert np.array_equal(out[1].view(np.uint32), want.view(np.uint32))
    x = rng.standard_normal(2 * _SMALL).astype(np.float32)
    assert all_finite(x)
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[rng.integers(y.size)] = bad
        assert not all_finite(y)


@pytest.mark.parametrize("qtype", ["BF16", "F16", "F32", "Q8_0"])
def test_stored_values_decode_as_ggufs_decoder(qtype: str) -> None:
    """``float32_values`` (what the quantizer reads a GGUF source's tensors with) equals gguf's decoder bit for
    bit on the stored bytes (every bf16 pattern, large enough for the threaded widening), flat."""
    from gguf import GGMLQuantizationType, quants

    from forge.bulk import _SMALL, float32_values

    t = GGMLQuantizationType[qtype]
    rng = np.random.default_rng(1)
    if t == GGMLQuantizationType.BF16:
        stored = rng.integers(0, 1 << 16, size=2 * _SMALL, dtype=np.uint16).view(np.uint8)
    else:
        x = rng.standard_normal((64, 256)).astype(np.float32)
        stored = quants.quantize(x, t).view(np.uint8).reshape(-1)
    got = float32_values(stored, t)
    want = quants.dequantize(stored, t).reshape(-1)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))


def test_bf16_rounding_on_every_core_equals_ggmls() -> None:
    """``f32_to_bf16`` above the threaded size and below it: gguf's encoder (ggml's rounding: nearest even,
    NaNs kept NaN with the quiet bit set) bit for bit, on every kind of float32 pattern."""
    from gguf import GGMLQuantizationType, quants

    from forge.bulk import _SMALL, f32_to_bf16

    rng = np.random.default_rng(3)
    bits = rng.integers(0, 1 << 32, size=2 * _SMALL, dtype=np.uint64).astype(np.uint32)
    bits[:6] = [0x3F808000, 0x3F818000, 0xBF808000, 0x7F7FFFFF, 0x7FC00001, 0xFF800001]  # ties, max, NaNs
    values = bits.view(np.float32).reshape(2, -1)
    want = quants.quantize(values, GGMLQuantizationType.BF16).view(np.uint16)
    for x in (values, values[:, : _SMALL // 8]):
        got = f32_to_bf16(x)
        assert got.dtype == np.uint16 and got.shape == x.shape
        assert np.array_equal(got, want[:, : x.shape[1]])
