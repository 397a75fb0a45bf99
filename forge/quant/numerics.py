"""Vectorized float32 primitives that reproduce ggml's quantizer helpers bit for bit.

Layout convention: the ``*_t`` functions take blocks *position-major*: an array of shape (n, B) where
``x[i]`` holds element i of each of the B blocks (C-contiguous). A sum over a block is then a
reduction over axis 0, which numpy performs as a sequential float32 accumulation per column, the same
order (and so the same rounding) as ggml's ``for (i = 0; i < n; ++i) sum += ...`` loops. The
functions without ``_t`` take the natural block-major shape (B, n) and transpose.

ggml names kept: ``nearest_int``, ``make_qx_quants``, ``make_q3_quants``, ``make_qkx2_quants``,
``make_qkx3_quants``, ``make_qp_quants`` (ggml/src/ggml-quants.c).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from forge.bulk import NON_FINITE, all_finite, encoder_threads, thread_pool
from forge.errors import ForgeError

F32 = np.float32
#: ggml's GROUP_MAX_EPS: a group whose largest magnitude is below this is encoded as all zero.
GROUP_MAX_EPS = F32(1e-15)
_MAGIC = F32(12582912.0)  # 1.5 * 2**23: adding it leaves round-half-even(f) in the low mantissa bits
_NEAREST_INT_EXACT_LIMIT = F32(4194303.0)


def f32(v: float) -> np.float32:
    return F32(v)


def nearest_int(f: np.ndarray) -> np.ndarray:
    """ggml's ``nearest_int`` exactly, including its wrap-around for |f| > 4194303 (int32 result)."""
    bits = (np.asarray(f, dtype=F32) + _MAGIC).view(np.int32)
    return (bits & 0x007FFFFF) - 0x00400000


