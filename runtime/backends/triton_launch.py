"""Launching a Triton kernel for less host time than ``kernel[grid](...)``.

A prefill is bound by the host: on the H200 machine a 512-token prefill of the 35B-A3B file queues 53 ms of
kernels in ~56-73 ms. Triton's JIT entry costs 47.5 us a launch of the 32-argument GEMM (23.5 us for a
7-argument one) where its compiled kernel's launcher alone costs 11.2 (8.6): the rest is the entry's option
handling, a string cache key built from the specialization, launch metadata and hooks (``.whl`` host
profile, session 15). ``launch`` keeps Triton's own binder (so the kernel is specialized exactly as Triton
would: argument types, 16-byte alignment, integers equal to 1 or divisible by 16) and its compiler, and
skips the rest: the compiled kernel is looked up by the binder's specialization and constexprs and started
through its launcher. A kernel's first launch on a device and each specialization's first, the interpreter,
launch hooks (Triton's profilers), Tritons without the structures used here and FORGE_TRITON_DIRECT=0 (read
at import) take ``kernel[grid](...)``.
"""

from __future__ import annotations

import os
from typing import Any

try:
    from triton import knobs
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction
except ImportError:  # pragma: no cover - machines without triton, or a Triton without knobs
    knobs = driver = JITFunction = None

DIRECT = os.environ.get("FORGE_TRITON_DIRECT") != "0"
#: (kernel, device, specialization, constexprs and options) -> the compiled kernel
_compiled: dict[tuple, Any] = {}


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    """``kernel[grid](*args, **meta)``: the same compiled kernel, launched on the current stream."""
    if (
        not DIRECT
        or JITFunction is None
        or not isinstance(kernel, JITFunction)
        or _hooked(knobs.runtime.launch_enter_hook)
        or _hooked(knobs.runtime.launch_exit_hook)
    ):
        kernel[grid](*args, **meta)
        return
    device = driver.active.get_current_device()
    caches = kernel.device_caches.get(device)
    if caches is None:  # the binder is made by the kernel's first launch on a device
        kernel[grid](*args, **meta)
        return
    bound, specialization, _ = caches[4](*args, **meta)
    key = (kernel, device, tuple(specialization), tuple(meta.items()))
    try:
        compiled = _compiled.get(key)
    except TypeError:  # an unhashable specialization value: Triton's own path
        kernel[grid](*args, **meta)
        return
    if compiled is None:  # Triton's entry compiles it (or finds it in its caches); remembered for the next
        compiled = kernel[grid](*args, **meta)
        if hasattr(compiled, "result"):  # compiled asynchronously
            compiled = compiled.result()
        if hasattr(compiled, "packed_metadata"):
            _compiled[key] = compiled
        return
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    compiled.run(
        grid[0], g1, g2, driver.active.get_current_stream(device), compiled.function,
        compiled.packed_metadata, None, None, None, *bound.values(),
    )  # fmt: skip


def _hooked(hook: Any) -> bool:
    """A launch hook is set: a function, or a HookChain (Triton >= 3.4: always there) holding one."""
    return hook is not None and bool(getattr(hook, "calls", True))


def compiled_count() -> int:
    """How many compiled kernels ``launch`` has remembered (one per kernel specialization first seen)."""
    return len(_compiled)


def clear() -> None:
    """Forget the compiled kernels (tests)."""
    _compiled.clear()


__all__ = ["clear", "compiled_count", "launch"]
