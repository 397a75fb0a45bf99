"""Float, legacy and K-quant codecs: bit-exact against llama.cpp's outputs, plus properties."""

from __future__ import annotations

import hashlib
import re
import struct

import numpy as np
import pytest
from gguf import quants as gguf_quants

from forge.errors import ForgeError
from forge.quant import numerics as nx
from forge.quant.types import get_type
from tests import oracle

MODEL = "tiny-qwen3moe"
MINE = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
MANIFESTS = ["Q8_0", "Q4_0", "Q6_K", "Q4_K_M", "Q4_K_S", "Q5_K_M", "Q3_K_M", "Q2_K", "bf16", "f32"]
MANIFESTS += ["Q4_K_M-imat", "Q3_K_M-imat", "Q2_K-imat"]
# tensors small enough for the fast run (every type and both paths still appear in it)
FAST = ("blk.0.attn_k.weight", "blk.0.attn_v.weight", "blk.3.attn_v.weight", "blk.0.attn_norm.weight")


def _fixture_cases() -> list:
    cases = []
    for man in MANIFESTS:
        if man not in oracle.manifest_names(MODEL):
            continue
        for t in oracle.manifest(MODEL, man)["tensors"]:
            if t["type"] not in MINE:
                continue
            marks = () if t["name"] in FAST else (pytest.mark.slow,)
            cases.append(pytest.param(man, t["name"], id=f"{man}:{t['name']}", marks=marks))
    return cases or [pytest.param("", "", id="no-fixtures")]


def _encode_like_llama_quantize(qtype: type, x: np.ndarray, weights: np.ndarray | None) -> bytes:
    """A 3-D expert tensor is quantized expert by expert, each with its own importance row."""
    if x.ndim == 1:
        x = x.reshape(1, -1)
    if x.ndim == 2:
        return qtype.encode(x, None if weights is None else weights[0]).tobytes()
    parts = [qtype.encode(x[e], None if weights is None else weights[e]) for e in range(x.shape[0])]
    return b"".join(p.tobytes() for p in parts)


@pytest.mark.parametrize(("manifest", "tensor"), _fixture_cases())
def test_bit_exact_with_llamacpp(manifest: str, tensor: str) -> None:
    if not manifest:
        oracle.fixtures()  # skips without fixtures
        pytest.skip("no manifest with our types")
    expected = oracle.manifest_tensor(MODEL, manifest, tensor)
    qtype = get_type(expected["type"])
    weights = None
    if manifest.endswith("-imat") and qtype.uses_imatrix:
        weights = oracle.llamacpp_importance(MODEL).get(tensor)
    data = _encode_like_llama_quantize(qtype, oracle.qwen3moe_tensor(tensor), weights)
    assert len(data) == expected["nbytes"]
    assert hashlib.sha256(data).hexdigest() == expected["sha256"]


# --------------------------------------------------------------------------------------------------
# properties on random data

QUANTS = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


def _awkward_rows(scale: float, n_per_row: int = 512) -> np.ndarray:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((6, n_per_row)).astype(np.float32) * np.float32(scale)
    x[0] = 0  # all zero
    x[1] = np.float32(scale)  # constant
    x[2, :256] = -np.float32(scale)  # constant negative super-block, random after it
    x[3, ::7] = 0  # sparse zeros
    x[4] = np.abs(x[4])  # all positive
    return x


