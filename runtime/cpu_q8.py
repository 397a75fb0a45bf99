"""Dot products of Q4_K rows with 8-bit activations, as llama.cpp's CPU backend computes them: the input
vector is quantized once to ggml's Q8_K (per 256 values an int8 code each and a float32 scale, plus the codes'
sums per 32), then each row block's products are integer multiply-adds (``vpmaddubsw`` / ``vpmaddwd`` on
AVX2 hosts, a plain loop elsewhere) scaled once per block. The one-token CPU kernels take this path for the
Q4_K weights of a model loaded with ``FORGE_Q8_ACTIVATIONS=1`` (``forge run|eval|serve --q8-activations``): 1.5-1.7x
faster products, logits about 1% of their scale from the float32 path (llama.cpp's own numerics); float32
activations stay the default, and prefill batches keep them.

The prepared input (``prepare``) is one float32 array: the float sums per 32 values that ``dot_row`` takes
anyway, then the Q8_K scales, the code sums per 32, and the codes themselves packed four to a float32 slot.
"""

from __future__ import annotations

import os

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

_FAST = {"fastmath": {"reassoc", "contract"}, "nogil": True, "cache": True, "error_model": "numpy"}
F32 = np.float32


def enabled() -> bool:
    """``FORGE_Q8_ACTIVATIONS`` is set (to anything but empty or 0): matrices built for the CPU kernels now
    multiply their Q4_K rows with 8-bit activations."""
    return os.environ.get("FORGE_Q8_ACTIVATIONS", "") not in ("", "0")


def _host_has_avx2() -> bool:
    try:
        return bool(llvm.get_host_cpu_features().get("avx2"))
    except RuntimeError:
        return False


@njit(inline="always", **_FAST)
def prepared_size(n: int, q8: bool) -> int:
    """Length of the prepared input of an n-value vector: its sums per 32, and with q8 (n a multiple of 256)
    the Q8_K scales, code sums per 32 and codes."""
    return n // 32 + (n // 256 + n // 32 + n // 4 if q8 and n % 256 == 0 else 0)


@njit(inline="always", **_FAST)
def has_q8(xp: np.ndarray, n: int) -> bool:
    return xp.shape[0] > n // 32


