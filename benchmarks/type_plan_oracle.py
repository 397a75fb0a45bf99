"""llama.cpp's type plan over real geometries: forge's recipes against llama-quantize, preset by preset.

The fixture models exercise only part of llama-quantize's mixture rules (3-4 layers, n_gqa 2). Real models
differ exactly where the rules branch: layer counts (use_more_bits, the first eighth/sixteenth), head
grouping (n_gqa >= 4), expert counts (n_expert >= 4, n_expert == 8), shared experts (two ffn_down per
layer), DeltaNet layers (a fused attn_qkv counts as attn_v), MTP layers, tied embeddings. This script writes
a bf16 GGUF for each geometry below with the *real* layer count, head counts, expert count and
experts-used, layer pattern (DeltaNet / full attention, shared expert, MTP block) and the real tensor
names, but small widths (hidden 256, expert FFN 256: every row length stays a multiple of 256 as in the
real models, so no row-length fallback is triggered that the real model would not trigger), then for every
forge preset that llama.cpp has as a file type compares the type of every tensor:

- llama.cpp: ``llama_model_quantize`` of llama-cpp-python (llama.cpp's own quantizer, in process) with
  ``dry_run`` (the types of a dry run are the ones a real run writes: both take them from the same
  preliminary pass; ``--check-real`` quantizes for real and reads the file back), with and without an
  imatrix (``params.imatrix``: one all-ones entry per weight tensor, per expert for ``_exps``); or the
  ``llama-quantize`` binary (``--llama-quantize PATH`` or FORGE_LLAMA_QUANTIZE, ``--imatrix FILE`` written
  with forge's own GGUF imatrix writer);
- forge: ``forge.quant.plan.make_plan`` on the same file (what ``forge quantize --dry-run --json`` prints).

The tensor data does not take part in the type plan, so by default the files are sparse (the header and
zero holes): a 512-expert, 61-layer model costs a few MB of disk. ``--data random`` writes random bf16
values instead (for the real-quantization cross-check; small geometries only).

Size classes: llama-quantize's only size-class rule (``LLM_TYPE_70B``: attn_v one step up) is set by the
llama/qwen2/deci/olmo/jais2 loaders for 80 (68) layers; ``qwen3moe`` and ``qwen35moe`` never get it (their
classes are 30B_A3B / 235B_A22B / 35B_A3B / 122B_A10B / 397B_A17B), so no geometry here reaches it.

    python benchmarks/type_plan_oracle.py                      # every geometry x every preset, a table
    python benchmarks/type_plan_oracle.py --geometry qwen3-30b-a3b --preset q4_k_m --show-diff
    python benchmarks/type_plan_oracle.py --json               # one JSON report
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from forge.errors import ForgeError  # noqa: E402
from forge.gguf_file import KV, GGUFLayout, TensorSpec  # noqa: E402
from forge.imatrix.formats import write_imatrix  # noqa: E402
from forge.imatrix.model import Imatrix  # noqa: E402
from forge.quant.plan import is_quantizable, make_plan  # noqa: E402
from forge.quant.recipe import available_recipes, load_recipe  # noqa: E402
from forge.quant.source import GGUFQuantSource, SrcTensor, source_ref  # noqa: E402
from runtime.synth import (  # noqa: E402
    HC_STREAMS,
    SynthGeometry,
    compress_ratios,
    deepseek4_block,
    deepseek4_keys,
    dsa_indexer_keys,
    glm_block,
    mla_keys,
    synth_tensors,
    tokenizer_kvs,
    typed_kvs,
)
from runtime.synth import _kvs as qwen3moe_kvs  # noqa: E402

HIDDEN, EXPERT_FF, VOCAB = 256, 256, 512


@dataclass(frozen=True)
class Geometry:
    """A real model's type-plan-relevant shape (widths are small; see the module docstring)."""

    name: str
    arch: str  # qwen3moe | qwen35moe | glm4moe | deepseek4
    layers: int  # decoder layers (without the MTP block)
    heads: int
    kv_heads: int
    head_dim: int  # the real one (recorded); the files use 64, keeping n_head x head_dim a multiple of 256
    experts: int
    experts_used: int
    tied: bool = False
    mtp: int = 0  # qwen35moe: MTP blocks exported as extra layers (forge convert's default: 1)
    full_attention_interval: int = 4  # qwen35moe: every 4th layer is full attention, the rest DeltaNet
    linear_k_heads: int = 0  # qwen35moe DeltaNet key heads
    linear_v_heads: int = 0  # qwen35moe DeltaNet value heads
    linear_head_dim: int = 128
    hidden: int = HIDDEN  # embedding length (256 keeps every row a multiple of 256, as in the real models)
    source: str = ""  # where the numbers come from

    @property
    def block_count(self) -> int:
        return self.layers + self.mtp


