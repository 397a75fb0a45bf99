"""qwen35moe (Qwen3.5 MoE): Gated DeltaNet layers, with every ``full_attention_interval``-th layer a gated
full-attention layer; routed experts plus a sigmoid-gated shared expert.

Computes llama.cpp's graph from the GGUF tensors as its converter writes them: norms store 1 + w,
``ssm_a`` = -exp(A_log), value heads tiled (value head h reads key head h % n_k_heads).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime import cpu_kernels
from runtime.models.qwen3moe import (
    AttentionConfig,
    FusedLinear,
    GQAttention,
    KVCache,
    Linear,
    MoeCausalLM,
    RoutedExperts,
    rms_norm,
    rms_norm_row,
)
from runtime.observers import Observer, notify_matmul
from runtime.weights import Weights

_CHUNK = 64  # tokens per chunk of the chunked delta rule (same as llama.cpp's)


def l2_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(eps)


def delta_rule_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, s: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token. q, k: (H, dk); v: (H, dv); g, beta: (H,); s: (H, dk, dv) -> out (H, dv), new state."""
    s = s * torch.exp(g)[:, None, None]
    predicted = torch.einsum("hk,hkv->hv", k, s)
    delta = (v - predicted) * beta[:, None]
    s = s + k[:, :, None] * delta[:, None, :]
    return torch.einsum("hk,hkv->hv", q, s), s


def delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    s: torch.Tensor,
    chunk: int = _CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over T tokens, chunk by chunk (WY form; a loop over chunks only).

    q, k: (T, H, dk); v: (T, H, dv); g (log decay), beta: (T, H); s: (H, dk, dv).
    Per token: S <- exp(g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q.
    Inside a chunk with cumulative log decay G, the u's solve (I + A) U = beta V - beta exp(G) K S0 with
    A[i, j] = beta_i exp(G_i - G_j) k_i.k_j (j < i); that lower-triangular solve is batched over all chunks.
    """
    t, n_head, dk = k.shape
    c = min(chunk, t)
    pad = (-t) % c
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))  # (H, T', d)
    g, beta = (F.pad(x.transpose(0, 1), (0, pad)) for x in (g, beta))  # padding: no decay, no update
    n = (t + pad) // c
    q, k, v = (x.reshape(n_head, n, c, -1) for x in (q, k, v))
    g, beta = g.reshape(n_head, n, c), beta.reshape(n_head, n, c)

    cum = g.cumsum(-1)
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = torch.exp((cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")))
    k_beta = k * beta[..., None]
    lower = (k_beta @ k.transpose(-1, -2)) * decay.masked_fill(
        torch.eye(c, dtype=torch.bool, device=q.device), 0
    )
    system = lower + torch.eye(c, dtype=q.dtype, device=q.device)
    w_v = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w_k = torch.linalg.solve_triangular(
        system, k_beta * torch.exp(cum)[..., None], upper=False, unitriangular=True
    )
    qk = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * torch.exp(cum)[..., None]
    k_to_end = k * torch.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = torch.exp(cum[..., -1])[..., None, None]

    out = torch.empty_like(v)
    for i in range(n):
        u = w_v[:, i] - w_k[:, i] @ s
        out[:, i] = q_decayed[:, i] @ s + qk[:, i] @ u
        s = s * chunk_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ u
    return out.reshape(n_head, n * c, -1)[:, :t].transpose(0, 1), s


class DeltaNetState:
    def __init__(self, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        self.conv, self.recurrent = conv, recurrent


class GatedDeltaNet:
    """The linear-attention token mixer: qkv projection, causal depthwise conv, gated delta rule, gated norm."""

    def __init__(self, weights: Weights, layer: int, eps: float, observers: list[Observer]) -> None:
        p = f"blk.{layer}."
        self.eps = eps
        self.n_k = int(weights.hparam("ssm.group_count"))
        self.n_v = int(weights.hparam("ssm.time_step_rank"))
        self.d_k = int(weights.hparam("ssm.state_size"))
        self.d_v = int(weights.hparam("ssm.inner_size")) // self.n_v
        names = ["attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight", "ssm_alpha.weight"]
        self.inputs = FusedLinear(weights, [p + n for n in names], observers)
        self.out = Linear(weights, p + "ssm_out.weight", observers)
        self.conv_w = weights.dense(p + "ssm_conv1d.weight")  # (channels, kernel)
        self.dt_bias = weights.dense(p + "ssm_dt.bias")
        self.a = weights.dense(p + "ssm_a")  # -exp(A_log)
        self.norm = weights.dense(p + "ssm_norm.weight")
        self.observers = observers
        # one-token path: q and k heads l2-normalized together, q's rows carrying the 1/sqrt(d_k) scale
        self.qk_scale = torch.cat([torch.full((self.n_k, 1), self.d_k**-0.5), torch.ones(self.n_k, 1)]).to(
            weights.device
        )
        self.conv_rows = self.conv_w.T.contiguous()  # (kernel, channels)
        self.conv_kernel_rows = self.conv_rows.numpy() if weights.cpu_kernels else None

    def new_state(self, device: torch.device) -> DeltaNetState:
        channels, kernel = self.conv_w.shape
        return DeltaNetState(
            torch.zeros(kernel - 1, channels, device=device),
            torch.zeros(self.n_v, self.d_k, self.d_v, device=device),
        )

    def __call__(self, x: torch.Tensor, st: DeltaNetState) -> torch.Tensor:
        t = x.shape[0]
        mixed, z, beta, alpha = self.inputs(x)
        beta = torch.sigmoid(beta)
        g = F.softplus(alpha + self.dt_bias) * self.a

        window = torch.cat([st.conv, mixed])
        st.conv = window[t:].clone()
        conv = F.conv1d(window.T[None], self.conv_w[:, None, :], groups=self.conv_w.shape[0])[0].T
        conv = F.silu(conv)

        key_dim = self.n_k * self.d_k
        q = l2_normalize(conv[:, :key_dim].reshape(t, self.n_k, self.d_k), self.eps)
        k = l2_normalize(conv[:, key_dim : 2 * key_dim].reshape(t, self.n_k, self.d_k), self.eps)
        v = conv[:, 2 * key_dim :].reshape(t, self.n_v, self.d_v)
        rep = self.n_v // self.n_k
        q = q.repeat(1, rep, 1) * self.d_k**-0.5  # tiled: value head h uses key head h % n_k
        k = k.repeat(1, rep, 1)
        if t == 1:
            o, st.recurrent = delta_rule_step(q[0], k[0], v[0], g[0], beta[0], st.recurrent)
            o = o[None]
        else:
            o, st.recurrent = delta_rule_chunked(q, k, v, g, beta, st.recurrent)
        o = rms_norm(o, self.norm, self.eps) * F.silu(z.reshape(t, self.n_v, self.d_v))
        return self.out(o.reshape(t, -1))

    def step(self, h: torch.Tensor, norm: torch.Tensor, eps: torch.Tensor, st: DeltaNetState) -> torch.Tensor:
        """One token (no ggml numerics): h (1, n_embd) the residual stream, norm the block's input RMSNorm
        weight, eps a (1, 1) tensor -> h + mixer."""
        if self.inputs.rows is not None:
            st.conv, st.recurrent = st.conv.contiguous(), st.recurrent.contiguous()
            out, x, o = cpu_kernels.deltanet_step(
                h, norm, self.eps, self.inputs.rows, self.n_k, st.conv, self.conv_kernel_rows, self.dt_bias,
                self.a, self.norm, st.recurrent, self.out.rows,
            )  # fmt: skip
            if self.observers:
                for name in self.inputs.names:
                    notify_matmul(self.observers, name, x)
                notify_matmul(self.observers, self.out.name, o)
            return out
        x = rms_norm_row(h, norm, eps)
        mixed, z, beta, alpha = self.inputs.step(x)
        window = torch.cat([st.conv, mixed[None]])
        st.conv = window[1:]
        conv = F.silu((window * self.conv_rows).sum(0))
        key_dim = self.n_k * self.d_k
        qk = conv[: 2 * key_dim].view(2 * self.n_k, self.d_k)
        qk = qk * (self.qk_scale / torch.linalg.vector_norm(qk, dim=-1, keepdim=True).clamp_min(self.eps))
        rep = self.n_v // self.n_k
        if rep > 1:  # tiled: value head h uses key head h % n_k
            qk = qk.view(2, 1, self.n_k, self.d_k).expand(2, rep, self.n_k, self.d_k)
        qk = qk.reshape(2, self.n_v, 1, self.d_k)
        q, k = qk[0], qk[1]
        v = conv[2 * key_dim :].view(self.n_v, 1, self.d_v)
        g = F.softplus(alpha + self.dt_bias) * self.a
        s = st.recurrent * torch.exp(g).view(-1, 1, 1)
        delta = (v - torch.bmm(k, s)) * torch.sigmoid(beta).view(-1, 1, 1)
        s = torch.baddbmm(s, k.transpose(1, 2), delta)
        st.recurrent = s
        o = torch.bmm(q, s).view(self.n_v, self.d_v)
        o = (rms_norm(o, self.norm, self.eps) * F.silu(z.view(self.n_v, self.d_v))).view(1, -1)
        return self.out.step(o, h)


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
        act = F.silu(gate).mul_(up)
        if self.observers:
            notify_matmul(self.observers, self.down.name, act[None])
        return torch.addmm(h, act.mul_(torch.sigmoid(scale))[None], self.down.weight_t)


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

    def __call__(self, h: torch.Tensor, cache: KVCache | DeltaNetState, pos0: int) -> torch.Tensor:
        x = rms_norm(h, self.attn_norm, self.eps)
        if isinstance(self.mixer, GatedDeltaNet):
            assert isinstance(cache, DeltaNetState)
            h = h + self.mixer(x, cache)
        else:
            assert isinstance(cache, KVCache)
            h = h + self.mixer(x, cache, pos0)
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
