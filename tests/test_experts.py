"""Runtime on expert-major files and SSD-streamed experts: logits bit-identical to the canonical file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import oracle
import pytest
import torch

from forge.errors import ForgeError
from forge.layout import convert
from runtime.experts import ExpertCache
from runtime.models import MoeCausalLM, load_model
from runtime.observers import Observer
from runtime.planner import RUNTIME_OVERHEAD, plan
from runtime.weights import GGUFWeights

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

LLAMACPP = [
    ("tiny-qwen3moe", "tiny-qwen3moe-Q4_K_M-imat.gguf"),
    ("tiny-qwen35moe", "tiny-qwen35moe-IQ2_XXS-imat.gguf"),
]


def _ids(n: int = 24) -> torch.Tensor:
    return torch.randint(0, 4096, (n,), generator=torch.Generator().manual_seed(7))


def _logits(path: Path, **kw: object) -> torch.Tensor:
    """A prefill of 24 tokens, then 3 single-token decode steps (both expert paths)."""
    m = load_model(path, **kw)  # type: ignore[arg-type]
    state = m.new_state(64)
    ids = _ids()
    out = [m.forward(ids[:21], state)]
    out += [m.forward(ids[i : i + 1], state) for i in range(21, 24)]
    return torch.cat(out)


def _expert_major(src: Path, tmp: Path, version: str) -> Path:
    dst = tmp / f"{src.stem}-{version}.gguf"
    convert(src, dst, version)
    return dst


def _check_layouts(src: Path, tmp: Path) -> None:
    for budget in (0, 1 << 30):  # experts decoded per use, and decoded once and kept
        want = _logits(src, expert_budget=budget)
        for version in ("v2", "v1"):
            got = _logits(_expert_major(src, tmp, version), expert_budget=budget)
            assert torch.equal(got, want), (version, budget)


def test_forge_q8_expert_major_logits_equal_canonical(example_q8: Path, tmp_path: Path) -> None:
    _check_layouts(example_q8, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "name"), LLAMACPP)
def test_llamacpp_expert_major_logits_equal_canonical(model: str, name: str, tmp_path: Path) -> None:
    _check_layouts(oracle.llamacpp_output(model, name), tmp_path)


def test_expert_major_reads_one_slice_per_expert(example_q8: Path, tmp_path: Path) -> None:
    native = _expert_major(example_q8, tmp_path, "v2")
    canon, em = GGUFWeights(example_q8), GGUFWeights(native)
    assert not canon.has("ds4.expert_major.v2") and em.store is not None
    layers = em.expert_layers()
    assert all(len(lay.reads) == 1 for lay in layers.values())
    assert all(len(lay.reads) == 3 for lay in canon.expert_layers().values())
    name = "blk.1.ffn_down_exps.weight"
    assert em.qtype(name) == canon.qtype(name) and em.shape(name) == canon.shape(name)
    assert torch.equal(em.raw(name), canon.raw(name))


def test_corrupted_expert_major_payload_is_refused(example_q8: Path, tmp_path: Path) -> None:
    native = _expert_major(example_q8, tmp_path, "v2")
    em = GGUFWeights(native)
    off = em.expert_layers()[1].reads[0][0]
    data = bytearray(native.read_bytes())
    data[off + 17] ^= 0x40
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ForgeError, match="payload digest"):
        load_model(bad)


# streaming ------------------------------------------------------------------------------------------------


def _floor(path: Path) -> int:
    w = GGUFWeights(path)
    return len(w.expert_layers()) * int(w.hparam("expert_used_count")) + 1


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_streaming_with_floor_cache_equals_resident(example_q8: Path, tmp_path: Path, policy: str) -> None:
    resident = _logits(example_q8, expert_budget=0)
    native = _expert_major(example_q8, tmp_path, "v2")
    for path in (example_q8, native):
        got = _logits(path, stream_experts=_floor(path), expert_policy=policy)
        assert torch.equal(got, resident), path.name


@pytest.mark.slow
@pytest.mark.parametrize(("model", "name"), LLAMACPP)
def test_llamacpp_streaming_equals_resident(model: str, name: str, tmp_path: Path) -> None:
    src = oracle.llamacpp_output(model, name)
    resident = _logits(src, expert_budget=0)
    for path in (src, _expert_major(src, tmp_path, "v1")):
        assert torch.equal(_logits(path, stream_experts=_floor(path)), resident), path.name


def test_cpu_decode_kernels_read_per_use_and_streamed_experts_encoded(
    example_q8: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    native = _expert_major(example_q8, tmp_path, "v2")
    for path in (example_q8, native):
        per_use = load_model(path, expert_budget=0, verify_experts=False)
        streamed = load_model(path, stream_experts=_floor(path), verify_experts=False)
        for a, b in zip(per_use.blocks, streamed.blocks, strict=True):  # type: ignore[attr-defined]
            assert a.moe.backend.NAME == b.moe.backend.NAME == "cpu"
            assert a.moe.source.kind == "per-use" and a.moe.source.has_records()
            assert b.moe.source.kind == "streamed" and b.moe.source.has_records()
    monkeypatch.setenv("FORGE_NO_NUMBA", "1")  # the torch path (CUDA, MPS) gives the same logits within 1e-4
    plain = _logits(example_q8, stream_experts=_floor(example_q8))
    monkeypatch.delenv("FORGE_NO_NUMBA")
    compiled = _logits(example_q8, stream_experts=_floor(example_q8))
    assert (compiled - plain).abs().max() <= 1e-4 * plain.abs().max()


def test_cache_below_floor_is_refused(example_q8: Path) -> None:
    floor = _floor(example_q8)
    with pytest.raises(ForgeError, match=f"below the floor of {floor}"):
        load_model(example_q8, stream_experts=floor - 1)


def test_cache_counts_reads(example_q8: Path, tmp_path: Path) -> None:
    native = _expert_major(example_q8, tmp_path, "v2")
    for path, reads_per_expert in ((example_q8, 3), (native, 1)):
        m = load_model(path, stream_experts=_floor(path) + 5)
        cache = m.weights.expert_cache
        assert isinstance(cache, ExpertCache)
        state = m.new_state(16)
        ids = _ids(4)
        for i in range(4):
            m.forward(ids[i : i + 1], state)
        s = cache.stats
        assert s.lookups == 4 * m.n_layer * m.n_expert_used == s.hits + s.misses
        assert s.misses > 0 and s.reads == reads_per_expert * s.misses
        record = next(iter(cache.layers.values())).record_bytes
        assert s.bytes_read == record * s.misses


def _small_synth(tmp: Path, layers: int = 2, experts: int = 64, used: int = 4) -> Path:
    """A synthesized model whose layers have many more experts than the cache floor."""
    from runtime.synth import SynthGeometry, synthesize

    geo = SynthGeometry(layers, experts, used, hidden=256, expert_ff=256, heads=4, kv_heads=2, head_dim=64,
                        vocab=512)  # fmt: skip
    path = tmp / f"synth-{layers}x{experts}.gguf"
    synthesize(path, geo, "q4_k")
    return path


def test_device_slab_path_equals_resident(example_q8: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The slab as a torch tensor filled through a staging row (what --device cuda uses), run on the CPU
    with torch ops as on CUDA (no compiled CPU kernels)."""
    from runtime.models import build_model
    from runtime.weights import load_weights

    monkeypatch.setenv("FORGE_NO_NUMBA", "1")

    w = load_weights(example_q8)
    assert isinstance(w, GGUFWeights)
    cache = ExpertCache(w.path, w.expert_layers(), _floor(example_q8), int(w.hparam("expert_used_count")),
                        slab_device="cpu")  # fmt: skip
    assert cache.slab_device is not None and not hasattr(cache, "slab")
    w.expert_cache = cache
    m = build_model(w)
    state, ids = m.new_state(64), _ids()
    got = torch.cat([m.forward(ids[:21], state), *(m.forward(ids[i : i + 1], state) for i in range(21, 24))])
    assert torch.equal(got, _logits(example_q8, expert_budget=0))
    assert cache.stats.misses > 0


