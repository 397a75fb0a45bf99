"""The decode step captured as CUDA graphs: one token through every layer is hundreds of small kernel
launches, whose host cost (not the GPU's) bounds the speed; a graph replays them as one.

A graph is captured per sequence (``State``) and attention span: the KV slots attention reads, a power
of two covering the position, with the slots past it masked (``KVCache.put_at``), so one graph serves
every position up to its span. The position enters as a device tensor. The model's first step at a new
span runs eagerly in that same form (it compiles kernels and grows tables outside a capture); later ones
are captured (once per sequence and span) and replayed. A graph is used only while everything it read is where it was: the state's
cache tensors (updated in place) and the prune mask.

A layer whose step needs the host in the middle (hybrid experts: the last step's accounts and the CPU worker
started, at the step's first routed layer) calls ``cut``: under capture the step's graph ends there, the host
call runs on what the graph computed, and a new graph begins on its result; a replay runs the graphs and the
host calls in turn.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from forge.errors import ForgeError
from runtime.layers import KVCache

if TYPE_CHECKING:
    from runtime.models.base import MoeCausalLM, State

log = logging.getLogger(__name__)

MIN_SPAN = 256


def enabled(model: MoeCausalLM) -> bool:
    """The model's decode steps can be captured: on CUDA, the fast one-token path, every routed-expert
    layer on the cuda kernels (which never wait for the device) or cutting the graph where it waits
    (``CUTS_GRAPHS``); FORGE_CUDA_GRAPHS=0 turns it off."""
    from runtime.backends import cuda_backend

    if (
        model.weights.device.type != "cuda"
        or not model.fast_decode
        or os.environ.get("FORGE_CUDA_GRAPHS") == "0"
    ):
        return False
    blocks = getattr(model, "blocks", [])
    backends = [getattr(getattr(b, "moe", None), "backend", cuda_backend) for b in blocks]
    return bool(blocks) and all(b is cuda_backend or getattr(b, "CUTS_GRAPHS", False) for b in backends)


class _Segments:
    """A decode step captured as graphs with host calls between them: ``calls[i]`` (function, its
    arguments, the tensor its result is copied into) runs after ``graphs[i]``."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.calls: list[tuple[Callable[..., torch.Tensor], tuple, torch.Tensor]] = []

    def begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        # thread-local: other threads (a hybrid layer's copier) keep working on their own streams meanwhile
        graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        self.graphs.append(graph)

    def cut(self, call: Callable[..., torch.Tensor], args: tuple) -> torch.Tensor:
        """End the graph being captured, run it (nothing ran while it was captured), then ``call`` on its
        tensors; the next graph begins on a copy of the result."""
        self.graphs[-1].capture_end()
        self.graphs[-1].replay()
        into = call(*args).clone()
        self.calls.append((call, args, into))
        self.begin()
        return into

    def replay(self) -> None:
        for i, graph in enumerate(self.graphs):
            graph.replay()
            if i < len(self.calls):
                call, args, into = self.calls[i]
                into.copy_(call(*args))


_capturing: _Segments | None = None  # the decode step being captured (on the model's thread), if any


def cut(call: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """``call(*args)``: a host step inside a decode step (see the module); called now when no capture is
    under way."""
    if _capturing is None:
        return call(*args)
    return _capturing.cut(call, args)


def span_for(pos: int) -> int:
    return max(MIN_SPAN, 1 << pos.bit_length())  # the smallest power of two above pos


@contextmanager
def captured_form(caches: list[KVCache], at: torch.Tensor, span: int) -> Iterator[None]:
    """Attention layers read their position from ``at`` (a device tensor holding it) and ``span`` slots."""
    for c in caches:
        c.at, c.span = at, span
    try:
        yield
    finally:
        for c in caches:
            c.at, c.span = None, 0


def _fingerprint(model: MoeCausalLM, state: State) -> tuple[int, ...]:
    """Where every cache tensor of ``state`` lives, and the model's prune-mask generation."""
    ptrs = [model.mask_generation]
    for cache in state.layers:
        ptrs.extend(t.data_ptr() for n, t in vars(cache).items() if isinstance(t, torch.Tensor) and n != "at")
    return tuple(ptrs)


class _Captured:
    def __init__(self, segments: _Segments, h_in: torch.Tensor, out: torch.Tensor, key: tuple) -> None:
        self.segments, self.h_in, self.out, self.key = segments, h_in, out, key


class DecodeGraphs:
    """One sequence's captured decode steps, by attention span."""

    def __init__(self, model: MoeCausalLM, device: torch.device) -> None:
        self.model = model
        self.at = torch.zeros(1, dtype=torch.long, device=device)
        self.graphs: dict[int, _Captured] = {}
        self.pool: Any = None
        self.failed = False
        self.replays = 0

    def step(self, h: torch.Tensor, state: State) -> torch.Tensor:
        """h (1, n_embd) the token's embedding at ``state.pos`` -> logits (1, vocab); the caller advances
        ``state.pos``."""
        pos = state.pos
        span = span_for(pos)
        caches = [c for c in state.layers if isinstance(c, KVCache)]
        captured = self.graphs.get(span)
        key = _fingerprint(self.model, state)
        if captured is not None and captured.key == key:
            self.at.fill_(pos)
            captured.h_in.copy_(h)
            captured.segments.replay()
            self.replays += 1
            out = captured.out.clone()
        else:
            capture = span in self.model.warm_spans and not self.failed
            out = self._run(h, state, caches, span, capture)
        for c in caches:
            c.length = pos + 1
        return out

    def _run(
        self, h: torch.Tensor, state: State, caches: list[KVCache], span: int, capture: bool
    ) -> torch.Tensor:
        """The step in its captured form (position and span from the device), eagerly or captured."""
        self.at.fill_(state.pos)
        with captured_form(caches, self.at, span):
            if capture and all(c.k is not None for c in caches):
                return self._capture(h, state, caches, span)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out = self.model.decode_layers(h, state.layers, state.pos)
            torch.cuda.current_stream().wait_stream(side)
            self.model.warm_spans.add(span)
            return out

    def _capture(self, h: torch.Tensor, state: State, caches: list[KVCache], span: int) -> torch.Tensor:
        for c in caches:  # no cache may grow inside the capture
            assert c.k is not None and c.v is not None
            c.reserve(span, c.k[:, 0], c.v[:, 0])
        global _capturing
        key = _fingerprint(self.model, state)  # where the caches are now
        h_in = h.clone()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        segments = _Segments(self.pool)
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(stream):
                segments.begin()
                _capturing = segments
                try:
                    out = self.model.decode_layers(h_in, state.layers, state.pos)
                finally:
                    _capturing = None
                    segments.graphs[-1].capture_end()
                segments.graphs[-1].replay()
        except RuntimeError as e:  # a path that cannot be captured: eager from now on
            if segments.calls:  # part of the step ran (recurrent states advanced): it cannot run again
                raise ForgeError(
                    f"cuda graphs: capturing a decode step failed ({e}); FORGE_CUDA_GRAPHS=0 runs without them"
                ) from e
            log.warning("cuda graphs: capturing the decode step failed (%s); running it eagerly", e)
            self.failed = True
            return self._run(h, state, caches, span, False)
        torch.cuda.current_stream().wait_stream(stream)
        self.graphs[span] = _Captured(segments, h_in, out, key)
        return out.clone()
