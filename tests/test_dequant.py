"""runtime.dequant against gguf.quants.dequantize (numpy) and llama.cpp's fixture files."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf import quants as gq

from forge import ggml_types
from forge.errors import ForgeError
from runtime.dequant import dequantize, supported_types
from runtime.synth import fp16_fields
from tests import oracle

T = GGMLQuantizationType
#: every type the runtime decodes (the type table's ``torch`` kind)
EXPECTED_TYPES = set(ggml_types.types_with("torch"))
QUANT_TYPES = sorted(EXPECTED_TYPES - {T.F32, T.F16, T.BF16}, key=int)
SHAPES = [(1,), (3,), (2, 5)]  # leading dims (rows, or batch x rows)
FIXTURE_FILES = ("Q8_0", "Q4_K_M-imat", "IQ2_XXS-imat")


def moderate_fp16(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Finite fp16 values of ordinary size (some subnormal ones too), as uint16 bit patterns."""
    return (rng.standard_normal(shape) * 0.02).astype(np.float16).view(np.uint16)


def random_rows(
    qtype: GGMLQuantizationType, lead: tuple[int, ...], n_blocks: int, seed: int = 0
) -> np.ndarray:
    """Random valid rows: random bytes with every fp16 scale field replaced by a moderate value."""
    rng = np.random.default_rng([int(qtype), n_blocks, *lead, seed])
    _, type_size = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (*lead, n_blocks * type_size), dtype=np.uint8)
    if qtype in (T.F32, T.F16, T.BF16):
        return data
    blocks = data.reshape(*lead, n_blocks, type_size)
    for off in fp16_fields(qtype) or ():
        blocks[..., off : off + 2] = moderate_fp16(rng, (*lead, n_blocks, 1)).view(np.uint8)
    if qtype == T.IQ1_M:
        # the fp16 scale lives in the top nibbles of the four uint16 scale words (bytes 49, 51, 53, 55)
        d = moderate_fp16(rng, (*lead, n_blocks))
        for k in range(4):
            nibble = ((d >> (4 * k)) & 0xF).astype(np.uint8)
            blocks[..., 49 + 2 * k] = (blocks[..., 49 + 2 * k] & 0x0F) | (nibble << 4)
    if qtype == T.MXFP4:  # E8M0 scale bytes of ordinary size (subnormal ones too)
        blocks[..., 0] = rng.choice(np.array([0, 1, 2, 100, 120, 127, 140], np.uint8), (*lead, n_blocks))
    return data


def assert_bit_equal(actual: np.ndarray, expected: np.ndarray) -> None:
    """Same shape and same float32 bit patterns (NaNs only need to be NaN in the same places)."""
    assert actual.shape == expected.shape
    assert actual.dtype == expected.dtype == np.float32
    nan_a, nan_e = np.isnan(actual), np.isnan(expected)
    np.testing.assert_array_equal(nan_a, nan_e)
    a, e = actual.view(np.uint32)[~nan_a], expected.view(np.uint32)[~nan_e]
    if not np.array_equal(a, e):
        bad = np.flatnonzero(a != e)
        raise AssertionError(
            f"{bad.size} of {a.size} values differ, first at {bad[0]}: "
            f"{actual[~nan_a][bad[0]]!r} vs {expected[~nan_e][bad[0]]!r}"
        )


def decode(data: np.ndarray, qtype: GGMLQuantizationType, device: str = "cpu") -> np.ndarray:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_per_row = data.shape[-1] // type_size * block_size
    out = dequantize(torch.from_numpy(data).to(device), qtype, n_per_row)
    assert out.dtype == torch.float32 and out.device.type == device
    return out.cpu().numpy()


def test_supported_types_are_the_quantizers_types() -> None:
    types = supported_types()
    assert set(types) == set(ggml_types.types_with("numpy"))
    assert types == sorted(types, key=int)


