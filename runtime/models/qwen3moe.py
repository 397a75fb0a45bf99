"""qwen3moe (Qwen3-30B-A3B family): GQA attention with q/k RMSNorm and NEOX RoPE, softmax top-k MoE."""

from __future__ import annotations

import torch

from runtime.layers import AttentionConfig, GQAttention, KVCache, rms_norm
from runtime.models.base import MoeCausalLM, PreNormBlock, State
from runtime.moe import RoutedExperts
from runtime.observers import Observer
from runtime.weights import Weights

__all__ = ["MoeCausalLM", "Qwen3MoeBlock", "Qwen3MoeModel", "State", "rms_norm"]


class Qwen3MoeBlock(PreNormBlock):
    def __init__(
        self, weights: Weights, layer: int, attn_cfg: AttentionConfig, n_used: int, observers: list[Observer]
    ) -> None:
        super().__init__(weights, layer, attn_cfg.eps)
        self.attn = GQAttention(weights, layer, attn_cfg, observers)
        self.moe = self.ffn = RoutedExperts(weights, layer, n_used, observers)

    def step(self, h: torch.Tensor, cache: KVCache, pos: int, eps: torch.Tensor) -> torch.Tensor:
        h = self.attn.step(h, self.attn_norm, eps, cache, pos)
        return self.moe.normed_step(h, self.ffn_norm, eps)


class Qwen3MoeModel(MoeCausalLM):
    arch = "qwen3moe"

    def __init__(self, weights: Weights, observers: list[Observer] | None = None) -> None:
        super().__init__(weights, observers)
        cfg = AttentionConfig.from_weights(weights, self.n_embd, self.eps)
        self.blocks = [
            Qwen3MoeBlock(weights, i, cfg, self.n_expert_used, self.observers) for i in range(self.n_layer)
        ]

    def _layer_state(self, layer: int, device: torch.device) -> object:
        return KVCache()
