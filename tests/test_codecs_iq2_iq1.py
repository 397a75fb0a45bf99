"""IQ2_XXS / IQ2_XS / IQ2_S / IQ1_S / IQ1_M encoders: bit-exact with llama.cpp, and their properties."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from forge.errors import ForgeError
from forge.quant.iq2_grid import CODE_WEIGHTS, N_CODES, codebook, grid_codes, neighbour_lists
from forge.quant.types import get_type
from tests import oracle

MODEL = "tiny-qwen3moe"
MINE = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M")
MANIFESTS = ("IQ2_XXS-imat", "IQ2_XS-imat", "IQ2_S-imat", "IQ1_S-imat")
#: One small tensor per manifest runs in the default suite; the full sweep is marked slow.
FAST = {"blk.0.attn_k.weight", "blk.0.attn_output.weight"}


def _fixture_cases() -> list:
    cases = []
    for man in MANIFESTS:
        if man not in oracle.manifest_names(MODEL):
            continue
        for t in oracle.manifest(MODEL, man)["tensors"]:
            if t["type"] in MINE:
                marks = () if t["name"] in FAST else (pytest.mark.slow,)
                cases.append(pytest.param(man, t["name"], marks=marks, id=f"{man}:{t['name']}"))
    return cases or [pytest.param(None, None, marks=pytest.mark.skip(reason="fixtures absent"))]


def _encode_like_llama_quantize(qtype: type, weights: np.ndarray, importance: np.ndarray) -> bytes:
    """llama-quantize quantizes a 3-D expert tensor expert by expert, each with its own imatrix row."""
    if weights.ndim == 3:
        return b"".join(qtype.encode(weights[e], importance[e]).tobytes() for e in range(len(weights)))
    return qtype.encode(weights, importance[0]).tobytes()


@pytest.mark.parametrize(("manifest", "tensor"), _fixture_cases())
def test_bit_exact_with_llamacpp_fixture(manifest: str, tensor: str) -> None:
    entry = oracle.manifest_tensor(MODEL, manifest, tensor)
    qtype = get_type(entry["type"])
    data = _encode_like_llama_quantize(
        qtype, oracle.qwen3moe_tensor(tensor), oracle.llamacpp_importance(MODEL)[tensor]
    )
    assert len(data) == entry["nbytes"]
    assert hashlib.sha256(data).hexdigest() == entry["sha256"]


# ---------------------------------------------------------------- libggml as an oracle (optional)


def _ggml_encode(gtype: T, rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    lib = oracle.libggml()
    qtype = get_type(gtype.name)
    rows = np.ascontiguousarray(rows, np.float32)
    out = np.zeros((rows.shape[0], qtype.row_bytes(rows.shape[1])), np.uint8)
    imp = None if importance is None else np.ascontiguousarray(importance, np.float32)
    lib.ggml_quantize_init(int(gtype))
    lib.ggml_quantize_chunk(
        int(gtype),
        rows.ctypes.data,
        out.ctypes.data,
        0,
        rows.shape[0],
        rows.shape[1],
        None if imp is None else imp.ctypes.data,
    )
    return out


def _random_case(seed: int, n_rows: int = 24, n_per_row: int = 512) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    rows = (rng.standard_normal((n_rows, n_per_row)) * rng.uniform(0.001, 0.1, (n_rows, 1))).astype(
        np.float32
    )
    rows[0, :256] = 0  # an all-zero super-block
    rows[1, 16:48] = 0  # an all-zero sub-block
    rows[2] = np.round(rows[2] * 64) / 64  # many ties, as bf16-sourced weights have
    importance = (rng.gamma(0.5, size=n_per_row) * 1e-3).astype(np.float32)
    importance[rng.integers(0, n_per_row, 20)] = 0  # unused input columns
    return rows, importance


# ggml_quantize_init builds its neighbour maps on first use (tens of seconds for IQ1): slow tests.
@pytest.mark.slow
@pytest.mark.parametrize("name", MINE)
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_libggml_on_random_data(name: str, seed: int) -> None:
    oracle.libggml()
    rows, importance = _random_case(seed)
    ours = get_type(name).encode(rows, importance)
    np.testing.assert_array_equal(ours, _ggml_encode(T[name], rows, importance))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["IQ2_S", "IQ1_M"])
def test_matches_libggml_without_importance(name: str) -> None:
    oracle.libggml()
    rows, _ = _random_case(7)
    ours = get_type(name).encode(rows, None)
    np.testing.assert_array_equal(ours, _ggml_encode(T[name], rows, None))


# ---------------------------------------------------------------- properties


@pytest.mark.parametrize("name", MINE)
def test_decode_agrees_with_gguf(name: str) -> None:
    rows, importance = _random_case(3, n_rows=8)
    qtype = get_type(name)
    data = qtype.encode(rows, importance)
    assert data.shape == (8, qtype.row_bytes(512))
    ours = qtype.decode(data, 512)
    np.testing.assert_array_equal(ours, gguf_quants.dequantize(data, T[name]))
    assert np.isfinite(ours).all() and np.abs(ours).max() > 0


@pytest.mark.parametrize("name", MINE)
def test_rejects_nan_and_bad_shapes(name: str) -> None:
    qtype = get_type(name)
    rows = np.ones((2, 256), np.float32)
    rows[1, 7] = np.nan
    with pytest.raises(ForgeError, match="NaN"):
        qtype.encode(rows, np.ones(256, np.float32))
    with pytest.raises(ForgeError, match="not a multiple of .*256"):
        qtype.encode(np.ones((2, 200), np.float32), np.ones(200, np.float32))
    with pytest.raises(ForgeError, match="importance"):
        qtype.encode(np.ones((2, 256), np.float32), np.ones(128, np.float32))


@pytest.mark.parametrize("name", ["IQ2_XXS", "IQ2_XS", "IQ1_S"])
def test_missing_importance_is_an_error(name: str) -> None:
    assert get_type(name).needs_imatrix
    with pytest.raises(ForgeError, match="importance"):
        get_type(name).encode(np.ones((1, 256), np.float32), None)


def test_rmse_ordering_on_gaussian_data() -> None:
    rng = np.random.default_rng(11)
    rows = rng.standard_normal((16, 1024)).astype(np.float32)
    importance = rng.uniform(0.5, 2.0, 1024).astype(np.float32)
    rmse = {}
    for name in MINE:
        qtype = get_type(name)
        back = qtype.decode(qtype.encode(rows, importance), 1024)
        rmse[name] = float(np.sqrt(np.mean((back - rows) ** 2)))
    assert rmse["IQ2_S"] < rmse["IQ2_XS"] < rmse["IQ2_XXS"] < rmse["IQ1_M"] < rmse["IQ1_S"], rmse
    assert rmse["IQ1_S"] < 1.0  # better than quantizing everything to zero


def test_all_zero_input_encodes_to_zero_bytes() -> None:
    for name in ("IQ2_XXS", "IQ2_XS", "IQ1_M"):
        qtype = get_type(name)
        assert not qtype.encode(np.zeros((2, 256), np.float32), np.ones(256, np.float32)).any()


# ---------------------------------------------------------------- codebooks


@pytest.mark.parametrize("gtype", [T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ1_S])
def test_codebook_matches_gguf_decode_grid(gtype: T) -> None:
    cls = getattr(gguf_quants, gtype.name)
    cls.init_grid()
    decoded = np.asarray(cls.grid).reshape(-1, 8)
    levels = codebook(gtype).levels
    assert len(levels) == {T.IQ2_XXS: 256, T.IQ2_XS: 512, T.IQ2_S: 1024, T.IQ1_S: 2048}[gtype]
    np.testing.assert_array_equal(np.asarray(cls.grid_map)[levels], decoded)
    assert len(np.unique(grid_codes(gtype))) == len(levels)


@pytest.mark.parametrize(("gtype", "nwant"), [(T.IQ2_XXS, 2), (T.IQ2_XS, 2), (T.IQ2_S, 1), (T.IQ1_S, 3)])
def test_neighbour_lists_match_a_plain_sort(gtype: T, nwant: int) -> None:
    """Re-derive ggml's neighbour rule with a per-code Python sort on (distance, index)."""
    cb = codebook(gtype)
    pts = 2 * cb.levels.astype(int) + 1
    rng = np.random.default_rng(5)
    off = np.flatnonzero(cb.point_of_code < 0)
    for code in rng.choice(off, 40, replace=False):
        lev = (code // CODE_WEIGHTS) % 3
        d2 = ((pts - (2 * lev + 1)) ** 2).sum(1)
        ranked = sorted(range(len(pts)), key=lambda j: (d2[j], j))
        kept = sorted(set(d2.tolist()))[:nwant]
        expect = [j for j in ranked if d2[j] in kept]
        assert cb.neighbours_of(code).tolist() == expect
        assert neighbour_lists(cb.levels, nwant, lev[None].astype(np.uint8))[0].tolist() == expect
    on = np.flatnonzero(cb.point_of_code >= 0)
    np.testing.assert_array_equal(cb.levels[cb.point_of_code[on]] @ CODE_WEIGHTS, on)
    assert cb.nb_count[on].sum() == 0 and (cb.nb_count[off] > 0).all() and len(cb.point_of_code) == N_CODES


def test_best_neighbour_dense_and_ragged_paths_agree() -> None:
    cb = codebook(T.IQ2_XS)
    rng = np.random.default_rng(2)
    off = np.flatnonzero(cb.point_of_code < 0)
    codes = np.concatenate([np.full(100, off[3]), rng.choice(off, 200)])  # one frequent code, many rare
    terms = rng.random((len(codes), 8, 3)).astype(np.float32)
    terms[:10] = 1.0  # exact ties: the first neighbour must win
    got = cb.best_neighbour(codes, terms)
    tindex = cb.term_index
    for q in range(len(codes)):
        cand = cb.neighbours_of(codes[q])
        score = np.zeros(len(cand), np.float32)
        for i in range(8):
            score = score + terms[q].reshape(24)[tindex[i][cand]]
        assert got[q] == cand[np.argmin(score)]
