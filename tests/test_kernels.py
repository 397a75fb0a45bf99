"""Compiled (numba) encoder kernels: the same bytes as the numpy reference encoders.

Every kernel is compared byte for byte with the numpy encoder it accelerates, on random rows with
edge cases (all-zero rows, constant rows, sparse zeros, one-signed rows, tiny and huge scales), with
and without importance weights and for several row counts; and, where llama.cpp's libggml-base is
around (FORGE_LIBGGML), against ggml itself at magnitudes where float32 squares overflow.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from forge.quant import numerics as nx
from forge.quant.codecs import iq1, iq2, iq3, iq4, kquants, legacy
from forge.quant.types import get_type
from tests import oracle

pytest.importorskip("numba")

from numba import njit  # noqa: E402

from forge import jit as _core
from forge.jit import enabled
from forge.quant.kernels import kernel, kernel_table, warm_up  # noqa: E402

# kernel name -> (numpy reference encoder, reads importance, needs importance)
KERNELS = {
    "q8.q8_0": (legacy.encode_q8_0, False, False),
    "legacy.q4_0": (legacy.encode_q4_0, True, False),
    "legacy.q4_1": (legacy.encode_q4_1, True, False),
    "legacy.q5_0": (legacy.encode_q5_0, True, False),
    "legacy.q5_1": (legacy.encode_q5_1, True, False),
    "kquants.q4_k": (kquants.encode_q4_k, True, False),
    "kquants.q5_k": (kquants.encode_q5_k, True, False),
    "kquants.q6_k": (kquants.encode_q6_k, True, False),
    "kquants.q2_k": (kquants.encode_q2_k, True, False),
    "kquants.q3_k": (kquants.encode_q3_k, True, False),
    "iq2.iq2_xxs": (iq2.IQ2_XXS._encode_chunk.fallback, True, True),
    "iq2.iq2_xs": (iq2.IQ2_XS._encode_chunk.fallback, True, True),
    "iq2.iq2_s": (iq2.IQ2_S._encode_chunk.fallback, True, False),
    "iq3.iq3_xxs": (iq3._encode_iq3_xxs, True, False),
    "iq3.iq3_s": (iq3._encode_iq3_s, True, False),
    "iq4.iq4_nl": (iq4._encode_iq4_nl, True, False),
    "iq4.iq4_xs": (iq4._encode_iq4_xs, True, False),
    "iq1.iq1_s": (iq1.IQ1_S._encode_chunk.fallback, True, True),
    "iq1.iq1_m": (iq1.IQ1_M._encode_chunk.fallback, True, False),
}
SCALES = [1.0, 3e3, 1e-3, 1e-6, 1e10, 1e-30]


@njit(**_core.JIT)
def _apply_scalar_helpers(x, ni, h, back):  # noqa: ANN001, ANN202
    for i in range(x.size):
        ni[i] = _core.nearest_int(x[i])
        h[i] = _core.fp16_bits(x[i])
        back[i] = _core.fp16_round(x[i])


def _rows(n_rows: int, n_per_row: int, scale: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_rows, n_per_row)).astype(np.float32) * np.float32(scale)
    edits = [
        lambda r: r.fill(0),  # all zero
        lambda r: r.fill(np.float32(scale)),  # constant
        lambda r: r.__setitem__(slice(0, 256), -np.float32(scale)),  # constant negative super-block
        lambda r: r.__setitem__(slice(None, None, 7), 0),  # sparse zeros
        lambda r: np.abs(r, out=r),  # one-signed
        lambda r: r.__setitem__(slice(None), np.round(r * 4) / 4 + 0),  # few distinct values, ties (no -0.0)
    ]
    for i in range(min(n_rows, len(edits))):
        edits[(i + seed) % len(edits)](x[i])
    return x


def _importance(n_per_row: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed + 100)
    w = rng.exponential(1, n_per_row).astype(np.float32)
    w[rng.random(n_per_row) < 0.2] = 0  # unused columns
    return w


def _cases(name: str) -> list:
    _, uses, needs = KERNELS[name]
    weighted = [True] if needs else ([False, True] if uses else [False])
    return [(name, s, w) for s in SCALES for w in weighted]


@pytest.mark.parametrize(("name", "scale", "weighted"), [c for n in KERNELS for c in _cases(n)])
def test_kernel_matches_numpy_reference(name: str, scale: float, weighted: bool) -> None:
    reference = KERNELS[name][0]
    for seed, (n_rows, n_per_row) in enumerate([(1, 256), (6, 512), (9, 768)]):
        x = _rows(n_rows, n_per_row, scale, seed)
        w = _importance(n_per_row, seed) if weighted else None
        with np.errstate(all="ignore"):
            want = reference(x, w)
        got = kernel(name)(x, w)
        assert got.dtype == np.uint8 and got.shape == want.shape
        bad = np.flatnonzero((got != want).any(axis=1))
        assert not len(bad), f"{name} scale {scale} rows {bad.tolist()} of {n_rows}x{n_per_row} differ"


@pytest.mark.parametrize(
    "type_name",
    ["Q8_0", "Q4_0", "Q5_1", "Q3_K", "Q4_K", "Q6_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"],
)
def test_codecs_dispatch_to_kernels_unless_disabled(type_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    qtype = get_type(type_name)
    x = _rows(40, 512, 1.0, 3)
    w = _importance(512, 3)
    monkeypatch.delenv("FORGE_NO_NUMBA", raising=False)
    assert enabled()
    fast = qtype.encode(x, w)
    monkeypatch.setenv("FORGE_NO_NUMBA", "1")
    assert not enabled()
    np.testing.assert_array_equal(fast, qtype.encode(x, w))


def test_scalar_helpers_match_numpy() -> None:
    rng = np.random.default_rng(0)
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    halves = halves[np.isfinite(halves)]
    x = np.concatenate(
        [
            rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32),
            halves,
            np.nextafter(halves, np.float32(np.inf)),  # just above each half and ...
            np.nextafter(halves, np.float32(-np.inf)),  # ... just below (rounding ties and carries)
            np.arange(-50, 50, 0.25, dtype=np.float32),
            np.float32([4194303, 4194304.5, 1e7, -1e9, 65519.996, 65520]),
        ]
    )
    x = x[np.isfinite(x)]
    ni, h, back = np.empty(x.size, np.int32), np.empty(x.size, np.int64), np.empty(x.size, np.float32)
    _apply_scalar_helpers(x, ni, h, back)
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(ni, nx.nearest_int(x))
        np.testing.assert_array_equal(h, nx.fp16_bits(x))
        np.testing.assert_array_equal(back, nx.fp16_round(x))


# --------------------------------------------------------------------------------------------------
# against ggml itself (optional), at magnitudes where x*x overflows float32


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q5_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("weighted", [False, True])
def test_kernel_matches_libggml_at_extreme_magnitudes(type_name: str, weighted: bool) -> None:
    """Where the numpy reference parts from ggml (an argmax over NaN scales once x² overflows, in
    Q3_K/Q6_K; a signed zero picked as the block maximum of an all-zero Q4_0/Q5_0 block), the kernels
    follow ggml."""
    quantize_chunk = oracle.libggml().ggml_quantize_chunk
    qtype = get_type(type_name)
    name = {"Q8_0": "q8.q8_0", "Q4_0": "legacy.q4_0", "Q5_0": "legacy.q5_0"}.get(
        type_name, f"kquants.{type_name.lower()}"
    )
    for scale in (1e30, 1e20, 1e15, 1e-38):
        x = _rows(6, 512, scale, 5)
        x[5, :64] = 0
        x[5, [0, 7, 32]] = -0.0  # all-zero blocks starting with a negative zero
        w = _importance(512, 5) if weighted else None
        want = np.zeros((x.shape[0], qtype.row_bytes(x.shape[1])), np.uint8)
        quantize_chunk(
            int(qtype.ggml_type), x.ctypes.data, want.ctypes.data, 0, x.shape[0], x.shape[1],
            None if w is None else w.ctypes.data,
        )  # fmt: skip
        np.testing.assert_array_equal(kernel(name)(x, w), want, err_msg=f"scale {scale}")


def test_iq2_xxs_kernel_zero_row_is_all_zero() -> None:
    x = np.zeros((1, 256), np.float32)
    w = np.ones(256, np.float32)
    out = kernel("iq2.iq2_xxs")(x, w)
    assert out.shape == (1, get_type(T.IQ2_XXS).row_bytes(256)) and not out.any()


def test_every_kernel_is_tested_and_wired(monkeypatch: pytest.MonkeyPatch) -> None:
    BY_TYPE = kernel_table()  # noqa: N806
    assert set(BY_TYPE.values()) == set(KERNELS)
    for type_name, name in BY_TYPE.items():
        assert get_type(type_name)._encode_chunk.__doc__.startswith(name), type_name
    monkeypatch.delenv("FORGE_NO_NUMBA", raising=False)
    assert warm_up(["q4_k", "IQ2_XXS", "F16"]) == ["Q4_K", "IQ2_XXS"]
    monkeypatch.setenv("FORGE_NO_NUMBA", "1")
    assert warm_up() == []
