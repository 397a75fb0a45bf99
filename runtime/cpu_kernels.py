"""Compiled (numba) one-token kernels for the CPU decode path: one call per block and token (attention,
Gated DeltaNet, shared expert, routed experts (routed outside, by ``runtime.moe.Router``), matrix-vector products with RMSNorm
folded in) over weights kept as their file rows (``Rows``: dot products from the bytes, ``runtime.cpu_rows``)
or float32 rows; plus the routed experts of a batch (prefill) over encoded rows, grouped by expert
(``routed_ffn_batch``), and a batch's product with encoded rows decoded a chunk at a time (``product``).

For one input row, torch's CPU matmul runs these shapes on one core well below memory speed (a 256 x 512
product took 56 us inside the model, i.e. 9 GB/s); these kernels read each weight row once as a
vectorized dot product, spread over the threads for the larger matrices (28 GB/s here on 2 cores).
Dot products may be reassociated (vectorized) by the compiler: results differ from torch's matmul in
the last bits only (the decode tests hold the step path to the batch path at 1e-4 of the logit scale).
Used when the device is the CPU and numba is enabled (``FORGE_NO_NUMBA`` unset), see ``available``.
Compiled once per install into numba's disk cache (``warm_up``); a change to ``runtime/cpu_rows.py`` alone
does not invalidate the kernels here that call it: delete ``runtime/__pycache__/*.nbi`` after editing it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import numpy as np
import torch
from numba import config as numba_config
from numba import get_num_threads, njit, prange, set_num_threads, types
from numba.extending import overload

from forge.jit import enabled as numba_enabled
from runtime.cpu_ir import claim
from runtime.cpu_rows import (
    FLOAT_ACTS,
    Q8_ACTS,
    X22_ACTS,
    activation_form,
    decode_row,
    dot_row,
    prefetch_row,
    prepare_input,
    prepare_into,
    prepared_size,
)

T = TypeVar("T")
_FASTMATH = {"reassoc", "contract"}  # vectorized sums and FMA; no assumptions about NaN or infinity
# weights (elements) from which a product is split across threads: below it, waking them costs more
PARALLEL_MIN = 1 << 16


def available(device: torch.device) -> bool:
    """The kernels serve one-token steps on ``device``."""
    return device.type == "cpu" and numba_enabled()


def use_threads(n: int) -> None:
    """Run the parallel kernels of the calling thread on ``n`` threads (torch's count, capped by numba's pool)."""
    n = max(1, min(n, numba_config.NUMBA_NUM_THREADS))
    if get_num_threads() != n:
        set_num_threads(n)


def on_own_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a thread of its own, which then exits; the caller waits (Ctrl-C still stops it: the
    thread is a daemon). A thread that has run parallel kernels (numba's or torch's) keeps an OpenMP team for
    good. When another thread runs them later (``forge serve``'s worker, the hybrid executor's), the teams
    outnumber the cores, and libgomp makes their threads sleep between regions instead of spinning: +80-100 us
    a kernel call on a 16-core host, an empty region 2 -> 17 us on 2 cores."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001  # raised again in the caller
            out["error"] = exc

    thread = threading.Thread(target=run, name="forge-own-thread", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.1)
    if "error" in out:
        raise out["error"]
    return out["value"]


def start_threads() -> None:
    """Start numba's thread pool now, on torch's thread count, and keep torch's count: the pool's start (at
    its first use, a kernel's or ``get_num_threads``'s) resets the process's OpenMP thread count, which torch
    reads too, to every core, so a model loaded after ``torch.set_num_threads(1)`` (``--threads 1``) ran
    its kernels and torch's products on all cores."""
    n = torch.get_num_threads()
    use_threads(n)
    torch.set_num_threads(n)


@njit(fastmath=_FASTMATH, nogil=True, cache=True, inline="always")
def _dot(w: np.ndarray, x: np.ndarray) -> np.float32:
    s = np.float32(0)
    for j in range(x.shape[0]):
        s += w[j] * x[j]
    return s


@njit(fastmath=_FASTMATH, nogil=True, cache=True, inline="always")
def _rms_norm(h: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray) -> None:
    ss = np.float32(0)
    for j in range(h.shape[0]):
        ss += h[j] * h[j]
    scale = np.float32(1) / np.sqrt(ss / np.float32(h.shape[0]) + np.float32(eps))
    for j in range(h.shape[0]):
        out[j] = h[j] * scale * weight[j]


def _row_dot(
    w: np.ndarray, index: np.ndarray, r: int, x: np.ndarray, xsum: np.ndarray, scratch: np.ndarray
) -> float:
    """Row r of w times x, where w holds float32 rows (n_out, n_in), or encoded rows back to back (uint8,
    row r's bytes ``w[index[r, 0] : index[r, 1]]`` of ggml type ``index[r, 2]``, see ``Rows``); compiled per
    kind of w (``overload``), so the kernels below take either."""
    raise NotImplementedError("compiled code only")


@overload(_row_dot, inline="always", jit_options={"fastmath": _FASTMATH})
def _row_dot_compiled(w, index, r, x, xsum, scratch):  # noqa: ANN001, ANN202
    if isinstance(w, types.Array) and w.dtype == types.float32:
        return lambda w, index, r, x, xsum, scratch: _dot(w[r], x)
    return lambda w, index, r, x, xsum, scratch: dot_row(
        w[index[r, 0] : index[r, 1]], index[r, 2], x, xsum, scratch
    )


def _prefetch(w: np.ndarray, index: np.ndarray, r: int) -> None:
    """``prefetch_row`` of row r of w (see ``_row_dot``)."""
    raise NotImplementedError("compiled code only")


@overload(_prefetch, inline="always")
def _prefetch_compiled(w, index, r):  # noqa: ANN001, ANN202
    if isinstance(w, types.Array) and w.dtype == types.float32:
        return lambda w, index, r: prefetch_row(w[r])
    return lambda w, index, r: prefetch_row(w[index[r, 0] : index[r, 1]])


@njit(fastmath=_FASTMATH, nogil=True, cache=True, inline="always")
def _gemv_rows(
    x: np.ndarray,
    w: np.ndarray,
    index: np.ndarray,
    res: np.ndarray,
    has_res: bool,
    out: np.ndarray,
    xsum: np.ndarray,
    scratch: np.ndarray,
    r0: int,
    r1: int,
) -> None:
    """Rows r0 .. r1 - 1 of ``_gemv_serial``'s product (the next row's bytes prefetched); xsum: x prepared."""
    n = out.shape[0]
    for r in range(r0, r1):
        if r + 1 < n:
            _prefetch(w, index, r + 1)
        s = _row_dot(w, index, r, x, xsum, scratch)
        out[r] = s + res[r] if has_res else s