@njit(**_FAST)
def quantize_q8_k(x: np.ndarray, xp: np.ndarray) -> None:
    """ggml's quantize_row_q8_K into the q8 part of ``xp`` (after the n / 32 float sums): per block the value
    of largest magnitude (the first one) maps to -127, iscale = -127 / that value, codes round(iscale * x)
    (half to even) at most 127, scale 1 / iscale (0 for an all-zero block)."""
    n = x.shape[0]
    nb = n // 256
    d_at, s_at = n // 32, n // 32 + nb
    codes = xp[s_at + n // 32 :].view(np.int8)
    for blk in range(nb):
        y = 256 * blk
        amax, peak = F32(0), F32(0)
        for j in range(256):
            a = abs(x[y + j])
            if a > amax:
                amax, peak = a, x[y + j]
        if amax == 0:
            xp[d_at + blk] = 0
            for j in range(256):
                codes[y + j] = 0
            for g in range(8):
                xp[s_at + 8 * blk + g] = 0
            continue
        iscale = F32(-127) / peak
        for g in range(8):
            total = 0
            for j in range(32):
                v = min(127, np.int64(np.rint(iscale * x[y + 32 * g + j])))
                codes[y + 32 * g + j] = v
                total += v
            xp[s_at + 8 * blk + g] = total
        xp[d_at + blk] = F32(1) / iscale


@intrinsic
def _block_isum_avx2(typingctx, b, qo, xp, co, s0, s1, s2, s3, s4, s5, s6, s7):  # noqa: ANN001, ANN201
    """sum over a Q4_K block's 8 groups of scale_g * sum(nibble * code): the block's 128 nibble bytes at
    b[qo:], the 256 int8 codes at byte co of the float32 array xp; four 32-byte steps of two ``vpmaddubsw``
    (nibbles x codes -> 16-bit pairs) and two ``vpmaddwd`` (pairs x the group's scale -> 32-bit)."""

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        i8, i16, i32, i64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
        v32, v16, v8 = ir.VectorType(i8, 32), ir.VectorType(i16, 16), ir.VectorType(i32, 8)
        mod = builder.module
        maddubs = mod.declare_intrinsic("llvm.x86.avx2.pmadd.ub.sw", (), ir.FunctionType(v16, [v32, v32]))
        madd = mod.declare_intrinsic("llvm.x86.avx2.pmadd.wd", (), ir.FunctionType(v8, [v16, v16]))
        total = mod.declare_intrinsic("llvm.vector.reduce.add.v8i32", (), ir.FunctionType(i32, [v8]))

        def base(k: int) -> ir.Value:
            data = context.make_array(signature.args[k])(context, builder, args[k]).data
            return builder.gep(builder.bitcast(data, i8.as_pointer()), [args[k + 1]], inbounds=True)

        def load(p: ir.Value, off: int) -> ir.Value:
            at = builder.gep(p, [ir.Constant(i64, off)], inbounds=True)
            return builder.load(builder.bitcast(at, v32.as_pointer()), align=1)

        def splat(v: ir.Value) -> ir.Value:
            one = builder.insert_element(ir.Constant(v16, None), builder.trunc(v, i16), ir.Constant(i32, 0))
            return builder.shuffle_vector(
                one, ir.Constant(v16, None), ir.Constant(ir.VectorType(i32, 16), [0] * 16)
            )

        q, c = base(0), base(2)
        low, four = ir.Constant(v32, [15] * 32), ir.Constant(v32, [4] * 32)
        acc = ir.Constant(v8, [0] * 8)
        for j in range(4):
            nib = load(q, 32 * j)
            lo = builder.call(maddubs, [builder.and_(nib, low), load(c, 64 * j)])
            hi = builder.call(maddubs, [builder.lshr(nib, four), load(c, 64 * j + 32)])
            acc = builder.add(acc, builder.call(madd, [lo, splat(args[4 + 2 * j])]))
            acc = builder.add(acc, builder.call(madd, [hi, splat(args[5 + 2 * j])]))
        return builder.sext(builder.call(total, [acc]), i64)

    scales = (s0, s1, s2, s3, s4, s5, s6, s7)
    if not all(isinstance(s, types.Integer) for s in (qo, co, *scales)):
        return None
    return types.int64(b, qo, xp, co, *scales), codegen


@njit(inline="always", **_FAST)
def _pair_isum(b: np.ndarray, q: int, codes: np.ndarray, c: int) -> tuple[int, int]:
    """The integer sums of 32 nibble bytes at b[q:] times their codes: low nibbles with codes[c:], high
    nibbles with codes[c + 32:]."""
    lo = 0
    hi = 0
    for lane in range(32):
        v = np.int64(b[q + lane])
        lo += (v & 15) * np.int64(codes[c + lane])
        hi += (v >> 4) * np.int64(codes[c + 32 + lane])
    return lo, hi


@njit(inline="always", **_FAST)
def _block_isum_loop(b, qo, xp, co, s0, s1, s2, s3, s4, s5, s6, s7):  # noqa: ANN001, ANN202
    """``_block_isum_avx2`` as plain loops, for hosts without AVX2."""
    codes = xp.view(np.int8)
    l0, h0 = _pair_isum(b, qo, codes, co)
    l1, h1 = _pair_isum(b, qo + 32, codes, co + 64)
    l2, h2 = _pair_isum(b, qo + 64, codes, co + 128)
    l3, h3 = _pair_isum(b, qo + 96, codes, co + 192)
    return s0 * l0 + s1 * h0 + s2 * l1 + s3 * h1 + s4 * l2 + s5 * h2 + s6 * l3 + s7 * h3


_block_isum = _block_isum_avx2 if _host_has_avx2() else _block_isum_loop
