"""Dot products of K-quant rows (Q4_K, Q5_K, Q6_K) with the input as 22-bit integers (and a sign), on AVX-512
VNNI: the CPU kernels' default path for these rows where the host has the instructions.

The input is quantized once per vector: per 256 values a float32 scale s (the block's largest magnitude over
2^22 - 1) and integers X = round(x / s) (|X| < 2^22) written as three signed bytes (X = 2^16 x1 + 2^8 x2 + x3,
x2 and x3 in -128..127); the row's codes times the digits are ``vpdpbusd`` (64 unsigned bytes times 64 signed,
four adjacent products summed into each of 16 int32 lanes), chained as ((c.x1) 2^8 + c.x2) 2^8 + c.x3 (each
2^8 a byte shuffle), so each lane holds the exact integer sum of its four codes times X (below 2^31 for 6-bit
codes). The lanes are then scaled in float32 by their group's scale. The input's rounding moves a product by
at most 2^-23 of the block's largest input value times the row's weights (about 1e-6 of a product's scale on
random rows with float32 sums), far inside the runtime's 1e-4 acceptance, against ~1% for llama.cpp's 8-bit
activations (``runtime.cpu_q8``); the minimums' term of Q4_K / Q5_K uses the input's exact float sums.

The prepared input (``runtime.cpu_rows.prepare_input``) is one float32 array: the float sums per 32 values,
the block scales, then per 64-value chunk 256 bytes: the three digit vectors (64 bytes each, values in their
natural order) and the sums of each four X (16 int32: Q6_K's codes carry a bias of 32, taken off as 32 times
these sums).
"""

from __future__ import annotations

import os

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from forge.jit import FAST_JIT as _FAST
from forge.jit import fp16_to_f32, u16_at
from runtime import cpu_q8
from runtime.cpu_ir import IRHelpers, host_has

F32 = np.float32
_X_MAX = 2**22 - 1

I8, I32, I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
F = ir.FloatType()
B64, B32 = ir.VectorType(I8, 64), ir.VectorType(I8, 32)
I16x32, F16x, F8x = ir.VectorType(I32, 16), ir.VectorType(F, 16), ir.VectorType(F, 8)
_FLAGS = ("reassoc", "contract")


def enabled() -> bool:
    """The host has AVX-512 VNNI and ``FORGE_NO_VNNI`` is not set (to anything but empty or 0): K-quant rows
    on the CPU take their input as 22-bit integers. Read when a vector is prepared."""
    return _VNNI and os.environ.get("FORGE_NO_VNNI", "") in ("", "0")


_VNNI = host_has("avx512vnni", "avx512bw")
if _VNNI:
    llvm.initialize_native_asmparser()  # the byte shuffle below is inline assembly


@njit(inline="always", **_FAST)
def prepared_size(n: int) -> int:
    """Length (float32 values) of the 22-bit part of an n-value vector's prepared input."""
    return n // 256 + n


@njit(inline="always", **_FAST)
def has_x22(xp: np.ndarray, n: int) -> bool:
    return n % 256 == 0 and xp.shape[0] == n // 32 + prepared_size(n)


