"""Two requesters on one host expert cache, as in a hybrid run: the CPU side and the GPU pool's copier.

    python benchmarks/cache_contention.py F.gguf [--slots 600 --worker 6 --copier 2 --compute-us 400] \
        [--hot 16] [--tokens 20 --warmup 4] [--drop-pages] [--simulate] [--json out.json]

Each token walks the file's layers. The worker (the hybrid CPU side) holds ``--worker`` experts of the
layer (``ExpertCache.held``) for ``--compute-us`` microseconds, as its kernel computes them in the slab
(sleeping: the compiled kernel lets the GIL go); the copier (the thread that fills the GPU pool) copies
``--copier`` other experts of the layer out of their held slots into staging rows, as
``runtime.hybrid.host_records`` does. Each has its own long-lived thread. Experts are drawn uniformly
(``--hot N``: the worker's from each layer's first N, so that it hits once they are read), and misses
are read from the file (``--drop-pages``: from the device, as when the file is not in the page cache).

Reported for the worker alone, the copier alone and both at once, over the tokens after ``--warmup``:
milliseconds a token, each requester's own milliseconds a token, the hit rate, microseconds a miss and
MB read a token; and ``overlap``, the two alone over both at once. ``--simulate`` leaves out the reads,
which leaves the cache's own bookkeeping.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from streaming import drop_cache, expert_layers  # noqa: E402

from runtime import omp_team  # noqa: E402
from runtime.experts import CacheStats, ExpertCache  # noqa: E402


def routes(layers: dict, tokens: int, worker: int, copier: int, hot: int, seed: int) -> dict[str, list]:
    """Per requester, per token, per layer: the experts it asks for (the two never share one). ``hot``: the
    worker's are drawn from the layer's first ``hot`` experts (0: from all), the copier's from the rest."""
    rng = np.random.default_rng(seed)
    out: dict[str, list] = {"worker": [], "copier": []}
    for _ in range(tokens):
        steps = {name: [] for name in out}
        for layer in sorted(layers):
            n = layers[layer].experts
            if hot:
                mine = rng.choice(hot, worker, replace=False)
                theirs = hot + rng.choice(n - hot, copier, replace=False)
            else:
                mine, theirs = np.split(rng.choice(n, worker + copier, replace=False), [worker])
            steps["worker"].append((layer, mine.tolist()))
            steps["copier"].append((layer, theirs.tolist()))
        for name in out:
            out[name].append(steps[name])
    return out


def run_worker(cache: ExpertCache, steps: list, compute_s: float) -> None:
    for layer, ids in steps:
        with cache.held(layer, ids):
            time.sleep(compute_s)  # the compiled kernel lets the GIL go while it computes


def run_copier(cache: ExpertCache, steps: list, stage: torch.Tensor) -> None:
    """As ``runtime.hybrid.host_records``: the records copied out of the held slots into staging rows."""
    slab = torch.from_numpy(cache.slab)
    for layer, ids in steps:
        with cache.held(layer, ids) as (_, slots):
            torch.index_select(slab, 0, torch.tensor(slots), out=stage[: len(slots)])


def measure(path: Path, layers: dict, args: argparse.Namespace, who: tuple[str, ...]) -> dict:
    """Tokens of ``who`` (one or both requesters, each on its own thread) on a fresh cache."""
    used = args.worker + args.copier
    cache = ExpertCache(path, layers, max(args.slots, len(layers) * used + 1), used, "lru", "cpu",
                        drop_pages=args.drop_pages, read_threads=args.read_threads)  # fmt: skip
    cache.simulate = args.simulate
    if args.simulate:
        cache.slab.fill(0)  # no first touch of a slot's pages inside the timed copies
    stage = torch.empty((args.copier, cache.slot_bytes), dtype=torch.uint8)
    plan = routes(layers, args.warmup + args.tokens, args.worker, args.copier, args.hot, args.seed)
    busy = {name: 0.0 for name in who}  # each requester's own seconds in the timed tokens

    def timed(name: str, steps: list, t: int) -> None:
        t0 = time.perf_counter()
        if name == "worker":
            run_worker(cache, steps, args.compute_us * 1e-6)
        else:
            run_copier(cache, steps, stage)
        if t >= args.warmup:
            busy[name] += time.perf_counter() - t0

    # a long-lived thread per requester, as in a hybrid run (a new thread's first torch call makes it an
    # OpenMP team), its torch copies on it alone as the product's copier's
    pools = {name: ThreadPoolExecutor(1, initializer=omp_team.serial, initargs=(name,)) for name in who}
    if args.drop_pages:
        drop_cache(path)
    try:
        for name in who:
            pools[name].submit(torch.get_num_threads).result()
        for t in range(args.warmup + args.tokens):
            if t == args.warmup:
                cache.stats, t0 = CacheStats(), time.perf_counter()
            for job in [pools[name].submit(timed, name, plan[name][t], t) for name in who]:
                job.result()
        seconds = time.perf_counter() - t0
    finally:
        for pool in pools.values():
            pool.shutdown()
        cache.close()
    s = cache.stats
    return {"who": "+".join(who), "ms_per_token": round(seconds / args.tokens * 1e3, 3),
            **{f"{name}_ms_per_token": round(busy[name] / args.tokens * 1e3, 3) for name in who},
            "hit_rate": round(s.hit_rate, 3), "us_per_miss": round(seconds / max(s.misses, 1) * 1e6, 1),
            "mb_read_per_token": round(s.bytes_read / args.tokens / 1e6, 2)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("path", type=Path)
    ap.add_argument("--slots", type=int, default=600, help="experts the cache holds")
    ap.add_argument("--worker", type=int, default=6, help="experts the CPU side holds a layer")
    ap.add_argument("--copier", type=int, default=2, help="experts the copier takes a layer (0: none)")
    ap.add_argument("--compute-us", type=float, default=400.0, help="the CPU side's compute a layer")
    ap.add_argument("--hot", type=int, default=0, help="the worker's experts from a layer's first N (0: all)")
    ap.add_argument("--tokens", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=4, help="tokens before the timed ones")
    ap.add_argument("--read-threads", type=int, default=16, help="0: WILLNEED hints, then reads in turn")
    ap.add_argument("--drop-pages", action="store_true", help="every read from the device")
    ap.add_argument("--simulate", action="store_true", help="no reads: the bookkeeping alone")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    layers = expert_layers(args.path)
    if layers is None:
        return 1
    modes = [("worker",), ("copier",), ("worker", "copier")] if args.copier else [("worker",)]
    rows = [measure(args.path, layers, args, who) for who in modes]
    for r in rows:
        own = ", ".join(f"{k.split('_')[0]} {v:.2f}" for k, v in r.items() if k.endswith("_ms_per_token"))
        print(f"{r['who']:>13}: {r['ms_per_token']:8.2f} ms a token ({own}), hits {r['hit_rate']:.0%}, "
              f"{r['us_per_miss']:7.1f} us a miss, {r['mb_read_per_token']:6.1f} MB read a token")  # fmt: skip
    out = {"path": str(args.path), "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    if len(rows) == 3:
        out["overlap"] = round(
            (rows[0]["ms_per_token"] + rows[1]["ms_per_token"]) / rows[2]["ms_per_token"], 3
        )
        print(f"overlap (alone, summed, over both at once): {out['overlap']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
