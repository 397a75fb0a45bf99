"""The cuda backend's Triton kernels on GGUF blocks vs torch dequantize + matmul, on one GPU.

    python benchmarks/cuda_kernels.py [--types Q4_K,Q6_K] [--tokens 1] [--prefill 512] [--no-torch]
    python benchmarks/cuda_kernels.py --types Q4_K --gemm-sweep [--model F.gguf]   # prefill GEMM configurations

Shapes are the decode products of the Qwen3.6-35B-A3B geometry: hidden 2048, 256 experts of FFN 512,
top 8, attention 16 heads x 256 (q 4096 rows, 2 KV heads: k/v 512 rows, o 2048 x 4096), vocab 248320.
Per type and shape: kernel time (CUDA events via triton.testing.do_bench, L2 flushed before each
run), GB/s of weight bytes read (for the MoE products: the 8 selected experts' bytes), that as % of
the copy bandwidth measured first (bytes read + written by a 2 GiB device-to-device copy), and the
torch path (dequantize to float32 + matmul, what the runtime did on CUDA before these kernels).
Then prefill: TFLOP/s of the GEMM at --prefill tokens for the q projection and the routed-expert
gate projection (tokens grouped by expert on the device), against dequantize-to-bf16 + cuBLAS.
--gemm-sweep: the dense prefill products at the default plan and on fp16x2's tile shapes, then one layer's
routed products over the GEMM configurations (ck.GEMM_CONFIG) and precisions; --model F.gguf then times
the whole prefill at the best four.
"""

from __future__ import annotations

import argparse
import os

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from prefill_precision import best_prefill
from triton.testing import do_bench

from runtime.backends import cuda_kernels as ck
from runtime.dequant import dequantize
from runtime.synth import fp16_fields

HIDDEN, EXPERT_FF, EXPERTS, TOP_K, VOCAB = 2048, 512, 256, 8, 248320
DENSE = {
    "attn_q": (4096, HIDDEN),
    "attn_k/v": (512, HIDDEN),
    "attn_o": (HIDDEN, 4096),
    "output": (VOCAB, HIDDEN),
}
MOE = {"ffn_gate/up_exps": (EXPERT_FF, HIDDEN), "ffn_down_exps": (HIDDEN, EXPERT_FF)}
_FLOATS = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}


def random_rows(qtype: Q, rows: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 (rows, row_bytes) of random well-formed blocks, made on the GPU (finite fp16 scales)."""
    if qtype in _FLOATS:
        v = torch.randn(rows, k, device="cuda", generator=gen) * 0.05
        return v.to(_FLOATS[qtype]).view(torch.uint8)
    bs, ts = GGML_QUANT_SIZES[qtype]
    raw = torch.randint(0, 256, (rows * k // bs, ts), dtype=torch.uint8, device="cuda", generator=gen)
    for off in fp16_fields(qtype):
        d = torch.rand(raw.shape[0], device="cuda", generator=gen) * 0.018 + 0.002
        raw[:, off : off + 2] = d.half().view(torch.uint8).view(-1, 2)
    return raw.view(rows, -1)


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 2 GiB device-to-device copy."""
    a = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), warmup=5, rep=50)
    return 2 * (1 << 31) / (ms * 1e-3)


