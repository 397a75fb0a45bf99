"""Compiled Q4_0 / Q4_1 / Q5_0 / Q5_1 encoders: ggml's ``quantize_row_<type>_ref`` without importance
weights and ``quantize_row_<type>_impl`` with them; same bytes as ``forge/quant/codecs/legacy.py``."""

from __future__ import annotations

import numpy as np
from numba import njit

from forge.jit import F32, JIT, put_fp16
from forge.quant.kernels.kquants import make_qkx, make_qx_lanes

QK = 32


@njit(**JIT)
def encode_legacy(rows: np.ndarray, imp: np.ndarray, nmax: int, affine: bool, out: np.ndarray) -> None:
    """nmax 8 / 16 symmetric (Q4_0 / Q5_0) or 15 / 31 affine (Q4_1 / Q5_1)."""
    n_rows, n_per_row = rows.shape
    nb = n_per_row // QK
    bsize = out.shape[1] // nb
    five = nmax == 16 or nmax == 31
    has_imp = imp.size > 0
    L = np.empty(QK, np.int64)
    w = np.empty(n_per_row, np.float32)
    xt = np.empty((QK, 1), np.float32)
    wt = np.empty((QK, 1), np.float32)
    lt = np.empty((QK, 1), np.uint8)
    lq = np.empty(QK, np.uint8)
    laux = np.empty(QK, np.uint8)
    s_out = np.empty(1, np.float32)
    for r in range(n_rows):
        row = rows[r]
        if has_imp:
            sumx2 = F32(0)
            for i in range(n_per_row):
                sumx2 += row[i] * row[i]
            sigma2 = sumx2 / F32(n_per_row)
            for i in range(n_per_row):
                w[i] = imp[i] * np.sqrt(sigma2 + row[i] * row[i])
        for b in range(nb):
            x = row[b * QK : (b + 1) * QK]
            y = out[r, b * bsize : (b + 1) * bsize]
            m = F32(0)
            if not has_imp:
                if affine:
                    lo = x[0]
                    hi = x[0]
                    for i in range(1, QK):
                        if x[i] < lo:
                            lo = x[i]
                        if x[i] > hi:
                            hi = x[i]
                    d = (hi - lo) / F32(nmax)
                    inv = F32(1) / d if d != F32(0) else F32(0)
                    for i in range(QK):
                        li = np.int64(np.int32((x[i] - lo) * inv + F32(0.5)))
                        L[i] = nmax if li > nmax else li
                    m = lo
                else:
                    amax = F32(0)
                    vmax = F32(0)
                    for i in range(QK):
                        if abs(x[i]) > amax:
                            amax = abs(x[i])
                            vmax = x[i]
                    d = vmax / F32(-nmax)
                    inv = F32(1) / d if d != F32(0) else F32(0)
                    half = F32(nmax) + F32(0.5)
                    for i in range(QK):
                        li = np.int64(np.int32(x[i] * inv + half))
                        L[i] = 2 * nmax - 1 if li > 2 * nmax - 1 else li
            else:
                wb = w[b * QK : (b + 1) * QK]
                if affine:
                    d, the_min = make_qkx(x, wb, QK, nmax, F32(-0.9), F32(0.05), 36, False, True, lq, laux)
                    m = -the_min
                    for i in range(QK):
                        L[i] = lq[i]
                else:
                    for i in range(QK):
                        xt[i, 0] = x[i]
                        wt[i, 0] = wb[i]
                    make_qx_lanes(xt, wt, QK, 1, nmax, s_out, lt)
                    d = s_out[0]
                    for i in range(QK):
                        L[i] = lt[i, 0]
            put_fp16(y, 0, d)
            o = 2
            if affine:
                put_fp16(y, 2, m)
                o = 4
            if five:
                h = 0
                for i in range(QK):
                    h |= ((L[i] >> 4) & 1) << i
                for t in range(4):
                    y[o + t] = (h >> (8 * t)) & 0xFF
                o += 4
            for j in range(16):
                y[o + j] = (L[j] & 0xF) | ((L[j + 16] & 0xF) << 4)


def _run(
    rows: np.ndarray, importance: np.ndarray | None, nmax: int, affine: bool, type_size: int
) -> np.ndarray:
    rows = np.ascontiguousarray(rows, np.float32)
    imp = np.empty(0, np.float32) if importance is None else np.ascontiguousarray(importance, np.float32)
    out = np.empty((rows.shape[0], rows.shape[1] // QK * type_size), np.uint8)
    encode_legacy(rows, imp, nmax, affine, out)
    return out


def q4_0(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    return _run(rows, importance, 8, False, 18)


def q4_1(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    return _run(rows, importance, 15, True, 20)


def q5_0(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    return _run(rows, importance, 16, False, 22)


def q5_1(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    return _run(rows, importance, 31, True, 24)
