"""Prefetch of the next layer's likely experts into an :class:`runtime.experts.ExpertCache`.

An observer: when a decode step routes layer L, layer L+1's router is applied to layer L's router
input (the residual stream changes little from one layer to the next, so this predicts much of
L+1's choice for the price of one small matmul) and the predicted experts are read into the cache by a
background thread (``os.preadv`` releases the GIL) while the model computes layer L and L+1's
attention. The cache never lets a prefetch evict a slot the model has pinned or an expert layer L
routed to, and the model waits for a read in flight instead of reading the expert twice, so logits are
unchanged. Prefill steps (several tokens) are not prefetched: they route to most experts anyway.

Counters (in the cache's stats): ``prefetch_issued`` experts read ahead, ``prefetch_used`` of them hit
by the model, ``prefetch_wasted`` evicted unused.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import torch
import torch.nn.functional as F

from runtime.experts import ExpertCache
from runtime.observers import Observer

_ROUTER = ".ffn_gate_inp.weight"


class Prefetcher(Observer):
    """Attach with :func:`attach_prefetcher`; ``background=False`` reads in the caller (deterministic)."""

    def __init__(self, model: Any, cache: ExpertCache, background: bool = True) -> None:
        self.cache = cache
        cache.prefetching = True
        self.n_used = int(model.n_expert_used)
        layers = [i for i in model.routed_layers() if i in cache.layers]
        self.routers = {i: model.blocks[i].moe.router.proj.weight for i in layers}
        self.next_layer = dict(zip(layers, layers[1:], strict=False))
        self.predicted = 0  # experts predicted (whether already cached or not)
        self._x: tuple[int, torch.Tensor] | None = None
        self._queue: queue.SimpleQueue[tuple[int, list[int], int] | None] | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._work, name="expert-prefetch", daemon=True)
            self._thread.start()

    def on_matmul_input(self, tensor_name: str, x: torch.Tensor, expert_ids: torch.Tensor | None) -> None:
        if expert_ids is None and x.shape[0] == 1 and tensor_name.endswith(_ROUTER):
            self._x = (int(tensor_name.split(".")[1]), x)

    def on_routing(
        self, layer: int, experts: torch.Tensor, weights: torch.Tensor, logits: torch.Tensor
    ) -> None:
        if experts.shape[0] != 1 or self._x is None or self._x[0] != layer:
            return
        self.cache.protect(layer, experts[0].tolist())
        nxt = self.next_layer.get(layer)
        if nxt is None:
            return
        w = self.routers[nxt]
        guess = torch.topk(F.linear(self._x[1].to(w.device), w), self.n_used, dim=-1).indices[0].tolist()
        self.predicted += len(guess)
        if self._queue is None:
            self._fetch(nxt, guess, layer)
        else:
            self._queue.put((nxt, guess, layer))

    def _fetch(self, layer: int, experts: list[int], issued_at: int) -> None:
        for e in experts:
            if not self.cache.prefetch_one(layer, e, issued_at):
                break

    def _work(self) -> None:
        assert self._queue is not None
        while (job := self._queue.get()) is not None:
            try:
                self._fetch(*job)
            except Exception:  # noqa: BLE001 - a failed read ahead is retried by the model's own read
                continue

    def close(self) -> None:
        """Stop the background thread (after the reads it has started)."""
        if self._queue is not None and self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._queue = self._thread = None


def attach_prefetcher(model: Any, background: bool = True) -> Prefetcher | None:
    """Register a prefetcher on ``model`` when its weights stream experts; None otherwise."""
    cache = getattr(model.weights, "expert_cache", None)
    if cache is None:
        return None
    p = Prefetcher(model, cache, background)
    model.observers.append(p)
    return p
