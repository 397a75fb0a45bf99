"""glm4moe (GLM-4.5/4.6/4.7): forge convert and forge quantize byte for byte as llama.cpp's converter and
llama-quantize on the tiny random checkpoint (tests/glm_fixture.py; llama.cpp's outputs as manifests in
tests/fixtures/llamacpp/tiny-glm4moe, recorded by benchmarks/glm_oracle.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from oracle import llamacpp_file, manifest
from test_convert import _kv_as_manifest, _manifest_of

from forge.convert import convert_checkpoint
from forge.errors import ForgeError
from forge.gguf_file import open_gguf
from forge.quant.quantize import quantize

MODEL = "tiny-glm4moe"


@pytest.mark.parametrize(("name", "outtype", "mtp"), [("bf16", "bf16", True), ("f32", "f32", True),
                                                      ("bf16-no-mtp", "bf16", False)])  # fmt: skip
def test_matches_llamacpp_converter(
    tiny_glm4moe: Path, tmp_path: Path, name: str, outtype: str, mtp: bool
) -> None:
    ref = manifest(MODEL, name)
    out = tmp_path / "m.gguf"
    convert_checkpoint(tiny_glm4moe, out, outtype, mtp=mtp)
    assert _manifest_of(out) == ref["tensors"]
    kvs = {k: _kv_as_manifest(kv.value) for k, kv in open_gguf(out).kvs.items()}
    assert list(kvs) == list(ref["kv"])
    for key, value in ref["kv"].items():
        assert kvs[key] == (pytest.approx(value, rel=1e-7) if isinstance(value, float) else value), key


def test_mtp_block_is_one_more_layer(tiny_glm4moe: Path) -> None:
    with_mtp, without = manifest(MODEL, "bf16"), manifest(MODEL, "bf16-no-mtp")
    extra = {t["name"] for t in with_mtp["tensors"]} - {t["name"] for t in without["tensors"]}
    assert extra and all(n.startswith("blk.3.") for n in extra)
    assert {"blk.3.nextn.eh_proj.weight", "blk.3.nextn.shared_head_norm.weight"} <= extra
    assert with_mtp["kv"]["glm4moe.block_count"] == 4 and without["kv"]["glm4moe.block_count"] == 3
    assert "glm4moe.nextn_predict_layers" not in without["kv"]


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["Q8_0", "Q4_K_M", "Q2_K", "Q4_K_M-imat", "IQ2_XXS-imat"])
def test_quantize_matches_llama_quantize(tiny_glm4moe: Path, tmp_path: Path, preset: str) -> None:
    """``-imat``: with llama-imatrix's file for the model (shipped)."""
    out = tmp_path / "q.gguf"
    imatrix = llamacpp_file(MODEL, f"{MODEL}-imatrix.gguf") if preset.endswith("-imat") else None
    quantize(tiny_glm4moe, out, preset.removesuffix("-imat").lower(), imatrix=imatrix, mtp=False)
    assert _manifest_of(out) == manifest(MODEL, preset)["tensors"]


def test_missing_glm_special_token_is_one_error(tiny_glm4moe: Path, tmp_path: Path) -> None:
    broken = tmp_path / "tiny-glm4moe"
    broken.mkdir()
    for p in tiny_glm4moe.iterdir():
        (broken / p.name).symlink_to(p)
    tok = json.loads((tiny_glm4moe / "tokenizer.json").read_text())
    tok["added_tokens"] = [a for a in tok["added_tokens"] if a["content"] != "[gMASK]"]
    tok["model"]["vocab"].pop("[gMASK]", None)
    (broken / "tokenizer.json").unlink()
    (broken / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ForgeError, match=r"no '\[gMASK\]' token"):
        convert_checkpoint(broken, tmp_path / "m.gguf", "bf16")
