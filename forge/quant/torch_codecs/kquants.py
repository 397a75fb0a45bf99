"""Q4_K and Q5_K on torch: the same steps, in the same float32 order, as codecs/kquants.py."""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T

from forge.quant.torch_codecs import device_encoder, ops

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
    x_t: torch.Tensor, levels: torch.Tensor, d: torch.Tensor, dm: torch.Tensor, nmax: int
) -> torch.Tensor:
    """clamp(nearest_int((x + dm)/d), 0, nmax); sub-blocks with d == 0 keep the search's levels."""
    q = ops.nearest_int_clip(ops.div(x_t + dm, d), 0, nmax)
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
        imp_t = ops.to_t(importance.reshape(-1, 32)).repeat(1, n_rows)
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
    header, levels = encode_q45k_blocks(rows, importance, 15)
    return torch.cat([header, _pack_nibbles_64(levels)], dim=1).reshape(rows.shape[0], -1)


@device_encoder(T.Q5_K, bytes_per_elem=64)
def encode_q5_k(rows: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    header, levels = encode_q45k_blocks(rows, importance, 31)
    nb = levels.shape[0]
    hi = (levels >> 4).reshape(nb, 4, 2, 32).to(torch.int32)  # chunk c, half, j -> bit 2c + half of qh[j]
    shifts = 2 * torch.arange(4, device=levels.device)[:, None] + torch.arange(2, device=levels.device)
    qh = (hi << shifts[None, :, :, None].to(torch.int32)).sum(dim=(1, 2)).to(torch.uint8)
    return torch.cat([header, qh, _pack_nibbles_64(levels)], dim=1).reshape(rows.shape[0], -1)
