"""Dot products of K-quant rows (Q4_K, Q5_K, Q6_K) with 8-bit activations, as llama.cpp's CPU backend computes
them: the input vector is quantized once to ggml's Q8_K (per 256 values an int8 code each and a float32 scale,
plus the codes' sums per 32), then each row block is integer multiply-adds (``vpmaddubsw`` / ``vpmaddwd`` on
AVX2 hosts, plain loops elsewhere) scaled once. The one-token CPU kernels take this path for the K-quant weights
of a model loaded with ``FORGE_Q8_ACTIVATIONS=1`` (``forge run|serve --q8-activations``): faster products, each
about 1% from the float32 one (llama.cpp's own numerics; the tiny Q4_K_M fixture's logits move by up to 6% of
their scale over 32 decode steps); float32 activations stay the default, and prefill batches (and so ``forge
eval``) keep them.

The prepared input (``runtime.cpu_rows.prepare_input``) is one float32 array: the float sums per 32 values that
``dot_row`` takes anyway, then the Q8_K scales (float32), the code sums per 32 (int16, two to a slot) and the
codes (int8, four to a slot)."""

from __future__ import annotations

import os

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from forge.jit import FAST_JIT as _FAST
from forge.jit import JIT, fp16_to_f32, u16_at
from runtime.cpu_ir import IRHelpers, host_has

F32 = np.float32


def enabled() -> bool:
    """``FORGE_Q8_ACTIVATIONS`` is set (to anything but empty or 0): matrices built for the CPU kernels now
    multiply their Q4_K, Q5_K and Q6_K rows with 8-bit activations."""
    return os.environ.get("FORGE_Q8_ACTIVATIONS", "") not in ("", "0")


@njit(inline="always", **_FAST)
def prepared_size(n: int) -> int:
    """Length (float32 values) of the Q8_K part of an n-value vector's prepared input (n a multiple of 256):
    the scales, code sums per 32 and codes."""
    return n // 256 + n // 64 + n // 4


@njit(inline="always", **_FAST)
def has_q8(xp: np.ndarray, n: int) -> bool:
    return n % 256 == 0 and xp.shape[0] == n // 32 + prepared_size(n)


@njit(inline="always", **_FAST)
def layout(n: int) -> tuple[int, int, int]:
    """Where the q8 parts of an n-value vector's prepared input start: the scales (a float32 index), the code
    sums and the codes (byte offsets)."""
    return n // 32, 4 * (n // 32 + n // 256), 4 * (n // 32 + n // 256 + n // 64)


