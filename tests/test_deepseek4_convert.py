"""DeepSeek V4: forge convert and forge quantize byte for byte against llama.cpp on the tiny checkpoints.

The checkpoints are written in code (tests/deepseek4_fixture.py); llama.cpp's outputs for them are the manifests in
tests/fixtures/llamacpp/tiny-deepseek4 (benchmarks/deepseek4_convert_oracle.py), which also records the checkpoints'
SHA-256: a generator that no longer writes those bytes skips these tests with that reason.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from deepseek4_fixture import CARD_FOLDER, e4m3_values, with_model_card, write_deepseek4
from gguf import GGUFReader, GGUFValueType
from oracle import tensor_manifest
from safetensors.torch import load_file, save_file

from forge.arch.tokenizer import detect_pre_tokenizer
from forge.convert import convert_checkpoint
from forge.errors import ForgeError
from forge.quant.quantize import quantize
from forge.quant.types import get_type

NAME = "tiny-deepseek4"
ORACLE = Path(__file__).resolve().parent / "fixtures" / "llamacpp" / NAME
VARIANTS = {"bf16": {"weights": "bf16"}, "fp8": {"weights": "fp8", "scales": "e8m0"}}
#: as benchmarks/deepseek4_convert_oracle.py built the IQ2_XXS reference
IQ2_XXS_OVERRIDES = ("attn_=q8_0", "shexp=q8_0", "indexer=q8_0", "hc_=q8_0", "compressor=q8_0")


def _manifest(name: str) -> dict:
    return json.loads((ORACLE / "manifests" / f"{name}.json").read_text())


def _kv_manifest(path: Path) -> dict:
    """A GGUF's KVs as the manifests list them (arrays as length + SHA-256 of their raw parts), in file order."""
    out = {}
    for name, f in GGUFReader(path).fields.items():
        if name.startswith("GGUF."):
            continue
        if f.types[0] == GGUFValueType.ARRAY:
            raw = b"".join(np.asarray(f.parts[i]).tobytes() for i in f.data)
            out[name] = {"array_len": len(f.data), "sha256": hashlib.sha256(raw).hexdigest()}
        elif f.types[0] == GGUFValueType.STRING:
            out[name] = bytes(f.parts[f.data[0]]).decode("utf-8", "replace")
        else:
            v = f.parts[f.data[0]].tolist()
            out[name] = v[0] if len(v) == 1 else v
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    recorded = json.loads((ORACLE / "sources.json").read_text())
    out = {}
    for variant, kwargs in VARIANTS.items():
        folder = write_deepseek4(tmp_path_factory.mktemp(variant) / NAME, **kwargs)
        for file, digest in recorded[variant].items():
            if hashlib.sha256((folder / file).read_bytes()).hexdigest() != digest:
                pytest.skip(f"tests/deepseek4_fixture.py no longer writes the recorded {variant} {file} (another "
                            "numpy/safetensors?); rerun benchmarks/deepseek4_convert_oracle.py")  # fmt: skip
        out[variant] = folder
    return out


