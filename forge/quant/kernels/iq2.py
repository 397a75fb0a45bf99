"""Compiled IQ2_XXS encoder: ggml's ``quantize_row_iq2_xxs_impl``, one super-block at a time.

Same float32 operations in the same order as ``forge/quant/codecs/iq2.py`` (the reference and the
fallback). Codebook lookups use forge/quant/iq2_grid.py's tables: base-3 group codes, the point of
a code (or -1) and, for off-codebook codes, ggml's neighbour lists in CSR form.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T
from numba import njit

from forge.quant.iq2_grid import codebook
from forge.quant.kernels._core import F32, GROUP_MAX_EPS, JIT, nearest_int, put_fp16
from forge.quant.kernels.kquants import make_qp

QK = 256


@njit(inline="always", **JIT)
def _clamp(v: int, lo: int, hi: int) -> int:
    return lo if v < lo else (hi if v > hi else v)


@njit(**JIT)
def _snap_group(
    xval: np.ndarray,
    waux: np.ndarray,
    o: int,
    inv: float,
    scale: float,
    mags: np.ndarray,
    point_of_code: np.ndarray,
    nb_start: np.ndarray,
    nb_count: np.ndarray,
    nb_flat: np.ndarray,
    nb_cols: np.ndarray,
    terms: np.ndarray,
) -> int:
    """Round group xval[o:o+8] at 1/inv to a code; its point, or the best neighbour at ``scale``
    (``iq2_find_best_neighbour``: least sum_i waux_i*(scale*q_i - x_i)^2, first on ties)."""
    code = 0
    mul = 1
    for i in range(8):
        li = _clamp(nearest_int(F32(0.5) * (inv * xval[o + i] - F32(1))), 0, 2)
        code += li * mul
        mul *= 3
    p = point_of_code[code]
    if p >= 0:
        return p
    for i in range(8):  # the term of coordinate i at level l (magnitude 2l+1)
        for lv in range(3):
            diff = scale * F32(2 * lv + 1) - xval[o + i]
            terms[3 * i + lv] = waux[o + i] * diff * diff
    start = nb_start[code]
    best = F32(np.inf)
    best_p = nb_flat[start]
    for k in range(nb_count[code]):
        cand = nb_flat[start + k]
        d2 = F32(0)
        for i in range(8):
            d2 += terms[nb_cols[start + k, i]]
        if d2 < best:
            best = d2
            best_p = cand
    return best_p


@njit(**JIT)
def encode_iq2_xxs(
    rows: np.ndarray,
    imp: np.ndarray,
    mags: np.ndarray,
    point_of_code: np.ndarray,
    nb_start: np.ndarray,
    nb_count: np.ndarray,
    nb_flat: np.ndarray,
    nb_cols: np.ndarray,
    out: np.ndarray,
) -> None:
    n_rows, n_per_row = rows.shape
    nb = n_per_row // QK
    weight = np.empty(32, np.float32)
    waux = np.empty(32, np.float32)
    xval = np.empty(32, np.float32)
    levels = np.empty(32, np.uint8)
    terms = np.empty(24, np.float32)
    signs = np.empty(4, np.int64)
    pts = np.empty(4, np.int64)
    best_pts = np.empty(4, np.int64)
    scales = np.empty(8, np.float32)
    words = np.empty(16, np.uint32)
    for r in range(n_rows):
        for b in range(nb):
            x = rows[r, b * QK : (b + 1) * QK]
            y = out[r, b * 66 : (b + 1) * 66]
            words[:] = 0
            sumx2 = F32(0)
            for i in range(QK):
                sumx2 += x[i] * x[i]
            sigma2 = sumx2 / F32(QK)
            max_scale = F32(0)
            for ib in range(8):
                xb = x[32 * ib : 32 * ib + 32]
                qw = imp[b * QK + 32 * ib : b * QK + 32 * ib + 32]
                for i in range(32):
                    weight[i] = qw[i] * np.sqrt(sigma2 + xb[i] * xb[i])
                    waux[i] = np.sqrt(weight[i])
                for k in range(4):
                    nflip = 0
                    s = 0
                    for i in range(8):
                        v = xb[8 * k + i]
                        if v >= F32(0):
                            xval[8 * k + i] = v
                        else:
                            xval[8 * k + i] = -v
                            nflip += 1
                            s |= 1 << i
                    if nflip % 2:
                        imin = 0
                        mn = weight[8 * k] * xb[8 * k] * xb[8 * k]
                        for i in range(1, 8):
                            ax = weight[8 * k + i] * xb[8 * k + i] * xb[8 * k + i]
                            if ax < mn:
                                mn = ax
                                imin = i
                        xval[8 * k + imin] = -xval[8 * k + imin]
                        s ^= 1 << imin
                    signs[k] = s & 127
                mx = xval[0]
                for i in range(1, 32):
                    if xval[i] > mx:
                        mx = xval[i]
                scales[ib] = F32(0)
                if mx < GROUP_MAX_EPS:
                    continue
                scale = make_qp(xval, 32, 4, weight, levels)
                eff_max = scale * F32(3)
                if not eff_max > F32(0):
                    continue
                best = F32(0)
                for step in range(-6, 7):
                    inv = (F32(5) + F32(step) * F32(0.1)) / eff_max
                    this_scale = F32(1) / inv
                    for k in range(4):
                        pts[k] = _snap_group(
                            xval,
                            waux,
                            8 * k,
                            inv,
                            this_scale,
                            mags,
                            point_of_code,
                            nb_start,
                            nb_count,
                            nb_flat,
                            nb_cols,
                            terms,
                        )
                    sumqx = F32(0)
                    sumq2 = F32(0)
                    for i in range(32):
                        q = mags[pts[i >> 3], i & 7]
                        sumqx += weight[i] * xval[i] * q
                        sumq2 += weight[i] * q * q
                    if sumq2 > F32(0) and sumqx * sumqx > best * sumq2:
                        scale = sumqx / sumq2
                        best = scale * sumqx
                        for k in range(4):
                            best_pts[k] = pts[k]
                if scale > F32(0):
                    inv = F32(1) / scale
                    for k in range(4):
                        best_pts[k] = _snap_group(
                            xval,
                            waux,
                            8 * k,
                            inv,
                            scale,
                            mags,
                            point_of_code,
                            nb_start,
                            nb_count,
                            nb_flat,
                            nb_cols,
                            terms,
                        )
                    sumqx = F32(0)
                    sumq2 = F32(0)
                    for i in range(32):
                        q = mags[best_pts[i >> 3], i & 7]
                        sumqx += weight[i] * xval[i] * q
                        sumq2 += weight[i] * q * q
                    if sumq2 > F32(0):
                        scale = sumqx / sumq2
                if scale < F32(0):
                    scale = -scale
                    for k in range(4):
                        signs[k] = ~signs[k] & 127
                gw = np.uint32(0)
                sw = np.uint32(0)
                for k in range(4):
                    gw |= np.uint32(best_pts[k]) << np.uint32(8 * k)
                    sw |= np.uint32(signs[k]) << np.uint32(7 * k)
                words[2 * ib] = gw
                words[2 * ib + 1] = sw
                scales[ib] = scale
                if scale > max_scale:
                    max_scale = scale
            if max_scale == F32(0):
                y[:] = 0
                continue
            d = max_scale / F32(31)
            put_fp16(y, 0, d)
            inv_d = F32(1) / d
            for ib in range(8):
                li = _clamp(nearest_int(F32(0.5) * (inv_d * scales[ib] - F32(1))), 0, 15)
                words[2 * ib + 1] |= np.uint32(li) << np.uint32(28)
            for j in range(16):
                wv = words[j]
                for t in range(4):
                    y[2 + 4 * j + t] = (wv >> np.uint32(8 * t)) & np.uint32(0xFF)


_TABLES: dict = {}


def _tables(gtype: T) -> tuple[np.ndarray, ...]:
    if gtype not in _TABLES:
        cb = codebook(gtype)
        _TABLES[gtype] = (
            np.ascontiguousarray(cb.magnitudes, np.float32),
            np.ascontiguousarray(cb.point_of_code, np.int32),
            np.ascontiguousarray(cb.nb_start, np.int32),
            np.ascontiguousarray(cb.nb_count, np.int32),
            np.ascontiguousarray(cb.nb_flat, np.int32),
            np.ascontiguousarray(cb.nb_term_cols, np.int32),
        )
    return _TABLES[gtype]


def iq2_xxs(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    rows = np.ascontiguousarray(rows, np.float32)
    out = np.empty((rows.shape[0], rows.shape[1] // QK * 66), np.uint8)
    encode_iq2_xxs(rows, np.ascontiguousarray(importance, np.float32), *_tables(T.IQ2_XXS), out)
    return out
