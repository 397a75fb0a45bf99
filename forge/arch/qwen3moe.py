"""Qwen3-MoE (HF ``qwen3_moe``) -> GGUF ``qwen3moe``."""

from __future__ import annotations

from forge.arch.base import GLOBAL_TENSORS, LAYER_RE, Architecture, OutTensor
from forge.checkpoint import HFTensor
from forge.gguf_file import KV

#: HF per-layer name -> (GGUF name, kept in F32): attention projections and the router, shared by the Qwen MoEs
PROJECTIONS = {
    "self_attn.q_proj.weight": ("attn_q.weight", False),
    "self_attn.k_proj.weight": ("attn_k.weight", False),
    "self_attn.v_proj.weight": ("attn_v.weight", False),
    "self_attn.o_proj.weight": ("attn_output.weight", False),
    "mlp.gate.weight": ("ffn_gate_inp.weight", True),
}
LAYER_TENSORS = {
    **PROJECTIONS,
    "input_layernorm.weight": ("attn_norm.weight", True),
    "post_attention_layernorm.weight": ("ffn_norm.weight", True),
    "self_attn.q_norm.weight": ("attn_q_norm.weight", True),
    "self_attn.k_norm.weight": ("attn_k_norm.weight", True),
}


class Qwen3Moe(Architecture):
    hf_model_types = ("qwen3_moe",)
    gguf_arch = "qwen3moe"

    def model_kvs(self, file_type: int) -> list[KV]:
        return self.moe_kvs(file_type, self.n_layers, dense_ffn=True)

    def map_tensor(self, name: str, t: HFTensor) -> list[OutTensor] | None:
        m = LAYER_RE.match(name)
        if m and m["rest"] in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            return self.fused_experts(int(m["layer"]), m["rest"], t)
        return self.tabled(name, t, LAYER_TENSORS, GLOBAL_TENSORS)
