"""``forward(..., last_only=True)``: the last block's FFN computes the last row only (llama.cpp's output ids),
with the logits of a full forward's last row; with an observer attached it computes every row."""

from __future__ import annotations

import torch

from runtime.observers import Observer


def last_router_rows(model, ids: torch.Tensor, last_only: bool) -> tuple[list[int], torch.Tensor]:  # noqa: ANN001
    """The row counts the last routed layer's router saw over one prefill of ``ids``, and its logits."""
    router = model.blocks[model.routed_layers()[-1]].moe.router
    logits, rows = router.logits, []

    def counted(x: torch.Tensor) -> torch.Tensor:
        rows.append(x.shape[0])
        return logits(x)

    router.logits = counted
    try:
        out = model.forward(ids, model.new_state(), last_only=last_only)
    finally:
        del router.logits
    return rows, out


def check_last_only(model, ids: torch.Tensor, rtol: float = 1e-5) -> None:  # noqa: ANN001
    assert model.routed_layers()[-1] == model.n_layer - 1
    rows, full = last_router_rows(model, ids, last_only=False)
    assert rows == [len(ids)]
    rows, last = last_router_rows(model, ids, last_only=True)
    assert rows == [1] and last.shape == (1, full.shape[1])
    assert (last - full[-1:]).abs().max() <= rtol * full.abs().max()
    model.observers.append(Observer())
    try:
        rows, seen = last_router_rows(model, ids, last_only=True)
    finally:
        model.observers.pop()
    assert rows == [len(ids)] and (seen - full[-1:]).abs().max() <= rtol * full.abs().max()