@pytest.fixture(scope="module")
def converted(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("converted")
    out = {v: convert_checkpoint(p, d / f"{v}.gguf").paths[0] for v, p in checkpoints.items()}
    for v, p in checkpoints.items():  # the MTP block alone, a draft model (llama.cpp's --mtp)
        out[f"{v}-mtp"] = convert_checkpoint(p, d / f"{v}-mtp.gguf", mtp_only=True).paths[0]
    # no template of its own: llama.cpp's DeepSeek V4 template is written (as for deepseek-ai's checkpoints)
    bare = shutil.copytree(checkpoints["bf16"], tmp_path_factory.mktemp("bundled") / NAME)
    (bare / "chat_template.jinja").unlink()
    out["bf16-bundled-template"] = convert_checkpoint(bare, d / "bundled.gguf").paths[0]
    # a published model's folder name, model card and sampling defaults (general.* as gguf's Metadata says)
    card = with_model_card(
        shutil.copytree(checkpoints["bf16"], tmp_path_factory.mktemp("card") / CARD_FOLDER)
    )
    out["bf16-model-card"] = convert_checkpoint(card, d / "card.gguf").paths[0]
    return out


@pytest.mark.parametrize(
    "variant", [*VARIANTS, "bf16-mtp", "fp8-mtp", "bf16-bundled-template", "bf16-model-card"]
)
def test_convert_matches_llamacpp(variant: str, converted: dict[str, Path]) -> None:
    want = _manifest(variant)
    got = tensor_manifest(converted[variant])
    assert [t["name"] for t in got] == [t["name"] for t in want["tensors"]]
    bad = [g["name"] for g, w in zip(got, want["tensors"], strict=True) if g != w]
    assert not bad, f"{len(bad)} tensors differ from llama.cpp's, first {bad[:3]}"
    assert _kv_manifest(converted[variant]) == want["kv"]
    assert list(_kv_manifest(converted[variant])) == list(want["kv"])  # same order


def test_mtp_block_left_out_with_or_without_no_mtp(
    checkpoints: dict[str, Path], converted: dict[str, Path], tmp_path: Path
) -> None:
    out = convert_checkpoint(checkpoints["bf16"], tmp_path / "no-mtp.gguf", mtp=False).paths[0]
    assert out.read_bytes() == converted["bf16"].read_bytes()
    assert not [t for t in tensor_manifest(out) if "nextn" in t["name"] or t["name"].startswith("blk.4.")]


def test_mtp_only_needs_an_mtp_block(tmp_path: Path) -> None:
    ckpt = write_deepseek4(tmp_path / NAME, mtp=False)
    with pytest.raises(ForgeError, match="--mtp-only: the checkpoint has no MTP block"):
        convert_checkpoint(ckpt, tmp_path / "d.gguf", mtp_only=True)
    assert not (tmp_path / "d.gguf").exists()


def test_outtype_does_not_change_the_file(
    checkpoints: dict[str, Path], converted: dict[str, Path], tmp_path: Path
) -> None:
    # llama.cpp's converter types every DeepSeek V4 tensor by its source dtype
    out = convert_checkpoint(checkpoints["fp8"], tmp_path / "f32.gguf", "f32").paths[0]
    assert out.read_bytes() == converted["fp8"].read_bytes()


def test_fp8_float_scales(tmp_path: Path) -> None:
    """F32 block scales (DeepSeek V3's kind) multiply the E4M3 values. llama.cpp's DeepSeek V4 converter reads
    every scale as E8M0 bytes (an F32 scale becomes four bogus exponents), so there is no manifest: the Q8_0
    bytes must be the Q8_0 encoding of weight x scale, computed here from the safetensors on their own."""
    ckpt = write_deepseek4(tmp_path / NAME, weights="fp8", scales="f32")
    out = convert_checkpoint(ckpt, tmp_path / "f.gguf").paths[0]
    hf = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        hf.update(load_file(shard))
    r = GGUFReader(out)
    by_name = {t.name: t for t in r.tensors}
    checked = 0
    for gname, src in (("blk.0.attn_q_a.weight", "layers.0.attn.wq_a"), ("blk.3.ffn_down_shexp.weight",
                       "layers.3.ffn.shared_experts.w2"), ("blk.1.indexer.attn_q_b.weight", "layers.1.attn.indexer.wq_b")):  # fmt: skip
        codes = hf[src + ".weight"].view(torch.uint8).numpy()
        scale = hf[src + ".scale"].numpy()
        assert scale.dtype == np.float32
        rows, cols = codes.shape
        full = np.repeat(np.repeat(scale, 128, axis=0)[:rows], 128, axis=1)[:, :cols]
        want = get_type("Q8_0").encode(e4m3_values()[codes] * full)
        t = by_name[gname]
        assert t.tensor_type.name == "Q8_0"
        assert np.array_equal(np.asarray(t.data).reshape(want.shape), want), gname
        checked += 1
    assert checked == 3


def _quantize_like_llama_quantize(ckpt: Path, name: str, out: Path) -> None:
    if name == "IQ2_XXS-imat":
        quantize(
            ckpt,
            out,
            "iq2_xxs",
            imatrix=ORACLE / f"{NAME}-imatrix.gguf",
            tensor_types=list(IQ2_XXS_OVERRIDES),
        )
    else:
        quantize(ckpt, out, name.lower())


@pytest.mark.parametrize(
    "name", ["Q8_0", "Q4_K_M", "Q2_K",
             pytest.param("IQ2_XXS-imat", marks=pytest.mark.slow)],
)  # fmt: skip
def test_quantize_from_checkpoint_matches_llama_quantize(
    name: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """forge quantize HF_DIR == llama-quantize --allow-requantize on llama.cpp's conversion (MXFP4 experts
    and the Q8_0 tensors decoded and re-encoded, or copied where the type stays)."""
    out = tmp_path / f"{name}.gguf"
    _quantize_like_llama_quantize(checkpoints["bf16"], name, out)
    want = _manifest(name)
    got = tensor_manifest(out)
    assert [t["name"] for t in got] == [t["name"] for t in want["tensors"]]
    bad = [g["name"] for g, w in zip(got, want["tensors"], strict=True) if g != w]
    assert not bad, f"{len(bad)} tensors differ from llama-quantize's, first {bad[:3]}"
    kvs = _kv_manifest(out)
    assert [k for k in kvs if k in want["kv"]] == list(want["kv"])
    # the imatrix's path (llama-quantize records the path it was given) may differ; everything else may not
    assert {k: v for k, v in kvs.items() if k in want["kv"] and k != "quantize.imatrix.file"} == {
        k: v for k, v in want["kv"].items() if k != "quantize.imatrix.file"
    }


def _without(ckpt: Path, tensor: str) -> None:
    """Drop one tensor from the checkpoint (its shard and the index)."""
    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = ckpt / index["weight_map"].pop(tensor)
    tensors = load_file(shard)
    del tensors[tensor]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))


