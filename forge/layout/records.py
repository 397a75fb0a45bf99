"""Per-layer record geometry shared by the v1 and v2 stores.

One record per (layer, expert) holds ``gate | up | down`` adjacent, each the expert's slice of the
canonical tensor, unchanged. Records of a layer follow each other at ``stride`` bytes (v2: the
record size; v1: the record size rounded up to 4,096).
"""

from __future__ import annotations

from dataclasses import dataclass

from forge.errors import ForgeError
from forge.gguf_file import tensor_nbytes
from forge.layout.gguf_raw import type_geometry
from forge.layout.source import ROLES, SourcePlan, routed_name

PAGE = 4096


@dataclass(frozen=True)
class Component:
    role: int  # 0 gate, 1 up, 2 down
    ggml_type: int
    dims: tuple[int, int, int]  # GGUF order: ne0, ne1, experts
    expert_bytes: int
    record_offset: int

    @property
    def block_elements(self) -> int:
        return type_geometry(self.ggml_type)[0]

    @property
    def canonical_name_suffix(self) -> str:
        return f"ffn_{ROLES[self.role]}_exps.weight"


@dataclass(frozen=True)
class LayerRecords:
    layer: int  # model layer index (blk.N)
    experts: int
    components: tuple[Component, Component, Component]
    data_offset: int  # from the start of the store
    stride: int  # bytes from one expert's record to the next
    source_index: tuple[int, int, int] | None = None  # source directory positions, when recorded

    @property
    def record_bytes(self) -> int:
        return sum(c.expert_bytes for c in self.components)

    @property
    def data_size(self) -> int:
        return self.stride * self.experts

    def canonical_name(self, role: int) -> str:
        return routed_name(self.layer, ROLES[role])

    def canonical_bytes(self, role: int) -> int:
        return self.components[role].expert_bytes * self.experts


def components_from_source(plan: SourcePlan) -> list[tuple[int, tuple[Component, Component, Component]]]:
    out = []
    for rl in plan.layers:
        comps, offset = [], 0
        for role, t in enumerate(rl.tensors):
            per_expert = t.nbytes // plan.experts
            comps.append(Component(role, t.ggml_type, t.dims, per_expert, offset))  # type: ignore[arg-type]
            offset += per_expert
        out.append((rl.layer, tuple(comps)))
    return out  # type: ignore[return-value]


def check_component(c: Component, role: int, experts: int, where: str) -> None:
    """Structural rules every component must satisfy; ForgeError naming ``where`` otherwise."""
    name = ROLES[role] if 0 <= role < 3 else str(role)
    if c.role != role:
        raise ForgeError(f"{where} {name}: role {c.role}, expected {role}")
    if any(d == 0 for d in c.dims) or c.dims[2] != experts:
        raise ForgeError(f"{where} {name}: dims {list(c.dims)} invalid for {experts} experts")
    try:
        total = tensor_nbytes(tuple(reversed(c.dims)), c.ggml_type, f"{where} {name}")
    except ForgeError as e:
        raise ForgeError(str(e)) from None
    if c.expert_bytes * experts != total:
        raise ForgeError(
            f"{where} {name}: per-expert bytes {c.expert_bytes}, type and dims give {total // experts}"
        )


def check_ffn_shape(comps: tuple[Component, Component, Component], where: str) -> None:
    gate, up, down = comps
    if up.dims != gate.dims or down.dims != (gate.dims[1], gate.dims[0], gate.dims[2]):
        raise ForgeError(
            f"{where}: gate {list(gate.dims)}, up {list(up.dims)}, down {list(down.dims)} are not an expert FFN"
        )
