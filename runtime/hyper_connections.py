"""Manifold-constrained hyper-connections (mHC, DeepSeek V4): the residual stream is ``hc`` parallel streams
(T, hc, n_embd). Before each attention or FFN block, a projection of the RMS-normalized streams gives three
mixes: ``pre`` collapses the streams into the block's input, ``post`` spreads the block's output back over
the streams, and ``comb`` (made doubly stochastic by Sinkhorn-Knopp iterations) mixes the old streams into
the new ones. ``HyperHead`` is the final collapse before the output norm.

GGUF tensors (llama.cpp's names): ``blk.N.hc_{attn,ffn}_fn`` ((2 + hc) hc, hc n_embd), ``_base``
((2 + hc) hc), ``_scale`` (3); ``output_hc_fn`` (hc, hc n_embd), ``output_hc_base`` (hc), ``output_hc_scale`` (1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.weights import Weights


def _mixes(streams: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """streams (T, hc, n) -> fn @ rms_norm(flattened streams), (T, rows of fn)."""
    flat = streams.reshape(streams.shape[0], -1)
    return F.linear(F.rms_norm(flat, (flat.shape[-1],), eps=eps), fn)


def sinkhorn(comb: torch.Tensor, iterations: int, eps: float) -> torch.Tensor:
    """comb (T, src, dst) logits -> softmax over dst, + eps, then alternately normalized over src and dst."""
    comb = torch.softmax(comb, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iterations - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class HyperConnection:
    """One block's mHC: ``collapse`` the streams into the block input, then ``expand`` its output."""

    def __init__(
        self, weights: Weights, prefix: str, hc: int, iterations: int, hc_eps: float, eps: float
    ) -> None:
        self.fn = weights.dense(prefix + "_fn.weight")
        self.base = weights.dense(prefix + "_base.weight")
        self.scale = weights.dense(prefix + "_scale.weight")
        self.hc, self.iterations, self.hc_eps, self.eps = hc, iterations, hc_eps, eps

    def collapse(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams (T, hc, n) -> (block input (T, n), post (T, hc), comb (T, src hc, dst hc))."""
        hc, t = self.hc, streams.shape[0]
        mixes = _mixes(streams, self.fn, self.eps)
        pre = torch.sigmoid(mixes[:, :hc] * self.scale[0] + self.base[:hc]) + self.hc_eps
        post = 2 * torch.sigmoid(mixes[:, hc : 2 * hc] * self.scale[1] + self.base[hc : 2 * hc])
        comb = (mixes[:, 2 * hc :] * self.scale[2] + self.base[2 * hc :]).view(t, hc, hc)
        collapsed = torch.einsum("th,thn->tn", pre, streams)
        return collapsed, post, sinkhorn(comb, self.iterations, self.hc_eps)

    @staticmethod
    def expand(
        out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """The new streams: post[dst] * out + sum over src of comb[src, dst] * streams[src]."""
        return post[:, :, None] * out[:, None, :] + torch.einsum("tsd,tsn->tdn", comb, streams)


class HyperHead:
    """The final collapse of the streams (sigmoid weights, no Sinkhorn) before the output norm."""

    def __init__(self, weights: Weights, hc_eps: float, eps: float) -> None:
        self.fn = weights.dense("output_hc_fn.weight")
        self.base = weights.dense("output_hc_base.weight")
        self.scale = weights.dense("output_hc_scale.weight")
        self.hc_eps, self.eps = hc_eps, eps

    def __call__(self, streams: torch.Tensor) -> torch.Tensor:
        pre = torch.sigmoid(_mixes(streams, self.fn, self.eps) * self.scale + self.base) + self.hc_eps
        return torch.einsum("th,thn->tn", pre, streams)