@njit(fastmath=_FASTMATH, nogil=True, cache=True)
def _gemv_serial(
    x: np.ndarray,
    w: np.ndarray,
    index: np.ndarray,
    res: np.ndarray,
    has_res: bool,
    out: np.ndarray,
    acts: int,
) -> None:
    """out[r] = w's row r . x (+ res[r]); w, index: float32 rows or encoded rows (see ``_row_dot``); acts: the
    form K-quant rows take x in (``runtime.cpu_rows.activation_form``)."""
    scratch = np.empty(x.shape[0], np.float32)
    _gemv_rows(x, w, index, res, has_res, out, prepare_input(x, acts), scratch, 0, out.shape[0])


_ROW_CHUNK = 64  # rows per parallel work item (one scratch row each)


@njit(fastmath=_FASTMATH, nogil=True, cache=True, parallel=True)
def _gemv_parallel(
    x: np.ndarray,
    w: np.ndarray,
    index: np.ndarray,
    res: np.ndarray,
    has_res: bool,
    out: np.ndarray,
    acts: int,
) -> None:
    """``_gemv_serial`` with the rows spread over the threads."""
    xsum = prepare_input(x, acts)
    n = out.shape[0]
    for c in prange((n + _ROW_CHUNK - 1) // _ROW_CHUNK):
        scratch = np.empty(x.shape[0], np.float32)
        _gemv_rows(
            x, w, index, res, has_res, out, xsum, scratch, c * _ROW_CHUNK, min(n, (c + 1) * _ROW_CHUNK)
        )


@njit(fastmath=_FASTMATH, nogil=True, cache=True)
def _norm_gemv(
    h: np.ndarray,
    norm: np.ndarray,
    eps: float,
    w: np.ndarray,
    index: np.ndarray,
    xn: np.ndarray,
    out: np.ndarray,
    threads: bool,
    acts: int,
) -> None:
    _rms_norm(h, norm, eps, xn)
    if threads:
        _gemv_parallel(xn, w, index, out, False, out, acts)
    else:
        _gemv_serial(xn, w, index, out, False, out, acts)


@njit(fastmath=_FASTMATH, nogil=True, cache=True, inline="always")
def _encoded_row(buf: np.ndarray, meta: np.ndarray, part: int, expert: int, row: int) -> np.ndarray:
    start = meta[part, 0] + expert * meta[part, 1] + row * meta[part, 2]
    return buf[start : start + meta[part, 3]]


@njit(fastmath=_FASTMATH, nogil=True, cache=True, inline="always")
def _gate_up_rows(
    gate: np.ndarray,
    up: np.ndarray,
    meta: np.ndarray,
    x: np.ndarray,
    x_sums: np.ndarray,
    ids: np.ndarray,
    act: np.ndarray,
    row: np.ndarray,
    r0: int,
    r1: int,
) -> None:
    """Rows r0 .. r1 - 1 of ``_routed_ffn_encoded``'s gate/up product, counted over the experts one after
    another (row r: expert ids[r // n_ff], its row r % n_ff): act[i, f] = SiLU(gate . x) * (up . x)."""
    n_ff = act.shape[1]
    for r in range(r0, r1):
        i = r // n_ff
        f = r - i * n_ff
        e = ids[i]
        if f + 1 < n_ff:
            prefetch_row(_encoded_row(gate, meta, 0, e, f + 1))
            prefetch_row(_encoded_row(up, meta, 1, e, f + 1))
        g = dot_row(_encoded_row(gate, meta, 0, e, f), meta[0, 4], x, x_sums, row)
        act[i, f] = _silu(g) * dot_row(_encoded_row(up, meta, 1, e, f), meta[1, 4], x, x_sums, row)


@njit(fastmath=_FASTMATH, nogil=True, cache=True, inline="always")
def _down_rows(
    down: np.ndarray,
    meta: np.ndarray,
    h: np.ndarray,
    ids: np.ndarray,
    weights: np.ndarray,
    act: np.ndarray,
    act_sums: np.ndarray,
    out: np.ndarray,
    row: np.ndarray,
    d0: int,
    d1: int,
) -> None:
    """Rows d0 .. d1 - 1 of ``_routed_ffn_encoded``'s down product: out[d] = h[d] + the experts' weighted sum."""
    n_out = out.shape[0]
    for d in range(d0, d1):
        s = np.float32(0)
        for i in range(ids.shape[0]):
            if d + 1 < n_out:
                prefetch_row(_encoded_row(down, meta, 2, ids[i], d + 1))
            s += weights[i] * dot_row(
                _encoded_row(down, meta, 2, ids[i], d), meta[2, 4], act[i], act_sums[i], row
            )
        out[d] = h[d] + s


@njit(fastmath=_FASTMATH, nogil=True, cache=True, parallel=True)
def _routed_ffn_encoded(
    x: np.ndarray,
    gate: np.ndarray,
    up: np.ndarray,
    down: np.ndarray,
    meta: np.ndarray,
    h: np.ndarray,
    ids: np.ndarray,
    weights: np.ndarray,
    act: np.ndarray,
    out: np.ndarray,
    acts: int,
    chunk_in: int,
    chunk_out: int,
    threads: int,
) -> None:
    """``_routed_ffn`` over encoded experts (acts: the form K-quant rows take their inputs in; chunk_in,
    chunk_out: rows of a parallel work item in the gate/up and the down products, see ``expert_chunks``;
    threads: numba's thread count, each taking items until none is left).

    gate, up, down: flat uint8 buffers; meta (3, 5): per part the offset, expert stride, row stride, row bytes
    and type of its rows (see ``EncodedExperts``). Each row's dot product is taken from its bytes (``dot_row``).
    """
    k, n_ff = act.shape
    x_sums = prepare_input(x, acts)
    rows = k * n_ff
    taken = np.zeros(2, np.int64)  # the two products' work items handed out so far (``claim``)
    items = (rows + chunk_in - 1) // chunk_in
    for _ in prange(min(threads, items)):
        row = np.empty(x.shape[0], np.float32)
        c = claim(taken, 0)
        while c < items:
            r0, r1 = c * chunk_in, min(rows, (c + 1) * chunk_in)
            _gate_up_rows(gate, up, meta, x, x_sums, ids, act, row, r0, r1)
            c = claim(taken, 0)
    act_sums = np.empty((k, prepared_size(n_ff, acts)), np.float32)
    for i in range(k):
        prepare_into(act[i], act_sums[i])
    n_out = out.shape[0]
    items = (n_out + chunk_out - 1) // chunk_out
    for _ in prange(min(threads, items)):
        row = np.empty(n_ff, np.float32)
        c = claim(taken, 1)
        while c < items:
            d0, d1 = c * chunk_out, min(n_out, (c + 1) * chunk_out)
            _down_rows(down, meta, h, ids, weights, act, act_sums, out, row, d0, d1)
            c = claim(taken, 1)


@njit(fastmath=_FASTMATH, nogil=True, cache=True, parallel=True)
def _routed_ffn(
    x: np.ndarray,
    gate_up: np.ndarray,
    down: np.ndarray,
    h: np.ndarray,
    ids: np.ndarray,
    weights: np.ndarray,
    act: np.ndarray,
    out: np.ndarray,
) -> None:
    """out = h + sum_i weights[i] * down[ids[i]] @ (silu(gate) * up), gate|up = gate_up[ids[i]] @ x.

    ids/weights: the routed experts and their weights (routed by ``runtime.moe.Router``, outside the
    kernels); k = ids.shape[0]. act (k, n_ff) receives the SwiGLU outputs.
    """
    k, n_ff = act.shape
    for r in prange(k * n_ff):
        i = r // n_ff
        f = r - i * n_ff
        e = ids[i]
        g = _dot(gate_up[e, f], x)
        act[i, f] = _silu(g) * _dot(gate_up[e, n_ff + f], x)
    for d in prange(down.shape[1]):
        s = np.float32(0)
        for i in range(k):
            s += weights[i] * _dot(down[ids[i], d], act[i])
        out[d] = h[d] + s


@njit(fastmath=_FASTMATH, nogil=True, cache=True, parallel=True)
def _attention_step(
    h: np.ndarray,
    norm: np.ndarray,
    eps: float,
    w_in: np.ndarray,
    i_in: np.ndarray,
    n_head: int,
    n_gate: int,
    qk_norm: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    pos: int,
    w_out: np.ndarray,
    i_out: np.ndarray,
    x: np.ndarray,
    att: np.ndarray,
    out: np.ndarray,
    acts: int,
) -> None:
    """out = h + attention of one token at ``pos`` (its k and v written to keys/values[:, pos]); x receives
    the normed h, att the attention (the projections' inputs).

    w_in's rows: q heads, k heads, n_gate output-gate rows, v heads; qk_norm: the q and k heads' RMSNorm
    weights (q's carrying the score scale); NEOX RoPE over the first 2 * len(cos) dims of each head. w_in and
    w_out (with i_in / i_out): float32 rows or encoded rows (see ``_row_dot``).
    """
    n_kv, _, head_dim = keys.shape
    _rms_norm(h, norm, eps, x)
    y = np.empty(i_in.shape[0], np.float32)
    _gemv_parallel(x, w_in, i_in, y, False, y, acts)
    n_qk = n_head + n_kv
    qk = y[: n_qk * head_dim].reshape(n_qk, head_dim)
    half = cos.shape[0]
    for i in range(n_qk):
        _rms_norm(qk[i], qk_norm[i], eps, qk[i])
        for d in range(half):
            a, b = qk[i, d], qk[i, d + half]
            qk[i, d] = a * cos[d] - b * sin[d]
            qk[i, d + half] = b * cos[d] + a * sin[d]
    v0 = n_qk * head_dim + n_gate
    for g in range(n_kv):
        keys[g, pos] = qk[n_head + g]
        values[g, pos] = y[v0 + g * head_dim : v0 + (g + 1) * head_dim]
    att[:] = 0
    rep = n_head // n_kv
    for i in prange(n_head):
        g = i // rep
        scores = np.empty(pos + 1, np.float32)
        peak = np.float32(-np.inf)
        for j in range(pos + 1):
            scores[j] = _dot(keys[g, j], qk[i])
            peak = max(peak, scores[j])
        total = np.float32(0)
        for j in range(pos + 1):
            scores[j] = np.exp(scores[j] - peak)
            total += scores[j]
        o = att[i * head_dim : (i + 1) * head_dim]
        for j in range(pos + 1):
            p = scores[j] / total
            for d in range(head_dim):
                o[d] += p * values[g, j, d]
        if n_gate:
            gate = y[n_qk * head_dim + i * head_dim : n_qk * head_dim + (i + 1) * head_dim]
            for d in range(head_dim):
                o[d] /= np.float32(1) + np.exp(-gate[d])
    _gemv_parallel(att, w_out, i_out, h, True, out, acts)


@njit(fastmath=_FASTMATH, nogil=True, cache=True, inline="always")
def _silu(v: np.float32) -> np.float32:
    return v / (np.float32(1) + np.exp(-v))


@njit(fastmath=_FASTMATH, nogil=True, cache=True, parallel=True)
def _deltanet_step(
    h: np.ndarray,
    norm: np.ndarray,
    eps: float,
    w_in: np.ndarray,
    i_in: np.ndarray,
    n_k: int,
    conv_state: np.ndarray,
    conv_w: np.ndarray,
    dt_bias: np.ndarray,
    a: np.ndarray,
    out_norm: np.ndarray,
    recurrent: np.ndarray,
    w_out: np.ndarray,
    i_out: np.ndarray,
    x: np.ndarray,
    o: np.ndarray,
    out: np.ndarray,
    acts: int,
) -> None:
    """out = h + the Gated DeltaNet mixer for one token; conv_state (kernel - 1, channels) and recurrent
    (n_v, d_k, d_v) are advanced in place. x receives the normed h, o the gated-norm output (the
    projections' inputs).

    w_in's rows: conv channels (q, k, v), z (n_v * d_v), beta (n_v), alpha (n_v); conv_w (kernel, channels).
    w_in and w_out (with i_in / i_out): float32 rows or encoded rows (see ``_row_dot``).
    """
    n_v, d_k, d_v = recurrent.shape
    channels, kernel = conv_state.shape[1], conv_w.shape[0]
    key_dim = n_k * d_k
    _rms_norm(h, norm, eps, x)
    y = np.empty(i_in.shape[0], np.float32)
    _gemv_parallel(x, w_in, i_in, y, False, y, acts)
    conv = np.empty(channels, np.float32)
    for c in range(channels):
        acc = y[c] * conv_w[kernel - 1, c]
        for t in range(kernel - 1):
            acc += conv_state[t, c] * conv_w[t, c]
        conv[c] = _silu(acc)
    for t in range(kernel - 2):
        conv_state[t] = conv_state[t + 1]
    conv_state[kernel - 2] = y[:channels]
    for i in range(2 * n_k):  # q heads (carrying the 1/sqrt(d_k) score scale) then k heads, l2-normalized
        head = conv[i * d_k : (i + 1) * d_k]
        scale = np.float32(1) / max(np.sqrt(_dot(head, head)), np.float32(eps))
        if i < n_k:
            scale *= np.float32(1) / np.sqrt(np.float32(d_k))
        for d in range(d_k):
            head[d] *= scale
    z0 = channels
    beta0 = z0 + n_v * d_v
    alpha0 = beta0 + n_v
    for hv in prange(n_v):
        kh = hv % n_k  # value heads tiled over key heads
        q = conv[kh * d_k : (kh + 1) * d_k]
        k = conv[key_dim + kh * d_k : key_dim + (kh + 1) * d_k]
        v = conv[2 * key_dim + hv * d_v : 2 * key_dim + (hv + 1) * d_v]
        gate = y[alpha0 + hv] + dt_bias[hv]
        softplus = gate if gate > 20 else np.log1p(np.exp(gate))
        decay = np.exp(softplus * a[hv])
        beta = np.float32(1) / (np.float32(1) + np.exp(-y[beta0 + hv]))
        s = recurrent[hv]
        pred = np.zeros(d_v, np.float32)
        for i in range(d_k):
            for j in range(d_v):
                s[i, j] *= decay
                pred[j] += k[i] * s[i, j]
        for j in range(d_v):
            pred[j] = (v[j] - pred[j]) * beta  # the delta
        oh = o[hv * d_v : (hv + 1) * d_v]
        oh[:] = 0
        for i in range(d_k):
            for j in range(d_v):
                s[i, j] += k[i] * pred[j]
                oh[j] += q[i] * s[i, j]
        _rms_norm(oh, out_norm, eps, oh)
        for j in range(d_v):
            oh[j] *= _silu(y[z0 + hv * d_v + j])
    _gemv_parallel(o, w_out, i_out, h, True, out, acts)


@njit(fastmath=_FASTMATH, nogil=True, cache=True)
def _shared_ffn(
    x: np.ndarray,
    w_in: np.ndarray,
    i_in: np.ndarray,
    w_down: np.ndarray,
    i_down: np.ndarray,
    h: np.ndarray,
    act: np.ndarray,
    out: np.ndarray,
    acts: int,
) -> None:
    """out = h + sigmoid(gate_inp . x) * w_down @ (silu(gate @ x) * (up @ x)); act receives the SwiGLU output.

    w_in's rows: gate (n_ff), up (n_ff), the one-row gate input; w_in and w_down: float32 rows or encoded rows
    (with i_in / i_down; see ``_row_dot``).
    """
    n_ff = act.shape[0]
    y = np.empty(i_in.shape[0], np.float32)
    _gemv_parallel(x, w_in, i_in, y, False, y, acts)
    for f in range(n_ff):
        act[f] = _silu(y[f]) * y[n_ff + f]
    scale = np.float32(1) / (np.float32(1) + np.exp(-y[2 * n_ff]))
    _gemv_parallel(act, w_down, i_down, out, False, out, acts)
    for r in range(out.shape[0]):
        out[r] = h[r] + scale * out[r]


# rows of one expert's matrix that one parallel work item of the batch kernel decodes (then multiplies)
BATCH_ROWS = 16
#: the batch kernel computes a group of fewer rows than this (per input form) from the encoded bytes, as a
#: decode step does, instead of decoding its expert's rows. Measured on the 2-core box, prefill of a 4-layer
#: Qwen3.6-35B-A3B-geometry Q4_K file (256 experts, top 8) with every expert encoded, limits 0 / 2 / 3 / 4:
#: 8-bit inputs pp64 115 / 142 / 150 / 146 tok/s, pp256 250 / 256 / 260 / 255; float32 inputs pp64 128 / 132
#: / 122 / 104, pp256 230 / 228 / 229 / 224. 22-bit (VNNI) inputs, on the H200's 16-core host, limits 0 / 2 / 3
#: / 4: pp64 922 / 1,006 / 1,034 / 1,045, pp512 1,507 / 1,585 / 1,792 / 1,580 (pp256 flat within noise).
DIRECT_BELOW = {FLOAT_ACTS: 2, Q8_ACTS: 3, X22_ACTS: 3}


@njit(fastmath=_FASTMATH, nogil=True, cache=True, inline="always")
def _swiglu(g: np.float32, u: np.float32, limit: np.float32) -> np.float32:
    """SiLU(min(g, limit)) * clamp(u, -limit, limit) (DeepSeek V4's clamped SwiGLU; limit = inf: plain)."""
    g = min(g, limit)
    u = max(min(u, limit), -limit)
    return _silu(g) * u


@njit(fastmath=_FASTMATH, nogil=True, cache=True, inline="always")
def _rows_dot(w: np.ndarray, n: int, x: np.ndarray, out: np.ndarray) -> None:
    """out[i] = w[i] . x for the first n rows of w, four rows per pass over x (they share each load of x)."""
    for i in range(0, n - 3, 4):
        s0 = s1 = s2 = s3 = np.float32(0)
        for j in range(x.shape[0]):
            v = x[j]
            s0 += w[i, j] * v
            s1 += w[i + 1, j] * v
            s2 += w[i + 2, j] * v
            s3 += w[i + 3, j] * v
        out[i], out[i + 1], out[i + 2], out[i + 3] = s0, s1, s2, s3
    for i in range(n - n % 4, n):
        out[i] = _dot(w[i], x)


@njit(fastmath=_FASTMATH, nogil=True, cache=True, inline="always")
def _rows_dot2(w: np.ndarray, n: int, x: np.ndarray, y: np.ndarray, ox: np.ndarray, oy: np.ndarray) -> None:
    """``_rows_dot`` of two inputs at once: ox[i] = w[i] . x, oy[i] = w[i] . y (each load of w serves both)."""
    for i in range(0, n - 3, 4):
        a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0)
        for j in range(x.shape[0]):
            v, u = x[j], y[j]
            w0, w1, w2, w3 = w[i, j], w[i + 1, j], w[i + 2, j], w[i + 3, j]
            a0 += w0 * v
            a1 += w1 * v
            a2 += w2 * v
            a3 += w3 * v
            b0 += w0 * u
            b1 += w1 * u
            b2 += w2 * u
            b3 += w3 * u
        ox[i], ox[i + 1], ox[i + 2], ox[i + 3] = a0, a1, a2, a3
        oy[i], oy[i + 1], oy[i + 2], oy[i + 3] = b0, b1, b2, b3
    for i in range(n - n % 4, n):
        ox[i], oy[i] = _dot(w[i], x), _dot(w[i], y)


