"""The routed-expert (MoE) layer's pieces: the router, computed once per layer call in torch.

A ``Router`` owns the layer's gate projection (``ffn_gate_inp``) and its prune mask, and turns router
logits into (expert ids, weights) -- the one place that decides routing, whatever backend then computes
the experts -- and reports each decision to the observers (``on_routing``). ``SoftmaxTopK`` is Qwen's
routing; other kinds (sigmoid scores + a selection bias + grouped top-k as DeepSeek V3/V4 and GLM route,
hash routing) subclass ``Router`` and override ``select`` (hash routing: also ``route``, which would then
take the token ids).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from forge.errors import ForgeError
from runtime.observers import Observer, notify_routing

# Router score given to pruned experts: finite (like ds4's -1e30) so softmax over a top-k never sees -inf.
MASKED_SCORE = -1e30


class Router:
    """Gate projection, prune mask and expert selection of one layer.

    ``proj``: the gate projection (a ``runtime.models.qwen3moe.Linear``: ``__call__``, ``step``, ``rows``
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
        kept.rows = None if full.rows is None else rows.numpy()
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
    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits (T, n_expert) -> expert ids (T, k) int64 and their weights (T, k) float32."""
        raise NotImplementedError

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``select``, reported to the observers: the one place a routing decision is made."""
        ids, weights = self.select(logits)
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
    top_logits, ids = torch.topk(logits, k, dim=-1)
    return ids, torch.softmax(top_logits, dim=-1)
