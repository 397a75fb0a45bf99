"""Prune masks in ds4's grid format: one line per routed layer, one character per expert, ``1`` = prune.

Lines starting with ``#`` and blank lines are comments. Unlike ds4 (which ignores stray characters and
tolerates short lines) a mask here must be exact: every line only ``0``/``1`` and exactly as long as the
model has experts, one line per routed layer, and each layer keeping at least experts-per-token experts.
The toolkit builds masks (forge.prune.mask) and the runtime applies them; both read this file format.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from forge.atomic import atomic_output
from forge.errors import ForgeError


@dataclass
class PruneMask:
    pruned: np.ndarray  # bool (routed layers, n_expert), True = prune
    source: str = "mask"

    @property
    def n_layers(self) -> int:
        return int(self.pruned.shape[0])

    @property
    def n_expert(self) -> int:
        return int(self.pruned.shape[1]) if self.pruned.ndim == 2 and self.pruned.shape[0] else 0

    @property
    def n_pruned(self) -> int:
        return int(self.pruned.sum())

    def kept_per_layer(self) -> list[int]:
        return [int(n) for n in (~self.pruned).sum(axis=1)]

    def validate(self, n_layers: int, n_expert: int, n_used: int, layer_ids: list[int] | None = None) -> None:
        """Refuse a mask that does not fit a model with these routed layers (``layer_ids`` name them)."""
        names = layer_ids if layer_ids is not None else list(range(n_layers))
        if self.n_layers < n_layers:
            raise ForgeError(
                f"{self.source}: {self.n_layers} mask lines for {n_layers} routed layers: "
                f"no line for layer {names[self.n_layers]}"
            )
        if self.n_layers > n_layers:
            raise ForgeError(
                f"{self.source}: {self.n_layers} mask lines for {n_layers} routed layers: "
                f"line {n_layers + 1} has no layer (the last routed layer is {names[-1] if names else 'none'})"
            )
        if self.n_expert != n_expert:
            raise ForgeError(
                f"{self.source}: layer {names[0]}: {self.n_expert} experts in the mask, the model has {n_expert}"
            )
        for row, kept in enumerate(self.kept_per_layer()):
            if kept < n_used:
                raise ForgeError(
                    f"{self.source}: layer {names[row]} keeps {kept} experts, fewer than the "
                    f"{n_used} experts each token uses"
                )


def parse_mask(text: str, source: str = "mask") -> PruneMask:
    rows: list[str] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        if set(s) - {"0", "1"}:
            bad = next(c for c in s if c not in "01")
            raise ForgeError(
                f"{source}: line {lineno} (layer line {len(rows)}): unexpected character {bad!r}; "
                "a mask line holds only 0 (keep) and 1 (prune)"
            )
        if rows and len(s) != len(rows[0]):
            raise ForgeError(
                f"{source}: layer line {len(rows)} has {len(s)} experts, the first line has {len(rows[0])}"
            )
        rows.append(s)
    if not rows:
        raise ForgeError(f"{source}: empty prune mask")
    grid = np.frombuffer("".join(rows).encode("ascii"), dtype=np.uint8).reshape(len(rows), -1)
    return PruneMask(grid == ord("1"), source)


def read_mask(path: str | os.PathLike[str]) -> PruneMask:
    p = Path(path)
    if not p.is_file():
        raise ForgeError(f"{p}: no such file")
    try:
        text = p.read_text(encoding="ascii")
    except UnicodeDecodeError:
        raise ForgeError(f"{p}: not a prune mask (non-ASCII bytes)") from None
    return parse_mask(text, str(p))


def format_mask(mask: PruneMask) -> str:
    return "".join("".join("1" if v else "0" for v in row) + "\n" for row in mask.pruned)


def write_mask(mask: PruneMask, path: str | os.PathLike[str]) -> None:
    with atomic_output(path) as f:
        f.write(format_mask(mask).encode("ascii"))
