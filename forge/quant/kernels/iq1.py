"""Compiled IQ1_S / IQ1_M encoders: ggml's ``quantize_row_iq1_s_impl`` / ``_iq1_m_impl``.

Same float32 operations in the same order as ``forge/quant/codecs/iq1.py`` (the reference and the
fallback): a stable sort of each sub-block, ggml's exhaustive scan over every pair of split points
(keeping the last record), then codebook snapping with the IQ2-style neighbour lists.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T
from numba import njit

from forge.jit import F32, JIT, nearest_int, put_fp16
from forge.quant.codecs.iq1 import X_M, X_P
from forge.quant.kernels.iq2 import _tables

QK = 256
_FLT_MAX = F32(np.finfo(np.float32).max)


@njit(inline="always", **JIT)
def _clamp(v: int, lo: int, hi: int) -> int:
    return lo if v < lo else (hi if v > hi else v)


@njit(**JIT)
def _stable_order(x: np.ndarray, n: int, order: np.ndarray) -> None:
    """Indices of x[:n] in ascending order, equal values kept in index order (insertion sort)."""
    for j in range(n):
        order[j] = j
    for j in range(1, n):
        k = order[j]
        v = x[k]
        i = j - 1
        while i >= 0 and v < x[order[i]]:
            order[i + 1] = order[i]
            i -= 1
        order[i + 1] = k


@njit(**JIT)
def _snap(
    lev: np.ndarray,
    o: int,
    x: np.ndarray,
    w: np.ndarray,
    scale: float,
    xx: np.ndarray,
    levels: np.ndarray,
    point_of_code: np.ndarray,
    nb_start: np.ndarray,
    nb_count: np.ndarray,
    nb_flat: np.ndarray,
) -> tuple[int, bool]:
    """The point of group lev[o:o+8], or (off the codebook) its neighbour of least
    Σ w·(scale·xx[l] − x)² (``iq1_find_best_neighbour2``, first on ties); and whether it was on."""
    code = 0
    mul = 1
    for i in range(8):
        code += lev[o + i] * mul
        mul *= 3
    p = point_of_code[code]
    if p >= 0:
        return p, True
    best = F32(np.inf)
    start = nb_start[code]
    p = nb_flat[start]
    for k in range(nb_count[code]):
        cand = nb_flat[start + k]
        d2 = F32(0)
        for i in range(8):
            diff = scale * xx[levels[cand, i]] - x[o + i]
            d2 += w[o + i] * diff * diff
        if d2 < best:
            best = d2
            p = cand
    return p, False


@njit(**JIT)
def encode_iq1_s(
    rows: np.ndarray,
    imp: np.ndarray,
    x_p: np.ndarray,
    x_m: np.ndarray,
    levels: np.ndarray,
    point_of_code: np.ndarray,
    nb_start: np.ndarray,
    nb_count: np.ndarray,
    nb_flat: np.ndarray,
    out: np.ndarray,
) -> None:
    n_rows, n_per_row = rows.shape
    nb = n_per_row // QK
    w = np.empty(32, np.float32)
    order = np.empty(32, np.int64)
    sumx = np.empty(33, np.float32)
    sumw = np.empty(33, np.float32)
    lev = np.empty(32, np.int64)
    point = np.zeros((8, 4), np.int64)
    scales = np.empty(8, np.float32)
    shifts = np.empty(8, np.int64)
    for r in range(n_rows):
        for b in range(nb):
            x = rows[r, b * QK : (b + 1) * QK]
            y = out[r, b * 50 : (b + 1) * 50]
            sumx2 = F32(0)
            for i in range(QK):
                sumx2 += x[i] * x[i]
            sigma2 = F32(2) * sumx2 / F32(QK)
            for ib in range(8):
                xb = x[32 * ib : 32 * ib + 32]
                amax = F32(0)
                for i in range(32):
                    w[i] = imp[b * QK + 32 * ib + i] * np.sqrt(sigma2 + xb[i] * xb[i])
                    if abs(xb[i]) > amax:
                        amax = abs(xb[i])
                scales[ib] = F32(0)
                shifts[ib] = 1
                for k in range(4):
                    point[ib, k] = 0
                if not amax >= F32(1e-12):
                    continue
                _stable_order(xb, 32, order)
                sumx[0] = F32(0)
                sumw[0] = F32(0)
                for j in range(32):
                    i = order[j]
                    sumx[j + 1] = sumx[j] + w[i] * xb[i]
                    sumw[j + 1] = sumw[j] + w[i]
                best = -_FLT_MAX
                scale = F32(0)
                b1 = -1
                b2 = -1
                shift = 0
                for i1 in range(33):
                    for i2 in range(i1, 33):
                        a = sumx[i1]
                        bb = sumx[i2] - sumx[i1]
                        c = sumx[32] - sumx[i2]
                        wa = sumw[i1]
                        wb = sumw[i2] - sumw[i1]
                        wc = sumw[32] - sumw[i2]
                        for s in range(2):
                            v = x_p if s == 0 else x_m
                            qx = a * v[0] + bb * v[1] + c * v[2]
                            q2 = wa * v[0] * v[0] + wb * v[1] * v[1] + wc * v[2] * v[2]
                            if q2 > F32(0) and qx * qx > best * q2:
                                scale = qx / q2
                                best = scale * qx
                                b1 = i1
                                b2 = i2
                                shift = 1 if s == 0 else -1
                if b1 < 0:
                    continue
                for j in range(32):
                    lev[order[j]] = 0 if j < b1 else (1 if j < b2 else 2)
                if scale < F32(0):
                    for j in range(32):
                        lev[j] = 2 - lev[j]
                    scale = -scale
                    shift = -shift
                xx = x_p if shift == 1 else x_m
                all_on = True
                for k in range(4):
                    p, on = _snap(
                        lev, 8 * k, xb, w, scale, xx, levels, point_of_code, nb_start, nb_count, nb_flat
                    )
                    point[ib, k] = p
                    all_on = all_on and on
                if not all_on:
                    sqx = F32(0)
                    sq2 = F32(0)
                    for i in range(32):
                        q = xx[levels[point[ib, i >> 3], i & 7]]
                        wq = w[i] * q
                        sqx += wq * xb[i]
                        sq2 += wq * q
                    if sqx > F32(0) and sq2 > F32(0):
                        scale = sqx / sq2
                scales[ib] = scale
                shifts[ib] = shift
            max_scale = scales[0]
            for ib in range(1, 8):
                if scales[ib] > max_scale:
                    max_scale = scales[ib]
            y[:] = 0
            d = max_scale / F32(15)
            empty = max_scale == F32(0)
            if not empty:
                put_fp16(y, 0, d * F32(1.125))
            inv_d = F32(1) / d
            for ib in range(8):
                h = 0
                for k in range(4):
                    y[2 + 4 * ib + k] = point[ib, k] & 0xFF
                    h |= (point[ib, k] >> 8) << (3 * k)
                if not empty:
                    ls = _clamp(nearest_int(F32(0.5) * (inv_d * scales[ib] - F32(1))), 0, 7)
                    if shifts[ib] == -1:
                        ls |= 8
                    h |= ls << 12
                y[34 + 2 * ib] = h & 0xFF
                y[35 + 2 * ib] = (h >> 8) & 0xFF


@njit(**JIT)
def encode_iq1_m(
    rows: np.ndarray,
    imp: np.ndarray,
    x_p: np.ndarray,
    x_m: np.ndarray,
    levels: np.ndarray,
    point_of_code: np.ndarray,
    nb_start: np.ndarray,
    nb_count: np.ndarray,
    nb_flat: np.ndarray,
    out: np.ndarray,
) -> None:
    n_rows, n_per_row = rows.shape
    nb = n_per_row // QK
    has_imp = imp.size > 0
    masks = np.array([0x00, 0x80, 0x08, 0x88], np.int64)
    cp1 = x_p[0] * x_p[0] - x_p[1] * x_p[1]
    cp2 = x_p[1] * x_p[1] - x_p[2] * x_p[2]
    cm1 = x_m[0] * x_m[0] - x_m[1] * x_m[1]
    cm2 = x_m[1] * x_m[1] - x_m[2] * x_m[2]
    w = np.empty(QK, np.float32)
    order = np.empty(16, np.int64)
    px = np.empty((2, 17), np.float32)
    pw = np.empty((2, 17), np.float32)
    lev = np.empty(16, np.int64)
    point = np.zeros((16, 2), np.int64)
    scales = np.empty(16, np.float32)
    shifts = np.empty(16, np.int64)
    xx = np.empty((2, 3), np.float32)
    qx = np.empty(4, np.float32)
    q2 = np.empty(4, np.float32)
    for r in range(n_rows):
        for b in range(nb):
            x = rows[r, b * QK : (b + 1) * QK]
            y = out[r, b * 56 : (b + 1) * 56]
            sumx2 = F32(0)
            for i in range(QK):
                sumx2 += x[i] * x[i]
            sigma2 = F32(2) * sumx2 / F32(QK)
            for i in range(QK):
                w[i] = imp[b * QK + i] * np.sqrt(sigma2 + x[i] * x[i]) if has_imp else x[i] * x[i]
            for ib in range(16):
                xb = x[16 * ib : 16 * ib + 16]
                wb = w[16 * ib : 16 * ib + 16]
                amax = F32(0)
                for i in range(16):
                    if abs(xb[i]) > amax:
                        amax = abs(xb[i])
                scales[ib] = F32(0)
                shifts[ib] = 0
                point[ib, 0] = 0
                point[ib, 1] = 0
                if not amax >= F32(1e-7):
                    continue
                _stable_order(xb, 16, order)
                for h in range(2):
                    px[h, 0] = F32(0)
                    pw[h, 0] = F32(0)
                for j in range(16):
                    i = order[j]
                    for h in range(2):
                        inside = (i >= 8) == (h == 1)
                        px[h, j + 1] = px[h, j] + (wb[i] * xb[i] if inside else F32(0))
                        pw[h, j + 1] = pw[h, j] + (wb[i] if inside else F32(0))
                best = -_FLT_MAX
                scale = F32(0)
                b1 = -1
                b2 = -1
                best_k = 0
                for i1 in range(17):
                    for i2 in range(i1, 17):
                        for k in range(4):
                            qx[k] = F32(0)
                            q2[k] = F32(0)
                        for h in range(2):
                            txs = px[h, 16]
                            tws = pw[h, 16]
                            sx = px[h, i1] + px[h, i2]
                            qxp = txs * x_p[2] - sx
                            qxm = txs * x_m[2] - sx
                            q2p = tws * x_p[2] * x_p[2] + pw[h, i1] * cp1 + pw[h, i2] * cp2
                            q2m = tws * x_m[2] * x_m[2] + pw[h, i1] * cm1 + pw[h, i2] * cm2
                            for k in range(4):
                                neg = (k >= 2) if h == 0 else (k % 2 == 1)
                                if h == 0:
                                    qx[k] = qxm if neg else qxp
                                    q2[k] = q2m if neg else q2p
                                else:
                                    qx[k] = qx[k] + (qxm if neg else qxp)
                                    q2[k] = q2[k] + (q2m if neg else q2p)
                        for k in range(4):
                            if q2[k] > F32(0) and qx[k] * qx[k] > best * q2[k]:
                                scale = qx[k] / q2[k]
                                best = scale * qx[k]
                                b1 = i1
                                b2 = i2
                                best_k = k
                if b1 < 0:
                    continue
                for j in range(16):
                    lev[order[j]] = 0 if j < b1 else (1 if j < b2 else 2)
                if scale < F32(0):
                    for j in range(16):
                        lev[j] = 2 - lev[j]
                    scale = -scale
                    best_k = 3 - best_k
                for t in range(3):
                    xx[0, t] = x_p[t] if best_k < 2 else x_m[t]
                    xx[1, t] = x_p[t] if best_k % 2 == 0 else x_m[t]
                all_on = True
                for g in range(2):
                    p, on = _snap(
                        lev, 8 * g, xb, wb, scale, xx[g], levels, point_of_code, nb_start, nb_count, nb_flat
                    )
                    point[ib, g] = p
                    all_on = all_on and on
                if not all_on:
                    sqx = F32(0)
                    sq2 = F32(0)
                    for i in range(16):
                        q = xx[i >> 3, levels[point[ib, i >> 3], i & 7]]
                        wq = wb[i] * q
                        sqx += wq * xb[i]
                        sq2 += wq * q
                    if sqx > F32(0) and sq2 > F32(0):
                        scale = sqx / sq2
                scales[ib] = scale
                shifts[ib] = best_k
            max_scale = scales[0]
            for ib in range(1, 16):
                if scales[ib] > max_scale:
                    max_scale = scales[ib]
            d = max_scale / F32(15)
            empty = max_scale == F32(0)
            inv_d = F32(1) / d
            ls = np.zeros(16, np.int64)
            y[:] = 0
            sqx = F32(0)
            sq2 = F32(0)
            for ib in range(16):
                if not empty:
                    ls[ib] = _clamp(nearest_int(F32(0.5) * (inv_d * scales[ib] - F32(1))), 0, 7)
                k = shifts[ib]
                for t in range(3):
                    xx[0, t] = x_p[t] if k < 2 else x_m[t]
                    xx[1, t] = x_p[t] if k % 2 == 0 else x_m[t]
                mult = F32(2 * ls[ib] + 1)
                for i in range(16):
                    q = xx[i >> 3, levels[point[ib, i >> 3], i & 7]] * mult
                    wq = w[16 * ib + i] * q
                    sqx += wq * x[16 * ib + i]
                    sq2 += wq * q
                y[2 * ib] = point[ib, 0] & 0xFF
                y[2 * ib + 1] = point[ib, 1] & 0xFF
                y[32 + ib] = (point[ib, 0] >> 8) | ((point[ib, 1] >> 8) << 4) | (0 if empty else masks[k])
            if sq2 > F32(0):
                d = sqx / sq2
            s_bits = 0
            if not empty:
                s_bits = _fp16_bits(d * F32(1.1125))
            for m in range(4):
                v = 0
                for t in range(4):
                    v |= ls[4 * m + t] << (3 * t)
                v |= ((s_bits >> (4 * m)) & 0xF) << 12
                y[48 + 2 * m] = v & 0xFF
                y[49 + 2 * m] = (v >> 8) & 0xFF


@njit(inline="always", **JIT)
def _fp16_bits(f: float) -> int:
    tmp = np.zeros(2, np.uint8)
    put_fp16(tmp, 0, f)
    return np.int64(tmp[0]) | (np.int64(tmp[1]) << 8)


def _run(gtype: T, rows: np.ndarray, importance: np.ndarray | None, type_size: int) -> np.ndarray:
    rows = np.ascontiguousarray(rows, np.float32)
    imp = np.empty(0, np.float32) if importance is None else np.ascontiguousarray(importance, np.float32)
    out = np.empty((rows.shape[0], rows.shape[1] // QK * type_size), np.uint8)
    mags, point_of_code, nb_start, nb_count, nb_flat, _ = _tables(gtype)
    levels = ((mags.astype(np.int64) - 1) // 2).astype(np.int64)
    fn = encode_iq1_s if gtype == T.IQ1_S else encode_iq1_m
    fn(rows, imp, X_P, X_M, levels, point_of_code, nb_start, nb_count, nb_flat, out)
    return out


def iq1_s(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    return _run(T.IQ1_S, rows, importance, 50)


def iq1_m(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    return _run(T.IQ1_M, rows, importance, 56)
