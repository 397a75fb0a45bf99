"""End-to-end quantize times on issue #18's benchmark model: forge (CPU threads), forge --device cuda and
llama-quantize, with every tensor's bytes compared.

    PYTHONPATH=. python benchmarks/quantize_model.py WORK [--runners forge-cpu forge-cuda llama]
        [--presets q4_k_m q6_k iq4_xs iq2_xxs+imat] [--threads 16] [--device cuda] [--llama-quantize PATH]
        [--layers 8 --experts 128 --hidden 2048 --moe-ff 768 --heads 16 --kv-heads 4 --vocab 32768]

The model (default: the issue's 8-layer Qwen3-30B-A3B-shaped random bf16 checkpoint, 4.9 B parameters
in its layers, 9.8 GB, written by benchmarks/random_checkpoint.py with its default attention and
vocabulary) and a random imatrix (benchmarks/quantize_speed.py) are written
into WORK once and reused. Each (runner, preset) is one fresh process, timed wall-clock from start to
exit: ``python -m forge quantize`` with FORGE_THREADS=--threads (``forge-cpu``) or ``--device cuda``
(``forge-cuda``) from the checkpoint, and ``llama-quantize`` with --threads threads from a bf16 GGUF
that ``forge convert`` writes once (not timed in the table; its time is printed). Each output's tensors
are hashed and the file deleted (disk); results and hashes accumulate in WORK/results.json, so runs
split over several calls print one table. Identity is per tensor (name, type, bytes); the files'
metadata differ (forge records its recipe and reuse keys).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quantize_speed import random_imatrix  # noqa: E402
from random_checkpoint import write_checkpoint  # noqa: E402

from forge.gguf_file import open_gguf  # noqa: E402

LLAMA_TYPES = {
    "q4_k_m": "Q4_K_M",
    "q5_k_m": "Q5_K_M",
    "q6_k": "Q6_K",
    "iq4_xs": "IQ4_XS",
    "iq2_xxs": "IQ2_XXS",
}
RUNNERS = ("forge-cpu", "forge-cuda", "llama")
ROOT = Path(__file__).resolve().parents[1]


def tensor_hashes(path: Path) -> dict[str, str]:
    """name -> type:xxh128 of the tensor's bytes."""
    f = open_gguf(path)
    mm = f.mapped()
    return {
        n: f"{t.ggml_type.name}:{xxhash.xxh3_128_hexdigest(mm[t.offset : t.offset + t.nbytes])}"
        for n, t in f.tensors.items()
    }


def prepare(work: Path, a: argparse.Namespace) -> tuple[Path, Path]:
    model = work / "model"
    if not (model / "model.safetensors.index.json").is_file():
        t0 = time.perf_counter()
        write_checkpoint(
            model, a.layers, a.experts, a.hidden, a.moe_ff, a.heads, a.kv_heads, a.head_dim, a.vocab
        )
        print(f"wrote {model} in {time.perf_counter() - t0:.0f} s", flush=True)
    imatrix = work / "imatrix.gguf"
    if not imatrix.is_file():
        random_imatrix(model, imatrix)
    return model, imatrix


def bf16_gguf(work: Path, model: Path) -> Path:
    out = work / "model-bf16.gguf"
    if not out.is_file():
        t0 = time.perf_counter()
        run([sys.executable, "-m", "forge", "convert", str(model), "-o", str(out), "--outtype", "bf16"], {})
        print(
            f"forge convert -> {out.name} (for llama-quantize): {time.perf_counter() - t0:.1f} s", flush=True
        )
    return out


def _pythonpath() -> str:
    """This checkout first, then what the caller's PYTHONPATH already had (where gguf may come from)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


def run(cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    """(wall seconds, standard output) of ``cmd``; exits with its output if it fails."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        cmd, env={**os.environ, "PYTHONPATH": _pythonpath(), **env}, capture_output=True, text=True
    )
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(
            f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        )
    return seconds, proc.stdout


