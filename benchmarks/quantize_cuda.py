"""Device (CUDA) encoder throughput against the CPU codecs, same bytes checked.

    PYTHONPATH=. python benchmarks/quantize_cuda.py [--device cuda] [--types q4_k q4_k+imat iq2_xxs+imat]
        [--rows 4096] [--cols 4096] [--cpu-rows N] [--repeat 3] [--numpy] [--json]

A Gaussian float32 matrix (default 4096 x 4096, 64 MiB) is encoded by ``encode_on_device`` (host to
device copy, encode, copy back, all timed) and by the CPU codec (``QuantType.encode``: the numba
kernels where a type has one, or the numpy encoders with ``--numpy``; threads: FORGE_THREADS). MB/s
are MB (1e6 bytes) of float32 input per wall-clock second; the device figure is the best of
``--repeat`` runs after a warm-up (CUDA context, codebook upload). The CPU path is timed once on the
first ``--cpu-rows`` rows (default: all) and its bytes are compared with the device's for those
rows. ``+imat`` cases use a random importance vector.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

DEFAULT_CASES = ("q4_k", "q4_k+imat", "iq2_xxs+imat")


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return device


def run_case(
    case: str, x: np.ndarray, imp: np.ndarray, device: str, cpu_rows: int, repeat: int
) -> dict[str, object]:
    from forge.quant.kernels import enabled as kernels_enabled
    from forge.quant.torch_codecs import encode_on_device
    from forge.quant.types import get_type

    name, _, flag = case.partition("+")
    qt = get_type(name)
    w = imp if flag == "imat" else None
    mb = x.nbytes / 1e6

    encode_on_device(qt.name(), x[:16], w, device)  # warm-up
    _sync(device)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = encode_on_device(qt.name(), x, w, device)
        _sync(device)
        times.append(time.perf_counter() - t0)

    xs = x[:cpu_rows]
    qt.encode(xs[:8], w)  # warm-up (numba's cache or compile)
    t0, c0 = time.perf_counter(), time.process_time()
    ref = qt.encode(xs, w)
    cpu_s, cpu_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    return {
        "type": qt.name(),
        "imatrix": w is not None,
        "device_s_best": min(times),
        "device_s_all": times,
        "device_mb_s": mb / min(times),
        "cpu_path": "numba" if kernels_enabled() else "numpy",
        "cpu_rows": int(xs.shape[0]),
        "cpu_s": cpu_s,
        "cpu_mb_s": xs.nbytes / 1e6 / cpu_s,
        "cpu_mb_s_per_cpu_second": xs.nbytes / 1e6 / max(cpu_cpu_s, 1e-9),
        "same_bytes_rows_checked": int(xs.shape[0]),
        "same_bytes": bool(np.array_equal(out[: xs.shape[0]], ref)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--types", nargs="*", default=list(DEFAULT_CASES), help="TYPE or TYPE+imat")
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--cpu-rows", type=int, default=None, help="rows the CPU path encodes (default: all)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--numpy", action="store_true", help="CPU path: numpy encoders (FORGE_NO_NUMBA=1)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args()
    if args.numpy:
        os.environ["FORGE_NO_NUMBA"] = "1"

    import torch

    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.rows, args.cols), dtype=np.float32)
    imp = rng.uniform(0.1, 2, args.cols).astype(np.float32)
    cpu_rows = min(args.rows, args.cpu_rows or args.rows)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    report: dict[str, object] = {
        "device": args.device,
        "device_name": _device_name(args.device),
        "torch": torch.__version__,
        "matrix": [args.rows, args.cols],
        "cpu_cores": os.cpu_count(),
        "forge_threads": os.environ.get("FORGE_THREADS", "default"),
        "load_1min": load,
        "cases": [run_case(c.lower(), x, imp, args.device, cpu_rows, args.repeat) for c in args.types],
    }
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(
        f"{report['device_name']} (torch {report['torch']}), matrix {args.rows}x{args.cols}, "
        f"{report['cpu_cores']} cores, load {load:.2f}"
    )
    print(
        f"{'type':<9}{'imatrix':<9}{'device MB/s':>12}{'cpu path':>10}{'cpu MB/s':>10}{'rows':>7}  same bytes"
    )
    for c in report["cases"]:  # type: ignore[union-attr]
        print(
            f"{c['type']:<9}{'yes' if c['imatrix'] else 'no':<9}{c['device_mb_s']:>12.1f}{c['cpu_path']:>10}"
            f"{c['cpu_mb_s']:>10.1f}{c['cpu_rows']:>7}  {c['same_bytes']}"
        )


if __name__ == "__main__":
    main()
