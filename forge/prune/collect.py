"""Collect an expert profile: the text runs through the runtime in llama-style chunks (consecutive
``ctx``-token chunks, each from an empty context) while an observer counts what the router does."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from forge.errors import ForgeError
from forge.fileio import read_text
from forge.prune.profile import LayerProfile, Profile
from runtime.observers import Observer


class ExpertProfiler(Observer):
    """Observer summing, per routed layer, each expert's routed pairs, routing weight and weight x |output|."""

    def __init__(self) -> None:
        self.count: dict[int, torch.Tensor] = {}
        self.weight: dict[int, torch.Tensor] = {}
        self.weighted_norm: dict[int, torch.Tensor] = {}

    def _entry(self, layer: int, n_expert: int, device: torch.device) -> None:
        if layer not in self.count:
            self.count[layer] = torch.zeros(n_expert, dtype=torch.int64, device=device)
            self.weight[layer] = torch.zeros(n_expert, dtype=torch.float64, device=device)
            self.weighted_norm[layer] = torch.zeros(n_expert, dtype=torch.float64, device=device)

    def on_routing(
        self, layer: int, experts: torch.Tensor, weights: torch.Tensor, logits: torch.Tensor
    ) -> None:
        self._entry(layer, int(logits.shape[-1]), logits.device)
        ids = experts.reshape(-1).long()
        self.count[layer] += torch.bincount(ids, minlength=self.count[layer].numel())
        self.weight[layer].index_add_(0, ids, weights.reshape(-1).double())

    def on_expert_output(
        self, layer: int, expert_ids: torch.Tensor, outputs: torch.Tensor, weights: torch.Tensor
    ) -> None:
        if layer not in self.weighted_norm:
            raise ForgeError(f"profile: layer {layer} reported expert outputs before its routing")
        norms = torch.linalg.vector_norm(outputs.double(), dim=-1)
        self.weighted_norm[layer].index_add_(0, expert_ids.long(), weights.double() * norms)


def profile_from_observer(obs: ExpertProfiler, expert_used_count: int, tokens: int) -> Profile:
    layers = []
    for layer in sorted(obs.count):
        count = obs.count[layer].cpu().numpy()
        weight = obs.weight[layer].cpu().numpy()
        total = obs.weighted_norm[layer].cpu().numpy()
        saliency = np.divide(total, count, out=np.zeros_like(total), where=count > 0)
        layers.append(LayerProfile(layer, count, weight, saliency))
    n_expert = int(layers[0].count.size) if layers else 0
    return Profile(layers, n_expert, expert_used_count, tokens)


@dataclass
class ProfileReport:
    profile: Profile
    chunks: int
    tokens: int
    seconds: float
    hash_routed: list[int]  # layers that route by token id (DeepSeek V4): not profiled, no mask covers them


def collect_profile(
    model_path: str | os.PathLike[str],
    text_path: str | os.PathLike[str],
    out: str | os.PathLike[str] | None,
    ctx: int = 512,
    chunks: int | None = None,
    device: str = "cpu",
    prune_mask: str | os.PathLike[str] | None = None,
    log: Callable[[str], None] | None = None,
) -> ProfileReport:
    """``forge prune profile``: run ``text_path`` through the model in ``ctx``-token chunks and profile it.

    With ``prune_mask`` the profile is taken on the masked model (to refine a mask iteratively).
    """
    from forge.atomic import check_output_path
    from forge.mask_file import read_mask
    from runtime.evaluate import perplexity_tokens
    from runtime.models import apply_prune_mask, load_model
    from runtime.tokenizer import Tokenizer

    if out is not None:
        check_output_path(out)
    if ctx < 1:
        raise ForgeError("--ctx must be at least 1")
    if chunks is not None and chunks < 1:
        raise ForgeError("--chunks must be >= 1")
    text_file = Path(text_path)
    body = read_text(text_file)
    obs = ExpertProfiler()
    model = load_model(model_path, device=device, observers=[obs])
    if prune_mask is not None:
        apply_prune_mask(model, read_mask(prune_mask))
    if ctx > model.n_ctx_train:
        raise ForgeError(f"--ctx {ctx} is longer than the model's context ({model.n_ctx_train})")
    ids = perplexity_tokens(Tokenizer.from_metadata(model.weights), body, ctx, chunks)
    available = len(ids) // ctx
    if available < 1:
        raise ForgeError(f"{text_file}: {len(ids)} tokens, fewer than one chunk of {ctx}")
    n_chunks = available if chunks is None else min(chunks, available)
    tokens = torch.tensor(ids[: n_chunks * ctx], dtype=torch.long).reshape(n_chunks, ctx)
    start = time.perf_counter()
    for i in range(n_chunks):
        model.forward(tokens[i].to(model.weights.device), model.new_state(ctx))
        if log:
            log(f"chunk {i + 1}/{n_chunks}")
    seconds = time.perf_counter() - start
    hashed = sorted(set(obs.count) - set(model.routed_layers()))
    for counts in (obs.count, obs.weight, obs.weighted_norm):  # DeepSeek V4's first layers route by token id
        for layer in hashed:
            counts.pop(layer, None)
    prof = profile_from_observer(obs, model.n_expert_used, n_chunks * ctx)
    prof.meta = {"model": str(model_path), "architecture": model.arch, "text": str(text_path), "ctx": ctx,
                 "chunks": n_chunks, "prune_mask": str(prune_mask) if prune_mask else None,
                 "hash_routed_layers": hashed}  # fmt: skip
    if out is not None:
        prof.save(out)
    return ProfileReport(prof, n_chunks, n_chunks * ctx, seconds, hashed)
