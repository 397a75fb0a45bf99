"""Shared layers of the runtime's models: matmuls on GGUF weights (with the observer hook and ggml input
rounding), RMSNorm, NEOX RoPE, the KV cache, causal GQA attention with q/k RMSNorm (optionally gated) and
the Gated DeltaNet token mixer. Each has a batch ``__call__`` and a one-token ``step``.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from forge import ggml_types
from runtime import cpu_kernels
from runtime.backends import cuda_fused, cuda_kernels
from runtime.observers import Observer, notify_matmul
from runtime.weights import Weights

_FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)

# ggml's CPU matmul first converts the activations to the weight type's "vec_dot" type; with
# ``ggml_numerics`` the runtime rounds activations the same way, to reproduce llama.cpp's figures closely.
_Q8_0_INPUTS = {Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL, Q.MXFP4}
_FLOAT_INPUTS = {Q.BF16: torch.bfloat16, Q.F16: torch.float16}


def _round_q8_0(x: torch.Tensor) -> torch.Tensor:
    """quantize_row_q8_0 then dequantize: blocks of 32, d = amax/127 kept as fp16, q = roundf(x / d)."""
    b = x.reshape(-1, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    v = b * torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.sign(v) * torch.floor(v.abs() + 0.5)
    return (q * d.half().float()).reshape(x.shape)


def _round_q8_k(x: torch.Tensor) -> torch.Tensor:
    """quantize_row_q8_K then dequantize: blocks of 256, iscale = -127/max (signed max-abs value)."""
    b = x.reshape(-1, 256)
    peak = b.gather(-1, b.abs().argmax(-1, keepdim=True))
    # tensor / tensor: a Python number over a tensor is computed as its reciprocal times the number, an ulp
    # from C's float division at times
    iscale = torch.where(peak != 0, torch.full_like(peak, -127.0) / peak, torch.zeros_like(peak))
    q = torch.round(b * iscale).clamp_max(127)
    d = torch.where(iscale != 0, torch.ones_like(iscale) / iscale, torch.zeros_like(iscale))
    return (q * d).reshape(x.shape)


def ggml_input_rounding(qtype: Q):  # noqa: ANN201 - returns a function or None
    if qtype in _FLOAT_INPUTS:
        dtype = _FLOAT_INPUTS[qtype]
        return lambda x: x.to(dtype).float()
    if qtype in _Q8_0_INPUTS:
        return _round_q8_0
    if qtype == Q.F32:
        return None
    return _round_q8_k  # K-quants and i-quants


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


def rms_norm_row(x: torch.Tensor, weight: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """rms_norm of one (1, n) row in four ops (F.rms_norm takes six on CPU); eps: a (1, 1) tensor.
    On CUDA the mean square is a reduction: as a matmul cuBLAS runs it as a split-K GEMM plus a reduction."""
    if x.is_cuda:
        if cuda_fused.available(x):
            return cuda_fused.rms_norm_row(x, weight, eps)
        return (x * weight).mul_(x.square().mean(-1, keepdim=True).add_(eps).rsqrt_())
    return (x * weight).mul_(torch.addmm(eps, x, x.T, alpha=1 / x.shape[-1]).rsqrt_())


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """rms_norm of each row of x (N, d) with a per-row weight (N, d); eps: an (N, 1, 1) tensor."""
    if x.is_cuda:
        return (x * weight).mul_(x.square().mean(-1, keepdim=True).add_(eps.view(-1, 1)).rsqrt_())
    mean_sq = torch.baddbmm(eps, x[:, None, :], x[:, :, None], alpha=1 / x.shape[-1])
    return (x * weight).mul_(mean_sq.rsqrt_().view(-1, 1))


def _cuda_encoded(
    weights: Weights, names: list[str], order: torch.Tensor | None = None
) -> tuple[torch.Tensor, Q] | None:
    """Quantized 2-D weights' file rows on the GPU, stacked (rows permuted by ``order``), and their type,
    when the cuda kernels compute their products (device cuda, no ggml numerics, one type they decode);
    else None (torch path)."""
    return weights.cuda_stack(names, order) if _cuda_computes_stacks(weights) else None


def _cuda_computes_stacks(weights: Weights) -> bool:
    """The cuda kernels take this model's products (device cuda, no ggml numerics, a GGUF source)."""
    return weights.device.type == "cuda" and not weights.ggml_numerics and hasattr(weights, "cuda_stack")


