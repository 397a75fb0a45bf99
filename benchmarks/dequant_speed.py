"""Dequantization throughput: runtime.dequant (torch) vs gguf.quants.dequantize (numpy).

    python benchmarks/dequant_speed.py [--values 4194304] [--repeat 5] [--threads N] [--types Q4_K,IQ2_XXS]

Prints MB/s of float32 output per type (median of --repeat runs) on the CPU, and on CUDA when
available, with the machine it ran on.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gq

from runtime.dequant import dequantize, supported_types

# Byte offsets of the fp16 scale fields (random bytes there could be NaN/inf, or denormals that
# slow some CPUs down); IQ1_M keeps its scale in the top nibbles of bytes 49, 51, 53, 55.
_FP16_FIELDS = {"Q4_1": (0, 2), "Q5_1": (0, 2), "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2),
                "Q5_K": (0, 2), "Q6_K": (208,), "IQ1_M": ()}  # fmt: skip


def sample_rows(qtype: GGMLQuantizationType, n_values: int, n_per_row: int = 4096) -> np.ndarray:
    rng = np.random.default_rng(int(qtype))
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_rows = max(1, n_values // n_per_row)
    data = rng.integers(0, 256, (n_rows, n_per_row // block_size * type_size), dtype=np.uint8)
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
        return data
    blocks = data.reshape(-1, type_size)
    scales = (rng.standard_normal((blocks.shape[0], 1)) * 0.02).astype(np.float16)
    for off in _FP16_FIELDS.get(qtype.name, (0,)):
        blocks[:, off : off + 2] = scales.view(np.uint8)
    if qtype == GGMLQuantizationType.IQ1_M:
        blocks[:, 49:56:2] &= 0x0F
        blocks[:, 55] |= 0x20  # fp16 0x2000-ish: a moderate positive scale
    return data


def median_seconds(fn: Callable[[], object], repeat: int, sync: Callable[[], None] = lambda: None) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--values", type=int, default=1 << 22, help="values per tensor on the CPU (CUDA: x16)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--types", default="", help="comma-separated type names (default: all supported)")
    ap.add_argument("--no-numpy", action="store_true", help="skip the gguf.quants reference")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    types = [
        GGMLQuantizationType[n.strip().upper()] for n in args.types.split(",") if n.strip()
    ] or supported_types()
    cuda = torch.cuda.is_available()
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
          f"torch {torch.__version__}" + (f", CUDA: {torch.cuda.get_device_name()}" if cuda else ""))  # fmt: skip
    print(f"MB/s of float32 output, median of {args.repeat}; {args.values} values per tensor on the CPU")
    header = f"{'type':8} {'torch cpu':>10} {'gguf-py':>10} {'speed-up':>9}" + (
        f" {'torch cuda':>11}" if cuda else ""
    )
    print(header)
    for qtype in types:
        block_size, _ = GGML_QUANT_SIZES[qtype]
        data = sample_rows(qtype, args.values)
        n_per_row = data.shape[-1] // GGML_QUANT_SIZES[qtype][1] * block_size
        mbytes = data.shape[0] * n_per_row * 4 / 1e6
        raw = torch.from_numpy(data)
        t_torch = median_seconds(lambda raw=raw, q=qtype, n=n_per_row: dequantize(raw, q, n), args.repeat)
        ref = (
            "-"
            if args.no_numpy
            else mbytes / median_seconds(lambda data=data, q=qtype: gq.dequantize(data, q), args.repeat)
        )
        line = f"{qtype.name:8} {mbytes / t_torch:10.0f} " + (f"{ref:10.0f} {ref and (mbytes / t_torch) / ref:8.1f}x"
                                                             if ref != "-" else f"{ref:>10} {'':9}")  # fmt: skip
        if cuda:
            big = torch.from_numpy(sample_rows(qtype, args.values * 16)).cuda()
            t_cuda = median_seconds(
                lambda big=big, q=qtype, n=n_per_row: dequantize(big, q, n),
                args.repeat,
                torch.cuda.synchronize,
            )
            line += f" {big.shape[0] * n_per_row * 4 / 1e6 / t_cuda:11.0f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
