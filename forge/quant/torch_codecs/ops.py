"""float32 primitives on torch tensors that give the same bits as forge/quant/numerics.py.

Same layout convention: ``*_t`` arrays are position-major (n, B), element i of every block in row i,
so a block sum is a loop over the n rows, each step one elementwise add across all blocks: the
sequential float32 order of ggml's C loops. torch's sum/cumsum are not sequential (pairwise on CPU,
tree reductions on CUDA) and are only used on integers here.

Two torch habits are avoided on purpose because they round twice where numpy rounds once:
``tensor / python_scalar`` (CUDA multiplies by the reciprocal) and ``python_scalar / tensor``
(``Tensor.__rtruediv__`` is ``reciprocal() * scalar``). Every division goes through :func:`div`,
which divides by a real tensor. Separate elementwise ops are never fused into an FMA by torch's
eager kernels, so ``a * b + c`` rounds twice, like numpy.
"""

from __future__ import annotations

import numpy as np
import torch

F32 = np.float32
GROUP_MAX_EPS = float(F32(1e-15))
_MAGIC = float(F32(12582912.0))  # 1.5 * 2**23, as numerics.nearest_int
_EXACT_LIMIT = 4194303.0


def c32(v: float) -> float:
    """A Python float holding exactly the float32 value numpy would use for ``np.float32(v)``."""
    return float(F32(v))


def scalar(v: float, like: torch.Tensor) -> torch.Tensor:
    """A 0-d float32 tensor on ``like``'s device (a divisor torch will not turn into a reciprocal)."""
    return torch.tensor(c32(v), dtype=torch.float32, device=like.device)


def div(a: torch.Tensor | float, b: torch.Tensor | float) -> torch.Tensor:
    """Correctly rounded float32 a / b with either side a scalar."""
    if not isinstance(b, torch.Tensor):
        b = scalar(b, a)  # type: ignore[arg-type]
    if not isinstance(a, torch.Tensor):
        a = scalar(a, b)
    return torch.div(a, b)


def sqrt(a: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 sqrt. torch's CPU sqrt is not (its vector path is off by one ulp
    for about 1 in 6 inputs); sqrt in float64 rounded once to float32 is exact (53 >= 2*24 + 2)."""
    return torch.sqrt(a.to(torch.float64)).to(torch.float32)


def np_maximum(a: torch.Tensor, b: torch.Tensor | float) -> torch.Tensor:
    """``np.maximum``: NaN propagates, and on equal values (+0 vs -0) the second operand wins."""
    if not isinstance(b, torch.Tensor):
        b = scalar(b, a)
    return torch.where((a > b) | torch.isnan(a), a, b)


def np_minimum(a: torch.Tensor, b: torch.Tensor | float) -> torch.Tensor:
    """``np.minimum`` with numpy's tie rule (second operand)."""
    if not isinstance(b, torch.Tensor):
        b = scalar(b, a)
    return torch.where((a < b) | torch.isnan(a), a, b)


def seq_sum(terms: torch.Tensor, start_zero: bool = True) -> torch.Tensor:
    """Sum over axis 0 in C loop order: ``s = 0; for t in terms: s += t`` (``start_zero=False``: s = t[0])."""
    out = torch.zeros_like(terms[0]) + terms[0] if start_zero else terms[0].clone()
    for i in range(1, terms.shape[0]):
        out += terms[i]
    return out


def nearest_int(f: torch.Tensor) -> torch.Tensor:
    """ggml's nearest_int as numerics.nearest_int computes it on x86 (int32, wrapping beyond 2**22).

    A NaN gives 0 there (x86's default NaN has mantissa 0x400000); CUDA's canonical NaN would not,
    so NaN is mapped explicitly.
    """
    bits = (f.to(torch.float32) + _MAGIC).view(torch.int32)
    out = (bits & 0x007FFFFF) - 0x00400000
    return torch.where(torch.isnan(f), torch.zeros_like(out), out)


