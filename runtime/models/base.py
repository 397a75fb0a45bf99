"""The shared driver of the MoE causal LMs: embedding, a stack of blocks, final norm and LM head, and the
per-sequence State; a model module composes its blocks from ``runtime.layers`` and ``runtime.moe``."""

from __future__ import annotations

from typing import Any

import torch

from forge.errors import ForgeError
from runtime import cpu_kernels
from runtime.backends import cuda_graph
from runtime.layers import Linear, rms_norm
from runtime.moe import RoutedExperts
from runtime.observers import Observer
from runtime.weights import Weights


class State:
    """Everything a sequence carries between forward calls: its position and per-layer caches."""

    def __init__(self, n_layer: int, max_tokens: int) -> None:
        self.pos = 0
        self.max_tokens = max_tokens
        self.layers: list[object] = [None] * n_layer
        self.graphs: Any = None  # its captured decode steps (runtime.backends.cuda_graph), on CUDA


class PreNormBlock:
    """A decoder block ``h + attn(norm(h))``, then ``+ ffn(norm(h))`` (qwen3moe, glm4moe, glm-dsa): the norms are
    ``attn_norm`` and ``ffn_norm`` (the file's name of the second one); a subclass sets ``attn`` and ``ffn``."""

    attn: Any
    ffn: Any

    def __init__(self, weights: Weights, layer: int, eps: float, ffn_norm: str = "ffn_norm") -> None:
        p = f"blk.{layer}."
        self.eps = eps
        self.attn_norm = weights.dense(p + "attn_norm.weight")
        self.ffn_norm = weights.dense(p + ffn_norm + ".weight")

    def __call__(self, h: torch.Tensor, cache: Any, pos0: int, rows: slice | None = None) -> torch.Tensor:
        h = h + self.attn(rms_norm(h, self.attn_norm, self.eps), cache, pos0)
        if rows is not None:
            h = h[rows]
        return h + self.ffn(rms_norm(h, self.ffn_norm, self.eps))