#: The geometry table (config.json of each model; widths reduced). Recorded in the test as well.
GEOMETRIES = {
    g.name: g
    for g in (
        Geometry("qwen3-30b-a3b", "qwen3moe", 48, 32, 4, 128, 128, 8,
                 source="Qwen/Qwen3-30B-A3B config.json"),
        Geometry("qwen3-235b-a22b", "qwen3moe", 94, 64, 4, 128, 128, 8,
                 source="Qwen/Qwen3-235B-A22B config.json"),
        Geometry("qwen3-coder-480b-a35b", "qwen3moe", 62, 96, 8, 128, 160, 8,
                 source="Qwen/Qwen3-Coder-480B-A35B-Instruct config.json"),
        Geometry("qwen3.6-35b-a3b", "qwen35moe", 40, 16, 2, 256, 256, 8, mtp=1,
                 linear_k_heads=16, linear_v_heads=32,
                 source="Qwen/Qwen3.6-35B-A3B config.json (as Qwen3.5-35B-A3B); MTP block exported"),
        Geometry("qwen3.6-35b-a3b-nomtp", "qwen35moe", 40, 16, 2, 256, 256, 8, mtp=0,
                 linear_k_heads=16, linear_v_heads=32,
                 source="the same converted with --no-mtp (llama.cpp converters without MTP support)"),
        Geometry("qwen3.5-397b-a17b", "qwen35moe", 60, 32, 2, 256, 512, 10, mtp=1,
                 linear_k_heads=16, linear_v_heads=64,
                 source="Qwen/Qwen3.5-397B-A17B config.json; MTP block exported"),
        Geometry("qwen3-30b-a3b-tied", "qwen3moe", 48, 32, 4, 128, 128, 8, tied=True,
                 source="Qwen3-30B-A3B with tied embeddings (no output.weight): synthetic"),
        Geometry("qwen3moe-8x-synthetic", "qwen3moe", 32, 32, 8, 128, 8, 2,
                 source="synthetic: 8 experts (llama.cpp's Mixtral n_expert == 8 rules), n_gqa 4"),
        Geometry("qwen3moe-hidden1088-synthetic", "qwen3moe", 24, 16, 4, 128, 64, 4, hidden=1088,
                 source="synthetic: hidden 1088 (not a multiple of 256): row-length fallbacks, output rule"),
        Geometry("qwen35moe-gqa2-synthetic", "qwen35moe", 24, 4, 2, 64, 32, 4, mtp=1, linear_k_heads=2,
                 linear_v_heads=4, linear_head_dim=64,
                 source="synthetic: the tiny-qwen35moe fixture's geometry at 24 layers (n_gqa 2 < 4)"),
        Geometry("qwen3moe-gqa2-2x-synthetic", "qwen3moe", 16, 8, 4, 64, 2, 1,
                 source="synthetic: n_gqa 2 and 2 experts (the IQ1/IQ2 family's low attn_v branch)"),
    )
}  # fmt: skip


@dataclass(frozen=True)
class GlmGeometry(Geometry):
    """glm4moe: leading dense layers, a shared expert, q/k biases, optional q/k norms. The FFN widths keep the
    real ones' remainder mod 256 (GLM-4.5-Air's 1408 and 10944 are not multiples of 256: llama-quantize's
    row-length fallbacks apply to its ffn_down tensors, as they do on the real model)."""

    dense_lead: int = 1  # first_k_dense_replace
    dense_ff: int = 512  # intermediate_size (small, same remainder mod 256 as the real one)
    expert_ff: int = EXPERT_FF  # moe_intermediate_size (likewise)
    qk_norm: bool = False  # use_qk_norm


GEOMETRIES.update({
    g.name: g
    for g in (
        GlmGeometry("glm-4.5-air", "glm4moe", 46, 96, 8, 128, 128, 8, mtp=1, dense_lead=1, dense_ff=448,
                    expert_ff=384, qk_norm=False,
                    source="zai-org/GLM-4.5-Air config.json (ffn 10944, expert ffn 1408); MTP block exported"),
        GlmGeometry("glm-4.5-air-nomtp", "glm4moe", 46, 96, 8, 128, 128, 8, mtp=0, dense_lead=1, dense_ff=448,
                    expert_ff=384, qk_norm=False, source="the same converted with --no-mtp"),
        GlmGeometry("glm-4.6", "glm4moe", 92, 96, 8, 128, 160, 8, mtp=1, dense_lead=3, dense_ff=512,
                    expert_ff=256, qk_norm=True,
                    source="zai-org/GLM-4.6 config.json (= GLM-4.5, GLM-4.7: ffn 12288, expert ffn 1536); MTP "
                           "block exported"),
    )
})  # fmt: skip


