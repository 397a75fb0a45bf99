"""How a trained MoE's routing uses an expert cache: the streaming benchmark's cache runs on a real trace.

    python benchmarks/routing_locality.py [MODEL.gguf ...] [--text FILE] [--tokens 2048] [--json OUT]

The synthesized 35B-geometry file has random routers, so ``benchmarks/streaming.py`` routes by an
assumed trace (uniform: no locality; zipf: an assumed skew). This script measures what a *trained*
router does instead: it runs each model (default: examples/tiny-qwen3moe, and tiny-qwen35moe from the folder
FORGE_SHARED_FIXTURES names, if set; bf16) over the text,
(HF folders are converted to a temporary bf16 GGUF first), records every token's experts per layer in decode order, and replays that trace through the runtime's
``ExpertCache`` (bookkeeping only: no I/O) at the cache shares of experts that 1, 2, 4 and 8 GiB give the
Qwen3.6-35B-A3B Q4_K geometry (5.9, 11.8, 23.7, 47.4% of all experts; never below the floor). The
first quarter of the tokens warms the cache; the rest is measured: hit rate and bytes read per token
as a share of the no-cache minimum (experts per token x record bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from forge.convert import convert_checkpoint
from runtime.experts import ExpertCache
from runtime.models import build_model
from runtime.observers import Observer
from runtime.prefetch import ROUTER, RouterGuess
from runtime.synth import GEOMETRIES
from runtime.tokenizer import Tokenizer
from runtime.weights import load_weights

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
QWEN35MOE = Path(os.environ.get("FORGE_SHARED_FIXTURES") or FIXTURES) / "tiny-qwen35moe"  # not shipped
Q36 = GEOMETRIES["qwen3.6-35b-a3b"]
Q36_RECORD = 1_769_472  # bytes of one Q4_K expert record (gate|up|down) in that geometry
SHARES = {f"{g} GiB": (g << 30) // Q36_RECORD / (Q36.layers * Q36.experts) for g in (1, 2, 4, 8)}


class RoutingRecorder(Observer):
    """Each layer's chosen experts; with ``guess`` (``runtime.prefetch.RouterGuess``) also, per layer after
    the first, what its router guessed from the layer before's input (``--prefetch``'s guess)."""

    def __init__(self, guess: RouterGuess | None = None) -> None:
        self.ids: dict[int, list[np.ndarray]] = {}
        self.guess, self.guesses = guess, {}
        self._x: tuple[int, torch.Tensor] | None = None

    def on_matmul_input(self, tensor_name: str, x: torch.Tensor, expert_ids: torch.Tensor | None) -> None:
        if self.guess is not None and expert_ids is None and tensor_name.endswith(ROUTER):
            self._x = (int(tensor_name.split(".")[1]), x)

    def on_routing(
        self, layer: int, experts: torch.Tensor, weights: torch.Tensor, logits: torch.Tensor
    ) -> None:
        self.ids.setdefault(layer, []).append(experts.cpu().numpy())
        if self.guess is not None and self._x is not None and self._x[0] == layer:
            guess = self.guess.rows(layer, self._x[1])
            if guess is not None:
                self.guesses.setdefault(guess[0], []).append(guess[1])


def record(
    model_path: Path, text: str, n_tokens: int, ctx: int = 512, guesses: dict[int, np.ndarray] | None = None
) -> tuple[dict, dict[int, np.ndarray]]:
    """The model's routed expert layers, and per layer the (n_tokens, k) expert ids of each token, from
    prefill chunks of ``ctx`` tokens; ``guesses``: filled with the (n_tokens, k) guesses of each layer
    after the first (``RoutingRecorder``)."""
    w = load_weights(model_path)
    rec = RoutingRecorder()
    model = build_model(w, [rec])
    if guesses is not None:
        rec.guess = RouterGuess(model, list(model.routed_layers()))
    tokens = Tokenizer.from_metadata(w).encode(text)[:n_tokens]
    with torch.inference_mode():
        for s in range(0, len(tokens), ctx):
            chunk = torch.tensor(tokens[s : s + ctx])
            model.forward(chunk, model.new_state(len(chunk)))
    if guesses is not None:
        guesses.update({layer: np.concatenate(v) for layer, v in sorted(rec.guesses.items())})
    return w.expert_layers(), {layer: np.concatenate(v) for layer, v in sorted(rec.ids.items())}


def replay(path: Path, layers: dict, trace: dict, share: float, policy: str) -> dict:
    k = next(iter(trace.values())).shape[1]
    total = sum(lay.experts for lay in layers.values())
    floor = len(layers) * k + 1
    capacity = max(floor, round(share * total))
    cache = ExpertCache(path, layers, capacity, k, policy)
    cache.simulate = True
    n = len(next(iter(trace.values())))
    warm = n // 4
    for t in range(n):
        if t == warm:
            lookups0, hits0 = cache.stats.lookups, cache.stats.hits
        for layer, ids in trace.items():
            cache.rows(layer, sorted(set(ids[t].tolist())))
    cache.close()
    lookups, hits = cache.stats.lookups - lookups0, cache.stats.hits - hits0
    return {"capacity": capacity, "share": capacity / total, "at_floor": capacity == floor,
            "hit_rate": hits / lookups, "bytes_vs_minimum": 1 - hits / lookups}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", type=Path)
    ap.add_argument("--text", type=Path, default=FIXTURES / "text" / "val.txt")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    models = args.models or [ROOT / "examples" / "tiny-qwen3moe"] + (
        [QWEN35MOE] if QWEN35MOE.is_dir() else []
    )
    text = args.text.read_text()
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for m in models:
            path = m
            if m.is_dir():
                path = Path(tmp) / f"{m.name}-bf16.gguf"
                convert_checkpoint(m, path, "bf16")
            layers, trace = record(path, text, args.tokens)
            first = next(iter(trace.values()))
            print(f"{m.name}: {len(layers)} routed layers x {next(iter(layers.values())).experts} experts, "
                  f"top {first.shape[1]}, {len(first)} tokens")  # fmt: skip
            for label, share in SHARES.items():
                for policy in ("lru", "lfu"):
                    r = replay(path, layers, trace, share, policy)
                    out.append(r | {"model": m.name, "budget": label, "policy": policy})
                    floor = ", floor" if r["at_floor"] else ""
                    print(f"  {label:>6} share {r['share']:5.1%} ({r['capacity']} experts{floor}) {policy}: "
                          f"hit {r['hit_rate']:6.1%}, bytes read {r['bytes_vs_minimum']:6.1%} of minimum")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
