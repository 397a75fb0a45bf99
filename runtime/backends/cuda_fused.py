"""Triton kernels for the elementwise and reduction work of a one-token decode step on CUDA.

A decode step's products are few (``cuda_kernels``); its norms, convolutions, recurrences, routing and
sums were dozens of tiny torch launches per layer, each costing a few microseconds even inside a CUDA
graph. Each function here is one launch for what torch did in many, computing the same formulas in
float32 (only the order of the additions in a sum differs):

    rms_norm_row(x, w, eps)                       one row's RMSNorm (eps a device tensor)
    softmax_top_k(logits, k)                      Qwen's routing: top-k ids, softmax of their logits
    swiglu(gate, up)                              SiLU(gate) * up, row by row
    weighted_sum(y, w, residual)                  residual + sum_k w[k] * y[k]   (the routed experts' output)
    gated_add(h, y, gate)                         h + sigmoid(gate) * y          (the shared expert's output)
    deltanet_conv(mixed, conv, conv_rows, ...)    causal conv + SiLU + q/k L2 norm, conv state shifted in place
    deltanet_rule(qkv, z, beta, alpha, ...)       gated delta rule + gated RMSNorm, recurrent state in place
    attention_qk(y, ...), attention_decode(...)   q/k RMSNorm + RoPE + the KV cache write; attention of one query

Every function takes CUDA tensors (or CPU tensors under TRITON_INTERPRET=1, for checking on a machine
without a GPU) and never waits for the device, so a decode step built from them can be captured.
"""

from __future__ import annotations

import os

import torch

from runtime.backends.triton_launch import launch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - machines without triton
    triton = None
    tl = None


