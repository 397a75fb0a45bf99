"""Device (CUDA) encoder throughput against the CPU codecs, same bytes checked.

    PYTHONPATH=. python benchmarks/quantize_cuda.py [--device cuda] [--types q4_k q4_k+imat iq2_xxs+imat]
        [--rows 4096] [--cols 4096] [--cpu-rows N] [--numpy-rows N] [--repeat 3] [--chunk-elems N] [--json]

A Gaussian float32 matrix (default 4096 x 4096, 64 MiB) is encoded by ``encode_on_device`` (host to
device copy, encode, copy back, all timed) and by the CPU codecs (``QuantType.encode``; threads:
FORGE_THREADS): the default path (numba kernels where a type has one) on the first ``--cpu-rows``
rows (default: all), and the numpy encoders (FORGE_NO_NUMBA=1) on the first ``--numpy-rows`` rows
(default 512; 0 skips). MB/s are MB (1e6 bytes) of float32 input per wall-clock second; the device
figure is the best of ``--repeat`` runs after a warm-up (CUDA context, codebook upload); ``encoder`` is the
device encoder alone on the matrix already on the device (no checks, no copies). Each CPU
path's bytes are compared with the device's on the rows it encoded. ``+imat`` cases use a random
importance vector.
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


def _time_cpu(qt: type, xs: np.ndarray, w: np.ndarray | None, numpy_only: bool) -> tuple[np.ndarray, float]:
    saved = os.environ.get("FORGE_NO_NUMBA")
    if numpy_only:
        os.environ["FORGE_NO_NUMBA"] = "1"
    try:
        qt.encode(xs[:8], w)  # warm-up (numba's cache or compile)
        t0 = time.perf_counter()
        out = qt.encode(xs, w)
        return out, time.perf_counter() - t0
    finally:
        if saved is None:
            os.environ.pop("FORGE_NO_NUMBA", None)
        else:
            os.environ["FORGE_NO_NUMBA"] = saved


def _encoder_rate(qt: object, x: np.ndarray, w: np.ndarray | None, device: str, repeat: int) -> float:
    """MB/s of the device encoder alone: the whole matrix already on the device, no checks, no copies back."""
    import torch

    from forge import ggml_types

    encode = ggml_types.implementation("gpu_encode", qt.ggml_type)
    xs = torch.from_numpy(x).to(device)
    ws = None if w is None else torch.from_numpy(w).to(device)
    with torch.inference_mode():
        encode(xs[:16], ws)
        best = float("inf")
        for _ in range(repeat):
            _sync(device)
            t0 = time.perf_counter()
            encode(xs, ws)
            _sync(device)
            best = min(best, time.perf_counter() - t0)
    return x.nbytes / 1e6 / best


def run_case(
    case: str,
    x: np.ndarray,
    imp: np.ndarray,
    device: str,
    cpu_rows: int,
    numpy_rows: int,
    repeat: int,
    chunk_elems: int | None,
) -> dict[str, object]:
    from forge.jit import enabled as kernels_enabled
    from forge.quant.torch_codecs import encode_on_device
    from forge.quant.types import get_type

    name, _, flag = case.partition("+")
    qt = get_type(name)
    w = imp if flag == "imat" else None

    import torch

    encode_on_device(qt.name(), x[:16], w, device, chunk_elems)  # warm-up
    _sync(device)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = encode_on_device(qt.name(), x, w, device, chunk_elems)
        _sync(device)
        times.append(time.perf_counter() - t0)
    result: dict[str, object] = {
        "type": qt.name(),
        "imatrix": w is not None,
        "device_s": times,
        "device_mb_s": x.nbytes / 1e6 / min(times),
        "device_peak_mib": torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None,
        "encoder_mb_s": _encoder_rate(qt, x, w, device, repeat),
    }
    paths = [("numba" if kernels_enabled() else "numpy", cpu_rows, False)]
    if numpy_rows and paths[0][0] != "numpy":
        paths.append(("numpy", numpy_rows, True))
    for label, n, numpy_only in paths:
        ref, seconds = _time_cpu(qt, x[:n], w, numpy_only)
        result[label] = {
            "rows": n,
            "s": seconds,
            "mb_s": x[:n].nbytes / 1e6 / seconds,
            "same_bytes": bool(np.array_equal(out[:n], ref)),
        }
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--types", nargs="*", default=list(DEFAULT_CASES), help="TYPE or TYPE+imat")
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument(
        "--cpu-rows", type=int, default=None, help="rows the default CPU path encodes (default: all)"
    )
    ap.add_argument("--numpy-rows", type=int, default=512, help="rows the numpy encoders encode (0: skip)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--chunk-elems", type=int, default=None, help="device chunk size (default: per type)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args()

    import torch

    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.rows, args.cols), dtype=np.float32)
    imp = rng.uniform(0.1, 2, args.cols).astype(np.float32)
    cpu_rows = min(args.rows, args.cpu_rows or args.rows)
    numpy_rows = min(args.rows, args.numpy_rows)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    report: dict[str, object] = {
        "device": args.device,
        "device_name": _device_name(args.device),
        "torch": torch.__version__,
        "matrix": [args.rows, args.cols],
        "cpu_cores": os.cpu_count(),
        "forge_threads": os.environ.get("FORGE_THREADS", "default"),
        "load_1min": load,
        "cases": [
            run_case(c.lower(), x, imp, args.device, cpu_rows, numpy_rows, args.repeat, args.chunk_elems)
            for c in args.types
        ],
    }
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(
        f"{report['device_name']} (torch {report['torch']}), matrix {args.rows}x{args.cols}, "
        f"{report['cpu_cores']} cores, load {load:.2f}"
    )
    print(
        f"{'type':<9}{'imatrix':<9}{'device MB/s':>12}{'encoder':>10}   CPU paths (MB/s on rows, same bytes)"
    )
    for c in report["cases"]:  # type: ignore[union-attr]
        cpu = "; ".join(
            f"{p} {c[p]['mb_s']:.1f} on {c[p]['rows']} rows, {c[p]['same_bytes']}"  # type: ignore[index]
            for p in ("numba", "numpy")
            if p in c
        )
        print(f"{c['type']:<9}{'yes' if c['imatrix'] else 'no':<9}{c['device_mb_s']:>12.1f}"
              f"{c['encoder_mb_s']:>10.1f}   {cpu}")  # fmt: skip


if __name__ == "__main__":
    main()