def graph_us(qtype: Q, raw: torch.Tensor, kernel, moe: bool, gen: torch.Generator, tokens: int) -> float:
    """Kernel time per call: a CUDA graph of calls on distinct weights (fresh expert ids per call for
    the MoE products; copies of a dense weight) so that L2 holds none of them, replayed."""
    calls = []
    if moe:
        for _ in range(32):
            ids = (
                torch.randperm(EXPERTS, device="cuda", generator=gen)[: tokens * TOP_K]
                .view(tokens, TOP_K)
                .int()
            )
            calls.append(lambda ids=ids: kernel(ids=ids))
    else:
        copies = [raw] + [raw.clone() for _ in range(min(63, (256 << 20) // raw.numel()))]
        calls = [lambda c=c: kernel(raw=c) for c in copies]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    ms = do_bench(g.replay, warmup=3, rep=50)
    return ms * 1e3 / len(calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=",".join(t.name for t in ck.supported_types()))
    ap.add_argument("--tokens", type=int, default=1, help="decode tokens per product (1..8)")
    ap.add_argument("--prefill", type=int, default=512, help="tokens of the prefill GEMM (0: skip)")
    ap.add_argument("--sweep", action="store_true", help="time GEMV tile configurations instead")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch dequantize + matmul timings")
    ap.add_argument(
        "--gemm-sweep", action="store_true", help="also time the prefill GEMM's tile configurations"
    )
    ap.add_argument("--model", help="with --gemm-sweep: a GGUF whose whole prefill is timed at the best ones")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}; copy bandwidth {bw / 1e9:.0f} GB/s (read + write)")
    print(
        f"decode, {args.tokens} token(s); times in microseconds. graph: per call of a CUDA graph of calls on"
    )
    print(
        "distinct weights (> L2 in all), no launch cost; eager: one Python call (launch included), L2 flushed"
    )
    print(
        f"{'type':8} {'product':18} {'N x K':>13} {'graph us':>9} {'eager us':>9} {'GB/s':>7} {'% copy':>7} "
        f"{'torch us':>9} {'x':>6}"
    )
    if args.sweep:
        return sweep(args, gen, bw)
    for name in args.types.split(","):
        qtype = Q[name.strip().upper()]
        for label, (n, k) in {**DENSE, **MOE}.items():
            moe = label in MOE
            raw = random_rows(qtype, (EXPERTS if moe else 1) * n, k, gen)
            if moe:
                raw = raw.view(EXPERTS, n, -1)
                ids = torch.randperm(EXPERTS, device="cuda", generator=gen)[: args.tokens * TOP_K]
                ids = ids.view(args.tokens, TOP_K).int()
                shape = (args.tokens, TOP_K, k) if "down" in label else (args.tokens, k)
                x = torch.randn(*shape, device="cuda", generator=gen)
                nbytes = args.tokens * TOP_K * n * raw.shape[-1]

                def kernel(x=x, raw=raw, ids=ids, qtype=qtype):
                    return ck.moe_linear(x, raw, qtype, ids)

                def torch_path(x=x, raw=raw, ids=ids, qtype=qtype, k=k):
                    w = dequantize(raw[ids.view(-1).long()], qtype, k)
                    xs = x.reshape(-1, 1, k) if x.dim() == 3 else x.repeat_interleave(TOP_K, 0)[:, None]
                    return torch.bmm(xs, w.transpose(1, 2))
            else:
                x = torch.randn(args.tokens, k, device="cuda", generator=gen)
                nbytes = raw.numel()

                def kernel(x=x, raw=raw, qtype=qtype):
                    return ck.linear(x, raw, qtype)

                def torch_path(x=x, raw=raw, qtype=qtype, k=k):
                    return x @ dequantize(raw, qtype, k).T

            eager_us = do_bench(kernel, warmup=10, rep=100) * 1e3
            us = graph_us(qtype, raw, kernel, moe, gen, args.tokens)
            t_us = float("nan") if args.no_torch else do_bench(torch_path, warmup=3, rep=50) * 1e3
            gbs = nbytes / (us * 1e-6) / 1e9
            print(
                f"{qtype.name:8} {label:18} {f'{n}x{k}':>13} {us:9.1f} {eager_us:9.1f} {gbs:7.0f} "
                f"{100 * gbs * 1e9 / bw:6.0f}% {t_us:9.1f} {t_us / us:6.1f}"
            )
            del raw
        torch.cuda.empty_cache()
    if args.prefill:
        prefill(args, gen)
    if args.gemm_sweep:
        m = args.prefill or 512
        for qtype in (Q[name.strip().upper()] for name in args.types.split(",")):
            dense_sweep(qtype, gen, m)
            rows = gemm_sweep(qtype, gen, m)
            if args.model:
                model_prefill(args.model, m, rows)


def sweep(args: argparse.Namespace, gen: torch.Generator, bw: float) -> None:
    """Graph time per call of each GEMV tile configuration (and the word kernel on/off) per type."""
    shapes = {"output": (VOCAB, HIDDEN, False), "attn_q": (4096, HIDDEN, False), "gate_exps": (512, HIDDEN, True),
              "down_exps": (HIDDEN, 512, True)}  # fmt: skip
    for name in args.types.split(","):
        qtype = Q[name.strip().upper()]
        for label, (n, k, moe) in shapes.items():
            raw = random_rows(qtype, (EXPERTS if moe else 1) * n, k, gen)
            if moe:
                raw = raw.view(EXPERTS, n, -1)
                x = torch.randn(
                    *((args.tokens, TOP_K, k) if "down" in label else (args.tokens, k)), device="cuda"
                )
                nbytes = args.tokens * TOP_K * n * raw.shape[-1]

                def kernel(x=x, raw=raw, qtype=qtype, ids=None):
                    return ck.moe_linear(x, raw, qtype, ids)
            else:
                x = torch.randn(args.tokens, k, device="cuda")
                nbytes = raw.numel()

                def kernel(x=x, raw=raw, qtype=qtype):
                    return ck.linear(x, raw, qtype)

            has_words = ck.ggml_types.implementation("cuda", qtype).words is not None
            for words in ("all", "0") if has_words else ("",):
                os.environ["FORGE_CUDA_WORDS"] = words
                for bn, warps, split in ((0, 0, 0), (8, 4, 1), (16, 4, 1), (16, 2, 1), (8, 4, 2), (16, 4, 2),
                                         (16, 4, 4), (8, 2, 4)):  # fmt: skip
                    if split > 1 and (words == "0" or k // 256 % split):
                        continue
                    with ck.configured(
                        ck.GEMV_CONFIG, bn=bn or None, warps=warps or None, split=split or None
                    ):
                        us = graph_us(qtype, raw, kernel, moe, gen, args.tokens)
                    gbs = nbytes / (us * 1e-6) / 1e9
                    print(f"{qtype.name:8} {label:10} words={words} BN={bn:3} warps={warps} split={split} "
                          f"{us:9.1f} us {gbs:6.0f} GB/s {100 * gbs * 1e9 / bw:4.0f}%")  # fmt: skip
            del raw
        torch.cuda.empty_cache()
    os.environ.pop("FORGE_CUDA_WORDS", None)


PREFILL_PRECISIONS = ("auto", "bf16x3", "tf32x3", "bf16x2", "bf16")


def prefill(args: argparse.Namespace, gen: torch.Generator) -> None:
    m = args.prefill
    print(f"\nprefill GEMM, {m} tokens: TFLOP/s (2 M N K / time; MoE: M = tokens x top-8 pairs)")
    print(
        f"{'type':8} {'product':18} {'precision':>9} {'kernel ms':>10} {'TFLOP/s':>8} {'torch bf16 ms':>14}"
    )
    for name in args.types.split(","):
        qtype = Q[name.strip().upper()]
        n, k = DENSE["attn_q"]
        raw = random_rows(qtype, n, k, gen)
        x = torch.randn(m, k, device="cuda", generator=gen)
        t_ms = do_bench(
            lambda raw=raw, x=x, qtype=qtype, k=k: x.bfloat16() @ dequantize(raw, qtype, k, torch.bfloat16).T
        )
        for prec in PREFILL_PRECISIONS:
            ms = do_bench(
                lambda raw=raw, x=x, qtype=qtype, prec=prec: ck.linear(x, raw, qtype, precision=prec)
            )
            print(
                f"{qtype.name:8} {'attn_q':18} {prec:>9} {ms:10.3f} {2 * m * n * k / ms / 1e9:8.1f} {t_ms:14.3f}"
            )
        n, k = MOE["ffn_gate/up_exps"]
        raw = random_rows(qtype, EXPERTS * n, k, gen).view(EXPERTS, n, -1)
        ids = torch.stack(
            [torch.randperm(EXPERTS, device="cuda", generator=gen)[:TOP_K] for _ in range(m)]
        ).int()
        for prec in PREFILL_PRECISIONS:
            ms = do_bench(
                lambda raw=raw, x=x, ids=ids, qtype=qtype, prec=prec: ck.moe_linear(x, raw, qtype, ids, prec)
            )
            flops = 2 * m * TOP_K * n * k
            print(
                f"{qtype.name:8} {'ffn_gate_exps':18} {prec:>9} {ms:10.3f} {flops / ms / 1e9:8.1f} {'':>14}"
            )
        del raw
        torch.cuda.empty_cache()


def timed_configs(products: dict, configs: list[tuple[dict, str | None]]) -> list[tuple[float, dict, dict]]:
    """Each (GEMM_CONFIG values, precision; None: "auto") timed on every product (a function of the precision),
    the configurations the chip refuses reported and skipped: rows of (total ms, ms per product, the
    configuration with its precision)."""
    out = []
    for cfg, prec in configs:
        try:
            with ck.configured(ck.GEMM_CONFIG, **cfg):
                times = {
                    name: do_bench(lambda f=fn, p=prec: f(p), warmup=5, rep=30)
                    for name, fn in products.items()
                }
        except Exception as e:  # a configuration past the shared memory or registers of the chip
            print(f"  {cfg} {prec}: {type(e).__name__}")
            continue
        out.append((sum(times.values()), times, {**cfg, "precision": prec or "auto"}))
    return out


def gemm_sweep(qtype: Q, gen: torch.Generator, m: int) -> list[tuple[float, dict, dict]]:
    """Times of one layer's routed prefill products at m tokens (gate+up as one 1,024-row weight, and down; top-8
    of 256 experts at random) over the integer-code GEMM's configurations (ck.GEMM_CONFIG): the kernel on x as
    it is (xt 0, its default tiles), both with K split in 2 and 4 parts, on x split once (xt 1) at each tile
    shape, then the best three at bf16x2, and for Q4_K / Q5_K the super-block kernel (fp16x2) at its tile
    shapes; best first."""
    gate_up = random_rows(qtype, EXPERTS * 2 * EXPERT_FF, HIDDEN, gen).view(EXPERTS, 2 * EXPERT_FF, -1)
    down = random_rows(qtype, EXPERTS * HIDDEN, EXPERT_FF, gen).view(EXPERTS, HIDDEN, -1)
    ids = torch.stack([torch.randperm(EXPERTS, device="cuda", generator=gen)[:TOP_K] for _ in range(m)]).int()
    x = torch.randn(m, HIDDEN, device="cuda", generator=gen)
    act = torch.randn(m, TOP_K, EXPERT_FF, device="cuda", generator=gen)
    products = {
        "gate_up": lambda prec: ck.moe_linear(x, gate_up, qtype, ids, prec),
        "down": lambda prec: ck.moe_linear(act, down, qtype, ids, prec),
    }

    configs = (
        [dict(xt=0)]
        + [dict(xt=xt, split=split) for xt in (0, 1) for split in (2, 4)]
        + [
            dict(xt=1, bn=bn, warps=warps, stages=stages, bm=bm)
            for bm in (16, 32)
            for bn, warps in ((64, 4), (64, 8), (128, 4), (128, 8), (256, 8))  # larger tiles spill at 4 warps
            for stages in (3, 4)
        ]
    )
    rows = sorted(timed_configs(products, [(cfg, "bf16x3") for cfg in configs]), key=lambda r: r[0])
    best = [({k: v for k, v in cfg.items() if k != "precision"}, "bf16x2") for _, _, cfg in rows[:3]]
    rows += timed_configs(products, best)
    if qtype in ck._FOLD_TYPES:  # a super-block's groups as one product (fp16x2)
        fold = [
            (dict(bn=bn, warps=warps, stages=stages, bm=bm), "fp16x2")
            for bm in (16, 32)
            for bn, warps in ((64, 4), (64, 8), (128, 8))
            for stages in (2, 3, 4)
        ]
        rows += timed_configs(products, fold)
    rows.sort(key=lambda r: r[0])
    print(
        f"\n{qtype.name} routed prefill GEMMs, {m} tokens (ms): gate_up + down, gate_up, down; configuration"
    )
    for total, t, cfg in rows:
        print(f"  {total:7.3f} {t['gate_up']:7.3f} {t['down']:7.3f}  {cfg}")
    return rows


def dense_sweep(qtype: Q, gen: torch.Generator, m: int) -> None:
    """Times of the dense prefill products at m tokens (a 5,120 x 2,048 input projection and a 2,048 x 4,096
    output one) at the default plan and, for Q4_K / Q5_K, the super-block kernel (fp16x2) at its tile shapes."""
    configs: list[tuple[dict, str | None]] = [({}, None)]
    if qtype in ck._FOLD_TYPES:
        configs += [
            (dict(bn=bn, warps=warps, stages=3, bm=bm), "fp16x2")
            for bm in (32, 64, 128)
            for bn, warps in ((64, 4), (128, 4), (128, 8))
        ]
    print(f"\n{qtype.name} dense prefill GEMMs, {m} tokens (ms): 5120x2048 + 2048x4096; configuration")
    products = {}
    for n, k in ((5120, HIDDEN), (HIDDEN, 4096)):
        raw, x = random_rows(qtype, n, k, gen), torch.randn(m, k, device="cuda", generator=gen)
        products[f"{n}x{k}"] = lambda prec, raw=raw, x=x: ck.linear(x, raw, qtype, prec)
    for total, t, cfg in sorted(timed_configs(products, configs), key=lambda r: r[0]):
        print(f"  {total:7.3f} {t['5120x2048']:7.3f} {t['2048x4096']:7.3f}  {cfg}")


def model_prefill(path: str, m: int, rows: list[tuple[float, dict, dict]], top: int = 4) -> None:
    """Whole-model prefill of m random tokens (last-token logits, as llama-bench; best of 5) at the default plan
    and at the ``top`` best sweep configurations, with the logits' largest deviation from the default's."""
    from runtime.models import load_model

    model = load_model(path, "cuda")
    ids = torch.randint(0, model.vocab_size, (m,), generator=torch.Generator().manual_seed(0)).cuda()

    def prefill_ms(cfg: dict) -> tuple[float, torch.Tensor]:
        os.environ["FORGE_CUDA_PRECISION"] = cfg.get("precision", "auto")
        try:
            with ck.configured(ck.GEMM_CONFIG, **{k: v for k, v in cfg.items() if k != "precision"}):
                seconds, logits = best_prefill(model, ids, 5)
        finally:
            os.environ.pop("FORGE_CUDA_PRECISION")
        return seconds * 1e3, logits

    base_ms, base = prefill_ms({})
    print(f"\nmodel prefill, {m} tokens: default plan {base_ms:.1f} ms ({m / base_ms * 1e3:.0f} tok/s)")
    for _, _, cfg in rows[:top]:
        ms, logits = prefill_ms(cfg)
        dev = ((logits - base).abs().max() / base.abs().max()).item()
        print(f"  {ms:7.1f} ms ({m / ms * 1e3:6.0f} tok/s), logits within {dev:.1e} of the default's: {cfg}")


if __name__ == "__main__":
    main()
