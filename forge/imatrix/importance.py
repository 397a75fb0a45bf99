"""What the quantizer asks of an imatrix: per-column weights for one tensor, as llama-quantize computes them.

Weight of expert e, column j = ``sums[e, j] / counts[e]`` in float32: for a GGUF imatrix that is
``in_sum2 / count``, for a ``.dat`` file ``stored / ncall`` (the reader keeps ncall as the count).

Experts with no data (count 0; only a GGUF imatrix can tell) follow a policy, always reported in the
log and never by dropping the tensor's data:

- ``"ones"`` (default, llama.cpp's rule): weight 1 for every column of the unseen expert; a llama.cpp
  imatrix then drives our quantizer to llama-quantize's bytes.
- ``"mean"``: the mean weight of the tensor's seen experts, column by column (an unseen expert is
  assumed to see inputs like its layer's other experts); all unseen -> ones.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Literal

import numpy as np

from forge.errors import ForgeError
from forge.imatrix.model import Imatrix

UnseenPolicy = Literal["ones", "mean"]
log = logging.getLogger(__name__)


def unseen_experts(imatrix: Imatrix, tensor_name: str) -> list[int]:
    """Indices of the entry's matrices (experts) that no row reached; [] for an absent tensor."""
    counts = imatrix.counts.get(tensor_name)
    return [] if counts is None else np.flatnonzero(counts == 0).tolist()


def _check_size(imatrix: Imatrix, tensor_name: str, n_per_row: int, n_mat: int) -> None:
    have_mat, have_cols = imatrix.shape(tensor_name)
    if have_mat * have_cols != n_mat * n_per_row:
        raise ForgeError(
            f"imatrix does not match the model at tensor {tensor_name}: imatrix has {have_mat} x {have_cols} "
            f"values, the model's tensor needs {n_mat} x {n_per_row}"
        )


def importance_for(
    imatrix: Imatrix, tensor_name: str, n_per_row: int, n_mat: int = 1, unseen: UnseenPolicy = "ones"
) -> np.ndarray | None:
    """float32 (n_mat, n_per_row) weights for ``tensor_name``, or None when the imatrix has no entry.

    Like llama-quantize, only the total length must match the model (a flat ``.dat`` entry holds all
    experts back to back). A different length raises ForgeError naming the tensor.
    """
    if unseen not in ("ones", "mean"):
        raise ForgeError(f"unknown policy {unseen!r} for experts without imatrix data (ones|mean)")
    if tensor_name not in imatrix.sums:
        return None
    _check_size(imatrix, tensor_name, n_per_row, n_mat)
    sums, counts = imatrix.sums[tensor_name], imatrix.counts[tensor_name]
    seen = counts > 0
    weights = sums / np.where(seen, counts, 1).astype(np.float32)[:, None]
    if not seen.all():
        missing = np.flatnonzero(~seen).tolist()
        fill = np.ones(sums.shape[1], np.float32)
        if unseen == "mean" and seen.any():
            fill = weights[seen].astype(np.float64).mean(axis=0).astype(np.float32)
        weights[~seen] = fill
        how = "mean of the seen experts" if unseen == "mean" and seen.any() else "weight 1 (llama.cpp's rule)"
        log.warning("%s: %d of %d experts have no imatrix data (%s): using %s",
                    tensor_name, len(missing), len(counts), _ranges(missing), how)  # fmt: skip
    return weights.reshape(n_mat, n_per_row)


def check_matches_model(imatrix: Imatrix, model_shapes: Mapping[str, tuple[int, int]]) -> None:
    """Refuse an imatrix made for another model: every entry must name a model tensor of the same size.

    ``model_shapes``: GGUF tensor name -> (n_mat, n_per_row) (n_mat = experts, 1 for a plain matrix).
    The first mismatching entry, in file order, is named. Model tensors without an entry are fine.
    """
    for name in imatrix.names():
        if name not in model_shapes:
            raise ForgeError(f"imatrix does not match the model: tensor {name} is not in the model")
        n_mat, n_per_row = model_shapes[name]
        _check_size(imatrix, name, n_per_row, n_mat)


def _ranges(ids: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    out: list[str] = []
    start = prev = ids[0]
    for i in [*ids[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(f"{start}-{prev}" if prev > start else str(start))
        if i is not None:
            start = prev = i
    return ", ".join(out)
