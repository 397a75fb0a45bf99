"""IQ4_NL, IQ4_XS, IQ3_XXS, IQ3_S encoders: bit-exact with llama.cpp, and sane on synthetic data."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from forge.errors import ForgeError
from forge.quant.iq3_grid import build_grid, iq3s_grid, iq3xxs_grid
from forge.quant.types import get_type
from tests import oracle

OUR_TYPES = ("IQ4_NL", "IQ4_XS", "IQ3_XXS", "IQ3_S")
QWEN3_MANIFESTS = ("IQ4_NL", "IQ4_XS", "IQ4_XS-imat", "IQ3_S-imat", "IQ3_XXS-imat")


# --- fixtures: llama.cpp's own outputs ------------------------------------------------------------


def _our_tensors(model: str, manifest: str) -> list[str]:
    if manifest not in oracle.manifest_names(model):
        return []
    return [t["name"] for t in oracle.manifest(model, manifest)["tensors"] if t["type"] in OUR_TYPES]


def _is_fast(tensor: str) -> bool:
    """The quick subset: the small attention matrices of block 0."""
    return tensor.startswith("blk.0.attn_")


def _cases(model: str, manifests: tuple[str, ...], buildable=lambda name: True):
    cases = []
    for man in manifests:
        for name in _our_tensors(model, man):
            if not buildable(name):
                continue
            marks = () if _is_fast(name) else (pytest.mark.slow,)
            cases.append(pytest.param(man, name, marks=marks, id=f"{man}:{name}"))
    return cases


def _encode_like_llama_quantize(src: np.ndarray, qtype: str, importance: np.ndarray | None) -> bytes:
    """A 3-D (expert) tensor is quantized expert by expert with that expert's importance row."""
    qt = get_type(qtype)
    mats = src.reshape(-1, *src.shape[-2:])
    out = []
    for e, mat in enumerate(mats):
        imp = None if importance is None else importance[e if importance.shape[0] > 1 else 0]
        out.append(qt.encode(mat, imp).tobytes())
    return b"".join(out)


def _check_manifest_tensor(model: str, manifest: str, name: str, src: np.ndarray) -> None:
    entry = oracle.manifest_tensor(model, manifest, name)
    importance = oracle.llamacpp_importance(model).get(name) if manifest.endswith("-imat") else None
    data = _encode_like_llama_quantize(src, entry["type"], importance)
    assert len(data) == entry["nbytes"]
    assert hashlib.sha256(data).hexdigest() == entry["sha256"], f"{manifest} {name} ({entry['type']})"


@pytest.mark.parametrize(("manifest", "name"), _cases("tiny-qwen3moe", QWEN3_MANIFESTS))
def test_bit_exact_tiny_qwen3moe(manifest: str, name: str) -> None:
    _check_manifest_tensor("tiny-qwen3moe", manifest, name, oracle.qwen3moe_tensor(name))


def _qwen35_source(name: str) -> np.ndarray:
    """The tiny-qwen35moe tensors the converter copies unchanged (GGUF layout, float32)."""
    hf = oracle.hf_tensors("tiny-qwen35moe")
    if name == "token_embd.weight":
        return hf["model.embed_tokens.weight"]
    _, layer, kind, _ = name.split(".")
    proj = kind.removeprefix("ffn_").split("_")[0]
    mlp = f"model.layers.{layer}.mlp"
    if kind.endswith("_shexp"):
        return hf[f"{mlp}.shared_expert.{proj}_proj.weight"]
    n = sum(1 for k in hf if k.startswith(f"{mlp}.experts.") and k.endswith(f".{proj}_proj.weight"))
    return np.stack([hf[f"{mlp}.experts.{e}.{proj}_proj.weight"] for e in range(n)])


def _qwen35_buildable(name: str) -> bool:
    return name == "token_embd.weight" or name.endswith(("_exps.weight", "_shexp.weight"))


@pytest.mark.slow
@pytest.mark.parametrize(("manifest", "name"), _cases("tiny-qwen35moe", ("IQ4_XS-imat",), _qwen35_buildable))
def test_bit_exact_tiny_qwen35moe(manifest: str, name: str) -> None:
    _check_manifest_tensor("tiny-qwen35moe", manifest, name, _qwen35_source(name))


# --- the IQ3 search tables -------------------------------------------------------------------------


