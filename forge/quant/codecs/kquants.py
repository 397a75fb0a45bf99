"""K-quants Q2_K..Q6_K: llama.cpp's quantizers (ggml-quants.c), bit for bit, vectorized.

Every type has two encoders, as in llama.cpp's ``quantize_<type>``: the ``*_ref`` algorithm when no
importance weights are given and the ``*_impl`` algorithm (weighted by the imatrix column vector,
shared by every row) when they are. Super-blocks are 256 values; all blocks of a chunk of rows are
processed at once, with blocks laid out position-major (see forge/quant/numerics.py).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
from gguf import GGMLQuantizationType as T

from forge.quant import numerics as nx
from forge.quant.kernels import accelerated
from forge.quant.numerics import F32
from forge.quant.types import BlockCodec

QK = 256


def _sub_t(rows: np.ndarray, n: int) -> np.ndarray:
    """Rows (R, cols) -> sub-blocks of n, position-major (n, R*cols/n)."""
    return nx.to_t(rows.reshape(-1, n))


def _weights_t(importance: np.ndarray | None, n_rows: int, n: int) -> np.ndarray | None:
    """The imatrix column weights for every sub-block of n_rows rows, position-major."""
    if importance is None:
        return None
    return np.tile(nx.to_t(importance.reshape(-1, n)), (1, n_rows))


def _superblock_sumsq(rows: np.ndarray) -> np.ndarray:
    """Σx² over each 256-block in C order, (NB,)."""
    x = nx.to_t(rows.reshape(-1, QK))
    return nx.seq_sum(x * x)


def _requant_t(
    x_t: np.ndarray, levels: np.ndarray, d: np.ndarray, dm: np.ndarray | None, lo: int, hi: int, offset: int
) -> np.ndarray:
    """Recompute levels with the stored scales: clamp(nearest_int((x + dm)/d), lo, hi) + offset.

    Sub-blocks whose effective scale d is 0 keep the levels found by the search (as ggml does).
    """
    with np.errstate(all="ignore"):
        v = x_t if dm is None else x_t + dm
        q = nx.nearest_int_clip(v / d, lo, hi) + F32(offset)
    keep = d == 0
    if keep.any():
        q[:, keep] = levels[:, keep]
    return q.astype(np.uint8)


def _u8_min(values: np.ndarray, cap: int) -> np.ndarray:
    """``uint8_t l = nearest_int(v); l = MIN(cap, l)`` (uint8 wrap first)."""
    return np.minimum(nx.nearest_int(values) & 0xFF, cap).astype(np.uint8)


def _pack_scale_min_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins (NB, 8) -> the 12-byte Q4_K/Q5_K scale field (NB, 12)."""
    ls = ls.astype(np.uint8)
    lm = lm.astype(np.uint8)
    out = np.empty((ls.shape[0], 12), np.uint8)
    out[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    out[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    return out


def _encode_q45k(rows: np.ndarray, importance: np.ndarray | None, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K (nmax 15) / Q5_K (nmax 31) search and requantization.

    Returns (header (NB, 16) = d, dmin, scales[12]; levels (NB, 256) uint8 in 0..nmax).
    """
    n_rows = rows.shape[0]
    x_t = _sub_t(rows, 32)  # (32, NS), NS = NB*8
    ns = x_t.shape[1]
    nb = ns // 8
    if importance is None:
        sum_x2 = nx.seq_sum(x_t * x_t)
        av_x = np.sqrt(sum_x2 / F32(32))
        w_t = av_x + np.abs(x_t)
        if nmax == 15:
            scales, mins, levels = nx.make_qkx2_quants_t(x_t, w_t, 15, -1.0, 0.1, 20, False)
        else:
            scales, mins, levels = nx.make_qkx2_quants_t(x_t, w_t, 31, -0.5, 0.1, 15, False)
        scales = scales.reshape(nb, 8)
        mins = mins.reshape(nb, 8)
        max_scale = np.maximum(scales.max(axis=1), F32(0))
        max_min = np.maximum(mins.max(axis=1), F32(0))
        with np.errstate(divide="ignore"):
            inv_scale = np.where(max_scale > 0, F32(63) / max_scale, F32(0)).astype(F32)
            inv_min = np.where(max_min > 0, F32(63) / max_min, F32(0)).astype(F32)
        ls = _u8_min(inv_scale[:, None] * scales, 63)
        lm = _u8_min(inv_min[:, None] * mins, 63)
        d_val = max_scale / F32(63)
        m_val = max_min / F32(63)
    else:
        sigma2 = F32(2) * _superblock_sumsq(rows) / F32(QK)  # (NB,)
        sig_t = np.repeat(sigma2, 8)[None, :]  # per sub-block
        w_t = _weights_t(importance, n_rows, 32) * np.sqrt(sig_t + x_t * x_t)
        sw = nx.seq_sum(w_t)
        scales, mins, levels = nx.make_qkx3_quants_t(x_t, w_t, nmax, -0.9, 0.05, 36, False)
        sw_t = nx.to_t(sw.reshape(nb, 8))
        d_val, ls = nx.make_qp_quants_t(nx.to_t(scales.reshape(nb, 8)), 63, sw_t)
        m_val, lm = nx.make_qp_quants_t(nx.to_t(mins.reshape(nb, 8)), 63, sw_t)
        ls = np.minimum(ls.T, 63)
        lm = np.minimum(lm.T, 63)
    header = np.empty((nb, 16), np.uint8)
    header[:, 0:2] = nx.fp16_bits(d_val).view(np.uint8).reshape(nb, 2)
    header[:, 2:4] = nx.fp16_bits(m_val).view(np.uint8).reshape(nb, 2)
    header[:, 4:16] = _pack_scale_min_k4(ls, lm)
    d_eff = (nx.fp16_round(d_val)[:, None] * ls.astype(F32)).reshape(-1)
    dm_eff = (nx.fp16_round(m_val)[:, None] * lm.astype(F32)).reshape(-1)
    q_t = _requant_t(x_t, levels, d_eff, dm_eff, 0, nmax, 0)
    return header, np.ascontiguousarray(q_t.T).reshape(nb, QK)


def _pack_nibbles_64(levels: np.ndarray) -> np.ndarray:
    """(NB, 256) 4-bit values -> (NB, 128): per 64-chunk, byte l = v[l] | v[l+32] << 4."""
    q = levels.reshape(-1, 4, 2, 32) & 0xF
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def encode_q4_k(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    header, levels = _encode_q45k(rows, importance, 15)
    return np.concatenate([header, _pack_nibbles_64(levels)], axis=1).reshape(rows.shape[0], -1)


def encode_q5_k(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    header, levels = _encode_q45k(rows, importance, 31)
    nb = levels.shape[0]
    hi = (levels >> 4).reshape(nb, 4, 2, 32)  # chunk c, half, j
    shifts = (2 * np.arange(4)[:, None] + np.arange(2)[None, :]).astype(np.uint8)  # bit 2c + half
    qh = np.bitwise_or.reduce(hi << shifts[None, :, :, None], axis=(1, 2)).astype(np.uint8)
    ql = _pack_nibbles_64(levels)
    return np.concatenate([header, qh, ql], axis=1).reshape(rows.shape[0], -1)


def encode_q6_k(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    n_rows = rows.shape[0]
    x_t = _sub_t(rows, 16)  # (16, NS), NS = NB*16
    ns = x_t.shape[1]
    nb = ns // 16
    scale, levels = nx.make_qx_quants_t(x_t, 32, _weights_t(importance, n_rows, 16))
    scales = scale.reshape(nb, 16)
    max_scale = np.take_along_axis(scales, np.abs(scales).argmax(axis=1)[:, None], axis=1)[:, 0]
    zero = np.abs(max_scale) < nx.GROUP_MAX_EPS
    with np.errstate(all="ignore"):
        iscale = F32(-128) / np.where(zero, F32(1), max_scale)
        d_val = F32(1) / iscale
        sc = np.minimum(nx.nearest_int(iscale[:, None] * scales), 127).astype(np.int8)
    d_eff = (nx.fp16_round(d_val)[:, None] * sc.astype(F32)).reshape(-1)
    q = np.ascontiguousarray(_requant_t(x_t, levels, d_eff, None, -32, 31, 32).T).reshape(nb, 2, 4, 32)
    ql = ((q[:, :, 0:2] & 0xF) | ((q[:, :, 2:4] & 0xF) << 4)).reshape(nb, 128)
    shifts = np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]
    qh = np.bitwise_or.reduce((q >> 4) << shifts, axis=2).astype(np.uint8).reshape(nb, 64)
    out = np.concatenate(
        [ql, qh, sc.view(np.uint8), nx.fp16_bits(d_val).view(np.uint8).reshape(nb, 2)], axis=1
    )
    out[zero] = 0
    return out.reshape(n_rows, -1)


def _pack_2bit_128(levels: np.ndarray) -> np.ndarray:
    """(NB, 256) 2-bit values -> (NB, 64): per 128-chunk, byte l = v[l] | v[l+32]<<2 | v[l+64]<<4 | v[l+96]<<6."""
    q = levels.reshape(-1, 2, 4, 32) & 3
    shifts = np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]
    return np.bitwise_or.reduce(q << shifts, axis=2).astype(np.uint8).reshape(-1, 64)


def encode_q2_k(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    n_rows = rows.shape[0]
    x_t = _sub_t(rows, 16)  # (16, NS), NS = NB*16
    nb = x_t.shape[1] // 16
    if importance is None:
        scales, mins, levels = nx.make_qkx2_quants_t(x_t, np.abs(x_t), 3, -0.5, 0.1, 15, True)
        scales = scales.reshape(nb, 16)
        mins = mins.reshape(nb, 16)
        max_scale = np.maximum(scales.max(axis=1), F32(0))
        max_min = np.maximum(mins.max(axis=1), F32(0))
        with np.errstate(divide="ignore", invalid="ignore"):
            ls = nx.nearest_int((F32(15) / max_scale)[:, None] * scales)
            lm = nx.nearest_int((F32(15) / max_min)[:, None] * mins)
        ls = np.where((max_scale > 0)[:, None], ls, 0)
        lm = np.where((max_min > 0)[:, None], lm, 0)
        packed = ((ls | (lm << 4)) & 0xFF).astype(np.uint8)
        d_val = max_scale / F32(15)
        m_val = max_min / F32(15)
    else:
        sigma2 = _superblock_sumsq(rows) / F32(QK)
        sig_t = np.repeat(sigma2, 16)[None, :]
        w_t = _weights_t(importance, n_rows, 16) * np.sqrt(sig_t + x_t * x_t)
        sw_t = nx.to_t(nx.seq_sum(w_t).reshape(nb, 16))
        scales, mins, levels = nx.make_qkx3_quants_t(x_t, w_t, 3, -0.9, 0.05, 36, False)
        d_val, ls = nx.make_qp_quants_t(nx.to_t(scales.reshape(nb, 16)), 15, sw_t)
        m_val, lm = nx.make_qp_quants_t(nx.to_t(mins.reshape(nb, 16)), 15, sw_t)
        packed = (ls.T | (lm.T << 4)).astype(np.uint8)
    d_eff = (nx.fp16_round(d_val)[:, None] * (packed & 0xF).astype(F32)).reshape(-1)
    dm_eff = (nx.fp16_round(m_val)[:, None] * (packed >> 4).astype(F32)).reshape(-1)
    q = np.ascontiguousarray(_requant_t(x_t, levels, d_eff, dm_eff, 0, 3, 0).T).reshape(nb, QK)
    d16 = nx.fp16_bits(d_val).view(np.uint8).reshape(nb, 2)
    m16 = nx.fp16_bits(m_val).view(np.uint8).reshape(nb, 2)
    return np.concatenate([packed, _pack_2bit_128(q), d16, m16], axis=1).reshape(n_rows, -1)


def _pack_q3_scales(ls: np.ndarray) -> np.ndarray:
    """16 six-bit scales (NB, 16) -> 12 bytes: low nibbles of j and j+8, then 2-bit highs by j%4, j/4."""
    ls = ls.astype(np.uint8)
    out = np.empty((ls.shape[0], 12), np.uint8)
    out[:, :8] = (ls[:, :8] & 0xF) | ((ls[:, 8:] & 0xF) << 4)
    hi = (ls >> 4).reshape(-1, 4, 4)  # [j // 4, j % 4]
    shifts = np.array([0, 2, 4, 6], np.uint8)[None, :, None]
    out[:, 8:] = np.bitwise_or.reduce(hi << shifts, axis=1)
    return out


def encode_q3_k(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    n_rows = rows.shape[0]
    x_t = _sub_t(rows, 16)
    nb = x_t.shape[1] // 16
    if importance is None:
        scale, levels = nx.make_q3_quants_t(x_t, 4)
        scales = scale.reshape(nb, 16)
        max_scale = np.take_along_axis(scales, np.abs(scales).argmax(axis=1)[:, None], axis=1)[:, 0]
        nonzero = max_scale != 0
        with np.errstate(divide="ignore", invalid="ignore"):
            iscale = F32(-32) / np.where(nonzero, max_scale, F32(1))
            li = nx.nearest_int(iscale[:, None] * scales)
        li = ((li + 128) & 0xFF) - 128  # stored through int8_t
        ls = np.where(nonzero[:, None], np.clip(li, -32, 31) + 32, 0)
        with np.errstate(divide="ignore"):
            d_val = np.where(nonzero, F32(1) / iscale, F32(0)).astype(F32)
        sc = np.where(nonzero[:, None], ls - 32, -32)
    else:
        sigma2 = F32(2) * _superblock_sumsq(rows) / F32(QK)
        sig_t = np.repeat(sigma2, 16)[None, :]
        w_t = _weights_t(importance, n_rows, 16) * np.sqrt(sig_t + x_t * x_t)
        sw_t = nx.to_t(nx.seq_sum(w_t).reshape(nb, 16))
        scale, levels = nx.make_qx_quants_t(x_t, 4, w_t)
        d_val, ls_t = nx.make_qx_quants_t(nx.to_t(scale.reshape(nb, 16)), 32, sw_t)
        ls = ls_t.T.astype(np.int32)
        sc = ls - 32
    d_eff = (nx.fp16_round(d_val)[:, None] * sc.astype(F32)).reshape(-1)
    q = np.ascontiguousarray(_requant_t(x_t, levels, d_eff, None, -4, 3, 4).T).reshape(nb, QK)
    high = (q > 3).reshape(nb, 8, 32)  # element 32k + m -> bit k of hmask[m]
    hmask = np.bitwise_or.reduce(high.astype(np.uint8) << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)
    qs = _pack_2bit_128(q & 3)
    d16 = nx.fp16_bits(d_val).view(np.uint8).reshape(nb, 2)
    return np.concatenate([hmask.astype(np.uint8), qs, _pack_q3_scales(ls), d16], axis=1).reshape(n_rows, -1)


class _KQuant(BlockCodec):
    uses_imatrix: ClassVar[bool] = True


class Q4_K(_KQuant):
    ggml_type = T.Q4_K
    _encode_chunk = staticmethod(accelerated("kquants.q4_k", encode_q4_k))


class Q5_K(_KQuant):
    ggml_type = T.Q5_K
    _encode_chunk = staticmethod(accelerated("kquants.q5_k", encode_q5_k))


class Q6_K(_KQuant):
    ggml_type = T.Q6_K
    _encode_chunk = staticmethod(accelerated("kquants.q6_k", encode_q6_k))


class Q2_K(_KQuant):
    ggml_type = T.Q2_K
    _encode_chunk = staticmethod(accelerated("kquants.q2_k", encode_q2_k))


class Q3_K(_KQuant):
    ggml_type = T.Q3_K
    _encode_chunk = staticmethod(accelerated("kquants.q3_k", encode_q3_k))