@dataclass(frozen=True)
class Deepseek4Geometry(Geometry):
    """deepseek4 as llama.cpp's converter writes a published (FP8 + FP4) checkpoint: routed experts MXFP4, the
    FP8 projections (attention, indexer query, shared expert) Q8_0, embeddings, router and compressor/indexer
    projections BF16, hyper-connections, sinks and compressor position biases F32, tid2eid I32; the MTP block
    left out (llama.cpp exports it only as a separate draft). Widths keep the real ones' multiples of 256:
    head dim 256 (so the compressors' ape rows, 1x/2x head dim, stay multiples of 256 as the real 512/1024)."""

    q_lora: int = 256
    o_groups: int = 8
    o_lora: int = 256
    expert_ff: int = EXPERT_FF
    hash_layers: int = 3
    compress_ratios: tuple[int, ...] = ()  # one per decoder layer: 0 (window only), 4 (CSA) or 128 (HCA)
    index_heads: int = 64
    index_dim: int = 128
    attn_head_dim: int = 256  # the files' head dim (head_dim records the real one)


GEOMETRIES.update({
    g.name: g
    for g in (
        Deepseek4Geometry("deepseek-v4-flash", "deepseek4", 43, 64, 1, 512, 256, 6, o_groups=8,
                          hash_layers=3, compress_ratios=tuple(compress_ratios("flash", 43)),
                          source="deepseek-ai/DeepSeek-V4-Flash config.json (hidden 4096, q_lora 1024, o_lora 1024, "
                                 "expert ffn 2048, indexer 64 x 128); MTP block not exported"),
        Deepseek4Geometry("deepseek-v4-pro", "deepseek4", 61, 128, 1, 512, 384, 6, o_groups=16,
                          hash_layers=3, compress_ratios=tuple(compress_ratios("pro", 61)),
                          source="deepseek-ai/DeepSeek-V4-Pro config.json (hidden 7168, q_lora 1536, o_lora 1024, "
                                 "expert ffn 3072, indexer 64 x 128); MTP block not exported"),
    )
})  # fmt: skip


# ------------------------------------------------------------------------------------------ the files


def _head_dim(g: Geometry) -> int:
    # small heads, but n_head x head_dim (attn_output's row) stays a multiple of 256 like the real one's
    return 64


def _kvs(arch: str, g: Geometry, entries: dict[str, Any]) -> list[KV]:
    """general.architecture, .type and .name, ``entries`` (runtime.synth.typed_kvs), the tokenizer's."""
    head = {"general.architecture": arch, "general.type": "model",
            "general.name": f"type-plan oracle {g.name} (small widths)"}  # fmt: skip
    return typed_kvs(arch, {**head, **entries}) + tokenizer_kvs(VOCAB)


def qwen3moe_model(g: Geometry) -> tuple[list[KV], list[TensorSpec]]:
    sg = SynthGeometry(g.layers, g.experts, g.experts_used, g.hidden, EXPERT_FF, g.heads, g.kv_heads,
                       _head_dim(g), VOCAB)  # fmt: skip
    specs = synth_tensors(sg, Q.BF16)
    if g.tied:
        specs = [s for s in specs if s.name != "output.weight"]
    kvs = [*qwen3moe_kvs(sg, g.name), KV("general.file_type", 32, GGUFValueType.UINT32)]
    return kvs + tokenizer_kvs(VOCAB), specs


