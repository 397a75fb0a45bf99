"""The canonical side: which tensors are routed experts, per family, and how to put them back.

A canonical MoE GGUF holds each layer's routed experts in three 3-D tensors
``blk.N.ffn_{gate,up,down}_exps.weight`` (dims ne0, ne1, experts). This module finds them, checks
that the file is laid out the way GGUF writers lay files out (so that the inverse conversion can
rebuild it byte for byte), and rebuilds the source tensor order from an expert-major file.
"""

from __future__ import annotations

from dataclasses import dataclass

from forge.errors import ForgeError
from forge.gguf_file import align_up
from forge.layout.gguf_raw import RawGGUF, RawTensor, packed_offsets

FAMILY_DEEPSEEK4 = 1
FAMILY_GLM_DSA = 2
FAMILY_QWEN35MOE = 3
# gguf-forge extension: ids 0x4647xxxx ("FG") are ours and never used by ds4.
FAMILY_QWEN3MOE = 0x4647_0001
FAMILY_GLM4MOE = 0x4647_0002

FAMILIES = {
    "deepseek4": FAMILY_DEEPSEEK4,
    "glm-dsa": FAMILY_GLM_DSA,
    "qwen35moe": FAMILY_QWEN35MOE,
    "qwen3moe": FAMILY_QWEN3MOE,
    "glm4moe": FAMILY_GLM4MOE,
}
#: families whose first ``leading_dense_block_count`` layers have a dense FFN instead of routed experts
DENSE_LEAD_FAMILIES = (FAMILY_GLM_DSA, FAMILY_GLM4MOE)
FAMILY_NAMES = {v: k for k, v in FAMILIES.items()}

ROLES = ("gate", "up", "down")
STORE_TENSOR_NAMES = ("ds4.expert_major.v1", "ds4.expert_major.v2")


def routed_name(layer: int, role: str) -> str:
    return f"blk.{layer}.ffn_{role}_exps.weight"


def is_routed_name(name: str) -> bool:
    parts = name.split(".")
    return (
        len(parts) == 4
        and parts[0] == "blk"
        and parts[1].isdigit()
        and parts[2] in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
        and parts[3] == "weight"
    )


@dataclass(frozen=True)
class RoutedLayer:
    layer: int
    tensors: tuple[RawTensor, RawTensor, RawTensor]  # gate, up, down
    source_index: tuple[int, int, int]  # positions in the source tensor directory


@dataclass(frozen=True)
class SourcePlan:
    raw: RawGGUF
    arch: str
    family: int
    experts: int
    experts_used: int
    layers: tuple[RoutedLayer, ...]
    kept: tuple[RawTensor, ...]  # non-routed tensors, in source order

    @property
    def routed_bytes(self) -> int:
        return sum(t.nbytes for layer in self.layers for t in layer.tensors)


def family_of(raw: RawGGUF) -> tuple[str, int]:
    arch = raw.kv.get("general.architecture")
    if not isinstance(arch, str):
        raise ForgeError(f"{raw.path}: no general.architecture KV")
    if arch not in FAMILIES:
        raise ForgeError(
            f"{raw.path}: architecture {arch!r} has no expert-major family (supported: {', '.join(FAMILIES)})"
        )
    return arch, FAMILIES[arch]


def _kv_int(raw: RawGGUF, key: str) -> int:
    value = raw.kv.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ForgeError(f"{raw.path}: missing or invalid integer KV {key}")
    return value


def plan_source(raw: RawGGUF) -> SourcePlan:
    """Find the routed experts of a canonical GGUF; refuse what cannot be converted losslessly."""
    arch, family = family_of(raw)
    for t in raw.tensors:
        if t.name in STORE_TENSOR_NAMES:
            raise ForgeError(
                f"{raw.path}: already expert-major (holds tensor {t.name}); convert it to canonical first"
            )
    block_count = _kv_int(raw, f"{arch}.block_count")
    experts = _kv_int(raw, f"{arch}.expert_count")
    used = _kv_int(raw, f"{arch}.expert_used_count")
    first = _kv_int(raw, f"{arch}.leading_dense_block_count") if family in DENSE_LEAD_FAMILIES else 0
    if experts == 0 or not first < block_count:
        raise ForgeError(
            f"{raw.path}: no routed layers ({arch}.expert_count={experts}, block_count={block_count})"
        )
    index = {t.name: i for i, t in enumerate(raw.tensors)}
    layers = []
    for layer in range(first, block_count):
        found = []
        for role in ROLES:
            name = routed_name(layer, role)
            if name not in index:
                raise ForgeError(f"{raw.path}: layer {layer} has no {name}")
            found.append(index[name])
        tensors = tuple(raw.tensors[i] for i in found)
        _check_routed(raw, layer, tensors, experts)  # type: ignore[arg-type]
        layers.append(RoutedLayer(layer, tensors, tuple(found)))  # type: ignore[arg-type]
    routed = {i for rl in layers for i in rl.source_index}
    kept = tuple(t for i, t in enumerate(raw.tensors) if i not in routed)
    for t in kept:
        if is_routed_name(t.name):
            raise ForgeError(
                f"{raw.path}: routed tensor {t.name} lies outside the routed layers {first}..{block_count - 1}"
            )
    check_canonical_packing(raw)
    return SourcePlan(raw, arch, family, experts, used, tuple(layers), kept)


