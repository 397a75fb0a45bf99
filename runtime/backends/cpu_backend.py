"""The cpu backend: the compiled (numba) kernels of ``runtime.cpu_kernels``.

``routed_ffn``'s one token (a decode step, the residual folded in; or a batch's one row) runs one kernel
call over the records the expert source hands out: encoded rows (per use, mapped from the file; streamed,
in the cache's slots) or the resident experts' float32 rows. A batch (prefill) over encoded rows runs the
batch kernel on the routed (token, slot) rows grouped by expert, each weight row decoded once per batch;
resident float32 experts take the torch reference (one matmul per expert, on rows already decoded).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

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
    """As ``torch_backend.routed_ffn``; the kernels serve one token (a decode step, or a batch's one row: a
    prefill's last layer computes its output row only) and batches of experts held encoded."""
    if x.shape[0] > 1 and source.kind != "resident":
        out = _batch(x, ids, weights, source, taps)
        return out if residual is None else residual + out
    if x.shape[0] != 1:
        return torch_backend.routed_ffn(x, ids, weights, source, taps, residual)
    if residual is None:
        residual = torch.zeros_like(x)
    ids, w = ids[0], weights[0]
    with source.records(ids) as (records, index):
        if isinstance(records, cpu_kernels.EncodedExperts):
            out, act = cpu_kernels.routed_ffn_encoded(x, index, w, records, residual)
        else:
            out, act = cpu_kernels.routed_ffn(x, index, w, *records, residual)
    if taps.observers:
        taps.inputs(x.expand(len(ids), -1), act, ids)
    return out


def _batch(
    x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, source: ExpertSource, taps: Taps
) -> torch.Tensor:
    """``torch_backend._batch`` on the batch kernel: the rows in the same order (sorted by expert), the same
    weighted combine."""
    order, sorted_ids, token, hit, counts = torch_backend.group_by_expert(ids)
    starts = F.pad(counts.cumsum(0), (1, 0))
    xs = x[token]
    act = torch.empty(xs.shape[0], source.n_ff)
    ys = torch.empty_like(xs)
    # a streamed layer's experts are held a group at a time (the cache may hold fewer than the batch hits)
    group = source.cache.group_size if source.kind == "streamed" else len(hit)
    cpu_kernels.use_threads(torch.get_num_threads())
    for a in range(0, len(hit), group):
        with source.records(hit[a : a + group]) as (records, index):
            cpu_kernels.routed_ffn_batch(
                xs, index, starts[a : a + group + 1], records, source.swiglu_limit, act, ys
            )
    if taps.observers:
        taps.inputs(xs, act, sorted_ids)
    return torch_backend.combine(x, ys, w, order, token)