class MoeCausalLM:
    """Shared driver: embedding, a stack of blocks, final norm and LM head; per-sequence State."""

    arch = ""

    def __init__(self, weights: Weights, observers: list[Observer] | None = None) -> None:
        self.weights = weights
        self.observers: list[Observer] = observers if observers is not None else []
        self.n_layer = int(weights.hparam("block_count"))
        self.n_embd = int(weights.hparam("embedding_length"))
        self.n_ctx_train = int(weights.hparam("context_length"))
        self.eps = float(weights.hparam("attention.layer_norm_rms_epsilon"))
        self.n_expert = int(weights.hparam("expert_count", 0))
        self.n_expert_used = int(weights.hparam("expert_used_count", 0))
        if self.n_expert <= 0 or not 0 < self.n_expert_used <= self.n_expert:
            raise ForgeError(f"{weights.source}: expert_count/expert_used_count missing or invalid")
        self.output_norm = weights.dense("output_norm.weight")
        head = "output.weight" if weights.has("output.weight") else "token_embd.weight"
        self.output = Linear(weights, head, self.observers)
        self.vocab_size = self.output.n_out
        if not weights.has("token_embd.weight"):
            raise ForgeError(f"{weights.source}: missing tensor token_embd.weight")
        # one-token forward passes take each block's ``step`` (not with ggml numerics: llama.cpp's roundings)
        self.fast_decode = not weights.ggml_numerics
        self.eps_row = torch.full((1, 1), self.eps, device=weights.device)
        self.mask_generation = 0  # bumped by each prune-mask change (captured decode steps read the mask)
        self.warm_spans: set[int] = set()  # attention spans the captured form of the step has run at

    def routed_layers(self) -> list[int]:
        """Indices of the layers with routed experts, in order (one prune-mask line each)."""
        return [
            i
            for i, b in enumerate(getattr(self, "blocks", []))
            if isinstance(getattr(b, "moe", None), RoutedExperts)
        ]

    def set_prune_mask(self, pruned: torch.Tensor | None) -> int:
        """pruned: (routed layers, n_expert) bool, True = pruned; None removes it. Returns the experts masked."""
        layers = self.routed_layers()
        if pruned is not None and tuple(pruned.shape) != (len(layers), self.n_expert):
            raise ForgeError(
                f"a prune mask for this model needs {len(layers)} lines of {self.n_expert} experts, "
                f"got {tuple(pruned.shape)}"
            )
        for row, layer in enumerate(layers):
            self.blocks[layer].moe.set_mask(None if pruned is None else pruned[row])  # type: ignore[attr-defined]
        self.mask_generation += 1
        return 0 if pruned is None else int(pruned.sum())

    def new_state(self, max_tokens: int | None = None) -> State:
        return State(self.n_layer, max_tokens or self.n_ctx_train)

    def _layer_state(self, layer: int, device: torch.device) -> object:
        """A fresh cache (KV cache or recurrent state) for one layer."""
        raise NotImplementedError

    def _block(self, layer: int, h: torch.Tensor, state: State, rows: slice | None = None) -> torch.Tensor:
        """Block ``layer`` over h; ``rows``: the rows its FFN computes (all if None), after the attention has
        filled the cache with every row's keys and values."""
        cache = state.layers[layer]
        if cache is None:
            cache = state.layers[layer] = self._layer_state(layer, h.device)
        return self.blocks[layer](h, cache, state.pos, rows)  # type: ignore[attr-defined]

    def _ffn_rows(self, layer: int, last_only: bool) -> slice | None:
        """The rows block ``layer``'s FFN computes (None: all): with ``last_only``, the last block computes the
        last one (as llama.cpp's output ids: one token's experts instead of a batch's), unless observers
        collect that layer's statistics."""
        if last_only and layer == self.n_layer - 1 and not self.observers:
            return slice(-1, None)
        return None

    def _decode_step(self, tokens: torch.Tensor, state: State) -> torch.Tensor:
        """The one-token path: each block's ``step`` (fewer, fused ops; residuals folded into matmuls)."""
        h = self.weights.rows("token_embd.weight", tokens.to(self.weights.device))
        layers = state.layers
        if layers[0] is None:
            for i in range(self.n_layer):
                layers[i] = self._layer_state(i, h.device)
        if self.weights.cpu_kernels:
            cpu_kernels.use_threads(torch.get_num_threads())
        if not self.observers and cuda_graph.enabled(self):
            if state.graphs is None:
                state.graphs = cuda_graph.DecodeGraphs(self, h.device)
            logits = state.graphs.step(h, state)
        else:
            logits = self.decode_layers(h, layers, state.pos)
        state.pos += 1
        return logits

    def decode_layers(self, h: torch.Tensor, layers: list[object], pos: int) -> torch.Tensor:
        """One token's embedding h (1, n_embd) at ``pos`` through every block's ``step`` -> logits (1, vocab)."""
        eps = self.eps_row
        for block, cache in zip(self.blocks, layers, strict=True):  # type: ignore[attr-defined]
            h = block.step(h, cache, pos, eps)
        return self.output.normed_step(h, self.output_norm, eps)

    @staticmethod
    def _token_count(tokens: torch.Tensor, state: State) -> int:
        """How many tokens a forward call evaluates; a ForgeError for none or for more than ``state`` holds."""
        t = int(tokens.shape[0])
        if t == 0:
            raise ForgeError("no tokens to evaluate")
        if state.pos + t > state.max_tokens:
            raise ForgeError(f"{state.pos + t} tokens exceed the context of {state.max_tokens}")
        return t

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, state: State, last_only: bool = False) -> torch.Tensor:
        """tokens (T,) int64 continuing ``state`` -> logits (T, vocab) float32 (or (1, vocab))."""
        t = self._token_count(tokens, state)
        if t == 1 and self.fast_decode:
            return self._decode_step(tokens, state)
        h = self.weights.rows("token_embd.weight", tokens.to(self.weights.device))
        for layer in range(self.n_layer):
            h = self._block(layer, h, state, self._ffn_rows(layer, last_only))
        state.pos += t
        if last_only:
            h = h[-1:]
        return self.output(rms_norm(h, self.output_norm, self.eps))
