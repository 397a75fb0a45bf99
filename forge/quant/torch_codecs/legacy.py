"""Q8_0 on torch: the same steps as codecs/legacy.py (it never reads importance)."""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T

from forge.quant.torch_codecs import device_encoder, ops

QK = 32


def _c_roundf(v: torch.Tensor) -> torch.Tensor:
    """C ``roundf``: halves away from zero (v - trunc(v) is exact)."""
    r = torch.trunc(v)
    frac = v - r
    return r + (frac >= 0.5).to(torch.float32) - (frac <= -0.5).to(torch.float32)


@device_encoder(T.Q8_0, bytes_per_elem=24)
def encode_q8_0(rows: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    blocks = rows.reshape(-1, QK)
    d = ops.div(blocks.abs().amax(dim=1), 127.0)
    inv = torch.where(d != 0, ops.div(1.0, d), ops.scalar(0.0, d))
    q = _c_roundf(blocks * inv[:, None]).to(torch.int32) & 0xFF
    return torch.cat([ops.fp16_bytes(d), q.to(torch.uint8)], dim=1).reshape(rows.shape[0], -1)
