"""The grouped GEMM's expert grouping from torch operations (``cuda_kernels._group_by_expert_ops``: pools of
more experts than the grouping kernel takes), on the CPU; ``test_cuda_kernels`` holds the kernel to the same
checks and to these values on a GPU."""

from __future__ import annotations

import pytest
import torch

from runtime.backends import cuda_kernels as ck


def assert_tiles_cover(ids: torch.Tensor, experts: int, bm: int, maps: tuple[torch.Tensor, ...]) -> None:
    """The pairs sorted by expert stably; every pair in exactly one tile of its expert, an expert's pairs in
    ceil(count / bm) full-first tiles, the spare tiles empty."""
    order, expert, start, rows = (t.cpu() for t in maps)
    flat = ids.view(-1).cpu()
    assert torch.equal(order.long(), torch.sort(flat, stable=True).indices)  # by expert, then pair order
    seen, tiles = [], {}
    for e, s, r in zip(expert.tolist(), start.tolist(), rows.tolist(), strict=True):
        pairs = order[s : s + r].tolist()
        assert all(int(flat[p]) == e for p in pairs)
        seen += pairs
        if r:
            tiles.setdefault(e, []).append(r)
    assert sorted(seen) == list(range(flat.numel()))
    counts = torch.bincount(flat.long(), minlength=experts).tolist()
    for e, c in enumerate(counts):
        want = [bm] * (c // bm) + ([c % bm] if c % bm else [])
        assert tiles.get(e, []) == want, e


def routing(n_tok: int, top_k: int, experts: int, seed: int) -> torch.Tensor:
    """Random (n_tok, top_k) int32 expert ids, the first token's slots all one expert."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, experts, (n_tok, top_k), generator=g)
    ids[0, :] = ids[0, 0]
    return ids.to(torch.int32)


@pytest.mark.parametrize(
    ("experts", "n_tok", "top_k", "bm"),
    [(5, 4, 2, 2), (3, 1, 1, 64), (256, 512, 8, 32), (4854, 512, 8, 16), (8192, 40, 8, 64)],
)
def test_grouping_by_operations_covers_every_pair_once(experts: int, n_tok: int, top_k: int, bm: int) -> None:
    if experts == 5:
        ids = torch.tensor([[3, 3], [0, 3], [3, 1], [3, 3]], dtype=torch.int32)
    else:
        ids = routing(n_tok, top_k, experts, experts)
    pairs = ids.numel()
    n_tiles = -(-pairs // bm) + min(experts, pairs)
    assert_tiles_cover(ids, experts, bm, ck._group_by_expert_ops(ids.view(-1), experts, bm, n_tiles))


def test_many_experts_group_by_operations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above GROUP_KERNEL_EXPERTS the grouping takes the torch operations (no kernel launch)."""
    monkeypatch.setattr(ck, "launch", lambda *a, **k: pytest.fail("the grouping kernel was launched"))
    ids = routing(64, 8, ck.GROUP_KERNEL_EXPERTS + 1, 0)
    assert_tiles_cover(
        ids, ck.GROUP_KERNEL_EXPERTS + 1, 16, ck._group_by_expert(ids, ck.GROUP_KERNEL_EXPERTS + 1, 16)
    )
