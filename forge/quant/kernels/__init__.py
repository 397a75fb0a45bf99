"""Compiled (numba) encoder kernels: the numpy codecs' algorithms as ggml's C loops, same bytes.

A codec opts in with ``_encode_chunk = staticmethod(accelerated("module.function", numpy_encoder))``:
the kernel runs when numba is importable and ``FORGE_NO_NUMBA`` is unset (checked at every call, so
tests can switch paths), otherwise the numpy encoder, which stays the reference. Kernels compile on
first use and are cached on disk (numba ``cache=True``, in this package's ``__pycache__``).

Caveat when editing: numba invalidates a cached kernel only when its own source file changes, not
when a jitted helper it calls from another module does (``_core``, ``kquants.make_qp``, ...). After
editing a helper module, delete ``forge/quant/kernels/__pycache__``.
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


#: Every kernel entry point, by the quant type it encodes.
KERNELS = {
    "Q8_0": "q8.q8_0",
    "Q4_0": "legacy.q4_0",
    "Q4_1": "legacy.q4_1",
    "Q5_0": "legacy.q5_0",
    "Q5_1": "legacy.q5_1",
    "Q2_K": "kquants.q2_k",
    "Q3_K": "kquants.q3_k",
    "Q4_K": "kquants.q4_k",
    "Q5_K": "kquants.q5_k",
    "Q6_K": "kquants.q6_k",
    "IQ2_XXS": "iq2.iq2_xxs",
    "IQ2_XS": "iq2.iq2_xs",
    "IQ2_S": "iq2.iq2_s",
    "IQ3_XXS": "iq3.iq3_xxs",
    "IQ3_S": "iq3.iq3_s",
    "IQ4_NL": "iq4.iq4_nl",
    "IQ4_XS": "iq4.iq4_xs",
    "IQ1_S": "iq1.iq1_s",
    "IQ1_M": "iq1.iq1_m",
}


def warm_up(type_names: list[str] | None = None) -> list[str]:
    """Compile (or load from numba's disk cache) the kernels of these quant types, all by default,
    with and without importance weights; returns the types warmed. Call it once in a parent process
    before starting encoder workers, so that they do not all compile the same kernels at once."""
    if not enabled():
        return []
    names = [n.upper() for n in (type_names or KERNELS)]
    x = np.linspace(-1, 1, 512, dtype=np.float32).reshape(2, 256)
    w = np.ones(256, np.float32)
    done = []
    for name in names:
        if name in KERNELS:
            for imp in (None, w):
                if imp is None and name in ("IQ2_XXS", "IQ2_XS", "IQ1_S"):
                    continue  # these encoders always take importance weights
                kernel(KERNELS[name])(x, imp)
            done.append(name)
    return done
