"""Hybrid routed experts (runtime.hybrid): a pool of hot experts on the "GPU" side, the rest on the CPU backend.

Without a GPU the fast side is the torch reference over a host pool, so the whole executor runs here: logits
against the resident path within the kernels' 1e-4, greedy tokens identical, the pool's policy, prune masks,
expert-major files and the observers' inputs. ``test_on_cuda`` runs the same on a real GPU (marked ``gpu``).
"""

from __future__ import annotations

import mmap
import subprocess
import sys
from pathlib import Path

import numpy as np
import oracle
import pytest
import torch
from output_rows import check_last_only

from forge.errors import ForgeError
from forge.imatrix.accumulate import ImatrixAccumulator
from forge.layout import convert
from forge.profile_file import LayerProfile, Profile
from runtime.cli import cache_stats
from runtime.hybrid import HybridExperts, HybridStats, Rates
from runtime.models import build_model, load_model
from runtime.observers import Observer
from runtime.planner import RUNTIME_OVERHEAD, model_stats, plan
from runtime.weights import GGUFWeights, load_weights

pytest.importorskip("numba")
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

PREFILL, DECODE = 21, 3


def _ids(n: int = PREFILL + DECODE, seed: int = 7) -> torch.Tensor:
    return torch.randint(0, 4096, (n,), generator=torch.Generator().manual_seed(seed))


def _hybrid(
    path: Path,
    slots: int | None = None,
    rates: Rates | None = Rates.never(),
    device: str = "cpu",
    observers: list[Observer] | None = None,
    **kw: object,
) -> tuple[object, HybridExperts]:
    """The model with hybrid experts: a pool of ``slots`` experts (default: a quarter of them); ``rates``
    None: measured."""
    w = load_weights(path, device, 0)
    w.host_experts = True
    m = build_model(w, observers)
    layers = w.expert_layers()
    record = max(lay.record_bytes for lay in layers.values())
    if slots is None:
        slots = sum(lay.experts for lay in layers.values()) // 4
    h = m.hybrid = HybridExperts(m, slots * record, device, rates=rates, **kw)  # type: ignore[arg-type,attr-defined]
    return m, h


def _logits(m: object, ids: torch.Tensor | None = None) -> torch.Tensor:
    """A prefill, then single-token decode steps."""
    ids = _ids() if ids is None else ids
    state = m.new_state(64)  # type: ignore[attr-defined]
    out = [m.forward(ids[:PREFILL], state)]  # type: ignore[attr-defined]
    out += [m.forward(ids[i : i + 1], state) for i in range(PREFILL, len(ids))]  # type: ignore[attr-defined]
    return torch.cat(out)


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-4) -> None:
    err = float((got.cpu() - want.cpu()).abs().max())
    assert err <= rtol * float(want.abs().max()), err


def _pairs(m: object, n_tok: int) -> int:
    return n_tok * m.n_expert_used * len(m.routed_layers())  # type: ignore[attr-defined]


@pytest.mark.parametrize("rates", ["never", "always"])
@pytest.mark.parametrize("share", [8, 1])
def test_logits_match_resident(example_q8: Path, rates: str, share: int) -> None:
    """Prefill misses on the CPU or copied for the batch; a pool of an eighth or all of the experts."""
    want = _logits(load_model(example_q8))
    layers = GGUFWeights(example_q8).expert_layers()
    slots = sum(lay.experts for lay in layers.values()) // share
    m, h = _hybrid(example_q8, slots, getattr(Rates, rates)())
    assert all(layer.pooled.gate_up is not None for layer in h.hybrid_layers.values())  # one part, one launch
    _close(_logits(m), want)
    s = h.stats
    assert s.gpu_pairs + s.upload_pairs + s.cpu_pairs == _pairs(m, PREFILL + DECODE)
    assert (s.upload_pairs > 0) == (rates == "always") and s.cpu_pairs > 0 and s.gpu_pairs > 0
    assert s.bytes_read == s.cpu_computes * layers[0].record_bytes
    # the decode steps alone: every routed layer of each step, hits among their pairs only
    assert s.step_layers == DECODE * len(m.routed_layers()) and s.k == m.n_expert_used
    assert 0 < s.step_hits <= s.gpu_hits and s.step_hit_rate == s.step_hits / _pairs(m, DECODE)
    assert s.step_cpu_seconds > 0 and s.step_device_seconds >= 0 and s.step_host_seconds > 0
    # the CPU kernel's calls by missed experts: every missed decode pair in one, none without a miss
    assert len(s.step_cpu_calls) == s.k + 1 and s.step_cpu_calls[0] == 0
    assert sum(n * c for n, c in enumerate(s.step_cpu_calls)) == s.step_layers * s.k - s.step_hits
    assert sum(s.step_cpu_seconds_by_misses) == pytest.approx(s.step_cpu_seconds)
    line = model_stats(m)  # --stats
    assert f"{s.gpu_hits} GPU hits" in line and f"{s.cpu_computes} CPU computes" in line
    assert f"decode steps: {s.step_hit_rate:.1%} GPU hits" in line
    assert (
        f"{s.bytes_read / 1e6:,.1f} MB read" in line and f"{s.bytes_uploaded / 1e6:,.1f} MB uploaded" in line
    )


