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
import shutil
import time
from collections.abc import Callable
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
    ap.add_argument("--granularity", default="tensor", help="tensor, family-layer or both (comma-separated)")
    ap.add_argument("--compare-uncorrected", action="store_true",
                    help="also search without the interaction correction (rows 'uncorrected')")  # fmt: skip
    ap.add_argument("--seeds", action="store_true",
                    help="also search with every bundled preset as a measured alternative (rows 'seeded')")  # fmt: skip
    ap.add_argument("--proxy-sample", type=int, default=0,
                    help="also search with --proxy (this many candidates measured; rows 'proxy')")  # fmt: skip
    ap.add_argument("--plot-with", type=Path, action="append", default=[],
                    help="--json of another model's run: a panel of its own in --png")  # fmt: skip
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
        row["model"] = a.model.name
        rows.append(row)
        done[(row["kind"], row["name"])] = row
        cache.write_text(json.dumps(list(done.values()), indent=1))
        print(f"{row['kind']:<9}{row['name']:<12}{row['bytes']:>12,}{row['bpw']:>8.3f}{row['kld']:>11.6f}"
              f"{row['top1']:>8.2%}", flush=True)  # fmt: skip

    print(f"{'kind':<9}{'name':<12}{'bytes':>12}{'bpw':>8}{'mean KLD':>11}{'top-1':>8}")
    kinds = (
        ["searched"] + (["uncorrected"] if a.compare_uncorrected else []) + (["seeded"] if a.seeds else [])
    )
    for g, kind in [(g, k) for g in a.granularity.split(",") for k in kinds]:
        corr = kind != "uncorrected"
        # one -o for all budgets: one set of measurements and type files; each granularity's measurements are
        # kept aside (measurements-G.json) and put back before its searches
        recipe = a.work / "search" / "best.toml"
        recipe.parent.mkdir(exist_ok=True)
        kept = a.work / "search" / f"measurements-{g}.json"
        if kept.is_file():
            shutil.copy(kept, recipe.with_name(recipe.name + ".search.json"))
        for b in [float(x) for x in a.budgets.split(",") if x]:
            name = f"{g}-{b:g}"
            if (kind, name) in done:
                keep(done[(kind, name)])
                continue
            t0 = time.perf_counter()
            out = a.work / f"{kind}-{name}.gguf"
            res = search(bf16, recipe, a.calib, a.imatrix, target_bpw=b, types=a.types, granularity=g,
                         ctx=a.calib_ctx, chunks=a.calib_chunks, quantize_out=out, correction=corr,
                         seeds=["all"] if kind == "seeded" else None,
                         log=lambda s: print("  " + s, flush=True))  # fmt: skip
            row = {"kind": kind, "name": name, "granularity": g, "budget": b, "bytes": res.measured_bytes,
                   "bpw": res.measured_bpw, "predicted_bytes": res.predicted_bytes,
                   "predicted_kld_calib": res.predicted_kld, "corrected_kld_calib": res.corrected_kld,
                   "measured_kld_calib": res.measured_kld, "uncorrected_kld_calib": res.uncorrected_kld,
                   "scales": res.scales, "rounds": res.rounds, "chosen_by": res.chosen_by, "search_seconds": round(time.perf_counter() - t0, 1),
                   "seconds": res.seconds, "measured_now": res.measured, "candidates": res.measurements,
                   **judge(res.quantized)}  # fmt: skip
            (a.work / "search" / f"{kind}-{name}.toml").write_text(recipe.read_text())
            shutil.copy(
                recipe.with_name(recipe.name + ".search.json"), a.work / "search" / f"measurements-{g}.json"
            )
            out.unlink()  # judged: the numbers are kept, the file is not needed
            keep(row)
    if a.proxy_sample:
        for g in a.granularity.split(","):
            proxy_rows(a, bf16, g, done, keep, judge)
    for name in [p for p in a.presets.split(",") if p]:
        if ("preset", name) in done:
            keep(done[("preset", name)])
            continue
        out = a.work / f"{name}.gguf"
        _, rep = quantize(bf16, out, name, imatrix=a.imatrix)
        n_el = sum(math.prod(r["shape"]) for r in rep.tensors)
        bpw = 8 * sum(r["bytes"] for r in rep.tensors) / n_el
        keep({"kind": "preset", "name": name, "bytes": out.stat().st_size, "bpw": bpw, **judge(out)})
    presets = sorted([r for r in rows if r["kind"] == "preset"], key=lambda r: r["bytes"])
    for kind, g in sorted({(r["kind"], r["granularity"]) for r in rows if r["kind"] != "preset"}):
        searched = sorted(
            [r for r in rows if r["kind"] == kind and r["granularity"] == g], key=lambda r: r["bytes"]
        )
        print(f"\n{kind} recipes, {g}: size predicted -> written; calibration KLD: sum of the per-group costs, "
              "corrected, measured file (the uncorrected knapsack's answer); held-out KLD")  # fmt: skip
        for r in searched:
            extra = ""
            if r.get("corrected_kld_calib") is not None:
                extra = (f", corrected {r['corrected_kld_calib']:.5f} -> measured {r['measured_kld_calib']:.5f} "
                         f"(uncorrected answer {r['uncorrected_kld_calib']:.5f})")  # fmt: skip
            print(f"{r['name']:<18}{r['predicted_bytes']:>12,} -> {r['bytes']:,} bytes; sum {r['predicted_kld_calib']:.5f}"
                  f"{extra}; val {r['kld']:.6f}; {r['search_seconds']:.0f} s")  # fmt: skip
        if kind == "proxy":
            r = searched[0]
            cost = r["proxy_seconds"] + r["sample_seconds"]
            print(f"proxy: {r['proxy']['sampled']} of {r['candidates']} candidates measured; "
                  f"rank correlation {r['proxy']['spearman']:.3f} on the sample (leave-one-out), "
                  f"{r['spearman_unsampled']:.3f} on every other candidate; costs {cost:.0f} s (proxy "
                  f"{r['proxy_seconds']:.0f} s + sample {r['sample_seconds']:.0f} s) vs {r['full_measure_seconds']:.0f} s "
                  f"measuring all: {r['full_measure_seconds'] / cost:.1f}x")  # fmt: skip
        print(f"each preset vs the largest {kind} ({g}) file with no more bits per weight (tensor data; the files' "
              "metadata differ by a few hundred bytes), held-out KLD:")  # fmt: skip
        wins = losses = 0
        top = max(r["bpw"] for r in searched)
        for p in presets:
            fit = [r for r in searched if r["bpw"] <= p["bpw"] + 1e-9]
            if not fit:
                print(f"  {p['name']:<10}{p['bpw']:.3f} bpw {p['kld']:.6f}: no searched file this small")
                continue
            if p["bpw"] > top + 0.8:
                print(
                    f"  {p['name']:<10}{p['bpw']:.3f} bpw {p['kld']:.6f}: beyond the largest budget ({top:.3f} bpw)"
                )
                continue
            r = fit[-1]
            won = r["kld"] < p["kld"]
            wins, losses = wins + won, losses + (not won)
            print(f"  {p['name']:<10}{p['bpw']:.3f} bpw {p['kld']:.6f} vs {r['name']} {r['bpw']:.3f} bpw "
                  f"{r['kld']:.6f}: " + ("searched lower" if won else "PRESET LOWER"))  # fmt: skip
        print(f"  searched file lower in {wins} of {wins + losses} comparisons")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    if a.png:
        panels = [(a.model.name, rows)]
        panels += [
            (str(json.loads(p.read_text())[0].get("model", p.stem)), json.loads(p.read_text()))
            for p in a.plot_with
        ]
        plot(panels, a.png)