def _neighbours_by_definition(levels: np.ndarray, code: int, nwant: int) -> list[int]:
    """iq3xs_init_impl's neighbour list of one off-grid code, the straightforward way."""
    pos = np.array([2 * ((code >> (3 * i)) & 7) + 1 for i in range(4)])
    grid_pos = 2 * levels.astype(int) + 1
    ranked = sorted((int(((g - pos) ** 2).sum()), j) for j, g in enumerate(grid_pos))
    distinct = sorted({d for d, _ in ranked})[:nwant]
    return [j for d, j in ranked if d in distinct]


@pytest.mark.parametrize(("grid_fn", "size", "nwant"), [(iq3xxs_grid, 256, 2), (iq3s_grid, 512, 3)])
def test_iq3_tables(grid_fn, size: int, nwant: int) -> None:
    grid = grid_fn()
    assert grid.levels.shape == (size, 4)
    # llama.cpp lists its grid codes in ascending order; ours are derived from the decoder tables
    assert np.all(np.diff(grid.codes.astype(int)) > 0)
    assert (grid.index_of_code >= 0).sum() == size
    assert np.array_equal(grid.index_of_code[grid.codes], np.arange(size))
    assert np.all(grid.n_neighbours[grid.codes] == 0)
    rng = np.random.default_rng(size)
    off = np.flatnonzero(grid.index_of_code < 0)
    for code in [int(off[0]), int(off[-1]), *rng.choice(off, 60, replace=False).tolist()]:
        expect = _neighbours_by_definition(grid.levels, code, nwant)
        n = grid.n_neighbours[code]
        assert grid.neighbours[code, :n].tolist() == expect
        assert np.all(grid.neighbours[code, n:] == -1)
    # the derived tables do not depend on anything but the levels
    again = build_grid(grid.levels, nwant)
    assert np.array_equal(again.neighbours, grid.neighbours)


# --- synthetic data ----------------------------------------------------------------------------------


KINDS = ("gauss", "zeros", "constant", "huge", "tiny", "sparse", "outliers")


def _rows(kind: str, n_rows: int = 8, n_per_row: int = 512) -> np.ndarray:
    rng = np.random.default_rng(KINDS.index(kind))
    x = rng.standard_normal((n_rows, n_per_row)).astype(np.float32)
    if kind == "zeros":
        return np.zeros_like(x)
    if kind == "constant":
        return np.repeat(rng.standard_normal((n_rows, 1)).astype(np.float32), n_per_row, axis=1)
    if kind == "huge":
        return x * np.float32(1e5)
    if kind == "tiny":
        return x * np.float32(1e-6)
    if kind == "sparse":  # whole 32-value sub-blocks of zeros between live ones
        x.reshape(n_rows, -1, 32)[:, 1::3] = 0
        return x
    if kind == "outliers":
        x[:, ::37] *= 50
        return x
    return x


#: relative RMSE bounds on Gaussian-like data (measured values are about 0.08, 0.08, 0.21, 0.16)
REL_RMSE = {"IQ4_NL": 0.1, "IQ4_XS": 0.1, "IQ3_XXS": 0.25, "IQ3_S": 0.2}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("qtype", OUR_TYPES)
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "imatrix"])
def test_encode_decode_shapes_and_values(qtype: str, kind: str, weighted: bool) -> None:
    qt = get_type(qtype)
    x = _rows(kind)
    importance = np.random.default_rng(1).random(x.shape[1]).astype(np.float32) + 0.01 if weighted else None
    data = qt.encode(x, importance)
    assert data.dtype == np.uint8 and data.shape == (x.shape[0], qt.row_bytes(x.shape[1]))
    y = qt.decode(data, x.shape[1])
    assert y.shape == x.shape and y.dtype == np.float32
    np.testing.assert_array_equal(y, dequantize(data, GGMLQuantizationType[qtype]))
    if kind == "zeros":
        assert not y.any()
    rel = np.sqrt(np.mean((y - x) ** 2) / max(float(np.mean(x**2)), 1e-30))
    if kind in ("gauss", "huge", "constant") or (kind == "sparse" and qtype != "IQ3_S"):
        assert rel < REL_RMSE[qtype], rel
    if kind == "outliers":  # 1 value in 37 is 50x larger: the 3-bit types lose the small ones
        assert rel < (0.1 if qtype.startswith("IQ4") else 0.4), rel
    if kind == "tiny":  # scales below fp16 range: nothing non-finite, nothing larger than the input
        assert np.isfinite(y).all() and np.abs(y).max() <= 2 * np.abs(x).max()


