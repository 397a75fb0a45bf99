"""MXFP4 (OCP microscaling FP4): 32 values per 17-byte block, llama.cpp's ``quantize_row_mxfp4_ref``.

A block is one E8M0 scale byte ``e`` (a power of two, 2^(e-127)) and 16 bytes of FP4 E2M1 codes: low
nibble element j, high nibble element j+16. ggml keeps the E2M1 values doubled (``FP4_LEVELS``) and
halves the scale instead. The encoder picks ``e`` from the block's largest magnitude and each code as
the level nearest to x (the first one on ties); it never reads importance weights (``quantize_mxfp4``).
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from forge.quant.types import BlockCodec

QK = 32
#: kvalues_mxfp4 (ggml-common.h): the E2M1 values times two, indexed by the 4-bit code.
FP4_LEVELS = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)
_LEVELS_F32 = FP4_LEVELS.astype(np.float32)


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """ggml's ``ggml_e8m0_to_fp32_half``: 2^(e-128) as float32, subnormal for e < 2."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def _scale_exponent(amax: np.ndarray) -> np.ndarray:
    """``amax > 0 ? (uint8_t)(floorf(log2f(amax)) - 2 + 127) : 0``.

    log2f is taken as the float32 rounding of the exact logarithm (float64 here), so a value just
    below a power of two whose logarithm rounds up to the integer gets that exponent, as in C."""
    with np.errstate(divide="ignore"):
        log2 = np.log2(amax.astype(np.float64)).astype(np.float32)
    e = np.floor(np.where(amax > 0, log2, np.float32(0))).astype(np.int64) + 125
    return np.where(amax > 0, e & 0xFF, 0).astype(np.uint8)


def encode_mxfp4(rows: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    blocks = rows.reshape(-1, QK)
    e = _scale_exponent(np.abs(blocks).max(axis=1))
    d = e8m0_half(e)
    err = np.abs((_LEVELS_F32[None, :] * d[:, None])[:, None, :] - blocks[:, :, None])
    codes = err.argmin(axis=2).astype(np.uint8)
    qs = codes[:, : QK // 2] | (codes[:, QK // 2 :] << np.uint8(4))
    return np.concatenate([e[:, None], qs], axis=1).reshape(rows.shape[0], -1)


class MXFP4(BlockCodec):
    ggml_type = T.MXFP4
    _encode_chunk = staticmethod(encode_mxfp4)
