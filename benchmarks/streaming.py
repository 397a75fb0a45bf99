"""SSD-streamed experts: hit rate, bytes read per token and decode tok/s at several cache budgets.

    python benchmarks/streaming.py --canonical /tmp/forge-streaming/q36.gguf [--v2 FILE] \\
        --budgets-gib 1,2,4,8 --policies lru,lfu --warmup 24 --tokens 32 \\
        --decode-budgets-gib 1,4 --decode-tokens 4 --json out.json

``--canonical`` is synthesized when absent (``runtime.synth``: Qwen3.6-35B-A3B geometry, Q4_K;
``--layers`` fewer layers: budgets are then scaled by layers/40, so the cache holds the same share of
the experts). ``--v2 FILE`` adds the expert-major layout (converted from the canonical file when
absent, which needs the disk space of a second copy).

Routing is a trace drawn up front (random weights route nearly every token to the same experts, which
would flatter any cache): ``--routing uniform`` draws each token's experts uniformly per layer (no
locality: the worst case for a cache), ``--routing zipf`` from a per-layer Zipf popularity
(``--zipf-s``; an assumed skew, not a measured one). The model's routers are overridden to follow the
trace, so a real decode step routes exactly as the trace says.

Per file:
1. The sequential read ceiling: a cold plain read of the whole file in 16 MiB chunks.
2. Cache runs, per (budget, policy): a fresh cache; the file is dropped from the page cache
   (posix_fadvise DONTNEED) and so is every range read afterwards, so each miss is a device read, as on
   a machine whose RAM cannot cache the file; ``--warmup`` tokens of the trace fill the cache (its
   bookkeeping only: no I/O, no data), then the next ``--tokens`` tokens are looked up (the reads a decode of them does, without the compute):
   hit rate, bytes read per token against the geometry minimum (experts per token x record bytes), read
   time per token.
3. Decode runs on the canonical file (``--decode-tokens`` real decode steps after a replayed warmup):
   first with every expert they touch cached (all hits: the resident compute time), then per
   ``--decode-budgets-gib``; checked against bytes read / read ceiling + resident compute time.
``--device cuda`` keeps the weights and the cache slab in GPU memory (reads staged through pinned host
memory).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runtime.experts import ExpertCache
from runtime.layers import rms_norm_row
from runtime.models import build_model
from runtime.planner import geometry
from runtime.synth import GEOMETRIES, synthesize
from runtime.weights import load_weights

FULL_LAYERS = GEOMETRIES["qwen3.6-35b-a3b"].layers


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def expert_layers(path: Path) -> dict | None:
    """The routed experts' layers of the file at ``path``; None, with one line on stderr, when there is no
    such file or it has none."""
    if not path.is_file():
        print(f"error: {path}: no such file", file=sys.stderr)
        return None
    layers = load_weights(path, verify_experts=False).expert_layers()
    if not layers:
        print(f"error: {path}: no routed expert tensors", file=sys.stderr)
        return None
    return layers


def read_ceiling(path: Path, chunk: int = 16 << 20) -> float:
    """Bytes/s of a cold plain sequential read of the whole file (pages dropped as they are read)."""
    drop_cache(path)
    fd = os.open(path, os.O_RDONLY)
    t0, n = time.perf_counter(), 0
    try:
        while data := os.pread(fd, chunk, n):
            os.posix_fadvise(fd, n, len(data), os.POSIX_FADV_DONTNEED)
            n += len(data)
    finally:
        os.close(fd)
    return n / (time.perf_counter() - t0)


Trace = list[list[np.ndarray]]  # trace[step][layer position] = the step's distinct expert ids


def routing_trace(
    kind: str, steps: int, layers: int, experts: int, used: int, zipf_s: float, seed: int
) -> Trace:
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        p = [None] * layers
    else:
        ranks = np.arange(1, experts + 1, dtype=np.float64) ** -zipf_s
        p = [ranks[rng.permutation(experts)] / ranks.sum() for _ in range(layers)]
    return [
        [np.sort(rng.choice(experts, used, replace=False, p=p[i])) for i in range(layers)]
        for _ in range(steps)
    ]


class CacheRunner:
    """Cache runs over one file: the lookups and reads of the trace's tokens, without the compute."""

    def __init__(self, path: Path, device: str) -> None:
        w = load_weights(path, verify_experts=False)
        self.path, self.device = path, device
        self.layers = w.expert_layers()
        self.order = sorted(self.layers)
        self.used = int(w.hparam("expert_used_count"))

    def new_cache(self, capacity: int, policy: str) -> ExpertCache:
        cache = ExpertCache(self.path, self.layers, capacity, self.used, policy, self.device, drop_pages=True)
        # fault the slab in now: a warmup without I/O leaves it untouched, and first-touch page faults
        # would otherwise be timed as read time
        cache._slab_t.zero_()
        return cache

    def replay(self, cache: ExpertCache, steps: Trace, read: bool = True) -> None:
        """Look up the steps' experts; ``read=False`` fills only the bookkeeping (warmup without I/O)."""
        cache.simulate = not read
        for step in steps:
            for layer, ids in zip(self.order, step, strict=True):
                cache.rows(layer, ids.tolist())
        cache.simulate = False

    def run(self, capacity: int, policy: str, warm: Trace, timed: Trace) -> dict:
        cache = self.new_cache(capacity, policy)
        drop_cache(self.path)
        self.replay(cache, warm, read=False)
        before = copy.copy(cache.stats)
        t0 = time.perf_counter()
        self.replay(cache, timed)
        r = summary(cache, before, len(timed), time.perf_counter() - t0)
        cache.close()
        return r


