"""DeepSeek V4 attention: one shared key/value head (K = V), partial interleaved RoPE, per-head sinks and a
grouped low-rank output projection, over three kinds of keys per layer (``compress_ratios[layer]``):

- 0: sliding window only (the last ``sliding_window`` tokens, the query's own included);
- 128 (heavily compressed attention, HCA): also one compressed entry per closed window of 128 tokens
  (softmax-gated sum of the window's projected rows, RMS-normed, roped at the window's first position);
- 4 (compressed sparse attention, CSA): compressed entries over overlapping windows of 8 tokens (the
  previous window's first half-channels with the current window's second half), of which the lightning
  indexer keeps the ``indexer.top_k`` best per query: sum over its heads of w_h ReLU(q_h . k), on its own
  compressed keys.

A query at position p sees compressed entry w iff w < (p + 1) // ratio (its window is closed). Compressed
layers rope with ``compress_rope_freq_base`` and the YaRN scaling of the file; sliding layers with the plain
``rope.freq_base``. The attention output's rope dims are rotated back by the query position before the
output projection (llama.cpp's ``ggml_rope_ext_back``). Computes llama.cpp's ``models/deepseek4.cpp`` graph
(and transformers' ``DeepseekV4Attention``) from the GGUF tensors as llama.cpp's converter writes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from forge.errors import ForgeError
from runtime.layers import Linear, rms_norm
from runtime.observers import Observer, notify_matmul
from runtime.weights import Weights

CSA_RATIO, HCA_RATIO = 4, 128
QUERY_BLOCK = 256  # queries whose attention is computed together


@dataclass(frozen=True)
class Yarn:
    """llama.cpp's YaRN parameters (``rope.scaling.*``): the angle of pair i mixes the interpolated angle
    (times ``freq_scale``) and the original one by a ramp over the pairs between the correction dims."""

    freq_scale: float
    n_ctx_orig: int
    beta_fast: float
    beta_slow: float

    def corr_dims(self, n_rot: int, base: float) -> tuple[float, float]:
        def dim(beta: float) -> float:
            return n_rot * math.log(self.n_ctx_orig / (beta * 2 * math.pi)) / (2 * math.log(base))

        return max(0.0, math.floor(dim(self.beta_fast))), min(n_rot - 1.0, math.ceil(dim(self.beta_slow)))


class Rope:
    """Interleaved (GPT-J, ggml's NORM mode) rotary embedding of the last ``n_rot`` dims of each head;
    pairs (2i, 2i+1) rotate by pos * base^(-2i / n_rot). llama.cpp cancels YaRN's magnitude scaling for
    DeepSeek V4 (its attn_factor), so only the angles change."""

    def __init__(self, n_rot: int, base: float, device: torch.device, yarn: Yarn | None = None) -> None:
        self.n_rot = n_rot
        inv_freq = base ** (-torch.arange(0, n_rot, 2, dtype=torch.float64) / n_rot)
        if yarn is not None and yarn.freq_scale != 1.0:
            low, high = yarn.corr_dims(n_rot, base)
            ramp = 1 - ((torch.arange(n_rot // 2, dtype=torch.float64) - low) / max(0.001, high - low)).clamp(
                0, 1
            )
            mix = ramp  # llama.cpp's ext_factor: 1 under YaRN
            inv_freq = inv_freq * yarn.freq_scale * (1 - mix) + inv_freq * mix
        self.inv_freq = inv_freq.to(device)

    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) -> cos, sin (T, n_rot / 2) float32."""
        ang = positions.to(self.inv_freq.device, torch.float64)[:, None] * self.inv_freq[None, :]
        return ang.cos().float(), ang.sin().float()

    def __call__(
        self, x: torch.Tensor, cs: tuple[torch.Tensor, torch.Tensor], inverse: bool = False
    ) -> torch.Tensor:
        """x (T, ..., D): its last n_rot dims rotated by the (T, n_rot / 2) angles ``cs`` (backwards: inverse)."""
        cos, sin = cs
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
        cos, sin = cos.view(shape), sin.view(shape)
        if inverse:
            sin = -sin
        rot = x[..., -self.n_rot :]
        even, odd = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
        return torch.cat([x[..., : -self.n_rot], out], dim=-1)


class CompressorState:
    """What a compressor carries between calls: the projected rows of the window not yet closed, the
    previous closed window's first half-channels (overlapping windows) and the compressed entries so far."""

    def __init__(self) -> None:
        self.kv: torch.Tensor | None = None  # (rows since the open window's start, width)
        self.gate: torch.Tensor | None = None
        self.prev: tuple[torch.Tensor, torch.Tensor] | None = None  # (ratio, head_dim) kv and gate
        self.entries: torch.Tensor | None = None  # (n, head_dim)

    @property
    def n_entries(self) -> int:
        return 0 if self.entries is None else int(self.entries.shape[0])


class Compressor:
    """One compressor (``attn_compressor_*`` or ``indexer_compressor_*``): each closed window of ``ratio``
    tokens -> one entry rms_norm(sum_j softmax_j(gate_j + ape_j) * kv_j), roped at the window's start.
    With ``overlap`` (ratio 4) the rows are 2 head_dim wide and an entry's window is the previous window's
    first half-channels then the current window's second half (2 ratio slots)."""

    def __init__(
        self, weights: Weights, prefix: str, ratio: int, head_dim: int, rope: Rope, eps: float,
        observers: list[Observer],
    ) -> None:  # fmt: skip
        self.ratio, self.head_dim, self.rope, self.eps = ratio, head_dim, rope, eps
        self.overlap = ratio == CSA_RATIO
        self.wkv = Linear(weights, prefix + "_kv.weight", observers)
        self.wgate = Linear(weights, prefix + "_gate.weight", observers)
        self.ape = weights.dense(prefix + "_ape.weight")  # (ratio, width)
        self.norm = weights.dense(prefix + "_norm.weight")
        width = self.ape.shape[-1]
        if width != (2 if self.overlap else 1) * head_dim or self.ape.shape[0] != ratio:
            raise ForgeError(f"{weights.source}: {prefix}_ape.weight has shape {tuple(self.ape.shape)}")

    def __call__(self, x: torch.Tensor, pos0: int, st: CompressorState) -> torch.Tensor:
        """x (T, n_embd) at positions pos0.. -> every entry so far (n, head_dim) (``st`` updated)."""
        r, d = self.ratio, self.head_dim
        kv = self.wkv(x)
        gate = self.wgate(x) + self.ape[torch.arange(pos0, pos0 + x.shape[0], device=x.device) % r]
        if st.kv is not None:
            kv, gate = torch.cat([st.kv, kv]), torch.cat([st.gate, gate])
        n_new = kv.shape[0] // r
        st.kv, st.gate = kv[n_new * r :], gate[n_new * r :]
        if n_new == 0:
            return st.entries if st.entries is not None else x.new_zeros(0, d)
        kv = kv[: n_new * r].view(n_new, r, -1)
        gate = gate[: n_new * r].view(n_new, r, -1)
        if self.overlap:
            if st.prev is None:
                first = (kv.new_zeros(1, r, d), gate.new_full((1, r, d), float("-inf")))
            else:
                first = (st.prev[0][None], st.prev[1][None])
            prev_kv = torch.cat([first[0], kv[:-1, :, :d]])
            prev_gate = torch.cat([first[1], gate[:-1, :, :d]])
            st.prev = (kv[-1, :, :d], gate[-1, :, :d])
            kv = torch.cat([prev_kv, kv[..., d:]], dim=1)
            gate = torch.cat([prev_gate, gate[..., d:]], dim=1)
        pooled = (kv * torch.softmax(gate, dim=1)).sum(dim=1)
        entries = rms_norm(pooled, self.norm, self.eps)
        first_window = st.n_entries
        starts = torch.arange(first_window, first_window + n_new, device=x.device) * r
        entries = self.rope(entries, self.rope.angles(starts))
        st.entries = entries if st.entries is None else torch.cat([st.entries, entries])
        return st.entries


class LightningIndexer:
    """Picks, per query, the ``top_k`` visible CSA entries with the best sum_h w_h ReLU(q_h . k_s)."""

    def __init__(
        self, weights: Weights, layer: int, rope: Rope, eps: float, observers: list[Observer]
    ) -> None:
        p = f"blk.{layer}."
        self.n_head = int(weights.hparam("attention.indexer.head_count"))
        self.head_dim = int(weights.hparam("attention.indexer.key_length"))
        self.top_k = int(weights.hparam("attention.indexer.top_k"))
        self.q_b = Linear(weights, p + "indexer.attn_q_b.weight", observers)
        self.proj = Linear(weights, p + "indexer.proj.weight", observers)
        self.compressor = Compressor(
            weights, p + "indexer_compressor", CSA_RATIO, self.head_dim, rope, eps, observers
        )
        self.rope = rope
        self.weight_scale = (self.head_dim * self.n_head) ** -0.5

    def prepare(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        pos0: int,
        st: CompressorState,
        cs: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (T, n_embd) the attention input, qr (T, q_lora_rank) the normed query latent, cs the compress-rope
        angles of the queries -> (every key so far (n, head_dim), queries (T, heads, head_dim), head weights
        (T, heads))."""
        keys = self.compressor(x, pos0, st)
        q = self.rope(self.q_b(qr).view(x.shape[0], self.n_head, self.head_dim), cs)
        return keys, q, self.proj(x) * self.weight_scale

    def choose(
        self, keys: torch.Tensor, q: torch.Tensor, w: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        """Queries q (T, heads, head_dim) with head weights w (T, heads), ``visible`` (T, n) the causal mask
        over the CSA entries -> (T, n) bool: the entries each query attends to."""
        return lightning_choice(keys, q, w, visible, self.top_k)


def lightning_choice(
    keys: torch.Tensor, q: torch.Tensor, w: torch.Tensor, visible: torch.Tensor, top_k: int
) -> torch.Tensor:
    """The lightning indexer's pick: keys (n, head_dim), queries q (T, heads, head_dim) with head weights w
    (T, heads), ``visible`` (T, n) the causal mask -> (T, n) bool, per query the ``top_k`` visible keys with
    the best sum_h w_h ReLU(q_h . k)."""
    if keys.shape[0] == 0:
        return visible
    scores = torch.einsum("thd,sd->ths", q, keys).relu_()
    scores = torch.einsum("ths,th->ts", scores, w).masked_fill(~visible, float("-inf"))
    top = torch.topk(scores, min(top_k, keys.shape[0]), dim=-1).indices
    return torch.zeros_like(visible).scatter_(1, top, True) & visible


class Dsv4AttentionState:
    """A layer's cache: the last sliding_window - 1 keys (K = V) and the compressors' states."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None  # (rows, head_dim), the last rows before the next position
        self.comp = CompressorState()
        self.index = CompressorState()


class Dsv4Attention:
    def __init__(self, weights: Weights, layer: int, eps: float, observers: list[Observer]) -> None:
        p = f"blk.{layer}."
        self.layer, self.eps, self.observers = layer, eps, observers
        self.n_head = int(weights.hparam("attention.head_count"))
        self.head_dim = int(weights.hparam("attention.key_length"))
        self.n_rot = int(weights.hparam("rope.dimension_count"))
        self.window = int(weights.hparam("attention.sliding_window"))
        self.n_groups = int(weights.hparam("attention.output_group_count"))
        self.o_rank = int(weights.hparam("attention.output_lora_rank"))
        ratios = list(weights.hparam("attention.compress_ratios"))
        if len(ratios) <= layer:
            raise ForgeError(f"{weights.source}: compress_ratios is shorter than block_count")
        self.ratio = int(ratios[layer])
        if self.ratio not in (0, CSA_RATIO, HCA_RATIO):
            raise ForgeError(
                f"{weights.source}: layer {layer}: compress ratio {self.ratio} (0, 4 or 128 only)"
            )
        if self.n_head % self.n_groups:
            raise ForgeError(f"{weights.source}: {self.n_head} heads in {self.n_groups} output groups")
        self.q_a = Linear(weights, p + "attn_q_a.weight", observers)
        self.q_a_norm = weights.dense(p + "attn_q_a_norm.weight")
        self.q_b = Linear(weights, p + "attn_q_b.weight", observers)
        self.kv = Linear(weights, p + "attn_kv.weight", observers)
        self.kv_norm = weights.dense(p + "attn_kv_a_norm.weight")
        self.sinks = weights.dense(p + "attn_sinks.weight")
        self.out_a = Linear(weights, p + "attn_output_a.weight", observers)
        self.out_b = Linear(weights, p + "attn_output_b.weight", observers)
        self.rope = _layer_rope(weights, self.n_rot, compressed=self.ratio != 0)
        self.compressor = (
            Compressor(weights, p + "attn_compressor", self.ratio, self.head_dim, self.rope, eps, observers)
            if self.ratio
            else None
        )
        self.indexer = (
            LightningIndexer(weights, layer, self.rope, eps, observers) if self.ratio == CSA_RATIO else None
        )

    def __call__(self, x: torch.Tensor, st: Dsv4AttentionState, pos0: int) -> torch.Tensor:
        """x (T, n_embd) the normed block input at positions pos0.. -> (T, n_embd)."""
        t, h, d = x.shape[0], self.n_head, self.head_dim
        positions = torch.arange(pos0, pos0 + t, device=x.device)
        cs = self.rope.angles(positions)
        qr = rms_norm(self.q_a(x), self.q_a_norm, self.eps)
        q = self.q_b(qr).view(t, h, d)
        q = self.rope(F.rms_norm(q, (d,), eps=self.eps), cs)
        kv = self.rope(rms_norm(self.kv(x), self.kv_norm, self.eps), cs)

        past = st.keys if st.keys is not None else kv.new_zeros(0, d)
        keys = torch.cat([past, kv])  # positions pos0 - len(past) ..
        st.keys = keys[max(0, keys.shape[0] - (self.window - 1)) :]
        entries = self.compressor(x, pos0, st.comp) if self.compressor is not None else kv.new_zeros(0, d)
        index = self.indexer.prepare(x, qr, pos0, st.index, cs) if self.indexer is not None else None
        out = torch.empty_like(q)
        for b0 in range(0, t, QUERY_BLOCK):  # blocks of queries: the scores stay (heads, block, window + n)
            b1 = min(t, b0 + QUERY_BLOCK)
            k0 = max(0, b0 + past.shape[0] - (self.window - 1))  # the block's oldest key in its window
            raw = keys[k0 : b1 + past.shape[0]]
            age = positions[b0:b1, None] - (
                pos0 - past.shape[0] + k0 + torch.arange(raw.shape[0], device=x.device)
            )
            mask = (age >= 0) & (age < self.window)
            if entries.shape[0]:
                n = torch.arange(entries.shape[0], device=x.device)
                visible = n[None, :] < (positions[b0:b1, None] + 1) // self.ratio
                if index is not None:
                    visible = self.indexer.choose(index[0], index[1][b0:b1], index[2][b0:b1], visible)
                raw, mask = torch.cat([raw, entries]), torch.cat([mask, visible], dim=1)
            out[b0:b1] = self._attend(q[b0:b1], raw, mask)
        out = self.rope(out, cs, inverse=True).reshape(t, self.n_groups, -1)
        return self.out_b(self._grouped(out))

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q (T, heads, d) over keys = values (S, d) where mask (T, S), with each head's sink -> (T, heads, d)."""
        h, t = q.shape[1], q.shape[0]
        scores = torch.einsum("thd,sd->hts", q, keys) * q.shape[-1] ** -0.5
        scores = scores.masked_fill(~mask[None], float("-inf"))
        sink = self.sinks.view(h, 1, 1).expand(h, t, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        return torch.einsum("hts,sd->thd", probs, keys)

    def _grouped(self, out: torch.Tensor) -> torch.Tensor:
        """(T, groups, heads per group x head_dim) -> each group through its rows of ``attn_output_a``."""
        if self.observers:
            notify_matmul(self.observers, self.out_a.name, out.reshape(-1, out.shape[-1]))
        if self.out_a.rounding is not None:  # ggml numerics: the product's input rows as ggml rounds them
            out = self.out_a.rounding(out.reshape(-1, out.shape[-1])).view(out.shape)
        w = self.out_a.weight.view(self.n_groups, self.o_rank, -1)
        return torch.einsum("tgi,goi->tgo", out, w).reshape(out.shape[0], -1)


def _layer_rope(weights: Weights, n_rot: int, compressed: bool) -> Rope:
    """Sliding layers: rope.freq_base, unscaled. Compressed layers: compress_rope_freq_base with the YaRN
    scaling of the file (if any), as are their compressed entries and indexer queries."""
    if not compressed:
        return Rope(n_rot, float(weights.hparam("rope.freq_base", 10000.0)), weights.device)
    base = float(weights.hparam("attention.compress_rope_freq_base"))
    yarn = None
    if weights.hparam("rope.scaling.type", "none") == "yarn":
        factor = float(weights.hparam("rope.scaling.factor"))
        yarn = Yarn(
            1.0 / factor,
            int(weights.hparam("rope.scaling.original_context_length")),
            float(weights.hparam("rope.scaling.yarn_beta_fast", 32.0)),
            float(weights.hparam("rope.scaling.yarn_beta_slow", 1.0)),
        )
    return Rope(n_rot, base, weights.device, yarn)
