"""``forge demo``: the main job end to end on the example model.

In a checkout the example is ``examples/tiny-qwen3moe`` (trained, 54 MB). An installed package does not
carry those weights: it ships the example's config and tokenizer (``forge/example/``) and writes random
weights of the same geometry next to them, so every step runs the same way (the figures mean nothing).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from rich.console import Console

from forge.errors import ForgeError

#: the checkout's trained example model (absent from an installed wheel)
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny-qwen3moe"
#: package data: the example's config.json and tokenizer files, and the text the demo evaluates on
EXAMPLE_FILES = resources.files("forge") / "example"
#: the first 24 kB of the fixtures' held-out validation text (Python sources the model never saw)
EXAMPLE_TEXT = EXAMPLE_FILES / "val-excerpt.txt"
_MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "chat_template.jinja")  # fmt: skip


def write_random_example(dest: Path, seed: int = 0) -> Path:
    """An HF folder in the example's geometry (Qwen3-MoE, 28 M parameters) with random bf16 weights."""
    import json

    import torch
    from safetensors.torch import save_file

    dest.mkdir(parents=True, exist_ok=True)
    for name in _MODEL_FILES:
        (dest / name).write_bytes((EXAMPLE_FILES / name).read_bytes())
    cfg = json.loads((dest / "config.json").read_text())
    d, hd = cfg["hidden_size"], cfg["head_dim"]
    ff, n_exp = cfg["moe_intermediate_size"], cfg["num_local_experts"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    layer = {"input_layernorm": (d,), "post_attention_layernorm": (d,), "self_attn.q_proj": (q, d),
             "self_attn.k_proj": (kv, d), "self_attn.v_proj": (kv, d), "self_attn.o_proj": (d, q),
             "self_attn.q_norm": (hd,), "self_attn.k_norm": (hd,), "mlp.gate": (n_exp, d)}  # fmt: skip
    expert = {"gate_proj": (ff, d), "up_proj": (ff, d), "down_proj": (d, ff)}
    shapes = {
        "model.embed_tokens": (cfg["vocab_size"], d),
        "lm_head": (cfg["vocab_size"], d),
        "model.norm": (d,),
    }
    for i in range(cfg["num_hidden_layers"]):
        shapes |= {f"model.layers.{i}.{k}": v for k, v in layer.items()}
        shapes |= {
            f"model.layers.{i}.mlp.experts.{e}.{k}": v for e in range(n_exp) for k, v in expert.items()
        }
    gen = torch.Generator().manual_seed(seed)
    std = cfg["initializer_range"]
    tensors = {  # norms at 1, matrices N(0, initializer_range) like a freshly initialised HF model
        f"{name}.weight": (torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=gen) * std)
        for name, shape in shapes.items()
    }
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(dest / "model.safetensors"))
    return dest


@dataclass
class Step:
    step: str
    output: str
    bytes: int
    seconds: float
    result: str


def _timed(fn: Callable[[], tuple[str, int, str]], step: str) -> Step:
    start = time.perf_counter()
    output, nbytes, result = fn()
    return Step(step, output, nbytes, time.perf_counter() - start, result)