def proxy_rows(
    a: argparse.Namespace, bf16: Path, g: str, done: dict, keep: Callable, judge: Callable
) -> None:
    """--proxy-sample N: the same budgets searched with --proxy, in a folder whose store holds only the sampled
    candidates' KLD (copied from the full search's measurements, type files hard-linked): the proxy is computed
    and timed, the sample costs what the full search spent on it, and the proxy is checked against every
    candidate's measured KLD (which the full search has)."""
    from forge.imatrix.formats import read_imatrix
    from forge.quant.source import source_ref
    from forge.search.measure import make_groups, parse_types
    from forge.search.proxy import proxy_costs, sample, spearman

    full_path = a.work / "search" / f"measurements-{g}.json"
    full = json.loads(full_path.read_text())
    pdir = a.work / f"proxy-{g}"
    recipe = pdir / "best.toml"
    store = pdir / "best.toml.search.json"
    groups, _ = make_groups(source_ref(bf16).open(), parse_types(a.types), read_imatrix(a.imatrix), g)
    picks = sample(groups, a.proxy_sample)
    if not store.is_file():
        (pdir / "best.toml.search").mkdir(parents=True, exist_ok=True)
        for f in (a.work / "search" / "best.toml.search").glob("*.gguf"):
            if not (pdir / "best.toml.search" / f.name).exists():
                os.link(f, pdir / "best.toml.search" / f.name)
        data = dict(full, costs={}, points={}, proxy={})
        for gn, lb in picks:
            data["costs"].setdefault(gn, {})[lb] = full["costs"][gn][lb]
        store.write_text(json.dumps(data))
    full_row = next(
        r
        for r in done.values()
        if r["kind"] == "searched" and r["granularity"] == g and "measure" in r["seconds"]
    )
    per_candidate = full_row["seconds"]["measure"] / full_row["candidates"]
    for b in [float(x) for x in a.budgets.split(",") if x]:
        name = f"{g}-{b:g}"
        if ("proxy", name) in done:
            keep(done[("proxy", name)])
            continue
        out = a.work / f"proxy-{name}.gguf"
        t0 = time.perf_counter()
        res = search(bf16, recipe, a.calib, a.imatrix, target_bpw=b, types=a.types, granularity=g, ctx=a.calib_ctx,
                     chunks=a.calib_chunks, quantize_out=out, proxy_sample=a.proxy_sample,
                     log=lambda s: print("  " + s, flush=True))  # fmt: skip
        pdata = json.loads(store.read_text())
        sampled = {(gn, lb): full["costs"][gn][lb] for gn, lb in picks}
        scaled = proxy_costs(groups, pdata["proxy"], sampled, res.proxy["scales"])
        pairs = [(scaled[i][j], full["costs"][gr.name][o.label]) for i, gr in enumerate(groups)
                 for j, o in enumerate(gr.options) if (gr.name, o.label) not in sampled]  # fmt: skip
        row = {"kind": "proxy", "name": name, "granularity": g, "budget": b, "bytes": res.measured_bytes,
               "bpw": res.measured_bpw, "predicted_bytes": res.predicted_bytes, "proxy": res.proxy,
               "candidates": res.measurements,
               "spearman_unsampled": spearman([p for p, _ in pairs], [m for _, m in pairs]),
               "proxy_seconds": res.seconds.get("proxy", 0.0), "sample_seconds": per_candidate * len(picks),
               "full_measure_seconds": full_row["seconds"]["measure"], "predicted_kld_calib": res.predicted_kld,
               "corrected_kld_calib": res.corrected_kld, "measured_kld_calib": res.measured_kld,
               "uncorrected_kld_calib": res.uncorrected_kld, "scales": res.scales, "rounds": res.rounds, "chosen_by": res.chosen_by,
               "seconds": res.seconds, "search_seconds": round(time.perf_counter() - t0, 1),
               **judge(res.quantized)}  # fmt: skip
        out.unlink()
        keep(row)