def test_batch_copies_the_layer_whole(example_q8: Path, tmp_path: Path) -> None:
    """When copying a layer's experts whole beats gathering the missed ones, a batch's pairs all go to the
    fast side over the whole copy, pooled ones too (canonical files only: an expert-major file's parts are
    strided)."""
    want = _logits(load_model(example_q8))
    whole = Rates(1.0, 1.0, 0.0, float("inf"))  # gathering never pays, the CPU is slow, a whole copy is free
    m, h = _hybrid(example_q8, rates=whole)
    assert all(layer.whole for layer in h.hybrid_layers.values())
    _close(_logits(m), want)
    s, n = h.stats, len(m.routed_layers())
    layer = next(iter(h.hybrid_layers.values()))
    assert s.upload_pairs > 0 and s.bytes_uploaded >= n * layer.n_expert * layer.record_bytes
    assert s.cpu_pairs + s.gpu_pairs + s.upload_pairs == _pairs(m, PREFILL + DECODE)
    assert s.cpu_pairs <= _pairs(m, DECODE)  # the prefill's misses all went over
    assert s.gpu_pairs <= _pairs(m, DECODE)  # and its pooled pairs were computed from the copy too
    major = tmp_path / "major.gguf"
    convert(example_q8, major, "v2")
    m, h = _hybrid(major, rates=whole)
    assert not any(layer.whole for layer in h.hybrid_layers.values())
    _close(_logits(m), want)


def test_a_prefill_for_its_last_logits_then_decode_steps_as_resident(example_q8: Path) -> None:
    """The prefill's last layer computes one row, through the batch path: no decode step's mailbox (whose
    rows the device and the CPU worker take in turn, a step at a time) is opened for it."""
    from runtime.generate import generate

    m, h = _hybrid(example_q8)
    check_last_only(m, _ids())
    prompt = _ids(12, seed=3).tolist()
    want = generate(load_model(example_q8), prompt, 6, stop_ids=set()).tokens
    assert generate(m, prompt, 6, stop_ids=set()).tokens == want
    assert h.stats.cpu_computes > 0


def test_llamacpp_q4_k_m_logits(tmp_path: Path) -> None:
    path = oracle.llamacpp_output("tiny-qwen3moe", "tiny-qwen3moe-Q4_K_M-imat.gguf")
    m, _ = _hybrid(path)
    _close(_logits(m), _logits(load_model(path)))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "name"),
    [
        ("tiny-qwen3moe", "tiny-qwen3moe-Q4_K_M-imat.gguf"),
        ("tiny-qwen35moe", "tiny-qwen35moe-IQ2_XXS-imat.gguf"),
    ],
)
def test_greedy_tokens_identical(model: str, name: str) -> None:
    from runtime.generate import generate

    path = oracle.llamacpp_output(model, name)
    prompt = _ids(16, seed=3).tolist()
    want = generate(load_model(path), prompt, 64, stop_ids=set()).tokens
    m, h = _hybrid(path)
    got = generate(m, prompt, 64, stop_ids=set()).tokens
    assert len(want) == 64 and got == want
    assert h.stats.gpu_hits > 0 and h.stats.cpu_computes > 0 and h.stats.admissions > 0


def _profile(m: object, counts: dict[int, np.ndarray]) -> Profile:
    n = m.n_expert  # type: ignore[attr-defined]
    layers = [LayerProfile(i, counts[i], counts[i].astype(float), np.zeros(n)) for i in m.routed_layers()]  # type: ignore[attr-defined]
    return Profile(layers, n, m.n_expert_used, 100)  # type: ignore[attr-defined]


def test_seeded_pool_holds_the_profile_hot_set(example_q8: Path) -> None:
    probe = load_model(example_q8)
    n, layers = probe.n_expert, probe.routed_layers()
    rng = np.random.default_rng(0)
    counts = {i: rng.integers(1, 1000, n) for i in layers}
    # every expert pooled: the whole pass is computed on the fast side
    m, h = _hybrid(example_q8, n * len(layers), profile=_profile(probe, counts))
    _logits(m)
    assert h.stats.cpu_pairs == 0 and h.stats.gpu_pairs == _pairs(m, PREFILL + DECODE)
    # half a layer's experts per layer: the pool holds each layer's hottest half (one geometry, one pool;
    # the seeded counts are scaled over all layers, so compare the pooled set with the global ranking)
    m, h = _hybrid(example_q8, n * len(layers) // 2, profile=_profile(probe, counts))
    pooled = np.flatnonzero(h.slot_of >= 0)
    everything = np.concatenate([counts[i] for i in layers]).astype(float)
    hottest = np.argsort(-everything, kind="stable")[: len(pooled)]
    assert set(pooled) == set(hottest)


def test_attach_seeds_from_a_profile_file(example_q8: Path, tmp_path: Path) -> None:
    from runtime.hybrid import attach

    probe = load_model(example_q8)
    path = tmp_path / "profile.json"
    _profile(probe, {i: np.arange(probe.n_expert) for i in probe.routed_layers()}).save(
        path
    )  # expert 0: never
    w = load_weights(example_q8, "cpu", 0)
    w.host_experts = True
    m = build_model(w)
    h = attach(m, 10_000 * w.expert_layers()[0].record_bytes, path, rates=Rates.never())
    assert m.hybrid is h and h.seeded == (probe.n_expert - 1) * len(probe.routed_layers())
    assert all(h.slot_of[lay.base] == -1 for lay in h.hybrid_layers.values())
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ForgeError, match="not an expert profile"):
        attach(build_model(w), 1 << 20, tmp_path / "bad.json", rates=Rates.never())


