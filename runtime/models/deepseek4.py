"""deepseek4 (DeepSeek V4 Flash / Pro): hyper-connected residual streams (``runtime.hyper_connections``),
compressed sliding-window attention (``runtime.attention_dsv4``) and a MoE whose first
``hash_layer_count`` layers route by token id (``ffn_gate_tid2eid``) and the others by their scores plus
a selection bias; scores sqrt(softplus) (or sigmoid / softmax, ``expert_gating_func``), weights
renormalized (``expert_weights_norm``) and scaled (``expert_weights_scale``); experts and shared expert
with a clamped SwiGLU (``swiglu_clamp_exp`` / ``_shexp``). The MTP block (``nextn``) is not used.

Computes llama.cpp's ``models/deepseek4.cpp`` graph from the GGUF tensors as its converter writes them.
"""

from __future__ import annotations

import torch

from forge.errors import ForgeError
from runtime.attention_dsv4 import Dsv4Attention, Dsv4AttentionState
from runtime.hyper_connections import HyperConnection, HyperHead
from runtime.layers import rms_norm
from runtime.models.base import MoeCausalLM, State
from runtime.moe import HashRouter, RoutedExperts, ScoredTopK, SharedSwiGLU
from runtime.observers import Observer
from runtime.weights import Weights


def _per_layer(weights: Weights, key: str, n_layer: int) -> list[float | None]:
    """A per-layer float key (a scalar for all layers, or an array); None (or <= 1e-6) where absent."""
    value = weights.hparam(key, None)
    values = [value] * n_layer if value is None or isinstance(value, (int, float)) else list(value)
    return [None if v is None or float(v) <= 1e-6 else float(v) for v in values[:n_layer]]


class Deepseek4Block:
    def __init__(self, weights: Weights, layer: int, model: Deepseek4Model) -> None:
        p = f"blk.{layer}."
        eps, obs = model.eps, model.observers
        hc = (model.hc, model.sinkhorn_iters, model.hc_eps, eps)
        self.eps = eps
        self.attn_hc = HyperConnection(weights, p + "hc_attn", *hc)
        self.ffn_hc = HyperConnection(weights, p + "hc_ffn", *hc)
        self.attn_norm = weights.dense(p + "attn_norm.weight")
        self.ffn_norm = weights.dense(p + "ffn_norm.weight")
        self.attn = Dsv4Attention(weights, layer, eps, obs)
        self.hashed = layer < model.n_hash_layers
        gating, norm, scale = model.gating, model.norm_weights, model.weights_scale
        if self.hashed:
            table = weights.table(p + "ffn_gate_tid2eid.weight")
            if table.shape != (model.vocab_size, model.n_expert_used):
                raise ForgeError(
                    f"{weights.source}: {p}ffn_gate_tid2eid.weight has shape {tuple(table.shape)}"
                )
            if int(table.min()) < 0 or int(table.max()) >= model.n_expert:
                raise ForgeError(f"{weights.source}: {p}ffn_gate_tid2eid.weight names experts out of range")

            def router(proj):  # noqa: ANN001, ANN202
                return HashRouter(proj, layer, obs, table, gating, norm, scale)
        else:
            bias = weights.dense(p + "exp_probs_b.bias")

            def router(proj):  # noqa: ANN001, ANN202
                return ScoredTopK(proj, layer, model.n_expert_used, obs, gating, bias, norm, scale)

        self.moe = RoutedExperts(weights, layer, model.n_expert_used, obs, router, model.clamp_exp[layer])
        self.shared = SharedSwiGLU(weights, layer, obs, model.clamp_shexp[layer])

    def __call__(
        self,
        streams: torch.Tensor,
        cache: Dsv4AttentionState,
        pos0: int,
        tokens: torch.Tensor,
        rows: slice | None = None,
    ) -> torch.Tensor:
        """``rows``: the rows the FFN computes (all if None; see ``MoeCausalLM._ffn_rows``)."""
        x, post, comb = self.attn_hc.collapse(streams)
        out = self.attn(rms_norm(x, self.attn_norm, self.eps), cache, pos0)
        streams = HyperConnection.expand(out, streams, post, comb)
        if rows is not None:
            streams, tokens = streams[rows], tokens[rows]
        x, post, comb = self.ffn_hc.collapse(streams)
        x = rms_norm(x, self.ffn_norm, self.eps)
        out = self.moe(x, tokens) + self.shared(x)
        return HyperConnection.expand(out, streams, post, comb)


class Deepseek4Model(MoeCausalLM):
    arch = "deepseek4"

    def __init__(self, weights: Weights, observers: list[Observer] | None = None) -> None:
        super().__init__(weights, observers)
        self.n_layer -= int(weights.hparam("nextn_predict_layers", 0))  # the MTP block is not run
        self.fast_decode = False  # one token takes the batch path (no compiled one-token kernels for V4)
        self.hc = int(weights.hparam("hyper_connection.count"))
        self.sinkhorn_iters = int(weights.hparam("hyper_connection.sinkhorn_iterations"))
        self.hc_eps = float(weights.hparam("hyper_connection.epsilon"))
        self.n_hash_layers = int(weights.hparam("hash_layer_count", 0))
        self.gating = int(weights.hparam("expert_gating_func", 4))
        self.norm_weights = bool(weights.hparam("expert_weights_norm", False))
        self.weights_scale = float(weights.hparam("expert_weights_scale", 1.0)) or 1.0
        self.clamp_exp = _per_layer(weights, "swiglu_clamp_exp", self.n_layer)
        shexp = weights.hparam("swiglu_clamp_shexp", None)
        self.clamp_shexp = (
            self.clamp_exp if shexp is None else _per_layer(weights, "swiglu_clamp_shexp", self.n_layer)
        )
        self.head = HyperHead(weights, self.hc_eps, self.eps)
        self.blocks = [Deepseek4Block(weights, i, self) for i in range(self.n_layer)]

    def routed_layers(self) -> list[int]:
        """The layers a prune mask covers: routed by scores, not the hash-routed ones."""
        return [i for i, b in enumerate(self.blocks) if not b.hashed]

    def _layer_state(self, layer: int, device: torch.device) -> object:
        return Dsv4AttentionState()

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, state: State, last_only: bool = False) -> torch.Tensor:
        """tokens (T,) int64 continuing ``state`` -> logits (T, vocab) float32 (or (1, vocab))."""
        t = self._token_count(tokens, state)
        tokens = tokens.to(self.weights.device)
        h = self.weights.rows("token_embd.weight", tokens)
        streams = h[:, None, :].expand(t, self.hc, h.shape[-1])
        for layer, block in enumerate(self.blocks):
            if state.layers[layer] is None:
                state.layers[layer] = self._layer_state(layer, h.device)
            streams = block(streams, state.layers[layer], state.pos, tokens, self._ffn_rows(layer, last_only))
        state.pos += t
        if last_only:
            streams = streams[-1:]
        return self.output(rms_norm(self.head(streams), self.output_norm, self.eps))
