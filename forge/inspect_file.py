"""What is inside a GGUF file: architecture, hyperparameters, tensors by type, layout and build keys."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType, LlamaFileType

from forge.gguf_file import open_gguf

LAYOUT_TENSORS = ("ds4.expert_major.v2", "ds4.expert_major.v1")


def describe(path: str | Path) -> dict[str, Any]:
    """A JSON-ready summary of a GGUF file."""
    path = Path(path)
    r = open_gguf(path)
    arch = r.architecture
    hyper = {
        k.removeprefix(f"{arch}."): kv.value
        for k, kv in r.kvs.items()
        if k.startswith(f"{arch}.") and kv.vtype != GGUFValueType.ARRAY
    }
    by_type: dict[str, dict[str, int]] = defaultdict(lambda: {"tensors": 0, "bytes": 0, "elements": 0})
    n_elements = n_bytes = 0
    for t in r.tensors.values():
        entry = by_type[t.ggml_type.name]
        elements = int(np.prod(t.shape, dtype=np.int64))
        entry["tensors"] += 1
        entry["bytes"] += t.nbytes
        entry["elements"] += elements
        n_elements += elements
        n_bytes += t.nbytes
    file_type = r.kv("general.file_type")
    try:
        file_type_name = (
            LlamaFileType(file_type).name.removeprefix("MOSTLY_") if file_type is not None else None
        )
    except ValueError:
        file_type_name = str(file_type)
    layout = next((n for n in LAYOUT_TENSORS if n in r.tensors), "canonical")
    reuse = {k: kv.value for k, kv in r.kvs.items() if k.startswith("quantize.reuse_key")}
    return {
        "file": str(path),
        "file_bytes": path.stat().st_size,
        "architecture": arch,
        "name": r.kv("general.name"),
        "file_type": file_type_name,
        "hyperparameters": hyper,
        "tensor_count": len(r.tensors),
        "kv_count": len(r.kvs),
        "tensor_bytes": n_bytes,
        "parameters": n_elements,
        "bits_per_weight": round(8 * n_bytes / n_elements, 4) if n_elements else 0.0,
        "by_type": {k: dict(v) for k, v in sorted(by_type.items(), key=lambda kv: -kv[1]["bytes"])},
        "layout": layout,
        "recipe": r.kv("forge.recipe"),
        "reuse_keys": reuse,
        "imatrix": r.kv("quantize.imatrix.file"),
    }