class _Routing(Observer):
    def __init__(self) -> None:
        self.distinct: dict[int, int] = {}

    def on_routing(
        self, layer: int, experts: torch.Tensor, weights: torch.Tensor, logits: torch.Tensor
    ) -> None:
        if experts.shape[0] > 1:
            self.distinct[layer] = int(experts.unique().numel())


@pytest.mark.parametrize("layout", ["canonical", "v2"])
def test_prefill_with_floor_cache_equals_resident(tmp_path: Path, layout: str) -> None:
    src = _small_synth(tmp_path)
    path = src if layout == "canonical" else _expert_major(src, tmp_path, "v2")
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(3))

    def logits(**kw: object) -> tuple[torch.Tensor, MoeCausalLM]:
        m = load_model(path, verify_experts=False, **kw)  # type: ignore[arg-type]
        st = m.new_state(64)
        out = torch.cat([m.forward(ids[:36], st), *(m.forward(ids[i : i + 1], st) for i in range(36, 40))])
        return out, m

    want, _ = logits(expert_budget=0)
    floor, routing = _floor(path), _Routing()
    got, m = logits(stream_experts=floor, observers=[routing])
    assert torch.equal(got, want)
    cache = m.weights.expert_cache
    assert isinstance(cache, ExpertCache) and cache.capacity == floor
    # the prefill routed each layer to more experts than the cache holds, yet no request decoded more
    # than one group (experts per token) at once
    assert min(routing.distinct.values()) > floor
    assert cache.stats.peak_decoded == m.n_expert_used


