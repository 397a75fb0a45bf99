"""Expert-range slices of a source tensor: read on a worker, or read on the driver and shipped.

A routed-expert tensor (numpy shape ``(n_expert, rows, cols)``) is split into ranges of whole
experts. Every ggml type encodes rows independently, so encoding the ranges apart and concatenating
gives the bytes of encoding the tensor at once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from forge.bulk import float32_values
from forge.quant.source import GGUFQuantSource, QuantSource, SourceRef


@dataclass(frozen=True)
class Part:
    """Experts ``[lo, hi)`` of a tensor; ``None`` bounds mean the whole tensor."""

    lo: int | None = None
    hi: int | None = None

    @property
    def whole(self) -> bool:
        return self.lo is None


def split_experts(shape: tuple[int, ...], max_elements: int) -> list[Part]:
    """Ranges of whole experts of at most ``max_elements`` each (at least one expert per range)."""
    if len(shape) != 3 or shape[0] < 2:
        return [Part()]
    per_expert = shape[1] * shape[2]
    step = max(1, max_elements // per_expert)
    if step >= shape[0]:
        return [Part()]
    return [Part(lo, min(lo + step, shape[0])) for lo in range(0, shape[0], step)]


def read_part(source: QuantSource, name: str, part: Part) -> np.ndarray:
    """float32 values of the part, exactly as ``source.float32(name)[lo:hi]``."""
    if part.whole:
        return source.float32(name)
    if isinstance(source, GGUFQuantSource):  # experts are contiguous: decode only the range
        t = source.file.tensors[name]
        raw = np.asarray(source.file.raw(name)).reshape(t.shape[0], -1)[part.lo : part.hi]
        return float32_values(raw, t.ggml_type).reshape(part.hi - part.lo, *t.shape[1:])
    return np.ascontiguousarray(source.float32(name)[part.lo : part.hi])


@dataclass(frozen=True)
class Shipped:
    """A part's values as the driver sends them: stored bytes plus their type, or float32."""

    data: np.ndarray
    ggml_type: int | None  # None: ``data`` is already float32
    shape: tuple[int, ...]

    def values(self) -> np.ndarray:
        if self.ggml_type is None:
            return self.data
        return float32_values(self.data, GGMLQuantizationType(self.ggml_type)).reshape(self.shape)


def ship_part(source: QuantSource, name: str, part: Part, last: dict | None = None) -> Shipped:
    """What a worker that cannot see the source needs: GGUF sources send their stored (e.g. bf16)
    bytes, half the size of float32; other sources send float32 (``last`` keeps the most recent
    whole tensor so that its expert ranges are produced once)."""
    if isinstance(source, GGUFQuantSource):
        t = source.file.tensors[name]
        raw = np.asarray(source.file.raw(name))
        if part.whole:
            return Shipped(raw.copy(), int(t.ggml_type), tuple(t.shape))
        data = raw.reshape(t.shape[0], -1)[part.lo : part.hi].reshape(-1).copy()
        return Shipped(data, int(t.ggml_type), (part.hi - part.lo, *t.shape[1:]))
    if part.whole:
        values = source.float32(name)
    else:
        last = {} if last is None else last
        if last.get("name") != name:
            last.update(name=name, values=source.float32(name))
        values = last["values"][part.lo : part.hi]
    return Shipped(np.ascontiguousarray(values), None, values.shape)


def fingerprint(ref: SourceRef) -> tuple:
    """What identifies the source's files (names, sizes, whole-second mtimes) on any machine that
    mounts them; ``()`` when the path is not visible here."""
    path = Path(ref.path)
    if not path.exists():
        return ()
    files = (
        [path]
        if path.is_file()
        else sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".json"))
    )
    out = []
    for p in files:
        try:
            st = os.stat(p)
        except OSError:
            return ()
        out.append((p.name, st.st_size, int(st.st_mtime)))
    return tuple(out)
