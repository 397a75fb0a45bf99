"""Routed experts streamed from the model file into a bounded cache of whole experts.

Every routed expert (one layer's gate, up and down slices of one expert) occupies one *slot* of a
preallocated uint8 slab. A miss reads the expert with ``os.preadv`` straight into its slot: one read
on an expert-major file (the record ``gate | up | down`` is contiguous), three on a canonical file
(one slice of each of the three stacked tensors). Slots are sized for the largest record, so a
boosted layer (bigger types) shares the slab with the others. Selected experts are decoded from
their slots per use, exactly as the resident path decodes them from the mapped file, so logits are
bit-identical.

The capacity floor is one complete routing cycle: layers x experts-per-token + 1 slots, so that a
token's experts of every layer can be resident at once with one slot to spare.

A prefill chunk may route a layer to more distinct experts than the cache holds. Such a request is
served lazily, in groups of experts-per-token experts: a group is looked up (pinned while its slots are
copied out), decoded, and dropped when the next group is asked for, so a prefill never holds more than
one group's decoded experts and never needs more slots than a decode step. The model asks for gate and
up of every expert first, then for down: when the layer's experts do not all fit, the down pass reads
the early groups again (counted as lookups and misses like any other).

Several threads may ask at once (the model, a hybrid run's copier, a :class:`runtime.prefetch.Prefetcher`
reading ahead): the cache's lock orders their slot bookkeeping, and each reads its misses without it, so
one's reads never hold up another's hits. A slot being read is never handed out until its read
completes, a prefetched slot is reserved for the layer it was predicted for until that layer has been
served, and a prefetch never evicts a slot the model has pinned, an expert of the layer being served, or
an expert used during the last full routing cycle (so a cache at the floor, where every slot is in use
each token, is left alone: a mispredicted read there costs a hit).

Slabs live in host memory by default; with ``slab_device`` (default: the cache's device when it is not
the CPU) they are a torch tensor on that device, filled through a small pinned host staging buffer.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from forge.errors import ForgeError
from runtime.weights import ExpertTensor, dequantize

ROLES = ("gate", "up", "down")


def routed_name(layer: int, role: str) -> str:
    return f"blk.{layer}.ffn_{role}_exps.weight"


@dataclass(frozen=True)
class Component:
    """One role (gate, up or down) of a layer's experts: its type, matrix shape and place in a slot."""

    role: str
    qtype: GGMLQuantizationType
    rows: int
    cols: int
    expert_bytes: int
    slot_offset: int  # byte offset of this component inside a slot


@dataclass(frozen=True)
class LayerExperts:
    """Where one layer's experts live in the file and how a slot holds one of them.

    ``reads``: (file offset of expert 0, bytes between experts, bytes, slot offset) per read; one entry
    on expert-major files, three (gate, up, down) on canonical ones.
    """

    layer: int
    experts: int
    components: tuple[Component, ...]
    reads: tuple[tuple[int, int, int, int], ...]

    @property
    def record_bytes(self) -> int:
        return sum(c.expert_bytes for c in self.components)

    def views(self, rows: Any) -> dict[str, Any]:
        """Per role, the (n, rows, row bytes) view of each of slot rows ``rows`` (n, slot bytes; a numpy
        array or a tensor), no copy."""
        return {
            c.role: rows[:, c.slot_offset : c.slot_offset + c.expert_bytes].reshape(len(rows), c.rows, -1)
            for c in self.components
        }


