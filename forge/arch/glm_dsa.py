"""GLM-5.x (HF ``glm_moe_dsa``, ``GlmMoeDsaForCausalLM``) -> GGUF ``glm-dsa``.

DeepSeek-V3.2-style attention: MLA (q and kv low-rank projections with RMSNorms, one shared rope key) with
the DSA lightning indexer (``indexer_types``: layers that run their own indexer, the others reuse the
previous one's selection), then GLM-4.5's MoE (dense lead layers, sigmoid router with selection bias, shared
expert) and the NextN/MTP block, as llama.cpp's converter (``GlmMoeDsaModel`` on ``DeepseekV2Model``)
writes them: ``kv_b_proj`` split per head into ``attn_k_b`` (transposed) and ``attn_v_b``, the KV head
count written as 1 (MLA's one latent head), the indexer's head weights kept in F32.
"""

from __future__ import annotations

import numpy as np

from forge.arch.base import GLOBAL_TENSORS, LAYER_RE, OutTensor, transformed
from forge.arch.glm4moe import LAYER_TENSORS, SIGMOID, Glm4Moe
from forge.checkpoint import HFTensor
from forge.gguf_file import KV, T

DSA_LAYER_TENSORS = {
    **{k: v for k, v in LAYER_TENSORS.items() if not k.startswith("self_attn.")},
    "post_attention_layernorm.weight": ("ffn_norm.weight", True),
    "self_attn.q_a_proj.weight": ("attn_q_a.weight", False),
    "self_attn.q_a_layernorm.weight": ("attn_q_a_norm.weight", True),
    "self_attn.q_b_proj.weight": ("attn_q_b.weight", False),
    "self_attn.kv_a_proj_with_mqa.weight": ("attn_kv_a_mqa.weight", False),
    "self_attn.kv_a_layernorm.weight": ("attn_kv_a_norm.weight", True),
    "self_attn.o_proj.weight": ("attn_output.weight", False),
    "self_attn.indexer.wq_b.weight": ("indexer.attn_q_b.weight", False),
    "self_attn.indexer.wk.weight": ("indexer.attn_k.weight", False),
    "self_attn.indexer.k_norm.weight": ("indexer.k_norm.weight", True),
    "self_attn.indexer.k_norm.bias": ("indexer.k_norm.bias", True),
    "self_attn.indexer.weights_proj.weight": ("indexer.proj.weight", True),
}


class GlmDsa(Glm4Moe):
    hf_model_types = ("glm_moe_dsa",)
    gguf_arch = "glm-dsa"

    def _mla(self) -> tuple[int, int, int, int]:
        """(kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim)"""
        keys = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
        return tuple(int(self.hp(k)) for k in keys)  # type: ignore[return-value]

    def model_kvs(self, file_type: int) -> list[KV]:
        """TextModel's KVs, then DeepseekV2Model's, then GlmMoeDsaModel's (a re-set key keeps its place).

        llama.cpp reads config.json through transformers' config class, whose defaults (head_dim, n_group,
        topk_group, rope_theta) are always present: their keys are always written where TextModel puts them.
        """
        kvl, rope, nope, vd = self._mla()
        kvs = [
            self.kv("block_count", self.n_layers + self.n_nextn),
            self.kv("context_length", int(self.hp("max_position_embeddings"))),
            self.kv("embedding_length", int(self.hp("hidden_size"))),
            self.kv("feed_forward_length", int(self.hp("intermediate_size"))),
            self.kv("attention.head_count", int(self.hp("num_attention_heads"))),
            self.kv("attention.head_count_kv", 1),
            self.kv("rope.freq_base", float(self.hp("rope_theta", default=10000.0)), T.FLOAT32),
            self.kv(
                "attention.layer_norm_rms_epsilon", float(self.hp("rms_norm_eps", default=1e-6)), T.FLOAT32
            ),
            self.kv("expert_count", self.n_experts),
            self.kv("expert_used_count", int(self.hp("num_experts_per_tok"))),
            self.kv("expert_group_count", int(self.hp("n_group", default=1))),
            self.kv("expert_group_used_count", int(self.hp("topk_group", default=1))),
        ]
        if self.hp("scoring_func", "score_function", default=None) is not None:
            kvs.append(self.kv("expert_gating_func", SIGMOID))
        kvs += [
            self.kv("attention.key_length", kvl + rope),
            self.kv("attention.value_length", kvl),
            KV("general.file_type", file_type, T.UINT32),
            self.kv("leading_dense_block_count", int(self.hp("first_k_dense_replace", default=0))),
            self.kv("vocab_size", int(self.hp("vocab_size"))),
        ]
        if self.hp("q_lora_rank", default=None) is not None:
            kvs.append(self.kv("attention.q_lora_rank", int(self.hp("q_lora_rank"))))
        kvs += [
            self.kv("attention.kv_lora_rank", kvl),
            self.kv("attention.key_length_mla", nope + rope),
            self.kv("attention.value_length_mla", vd),
            self.kv("expert_feed_forward_length", int(self.hp("moe_intermediate_size"))),
            self.kv("expert_shared_count", int(self.hp("n_shared_experts", default=0))),
        ]
        if (scale := self.hp("routed_scaling_factor", default=None)) is not None:
            kvs.append(self.kv("expert_weights_scale", float(scale), T.FLOAT32))
        if self.hp("norm_topk_prob", default=False):
            kvs.append(self.kv("expert_weights_norm", True, T.BOOL))
        kvs.append(
            self.kv("rope.dimension_count", int(rope * float(self.hp("partial_rotary_factor", default=1.0))))
        )
        if self.mtp and self.hp("num_nextn_predict_layers", default=None) is not None:
            kvs.append(self.kv("nextn_predict_layers", self.n_nextn))
        kvs += [
            self.kv("attention.indexer.head_count", int(self.hp("index_n_heads"))),
            self.kv("attention.indexer.key_length", int(self.hp("index_head_dim"))),
            self.kv("attention.indexer.top_k", int(self.hp("index_topk"))),
        ]
        if types := self.hp("indexer_types", default=None):
            kvs.append(
                KV(f"{self.gguf_arch}.attention.indexer.types", [t == "full" for t in types], T.ARRAY, T.BOOL)
            )
        return kvs

    def map_tensor(self, name: str, t: HFTensor) -> list[OutTensor] | None:
        m = LAYER_RE.match(name)
        if m and m["rest"] == "self_attn.kv_b_proj.weight":
            return self._kv_b(f"blk.{m['layer']}.", t)
        return self.tabled(name, t, DSA_LAYER_TENSORS, GLOBAL_TENSORS)

    def _kv_b(self, p: str, t: HFTensor) -> list[OutTensor]:
        """kv_b_proj (heads x (nope + v), kv_lora) -> per head k_b (kv_lora, nope) and v_b (v, kv_lora)."""
        kvl, _, nope, vd = self._mla()
        nh = int(self.hp("num_attention_heads"))

        def heads(a: np.ndarray) -> np.ndarray:
            return a.reshape(nh, nope + vd, kvl)

        return [
            OutTensor(p + "attn_k_b.weight", (nh, kvl, nope),
                      transformed(t, lambda a: heads(a)[:, :nope].transpose(0, 2, 1)), (t,)),
            OutTensor(p + "attn_v_b.weight", (nh, vd, kvl), transformed(t, lambda a: heads(a)[:, nope:]), (t,)),
        ]  # fmt: skip
