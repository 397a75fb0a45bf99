"""Encoders on any torch device (CUDA in practice) giving the same bytes as the numpy codecs.

``encode_on_device("q4_k", rows, importance, "cuda")`` quantizes float32 rows (n_rows, n_per_row)
on the device in chunks of whole rows and returns uint8 (n_rows, row_bytes), byte for byte what
``get_type("q4_k").encode(rows, importance)`` returns. ``importance`` may also hold one vector per
group of consecutive rows (n_mat, n_per_row), a 3-D tensor's experts, each encoded with its own
vector as the CPU encodes them one matrix at a time, in one device pass. Types without a torch encoder are refused
(``supported_on_device`` says which ones have one); the caller falls back to the CPU path. An encoder
registers itself in the type table (``forge.ggml_types``, kind ``gpu_encode``) with ``@device_encoder``;
``encoders.py`` imports them all.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType

from forge import ggml_types
from forge.bulk import NON_FINITE
from forge.errors import ForgeError

#: Elements of source weights encoded per device step at most (bigger steps amortize the kernel
#: launches: on an H200, IQ2_XXS runs 1.6x faster with 2**25 than with 2**22).
CHUNK_ELEMS = {"cuda": 1 << 25, "cpu": 1 << 18}


def device_encoder(qtype: GGMLQuantizationType, bytes_per_elem: int) -> Callable[[Callable], Callable]:
    """Register the decorated torch encoder of ``qtype``. ``bytes_per_elem``: its peak device bytes per
    element of a step, with headroom (a CUDA step is cut so that it fits in half the free memory)."""

    def register(encode: Callable) -> Callable:
        encode.bytes_per_elem = bytes_per_elem  # type: ignore[attr-defined]
        ggml_types.provide("gpu_encode", qtype, encode)
        return encode

    return register


def supported_on_device(qtype: str) -> bool:
    """Whether ``qtype`` (a ggml type name, any case) has a torch encoder."""
    return ggml_types.supports("gpu_encode", ggml_types.ggml_type(qtype))


def check_device(device: str) -> None:
    """ForgeError unless ``device`` is ``cpu`` or a torch device this machine has."""
    if device != "cpu":
        _device(device)


def _device(device: str):  # noqa: ANN202
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ForgeError(f"unknown torch device {device!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ForgeError(f"device {device!r} asked for, but torch sees no CUDA device")
    return dev


def _default_chunk(encode: Callable, dev) -> int:  # noqa: ANN001
    import torch

    chunk = CHUNK_ELEMS.get(dev.type, CHUNK_ELEMS["cuda"])
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        chunk = min(chunk, max(1 << 16, free // 2 // encode.bytes_per_elem))
    return chunk


def encode_on_device(
    qtype: str,
    rows: np.ndarray,
    importance: np.ndarray | None,
    device: str,
    chunk_elems: int | None = None,
) -> np.ndarray:
    """float32 rows (n_rows, n_per_row) -> uint8 (n_rows, row_bytes), encoded on ``device``. bf16 rows may
    come as their bits (uint16): they are copied as such and widened on the device (half the bytes to copy,
    no float32 pass on the host).

    Validation and importance handling are those of the CPU codec (``QuantType.encode``), except that the
    values are checked for NaN and infinity on the device, as they arrive there.
    """
    import torch

    from forge.quant.numerics import check_input
    from forge.quant.types import get_type

    qt = get_type(qtype)
    name = qt.name()
    encode = ggml_types.implementation("gpu_encode", qt.ggml_type)
    if encode is None:
        have = ", ".join(t.name for t in ggml_types.types_with("gpu_encode"))
        raise ForgeError(f"{name} has no device encoder; device encoders exist for {have}")
    dev = _device(device)
    bits = rows.dtype == np.uint16
    # shape and importance checked here, the values on the device
    rows, importance = check_input(name, rows, qt.block_size, importance, finite=False)
    per_matrix = importance is not None and importance.ndim == 2
    if bits:
        rows = rows.view(np.int16)
    if importance is None and getattr(qt, "requires_importance", False):
        raise ForgeError(f"{name} needs importance weights (an imatrix); none were given")
    n_rows, n_per_row = rows.shape
    out = np.empty((n_rows, qt.row_bytes(n_per_row)), np.uint8)
    if n_rows == 0 or n_per_row == 0:
        return out
    if chunk_elems is None:
        chunk_elems = _default_chunk(encode, dev)
    step = max(1, chunk_elems // n_per_row)
    imp = None if importance is None else torch.from_numpy(importance).to(dev)
    group_rows = n_rows // len(importance) if per_matrix else 0
    with torch.inference_mode():
        _encode_chunks(encode, rows, out, step, dev, imp, group_rows, bits)
    return out


class _Staging(threading.local):
    """Per thread, two pinned host buffers for chunks going in and two for their codes coming out, kept
    between calls (pinning 0.4 GB costs about 0.2 s) and grown as needed."""

    def __init__(self) -> None:
        self.buffers: list = [None] * 4

    def get(self, i: int, nbytes: int):  # noqa: ANN201
        import torch

        buf = self.buffers[i]
        if buf is None or buf.numel() < nbytes:
            buf = self.buffers[i] = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        return buf[:nbytes]


_STAGING = _Staging()


def _encode_chunks(encode, rows, out, step, dev, imp, group_rows, bits) -> None:  # noqa: ANN001
    """Encode ``rows`` into ``out`` in chunks of ``step`` rows. On CUDA the chunks pass through pinned
    buffers, asynchronously, two at a time: chunk k's rows are copied in while the device encodes chunk k-1,
    whose codes are copied out once its event says they are there. Copying pageable memory synchronously,
    chunk by chunk, had taken twice the kernels' time (Q4_K on an H200)."""
    import torch

    cuda = dev.type == "cuda"
    pending: deque = deque()  # (event, first row, codes) of the chunks in flight, oldest first

    def drain() -> None:
        done, s, codes = pending.popleft()
        if done is not None:
            done.synchronize()
        out[s : s + len(codes)] = codes.numpy()

    for k, s in enumerate(range(0, rows.shape[0], step)):
        if len(pending) == 2:  # the oldest chunk's buffers (this slot's) are free once its codes are out
            drain()
        host = rows[s : s + step]
        chunk = torch.from_numpy(host)
        if cuda:
            staged = _STAGING.get(k % 2, host.nbytes).view(chunk.dtype).view(chunk.shape)
            staged.copy_(chunk)
            chunk = staged.to(dev, non_blocking=True)
        if bits:
            chunk = (chunk.to(torch.int32) << 16).view(torch.float32)
        if not bool(torch.isfinite(chunk).all()):  # before encoding: no garbage indices on the device
            raise ForgeError(NON_FINITE)
        w = imp
        if group_rows:  # each row's own group's vector
            w = imp.index_select(0, torch.arange(s, s + chunk.shape[0], device=dev) // group_rows)
        codes, done = encode(chunk, w), None
        if cuda:
            host_codes = _STAGING.get(2 + k % 2, codes.numel()).view(codes.shape)
            host_codes.copy_(codes, non_blocking=True)
            codes, done = host_codes, torch.cuda.Event()
            done.record()
        pending.append((done, s, codes))
    while pending:
        drain()


__all__ = ["CHUNK_ELEMS", "check_device", "device_encoder", "encode_on_device", "supported_on_device"]
