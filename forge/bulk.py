"""Whole-array passes of the converter and quantizer spread over the cores: widening bf16 values to float32,
rounding float32 to bf16 and checking that weights are finite. With numpy alone each is one single-threaded
pass over the tensor, which on many cores left the encoders waiting: on 2 cores they were half of a q4_k_m
quantize. Compiled kernels without the GIL run on a pool of Python threads, as the encoders do
(``map_row_chunks``): numba's own parallel layer must not run in a process that later forks the ``--jobs``
workers."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from gguf import GGMLQuantizationType, quants
from numba import njit

from forge.errors import ForgeError
from forge.jit import enabled

_CHUNK = 1 << 18  # elements a thread takes at a time, at least
_SMALL = 1 << 20  # below this many elements numpy's one pass is cheaper than waking the threads


@njit(nogil=True, cache=True)
def _widen_bf16(bits: np.ndarray, out: np.ndarray, start: int, stop: int) -> int:
    for i in range(start, stop):
        out[i] = np.uint32(bits[i]) << 16
    return 0


@njit(nogil=True, cache=True)
def _round_bf16(bits: np.ndarray, out: np.ndarray, start: int, stop: int) -> int:
    for i in range(start, stop):
        u = np.int64(bits[i])
        if (u & 0x7FFFFFFF) > 0x7F800000:  # NaN: kept NaN, quiet bit set
            out[i] = np.uint16((u >> 16) | 64)
        else:  # nearest even; no NaN comes near 2**32
            out[i] = np.uint16((u + 0x7FFF + ((u >> 16) & 1)) >> 16)
    return 0


@njit(nogil=True, cache=True)
def _count_nonfinite(x: np.ndarray, start: int, stop: int) -> int:
    bad = 0
    for i in range(start, stop):
        bad += not np.isfinite(x[i])
    return bad


def encoder_threads() -> int:
    """Encoder threads: ``FORGE_THREADS``, else every core this process may run on."""
    env = os.environ.get("FORGE_THREADS", "").strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ForgeError(f"FORGE_THREADS must be a positive whole number, not {env!r}")
        return int(env)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity API (macOS)
        return max(1, os.cpu_count() or 1)


_POOL: tuple[int, int, ThreadPoolExecutor] | None = None  # (process id, threads, pool)


def thread_pool() -> ThreadPoolExecutor:
    """The encoders' threads: one pool of ``encoder_threads()`` per process (a ``--jobs`` worker, forked,
    makes its own), shared by every pass (a per-expert source or imatrix calls them hundreds of times per
    layer; a pool per call started its threads each time). Tasks must not wait on other tasks of the pool."""
    global _POOL
    threads = encoder_threads()
    if _POOL is None or _POOL[:2] != (os.getpid(), threads):
        _POOL = (os.getpid(), threads, ThreadPoolExecutor(threads, thread_name_prefix="forge-encode"))
    return _POOL[2]


def _chunked(kernel, *arrays: np.ndarray) -> int:  # noqa: ANN001
    """The sum of ``kernel(*arrays, start, stop)`` over chunks of the first (flat) array's indices, on the
    encoders' thread count (``FORGE_THREADS``, else every core)."""
    n = arrays[0].shape[0]
    step = max(_CHUNK, -(-n // (4 * encoder_threads())))
    return sum(thread_pool().map(lambda s: kernel(*arrays, s, min(n, s + step)), range(0, n, step)))


def bf16_to_f32(bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """bf16 values stored as uint16 bits -> float32, same shape (exact: the bits shifted into place), into
    ``out`` (a C-contiguous float32 array of that shape) if given."""
    if out is None:
        out = np.empty(bits.shape, np.float32)
    wide = out.view(np.uint32)
    if not enabled() or bits.size < _SMALL:
        np.left_shift(bits, 16, out=wide, dtype=np.uint32)
    else:
        _chunked(_widen_bf16, np.ascontiguousarray(bits).reshape(-1), wide.reshape(-1))
    return out


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16, same shape) as ggml's ``ggml_compute_fp32_to_bf16`` rounds: to nearest
    even, a NaN kept NaN with the quiet bit set (gguf's numpy encoder took 4.2 s for 100 M values)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    u = values.view(np.uint32)
    if enabled() and values.size >= _SMALL:
        out = np.empty(values.shape, np.uint16)
        _chunked(_round_bf16, u.reshape(-1), out.reshape(-1))
        return out
    lsb = u >> np.uint32(16)
    lsb &= np.uint32(1)
    lsb += np.uint32(0x7FFF)
    lsb += u  # wraps modulo 2**32 like the C code; only NaNs come near the top
    bits = (lsb >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        bits[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(64)).astype(np.uint16)
    return bits


def float32_values(data: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """The float32 values of ``data``, stored values of ``ggml_type`` (its bytes as uint8, or BF16 bits as
    uint16), flat: BF16 widened on every core (gguf's numpy decoder took 4.3 s for a 400 MB tensor,
    ``bf16_to_f32`` 0.16 s on 2 cores), F16 and F32 converted, other types decoded by gguf. An F32 result may
    be a view of ``data``."""
    flat = np.ascontiguousarray(data).reshape(-1)
    if ggml_type == GGMLQuantizationType.BF16:
        return bf16_to_f32(flat.view(np.uint16))
    if ggml_type == GGMLQuantizationType.F16:
        return flat.view(np.float16).astype(np.float32)
    if ggml_type == GGMLQuantizationType.F32:
        return flat.view(np.float32)
    return quants.dequantize(flat, ggml_type).reshape(-1).astype(np.float32, copy=False)


#: the error of a source tensor holding NaN or infinity (whichever pass finds it)
NON_FINITE = "non-finite values (NaN or inf) in the source weights"


def all_finite(x: np.ndarray) -> bool:
    """No NaN or infinity in the float32 array ``x``."""
    if not enabled() or x.size < _SMALL or x.dtype != np.float32:
        return bool(np.isfinite(x).all())
    return _chunked(_count_nonfinite, np.ascontiguousarray(x).reshape(-1)) == 0
