"""Access to ../shared/fixtures (llama.cpp's outputs): skip cleanly when the folder is absent."""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path

import numpy as np
import pytest

FIXTURES = Path(
    os.environ.get("FORGE_FIXTURES", Path(__file__).resolve().parents[1] / ".." / "shared" / "fixtures")
)
MODELS = ("tiny-qwen3moe", "tiny-qwen35moe")


def fixtures() -> Path:
    if not FIXTURES.is_dir():
        pytest.skip("../shared/fixtures is absent")
    return FIXTURES.resolve()


def model_dir(model: str) -> Path:
    return fixtures() / model


def llamacpp_dir(model: str) -> Path:
    return fixtures() / "llamacpp" / model


def manifest_names(model: str) -> list[str]:
    """Manifest stems (e.g. 'Q4_K_M-imat') present for a model; [] without the fixtures."""
    d = FIXTURES / "llamacpp" / model / "manifests"
    return sorted(p.stem for p in d.glob("*.json")) if d.is_dir() else []


@cache
def manifest(model: str, name: str) -> dict:
    return json.loads((llamacpp_dir(model) / "manifests" / f"{name}.json").read_text())


def manifest_tensor(model: str, name: str, tensor: str) -> dict:
    return next(t for t in manifest(model, name)["tensors"] if t["name"] == tensor)


@cache
def hf_tensors(model: str) -> dict:
    """All HF tensors of a fixture as float32 numpy arrays (they are small)."""
    from safetensors.torch import load_file as load_torch

    out = {}
    for shard in sorted(model_dir(model).glob("*.safetensors")):
        for k, v in load_torch(str(shard)).items():
            out[k] = v.float().numpy()
    return out


_QWEN3MOE_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.gate",
}


def qwen3moe_tensor(gguf_name: str) -> np.ndarray:
    """A tiny-qwen3moe tensor in GGUF layout (numpy shape = reversed ggml ne), float32.

    A test helper independent of forge's converter, so encoders can be checked on their own.
    """
    hf = hf_tensors("tiny-qwen3moe")
    top = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output.weight": "lm_head.weight",
        "output_norm.weight": "model.norm.weight",
    }
    if gguf_name in top:
        return hf[top[gguf_name]]
    _, layer, kind, _ = gguf_name.split(".")
    if kind.endswith("_exps"):
        proj = kind.removeprefix("ffn_").removesuffix("_exps")
        n = sum(
            1
            for k in hf
            if k.startswith(f"model.layers.{layer}.mlp.experts.") and k.endswith(f"{proj}_proj.weight")
        )
        return np.stack([hf[f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"] for e in range(n)])
    return hf[f"model.layers.{layer}.{_QWEN3MOE_NAMES[kind]}.weight"]


@cache
def llamacpp_importance(model: str) -> dict[str, np.ndarray]:
    """llama-quantize's view of <model>-imatrix.gguf: name -> (n_mat, n_per_row) float32 weights.

    value = in_sum2 / count of its expert; an expert with count 0 gets all-ones (as llama.cpp does).
    """
    from gguf import GGUFReader

    r = GGUFReader(llamacpp_dir(model) / f"{model}-imatrix.gguf")
    t = {x.name: np.array(x.data, dtype=np.float32) for x in r.tensors}
    out = {}
    for name, sums in t.items():
        if not name.endswith(".in_sum2"):
            continue
        base = name.removesuffix(".in_sum2")
        counts = t[base + ".counts"].reshape(-1, 1)
        sums = sums.reshape(counts.shape[0], -1)
        with np.errstate(divide="ignore", invalid="ignore"):
            v = np.where(counts > 0, sums / np.where(counts > 0, counts, 1), 1.0).astype(np.float32)
        out[base] = v
    return out
