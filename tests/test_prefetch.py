"""Prefetch of the next layer's experts: logits unchanged, counters consistent, no eviction of what is in use."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from forge.layout import convert
from runtime.experts import ExpertCache
from runtime.models import load_model
from runtime.prefetch import attach_prefetcher
from runtime.synth import SynthGeometry, synthesize

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

LAYERS, EXPERTS, USED = 4, 32, 4
FLOOR = LAYERS * USED + 1


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("prefetch")
    geo = SynthGeometry(LAYERS, EXPERTS, USED, hidden=256, expert_ff=256, heads=4, kv_heads=2, head_dim=64,
                        vocab=512)  # fmt: skip
    canon = tmp / "synth.gguf"
    synthesize(canon, geo, "q4_k")
    v2 = tmp / "synth-v2.gguf"
    convert(canon, v2, "v2")
    return {"canonical": canon, "v2": v2}


def _run(path: Path, n: int = 12, **kw: object) -> tuple[torch.Tensor, object]:
    prefetch = kw.pop("prefetch", None)
    m = load_model(path, verify_experts=False, **kw)  # type: ignore[arg-type]
    p = attach_prefetcher(m, background=prefetch == "background") if prefetch else None
    ids = torch.randint(0, 512, (n + 8,), generator=torch.Generator().manual_seed(5))
    st = m.new_state(64)
    out = [m.forward(ids[:8], st)] + [m.forward(ids[i : i + 1], st) for i in range(8, n + 8)]
    if p is not None:
        p.close()
    return torch.cat(out), m


@pytest.mark.parametrize(
    ("layout", "mode", "capacity"),
    [
        ("v2", "background", 2 * FLOOR),
        pytest.param("canonical", "background", FLOOR, marks=pytest.mark.slow),
        pytest.param("canonical", "inline", 3 * FLOOR, marks=pytest.mark.slow),
        pytest.param("v2", "inline", FLOOR, marks=pytest.mark.slow),
    ],
)
def test_prefetch_keeps_logits_bit_identical(
    files: dict[str, Path], layout: str, mode: str, capacity: int
) -> None:
    want, _ = _run(files[layout], expert_budget=0)
    got, m = _run(files[layout], stream_experts=capacity, prefetch=mode)
    assert torch.equal(got, want), capacity
    s = m.weights.expert_cache.stats  # type: ignore[attr-defined]
    assert s.prefetch_issued > 0 or capacity == FLOOR  # at the floor every slot is in use each cycle
    assert s.prefetch_used + s.prefetch_wasted <= s.prefetch_issued
    record = next(iter(m.weights.expert_cache.layers.values())).record_bytes  # type: ignore[attr-defined]
    assert s.bytes_read == record * (s.misses + s.prefetch_issued)


def test_prefetch_counters_and_hits(files: dict[str, Path]) -> None:
    """With room for every expert nothing is evicted: each prefetched expert the model then used is
    exactly one miss saved (inline prefetch is deterministic)."""
    path, everything = files["v2"], LAYERS * EXPERTS
    _, base = _run(path, stream_experts=everything)
    _, pre = _run(path, stream_experts=everything, prefetch="inline")
    b, p = base.weights.expert_cache.stats, pre.weights.expert_cache.stats  # type: ignore[attr-defined]
    assert p.lookups == b.lookups and p.evictions == 0
    assert 0 < p.prefetch_used <= p.prefetch_issued and p.prefetch_wasted == 0
    assert p.misses == b.misses - p.prefetch_used


def test_prefetch_never_evicts_protected_or_pinned(files: dict[str, Path]) -> None:
    from runtime.weights import GGUFWeights

    w = GGUFWeights(files["canonical"])
    cache = ExpertCache(w.path, w.expert_layers(), FLOOR, USED)
    held: list[int] = []
    for layer, ids in ((1, range(FLOOR - USED)), (0, range(USED)), (1, [0, 1]), (0, range(USED))):
        cache.release(held)
        held = cache.slots(layer, list(ids))  # two routing cycles; the cache is full
    # layer 0's experts stay pinned (as while being copied out); layer 1 routed to expert 0
    cache.serve(1, [0])
    n = cache.prefetch(2, list(range(16, 32)), issued_at=1)
    fetched = [e for e in range(16, 32) if cache.key(2, e) in cache.slot_of]
    keys = set(cache.slot_of)
    assert {cache.key(0, e) for e in range(USED)} <= keys  # pinned
    assert cache.key(1, 0) in keys  # protected
    assert cache.key(1, 1) in keys  # used during the last routing cycle
    # the experts unused since may go, once: the prefetched experts themselves are reserved for layer 2
    assert n == len(fetched) == FLOOR - USED - 2
    assert fetched == list(range(16, 16 + n))  # in the order guessed
    assert cache.stats.prefetch_issued == n and cache.stats.prefetch_wasted == 0
    assert cache.prefetch(2, fetched, issued_at=1) == 0  # cached already: nothing read twice
    # a request from a layer the model has moved past is dropped
    cache.release(held)
    cache.serve(3, [])
    assert cache.prefetch(2, [31], issued_at=1) == 0 and cache.key(2, 31) not in cache.slot_of
    # serving layer 2 hits the prefetched experts and frees their reservations
    hits = cache.stats.hits
    cache.release(cache.slots(2, fetched[:3]))
    assert cache.stats.prefetch_used == 3 and cache.stats.hits - hits == 3
    assert (cache.reserved_for < 0).all()


def test_a_wrong_guess_is_the_first_to_go(files: dict[str, Path]) -> None:
    """A guessed expert the model never used ranks as the least recently used once its layer is served (a
    guess counted as a use would stay, under LRU, a whole cycle and push out experts the model uses)."""
    from runtime.weights import GGUFWeights

    w = GGUFWeights(files["canonical"])
    cache = ExpertCache(w.path, w.expert_layers(), FLOOR + 2, USED, "lru")
    for layer in range(LAYERS):
        cache.release(cache.slots(layer, list(range(USED))))
    cache.serve(1, list(range(USED)))
    assert cache.prefetch(2, [20], issued_at=1) == 1
    cache.release(cache.slots(0, [8, 9]))  # the cache is full now
    cache.release(cache.slots(2, list(range(USED))))  # layer 2 served: the guess was wrong
    cache.release(cache.slots(3, [30]))
    assert cache.key(2, 20) not in cache.slot_of and cache.stats.prefetch_wasted == 1
    assert all(cache.key(layer, e) in cache.slot_of for layer in range(LAYERS) for e in range(USED))
