"""Record llama.cpp's outputs for the tiny GLM fixtures (tests/glm_fixture.py) as shipped manifests.

    python benchmarks/glm_oracle.py [--model tiny-glm4moe tiny-glm-dsa] [--lcb /tmp/lcb] [--work /tmp/glm-oracle]

Writes, per model, ``tests/fixtures/llamacpp/MODEL/manifests/{bf16,f32,bf16-no-mtp,PRESET,PRESET-imat}.json`` with
``gguf_manifest.py`` (``../shared/tools``, the tool that made the tiny-qwen3moe manifests), and
llama-imatrix's output on ``text/calib.txt`` (``MODEL-imatrix.gguf``, used for the ``-imat`` presets) and
llama-perplexity's figure on the bf16 GGUF into ``tests/fixtures/llamacpp/glm_perplexity.json``.

llama.cpp's converter names a BPE pre-tokenizer by hashing the token ids of a fixed text, a hash that only
a published vocabulary has; the tiny vocabulary has none, so the converter runs here with that lookup
answering ``glm4`` (what it answers for GLM-4.5's vocabulary, whose split the fixture uses). Nothing else
in the converter is changed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from glm_fixture import write_glm4moe, write_glm_dsa  # noqa: E402
from llamacpp_tools import converter, run  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "llamacpp"


def convert(lcb: Path, model: Path, out: Path, outtype: str, *extra: str) -> Path:
    run([*converter(lcb, "glm4"), str(model), "--outtype", outtype, "--outfile", str(out), *extra])
    return out


def manifest(tool: Path, gguf: Path, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    run([sys.executable, str(tool), str(gguf), str(out)])


def perplexity(lcb: Path, gguf: Path, text: Path, chunks: int) -> float:
    cmd = [str(lcb / "bin" / "llama-perplexity"), "-m", str(gguf), "-f", str(text), "-c", "512", "-b", "512",
           "--chunks", str(chunks), "-t", "2"]  # fmt: skip
    for _ in range(3):  # its last log lines are written asynchronously and now and then lost at exit
        log = run(cmd)
        if m := re.search(r"Final estimate: PPL = ([0-9.]+)", log):
            return float(m[1])
        running = re.findall(r"\[\d+\]([0-9.]+),", log)  # the running estimate after each chunk
        if len(running) == chunks:
            return float(running[-1])
    raise SystemExit(f"{' '.join(cmd)}: no final perplexity in its output")


MODELS = {"tiny-glm4moe": write_glm4moe, "tiny-glm-dsa": write_glm_dsa}


def record(a: argparse.Namespace, name: str) -> dict:
    """One model's manifests and imatrix; returns its perplexity figure."""
    model = MODELS[name](a.work / name)
    dest = FIXTURES / name / "manifests"
    bf16 = convert(a.lcb, model, a.work / f"{name}-bf16.gguf", "bf16")
    manifest(a.tool, bf16, dest / "bf16.json")
    manifest(a.tool, convert(a.lcb, model, a.work / f"{name}-f32.gguf", "f32"), dest / "f32.json")
    no_mtp = convert(a.lcb, model, a.work / f"{name}-bf16-no-mtp.gguf", "bf16", "--no-mtp")
    manifest(a.tool, no_mtp, dest / "bf16-no-mtp.json")
    text = ROOT / "tests" / "fixtures" / "text"
    imatrix = FIXTURES / name / f"{name}-imatrix.gguf"
    run([str(a.lcb / "bin" / "llama-imatrix"), "-m", str(no_mtp), "-f", str(text / "calib.txt"), "-o", str(imatrix),
         "-c", "512", "-b", "512", "--chunks", str(a.chunks), "-t", "2"])  # fmt: skip
    for preset in a.presets + [f"{p}-imat" for p in a.imatrix_presets]:
        q = a.work / f"{name}-{preset}.gguf"
        im = ["--imatrix", str(imatrix)] if preset.endswith("-imat") else []
        run(
            [
                str(a.lcb / "bin" / "llama-quantize"),
                *im,
                str(no_mtp),
                str(q),
                preset.removesuffix("-imat"),
                "2",
            ]
        )
        manifest(a.tool, q, dest / f"{preset}.json")
    ppl = perplexity(a.lcb, no_mtp, text / "val.txt", a.chunks)
    return {"bf16-no-mtp": {"ppl": ppl, "chunks": a.chunks, "ctx": 512}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lcb", type=Path, default=Path("/tmp/lcb"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/glm-oracle"))
    ap.add_argument("--tool", type=Path, default=ROOT.parent / "shared" / "tools" / "gguf_manifest.py")
    ap.add_argument("--model", nargs="*", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--presets", nargs="*", default=["Q8_0", "Q4_K_M", "Q2_K"])
    ap.add_argument("--imatrix-presets", nargs="*", default=["Q4_K_M", "IQ2_XXS"])
    ap.add_argument("--chunks", type=int, default=8)
    a = ap.parse_args()
    path = FIXTURES / "glm_perplexity.json"
    figures = json.loads(path.read_text()) if path.is_file() else {}
    for name in a.model:
        figures[name] = record(a, name)
        path.write_text(json.dumps(figures, indent=1) + "\n")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
