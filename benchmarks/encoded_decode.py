"""Decode tokens/s with routed experts kept encoded (decoded per use, or streamed through an expert cache):
the compiled CPU kernels against torch's dequantize-then-matmul path (``FORGE_NO_NUMBA=1``).

    python benchmarks/encoded_decode.py [--layers 2] [--experts 64] [--threads 2] [--tokens 32] [--json OUT]

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--one", nargs=2, metavar=("FILE", "MODE"), help=argparse.SUPPRESS)  # a child run
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(Path(args.one[0]), args.one[1], args.threads, args.tokens)))
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
