"""The compiled (numba) code's shared leaf: the switch that turns it off, and scalar float32 primitives
bit-exact with ggml's C, used by the quantizer's encoder kernels and the runtime's row kernels alike.

Every kernel is compiled with :data:`JIT`: no fastmath (so LLVM neither reorders nor fuses float32
operations), the GIL released (the row-chunk thread pool runs kernels in parallel) and numpy's error
model (float division by zero gives inf/nan as in C instead of raising). Float constants must be
``np.float32`` values, or numba computes in float64.
"""

from __future__ import annotations

import os

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import config as numba_config
from numba.core import registry
from numba.extending import intrinsic

JIT = {"cache": True, "nogil": True, "error_model": "numpy"}
#: ``JIT`` for dot products: sums may be reassociated (vectorized) and fused; no assumptions about NaN or inf
FAST_JIT = {**JIT, "fastmath": {"reassoc", "contract"}}

#: LLVM tuning for Intel CPUs with AVX-512 (see :func:`_tune_for_intel_avx512`)
INTEL_AVX512_TUNING = "skylake"


def _tune_for_intel_avx512() -> None:
    """Compile with LLVM's skylake tuning (the instructions stay the host's own: numba passes the host's
    feature list with any CPU name) on Intel CPUs with AVX-512 where the user has not named a target. The
    tuning for the host's own name (rocketlake, sapphirerapids, emeraldrapids) made the row kernels
    1.07-1.2x slower per thread on the development machines and up to 2.3x on the H200 host
    (``benchmarks/cpu_threads.py --cpu-names default,native``). Only before numba's CPU target is made: the
    target machine is built once."""
    if "NUMBA_CPU_NAME" in os.environ or "_toplevel_target_context" in vars(registry.cpu_target):
        return
    from llvmlite import binding as llvm

    try:
        name, features = llvm.get_host_cpu_name(), llvm.get_host_cpu_features()
    except RuntimeError:  # LLVM cannot read this host's features: numba's own choice stands
        return
    if features.get("avx512f") and not name.startswith(("znver", "generic")):
        numba_config.CPU_NAME = INTEL_AVX512_TUNING


_tune_for_intel_avx512()


def enabled() -> bool:
    """Compiled kernels are used unless ``FORGE_NO_NUMBA`` is set (to anything but empty or 0); checked at
    every call, so tests can switch paths."""
    return os.environ.get("FORGE_NO_NUMBA", "") in ("", "0")


F32 = np.float32
GROUP_MAX_EPS = F32(1e-15)
_MAGIC = F32(12582912.0)  # 1.5 * 2**23


@intrinsic
def f32_bits(typingctx, x):  # noqa: ANN001, ANN201
    """The bit pattern of a float32 as int32 (C ``memcpy(&i, &f, 4)``)."""
    if not isinstance(x, types.Float) or x.bitwidth != 32:
        return None

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        return builder.bitcast(args[0], ir.IntType(32))

    return types.int32(types.float32), codegen


@intrinsic
def bits_f32(typingctx, x):  # noqa: ANN001, ANN201
    """The float32 whose bit pattern is the int32 ``x``."""
    if not isinstance(x, types.Integer) or x.bitwidth != 32:
        return None

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(x), codegen


def _flat_array(arr, i) -> bool:  # noqa: ANN001
    return (
        isinstance(arr, types.Array) and arr.ndim == 1 and arr.layout == "C" and isinstance(i, types.Integer)
    )


def _element(context, builder, signature, args):  # noqa: ANN001, ANN202
    """LLVM pointer to ``args[0][args[1]]`` (a 1-D contiguous array and an integer index), no checks."""
    ary = context.make_array(signature.args[0])(context, builder, args[0])
    index = context.cast(builder, args[1], signature.args[1], types.intp)
    return builder.gep(ary.data, [index], inbounds=True)


@intrinsic
def at(typingctx, arr, i):  # noqa: ANN001, ANN201
    """``arr[i]`` of a 1-D contiguous array without numba's wraparound of negative indices (``0 <= i < len``
    is the caller's promise): a plain load, so a loop over ``at(arr, base + lane)`` vectorizes into vector
    loads where an index numba cannot prove non-negative becomes a gather. (A slice per block would do the
    same at the cost of two atomic reference-count updates per slice.)"""
    if not _flat_array(arr, i):
        return None

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        return builder.load(_element(context, builder, signature, args))

    return arr.dtype(arr, i), codegen


@intrinsic
def put(typingctx, arr, i, v):  # noqa: ANN001, ANN201
    """``arr[i] = v`` without the wraparound check (see ``at``); v is cast to the array's type."""
    if not _flat_array(arr, i):
        return None

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        value = context.cast(builder, args[2], signature.args[2], signature.args[0].dtype)
        builder.store(value, _element(context, builder, signature, args))
        return context.get_dummy_value()

    return types.none(arr, i, v), codegen


