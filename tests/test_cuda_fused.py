"""The decode step's fused Triton kernels (``runtime.backends.cuda_fused``) against the torch formulas they
replace. Marked ``gpu``: they run on CUDA; with TRITON_INTERPRET=1 and triton installed they also run on
the CPU through Triton's interpreter (how they were checked on a machine without a GPU)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from runtime.backends import cuda_fused
from runtime.layers import l2_normalize
from runtime.moe import softmax_top_k

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and cuda_fused.triton is not None
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        cuda_fused.triton is None or not (torch.cuda.is_available() or INTERPRET),
        reason="needs CUDA and triton",
    ),
]


def _rand(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE)


def _close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> None:
    scale = b.abs().max().clamp_min(1e-6)
    assert (a - b).abs().max() <= rel * scale, float((a - b).abs().max() / scale)


def test_rms_norm_row() -> None:
    x, w = _rand(1, 2048), _rand(2048, seed=1)
    eps = torch.full((1, 1), 1e-6, device=DEVICE)
    _close(cuda_fused.rms_norm_row(x, w, eps), F.rms_norm(x, (2048,), w, 1e-6))


@pytest.mark.parametrize("experts,k", [(256, 8), (128, 8), (60, 4), (8, 2)])
def test_softmax_top_k_matches_torch(experts: int, k: int) -> None:
    logits = _rand(3, experts, seed=experts)
    logits[1, : experts // 2] = -1e30  # pruned experts
    ids, w = cuda_fused.softmax_top_k(logits, k)
    ref_ids, ref_w = softmax_top_k(logits, k)
    assert torch.equal(ids, ref_ids)
    _close(w, ref_w)


def test_top_k_takes_the_first_index_on_ties() -> None:
    logits = torch.zeros(1, 16, device=DEVICE)
    logits[0, [3, 9]] = 1.0
    ids, w = cuda_fused.softmax_top_k(logits, 4)
    assert ids[0].tolist() == [3, 9, 0, 1]
    _close(w.sum(-1), torch.ones(1, device=DEVICE))


def test_swiglu_weighted_sum_gated_add() -> None:
    gu = _rand(8, 2, 96)
    _close(cuda_fused.swiglu(gu[:, 0], gu[:, 1]), F.silu(gu[:, 0]) * gu[:, 1])
    y, w, h = _rand(2, 8, 300, seed=2), _rand(2, 8, seed=3).softmax(-1), _rand(2, 300, seed=4)
    _close(cuda_fused.weighted_sum(y, w, h), h + (y * w[..., None]).sum(1))
    _close(cuda_fused.weighted_sum(y, w), (y * w[..., None]).sum(1))
    g = _rand(1, seed=5)
    _close(cuda_fused.gated_add(h[:1], y[0, :1], g), h[:1] + torch.sigmoid(g) * y[0, :1])


def _deltanet_reference(mixed, conv, conv_rows, z, beta, alpha, dt_bias, a, state, norm, n_k, dk, eps):
    """The torch one-token DeltaNet step (runtime.layers.GatedDeltaNet.step's formulas)."""
    n_v, _, dv = state.shape
    window = torch.cat([conv, mixed[None]])
    conv_new = window[1:].clone()
    out = F.silu((window * conv_rows).sum(0))
    key_dim = n_k * dk
    q = l2_normalize(out[:key_dim].view(n_k, dk), eps) * dk**-0.5
    k = l2_normalize(out[key_dim : 2 * key_dim].view(n_k, dk), eps)
    rep = n_v // n_k
    q, k = q.repeat(rep, 1), k.repeat(rep, 1)
    v = out[2 * key_dim :].view(n_v, dv)
    g = F.softplus(alpha + dt_bias) * a
    s = state * torch.exp(g)[:, None, None]
    delta = (v - torch.einsum("hk,hkv->hv", k, s)) * torch.sigmoid(beta)[:, None]
    s = s + k[:, :, None] * delta[:, None, :]
    o = torch.einsum("hk,hkv->hv", q, s)
    o = F.rms_norm(o, (dv,), norm, eps) * F.silu(z.view(n_v, dv))
    return o.view(1, -1), conv_new, s


@pytest.mark.parametrize("n_k,n_v,dk", [(2, 4, 32), (4, 4, 16)])
def test_deltanet_step_matches_torch(n_k: int, n_v: int, dk: int) -> None:
    dv, kw, eps = dk, 4, 1e-6
    c = 2 * n_k * dk + n_v * dv
    mixed, conv, conv_rows = _rand(c, seed=1), _rand(kw - 1, c, seed=2), _rand(kw, c, seed=3, scale=0.5)
    z, beta, alpha = _rand(n_v * dv, seed=4), _rand(n_v, seed=5), _rand(n_v, seed=6)
    dt_bias, a = _rand(n_v, seed=7), -_rand(n_v, seed=8).abs()
    state, norm = _rand(n_v, dk, dv, seed=9, scale=0.1), _rand(dv, seed=10)
    ref_o, ref_conv, ref_state = _deltanet_reference(
        mixed, conv, conv_rows, z, beta, alpha, dt_bias, a, state, norm, n_k, dk, eps
    )
    qk_scale = torch.cat([torch.full((n_k,), dk**-0.5), torch.ones(n_k)]).to(DEVICE)
    qkv = cuda_fused.deltanet_conv(mixed, conv, conv_rows, qk_scale, 2 * n_k, dk, eps)
    o = cuda_fused.deltanet_rule(qkv, z, beta, alpha, dt_bias, a, state, norm, n_k, eps)
    _close(conv, ref_conv, 0)
    _close(state, ref_state)
    _close(o, ref_o, 1e-4)


@pytest.mark.parametrize("gated", [False, True])
def test_attention_step_matches_torch(gated: bool) -> None:
    n_head, n_kv, hd, cap, pos, eps = 4, 2, 64, 32, 9, 1e-6
    parts = [n_head * hd, n_kv * hd, n_head * hd if gated else 0, n_kv * hd]
    y = _rand(sum(parts), seed=1)
    qk_norm = _rand(n_head + n_kv, hd, seed=2)
    keys, values = _rand(n_kv, cap, hd, seed=3), _rand(n_kv, cap, hd, seed=4)
    half = hd // 2
    partner = torch.arange(hd)
    partner[:half] += half
    partner[half:] -= half
    ang = torch.arange(cap)[:, None] * (10000.0 ** (-torch.arange(half) / half))[None]
    cos_rows = torch.cat([ang.cos(), ang.cos()], -1).to(DEVICE)
    sin_rows = torch.cat([-ang.sin(), ang.sin()], -1).to(DEVICE)
    partner = partner.to(DEVICE)
    at = torch.tensor([pos], device=DEVICE)

    qk = y[: parts[0] + parts[1]].view(n_head + n_kv, hd)
    qk = F.rms_norm(qk, (hd,), None, eps) * qk_norm
    qk = qk * cos_rows[pos] + qk[:, partner] * sin_rows[pos]
    v = y[sum(parts[:3]) :].view(n_kv, hd)
    ref_keys, ref_values = keys.clone(), values.clone()
    ref_keys[:, pos], ref_values[:, pos] = qk[n_head:], v
    q = qk[:n_head].view(n_kv, n_head // n_kv, hd)
    att = torch.softmax(q @ ref_keys[:, : pos + 1].transpose(1, 2), -1) @ ref_values[:, : pos + 1]
    ref = att.reshape(1, -1)
    gate = y[parts[0] + parts[1] : parts[0] + parts[1] + parts[2]] if gated else None
    if gated:
        ref = ref * torch.sigmoid(gate)

    for where in (at, None):
        k2, v2 = keys.clone(), values.clone()
        q_out = cuda_fused.attention_qk(
            y, qk_norm, cos_rows, sin_rows, partner, k2, v2, where, pos, n_head, sum(parts[:3]), eps
        )
        _close(q_out, qk[:n_head])
        _close(k2, ref_keys)
        _close(v2, ref_values, 0)
        _close(cuda_fused.attention_decode(q_out, k2, v2, where, pos, gate), ref)


@pytest.mark.parametrize(("hd", "pos0", "t"), [(64, 0, 70), (256, 0, 40), (128, 37, 65), (256, 5, 1 + 64)])
def test_attention_prefill_matches_torch(hd: int, pos0: int, t: int) -> None:
    """Causal GQA attention of t rows at positions pos0.. over a cache's strided first pos0 + t slots, against
    torch's float32 SDPA on repeated KV heads with an explicit mask."""
    n_head, n_kv, cap = 8, 2, 160
    q = _rand(t, n_head, hd, seed=5)
    keys, values = _rand(n_kv, cap, hd, seed=6), _rand(n_kv, cap, hd, seed=7, scale=3.0)
    span = pos0 + t
    out = cuda_fused.attention_prefill(q, keys[:, :span], values[:, :span], pos0)
    k = keys[:, :span].repeat_interleave(n_head // n_kv, 0)
    v = values[:, :span].repeat_interleave(n_head // n_kv, 0)
    mask = torch.arange(span, device=DEVICE)[None, :] <= torch.arange(pos0, span, device=DEVICE)[:, None]
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask).transpose(0, 1)
    _close(out, ref.reshape(t, n_head * hd))


def test_layers_attention_takes_the_kernel_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """runtime.layers.attention hands a prefill to attention_prefill with FORGE_CUDA_PREFILL_ATTENTION=1, with
    torch's SDPA results."""
    from runtime import layers

    q, keys, values = _rand(33, 4, 64, seed=8), _rand(2, 40, 64, seed=9), _rand(2, 40, 64, seed=10)
    calls = []
    kernel = cuda_fused.attention_prefill
    monkeypatch.setattr(cuda_fused, "attention_prefill", lambda *a: calls.append(1) or kernel(*a))
    monkeypatch.delenv("FORGE_CUDA_PREFILL_ATTENTION", raising=False)
    ref = layers.attention(q, keys[:, :35], values[:, :35], 2)
    monkeypatch.setenv("FORGE_CUDA_PREFILL_ATTENTION", "1")
    out = layers.attention(q, keys[:, :35], values[:, :35], 2)
    assert calls == [1]
    _close(out, ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's fused attention kernels need CUDA")
@pytest.mark.parametrize("pos0", [0, 5])
def test_prefill_attention_takes_torchs_fused_kernel(pos0: int) -> None:
    """On CUDA a float32 prefill's SDPA can take torch's memory-efficient kernel (it would refuse the 3-D inputs
    and leave the math path), with the math path's results to float32 accuracy."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from runtime import layers

    q, keys, values = _rand(48, 8, 256, seed=11), _rand(2, 64, 256, seed=12), _rand(2, 64, 256, seed=13)
    s = pos0 + 48
    with sdpa_kernel([SDPBackend.MATH]):
        ref = layers.attention(q, keys[:, :s], values[:, :s], pos0)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        out = layers.attention(q, keys[:, :s], values[:, :s], pos0)
    _close(out, ref)