def plot(panels: list[tuple[str, list[dict]]], png: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no {png} (pip install matplotlib)")
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(8 * len(panels), 5.5), squeeze=False)
    for ax, (title, rows) in zip(axes[0], panels, strict=True):
        pts = [r for r in rows if r["kind"] == "preset" and 2.4 <= r["bpw"] <= 6.7]
        ax.plot([r["bpw"] for r in pts], [r["kld"] for r in pts], "o", color="gray", label="presets")
        for r in pts:
            ax.annotate(
                r["name"], (r["bpw"], r["kld"]), fontsize=6, xytext=(3, 3), textcoords="offset points"
            )
        shown = {
            ("searched", "tensor"),
            ("searched", "family-layer"),
            ("seeded", "family-layer"),
            ("proxy", "family-layer"),
        }
        for kind, g in sorted({(r["kind"], r["granularity"]) for r in rows if r["kind"] != "preset"} & shown):
            s = sorted(
                (r for r in rows if r["kind"] == kind and r["granularity"] == g), key=lambda r: r["bpw"]
            )
            label = f"{kind}, {g}"
            ax.plot(
                [r["bpw"] for r in s],
                [r["kld"] for r in s],
                "s-" if kind == "searched" else "x--",
                label=label,
            )
        ax.set_yscale("log")
        ax.set_xlabel("bits per weight")
        ax.set_ylabel("mean KLD vs bf16 (val.txt, 32 x 512)")
        ax.set_title(f"{title}: searched recipes vs presets")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
