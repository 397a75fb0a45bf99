"""qwen35moe (Qwen3.5 MoE): Gated DeltaNet layers, with every ``full_attention_interval``-th layer a gated
full-attention layer; routed experts plus a sigmoid-gated shared expert.

Computes llama.cpp's graph from the GGUF tensors as its converter writes them: norms store 1 + w,
``ssm_a`` = -exp(A_log), value heads tiled (value head h reads key head h % n_k_heads).
"""

from __future__ import annotations

import torch

from runtime.layers import (
    AttentionConfig,
    DeltaNetState,
    GatedDeltaNet,
    GQAttention,
    KVCache,
    delta_rule_chunked,
    delta_rule_step,
    rms_norm,
    rms_norm_row,
)
from runtime.models.base import MoeCausalLM
from runtime.moe import RoutedExperts, SharedExpert
from runtime.observers import Observer
from runtime.weights import Weights

__all__ = ["Qwen35MoeBlock", "Qwen35MoeModel", "delta_rule_chunked", "delta_rule_step"]


class Qwen35MoeBlock:
    def __init__(
        self,
        weights: Weights,
        layer: int,
        recurrent: bool,
        attn_cfg: AttentionConfig,
        n_used: int,
        observers: list[Observer],
    ) -> None:
        p = f"blk.{layer}."
        self.eps = attn_cfg.eps
        self.recurrent = recurrent
        self.attn_norm = weights.dense(p + "attn_norm.weight")
        self.post_norm = weights.dense(p + "post_attention_norm.weight")
        self.mixer: GatedDeltaNet | GQAttention
        if recurrent:
            self.mixer = GatedDeltaNet(weights, layer, attn_cfg.eps, observers)
        else:
            self.mixer = GQAttention(weights, layer, attn_cfg, observers, gated=True)
        self.moe = RoutedExperts(weights, layer, n_used, observers)
        self.shared = (
            SharedExpert(weights, layer, observers) if weights.has(p + "ffn_up_shexp.weight") else None
        )

    def __call__(
        self, h: torch.Tensor, cache: KVCache | DeltaNetState, pos0: int, rows: slice | None = None
    ) -> torch.Tensor:
        x = rms_norm(h, self.attn_norm, self.eps)
        if isinstance(self.mixer, GatedDeltaNet):
            assert isinstance(cache, DeltaNetState)
            h = h + self.mixer(x, cache)
        else:
            assert isinstance(cache, KVCache)
            h = h + self.mixer(x, cache, pos0)
        if rows is not None:
            h = h[rows]
        x = rms_norm(h, self.post_norm, self.eps)
        y = self.moe(x)
        if self.shared is not None:
            y = y + self.shared(x)
        return h + y

    def step(
        self, h: torch.Tensor, cache: KVCache | DeltaNetState, pos: int, eps: torch.Tensor
    ) -> torch.Tensor:
        if isinstance(self.mixer, GatedDeltaNet):
            assert isinstance(cache, DeltaNetState)
            h = self.mixer.step(h, self.attn_norm, eps, cache)
        else:
            assert isinstance(cache, KVCache)
            h = self.mixer.step(h, self.attn_norm, eps, cache, pos)
        x = rms_norm_row(h, self.post_norm, eps)
        if self.shared is not None:
            h = self.shared.step(x, h)
        return self.moe.step(x, h)


class Qwen35MoeModel(MoeCausalLM):
    arch = "qwen35moe"

    def __init__(self, weights: Weights, observers: list[Observer] | None = None) -> None:
        super().__init__(weights, observers)
        cfg = AttentionConfig.from_weights(weights, self.n_embd, self.eps)
        interval = int(weights.hparam("full_attention_interval", 4))
        self.blocks = [
            Qwen35MoeBlock(weights, i, (i + 1) % interval != 0, cfg, self.n_expert_used, self.observers)
            for i in range(self.n_layer)
        ]

    def _layer_state(self, layer: int, device: torch.device) -> object:
        mixer = self.blocks[layer].mixer
        return mixer.new_state(device) if isinstance(mixer, GatedDeltaNet) else KVCache()