def rint_clip(v: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """clamp(nearest_int(v), lo, hi) as float32, for |v| <= 4194303 (exact there)."""
    r = np.rint(v)
    return np.clip(r, F32(lo), F32(hi), out=r)


def nearest_int_clip(v: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """clamp(nearest_int(v), lo, hi) as float32 for any finite or non-finite v, as ggml computes it."""
    with np.errstate(invalid="ignore"):
        inside = np.abs(v) <= _NEAREST_INT_EXACT_LIMIT
    if inside.all():
        return rint_clip(v, lo, hi)
    return np.clip(nearest_int(v), lo, hi).astype(F32)


def fp16_round(v: np.ndarray) -> np.ndarray:
    """float32 -> fp16 (round to nearest even, overflow to inf) -> float32: GGML_FP32_TO_FP16 then back."""
    with np.errstate(over="ignore"):
        return np.asarray(v, dtype=F32).astype(np.float16).astype(F32)


def fp16_bits(v: np.ndarray) -> np.ndarray:
    """float32 -> fp16 bit patterns (uint16)."""
    with np.errstate(over="ignore"):
        return np.asarray(v, dtype=F32).astype(np.float16).view(np.uint16)


def seq_sum(terms: np.ndarray, start_zero: bool = True) -> np.ndarray:
    """Sum over axis 0 in sequential float32 order: ``s = 0; for t in terms: s += t`` (C loop order).

    ``start_zero=False`` starts from ``terms[0]`` instead of ``0 + terms[0]`` (differs only for -0.0).
    """
    terms = np.ascontiguousarray(terms, dtype=F32)
    n = terms.shape[0]
    flat = terms.reshape(n, -1)
    if flat.shape[1] >= 16:
        # numpy reduces axis 0 of a C-contiguous array row by row (no pairwise summation there).
        out = np.add.reduce(flat, axis=0, initial=F32(0)) if start_zero else np.add.reduce(flat, axis=0)
    else:
        out = np.zeros(flat.shape[1], F32) if start_zero else flat[0].copy()
        for i in range(0 if start_zero else 1, n):
            out += flat[i]
    return out.reshape(terms.shape[1:])


def first_absmax(x_t: np.ndarray) -> np.ndarray:
    """The element of largest magnitude of each block (first one on ties), keeping its sign."""
    idx = np.abs(x_t).argmax(axis=0)
    return np.take_along_axis(x_t, idx[None], axis=0)[0]


def to_t(blocks: np.ndarray) -> np.ndarray:
    """(B, n) block-major -> (n, B) position-major, contiguous float32."""
    return np.ascontiguousarray(np.asarray(blocks, dtype=F32).T)


# --------------------------------------------------------------------------------------------------
# make_qx_quants (symmetric, signed levels -nmax..nmax-1), rmse_type 1


def make_qx_quants_t(x: np.ndarray, nmax: int, w: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """ggml ``make_qx_quants(n, nmax, x, L, rmse_type=1, qw)``; ``w=None`` means weights x².

    Returns (scale (B,), L (n, B) uint8 holding l + nmax).
    """
    x = np.asarray(x, dtype=F32)
    if w is None:
        w = x * x
    fnmax = F32(nmax)
    with np.errstate(all="ignore"):
        mx = first_absmax(x)
        zero = np.abs(mx) < GROUP_MAX_EPS
        mx = np.where(zero, F32(1), mx)
        wx = w * x

        def sums(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            lv = rint_clip(iscale * x, -nmax, nmax - 1)
            sumlx = seq_sum(wx * lv)
            wl = w * lv
            wl *= lv
            return sumlx, seq_sum(wl)

        best_iscale = -fnmax / mx
        sumlx, suml2 = sums(best_iscale)
        scale = np.where(suml2 != 0, sumlx / suml2, F32(0)).astype(F32)
        best = scale * sumlx
        for step in range(-9, 10):
            if step == 0:
                continue
            iscale = -(fnmax + F32(0.1) * F32(step)) / mx
            sumlx, suml2 = sums(iscale)
            better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            if better.any():
                new_scale = sumlx / suml2
                scale = np.where(better, new_scale, scale)
                best = np.where(better, new_scale * sumlx, best)
                best_iscale = np.where(better, iscale, best_iscale)
        levels = rint_clip(best_iscale * x, -nmax, nmax - 1) + fnmax
    levels[:, zero] = 0
    scale = np.where(zero, F32(0), scale).astype(F32)
    return scale, levels.astype(np.uint8)


def make_qx_quants(x: np.ndarray, nmax: int, w: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Block-major form of :func:`make_qx_quants_t`: x (B, n) -> (scale (B,), L (B, n))."""
    scale, levels = make_qx_quants_t(to_t(x), nmax, None if w is None else to_t(w))
    return scale, np.ascontiguousarray(levels.T)


# --------------------------------------------------------------------------------------------------
# make_q3_quants (Q3_K without importance): make_qx start + coordinate descent, weights x²


def make_q3_quants_t(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml ``make_q3_quants(n, nmax, x, L, do_rmse=true)``. Returns (scale (B,), L (n, B) uint8 = l + nmax)."""
    x = np.asarray(x, dtype=F32)
    n = x.shape[0]
    with np.errstate(all="ignore"):
        mx = first_absmax(x)
        zero = np.abs(mx) < GROUP_MAX_EPS
        mx = np.where(zero, F32(1), mx)
        iscale = F32(-nmax) / mx
        lv = rint_clip(iscale * x, -nmax, nmax - 1)
        w = x * x
        wx = w * x
        sumlx = seq_sum(wx * lv)
        suml2 = seq_sum(w * lv * lv)
        for _ in range(5):
            changed = np.zeros(mx.shape, bool)
            for i in range(n):
                li = lv[i]
                slx = sumlx - wx[i] * li
                sl2 = suml2 - w[i] * li * li
                new_l = nearest_int_clip(x[i] * sl2 / slx, -nmax, nmax - 1)
                cand = (slx > 0) & (new_l != li)
                slx2 = slx + wx[i] * new_l
                sl22 = sl2 + w[i] * new_l * new_l
                take = cand & (sl22 > 0) & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22)
                if take.any():
                    lv[i] = np.where(take, new_l, li)
                    sumlx = np.where(take, slx2, sumlx)
                    suml2 = np.where(take, sl22, suml2)
                    changed |= take
            if not changed.any():
                break
        scale = np.where(suml2 > 0, sumlx / suml2, F32(0)).astype(F32)
    levels = lv + F32(nmax)
    levels[:, zero] = 0
    return np.where(zero, F32(0), scale).astype(F32), levels.astype(np.uint8)


# --------------------------------------------------------------------------------------------------
# make_qkx2_quants / make_qkx3_quants (asymmetric: x ≈ scale*L - the_min, L in 0..nmax)


def _make_qkx_t(
    x: np.ndarray,
    w: np.ndarray,
    nmax: int,
    rmin: float,
    rdelta: float,
    nstep: int,
    use_mad: bool,
    guarded: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    fnmax = F32(nmax)
    zero, limit = F32(0), _NEAREST_INT_EXACT_LIMIT
    # work buffers, reused by every candidate (the loop is the encoders' hot path)
    xm = np.empty_like(x)
    lv = np.empty_like(x)
    wl = np.empty_like(x)
    tmp = np.empty_like(x)

    def error(scale: np.ndarray, mn: np.ndarray, levels: np.ndarray) -> np.ndarray:
        np.multiply(levels, scale, out=tmp)
        np.add(tmp, mn, out=tmp)
        np.subtract(tmp, x, out=tmp)
        if use_mad:
            np.abs(tmp, out=tmp)
        else:
            np.multiply(tmp, tmp, out=tmp)
        np.multiply(tmp, w, out=tmp)
        return seq_sum(tmp)

    with np.errstate(all="ignore"):
        lo = x.min(axis=0)
        hi = x.max(axis=0)
        sum_w = seq_sum(w, start_zero=False)
        sum_x = seq_sum(w * x, start_zero=False)
        mn = mn0 = np.minimum(lo, zero)
        flat = hi == mn
        hi_safe = np.where(flat, F32(1), hi)

        iscale = fnmax / (hi_safe - mn)
        scale = F32(1) / iscale
        levels = nearest_int_clip(iscale * (x - mn), 0, nmax)
        best = error(scale, mn, levels)
        for step in range(nstep + 1):
            c = (F32(rmin) + F32(rdelta) * F32(step)) + fnmax
            iscale = c / (hi_safe - mn)
            np.subtract(x, mn, out=xm)
            np.multiply(xm, iscale, out=lv)
            if guarded:
                # make_qkx3: v > 0 ? nearest_int(MIN(v, nmax)) : 0, so NaN -> 0 and +inf -> nmax
                if np.isfinite(iscale).all():
                    np.clip(lv, zero, fnmax, out=lv)
                else:
                    np.fmin(np.fmax(lv, zero, out=lv), fnmax, out=lv)
                np.rint(lv, out=lv)
            else:
                # v = iscale*(x - mn) is monotone in x: checking both ends bounds every element
                ends_ok = (np.abs(iscale * (lo - mn)) <= limit) & (np.abs(iscale * (hi_safe - mn)) <= limit)
                if ends_ok.all():
                    np.clip(lv, zero, fnmax, out=lv)
                    np.rint(lv, out=lv)
                else:
                    lv[...] = nearest_int_clip(lv, 0, nmax)
            np.multiply(w, lv, out=wl)
            sum_l = seq_sum(wl)
            np.multiply(wl, x, out=tmp)
            sum_xl = seq_sum(tmp)
            np.multiply(wl, lv, out=tmp)
            sum_l2 = seq_sum(tmp)
            det = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            pos = this_min > 0
            if pos.any():
                this_min = np.where(pos, zero, this_min)
                this_scale = np.where(pos, sum_xl / sum_l2, this_scale)
            cur = error(this_scale, this_min, lv)
            better = (det > 0) & (cur < best)
            if better.any():
                np.copyto(levels, lv, where=better)
                best = np.where(better, cur, best)
                scale = np.where(better, this_scale, scale)
                mn = np.where(better, this_min, mn)
    levels[:, flat] = 0
    scale = np.where(flat, zero, scale).astype(F32)
    return scale, (-np.where(flat, mn0, mn)).astype(F32), levels.astype(np.uint8)


def make_qkx2_quants_t(
    x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml ``make_qkx2_quants``: returns (scale (B,), the_min (B,) >= 0, L (n, B) uint8)."""
    x = np.asarray(x, dtype=F32)
    return _make_qkx_t(x, np.asarray(w, dtype=F32), nmax, rmin, rdelta, nstep, use_mad, guarded=False)


def make_qkx3_quants_t(
    x: np.ndarray, w: np.ndarray | None, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml ``make_qkx3_quants`` (``w=None`` means weights x²): (scale, the_min, L (n, B) uint8)."""
    x = np.asarray(x, dtype=F32)
    w = x * x if w is None else np.asarray(w, dtype=F32)
    return _make_qkx_t(x, w, nmax, rmin, rdelta, nstep, use_mad, guarded=True)


def make_qkx2_quants(x, w, nmax, rmin, rdelta, nstep, use_mad):  # noqa: ANN001, ANN201
    """Block-major form of :func:`make_qkx2_quants_t`: x, w (B, n) -> (scale, the_min, L (B, n))."""
    s, m, lv = make_qkx2_quants_t(to_t(x), to_t(w), nmax, rmin, rdelta, nstep, use_mad)
    return s, m, np.ascontiguousarray(lv.T)


def make_qkx3_quants(x, w, nmax, rmin, rdelta, nstep, use_mad):  # noqa: ANN001, ANN201
    """Block-major form of :func:`make_qkx3_quants_t`: x, w (B, n) -> (scale, the_min, L (B, n))."""
    s, m, lv = make_qkx3_quants_t(to_t(x), None if w is None else to_t(w), nmax, rmin, rdelta, nstep, use_mad)
    return s, m, np.ascontiguousarray(lv.T)


# --------------------------------------------------------------------------------------------------
# make_qp_quants (non-negative values, levels 0..nmax, weighted)


def make_qp_quants_t(x: np.ndarray, nmax: int, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml ``make_qp_quants(n, nmax, x, L, quant_weights)``. Returns (scale (B,), L (n, B) uint8).

    L is stored as uint8 like ggml does (a negative level would wrap; it cannot occur for x >= 0).
    """
    x = np.asarray(x, dtype=F32)
    w = np.asarray(w, dtype=F32)
    n = x.shape[0]
    fnmax = F32(nmax)
    with np.errstate(all="ignore"):
        mx = np.maximum(x.max(axis=0), F32(0))
        zero = mx < GROUP_MAX_EPS
        mx = np.where(zero, F32(1), mx)

        def as_u8(levels_i32: np.ndarray) -> np.ndarray:
            return (levels_i32 & 0xFF).astype(F32)

        def mse(scale: np.ndarray, lv: np.ndarray) -> np.ndarray:
            diff = x - scale * lv
            t = w * diff
            t *= diff
            return seq_sum(t)

        iscale = fnmax / mx
        best = mse(F32(1) / iscale, as_u8(nearest_int(iscale * x)))
        for step in range(-4, 5):
            if step == 0:
                continue
            iscale_is = (F32(0.1) * F32(step) + fnmax) / mx
            cur = mse(F32(1) / iscale_is, np.minimum(nearest_int(iscale_is * x), nmax).astype(F32))
            better = cur < best
            best = np.where(better, cur, best)
            iscale = np.where(better, iscale_is, iscale)
        # sums use the int level, L keeps its uint8 image (they differ only for negative x)
        li32 = np.minimum(nearest_int(iscale * x), nmax).astype(F32)
        lv = as_u8(li32.astype(np.int32))
        wx = w * x
        sumlx = seq_sum(wx * li32)
        suml2 = seq_sum(w * li32 * li32)
        for _ in range(5):
            changed = np.zeros(mx.shape, bool)
            for i in range(n):
                li = lv[i]
                slx = sumlx - wx[i] * li
                sl2 = suml2 - w[i] * li * li
                ok = (slx > 0) & (sl2 > 0)
                new_l = np.minimum(nearest_int(x[i] * sl2 / slx), nmax).astype(F32)
                cand = ok & (new_l != li)
                slx2 = slx + wx[i] * new_l
                sl22 = sl2 + w[i] * new_l * new_l
                take = cand & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22)
                if take.any():
                    lv[i] = np.where(take, as_u8(new_l.astype(np.int32)), li)
                    sumlx = np.where(take, slx2, sumlx)
                    suml2 = np.where(take, sl22, suml2)
                    changed |= take
            if not changed.any():
                break
        scale = np.where(suml2 > 0, sumlx / suml2, F32(0)).astype(F32)
    lv[:, zero] = 0
    return np.where(zero, F32(0), scale).astype(F32), lv.astype(np.uint8)


def make_qp_quants(x: np.ndarray, nmax: int, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Block-major form of :func:`make_qp_quants_t`: x, w (B, n) -> (scale (B,), L (B, n) uint8)."""
    scale, levels = make_qp_quants_t(to_t(x), nmax, to_t(w))
    return scale, np.ascontiguousarray(levels.T)


# --------------------------------------------------------------------------------------------------
# input checks and the row-chunk driver


def check_rows(
    name: str, rows: np.ndarray, block_size: int, importance: np.ndarray | None = None, finite: bool = True
) -> tuple[np.ndarray, np.ndarray | None]:
    """Validate encoder input; return (float32 C-contiguous rows, float32 importance or None)."""
    rows = np.asarray(rows)
    if rows.ndim != 2:
        raise ForgeError(f"{name}: expected a 2-D array of rows, got shape {rows.shape}")
    if not np.issubdtype(rows.dtype, np.floating):
        raise ForgeError(f"{name}: expected floating-point rows, got {rows.dtype}")
    rows = np.ascontiguousarray(rows, dtype=F32)
    n_per_row = rows.shape[1]
    if n_per_row % block_size:
        raise ForgeError(f"{name}: row length {n_per_row} is not a multiple of the block size {block_size}")
    if finite and rows.size and not all_finite(rows):
        what = "NaN" if np.isnan(rows).any() else "infinite values"
        raise ForgeError(f"{name}: input contains {what}; cannot quantize non-finite weights")
    if importance is not None:
        importance = np.ascontiguousarray(importance, dtype=F32).reshape(-1)
        if importance.shape != (n_per_row,):
            raise ForgeError(
                f"{name}: importance has {importance.size} values but rows have {n_per_row} columns"
            )
        if not np.isfinite(importance).all():
            raise ForgeError(f"{name}: importance weights contain NaN or infinite values")
    return rows, importance


def check_input(
    name: str, rows: np.ndarray, block_size: int, importance: np.ndarray | None = None, finite: bool = True
) -> tuple[np.ndarray, np.ndarray | None]:
    """``check_rows`` for an encoder's whole input, which may also be bf16 values as their bits (uint16, left
    as they are: their values are checked where they are widened) and may have one importance vector per group
    of consecutive rows (n_groups, n_per_row), a 3-D tensor's matrices. Returns (rows, float32 importance)."""
    bits = rows.dtype == np.uint16
    if bits and rows.ndim != 2:
        raise ForgeError(f"{name}: expected a 2-D array of rows, got shape {rows.shape}")
    checked = np.empty((0, rows.shape[1]), F32) if bits else rows
    if importance is not None and np.ndim(importance) == 2:
        checked, _ = check_rows(name, checked, block_size, finite=finite and not bits)
        if not len(importance) or rows.shape[0] % len(importance):
            raise ForgeError(
                f"{name}: {rows.shape[0]} rows do not split into {len(importance)} importance groups"
            )
        importance = np.stack([check_rows(name, checked[:0], block_size, w)[1] for w in importance])
    else:
        checked, importance = check_rows(name, checked, block_size, importance, finite=finite and not bits)
    return (np.ascontiguousarray(rows) if bits else checked), importance


def _task_rows(rows: np.ndarray, s: int, e: int) -> np.ndarray:
    """Rows s:e as float32; bf16 bits widened here, by the task (the pool's whole-array passes must not run
    inside its own tasks), and checked for NaN and infinity."""
    if rows.dtype != np.uint16:
        return rows[s:e]
    wide = np.left_shift(rows[s:e], 16, dtype=np.uint32).view(F32)
    if not np.isfinite(wide).all():
        raise ForgeError(NON_FINITE)
    return wide


def map_row_chunks(
    rows: np.ndarray,
    row_bytes: int,
    encode_chunk: Callable[[np.ndarray, int], np.ndarray],
    chunk_elems: int = 1 << 16,
    out: np.ndarray | None = None,
    groups: int = 1,
    task_elems: int | None = None,
) -> np.ndarray:
    """Encode ``rows`` (R, n) in chunks of whole rows (bounded memory), on the encoders' thread pool, into
    ``out`` (uint8 (R, row_bytes); a new array if None). ``rows`` may be bf16 bits (uint16), widened a chunk
    at a time.

    ``encode_chunk(rows_chunk, group) -> uint8 (r, row_bytes)``, ``group`` the chunk's group of consecutive
    rows (R/``groups`` rows each, e.g. one expert's matrix; a chunk never crosses groups). Chunks hold the
    larger of ``chunk_elems`` and ``task_elems`` values (default: a quarter of one thread's share, at most
    2**20). Every chunk of every group is queued at once, so no thread waits at a group's end (per-expert
    calls had left a quarter of 16 threads idle).
    """
    n_rows, n_per_row = rows.shape
    if out is None:
        out = np.empty((n_rows, row_bytes), np.uint8)
    if n_rows == 0:
        return out
    threads = encoder_threads()
    if task_elems is None:
        task_elems = min(rows.size // (4 * threads), 1 << 20)
    step = max(1, max(chunk_elems, task_elems) // max(1, n_per_row))
    per_group = n_rows // groups
    ends = [(g * per_group, (g + 1) * per_group) for g in range(groups)]
    chunks = [
        (s, min(s + step, end), g) for g, (first, end) in enumerate(ends) for s in range(first, end, step)
    ]

    def run(chunk: tuple[int, int, int]) -> None:
        s, e, g = chunk
        out[s:e] = encode_chunk(_task_rows(rows, s, e), g)

    if min(threads, len(chunks)) <= 1:
        for c in chunks:
            run(c)
    else:
        pool = thread_pool()
        for f in [pool.submit(run, c) for c in chunks]:
            f.result()
    return out
