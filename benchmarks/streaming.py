"""SSD-streamed experts: decode tok/s, hit rate and bytes read per token at several cache budgets.

    python benchmarks/streaming.py --layers 4 --tokens 32 --budgets-gib 1,2,4,8 [--routing random]

Synthesizes a Qwen3.6-35B-A3B-geometry Q4_K file (``runtime.synth``; ``--layers`` fewer layers to fit
the machine), converts it to expert-major v2, then for canonical vs v2 and LRU vs LFU decodes
``--tokens`` tokens one at a time after dropping the file from the page cache (posix_fadvise
DONTNEED). Cache budgets are given for the full 40-layer model and scaled by layers/40, so that the
cache holds the same share of the experts. ``--routing random`` replaces the routers' logits with
uniform random ones (the routers of random weights are nearly token-independent and would flatter
the hit rate). Also measures the sequential read ceiling of the file and the compute time of a fully
cached decode, and prints the model: decode time ~ bytes read / throughput + compute.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from forge.layout import convert
from runtime.models import build_model
from runtime.planner import geometry
from runtime.synth import GEOMETRIES, synthesize
from runtime.weights import load_weights, open_expert_cache

FULL_LAYERS = GEOMETRIES["qwen3.6-35b-a3b"].layers


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_ceiling(path: Path, chunk: int = 16 << 20) -> float:
    """Bytes/s of a cold plain sequential read of the whole file."""
    drop_cache(path)
    fd = os.open(path, os.O_RDONLY)
    t0, n = time.perf_counter(), 0
    try:
        while data := os.pread(fd, chunk, n):
            n += len(data)
    finally:
        os.close(fd)
    return n / (time.perf_counter() - t0)


def decode_run(path: Path, capacity: int, policy: str, tokens: torch.Tensor, random_routing: bool) -> dict:
    w = load_weights(path, verify_experts=False)
    w.expert_cache = open_expert_cache(w, capacity, policy)
    m = build_model(w)
    if random_routing:
        gen = torch.Generator().manual_seed(1)
        for block in m.blocks:
            block.moe.router = lambda x, n=m.n_expert: torch.randn(x.shape[0], n, generator=gen)
    drop_cache(path)
    st = m.new_state(len(tokens) + 1)
    t0 = time.perf_counter()
    for t in tokens:
        m.forward(t[None], st)
    dt = time.perf_counter() - t0
    s = w.expert_cache.stats
    return {
        "tok_s": len(tokens) / dt,
        "hit_rate": s.hit_rate,
        "bytes_per_token": s.bytes_read / len(tokens),
        "read_s_per_token": s.read_seconds / len(tokens),
        "s_per_token": dt / len(tokens),
        "reads": s.reads,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path, default=Path("/tmp/forge-streaming"))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--budgets-gib", default="1,2,4,8")
    ap.add_argument("--routing", choices=["model", "random"], default="random")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.dir.mkdir(parents=True, exist_ok=True)
    canon, v2 = args.dir / f"synth-{args.layers}L.gguf", args.dir / f"synth-{args.layers}L-v2.gguf"
    if not canon.exists():
        synthesize(canon, "qwen3.6-35b-a3b", "q4_k", args.layers, args.vocab)
    if not v2.exists():
        convert(canon, v2, "v2")
    w = load_weights(canon)
    g = geometry(w, args.tokens + 1)
    minimum = g.routed_layers * g.experts_used * g.slot_bytes
    ceiling = read_ceiling(canon)
    tokens = torch.randint(0, args.vocab, (args.tokens,), generator=torch.Generator().manual_seed(0))
    # compute time: every expert cached and warm (after a first pass fills the cache)
    warm = decode_run(canon, g.experts, "lru", tokens, args.routing == "random")
    results = {
        "file_bytes": g.file_bytes, "layers": args.layers, "routing": args.routing, "tokens": args.tokens,
        "min_bytes_per_token": minimum, "read_ceiling_mb_s": ceiling / 1e6, "runs": [],
    }  # fmt: skip
    print(f"file {g.file_bytes / 1e9:.2f} GB ({args.layers} of {FULL_LAYERS} layers), record {g.slot_bytes:,} B, "
          f"no-cache minimum {minimum / 1e6:.1f} MB/token, sequential read ceiling {ceiling / 1e6:,.0f} MB/s")  # fmt: skip
    print(f"all-cached cold run: {warm['tok_s']:.2f} tok/s (includes first reads)")
    for gib in (float(x) for x in args.budgets_gib.split(",")):
        cache_bytes = int(gib * (1 << 30) * args.layers / FULL_LAYERS)
        capacity = max(g.floor, cache_bytes // g.slot_bytes)
        for path, layout in ((canon, "canonical"), (v2, "v2")):
            for policy in ("lru", "lfu"):
                r = decode_run(path, capacity, policy, tokens, args.routing == "random")
                r |= {"budget_gib_full_model": gib, "capacity": capacity, "layout": layout, "policy": policy}
                r["predicted_s_per_token"] = r["bytes_per_token"] / ceiling
                results["runs"].append(r)
                print(f"{gib:>4} GiB ({capacity:>5} experts) {layout:>9} {policy}: {r['tok_s']:6.2f} tok/s, "
                      f"hit {r['hit_rate']:6.1%}, {r['bytes_per_token'] / 1e6:7.1f} MB/token "
                      f"({r['bytes_per_token'] / minimum:5.1%} of minimum), read {r['read_s_per_token']:.3f} "
                      f"s/token of {r['s_per_token']:.3f}")  # fmt: skip
    (args.dir / "streaming.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
