"""The CPU side of a hybrid decode step, with a thread standing in for the GPU: per call or in one region.

    python benchmarks/hybrid_cpu_step.py [--threads 1,8,15,16] [--misses 1,4,8] [--layers 6] [--experts 256]
        [--gap-us 100] [--reps 20] [--main-team torch|released|numba|none] [--json OUT]

The stand-in device posts a layer's routing to the mailbox ``--gap-us`` after the last answer (the GPU's share
of a layer: ~100 us on the H200 at 4 GiB), ``--misses`` of its 8 experts missed, and waits for the answer.
The CPU side serves the layers as ``runtime.hybrid`` does: ``calls``, a kernel call per layer
(``cpu_kernels.routed_ffn_into``, the default path), or ``region``, the whole step in one parallel region
(``runtime.cpu_step``, ``FORGE_HYBRID_STEP_REGION=1``). Experts: Qwen3.6-35B-A3B's geometry (2048 x 512,
Q4_K bytes with small random values), ``--layers`` x ``--experts`` of them, so that the rows come from memory
as a decode step's do. Per path, threads and misses: the median over ``--reps`` steps of a layer's CPU time,
post seen to answer written (us), and for the region the share of its work items the busiest thread did
(1.0: one thread did everything). Also the cost of an empty numba parallel region, which a kernel call pays
twice. ``--main-team``: the main thread first runs a torch matmul (``torch``, as a model run does) or a numba
parallel kernel (``numba``), or neither (``none``): its OpenMP team then exists beside the worker's, and
libgomp's threads sleep between regions when the teams outnumber the cores (an empty region: 48 us on the
16-core H200 host with both, session 27); ``released``: the torch product, then its team let go
(``runtime.omp_team.release``, as a hybrid run's main thread does).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from numba import njit, prange  # noqa: E402

from runtime import cpu_kernels, omp_team  # noqa: E402
from runtime.cpu_kernels import EncodedExperts, routed_ffn_into  # noqa: E402
from runtime.cpu_step import DecodeStep  # noqa: E402
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
    def __init__(self, layers: int, experts: int, gap_us: float) -> None:
        rng = self.rng = np.random.default_rng(0)
        parts = ((N_FF, N_EMBD), (N_FF, N_EMBD), (N_EMBD, N_FF))  # gate, up, down: (rows, columns)
        self.records = [
            EncodedExperts(*(a for rows, cols in parts for a in (_q4_k(rng, experts, rows, cols), Q.Q4_K)))
            for _ in range(layers)
        ]
        self.layers, self.experts, self.gap = layers, experts, gap_us * 1e-6
        self.step = DecodeStep(
            self.records, np.zeros((layers, 2 * K + N_EMBD), np.float32), np.zeros(layers, np.int32),
            np.zeros(layers, np.int32), np.zeros((layers, N_EMBD), np.float32),
            np.full(layers * experts, -1, np.int64), np.arange(layers, dtype=np.int64) * experts, K,
        )  # fmt: skip
        self.gen = 0

    def _device(self, gen: int, misses: int) -> None:
        s = self.step
        for i in range(self.layers):
            t = time.perf_counter()
            while time.perf_counter() - t < self.gap:
                time.sleep(0)  # the GIL let go, as while a GPU computes
            ids = self.rng.choice(self.experts, K, replace=False)
            s.slot_of[i * self.experts + ids] = 0
            s.slot_of[i * self.experts + ids[:misses]] = -1
            s.mail[i, :K], s.mail[i, K : 2 * K], s.mail[i, 2 * K :] = ids, 0.1, 1.0
            s.posted[i] = gen
            while s.done[i] != gen:
                time.sleep(0)

    def region(self, threads: int, gen: int) -> None:
        cpu_kernels.use_threads(threads)
        self.step.serve(threads, 10.0)

    def calls(self, threads: int, gen: int) -> None:
        s, zeros = self.step, np.zeros(N_EMBD, np.float32)
        cpu_kernels.use_threads(threads)
        for i in range(self.layers):
            while s.posted[i] != gen:
                os.sched_yield()
            t0 = time.perf_counter_ns()
            ids = s.mail[i, :K].astype(np.int64)
            miss = np.flatnonzero(s.slot_of[i * self.experts + ids] < 0)
            act = np.empty((miss.size, N_FF), np.float32)
            w = s.mail[i, K : 2 * K][miss]
            routed_ffn_into(s.mail[i, 2 * K :], ids[miss], w, self.records[i], zeros, act, s.result[i])
            s.stamps[i, :2] = t0, time.perf_counter_ns()
            s.done[i] = gen

    def layer_us(self, serve: Callable[[int, int], None], threads: int, misses: int, reps: int) -> float:
        """Median over ``reps`` steps of a layer's CPU time (us), post seen to answer written."""
        out = []
        for _ in range(reps + 1):  # the first step warms the path
            self.gen += 1
            worker = threading.Thread(target=serve, args=(threads, self.gen))
            worker.start()
            self._device(self.gen, misses)
            worker.join()
            out.append(float((self.step.stamps[:, 1] - self.step.stamps[:, 0]).mean() / 1e3))
        return float(np.median(out[1:]))


def empty_region_us(threads: int) -> float:
    """An empty parallel region's median cost (us) on a fresh worker thread."""
    out: list[float] = []

    def run() -> None:
        cpu_kernels.use_threads(threads)
        a = np.zeros(max(1, threads))
        _empty(threads, a)
        for _ in range(200):
            t = time.perf_counter()
            _empty(threads, a)
            out.append(time.perf_counter() - t)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    return float(np.median(out) * 1e6)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,8,15,16")
    ap.add_argument("--misses", default="1,4,8")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--gap-us", type=float, default=100.0)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--main-team", choices=("torch", "released", "numba", "none"), default="torch")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    misses = [int(m) for m in args.misses.split(",")]
    if not all(1 <= m <= K for m in misses) or min(threads) < 1:
        sys.exit(f"hybrid_cpu_step: misses are 1..{K}, threads at least 1")
    if args.main_team in ("torch", "released"):
        torch.ones(512, 512) @ torch.ones(512, 512)
        if args.main_team == "released":
            omp_team.find()
            omp_team.release()
    elif args.main_team == "numba":
        _empty(max(threads), np.zeros(max(threads)))
    bench = Bench(args.layers, args.experts, args.gap_us)
    rows = []
    for t in threads:
        empty = empty_region_us(t)
        for name in ("calls", "region"):
            bench.step.items = np.zeros(0, np.int64)
            us = {m: round(bench.layer_us(getattr(bench, name), t, m, args.reps), 1) for m in misses}
            row = {"path": name, "threads": t, "empty_region_us": round(empty, 1), "layer_us": us}
            cells = "  ".join(f"{m} missed {v:8.1f}" for m, v in us.items())
            if name == "region":  # how evenly its members shared the work items
                row["busiest_share"] = round(bench.step.busiest_share, 3)
                cells += f"  (busiest thread: {row['busiest_share']:.0%} of the items)"
            rows.append(row)
            print(f"{name:6s} {t:2d} threads (empty region {empty:5.1f} us): {cells}", flush=True)
    if args.json:
        args.json.write_text(
            json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
