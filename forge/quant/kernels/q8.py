"""Compiled Q8_0 encoder: ggml's ``quantize_row_q8_0_ref`` (roundf, half away from zero)."""

from __future__ import annotations

import numpy as np
from numba import njit

from forge.jit import F32, JIT, put_fp16

QK = 32


@njit(**JIT)
def encode_q8_0(rows: np.ndarray, out: np.ndarray) -> None:
    n_rows, n_per_row = rows.shape
    for r in range(n_rows):
        for b in range(n_per_row // QK):
            x = rows[r, b * QK : (b + 1) * QK]
            y = out[r, b * 34 : (b + 1) * 34]
            amax = F32(0)
            for i in range(QK):
                a = abs(x[i])
                if a > amax:
                    amax = a
            d = amax / F32(127)
            inv = F32(1) / d if d != F32(0) else F32(0)
            put_fp16(y, 0, d)
            for i in range(QK):
                v = x[i] * inv
                t = F32(np.int32(v))  # trunc: |v| <= 127 plus rounding
                frac = v - t
                if frac >= F32(0.5):
                    t += F32(1)
                elif frac <= F32(-0.5):
                    t -= F32(1)
                y[2 + i] = np.int32(t) & 0xFF


def q8_0(rows: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    rows = np.ascontiguousarray(rows, np.float32)
    out = np.empty((rows.shape[0], rows.shape[1] // QK * 34), np.uint8)
    encode_q8_0(rows, out)
    return out