def available(x: torch.Tensor) -> bool:
    """These kernels run for ``x``'s device: CUDA with triton (FORGE_CUDA_FUSED=0 turns them off)."""
    if triton is None or os.environ.get("FORGE_CUDA_FUSED") == "0":
        return False
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def use_attention_prefill(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether attention_prefill takes a prefill's attention: opt-in (FORGE_CUDA_PREFILL_ATTENTION=1). On the
    H200 it agrees with torch's SDPA but is slower than its float32 math path (207 against 165 us of GPU time
    a layer at 512 tokens x 16 heads x 256 values)."""
    return (
        os.environ.get("FORGE_CUDA_PREFILL_ATTENTION") == "1"
        and available(q)
        and q.dtype == torch.float32
        and q.shape[-1] in (64, 128, 256)
        and k.stride(-1) == 1
    )


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


if triton is not None:

    @triton.jit
    def _float32_dot(a, b, acc, INTERP: tl.constexpr):
        """a @ b + acc, float32-accurate: tf32x3 on tensor cores (float32 products under the interpreter)."""
        if INTERP:
            return tl.dot(a, b, acc, input_precision="ieee")
        return tl.dot(a, b, acc, input_precision="tf32x3")

    @triton.jit
    def _silu(x):
        return x / (1.0 + tl.exp(-x))

    @triton.jit
    def _sigmoid(x):
        return 1.0 / (1.0 + tl.exp(-x))

    @triton.jit
    def _rms_norm_kernel(x, w, out, N, eps, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        m = i < N
        v = tl.load(x + i, mask=m, other=0.0)
        r = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / N + tl.load(eps))
        tl.store(out + i, v * tl.load(w + i, mask=m, other=0.0) * r, mask=m)

    @triton.jit
    def _top_k_kernel(logits, ids, weights, E, stride, K: tl.constexpr, BLOCK: tl.constexpr):
        """One row per program: the K largest logits (first index on ties), descending, and the softmax
        over them."""
        row = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK)
        v = tl.load(logits + row * stride + e, mask=e < E, other=float("-inf"))
        kk = tl.arange(0, K)
        top = tl.zeros([K], dtype=tl.float32)
        idx = tl.zeros([K], dtype=tl.int64)
        for j in tl.static_range(K):
            best = tl.max(v, axis=0)
            pick = tl.min(tl.where(v == best, e, BLOCK), axis=0)
            top = tl.where(kk == j, best, top)
            idx = tl.where(kk == j, pick.to(tl.int64), idx)
            v = tl.where(e == pick, float("-inf"), v)
        p = tl.exp(top - tl.max(top, axis=0))
        tl.store(ids + row * K + kk, idx)
        tl.store(weights + row * K + kk, p / tl.sum(p, axis=0))

    @triton.jit
    def _swiglu_kernel(gate, up, out, N, s_gate, s_up, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = i < N
        g = tl.load(gate + row * s_gate + i, mask=m, other=0.0)
        u = tl.load(up + row * s_up + i, mask=m, other=0.0)
        tl.store(out + row * N + i, _silu(g) * u, mask=m)

    @triton.jit
    def _weighted_sum_kernel(y, w, res, out, N, K: tl.constexpr, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        """y (T, K, N), w (T, K) -> out (T, N) = res + sum_k w y; program (token, column block)."""
        t = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = i < N
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k in tl.static_range(K):
            acc += tl.load(w + t * K + k) * tl.load(y + (t * K + k) * N + i, mask=m, other=0.0)
        if HAS_RES:
            acc = tl.load(res + t * N + i, mask=m, other=0.0) + acc
        tl.store(out + t * N + i, acc, mask=m)

    @triton.jit
    def _gated_add_kernel(h, y, gate, out, N, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < N
        s = _sigmoid(tl.load(gate))
        tl.store(out + i, tl.load(h + i, mask=m, other=0.0) + s * tl.load(y + i, mask=m, other=0.0), mask=m)

    @triton.jit
    def _deltanet_conv_kernel(
        mixed, conv, conv_rows, out, qk_scale, eps, C, QK_GROUPS, KW: tl.constexpr, KP: tl.constexpr,
        D: tl.constexpr,
    ):  # fmt: skip
        """Program p: channels p*D .. p*D+D-1 (one q/k head for p < QK_GROUPS). The window is the KW-1
        state rows and the new input; the state shifts by one row (only this program owns these channels)."""
        p = tl.program_id(0)
        c = p * D + tl.arange(0, D)
        r = tl.arange(0, KP)[:, None]
        state = tl.load(conv + r * C + c[None, :], mask=r < KW - 1, other=0.0)
        new = tl.load(mixed + c)
        window = tl.where(r == KW - 1, new[None, :], state)
        wk = tl.load(conv_rows + r * C + c[None, :], mask=r < KW, other=0.0)
        v = _silu(tl.sum(window * wk, axis=0))
        if p < QK_GROUPS:
            norm = tl.maximum(tl.sqrt(tl.sum(v * v, axis=0)), eps)
            v = v * (tl.load(qk_scale + p) / norm)
        tl.store(out + c, v)
        # shift: row j <- row j + 1 (the last row <- the new input), every row read before any is written
        nxt = tl.load(conv + (r + 1) * C + c[None, :], mask=r < KW - 2, other=0.0)
        nxt = tl.where(r == KW - 2, new[None, :], nxt)
        tl.debug_barrier()
        tl.store(conv + r * C + c[None, :], nxt, mask=r < KW - 1)

    @triton.jit
    def _deltanet_rule_kernel(
        qkv, z, beta, alpha, dt_bias, a, state, norm, out, eps, N_K, KEY_DIM,
        DK: tl.constexpr, DV: tl.constexpr,
    ):  # fmt: skip
        """Program h: value head h (key head h % N_K): S <- exp(g) S; delta = sigmoid(beta) (v - S^T k);
        S <- S + k delta^T; o = S^T q, then RMSNorm(o) * norm * SiLU(z)."""
        h = tl.program_id(0)
        kh = h % N_K
        dk = tl.arange(0, DK)
        dv = tl.arange(0, DV)
        q = tl.load(qkv + kh * DK + dk)
        k = tl.load(qkv + KEY_DIM + kh * DK + dk)
        v = tl.load(qkv + 2 * KEY_DIM + h * DV + dv)
        x = tl.load(alpha + h) + tl.load(dt_bias + h)
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        decay = tl.exp(softplus * tl.load(a + h))
        b = _sigmoid(tl.load(beta + h))
        base = h.to(tl.int64) * DK * DV
        ptr = state + base + dk[:, None] * DV + dv[None, :]
        s = tl.load(ptr) * decay
        delta = (v - tl.sum(k[:, None] * s, axis=0)) * b
        s = s + k[:, None] * delta[None, :]
        tl.store(ptr, s)
        o = tl.sum(q[:, None] * s, axis=0)
        r = 1.0 / tl.sqrt(tl.sum(o * o, axis=0) / DV + eps)
        zz = tl.load(z + h * DV + dv)
        tl.store(out + h * DV + dv, o * r * tl.load(norm + dv) * _silu(zz))

    # the position and the cache's capacity vary from call to call: not specialized (no recompiles)
    @triton.jit(do_not_specialize=["pos", "cap"])
    def _attention_qk_kernel(
        y, qk_norm, cos_rows, sin_rows, partner, q_out, keys, values, at, pos, cap, eps, N_HEAD, N_KV,
        V_OFF, HAS_AT: tl.constexpr, HD: tl.constexpr,
    ):  # fmt: skip
        """Program i < N_HEAD: q head i normed and rotated into q_out; then the N_KV k heads normed, rotated
        and written at the position's cache slot; then the N_KV v heads copied there."""
        i = tl.program_id(0)
        d = tl.arange(0, HD)
        p = tl.load(at).to(tl.int64) if HAS_AT else pos.to(tl.int64)
        if i < N_HEAD + N_KV:
            x = tl.load(y + i * HD + d)
            part = tl.load(partner + d)
            xp = tl.load(y + i * HD + part)
            r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / HD + eps)
            xn = x * tl.load(qk_norm + i * HD + d) * r
            xpn = xp * tl.load(qk_norm + i * HD + part) * r
            rot = xn * tl.load(cos_rows + p * HD + d) + xpn * tl.load(sin_rows + p * HD + d)
            if i < N_HEAD:
                tl.store(q_out + i * HD + d, rot)
            else:
                tl.store(keys + ((i - N_HEAD) * cap + p) * HD + d, rot)
        else:
            j = i - N_HEAD - N_KV
            tl.store(values + (j * cap + p) * HD + d, tl.load(y + V_OFF + j * HD + d))

    @triton.jit(do_not_specialize=["pos", "cap"])
    def _attention_decode_kernel(
        q, keys, values, gate, out, at, pos, cap, REP, HAS_AT: tl.constexpr, HAS_GATE: tl.constexpr,
        HD: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """Program h: query head h over its KV head's slots 0..position (online softmax; the scale is in q)."""
        h = tl.program_id(0)
        kv = (h // REP).to(tl.int64)
        d = tl.arange(0, HD)
        j = tl.arange(0, BLOCK)
        p = tl.load(at).to(tl.int64) if HAS_AT else pos.to(tl.int64)
        qv = tl.load(q + h * HD + d)
        m_i = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
        l_i = tl.sum(tl.zeros([BLOCK], dtype=tl.float32), axis=0)
        acc = tl.zeros([HD], dtype=tl.float32)
        for j0 in range(0, p + 1, BLOCK):
            slot = j0 + j
            valid = slot <= p
            rows = (kv * cap + slot)[:, None] * HD + d[None, :]
            kt = tl.load(keys + rows, mask=valid[:, None], other=0.0)
            s = tl.where(valid, tl.sum(kt * qv[None, :], axis=1), float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp(m_i - m_new)
            e = tl.exp(s - m_new)
            vt = tl.load(values + rows, mask=valid[:, None], other=0.0)
            acc = acc * alpha + tl.sum(e[:, None] * vt, axis=0)
            l_i = l_i * alpha + tl.sum(e, axis=0)
            m_i = m_new
        o = acc / l_i
        if HAS_GATE:
            o = o * _sigmoid(tl.load(gate + h * HD + d))
        tl.store(out + h * HD + d, o)

    @triton.jit(do_not_specialize=["T", "S", "pos0"])
    def _attention_prefill_kernel(
        q, keys, values, out, T, S, pos0, sk_h, sk_s, sv_h, sv_s, scale, REP, HD: tl.constexpr, BM: tl.constexpr,
        BN: tl.constexpr, DC: tl.constexpr, INTERP: tl.constexpr,
    ):  # fmt: skip
        """Program (m, h, j): output values j DC .. j DC + DC - 1 of query rows m BM .. m BM + BM - 1 of head h
        (at positions pos0 + row) over its KV head's keys up to each row's position, online softmax. The
        scores take HD in chunks of DC; each program of a row block computes them again (registers, not
        FLOPs, bound a head of 256 values)."""
        h = tl.program_id(1)
        n_head = tl.num_programs(1)
        kv = (h // REP).to(tl.int64)
        r = tl.program_id(0) * BM + tl.arange(0, BM)
        dc = tl.arange(0, DC)
        qrow = (r.to(tl.int64) * n_head + h) * HD
        pos = pos0 + r
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], dtype=tl.float32)
        acc = tl.zeros([BM, DC], dtype=tl.float32)
        dv = tl.program_id(2) * DC + dc
        for s0 in range(0, tl.minimum(pos0 + tl.program_id(0) * BM + BM, S), BN):
            c = s0 + tl.arange(0, BN)
            krow = kv * sk_h + c.to(tl.int64) * sk_s
            s = tl.zeros([BM, BN], dtype=tl.float32)
            for j in tl.static_range(HD // DC):
                qt = tl.load(q + qrow[:, None] + j * DC + dc[None, :], mask=(r < T)[:, None], other=0.0)
                kt = tl.load(keys + krow[:, None] + j * DC + dc[None, :], mask=(c < S)[:, None], other=0.0)
                s = _float32_dot(qt, tl.trans(kt), s, INTERP)
            s = tl.where((c[None, :] <= pos[:, None]) & (c < S)[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            e = tl.exp(s - m_new[:, None])
            vrow = kv * sv_h + c.to(tl.int64) * sv_s
            vt = tl.load(values + vrow[:, None] + dv[None, :], mask=(c < S)[:, None], other=0.0)
            acc = _float32_dot(e, vt, acc * alpha[:, None], INTERP)
            l_i = l_i * alpha + tl.sum(e, axis=1)
            m_i = m_new
        tl.store(out + qrow[:, None] + dv[None, :], acc / l_i[:, None], mask=(r < T)[:, None])


def rms_norm_row(x: torch.Tensor, w: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """x (1, n) -> x * w / sqrt(mean(x^2) + eps); eps a one-value tensor on x's device."""
    out = torch.empty_like(x)
    n = x.shape[-1]
    launch(_rms_norm_kernel, (1,), x, w, out, n, eps, BLOCK=_pow2(n), num_warps=4 if n <= 4096 else 8)
    return out


def softmax_top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (T, E) float32 -> ids (T, k) int64 (descending logits, first index on ties) and the softmax
    of those k logits, float32."""
    t, e = logits.shape
    ids = torch.empty((t, k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((t, k), dtype=torch.float32, device=logits.device)
    launch(
        _top_k_kernel,
        (t,),
        logits,
        ids,
        weights,
        e,
        logits.stride(0),
        K=k,
        BLOCK=_pow2(max(e, k)),
        num_warps=4,
    )
    return ids, weights


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up (..., N) with the same leading shape (rows may be strided views of one tensor) ->
    SiLU(gate) * up, contiguous float32 (..., N)."""
    n = gate.shape[-1]
    lead = gate.shape[:-1]
    g2, u2 = gate.reshape(-1, n), up.reshape(-1, n)
    out = torch.empty((g2.shape[0], n), dtype=torch.float32, device=gate.device)
    block = min(1024, _pow2(n))
    launch(
        _swiglu_kernel, (g2.shape[0], -(-n // block)), g2, u2, out, n, g2.stride(0), u2.stride(0), BLOCK=block
    )
    return out.view(*lead, n)


def weighted_sum(y: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """y (T, K, N) float32, w (T, K) -> (T, N) = residual + sum over k of w[:, k] * y[:, k]."""
    t, k, n = y.shape
    out = torch.empty((t, n), dtype=torch.float32, device=y.device)
    w = w.to(torch.float32).contiguous()
    res = residual.contiguous() if residual is not None else out
    block = min(1024, _pow2(n))
    launch(
        _weighted_sum_kernel,
        (t, -(-n // block)),
        y.contiguous(),
        w,
        res,
        out,
        n,
        K=k,
        HAS_RES=residual is not None,
        BLOCK=block,
    )
    return out


def gated_add(h: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """One row: h + sigmoid(gate) * y, gate a one-value tensor."""
    out = torch.empty_like(h)
    n = h.shape[-1]
    block = min(1024, _pow2(n))
    launch(_gated_add_kernel, (-(-n // block),), h, y, gate, out, n, BLOCK=block)
    return out


def deltanet_conv(
    mixed: torch.Tensor,
    conv: torch.Tensor,
    conv_rows: torch.Tensor,
    qk_scale: torch.Tensor,
    qk_groups: int,
    group: int,
    eps: float,
) -> torch.Tensor:
    """One token of the DeltaNet's causal depthwise conv. mixed (C,) the new input, conv (KW-1, C) the state
    (shifted in place), conv_rows (KW, C) -> SiLU(conv) (C,), its first ``qk_groups`` groups of ``group``
    channels (the q and k heads) L2-normalized and scaled by ``qk_scale`` (qk_groups,)."""
    kw, c = conv_rows.shape
    out = torch.empty(c, dtype=torch.float32, device=mixed.device)
    launch(
        _deltanet_conv_kernel,
        (c // group,),
        mixed,
        conv,
        conv_rows,
        out,
        qk_scale,
        eps,
        c,
        qk_groups,
        KW=kw,
        KP=_pow2(kw),
        D=group,
        num_warps=2,
    )
    return out


def deltanet_rule(
    qkv: torch.Tensor,
    z: torch.Tensor,
    beta: torch.Tensor,
    alpha: torch.Tensor,
    dt_bias: torch.Tensor,
    a: torch.Tensor,
    state: torch.Tensor,
    norm: torch.Tensor,
    n_k: int,
    eps: float,
) -> torch.Tensor:
    """One token of the gated delta rule. qkv (C,) from ``deltanet_conv``; state (H, DK, DV) updated in
    place -> RMSNorm(o) * norm * SiLU(z), (1, H * DV)."""
    n_v, dk, dv = state.shape
    out = torch.empty((1, n_v * dv), dtype=torch.float32, device=qkv.device)
    launch(_deltanet_rule_kernel, (n_v,),
        qkv, z, beta, alpha, dt_bias, a, state, norm, out, eps, n_k, n_k * dk, DK=dk, DV=dv,
        num_warps=4 if dk * dv <= 8192 else 8,
    )  # fmt: skip
    return out


def attention_qk(
    y: torch.Tensor,
    qk_norm: torch.Tensor,
    cos_rows: torch.Tensor,
    sin_rows: torch.Tensor,
    partner: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    at: torch.Tensor | None,
    pos: int,
    n_head: int,
    v_offset: int,
    eps: float,
) -> torch.Tensor:
    """y: one token's projection row [q heads, k heads, (gate heads), v heads]; q/k heads RMSNormed by
    ``qk_norm`` (n_head + n_kv, hd) and rotated (rows ``x * cos + x[partner] * sin`` at the position); k and v
    written to the caches (n_kv, cap, hd) at the position (``at`` on the device, else ``pos``) -> q (n_head, hd)."""
    n_kv, cap, hd = keys.shape
    q = torch.empty((n_head, hd), dtype=torch.float32, device=y.device)
    launch(_attention_qk_kernel, (n_head + 2 * n_kv,),
        y, qk_norm, cos_rows, sin_rows, partner, q, keys, values, at if at is not None else q, pos, cap, eps,
        n_head, n_kv, v_offset, HAS_AT=at is not None, HD=hd, num_warps=2 if hd <= 128 else 4,
    )  # fmt: skip
    return q


def attention_decode(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    at: torch.Tensor | None,
    pos: int,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query row per head, q (n_head, hd) already scaled, over cache slots 0..position -> (1, n_head * hd),
    times sigmoid(gate) when a (n_head * hd,) gate is given."""
    n_head, hd = q.shape
    n_kv, cap, _ = keys.shape
    out = torch.empty((1, n_head * hd), dtype=torch.float32, device=q.device)
    block = 32 if hd > 128 else 64
    launch(_attention_decode_kernel, (n_head,),
        q, keys, values, gate if gate is not None else q, out, at if at is not None else q, pos, cap,
        n_head // n_kv, HAS_AT=at is not None, HAS_GATE=gate is not None, HD=hd, BLOCK=block, num_warps=4,
    )  # fmt: skip
    return out


# attention_prefill's tiles: query rows a program, keys a step, output values a program (a head's values split
# across programs), warps, pipeline stages
ATTENTION_CONFIG = {"bm": 32, "bn": 32, "dc": 64, "warps": 4, "stages": 2}


def attention_prefill(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos0: int) -> torch.Tensor:
    """Causal GQA attention of T query rows, q (T, H, D) float32 at positions pos0.., over keys / values
    (Hkv, >= pos0 + T, D) (strided slots allowed) -> (T, H * D): scores and weighted sums on tf32x3 (float32
    accurate), online softmax; no repeated KV heads, no mask tensor."""
    t, n_head, hd = q.shape
    n_kv = keys.shape[0]
    q = q.contiguous()
    out = torch.empty((t, n_head * hd), dtype=torch.float32, device=q.device)
    c = ATTENTION_CONFIG
    bm, bn, dc = c["bm"], c["bn"], min(hd, c["dc"])
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    launch(_attention_prefill_kernel, (-(-t // bm), n_head, hd // dc),
        q, keys, values, out, t, pos0 + t, pos0, keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        hd**-0.5, n_head // n_kv, HD=hd, BM=bm, BN=bn, DC=dc, INTERP=interp, num_warps=c["warps"],
        num_stages=c["stages"],
    )  # fmt: skip
    return out
