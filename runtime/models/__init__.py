"""One module per architecture; ``load_model`` picks the class from ``general.architecture``."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

from forge.errors import ForgeError
from forge.mask_file import PruneMask
from runtime.models.base import MoeCausalLM, State
from runtime.models.deepseek4 import Deepseek4Model
from runtime.models.glm4moe import Glm4MoeModel
from runtime.models.glm_dsa import GlmDsaModel
from runtime.models.qwen3moe import Qwen3MoeModel
from runtime.models.qwen35moe import Qwen35MoeModel
from runtime.observers import Observer
from runtime.weights import DEFAULT_EXPERT_BUDGET, Weights, load_weights

ARCHITECTURES: dict[str, type[MoeCausalLM]] = {
    "qwen3moe": Qwen3MoeModel,
    "qwen35moe": Qwen35MoeModel,
    "deepseek4": Deepseek4Model,
    "glm4moe": Glm4MoeModel,
    "glm-dsa": GlmDsaModel,
}

__all__ = [
    "ARCHITECTURES",
    "MoeCausalLM",
    "State",
    "apply_prune_mask",
    "build_model",
    "load_model",
    "prepare_decode",
]


def build_model(weights: Weights, observers: list[Observer] | None = None) -> MoeCausalLM:
    cls = ARCHITECTURES.get(weights.arch)
    if cls is None:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise ForgeError(
            f"{weights.source}: unsupported architecture {weights.arch!r} (supported: {supported})"
        )
    return cls(weights, observers)


def load_model(
    path: str | Path,
    device: str | torch.device = "cpu",
    observers: list[Observer] | None = None,
    expert_budget: int = DEFAULT_EXPERT_BUDGET,
    ggml_numerics: bool = False,
    stream_experts: int | None = None,
    expert_policy: str = "lru",
    verify_experts: bool = True,
) -> MoeCausalLM:
    """A GGUF file or a Hugging Face folder -> a runnable model on ``device``.

    ``expert_budget``: bytes of decoded routed experts kept resident; the rest are decoded per use.
    ``ggml_numerics``: round matmul inputs (and the KV cache) as llama.cpp's CPU backend does.
    ``stream_experts``: read routed experts from the file into a cache of that many experts
    (``expert_policy`` lru or lfu) instead of keeping them mapped (see runtime.experts).
    """
    weights = load_weights(
        path, device, expert_budget, ggml_numerics, stream_experts, expert_policy, verify_experts
    )
    return build_model(weights, observers)


def prepare_decode(model: MoeCausalLM, log: Callable[[str], None] | None = None) -> None:
    """Load the compiled one-token kernels now (compiling them on a first run, said to ``log``), so that
    no decode step, nor a printed tokens/s figure, pays for it. They run on a thread of their own, which
    then exits: a thread that ran numba's parallel kernels keeps an OpenMP team, and when another thread
    decodes (``forge serve``'s worker), one team too many for the cores makes libgomp's threads sleep between
    every parallel region (+80-100 us a kernel call measured on a 16-core host)."""
    if not (model.weights.cpu_kernels and model.fast_decode):
        return
    from runtime import cpu_kernels

    if not cpu_kernels.cached_on_disk():
        (log or (lambda s: sys.stderr.write(s + "\n")))(
            "compiling the CPU decode kernels (first run after an install, ~30 s; cached on disk)"
        )
    cpu_kernels.on_own_thread(cpu_kernels.warm_up)


def apply_prune_mask(model: object, mask: PruneMask) -> int:
    """Mask a loaded runtime model's routed experts; returns how many are masked. Validates first."""
    layers = model.routed_layers()  # type: ignore[attr-defined]
    mask.validate(len(layers), model.n_expert, model.n_expert_used, layers)  # type: ignore[attr-defined]
    return model.set_prune_mask(torch.from_numpy(mask.pruned.copy()))  # type: ignore[attr-defined]
