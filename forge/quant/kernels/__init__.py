"""Compiled (numba) encoder kernels: the numpy codecs' algorithms as ggml's C loops, same bytes.

A codec opts in with ``_encode_chunk = staticmethod(accelerated("module.function", numpy_encoder))``:
the kernel runs when numba is importable and ``FORGE_NO_NUMBA`` is unset (checked at every call, so
tests can switch paths), otherwise the numpy encoder, which stays the reference. Kernels compile on
first use and are cached on disk (numba ``cache=True``).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from functools import cache

import numpy as np

Encoder = Callable[[np.ndarray, "np.ndarray | None"], np.ndarray]


@cache
def numba_available() -> bool:
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


def enabled() -> bool:
    """Kernels are used: numba importable and FORGE_NO_NUMBA unset (or empty/0)."""
    return os.environ.get("FORGE_NO_NUMBA", "") in ("", "0") and numba_available()


@cache
def kernel(name: str) -> Encoder:
    """The kernel entry point ``"module.function"`` of this package (imported on first use)."""
    module, func = name.rsplit(".", 1)
    return getattr(importlib.import_module(f"{__name__}.{module}"), func)


def accelerated(name: str, fallback: Encoder) -> Encoder:
    """An encoder running kernel ``name`` when kernels are enabled, else ``fallback``."""

    def encode(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
        if enabled():
            return kernel(name)(rows, importance)
        return fallback(rows, importance)

    encode.__name__ = getattr(fallback, "__name__", name)
    encode.__doc__ = f"{name} kernel when numba is enabled, else {encode.__name__}"
    encode.fallback = fallback  # type: ignore[attr-defined]
    return encode