def qwen35moe_model(g: Geometry) -> tuple[list[KV], list[TensorSpec]]:
    """llama.cpp's qwen35moe tensor set (as forge convert and convert_hf_to_gguf.py write it)."""
    h, hd, ff, bf, f32 = g.hidden, _head_dim(g), EXPERT_FF, Q.BF16, Q.F32
    nk, nv, dh = g.linear_k_heads, g.linear_v_heads, g.linear_head_dim
    specs = [TensorSpec("token_embd.weight", (VOCAB, h), bf)]
    for i in range(g.block_count):
        p = f"blk.{i}."
        layer = [
            TensorSpec(p + "attn_norm.weight", (h,), f32),
            TensorSpec(p + "post_attention_norm.weight", (h,), f32),
            TensorSpec(p + "ffn_gate_inp.weight", (g.experts, h), f32),
            TensorSpec(p + "ffn_gate_exps.weight", (g.experts, ff, h), bf),
            TensorSpec(p + "ffn_up_exps.weight", (g.experts, ff, h), bf),
            TensorSpec(p + "ffn_down_exps.weight", (g.experts, h, ff), bf),
            TensorSpec(p + "ffn_gate_shexp.weight", (ff, h), bf),
            TensorSpec(p + "ffn_up_shexp.weight", (ff, h), bf),
            TensorSpec(p + "ffn_down_shexp.weight", (h, ff), bf),
            TensorSpec(p + "ffn_gate_inp_shexp.weight", (1, h), f32),
        ]
        recurrent = i < g.layers and (i + 1) % g.full_attention_interval != 0
        if recurrent:  # Gated DeltaNet
            layer += [
                TensorSpec(p + "ssm_a", (nv,), f32),
                TensorSpec(p + "ssm_conv1d.weight", (2 * nk * dh + nv * dh, 4), f32),
                TensorSpec(p + "ssm_dt.bias", (nv,), f32),
                TensorSpec(p + "ssm_alpha.weight", (nv, h), bf),
                TensorSpec(p + "ssm_beta.weight", (nv, h), bf),
                TensorSpec(p + "attn_qkv.weight", (2 * nk * dh + nv * dh, h), bf),
                TensorSpec(p + "attn_gate.weight", (nv * dh, h), bf),
                TensorSpec(p + "ssm_norm.weight", (dh,), f32),
                TensorSpec(p + "ssm_out.weight", (h, nv * dh), bf),
            ]
        else:  # gated full attention (q carries the gate: 2 x n_head x head_dim rows)
            layer += [
                TensorSpec(p + "attn_q.weight", (2 * g.heads * hd, h), bf),
                TensorSpec(p + "attn_k.weight", (g.kv_heads * hd, h), bf),
                TensorSpec(p + "attn_v.weight", (g.kv_heads * hd, h), bf),
                TensorSpec(p + "attn_output.weight", (h, g.heads * hd), bf),
                TensorSpec(p + "attn_q_norm.weight", (hd,), f32),
                TensorSpec(p + "attn_k_norm.weight", (hd,), f32),
            ]
        if i >= g.layers:  # the MTP block
            layer += _nextn(p, h)
        specs += sorted(layer, key=lambda s: s.name)
    if not g.tied:
        specs.append(TensorSpec("output.weight", (VOCAB, h), bf))
    specs.append(TensorSpec("output_norm.weight", (h,), f32))

    keys = {
        "block_count": g.block_count,
        "context_length": 262144,
        "embedding_length": h,
        "attention.head_count": g.heads,
        "attention.head_count_kv": g.kv_heads,
        "rope.freq_base": 1e7,
        "attention.layer_norm_rms_epsilon": 1e-6,
        "expert_count": g.experts,
        "expert_used_count": g.experts_used,
        "attention.key_length": hd,
        "attention.value_length": hd,
        "general.file_type": 32,
        "expert_feed_forward_length": ff,
        "expert_shared_feed_forward_length": ff,
        "ssm.conv_kernel": 4,
        "ssm.state_size": dh,
        "ssm.group_count": nk,
        "ssm.time_step_rank": nv,
        "ssm.inner_size": nv * dh,
        "full_attention_interval": g.full_attention_interval,
        "rope.dimension_count": hd // 4,
        "rope.dimension_sections": [11, 11, 10, 0],
        "general.quantization_version": 2,
        **({"nextn_predict_layers": g.mtp} if g.mtp else {}),
    }
    return _kvs("qwen35moe", g, keys), specs


def _nextn(p: str, h: int) -> list[TensorSpec]:
    """The MTP block's own tensors (llama.cpp's NextN names) as the converters write them."""
    return [
        TensorSpec(p + "nextn.eh_proj.weight", (h, 2 * h), Q.BF16),
        TensorSpec(p + "nextn.enorm.weight", (h,), Q.F32),
        TensorSpec(p + "nextn.hnorm.weight", (h,), Q.F32),
        TensorSpec(p + "nextn.shared_head_norm.weight", (h,), Q.F32),
    ]


def _glm_synth(g: GlmGeometry) -> SynthGeometry:
    """``g`` as runtime.synth's geometry (the MTP block one more layer)."""
    if isinstance(g, GlmDsaGeometry):
        head_dim = g.nope_dim + g.rope_dim
        mla = {
            k: getattr(g, k) for k in ("q_lora", "kv_lora", "rope_dim", "v_dim", "index_heads", "index_dim")
        }
    else:
        head_dim, mla = _head_dim(g), {}
    return SynthGeometry(g.block_count, g.experts, g.experts_used, g.hidden, g.expert_ff, g.heads, g.kv_heads,
                           head_dim, VOCAB, arch=g.arch, dense_lead=g.dense_lead, dense_ff=g.dense_ff,
                           qk_norm=g.qk_norm, **mla)  # fmt: skip


def _glm_specs(g: GlmGeometry) -> list[TensorSpec]:
    """The converters' glm4moe / glm-dsa tensors in bf16: runtime.synth's blocks, the MTP block's NextN ones."""
    sg = _glm_synth(g)
    h = g.hidden
    specs = [
        TensorSpec("output.weight", (VOCAB, h), Q.BF16),
        TensorSpec("token_embd.weight", (VOCAB, h), Q.BF16),
    ]
    for i in range(g.block_count):
        block = glm_block(sg, i, Q.BF16)
        specs += sorted(block + _nextn(f"blk.{i}.", h), key=lambda s: s.name) if i >= g.layers else block
    specs.append(TensorSpec("output_norm.weight", (h,), Q.F32))
    return specs


def _glm_head_keys(g: GlmGeometry, context: int, kv_heads: int) -> dict[str, Any]:
    """The glm4moe / glm-dsa converters' first keys, as far as expert_group_used_count."""
    return {
        "block_count": g.block_count,
        "context_length": context,
        "embedding_length": g.hidden,
        "feed_forward_length": g.dense_ff,
        "attention.head_count": g.heads,
        "attention.head_count_kv": kv_heads,
        "rope.freq_base": 1e6,
        "attention.layer_norm_rms_epsilon": 1e-5,
        "expert_count": g.experts,
        "expert_used_count": g.experts_used,
        "expert_group_count": 1,
        "expert_group_used_count": 1,
    }


