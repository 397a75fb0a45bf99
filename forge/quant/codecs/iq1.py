"""IQ1_S and IQ1_M: ternary codebook quants, bit-exact with ggml's quantize_iq1_s / quantize_iq1_m.

Each group of 8 weights is a point of a 2048-point codebook of ternary vectors (levels -1, 0, 1),
shifted by +-delta (IQ1S_DELTA = IQ1M_DELTA = 0.125): the quantized values are scale * (level +- delta).
Per sub-block (32 weights for IQ1_S with one shift, 16 for IQ1_M with one shift per group of 8),
ggml finds the exact weighted least-squares split of the sorted values into three level classes
(every pair of split points, both shifts), then snaps off-codebook groups to their best neighbour.

ggml scans the candidate splits in order and keeps one only when (sum w x q)^2 > best * sum w q^2,
so the winner is the last "record". We score every candidate at once in float64, which decides
the winner whenever the best beats all others by a clear relative margin; the few sub-blocks with
near-ties are re-run as the exact float32 record scan.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from forge.quant.codecs.iq2 import QK_K, block_encoder, seq_sum
from forge.quant.iq2_grid import CODE_WEIGHTS, codebook
from forge.quant.kernels import accelerated
from forge.quant.numerics import fp16_bits, nearest_int
from forge.quant.types import BlockCodec

F = np.float32
DELTA = F(0.125)
#: Level values for a positive shift (x_p) and a negative one (x_m), as ggml's quantizer writes them.
X_P = np.array([F(-1) + DELTA, DELTA, F(1) + DELTA], F)
X_M = np.array([F(-1) - DELTA, -DELTA, F(1) - DELTA], F)
GROUP_MAX_EPS_IQ1_S = F(1e-12)
GROUP_MAX_EPS_IQ1_M = F(1e-7)
#: A float64 best score must beat the runner-up by this relative margin to skip the exact scan
#: (float32 rounding in ggml's comparison is a few 1e-7 relative).
_MARGIN = 1e-6
IQ1_CHUNK_BLOCKS = 512


def _split_pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    """All (i1, i2) with 0 <= i1 <= i2 <= n, in ggml's loop order."""
    i1, i2 = np.triu_indices(n + 1)
    return i1, i2


def _last_record(sumqx: np.ndarray, sumq2: np.ndarray) -> np.ndarray:
    """Index of the candidate ggml ends up with (the last accepted record), -1 when none is.

    Candidates are the columns of (M, C) float32 arrays, in ggml's scan order.
    """
    valid = sumq2 > 0
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        score = np.where(valid, sumqx.astype(np.float64) ** 2 / sumq2, -1.0)
    win = score.argmax(1)
    top = score[np.arange(len(score)), win]
    close = (score >= top[:, None] * (1 - _MARGIN)).sum(1)
    mag_qx, mag_q2 = np.abs(sumqx).max(1), np.abs(sumq2).max(1)
    # ggml's float32 products lose precision outside the normal range: decide those exactly too.
    exact = (close > 1) | (top <= 0) | (mag_qx < 1e-17) | (mag_q2 < 1e-17) | (mag_qx > 1e17) | (mag_q2 > 1e17)
    win = np.where(valid.any(1), win, -1)
    rows = np.flatnonzero(exact)
    if len(rows):
        qx, q2, ok = sumqx[rows], sumq2[rows], valid[rows]
        best = np.full(len(rows), -np.finfo(F).max, F)
        pick = np.full(len(rows), -1)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            for c in range(qx.shape[1]):
                a, b = qx[:, c], q2[:, c]
                take = ok[:, c] & (a * a > best * b)
                best = np.where(take, (a / b) * a, best)
                pick = np.where(take, c, pick)
        win[rows] = pick
    return win


def _snap_groups(cb, lev: np.ndarray, x: np.ndarray, w: np.ndarray, scale: np.ndarray, xx: np.ndarray):
    """Point index per group (M, G) for level codes lev (M, G, 8); off-codebook codes go to the
    neighbour minimizing sum w (scale*xx[l] - x)^2 (iq1_find_best_neighbour2). xx: (M, G, 3)."""
    codes = (lev * CODE_WEIGHTS).sum(-1)
    point = cb.point_of_code[codes]
    all_on_grid = (point >= 0).all(-1)
    m, g = np.nonzero(point < 0)
    if len(m):
        diff = scale[m, None, None] * xx[m, g][:, None, :] - x[m, g][:, :, None]
        terms = w[m, g][:, :, None] * diff * diff
        point[m, g] = cb.best_neighbour(codes[m, g], terms)
    return point, all_on_grid


