"""Encoder throughput per quant type on a 4096 x 4096 Gaussian float32 matrix (MB/s of float32 input).

    python benchmarks/codec_speed.py [TYPE ...]        # default: every registered encoder type

Each type is timed without and with a random importance vector (types that read one), printing
wall-clock and CPU-time throughput (CPU time stays meaningful on a busy machine).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from forge.quant.types import get_type, known_type_names


def main() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4096, 4096), dtype=np.float32)
    imp = rng.uniform(0.1, 2, 4096).astype(np.float32)
    names = [n.upper() for n in sys.argv[1:]] or [n for n in known_type_names() if n not in ("F32",)]
    print(f"machine: {os.cpu_count()} cores, FORGE_THREADS={os.environ.get('FORGE_THREADS', 'default')}")
    print(f"{'type':<9}{'imatrix':<9}{'wall MB/s':>10}{'cpu MB/s':>10}")
    for name in names:
        qt = get_type(name)
        for label, w in (("no", None), ("yes", imp)):
            if (w is None and qt.needs_imatrix) or (w is not None and not qt.uses_imatrix):
                continue
            t0, c0 = time.perf_counter(), time.process_time()
            qt.encode(x, w)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            print(
                f"{name:<9}{label:<9}{x.nbytes / wall / 1e6:>10.1f}{x.nbytes / cpu / 1e6:>10.1f}", flush=True
            )


if __name__ == "__main__":
    main()
