"""How far ``--q8-activations`` moves a model's decode logits, beside ``--ggml-numerics`` (llama.cpp's numerics
throughout, on the torch path), both from the default float32 path: the largest |logit difference| over
``--steps`` one-token decode steps after an 8-token prompt, as a share of the largest |logit|.

    python benchmarks/q8_activations.py F.gguf [--steps 32]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.models import load_model  # noqa: E402


def decode(path: Path, ids: torch.Tensor, q8: bool, ggml: bool) -> torch.Tensor:
    os.environ["FORGE_Q8_ACTIVATIONS"] = "1" if q8 else "0"  # read when the model's matrices are built
    model = load_model(path, "cpu", ggml_numerics=ggml)
    state = model.new_state()
    model.forward(ids[:8], state)
    return torch.cat([model.forward(ids[i : i + 1], state, last_only=True) for i in range(8, len(ids))])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--steps", type=int, default=32)
    a = ap.parse_args()
    ids = torch.randint(0, 1000, (8 + a.steps,), generator=torch.Generator().manual_seed(0))
    base = decode(a.gguf, ids, False, False)
    scale = base.abs().max()
    for name, q8, ggml in (("--q8-activations", True, False), ("--ggml-numerics", False, True)):
        moved = (decode(a.gguf, ids, q8, ggml) - base).abs().max() / scale
        print(f"{a.gguf.name}: {name} moves the logits by up to {100 * moved:.1f}% of their scale")


if __name__ == "__main__":
    main()
