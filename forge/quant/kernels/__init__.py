"""Compiled (numba) encoder kernels: the numpy codecs' algorithms as ggml's C loops, same bytes.

A codec opts in with ``_encode_chunk = staticmethod(accelerated("module.function", numpy_encoder))``:
the kernel runs unless ``FORGE_NO_NUMBA`` is set (``forge.jit.enabled``, checked at every call, so tests
can switch paths); the numpy encoder stays the reference. Kernels compile on
first use and are cached on disk (numba ``cache=True``, in this package's ``__pycache__``).

Caveat when editing: numba invalidates a cached kernel only when its own source file changes, not
when a jitted helper it calls from another module does (``forge.jit``, ``kquants.make_qp``, ...). After
editing a helper module, delete ``forge/quant/kernels/__pycache__`` (and ``runtime/__pycache__``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import cache

import numpy as np

from forge.jit import enabled

Encoder = Callable[[np.ndarray, "np.ndarray | None"], np.ndarray]


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
    encode.kernel_name = name  # type: ignore[attr-defined]
    return encode


def kernel_table() -> dict[str, str]:
    """Every kernel entry point, by the quant type whose codec runs it (the type table's ``compiled``)."""
    from forge import ggml_types

    return {t.name: ggml_types.implementation("compiled", t) for t in ggml_types.types_with("compiled")}


def warm_up(type_names: list[str] | None = None) -> list[str]:
    """Compile (or load from numba's disk cache) the kernels of these quant types, all by default,
    with and without importance weights; returns the types warmed. Call it once in a parent process
    before starting encoder workers, so that they do not all compile the same kernels at once."""
    if not enabled():
        return []
    from forge.quant.types import get_type

    table = kernel_table()
    names = [n.upper() for n in (type_names or table)]
    x = np.linspace(-1, 1, 512, dtype=np.float32).reshape(2, 256)
    w = np.ones(256, np.float32)
    done = []
    for name in names:
        if name in table:
            for imp in (None, w) if not get_type(name).requires_importance else (w,):
                kernel(table[name])(x, imp)
            done.append(name)
    return done
