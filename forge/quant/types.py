"""The quant-type registry: every GGUF tensor type we can encode and/or decode.

A type is a subclass of :class:`QuantType` carrying its geometry as class attributes; defining the
subclass registers it in the one type table, ``forge.ggml_types`` (kind ``numpy``, and ``compiled`` when
its encoder has a numba kernel). The quantizer uses ``encode`` and ``decode`` (numpy, the reference); the
runtime does not import this package: it registers its torch dequantizers and compiled row kernels in
the same table, and the tests hold every registered decoder to ``decode``.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from forge import ggml_types
from forge.errors import ForgeError


class QuantType:
    """One GGUF tensor type. Rows are the fastest GGUF dimension (ne[0]); blocks run along rows."""

    ggml_type: ClassVar[GGMLQuantizationType]
    block_size: ClassVar[int]
    type_size: ClassVar[int]
    #: Bump when the encoder's output bytes change for the same input (it is part of reuse keys).
    version: ClassVar[int] = 1
    #: The encoder reads importance weights when given them.
    uses_imatrix: ClassVar[bool] = False
    #: llama.cpp refuses to produce this type without importance weights.
    needs_imatrix: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "ggml_type" in cls.__dict__:
            cls.block_size, cls.type_size = GGML_QUANT_SIZES[cls.ggml_type]
            ggml_types.provide("numpy", cls.ggml_type, cls)
            kernel_name = getattr(getattr(cls, "_encode_chunk", None), "kernel_name", None)
            if kernel_name is not None:
                ggml_types.provide("compiled", cls.ggml_type, kernel_name)

    @classmethod
    def name(cls) -> str:
        return cls.ggml_type.name

    @classmethod
    def row_bytes(cls, n_per_row: int) -> int:
        return n_per_row // cls.block_size * cls.type_size

    @classmethod
    def encode(
        cls, rows: np.ndarray, importance: np.ndarray | None = None, out: np.ndarray | None = None
    ) -> np.ndarray:
        """float32 (n_rows, n_per_row) -> uint8 (n_rows, row_bytes), written into ``out`` when given (a
        C-contiguous array of that shape). ``importance``: (n_per_row,)."""
        raise ForgeError(f"encoding to {cls.name()} is not supported")

    @classmethod
    def decode(cls, data: np.ndarray, n_per_row: int) -> np.ndarray:
        """uint8 (..., row_bytes) -> float32 (..., n_per_row)."""
        raise ForgeError(f"decoding {cls.name()} is not supported")


def get_type(key: str | int | GGMLQuantizationType) -> type[QuantType]:
    """Look a type up by name (case-insensitive) or ggml type id."""
    try:
        gtype = GGMLQuantizationType[key.upper()] if isinstance(key, str) else GGMLQuantizationType(key)
    except (KeyError, ValueError):
        raise ForgeError(f"unknown tensor type {key!r}; known: {', '.join(known_type_names())}") from None
    qt = ggml_types.implementation("numpy", gtype)
    if qt is None:
        raise ForgeError(f"tensor type {gtype.name} is not supported; known: {', '.join(known_type_names())}")
    return qt


def known_type_names() -> list[str]:
    return [t.name for t in ggml_types.types_with("numpy")]


KERNEL_CHUNK_ELEMS = 1 << 16


class BlockCodec(QuantType):
    """Most codecs: validate rows, encode them in chunks of whole rows (on a small thread pool),
    decode through the ``gguf`` package. A subclass only provides ``_encode_chunk``."""

    #: (rows float32 (r, n_per_row), importance (n_per_row,) | None) -> uint8 (r, row_bytes)
    _encode_chunk: ClassVar = None
    #: the encoder itself cannot run without importance weights
    requires_importance: ClassVar[bool] = False
    chunk_elems: ClassVar[int] = 1 << 16

    @classmethod
    def encode(
        cls, rows: np.ndarray, importance: np.ndarray | None = None, out: np.ndarray | None = None
    ) -> np.ndarray:
        """Also takes bf16 values as their bits (uint16 rows, widened a chunk at a time) and one importance
        vector per group of consecutive rows (n_groups, n_per_row), a 3-D tensor's matrices."""
        from forge.jit import enabled
        from forge.quant.numerics import check_input, map_row_chunks

        rows, importance = check_input(cls.name(), rows, cls.block_size, importance)
        if not cls.uses_imatrix:
            importance = None
        elif importance is None and cls.requires_importance:
            raise ForgeError(f"{cls.name()} needs importance weights (an imatrix); none were given")
        fn = cls._encode_chunk
        per_group = None if importance is None else importance.reshape(-1, rows.shape[1])
        if enabled():  # compiled kernels loop: small chunks let the threads share even a small tensor
            chunk, most = min(cls.chunk_elems, KERNEL_CHUNK_ELEMS), None
        else:  # numpy codecs vectorize over a chunk's blocks: big chunks, as big as their memory allows
            chunk = most = cls.chunk_elems
        return map_row_chunks(
            rows,
            cls.row_bytes(rows.shape[1]),
            lambda c, g: fn(c, None if per_group is None else per_group[g]),
            chunk,
            out,
            1 if per_group is None else len(per_group),
            most,
        )

    @classmethod
    def decode(cls, data: np.ndarray, n_per_row: int) -> np.ndarray:
        from gguf.quants import dequantize

        data = np.asarray(data, dtype=np.uint8)
        if n_per_row % cls.block_size or data.shape[-1] != cls.row_bytes(n_per_row):
            raise ForgeError(f"{cls.name()}: rows of {data.shape[-1]} bytes do not hold {n_per_row} values")
        return (
            dequantize(data, cls.ggml_type)
            .astype(np.float32, copy=False)
            .reshape(*data.shape[:-1], n_per_row)
        )