def run_demo(model: Path | None, keep: Path | None, console: Console) -> list[Step]:
    from forge.convert import convert_checkpoint
    from forge.inspect_file import describe
    from forge.layout import convert as convert_layout
    from forge.prune.apply import apply_mask
    from forge.prune.collect import collect_profile
    from forge.prune.mask import build_mask
    from forge.quant.quantize import quantize
    from runtime.evaluate import evaluate, perplexity_tokens
    from runtime.models import load_model
    from runtime.tokenizer import Tokenizer

    if model is not None and not (model / "config.json").is_file():
        raise ForgeError(f"{model}: not a Hugging Face model folder (no config.json)")
    with tempfile.TemporaryDirectory(prefix="forge-demo-") as tmp:
        work = keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        if model is None and (EXAMPLE / "config.json").is_file():
            model = EXAMPLE
        elif model is None:
            model = work / "tiny-qwen3moe-random"
            shutil.rmtree(model, ignore_errors=True)
            console.print("[bold]>[/bold] no trained example in this install (it lives in the repository's "
                          f"examples/): random weights in its geometry at {model}; the figures mean nothing")  # fmt: skip
            write_random_example(model)
        bf16, q4 = work / "model-bf16.gguf", work / "model-Q4_K_M.gguf"
        boost, em = work / "model-Q4_K_M-boost.gguf", work / "model-Q4_K_M-v2.gguf"

        def do_convert() -> tuple[str, int, str]:
            rep = convert_checkpoint(model, bf16, "bf16", progress=True)
            return bf16.name, rep.bytes_written, f"{rep.n_tensors} tensors, lossless"

        def do_quantize() -> tuple[str, int, str]:
            _, rep = quantize(model, q4, "q4_k_m", jobs=2, progress=True)
            return q4.name, rep.bytes, f"llama.cpp's Q4_K_M mix, {len(rep.tensors)} tensors"

        def do_reuse() -> tuple[str, int, str]:
            over = ["blk\\.3\\.ffn_.*_exps=q6_k"]
            _, rep = quantize(model, boost, "q4_k_m", tensor_types=over, reuse=[q4], progress=True)
            copied = sum(r["reason"].startswith("key match") for r in rep.tensors)
            return (
                boost.name,
                rep.bytes,
                f"layer 3 experts -> Q6_K: {copied}/{len(rep.tensors)} tensors copied",
            )

        def do_layout() -> tuple[str, int, str]:
            convert_layout(q4, em, "v2")
            back = work / "model-Q4_K_M-roundtrip.gguf"
            convert_layout(em, back, "canonical")
            same = "byte-identical" if back.read_bytes() == q4.read_bytes() else "DIFFERS"
            return em.name, em.stat().st_size, f"expert-major v2, verified; back to canonical: {same}"

        def do_eval() -> tuple[str, int, str]:
            base = load_model(bf16)
            tok = Tokenizer.from_metadata(base.weights)
            ids = perplexity_tokens(tok, EXAMPLE_TEXT.read_text(encoding="utf-8"), 512, 4)
            ref = evaluate(base, ids, 512, 4)
            r = evaluate(load_model(q4), ids, 512, 4, reference=base)
            return q4.name, 0, (f"PPL {r.perplexity:.3f} (bf16 {ref.perplexity:.3f}), mean KLD {r.kld_mean:.4f}, "
                                f"same top token {r.top1_agreement:.1%}")  # fmt: skip

        pruned = work / "model-Q4_K_M-pruned75.gguf"

        def do_prune() -> tuple[str, int, str]:
            rep = collect_profile(q4, EXAMPLE_TEXT, None, ctx=512, chunks=1)
            mask = build_mask(rep.profile, keep_fraction=0.75, by="weight")
            applied = apply_mask(q4, mask, pruned)
            base = load_model(q4)
            tok = Tokenizer.from_metadata(base.weights)
            ids = perplexity_tokens(tok, EXAMPLE_TEXT.read_text(encoding="utf-8"), 512, 4)
            r = evaluate(load_model(pruned), ids, 512, 4, reference=base)
            saved = 1 - applied.output_bytes / applied.source_bytes
            return pruned.name, applied.output_bytes, (f"keep 24/32 experts by weight: {saved:.0%} smaller, "
                                                       f"KLD {r.kld_mean:.4f} vs Q4_K_M")  # fmt: skip

        def do_inspect() -> tuple[str, int, str]:
            info = describe(q4)
            return q4.name, info["file_bytes"], f"{info['architecture']}, {info['bits_per_weight']:.2f} bpw"

        steps = (
            ("convert HF -> GGUF bf16", do_convert),
            ("quantize HF -> Q4_K_M", do_quantize),
            ("rebuild a boosted variant (--reuse)", do_reuse),
            ("layout -> expert-major v2 and back", do_layout),
            ("eval Q4_K_M vs bf16 (4 x 512 tokens)", do_eval),
            ("prune 25% of the experts (profile, mask, apply)", do_prune),
            ("inspect", do_inspect),
        )
        rows = []
        for name, fn in steps:
            console.print(f"[bold]>[/bold] {name}")
            rows.append(_timed(fn, name))
        return rows