@intrinsic
def prefetch(typingctx, arr, i):  # noqa: ANN001, ANN201
    """Ask the CPU to bring the cache line of ``arr[i]`` (a 1-D contiguous array) into the caches, for reading."""
    if not _flat_array(arr, i):
        return None

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        ptr = builder.bitcast(_element(context, builder, signature, args), ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32])
        fn = builder.module.declare_intrinsic("llvm.prefetch", (), fnty)
        builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.none(arr, i), codegen


@intrinsic
def u8_field(typingctx, v, shift, mask):  # noqa: ANN001, ANN201
    """float32((v >> shift) & mask) of a byte ``v`` (uint8), computed on 8-bit integers.

    numba widens integer arithmetic to 64 bits, which makes LLVM vectorize a loop over bytes 8 lanes at a
    time with 64-bit conversions; this keeps the bit field in 8 bits (16 or 32 lanes a vector)."""
    if v != types.uint8 or not isinstance(shift, types.Integer) or not isinstance(mask, types.Integer):
        return None

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        byte = ir.IntType(8)
        field = builder.and_(
            builder.lshr(args[0], builder.trunc(args[1], byte)), builder.trunc(args[2], byte)
        )
        return builder.uitofp(field, ir.FloatType())

    return types.float32(v, shift, mask), codegen


@intrinsic
def i8_f32(typingctx, v):  # noqa: ANN001, ANN201
    """float32 of a byte (uint8) read as int8, converted on 8 bits (see ``u8_field``)."""
    if v != types.uint8:
        return None

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        return builder.sitofp(args[0], ir.FloatType())

    return types.float32(v), codegen


@njit(inline="always", **JIT)
def nearest_int(f: float) -> int:
    """ggml ``nearest_int``: round half to even through the 1.5*2**23 trick (wraps like ggml beyond 2**22)."""
    v = F32(f) + _MAGIC
    return (f32_bits(v) & 0x007FFFFF) - 0x00400000


@njit(inline="always", **JIT)
def fp16_bits(f: float) -> int:
    """float32 -> IEEE half bits, round to nearest even, overflow to inf (numpy's ``astype(float16)``)."""
    x = np.int64(f32_bits(F32(f))) & 0xFFFFFFFF
    sign = (x >> 16) & 0x8000
    a = x & 0x7FFFFFFF
    if a >= 0x7F800000:  # inf / nan
        if a == 0x7F800000:
            return sign | 0x7C00
        return sign | 0x7C00 | 0x200 | ((a >> 13) & 0x3FF)
    if a >= 0x477FF000:  # >= 65520: rounds to inf
        return sign | 0x7C00
    e = a >> 23
    if e < 113:  # below 2**-14: a half subnormal (or zero)
        if e < 102:  # below 2**-25: rounds to zero
            return sign
        m = (a & 0x7FFFFF) | 0x800000
        shift = 126 - e
        k = m >> shift
        rem = m & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        if rem > half or (rem == half and (k & 1)):
            k += 1
        return sign | k
    h = ((e - 112) << 10) | ((a >> 13) & 0x3FF)
    rem = a & 0x1FFF
    if rem > 0x1000 or (rem == 0x1000 and (h & 1)):
        h += 1
    return sign | h


@njit(inline="always", **JIT)
def u16_at(b: np.ndarray, i: int) -> int:
    """The little-endian uint16 at bytes b[i], b[i + 1] (e.g. a block's fp16 scale, for ``fp16_to_f32``)."""
    return np.int64(b[i]) | (np.int64(b[i + 1]) << 8)


@njit(inline="always", **JIT)
def fp16_to_f32(h: int) -> float:
    """IEEE half bits -> float32 (exact). Without branches: in a dot product over a row's blocks, a branch on
    subnormal scales (common in quiet weights) is mispredicted; both forms are computed and one selected."""
    sign = (h & 0x8000) << 16
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    sub = F32(m) * (F32(-5.960464477539063e-08) if sign else F32(5.960464477539063e-08))  # m * 2**-24, exact
    bits = sign | ((e + (255 - 31 if e == 31 else 112)) << 23) | (m << 13)
    normal = bits_f32(np.int32(np.int64(bits) - (np.int64(1) << 32) if bits >= 0x80000000 else bits))
    return sub if e == 0 else normal


@njit(inline="always", **JIT)
def fp16_round(f: float) -> float:
    """GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(f))."""
    return fp16_to_f32(fp16_bits(f))


@njit(inline="always", **JIT)
def put_fp16(out: np.ndarray, pos: int, f: float) -> None:
    """Store fp16(f) little-endian at out[pos], out[pos+1]."""
    h = fp16_bits(f)
    out[pos] = h & 0xFF
    out[pos + 1] = (h >> 8) & 0xFF
