"""Encoder throughput per quant type on a 4096 x 4096 Gaussian float32 matrix (MB/s of float32 input).

    python benchmarks/codec_speed.py [TYPE ...] [--numpy | --compare] [--rows N]

Default: every registered encoder type, through the default path (the compiled numba kernels where a
type has one, unless FORGE_NO_NUMBA is set). ``--numpy`` forces the numpy encoders, ``--compare``
times both paths and checks they give the same bytes. Each type is timed without and with a random
importance vector (types that read one), printing wall-clock and CPU-time throughput (CPU time stays
meaningful on a busy machine); threads: FORGE_THREADS. The first call of each type on a few rows is
timed apart ("warm-up": loading the kernels from numba's on-disk cache, or compiling them when the
cache is cold) and not counted.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from forge.quant.types import get_type, known_type_names


def _time(qt: type, x: np.ndarray, w: np.ndarray | None) -> tuple[np.ndarray, float, float, float]:
    t0 = time.perf_counter()
    qt.encode(x[:8], w)
    warm = time.perf_counter() - t0
    t0, c0 = time.perf_counter(), time.process_time()
    out = qt.encode(x, w)
    return out, time.perf_counter() - t0, time.process_time() - c0, warm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("types", nargs="*")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--numpy", action="store_true", help="numpy encoders only (FORGE_NO_NUMBA=1)")
    mode.add_argument("--compare", action="store_true", help="numba kernels and numpy, same bytes checked")
    ap.add_argument("--rows", type=int, default=4096, help="rows of the 4096-wide test matrix")
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.rows, 4096), dtype=np.float32)
    imp = rng.uniform(0.1, 2, 4096).astype(np.float32)
    names = [n.upper() for n in args.types] or [n for n in known_type_names() if n not in ("F32",)]
    paths = ["numba", "numpy"] if args.compare else ["numpy" if args.numpy else "default"]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"machine: {os.cpu_count()} cores, load {load:.2f}, "
        f"FORGE_THREADS={os.environ.get('FORGE_THREADS', 'default')}, matrix {x.shape[0]}x{x.shape[1]}"
    )
    print(f"{'type':<9}{'imatrix':<9}{'path':<8}{'wall MB/s':>10}{'cpu MB/s':>10}{'warm-up s':>10}")
    saved = os.environ.get("FORGE_NO_NUMBA")
    for name in names:
        qt = get_type(name)
        for label, w in (("no", None), ("yes", imp)):
            if (w is None and qt.needs_imatrix) or (w is not None and not qt.uses_imatrix):
                continue
            outputs = []
            for path in paths:
                if path == "numpy":
                    os.environ["FORGE_NO_NUMBA"] = "1"
                elif path == "numba":
                    os.environ.pop("FORGE_NO_NUMBA", None)
                out, wall, cpu, warm = _time(qt, x, w)
                outputs.append(out)
                if saved is None:
                    os.environ.pop("FORGE_NO_NUMBA", None)
                else:
                    os.environ["FORGE_NO_NUMBA"] = saved
                print(
                    f"{name:<9}{label:<9}{path:<8}{x.nbytes / wall / 1e6:>10.1f}{x.nbytes / cpu / 1e6:>10.1f}"
                    f"{warm:>10.2f}",
                    flush=True,
                )
            if len(outputs) == 2 and not np.array_equal(*outputs):
                print(f"{name:<9}{label:<9}MISMATCH between the numba and numpy paths", flush=True)


if __name__ == "__main__":
    main()
