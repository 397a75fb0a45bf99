"""What an expert-major (or canonical) GGUF holds, as a plain dict for tables and ``--json``."""

from __future__ import annotations

import os

from forge.errors import ForgeError
from forge.layout.convert import plan_native
from forge.layout.gguf_raw import open_gguf, type_name
from forge.layout.reader import parse_native, store_tensor
from forge.layout.records import LayerRecords
from forge.layout.source import FAMILY_NAMES, plan_source


def _layer_row(lr: LayerRecords) -> dict[str, object]:
    gate, up, down = lr.components
    return {
        "layer": lr.layer,
        "types": [type_name(c.ggml_type) for c in lr.components],
        "gate_bytes": gate.expert_bytes,
        "up_bytes": up.expert_bytes,
        "down_bytes": down.expert_bytes,
        "record_bytes": lr.record_bytes,
        "stride": lr.stride,
    }


def inspect_file(path: str | os.PathLike[str]) -> dict[str, object]:
    """Family, layers, experts, record bytes per layer, store and overhead bytes.

    For a canonical file the figures are those the v2 and v1 conversions would produce.
    """
    with open_gguf(path) as raw:
        if store_tensor(raw) is not None:
            store = parse_native(raw)
            layers = list(store.layers.values())
            routed = sum(lr.record_bytes * lr.experts for lr in layers)
            return {
                "file": str(raw.path),
                "layout": f"v{store.version}",
                "family": store.family_name,
                "family_id": store.family,
                "architecture": raw.kv.get("general.architecture"),
                "layers": len(layers),
                "experts": store.experts,
                "experts_used": store.experts_used,
                "record_bytes": {str(lr.layer): lr.record_bytes for lr in layers},
                "per_layer": [_layer_row(lr) for lr in layers],
                "routed_bytes": routed,
                "store_bytes": store.store_size,
                "overhead_bytes": store.store_size - routed,
                "file_bytes": raw.size,
                "source_bytes": store.header.source_size,
                "size_delta_bytes": raw.size - store.header.source_size,
                "source_order": "derived"
                if store.layers[layers[0].layer].source_index is None
                else "recorded",
                "source_sha256": store.header.source_sha256.hex(),
                "payload_sha256": store.header.payload_sha256.hex(),
            }
        plan = plan_source(raw)
        planned = {}
        for version in (2, 1):
            try:
                nat = plan_native(plan, version)
            except ForgeError as e:  # a family v1 does not support
                planned[f"v{version}"] = {"error": str(e)}
                continue
            planned[f"v{version}"] = {
                "store_bytes": nat.store_size,
                "overhead_bytes": nat.store_size - plan.routed_bytes,
                "file_bytes": nat.out_size,
                "size_delta_bytes": nat.out_size - raw.size,
            }
        nat2 = plan_native(plan, 2)
        return {
            "file": str(raw.path),
            "layout": "canonical",
            "family": FAMILY_NAMES[plan.family],
            "family_id": plan.family,
            "architecture": plan.arch,
            "layers": len(plan.layers),
            "experts": plan.experts,
            "experts_used": plan.experts_used,
            "record_bytes": {str(lr.layer): lr.record_bytes for lr in nat2.layers},
            "per_layer": [_layer_row(lr) for lr in nat2.layers],
            "routed_bytes": plan.routed_bytes,
            "store_bytes": nat2.store_size,  # as v2
            "overhead_bytes": nat2.store_size - plan.routed_bytes,
            "file_bytes": raw.size,
            "planned": planned,
        }
