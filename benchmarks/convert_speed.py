"""forge convert throughput vs `cp` of the same bytes, on a ~2 GB random qwen3moe checkpoint.

    python benchmarks/convert_speed.py [--work DIR] [--repeat 3]

Both runs read warm from the page cache (each is preceded by one untimed warm-up read) and write
to the same folder; the best of --repeat runs is reported. Prints a table.
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

from forge.convert import convert_checkpoint  # noqa: E402


def best_of(n: int, fn) -> float:  # noqa: ANN001
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    work = a.work or Path(tempfile.mkdtemp(prefix="forge-bench-"))
    ckpt = work / "random-qwen3moe"
    if not (ckpt / "config.json").is_file():
        write_checkpoint(ckpt)
    shards = sorted(ckpt.glob("*.safetensors"))
    nbytes = sum(p.stat().st_size for p in shards)
    out = work / "out.gguf"
    for p in shards:  # warm the page cache
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass

    def cp() -> None:
        subprocess.run(["cp", *map(str, shards), str(work / "cpdir")], check=True)
        for p in (work / "cpdir").iterdir():
            os.fsync(os.open(p, os.O_RDONLY))

    (work / "cpdir").mkdir(exist_ok=True)
    t_cp = best_of(a.repeat, cp)
    shutil.rmtree(work / "cpdir")
    t_conv = best_of(a.repeat, lambda: convert_checkpoint(ckpt, out, "bf16"))
    mb = nbytes / 1e6
    print(f"machine: {os.cpu_count()} cores; source {nbytes:,} bytes in {len(shards)} shards (bf16)")
    print(f"{'run':<28}{'seconds':>10}{'MB/s':>10}{'vs cp':>8}")
    print(f"{'cp (+fsync)':<28}{t_cp:>10.2f}{mb / t_cp:>10.0f}{1.0:>8.2f}")
    print(f"{'forge convert --outtype bf16':<28}{t_conv:>10.2f}{mb / t_conv:>10.0f}{t_cp / t_conv:>8.2f}")
    if a.work is None:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
