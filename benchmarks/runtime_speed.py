"""Prefill / decode tokens per second of the runtime (pp512 / tg128, like llama-bench), beside transformers.

    python benchmarks/runtime_speed.py [GGUF ...] [--model GGUF] [--threads 2] [--device cpu|cuda|mps]
        [--transformers HF_DIR] [--synth] [--resident-only] [--llama-bench PATH] [--json OUT]

Without files it converts the bundled examples/tiny-qwen3moe to bf16 and derives a Q8_0 copy, and adds the
llama.cpp files in the folder FORGE_SHARED_FIXTURES names, if set (and tiny-qwen35moe, bf16 and llama.cpp's, from
there).
Each file runs with its routed experts resident (decoded once) and, unless ``--resident-only``, decoded on
every use (expert cache 0). The load average is printed: on a shared machine the figures are lower bounds. ``--synth`` benchmarks a larger randomly initialized
qwen3moe (about 5 B parameters, Q4_K experts) written on the fly: meant for GPUs.
llama.cpp's figures for the tiny model (llama-bench, 2 threads, the 2-core development machine) are printed
for reference from the fixtures README.

With ``--llama-bench PATH`` (a llama.cpp ``llama-bench`` binary) every file is also measured by llama.cpp with
the same settings (``-t THREADS -p PP -n TG -r REPS``, ``-ngl 99`` on cuda, 0 otherwise, ``-o json``), and a
table puts both side by side with the ratio forge / llama.cpp for prefill and decode. Both sides report the
best of their repetitions (llama.cpp's mean is kept in the JSON). A file llama.cpp cannot load (say, an
expert-major layout) is reported and skipped. Files made by ``forge synth`` carry a tokenizer, so llama.cpp
loads them.
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

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime.models import load_model  # noqa: E402

LLAMA_CPP = {"bf16": (6100, 1600), "Q8_0": (5400, 1740), "Q4_K_M": (6600, 2100)}  # pp512, tg128 tok/s


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
    elif device == "mps":
        torch.mps.synchronize()


def bench_runtime(path: Path, device: str, pp: int, tg: int, reps: int, budget: int) -> dict:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    model = load_model(path, device, expert_budget=budget)
    load_s = time.perf_counter() - t0
    memory = {}
    if device == "cuda":
        from forge.gguf_file import GGUFFile

        tensor_bytes = sum(t.nbytes for t in GGUFFile(path).tensors.values())
        held = torch.cuda.memory_allocated() - base
        memory = {"tensor_mib": round(tensor_bytes / 2**20), "gpu_load_mib": round(held / 2**20),
                  "gpu_load_ratio": round(held / tensor_bytes, 3)}  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    vocab = model.vocab_size
    ids = torch.randint(0, vocab, (pp,), generator=gen).to(device)
    warm = model.new_state()
    model.forward(ids[:64], warm)  # warm-up, the one-token path too (its kernels load or compile once)
    model.forward(ids[:1], warm)
    best_pp = 0.0
    for _ in range(reps):
        st = model.new_state()
        _sync(device)
        t = time.perf_counter()
        model.forward(ids, st, last_only=True)
        _sync(device)
        best_pp = max(best_pp, pp / (time.perf_counter() - t))
    best_tg = 0.0
    for _ in range(max(1, reps - 1)):
        st = model.new_state()
        toks = torch.randint(0, vocab, (tg,), generator=gen).to(device)
        _sync(device)
        t = time.perf_counter()
        for i in range(tg):
            model.forward(toks[i : i + 1], st, last_only=True)
        _sync(device)
        best_tg = max(best_tg, tg / (time.perf_counter() - t))
    if device == "cuda":
        memory["gpu_peak_mib"] = round((torch.cuda.max_memory_allocated() - base) / 2**20)
    return {
        "file": path.name, "load_s": round(load_s, 2), "pp": round(best_pp, 1), "tg": round(best_tg, 1), **memory
    }  # fmt: skip


def bench_transformers(hf_dir: Path, device: str, pp: int, tg: int, reps: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(device).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, pp), generator=torch.Generator().manual_seed(0)).to(
        device
    )
    best_pp = best_tg = 0.0
    with torch.no_grad():
        model(ids[:, :64])
        for _ in range(reps):
            _sync(device)
            t = time.perf_counter()
            model(ids)
            _sync(device)
            best_pp = max(best_pp, pp / (time.perf_counter() - t))
        for _ in range(max(1, reps - 1)):
            _sync(device)
            t = time.perf_counter()
            out = model(ids[:, :1], use_cache=True)
            for i in range(1, tg):
                out = model(ids[:, i : i + 1], past_key_values=out.past_key_values, use_cache=True)
            _sync(device)
            best_tg = max(best_tg, tg / (time.perf_counter() - t))
    return {"file": f"transformers fp32 ({hf_dir.name})", "pp": round(best_pp, 1), "tg": round(best_tg, 1)}


# files to measure ----------------------------------------------------------------------------------------


def q8_0_copy(src: Path, out: Path) -> Path:
    """``src`` with every quantizable weight (2-D+, not norms or the router) re-encoded as Q8_0."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
    from gguf.quants import quantize

    from runtime.weights import dequantize

    r = GGUFReader(src)
    arch = str(r.fields["general.architecture"].contents())
    w = GGUFWriter(out, arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0].name == "ARRAY" else None
        w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for t in r.tensors:
        qtype = GGMLQuantizationType(t.tensor_type)
        shape = [int(x) for x in reversed(t.shape)]
        raw = torch.from_numpy(np.asarray(t.data).view(np.uint8).reshape(*shape[:-1], -1).copy())
        values = dequantize(raw, qtype, shape[-1]).numpy()
        if len(shape) >= 2 and "norm" not in t.name and "ffn_gate_inp" not in t.name and shape[-1] % 32 == 0:
            w.add_tensor(
                t.name, quantize(values, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0
            )
        else:
            w.add_tensor(t.name, values.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def default_files(tmp: Path) -> list[Path]:
    from forge.convert import convert_checkpoint

    bf16 = tmp / "tiny-qwen3moe-bf16.gguf"
    convert_checkpoint(ROOT / "examples" / "tiny-qwen3moe", bf16, "bf16")
    files = [bf16, q8_0_copy(bf16, tmp / "tiny-qwen3moe-Q8_0-forge.gguf")]
    # llama.cpp's GGUFs and tiny-qwen35moe are not shipped in tests/fixtures: only from FORGE_SHARED_FIXTURES
    shared = Path(os.environ.get("FORGE_SHARED_FIXTURES") or ROOT / "tests" / "fixtures")
    fixtures = shared / "llamacpp" / "tiny-qwen3moe"
    files += sorted(fixtures.glob("tiny-qwen3moe-Q*.gguf"))
    q35 = shared / "tiny-qwen35moe"
    if q35.is_dir():
        files.append(tmp / "tiny-qwen35moe-bf16.gguf")
        convert_checkpoint(q35, files[-1], "bf16", mtp=False)
        files += sorted((fixtures.parent / "tiny-qwen35moe").glob("tiny-qwen35moe-Q*.gguf"))
    return files


# llama.cpp's llama-bench on the same files ---------------------------------------------------------------


def llama_bench_command(
    binary: Path,
    model: Path,
    device: str,
    threads: int,
    pp: int,
    tg: int,
    reps: int,
    extra: tuple[str, ...] = (),
) -> list[str]:
    """llama-bench with the settings forge runs with: the same threads, prompt and generation lengths;
    ``extra``: more llama-bench arguments (e.g. ``-ot exps=CPU``)."""
    ngl = 99 if device == "cuda" else 0
    return [str(binary), "-m", str(model), "-t", str(threads), "-p", str(pp), "-n", str(tg),
            "-r", str(reps), "-ngl", str(ngl), "-o", "json", *extra]  # fmt: skip


def parse_llama_bench(text: str) -> dict:
    """pp / tg tokens per second from ``llama-bench -o json`` (a list of tests: pp has n_gen 0, tg n_prompt 0).

    ``pp`` and ``tg`` are the best repetition (as forge's figures), ``*_avg`` llama-bench's mean.
    """
    start = text.find("[")  # anything a build prints before the JSON array
    if start < 0:
        raise ValueError("no JSON array in llama-bench's output")
    tests = json.loads(text[start:])
    out: dict = {}
    for t in tests:
        kind = "pp" if t["n_gen"] == 0 and t["n_prompt"] > 0 else "tg" if t["n_prompt"] == 0 else None
        if kind is None:
            continue  # pp+tg combined tests (-pg): not measured by forge
        samples = t.get("samples_ts") or [t["avg_ts"]]
        out[kind] = round(max(samples), 1)
        out[f"{kind}_avg"] = round(t["avg_ts"], 1)
        out[f"{kind}_tokens"] = t["n_prompt"] or t["n_gen"]
        out.update(build=t.get("build_commit"), backends=t.get("backends"), threads=t.get("n_threads"))
        out.update(ngl=t.get("n_gpu_layers"), flash_attn=t.get("flash_attn"))
    if "pp" not in out and "tg" not in out:
        raise ValueError("llama-bench's output has no pp or tg test")
    return out


def run_llama_bench(
    binary: Path,
    model: Path,
    device: str,
    threads: int,
    pp: int,
    tg: int,
    reps: int,
    extra: tuple[str, ...] = (),
) -> dict:
    """llama.cpp's figures for ``model``, or ``{"error": ...}`` when llama-bench fails on it or, on the GPU, when
    the file is a synthesized one whose activations overflow its float16 sums (``runtime.synth.out_of_range``)."""
    from runtime.synth import out_of_range

    if device == "cuda" and out_of_range(model):
        return {"error": f"{model} predates forge synth's value sizes (2026-12-04): write it again"}
    cmd = llama_bench_command(binary, model, device, threads, pp, tg, reps, extra)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        return {"error": f"{binary}: {exc.strerror or exc}"}
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
        return {"error": f"llama-bench exit {r.returncode}: {last}"}
    try:
        return parse_llama_bench(r.stdout)
    except (ValueError, KeyError, TypeError) as exc:
        return {"error": f"unreadable llama-bench output: {exc}"}


def compare(row: dict, llama: dict) -> dict:
    """``row`` (forge's figures) with llama.cpp's and the ratios forge / llama.cpp."""
    out = {**row, "llama_cpp": llama}
    for k in ("pp", "tg"):
        if llama.get(k):
            out[f"ratio_{k}"] = float(f"{row[k] / llama[k]:.3g}")
    return out


def print_comparison(rows: list[dict]) -> None:
    def fig(x: float | None, fmt: str = ".1f") -> str:
        return "-" if x is None else format(x, fmt)

    print(f"\n{'file':<42} {'cache MiB':>9} | {'pp forge':>9} {'llama.cpp':>9} {'ratio':>6} | "
          f"{'tg forge':>8} {'llama.cpp':>9} {'ratio':>6}")  # fmt: skip
    for r in rows:
        if "llama_cpp" not in r:
            continue
        lc = r["llama_cpp"]
        print(f"{r['file']:<42} {r.get('expert_cache_mib', ''):>9} | {r['pp']:>9.1f} {fig(lc.get('pp')):>9} "
              f"{fig(r.get('ratio_pp'), '.3g'):>6} | {r['tg']:>8.1f} {fig(lc.get('tg')):>9} "
              f"{fig(r.get('ratio_tg'), '.3g'):>6}" + (f"  ({lc['error']})" if "error" in lc else ""))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", type=Path)
    ap.add_argument("--model", type=Path, action="append", default=[], help="a GGUF file (same as FILE)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--expert-cache-mib", type=int, default=1024)
    ap.add_argument("--transformers", type=Path, default=ROOT / "examples" / "tiny-qwen3moe")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--synth", action="store_true", help="also a ~5 B-parameter random Q4_K qwen3moe")
    ap.add_argument("--resident-only", action="store_true", help="skip the experts-decoded-per-use runs")
    ap.add_argument(
        "--llama-bench", type=Path, help="llama.cpp's llama-bench: also measure every file with it"
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.llama_bench is not None and not (
        args.llama_bench.is_file() and os.access(args.llama_bench, os.X_OK)
    ):
        ap.error(f"--llama-bench {args.llama_bench}: not an executable file")
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        files = [*args.files, *args.model] or default_files(Path(tmp))
        if args.synth:
            from runtime.synth import synthesize

            synth = Path(tmp) / "synth-qwen3moe-8L-Q4_K.gguf"
            synthesize(synth, "qwen3-30b-a3b", "q4_k", layers=8)
            files.append(synth)
        for f in files:
            llama = None
            if args.llama_bench is not None:
                llama = run_llama_bench(
                    args.llama_bench, f, args.device, args.threads, args.pp, args.tg, args.reps
                )
                print(json.dumps({"file": f.name, "llama_cpp": llama}), flush=True)
            budgets = {args.expert_cache_mib} if args.resident_only else {args.expert_cache_mib, 0}
            for budget_mib in sorted(budgets, reverse=True):
                row = bench_runtime(f, args.device, args.pp, args.tg, args.reps, budget_mib << 20)
                row["expert_cache_mib"] = budget_mib
                if llama is not None:
                    row = compare(row, llama)
                rows.append(row)
                print(json.dumps(row), flush=True)
        if not args.no_transformers:
            row = bench_transformers(args.transformers, args.device, args.pp, args.tg, args.reps)
            rows.append(row)
            print(json.dumps(row), flush=True)
    where = args.device + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else "")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"\n{where}, torch threads {args.threads}, pp{args.pp} / tg{args.tg} tokens/s (best of {args.reps}), "
        f"load average {load}"
    )
    print(f"{'file':<42} {'cache MiB':>9} {'pp':>9} {'tg':>8}")
    for r in rows:
        print(f"{r['file']:<42} {r.get('expert_cache_mib', ''):>9} {r['pp']:>9.1f} {r['tg']:>8.1f}")
    if args.llama_bench is not None:
        print_comparison(rows)
    else:
        print("llama.cpp llama-bench, tiny-qwen3moe, 2 threads (fixtures README): "
              + ", ".join(f"{k} {pp}/{tg}" for k, (pp, tg) in LLAMA_CPP.items()))  # fmt: skip
    if args.json:
        args.json.write_text(
            json.dumps({"device": where, "threads": args.threads, "load": load, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
