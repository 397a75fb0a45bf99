"""IQ2_XXS on torch: the same search, in the same float32 order, as codecs/iq2.py.

Sub-blocks of 32 are laid out position-major (32, M), element 8g + i of group g in row 8g + i, so
every per-sub-block sum is a sequential loop over rows. The codebook's neighbour lists are ragged
(1 to 150 points per off-grid code); the best-neighbour search scores every (query, neighbour)
pair at once and takes a segmented first-minimum with scatter_reduce.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from forge.quant.iq2_grid import CODE_WEIGHTS, codebook
from forge.quant.torch_codecs import device_encoder, iq2_triton, ops
from forge.quant.torch_codecs.kquants_triton import tame

QK_K = 256
SUB = 32  # IQ2_XXS sub-block
NG = SUB // 8
_LEVEL_MAGS = (1.0, 3.0, 5.0)


@dataclass(frozen=True)
class DeviceCodebook:
    mags: torch.Tensor  # (n_points, 8) float32 magnitudes 2l+1
    point_of_code: torch.Tensor  # (3**8,) int64, -1 off the codebook
    nb_start: torch.Tensor  # (3**8,) int64
    nb_count: torch.Tensor  # (3**8,) int64
    nb_flat: torch.Tensor  # (E,) int64 point index of each neighbour-list entry
    nb_cols: torch.Tensor  # (8, E) int64: column 3*i + l_i of each entry's coordinate i term
    code_weights: torch.Tensor  # (8, 1) int64


@cache
def device_codebook(gtype: T, device: str) -> DeviceCodebook:
    cb = codebook(gtype)

    def t(a: np.ndarray, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.as_tensor(np.array(a)).to(device=device, dtype=dtype)

    return DeviceCodebook(
        mags=t(cb.magnitudes, torch.float32),
        point_of_code=t(cb.point_of_code),
        nb_start=t(cb.nb_start),
        nb_count=t(cb.nb_count),
        nb_flat=t(cb.nb_flat),
        nb_cols=t(cb.nb_term_cols.T),
        code_weights=t(CODE_WEIGHTS[:, None]),
    )


def seq_sum_first(terms: torch.Tensor) -> torch.Tensor:
    """``np.cumsum(a)[-1]`` over axis 0: starts from the first term (iq2.py's seq_sum)."""
    return ops.seq_sum(terms, start_zero=False)


def best_neighbour(cb: DeviceCodebook, codes: torch.Tensor, terms: torch.Tensor) -> torch.Tensor:
    """Among each code's neighbours, the point of least score (the first on ties), as Codebook.best_neighbour.

    ``terms`` (Q, 8, 3): the term of coordinate i at level l; a point's score is the float32 sum of
    its 8 terms in coordinate order.
    """
    q = codes.shape[0]
    dev = codes.device
    take = torch.index_select  # 1-D gathers (much cheaper than advanced indexing on CPU)
    counts = take(cb.nb_count, 0, codes)
    qid = torch.repeat_interleave(torch.arange(q, device=dev), counts)
    first = torch.cumsum(counts, 0) - counts
    pair = torch.arange(qid.shape[0], device=dev)
    entry = take(take(cb.nb_start, 0, codes), 0, qid) + (pair - take(first, 0, qid))
    table = terms.reshape(-1)
    base = qid * 24
    score = take(table, 0, base + take(cb.nb_cols[0], 0, entry))
    for i in range(1, 8):
        score = score + take(table, 0, base + take(cb.nb_cols[i], 0, entry))
    inf = torch.full((q,), float("inf"), dtype=torch.float32, device=dev)
    low = inf.scatter_reduce(0, qid, score, reduce="amin", include_self=True)
    n_pairs = qid.shape[0]
    cand = torch.where(score == take(low, 0, qid), pair, torch.full_like(pair, n_pairs))
    pick = torch.full((q,), n_pairs, dtype=torch.int64, device=dev).scatter_reduce(
        0, qid, cand, reduce="amin", include_self=True
    )
    pick = torch.where(pick == n_pairs, first, pick)  # no finite score: ggml keeps the first entry
    return take(cb.nb_flat, 0, take(entry, 0, pick))


def snap(
    cb: DeviceCodebook, xval: torch.Tensor, waux: torch.Tensor, scale: torch.Tensor, inv_scale: torch.Tensor
) -> torch.Tensor:
    """Round the groups of xval (32, M) at 1/inv_scale to codes, off-codebook ones to their best
    neighbour at ``scale`` (iq2.snap). Returns point indices (NG, M) int64."""
    m = xval.shape[1]
    t = 0.5 * (inv_scale * xval - 1.0)
    lev = torch.clamp(ops.nearest_int(t), 0, 2).to(torch.int64)
    codes = (lev.reshape(NG, 8, m) * cb.code_weights).sum(dim=1)  # (NG, M), exact integer sum
    point = cb.point_of_code[codes]
    g_idx, m_idx = torch.nonzero(point < 0, as_tuple=True)
    if g_idx.numel():
        rows = (8 * g_idx)[None, :] + torch.arange(8, device=xval.device)[:, None]  # (8, Q)
        xg = xval[rows, m_idx[None, :]]  # (8, Q)
        wg = waux[rows, m_idx[None, :]]
        s = scale[m_idx]
        # terms[q, i, l] = waux * (s*mag_l - x)^2, in iq2.snap's operation order
        terms = torch.stack([wg * (s * mag - xg) * (s * mag - xg) for mag in _LEVEL_MAGS], dim=-1)
        point[g_idx, m_idx] = best_neighbour(cb, codes[g_idx, m_idx], terms.permute(1, 0, 2).contiguous())
    return point


def q_values(cb: DeviceCodebook, point: torch.Tensor) -> torch.Tensor:
    """Point indices (NG, M) -> their magnitudes position-major (32, M)."""
    return cb.mags[point].permute(0, 2, 1).reshape(SUB, -1)


def fit(weight: torch.Tensor, xval: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return seq_sum_first(weight * xval * q), seq_sum_first(weight * q * q)


def make_qp_quants(nmax: int, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """iq2.make_qp_quants on position-major x, w (n, M): the scale (M,)."""
    fn = float(nmax)
    zero = ops.scalar(0.0, x)
    mx = ops.np_maximum(x.amax(dim=0), zero)
    iscale = ops.div(fn, mx)

    def u8(a: torch.Tensor) -> torch.Tensor:
        return (a & 0xFF).to(torch.float32)

    lq = u8(ops.nearest_int(iscale * x))
    diff = x - ops.div(1.0, iscale) * lq
    best_mse = seq_sum_first(w * diff * diff)
    for is_ in (-4, -3, -2, -1, 1, 2, 3, 4):
        iscale_is = ops.div(float(np.float32(0.1) * np.float32(is_) + np.float32(fn)), mx)
        scale_is = ops.div(1.0, iscale_is)
        lq = torch.clamp(ops.nearest_int(iscale_is * x), max=nmax).to(torch.float32)
        diff = x - scale_is * lq
        mse = seq_sum_first(w * diff * diff)
        better = mse < best_mse
        best_mse = torch.where(better, mse, best_mse)
        iscale = torch.where(better, iscale_is, iscale)
    lint = torch.clamp(ops.nearest_int(iscale * x), max=nmax)
    lf = lint.to(torch.float32)
    sumlx, suml2 = seq_sum_first(w * x * lf), seq_sum_first(w * lf * lf)
    stored = lint & 0xFF
    for _ in range(5):
        changed = torch.zeros(x.shape[1], dtype=torch.bool, device=x.device)
        for i in range(x.shape[0]):
            wi, xi, li = w[i], x[i], stored[i].to(torch.float32)
            slx = sumlx - wi * xi * li
            sl2 = suml2 - wi * li * li
            ok = (slx > 0) & (sl2 > 0)
            new_l = torch.clamp(ops.nearest_int(ops.div(xi * sl2, slx)), max=nmax)
            ok &= new_l != stored[i]
            nf = new_l.to(torch.float32)
            slx = slx + wi * xi * nf
            sl2 = sl2 + wi * nf * nf
            ok &= slx * slx * suml2 > sumlx * sumlx * sl2
            stored[i] = torch.where(ok, new_l & 0xFF, stored[i])
            sumlx = torch.where(ok, slx, sumlx)
            suml2 = torch.where(ok, sl2, suml2)
            changed |= ok
        if not bool(changed.any()):
            break
    return torch.where(suml2 > 0, ops.div(sumlx, suml2), zero)


def _signs(xb: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """|x| (32, M) and the 7 stored sign bits per group (NG, M), ggml's even-parity trick (iq2._signs)."""
    m = xb.shape[1]
    dev = xb.device
    neg = xb < 0
    xval = torch.where(neg, -xb, xb)
    bit = torch.arange(8, device=dev)[None, :, None]
    neg_g = neg.reshape(NG, 8, m)
    signs = (neg_g.to(torch.int64) << bit).sum(dim=1)
    odd = neg_g.sum(dim=1) % 2 == 1
    least = torch.argmin((weight * xb * xb).reshape(NG, 8, m), dim=1)  # first on ties, as np.argmin
    flip = (bit == least[:, None, :]) & odd[:, None, :]
    xval = torch.where(flip.reshape(SUB, m), -xval, xval)
    signs = torch.where(odd, signs ^ (1 << least), signs) & 127
    return xval, signs


def _snap_fit(
    cb: DeviceCodebook, xval: torch.Tensor, waux: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
    inv_scale: torch.Tensor, fused: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """One search step: the points at ``scale`` (snap) and their fit's two sums."""
    if fused:
        return iq2_triton.snap_fit(cb, xval, waux, weight, scale, inv_scale)
    pt = snap(cb, xval, waux, scale, inv_scale)
    return (pt, *fit(weight, xval, q_values(cb, pt)))


def _search(
    cb: DeviceCodebook, xval: torch.Tensor, weight: torch.Tensor, fused: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """iq2._search for IQ2_XXS on every sub-block: points (NG, M), scale (M,) and live (M,); ``fused``: the
    steps by iq2_triton's kernels."""
    m = xval.shape[1]
    waux = ops.sqrt(weight)
    zero = ops.scalar(0.0, xval)
    scale = iq2_triton.qp_scale(4, xval, weight) if fused else make_qp_quants(4, xval, weight)
    top = scale * 3.0
    live = top > 0  # XXS skips sub-blocks whose first fit is not positive
    best = torch.zeros(m, dtype=torch.float32, device=xval.device)
    point = torch.zeros((NG, m), dtype=torch.int64, device=xval.device)
    for is_ in range(-6, 7):
        inv = ops.div(float(np.float32(5) + np.float32(is_) * np.float32(0.1)), top)
        pt, sqx, sq2 = _snap_fit(cb, xval, waux, weight, ops.div(1.0, inv), inv, fused)
        better = (sq2 > 0) & (sqx * sqx > best * sq2) & live
        scale = torch.where(better, ops.div(sqx, sq2), scale)
        best = torch.where(better, scale * sqx, best)
        point = torch.where(better, pt, point)
    # final pass at the fitted scale: every group is snapped again
    redo = (scale > 0) & live
    safe = torch.where(redo, scale, ops.scalar(1.0, xval))
    pt = snap(cb, xval, waux, safe, ops.div(1.0, safe))
    point = torch.where(redo, pt, point)
    sqx, sq2 = fit(weight, xval, q_values(cb, point))
    scale = torch.where(redo & (sq2 > 0), ops.div(sqx, sq2), scale)
    scale = torch.where(live, scale, zero)
    point = torch.where(live, point, torch.zeros_like(point))
    return point, scale, live


# peak device bytes per element measured on an H200: 234
@device_encoder(T.IQ2_XXS, bytes_per_elem=320)
def encode_iq2_xxs(rows: torch.Tensor, importance: torch.Tensor, fused: bool | None = None) -> torch.Tensor:
    """rows float32 (R, n_per_row), importance (n_per_row,) or one per row -> uint8 (R, row_bytes).
    ``fused``: the search steps by iq2_triton's kernels (default: where they serve: CUDA, checked in this
    process, a chunk of tame magnitudes)."""
    n_rows = rows.shape[0]
    dev = rows.device
    if fused is None:
        fused = iq2_triton.usable(dev) and tame(rows, importance)
    cb = device_codebook(T.IQ2_XXS, str(dev))
    x_sb = ops.to_t(rows.reshape(-1, QK_K))  # (256, N)
    n = x_sb.shape[1]
    sigma2 = ops.div(seq_sum_first(x_sb * x_sb), float(QK_K))
    del x_sb
    xb = ops.to_t(rows.reshape(-1, SUB))  # (32, M), M = N*8
    qw = ops.importance_t(importance, n_rows, SUB)
    weight = qw * ops.sqrt(torch.repeat_interleave(sigma2, QK_K // SUB)[None, :] + xb * xb)
    del qw
    xval, signs = _signs(xb, weight)
    del xb
    mx = xval.amax(dim=0)
    act = mx >= ops.GROUP_MAX_EPS
    # the search runs on every sub-block; those below GROUP_MAX_EPS (not act) are then reset, as
    # iq2.py never searches them
    point, scale, live = _search(cb, xval, weight, fused)
    # a negative fitted scale cannot occur for |x|; ggml would flip it and the signs, so do we
    signs = torch.where(act & (scale < 0), ~signs & 127, signs)
    scale = torch.where(act, scale.abs(), ops.scalar(0.0, scale))
    point = torch.where(act, point, torch.zeros_like(point))
    signs = torch.where(act & live, signs, torch.zeros_like(signs))

    scale_b = scale.reshape(n, 8)
    max_scale = scale_b.amax(dim=1)
    d = ops.div(max_scale, 31.0)
    d_bytes = ops.fp16_bytes(d)
    ls = torch.clamp(ops.nearest_int(0.5 * (ops.div(1.0, d)[:, None] * scale_b - 1.0)), 0, 15).to(torch.int64)
    empty = max_scale == 0
    ls = torch.where(empty[:, None], 0, ls)
    point_b = point.t().reshape(n, 8, NG)  # (N, sub-block, group)
    signs_b = signs.t().reshape(n, 8, NG)
    k = torch.arange(NG, device=dev)
    grid_word = (point_b << (8 * k)).sum(-1)
    sign_word = (signs_b << (7 * k)).sum(-1) | (ls << 28)
    words = torch.stack([grid_word, sign_word], -1).reshape(n, 16)
    words = torch.where(empty[:, None], 0, words)
    word_bytes = torch.stack([(words >> (8 * b)) & 0xFF for b in range(4)], -1).reshape(n, 64)
    d_bytes = torch.where(empty[:, None], 0, d_bytes.to(torch.int64))
    return torch.cat([d_bytes, word_bytes], dim=1).to(torch.uint8).reshape(n_rows, -1)