# planner, CLI, memory ----------------------------------------------------------------------------------


def _forge(*args: str) -> subprocess.CompletedProcess[str]:
    code = "import sys; from forge.cli import main; sys.argv = ['forge', *sys.argv[1:]]; main()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)


def test_auto_picks_resident_then_streaming_under_a_small_budget(example_q8: Path) -> None:
    w = GGUFWeights(example_q8)
    p = plan(w)
    assert p.mode == "resident" and "fits in available memory" in p.describe()
    g = p.geometry
    assert g is not None
    fixed = g.resident_bytes + g.kv_bytes + RUNTIME_OVERHEAD + g.scratch_bytes
    small = plan(w, memory_budget=fixed + (g.floor + 2) * g.slot_bytes)
    assert small.mode == "streaming" and small.cache_experts == g.floor + 2
    assert "expert cache: " in small.describe() and "--memory-budget" in small.describe()
    with pytest.raises(ForgeError, match=f"floor of {g.floor} experts"):
        plan(w, memory_budget=fixed + (g.floor - 1) * g.slot_bytes)


@pytest.mark.slow
def test_cli_prints_decision_and_stats(example_q8: Path) -> None:
    common = ["run", str(example_q8), "-p", "Hello there", "-n", "3", "--stats"]
    r = _forge(*common)
    assert r.returncode == 0, r.stderr
    assert "residency: resident" in r.stderr and "expert cache: none" in r.stderr
    assert "cpu products: K-quant rows on " in r.stderr
    r = _forge(*common, "--memory-budget", "500M")
    assert r.returncode == 0, r.stderr
    assert "residency: streaming" in r.stderr and "hits" in r.stderr
    r = _forge(*common, "--ssd-streaming", "--cache-experts", str(_floor(example_q8)), "--prefetch")
    assert r.returncode == 0, r.stderr
    assert "residency: streaming" in r.stderr and "prefetch: " in r.stderr
    r = _forge(*common, "--ssd-streaming", "--cache-experts", "2")
    assert r.returncode == 1 and r.stderr.startswith("error: expert cache of 2 experts is below the floor")


