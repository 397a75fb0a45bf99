"""The torch backend: the reference for every op, and the path for MPS and any device without kernels.

``routed_ffn`` computes a routed-expert layer by decoding the selected experts from their source to
float32 and multiplying with torch ops. It has two entry points by shape: one token (a loop over its k
experts, in slot order, accumulating into the residual) and a batch (rows grouped by expert, one matmul
per expert hit), each the same arithmetic the runtime has always done (the oracle tables depend on it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from runtime.moe import ExpertSource, Taps


NAME = "torch"


def routed_ffn(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    source: ExpertSource,
    taps: Taps,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x (T, n_embd), ids / weights (T, k) as the router chose -> residual (or 0) + the experts' output."""
    if x.shape[0] == 1:
        return _one_token(x, ids[0], weights[0], source, taps, residual)
    out = _batch(x, ids, weights, source, taps)
    return out if residual is None else residual + out


def _swiglu(
    w: list[torch.Tensor] | tuple[Sequence[torch.Tensor], ...],
    i: int,
    x: torch.Tensor,
    n_ff: int,
    limit: float | None = None,
) -> torch.Tensor:
    if isinstance(w, list):
        gu = F.linear(x, w[i])
        gate, up = gu[:, :n_ff], gu[:, n_ff:]
    else:
        gate, up = F.linear(x, w[0][i]), F.linear(x, w[1][i])
    if limit is not None:  # DeepSeek V4's clamped SwiGLU (ggml_swiglu_clamp)
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return F.silu(gate) * up


def _one_token(
    x: torch.Tensor,
    ids: torch.Tensor,
    w: torch.Tensor,
    source: ExpertSource,
    taps: Taps,
    residual: torch.Tensor | None,
) -> torch.Tensor:
    hit = ids.tolist()
    gate_up, down = source.gate_up_matrices(hit), source.down_matrices(hit)
    xin = taps.round_in(x) if taps.round_in else x
    acts = [_swiglu(gate_up, i, xin, source.n_ff, source.swiglu_limit) for i in range(len(hit))]
    if taps.observers:
        taps.inputs(x.expand(len(hit), -1), torch.cat(acts), ids)
    if taps.round_act:
        acts = [taps.round_act(a) for a in acts]
    if taps.observers and taps.watchers():
        taps.outputs(ids, torch.cat([F.linear(acts[i], down[i]) for i in range(len(hit))]), w)
    scales = w.tolist()
    out = torch.zeros_like(x) if residual is None else residual
    for i in range(len(hit)):
        out = torch.addmm(out, acts[i], down[i].T, alpha=scales[i])
    return out


def _batch(
    x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, source: ExpertSource, taps: Taps
) -> torch.Tensor:
    order, sorted_ids, token, hit, counts = group_by_expert(ids)
    hit_list, counts_list = hit.tolist(), counts.tolist()
    gate_up, down = source.gate_up_matrices(hit_list), source.down_matrices(hit_list)
    xs = x[token]
    xin = taps.round_in(xs) if taps.round_in else xs
    act = torch.empty(xs.shape[0], source.n_ff, dtype=x.dtype, device=x.device)
    start = 0
    for i, n in enumerate(counts_list):
        act[start : start + n] = _swiglu(gate_up, i, xin[start : start + n], source.n_ff, source.swiglu_limit)
        start += n
    if taps.observers:
        taps.inputs(xs, act, sorted_ids)
    if taps.round_act:
        act = taps.round_act(act)
    ys = torch.empty_like(xs)
    start = 0
    for i, n in enumerate(counts_list):
        ys[start : start + n] = F.linear(act[start : start + n], down[i])
        start += n
    if taps.observers and taps.watchers():
        taps.outputs(sorted_ids, ys, w.reshape(-1)[order])
    return combine(x, ys, w, order, token)


def group_by_expert(
    ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids (T, k) -> the routed (token, slot) pairs sorted by expert (stable): their order in ids.reshape(-1),
    their expert ids, their tokens, and the experts hit with their pair counts."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    sorted_ids = flat[order]
    hit, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    return order, sorted_ids, order // ids.shape[1], hit, counts


def combine(
    x: torch.Tensor, ys: torch.Tensor, w: torch.Tensor, order: torch.Tensor, token: torch.Tensor
) -> torch.Tensor:
    """The rows' outputs ys (in ``group_by_expert`` order) weighted by the router's w (T, k) and summed
    per token -> (T, n_embd)."""
    ys *= w.reshape(-1)[order, None]
    return torch.zeros_like(x).index_add_(0, token, ys)
