"""The type table (forge/ggml_types.py): every capability it claims holds, for every type that claims it
(the type lists come from the table), and MXFP4 is bit-exact with llama.cpp."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import numpy as np
import oracle
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from forge import ggml_types
from forge.errors import ForgeError
from forge.quant.types import get_type

#: gguf-py ignores IQ1_M's per-group delta sign (the numpy decoder goes through it); the torch decoder follows
#: ggml, which tests/test_dequant.py checks value by value
GGUF_PY_DIFFERS = {T.IQ1_M}


def _rows(qtype: T, n_rows: int, n_per_row: int, seed: int) -> np.ndarray:
    """Well-formed encoded rows: random values (mixed magnitudes, zeros, ties) through the numpy encoder."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_rows, n_per_row)).astype(np.float32)
    x *= np.float32(10.0) ** rng.integers(-4, 3, (n_rows, 1)).astype(np.float32)
    x[0, :32] = 0
    importance = rng.random(n_per_row).astype(np.float32) + 0.1
    return get_type(qtype).encode(x, importance)


def _n_per_row(qtype: T) -> int:
    return 2 * max(256, GGML_QUANT_SIZES[qtype][0])


@pytest.mark.parametrize("qtype", ggml_types.types_with("numpy"), ids=lambda t: t.name)
def test_numpy_codec_geometry_is_ggmls(qtype: T) -> None:
    qt = get_type(qtype)
    assert (qt.block_size, qt.type_size) == ggml_types.geometry(qtype) == GGML_QUANT_SIZES[qtype]
    n = _n_per_row(qtype)
    data = _rows(qtype, 3, n, seed=1)
    assert data.shape == (3, qt.row_bytes(n)) and data.dtype == np.uint8
    assert qt.decode(data, n).shape == (3, n)


@pytest.mark.parametrize("qtype", ggml_types.types_with("torch"), ids=lambda t: t.name)
def test_torch_decoder_equals_numpy_decoder(qtype: T) -> None:
    from runtime.dequant import dequantize

    if qtype in GGUF_PY_DIFFERS:
        pytest.skip("gguf-py's decoder is not ggml's here (see GGUF_PY_DIFFERS)")
    assert ggml_types.supports("numpy", qtype), (
        f"{qtype.name} decodes in the runtime but the registry has no codec"
    )
    n = _n_per_row(qtype)
    data = _rows(qtype, 4, n, seed=2)
    got = dequantize(torch.from_numpy(data), qtype, n).numpy()
    want = get_type(qtype).decode(data, n)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("qtype", ggml_types.types_with("cpu_rows"), ids=lambda t: t.name)