def summary(cache: ExpertCache, before: Any, n: int, seconds: float) -> dict:
    s = cache.stats
    keys = ("lookups", "hits", "misses", "reads", "bytes_read", "read_seconds", "wait_seconds",
            "prefetch_issued", "prefetch_used", "prefetch_wasted")  # fmt: skip
    d = {k: getattr(s, k) - getattr(before, k) for k in keys}
    return d | {
        "capacity": cache.capacity, "policy": cache.policy.name, "s_per_token": seconds / n,
        "hit_rate": d["hits"] / d["lookups"] if d["lookups"] else 0.0, "bytes_per_token": d["bytes_read"] / n,
        "read_s_per_token": d["read_seconds"] / n,
    }  # fmt: skip


class TraceRouter:
    """Stands in for a layer's gate projection (batch and one-token calls): logits that pick the trace's
    experts. No compiled rows, so the one-token path asks ``normed_input_step``."""

    rows = None

    def __init__(self, runner: DecodeRunner, pos: int, n_expert: int, weight: torch.Tensor) -> None:
        self.runner, self.pos, self.n_out, self.weight = runner, pos, n_expert, weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(x.shape[0], self.n_out, device=x.device)
        logits[:, torch.from_numpy(self.runner.trace[self.runner.step][self.pos]).to(x.device)] = 1.0
        return logits

    step = __call__

    def normed_input_step(
        self, h: torch.Tensor, norm: torch.Tensor, eps: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = rms_norm_row(h, norm, eps)
        return x, self(x)


class DecodeRunner(CacheRunner):
    """Real decode steps whose routers follow the trace."""

    def __init__(self, path: Path, device: str, trace: Trace) -> None:
        super().__init__(path, device)
        self.w = load_weights(path, device, verify_experts=False)
        self.cache = self.new_cache(len(self.layers) * self.used + 1, "lru")
        self.w.expert_cache = self.cache
        self.trace, self.step = trace, 0
        self._build()

    def _build(self) -> None:
        """The model over the current expert cache, its routers following the trace."""
        self.m = build_model(self.w)
        for pos, layer in enumerate(self.order):
            moe = self.m.blocks[layer].moe
            moe.router.proj = TraceRouter(self, pos, moe.router.n_expert, moe.router.proj.weight)

    def decode(self, capacity: int, policy: str, warm: range, timed: range, all_hits: bool = False) -> dict:
        self.cache.close()
        self.cache = self.w.expert_cache = self.new_cache(capacity, policy)
        self._build()
        drop_cache(self.path)
        self.replay(self.cache, [self.trace[i] for i in warm], read=all_hits)
        before = copy.copy(self.cache.stats)
        st = self.m.new_state(len(timed) + 1)
        t0 = time.perf_counter()
        for self.step in timed:
            self.m.forward(torch.tensor([self.step % 1000], device=self.w.device), st)
        if self.device == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        return summary(self.cache, before, len(timed), dt)


def prefetch_check(path: Path, tokens: int, capacity: int, device: str) -> list[dict]:
    """Decode with the model's own routing, prefetch off then on: s/token, misses and prefetch counters.

    The cache starts empty each time and every read is dropped from the page cache (as in the cache runs).
    """
    from runtime.prefetch import attach_prefetcher

    out = []
    for prefetch in (False, True):
        w = load_weights(path, device, verify_experts=False)
        w.expert_cache = ExpertCache(path, w.expert_layers(), capacity, int(w.hparam("expert_used_count")),
                                     "lru", device, drop_pages=True)  # fmt: skip
        m = build_model(w)
        pre = attach_prefetcher(m) if prefetch else None
        ids = torch.randint(0, m.vocab_size, (tokens + 1,), generator=torch.Generator().manual_seed(0))
        st = m.new_state(tokens + 2)
        drop_cache(path)
        m.forward(ids[:1].to(w.device), st)  # first token: fills the cache with what routing starts with
        before = copy.copy(w.expert_cache.stats)
        t0 = time.perf_counter()
        for t in ids[1:]:
            m.forward(t[None].to(w.device), st)
        if device == "cuda":
            torch.cuda.synchronize()
        r = summary(w.expert_cache, before, tokens, time.perf_counter() - t0) | {"prefetch": prefetch}
        if pre is not None:
            pre.close()
            r["predicted"] = pre.predicted
        print(f"  prefetch {'on ' if prefetch else 'off'}: {r['s_per_token']:.3f} s/token, hit {r['hit_rate']:.1%}, "
              f"{r['misses']} misses, {r['bytes_per_token'] / 1e6:.1f} MB/token, read {r['read_s_per_token']:.3f} "
              f"s/token, waited {r['wait_seconds']:.3f} s; read ahead {r['prefetch_issued']}, used "
              f"{r['prefetch_used']}, wasted {r['prefetch_wasted']}", flush=True)  # fmt: skip
        out.append(r)
        w.expert_cache.close()
    return out


def _line(r: dict, minimum: int) -> str:
    return (f"{r['capacity']:>5} experts {r['policy']}: hit {r['hit_rate']:6.1%}, {r['bytes_per_token'] / 1e6:6.1f} MB/token "
            f"({r['bytes_per_token'] / minimum:5.1%} of minimum), read {r['read_s_per_token']:.3f} s/token")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--canonical", type=Path, default=Path("/tmp/forge-streaming/q36.gguf"))
    ap.add_argument("--v2", type=Path, default=None, help="expert-major file (converted when absent)")
    ap.add_argument("--layers", type=int, default=None, help="synthesize fewer layers than 40")
    ap.add_argument("--vocab", type=int, default=None, help="synthesize a smaller vocabulary")
    ap.add_argument("--warmup", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--budgets-gib", default="1,2,4,8")
    ap.add_argument("--policies", default="lru,lfu")
    ap.add_argument("--routing", choices=["uniform", "zipf"], default="uniform")
    ap.add_argument("--zipf-s", type=float, default=1.0)
    ap.add_argument("--decode-budgets-gib", default="1,4")
    ap.add_argument("--decode-policies", default="lru")
    ap.add_argument("--decode-tokens", type=int, default=4, help="0: no decode runs")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--prefetch-check",
        type=Path,
        default=None,
        help="only compare decode with and without --prefetch on this file (the model's routing)",
    )
    ap.add_argument("--prefetch-capacity", type=int, default=0, help="cache experts for it (default: floor)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.prefetch_check is not None:
        w = load_weights(args.prefetch_check, verify_experts=False)
        floor = len(w.expert_layers()) * int(w.hparam("expert_used_count")) + 1
        print(f"prefetch check on {args.prefetch_check}: {args.tokens} tokens, load {os.getloadavg()[0]:.1f}")
        r = prefetch_check(args.prefetch_check, args.tokens, args.prefetch_capacity or floor, args.device)
        if args.json:
            args.json.write_text(json.dumps(r, indent=1))
        return
    if not args.canonical.exists():
        args.canonical.parent.mkdir(parents=True, exist_ok=True)
        synthesize(args.canonical, "qwen3.6-35b-a3b", "q4_k", args.layers, args.vocab)
    files = [("canonical", args.canonical)]
    if args.v2 is not None:
        if not args.v2.exists():
            from forge.layout import convert

            convert(args.canonical, args.v2, "v2")
        files.append(("v2", args.v2))
    w = load_weights(args.canonical, verify_experts=False)
    g = geometry(w, 64)
    n_expert = int(w.hparam("expert_count"))
    del w
    minimum = g.routed_layers * g.experts_used * g.slot_bytes
    steps = args.warmup + max(args.tokens, args.decode_tokens)
    trace = routing_trace(args.routing, steps, g.routed_layers, n_expert, g.experts_used, args.zipf_s, 0)
    warm, timed = trace[: args.warmup], trace[args.warmup : args.warmup + args.tokens]
    scale = g.routed_layers / GEOMETRIES["qwen3.6-35b-a3b"].layers
    capacity = {gib: max(g.floor, int(gib * (1 << 30) * scale) // g.slot_bytes) for gib in
                {float(x) for x in (args.budgets_gib + "," + args.decode_budgets_gib).split(",") if x}}  # fmt: skip
    results: dict[str, Any] = {
        "args": {k: str(v) for k, v in vars(args).items()}, "layers": g.routed_layers, "record_bytes": g.slot_bytes,
        "min_bytes_per_token": minimum, "loadavg": os.getloadavg(), "files": {}, "cache_runs": [], "decode_runs": [],
    }  # fmt: skip
    print(f"{g.routed_layers} layers x {n_expert} experts, top {g.experts_used}, record {g.slot_bytes:,} B; "
          f"no-cache minimum {minimum / 1e6:.1f} MB/token; routing {args.routing}; {args.warmup} warmup + "
          f"{args.tokens} measured tokens; load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    for layout, path in files:
        ceiling = read_ceiling(path)
        results["files"][layout] = {
            "path": str(path),
            "bytes": path.stat().st_size,
            "read_ceiling_mb_s": ceiling / 1e6,
        }
        print(
            f"{layout}: {path.stat().st_size / 1e9:.2f} GB, sequential read ceiling {ceiling / 1e6:,.0f} MB/s",
            flush=True,
        )
        runner = CacheRunner(path, args.device)
        for gib in (float(x) for x in args.budgets_gib.split(",")):
            for policy in args.policies.split(","):
                r = runner.run(capacity[gib], policy, warm, timed)
                r |= {
                    "layout": layout,
                    "budget_gib": gib,
                    "io_mb_s": r["bytes_per_token"] / r["read_s_per_token"] / 1e6
                    if r["read_s_per_token"]
                    else 0.0,
                }
                results["cache_runs"].append(r)
                print(f"  {gib:>4} GiB " + _line(r, minimum) + f" ({r['io_mb_s']:,.0f} MB/s)", flush=True)
    if args.decode_tokens:
        ceiling = results["files"]["canonical"]["read_ceiling_mb_s"] * 1e6
        t0 = time.perf_counter()
        d = DecodeRunner(args.canonical, args.device, trace)
        print(
            f"decode runs (canonical, {args.decode_tokens} tokens; model loaded in {time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
        span = range(args.warmup, args.warmup + args.decode_tokens)
        touched = sum(len(trace[i][j]) for i in span for j in range(g.routed_layers))
        r = d.decode(max(g.floor, touched + 1), "lru", span, span, all_hits=True)
        compute = r["s_per_token"]
        results["compute_s_per_token"] = compute
        print(
            f"  resident compute (all hits: {r['hit_rate']:.0%}): {compute:.3f} s/token, {1 / compute:.3f} tok/s",
            flush=True,
        )
        for gib in (float(x) for x in args.decode_budgets_gib.split(",") if x):
            for policy in args.decode_policies.split(","):
                r = d.decode(capacity[gib], policy, range(args.warmup), span)
                model_s = r["bytes_per_token"] / ceiling + compute
                r |= {"budget_gib": gib, "tok_s": 1 / r["s_per_token"], "model_s_per_token": model_s,
                      "within_2x": r["s_per_token"] <= 2 * model_s}  # fmt: skip
                results["decode_runs"].append(r)
                print(f"  {gib:>4} GiB " + _line(r, minimum) + f"; {r['tok_s']:.3f} tok/s, {r['s_per_token']:.2f} s/token "
                      f"vs bytes/ceiling + compute {model_s:.2f} ({'within' if r['within_2x'] else 'NOT within'} 2x)", flush=True)  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