def glm4moe_model(g: GlmGeometry) -> tuple[list[KV], list[TensorSpec]]:
    """llama.cpp's glm4moe tensor set (as forge convert and convert_hf_to_gguf.py write it)."""
    hd, ff = _head_dim(g), g.expert_ff
    specs = _glm_specs(g)
    keys = {
        **_glm_head_keys(g, 131072, g.kv_heads),
        "attention.key_length": hd,
        "attention.value_length": hd,
        "general.file_type": 32,
        "rope.dimension_count": hd // 2,
        "expert_feed_forward_length": ff,
        "expert_shared_count": 1,
        "leading_dense_block_count": g.dense_lead,
        "expert_gating_func": 2,
        "expert_weights_scale": 2.5,
        "expert_weights_norm": True,
        **({"nextn_predict_layers": g.mtp} if g.mtp else {}),
        "general.quantization_version": 2,
    }
    return _kvs("glm4moe", g, keys), specs


#: the types llama.cpp's converter gives a published (FP8 + FP4) checkpoint's deepseek4 tensors, by role
_CONVERTED = {"expert": Q.MXFP4, "fp8": Q.Q8_0, "bf16": Q.BF16, "router": Q.BF16, "f32_matrix": Q.F32, "f32": Q.F32,
              "i32": Q.I32}  # fmt: skip


def _converted(role: str, shape: tuple[int, ...]) -> Q:
    return _CONVERTED[role]


def deepseek4_model(g: Deepseek4Geometry) -> tuple[list[KV], list[TensorSpec]]:
    """llama.cpp's deepseek4 tensor set and types (as forge convert and convert_hf_to_gguf.py write it)."""
    h, hd, ff, e, hc = g.hidden, g.attn_head_dim, g.expert_ff, g.experts, HC_STREAMS
    sg = SynthGeometry(g.layers, e, g.experts_used, h, ff, g.heads, g.kv_heads, hd, VOCAB, arch="deepseek4",
                       q_lora=g.q_lora, o_groups=g.o_groups, o_lora=g.o_lora, hash_layers=g.hash_layers,
                       index_heads=g.index_heads, index_dim=g.index_dim)  # fmt: skip
    blocks = [s for i, r in enumerate(g.compress_ratios) for s in deepseek4_block(sg, i, r, _converted)]
    # the converter writes the hash tables, then the routed experts, then the embedding and the rest by layer
    hoisted = [s for kind in ("tid2eid.weight", "_exps.weight") for s in blocks if s.name.endswith(kind)]
    rest = [s for s in blocks if not s.name.endswith(("tid2eid.weight", "_exps.weight"))]
    specs = [*hoisted, TensorSpec("token_embd.weight", (VOCAB, h), Q.BF16), *rest,
             TensorSpec("output_hc_base.weight", (hc,), Q.F32), TensorSpec("output_hc_fn.weight", (hc, hc * h), Q.F32),
             TensorSpec("output_hc_scale.weight", (1,), Q.F32), TensorSpec("output.weight", (VOCAB, h), Q.BF16),
             TensorSpec("output_norm.weight", (h,), Q.F32)]  # fmt: skip
    keys = {
        "block_count": g.layers,
        "context_length": 1048576,
        "embedding_length": h,
        **deepseek4_keys(sg, list(g.compress_ratios), yarn=False, file_type=38),
        "general.quantization_version": 2,
    }
    return _kvs("deepseek4", g, keys), specs


@dataclass(frozen=True)
class GlmDsaGeometry(GlmGeometry):
    """glm-dsa (GLM-5.x): MLA + the DSA indexer; the MLA widths are the real ones (they are row lengths:
    attn_k_b's rows are qk_nope_head_dim long, 192 on GLM-5, not a multiple of 256)."""

    q_lora: int = 2048
    kv_lora: int = 512
    rope_dim: int = 64
    nope_dim: int = 192
    v_dim: int = 256
    index_heads: int = 32
    index_dim: int = 128


GEOMETRIES["glm-5"] = GlmDsaGeometry(
    "glm-5", "glm-dsa", 78, 64, 64, 192, 256, 8, mtp=1, dense_lead=3, dense_ff=512, expert_ff=256,
    source="zai-org/GLM-5 config.json (= GLM-5.1: ffn 12288, expert ffn 2048, MLA q/kv rank 2048/512, rope/nope/v "
           "64/192/256, indexer 32 heads x 128); MTP block exported",
)  # fmt: skip


