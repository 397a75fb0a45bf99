"""Compiled IQ2_XXS / IQ2_XS / IQ2_S encoders: ggml's ``quantize_row_iq2_*_impl``, one super-block at a time.

Same float32 operations in the same order as ``forge/quant/codecs/iq2.py`` (the reference and the
fallback). Codebook lookups use forge/quant/iq2_grid.py's tables: base-3 group codes, the point of
a code (or -1) and, for off-codebook codes, ggml's neighbour lists in CSR form.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T
from numba import njit

from forge.jit import F32, GROUP_MAX_EPS, JIT, nearest_int, put_fp16
from forge.quant.iq2_grid import codebook
from forge.quant.kernels.kquants import make_qp

QK = 256


@njit(inline="always", **JIT)
def _clamp(v: int, lo: int, hi: int) -> int:
    return lo if v < lo else (hi if v > hi else v)


@njit(inline="always", **JIT)
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


@njit(**JIT)
def encode_iq2_xs_s(
    rows: np.ndarray,
    imp: np.ndarray,
    is_s: bool,
    mags: np.ndarray,
    point_of_code: np.ndarray,
    nb_start: np.ndarray,
    nb_count: np.ndarray,
    nb_flat: np.ndarray,
    nb_cols: np.ndarray,
    out: np.ndarray,
) -> None:
    """IQ2_XS (is_s False) / IQ2_S (is_s True): sub-blocks of 16 (two groups), scale ladder from
    max/5, a final re-snap of the off-codebook groups only. ``imp`` empty (IQ2_S only) means weights
    0.25*sigma2 + x^2."""
    n_rows, n_per_row = rows.shape
    nb = n_per_row // QK
    has_imp = imp.size > 0
    bsize = out.shape[1] // nb
    eps = F32(1e-8) if is_s else GROUP_MAX_EPS
    sign_mask = 255 if is_s else 127
    weight = np.empty(16, np.float32)
    waux = np.empty(16, np.float32)
    xval = np.empty(16, np.float32)
    terms = np.empty(24, np.float32)
    pts = np.empty(2, np.int64)
    on_grid = np.empty(2, np.bool_)
    best_pts = np.empty(2, np.int64)
    best_on_grid = np.empty(2, np.bool_)
    signs = np.zeros((16, 2), np.int64)
    points = np.zeros((16, 2), np.int64)
    scales = np.empty(16, np.float32)
    for r in range(n_rows):
        for b in range(nb):
            x = rows[r, b * QK : (b + 1) * QK]
            y = out[r, b * bsize : (b + 1) * bsize]
            sumx2 = F32(0)
            for i in range(QK):
                sumx2 += x[i] * x[i]
            sigma2 = (F32(2) * sumx2 if is_s else sumx2) / F32(QK)
            max_scale = F32(0)
            for ib in range(16):
                xb = x[16 * ib : 16 * ib + 16]
                for i in range(16):
                    if has_imp:
                        weight[i] = imp[b * QK + 16 * ib + i] * np.sqrt(sigma2 + xb[i] * xb[i])
                    else:
                        weight[i] = F32(0.25) * sigma2 + xb[i] * xb[i]
                    waux[i] = np.sqrt(weight[i])
                for k in range(2):
                    nflip = 0
                    sg = 0
                    for i in range(8):
                        v = xb[8 * k + i]
                        if v >= F32(0):
                            xval[8 * k + i] = v
                        else:
                            xval[8 * k + i] = -v
                            nflip += 1
                            sg |= 1 << i
                    if nflip % 2 and not is_s:
                        imin = 0
                        mn = weight[8 * k] * xb[8 * k] * xb[8 * k]
                        for i in range(1, 8):
                            ax = weight[8 * k + i] * xb[8 * k + i] * xb[8 * k + i]
                            if ax < mn:
                                mn = ax
                                imin = i
                        xval[8 * k + imin] = -xval[8 * k + imin]
                        sg ^= 1 << imin
                    signs[ib, k] = sg & sign_mask
                mx = xval[0]
                for i in range(1, 16):
                    if xval[i] > mx:
                        mx = xval[i]
                scales[ib] = F32(0)
                points[ib, 0] = 0
                points[ib, 1] = 0
                if mx < eps:
                    signs[ib, 0] = 0
                    signs[ib, 1] = 0
                    continue
                scale = mx / F32(5)
                best = F32(0)
                best_pts[0] = 0
                best_pts[1] = 0
                best_on_grid[0] = True
                best_on_grid[1] = True
                for step in range(-9, 10):
                    inv = (F32(5) + F32(step) * F32(0.1)) / mx
                    this_scale = F32(1) / inv
                    for k in range(2):
                        pts[k] = _snap_group(
                            xval, waux, 8 * k, inv, this_scale, mags, point_of_code, nb_start, nb_count, nb_flat,
                            nb_cols, terms,
                        )  # fmt: skip
                        on_grid[k] = _on_grid(xval, 8 * k, inv, point_of_code)
                    sumqx = F32(0)
                    sumq2 = F32(0)
                    for i in range(16):
                        q = mags[pts[i >> 3], i & 7]
                        sumqx += weight[i] * xval[i] * q
                        sumq2 += weight[i] * q * q
                    if sumq2 > F32(0) and sumqx * sumqx > best * sumq2:
                        scale = sumqx / sumq2
                        best = scale * sumqx
                        for k in range(2):
                            best_pts[k] = pts[k]
                            best_on_grid[k] = on_grid[k]
                if scale > F32(0) and not (best_on_grid[0] and best_on_grid[1]):
                    inv = F32(1) / scale
                    for k in range(2):
                        if not best_on_grid[k]:
                            best_pts[k] = _snap_group(
                                xval, waux, 8 * k, inv, scale, mags, point_of_code, nb_start, nb_count, nb_flat,
                                nb_cols, terms,
                            )  # fmt: skip
                    sumqx = F32(0)
                    sumq2 = F32(0)
                    for i in range(16):
                        q = mags[best_pts[i >> 3], i & 7]
                        sumqx += weight[i] * xval[i] * q
                        sumq2 += weight[i] * q * q
                    if sumq2 > F32(0):
                        scale = sumqx / sumq2
                if scale < F32(0):
                    scale = -scale
                    for k in range(2):
                        signs[ib, k] = ~signs[ib, k] & sign_mask
                points[ib, 0] = best_pts[0]
                points[ib, 1] = best_pts[1]
                scales[ib] = scale
                if scale > max_scale:
                    max_scale = scale
            y[:] = 0
            if max_scale == F32(0) and not is_s:
                continue
            d = max_scale / F32(31)
            if max_scale != F32(0):
                put_fp16(y, 0, d * F32(0.9875) if is_s else d)
            inv_d = F32(1) / d
            sc_off = bsize - 8
            for ib in range(16):
                li = 0
                if max_scale != F32(0):
                    li = _clamp(nearest_int(F32(0.5) * (inv_d * scales[ib] - F32(1))), 0, 15)
                y[sc_off + (ib >> 1)] |= li << (4 * (ib & 1))
            for ib in range(16):
                for k in range(2):
                    g = 2 * ib + k
                    p = points[ib, k]
                    if is_s:
                        y[2 + g] = p & 0xFF
                        y[34 + g] = signs[ib, k]
                        y[66 + (g >> 2)] |= (p >> 8) << (2 * (g & 3))
                    else:
                        v = p | (signs[ib, k] << 9)
                        y[2 + 2 * g] = v & 0xFF
                        y[3 + 2 * g] = (v >> 8) & 0xFF


@njit(inline="always", **JIT)
def _on_grid(xval: np.ndarray, o: int, inv: float, point_of_code: np.ndarray) -> bool:
    """Whether group xval[o:o+8] rounded at 1/inv is a codebook point."""
    code = 0
    mul = 1
    for i in range(8):
        code += _clamp(nearest_int(F32(0.5) * (inv * xval[o + i] - F32(1))), 0, 2) * mul
        mul *= 3
    return point_of_code[code] >= 0


_TABLES: dict = {}


def _tables(gtype: T) -> tuple[np.ndarray, ...]:
    if gtype not in _TABLES:
        cb = codebook(gtype)
        _TABLES[gtype] = (
            np.ascontiguousarray(cb.magnitudes, np.float32),
            np.ascontiguousarray(cb.point_of_code, np.int32),
            np.ascontiguousarray(cb.nb_start, np.int32),
            np.ascontiguousarray(cb.nb_count, np.int32),
            np.ascontiguousarray(cb.nb_flat, np.uint16),  # points < 2048
            np.ascontiguousarray(cb.nb_term_cols, np.uint8),  # < 24: a quarter of the cache lines
        )
    return _TABLES[gtype]


def iq2_xxs(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    rows = np.ascontiguousarray(rows, np.float32)
    out = np.empty((rows.shape[0], rows.shape[1] // QK * 66), np.uint8)
    encode_iq2_xxs(rows, np.ascontiguousarray(importance, np.float32), *_tables(T.IQ2_XXS), out)
    return out


def _run_xs_s(gtype: T, rows: np.ndarray, importance: np.ndarray | None, type_size: int) -> np.ndarray:
    rows = np.ascontiguousarray(rows, np.float32)
    imp = np.empty(0, np.float32) if importance is None else np.ascontiguousarray(importance, np.float32)
    out = np.empty((rows.shape[0], rows.shape[1] // QK * type_size), np.uint8)
    encode_iq2_xs_s(rows, imp, gtype == T.IQ2_S, *_tables(gtype), out)
    return out


def iq2_xs(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    return _run_xs_s(T.IQ2_XS, rows, importance, 74)


def iq2_s(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    return _run_xs_s(T.IQ2_S, rows, importance, 82)
