"""K-quants (Q2_K..Q6_K) on torch: the same steps, in the same float32 order, as codecs/kquants.py."""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T

from forge.quant.torch_codecs import device_encoder, kquants_triton, ops

QK = 256


def _u8_min(values: torch.Tensor, cap: int) -> torch.Tensor:
    """``uint8_t l = nearest_int(v); l = MIN(cap, l)`` (uint8 wrap first)."""
    return torch.clamp(ops.nearest_int(values) & 0xFF, max=cap)


def _pack_scale_min_k4(ls: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    """8 six-bit scales and mins (NB, 8) int -> the 12-byte Q4_K/Q5_K scale field (NB, 12) uint8."""
    return torch.cat(
        [
            ls[:, :4] | ((ls[:, 4:] >> 4) << 6),
            lm[:, :4] | ((lm[:, 4:] >> 4) << 6),
            (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4),
        ],
        dim=1,
    ).to(torch.uint8)


def _requant_t(
    x_t: torch.Tensor, levels: torch.Tensor, d: torch.Tensor, dm: torch.Tensor | None, hi: int, lo: int = 0
) -> torch.Tensor:
    """clamp(nearest_int((x + dm)/d), lo, hi) - lo; sub-blocks with d == 0 keep the search's levels."""
    q = ops.nearest_int_clip(ops.div(x_t if dm is None else x_t + dm, d), lo, hi) - float(lo)
    return torch.where(d == 0, levels.to(torch.float32), q).to(torch.uint8)


def encode_q45k_blocks(
    rows: torch.Tensor, importance: torch.Tensor | None, nmax: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """rows float32 (R, n_per_row) -> (header (NB, 16) uint8, levels (NB, 256) uint8 in 0..nmax)."""
    n_rows = rows.shape[0]
    x_t = ops.to_t(rows.reshape(-1, 32))  # (32, NS), NS = NB*8
    nb = x_t.shape[1] // 8
    if importance is None:
        sum_x2 = ops.seq_sum(x_t * x_t)
        av_x = ops.sqrt(ops.div(sum_x2, 32.0))
        w_t = av_x + x_t.abs()
        if nmax == 15:
            scales, mins, levels = ops.make_qkx_t(x_t, w_t, 15, -1.0, 0.1, 20, False, guarded=False)
        else:
            scales, mins, levels = ops.make_qkx_t(x_t, w_t, 31, -0.5, 0.1, 15, False, guarded=False)
        scales = scales.reshape(nb, 8)
        mins = mins.reshape(nb, 8)
        zero = ops.scalar(0.0, x_t)
        max_scale = ops.np_maximum(scales.amax(dim=1), zero)
        max_min = ops.np_maximum(mins.amax(dim=1), zero)
        inv_scale = torch.where(max_scale > 0, ops.div(63.0, max_scale), zero)
        inv_min = torch.where(max_min > 0, ops.div(63.0, max_min), zero)
        ls = _u8_min(inv_scale[:, None] * scales, 63)
        lm = _u8_min(inv_min[:, None] * mins, 63)
        d_val = ops.div(max_scale, 63.0)
        m_val = ops.div(max_min, 63.0)
    else:
        x_sb = ops.to_t(rows.reshape(-1, QK))  # (256, NB)
        sigma2 = ops.div(2.0 * ops.seq_sum(x_sb * x_sb), float(QK))
        del x_sb
        sig_t = torch.repeat_interleave(sigma2, 8)[None, :]
        imp_t = ops.importance_t(importance, n_rows, 32)
        w_t = imp_t * ops.sqrt(sig_t + x_t * x_t)
        del imp_t
        sw = ops.seq_sum(w_t)
        scales, mins, levels = ops.make_qkx_t(x_t, w_t, nmax, -0.9, 0.05, 36, False, guarded=True)
        sw_t = ops.to_t(sw.reshape(nb, 8))
        d_val, ls = ops.make_qp_quants_t(ops.to_t(scales.reshape(nb, 8)), 63, sw_t)
        m_val, lm = ops.make_qp_quants_t(ops.to_t(mins.reshape(nb, 8)), 63, sw_t)
        ls = torch.clamp(ls.t().to(torch.int32), max=63)
        lm = torch.clamp(lm.t().to(torch.int32), max=63)
    ls = ls.to(torch.int32)
    lm = lm.to(torch.int32)
    header = torch.cat([ops.fp16_bytes(d_val), ops.fp16_bytes(m_val), _pack_scale_min_k4(ls, lm)], dim=1)
    d_eff = (ops.fp16_round(d_val)[:, None] * ls.to(torch.float32)).reshape(-1)
    dm_eff = (ops.fp16_round(m_val)[:, None] * lm.to(torch.float32)).reshape(-1)
    q_t = _requant_t(x_t, levels, d_eff, dm_eff, nmax)
    return header, q_t.t().reshape(nb, QK)


def _pack_nibbles_64(levels: torch.Tensor) -> torch.Tensor:
    """(NB, 256) 4-bit values -> (NB, 128): per 64-chunk, byte l = v[l] | v[l+32] << 4."""
    q = levels.reshape(-1, 4, 2, 32) & 0xF
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


# peak device bytes per element measured on an H200: 49 (Q4_K)
@device_encoder(T.Q4_K, bytes_per_elem=64)
def encode_q4_k(rows: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    """On a GPU: one fused kernel (``kquants_triton``) once it has shown the same bytes as these operations in
    this process, for chunks of tame magnitudes (``kquants_triton.tame``)."""
    fused = kquants_triton.encode_fused("q4_k", rows, importance)
    return fused if fused is not None else encode_q4_k_ops(rows, importance)


def encode_q4_k_ops(rows: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    header, levels = encode_q45k_blocks(rows, importance, 15)
    return torch.cat([header, _pack_nibbles_64(levels)], dim=1).reshape(rows.shape[0], -1)


@device_encoder(T.Q5_K, bytes_per_elem=64)
def encode_q5_k(rows: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    """As ``encode_q4_k``."""
    fused = kquants_triton.encode_fused("q5_k", rows, importance)
    return fused if fused is not None else encode_q5_k_ops(rows, importance)


def encode_q5_k_ops(rows: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    header, levels = encode_q45k_blocks(rows, importance, 31)
    nb = levels.shape[0]
    hi = (levels >> 4).reshape(nb, 4, 2, 32).to(torch.int32)  # chunk c, half, j -> bit 2c + half of qh[j]
    shifts = 2 * torch.arange(4, device=levels.device)[:, None] + torch.arange(2, device=levels.device)
    qh = (hi << shifts[None, :, :, None].to(torch.int32)).sum(dim=(1, 2)).to(torch.uint8)
    return torch.cat([header, qh, _pack_nibbles_64(levels)], dim=1).reshape(rows.shape[0], -1)


def _sub_t(rows: torch.Tensor, n: int) -> torch.Tensor:
    """Rows (R, cols) -> sub-blocks of n, position-major (n, R*cols/n)."""
    return ops.to_t(rows.reshape(-1, n))


def _imatrix_weights_t(rows: torch.Tensor, x_t: torch.Tensor, importance: torch.Tensor, sigma_mul: float):
    """``qw * sqrt(sigma2 + x²)`` per element of the 16-sub-blocks, sigma2 = sigma_mul·Σx²/256 per super-block."""
    x_sb = ops.to_t(rows.reshape(-1, QK))
    sumsq = ops.seq_sum(x_sb * x_sb)
    del x_sb
    if sigma_mul != 1.0:
        sumsq = ops.scalar(sigma_mul, sumsq) * sumsq
    sig_t = torch.repeat_interleave(ops.div(sumsq, float(QK)), 16)[None, :]
    return ops.importance_t(importance, rows.shape[0], 16) * ops.sqrt(sig_t + x_t * x_t)


def _signed_max(scales: torch.Tensor) -> torch.Tensor:
    """(NB, 16) -> the scale of largest magnitude per super-block (first on ties), with its sign."""
    return ops.first_absmax(scales.t())


def _int8(v: torch.Tensor) -> torch.Tensor:
    """An int32 stored through int8_t (wraps)."""
    return ((v + 128) & 0xFF) - 128


def _or_shifted(parts: torch.Tensor, dim: int) -> torch.Tensor:
    """OR of ``parts`` (values of 2 bits) shifted by 0, 2, 4, 6 along ``dim`` (size 4): their sum, as the bits are disjoint."""
    shape = [1] * parts.dim()
    shape[dim] = 4
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32, device=parts.device).reshape(shape)
    return (parts.to(torch.int32) << shifts).sum(dim=dim).to(torch.uint8)


def _pack_2bit_128(levels: torch.Tensor) -> torch.Tensor:
    """(NB, 256) 2-bit values -> (NB, 64): per 128-chunk, byte l = v[l] | v[l+32]<<2 | v[l+64]<<4 | v[l+96]<<6."""
    return _or_shifted(levels.reshape(-1, 2, 4, 32) & 3, dim=2).reshape(-1, 64)


@device_encoder(T.Q6_K, bytes_per_elem=64)
def encode_q6_k(rows: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    """On a GPU: one fused kernel (``kquants_triton``) once it has shown the same bytes as these operations
    in this process."""
    fused = kquants_triton.encode_fused("q6_k", rows, importance)
    return fused if fused is not None else encode_q6_k_ops(rows, importance)


def encode_q6_k_ops(rows: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    n_rows = rows.shape[0]
    x_t = _sub_t(rows, 16)  # (16, NS), NS = NB*16
    nb = x_t.shape[1] // 16
    w_t = None if importance is None else ops.importance_t(importance, n_rows, 16)
    scale, levels = ops.make_qx_quants_t(x_t, 32, w_t)
    del w_t
    scales = scale.reshape(nb, 16)
    max_scale = _signed_max(scales)
    zero = max_scale.abs() < ops.GROUP_MAX_EPS
    iscale = ops.div(-128.0, torch.where(zero, ops.scalar(1.0, scales), max_scale))
    d_val = ops.div(1.0, iscale)
    sc = _int8(torch.clamp(ops.nearest_int(iscale[:, None] * scales), max=127))
    d_eff = (ops.fp16_round(d_val)[:, None] * sc.to(torch.float32)).reshape(-1)
    q = _requant_t(x_t, levels, d_eff, None, 31, -32).t().reshape(nb, 2, 4, 32)
    ql = ((q[:, :, 0:2] & 0xF) | ((q[:, :, 2:4] & 0xF) << 4)).reshape(nb, 128)
    qh = _or_shifted(q >> 4, dim=2).reshape(nb, 64)
    out = torch.cat([ql, qh, (sc & 0xFF).to(torch.uint8), ops.fp16_bytes(d_val)], dim=1)
    return torch.where(zero[:, None], torch.zeros_like(out), out).reshape(n_rows, -1)


@device_encoder(T.Q2_K, bytes_per_elem=96)
def encode_q2_k(rows: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    n_rows = rows.shape[0]
    x_t = _sub_t(rows, 16)
    nb = x_t.shape[1] // 16
    if importance is None:
        scales, mins, levels = ops.make_qkx_t(x_t, x_t.abs(), 3, -0.5, 0.1, 15, True, guarded=False)
        scales = scales.reshape(nb, 16)
        mins = mins.reshape(nb, 16)
        zero = ops.scalar(0.0, x_t)
        max_scale = ops.np_maximum(scales.amax(dim=1), zero)
        max_min = ops.np_maximum(mins.amax(dim=1), zero)
        ls = ops.nearest_int(ops.div(15.0, max_scale)[:, None] * scales)
        lm = ops.nearest_int(ops.div(15.0, max_min)[:, None] * mins)
        ls = torch.where((max_scale > 0)[:, None], ls, 0)
        lm = torch.where((max_min > 0)[:, None], lm, 0)
        packed = (ls | (lm << 4)) & 0xFF
        d_val = ops.div(max_scale, 15.0)
        m_val = ops.div(max_min, 15.0)
    else:
        w_t = _imatrix_weights_t(rows, x_t, importance, 1.0)
        sw_t = ops.to_t(ops.seq_sum(w_t).reshape(nb, 16))
        scales, mins, levels = ops.make_qkx_t(x_t, w_t, 3, -0.9, 0.05, 36, False, guarded=True)
        del w_t
        d_val, ls = ops.make_qp_quants_t(ops.to_t(scales.reshape(nb, 16)), 15, sw_t)
        m_val, lm = ops.make_qp_quants_t(ops.to_t(mins.reshape(nb, 16)), 15, sw_t)
        packed = (ls.t().to(torch.int32) | (lm.t().to(torch.int32) << 4)) & 0xFF
    d_eff = (ops.fp16_round(d_val)[:, None] * (packed & 0xF).to(torch.float32)).reshape(-1)
    dm_eff = (ops.fp16_round(m_val)[:, None] * (packed >> 4).to(torch.float32)).reshape(-1)
    q = _requant_t(x_t, levels, d_eff, dm_eff, 3).t().reshape(nb, QK)
    head = [packed.to(torch.uint8), _pack_2bit_128(q), ops.fp16_bytes(d_val), ops.fp16_bytes(m_val)]
    return torch.cat(head, dim=1).reshape(n_rows, -1)


def _pack_q3_scales(ls: torch.Tensor) -> torch.Tensor:
    """16 six-bit scales (NB, 16) -> 12 bytes: low nibbles of j and j+8, then 2-bit highs by j%4, j/4."""
    ls = ls.to(torch.int32) & 0xFF
    low = ((ls[:, :8] & 0xF) | ((ls[:, 8:] & 0xF) << 4)).to(torch.uint8)
    return torch.cat([low, _or_shifted((ls >> 4).reshape(-1, 4, 4), dim=1)], dim=1)


@device_encoder(T.Q3_K, bytes_per_elem=96)
def encode_q3_k(rows: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    n_rows = rows.shape[0]
    x_t = _sub_t(rows, 16)
    nb = x_t.shape[1] // 16
    if importance is None:
        scale, levels = ops.make_q3_quants_t(x_t, 4)
        scales = scale.reshape(nb, 16)
        max_scale = _signed_max(scales)
        nonzero = max_scale != 0
        iscale = ops.div(-32.0, torch.where(nonzero, max_scale, ops.scalar(1.0, scales)))
        li = _int8(ops.nearest_int(iscale[:, None] * scales))
        ls = torch.where(nonzero[:, None], torch.clamp(li, -32, 31) + 32, 0)
        d_val = torch.where(nonzero, ops.div(1.0, iscale), ops.scalar(0.0, scales))
        sc = torch.where(nonzero[:, None], ls - 32, -32)
    else:
        w_t = _imatrix_weights_t(rows, x_t, importance, 2.0)
        sw_t = ops.to_t(ops.seq_sum(w_t).reshape(nb, 16))
        scale, levels = ops.make_qx_quants_t(x_t, 4, w_t)
        del w_t
        d_val, ls_t = ops.make_qx_quants_t(ops.to_t(scale.reshape(nb, 16)), 32, sw_t)
        ls = ls_t.t().to(torch.int32)
        sc = ls - 32
    d_eff = (ops.fp16_round(d_val)[:, None] * sc.to(torch.float32)).reshape(-1)
    q = _requant_t(x_t, levels, d_eff, None, 3, -4).t().reshape(nb, QK)
    bit = torch.arange(8, device=q.device, dtype=torch.int32)[None, :, None]
    hmask = ((q > 3).reshape(nb, 8, 32).to(torch.int32) << bit).sum(dim=1).to(torch.uint8)
    parts = [hmask, _pack_2bit_128(q & 3), _pack_q3_scales(ls), ops.fp16_bytes(d_val)]
    return torch.cat(parts, dim=1).reshape(n_rows, -1)
