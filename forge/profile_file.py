"""Expert profiles: how often, how strongly and how saliently each routed expert is used on a text.

Per routed layer and expert: ``tokens`` (the (token, slot) pairs routed to it), ``weight`` (their summed
routing weight) and ``saliency`` (routing weight x L2 norm of the expert's output, averaged over the
pairs it served; 0 for an expert never routed). This module is the file format (no torch): forge.prune.collect
gathers a profile through the runtime's observer hooks, and the runtime reads one to seed its GPU expert cache
(runtime.hybrid).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from forge.atomic import atomic_output
from forge.errors import ForgeError

FORMAT = "forge.expert_profile"
VERSION = 1
METRICS = ("count", "weight", "saliency")
# Tie-breakers after the primary metric (then the lower expert id first).
_TIE_ORDER = {
    "count": ("count", "weight", "saliency"),
    "weight": ("weight", "count", "saliency"),
    "saliency": ("saliency", "weight", "count"),
}


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
