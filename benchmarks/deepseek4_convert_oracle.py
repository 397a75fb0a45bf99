"""Record llama.cpp's outputs for the tiny DeepSeek V4 fixtures (tests/deepseek4_fixture.py) as shipped manifests.

    python benchmarks/deepseek4_convert_oracle.py [--lcb /tmp/lcb] [--llama-cpp /tmp/lcpp/src/llama.cpp]
                                                  [--work /tmp/deepseek4-convert-oracle]

Writes into ``tests/fixtures/llamacpp/tiny-deepseek4/``:

- ``manifests/bf16.json`` and ``manifests/fp8.json``: llama.cpp's converter on the bf16 and the FP8 (E8M0
  block scales) checkpoints (routed experts FP4 in both); ``manifests/bf16-bundled-template.json``: the bf16
  one without its chat_template.jinja (the converter then writes llama.cpp's own DeepSeek V4 template);
  ``manifests/bf16-model-card.json``: the bf16 one in a folder named like a published model, with a model card
  and sampling defaults (``general.*`` from gguf's Metadata); ``manifests/{bf16,fp8}-mtp.json``: the converter's
  ``--mtp`` export (the MTP block alone, a draft model);
- ``manifests/{Q8_0,Q4_K_M,Q2_K,IQ2_XXS-imat}.json``: llama-quantize (``--allow-requantize``: the converted
  file already holds MXFP4 and Q8_0 tensors) on the bf16 conversion. IQ2_XXS uses the imatrix below and
  keeps every non-expert matrix at Q8_0 (``--tensor-type``, see IQ2_XXS_OVERRIDES);
- ``tiny-deepseek4-imatrix.gguf``: llama-imatrix on ``tests/fixtures/text/calib.txt`` (8 chunks of 512),
  reduced to the routed-expert entries (as the reference engine's imatrix files are): llama-imatrix records
  the grouped output projection ``attn_output_a`` per group (o_groups x 128 values) and llama-quantize then
  refuses its own file ("imatrix size 256 is different from tensor size 128");
- ``sources.json``: SHA-256 of every file of both checkpoints, so the tests notice a generator that no
  longer writes the same bytes.

The converter runs from llama.cpp's source tree (``--llama-cpp``, the same commit as the build in ``--lcb``):
its DeepSeek V4 class reads ``models/templates/`` there, which the build folder lacks. llama.cpp's converter
names a BPE pre-tokenizer by hashing the token ids of a fixed text, a hash only a
published vocabulary has; the fixture's tiny vocabulary (tiny-qwen3moe's, Qwen2's split) has none, so the
converter runs with that lookup answering ``qwen2``. Nothing else in the converter is changed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from deepseek4_fixture import CARD_FOLDER, with_model_card, write_deepseek4  # noqa: E402
from llamacpp_tools import converter, run  # noqa: E402

NAME = "tiny-deepseek4"
FIXTURES = ROOT / "tests" / "fixtures" / "llamacpp"
TEXT = ROOT / "tests" / "fixtures" / "text"
PRESETS = ("Q8_0", "Q4_K_M", "Q2_K")
#: the non-expert matrices kept at Q8_0 in the IQ2_XXS build (the imatrix covers the routed experts only)
IQ2_XXS_OVERRIDES = ("attn_=q8_0", "shexp=q8_0", "indexer=q8_0", "hc_=q8_0", "compressor=q8_0")
#: the checkpoints: folder variant -> write_deepseek4 arguments
VARIANTS = {"bf16": {"weights": "bf16"}, "fp8": {"weights": "fp8", "scales": "e8m0"}}


def sources(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lcb", type=Path, default=Path("/tmp/lcb"))
    ap.add_argument("--llama-cpp", type=Path, default=Path("/tmp/lcpp/src/llama.cpp"), help="source tree")
    ap.add_argument("--work", type=Path, default=Path("/tmp/deepseek4-convert-oracle"))
    ap.add_argument("--tool", type=Path, default=ROOT.parent / "shared" / "tools" / "gguf_manifest.py")
    ap.add_argument("--chunks", type=int, default=8)
    a = ap.parse_args()
    dest = FIXTURES / NAME
    (dest / "manifests").mkdir(parents=True, exist_ok=True)

    def manifest(gguf: Path, label: str) -> None:
        run([sys.executable, str(a.tool), str(gguf), str(dest / "manifests" / f"{label}.json")])

    def convert(model: Path, out: Path, *extra: str) -> Path:
        run([*converter(a.llama_cpp, "qwen2"), str(model), "--outfile", str(out), *extra])
        return out

    hashes = {}
    for variant, kwargs in VARIANTS.items():
        model = write_deepseek4(a.work / variant / NAME, **kwargs)
        hashes[variant] = sources(model)
        manifest(convert(model, a.work / f"{NAME}-{variant}.gguf"), variant)
        manifest(convert(model, a.work / f"{NAME}-{variant}-mtp.gguf", "--mtp"), f"{variant}-mtp")
    model = write_deepseek4(a.work / "bundled" / NAME, **VARIANTS["bf16"])
    (model / "chat_template.jinja").unlink()
    manifest(convert(model, a.work / f"{NAME}-bundled.gguf"), "bf16-bundled-template")
    model = with_model_card(write_deepseek4(a.work / "card" / CARD_FOLDER, **VARIANTS["bf16"]))
    manifest(convert(model, a.work / f"{NAME}-card.gguf"), "bf16-model-card")
    (dest / "sources.json").write_text(json.dumps(hashes, indent=1) + "\n")

    bf16 = a.work / f"{NAME}-bf16.gguf"
    full = a.work / f"{NAME}-imatrix-full.gguf"
    run([str(a.lcb / "bin" / "llama-imatrix"), "-m", str(bf16), "-f", str(TEXT / "calib.txt"), "-o", str(full),
         "-c", "512", "-b", "512", "--chunks", str(a.chunks), "-t", "2"])  # fmt: skip
    imatrix = dest / f"{NAME}-imatrix.gguf"
    _experts_only(full, imatrix)

    quantize = [str(a.lcb / "bin" / "llama-quantize"), "--allow-requantize"]
    for preset in PRESETS:
        q = a.work / f"{NAME}-{preset}.gguf"
        run([*quantize, str(bf16), str(q), preset, "2"])
        manifest(q, preset)
    q = a.work / f"{NAME}-IQ2_XXS-imat.gguf"
    overrides = [x for o in IQ2_XXS_OVERRIDES for x in ("--tensor-type", o)]
    run([*quantize, "--imatrix", str(imatrix), *overrides, str(bf16), str(q), "IQ2_XXS", "2"])
    manifest(q, "IQ2_XXS-imat")
    print(f"wrote {dest}")


def _experts_only(src: Path, dst: Path) -> None:
    from forge.imatrix.formats import read_imatrix, write_gguf_imatrix
    from forge.imatrix.model import Imatrix

    im = read_imatrix(src)
    keep = [n for n in im.sums if "_exps." in n]
    write_gguf_imatrix(
        Imatrix(
            {n: im.sums[n] for n in keep},
            {n: im.counts[n] for n in keep},
            im.datasets,
            im.chunk_count,
            im.chunk_size,
            {n: im.in_sum[n] for n in keep if n in im.in_sum},
        ),  # fmt: skip
        dst,
    )


if __name__ == "__main__":
    main()
