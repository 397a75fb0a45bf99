"""Triton kernels that compute directly on GGUF blocks (the ``cuda`` backend's weight products).

    linear(x, raw, qtype)                 x (T, K) @ W.T, W (N, K) held as GGUF rows uint8 (N, row_bytes)
    moe_linear(x, raw, qtype, ids)        per (token, slot): x @ W[ids[t, s]].T, raw (E, N, row_bytes)

Both pick a GEMV kernel for decode (T <= 8: the weights are read once, every token's products are
summed from the same dequantized registers) and a dequant-in-kernel GEMM (``tl.dot``) for prefill.
MoE prefill groups the (token, slot) pairs by expert on the device (a sort, then one launch for the tile ->
expert table, whose length has a fixed upper bound), so no call synchronizes with the host.

The blocks are decoded in registers by the same formulas as runtime/dequant_*.py (ggml's layouts
and order of operations), in float32; products accumulate in float32. A weight tile is handled as
[rows, groups, group] where a group is the run of values that shares one scale, so per-group fields
(scales, minimums, sign words) are loaded once per group rather than once per value.

Types without a kernel fall back to ``runtime.dequant.dequantize`` + ``torch.matmul`` (logged once).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from forge import ggml_types
from runtime.backends.triton_launch import launch

try:  # CI machines have no triton; the module still imports so callers can ask ``available()``
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None
    tl = None

T = GGMLQuantizationType
log = logging.getLogger(__name__)


class KernelType(NamedTuple):
    """What the kernels need to know of a type they decode (registered as its ``cuda`` capability)."""

    #: values per group that shares one scale (the tile's innermost axis); floats use one 64-value group
    group: int
    #: the word kernel's view of the rows (``_as_words``), for the types it handles
    words: torch.dtype | None = None


for _qtype, _kt in {
    T.F32: KernelType(64),
    T.F16: KernelType(64),
    T.BF16: KernelType(64),
    T.Q8_0: KernelType(32, torch.int16),
    T.Q2_K: KernelType(16),
    T.Q3_K: KernelType(16),
    T.Q4_K: KernelType(32, torch.int32),
    T.Q5_K: KernelType(32, torch.int32),
    T.Q6_K: KernelType(16, torch.int16),
    T.IQ4_NL: KernelType(32),
    T.IQ4_XS: KernelType(32),
    T.IQ2_XXS: KernelType(32),
    T.IQ2_XS: KernelType(16),
    T.IQ3_XXS: KernelType(32),
    T.MXFP4: KernelType(32),
}.items():
    ggml_types.provide("cuda", _qtype, _kt)
_PRECISIONS = {"tf32": 0, "ieee": 1, "fp16": 2, "bf16": 3, "tf32x3": 4, "bf16x3": 5, "bf16x2": 6, "fp16x2": 7}
# Types whose values are an integer code times a per-group scale (less a per-group minimum): their
# GEMM can take the codes, exact in bfloat16, to the tensor cores and apply the scales per group.
_INT_TYPES = (T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0)
# Types whose 6-bit group scale times code is at most 1,953: exact in float16, so a super-block's groups
# make one chained tensor-core product (fp16x2, _fold_gemm_t) with one float scale applied per block.
_FOLD_TYPES = (T.Q4_K, T.Q5_K)
# Largest unit roundoff of each product precision's operands (tf32 may truncate: 2^-10, not 2^-11).
# tf32x3 splits each operand into a tf32 high and low part and sums three products: float32-like (2^-21
# is a safe reading of its error; the tests hold it to the float32 bound of 1e-4 of the output scale).
UNIT_ROUNDOFF = {
    "tf32": 2.0**-10,
    "ieee": 2.0**-24,
    "fp16": 2.0**-11,
    "bf16": 2.0**-8,
    "tf32x3": 2.0**-21,
    "bf16x3": 2.0**-24,  # x = three bfloat16 parts exactly; codes exact: float32 products
    "bf16x2": 2.0**-15,  # x's top 8 bits, then the rest rounded to 8 bits; codes exact
    # x times a power of two per row as two float16 parts (22 bits), its group sums likewise; scaled codes and
    # 6-bit minimums exact
    "fp16x2": 2.0**-21,
}
# The runtime's prefill precision: "auto" is float32-accurate, fp16x2 (Q4_K, Q5_K), bf16x3 or tf32x3,
# whichever measured faster for the product (_gemm_plan); tf32 alone gave 7.6e-4 of the logit scale on the
# 35B-geometry file, over the 1e-4 acceptance. FORGE_CUDA_PRECISION overrides it (benchmarks).
DEFAULT_PRECISION = "auto"
DECODE_TOKENS = 8
# the most experts the grouping kernel takes: it holds a per-expert row in each program, and 8,192 (an 8 GiB
# hybrid pool's slots) took minutes to compile; more go through torch operations (_group_by_expert_ops)
GROUP_KERNEL_EXPERTS = 1024
_warned: set[str] = set()


def available() -> bool:
    """Triton imports and CUDA is present (FORGE_CUDA_KERNELS=0 turns the kernels off: torch path)."""
    return triton is not None and torch.cuda.is_available() and os.environ.get("FORGE_CUDA_KERNELS") != "0"


def computes(device: torch.device, qtype: GGMLQuantizationType | int) -> bool:
    """Whether products with a ``qtype`` weight on ``device`` run on these kernels (from the file bytes)."""
    return device.type == "cuda" and available() and supports(qtype)


def supported_types() -> list[GGMLQuantizationType]:
    return ggml_types.types_with("cuda")


@functools.cache
def supports(qtype: GGMLQuantizationType | int) -> bool:
    return ggml_types.supports("cuda", qtype)


# ---------------------------------------------------------------------------------------------------
# Decoding one tile of blocks in registers
# ---------------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _u8(ptr):
        return tl.load(ptr).to(tl.int32)

    @triton.jit
    def _f16(ptr):
        lo = tl.load(ptr).to(tl.uint16)
        hi = tl.load(ptr + 1).to(tl.uint16)
        return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _i8(ptr):
        return tl.load(ptr).to(tl.int8, bitcast=True).to(tl.int32)

    @triton.jit
    def _parity_sign(bits, p):
        """+1/-1 of value p (0..7) for a 7-bit sign index (ggml's ksigns_iq2xs: bit 7 = parity)."""
        v = bits ^ (bits >> 4)
        v = v ^ (v >> 2)
        v = v ^ (v >> 1)
        bit = tl.where(p < 7, (bits >> p) & 1, v & 1)
        return (1 - 2 * bit).to(tl.float32)

    @triton.jit
    def _scale_min_of(a, b, c, g):
        """ggml's get_scale_min_k4 for group g (0..7), from the scale bytes g % 4, 4 + g % 4 and 8 + g % 4."""
        sc = tl.where(g < 4, a & 63, (c & 15) | ((a >> 6) << 4))
        m = tl.where(g < 4, b & 63, (c >> 4) | ((b >> 6) << 4))
        return sc, m

    @triton.jit
    def _k4_scale_min(w, bp, g):
        """get_scale_min_k4 for group g (0..7) of the 12 scale bytes at bp + 4, as float32."""
        gl = g % 4
        sc, m = _scale_min_of(_u8(w + bp + 4 + gl), _u8(w + bp + 8 + gl), _u8(w + bp + 12 + gl), g)
        return sc.to(tl.float32), m.to(tl.float32)

    @triton.jit
    def _decode(w, bp, jg, si, kmask, tab, QT: tl.constexpr):
        """Values of a tile: bp [R, G, 1] byte offset of each group's block, jg [1, G, 1] the group's
        first value within its block, si [1, 1, S] the value within the group -> float32 [R, G, S].
        For the float types bp is the element offset of the group's first value."""
        if QT == 0 or QT == 1 or QT == 30:  # F32, F16, BF16
            return tl.load(w + bp + si, mask=kmask, other=0.0).to(tl.float32)
        elif QT == 8:  # Q8_0: fp16 d | int8 q[32]
            return _i8(w + bp + 2 + si).to(tl.float32) * _f16(w + bp)
        elif QT == 12 or QT == 13:  # Q4_K / Q5_K: d | dmin | scales[12] | (Q5_K: qh[32]) | qs[128]
            g = jg // 32
            sc, m = _k4_scale_min(w, bp, g)
            dl = _f16(w + bp) * sc
            ml = _f16(w + bp + 2) * m
            if QT == 12:
                q = (_u8(w + bp + 16 + (g // 2) * 32 + si) >> ((g % 2) * 4)) & 15
            else:
                q = (_u8(w + bp + 48 + (g // 2) * 32 + si) >> ((g % 2) * 4)) & 15
                q = q | (((_u8(w + bp + 16 + si) >> g) & 1) << 4)
            return dl * q.to(tl.float32) - ml
        elif QT == 14:  # Q6_K: ql[128] | qh[64] | int8 scales[16] | d
            j = jg + si
            r = j // 128
            jj = j % 128
            ql = (_u8(w + bp + r * 64 + jj % 64) >> ((jj // 64) * 4)) & 15
            qh = (_u8(w + bp + 128 + r * 32 + jj % 32) >> (2 * (jj // 32))) & 3
            dl = _f16(w + bp + 208) * _i8(w + bp + 192 + jg // 16).to(tl.float32)
            return dl * ((ql | (qh << 4)) - 32).to(tl.float32)
        elif QT == 10:  # Q2_K: scales[16] | qs[64] | d | dmin
            j = jg + si
            scb = _u8(w + bp + jg // 16)
            dl = _f16(w + bp + 80) * (scb & 15).to(tl.float32)
            ml = _f16(w + bp + 82) * (scb >> 4).to(tl.float32)
            jj = j % 128
            q = (_u8(w + bp + 16 + (j // 128) * 32 + jj % 32) >> (2 * (jj // 32))) & 3
            return dl * q.to(tl.float32) - ml
        elif QT == 11:  # Q3_K: hmask[32] | qs[64] | scales[12] | d
            j = jg + si
            i = jg // 16
            low = (_u8(w + bp + 96 + i % 8) >> ((i // 8) * 4)) & 15
            high = (_u8(w + bp + 104 + i % 4) >> (2 * (i // 4))) & 3
            dl = _f16(w + bp + 108) * ((low | (high << 4)) - 32).to(tl.float32)
            jj = j % 128
            q2 = (_u8(w + bp + 32 + (j // 128) * 32 + jj % 32) >> (2 * (jj // 32))) & 3
            hb = (_u8(w + bp + j % 32) >> (j // 32)) & 1
            return dl * (q2 + 4 * hb - 4).to(tl.float32)
        elif QT == 20:  # IQ4_NL: d | 16 B nibbles
            nib = (_u8(w + bp + 2 + si % 16) >> ((si // 16) * 4)) & 15
            return _f16(w + bp) * tl.load(tab + nib)
        elif QT == 23:  # IQ4_XS: d | scales_h u16 | scales_l[4] | qs[128]
            g = jg // 32
            low = (_u8(w + bp + 4 + g // 2) >> ((g % 2) * 4)) & 15
            high = (_u8(w + bp + 2 + g // 4) >> ((g % 4) * 2)) & 3
            dl = _f16(w + bp) * ((low | (high << 4)) - 32).to(tl.float32)
            nib = (_u8(w + bp + 8 + g * 16 + si % 16) >> ((si // 16) * 4)) & 15
            return dl * tl.load(tab + nib)
        elif QT == 16:  # IQ2_XXS: d | 8 x (4 grid-index bytes, u32: 4 x 7 sign bits + 4-bit scale)
            sub = bp + 2 + (jg // 32) * 8
            aux = (
                _u8(w + sub + 4)
                | (_u8(w + sub + 5) << 8)
                | (_u8(w + sub + 6) << 16)
                | (_u8(w + sub + 7) << 24)
            )
            db = _f16(w + bp) * (0.5 + (_u8(w + sub + 7) >> 4).to(tl.float32)) * 0.25
            k = si // 8
            gv = tl.load(tab + _u8(w + sub + k) * 8 + si % 8)
            return db * gv * _parity_sign((aux >> (7 * k)) & 127, si % 8)
        elif QT == 17:  # IQ2_XS: d | 32 x u16 (9-bit grid index, 7-bit sign index) | scales[8]
            i16 = jg // 16
            sc = (_u8(w + bp + 66 + i16 // 2) >> ((i16 % 2) * 4)) & 15
            db = _f16(w + bp) * (0.5 + sc.to(tl.float32)) * 0.25
            pair = (jg + si) // 8
            qs = _u8(w + bp + 2 + 2 * pair) | (_u8(w + bp + 3 + 2 * pair) << 8)
            gv = tl.load(tab + (qs & 511) * 8 + si % 8)
            return db * gv * _parity_sign(qs >> 9, si % 8)
        elif QT == 18:  # IQ3_XXS: d | qs[64] (grid indices, 4 values each) | 8 x u32 (signs + scale)
            s = jg // 32
            ap = bp + 66 + 4 * s
            aux = (
                _u8(w + ap)
                | (_u8(w + ap + 1) << 8)
                | (_u8(w + ap + 2) << 16)
                | ((_u8(w + ap + 3) & 15) << 24)
            )
            db = _f16(w + bp) * (0.5 + (_u8(w + ap + 3) >> 4).to(tl.float32)) * 0.5
            gv = tl.load(tab + _u8(w + bp + 2 + s * 8 + si // 4) * 4 + si % 4)
            return db * gv * _parity_sign((aux >> (7 * (si // 8))) & 127, si % 8)
        elif QT == 39:  # MXFP4: E8M0 e | 16 B nibbles (E2M1 codes); x = kvalues_mxfp4[q] * 2^(e-128)
            e = _u8(w + bp)
            d = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)
            nib = (_u8(w + bp + 1 + si % 16) >> ((si // 16) * 4)) & 15
            return tl.load(tab + nib) * d
        else:
            tl.static_assert(False, "no kernel for this GGUF type")

    @triton.jit
    def _tile_offsets(k0, row_off, K, G: tl.constexpr, S: tl.constexpr, BS: tl.constexpr, TS: tl.constexpr):
        """Block offsets for the K-tile starting at k0: bp [R, G, 1], jg [1, G, 1], si [1, 1, S], kg, kmask."""
        gi = tl.arange(0, G)[None, :, None]
        si = tl.arange(0, S)[None, None, :]
        kg = k0 + gi * S
        bp = row_off[:, None, None] + (kg // BS).to(tl.int64) * TS
        kmask = (kg + si) < K
        return bp, kg % BS, si, kg, kmask

    # ------------------------------------------------------------------------------------------------
    # Decode: GEMV over a few tokens; grouped MoE GEMV.
    # One token (all MoE products, and decode of one sequence): every thread accumulates w * x in
    # its own registers over the whole K loop and the tile is reduced once at the end. More tokens:
    # the decoded tile is reused for each token's product, reduced per tile.
    # ------------------------------------------------------------------------------------------------

    @triton.jit
    def _rows_and_x(x, y, ids, N, row_stride, sx_tok, sx_slot, sy_tok, TOPK: tl.constexpr, BN: tl.constexpr,
                    MOE: tl.constexpr):  # fmt: skip
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        nc = tl.minimum(n, N - 1).to(tl.int64)
        if MOE:
            pair = tl.program_id(1)
            e = tl.load(ids + pair).to(tl.int64)
            row = (e * N + nc) * row_stride
            x = x + (pair // TOPK) * sx_tok + (pair % TOPK) * sx_slot
            y = y + pair.to(tl.int64) * sy_tok
        else:
            row = nc * row_stride
        return n, row, x, y

    @triton.jit
    def _store_rows(y, acc, n, N, sy_tok, NT: tl.constexpr, NTP: tl.constexpr):
        tcol = tl.arange(0, NTP)
        tl.store(y + tcol[None, :] * sy_tok + n[:, None], acc, mask=(n[:, None] < N) & (tcol[None, :] < NT))

    @triton.jit
    def _gemv_kernel(
        x,
        w,
        y,
        tab,
        ids,
        N,
        K,
        row_stride,
        sx_tok,
        sx_slot,
        sy_tok,
        TOPK: tl.constexpr,
        NT: tl.constexpr,
        NTP: tl.constexpr,
        QT: tl.constexpr,
        BS: tl.constexpr,
        TS: tl.constexpr,
        S: tl.constexpr,
        G: tl.constexpr,
        BN: tl.constexpr,
        MOE: tl.constexpr,
    ):
        """Dense: one program covers BN rows for all NT tokens. MoE (NT = 1): program axis 1 is the
        (token, slot) pair; its expert id is read on the device."""
        n, row_off, x, y = _rows_and_x(x, y, ids, N, row_stride, sx_tok, sx_slot, sy_tok, TOPK, BN, MOE)
        tcol = tl.arange(0, NTP)
        if NT == 1:
            acc_e = tl.zeros([BN, G, S], dtype=tl.float32)
            for k0 in range(0, K, G * S):
                bp, jg, si, kg, kmask = _tile_offsets(k0, row_off, K, G, S, BS, TS)
                wt = _decode(w, bp, jg, si, kmask, tab, QT)
                acc_e += wt * tl.load(x + kg + si, mask=kmask, other=0.0).to(tl.float32)
            acc = tl.where(tcol[None, :] == 0, tl.sum(tl.sum(acc_e, axis=2), axis=1)[:, None], 0.0)
        else:
            acc = tl.zeros([BN, NTP], dtype=tl.float32)
            for k0 in range(0, K, G * S):
                bp, jg, si, kg, kmask = _tile_offsets(k0, row_off, K, G, S, BS, TS)
                wt = _decode(w, bp, jg, si, kmask, tab, QT)
                for t in tl.static_range(NT):
                    xt = tl.load(x + t * sx_tok + kg + si, mask=kmask, other=0.0).to(tl.float32)
                    part = tl.sum(tl.sum(wt * xt, axis=2), axis=1)
                    acc += tl.where(tcol[None, :] == t, part[:, None], 0.0)
        _store_rows(y, acc, n, N, sy_tok, NT, NTP)

    # ------------------------------------------------------------------------------------------------
    # Decode fast path for the types of q4_k_m files (Q4_K, Q5_K, Q6_K, Q8_0): the quants are read as
    # 32-bit (Q4_K, Q5_K) or 16-bit words (Q6_K, Q8_0: 210- and 34-byte blocks are only 2-byte
    # aligned), a 256-value chunk per step laid out as [rows, ...word axes..., value-in-word axes].
    # Each chunk function returns the chunk's float32 weights and the x offset of each value.
    # ------------------------------------------------------------------------------------------------

    @triton.jit
    def _f16_of(bits):
        return (bits & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _chunk_k4(w32, w8, base, Q5: tl.constexpr):
        """One Q4_K/Q5_K super-block of BN rows; base [BN] int64 word offset of each row's block."""
        p = tl.arange(0, 4)[None, :, None, None, None]  # pair of groups (32 bytes of qs)
        v = tl.arange(0, 8)[None, None, :, None, None]  # word within the pair
        h = tl.arange(0, 2)[None, None, None, :, None]  # low nibble: group 2p, high: group 2p + 1
        i = tl.arange(0, 4)[None, None, None, None, :]  # byte within the word
        b5 = base[:, None, None, None, None]
        qs = tl.load(w32 + b5 + (12 if Q5 else 4) + p * 8 + v)
        q = (qs >> (h * 4 + i * 8)) & 15
        if Q5:  # qh byte l = 4v + i holds bit g = 2p + h of value l of group g
            qh = tl.load(w32 + b5 + 4 + v)
            q = q | (((qh >> (i * 8 + 2 * p + h)) & 1) << 4)
        # scales of the 8 groups, g = 2p + h
        g = 2 * p + h
        sc, m = _k4_scale_min(w8, b5 * 4, g)
        dw = tl.load(w32 + b5)
        wf = (_f16_of(dw) * sc) * q.to(tl.float32) - _f16_of(dw >> 16) * m
        return wf, p * 64 + h * 32 + v * 4 + i

    @triton.jit
    def _chunk_q6k(w16, w8, base):
        """One Q6_K block (105 16-bit words) of BN rows; value j = 128 r + 64 half + 2 (8 lg + l8) + i."""
        r = tl.arange(0, 2)[None, :, None, None, None, None]
        lg = tl.arange(0, 4)[None, None, :, None, None, None]
        l8 = tl.arange(0, 8)[None, None, None, :, None, None]
        half = tl.arange(0, 2)[None, None, None, None, :, None]
        i = tl.arange(0, 2)[None, None, None, None, None, :]
        b6 = base[:, None, None, None, None, None]
        ql = tl.load(w16 + b6 + r * 32 + lg * 8 + l8).to(tl.int32)
        qh = tl.load(w16 + b6 + 64 + r * 16 + (lg % 2) * 8 + l8).to(tl.int32)
        q = ((ql >> (8 * i + 4 * half)) & 15) | (((qh >> (8 * i + 2 * (2 * half + lg // 2))) & 3) << 4)
        sc = _i8(w8 + b6 * 2 + 192 + 8 * r + 4 * half + lg).to(tl.float32)  # scale of 16 values
        dl = _f16_of(tl.load(w16 + b6 + 104).to(tl.int32)) * sc
        return dl * (q - 32).to(tl.float32), r * 128 + half * 64 + 2 * (lg * 8 + l8) + i

    @triton.jit
    def _chunk_q80(w16, base):
        """Eight Q8_0 blocks (17 16-bit words each) of BN rows; base is the first block's word offset."""
        blk = tl.arange(0, 8)[None, :, None, None]
        v = tl.arange(0, 16)[None, None, :, None]
        i = tl.arange(0, 2)[None, None, None, :]
        b4 = base[:, None, None, None] + blk * 17
        qw = tl.load(w16 + b4 + 1 + v).to(tl.int32)  # sign-extended: the high byte needs no fix-up
        d = _f16_of(tl.load(w16 + b4).to(tl.int32))
        return ((qw << (24 - 8 * i)) >> 24).to(tl.float32) * d, blk * 32 + v * 2 + i

    @triton.jit
    def _chunk(w, w8, row, c, QT: tl.constexpr):
        if QT == 12:
            return _chunk_k4(w, w8, row + c * 36, False)
        elif QT == 13:
            return _chunk_k4(w, w8, row + c * 44, True)
        elif QT == 14:
            return _chunk_q6k(w, w8, row + c * 105)
        else:
            return _chunk_q80(w, row + c * 136)

    @triton.jit
    def _gemv_words_kernel(
        x,
        w,
        y,
        ids,
        N,
        K,
        row_words,
        sx_tok,
        sx_slot,
        sy_tok,
        TOPK: tl.constexpr,
        NT: tl.constexpr,
        NTP: tl.constexpr,
        QT: tl.constexpr,
        BN: tl.constexpr,
        MOE: tl.constexpr,
        SPLIT: tl.constexpr,
    ):
        """As _gemv_kernel, for Q4_K/Q5_K (w viewed as int32) and Q6_K/Q8_0 (w viewed as int16)."""
        n, row, x, y = _rows_and_x(x, y, ids, N, row_words, sx_tok, sx_slot, sy_tok, TOPK, BN, MOE)
        w8 = w.to(tl.pointer_type(tl.uint8))
        tcol = tl.arange(0, NTP)
        if NT == 1:
            # SPLIT > 1: program axis 2 takes 1/SPLIT of the chunks and adds its sums into y (zeroed)
            per = K // 256 // SPLIT
            c0 = tl.program_id(2) * per
            wf, xi = _chunk(w, w8, row, c0, QT)
            acc_e = wf * tl.load(x + c0 * 256 + xi)
            for c in range(c0 + 1, c0 + per):
                wf, xi = _chunk(w, w8, row, c, QT)
                acc_e += wf * tl.load(x + c * 256 + xi)
            part = _row_sum(acc_e, QT)
            if SPLIT > 1:
                tl.atomic_add(y + n, part, mask=n < N, sem="relaxed")
            else:
                tl.store(y + n, part, mask=n < N)
        else:
            acc = tl.zeros([BN, NTP], dtype=tl.float32)
            for c in range(0, K // 256):
                wf, xi = _chunk(w, w8, row, c, QT)
                for t in tl.static_range(NT):
                    xv = tl.load(x + t * sx_tok + c * 256 + xi).to(tl.float32)
                    part = _row_sum(wf * xv, QT)
                    acc += tl.where(tcol[None, :] == t, part[:, None], 0.0)
            _store_rows(y, acc, n, N, sy_tok, NT, NTP)

    @triton.jit
    def _row_sum(t, QT: tl.constexpr):
        """Sum over every axis but the first (the chunk tensors' rank depends on the type)."""
        if QT == 12 or QT == 13:
            return tl.sum(tl.sum(tl.sum(tl.sum(t, axis=4), axis=3), axis=2), axis=1)
        elif QT == 14:
            return tl.sum(tl.sum(tl.sum(tl.sum(tl.sum(t, axis=5), axis=4), axis=3), axis=2), axis=1)
        else:
            return tl.sum(tl.sum(tl.sum(t, axis=3), axis=2), axis=1)

    # ------------------------------------------------------------------------------------------------
    # Prefill: GEMM with the weight tile decoded in registers; grouped MoE GEMM
    # ------------------------------------------------------------------------------------------------

    @triton.jit
    def _dot(a, b, acc, PREC: tl.constexpr):
        if PREC == 0:
            return tl.dot(a, b, acc, input_precision="tf32")
        elif PREC == 1:
            return tl.dot(a, b, acc, input_precision="ieee")
        elif PREC == 4:
            return tl.dot(a, b, acc, input_precision="tf32x3")
        elif PREC == 2:
            return tl.dot(a.to(tl.float16), b.to(tl.float16), acc)
        else:
            return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)

    @triton.jit
    def _group_at(row_off, g, BS: tl.constexpr, TS: tl.constexpr, S: tl.constexpr):
        """Value group g of rows starting at byte offsets row_off: (its block's byte offsets, its index in the
        block), the arguments of _int_codes and _int_scale."""
        k = g * S
        return row_off + (k // BS) * TS, (k % BS) // S

    @triton.jit
    def _int_operand(q, DT: tl.constexpr, INTERP: tl.constexpr):
        """Small integers (codes, scales) as a tensor-core operand of type DT (bfloat16 up to 8 bits, float16 up
        to 11: exact), float32 under the interpreter."""
        if INTERP:
            return q.to(tl.float32)
        return q.to(tl.float32).to(DT)

    @triton.jit
    def _int_codes(w, bp, c, li, QT: tl.constexpr):
        at = bp[:, None] + li[None, :]
        if QT == 8:  # Q8_0
            return _i8(w + at + 2)
        elif QT == 12:  # Q4_K
            return (_u8(w + at + 16 + (c // 2) * 32) >> ((c % 2) * 4)) & 15
        elif QT == 13:  # Q5_K
            q = (_u8(w + at + 48 + (c // 2) * 32) >> ((c % 2) * 4)) & 15
            return q | (((_u8(w + at + 16) >> c) & 1) << 4)
        else:  # Q6_K, 16-value groups: value j = 16 c + l of ggml's ql / qh interleave
            r = c // 8
            ql = (_u8(w + at + r * 64 + (c % 4) * 16) >> (((c % 8) // 4) * 4)) & 15
            qh = (_u8(w + at + 128 + r * 32 + (c % 2) * 16) >> (((c % 8) // 2) * 2)) & 3
            return (ql | (qh << 4)) - 32

    @triton.jit
    def _int_scale(w, bp, c, QT: tl.constexpr):
        if QT == 8:
            return _f16(w + bp), 0.0
        elif QT == 12 or QT == 13:
            sc, m = _k4_scale_min(w, bp, c)
            return _f16(w + bp) * sc, _f16(w + bp + 2) * m
        else:
            return _f16(w + bp + 208) * _i8(w + bp + 192 + c).to(tl.float32), 0.0

    @triton.jit
    def _bf16_parts(x, PARTS: tl.constexpr, INTERP: tl.constexpr):
        """x float32 -> PARTS bfloat16 tensors summing to it (3 parts: exactly; 2: to 16 bits)."""
        hi = (x.to(tl.uint32, bitcast=True) & 0xFFFF0000).to(tl.float32, bitcast=True)
        r = x - hi
        mid = (r.to(tl.uint32, bitcast=True) & 0xFFFF0000).to(tl.float32, bitcast=True)
        lo = r - mid
        if PARTS == 2:
            mid = r
        if INTERP:  # the interpreter has no bfloat16 dot: the same (exact) products in float32
            return hi, mid, lo
        return hi.to(tl.bfloat16), mid.to(tl.bfloat16), lo.to(tl.bfloat16)

    @triton.jit
    def _exact_dot(a, b, acc, INTERP: tl.constexpr):
        """a @ b + acc for operands whose products are exact (bfloat16 or float16 values; float32 under INTERP)."""
        if INTERP:
            return tl.dot(a, b, acc, input_precision="ieee")
        return tl.dot(a, b, acc)

    @triton.jit
    def _int_gemm(x, w, xrow, rmask, row_off, k_lo, k_hi, BS: tl.constexpr, TS: tl.constexpr, S: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, QT: tl.constexpr, PARTS: tl.constexpr,
                  INTERP: tl.constexpr):  # fmt: skip
        """The K loop on integer codes: per group, x (split in bfloat16 parts, exact with 3) times the
        codes (exact in bfloat16) on tensor cores, then scaled and less the group's minimum times the
        sum of x over the group, in float32."""
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        li = tl.arange(0, S)
        for k in range(k_lo, k_hi, S):  # one group a step: unrolling a block's groups overflows shared memory
            bp, c = _group_at(row_off, k // S, BS, TS, S)
            scale, minimum = _int_scale(w, bp, c, QT)
            qt = tl.trans(_int_operand(_int_codes(w, bp, c, li, QT), tl.bfloat16, INTERP))
            xt = tl.load(x + xrow[:, None] + (k + li)[None, :], mask=rmask[:, None], other=0.0)
            hi, mid, lo = _bf16_parts(xt, PARTS, INTERP)
            p = _exact_dot(hi, qt, tl.zeros([BM, BN], dtype=tl.float32), INTERP)
            p = _exact_dot(mid, qt, p, INTERP)
            if PARTS == 3:
                p = _exact_dot(lo, qt, p, INTERP)
            acc += p * scale[None, :]
            if QT != 8 and QT != 14:
                acc -= tl.sum(xt, axis=1)[:, None] * minimum[None, :]
        return acc

    @triton.jit
    def _tile_rows(r, pid_m, rows, order, tile_start, sx_tok, sx_slot, sy, TOPK: tl.constexpr, BM: tl.constexpr,
                   MOE: tl.constexpr):  # fmt: skip
        """For tile row indices r (< BM): (row in use, x offset, y offset). MoE: the tile's (token, slot) pairs."""
        rmask = r < rows
        if MOE:
            pair = tl.load(order + tl.load(tile_start + pid_m) + r, mask=rmask, other=0).to(tl.int64)
            return rmask, (pair // TOPK) * sx_tok + (pair % TOPK) * sx_slot, pair * sy
        m = (pid_m * BM + r).to(tl.int64)
        return rmask, m * sx_tok, m * sy

    @triton.jit
    def _int_gemm_t(xs, xsum, xoff, xsrow, xmask, smask, w, row_off, k_lo, k_hi, BS: tl.constexpr, TS: tl.constexpr,
                    S: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, QT: tl.constexpr,
                    INTERP: tl.constexpr):  # fmt: skip
        """_int_gemm with the operands swapped: the weight rows are the product's rows (BN of them, a full
        tensor-core tile however few pairs an expert has), x arrives split already (_split_x) and its BM
        operand rows are (part, pair) at xoff (xmask: in use); the group sums at xsrow are taken where smask.
        Returns acc [BN, BM], the parts' products apart."""
        acc = tl.zeros([BN, BM], dtype=tl.float32)
        li = tl.arange(0, S)
        for g in range(k_lo // S, k_hi // S):  # k = g S: the compiler sees the alignment of every load
            k = g * S
            scale, minimum, xsum_g = _group_terms(w, xsum, row_off, xsrow, smask, g, BS, TS, S, QT)
            bp, c = _group_at(row_off, g, BS, TS, S)
            a = _int_operand(_int_codes(w, bp, c, li, QT), tl.bfloat16, INTERP)
            xt = tl.load(xs + xoff[:, None] + (k + li)[None, :], mask=xmask[:, None], other=0.0)
            p = _exact_dot(a, tl.trans(xt), tl.zeros([BN, BM], dtype=tl.float32), INTERP)
            acc += p * scale[:, None]
            if QT != 8 and QT != 14:
                acc -= minimum[:, None] * xsum_g[None, :]
        return acc

    @triton.jit
    def _group_terms(w, xsum, row_off, xsrow, smask, g, BS: tl.constexpr, TS: tl.constexpr, S: tl.constexpr,
                     QT: tl.constexpr):  # fmt: skip
        """Group g's scales and minimums [BN] and x's sums over it [BM] (0 for the types without minimums)."""
        bp, c = _group_at(row_off, g, BS, TS, S)
        scale, minimum = _int_scale(w, bp, c, QT)
        if QT != 8 and QT != 14:
            return scale, minimum, tl.load(xsum + xsrow + g, mask=smask, other=0.0)
        else:
            return scale, minimum, 0.0

    @triton.jit
    def _k4_scale_min_words(s1, s2, s3, g):
        """get_scale_min_k4 for groups g from the 12 scale bytes held as three int32 words (integers)."""
        sh = (g % 4) * 8
        return _scale_min_of((s1 >> sh) & 255, (s2 >> sh) & 255, (s3 >> sh) & 255, g)

    @triton.jit
    def _fold_codes(qs, qh, shift, bit, sc, QT: tl.constexpr, INTERP: tl.constexpr):
        """Q4_K / Q5_K codes times their group's 6-bit scale sc as a float16 tensor-core operand, exact (at most
        31 x 63 = 1,953): qs the quant bytes, shift 0 (low nibble) or 4 (high) per code, Q5_K: bit ``bit`` of qh
        the fifth. On a GPU two codes a register: 0x6400 | q is 1024 + q in float16, and one f16x2 fma with sc
        and -1024 sc leaves sc q."""
        if INTERP:
            q = (qs.to(tl.int32) >> shift) & 15
            if QT == 13:
                q = q | (((qh.to(tl.int32) >> bit) & 1) << 4)
            return (sc * q).to(tl.float32)
        f = tl.broadcast_to(sc.to(tl.float16), qs.shape)
        shift = tl.broadcast_to(shift, qs.shape)
        if QT == 12:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t, z; mov.b32 z, 0; cvt.u32.u16 t, $1; prmt.b32 t, t, z, 0x4140; shr.b32 t, t, $2;"
                " lop3.b32 t, t, 0x000F000F, 0x64006400, 0xEA; fma.rn.f16x2 $0, t, $4, $5; }",
                "=r,h,r,r,r,r", [qs, shift, f, f * -1024.0], dtype=tl.float16, is_pure=True, pack=2,
            )  # fmt: skip
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t, u, z; mov.b32 z, 0; cvt.u32.u16 t, $1; prmt.b32 t, t, z, 0x4140; shr.b32 t, t, $3;"
            " cvt.u32.u16 u, $2; prmt.b32 u, u, z, 0x4140; shr.b32 u, u, $5; shl.b32 u, u, 4;"
            " and.b32 u, u, 0x00100010; lop3.b32 t, t, 0x000F000F, u, 0xEA; or.b32 t, t, 0x64006400;"
            " fma.rn.f16x2 $0, t, $7, $8; }",
            "=r,h,h,r,r,r,r,r,r", [qs, qh, shift, tl.broadcast_to(bit, qs.shape), f, f * -1024.0],
            dtype=tl.float16, is_pure=True, pack=2,
        )  # fmt: skip

    @triton.jit
    def _word_bytes(words, i, shape):
        """Byte i of each word, as uint8 broadcast to ``shape``."""
        return tl.broadcast_to(((words >> (i * 8)) & 255).to(tl.uint8), shape)

    @triton.jit
    def _fold_gemm_t(xs, xsum, xoff, xsrow, xmask, w, row_off, k_lo, k_hi, TS: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, QT: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
        """_int_gemm_t for Q4_K / Q5_K on x split by _split_x_fold (two float16 parts): per super-block, each
        code times its group's 6-bit scale (exact in float16, _fold_codes) against x on tensor cores, chained
        over the block's four 64-value chunks (each decoded from 8 words a row, in _split_x_fold's order of x),
        then times the block's d; the minimums' term, the 6-bit m times x's group sums / 32 in float16 parts
        (each part's rows read their own), is one more exact product, then times 32 dmin."""
        w32 = w.to(tl.pointer_type(tl.int32))
        v = tl.arange(0, 8)[None, :, None, None]  # word of the chunk's 32 code bytes
        h = tl.arange(0, 2)[None, None, :, None]  # low nibble: group 2c, high: group 2c + 1
        i = tl.arange(0, 4)[None, None, None, :]  # byte within the word
        col = tl.arange(0, 64)
        g16 = tl.arange(0, 16)[None, :]  # the block's 8 groups, padded to a product's least K
        acc = tl.zeros([BN, BM], dtype=tl.float32)
        for sb in range(k_lo // 256, k_hi // 256):
            base = (row_off + sb * TS) // 4
            head, s1 = tl.load(w32 + base), tl.load(w32 + base + 1)
            s2, s3 = tl.load(w32 + base + 2), tl.load(w32 + base + 3)
            b4 = base[:, None, None, None]
            qh = tl.zeros([BN, 8, 2, 4], dtype=tl.uint8)  # Q5_K's fifth bits
            if QT == 13:
                qh = _word_bytes(tl.load(w32 + b4 + 4 + v), i, (BN, 8, 2, 4))
            p = tl.zeros([BN, BM], dtype=tl.float32)
            for c in range(4):
                qs = _word_bytes(tl.load(w32 + b4 + (12 if QT == 13 else 4) + c * 8 + v), i, (BN, 8, 2, 4))
                sc, _ = _k4_scale_min_words(
                    s1[:, None, None, None], s2[:, None, None, None], s3[:, None, None, None], 2 * c + h
                )
                codes = _fold_codes(qs, qh, 4 * h, 2 * c + h, sc, QT, INTERP)
                at = xoff[:, None] + (sb * 256 + c * 64 + col)[None, :]
                xt = tl.load(xs + at, mask=xmask[:, None], other=0.0)
                p = _exact_dot(tl.reshape(codes, (BN, 64)), tl.trans(xt), p, INTERP)
            acc += _f16_of(head)[:, None] * p
            _, m = _k4_scale_min_words(s1[:, None], s2[:, None], s3[:, None], g16 % 8)
            mq = _int_operand(tl.where(g16 < 8, m, 0), tl.float16, INTERP)
            xg = tl.load(xsum + xsrow[:, None] + sb * 8 + g16, mask=xmask[:, None] & (g16 < 8), other=0.0)
            pm = _exact_dot(mq, tl.trans(xg), tl.zeros([BN, BM], dtype=tl.float32), INTERP)
            acc -= (32.0 * _f16_of(head >> 16))[:, None] * pm
        return acc

    @triton.jit
    def _split_x_fold_kernel(x, parts, sums, inv, K, numel, B: tl.constexpr):
        """Row r of x (K values) -> x 2^s as two float16 parts (hi, then the rest), numel elements apart, with s
        the row's power of two that puts its largest value in [2^14, 2^15); each 64-value chunk in the order
        _fold_gemm_t decodes codes (value 32 h + 4 v + i at 8 v + 4 h + i); the sums of each 32 scaled values
        over 32, as two float16 parts numel / 32 apart; and 2^-s. The row is read in blocks of B values, twice."""
        row = tl.program_id(0).to(tl.int64)
        kb = tl.arange(0, B)
        amax = tl.max(tl.zeros([B], dtype=tl.float32), axis=0)
        for k0 in range(0, K, B):
            amax = tl.maximum(
                amax, tl.max(tl.abs(tl.load(x + row * K + k0 + kb, mask=k0 + kb < K, other=0.0)), 0)
            )
        e = ((amax.to(tl.int32, bitcast=True) >> 23) & 255) - 127
        s = tl.minimum(tl.maximum(14 - e, -100), 100)
        for k0 in range(0, K, B):
            k = k0 + kb
            xs = tl.load(x + row * K + k, mask=k < K, other=0.0) * ((s + 127) << 23).to(
                tl.float32, bitcast=True
            )
            hi = xs.to(tl.float16).to(tl.float32)
            r = k % 64
            at = row * K + (k - r) + ((r % 32) // 4) * 8 + (r // 32) * 4 + r % 4
            tl.store(parts + at, hi.to(parts.dtype.element_ty), mask=k < K)
            tl.store(parts + numel + at, (xs - hi).to(tl.float16).to(parts.dtype.element_ty), mask=k < K)
            g = k0 // 32 + tl.arange(0, B // 32)
            group_sums = tl.sum(tl.reshape(xs, (B // 32, 32)), axis=1) * 0.03125  # below 2^15
            sum_hi = group_sums.to(tl.float16).to(tl.float32)
            at = row * (K // 32) + g
            tl.store(sums + at, sum_hi.to(sums.dtype.element_ty), mask=g < K // 32)
            sum_lo = (group_sums - sum_hi).to(tl.float16)
            tl.store(sums + numel // 32 + at, sum_lo.to(sums.dtype.element_ty), mask=g < K // 32)
        tl.store(inv + row, ((127 - s) << 23).to(tl.float32, bitcast=True))

    @triton.jit
    def _tile_table_kernel(ids, table, pairs, E, bm, n_tiles, EP: tl.constexpr, BLOCK: tl.constexpr,
                           BB: tl.constexpr):  # fmt: skip
        """The (token, slot) pairs grouped by expert for the grouped GEMM, in table (int32): rows [0, 3) of
        n_tiles each: tile b's expert, first position in the order and rows (an expert's pairs take
        ceil(count / bm) tiles in expert order, the tiles past the last get 0 rows); then the order itself
        (pairs values: the pairs sorted by expert, stably). Program b writes tiles [b BB, b BB + BB) and,
        when b < E, the positions of expert b's pairs; each counts the pairs again."""
        e = tl.arange(0, EP)
        counts = tl.zeros([EP], dtype=tl.int32)
        for p0 in range(0, pairs, BLOCK):
            p = p0 + tl.arange(0, BLOCK)
            v = tl.load(ids + p, mask=p < pairs, other=0).to(tl.int32)
            counts += tl.histogram(v, EP)
        padding = tl.cdiv(pairs, BLOCK) * BLOCK - pairs  # the masked lanes, counted as expert 0
        counts -= tl.where(e == 0, padding, 0)
        tiles = (counts + bm - 1) // bm
        tile_end = tl.cumsum(tiles, 0)
        seg_start = tl.cumsum(counts, 0) - counts
        pid = tl.program_id(0)
        b = pid * BB + tl.arange(0, BB)
        te = tl.sum(((tile_end[None, :] <= b[:, None]) & (e[None, :] < E)).to(tl.int32), axis=1)
        at = e[None, :] == tl.minimum(te, E - 1)[:, None]  # the tile's expert, as a one-hot row
        first = tl.sum(tl.where(at, tile_end - tiles, 0), axis=1)
        row0 = (b - first) * bm
        rows = tl.sum(tl.where(at, counts, 0), axis=1) - row0
        rows = tl.where(te >= E, 0, tl.minimum(tl.maximum(rows, 0), bm))
        start = tl.sum(tl.where(at, seg_start, 0), axis=1) + row0
        keep = b < n_tiles
        tl.store(table + b, tl.minimum(te, E - 1), mask=keep)
        tl.store(table + n_tiles + b, start, mask=keep)
        tl.store(table + 2 * n_tiles + b, rows, mask=keep)
        if pid < E:
            at_order = table + 3 * n_tiles + tl.sum(tl.where(e == pid, seg_start, 0), axis=0)
            seen = tl.zeros([], dtype=tl.int32)
            for p0 in range(0, pairs, BLOCK):
                p = p0 + tl.arange(0, BLOCK)
                mine = tl.load(ids + p, mask=p < pairs, other=-1).to(tl.int32) == pid
                rank = seen + tl.cumsum(mine.to(tl.int32), 0) - 1
                tl.store(at_order + rank, p, mask=mine)
                seen += tl.sum(mine.to(tl.int32), 0)

    @triton.jit
    def _split_x_kernel(x, parts, sums, numel, PARTS: tl.constexpr, S: tl.constexpr, SUMS: tl.constexpr,
                        B: tl.constexpr):  # fmt: skip
        """x float32 -> PARTS parts (as _bf16_parts) ``numel`` elements apart, and the sum of each S values."""
        off = tl.program_id(0) * B + tl.arange(0, B)
        v = tl.load(x + off, mask=off < numel, other=0.0)
        hi, mid, lo = _bf16_parts(v, PARTS, False)
        tl.store(parts + off, hi.to(parts.dtype.element_ty), mask=off < numel)
        tl.store(parts + numel + off, mid.to(parts.dtype.element_ty), mask=off < numel)
        if PARTS == 3:
            tl.store(parts + 2 * numel + off, lo.to(parts.dtype.element_ty), mask=off < numel)
        if SUMS:
            g = tl.program_id(0) * (B // S) + tl.arange(0, B // S)
            tl.store(sums + g, tl.sum(tl.reshape(v, (B // S, S)), axis=1), mask=g < numel // S)

    @triton.jit
    def _gemm_kernel(
        x,
        w,
        y,
        tab,
        order,
        tile_expert,
        tile_start,
        tile_rows,
        M,
        N,
        K,
        row_stride,
        sx_tok,
        sx_slot,
        sy,
        split_stride,
        xsum,
        x_part,
        xinv,
        TOPK: tl.constexpr,
        QT: tl.constexpr,
        BS: tl.constexpr,
        TS: tl.constexpr,
        S: tl.constexpr,
        G: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        PREC: tl.constexpr,
        MOE: tl.constexpr,
        SPLIT: tl.constexpr,
        INTERP: tl.constexpr,
        XT: tl.constexpr,
    ):
        """Dense: rows m of x. MoE: tile pid_m holds up to BM (token, slot) pairs of one expert, listed
        by ``order[tile_start : tile_start + tile_rows]``; tiles past the last have 0 rows.
        PREC 5 / 6 (bf16x3 / bf16x2): the integer-code loop (_int_gemm), for the types of _INT_TYPES.
        SPLIT > 1: program (., ., s) takes the s-th of SPLIT equal parts of K and writes its partial sums
        ``split_stride`` elements after y's start times s (summed by the caller).
        XT (with PREC 5 / 6): x is _split_x's parts and xsum its group sums: _int_gemm_t. PREC 7 (fp16x2,
        with XT): x is _split_x_fold's parts of x times a power of two per row, xsum their group sums in two
        float16 parts, xinv those rows' inverse powers: _fold_gemm_t."""
        pid_m = tl.program_id(1)
        k_lo, k_part = 0, K
        if SPLIT > 1:  # resolved when compiling: the one-part kernel is the one before splits existed
            k_part = K // SPLIT
            k_lo = tl.program_id(2) * k_part
            y += tl.program_id(2) * split_stride
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        nc = tl.minimum(n, N - 1).to(tl.int64)
        r = tl.arange(0, BM)
        rows = M - pid_m * BM
        if MOE:
            rows = tl.load(tile_rows + pid_m)
            if rows == 0:
                return
            e = tl.load(tile_expert + pid_m).to(tl.int64)
            row_off = (e * N + nc) * row_stride
        else:
            row_off = nc * row_stride
        rmask, xrow, yrow = _tile_rows(r, pid_m, rows, order, tile_start, sx_tok, sx_slot, sy, TOPK, BM, MOE)
        if XT:  # x's parts stacked as NP row blocks of one operand: one product per group, parts summed at the end
            NP: tl.constexpr = 4 if PREC == 5 else 2
            PARTS: tl.constexpr = 3 if PREC == 5 else 2
            r4 = tl.arange(0, NP * BM)
            m4, x4, _ = _tile_rows(
                r4 % BM, pid_m, rows, order, tile_start, sx_tok, sx_slot, sy, TOPK, BM, MOE
            )
            part = r4 // BM
            xoff, xmask, smask = x4 + part * x_part, m4 & (part < PARTS), m4 & (part == 0)
            if PREC == 7:  # each part's rows read their part of the group sums
                acc4 = _fold_gemm_t(
                    x, xsum, xoff, x4 // S + part * (x_part // S), xmask, w, row_off, k_lo, k_lo + k_part, TS,
                    NP * BM, BN, QT, INTERP,
                )  # fmt: skip
            else:
                acc4 = _int_gemm_t(
                    x, xsum, xoff, x4 // S, xmask, smask, w, row_off, k_lo, k_lo + k_part, BS, TS, S, NP * BM,
                    BN, QT, INTERP,
                )  # fmt: skip
            acc = tl.sum(tl.reshape(acc4, (BN, NP, BM)), axis=1)
            if PREC == 7:
                acc *= tl.load(xinv + xrow // K, mask=rmask, other=0.0)[None, :]
            tl.store(y + yrow[None, :] + n[:, None], acc, mask=rmask[None, :] & (n[:, None] < N))
        else:
            if PREC >= 5:
                acc = _int_gemm(
                    x, w, xrow, rmask, row_off, k_lo, k_lo + k_part, BS, TS, S, BM, BN, QT, 8 - PREC, INTERP
                )
            else:
                acc = tl.zeros([BM, BN], dtype=tl.float32)
                for k0 in range(k_lo, k_lo + k_part, G * S):
                    bp, jg, si, kg, kmask = _tile_offsets(k0, row_off, K, G, S, BS, TS)
                    wt = tl.reshape(_decode(w, bp, jg, si, kmask, tab, QT), (BN, G * S))
                    k = k0 + tl.arange(0, G * S)
                    xt = tl.load(
                        x + xrow[:, None] + k[None, :], mask=rmask[:, None] & (k[None, :] < K), other=0.0
                    )
                    acc = _dot(xt.to(tl.float32), tl.trans(wt), acc, PREC)
            tl.store(y + yrow[:, None] + n[None, :], acc, mask=rmask[:, None] & (n[None, :] < N))


# ---------------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------------

_TABLES: dict[tuple[int, int | None], torch.Tensor] = {}


def _table(qtype: GGMLQuantizationType, device: torch.device) -> torch.Tensor:
    """The codebook a type decodes through (float32, on ``device``); a 1-value dummy for the others."""
    key = (int(qtype), device.index)
    if key not in _TABLES:
        from gguf import quants as gq

        from runtime import dequant_iquants as iq

        if qtype in (T.IQ4_NL, T.IQ4_XS):
            t = torch.tensor(iq._IQ4_VALUES, dtype=torch.float32)
        elif qtype == T.MXFP4:
            from runtime import dequant_legacy

            t = torch.tensor(dequant_legacy._FP4_LEVELS, dtype=torch.float32)
        elif qtype in (T.IQ2_XXS, T.IQ2_XS, T.IQ3_XXS):
            cls = {T.IQ2_XXS: gq.IQ2_XXS, T.IQ2_XS: gq.IQ2_XS, T.IQ3_XXS: gq.IQ3_XXS}[qtype]
            t = iq._grid(cls, torch.device("cpu")).reshape(-1)
        else:
            t = torch.zeros(1, dtype=torch.float32)
        _TABLES[key] = t.contiguous().to(device)
    return _TABLES[key]


@functools.cache
def _type_facts(qtype: GGMLQuantizationType) -> tuple[int, int, int, torch.dtype | None]:
    """(BS, TS, S, the float dtype a float type's rows hold or None): registry lookups, once a type (a
    product asked for them every call, ~14 lookups a layer of host time)."""
    bs, ts = GGML_QUANT_SIZES[qtype]
    float_dtype = ggml_types.implementation("torch", qtype)
    group = ggml_types.implementation("cuda", qtype).group
    return bs, ts, group, float_dtype if isinstance(float_dtype, torch.dtype) else None


def _geometry(qtype: GGMLQuantizationType, raw: torch.Tensor) -> tuple[torch.Tensor, int, int, int, int, int]:
    """(weights as the kernel reads them, K, row stride in its elements, BS, TS, S)."""
    bs, ts, group, float_dtype = _type_facts(qtype)
    row_bytes = raw.shape[-1]
    if row_bytes % ts:
        raise ValueError(f"{qtype.name}: rows of {row_bytes} bytes are not whole {ts}-byte blocks")
    k = row_bytes // ts * bs
    if float_dtype is not None:
        w = raw.view(float_dtype)
        return w, k, w.shape[-1], 1, 1, group
    return raw, k, row_bytes, bs, ts, group


def _groups(k: int, s: int, bs: int, most: int) -> int:
    """Groups per K-tile: a power of two, at most ``most`` values, whose tiles never straddle K's end
    for block types (the float types mask their last tile)."""
    g = max(1, most // s)
    if bs > 1:
        while g > 1 and k % (g * s):
            g //= 2
    return g


def _fallback(qtype: GGMLQuantizationType, why: str) -> None:
    if qtype.name not in _warned:
        _warned.add(qtype.name)
        log.warning("cuda kernels: %s %s; using torch dequantize + matmul for it", qtype.name, why)


def _reference(x: torch.Tensor, raw: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    from runtime.dequant import dequantize

    bs, ts = GGML_QUANT_SIZES[qtype]
    w = dequantize(raw, qtype, raw.shape[-1] // ts * bs)
    return x.float() @ w.transpose(-1, -2)


def _can_run(x: torch.Tensor, qtype: GGMLQuantizationType) -> bool:
    if not supports(qtype):
        _fallback(qtype, "has no kernel")
        return False
    if triton is None or x.device.type != "cuda":
        return bool(triton is not None and os.environ.get("TRITON_INTERPRET") == "1")
    return True


def linear(
    x: torch.Tensor, raw: torch.Tensor, qtype: GGMLQuantizationType | int, precision: str | None = None
) -> torch.Tensor:
    """x (..., K) @ W.T for W held as GGUF rows ``raw`` uint8 (N, row_bytes) -> float32 (..., N).

    Up to DECODE_TOKENS rows take the GEMV kernel (exact float32 products); more take the GEMM
    kernel at ``precision`` (default: DEFAULT_PRECISION; "auto", "fp16x2", "bf16x3", "tf32x3", "ieee",
    "bf16x2", "tf32", "fp16", "bf16": see UNIT_ROUNDOFF)."""
    qtype = qtype if isinstance(qtype, T) else T(int(qtype))
    raw = raw if raw.is_contiguous() else raw.contiguous()
    lead, kx = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, kx)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    if not _can_run(x, qtype):
        return _reference(x2, raw, qtype).view(*lead, raw.shape[0])
    w, k, stride, bs, ts, s = _geometry(qtype, raw)
    if kx != k:
        raise ValueError(f"linear: x has {kx} values per row, the {qtype.name} weight rows hold {k}")
    n, m = raw.shape[0], x2.shape[0]
    y = torch.empty((m, n), dtype=torch.float32, device=x.device)
    tab = _table(qtype, x.device)
    if m <= DECODE_TOKENS:
        _launch_gemv(x2, w, y, tab, None, n, k, stride, x2.stride(0), 0, n, 1, m, qtype, bs, ts, s)
    else:
        plan = _gemm_plan(qtype, precision, moe=False)
        _launch_gemm(
            x2, w, y, tab, None, m, n, k, stride, x2.stride(0), 0, n, 1, qtype, bs, ts, s, plan, plan.bm
        )
    return y.view(*lead, n)


def moe_linear(
    x: torch.Tensor,
    raw: torch.Tensor,
    qtype: GGMLQuantizationType | int,
    ids: torch.Tensor,
    precision: str | None = None,
    groups: dict | None = None,
) -> torch.Tensor:
    """Every selected expert's product in one launch: out[t, s] = x[t] @ W[ids[t, s]].T.

    ``raw`` uint8 (E, N, row_bytes); ``x`` (T, K) shared by a token's slots or (T, top_k, K), one row
    per slot (the down projection); ``ids`` (T, top_k) integer expert ids on x's device. Returns
    float32 (T, top_k, N). Decode (T * top_k <= 64 pairs) takes the GEMV kernel, one program per
    pair; more pairs are grouped by expert on the device and take the GEMM kernel. ``groups``: a dict the
    caller passes to every product over the same ``ids`` (a layer's gate/up and down) so that the grouping is
    computed once."""
    qtype = qtype if isinstance(qtype, T) else T(int(qtype))
    raw = raw if raw.is_contiguous() else raw.contiguous()
    n_tok, top_k = ids.shape
    e_count, n = raw.shape[0], raw.shape[1]
    per_slot = x.dim() == 3
    if not x.is_contiguous():
        x = x.contiguous()
    if not _can_run(x, qtype):
        w_sel = raw[ids.reshape(-1).long()]
        xs = x.reshape(n_tok * top_k, 1, -1) if per_slot else x.repeat_interleave(top_k, 0).unsqueeze(1)
        return _reference(xs, w_sel, qtype).view(n_tok, top_k, n)
    w, k, stride, bs, ts, s = _geometry(qtype, raw)
    if x.shape[-1] != k:
        raise ValueError(f"moe_linear: x has {x.shape[-1]} values per row, the {qtype.name} rows hold {k}")
    sx_tok = x.stride(0)
    sx_slot = x.stride(1) if per_slot else 0
    y = torch.empty((n_tok, top_k, n), dtype=torch.float32, device=x.device)
    tab = _table(qtype, x.device)
    ids = ids.contiguous()
    pairs = n_tok * top_k
    if pairs <= DECODE_TOKENS * 8:
        _launch_gemv(x, w, y, tab, ids, n, k, stride, sx_tok, sx_slot, n, top_k, 1, qtype, bs, ts, s, pairs)
        return y
    # a tile holds one expert's pairs: about pairs / E of them (16 at prefill 512 of the 35B-A3B)
    plan = _gemm_plan(qtype, precision, moe=True)
    bm = GEMM_CONFIG["bm"] or min(64, max(plan.smallest_tile, _next_pow2(-(-pairs // e_count))))
    key = (e_count, bm)
    maps = groups.get(key) if groups is not None else None
    if maps is None:
        maps = _group_by_expert(ids, e_count, bm)
        if groups is not None:
            groups[key] = maps
    _launch_gemm(x, w, y, tab, maps, 0, n, k, stride, sx_tok, sx_slot, n, top_k, qtype, bs, ts, s, plan, bm)
    return y


def _group_by_expert(
    ids: torch.Tensor, e_count: int, bm: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token, slot) pairs sorted by expert (stably), cut in tiles of <= bm pairs of one expert: one launch on
    the device (_tile_table_kernel) -> (order, tile expert, tile start, tile rows), views of one int32 buffer.

    The tile count is bounded on the host (ceil(pairs / bm) + min(E, pairs)); the spare tiles get 0 rows
    and return at once, so nothing here waits for the device."""
    flat = ids.reshape(-1)
    pairs = flat.numel()
    n_tiles = -(-pairs // bm) + min(e_count, pairs)
    if e_count > GROUP_KERNEL_EXPERTS:
        return _group_by_expert_ops(flat, e_count, bm, n_tiles)
    table = torch.empty(3 * n_tiles + pairs, dtype=torch.int32, device=ids.device)
    grid = (max(_cdiv(n_tiles, 32), e_count),)
    launch(
        _tile_table_kernel,
        grid,
        flat,
        table,
        pairs,
        e_count,
        bm,
        n_tiles,
        EP=_next_pow2(e_count),
        BLOCK=1024,
        BB=32,
    )
    return _table_views(table, n_tiles)


def _group_by_expert_ops(
    flat: torch.Tensor, e_count: int, bm: int, n_tiles: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_group_by_expert``'s table from torch operations (a sort, a scatter, cumulative sums, a search), for
    more experts than the kernel holds per program (a hybrid pool's thousands of slots): the same values,
    and nothing waits for the device either."""
    dev = flat.device
    ids = flat.long()
    counts = torch.zeros(e_count, dtype=torch.int64, device=dev).scatter_add_(0, ids, torch.ones_like(ids))
    tiles = (counts + bm - 1) // bm
    tile_end = torch.cumsum(tiles, 0)
    b = torch.arange(n_tiles, device=dev)
    # the tiles' experts: how many experts' tiles end at or before tile b
    te = torch.searchsorted(tile_end, b, right=True)
    expert = te.clamp(max=e_count - 1)
    row0 = (b - (tile_end[expert] - tiles[expert])) * bm
    rows = torch.where(te >= e_count, 0, (counts[expert] - row0).clamp(0, bm))
    start = torch.cumsum(counts, 0)[expert] - counts[expert] + row0
    order = torch.sort(ids, stable=True).indices
    return _table_views(torch.cat([expert, start, rows, order]).to(torch.int32), n_tiles)


def _table_views(
    table: torch.Tensor, n_tiles: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, tile expert, tile start, tile rows) of a grouping table: three rows of n_tiles, then the order."""
    return (
        table[3 * n_tiles :],
        table[:n_tiles],
        table[n_tiles : 2 * n_tiles],
        table[2 * n_tiles : 3 * n_tiles],
    )


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # triton.cdiv is a jit function in newer Tritons: slow to call from Python


def _next_pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def _as_words(qtype: GGMLQuantizationType, w: torch.Tensor, k: int) -> torch.Tensor | None:
    """The rows viewed as the word kernel's words, or None where it does not apply.

    By default only Q6_K takes it: for Q4_K, Q5_K and Q8_0 the generic kernel measured as fast or
    faster (the word kernel's final 5-axis row sum costs more than it saves); FORGE_CUDA_WORDS=all
    selects it for all four (tests, --sweep), =0 for none."""
    dtype = ggml_types.implementation("cuda", qtype).words
    choice = os.environ.get("FORGE_CUDA_WORDS", "")
    if dtype is None or k % 256 or choice == "0" or (qtype != T.Q6_K and choice != "all"):
        return None
    size = 4 if dtype == torch.int32 else 2
    if w.shape[-1] % size or w.data_ptr() % size or w.stride(-2) % size:
        return None
    return w.view(dtype)


# GEMV tiles: rows per program (MoE / dense) and warps; read at each launch so benchmarks can sweep them.
# None: the measured defaults of _gemv_tiles (benchmarks/cuda_kernels.py --sweep sets them to compare).
GEMV_CONFIG: dict[str, int | None] = {"bn": None, "warps": None, "split": None}


def _gemv_tiles(words: bool, qtype: GGMLQuantizationType, n: int, k: int, nt: int) -> tuple[int, int, int]:
    """(rows per program, warps, K split), from benchmarks/cuda_kernels.py --sweep on the H200 at the
    35B-A3B shapes: the generic kernel takes 16 rows (8 for the types it decodes more slowly below 8192
    rows), the Q6_K word kernel 8 rows and two warps, with K split in four for the small products;
    vocab-sized products take two warps."""
    if words:
        bn, warps = (8 if k >= 1024 else 16), 2
        split = 4 if nt == 1 and n <= 8192 and (k // 256) % 4 == 0 else 1
    else:
        bn = 16 if n > 8192 or qtype in (T.Q4_K, T.Q8_0) else 8
        warps, split = (2 if n > 65536 else 4), 1
    cfg = GEMV_CONFIG
    return cfg["bn"] or bn, cfg["warps"] or warps, (cfg["split"] or split) if words and nt == 1 else 1


def _launch_gemv(x, w, y, tab, ids, n, k, stride, sx_tok, sx_slot, sy, top_k, nt, qtype, bs, ts, s, pairs=0):
    moe = ids is not None
    words = _as_words(qtype, w, k)
    bn, warps, split = _gemv_tiles(words is not None, qtype, n, k, nt)
    if (k // 256) % split:
        split = 1
    if words is not None:
        if split > 1:
            y.zero_()
        launch(
            _gemv_words_kernel,
            (_cdiv(n, bn), pairs if moe else 1, split),
            x,
            words,
            y,
            ids if moe else words,
            n,
            k,
            words.shape[-1],
            sx_tok,
            sx_slot,
            sy,
            TOPK=top_k,
            NT=nt,
            NTP=max(2, _next_pow2(nt)),
            QT=int(qtype),
            BN=bn,
            MOE=moe,
            SPLIT=split,
            num_warps=warps,
        )
        return
    g = _groups(k, s, bs, 256 if nt <= 4 else 128)
    grid = (_cdiv(n, bn), pairs if moe else 1)
    launch(
        _gemv_kernel,
        grid,
        x,
        w,
        y,
        tab,
        ids if moe else tab,
        n,
        k,
        stride,
        sx_tok,
        sx_slot,
        sy,
        TOPK=top_k,
        NT=nt,
        NTP=max(2, _next_pow2(nt)),
        QT=int(qtype),
        BS=bs,
        TS=ts,
        S=s,
        G=g,
        BN=bn,
        MOE=moe,
        num_warps=warps,
    )


# GEMM tiles, read at each launch so the benchmark can sweep them (None: _gemm_plan's).
GEMM_CONFIG: dict[str, int | None] = {
    "bn": None, "warps": None, "stages": None, "bm": None, "split": None, "xt": None
}  # fmt: skip


@contextmanager
def configured(config: dict[str, int | None], **values: int | None) -> Iterator[None]:
    """``values`` set in GEMV_CONFIG or GEMM_CONFIG for the block (benchmarks and tests), then the old ones."""
    old = {key: config[key] for key in values}
    config.update(values)
    try:
        yield
    finally:
        config.update(old)


class GemmPlan(NamedTuple):
    """How a prefill product runs: the kernel's PREC code, weight rows per program, warps, pipeline stages
    (0: Triton's default), the fewest (token, slot) pairs an MoE tile is cut for, and the parts K is split in
    (a program each, their partial sums added after; 1 unless the sweep asks)."""

    prec: int
    bn: int
    warps: int
    stages: int
    smallest_tile: int
    split: int = 1
    #: x split once (_split_x) and the weight rows as the product's rows (_int_gemm_t); integer codes only
    xt: bool = False
    #: dense products: tokens per tile
    bm: int = 128


def _gemm_plan(qtype: GGMLQuantizationType, precision: str | None, moe: bool) -> GemmPlan:
    """The plan of a prefill product of ``qtype`` weights at ``precision`` (None: FORGE_CUDA_PRECISION, else
    DEFAULT_PRECISION).

    From benchmarks/cuda_kernels.py --gemm-sweep on the H200 at the 35B-A3B shapes, 512 tokens: the
    routed-expert products on integer codes (128 rows, 4 warps, 3 stages, 32-pair tiles) took 0.81 ms
    (Q4_K) and 0.66 ms (Q6_K) where the tf32x3 kernel on decoded values took 1.21 and 1.87; for a dense
    product of 512 rows the Q4_K codes were slower (0.23 vs 0.18 ms), the Q6_K ones faster (0.18 vs 0.28).
    Routed products take x split once (xt; FORGE_CUDA_XT=0|1 overrides): at the layer's shapes, Q4_K gate+up
    (1,024 rows) and down 1.30 + 0.64 ms at 64 rows, 4 warps, 3 stages, 32-pair tiles, against 1.49 + 0.70
    for the kernel on x as it is; a whole 40-layer prefill of 512 tokens 119 vs 139 ms. Dense products keep
    x as it is (x split, 128-token tiles: 4x slower). Routed Q4_K / Q5_K products take fp16x2 (one product
    per super-block, _fold_gemm_t): gate+up and down 0.68 + 0.44 ms at 64 rows, 4 warps, 3 stages, 32-pair
    tiles; the whole prefill 76.5 ms. So do dense ones (a 5,120 x 2,048 and a 2,048 x 4,096 Q4_K product:
    0.165 + 0.132 ms at 128 rows, 4 warps, 3 stages, 32-token tiles, against 0.269 + 0.183 on tf32x3; 128-token
    tiles spill). With two codes decoded a register (_fold_codes) the same tiles stay the best: routed
    0.635 + 0.401 ms, dense 0.138 + 0.130."""
    precision = precision or os.environ.get("FORGE_CUDA_PRECISION") or DEFAULT_PRECISION
    if precision == "auto":
        if qtype in _FOLD_TYPES:
            precision = "fp16x2"
        else:
            precision = "bf16x3" if qtype in _INT_TYPES and (moe or qtype == T.Q6_K) else "tf32x3"
    if precision not in _PRECISIONS:
        raise ValueError(f"precision must be one of auto, {', '.join(_PRECISIONS)}, not {precision!r}")
    if precision == "fp16x2" and qtype not in _FOLD_TYPES:
        precision = "bf16x3"  # float32-accurate too (tf32x3 below for the types without integer codes)
    prec = _PRECISIONS[precision]
    if prec in (5, 6) and qtype not in _INT_TYPES:
        prec = _PRECISIONS["tf32x3"]  # float32-accurate too, on the decoded values
    cfg = GEMM_CONFIG
    asked = (
        cfg["xt"] if cfg["xt"] is not None else os.environ.get("FORGE_CUDA_XT", "1" if moe else "0") == "1"
    )
    # the split-x kernel is an integer-code one; fp16x2 exists only on it
    xt = prec == 7 or (prec in (5, 6) and bool(asked))
    if prec == 7 and not moe:
        bn, warps, stages, smallest = 128, 4, 3, 32
    elif xt:
        bn, warps, stages, smallest = 64, 4, 3, 32
    elif prec >= 5:
        bn, warps, stages, smallest = (128, 4, 3, 32) if moe else (64, 4, 2, 32)
    else:  # dense products take 128-row tiles of x, MoE tiles at most 64 pairs
        bn, warps, stages, smallest = 64, (4 if moe else 8), 0, 16
    stages = cfg["stages"] or stages
    bm = cfg["bm"] or (32 if prec == 7 else 128)
    return GemmPlan(prec, cfg["bn"] or bn, cfg["warps"] or warps, stages, smallest, cfg["split"] or 1, xt, bm)


def _launch_gemm(x, w, y, tab, maps, m, n, k, stride, sx_tok, sx_slot, sy, top_k, qtype, bs, ts, s, plan, bm):
    moe = maps is not None
    g = _groups(k, s, bs, 64)
    if g * s < 16:  # tl.dot needs K-tiles of at least 16
        g = max(g, 16 // s)
    order, tile_expert, tile_start, tile_rows = maps if moe else (tab, tab, tab, tab)
    tiles_m = tile_rows.numel() if moe else _cdiv(m, bm)
    fold = plan.prec == 7
    split = plan.split if k % (plan.split * (256 if fold else g * s)) == 0 else 1
    out = y if split == 1 else torch.empty((split, *y.shape), dtype=y.dtype, device=y.device)
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    xsum, x_part, xinv = tab, 0, tab
    if plan.xt:
        x_part = x.numel()
        if fold:
            x, xsum, xinv = _split_x_fold(x, k, interp)
        else:
            x, xsum = _split_x(x, 8 - plan.prec, s, qtype in (T.Q4_K, T.Q5_K), interp)
    launch(
        _gemm_kernel,
        (_cdiv(n, plan.bn), tiles_m, split),
        x,
        w,
        out,
        tab,
        order,
        tile_expert,
        tile_start,
        tile_rows,
        m,
        n,
        k,
        stride,
        sx_tok,
        sx_slot,
        sy,
        y.numel(),
        xsum,
        x_part,
        xinv,
        TOPK=top_k,
        QT=int(qtype),
        BS=bs,
        TS=ts,
        S=s,
        G=g,
        BM=bm,
        BN=plan.bn,
        PREC=plan.prec,
        MOE=moe,
        SPLIT=split,
        INTERP=interp,
        XT=plan.xt,
        num_warps=plan.warps,
        **({"num_stages": plan.stages} if plan.stages else {}),
    )
    if split > 1:
        torch.sum(out, 0, out=y)


def _split_x(
    x: torch.Tensor, parts: int, s: int, sums: bool, interp: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """x float32 -> (its ``parts`` bfloat16 parts, x.numel() apart; float32 sums of each ``s`` values, or a
    1-value dummy) in one launch. The interpreter has no bfloat16 products: float32 parts there (exact)."""
    numel = x.numel()
    out = torch.empty(parts * numel, dtype=torch.float32 if interp else torch.bfloat16, device=x.device)
    group_sums = torch.empty(numel // s if sums else 1, dtype=torch.float32, device=x.device)
    block = 1024
    launch(
        _split_x_kernel,
        (_cdiv(numel, block),),
        x,
        out,
        group_sums,
        numel,
        PARTS=parts,
        S=s,
        SUMS=sums,
        B=block,
    )
    return out, group_sums


def _split_x_fold(x: torch.Tensor, k: int, interp: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x float32 rows of k values -> (_split_x_fold_kernel's two float16 parts, x.numel() apart; the sums of
    each 32 scaled values over 32, two float16 parts; each row's inverse power of two), one program a row.
    Float32 parts under the interpreter (same values)."""
    numel = x.numel()
    rows = numel // k
    out = torch.empty(2 * numel, dtype=torch.float32 if interp else torch.float16, device=x.device)
    group_sums = torch.empty(2 * (numel // 32), dtype=out.dtype, device=x.device)
    inv = torch.empty(rows, dtype=torch.float32, device=x.device)
    launch(_split_x_fold_kernel, (rows,), x, out, group_sums, inv, k, numel, B=min(1024, _next_pow2(k)))
    return out, group_sums, inv
