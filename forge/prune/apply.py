"""Physical pruning: remove masked experts from a GGUF file.

Every per-expert tensor of a routed layer (``ffn_{gate,up,down,gate_up}_exps``, the router
``ffn_gate_inp`` and a per-expert bias such as ``exp_probs_b``) keeps only the surviving experts' slices,
copied byte for byte (the expert is the outermost dimension, so any quant type slices cleanly). The
shared expert and every other tensor are copied unchanged. A GGUF has one ``expert_count``, so every
routed layer must keep the same number of experts.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from forge.errors import ForgeError
from forge.gguf_file import KV, GGUFFile, TensorSpec, open_gguf, write_gguf
from forge.mask_file import PruneMask

_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")
_PER_EXPERT = re.compile(
    r"^(ffn_\w+_exps\.(weight|bias|scale)|ffn_gate_inp\.(weight|bias)|exp_probs_b\.bias)$"
)
_STORE_TENSORS = ("ds4.expert_major.v1", "ds4.expert_major.v2")


@dataclass
class ApplyReport:
    output: Path
    source_bytes: int
    output_bytes: int
    expert_count: int
    kept: int
    layers: int

    @property
    def saved_bytes(self) -> int:
        return self.source_bytes - self.output_bytes


def routed_layers(f: GGUFFile) -> list[int]:
    """Layers with a router (``blk.N.ffn_gate_inp.weight``), ascending: one mask line each."""
    return sorted(
        int(m.group(1))
        for name in f.tensors
        if (m := _BLK.match(name)) and m.group(2) == "ffn_gate_inp.weight"
    )


# Incremental-rebuild records describe the unpruned tensors: a pruned file is no reuse prior.
_STALE = ("forge.reuse.", "quantize.reuse_key")


def _updated(kv: KV, count_key: str, n_expert: int, n_kept: int) -> KV:
    if kv.key == count_key:
        return KV(kv.key, n_kept, kv.vtype)
    if kv.key == "general.size_label" and isinstance(kv.value, str) and kv.value.startswith(f"{n_expert}x"):
        return KV(kv.key, f"{n_kept}x" + kv.value[len(f"{n_expert}x") :], kv.vtype)
    return kv


def _arch_key(f: GGUFFile, key: str) -> str:
    return f"{f.architecture}.{key}"


def apply_mask(model: str | os.PathLike[str], mask: PruneMask, out: str | os.PathLike[str]) -> ApplyReport:
    """``forge prune apply``: write ``out``, ``model`` without the experts ``mask`` prunes (transactional)."""
    from forge.atomic import check_output_path

    check_output_path(out)
    src = Path(model)
    f = open_gguf(src)
    if int(f.kv("split.count", 1)) > 1:
        raise ForgeError(f"{src}: a split GGUF; merge the shards first (pruning writes one file)")
    if any(name in f.tensors for name in _STORE_TENSORS):
        raise ForgeError(f"{src}: an expert-major file; convert it back to the canonical layout first")
    count_key, used_key = _arch_key(f, "expert_count"), _arch_key(f, "expert_used_count")
    if count_key not in f.kvs or used_key not in f.kvs:
        raise ForgeError(f"{src}: no {count_key}/{used_key}: not a Mixture-of-Experts model")
    n_expert, n_used = int(f.kv(count_key)), int(f.kv(used_key))
    if int(f.kv(_arch_key(f, "nextn_predict_layers"), 0)):
        raise ForgeError(
            f"{src}: has a NextN/MTP block, whose routed experts a mask does not cover (it masks the layers "
            "the model runs); prune a file converted with --no-mtp"
        )
    layers = routed_layers(f)
    if not layers:
        raise ForgeError(f"{src}: no routed layers (no blk.N.ffn_gate_inp.weight)")
    hashed = [layer for layer in layers if f"blk.{layer}.ffn_gate_tid2eid.weight" in f.tensors]
    if hashed:
        raise ForgeError(
            f"{src}: layers {', '.join(map(str, hashed))} are hash-routed (each token id names its experts), so "
            "they keep every expert, and a GGUF has one expert_count: a physically pruned file cannot hold them; "
            "the mask applies to the routed layers at run time (--prune-mask)"
        )
    mask.validate(len(layers), n_expert, n_used, layers)
    kept_counts = mask.kept_per_layer()
    if len(set(kept_counts)) > 1:
        detail = ", ".join(f"layer {layer}: {n}" for layer, n in zip(layers, kept_counts, strict=True))
        raise ForgeError(
            f"{mask.source}: the layers keep different numbers of experts ({detail}); a GGUF has one "
            "expert_count, so physical pruning needs the same number in every layer (build the mask with "
            "--keep or --keep-fraction); the uneven mask can still be used as it is with --prune-mask"
        )
    n_kept = kept_counts[0]
    kept_ids = {layer: np.flatnonzero(~mask.pruned[row]) for row, layer in enumerate(layers)}

    specs: list[TensorSpec] = []
    sources: list[tuple[str, np.ndarray | None]] = []
    for name, info in f.tensors.items():
        m = _BLK.match(name)
        keep = kept_ids.get(int(m.group(1))) if m and _PER_EXPERT.match(m.group(2)) else None
        shape = info.shape
        if m and keep is None and _PER_EXPERT.match(m.group(2)):
            raise ForgeError(f"{src}: {name}: per-expert tensor in layer {m.group(1)}, which has no router")
        if keep is not None:
            if not shape or shape[0] != n_expert:
                raise ForgeError(
                    f"{src}: {name}: shape {shape} does not have {n_expert} experts as its outer dimension"
                )
            shape = (n_kept, *shape[1:])
        specs.append(TensorSpec(name, shape, info.ggml_type))
        sources.append((name, keep))

    kvs = [
        _updated(kv, count_key, n_expert, n_kept) for kv in f.kvs.values() if not kv.key.startswith(_STALE)
    ]

    def data():  # noqa: ANN202 - a generator of tensor bytes
        for name, keep in sources:
            raw = f.raw(name)
            yield raw if keep is None else raw.reshape(n_expert, -1)[keep]

    size = write_gguf(out, kvs, specs, data(), alignment=f.alignment)
    return ApplyReport(Path(out), f.size, size, n_expert, n_kept, len(layers))
