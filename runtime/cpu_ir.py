"""What the CPU kernels' LLVM intrinsics (``runtime.cpu_q8``, ``runtime.cpu_vnni``) share: the host's
instruction sets, and code generation helpers for a numba intrinsic: byte pointers into its array arguments,
unaligned vector loads, constant vectors, and a K-quant block's six-bit scales and minimums unpacked; and
``claim``, the atomic counter from which a parallel region's threads take their work items."""

from __future__ import annotations

from llvmlite import binding as llvm
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

I8, I32, I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)


def host_has(*features: str) -> bool:
    """The host CPU has every one of these LLVM features (``avx2``, ``avx512vnni``, ...)."""
    try:
        found = llvm.get_host_cpu_features()
    except RuntimeError:  # LLVM cannot read this host's features
        return False
    return all(found.get(f) for f in features)


class IRHelpers:
    """A numba intrinsic's code generator state (context, builder, signature, args) and the helpers its
    kernels share."""

    def __init__(self, context, builder, signature, args) -> None:  # noqa: ANN001
        self.context, self.b, self.signature, self.args = context, builder, signature, args

    def at(self, k: int, offset: ir.Value | None = None) -> ir.Value:
        """A byte pointer to array argument k's data (at byte ``offset``)."""
        data = self.context.make_array(self.signature.args[k])(self.context, self.b, self.args[k]).data
        p = self.b.bitcast(data, I8.as_pointer())
        return p if offset is None else self.b.gep(p, [offset], inbounds=True)

    def load(self, p: ir.Value, off: int | ir.Value, ty: ir.Type) -> ir.Value:
        """An unaligned load of ``ty`` at byte ``off`` of byte pointer p."""
        q = self.b.gep(p, [ir.Constant(I64, off) if isinstance(off, int) else off], inbounds=True)
        return self.b.load(self.b.bitcast(q, ty.as_pointer()), align=1)

    def splat(self, ty: ir.VectorType, v: int | float) -> ir.Constant:
        return ir.Constant(ty, [v] * ty.count)

    def k4_scales_mins(self, blk: ir.Value) -> tuple[ir.Value, ir.Value]:
        """The eight 6-bit scales and eight 6-bit minimums (two <8 x i8>) of the Q4_K / Q5_K block at byte
        pointer blk (its 12 scale bytes at blk + 4), unpacked as ggml's AVX2 code does."""
        b = self.b

        def c(v: int) -> ir.Constant:
            return ir.Constant(I32, v)

        u0, u1, u2 = (self.load(blk, 4 + 4 * k, I32) for k in range(3))
        m2, m4, m6 = c(0x0F0F0F0F), c(0x03030303), c(0x3F3F3F3F)
        sc_hi = b.or_(b.and_(u2, m2), b.shl(b.and_(b.lshr(u0, c(6)), m4), c(4)))
        mn_hi = b.or_(b.and_(b.lshr(u2, c(4)), m2), b.shl(b.and_(b.lshr(u1, c(6)), m4), c(4)))

        def bytes8(lo: ir.Value, hi: ir.Value) -> ir.Value:
            pair = b.insert_element(ir.Constant(ir.VectorType(I32, 2), None), lo, c(0))
            return b.bitcast(b.insert_element(pair, hi, c(1)), ir.VectorType(I8, 8))

        return bytes8(b.and_(u0, m6), sc_hi), bytes8(b.and_(u1, m6), mn_hi)


@intrinsic
def claim(typingctx, counter, i):  # noqa: ANN001, ANN201
    """claim(counter, i) -> int64: counter[i] (an int64 array) before one is added to it atomically. A
    parallel region's threads take their work items from it in turn, so a thread that starts late or runs
    slow (another process on its core, memory farther away) takes fewer: numba splits a ``prange`` into equal
    shares fixed in advance, and the region lasted as long as its slowest share."""
    if not (
        isinstance(counter, types.Array) and counter.dtype == types.int64 and isinstance(i, types.Integer)
    ):
        return None

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        p = builder.gep(data, [builder.sext(args[1], I64) if args[1].type != I64 else args[1]])
        return builder.atomic_rmw("add", p, ir.Constant(I64, 1), "monotonic")

    return types.int64(counter, i), codegen
