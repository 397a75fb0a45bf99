"""What `forge recipe search` costs as the model and the calibration grow, and an extrapolation to a 35B run.

    python benchmarks/recipe_search_cost.py [--layers 1,2] [--tokens 64,128] [--experts 256] [--vocab 248320]
        [--encode-types all] [--work DIR] [--json out.json]

The models are `forge synth --geometry qwen3.6-35b-a3b --layers N` (qwen3moe blocks at that geometry: hidden
2048, 256 experts of 512, 8 used, 16 heads / 2 KV heads of 256, vocabulary 248,320; random Q8_0 weights,
made bf16 by `forge quantize --allow-requantize`). The real Qwen3.6-35B-A3B also has Gated DeltaNet layers
and a shared expert, which this synthesized block does not: the extrapolation counts its groups, not the real
model's, and says so.

Three measurements:
1. encoding: every candidate type's file (`forge quantize` with that type everywhere) of a 1-layer model with
   `--encode-experts` experts and a 4,096 vocabulary (importance weights collected on 2 x 128 tokens of
   calib.txt): seconds per million parameters, per type, one process;
2. measuring: a search (per-tensor groups, types q4_k,q8_0, no correction) on N-layer full-geometry models
   and one calibration chunk of T tokens; a candidate in layer L reruns layers L.. and the head, so the
   seconds are fitted as  (sum over candidates of the layers they rerun) x t_layer + candidates x t_head;
3. the knapsack: `knapsack.solve` on random costs with the group and option counts of a 35B search.
`--per-layer T` times a candidate's parts directly (a layer rerun, the head, the build, at T tokens, on the
2-layer model once the shared decoded matrices are warm) and extrapolates from those: since candidates share
the base's decoded matrices, the fixed part of the fit above is mostly gone and 1-2 layers no longer separate
it from noise.
The extrapolation multiplies these out for 40 layers, 12 types and 4 x 512 calibration tokens, on this machine,
with each cost linear in the tokens (fitted from the two token counts) and its fixed part paid once per
candidate or once per chunk (the two ends of the range printed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from forge.imatrix.accumulate import collect  # noqa: E402
from forge.imatrix.formats import read_imatrix  # noqa: E402
from forge.quant.quantize import quantize  # noqa: E402
from forge.quant.source import source_ref  # noqa: E402
from forge.search.knapsack import solve  # noqa: E402
from forge.search.measure import DEFAULT_TYPES, make_groups, type_file_recipe  # noqa: E402
from forge.search.search import search  # noqa: E402
from runtime.synth import synthesize  # noqa: E402

CALIB = ROOT / "tests/fixtures/text/calib.txt"
GEOMETRY = "qwen3.6-35b-a3b"


def bf16_model(work: Path, layers: int, **kw: int) -> Path:
    tag = "-".join([f"l{layers}", *(f"{k[0]}{v}" for k, v in sorted(kw.items()))])
    out = work / f"synth-{tag}-bf16.gguf"
    if out.is_file():
        return out
    q8 = work / f"synth-{tag}-q8_0.gguf"
    synthesize(q8, GEOMETRY, "q8_0", layers, **kw)
    recipe = work / "bf16.toml"
    recipe.write_text('name = "bf16"\ndefault = "bf16"\n')
    quantize(q8, out, str(recipe), allow_requantize=True)
    q8.unlink()
    return out


def params_of(path: Path) -> int:
    return sum(math.prod(t.shape) for t in source_ref(path).open().tensors())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="1,2")
    ap.add_argument("--tokens", default="64,128", help="calibration tokens (one chunk each)")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=None, help="default: the geometry's (248,320)")
    ap.add_argument("--encode-experts", type=int, default=8)
    ap.add_argument("--encode-types", default="all", help="'all' (the search's 12) or a comma list, or ''")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", type=Path, default=Path("/tmp/forge-search-cost"))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--from-json", type=Path, default=None, help="only redo the extrapolation of a --json")
    ap.add_argument("--per-layer", type=int, default=0, metavar="T",
                    help="only time a layer rerun, the head and a build at T tokens on the 2-layer model (after a "
                    "measuring run left its type files), and extrapolate from those")  # fmt: skip
    a = ap.parse_args()
    if a.per_layer:
        import torch

        torch.set_num_threads(a.threads)
        parts = per_layer(a.work, a.per_layer, a.experts, a.vocab)
        n_layer, per_layer_groups, n_types, chunks = 40, 7, 12, 4
        for name, groups in (("tensor", per_layer_groups), ("family-layer", 2)):
            cands = (n_layer * groups + 2) * n_types
            reruns = sum(groups * n_types * (n_layer - layer) for layer in range(n_layer)) + n_types * n_layer
            hours = (
                chunks * (reruns * parts["layer_s"] + cands * parts["head_s"]) + cands * parts["build_s"]
            ) / 3600
            print(f"35B-shaped, {name}: {cands} candidates, {reruns} layer reruns x {chunks} chunks of "
                  f"{a.per_layer}: {hours:.0f} h of measuring in one process")  # fmt: skip
        return
    if a.from_json:
        out = json.loads(a.from_json.read_text())
        extrapolate(out)
        a.from_json.write_text(json.dumps(out, indent=1))
        return
    import torch

    torch.set_num_threads(a.threads)
    a.work.mkdir(parents=True, exist_ok=True)
    out: dict = {"machine": f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start",
                 "threads": a.threads}  # fmt: skip

    # 1. encoding throughput per type ---------------------------------------------------------------------
    types = list(DEFAULT_TYPES) if a.encode_types == "all" else [t for t in a.encode_types.split(",") if t]
    enc: dict[str, float] = {}
    if types:
        small = bf16_model(a.work, 1, experts=a.encode_experts, vocab=4096)
        n = params_of(small)
        imatrix = a.work / "small-imatrix.gguf"  # the IQ2 types need importance weights
        if not imatrix.is_file():
            collect(small, CALIB, imatrix, ctx=128, chunks=2, log=None)
        src, im = source_ref(small).open(), read_imatrix(imatrix)
        for t in types:
            recipe = a.work / f"all-{t}.toml"  # the search's own type-file recipe
            recipe.write_text(type_file_recipe(src, t.upper(), im))
            t0 = time.perf_counter()
            quantize(small, a.work / "enc.gguf", str(recipe), imatrix=imatrix)
            enc[t] = (time.perf_counter() - t0) / (n / 1e6)
            print(f"encode {t:<8} {enc[t]:.3f} s per million parameters", flush=True)
        out["encode_s_per_mparam"] = enc

    # 2. measuring -----------------------------------------------------------------------------------------
    runs = []
    for layers in [int(x) for x in a.layers.split(",") if x]:
        kw = {"experts": a.experts} | ({"vocab": a.vocab} if a.vocab else {})
        model = bf16_model(a.work, layers, **kw)
        source = source_ref(model).open()
        groups, _ = make_groups(source, ["Q4_K", "Q8_0"], None, "tensor")
        for tokens in [int(x) for x in a.tokens.split(",") if x]:
            o = a.work / f"l{layers}" / "best.toml"  # one folder per model: the type files are kept across T
            o.parent.mkdir(exist_ok=True)
            t0 = time.perf_counter()
            res = search(model, o, CALIB, target_bpw=6.0, types="q4_k,q8_0", ctx=tokens, chunks=1,
                         correction=False)  # fmt: skip
            wall = time.perf_counter() - t0
            cands = [(g.layer, len(g.options)) for g in groups]
            reruns = sum(k * (layers - max(layer, 0)) for layer, k in cands)  # layers each candidate reruns
            row = {"layers": layers, "tokens": tokens, "params": res.parameters, "groups": len(groups),
                   "candidates": res.measurements, "layer_reruns": reruns, "seconds": res.seconds,
                   "wall": round(wall, 1)}  # fmt: skip
            runs.append(row)
            print(json.dumps(row), flush=True)
    out["runs"] = runs

    # the fit, per token count: measure = reruns * t_layer + candidates * t_head
    fits = {}
    for tokens in sorted({r["tokens"] for r in runs}):
        rs = [r for r in runs if r["tokens"] == tokens]
        if len(rs) < 2:
            continue
        a_mat = np.array([[r["layer_reruns"], r["candidates"]] for r in rs], dtype=np.float64)
        b = np.array([r["seconds"]["measure"] for r in rs])
        t_layer, t_head = np.linalg.lstsq(a_mat, b, rcond=None)[0]
        fits[tokens] = {"t_layer": float(t_layer), "t_head": float(t_head),
                        "reference_per_layer": float(np.mean([r["seconds"]["reference"] / r["layers"] for r in rs]))}  # fmt: skip
        print(f"{tokens} tokens: {t_layer:.3f} s per layer rerun, {t_head:.3f} s per head", flush=True)
    out["fits"] = fits

    # 3. the knapsack at a 35B search's size (random costs, sizes shaped like the groups') ----------------
    rng = random.Random(0)
    ks = {}
    for n_groups in (100, 200):
        sizes = [[rng.randint(10**6, 10**8) * (j + 1) for j in range(12)] for _ in range(n_groups)]
        costs = [sorted((rng.random() for _ in range(12)), reverse=True) for _ in range(n_groups)]
        budget = sum(s[6] for s in sizes)
        t0 = time.perf_counter()
        solve(sizes, costs, budget)
        ks[n_groups] = round(time.perf_counter() - t0, 2)
        print(f"knapsack {n_groups} groups x 12 options: {ks[n_groups]} s", flush=True)
    out["knapsack_s"] = ks

    extrapolate(out)
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


def per_layer(work: Path, tokens: int, experts: int, vocab: int | None) -> dict:
    """One candidate's parts on the 2-layer model at ``tokens`` tokens (one chunk, the scored half through
    the head), after the shared decoded matrices are warm: a layer rerun (a layer-0 candidate minus a layer-1
    one), the head, and a candidate's model build. Best of two."""
    from forge.search.measure import KldMeter
    from runtime.weights import GGUFWeights

    model = bf16_model(work, 2, experts=experts, **({"vocab": vocab} if vocab else {}))
    typed = work / "l2" / "best.toml.search" / "Q4_K.gguf"  # left by the measuring runs
    meter = KldMeter(model, list(range(100, 100 + 2 * tokens)), tokens, 1)
    w = GGUFWeights(typed, "cpu", verify_experts=False)
    meter.kld(meter.variant({"blk.1.attn_k.weight": w}), 1)  # warm
    best: dict[str, float] = {}
    for _ in range(2):
        for key, name, layer in (("from_0", "blk.0.attn_q.weight", 0), ("from_1", "blk.1.attn_q.weight", 1)):
            t0 = time.perf_counter()
            v = meter.variant({name: w})
            t1 = time.perf_counter()
            meter.kld(v, layer)
            t2 = time.perf_counter()
            best[key] = min(best.get(key, math.inf), t2 - t1)
            best["build"] = min(best.get("build", math.inf), t1 - t0)
    out = {"tokens": tokens, "layer_s": best["from_0"] - best["from_1"], "head_s": 2 * best["from_1"] - best["from_0"],
           "build_s": best["build"]}  # fmt: skip
    print(json.dumps(out), flush=True)
    return out


