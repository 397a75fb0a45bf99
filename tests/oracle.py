"""Where the tests find their oracle: llama.cpp's outputs for the fixture models.

Two places, looked up in this order:

- ``tests/fixtures/`` (in the repository, see its README): for tiny-qwen3moe, whose weights are
  ``examples/tiny-qwen3moe``, the manifests of llama.cpp's converted and quantized files (tensor SHA-256 and
  KVs), its llama-imatrix files, llama-perplexity's figures and the start of the two texts;
- an optional larger folder laid out the same way, ``FORGE_SHARED_FIXTURES`` (default ``../shared/fixtures``
  beside the checkout): llama.cpp's full GGUFs and the tiny-qwen35moe model with its manifests. What needs
  it skips cleanly when it is absent.
"""

from __future__ import annotations

import ctypes
import json
import os
from functools import cache
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = Path(__file__).resolve().parent / "fixtures"
SHARED = Path(os.environ.get("FORGE_SHARED_FIXTURES") or ROOT.parent / "shared" / "fixtures")
MODELS = ("tiny-qwen3moe", "tiny-qwen35moe")
#: fixture models whose Hugging Face folder is in the repository (byte for byte the fixture's)
IN_REPO = {"tiny-qwen3moe": ROOT / "examples" / "tiny-qwen3moe"}


def fixture(*parts: str) -> Path:
    """A fixture file or folder: shipped in tests/fixtures, else from the optional folder; skips if neither."""
    for base in (SHIPPED, SHARED):
        path = base.joinpath(*parts)
        if path.exists():
            return path
    pytest.skip(f"fixture {'/'.join(parts)} is not shipped and {SHARED} does not have it")


def fixtures() -> Path:
    """The optional folder; skips when it is absent."""
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} is absent (set FORGE_SHARED_FIXTURES)")
    return SHARED.resolve()


def model_dir(model: str) -> Path:
    return IN_REPO.get(model) or fixture(model)


def llamacpp_dir(model: str) -> Path:
    """llama.cpp's full outputs for a model (the optional folder only)."""
    return fixtures() / "llamacpp" / model


def llamacpp_output(model: str, name: str) -> Path:
    """A file of llama.cpp's full outputs for a model (the optional folder only); skips if absent."""
    path = llamacpp_dir(model) / name
    if not path.exists():
        pytest.skip(f"{path} is absent")
    return path


def llamacpp_file(model: str, name: str) -> Path:
    """One of llama.cpp's files for a model (e.g. ``tiny-qwen3moe-imatrix.gguf``), shipped or not."""
    return fixture("llamacpp", model, name)


def text(name: str) -> Path:
    """``val.txt`` or ``calib.txt``: the shipped start (32 chunks of 512 tokens and a little more)."""
    return fixture("text", name)


def manifest_names(model: str) -> list[str]:
    """Manifest stems (e.g. 'Q4_K_M-imat') present for a model, shipped or in the optional folder."""
    dirs = (base / "llamacpp" / model / "manifests" for base in (SHIPPED, SHARED))
    return sorted({p.stem for d in dirs if d.is_dir() for p in d.glob("*.json")})


@cache
def manifest(model: str, name: str) -> dict:
    return json.loads(fixture("llamacpp", model, "manifests", f"{name}.json").read_text())


def manifest_tensor(model: str, name: str, tensor: str) -> dict:
    return next(t for t in manifest(model, name)["tensors"] if t["name"] == tensor)


def tensor_manifest(path: Path) -> list[dict]:
    """A GGUF's tensors as a manifest lists them (read with the ``gguf`` package, independent of forge)."""
    import hashlib

    from gguf import GGUFReader

    return [{"name": t.name, "type": t.tensor_type.name, "shape": [int(n) for n in t.shape], "nbytes": int(t.n_bytes),
             "sha256": hashlib.sha256(np.ascontiguousarray(t.data).tobytes()).hexdigest()}
            for t in GGUFReader(path).tensors]  # fmt: skip


@cache
def perplexity_figures() -> dict[str, dict[str, dict]]:
    """model -> file label ('bf16', 'Q8_0', 'Q4_K_M-imat', ...) -> llama-perplexity's ppl, kld_mean, same_top_token."""
    return json.loads(fixture("llamacpp", "perplexity.json").read_text())["models"]


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

    r = GGUFReader(llamacpp_file(model, f"{model}-imatrix.gguf"))
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


@cache
def _load_libggml(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p]  # fmt: skip
    return lib


def libggml() -> ctypes.CDLL:
    """llama.cpp's libggml-base (a development oracle for the encoders): the file FORGE_LIBGGML names; skips
    without it. ``ggml_quantize_init(type)`` and ``ggml_quantize_chunk(type, src, dst, start, nrows, n_per_row,
    imatrix)`` are typed."""
    path = os.environ.get("FORGE_LIBGGML", "")
    if not os.path.isfile(path):
        pytest.skip("no libggml-base (set FORGE_LIBGGML to the shared library of a llama.cpp build)")
    return _load_libggml(path)


def llama_quantize() -> str:
    """llama.cpp's ``llama-quantize`` binary (an optional oracle for type plans): the file
    FORGE_LLAMA_QUANTIZE names (``build/bin/llama-quantize`` of a llama.cpp CMake build); skips without it."""
    path = os.environ.get("FORGE_LLAMA_QUANTIZE", "")
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        pytest.skip("no llama-quantize (set FORGE_LLAMA_QUANTIZE to the binary of a llama.cpp build)")
    return path
