"""Q4_K, Q5_K and Q6_K encoders as fused Triton kernels (Q4_K and Q5_K share one): the same float32
operations in the same order as ``forge/quant/kernels/kquants.py`` (ggml's ``quantize_row_q4_K_ref`` /
``quantize_row_q6_K`` and their imatrix forms), so the same bytes.

The torch encoder (``kquants.encode_q4_k``) runs the sub-block search as chains of whole-chunk operations:
a sequential 32-term sum is 32 launches, a search step four of them, and the chunk passes through memory
for every one (1.2 GB/s of float32 input on an H200). Here a program takes ``BS`` super-blocks and keeps
their 8 sub-blocks' running sums, scales and errors in registers; each pass over a sub-block's 32 values
reads them again from the cache in C order, and the search's levels go to a scratch row only when a step
improves. Bit-exact needs what C does: divisions and square roots correctly rounded (``div_rn``,
``sqrt_rn``), no multiply-add contraction (the kernel is launched with ``enable_fp_fusion=False``),
round-half-even through ggml's 1.5 * 2**23 trick, fp16 by round to nearest even.

``encode_q45_k_fused(rows, qtype, importance)`` / ``encode_q6_k_fused(rows, importance)`` take float32 rows
(R, n_per_row) on a CUDA device and return (R, row_bytes) uint8; ``usable(qtype, device)`` compares a kernel
with the torch encoder once per process (``kquants`` uses it only when they agree), and ``tame(rows,
importance)`` says whether a chunk's magnitudes keep every intermediate a normal float (no nonzero value
below 1e-10 or above 1e10): Triton may flush subnormal results to zero where the CPU keeps them, and x86 and
CUDA write NaNs with other bits, so chunks beyond that range take the torch operations, which reproduce both.
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
BLOCK_BYTES = {"q4_k": 144, "q5_k": 176, "q6_k": 210}
#: super-blocks per program
BS = 32

if triton is not None:

    @triton.jit
    def _nearest_int(v):
        bits = (v + 12582912.0).to(tl.int32, bitcast=True)
        return (bits & 0x007FFFFF) - 0x00400000

    @triton.jit
    def _weight(v, av, imp_ptr, off, sig, ok, HAS_IMP: tl.constexpr):
        """A value's weight in the sub-block search: imp * sqrt(sigma2 + x^2) with importance, else
        av_x + |x|."""
        if HAS_IMP:
            return tl.load(imp_ptr + off, mask=ok, other=0.0) * tl.sqrt_rn(sig + v * v)
        else:
            return av + tl.abs(v)

    @triton.jit
    def _level(v, NMAX: tl.constexpr, GUARD: tl.constexpr):
        """A search step's level: make_qkx3's v > 0 ? nearest_int(MIN(v, nmax)) : 0, make_qkx2's clamp."""
        if GUARD:
            return tl.where(v > 0.0, _nearest_int(tl.where(v < NMAX, v, NMAX * 1.0)), 0)
        else:
            return tl.minimum(tl.maximum(_nearest_int(v), 0), NMAX)

    @triton.jit
    def _pick(values, j, i):
        """Column i of a (BS, n) tile, exactly (the other terms are zeros)."""
        return tl.sum(tl.where(j == i, values, 0.0), axis=1)

    @triton.jit
    def _make_qp(x, w, j, qp_ptr, BS_: tl.constexpr):
        """ggml make_qp_quants(8, 63, x, L, w) on each row of the (BS, 8) tiles x, w: returns (scale (BS,),
        levels (BS, 8) int32). C's order throughout; each row's refinement stops at its first pass without a
        change."""
        zero1 = tl.zeros((BS_,), tl.float32)
        mx = tl.max(x, axis=1)
        mx = tl.where(mx > 0.0, mx, 0.0)
        tiny = mx < 1e-15
        mx = tl.where(tiny, 1.0, mx)
        iscale = tl.div_rn(zero1 + 63.0, mx)
        scale = tl.div_rn(zero1 + 1.0, iscale)
        best = zero1
        for i in range(8):
            xi = _pick(x, j, i)
            wi = _pick(w, j, i)
            diff = xi - scale * (_nearest_int(iscale * xi) & 0xFF).to(tl.float32)
            best = best + (wi * diff) * diff
        for k in range(8):  # steps -4..-1, 1..4
            iscale_is = tl.div_rn(zero1 + tl.load(qp_ptr + k), mx)
            scale_is = tl.div_rn(zero1 + 1.0, iscale_is)
            mse = zero1
            for i in range(8):
                xi = _pick(x, j, i)
                wi = _pick(w, j, i)
                diff = xi - scale_is * tl.minimum(_nearest_int(iscale_is * xi), 63).to(tl.float32)
                mse = mse + (wi * diff) * diff
            up = mse < best
            best = tl.where(up, mse, best)
            iscale = tl.where(up, iscale_is, iscale)
        sumlx = zero1
        suml2 = zero1
        levels = tl.zeros((BS_, 8), tl.int32)
        for i in range(8):
            xi = _pick(x, j, i)
            wi = _pick(w, j, i)
            li = tl.minimum(_nearest_int(iscale * xi), 63)
            levels = tl.where(j == i, (li & 0xFF)[:, None], levels)
            fl = li.to(tl.float32)
            sumlx = sumlx + (wi * xi) * fl
            suml2 = suml2 + (wi * fl) * fl
        active = ~tiny
        for _ in range(5):
            changed = tiny & ~tiny
            for i in range(8):
                xi = _pick(x, j, i)
                wi = _pick(w, j, i)
                li = tl.sum(tl.where(j == i, levels, 0), axis=1)
                fl = li.to(tl.float32)
                slx = sumlx - (wi * xi) * fl
                sl2 = suml2 - (wi * fl) * fl
                can = active & (slx > 0.0) & (sl2 > 0.0)
                new_l = tl.minimum(_nearest_int(tl.div_rn(xi * sl2, tl.where(can, slx, 1.0))), 63)
                fn = new_l.to(tl.float32)
                slx = slx + (wi * xi) * fn
                sl2 = sl2 + (wi * fn) * fn
                take = can & (new_l != li) & ((slx * slx) * suml2 > (sumlx * sumlx) * sl2)
                levels = tl.where(take[:, None] & (j == i), (new_l & 0xFF)[:, None], levels)
                sumlx = tl.where(take, slx, sumlx)
                suml2 = tl.where(take, sl2, suml2)
                changed = changed | take
            active = active & changed
        scale = tl.where(suml2 > 0.0, tl.div_rn(sumlx, tl.where(suml2 > 0.0, suml2, 1.0)), 0.0)
        return tl.where(tiny, 0.0, scale), tl.where(tiny[:, None], 0, levels)

    @triton.jit
    def _q45k_kernel(x_ptr, imp_ptr, imp_stride, n_per_row, out_ptr, lv_ptr, n_sb, steps_ptr,
                     NMAX: tl.constexpr, NSTEPS: tl.constexpr, BYTES: tl.constexpr, HAS_IMP: tl.constexpr,
                     BS_: tl.constexpr):  # fmt: skip
        pid = tl.program_id(0)
        row = pid * BS_ + tl.arange(0, BS_)  # (BS,) super-blocks
        sb = row[:, None]
        j = tl.arange(0, 8)[None, :]  # (1, 8) sub-block
        ok = (sb < n_sb) & (j < 8)
        base = sb * 256 + j * 32  # (BS, 8) first value of each sub-block
        sbs = n_per_row // 256  # super-blocks per row: the importance vector's row and column
        imp_base = (sb // sbs) * imp_stride + (sb % sbs) * 256 + j * 32
        zero = tl.zeros((BS_, 8), tl.float32)

        # the weights' parameters: without importance each sub-block's rms (its squares summed in C order),
        # with it each super-block's 2 * mean square (sigma2: the 256 squares in order)
        sum_x2 = zero
        for i in range(32):
            v = tl.load(x_ptr + base + i, mask=ok, other=0.0)
            sum_x2 = sum_x2 + v * v
        av = tl.sqrt_rn(tl.div_rn(sum_x2, 32.0))
        total = tl.zeros((BS_,), tl.float32)
        if HAS_IMP:
            for t in range(256):
                v = tl.load(x_ptr + row * 256 + t, mask=row < n_sb, other=0.0)
                total = total + v * v
        sig = tl.div_rn(2.0 * total, 256.0)[:, None]
        # min / max, sums of w and w * x (C order)
        x0 = tl.load(x_ptr + base, mask=ok, other=0.0)
        mn = x0
        mx = x0
        sum_w = _weight(x0, av, imp_ptr, imp_base, sig, ok, HAS_IMP)
        sum_x = sum_w * x0
        for i in range(1, 32):
            v = tl.load(x_ptr + base + i, mask=ok, other=0.0)
            w = _weight(v, av, imp_ptr, imp_base + i, sig, ok, HAS_IMP)
            mn = tl.where(v < mn, v, mn)
            mx = tl.where(v > mx, v, mx)
            sum_w = sum_w + w
            sum_x = sum_x + w * v
        mn = tl.where(mn > 0.0, 0.0, mn)
        flat = mx == mn
        span = tl.where(flat, 1.0, mx - mn)

        # make_qkx2_quants(32, nmax, x, w, rmin, rdelta, nstep): Q4_K 15, -1, 0.1, 20; Q5_K 31, -0.5, 0.1, 15;
        # with importance make_qkx3_quants (-0.9, 0.05, 36; guarded rounding in the steps)
        iscale = tl.div_rn(zero + NMAX, span)
        scale = tl.div_rn(tl.full((BS_, 8), 1.0, tl.float32), iscale)
        best = zero
        for i in range(32):
            v = tl.load(x_ptr + base + i, mask=ok, other=0.0)
            li = tl.minimum(tl.maximum(_nearest_int(iscale * (v - mn)), 0), NMAX)
            tl.store(lv_ptr + base + i, li.to(tl.uint8), mask=ok)
            diff = scale * li.to(tl.float32) + mn - v
            best = best + _weight(v, av, imp_ptr, imp_base + i, sig, ok, HAS_IMP) * (diff * diff)
        for step in range(NSTEPS):
            # over the current min (a better step moves it), as ggml's loop
            iscale = tl.div_rn(zero + tl.load(steps_ptr + step), tl.where(flat, 1.0, mx - mn))
            sum_l = zero
            sum_l2 = zero
            sum_xl = zero
            for i in range(32):
                v = tl.load(x_ptr + base + i, mask=ok, other=0.0)
                fl = _level(iscale * (v - mn), NMAX, HAS_IMP).to(tl.float32)
                wl = _weight(v, av, imp_ptr, imp_base + i, sig, ok, HAS_IMP) * fl
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
                fl = _level(iscale * (v - mn), NMAX, HAS_IMP).to(tl.float32)
                diff = this_scale * fl + this_min - v
                cur = cur + _weight(v, av, imp_ptr, imp_base + i, sig, ok, HAS_IMP) * (diff * diff)
            better = (det > 0.0) & (cur < best) & ~flat
            for i in range(32):
                v = tl.load(x_ptr + base + i, mask=ok, other=0.0)
                li = _level(iscale * (v - mn), NMAX, HAS_IMP)
                tl.store(lv_ptr + base + i, li.to(tl.uint8), mask=ok & better)
            best = tl.where(better, cur, best)
            scale = tl.where(better, this_scale, scale)
            mn = tl.where(better, this_min, mn)
        scale = tl.where(flat, 0.0, scale)
        the_min = -mn  # flat: -min(x0's min, 0) as the search never moved it

        # the super-block's 6-bit scales and mins, its fp16 d and dmin: with importance make_qp_quants over
        # the sub-blocks' weight sums, else from the largest scale and min
        if HAS_IMP:
            d_val, ls = _make_qp(scale, sum_w, j, steps_ptr + NSTEPS, BS_)
            m_val, lm = _make_qp(the_min, sum_w, j, steps_ptr + NSTEPS, BS_)
            ls = tl.minimum(ls, 63)
            lm = tl.minimum(lm, 63)
        else:
            max_scale = tl.max(scale, axis=1)  # (BS,); C starts from +0 and keeps it unless a value is above
            max_scale = tl.where(max_scale > 0.0, max_scale, 0.0)
            max_min = tl.max(the_min, axis=1)
            max_min = tl.where(max_min > 0.0, max_min, 0.0)
            one = tl.full((BS_,), 63.0, tl.float32)
            inv_scale = tl.where(
                max_scale > 0.0, tl.div_rn(one, tl.where(max_scale > 0.0, max_scale, 1.0)), 0.0
            )
            inv_min = tl.where(max_min > 0.0, tl.div_rn(one, tl.where(max_min > 0.0, max_min, 1.0)), 0.0)
            ls = tl.minimum(_nearest_int(inv_scale[:, None] * scale) & 0xFF, 63)  # (BS, 8)
            lm = tl.minimum(_nearest_int(inv_min[:, None] * the_min) & 0xFF, 63)
            d_val = tl.div_rn(max_scale, 63.0)
            m_val = tl.div_rn(max_min, 63.0)
        d16 = d_val.to(tl.float16)
        m16 = m_val.to(tl.float16)
        live = row < n_sb
        out = out_ptr + row * BYTES
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
            li = tl.minimum(tl.maximum(_nearest_int(tl.div_rn(v + dm, d_safe)), 0), NMAX)
            old = tl.load(lv_ptr + base + i, mask=ok, other=0).to(tl.int32)
            tl.store(lv_ptr + base + i, tl.where(keep, old, li).to(tl.uint8), mask=ok)
        # the levels were stored by the threads holding their sub-blocks and are read below by others: the
        # program's threads meet first (without it a GPU read stale levels; Triton's interpreter cannot tell)
        tl.debug_barrier()
        # low nibbles: byte QS + 32 c + i = L[64 c + i] & 15 | (L[64 c + 32 + i] & 15) << 4; Q5_K's fifth bits:
        # byte 16 + i holds bit 2 c of L[64 c + i] and bit 2 c + 1 of L[64 c + 32 + i]
        lane = tl.arange(0, 32)[None, :]
        at = lv_ptr + row[:, None] * 256 + lane
        qs = 16 if NMAX == 15 else 48
        qh = tl.zeros((BS_, 32), tl.int32)
        for c in range(4):
            lo = tl.load(at + 64 * c, mask=live[:, None], other=0).to(tl.int32)
            hi = tl.load(at + 64 * c + 32, mask=live[:, None], other=0).to(tl.int32)
            byte = (lo & 0xF) | ((hi & 0xF) << 4)
            tl.store(out[:, None] + qs + 32 * c + lane, byte.to(tl.uint8), mask=live[:, None])
            qh = qh | ((lo >> 4) << (2 * c)) | ((hi >> 4) << (2 * c + 1))
        if NMAX == 31:
            tl.store(out[:, None] + 16 + lane, qh.to(tl.uint8), mask=live[:, None])

    @triton.jit
    def _qx_sums(x_ptr, base, imp_ptr, imp_base, ok, iscale, zero, HAS_IMP: tl.constexpr):
        """make_qx_quants' sums over a 16-value sub-block at ``iscale``, in C order: sum w x l and sum w l^2
        (w the importance, else x^2; l = nearest_int(iscale x) within -32..31)."""
        sumlx = zero
        suml2 = zero
        for i in range(16):
            v = tl.load(x_ptr + base + i, mask=ok, other=0.0)
            if HAS_IMP:
                w = tl.load(imp_ptr + imp_base + i, mask=ok, other=0.0)
            else:
                w = v * v
            fl = tl.minimum(tl.maximum(_nearest_int(iscale * v), -32), 31).to(tl.float32)
            sumlx = sumlx + (w * v) * fl
            suml2 = suml2 + (w * fl) * fl
        return sumlx, suml2

    @triton.jit
    def _q6k_kernel(x_ptr, imp_ptr, imp_stride, n_per_row, out_ptr, lv_ptr, n_sb, steps_ptr,
                    HAS_IMP: tl.constexpr, BS_: tl.constexpr):  # fmt: skip
        pid = tl.program_id(0)
        row = pid * BS_ + tl.arange(0, BS_)  # (BS,) super-blocks
        sb = row[:, None]
        j = tl.arange(0, 16)[None, :]  # (1, 16) sub-block of 16
        ok = (sb < n_sb) & (j < 16)
        base = sb * 256 + j * 16
        sbs = n_per_row // 256  # super-blocks per row: the importance vector's row and column
        imp_base = (sb // sbs) * imp_stride + (sb % sbs) * 256 + j * 16
        zero = tl.zeros((BS_, 16), tl.float32)

        # make_qx_quants(16, 32, x, L, rmse_type 1, w): w the importance, else x * x
        amax = zero
        mx = zero
        for i in range(16):
            v = tl.load(x_ptr + base + i, mask=ok, other=0.0)
            ax = tl.abs(v)
            up = ax > amax
            amax = tl.where(up, ax, amax)
            mx = tl.where(up, v, mx)
        iscale = tl.div_rn(zero - 32.0, mx)
        best_iscale = iscale
        sumlx, suml2 = _qx_sums(x_ptr, base, imp_ptr, imp_base, ok, iscale, zero, HAS_IMP)
        scale = tl.where(suml2 != 0.0, tl.div_rn(sumlx, tl.where(suml2 != 0.0, suml2, 1.0)), 0.0)
        best = scale * sumlx
        for k in range(18):  # steps -9..-1, 1..9
            iscale = tl.div_rn(zero - tl.load(steps_ptr + k), mx)
            sumlx, suml2 = _qx_sums(x_ptr, base, imp_ptr, imp_base, ok, iscale, zero, HAS_IMP)
            better = (suml2 > 0.0) & (sumlx * sumlx > best * suml2)
            scale = tl.where(better, tl.div_rn(sumlx, tl.where(better, suml2, 1.0)), scale)
            best = tl.where(better, scale * sumlx, best)
            best_iscale = tl.where(better, iscale, best_iscale)
        empty = amax < 1e-15  # GROUP_MAX_EPS: an all-zero sub-block
        scale = tl.where(empty, 0.0, scale)
        for i in range(16):
            v = tl.load(x_ptr + base + i, mask=ok, other=0.0)
            li = tl.minimum(tl.maximum(_nearest_int(best_iscale * v), -32), 31) + 32
            tl.store(lv_ptr + base + i, tl.where(empty, 0, li).to(tl.uint8), mask=ok)

        # the super-block: the scale of largest magnitude (the first such), its int8 scales, fp16 d
        first = tl.argmax(tl.abs(scale), axis=1, tie_break_left=True)  # (BS,)
        max_scale = tl.sum(tl.where(j == first[:, None], scale, 0.0), axis=1)
        live = row < n_sb
        blank = tl.abs(max_scale) < 1e-15
        iscale_b = tl.div_rn(tl.full((BS_,), -128.0, tl.float32), tl.where(blank, 1.0, max_scale))
        d16 = tl.div_rn(tl.full((BS_,), 1.0, tl.float32), iscale_b).to(tl.float16)
        sc = tl.minimum(_nearest_int(iscale_b[:, None] * scale), 127)  # (BS, 16)
        out = out_ptr + row * 210
        dbits = d16.to(tl.int16, bitcast=True).to(tl.int32)
        tl.store(out + 208, tl.where(blank, 0, dbits & 0xFF).to(tl.uint8), mask=live)
        tl.store(out + 209, tl.where(blank, 0, (dbits >> 8) & 0xFF).to(tl.uint8), mask=live)
        lane16 = tl.arange(0, 16)[None, :]
        tl.store(
            out[:, None] + 192 + lane16,
            tl.where(blank[:, None], 0, sc & 0xFF).to(tl.uint8),
            mask=live[:, None],
        )
        d = d16.to(tl.float32)[:, None] * sc.to(tl.float32)
        keep = d == 0.0
        d_safe = tl.where(keep, 1.0, d)
        for i in range(16):
            v = tl.load(x_ptr + base + i, mask=ok, other=0.0)
            li = tl.minimum(tl.maximum(_nearest_int(tl.div_rn(v, d_safe)), -32), 31) + 32
            old = tl.load(lv_ptr + base + i, mask=ok, other=0).to(tl.int32)
            tl.store(lv_ptr + base + i, tl.where(keep, old, li).to(tl.uint8), mask=ok)
        # the levels were stored by the threads holding their sub-blocks and are read below by others: the
        # program's threads meet first (without it a GPU read stale levels; Triton's interpreter cannot tell)
        tl.debug_barrier()
        # ql: byte 64 h + i = L[128 h + i] & 15 | (L[128 h + 64 + i] & 15) << 4, 64 h + 32 + i likewise from
        # +32 / +96; qh: byte 128 + 32 h + i = the four levels' high 2 bits
        lane = tl.arange(0, 32)[None, :]
        at = lv_ptr + row[:, None] * 256 + lane
        for h in range(2):
            q0 = tl.load(at + 128 * h, mask=live[:, None], other=0).to(tl.int32)
            q1 = tl.load(at + 128 * h + 32, mask=live[:, None], other=0).to(tl.int32)
            q2 = tl.load(at + 128 * h + 64, mask=live[:, None], other=0).to(tl.int32)
            q3 = tl.load(at + 128 * h + 96, mask=live[:, None], other=0).to(tl.int32)
            gone = blank[:, None]
            lo = tl.where(gone, 0, (q0 & 0xF) | ((q2 & 0xF) << 4))
            lo2 = tl.where(gone, 0, (q1 & 0xF) | ((q3 & 0xF) << 4))
            hi = tl.where(gone, 0, (q0 >> 4) | ((q1 >> 4) << 2) | ((q2 >> 4) << 4) | ((q3 >> 4) << 6))
            tl.store(out[:, None] + 64 * h + lane, lo.to(tl.uint8), mask=live[:, None])
            tl.store(out[:, None] + 64 * h + 32 + lane, lo2.to(tl.uint8), mask=live[:, None])
            tl.store(out[:, None] + 128 + 32 * h + lane, hi.to(tl.uint8), mask=live[:, None])


def encode_fused(qtype: str, rows: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor | None:
    """``qtype``'s bytes from its fused kernel, or None where the kernel may not serve: rows not on CUDA, its
    self-check failed in this process (``usable``), or a chunk of magnitudes it does not take (``tame``)."""
    if not (rows.is_cuda and usable(qtype, rows.device) and tame(rows, importance)):
        return None
    if qtype == "q6_k":
        return encode_q6_k_fused(rows, importance)
    return encode_q45_k_fused(rows, qtype, importance)


def encode_q45_k_fused(
    rows: torch.Tensor, qtype: str, importance: torch.Tensor | None = None
) -> torch.Tensor:
    """float32 rows (R, n_per_row) on CUDA, importance None, (n_per_row,) or one per row (R, n_per_row) ->
    ``qtype`` (q4_k, q5_k) bytes (R, n_per_row / 256 * block) uint8."""
    imat = importance is not None
    nmax = 15 if qtype == "q4_k" else 31
    nsteps = 37 if imat else (21 if qtype == "q4_k" else 16)
    return _launch(_q45k_kernel, rows, qtype, importance, _steps(rows.device, qtype, imat),
                   NMAX=nmax, NSTEPS=nsteps, BYTES=BLOCK_BYTES[qtype])  # fmt: skip


def encode_q6_k_fused(rows: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    """float32 rows (R, n_per_row) on CUDA, importance None, (n_per_row,) or one per row (R, n_per_row) ->
    Q6_K bytes (R, n_per_row / 256 * 210) uint8."""
    return _launch(_q6k_kernel, rows, "q6_k", importance, _steps(rows.device, "q6_k"))


def _launch(kernel, rows: torch.Tensor, qtype: str, importance: torch.Tensor | None, steps: torch.Tensor,
            **constants: int) -> torch.Tensor:  # noqa: ANN001  # fmt: skip
    """One program per ``BS`` super-blocks of ``rows``: the output and level scratch made, the importance
    given as one vector (stride 0) or one per row; the search's constants ``steps``."""
    n_rows, n_per_row = rows.shape
    n_sb = n_rows * n_per_row // QK
    x = rows.contiguous()
    out = torch.empty((n_sb, BLOCK_BYTES[qtype]), dtype=torch.uint8, device=rows.device)
    scratch = torch.empty((n_sb, QK), dtype=torch.uint8, device=rows.device)
    imp = x if importance is None else importance.to(torch.float32).contiguous()
    stride = n_per_row if imp.dim() == 2 else 0
    if n_sb:
        kernel[(triton.cdiv(n_sb, BS),)](x, imp, stride, n_per_row, out, scratch, n_sb, steps,
                                         HAS_IMP=importance is not None, BS_=BS, enable_fp_fusion=False,
                                         **constants)  # fmt: skip
    return out.reshape(n_rows, -1)


@functools.cache
def _steps(device: torch.device, qtype: str, imat: bool = False) -> torch.Tensor:
    """The searches' float32 constants as C computes them: Q4_K's 21 and Q5_K's 16 rmin + rdelta * step +
    nmax (-1, 0.1, 15; -0.5, 0.1, 31), with importance 37 (-0.9, 0.05) then make_qp_quants' 8 0.1 * step +
    63 (step -4..4 but 0); Q6_K's 18 nmax + 0.1 * step (32; step -9..9 but 0)."""
    if imat:
        nmax = np.float32(15.0 if qtype == "q4_k" else 31.0)
        step = np.arange(37, dtype=np.float32)
        search = (np.float32(-0.9) + np.float32(0.05) * step) + nmax
        qp = np.float32(0.1) * np.array([s for s in range(-4, 5) if s], dtype=np.float32) + np.float32(63.0)
        c = np.concatenate([search, qp])
    elif qtype == "q4_k":
        step = np.arange(21, dtype=np.float32)
        c = (np.float32(-1.0) + np.float32(0.1) * step) + np.float32(15.0)
    elif qtype == "q5_k":
        step = np.arange(16, dtype=np.float32)
        c = (np.float32(-0.5) + np.float32(0.1) * step) + np.float32(31.0)
    else:
        step = np.array([s for s in range(-9, 10) if s], dtype=np.float32)
        c = np.float32(32.0) + np.float32(0.1) * step
    return torch.from_numpy(c.astype(np.float32)).to(device)


#: the magnitudes (nonzero values, importance weights) a fused kernel takes
TAME = (1e-10, 1e10)


def tame(rows: torch.Tensor, importance: torch.Tensor | None) -> bool:
    """Every nonzero value of ``rows`` and ``importance`` within ``TAME`` (one device reduction, one sync)."""
    lo, hi = TAME
    checks = []
    for t in (rows, importance):
        if t is not None:
            a = t.abs()
            checks.append(((a < lo) & (a != 0)).any() | (a > hi).any())
    return not bool(torch.stack(checks).any())


def usable(qtype: str, device: torch.device) -> bool:
    """Triton is there and ``qtype``'s kernel gave the torch encoder's bytes on this device (checked once)."""
    return triton is not None and self_check(qtype, str(device))


@functools.cache
def self_check(qtype: str, device: str) -> bool:
    """Whether ``qtype``'s kernel gives the torch encoder's bytes on ``device`` (random rows at several scales,
    flat and zero blocks and sub-blocks, an outlier; without importance, with one vector, with one per row);
    checked once per process, a difference logged."""
    from forge.quant.torch_codecs import kquants

    gen = torch.Generator().manual_seed(1234)
    rows = torch.randn(48, 1024, generator=gen)
    rows[1] = 0.0
    rows[2, :256] = 3.25
    rows[3] *= 1e-6
    rows[4] *= 1e6
    rows[7, 300] = 1e5
    rows[5, ::2] = 0.0
    rows[6, 16:32] = 0.0
    rows = rows.to(device)
    imp = torch.rand(1024, generator=gen).to(device)
    weights = (None, imp, imp.expand(48, -1))
    if qtype in ("q4_k", "q5_k"):
        ops = kquants.encode_q4_k_ops if qtype == "q4_k" else kquants.encode_q5_k_ops
        pairs = [(ops(rows, w), encode_q45_k_fused(rows, qtype, w)) for w in weights]
    else:
        pairs = [(kquants.encode_q6_k_ops(rows, w), encode_q6_k_fused(rows, w)) for w in weights]
    same = all(bool(torch.equal(want, got)) for want, got in pairs)
    if not same:
        log.warning(
            "the fused %s kernel differs from the torch encoder on %s: not used", qtype.upper(), device
        )
    return same


__all__ = ["TAME", "encode_fused", "encode_q45_k_fused", "encode_q6_k_fused", "self_check", "tame", "usable"]
