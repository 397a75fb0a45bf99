"""imatrix collection speed: overhead of the accumulator over plain evaluation, and `forge imatrix collect` tokens/s.

    python benchmarks/imatrix_speed.py [--model HF_DIR|GGUF] [--text FILE] [--chunks 32] [--ctx 512]
                                       [--threads 2] [--reps 5]

The overhead of collection is the extra time of an evaluation with the accumulator attached over the
same evaluation without it (the same forward passes). The two runs alternate (ABBA order, ``--reps``
pairs) so that load drifting on a shared machine hits both alike; the median and the minimum of the
per-pair ratio are reported, with the time spent inside the accumulator's hook (a direct measure,
less sensitive to load) and the load average before and after. llama-imatrix: 5.1 s for 32 x 512
tokens on tiny-qwen3moe, 2 threads (fixtures README).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from random_checkpoint import EXAMPLE

from forge.imatrix.accumulate import ImatrixAccumulator, collect
from runtime.evaluate import evaluate, perplexity_tokens
from runtime.models import load_model
from runtime.tokenizer import Tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"


class TimedAccumulator(ImatrixAccumulator):
    """The accumulator, with the wall time spent in its matmul hook added up."""

    seconds = 0.0

    def on_matmul_input(self, tensor_name: str, x: torch.Tensor, expert_ids: torch.Tensor | None) -> None:
        start = time.perf_counter()
        super().on_matmul_input(tensor_name, x, expert_ids)
        self.seconds += time.perf_counter() - start


def _load() -> str:
    return "load average " + " ".join(f"{v:.2f}" for v in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=EXAMPLE)
    ap.add_argument("--text", type=Path, default=FIXTURES / "text" / "calib.txt")
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5, help="pairs of (eval, eval + accumulator) runs")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    text = a.text if a.text.is_file() else EXAMPLE.parent / "tiny-qwen3moe-val-excerpt.txt"
    print(f"{_load()}; {os.cpu_count()} cores, torch threads {torch.get_num_threads()}; model {a.model}")
    plain = load_model(a.model)
    acc = TimedAccumulator()
    observed = load_model(a.model, observers=[acc])
    ids = perplexity_tokens(
        Tokenizer.from_metadata(plain.weights), text.read_text(encoding="utf-8"), a.ctx, a.chunks
    )
    evaluate(plain, ids, a.ctx, 1)  # warm-up: first-call allocations, thread pool
    evaluate(observed, ids, a.ctx, 1)
    t_eval: list[float] = []
    t_obs: list[float] = []
    t_hook: list[float] = []
    chunks = 0
    for rep in range(a.reps):
        order = ("eval", "obs") if rep % 2 == 0 else ("obs", "eval")
        for which in order:
            acc.seconds = 0.0
            start = time.perf_counter()
            res = evaluate(plain if which == "eval" else observed, ids, a.ctx, a.chunks)
            elapsed = time.perf_counter() - start
            (t_eval if which == "eval" else t_obs).append(elapsed)
            if which == "obs":
                t_hook.append(acc.seconds)
            chunks = res.chunks
    n = chunks * a.ctx
    ratios = [o / e - 1 for o, e in zip(t_obs, t_eval, strict=True)]
    hook = [h / e for h, e in zip(t_hook, t_eval, strict=True)]
    print(f"{a.reps} pairs of {chunks} x {a.ctx} tokens of {text.name}")
    print(f"eval               median {statistics.median(t_eval):7.2f} s  {n / statistics.median(t_eval):8.0f} tok/s"
          f"   (min {min(t_eval):.2f} s)")  # fmt: skip
    print(f"eval + accumulator median {statistics.median(t_obs):7.2f} s  {n / statistics.median(t_obs):8.0f} tok/s"
          f"   (min {min(t_obs):.2f} s)")  # fmt: skip
    print(f"overhead (per pair) median {statistics.median(ratios):+.1%}  min {min(ratios):+.1%}  "
          f"all {' '.join(f'{r:+.1%}' for r in ratios)}")  # fmt: skip
    print(
        f"time inside the accumulator / eval time: median {statistics.median(hook):.1%}  min {min(hook):.1%}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        collect(a.model, text, Path(tmp) / "im.gguf", ctx=a.ctx, chunks=a.chunks, log=None)
        t_collect = time.perf_counter() - start
    print(
        f"imatrix collect    {t_collect:7.2f} s  {n / t_collect:8.0f} tok/s   (model load, tokenizing, writing included)"
    )
    print(_load())


if __name__ == "__main__":
    main()
