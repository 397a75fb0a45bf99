"""IQ3_XXS and IQ3_S: 3-bit grid quants (llama.cpp's ``quantize_row_iq3_xxs_impl`` / ``_iq3_s_impl``).

A super-block of 256 values is 8 sub-blocks of 32; each group of 4 magnitudes is one point of a grid
of 4-vectors (256 points for IQ3_XXS, 512 for IQ3_S, see forge.quant.iq3_grid), signs are stored
apart, and each sub-block has a 4-bit scale on top of an fp16 super-block scale. The encoder tries
a range of sub-block scales, snapping each group to the grid (or to its best listed neighbour),
and keeps the scale with the best weighted fit; all of it vectorized over every sub-block at once.

Inside, arrays are position-major: (32 positions, B sub-blocks), sub-block b = super-block b // 8,
sub-block b % 8; groups of 4 are (8 groups, B).
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

from forge.quant.codecs.iq4 import RowChunkedCodec, _importance_position_major, _position_major, _seq_dot
from forge.quant.iq3_grid import IQ3Grid, iq3s_grid, iq3xxs_grid
from forge.quant.kernels import accelerated
from forge.quant.numerics import fp16_bits, nearest_int

_KMAXQ = 8
_GROUP_MAX_EPS_IQ3_XXS = np.float32(1e-8)


def _levels_for(inv_scale: np.ndarray, xval: np.ndarray) -> np.ndarray:
    """clamp(nearest_int(0.5·(id·x − 1)), 0, 7): the level l of magnitude 2l+1."""
    half = np.float32(0.5) * (inv_scale * xval - np.float32(1))
    return nearest_int(half).clip(0, _KMAXQ - 1)


def _group_codes(levels: np.ndarray) -> np.ndarray:
    """levels (32, B) -> grid codes (8, B): l0 | l1<<3 | l2<<6 | l3<<9 per group of 4."""
    lv = levels.reshape(8, 4, -1)
    return lv[:, 0] | (lv[:, 1] << 3) | (lv[:, 2] << 6) | (lv[:, 3] << 9)


def _group_major(a: np.ndarray) -> np.ndarray:
    """(32, B) -> (4, 8·B): column k·B + b holds the 4 values of group k of sub-block b."""
    return np.ascontiguousarray(a.reshape(8, 4, -1).transpose(1, 0, 2)).reshape(4, -1)


def _best_neighbours(
    grid: IQ3Grid, codes: np.ndarray, rows: np.ndarray, xg: np.ndarray, wg: np.ndarray, scale: np.ndarray
) -> np.ndarray:
    """iq3_find_best_neighbour for n off-grid groups at once.

    codes (n,) their codes, rows (n,) their columns in xg/wg (group-major |x| and sqrt(weight)),
    scale (n,). Returns the grid index minimizing Σ waux·(scale·q − xval)² (float32, C's order)
    over the code's neighbour list, the first one on ties. Groups are sorted by neighbour count
    (radix sort of a uint8 key) so that neighbour slot j is a prefix of the arrays.
    """
    counts = np.take(grid.n_neighbours_u8, codes)
    order = np.argsort(~counts, kind="stable")
    # n_live[j]: how many groups have more than j neighbours (a prefix once sorted)
    n_live = len(codes) - np.cumsum(np.bincount(counts))[:-1]
    c = codes[order]
    sel = rows[order]
    x = np.take(xg, sel, axis=1)
    w = np.take(wg, sel, axis=1)
    s = scale[order]
    best_d2 = np.full(len(c), np.inf, np.float32)
    best_slot = np.zeros(len(c), np.uint8)
    for j, m in enumerate(n_live):
        q = np.take(grid.neighbour_magnitudes[j], c[:m], axis=1)  # (4, m)
        diff = s[:m] * q
        diff -= x[:, :m]
        term = w[:, :m] * diff
        term *= diff
        d2 = term[0] + term[1]  # C adds the four terms in order
        d2 += term[2]
        d2 += term[3]
        best = best_d2[:m]
        np.copyto(best_slot[:m], j, where=d2 < best)
        np.minimum(best, d2, out=best)
    out = np.empty(len(c), np.int32)
    out[order] = grid.neighbours_by_slot[best_slot, c]
    return out


def _snap(grid: IQ3Grid, inv_scale, scale, xval, xg, wg, search=None) -> tuple[np.ndarray, np.ndarray]:
    """Grid index (8, B) of every group for one scale per column, and which rounded codes were on
    the grid. Off-grid groups take their best neighbour (only where ``search`` allows, if given).
    xg, wg: group-major |x| and sqrt(weight) (see _group_major)."""
    codes = _group_codes(_levels_for(inv_scale, xval))
    index = np.take(grid.index_of_code, codes)
    on_grid = index >= 0
    off = ~on_grid if search is None else (~on_grid & search)
    flat = np.flatnonzero(off)
    if flat.size:
        n_cols = xval.shape[1]
        index.reshape(-1)[flat] = _best_neighbours(
            grid, codes.reshape(-1)[flat], flat, xg, wg, scale[flat % n_cols]
        )
    return index, on_grid


def _fit(grid: IQ3Grid, index: np.ndarray, wx: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Σ w·x·q and Σ w·q² (sequential, C order) for the grid points chosen per group."""
    q = np.empty((8, 4) + index.shape[1:], np.float32)
    for i in range(4):
        np.take(grid.magnitudes_by_coord[i], index, out=q[:, i])
    q = q.reshape(32, -1)
    return _seq_dot(wx, q), _seq_dot(w * q, q)


def _signs(x: np.ndarray, w: np.ndarray, even: bool) -> tuple[np.ndarray, np.ndarray]:
    """|x| and the sign bits (4, B) of each group of 8; ``even`` (IQ3_XXS) keeps an even number of
    minus signs per group by un-flipping the element with the least w·x², whose magnitude then
    enters the fit as negative."""
    neg = x < 0
    xval = np.where(neg, -x, x)
    neg8 = neg.reshape(4, 8, -1)
    if even:
        odd = (neg8.sum(axis=1) & 1).astype(bool)  # (4, B)
        imin = np.argmin((w * x * x).reshape(4, 8, -1), axis=1)
        k, b = np.nonzero(odd)
        i = imin[k, b]
        pos = 8 * k + i
        xval[pos, b] = -xval[pos, b]
        neg8 = neg8.copy()
        neg8[k, i, b] ^= True
    bits = (neg8.astype(np.uint8) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)
    if even:
        bits &= 127  # the 8th sign is implied by the parity
    return xval, bits


def _subblock_scales(grid: IQ3Grid, kind: str, x: np.ndarray, w: np.ndarray):
    """The scale search of one IQ3 type over sub-blocks x, w (32, B).

    Returns (scale (B,) >= 0, grid index (8, B), sign bits (4, B), live (B,)).
    """
    xxs = kind == "xxs"
    waux = np.sqrt(w)
    xval, bits = _signs(x, w, even=xxs)
    vmax = xval.max(axis=0)
    live = vmax >= _GROUP_MAX_EPS_IQ3_XXS if xxs else vmax != 0
    vmax = np.where(live, vmax, np.float32(1))
    wx = w * xval
    xg, wg = _group_major(xval), _group_major(waux)

    n_cols = x.shape[1]
    best = np.zeros(n_cols, np.float32)
    scale = vmax / np.float32(2 * _KMAXQ - 1)
    index = np.broadcast_to(grid.index_of_code[0], (8, n_cols)).astype(np.int32)  # L = 0
    on_grid = np.full((8, n_cols), xxs)
    steps = range(-15, 16) if xxs else range(-9, 10)
    for step in steps:
        inv = (np.float32(2 * _KMAXQ - 1) + np.float32(step) * np.float32(0.2)) / vmax
        idx, on = _snap(grid, inv, np.float32(1) / inv, xval, xg, wg)
        sumqx, sumq2 = _fit(grid, idx, wx, w)
        better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        new_scale = sumqx / sumq2
        scale = np.where(better, new_scale, scale)
        best = np.where(better, new_scale * sumqx, best)
        index = np.where(better, idx, index)
        on_grid = np.where(better, on, on_grid)

    # one more snap with the chosen scale where some group had to take a neighbour
    cols = np.flatnonzero((~on_grid).any(axis=0) & (scale > 0))
    if cols.size:
        sc = scale[cols]
        xv = np.take(xval, cols, axis=1)
        search = ~on_grid[:, cols] if xxs else None
        idx, _ = _snap(
            grid,
            np.float32(1) / sc,
            sc,
            xv,
            _group_major(xv),
            _group_major(np.take(waux, cols, axis=1)),
            search,
        )
        if xxs:  # IQ3_XXS keeps the groups that were on the grid; IQ3_S re-snaps all
            idx = np.where(on_grid[:, cols], index[:, cols], idx)
        index[:, cols] = idx
        sumqx, sumq2 = _fit(grid, idx, np.take(wx, cols, axis=1), np.take(w, cols, axis=1))
        scale[cols] = np.where(sumq2 > 0, sumqx / sumq2, sc)

    flip = scale < 0  # "should never happen" in llama.cpp, handled there by flipping every sign
    scale = np.where(flip, -scale, scale)
    bits = np.where(flip, ~bits & (127 if xxs else 255), bits).astype(np.uint8)
    scale = np.where(live, scale, np.float32(0))
    return scale, index, bits, live


def _superblock_setup(rows: np.ndarray, importance: np.ndarray | None):
    """x, w in sub-block position-major layout (32, S*8), column s*8 + ib."""
    n_rows = rows.shape[0]
    xs = _position_major(rows, 256)  # (256, S)
    sigma2 = _seq_dot(xs, xs) * np.float32(2) / np.float32(256)
    if importance is None:
        ws = xs * xs
    else:
        ws = _importance_position_major(importance, 256, n_rows) * np.sqrt(sigma2 + xs * xs)

    def sub(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a.reshape(8, 32, -1).transpose(1, 2, 0).reshape(32, -1))

    return sub(xs), sub(ws), xs.shape[1]


def _superblock_scales(scale: np.ndarray, n_super: int, fudge: float):
    """fp16 d bits (S,), 4-bit sub-scales (S, 8) and whether the super-block has any scale."""
    scales = scale.reshape(n_super, 8)
    max_scale = scales.max(axis=1)
    d = max_scale / np.float32(31)
    has = max_scale > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.float32(1) / d
    ls = nearest_int(np.float32(0.5) * (inv[:, None] * scales - np.float32(1))).clip(0, 15)
    d_bits = np.where(has, fp16_bits(d * np.float32(fudge)), 0).astype(np.uint16)
    return d_bits, np.where(has[:, None], ls, 0).astype(np.uint32), has


def _encode_iq3_xxs(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    n_rows = rows.shape[0]
    x, w, n_super = _superblock_setup(rows, importance)
    with np.errstate(all="ignore"):
        scale, index, bits, live = _subblock_scales(iq3xxs_grid(), "xxs", x, w)
        d_bits, ls, has = _superblock_scales(scale, n_super, 1.0125)
    index = np.where(live, index, 0).reshape(8, n_super, 8).transpose(1, 2, 0)  # (S, ib, k)
    bits = np.where(live, bits, 0).astype(np.uint32).reshape(4, n_super, 8)
    packed = bits[0] | (bits[1] << 7) | (bits[2] << 14) | (bits[3] << 21) | (ls << 28)
    packed = np.where(has[:, None], packed, 0).astype("<u4")  # an all-zero super-block is all zero
    index = np.where(has[:, None, None], index, 0)

    out = np.empty((n_super, 98), np.uint8)
    out[:, 0:2] = d_bits.astype("<u2").view(np.uint8).reshape(-1, 2)
    out[:, 2:66] = index.reshape(n_super, 64)
    out[:, 66:98] = packed.view(np.uint8).reshape(n_super, 32)
    return out.reshape(n_rows, -1)


def _encode_iq3_s(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    n_rows = rows.shape[0]
    x, w, n_super = _superblock_setup(rows, importance)
    with np.errstate(all="ignore"):
        scale, index, bits, live = _subblock_scales(iq3s_grid(), "s", x, w)
        d_bits, ls, _ = _superblock_scales(scale, n_super, 1.033)
    index = index.reshape(8, n_super, 8).transpose(1, 2, 0)  # (S, ib, k)
    live = live.reshape(n_super, 8)
    qh = ((index >> 8).astype(np.uint8) << np.arange(8, dtype=np.uint8)).sum(axis=2, dtype=np.uint8)
    qh = np.where(live, qh, 0)
    # llama.cpp advances its qs/signs write pointers only past sub-blocks it did not skip (all
    # zero), so the later sub-blocks' bytes move forward and the tail stays zero.
    s_idx, ib_idx = np.nonzero(live)
    slot = (np.cumsum(live, axis=1) - 1)[s_idx, ib_idx]
    qs = np.zeros((n_super, 8, 8), np.uint8)
    qs[s_idx, slot] = (index[s_idx, ib_idx] & 255).astype(np.uint8)
    signs = np.zeros((n_super, 8, 4), np.uint8)
    signs[s_idx, slot] = bits.reshape(4, n_super, 8).transpose(1, 2, 0)[s_idx, ib_idx]

    out = np.empty((n_super, 110), np.uint8)
    out[:, 0:2] = d_bits.astype("<u2").view(np.uint8).reshape(-1, 2)
    out[:, 2:66] = qs.reshape(n_super, 64)
    out[:, 66:74] = qh
    out[:, 74:106] = signs.reshape(n_super, 32)
    out[:, 106:110] = (ls[:, 0::2] | (ls[:, 1::2] << 4)).astype(np.uint8)
    return out.reshape(n_rows, -1)


class IQ3_XXS(RowChunkedCodec):
    ggml_type = GGMLQuantizationType.IQ3_XXS
    needs_imatrix = True
    _encode_chunk = staticmethod(accelerated("iq3.iq3_xxs", _encode_iq3_xxs))


class IQ3_S(RowChunkedCodec):
    ggml_type = GGMLQuantizationType.IQ3_S
    _encode_chunk = staticmethod(accelerated("iq3.iq3_s", _encode_iq3_s))
