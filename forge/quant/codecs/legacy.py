"""Legacy 32-value block types Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: llama.cpp's quantizers, bit for bit.

Without importance weights these are ggml's ``quantize_row_<type>_ref`` (round-to-nearest from the
block's extreme values); with them, Q4_0/Q4_1/Q5_0/Q5_1 switch to ``quantize_row_<type>_impl``
(a weighted scale search, make_qx_quants / make_qkx3_quants). Q8_0 never reads importance.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
from gguf import GGMLQuantizationType as T

from forge.quant import numerics as nx
from forge.quant.kernels import accelerated
from forge.quant.numerics import F32
from forge.quant.types import BlockCodec

QK = 32


def _c_roundf(v: np.ndarray) -> np.ndarray:
    """C ``roundf``: halves away from zero (exact: v - trunc(v) has no rounding error)."""
    r = np.trunc(v)
    frac = v - r
    r += (frac >= F32(0.5)).astype(F32)
    r -= (frac <= F32(-0.5)).astype(F32)
    return r


def _inverse(d: np.ndarray) -> np.ndarray:
    """``d ? 1.0f/d : 0.0f``."""
    with np.errstate(divide="ignore"):
        return np.where(d != 0, F32(1) / d, F32(0)).astype(F32)


def _fp16_col(v: np.ndarray) -> np.ndarray:
    return nx.fp16_bits(v).view(np.uint8).reshape(-1, 2)


def _nibbles(levels: np.ndarray) -> np.ndarray:
    """(NB, 32) values -> (NB, 16) bytes: low nibble element j, high nibble element j+16."""
    lv = levels.astype(np.uint8)
    return (lv[:, :16] & 0xF) | ((lv[:, 16:] & 0xF) << 4)


def _high_bits(levels: np.ndarray) -> np.ndarray:
    """(NB, 32) 5-bit values -> (NB, 4) bytes: little-endian uint32 whose bit j is bit 4 of element j."""
    bits = ((levels.astype(np.uint32) >> 4) & 1) << np.arange(32, dtype=np.uint32)
    return np.bitwise_or.reduce(bits, axis=1).astype("<u4").view(np.uint8).reshape(-1, 4)


def _row_weights_t(rows: np.ndarray, importance: np.ndarray) -> np.ndarray:
    """``qw * sqrtf(sigma2 + x²)`` per element, sigma2 = Σx²/n over the whole row; position-major."""
    n_rows, n_per_row = rows.shape
    rows_t = nx.to_t(rows)
    sigma2 = nx.seq_sum(rows_t * rows_t) / F32(n_per_row)  # (R,)
    x_t = nx.to_t(rows.reshape(-1, QK))  # (32, R*nb)
    sig = np.repeat(sigma2, n_per_row // QK)[None, :]
    qw = np.tile(nx.to_t(importance.reshape(-1, QK)), (1, n_rows))
    return qw * np.sqrt(sig + x_t * x_t)


def _absmax_signed(blocks: np.ndarray) -> np.ndarray:
    return np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None], axis=1)[:, 0]


def encode_q8_0(rows: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    blocks = rows.reshape(-1, QK)
    d = np.abs(blocks).max(axis=1) / F32(127)
    q = _c_roundf(blocks * _inverse(d)[:, None]).astype(np.int8)
    return np.concatenate([_fp16_col(d), q.view(np.uint8)], axis=1).reshape(rows.shape[0], -1)


def _symmetric_ref(blocks: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0/Q5_0 ref: d = max / -nmax, level = MIN(2nmax-1, (int)(x/d + nmax + 0.5))."""
    d = _absmax_signed(blocks) / F32(-nmax)
    v = blocks * _inverse(d)[:, None] + F32(nmax + 0.5)
    return d, np.minimum(np.trunc(v), F32(2 * nmax - 1))


def _affine_ref(blocks: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1/Q5_1 ref: d = (max - min)/nmax, m = min, level = (int)((x - min)/d + 0.5)."""
    lo = blocks.min(axis=1)
    d = (blocks.max(axis=1) - lo) / F32(nmax)
    v = (blocks - lo[:, None]) * _inverse(d)[:, None] + F32(0.5)
    return d, lo, np.minimum(np.trunc(v), F32(nmax))


def encode_q4_0(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    if importance is None:
        d, levels = _symmetric_ref(rows.reshape(-1, QK), 8)
    else:
        d, levels_t = nx.make_qx_quants_t(nx.to_t(rows.reshape(-1, QK)), 8, _row_weights_t(rows, importance))
        levels = levels_t.T
    return np.concatenate([_fp16_col(d), _nibbles(levels)], axis=1).reshape(rows.shape[0], -1)


def encode_q5_0(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    if importance is None:
        d, levels = _symmetric_ref(rows.reshape(-1, QK), 16)
    else:
        d, levels_t = nx.make_qx_quants_t(nx.to_t(rows.reshape(-1, QK)), 16, _row_weights_t(rows, importance))
        levels = levels_t.T
    out = [_fp16_col(d), _high_bits(levels), _nibbles(levels)]
    return np.concatenate(out, axis=1).reshape(rows.shape[0], -1)


def _affine(rows: np.ndarray, importance: np.ndarray | None, nmax: int) -> tuple[np.ndarray, ...]:
    if importance is None:
        return _affine_ref(rows.reshape(-1, QK), nmax)
    x_t = nx.to_t(rows.reshape(-1, QK))
    d, the_min, levels_t = nx.make_qkx3_quants_t(
        x_t, _row_weights_t(rows, importance), nmax, -0.9, 0.05, 36, False
    )
    return d, -the_min, levels_t.T


def encode_q4_1(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    d, m, levels = _affine(rows, importance, 15)
    return np.concatenate([_fp16_col(d), _fp16_col(m), _nibbles(levels)], axis=1).reshape(rows.shape[0], -1)


def encode_q5_1(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    d, m, levels = _affine(rows, importance, 31)
    out = [_fp16_col(d), _fp16_col(m), _high_bits(levels), _nibbles(levels)]
    return np.concatenate(out, axis=1).reshape(rows.shape[0], -1)


class _Legacy(BlockCodec):
    uses_imatrix: ClassVar[bool] = True


class Q8_0(_Legacy):
    ggml_type = T.Q8_0
    uses_imatrix = False
    _encode_chunk = staticmethod(accelerated("q8.q8_0", encode_q8_0))


class Q4_0(_Legacy):
    ggml_type = T.Q4_0
    _encode_chunk = staticmethod(accelerated("legacy.q4_0", encode_q4_0))


class Q4_1(_Legacy):
    ggml_type = T.Q4_1
    _encode_chunk = staticmethod(accelerated("legacy.q4_1", encode_q4_1))


class Q5_0(_Legacy):
    ggml_type = T.Q5_0
    _encode_chunk = staticmethod(accelerated("legacy.q5_0", encode_q5_0))


class Q5_1(_Legacy):
    ggml_type = T.Q5_1
    _encode_chunk = staticmethod(accelerated("legacy.q5_1", encode_q5_1))