@njit(fastmath=_FASTMATH, nogil=True, cache=True, inline="always")
def _decode_rows(
    buf: np.ndarray, meta: np.ndarray, part: int, expert: int, first: int, n: int, out: np.ndarray
) -> None:
    """Rows first .. first + n - 1 of an expert's part (see ``_encoded_row``) decoded into out[:n]."""
    for i in range(n):
        if i + 1 < n:
            prefetch_row(_encoded_row(buf, meta, part, expert, first + i + 1))
        decode_row(_encoded_row(buf, meta, part, expert, first + i), meta[part, 4], out[i])


@njit(fastmath=_FASTMATH, nogil=True, cache=True, parallel=True)
def _routed_ffn_batch(
    xs: np.ndarray,
    gate: np.ndarray,
    up: np.ndarray,
    down: np.ndarray,
    meta: np.ndarray,
    experts: np.ndarray,
    starts: np.ndarray,
    limit: np.float32,
    act: np.ndarray,
    ys: np.ndarray,
    threads: int,
    direct_below: int,
    acts: int,
) -> None:
    """The routed experts of a batch over encoded experts (see ``_routed_ffn_encoded``), rows grouped by expert.

    xs (R, n_embd): the routed (token, slot) rows; rows starts[g] : starts[g + 1] go to expert experts[g].
    act (R, n_ff) receives the SwiGLU outputs, ys (R, n_embd) the down outputs (unweighted). Work items:
    (group, block of ``BATCH_ROWS`` output rows), taken in turn by ``threads`` threads (groups differ in size).
    A block's weight rows are decoded once (``decode_row``) and multiplied with every row of its group; a
    group of fewer than ``direct_below`` rows takes each product from the encoded bytes (``dot_row``, its
    inputs prepared in form ``acts``), as a decode step does: decoding costs more than a few such products.
    """
    n_groups, n_embd, n_ff = experts.shape[0], xs.shape[1], act.shape[1]
    taken = np.zeros(4, np.int64)  # each pass's work items handed out so far (``claim``), in order
    few = starts[1:] - starts[:-1] < direct_below  # the groups computed from the encoded bytes
    prepared = few.any()
    xp = np.empty((xs.shape[0] if prepared else 0, prepared_size(n_embd, acts)), np.float32)
    ap = np.empty((xs.shape[0] if prepared else 0, prepared_size(n_ff, acts)), np.float32)
    if prepared:
        for _ in prange(min(threads, n_groups)):
            _prepare_groups(xs, xp, starts, few, taken, 0)
    blocks = (n_ff + BATCH_ROWS - 1) // BATCH_ROWS
    for _ in prange(min(threads, n_groups * blocks)):
        row = np.empty(n_embd, np.float32)
        item = claim(taken, 1)
        while item < n_groups * blocks:
            _gate_up_block(xs, xp, row, gate, up, meta, experts, starts, few, limit, act, item, blocks)
            item = claim(taken, 1)
    if prepared:
        for _ in prange(min(threads, n_groups)):
            _prepare_groups(act, ap, starts, few, taken, 2)
    blocks = (n_embd + BATCH_ROWS - 1) // BATCH_ROWS
    for _ in prange(min(threads, n_groups * blocks)):
        row = np.empty(n_ff, np.float32)
        item = claim(taken, 3)
        while item < n_groups * blocks:
            _down_block(down, meta, experts, starts, few, act, ap, row, ys, item, blocks)
            item = claim(taken, 3)


