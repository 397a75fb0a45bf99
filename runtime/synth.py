"""``forge synth``: a GGUF with random but well-formed quantized weights in a real model's geometry.

For speed and memory measurements only (expert streaming, layouts): the values mean nothing. Blocks are
random bytes with every fp16 scale field set to a small finite value of random sign (one sign per block),
so every decoder produces finite numbers that average zero and routing depends on the token. The file is
canonical (llama-quantize's name-sorted tensor order within each block) and converts to expert-major with
``forge layout convert``.

The geometry is written as a ``qwen3moe`` model (GQA attention + softmax top-k routed experts), which the
runtime runs end to end. Qwen3.6-35B-A3B itself is a ``qwen35moe`` (Gated DeltaNet layers, a shared
expert); its routed experts - what streaming is about - are reproduced exactly (40 layers x 256 experts,
top 8, hidden 2048, expert FFN 512), the rest approximately: every layer has full attention
(16 heads, 2 KV heads, head dim 256) and the shared expert is left out (the qwen3moe graph has none).

GLM geometries (``glm-4.5-air``, ``glm-4.6``) are written as ``glm4moe`` models, GLM's own graph: leading
dense layers, q/k/v biases (zero), routed experts with a sigmoid router and its selection bias (zero) and a
shared expert; GLM-4.6's q/k norms. A row length that is not a whole number of the type's blocks (GLM-4.5-Air's
expert FFN 1408 and dense FFN 10944 under a k-quant) is written as Q8_0, as llama-quantize falls back.

DeepSeek V4 geometries (``deepseek-v4-flash``, ``deepseek-v4-pro``) are written as ``deepseek4`` models, as
llama-quantize leaves a converted one: hash-routed first layers (I32 token -> expert tables), per-layer KV
compression (Flash: window, window, then ratio 4 / 128; Pro: 128, 128, then 128 / 4) with the compressors
and the ratio-4 layers' lightning indexer, query / grouped output LoRAs, hyper-connections (4 streams), routed
and shared experts; the router in F32, norms one, biases zero.

The file carries a small byte-level BPE tokenizer (``gpt2`` model, ``qwen2`` pre-tokenizer) so llama.cpp and
``forge run`` load it: the 256 byte tokens, ``<|endoftext|>`` (BOS and EOS), ``<|im_start|>``,
``<|im_end|>`` and a ChatML template, then lowercase "words" ("ab", " ab", "abc", ...) built by merges
until the geometry's vocabulary size is reached, so the embedding and output keep their real shapes and
random logits decode to random words rather than nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import cache
from itertools import count, islice, product
from pathlib import Path
from string import ascii_lowercase
from typing import Annotated, Any, Literal

import numpy as np
import typer
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from forge import ggml_types
from forge.errors import ForgeError
from forge.gguf_file import KV, TensorSpec, write_gguf
from forge.options import require_choice, require_int, require_seed
from runtime.tokenizer import _byte_to_unicode

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
    arch: str = "qwen3moe"  # or glm4moe
    dense_lead: int = 0  # glm4moe: leading dense layers
    dense_ff: int = 0  # glm4moe: their FFN length
    qk_norm: bool = True  # glm4moe: GLM-4.5-Air has none
    q_lora: int = 0  # deepseek4: query LoRA rank
    o_groups: int = 0  # deepseek4: output projection groups
    o_lora: int = 0  # deepseek4: their rank
    hash_layers: int = 0  # deepseek4: leading hash-routed layers
    index_heads: int = 0  # deepseek4: lightning indexer heads
    index_dim: int = 0  # deepseek4: and their dimension
    ratios: str = ""  # deepseek4: compression-ratio schedule, "flash" or "pro" (see compress_ratios)
    kv_lora: int = (
        0  # glm-dsa: MLA kv LoRA rank (q_lora, index_heads, index_dim as above; head_dim = nope + rope)
    )
    rope_dim: int = 0  # glm-dsa: roped dims of a query head
    v_dim: int = 0  # glm-dsa: value head dimension


GEOMETRIES = {
    "qwen3.6-35b-a3b": SynthGeometry(40, 256, 8, 2048, 512, 16, 2, 256, 248320),
    "qwen3-30b-a3b": SynthGeometry(48, 128, 8, 2048, 768, 32, 4, 128, 151936),
    # zai-org's config.json: GLM-4.5-Air 106B-A12B; GLM-4.6 355B-A32B (= GLM-4.5, GLM-4.7)
    "glm-4.5-air": SynthGeometry(46, 128, 8, 4096, 1408, 96, 8, 128, 151552, 131072, "glm4moe", 1, 10944, False),
    "glm-4.6": SynthGeometry(92, 160, 8, 5120, 1536, 96, 8, 128, 151552, 202752, "glm4moe", 3, 12288, True),
    # zai-org's GLM-5 config.json (= GLM-5.1): MLA + DSA indexer, 744B-A40B
    "glm-5": SynthGeometry(78, 256, 8, 6144, 2048, 64, 1, 256, 154880, 202752, "glm-dsa", 3, 12288, False,
                           q_lora=2048, index_heads=32, index_dim=128, kv_lora=512, rope_dim=64, v_dim=256),
    # deepseek-ai's config.json: DeepSeek-V4-Flash 284B-A13B, DeepSeek-V4-Pro 1.6T-A49B
    "deepseek-v4-flash": SynthGeometry(43, 256, 6, 4096, 2048, 64, 1, 512, 129280, 1048576, "deepseek4",
                                       q_lora=1024, o_groups=8, o_lora=1024, hash_layers=3, index_heads=64,
                                       index_dim=128, ratios="flash"),
    "deepseek-v4-pro": SynthGeometry(61, 384, 6, 7168, 3072, 128, 1, 512, 129280, 1048576, "deepseek4",
                                     q_lora=1536, o_groups=16, o_lora=1024, hash_layers=3, index_heads=64,
                                     index_dim=128, ratios="pro"),
}  # fmt: skip


def compress_ratios(schedule: str, layers: int) -> list[int]:
    """deepseek4's per-layer KV compression: "flash": layers 0-1 window only (0), then 4 / 128 alternating;
    "pro": layers 0-1 128, then 128 / 4 alternating (transformers' DeepseekV4Config default)."""
    if schedule == "flash":
        return [0 if i < 2 else (4 if i % 2 == 0 else 128) for i in range(layers)]
    return [128 if i < 2 or i % 2 == 0 else 4 for i in range(layers)]


def synth_types() -> list[Q]:
    """The types ``forge synth`` writes: those whose torch decoder says where a block's fp16 scales are
    (every other byte pattern decodes to finite values), by type id."""
    return [t for t in ggml_types.types_with("torch") if fp16_fields(t) is not None]


def fp16_fields(qtype: Q) -> tuple[int, ...] | None:
    """Byte offsets of the fp16 scale fields (d, dmin) in one ``qtype`` block, registered with its decoder."""
    return getattr(ggml_types.implementation("torch", qtype), "fp16_fields", None)


def random_blocks(
    qtype: Q, n_blocks: int, rng: np.random.Generator, lo: float, hi: float, signed: bool = False
) -> np.ndarray:
    """uint8 (n_blocks, block bytes): random bytes with every fp16 scale field drawn from [lo, hi), so every
    decoder gives finite values. ``signed``: each block's scale fields share a random sign, which negates
    the block's values: the values average zero (random bytes alone give K-quants with minimums a positive
    mean, which sums coherently through every product)."""
    fields = fp16_fields(qtype)
    if fields is None:
        raise ForgeError(f"random {qtype.name} blocks are not supported (types: {_names(synth_types())})")
    blocks = rng.integers(0, 256, (n_blocks, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    sign = rng.choice(np.array([-1.0, 1.0]), n_blocks) if signed else 1.0
    for off in fields:
        d = (sign * rng.uniform(lo, hi, n_blocks)).astype(np.float16)
        blocks[:, off : off + 2] = d.view(np.uint8).reshape(-1, 2)
    return blocks


def _names(types: list[Q]) -> str:
    return ", ".join(t.name.lower() for t in types)


_POOL_BYTES = 32 << 20


#: element standard deviations of the synthesized matrices: a trained model's (~0.02 at these widths), the
#: attention's value and output projections (kept small, so the residual stream is the embedding plus the
#: experts' outputs), and the output head (logits in a trained model's range, so sampling varies). With
#: these every activation stays far inside float16's range, which llama.cpp's GPU kernels need: its 8-bit
#: activation blocks keep their sums in float16 (scaling by block scales alone left the experts' SwiGLU
#: outputs at up to 4.4e6 in the 35B geometry: its GPU prefill would route infinities).
WEIGHT_STD, QUIET_STD, HEAD_STD = 0.02, 2e-4, 0.03
#: a synthesized file's record of WEIGHT_STD; files written before it have none (see ``out_of_range``)
STD_KEY = "forge.synth.weight_std"


@cache
def _unit_std(qtype: Q) -> float:
    """The element standard deviation of random ``qtype`` blocks whose scale fields are drawn from [0.2, 2)
    (every decoded value is linear in them)."""
    import torch  # here, not at import: every ``forge`` command imports this module

    from runtime.dequant import dequantize

    probe = random_blocks(qtype, 1024, np.random.default_rng(0), 0.2, 2.0, signed=True)
    block = GGML_QUANT_SIZES[qtype][0]
    return float(dequantize(torch.from_numpy(probe).reshape(8, -1), qtype, 128 * block).std())


class _BlockPool:
    """A pool of random well-formed blocks of one type whose values have standard deviation ``std``; tensors
    are written as slices of it."""

    def __init__(self, qtype: Q, rng: np.random.Generator, std: float) -> None:
        size, scale = GGML_QUANT_SIZES[qtype][1], std / _unit_std(qtype)
        self.data = random_blocks(
            qtype, _POOL_BYTES // size, rng, 0.2 * scale, 2 * scale, signed=True
        ).reshape(-1)
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


def typed_kvs(arch: str, entries: dict[str, Any]) -> list[KV]:
    """A KV per entry, in order: ``<arch>.<key>``, a ``general.`` key as it is. The value type comes from the
    value: bool, int (UINT32), float (FLOAT32), str, or a list of floats (FLOAT32) or ints (INT32)."""
    return [
        KV(key if key.startswith("general.") else f"{arch}.{key}", v, *_vtypes(v))
        for key, v in entries.items()
    ]


def _vtypes(value: Any) -> tuple[GGUFValueType, ...]:
    if isinstance(value, list):
        item = GGUFValueType.FLOAT32 if isinstance(value[0], float) else GGUFValueType.INT32
        return GGUFValueType.ARRAY, item
    if isinstance(value, bool):
        return (GGUFValueType.BOOL,)
    if isinstance(value, int):
        return (GGUFValueType.UINT32,)
    return (GGUFValueType.FLOAT32,) if isinstance(value, float) else (GGUFValueType.STRING,)


def _arch_kvs(g: SynthGeometry, name: str, keys: dict[str, Any]) -> list[KV]:
    """general.architecture and .name, then ``<arch>.<key>`` for block_count, context_length, embedding_length and
    ``keys``, in that order, then ``STD_KEY``."""
    return typed_kvs(g.arch, {
        "general.architecture": g.arch, "general.name": f"synthetic {name} (random weights)",
        "block_count": g.layers, "context_length": g.context, "embedding_length": g.hidden, **keys,
    }) + [KV(STD_KEY, WEIGHT_STD, GGUFValueType.FLOAT32)]  # fmt: skip


def out_of_range(path: str | Path) -> bool:
    """Whether ``path`` is a file ``forge synth`` wrote before its values had a trained model's size
    (``WEIGHT_STD``): activations beyond float16's range, which llama.cpp's GPU kernels sum in."""
    from forge.gguf_file import open_gguf

    try:
        f = open_gguf(path)
    except ForgeError:
        return False
    name = str(f.kv("general.name", ""))
    return name.startswith("synthetic ") and name.endswith("(random weights)") and f.kv(STD_KEY) is None


def _glm_dsa_keys(g: SynthGeometry) -> dict[str, Any]:
    return {
        "feed_forward_length": g.dense_ff,
        "attention.head_count": g.heads,
        "attention.head_count_kv": 1,
        "rope.freq_base": 1e6,
        "attention.layer_norm_rms_epsilon": 1e-5,
        "expert_count": g.experts,
        "expert_used_count": g.experts_used,
        "expert_gating_func": 2,
        "attention.key_length": g.kv_lora + g.rope_dim,
        "attention.value_length": g.kv_lora,
        "leading_dense_block_count": g.dense_lead,
        **mla_keys(g),
        "expert_feed_forward_length": g.expert_ff,
        "expert_shared_count": 1,
        "expert_weights_scale": 2.5,
        "expert_weights_norm": True,
        "rope.dimension_count": g.rope_dim,
        **dsa_indexer_keys(g),
    }


def mla_keys(g: SynthGeometry) -> dict[str, Any]:
    """glm-dsa's MLA widths (``typed_kvs``); ``head_dim`` is a query head's nope + rope dims."""
    return {
        "attention.q_lora_rank": g.q_lora,
        "attention.kv_lora_rank": g.kv_lora,
        "attention.key_length_mla": g.head_dim,
        "attention.value_length_mla": g.v_dim,
    }


def dsa_indexer_keys(g: SynthGeometry) -> dict[str, Any]:
    """glm-dsa's lightning indexer (``typed_kvs``)."""
    return {
        "attention.indexer.head_count": g.index_heads,
        "attention.indexer.key_length": g.index_dim,
        "attention.indexer.top_k": 2048,
    }


def _gqa_keys(g: SynthGeometry) -> dict[str, Any]:
    return {
        "attention.head_count": g.heads,
        "attention.head_count_kv": g.kv_heads,
        "attention.key_length": g.head_dim,
        "attention.value_length": g.head_dim,
    }


def _glm4moe_keys(g: SynthGeometry) -> dict[str, Any]:
    return {
        "feed_forward_length": g.dense_ff,
        **_gqa_keys(g),
        "attention.layer_norm_rms_epsilon": 1e-5,
        "rope.freq_base": 1e6,
        "rope.dimension_count": g.head_dim // 2,
        "expert_count": g.experts,
        "expert_used_count": g.experts_used,
        "expert_feed_forward_length": g.expert_ff,
        "expert_shared_count": 1,
        "leading_dense_block_count": g.dense_lead,
        "expert_gating_func": 2,
        "expert_weights_scale": 1.0,
        "expert_weights_norm": True,
    }


_YARN = {
    "rope.scaling.type": "yarn",
    "rope.scaling.factor": 16.0,
    "rope.scaling.original_context_length": 65536,
    "rope.scaling.yarn_beta_fast": 32.0,
    "rope.scaling.yarn_beta_slow": 1.0,
}


def deepseek4_keys(
    g: SynthGeometry, ratios: list[int], yarn: bool = True, file_type: int | None = None
) -> dict[str, Any]:
    """deepseek4's keys after embedding_length, in llama.cpp's converter order (``typed_kvs``): ``ratios`` the
    per-layer compress ratios; ``yarn``: with the published models' YaRN rope scaling; ``file_type``: the
    converter's general.file_type, in its place."""
    return {
        "attention.head_count": g.heads,
        "attention.head_count_kv": 1,
        **(_YARN if yarn else {}),
        "rope.freq_base": 10000.0,
        "attention.layer_norm_rms_epsilon": 1e-6,
        "expert_count": g.experts,
        "expert_used_count": g.experts_used,
        "expert_gating_func": 4,  # sqrtsoftplus
        "attention.key_length": g.head_dim,
        "attention.value_length": g.head_dim,
        **({} if file_type is None else {"general.file_type": file_type}),
        "rope.dimension_count": min(64, g.head_dim),
        "attention.q_lora_rank": g.q_lora,
        "attention.sliding_window": 128,
        "expert_feed_forward_length": g.expert_ff,
        "expert_shared_count": 1,
        "expert_weights_scale": 1.5,
        "expert_weights_norm": True,
        "swiglu_clamp_exp": [10.0] * g.layers,
        "swiglu_clamp_shexp": [10.0] * g.layers,
        "attention.indexer.head_count": g.index_heads,
        "attention.indexer.key_length": g.index_dim,
        "attention.indexer.top_k": 512,
        "attention.output_group_count": g.o_groups,
        "attention.output_lora_rank": g.o_lora,
        "attention.compress_ratios": ratios,
        "attention.compress_rope_freq_base": 160000.0,
        "hyper_connection.count": HC_STREAMS,
        "hyper_connection.sinkhorn_iterations": 20,
        "hyper_connection.epsilon": 1e-6,
        "hash_layer_count": g.hash_layers,
        "embedding_length_out": HC_STREAMS * g.hidden,
    }


def _qwen3moe_keys(g: SynthGeometry) -> dict[str, Any]:
    return {
        "feed_forward_length": g.expert_ff,
        **_gqa_keys(g),
        "attention.layer_norm_rms_epsilon": 1e-6,
        "rope.freq_base": 1e7,
        "expert_count": g.experts,
        "expert_used_count": g.experts_used,
        "expert_feed_forward_length": g.expert_ff,
    }


_ARCH_KEYS = {"qwen3moe": _qwen3moe_keys, "glm4moe": _glm4moe_keys, "glm-dsa": _glm_dsa_keys,
              "deepseek4": lambda g: deepseek4_keys(g, compress_ratios(g.ratios, g.layers))}  # fmt: skip


def _kvs(g: SynthGeometry, name: str) -> list[KV]:
    return _arch_kvs(g, name, _ARCH_KEYS[g.arch](g))


def glm_block(g: SynthGeometry, i: int, qtype: Q) -> list[TensorSpec]:
    """Block ``i`` of a glm4moe / glm-dsa model, sorted by name: matrices in ``qtype`` (Q8_0 where a row is
    not a whole number of its blocks; a bf16 file's are all bf16), router, norms and biases in F32."""
    h, q_rows, kv_rows, p = g.hidden, g.heads * g.head_dim, g.kv_heads * g.head_dim, f"blk.{i}."
    whole = GGML_QUANT_SIZES[qtype][0]

    def w(
        name: str, shape: tuple[int, ...]
    ) -> TensorSpec:  # a row of partial blocks: Q8_0 (llama's fallback)
        return TensorSpec(p + name, shape, qtype if shape[-1] % whole == 0 else Q.Q8_0)

    if g.arch == "glm-dsa":  # MLA + the DSA indexer
        nope, r, kvl, ih, idim = g.head_dim - g.rope_dim, g.rope_dim, g.kv_lora, g.index_heads, g.index_dim
        layer = [
            TensorSpec(p + "attn_norm.weight", (h,), Q.F32), TensorSpec(p + "ffn_norm.weight", (h,), Q.F32),
            w("attn_q_a.weight", (g.q_lora, h)), TensorSpec(p + "attn_q_a_norm.weight", (g.q_lora,), Q.F32),
            w("attn_q_b.weight", (g.heads * g.head_dim, g.q_lora)), w("attn_kv_a_mqa.weight", (kvl + r, h)),
            TensorSpec(p + "attn_kv_a_norm.weight", (kvl,), Q.F32), w("attn_k_b.weight", (g.heads, kvl, nope)),
            w("attn_v_b.weight", (g.heads, g.v_dim, kvl)), w("attn_output.weight", (h, g.heads * g.v_dim)),
            w("indexer.attn_q_b.weight", (ih * idim, g.q_lora)), w("indexer.attn_k.weight", (idim, h)),
            TensorSpec(p + "indexer.k_norm.weight", (idim,), Q.F32),
            TensorSpec(p + "indexer.k_norm.bias", (idim,), Q.F32), TensorSpec(p + "indexer.proj.weight", (ih, h), Q.F32),
        ]  # fmt: skip
        return sorted(layer + _glm_ffn(g, i, w, p), key=lambda s: s.name)
    layer = [
        TensorSpec(p + "attn_norm.weight", (h,), Q.F32),
        TensorSpec(p + "post_attention_norm.weight", (h,), Q.F32),
        w("attn_q.weight", (q_rows, h)),
        w("attn_k.weight", (kv_rows, h)),
        w("attn_v.weight", (kv_rows, h)),
        TensorSpec(p + "attn_q.bias", (q_rows,), Q.F32),
        TensorSpec(p + "attn_k.bias", (kv_rows,), Q.F32),
        TensorSpec(p + "attn_v.bias", (kv_rows,), Q.F32),
        w("attn_output.weight", (h, q_rows)),
    ]
    if g.qk_norm:
        layer += [TensorSpec(p + "attn_q_norm.weight", (g.head_dim,), Q.F32),
                  TensorSpec(p + "attn_k_norm.weight", (g.head_dim,), Q.F32)]  # fmt: skip
    return sorted(layer + _glm_ffn(g, i, w, p), key=lambda s: s.name)


def _glm_ffn(g: SynthGeometry, i: int, w: Any, p: str) -> list[TensorSpec]:
    h, ff = g.hidden, g.expert_ff
    if i < g.dense_lead:
        return [w("ffn_gate.weight", (g.dense_ff, h)), w("ffn_up.weight", (g.dense_ff, h)),
                w("ffn_down.weight", (h, g.dense_ff))]  # fmt: skip
    return [
        TensorSpec(p + "ffn_gate_inp.weight", (g.experts, h), Q.F32),
        TensorSpec(p + "exp_probs_b.bias", (g.experts,), Q.F32),
        w("ffn_gate_exps.weight", (g.experts, ff, h)),
        w("ffn_up_exps.weight", (g.experts, ff, h)),
        w("ffn_down_exps.weight", (g.experts, h, ff)),
        w("ffn_gate_shexp.weight", (ff, h)),
        w("ffn_up_shexp.weight", (ff, h)),
        w("ffn_down_shexp.weight", (h, ff)),
    ]


HC_STREAMS = 4  # deepseek4's hyper-connection streams (both models)


#: what a deepseek4 tensor is, for its type: routed experts, the FP8 projections of a published checkpoint
#: (attention, shared expert, indexer query), its BF16 ones (compressors, indexer head weights), the router, the
#: F32 matrices (hyper-connection mixing, compressor position biases), vectors (norms, sinks, biases), the hash table
Deepseek4Role = Literal["expert", "fp8", "bf16", "router", "f32_matrix", "f32", "i32"]


def deepseek4_block(
    g: SynthGeometry, i: int, ratio: int, type_of: Callable[[Deepseek4Role, tuple[int, ...]], Q]
) -> list[TensorSpec]:
    """Block ``i`` (compress ratio ``ratio``) of a deepseek4 model in llama.cpp's converter order, each tensor
    typed by ``type_of(role, shape)``."""
    h, hd, ff, e, p = g.hidden, g.head_dim, g.expert_ff, g.experts, f"blk.{i}."
    mix = (2 + HC_STREAMS) * HC_STREAMS

    def t(role: Deepseek4Role, name: str, shape: tuple[int, ...]) -> TensorSpec:
        return TensorSpec(p + name, shape, type_of(role, shape))

    out = [t("i32", "ffn_gate_tid2eid.weight", (g.vocab, g.experts_used))] if i < g.hash_layers else []
    out += [
        t("expert", "ffn_gate_exps.weight", (e, ff, h)), t("expert", "ffn_down_exps.weight", (e, h, ff)),
        t("expert", "ffn_up_exps.weight", (e, ff, h)),
        t("f32", "attn_sinks.weight", (g.heads,)), t("f32", "attn_kv_a_norm.weight", (hd,)),
        t("f32", "attn_q_a_norm.weight", (g.q_lora,)), t("fp8", "attn_kv.weight", (hd, h)),
        t("fp8", "attn_output_a.weight", (g.o_groups * g.o_lora, g.heads * hd // g.o_groups)),
        t("fp8", "attn_output_b.weight", (h, g.o_groups * g.o_lora)), t("fp8", "attn_q_a.weight", (g.q_lora, h)),
        t("fp8", "attn_q_b.weight", (g.heads * hd, g.q_lora)), t("f32", "attn_norm.weight", (h,)),
        t("router", "ffn_gate_inp.weight", (e, h)), t("fp8", "ffn_gate_shexp.weight", (ff, h)),
        t("fp8", "ffn_down_shexp.weight", (h, ff)), t("fp8", "ffn_up_shexp.weight", (ff, h)),
        t("f32", "ffn_norm.weight", (h,)),
        *(x for s in ("attn", "ffn") for x in (t("f32", f"hc_{s}_base.weight", (mix,)),
          t("f32_matrix", f"hc_{s}_fn.weight", (mix, HC_STREAMS * h)), t("f32", f"hc_{s}_scale.weight", (3,)))),
    ]  # fmt: skip
    if i >= g.hash_layers:
        out.append(t("f32", "exp_probs_b.bias", (e,)))
    if ratio:
        coff = 2 if ratio == 4 else 1
        out += [t("f32_matrix", "attn_compressor_ape.weight", (ratio, coff * hd)),
                t("f32", "attn_compressor_norm.weight", (hd,)), t("bf16", "attn_compressor_gate.weight", (coff * hd, h)),
                t("bf16", "attn_compressor_kv.weight", (coff * hd, h))]  # fmt: skip
    if ratio == 4:
        di = g.index_dim
        out += [t("f32_matrix", "indexer_compressor_ape.weight", (ratio, 2 * di)),
                t("f32", "indexer_compressor_norm.weight", (di,)), t("bf16", "indexer_compressor_gate.weight", (2 * di, h)),
                t("bf16", "indexer_compressor_kv.weight", (2 * di, h)), t("bf16", "indexer.proj.weight", (g.index_heads, h)),
                t("fp8", "indexer.attn_q_b.weight", (g.index_heads * di, g.q_lora))]  # fmt: skip
    return out


def _deepseek4_layer(g: SynthGeometry, i: int, ratio: int, qtype: Q) -> list[TensorSpec]:
    """A deepseek4 block as llama-quantize leaves it, sorted by name: matrices in ``qtype`` (Q8_0 where a row is
    not a whole number of its blocks), the router, norms, biases, sinks in F32, the hash table in I32."""
    whole = GGML_QUANT_SIZES[qtype][0]

    def type_of(role: Deepseek4Role, shape: tuple[int, ...]) -> Q:
        if role in ("f32", "router"):
            return Q.F32
        if role == "i32":
            return Q.I32
        return qtype if shape[-1] % whole == 0 else Q.Q8_0

    return sorted(deepseek4_block(g, i, ratio, type_of), key=lambda s: s.name)


def synth_tensors(g: SynthGeometry, qtype: Q) -> list[TensorSpec]:
    """Tensor specs (numpy shapes) in llama-quantize's order: blocks' tensors sorted by name."""
    if g.arch == "deepseek4":
        h, whole = g.hidden, GGML_QUANT_SIZES[qtype][0]
        head_fn = HC_STREAMS * h
        return [TensorSpec("token_embd.weight", (g.vocab, h), qtype),
                *(s for i, r in enumerate(compress_ratios(g.ratios, g.layers)) for s in _deepseek4_layer(g, i, r, qtype)),
                TensorSpec("output_hc_base.weight", (HC_STREAMS,), Q.F32),
                TensorSpec("output_hc_fn.weight", (HC_STREAMS, head_fn), qtype if head_fn % whole == 0 else Q.Q8_0),
                TensorSpec("output_hc_scale.weight", (1,), Q.F32),
                TensorSpec("output.weight", (g.vocab, h), qtype),
                TensorSpec("output_norm.weight", (h,), Q.F32)]  # fmt: skip
    if g.arch in ("glm4moe", "glm-dsa"):
        return [TensorSpec("token_embd.weight", (g.vocab, g.hidden), qtype),
                *(s for i in range(g.layers) for s in glm_block(g, i, qtype)),
                TensorSpec("output.weight", (g.vocab, g.hidden), qtype),
                TensorSpec("output_norm.weight", (g.hidden,), Q.F32)]  # fmt: skip
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
    vocab: int | None = None, seed: int = 0, **overrides: int | None,
) -> int:  # fmt: skip
    """Write the synthetic GGUF; returns its size in bytes.

    ``layers``, ``vocab`` and ``overrides`` (any other SynthGeometry field) replace the geometry's values
    where not None. Everything is checked before any work.
    """
    g = GEOMETRIES.get(geometry) if isinstance(geometry, str) else geometry
    if g is None:
        raise ForgeError(f"unknown geometry {geometry!r} (known: {', '.join(GEOMETRIES)})")
    changes = {k: v for k, v in {"layers": layers, "vocab": vocab, **overrides}.items() if v is not None}
    g = replace(g, **changes)
    require_choice("--type", qtype.lower(), [t.name.lower() for t in synth_types()])
    t = Q[qtype.upper()]
    check_geometry(g, t)
    require_seed("--seed", seed)
    rng = np.random.default_rng(seed)
    # Blocks of random sign average zero, so no product adds a common vector to every token and routing
    # depends on the token (as in a trained model; tests/test_synth.py). See WEIGHT_STD.
    specs = synth_tensors(g, t)
    pools: dict[tuple[Q, float], _BlockPool] = {}

    def data() -> Iterator[Any]:
        for s in specs:
            if s.ggml_type == Q.F32 and "gate_inp" in s.name:
                # router rows orthogonal to the all-ones direction (a norm's scale shifts no logit)
                w = rng.standard_normal(s.shape)
                yield (w - w.mean(axis=-1, keepdims=True)).astype(np.float32)
            elif s.ggml_type == Q.F32 and s.name.endswith(".bias"):
                yield np.zeros(s.shape, np.float32)  # glm4moe's attention biases and selection bias
            elif s.ggml_type == Q.I32:  # deepseek4's hash routing: k distinct experts per token
                first = rng.integers(0, g.experts, (s.shape[0], 1))
                yield ((first + np.arange(s.shape[1])) % g.experts).astype(np.int32)
            elif s.ggml_type == Q.F32:
                yield np.ones(s.shape, np.float32)  # norms: 1 keeps the common component out of routing
            else:
                quiet = ".attn_output." in s.name or ".attn_v." in s.name
                std = HEAD_STD if s.name == "output.weight" else QUIET_STD if quiet else WEIGHT_STD
                if (s.ggml_type, std) not in pools:  # a pool per type (glm4moe's Q8_0 rows too) and deviation
                    pools[(s.ggml_type, std)] = _BlockPool(s.ggml_type, rng, std)
                yield pools[(s.ggml_type, std)].writer(s.nbytes)

    name = geometry if isinstance(geometry, str) else "custom"
    if any(v is not None for v in overrides.values()):
        name += ", custom dimensions"
    return write_gguf(dest, _kvs(g, name) + tokenizer_kvs(g.vocab), specs, data())


# Upper bounds keep a typo from asking for a file no disk holds; experts: llama.cpp's LLAMA_MAX_EXPERTS.
MAX_LAYERS, MAX_EXPERTS, MAX_DIM, MAX_HEADS = 1024, 512, 65536, 1024


def check_geometry(g: SynthGeometry, t: Q) -> None:
    """Every dimension in range and a whole number of ``t``'s blocks where it is a row length."""
    block = GGML_QUANT_SIZES[t][0]
    require_int("--layers", g.layers, 1, MAX_LAYERS)
    require_int("--experts", g.experts, 1, MAX_EXPERTS)
    require_int("--experts-used", g.experts_used, 1, g.experts)
    require_int("--heads", g.heads, 1, MAX_HEADS)
    require_int("--kv-heads", g.kv_heads, 1, g.heads)
    if g.heads % g.kv_heads:
        raise ForgeError(f"--heads ({g.heads}) must be a multiple of --kv-heads ({g.kv_heads})")
    require_int("--head-dim", g.head_dim, 2, MAX_DIM)
    if g.head_dim % 2:
        raise ForgeError(f"--head-dim must be even (RoPE rotates pairs), not {g.head_dim}")
    require_int("--vocab", g.vocab, MIN_VOCAB, MAX_VOCAB)
    require_int("context", g.context, 1, 2**31 - 1)
    rows = {"--hidden": g.hidden, "--expert-ff": g.expert_ff, "--heads x --head-dim": g.heads * g.head_dim}
    if g.arch == "deepseek4":  # rows of partial blocks are written as Q8_0
        for option, n in (("--hidden", g.hidden), ("--expert-ff", g.expert_ff), ("--head-dim", g.head_dim),
                          ("q LoRA rank", g.q_lora), ("output LoRA rank", g.o_lora), ("indexer dim", g.index_dim)):  # fmt: skip
            require_int(option, n, 32, MAX_DIM)
            if n % 32:
                raise ForgeError(f"{option} must be a multiple of 32 (Q8_0 blocks), not {n}")
        if (g.heads * g.head_dim // max(g.o_groups, 1)) % 32:
            raise ForgeError(
                "deepseek4: heads x head dim / output groups must be a multiple of 32 (Q8_0 blocks)"
            )
        if g.heads % g.o_groups or g.kv_heads != 1:
            raise ForgeError(f"deepseek4: --heads ({g.heads}) must be a multiple of the output groups "
                             f"({g.o_groups}) and --kv-heads 1")  # fmt: skip
        require_int("--experts-used", g.experts_used, 1, g.experts)
        return
    if g.arch in ("glm4moe", "glm-dsa"):  # FFN rows of partial blocks are written as Q8_0
        require_int("--layers", g.layers, g.dense_lead + 1, MAX_LAYERS)
        for option, n in (("--expert-ff", g.expert_ff), ("dense FFN", g.dense_ff)):
            require_int(option, n, 32, MAX_DIM)
            if n % 32:
                raise ForgeError(f"{option} must be a multiple of 32 (Q8_0 blocks), not {n}")
        del rows["--expert-ff"]
    for option, n in rows.items():
        require_int(option, n, block, MAX_DIM)
        if n % block:
            raise ForgeError(f"{option} must be a multiple of {block} ({t.name} blocks), not {n}")


# --- tokenizer ----------------------------------------------------------------------------------------------
NORMAL, CONTROL = 1, 3  # llama.cpp's token types
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MIN_VOCAB, MAX_VOCAB = 256 + len(SPECIALS), 1 << 19
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _words() -> Iterator[str]:
    """ " a".." z", then "aa", " aa" .. "zz", " zz", then three letters, ...: each one merge from a shorter one."""
    space = _byte_to_unicode()[ord(" ")]
    for n in count(1):
        for letters in product(ascii_lowercase, repeat=n):
            word = "".join(letters)
            yield space + word
            if n > 1:
                yield word


def synth_tokens(vocab: int) -> tuple[list[str], list[int], list[str]]:
    """Tokens, token types and merges of the synthetic byte-level BPE vocabulary of ``vocab`` entries."""
    byte_map = _byte_to_unicode()
    tokens = [byte_map[b] for b in range(256)] + list(SPECIALS)
    types = [NORMAL] * 256 + [CONTROL] * len(SPECIALS)
    words = list(islice(_words(), max(vocab - len(tokens), 0)))
    merges = [f"{w[:-1]} {w[-1]}" for w in words]
    return tokens + words, types + [NORMAL] * len(words), merges


def tokenizer_kvs(vocab: int) -> list[KV]:
    tokens, types, merges = synth_tokens(vocab)
    eot = SPECIALS.index("<|endoftext|>") + 256
    arr, s, u = GGUFValueType.ARRAY, GGUFValueType.STRING, GGUFValueType.UINT32
    return [
        KV("tokenizer.ggml.model", "gpt2", s),
        KV("tokenizer.ggml.pre", "qwen2", s),
        KV("tokenizer.ggml.tokens", tokens, arr, s),
        KV("tokenizer.ggml.token_type", types, arr, GGUFValueType.INT32),
        KV("tokenizer.ggml.merges", merges, arr, s),
        KV("tokenizer.ggml.bos_token_id", eot, u),  # explicit: llama.cpp's gpt2 default is token 11
        KV("tokenizer.ggml.eos_token_id", eot, u),
        KV("tokenizer.ggml.padding_token_id", eot, u),
        KV("tokenizer.ggml.add_bos_token", False, GGUFValueType.BOOL),
        KV("tokenizer.chat_template", CHATML, s),
    ]


def synth(
    output: Annotated[Path, typer.Option("-o", "--output", help="GGUF file to write")],
    geometry: Annotated[str, typer.Option(help=f"one of: {', '.join(GEOMETRIES)}")] = "qwen3.6-35b-a3b",
    type_: Annotated[
        str,
        typer.Option(
            "--type", help="weights' quant type: a block type with fp16 scales (q4_0, q8_0, q2_k...q6_k, iq*)"
        ),
    ] = "q4_k",
    layers: Annotated[int | None, typer.Option(help="fewer layers than the geometry's")] = None,
    vocab: Annotated[int | None, typer.Option(help="vocabulary size (default: the geometry's)")] = None,
    seed: Annotated[int, typer.Option(help="random seed")] = 0,
    experts: Annotated[int | None, typer.Option(help="routed experts per layer")] = None,
    experts_used: Annotated[int | None, typer.Option(help="experts chosen per token")] = None,
    hidden: Annotated[int | None, typer.Option(help="embedding length")] = None,
    expert_ff: Annotated[int | None, typer.Option(help="expert FFN length")] = None,
    heads: Annotated[int | None, typer.Option(help="attention heads")] = None,
    kv_heads: Annotated[int | None, typer.Option(help="KV heads")] = None,
    head_dim: Annotated[int | None, typer.Option(help="head dimension")] = None,
) -> None:
    """Write a GGUF with random well-formed quantized weights in a real model's geometry (benchmarks).

    The geometry options (default: the geometry's own) make small custom models, e.g. for tests.
    """
    size = synthesize(
        output, geometry, type_, layers, vocab, seed, experts=experts, experts_used=experts_used,
        hidden=hidden, expert_ff=expert_ff, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
    )  # fmt: skip
    typer.echo(f"{output}: {size / 1e9:.2f} GB, {geometry}, {type_}")
