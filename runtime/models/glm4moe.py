"""glm4moe (GLM-4.5 / 4.6 / 4.7): GQA attention with q/k/v biases, optional q/k RMSNorm and partial NEOX
RoPE; ``leading_dense_block_count`` dense SwiGLU layers, then routed experts (sigmoid scores, selection bias
``exp_probs_b``, group-limited top-k, normalized weights times ``expert_weights_scale``) plus an ungated
shared expert. The NextN/MTP block (the last ``nextn_predict_layers`` blocks of the file) is not run.

Every step goes through the batched path (no one-token ``step``: the compiled decode kernels take q/k norms
and no biases).
"""

from __future__ import annotations

import torch

from runtime.layers import AttentionConfig, GQAttention, KVCache
from runtime.models.base import MoeCausalLM, PreNormBlock
from runtime.moe import GroupedScoredTopK, RoutedExperts, SharedSwiGLU
from runtime.observers import Observer
from runtime.weights import Weights


class GlmFfn:
    """A GLM layer's FFN: a dense SwiGLU (the leading layers), or routed experts plus the shared expert."""

    def __init__(self, weights: Weights, layer: int, n_used: int, observers: list[Observer]) -> None:
        p = f"blk.{layer}."
        self.moe: RoutedExperts | None = None
        self.shared: SharedSwiGLU | None = None
        self.dense: SharedSwiGLU | None = None
        if not weights.has(p + "ffn_gate_inp.weight"):
            self.dense = SharedSwiGLU(weights, layer, observers, None, suffix="")
            return
        bias = weights.dense(p + "exp_probs_b.bias") if weights.has(p + "exp_probs_b.bias") else None
        scale = float(weights.hparam("expert_weights_scale", 0.0)) or 1.0  # llama.cpp: 0 = unscaled

        def router(proj):  # noqa: ANN001, ANN202
            return GroupedScoredTopK(
                proj, layer, n_used, observers, int(weights.hparam("expert_gating_func", 2)), bias,
                bool(weights.hparam("expert_weights_norm", False)), scale,
                int(weights.hparam("expert_group_count", 1)), int(weights.hparam("expert_group_used_count", 1)),
            )  # fmt: skip

        self.moe = RoutedExperts(weights, layer, n_used, observers, router=router)
        if weights.has(p + "ffn_up_shexp.weight"):
            self.shared = SharedSwiGLU(weights, layer, observers, None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None:
            return self.dense(x)
        assert self.moe is not None
        y = self.moe(x)
        return y if self.shared is None else y + self.shared(x)


class Glm4MoeBlock(PreNormBlock):
    def __init__(
        self, weights: Weights, layer: int, attn_cfg: AttentionConfig, n_used: int, observers: list[Observer]
    ) -> None:
        super().__init__(weights, layer, attn_cfg.eps, "post_attention_norm")
        self.attn = GQAttention(weights, layer, attn_cfg, observers)
        self.ffn = GlmFfn(weights, layer, n_used, observers)
        self.moe = self.ffn.moe  # the routed experts (None on a dense layer), as the driver finds them


class Glm4MoeModel(MoeCausalLM):
    arch = "glm4moe"

    def __init__(self, weights: Weights, observers: list[Observer] | None = None) -> None:
        super().__init__(weights, observers)
        self.n_layer -= int(weights.hparam("nextn_predict_layers", 0))  # the MTP block is not run
        self.fast_decode = False
        cfg = AttentionConfig.from_weights(weights, self.n_embd, self.eps)
        self.blocks = [
            Glm4MoeBlock(weights, i, cfg, self.n_expert_used, self.observers) for i in range(self.n_layer)
        ]

    def _layer_state(self, layer: int, device: torch.device) -> object:
        return KVCache()