def _peak_rss_run(path: Path, cache_bytes: int) -> dict[str, int]:
    code = f"""
import json, resource, torch
from runtime.planner import geometry
from runtime.weights import load_weights, open_expert_cache
from runtime.models import build_model
w = load_weights({str(path)!r}, verify_experts=False)
g = geometry(w, 64)
w.expert_cache = open_expert_cache(w, max(g.floor, {cache_bytes} // g.slot_bytes))
m = build_model(w)
st = m.new_state(64)
gen = torch.Generator().manual_seed(0)
for t in torch.randint(0, 512, (12,), generator=gen):
    m.forward(t[None], st)
s = w.expert_cache.stats
# VmHWM is this process's own peak; ru_maxrss after a vfork+exec starts from the parent's (pytest's) RSS
try:
    peak = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")) * 1024
except OSError:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps(dict(peak=peak, resident=g.resident_bytes,
                      kv=g.kv_bytes, scratch=g.scratch_bytes, slab=w.expert_cache.nbytes, misses=s.misses,
                      file=g.file_bytes)))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_streaming_peak_rss_stays_under_budget(tmp_path: Path) -> None:
    from runtime.synth import GEOMETRIES, SynthGeometry, synthesize

    geo = SynthGeometry(
        **{**GEOMETRIES["qwen3.6-35b-a3b"].__dict__, "layers": 2, "experts": 96, "vocab": 512}
    )
    src = synthesize(tmp_path / "synth.gguf", geo, "q4_k") and tmp_path / "synth.gguf"
    budget = 50 << 20
    r = _peak_rss_run(src, budget)
    assert r["file"] > 5 * budget and r["misses"] > 0
    assert r["slab"] <= budget
    assert r["peak"] <= budget + r["resident"] + r["kv"] + r["scratch"] + RUNTIME_OVERHEAD, r


def test_a_collected_cache_does_not_join_its_readers(
    example_q8: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A collection may run while a starting thread holds threading's locks; joining a reader there hung
    a test run, so a dropped cache only tells its readers to stop; ``close`` still waits for them."""
    from concurrent.futures import ThreadPoolExecutor

    w = GGUFWeights(example_q8)
    waits: list[bool] = []
    real = ThreadPoolExecutor.shutdown
    monkeypatch.setattr(
        ThreadPoolExecutor,
        "shutdown",
        lambda self, wait=True, **kw: (waits.append(wait), real(self, wait, **kw)),
    )
    for drop in (True, False):
        cache = ExpertCache(w.path, w.expert_layers(), _floor(example_q8), int(w.hparam("expert_used_count")))
        cache._readers = ThreadPoolExecutor(2)
        cache._readers.submit(int).result()
        cache.__del__() if drop else cache.close()
    assert waits == [False, True]


def test_experts_held_elsewhere_go_first(example_q8: Path) -> None:
    """A miss takes the slot of an expert another cache holds (a hybrid run's GPU pool), the least recently
    used of those, before the policy's own choice; with none marked, the policy's choice."""
    w = GGUFWeights(example_q8)
    layer = min(w.expert_layers())
    lay, used = w.expert_layers()[layer], int(w.hparam("expert_used_count"))
    assert lay.experts >= 9
    cache = ExpertCache(w.path, {layer: lay}, used + 2, used, "lru")

    def use(*ids: int) -> None:
        cache.release(cache.slots(layer, list(ids)))

    for e in range(used + 2):
        use(e)
    assert len(cache.slot_of) == cache.capacity
    cache.elsewhere[[cache.key(layer, 4), cache.key(layer, 1)]] = True
    use(6)
    assert cache.key(layer, 1) not in cache.slot_of and cache.key(layer, 4) in cache.slot_of
    use(7)
    assert cache.key(layer, 4) not in cache.slot_of
    use(8)  # nothing marked is left: the least recently used goes
    assert cache.key(layer, 0) not in cache.slot_of and cache.key(layer, 2) in cache.slot_of
    cache.close()


