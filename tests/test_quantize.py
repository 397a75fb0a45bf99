"""forge quantize: llama.cpp's bytes for every fixture manifest, recipes, dry run, jobs, refusals."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import EXAMPLE
from oracle import MODELS, llamacpp_file, manifest, manifest_names, model_dir

from forge.errors import ForgeError
from forge.gguf_file import open_gguf
from forge.quant.quantize import quantize
from forge.quant.recipe import available_recipes, load_recipe, parse_overrides, parse_recipe

CASES = [(m, n) for m in MODELS for n in manifest_names(m) if n not in ("bf16", "f32")]


def _preset(manifest_name: str) -> str:
    return manifest_name.removesuffix("-imat").lower()


def _tensor_manifest(path: Path) -> list[dict]:
    r = open_gguf(path)
    return [{"name": t.name, "type": t.ggml_type.name, "shape": list(reversed(t.shape)), "nbytes": t.nbytes,
             "sha256": hashlib.sha256(np.asarray(r.raw(t.name)).tobytes()).hexdigest()} for t in r.tensors.values()]  # fmt: skip


def _quantize_like_llamacpp(model: str, name: str, out: Path) -> None:
    imatrix = llamacpp_file(model, f"{model}-imatrix.gguf") if name.endswith("-imat") else None
    quantize(model_dir(model), out, _preset(name), imatrix=imatrix, mtp=False)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "name"), CASES)
def test_every_manifest_bit_exact(model: str, name: str, tmp_path: Path) -> None:
    out = tmp_path / "q.gguf"
    _quantize_like_llamacpp(model, name, out)
    got, want = _tensor_manifest(out), manifest(model, name)["tensors"]
    assert [t["name"] for t in got] == [t["name"] for t in want]
    bad = [g["name"] for g, w in zip(got, want, strict=True) if g != w]
    assert not bad, f"{len(bad)} tensors differ, first {bad[:3]}"


def test_q8_0_bit_exact_and_kvs(tmp_path: Path) -> None:
    out = tmp_path / "q.gguf"
    _quantize_like_llamacpp("tiny-qwen3moe", "Q8_0", out)
    ref = manifest("tiny-qwen3moe", "Q8_0")
    assert _tensor_manifest(out) == ref["tensors"]
    r = open_gguf(out)
    assert r.kv("general.file_type") == ref["kv"]["general.file_type"] == 7
    assert r.kv("general.quantization_version") == 2
    assert 'name = "q8_0"' in r.kv("forge.recipe")


def test_dry_run_size_is_exact_and_jobs_do_not_change_bytes(tmp_path: Path) -> None:
    overrides = ["ffn_.*_exps=q8_0", "attn=q4_0"]
    _, dry = quantize(EXAMPLE, None, "q6_k", tensor_types=overrides)
    assert not list(tmp_path.iterdir())
    one, two = tmp_path / "one.gguf", tmp_path / "two.gguf"
    quantize(EXAMPLE, one, "q6_k", tensor_types=overrides, jobs=1)
    quantize(EXAMPLE, two, "q6_k", tensor_types=overrides, jobs=2)
    assert one.stat().st_size == dry.bytes
    assert one.read_bytes() == two.read_bytes()
    types = {t.name: t.ggml_type.name for t in open_gguf(one).tensors.values()}
    assert types["blk.0.ffn_up_exps.weight"] == "Q8_0" and types["blk.1.attn_q.weight"] == "Q4_0"
    assert types["output.weight"] == "Q6_K" and types["blk.0.ffn_gate_inp.weight"] == "F32"


def test_recipe_precedence() -> None:
    recipe = parse_recipe(
        """
default = "q4_k"
[[rules]]
pattern = "attn"
type = "q5_k"
[[rules]]
pattern = "attn_v"
type = "q6_k"
[[rules]]
name = "blk.0.attn_v.weight"
type = "q8_0"
[[rules]]
pattern = "ffn_down"
when = "i >= n - 1"
type = "q6_k"
"""
    )

    def env(rule: object, layer: int = 0) -> dict[str, int]:
        return {"i": layer, "n": 4}

    assert recipe.type_for("blk.0.attn_v.weight", env)[0] == "Q8_0"  # exact name beats patterns
    assert recipe.type_for("blk.1.attn_v.weight", env)[0] == "Q5_K"  # first matching pattern in file order
    assert recipe.type_for("blk.1.ffn_up.weight", env)[0] == "Q4_K"  # default
    assert recipe.type_for("blk.3.ffn_down.weight", lambda r: env(r, 3))[0] == "Q6_K"  # when holds
    assert recipe.type_for("blk.2.ffn_down.weight", lambda r: env(r, 2))[0] == "Q4_K"  # when fails
    over = parse_overrides(["BLK\\.0\\.ATTN_V=q2_k"])
    assert recipe.type_for("blk.0.attn_v.weight", env, over) == (
        "Q2_K",
        "--tensor-type blk\\.0\\.attn_v=Q2_K",
    )


def test_malformed_recipes_name_the_line(tmp_path: Path) -> None:
    with pytest.raises(ForgeError, match="line 4"):
        parse_recipe('default = "q4_k"\n\n[[rules]]\npattern = "attn_v"\ntype = "q9_z"\n', "r.toml")
    with pytest.raises(ForgeError, match="line 2"):
        parse_recipe('default = "q4_k"\nthis is not toml\n', "r.toml")
    with pytest.raises(ForgeError, match="exactly one of"):
        parse_recipe('default = "q4_k"\n[[rules]]\ntype = "q8_0"\n', "r.toml")
    with pytest.raises(ForgeError, match="unknown recipe"):
        load_recipe("q7_k_xl")


def test_every_preset_parses() -> None:
    names = available_recipes()
    assert {"q4_k_m", "q8_0", "iq2_xxs", "moe_2bit"} <= set(names)
    for name in names:
        assert load_recipe(name).default


def test_refusals(tmp_path: Path) -> None:
    with pytest.raises(ForgeError, match="needs an importance matrix"):
        quantize(EXAMPLE, tmp_path / "x.gguf", "iq2_xxs")
    with pytest.raises(ForgeError, match="tensor output.weight needs an importance matrix"):
        quantize(EXAMPLE, tmp_path / "x.gguf", "q8_0", tensor_types=["output=iq2_xxs"])
    q8 = tmp_path / "q8.gguf"
    quantize(EXAMPLE, q8, "q8_0")
    with pytest.raises(ForgeError, match="already quantized"):
        quantize(q8, tmp_path / "y.gguf", "q4_k_m")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q8.gguf"]


def test_cli_json_report(tmp_path: Path) -> None:
    out = tmp_path / "q.gguf"
    proc = subprocess.run([sys.executable, "-m", "forge", "quantize", str(EXAMPLE), "-o", str(out), "--recipe", "q8_0",
                           "--json"], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["file_bytes"] == out.stat().st_size
    assert {t["action"] for t in rep["tensors"]} == {"encoded", "copied"}
    assert rep["by_type"]["Q8_0"]["tensors"] == 30
    # where the time went: the writer's own stages add up to the build's time, the workers' are per tensor
    st = rep["stages"]
    assert set(st) == {"source_keys", "read", "encode", "waited", "output_digests", "writing"}
    assert all(v >= 0 for v in st.values()) and st["encode"] > 0
    assert st["waited"] + st["output_digests"] + st["writing"] == pytest.approx(rep["seconds"], abs=0.01)
    assert st["read"] + st["encode"] == pytest.approx(
        sum(t.get("seconds", 0) for t in rep["tensors"]), abs=0.05
    )
