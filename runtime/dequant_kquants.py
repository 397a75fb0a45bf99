"""Torch dequantizers for the 256-element K-quant super-blocks: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K.

Layouts are ggml's ``block_q*_K`` structs (ggml-common.h). The quant bytes are consumed in
"shift-major" order: for each 32-byte (or 64-byte) run of bytes, first every byte's lowest field,
then every byte's next field, ..., which :func:`unpack` with ``dim=-2`` reproduces.
Arithmetic follows ggml's order so results are bit-identical to ggml and ``gguf.quants``.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T

from runtime.dequant_bits import block_decoder, f16_at, shift_major


@block_decoder(T.Q2_K, fp16_fields=(80, 82))
def q2_k(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # scales[16] (low nibble: scale, high nibble: min) | qs[64] (2-bit) | fp16 d | fp16 dmin
    sc = blocks[:, 0:16]
    d, dmin = f16_at(blocks, 80), f16_at(blocks, 82)
    dl = (d * (sc & 0x0F).float()).unsqueeze(-1)
    ml = (dmin * (sc >> 4).float()).unsqueeze(-1)
    q = shift_major(blocks, 16, 80, 2, 32).view(-1, 16, 16).float()
    return torch.sub(dl * q, ml, out=out.view(-1, 16, 16))


@block_decoder(T.Q3_K, fp16_fields=(108,))
def q3_k(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # hmask[32] | qs[64] (low 2 bits) | scales[12] (16 x 6-bit) | fp16 d
    # scale i: low 4 bits from byte i%8 (nibble i//8), high 2 bits from byte 8 + i%4 (bits 2*(i//4))
    low = shift_major(blocks, 96, 104, 4, 8)
    high = shift_major(blocks, 104, 108, 2, 4)
    dl = (f16_at(blocks, 108) * ((low | (high << 4)).float() - 32)).unsqueeze(-1)
    q2 = shift_major(blocks, 32, 96, 2, 32)
    hbit = shift_major(blocks, 0, 32, 1, 32)
    # a clear hmask bit subtracts 4: q = q2 - 4 * (1 - hbit)
    q = ((q2 | (hbit << 2)).view(torch.int8) - 4).float().view(-1, 16, 16)
    return torch.mul(dl, q, out=out.view(-1, 16, 16))


def _scales_mins_k4(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 bytes -> 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4), uint8 (n, 8) each.

    Entries 0-3 are the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); entries 4-7 take their
    low 4 bits from bytes 8-11 (low nibble: scale, high nibble: min) and their top 2 bits from the
    top bits of bytes 0-3 (scales) and 4-7 (mins).
    """
    a, b, c = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scales = torch.cat((a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)), dim=-1)
    mins = torch.cat((b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)), dim=-1)
    return scales, mins


def _k4_scale_and_offset(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d, dmin = f16_at(blocks, 0), f16_at(blocks, 2)
    scales, mins = _scales_mins_k4(blocks[:, 4:16])
    return (d * scales.float()).unsqueeze(-1), (dmin * mins.float()).unsqueeze(-1)


@block_decoder(T.Q4_K, fp16_fields=(0, 2))
def q4_k(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # fp16 d | fp16 dmin | scales[12] | qs[128] (nibbles; 32 bytes per pair of 32-element groups)
    dl, ml = _k4_scale_and_offset(blocks)
    q = shift_major(blocks, 16, 144, 4, 32).view(-1, 8, 32).float()
    return torch.sub(dl * q, ml, out=out.view(-1, 8, 32))


@block_decoder(T.Q5_K, fp16_fields=(0, 2))
def q5_k(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # fp16 d | fp16 dmin | scales[12] | qh[32] (bit g of byte l: group g, element l) | qs[128]
    dl, ml = _k4_scale_and_offset(blocks)
    q = (
        (shift_major(blocks, 48, 176, 4, 32) | (shift_major(blocks, 16, 48, 1, 32) << 4))
        .view(-1, 8, 32)
        .float()
    )
    return torch.sub(dl * q, ml, out=out.view(-1, 8, 32))


@block_decoder(T.Q6_K, fp16_fields=(208,))
def q6_k(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # ql[128] (low nibbles) | qh[64] (2-bit high parts) | int8 scales[16] | fp16 d; x = d * s * (q - 32)
    q6 = shift_major(blocks, 0, 128, 4, 64) | (shift_major(blocks, 128, 192, 2, 32) << 4)
    q = (q6.view(torch.int8) - 32).float().view(-1, 16, 16)
    dl = (f16_at(blocks, 208) * blocks[:, 192:208].view(torch.int8).float()).unsqueeze(-1)
    return torch.mul(dl, q, out=out.view(-1, 16, 16))
