"""The CPU side of a hybrid decode step alone: one-token calls of the routed-expert kernel on encoded experts.

    python benchmarks/cpu_experts.py [--type q4_k] [--experts 256] [--hidden 2048] [--ff 512] [--layers 1]
        [--counts 1,2,4,6,8] [--threads N,...] [--items 1,2,4,8] [--gap-us 150] [--calls 300]
        [--mapped FILE | --gguf MODEL.gguf [--pin]] [--json OUT]

``--layers`` layers of random encoded experts (the Qwen3.6-35B-A3B geometry by default: 256 experts of 2048 x
512, Q4_K, 453 MB a layer, more than a host's last-level cache; ``--gguf``: a model file's) and, as the hybrid
executor's worker makes them, calls of
``cpu_kernels.routed_ffn_into`` from a second thread for ``--counts`` missed experts (of a random layer, other
experts each call), each after ``--gap-us`` of spinning (the GPU's part of a layer, during which the kernel's threads
wait). Per thread count, work items per thread (``cpu_kernels.ITEMS_PER_THREAD``; 0: items of 64 rows
whatever the thread count, as before 2026-12-04) and expert count: the median
and 10th percentile microseconds of a call and the median's GB/s of expert bytes read.

On the H200 machine (2026-12-04) a call cost 83-97 / 183-199 / 330-357 us for 1 / 4 / 8 experts of one layer
and 107-217 / 166-303 / 253-490 over a whole 40-layer file (``--gguf``), page-locked or not, with as much
spread between fresh machines of the same kind as between the sources. The file's 4 KB pages are not the
cost: its experts copied onto 2 MB pages measured the same (107-179 / 166-280 / 253-388 us, session 23), and
so did ``--layers 40`` (numpy's copies, on huge pages) on one machine (61-148 / 151-226 / 283-363 us). Experts
that fit the last-level cache (``--experts 16``: 28 MB) still cost 73-76 / 164-170 / 279-309 us: the kernel
is bound by its arithmetic (~30 us an expert on 16 threads) plus ~40 us a call (two parallel regions of ~9 us
each, the input's and the SwiGLU outputs' 22-bit forms prepared on one thread, the dispatch). On 2026-12-04
(session 24, another machine of the kind, ``--gguf``) the threads' work items taken in turn (``cpu_ir.claim``)
measured 208 / 339 / 473 us against 167 / 274 / 453 with equal shares: slower here, though faster inside the
hybrid decode step at every count of missed experts (``README``, "Hybrid experts").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime import cpu_kernels  # noqa: E402
from runtime.synth import random_blocks  # noqa: E402


def random_layers(
    qtype: GGMLQuantizationType, layers: int, experts: int, hidden: int, ff: int, mapped: Path | None = None
) -> list[cpu_kernels.EncodedExperts]:
    """``layers`` layers of random experts (the first layer's bytes copied to the others: separate memory, as
    a model's layers are), in anonymous memory (numpy asks for huge pages) or (``mapped``) in a file's pages."""
    rng = np.random.default_rng(0)
    block, size = GGML_QUANT_SIZES[qtype]

    def part(rows: int, cols: int) -> np.ndarray:
        n = experts * rows * cols // block
        return random_blocks(qtype, n, rng, 1e-4, 1e-3, signed=True).reshape(
            experts, rows, cols // block * size
        )

    t = int(qtype)
    first = [part(ff, hidden), part(ff, hidden), part(hidden, ff)]
    parts = [first] + [[a.copy() for a in first] for _ in range(layers - 1)]
    if mapped is not None:  # the same bytes in a file's mapped pages, as a hybrid step reads a model file
        with open(mapped, "wb") as f:
            for a in first * layers:
                f.write(a.tobytes())
        m, at = np.memmap(mapped, np.uint8, "r"), 0
        for lay in parts:
            for i, a in enumerate(lay):
                lay[i], at = m[at : at + a.size].reshape(a.shape), at + a.size
    return [cpu_kernels.EncodedExperts(g, t, u, t, d, t) for g, u, d in parts]


def file_experts(path: Path, pin: bool) -> tuple[object, list[cpu_kernels.EncodedExperts], object]:
    """Every routed layer's experts of a model file as the hybrid executor's worker reads them (the mapped
    file; ``pin``: page-locked as ``runtime.host_pin`` does for a hybrid run). Returns the model (which holds
    the mapping), the layers' experts and the pinned ranges (None)."""
    from runtime import host_pin
    from runtime.models import build_model
    from runtime.planner import available_memory
    from runtime.weights import load_weights

    model = build_model(load_weights(path, "cpu", 0, verify_experts=False))
    layers = [
        b.moe.source.encoded_records() for i, b in enumerate(model.blocks) if i in model.routed_layers()
    ]
    pinned = None
    if pin:
        import torch

        bufs = [torch.from_numpy(b) for e in layers for b in e.buffers]
        pinned = host_pin.pin(bufs, available_memory()[0])
        print(f"page-locked: {pinned.nbytes / 1e9:.1f} GB" if pinned else "not page-locked")
    return model, layers, pinned


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def measure(
    layers: list[cpu_kernels.EncodedExperts], n: int, threads: int, args: argparse.Namespace
) -> list[float]:
    """Seconds of each of ``args.calls`` calls for ``n`` experts (of a random layer), on the calling thread."""
    cpu_kernels.use_threads(threads)
    n_exp, hidden = args.experts, args.hidden
    rng = np.random.default_rng(n)
    x = rng.standard_normal(hidden).astype(np.float32)
    h, out = np.zeros(hidden, np.float32), np.empty(hidden, np.float32)
    act, w = np.empty((n, layers[0].n_ff), np.float32), np.full(n, 1.0 / n, np.float32)
    times = []
    for i in range(args.calls + 10):
        ids = rng.choice(n_exp, n, replace=False).astype(np.int64)
        enc = layers[rng.integers(len(layers))]
        spin(args.gap_us * 1e-6)
        t0 = time.perf_counter()
        cpu_kernels.routed_ffn_into(x, ids, w, enc, h, act, out)
        if i >= 10:
            times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--type", default="q4_k")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ff", type=int, default=512)
    ap.add_argument("--layers", type=int, default=1, help="layers of random experts (40: a 35B file's 18 GB)")
    ap.add_argument("--counts", default="1,2,4,6,8")
    ap.add_argument("--threads", default="")
    ap.add_argument("--items", default=str(cpu_kernels.ITEMS_PER_THREAD))
    ap.add_argument("--gap-us", type=float, default=150.0)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--mapped", type=Path, help="write the experts to this file and read them mapped")
    ap.add_argument(
        "--gguf", type=Path, help="a model file's routed experts instead (a random layer each call)"
    )
    ap.add_argument("--pin", action="store_true", help="with --gguf: page-lock them, as a hybrid run does")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    qtype = GGMLQuantizationType[args.type.upper()]
    if args.gguf:
        model, layers, _pinned = file_experts(args.gguf, args.pin)  # the model holds the mapping
        args.experts, args.hidden, args.type = model.n_expert, model.n_embd, f"{args.gguf.name}'s"
    else:
        layers = random_layers(qtype, args.layers, args.experts, args.hidden, args.ff, args.mapped)
    enc = layers[0]
    record = sum(int(enc.meta[p, 1]) for p in range(3))
    cpu_kernels.start_threads()
    threads = [int(t) for t in args.threads.split(",") if t] or [cpu_kernels.numba_config.NUMBA_NUM_THREADS]
    chunks = cpu_kernels.expert_chunks

    def fixed(*_: int) -> tuple[int, int]:  # --items 0: 64-row items, whatever the thread count
        return 64, 64

    worker = ThreadPoolExecutor(1)  # as the hybrid executor's worker: not the thread that started the pool
    rows = []
    print(
        f"{args.type} experts ({len(layers)} layers of {args.experts}): {record / 1e6:.2f} MB each; {enc.acts=}"
    )
    for t in threads:
        for items in (int(i) for i in args.items.split(",")):
            cpu_kernels.ITEMS_PER_THREAD = items
            cpu_kernels.expert_chunks = fixed if items == 0 else chunks
            for n in (int(c) for c in args.counts.split(",")):
                s = np.array(worker.submit(measure, layers, n, t, args).result())
                med, p10 = float(np.median(s)), float(np.percentile(s, 10))
                row = {"threads": t, "items": items, "experts": n, "median_us": round(med * 1e6, 1),
                       "p10_us": round(p10 * 1e6, 1), "gb_s": round(n * record / med / 1e9, 1)}  # fmt: skip
                rows.append(row)
                print(f"threads {t:3d} items/thread {items:2d} experts {n}: median {row['median_us']:7.1f} us, "
                      f"p10 {row['p10_us']:7.1f} us, {row['gb_s']:5.1f} GB/s", flush=True)  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
