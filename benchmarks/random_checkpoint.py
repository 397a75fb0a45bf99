"""Write a random-initialized qwen3moe Hugging Face checkpoint of a chosen geometry (for speed runs).

    python benchmarks/random_checkpoint.py OUT_DIR [--layers 6 --experts 32 --hidden 2048 --moe-ff 768]

Default geometry: ~1.0 G parameters, ~2.1 GB of bf16 safetensors in 2 GB shards. The tokenizer and
chat template are copied from the bundled example (vocabulary padded with [PAD] ids as needed).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny-qwen3moe"


def tensors_for(layer: int, hidden: int, experts: int, moe_ff: int, heads: int, kv_heads: int, head_dim: int,
                rng: torch.Generator) -> dict[str, torch.Tensor]:  # fmt: skip
    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=rng) * 0.02).to(torch.bfloat16)

    p = f"model.layers.{layer}."
    out = {
        p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
        p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
        p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
        p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
        p + "self_attn.q_norm.weight": torch.ones(head_dim, dtype=torch.bfloat16),
        p + "self_attn.k_norm.weight": torch.ones(head_dim, dtype=torch.bfloat16),
        p + "mlp.gate.weight": w(experts, hidden),
    }
    for e in range(experts):
        out[p + f"mlp.experts.{e}.gate_proj.weight"] = w(moe_ff, hidden)
        out[p + f"mlp.experts.{e}.up_proj.weight"] = w(moe_ff, hidden)
        out[p + f"mlp.experts.{e}.down_proj.weight"] = w(hidden, moe_ff)
    return out


def write_checkpoint(out: Path, layers: int = 6, experts: int = 32, hidden: int = 2048, moe_ff: int = 768,
                     heads: int = 16, kv_heads: int = 4, head_dim: int = 128, vocab: int = 32768,
                     shard_bytes: int = 2 << 30, seed: int = 0) -> Path:  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    rng = torch.Generator().manual_seed(seed)
    cfg = json.loads((EXAMPLE / "config.json").read_text())
    cfg.update(num_hidden_layers=layers, num_local_experts=experts, num_experts=experts, hidden_size=hidden,
               moe_intermediate_size=moe_ff, intermediate_size=4 * moe_ff, num_attention_heads=heads,
               num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=vocab)  # fmt: skip
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(EXAMPLE / name, out / name)
    groups: list[dict[str, torch.Tensor]] = [{
        "model.embed_tokens.weight": (torch.randn(vocab, hidden, generator=rng) * 0.02).to(torch.bfloat16),
        "lm_head.weight": (torch.randn(vocab, hidden, generator=rng) * 0.02).to(torch.bfloat16),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
    }]  # fmt: skip
    size = sum(t.numel() * 2 for t in groups[0].values())
    weight_map: dict[str, str] = {}
    shards: list[dict[str, torch.Tensor]] = [groups[0]]
    for layer in range(layers):
        ts = tensors_for(layer, hidden, experts, moe_ff, heads, kv_heads, head_dim, rng)
        nbytes = sum(t.numel() * 2 for t in ts.values())
        if size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1].update(ts)
        size += nbytes
    total = 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        total += sum(t.numel() * 2 for t in shard.values())
        shards[i] = {}
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--moe-ff", type=int, default=768)
    a = ap.parse_args()
    write_checkpoint(a.out, a.layers, a.experts, a.hidden, a.moe_ff)
    print(a.out, sum(p.stat().st_size for p in a.out.glob("*.safetensors")), "bytes")


if __name__ == "__main__":
    np.random.seed(0)
    main()
