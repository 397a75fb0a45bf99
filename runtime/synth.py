"""``forge synth``: a GGUF with random but well-formed quantized weights in a real model's geometry.

For speed and memory measurements only (expert streaming, layouts): the values mean nothing. Blocks are
random bytes with every fp16 scale field set to a small finite value, so every decoder produces finite
numbers. The file is canonical (llama-quantize's name-sorted tensor order within each block) and
converts to expert-major with ``forge layout convert``.

The geometry is written as a ``qwen3moe`` model (GQA attention + softmax top-k routed experts), which the
runtime runs end to end. Qwen3.6-35B-A3B itself is a ``qwen35moe`` (Gated DeltaNet layers, a shared
expert); its routed experts - what streaming is about - are reproduced exactly (40 layers x 256 experts,
top 8, hidden 2048, expert FFN 512), the rest approximately: every layer has full attention
(16 heads, 2 KV heads, head dim 256) and the shared expert is left out (the qwen3moe graph has none).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from forge.errors import ForgeError
from forge.gguf_file import KV, TensorSpec, write_gguf

Q = GGMLQuantizationType


@dataclass(frozen=True)
class SynthGeometry:
    layers: int
    experts: int
    experts_used: int
    hidden: int
    expert_ff: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    context: int = 262144


GEOMETRIES = {
    "qwen3.6-35b-a3b": SynthGeometry(40, 256, 8, 2048, 512, 16, 2, 256, 248320),
    "qwen3-30b-a3b": SynthGeometry(48, 128, 8, 2048, 768, 32, 4, 128, 151936),
}

# byte offsets of the fp16 scale fields (d, dmin) inside one block, per type
_FP16_FIELDS = {
    Q.Q4_0: (0,),
    Q.Q8_0: (0,),
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
}
_POOL_BYTES = 32 << 20


class _BlockPool:
    """A pool of random well-formed blocks of one type; tensors are written as slices of it."""

    def __init__(self, qtype: Q, rng: np.random.Generator, scale: float = 0.01) -> None:
        block, size = GGML_QUANT_SIZES[qtype]
        if qtype not in _FP16_FIELDS:
            raise ForgeError(f"forge synth supports {', '.join(t.name.lower() for t in _FP16_FIELDS)}")
        blocks = rng.integers(0, 256, (_POOL_BYTES // size, size), dtype=np.uint8)
        for off in _FP16_FIELDS[qtype]:
            d = rng.uniform(0.2 * scale, 2 * scale, blocks.shape[0]).astype(np.float16)
            blocks[:, off : off + 2] = d.view(np.uint8).reshape(-1, 2)
        self.data = blocks.reshape(-1)
        self.pos = 0

    def writer(self, nbytes: int) -> Any:
        def write(f: Any) -> None:
            left = nbytes
            while left:
                n = min(left, self.data.size - self.pos)
                f.write(memoryview(self.data[self.pos : self.pos + n]))
                left -= n
                self.pos = (self.pos + n) % self.data.size

        return write


def _kvs(g: SynthGeometry, name: str) -> list[KV]:
    a, u, f = "qwen3moe.", GGUFValueType.UINT32, GGUFValueType.FLOAT32
    return [
        KV("general.architecture", "qwen3moe", GGUFValueType.STRING),
        KV("general.name", f"synthetic {name} (random weights)", GGUFValueType.STRING),
        KV(a + "block_count", g.layers, u),
        KV(a + "context_length", g.context, u),
        KV(a + "embedding_length", g.hidden, u),
        KV(a + "feed_forward_length", g.expert_ff, u),
        KV(a + "attention.head_count", g.heads, u),
        KV(a + "attention.head_count_kv", g.kv_heads, u),
        KV(a + "attention.key_length", g.head_dim, u),
        KV(a + "attention.value_length", g.head_dim, u),
        KV(a + "attention.layer_norm_rms_epsilon", 1e-6, f),
        KV(a + "rope.freq_base", 1e7, f),
        KV(a + "expert_count", g.experts, u),
        KV(a + "expert_used_count", g.experts_used, u),
        KV(a + "expert_feed_forward_length", g.expert_ff, u),
    ]


def synth_tensors(g: SynthGeometry, qtype: Q) -> list[TensorSpec]:
    """Tensor specs (numpy shapes) in llama-quantize's order: blocks' tensors sorted by name."""
    h, q_rows, kv_rows = g.hidden, g.heads * g.head_dim, g.kv_heads * g.head_dim
    specs = [TensorSpec("token_embd.weight", (g.vocab, h), qtype)]
    for i in range(g.layers):
        p = f"blk.{i}."
        layer = [
            TensorSpec(p + "attn_k.weight", (kv_rows, h), qtype),
            TensorSpec(p + "attn_k_norm.weight", (g.head_dim,), Q.F32),
            TensorSpec(p + "attn_norm.weight", (h,), Q.F32),
            TensorSpec(p + "attn_output.weight", (h, q_rows), qtype),
            TensorSpec(p + "attn_q.weight", (q_rows, h), qtype),
            TensorSpec(p + "attn_q_norm.weight", (g.head_dim,), Q.F32),
            TensorSpec(p + "attn_v.weight", (kv_rows, h), qtype),
            TensorSpec(p + "ffn_down_exps.weight", (g.experts, h, g.expert_ff), qtype),
            TensorSpec(p + "ffn_gate_exps.weight", (g.experts, g.expert_ff, h), qtype),
            TensorSpec(p + "ffn_gate_inp.weight", (g.experts, h), Q.F32),
            TensorSpec(p + "ffn_norm.weight", (h,), Q.F32),
            TensorSpec(p + "ffn_up_exps.weight", (g.experts, g.expert_ff, h), qtype),
        ]
        specs += sorted(layer, key=lambda s: s.name)
    specs += [TensorSpec("output.weight", (g.vocab, h), qtype), TensorSpec("output_norm.weight", (h,), Q.F32)]
    return specs


def synthesize(
    dest: str | Path, geometry: str | SynthGeometry, qtype: str = "q4_k", layers: int | None = None,
    vocab: int | None = None, seed: int = 0,
) -> int:  # fmt: skip
    """Write the synthetic GGUF; returns its size in bytes."""
    g = GEOMETRIES.get(geometry) if isinstance(geometry, str) else geometry
    if g is None:
        raise ForgeError(f"unknown geometry {geometry!r} (known: {', '.join(GEOMETRIES)})")
    if layers is not None:
        if layers < 1:
            raise ForgeError("--layers must be >= 1")
        g = SynthGeometry(**{**g.__dict__, "layers": layers})
    if vocab is not None:
        g = SynthGeometry(**{**g.__dict__, "vocab": vocab})
    try:
        t = Q[qtype.upper()]
    except KeyError:
        raise ForgeError(f"unknown quant type {qtype!r}") from None
    rng = np.random.default_rng(seed)
    pool = _BlockPool(t, rng)
    # Attention of random weights adds nearly the same vector to every token; kept small, the residual
    # stream stays token-specific and so does routing (as in a trained model).
    quiet = _BlockPool(t, rng, scale=1e-4)
    specs = synth_tensors(g, t)

    def data() -> Iterator[Any]:
        for s in specs:
            if s.ggml_type == Q.F32 and "gate_inp" in s.name:
                # Random K-quant blocks have a non-zero mean, so every hidden state carries a large common
                # (all-ones) component; router rows orthogonal to it make routing depend on the token.
                w = rng.standard_normal(s.shape)
                yield (w - w.mean(axis=-1, keepdims=True)).astype(np.float32)
            elif s.ggml_type == Q.F32:
                yield np.ones(s.shape, np.float32)  # norms: 1 keeps the common component out of routing
            else:
                yield (quiet if "attn_output" in s.name or "attn_v" in s.name else pool).writer(s.nbytes)

    name = geometry if isinstance(geometry, str) else "custom"
    return write_gguf(dest, _kvs(g, name), specs, data())


def synth(
    output: Annotated[Path, typer.Option("-o", "--output", help="GGUF file to write")],
    geometry: Annotated[str, typer.Option(help=f"one of: {', '.join(GEOMETRIES)}")] = "qwen3.6-35b-a3b",
    type_: Annotated[str, typer.Option("--type", help="quant type of the weights")] = "q4_k",
    layers: Annotated[int | None, typer.Option(help="fewer layers than the geometry's")] = None,
    vocab: Annotated[int | None, typer.Option(help="vocabulary size (default: the geometry's)")] = None,
    seed: Annotated[int, typer.Option(help="random seed")] = 0,
) -> None:
    """Write a GGUF with random well-formed quantized weights in a real model's geometry (benchmarks)."""
    size = synthesize(output, geometry, type_, layers, vocab, seed)
    typer.echo(f"{output}: {size / 1e9:.2f} GB, {geometry}, {type_}")