def test_cpu_rows_decode_and_dot_equal_numpy(qtype: T) -> None:
    pytest.importorskip("numba")
    from runtime.cpu_rows import decode_row, dot_row, group_sums

    n = _n_per_row(qtype)
    data = _rows(qtype, 3, n, seed=3)
    want = get_type(qtype).decode(data, n)
    x = np.random.default_rng(4).standard_normal(n).astype(np.float32)
    xsum = np.empty(n // 32, np.float32)
    group_sums(x, xsum)
    row, scratch = np.empty(n, np.float32), np.empty(n, np.float32)
    type_id = ggml_types.implementation("cpu_rows", qtype)
    for r in range(len(data)):
        decode_row(data[r], type_id, row)
        assert np.array_equal(row.view(np.uint32), want[r].view(np.uint32)), r
        exact = float(want[r].astype(np.float64) @ x.astype(np.float64))
        bound = 1e-5 * float(np.abs(want[r]).astype(np.float64) @ np.abs(x).astype(np.float64))
        assert abs(dot_row(data[r], type_id, x, xsum, scratch) - exact) <= bound, r


@pytest.mark.parametrize("qtype", ggml_types.types_with("compiled"), ids=lambda t: t.name)
def test_compiled_encoder_equals_numpy_encoder(qtype: T, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("numba")
    from forge.quant.kernels import kernel

    qt = get_type(qtype)
    n = _n_per_row(qtype)
    x = np.random.default_rng(5).standard_normal((2, n)).astype(np.float32)
    w = np.random.default_rng(6).random(n).astype(np.float32) + 0.1
    imp = w if qt.uses_imatrix else None
    want = qt._encode_chunk.fallback(x, imp)
    assert np.array_equal(kernel(ggml_types.implementation("compiled", qtype))(x, imp), want)


@pytest.mark.parametrize("qtype", ggml_types.types_with("gpu_encode"), ids=lambda t: t.name)
def test_gpu_encoder_equals_numpy_encoder_on_torch_cpu(qtype: T) -> None:
    from forge.quant.torch_codecs import encode_on_device

    n = 512
    x = np.random.default_rng(7).standard_normal((3, n)).astype(np.float32)
    w = np.random.default_rng(8).random(n).astype(np.float32) + 0.1
    assert np.array_equal(encode_on_device(qtype.name, x, w, "cpu"), get_type(qtype).encode(x, w))


def test_cuda_kernel_types_have_a_torch_decoder() -> None:
    """The kernels decode the file bytes and fall back to the torch decoder: a kernel type without one
    (or a float type without its dtype) could not be checked against anything."""
    cuda = ggml_types.types_with("cuda")
    assert cuda
    for qtype in cuda:
        assert ggml_types.supports("torch", qtype), qtype.name


def test_lookups_and_refusals() -> None:
    assert ggml_types.ggml_type("mxfp4") == T.MXFP4 == ggml_types.ggml_type(39)
    assert ggml_types.bits_per_weight(T.MXFP4) == 8 * 17 / 32
    assert not ggml_types.supports("torch", 10_000)
    with pytest.raises(ForgeError, match="unknown GGUF tensor type"):
        ggml_types.ggml_type("q9_z")
    with pytest.raises(ValueError, match="unknown capability kind"):
        ggml_types.types_with("fpga")
    with pytest.raises(ForgeError, match="not supported"):
        get_type("TQ1_0")


def test_forge_types_json_is_the_table() -> None:
    res = subprocess.run([sys.executable, "-m", "forge", "types", "--json"], capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr
    rows = {r["type"]: r for r in json.loads(res.stdout)}
    heads = {kind: head for head, kind in (*ggml_types.ENCODE_KINDS, *ggml_types.DECODE_KINDS)}
    for kind, head in heads.items():
        for qtype in ggml_types.types_with(kind):
            column = "encode" if (head, kind) in ggml_types.ENCODE_KINDS else "decode"
            assert head in rows[qtype.name][column], (qtype.name, kind)
    assert rows["MXFP4"]["bits_per_weight"] == 4.25


# ------------------------------------------------------------------------------------ MXFP4 vs llama.cpp


def _mxfp4_edge_rows() -> np.ndarray:
    """Blocks whose largest magnitude is a power of two or one ulp either side of it (where log2f rounds),
    values on the midpoints between FP4 levels (ties go to the first level), zeros and signed zeros."""
    rng = np.random.default_rng(9)
    p = np.ldexp(np.float32(1), rng.integers(-30, 30, 1024)).astype(np.float32)
    blocks = []
    for amax in (p, np.nextafter(p, np.float32(0)), np.nextafter(p, np.float32(np.inf))):
        b = rng.uniform(-1, 1, (len(p), 32)).astype(np.float32) * p[:, None]
        b[:, 5] = -amax
        d = np.ldexp(np.float32(1), np.floor(np.log2(amax.astype(np.float64))).astype(int) - 3).astype(
            np.float32
        )
        b[:, 7:15] = np.array([0.5, 1.5, 2.5, 3.5, 5, 7, 10, -0.5], np.float32) * d[:, None]
        b[:, 16], b[:, 17] = 0.0, -0.0
        blocks.append(b)
    return np.concatenate(blocks).reshape(-1, 256)


def test_mxfp4_matches_libggml() -> None:
    lib = oracle.libggml()
    rows = np.concatenate([_mxfp4_edge_rows(), _rows_float(seed=10)])
    qt = get_type("MXFP4")
    want = np.zeros((len(rows), qt.row_bytes(rows.shape[1])), np.uint8)
    lib.ggml_quantize_init(int(T.MXFP4))
    lib.ggml_quantize_chunk(
        int(T.MXFP4), rows.ctypes.data, want.ctypes.data, 0, len(rows), rows.shape[1], None
    )
    assert np.array_equal(qt.encode(rows), want)


def _rows_float(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((64, 256)) * np.float32(10.0) ** rng.integers(-6, 4, (64, 1))).astype(
        np.float32
    )


def _experts(proj: str, layer: int) -> np.ndarray:
    """(n_expert, rows, cols) float32 of one layer's expert projections, read straight from the shards."""
    from safetensors import safe_open

    folder = oracle.model_dir("tiny-qwen3moe")
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    prefix, suffix = f"model.layers.{layer}.mlp.experts.", f".{proj}_proj.weight"
    keys = sorted((k for k in weight_map if k.startswith(prefix) and k.endswith(suffix)),
                  key=lambda k: int(k[len(prefix) :].split(".")[0]))  # fmt: skip
    out = []
    for key in keys:
        with safe_open(folder / weight_map[key], "pt") as f:
            out.append(f.get_tensor(key).float().numpy())
    return np.stack(out)


def test_mxfp4_expert_tensor_bit_exact_with_llama_quantize() -> None:
    """blk.0.ffn_up_exps of tiny-qwen3moe, as llama-quantize MXFP4_MOE wrote it (the manifest's SHA-256)."""
    name = "blk.0.ffn_up_exps.weight"
    entry = oracle.manifest_tensor("tiny-qwen3moe", "MXFP4_MOE", name)
    assert entry["type"] == "MXFP4"
    weights = _experts("up", layer=0)
    data = get_type("MXFP4").encode(weights.reshape(-1, weights.shape[-1])).tobytes()
    assert len(data) == entry["nbytes"]
    assert hashlib.sha256(data).hexdigest() == entry["sha256"]


def test_mxfp4_decoders_agree_with_gguf_py_on_every_code_and_scale() -> None:
    """Every exponent byte (subnormal scales included) with every pair of codes, through the torch decoder."""
    from gguf.quants import dequantize as gguf_dequantize

    from runtime.dequant import dequantize

    e = np.repeat(np.arange(256, dtype=np.uint8), 16)
    codes = np.tile(np.arange(256, dtype=np.uint8).reshape(16, 16), (256, 1))  # every byte under every e
    blocks = np.concatenate([e[:, None], codes], axis=1)
    got = dequantize(torch.from_numpy(blocks), T.MXFP4, 32).numpy()
    with np.errstate(over="ignore"):  # 12 x 2^127 is inf in both
        want = gguf_dequantize(blocks, T.MXFP4).astype(np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
