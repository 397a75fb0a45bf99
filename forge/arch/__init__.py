"""Architecture tables: one module per Hugging Face ``model_type`` family."""

from __future__ import annotations

from forge.arch.base import Architecture, OutTensor, SourceArray
from forge.arch.deepseek4 import Deepseek4
from forge.arch.glm4moe import Glm4Moe
from forge.arch.glm_dsa import GlmDsa
from forge.arch.qwen3moe import Qwen3Moe
from forge.arch.qwen35moe import Qwen35Moe
from forge.checkpoint import Checkpoint
from forge.errors import ForgeError

ARCHITECTURES: tuple[type[Architecture], ...] = (Qwen3Moe, Qwen35Moe, Glm4Moe, GlmDsa, Deepseek4)


def supported_model_types() -> list[str]:
    return [t for a in ARCHITECTURES for t in a.hf_model_types]


def architecture_for(ckpt: Checkpoint, mtp: bool = True, mtp_only: bool = False) -> Architecture:
    """``mtp_only``: the multi-token-prediction block alone, as a draft model (families that have the export)."""
    cfg = ckpt.config
    model_type = cfg.get("model_type")
    for arch in ARCHITECTURES:
        if model_type in arch.hf_model_types:
            if mtp_only and not arch.exports_mtp_alone:
                raise ForgeError(f"{ckpt.path}: --mtp-only is not available for {arch.gguf_arch} models")
            table = arch(ckpt, mtp=mtp)
            table.mtp_only = mtp_only
            return table
    raise ForgeError(
        f"{ckpt.path}: unsupported model_type {model_type!r}; supported: {', '.join(supported_model_types())}"
    )


__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "OutTensor",
    "SourceArray",
    "architecture_for",
    "supported_model_types",
]
