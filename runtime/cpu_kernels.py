"""Compiled (numba) one-token kernels for the CPU decode path: matrix-vector products over row-major
float32 weights, RMSNorm folded into them, and the routed-expert FFN with its top-k routing.

For one input row, torch's CPU matmul runs these shapes on one core well below memory speed (a 256 x 512
product took 56 us inside the model, i.e. 9 GB/s); these kernels read each weight row once as a
vectorized dot product, spread over the threads for the larger matrices (28 GB/s here on 2 cores).
Dot products may be reassociated (vectorized) by the compiler: results differ from torch's matmul in
the last bits only (the decode tests hold the step path to the batch path at 1e-4 of the logit scale).
Used when the device is the CPU and numba is enabled (``FORGE_NO_NUMBA`` unset), see ``available``.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import config as numba_config
from numba import get_num_threads, njit, prange, set_num_threads

from forge.quant.kernels import enabled as numba_enabled

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


@njit(fastmath=_FASTMATH, nogil=True, cache=True)
def _gemv_serial(x: np.ndarray, w: np.ndarray, res: np.ndarray, has_res: bool, out: np.ndarray) -> None:
    for r in range(w.shape[0]):
        out[r] = _dot(w[r], x) + res[r] if has_res else _dot(w[r], x)


@njit(fastmath=_FASTMATH, nogil=True, cache=True, parallel=True)
def _gemv_parallel(x: np.ndarray, w: np.ndarray, res: np.ndarray, has_res: bool, out: np.ndarray) -> None:
    for r in prange(w.shape[0]):
        out[r] = _dot(w[r], x) + res[r] if has_res else _dot(w[r], x)


@njit(fastmath=_FASTMATH, nogil=True, cache=True)
def _norm_gemv_serial(
    h: np.ndarray, norm: np.ndarray, eps: float, w: np.ndarray, xn: np.ndarray, out: np.ndarray
) -> None:
    _rms_norm(h, norm, eps, xn)
    for r in range(w.shape[0]):
        out[r] = _dot(w[r], xn)


@njit(fastmath=_FASTMATH, nogil=True, cache=True, parallel=True)
def _norm_gemv_parallel(
    h: np.ndarray, norm: np.ndarray, eps: float, w: np.ndarray, xn: np.ndarray, out: np.ndarray
) -> None:
    _rms_norm(h, norm, eps, xn)
    for r in prange(w.shape[0]):
        out[r] = _dot(w[r], xn)


@njit(fastmath=_FASTMATH, nogil=True, cache=True, parallel=True)
def _routed_ffn(
    x: np.ndarray,
    logits: np.ndarray,
    gate_up: np.ndarray,
    down: np.ndarray,
    h: np.ndarray,
    ids: np.ndarray,
    weights: np.ndarray,
    act: np.ndarray,
    out: np.ndarray,
) -> None:
    """out = h + sum_i weights[i] * down[ids[i]] @ (silu(gate) * up), gate|up = gate_up[ids[i]] @ x.

    ids/weights: the top-k of ``logits`` (descending, first index on ties, like torch.topk) and the softmax
    of those logits; k = ids.shape[0]. act (k, n_ff) receives the SwiGLU outputs.
    """
    k, n_ff = act.shape
    taken = np.zeros(logits.shape[0], np.bool_)
    for i in range(k):
        best = -1
        for e in range(logits.shape[0]):
            if not taken[e] and (best < 0 or logits[e] > logits[best]):
                best = e
        taken[best] = True
        ids[i] = best
    total = np.float32(0)
    for i in range(k):
        weights[i] = np.exp(logits[ids[i]] - logits[ids[0]])
        total += weights[i]
    for i in range(k):
        weights[i] /= total
    for r in prange(k * n_ff):
        i = r // n_ff
        f = r - i * n_ff
        e = ids[i]
        g = _dot(gate_up[e, f], x)
        act[i, f] = g / (np.float32(1) + np.exp(-g)) * _dot(gate_up[e, n_ff + f], x)
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
    n_head: int,
    n_gate: int,
    qk_norm: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    pos: int,
    w_out: np.ndarray,
    x: np.ndarray,
    att: np.ndarray,
    out: np.ndarray,
) -> None:
    """out = h + attention of one token at ``pos`` (its k and v written to keys/values[:, pos]); x receives
    the normed h, att the attention (the projections' inputs).

    w_in's rows: q heads, k heads, n_gate output-gate rows, v heads; qk_norm: the q and k heads' RMSNorm
    weights (q's carrying the score scale); NEOX RoPE over the first 2 * len(cos) dims of each head.
    """
    n_kv, _, head_dim = keys.shape
    _rms_norm(h, norm, eps, x)
    y = np.empty(w_in.shape[0], np.float32)
    for r in prange(w_in.shape[0]):
        y[r] = _dot(w_in[r], x)
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
    for r in prange(w_out.shape[0]):
        out[r] = h[r] + _dot(w_out[r], att)


def _vec(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy().reshape(-1)


def gemv(x: torch.Tensor, w: np.ndarray, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x (1, n_in) float32 -> (1, n_out): x @ w.T (+ residual (1, n_out)); w (n_out, n_in) C-contiguous."""
    out = torch.empty(1, w.shape[0])
    o = out.numpy()[0]
    res = o if residual is None else _vec(residual)
    kernel = _gemv_parallel if w.size >= PARALLEL_MIN else _gemv_serial
    kernel(_vec(x), w, res, residual is not None, o)
    return out


def norm_gemv(
    h: torch.Tensor, norm: np.ndarray, eps: float, w: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """h (1, n) -> (rms_norm(h) * norm, that @ w.T), both (1, .)."""
    xn, out = torch.empty(1, h.shape[-1]), torch.empty(1, w.shape[0])
    kernel = _norm_gemv_parallel if w.size >= PARALLEL_MIN else _norm_gemv_serial
    kernel(_vec(h), norm, eps, w, xn.numpy()[0], out.numpy()[0])
    return xn, out


def routed_ffn(
    x: torch.Tensor, logits: torch.Tensor, k: int, gate_up: np.ndarray, down: np.ndarray, h: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """h + the top-k routed experts' SwiGLU output for one token x (1, n_embd); logits (1, n_expert).

    gate_up: (n_expert, 2 n_ff, n_embd) with the gate rows first; down: (n_expert, n_embd, n_ff).
    Returns that (1, n_embd), the expert ids (k,), their weights (k,) and SwiGLU outputs (k, n_ff).
    """
    ids, weights = torch.empty(k, dtype=torch.int64), torch.empty(k)
    act, out = torch.empty(k, down.shape[2]), torch.empty(1, h.shape[-1])
    _routed_ffn(
        _vec(x),
        _vec(logits),
        gate_up,
        down,
        _vec(h),
        ids.numpy(),
        weights.numpy(),
        act.numpy(),
        out.numpy()[0],
    )
    return out, ids, weights, act


def attention_step(
    h: torch.Tensor,
    norm: torch.Tensor,
    eps: float,
    w_in: np.ndarray,
    n_head: int,
    n_gate: int,
    qk_norm: np.ndarray,
    rope: tuple[torch.Tensor, torch.Tensor],
    keys: torch.Tensor,
    values: torch.Tensor,
    pos: int,
    w_out: np.ndarray,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h (1, n_embd) + the attention block's output for the token at ``pos`` (see ``_attention_step``);
    rope: that position's (cos, sin) rows; keys/values: the (n_kv, capacity, head_dim) cache, written at pos.
    Returns that, and the inputs of the two projections: the normed h (1, n_embd), the attention (1, n_head * d).
    """
    out, x = torch.empty_like(h), torch.empty_like(h)
    att = torch.empty(1, w_out.shape[1])
    cos, sin = rope
    _attention_step(
        _vec(h), _vec(norm), eps, w_in, n_head, n_gate, qk_norm, cos.numpy(), sin.numpy(),
        keys.numpy(), values.numpy(), pos, w_out, x.numpy()[0], att.numpy()[0], out.numpy()[0],
    )  # fmt: skip
    return out, x, att