@njit(fastmath=_FASTMATH, nogil=True, cache=True, inline="always")
def _prepare_groups(
    x: np.ndarray, xp: np.ndarray, starts: np.ndarray, few: np.ndarray, taken: np.ndarray, i: int
) -> None:
    """The rows of the ``few`` groups prepared for ``dot_row``, a group at a time as ``claim(taken, i)`` hands
    them out (see ``_routed_ffn_batch``)."""
    g = claim(taken, i)
    while g < few.shape[0]:
        if few[g]:
            for r in range(starts[g], starts[g + 1]):
                prepare_into(x[r], xp[r])
        g = claim(taken, i)


@njit(nogil=True, cache=True, inline="always")
def _item_block(item: int, blocks: int, experts: np.ndarray, starts: np.ndarray, rows: int) -> tuple:
    """A batch work item's group, expert, the group's rows r0 .. r1 - 1, and the block's first weight row and
    row count (``blocks`` blocks of ``BATCH_ROWS`` of a part's ``rows`` rows per group)."""
    g = item // blocks
    first = (item - g * blocks) * BATCH_ROWS
    return g, experts[g], starts[g], starts[g + 1], first, min(BATCH_ROWS, rows - first)


@njit(fastmath=_FASTMATH, nogil=True, cache=True, inline="always")
def _gate_up_block(
    xs: np.ndarray,
    xp: np.ndarray,
    row: np.ndarray,
    gate: np.ndarray,
    up: np.ndarray,
    meta: np.ndarray,
    experts: np.ndarray,
    starts: np.ndarray,
    few: np.ndarray,
    limit: np.float32,
    act: np.ndarray,
    item: int,
    blocks: int,
) -> None:
    """``_routed_ffn_batch``'s gate/up work item ``item``: a block of ``BATCH_ROWS`` rows of one group's expert."""
    n_embd = xs.shape[1]
    g, e, r0, r1, f0, n = _item_block(item, blocks, experts, starts, act.shape[1])
    if few[g]:
        for f in range(f0, f0 + n):
            gr, ur = _encoded_row(gate, meta, 0, e, f), _encoded_row(up, meta, 1, e, f)
            for r in range(r0, r1):
                gv = dot_row(gr, meta[0, 4], xs[r], xp[r], row)
                act[r, f] = _swiglu(gv, dot_row(ur, meta[1, 4], xs[r], xp[r], row), limit)
        return
    wg, wu = np.empty((BATCH_ROWS, n_embd), np.float32), np.empty((BATCH_ROWS, n_embd), np.float32)
    _decode_rows(gate, meta, 0, e, f0, n, wg)
    _decode_rows(up, meta, 1, e, f0, n, wu)
    gs, us = np.empty((2, BATCH_ROWS), np.float32), np.empty((2, BATCH_ROWS), np.float32)
    for r in range(r0, r1, 2):
        if r + 1 < r1:
            _rows_dot2(wg, n, xs[r], xs[r + 1], gs[0], gs[1])
            _rows_dot2(wu, n, xs[r], xs[r + 1], us[0], us[1])
        else:
            _rows_dot(wg, n, xs[r], gs[0])
            _rows_dot(wu, n, xs[r], us[0])
        for t in range(min(2, r1 - r)):
            for i in range(n):
                act[r + t, f0 + i] = _swiglu(gs[t, i], us[t, i], limit)


