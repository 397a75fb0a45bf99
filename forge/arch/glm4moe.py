"""GLM-4.5 / 4.6 / 4.7 MoE (HF ``glm4_moe``) -> GGUF ``glm4moe``.

Leading dense layers (``first_k_dense_replace``), then layers of routed experts with a sigmoid router, its
selection bias (``e_score_correction_bias`` -> ``exp_probs_b.bias``) and an unscaled shared expert;
attention with optional q/k biases and q/k RMSNorm, partial NEOX RoPE. The NextN/MTP block is the decoder
layer ``num_hidden_layers`` of the published checkpoint, written as llama.cpp's ``blk.N`` with its
``nextn.*`` tensors (left out with ``--no-mtp``). Tensors keep their values (no transforms).
"""

from __future__ import annotations

from typing import ClassVar

from forge.arch.base import GLOBAL_TENSORS, LAYER_RE, Architecture, OutTensor
from forge.checkpoint import HFTensor
from forge.gguf_file import KV, T

#: HF per-layer name -> (GGUF name, kept in F32 whatever the output type)
LAYER_TENSORS = {
    "input_layernorm.weight": ("attn_norm.weight", True),
    "post_attention_layernorm.weight": ("post_attention_norm.weight", True),
    "self_attn.q_proj.weight": ("attn_q.weight", False),
    "self_attn.k_proj.weight": ("attn_k.weight", False),
    "self_attn.v_proj.weight": ("attn_v.weight", False),
    "self_attn.q_proj.bias": ("attn_q.bias", True),
    "self_attn.k_proj.bias": ("attn_k.bias", True),
    "self_attn.v_proj.bias": ("attn_v.bias", True),
    "self_attn.o_proj.weight": ("attn_output.weight", False),
    "self_attn.q_norm.weight": ("attn_q_norm.weight", True),
    "self_attn.k_norm.weight": ("attn_k_norm.weight", True),
    "mlp.gate_proj.weight": ("ffn_gate.weight", False),
    "mlp.up_proj.weight": ("ffn_up.weight", False),
    "mlp.down_proj.weight": ("ffn_down.weight", False),
    "mlp.gate.weight": ("ffn_gate_inp.weight", True),
    "mlp.gate.e_score_correction_bias": ("exp_probs_b.bias", True),
    "mlp.shared_experts.gate_proj.weight": ("ffn_gate_shexp.weight", False),
    "mlp.shared_experts.up_proj.weight": ("ffn_up_shexp.weight", False),
    "mlp.shared_experts.down_proj.weight": ("ffn_down_shexp.weight", False),
    # the NextN/MTP block's own tensors
    "eh_proj.weight": ("nextn.eh_proj.weight", False),
    "enorm.weight": ("nextn.enorm.weight", True),
    "hnorm.weight": ("nextn.hnorm.weight", True),
    "embed_tokens.weight": ("nextn.embed_tokens.weight", False),
    "shared_head.head.weight": ("nextn.shared_head_head.weight", False),
    "shared_head.norm.weight": ("nextn.shared_head_norm.weight", True),
}
SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


class Glm4Moe(Architecture):
    hf_model_types = ("glm4_moe",)
    gguf_arch = "glm4moe"
    #: GLM's split regex is llama-3's; llama.cpp names it glm4 (no BOS, whole-word vocabulary hits first)
    pre_tokenizer_names: ClassVar[dict[str, str]] = {"llama-bpe": "glm4"}
    #: special tokens llama.cpp's GLM vocabulary code sets (when the tokenizer files did not)
    special_tokens: ClassVar[tuple[tuple[str, str], ...]] = (
        ("bos", "[gMASK]"), ("eot", "<|user|>"), ("unknown", "<|endoftext|>"), ("eom", "<|observation|>"),
    )  # fmt: skip

    @property
    def n_experts(self) -> int:
        return int(self.hp("n_routed_experts"))

    @property
    def n_nextn(self) -> int:
        return int(self.hp("num_nextn_predict_layers", default=0)) if self.mtp else 0

    def strip(self, name: str) -> str | None:
        stripped = super().strip(name)
        m = LAYER_RE.match(stripped or "")
        if m and not self.mtp and int(m["layer"]) >= self.n_layers:
            return None  # --no-mtp: the NextN block is left out
        return stripped

    def model_kvs(self, file_type: int) -> list[KV]:
        """llama.cpp's converter order: TextModel's KVs, then Glm4MoeModel's (a re-set key keeps its place)."""
        n_head = int(self.hp("num_attention_heads"))
        opt = {k: self.hp(k, default=None) for k in ("rope_theta", "n_group", "topk_group", "head_dim")}
        kvs = [
            self.kv("block_count", self.n_layers + self.n_nextn),
            self.kv("context_length", int(self.hp("max_position_embeddings"))),
            self.kv("embedding_length", int(self.hp("hidden_size"))),
            self.kv("feed_forward_length", int(self.hp("intermediate_size"))),
            self.kv("attention.head_count", n_head),
            self.kv("attention.head_count_kv", int(self.hp("num_key_value_heads", default=n_head))),
        ]
        if opt["rope_theta"] is not None:
            kvs.append(self.kv("rope.freq_base", float(opt["rope_theta"]), T.FLOAT32))
        kvs += [
            self.kv("attention.layer_norm_rms_epsilon", float(self.hp("rms_norm_eps")), T.FLOAT32),
            self.kv("expert_count", self.n_experts),
            self.kv("expert_used_count", int(self.hp("num_experts_per_tok"))),
        ]
        if opt["n_group"] is not None:
            kvs.append(self.kv("expert_group_count", int(opt["n_group"])))
        if opt["topk_group"] is not None:
            kvs.append(self.kv("expert_group_used_count", int(opt["topk_group"])))
        gating_early = self.hp("scoring_func", "score_function", default=None) is not None
        if gating_early:
            kvs.append(self.kv("expert_gating_func", SIGMOID))
        if opt["head_dim"] is not None:
            kvs += [self.kv("attention.key_length", int(opt["head_dim"])),
                    self.kv("attention.value_length", int(opt["head_dim"]))]  # fmt: skip
        kvs += [
            KV("general.file_type", file_type, T.UINT32),
            self.kv(
                "rope.dimension_count",
                int(self.head_dim * float(self.hp("partial_rotary_factor", default=0.5))),
            ),
            self.kv("expert_feed_forward_length", int(self.hp("moe_intermediate_size"))),
        ]
        if (shared := self.hp("n_shared_experts", default=None)) is not None:
            kvs.append(self.kv("expert_shared_count", int(shared)))
        if (dense := self.hp("first_k_dense_replace", default=None)) is not None:
            kvs.append(self.kv("leading_dense_block_count", int(dense)))
        if not gating_early:
            kvs.append(self.kv("expert_gating_func", SIGMOID))
        if (scale := self.hp("routed_scaling_factor", default=None)) is not None:
            kvs.append(self.kv("expert_weights_scale", float(scale), T.FLOAT32))
        if (norm := self.hp("norm_topk_prob", default=None)) is not None:
            kvs.append(self.kv("expert_weights_norm", bool(norm), T.BOOL))
        if self.mtp and self.hp("num_nextn_predict_layers", default=None) is not None:
            kvs.append(self.kv("nextn_predict_layers", self.n_nextn))
        return kvs

    def map_tensor(self, name: str, t: HFTensor) -> list[OutTensor] | None:
        return self.tabled(name, t, LAYER_TENSORS, GLOBAL_TENSORS)
