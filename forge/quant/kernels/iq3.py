"""Compiled IQ3_XXS / IQ3_S encoders: ggml's ``quantize_row_iq3_xxs_impl`` / ``_iq3_s_impl``.

Same float32 operations in the same order as ``forge/quant/codecs/iq3.py`` (the reference and the
fallback), one super-block at a time. Grid tables come from forge/quant/iq3_grid.py: 12-bit codes
(3 bits per coordinate), the grid index of a code (or -1) and its neighbour list.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from forge.jit import F32, JIT, nearest_int, put_fp16
from forge.quant.iq3_grid import iq3s_grid, iq3xxs_grid

QK = 256


@njit(inline="always", **JIT)
def _clamp(v: int, lo: int, hi: int) -> int:
    return lo if v < lo else (hi if v > hi else v)


@njit(**JIT)
def _snap(
    xval: np.ndarray,
    waux: np.ndarray,
    inv: float,
    scale: float,
    search: np.ndarray,
    mags: np.ndarray,
    index_of_code: np.ndarray,
    neighbours: np.ndarray,
    n_neighbours: np.ndarray,
    index: np.ndarray,
    on_grid: np.ndarray,
) -> None:
    """Round the 8 groups of 4 at 1/inv; an off-grid group whose ``search`` flag is set takes its
    best neighbour at ``scale`` (least Σ waux·(scale·q − x)², first on ties)."""
    for k in range(8):
        code = 0
        for i in range(4):
            code |= _clamp(nearest_int(F32(0.5) * (inv * xval[4 * k + i] - F32(1))), 0, 7) << (3 * i)
        g = index_of_code[code]
        on_grid[k] = g >= 0
        if g < 0 and search[k]:
            best = F32(np.inf)
            for j in range(n_neighbours[code]):
                cand = neighbours[code, j]
                d2 = F32(0)
                for i in range(4):
                    diff = scale * mags[cand, i] - xval[4 * k + i]
                    t = waux[4 * k + i] * diff * diff
                    d2 = t if i == 0 else d2 + t
                if d2 < best:
                    best = d2
                    g = cand
        index[k] = g


@njit(inline="always", **JIT)
def _fit(w: np.ndarray, xval: np.ndarray, mags: np.ndarray, index: np.ndarray) -> tuple[float, float]:
    sumqx = F32(0)
    sumq2 = F32(0)
    for i in range(32):
        q = mags[index[i >> 2], i & 3]
        sumqx += w[i] * xval[i] * q
        sumq2 += w[i] * q * q
    return sumqx, sumq2


@njit(**JIT)
def encode_iq3(
    rows: np.ndarray,
    imp: np.ndarray,
    is_s: bool,
    mags: np.ndarray,
    index_of_code: np.ndarray,
    neighbours: np.ndarray,
    n_neighbours: np.ndarray,
    out: np.ndarray,
) -> None:
    """IQ3_XXS (is_s False, 98-byte blocks) / IQ3_S (is_s True, 110-byte blocks); ``imp`` empty means
    weights x²."""
    n_rows, n_per_row = rows.shape
    nb = n_per_row // QK
    has_imp = imp.size > 0
    bsize = out.shape[1] // nb
    xxs = not is_s
    sign_mask = 127 if xxs else 255
    w = np.empty(32, np.float32)
    waux = np.empty(32, np.float32)
    xval = np.empty(32, np.float32)
    idx = np.empty(8, np.int64)
    on = np.empty(8, np.bool_)
    best_idx = np.empty(8, np.int64)
    best_on = np.empty(8, np.bool_)
    search_all = np.ones(8, np.bool_)
    search_off = np.empty(8, np.bool_)
    bits = np.zeros((8, 4), np.int64)
    index = np.zeros((8, 8), np.int64)
    scales = np.empty(8, np.float32)
    live = np.empty(8, np.bool_)
    for r in range(n_rows):
        for b in range(nb):
            x = rows[r, b * QK : (b + 1) * QK]
            y = out[r, b * bsize : (b + 1) * bsize]
            sumx2 = F32(0)
            for i in range(QK):
                sumx2 += x[i] * x[i]
            sigma2 = sumx2 * F32(2) / F32(QK)
            for ib in range(8):
                xb = x[32 * ib : 32 * ib + 32]
                for i in range(32):
                    w[i] = (
                        imp[b * QK + 32 * ib + i] * np.sqrt(sigma2 + xb[i] * xb[i])
                        if has_imp
                        else xb[i] * xb[i]
                    )
                    waux[i] = np.sqrt(w[i])
                for k in range(4):
                    nneg = 0
                    sg = 0
                    for i in range(8):
                        v = xb[8 * k + i]
                        if v < F32(0):
                            xval[8 * k + i] = -v
                            nneg += 1
                            sg |= 1 << i
                        else:
                            xval[8 * k + i] = v
                    if xxs and nneg % 2:
                        imin = 0
                        mn = w[8 * k] * xb[8 * k] * xb[8 * k]
                        for i in range(1, 8):
                            t = w[8 * k + i] * xb[8 * k + i] * xb[8 * k + i]
                            if t < mn:
                                mn = t
                                imin = i
                        xval[8 * k + imin] = -xval[8 * k + imin]
                        sg ^= 1 << imin
                    bits[ib, k] = sg & sign_mask
                vmax = xval[0]
                for i in range(1, 32):
                    if xval[i] > vmax:
                        vmax = xval[i]
                live[ib] = vmax >= F32(1e-8) if xxs else vmax != F32(0)
                if not live[ib]:
                    vmax = F32(1)
                best = F32(0)
                scale = vmax / F32(15)
                for k in range(8):
                    best_idx[k] = index_of_code[0]
                    best_on[k] = xxs
                for step in range(-15 if xxs else -9, 16 if xxs else 10):
                    inv = (F32(15) + F32(step) * F32(0.2)) / vmax
                    _snap(
                        xval,
                        waux,
                        inv,
                        F32(1) / inv,
                        search_all,
                        mags,
                        index_of_code,
                        neighbours,
                        n_neighbours,
                        idx,
                        on,
                    )
                    sumqx, sumq2 = _fit(w, xval, mags, idx)
                    if sumq2 > F32(0) and sumqx * sumqx > best * sumq2:
                        scale = sumqx / sumq2
                        best = scale * sumqx
                        for k in range(8):
                            best_idx[k] = idx[k]
                            best_on[k] = on[k]
                any_off = False
                for k in range(8):
                    if not best_on[k]:
                        any_off = True
                if any_off and scale > F32(0):
                    for k in range(8):
                        search_off[k] = not best_on[k]
                    _snap(
                        xval, waux, F32(1) / scale, scale, search_off if xxs else search_all, mags, index_of_code,
                        neighbours, n_neighbours, idx, on,
                    )  # fmt: skip
                    for k in range(8):
                        if is_s or not best_on[k]:
                            best_idx[k] = idx[k]
                    sumqx, sumq2 = _fit(w, xval, mags, best_idx)
                    if sumq2 > F32(0):
                        scale = sumqx / sumq2
                if scale < F32(0):
                    scale = -scale
                    for k in range(4):
                        bits[ib, k] = ~bits[ib, k] & sign_mask
                scales[ib] = scale if live[ib] else F32(0)
                for k in range(8):
                    index[ib, k] = best_idx[k]
            max_scale = scales[0]
            for ib in range(1, 8):
                if scales[ib] > max_scale:
                    max_scale = scales[ib]
            d = max_scale / F32(31)
            has = max_scale > F32(0)
            inv_d = F32(1) / d
            y[:] = 0
            if has:
                put_fp16(y, 0, d * (F32(1.033) if is_s else F32(1.0125)))
            ls = np.zeros(8, np.int64)
            if has:
                for ib in range(8):
                    ls[ib] = _clamp(nearest_int(F32(0.5) * (inv_d * scales[ib] - F32(1))), 0, 15)
            if xxs:
                if not has:
                    continue
                for ib in range(8):
                    packed = np.uint32(ls[ib]) << np.uint32(28)
                    if live[ib]:
                        for k in range(8):
                            y[2 + 8 * ib + k] = index[ib, k] & 0xFF
                        for k in range(4):
                            packed |= np.uint32(bits[ib, k]) << np.uint32(7 * k)
                    for t in range(4):
                        y[66 + 4 * ib + t] = (packed >> np.uint32(8 * t)) & np.uint32(0xFF)
            else:
                slot = 0
                for ib in range(8):
                    if not live[ib]:
                        continue
                    h = 0
                    for k in range(8):
                        y[2 + 8 * slot + k] = index[ib, k] & 0xFF
                        h |= (index[ib, k] >> 8) << k
                    y[66 + ib] = h
                    for k in range(4):
                        y[74 + 4 * slot + k] = bits[ib, k]
                    slot += 1
                for m in range(4):
                    y[106 + m] = ls[2 * m] | (ls[2 * m + 1] << 4)


_TABLES: dict = {}


def _tables(is_s: bool) -> tuple[np.ndarray, ...]:
    if is_s not in _TABLES:
        g = iq3s_grid() if is_s else iq3xxs_grid()
        _TABLES[is_s] = (
            np.ascontiguousarray(g.magnitudes, np.float32),
            np.ascontiguousarray(g.index_of_code, np.int32),
            np.ascontiguousarray(g.neighbours, np.int32),
            np.ascontiguousarray(g.n_neighbours, np.int32),
        )
    return _TABLES[is_s]


def _run(rows: np.ndarray, importance: np.ndarray | None, is_s: bool, type_size: int) -> np.ndarray:
    rows = np.ascontiguousarray(rows, np.float32)
    imp = np.empty(0, np.float32) if importance is None else np.ascontiguousarray(importance, np.float32)
    out = np.empty((rows.shape[0], rows.shape[1] // QK * type_size), np.uint8)
    encode_iq3(rows, imp, is_s, *_tables(is_s), out)
    return out


def iq3_xxs(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    return _run(rows, importance, False, 98)


def iq3_s(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    return _run(rows, importance, True, 110)
