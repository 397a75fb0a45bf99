"""The cuda backend's prefill GEMM precisions on one GGUF file: time and logit deviation from "ieee".

    python benchmarks/prefill_precision.py MODEL.gguf [--tokens 512] [--precisions auto,fp16x2,bf16x3,tf32x3,bf16x2]
    python benchmarks/prefill_precision.py MODEL.gguf --profile     # where one prefill's GPU time goes

Loads the model once on CUDA, runs a prefill of --tokens random ids with every precision
(FORGE_CUDA_PRECISION, read at each launch) and prints the best of --reps times and
max |logits - logits(ieee)| / max |logits(ieee)|: "ieee" takes float32 products on the decoded
weights, so it is the float32 reference the runtime's 1e-4 acceptance is stated against.
"""

from __future__ import annotations

import argparse
import bisect
import os
import time

import torch

from runtime.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--precisions", default="auto,fp16x2,bf16x3,tf32x3,bf16x2")
    ap.add_argument("--profile", action="store_true", help="only profile one prefill (default precision)")
    args = ap.parse_args()
    model = load_model(args.model, "cuda")
    ids = torch.randint(
        0, model.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0)
    ).cuda()
    if args.profile:
        profile(model, ids)
        return
    ref = None
    print(f"{'precision':>9} {'prefill ms':>11} {'tok/s':>9} {'max dev / max logit':>20}")
    for prec in ["ieee", *args.precisions.split(",")]:
        os.environ["FORGE_CUDA_PRECISION"] = prec
        best, logits = best_prefill(model, ids, args.reps + 1, last_only=False)  # the first run compiles
        if ref is None:
            ref = logits
        dev = ((logits - ref).abs().max() / ref.abs().max()).item()
        print(f"{prec:>9} {best * 1e3:11.1f} {args.tokens / best:9.0f} {dev:20.2e}")
    os.environ.pop("FORGE_CUDA_PRECISION")


def best_prefill(model, ids: torch.Tensor, reps: int, last_only: bool = True) -> tuple[float, torch.Tensor]:  # noqa: ANN001
    """The best seconds of ``reps`` prefills of ``ids`` on fresh states (synchronized; the state is made before
    the clock starts, as runtime_speed.py and llama-bench do), and the last logits."""
    best = float("inf")
    for _ in range(reps):
        state = model.new_state()
        torch.cuda.synchronize()
        t = time.perf_counter()
        logits = model.forward(ids, state, last_only=last_only)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best, logits


#: the profiler ranges ``_labelled`` opens start with these
_PRODUCT_RANGES = ("linear ", "moe_linear ")


def _labelled(fn, kind: str):  # noqa: ANN001, ANN202
    """``fn`` (a cuda_kernels product) inside a profiler range named by the product's kind, weight shape
    and type, so that the profile adds up GPU time per product."""
    from torch.profiler import record_function

    def call(x, raw, qtype, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        shape = "x".join(str(d) for d in raw.shape[:-1])
        name = getattr(qtype, "name", None) or str(int(qtype))
        with record_function(f"{kind} {shape} {name} {tuple(x.shape[:-1])}"):
            return fn(x, raw, qtype, *args, **kw)

    return call


def profile(model, ids: torch.Tensor) -> None:  # noqa: ANN001
    """The kernels of one prefill (after a warm-up that compiles them), by total GPU time, then the GPU
    time of each product (dense ``linear`` / routed ``moe_linear``, by weight shape, type and rows)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from runtime.backends import cuda_kernels

    wall, _ = best_prefill(model, ids, 3)  # the first compiles
    cuda_kernels.linear = _labelled(cuda_kernels.linear, "linear")
    cuda_kernels.moe_linear = _labelled(cuda_kernels.moe_linear, "moe_linear")
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model.forward(ids, model.new_state(), last_only=True)
        torch.cuda.synchronize()
    averages = prof.key_averages()
    print(averages.table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60))
    print(averages.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
    print(product_table(prof.events()))
    gpu_ms = sum(e.time_range.elapsed_us() for e in prof.events() if _is_kernel(e)) / 1e3
    print(f"prefill of {len(ids)} tokens (logits of the last, as llama-bench): {wall * 1e3:.1f} ms wall "
          f"(best of 3, no profiler), {gpu_ms:.1f} ms of GPU kernels: the GPU waits {wall * 1e3 - gpu_ms:.1f} ms")  # fmt: skip


def _is_kernel(e) -> bool:  # noqa: ANN001
    return e.device_type != torch.autograd.DeviceType.CPU and not e.name.startswith(_PRODUCT_RANGES)


def product_table(events) -> str:  # noqa: ANN001
    """GPU kernel time per product: each GPU kernel is counted in the product whose range (the profiler's GPU
    copy of a ``_labelled`` range) holds its start, against the kernels' total. (A range's own GPU span also
    holds the gaps between its kernels, and its CPU copy often none of them: neither adds up.)"""
    gpu = [e for e in events if e.device_type != torch.autograd.DeviceType.CPU]
    labels = sorted(
        (e.time_range.start, e.time_range.end, e.name) for e in gpu if e.name.startswith(_PRODUCT_RANGES)
    )
    kernels = [e for e in gpu if _is_kernel(e)]
    total = sum(e.time_range.elapsed_us() for e in kernels) or 1
    per: dict[str, list[float]] = {}
    for k in kernels:
        at = bisect.bisect_right(labels, (k.time_range.start, float("inf"), "")) - 1
        if at >= 0 and labels[at][0] <= k.time_range.start < labels[at][1]:
            per.setdefault(labels[at][2], []).append(k.time_range.elapsed_us())
    lines = [f"{'product':<60} {'kernels':>8} {'GPU ms':>9} {'% of GPU':>9}"]
    for name, times in sorted(per.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"{name:<60} {len(times):>8} {sum(times) / 1e3:9.2f} {100 * sum(times) / total:8.1f}%")
    lines.append(f"{'all kernels':<60} {len(kernels):>8} {total / 1e3:9.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
