"""DeepSeek V4 (HF ``deepseek_v4``, published layout) -> GGUF ``deepseek4``, as llama.cpp's converter writes it.

The checkpoint is read in the layout deepseek-ai publishes (``embed``, ``layers.N.attn.wq_a``,
``layers.N.ffn.experts.E.w1`` ..., config keys ``num_hash_layers``, ``compress_ratios``). Output types follow
the source, never ``--outtype``:

- routed experts, packed FP4 E2M1 with one E8M0 scale per 32 columns, are repacked into GGUF ``MXFP4``
  blocks (bits moved, nothing re-quantized): one stacked tensor per layer and projection, in the order
  gate (w1), down (w2), up (w3);
- FP8 E4M3 weights with 128x128 block scales (E8M0 or F32 ``.scale``) are dequantized and written as Q8_0;
- BF16 matrices stay BF16, F32 tensors F32, vectors and norms F32; the hash-routing tables ``tid2eid``
  (I64) are written as I32, first of all tensors;
- hash-routed layers' ``ffn.gate.bias`` is unused and left out; the MTP block (``mtp.*``) is not part of
  the model file, with or without ``--no-mtp``: ``--mtp-only`` writes it alone, a draft model (llama.cpp's
  ``--mtp``): the block as layer n_layers, its e_proj / h_proj side by side as ``nextn.eh_proj`` (Q8_0), its
  hc_head as the root's, with the embeddings, final norm and head;
- ``general.file_type`` is MOSTLY_MXFP4_MOE;
- ``tokenizer.chat_template`` comes right after ``general.architecture``: the model's own template, else
  llama.cpp's bundled DeepSeek V4 one (``forge/arch/templates``, the Flash-0731 one for a folder named so).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from importlib import resources

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import LlamaFileType

from forge.arch.base import LAYER_RE, Architecture, OutTensor, SourceArray, raw
from forge.checkpoint import HFTensor
from forge.errors import ForgeError
from forge.gguf_file import KV, T

ROOT_TENSORS = {
    "embed.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "head.weight": "output.weight",
    "hc_head_fn": "output_hc_fn.weight",
    "hc_head_base": "output_hc_base.weight",
    "hc_head_scale": "output_hc_scale.weight",
}
LAYER_TENSORS = {
    **{f"hc_{s}_{p}": f"hc_{s}_{p}.weight" for s in ("attn", "ffn") for p in ("fn", "base", "scale")},
    "attn.attn_sink": "attn_sinks.weight",
    "attn.wq_a.weight": "attn_q_a.weight",
    "attn.wq_b.weight": "attn_q_b.weight",
    "attn.q_norm.weight": "attn_q_a_norm.weight",
    "attn.wkv.weight": "attn_kv.weight",
    "attn.kv_norm.weight": "attn_kv_a_norm.weight",
    "attn.wo_a.weight": "attn_output_a.weight",
    "attn.wo_b.weight": "attn_output_b.weight",
    "attn.compressor.ape": "attn_compressor_ape.weight",
    "attn.compressor.wkv.weight": "attn_compressor_kv.weight",
    "attn.compressor.wgate.weight": "attn_compressor_gate.weight",
    "attn.compressor.norm.weight": "attn_compressor_norm.weight",
    "attn.indexer.wq_b.weight": "indexer.attn_q_b.weight",
    "attn.indexer.weights_proj.weight": "indexer.proj.weight",
    "attn.indexer.compressor.ape": "indexer_compressor_ape.weight",
    "attn.indexer.compressor.wkv.weight": "indexer_compressor_kv.weight",
    "attn.indexer.compressor.wgate.weight": "indexer_compressor_gate.weight",
    "attn.indexer.compressor.norm.weight": "indexer_compressor_norm.weight",
    "attn_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "ffn.gate.weight": "ffn_gate_inp.weight",
    "ffn.gate.bias": "exp_probs_b.bias",
    "ffn.gate.bias_vl": "exp_probs_b_vl.bias",
    "ffn.shared_experts.w1.weight": "ffn_gate_shexp.weight",
    "ffn.shared_experts.w2.weight": "ffn_down_shexp.weight",
    "ffn.shared_experts.w3.weight": "ffn_up_shexp.weight",
    "nextn.enorm.weight": "nextn.enorm.weight",
    "nextn.hnorm.weight": "nextn.hnorm.weight",
    "nextn.shared_head_norm.weight": "nextn.shared_head_norm.weight",
}
#: kept in F32 when the source is F16 (llama.cpp's converter list); BF16/F32 sources keep their type
F32_WHEN_F16 = ("ffn_gate_inp.weight", "indexer.proj.weight")
#: llama.cpp's order of the expert projections: gate, down, up
EXPERT_PROJECTIONS = (("w1", "gate"), ("w2", "down"), ("w3", "up"))
_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.(weight|scale)$")
_GATING = {"softmax": 1, "sigmoid": 2, "sqrtsoftplus": 4}


def mxfp4_blocks(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Packed E2M1 (uint8 [rows, cols/2], element 2i in the low nibble) + E8M0 scales (uint8 [rows, cols/32])
    -> GGUF MXFP4 rows (uint8 [rows, cols/32 * 17]): per 32 values the scale byte, then 16 bytes holding
    value j in the low nibble and value j + 16 in the high one. Both index the same E2M1 code table."""
    rows = packed.shape[0]
    n_blocks = packed.shape[1] * 2 // 32
    if scale.shape != (rows, n_blocks):
        raise ForgeError(f"FP4 scale shape {scale.shape} does not match {(rows, n_blocks)}")
    src = packed.reshape(rows, n_blocks, 16)
    codes = np.stack((src & 0x0F, src >> 4), axis=-1).reshape(rows, n_blocks, 32)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return np.concatenate((scale.reshape(rows, n_blocks, 1), qs), axis=-1).reshape(rows, n_blocks * 17)