@njit(fastmath=_FASTMATH, nogil=True, cache=True, inline="always")
def _down_block(
    down: np.ndarray,
    meta: np.ndarray,
    experts: np.ndarray,
    starts: np.ndarray,
    few: np.ndarray,
    act: np.ndarray,
    ap: np.ndarray,
    row: np.ndarray,
    ys: np.ndarray,
    item: int,
    blocks: int,
) -> None:
    """``_routed_ffn_batch``'s down work item ``item``: a block of ``BATCH_ROWS`` output rows of one group."""
    g, e, r0, r1, d0, n = _item_block(item, blocks, experts, starts, ys.shape[1])
    if few[g]:
        for d in range(d0, d0 + n):
            dr = _encoded_row(down, meta, 2, e, d)
            for r in range(r0, r1):
                ys[r, d] = dot_row(dr, meta[2, 4], act[r], ap[r], row)
        return
    wd = np.empty((BATCH_ROWS, act.shape[1]), np.float32)
    _decode_rows(down, meta, 2, e, d0, n, wd)
    for r in range(r0, r1, 2):
        if r + 1 < r1:
            _rows_dot2(wd, n, act[r], act[r + 1], ys[r, d0 : d0 + n], ys[r + 1, d0 : d0 + n])
        else:
            _rows_dot(wd, n, act[r], ys[r, d0 : d0 + n])