@njit(**_FAST)
def quantize_x22(x: np.ndarray, xp: np.ndarray, at: int) -> None:
    """The 22-bit form of x (n a multiple of 256) into xp[at:]: n / 256 block scales, then per 64-value chunk
    its three digit vectors and sums of four (see the module's doc)."""
    n = x.shape[0]
    nb = n // 256
    chunks = xp[at + nb : at + nb + n].view(np.int8)
    sums = xp[at + nb : at + nb + n].view(np.int32)
    for blk in range(nb):
        y = 256 * blk
        amax = F32(0)
        for j in range(256):
            amax = max(amax, abs(x[y + j]))
        s = amax / F32(_X_MAX)
        xp[at + blk] = s
        inv = 1 / np.float64(s) if amax > 0 else 0.0  # float64: x / s rounds once, to the nearest integer
        for c in range(4):
            base = 256 * (4 * blk + c)
            for lane in range(16):
                total = 0
                for k in range(4):
                    v = 4 * lane + k
                    q = min(_X_MAX, max(-_X_MAX, np.int64(np.rint(np.float64(x[y + 64 * c + v]) * inv))))
                    low = ((q + 128) & 255) - 128
                    mid = (((q - low) >> 8) + 128 & 255) - 128
                    chunks[base + v] = (q - low - 256 * mid) >> 16
                    chunks[base + 64 + v] = mid
                    chunks[base + 128 + v] = low
                    total += q
                sums[base // 4 + 48 + lane] = total


class _Gen(IRHelpers):
    """``IRHelpers`` and the VNNI multiply-adds, byte shuffles and float reductions."""

    def __init__(self, context, builder, signature, args) -> None:  # noqa: ANN001
        super().__init__(context, builder, signature, args)
        mod = builder.module
        self._dp = mod.declare_intrinsic(
            "llvm.x86.avx512.vpdpbusd.512", (), ir.FunctionType(I16x32, [I16x32] * 3)
        )
        # inline assembly: LLVM would turn a byte shuffle that is a shift back into the shift
        self._shuffle = ir.InlineAsm(ir.FunctionType(B64, [B64, B64]), "vpshufb $2, $1, $0", "=v,v,v")
        self._times_256 = ir.Constant(
            B64, [0x80, 0, 1, 2, 0x80, 4, 5, 6, 0x80, 8, 9, 10, 0x80, 12, 13, 14] * 4
        )
        self._sum16 = mod.declare_intrinsic(
            "llvm.vector.reduce.fadd.v16f32", (), ir.FunctionType(F, [F, F16x])
        )
        self._sum8 = mod.declare_intrinsic("llvm.vector.reduce.fadd.v8f32", (), ir.FunctionType(F, [F, F8x]))

    def broadcast(self, ty: ir.VectorType, v: ir.Value) -> ir.Value:
        one = self.b.insert_element(ir.Constant(ty, None), v, ir.Constant(I32, 0))
        return self.b.shuffle_vector(one, one, ir.Constant(ir.VectorType(I32, ty.count), [0] * ty.count))

    def idx(self, v: int) -> ir.Constant:
        return ir.Constant(I64, v)

    def dp3(self, codes: ir.Value, digits: ir.Value) -> ir.Value:
        """The exact int32 lane sums of codes (64 unsigned bytes) times the X whose digits start at byte pointer
        ``digits``: ((c.x1) 2^8 + c.x2) 2^8 + c.x3, each 2^8 a byte shuffle (``vpshufb``, off the port that
        the multiply-adds, conversions and shifts share)."""
        b = self.b
        c = b.bitcast(codes, I16x32)
        a = self.splat(I16x32, 0)
        for d in range(3):
            if d:
                a = b.bitcast(b.call(self._shuffle, [b.bitcast(a, B64), self._times_256]), I16x32)
            a = b.call(self._dp, [a, c, self.load(digits, 64 * d, I16x32)])
        return a

    def fp16(self, p: ir.Value, off: int | ir.Value) -> ir.Value:
        return self.b.fpext(self.load(p, off, ir.HalfType()), F)

    def fma(self, acc: ir.Value, a: ir.Value, s: ir.Value) -> ir.Value:
        return self.b.fadd(acc, self.b.fmul(a, s, flags=_FLAGS), flags=_FLAGS)

    def spread(self, v: ir.Value, lanes: list[int]) -> ir.Value:
        """16 lanes of v, by index."""
        return self.b.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, 16), lanes))

    def concat(self, lo: ir.Value, hi: ir.Value) -> ir.Value:
        """Two 32-byte vectors as one of 64 bytes."""
        return self.b.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(I32, 64), list(range(64))))