def fp8_dequantized(weight: HFTensor, scale: HFTensor) -> np.ndarray:
    """An FP8 weight times its 128x128 block scales (E8M0 or float), float32 (llama.cpp's dequantization)."""
    rows, cols = weight.shape
    s = scale.float32()
    if s.shape != (-(-rows // 128), -(-cols // 128)):
        raise ForgeError(f"{scale.name}: shape {s.shape} is not the 128x128 block grid of {weight.shape}")
    full = np.repeat(np.repeat(s, 128, axis=0)[:rows], 128, axis=1)[:, :cols]
    return weight.float32() * full


class Deepseek4(Architecture):
    hf_model_types = ("deepseek_v4",)
    gguf_arch = "deepseek4"
    prefixes = ()
    exports_mtp_alone = True

    @property
    def n_experts(self) -> int:
        return int(self.hp("n_routed_experts"))

    def bundled_chat_template(self) -> str | None:
        # llama.cpp's own DeepSeek V4 templates (the published checkpoints ship none): the Flash-0731 one for a
        # folder named so, as llama.cpp picks it
        name = "deepseek-ai-DeepSeek-V4-Flash-0731.jinja" if "0731" in self.ckpt.path.resolve().name else (
            "deepseek-ai-DeepSeek-V4.jinja")  # fmt: skip
        return (resources.files("forge") / "arch" / "templates" / name).read_text(encoding="utf-8")

    @property
    def n_hash(self) -> int:
        return int(self.hp("num_hash_layers", default=0))

    @property
    def n_nextn(self) -> int:
        return int(self.hp("num_nextn_predict_layers", default=0))

    @property
    def block_count(self) -> int:
        return self.n_layers + (self.n_nextn if self.mtp_only else 0)

    def strip(self, name: str) -> str | None:
        if name.startswith(("aligner.", "image_", "vision.")):
            return None
        if self.mtp_only:
            return self._mtp_name(name)
        if name.startswith("mtp."):
            return None  # llama.cpp's converter leaves the MTP block out of the model (--mtp-only writes it alone)
        return name

    def _mtp_name(self, name: str) -> str | None:
        """The draft model's names: the MTP block j as layer n_layers + j (its own hc_head at the root, e_proj /
        h_proj / enorm / hnorm / norm under nextn.), plus the embeddings, final norm and head."""
        if not name.startswith("mtp."):
            return name if name in ("embed.weight", "norm.weight", "head.weight", "head.scale") else None
        parts = name.split(".", 2)
        if len(parts) < 3 or not parts[1].isdecimal() or int(parts[1]) >= self.n_nextn:
            raise ForgeError(f"{self.ckpt.path}: unexpected MTP tensor {name} (num_nextn_predict_layers "
                             f"{self.n_nextn})")  # fmt: skip
        bid, rest = self.n_layers + int(parts[1]), parts[2]
        if rest in ("hc_head_fn", "hc_head_base", "hc_head_scale"):
            return rest
        if rest.startswith(("e_proj.", "h_proj.", "enorm.", "hnorm.")):
            return f"layers.{bid}.nextn.{rest}"
        if rest == "norm.weight":
            return f"layers.{bid}.nextn.shared_head_norm.weight"
        return f"layers.{bid}.{rest}"

    def model_kvs(self, file_type: int) -> list[KV]:
        del file_type  # always MXFP4_MOE: the routed experts are MXFP4 whatever the output type
        n = self.block_count
        limit = float(self.hp("swiglu_limit"))
        scoring = self.hp("scoring_func", default=None)
        if scoring is not None and scoring not in _GATING:
            raise ForgeError(f"{self.ckpt.path}/config.json: unsupported scoring_func {scoring!r}")
        kvs = [
            self.kv("block_count", n),
            self.kv("context_length", int(self.hp("max_position_embeddings"))),
            self.kv("embedding_length", int(self.hp("hidden_size"))),
            self.kv("attention.head_count", int(self.hp("num_attention_heads"))),
            self.kv("attention.head_count_kv", int(self.hp("num_key_value_heads"))),
            *self._rope_scaling_kvs(),
            self.kv("rope.freq_base", float(self.hp("rope_theta")), T.FLOAT32),
            self.kv("attention.layer_norm_rms_epsilon", float(self.hp("rms_norm_eps")), T.FLOAT32),
            self.kv("expert_count", self.n_experts),
            self.kv("expert_used_count", int(self.hp("num_experts_per_tok"))),
            *([self.kv("expert_gating_func", _GATING[scoring])] if scoring else []),
            self.kv("attention.key_length", int(self.hp("head_dim"))),
            self.kv("attention.value_length", int(self.hp("head_dim"))),
            KV("general.file_type", int(LlamaFileType.MOSTLY_MXFP4_MOE), T.UINT32),
            self.kv("rope.dimension_count", int(self.hp("qk_rope_head_dim"))),
            self.kv("attention.q_lora_rank", int(self.hp("q_lora_rank"))),
            self.kv("attention.sliding_window", int(self.hp("sliding_window"))),
            self.kv("expert_feed_forward_length", int(self.hp("moe_intermediate_size"))),
            self.kv("expert_shared_count", int(self.hp("n_shared_experts"))),
            self.kv("expert_weights_scale", float(self.hp("routed_scaling_factor")), T.FLOAT32),
            self.kv("expert_weights_norm", bool(self.hp("norm_topk_prob")), T.BOOL),
            KV(f"{self.gguf_arch}.swiglu_clamp_exp", [limit] * n, T.ARRAY, T.FLOAT32),
            KV(f"{self.gguf_arch}.swiglu_clamp_shexp", [limit] * n, T.ARRAY, T.FLOAT32),
            self.kv("attention.indexer.head_count", int(self.hp("index_n_heads"))),
            self.kv("attention.indexer.key_length", int(self.hp("index_head_dim"))),
            self.kv("attention.indexer.top_k", int(self.hp("index_topk"))),
            self.kv("attention.output_group_count", int(self.hp("o_groups"))),
            self.kv("attention.output_lora_rank", int(self.hp("o_lora_rank"))),
            KV(
                f"{self.gguf_arch}.attention.compress_ratios",
                [int(r) for r in self.hp("compress_ratios")],
                T.ARRAY,
                T.INT32,
            ),  # fmt: skip
            self.kv("attention.compress_rope_freq_base", float(self.hp("compress_rope_theta")), T.FLOAT32),
            self.kv("hyper_connection.count", int(self.hp("hc_mult"))),
            self.kv("hyper_connection.sinkhorn_iterations", int(self.hp("hc_sinkhorn_iters"))),
            self.kv("hyper_connection.epsilon", float(self.hp("hc_eps")), T.FLOAT32),
            self.kv("hash_layer_count", self.n_hash),
            self.kv("embedding_length_out", int(self.hp("hidden_size")) * int(self.hp("hc_mult"))),
        ]
        if self.mtp_only and self.n_nextn:
            kvs.append(self.kv("nextn_predict_layers", self.n_nextn))
        return kvs

    def _rope_scaling_kvs(self) -> list[KV]:
        rope = self.cfg.get("rope_scaling") or {}
        kind = rope.get("rope_type", rope.get("type"))
        if kind not in ("yarn", "linear") or rope.get("factor") is None:
            return []
        out = [self.kv("rope.scaling.type", kind, T.STRING),
               self.kv("rope.scaling.factor", float(rope["factor"]), T.FLOAT32)]  # fmt: skip
        if kind == "yarn":
            out.append(
                self.kv("rope.scaling.original_context_length", int(rope["original_max_position_embeddings"]))
            )
            for key, gkey in (("extrapolation_factor", "yarn_ext_factor"), ("attention_factor", "yarn_attn_factor"),
                              ("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):  # fmt: skip
                value = rope.get(key, rope.get("attn_factor") if key == "attention_factor" else None)
                if value is not None:
                    out.append(self.kv(f"rope.scaling.{gkey}", float(value), T.FLOAT32))
        return out

    # -- tensors
    def plan(self) -> list[OutTensor]:
        """llama.cpp's order: the hash-routing tables, the routed experts layer by layer, then the rest as
        the checkpoint lists it."""
        tensors = {n: t for t in self.ckpt if (n := self.strip(t.name)) is not None}
        if self.mtp_only and not any(n.startswith(f"layers.{self.n_layers}.") for n in tensors):
            raise ForgeError(f"{self.ckpt.path}: --mtp-only: the checkpoint has no MTP block (mtp.*)")
        first = self.n_layers if self.mtp_only else 0
        out = [] if self.mtp_only else [self._tid2eid(i, tensors) for i in range(self.n_hash)]
        for layer in range(first, self.block_count):
            out += [self._experts(layer, w, proj, tensors) for w, proj in EXPERT_PROJECTIONS]
        out += [self._eh_proj(layer, tensors) for layer in range(first, self.block_count) if self.mtp_only]
        for name, t in tensors.items():
            if ".nextn.e_proj." in name or ".nextn.h_proj." in name:
                continue
            if _EXPERT.match(name) or name.endswith(".ffn.gate.tid2eid") or name.endswith(".scale"):
                continue
            m = LAYER_RE.match(name)
            if m and int(m["layer"]) < self.n_hash and m["rest"] == "ffn.gate.bias":
                continue  # hash-routed layers route by tid2eid; their bias is unused
            mapped = self._map(name, t, tensors)
            if mapped is None:
                raise ForgeError(f"{self.ckpt.path}: cannot map tensor {t.name} to GGUF ({self.gguf_arch})")
            out.append(mapped)
        return out

    def _map(self, name: str, t: HFTensor, tensors: dict[str, HFTensor]) -> OutTensor | None:
        if name in ROOT_TENSORS:
            gname = ROOT_TENSORS[name]
        else:
            m = LAYER_RE.match(name)
            if not m or m["rest"] not in LAYER_TENSORS or int(m["layer"]) >= self.block_count:
                return None
            gname = f"blk.{m['layer']}.{LAYER_TENSORS[m['rest']]}"
        scale = tensors.get(name.removesuffix(".weight") + ".scale") if name.endswith(".weight") else None
        if t.dtype in ("F8_E4M3", "F8_E5M2"):
            if scale is None:
                raise ForgeError(f"{self.ckpt.path}: FP8 tensor {t.name} has no .scale")
            return _encoded(gname, t.shape, lambda: _q8_0(fp8_dequantized(t, scale)), Q.Q8_0, (t, scale))
        if t.dtype == "F32" or len(t.shape) <= 1 or gname.endswith("_norm.weight"):
            return OutTensor(gname, t.shape, lambda: raw(t), (t,), verbatim=t.dtype == "F32", gguf_type=Q.F32)
        if t.dtype == "BF16":
            return OutTensor(gname, t.shape, lambda: raw(t), (t,), verbatim=True, gguf_type=Q.BF16)
        return OutTensor(gname, t.shape, lambda: raw(t), (t,), force_f32=gname.endswith(F32_WHEN_F16))

    def _eh_proj(self, layer: int, tensors: dict[str, HFTensor]) -> OutTensor:
        """The draft's input projection: e_proj and h_proj side by side ([hidden, 2 x hidden]), always Q8_0."""
        pairs = []
        for part in ("e_proj", "h_proj"):
            t = tensors.get(f"layers.{layer}.nextn.{part}.weight")
            if t is None:
                raise ForgeError(f"{self.ckpt.path}: the MTP block has no {part}.weight")
            pairs.append((t, tensors.get(f"layers.{layer}.nextn.{part}.scale")))

        def values(t: HFTensor, scale: HFTensor | None) -> np.ndarray:
            if t.dtype in ("F8_E4M3", "F8_E5M2"):
                if scale is None:
                    raise ForgeError(f"{self.ckpt.path}: FP8 tensor {t.name} has no .scale")
                return fp8_dequantized(t, scale)
            return t.float32()

        (e, _), (h, _) = pairs
        shape = (e.shape[0], e.shape[1] + h.shape[1])
        sources = tuple(x for pair in pairs for x in pair if x is not None)
        return _encoded(f"blk.{layer}.nextn.eh_proj.weight", shape,
                        lambda: _q8_0(np.concatenate([values(*p) for p in pairs], axis=1)), Q.Q8_0, sources)  # fmt: skip

    def _tid2eid(self, layer: int, tensors: dict[str, HFTensor]) -> OutTensor:
        t = tensors.get(f"layers.{layer}.ffn.gate.tid2eid")
        if t is None:
            raise ForgeError(f"{self.ckpt.path}: hash-routed layer {layer} has no ffn.gate.tid2eid table")
        return OutTensor(f"blk.{layer}.ffn_gate_tid2eid.weight", t.shape, lambda: raw(t), (t,), gguf_type=Q.I32,
                         encoded=lambda: np.ascontiguousarray(t.raw(), dtype=np.int32))  # fmt: skip

    def _experts(self, layer: int, w: str, proj: str, tensors: dict[str, HFTensor]) -> OutTensor:
        pairs = []
        for e in range(self.n_experts):
            base = f"layers.{layer}.ffn.experts.{e}.{w}"
            weight, scale = tensors.get(base + ".weight"), tensors.get(base + ".scale")
            if weight is None or scale is None:
                raise ForgeError(f"{self.ckpt.path}: routed expert tensor {base}.weight or .scale is missing")
            if weight.dtype not in ("I8", "U8") or scale.dtype not in ("F8_E8M0", "U8"):
                raise ForgeError(
                    f"{self.ckpt.path}: {base}: routed experts must be packed FP4 (I8) with E8M0 scales, "
                    f"found {weight.dtype} / {scale.dtype}"
                )
            pairs.append((weight, scale))
        rows, half = pairs[0][0].shape
        sources = tuple(x for p in pairs for x in p)

        def encoded() -> np.ndarray:
            return np.stack(
                [mxfp4_blocks(wt.raw().view(np.uint8), sc.raw().view(np.uint8)) for wt, sc in pairs]
            )

        return _encoded(f"blk.{layer}.ffn_{proj}_exps.weight", (self.n_experts, rows, half * 2), encoded, Q.MXFP4,
                        sources)  # fmt: skip


def _encoded(
    name: str,
    shape: tuple[int, ...],
    encoded: Callable[[], np.ndarray],
    qtype: Q,
    sources: tuple[HFTensor, ...],
) -> OutTensor:
    """A tensor llama.cpp's converter writes encoded; its values are what llama-quantize decodes from it."""

    def produce() -> SourceArray:
        from forge.quant.types import get_type

        qt = get_type(qtype)
        data = encoded()
        values = qt.decode(data, data.shape[-1] // qt.type_size * qt.block_size)
        return SourceArray(np.ascontiguousarray(values, dtype=np.float32).reshape(shape), "F32")

    return OutTensor(name, shape, produce, sources, gguf_type=qtype, encoded=encoded)


def _q8_0(values: np.ndarray) -> np.ndarray:
    from forge.quant.types import get_type

    return get_type(Q.Q8_0).encode(values)