@pytest.mark.parametrize("name", QUANTS)
@pytest.mark.parametrize("scale", [1.0, 3e3, 1e-3, 1e-6])
@pytest.mark.parametrize("weighted", [False, True])
def test_decode_agrees_with_gguf_and_error_is_bounded(name: str, scale: float, weighted: bool) -> None:
    qtype = get_type(name)
    x = _awkward_rows(scale)
    weights = np.random.default_rng(3).uniform(0.01, 5, x.shape[1]).astype(np.float32) if weighted else None
    data = qtype.encode(x, weights)
    assert data.dtype == np.uint8 and data.shape == (x.shape[0], qtype.row_bytes(x.shape[1]))
    ours = qtype.decode(data, x.shape[1])
    theirs = gguf_quants.dequantize(data, qtype.ggml_type).reshape(x.shape)
    np.testing.assert_array_equal(ours, theirs)
    assert np.isfinite(ours).all()
    np.testing.assert_array_equal(ours[0], 0)  # an all-zero row stays exactly zero
    if scale >= 1.0:  # fp16 super-block scales are normal numbers here (not subnormal)
        blocks = x.reshape(-1, 32)
        err = np.abs(ours.reshape(-1, 32) - blocks).max(axis=1)
        spread = np.ptp(blocks, axis=1) + np.abs(blocks).max(axis=1)
        bits = {"Q8_0": 8, "Q6_K": 6, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q4_0": 4, "Q4_1": 4, "Q4_K": 4}
        levels = 2 ** bits.get(name, 2)
        # at most about one quantization step of the block's range, with slack for the scale's own rounding
        assert (err <= 2.5 * spread / (levels - 1) + 1e-12).all()


def test_rmse_ordering_on_gaussian_data() -> None:
    x = np.random.default_rng(11).standard_normal((64, 1024)).astype(np.float32)
    order = ["Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K"]
    rmse = []
    for name in order:
        qtype = get_type(name)
        y = qtype.decode(qtype.encode(x), x.shape[1])
        rmse.append(float(np.sqrt(np.mean((y - x) ** 2))))
    assert rmse == sorted(rmse), dict(zip(order, rmse, strict=True))
    assert rmse[0] < 0.01 < rmse[-1]


@pytest.mark.parametrize("name", QUANTS)
def test_nan_and_inf_are_rejected(name: str) -> None:
    qtype = get_type(name)
    x = np.ones((2, 256), np.float32)
    x[1, 5] = np.nan
    with pytest.raises(ForgeError, match="NaN"):
        qtype.encode(x)
    x[1, 5] = np.inf
    with pytest.raises(ForgeError, match="infinite"):
        qtype.encode(x)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_K"])
def test_bad_shapes_are_rejected(name: str) -> None:
    qtype = get_type(name)
    with pytest.raises(ForgeError, match="multiple of the block size"):
        qtype.encode(np.ones((2, 40), np.float32))
    with pytest.raises(ForgeError, match="importance"):
        qtype.encode(np.ones((2, 256), np.float32), np.ones(128, np.float32))
    with pytest.raises(ForgeError, match="2-D"):
        qtype.encode(np.ones(256, np.float32))


def test_q8_0_ignores_importance_and_matches_gguf_quantizer() -> None:
    x = np.random.default_rng(5).standard_normal((8, 256)).astype(np.float32)
    q8 = get_type("Q8_0")
    np.testing.assert_array_equal(q8.encode(x), q8.encode(x, np.arange(256, dtype=np.float32)))
    np.testing.assert_array_equal(q8.encode(x), gguf_quants.quantize(x, q8.ggml_type))


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_legacy_reference_path_matches_gguf_quantizer(name: str) -> None:
    qtype = get_type(name)
    x = _awkward_rows(1.0, 256)
    np.testing.assert_array_equal(qtype.encode(x), gguf_quants.quantize(x, qtype.ggml_type))


def test_importance_changes_the_k_quant_encoding() -> None:
    x = np.random.default_rng(2).standard_normal((4, 256)).astype(np.float32)
    w = np.random.default_rng(4).uniform(0, 10, 256).astype(np.float32)
    for name in ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q5_1"]:
        qtype = get_type(name)
        assert not np.array_equal(qtype.encode(x), qtype.encode(x, w)), name


# --------------------------------------------------------------------------------------------------
# floats


def test_bf16_rounds_to_nearest_even_and_quiets_nan() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(9)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32).reshape(400, 500).copy()
    x[0, :4] = [1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), np.float32(3.0e38) * 1.0]  # ties and near-max
    bf16 = get_type("BF16")
    got = bf16.encode(x).view(np.uint16)
    finite = np.isfinite(x)
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(got[finite], want[finite])
    nan_bits = x.view(np.uint32)[np.isnan(x)]
    np.testing.assert_array_equal(got[np.isnan(x)], ((nan_bits >> 16) | 64).astype(np.uint16))
    back = bf16.decode(bf16.encode(x), x.shape[1])
    np.testing.assert_array_equal(np.isnan(back), np.isnan(x))