def glm_dsa_model(g: GlmDsaGeometry) -> tuple[list[KV], list[TensorSpec]]:
    """llama.cpp's glm-dsa tensor set (as forge convert and convert_hf_to_gguf.py write it)."""
    ff, sg = g.expert_ff, _glm_synth(g)
    specs = _glm_specs(g)
    keys = {
        **_glm_head_keys(g, 202752, 1),
        "expert_gating_func": 2,
        "attention.key_length": g.kv_lora + g.rope_dim,
        "attention.value_length": g.kv_lora,
        "general.file_type": 32,
        "leading_dense_block_count": g.dense_lead,
        "vocab_size": VOCAB,
        **mla_keys(sg),
        "expert_feed_forward_length": ff,
        "expert_shared_count": 1,
        "expert_weights_scale": 2.5,
        "expert_weights_norm": True,
        **({"nextn_predict_layers": g.mtp} if g.mtp else {}),
        "rope.dimension_count": g.rope_dim,
        **dsa_indexer_keys(sg),
        "general.quantization_version": 2,
    }
    return _kvs("glm-dsa", g, keys), specs


def model(g: Geometry) -> tuple[list[KV], list[TensorSpec]]:
    if isinstance(g, GlmDsaGeometry):
        return glm_dsa_model(g)
    if isinstance(g, GlmGeometry):
        return glm4moe_model(g)
    if isinstance(g, Deepseek4Geometry):
        return deepseek4_model(g)
    return qwen3moe_model(g) if g.arch == "qwen3moe" else qwen35moe_model(g)


def write_model(g: Geometry, dest: Path, data: str = "sparse", seed: int = 0) -> int:
    """The bf16 GGUF of ``g``; ``data``: 'sparse' (zero holes, no disk) or 'random' (bf16 of N(0, 0.02))."""
    kvs, specs = model(g)
    layout = GGUFLayout(kvs, specs)  # forge's own GGUF layout: header, offsets, alignment
    rng = np.random.default_rng(seed)
    with open(dest, "wb") as f:
        f.write(layout.header)
        if data == "random":
            for spec, off in zip(specs, layout.offsets, strict=True):
                f.seek(layout.data_start + off)
                if spec.ggml_type == Q.F32:
                    f.write(np.ones(spec.shape, np.float32).tobytes())
                else:
                    x = (rng.standard_normal(spec.shape, dtype=np.float32) * 0.02).view(np.uint32)
                    f.write(((x + 0x8000) >> 16).astype(np.uint16).tobytes())
        f.truncate(layout.total_size)
    return layout.total_size


# ------------------------------------------------------------------------------------------ imatrix


def imatrix_for(specs: list[TensorSpec]) -> Imatrix:
    """What llama-imatrix would hold: every quantizable weight but the embeddings and the output (per expert for
    ``_exps``), ones."""
    im = Imatrix(datasets=["type-plan-oracle"], chunk_count=1, chunk_size=512)
    for s in specs:
        if s.name not in ("token_embd.weight", "output.weight") and is_quantizable(
            SrcTensor(s.name, s.shape, s.ggml_type)
        ):
            n_mat = s.shape[0] if len(s.shape) == 3 else 1
            im.sums[s.name] = np.ones((n_mat, s.shape[-1]), np.float32)
            im.counts[s.name] = np.ones(n_mat, np.int64)
    im.check()
    return im


# ------------------------------------------------------------------------------------------ the two sides


def llama_ftype(preset: str) -> int | None:
    """llama.cpp's LLAMA_FTYPE_* of a preset, or None when llama.cpp has no such mix (forge's own presets)."""
    import llama_cpp

    return getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{preset.upper()}", None)


def comparable_presets() -> list[str]:
    return [p for p in available_recipes() if llama_ftype(p) is not None]


def forge_types(path: Path, preset: str, imatrix: Imatrix | None) -> dict[str, str]:
    src = GGUFQuantSource(source_ref(path))
    plan = make_plan(src, load_recipe(preset), imatrix=imatrix, allow_requantize=True)
    return {t.name: t.out_type.name for t in plan}


_LINE = re.compile(r"\[\s*\d+/\s*\d+\]\s+(\S+)\s+- \[[^\]]*\], type =\s*(\w+), size =[^\n(]*(?:\((\w+)\))?")


def parse_dry_run(log: str) -> dict[str, str]:
    """Tensor -> type from llama-quantize's per-tensor log lines (dry run or real run)."""
    out = {}
    for m in _LINE.finditer(log):
        out[m.group(1)] = (m.group(3) or m.group(2)).upper()
    return out


_LOG: list[bytes] = []  # llama.cpp's log text of the current call
_LOG_CB = None


