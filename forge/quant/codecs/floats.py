"""Plain float types F32, F16 and BF16 (conversions as ggml performs them)."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from forge.bulk import f32_to_bf16
from forge.errors import ForgeError
from forge.quant import numerics as nx
from forge.quant.types import QuantType


def _into(data: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    if out is None:
        return data
    out[...] = data
    return out


class _Float(QuantType):
    @classmethod
    def _rows(cls, rows: np.ndarray) -> np.ndarray:
        return nx.check_rows(cls.name(), rows, 1, finite=False)[0]

    @classmethod
    def decode(cls, data: np.ndarray, n_per_row: int) -> np.ndarray:
        data = np.ascontiguousarray(data, dtype=np.uint8)
        if data.shape[-1] != cls.row_bytes(n_per_row):
            raise ForgeError(f"{cls.name()}: rows of {data.shape[-1]} bytes do not hold {n_per_row} values")
        return cls._decode(data).reshape(*data.shape[:-1], n_per_row)


class F32(_Float):
    ggml_type = T.F32

    @classmethod
    def encode(
        cls, rows: np.ndarray, importance: np.ndarray | None = None, out: np.ndarray | None = None
    ) -> np.ndarray:
        rows = cls._rows(rows)
        return _into(rows.view(np.uint8).reshape(rows.shape[0], -1), out)

    @staticmethod
    def _decode(data: np.ndarray) -> np.ndarray:
        return data.view(np.float32).copy()


class F16(_Float):
    ggml_type = T.F16

    @classmethod
    def encode(
        cls, rows: np.ndarray, importance: np.ndarray | None = None, out: np.ndarray | None = None
    ) -> np.ndarray:
        rows = cls._rows(rows)
        with np.errstate(over="ignore"):
            return _into(rows.astype(np.float16).view(np.uint8).reshape(rows.shape[0], -1), out)

    @staticmethod
    def _decode(data: np.ndarray) -> np.ndarray:
        return data.view(np.float16).astype(np.float32)


class BF16(_Float):
    ggml_type = T.BF16

    @classmethod
    def encode(
        cls, rows: np.ndarray, importance: np.ndarray | None = None, out: np.ndarray | None = None
    ) -> np.ndarray:
        rows = cls._rows(rows)
        return _into(f32_to_bf16(rows).view(np.uint8).reshape(rows.shape[0], -1), out)

    @staticmethod
    def _decode(data: np.ndarray) -> np.ndarray:
        return (data.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
