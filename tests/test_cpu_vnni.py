"""22-bit integer activations for the CPU kernels' K-quant rows (``runtime.cpu_vnni``, the default on AVX-512
VNNI hosts): the input's form, the row products against exact references, and the switch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from numba import njit

from runtime import cpu_kernels as ck
from runtime import cpu_vnni
from runtime.cpu_rows import FLOAT_ACTS, Q8_ACTS, X22_ACTS, dot_row, prepare_input
from runtime.dequant import dequantize

vnni = pytest.mark.skipif(not cpu_vnni._VNNI, reason="the host has no AVX-512 VNNI")


def _input(n: int, seed: int) -> np.ndarray:
    """Values over several orders of magnitude and a block of zeros."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * np.exp(2 * rng.standard_normal(n))).astype(np.float32)
    x[256:512] = 0
    return x


def _rounded(xp: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The 22-bit form in xp read back: (X as int64, X times its block's scale as float64)."""
    at, nb = n // 32, n // 256
    scales = xp[at : at + nb].astype(np.float64)
    chunks = xp[at + nb :].view(np.int8).reshape(-1, 256).astype(np.int64)
    big = (65536 * chunks[:, :64] + 256 * chunks[:, 64:128] + chunks[:, 128:192]).reshape(-1)
    return big, (big.reshape(nb, 256) * scales[:, None]).reshape(-1)


def test_the_22_bit_form_rounds_each_value_to_its_blocks_step() -> None:
    n = 1024
    x = _input(n, 1)
    xp = prepare_input(x, X22_ACTS)
    assert xp.shape == (n // 32 + n // 256 + n,)
    assert np.array_equal(xp[: n // 32], prepare_input(x, FLOAT_ACTS))  # the float sums first, as every form
    big, rounded = _rounded(xp, n)
    assert np.abs(big).max() == 2**22 - 1  # each block's largest value takes the whole range
    step = np.repeat(xp[n // 32 : n // 32 + n // 256].astype(np.float64), 256)
    assert step[256] == 0 and not big[256:512].any()
    assert np.all(np.abs(rounded - x) <= step / 2 * (1 + 1e-6))
    sums = xp[n // 32 + n // 256 :].view(np.int32).reshape(-1, 64)[:, 48:].reshape(-1)
    assert np.array_equal(sums, big.reshape(-1, 4).sum(1))  # the sums of four that Q6_K's bias takes


@njit
def _loop_dots(raw: np.ndarray, xp: np.ndarray, n: int, qtype: int) -> np.ndarray:
    return np.array([cpu_vnni.dot_loop(raw[r], qtype, xp, n // 32, n) for r in range(raw.shape[0])])


def _on_the_grid(n: int, seed: int) -> np.ndarray:
    """Inputs the 22-bit form holds exactly: per block integers below 2^22 (the largest at 2^22 - 1) times a
    power of two, over several orders of magnitude, and a block of zeros."""
    rng = np.random.default_rng(seed)
    big = np.clip(
        np.rint(rng.standard_normal(n) * np.exp(2 * rng.standard_normal(n)) * 2e4), -(2**22 - 1), 2**22 - 1
    )
    big[::256] = 2**22 - 1
    x = (big.reshape(-1, 256) * 2.0 ** rng.integers(-30, -10, (n // 256, 1))).reshape(-1).astype(np.float32)
    x[256:512] = 0
    return x


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_rows_times_the_22_bit_input(name: str) -> None:
    """On inputs the form holds exactly, both implementations equal the exact products (float32 sums); on any
    input the rounding moves a product by about 2^-23 of the input's scale: far inside the runtime's 1e-4."""
    from forge.quant.types import get_type

    n, rows, qtype = 1024, 48, Q[name]
    rng = np.random.default_rng(2)
    raw = get_type(qtype).encode(rng.standard_normal((rows, n)).astype(np.float32))
    w = dequantize(torch.from_numpy(raw), qtype, n).double().numpy()
    x = _on_the_grid(n, 3)
    xp = prepare_input(x, X22_ACTS)
    assert np.array_equal(_rounded(xp, n)[1], x)
    want = w @ x.astype(np.float64)
    scale = np.abs(want).max()
    assert np.abs(_loop_dots(raw, xp, n, int(qtype)) - want).max() <= 1e-6 * scale
    if cpu_vnni._VNNI:
        buf = np.empty(n, np.float32)
        got = np.array([dot_row(raw[r], int(qtype), x, xp, buf) for r in range(rows)])
        assert np.abs(got - want).max() <= 1e-6 * scale
        x = _input(n, 4)
        xp = prepare_input(x, X22_ACTS)
        got = np.array([dot_row(raw[r], int(qtype), x, xp, buf) for r in range(rows)])
        exact = w @ x.astype(np.float64)
        assert 0 < np.abs(got - exact).max() <= 1e-5 * np.abs(exact).max()


@vnni
def test_rows_with_the_fifth_and_sixth_bits_set() -> None:
    """Codes at their largest (Q5_K 31, Q6_K 63) against inputs at their largest: no lane overflows."""
    n = 512
    x = np.full(n, -3.0, np.float32)
    xp, buf = prepare_input(x, X22_ACTS), np.empty(n, np.float32)
    one = np.array([0x3C00], np.uint16).view(np.uint8)
    for qtype, size in ((Q.Q5_K, 176), (Q.Q6_K, 210)):
        raw = np.full((1, size * n // 256), 0xFF, np.uint8)
        if qtype == Q.Q6_K:
            raw[0, 192:208] = raw[0, 210 + 192 : 210 + 208] = 127  # scales
            raw[0, 208:210] = raw[0, 418:420] = one  # d = 1
        else:
            raw[0, 0:2] = raw[0, 176:178] = one  # d = 1, dmin = nan from the 0xFF bytes: set it to 1 too
            raw[0, 2:4] = raw[0, 178:180] = one
        want = float(dequantize(torch.from_numpy(raw), qtype, n).double().numpy()[0] @ x.astype(np.float64))
        assert dot_row(raw[0], int(qtype), x, xp, buf) == pytest.approx(want, rel=1e-6)


def test_the_form_follows_the_host_and_the_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FORGE_Q8_ACTIVATIONS", raising=False)
    monkeypatch.delenv("FORGE_NO_VNNI", raising=False)
    raw = np.zeros((2, 144), np.uint8)
    default = ck.Rows.encoded_parts([(raw, int(Q.Q4_K))]).acts
    assert default == (X22_ACTS if cpu_vnni._VNNI else FLOAT_ACTS)
    monkeypatch.setenv("FORGE_NO_VNNI", "1")
    assert ck.Rows.encoded_parts([(raw, int(Q.Q4_K))]).acts == FLOAT_ACTS
    monkeypatch.setenv("FORGE_Q8_ACTIVATIONS", "1")
    assert ck.Rows.encoded_parts([(raw, int(Q.Q4_K))]).acts == Q8_ACTS
