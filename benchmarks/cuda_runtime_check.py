"""Torch path vs the cuda kernels on one GGUF file (CUDA): prefill logits, first decode-step logits, 64 greedy
tokens, GPU memory after load and eager greedy tok/s. The torch path is FORGE_CUDA_KERNELS=0.

python benchmarks/cuda_runtime_check.py MODEL.gguf
"""

import os
import sys
import time

import torch

from runtime.models import load_model

path = sys.argv[1]
res = {}
for mode in ("0", "1"):
    os.environ["FORGE_CUDA_KERNELS"] = mode
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    m = load_model(path, "cuda")
    print(f"kernels={mode}: GPU memory after load {(torch.cuda.memory_allocated() - base) / 2**20:.0f} MiB")
    ids = torch.randint(0, m.vocab_size, (48,), generator=torch.Generator().manual_seed(0)).cuda()
    st = m.new_state()
    pre = m.forward(ids, st)
    nxt = pre[-1].argmax()
    first = m.forward(nxt.view(1), st, last_only=True)[-1]
    toks = [int(nxt)]
    nxt = first.argmax()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(63):
        toks.append(int(nxt))
        nxt = m.forward(nxt.view(1), st, last_only=True)[-1].argmax()
    torch.cuda.synchronize()
    print(
        f"kernels={mode}: {63 / (time.perf_counter() - t):.1f} tok/s greedy decode (eager, incl. argmax sync)"
    )
    res[mode] = (pre, first, toks)
    del m, st
    torch.cuda.empty_cache()
(a0, a1, at), (b0, b1, bt) = res["0"], res["1"]
for name, x, y in (("prefill logits (48 tokens)", a0, b0), ("first decode-step logits", a1, b1)):
    print(f"{name}: max |diff| / max |logit| = {((x - y).abs().max() / x.abs().max()).item():.2e}")
same = sum(p == q for p, q in zip(at, bt, strict=True))
print(
    f"greedy tokens: {same}/64 identical; first divergence at {next((i for i, (p, q) in enumerate(zip(at, bt, strict=True)) if p != q), None)}"
)
