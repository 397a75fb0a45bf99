"""Expert-major conversion and verification throughput vs ``cp`` of the same file.

Builds a synthetic canonical qwen3moe GGUF of about 2 GB (Q4_K gate/up, Q6_K down experts of
random bytes; conversion never decodes them), then times, each after dropping nothing from the
page cache (all runs read warm data, like ``cp`` does here):

    cp SRC DST                     (baseline; and cp followed by fsync of DST, since we fsync)
    (wall time and the CPU seconds used are both printed: on a shared machine the wall time
    depends on the other processes, the CPU seconds do not)
    convert --to v2 --skip-verify  (source SHA-256 + payload SHA-256 included)
    verify SRC NATIVE              (every byte compared, both digests recomputed)
    convert --to v2                (convert + full verify before install)
    convert --to canonical         (rebuild + SHA-256 check against the recorded digest)

Usage: python benchmarks/layout_speed.py [--gb 2.0] [--dir /tmp] [--keep]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

from forge.layout.convert import convert
from forge.layout.verify import verify_files

Q = GGMLQuantizationType


def build_source(path: Path, gb: float) -> None:
    n_embd, n_ff, experts = 2048, 768, 64
    per_layer = sum(n_ff * n_embd // 256 * GGML_QUANT_SIZES[t][1] * experts for t in (Q.Q4_K, Q.Q4_K, Q.Q6_K))
    layers = max(1, round(gb * 1e9 / per_layer))
    rng = np.random.default_rng(0)
    w = GGUFWriter(path, "qwen3moe")
    for key, value in (("block_count", layers), ("expert_count", experts), ("expert_used_count", 8)):
        w.add_uint32(f"qwen3moe.{key}", value)
    w.add_tensor(
        "token_embd.weight", rng.integers(0, 256, (4096, n_embd // 32 * 34), np.uint8), raw_dtype=Q.Q8_0
    )
    for layer in range(layers):
        for name, t, rows, cols in sorted(
            [
                (f"blk.{layer}.ffn_gate_exps.weight", Q.Q4_K, n_ff, n_embd),
                (f"blk.{layer}.ffn_up_exps.weight", Q.Q4_K, n_ff, n_embd),
                (f"blk.{layer}.ffn_down_exps.weight", Q.Q6_K, n_embd, n_ff),
                (f"blk.{layer}.ffn_gate_inp.weight", Q.F32, experts, n_embd),
            ]
        ):
            if t == Q.F32:
                w.add_tensor(name, rng.standard_normal((rows, cols)).astype(np.float32))
            else:
                row_bytes = cols // 256 * GGML_QUANT_SIZES[t][1]
                w.add_tensor(name, rng.integers(0, 256, (experts, rows, row_bytes), np.uint8), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def timed(fn) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(wall seconds, CPU seconds of this process and its children, all threads)."""
    os.sync()  # earlier runs' dirty pages must not be flushed on this run's clock
    c, t = _cpu(), time.perf_counter()
    fn()
    return time.perf_counter() - t, _cpu() - c


def cp_fsync(src: Path, dst: Path) -> None:
    subprocess.run(["cp", str(src), str(dst)], check=True)
    fd = os.open(dst, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--repeat", type=int, default=2, help="best of N runs")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="layout-speed-", dir=args.dir))
    try:
        src, native, back, copy = (work / n for n in ("src.gguf", "native.gguf", "back.gguf", "copy.gguf"))
        build_source(src, args.gb)
        size = src.stat().st_size
        subprocess.run(["cat", str(src)], stdout=subprocess.DEVNULL, check=True)  # warm the page cache

        def best(fn, fresh: tuple[Path, ...] = ()) -> tuple[float, float]:  # type: ignore[no-untyped-def]
            runs = []
            for _ in range(args.repeat):
                for p in fresh:
                    p.unlink(missing_ok=True)
                runs.append(timed(fn))
            return min(runs)

        rows = [
            ("cp", best(lambda: subprocess.run(["cp", str(src), str(copy)], check=True), (copy,))),
            ("cp + fsync", best(lambda: cp_fsync(src, copy), (copy,))),
            (
                "convert --to v2 --skip-verify",
                best(lambda: convert(src, native, "v2", verify=False), (native,)),
            ),
            ("verify", best(lambda: verify_files(src, native))),
            ("convert --to v2 (with verify)", best(lambda: convert(src, native, "v2"), (native,))),
            ("convert --to canonical", best(lambda: convert(native, back, "canonical"), (back,))),
        ]
        assert back.read_bytes() == src.read_bytes()
        blob = os.urandom(256 << 20)
        rows.append(
            ("one SHA-256 stream (in memory)", timed(lambda: [hashlib.sha256(blob) for _ in range(8)]))
        )
        rows[-1] = (rows[-1][0], tuple(x * size / (8 * len(blob)) for x in rows[-1][1]))  # scaled to the file
        base = size / rows[0][1][0]
        load = os.getloadavg()[0]
        print(
            f"file {size / 1e9:.2f} GB, {os.cpu_count()} CPUs, load average {load:.1f}; best of {args.repeat}"
        )
        print(
            "page cache warm; every run starts after os.sync(); MB = 1e6 bytes; cpu = all threads + children"
        )
        print(f"{'operation':<32} {'seconds':>8} {'MB/s':>8} {'vs cp':>7} {'cpu s':>7}")
        for name, (secs, cpu) in rows:
            rate = size / secs
            print(f"{name:<32} {secs:>8.2f} {rate / 1e6:>8.0f} {rate / base:>7.0%} {cpu:>7.2f}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
