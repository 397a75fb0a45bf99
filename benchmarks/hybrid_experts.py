"""Hybrid routed experts (``--gpu-expert-cache``) against resident GPU, SSD streaming and llama.cpp's modes.

    python benchmarks/hybrid_experts.py FILE.gguf [--caches-gib 1,4,8] [--stream-gib 4]
        [--routing trace,uniform,file] [--trace-model DIR|GGUF] [--text FILE] [--trace-tokens 2048]
        [--pp 512] [--tg 64] [--reps 2] [--warmup 64] [--warmup-prefills 2] [--threads N] [--profile PROFILE.json]
        [--llama-bench PATH] [--cold] [--host-cache-gib G] [--read-threads 4] [--read-chunk-kb 0] [--rows resident,hybrid,streaming,llama]
        [--layers N] [--json OUT] [--cprofile DIR]

FILE is e.g. the Qwen3.6-35B-A3B-geometry Q4_K file; when absent it is written
(``runtime.synth``, ``--layers`` fewer layers). Per row, decode (tg: ``--tg`` one-token steps from an
empty context) and prefill (pp: one forward pass of ``--pp`` tokens) tokens/s, the best of ``--reps``:

- ``resident GPU``: the whole file on the GPU (cuda kernels, CUDA graphs); skipped when it does not fit.
  It keeps the file's routers (its cost does not depend on which experts are chosen).
- ``hybrid N GiB``: ``runtime.hybrid`` with an N GiB GPU expert pool (``--profile``: seeded from a
  ``forge prune profile`` JSON); before timing, one prefill and ``--warmup`` decode steps of the routing
  let the pool learn the hot experts. Notes: GPU hit rate, CPU-computed experts per token, MB uploaded.
- ``SSD streaming``: ``--ssd-streaming --cache-bytes`` ``--stream-gib`` (the expert cache on the device,
  misses read from the file and computed there).
- ``llama.cpp -ot exps=CPU`` and ``llama.cpp all on GPU`` (with ``--llama-bench``): ``llama-bench -ngl 99
  [-ot exps=CPU] -t THREADS -p PP -n TG -r REPS``; llama.cpp routes by the file's own routers.

Routing (the forge rows other than resident GPU, per ``--routing``): the routers are overridden so that the
i-th token of the run takes the experts of row i of a routing table. ``uniform``: k distinct experts per token
and layer, uniformly (no locality: the worst case for a cache). ``trace``: what a trained router chose
(``routing_locality.record``: ``--trace-model``, default the bundled tiny-qwen3moe, over ``--text``), scaled
to the file's geometry: file layer l replays trace layer l mod L, and each of a token's k_t chosen experts e
becomes k / k_t distinct experts drawn from the block of E / E_t experts that e stands for (a per-layer
permutation scatters the blocks), so the popularity of experts and its drift along the text are the trained
router's. A synthesized file's own routers are random: they choose with no locality to learn
(before 2026-12-02 they sent nearly every token to the same experts). ``file``: those routers, as llama.cpp
routes (llama.cpp copies only the experts a batch activates, so its prefill depends on how many that is).

``FORGE_Q8_ACTIVATIONS=1`` gives the hybrid rows' CPU side 8-bit activations (``--q8-activations``).

Without CUDA the GPU rows are skipped with a note and the forge rows run on the CPU (``CPU, mapped file``:
every expert computed by the CPU kernels from the mapped file; ``SSD streaming``). ``--cold`` drops the file
from the page cache before each timed run (as on a machine whose RAM cannot hold it); otherwise the file
is read once first so that it is in the page cache. Each row is run on its own: a failure is reported in
its row and the next row runs.
"""

from __future__ import annotations

import argparse
import collections
import copy
import cProfile
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from routing_locality import FIXTURES, record  # noqa: E402
from runtime_speed import run_llama_bench  # noqa: E402
from streaming import drop_cache, read_ceiling  # noqa: E402

from runtime import cpu_kernels, hybrid  # noqa: E402
from runtime.backends import triton_launch  # noqa: E402
from runtime.experts import READ_CHUNK, CacheStats, ExpertCache  # noqa: E402
from runtime.layers import rms_norm_row  # noqa: E402
from runtime.models import build_model  # noqa: E402
from runtime.observers import notify_matmul  # noqa: E402
from runtime.planner import geometry  # noqa: E402
from runtime.prefetch import attach_prefetcher  # noqa: E402
from runtime.weights import load_weights  # noqa: E402

GIB = 1 << 30


# routing tables ------------------------------------------------------------------------------------------
def uniform_table(layers: int, n: int, experts: int, k: int, seed: int = 0) -> list[np.ndarray]:
    """Per layer (n, k): k distinct experts per token, uniformly."""
    rng = np.random.default_rng(seed)
    return [np.argsort(rng.random((n, experts), dtype=np.float32), axis=1)[:, :k] for _ in range(layers)]


