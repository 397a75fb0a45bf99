"""Compiled (numba) decoders of one encoded row to float32 and dot products straight from its bytes, for
the CPU kernels' weights kept encoded (dense weights and routed experts alike): a row is decoded into a small
buffer and consumed at once, or multiplied without decoding, never stored whole as float32.

The float operations are ggml's ``dequantize_row_*`` (and ``gguf.quants``) in the same order, without
fastmath, so a decoded row equals ``runtime.dequant.dequantize``'s bit for bit (tests).

Caveat when editing: numba's disk cache of the kernels in ``runtime.cpu_kernels`` that call
``decode_row`` is invalidated by changes to that file only; after editing this one, delete
``runtime/__pycache__/*.nbi``.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q
from numba import njit

from forge import ggml_types
from forge.jit import FAST_JIT as _FAST
from forge.jit import at, bits_f32, fp16_to_f32, i8_f32, prefetch, put, u8_field, u16_at
from runtime import cpu_q8, cpu_vnni

# the types whose rows ``decode_row`` decodes and ``dot_row`` multiplies (the float types, those of the
# common K-quant mixes and MXFP4), registered in the type table (kind ``cpu_rows``) under the id they take
_ROW_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4)
_F32, _F16, _BF16, _Q8_0, _Q4_K, _Q5_K, _Q6_K, _MXFP4 = (int(t) for t in _ROW_TYPES)
for _t in _ROW_TYPES:
    ggml_types.provide("cpu_rows", _t, int(_t))
_JIT = {"cache": True, "nogil": True, "error_model": "numpy"}
F32 = np.float32
#: ggml's kvalues_mxfp4 (the FP4 E2M1 values times two, by 4-bit code)
_FP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)


@njit(inline="always", **_JIT)
def _bits(u: int) -> float:
    """The float32 with bit pattern ``u`` (0 <= u < 2**32)."""
    return bits_f32(np.int32(u - (np.int64(1) << 32) if u >= 0x80000000 else u))


@njit(inline="always", **_JIT)
def _decode_k4(b: np.ndarray, out: np.ndarray, block_bytes: int, qs_at: int, qh_at: int) -> None:
    """Q4_K (qh_at < 0) and Q5_K rows: fp16 d, dmin, 12 scale bytes, [32 high-bit bytes at qh_at], nibbles."""
    for blk in range(out.shape[0] // 256):
        o, y = block_bytes * blk, 256 * blk
        d, dmin = fp16_to_f32(u16_at(b, o)), fp16_to_f32(u16_at(b, o + 2))
        for j in range(4):
            sc, m = cpu_q8.scale_min_k4(2 * j, b, o + 4)
            d1, m1 = d * F32(sc), dmin * F32(m)
            sc, m = cpu_q8.scale_min_k4(2 * j + 1, b, o + 4)
            d2, m2 = d * F32(sc), dmin * F32(m)
            q, ya = o + qs_at + 32 * j, y + 64 * j
            if qh_at >= 0:
                for lane in range(32):
                    v, h = at(b, q + lane), at(b, o + qh_at + lane)
                    lo = u8_field(v, 0, 15) + F32(16) * u8_field(h, 2 * j, 1)  # exact: small integers
                    hi = u8_field(v, 4, 15) + F32(16) * u8_field(h, 2 * j + 1, 1)
                    put(out, ya + lane, d1 * lo - m1)
                    put(out, ya + 32 + lane, d2 * hi - m2)
            else:
                for lane in range(32):
                    v = at(b, q + lane)
                    put(out, ya + lane, d1 * u8_field(v, 0, 15) - m1)
                    put(out, ya + 32 + lane, d2 * u8_field(v, 4, 15) - m2)


@njit(inline="always", **_JIT)
def _e8m0_half(e: int) -> float:
    """ggml_e8m0_to_fp32_half: 2^(e-128), subnormal for e < 2."""
    return _bits(np.int64(0x00200000) << e if e < 2 else (e - 1) << 23)


@njit(inline="always", **_JIT)
def _q6_scales(b: np.ndarray, sc: int, d: float) -> tuple[float, float, float, float]:
    """Q6_K: the four 32-value parts' scales of one 16-lane group, times d (sc: the group's first scale byte)."""
    return d * i8_f32(b[sc]), d * i8_f32(b[sc + 2]), d * i8_f32(b[sc + 4]), d * i8_f32(b[sc + 6])


@njit(inline="always", **_JIT)
def _q6_lane(b: np.ndarray, la: int, lh: int) -> tuple[float, float, float, float]:
    """Q6_K: the four quants (minus 32) of one lane, from its low-nibble bytes at la, la + 32 and high bits at lh."""
    a, c, h = at(b, la), at(b, la + 32), at(b, lh)
    return (
        u8_field(a, 0, 15) + F32(16) * u8_field(h, 0, 3) - F32(32),
        u8_field(c, 0, 15) + F32(16) * u8_field(h, 2, 3) - F32(32),
        u8_field(a, 4, 15) + F32(16) * u8_field(h, 4, 3) - F32(32),
        u8_field(c, 4, 15) + F32(16) * u8_field(h, 6, 3) - F32(32),
    )


@njit(**_JIT)
def decode_row(b: np.ndarray, qtype: int, out: np.ndarray) -> None:
    """Decode the encoded row ``b`` (uint8) of ``qtype`` (a ``cpu_rows`` type's id) into ``out`` (float32)."""
    n = out.shape[0]
    if qtype == _F32:
        for j in range(n):
            out[j] = _bits(u16_at(b, 4 * j) | (u16_at(b, 4 * j + 2) << 16))
    elif qtype == _F16:
        for j in range(n):
            out[j] = fp16_to_f32(u16_at(b, 2 * j))
    elif qtype == _BF16:
        for j in range(n):
            out[j] = _bits(u16_at(b, 2 * j) << 16)
    elif qtype == _Q8_0:
        for blk in range(n // 32):
            o = 34 * blk
            d = fp16_to_f32(u16_at(b, o))
            for j in range(32):
                put(out, 32 * blk + j, i8_f32(at(b, o + 2 + j)) * d)
    elif qtype == _Q4_K:
        _decode_k4(b, out, 144, 16, -1)
    elif qtype == _Q5_K:
        _decode_k4(b, out, 176, 48, 16)
    elif qtype == _Q6_K:
        for blk in range(n // 256):
            o, y = 210 * blk, 256 * blk
            d = fp16_to_f32(u16_at(b, o + 208))
            for half in range(2):
                ql, qh, sc, yh = o + 64 * half, o + 128 + 32 * half, o + 192 + 8 * half, y + 128 * half
                for g in range(2):  # lanes 16 g .. 16 g + 15 of each of the four 32-value parts share a scale
                    c1, c2, c3, c4 = _q6_scales(b, sc + g, d)
                    la, lh, yg = ql + 16 * g, qh + 16 * g, yh + 16 * g
                    for lane in range(16):
                        q1, q2, q3, q4 = _q6_lane(b, la + lane, lh + lane)
                        put(out, yg + lane, c1 * q1)
                        put(out, yg + 32 + lane, c2 * q2)
                        put(out, yg + 64 + lane, c3 * q3)
                        put(out, yg + 96 + lane, c4 * q4)
    elif qtype == _MXFP4:
        for blk in range(n // 32):
            o = 17 * blk
            d = _e8m0_half(np.int64(b[o]))
            for j in range(16):
                q = np.int64(b[o + 1 + j])
                out[32 * blk + j] = _FP4[q & 0xF] * d
                out[32 * blk + 16 + j] = _FP4[q >> 4] * d


# dot products straight from encoded rows --------------------------------------------------------------------
# sum_j x_j * (d * sc * q_j - dmin * m) = sum_j (d * sc * q_j) x_j - dmin * m * sum_j x_j: the per-32 sums of x
# (``xsum``) are computed once per input. The inner loops run over a block's lanes and add into an accumulator
# of 32 (or 16) lanes (``lanes``, in the caller's scratch) that is summed once per row: a loop that reduces to one float per
# 32 values would end every block in a horizontal sum. Loads in them go through ``at`` (no wraparound check,
# which would turn vector loads into gathers), and bytes are unpacked on 8 bits (``u8_field``).


@njit(**_FAST)
def group_sums(x: np.ndarray, out: np.ndarray) -> None:
    """out[g] = sum of x[32 g : 32 g + 32] (out: at least len(x) / 32 values)."""
    for g in range(x.shape[0] // 32):
        s = F32(0)
        xg = x[32 * g : 32 * g + 32]
        for j in range(32):
            s += xg[j]
        out[g] = s


#: the forms of a prepared input (``prepare_input``): its float sums per 32 only (K-quant rows times x in
#: float32); with llama.cpp's 8-bit Q8_K form (``runtime.cpu_q8``); with the 22-bit integer form on AVX-512
#: VNNI hosts (``runtime.cpu_vnni``). FLOAT_ACTS is 0: a kernel over float32 rows and encoded rows takes the
#: encoded rows' form as ``a.acts or b.acts``
FLOAT_ACTS, Q8_ACTS, X22_ACTS = 0, 1, 2


def activation_form() -> int:
    """The form the CPU kernels' K-quant rows take their inputs in: ``--q8-activations``' 8 bits when asked,
    else 22-bit integers where the host has AVX-512 VNNI (``FORGE_NO_VNNI=1`` keeps float32)."""
    if cpu_q8.enabled():
        return Q8_ACTS
    return X22_ACTS if cpu_vnni.enabled() else FLOAT_ACTS


def describe_form(acts: int) -> str:
    """What ``--stats`` says of the CPU kernels' inputs."""
    return {
        FLOAT_ACTS: "float32 activations",
        Q8_ACTS: "8-bit activations (--q8-activations, llama.cpp's numerics)",
        X22_ACTS: "22-bit integer activations (AVX-512 VNNI; FORGE_NO_VNNI=1 for float32)",
    }[acts]


@njit(inline="always", **_FAST)
def prepared_size(n: int, acts: int) -> int:
    """Length of the prepared input of an n-value vector in form ``acts``: its sums per 32 values, then (n a
    multiple of 256) the Q8_K or 22-bit form."""
    if n % 256:
        return n // 32
    if acts == Q8_ACTS:
        return n // 32 + cpu_q8.prepared_size(n)
    return n // 32 + (cpu_vnni.prepared_size(n) if acts == X22_ACTS else 0)


@njit(**_FAST)
def prepare_into(x: np.ndarray, xp: np.ndarray) -> None:
    """Fill ``xp`` (``prepared_size(len(x), acts)`` values) with what ``dot_row`` takes with x: its sums per 32
    values, then the form xp has room for."""
    n = x.shape[0]
    group_sums(x, xp)
    if cpu_q8.has_q8(xp, n):
        cpu_q8.quantize_q8_k(x, xp)
    elif cpu_vnni.has_x22(xp, n):
        cpu_vnni.quantize_x22(x, xp, n // 32)


@njit(**_FAST)
def prepare_input(x: np.ndarray, acts: int) -> np.ndarray:
    """``prepare_into`` a new array of form ``acts``."""
    xp = np.empty(prepared_size(x.shape[0], acts), np.float32)
    prepare_into(x, xp)
    return xp


@njit(inline="always", **_FAST)
def _zero(acc: np.ndarray) -> None:
    for lane in range(acc.shape[0]):
        acc[lane] = 0


@njit(inline="always", **_FAST)
def _total(acc: np.ndarray) -> float:
    s = F32(0)
    for lane in range(acc.shape[0]):
        s += acc[lane]
    return s


@njit(inline="always", **_FAST)
def _dot_q8_0(b: np.ndarray, x: np.ndarray, scratch: np.ndarray) -> float:
    lanes = scratch[:32]
    _zero(lanes)
    for blk in range(x.shape[0] // 32):
        o, y = 34 * blk, 32 * blk
        d = fp16_to_f32(u16_at(b, o))
        for lane in range(32):
            lanes[lane] += d * i8_f32(at(b, o + 2 + lane)) * at(x, y + lane)
    return _total(lanes)


@njit(inline="always", **_FAST)
def _dot_mxfp4(b: np.ndarray, x: np.ndarray) -> float:
    acc = F32(0)
    for blk in range(x.shape[0] // 32):
        o = 17 * blk
        s = F32(0)
        for j in range(16):
            q = np.int32(b[o + 1 + j])
            s += _FP4[q & 0xF] * x[32 * blk + j] + _FP4[q >> 4] * x[32 * blk + 16 + j]
        acc += _e8m0_half(np.int64(b[o])) * s
    return acc


@njit(inline="always", **_FAST)
def _k4_lane(b: np.ndarray, q: int) -> tuple[np.uint8, np.uint8, np.uint8, np.uint8]:
    """A lane's four nibble bytes in a K-quant block (one per pair of groups), from b[q]."""
    return at(b, q), at(b, q + 32), at(b, q + 64), at(b, q + 96)


@njit(inline="always", **_FAST)
def _k5_high(h: np.uint8, bit: int) -> float:
    """16 times bit ``bit`` of a Q5_K high-bit byte."""
    return F32(16) * u8_field(h, bit, 1)


@njit(inline="always", **_FAST)
def _dot_k4(
    b: np.ndarray,
    x: np.ndarray,
    xsum: np.ndarray,
    scratch: np.ndarray,
    block_bytes: int,
    qs_at: int,
    qh_at: int,
) -> float:
    """Q4_K (qh_at < 0) and Q5_K rows: fp16 d, dmin, 12 scale bytes, then [32 high-bit bytes at qh_at], nibbles.

    A block is one vectorized loop over its 32 byte lanes, each lane taking its value of all 8 groups, the sum
    of the 8 products written as a tree: the block's scales are decoded once (``scale_min_k4`` with constant
    groups: its branch folds away), not per pair of groups with the aliasing checks of a loop each, and the
    additions do not wait on one another (1.2x on this CPU)."""
    lanes = scratch[:32]
    _zero(lanes)
    mins = F32(0)
    for blk in range(x.shape[0] // 256):
        o, y, g = block_bytes * blk, 256 * blk, 8 * blk
        d, dmin = fp16_to_f32(u16_at(b, o)), fp16_to_f32(u16_at(b, o + 2))
        (s0, m0), (s1, m1) = cpu_q8.scale_min_k4(0, b, o + 4), cpu_q8.scale_min_k4(1, b, o + 4)
        (s2, m2), (s3, m3) = cpu_q8.scale_min_k4(2, b, o + 4), cpu_q8.scale_min_k4(3, b, o + 4)
        (s4, m4), (s5, m5) = cpu_q8.scale_min_k4(4, b, o + 4), cpu_q8.scale_min_k4(5, b, o + 4)
        (s6, m6), (s7, m7) = cpu_q8.scale_min_k4(6, b, o + 4), cpu_q8.scale_min_k4(7, b, o + 4)
        mins += dmin * (
            (F32(m0) * xsum[g] + F32(m1) * xsum[g + 1]) + (F32(m2) * xsum[g + 2] + F32(m3) * xsum[g + 3])
        ) + dmin * (
            (F32(m4) * xsum[g + 4] + F32(m5) * xsum[g + 5]) + (F32(m6) * xsum[g + 6] + F32(m7) * xsum[g + 7])
        )
        c0, c1, c2, c3 = d * F32(s0), d * F32(s1), d * F32(s2), d * F32(s3)
        c4, c5, c6, c7 = d * F32(s4), d * F32(s5), d * F32(s6), d * F32(s7)
        q = o + qs_at
        if qh_at >= 0:
            for lane in range(32):
                v0, v1, v2, v3 = _k4_lane(b, q + lane)
                h = at(b, o + qh_at + lane)
                lanes[lane] += (
                    (c0 * (u8_field(v0, 0, 15) + _k5_high(h, 0)) * at(x, y + lane)
                     + c1 * (u8_field(v0, 4, 15) + _k5_high(h, 1)) * at(x, y + 32 + lane))
                    + (c2 * (u8_field(v1, 0, 15) + _k5_high(h, 2)) * at(x, y + 64 + lane)
                       + c3 * (u8_field(v1, 4, 15) + _k5_high(h, 3)) * at(x, y + 96 + lane))
                ) + (
                    (c4 * (u8_field(v2, 0, 15) + _k5_high(h, 4)) * at(x, y + 128 + lane)
                     + c5 * (u8_field(v2, 4, 15) + _k5_high(h, 5)) * at(x, y + 160 + lane))
                    + (c6 * (u8_field(v3, 0, 15) + _k5_high(h, 6)) * at(x, y + 192 + lane)
                       + c7 * (u8_field(v3, 4, 15) + _k5_high(h, 7)) * at(x, y + 224 + lane))
                )  # fmt: skip
        else:
            for lane in range(32):
                v0, v1, v2, v3 = _k4_lane(b, q + lane)
                lanes[lane] += (
                    (c0 * u8_field(v0, 0, 15) * at(x, y + lane) + c1 * u8_field(v0, 4, 15) * at(x, y + 32 + lane))
                    + (c2 * u8_field(v1, 0, 15) * at(x, y + 64 + lane) + c3 * u8_field(v1, 4, 15) * at(x, y + 96 + lane))
                ) + (
                    (c4 * u8_field(v2, 0, 15) * at(x, y + 128 + lane) + c5 * u8_field(v2, 4, 15) * at(x, y + 160 + lane))
                    + (c6 * u8_field(v3, 0, 15) * at(x, y + 192 + lane) + c7 * u8_field(v3, 4, 15) * at(x, y + 224 + lane))
                )  # fmt: skip
    return _total(lanes) - mins


@njit(inline="always", **_FAST)
def _dot_q6_k(b: np.ndarray, x: np.ndarray, scratch: np.ndarray) -> float:
    lanes = scratch[:16]
    _zero(lanes)
    for blk in range(x.shape[0] // 256):
        o, y = 210 * blk, 256 * blk
        d = fp16_to_f32(u16_at(b, o + 208))
        for half in range(2):
            ql, qh, sc, yh = o + 64 * half, o + 128 + 32 * half, o + 192 + 8 * half, y + 128 * half
            for g in range(2):  # lanes 16 g .. 16 g + 15 of each of the four 32-value parts share a scale
                c1, c2, c3, c4 = _q6_scales(b, sc + g, d)
                la, lh, xg = ql + 16 * g, qh + 16 * g, yh + 16 * g
                for lane in range(16):
                    q1, q2, q3, q4 = _q6_lane(b, la + lane, lh + lane)
                    lanes[lane] += (
                        c1 * q1 * at(x, xg + lane)
                        + c2 * q2 * at(x, xg + 32 + lane)
                        + c3 * q3 * at(x, xg + 64 + lane)
                        + c4 * q4 * at(x, xg + 96 + lane)
                    )
    return _total(lanes)


@njit(inline="always", **_FAST)
def prefetch_row(b: np.ndarray) -> None:
    """Start loading a row (encoded or float32) that a dot product will read next: the hardware prefetcher alone leaves
    these kernels waiting on memory (a Q4_K product over a 37 MB matrix ran at half its in-cache speed)."""
    for c in range(0, b.shape[0], 64 // b.itemsize):
        prefetch(b, c)


@njit(inline="always", **_FAST)
def dot_row(b: np.ndarray, qtype: int, x: np.ndarray, xsum: np.ndarray, buf: np.ndarray) -> float:
    """sum_j row_j * x_j for the encoded row ``b`` of ``qtype``; xsum: ``prepare_input(x, acts)`` (the sums per 32
    values, and the Q8_K or 22-bit form that K-quant rows are multiplied with instead of x); buf: scratch of len(x)
    (at least 32). The 22-bit K-quant products are compiled into the caller (a call per row cost a third of
    one: ~50 ns), every other row takes one call."""
    n = x.shape[0]
    if cpu_vnni.has_x22(xsum, n) and qtype in (_Q4_K, _Q5_K, _Q6_K):
        return cpu_vnni.dot_k(b, qtype, xsum, n // 32, n)
    return _dot_row(b, qtype, x, xsum, buf)


@njit(**_FAST)
def _dot_row(b: np.ndarray, qtype: int, x: np.ndarray, xsum: np.ndarray, buf: np.ndarray) -> float:
    """``dot_row`` of a row on float32 or Q8_K inputs: each type's product compiled in (one call per row)."""
    n = x.shape[0]
    if cpu_q8.has_q8(xsum, n):  # K-quant rows take the 8-bit input
        if qtype in (_Q4_K, _Q5_K):
            return cpu_q8.dot_k(b, xsum, n, qtype == _Q5_K)
        if qtype == _Q6_K:
            return cpu_q8.dot_q6_k(b, xsum, n)
    if qtype == _Q4_K:
        return _dot_k4(b, x, xsum, buf, 144, 16, -1)
    if qtype == _Q6_K:
        return _dot_q6_k(b, x, buf)
    if qtype == _Q5_K:
        return _dot_k4(b, x, xsum, buf, 176, 48, 16)
    if qtype == _Q8_0:
        return _dot_q8_0(b, x, buf)
    if qtype == _MXFP4:
        return _dot_mxfp4(b, x)
    decode_row(b, qtype, buf)
    s = F32(0)
    for j in range(x.shape[0]):
        s += buf[j] * x[j]
    return s