@pytest.mark.parametrize("name", ["F32", "F16", "BF16"])
def test_float_types_round_trip(name: str) -> None:
    qtype = get_type(name)
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    back = qtype.decode(qtype.encode(x), 64)
    ref = gguf_quants.dequantize(qtype.encode(x), qtype.ggml_type).reshape(x.shape)
    np.testing.assert_array_equal(back, ref)
    tol = {"F32": 0, "F16": 1e-3, "BF16": 1e-2}[name]
    np.testing.assert_allclose(back, x, rtol=tol, atol=0)


# --------------------------------------------------------------------------------------------------
# numerics


def test_seq_sum_is_sequential_float32() -> None:
    rng = np.random.default_rng(0)
    for cols in (1, 3, 15, 16, 17, 64, 255, 5000):
        t = (rng.standard_normal((32, cols)) * rng.uniform(0, 1e4, (1, cols))).astype(np.float32)
        ref = np.zeros(cols, np.float32)
        for row in t:
            ref += row
        np.testing.assert_array_equal(nx.seq_sum(t), ref)


def test_nearest_int_is_ggml_bit_trick() -> None:
    v = np.array([0.5, 1.5, 2.5, -0.5, -1.5, 3.49999, -7.5, 4194303.0, 1e7, -1e9], np.float32)
    got = nx.nearest_int(v)
    np.testing.assert_array_equal(got[:8], np.rint(v[:8]).astype(np.int32))
    # beyond 2**22 ggml's trick wraps: reproduce it with plain integer arithmetic on the float's bits
    for val, g in zip(v[8:], got[8:], strict=True):
        (b,) = struct.unpack("<i", struct.pack("<f", np.float32(val) + np.float32(12582912.0)))
        assert g == (b & 0x7FFFFF) - 0x400000


def _qp_scalar(x: list[float], nmax: int, w: list[float]) -> tuple[float, list[int]]:
    """ggml make_qp_quants transcribed one element at a time, float32 throughout (independent check)."""
    f = np.float32
    n = len(x)
    mx = f(0)
    for v in x:
        mx = max(mx, f(v))
    if mx < f(1e-15):
        return 0.0, [0] * n

    def ni(v: np.float32) -> int:
        return int(nx.nearest_int(np.array([v], np.float32))[0])

    iscale = f(nmax) / mx
    levels = [ni(iscale * f(v)) for v in x]
    scale = f(1) / iscale
    best = f(0)
    for i in range(n):
        diff = f(x[i]) - scale * f(levels[i])
        best = f(best + f(w[i]) * diff * diff)
    for step in range(-4, 5):
        if step == 0:
            continue
        isc = (f(0.1) * f(step) + f(nmax)) / mx
        sc = f(1) / isc
        mse = f(0)
        for i in range(n):
            lv = min(nmax, ni(isc * f(x[i])))
            diff = f(x[i]) - sc * f(lv)
            mse = f(mse + f(w[i]) * diff * diff)
        if mse < best:
            best, iscale = mse, isc
    sumlx = suml2 = f(0)
    levels = []
    for i in range(n):
        lv = min(nmax, ni(iscale * f(x[i])))
        levels.append(lv)
        sumlx = f(sumlx + f(w[i]) * f(x[i]) * f(lv))
        suml2 = f(suml2 + f(w[i]) * f(lv) * f(lv))
    for _ in range(5):
        changed = 0
        for i in range(n):
            wi, xi = f(w[i]), f(x[i])
            slx = f(sumlx - wi * xi * f(levels[i]))
            sl2 = f(suml2 - wi * f(levels[i]) * f(levels[i]))
            if slx > 0 and sl2 > 0:
                new_l = min(nmax, ni(xi * sl2 / slx))
                if new_l != levels[i]:
                    slx = f(slx + wi * xi * f(new_l))
                    sl2 = f(sl2 + wi * f(new_l) * f(new_l))
                    if slx * slx * suml2 > sumlx * sumlx * sl2:
                        levels[i], sumlx, suml2 = new_l, slx, sl2
                        changed += 1
        if not changed:
            break
    return float(sumlx / suml2) if suml2 > 0 else 0.0, levels


