"""Decode tokens/s with routed experts kept encoded (decoded per use, or streamed through an expert cache):
the compiled CPU kernels against torch's dequantize-then-matmul path (``FORGE_NO_NUMBA=1``).

    python benchmarks/encoded_decode.py [--layers 2] [--experts 64] [--threads 2] [--tokens 32] [--json OUT]
    python benchmarks/encoded_decode.py --dots      # ns per weight of one dot product from encoded bytes, per type
                                                    # (and on the 22-bit input where the host has AVX-512 VNNI)

Synthesizes (once, under the temp folder) a Q4_K file in Qwen3.6-35B-A3B's expert geometry with fewer layers
and experts and a 4,096-token vocabulary (so that the output matrix does not dominate), then measures one-token decode after 8 warm-up tokens. The expert cache holds every expert, so
the streamed figure is the compute of a cache hit (reads from the disk are benchmarks/streaming.py's part).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def measure(path: Path, mode: str, threads: int, tokens: int) -> float:
    import torch

    from runtime.models import load_model, prepare_decode

    torch.set_num_threads(threads)
    n_expert = None
    if mode == "streamed":
        from runtime.weights import GGUFWeights

        w = GGUFWeights(path)
        n_expert = len(w.expert_layers()) * int(w.hparam("expert_count"))
    kw = {"stream_experts": n_expert} if mode == "streamed" else {"expert_budget": 0}
    model = load_model(path, verify_experts=False, **kw)
    prepare_decode(model)
    state = model.new_state(tokens + 16)
    ids = torch.randint(0, model.vocab_size, (tokens + 8,), generator=torch.Generator().manual_seed(0))
    for i in range(8):
        model.forward(ids[i : i + 1], state)
    t = time.perf_counter()
    for i in range(8, tokens + 8):
        model.forward(ids[i : i + 1], state)
    return tokens / (time.perf_counter() - t)


def dot_speeds(n: int = 2048, rows: int = 256, reps: int = 20, acts: int = 0) -> dict[str, float]:
    """ns per weight of ``dot_row`` on one core, per type (random rows with small finite scales), the input
    prepared in form ``acts`` (``runtime.cpu_rows.activation_form``: 0 float32, 2 the 22-bit integers)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from numba import njit

    from runtime.cpu_rows import dot_row, prepare_input

    @njit
    def run(raw, qtype, x, x_sums, buf, reps):  # noqa: ANN001, ANN202
        s = np.float32(0)
        for _ in range(reps):
            for r in range(raw.shape[0]):
                s += dot_row(raw[r], qtype, x, x_sums, buf)
        return s

    rng = np.random.default_rng(0)
    x = rng.standard_normal(n).astype(np.float32)
    x_sums, buf = prepare_input(x, acts), np.empty(n, np.float32)
    out = {}
    for name, scale_at in (("Q4_K", (0, 2)), ("Q5_K", (0, 2)), ("Q6_K", (208,)), ("Q8_0", (0,))):
        qtype = GGMLQuantizationType[name]
        block, size = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (rows, n // block, size), dtype=np.uint8)
        for at in scale_at:
            raw[..., at : at + 2] = np.full((rows, n // block, 1), 0.001, np.float16).view(np.uint8)
        raw = raw.reshape(rows, -1)
        run(raw, int(qtype), x, x_sums, buf, 1)
        best = min(_timed(run, raw, int(qtype), x, x_sums, buf, reps) for _ in range(3))
        out[name] = round(best / (reps * rows * n) * 1e9, 3)
    return out


def _timed(fn, *args) -> float:  # noqa: ANN001
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--dots", action="store_true", help="only the per-type dot-product speeds")
    ap.add_argument("--one", nargs=2, metavar=("FILE", "MODE"), help=argparse.SUPPRESS)  # a child run
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(Path(args.one[0]), args.one[1], args.threads, args.tokens)))
        return
    if args.dots:
        # rows of 2,048 values (a dense or gate/up row of the 35B-A3B) and of 512 (its experts' down rows); the
        # K-quant rows also on the 22-bit integer input where the host has AVX-512 VNNI
        from runtime import cpu_vnni
        from runtime.cpu_rows import X22_ACTS

        out = {"ns_per_weight_one_core": dot_speeds(), "rows_of_512": dot_speeds(512, 1024)}
        if cpu_vnni.enabled():
            out["x22_ns_per_weight_one_core"] = dot_speeds(acts=X22_ACTS)
            out["x22_rows_of_512"] = dot_speeds(512, 1024, acts=X22_ACTS)
        print(json.dumps(out))
        return
    from runtime.synth import GEOMETRIES, SynthGeometry, synthesize

    path = Path(tempfile.gettempdir()) / f"forge-encoded-{args.layers}L-{args.experts}E-v4096-q4_k.gguf"
    if not path.exists():
        geo = GEOMETRIES["qwen3.6-35b-a3b"]
        synthesize(
            path,
            SynthGeometry(**{**geo.__dict__, "layers": args.layers, "experts": args.experts, "vocab": 4096}),
            "q4_k",
        )
    rows = []
    for mode in ("per-use", "streamed"):
        for kernels in (True, False):
            env = {**os.environ, "FORGE_NO_NUMBA": "" if kernels else "1"}
            cmd = [sys.executable, __file__, "--one", str(path), mode, "--threads", str(args.threads),
                   "--tokens", str(args.tokens)]  # fmt: skip
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            tps = json.loads(out.strip().splitlines()[-1])
            rows.append({"mode": mode, "path": "kernels" if kernels else "torch", "tok_s": round(tps, 2)})
            print(json.dumps(rows[-1]), flush=True)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\n{path.name} ({path.stat().st_size / 1e9:.2f} GB), {args.threads} threads, load average {load}")
    for r in rows:
        print(f"{r['mode']:<9} {r['path']:<8} {r['tok_s']:>8.2f} tok/s")
    if args.json:
        args.json.write_text(
            json.dumps({"file": path.name, "threads": args.threads, "load": load, "rows": rows})
        )


if __name__ == "__main__":
    main()