def scaled_trace(trace: dict[int, np.ndarray], trace_experts: int, layers: int, experts: int, k: int,
                 seed: int = 0, guesses: dict[int, np.ndarray] | None = None,
                 ) -> tuple[list[np.ndarray], list[np.ndarray | None]]:  # fmt: skip
    """A trained router's trace (per layer (n, k_t) over ``trace_experts``) as a table of the file's geometry
    (see the module's docstring), and its ``guesses`` (per trace layer after the first, ``record``'s) as
    the guess tables of the file's layers that replay such a layer (None for the others: their layer before
    replays no trace layer before theirs). A guessed trace expert that was chosen stands for the same
    experts of the file as the choice; another for experts drawn as a choice's are."""
    rows, names = list(trace.values()), list(trace)
    n, kt = rows[0].shape
    if experts % trace_experts or k % kt or k // kt > experts // trace_experts:
        raise SystemExit(
            f"a trace of {trace_experts} experts (top {kt}) does not scale to {experts} experts (top {k})"
        )
    block, per = experts // trace_experts, k // kt
    rng, other = np.random.default_rng(seed), np.random.default_rng(seed + 1)
    out, guessed = [], []
    for layer in range(layers):
        t = rows[layer % len(rows)]
        sub = np.argsort(rng.random((n, kt, block), dtype=np.float32), axis=-1)[..., :per]
        perm = rng.permutation(experts)
        out.append(perm[(t[..., None] * block + sub).reshape(n, kt * per)])
        g = (guesses or {}).get(names[layer % len(rows)]) if layer else None
        if g is None:
            guessed.append(None)
            continue
        same = g[:, :, None] == t[:, None, :]
        g_sub = np.where(
            same.any(-1)[..., None],
            sub[np.arange(n)[:, None], same.argmax(-1)],
            np.argsort(other.random((n, kt, block), dtype=np.float32), axis=-1)[..., :per],
        )
        guessed.append(perm[(g[..., None] * block + g_sub).reshape(n, kt * per)])
    return out, guessed


class Routing:
    """A routing table and the position of the next token in it (wrapping around), kept on the device of
    the model it routes (so that a captured decode step reads the position from there); ``guesses``: per
    routed layer the trained router's guesses of it (``scaled_trace``), or None. ``guessing``: a read ahead
    takes them (``TableGuess``), so a decode step ends before the position moves on."""

    def __init__(self, table: list[np.ndarray], guesses: list[np.ndarray | None] | None = None) -> None:
        self.table, self.cursor, self.guesses, self.guessing = table, 0, guesses, False
        self.on: dict[torch.device, tuple[list[torch.Tensor], torch.Tensor]] = {}

    def advance(self, n: int) -> None:
        self.cursor += n
        for _, at in self.on.values():
            at.fill_(self.cursor)

    def ids(self, pos: int, n: int, device: torch.device) -> torch.Tensor:
        if device not in self.on:
            with torch.inference_mode(False):  # ``advance`` updates the position outside the forward pass
                tables = [torch.from_numpy(t).to(device) for t in self.table]
                self.on[device] = tables, torch.full((), self.cursor, dtype=torch.int64, device=device)
        tables, at = self.on[device]
        t = tables[pos]
        return t[(at + torch.arange(n, device=device)) % t.shape[0]]


