"""Tiny random GLM MoE checkpoints made in code (``Glm4MoeForCausalLM``), in the published layout.

    python tests/glm_fixture.py OUT_DIR [--seed 0] [--no-qk-norm]

Deterministic from the seed: values come from numpy's PCG64 (so the bytes do not depend on the torch or
transformers version) and are rounded to bf16 once. The layout is the one zai-org publishes: per-expert
``mlp.experts.E.{gate,up,down}_proj``, ``mlp.gate.e_score_correction_bias`` in F32, ``mlp.shared_experts``,
leading dense layers (``mlp.{gate,up,down}_proj``) and the NextN/MTP block as one more decoder layer
``model.layers.N`` with ``eh_proj``, ``enorm``, ``hnorm`` and ``shared_head.norm``.

The tokenizer is the bundled tiny-qwen3moe vocabulary (byte-level BPE trained on Python) under GLM's
pre-tokenizer split, with GLM's special tokens appended; llama.cpp's converter accepts it (its GLM
vocabulary code looks those specials up).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from fixture_values import Values, bf16
from safetensors.torch import save_file

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny-qwen3moe"
GLM_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GLM_SPECIALS = ("[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>", "<|assistant|>",
                "<|observation|>")  # fmt: skip
CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

#: the tiny geometry: every matrix row a multiple of 256 so that every k-quant applies as on a real model
GLM4MOE_CONFIG = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": [0, 4102, 4104],
    "pad_token_id": 0,
    "first_k_dense_replace": 1,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 256,
    "initializer_range": 0.02,
    "intermediate_size": 512,
    "max_position_embeddings": 4096,
    "moe_intermediate_size": 256,
    "n_group": 1,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 3,
    "num_key_value_heads": 2,
    "num_nextn_predict_layers": 1,
    "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "routed_scaling_factor": 2.5,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "torch_dtype": "bfloat16",
    "use_qk_norm": True,
    "vocab_size": 4112,
}
#: larger than a trained model's init, so that every block (and the routing) visibly moves the logits
WEIGHT_STD, HEAD_STD = 0.05, 0.1


def _layer(v: Values, cfg: dict, i: int, moe: bool, nextn: bool) -> dict[str, torch.Tensor]:
    h, d = cfg["hidden_size"], cfg.get("head_dim", 0)
    nh, nkv, std = cfg["num_attention_heads"], cfg["num_key_value_heads"], WEIGHT_STD
    p = f"model.layers.{i}."
    out: dict[str, torch.Tensor] = {}
    if nextn:
        out[p + "eh_proj.weight"] = bf16(v.normal((h, 2 * h), std))
        out[p + "enorm.weight"] = bf16(v.normal((h,), 0.1, 1.0))
        out[p + "hnorm.weight"] = bf16(v.normal((h,), 0.1, 1.0))
        out[p + "shared_head.norm.weight"] = bf16(v.normal((h,), 0.1, 1.0))
    out[p + "input_layernorm.weight"] = bf16(v.normal((h,), 0.1, 1.0))
    out[p + "post_attention_layernorm.weight"] = bf16(v.normal((h,), 0.1, 1.0))
    if "q_lora_rank" in cfg:
        out |= _dsa_attention(v, cfg, p)
        return out | _ffn(v, cfg, p, moe)
    for name, rows in (("q", nh * d), ("k", nkv * d), ("v", nkv * d)):
        out[p + f"self_attn.{name}_proj.weight"] = bf16(v.normal((rows, h), std))
        if cfg["attention_bias"]:
            out[p + f"self_attn.{name}_proj.bias"] = bf16(v.normal((rows,), 0.5))
    out[p + "self_attn.o_proj.weight"] = bf16(v.normal((h, nh * d), std))
    if cfg["use_qk_norm"]:
        out[p + "self_attn.q_norm.weight"] = bf16(v.normal((d,), 0.1, 1.0))
        out[p + "self_attn.k_norm.weight"] = bf16(v.normal((d,), 0.1, 1.0))
    return out | _ffn(v, cfg, p, moe)


def _ffn(v: Values, cfg: dict, p: str, moe: bool) -> dict[str, torch.Tensor]:
    h, ff, e, std = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["n_routed_experts"], WEIGHT_STD
    out: dict[str, torch.Tensor] = {}
    if not moe:
        dff = cfg["intermediate_size"]
        out[p + "mlp.gate_proj.weight"] = bf16(v.normal((dff, h), std))
        out[p + "mlp.up_proj.weight"] = bf16(v.normal((dff, h), std))
        out[p + "mlp.down_proj.weight"] = bf16(v.normal((h, dff), std))
        return out
    # a router far from uniform, so the top-k choice (and the correction bias) matter
    out[p + "mlp.gate.weight"] = bf16(v.normal((e, h), 0.1))
    out[p + "mlp.gate.e_score_correction_bias"] = torch.from_numpy(v.normal((e,), 0.05))
    for x in range(e):
        out[p + f"mlp.experts.{x}.gate_proj.weight"] = bf16(v.normal((ff, h), std))
        out[p + f"mlp.experts.{x}.up_proj.weight"] = bf16(v.normal((ff, h), std))
        out[p + f"mlp.experts.{x}.down_proj.weight"] = bf16(v.normal((h, ff), std))
    sff = ff * cfg["n_shared_experts"]
    out[p + "mlp.shared_experts.gate_proj.weight"] = bf16(v.normal((sff, h), std))
    out[p + "mlp.shared_experts.up_proj.weight"] = bf16(v.normal((sff, h), std))
    out[p + "mlp.shared_experts.down_proj.weight"] = bf16(v.normal((h, sff), std))
    return out


#: the tiny GLM-5 (``GlmMoeDsaForCausalLM``): MLA with q/kv LoRA ranks, the DSA indexer keeping 8 tokens, one
#: dense layer, routed + shared experts, and the NextN block
GLM_DSA_CONFIG = {
    **{k: v for k, v in GLM4MOE_CONFIG.items() if k not in ("attention_bias", "head_dim", "partial_rotary_factor",
                                                           "use_qk_norm")},
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "attention_bias": False,
    "num_key_value_heads": 4,
    "q_lora_rank": 256,
    "kv_lora_rank": 256,
    "qk_rope_head_dim": 32,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "index_n_heads": 4,
    "index_head_dim": 64,
    "index_topk": 8,
    "indexer_types": ["full", "shared", "full"],
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
}  # fmt: skip


def _dsa_attention(v: Values, cfg: dict, p: str) -> dict[str, torch.Tensor]:
    h, nh, std = cfg["hidden_size"], cfg["num_attention_heads"], WEIGHT_STD
    ql, kvl, rope, nope, vd = (cfg[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                                                "v_head_dim"))  # fmt: skip
    a = p + "self_attn."
    out = {
        a + "q_a_proj.weight": bf16(v.normal((ql, h), std)),
        a + "q_a_layernorm.weight": bf16(v.normal((ql,), 0.1, 1.0)),
        a + "q_b_proj.weight": bf16(v.normal((nh * (nope + rope), ql), std)),
        a + "kv_a_proj_with_mqa.weight": bf16(v.normal((kvl + rope, h), std)),
        a + "kv_a_layernorm.weight": bf16(v.normal((kvl,), 0.1, 1.0)),
        a + "kv_b_proj.weight": bf16(v.normal((nh * (nope + vd), kvl), std)),
        a + "o_proj.weight": bf16(v.normal((h, nh * vd), std)),
    }
    layer = int(p.split(".")[2])
    if layer >= len(cfg["indexer_types"]) or cfg["indexer_types"][layer] == "full":
        ih, idim = cfg["index_n_heads"], cfg["index_head_dim"]
        out |= {
            a + "indexer.wq_b.weight": bf16(v.normal((ih * idim, ql), std)),
            a + "indexer.wk.weight": bf16(v.normal((idim, h), std)),
            a + "indexer.k_norm.weight": bf16(v.normal((idim,), 0.1, 1.0)),
            a + "indexer.k_norm.bias": bf16(v.normal((idim,), 0.1)),
            a + "indexer.weights_proj.weight": bf16(v.normal((ih, h), std)),
        }
    return out


def _tokenizer(out: Path, vocab_size: int) -> None:
    tok = json.loads((EXAMPLE / "tokenizer.json").read_text())
    base = len(tok["model"]["vocab"])
    for j, content in enumerate(GLM_SPECIALS):
        tok["added_tokens"].append({"id": base + j, "content": content, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": True})  # fmt: skip
    assert base + len(GLM_SPECIALS) <= vocab_size
    tok["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {"Regex": GLM_SPLIT}
    tok["model"]["ignore_merges"] = True  # as llama.cpp's glm4 pre-tokenizer treats it
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    tcfg = {"backend": "tokenizers", "tokenizer_class": "TokenizersBackend", "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>", "model_max_length": 4096, "clean_up_tokenization_spaces": False}  # fmt: skip
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def write_glm4moe(out: str | Path, seed: int = 0, **overrides: object) -> Path:
    """A tiny random ``Glm4MoeForCausalLM`` checkpoint in ``out``; ``overrides`` change config keys."""
    return _write(Path(out), {**GLM4MOE_CONFIG, **overrides}, seed)


def write_glm_dsa(out: str | Path, seed: int = 0, **overrides: object) -> Path:
    """A tiny random ``GlmMoeDsaForCausalLM`` (GLM-5) checkpoint in ``out``; ``overrides`` change config keys."""
    return _write(Path(out), {**GLM_DSA_CONFIG, **overrides}, seed)


def _write(out: Path, cfg: dict, seed: int) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    v = Values(seed)
    h, vocab, n = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    tensors = {"model.embed_tokens.weight": bf16(v.normal((vocab, h), 1.0))}
    for i in range(n + cfg["num_nextn_predict_layers"]):
        tensors.update(_layer(v, cfg, i, moe=i >= cfg["first_k_dense_replace"], nextn=i >= n))
    tensors["model.norm.weight"] = bf16(v.normal((h,), 0.1, 1.0))
    tensors["lm_head.weight"] = bf16(v.normal((vocab, h), HEAD_STD))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    _tokenizer(out, vocab)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-qk-norm", action="store_true")
    ap.add_argument("--dsa", action="store_true", help="GLM-5 (GlmMoeDsaForCausalLM) instead of GLM-4.5")
    a = ap.parse_args()
    if a.dsa:
        print(write_glm_dsa(a.out, a.seed))
    else:
        print(write_glm4moe(a.out, a.seed, **({"use_qk_norm": False} if a.no_qk_norm else {})))


if __name__ == "__main__":
    main()
