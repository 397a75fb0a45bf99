"""The MoE layers: ``RoutedExperts`` = a ``Router`` + an ``ExpertSource`` + one backend op; ``SharedExpert``.

``RoutedExperts`` routes once per call (in torch, outside any kernel), then hands (token, expert id, weight)
lists to its backend's ``routed_ffn`` (``runtime.backends``), which reads the experts from the layer's
source; observers and ggml numerics meet the experts at one boundary (``Taps``).

A ``Router`` owns the layer's gate projection (``ffn_gate_inp``) and its prune mask, and turns router
logits into (expert ids, weights) -- the one place that decides routing, whatever backend then computes
the experts -- and reports each decision to the observers (``on_routing``). ``SoftmaxTopK`` is Qwen's
routing, ``ScoredTopK`` DeepSeek V4's (scores softmax / sigmoid / sqrt(softplus), a selection bias,
renormalized and scaled weights); other kinds subclass ``Router`` and override ``select``. ``HashRouter``
(DeepSeek V4's first layers: experts by token id) reads the token ids, which ``route`` passes to
``select_tokens``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from forge import ggml_types
from forge.errors import ForgeError
from runtime import backends, cpu_kernels
from runtime.backends import cuda_fused, cuda_kernels, torch_backend
from runtime.layers import FusedLinear, Linear, ggml_input_rounding
from runtime.observers import (
    Observer,
    expert_output_observers,
    notify_expert_output,
    notify_matmul,
    notify_routing,
)
from runtime.weights import ExpertTensor, Weights

# Router score given to pruned experts: finite (like ds4's -1e30) so softmax over a top-k never sees -inf.
MASKED_SCORE = -1e30


class Router:
    """Gate projection, prune mask and expert selection of one layer.

    ``proj``: the gate projection (a ``runtime.layers.Linear``: ``__call__``, ``step``, ``rows``
    for the compiled one-token kernels, ``weight``).
    """

    def __init__(self, proj: Any, layer: int, n_used: int, observers: list[Observer]) -> None:
        self.proj, self.layer, self.n_used, self.observers = proj, layer, n_used, observers
        self.n_expert = int(proj.n_out)
        self.kept: torch.Tensor | None = None  # surviving expert ids under a prune mask
        self.kept_proj: Any = None

    # logits -----------------------------------------------------------------------------------------------
    def set_mask(self, pruned: torch.Tensor | None) -> None:
        """pruned: (n_expert,) bool, True = never route to this expert; None removes the mask.

        The router then scores only the surviving experts (the same matmul a physically pruned file does)
        and gives the others MASKED_SCORE, so each token goes to its best surviving experts.
        """
        if pruned is None:
            self.kept = self.kept_proj = None
            return
        if pruned.shape != (self.n_expert,) or pruned.dtype != torch.bool:
            raise ForgeError(f"layer {self.layer}: a prune mask needs {self.n_expert} booleans")
        if int((~pruned).sum()) < self.n_used:
            raise ForgeError(f"layer {self.layer}: a prune mask must keep at least {self.n_used} experts")
        full = self.proj
        self.kept = torch.nonzero(~pruned.cpu())[:, 0].to(full.weight.device)
        kept = copy.copy(full)
        rows = full.weight[self.kept]  # held in the full router's layout: the same matmul results
        kept.weight = rows if full.weight.is_contiguous() else rows.T.contiguous().T
        kept.weight_t = kept.weight.T
        kept.encoded = None  # the surviving rows only: the torch product
        kept.rows = None if full.rows is None else cpu_kernels.Rows.floats(rows.numpy())
        self.kept_proj = kept

    def _scatter(self, part: torch.Tensor) -> torch.Tensor:
        """The surviving experts' router logits (T, kept) -> (T, n_expert), the others MASKED_SCORE."""
        if self.kept is None:
            return part
        logits = part.new_full((part.shape[0], self.n_expert), MASKED_SCORE)
        logits[:, self.kept] = part
        return logits

    @property
    def active(self) -> Any:
        """The projection computing the logits (the surviving rows' under a prune mask)."""
        return self.proj if self.kept_proj is None else self.kept_proj

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, n_embd) -> (T, n_expert)."""
        return self._scatter(self.active(x))

    def logits_step(self, x: torch.Tensor) -> torch.Tensor:
        """One token: x (1, n_embd) -> (1, n_expert)."""
        return self._scatter(self.active.step(x))

    def normed_logits(
        self, h: torch.Tensor, norm: torch.Tensor, eps: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token: (rms_norm(h) * norm, its logits (1, n_expert)); eps a (1, 1) tensor."""
        x, logits = self.active.normed_input_step(h, norm, eps)
        return x, self._scatter(logits)

    # selection --------------------------------------------------------------------------------------------
    reads_tokens = False  # hash routing: the expert ids come from the token ids (``select_tokens``)

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits (T, n_expert) -> expert ids (T, k) int64 and their weights (T, k) float32."""
        raise NotImplementedError

    def select_tokens(self, logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def route(
        self, logits: torch.Tensor, tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``select``, reported to the observers: the one place a routing decision is made. ``tokens`` (T,):
        the token ids, which only hash routing reads."""
        ids, weights = (
            self.select(logits)
            if tokens is None or not self.reads_tokens
            else self.select_tokens(logits, tokens)
        )
        if self.observers:
            notify_routing(self.observers, self.layer, ids, weights, logits)
        return ids, weights


