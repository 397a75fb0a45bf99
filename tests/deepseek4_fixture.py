"""Tiny random DeepSeek V4 checkpoints made in code (``DeepseekV4ForCausalLM``), in the published layout.

    python tests/deepseek4_fixture.py OUT_DIR [--seed 0] [--weights bf16|fp8] [--scales e8m0|f32]

The layout is the one deepseek-ai publishes (and llama.cpp's converter reads; transformers loads it through
its ``deepseek_v4`` conversion mapping): original tensor names (``embed``, ``head``, ``layers.N.attn.wq_a``,
``layers.N.ffn.experts.E.w1`` ...), config keys ``num_hash_layers``, ``compress_ratios``,
``qk_rope_head_dim``, and the MTP block under ``mtp.0.``. Every feature the converters handle is there:

- hash-routed layers (``ffn.gate.tid2eid``, I64 [vocab, top-k]; their ``ffn.gate.bias`` is unused);
- attention layers of each compression ratio: 0 (sliding window only), 4 (compressor with overlap, and the
  lightning indexer with its own compressor) and 128 (compressor only);
- routed experts as published: packed FP4 E2M1 (I8 [rows, cols/2], element 2i in the low nibble) with one
  E8M0 scale per 32 columns (``.scale``, F8_E8M0 [rows, cols/32]);
- with ``weights="fp8"``, the projections deepseek-ai ships in FP8 (attention, indexer query, shared
  experts, MTP e/h projections) as F8_E4M3 with 128x128 block scales (``.scale``: F8_E8M0, or F32 with
  ``scales="f32"``); with ``weights="bf16"`` those are BF16. Embeddings, head, router and the compressor
  and indexer projections are BF16 in both; norms BF16; hyper-connection tensors, sinks, compressor
  position biases and router biases F32 (as published);
- the MTP block (``mtp.0.e_proj``, ``h_proj``, ``enorm``, ``hnorm``, ``norm``, its own ``hc_head_*`` and
  a full decoder block).

Deterministic from the seed: every value comes from numpy's PCG64 in a fixed order, and FP8/FP4/E8M0 codes
are computed with numpy, so the bytes depend on neither the torch nor the transformers version (torch only
writes the file). The tokenizer is the bundled tiny-qwen3moe vocabulary (byte-level BPE, 4096 ids).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import torch
from fixture_values import Values, bf16
from safetensors.torch import save_file

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny-qwen3moe"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}{% else %}{{ m['content'] }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)

#: the tiny geometry. Rows are multiples of 256 where the real model's are, so the k-quants apply as on a
#: real model; FP8 block scales cover partial 128x128 blocks (dims of 64); layer i has compress ratio
#: compress_ratios[i] (the last entry is the MTP block's), the first num_hash_layers layers are hash-routed.
#: llama.cpp runs this geometry (llama-perplexity, llama-imatrix); with an indexer head dim of 32 its graph
#: fails a reshape assertion, and without a ratio-4 layer it divides by zero.
DEEPSEEK4_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "bos_token_id": 0,
    "eos_token_id": 0,
    "compress_ratios": [0, 4, 128, 4, 0],
    "compress_rope_theta": 160000.0,
    "expert_dtype": "fp4",
    "hc_eps": 1e-06,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 256,
    "index_head_dim": 128,
    "index_n_heads": 4,
    "index_topk": 8,
    "initializer_range": 0.02,
    "max_position_embeddings": 16384,
    "moe_intermediate_size": 256,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hash_layers": 2,
    "num_hidden_layers": 4,
    "num_key_value_heads": 1,
    "num_nextn_predict_layers": 1,
    "o_groups": 2,
    "o_lora_rank": 32,
    "q_lora_rank": 64,
    "qk_rope_head_dim": 16,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 16,
        "original_max_position_embeddings": 1024,
        "type": "yarn",
    },
    "rope_theta": 10000.0,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "sliding_window": 16,
    "swiglu_limit": 10.0,
    "tie_word_embeddings": False,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "vocab_size": 4096,
}
#: how deepseek-ai stores FP8 weights (``quantization_config`` of the published config.json)
FP8_QUANTIZATION = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                    "weight_block_size": [128, 128]}  # fmt: skip

#: the folder name and files of the model-card case (llama.cpp names the model, its basename, finetune and version
#: from the folder name, takes license and tags from the card and sampling defaults from generation_config.json)
CARD_FOLDER = "DeepSeek-V4-Flash-Tiny"
MODEL_CARD = (
    "---\nlicense: mit\nlibrary_name: transformers\ntags:\n- deepseek\n- moe\n---\n# A tiny DeepSeek V4\n"
)
GENERATION_CONFIG = {
    "bos_token_id": 0,
    "eos_token_id": 0,
    "do_sample": True,
    "temperature": 1.0,
    "top_p": 0.95,
}
#: the values of the 4-bit E2M1 codes 0..7 (bit 3 is the sign)
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)


def e4m3_values() -> np.ndarray:
    """float32 value of every F8_E4M3 (fn) code 0..255; the two NaN codes are NaN."""
    c = np.arange(256, dtype=np.int64)
    e, m = (c >> 3) & 0xF, c & 7
    mag = np.where(e == 0, m / 8.0 * 2.0**-6, (1 + m / 8.0) * np.exp2(e - 7.0))
    v = np.where(c & 0x80, -mag, mag).astype(np.float32)
    v[(c & 0x7F) == 0x7F] = np.nan
    return v


def e8m0_values(codes: np.ndarray) -> np.ndarray:
    return np.exp2(codes.astype(np.float32) - 127.0)


def fp8_block_quantize(w: np.ndarray, scales: str) -> tuple[np.ndarray, np.ndarray]:
    """(E4M3 codes uint8 [out, in], scales [ceil(out/128), ceil(in/128)]: E8M0 codes uint8 or float32).

    A 128x128 block's scale maps its largest magnitude to at most 448 (E4M3's largest); E8M0 scales are the
    power of two at or above amax / 448. Codes are the nearest E4M3 value (ties to the lower code)."""
    rows, cols = w.shape
    br, bc = -(-rows // 128), -(-cols // 128)
    pad = np.zeros((br * 128, bc * 128), np.float32)
    pad[:rows, :cols] = np.abs(w)
    amax = pad.reshape(br, 128, bc, 128).max(axis=(1, 3))
    amax = np.maximum(amax, np.float32(1e-12))
    if scales == "e8m0":
        exp = np.ceil(np.log2(amax / np.float32(448.0))).astype(np.int64)
        codes = (exp + 127).astype(np.uint8)
        scale = e8m0_values(codes)
        stored: np.ndarray = codes
    else:
        scale = (amax / np.float32(448.0)).astype(np.float32)
        stored = scale
    full = np.repeat(np.repeat(scale, 128, axis=0), 128, axis=1)[:rows, :cols]
    x = (w / full).astype(np.float32)
    table = e4m3_values()
    pos = np.arange(0x7F, dtype=np.uint8)  # 0x00..0x7E: non-negative, increasing values
    mag = np.abs(x)
    i = np.clip(np.searchsorted(table[pos], mag), 1, len(pos) - 1)
    nearer_low = (mag - table[pos][i - 1]) <= (table[pos][i] - mag)
    code = np.where(nearer_low, i - 1, i).astype(np.uint8)
    code = np.where(x < 0, code | np.uint8(0x80), code).astype(np.uint8)
    return code, stored


def _u8(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.uint8)).view(dtype)


class _Writer:
    """Collects the published tensors of one checkpoint."""

    def __init__(self, cfg: dict, v: Values, weights: str, scales: str) -> None:
        self.cfg, self.v, self.weights, self.scales = cfg, v, weights, scales
        self.std = float(cfg["initializer_range"])
        self.out: dict[str, torch.Tensor] = {}

    def bf16(self, name: str, shape: tuple[int, ...], std: float | None = None, mean: float = 0.0) -> None:
        self.out[name] = bf16(self.v.normal(shape, self.std if std is None else std, mean))

    def f32(self, name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> None:
        self.out[name] = torch.from_numpy(self.v.normal(shape, std, mean))

    def norm(self, name: str, n: int) -> None:
        self.bf16(name, (n,), 0.1, 1.0)

    def linear(self, prefix: str, rows: int, cols: int) -> None:
        """A projection deepseek-ai ships in FP8 (``prefix.weight`` + ``prefix.scale``)."""
        w = self.v.normal((rows, cols), self.std)
        if self.weights == "bf16":
            self.out[prefix + ".weight"] = bf16(w)
            return
        codes, scale = fp8_block_quantize(w, self.scales)
        self.out[prefix + ".weight"] = _u8(codes, torch.float8_e4m3fn)
        self.out[prefix + ".scale"] = (
            _u8(scale, torch.float8_e8m0fnu) if self.scales == "e8m0" else torch.from_numpy(scale)
        )

    def fp4(self, prefix: str, rows: int, cols: int) -> None:
        """A routed expert matrix: packed E2M1 codes and per-32-column E8M0 scales around 2^-8."""
        codes = self.v.integers(0, 16, (rows, cols)).astype(np.uint8)
        packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
        scale = (127 - 8 + self.v.integers(-1, 2, (rows, cols // 32))).astype(np.uint8)
        self.out[prefix + ".weight"] = torch.from_numpy(packed.view(np.int8))
        self.out[prefix + ".scale"] = _u8(scale, torch.float8_e8m0fnu)

    def hyper_connection(self, prefix: str, n_out: int, n_scale: int) -> None:
        hc, h = self.cfg["hc_mult"], self.cfg["hidden_size"]
        self.f32(prefix + "_fn", (n_out, hc * h), self.std)
        self.f32(prefix + "_base", (n_out,), 0.1)
        self.f32(prefix + "_scale", (n_scale,), 0.1, 1.0)

    def compressor(self, prefix: str, ratio: int, head_dim: int, overlap: bool) -> None:
        h, coff = self.cfg["hidden_size"], 2 if overlap else 1
        self.f32(prefix + "ape", (ratio, coff * head_dim), 0.1)
        self.bf16(prefix + "wkv.weight", (coff * head_dim, h))
        self.bf16(prefix + "wgate.weight", (coff * head_dim, h))
        self.norm(prefix + "norm.weight", head_dim)

    def block(self, p: str, ratio: int, hashed: bool) -> None:
        c = self.cfg
        h, d, nh, ql = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["q_lora_rank"]
        hc = c["hc_mult"]
        self.hyper_connection(p + "hc_attn", (2 + hc) * hc, 3)
        self.hyper_connection(p + "hc_ffn", (2 + hc) * hc, 3)
        self.norm(p + "attn_norm.weight", h)
        self.norm(p + "ffn_norm.weight", h)
        a = p + "attn."
        self.f32(a + "attn_sink", (nh,), 0.5)
        self.linear(a + "wq_a", ql, h)
        self.norm(a + "q_norm.weight", ql)
        self.linear(a + "wq_b", nh * d, ql)
        self.linear(a + "wkv", d, h)
        self.norm(a + "kv_norm.weight", d)
        self.linear(a + "wo_a", c["o_groups"] * c["o_lora_rank"], nh * d // c["o_groups"])
        self.linear(a + "wo_b", h, c["o_groups"] * c["o_lora_rank"])
        if ratio:
            self.compressor(a + "compressor.", ratio, d, overlap=ratio == 4)
        if ratio == 4:
            ni, di = c["index_n_heads"], c["index_head_dim"]
            self.linear(a + "indexer.wq_b", ni * di, ql)
            self.bf16(a + "indexer.weights_proj.weight", (ni, h))
            self.compressor(a + "indexer.compressor.", ratio, di, overlap=True)
        f = p + "ffn."
        e, ff, k = c["n_routed_experts"], c["moe_intermediate_size"], c["num_experts_per_tok"]
        # a router far from uniform, so the top-k choice (and the bias) matter
        self.bf16(f + "gate.weight", (e, h), 0.1)
        self.f32(f + "gate.bias", (e,), 0.05)
        if hashed:  # k distinct experts per token id
            order = np.argsort(self.v.normal((c["vocab_size"], e), 1.0), axis=1, kind="stable")
            self.out[f + "gate.tid2eid"] = torch.from_numpy(
                np.ascontiguousarray(order[:, :k].astype(np.int64))
            )
        for x in range(e):
            self.fp4(f + f"experts.{x}.w1", ff, h)
            self.fp4(f + f"experts.{x}.w2", h, ff)
            self.fp4(f + f"experts.{x}.w3", ff, h)
        sff = ff * c["n_shared_experts"]
        self.linear(f + "shared_experts.w1", sff, h)
        self.linear(f + "shared_experts.w2", h, sff)
        self.linear(f + "shared_experts.w3", sff, h)


def _tokenizer(out: Path) -> None:
    shutil.copyfile(EXAMPLE / "tokenizer.json", out / "tokenizer.json")
    # bos and eos named by the tokenizer config, as deepseek-ai's is
    tcfg = {"backend": "tokenizers", "tokenizer_class": "TokenizersBackend", "bos_token": "<|endoftext|>",
            "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "model_max_length": 16384}  # fmt: skip
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")


def write_deepseek4(
    out: str | Path, seed: int = 0, weights: str = "bf16", scales: str = "e8m0", mtp: bool = True,
    **overrides: object,
) -> Path:  # fmt: skip
    """Write a tiny random ``DeepseekV4ForCausalLM`` checkpoint in the published layout into ``out``.

    ``weights``: "bf16" (every non-expert matrix BF16) or "fp8" (the published FP8 projections as E4M3 with
    128x128 block scales, ``scales`` "e8m0" or "f32"). Routed experts are packed FP4 in both (the only form
    deepseek-ai publishes, and the only one llama.cpp's converter reads). ``mtp``: include the ``mtp.0.``
    block. ``overrides`` change config keys (geometry included). Two shards and an index, like the
    published checkpoints. The same arguments always give the same bytes.
    """
    if weights not in ("bf16", "fp8") or scales not in ("e8m0", "f32"):
        raise ValueError(f"weights must be bf16|fp8 and scales e8m0|f32, not {weights!r}, {scales!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {**DEEPSEEK4_CONFIG, **overrides}
    if not mtp:
        cfg["num_nextn_predict_layers"] = 0
    if weights == "fp8":
        cfg["quantization_config"] = {
            **FP8_QUANTIZATION,
            "scale_fmt": "ue8m0" if scales == "e8m0" else "float",
        }
    w = _Writer(cfg, Values(seed), weights, scales)
    h, vocab, n, hc = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"], cfg["hc_mult"]
    ratios = cfg["compress_ratios"]
    w.bf16("embed.weight", (vocab, h), 1.0)
    shards: list[dict[str, torch.Tensor]] = []
    for i in range(n):
        w.block(f"layers.{i}.", ratios[i], hashed=i < cfg["num_hash_layers"])
        if i == n // 2 - 1:  # first shard: embeddings and the first half of the layers
            shards.append(w.out)
            w.out = {}
    w.norm("norm.weight", h)
    w.bf16("head.weight", (vocab, h))
    w.hyper_connection("hc_head", hc, 1)
    for j in range(cfg["num_nextn_predict_layers"]):
        p = f"mtp.{j}."
        w.linear(p + "e_proj", h, h)
        w.linear(p + "h_proj", h, h)
        w.norm(p + "enorm.weight", h)
        w.norm(p + "hnorm.weight", h)
        w.norm(p + "norm.weight", h)
        w.hyper_connection(p + "hc_head", hc, 1)
        w.block(p, ratios[n + j], hashed=False)
    shards.append(w.out)
    weight_map = {}
    for k, tensors in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    _tokenizer(out)
    return out


def with_model_card(folder: Path) -> Path:
    """What published checkpoints add: a model card (README.md with YAML front matter), sampling defaults
    (generation_config.json) and add_bos_token / add_eos_token in the tokenizer config."""
    (folder / "README.md").write_text(MODEL_CARD, encoding="utf-8")
    (folder / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2))
    tcfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(
        json.dumps({**tcfg, "add_bos_token": True, "add_eos_token": False})
    )
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--weights", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--scales", choices=("e8m0", "f32"), default="e8m0")
    ap.add_argument("--no-mtp", action="store_true")
    a = ap.parse_args()
    print(write_deepseek4(a.out, a.seed, a.weights, a.scales, mtp=not a.no_mtp))


if __name__ == "__main__":
    main()