def _check_routed(
    raw: RawGGUF, layer: int, tensors: tuple[RawTensor, RawTensor, RawTensor], experts: int
) -> None:
    gate, up, down = tensors
    for role, t in zip(ROLES, tensors, strict=True):
        if len(t.dims) != 3 or t.dims[2] != experts:
            raise ForgeError(
                f"{raw.path}: layer {layer} {role}: dims {list(t.dims)} are not (ne0, ne1, {experts} experts)"
            )
    if up.dims != gate.dims or down.dims != (gate.dims[1], gate.dims[0], experts):
        raise ForgeError(
            f"{raw.path}: layer {layer}: gate {list(gate.dims)}, up {list(up.dims)}, down {list(down.dims)} "
            "are not an expert FFN (up = gate, down = gate transposed)"
        )


def check_canonical_packing(raw: RawGGUF) -> None:
    """Refuse a file the inverse conversion could not rebuild byte for byte.

    The inverse writes tensors back to back with ``general.alignment`` and zero padding (what
    llama.cpp and gguf-py write); a file with other offsets or non-zero padding is refused.
    """
    offsets = packed_offsets([t.nbytes for t in raw.tensors], raw.alignment)
    for t, want in zip(raw.tensors, offsets, strict=True):
        if t.offset != want:
            raise ForgeError(
                f"{raw.path}: tensor {t.name} at data offset {t.offset}, packed layout puts it at {want}; "
                "cannot guarantee a byte-identical inverse"
            )
    gaps = [(raw.dir_end, raw.data_start)]
    for t, nxt in zip(raw.tensors, offsets[1:] + [None], strict=True):
        end = raw.data_start + t.offset + t.nbytes
        gaps.append((end, raw.data_start + nxt if nxt is not None else raw.size))
    if not raw.tensors:
        gaps.append((raw.data_start, raw.size))
    for start, end in gaps:
        if end - start > 0 and any(raw.mm[start:end]):
            raise ForgeError(
                f"{raw.path}: non-zero padding at bytes {start}..{end}; cannot guarantee a byte-identical inverse"
            )
    if raw.tensors and raw.size - raw.data_end() >= raw.alignment:
        raise ForgeError(f"{raw.path}: {raw.size - raw.data_end():,} trailing bytes after the last tensor")


def sorted_rule_order(kept_names: list[str], routed: dict[int, list[str]]) -> list[str] | None:
    """The source directory order when routed tensors sat name-sorted inside their block.

    llama-quantize writes each ``blk.N.`` block sorted by name; this rebuilds such an order from
    the kept names alone: each routed name goes before the first kept name of its block that sorts
    after it, or after the block's last kept name. None if a block has no kept tensor.
    """
    placed: list[tuple[int, int, str]] = []
    for layer, names in routed.items():
        prefix = f"blk.{layer}."
        members = [i for i, n in enumerate(kept_names) if n.startswith(prefix)]
        if not members:
            return None
        for name in names:
            anchor = next((i for i in members if kept_names[i] > name), members[-1] + 1)
            # At a shared anchor, a block's tail goes before the next block's head.
            placed.append((anchor, 0 if anchor > members[-1] else 1, name))
    placed.sort()
    order, k = [], 0
    for anchor, _, name in placed:
        order.extend(kept_names[k:anchor])
        k = max(k, anchor)
        order.append(name)
    order.extend(kept_names[k:])
    return order


def source_order_is_derivable(plan: SourcePlan) -> bool:
    routed = {rl.layer: sorted(routed_name(rl.layer, r) for r in ROLES) for rl in plan.layers}
    return sorted_rule_order([t.name for t in plan.kept], routed) == [t.name for t in plan.raw.tensors]


def rebuild_order(
    kept_names: list[str], routed_index: dict[str, int | None], n_tensors: int, where: str
) -> list[str]:
    """Source directory order from the kept names and, per routed name, its recorded index or None."""
    explicit = {n: i for n, i in routed_index.items() if i is not None}
    if explicit and len(explicit) != len(routed_index):
        raise ForgeError(f"{where}: source positions recorded for some routed tensors but not all")
    if not explicit:
        routed: dict[int, list[str]] = {}
        for name in routed_index:
            routed.setdefault(int(name.split(".")[1]), []).append(name)
        order = sorted_rule_order(kept_names, {k: sorted(v) for k, v in routed.items()})
        if order is None:
            raise ForgeError(
                f"{where}: cannot derive the source tensor order (a routed block has no other tensor)"
            )
    else:
        slots: list[str | None] = [None] * n_tensors
        for name, i in explicit.items():
            if not 0 <= i < n_tensors or slots[i] is not None:
                raise ForgeError(f"{where}: recorded source position {i} of {name} is invalid or repeated")
            slots[i] = name
        rest = iter(kept_names)
        order = [s if s is not None else next(rest, "") for s in slots]
        if "" in order or next(rest, None) is not None:
            raise ForgeError(f"{where}: recorded source positions do not fit {n_tensors} tensors")
    if len(order) != n_tensors:
        raise ForgeError(f"{where}: source tensor count {n_tensors} does not match {len(order)} tensors")
    return order


def file_aligned_offset(data_start: int, pos: int, alignment: int, file_alignment: int) -> int:
    """Smallest data offset >= pos that is a multiple of ``alignment`` and puts the tensor on a
    ``file_alignment`` boundary of the file (the source alignment must divide it)."""
    if file_alignment % alignment:
        raise ForgeError(f"general.alignment {alignment} does not divide {file_alignment}")
    return align_up(data_start + pos, file_alignment) - data_start
