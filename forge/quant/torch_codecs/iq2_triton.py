"""IQ2_XXS's search steps as Triton kernels: one lane per sub-block of 32, the same float32 operations in the
same order as ``iq2.py``'s torch operations, so the same bytes.

The torch encoder runs each step as chains of whole-chunk operations: ``make_qp_quants``' refinement is 5 x 32
passes of a dozen small launches, each snap step gathers the off-grid groups, writes out every (query,
neighbour) pair (up to 150 per group) and reduces them, and each fit is 64 sequential adds. On an H200 the
device then waits on the host's launches. Here ``qp_scale`` is ``make_qp_quants`` in one launch and
``snap_fit`` one search step (round to codes, best neighbour of every off-grid group, the fit's two sums) in
another. A lane walks a group's neighbour list scoring each point's 8 terms in coordinate order and keeps the
first least score; a NaN score makes it keep the first neighbour, as the torch search's NaN-propagating
minimum does.

Bit-exact needs what C does: divisions correctly rounded (``div_rn``; the square roots of the weights stay
with torch), no multiply-add contraction (``enable_fp_fusion=False``). As for the K-quant kernels, chunks whose magnitudes could reach
subnormals (``kquants_triton.tame``) take the torch operations, and ``usable(device)`` compares the kernels
with them once per process.
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

#: sub-blocks (columns) per program
BLOCK = 128
SUB = 32

if triton is not None:
    _SUB = tl.constexpr(SUB)

    @triton.jit
    def _nearest_int(v):
        """ops.nearest_int: ggml's 1.5 * 2**23 trick, NaN -> 0."""
        bits = (v + 12582912.0).to(tl.int32, bitcast=True)
        return tl.where(v != v, 0, (bits & 0x007FFFFF) - 0x00400000)

    @triton.jit
    def _qp_term(x_ptr, w_ptr, r, M, m, live, iscale, scale, NMAX: tl.constexpr, FIRST: tl.constexpr):
        """Row r's term w * (x - scale * l)^2 of make_qp_quants' error; FIRST: the first level, kept to 8
        bits, not clamped."""
        x = tl.load(x_ptr + r * M + m, mask=live, other=0.0)
        w = tl.load(w_ptr + r * M + m, mask=live, other=0.0)
        if FIRST:
            lv = (_nearest_int(iscale * x) & 0xFF).to(tl.float32)
        else:
            lv = tl.minimum(_nearest_int(iscale * x), NMAX).to(tl.float32)
        d = x - scale * lv
        return w * d * d

    @triton.jit
    def _qp_levels(x_ptr, w_ptr, lv_ptr, r, M, m, live, iscale, NMAX: tl.constexpr):
        """Row r's level at ``iscale``, stored to 8 bits, and its terms of sum(w x l) and sum(w l^2)."""
        x = tl.load(x_ptr + r * M + m, mask=live, other=0.0)
        w = tl.load(w_ptr + r * M + m, mask=live, other=0.0)
        li = tl.minimum(_nearest_int(iscale * x), NMAX)
        tl.store(lv_ptr + r * M + m, li & 0xFF, mask=live)
        lf = li.to(tl.float32)
        return w * x * lf, w * lf * lf

    @triton.jit
    def _qp_scale_kernel(x_ptr, w_ptr, lv_ptr, steps_ptr, out_ptr, M,
                         NMAX: tl.constexpr, BLOCK_: tl.constexpr):  # fmt: skip
        """iq2.make_qp_quants(NMAX, x, w) for x, w (32, M): the scale of each column; lv_ptr is scratch."""
        m = tl.program_id(0).to(tl.int64) * BLOCK_ + tl.arange(0, BLOCK_)
        live = m < M
        mx = tl.load(x_ptr + m, mask=live, other=0.0)
        for r in range(1, _SUB):
            mx = tl.maximum(mx, tl.load(x_ptr + r * M + m, mask=live, other=0.0))
        mx = tl.where(mx > 0.0, mx, 0.0)
        zero = tl.zeros((BLOCK_,), tl.float32)
        iscale = tl.div_rn(zero + NMAX, mx)
        scale = tl.div_rn(zero + 1.0, iscale)
        best = _qp_term(x_ptr, w_ptr, 0, M, m, live, iscale, scale, NMAX, True)
        for r in range(1, _SUB):
            best = best + _qp_term(x_ptr, w_ptr, r, M, m, live, iscale, scale, NMAX, True)
        for k in range(8):
            iscale_is = tl.div_rn(zero + tl.load(steps_ptr + k), mx)
            scale_is = tl.div_rn(zero + 1.0, iscale_is)
            mse = _qp_term(x_ptr, w_ptr, 0, M, m, live, iscale_is, scale_is, NMAX, False)
            for r in range(1, _SUB):
                mse = mse + _qp_term(x_ptr, w_ptr, r, M, m, live, iscale_is, scale_is, NMAX, False)
            better = mse < best
            best = tl.where(better, mse, best)
            iscale = tl.where(better, iscale_is, iscale)
        sumlx, suml2 = _qp_levels(x_ptr, w_ptr, lv_ptr, 0, M, m, live, iscale, NMAX)
        for r in range(1, _SUB):
            tx, t2 = _qp_levels(x_ptr, w_ptr, lv_ptr, r, M, m, live, iscale, NMAX)
            sumlx = sumlx + tx
            suml2 = suml2 + t2
        # the torch loop stops after a pass that changed no column; a column a pass leaves alone is left
        # alone by every later pass too, so running all five passes gives the same levels
        for _ in range(5):
            for row in range(_SUB):
                x = tl.load(x_ptr + row * M + m, mask=live, other=0.0)
                w = tl.load(w_ptr + row * M + m, mask=live, other=0.0)
                stored = tl.load(lv_ptr + row * M + m, mask=live, other=0)
                li = stored.to(tl.float32)
                slx = sumlx - w * x * li
                sl2 = suml2 - w * li * li
                ok = (slx > 0.0) & (sl2 > 0.0)
                new_l = tl.minimum(_nearest_int(tl.div_rn(x * sl2, slx)), NMAX)
                ok = ok & (new_l != stored)
                nf = new_l.to(tl.float32)
                slx = slx + w * x * nf
                sl2 = sl2 + w * nf * nf
                ok = ok & (slx * slx * suml2 > sumlx * sumlx * sl2)
                tl.store(lv_ptr + row * M + m, tl.where(ok, new_l & 0xFF, stored), mask=live)
                sumlx = tl.where(ok, slx, sumlx)
                suml2 = tl.where(ok, sl2, suml2)
        pos = suml2 > 0.0
        tl.store(out_ptr + m, tl.where(pos, tl.div_rn(sumlx, tl.where(pos, suml2, 1.0)), 0.0), mask=live)

    @triton.jit
    def _term(wa, x, s, mag):
        """A coordinate's term of a neighbour's score: waux * (s * mag - x)^2, in iq2.snap's order."""
        d = s * mag - x
        return wa * d * d

    @triton.jit
    def _group_rows(ptr, base, M, m, live):
        """The 8 values of a group (rows base..base+7) of every column."""
        row = ptr + base * M + m
        return (tl.load(row, mask=live, other=0.0), tl.load(row + M, mask=live, other=0.0),
                tl.load(row + 2 * M, mask=live, other=0.0), tl.load(row + 3 * M, mask=live, other=0.0),
                tl.load(row + 4 * M, mask=live, other=0.0), tl.load(row + 5 * M, mask=live, other=0.0),
                tl.load(row + 6 * M, mask=live, other=0.0), tl.load(row + 7 * M, mask=live, other=0.0))  # fmt: skip

    @triton.jit
    def _level(inv, x):
        """A coordinate's level at 1/inv: nearest_int((inv x - 1) / 2) in 0..2 (iq2.snap)."""
        return tl.minimum(tl.maximum(_nearest_int(0.5 * (inv * x - 1.0)), 0), 2)

    @triton.jit
    def _snap_group(x_ptr, wa_ptr, base, M, m, live, s, inv, poc_ptr, start_ptr, count_ptr, flat_ptr, mags_ptr,
                    LONGEST: tl.constexpr):  # fmt: skip
        """The point of one group of 8 (rows base..base+7) of every column (iq2.snap)."""
        x0, x1, x2, x3, x4, x5, x6, x7 = _group_rows(x_ptr, base, M, m, live)
        code = _level(inv, x0) + 3 * _level(inv, x1) + 9 * _level(inv, x2) + 27 * _level(inv, x3)
        code += 81 * _level(inv, x4) + 243 * _level(inv, x5) + 729 * _level(inv, x6) + 2187 * _level(inv, x7)
        on_grid = tl.load(poc_ptr + code, mask=live, other=0)
        start = tl.load(start_ptr + code, mask=live, other=0)
        count = tl.where(on_grid < 0, tl.load(count_ptr + code, mask=live, other=0), 0)
        w0, w1, w2, w3, w4, w5, w6, w7 = _group_rows(wa_ptr, base, M, m, live)
        best = tl.full(s.shape, float("inf"), tl.float32)
        pick = tl.zeros(s.shape, tl.int64)
        nan = tl.zeros(s.shape, tl.int1)
        for j in range(0, LONGEST):  # the codebook's longest list (a block's own longest is about as long)
            ok = j < count
            mg = mags_ptr + tl.load(flat_ptr + start + j, mask=ok, other=0) * 8
            score = _term(w0, x0, s, tl.load(mg + 0, mask=ok, other=0.0))
            score = score + _term(w1, x1, s, tl.load(mg + 1, mask=ok, other=0.0))
            score = score + _term(w2, x2, s, tl.load(mg + 2, mask=ok, other=0.0))
            score = score + _term(w3, x3, s, tl.load(mg + 3, mask=ok, other=0.0))
            score = score + _term(w4, x4, s, tl.load(mg + 4, mask=ok, other=0.0))
            score = score + _term(w5, x5, s, tl.load(mg + 5, mask=ok, other=0.0))
            score = score + _term(w6, x6, s, tl.load(mg + 6, mask=ok, other=0.0))
            score = score + _term(w7, x7, s, tl.load(mg + 7, mask=ok, other=0.0))
            better = ok & (score < best)
            best = tl.where(better, score, best)
            pick = tl.where(better, j, pick)
            nan = nan | (ok & (score != score))
        pick = tl.where(nan, 0, pick)
        near = tl.load(flat_ptr + start + pick, mask=live & (count > 0), other=0)
        return tl.where(count > 0, near, on_grid.to(tl.int64))

    @triton.jit
    def _fit_terms(x_ptr, w_ptr, mags_ptr, base, i, M, m, live, p):
        """Row base + i's terms of iq2.fit, w x q and w q^2, q the magnitude of point p's coordinate i."""
        x = tl.load(x_ptr + (base + i) * M + m, mask=live, other=0.0)
        w = tl.load(w_ptr + (base + i) * M + m, mask=live, other=0.0)
        q = tl.load(mags_ptr + p * 8 + i, mask=live, other=0.0)
        return w * x * q, w * q * q

    @triton.jit
    def _snap_fit_kernel(x_ptr, wa_ptr, w_ptr, scale_ptr, inv_ptr, poc_ptr, start_ptr, count_ptr, flat_ptr,
                         mags_ptr, point_ptr, sqx_ptr, sq2_ptr, M, LONGEST: tl.constexpr,
                         BLOCK_: tl.constexpr):  # fmt: skip
        """iq2.snap then iq2.fit on its points: point (4, M), sqx (M,), sq2 (M,)."""
        m = tl.program_id(0).to(tl.int64) * BLOCK_ + tl.arange(0, BLOCK_)
        live = m < M
        s = tl.load(scale_ptr + m, mask=live, other=1.0)
        inv = tl.load(inv_ptr + m, mask=live, other=1.0)
        p = _snap_group(x_ptr, wa_ptr, 0, M, m, live, s, inv, poc_ptr, start_ptr, count_ptr, flat_ptr, mags_ptr,
                        LONGEST)  # fmt: skip
        tl.store(point_ptr + m, p, mask=live)
        sqx, sq2 = _fit_terms(x_ptr, w_ptr, mags_ptr, 0, 0, M, m, live, p)
        for i in range(1, 8):
            tx, t2 = _fit_terms(x_ptr, w_ptr, mags_ptr, 0, i, M, m, live, p)
            sqx = sqx + tx
            sq2 = sq2 + t2
        for g in range(1, _SUB // 8):
            p = _snap_group(x_ptr, wa_ptr, 8 * g, M, m, live, s, inv, poc_ptr, start_ptr, count_ptr, flat_ptr,
                            mags_ptr, LONGEST)  # fmt: skip
            tl.store(point_ptr + g * M + m, p, mask=live)
            for i in range(8):
                tx, t2 = _fit_terms(x_ptr, w_ptr, mags_ptr, 8 * g, i, M, m, live, p)
                sqx = sqx + tx
                sq2 = sq2 + t2
        tl.store(sqx_ptr + m, sqx, mask=live)
        tl.store(sq2_ptr + m, sq2, mask=live)


@functools.cache
def _qp_steps(nmax: int, device: str) -> torch.Tensor:
    """The 8 numerators of make_qp_quants' scale search, as iq2.py rounds them (float32)."""
    fn = np.float32(nmax)
    steps = [np.float32(0.1) * np.float32(k) + fn for k in (-4, -3, -2, -1, 1, 2, 3, 4)]
    return torch.tensor(np.array(steps, np.float32), device=device)


@functools.cache
def _longest(count: torch.Tensor) -> int:
    return int(count.max())


def qp_scale(nmax: int, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``iq2.make_qp_quants(nmax, x, w)`` for x, w (32, M) float32 on CUDA: the scale (M,)."""
    m = x.shape[1]
    out = torch.empty(m, dtype=torch.float32, device=x.device)
    scratch = torch.empty((SUB, m), dtype=torch.int32, device=x.device)
    _qp_scale_kernel[(triton.cdiv(m, BLOCK),)](
        x.contiguous(), w.contiguous(), scratch, _qp_steps(nmax, str(x.device)), out, m, NMAX=nmax,
        BLOCK_=BLOCK, enable_fp_fusion=False,
    )  # fmt: skip
    return out


def snap_fit(
    cb,  # noqa: ANN001 - iq2.DeviceCodebook
    xval: torch.Tensor,
    waux: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    inv_scale: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``iq2.snap(cb, xval, waux, scale, inv_scale)`` and ``iq2.fit`` on its points: (point (4, M) int64,
    sqx (M,), sq2 (M,))."""
    m = xval.shape[1]
    dev = xval.device
    point = torch.empty((SUB // 8, m), dtype=torch.int64, device=dev)
    sqx = torch.empty(m, dtype=torch.float32, device=dev)
    sq2 = torch.empty(m, dtype=torch.float32, device=dev)
    _snap_fit_kernel[(triton.cdiv(m, BLOCK),)](
        xval.contiguous(), waux.contiguous(), weight.contiguous(), scale.contiguous(), inv_scale.contiguous(),
        cb.point_of_code, cb.nb_start, cb.nb_count, cb.nb_flat, cb.mags, point, sqx, sq2, m,
        LONGEST=_longest(cb.nb_count), BLOCK_=BLOCK, enable_fp_fusion=False,
    )  # fmt: skip
    return point, sqx, sq2


def usable(device: torch.device) -> bool:
    """Triton is there, ``device`` is CUDA and the kernels gave the torch operations' bytes there (checked once)."""
    return triton is not None and device.type == "cuda" and self_check(str(device))


@functools.cache
def self_check(device: str) -> bool:
    """Whether IQ2_XXS through the kernels gives the torch operations' bytes on ``device`` (``agrees``); checked
    once per process, a difference logged."""
    try:
        same = agrees(device, 2048)
    except Exception as e:  # noqa: BLE001 - a kernel that does not compile or run here is not used
        log.warning("the IQ2_XXS kernels fail on %s (%s): not used", device, e)
        return False
    if not same:
        log.warning("the IQ2_XXS kernels differ from the torch operations on %s: not used", device)
    return same


def agrees(device: str, n_per_row: int) -> bool:
    """Whether ``iq2.encode_iq2_xxs`` gives the same bytes with and without the kernels on 8 rows of
    ``n_per_row`` values (random rows at several scales, zero and flat sub-blocks, an outlier; one importance
    vector and one per row)."""
    from forge.quant.torch_codecs import iq2

    gen = torch.Generator().manual_seed(4321)
    rows = torch.randn(8, n_per_row, generator=gen) * torch.rand(8, 1, generator=gen) * 3
    rows[1] = 0.0
    rows[2, :256] = 0.75
    rows[3, 32:64] = 0.0
    rows[4] *= 1e-4
    rows[5, 100] = 40.0
    rows[6, ::3] = 0.0
    rows = rows.to(device)
    imp = torch.rand(n_per_row, generator=gen).to(device)
    weights = (imp, (torch.rand(8, n_per_row, generator=gen) + 0.01).to(device))
    return all(
        torch.equal(iq2.encode_iq2_xxs(rows, w, fused=False), iq2.encode_iq2_xxs(rows, w, fused=True))
        for w in weights
    )


__all__ = ["agrees", "qp_scale", "self_check", "snap_fit", "usable"]
