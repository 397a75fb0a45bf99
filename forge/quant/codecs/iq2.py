"""IQ2_XXS, IQ2_XS and IQ2_S: 2-bit codebook quants, bit-exact with ggml's quantize_iq2_xxs/xs/s.

Super-blocks of 256 weights are cut into sub-blocks (32 for XXS, 16 for XS/S) of groups of 8.
Each group is stored as a point of an 8-dimensional codebook (magnitudes 1, 3, 5 times the
sub-block scale) plus 8 sign bits; every sub-block gets a 4-bit scale relative to the super-block's
fp16 ``d``. The search, per sub-block, tries a ladder of scales, rounds each group to a code, snaps
off-codebook codes to their best neighbour and keeps the scale maximizing (sum w x q)^2 / sum w q^2.

Everything runs vectorized over all sub-blocks of a chunk; float32 sums that ggml accumulates
element by element are accumulated in the same order (``seq_sum``), since one ulp can flip a later
rounding or comparison. ggml-base is built without FMA, so no contraction is emulated.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType as T

from forge.quant.iq2_grid import CODE_WEIGHTS, Codebook, codebook
from forge.quant.kernels import accelerated
from forge.quant.numerics import fp16_bits, nearest_int
from forge.quant.types import BlockCodec

F = np.float32
QK_K = 256
GROUP_MAX_EPS = F(1e-15)
GROUP_MAX_EPS_IQ2_S = F(1e-8)
#: Super-blocks handled per vectorized step (bounds the temporaries to a few tens of MB).
CHUNK_BLOCKS = 8192


# ---------------------------------------------------------------- float helpers shared with iq1.py


def seq_sum(a: np.ndarray) -> np.ndarray:
    """float32 sum over the last axis, accumulated left to right like a C loop (not pairwise)."""
    return np.cumsum(a, axis=-1, dtype=F)[..., -1]


def block_encoder(encode_blocks: Callable[[np.ndarray, np.ndarray | None], np.ndarray]):  # noqa: ANN201
    """Adapt ``encode_blocks(x (N, 256), qw (N, 256) | None) -> uint8 (N, type_size)`` to whole rows."""

    def encode_rows(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
        n_rows = rows.shape[0]
        qw = None if importance is None else np.tile(importance.reshape(-1, QK_K), (n_rows, 1))
        return encode_blocks(rows.reshape(-1, QK_K), qw).reshape(n_rows, -1)

    return encode_rows


# ---------------------------------------------------------------- codebook search


_LEVEL_MAGS = np.array([1, 3, 5], F)


def snap(
    cb: Codebook,
    mags: np.ndarray,
    xval: np.ndarray,
    waux: np.ndarray,
    scale: np.ndarray,
    inv_scale: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Round groups (M, G, 8) at 1/inv_scale to codes; snap off-codebook ones to their best neighbour.

    Returns the point index (M, G) and whether the rounded code was itself a point.
    ``scale`` (M,) is what ggml passes to iq2_find_best_neighbour (1/id or the fitted scale).
    """
    t = F(0.5) * (inv_scale[:, None, None] * xval - F(1))
    lev = np.clip(nearest_int(t), 0, 2)
    codes = (lev * CODE_WEIGHTS).sum(-1)
    point = cb.point_of_code[codes]
    on_grid = point >= 0
    m_idx, g_idx = np.nonzero(~on_grid)
    if len(m_idx):
        # iq2_find_best_neighbour: sum_i waux_i * (s*q_i - x_i)^2 over the code's neighbours.
        diff = scale[m_idx, None, None] * _LEVEL_MAGS - xval[m_idx, g_idx][:, :, None]
        terms = waux[m_idx, g_idx][:, :, None] * diff * diff
        point[m_idx, g_idx] = cb.best_neighbour(codes[m_idx, g_idx], terms)
    return point, on_grid


def fit(weight: np.ndarray, xval: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sum w x q, sum w q^2) over each sub-block, in ggml's order."""
    return seq_sum(weight * xval * q), seq_sum(weight * q * q)


