"""Q4_K without importance weights as one Triton kernel: the same float32 operations in the same order as
``forge/quant/kernels/kquants.py`` (ggml's ``quantize_row_q4_K_ref``), so the same bytes.

The torch encoder (``kquants.encode_q4_k``) runs the sub-block search as chains of whole-chunk operations:
a sequential 32-term sum is 32 launches, a search step four of them, and the chunk passes through memory
for every one (1.2 GB/s of float32 input on an H200). Here a program takes ``BS`` super-blocks and keeps
their 8 sub-blocks' running sums, scales and errors in registers; each pass over a sub-block's 32 values
reads them again from the cache in C order, and the search's levels go to a scratch row only when a step
improves. Bit-exact needs what C does: divisions and square roots correctly rounded (``div_rn``,
``sqrt_rn``), no multiply-add contraction (the kernel is launched with ``enable_fp_fusion=False``),
round-half-even through ggml's 1.5 * 2**23 trick, fp16 by round to nearest even.

``encode_q4_k_fused(rows)`` takes float32 rows (R, n_per_row) on a CUDA device and returns (R, row_bytes)
uint8; ``self_check()`` compares it with the torch encoder once per process (``kquants`` uses it only when
they agree).
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - machines without triton
    triton = tl = None

log = logging.getLogger(__name__)

QK = 256
BLOCK_BYTES = 144
#: super-blocks per program
BS = 32

if triton is not None:

    @triton.jit
    def _nearest_int(v):
        bits = (v + 12582912.0).to(tl.int32, bitcast=True)
        return (bits & 0x007FFFFF) - 0x00400000

    @triton.jit
    def _weight(x, av):
        return av + tl.abs(x)

    @triton.jit
    def _q4k_kernel(x_ptr, out_ptr, lv_ptr, n_sb, steps_ptr, BS_: tl.constexpr):
        pid = tl.program_id(0)
        row = pid * BS_ + tl.arange(0, BS_)  # (BS,) super-blocks
        sb = row[:, None]
        j = tl.arange(0, 8)[None, :]  # (1, 8) sub-block
        ok = (sb < n_sb) & (j < 8)
        base = sb * 256 + j * 32  # (BS, 8) first value of each sub-block
        zero = tl.zeros((BS_, 8), tl.float32)

        # per sub-block: sum of squares (C order), its weights' scale, min / max, sums of w and w * x
        sum_x2 = zero
        for i in range(32):
            v = tl.load(x_ptr + base + i, mask=ok, other=0.0)
            sum_x2 = sum_x2 + v * v
        av = tl.sqrt_rn(tl.div_rn(sum_x2, 32.0))
        x0 = tl.load(x_ptr + base, mask=ok, other=0.0)
        mn = x0
        mx = x0
        sum_w = _weight(x0, av)
        sum_x = sum_w * x0
        for i in range(1, 32):
            v = tl.load(x_ptr + base + i, mask=ok, other=0.0)
            w = _weight(v, av)
            mn = tl.where(v < mn, v, mn)
            mx = tl.where(v > mx, v, mx)
            sum_w = sum_w + w
            sum_x = sum_x + w * v
        mn = tl.where(mn > 0.0, 0.0, mn)
        flat = mx == mn
        span = tl.where(flat, 1.0, mx - mn)

        # make_qkx2_quants(32, 15, x, w, rmin -1, rdelta 0.1, nstep 20)
        iscale = tl.div_rn(tl.full((BS_, 8), 15.0, tl.float32), span)
        scale = tl.div_rn(tl.full((BS_, 8), 1.0, tl.float32), iscale)
        best = zero
        for i in range(32):
            v = tl.load(x_ptr + base + i, mask=ok, other=0.0)
            li = tl.minimum(tl.maximum(_nearest_int(iscale * (v - mn)), 0), 15)
            tl.store(lv_ptr + base + i, li.to(tl.uint8), mask=ok)
            diff = scale * li.to(tl.float32) + mn - v
            best = best + _weight(v, av) * (diff * diff)
        for step in range(21):
            # over the current min (a better step moves it), as ggml's loop
            iscale = tl.div_rn(zero + tl.load(steps_ptr + step), tl.where(flat, 1.0, mx - mn))
            sum_l = zero
            sum_l2 = zero
            sum_xl = zero
            for i in range(32):
                v = tl.load(x_ptr + base + i, mask=ok, other=0.0)
                fl = tl.minimum(tl.maximum(_nearest_int(iscale * (v - mn)), 0), 15).to(tl.float32)
                wl = _weight(v, av) * fl
                sum_l = sum_l + wl
                sum_l2 = sum_l2 + wl * fl
                sum_xl = sum_xl + wl * v
            det = sum_w * sum_l2 - sum_l * sum_l
            this_scale = tl.div_rn(sum_w * sum_xl - sum_x * sum_l, det)
            this_min = tl.div_rn(sum_l2 * sum_x - sum_l * sum_xl, det)
            pos = this_min > 0.0
            this_min = tl.where(pos, 0.0, this_min)
            this_scale = tl.where(pos, tl.div_rn(sum_xl, sum_l2), this_scale)
            cur = zero
            for i in range(32):
                v = tl.load(x_ptr + base + i, mask=ok, other=0.0)
                fl = tl.minimum(tl.maximum(_nearest_int(iscale * (v - mn)), 0), 15).to(tl.float32)
                diff = this_scale * fl + this_min - v
                cur = cur + _weight(v, av) * (diff * diff)
            better = (det > 0.0) & (cur < best) & ~flat
            for i in range(32):
                v = tl.load(x_ptr + base + i, mask=ok, other=0.0)
                li = tl.minimum(tl.maximum(_nearest_int(iscale * (v - mn)), 0), 15)
                tl.store(lv_ptr + base + i, li.to(tl.uint8), mask=ok & better)
            best = tl.where(better, cur, best)
            scale = tl.where(better, this_scale, scale)
            mn = tl.where(better, this_min, mn)
        scale = tl.where(flat, 0.0, scale)
        the_min = -mn  # flat: -min(x0's min, 0) as the search never moved it

        # the super-block's 6-bit scales and mins, its fp16 d and dmin
        max_scale = tl.max(scale, axis=1)  # (BS,); C starts from +0 and keeps it unless a value is above
        max_scale = tl.where(max_scale > 0.0, max_scale, 0.0)
        max_min = tl.max(the_min, axis=1)
        max_min = tl.where(max_min > 0.0, max_min, 0.0)
        inv_scale = tl.where(max_scale > 0.0, tl.div_rn(tl.full((BS_,), 63.0, tl.float32), max_scale), 0.0)
        inv_min = tl.where(max_min > 0.0, tl.div_rn(tl.full((BS_,), 63.0, tl.float32), max_min), 0.0)
        ls = tl.minimum(_nearest_int(inv_scale[:, None] * scale) & 0xFF, 63)  # (BS, 8)
        lm = tl.minimum(_nearest_int(inv_min[:, None] * the_min) & 0xFF, 63)
        d16 = tl.div_rn(max_scale, 63.0).to(tl.float16)
        m16 = tl.div_rn(max_min, 63.0).to(tl.float16)
        live = row < n_sb
        out = out_ptr + row * 144
        dbits = d16.to(tl.int16, bitcast=True).to(tl.int32)
        mbits = m16.to(tl.int16, bitcast=True).to(tl.int32)
        tl.store(out + 0, (dbits & 0xFF).to(tl.uint8), mask=live)
        tl.store(out + 1, ((dbits >> 8) & 0xFF).to(tl.uint8), mask=live)
        tl.store(out + 2, (mbits & 0xFF).to(tl.uint8), mask=live)
        tl.store(out + 3, ((mbits >> 8) & 0xFF).to(tl.uint8), mask=live)
        for q in range(4):
            s_lo = tl.sum(tl.where(j == q, ls, 0), axis=1)
            s_hi = tl.sum(tl.where(j == q + 4, ls, 0), axis=1)
            m_lo = tl.sum(tl.where(j == q, lm, 0), axis=1)
            m_hi = tl.sum(tl.where(j == q + 4, lm, 0), axis=1)
            tl.store(out + 4 + q, (s_lo | ((s_hi >> 4) << 6)).to(tl.uint8), mask=live)
            tl.store(out + 8 + q, (m_lo | ((m_hi >> 4) << 6)).to(tl.uint8), mask=live)
            tl.store(out + 12 + q, ((s_hi & 0xF) | ((m_hi & 0xF) << 4)).to(tl.uint8), mask=live)

        # the levels again from the rounded d and dmin (a sub-block whose d is 0 keeps the search's)
        d = d16.to(tl.float32)[:, None] * ls.to(tl.float32)  # (BS, 8)
        dm = m16.to(tl.float32)[:, None] * lm.to(tl.float32)
        keep = d == 0.0
        d_safe = tl.where(keep, 1.0, d)
        for i in range(32):
            v = tl.load(x_ptr + base + i, mask=ok, other=0.0)
            li = tl.minimum(tl.maximum(_nearest_int(tl.div_rn(v + dm, d_safe)), 0), 15)
            old = tl.load(lv_ptr + base + i, mask=ok, other=0).to(tl.int32)
            tl.store(lv_ptr + base + i, tl.where(keep, old, li).to(tl.uint8), mask=ok)
        # nibbles: byte 16 + 32 c + i = L[64 c + i] | L[64 c + 32 + i] << 4
        lane = tl.arange(0, 32)[None, :]
        for c in range(4):
            lo = tl.load(lv_ptr + row[:, None] * 256 + 64 * c + lane, mask=live[:, None], other=0).to(
                tl.int32
            )
            hi = tl.load(lv_ptr + row[:, None] * 256 + 64 * c + 32 + lane, mask=live[:, None], other=0)
            byte = lo | (hi.to(tl.int32) << 4)
            tl.store(out[:, None] + 16 + 32 * c + lane, byte.to(tl.uint8), mask=live[:, None])


def encode_q4_k_fused(rows: torch.Tensor) -> torch.Tensor:
    """float32 rows (R, n_per_row) on CUDA -> Q4_K bytes (R, n_per_row / 256 * 144) uint8."""
    n_rows, n_per_row = rows.shape
    n_sb = n_rows * n_per_row // QK
    x = rows.contiguous()
    out = torch.empty((n_sb, BLOCK_BYTES), dtype=torch.uint8, device=rows.device)
    scratch = torch.empty((n_sb, QK), dtype=torch.uint8, device=rows.device)
    if n_sb:
        grid = (triton.cdiv(n_sb, BS),)
        _q4k_kernel[grid](x, out, scratch, n_sb, _steps(rows.device), BS_=BS, enable_fp_fusion=False)
    return out.reshape(n_rows, -1)


@functools.cache
def _steps(device: torch.device) -> torch.Tensor:
    """The search's 21 scales of nmax, rmin + rdelta * step + nmax in float32 as C computes them."""
    step = np.arange(21, dtype=np.float32)
    return torch.from_numpy((np.float32(-1.0) + np.float32(0.1) * step) + np.float32(15.0)).to(device)


def usable(device: torch.device) -> bool:
    """Triton is there and the kernel gave the torch encoder's bytes on this device (checked once)."""
    return triton is not None and self_check(str(device))


@functools.cache
def self_check(device: str) -> bool:
    """Whether the kernel gives the torch encoder's bytes on ``device`` (random rows, flat and zero blocks,
    large and tiny magnitudes); checked once per process, a difference logged."""
    from forge.quant.torch_codecs.kquants import encode_q4_k_ops

    gen = torch.Generator().manual_seed(1234)
    rows = torch.randn(48, 1024, generator=gen)
    rows[1] = 0.0
    rows[2, :256] = 3.25
    rows[3] *= 1e-20
    rows[4] *= 1e20
    rows[5, ::2] = 0.0
    rows = rows.to(device)
    want = encode_q4_k_ops(rows, None)
    got = encode_q4_k_fused(rows)
    same = bool(torch.equal(want, got))
    if not same:
        bad = int((want != got).any(dim=1).sum())
        log.warning("the fused Q4_K kernel differs from the torch encoder on %d of 48 rows: not used", bad)
    return same


__all__ = ["encode_q4_k_fused", "self_check", "usable"]
