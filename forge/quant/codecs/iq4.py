"""IQ4_NL and IQ4_XS: 4-bit non-linear quants (llama.cpp's ``quantize_row_iq4_nl_impl``).

Every element is one of 16 fixed levels (``IQ4_LEVELS``) times a block scale. IQ4_NL has one fp16
scale per 32 values; IQ4_XS has an fp16 super-block scale per 256 values and a 6-bit signed
sub-scale per 32. Both search 16 candidate scales per 32-value block, vectorized over all blocks.

Arrays inside the encoder are "position-major": shape (positions, blocks), so the loops over the
positions of a block (which must accumulate in C's sequential float32 order) touch contiguous rows.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

from forge.quant.kernels import accelerated
from forge.quant.numerics import fp16_bits, nearest_int, seq_sum
from forge.quant.types import BlockCodec

#: kvalues_iq4nl (ggml-common.h), ascending.
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
_LEVELS_F32 = IQ4_LEVELS.astype(np.float32)
_GROUP_MAX_EPS = np.float32(1e-15)
_NTRY = 7
#: Elements per encoder step: bounds the temporaries (a few dozen bytes per element).
_CHUNK_ELEMS = 1 << 17


def _seq_dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Σ_i a[i]·b[i] over axis 0 in C's order: products rounded to float32, then added one at a time.

    (ggml-quants.c lives in ggml-base, which is built without FMA, as the fixtures confirm.)
    """
    return seq_sum(a * b)


def _position_major(rows: np.ndarray, block: int) -> np.ndarray:
    """(n_rows, n_per_row) -> (block, n_rows * n_per_row // block); column = one block."""
    return np.ascontiguousarray(rows.reshape(-1, block).T)


def _importance_position_major(importance: np.ndarray, block: int, n_rows: int) -> np.ndarray:
    per_row = importance.reshape(-1, block).T
    return np.ascontiguousarray(np.tile(per_row, (1, n_rows)))


# --- IQ4 core ---------------------------------------------------------------------------------------


# best_index_int8 on the levels, by table: the levels are integers, so the pair of levels around
# al depends only on floor(al) (clipped to the table's range, where the outermost pair applies).
_FLOORS = np.arange(-128, 114, dtype=np.float32)
_UPPER = np.searchsorted(_LEVELS_F32, _FLOORS, side="right").clip(1, 15)
_LO_VAL, _HI_VAL = _LEVELS_F32[_UPPER - 1], _LEVELS_F32[_UPPER]


def _slot(al: np.ndarray) -> np.ndarray:
    """The table row of al; NaN (an overflowed search) takes the top row, where ggml's binary search ends."""
    return (np.floor(np.where(np.isnan(al), np.float32(113), al)).clip(-128, 113) + np.float32(128)).astype(
        np.intp
    )


def _best_level(al: np.ndarray) -> np.ndarray:
    """best_index_int8(16, kvalues_iq4nl, al): index of the nearest level; on a tie, or while the
    lower level is not strictly farther, ggml keeps the lower one."""
    slot = _slot(al)
    up = ~(al - _LO_VAL[slot] < _HI_VAL[slot] - al)  # ggml's test, so that NaN picks the upper level
    return (_UPPER[slot] - 1 + up).astype(np.uint8)


def _best_value(al: np.ndarray) -> np.ndarray:
    """The level value best_index_int8 picks, as float32."""
    slot = _slot(al)
    lo = _LO_VAL[slot]
    hi = _HI_VAL[slot]
    return np.where(al - lo < hi - al, lo, hi)


