"""How fast a disk serves a decode step's missed experts: the expert cache's reads, pages dropped.

    python benchmarks/disk_reads.py F.gguf --threads 1,4,8,16 --chunk-kb 0,128,256,1024 --misses 1,4 \\
        --requests 40 [--json out.json]

A decode step misses a few experts per layer and reads them before it can compute them, so what counts
is how fast one request of a few records comes back, not the disk's sequential rate. Per (reads in
flight ``--threads``, most bytes per read ``--chunk-kb``, 0: a whole part, and experts per request
``--misses``): ``--requests`` requests of experts drawn at random over the file's layers, each through
``ExpertCache.slots`` (the product's code) with every range dropped from the page cache before and after
it, so each is a device read. Reported: GB/s, milliseconds per request, and the share of the sequential
read ceiling (a cold plain read of the file in 16 MiB chunks, as ``streaming.py`` measures it), which
the uncached row of ``hybrid_experts.py`` takes as its bound.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from streaming import drop_cache, expert_layers, read_ceiling  # noqa: E402

from runtime.experts import ExpertCache  # noqa: E402


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def measure(
    path: Path, layers: dict, threads: int, chunk: int, misses: int, requests: int, seed: int
) -> dict:
    """``requests`` requests of ``misses`` random experts (distinct within a layer) on a fresh cache."""
    rng = np.random.default_rng(seed)
    cache = ExpertCache(path, layers, len(layers) * misses + 1, misses, "lru", "cpu", drop_pages=True,
                        read_threads=threads, read_chunk=chunk)  # fmt: skip
    try:
        order = sorted(layers)
        drop_cache(path)
        for _ in range(requests):
            layer = order[int(rng.integers(len(order)))]
            ids = rng.choice(layers[layer].experts, misses, replace=False).tolist()
            got = cache.slots(layer, ids)
            cache.release(got)
        s = cache.stats
        return {"threads": threads, "chunk_kb": chunk >> 10, "misses": misses, "requests": requests,
                "gb_s": round(s.bytes_read / s.read_seconds / 1e9, 3),
                "ms_per_request": round(s.read_seconds / requests * 1e3, 3), "reads": s.reads}  # fmt: skip
    finally:
        cache.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("path", type=Path)
    ap.add_argument(
        "--threads",
        type=ints,
        default=[1, 4, 8, 16],
        help="reader threads (0: none; WILLNEED hints, then reads in turn)",
    )
    ap.add_argument("--chunk-kb", type=ints, default=[0, 128, 256, 1024], help="most KiB a read (0: a part)")
    ap.add_argument("--misses", type=ints, default=[1, 4], help="experts per request")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    layers = expert_layers(args.path)
    if layers is None:
        return 1
    record = max(lay.record_bytes for lay in layers.values())
    ceiling = read_ceiling(args.path)
    print(
        f"{args.path}: expert record {record / 1e6:.2f} MB; sequential read ceiling {ceiling / 1e9:.2f} GB/s"
    )
    rows = []
    for misses in args.misses:
        print(f"\n{misses} expert(s) a request: GB/s (ms a request, share of the ceiling)")
        print(
            "threads | "
            + " | ".join(f"chunk {c or 'part':>4}" + ("" if c == 0 else " KiB") for c in args.chunk_kb)
        )
        for threads in args.threads:
            cells = []
            for chunk_kb in args.chunk_kb:
                r = measure(args.path, layers, threads, chunk_kb << 10, misses, args.requests, args.seed)
                r["share_of_ceiling"] = round(r["gb_s"] * 1e9 / ceiling, 3)
                rows.append(r)
                cells.append(
                    f"{r['gb_s']:5.2f} ({r['ms_per_request']:6.2f} ms, {r['share_of_ceiling']:4.0%})"
                )
            print(f"{threads:7d} | " + " | ".join(cells))
    if args.json:
        args.json.write_text(json.dumps({"path": str(args.path), "record_bytes": record,
                                         "ceiling_gb_s": round(ceiling / 1e9, 3), "rows": rows}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
