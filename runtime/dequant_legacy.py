"""Torch dequantizers for the 32-element block types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4.

In every type the 16 bytes of nibbles hold element j in the low nibble of byte j and element j+16
in the high nibble. Arithmetic follows ggml's order (``d * q`` or ``d * q + m``) so results are
bit-identical to ggml and to ``gguf.quants``.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T

from runtime.dequant_bits import block_decoder, f16_at, high_bits, lookup, shift_major


def _nibbles32(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """16 bytes of nibbles at ``start`` -> (n, 32) uint8 values: low nibbles first, then high nibbles."""
    return shift_major(blocks, start, start + 16, 4, 16)


def _fifth_bits(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The little-endian uint32 at ``start`` -> (n, 32): bit j is element j's fifth bit, already at bit 4."""
    return lookup(high_bits(blocks.device, 4), blocks[:, start : start + 4]).reshape(-1, 32)


@block_decoder(T.Q4_0, fp16_fields=(0,))
def q4_0(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # fp16 d | 16 B nibbles; x = d * (q - 8)
    q = _nibbles32(blocks, 2).view(torch.int8) - 8
    return torch.mul(f16_at(blocks, 0), q.float(), out=out)


@block_decoder(T.Q4_1, fp16_fields=(0, 2))
def q4_1(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # fp16 d | fp16 m | 16 B nibbles; x = d * q + m
    d, m = f16_at(blocks, 0), f16_at(blocks, 2)
    return torch.add(d * _nibbles32(blocks, 4).float(), m, out=out)


@block_decoder(T.Q5_0, fp16_fields=(0,))
def q5_0(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # fp16 d | uint32 qh (fifth bits) | 16 B nibbles; x = d * (q - 16)
    q = (_nibbles32(blocks, 6) | _fifth_bits(blocks, 2)).view(torch.int8) - 16
    return torch.mul(f16_at(blocks, 0), q.float(), out=out)


@block_decoder(T.Q5_1, fp16_fields=(0, 2))
def q5_1(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # fp16 d | fp16 m | uint32 qh | 16 B nibbles; x = d * q + m
    d, m = f16_at(blocks, 0), f16_at(blocks, 2)
    q = _nibbles32(blocks, 8) | _fifth_bits(blocks, 4)
    return torch.add(d * q.float(), m, out=out)


@block_decoder(T.Q8_0, fp16_fields=(0,))
def q8_0(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # fp16 d | 32 x int8; x = q * d
    return torch.mul(blocks[:, 2:34].view(torch.int8).float(), f16_at(blocks, 0), out=out)


_FP4_LEVELS = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # kvalues_mxfp4: E2M1 values x 2


@block_decoder(T.MXFP4)
def mxfp4(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # E8M0 e | 16 B nibbles (codes into kvalues_mxfp4); x = ggml_e8m0_to_fp32_half(e) * kvalues[q]
    e = blocks[:, :1].int()
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)  # 2^(e-128), subnormal below e = 2
    levels = torch.tensor(_FP4_LEVELS, dtype=torch.float32, device=blocks.device)
    return torch.mul(levels[_nibbles32(blocks, 1).long()], bits.view(torch.float32), out=out)
