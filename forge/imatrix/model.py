"""The in-memory importance matrix: per weight tensor, sums of squared inputs and row counts.

Units follow llama.cpp. With ``chunk_size > 0`` (a GGUF imatrix, or our own collection) ``sums`` are
raw sums of x² over the rows that reached the tensor (per expert for routed experts) and ``counts``
the number of those rows. With ``chunk_size == 0`` the data came from a legacy ``.dat`` file, which
stores normalized values: ``sums`` are the stored values and ``counts`` the entry's ``ncall``. In
both cases the quantizer's weight is ``sums / counts`` (llama.cpp's own legacy loader also marks
such data with chunk size 0).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from forge.errors import ForgeError


@dataclass
class Imatrix:
    """``sums[name]``: float32 (n_mat, n_per_row); ``counts[name]``: int64 (n_mat,).

    ``in_sum`` optionally holds plain sums of x (written by newer llama-imatrix as ``.in_sum``); it is
    kept so that a GGUF round trip is lossless, and never needed by the quantizer.
    """

    sums: dict[str, np.ndarray] = field(default_factory=dict)
    counts: dict[str, np.ndarray] = field(default_factory=dict)
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0
    in_sum: dict[str, np.ndarray] = field(default_factory=dict)
    chunks_planned: int = 0  # > chunk_count: a snapshot of an unfinished collection

    @property
    def partial(self) -> bool:
        return self.chunks_planned > self.chunk_count

    def __post_init__(self) -> None:
        self.check()

    @property
    def counts_are_ncall(self) -> bool:
        """True when the data came from a ``.dat`` file (values normalized, counts are ncall)."""
        return self.chunk_size == 0

    def names(self) -> list[str]:
        """Tensor names in llama.cpp's file order (byte-wise sorted)."""
        return sorted(self.sums)

    def shape(self, name: str) -> tuple[int, int]:
        """(n_mat, n_per_row) of one entry."""
        s = self.sums[name]
        return int(s.shape[0]), int(s.shape[1])

    def check(self) -> None:
        """Refuse inconsistent entries (a programming error or a malformed file)."""
        if set(self.sums) != set(self.counts):
            missing = sorted(set(self.sums) ^ set(self.counts))[0]
            raise ForgeError(f"imatrix entry {missing}: sums and counts do not pair up")
        for name, s in self.sums.items():
            c = self.counts[name]
            if s.dtype != np.float32 or s.ndim != 2:
                raise ForgeError(
                    f"imatrix entry {name}: sums must be float32 (n_mat, n_per_row), got {s.dtype} {s.shape}"
                )
            if c.dtype != np.int64 or c.shape != (s.shape[0],):
                raise ForgeError(
                    f"imatrix entry {name}: counts must be int64 ({s.shape[0]},), got {c.dtype} {c.shape}"
                )
            if (c < 0).any():
                raise ForgeError(f"imatrix entry {name}: negative count")
            a = self.in_sum.get(name)
            if a is not None and (a.dtype != np.float32 or a.shape != s.shape):
                raise ForgeError(
                    f"imatrix entry {name}: in_sum shape {a.shape} differs from in_sum2 {s.shape}"
                )
        if set(self.in_sum) - set(self.sums):
            raise ForgeError(
                f"imatrix entry {sorted(set(self.in_sum) - set(self.sums))[0]}: in_sum without in_sum2"
            )


def merge(imatrices: Iterable[Imatrix]) -> Imatrix:
    """Add imatrices: per tensor sums add and counts add (experts one by one); chunk counts add.

    Tensors present in only some inputs are kept as they are (like llama-imatrix ``--in-file``).
    Inputs must agree on units (GGUF row counts vs ``.dat`` ncall) and on chunk size.
    """
    items = list(imatrices)
    if not items:
        raise ForgeError("merge: no imatrix given")
    chunk_sizes = {im.chunk_size for im in items}
    if len(chunk_sizes) > 1:
        if 0 in chunk_sizes:
            raise ForgeError(
                "merge: cannot add a .dat-derived imatrix (normalized values, ncall counts) to one with raw "
                "row counts; merge files of the same kind"
            )
        raise ForgeError(f"merge: chunk sizes differ ({sorted(chunk_sizes)})")
    out = Imatrix(chunk_size=items[0].chunk_size)
    for im in items:
        out.datasets.extend(im.datasets)
        out.chunk_count += im.chunk_count
        out.chunks_planned += max(im.chunks_planned, im.chunk_count)
        for name, s in im.sums.items():
            if name not in out.sums:
                out.sums[name] = s.astype(np.float32, copy=True)
                out.counts[name] = im.counts[name].copy()
                if name in im.in_sum:
                    out.in_sum[name] = im.in_sum[name].astype(np.float32, copy=True)
                continue
            if out.sums[name].shape != s.shape:
                raise ForgeError(
                    f"merge: tensor {name} has shape {s.shape} in one input, {out.sums[name].shape} in another"
                )
            out.sums[name] += s
            out.counts[name] += im.counts[name]
            if name in out.in_sum and name in im.in_sum:
                out.in_sum[name] += im.in_sum[name]
            else:
                out.in_sum.pop(name, None)  # a partial sum of x would be wrong: drop it
    out.check()
    return out