@pytest.mark.parametrize("qtype", OUR_TYPES)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_input_rejected(qtype: str, bad: float) -> None:
    x = _rows("gauss", 2, 256)
    x[1, 17] = bad
    with pytest.raises(ForgeError):
        get_type(qtype).encode(x)
    imp = np.ones(256, np.float32)
    imp[3] = bad
    with pytest.raises(ForgeError):
        get_type(qtype).encode(_rows("gauss", 2, 256), imp)


@pytest.mark.parametrize("qtype", OUR_TYPES)
def test_bad_shapes_rejected(qtype: str) -> None:
    qt = get_type(qtype)
    with pytest.raises(ForgeError):
        qt.encode(np.zeros((2, qt.block_size + 1), np.float32))
    with pytest.raises(ForgeError):
        qt.encode(np.zeros((2, 256), np.float32), np.ones(128, np.float32))
    with pytest.raises(ForgeError):
        qt.decode(np.zeros((2, qt.type_size + 1), np.uint8), 256)


def test_rmse_ordering_on_gaussian_data() -> None:
    x = _rows("gauss", 32, 1024)
    rmse = {}
    for qtype in OUR_TYPES:
        qt = get_type(qtype)
        rmse[qtype] = float(np.sqrt(np.mean((qt.decode(qt.encode(x), x.shape[1]) - x) ** 2)))
    assert abs(rmse["IQ4_NL"] - rmse["IQ4_XS"]) < 0.1 * rmse["IQ4_NL"], rmse
    assert max(rmse["IQ4_NL"], rmse["IQ4_XS"]) < rmse["IQ3_S"] < rmse["IQ3_XXS"], rmse


def test_importance_steers_the_error() -> None:
    """Columns with more importance get less error (importance acts inside each block)."""
    x = _rows("gauss", 64, 512)
    imp = np.ones(512, np.float32)
    imp[::2] = 100.0
    for qtype in OUR_TYPES:
        qt = get_type(qtype)
        err = (qt.decode(qt.encode(x, imp), 512) - x) ** 2
        assert err[:, ::2].mean() < 0.8 * err[:, 1::2].mean(), qtype


def test_iq3s_skipped_subblocks_shift_later_ones_forward() -> None:
    """llama.cpp writes IQ3_S's grid indices and signs only for non-zero sub-blocks, packed to the
    front of the super-block (its decoder then reads them misplaced); we reproduce the bytes."""
    x = _rows("gauss", 1, 256)
    zeroed = x.copy()
    zeroed[0, 64:96] = 0  # sub-block 2
    qt = get_type("IQ3_S")
    full, holed = qt.encode(x)[0], qt.encode(zeroed)[0]
    qs_full, qs_holed = full[2:66].reshape(8, 8), holed[2:66].reshape(8, 8)
    signs_full, signs_holed = full[74:106].reshape(8, 4), holed[74:106].reshape(8, 4)
    # without importance, a sub-block's search does not depend on its neighbours
    assert np.array_equal(qs_holed[:2], qs_full[:2]) and np.array_equal(qs_holed[2:7], qs_full[3:])
    assert np.array_equal(signs_holed[2:7], signs_full[3:])
    assert not qs_holed[7].any() and not signs_holed[7].any()
    assert holed[66 + 2] == 0  # no high index bits for the skipped sub-block


# --- optional development oracle: llama.cpp's libggml through ctypes -----------------------------


def _ggml_quantize(lib, qtype: str, x: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    gtype = int(GGMLQuantizationType[qtype])
    qt = get_type(qtype)
    x = np.ascontiguousarray(x, np.float32)
    out = np.zeros((x.shape[0], qt.row_bytes(x.shape[1])), np.uint8)
    imp = None if importance is None else np.ascontiguousarray(importance, np.float32)
    lib.ggml_quantize_init(gtype)
    lib.ggml_quantize_chunk(
        gtype,
        x.ctypes.data,
        out.ctypes.data,
        0,
        x.shape[0],
        x.shape[1],
        None if imp is None else imp.ctypes.data,
    )
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("qtype", OUR_TYPES)
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "imatrix"])
def test_matches_libggml_on_random_data(qtype: str, kind: str, weighted: bool) -> None:
    lib = oracle.libggml()
    x = _rows(kind, 16, 1024)
    importance = np.random.default_rng(7).random(x.shape[1]).astype(np.float32) if weighted else None
    expect = _ggml_quantize(lib, qtype, x, importance)
    np.testing.assert_array_equal(get_type(qtype).encode(x, importance), expect)