class EncodedExperts:
    """A layer's routed experts as encoded rows: per part (gate, up, down) a flat uint8 buffer over its bytes
    and where expert e's row r starts in it (offset + e * expert stride + r * row stride); no bytes are copied.

    Each part is given as an (n_expert, rows, row bytes) array whose rows are contiguous (a tensor's bytes, a
    strided view of an expert-major store or of an expert cache's slab).
    """

    def __init__(
        self, gate: np.ndarray, gate_type: int, up: np.ndarray, up_type: int, down: np.ndarray, down_type: int
    ) -> None:
        parts = ((gate, gate_type), (up, up_type), (down, down_type))
        self.buffers = tuple(_flat_bytes(a) for a, _ in parts)
        self.meta = np.array(
            [[0, a.strides[0], a.strides[1], a.shape[2], int(t)] for a, t in parts], np.int64
        )
        self.n_ff = gate.shape[1]
        self.acts = activation_form()  # the form K-quant rows take their inputs in


def _flat_bytes(a: np.ndarray) -> np.ndarray:
    """A 1-D view from a's first byte to its last (a: 3-D uint8, non-negative strides, contiguous rows)."""
    if a.dtype != np.uint8 or a.ndim != 3 or a.strides[2] != 1 or min(a.strides) < 0:
        raise ValueError(
            f"encoded experts need (experts, rows, row bytes) uint8 rows, got {a.dtype} {a.strides}"
        )
    span = (a.shape[0] - 1) * a.strides[0] + (a.shape[1] - 1) * a.strides[1] + a.shape[2]
    return np.lib.stride_tricks.as_strided(a, shape=(span,), strides=(1,))


