"""Incremental-build speed: full build vs one-layer boost rebuilt with --reuse, against Amdahl's ideal.

    python benchmarks/reuse.py [--work DIR] [--recipe q8_0] [--boost-type q4_0] [--layers 48]

Builds a random qwen3moe checkpoint with a 48-layer geometry (~2.2 GB bf16), quantizes it from
scratch, then rebuilds with one layer's routed experts boosted and `--reuse` of the first build.
Ideal (Amdahl) speedup = full time / (full time x fraction of bytes re-encoded). The copy rate is
compared with `cp` of the prior file.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from random_checkpoint import write_checkpoint  # noqa: E402

from forge.quant.quantize import quantize  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--recipe", default="q8_0")
    ap.add_argument("--boost-type", default="q4_0")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--trust-mtime", action="store_true", help="key sources by shard stats, not content")
    a = ap.parse_args()
    work = a.work or Path(tempfile.mkdtemp(prefix="forge-reuse-"))
    ckpt = work / f"random-qwen3moe-{a.layers}L"
    if not (ckpt / "config.json").is_file():
        write_checkpoint(
            ckpt, layers=a.layers, experts=16, hidden=1024, moe_ff=384, heads=8, kv_heads=2, head_dim=128
        )
    base, boost = work / "base.gguf", work / "boost.gguf"
    layer = a.layers // 2
    override = [f"blk\\.{layer}\\.ffn_.*_exps={a.boost_type}"]

    start = time.perf_counter()
    quantize(ckpt, base, a.recipe, jobs=a.jobs, trust_mtime=a.trust_mtime)
    t_full = time.perf_counter() - start
    start = time.perf_counter()
    _, rep = quantize(
        ckpt, boost, a.recipe, tensor_types=override, reuse=[base], jobs=a.jobs, trust_mtime=a.trust_mtime
    )
    t_boost = time.perf_counter() - start

    encoded = [r for r in rep.tensors if r["action"] == "encoded"]
    fraction = sum(r["bytes"] for r in encoded) / sum(r["bytes"] for r in rep.tensors)
    copied_bytes = sum(r["bytes"] for r in rep.tensors if r["action"] == "copied")
    start = time.perf_counter()
    subprocess.run(["cp", str(base), str(work / "cp.gguf")], check=True)
    os.fsync(os.open(work / "cp.gguf", os.O_RDONLY))
    t_cp = time.perf_counter() - start
    ideal = 1 / fraction
    print(f"machine: {os.cpu_count()} cores; checkpoint {sum(p.stat().st_size for p in ckpt.glob('*.safetensors')):,} B; "
          f"recipe {a.recipe}, boost blk.{layer} experts -> {a.boost_type}, --jobs {a.jobs}, trust-mtime {a.trust_mtime}")  # fmt: skip
    print(f"full build          {t_full:8.1f} s")
    print(f"boost with --reuse  {t_boost:8.1f} s   ({len(encoded)} of {len(rep.tensors)} tensors re-encoded, "
          f"{fraction:.2%} of the bytes)")  # fmt: skip
    print(
        f"speedup             {t_full / t_boost:8.1f} x   ideal (Amdahl) {ideal:.1f} x   ratio {ideal / (t_full / t_boost):.2f}"
    )
    print(
        f"cp of the prior     {t_cp:8.1f} s   ({base.stat().st_size / t_cp / 1e6:.0f} MB/s); copied {copied_bytes:,} B in the boost"
    )
    if a.work is None:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