def _cpu_rows(
    weights: Weights, names: list[str], order: torch.Tensor | None = None
) -> cpu_kernels.Rows | None:
    """Weights' file rows (one weight: the mapped bytes, not copied; several: stacked, rows permuted by
    ``order``), when the compiled CPU kernels compute the model, read every one's type from the bytes and
    no ggml numerics are asked for; else None (float32 rows, or torch)."""
    if not weights.cpu_kernels or weights.ggml_numerics or not hasattr(weights, "raw"):
        return None
    qtypes = [weights.qtype(n) for n in names]
    if any(len(weights.shape(n)) > 2 for n in names) or not all(
        ggml_types.supports("cpu_rows", q) for q in qtypes
    ):
        return None
    # float weights alone stay float32 (at most 2x their bytes, and a float32 row's dot product is the fastest)
    if all(q in _FLOAT_TYPES for q in qtypes):
        return None
    parts = [(weights.raw(n).numpy(), int(q)) for n, q in zip(names, qtypes, strict=True)]
    return cpu_kernels.Rows.encoded_parts(parts, None if order is None else order.cpu().numpy())


def _n_rows(weights: Weights, name: str) -> int:
    """A weight's output rows (a 1-D weight is one), without decoding it where the shape is known."""
    shape = weights.shape(name) if hasattr(weights, "shape") else tuple(weights.dense(name).shape)
    return shape[0] if len(shape) == 2 else 1