@pytest.mark.parametrize(
    ("weights", "tensor", "message"),
    [("bf16", "layers.2.ffn.experts.5.w3.scale", "layers.2.ffn.experts.5.w3.weight or .scale is missing"),
     ("fp8", "layers.0.attn.wkv.scale", "FP8 tensor layers.0.attn.wkv.weight has no .scale"),
     ("bf16", "layers.1.ffn.gate.tid2eid", "hash-routed layer 1 has no ffn.gate.tid2eid")],
)  # fmt: skip
def test_incomplete_checkpoint_is_one_clear_error(
    weights: str, tensor: str, message: str, tmp_path: Path
) -> None:
    ckpt = write_deepseek4(tmp_path / NAME, weights=weights)
    _without(ckpt, tensor)
    with pytest.raises(ForgeError, match=message.replace(".", r"\.")):
        convert_checkpoint(ckpt, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


def test_ds4_2bit_preset(checkpoints: dict[str, Path]) -> None:
    """The reference engine's 2-bit Flash layout: routed gate/up IQ2_XXS and down Q2_K, attention projections,
    shared expert and output Q8_0, hyper-connections / compressors / indexer / embeddings F16."""
    plan, _ = quantize(checkpoints["fp8"], None, "ds4_2bit", imatrix=ORACLE / f"{NAME}-imatrix.gguf")
    want = [(r"ffn_(gate|up)_exps", "IQ2_XXS"), (r"ffn_down_exps", "Q2_K"),
            (r"blk\.\d+\.attn_(q_a|q_b|kv|output_a|output_b)\.weight|_shexp\.weight|^output\.weight", "Q8_0"),
            (r"hc_\w+_fn|output_hc_fn|compressor_(kv|gate|ape)|indexer\.(proj|attn_q_b)|token_embd", "F16"),
            (r"_norm\.weight|hc_(\w+_)?(base|scale)|attn_sinks|exp_probs_b", "F32"),
            (r"ffn_gate_inp", "BF16"), (r"tid2eid", "I32")]  # fmt: skip
    for p in plan:
        types = {t for pattern, t in want if re.search(pattern, p.name)}
        assert types == {p.out_type.name}, (p.name, p.out_type.name, types)
    assert all(p.importance is not None for p in plan if "_exps" in p.name)


def test_deepseek_v3_pre_tokenizer_is_named() -> None:
    """deepseek-ai's tokenizer.json split sequence (as published for V3 and V4) is llama.cpp's deepseek-v3."""
    pre = json.loads(
        r"""{"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated", "invert": false},
        {"type": "Split", "pattern": {"Regex": "[一-龥぀-ゟ゠-ヿ]+"}, "behavior": "Isolated", "invert": false},
        {"type": "Split", "pattern": {"Regex": "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"}, "behavior": "Isolated", "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]}"""
    )  # fmt: skip
    assert detect_pre_tokenizer({"pre_tokenizer": pre}, "tokenizer.json") == "deepseek-v3"
