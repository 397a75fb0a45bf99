"""Backends: one op set per kind of device (today: ``routed_ffn``, the routed-expert layer over the
router's (expert ids, weights), reading an ``runtime.moe.ExpertSource``).

- ``torch_backend``: the reference, and the path for MPS and anything else;
- ``cpu_backend``: the compiled (numba) kernels (one-token steps);
- ``cuda_backend``: Triton kernels on the GGUF blocks (``cuda_kernels``).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any


def for_experts(weights: Any, source: Any, taps: Any) -> ModuleType:
    """The backend that computes a layer's routed experts: the torch reference under ggml numerics (its
    input roundings) or a SwiGLU clamp, the cuda kernels when the source's bytes are on a GPU in types they decode, the
    compiled CPU kernels when the source hands out records they read; else torch."""
    from runtime.backends import cpu_backend, cuda_backend, torch_backend

    if taps.rounds or weights.ggml_numerics or source.swiglu_limit is not None:
        return torch_backend
    if source.device_parts() is not None:
        return cuda_backend
    if weights.cpu_kernels and source.has_records():
        return cpu_backend
    return torch_backend
