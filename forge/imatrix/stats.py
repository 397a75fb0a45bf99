"""``forge imatrix show``: what an imatrix holds, per tensor and per expert."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from forge.imatrix.model import Imatrix


@dataclass
class TensorStats:
    """Statistics of one entry. ``rows`` are row counts (``.dat``: ncall units, see ``counts_unit``).

    Value statistics are over the weights (mean x² per column, ``sums / counts``) of the seen experts.
    """

    name: str
    n_mat: int
    n_per_row: int
    rows: int
    counts_unit: str
    experts_seen: int
    unseen_experts: list[int]
    count_min: int
    count_max: int
    value_min: float
    value_mean: float
    value_max: float
    value_std: float
    zero_columns: int

    def to_dict(self) -> dict:
        return asdict(self)


def tensor_stats(im: Imatrix, name: str) -> TensorStats:
    sums, counts = im.sums[name], im.counts[name]
    seen = counts > 0
    values = (sums[seen] / counts[seen].astype(np.float32)[:, None]).astype(np.float64)
    has = values.size > 0
    return TensorStats(
        name=name,
        n_mat=int(sums.shape[0]),
        n_per_row=int(sums.shape[1]),
        rows=int(counts.sum()),
        counts_unit="ncall" if im.counts_are_ncall else "rows",
        experts_seen=int(seen.sum()),
        unseen_experts=np.flatnonzero(~seen).tolist(),
        count_min=int(counts.min()),
        count_max=int(counts.max()),
        value_min=float(values.min()) if has else 0.0,
        value_mean=float(values.mean()) if has else 0.0,
        value_max=float(values.max()) if has else 0.0,
        value_std=float(values.std()) if has else 0.0,
        zero_columns=int((values == 0).sum()),
    )


def summary(im: Imatrix) -> dict:
    """Everything ``show --json`` prints: file-level metadata and per-tensor statistics."""
    tensors = [tensor_stats(im, n) for n in im.names()]
    return {
        "datasets": list(im.datasets),
        "chunk_count": im.chunk_count,
        "chunk_size": im.chunk_size,
        "partial": im.partial,
        "chunks_planned": max(im.chunks_planned, im.chunk_count),
        "counts_unit": "ncall" if im.counts_are_ncall else "rows",
        "entries": len(tensors),
        "entries_with_unseen_experts": sum(1 for t in tensors if t.unseen_experts),
        "tensors": [t.to_dict() for t in tensors],
    }
