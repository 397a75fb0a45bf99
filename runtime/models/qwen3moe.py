"""qwen3moe (Qwen3-30B-A3B family): GQA attention with q/k RMSNorm and NEOX RoPE, softmax top-k MoE.

Also the building blocks the other Qwen MoE models reuse: RMSNorm, RoPE, the KV cache, attention,
and the routed-expert FFN (gathering the selected experts, decoding only those).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from forge.errors import ForgeError
from runtime.observers import Observer, notify_matmul, notify_routing
from runtime.weights import ExpertTensor, Weights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class Linear:
    """x @ W.T for a weight decoded at load, reporting its input to the observers."""

    def __init__(self, weights: Weights, name: str, observers: list[Observer]) -> None:
        self.name, self.weight, self.observers = name, weights.dense(name), observers
        if self.weight.dim() == 1:  # a one-output projection may be stored 1-D (ffn_gate_inp_shexp)
            self.weight = self.weight[None, :]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.observers:
            notify_matmul(self.observers, self.name, x)
        return F.linear(x, self.weight)


class Rope:
    """NEOX-style rotary embedding on the first ``n_rot`` dims of each head (llama.cpp's rope type 2)."""

    def __init__(self, n_rot: int, base: float, device: torch.device) -> None:
        self.n_rot = n_rot
        self.inv_freq = 1.0 / (
            base ** (torch.arange(0, n_rot, 2, dtype=torch.float32, device=device) / n_rot)
        )

    def __call__(self, x: torch.Tensor, pos0: int) -> torch.Tensor:
        """x: (T, H, D) at positions pos0..pos0+T-1."""
        t = x.shape[0]
        pos = torch.arange(pos0, pos0 + t, dtype=torch.float32, device=x.device)
        ang = (pos[:, None] * self.inv_freq[None, :])[:, None, :]
        cos, sin = ang.cos(), ang.sin()
        half = self.n_rot // 2
        x1, x2, rest = x[..., :half], x[..., half : self.n_rot], x[..., self.n_rot :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


class KVCache:
    """Keys and values of one attention layer, (capacity, n_head_kv, head_dim), grown by doubling."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        need = self.length + k.shape[0]
        if self.k is None or need > self.k.shape[0]:
            cap = max(256, need, 2 * (0 if self.k is None else self.k.shape[0]))
            new_k = k.new_empty((cap, *k.shape[1:]))
            new_v = v.new_empty((cap, *v.shape[1:]))
            if self.k is not None and self.v is not None:
                new_k[: self.length] = self.k[: self.length]
                new_v[: self.length] = self.v[: self.length]
            self.k, self.v = new_k, new_v
        assert self.v is not None
        self.k[self.length : need] = k
        self.v[self.length : need] = v
        self.length = need
        return self.k[:need], self.v[:need]


class State:
    """Everything a sequence carries between forward calls: its position and per-layer caches."""

    def __init__(self, n_layer: int, max_tokens: int) -> None:
        self.pos = 0
        self.max_tokens = max_tokens
        self.layers: list[object] = [None] * n_layer


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos0: int) -> torch.Tensor:
    """Causal GQA attention. q: (T, H, D) at positions pos0.., k/v: (pos0+T, Hkv, D) -> (T, H*D)."""
    t, n_head, d = q.shape
    n_rep = n_head // k.shape[1]
    if n_rep > 1:
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if t == 1:
        out = F.scaled_dot_product_attention(q, k, v)
    elif pos0 == 0:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        rows = torch.arange(pos0, pos0 + t, device=q.device)[:, None]
        mask = torch.arange(k.shape[1], device=q.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(0, 1).reshape(t, n_head * d)


class RoutedExperts:
    """Softmax top-k routing over stacked experts (SwiGLU), renormalized top-k weights."""

    def __init__(self, weights: Weights, layer: int, n_used: int, observers: list[Observer]) -> None:
        p = f"blk.{layer}."
        self.layer, self.n_used, self.observers = layer, n_used, observers
        self.router = Linear(weights, p + "ffn_gate_inp.weight", observers)
        self.names = (p + "ffn_gate_exps.weight", p + "ffn_up_exps.weight", p + "ffn_down_exps.weight")
        if weights.has(p + "ffn_gate_up_exps.weight"):
            self.gate_up: ExpertTensor | None = weights.experts(p + "ffn_gate_up_exps.weight")
            self.gate = self.up = None
        else:
            self.gate_up = None
            self.gate, self.up = weights.experts(self.names[0]), weights.experts(self.names[1])
        self.down = weights.experts(self.names[2])

    def _report(self, x: torch.Tensor, act: torch.Tensor, ids: torch.Tensor) -> None:
        notify_matmul(self.observers, self.names[0], x, ids)
        notify_matmul(self.observers, self.names[1], x, ids)
        notify_matmul(self.observers, self.names[2], act, ids)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        probs = torch.softmax(logits, dim=-1)
        top_w, top_ids = torch.topk(probs, self.n_used, dim=-1)
        top_w = top_w / top_w.sum(-1, keepdim=True)
        if self.observers:
            notify_routing(self.observers, self.layer, top_ids, top_w, logits)
        ids = top_ids.reshape(-1)
        order = torch.argsort(ids, stable=True)
        sorted_ids = ids[order]
        token = order // self.n_used
        hit, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
        hit_list, counts_list = hit.tolist(), counts.tolist()
        if self.gate_up is not None:
            fused = self.gate_up.per_expert(hit_list)
            n_ff = fused[0].shape[0] // 2
            w_gate, w_up = [w[:n_ff] for w in fused], [w[n_ff:] for w in fused]
        else:
            assert self.gate is not None and self.up is not None
            w_gate, w_up = self.gate.per_expert(hit_list), self.up.per_expert(hit_list)
        w_down = self.down.per_expert(hit_list)

        xs = x[token]
        act = torch.empty(xs.shape[0], w_gate[0].shape[0], dtype=x.dtype, device=x.device)
        start = 0
        for i, n in enumerate(counts_list):
            seg = xs[start : start + n]
            act[start : start + n] = F.silu(F.linear(seg, w_gate[i])) * F.linear(seg, w_up[i])
            start += n
        if self.observers:
            self._report(xs, act, sorted_ids)
        ys = torch.empty_like(xs)
        start = 0
        for i, n in enumerate(counts_list):
            ys[start : start + n] = F.linear(act[start : start + n], w_down[i])
            start += n
        ys *= top_w.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, token, ys)


@dataclass(frozen=True)
class AttentionConfig:
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rope_base: float
    eps: float


class GQAttention:
    """Attention with q/k RMSNorm; ``gated``: q_proj also yields a per-head output gate (Qwen3.5/Next)."""

    def __init__(
        self,
        weights: Weights,
        layer: int,
        cfg: AttentionConfig,
        observers: list[Observer],
        gated: bool = False,
    ) -> None:
        p = f"blk.{layer}."
        self.cfg, self.gated, self.observers = cfg, gated, observers
        q_rows = cfg.n_head * cfg.head_dim * (2 if gated else 1)
        kv_rows = cfg.n_head_kv * cfg.head_dim
        if weights.has(p + "attn_qkv.weight"):
            self.qkv: Linear | None = Linear(weights, p + "attn_qkv.weight", observers)
            self.split = (q_rows, kv_rows, kv_rows)
        else:
            self.qkv = None
            self.q = Linear(weights, p + "attn_q.weight", observers)
            self.k = Linear(weights, p + "attn_k.weight", observers)
            self.v = Linear(weights, p + "attn_v.weight", observers)
        self.out = Linear(weights, p + "attn_output.weight", observers)
        self.q_norm = weights.dense(p + "attn_q_norm.weight")
        self.k_norm = weights.dense(p + "attn_k_norm.weight")
        self.rope = Rope(cfg.n_rot, cfg.rope_base, weights.device)

    def __call__(self, x: torch.Tensor, cache: KVCache, pos0: int) -> torch.Tensor:
        c, t = self.cfg, x.shape[0]
        if self.qkv is not None:
            q, k, v = torch.split(self.qkv(x), self.split, dim=-1)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        gate = None
        if self.gated:
            qg = q.view(t, c.n_head, 2 * c.head_dim)
            q, gate = qg[..., : c.head_dim], qg[..., c.head_dim :].reshape(t, -1)
        q = rms_norm(q.reshape(t, c.n_head, c.head_dim), self.q_norm, c.eps)
        k = rms_norm(k.reshape(t, c.n_head_kv, c.head_dim), self.k_norm, c.eps)
        v = v.reshape(t, c.n_head_kv, c.head_dim)
        q, k = self.rope(q, pos0), self.rope(k, pos0)
        keys, values = cache.append(k, v)
        out = attention(q, keys, values, pos0)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.out(out)


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
        self.vocab_size = self.output.weight.shape[0]
        if not weights.has("token_embd.weight"):
            raise ForgeError(f"{weights.source}: missing tensor token_embd.weight")

    def new_state(self, max_tokens: int | None = None) -> State:
        return State(self.n_layer, max_tokens or self.n_ctx_train)

    def _block(self, layer: int, h: torch.Tensor, state: State) -> torch.Tensor:
        raise NotImplementedError

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, state: State, last_only: bool = False) -> torch.Tensor:
        """tokens (T,) int64 continuing ``state`` -> logits (T, vocab) float32 (or (1, vocab))."""
        t = int(tokens.shape[0])
        if t == 0:
            raise ForgeError("no tokens to evaluate")
        if state.pos + t > state.max_tokens:
            raise ForgeError(f"{state.pos + t} tokens exceed the context of {state.max_tokens}")
        h = self.weights.rows("token_embd.weight", tokens.to(self.weights.device))
        for layer in range(self.n_layer):
            h = self._block(layer, h, state)
        state.pos += t
        if last_only:
            h = h[-1:]
        return self.output(rms_norm(h, self.output_norm, self.eps))


class Qwen3MoeBlock:
    def __init__(
        self, weights: Weights, layer: int, attn_cfg: AttentionConfig, n_used: int, observers: list[Observer]
    ) -> None:
        p = f"blk.{layer}."
        self.eps = attn_cfg.eps
        self.attn_norm = weights.dense(p + "attn_norm.weight")
        self.ffn_norm = weights.dense(p + "ffn_norm.weight")
        self.attn = GQAttention(weights, layer, attn_cfg, observers)
        self.moe = RoutedExperts(weights, layer, n_used, observers)

    def __call__(self, h: torch.Tensor, cache: KVCache, pos0: int) -> torch.Tensor:
        h = h + self.attn(rms_norm(h, self.attn_norm, self.eps), cache, pos0)
        return h + self.moe(rms_norm(h, self.ffn_norm, self.eps))


class Qwen3MoeModel(MoeCausalLM):
    arch = "qwen3moe"

    def __init__(self, weights: Weights, observers: list[Observer] | None = None) -> None:
        super().__init__(weights, observers)
        n_head = int(weights.hparam("attention.head_count"))
        head_dim = int(weights.hparam("attention.key_length", self.n_embd // n_head))
        cfg = AttentionConfig(
            n_head=n_head,
            n_head_kv=int(weights.hparam("attention.head_count_kv", n_head)),
            head_dim=head_dim,
            n_rot=int(weights.hparam("rope.dimension_count", head_dim)),
            rope_base=float(weights.hparam("rope.freq_base", 10000.0)),
            eps=self.eps,
        )
        self.blocks = [
            Qwen3MoeBlock(weights, i, cfg, self.n_expert_used, self.observers) for i in range(self.n_layer)
        ]

    def _block(self, layer: int, h: torch.Tensor, state: State) -> torch.Tensor:
        cache = state.layers[layer]
        if cache is None:
            cache = state.layers[layer] = KVCache()
        assert isinstance(cache, KVCache)
        return self.blocks[layer](h, cache, state.pos)
