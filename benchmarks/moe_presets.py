"""forge's MoE-aware presets vs llama.cpp's mixes on tiny-qwen3moe: size, perplexity, KLD, top-1.

    python benchmarks/moe_presets.py [--chunks 32] [--imatrix FILE] [--text FILE]

Every file is made by `forge quantize` from the bundled example (the llama.cpp mixes are bit-exact
with llama-quantize, so their rows are llama.cpp's files) with the same imatrix, and evaluated by
`forge eval` against the bf16 model on the validation text (ctx 512, like the fixtures' tables).
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path

from random_checkpoint import EXAMPLE

from forge.convert import convert_checkpoint
from forge.quant.quantize import quantize
from runtime.evaluate import ReferenceLogits, evaluate, perplexity_tokens
from runtime.models import load_model
from runtime.tokenizer import Tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
PRESETS = ["q4_k_m", "moe_4bit", "iq2_xxs", "moe_2bit"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument(
        "--imatrix", type=Path, default=FIXTURES / "llamacpp/tiny-qwen3moe/tiny-qwen3moe-imatrix.gguf"
    )
    ap.add_argument("--text", type=Path, default=FIXTURES / "text/val.txt")
    ap.add_argument("--presets", default=",".join(PRESETS))
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="forge-moe-"))
    bf16 = work / "bf16.gguf"
    convert_checkpoint(EXAMPLE, bf16, "bf16")
    base = load_model(bf16)
    tok = Tokenizer.from_metadata(base.weights)
    ids = perplexity_tokens(tok, a.text.read_text(encoding="utf-8"), 512, a.chunks)
    ref_path = work / "ref.npz"
    ref = evaluate(base, ids, 512, a.chunks, save_logits=ref_path)
    print(f"machine: {os.cpu_count()} cores; {ref.tokens} scored tokens; bf16 PPL {ref.perplexity:.4f}")
    print(f"{'recipe':<10}{'bytes':>12}{'bpw':>7}{'PPL':>9}{'mean KLD':>10}{'top-1':>8}")
    ref_logits = ReferenceLogits.load(ref_path)
    for name in a.presets.split(","):
        out = work / f"{name}.gguf"
        _, rep = quantize(EXAMPLE, out, name, imatrix=a.imatrix)
        n_el = sum(math.prod(r["shape"]) for r in rep.tensors)
        bpw = 8 * sum(r["bytes"] for r in rep.tensors) / n_el
        r = evaluate(load_model(out), ids, 512, a.chunks, reference_logits=ref_logits)
        print(
            f"{name:<10}{rep.bytes:>12,}{bpw:>7.3f}{r.perplexity:>9.4f}{r.kld_mean:>10.6f}{r.top1_agreement:>8.2%}",
            flush=True,
        )


if __name__ == "__main__":
    main()