def command(
    runner: str, preset: str, imat: bool, model: Path, imatrix: Path, out: Path, a
) -> tuple[list, dict]:  # noqa: ANN001
    if runner == "llama":
        if not a.llama_quantize:
            raise SystemExit("the llama runner needs --llama-quantize PATH")
        src = bf16_gguf(out.parent, model)
        im = ["--imatrix", str(imatrix)] if imat else []
        return [a.llama_quantize, *im, str(src), str(out), LLAMA_TYPES[preset], str(a.threads)], {}
    cmd = [
        sys.executable,
        "-m",
        "forge",
        "quantize",
        str(model),
        "-o",
        str(out),
        "--recipe",
        preset,
        "--json",
    ]
    cmd += ["--imatrix", str(imatrix)] if imat else []
    cmd += ["--device", a.device] if runner == "forge-cuda" else []
    return cmd, {"FORGE_THREADS": str(a.threads)}


def table(results: dict, presets: list[str]) -> None:
    print(f"\n{'preset':<16}" + "".join(f"{r + ' s':>13}" for r in RUNNERS) + f"{'llama/cuda':>12}{'llama/cpu':>11}"
          "  same tensors")  # fmt: skip
    for p in presets:
        row = {r: results.get(f"{r}/{p}") for r in RUNNERS}
        secs = "".join(f"{row[r]['s']:>13.1f}" if row[r] else f"{'-':>13}" for r in RUNNERS)
        ref = row["forge-cpu"] or row["llama"]

        def ratio(num: str, den: str, row: dict = row) -> str:
            return f"{row[num]['s'] / row[den]['s']:.2f}x" if row[num] and row[den] else "-"

        same = []
        for r in RUNNERS:
            if row[r] and ref and row[r] is not ref:
                h, hr = row[r]["tensors"], ref["tensors"]
                n_same = sum(h.get(k) == v for k, v in hr.items())
                same.append(f"{r} {n_same}/{len(hr)}" + ("" if n_same == len(hr) == len(h) else " DIFFER"))
        base = "forge-cpu" if row["forge-cpu"] else "llama"
        print(f"{p:<16}{secs}{ratio('llama', 'forge-cuda'):>12}{ratio('llama', 'forge-cpu'):>11}  vs {base}: "
              + (", ".join(same) or "-"))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("--runners", nargs="*", default=["forge-cpu", "forge-cuda"], choices=RUNNERS)
    ap.add_argument("--presets", nargs="*", default=["q4_k_m", "q6_k", "iq4_xs", "iq2_xxs+imat"])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--llama-quantize", default=None, help="path of llama-quantize (adds nothing unless 'llama' runs)"
    )
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--moe-ff", type=int, default=768)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=32768)
    a = ap.parse_args()
    if a.llama_quantize and "llama" not in a.runners:
        a.runners.append("llama")
    a.work.mkdir(parents=True, exist_ok=True)
    model, imatrix = prepare(a.work, a)
    n_bytes = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    print(f"model {model}: {n_bytes / 1e9:.2f} GB bf16 (~{n_bytes / 2e9:.2f} B parameters), {a.layers} layers, "
          f"{a.experts} experts, hidden {a.hidden}; {os.cpu_count()} cores, threads {a.threads}", flush=True)  # fmt: skip
    if "forge-cuda" in a.runners:
        import torch

        print(
            f"device {a.device}: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA'}"
        )
    store = a.work / "results.json"
    results = json.loads(store.read_text()) if store.is_file() else {}
    for spec in a.presets:
        preset, _, flag = spec.partition("+")
        if preset not in LLAMA_TYPES:
            raise SystemExit(f"unknown preset {preset!r}; choose from {', '.join(LLAMA_TYPES)}")
        for runner in a.runners:
            out = a.work / f"out-{runner}-{preset}.gguf"
            cmd, env = command(runner, preset, flag == "imat", model, imatrix, out, a)
            seconds, stdout = run(cmd, env)
            # forge's own account of its time by stage (its --json report)
            stages = json.loads(stdout)["stages"] if runner.startswith("forge") else {}
            results[f"{runner}/{spec}"] = {
                "s": seconds,
                "bytes": out.stat().st_size,
                "tensors": tensor_hashes(out),
                "stages": stages,
            }
            out.unlink()
            detail = ", ".join(f"{k} {v:.1f}" for k, v in stages.items())
            print(f"{runner:<11} {spec:<14} {seconds:8.1f} s  {detail}", flush=True)
            store.write_text(json.dumps(results))
    table(results, a.presets)


if __name__ == "__main__":
    main()
