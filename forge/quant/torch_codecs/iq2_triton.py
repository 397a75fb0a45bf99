"""The IQ2 best-neighbour search as one Triton kernel: ``iq2.best_neighbour``'s result without its pairs.

The torch search (``iq2.best_neighbour``) writes out every (query, neighbour) pair of a chunk, up to 150 per
off-grid group, with eight gathered terms each, and reduces them with two segmented minimums: on an H200 it
is most of IQ2_XXS's encode time. Here a lane takes one query and walks its neighbour list, summing each
point's 8 terms in coordinate order (the same float32 additions) and keeping the first least score; a NaN
score makes the query keep its first neighbour, as the torch search's NaN-propagating minimum does.

``best_neighbour_fused(cb, codes, terms)`` takes and returns what ``iq2.best_neighbour`` does, or None where
the kernel may not serve (no Triton, not CUDA, or its self-check failed on this device).
"""

from __future__ import annotations

import functools
import logging

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - machines without triton
    triton = tl = None

log = logging.getLogger(__name__)

#: queries per program
BLOCK = 128

if triton is not None:

    @triton.jit
    def _best_neighbour_kernel(codes_ptr, terms_ptr, start_ptr, count_ptr, flat_ptr, cols_ptr, out_ptr, n_q,
                               LONGEST: tl.constexpr, BLOCK_: tl.constexpr):  # fmt: skip
        q = tl.program_id(0).to(tl.int64) * BLOCK_ + tl.arange(0, BLOCK_)
        live = q < n_q
        code = tl.load(codes_ptr + q, mask=live, other=0)
        start = tl.load(start_ptr + code, mask=live, other=0)
        count = tl.load(count_ptr + code, mask=live, other=0)
        row = terms_ptr + q * 24
        best = tl.full((BLOCK_,), float("inf"), tl.float32)
        pick = tl.zeros((BLOCK_,), tl.int64)
        nan = tl.zeros((BLOCK_,), tl.int1)
        for j in range(0, LONGEST):  # the codebook's longest list (a block's own longest is about as long)
            ok = j < count
            cols = cols_ptr + (start + j) * 8
            score = tl.load(row + tl.load(cols, mask=ok, other=0), mask=ok, other=0.0)
            for i in tl.static_range(1, 8):
                score = score + tl.load(row + tl.load(cols + i, mask=ok, other=0), mask=ok, other=0.0)
            better = ok & (score < best)
            best = tl.where(better, score, best)
            pick = tl.where(better, j, pick)
            nan = nan | (ok & (score != score))
        pick = tl.where(nan, 0, pick)
        tl.store(out_ptr + q, tl.load(flat_ptr + start + pick, mask=live, other=0), mask=live)


@functools.cache
def _entry_cols(cols: torch.Tensor) -> torch.Tensor:
    """The codebook's (8, E) term columns entry-major (E, 8) int32: one entry's 8 columns side by side."""
    return cols.t().contiguous().to(torch.int32)


@functools.cache
def _longest(count: torch.Tensor) -> int:
    return int(count.max())


def _launch(cb, codes: torch.Tensor, terms: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    n_q = codes.shape[0]
    out = torch.empty(n_q, dtype=torch.int64, device=codes.device)
    if n_q:
        _best_neighbour_kernel[(triton.cdiv(n_q, BLOCK),)](
            codes.contiguous(), terms.to(torch.float32).contiguous(), cb.nb_start, cb.nb_count, cb.nb_flat,
            _entry_cols(cb.nb_cols), out, n_q, LONGEST=_longest(cb.nb_count), BLOCK_=BLOCK, enable_fp_fusion=False,
        )  # fmt: skip
    return out


def best_neighbour_fused(cb, codes: torch.Tensor, terms: torch.Tensor) -> torch.Tensor | None:  # noqa: ANN001
    """``iq2.best_neighbour(cb, codes, terms)`` from the kernel, or None where it may not serve."""
    if triton is None or not codes.is_cuda or not self_check(str(codes.device)):
        return None
    return _launch(cb, codes, terms)


@functools.cache
def self_check(device: str) -> bool:
    """Whether the kernel picks what the torch search picks on ``device`` (random codes over the whole code
    range, random terms with ties, an infinite and a NaN term); checked once per process, a difference
    logged."""
    from gguf import GGMLQuantizationType as T

    from forge.quant.torch_codecs import iq2

    cb = iq2.device_codebook(T.IQ2_XXS, device)
    gen = torch.Generator().manual_seed(77)
    off_grid = torch.nonzero(cb.point_of_code.cpu() < 0).reshape(-1)
    codes = off_grid[torch.randint(len(off_grid), (4096,), generator=gen)]
    terms = torch.rand(4096, 8, 3, generator=gen)
    terms[:1024] = torch.round(terms[:1024] * 4) / 4  # ties
    terms[5, 3, :] = float("inf")
    terms[6, 2, 1] = float("nan")
    codes, terms = codes.to(device), terms.to(device)
    same = bool(torch.equal(iq2.best_neighbour(cb, codes, terms), _launch(cb, codes, terms)))
    if not same:
        log.warning("the IQ2 best-neighbour kernel differs from the torch search on %s: not used", device)
    return same


__all__ = ["best_neighbour_fused", "self_check"]
