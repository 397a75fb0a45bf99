"""Compiled K-quant encoders (Q2_K..Q6_K): ggml's C loops, one super-block at a time.

Same float32 operations in the same order as ``forge/quant/codecs/kquants.py`` (which is the
reference and the fallback), so the bytes are identical.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from forge.jit import F32, GROUP_MAX_EPS, JIT, fp16_round, nearest_int, put_fp16

QK = 256
_LIMIT = F32(4194303.0)


@njit(inline="always", **JIT)
def _clamp(v: int, lo: int, hi: int) -> int:
    return lo if v < lo else (hi if v > hi else v)


@njit(**JIT)
def make_qkx(
    x: np.ndarray,
    w: np.ndarray,
    n: int,
    nmax: int,
    rmin: float,
    rdelta: float,
    nstep: int,
    use_mad: bool,
    guarded: bool,
    L: np.ndarray,
    laux: np.ndarray,
) -> tuple[float, float]:
    """ggml ``make_qkx2_quants`` (guarded=False) / ``make_qkx3_quants`` (guarded=True, weights given).

    Returns (scale, the_min); the levels go to L[:n]. The guarded rounding of the search steps is
    numerics.make_qkx3_quants_t's: ``v > 0 ? nearest_int(MIN(v, nmax)) : 0``.
    """
    fnmax = F32(nmax)
    mn = x[0]
    mx = x[0]
    sum_w = w[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        if x[i] < mn:
            mn = x[i]
        if x[i] > mx:
            mx = x[i]
        sum_w += w[i]
        sum_x += w[i] * x[i]
    if mn > F32(0):
        mn = F32(0)
    if mx == mn:
        for i in range(n):
            L[i] = 0
        return F32(0), -mn
    iscale = fnmax / (mx - mn)
    scale = F32(1) / iscale
    best = F32(0)
    for i in range(n):
        li = _clamp(nearest_int(iscale * (x[i] - mn)), 0, nmax)
        L[i] = li
        diff = scale * F32(li) + mn - x[i]
        diff = abs(diff) if use_mad else diff * diff
        best += w[i] * diff
    for step in range(nstep + 1):
        iscale = (F32(rmin) + F32(rdelta) * F32(step) + fnmax) / (mx - mn)
        sum_l = F32(0)
        sum_l2 = F32(0)
        sum_xl = F32(0)
        for i in range(n):
            v = iscale * (x[i] - mn)
            if guarded:
                li = nearest_int(v if v < fnmax else fnmax) if v > F32(0) else 0
            else:
                li = _clamp(nearest_int(v), 0, nmax)
            laux[i] = li
            fl = F32(li)
            wl = w[i] * fl
            sum_l += wl
            sum_l2 += wl * fl
            sum_xl += wl * x[i]
        det = sum_w * sum_l2 - sum_l * sum_l
        if det > F32(0):
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            if this_min > F32(0):
                this_min = F32(0)
                this_scale = sum_xl / sum_l2
            cur = F32(0)
            for i in range(n):
                diff = this_scale * F32(laux[i]) + this_min - x[i]
                diff = abs(diff) if use_mad else diff * diff
                cur += w[i] * diff
            if cur < best:
                for i in range(n):
                    L[i] = laux[i]
                best = cur
                scale = this_scale
                mn = this_min
    return scale, -mn


@njit(**JIT)
def make_qkx_lanes(
    xt: np.ndarray,
    wt: np.ndarray,
    nmax: int,
    rmin: float,
    rdelta: float,
    nstep: int,
    use_mad: bool,
    guarded: bool,
    Lt: np.ndarray,
    scale_out: np.ndarray,
    min_out: np.ndarray,
) -> None:
    """:func:`make_qkx` for many sub-blocks at once, position-major: ``xt[i, j]`` is element i of
    sub-block j. Each lane runs ggml's loop for its sub-block (sums accumulate over i in order), so
    the lanes are independent and LLVM vectorizes across them; worth it from a few dozen lanes (a
    whole row of sub-blocks), not for the 8 of one super-block. Levels go to Lt, scale and the_min
    to scale_out/min_out."""
    n, nl = xt.shape
    fnmax = F32(nmax)
    mn = np.empty(nl, np.float32)
    mx = np.empty(nl, np.float32)
    mn0 = np.empty(nl, np.float32)
    sum_w = np.empty(nl, np.float32)
    sum_x = np.empty(nl, np.float32)
    iscale = np.empty(nl, np.float32)
    scale = np.empty(nl, np.float32)
    best = np.zeros(nl, np.float32)
    cur = np.empty(nl, np.float32)
    sum_l = np.empty(nl, np.float32)
    sum_l2 = np.empty(nl, np.float32)
    sum_xl = np.empty(nl, np.float32)
    this_scale = np.empty(nl, np.float32)
    this_min = np.empty(nl, np.float32)
    better = np.empty(nl, np.bool_)
    laux = np.empty((n, nl), np.uint8)  # local: known not to alias the inputs (vectorizable)
    for j in range(nl):
        mn[j] = xt[0, j]
        mx[j] = xt[0, j]
        sum_w[j] = wt[0, j]
        sum_x[j] = sum_w[j] * xt[0, j]
    for i in range(1, n):
        for j in range(nl):
            v = xt[i, j]
            if v < mn[j]:
                mn[j] = v
            if v > mx[j]:
                mx[j] = v
            sum_w[j] += wt[i, j]
            sum_x[j] += wt[i, j] * v
    for j in range(nl):
        if mn[j] > F32(0):
            mn[j] = F32(0)
        mn0[j] = mn[j]
        iscale[j] = fnmax / (mx[j] - mn[j])
        scale[j] = F32(1) / iscale[j]
    for i in range(n):
        for j in range(nl):
            li = _clamp(nearest_int(iscale[j] * (xt[i, j] - mn[j])), 0, nmax)
            Lt[i, j] = li
            diff = scale[j] * F32(li) + mn[j] - xt[i, j]
            diff = abs(diff) if use_mad else diff * diff
            best[j] += wt[i, j] * diff
    for step in range(nstep + 1):
        c = F32(rmin) + F32(rdelta) * F32(step) + fnmax
        for j in range(nl):
            iscale[j] = c / (mx[j] - mn[j])
            sum_l[j] = F32(0)
            sum_l2[j] = F32(0)
            sum_xl[j] = F32(0)
            cur[j] = F32(0)
        for i in range(n):
            for j in range(nl):
                v = iscale[j] * (xt[i, j] - mn[j])
                if guarded:
                    li = nearest_int(v if v < fnmax else fnmax) if v > F32(0) else 0
                else:
                    li = _clamp(nearest_int(v), 0, nmax)
                laux[i, j] = li
                fl = F32(li)
                wl = wt[i, j] * fl
                sum_l[j] += wl
                sum_l2[j] += wl * fl
                sum_xl[j] += wl * xt[i, j]
        for j in range(nl):
            det = sum_w[j] * sum_l2[j] - sum_l[j] * sum_l[j]
            ts = (sum_w[j] * sum_xl[j] - sum_x[j] * sum_l[j]) / det
            tm = (sum_l2[j] * sum_x[j] - sum_l[j] * sum_xl[j]) / det
            if tm > F32(0):
                tm = F32(0)
                ts = sum_xl[j] / sum_l2[j]
            this_scale[j] = ts
            this_min[j] = tm
            better[j] = det > F32(0)
        for i in range(n):
            for j in range(nl):
                diff = this_scale[j] * F32(laux[i, j]) + this_min[j] - xt[i, j]
                diff = abs(diff) if use_mad else diff * diff
                cur[j] += wt[i, j] * diff
        for j in range(nl):
            better[j] = better[j] and cur[j] < best[j]
            if better[j]:
                best[j] = cur[j]
                scale[j] = this_scale[j]
                mn[j] = this_min[j]
        for i in range(n):
            for j in range(nl):
                if better[j]:
                    Lt[i, j] = laux[i, j]
    for j in range(nl):
        if mx[j] == mn0[j]:  # flat sub-block: ggml returns before the search
            for i in range(n):
                Lt[i, j] = 0
            scale_out[j] = F32(0)
            min_out[j] = -mn0[j]
        else:
            scale_out[j] = scale[j]
            min_out[j] = -mn[j]


@njit(**JIT)
def make_qp(x: np.ndarray, n: int, nmax: int, w: np.ndarray, L: np.ndarray) -> float:
    """ggml ``make_qp_quants``; L (uint8 storage, as ggml) gets the levels."""
    fnmax = F32(nmax)
    mx = F32(0)
    for i in range(n):
        if x[i] > mx:
            mx = x[i]
    if mx < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return F32(0)
    iscale = fnmax / mx
    scale = F32(1) / iscale
    best = F32(0)
    for i in range(n):
        lv = F32(nearest_int(iscale * x[i]) & 0xFF)
        diff = x[i] - scale * lv
        best += w[i] * diff * diff
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_is = (F32(0.1) * F32(step) + fnmax) / mx
        scale_is = F32(1) / iscale_is
        mse = F32(0)
        for i in range(n):
            li = nearest_int(iscale_is * x[i])
            if li > nmax:
                li = nmax
            diff = x[i] - scale_is * F32(li)
            mse += w[i] * diff * diff
        if mse < best:
            best = mse
            iscale = iscale_is
    sumlx = F32(0)
    suml2 = F32(0)
    for i in range(n):
        li = nearest_int(iscale * x[i])
        if li > nmax:
            li = nmax
        L[i] = li & 0xFF
        fl = F32(li)
        sumlx += w[i] * x[i] * fl
        suml2 += w[i] * fl * fl
    for _ in range(5):
        changed = False
        for i in range(n):
            fl = F32(L[i])
            slx = sumlx - w[i] * x[i] * fl
            sl2 = suml2 - w[i] * fl * fl
            if slx > F32(0) and sl2 > F32(0):
                new_l = nearest_int(x[i] * sl2 / slx)
                if new_l > nmax:
                    new_l = nmax
                if new_l != L[i]:
                    fn = F32(new_l)
                    slx += w[i] * x[i] * fn
                    sl2 += w[i] * fn * fn
                    if slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l & 0xFF
                        sumlx = slx
                        suml2 = sl2
                        changed = True
        if not changed:
            break
    return sumlx / suml2 if suml2 > F32(0) else F32(0)


@njit(**JIT)
def make_qx_lanes(
    xt: np.ndarray, wt: np.ndarray, n: int, nl: int, nmax: int, scale_out: np.ndarray, Lt: np.ndarray
) -> None:
    """ggml ``make_qx_quants(n, nmax, x, L, rmse_type=1, w)`` for NL sub-blocks at once, position-major
    (see :func:`make_qkx_lanes`, also for n and nl); Lt gets l + nmax."""
    fnmax = F32(nmax)
    mx = np.zeros(nl, np.float32)
    amax = np.zeros(nl, np.float32)
    iscale = np.empty(nl, np.float32)
    best_iscale = np.empty(nl, np.float32)
    sumlx = np.zeros(nl, np.float32)
    suml2 = np.zeros(nl, np.float32)
    scale = np.empty(nl, np.float32)
    best = np.empty(nl, np.float32)
    wx = np.empty((n, nl), np.float32)
    for i in range(n):
        for j in range(nl):
            ax = abs(xt[i, j])
            if ax > amax[j]:
                amax[j] = ax
                mx[j] = xt[i, j]
            wx[i, j] = wt[i, j] * xt[i, j]
    for j in range(nl):
        iscale[j] = -fnmax / mx[j]
        best_iscale[j] = iscale[j]
    for i in range(n):
        for j in range(nl):
            fl = F32(_clamp(nearest_int(iscale[j] * xt[i, j]), -nmax, nmax - 1))
            sumlx[j] += wx[i, j] * fl
            suml2[j] += wt[i, j] * fl * fl
    for j in range(nl):
        scale[j] = sumlx[j] / suml2[j] if suml2[j] != F32(0) else F32(0)
        best[j] = scale[j] * sumlx[j]
    for step in range(-9, 10):
        if step == 0:
            continue
        for j in range(nl):
            iscale[j] = -(fnmax + F32(0.1) * F32(step)) / mx[j]
            sumlx[j] = F32(0)
            suml2[j] = F32(0)
        for i in range(n):
            for j in range(nl):
                fl = F32(_clamp(nearest_int(iscale[j] * xt[i, j]), -nmax, nmax - 1))
                sumlx[j] += wx[i, j] * fl
                suml2[j] += wt[i, j] * fl * fl
        for j in range(nl):
            if suml2[j] > F32(0) and sumlx[j] * sumlx[j] > best[j] * suml2[j]:
                scale[j] = sumlx[j] / suml2[j]
                best[j] = scale[j] * sumlx[j]
                best_iscale[j] = iscale[j]
    for i in range(n):
        for j in range(nl):
            Lt[i, j] = _clamp(nearest_int(best_iscale[j] * xt[i, j]), -nmax, nmax - 1) + nmax
    for j in range(nl):
        if amax[j] < GROUP_MAX_EPS:  # all zero
            scale_out[j] = F32(0)
            for i in range(n):
                Lt[i, j] = 0
        else:
            scale_out[j] = scale[j]


@njit(inline="always", **JIT)
def _u8_min(v: float, cap: int) -> int:
    li = nearest_int(v) & 0xFF
    return cap if li > cap else li


@njit(**JIT)
def encode_q45k(rows: np.ndarray, imp: np.ndarray, nmax: int, out: np.ndarray) -> None:
    """Q4_K (nmax 15) / Q5_K (nmax 31) rows; ``imp`` empty means no importance weights.

    The sub-block search runs over all sub-blocks of a row at once (make_qkx_lanes)."""
    n_rows, n_per_row = rows.shape
    nb = n_per_row // QK
    ns = nb * 8
    has_imp = imp.size > 0
    bsize = out.shape[1] // nb
    L = np.empty(QK, np.uint8)
    xt = np.empty((32, ns), np.float32)  # xt[i, s] = row[32 s + i]
    wt = np.empty((32, ns), np.float32)
    lt = np.empty((32, ns), np.uint8)
    all_scales = np.empty(ns, np.float32)
    all_mins = np.empty(ns, np.float32)
    sum_x2 = np.empty(ns, np.float32)
    sigma2 = np.empty(nb, np.float32)
    sw = np.empty(ns, np.float32)
    ls = np.empty(8, np.uint8)
    lm = np.empty(8, np.uint8)
    for r in range(n_rows):
        row = rows[r]
        for s in range(ns):
            for i in range(32):
                xt[i, s] = row[32 * s + i]
        if not has_imp:
            sum_x2[:] = F32(0)
            for i in range(32):
                for s in range(ns):
                    sum_x2[s] += xt[i, s] * xt[i, s]
            for s in range(ns):
                av_x = np.sqrt(sum_x2[s] / F32(32))
                for i in range(32):
                    wt[i, s] = av_x + abs(xt[i, s])
            if nmax == 15:
                make_qkx_lanes(xt, wt, 15, F32(-1.0), F32(0.1), 20, False, False, lt, all_scales, all_mins)
            else:
                make_qkx_lanes(xt, wt, 31, F32(-0.5), F32(0.1), 15, False, False, lt, all_scales, all_mins)
        else:
            for b in range(nb):
                total = F32(0)
                for i in range(QK):
                    total += row[b * QK + i] * row[b * QK + i]
                sigma2[b] = F32(2) * total / F32(QK)
            sw[:] = F32(0)
            for i in range(32):
                for s in range(ns):
                    wt[i, s] = imp[32 * s + i] * np.sqrt(sigma2[s // 8] + xt[i, s] * xt[i, s])
                    sw[s] += wt[i, s]
            make_qkx_lanes(xt, wt, nmax, F32(-0.9), F32(0.05), 36, False, True, lt, all_scales, all_mins)
        for b in range(nb):
            x = row[b * QK : (b + 1) * QK]
            y = out[r, b * bsize : (b + 1) * bsize]
            scales = all_scales[8 * b : 8 * b + 8]
            mins = all_mins[8 * b : 8 * b + 8]
            if not has_imp:
                max_scale = F32(0)
                max_min = F32(0)
                for j in range(8):
                    if scales[j] > max_scale:
                        max_scale = scales[j]
                    if mins[j] > max_min:
                        max_min = mins[j]
                inv_scale = F32(63) / max_scale if max_scale > F32(0) else F32(0)
                inv_min = F32(63) / max_min if max_min > F32(0) else F32(0)
                for j in range(8):
                    ls[j] = _u8_min(inv_scale * scales[j], 63)
                    lm[j] = _u8_min(inv_min * mins[j], 63)
                d_val = max_scale / F32(63)
                m_val = max_min / F32(63)
            else:
                d_val = make_qp(scales, 8, 63, sw[8 * b : 8 * b + 8], ls)
                m_val = make_qp(mins, 8, 63, sw[8 * b : 8 * b + 8], lm)
                for j in range(8):
                    if ls[j] > 63:
                        ls[j] = 63
                    if lm[j] > 63:
                        lm[j] = 63
            for j in range(8):
                for i in range(32):
                    L[32 * j + i] = lt[i, 8 * b + j]
            put_fp16(y, 0, d_val)
            put_fp16(y, 2, m_val)
            for j in range(4):
                y[4 + j] = ls[j] | ((ls[j + 4] >> 4) << 6)
                y[8 + j] = lm[j] | ((lm[j + 4] >> 4) << 6)
                y[12 + j] = (ls[j + 4] & 0xF) | ((lm[j + 4] & 0xF) << 4)
            d16 = fp16_round(d_val)
            m16 = fp16_round(m_val)
            for j in range(8):
                d = d16 * F32(ls[j])
                if d == F32(0):
                    continue
                dm = m16 * F32(lm[j])
                for i in range(32):
                    L[32 * j + i] = _clamp(nearest_int((x[32 * j + i] + dm) / d), 0, nmax)
            if nmax == 15:
                for c in range(4):
                    for i in range(32):
                        y[16 + 32 * c + i] = L[64 * c + i] | (L[64 * c + 32 + i] << 4)
            else:
                for i in range(32):
                    h = 0
                    for c in range(4):
                        h |= (L[64 * c + i] >> 4) << (2 * c)
                        h |= (L[64 * c + 32 + i] >> 4) << (2 * c + 1)
                    y[16 + i] = h
                for c in range(4):
                    for i in range(32):
                        y[48 + 32 * c + i] = (L[64 * c + i] & 0xF) | ((L[64 * c + 32 + i] & 0xF) << 4)


@njit(**JIT)
def encode_q6k(rows: np.ndarray, imp: np.ndarray, out: np.ndarray) -> None:
    """Q6_K rows; ``imp`` empty means weights x²."""
    n_rows, n_per_row = rows.shape
    nb = n_per_row // QK
    has_imp = imp.size > 0
    L = np.empty(QK, np.uint8)
    xt = np.empty((16, 16), np.float32)  # xt[i, j] = x[16j + i]
    wt = np.empty((16, 16), np.float32)
    lt = np.empty((16, 16), np.uint8)
    scales = np.empty(16, np.float32)
    sc = np.empty(16, np.int32)
    for r in range(n_rows):
        for b in range(nb):
            x = rows[r, b * QK : (b + 1) * QK]
            y = out[r, b * 210 : (b + 1) * 210]
            for j in range(16):
                for i in range(16):
                    v = x[16 * j + i]
                    xt[i, j] = v
                    wt[i, j] = imp[b * QK + 16 * j + i] if has_imp else v * v
            make_qx_lanes(xt, wt, 16, 16, 32, scales, lt)
            max_scale = F32(0)
            max_abs = F32(0)
            for j in range(16):
                s = scales[j]
                if abs(s) > max_abs:
                    max_abs = abs(s)
                    max_scale = s
            if max_abs < GROUP_MAX_EPS:
                y[:] = 0
                continue
            for j in range(16):
                for i in range(16):
                    L[16 * j + i] = lt[i, j]
            iscale = F32(-128) / max_scale
            d_val = F32(1) / iscale
            put_fp16(y, 208, d_val)
            d16 = fp16_round(d_val)
            for j in range(16):
                li = nearest_int(iscale * scales[j])
                sc[j] = 127 if li > 127 else li
                y[192 + j] = sc[j] & 0xFF
            for j in range(16):
                d = d16 * F32(sc[j])
                if d == F32(0):
                    continue
                for i in range(16):
                    L[16 * j + i] = _clamp(nearest_int(x[16 * j + i] / d), -32, 31) + 32
            for h in range(2):
                for i in range(32):
                    q0 = L[128 * h + i]
                    q1 = L[128 * h + 32 + i]
                    q2 = L[128 * h + 64 + i]
                    q3 = L[128 * h + 96 + i]
                    y[64 * h + i] = (q0 & 0xF) | ((q2 & 0xF) << 4)
                    y[64 * h + 32 + i] = (q1 & 0xF) | ((q3 & 0xF) << 4)
                    y[128 + 32 * h + i] = (q0 >> 4) | ((q1 >> 4) << 2) | ((q2 >> 4) << 4) | ((q3 >> 4) << 6)


@njit(**JIT)
def make_q3(x: np.ndarray, n: int, nmax: int, L: np.ndarray) -> float:
    """ggml ``make_q3_quants(n, nmax, x, L, do_rmse=true)`` (weights x²); L gets l + nmax."""
    amax = F32(0)
    mx = F32(0)
    for i in range(n):
        ax = abs(x[i])
        if ax > amax:
            amax = ax
            mx = x[i]
    if amax < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return F32(0)
    iscale = F32(-nmax) / mx
    lv = np.empty(16, np.int64)
    sumlx = F32(0)
    suml2 = F32(0)
    for i in range(n):
        li = _clamp(nearest_int(iscale * x[i]), -nmax, nmax - 1)
        lv[i] = li
        w = x[i] * x[i]
        sumlx += w * x[i] * F32(li)
        suml2 += w * F32(li) * F32(li)
    for _ in range(5):
        changed = False
        for i in range(n):
            w = x[i] * x[i]
            fl = F32(lv[i])
            slx = sumlx - w * x[i] * fl
            if slx > F32(0):
                sl2 = suml2 - w * fl * fl
                new_l = _clamp(nearest_int(x[i] * sl2 / slx), -nmax, nmax - 1)
                if new_l != lv[i]:
                    fn = F32(new_l)
                    slx += w * x[i] * fn
                    sl2 += w * fn * fn
                    if sl2 > F32(0) and slx * slx * suml2 > sumlx * sumlx * sl2:
                        lv[i] = new_l
                        sumlx = slx
                        suml2 = sl2
                        changed = True
        if not changed:
            break
    for i in range(n):
        L[i] = lv[i] + nmax
    return sumlx / suml2 if suml2 > F32(0) else F32(0)


@njit(**JIT)
def _pack_2bit_128(L: np.ndarray, y: np.ndarray, off: int) -> None:
    """256 2-bit values -> 64 bytes: per 128-chunk, byte l = v[l] | v[l+32]<<2 | v[l+64]<<4 | v[l+96]<<6."""
    for h in range(2):
        for i in range(32):
            v = 0
            for k in range(4):
                v |= (L[128 * h + 32 * k + i] & 3) << (2 * k)
            y[off + 32 * h + i] = v


@njit(**JIT)
def encode_q2k(rows: np.ndarray, imp: np.ndarray, out: np.ndarray) -> None:
    """Q2_K rows; ``imp`` empty means no importance weights."""
    n_rows, n_per_row = rows.shape
    nb = n_per_row // QK
    has_imp = imp.size > 0
    L = np.empty(QK, np.uint8)
    laux = np.empty(16, np.uint8)
    w = np.empty(16, np.float32)
    scales = np.empty(16, np.float32)
    mins = np.empty(16, np.float32)
    sw = np.empty(16, np.float32)
    ls = np.empty(16, np.uint8)
    lm = np.empty(16, np.uint8)
    for r in range(n_rows):
        for b in range(nb):
            x = rows[r, b * QK : (b + 1) * QK]
            y = out[r, b * 84 : (b + 1) * 84]
            if not has_imp:
                max_scale = F32(0)
                max_min = F32(0)
                for j in range(16):
                    xs = x[16 * j : 16 * j + 16]
                    for i in range(16):
                        w[i] = abs(xs[i])
                    s, m = make_qkx(xs, w, 16, 3, F32(-0.5), F32(0.1), 15, True, False, L[16 * j :], laux)
                    scales[j] = s
                    mins[j] = m
                    if s > max_scale:
                        max_scale = s
                    if m > max_min:
                        max_min = m
                inv_scale = F32(15) / max_scale if max_scale > F32(0) else F32(0)
                inv_min = F32(15) / max_min if max_min > F32(0) else F32(0)
                for j in range(16):
                    y[j] = (nearest_int(inv_scale * scales[j]) | (nearest_int(inv_min * mins[j]) << 4)) & 0xFF
                d_val = max_scale / F32(15)
                m_val = max_min / F32(15)
            else:
                total = F32(0)
                for i in range(QK):
                    total += x[i] * x[i]
                sigma2 = total / F32(QK)
                for j in range(16):
                    xs = x[16 * j : 16 * j + 16]
                    sumw = F32(0)
                    for i in range(16):
                        w[i] = imp[b * QK + 16 * j + i] * np.sqrt(sigma2 + xs[i] * xs[i])
                        sumw += w[i]
                    sw[j] = sumw
                    s, m = make_qkx(xs, w, 16, 3, F32(-0.9), F32(0.05), 36, False, True, L[16 * j :], laux)
                    scales[j] = s
                    mins[j] = m
                d_val = make_qp(scales, 16, 15, sw, ls)
                m_val = make_qp(mins, 16, 15, sw, lm)
                for j in range(16):
                    y[j] = (ls[j] | (lm[j] << 4)) & 0xFF
            put_fp16(y, 80, d_val)
            put_fp16(y, 82, m_val)
            d16 = fp16_round(d_val)
            m16 = fp16_round(m_val)
            for j in range(16):
                d = d16 * F32(y[j] & 0xF)
                if d == F32(0):
                    continue
                dm = m16 * F32(y[j] >> 4)
                for i in range(16):
                    L[16 * j + i] = _clamp(nearest_int((x[16 * j + i] + dm) / d), 0, 3)
            _pack_2bit_128(L, y, 16)


@njit(**JIT)
def encode_q3k(rows: np.ndarray, imp: np.ndarray, out: np.ndarray) -> None:
    """Q3_K rows; ``imp`` empty means no importance weights."""
    n_rows, n_per_row = rows.shape
    nb = n_per_row // QK
    has_imp = imp.size > 0
    L = np.empty(QK, np.uint8)
    xt = np.empty((16, 16), np.float32)
    wt = np.empty((16, 16), np.float32)
    lt = np.empty((16, 16), np.uint8)
    scales = np.empty(16, np.float32)
    st = np.empty((16, 1), np.float32)
    swt = np.empty((16, 1), np.float32)
    lst = np.empty((16, 1), np.uint8)
    d_out = np.empty(1, np.float32)
    ls = np.empty(16, np.int64)
    for r in range(n_rows):
        for b in range(nb):
            x = rows[r, b * QK : (b + 1) * QK]
            y = out[r, b * 110 : (b + 1) * 110]
            if not has_imp:
                amax = F32(0)
                max_scale = F32(0)
                for j in range(16):
                    s = make_q3(x[16 * j : 16 * j + 16], 16, 4, L[16 * j :])
                    scales[j] = s
                    if abs(s) > amax:
                        amax = abs(s)
                        max_scale = s
                if max_scale != F32(0):
                    iscale = F32(-32) / max_scale
                    for j in range(16):
                        li = ((nearest_int(iscale * scales[j]) + 128) & 0xFF) - 128  # through int8_t
                        ls[j] = _clamp(li, -32, 31) + 32
                    d_val = F32(1) / iscale
                else:
                    ls[:] = 0
                    d_val = F32(0)
            else:
                total = F32(0)
                for i in range(QK):
                    total += x[i] * x[i]
                sigma2 = F32(2) * total / F32(QK)
                for j in range(16):
                    for i in range(16):
                        v = x[16 * j + i]
                        xt[i, j] = v
                        wt[i, j] = imp[b * QK + 16 * j + i] * np.sqrt(sigma2 + v * v)
                for j in range(16):
                    sumw = F32(0)
                    for i in range(16):
                        sumw += wt[i, j]
                    swt[j, 0] = sumw
                make_qx_lanes(xt, wt, 16, 16, 4, scales, lt)
                for j in range(16):
                    st[j, 0] = scales[j]
                    for i in range(16):
                        L[16 * j + i] = lt[i, j]
                make_qx_lanes(st, swt, 16, 1, 32, d_out, lst)
                d_val = d_out[0]
                for j in range(16):
                    ls[j] = lst[j, 0]
            put_fp16(y, 108, d_val)
            for j in range(8):
                y[96 + j] = (ls[j] & 0xF) | ((ls[j + 8] & 0xF) << 4)
            for m in range(4):
                v = 0
                for k in range(4):
                    v |= (ls[4 * k + m] >> 4) << (2 * k)
                y[104 + m] = v
            d16 = fp16_round(d_val)
            for j in range(16):
                d = d16 * F32(ls[j] - 32)
                if d == F32(0):
                    continue
                for i in range(16):
                    L[16 * j + i] = _clamp(nearest_int(x[16 * j + i] / d), -4, 3) + 4
            for m in range(32):
                h = 0
                for k in range(8):
                    if L[32 * k + m] > 3:
                        h |= 1 << k
                y[m] = h
            _pack_2bit_128(L, y, 32)


# ---------------------------------------------------------------- entry points: (rows, importance) -> bytes


def _importance(importance: np.ndarray | None) -> np.ndarray:
    return np.empty(0, np.float32) if importance is None else np.ascontiguousarray(importance, np.float32)


def _run45(rows: np.ndarray, importance: np.ndarray | None, nmax: int, type_size: int) -> np.ndarray:
    rows = np.ascontiguousarray(rows, np.float32)
    out = np.empty((rows.shape[0], rows.shape[1] // QK * type_size), np.uint8)
    encode_q45k(rows, _importance(importance), nmax, out)
    return out


def q4_k(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    return _run45(rows, importance, 15, 144)


def q5_k(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    return _run45(rows, importance, 31, 176)


def q6_k(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    rows = np.ascontiguousarray(rows, np.float32)
    out = np.empty((rows.shape[0], rows.shape[1] // QK * 210), np.uint8)
    encode_q6k(rows, _importance(importance), out)
    return out


def q2_k(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    rows = np.ascontiguousarray(rows, np.float32)
    out = np.empty((rows.shape[0], rows.shape[1] // QK * 84), np.uint8)
    encode_q2k(rows, _importance(importance), out)
    return out


def q3_k(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    rows = np.ascontiguousarray(rows, np.float32)
    out = np.empty((rows.shape[0], rows.shape[1] // QK * 110), np.uint8)
    encode_q3k(rows, _importance(importance), out)
    return out
