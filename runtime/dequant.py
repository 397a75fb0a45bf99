"""GGUF tensor data -> torch floats, vectorized with plain torch ops (CPU, CUDA, MPS).

    dequantize(raw, qtype, n_per_row, dtype=torch.float32)

``raw`` is uint8 (..., row_bytes) holding whole rows of ``qtype`` blocks; the result is
(..., n_per_row) on ``raw``'s device. Values are computed in float32 with ggml's order of
operations (bit-identical to llama.cpp's dequantize_row_* and to ``gguf.quants.dequantize``, except
IQ1_M where gguf-py ignores the per-group delta sign; we follow ggml), then cast to ``dtype``.
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from forge import ggml_types
from forge.errors import ForgeError
from runtime import dequant_iquants, dequant_kquants, dequant_legacy  # noqa: F401  (register the decoders)

T = GGMLQuantizationType

# importing the decoder modules registers them (``@block_decoder``); the float types are reinterpreted
for _qtype, _dtype in ((T.F32, torch.float32), (T.F16, torch.float16), (T.BF16, torch.bfloat16)):
    ggml_types.provide("torch", _qtype, _dtype)

# Output values decoded per step: small enough that a step's temporaries stay in the CPU caches,
# large enough that per-op overhead fades (1M was the best of 64K..4M on 1 and 16 threads, measured
# with benchmarks/dequant_speed.py); accelerators get far larger steps.
_CPU_STEP = 1 << 20
_ACCEL_STEP = 1 << 26


def supported_types() -> list[GGMLQuantizationType]:
    """Every GGUF tensor type :func:`dequantize` decodes, by type id."""
    return ggml_types.types_with("torch")


def dequantize(
    raw: torch.Tensor, qtype: GGMLQuantizationType, n_per_row: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """uint8 (..., row_bytes) rows of ``qtype`` -> ``dtype`` (..., n_per_row), on ``raw``'s device."""
    qtype = _known_type(qtype)
    decode = ggml_types.implementation("torch", qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if raw.dtype != torch.uint8:
        raise ForgeError(f"dequantize expects uint8 bytes, got {raw.dtype}")
    if raw.dim() == 0 or n_per_row <= 0 or n_per_row % block_size:
        raise ForgeError(
            f"{qtype.name}: a row of {n_per_row} values is not a whole number of {block_size}-value blocks"
        )
    row_bytes = n_per_row // block_size * type_size
    if raw.shape[-1] != row_bytes:
        raise ForgeError(
            f"{qtype.name}: rows of {n_per_row} values take {row_bytes} bytes, but the data has {raw.shape[-1]} per row"
        )
    out_shape = (*raw.shape[:-1], n_per_row)
    if isinstance(decode, torch.dtype):
        return _reinterpret(raw, decode).to(dtype, copy=True).view(out_shape)

    blocks = raw.reshape(-1, type_size)
    out = torch.empty((blocks.shape[0], block_size), dtype=dtype, device=raw.device)
    step = max(1, (_CPU_STEP if raw.device.type == "cpu" else _ACCEL_STEP) // block_size)
    staging = (
        None
        if dtype == torch.float32
        else torch.empty((min(step, len(blocks)), block_size), device=raw.device)
    )
    for start in range(0, blocks.shape[0], step):
        chunk = blocks[start : start + step]
        if staging is None:
            decode(chunk, out[start : start + step])
        else:
            decode(chunk, staging[: len(chunk)])
            out[start : start + step] = staging[: len(chunk)]
    return out.view(out_shape)


def _known_type(qtype: GGMLQuantizationType | int) -> GGMLQuantizationType:
    try:
        qtype = GGMLQuantizationType(qtype)
    except ValueError:
        raise ForgeError(f"unknown GGUF tensor type id {qtype!r}") from None
    if not ggml_types.supports("torch", qtype):
        names = ", ".join(t.name for t in supported_types())
        raise ForgeError(f"dequantizing tensor type {qtype.name} is not supported (supported: {names})")
    return qtype


def _reinterpret(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bytes of ``raw`` viewed as ``dtype`` along the last axis (copied when misaligned)."""
    try:
        return raw.view(dtype)
    except RuntimeError:
        return raw.contiguous().clone().view(dtype)
