"""Qwen3.5/3.6-MoE (HF ``qwen3_5_moe`` / ``qwen3_5_moe_text``) -> GGUF ``qwen35moe``.

Gated DeltaNet (linear attention) layers, gated full-attention layers, routed experts and a
shared expert with a sigmoid gate. The converter's transforms, each checked byte for byte
against llama.cpp's output on the fixture:
- RMSNorm weights are stored zero-centred in HF (the model multiplies by 1 + w): GGUF stores 1 + w
  in F32 (all norms except the DeltaNet output norm ``linear_attn.norm``);
- ``A_log`` becomes ``ssm_a = -exp(A_log)`` (F32);
- value heads are reordered from grouped-by-key-head (k0: v0 v1, k1: v2 v3) to tiled
  (v0 v2 v1 v3) in every tensor indexed by value head: dt_bias, A_log, in_proj_a/b rows, in_proj_z
  rows, the v part of in_proj_qkv and of conv1d, and out_proj columns.
"""

from __future__ import annotations

import numpy as np

from forge.arch.base import LAYER_RE, Architecture, OutTensor, raw, transformed
from forge.arch.qwen3moe import PROJECTIONS
from forge.checkpoint import HFTensor
from forge.errors import ForgeError
from forge.gguf_file import KV, T

PLAIN = {
    **PROJECTIONS,
    "mlp.shared_expert.down_proj.weight": ("ffn_down_shexp.weight", False),
    "mlp.shared_expert.gate_proj.weight": ("ffn_gate_shexp.weight", False),
    "mlp.shared_expert.up_proj.weight": ("ffn_up_shexp.weight", False),
    "mlp.shared_expert_gate.weight": ("ffn_gate_inp_shexp.weight", True),
    "linear_attn.norm.weight": ("ssm_norm.weight", True),
}
NORMS_PLUS_ONE = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
#: the MTP block's own tensors (llama.cpp's NextN names)
MTP_TENSORS = {
    "mtp.fc.weight": ("nextn.eh_proj.weight", False, False),
    "mtp.pre_fc_norm_embedding.weight": ("nextn.enorm.weight", True, True),
    "mtp.pre_fc_norm_hidden.weight": ("nextn.hnorm.weight", True, True),
    "mtp.norm.weight": ("nextn.shared_head_norm.weight", True, True),
}


def _plus_one(a: np.ndarray) -> np.ndarray:
    return a + np.float32(1.0)


def _neg_exp(a: np.ndarray) -> np.ndarray:
    # exp in float64, rounded once to float32: matches torch's float32 exp used by llama.cpp
    return (-np.exp(a.astype(np.float64))).astype(np.float32)


