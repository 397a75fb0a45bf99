"""Encoder throughput: MB/s of float32 source weights per type, single process and --jobs 2.

    python benchmarks/quantize_speed.py [--work DIR] [--types q8_0,q4_k,q6_k,iq2_xxs] [--imatrix]

Runs `forge quantize` with `--tensor-type '.*=TYPE'` style overrides (every quantizable tensor to one
type) on the ~2.2 GB random checkpoint of benchmarks/random_checkpoint.py and on the bundled tiny
model (to compare with llama-quantize's timings quoted in the fixtures README).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from random_checkpoint import EXAMPLE, write_checkpoint  # noqa: E402

from forge.imatrix.formats import write_imatrix  # noqa: E402
from forge.imatrix.model import Imatrix  # noqa: E402
from forge.quant.plan import is_quantizable  # noqa: E402
from forge.quant.quantize import quantize  # noqa: E402
from forge.quant.source import source_ref  # noqa: E402


def random_imatrix(model: Path, out: Path) -> Path:
    """An imatrix with random positive weights for every quantizable tensor (speed runs only)."""
    src = source_ref(model).open()
    rng = np.random.default_rng(0)
    sums, counts = {}, {}
    for t in src.tensors():
        if is_quantizable(t) and t.name.startswith("blk."):
            n_mat = t.shape[0] if len(t.shape) == 3 else 1
            sums[t.name] = rng.random((n_mat, t.shape[-1]), dtype=np.float32) + np.float32(0.1)
            counts[t.name] = np.ones(n_mat, np.int64)
    write_imatrix(Imatrix(sums, counts, ["random"], 1, 512), out)
    return out


def time_build(model: Path, out: Path, qtype: str, jobs: int, imatrix: Path | None) -> float:
    start = time.perf_counter()
    quantize(model, out, "q8_0", tensor_types=[f"^blk\\..*={qtype}"], jobs=jobs, imatrix=imatrix)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--types", default="q8_0,q6_k,q4_k,iq2_xxs")
    ap.add_argument("--big", action="store_true", help="also run the ~2.2 GB random checkpoint")
    a = ap.parse_args()
    work = a.work or Path(tempfile.mkdtemp(prefix="forge-qspeed-"))
    models = [("tiny-qwen3moe", EXAMPLE)]
    if a.big:
        big = work / "random-qwen3moe"
        if not (big / "config.json").is_file():
            write_checkpoint(big)
        models.append(("random 2.2 GB", big))
    print(f"machine: {os.cpu_count()} cores")
    print(f"{'model':<16}{'type':<10}{'imatrix':<9}{'jobs':>5}{'seconds':>10}{'MB/s f32':>10}")
    for label, model in models:
        src = source_ref(model).open()
        f32_bytes = sum(4 * int(np.prod(t.shape)) for t in src.tensors() if is_quantizable(t))
        imat = random_imatrix(model, work / f"{label.replace(' ', '_')}-imatrix.gguf")
        for qtype in a.types.split(","):
            needs = qtype.startswith(("iq2", "iq1", "iq3"))
            for jobs in (1, 2):
                for im in [imat] if needs else [None, imat]:
                    t = time_build(model, work / "out.gguf", qtype, jobs, im)
                    print(
                        f"{label:<16}{qtype:<10}{'yes' if im else 'no':<9}{jobs:>5}{t:>10.2f}{f32_bytes / t / 1e6:>10.1f}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
