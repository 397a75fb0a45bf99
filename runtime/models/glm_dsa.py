"""glm-dsa (GLM-5.x): MLA attention with the DSA lightning indexer (``runtime.attention_mla``), GLM's FFNs
(leading dense layers, then routed experts with sigmoid routing, selection bias and a shared expert, as
``glm4moe``). The NextN/MTP block is not run; every step goes through the batched path."""

from __future__ import annotations

import torch

from runtime.attention_mla import MlaAttention, MlaState, Selection
from runtime.models.base import MoeCausalLM, PreNormBlock
from runtime.models.glm4moe import GlmFfn
from runtime.observers import Observer
from runtime.weights import Weights


def default_indexer_types(n_ctx_train: int, n_layer: int) -> list[bool]:
    """llama.cpp's choice for a file without ``attention.indexer.types``: every layer runs its indexer (GLM-5,
    5.1), unless the context is of a million tokens or more (GLM-5.2: two, then one layer in four)."""
    if n_ctx_train < 1048576:
        return [True] * n_layer
    return [i < 2 or (i - 2) % 4 == 0 for i in range(n_layer)]


class GlmDsaBlock(PreNormBlock):
    def __init__(
        self, weights: Weights, layer: int, eps: float, n_used: int, observers: list[Observer], selection: Selection,
        indexer: bool,
    ) -> None:  # fmt: skip
        super().__init__(weights, layer, eps)
        self.attn = MlaAttention(weights, layer, eps, observers, selection, indexer)
        self.ffn = GlmFfn(weights, layer, n_used, observers)
        self.moe = self.ffn.moe


class GlmDsaModel(MoeCausalLM):
    arch = "glm-dsa"

    def __init__(self, weights: Weights, observers: list[Observer] | None = None) -> None:
        super().__init__(weights, observers)
        self.n_layer -= int(weights.hparam("nextn_predict_layers", 0))  # the MTP block is not run
        self.fast_decode = False
        types = list(
            weights.hparam("attention.indexer.types", default_indexer_types(self.n_ctx_train, self.n_layer))
        )
        selection = Selection()
        self.blocks = [
            GlmDsaBlock(weights, i, self.eps, self.n_expert_used, self.observers, selection, bool(types[i]))
            for i in range(self.n_layer)
        ]

    def _layer_state(self, layer: int, device: torch.device) -> object:
        return MlaState()
