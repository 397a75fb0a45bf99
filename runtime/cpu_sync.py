"""What the threads of one long parallel region (``runtime.cpu_step``) coordinate with, inside numba: atomic
loads, stores and adds on int32 / int64 array elements (acquire / release ordering, so the data written
before a flag is seen by the thread that reads the flag), a monotonic clock, and the CPU's spin-wait hint
and a yield for a thread that waits.

A plain ``while flags[i] == v`` may be compiled into a loop that reads memory once; an atomic load is
made at every iteration."""

from __future__ import annotations

import time

from llvmlite import binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from forge.jit import _element, _flat_array

I32, I64 = ir.IntType(32), ir.IntType(64)
_X86 = llvm.get_process_triple().startswith(("x86_64", "i386", "i686"))


def _int_flags(arr, i) -> bool:  # noqa: ANN001
    return _flat_array(arr, i) and arr.dtype in (types.int32, types.int64)


@intrinsic
def load_acquire(typingctx, arr, i):  # noqa: ANN001, ANN201
    """arr[i] (int32 / int64, 1-D contiguous), read from memory each call; what was written before the
    ``store_release`` or ``arrive`` that set it is visible after it."""
    if not _int_flags(arr, i):
        return None

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        p = _element(context, builder, signature, args)
        return builder.load_atomic(p, "acquire", arr.dtype.bitwidth // 8)

    return arr.dtype(arr, i), codegen


@intrinsic
def store_release(typingctx, arr, i, v):  # noqa: ANN001, ANN201
    """arr[i] = v, after every write this thread made before it (see ``load_acquire``)."""
    if not _int_flags(arr, i) or not isinstance(v, types.Integer):
        return None

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        p = _element(context, builder, signature, args)
        value = context.cast(builder, args[2], signature.args[2], arr.dtype)
        builder.store_atomic(value, p, "release", arr.dtype.bitwidth // 8)
        return context.get_dummy_value()

    return types.none(arr, i, v), codegen


@intrinsic
def arrive(typingctx, counter, i):  # noqa: ANN001, ANN201
    """counter[i] (int64) before one is added to it, ordered both ways: the thread that counts last sees what
    every thread counted before it wrote (``cpu_ir.claim`` is the same add with no ordering, for work items)."""
    if not (_flat_array(counter, i) and counter.dtype == types.int64):
        return None

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        p = _element(context, builder, signature, args)
        return builder.atomic_rmw("add", p, ir.Constant(I64, 1), "acq_rel")

    return types.int64(counter, i), codegen


@intrinsic
def now_ns(typingctx):  # noqa: ANN001, ANN201
    """The monotonic clock (``time.monotonic_ns``'s), in nanoseconds, from ``clock_gettime``."""

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        spec = ir.LiteralStructType([I64, I64])  # struct timespec on 64-bit Linux and macOS
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(I32, [I32, spec.as_pointer()]), "clock_gettime"
        )
        ts = cgutils.alloca_once(builder, spec)
        builder.call(fn, [ir.Constant(I32, time.CLOCK_MONOTONIC), ts])
        sec = builder.load(builder.gep(ts, [ir.Constant(I32, 0), ir.Constant(I32, 0)]))
        nsec = builder.load(builder.gep(ts, [ir.Constant(I32, 0), ir.Constant(I32, 1)]))
        return builder.add(builder.mul(sec, ir.Constant(I64, 1_000_000_000)), nsec)

    return types.int64(), codegen


@intrinsic
def spin_pause(typingctx):  # noqa: ANN001, ANN201
    """The CPU's hint that this thread is spin-waiting (x86 ``pause``; nothing elsewhere)."""

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        if _X86:
            fn = builder.module.declare_intrinsic(
                "llvm.x86.sse2.pause", (), ir.FunctionType(ir.VoidType(), [])
            )
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.none(), codegen


@intrinsic
def yield_thread(typingctx):  # noqa: ANN001, ANN201
    """``sched_yield``: let another runnable thread have this core (a waiting thread that spun long enough)."""

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(I32, []), "sched_yield")
        builder.call(fn, [])
        return context.get_dummy_value()

    return types.none(), codegen


__all__ = ["arrive", "load_acquire", "now_ns", "spin_pause", "store_release", "yield_thread"]