@pytest.mark.parametrize("lead", SHAPES, ids=str)
@pytest.mark.parametrize("qtype", sorted(EXPECTED_TYPES - {T.IQ1_M}, key=int), ids=lambda t: t.name)
def test_matches_gguf_py(qtype: GGMLQuantizationType, lead: tuple[int, ...]) -> None:
    for n_blocks in (1, 3):
        data = random_rows(qtype, lead, n_blocks)
        assert_bit_equal(decode(data, qtype), gq.dequantize(data, qtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_tensor_spanning_several_decode_steps(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    import runtime.dequant

    monkeypatch.setattr(runtime.dequant, "_CPU_STEP", 7 * 256)  # 7 blocks a step; 29 x 37 leaves a remainder
    data = random_rows(T.Q4_K, (37,), 29)
    got = dequantize(torch.from_numpy(data), T.Q4_K, 29 * 256, dtype=dtype)
    assert got.dtype == dtype
    expected = gq.dequantize(data, T.Q4_K)
    if dtype == torch.float16:
        expected = expected.astype(np.float16).astype(np.float32)
    assert_bit_equal(got.float().numpy(), expected)


def iq1_m_scalar_reference(block: bytes) -> list[float]:
    """IQ1_M decoded one value at a time, as ggml's dequantize_row_iq1_m does.

    gguf-py's IQ1_M dequantizer always uses -delta (``qh & 0x08 == 0`` parses as ``qh & False``);
    ggml uses -delta only where the group's delta bit is set. This reference follows ggml.
    """
    qs, qh, sc = (
        block[0:32],
        block[32:48],
        [int.from_bytes(block[48 + 2 * k : 50 + 2 * k], "little") for k in range(4)],
    )
    d_bits = (sc[0] >> 12) | ((sc[1] >> 8) & 0x00F0) | ((sc[2] >> 4) & 0x0F00) | (sc[3] & 0xF000)
    d = np.uint16(d_bits).view(np.float16).astype(np.float32)
    gq.IQ1_S.init_grid()
    grid = gq.IQ1_S.grid.reshape(2048, 8)
    out = []
    for ib in range(8):
        for group in range(4):
            scale = (sc[ib // 2] >> (6 * (ib % 2) + 3 * (group // 2))) & 7
            dl = d * np.float32(2 * scale + 1)
            nibble = (qh[2 * ib + group // 2] >> (4 * (group % 2))) & 0xF
            index = qs[4 * ib + group] | ((nibble & 7) << 8)
            delta = np.float32(-0.125 if nibble & 8 else 0.125)
            out += [dl * (grid[index, j] + delta) for j in range(8)]
    return out


@pytest.mark.parametrize("lead", SHAPES, ids=str)
def test_iq1_m_matches_ggml(lead: tuple[int, ...]) -> None:
    data = random_rows(T.IQ1_M, lead, 2)
    got = decode(data, T.IQ1_M)
    blocks = data.reshape(-1, 56)
    expected = np.array([iq1_m_scalar_reference(bytes(b)) for b in blocks], dtype=np.float32)
    assert_bit_equal(got, expected.reshape(got.shape))
    # where every delta bit is set, gguf-py's (always -delta) answer is the right one as well
    data.reshape(-1, 56)[:, 32:48] |= 0x88
    assert_bit_equal(decode(data, T.IQ1_M), gq.dequantize(data, T.IQ1_M))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16, T.Q4_0, T.Q6_K, T.IQ2_XXS], ids=lambda t: t.name)
def test_output_dtype_is_the_float32_result_cast(qtype: GGMLQuantizationType, dtype: torch.dtype) -> None:
    data = torch.from_numpy(random_rows(qtype, (3,), 2))
    n = data.shape[-1] // GGML_QUANT_SIZES[qtype][1] * GGML_QUANT_SIZES[qtype][0]
    got = dequantize(data, qtype, n, dtype=dtype)
    assert got.dtype == dtype
    assert torch.equal(got.isnan(), dequantize(data, qtype, n).to(dtype).isnan())
    assert torch.equal(got.nan_to_num(), dequantize(data, qtype, n).to(dtype).nan_to_num())


def test_non_contiguous_and_empty_inputs() -> None:
    data = random_rows(T.Q5_K, (4, 6), 2)
    view = torch.from_numpy(data).transpose(0, 1)[::2]
    assert_bit_equal(
        dequantize(view, T.Q5_K, 512).numpy(), gq.dequantize(np.ascontiguousarray(view.numpy()), T.Q5_K)
    )
    assert dequantize(torch.empty((0, 352), dtype=torch.uint8), T.Q5_K, 512).shape == (0, 512)
    f32 = torch.from_numpy(random_rows(T.F32, (1,), 9)).reshape(-1)[4:]  # misaligned float32 view
    assert_bit_equal(dequantize(f32, T.F32, 8).numpy(), gq.dequantize(f32.numpy().copy(), T.F32))


def test_result_does_not_alias_the_input() -> None:
    raw = torch.from_numpy(random_rows(T.F32, (2,), 4))
    out = dequantize(raw, T.F32, 4)
    out.fill_(0)
    assert raw.any()


@pytest.mark.parametrize("qtype", [T.Q8_1, T.Q8_K, T.TQ1_0, T.I32])
def test_unsupported_type_is_a_forge_error_naming_it(qtype: GGMLQuantizationType) -> None:
    with pytest.raises(ForgeError, match=qtype.name):
        dequantize(torch.zeros((1, 64), dtype=torch.uint8), qtype, 32)


def test_bad_shapes_are_forge_errors() -> None:
    with pytest.raises(ForgeError, match="bytes"):
        dequantize(torch.zeros((2, 35), dtype=torch.uint8), T.Q8_0, 32)
    with pytest.raises(ForgeError, match="block"):
        dequantize(torch.zeros((2, 34), dtype=torch.uint8), T.Q8_0, 31)
    with pytest.raises(ForgeError, match="uint8"):
        dequantize(torch.zeros((2, 34), dtype=torch.int8), T.Q8_0, 32)


def fixture_tensors(name: str) -> list[tuple[str, GGMLQuantizationType, np.ndarray, int]]:
    path = oracle.llamacpp_dir("tiny-qwen3moe") / f"tiny-qwen3moe-{name}.gguf"
    if not path.is_file():
        pytest.skip(f"{path} is absent")
    out = []
    for t in GGUFReader(path).tensors:
        raw = np.asarray(t.data).view(np.uint8)
        n_per_row = int(t.shape[0])
        block_size, type_size = GGML_QUANT_SIZES[t.tensor_type]
        out.append((t.name, t.tensor_type, raw.reshape(-1, n_per_row // block_size * type_size), n_per_row))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", FIXTURE_FILES)
def test_llamacpp_fixture_tensors_decode_like_gguf_py(name: str) -> None:
    tensors = fixture_tensors(name)
    assert tensors
    for tensor_name, qtype, raw, n_per_row in tensors:
        got = dequantize(torch.from_numpy(raw.copy()), qtype, n_per_row).numpy()
        try:
            assert_bit_equal(got, gq.dequantize(raw, qtype).reshape(got.shape))
        except AssertionError as e:
            raise AssertionError(f"{tensor_name} ({qtype.name}): {e}") from None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qtype", sorted(EXPECTED_TYPES, key=int), ids=lambda t: t.name)
def test_cuda_matches_cpu(qtype: GGMLQuantizationType) -> None:
    data = random_rows(qtype, (7, 5), 3)
    assert_bit_equal(decode(data, qtype, "cuda"), decode(data, qtype))
