"""imatrix collection speed: tokens/s of `forge imatrix collect` vs plain `forge eval` on the same chunks.

    python benchmarks/imatrix_speed.py [--model HF_DIR|GGUF] [--text FILE] [--chunks 32] [--ctx 512]

The overhead of collection is the extra time over an evaluation of the same tokens (the same
forward passes, without the observer). llama-imatrix: 5.1 s for 32 x 512 tokens on tiny-qwen3moe,
2 threads (fixtures README).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
from random_checkpoint import EXAMPLE

from forge.imatrix.accumulate import ImatrixAccumulator, collect
from runtime.evaluate import evaluate, perplexity_tokens
from runtime.models import load_model
from runtime.tokenizer import Tokenizer

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=EXAMPLE)
    ap.add_argument("--text", type=Path, default=FIXTURES / "text" / "calib.txt")
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=512)
    a = ap.parse_args()
    text = a.text if a.text.is_file() else EXAMPLE.parent / "tiny-qwen3moe-val-excerpt.txt"
    model = load_model(a.model)
    ids = perplexity_tokens(
        Tokenizer.from_metadata(model.weights), text.read_text(encoding="utf-8"), a.ctx, a.chunks
    )
    start = time.perf_counter()
    res = evaluate(model, ids, a.ctx, a.chunks)
    t_eval = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        collect(a.model, text, Path(tmp) / "im.gguf", ctx=a.ctx, chunks=a.chunks, log=None)
        t_collect = time.perf_counter() - start
    acc = ImatrixAccumulator()
    observed = load_model(a.model, observers=[acc])
    start = time.perf_counter()
    evaluate(observed, ids, a.ctx, a.chunks)
    t_obs = time.perf_counter() - start
    n = res.chunks * a.ctx
    print(
        f"machine: {os.cpu_count()} cores, torch threads {torch.get_num_threads()}; {res.chunks} x {a.ctx} tokens of {text.name}"
    )
    print(f"eval               {t_eval:7.2f} s  {n / t_eval:8.0f} tok/s")
    print(f"eval + accumulator {t_obs:7.2f} s  {n / t_obs:8.0f} tok/s   overhead {t_obs / t_eval - 1:+.1%}")
    print(
        f"imatrix collect    {t_collect:7.2f} s  {n / t_collect:8.0f} tok/s   (model load, tokenizing, writing included)"
    )


if __name__ == "__main__":
    main()