def _component(role: str, qtype: GGMLQuantizationType, rows: int, cols: int, offset: int) -> Component:
    block, size = GGML_QUANT_SIZES[qtype]
    return Component(role, qtype, rows, cols, rows * (cols // block) * size, offset)


def canonical_layers(tensors: dict[str, Any], n_layer: int) -> dict[int, LayerExperts]:
    """Layers of a canonical file from its tensor directory (forge.gguf_file.TensorInfo)."""
    out: dict[int, LayerExperts] = {}
    for layer in range(n_layer):
        names = [routed_name(layer, r) for r in ROLES]
        if not all(n in tensors for n in names):
            continue
        comps, reads, offset = [], [], 0
        for role, name in zip(ROLES, names, strict=True):
            t = tensors[name]
            experts, rows, cols = t.shape
            c = _component(role, t.ggml_type, rows, cols, offset)
            comps.append(c)
            reads.append((t.offset, c.expert_bytes, c.expert_bytes, offset))
            offset += c.expert_bytes
        out[layer] = LayerExperts(layer, experts, tuple(comps), tuple(reads))
    return out


def expert_major_layers(store: Any) -> dict[int, LayerExperts]:
    """Layers of an expert-major file (a ``forge.layout.ExpertStore``): one read per expert."""
    out: dict[int, LayerExperts] = {}
    for layer, lr in store.layers.items():
        comps = tuple(
            _component(
                ROLES[c.role], GGMLQuantizationType(c.ggml_type), c.dims[1], c.dims[0], c.record_offset
            )
            for c in lr.components
        )
        base = store.store_start + lr.data_offset
        out[layer] = LayerExperts(layer, lr.experts, comps, ((base, lr.stride, lr.record_bytes, 0),))
    return out


def verify_store_payload(store: Any, chunk: int = 16 << 20) -> None:
    """The expert-major payload digest, computed from file reads (not the mmap: no resident pages)."""
    h = hashlib.sha256()
    start, end = store.store_start + store.payload_offset, store.store_start + store.store_size
    fd = os.open(store.path, os.O_RDONLY)
    try:
        for pos in range(start, end, chunk):
            n = min(chunk, end - pos)
            data = os.pread(fd, n, pos)
            if len(data) != n:
                raise ForgeError(f"{store.path}: truncated expert store")
            h.update(data)
            os.posix_fadvise(fd, pos, n, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if h.digest() != store.header.payload_sha256:
        raise ForgeError(f"{store.path}: payload digest mismatch (expert data corrupted)")


# eviction policies --------------------------------------------------------------------------------------


class EvictionPolicy:
    """Ranks filled slots for reuse, lowest score first. Keys are dense integers (layer position x experts
    + expert)."""

    name = ""

    def __init__(self, capacity: int, n_keys: int) -> None:
        self.last_use = np.zeros(capacity, np.int64)
        self.tick = 0

    def access(self, key: int) -> None:
        """Every lookup of ``key``, hit or miss, before ``use``."""

    def use(self, slot: int, key: int) -> None:
        self.tick += 1
        self.last_use[slot] = self.tick

    def score(self, slot_keys: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def score(self, slot_keys: np.ndarray) -> np.ndarray:
        return self.last_use


class FrequencyPolicy(EvictionPolicy):
    """Least frequently used with aging: counts of every key seen (resident or not) are halved every
    ``window`` accesses, so that a shift in routing is followed; ties go to the least recently used."""

    name = "lfu"

    def __init__(self, capacity: int, n_keys: int, window: int | None = None) -> None:
        super().__init__(capacity, n_keys)
        self.count = np.zeros(n_keys, np.int64)
        self.window = window or max(8 * capacity, 1024)
        self.accesses = 0

    def access(self, key: int) -> None:
        self.count[key] += 1
        self.accesses += 1
        if self.accesses % self.window == 0:
            self.count >>= 1

    def score(self, slot_keys: np.ndarray) -> np.ndarray:
        return self.count[slot_keys] * (self.tick + 1) + self.last_use


_NEVER = np.iinfo(np.int64).max
_ELSEWHERE_FIRST = 1 << 62  # below any policy score (ticks and counts stay far under 2^61)


def _lowest(score: np.ndarray, excluded: np.ndarray, n: int) -> list[int]:
    """At most ``n`` slots not ``excluded`` (bool mask), those of the lowest ``score``."""
    if n == 1:  # a decode step's usual miss: one pass, no index of the candidates
        ranked = np.where(excluded, _NEVER, score)
        i = int(np.argmin(ranked))
        return [] if ranked[i] == _NEVER else [i]
    cand = np.flatnonzero(~excluded)
    if len(cand) > n:
        cand = cand[np.argpartition(score[cand], n - 1)[:n]]
    return cand.tolist()


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "lfu": FrequencyPolicy}


@dataclass
class CacheStats:
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    reads: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    evictions: int = 0
    tokens: int = 0  # forward-pass tokens, counted by the model driver when it reports them
    peak_decoded: int = 0  # most experts decoded by one request (prefill groups included)
    wait_seconds: float = 0.0  # the model waiting for a prefetch read in flight
    prefetch_issued: int = 0  # experts read by the prefetcher (also in reads / bytes_read)
    prefetch_used: int = 0  # ... later hit by the model before being evicted
    prefetch_wasted: int = 0  # ... evicted unused (issued - used - wasted: still cached, unused)
    prefetch_seconds: float = 0.0  # read time spent in the background

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def to_json(self) -> dict[str, float | int]:
        out: dict[str, float | int] = dict(self.__dict__)
        out["hit_rate"] = round(self.hit_rate, 6)
        secs = self.read_seconds + self.prefetch_seconds  # bytes_read counts both
        out["read_mb_per_s"] = round(self.bytes_read / secs / 1e6, 1) if secs else 0.0
        return out


@dataclass
class _Pending:
    ids: list[int]
    decoded: dict[str, list[torch.Tensor]] = field(default_factory=dict)


@dataclass
class _Group:
    """The decoded roles of one group of a layer's grouped (prefill) request."""

    ids: tuple[int, ...]
    index: int
    decoded: dict[str, list[torch.Tensor]]


class GroupedExperts(Sequence[torch.Tensor]):
    """One role's matrices of a layer's experts ``ids``, decoded a group at a time on access."""

    def __init__(self, cache: ExpertCache, layer: int, role: str, ids: tuple[int, ...]) -> None:
        self.cache, self.layer, self.role, self.ids = cache, layer, role, ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> torch.Tensor:  # type: ignore[override]
        if not -len(self.ids) <= i < len(self.ids):
            raise IndexError(i)
        i %= len(self.ids)
        size = self.cache.group_size
        return self.cache.group_matrices(self.layer, self.role, self.ids, i // size)[i % size]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self[i] for i in range(len(self.ids)))


#: the most bytes of one read of a missed expert (``ExpertCache.read_chunk``; 0: a whole part). Smaller reads
#: did not serve a decode step's misses faster on the disks measured (``benchmarks/disk_reads.py``)
READ_CHUNK = 0


def _chunks(part: tuple[int, int, int, int], chunk: int) -> list[tuple[int, int, int, int]]:
    """One item of ``LayerExperts.reads`` as reads of at most ``chunk`` bytes each (0: the whole item)."""
    start, step, n, dst = part
    if chunk <= 0 or n <= chunk:
        return [part]
    return [(start + o, step, min(chunk, n - o), dst + o) for o in range(0, n, chunk)]


class ExpertCache:
    """A bounded cache of whole routed experts, filled from the file with positional reads."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        layers: dict[int, LayerExperts],
        capacity: int,
        experts_used: int,
        policy: str = "lru",
        device: str | torch.device = "cpu",
        slab_device: str | torch.device | None = None,
        drop_pages: bool = False,
        read_threads: int = 4,
        read_chunk: int = READ_CHUNK,
    ) -> None:
        """``drop_pages``: evict every range read from the OS page cache again (benchmarks: each miss then
        costs a device read, as on a machine whose RAM cannot cache the file). ``read_threads``: preads
        in flight at once for one request's misses (0: no reader threads; the kernel is asked for every
        range first, ``posix_fadvise(WILLNEED)``, and the requester reads them in turn); ``read_chunk``: the
        most bytes of one read (0: a whole part), so that one missed expert can be more reads in flight."""
        self._fd = -1
        self._readers: ThreadPoolExecutor | None = None
        self.drop_pages = drop_pages
        if not layers:
            raise ForgeError(f"{path}: no routed expert tensors to stream")
        self.floor = len(layers) * experts_used + 1
        if capacity < self.floor:
            raise ForgeError(
                f"expert cache of {capacity} experts is below the floor of {self.floor} "
                f"({len(layers)} layers x {experts_used} experts per token + 1)"
            )
        if policy not in POLICIES:
            raise ForgeError(f"unknown expert cache policy {policy!r} (choose from {', '.join(POLICIES)})")
        self.path, self.layers, self.device = str(path), layers, torch.device(device)
        self.group_size = experts_used
        self.slot_bytes = max(lay.record_bytes for lay in layers.values())
        total = sum(lay.experts for lay in layers.values())
        self.capacity = min(capacity, total)
        self._key_base: dict[int, int] = {}
        base = 0
        for layer in sorted(layers):
            self._key_base[layer] = base
            base += layers[layer].experts
        if slab_device is None and self.device.type != "cpu":
            slab_device = self.device
        self.slab_device = None if slab_device is None else torch.device(slab_device)
        if self.slab_device is None:
            self.slab = np.empty((self.capacity, self.slot_bytes), np.uint8)
            self._slab_t = torch.from_numpy(self.slab)
        else:  # reads land in each requester's host staging rows, then are copied over
            self._slab_t = torch.empty(
                (self.capacity, self.slot_bytes), dtype=torch.uint8, device=self.slab_device
            )
        self._stages = threading.local()  # a requester's host staging rows for a device slab
        self.slot_key = np.full(self.capacity, -1, np.int64)  # -1: empty (never filled, or its read failed)
        self.slot_of: dict[int, int] = {}
        self.policy = POLICIES[policy](self.capacity, total)
        #: keys another cache holds (a hybrid run's GPU pool): evicted first, so that the two hold different experts
        self.elsewhere = np.zeros(total, bool)
        self.stats = CacheStats()
        self._pending: dict[int, _Pending] = {}
        self._groups: dict[int, _Group] = {}
        # the slot bookkeeping is guarded by _lock; reads run outside it, so that one requester's reads
        # (the model's, a hybrid run's copier, the prefetcher) do not hold up another's lookups and reads
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a read ended or a slot was let go
        # per slot, the requests holding it (the model's, a hybrid run's copier): none is evicted while held
        self.pinned = np.zeros(self.capacity, np.int32)
        self.loading = np.zeros(self.capacity, bool)  # slots being read (by any requester)
        self.reserved_for = np.full(self.capacity, -1, np.int64)  # layer a prefetched slot waits for
        self._reserving = False  # some slot may be reserved (saves a pass over the slots per request)
        self.prefetched = np.zeros(self.capacity, bool)  # prefetched, not yet hit
        self.serving = -1  # the layer of the last request served
        # policy ticks at which the last two routing cycles (passes over the first layer) began: a prefetch
        # only evicts an expert unused since the earlier one (one that the last full cycle did not need)
        self._cycle_ticks = [0, 0]
        self._first_layer = min(layers)
        self.protected_keys: list[int] = []  # keys the prefetcher must not evict
        self.prefetching = False  # a Prefetcher is attached
        self.simulate = False  # benchmarks: fill the bookkeeping of misses without reading them
        #: preads in flight at once for the misses of one request
        self.read_threads = max(0, read_threads)
        self.read_chunk = read_chunk
        #: a read ahead asks for all its ranges first (``posix_fadvise(WILLNEED)``): its reads in flight at once
        #: (``benchmarks/read_ahead.py``, this box's disk: 17.5 against 19.3 ms a token one read at a time)
        self.ahead_hints = True
        self._fd = os.open(self.path, os.O_RDONLY)
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)  # expert reads are scattered: no readahead

    @property
    def nbytes(self) -> int:
        return self._slab_t.nbytes

    def close(self, wait: bool = True) -> None:
        if self._readers is not None:
            self._readers.shutdown(wait=wait)
            self._readers = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        # no join: a collection can run inside threading's own locks (a thread starting), and joining a
        # reader there waits on the lock its own thread holds (a test run hung so)
        self.close(wait=False)

    def key(self, layer: int, expert: int) -> int:
        return self._key_base[layer] + expert

    # slots ----------------------------------------------------------------------------------------------
    def _pread(self, lay: LayerExperts, expert: int, row: np.ndarray, parts: Sequence | None = None) -> int:
        """Read the record of ``expert`` into ``row`` (uint8, slot_bytes), or those of its ``parts`` (items of
        ``lay.reads``); returns the reads made."""
        reads = 0
        for start, step, n, dst in lay.reads if parts is None else parts:
            buf, pos, done = memoryview(row[dst : dst + n]), start + expert * step, 0
            while done < n:
                got = os.preadv(self._fd, [buf[done:]], pos + done)
                if got <= 0:
                    raise ForgeError(f"{self.path}: truncated file (layer {lay.layer} expert {expert})")
                done += got
                reads += 1
            if self.drop_pages:
                os.posix_fadvise(self._fd, start + expert * step, n, os.POSIX_FADV_DONTNEED)
        return reads

    def _read_misses(self, lay: LayerExperts, misses: list[tuple[int, int]], ahead: bool = False) -> int:
        """Read the (expert, slot) records of one request, without the lock; returns the reads made. Several
        preads are in flight at once (an SSD serves scattered reads faster in parallel; pread releases the
        GIL): ``read_threads`` of them. ``ahead``: a read ahead's, on the calling thread (none queued ahead
        of the model's in the reader threads), all its ranges asked for first (``ahead_hints``) or one read
        at a time.
        A device slab is filled through the requester's pinned host rows with one copy."""
        if self.slab_device is None:
            rows = [self.slab[slot] for _, slot in misses]
        else:
            stage = getattr(self._stages, "rows", None)
            if stage is None or len(stage) < len(misses):
                stage = self._stages.rows = self._host_rows(max(len(misses), self.group_size))
            rows = list(stage.numpy()[: len(misses)])
        # a job per chunk of each part of each expert: as many reads in flight as there are threads
        pieces = [piece for part in lay.reads for piece in _chunks(part, self.read_chunk)]
        jobs = [(e, row, (piece,)) for (e, _), row in zip(misses, rows, strict=True) for piece in pieces]
        if (self.ahead_hints if ahead else self.read_threads == 0) and len(jobs) > 1:
            # every range asked for first: the kernel has them in flight at once, no hand-offs to threads
            for e, _, ((start, step, n, _),) in jobs:
                os.posix_fadvise(self._fd, start + e * step, n, os.POSIX_FADV_WILLNEED)
        if ahead or len(jobs) == 1 or self.read_threads <= 1:
            reads = sum(self._pread(lay, *job) for job in jobs)
        else:  # every read ends before an error is raised: none may land in a slot given up for it
            pool = self._pool()
            futures = [pool.submit(self._pread, lay, *job) for job in jobs]
            wait(futures)
            reads = sum(f.result() for f in futures)
        if self.slab_device is not None:
            index = torch.tensor([slot for _, slot in misses], device=self.slab_device)
            self._slab_t.index_copy_(0, index, stage[: len(misses)].to(self.slab_device))
        return reads

    def _host_rows(self, n: int) -> torch.Tensor:
        """(n, slot_bytes) host staging rows, pinned for a CUDA slab."""
        assert self.slab_device is not None
        pin = self.slab_device.type == "cuda"
        return torch.empty((n, self.slot_bytes), dtype=torch.uint8, pin_memory=pin)

    def _pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._readers is None:
                self._readers = ThreadPoolExecutor(self.read_threads, thread_name_prefix="expert-read")
            return self._readers

    def _free_slots(self, n: int, busy: np.ndarray) -> list[int] | None:
        """``n`` slots to fill, none ``busy`` (the caller's mask, marked here); None if there are fewer.
        First empty slots, then the least recently used of the experts another cache holds (``elsewhere``),
        then the policy's choice; slots reserved for a coming layer (prefetched) only when nothing else is
        left. One pass over the slots for all of a request's misses."""
        if n <= 0:
            return []
        reserved = self.reserved_for >= 0 if self._reserving else None
        if self.capacity - np.count_nonzero(busy) < n:
            return None
        out: list[int] = []
        if len(self.slot_of) < self.capacity:  # some slot holds nothing
            out = np.flatnonzero(~busy & (self.slot_key < 0))[:n].tolist()
            busy[out] = True
        if len(out) < n:
            # one ranking: the experts held elsewhere first (by last use), then the policy's order
            rank = self.policy.score(self.slot_key)
            rank = np.where(self.elsewhere[self.slot_key], self.policy.last_use - _ELSEWHERE_FIRST, rank)
            held = busy if reserved is None else busy | reserved
            got = _lowest(rank, held, n - len(out))
            out += got
            if len(out) < n:  # only slots reserved for a coming layer are left
                busy[got] = True
                out += _lowest(rank, busy, n - len(out))
        return out

    def _busy(self) -> np.ndarray:
        return (self.pinned > 0) | self.loading

    def _evict(self, slot: int) -> None:
        key = int(self.slot_key[slot])
        if key >= 0:
            del self.slot_of[key]
            self.stats.evictions += 1
        if self.prefetched[slot]:
            self.stats.prefetch_wasted += 1
            self.prefetched[slot] = False
        self.reserved_for[slot] = -1

    def _claim(self, slot: int, key: int) -> None:
        """Under the lock: ``slot``'s expert evicted, the slot given to ``key`` and marked being read."""
        self._evict(slot)
        self.slot_key[slot] = key
        self.slot_of[key] = slot
        self.loading[slot] = True

    def _read_ended(self, slots: list[int], failed: bool = False) -> None:
        """Under the lock: the reads into ``slots`` are over (their waiters woken); ``failed``: the slots are
        empty again, their experts no longer cached."""
        self.loading[slots] = False
        for slot in slots if failed else ():
            key = int(self.slot_key[slot])
            if self.slot_of.get(key) == slot:
                del self.slot_of[key]
            self.slot_key[slot] = -1
            self.prefetched[slot] = False
            self.reserved_for[slot] = -1
        self._changed.notify_all()

    def serve(self, layer: int, ids: list[int]) -> None:
        """The model has routed ``layer`` to experts ``ids`` (before it asks for them): a read ahead leaves
        them alone, and one for an earlier layer is stale from now on."""
        keys = [self._key_base[layer] + e for e in ids]
        with self._lock:
            self._serving(layer)
            self._unreserve(layer - 1)
            self.protected_keys = keys

    def _serving(self, layer: int) -> None:
        if layer == self._first_layer and self.serving != layer:
            self._cycle_ticks = [self._cycle_ticks[1], self.policy.tick]
        self.serving = layer

    def _unreserve(self, layer: int) -> None:
        """Slots prefetched for ``layer`` or an earlier one have had their chance."""
        if self._reserving:
            self.reserved_for[(self.reserved_for >= 0) & (self.reserved_for <= layer)] = -1
            self._reserving = bool((self.reserved_for >= 0).any())

    def slots(self, layer: int, ids: list[int], serve: bool = True) -> list[int]:
        """Slots holding experts ``ids`` of ``layer`` (at most ``capacity``), reading misses.

        The slots stay held until :meth:`release` of them (none if this fails). The lookups are made under
        the cache's lock, the misses read without it; a hit on an expert another requester is still
        reading waits for that read, after this request's own. ``serve=False``: a request that is not the
        model's own (a hybrid run's copier): it moves no read ahead's clock.
        """
        lay = self.layers[layer]
        if len(ids) > self.capacity and len(set(ids)) > self.capacity:
            raise ForgeError(f"{len(ids)} experts requested at once, the cache holds {self.capacity}")
        with self._lock:
            if serve:
                self._serving(layer)
            out, misses, others = self._take(layer, ids)
            if serve:
                self._unreserve(layer)
        if not misses and not others:
            return out
        mine = [slot for _, slot in misses]
        t0 = time.perf_counter()
        try:
            reads = self._read_misses(lay, misses) if misses and not self.simulate else 0
        except BaseException:
            with self._lock:
                self._read_ended(mine, failed=True)
                self._let_go(out)
            raise
        with self._lock:
            if misses:
                self._read_ended(mine)
                if not self.simulate:
                    self.stats.reads += reads
                    self.stats.bytes_read += lay.record_bytes * len(misses)
                    self.stats.read_seconds += time.perf_counter() - t0
            if others:
                self._wait_for(layer, others, out)
        return out

    def _take(self, layer: int, ids: list[int]) -> tuple[list[int], list[tuple[int, int]], list[tuple[int, int]]]:  # fmt: skip
        """``slots``' lookups, under the lock: each expert's slot held, misses given free slots (waiting
        for some, holding nothing, when every slot is held or being read) and marked loading. Returns the
        slots, the (expert, slot) misses to read, and the (key, slot) hits another requester is reading."""
        base = self._key_base[layer]
        keys = [base + e for e in ids]
        while True:
            missing = {k for k in keys if k not in self.slot_of}
            if not missing:
                fresh = []
                break
            busy = self._busy()
            busy[[self.slot_of[k] for k in keys if k not in missing]] = True
            fresh = self._free_slots(len(missing), busy)
            if fresh is not None:
                break
            self._changed.wait()
        out: list[int] = []
        misses: list[tuple[int, int]] = []
        others: list[tuple[int, int]] = []
        fresh_slots, reading = iter(fresh), set()
        for e, key in zip(ids, keys, strict=True):
            self.stats.lookups += 1
            self.policy.access(key)
            slot = self.slot_of.get(key)
            if slot is None:
                self.stats.misses += 1
                slot = next(fresh_slots)
                reading.add(slot)
                self._claim(slot, key)
                misses.append((e, slot))
            else:
                self.stats.hits += 1
                if self.loading[slot] and slot not in reading:
                    others.append((key, slot))
                if self.prefetched[slot]:
                    self.stats.prefetch_used += 1
                    self.prefetched[slot] = False
            self.pinned[slot] += 1
            out.append(slot)
            self.policy.use(slot, key)
        return out, misses, others

    def _wait_for(self, layer: int, others: list[tuple[int, int]], out: list[int]) -> None:
        """Wait (under the lock) for the reads of hits another requester was making; if one failed, let go
        of ``out`` and fail too."""
        t0 = time.perf_counter()
        try:
            for key, slot in others:
                while self.loading[slot]:
                    self._changed.wait()
                if self.slot_key[slot] != key:
                    expert = key - self._key_base[layer]
                    raise ForgeError(f"{self.path}: the read of layer {layer} expert {expert} failed")
        except BaseException:
            self._let_go(out)
            raise
        self.stats.wait_seconds += time.perf_counter() - t0

    def release(self, slots: list[int]) -> None:
        """Let go of ``slots`` (as :meth:`slots` returned them)."""
        with self._lock:
            self._let_go(slots)

    def _let_go(self, slots: list[int]) -> None:
        if len(set(slots)) == len(slots):
            self.pinned[slots] -= 1
        else:  # an expert asked for twice is held twice
            np.subtract.at(self.pinned, slots, 1)
        self._changed.notify_all()

    @contextmanager
    def held(self, layer: int, ids: list[int], serve: bool = True) -> Iterator[tuple[np.ndarray, list[int]]]:
        """The host slab (slots, slot bytes) and the slots holding experts ``ids`` (misses read), pinned
        for the block: nothing is evicted or prefetched into them until it ends. Host slabs only.
        ``serve``: as :meth:`slots`'."""
        assert self.slab_device is None, "a device slab has no host view"
        slots = self.slots(layer, ids, serve)
        try:
            yield self.slab, slots
        finally:
            self.release(slots)

    def rows(self, layer: int, ids: list[int]) -> torch.Tensor:
        """(len(ids), slot_bytes) uint8 copies of the experts' records, on the cache's device."""
        slots = self.slots(layer, ids)
        try:  # index_select copies whole rows (indexing with a list went byte by byte: ~1.3 GB/s)
            rows = torch.index_select(self._slab_t, 0, torch.tensor(slots, device=self._slab_t.device))
        finally:
            self.release(slots)
        return rows if rows.device == self.device else rows.to(self.device)

    def decode(
        self, layer: int, ids: list[int], roles: tuple[str, ...] = ROLES
    ) -> dict[str, list[torch.Tensor]]:
        """Float32 (rows, cols) matrices of experts ``ids`` of ``layer`` (at most ``capacity``), per role."""
        lay = self.layers[layer]
        rows = self.rows(layer, ids)
        self.stats.peak_decoded = max(self.stats.peak_decoded, len(ids))
        views = lay.views(rows)
        return {
            c.role: list(dequantize(views[c.role], c.qtype, c.cols).unbind(0))
            for c in lay.components
            if c.role in roles
        }

    def tensor(self, layer: int, role: str) -> StreamedExperts:
        return StreamedExperts(self, layer, role)

    def role_matrices(self, layer: int, role: str, ids: list[int]) -> Sequence[torch.Tensor]:
        """One role's matrices of experts ``ids``.

        Up to one group (a decode step): the first role asked for decodes all roles of ``ids`` (one cache
        lookup per expert), the others take theirs from that decode. More (a prefill): a lazy sequence
        that decodes a group at a time (:class:`GroupedExperts`).
        """
        if len(ids) > self.group_size:
            return GroupedExperts(self, layer, role, tuple(ids))
        pending = self._pending.get(layer)
        if pending is None or pending.ids != ids or role not in pending.decoded:
            pending = _Pending(list(ids), self.decode(layer, ids))
            self._pending[layer] = pending
        mats = pending.decoded.pop(role)
        if not pending.decoded:
            del self._pending[layer]
        return mats

    def group_matrices(self, layer: int, role: str, ids: tuple[int, ...], index: int) -> list[torch.Tensor]:
        """``role``'s matrices of group ``index`` of a grouped request; gate and up are decoded together
        (the model uses them together), down alone (it comes in a second pass)."""
        g = self._groups.get(layer)
        if g is None or g.ids != ids or g.index != index or role not in g.decoded:
            self._groups.pop(layer, None)  # drop the previous group before decoding the next
            chunk = list(ids[index * self.group_size : (index + 1) * self.group_size])
            roles = ("down",) if role == "down" else ("gate", "up")
            g = _Group(ids, index, self.decode(layer, chunk, roles))
            self._groups[layer] = g
        return g.decoded[role]

    # prefetch -------------------------------------------------------------------------------------------
    def prefetch(self, layer: int, experts: list[int], issued_at: int) -> int:
        """Read experts ``experts`` of ``layer`` ahead of use (a read-ahead thread), those not cached yet
        and as many as free slots allow. Returns how many were read: 0 when the request is stale (the model
        has moved past ``issued_at`` + 1). The reads are this thread's own: they never queue in the pool that
        serves the model's misses."""
        lay = self.layers.get(layer)
        if lay is None or not experts:
            return 0
        base = self._key_base[layer]
        with self._lock:
            if not issued_at - 1 <= self.serving <= issued_at:
                return 0
            want = list(dict.fromkeys(e for e in experts if base + e not in self.slot_of))
            busy = self._busy() | ((self.slot_key >= 0) & (self.policy.last_use > self._cycle_ticks[0]))
            # the routed layer's experts (a lookup each, not a search of every slot)
            busy[[self.slot_of[k] for k in self.protected_keys if k in self.slot_of]] = True
            if self._reserving:
                busy |= self.reserved_for >= 0
            want = want[: self.capacity - int(np.count_nonzero(busy))]
            fresh = self._free_slots(len(want), busy) or []
            for e, slot in zip(want, fresh, strict=True):
                self._claim(slot, base + e)
                self.reserved_for[slot] = layer
                self.prefetched[slot] = True
                # a guess ranks as the least recently used until the model uses it: kept by its reservation
                # until its layer is served, then, if the guess was wrong, the first to go
                self.policy.last_use[slot] = 0
            self._reserving |= bool(fresh)
        if not fresh:
            return 0
        misses = list(zip(want, fresh, strict=True))
        t0 = time.perf_counter()
        try:
            reads = self._read_misses(lay, misses, ahead=True)
        except BaseException:
            with self._lock:
                self._read_ended(fresh, failed=True)
            raise
        with self._lock:
            self._read_ended(fresh)
            self.stats.reads += reads
            self.stats.bytes_read += lay.record_bytes * len(misses)
            self.stats.prefetch_issued += len(misses)
            self.stats.prefetch_seconds += time.perf_counter() - t0
        return len(misses)


class StreamedExperts(ExpertTensor):
    """The ExpertTensor interface of one role of one layer, served by an :class:`ExpertCache`."""

    def __init__(self, cache: ExpertCache, layer: int, role: str) -> None:
        comp = next(c for c in cache.layers[layer].components if c.role == role)
        self.cache, self.layer, self.role = cache, layer, role
        self.raw = torch.empty(0, dtype=torch.uint8)
        self.qtype, self.cols, self.rows, self.resident = comp.qtype, comp.cols, comp.rows, False
        self.n_expert = cache.layers[layer].experts
        self._decoded = None

    def per_expert(self, ids: list[int]) -> list[torch.Tensor]:
        return self.cache.role_matrices(self.layer, self.role, list(ids))  # type: ignore[return-value]

    def take(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.stack(list(self.per_expert(ids.tolist())))

    def decoded(self) -> torch.Tensor:
        raise ForgeError("streamed experts are never decoded whole")

    @property
    def decoded_nbytes(self) -> int:
        return 1 << 62  # never made resident by the expert budget
