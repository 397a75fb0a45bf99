"""Qwen3-MoE (HF ``qwen3_moe``) -> GGUF ``qwen3moe``."""

from __future__ import annotations

from forge.arch.base import LAYER_RE, Architecture, OutTensor, raw
from forge.checkpoint import HFTensor
from forge.gguf_file import KV, T

#: HF per-layer name -> (GGUF name, kept in F32)
LAYER_TENSORS = {
    "input_layernorm.weight": ("attn_norm.weight", True),
    "post_attention_layernorm.weight": ("ffn_norm.weight", True),
    "self_attn.q_proj.weight": ("attn_q.weight", False),
    "self_attn.k_proj.weight": ("attn_k.weight", False),
    "self_attn.v_proj.weight": ("attn_v.weight", False),
    "self_attn.o_proj.weight": ("attn_output.weight", False),
    "self_attn.q_norm.weight": ("attn_q_norm.weight", True),
    "self_attn.k_norm.weight": ("attn_k_norm.weight", True),
    "mlp.gate.weight": ("ffn_gate_inp.weight", True),
}
GLOBAL_TENSORS = {
    "lm_head.weight": ("output.weight", False),
    "embed_tokens.weight": ("token_embd.weight", False),
    "norm.weight": ("output_norm.weight", True),
}


class Qwen3Moe(Architecture):
    hf_model_types = ("qwen3_moe",)
    gguf_arch = "qwen3moe"

    def model_kvs(self, file_type: int) -> list[KV]:
        n_head = int(self.hp("num_attention_heads"))
        head_dim = int(self.hp("head_dim", default=int(self.hp("hidden_size")) // n_head))
        return [
            self.kv("block_count", self.n_layers),
            self.kv("context_length", int(self.hp("max_position_embeddings"))),
            self.kv("embedding_length", int(self.hp("hidden_size"))),
            self.kv("feed_forward_length", int(self.hp("intermediate_size"))),
            self.kv("attention.head_count", n_head),
            self.kv("attention.head_count_kv", int(self.hp("num_key_value_heads", default=n_head))),
            self.kv("rope.freq_base", float(self.hp("rope_theta", default=10000.0)), T.FLOAT32),
            self.kv("attention.layer_norm_rms_epsilon", float(self.hp("rms_norm_eps")), T.FLOAT32),
            self.kv("expert_count", self.n_experts),
            self.kv("expert_used_count", int(self.hp("num_experts_per_tok"))),
            self.kv("attention.key_length", head_dim),
            self.kv("attention.value_length", head_dim),
            KV("general.file_type", file_type, T.UINT32),  # llama.cpp writes it here
            self.kv("expert_feed_forward_length", int(self.hp("moe_intermediate_size"))),
        ]

    def map_tensor(self, name: str, t: HFTensor) -> list[OutTensor] | None:
        if name in GLOBAL_TENSORS:
            gname, f32 = GLOBAL_TENSORS[name]
            return [OutTensor(gname, t.shape, lambda: raw(t), (t,), f32, verbatim=True)]
        m = LAYER_RE.match(name)
        if not m:
            return None
        layer, rest = int(m["layer"]), m["rest"]
        if rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            return self.fused_experts(layer, rest, t)
        if rest not in LAYER_TENSORS:
            return None
        gname, f32 = LAYER_TENSORS[rest]
        return [OutTensor(f"blk.{layer}.{gname}", t.shape, lambda: raw(t), (t,), f32, verbatim=True)]