class Linear:
    """x @ W.T for a weight decoded at load, reporting its input to the observers. Kept as the file bytes
    instead where kernels read them: on CUDA for the types the cuda kernels decode, on the CPU for those the
    compiled row kernels read (one token: dot products from the bytes; a batch: decoded in row chunks per
    call). Decoded to float32 only if a caller asks for ``weight``."""

    def __init__(self, weights: Weights, name: str, observers: list[Observer]) -> None:
        self.name, self.observers = name, observers
        self.encoded = _cuda_encoded(weights, [name])  # (file bytes on the GPU, type) for the cuda kernels
        # rows for the compiled CPU kernels: the file's, or float32 ones (below)
        self.rows = _cpu_rows(weights, [name]) if self.encoded is None else None
        self._weights, self._weight_t = weights, None
        if self.encoded is None and self.rows is None:
            # held transposed ((n_in, n_out) contiguous; ``weight`` is the (n_out, n_in) view): faster for one
            # token on CPU. A one-output projection may be stored 1-D (ffn_gate_inp_shexp): one row.
            self.weight_t = weights.columns([name])
            if weights.cpu_kernels:
                self.rows = cpu_kernels.Rows.floats(self.weight.numpy())
        if self.encoded is not None:
            self.n_out = self.encoded[0].shape[0]
        elif self.rows is not None:
            self.n_out = self.rows.n_out
        else:
            self.n_out = self.weight.shape[0]
        self.rounding = ggml_input_rounding(weights.qtype(name)) if weights.ggml_numerics else None

    @property
    def weight_t(self) -> torch.Tensor:
        if self._weight_t is None:  # an encoded weight a torch-path caller asks for: decoded once
            self._weight_t = self._weights.columns([self.name])
        return self._weight_t

    @weight_t.setter
    def weight_t(self, value: torch.Tensor) -> None:
        self._weight_t = value

    @property
    def weight(self) -> torch.Tensor:
        return self.weight_t.T

    @weight.setter
    def weight(self, value: torch.Tensor) -> None:
        self._weight_t = value.T

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.observers:
            notify_matmul(self.observers, self.name, x)
        if self.rounding is not None:
            x = self.rounding(x)
        if self.encoded is not None:
            return cuda_kernels.linear(x, *self.encoded)
        if self.rows is not None and self.rows.encoded:
            return cpu_kernels.product(x.reshape(-1, x.shape[-1]), self.rows).view(*x.shape[:-1], -1)
        return F.linear(x, self.weight)

    def step(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """One token (no ggml numerics): x (1, n_in) -> (1, n_out), plus ``residual`` (1, n_out) if given."""
        if self.observers:
            notify_matmul(self.observers, self.name, x)
        if self.rows is not None:
            return cpu_kernels.gemv(x, self.rows, residual)
        if self.encoded is not None:
            y = cuda_kernels.linear(x, *self.encoded)
            return y if residual is None else y.add_(residual)
        return torch.mm(x, self.weight_t) if residual is None else torch.addmm(residual, x, self.weight_t)

    def normed_step(self, h: torch.Tensor, norm: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        """One token: rms_norm(h) * norm, then this product; eps: a (1, 1) tensor."""
        return self.normed_input_step(h, norm, eps)[1]

    def normed_input_step(
        self, h: torch.Tensor, norm: torch.Tensor, eps: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``normed_step``, also returning its input rms_norm(h) * norm."""
        if self.rows is None:
            x = rms_norm_row(h, norm, eps)
            return x, self.step(x)
        x, y = cpu_kernels.norm_gemv(h, norm.numpy(), float(eps), self.rows)
        if self.observers:
            notify_matmul(self.observers, self.name, x)
        return x, y


class RowStack:
    """Weight rows computed as one product: file bytes the cuda kernels read, file rows the CPU kernels read,
    or a float32 matrix."""

    def __init__(
        self,
        encoded: tuple[torch.Tensor, Q] | None = None,
        weight: torch.Tensor | None = None,
        rows: cpu_kernels.Rows | None = None,
    ) -> None:
        self.encoded, self.weight, self.rows = encoded, weight, rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.encoded is not None:
            return cuda_kernels.linear(x, *self.encoded)
        if self.rows is not None and self.rows.encoded:
            return cpu_kernels.product(x, self.rows)
        assert self.weight is not None
        return F.linear(x, self.weight)


def _cuda_segments(weights: Weights, names: list[str]) -> list[RowStack] | None:
    """``names``' rows as runs of one type each (file bytes where the cuda kernels compute the type,
    float32 otherwise); None when the kernels compute none of them (the float32 path)."""
    if not _cuda_computes_stacks(weights):
        return None

    def kind(name: str) -> Q | None:
        q = weights.qtype(name)
        return q if len(weights.shape(name)) == 2 and weights.cuda_computes(q) else None

    runs = [(k, list(run)) for k, run in groupby(names, key=kind)]
    if all(k is None for k, _ in runs):
        return None
    return [
        RowStack(encoded=weights.cuda_stack(run))
        if k is not None
        else RowStack(weight=weights.columns(run).T)
        for k, run in runs
    ]


class FusedLinear:
    """Several weights that read the same input, multiplied as one matrix; each is reported by its name."""

    def __init__(self, weights: Weights, names: list[str], observers: list[Observer]) -> None:
        self.names, self.observers = names, observers
        self.separate: list[Linear] | None = None
        self.segments: list[RowStack] | None = None
        self.rows: cpu_kernels.Rows | None = None
        if weights.ggml_numerics:  # each weight with its own input rounding
            self.separate = [Linear(weights, n, observers) for n in names]
            self.sizes = [lin.weight.shape[0] for lin in self.separate]
        else:
            # on CUDA: runs of names of one type the kernels compute, each kept as its stacked file rows
            self.segments = _cuda_segments(weights, names)
            self.sizes = [_n_rows(weights, n) for n in names]
            self.rows = _cpu_rows(weights, names) if self.segments is None else None  # the CPU kernels' rows
            if self.segments is None and self.rows is None:
                self.weight_t = weights.columns(names)  # (n_in, total rows)
                self.weight = self.weight_t.T
                if weights.cpu_kernels:
                    self.rows = cpu_kernels.Rows.floats(self.weight.numpy())

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, n_in) -> (T, total rows)."""
        if self.rows is not None and self.rows.encoded:
            return cpu_kernels.product(x, self.rows)
        if self.segments is None:
            return F.linear(x, self.weight)
        parts = [seg(x) for seg in self.segments]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.separate is not None:
            return tuple(lin(x) for lin in self.separate)
        if self.observers:
            for name in self.names:
                notify_matmul(self.observers, name, x)
        return torch.split(self._product(x), self.sizes, dim=-1)

    def step(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One token on torch ops (the compiled kernels read ``rows`` themselves): x (1, n_in) -> each
        weight's (n_out,) product."""
        if self.observers:
            for name in self.names:
                notify_matmul(self.observers, name, x)
        if self.rows is not None:
            return torch.split(cpu_kernels.gemv(x, self.rows)[0], self.sizes)
        if self.segments is not None:
            return torch.split(self._product(x)[0], self.sizes)
        return torch.split(torch.mm(x, self.weight_t)[0], self.sizes)


class Rope:
    """NEOX-style rotary embedding on the first ``n_rot`` dims of each head (llama.cpp's rope type 2)."""

    def __init__(
        self,
        n_rot: int,
        base: float,
        device: torch.device,
        head_dim: int | None = None,
        ggml_table: bool = False,
    ) -> None:
        self.n_rot, self.device, self.base, self.ggml_table = n_rot, device, base, ggml_table
        self.head_dim = head_dim or n_rot
        self.inv_freq = 1.0 / (
            base ** (torch.arange(0, n_rot, 2, dtype=torch.float32, device=device) / n_rot)
        )
        self.cos = self.sin = torch.empty(0, n_rot // 2, device=device)
        # one token: out = x * cos_row + x[partner] * sin_row over whole heads (dims past n_rot: cos 1, sin 0)
        half = n_rot // 2
        partner = torch.arange(self.head_dim)
        partner[:half] += half
        partner[half:n_rot] -= half
        self.partner = partner.to(device)
        self.cos_row = self.sin_row = torch.empty(0, self.head_dim, device=device)

    def _table(self, end: int) -> None:
        if end > self.cos.shape[0]:
            n = max(end, 2 * self.cos.shape[0], 1024)
            if self.ggml_table:
                ang = self._ggml_angles(n)
                self.cos, self.sin = ang.cos().float(), ang.sin().float()
            else:
                ang = (
                    torch.arange(n, dtype=torch.float32, device=self.device)[:, None] * self.inv_freq[None, :]
                )
                self.cos, self.sin = ang.cos(), ang.sin()

    def _ggml_angles(self, n: int) -> torch.Tensor:
        """ggml's rope cache: theta_0 = pos, theta_{i+1} = theta_i * base^(-2/n_rot), each step rounded to
        float32; returned as float64 so that cos/sin round once (like a correctly rounded cosf/sinf)."""
        scale = np.float32(np.float32(self.base) ** np.float32(-2.0 / self.n_rot))
        theta = np.empty((n, self.n_rot // 2), np.float32)
        theta[:, 0] = np.arange(n, dtype=np.float32)
        for i in range(1, self.n_rot // 2):
            theta[:, i] = theta[:, i - 1] * scale
        return torch.from_numpy(theta).to(self.device, torch.float64)

    def __call__(self, x: torch.Tensor, pos0: int) -> torch.Tensor:
        """x: (T, H, D) at positions pos0..pos0+T-1."""
        t = x.shape[0]
        self._table(pos0 + t)
        cos, sin = self.cos[pos0 : pos0 + t, None, :], self.sin[pos0 : pos0 + t, None, :]
        half = self.n_rot // 2
        x1, x2 = x[..., :half], x[..., half : self.n_rot]
        parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
        if self.n_rot < x.shape[-1]:
            parts.append(x[..., self.n_rot :])
        return torch.cat(parts, dim=-1)

    def row(self, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (n_rot / 2,) cos and sin of position ``pos``."""
        self._table(pos + 1)
        return self.cos[pos], self.sin[pos]

    def step(self, x: torch.Tensor, pos: int, at: torch.Tensor | None = None, end: int = 0) -> torch.Tensor:
        """x: (N, head_dim), N heads of the one token at position ``pos``; or, in a captured decode step,
        at the position held by the device tensor ``at`` (1,), below ``end``."""
        cos_row, sin_row = self.row_tables(max(end, pos + 1))
        if at is not None:
            cos, sin = cos_row.index_select(0, at), sin_row.index_select(0, at)
        else:
            cos, sin = cos_row[pos], sin_row[pos]
        return torch.addcmul(x * cos, x.index_select(-1, self.partner), sin)

    def row_tables(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole-head (positions >= end, head_dim) cos and sin rows: a head at position p rotates as
        ``x * cos[p] + x[partner] * sin[p]``."""
        if end > self.cos_row.shape[0]:
            self._table(end)
            rest = self.head_dim - self.n_rot
            n = self.cos.shape[0]
            ones, zeros = self.cos.new_ones(n, rest), self.cos.new_zeros(n, rest)
            self.cos_row = torch.cat([self.cos, self.cos, ones], dim=-1)
            self.sin_row = torch.cat([-self.sin, self.sin, zeros], dim=-1)
        return self.cos_row, self.sin_row


class KVCache:
    """Keys and values of one attention layer, (n_head_kv, capacity, head_dim), grown by doubling."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = 0
        # in a captured decode step (runtime.backends.cuda_graph): the position as a device tensor (1,),
        # and how many slots attention reads (a static count; the slots past the position are masked)
        self.at: torch.Tensor | None = None
        self.span = 0

    def reserve(self, need: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Capacity for ``need`` positions; k/v: (..., n_head_kv, head_dim) rows giving shape and dtype."""
        if self.k is None or self.v is None or need > self.k.shape[1]:
            cap = max(256, need, 2 * (0 if self.k is None else self.k.shape[1]))
            # zeros, not garbage, past the length: a captured decode step reads those slots (masked)
            new_k = k.new_zeros((k.shape[-2], cap, k.shape[-1]))
            new_v = v.new_zeros((v.shape[-2], cap, v.shape[-1]))
            if self.k is not None and self.v is not None:
                new_k[:, : self.length] = self.k[:, : self.length]
                new_v[:, : self.length] = self.v[:, : self.length]
            self.k, self.v = new_k, new_v
        return self.k, self.v

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: (T, n_head_kv, head_dim) -> all keys and values so far, (n_head_kv, length, head_dim)."""
        need = self.length + k.shape[0]
        keys, values = self.reserve(need, k, v)
        keys[:, self.length : need] = k.transpose(0, 1)
        values[:, self.length : need] = v.transpose(0, 1)
        self.length = need
        return keys[:, :need], values[:, :need]

    def put(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token's k, v: (n_head_kv, head_dim); returns like ``append``."""
        need = self.length + 1
        keys, values = self.reserve(need, k, v)
        keys[:, self.length] = k
        values[:, self.length] = v
        self.length = need
        return keys[:, :need], values[:, :need]

    def put_at(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token's k, v: (n_head_kv, head_dim), written at position ``at`` -> the first ``span`` keys
        and values, and a (span,) additive mask hiding the slots past the position (0 or -inf)."""
        assert self.at is not None
        keys, values = self.reserve(self.span, k, v)
        keys.index_copy_(1, self.at, k[:, None])
        values.index_copy_(1, self.at, v[:, None])
        slots = torch.arange(self.span, device=k.device)
        mask = torch.zeros(self.span, device=k.device).masked_fill_(slots > self.at, float("-inf"))
        return keys[:, : self.span], values[:, : self.span], mask


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos0: int) -> torch.Tensor:
    """Causal GQA attention. q: (T, H, D) at positions pos0.., k/v: (Hkv, pos0+T, D) -> (T, H*D)."""
    t, n_head, d = q.shape
    n_kv = k.shape[0]
    n_rep = n_head // n_kv
    if t == 1:  # one query row: each KV head's group of query heads attends as a batch of rows, no copies
        out = F.scaled_dot_product_attention(q.view(n_kv, n_rep, d), k, v)
        return out.reshape(1, n_head * d)
    if cuda_fused.use_attention_prefill(q, k):  # opt-in: one Triton launch
        return cuda_fused.attention_prefill(q, k, v, pos0)
    if n_rep > 1:
        k = k.repeat_interleave(n_rep, dim=0)
        v = v.repeat_interleave(n_rep, dim=0)
    q = q.transpose(0, 1)
    if q.is_cuda:  # torch's fused kernels (float32: memory-efficient attention) take 4-D inputs only
        q, k, v = q[None], k[None], v[None]
    if pos0 == 0:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        rows = torch.arange(pos0, pos0 + t, device=q.device)[:, None]
        mask = torch.arange(k.shape[-2], device=q.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.reshape(n_head, t, d).transpose(0, 1).reshape(t, n_head * d)


@dataclass(frozen=True)
class AttentionConfig:
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rope_base: float
    eps: float

    @classmethod
    def from_weights(cls, weights: Weights, n_embd: int, eps: float) -> AttentionConfig:
        n_head = int(weights.hparam("attention.head_count"))
        head_dim = int(weights.hparam("attention.key_length", n_embd // n_head))
        return cls(
            n_head=n_head,
            n_head_kv=int(weights.hparam("attention.head_count_kv", n_head)),
            head_dim=head_dim,
            n_rot=int(weights.hparam("rope.dimension_count", head_dim)),
            rope_base=float(weights.hparam("rope.freq_base", 10000.0)),
            eps=eps,
        )


# The fused one-token attention walks a head's slots in one program; past this many slots (an estimate, not
# measured) the step takes torch's batched products, which spread the slots over the GPU.
FUSED_ATTENTION_SLOTS = 1024


class GQAttention:
    """Attention with q/k RMSNorm; ``gated``: q_proj also yields a per-head output gate (Qwen3.5/Next).
    Without ``attn_q_norm`` / ``attn_k_norm`` tensors q and k are not normalized; ``attn_{q,k,v}.bias``
    tensors are added to the projections (GLM); either one leaves the one-token ``step`` unavailable.

    Without ggml numerics q, k, v (and the gate) come from one matmul whose rows are ordered
    [q heads, k heads, gate heads, v heads], so that each part is a contiguous slice.
    """

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
        fused_in_file = weights.has(p + "attn_qkv.weight")
        if fused_in_file:
            self.in_names = [p + "attn_qkv.weight"]
        else:
            self.in_names = [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]
        self.qkv: Linear | None = None
        self.q_k_v: FusedLinear | None = None
        self.w_in: RowStack | None = None  # q, k, (gate), v rows as one product (not with ggml numerics)
        if weights.ggml_numerics:  # each weight with its own input rounding
            if fused_in_file:
                self.qkv = Linear(weights, self.in_names[0], observers)
            else:
                self.q_k_v = FusedLinear(weights, self.in_names, observers)
        else:
            order = None
            if gated:  # q_proj rows are [q, gate] per head: gather all q rows first, all gate rows after k
                per_head = torch.arange(q_rows).view(cfg.n_head, 2, cfg.head_dim)
                kv = torch.arange(q_rows, q_rows + 2 * kv_rows)
                parts = [per_head[:, 0].reshape(-1), kv[:kv_rows], per_head[:, 1].reshape(-1), kv[kv_rows:]]
                order = torch.cat(parts).to(weights.device)
            encoded = _cuda_encoded(weights, self.in_names, order)
            self.w_in = RowStack(
                encoded=encoded, rows=None if encoded else _cpu_rows(weights, self.in_names, order)
            )
            if self.w_in.encoded is None and self.w_in.rows is None:
                self.w_in_t = weights.columns(self.in_names, order)
                self.w_in.weight = self.w_in_t.T
                if weights.cpu_kernels:
                    self.w_in.rows = cpu_kernels.Rows.floats(self.w_in.weight.numpy())
        q_dim = cfg.n_head * cfg.head_dim
        self.sizes = (q_dim, kv_rows, q_dim if gated else 0, kv_rows)  # q, k, gate, v in w_in's rows
        self.out = Linear(weights, p + "attn_output.weight", observers)
        biases = [p + f"attn_{n}.bias" for n in "qkv"]
        self.bias = torch.cat([weights.dense(b) for b in biases]) if weights.has(biases[0]) else None
        self.normed = weights.has(p + "attn_q_norm.weight")
        ones = torch.ones(cfg.head_dim, device=weights.device)
        self.q_norm = weights.dense(p + "attn_q_norm.weight") if self.normed else ones
        self.k_norm = weights.dense(p + "attn_k_norm.weight") if self.normed else ones
        self.rope = Rope(cfg.n_rot, cfg.rope_base, weights.device, cfg.head_dim, weights.ggml_numerics)
        # llama.cpp keeps K and V as fp16; its batched CPU attention takes Q in float32 (measured against
        # the peer's intermediate tensors: rounding Q to fp16 moved the outputs 500x further away)
        self.f16_cache = weights.ggml_numerics
        # one-token path: q and k heads normalized together, q's rows carrying the 1/sqrt(d) score scale
        n_qk = cfg.n_head + cfg.n_head_kv
        self.qk_norm = torch.cat(
            [(self.q_norm * cfg.head_dim**-0.5).expand(cfg.n_head, -1), self.k_norm.expand(cfg.n_head_kv, -1)]
        )
        self.qk_eps = torch.full((n_qk, 1, 1), cfg.eps, device=weights.device)
        self.qk_norm_rows = self.qk_norm.numpy() if weights.cpu_kernels else None
        self.qk_norm = self.qk_norm.contiguous()
        hd = cfg.head_dim
        self.fused_step = cuda_fused.available(self.qk_norm) and hd & (hd - 1) == 0 and self.bias is None

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x (T, n_embd) -> q, k, gate (or None), v as (T, rows) matrices."""
        if self.w_in is not None:
            if self.observers:
                for name in self.in_names:
                    notify_matmul(self.observers, name, x)
            y = self.w_in(x)
            q, k, gate, v = torch.split(y if self.bias is None else y + self.bias, self.sizes, dim=-1)
            return q, k, gate if self.gated else None, v
        c, t = self.cfg, x.shape[0]
        if self.qkv is not None:
            q, k, v = torch.split(self.qkv(x), (self.sizes[0] + self.sizes[2], *self.sizes[1::2]), dim=-1)
        else:
            assert self.q_k_v is not None
            q, k, v = self.q_k_v(x)
            if self.bias is not None:
                bq, bk, bv = torch.split(self.bias, (self.sizes[0], self.sizes[1], self.sizes[3]))
                q, k, v = q + bq, k + bk, v + bv
        if not self.gated:
            return q, k, None, v
        qg = q.view(t, c.n_head, 2 * c.head_dim)
        return qg[..., : c.head_dim].reshape(t, -1), k, qg[..., c.head_dim :].reshape(t, -1), v

    def __call__(self, x: torch.Tensor, cache: KVCache, pos0: int) -> torch.Tensor:
        c, t = self.cfg, x.shape[0]
        q, k, gate, v = self._project(x)
        q, k = q.reshape(t, c.n_head, c.head_dim), k.reshape(t, c.n_head_kv, c.head_dim)
        if self.normed:
            q, k = rms_norm(q, self.q_norm, c.eps), rms_norm(k, self.k_norm, c.eps)
        v = v.reshape(t, c.n_head_kv, c.head_dim)
        qk = self.rope(torch.cat([q, k], dim=1), pos0)
        q, k = qk[:, : c.n_head], qk[:, c.n_head :]
        if self.f16_cache:
            k, v = k.half().float(), v.half().float()
        keys, values = cache.append(k, v)
        out = attention(q, keys, values, pos0)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.out(out)

    def step(
        self, h: torch.Tensor, norm: torch.Tensor, eps: torch.Tensor, cache: KVCache, pos: int
    ) -> torch.Tensor:
        """One token (no ggml numerics): h (1, n_embd) the residual stream, norm the block's input RMSNorm
        weight, eps a (1, 1) tensor -> h + attention."""
        assert self.w_in is not None and self.normed and self.bias is None, "no one-token path here"
        c = self.cfg
        if self.w_in.rows is not None:
            kv = h.new_empty(c.n_head_kv, c.head_dim)
            keys, values = cache.reserve(pos + 1, kv, kv)
            cache.length = pos + 1
            out, x, att = cpu_kernels.attention_step(
                h, norm, c.eps, self.w_in.rows, c.n_head, self.sizes[2], self.qk_norm_rows, self.rope.row(pos),
                keys, values, pos, self.out.rows,
            )  # fmt: skip
            if self.observers:
                for name in self.in_names:
                    notify_matmul(self.observers, name, x)
                notify_matmul(self.observers, self.out.name, att)
            return out
        x = rms_norm_row(h, norm, eps)
        if self.observers:
            for name in self.in_names:
                notify_matmul(self.observers, name, x)
        y = self.w_in(x)[0] if self.w_in.encoded is not None else torch.mm(x, self.w_in_t)[0]
        n_q, n_k, n_gate, _ = self.sizes
        if self.fused_step and max(pos + 1, cache.span) <= FUSED_ATTENTION_SLOTS:
            return self.out.step(self._fused_attention(y, cache, pos), h)
        qk = y[: n_q + n_k].view(c.n_head + c.n_head_kv, c.head_dim)
        qk = self.rope.step(rms_norm_heads(qk, self.qk_norm, self.qk_eps), pos, cache.at, cache.span)
        v = y[n_q + n_k + n_gate :].view(c.n_head_kv, c.head_dim)
        if cache.at is None:
            keys, values = cache.put(qk[c.n_head :], v)
        else:
            keys, values, mask = cache.put_at(qk[c.n_head :], v)
        scores = torch.bmm(qk[: c.n_head].view(c.n_head_kv, -1, c.head_dim), keys.transpose(1, 2))
        if cache.at is not None:
            scores = scores + mask
        out = torch.bmm(torch.softmax(scores, dim=-1), values).view(1, -1)
        if n_gate:
            out = out * torch.sigmoid(y[n_q + n_k : n_q + n_k + n_gate])
        return self.out.step(out, h)

    def _fused_attention(self, y: torch.Tensor, cache: KVCache, pos: int) -> torch.Tensor:
        """The one-token attention after the projection in two launches (``cuda_fused``): q/k norms, RoPE and
        the cache write; then attention over slots 0..position, gated."""
        c = self.cfg
        kv = y.new_empty(c.n_head_kv, c.head_dim)
        if cache.at is None:
            keys, values = cache.reserve(pos + 1, kv, kv)
            cache.length = pos + 1
        else:
            keys, values = cache.reserve(cache.span, kv, kv)
        cos_rows, sin_rows = self.rope.row_tables(max(pos + 1, cache.span))
        n_q, n_k, n_gate, _ = self.sizes
        q = cuda_fused.attention_qk(
            y, self.qk_norm, cos_rows, sin_rows, self.rope.partner, keys, values, cache.at, pos, c.n_head,
            n_q + n_k + n_gate, c.eps,
        )  # fmt: skip
        gate = y[n_q + n_k : n_q + n_k + n_gate] if n_gate else None
        return cuda_fused.attention_decode(q, keys, values, cache.at, pos, gate)


# Gated DeltaNet (Qwen3.5 / Qwen3-Next) ----------------------------------------------------------------------
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

    out = []
    k_to_end = k_to_end.transpose(-1, -2)
    for i in range(n):  # five launches a chunk: on a GPU the loop is the layer's launch cost
        u = torch.baddbmm(w_v[:, i], w_k[:, i], s, alpha=-1)
        out.append(torch.baddbmm(qk[:, i] @ u, q_decayed[:, i], s))
        s = torch.baddbmm(s * chunk_decay[:, i], k_to_end[:, i], u)
    return torch.stack(out, 1).reshape(n_head, n * c, -1)[:, :t].transpose(0, 1), s


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
        self.qk_scale_flat = self.qk_scale.view(-1).contiguous()
        pow2 = all(n & (n - 1) == 0 for n in (self.d_k, self.d_v))
        channels = self.conv_rows.shape[1]
        self.fused_step = cuda_fused.available(self.conv_rows) and pow2 and channels % self.d_k == 0

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
        st.conv.copy_(window[t:])  # states are updated in place: a captured decode step holds their addresses
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
            o, s = delta_rule_step(q[0], k[0], v[0], g[0], beta[0], st.recurrent)
            o = o[None]
        else:
            o, s = delta_rule_chunked(q, k, v, g, beta, st.recurrent)
        st.recurrent.copy_(s)
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
        if self.fused_step:
            qkv = cuda_fused.deltanet_conv(
                mixed, st.conv, self.conv_rows, self.qk_scale_flat, 2 * self.n_k, self.d_k, self.eps
            )
            o = cuda_fused.deltanet_rule(
                qkv, z, beta, alpha, self.dt_bias, self.a, st.recurrent, self.norm, self.n_k, self.eps
            )
            return self.out.step(o, h)
        window = torch.cat([st.conv, mixed[None]])
        st.conv.copy_(window[1:])
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
        if s.is_cuda:  # products of one row: elementwise and a sum, not cuBLAS's batched GEMMs
            kt = k.transpose(1, 2)
            delta = (v - (kt * s).sum(1, keepdim=True)) * torch.sigmoid(beta).view(-1, 1, 1)
            st.recurrent.copy_(s.addcmul_(kt, delta))
            o = (q.transpose(1, 2) * st.recurrent).sum(1)
        else:
            delta = (v - torch.bmm(k, s)) * torch.sigmoid(beta).view(-1, 1, 1)
            st.recurrent.copy_(torch.baddbmm(s, k.transpose(1, 2), delta))
            o = torch.bmm(q, st.recurrent).view(self.n_v, self.d_v)
        o = (rms_norm(o, self.norm, self.eps) * F.silu(z.view(self.n_v, self.d_v))).view(1, -1)
        return self.out.step(o, h)
