"""Torch dequantizers for the i-quants: IQ4_NL, IQ4_XS, IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S,
IQ1_S, IQ1_M.

Layouts are ggml's ``block_iq*`` structs (ggml-common.h). The codebook grids are data: they are
taken from the ``gguf`` package's tables (gguf/quants.py, the same values as ggml's ``iq*_grid``)
once per process and kept per device. Arithmetic follows ggml's order (``db * grid * sign``,
``dl * (grid + delta)``), so results are bit-identical to ggml.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

from runtime.dequant_bits import (
    block_decoder,
    byte_major,
    byte_signs,
    cached_table,
    f16_at,
    f16_from_bytes,
    lookup,
    parity_signs,
    shift_major,
    u16,
    u28,
)

# The non-linear 4-bit codebook of IQ4_NL/IQ4_XS (ggml's kvalues_iq4nl).
_IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# IQ1_S/IQ1_M shift every grid value by +-1/8 (ggml's IQ1S_DELTA).
_IQ1_DELTA = 0.125


def _grid(cls: type, device: torch.device) -> torch.Tensor:
    """A gguf.quants i-quant grid as a float32 (n_entries, group) tensor on ``device``."""

    def build() -> torch.Tensor:
        cls.init_grid()
        return torch.from_numpy(np.ascontiguousarray(cls.grid.reshape(cls.grid_shape), dtype=np.float32))

    return cached_table(cls.__name__, device, build)


def _iq4_values(device: torch.device) -> torch.Tensor:
    return cached_table("iq4nl", device, lambda: torch.tensor(_IQ4_VALUES, dtype=torch.float32))


@block_decoder(T.IQ4_NL, fp16_fields=(0,))
def iq4_nl(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # fp16 d | 16 B nibbles (element j: low nibble of byte j, element j+16: high nibble)
    q = shift_major(blocks, 2, 18, 4, 16)
    return torch.mul(f16_at(blocks, 0), lookup(_iq4_values(blocks.device), q), out=out)


@block_decoder(T.IQ4_XS, fp16_fields=(0,))
def iq4_xs(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # fp16 d | uint16 scales_h (2 bits per group) | scales_l[4] (4 bits per group) | qs[128]
    low = byte_major(blocks, 4, 8, 4)
    high = byte_major(blocks, 2, 4, 2)
    dl = (f16_at(blocks, 0) * ((low | (high << 4)).float() - 32)).unsqueeze(-1)
    q = shift_major(blocks, 8, 136, 4, 16).view(-1, 8, 32)
    return torch.mul(dl, lookup(_iq4_values(blocks.device), q), out=out.view(-1, 8, 32))


def _half_step_scale(d: torch.Tensor, s: torch.Tensor, factor: float) -> torch.Tensor:
    """ggml's ``d * (0.5f + s) * factor`` for 4-bit scales ``s``."""
    return d * (0.5 + s.float()) * factor


def _parity_sign_groups(aux: torch.Tensor) -> torch.Tensor:
    """int32 (n, g) words holding four 7-bit sign indices -> (n, g, 4, 8) signs."""
    idx = torch.stack([(aux >> (7 * k)) & 0x7F for k in range(4)], dim=-1)
    return lookup(parity_signs(aux.device), idx)


