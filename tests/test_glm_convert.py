"""GLM MoE families, glm4moe (GLM-4.5/4.6/4.7) and glm-dsa (GLM-5.x): forge convert and forge quantize byte for
byte as llama.cpp's converter and llama-quantize on the tiny random checkpoints (tests/glm_fixture.py;
llama.cpp's outputs as manifests in tests/fixtures/llamacpp/tiny-glm4moe and tiny-glm-dsa, recorded by
benchmarks/glm_oracle.py)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from oracle import llamacpp_file, manifest
from test_convert import _kv_as_manifest, _manifest_of

from forge.convert import convert_checkpoint
from forge.errors import ForgeError
from forge.gguf_file import open_gguf
from forge.quant.quantize import quantize

MODEL = "tiny-glm4moe"
MODELS = ("tiny-glm4moe", "tiny-glm-dsa")


@pytest.fixture
def checkpoint(request: pytest.FixtureRequest):
    """model name -> its HF folder (the session's tiny checkpoints)."""
    return lambda name: request.getfixturevalue(name.replace("-", "_"))


def _kv(value: object) -> object:
    """A KV as the manifests record it (bool arrays: their bytes, one per item)."""
    if isinstance(value, list) and value and isinstance(value[0], bool):
        return {
            "array_len": len(value),
            "sha256": hashlib.sha256(np.asarray(value, bool).tobytes()).hexdigest(),
        }
    return _kv_as_manifest(value)


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
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("preset", ["Q8_0", "Q4_K_M", "Q2_K", "Q4_K_M-imat", "IQ2_XXS-imat"])
def test_quantize_matches_llama_quantize(checkpoint, tmp_path: Path, model: str, preset: str) -> None:
    """``-imat``: with llama-imatrix's file for the model (shipped)."""
    out = tmp_path / "q.gguf"
    imatrix = llamacpp_file(model, f"{model}-imatrix.gguf") if preset.endswith("-imat") else None
    quantize(checkpoint(model), out, preset.removesuffix("-imat").lower(), imatrix=imatrix, mtp=False)
    assert _manifest_of(out) == manifest(model, preset)["tensors"]


def test_glm_dsa_kv_b_is_split_per_head(tiny_glm_dsa: Path, tmp_path: Path) -> None:
    """attn_k_b holds each head's key rows of kv_b_proj transposed, attn_v_b its value rows (independent of
    llama.cpp: from the safetensors)."""
    from safetensors.torch import load_file as load_torch

    out = tmp_path / "m.gguf"
    convert_checkpoint(tiny_glm_dsa, out, "f32", mtp=False)

    kv_b = load_torch(str(tiny_glm_dsa / "model.safetensors"))["model.layers.1.self_attn.kv_b_proj.weight"]
    kv_b = kv_b.float().numpy().reshape(4, 64 + 64, 256)
    r = open_gguf(out)
    np.testing.assert_array_equal(r.array("blk.1.attn_k_b.weight"), kv_b[:, :64].transpose(0, 2, 1))
    np.testing.assert_array_equal(r.array("blk.1.attn_v_b.weight"), kv_b[:, 64:])


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