def make_qp_quants(nmax: int, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """ggml's make_qp_quants (scale of a non-negative-ish vector on levels 0..nmax), per row of x.

    Quirk kept: ggml stores L as uint8, so a negative level read back from L is 256 + level.
    Rows here always have max(x) >= GROUP_MAX_EPS (the caller skipped the others).
    """
    fn = F(nmax)
    mx = np.maximum(x.max(-1), F(0))
    iscale = fn / mx
    u8 = lambda a: (a & 0xFF).astype(F)  # noqa: E731
    lq = u8(nearest_int(iscale[:, None] * x))
    diff = x - (F(1) / iscale)[:, None] * lq
    best_mse = seq_sum(w * diff * diff)
    for is_ in (-4, -3, -2, -1, 1, 2, 3, 4):
        iscale_is = (F(0.1) * F(is_) + fn) / mx
        scale_is = F(1) / iscale_is
        lq = np.minimum(nmax, nearest_int(iscale_is[:, None] * x)).astype(F)
        diff = x - scale_is[:, None] * lq
        mse = seq_sum(w * diff * diff)
        better = mse < best_mse
        best_mse = np.where(better, mse, best_mse)
        iscale = np.where(better, iscale_is, iscale)
    lint = np.minimum(nmax, nearest_int(iscale[:, None] * x))
    lf = lint.astype(F)
    sumlx, suml2 = seq_sum(w * x * lf), seq_sum(w * lf * lf)
    stored = lint & 0xFF
    for _ in range(5):
        changed = np.zeros(len(x), bool)
        for i in range(x.shape[1]):
            wi, xi, li = w[:, i], x[:, i], stored[:, i].astype(F)
            slx = sumlx - wi * xi * li
            sl2 = suml2 - wi * li * li
            ok = (slx > 0) & (sl2 > 0)
            with np.errstate(divide="ignore", invalid="ignore"):
                new_l = np.minimum(nmax, nearest_int(xi * sl2 / slx))
            ok &= new_l != stored[:, i]
            nf = new_l.astype(F)
            slx = slx + wi * xi * nf
            sl2 = sl2 + wi * nf * nf
            ok &= slx * slx * suml2 > sumlx * sumlx * sl2
            stored[:, i] = np.where(ok, new_l & 0xFF, stored[:, i])
            sumlx = np.where(ok, slx, sumlx)
            suml2 = np.where(ok, sl2, suml2)
            changed |= ok
        if not changed.any():
            break
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(suml2 > 0, sumlx / suml2, F(0)).astype(F)


# ---------------------------------------------------------------- the three IQ2 encoders


def _signs(xb: np.ndarray, weight: np.ndarray, even_parity: bool) -> tuple[np.ndarray, np.ndarray]:
    """|x| per group (M, G, 8) and the sign bits. With even_parity (XXS/XS, 7 stored bits), a group
    with an odd number of negatives flips the sign of its element of least w*x^2, whose magnitude
    is then fitted as negative (ggml's trick; the decoder restores the 8th sign from parity)."""
    neg = xb < 0
    xval = np.where(neg, -xb, xb)
    signs = (neg << np.arange(8)).sum(-1)
    if even_parity:
        m, g = np.nonzero(neg.sum(-1) % 2 == 1)
        i = np.argmin(weight[m, g] * xb[m, g] * xb[m, g], axis=-1)
        xval[m, g, i] = -xval[m, g, i]
        signs[m, g] ^= 1 << i
        signs &= 127
    return xval, signs


def _search(gtype: T, cb: Codebook, xval: np.ndarray, weight: np.ndarray, mx: np.ndarray):
    """Per active sub-block (rows of xval (M, G, 8)): chosen points (M, G) and scale (M,)."""
    mags = cb.magnitudes
    m, g = xval.shape[:2]
    x2, w2 = xval.reshape(m, -1), weight.reshape(m, -1)
    waux = np.sqrt(weight)
    if gtype == T.IQ2_XXS:
        scale = make_qp_quants(4, x2, w2)
        eff_max = scale * F(3)
        steps, top = range(-6, 7), eff_max
    else:
        scale = mx / F(5)
        eff_max = scale
        steps, top = range(-9, 10), mx
    live = eff_max > 0  # XXS skips sub-blocks whose first fit is not positive
    best = np.zeros(m, F)
    point = np.zeros((m, g), np.int32)
    on_grid = np.ones((m, g), bool)
    with np.errstate(divide="ignore", invalid="ignore"):
        for is_ in steps:
            inv = (F(5) + F(is_) * F(0.1)) / top
            pt, og = snap(cb, mags, xval, waux, F(1) / inv, inv)
            sqx, sq2 = fit(w2, x2, mags[pt].reshape(m, -1))
            better = (sq2 > 0) & (sqx * sqx > best * sq2) & live
            scale = np.where(better, sqx / sq2, scale)
            best = np.where(better, scale * sqx, best)
            point = np.where(better[:, None], pt, point)
            on_grid = np.where(better[:, None], og, on_grid)
        # Final pass at the fitted scale: XXS re-snaps every group, XS/S only the groups whose
        # rounded code was off the codebook.
        redo = (scale > 0) & live
        if gtype != T.IQ2_XXS:
            redo &= ~on_grid.all(-1)
        r = np.flatnonzero(redo)
        if len(r):
            pt, _ = snap(cb, mags, xval[r], waux[r], scale[r], F(1) / scale[r])
            keep = np.zeros_like(on_grid[r]) if gtype == T.IQ2_XXS else on_grid[r]
            point[r] = np.where(keep, point[r], pt)
            sqx, sq2 = fit(w2[r], x2[r], mags[point[r]].reshape(len(r), -1))
            scale[r] = np.where(sq2 > 0, sqx / sq2, scale[r])
    scale = np.where(live, scale, F(0))
    point = np.where(live[:, None], point, 0)
    return point, scale, live


def _encode_chunk(gtype: T, x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    cb = codebook(gtype)
    n = len(x)
    sub = 32 if gtype == T.IQ2_XXS else 16
    nsub, ng = QK_K // sub, sub // 8
    m = n * nsub
    sumx2 = seq_sum(x * x)
    sigma2 = (F(2) * sumx2 if gtype == T.IQ2_S else sumx2) / F(QK_K)
    xb = x.reshape(m, sub)
    s2 = np.repeat(sigma2, nsub)[:, None]
    weight = qw.reshape(m, sub) * np.sqrt(s2 + xb * xb) if qw is not None else F(0.25) * s2 + xb * xb
    xg, wg = xb.reshape(m, ng, 8), weight.reshape(m, ng, 8)
    xval, signs = _signs(xg, wg, even_parity=gtype != T.IQ2_S)
    mx = xval.reshape(m, sub).max(-1)

    point = np.zeros((m, ng), np.int32)
    scale = np.zeros(m, F)
    act = np.flatnonzero(mx >= (GROUP_MAX_EPS_IQ2_S if gtype == T.IQ2_S else GROUP_MAX_EPS))
    written = np.zeros(m, bool)  # ggml wrote this sub-block's codes and signs
    if len(act):
        p, s, live = _search(gtype, cb, xval[act], wg[act], mx[act])
        flip = s < 0  # cannot happen for non-negative |x|; ggml flips scale and signs, so do we
        s = np.abs(s)
        signs[act] = np.where(flip[:, None], ~signs[act] & (255 if gtype == T.IQ2_S else 127), signs[act])
        point[act], scale[act], written[act] = p, s, live
    signs = np.where(written[:, None], signs, 0)

    scale_b = scale.reshape(n, nsub)
    max_scale = scale_b.max(1)
    d = max_scale / F(31)
    d_bits = fp16_bits(d * F(0.9875) if gtype == T.IQ2_S else d)
    with np.errstate(divide="ignore", invalid="ignore"):
        ls = np.clip(nearest_int(F(0.5) * ((F(1) / d)[:, None] * scale_b - F(1))), 0, 15)
    empty = max_scale == 0
    ls[empty] = 0
    d_bits[empty] = 0
    point_b, signs_b = point.reshape(n, nsub, ng), signs.reshape(n, nsub, ng)
    if gtype == T.IQ2_XXS:
        grid_word = (point_b.astype(np.uint32) << (8 * np.arange(4, dtype=np.uint32))).sum(
            -1, dtype=np.uint32
        )
        sign_word = (signs_b.astype(np.uint32) << (7 * np.arange(4, dtype=np.uint32))).sum(
            -1, dtype=np.uint32
        )
        sign_word |= ls.astype(np.uint32) << 28
        words = np.stack([grid_word, sign_word], -1).reshape(n, 16)
        words[empty] = 0
        return np.concatenate([d_bits.view(np.uint8).reshape(n, 2), words.view(np.uint8)], 1)
    packed_scales = (ls[:, 0::2] | (ls[:, 1::2] << 4)).astype(np.uint8)
    if gtype == T.IQ2_XS:
        qs = (point_b | (signs_b << 9)).astype(np.uint16).reshape(n, 32)
        qs[empty] = 0
        return np.concatenate([d_bits.view(np.uint8).reshape(n, 2), qs.view(np.uint8), packed_scales], 1)
    flat_point = point_b.reshape(n, 32)
    qh = ((flat_point >> 8).reshape(n, 8, 4) << (2 * np.arange(4))).sum(-1).astype(np.uint8)
    return np.concatenate(
        [
            d_bits.view(np.uint8).reshape(n, 2),
            (flat_point & 255).astype(np.uint8),
            signs_b.reshape(n, 32).astype(np.uint8),
            qh,
            packed_scales,
        ],
        1,
    )


class _IQ2(BlockCodec):
    uses_imatrix = True
    needs_imatrix = True
    requires_importance = True
    chunk_elems = CHUNK_BLOCKS * QK_K


class IQ2_XXS(_IQ2):
    """2.0625 bpw: 256-point codebook, 7 sign bits per 8 (even parity), 4-bit scale per 32."""

    ggml_type = T.IQ2_XXS
    _encode_chunk = staticmethod(
        accelerated("iq2.iq2_xxs", block_encoder(lambda x, qw: _encode_chunk(T.IQ2_XXS, x, qw)))
    )


class IQ2_XS(_IQ2):
    """2.3125 bpw: 512-point codebook, 7 sign bits per 8 (even parity), 4-bit scale per 16."""

    ggml_type = T.IQ2_XS
    _encode_chunk = staticmethod(
        accelerated("iq2.iq2_xs", block_encoder(lambda x, qw: _encode_chunk(T.IQ2_XS, x, qw)))
    )


class IQ2_S(_IQ2):
    """2.5625 bpw: 1024-point codebook, 8 sign bits per 8, 4-bit scale per 16.

    ggml quantizes it without importance weights too (weights 0.25*sigma^2 + x^2); llama-quantize
    still refuses the type without an imatrix except for token_embd/output.
    """

    ggml_type = T.IQ2_S
    requires_importance = False
    _encode_chunk = staticmethod(
        accelerated("iq2.iq2_s", block_encoder(lambda x, qw: _encode_chunk(T.IQ2_S, x, qw)))
    )
