"""The cpu backend: the compiled (numba) kernels of ``runtime.cpu_kernels``.

``routed_ffn``'s one-token step (the residual folded in) runs one kernel call over the records the
expert source hands out: encoded rows (per use, mapped from the file; streamed, in the cache's slots)
or the resident experts' float32 rows. Batches (prefill) go to the torch reference until the CPU has
encoded-row prefill kernels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from runtime import cpu_kernels
from runtime.backends import torch_backend

if TYPE_CHECKING:
    from runtime.moe import ExpertSource, Taps

NAME = "cpu"


def routed_ffn(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    source: ExpertSource,
    taps: Taps,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """As ``torch_backend.routed_ffn``; the kernels serve one token with a residual (a decode step)."""
    if residual is None or x.shape[0] != 1:
        return torch_backend.routed_ffn(x, ids, weights, source, taps, residual)
    ids, w = ids[0], weights[0]
    with source.records(ids) as (records, index):
        if isinstance(records, cpu_kernels.EncodedExperts):
            out, act = cpu_kernels.routed_ffn_encoded(x, index, w, records, residual)
        else:
            out, act = cpu_kernels.routed_ffn(x, index, w, *records, residual)
    if taps.observers:
        taps.inputs(x.expand(len(ids), -1), act, ids)
    return out
