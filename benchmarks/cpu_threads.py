"""How the CPU decode's matrix-vector product scales with threads, and what numba's CPU target does to it:
the LM head (the largest matrix of a decode step) multiplied by one token with the compiled row kernels
(``runtime.cpu_kernels``), at 1..N threads, under one or more ``NUMBA_CPU_NAME`` values.

    python benchmarks/cpu_threads.py [GGUF] [--tensor output.weight] [--threads 1,2,4,8,16]
        [--cpu-names default,native,haswell] [--rounds 3] [--json OUT]

Without a GGUF it multiplies a random Q4_K matrix of Qwen3.6-35B-A3B's LM-head shape (248,320 x 2,048,
286 MB). Each CPU name runs in its own process (numba reads the target when it starts): ``default`` is what
forge compiles for (``forge.jit``: skylake tuning on Intel CPUs with AVX-512, else the host's), ``native``
the host CPU's own name (numba's default), any other an LLVM CPU name; the instructions are the host's in
every case, only LLVM's tuning changes. The rounds go through the names in turn, so a noisy neighbour slows
them alike, and the best time of each (name, threads) is kept. Printed per row: milliseconds, the matrix's bytes
read per second, nanoseconds per weight per thread (flat when the product scales; rising when the threads
wait on memory or on each other), and the rate at which the same threads merely read those bytes (the
product's ceiling: a product near it is bound by memory, far below it by its instructions).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VOCAB, HIDDEN = 248320, 2048


def _matrix(path: str | None, tensor: str):  # noqa: ANN202
    from gguf import GGMLQuantizationType as Q

    from runtime.cpu_kernels import Rows

    if path is None:
        from runtime.synth import random_blocks

        blocks = random_blocks(
            Q.Q4_K, VOCAB * HIDDEN // 256, np.random.default_rng(0), 1e-3, 1e-2, signed=True
        )
        return Rows.encoded_parts([(blocks.reshape(VOCAB, -1), int(Q.Q4_K))]), HIDDEN
    from forge.gguf_file import open_gguf

    f = open_gguf(path)
    t = f.tensors[tensor]
    return Rows.encoded_parts([(np.ascontiguousarray(f.array(tensor)), int(t.ggml_type))]), int(t.shape[-1])


def _best_ms(fn, reps: int) -> float:  # noqa: ANN001
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def _read_kernel():  # noqa: ANN202
    from numba import njit, prange

    @njit(parallel=True, cache=True)
    def read_all(words: np.ndarray) -> int:  # the bytes' sum as uint64 words: memory read rate
        s = np.uint64(0)
        for i in prange(words.shape[0]):
            s += words[i]
        return s

    return read_all


def child(path: str | None, tensor: str, threads: list[int], reps: int) -> dict:
    """Best milliseconds of one product per thread count, in this process's numba target, and of reading the
    same bytes (summed as 64-bit words: the memory's read rate, the product's ceiling)."""
    import numba

    from runtime import cpu_kernels

    w, n_in = _matrix(path, tensor)
    x = np.random.default_rng(1).standard_normal(n_in).astype(np.float32)
    out = np.empty(w.n_out, np.float32)
    words = w.data[: w.data.nbytes // 8 * 8].view(np.uint64)
    read_all = _read_kernel()
    best, read = {}, {}
    for n in threads:
        numba.set_num_threads(n)
        best[n] = _best_ms(
            lambda: cpu_kernels._gemv_parallel(x, w.data, w.index, out, False, out, w.acts), reps
        )
        read[n] = _best_ms(lambda: read_all(words), reps)
    from numba.core.registry import cpu_target

    tuning = cpu_target.target_context.codegen().magic_tuple()[1]
    return {"best_ms": best, "read_ms": read, "bytes": int(w.data.nbytes), "weights": int(w.n_out) * n_in,
            "tuning": tuning}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", nargs="?")
    ap.add_argument("--tensor", default="output.weight")
    ap.add_argument("--threads", default=None, help="comma-separated (default: 1, 2, 4, ... up to the cores)")
    ap.add_argument(
        "--cpu-names", default="default", help="comma-separated: default, native or LLVM CPU names"
    )
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json")
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    threads = (
        [int(t) for t in args.threads.split(",")]
        if args.threads
        else sorted({min(cores, 1 << k) for k in range(cores.bit_length() + 1)})
    )
    if args.child:
        print(json.dumps(child(args.gguf, args.tensor, threads, args.reps)))
        return
    names = args.cpu_names.split(",")
    best: dict[tuple[str, int], float] = {}
    read: dict[int, float] = {}  # reading the bytes alone, whatever the tuning
    size = None
    for _ in range(args.rounds):
        for name in names:
            env = dict(os.environ)
            env.pop("NUMBA_CPU_NAME", None)
            if name == "native":
                from llvmlite import binding as llvm

                env["NUMBA_CPU_NAME"] = llvm.get_host_cpu_name()
            elif name != "default":
                env["NUMBA_CPU_NAME"] = name
            cmd = [sys.executable, __file__, "--child", "--threads", ",".join(map(str, threads)),
                   "--reps", str(args.reps), "--tensor", args.tensor, *([args.gguf] if args.gguf else [])]  # fmt: skip
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                sys.exit(f"cpu_threads: {name}: {done.stderr.strip().splitlines()[-1:]}")
            r = json.loads(done.stdout.strip().splitlines()[-1])
            size = (r["bytes"], r["weights"])
            for n, ms in r["best_ms"].items():
                key = (f"{name} ({r['tuning']})" if name in ("default", "native") else name, int(n))
                best[key] = min(best.get(key, float("inf")), ms)
                read[int(n)] = min(read.get(int(n), float("inf")), r["read_ms"][n])
    nbytes, weights = size
    print(f"{args.gguf or 'random Q4_K'} {args.tensor if args.gguf else ''}: {nbytes / 1e6:.0f} MB, "
          f"{cores} cores, best of {args.rounds} round(s) x {args.reps}")  # fmt: skip
    print(f"{'cpu name':>24} {'threads':>7} {'ms':>9} {'GB/s':>7} {'ns/weight/thread':>17} {'read GB/s':>10}")
    rows = []
    for (name, n), ms in best.items():
        row = {"cpu_name": name, "threads": n, "ms": round(ms, 3), "gb_s": round(nbytes / ms / 1e6, 2),
               "ns_per_weight_thread": round(ms * 1e6 * n / weights, 4),
               "read_gb_s": round(nbytes / read[n] / 1e6, 2)}  # fmt: skip
        rows.append(row)
        print(f"{name:>24} {n:>7} {ms:>9.2f} {row['gb_s']:>7.1f} {row['ns_per_weight_thread']:>17.3f}"
              f" {row['read_gb_s']:>10.1f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