def test_misses_are_admitted_then_hit(example_q8: Path) -> None:
    """A pool that can hold every expert, no profile, admissions unlimited: the second pass over the same
    tokens computes nothing on the CPU."""
    probe = load_model(example_q8)
    m, h = _hybrid(example_q8, probe.n_expert * len(probe.routed_layers()), admit_per_call=0)
    first = _logits(m)
    s = h.stats
    # each miss is admitted once (free slots), and later uses of it in the pass are hits
    assert s.admissions == s.cpu_computes > 0 and s.gpu_hits > 0 and s.evictions == 0
    assert int((h.slot_of >= 0).sum()) == s.admissions
    cpu_pairs, gpu_pairs = s.cpu_pairs, s.gpu_pairs
    _close(_logits(m), first, 1e-5)
    assert h.stats.cpu_pairs == cpu_pairs and h.stats.evictions == 0
    assert h.stats.gpu_pairs - gpu_pairs == _pairs(m, PREFILL + DECODE)


def test_decode_step_admits_in_one_look_at_the_pool(
    example_q8: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode step's admissions (the hottest miss of each layer) are decided together: one look at the pool's
    slots a step, whatever the layers; the slots then hold their experts' records as the file stores them."""
    m, h = _hybrid(example_q8)
    looks = []
    slots_for = h._slots_for

    def counted(pool: object, keys: np.ndarray) -> np.ndarray:
        looks.append(keys.size)
        return slots_for(pool, keys)  # type: ignore[arg-type]

    monkeypatch.setattr(h, "_slots_for", counted)
    state, steps, layers = m.new_state(64), 6, len(h.hybrid_layers)
    ids = _ids(steps)
    for i in range(steps):  # decode steps only: each routed layer has a miss to admit into a free slot
        m.forward(ids[i : i + 1], state)
    s = h.stats
    assert layers > 1 and s.admissions == sum(looks) >= layers
    assert 0 < len(looks) <= steps and max(looks) == layers * h.admit_per_call  # every layer's in one look
    h._settle(wait=True)
    _assert_pool_holds_the_file_records(h)


def test_admissions_copied_together_are_settled_by_one_question(
    example_q8: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch's admissions share their copy: settling asks it once, not once an admission."""
    import runtime.hybrid as hybrid

    m, h = _hybrid(example_q8, rates=Rates.always())
    asked = []
    finished = hybrid._finished

    def counted(copied: object, wait: bool = False) -> bool:
        asked.append(copied)
        return finished(copied, wait)

    monkeypatch.setattr(hybrid, "_finished", counted)
    pending = []
    settle = h._settle

    def settled(wait: bool = False) -> None:
        pending.append(sum(len(pool.pending) for pool in h.pools.values()))
        settle(wait)

    monkeypatch.setattr(h, "_settle", settled)
    m.forward(_ids()[:PREFILL], m.new_state(64))
    assert h.stats.admissions > len(h.hybrid_layers) and sum(pending) > len(asked)
    assert len(asked) <= len(pending)  # on the CPU every copy is done at once: one question a settle


def test_batch_copies_admitted_into_the_pool(example_q8: Path) -> None:
    """A prefill that copies every miss for the batch admits those copies into the pool in one copy per
    part: each pooled slot then holds its expert's record as the file stores it."""
    probe = load_model(example_q8)
    m, h = _hybrid(example_q8, probe.n_expert * len(probe.routed_layers()) // 2, rates=Rates.always())
    state = m.new_state(64)
    m.forward(_ids()[:PREFILL], state)
    assert h.stats.upload_experts > 0 and h.stats.admissions > 0
    _assert_pool_holds_the_file_records(h)


def _assert_pool_holds_the_file_records(h: HybridExperts) -> None:
    """Every layer has pooled experts, and each pooled slot holds its expert's record as the file stores it."""
    from runtime.hybrid import host_records

    for layer in h.hybrid_layers.values():
        pooled = np.flatnonzero(h.slot_of[layer.base : layer.base + layer.n_expert] >= 0)
        assert pooled.size
        records = host_records(layer, torch.from_numpy(pooled))
        for c, rec in zip(layer.pool.components, records, strict=True):
            slots = torch.from_numpy(h.slot_of[layer.base + pooled])
            assert torch.equal(layer.pool.view(layer.pool.parts, c.role, slots), rec), c.role


def test_pool_parts(example_q8: Path) -> None:
    """Gate and up of one type share a part (rows stacked), else each role has its own."""
    import dataclasses

    from gguf import GGMLQuantizationType as Q

    from runtime.hybrid import SlotPool

    comps = GGUFWeights(example_q8).expert_layers()[0].components
    by = {c.role: c for c in comps}
    pool = SlotPool(comps, 3, torch.device("cpu"))
    assert sorted(pool.parts) == ["down", "gate_up"]
    assert pool.parts["gate_up"].shape[1] == by["gate"].rows + by["up"].rows
    pool.parts["gate_up"].zero_()
    pool.view(pool.parts, "up", 1).fill_(7)
    assert (pool.parts["gate_up"][1, by["gate"].rows :] == 7).all() and not (
        pool.parts["gate_up"][1, :1] == 7
    ).all()
    mixed = tuple(dataclasses.replace(c, qtype=Q.Q4_0) if c.role == "up" else c for c in comps)
    pool = SlotPool(mixed, 3, torch.device("cpu"))
    assert (
        sorted(pool.parts) == ["down", "gate", "up"]
        and pool.view(pool.stage, "up", slice(0, 1)).shape[0] == 1
    )


def test_a_hotter_miss_evicts_the_coldest_slot(example_q8: Path) -> None:
    m, h = _hybrid(example_q8, 4, admit_per_call=0)
    layer = h.hybrid_layers[m.routed_layers()[0]]
    count = h.policy.count
    h._admit(layer, np.arange(4), None, 0)
    h._settle(wait=True)
    assert sorted(np.flatnonzero(h.slot_of >= 0)) == [layer.base + e for e in range(4)]
    count[layer.base + np.arange(4)] = [5, 1, 7, 3]
    count[layer.base + 9] = 4  # hotter than the coldest slot by more than the margin: takes expert 1's slot
    h._admit(layer, np.array([9]), None, 0)
    h._settle(wait=True)
    assert h.slot_of[layer.base + 1] == -1 and h.slot_of[layer.base + 9] >= 0 and h.stats.evictions == 1
    count[layer.base + 10] = (
        4  # the coldest slot is now expert 3 (count 3): within the margin, left on the CPU
    )
    h._admit(layer, np.array([10]), None, 0)
    assert h.slot_of[layer.base + 10] == -1 and h.stats.evictions == 1
    # a decode step's admission (a limit) skips the look at every slot while no miss beats the coldest count
    # seen last, which follows the policy's halvings: after two, expert 10 (4) beats expert 3 (3 -> 0.75)
    h._admit(layer, np.array([10]), None, 2)
    assert h.slot_of[layer.base + 10] == -1 and layer.pool.coldest == 3
    count *= 0.25
    h.policy.decays += 2
    count[layer.base + 10] = 4
    h._admit(layer, np.array([10]), None, 2)
    h._settle(wait=True)
    assert h.slot_of[layer.base + 10] >= 0 and h.slot_of[layer.base + 3] == -1 and h.stats.evictions == 2


class _Routed(Observer):
    def __init__(self) -> None:
        self.ids: dict[str, set[int]] = {}

    def on_matmul_input(self, tensor_name: str, x: torch.Tensor, expert_ids: torch.Tensor | None) -> None:
        if expert_ids is not None:
            self.ids.setdefault(tensor_name, set()).update(expert_ids.tolist())


def test_prune_mask_honoured(example_q8: Path) -> None:
    ref = load_model(example_q8)
    routed = len(ref.routed_layers())
    pruned = torch.zeros(routed, ref.n_expert, dtype=torch.bool)
    pruned[:, ::3] = True
    ref.set_prune_mask(pruned)
    want = _logits(ref)
    seen = _Routed()
    m, _ = _hybrid(example_q8, observers=[seen])
    m.set_prune_mask(pruned)
    got = _logits(m)
    _close(got, want)
    assert float((got - _logits(load_model(example_q8))).abs().max()) > 1e-2  # the mask changed the output
    masked = set(range(0, ref.n_expert, 3))
    assert len(seen.ids) == 3 * routed and all(not ids & masked for ids in seen.ids.values())


def test_expert_major_equals_canonical(example_q8: Path, tmp_path: Path) -> None:
    want = _logits(_hybrid(example_q8)[0])
    major = tmp_path / "major.gguf"
    convert(example_q8, major, "v2")
    m, h = _hybrid(major)
    assert torch.equal(_logits(m), want)
    assert h.stats.cpu_pairs > 0 and h.stats.gpu_pairs > 0


def test_imatrix_equals_resident(example_q8: Path) -> None:
    acc = {}
    for mode in ("resident", "hybrid"):
        acc[mode] = ImatrixAccumulator()
        if mode == "resident":
            m = load_model(example_q8, observers=[acc[mode]])
        else:
            m, _ = _hybrid(example_q8, rates=Rates.always(), observers=[acc[mode]])
        _logits(m)
    a, b = acc["resident"], acc["hybrid"]
    assert a._counts.keys() == b._counts.keys() and any("_exps" in n for n in a._counts)
    for name in a._counts:
        assert torch.equal(a._counts[name], b._counts[name]), name
        assert torch.allclose(a._sums[name], b._sums[name], rtol=1e-4, atol=1e-6), name


def test_refuses_bad_setups(example_q8: Path) -> None:
    w = load_weights(example_q8, "cpu", 0)
    m = build_model(w)
    with pytest.raises(ForgeError, match="host memory"):
        HybridExperts(m, 1 << 30, "cpu", rates=Rates.never())
    with pytest.raises(ForgeError, match="holds no expert"):
        _hybrid(example_q8, 0)
    probe = load_model(example_q8)
    bad = _profile(probe, {i: np.ones(probe.n_expert, np.int64) for i in probe.routed_layers()})
    bad.layers = bad.layers[1:]
    with pytest.raises(ForgeError, match="expert profile covers"):
        _hybrid(example_q8, profile=bad)


def test_planner_chooses_by_gpu_and_host_memory(example_q8: Path) -> None:
    w = GGUFWeights(example_q8)
    g = plan(w, memory_budget=1 << 40, gpu_memory=1 << 40).geometry
    assert g is not None
    assert plan(w, memory_budget=1 << 40, gpu_memory=1 << 40).mode == "resident"
    # the GPU holds the other weights and a few experts, the host all of them: hybrid
    small = (g.file_bytes - g.routed_bytes) + g.kv_bytes + (2 << 30) + 16 * g.slot_bytes
    p = plan(w, memory_budget=1 << 40, gpu_memory=int(small / 0.9) + 1)
    assert p.mode == "hybrid" and 15 * g.slot_bytes <= p.gpu_cache_bytes <= 16 * g.slot_bytes
    assert "GPU expert cache" in p.describe() and "fit in --memory-budget" in p.describe()
    # the host does not hold them either: hybrid, the CPU's experts streamed through a host expert cache
    budget = g.routed_bytes + RUNTIME_OVERHEAD - 1
    p = plan(w, memory_budget=budget, gpu_memory=int(small / 0.9) + 1)
    assert (
        p.mode == "hybrid"
        and p.cache_experts == (budget - RUNTIME_OVERHEAD - g.scratch_bytes) // g.slot_bytes
    )
    assert "host expert cache" in p.describe() and "do not fit" in p.describe()
    p = plan(w, "streaming", memory_budget=1 << 40, cache_experts=40, gpu_cache_bytes=4 * g.slot_bytes)
    assert p.mode == "hybrid" and p.cache_experts == 40
    with pytest.raises(ForgeError, match="below the floor"):
        plan(
            w, "streaming", memory_budget=1 << 40, cache_experts=g.floor - 1, gpu_cache_bytes=4 * g.slot_bytes
        )
    p = plan(w, gpu_cache_bytes=4 * g.slot_bytes, memory_budget=1 << 40)
    assert p.mode == "hybrid" and p.gpu_cache_bytes == 4 * g.slot_bytes
    with pytest.raises(ForgeError, match="at least one expert"):
        plan(w, gpu_cache_bytes=1, memory_budget=1 << 40)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpu-expert-cache", "1G"], "--gpu-expert-cache needs --device cuda"),
        (["--gpu-expert-cache", "1G", "--resident"], "--gpu-expert-cache excludes --resident"),
    ],
)
def test_cli_fails_closed(example_q8: Path, args: list[str], message: str) -> None:
    code = "import sys; from forge.cli import main; sys.argv = ['forge', *sys.argv[1:]]; main()"
    run = subprocess.run(
        [sys.executable, "-c", code, "run", str(example_q8), "-p", "x", "-n", "1", *args],
        capture_output=True,
        text=True,
    )
    assert run.returncode != 0 and message in run.stderr and "Traceback" not in run.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda(example_q8: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU: the pool on the cuda kernels, misses on the CPU backend, prefill copies and admissions on
    the side stream, whole layers copied a layer ahead; logits against the resident CPU path, expert-major ==
    canonical, imatrix counts."""
    want = _logits(load_model(example_q8))
    whole = Rates(1.0, 1.0, 0.0, float("inf"))
    for rates, pin in (
        (Rates.never(), "1"),
        (Rates.always(), "1"),
        (Rates.always(), "0"),
        (whole, "1"),
        (None, "1"),
    ):
        monkeypatch.setenv("FORGE_HYBRID_PIN", pin)
        acc = ImatrixAccumulator()
        m, h = _hybrid(example_q8, rates=rates, device="cuda", observers=[acc])
        # the file's experts page-locked (copies straight from the mapping), or staged through pinned buffers
        assert (h.pinned is not None) == (pin == "1")
        assert all(layer.fast_backend.NAME == "cuda" for layer in h.hybrid_layers.values())
        got = _logits(m)
        _close(got, want)
        s = h.stats
        assert s.gpu_pairs + s.upload_pairs + s.cpu_pairs == _pairs(m, PREFILL + DECODE)
        # whole layers from the page-locked file: each next layer's copy started during the one before
        if rates is whole and pin == "1":
            assert s.prefetched > s.prefetches_unused
        elif rates is not None:
            assert s.prefetched == 0
        ref_acc = ImatrixAccumulator()
        _logits(load_model(example_q8, observers=[ref_acc]))
        for name in ref_acc._counts:
            want_counts, got_counts = ref_acc._counts[name].cpu().double(), acc._counts[name].cpu().double()
            assert torch.equal(want_counts, got_counts), name
            assert torch.allclose(ref_acc._sums[name].cpu(), acc._sums[name].cpu(), rtol=1e-3, atol=1e-6), (
                name
            )
        h.close()  # the pages unlocked before the next model maps the file again
    major = tmp_path / "major.gguf"
    convert(example_q8, major, "v2")
    _close(_logits(_hybrid(major, rates=Rates.never(), device="cuda")[0]), want)
    # seeded from a profile through the copier thread and the side stream (every expert: no CPU pair)
    probe = load_model(example_q8)
    counts = {i: np.arange(1, probe.n_expert + 1) for i in probe.routed_layers()}
    m, h = _hybrid(
        example_q8,
        probe.n_expert * len(probe.routed_layers()),
        device="cuda",
        profile=_profile(probe, counts),
    )
    assert h.seeded == h.capacity
    _close(_logits(m), want)
    assert h.stats.cpu_pairs == 0 and h.stats.admissions == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_steps_in_cuda_graphs(example_q8: Path) -> None:
    """Without observers a decode step is captured whole (the CPU's answers awaited on the device), cut once
    for the host's call at its start, and replayed while admissions change the pool between steps: logits as
    the resident path's."""
    ids = _ids(PREFILL + 12)
    want = _logits(load_model(example_q8), ids)
    m, h = _hybrid(example_q8, device="cuda")
    state = m.new_state(64)
    got = [m.forward(ids[:PREFILL], state)]
    got += [m.forward(ids[i : i + 1], state) for i in range(PREFILL, len(ids))]
    _close(torch.cat(got), want)
    graphs = state.graphs
    assert graphs is not None and graphs.replays >= 8 and not graphs.failed
    (captured,) = graphs.graphs.values()
    assert len(captured.segments.graphs) == 2  # cut once, at the step's first routed layer (``begin_step``)
    assert h.stats.admissions > 0 and h.stats.cpu_pairs > 0 and h.stats.gpu_pairs > 0


@pytest.mark.slow
def test_server_live_imatrix_in_hybrid_mode(example_q8: Path, tmp_path: Path) -> None:
    """A server's live imatrix (its prefill gate over the observers) sees the resident server's inputs."""
    from forge.imatrix.live import LiveImatrix
    from runtime.server import load_engine

    live = {}
    for mode, cache in (
        ("resident", None),
        ("hybrid", 8 * GGUFWeights(example_q8).expert_layers()[0].record_bytes),
    ):
        live[mode] = LiveImatrix(tmp_path / f"{mode}.gguf")
        engine = load_engine(example_q8, "cpu", imatrix=live[mode], gpu_cache_bytes=cache)
        assert (getattr(engine.model, "hybrid", None) is not None) == (mode == "hybrid")
        engine.gate.open = True
        engine.model.forward(_ids(), engine.model.new_state(64))
    a, b = live["resident"], live["hybrid"]
    assert a._counts.keys() == b._counts.keys() and any("_exps" in n for n in a._counts)
    for name in a._counts:
        assert torch.equal(a._counts[name], b._counts[name]), name
        assert torch.allclose(a._sums[name], b._sums[name], rtol=1e-4, atol=1e-6), name


@pytest.mark.parametrize("rates", ["never", "always"])
def test_misses_streamed_through_a_host_expert_cache(example_q8: Path, rates: str) -> None:
    """The CPU side over an SSD-streamed host expert cache (the file beyond host memory): misses are read by
    the cache, computed there or copied for the batch from its records."""
    from runtime.experts import ExpertCache

    want = _logits(load_model(example_q8))
    w = load_weights(example_q8, "cpu", 0)
    w.host_experts = True
    layers = w.expert_layers()
    used = int(w.hparam("expert_used_count"))
    w.expert_cache = ExpertCache(example_q8, layers, len(layers) * used + 9, used, "lfu", "cpu")
    m = build_model(w)
    assert {m.blocks[i].moe.source.kind for i in m.routed_layers()} == {"streamed"}
    h = HybridExperts(m, 16 * layers[0].record_bytes, "cpu", rates=getattr(Rates, rates)())
    _close(_logits(m), want)
    s, c = h.stats, w.expert_cache.stats
    assert s.cpu_pairs > 0 and s.gpu_pairs > 0 and (s.upload_pairs > 0) == (rates == "always")
    assert c.misses > 0 and c.bytes_read == c.misses * layers[0].record_bytes
    # the host cache knows what the pool holds (its first to go): the two hold different experts
    pooled = {(i, e) for i in h.key_base for e in range(layers[i].experts) if h.held[h.key_base[i] + e]}
    marked = {(i, e) for i in layers for e in range(layers[i].experts) if w.expert_cache.elsewhere[w.expert_cache.key(i, e)]}  # fmt: skip
    assert pooled and marked == pooled


_ON_CUDA = pytest.param(
    "cuda",
    True,
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
)


@pytest.mark.parametrize(("device", "background"), [("cpu", False), ("cpu", True), _ON_CUDA])
def test_decode_steps_read_the_next_layers_guess_ahead(
    example_q8: Path, device: str, background: bool
) -> None:
    """``--prefetch`` over a host expert cache: each decode layer's worker reads the next layer's guessed
    experts (its router on this layer's input) that the pool does not hold into the host cache; logits
    as without, the cache's counters consistent, and no expert output observer in the way of the decode
    steps' mailbox (on a GPU: the steps captured)."""
    from runtime.experts import ExpertCache
    from runtime.prefetch import ReadAhead, attach_prefetcher

    want = _logits(load_model(example_q8))
    w = load_weights(example_q8, device, 0)
    w.host_experts = True
    layers = w.expert_layers()
    used = int(w.hparam("expert_used_count"))
    w.expert_cache = cache = ExpertCache(example_q8, layers, len(layers) * used * 4, used, "lfu", "cpu")
    m = build_model(w)
    h = HybridExperts(m, 16 * layers[0].record_bytes, device)
    m.hybrid = h  # type: ignore[attr-defined]
    guessed: list[tuple[int, list[int]]] = []
    read_ahead = attach_prefetcher(m, background)
    assert isinstance(read_ahead, ReadAhead) and read_ahead is h.read_ahead and not m.observers  # type: ignore[attr-defined]
    submit = read_ahead.submit

    def spy(layer: int, experts: list[int], issued_at: int) -> None:
        guessed.append((layer, experts))
        assert all(h.slot_of[h.key_base[layer] + e] < 0 for e in experts)  # none the pool holds
        submit(layer, experts, issued_at)

    read_ahead.submit = spy  # type: ignore[method-assign]
    _close(_logits(m), want)
    h.close()
    s = cache.stats
    first = min(m.routed_layers())  # type: ignore[attr-defined]
    assert guessed and all(layer != first for layer, _ in guessed)
    assert (
        s.prefetch_issued > 0
        and s.prefetch_used > 0
        and s.prefetch_used + s.prefetch_wasted <= s.prefetch_issued
    )
    assert s.bytes_read == layers[0].record_bytes * (s.misses + s.prefetch_issued)


def test_planned_hybrid_over_a_host_cache(example_q8: Path) -> None:
    """``--gpu-expert-cache`` with ``--ssd-streaming --cache-experts``, through the planner's loader."""
    from runtime.planner import load_planned_model

    record = GGUFWeights(example_q8).expert_layers()[0].record_bytes
    said: list[str] = []
    m, p = load_planned_model(
        example_q8, "cpu", "streaming", cache_experts=40, gpu_cache_bytes=8 * record, log=said.append
    )
    assert p is not None and p.mode == "hybrid" and m.hybrid.capacity == 8  # type: ignore[attr-defined]
    assert m.weights.expert_cache.capacity == 40 and "host expert cache of 40 experts" in said[0]  # type: ignore[union-attr]
    _close(_logits(m), _logits(load_model(example_q8)))
    stats = model_stats(m)
    reads = m.weights.expert_cache.stats.reads  # type: ignore[union-attr]
    assert "GPU hits" in stats and reads > 0 and "host expert cache: " in stats and f" {reads} reads" in stats
    assert cache_stats(m)["host_cache"]["reads"] == reads  # type: ignore[index]


def test_pages_to_lock_and_coldest_slots() -> None:
    """The page ranges under a file's expert views (merged when close; strided views covered whole), and
    the coldest slots without a full sort (ties to the lower slot, as a stable sort)."""
    from runtime.host_pin import merged_pages
    from runtime.hybrid import _coldest

    page = mmap.PAGESIZE
    base = torch.zeros(64 * page, dtype=torch.uint8)
    start = -(-base.data_ptr() // page) * page - base.data_ptr()  # the first page boundary in it
    a, b = base[start + 10 : start + 20], base[start + page + 5 : start + 2 * page + 1]
    far = base[start + 40 * page : start + 41 * page]
    lo = base.data_ptr() + start
    assert merged_pages([a, b, far], gap=0) == [(lo, 3 * page), (lo + 40 * page, page)]
    assert merged_pages([far, a], gap=64 * page) == [(lo, 41 * page)]
    strided = base[start : start + 8 * page].view(8, page)[:, :16]  # 8 rows of 16 bytes, a page apart
    assert merged_pages([strided], gap=0) == [(lo, 8 * page)]
    rng = np.random.default_rng(0)
    for _ in range(500):
        count = rng.integers(0, 4, int(rng.integers(1, 40))).astype(np.float64)
        count[rng.random(count.size) < 0.2] = np.inf
        n = int(rng.integers(0, count.size + 2))
        assert np.array_equal(_coldest(count, n), np.argsort(count, kind="stable")[:n])


def test_locked_pages_are_released_when_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Page-locked ranges keep the memory they lock alive and are unlocked once: by ``release``, or when
    dropped unreleased (a registration outliving its mapping would serve a later mapping's copies stale pages:
    NaNs on the GPU when a hybrid model was dropped without ``close`` and another file mapped)."""
    import gc
    import weakref

    from runtime import host_pin

    calls: list[int] = []

    class Driver:
        def cudaHostRegister(self, ptr: int, n: int, flags: int) -> int:  # noqa: N802
            return 0

        def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
            calls.append(ptr)
            return 0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Driver())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    page = mmap.PAGESIZE
    mem = torch.zeros(8 * page, dtype=torch.uint8)
    alive = weakref.ref(mem)
    pinned = host_pin.pin([mem[: 2 * page], mem[6 * page :]], available=1 << 40)
    assert pinned is not None and len(pinned.ranges) == 1
    ptr = pinned.ranges[0][0]
    del mem
    gc.collect()
    assert alive() is not None and calls == []  # held while locked
    del pinned
    gc.collect()
    assert calls == [ptr] and alive() is None
    calls.clear()
    pinned = host_pin.pin([torch.zeros(4 * page, dtype=torch.uint8)], available=1 << 40)
    assert pinned is not None
    pinned.release()
    assert len(calls) == 1 and pinned.ranges == []
    del pinned
    gc.collect()
    assert len(calls) == 1  # released once


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_waits_for_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stream holds until a host thread writes the step number into page-locked memory; a wait that
    nobody answers gives up after its reads and sets the fault flag."""
    import threading
    import time

    from runtime.backends import host_wait

    done = torch.zeros(4, dtype=torch.int32, pin_memory=True)
    fault = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    step = torch.full((1,), 3, dtype=torch.int32, device="cuda")
    after = torch.zeros(1, device="cuda")
    host_wait.wait_for_host(done, 2, step, fault)
    after.fill_(1.0)
    time.sleep(0.2)
    assert not torch.cuda.current_stream().query()  # held by the wait
    threading.Timer(0.1, lambda: done.__setitem__(2, 3)).start()
    torch.cuda.synchronize()
    assert after.item() == 1.0 and int(fault[0]) == 0
    monkeypatch.setattr(host_wait, "LIMIT", 1000)
    host_wait.wait_for_host(done, 1, step, fault)
    torch.cuda.synchronize()
    assert int(fault[0]) == 1


def test_a_step_the_cpu_side_never_answers_fails_closed(
    example_q8: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the CPU worker does not answer a decode step, the wait gives up (its fault flag set) and the next
    use of the executor raises a ForgeError instead of computing on with a missing share."""
    from runtime.backends import host_wait

    m, h = _hybrid(example_q8)
    state = m.new_state(64)
    ids = _ids()
    m.forward(ids[:PREFILL], state)
    monkeypatch.setattr(host_wait, "CPU_TIMEOUT", 0.2)
    monkeypatch.setattr(HybridExperts, "_serve_step", lambda self, ex: None)  # never answers
    m.forward(ids[PREFILL : PREFILL + 1], state)
    assert int(h.exchange.fault[0]) == 1
    with pytest.raises(ForgeError, match="did not answer"):
        h.finish_step()
    h.close()


def test_a_batch_splits_its_misses_between_copies_and_the_cpu_for_the_shortest_batch() -> None:
    """The CPU takes the experts cheapest for it while the others are copied: the batch lasts as long as the
    later of the two, which no other split shortens (checked against every split of small batches)."""
    import itertools

    rates = Rates(upload_bps=100.0, cpu_expert_s=0.5, cpu_pair_s=0.25)  # a 100-byte record: 1 s to copy

    def batch_seconds(pairs: np.ndarray, upload: np.ndarray, rates: Rates = rates) -> float:
        return max(rates.cpu_seconds(pairs[~upload]), float(upload.sum()))

    # each expert alone is copied sooner than computed (1.5 s), yet an idle CPU takes three of eight
    pairs = np.full(8, 4)
    assert rates.upload(100, pairs).tolist() == [False] * 3 + [True] * 5
    assert batch_seconds(pairs, rates.upload(100, pairs)) == 5.0  # copying all eight: 8 s
    # experts of fewer than 3 pairs taken from the encoded bytes: 0.2 s a pair
    direct = Rates(upload_bps=100.0, cpu_expert_s=0.5, cpu_pair_s=0.25, cpu_direct_s=0.2, direct_below=3)
    assert direct.cpu_costs(np.array([1, 2, 3])).tolist() == pytest.approx([0.2, 0.4, 1.25])
    rng = np.random.default_rng(0)
    for _ in range(200):
        for r in (rates, direct):
            pairs = rng.integers(1, 12, rng.integers(1, 9))
            got = batch_seconds(pairs, r.upload(100, pairs), r)
            best = min(
                batch_seconds(pairs, np.array(split, bool), r)
                for split in itertools.product([False, True], repeat=pairs.size)
            )
            assert got == pytest.approx(best)
    assert not Rates.never().upload(100, pairs).any() and Rates.always().upload(100, pairs).all()


def test_rates_are_measured_at_load(example_q8: Path) -> None:
    """Without given rates the executor measures them on its first layer: the copies, the CPU's decoded
    experts and its experts of one pair (``cpu_kernels.DIRECT_BELOW``, taken from the encoded bytes)."""
    from runtime import cpu_kernels

    m, h = _hybrid(example_q8, rates=None)
    r = h.rates
    layer = h.hybrid_layers[min(h.hybrid_layers)]
    assert r.direct_below == cpu_kernels.DIRECT_BELOW[layer.encoded.acts] >= 2
    assert r.upload_bps > 0 and r.cpu_direct_s > 0 and r.cpu_pair_s >= 0 and r.cpu_expert_s >= 0
    assert np.isfinite([r.upload_bps, r.cpu_direct_s, r.cpu_pair_s, r.cpu_expert_s]).all()
    _close(_logits(m), _logits(load_model(example_q8)))


def test_stats_since_a_snapshot_count_what_came_after() -> None:
    """A benchmark's warm-up taken off its timed steps: the snapshot keeps its own lists (the worker adds to
    the live ones in place), and ``since`` subtracts each count, a list's entry by entry, ``k`` as now."""
    s = HybridStats(step_layers=3, k=8, step_cpu_calls=[0, 1], step_cpu_seconds_by_misses=[0.0, 0.5])
    snap = s.snapshot()
    s.step_layers += 2
    s.step_cpu_calls[1] += 4
    s.step_cpu_calls.append(2)
    s.step_cpu_seconds_by_misses[1] += 1.0
    assert snap.step_cpu_calls == [0, 1] and snap.step_cpu_seconds_by_misses == [0.0, 0.5]
    d = s.since(snap)
    assert d.step_layers == 2 and d.k == 8 and d.gpu_hits == 0
    assert d.step_cpu_calls == [0, 4, 2] and d.step_cpu_seconds_by_misses == [0.0, 1.0]
