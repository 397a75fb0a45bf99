"""Why a forward pass produced NaN/inf logits: the first weight tensor (file order) holding such values.

Off the hot path: callers test the logits once (``check_logits``, one ``isfinite().all()`` per chunk or
step); only when that fails is every weight tensor decoded, in bounded row chunks on the CPU, straight
from the file (nothing is kept or moved to the device).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from forge.errors import ForgeError
from runtime.weights import Weights, dequantize

CHUNK_BYTES = 64 << 20  # decoded float32 bytes per checked piece


def check_logits(logits: torch.Tensor, weights: Weights, where: str) -> None:
    """Raise ForgeError (naming the culprit tensor when there is one) unless every logit is finite."""
    if not bool(torch.isfinite(logits).all()):
        raise nonfinite_logits_error(weights, where)


def nonfinite_logits_error(weights: Weights, where: str) -> ForgeError:
    name = first_nonfinite_tensor(weights)
    if name is None:
        return ForgeError(
            f"non-finite logits at {where} (no weight tensor holds NaN/inf: activations overflowed)"
        )
    return ForgeError(f"non-finite logits at {where}: tensor {name} holds NaN/inf values")


def first_nonfinite_tensor(weights: Weights) -> str | None:
    """The first weight tensor, in file order, whose decoded values include NaN or inf; None if none."""
    for name, pieces in _tensor_pieces(weights):
        if any(not bool(torch.isfinite(p).all()) for p in pieces):
            return name
    return None


def _tensor_pieces(weights: Weights) -> Iterator[tuple[str, Iterator[torch.Tensor]]]:
    """(name, its decoded values as float32 pieces) for every tensor of ``weights``, in file order."""
    file = getattr(weights, "file", None)
    if file is None:  # a Hugging Face folder: float tensors in memory
        for name, t in getattr(weights, "tensors", {}).items():
            yield name, iter([t])
        return
    store = getattr(weights, "store", None)
    for name, info in file.tensors.items():
        if weights.has(name):
            yield name, _decoded_rows(file.raw(name), info.ggml_type, info.shape[-1])
        elif store is not None:  # the expert-major store: its routed tensors, expert by expert
            for lr in store.layers.values():
                for c in lr.components:
                    experts = (store.expert(lr.layer, e)[c.role] for e in range(lr.experts))
                    qtype = GGMLQuantizationType(c.ggml_type)
                    yield lr.canonical_name(c.role), _expert_rows(experts, qtype, c.dims[0])


def _expert_rows(
    experts: Iterator[memoryview], qtype: GGMLQuantizationType, cols: int
) -> Iterator[torch.Tensor]:
    for mv in experts:
        yield from _decoded_rows(np.frombuffer(mv, np.uint8), qtype, cols)


def _decoded_rows(data: np.ndarray, qtype: GGMLQuantizationType, cols: int) -> Iterator[torch.Tensor]:
    """A tensor's bytes (flat uint8) decoded as float32 rows of ``cols`` values, a bounded chunk at a time."""
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    row_bytes = cols // block * block_bytes
    rows = data.reshape(-1, row_bytes)
    step = max(1, CHUNK_BYTES // (4 * cols))
    for i in range(0, rows.shape[0], step):
        yield dequantize(torch.from_numpy(np.array(rows[i : i + step])), qtype, cols)