def _prepare(x: np.ndarray, qw: np.ndarray | None, sub: int):
    n = len(x)
    m = n * (QK_K // sub)
    sigma2 = F(2) * seq_sum(x * x) / F(QK_K)
    xb = x.reshape(m, sub)
    s2 = np.repeat(sigma2, QK_K // sub)[:, None]
    weight = qw.reshape(m, sub) * np.sqrt(s2 + xb * xb) if qw is not None else xb * xb
    return xb, weight


def _sorted_prefix(xb: np.ndarray, weight: np.ndarray, half: np.ndarray | None):
    """Stable ascending sort of each sub-block and ggml's running sums of w*x and w over it."""
    order = np.argsort(xb, axis=1, kind="stable")  # glibc's qsort here is a stable merge sort
    xs = np.take_along_axis(xb, order, 1)
    ws = np.take_along_axis(weight, order, 1)
    wx = ws * xs
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(xb.shape[1]), 1)
    zero = np.zeros((len(xb), 1), F)
    if half is None:
        return (
            rank,
            np.concatenate([zero, np.cumsum(wx, 1, dtype=F)], 1),
            np.concatenate([zero, np.cumsum(ws, 1, dtype=F)], 1),
        )
    in_h = [np.take_along_axis(np.broadcast_to(half == h, xb.shape), order, 1) for h in (0, 1)]
    px = [np.concatenate([zero, np.cumsum(np.where(k, wx, F(0)), 1, dtype=F)], 1) for k in in_h]
    pw = [np.concatenate([zero, np.cumsum(np.where(k, ws, F(0)), 1, dtype=F)], 1) for k in in_h]
    return rank, px, pw


def _levels_from_split(rank: np.ndarray, i1: np.ndarray, i2: np.ndarray) -> np.ndarray:
    return (rank >= i1[:, None]).astype(np.int8) + (rank >= i2[:, None]).astype(np.int8)


# ---------------------------------------------------------------- IQ1_S


def _encode_iq1_s_chunk(x: np.ndarray, qw: np.ndarray) -> np.ndarray:
    cb = codebook(T.IQ1_S)
    n = len(x)
    m = n * 8
    xb, weight = _prepare(x, qw, 32)
    scale = np.zeros(m, F)
    shift = np.ones(m, np.int8)
    point = np.zeros((m, 4), np.int32)
    act = np.flatnonzero(np.abs(xb).max(1) >= GROUP_MAX_EPS_IQ1_S)
    if len(act):
        s, sh, p, ok = _search_iq1_s(cb, xb[act], weight[act])
        scale[act], shift[act], point[act] = np.where(ok, s, F(0)), np.where(ok, sh, 1), p
    qh = ((point >> 8) << (3 * np.arange(4))).sum(-1)
    scale_b = scale.reshape(n, 8)
    max_scale = scale_b.max(1)
    d = max_scale / F(15)
    with np.errstate(divide="ignore", invalid="ignore"):
        ls = np.clip(nearest_int(F(0.5) * ((F(1) / d)[:, None] * scale_b - F(1))), 0, 7)
    ls |= np.where(shift.reshape(n, 8) == -1, 8, 0)
    empty = max_scale == 0
    ls[empty] = 0
    d_bits = fp16_bits(d * F(1.125))
    d_bits[empty] = 0
    qh = (qh.reshape(n, 8) | (ls << 12)).astype(np.uint16)
    return np.concatenate(
        [
            d_bits.view(np.uint8).reshape(n, 2),
            (point & 255).astype(np.uint8).reshape(n, 32),
            qh.view(np.uint8),
        ],
        1,
    )


def _search_iq1_s(cb, xb: np.ndarray, weight: np.ndarray):
    m = len(xb)
    rank, sumx, sumw = _sorted_prefix(xb, weight, None)
    i1, i2 = _split_pairs(32)
    a, b, c = sumx[:, i1], sumx[:, i2] - sumx[:, i1], sumx[:, 32:33] - sumx[:, i2]
    wa, wb, wc = sumw[:, i1], sumw[:, i2] - sumw[:, i1], sumw[:, 32:33] - sumw[:, i2]
    sumqx = np.empty((m, 2 * len(i1)), F)
    sumq2 = np.empty_like(sumqx)
    for k, v in enumerate((X_P, X_M)):  # per split: the +delta candidate, then the -delta one
        sumqx[:, k::2] = a * v[0] + b * v[1] + c * v[2]
        sumq2[:, k::2] = wa * v[0] * v[0] + wb * v[1] * v[1] + wc * v[2] * v[2]
    win = _last_record(sumqx, sumq2)
    ok = win >= 0
    win = np.maximum(win, 0)
    rows = np.arange(m)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = sumqx[rows, win] / sumq2[rows, win]
    shift = np.where(win % 2 == 0, 1, -1).astype(np.int8)
    lev = _levels_from_split(rank, i1[win // 2], i2[win // 2])
    neg = scale < 0
    lev = np.where(neg[:, None], 2 - lev, lev)
    scale = np.abs(scale)
    shift = np.where(neg, -shift, shift)
    xx = np.where((shift == 1)[:, None], X_P, X_M)
    lev_g = lev.reshape(m, 4, 8)
    xg, wg = xb.reshape(m, 4, 8), weight.reshape(m, 4, 8)
    point, on_grid = _snap_groups(cb, lev_g, xg, wg, scale, np.broadcast_to(xx[:, None, :], (m, 4, 3)))
    refit = ~on_grid & ok
    if refit.any():
        r = np.flatnonzero(refit)
        q = np.take_along_axis(xx[r], cb.levels[point[r]].reshape(len(r), 32).astype(np.intp), 1)
        wq = weight[r] * q
        sqx, sq2 = seq_sum(wq * xb[r]), seq_sum(wq * q)
        with np.errstate(divide="ignore", invalid="ignore"):
            scale[r] = np.where((sqx > 0) & (sq2 > 0), sqx / sq2, scale[r])
    return scale, shift, np.where(ok[:, None], point, 0), ok


# ---------------------------------------------------------------- IQ1_M

_MASKS = np.array([0x00, 0x80, 0x08, 0x88], np.uint8)


def _group_level_values(best_k: np.ndarray) -> np.ndarray:
    """(M, 2, 3): the level values of each group of 8 for shift pattern k (0: ++, 1: +-, 2: -+, 3: --)."""
    first = np.where((best_k < 2)[:, None], X_P, X_M)
    second = np.where((best_k % 2 == 0)[:, None], X_P, X_M)
    return np.stack([first, second], 1)


def _encode_iq1_m_chunk(x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    cb = codebook(T.IQ1_M)
    n = len(x)
    m = n * 16
    xb, weight = _prepare(x, qw, 16)
    scale = np.zeros(m, F)
    shift = np.zeros(m, np.int64)
    point = np.zeros((m, 2), np.int32)
    act = np.flatnonzero(np.abs(xb).max(1) >= GROUP_MAX_EPS_IQ1_M)
    if len(act):
        s, k, p, ok = _search_iq1_m(cb, xb[act], weight[act])
        scale[act], shift[act], point[act] = np.where(ok, s, F(0)), np.where(ok, k, 0), p
    scale_b = scale.reshape(n, 16)
    max_scale = scale_b.max(1)
    d = max_scale / F(15)
    with np.errstate(divide="ignore", invalid="ignore"):
        ls = np.clip(nearest_int(F(0.5) * ((F(1) / d)[:, None] * scale_b - F(1))), 0, 7)
    empty = max_scale == 0
    ls[empty] = 0
    qh = (point[:, 0] >> 8) | ((point[:, 1] >> 8) << 4)
    qh = qh.reshape(n, 16) | np.where(empty[:, None], 0, _MASKS[shift.reshape(n, 16)])
    # Super-block scale: refit over all 256 weights with the coded sub-block scales (2l+1).
    xx = _group_level_values(shift)  # (m, 2, 3)
    lv = cb.levels[point].astype(np.intp)  # (m, 2, 8)
    q = np.take_along_axis(xx, lv, 2).reshape(n, 16, 16) * (2 * ls[:, :, None] + 1).astype(F)
    wq = weight.reshape(n, 16, 16) * q
    sqx = seq_sum((wq * xb.reshape(n, 16, 16)).reshape(n, QK_K))
    sq2 = seq_sum((wq * q).reshape(n, QK_K))
    with np.errstate(divide="ignore", invalid="ignore"):
        d = np.where(sq2 > 0, sqx / sq2, d)
    s_bits = fp16_bits(d * F(1.1125)).astype(np.uint16)
    s_bits[empty] = 0
    sc = (ls.reshape(n, 4, 4) << (3 * np.arange(4))).sum(-1).astype(np.uint16)
    sc |= (s_bits[:, None] >> (4 * np.arange(4, dtype=np.uint16)) & 0xF) << 12
    return np.concatenate(
        [(point & 255).astype(np.uint8).reshape(n, 32), qh.astype(np.uint8), sc.view(np.uint8)], 1
    )


def _search_iq1_m(cb, xb: np.ndarray, weight: np.ndarray):
    m = len(xb)
    half = (np.arange(16) >= 8).astype(np.int8)
    rank, px, pw = _sorted_prefix(xb, weight, half)
    i1, i2 = _split_pairs(16)
    p2, m2 = X_P[2], X_M[2]
    cp1, cp2 = X_P[0] * X_P[0] - X_P[1] * X_P[1], X_P[1] * X_P[1] - X_P[2] * X_P[2]
    cm1, cm2 = X_M[0] * X_M[0] - X_M[1] * X_M[1], X_M[1] * X_M[1] - X_M[2] * X_M[2]
    qx_p, qx_m, q2_p, q2_m = [], [], [], []
    for h in (0, 1):
        txs, tws = px[h][:, 16:17], pw[h][:, 16:17]
        sx = px[h][:, i1] + px[h][:, i2]
        qx_p.append(txs * p2 - sx)
        qx_m.append(txs * m2 - sx)
        q2_p.append(tws * p2 * p2 + pw[h][:, i1] * cp1 + pw[h][:, i2] * cp2)
        q2_m.append(tws * m2 * m2 + pw[h][:, i1] * cm1 + pw[h][:, i2] * cm2)
    sumqx = np.empty((m, 4 * len(i1)), F)
    sumq2 = np.empty_like(sumqx)
    for k in range(4):  # per split: shifts (+,+), (+,-), (-,+), (-,-) of the two groups of 8
        first, second = k >= 2, k % 2 == 1
        sumqx[:, k::4] = (qx_m if first else qx_p)[0] + (qx_m if second else qx_p)[1]
        sumq2[:, k::4] = (q2_m if first else q2_p)[0] + (q2_m if second else q2_p)[1]
    win = _last_record(sumqx, sumq2)
    ok = win >= 0
    win = np.maximum(win, 0)
    rows = np.arange(m)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = sumqx[rows, win] / sumq2[rows, win]
    best_k = win % 4
    lev = _levels_from_split(rank, i1[win // 4], i2[win // 4])
    neg = scale < 0
    lev = np.where(neg[:, None], 2 - lev, lev)
    scale = np.abs(scale)
    best_k = np.where(neg, 3 - best_k, best_k)
    xx = _group_level_values(best_k)
    xg, wg = xb.reshape(m, 2, 8), weight.reshape(m, 2, 8)
    point, on_grid = _snap_groups(cb, lev.reshape(m, 2, 8), xg, wg, scale, xx)
    refit = ~on_grid & ok
    if refit.any():
        r = np.flatnonzero(refit)
        q = np.take_along_axis(xx[r], cb.levels[point[r]].astype(np.intp), 2).reshape(len(r), 16)
        wq = weight[r] * q
        sqx, sq2 = seq_sum(wq * xb[r]), seq_sum(wq * q)
        with np.errstate(divide="ignore", invalid="ignore"):
            scale[r] = np.where((sqx > 0) & (sq2 > 0), sqx / sq2, scale[r])
    return scale, best_k, np.where(ok[:, None], point, 0), ok


class _IQ1(BlockCodec):
    uses_imatrix = True
    needs_imatrix = True
    chunk_elems = IQ1_CHUNK_BLOCKS * QK_K


class IQ1_S(_IQ1):
    """1.5625 bpw: 2048-point ternary codebook, one +-delta shift and a 3-bit scale per 32."""

    ggml_type = T.IQ1_S
    requires_importance = True
    _encode_chunk = staticmethod(
        accelerated("iq1.iq1_s", block_encoder(lambda x, qw: _encode_iq1_s_chunk(x, qw)))
    )


class IQ1_M(_IQ1):
    """1.75 bpw: 2048-point ternary codebook, a shift per 8, 3-bit scales per 16, fp16 d spread
    over the scale words' top nibbles. ggml also quantizes it without importance weights (w = x^2);
    llama-quantize refuses the type without an imatrix."""

    ggml_type = T.IQ1_M
    _encode_chunk = staticmethod(
        accelerated("iq1.iq1_m", block_encoder(lambda x, qw: _encode_iq1_m_chunk(x, qw)))
    )