@block_decoder(T.IQ2_XXS, fp16_fields=(0,))
def iq2_xxs(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # fp16 d | 8 x (4 grid-index bytes, uint32: 4 x 7 sign bits + 4-bit scale in the top nibble)
    sub = blocks[:, 2:66].reshape(-1, 8, 8)
    db = _half_step_scale(f16_at(blocks, 0), sub[:, :, 7] >> 4, 0.25)
    grid = lookup(_grid(gq.IQ2_XXS, blocks.device), sub[:, :, 0:4])
    signs = _parity_sign_groups(u28(sub[:, :, 4:8]).squeeze(-1))
    return torch.mul(db[:, :, None, None] * grid, signs, out=out.view(-1, 8, 4, 8))


@block_decoder(T.IQ2_XS, fp16_fields=(0,))
def iq2_xs(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # fp16 d | 32 x uint16 (9-bit grid index, 7-bit sign index) | scales[8] (two 4-bit per byte)
    qs = u16(blocks[:, 2:66])
    db = _half_step_scale(f16_at(blocks, 0), byte_major(blocks, 66, 74, 4), 0.25)
    grid = lookup(_grid(gq.IQ2_XS, blocks.device), qs & 0x1FF)
    signs = lookup(parity_signs(blocks.device), qs >> 9)
    return torch.mul(
        db.view(-1, 16, 1, 1) * grid.view(-1, 16, 2, 8), signs.view(-1, 16, 2, 8), out=out.view(-1, 16, 2, 8)
    )


@block_decoder(T.IQ2_S, fp16_fields=(0,))
def iq2_s(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # fp16 d | qs[32] (grid index low 8 bits) | signs[32] | qh[8] (2 high bits each) | scales[8]
    idx = blocks[:, 2:34].int() | (byte_major(blocks, 66, 74, 2).int() << 8)
    db = _half_step_scale(f16_at(blocks, 0), byte_major(blocks, 74, 82, 4), 0.25)
    grid = lookup(_grid(gq.IQ2_S, blocks.device), idx)
    signs = lookup(byte_signs(blocks.device), blocks[:, 34:66])
    return torch.mul(
        db.view(-1, 16, 1, 1) * grid.view(-1, 16, 2, 8), signs.view(-1, 16, 2, 8), out=out.view(-1, 16, 2, 8)
    )


@block_decoder(T.IQ3_XXS, fp16_fields=(0,))
def iq3_xxs(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # fp16 d | qs[64] (grid indices, 4 values each) | 8 x uint32 (4 x 7 sign bits + 4-bit scale)
    aux = blocks[:, 66:98].reshape(-1, 8, 4)
    db = _half_step_scale(f16_at(blocks, 0), aux[:, :, 3] >> 4, 0.5)
    grid = lookup(_grid(gq.IQ3_XXS, blocks.device), blocks[:, 2:66])
    signs = _parity_sign_groups(u28(aux).squeeze(-1))
    return torch.mul(db[:, :, None, None] * grid.view(-1, 8, 4, 8), signs, out=out.view(-1, 8, 4, 8))


@block_decoder(T.IQ3_S, fp16_fields=(0,))
def iq3_s(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # fp16 d | qs[64] (index low 8 bits) | qh[8] (9th bits) | signs[32] | scales[4] (two 4-bit per byte)
    idx = blocks[:, 2:66].int() | (byte_major(blocks, 66, 74, 1).int() << 8)
    scales = byte_major(blocks, 106, 110, 4)
    db = f16_at(blocks, 0) * (1 + 2 * scales.float())
    grid = lookup(_grid(gq.IQ3_S, blocks.device), idx)
    signs = lookup(byte_signs(blocks.device), blocks[:, 74:106])
    return torch.mul(
        db.view(-1, 8, 1, 1) * grid.view(-1, 8, 4, 8), signs.view(-1, 8, 4, 8), out=out.view(-1, 8, 4, 8)
    )


def _iq1_delta(negative: torch.Tensor) -> torch.Tensor:
    return torch.where(negative != 0, -_IQ1_DELTA, _IQ1_DELTA)


@block_decoder(T.IQ1_S, fp16_fields=(0,))
def iq1_s(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # fp16 d | qs[32] (index low 8 bits) | 8 x uint16 qh: 4 x 3 index bits, 3-bit scale, delta sign
    qh = u16(blocks[:, 34:50])
    high = torch.stack([(qh >> (3 * k)) & 7 for k in range(4)], dim=-1).reshape(-1, 32)
    dl = f16_at(blocks, 0) * (2 * ((qh >> 12) & 7) + 1).float()
    delta = _iq1_delta(qh & 0x8000)
    grid = lookup(_grid(gq.IQ1_S, blocks.device), blocks[:, 2:34].int() | (high << 8)).view(-1, 8, 4, 8)
    return torch.mul(dl.view(-1, 8, 1, 1), grid + delta.view(-1, 8, 1, 1), out=out.view(-1, 8, 4, 8))


@block_decoder(T.IQ1_M)
def iq1_m(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # qs[32] | qh[16] (per nibble: 3 index bits + delta sign) | 4 x uint16 scales: 4 x 3-bit scales,
    # and the fp16 super-block scale split over their top nibbles (scale k's top nibble = bits 4k..4k+3)
    top = blocks[:, 49:56:2] >> 4
    d = f16_from_bytes(top[:, 0] | (top[:, 1] << 4), top[:, 2] | (top[:, 3] << 4)).unsqueeze(-1)
    sc = u16(blocks[:, 48:56])
    scales = torch.stack([(sc >> (3 * k)) & 7 for k in range(4)], dim=-1).reshape(-1, 16)
    dl = d * (2 * scales + 1).float()
    nib = byte_major(blocks, 32, 48, 4)
    grid = lookup(_grid(gq.IQ1_S, blocks.device), blocks[:, 0:32].int() | ((nib & 7).int() << 8))
    delta = _iq1_delta(nib & 8)
    return torch.mul(
        dl.view(-1, 16, 1, 1), grid.view(-1, 16, 2, 8) + delta.view(-1, 16, 2, 1), out=out.view(-1, 16, 2, 8)
    )