@njit(**JIT)  # no fastmath: the scale is ggml's 1 / (-127 / max), which LLVM would fold into max / -127
def quantize_q8_k(x: np.ndarray, xp: np.ndarray) -> None:
    """ggml's quantize_row_q8_K into the q8 part of ``xp``: per block the value of largest magnitude (the first
    one) maps to -127, iscale = -127 / that value, codes round(iscale * x) (half to even) at most 127, scale
    1 / iscale (0 for an all-zero block); and the codes' sums per 32."""
    n = x.shape[0]
    d_at, s_at, c_at = layout(n)
    sums, codes = xp.view(np.int16)[s_at // 2 : c_at // 2], xp.view(np.int8)[c_at:]
    for blk in range(n // 256):
        y = 256 * blk
        amax, peak = F32(0), F32(0)
        for j in range(256):
            a = abs(x[y + j])
            if a > amax:
                amax, peak = a, x[y + j]
        iscale = F32(-127) / peak if amax != 0 else F32(0)
        for g in range(8):
            total = 0
            for j in range(32):
                v = min(127, np.int64(np.rint(iscale * x[y + 32 * g + j])))
                codes[y + 32 * g + j] = v
                total += v
            sums[8 * blk + g] = total
        xp[d_at + blk] = F32(1) / iscale if amax != 0 else F32(0)


I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
V32, V16, V8 = ir.VectorType(I8, 32), ir.VectorType(I16, 16), ir.VectorType(I32, 8)


class _Avx2(IRHelpers):
    """``IRHelpers`` and the AVX2 multiply-adds and a vector's sum."""

    def __init__(self, context, builder, signature, args) -> None:  # noqa: ANN001
        super().__init__(context, builder, signature, args)
        mod = builder.module
        self._maddubs = mod.declare_intrinsic(
            "llvm.x86.avx2.pmadd.ub.sw", (), ir.FunctionType(V16, [V32, V32])
        )
        self._madd = mod.declare_intrinsic("llvm.x86.avx2.pmadd.wd", (), ir.FunctionType(V8, [V16, V16]))
        self._total = mod.declare_intrinsic("llvm.vector.reduce.add.v8i32", (), ir.FunctionType(I32, [V8]))

    def maddubs(self, unsigned: ir.Value, signed: ir.Value) -> ir.Value:
        """32 unsigned x 32 signed bytes -> 16 sums of adjacent products (16-bit)."""
        return self.b.call(self._maddubs, [unsigned, signed])

    def madd(self, a: ir.Value, b: ir.Value) -> ir.Value:
        """16 x 16 16-bit values -> 8 sums of adjacent products (32-bit)."""
        return self.b.call(self._madd, [a, b])

    def total(self, v: ir.Value) -> ir.Value:
        return self.b.call(self._total, [v])


def _k_block_avx2(five_bits: bool):  # noqa: ANN202
    """The intrinsic for a Q4_K block (Q5_K with ``five_bits``: a fifth bit per value from its 32 high-bit bytes)
    at byte o of b times its 256 Q8_K codes (byte co of xp; their sums per 32 at byte so), as integers: (sum
    over groups of scale * sum(q * code), sum over groups of min * code sum), the first with four steps of 32
    bytes of two ``vpmaddubsw`` (quants x codes -> 16-bit pairs) and two ``vpmaddwd`` (pairs x the group's
    scale -> 32-bit), the six-bit scales and mins unpacked as ggml's AVX2 code does."""
    qs_at = 48 if five_bits else 16

    def block(typingctx, b, o, xp, so, co):  # noqa: ANN001, ANN202
        if not all(isinstance(t, types.Integer) for t in (o, so, co)):
            return None

        def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
            x = _Avx2(context, builder, signature, args)

            blk = x.at(0, args[1])
            sc8, mn8 = x.k4_scales_mins(blk)
            scales = builder.zext(sc8, ir.VectorType(I16, 8))
            mins = builder.zext(mn8, V8)
            sums = builder.sext(x.load(x.at(2, args[3]), 0, ir.VectorType(I16, 8)), V8)
            msum = x.total(builder.mul(mins, sums))

            codes = x.at(2, args[4])
            low, four = x.splat(V32, 15), x.splat(V32, 4)
            high = x.load(blk, 16, V32) if five_bits else None
            acc = x.splat(V8, 0)
            for j in range(4):
                nib = x.load(blk, qs_at + 32 * j, V32)
                for half, part in enumerate((builder.and_(nib, low), builder.lshr(nib, four))):
                    if high is not None:  # bit 2j + half of each high-bit byte, as 16
                        bit = builder.and_(builder.lshr(high, x.splat(V32, 2 * j + half)), x.splat(V32, 1))
                        part = builder.or_(part, builder.shl(bit, four))
                    pairs = x.maddubs(part, x.load(codes, 64 * j + 32 * half, V32))
                    splat = builder.shuffle_vector(
                        scales, scales, x.splat(ir.VectorType(I32, 16), 2 * j + half)
                    )
                    acc = builder.add(acc, x.madd(pairs, splat))
            sums = [builder.sext(x.total(acc), I64), builder.sext(msum, I64)]
            return context.make_tuple(builder, signature.return_type, sums)

        return types.UniTuple(types.int64, 2)(b, o, xp, so, co), codegen

    block.__name__ = block.__qualname__ = f"q{5 if five_bits else 4}_k_block_avx2"
    return intrinsic(block)


_block4_avx2, _block5_avx2 = _k_block_avx2(False), _k_block_avx2(True)


@intrinsic
def _block6_avx2(typingctx, b, o, xp, co):  # noqa: ANN001, ANN202
    """A Q6_K block (at byte o of b) times its 256 Q8_K codes (byte co of xp) as an integer: sum over the 16
    groups of 16 values of scale * sum((q - 32) * code), as ggml's AVX2 code: ``vpmaddubsw`` of the unsigned
    6-bit q with the codes less 32 times the codes' pair sums, then ``vpmaddwd`` with the groups' scales."""
    if not all(isinstance(t, types.Integer) for t in (o, co)):
        return None

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        x = _Avx2(context, builder, signature, args)

        def bits(v: int) -> ir.Value:
            return x.splat(V32, v)

        blk, codes = x.at(0, args[1]), x.at(2, args[3])
        scales = builder.sext(x.load(blk, 192, ir.VectorType(I8, 16)), V16)
        acc = x.splat(V8, 0)
        for half in range(2):
            ql0, ql1 = x.load(blk, 64 * half, V32), x.load(blk, 64 * half + 32, V32)
            qh = x.load(blk, 128 + 32 * half, V32)
            high = (
                builder.shl(builder.and_(qh, bits(0x03)), bits(4)),
                builder.shl(builder.and_(qh, bits(0x0C)), bits(2)),
                builder.and_(qh, bits(0x30)),
                builder.lshr(builder.and_(qh, bits(0xC0)), bits(2)),
            )
            low = (
                builder.and_(ql0, bits(15)),
                builder.and_(ql1, bits(15)),
                builder.lshr(ql0, bits(4)),
                builder.lshr(ql1, bits(4)),
            )
            for k in range(4):
                c = x.load(codes, 128 * half + 32 * k, V32)
                pairs = builder.sub(x.maddubs(builder.or_(low[k], high[k]), c), x.maddubs(bits(32), c))
                g = 8 * half + 2 * k
                mask = ir.Constant(ir.VectorType(I32, 16), [g] * 8 + [g + 1] * 8)
                acc = builder.add(acc, x.madd(pairs, builder.shuffle_vector(scales, scales, mask)))
        return builder.sext(x.total(acc), I64)

    return types.int64(b, o, xp, co), codegen


@njit(inline="always", **_FAST)
def _block6_loop(b: np.ndarray, o: int, xp: np.ndarray, co: int) -> int:
    """``_block6_avx2`` as plain loops."""
    codes = xp.view(np.int8)
    total = 0
    for half in range(2):
        for k in range(4):
            g = 8 * half + 2 * k
            for sub in range(2):
                s = 0
                for lane in range(16 * sub, 16 * sub + 16):
                    low = np.int64(b[o + 64 * half + 32 * (k % 2) + lane])
                    low = (low >> 4) if k >= 2 else (low & 15)
                    high = (np.int64(b[o + 128 + 32 * half + lane]) >> (2 * k)) & 3
                    s += ((low | (high << 4)) - 32) * np.int64(codes[co + 128 * half + 32 * k + lane])
                total += np.int64(np.int8(b[o + 192 + g + sub])) * s
    return total


@njit(inline="always", **JIT)
def scale_min_k4(j: int, s: np.ndarray, base: int) -> tuple[int, int]:
    """ggml's get_scale_min_k4: group j's six-bit scale and min from a K-quant block's 12 scale bytes at
    s[base:] (also ``runtime.cpu_rows``' decoder's)."""
    if j < 4:
        return np.int64(s[base + j]) & 63, np.int64(s[base + j + 4]) & 63
    sc = (np.int64(s[base + j + 4]) & 0xF) | ((np.int64(s[base + j - 4]) >> 6) << 4)
    m = (np.int64(s[base + j + 4]) >> 4) | ((np.int64(s[base + j]) >> 6) << 4)
    return sc, m


@njit(inline="always", **_FAST)
def _block_loop(b: np.ndarray, o: int, xp: np.ndarray, so: int, co: int, qh_at: int) -> tuple[int, int]:
    """``_k_block_avx2``'s intrinsics as plain loops, for hosts without AVX2: Q4_K (qh_at < 0) or Q5_K (its high
    bits at byte qh_at of the block)."""
    codes, sums = xp.view(np.int8), xp.view(np.int16)
    qs_at = 16 if qh_at < 0 else 48
    isum = 0
    msum = 0
    for g in range(8):
        sc, m = scale_min_k4(g, b, o + 4)
        q, shift = o + qs_at + 32 * (g // 2), 4 * (g % 2)
        s = 0
        for lane in range(32):
            v = (np.int64(b[q + lane]) >> shift) & 15
            if qh_at >= 0:
                v |= ((np.int64(b[o + qh_at + lane]) >> g) & 1) << 4
            s += v * np.int64(codes[co + 32 * g + lane])
        isum += sc * s
        msum += m * np.int64(sums[so // 2 + g])
    return isum, msum


@njit(inline="always", **_FAST)
def _block4_loop(b: np.ndarray, o: int, xp: np.ndarray, so: int, co: int) -> tuple[int, int]:
    return _block_loop(b, o, xp, so, co, -1)


@njit(inline="always", **_FAST)
def _block5_loop(b: np.ndarray, o: int, xp: np.ndarray, so: int, co: int) -> tuple[int, int]:
    return _block_loop(b, o, xp, so, co, 16)


_AVX2 = host_has("avx2")
_block4, _block5, _block6 = (
    (_block4_avx2, _block5_avx2, _block6_avx2) if _AVX2 else (_block4_loop, _block5_loop, _block6_loop)
)


@njit(inline="always", **_FAST)
def dot_k(b: np.ndarray, xp: np.ndarray, n: int, five_bits: bool) -> float:
    """A Q4_K row (Q5_K with ``five_bits``) times the Q8_K input prepared in ``xp``: llama.cpp's
    vec_dot_q4_K_q8_K / vec_dot_q5_K_q8_K."""
    d_at, s_at, c_at = layout(n)
    size = 176 if five_bits else 144
    acc = F32(0)
    for blk in range(n // 256):
        o = size * blk
        if five_bits:
            isum, msum = _block5(b, o, xp, s_at + 16 * blk, c_at + 256 * blk)
        else:
            isum, msum = _block4(b, o, xp, s_at + 16 * blk, c_at + 256 * blk)
        d = fp16_to_f32(u16_at(b, o))
        dmin = fp16_to_f32(u16_at(b, o + 2))
        acc += xp[d_at + blk] * (d * F32(isum) - dmin * F32(msum))
    return acc


@njit(inline="always", **_FAST)
def dot_q6_k(b: np.ndarray, xp: np.ndarray, n: int) -> float:
    """A Q6_K row times the Q8_K input prepared in ``xp``: llama.cpp's vec_dot_q6_K_q8_K."""
    d_at, _, c_at = layout(n)
    acc = F32(0)
    for blk in range(n // 256):
        o = 210 * blk
        d = fp16_to_f32(u16_at(b, o + 208))
        acc += xp[d_at + blk] * d * F32(_block6(b, o, xp, c_at + 256 * blk))
    return acc