def nearest_int_clip(v: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """clamp(nearest_int(v), lo, hi) as float32 for any v (numerics.nearest_int_clip)."""
    r = torch.where(v.abs() <= _EXACT_LIMIT, torch.round(v), nearest_int(v).to(torch.float32))
    return r.clamp_(lo, hi)


def fp16_round(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float16).to(torch.float32)


#: the fp16 bits of x86's default NaN (0xFFC00000, what an invalid operation such as inf / inf gives) and of
#: its negation, as numpy converts them
X86_NAN_FP16, X86_NEGATED_NAN_FP16 = 0xFE00, 0x7E00


def fp16_bytes(v: torch.Tensor, nan_negated: bool = False) -> torch.Tensor:
    """float32 (B,) -> the little-endian fp16 bytes (B, 2) uint8.

    A NaN is written with the bits the CPU codec writes there. The rows are finite, so a NaN field was made
    by an invalid operation: x86's default NaN, negative, which later operations carry with its sign (and a
    negation flips: ``nan_negated`` for a field computed from a negated value). CUDA makes a positive
    canonical NaN and converts it to fp16 as 0x7FFF, so the bits are set here rather than converted.
    """
    bits = v.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    bits = torch.where(torch.isnan(v), X86_NEGATED_NAN_FP16 if nan_negated else X86_NAN_FP16, bits)
    return torch.stack([bits & 0xFF, bits >> 8], dim=-1).to(torch.uint8)


def to_t(blocks: torch.Tensor) -> torch.Tensor:
    """(B, n) block-major -> (n, B) position-major, contiguous."""
    return blocks.t().contiguous()


def importance_t(importance: torch.Tensor, n_rows: int, n: int) -> torch.Tensor:
    """The importance weight of every element of the rows' n-blocks, position-major (n, n_rows*n_per_row/n),
    from one vector (n_per_row,) that every row shares or one per row (n_rows, n_per_row)."""
    blocks = to_t(importance.reshape(-1, n))
    return blocks if importance.dim() == 2 else blocks.repeat(1, n_rows)


# --------------------------------------------------------------------------------------------------
# make_qkx2_quants / make_qkx3_quants (numerics._make_qkx_t)


def make_qkx_t(
    x: torch.Tensor,
    w: torch.Tensor,
    nmax: int,
    rmin: float,
    rdelta: float,
    nstep: int,
    use_mad: bool,
    guarded: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (scale (B,), the_min (B,), L (n, B) uint8), as numerics.make_qkx2/3_quants_t.

    The numpy code picks between two rounding paths with a whole-array test; both give the same
    values element by element, so this computes the element-wise form (no host sync).
    """
    fnmax = float(nmax)
    zero = scalar(0.0, x)

    def error(scale: torch.Tensor, mn: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
        t = levels * scale
        t += mn
        t -= x
        t = t.abs_() if use_mad else t.mul_(t)
        t *= w
        return seq_sum(t)

    lo = x.amin(dim=0)
    hi = x.amax(dim=0)
    sum_w = seq_sum(w, start_zero=False)
    sum_x = seq_sum(w * x, start_zero=False)
    mn = mn0 = np_minimum(lo, zero)
    flat = hi == mn
    hi_safe = torch.where(flat, scalar(1.0, x), hi)

    iscale = div(fnmax, hi_safe - mn)
    scale = div(1.0, iscale)
    levels = nearest_int_clip(iscale * (x - mn), 0, nmax)
    best = error(scale, mn, levels)
    nmax_t = scalar(fnmax, x)
    for step in range(nstep + 1):
        c = float((F32(rmin) + F32(rdelta) * F32(step)) + F32(nmax))
        iscale = div(c, hi_safe - mn)
        lv = (x - mn) * iscale
        if guarded:
            # make_qkx3: v > 0 ? nearest_int(MIN(v, nmax)) : 0, so NaN -> 0 and +inf -> nmax
            lv = torch.round(torch.fmin(torch.fmax(lv, zero), nmax_t))
        else:
            lv = nearest_int_clip(lv, 0, nmax)
        wl = w * lv
        sum_l = seq_sum(wl)
        sum_xl = seq_sum(wl * x)
        sum_l2 = seq_sum(wl * lv)
        det = sum_w * sum_l2 - sum_l * sum_l
        this_scale = div(sum_w * sum_xl - sum_x * sum_l, det)
        this_min = div(sum_l2 * sum_x - sum_l * sum_xl, det)
        pos = this_min > 0
        this_min = torch.where(pos, zero, this_min)
        this_scale = torch.where(pos, div(sum_xl, sum_l2), this_scale)
        cur = error(this_scale, this_min, lv)
        better = (det > 0) & (cur < best)
        levels = torch.where(better, lv, levels)
        best = torch.where(better, cur, best)
        scale = torch.where(better, this_scale, scale)
        mn = torch.where(better, this_min, mn)
    levels = torch.where(flat, zero, levels)
    scale = torch.where(flat, zero, scale)
    return scale, -torch.where(flat, mn0, mn), levels.to(torch.uint8)


# --------------------------------------------------------------------------------------------------
# make_qp_quants (numerics.make_qp_quants_t)


def _as_u8(levels_i32: torch.Tensor) -> torch.Tensor:
    return (levels_i32 & 0xFF).to(torch.float32)


def make_qp_quants_t(x: torch.Tensor, nmax: int, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """numerics.make_qp_quants_t: (scale (B,), L (n, B) uint8) for non-negative x (n, B)."""
    n = x.shape[0]
    fnmax = float(nmax)
    zero_t = scalar(0.0, x)
    mx = np_maximum(x.amax(dim=0), zero_t)
    zero = mx < GROUP_MAX_EPS
    mx = torch.where(zero, scalar(1.0, x), mx)

    def mse(scale: torch.Tensor, lv: torch.Tensor) -> torch.Tensor:
        diff = x - scale * lv
        t = w * diff
        t *= diff
        return seq_sum(t)

    iscale = div(fnmax, mx)
    best = mse(div(1.0, iscale), _as_u8(nearest_int(iscale * x)))
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_is = div(float(F32(0.1) * F32(step) + F32(fnmax)), mx)
        cur = mse(div(1.0, iscale_is), torch.clamp(nearest_int(iscale_is * x), max=nmax).to(torch.float32))
        better = cur < best
        best = torch.where(better, cur, best)
        iscale = torch.where(better, iscale_is, iscale)
    li32 = torch.clamp(nearest_int(iscale * x), max=nmax).to(torch.float32)
    lv = _as_u8(li32.to(torch.int32))
    wx = w * x
    sumlx = seq_sum(wx * li32)
    suml2 = seq_sum(w * li32 * li32)
    for _ in range(5):
        changed = torch.zeros_like(zero)
        for i in range(n):
            li = lv[i]
            slx = sumlx - wx[i] * li
            sl2 = suml2 - w[i] * li * li
            ok = (slx > 0) & (sl2 > 0)
            new_l = torch.clamp(nearest_int(div(x[i] * sl2, slx)), max=nmax).to(torch.float32)
            cand = ok & (new_l != li)
            slx2 = slx + wx[i] * new_l
            sl22 = sl2 + w[i] * new_l * new_l
            take = cand & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22)
            lv[i] = torch.where(take, _as_u8(new_l.to(torch.int32)), li)
            sumlx = torch.where(take, slx2, sumlx)
            suml2 = torch.where(take, sl22, suml2)
            changed |= take
        if not bool(changed.any()):
            break
    scale = torch.where(suml2 > 0, div(sumlx, suml2), zero_t)
    lv = torch.where(zero, zero_t, lv)
    return torch.where(zero, zero_t, scale), lv.to(torch.uint8)


# --------------------------------------------------------------------------------------------------
# make_qx_quants / make_q3_quants (numerics.make_qx_quants_t, numerics.make_q3_quants_t)


def first_absmax(x: torch.Tensor) -> torch.Tensor:
    """The element of largest magnitude of each column (first one on ties), keeping its sign; a column with
    a NaN gives its first NaN (numpy's argmax). The first index is the smallest matching position, so the
    choice does not depend on how a device's reduction visits equal values."""
    a = x.abs()
    nan = torch.isnan(a)
    hit = torch.where(nan.any(dim=0), nan, a == a.amax(dim=0))
    pos = torch.arange(x.shape[0], device=x.device).view(-1, *([1] * (x.dim() - 1)))
    first = torch.where(hit, pos, x.shape[0]).amin(dim=0)
    return x.gather(0, first[None])[0]


def make_qx_quants_t(
    x: torch.Tensor, nmax: int, w: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """numerics.make_qx_quants_t: (scale (B,), L (n, B) uint8 holding l + nmax); ``w=None``: weights x²."""
    if w is None:
        w = x * x
    zero_t = scalar(0.0, x)
    mx = first_absmax(x)
    zero = mx.abs() < GROUP_MAX_EPS
    mx = torch.where(zero, scalar(1.0, x), mx)
    wx = w * x

    def levels(iscale: torch.Tensor) -> torch.Tensor:
        return torch.round(iscale * x).clamp_(-nmax, nmax - 1)

    def sums(iscale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lv = levels(iscale)
        wl = w * lv
        wl *= lv
        return seq_sum(wx * lv), seq_sum(wl)

    best_iscale = div(-float(nmax), mx)
    sumlx, suml2 = sums(best_iscale)
    scale = torch.where(suml2 != 0, div(sumlx, suml2), zero_t)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = div(-float(F32(nmax) + F32(0.1) * F32(step)), mx)
        sumlx, suml2 = sums(iscale)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        new_scale = div(sumlx, suml2)
        scale = torch.where(better, new_scale, scale)
        best = torch.where(better, new_scale * sumlx, best)
        best_iscale = torch.where(better, iscale, best_iscale)
    lv = levels(best_iscale) + float(nmax)
    lv = torch.where(zero, zero_t, lv)
    return torch.where(zero, zero_t, scale), lv.to(torch.uint8)


def make_q3_quants_t(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """numerics.make_q3_quants_t: (scale (B,), L (n, B) uint8 = l + nmax), weights x², coordinate descent."""
    zero_t = scalar(0.0, x)
    mx = first_absmax(x)
    zero = mx.abs() < GROUP_MAX_EPS
    mx = torch.where(zero, scalar(1.0, x), mx)
    lv = torch.round(div(-float(nmax), mx) * x).clamp_(-nmax, nmax - 1)
    w = x * x
    wx = w * x
    sumlx = seq_sum(wx * lv)
    suml2 = seq_sum(w * lv * lv)
    for _ in range(5):
        changed = torch.zeros_like(zero)
        for i in range(x.shape[0]):
            li = lv[i]
            slx = sumlx - wx[i] * li
            sl2 = suml2 - w[i] * li * li
            new_l = nearest_int_clip(div(x[i] * sl2, slx), -nmax, nmax - 1)
            slx2 = slx + wx[i] * new_l
            sl22 = sl2 + w[i] * new_l * new_l
            take = (slx > 0) & (new_l != li) & (sl22 > 0) & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22)
            lv[i] = torch.where(take, new_l, li)
            sumlx = torch.where(take, slx2, sumlx)
            suml2 = torch.where(take, sl22, suml2)
            changed |= take
        if not bool(changed.any()):
            break
    scale = torch.where(suml2 > 0, div(sumlx, suml2), zero_t)
    levels = torch.where(zero, zero_t, lv + float(nmax))
    return torch.where(zero, zero_t, scale), levels.to(torch.uint8)
