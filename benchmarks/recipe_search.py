"""`forge recipe search` on a fixture model (tiny-qwen3moe by default, `--model`): searched recipes vs llama.cpp's presets and ours, by size and KLD.

    python benchmarks/recipe_search.py [--budgets 2.5,3,3.5,4,4.5,5] [--calib-ctx 128 --calib-chunks 4]
        [--val-chunks 32] [--types ...] [--granularity tensor] [--work DIR] [--png pareto.png] [--json out.json]

The search calibrates on `tests/fixtures/text/calib.txt` (short chunks: the search's own cost) and every file
is judged on the held-out `tests/fixtures/text/val.txt` (ctx 512, the first --val-chunks chunks, mean KLD
against the bf16 model, top-k 128 reference logits as `forge eval --reference-logits`). Measurements are made
once and reused by every budget (they do not depend on it). Each preset is compared with the largest searched
file no larger than it. `--png` draws bits per weight vs mean KLD for all files (matplotlib; without it the
table is printed and the PNG skipped). Everything lands in --work (reused by a rerun).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch
from random_checkpoint import EXAMPLE

from forge.convert import convert_checkpoint
from forge.quant.quantize import quantize
from forge.search.search import search
from runtime.evaluate import ReferenceLogits, evaluate, perplexity_tokens
from runtime.models import load_model
from runtime.tokenizer import Tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
IMATRIX = FIXTURES / "llamacpp/tiny-qwen3moe/tiny-qwen3moe-imatrix.gguf"
PRESETS = ["iq2_xxs", "iq2_xs", "q2_k", "iq3_xxs", "iq3_s", "q3_k_m", "iq4_xs", "q4_k_m", "q5_k_m", "moe_2bit",
           "moe_4bit", "q6_k"]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--model", type=Path, default=EXAMPLE, help="Hugging Face folder (default: tiny-qwen3moe)"
    )
    ap.add_argument("--budgets", default="2.5,3,3.5,4,4.5,5")
    ap.add_argument("--calib", type=Path, default=FIXTURES / "text/calib.txt")
    ap.add_argument("--calib-ctx", type=int, default=128)
    ap.add_argument("--calib-chunks", type=int, default=4)
    ap.add_argument("--val", type=Path, default=FIXTURES / "text/val.txt")
    ap.add_argument("--val-chunks", type=int, default=32)
    ap.add_argument("--types", default=None)
    ap.add_argument("--granularity", default="tensor")
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--imatrix", type=Path, default=IMATRIX)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", type=Path, default=Path("/tmp/forge-recipe-search"))
    ap.add_argument("--png", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    a.work.mkdir(parents=True, exist_ok=True)
    bf16 = a.work / "bf16.gguf"
    if not bf16.is_file():
        convert_checkpoint(a.model, bf16, "bf16")
    base = load_model(bf16)
    tok = Tokenizer.from_metadata(base.weights)
    ids = perplexity_tokens(tok, a.val.read_text(encoding="utf-8"), 512, a.val_chunks)
    ref_path = a.work / f"val-ref-{a.val_chunks}.npz"
    if not ref_path.is_file():
        evaluate(base, ids, 512, a.val_chunks, save_logits=ref_path)
    ref = ReferenceLogits.load(ref_path)
    print(f"machine: {os.cpu_count()} cores, {a.threads} torch thread(s); judged on {a.val.name}: "
          f"{a.val_chunks} x 512 tokens; calibration {a.calib.name}: {a.calib_chunks} x {a.calib_ctx} tokens")  # fmt: skip

    def judge(path: Path) -> dict:
        r = evaluate(load_model(path), ids, 512, a.val_chunks, reference_logits=ref)
        return {"kld": r.kld_mean, "ppl": r.perplexity, "top1": r.top1_agreement}

    rows: list[dict] = []
    cache = a.work / "rows.json"
    done = {(r["kind"], r["name"]): r for r in json.loads(cache.read_text())} if cache.is_file() else {}

    def keep(row: dict) -> None:
        rows.append(row)
        done[(row["kind"], row["name"])] = row
        cache.write_text(json.dumps(list(done.values()), indent=1))
        print(f"{row['kind']:<9}{row['name']:<12}{row['bytes']:>12,}{row['bpw']:>8.3f}{row['kld']:>11.6f}"
              f"{row['top1']:>8.2%}", flush=True)  # fmt: skip

    print(f"{'kind':<9}{'name':<12}{'bytes':>12}{'bpw':>8}{'mean KLD':>11}{'top-1':>8}")
    for b in [float(x) for x in a.budgets.split(",") if x]:
        name = f"search-{b:g}"
        if ("searched", name) in done:
            keep(done[("searched", name)])
            continue
        recipe = a.work / "search" / "best.toml"  # one -o for all budgets: one set of measurements
        recipe.parent.mkdir(exist_ok=True)
        t0 = time.perf_counter()
        res = search(bf16, recipe, a.calib, a.imatrix, target_bpw=b, types=a.types, granularity=a.granularity,
                     ctx=a.calib_ctx, chunks=a.calib_chunks, quantize_out=a.work / f"{name}.gguf",
                     log=lambda s: print("  " + s, flush=True))  # fmt: skip
        row = {"kind": "searched", "name": name, "bytes": res.measured_bytes, "bpw": res.measured_bpw,
               "predicted_bytes": res.predicted_bytes, "predicted_kld_calib": res.predicted_kld,
               "measured_kld_calib": res.measured_kld, "search_seconds": round(time.perf_counter() - t0, 1),
               "measured_now": res.measured, "candidates": res.measurements, **judge(res.quantized)}  # fmt: skip
        (a.work / "search" / f"bpw-{b:g}.toml").write_text(recipe.read_text())
        keep(row)
    for name in [p for p in a.presets.split(",") if p]:
        if ("preset", name) in done:
            keep(done[("preset", name)])
            continue
        out = a.work / f"{name}.gguf"
        _, rep = quantize(bf16, out, name, imatrix=a.imatrix)
        n_el = sum(math.prod(r["shape"]) for r in rep.tensors)
        bpw = 8 * sum(r["bytes"] for r in rep.tensors) / n_el
        keep({"kind": "preset", "name": name, "bytes": out.stat().st_size, "bpw": bpw, **judge(out)})
    presets = [r for r in rows if r["kind"] == "preset"]
    searched = sorted([r for r in rows if r["kind"] == "searched"], key=lambda r: r["bytes"])
    print("\nsearched recipes (size and calibration KLD: predicted -> written/measured):")
    for r in searched:
        print(f"{r['name']:<12}{r['predicted_bytes']:>12,} -> {r['bytes']:,} bytes; calibration KLD "
              f"{r['predicted_kld_calib']:.5f} -> {r['measured_kld_calib']:.5f}")  # fmt: skip
    print("\neach preset vs the largest searched file no larger than it (held-out KLD):")
    wins = losses = 0
    for p in sorted(presets, key=lambda r: r["bytes"]):
        fit = [r for r in searched if r["bytes"] <= p["bytes"]]
        if not fit:
            print(f"{p['name']:<10}{p['bpw']:.3f} bpw {p['kld']:.6f}: no searched file this small")
            continue
        r = fit[-1]
        won = r["kld"] < p["kld"]
        wins, losses = wins + won, losses + (not won)
        print(f"{p['name']:<10}{p['bpw']:.3f} bpw {p['kld']:.6f} vs {r['name']} {r['bpw']:.3f} bpw {r['kld']:.6f}: "
              + ("searched lower" if won else "PRESET LOWER"))  # fmt: skip
    print(f"searched file lower in {wins} of {wins + losses} comparisons")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    if a.png:
        plot(rows, a.png, a.model.name)


def plot(rows: list[dict], png: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no {png} (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for kind, style in (("preset", "o"), ("searched", "s-")):
        pts = sorted((r["bpw"], r["kld"], r["name"]) for r in rows if r["kind"] == kind)
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=kind)
        for x, y, n in pts:
            ax.annotate(n, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("bits per weight")
    ax.set_ylabel("mean KLD vs bf16 (held-out text)")
    ax.set_title(f"{title}: searched recipes vs presets")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
