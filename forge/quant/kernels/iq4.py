"""Compiled IQ4_NL / IQ4_XS encoders: ggml's ``quantize_row_iq4_nl_impl``, one block at a time.

Same float32 operations in the same order as ``forge/quant/codecs/iq4.py`` (the reference and the
fallback).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from forge.jit import F32, GROUP_MAX_EPS, JIT, nearest_int, put_fp16
from forge.quant.codecs.iq4 import IQ4_LEVELS

_LEVELS = IQ4_LEVELS.astype(np.float32)


# The levels are integers, so the bracketing pair of levels of x depends only on floor(x): _UPPER[f + 128]
# is the index of the first level above floor f (for -127 <= f <= 112, the range reached below).
_UPPER = np.searchsorted(_LEVELS, np.arange(-128, 114, dtype=np.float32), side="right").astype(np.int64)


@njit(inline="always", **JIT)
def _best_index(levels: np.ndarray, upper: np.ndarray, x: float) -> int:
    """ggml ``best_index_int8(16, kvalues_iq4nl, x)``: the nearest level, the upper one on ties
    (NaN gives 15, as ggml's binary search does)."""
    if x <= levels[0]:
        return 0
    if not x < levels[15]:
        return 15
    mu = upper[np.int64(np.floor(x)) + 128]
    return mu - np.int64(x - levels[mu - 1] < levels[mu] - x)  # branch-free: the pick is a coin toss


@njit(**JIT)
def _block_scale(x: np.ndarray, w: np.ndarray, levels: np.ndarray, upper: np.ndarray) -> float:
    """The best scale of a 32-value block (0 when all |x| < GROUP_MAX_EPS)."""
    amax = F32(0)
    vmax = F32(0)
    for i in range(32):
        ax = abs(x[i])
        if ax > amax:
            amax = ax
            vmax = x[i]
    if not amax >= GROUP_MAX_EPS:
        return F32(0)
    d0 = -vmax / levels[0]
    inv = F32(1) / d0
    sumqx = F32(0)
    sumq2 = F32(0)
    for i in range(32):
        q = levels[_best_index(levels, upper, inv * x[i])]
        wq = w[i] * q
        sumqx += wq * x[i]
        sumq2 += wq * q
    d = sumqx / sumq2 if sumq2 > F32(0) else F32(0)
    best = d * sumqx
    for itry in range(-7, 8):
        inv = (F32(itry) + levels[0]) / vmax
        sumqx = F32(0)
        sumq2 = F32(0)
        for i in range(32):
            q = levels[_best_index(levels, upper, inv * x[i])]
            wq = w[i] * q
            sumqx += wq * x[i]
            sumq2 += wq * q
        if sumq2 > F32(0) and sumqx * sumqx > best * sumq2:
            d = sumqx / sumq2
            best = d * sumqx
    return d


@njit(**JIT)
def encode_iq4(
    rows: np.ndarray, imp: np.ndarray, xs: bool, levels: np.ndarray, upper: np.ndarray, out: np.ndarray
) -> None:
    """IQ4_NL (xs False: 32-value blocks of 18 bytes) / IQ4_XS (xs True: 256-value blocks of 136)."""
    n_rows, n_per_row = rows.shape
    sb = 256 if xs else 32
    bsize = 136 if xs else 18
    has_imp = imp.size > 0
    w = np.empty(256, np.float32)
    scales = np.empty(8, np.float32)
    ls = np.empty(8, np.int64)
    for r in range(n_rows):
        for b in range(n_per_row // sb):
            x = rows[r, b * sb : (b + 1) * sb]
            y = out[r, b * bsize : (b + 1) * bsize]
            sumx2 = F32(0)
            for i in range(sb):
                sumx2 += x[i] * x[i]
            sigma2 = sumx2 * (F32(2.0 / 256) if xs else F32(2.0 / 32))
            for i in range(sb):
                w[i] = imp[b * sb + i] * np.sqrt(sigma2 + x[i] * x[i]) if has_imp else x[i] * x[i]
            if not xs:
                d = _block_scale(x, w, levels, upper)
                put_fp16(y, 0, d)
                inv = F32(1) / d if d != F32(0) else F32(0)
                for j in range(16):
                    lo = _best_index(levels, upper, inv * x[j])
                    hi = _best_index(levels, upper, inv * x[j + 16])
                    y[2 + j] = lo | (hi << 4)
                continue
            amax = F32(0)
            max_scale = F32(0)
            for ib in range(8):
                s = _block_scale(x[32 * ib : 32 * ib + 32], w[32 * ib : 32 * ib + 32], levels, upper)
                scales[ib] = s
                if abs(s) > amax:
                    amax = abs(s)
                    max_scale = s
            d = -max_scale / F32(32)
            inv_d = F32(1) / d if d != F32(0) else F32(0)
            put_fp16(y, 0, d)
            h = 0
            for ib in range(8):
                li = nearest_int(inv_d * scales[ib])
                ls[ib] = -32 if li < -32 else (31 if li > 31 else li)
                h |= ((ls[ib] + 32) >> 4) << (2 * ib)
            y[2] = h & 0xFF
            y[3] = (h >> 8) & 0xFF
            for m in range(4):
                y[4 + m] = ((ls[2 * m] + 32) & 15) | (((ls[2 * m + 1] + 32) & 15) << 4)
            for ib in range(8):
                dl = d * F32(ls[ib])
                inv_dl = F32(1) / dl if dl != F32(0) else F32(0)
                for j in range(16):
                    lo = _best_index(levels, upper, inv_dl * x[32 * ib + j])
                    hi = _best_index(levels, upper, inv_dl * x[32 * ib + j + 16])
                    y[8 + 16 * ib + j] = lo | (hi << 4)


def _run(rows: np.ndarray, importance: np.ndarray | None, xs: bool) -> np.ndarray:
    rows = np.ascontiguousarray(rows, np.float32)
    imp = np.empty(0, np.float32) if importance is None else np.ascontiguousarray(importance, np.float32)
    n_blocks = rows.shape[1] // (256 if xs else 32)
    out = np.empty((rows.shape[0], n_blocks * (136 if xs else 18)), np.uint8)
    encode_iq4(rows, imp, xs, _LEVELS, _UPPER, out)
    return out


def iq4_nl(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    return _run(rows, importance, False)


def iq4_xs(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    return _run(rows, importance, True)
