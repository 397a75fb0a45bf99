"""Byte-level helpers shared by the torch dequantizers (bit unpacking, fp16 fields, lookup tables).

Every decoder takes ``blocks``: uint8 (n_blocks, type_size) and ``out``: float32 (n_blocks, block_size),
contiguous, fills ``out`` and returns it; ``@block_decoder(qtype)`` registers it in the type table
(``forge.ggml_types``, kind ``torch``).
Bit work stays in uint8/int32 (MPS lacks some int64 bit ops); int64 appears only as gather indices.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gguf import GGMLQuantizationType

from forge import ggml_types

Decoder = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def block_decoder(
    qtype: GGMLQuantizationType, fp16_fields: tuple[int, ...] | None = None
) -> Callable[[Decoder], Decoder]:
    """Register the decorated function as ``qtype``'s torch block decoder. ``fp16_fields``: the byte offsets
    of the block's fp16 scales (d, dmin) when every other byte pattern decodes to finite values, so that
    random bytes with small finite scales there are a well-formed block (``runtime.synth.random_blocks``)."""

    def register(decode: Decoder) -> Decoder:
        decode.fp16_fields = fp16_fields  # type: ignore[attr-defined]
        ggml_types.provide("torch", qtype, decode)
        return decode

    return register


def f16_at(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The little-endian fp16 field at byte ``offset`` of each block, as float32 (n_blocks, 1)."""
    try:
        halves = blocks.view(torch.float16)  # one strided column read beats a copy of 2-byte rows
    except RuntimeError:
        return blocks[:, offset : offset + 2].contiguous().view(torch.float16).float()
    return halves[:, offset // 2 : offset // 2 + 1].float()


def f16_from_bytes(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """An fp16 value assembled from two uint8 tensors (low byte, high byte), as float32."""
    return torch.stack((lo, hi), dim=-1).view(torch.float16).squeeze(-1).float()


def u16(b: torch.Tensor) -> torch.Tensor:
    """Pairs of bytes (..., 2k) read as little-endian uint16 values, int32 (..., k)."""
    return b[..., 0::2].int() | (b[..., 1::2].int() << 8)


def u28(b: torch.Tensor) -> torch.Tensor:
    """The low 28 bits of little-endian uint32 values (..., 4k) -> int32 (..., k); fits a signed int."""
    return (
        b[..., 0::4].int()
        | (b[..., 1::4].int() << 8)
        | (b[..., 2::4].int() << 16)
        | ((b[..., 3::4] & 0x0F).int() << 24)
    )


def _fields(blocks: torch.Tensor, start: int, stop: int, width: int) -> list[torch.Tensor]:
    """Bytes [start, stop) of each block split into 8/width fields of ``width`` bits, least significant first.

    Shifts and masks run as one long loop over contiguous bytes (per-block loops over a column range
    are many times slower): over the whole blocks when the range is most of them, else over a
    contiguous copy of the range. The returned (n, stop - start) tensors may be views.
    """
    if 2 * (stop - start) >= blocks.shape[1]:
        src = blocks.contiguous()
    else:
        src, start, stop = blocks[:, start:stop].contiguous(), 0, stop - start
    mask = (1 << width) - 1
    words = _as_words(src)
    out = []
    for shift in range(0, 8, width):
        if words is not None:
            # four bytes per int32 lane; the byte-replicated mask also clears the sign bits the shift drags in
            x = ((words >> shift) & (mask * 0x01010101)).view(torch.uint8).view(src.shape)
        else:
            x = src >> shift if shift else src
            x = x & mask if shift + width < 8 else x
        out.append(x[:, start:stop])
    return out


def _as_words(src: torch.Tensor) -> torch.Tensor | None:
    """A contiguous byte tensor viewed as flat int32 words (bytewise bit ops vectorize far better)."""
    if src.numel() % 4:
        return None
    try:
        return src.view(-1).view(torch.int32)
    except RuntimeError:  # storage offset not 4-byte aligned
        return None


def shift_major(blocks: torch.Tensor, start: int, stop: int, width: int, run: int) -> torch.Tensor:
    """Unpack bytes [start, stop) in runs of ``run`` bytes: per run, every byte's lowest field, then
    every byte's next field, ... (ggml's ``for shift: for l in run: q[l] >> shift`` loops).

    Returns uint8 (n_blocks, (stop - start) * 8 // width).
    """
    n = blocks.shape[0]
    parts = [f.reshape(n, -1, run) for f in _fields(blocks, start, stop, width)]
    return torch.stack(parts, dim=-2).reshape(n, -1)


def byte_major(blocks: torch.Tensor, start: int, stop: int, width: int) -> torch.Tensor:
    """Unpack bytes [start, stop) with each byte's fields adjacent, least significant first.

    Returns uint8 (n_blocks, (stop - start) * 8 // width).
    """
    return torch.stack(_fields(blocks, start, stop, width), dim=-1).reshape(blocks.shape[0], -1)


_TABLES: dict[tuple[str, str], torch.Tensor] = {}


def cached_table(name: str, device: torch.device, build: Callable[[], torch.Tensor]) -> torch.Tensor:
    """A lookup table built once on the CPU and kept per device."""
    key = (name, str(device))
    table = _TABLES.get(key)
    if table is None:
        cpu_key = (name, "cpu")
        if cpu_key not in _TABLES:
            _TABLES[cpu_key] = build()
        table = _TABLES[key] = _TABLES[cpu_key].to(device)
    return table


def _sign_rows(bytes_: torch.Tensor) -> torch.Tensor:
    """(n,) byte values -> (n, 8) float32 of +1/-1: bit j set gives -1 at position j."""
    bits = (bytes_.view(-1, 1) >> torch.arange(8)) & 1
    return (1 - 2 * bits).float()


def byte_signs(device: torch.device) -> torch.Tensor:
    """(256, 8): the eight signs stored as the bits of one byte (IQ2_S, IQ3_S)."""
    return cached_table("byte_signs", device, lambda: _sign_rows(torch.arange(256)))


def parity_signs(device: torch.device) -> torch.Tensor:
    """(128, 8): 7 stored sign bits plus an implied 8th that makes the count of minus signs even.

    This is ggml's ``ksigns_iq2xs`` table (value i | parity(i) << 7), used by IQ2_XXS/IQ2_XS/IQ3_XXS.
    """

    def build() -> torch.Tensor:
        i = torch.arange(128)
        parity = sum((i >> j) & 1 for j in range(7)) & 1
        return _sign_rows(i | (parity << 7))

    return cached_table("parity_signs", device, build)


def high_bits(device: torch.device, shift: int) -> torch.Tensor:
    """(256, 8) uint8: bit j of the byte, moved to bit ``shift`` (one byte of Q5_0/Q5_1's qh)."""
    return cached_table(
        f"high_bits{shift}",
        device,
        lambda: ((torch.arange(256).view(-1, 1) >> torch.arange(8)) & 1).to(torch.uint8) << shift,
    )


def lookup(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[index]`` for an integer index tensor of any shape (rows of a 2-D table are appended)."""
    if table.dim() == 1 or table.device.type != "cuda":
        return table.index_select(0, index.reshape(-1).long()).view(*index.shape, *table.shape[1:])
    # On CUDA a gather of single elements runs about 10x faster than index_select of short rows.
    width = table.shape[1]
    columns = cached_table(f"arange{width}", table.device, lambda: torch.arange(width))
    return table.view(-1).take(index.long().unsqueeze(-1) * width + columns)