def llama_types(path: Path, preset: str, imatrix: Imatrix | None, real: bool = False) -> dict[str, str]:
    """llama.cpp's types, in process (llama-cpp-python's llama_model_quantize)."""
    import llama_cpp

    global _LOG_CB
    if _LOG_CB is None:
        _LOG_CB = llama_cpp.llama_log_callback(lambda level, text, ud: _LOG.append(text or b""))
        llama_cpp.llama_log_set(_LOG_CB, ctypes.c_void_p())
    _LOG.clear()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_ftype(preset)
    params.nthread = 2
    params.dry_run = not real
    params.allow_requantize = True  # deepseek4 files hold MXFP4 and Q8_0 tensors
    if imatrix is not None:
        params.imatrix = _llama_imatrix(imatrix)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / "out.gguf"
        rc = llama_cpp.llama_model_quantize(str(path).encode(), str(out).encode(), ctypes.byref(params))
        log = b"".join(_LOG).decode(errors="replace")
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize {preset} on {path.name} failed ({rc}):\n{log[-2000:]}")
        if real:
            return gguf_types(out)
    return parse_dry_run(log)


_IMATRIX_ENTRIES: dict[int, tuple] = {}


def _llama_imatrix(imatrix: Imatrix) -> object:
    """The imatrix as llama_model_imatrix_data entries (what llama-quantize loads from a file), made once."""
    import llama_cpp

    if id(imatrix) not in _IMATRIX_ENTRIES:
        _IMATRIX_ENTRIES.clear()
        names = imatrix.names()
        entries = (llama_cpp.llama_model_imatrix_data * (len(names) + 1))()
        values = []
        for k, name in enumerate(names):
            v = np.ascontiguousarray((imatrix.sums[name] / imatrix.counts[name][:, None]).reshape(-1))
            values.append(v)
            entries[k].name = name.encode()
            entries[k].data = v.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            entries[k].size = v.size
        entries[len(names)].name = None
        _IMATRIX_ENTRIES[id(imatrix)] = (imatrix, entries, values)  # the arrays live as long as the entries
    return _IMATRIX_ENTRIES[id(imatrix)][1]


def gguf_types(path: Path) -> dict[str, str]:
    from gguf import GGUFReader

    return {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}


def llama_quantize_binary() -> str | None:
    """The llama-quantize binary FORGE_LLAMA_QUANTIZE names, if it is there."""
    path = os.environ.get("FORGE_LLAMA_QUANTIZE", "")
    return path if path and os.access(path, os.X_OK) else None


def binary_types(binary: str, path: Path, preset: str, imatrix_file: Path | None) -> dict[str, str]:
    """llama.cpp's types from the llama-quantize binary's --dry-run."""
    cmd = [binary, "--dry-run", "--allow-requantize"] + (
        ["--imatrix", str(imatrix_file)] if imatrix_file else []
    )
    cmd += [str(path), str(path.with_suffix(".unused.gguf")), preset.upper(), "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{(r.stdout + r.stderr)[-2000:]}")
    return parse_dry_run(r.stdout + r.stderr)


# ------------------------------------------------------------------------------------------ comparison


def compare(ours: dict[str, str], theirs: dict[str, str]) -> list[tuple[str, str, str]]:
    """(tensor, forge's type, llama.cpp's type) for every tensor where they differ (or one lacks it)."""
    names = sorted(set(ours) | set(theirs))
    return [(n, ours.get(n, "-"), theirs.get(n, "-")) for n in names if ours.get(n) != theirs.get(n)]