class Qwen35Moe(Architecture):
    hf_model_types = ("qwen3_5_moe", "qwen3_5_moe_text")
    gguf_arch = "qwen35moe"

    @property
    def n_mtp(self) -> int:
        has = any(t.name.startswith("mtp.") for t in self.ckpt)
        return int(self.hp("mtp_num_hidden_layers", default=1)) if (self.mtp and has) else 0

    def full_attention_interval(self) -> int:
        if "full_attention_interval" in self.cfg:
            return int(self.cfg["full_attention_interval"])
        types = self.cfg.get("layer_types")
        if not types or "full_attention" not in types:
            raise ForgeError(f"{self.ckpt.path}/config.json: needs full_attention_interval or layer_types")
        interval = types.index("full_attention") + 1
        expected = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(len(types))
        ]
        if types != expected:
            raise ForgeError(
                f"{self.ckpt.path}/config.json: layer_types is not periodic; GGUF needs an interval"
            )
        return interval

    def model_kvs(self, file_type: int) -> list[KV]:
        rot = float(self.hp("partial_rotary_factor", default=1.0))
        sections = list(self.hp("mrope_section", default=[11, 11, 10]))
        sections += [0] * (4 - len(sections))
        n_v, v_dim = int(self.hp("linear_num_value_heads")), int(self.hp("linear_value_head_dim"))
        kvs = [
            *self.moe_kvs(file_type, self.n_layers + self.n_mtp, dense_ffn=False),
            self.kv("expert_shared_feed_forward_length", int(self.hp("shared_expert_intermediate_size"))),
            self.kv("ssm.conv_kernel", int(self.hp("linear_conv_kernel_dim"))),
            self.kv("ssm.state_size", int(self.hp("linear_key_head_dim"))),
            self.kv("ssm.group_count", int(self.hp("linear_num_key_heads"))),
            self.kv("ssm.time_step_rank", n_v),
            self.kv("ssm.inner_size", n_v * v_dim),
            self.kv("full_attention_interval", self.full_attention_interval()),
            self.kv("rope.dimension_count", int(self.head_dim * rot)),
            KV(f"{self.gguf_arch}.rope.dimension_sections", sections, T.ARRAY, T.INT32),
        ]
        if self.n_mtp:
            kvs.append(self.kv("nextn_predict_layers", self.n_mtp))
        return kvs

    # value-head reordering: grouped (per key head) -> tiled
    def _vperm(self, a: np.ndarray, axis: int, head: int) -> np.ndarray:
        n_k, n_v = int(self.hp("linear_num_key_heads")), int(self.hp("linear_num_value_heads"))
        if n_v == n_k:
            return a
        a = np.moveaxis(a, axis, 0)
        rest = a.shape[1:]
        a = a.reshape(n_k, n_v // n_k, head, *rest).swapaxes(0, 1).reshape(n_v * head, *rest)
        return np.moveaxis(a, 0, axis)

    def _linear_attn(self, layer: int, rest: str, t: HFTensor) -> list[OutTensor] | None:
        vd = int(self.hp("linear_value_head_dim"))
        qk = 2 * int(self.hp("linear_num_key_heads")) * int(self.hp("linear_key_head_dim"))
        b = f"blk.{layer}."

        def out(
            name: str, shape: tuple[int, ...], fn, exact: bool = True, f32: bool = False
        ) -> list[OutTensor]:
            return [OutTensor(b + name, shape, transformed(t, fn, exact), (t,), f32)]

        if rest == "linear_attn.A_log":
            return out("ssm_a", t.shape, lambda a: _neg_exp(self._vperm(a, 0, 1)), False, True)
        if rest == "linear_attn.dt_bias":
            return out("ssm_dt.bias", t.shape, lambda a: self._vperm(a, 0, 1), f32=True)
        if rest == "linear_attn.conv1d.weight":
            shape = (t.shape[0], t.shape[-1])
            return out("ssm_conv1d.weight", shape,
                       lambda a: np.concatenate([a.reshape(shape)[:qk], self._vperm(a.reshape(shape)[qk:], 0, vd)]),
                       f32=True)  # fmt: skip
        if rest == "linear_attn.in_proj_a.weight":
            return out("ssm_alpha.weight", t.shape, lambda a: self._vperm(a, 0, 1))
        if rest == "linear_attn.in_proj_b.weight":
            return out("ssm_beta.weight", t.shape, lambda a: self._vperm(a, 0, 1))
        if rest == "linear_attn.in_proj_z.weight":
            return out("attn_gate.weight", t.shape, lambda a: self._vperm(a, 0, vd))
        if rest == "linear_attn.in_proj_qkv.weight":
            return out(
                "attn_qkv.weight", t.shape, lambda a: np.concatenate([a[:qk], self._vperm(a[qk:], 0, vd)])
            )
        if rest == "linear_attn.out_proj.weight":
            return out("ssm_out.weight", t.shape, lambda a: self._vperm(a, 1, vd))
        return None

    def map_tensor(self, name: str, t: HFTensor) -> list[OutTensor] | None:
        if name == "lm_head.weight":
            return [OutTensor("output.weight", t.shape, lambda: raw(t), (t,), verbatim=True)]
        if name == "embed_tokens.weight":
            return [OutTensor("token_embd.weight", t.shape, lambda: raw(t), (t,), verbatim=True)]
        if name == "norm.weight":
            return [OutTensor("output_norm.weight", t.shape, transformed(t, _plus_one, False), (t,), True)]
        if name in MTP_TENSORS:
            gname, plus_one, f32 = MTP_TENSORS[name]
            produce = transformed(t, _plus_one, False) if plus_one else (lambda: raw(t))
            return [OutTensor(f"blk.{self.n_layers}.{gname}", t.shape, produce, (t,), f32)]
        m = LAYER_RE.match(name)
        if not m:
            return None
        layer, rest = int(m["layer"]), m["rest"]
        if rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            return self.fused_experts(layer, rest, t)
        if rest in NORMS_PLUS_ONE:
            produce = transformed(t, _plus_one, False)
            return [OutTensor(f"blk.{layer}.{NORMS_PLUS_ONE[rest]}", t.shape, produce, (t,), True)]
        if rest in PLAIN:
            gname, f32 = PLAIN[rest]
            return [OutTensor(f"blk.{layer}.{gname}", t.shape, lambda: raw(t), (t,), f32, verbatim=True)]
        return self._linear_attn(layer, rest, t)
