"""The uncached hybrid decode's host side, replayed on a host expert cache: with and without read ahead.

    python benchmarks/read_ahead.py F.gguf [--pool-share 0.237] [--host-share 0.474] [--compute-us 370] \
        [--tokens 48 --warmup 16] [--read-threads 4] [--json out.json]

A hybrid run whose file does not fit host memory (``hybrid_experts.py --host-cache-gib``) computes the
experts its GPU pool lacks on the CPU, from a host ``ExpertCache`` whose misses are disk reads. This
replays that side alone, so that the cost of its reads can be measured on any host (no GPU): per token,
per layer of the file, as the hybrid worker does at the layer's post,

- ``ExpertCache.serve`` with the layer's routing, and with ``--prefetch`` on, the next layer's guessed
  experts that the pool does not hold handed to a ``runtime.prefetch.ReadAhead``;
- the layer's experts that the pool does not hold asked for (``held``: misses read from the file, every
  range dropped from the page cache again), then ``--compute-us`` of sleep for the CPU kernel and the
  device's part of the layer (the hybrid decode layer took 367 us on the H200 machine, session 29).

Routing is ``hybrid_experts.py``'s trace: a trained router's choices (tiny-qwen3moe over the validation
text) scaled to the file's geometry, and its recorded guesses (the next layer's router on this layer's
input) scaled the same way. The pool is static: the ``--pool-share`` of all experts most chosen over the
table (a 4 GiB pool of the 40-layer 35B-geometry file holds 23.7%; the live pool's policy hits fewer).
The host cache holds ``--host-share`` (8 GiB: 47.4%) and starts empty.

Reported per row, over the tokens after ``--warmup``: milliseconds a token, of which the model's own reads
and its waits for reads ahead; MB read a token and MB needed (the experts the decode found uncached: its
misses and the read ahead's used); experts read ahead, used and evicted unused; and the bound, needed MB
at the disk's rate for one-expert requests (``--disk-gb-s``, default measured by ``disk_reads.py``'s way:
the plain row's own read rate) plus the compute.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hybrid_experts import Routing, TableGuess, cache_figures, routing_tables  # noqa: E402
from routing_locality import FIXTURES, ROOT  # noqa: E402
from streaming import drop_cache, expert_layers  # noqa: E402

from runtime.experts import CacheStats, ExpertCache  # noqa: E402
from runtime.prefetch import ReadAhead  # noqa: E402


def hottest(table: list[np.ndarray], experts: int, share: float) -> np.ndarray:
    """(layers, experts) bool: the ``share`` of all experts most chosen over ``table``."""
    counts = np.stack([np.bincount(t.reshape(-1), minlength=experts) for t in table])
    n = int(share * counts.size)
    pooled = np.zeros(counts.size, bool)
    pooled[np.argsort(-counts.reshape(-1), kind="stable")[:n]] = True
    return pooled.reshape(counts.shape)


def replay(path: Path, layers: dict, table: list, guesses: list, pooled: np.ndarray, args: argparse.Namespace,
           prefetch: bool, hints: bool = True) -> dict:  # fmt: skip
    order = sorted(layers)
    k = table[0].shape[1]
    total = sum(lay.experts for lay in layers.values())
    cache = ExpertCache(path, layers, max(int(args.host_share * total), len(layers) * k + 1), k, "lfu", "cpu",
                        drop_pages=True, read_threads=args.read_threads)  # fmt: skip
    cache.ahead_hints = hints
    routing = Routing(table, guesses)
    # the tables' guesses at the token replayed (no router product: the sleep stands for the layer's compute)
    ahead = ReadAhead(cache, TableGuess(routing, order, lambda layer, x: None)) if prefetch else None

    pos = {layer: i for i, layer in enumerate(order)}

    def not_pooled(layer: int, experts: list[int]) -> list[int]:
        return [e for e in experts if not pooled[pos[layer], e]]

    drop_cache(path)
    compute = args.compute_us * 1e-6
    slept = 0.0
    try:
        for t in range(args.warmup + args.tokens):
            if t == args.warmup:
                c0, t0, slept = copy.copy(cache.stats), time.perf_counter(), 0.0
            for i, layer in enumerate(order):
                ids = table[i][t % len(table[i])].tolist()
                if ahead is None:
                    cache.serve(layer, ids)
                else:  # as the hybrid worker at the layer's post
                    ahead.routed(layer, ids, torch.empty(0), not_pooled)
                need = [e for e in ids if not pooled[i, e]]
                if need:
                    with cache.held(layer, need):
                        pass
                s0 = time.perf_counter()
                time.sleep(compute)
                slept += time.perf_counter() - s0
            routing.advance(1)
        seconds = time.perf_counter() - t0
    finally:
        if ahead is not None:
            ahead.close()
        cache.close()
    return figures(c0, cache.stats, args.tokens, seconds, slept, cache.slot_bytes) | {
        "prefetch": prefetch,
        "ahead_hints": hints,
    }


def figures(c0: CacheStats, c1: CacheStats, n: int, seconds: float, slept: float, record: int) -> dict:
    return {
        "ms_per_token": round(seconds / n * 1e3, 2),
        "compute_ms_per_token": round(slept / n * 1e3, 2),
        "model_read_gb_s": round(
            (c1.misses - c0.misses) * record / (c1.read_seconds - c0.read_seconds) / 1e9, 3
        )
        if c1.read_seconds > c0.read_seconds
        else None,
    } | cache_figures(c0, c1, n, record)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", type=Path)
    ap.add_argument("--pool-share", type=float, default=0.237)
    ap.add_argument("--host-share", type=float, default=0.474)
    ap.add_argument("--compute-us", type=float, default=370.0)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--read-threads", type=int, default=4)
    ap.add_argument(
        "--unhinted", action="store_true",
        help="a third row: the read ahead's reads one at a time, its ranges not asked for first (ahead_hints off)",
    )  # fmt: skip
    ap.add_argument("--disk-gb-s", type=float, help="the bound's read rate (default: the plain row's own)")
    ap.add_argument("--trace-model", type=Path, default=ROOT / "examples" / "tiny-qwen3moe")
    ap.add_argument("--text", type=Path, default=FIXTURES / "text" / "val.txt")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if not 0 <= args.pool_share < 1 or not 0 < args.host_share <= 1:
        print("error: --pool-share takes [0, 1), --host-share (0, 1]", file=sys.stderr)
        return 1
    layers = expert_layers(args.file)
    if layers is None:
        return 1
    n = args.warmup + args.tokens
    args.routing, args.trace_tokens = ["trace"], 2048
    tables, guesses = routing_tables(args, args.file, n)
    table, guessed = tables["trace"], guesses["trace"]
    pooled = hottest(table, next(iter(layers.values())).experts, args.pool_share)
    variants = [(False, True), (True, True)] + [(True, False)] * args.unhinted
    rows = [replay(args.file, layers, table, guessed, pooled, args, p, h) for p, h in variants]
    disk = args.disk_gb_s or rows[0]["model_read_gb_s"]
    print(f"{args.file.name}: {len(layers)} layers, pool {args.pool_share:.1%}, host cache {args.host_share:.1%}, "
          f"compute {args.compute_us:g} us a layer, {args.tokens} tokens after {args.warmup}")  # fmt: skip
    for r in rows:
        r["bound_ms_per_token"] = round(r["needed_mb_per_token"] / disk + r["compute_ms_per_token"], 2)
        r["ratio"] = round(r["ms_per_token"] / r["bound_ms_per_token"], 2)
        label = ("on" if r["ahead_hints"] else "on, unhinted") if r["prefetch"] else "off"
        print(f"  read ahead {label}: {r['ms_per_token']} ms a token (bound "
              f"{r['bound_ms_per_token']}, ratio {r['ratio']}): reads {r['read_ms_per_token']}, waits "
              f"{r['wait_ms_per_token']}, compute {r['compute_ms_per_token']}; MB read {r['read_mb_per_token']}, "
              f"needed {r['needed_mb_per_token']}; read ahead {r['read_ahead_per_token']}, used "
              f"{r['used_per_token']}, evicted unused {r['wasted_per_token']}")  # fmt: skip
    if args.json:
        args.json.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
