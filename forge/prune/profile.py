"""Expert profiles: how often, how strongly and how saliently each routed expert is used on a text.

Per routed layer and expert: ``tokens`` (the (token, slot) pairs routed to it), ``weight`` (their summed
routing weight) and ``saliency`` (routing weight x L2 norm of the expert's output, averaged over the
pairs it served; 0 for an expert never routed). Collected through the runtime's observer hooks while the
text runs in llama-style chunks (consecutive ``ctx``-token chunks, each from an empty context).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from forge.atomic import atomic_output
from forge.errors import ForgeError
from runtime.observers import Observer

FORMAT = "forge.expert_profile"
VERSION = 1
METRICS = ("count", "weight", "saliency")
# Tie-breakers after the primary metric (then the lower expert id first).
_TIE_ORDER = {
    "count": ("count", "weight", "saliency"),
    "weight": ("weight", "count", "saliency"),
    "saliency": ("saliency", "weight", "count"),
}


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


@dataclass
class LayerProfile:
    layer: int
    count: np.ndarray  # int64 (n_expert,)
    weight: np.ndarray  # float64 (n_expert,)
    saliency: np.ndarray  # float64 (n_expert,)

    def metric(self, name: str) -> np.ndarray:
        if name not in METRICS:
            raise ForgeError(f"unknown ranking {name!r} (choose {', '.join(METRICS)})")
        return getattr(self, name)

    def ranking(self, by: str) -> list[int]:
        """Expert ids from most to least important by ``by`` (ties: the other metrics, then lower id)."""
        keys = [-self.metric(m).astype(np.float64) for m in _TIE_ORDER[by]]
        order = np.lexsort([np.arange(self.count.size), *reversed(keys)])
        return [int(i) for i in order]


@dataclass
class Profile:
    layers: list[LayerProfile]
    expert_count: int
    expert_used_count: int
    tokens: int
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            **self.meta,
            "tokens": self.tokens,
            "expert_count": self.expert_count,
            "expert_used_count": self.expert_used_count,
            "layers": [
                {
                    "layer": lp.layer,
                    "tokens": lp.count.tolist(),
                    "weight": [round(float(v), 6) for v in lp.weight],
                    "saliency": [round(float(v), 6) for v in lp.saliency],
                    "ranking": {m: lp.ranking(m) for m in METRICS},
                }
                for lp in self.layers
            ],
        }

    def save(self, path: str | os.PathLike[str]) -> None:
        with atomic_output(path) as f:
            f.write((json.dumps(self.to_json(), indent=1) + "\n").encode())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Profile:
        try:
            doc = json.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ForgeError(f"{path}: no such file") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ForgeError(f"{path}: not a JSON expert profile ({exc})") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ForgeError(f"{path}: not an expert profile (format is not {FORMAT!r})")
        try:
            n_expert, n_used = int(doc["expert_count"]), int(doc["expert_used_count"])
            layers = []
            for entry in doc["layers"]:
                lp = LayerProfile(
                    int(entry["layer"]),
                    np.asarray(entry["tokens"], dtype=np.int64),
                    np.asarray(entry["weight"], dtype=np.float64),
                    np.asarray(entry["saliency"], dtype=np.float64),
                )
                if not lp.count.shape == lp.weight.shape == lp.saliency.shape == (n_expert,):
                    raise ForgeError(f"{path}: layer {lp.layer} does not list {n_expert} experts")
                layers.append(lp)
            meta = {k: v for k, v in doc.items() if k not in ("format", "version", "layers")}
            return cls(layers, n_expert, n_used, int(doc["tokens"]), meta)
        except (KeyError, TypeError, ValueError) as exc:
            raise ForgeError(f"{path}: malformed expert profile ({type(exc).__name__}: {exc})") from None


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
    from forge.prune.mask import apply_mask_to_model, read_mask
    from runtime.evaluate import perplexity_tokens
    from runtime.models import load_model
    from runtime.tokenizer import Tokenizer

    if out is not None:
        check_output_path(out)
    if ctx < 1:
        raise ForgeError("--ctx must be at least 1")
    if chunks is not None and chunks < 1:
        raise ForgeError("--chunks must be >= 1")
    text_file = Path(text_path)
    if not text_file.is_file():
        raise ForgeError(f"{text_file}: no such file")
    try:
        body = text_file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ForgeError(f"{text_file}: not UTF-8 text") from None
    obs = ExpertProfiler()
    model = load_model(model_path, device=device, observers=[obs])
    if prune_mask is not None:
        apply_mask_to_model(model, read_mask(prune_mask))
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
    prof = profile_from_observer(obs, model.n_expert_used, n_chunks * ctx)
    prof.meta = {"model": str(model_path), "architecture": model.arch, "text": str(text_path), "ctx": ctx,
                 "chunks": n_chunks, "prune_mask": str(prune_mask) if prune_mask else None}  # fmt: skip
    if out is not None:
        prof.save(out)
    return ProfileReport(prof, n_chunks, n_chunks * ctx, seconds)