def _row(g: _Gen, args: list, qtype: int) -> ir.Value:
    """The float32 dot of a Q4_K (12) / Q5_K (13) / Q6_K (14) row with the prepared input: one loop over the
    row's blocks, the accumulators in vector registers."""
    builder = g.b
    xpp = g.at(2)
    at_bytes = builder.mul(args[3], g.idx(4))
    nb = builder.lshr(args[4], g.idx(8))
    digits0 = builder.add(at_bytes, builder.mul(nb, g.idx(4)))
    acc = cgutils.alloca_once_value(builder, g.splat(F16x, 0.0))
    mins = cgutils.alloca_once_value(builder, g.splat(F8x, 0.0))
    with cgutils.for_range(builder, nb) as loop:
        i = loop.index
        sx = g.load(xpp, builder.add(at_bytes, builder.mul(i, g.idx(4))), F)
        chunk0 = builder.add(digits0, builder.mul(i, g.idx(1024)))
        if qtype == 14:
            _q6_k_block(g, g.at(0, builder.mul(i, g.idx(210))), xpp, sx, chunk0, acc)
        else:
            blk = g.at(0, builder.mul(i, g.idx(176 if qtype == 13 else 144)))
            _k4_block(g, blk, xpp, i, sx, chunk0, acc, mins, qtype == 13)
    # reassociated: an ordered reduction is 24 dependent additions (~13 ns a row)
    total = builder.call(g._sum16, [ir.Constant(F, 0.0), builder.load(acc)], fastmath=_FLAGS)
    return builder.fsub(
        total, builder.call(g._sum8, [ir.Constant(F, 0.0), builder.load(mins)], fastmath=_FLAGS)
    )


@intrinsic
def _dot_k_vnni(typingctx, b, qtype, xp, at, n):  # noqa: ANN001, ANN202
    """dot_k(b, qtype, xp, at, n) -> float32 of a Q4_K / Q5_K / Q6_K row (uint8 array b, n values) with the
    22-bit input prepared in xp (its part from float index ``at``). The three types' loops sit in one
    intrinsic: a caller with one intrinsic call per type ran 512-value rows at a third of the speed."""
    if not all(isinstance(t, types.Integer) for t in (qtype, at, n)):
        return None

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        g = _Gen(context, builder, signature, args)
        out = cgutils.alloca_once(builder, F)
        is_q6 = builder.icmp_signed("==", args[1], ir.Constant(args[1].type, 14))
        is_q5 = builder.icmp_signed("==", args[1], ir.Constant(args[1].type, 13))
        with builder.if_else(is_q6) as (q6, other):
            with q6:
                builder.store(_row(g, args, 14), out)
            with other, builder.if_else(is_q5) as (q5, q4):
                with q5:
                    builder.store(_row(g, args, 13), out)
                with q4:
                    builder.store(_row(g, args, 12), out)
        return builder.load(out)

    return types.float32(b, qtype, xp, at, n), codegen


def _k4_block(g: _Gen, blk, xpp, i, sx, chunk0, acc, mins, five_bits: bool) -> None:  # noqa: ANN001
    """One Q4_K / Q5_K block (i of the row) at byte pointer blk: the scaled code products into acc (16 lanes), dmin m times the
    input's float group sums into mins (8 lanes, one a group)."""
    b = g.b
    sc8, mn8 = g.k4_scales_mins(blk)
    d, dmin = g.fp16(blk, 0), g.fp16(blk, 2)
    scales = b.fmul(b.uitofp(sc8, F8x), g.broadcast(F8x, b.fmul(d, sx)))
    group_sums = g.load(xpp, b.mul(i, g.idx(32)), F8x)
    dm = g.broadcast(F8x, dmin)
    b.store(g.fma(b.load(mins), b.fmul(b.uitofp(mn8, F8x), dm), group_sums), mins)
    qs_at = 48 if five_bits else 16
    high = None
    if five_bits:
        qh = g.load(blk, 16, B32)
        high = g.concat(qh, qh)
    a_acc = b.load(acc)
    for c in range(4):
        q = g.load(blk, qs_at + 32 * c, B32)
        codes = b.and_(g.concat(q, b.lshr(q, g.splat(B32, 4))), g.splat(B64, 15))
        if high is not None:
            bits = ir.Constant(B64, [1 << (2 * c)] * 32 + [1 << (2 * c + 1)] * 32)
            on = b.icmp_unsigned("!=", b.and_(high, bits), g.splat(B64, 0))
            codes = b.or_(codes, b.select(on, g.splat(B64, 16), g.splat(B64, 0)))
        lanes = g.dp3(codes, b.gep(xpp, [b.add(chunk0, g.idx(256 * c))], inbounds=True))
        a_acc = g.fma(a_acc, b.sitofp(lanes, F16x), g.spread(scales, [2 * c] * 8 + [2 * c + 1] * 8))
    b.store(a_acc, acc)


