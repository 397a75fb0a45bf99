"""Multi-head latent attention (MLA) with DeepSeek's sparse-attention (DSA) lightning indexer, as GLM-5.x
(``glm-dsa``) runs it: llama.cpp's ``models/glm-dsa.cpp`` graph from the GGUF tensors its converter writes.

Per token the cache keeps the normed kv latent (``kv_lora_rank``) and the roped shared key (``rope`` dims):
queries are absorbed into the latent through ``attn_k_b`` and the attended latent is expanded per head through
``attn_v_b`` (MLA as MQA with one latent head). RoPE is the interleaved kind (ggml's NORM mode). A layer whose
``indexer.types`` entry is true runs the indexer - its own queries from the q latent, one LayerNorm-ed key per
token, both roped on their first ``rope`` dims - and attends only to its ``indexer.top_k`` best keys; the other
layers reuse the selection of the last layer that ran it (``Selection``). llama.cpp also rotates the indexer's
queries and keys by one Hadamard matrix, which leaves their dot products as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.attention_dsv4 import Rope, lightning_choice
from runtime.layers import Linear, rms_norm
from runtime.observers import Observer, notify_matmul
from runtime.weights import Weights

#: the indexer key LayerNorm's epsilon (transformers' GlmMoeDsaIndexer)
INDEXER_NORM_EPS = 1e-6


class Selection:
    """The keys each query attends to, handed from a layer that runs the indexer to the layers that share it."""

    def __init__(self) -> None:
        self.mask: torch.Tensor | None = None  # (T, n) bool


class MlaState:
    def __init__(self) -> None:
        self.latent: torch.Tensor | None = None  # (n, kv_lora_rank)
        self.k_pe: torch.Tensor | None = None  # (n, rope)
        self.index_keys: torch.Tensor | None = None  # (n, indexer head dim), indexer layers only


def _grow(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    return new if old is None else torch.cat([old, new])


class MlaAttention:
    def __init__(
        self,
        weights: Weights,
        layer: int,
        eps: float,
        observers: list[Observer],
        selection: Selection,
        indexer: bool,
    ) -> None:
        p = f"blk.{layer}."
        self.eps, self.selection, self.observers = eps, selection, observers
        self.names = (p + "attn_k_b.weight", p + "attn_v_b.weight")
        self.n_head = int(weights.hparam("attention.head_count"))
        self.kv_lora = int(weights.hparam("attention.kv_lora_rank"))
        self.n_rot = int(weights.hparam("rope.dimension_count"))
        self.nope = int(weights.hparam("attention.key_length_mla")) - self.n_rot
        self.kq_scale = (self.nope + self.n_rot) ** -0.5
        self.q_a = Linear(weights, p + "attn_q_a.weight", observers)
        self.q_a_norm = weights.dense(p + "attn_q_a_norm.weight")
        self.q_b = Linear(weights, p + "attn_q_b.weight", observers)
        self.kv_a = Linear(weights, p + "attn_kv_a_mqa.weight", observers)
        self.kv_a_norm = weights.dense(p + "attn_kv_a_norm.weight")
        self.k_b = weights.dense(p + "attn_k_b.weight")  # (heads, kv_lora, nope)
        self.v_b = weights.dense(p + "attn_v_b.weight")  # (heads, v, kv_lora)
        self.out = Linear(weights, p + "attn_output.weight", observers)
        self.rope = Rope(self.n_rot, float(weights.hparam("rope.freq_base", 10000.0)), weights.device)
        self.indexer = indexer
        if indexer:
            self.i_heads = int(weights.hparam("attention.indexer.head_count"))
            self.i_dim = int(weights.hparam("attention.indexer.key_length"))
            self.top_k = int(weights.hparam("attention.indexer.top_k"))
            self.i_q = Linear(weights, p + "indexer.attn_q_b.weight", observers)
            self.i_k = Linear(weights, p + "indexer.attn_k.weight", observers)
            self.i_norm = (
                weights.dense(p + "indexer.k_norm.weight"),
                weights.dense(p + "indexer.k_norm.bias"),
            )
            self.i_proj = Linear(weights, p + "indexer.proj.weight", observers)

    def _rope_head(self, x: torch.Tensor, cs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Rope on the first ``n_rot`` dims of each head (the indexer's [rope | nope] layout)."""
        return torch.cat([self.rope(x[..., : self.n_rot], cs), x[..., self.n_rot :]], dim=-1)

    def _select(
        self, x: torch.Tensor, qr: torch.Tensor, cs: tuple[torch.Tensor, torch.Tensor], st: MlaState,
        visible: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        t = x.shape[0]
        q = self._rope_head(self.i_q(qr).view(t, self.i_heads, self.i_dim), cs)
        k = F.layer_norm(self.i_k(x), (self.i_dim,), *self.i_norm, INDEXER_NORM_EPS)
        st.index_keys = _grow(st.index_keys, self._rope_head(k, cs))
        w = self.i_proj(x) * (self.i_dim * self.i_heads) ** -0.5
        return lightning_choice(st.index_keys, q, w, visible, self.top_k)

    def __call__(self, x: torch.Tensor, st: MlaState, pos0: int) -> torch.Tensor:
        t, nh = x.shape[0], self.n_head
        cs = self.rope.angles(torch.arange(pos0, pos0 + t))
        qr = rms_norm(self.q_a(x), self.q_a_norm, self.eps)
        q = self.q_b(qr).view(t, nh, self.nope + self.n_rot)
        q_nope, q_pe = q[..., : self.nope], self.rope(q[..., self.nope :], cs)
        kv = self.kv_a(x)
        st.latent = _grow(st.latent, rms_norm(kv[:, : self.kv_lora], self.kv_a_norm, self.eps))
        st.k_pe = _grow(st.k_pe, self.rope(kv[:, None, self.kv_lora :], cs)[:, 0])
        n = st.latent.shape[0]
        visible = (
            torch.arange(n, device=x.device)[None, :]
            <= torch.arange(pos0, pos0 + t, device=x.device)[:, None]
        )
        if self.indexer:
            self.selection.mask = self._select(x, qr, cs, st, visible)
        elif self.selection.mask is None or self.selection.mask.shape != visible.shape:
            raise RuntimeError("a shared-indexer layer runs before any layer with its own indexer")
        if self.observers:  # per head, as llama-imatrix sees the absorbed products' inputs (head-major rows)
            notify_matmul(self.observers, self.names[0], q_nope.reshape(t, -1))
        q_abs = torch.einsum("thn,hkn->thk", q_nope, self.k_b)  # queries absorbed into the latent
        scores = torch.einsum("thk,sk->ths", q_abs, st.latent) + torch.einsum("thr,sr->ths", q_pe, st.k_pe)
        scores = (scores * self.kq_scale).masked_fill(~self.selection.mask[:, None, :], float("-inf"))
        latent_out = torch.einsum("ths,sk->thk", torch.softmax(scores, dim=-1), st.latent)
        if self.observers:
            notify_matmul(self.observers, self.names[1], latent_out.reshape(t, -1))
        return self.out(torch.einsum("thk,hvk->thv", latent_out, self.v_b).reshape(t, -1))
