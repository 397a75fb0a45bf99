"""IQ4_NL and IQ4_XS on torch: the same 16-candidate scale search, in the same float32 order, as codecs/iq4.py."""

from __future__ import annotations

from functools import cache

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from forge.quant.codecs.iq4 import _FLOORS, _HI_VAL, _LO_VAL, _NTRY, _UPPER
from forge.quant.torch_codecs import device_encoder, ops

LEVEL0 = -127.0  # kvalues_iq4nl[0]


@cache
def _tables(device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """best_index_int8 by table, indexed by floor(al) + 128 (codecs/iq4.py): upper index, lower and upper level."""

    def t(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(np.ascontiguousarray(a)).to(device=device, dtype=dtype)

    assert _FLOORS[0] == -128
    return t(_UPPER, torch.int64), t(_LO_VAL, torch.float32), t(_HI_VAL, torch.float32)


def _pick(al: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index, level value) of the level best_index_int8 picks for each al (codecs/iq4._best_level)."""
    upper, lo_val, hi_val = _tables(str(al.device))
    top = ops.scalar(113.0, al)  # NaN (an overflowed search) ends at the top, as ggml's binary search
    slot = (
        (torch.floor(torch.where(torch.isnan(al), top, al)).clamp_(-128, 113) + 128)
        .to(torch.int64)
        .reshape(-1)
    )
    lo = lo_val[slot].reshape(al.shape)
    hi = hi_val[slot].reshape(al.shape)
    up = ~(al - lo < hi - al)
    index = upper[slot].reshape(al.shape) - 1 + up.to(torch.int64)
    return index, torch.where(up, hi, lo)


def _block_scales(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Best scale per 32-value block (codecs/iq4._block_scales). x, w: (32, B). d (B,), 0 for all-zero blocks."""
    vmax = ops.first_absmax(x)
    live = vmax.abs() >= ops.GROUP_MAX_EPS
    safe_max = torch.where(live, vmax, ops.scalar(1.0, x))
    zero = ops.scalar(0.0, x)

    def trial(inv_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = _pick(inv_scale * x)[1]
        wq = w * q
        return ops.seq_sum(wq * x), ops.seq_sum(wq * q)

    d0 = ops.div(-safe_max, LEVEL0)
    sumqx, sumq2 = trial(ops.div(1.0, d0))
    d = torch.where(sumq2 > 0, ops.div(sumqx, sumq2), zero)
    best = d * sumqx
    for itry in range(-_NTRY, _NTRY + 1):
        sumqx, sumq2 = trial(ops.div(float(np.float32(itry) + np.float32(LEVEL0)), safe_max))
        better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        d_new = ops.div(sumqx, sumq2)
        d = torch.where(better, d_new, d)
        best = torch.where(better, d_new * sumqx, best)
    return torch.where(live, d, zero)


def _weights(x: torch.Tensor, importance: torch.Tensor | None, n_rows: int, block: int) -> torch.Tensor:
    """x² without importance, else qw * sqrt(2/n·Σx² + x²) (sums over the position-major block x (block, B))."""
    if importance is None:
        return x * x
    sigma2 = ops.seq_sum(x * x) * ops.scalar(2.0 / block, x)
    qw = ops.importance_t(importance, n_rows, block)
    return qw * ops.sqrt(sigma2 + x * x)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d != 0, ops.div(1.0, d), ops.scalar(0.0, d))


def _pack_nibbles(levels: torch.Tensor) -> torch.Tensor:
    """levels (32, B) -> (B, 16) bytes: byte j = level j | level j+16 << 4."""
    return (levels[:16] | (levels[16:] << 4)).t().to(torch.uint8)


@device_encoder(T.IQ4_NL, bytes_per_elem=128)
def encode_iq4_nl(rows: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    n_rows = rows.shape[0]
    x = ops.to_t(rows.reshape(-1, 32))
    d = _block_scales(x, _weights(x, importance, n_rows, 32))
    levels = _pick(_inverse(d) * x)[0]
    return torch.cat([ops.fp16_bytes(d), _pack_nibbles(levels)], dim=1).reshape(n_rows, -1)


@device_encoder(T.IQ4_XS, bytes_per_elem=128)
def encode_iq4_xs(rows: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    n_rows = rows.shape[0]
    xs = ops.to_t(rows.reshape(-1, 256))  # (256, S)
    n_super = xs.shape[1]
    ws = _weights(xs, importance, n_rows, 256)

    def sub_blocks(a: torch.Tensor) -> torch.Tensor:
        """(256, S) -> (32, 8*S): column ib*S + s is sub-block ib of super-block s."""
        return a.reshape(8, 32, n_super).permute(1, 0, 2).reshape(32, -1)

    x = sub_blocks(xs)
    del xs
    scales = _block_scales(x, sub_blocks(ws)).reshape(8, n_super)
    del ws
    max_scale = ops.first_absmax(scales)
    d = ops.div(-max_scale, 32.0)
    ls = ops.nearest_int(_inverse(d) * scales).clamp_(-32, 31)  # (8, S)
    dl = d * ls.to(torch.float32)
    levels = _pick(_inverse(dl).reshape(1, -1) * x)[0]  # (32, 8*S)
    ls_u = ls + 32  # 6 bits: low nibble in scales_l, top 2 bits in scales_h
    shifts = 2 * torch.arange(8, device=ls.device, dtype=torch.int32)[:, None]
    scales_h = ((ls_u >> 4) << shifts).sum(dim=0)  # disjoint bits: the sum is the OR
    scales_l = (ls_u[0::2] & 15) | ((ls_u[1::2] & 15) << 4)  # (4, S)
    nib = _pack_nibbles(levels).reshape(8, n_super, 16).permute(1, 0, 2).reshape(n_super, 128)
    parts = [
        ops.fp16_bytes(d, nan_negated=True),  # d = -max_scale / 32
        torch.stack([scales_h & 0xFF, scales_h >> 8], dim=1).to(torch.uint8),
        scales_l.t().to(torch.uint8),
        nib,
    ]
    return torch.cat(parts, dim=1).reshape(n_rows, -1)