def extrapolate(out: dict) -> None:
    """40 layers, 12 types, 4 x 512 calibration tokens, from the fits at two token counts: each cost is
    a + b x tokens. The fixed part ``a`` (the variant model built, weights decoded) is paid once per candidate
    or once per chunk: the two ends of the range."""
    fits, enc, runs = out.get("fits", {}), out.get("encode_s_per_mparam", {}), out["runs"]
    if len(fits) < 2 or not enc:
        return
    (t_a, f_a), (t_b, f_b) = sorted((int(k), v) for k, v in fits.items())[:2]

    def line(key: str) -> tuple[float, float]:
        slope = (f_b[key] - f_a[key]) / (t_b - t_a)
        return f_a[key] - slope * t_a, slope

    n_layer, per_layer_groups, n_types, chunks, ctx = 40, 7, 12, 4, 512
    cands = (n_layer * per_layer_groups + 2) * n_types
    reruns = (
        sum(per_layer_groups * n_types * (n_layer - layer) for layer in range(n_layer)) + n_types * n_layer
    )
    by_layers = {r["layers"]: r["params"] for r in runs}
    (l1, p1), (l2, p2) = sorted(by_layers.items())[:2]
    params_35b = p1 + (n_layer - l1) * (p2 - p1) / (l2 - l1)  # this block's parameters at 40 layers
    (la, lb), (ha, hb) = line("t_layer"), line("t_head")
    once = reruns * (la + lb * chunks * ctx) + cands * (ha + hb * chunks * ctx)
    per_chunk = chunks * (reruns * (la + lb * ctx) + cands * (ha + hb * ctx))
    extra = {
        "params": params_35b, "candidates": cands, "layer_reruns": reruns,
        "t_layer_s": [la, lb], "t_head_s": [ha, hb],
        "encode_hours": params_35b / 1e6 * sum(enc.get(t, float(np.mean(list(enc.values())))) for t in DEFAULT_TYPES) / 3600,
        "measure_hours": [min(once, per_chunk) / 3600, max(once, per_chunk) / 3600],
    }  # fmt: skip
    out["extrapolation_35b"] = extra
    print(json.dumps(extra, indent=1))


if __name__ == "__main__":
    main()