def _block_scales(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Best scale per 32-value block. x, w: (32, B). Returns d (B,), 0 for all-zero blocks."""
    ax = np.abs(x)
    imax = np.argmax(ax, axis=0)  # first position of the largest |x|, like the C scan
    cols = np.arange(x.shape[1])
    amax = ax[imax, cols]
    vmax = x[imax, cols]
    live = amax >= _GROUP_MAX_EPS
    safe_max = np.where(live, vmax, np.float32(1))

    def trial(inv_scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        q = _best_value(inv_scale * x)
        wq = w * q
        return _seq_dot(wq, x), _seq_dot(wq, q)

    d0 = -safe_max / _LEVELS_F32[0]
    sumqx, sumq2 = trial(np.float32(1) / d0)
    with np.errstate(divide="ignore", invalid="ignore"):
        d = np.where(sumq2 > 0, sumqx / sumq2, np.float32(0)).astype(np.float32)
    best = d * sumqx
    for itry in range(-_NTRY, _NTRY + 1):
        inv = (np.float32(itry) + _LEVELS_F32[0]) / safe_max
        sumqx, sumq2 = trial(inv)
        better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        with np.errstate(divide="ignore", invalid="ignore"):
            d_new = sumqx / sumq2
        d = np.where(better, d_new, d)
        best = np.where(better, d_new * sumqx, best)
    return np.where(live, d, np.float32(0)).astype(np.float32)


def _weights(x: np.ndarray, qw: np.ndarray | None, sigma2: np.ndarray) -> np.ndarray:
    if qw is None:
        return x * x
    return qw * np.sqrt(sigma2 + x * x)


def _sigma2(x: np.ndarray) -> np.ndarray:
    """2/n · Σx² over axis 0 (sequential, float32)."""
    return _seq_dot(x, x) * np.float32(2.0 / x.shape[0])


def _pack_nibbles(levels: np.ndarray) -> np.ndarray:
    """levels (32, B) -> (B, 16) bytes: byte j = level j | level j+16 << 4."""
    return np.ascontiguousarray((levels[:16] | (levels[16:] << 4)).T)


def _encode_iq4_nl(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    n_rows = rows.shape[0]
    x = _position_major(rows, 32)
    qw = None if importance is None else _importance_position_major(importance, 32, n_rows)
    w = _weights(x, qw, _sigma2(x))
    d = _block_scales(x, w)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    levels = _best_level(inv * x)
    out = np.empty((x.shape[1], 18), np.uint8)
    out[:, :2] = fp16_bits(d).view(np.uint8).reshape(-1, 2)
    out[:, 2:] = _pack_nibbles(levels)
    return out.reshape(n_rows, -1)


def _encode_iq4_xs(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    n_rows = rows.shape[0]
    xs = _position_major(rows, 256)  # (256, S)
    n_super = xs.shape[1]
    sigma2 = _sigma2(xs)
    qws = None if importance is None else _importance_position_major(importance, 256, n_rows)
    ws = _weights(xs, qws, sigma2)
    # sub-block view (32, 8*S): column ib*S + s is sub-block ib of super-block s
    x = np.ascontiguousarray(xs.reshape(8, 32, n_super).transpose(1, 0, 2).reshape(32, -1))
    w = np.ascontiguousarray(ws.reshape(8, 32, n_super).transpose(1, 0, 2).reshape(32, -1))
    scales = _block_scales(x, w).reshape(8, n_super)

    # the sub-scale of largest magnitude (first one on ties), with its sign
    imax = np.argmax(np.abs(scales), axis=0)
    max_scale = scales[imax, np.arange(n_super)]
    d = -max_scale / np.float32(32)
    with np.errstate(divide="ignore"):
        inv_d = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    ls = nearest_int(inv_d * scales).clip(-32, 31)  # (8, S)
    dl = d * ls.astype(np.float32)
    with np.errstate(divide="ignore"):
        inv_dl = np.where(dl != 0, np.float32(1) / dl, np.float32(0)).astype(np.float32)
    levels = _best_level(inv_dl.reshape(1, -1) * x)  # (32, 8*S)

    ls_u = (ls + 32).astype(np.uint16)  # 6 bits: low nibble in scales_l, top 2 bits in scales_h
    scales_h = np.zeros(n_super, np.uint16)
    for ib in range(8):
        scales_h |= (ls_u[ib] >> 4) << (2 * ib)
    scales_l = (ls_u[0::2] & 15) | ((ls_u[1::2] & 15) << 4)  # (4, S)

    out = np.empty((n_super, 136), np.uint8)
    out[:, 0:2] = fp16_bits(d).view(np.uint8).reshape(-1, 2)
    out[:, 2:4] = scales_h.view(np.uint8).reshape(-1, 2)
    out[:, 4:8] = scales_l.T.astype(np.uint8)
    nib = _pack_nibbles(levels).reshape(8, n_super, 16).transpose(1, 0, 2)
    out[:, 8:] = nib.reshape(n_super, 128)
    return out.reshape(n_rows, -1)


class RowChunkedCodec(BlockCodec):
    """The IQ4 and IQ3 types."""

    uses_imatrix = True
    chunk_elems = _CHUNK_ELEMS


class IQ4_NL(RowChunkedCodec):
    ggml_type = GGMLQuantizationType.IQ4_NL
    _encode_chunk = staticmethod(accelerated("iq4.iq4_nl", _encode_iq4_nl))


class IQ4_XS(RowChunkedCodec):
    ggml_type = GGMLQuantizationType.IQ4_XS
    _encode_chunk = staticmethod(accelerated("iq4.iq4_xs", _encode_iq4_xs))