class TableRouter:
    """Stands in for a layer's gate projection: logits that pick the table's experts for each token of the
    call (batch, one-token and normed one-token calls). No compiled rows."""

    rows = None

    def __init__(self, routing: Routing, pos: int, n_expert: int, proj: Any) -> None:
        self.routing, self.pos, self.n_out, self.weight = routing, pos, n_expert, proj.weight
        self.name, self.observers = proj.name, proj.observers  # its input reported as the projection's

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.observers:
            notify_matmul(self.observers, self.name, x)
        ids = self.routing.ids(self.pos, x.shape[0], x.device)
        return torch.zeros(x.shape[0], self.n_out, device=x.device).scatter_(1, ids, 1.0)

    step = __call__

    def normed_input_step(self, h: torch.Tensor, norm: torch.Tensor, eps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        x = rms_norm_row(h, norm, eps)
        return x, self(x)


class TableGuess:
    """``--prefetch``'s guess from a routing's guess tables, in place of ``router`` (the
    ``runtime.prefetch.RouterGuess`` it stands in for, whose product is still computed: its time is the
    guess's): the guess of the layer after ``layer`` for the token being decoded (None where the table has
    none)."""

    def __init__(self, routing: Routing, layers: list[int], router: Any) -> None:
        self.routing, self.router = routing, router
        self.next_layer = dict(zip(layers, layers[1:], strict=False))
        self.pos = {layer: i for i, layer in enumerate(layers)}  # a layer's row of the tables
        routing.guessing = True

    def __call__(self, layer: int, x: torch.Tensor) -> tuple[int, list[int]] | None:
        self.router(layer, x)
        nxt = self.next_layer.get(layer)
        guesses = self.routing.guesses
        table = None if nxt is None or guesses is None else guesses[self.pos[nxt]]
        return None if table is None else (nxt, table[self.routing.cursor % len(table)].tolist())


def read_ahead(model: Any, routing: Routing | None) -> str:
    """``--prefetch`` on ``model`` (hybrid or streaming) with the guesses of ``routing`` (the file's own
    routers: their guess; a table: its guess tables; none for uniform routing); what was done."""
    if routing is not None and routing.guesses is None:
        return "no read ahead: no guesses for this routing (only a trained router's are replayed)"
    ra = attach_prefetcher(model)
    if ra is None:
        return "no read ahead: no expert cache"
    if routing is not None:
        ra.guess = TableGuess(routing, sorted(model.routed_layers()), ra.guess)
    return "the next layer's guessed experts read ahead"


def cache_figures(c0: CacheStats, c1: CacheStats, tokens: int, record_bytes: int) -> dict:
    """An expert cache's decode between two snapshots, per decoded token: its hit rate; the model's own read
    time and waits for reads ahead; the read rate (all reads, ahead too); the MB of the experts the decode
    found uncached (its misses and the read ahead's used: what it reads without a read ahead; at
    ``record_bytes`` each) against all MB read; experts read ahead, used and evicted unused."""
    reads = c1.read_seconds - c0.read_seconds
    all_reads = reads + c1.prefetch_seconds - c0.prefetch_seconds
    needed = c1.misses - c0.misses + c1.prefetch_used - c0.prefetch_used
    return {
        "hit_rate": round((c1.hits - c0.hits) / max(c1.lookups - c0.lookups, 1), 4),
        "read_ms_per_token": round(reads / tokens * 1e3, 2),
        "wait_ms_per_token": round((c1.wait_seconds - c0.wait_seconds) / tokens * 1e3, 2),
        "read_gb_s": round((c1.bytes_read - c0.bytes_read) / all_reads / 1e9, 3) if all_reads else None,
        "needed_mb_per_token": round(needed * record_bytes / tokens / 1e6, 2),
        "read_mb_per_token": round((c1.bytes_read - c0.bytes_read) / tokens / 1e6, 2),
        "read_ahead_per_token": round((c1.prefetch_issued - c0.prefetch_issued) / tokens, 2),
        "used_per_token": round((c1.prefetch_used - c0.prefetch_used) / tokens, 2),
        "wasted_per_token": round((c1.prefetch_wasted - c0.prefetch_wasted) / tokens, 2),
    }


def _routing(
    table: list[np.ndarray] | None, guesses: list[np.ndarray | None] | None = None
) -> Routing | None:
    return None if table is None else Routing(table, guesses)


def route_by(model: Any, routing: Routing | None) -> None:
    """The model's routers replaced by ``routing``'s table (None: the file's own routers kept)."""
    if routing is None:
        return
    for pos, layer in enumerate(model.routed_layers()):
        r = model.blocks[layer].moe.router
        r.proj = TableRouter(routing, pos, r.n_expert, r.proj)


# timing --------------------------------------------------------------------------------------------------
def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(model: Any, routing: Routing | None, device: str, args: argparse.Namespace, path: Path,
          bytes_read: Any = None, before_tg: Any = None) -> dict:  # fmt: skip
    """Warm up (one prefill, ``--warmup`` decode steps), then the best pp and tg of ``--reps`` runs;
    ``bytes_read``: a counter of file bytes read, reported per decoded token; ``before_tg()`` is called
    between the timed prefills and the timed decode runs."""
    gen = torch.Generator().manual_seed(0)
    toks = torch.randint(0, model.vocab_size, (max(args.pp, args.tg, args.warmup) + 1,), generator=gen).to(
        device
    )

    def advance(n: int) -> None:
        if routing is not None:
            if routing.guessing:  # the worker reads the decode step's guesses at the position: not past it
                _sync(device)
            routing.advance(n)

    # prefills first: each new (pair count) specialization of a Triton kernel compiles on first use (seconds
    # for the GEMM), and a hybrid layer's pair counts vary from batch to batch
    for _ in range(args.warmup_prefills):
        model.forward(toks[: args.pp], model.new_state(args.pp + 1), last_only=True)
        advance(args.pp)
    st = model.new_state(args.pp + args.warmup + 2)
    model.forward(toks[: args.pp], st, last_only=True)
    advance(args.pp)
    for i in range(args.warmup):
        model.forward(toks[i : i + 1], st, last_only=True)
        advance(1)

    def best_rate(tokens: int, run: Any) -> float:
        """The best tokens/s of ``--reps`` runs of ``run(state)`` on fresh states (page cache dropped first
        with ``--cold``)."""
        rate = 0.0
        for _ in range(args.reps):
            st = model.new_state(tokens + 1)
            if args.cold:
                drop_cache(path)
            _sync(device)
            t0 = time.perf_counter()
            run(st)
            _sync(device)
            rate = max(rate, tokens / (time.perf_counter() - t0))
        return rate

    def prefill(st: Any) -> None:
        model.forward(toks[: args.pp], st, last_only=True)
        advance(args.pp)

    def decode(st: Any) -> None:
        for i in range(args.tg):
            model.forward(toks[i : i + 1], st, last_only=True)
            advance(1)

    compiled0 = triton_launch.compiled_count()
    best_pp = profiled(args, "pp", lambda: best_rate(args.pp, prefill))
    read0 = bytes_read() if bytes_read else 0
    if before_tg is not None:
        before_tg()
    best_tg = profiled(args, "tg", lambda: best_rate(args.tg, decode))
    # kernel specializations first seen in the timed runs (each compiled there: seconds for a GEMM)
    out = {
        "pp": round(best_pp, 1),
        "tg": round(best_tg, 1),
        "compiles": triton_launch.compiled_count() - compiled0,
    }
    if bytes_read:
        out["tg_bytes_read_per_token"] = round((bytes_read() - read0) / (args.reps * args.tg))
    return out


def profiled(args: argparse.Namespace, phase: str, run: Any) -> Any:
    """``run()``, under cProfile with ``--cprofile DIR`` (its statistics written to DIR/PHASE-N.pstats)."""
    if args.cprofile is None:
        return run()
    args.cprofile.mkdir(parents=True, exist_ok=True)
    prof = cProfile.Profile()
    try:
        return prof.runcall(run)
    finally:
        n = len(list(args.cprofile.glob(f"{phase}-*.pstats")))
        prof.dump_stats(args.cprofile / f"{phase}-{n}.pstats")


def thread_cpu() -> dict[int, tuple[str, float]]:
    """Each thread of the process: its name and CPU seconds so far (user and system)."""
    out, tick = {}, os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = (Path("/proc/self/task") / tid / "stat").read_text()
        except OSError:  # the thread ended
            continue
        name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        out[int(tid)] = (name, (int(rest[11]) + int(rest[12])) / tick)
    return out


# rows ----------------------------------------------------------------------------------------------------
def _free(*objs: Any) -> None:
    for o in objs:
        h = getattr(o, "hybrid", None)
        if h is not None:
            h.close()
        cache = getattr(getattr(o, "weights", None), "expert_cache", None)
        if cache is not None:
            cache.close()
    del objs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def row_resident(path: Path, device: str, args: argparse.Namespace) -> dict:
    from runtime.models import load_model

    model = load_model(path, device, expert_budget=0, verify_experts=False)
    try:
        return timed(model, None, device, args, path)
    finally:
        _free(model)


def row_hybrid(
    path: Path, gib: float, routing: Routing | None, args: argparse.Namespace, host_gib: float = 0,
    prefetch: bool = False,
) -> dict:  # fmt: skip
    """``host_gib``: the CPU side's experts streamed from the file through a host expert cache of that size,
    every range read dropped from the page cache again (each miss a disk read); ``prefetch``: with the
    next layer's guessed experts read ahead into it (``read_ahead``)."""
    w = load_weights(path, "cuda", 0, verify_experts=False)
    w.host_experts = True
    counter = None
    if host_gib:
        layers, used = w.expert_layers(), int(w.hparam("expert_used_count"))
        slot = max(lay.record_bytes for lay in layers.values())
        n = max(len(layers) * used + 1, int(host_gib * GIB) // slot)
        w.expert_cache = ExpertCache(
            path, layers, n, used, "lfu", "cpu", drop_pages=True, read_threads=args.read_threads,
            read_chunk=args.read_chunk_kb << 10,
        )  # fmt: skip
        counter = lambda: w.expert_cache.stats.bytes_read  # noqa: E731
        drop_cache(path)
    model = build_model(w)
    route_by(model, routing)
    h = hybrid.attach(model, int(gib * GIB), args.profile)
    h.admit_per_call = args.admit_per_call
    ahead = read_ahead(model, routing) if prefetch else None
    try:
        warm: list[hybrid.HybridStats] = []
        host_warm: list[CacheStats] = []  # the host cache's figures when the timed decode began
        cpu0: dict = {}

        def before_tg() -> None:
            warm.append(h.stats.snapshot())
            cpu0.update(thread_cpu())
            if host_gib:
                host_warm.append(copy.copy(w.expert_cache.stats))

        r = timed(model, routing, "cuda", args, path, counter, before_tg)
        cpu1 = thread_cpu()
        # the CPU seconds each group of threads (by name) spent in the timed decode runs
        by_name = collections.Counter()
        for tid, (name, secs) in cpu1.items():
            by_name[name] += secs - cpu0.get(tid, (name, 0.0))[1]
        r["decode_cpu_s_by_thread"] = {n: round(v, 2) for n, v in by_name.most_common()}
        s = h.stats
        # the decode breakdown of the timed steps alone: the warm-up's first steps capture the CUDA graphs
        # (and may compile kernels), which counted as the device's part
        t = s.since(warm[0])
        tokens = (args.warmup_prefills + 1) * args.pp + args.warmup + args.reps * (args.pp + args.tg)
        layers = len(model.routed_layers())
        r |= {"pool_experts": h.capacity, "hit_rate": round(s.hit_rate, 4),
              "cpu_experts_per_token_layer": round(s.cpu_computes / tokens / layers, 3),
              "mb_uploaded": round(s.bytes_uploaded / 1e6, 1), "mb_read_cpu": round(s.bytes_read / 1e6, 1),
              "admissions": s.admissions, "pinned_gb": round(h.pinned.nbytes / 1e9, 2) if h.pinned else 0,
              "pin_seconds": round(h.pinned.seconds, 2) if h.pinned else 0, "rates": vars(h.rates) if hasattr(h.rates, "__dict__") else str(h.rates),
              "stats": s.to_json()}  # fmt: skip
        by_misses = _cpu_by_misses(t)
        # the host cache in the timed decode: its hits, and its reads' time and rate (summed over the two
        # requesters, the CPU side and the copier, whose reads may overlap: the rate is a request's)
        if host_gib:
            c0, c1, n = host_warm[0], w.expert_cache.stats, args.reps * args.tg
            r["host_cache_decode"] = cache_figures(c0, c1, n, w.expert_cache.slot_bytes)
            r["read_ahead"] = ahead
        us = 1e6 / max(t.step_layers, 1)
        r |= {"decode_hit_rate": round(t.step_hit_rate, 4),
              "decode_layer_us": {"device": round(t.step_device_seconds * us, 1),
                                  "cpu_kernel": round(t.step_cpu_seconds * us, 1),
                                  "host_between_steps": round(t.step_host_seconds * us, 1),
                                  "whole": round(1e6 / r["tg"] / layers, 1) if r.get("tg") else None},
              "decode_cpu_kernel_us_by_misses": by_misses}  # fmt: skip
        # the process's threads by name: an OpenMP team's threads take the name of the thread that made it
        # (``hybrid-cpu``: the worker's; the model thread's and the copier's should be gone)
        r["threads_by_name"] = dict(collections.Counter(name for name, _ in cpu1.values()).most_common())
        r["note"] = (
            f"pool {h.capacity} experts, GPU hits {s.hit_rate:.0%} (decode {r['decode_hit_rate']:.0%}), "
            f"{s.bytes_uploaded / 1e6:,.0f} MB uploaded; a decode layer {r['decode_layer_us']['whole']} us: "
            f"device {r['decode_layer_us']['device']}, CPU kernel {r['decode_layer_us']['cpu_kernel']}, host "
            f"between steps {r['decode_layer_us']['host_between_steps']} ({t.step_admissions} admissions); "
            f"threads {r['threads_by_name']}, their CPU seconds in the timed decode {r['decode_cpu_s_by_thread']}"
        )
        if "fixed_us" in by_misses:
            r["note"] += (
                f"; a CPU call {by_misses['fixed_us']} us + {by_misses['per_expert_us']} us per missed expert"
            )
        return r
    finally:
        _free(model)


def _cpu_by_misses(s: hybrid.HybridStats) -> dict:
    """Decode steps' CPU kernel calls by missed experts (``s``: the timed steps' counts): per count m, the calls
    and their mean microseconds, and a least-squares line through those means (weighted by calls): a call's
    fixed cost and the cost of each missed expert."""
    calls = np.array(s.step_cpu_calls, float)
    secs = np.array(s.step_cpu_seconds_by_misses, float)
    m = np.flatnonzero(calls > 0)
    out: dict = {"calls": {int(i): int(calls[i]) for i in m}, "mean_us": {int(i): round(float(secs[i] / calls[i]) * 1e6, 1) for i in m}}  # fmt: skip
    if m.size >= 2:
        slope, fixed = np.polyfit(m, secs[m] / calls[m] * 1e6, 1, w=np.sqrt(calls[m]))
        out |= {"fixed_us": round(float(fixed), 1), "per_expert_us": round(float(slope), 1)}
    return out


def row_streaming(
    path: Path, device: str, gib: float, routing: Routing | None, args: argparse.Namespace,
    prefetch: bool = False,
) -> dict:  # fmt: skip
    """``--drop-pages``: every range the cache reads is dropped from the page cache again (each miss a disk
    read); ``prefetch``: the next layer's guessed experts read ahead (``read_ahead``)."""
    w0 = load_weights(path, verify_experts=False)
    g = geometry(w0)
    capacity = min(max(g.floor, int(gib * GIB) // g.slot_bytes), g.experts)
    del w0
    w = load_weights(path, device, 0, stream_experts=capacity, verify_experts=False)
    cache = w.expert_cache
    assert cache is not None
    cache.drop_pages, cache.read_threads = args.drop_pages, args.read_threads
    if args.drop_pages:
        drop_cache(path)
    model = build_model(w)
    route_by(model, routing)
    ahead = read_ahead(model, routing) if prefetch else None
    stats: list[CacheStats] = []
    try:
        r = timed(model, routing, device, args, path, lambda: cache.stats.bytes_read,
                  lambda: stats.append(copy.copy(cache.stats)))  # fmt: skip
        s, n = cache.stats, args.reps * args.tg
        r |= {"capacity": capacity, "hit_rate": round(s.hit_rate, 4),
              "decode": cache_figures(stats[0], s, n, cache.slot_bytes),
              "note": f"{capacity} experts cached, hits {s.hit_rate:.0%}" + (f"; {ahead}" if ahead else "")}  # fmt: skip
        return r
    finally:
        _free(model)


def row_cpu(path: Path, routing: Routing | None, args: argparse.Namespace) -> dict:
    """Every routed expert computed by the CPU kernels from the mapped file (the whole model on the CPU)."""
    w = load_weights(path, "cpu", 0, verify_experts=False)
    model = build_model(w)
    route_by(model, routing)
    try:
        return timed(model, routing, "cpu", args, path)
    finally:
        _free(model)


def guarded(label: str, routing: str, f: Any, *a: Any) -> dict:
    print(f"  running {label} ({routing}) ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        r = f(*a)
    except Exception as exc:  # a row that fails is reported, the next one runs
        traceback.print_exc(file=sys.stderr)
        r = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:200]}
    _free()
    row = {"mode": label, "routing": routing, **r, "seconds": round(time.perf_counter() - t0, 1)}
    print(f"  done {json.dumps(row)}", file=sys.stderr, flush=True)  # kept if a later row is cut short
    return row


# main ----------------------------------------------------------------------------------------------------
def ensure_file(path: Path, layers: int | None) -> None:
    if path.exists():
        return
    from runtime.synth import synthesize

    print(
        f"writing {path} (synthesized Qwen3.6-35B-A3B geometry, Q4_K, layers {layers or 'all'})",
        file=sys.stderr,
    )
    synthesize(path, "qwen3.6-35b-a3b", "q4_k", layers=layers)


def warm_page_cache(path: Path, chunk: int = 64 << 20) -> float:
    t0, n = time.perf_counter(), 0
    with open(path, "rb", buffering=0) as f:
        while data := f.read(chunk):
            n += len(data)
    return n / (time.perf_counter() - t0)


def routing_tables(
    args: argparse.Namespace, path: Path, n: int
) -> tuple[dict[str, list[np.ndarray] | None], dict[str, list[np.ndarray | None]]]:
    """Per ``--routing`` kind its table (None: the file's routers), and the guess tables of a trace."""
    w = load_weights(path, verify_experts=False)
    lays = w.expert_layers()
    experts, k = next(iter(lays.values())).experts, int(w.hparam("expert_used_count"))
    tables, guesses = {}, {}
    for kind in args.routing:
        if kind == "file":
            tables[kind] = None
        elif kind == "uniform":
            tables[kind] = uniform_table(len(lays), n, experts, k)
        else:
            model = args.trace_model
            with tempfile.TemporaryDirectory() as tmp:
                if model.is_dir():
                    from forge.convert import convert_checkpoint

                    gguf = Path(tmp) / f"{model.name}-bf16.gguf"
                    convert_checkpoint(model, gguf, "bf16")
                    model = gguf
                # the recording runs forge's CPU kernels: not on this thread, which would keep their OpenMP
                # team and make the hybrid worker's sleep between calls
                guessed: dict[int, np.ndarray] = {}
                tlays, trace = cpu_kernels.on_own_thread(
                    record, model, args.text.read_text(), args.trace_tokens, 512, guessed
                )
            t_experts = next(iter(tlays.values())).experts
            tables[kind], guesses[kind] = scaled_trace(
                trace, t_experts, len(lays), experts, k, guesses=guessed
            )
    return tables, guesses


def uncached_note(r: dict, c: dict, disk_gb_s: float, cached: dict | None) -> str:
    """A row whose misses were disk reads: MB read a token, the bound (needed MB / the disk's sequential rate
    + the compute of the same row with the file cached, when there is one) and the row against it, the
    cache's hits and read time, and its read ahead."""
    note = f"{r['tg_bytes_read_per_token'] / 1e6:,.1f} MB read a token ({c['needed_mb_per_token']} needed)"
    if cached:
        bound = 1 / (c["needed_mb_per_token"] * 1e6 / (disk_gb_s * 1e9) + 1 / cached["tg"])
        r["expected_tg"] = round(bound, 1)
        note += f"; bound (needed / disk + the cached row's compute) {bound:.1f} tok/s, ratio {bound / r['tg']:.2f}"
    note += (f"; cache hits {c['hit_rate']:.0%}, reads {c['read_ms_per_token']} ms a token at {c['read_gb_s']} GB/s, "
             f"waits {c['wait_ms_per_token']} ms")  # fmt: skip
    if c["read_ahead_per_token"]:
        note += (f"; read ahead {c['read_ahead_per_token']} a token: {c['used_per_token']} used, "
                 f"{c['wasted_per_token']} evicted unused")  # fmt: skip
    return note


def print_table(rows: list[dict], header: str) -> None:
    print(header)
    width = max([28] + [len(r["mode"]) for r in rows])
    print(f"{'mode':<{width}} {'routing':<8} | {'pp tok/s':>9} | {'tg tok/s':>9} | note")
    for r in rows:
        pp = f"{r['pp']:>9.1f}" if "pp" in r else f"{'-':>9}"
        tg = f"{r['tg']:>9.1f}" if "tg" in r else f"{'-':>9}"
        note = r.get("error") or r.get("note", "")
        print(f"{r['mode']:<{width}} {r['routing']:<8} | {pp} | {tg} | {note}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", type=Path)
    ap.add_argument("--layers", type=int, help="layers of a synthesized FILE (default: all 40)")
    ap.add_argument("--caches-gib", default="1,4,8")
    ap.add_argument("--stream-gib", type=float, default=4.0)
    ap.add_argument(
        "--host-cache-gib", type=float, default=0.0,
        help="also run hybrid 4 GiB with the CPU's experts streamed through a host cache of this size, pages dropped",
    )  # fmt: skip
    ap.add_argument(
        "--read-threads",
        type=int,
        default=4,
        help="the host cache's reads in flight (a job per expert part; 0: the requester reads after WILLNEED hints)",
    )
    ap.add_argument(
        "--read-chunk-kb",
        type=int,
        default=READ_CHUNK >> 10,
        help="the most KiB of one of its reads (0: a part)",
    )
    ap.add_argument(
        "--prefetch", action="store_true",
        help="also run each streamed row (--host-cache-gib; SSD streaming without CUDA) with the next layer's "
        "guessed experts read ahead (trace routing: the trained router's guesses, scaled as its choices)",
    )  # fmt: skip
    ap.add_argument(
        "--drop-pages", action="store_true",
        help="the SSD streaming row's cache drops every range it reads from the page cache (each miss a disk read)",
    )  # fmt: skip
    ap.add_argument("--routing", default="trace,uniform")
    ap.add_argument("--trace-model", type=Path, default=ROOT / "examples" / "tiny-qwen3moe")
    ap.add_argument("--text", type=Path, default=FIXTURES / "text" / "val.txt")
    ap.add_argument("--trace-tokens", type=int, default=2048)
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=64)
    ap.add_argument(
        "--warmup-prefills",
        type=int,
        default=2,
        help="prefills before the timed runs (and the one before --warmup)",
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--profile", type=Path, help="forge prune profile JSON seeding the GPU pools")
    ap.add_argument("--admit-per-call", type=int, default=hybrid.ADMIT_PER_CALL,
                    help="experts a decode step's layer may admit into the GPU pool (0: all that qualify)")  # fmt: skip
    ap.add_argument("--llama-bench", type=Path)
    ap.add_argument(
        "--cold", action="store_true", help="drop the file from the page cache before each timed run"
    )
    ap.add_argument("--rows", default="resident,hybrid,streaming,llama",
                    help="which rows: resident, hybrid, streaming, llama (a device's time limit: split a run)")  # fmt: skip
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--cprofile", type=Path, help="write cProfile statistics of the timed runs to this folder"
    )
    args = ap.parse_args()
    want = {r.strip() for r in args.rows.split(",") if r.strip()}
    if not want or want - {"resident", "hybrid", "streaming", "llama"}:
        raise SystemExit("--rows: resident, hybrid, streaming and/or llama")
    args.routing = [r.strip() for r in args.routing.split(",") if r.strip()]
    if not args.routing or any(r not in ("trace", "uniform", "file") for r in args.routing):
        raise SystemExit("--routing: any of trace, uniform, file")
    caches = [float(c) for c in args.caches_gib.split(",") if c.strip()]
    if args.profile is not None and not args.profile.is_file():
        raise SystemExit(f"{args.profile}: no such file")
    torch.set_num_threads(args.threads)
    ensure_file(args.file, args.layers)
    os.sync()  # a file just written: its pages' write-back would run during the first row's timing
    path = args.file
    cuda = torch.cuda.is_available()
    machine = {
        "gpu": torch.cuda.get_device_name() if cuda else None, "cpus": os.cpu_count(), "threads": args.threads,
        "load_avg": [round(x, 2) for x in os.getloadavg()], "file": str(path), "file_gib": round(path.stat().st_size / GIB, 2),
        "env": {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "KMP_BLOCKTIME", "NUMBA_THREADING_LAYER") if k in os.environ},
    }  # fmt: skip
    notes = []
    if args.cold:
        notes.append("--cold: the file is dropped from the page cache before each timed run")
    else:
        machine["page_cache_read_gb_s"] = round(warm_page_cache(path) / 1e9, 2)
    n_tokens = args.pp + args.warmup + args.reps * (args.pp + args.tg) + 1
    forge_rows = want & {"hybrid", "streaming"} or (not cuda and "resident" in want) or args.host_cache_gib
    tables, guesses = routing_tables(args, path, min(n_tokens, 1 << 14)) if forge_rows else ({}, {})
    rows: list[dict] = []
    aheads = (False, True) if args.prefetch else (False,)  # the streamed rows without, then with, read ahead

    def disk_gb_s() -> float:  # the disk's sequential rate, measured once
        return machine.setdefault("disk_read_gb_s", round(read_ceiling(path) / 1e9, 2))

    if cuda:
        free = torch.cuda.mem_get_info()[0]
        fits = path.stat().st_size + (2 << 30) <= free
        if "resident" in want and fits:
            rows.append(guarded("resident GPU", "file", row_resident, path, "cuda", args))
        elif "resident" in want:
            rows.append({"mode": "resident GPU", "routing": "file", "note": f"skipped: the file does not fit in {free / GIB:.0f} GiB free"})  # fmt: skip
        for kind, table in tables.items():
            for gib in caches if "hybrid" in want else ():
                rows.append(
                    guarded(f"hybrid {gib:g} GiB", kind, row_hybrid, path, gib, _routing(table), args)
                )
            if "streaming" in want:
                rows.append(guarded(f"SSD streaming {args.stream_gib:g} GiB", kind, row_streaming, path, "cuda",
                                    args.stream_gib, _routing(table), args))  # fmt: skip
            if args.host_cache_gib:
                cached = next(
                    (r for r in rows if r["mode"] == "hybrid 4 GiB" and r["routing"] == kind and "tg" in r),
                    None,
                )
                for ahead in aheads:
                    label = f"hybrid 4 GiB, host {args.host_cache_gib:g} GiB" + (
                        ", read ahead" if ahead else ""
                    )
                    r = guarded(label, kind, row_hybrid, path, 4.0, _routing(table, guesses.get(kind)), args,
                                args.host_cache_gib, ahead)  # fmt: skip
                    if "tg" in r:
                        r["note"] = uncached_note(r, r["host_cache_decode"], disk_gb_s(), cached)
                    rows.append(r)
    else:
        notes.append(
            "no CUDA device: the GPU rows (resident GPU, hybrid) are skipped; forge's rows run on the CPU"
        )
        for kind, table in tables.items():
            if "resident" in want:
                rows.append(guarded("CPU, mapped file", kind, row_cpu, path, _routing(table), args))
            for ahead in aheads if "streaming" in want else ():
                label = f"SSD streaming {args.stream_gib:g} GiB" + (", read ahead" if ahead else "")
                r = guarded(label, kind, row_streaming, path, "cpu", args.stream_gib,
                            _routing(table, guesses.get(kind)), args, ahead)  # fmt: skip
                if "tg" in r and args.drop_pages:
                    r["note"] += "; " + uncached_note(r, r["decode"], disk_gb_s(), None)
                rows.append(r)
    if args.llama_bench is not None and "llama" in want:
        modes = [("llama.cpp -ot exps=CPU", ("-ot", "exps=CPU")), ("llama.cpp all on GPU", ())] if cuda else [("llama.cpp CPU", ())]  # fmt: skip
        for label, extra in modes:
            print(f"  running {label} ...", file=sys.stderr, flush=True)
            lc = run_llama_bench(args.llama_bench, path, "cuda" if cuda else "cpu", args.threads, args.pp, args.tg,
                                 args.reps, extra)  # fmt: skip
            row = {"mode": label, "routing": "file", "llama_cpp": lc}
            if "error" in lc:
                row["error"] = lc["error"]
            else:
                row |= {"pp": lc.get("pp", 0.0), "tg": lc.get("tg", 0.0), "note": f"build {lc.get('build')}"}
            rows.append(row)
    header = (
        f"{path.name} ({machine['file_gib']} GiB) on {machine['gpu'] or 'CPU only'}, {machine['cpus']} CPUs, "
        f"{args.threads} threads, load {machine['load_avg']}; pp{args.pp}, tg{args.tg}, best of {args.reps}"
    )
    for n in notes:
        print(f"note: {n}")
    print_table(rows, header)
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "notes": notes, "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
