"""The cuda backend: Triton kernels computing on the GGUF blocks (``runtime.backends.cuda_kernels``).

``routed_ffn`` is one ``moe_linear`` launch per projection over every (token, slot) pair, the expert ids
staying on the device (no host sync), for prefill and decode alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from runtime.backends import cuda_fused, cuda_kernels

if TYPE_CHECKING:
    from runtime.moe import ExpertSource, Taps

NAME = "cuda"


def routed_ffn(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    source: ExpertSource,
    taps: Taps,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x (T, n_embd), ids / weights (T, k) -> residual (or 0) + the experts' output, (T, n_embd)."""
    parts = source.device_parts()
    assert parts is not None
    *gate_up, down = parts
    n_ff = source.n_ff
    groups: dict = {}  # the (token, slot) pairs grouped by expert once for the layer's products
    if len(gate_up) == 1:
        gu = cuda_kernels.moe_linear(x, gate_up[0].raw, gate_up[0].qtype, ids, groups=groups)
        gate, up = gu[..., :n_ff], gu[..., n_ff:]
    else:
        gate = cuda_kernels.moe_linear(x, gate_up[0].raw, gate_up[0].qtype, ids, groups=groups)
        up = cuda_kernels.moe_linear(x, gate_up[1].raw, gate_up[1].qtype, ids, groups=groups)
    act = (
        cuda_fused.swiglu(gate, up) if cuda_fused.available(x) else F.silu(gate).mul_(up)
    )  # (T, top_k, n_ff)
    if taps.observers:
        k = ids.shape[1]
        taps.inputs(x.repeat_interleave(k, 0), act.reshape(-1, n_ff), ids.reshape(-1))
    y = cuda_kernels.moe_linear(act, down.raw, down.qtype, ids, groups=groups)  # (T, top_k, n_embd)
    if cuda_fused.available(y):
        return cuda_fused.weighted_sum(y, weights, residual)
    out = (y * weights[..., None].to(y.dtype)).sum(1)  # a weighted sum over k slots: no GEMM launch
    return out if residual is None else residual + out