def _vec(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy().reshape(-1)


class Rows(NamedTuple):
    """A matrix the kernels multiply row by row: float32 rows (n_out, n_in), or encoded rows of ggml types
    ``runtime.cpu_rows`` reads, their bytes back to back in ``data`` (uint8), row r at
    ``data[index[r, 0] : index[r, 1]]`` of type ``index[r, 2]``: one weight's file rows (a view of the mapped
    file), or several weights' of any such types stacked (q, k and v of a layer whose v has another type).
    ``index`` (n_out, 3) int64 also comes with float32 rows (zeros), so every kernel reads n_out from it."""

    data: np.ndarray
    index: np.ndarray
    acts: int = FLOAT_ACTS  # the form K-quant rows take their input in (``runtime.cpu_rows.activation_form``)

    @classmethod
    def floats(cls, w: np.ndarray) -> Rows:
        return cls(np.ascontiguousarray(w, np.float32), np.zeros((w.shape[0], 3), np.int64))

    @classmethod
    def encoded_parts(cls, parts: list[tuple[np.ndarray, int]], order: np.ndarray | None = None) -> Rows:
        """Encoded matrices (rows, row bytes) uint8 (a 1-D one is one row) with their types, stacked by rows,
        rows permuted by ``order``; one C-contiguous matrix is used in place, not copied."""
        mats = [(m.reshape(1, -1) if m.ndim == 1 else m, t) for m, t in parts]
        if len(mats) == 1 and mats[0][0].flags.c_contiguous:
            data = mats[0][0].reshape(-1)
        else:
            data = np.concatenate([np.ascontiguousarray(m).reshape(-1) for m, _ in mats])
        sizes = np.concatenate([np.full(m.shape[0], m.shape[1], np.int64) for m, _ in mats])
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        index = np.stack(
            [starts, starts + sizes, np.concatenate([np.full(m.shape[0], t) for m, t in mats])], 1
        )
        index = np.ascontiguousarray(index if order is None else index[order], np.int64)
        return cls(data, index, activation_form())

    @property
    def encoded(self) -> bool:
        return self.data.dtype == np.uint8

    @property
    def n_out(self) -> int:
        return self.index.shape[0]

    def threaded(self, n_in: int) -> bool:
        """Worth spreading over the threads: at least ``PARALLEL_MIN`` weights."""
        return self.n_out * n_in >= PARALLEL_MIN


def gemv(x: torch.Tensor, w: Rows, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x (1, n_in) float32 -> (1, n_out): x @ W.T (+ residual (1, n_out))."""
    out = torch.empty(1, w.n_out)
    o = out.numpy()[0]
    res = o if residual is None else _vec(residual)
    kernel = _gemv_parallel if w.threaded(x.shape[-1]) else _gemv_serial
    kernel(_vec(x), w.data, w.index, res, residual is not None, o, w.acts)
    return out


def norm_gemv(h: torch.Tensor, norm: np.ndarray, eps: float, w: Rows) -> tuple[torch.Tensor, torch.Tensor]:
    """h (1, n) -> (rms_norm(h) * norm, that @ W.T), both (1, .)."""
    xn, out = torch.empty(1, h.shape[-1]), torch.empty(1, w.n_out)
    _norm_gemv(
        _vec(h), norm, eps, w.data, w.index, xn.numpy()[0], out.numpy()[0], w.threaded(h.shape[-1]), w.acts
    )
    return xn, out


@njit(nogil=True, cache=True, parallel=True)
def _decode_rows_into(w: np.ndarray, index: np.ndarray, out: np.ndarray) -> None:
    """out[i] = encoded row i of (w, index) (see ``Rows``), decoded."""
    for r in prange(index.shape[0]):
        decode_row(w[index[r, 0] : index[r, 1]], index[r, 2], out[r])


# float32 elements of the decoded rows that a batch product holds at a time
_DECODE_CHUNK_ELEMS = 1 << 22


def product(x: torch.Tensor, w: Rows) -> torch.Tensor:
    """x (T, n_in) @ W.T for any number of rows T: one row by the kernels, a batch by torch's matmul over
    float32 rows, encoded rows decoded a chunk at a time (memory stays bounded)."""
    if x.shape[0] == 1:
        return gemv(x, w)
    if not w.encoded:
        return torch.mm(x, torch.from_numpy(w.data).T)
    out = x.new_empty(x.shape[0], w.n_out)
    step = max(1, _DECODE_CHUNK_ELEMS // x.shape[-1])
    buf = np.empty((min(step, w.n_out), x.shape[-1]), np.float32)
    for r0 in range(0, w.n_out, step):
        n = min(step, w.n_out - r0)
        _decode_rows_into(w.data, w.index[r0 : r0 + n], buf[:n])
        torch.mm(x, torch.from_numpy(buf[:n]).T, out=out[:, r0 : r0 + n])
    return out


def routed_ffn_encoded(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: EncodedExperts, h: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``routed_ffn`` with the experts kept encoded (see ``EncodedExperts``; ``ids`` index its first axis);
    same returns."""
    act, out = torch.empty(len(ids), experts.n_ff), torch.empty(1, h.shape[-1])
    routed_ffn_into(_vec(x), _ids(ids), _vec(weights.float()), experts, _vec(h), act.numpy(), out.numpy()[0])
    return out, act


def routed_ffn_into(
    x: np.ndarray,
    ids: np.ndarray,
    weights: np.ndarray,
    experts: EncodedExperts,
    h: np.ndarray,
    act: np.ndarray,
    out: np.ndarray,
) -> None:
    """``routed_ffn_encoded`` on numpy arrays, no tensors made: x, h, out (n_embd,) float32; ids (k,) int64;
    weights (k,) float32; act (k, n_ff) float32 receives the SwiGLU outputs, out h + the experts' weighted
    sum (a decode step's worker calls it per layer: the tensor wrapping cost tens of microseconds)."""
    threads = get_num_threads()
    chunk_in, chunk_out = expert_chunks(act.size, out.shape[0], threads)
    _routed_ffn_encoded(
        x,
        *experts.buffers,
        experts.meta,
        h,
        ids,
        weights,
        act,
        out,
        experts.acts,
        chunk_in,
        chunk_out,
        threads,
    )


#: a one-token expert call's work items per thread (``expert_chunks``)
ITEMS_PER_THREAD = 4


def expert_chunks(ff_rows: int, n_out: int, threads: int) -> tuple[int, int]:
    """Rows of a parallel work item in a one-token expert call's gate/up product (``ff_rows``: experts x n_ff
    rows) and down product (``n_out`` rows): about ``ITEMS_PER_THREAD`` items per thread, 4 to ``_ROW_CHUNK``
    rows. A decode step's few experts are too few rows for every thread at ``_ROW_CHUNK`` (one expert's
    512 gate/up rows were 8 items on 16 threads) and the threads take equal shares of the items."""
    per = ITEMS_PER_THREAD * max(1, threads)
    return tuple(max(4, min(_ROW_CHUNK, -(-n // per))) for n in (ff_rows, n_out))  # type: ignore[return-value]


def routed_ffn_batch(
    xs: torch.Tensor,
    experts: torch.Tensor,
    starts: torch.Tensor,
    records: EncodedExperts,
    limit: float | None,
    act: torch.Tensor,
    ys: torch.Tensor,
    direct_below: int | None = None,
) -> None:
    """A batch's routed rows over encoded experts, grouped by expert: rows ``starts[g] : starts[g + 1]`` of
    xs (R, n_embd) go to expert ``experts[g]`` (an index along the records' first axis); fills those rows of
    act (R, n_ff) with the SwiGLU outputs (clamped at ``limit`` if set) and of ys (R, n_embd) with the
    experts' (unweighted) outputs. Groups of fewer than ``direct_below`` rows (default ``DIRECT_BELOW`` for
    the records' input form) are computed from the encoded bytes. See ``_routed_ffn_batch``."""
    if direct_below is None:
        direct_below = DIRECT_BELOW[records.acts]
    _routed_ffn_batch(
        xs.numpy(),
        *records.buffers,
        records.meta,
        _ids(experts),
        _ids(starts),
        np.float32(np.inf if limit is None else limit),
        act.numpy(),
        ys.numpy(),
        get_num_threads(),
        direct_below,
        records.acts,
    )


def routed_ffn(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: np.ndarray,
    down: np.ndarray,
    h: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h + the routed experts' SwiGLU output for one token x (1, n_embd): experts ``ids`` (k,) weighted by
    ``weights`` (k,), as ``runtime.moe.Router`` routed them.

    gate_up: (n_expert, 2 n_ff, n_embd) with the gate rows first; down: (n_expert, n_embd, n_ff).
    Returns that (1, n_embd) and the SwiGLU outputs (k, n_ff).
    """
    act, out = torch.empty(len(ids), down.shape[2]), torch.empty(1, h.shape[-1])
    _routed_ffn(
        _vec(x), gate_up, down, _vec(h), _ids(ids), _vec(weights.float()), act.numpy(), out.numpy()[0]
    )
    return out, act


def _ids(ids: torch.Tensor) -> np.ndarray:
    return ids.detach().reshape(-1).to(torch.int64).contiguous().numpy()


def attention_step(
    h: torch.Tensor,
    norm: torch.Tensor,
    eps: float,
    w_in: Rows,
    n_head: int,
    n_gate: int,
    qk_norm: np.ndarray,
    rope: tuple[torch.Tensor, torch.Tensor],
    keys: torch.Tensor,
    values: torch.Tensor,
    pos: int,
    w_out: Rows,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h (1, n_embd) + the attention block's output for the token at ``pos`` (see ``_attention_step``);
    rope: that position's (cos, sin) rows; keys/values: the (n_kv, capacity, head_dim) cache, written at pos.
    Returns that, and the inputs of the two projections: the normed h (1, n_embd), the attention (1, n_head * d).
    """
    out, x = torch.empty_like(h), torch.empty_like(h)
    att = torch.empty(1, n_head * keys.shape[2])
    cos, sin = rope
    _attention_step(
        _vec(h), _vec(norm), eps, w_in.data, w_in.index, n_head, n_gate, qk_norm, cos.numpy(), sin.numpy(),
        keys.numpy(), values.numpy(), pos, w_out.data, w_out.index, x.numpy()[0], att.numpy()[0], out.numpy()[0],
        w_in.acts or w_out.acts,
    )  # fmt: skip
    return out, x, att


def deltanet_step(
    h: torch.Tensor,
    norm: torch.Tensor,
    eps: float,
    w_in: Rows,
    n_k: int,
    conv_state: torch.Tensor,
    conv_w: np.ndarray,
    dt_bias: torch.Tensor,
    a: torch.Tensor,
    out_norm: torch.Tensor,
    recurrent: torch.Tensor,
    w_out: Rows,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h (1, n_embd) + the Gated DeltaNet mixer's output (see ``_deltanet_step``; the states advance in
    place). Returns that, the normed h (1, n_embd) and the output projection's input (1, n_v * d_v)."""
    out, x, o = (
        torch.empty_like(h),
        torch.empty_like(h),
        torch.empty(1, recurrent.shape[0] * recurrent.shape[2]),
    )
    _deltanet_step(
        _vec(h), _vec(norm), eps, w_in.data, w_in.index, n_k, conv_state.numpy(), conv_w, _vec(dt_bias), _vec(a),
        _vec(out_norm), recurrent.numpy(), w_out.data, w_out.index, x.numpy()[0], o.numpy()[0], out.numpy()[0],
        w_in.acts or w_out.acts,
    )  # fmt: skip
    return out, x, o


def shared_ffn(
    x: torch.Tensor, w_in: Rows, w_down: Rows, h: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """h + the sigmoid-gated shared expert on x (1, n_embd) (see ``_shared_ffn``); also its SwiGLU output (1, n_ff)."""
    act, out = torch.empty(1, (w_in.n_out - 1) // 2), torch.empty_like(h)
    _shared_ffn(
        _vec(x),
        w_in.data,
        w_in.index,
        w_down.data,
        w_down.index,
        _vec(h),
        act.numpy()[0],
        out.numpy()[0],
        w_in.acts or w_down.acts,
    )
    return out, act


def cached_on_disk() -> bool:
    """Every kernel has an up-to-date compiled copy in numba's disk cache (False: the next use compiles)."""
    kernels = (
        _gemv_serial,
        _gemv_parallel,
        _norm_gemv,
        _decode_rows_into,
        _routed_ffn,
        _routed_ffn_encoded,
        _routed_ffn_batch,
        _attention_step,
        _deltanet_step,
        _shared_ffn,
    )
    try:
        source = os.path.getmtime(__file__)
        return all(os.path.getmtime(k._cache._cache_file._index_path) >= source for k in kernels)
    except (AttributeError, OSError):  # numba's cache internals moved, or no index yet
        return False


def warm_up() -> None:
    """Load (or, after an install, compile) every kernel now, so that no decode step pays for it: each for
    float32 rows and for encoded rows (here float32 bytes, type 0, which compile the same code)."""
    one = torch.ones(1, 64)
    ids, weights = torch.tensor([1, 0]), torch.full((2,), 0.5)
    routed_ffn(one, ids, weights, np.ones((4, 64, 64), np.float32), np.ones((4, 64, 32), np.float32), one)
    kv = torch.zeros(1, 2, 32)
    for encoded in (False, True):

        def m(*shape: int, encoded: bool = encoded) -> Rows:
            if encoded:  # float32 values as bytes (type 0): n_in * 4 bytes a row
                return Rows.encoded_parts([(np.zeros((*shape[:-1], 4 * shape[-1]), np.uint8), 0)])
            return Rows.floats(np.ones(shape, np.float32))

        gemv(one, m(64, 64))
        gemv(one, m(PARALLEL_MIN // 64, 64), torch.ones(1, PARALLEL_MIN // 64))
        norm_gemv(one, np.ones(64, np.float32), 1e-6, m(64, 64))
        product(torch.ones(2, 64), m(64, 64))
        attention_step(
            one, one[0], 1e-6, m(4 * 32, 64), 2, 0, np.ones((3, 32), np.float32),
            (torch.ones(16), torch.zeros(16)), kv, kv.clone(), 0, m(64, 64),
        )  # fmt: skip
        deltanet_step(
            one, one[0], 1e-6, m(4 * 16 + 2, 64), 1, torch.zeros(3, 48), np.ones((4, 48), np.float32),
            torch.zeros(1), -torch.ones(1), torch.ones(16), torch.zeros(1, 16, 16), m(64, 16),
        )  # fmt: skip
        shared_ffn(one, m(65, 64), m(64, 32), one)
    experts = np.zeros((4, 64, 256), np.uint8)  # float32 rows (type 0) of 64 values
    encoded = EncodedExperts(experts, 0, experts, 0, experts, 0)
    routed_ffn_encoded(one, ids, weights, encoded, one)
    batch = torch.ones(2, 64)
    routed_ffn_batch(
        batch, ids, torch.tensor([0, 1, 2]), encoded, None, torch.empty(2, 64), torch.empty(2, 64)
    )