class SoftmaxTopK(Router):
    """The k best logits (descending, first index on ties), weighted by the softmax over those k logits
    (= the top-k softmax probabilities renormalized to sum 1), as Qwen3 / Qwen3.5 MoE route."""

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return softmax_top_k(logits, self.n_used)


def softmax_top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (T, n_expert) -> the top-k ids (T, k) (torch.topk's order) and the softmax of their logits."""
    if cuda_fused.available(logits) and logits.dtype == torch.float32 and logits.is_contiguous():
        return cuda_fused.softmax_top_k(logits, k)  # one launch for topk + softmax
    top_logits, ids = torch.topk(logits, k, dim=-1)
    return ids, torch.softmax(top_logits, dim=-1)


#: llama.cpp's expert gating functions (``<arch>.expert_gating_func``): logits -> per-expert scores
SCORE_FUNCTIONS = {
    1: lambda z: torch.softmax(z, dim=-1),
    2: torch.sigmoid,
    4: lambda z: torch.sqrt(F.softplus(z)),
}


class ScoredTopK(Router):
    """DeepSeek V3/V4 routing: scores = f(logits) (softmax, sigmoid or sqrt(softplus)), the k experts with the
    best scores + ``bias`` (the selection bias ``exp_probs_b``; it does not enter the weights), weighted by
    their scores, renormalized to sum 1 when ``normalize``, times ``scale`` (the routed scaling factor)."""

    def __init__(
        self,
        proj: Any,
        layer: int,
        n_used: int,
        observers: list[Observer],
        gating: int,
        bias: torch.Tensor | None = None,
        normalize: bool = True,
        scale: float = 1.0,
    ) -> None:
        super().__init__(proj, layer, n_used, observers)
        if gating not in SCORE_FUNCTIONS:
            raise ForgeError(f"layer {layer}: expert gating function {gating} is not supported")
        self.score, self.bias, self.normalize, self.scale = SCORE_FUNCTIONS[gating], bias, normalize, scale

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """The experts' scores; under a prune mask computed on the surviving experts' logits alone, as a
        physically pruned file computes them (a vectorized sigmoid rounds an element by where it falls in the
        row: in a row of 16 and one of 10 an expert may get scores one ulp apart), the others 0."""
        if self.kept is None:
            return self.score(logits)
        part = self.score(logits.index_select(1, self.kept))
        return part.new_zeros(logits.shape).index_copy_(1, self.kept, part)

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.scores(logits)
        chosen = scores if self.bias is None else scores + self.bias
        if self.kept is not None:  # pruned experts: never chosen, whatever their bias
            chosen = chosen.masked_fill(logits == MASKED_SCORE, float("-inf"))
        ids = torch.topk(chosen, self.n_used, dim=-1).indices
        return ids, self._weights(scores, ids)

    def _weights(self, scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        w = scores.gather(1, ids)
        if self.normalize:  # llama.cpp clamps the sum to fp16's smallest normal
            w = w / w.sum(dim=-1, keepdim=True).clamp_min(6.103515625e-5)
        return w * self.scale


class GroupedScoredTopK(ScoredTopK):
    """``ScoredTopK`` limited to the ``topk_group`` best of ``n_group`` equal expert groups (a group scores
    the sum of its two best biased scores), as DeepSeek V3 and GLM-4.5 route (llama.cpp's
    ``expert_group_count`` / ``expert_group_used_count``); one group is plain ``ScoredTopK``."""

    def __init__(self, proj: Any, layer: int, n_used: int, observers: list[Observer], gating: int,
                 bias: torch.Tensor | None, normalize: bool, scale: float, n_group: int, topk_group: int) -> None:  # fmt: skip
        super().__init__(proj, layer, n_used, observers, gating, bias, normalize, scale)
        if n_group < 1 or self.n_expert % n_group or not 1 <= topk_group <= n_group:
            raise ForgeError(
                f"layer {layer}: {n_group} expert groups ({topk_group} used) do not fit {self.n_expert} experts"
            )
        self.n_group, self.topk_group = n_group, topk_group

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.n_group == 1:
            return super().select(logits)
        scores = self.scores(logits)
        chosen = scores if self.bias is None else scores + self.bias
        if self.kept is not None:
            chosen = chosen.masked_fill(logits == MASKED_SCORE, float("-inf"))
        groups = chosen.view(chosen.shape[0], self.n_group, -1)
        best = torch.topk(groups.topk(2, dim=-1).values.sum(-1), self.topk_group, dim=-1).indices
        keep = torch.zeros(groups.shape[:2], dtype=torch.bool, device=logits.device).scatter_(1, best, True)
        chosen = groups.masked_fill(~keep[..., None], float("-inf")).view_as(chosen)
        ids = torch.topk(chosen, self.n_used, dim=-1).indices
        return ids, self._weights(scores, ids)


class HashRouter(ScoredTopK):
    """DeepSeek V4's hash-routed layers: token id t goes to the experts ``table[t]`` (``ffn_gate_tid2eid``,
    (vocab, k)), weighted by their scores as ``ScoredTopK`` weights them. A prune mask does not apply."""

    reads_tokens = True

    def __init__(self, proj: Any, layer: int, observers: list[Observer], table: torch.Tensor, gating: int,
                 normalize: bool = True, scale: float = 1.0) -> None:  # fmt: skip
        super().__init__(proj, layer, int(table.shape[1]), observers, gating, None, normalize, scale)
        self.table = table

    def set_mask(self, pruned: torch.Tensor | None) -> None:
        if pruned is not None:
            raise ForgeError(f"layer {self.layer} is hash-routed: a prune mask applies to routed layers only")

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise ForgeError(f"layer {self.layer} is hash-routed: routing it needs the token ids")

    def select_tokens(self, logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.table[tokens.to(self.table.device)]
        return ids, self._weights(self.score(logits), ids)


# the observer / numerics boundary ------------------------------------------------------------------------
class Taps:
    """Where a routed-expert layer meets the observers and ``--ggml-numerics``: every backend reports the
    matmul inputs of the expert projections through ``inputs`` (rows = routed (token, slot) pairs, before
    any rounding), and the torch reference rounds with ``round_in`` / ``round_act`` (ggml numerics only;
    the other backends are not chosen then). ``watchers``: the observers that want each expert's output
    (they are served by the torch reference, which computes it separately)."""

    def __init__(
        self,
        names: tuple[str, str, str],
        layer: int,
        observers: list[Observer],
        round_in: Callable[[torch.Tensor], torch.Tensor] | None = None,
        round_act: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.names, self.layer, self.observers = names, layer, observers
        self.round_in, self.round_act = round_in, round_act

    @property
    def rounds(self) -> bool:
        return self.round_in is not None or self.round_act is not None

    def watchers(self) -> list[Observer]:
        return expert_output_observers(self.observers) if self.observers else []

    def inputs(self, x: torch.Tensor, act: torch.Tensor, ids: torch.Tensor) -> None:
        """x (rows, n_embd) the gate/up input rows, act (rows, n_ff) the down inputs, ids (rows,) experts."""
        if self.observers:
            notify_matmul(self.observers, self.names[0], x, ids)
            notify_matmul(self.observers, self.names[1], x, ids)
            notify_matmul(self.observers, self.names[2], act, ids)

    def outputs(self, ids: torch.Tensor, outputs: torch.Tensor, weights: torch.Tensor) -> None:
        if watch := self.watchers():
            notify_expert_output(watch, self.layer, ids, outputs, weights)


# expert sources ------------------------------------------------------------------------------------------
class ExpertSource:
    """Where one layer's routed experts are held, separate from how they are computed.

    ``kind``: ``resident`` (decoded to float32 at load, within the expert budget), ``per-use`` (the file's
    encoded bytes, mapped; on CUDA: on the device) or ``streamed`` (an expert cache's slots). A source hands
    out its experts as records for the backends: ``records(ids)`` (the compiled CPU kernels: encoded rows,
    or the resident float32 rows), ``device_parts`` (the cuda kernels: the file bytes on the GPU), and
    ``gate_up`` / ``down`` (the torch reference: float32 matrices of the experts asked for, decoded per use
    unless resident).
    """

    def __init__(self, weights: Weights, layer: int) -> None:
        p = f"blk.{layer}."
        self.layer = layer
        self.names = (p + "ffn_gate_exps.weight", p + "ffn_up_exps.weight", p + "ffn_down_exps.weight")
        self.gate_up: ExpertTensor | None = None
        self.gate: ExpertTensor | None = None
        self.up: ExpertTensor | None = None
        if weights.has(p + "ffn_gate_up_exps.weight"):
            self.gate_up = weights.experts(p + "ffn_gate_up_exps.weight")
        elif (stacked := _cuda_gate_up(weights, list(self.names[:2]))) is not None:
            self.gate_up = stacked  # on CUDA, one launch for both (decode and prefill)
        else:
            self.gate, self.up = weights.experts(self.names[0]), weights.experts(self.names[1])
        self.down = weights.experts(self.names[2])
        self.n_ff = self.down.cols
        parts = (self.gate_up,) if self.gate_up is not None else (self.gate, self.up)
        self.parts: tuple[ExpertTensor, ...] = (*parts, self.down)  # type: ignore[arg-type]
        self.up_name = p + "ffn_gate_up_exps.weight" if self.gate_up is not None else self.names[1]
        # Resident gate and up are kept as one (n_expert, 2 n_ff, n_embd) tensor: one matmul per expert.
        self.fused: torch.Tensor | None = None
        if self.gate_up is not None and self.gate_up.resident:
            self.fused = self.gate_up.decoded()
        elif self.gate is not None and self.up is not None and self.gate.resident and self.up.resident:
            self.fused = torch.cat([self.gate.decoded(), self.up.decoded()], dim=1)
            self.gate.release()
            self.up.release()
        self.resident = self.fused is not None and self.down.resident
        # DeepSeek V4 clamps its experts' SwiGLU: SiLU(min(gate, limit)) * clamp(up, -limit, limit). Set by the
        # layer; only the torch reference computes it (``backends.for_experts``).
        self.swiglu_limit: float | None = None
        self.cache: Any = None
        self.cache_layer: Any = None
        if weights.expert_cache is not None and layer in weights.expert_cache.layers:
            self.kind = "streamed"
            self.cache = weights.expert_cache
            self.cache_layer = streamed_layer(weights, layer)
        else:
            self.kind = "resident" if self.resident else "per-use"
        self._rows: tuple[np.ndarray, np.ndarray] | None = None
        self._encoded: cpu_kernels.EncodedExperts | None = None
        self._slab_records: cpu_kernels.EncodedExperts | None = None  # streamed: the cache's slab, by slot

    # torch reference: float32 matrices ------------------------------------------------------------------------
    def gate_up_matrices(self, hit: list[int]) -> list[torch.Tensor] | tuple[list[torch.Tensor], ...]:
        """Experts ``hit``'s gate|up (rows 2 n_ff) matrices, or a (gate, up) pair of lists."""
        if self.fused is not None:
            return [self.fused[e] for e in hit]
        if self.gate_up is not None:
            return self.gate_up.per_expert(hit)
        assert self.gate is not None and self.up is not None
        return self.gate.per_expert(hit), self.up.per_expert(hit)

    def down_matrices(self, hit: list[int]) -> Sequence[torch.Tensor]:
        return self.down.per_expert(hit)

    # cuda kernels: the file bytes on the device ----------------------------------------------------------------
    def device_parts(self) -> tuple[ExpertTensor, ...] | None:
        """(gate_up,) or (gate, up), then down, when all are file bytes on a GPU of types the cuda kernels
        decode; else None."""
        if self.kind == "streamed" or not all(
            t.raw.numel() and t.raw.is_contiguous() and cuda_kernels.computes(t.raw.device, t.qtype)
            for t in self.parts
        ):
            return None
        return self.parts

    # compiled CPU kernels: records --------------------------------------------------------------------------------
    def has_records(self) -> bool:
        """``records`` can serve (host memory; encoded parts of types the kernels decode)."""
        if self.kind == "streamed":
            return self.cache_layer is not None
        if self.resident:
            return self.fused is not None and self.fused.device.type == "cpu"
        return self.encoded_records() is not None

    def encoded_records(self) -> cpu_kernels.EncodedExperts | None:
        """A per-use layer's experts as the kernels' encoded rows (over the mapped file), else None."""
        if self._encoded is None and self.kind == "per-use":
            self._encoded = encoded_experts(self.gate_up, self.gate, self.up, self.down)
        return self._encoded

    @contextmanager
    def records(self, ids: torch.Tensor) -> Iterator[tuple[Any, torch.Tensor]]:
        """Experts ``ids`` (k,) as the compiled kernels read them, and their index along the records' first
        axis: resident experts as (gate_up, down) float32 arrays, the others as ``EncodedExperts`` (over the
        mapped file, or over the cache's slots, held for the block: computed in place, no copy)."""
        if self.kind == "streamed":
            cache, lay = self.cache_layer
            k = len(ids)
            cache.stats.peak_decoded = max(cache.stats.peak_decoded, k)
            with cache.held(self.layer, ids.tolist()) as (slab, slots):
                if self._slab_records is None:  # the slab is the cache's for its life: viewed once
                    views = lay.views(slab)
                    part = {c.role: (views[c.role], c.qtype) for c in lay.components}
                    self._slab_records = cpu_kernels.EncodedExperts(*part["gate"], *part["up"], *part["down"])
                yield self._slab_records, torch.tensor(slots)
            return
        if self.resident:
            if self._rows is None:
                assert self.fused is not None
                self._rows = (self.fused.contiguous().numpy(), self.down.decoded().contiguous().numpy())
            yield self._rows, ids
            return
        encoded = self.encoded_records()
        assert encoded is not None
        yield encoded, ids


def _cuda_gate_up(weights: Weights, names: list[str]) -> ExpertTensor | None:
    """Separate gate and up experts as one stacked tensor of their file rows on the GPU, where the cuda
    kernels compute them (``Weights.cuda_expert_stack``); else None."""
    stack = getattr(weights, "cuda_expert_stack", None)
    return stack(names) if stack is not None and weights.device.type == "cuda" else None


def encoded_experts(
    gate_up: ExpertTensor | None, gate: ExpertTensor | None, up: ExpertTensor | None, down: ExpertTensor
) -> cpu_kernels.EncodedExperts | None:
    """A layer's per-use routed experts as the compiled path's encoded rows; None when one of them is held
    otherwise (decoded, streamed by an expert cache) or of a type the kernels do not decode."""
    parts = [p for p in (gate_up, gate, up, down) if p is not None]
    if any(
        p.resident
        or p.raw.numel() == 0
        or p.raw.device.type != "cpu"
        or not ggml_types.supports("cpu_rows", p.qtype)
        for p in parts
    ):
        return None
    if gate_up is not None:
        raw, n_ff = gate_up.raw.numpy(), gate_up.rows // 2
        g, gt, u, ut = raw[:, :n_ff], gate_up.qtype, raw[:, n_ff:], gate_up.qtype
    else:
        assert gate is not None and up is not None
        g, gt, u, ut = gate.raw.numpy(), gate.qtype, up.raw.numpy(), up.qtype
    return cpu_kernels.EncodedExperts(g, gt, u, ut, down.raw.numpy(), down.qtype)


def streamed_layer(weights: Weights, layer: int) -> tuple[Any, Any] | None:
    """(expert cache, its LayerExperts) when ``layer``'s routed experts are streamed into a host slab as
    separate gate, up and down parts of types the compiled path decodes; else None."""
    cache = weights.expert_cache
    lay = None if cache is None or cache.slab_device is not None else cache.layers.get(layer)
    if lay is None:
        return None
    roles = {c.role: c.qtype for c in lay.components}
    if sorted(roles) != ["down", "gate", "up"] or not all(
        ggml_types.supports("cpu_rows", t) for t in roles.values()
    ):
        return None
    return cache, lay


# the layers ------------------------------------------------------------------------------------------
class RoutedExperts:
    """A routed-expert (SwiGLU) layer: its router (``runtime.moe``) picks (expert ids, weights) once per
    call, then one backend op (``runtime.backends``) computes the experts from the layer's expert source."""

    def __init__(
        self,
        weights: Weights,
        layer: int,
        n_used: int,
        observers: list[Observer],
        router: Callable[[Linear], Router] | None = None,
        swiglu_limit: float | None = None,
    ) -> None:
        """``router``: makes the layer's router from its gate projection (default ``SoftmaxTopK``);
        ``swiglu_limit``: the experts' SwiGLU clamp (DeepSeek V4), see ``ExpertSource.swiglu_limit``."""
        p = f"blk.{layer}."
        self.layer, self.n_used, self.observers = layer, n_used, observers
        gate_inp = Linear(weights, p + "ffn_gate_inp.weight", observers)
        self.router = (router or (lambda proj: SoftmaxTopK(proj, layer, n_used, observers)))(gate_inp)
        self.n_used = self.router.n_used
        self.n_expert = self.router.n_expert
        self.source = ExpertSource(weights, layer)
        self.source.swiglu_limit = swiglu_limit
        self.n_ff = self.source.n_ff
        round_in = round_act = None
        if weights.ggml_numerics:  # the types as the file stores them (a HF folder: as forge convert would)
            round_in = ggml_input_rounding(weights.qtype(self.source.up_name))
            round_act = ggml_input_rounding(weights.qtype(self.source.names[2]))
        self.taps = Taps(self.source.names, layer, observers, round_in, round_act)
        self.backend = backends.for_experts(weights, self.source, self.taps)

    def set_mask(self, pruned: torch.Tensor | None) -> None:
        """pruned: (n_expert,) bool, True = never route to this expert; None removes the mask."""
        self.router.set_mask(pruned)

    def __call__(self, x: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """x (T, n_embd) -> the routed experts' output (T, n_embd); ``tokens`` (T,) for hash routing."""
        return self._ffn(x, self.router.logits(x), None, tokens)

    def normed_step(self, h: torch.Tensor, norm: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        """One token: h (1, n_embd) the residual stream -> h + the routed experts' output on rms_norm(h) * norm;
        eps: a (1, 1) tensor."""
        x, logits = self.router.normed_logits(h, norm, eps)
        return self._ffn(x, logits, h)

    def step(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """One token: x (1, n_embd) the normed input, h the residual -> h + the routed experts' output."""
        return self._ffn(x, self.router.logits_step(x), h)

    def _ffn(
        self,
        x: torch.Tensor,
        logits: torch.Tensor,
        h: torch.Tensor | None,
        tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        ids, w = self.router.route(logits, tokens)
        # an observer of each expert's output is served by the reference (which computes those outputs)
        backend = torch_backend if self.observers and self.taps.watchers() else self.backend
        return backend.routed_ffn(x, ids, w, self.source, self.taps, h)


class SharedSwiGLU:
    """A shared expert without an output gate (DeepSeek V4): down(SiLU(gate x) * up x), the SwiGLU clamped
    as its routed experts' is (``limit``; None: unclamped)."""

    def __init__(
        self,
        weights: Weights,
        layer: int,
        observers: list[Observer],
        limit: float | None,
        suffix: str = "_shexp",
    ) -> None:
        """``suffix``: the tensors' (``ffn_gate{suffix}.weight``...); "" for a dense layer's FFN (GLM)."""
        p = f"blk.{layer}."
        self.inputs = FusedLinear(
            weights, [p + f"ffn_gate{suffix}.weight", p + f"ffn_up{suffix}.weight"], observers
        )
        self.down = Linear(weights, p + f"ffn_down{suffix}.weight", observers)
        self.limit = limit

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.inputs(x)
        if self.limit is not None:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return self.down(F.silu(gate) * up)


class SharedExpert:
    def __init__(self, weights: Weights, layer: int, observers: list[Observer]) -> None:
        p = f"blk.{layer}."
        names = ["ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_gate_inp_shexp.weight"]
        self.inputs = FusedLinear(weights, [p + n for n in names], observers)
        self.down = Linear(weights, p + "ffn_down_shexp.weight", observers)
        self.observers = observers

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, scale = self.inputs(x)
        return self.down(F.silu(gate) * up) * torch.sigmoid(scale)

    def step(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """One token: h + the shared expert's output (its gate applied before the down matmul)."""
        if self.inputs.rows is not None:
            for name in self.inputs.names if self.observers else ():
                notify_matmul(self.observers, name, x)
            out, act = cpu_kernels.shared_ffn(x, self.inputs.rows, self.down.rows, h)
            if self.observers:
                notify_matmul(self.observers, self.down.name, act)
            return out
        gate, up, scale = self.inputs.step(x)
        if cuda_fused.available(x):
            return cuda_fused.gated_add(h, self.down.step(cuda_fused.swiglu(gate[None], up[None])), scale)
        return torch.addcmul(h, self.down.step(F.silu(gate).mul_(up)[None]), torch.sigmoid(scale))
