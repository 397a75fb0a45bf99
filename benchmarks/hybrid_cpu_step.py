"""The CPU side of a hybrid decode step, with a thread standing in for the GPU, and the main thread's OpenMP team.

    python benchmarks/hybrid_cpu_step.py [--threads 1,8,15,16] [--misses 1,4,8] [--layers 6] [--experts 256]
        [--gap-us 100] [--reps 20] [--main-team torch|released|numba|none] [--hot] [--json OUT]

A worker thread serves the decode steps' layers as ``runtime.hybrid``'s does (one thread for the whole run,
so its OpenMP team is made once): per layer, wait for the stand-in device's post in the mailbox, compute the
missed experts with a kernel call (``hybrid.answer_missed``, the executor's own), write the answer. The
stand-in device posts a layer's routing ``--gap-us`` after the last answer (the GPU's share of a layer: ~100 us on the H200 at
4 GiB), ``--misses`` of its 8 experts missed. Experts: Qwen3.6-35B-A3B's geometry (2048 x 512, Q4_K bytes with
small random values), ``--layers`` x ``--experts`` of them, so that the rows come from memory as a decode
step's do (``--hot``: the same 8 experts of each layer every step, their rows then in the CPU's caches: what
is left of a call's cost is not its reads from memory). Per thread count and misses: the median over ``--reps`` steps of a layer's CPU time, post seen to
answer written (us), a least-squares line through them (a call's fixed cost and each missed expert's), and
the cost of an empty numba parallel region on the worker (a kernel call opens two).

``--main-team``: before the run, the main thread makes an OpenMP team with a torch product (``torch``, as a
model's load does), or a numba parallel kernel (``numba``), or not (``none``); ``released``: the torch
product, then the team let go (``runtime.omp_team.release``, as a hybrid run's model thread does at each
decode step). With a second team beside the worker's, libgomp has the worker's threads sleep between regions
(session 28, 16-core H200 host, 15 threads: an empty region 35 us with the main thread's team, 7 without; a
1-missed-expert layer 312 -> 172 us).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from numba import njit, prange  # noqa: E402

from runtime import cpu_kernels, omp_team  # noqa: E402
from runtime.cpu_kernels import EncodedExperts  # noqa: E402
from runtime.hybrid import answer_missed  # noqa: E402
from runtime.synth import random_blocks  # noqa: E402

N_EMBD, N_FF, K = 2048, 512, 8


def _q4_k(rng: np.random.Generator, experts: int, rows: int, cols: int) -> np.ndarray:
    """Q4_K rows of random bytes with small scale fields (finite sums)."""
    return random_blocks(Q.Q4_K, experts * rows * cols // 256, rng, 1e-4, 1e-3, signed=True).reshape(
        experts, rows, -1
    )


@njit(parallel=True, nogil=True, cache=True)
def _empty(n: int, a: np.ndarray) -> None:
    for i in prange(n):
        a[i] += 1.0


class Bench:
    """The layers' records, the mailbox and the worker: ``step(threads, misses)`` serves one decode step."""

    def __init__(self, layers: int, experts: int, gap_us: float, hot: bool = False) -> None:
        rng = self.rng = np.random.default_rng(0)
        parts = ((N_FF, N_EMBD), (N_FF, N_EMBD), (N_EMBD, N_FF))  # gate, up, down: (rows, columns)
        self.records = [
            EncodedExperts(*(a for rows, cols in parts for a in (_q4_k(rng, experts, rows, cols), Q.Q4_K)))
            for _ in range(layers)
        ]
        self.layers, self.experts, self.gap, self.hot = layers, experts, gap_us * 1e-6, hot
        self.mail = np.zeros((layers, 2 * K + N_EMBD), np.float32)
        self.result = np.zeros((layers, N_EMBD), np.float32)
        self.posted, self.done = np.zeros(layers, np.int64), np.zeros(layers, np.int64)
        self.missed = np.full(layers * experts, False)
        self.stamps = np.zeros((layers, 2), np.int64)
        self.gen = 0
        self.worker = ThreadPoolExecutor(1)  # one thread for the whole run, as the hybrid executor's

    def _serve(self, threads: int, gen: int) -> None:
        """The worker's step, as ``HybridExperts._serve_step`` takes it."""
        zeros = np.zeros(N_EMBD, np.float32)
        cpu_kernels.use_threads(threads)
        for i in range(self.layers):
            while self.posted[i] != gen:
                os.sched_yield()
            t0 = time.perf_counter_ns()
            ids = self.mail[i, :K].astype(np.int64)
            miss = np.flatnonzero(self.missed[i * self.experts + ids])
            answer_missed(self.mail[i], ids[miss], miss, self.records[i], zeros, self.result[i])
            self.stamps[i] = t0, time.perf_counter_ns()
            self.done[i] = gen

    def _device(self, gen: int, misses: int) -> None:
        for i in range(self.layers):
            t = time.perf_counter()
            while time.perf_counter() - t < self.gap:
                time.sleep(0)  # the GIL let go, as while a GPU computes
            ids = np.arange(K) if self.hot else self.rng.choice(self.experts, K, replace=False)
            self.missed[i * self.experts + ids] = False
            self.missed[i * self.experts + ids[:misses]] = True
            self.mail[i, :K], self.mail[i, K : 2 * K], self.mail[i, 2 * K :] = ids, 0.1, 1.0
            self.posted[i] = gen
            while self.done[i] != gen:
                time.sleep(0)

    def layer_us(self, threads: int, misses: int, reps: int) -> float:
        """Median over ``reps`` steps of a layer's CPU time (us), post seen to answer written."""
        out = []
        for _ in range(reps + 1):  # the first step warms the path
            self.gen += 1
            job = self.worker.submit(self._serve, threads, self.gen)
            self._device(self.gen, misses)
            job.result()
            out.append(float((self.stamps[:, 1] - self.stamps[:, 0]).mean() / 1e3))
        return float(np.median(out[1:]))

    def empty_region_us(self, threads: int) -> float:
        """An empty parallel region's median cost (us) on the worker."""

        def run() -> float:
            cpu_kernels.use_threads(threads)
            a, out = np.zeros(max(1, threads)), []
            _empty(threads, a)
            for _ in range(200):
                t = time.perf_counter()
                _empty(threads, a)
                out.append(time.perf_counter() - t)
            return float(np.median(out) * 1e6)

        return self.worker.submit(run).result()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,8,15,16")
    ap.add_argument("--misses", default="1,4,8")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--gap-us", type=float, default=100.0)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--main-team", choices=("torch", "released", "numba", "none"), default="torch")
    ap.add_argument("--hot", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    misses = [int(m) for m in args.misses.split(",")]
    if not all(1 <= m <= K for m in misses) or min(threads) < 1:
        sys.exit(f"hybrid_cpu_step: misses are 1..{K}, threads at least 1")
    if args.main_team in ("torch", "released"):
        torch.ones(512, 512) @ torch.ones(512, 512)
    elif args.main_team == "numba":
        _empty(max(threads), np.zeros(max(threads)))
    if args.main_team == "released":
        omp_team.find()
        omp_team.release()
    bench = Bench(args.layers, args.experts, args.gap_us, args.hot)
    rows = []
    for t in threads:
        empty = bench.empty_region_us(t)
        us = {m: round(bench.layer_us(t, m, args.reps), 1) for m in misses}
        row = {"threads": t, "empty_region_us": round(empty, 1), "layer_us": us}
        cells = "  ".join(f"{m} missed {v:8.1f}" for m, v in us.items())
        if len(us) >= 2:
            slope, fixed = np.polyfit(list(us), list(us.values()), 1)
            row |= {"fixed_us": round(float(fixed), 1), "per_expert_us": round(float(slope), 1)}
            cells += f"  (a call {fixed:.1f} us + {slope:.1f} us per missed expert)"
        rows.append(row)
        print(f"{t:2d} threads (empty region {empty:5.1f} us): {cells}", flush=True)
    if args.json:
        args.json.write_text(
            json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
