"""The GGUF tensor types: one table that every part asks (geometry, and who implements what).

A type's geometry (values per block, bytes per block) is ggml's (``gguf.GGML_QUANT_SIZES``). What gguf-forge
can do with it is registered beside the implementation, by ``provide(kind, qtype, impl)`` or the
``@provides(kind, *qtypes)`` decorator, one kind per implementing module:

=========== ========================================= =======================================================
kind        registered in                             implementation
=========== ========================================= =======================================================
numpy       ``forge.quant`` (``codecs/*``)            the ``QuantType`` (reference encode/decode, numpy)
compiled    ``forge.quant`` (``codecs/*``)            the numba encoder kernel's name (``forge.quant.kernels``)
gpu_encode  ``forge.quant.torch_codecs``              the torch encoder (``@device_encoder``)
torch       ``runtime.dequant`` (``dequant_*.py``)    a block decoder; for float types the torch dtype
cpu_rows    ``runtime.cpu_rows``                      the type id ``decode_row``/``dot_row`` take (numba)
cuda        ``runtime.backends.cuda_kernels``         the Triton kernels' value group (values per scale)
=========== ========================================= =======================================================

The first question about a kind imports the module that registers it (``KINDS``), so an answer never
depends on what happens to be imported. This module is a leaf (gguf only): the runtime imports it, and
through it never imports the quantizer's encoders unless it asks about an encoder kind.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, TypeVar

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from forge.errors import ForgeError

T = GGMLQuantizationType
F = TypeVar("F")

#: kind -> the module whose import registers every implementation of that kind
KINDS = {
    "numpy": "forge.quant",
    "compiled": "forge.quant",
    "gpu_encode": "forge.quant.torch_codecs.encoders",
    "torch": "runtime.dequant",
    "cpu_rows": "runtime.cpu_rows",
    "cuda": "runtime.backends.cuda_kernels",
}
_IMPLS: dict[str, dict[GGMLQuantizationType, Any]] = {kind: {} for kind in KINDS}
_loaded: set[str] = set()


def ggml_type(key: str | int | GGMLQuantizationType) -> GGMLQuantizationType:
    """A GGUF tensor type by name (any case) or id; ForgeError for one ggml does not define."""
    try:
        return GGMLQuantizationType[key.upper()] if isinstance(key, str) else GGMLQuantizationType(key)
    except (KeyError, ValueError):
        raise ForgeError(f"unknown GGUF tensor type {key!r}") from None


def geometry(qtype: GGMLQuantizationType | int) -> tuple[int, int]:
    """(values per block, bytes per block)."""
    return GGML_QUANT_SIZES[ggml_type(qtype)]


def bits_per_weight(qtype: GGMLQuantizationType | int) -> float:
    block_size, type_size = geometry(qtype)
    return 8 * type_size / block_size


def provide(kind: str, qtype: GGMLQuantizationType, impl: Any) -> None:
    """Register ``impl`` as the ``kind`` implementation of ``qtype`` (called by the implementing module)."""
    if kind not in KINDS:
        raise ValueError(f"unknown capability kind {kind!r}; known: {', '.join(KINDS)}")
    _IMPLS[kind][GGMLQuantizationType(qtype)] = impl


def provides(kind: str, *qtypes: GGMLQuantizationType) -> Callable[[F], F]:
    """Decorator form of :func:`provide`: the decorated object implements ``kind`` for ``qtypes``."""

    def register(impl: F) -> F:
        for qtype in qtypes:
            provide(kind, qtype, impl)
        return impl

    return register


def _impls(kind: str) -> dict[GGMLQuantizationType, Any]:
    if kind not in KINDS:
        raise ValueError(f"unknown capability kind {kind!r}; known: {', '.join(KINDS)}")
    if kind not in _loaded:
        importlib.import_module(KINDS[kind])
        _loaded.add(kind)
    return _IMPLS[kind]


def implementation(kind: str, qtype: GGMLQuantizationType | int) -> Any | None:
    """The registered ``kind`` implementation of ``qtype``, or None."""
    try:
        return _impls(kind).get(GGMLQuantizationType(qtype))
    except ValueError:
        return None


def supports(kind: str, qtype: GGMLQuantizationType | int) -> bool:
    return implementation(kind, qtype) is not None


def types_with(kind: str) -> list[GGMLQuantizationType]:
    """Every type with a ``kind`` implementation, by type id."""
    return sorted(_impls(kind), key=int)


#: the listing's columns: (heading, kind) for encoding, then decoding
ENCODE_KINDS = (("numpy", "numpy"), ("compiled", "compiled"), ("gpu", "gpu_encode"))
DECODE_KINDS = (("numpy", "numpy"), ("torch", "torch"), ("cpu rows", "cpu_rows"), ("cuda", "cuda"))


def table() -> list[dict[str, Any]]:
    """One record per type something is registered for: name, id, geometry, bits per weight, and the
    encoders and decoders that exist for it (``forge types``)."""
    kinds = {kind for _, kind in (*ENCODE_KINDS, *DECODE_KINDS)}
    known = sorted({t for kind in kinds for t in _impls(kind)}, key=int)
    rows = []
    for qtype in known:
        block_size, type_size = geometry(qtype)
        rows.append({
            "type": qtype.name,
            "id": int(qtype),
            "block_size": block_size,
            "type_size": type_size,
            "bits_per_weight": bits_per_weight(qtype),
            "encode": [head for head, kind in ENCODE_KINDS if supports(kind, qtype)],
            "decode": [head for head, kind in DECODE_KINDS if supports(kind, qtype)],
        })  # fmt: skip
    return rows