def plan_digest(types: dict[str, str]) -> str:
    """A short digest of a whole type plan (sorted ``name=TYPE`` lines), for the recorded oracle."""
    text = "\n".join(f"{n}={t}" for n, t in sorted(types.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class PairResult:
    geometry: str
    preset: str
    imatrix: bool
    oracle: str  # 'llama_cpp' (in process), 'llama-quantize' (the binary), 'recorded' or 'forge only'
    tensors: int
    forge_digest: str  # plan_digest of forge's plan
    llama_digest: str  # plan_digest of llama.cpp's plan ('' with no oracle)
    diffs: list

    @property
    def ok(self) -> bool:
        return not self.diffs


class Oracle:
    """llama.cpp's type plans: in process (``llama_cpp``) or from a ``llama-quantize`` binary."""

    def __init__(self, binary: str | None = None):
        self.binary = binary
        self.name = "llama-quantize" if binary else "llama_cpp"
        self._imatrix_files: dict[int, Path] = {}

    def types(self, path: Path, preset: str, imatrix: Imatrix | None) -> dict[str, str]:
        if not self.binary:
            return llama_types(path, preset, imatrix)
        im_file = None
        if imatrix is not None:
            im_file = self._imatrix_files.get(id(imatrix))
            if im_file is None:
                im_file = path.with_name(path.stem + "-imatrix.gguf")
                write_imatrix(imatrix, im_file)  # forge's writer: llama.cpp's GGUF imatrix format
                self._imatrix_files = {id(imatrix): im_file}
        return binary_types(self.binary, path, preset, im_file)


def run_geometry(gname: str, presets: list[str], workdir: Path, modes: tuple[bool, ...] = (False, True),
                 oracle: Oracle | None = None) -> list[PairResult]:  # fmt: skip
    """Every (preset, with/without imatrix) of one geometry; presets forge refuses without an imatrix (as
    llama-quantize does) are compared with one only."""
    g = GEOMETRIES[gname]
    path = workdir / f"{gname}.gguf"
    write_model(g, path)
    im = imatrix_for(model(g)[1])
    results = []
    try:
        for preset in presets:
            for with_im in modes:
                imx = im if with_im else None
                try:
                    ours = forge_types(path, preset, imx)
                except ForgeError as e:
                    if imx is None and "needs an importance matrix" in str(e):
                        continue
                    raise
                if oracle is None:
                    results.append(PairResult(gname, preset, with_im, "forge only", len(ours), plan_digest(ours),
                                              "", []))  # fmt: skip
                    continue
                theirs = oracle.types(path, preset, imx)
                results.append(PairResult(gname, preset, with_im, oracle.name, len(theirs), plan_digest(ours),
                                          plan_digest(theirs), compare(ours, theirs)))  # fmt: skip
    finally:
        path.unlink()
    return results


def recorded_check(
    gname: str, presets: list[str], workdir: Path, recorded: dict[str, str]
) -> list[PairResult]:
    """forge's plans against recorded digests of llama.cpp's (``--record``; no llama.cpp needed)."""
    results = []
    for r in run_geometry(gname, presets, workdir):
        want = recorded.get(record_key(gname, r.preset, r.imatrix), "not recorded")
        diffs = [] if want == r.forge_digest else [("(plan digest)", r.forge_digest, want)]
        results.append(
            PairResult(gname, r.preset, r.imatrix, "recorded", r.tensors, r.forge_digest, want, diffs)
        )
    return results


def record_key(geometry: str, preset: str, imatrix: bool) -> str:
    return f"{geometry} {preset} {'imatrix' if imatrix else 'plain'}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--geometry", action="append", choices=list(GEOMETRIES), help="default: all")
    ap.add_argument("--preset", action="append", help="default: every forge preset llama.cpp has")
    ap.add_argument("--imatrix", choices=("both", "with", "without"), default="both")
    ap.add_argument(
        "--llama-quantize",
        default=llama_quantize_binary(),
        help="use this llama-quantize binary (default: $FORGE_LLAMA_QUANTIZE) instead of llama_cpp",
    )
    ap.add_argument("--record", type=Path, help="also write llama.cpp's plan digests to this JSON file")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--show-diff", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    geometries = args.geometry or list(GEOMETRIES)
    presets = args.preset or comparable_presets()
    modes = {"both": (False, True), "with": (True,), "without": (False,)}[args.imatrix]
    oracle = Oracle(args.llama_quantize)
    t0 = time.time()
    results = []
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for g in geometries:
            results += run_geometry(g, presets, Path(tmp), modes, oracle)
    if args.record:
        from importlib.metadata import version

        args.record.write_text(json.dumps({
            "oracle": f"llama.cpp of llama-cpp-python {version('llama-cpp-python')} ({oracle.name})",
            "made_by": "python benchmarks/type_plan_oracle.py --record " + str(args.record),
            "digest": "sha256 of the sorted 'name=TYPE' lines of llama.cpp's plan, first 16 hex digits",
            "geometries": {g: asdict(GEOMETRIES[g]) for g in geometries},
            "plans": {record_key(r.geometry, r.preset, r.imatrix): r.llama_digest for r in results},
        }, indent=1) + "\n")  # fmt: skip
    if args.json:
        print(json.dumps({"geometries": [asdict(GEOMETRIES[g]) for g in geometries],
                          "results": [{**r.__dict__, "ok": r.ok} for r in results],
                          "seconds": round(time.time() - t0, 1)}, indent=1))  # fmt: skip
        return 0 if all(r.ok for r in results) else 1
    print(table(results, geometries, presets))
    bad = [r for r in results if not r.ok]
    print(f"{len(results) - len(bad)}/{len(results)} (geometry, preset, imatrix) runs identical "
          f"({len({(r.geometry, r.preset) for r in results})} (geometry, preset) pairs, oracle {oracle.name}), "
          f"{time.time() - t0:.0f} s")  # fmt: skip
    if args.show_diff:
        for r in bad:
            print(f"\n{r.geometry} {r.preset} {'with' if r.imatrix else 'without'} imatrix:")
            for n, ours, theirs in r.diffs:
                print(f"  {n:<40} forge {ours:<8} llama.cpp {theirs}")
    return 0 if not bad else 1


def table(results: list[PairResult], geometries: list[str], presets: list[str]) -> str:
    """Markdown: a row per preset, a column per geometry; cells 'plain/imatrix' ok or the number of diffs."""
    lines = ["| preset | " + " | ".join(geometries) + " |", "|---" * (len(geometries) + 1) + "|"]
    for preset in presets:
        cells = []
        for g in geometries:
            rs = [r for r in results if r.geometry == g and r.preset == preset]
            marks = {r.imatrix: "ok" if r.ok else f"{len(r.diffs)} diff" for r in rs}
            cells.append(" / ".join(marks.get(m, "-") for m in (False, True)))
        lines.append(f"| {preset} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