def _q6_k_block(g: _Gen, blk, xpp, sx, chunk0, acc) -> None:  # noqa: ANN001
    """One Q6_K block at byte pointer blk: (q - 32) times X per lane, scaled by its 16-value group's int8 scale."""
    b = g.b
    d = g.fp16(blk, 208)
    sc = b.sitofp(g.load(blk, 192, ir.VectorType(I8, 16)), F16x)
    scales = b.fmul(sc, g.broadcast(F16x, b.fmul(d, sx)))
    a_acc = b.load(acc)
    for half in range(2):
        ql = g.load(blk, 64 * half, B64)
        qh = g.load(blk, 128 + 32 * half, B32)
        qh = g.concat(qh, b.lshr(qh, g.splat(B32, 2)))
        three, four = g.splat(B64, 3), g.splat(B64, 4)
        low = b.or_(b.and_(ql, g.splat(B64, 15)), b.shl(b.and_(qh, three), four))
        top = b.or_(b.lshr(ql, four), b.shl(b.and_(b.lshr(qh, four), three), four))
        for k, codes in enumerate((low, top)):
            c = 2 * half + k
            chunk = b.gep(xpp, [b.add(chunk0, g.idx(256 * c))], inbounds=True)
            lanes = g.dp3(codes, chunk)
            bias = b.shl(g.load(chunk, 192, I16x32), g.splat(I16x32, 5))
            lanes = b.sub(lanes, bias)
            a_acc = g.fma(a_acc, b.sitofp(lanes, F16x), g.spread(scales, [4 * c + i // 4 for i in range(16)]))
    b.store(a_acc, acc)


@njit(inline="always", **_FAST)
def _x(xp: np.ndarray, at: int, nb: int, blk: int, v: int) -> int:
    """X of value v of block blk, from its three digits."""
    c = xp[at + nb :].view(np.int8)
    base = 256 * (4 * blk + v // 64) + v % 64
    return 65536 * np.int64(c[base]) + 256 * np.int64(c[base + 64]) + np.int64(c[base + 128])


@njit(**_FAST)
def dot_loop(b: np.ndarray, qtype: int, xp: np.ndarray, at: int, n: int) -> float:
    """``dot_k`` as plain loops, for hosts without VNNI (which never prepare the 22-bit form: ``enabled``) and
    as the tests' second implementation."""
    nb = n // 256
    acc = 0.0
    for blk in range(nb):
        sx = np.float64(xp[at + blk])
        if qtype == 14:
            o = 210 * blk
            d = fp16_to_f32(u16_at(b, o + 208))
            for v in range(256):
                half, p, lane = v // 128, (v % 128) // 32, v % 32
                low = (np.int64(b[o + 64 * half + 32 * (p % 2) + lane]) >> (4 * (p // 2))) & 15
                q = low | (((np.int64(b[o + 128 + 32 * half + lane]) >> (2 * p)) & 3) << 4)
                acc += d * sx * np.int8(b[o + 192 + v // 16]) * ((q - 32) * _x(xp, at, nb, blk, v))
            continue
        size, qs_at = (176, 48) if qtype == 13 else (144, 16)
        o = size * blk
        d, dmin = fp16_to_f32(u16_at(b, o)), fp16_to_f32(u16_at(b, o + 2))
        for g in range(8):
            sc, m = cpu_q8.scale_min_k4(g, b, o + 4)
            total = 0
            for lane in range(32):
                q = (np.int64(b[o + qs_at + 32 * (g // 2) + lane]) >> (4 * (g % 2))) & 15
                if qtype == 13:
                    q |= ((np.int64(b[o + 16 + lane]) >> g) & 1) << 4
                total += q * _x(xp, at, nb, blk, 32 * g + lane)
            acc += d * sx * sc * total - dmin * m * np.float64(xp[8 * blk + g])
    return F32(acc)


if _VNNI:
    dot_k = _dot_k_vnni
else:
    dot_k = dot_loop