def test_make_qp_quants_matches_a_scalar_transcription() -> None:
    rng = np.random.default_rng(21)
    x = np.abs(rng.standard_normal((40, 8))).astype(np.float32) * rng.uniform(0.01, 3, (40, 1)).astype(
        np.float32
    )
    x[0] = 0
    w = rng.uniform(0, 4, (40, 8)).astype(np.float32)
    scale, levels = nx.make_qp_quants(x, 63, w)
    for b in range(x.shape[0]):
        s, lv = _qp_scalar(list(x[b]), 63, list(w[b]))
        assert np.float32(s) == scale[b]
        assert list(levels[b]) == lv


# --------------------------------------------------------------------------------------------------
# optional: llama.cpp's own quantizer through ctypes (oracle.libggml: FORGE_LIBGGML); skipped without it


@pytest.mark.parametrize("name", QUANTS)
def test_matches_libggml_on_random_data(name: str) -> None:
    quantize_chunk = oracle.libggml().ggml_quantize_chunk
    qtype = get_type(name)
    rng = np.random.default_rng(17)
    n = 512
    datasets = [
        rng.standard_normal((8, n)),
        rng.standard_t(2, (8, n)),
        rng.integers(-8, 8, (8, n)) / 2,  # exact halves: rounding ties
        _awkward_rows(1e-6, n)[:, :n],
        rng.standard_normal((8, n)) * np.exp(rng.uniform(-8, 8, (8, n // 16, 1))).repeat(16, 1).reshape(8, n),
    ]
    sparse_w = rng.exponential(1, n)
    sparse_w[rng.random(n) < 0.3] = 0
    for x in datasets:
        x = np.ascontiguousarray(x, np.float32)
        for w in (None, rng.uniform(0.01, 3, n), sparse_w):
            w = None if w is None else np.ascontiguousarray(w, np.float32)
            want = np.zeros((x.shape[0], qtype.row_bytes(n)), np.uint8)
            quantize_chunk(
                int(qtype.ggml_type),
                x.ctypes.data,
                want.ctypes.data,
                0,
                x.shape[0],
                n,
                None if w is None else w.ctypes.data,
            )
            np.testing.assert_array_equal(qtype.encode(x, w), want)


@pytest.mark.parametrize("qtype", ["Q6_K", "Q4_K", "IQ4_XS", "IQ2_XXS"])
def test_encode_takes_bf16_bits_and_one_vector_per_matrix(
    qtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What ``forge quantize`` hands a codec: a 3-D tensor's rows as bf16 bits with one importance vector per
    matrix, in one call. The bytes are those of each matrix's float32 values encoded alone, and a NaN or an
    infinity among the bits is refused."""
    from forge.bulk import NON_FINITE, bf16_to_f32

    monkeypatch.setenv("FORGE_THREADS", "3")
    rng = np.random.default_rng(4)
    values = (rng.standard_normal((12, 512)) * rng.uniform(1e-3, 10, (12, 1))).astype(np.float32)
    bits = (values.view(np.uint32) >> 16).astype(np.uint16)
    wide = bf16_to_f32(bits)
    imp = rng.uniform(0.1, 2, (3, 512)).astype(np.float32)
    qt = get_type(qtype)
    want = np.concatenate([qt.encode(wide[4 * g : 4 * g + 4], imp[g]) for g in range(3)])
    assert np.array_equal(qt.encode(bits, imp), want)
    assert np.array_equal(qt.encode(wide, imp), want)
    for bad in (np.nan, np.inf):
        poisoned = bits.copy()
        poisoned[9, 100] = (np.array([bad], np.float32).view(np.uint32) >> 16).astype(np.uint16)[0]
        with pytest.raises(ForgeError, match=re.escape(NON_FINITE)):
            qt.encode(poisoned, imp)


def test_row_chunks_stay_inside_their_group() -> None:
    """Chunks of ``task_elems`` values at most; each lies in one group of rows and is told which."""
    rows = np.repeat(np.arange(10, dtype=np.float32), 4).reshape(10, 4)  # row i holds i
    seen = []

    def encode_chunk(chunk: np.ndarray, group: int) -> np.ndarray:
        seen.append((int(chunk[0, 0]), len(chunk), group))
        return chunk[:, :1].astype(np.uint8)

    out = nx.map_row_chunks(rows, 1, encode_chunk, chunk_elems=4, groups=2, task_elems=12)
    assert out[:, 0].tolist() == list(range(10))
    assert sorted(seen) == [(0, 3, 0), (3, 2, 0), (5, 3, 1), (8, 2, 1)]