@pytest.mark.parametrize(("chunk", "threads"), [(0, 3), (4096, 3), (10_000, 3), (0, 0), (4096, 0)])
def test_reads_in_chunks_fill_the_same_bytes(example_q8: Path, chunk: int, threads: int) -> None:
    """``read_chunk`` splits each part of a missed expert into reads of at most that many bytes (0: one
    read a part): the slot holds the same bytes either way, read by reader threads or (0) by the requester
    after asking the kernel for every range."""
    w = GGUFWeights(example_q8)
    layers = w.expert_layers()
    layer, used = max(layers), int(w.hparam("expert_used_count"))
    lay = layers[layer]
    cache = ExpertCache(w.path, {layer: lay}, used + 1, used, "lru", read_threads=threads, read_chunk=chunk)
    slots = cache.slots(layer, [1, 5])
    cache.release(slots)
    raw = np.fromfile(w.path, np.uint8)
    for e, slot in zip([1, 5], slots, strict=True):
        for start, step, n, dst in lay.reads:
            assert np.array_equal(
                cache.slab[slot, dst : dst + n], raw[start + e * step : start + e * step + n]
            )
    parts = [n for _, _, n, _ in lay.reads]
    assert cache.stats.reads == 2 * sum(-(-n // chunk) if chunk else 1 for n in parts)
    assert chunk == 0 or max(parts) > chunk  # the chunked cases split something
    assert (cache._readers is None) == (threads == 0)
    cache.close()


def test_a_request_lets_go_of_its_own_slots_only(example_q8: Path) -> None:
    """Two requests hold slots at once (a hybrid run's CPU side computing in the slab while its copier takes
    records out): one's end leaves the other's slots held, so a miss cannot evict them; a failed request
    holds nothing."""
    w = GGUFWeights(example_q8)
    layer = min(w.expert_layers())
    lay, used = w.expert_layers()[layer], int(w.hparam("expert_used_count"))
    cache = ExpertCache(w.path, {layer: lay}, used + 1, used, "lru")
    with cache.held(layer, list(range(used))) as (_, computing):
        cache.rows(layer, [used])  # the copier's request, while the CPU side computes
        assert (cache.pinned[computing] == 1).all() and cache.pinned.sum() == used
        with pytest.raises(ForgeError, match="at once"):
            cache.rows(layer, list(range(used + 2)))
        # the one slot not held is the only one a miss may take
        cache.rows(layer, [used + 1])
        assert all(cache.key(layer, e) in cache.slot_of for e in range(used))
    assert not cache.pinned.any()
    os.close(cache._fd)
    cache._fd = os.open(os.devnull, os.O_RDONLY)  # every read now comes back empty
    with pytest.raises(ForgeError, match="truncated"):
        cache.rows(layer, [used + 2])
    assert not cache.pinned.any()
    cache.close()


def _record(path: Path, lay: object, expert: int) -> np.ndarray:
    """Expert ``expert``'s record as a slot holds it, read from the file."""
    raw = np.fromfile(path, np.uint8)
    row = np.zeros(lay.record_bytes, np.uint8)  # type: ignore[attr-defined]
    for start, step, n, dst in lay.reads:  # type: ignore[attr-defined]
        row[dst : dst + n] = raw[start + expert * step : start + expert * step + n]
    return row


def test_a_read_in_flight_holds_up_no_other_request(
    example_q8: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Misses are read outside the cache's lock: while one request reads, another is served from the cache;
    a request for the expert being read waits for that read and gets its bytes."""
    import threading

    w = GGUFWeights(example_q8)
    layer = min(w.expert_layers())
    lay, used = w.expert_layers()[layer], int(w.hparam("expert_used_count"))
    cache = ExpertCache(w.path, {layer: lay}, used + 2, used, "lru", read_threads=1)
    cache.release(cache.slots(layer, [0, 1]))
    gate, real = threading.Event(), cache._pread

    def slow(lay_: object, expert: int, *a: object) -> int:
        if expert == 5:
            assert gate.wait(30)
        return real(lay_, expert, *a)  # type: ignore[arg-type]

    monkeypatch.setattr(cache, "_pread", slow)
    got: dict[str, list[int]] = {}
    reader = threading.Thread(target=lambda: got.setdefault("reader", cache.slots(layer, [5])))
    reader.start()
    while not cache.loading.any():
        reader.join(0.01)
    hits = cache.slots(layer, [0, 1])  # served while expert 5 is being read
    waiter = threading.Thread(target=lambda: got.setdefault("waiter", cache.slots(layer, [5])))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and "waiter" not in got  # waits for the read in flight
    gate.set()
    reader.join(30)
    waiter.join(30)
    assert got["reader"] == got["waiter"] and cache.stats.misses == 3 and cache.stats.wait_seconds > 0
    assert np.array_equal(cache.slab[got["reader"][0]], _record(w.path, lay, 5))
    for held in (hits, got["reader"], got["waiter"]):
        cache.release(held)
    assert not cache.pinned.any()
    cache.close()


def test_a_failed_read_caches_nothing_and_a_full_cache_waits(example_q8: Path) -> None:
    """A read that fails leaves its expert uncached (a later request reads it again, whole); a request
    finding every slot held waits until one is let go instead of failing or waiting forever."""
    import threading

    w = GGUFWeights(example_q8)
    layer = min(w.expert_layers())
    lay, used = w.expert_layers()[layer], int(w.hparam("expert_used_count"))
    cache = ExpertCache(w.path, {layer: lay}, used + 1, used, "lru")
    fd, cache._fd = cache._fd, os.open(os.devnull, os.O_RDONLY)  # every read comes back empty
    with pytest.raises(ForgeError, match="truncated"):
        cache.slots(layer, [3])
    os.close(cache._fd)
    cache._fd = fd
    assert cache.key(layer, 3) not in cache.slot_of and not cache.pinned.any() and not cache.loading.any()
    held = cache.slots(layer, list(range(used + 1)))  # every slot held
    assert np.array_equal(cache.slab[held[3]], _record(w.path, lay, 3))
    got: list[int] = []
    other = threading.Thread(target=lambda: got.extend(cache.slots(layer, [used + 1])))
    other.start()
    other.join(0.3)
    assert other.is_alive() and not got
    cache.release(held)
    other.join(30)
    assert len(got) == 1 and np.array_equal(cache.slab[got[0]], _record(w.path, lay, used + 1))
    cache.release(got)
    cache.close()


def test_a_request_of_several_misses_takes_the_slots_one_at_a_time_would(example_q8: Path) -> None:
    """One pass picks all of a request's free slots: the experts held elsewhere first (least recently used
    first), then the least recently used, never a slot the request itself hits or another holds."""
    w = GGUFWeights(example_q8)
    layer = min(w.expert_layers())
    lay, used = w.expert_layers()[layer], int(w.hparam("expert_used_count"))
    assert lay.experts >= used + 6
    cache = ExpertCache(w.path, {layer: lay}, used + 2, used, "lru")
    for e in range(used + 2):  # least recently used first: 0, 1, ...
        cache.release(cache.slots(layer, [e]))
    other = cache.slots(layer, [1])  # held by another request
    cache.elsewhere[cache.key(layer, 5)] = True
    cache.release(cache.slots(layer, [0, used + 2, used + 3, used + 4]))  # hits 0, misses three
    gone = {e for e in range(used + 2) if cache.key(layer, e) not in cache.slot_of}
    assert gone == {5, 2, 3}
    cache.release(other)
    cache.close()


def test_requests_from_several_threads_see_their_own_records(example_q8: Path) -> None:
    """Threads asking at once for overlapping experts of a cache too small for them all: every held slot
    holds the record of the expert asked for (a read done or waited for, never one evicted under it), and
    nothing stays held or loading after."""
    import threading

    w = GGUFWeights(example_q8)
    layers, used = w.expert_layers(), int(w.hparam("expert_used_count"))
    cache = ExpertCache(w.path, layers, len(layers) * used + 3, used, "lru", read_threads=2)
    want = {(layer, e): _record(w.path, lay, e) for layer, lay in layers.items() for e in range(lay.experts)}
    errors: list[str] = []

    def requester(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(60):
            layer = int(rng.choice(sorted(layers)))
            ids = rng.choice(layers[layer].experts, int(rng.integers(1, used + 1)), replace=False).tolist()
            with cache.held(layer, ids) as (slab, slots):
                bad = [
                    e for e, s in zip(ids, slots, strict=True) if not np.array_equal(slab[s], want[layer, e])
                ]
                if bad:
                    errors.append(f"layer {layer} experts {bad}")

    threads = [threading.Thread(target=requester, args=(seed,)) for seed in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads) and not errors, errors[:3]
    assert not cache.pinned.any() and not cache.loading.any() and cache.stats.misses > 0
    cache.close()
