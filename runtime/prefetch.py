"""Prefetch of the next layer's likely experts into an :class:`runtime.experts.ExpertCache`.

When a decode step routes layer L, layer L+1's router is applied to layer L's router input
(``RouterGuess``: the residual stream changes little from one layer to the next, so this predicts much of
L+1's choice for the price of one small matmul) and the guessed experts are read into the cache by a
thread of its own (``ReadAhead``; ``os.preadv`` releases the GIL) while the model reads and computes layer L
and L+1's attention. Who guesses: on the host path an observer of the routing (``Prefetcher``); with
hybrid experts the decode step's CPU worker at each layer's post (``runtime.hybrid``). The cache never lets
a read ahead evict a slot the model has pinned or an expert layer L routed to, and the model waits for a
read in flight instead of reading the expert twice, so logits are unchanged. Prefill steps (several
tokens) are not read ahead: they route to most experts anyway.

Counters (in the cache's stats): ``prefetch_issued`` experts read ahead, ``prefetch_used`` of them hit
by the model, ``prefetch_wasted`` evicted unused.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from runtime import cpu_kernels, omp_team
from runtime.experts import ExpertCache
from runtime.observers import Observer

ROUTER = ".ffn_gate_inp.weight"  # the router projection's name ends so: its input is a guess's
#: (layer, its router input) -> (the next layer, its guessed experts), or None after the last layer
Guess = Callable[[int, torch.Tensor], tuple[int, list[int]] | None]
#: (layer, experts guessed of it) -> those worth reading
Keep = Callable[[int, list[int]], list[int]]


class RouterGuess:
    """Layer L+1's likely experts from layer L's router input: L+1's router applied to it (its top k), on the
    host by the CPU kernels (a hybrid decode step's worker guesses while the device waits for its answer: work
    queued on the device there would wait behind that wait; and the worker's kernel threads are the one
    OpenMP team of a decode step, which a torch product there could add to)."""

    def __init__(self, model: Any, layers: list[int]) -> None:
        self.n_used = int(model.n_expert_used)
        self.routers = {
            i: cpu_kernels.Rows.floats(model.blocks[i].moe.router.proj.weight.detach().float().cpu().numpy())
            for i in layers
        }
        self.next_layer = dict(zip(layers, layers[1:], strict=False))

    def __call__(self, layer: int, x: torch.Tensor) -> tuple[int, list[int]] | None:
        """(the layer after ``layer``, its guessed experts) from ``layer``'s router input ``x`` (one row);
        None after the last layer."""
        guess = self.rows(layer, x.reshape(1, -1))
        return None if guess is None else (guess[0], guess[1][0].tolist())

    def rows(self, layer: int, x: torch.Tensor) -> tuple[int, np.ndarray] | None:
        """The same for each row of ``x`` (n, n_embd): the next layer and its guesses (n, k)."""
        nxt = self.next_layer.get(layer)
        if nxt is None:
            return None
        logits = cpu_kernels.product(x.to("cpu", torch.float32), self.routers[nxt]).numpy()
        return nxt, np.argsort(-logits, axis=-1, kind="stable")[:, : self.n_used]


class ReadAhead:
    """Reads the experts ``guess`` (a ``RouterGuess``, or what stands in for one) expects of the next layer into
    an :class:`ExpertCache`, on a thread of its own (``background=False``: in the caller, deterministic). A
    guess the model has moved past is dropped by the cache."""

    def __init__(self, cache: ExpertCache, guess: Guess, background: bool = True) -> None:
        self.cache, self.guess = cache, guess
        cache.prefetching = True
        self.predicted = 0  # experts guessed (whether already cached or not)
        self._queue: queue.SimpleQueue[tuple[int, list[int], int] | None] | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._work, name="expert-prefetch", daemon=True)
            self._thread.start()

    def routed(self, layer: int, ids: list[int], x: torch.Tensor, keep: Keep | None = None) -> None:
        """The model has routed ``layer`` (its router input ``x``) to experts ``ids``, before asking for them:
        the cache is told, and the next layer's guessed experts are read (``keep``: of (layer, experts), those
        worth reading)."""
        self.cache.serve(layer, ids)
        guess = self.guess(layer, x)
        if guess is None:
            return
        nxt, experts = guess
        if keep is not None:
            experts = keep(nxt, experts)
        if experts:
            self.submit(nxt, experts, layer)

    def submit(self, layer: int, experts: list[int], issued_at: int) -> None:
        """Read experts ``experts`` of ``layer``, guessed while the model was at layer ``issued_at``."""
        self.predicted += len(experts)
        if self._queue is None:
            self.cache.prefetch(layer, experts, issued_at)
        else:
            self._queue.put((layer, experts, issued_at))

    def _work(self) -> None:
        omp_team.serial("expert-prefetch")
        assert self._queue is not None
        while (job := self._queue.get()) is not None:
            try:
                self.cache.prefetch(*job)
            except Exception:  # noqa: BLE001 - a failed read ahead is retried by the model's own read
                continue

    def close(self) -> None:
        """Stop the background thread (after the reads it has started)."""
        if self._queue is not None and self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._queue = self._thread = None


class Prefetcher(Observer):
    """The read ahead of a model whose every layer runs on the host: an observer of its routing (attached by
    :func:`attach_prefetcher`)."""

    def __init__(self, read_ahead: ReadAhead) -> None:
        self.read_ahead = read_ahead
        self._x: tuple[int, torch.Tensor] | None = None

    def on_matmul_input(self, tensor_name: str, x: torch.Tensor, expert_ids: torch.Tensor | None) -> None:
        if expert_ids is None and x.shape[0] == 1 and tensor_name.endswith(ROUTER):
            self._x = (int(tensor_name.split(".")[1]), x)

    def on_routing(
        self, layer: int, experts: torch.Tensor, weights: torch.Tensor, logits: torch.Tensor
    ) -> None:
        if experts.shape[0] == 1 and self._x is not None and self._x[0] == layer:
            self.read_ahead.routed(layer, experts[0].tolist(), self._x[1])


def attach_prefetcher(model: Any, background: bool = True) -> ReadAhead | None:
    """Read ahead on ``model`` when its weights stream experts (with hybrid experts, in the executor's decode
    steps; else by an observer of the routing); None otherwise."""
    cache = getattr(model.weights, "expert_cache", None)
    if cache is None:
        return None
    if getattr(model, "hybrid", None) is not None:
        return model.hybrid.prefetch(model, background)
    read_ahead = ReadAhead(
        cache, RouterGuess(model, [i for i in model.routed_layers() if i in cache.layers]), background
    )
    model.observers.append(Prefetcher(read_ahead))
    return read_ahead
