"""Hybrid routed experts: the hot experts computed on the GPU from a pool of slots, the others on the CPU
from the host's copy of the file, both at once.

The routed experts stay the file's encoded bytes in host memory (``Weights.host_experts``: the mapped file,
canonical or expert-major), or, for a file beyond host memory, are streamed into a host ``ExpertCache``
(``runtime.experts``) that the CPU side reads from. A fixed pool of slots on the fast device holds the encoded records (gate, up and
down rows as the file stores them) of the hot experts; layers whose experts share one geometry share one
pool, so the hot set is chosen across layers. Per routed layer, after routing (``runtime.moe.Router``), the
expert ids come to the host once; then

- the (token, expert) pairs whose expert is in the pool are computed by the fast device's backend on the
  pool (the cuda kernels: one ``moe_linear`` launch per projection over slot ids),
- in a prefill batch, a missed expert routed to enough tokens that its copy costs less than computing it on
  the CPU (``Rates``, measured at load) is copied for this batch and computed there too (or the layer's
  experts are copied whole, when that is faster than the gathered copies and the CPU's share),
- the remaining pairs are computed by the CPU backend (numba kernels on the encoded records, which release
  the GIL) in a worker thread at the same time,

and the partial sums (each pair weighted by its router weight, as every backend does) are added. A decode step
(one token, no observers) never waits for the device: per routed layer the device posts the routing to a
mailbox in page-locked host memory (``Exchange``), computes the pooled pairs (looked up in a slot table on
the device), then waits on the device (``host_wait``) until the CPU worker, which watches the mailbox, has
computed the missed pairs and written their sum; so a CUDA graph holds the whole step, and the host's only
call in it (``begin_step``, cut out by ``cuda_graph.cut``) settles the last step's accounts and starts the
worker. The pool's policy is least-frequently-used with decay over the measured routing (``Frequency``),
seeded from a ``forge prune profile`` JSON when given; a missed expert whose count beats the coldest slot's
is copied into that slot on a side stream after the kernels queued so far (the step never waits for it: the
slot serves from the first lookup after the copy has finished).

Observers see what they see on the resident path: each side's matmul inputs are recorded with their expert
ids and reported from the calling thread (``runtime.moe.Taps``).

The fast device is a parameter: on a CPU the "GPU" side is the torch reference over a host pool, which is
how the tests run the whole executor without a GPU.
"""

from __future__ import annotations

import copy
import itertools
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from forge.errors import ForgeError
from runtime import cpu_kernels, host_pin, omp_team
from runtime.backends import cpu_backend, cuda_backend, cuda_graph, host_wait, torch_backend
from runtime.experts import Component, ExpertCache, LayerExperts
from runtime.observers import expert_output_observers
from runtime.prefetch import ReadAhead, RouterGuess
from runtime.weights import ExpertTensor

#: experts admitted into the pool per one-token layer call at most (each is one record's copy on the side
#: stream, decided on the host between two decode steps: 2 a call cost the H200 machine 45 us a layer there, and
#: 1 decoded faster with the same hits; 0: every qualifying one)
ADMIT_PER_CALL = 1
#: pinned staging records per pool for admissions in flight; when all are busy an admission waits a call
STAGING_RECORDS = 8
#: bytes of each of the two pinned buffers a batch's copies pass through (``Staging``)
STAGING_BYTES = 64 << 20
#: a missed expert replaces the coldest pooled one when its decayed pair count is higher by more than this
ADMIT_MARGIN = 1.0
#: the policy's counts halve every this many pairs per expert of the model (a 40-layer 256-expert model with 8
#: experts a token: 1,024 decode tokens, or two 512-token prefills). ``benchmarks/hybrid_policy.py`` (the hybrid
#: benchmark's trace routing, 2,427 slots of 10,240 experts): decode hits 52.3% at 8, 54.9% at 16, 55.0% at 32,
#: 55.2% at 128 (nearly never halving), with 44% fewer admissions at 32 than at 8; 32 keeps most of the gain
#: and still follows a shift in routing
POLICY_WINDOW = 32


@dataclass
class HybridStats:
    gpu_pairs: int = 0  # (token, expert) pairs computed on the fast device from the pool
    gpu_hits: int = 0  # experts of a layer call found in the pool
    upload_experts: int = 0  # missed experts copied for one prefill batch and computed on the fast device
    upload_pairs: int = 0
    cpu_pairs: int = 0
    cpu_computes: int = 0  # experts of a layer call computed on the CPU
    bytes_read: int = 0  # record bytes the CPU side read (host memory, or the file through the mapping)
    bytes_uploaded: int = 0  # batch copies and admissions to the fast device
    prefetched: int = 0  # layers copied whole ahead of their batch, during the layer before
    prefetches_unused: int = 0  # of those, layers whose batch then did not go whole
    admissions: int = 0
    evictions: int = 0
    cpu_seconds: float = 0.0  # the worker's time on the CPU side
    wait_seconds: float = 0.0  # the caller waiting for the CPU side after queueing the fast side
    # decode steps alone (one token: a mailbox row per layer): layer calls, experts found in the pool, the
    # worker's time waiting for the device's post of a layer after the step's first (the GPU's part between
    # two layers' experts) and in the CPU kernel
    step_layers: int = 0
    step_hits: int = 0
    k: int = 0  # experts per token
    step_device_seconds: float = 0.0
    step_cpu_seconds: float = 0.0
    step_admissions: int = 0  # admissions decided from decode steps (``_account``)
    step_host_seconds: float = 0.0  # the host's work between two steps' workers (accounts, admissions)
    # the decode steps' CPU kernel calls by how many experts they computed (index m: m missed experts): how
    # many and their seconds, which part of a call does not depend on m
    step_cpu_calls: list[int] = field(default_factory=list)
    step_cpu_seconds_by_misses: list[float] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        n = self.gpu_hits + self.upload_experts + self.cpu_computes
        return self.gpu_hits / n if n else 0.0

    @property
    def step_hit_rate(self) -> float:
        """The share of the decode steps' routed experts found in the pool (a batch's copies count as misses
        in ``hit_rate``: a prefill's whole-layer copies outweigh every decode step)."""
        n = self.step_layers * self.k
        return self.step_hits / n if n else 0.0

    def snapshot(self) -> HybridStats:
        """A copy that later counting leaves as it is (the per-count lists copied too)."""
        return copy.deepcopy(self)

    def since(self, earlier: HybridStats) -> HybridStats:
        """What was counted after ``earlier`` (a ``snapshot`` of these stats): each count less its value then
        (a list's entries one by one), ``k`` as now."""
        out: dict[str, Any] = {}
        for f in fields(self):
            now, then = getattr(self, f.name), getattr(earlier, f.name)
            if f.name == "k":
                out[f.name] = now
            elif isinstance(now, list):
                out[f.name] = [v - (then[i] if i < len(then) else 0) for i, v in enumerate(now)]
            else:
                out[f.name] = now - then
        return HybridStats(**out)

    def to_json(self) -> dict[str, float | int]:
        out: dict[str, float | int] = dict(asdict(self))
        out["hit_rate"] = round(self.hit_rate, 6)
        out["step_hit_rate"] = round(self.step_hit_rate, 6)
        return out


@dataclass(frozen=True)
class Rates:
    """What a batch's copy of a missed expert costs against computing it on the CPU: ``upload_bps`` bytes/s
    to the fast device (records gathered), ``cpu_expert_s`` + n x ``cpu_pair_s`` seconds for an expert's n
    pairs on the CPU, or n x ``cpu_direct_s`` for fewer than ``direct_below`` pairs (the batch kernel takes
    those from the encoded bytes, ``cpu_kernels.DIRECT_BELOW``); ``whole_bps``: bytes/s of copying a layer's
    whole experts as the file holds them (one copy per part, no gather: canonical files in host memory; 0:
    never)."""

    upload_bps: float
    cpu_expert_s: float
    cpu_pair_s: float
    whole_bps: float = 0.0
    cpu_direct_s: float = 0.0
    direct_below: int = 0

    def cpu_costs(self, pairs: np.ndarray) -> np.ndarray:
        """The CPU's seconds for each of experts of ``pairs`` pairs."""
        decoded = self.cpu_expert_s + pairs * self.cpu_pair_s
        return np.where(pairs < self.direct_below, pairs * self.cpu_direct_s, decoded)

    def upload(self, record_bytes: int, pairs: np.ndarray) -> np.ndarray:
        """Which of a batch's missed experts (``pairs`` pairs each) to copy to the fast device (True); the CPU
        computes the others meanwhile. The CPU takes the experts cheapest for it, as many as keep the batch
        shortest: its time (the sum of theirs) against the copies' of the rest, whichever ends later. An
        expert of a few pairs on an idle CPU saves a whole record's copy."""
        cost = self.cpu_costs(pairs)
        order = np.argsort(cost, kind="stable")
        on_cpu = np.concatenate([[0.0], np.cumsum(cost[order])])  # the CPU's time with the first j of them
        copies = (pairs.size - np.arange(pairs.size + 1)) * (record_bytes / self.upload_bps)
        upload = np.ones(pairs.size, bool)
        upload[order[: int(np.argmin(np.maximum(on_cpu, copies)))]] = False
        return upload

    def cpu_seconds(self, pairs: np.ndarray) -> float:
        """The CPU side's time for experts of ``pairs`` pairs each."""
        return float(np.sum(self.cpu_costs(pairs)))

    def whole_pays(self, layer_bytes: int, gathered_bytes: int, cpu_seconds: float) -> bool:
        """Copying the layer's experts whole beats gathering ``gathered_bytes`` of them while the CPU
        computes the others in ``cpu_seconds``."""
        alternative = max(gathered_bytes / self.upload_bps, cpu_seconds)
        return self.whole_bps > 0 and layer_bytes / self.whole_bps < alternative

    #: never copy for a batch (every miss on the CPU)
    @classmethod
    def never(cls) -> Rates:
        return cls(1.0, 0.0, 0.0)

    #: always copy for a batch (every miss of a batch on the fast device)
    @classmethod
    def always(cls) -> Rates:
        return cls(float("inf"), 1.0, 0.0)


@dataclass
class BatchCopies:
    """A batch's copies of experts on the fast device: per role (n, rows, row bytes), and per expert of the
    layer its index there (-1: not copied)."""

    parts: dict[str, torch.Tensor]
    where: np.ndarray


class Frequency:
    """Least frequently used with decay: per key (layer x experts + expert) the pairs routed to it, halved
    every ``window`` pairs, so that a shift in routing is followed."""

    def __init__(self, n_keys: int, window: int) -> None:
        self.count = np.zeros(n_keys, np.float64)
        self.window, self.seen = window, 0
        self.decays = 0  # halvings so far

    def observe(self, keys: np.ndarray, distinct: bool = False) -> None:
        """One pair for each of ``keys`` (``distinct``: no key twice, as one token's experts)."""
        if distinct:
            self.count[keys] += 1.0
        else:
            np.add.at(self.count, keys, 1.0)
        self.seen += keys.size
        while self.seen >= self.window:
            self.count *= 0.5
            self.decays += 1
            self.seen -= self.window

    def seed(self, keys: np.ndarray, counts: np.ndarray) -> None:
        """Counts from a profile, scaled to one window's worth of pairs."""
        total = float(counts.sum())
        if total > 0:
            self.count[keys] = counts * (self.window / total)


class SlotPool:
    """Slots on the fast device for the records of experts of one geometry: per part an (slots, rows, row
    bytes) uint8 tensor (contiguous, as ``moe_linear`` reads it). Gate and up of one type are one part, the
    up rows after the gate rows (one launch computes both, as ``runtime.weights`` stacks them on CUDA)."""

    def __init__(self, components: tuple[Component, ...], n_slots: int, device: torch.device) -> None:
        self.components = components
        self.record_bytes = sum(c.expert_bytes for c in components)
        role = {c.role: c for c in components}
        gate, up = role["gate"], role["up"]
        fused = gate.qtype == up.qtype and gate.cols == up.cols
        groups = (
            {"gate_up": (gate, up), "down": (role["down"],)} if fused else {c.role: (c,) for c in components}
        )
        self.where: dict[str, tuple[str, int, int]] = {}  # role -> (part, its first row, past its last row)
        self.kind: dict[str, Component] = {}  # part -> a component of it (type and columns)
        shapes = {}
        for part, comps in groups.items():
            rows = 0
            for c in comps:
                self.where[c.role] = (part, rows, rows + c.rows)
                rows += c.rows
            self.kind[part] = comps[0]
            shapes[part] = (rows, comps[0].expert_bytes // comps[0].rows)
        # zeros: a decode step computes every pair on the pool, a missed one from slot 0 with weight 0, so no
        # slot may hold bytes that decode to inf or NaN
        self.parts = {
            p: torch.zeros((n_slots, *shape), dtype=torch.uint8, device=device) for p, shape in shapes.items()
        }
        self.key = np.full(n_slots, -1, np.int64)  # the key each slot holds (or is being filled with)
        # every slot taken, and the coldest held count as the last full look found it (at the policy's decay
        # ``epoch``): counts only grow between decays, so a key not above it by the margin cannot take a slot
        self.full, self.coldest, self.epoch = False, 0.0, 0
        self.pending: list[tuple[int, int, Any]] = []  # (slot, key, copy done event)
        self.device = device
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if cuda else None
        # pinned host records for admissions in flight, and the copier's job using each
        self.stage = {
            p: torch.empty((STAGING_RECORDS, *shape), dtype=torch.uint8, pin_memory=cuda)
            for p, shape in shapes.items()
        }
        self.staging: list[Any] = [None] * STAGING_RECORDS

    @property
    def n_slots(self) -> int:
        return len(self.key)

    def view(self, tensors: dict[str, torch.Tensor], role: str, index: int | slice) -> torch.Tensor:
        """``role``'s rows of record ``index`` in ``tensors`` (``parts`` or ``stage``)."""
        part, first, last = self.where[role]
        return tensors[part][index, first:last]

    def tensors(self) -> dict[str, ExpertTensor]:
        return {p: ExpertTensor(t, self.kind[p].qtype, self.kind[p].cols) for p, t in self.parts.items()}


def _geometry(lay: LayerExperts) -> tuple[tuple[str, int, int, int], ...]:
    return tuple((c.role, int(c.qtype), c.rows, c.cols) for c in lay.components)


def _shape(c: Component) -> tuple[int, int]:
    return c.rows, c.expert_bytes // c.rows


def _over(source: Any, parts: dict[str, ExpertTensor]) -> Any:
    """A copy of an ``ExpertSource`` whose experts are ``parts`` (gate_up or gate and up, then down), held
    per use."""
    s = copy.copy(source)
    s.gate_up, s.gate, s.up, s.down = parts.get("gate_up"), parts.get("gate"), parts.get("up"), parts["down"]
    s.fused, s.resident, s.kind = None, False, "per-use"
    s.parts = (s.gate_up, s.down) if s.gate_up is not None else (s.gate, s.up, s.down)
    s.cache = s.cache_layer = s._rows = s._encoded = s._slab_records = None
    return s


class _Recorder:
    """A ``Taps`` stand-in for one side of a layer call: records the matmul inputs with their expert ids
    (``experts`` maps the side's record index to the expert id), reported later from the caller's thread."""

    round_in = round_act = None
    rounds = False

    def __init__(self, observers: list[Any], experts: torch.Tensor | None) -> None:
        self.observers, self.experts = observers, experts
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def watchers(self) -> list[Any]:
        return []

    def inputs(self, x: torch.Tensor, act: torch.Tensor, ids: torch.Tensor) -> None:
        ids = ids.reshape(-1)
        if self.experts is not None:
            ids = self.experts[ids.to(self.experts.device)]
        self.calls.append((x, act, ids))

    def outputs(self, ids: torch.Tensor, outputs: torch.Tensor, weights: torch.Tensor) -> None:
        pass

    def replay(self, taps: Any, device: torch.device) -> None:
        """Report the recorded inputs to ``taps`` on ``device`` (the model's: where the resident path's are)."""
        for x, act, ids in self.calls:
            taps.inputs(x.to(device), act.to(device), ids.to(device))


def _partial(
    backend: Any,
    source: Any,
    taps: Any,
    x: torch.Tensor,
    tok: torch.Tensor,
    ids: torch.Tensor,
    w: torch.Tensor,
) -> torch.Tensor:
    """The experts of the pairs (token ``tok``, record ``ids``, weight ``w``) -> their weighted sum per token
    (T, n_embd), by ``backend`` over ``source``. One token keeps the step form (one kernel call over its
    experts); a batch computes its pairs as rows of one expert each."""
    if x.shape[0] == 1:
        return backend.routed_ffn(x, ids[None], w[None], source, taps)
    xs = x.index_select(0, tok)
    y = backend.routed_ffn(xs, ids[:, None], w[:, None], source, taps)
    return torch.zeros_like(x).index_add_(0, tok, y)


class HybridLayer:
    """The backend installed on one ``RoutedExperts`` layer (``routed_ffn`` as the backend modules')."""

    NAME = "hybrid"
    CUTS_GRAPHS = True  # a decode step's host call, at its first routed layer, is cut out of its CUDA graph

    def __init__(self, executor: HybridExperts, layer: int, source: Any, pool: SlotPool) -> None:
        self.executor, self.layer, self.pool = executor, layer, pool
        self.host = source  # the layer's experts in host memory (the mapped file)
        self.host_backend = cpu_backend if source.has_records() else torch_backend
        # a decode step's worker calls the kernel on these directly (None: through the backend)
        self.encoded = source.encoded_records() if self.host_backend is cpu_backend else None
        self.pooled = _over(source, pool.tensors())
        self.fast_backend = cuda_backend if self.pooled.device_parts() is not None else torch_backend
        lay = executor.layers[layer]
        self.base, self.record_bytes, self.n_expert = executor.key_base[layer], lay.record_bytes, lay.experts
        # a batch may copy the layer's experts whole: each part one contiguous tensor in host memory
        self.whole = source.kind == "per-use" and all(
            getattr(source, c.role).raw.is_contiguous() for c in pool.components
        )

    def routed_ffn(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        source: Any,
        taps: Any,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        ex = self.executor
        if self.base == 0:  # the first routed layer: a forward call of one token, or a batch's
            ex.batch_call = x.shape[0] > 1
        if x.shape[0] == 1 and not ex.batch_call and not taps.observers and self.pool.n_slots:
            return ex.decode_step(self, x, ids, weights, residual)
        # a batch's one row (its last layer computes the output row's FFN only) is no decode step's
        return ex.routed_ffn(self, x, ids, weights, taps, residual)


class Exchange:
    """A decode step's mailbox between the device and the CPU worker, a row per routed layer (page-locked on
    a GPU): ``mail`` the routing the device posts (ids, weights, input: (layers, 2k + n_embd)), ``result`` the
    CPU's sum of the missed pairs (layers, n_embd), ``posted`` / ``done`` the step number of each row's post
    and answer, ``step`` the device's step counter, ``fault`` set by a wait that gave up; ``pools`` the rows'
    slot pools and ``pool_of`` each row's (an index into them); ``bases`` and ``record_bytes`` each row's
    first key in the slot table and its layer's record size."""

    def __init__(self, layers: list[HybridLayer], k: int, n_embd: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.layers, self.k, self.n_embd = layers, k, n_embd
        self.index = {lay.layer: i for i, lay in enumerate(layers)}
        self.bases = np.array([lay.base for lay in layers], np.int64)
        self.record_bytes = np.array([lay.record_bytes for lay in layers], np.int64)
        self.pools = list(dict.fromkeys(lay.pool for lay in layers))
        self.pool_of = np.array([self.pools.index(lay.pool) for lay in layers], np.int64)
        n = len(layers)
        self.mail = torch.zeros(n, 2 * k + n_embd, pin_memory=pin)
        self.result = torch.zeros(n, n_embd, pin_memory=pin)
        self.posted = torch.zeros(n, dtype=torch.int32, pin_memory=pin)
        self.done = torch.zeros(n, dtype=torch.int32, pin_memory=pin)
        self.fault = torch.zeros(1, dtype=torch.int32, pin_memory=pin)
        self.step = torch.zeros(1, dtype=torch.int32, device=device)


class HybridExperts:
    """The pools, policy, CPU worker and statistics of a model's hybrid routed experts (see the module)."""

    def __init__(
        self,
        model: Any,
        cache_bytes: int,
        device: torch.device | str | None = None,
        profile: Any = None,
        rates: Rates | None = None,
        admit_per_call: int = ADMIT_PER_CALL,
        window: int | None = None,
    ) -> None:
        """``model``: built over weights with ``host_experts``; ``cache_bytes``: the pools' size on ``device``
        (default the model's device); ``profile``: a ``forge.prune.profile.Profile`` seeding the policy and
        the pools; ``rates``: measured at load when not given."""
        weights = model.weights
        if not weights.host_experts:
            raise ForgeError("hybrid experts need a model loaded with its routed experts in host memory")
        if weights.ggml_numerics:
            raise ForgeError("--gpu-expert-cache and --ggml-numerics exclude each other")
        self.device = torch.device(device) if device is not None else weights.device
        if self.device.type != "cpu" and expert_output_observers(model.observers):
            raise ForgeError(
                "hybrid experts do not serve observers of each expert's output (e.g. forge prune profile's "
                "saliency): run without --gpu-expert-cache"
            )
        self.seeded = 0  # experts copied into the pools from the profile at load
        self._stats = HybridStats()
        self.admit_per_call = admit_per_call
        self.layers: dict[int, LayerExperts] = weights.expert_layers()
        moes = {i: b.moe for i, b in enumerate(model.blocks) if i in model.routed_layers()}
        for i, moe in moes.items():
            if i not in self.layers or sorted(c.role for c in self.layers[i].components) != [
                "down",
                "gate",
                "up",
            ]:
                raise ForgeError(
                    f"{weights.source}: hybrid experts need separate gate, up and down experts (layer {i})"
                )
            if moe.source.kind not in ("per-use", "streamed") or (
                moe.source.kind == "streamed" and moe.source.cache_layer is None
            ):
                raise ForgeError(
                    f"{weights.source}: hybrid experts need the routed experts in host memory or in a host "
                    f"expert cache (layer {i} holds them {moe.source.kind})"
                )
            if moe.source.swiglu_limit is not None:
                raise ForgeError(
                    f"{weights.source}: hybrid experts do not compute clamped SwiGLU experts (layer {i})"
                )
        order = sorted(moes)
        self.key_base = dict(
            zip(order, np.cumsum([0] + [self.layers[i].experts for i in order[:-1]]).tolist(), strict=True)
        )
        n_keys = sum(self.layers[i].experts for i in order)
        self.policy = Frequency(n_keys, window or POLICY_WINDOW * n_keys)
        # key -> its slot in its layer's pool (-1: not there), on the host and (``slot_table``) on the device,
        # where a decode step's pooled experts are looked up without the host; changed only between layer
        # calls, copied over before the next device work (``_publish``)
        cuda = self.device.type == "cuda"
        host_table = torch.full((n_keys,), -1, dtype=torch.int64, pin_memory=cuda)
        self.slot_of = host_table.numpy()
        self.slot_table = host_table.to(self.device) if cuda else host_table
        self._host_table, self._changed = host_table, False
        self.held = np.zeros(n_keys, bool)  # key -> in a slot or being copied into one
        self.pools = self._pools(order, cache_bytes)
        self.hybrid_layers: dict[int, HybridLayer] = {}
        for i in order:
            pool = self.pools[_geometry(self.layers[i])]
            self.hybrid_layers[i] = moes[i].backend = HybridLayer(self, i, moes[i].source, pool)
        self._host_cache, self._host_key = self._streamed_keys(order, n_keys)
        self.worker = ThreadPoolExecutor(1, "hybrid-cpu", omp_team.name_thread, ("hybrid-cpu",))
        biggest = max(lay.record_bytes for lay in self.layers.values())
        self.staging = Staging(max(STAGING_BYTES, biggest)) if self.device.type == "cuda" else None
        self.copier = ThreadPoolExecutor(1, "hybrid-copy", omp_team.serial, ("hybrid-copy",))
        # a batch that copies a layer whole starts the next layer's whole copy on its own stream (the next is
        # then likely copied whole too): the copies run back to back instead of between the layers' work
        self.next_layer = dict(zip(order, [self.hybrid_layers[i] for i in order[1:]], strict=False))
        self.copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self._prefetched: dict[int, tuple[list[torch.Tensor], Any]] = {}
        # the CPU side's kernel threads: one core left to the thread that launches the GPU's work
        self.cpu_threads = max(1, torch.get_num_threads() - (self.device.type == "cuda"))
        self.exchange: Exchange | None = None  # the decode steps' mailbox, made at the first step
        # over a host expert cache: the next layer's guessed experts read into it while a decode step's layer
        # is served (``prefetch``)
        self.read_ahead: ReadAhead | None = None
        self.batch_call = False  # the forward call under way routes a batch (set at its first routed layer)
        self._step_job: Future | None = None  # the worker serving the decode step under way
        self.pinned = self._pin() if cuda else None
        if profile is not None:
            self._seed(profile, order)
        self.rates = rates or measure_rates(self, next(iter(self.hybrid_layers.values())))
        if cuda:  # the libraries the model's thread lets its OpenMP team go in (``begin_step``)
            omp_team.find()

    def prefetch(self, model: Any, background: bool = True) -> ReadAhead | None:
        """Read ahead in decode steps: at each routed layer, the next layer's experts that its router guesses
        from this layer's input (``runtime.prefetch.RouterGuess``) and the pools do not hold are read into
        the host expert cache. None (nothing done) when every layer is in host memory."""
        if self._host_cache is None:
            return None
        if self.read_ahead is None:
            guess = RouterGuess(model, sorted(self.hybrid_layers))
            self.read_ahead = ReadAhead(self._host_cache, guess, background)
        return self.read_ahead

    def _not_pooled(self, layer: int, experts: list[int]) -> list[int]:
        """Of ``experts`` of ``layer``, those no pool holds (the CPU side's, which a read ahead may fetch)."""
        base = self.hybrid_layers[layer].base
        return [e for e in experts if self.slot_of[base + e] < 0]

    def _streamed_keys(self, order: list[int], n_keys: int) -> tuple[ExpertCache | None, np.ndarray]:
        """The host expert cache that layers stream through (None: every layer in host memory), and per key
        its key there (-1: a layer in host memory). What a pool holds is the host cache's first to go."""
        cache, host_key = None, np.full(n_keys, -1, np.int64)
        for i in order:
            source = self.hybrid_layers[i].host
            if source.kind == "streamed":
                cache, base = source.cache, self.key_base[i]
                host_key[base : base + self.layers[i].experts] = cache.key(i, 0) + np.arange(
                    self.layers[i].experts
                )
        return cache, host_key

    def _pin(self) -> host_pin.PinnedRanges | None:
        """Page-lock the mapped file's routed experts (layers held in host memory, not streamed through a
        host cache), so that batch copies and admissions read them at DMA speed."""
        from runtime.planner import available_memory

        parts = [
            getattr(lay.host, c.role).raw
            for lay in self.hybrid_layers.values()
            if lay.host.kind == "per-use"
            for c in lay.pool.components
        ]
        return host_pin.pin(parts, available_memory()[0]) if parts else None

    # pools ------------------------------------------------------------------------------------------------
    def _pools(self, order: list[int], cache_bytes: int) -> dict[tuple, SlotPool]:
        """One pool per expert geometry, the bytes shared in proportion to the geometry's routed bytes."""
        groups: dict[tuple, list[int]] = {}
        for i in order:
            groups.setdefault(_geometry(self.layers[i]), []).append(i)
        total = sum(self.layers[i].experts * self.layers[i].record_bytes for i in order)
        pools = {}
        for geo, layers in groups.items():
            lay = self.layers[layers[0]]
            share = sum(self.layers[i].experts for i in layers) * lay.record_bytes
            n = min(
                int(cache_bytes * share / total) // lay.record_bytes,
                sum(self.layers[i].experts for i in layers),
            )
            pools[geo] = SlotPool(lay.components, n, self.device)
        if not any(p.n_slots for p in pools.values()):
            smallest = min(lay.record_bytes for lay in self.layers.values())
            raise ForgeError(
                f"--gpu-expert-cache of {cache_bytes:,} bytes holds no expert (one takes {smallest:,})"
            )
        return pools

    @property
    def capacity(self) -> int:
        return sum(p.n_slots for p in self.pools.values())

    @property
    def nbytes(self) -> int:
        return sum(p.n_slots * p.record_bytes for p in self.pools.values())

    def _seed(self, profile: Any, order: list[int]) -> None:
        """Counts from ``profile`` (its routed layers in order, or by layer index), then each pool filled with
        its hottest experts."""
        by_layer = {lp.layer: lp for lp in profile.layers}
        if set(by_layer) != set(order):
            raise ForgeError(
                f"the expert profile covers layers {sorted(by_layer)}, the model routes layers {order}"
            )
        for i in order:
            counts = by_layer[i].count
            if counts.size != self.layers[i].experts:
                raise ForgeError(
                    f"the expert profile lists {counts.size} experts in layer {i}, the model has {self.layers[i].experts}"
                )
        keys = np.concatenate([self.key_base[i] + np.arange(self.layers[i].experts) for i in order])
        self.policy.seed(keys, np.concatenate([by_layer[i].count for i in order]).astype(np.float64))
        for pool in self.pools.values():  # each pool filled with the hottest experts of its layers
            mine = [lay for lay in self.hybrid_layers.values() if lay.pool is pool]
            keys = np.concatenate([np.arange(lay.base, lay.base + lay.n_expert) for lay in mine])
            hot = keys[np.argsort(-self.policy.count[keys], kind="stable")][: pool.n_slots]
            hot = hot[self.policy.count[hot] > 0]
            for lay in mine:
                chosen = hot[(hot >= lay.base) & (hot < lay.base + lay.n_expert)]
                while (todo := chosen[self.slot_of[chosen] < 0]).size:
                    before = self._stats.admissions
                    self._admit(lay, todo - lay.base, None, 0)
                    self._settle(wait=True)  # frees the staging records for the next round
                    if self._stats.admissions == before:
                        break
        self._publish()
        self.seeded, self._stats = self._stats.admissions, HybridStats()

    def _settle(self, wait: bool = False) -> None:
        """Admissions whose copy has finished serve from now on (``wait``: all of them, waiting). Admissions
        copied together share their copy's event, asked once (a prefill admits thousands at a time)."""
        finished: dict[int, bool] = {}
        for pool in self.pools.values():
            still = []
            for slot, key, copied in pool.pending:
                if id(copied) not in finished:
                    finished[id(copied)] = _finished(copied, wait)
                if finished[id(copied)]:
                    self.slot_of[key] = slot
                    self._changed = True
                else:
                    still.append((slot, key, copied))
            pool.pending = still

    def _publish(self) -> None:
        """The slot table's changes to the device, queued before the next layer's work. The copy reads the
        pinned host table when it runs: the host changes it again only after its next wait for the device."""
        if self._changed and self.slot_table is not self._host_table:
            self.slot_table.copy_(self._host_table, non_blocking=True)
        self._changed = False

    def _admit(self, layer: HybridLayer, experts: np.ndarray, batch: BatchCopies | None, limit: int) -> None:
        """Copy ``experts`` (hottest first) into free slots or over colder ones (by more than
        ``ADMIT_MARGIN`` pairs, so that equally hot experts do not churn), ``limit`` at most (0: all that
        qualify): those of ``batch`` (this batch's device copies) in one copy per part, the others from host
        memory one at a time while staging records are free."""
        pool, count = layer.pool, self.policy.count
        keys = layer.base + experts
        keys = keys[~self.held[keys]]  # not in the pool, nor being copied there
        # none beats the coldest slot as the last full look found it (a decode step's usual case, decided
        # without looking at every slot)
        if limit and (not keys.size or count[keys].max() <= self._floor(pool)):
            return
        keys = keys[np.argsort(-count[keys], kind="stable")]
        if limit:
            keys = keys[:limit]
        slots = self._slots_for(pool, keys)
        keys = keys[: slots.size]
        copied = np.zeros(keys.size, bool) if batch is None else batch.where[keys - layer.base] >= 0
        if copied.any():
            done = self._copy_from_batch(pool, slots[copied], batch, keys[copied] - layer.base)
            for key, slot in zip(keys[copied].tolist(), slots[copied].tolist(), strict=True):
                self._place(pool, key, slot, done)
        rest = keys[~copied]
        self._copy_in(pool, [layer] * rest.size, rest, slots[~copied])

    def _admit_step(self, pool: SlotPool, layers: list[HybridLayer], keys: np.ndarray) -> None:
        """A decode step's admissions into ``pool``: ``keys`` (of ``layers``, hottest first) in one look at
        the slots and one block of copies."""
        slots = self._slots_for(pool, keys)
        self._copy_in(pool, layers[: slots.size], keys[: slots.size], slots)

    def _copy_in(
        self, pool: SlotPool, layers: list[HybridLayer], keys: np.ndarray, slots: np.ndarray
    ) -> None:
        """Start copying ``keys`` (of ``layers``) from host memory into ``slots`` and place them: from the
        page-locked file in one block on the side stream, after the kernels queued so far (which may read
        the slots' old experts); else one at a time (``_copy``) while staging records are free."""
        locked = pool.stream is not None and self.pinned is not None
        direct: list[int] = []
        staged: list[int] = []
        for i, lay in enumerate(layers):
            (direct if locked and lay.host.kind == "per-use" else staged).append(i)
        if direct:

            def copy() -> None:
                for i in direct:
                    host, expert = layers[i].host, int(keys[i]) - layers[i].base
                    for c in pool.components:
                        pool.view(pool.parts, c.role, int(slots[i])).copy_(
                            getattr(host, c.role).raw[expert], non_blocking=True
                        )

            done = _on_side_stream(pool, copy)
            for i in direct:
                self._place(pool, int(keys[i]), int(slots[i]), done)
        for i in staged:
            job = self._copy(layers[i], pool, int(slots[i]), int(keys[i]) - layers[i].base)
            if job is False:
                break  # no staging record free: a later call admits
            self._place(pool, int(keys[i]), int(slots[i]), job)
            self._stats.bytes_uploaded += pool.record_bytes
        self._stats.bytes_uploaded += pool.record_bytes * len(direct)

    def _floor(self, pool: SlotPool) -> float:
        """The count a key must beat to take a slot of ``pool`` (-inf while a slot is free): the coldest slot's
        as the last full look found it (``_slots_for``), decayed since, plus the margin. Counts only grow
        between decays, so the coldest slot's count is at least that."""
        if not pool.full:
            return -np.inf
        return pool.coldest * 0.5 ** (self.policy.decays - pool.epoch) + ADMIT_MARGIN

    def _slots_for(self, pool: SlotPool, keys: np.ndarray) -> np.ndarray:
        """Slots for ``keys`` (hottest first) in turn: free ones, then the coldest held ones (not being
        filled) while the key is hotter than the slot's by more than ``ADMIT_MARGIN``."""
        free = np.flatnonzero(pool.key < 0)
        if keys.size <= free.size:
            return free[: keys.size]
        count = self.policy.count
        held = np.where(pool.key >= 0, count[pool.key], np.inf)
        held[[s for s, _, _ in pool.pending]] = np.inf
        rest = keys[free.size :]
        victims = _coldest(held, rest.size)
        cold = float(held[victims[0]]) if victims.size else np.inf
        pool.full, pool.coldest, pool.epoch = (
            free.size == 0,
            cold if np.isfinite(cold) else 0.0,
            self.policy.decays,
        )
        hotter = count[rest[: victims.size]] > held[victims] + ADMIT_MARGIN
        n = hotter.size if hotter.all() else int(np.argmin(hotter))
        return np.concatenate([free, victims[:n]])

    def _place(self, pool: SlotPool, key: int, slot: int, copied: Any) -> None:
        """``key`` takes ``slot`` (its copy ``copied`` under way; the slot's expert evicted)."""
        old = pool.key[slot]
        if self._host_cache is not None:  # streamed layers: the host cache keeps what the pool does not
            for k, on_pool in ((old, False), (key, True)):
                if k >= 0 and self._host_key[k] >= 0:
                    self._host_cache.elsewhere[self._host_key[k]] = on_pool
        if old >= 0:
            self.slot_of[old] = -1
            self.held[old] = False
            self._changed = True
            self._stats.evictions += 1
        pool.key[slot] = key
        self.held[key] = True
        pool.pending.append((slot, key, copied))
        self._stats.admissions += 1

    def _copy_from_batch(
        self, pool: SlotPool, slots: np.ndarray, batch: BatchCopies, experts: np.ndarray
    ) -> Any:
        """Copy ``experts`` from ``batch`` into ``slots``, one copy per component (on the side stream after
        the kernels queued so far). Returns what ``_finished`` waits on."""

        def copy() -> None:
            # pinned, asynchronous: a pageable copy would wait for the kernels the side stream waits for
            to, rows = _to(pool.device, slots, batch.where[experts])
            for c in pool.components:
                part, first, last = pool.where[c.role]
                pool.parts[part][:, first:last].index_copy_(0, to, batch.parts[c.role].index_select(0, rows))

        return _on_side_stream(pool, copy, batch.parts.values())

    def _copy(self, layer: HybridLayer, pool: SlotPool, slot: int, expert: int) -> Any:
        """Start copying ``expert`` of ``layer`` from host memory into ``slot`` (the copier thread stages the
        record in pinned memory, then copies on the side stream). Returns what ``_finished`` waits on; None
        when done; False when every staging record is in use."""
        if pool.stream is None:  # a host "device": copied now
            records = host_records(layer, torch.tensor([expert]))
            for c, rec in zip(pool.components, records, strict=True):
                pool.view(pool.parts, c.role, slot).copy_(rec[0])
            return None
        queued = torch.cuda.Event()
        queued.record()  # the kernels queued so far may read the slot's old expert: the copy waits for them
        free = [i for i, job in enumerate(pool.staging) if job is None or _finished(job)]
        if not free:
            return False
        job = self.copier.submit(_stage_and_copy, pool, free[0], slot, layer, expert, queued)
        pool.staging[free[0]] = job
        return job

    # the layer call -----------------------------------------------------------------------------------------
    def routed_ffn(
        self,
        layer: HybridLayer,
        x: torch.Tensor,
        ids: torch.Tensor,
        w: torch.Tensor,
        taps: Any,
        residual: torch.Tensor | None,
    ) -> torch.Tensor:
        self.finish_step()
        n_tok, k = ids.shape
        dev = x.device
        # the one wait for the device in a layer call: ids, weights and inputs to the host in one copy
        packed = torch.cat([ids.to(x.dtype), w.to(x.dtype), x], 1)
        host = packed if dev.type == "cpu" else packed.to("cpu")
        ids_n = host[:, :k].numpy().astype(np.int64).reshape(-1)
        w_h, x_h = host[:, k : 2 * k].reshape(-1), host[:, 2 * k :]
        keys = layer.base + ids_n
        self.policy.observe(keys)
        slots = self.slot_of[keys]
        hit = slots >= 0
        tok = np.repeat(np.arange(n_tok), k)
        upload = np.zeros_like(hit)
        missed, inverse, pairs = np.unique(ids_n[~hit], return_inverse=True, return_counts=True)
        whole = False
        if n_tok > 1 and missed.size:
            pays = self.rates.upload(layer.record_bytes, pairs)
            upload[~hit] = pays[inverse]
            whole = layer.whole and self.rates.whole_pays(
                layer.record_bytes * layer.n_expert,
                int(pays.sum()) * layer.record_bytes,
                self.rates.cpu_seconds(pairs[~pays]),
            )
            # the whole layer goes over anyway: every pair is computed there, in one grouped product
            if whole:
                upload[:], hit = True, np.zeros_like(hit)
        if not whole:
            self._claim_prefetched(None)
        on_cpu = ~hit & ~upload
        observers = taps.observers

        job: Future | None = None
        cpu_taps = _Recorder(observers, None) if observers else None
        if on_cpu.any():
            sel = np.flatnonzero(on_cpu)
            args = (layer, cpu_taps, x_h, torch.from_numpy(tok[sel]), torch.from_numpy(ids_n[sel]), w_h[sel])
            job = self.worker.submit(self._cpu_side, *args)

        out = residual if residual is not None else torch.zeros_like(x)
        fast_taps: list[_Recorder] = []
        if hit.any():
            sel = np.flatnonzero(hit)
            pair_slot, pair_tok, pair_w = _to(dev, slots[sel], tok[sel], w_h[sel])
            rec = _Recorder(observers, _to(dev, layer.pool.key - layer.base)[0]) if observers else None
            fast_taps += [rec] if rec is not None else []
            out = out + _partial(
                layer.fast_backend, layer.pooled, rec or _NO_TAPS, x, pair_tok, pair_slot, pair_w
            )
            self._stats.gpu_pairs += sel.size
            self._stats.gpu_hits += np.unique(slots[sel]).size
        uploaded = None
        if upload.any():
            y, rec, uploaded = self._batch_upload(layer, x, tok, ids_n, w_h, upload, observers, whole)
            out = out + y
            fast_taps += [rec] if rec is not None else []
        if job is not None:
            t0 = time.perf_counter()
            y, seconds = job.result()
            self._stats.wait_seconds += time.perf_counter() - t0
            self._stats.cpu_seconds += seconds
            out = out + (y if dev.type == "cpu" else y.to(dev, non_blocking=True))
            n_exp = int(np.unique(ids_n[on_cpu]).size)
            self._stats.cpu_pairs += int(on_cpu.sum())
            self._stats.cpu_computes += n_exp
            self._stats.bytes_read += n_exp * layer.record_bytes
        if observers:
            for rec in [*fast_taps, cpu_taps]:
                if rec is not None:
                    rec.replay(taps, dev)
        if missed.size:
            self._admit(layer, missed, uploaded, self.admit_per_call if n_tok == 1 else 0)
        self._settle()
        self._publish()
        return out

    # the decode step ----------------------------------------------------------------------------------------
    def decode_step(self, layer: HybridLayer, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                    residual: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        """One token through ``layer``, queued on the device without waiting for it (a CUDA graph holds the
        whole step): the routing posted to the host's mailbox, the pooled pairs computed (looked up in the
        device's slot table; a missed pair from slot 0 with weight 0), then a wait on the device until the
        CPU worker has answered with the missed pairs' sum (``_serve_step``), which is added. The step's
        first layer first runs ``begin_step`` on the host (the step's one host call)."""
        ex = self._exchange_for(ids.shape[1], x.shape[1])
        i = ex.index[layer.layer]
        if i == 0:
            x = cuda_graph.cut(self.begin_step, x)
            ex.step.add_(1)
        packed = torch.cat([ids.to(x.dtype), w.to(x.dtype), x], 1)
        ex.mail[i : i + 1].copy_(packed, non_blocking=True)
        ex.posted[i : i + 1].copy_(ex.step, non_blocking=True)
        slot = self.slot_table[ids + layer.base]
        hit = slot >= 0
        if residual is None:
            residual = torch.zeros_like(x)
        out = layer.fast_backend.routed_ffn(
            x, slot.clamp(min=0), torch.where(hit, w, 0.0), layer.pooled, _NO_TAPS, residual
        )
        host_wait.wait_for_host(ex.done, i, ex.step, ex.fault)
        return out + ex.result[i : i + 1].to(x.device, non_blocking=True)

    @property
    def stats(self) -> HybridStats:
        """The figures so far (the decode step under way, if any, waited for and accounted)."""
        self.finish_step()
        return self._stats

    def _exchange_for(self, k: int, n_embd: int) -> Exchange:
        ex = self.exchange
        if ex is None or ex.mail.shape[1] != 2 * k + n_embd:
            self.finish_step()
            layers = [self.hybrid_layers[i] for i in sorted(self.hybrid_layers)]
            ex = self.exchange = Exchange(layers, k, n_embd, self.device)
        return ex

    def begin_step(self, x: torch.Tensor) -> torch.Tensor:
        """The host's part at a decode step's start: the last step's accounts (policy, admissions), the slot
        table's changes to the device (queued before this step's lookups), and the CPU worker set to serve
        this step's layers. Returns ``x``."""
        self.finish_step()
        t0 = time.perf_counter()
        if self.device.type == "cuda":  # the model thread's team (made by the load) would slow the worker's
            omp_team.release()
        self._settle()
        self._publish()
        self._step_job = self.worker.submit(self._serve_step, self.exchange)
        self._stats.step_host_seconds += time.perf_counter() - t0
        return x

    def finish_step(self) -> None:
        """Wait for the worker's last decode step, then account for it (before anything else uses the pools)."""
        job, self._step_job = self._step_job, None
        if job is None:
            return
        job.result()
        ex = self.exchange
        fault = ex.fault.numpy()
        if fault[0]:
            fault[0] = 0
            raise ForgeError("hybrid experts: the CPU side did not answer a decode step in time")
        t0, before = time.perf_counter(), self._stats.admissions
        self._account(ex)
        self._stats.step_admissions += self._stats.admissions - before
        self._stats.step_host_seconds += time.perf_counter() - t0

    def _serve_step(self, ex: Exchange) -> None:
        """The CPU worker's decode step: per routed layer in order, wait for its routing in the mailbox, compute
        the missed pairs on the CPU (the slot table is the one the device looks up: it changes only between
        steps), write their sum, then the answer's flag (which releases the device): a kernel call per layer
        (encoded records) or the host backend's."""
        cpu_kernels.use_threads(self.cpu_threads)
        k, s = ex.k, self._stats
        for per in (s.step_cpu_calls, s.step_cpu_seconds_by_misses):
            per.extend([0] * (k + 1 - len(per)))
        posted, done, mail, result = ex.posted.numpy(), ex.done.numpy(), ex.mail.numpy(), ex.result.numpy()
        missed, stamps = np.zeros(len(ex.layers), np.int64), np.zeros((len(ex.layers), 2))
        zeros = np.zeros(ex.n_embd, np.float32)
        with torch.inference_mode():
            for i, layer in enumerate(ex.layers):
                t0 = time.perf_counter()
                while posted[i] == done[i]:  # the device's post not there yet
                    if time.perf_counter() - t0 > host_wait.CPU_TIMEOUT:
                        return  # the step was abandoned (its capture failed, say)
                    os.sched_yield()
                stamps[i, 0] = time.perf_counter()
                ids = mail[i, :k].astype(np.int64)
                if self.read_ahead is not None:  # the next layer's guesses read while this one is served
                    x = torch.from_numpy(mail[i, 2 * k :])
                    self.read_ahead.routed(layer.layer, ids.tolist(), x, self._not_pooled)
                miss = np.flatnonzero(self.slot_of[layer.base + ids] < 0)
                missed[i] = miss.size
                if not miss.size:
                    result[i] = 0.0
                elif layer.encoded is not None:
                    answer_missed(mail[i], ids[miss], miss, layer.encoded, zeros, result[i])
                elif layer.host.kind == "streamed":  # in the host cache's slots, held while computed there
                    with layer.host.records(torch.from_numpy(ids[miss])) as (records, slots):
                        answer_missed(mail[i], slots.numpy(), miss, records, zeros, result[i])
                else:
                    result[i] = layer.host_backend.routed_ffn(
                        torch.from_numpy(mail[i, 2 * k :])[None], torch.from_numpy(ids[miss])[None],
                        torch.from_numpy(mail[i, k : 2 * k][miss])[None], layer.host, _NO_TAPS,
                    ).numpy()[0]  # fmt: skip
                stamps[i, 1] = time.perf_counter()
                done[i] = posted[i]
        self._count_step(ex, missed, stamps)

    def _count_step(self, ex: Exchange, missed: np.ndarray, stamps: np.ndarray) -> None:
        """A served step's CPU figures: per layer its missed pairs and the clock (s) when its post was seen and
        answered; the device's share is the wait between an answer and the next layer's post."""
        s = self._stats
        took = stamps[:, 1] - stamps[:, 0]
        s.step_device_seconds += float((stamps[1:, 0] - stamps[:-1, 1]).sum())
        for m, t in zip(missed.tolist(), took.tolist(), strict=True):
            if m:
                s.cpu_seconds += t
                s.step_cpu_seconds += t
                s.step_cpu_calls[m] += 1
                s.step_cpu_seconds_by_misses[m] += t
        n = int(missed.sum())
        s.cpu_pairs += n
        s.cpu_computes += n
        s.bytes_read += int((missed * ex.record_bytes).sum())

    def _account(self, ex: Exchange) -> None:
        """A served decode step's policy counts, hits and admissions, from its mailbox."""
        k = ex.k
        ids = ex.mail.numpy()[:, :k].astype(np.int64)
        keys = ex.bases[:, None] + ids
        self.policy.observe(keys.reshape(-1), distinct=True)
        missed = self.slot_of[keys] < 0
        n_miss = int(missed.sum())
        self._stats.gpu_hits += keys.size - n_miss
        self._stats.gpu_pairs += keys.size - n_miss
        self._stats.step_hits += keys.size - n_miss
        self._stats.step_layers += len(keys)
        self._stats.k = k
        # missed experts that may take a slot: per layer the hottest ``admit_per_call`` (0: all), then per
        # pool hottest first, in one look at its slots
        count = self.policy.count[keys]
        may = missed & ~self.held[keys]
        if self.admit_per_call:
            may &= count > np.array([self._floor(p) for p in ex.pools])[ex.pool_of][:, None]
        rows = np.flatnonzero(may.any(1))
        if not rows.size:
            return
        score = np.where(may[rows], count[rows], -np.inf)
        order = np.argsort(-score, axis=1, kind="stable")[:, : self.admit_per_call or None]
        score = np.take_along_axis(score, order, 1)
        take = score > -np.inf
        layer_of = np.broadcast_to(rows[:, None], order.shape)[take]
        key_of, score = np.take_along_axis(keys[rows], order, 1)[take], score[take]
        hottest = np.argsort(-score, kind="stable")
        layer_of, key_of = layer_of[hottest], key_of[hottest]
        for j, pool in enumerate(ex.pools):
            mine = ex.pool_of[layer_of] == j
            if mine.any():
                self._admit_step(pool, [ex.layers[i] for i in layer_of[mine].tolist()], key_of[mine])

    def _cpu_side(
        self,
        layer: HybridLayer,
        taps: Any,
        x: torch.Tensor,
        tok: torch.Tensor,
        ids: torch.Tensor,
        w: torch.Tensor,
    ) -> tuple[torch.Tensor, float]:
        t0 = time.perf_counter()
        cpu_kernels.use_threads(self.cpu_threads)
        with torch.inference_mode():  # as the model's forward pass (the mode is per thread)
            y = _partial(layer.host_backend, layer.host, taps or _NO_TAPS, x, tok, ids, w)
        return y, time.perf_counter() - t0

    def _batch_upload(self, layer: HybridLayer, x: torch.Tensor, tok: np.ndarray, ids: np.ndarray,
                      w: torch.Tensor, upload: np.ndarray, observers: list[Any], whole: bool = False
                      ) -> tuple[torch.Tensor, _Recorder | None, BatchCopies]:  # fmt: skip
        """The pairs ``upload`` of a batch: their experts copied to the device for this batch (``whole``: the
        layer's experts whole, one copy per part) and computed there. Returns their sum per token, the
        recorded observer inputs and the copies."""
        dev = x.device
        sel = np.flatnonzero(upload)
        experts, index = np.unique(ids[sel], return_inverse=True)
        e_t = torch.from_numpy(experts)
        if whole:
            copied = self._whole_copies(layer, dev)
            self._prefetch(self.next_layer.get(layer.layer))
            index, slot_of = ids[sel], experts  # the copies are indexed by expert id
        else:
            copied, slot_of = _upload(layer, e_t, dev), np.arange(len(experts))
        parts = {c.role: ExpertTensor(t, c.qtype, c.cols) for c, t in zip(layer.pool.components, copied, strict=True)}  # fmt: skip
        source = _over(layer.host, parts)
        backend = cuda_backend if source.device_parts() is not None else torch_backend
        rec = _Recorder(observers, None if whole else _to(dev, experts)[0]) if observers else None
        pair_tok, pair_index, pair_w = _to(dev, tok[sel], index, w[sel])
        y = _partial(backend, source, rec or _NO_TAPS, x, pair_tok, pair_index, pair_w)
        self._stats.upload_experts += experts.size
        self._stats.upload_pairs += sel.size
        self._stats.bytes_uploaded += (layer.n_expert if whole else experts.size) * layer.record_bytes
        where = np.full(layer.n_expert, -1, np.int64)
        where[experts] = slot_of
        return y, rec, BatchCopies({role: t.raw for role, t in parts.items()}, where)

    def _claim_prefetched(self, layer: HybridLayer | None) -> tuple[list[torch.Tensor], Any] | None:
        """The copy started ahead for ``layer`` (None: for no layer), if any; copies for other layers are not
        needed any more and are dropped (counted unused)."""
        got = self._prefetched.pop(layer.layer, None) if layer is not None else None
        self._stats.prefetches_unused += len(self._prefetched)
        self._prefetched.clear()
        return got

    def _whole_copies(self, layer: HybridLayer, dev: torch.device) -> list[torch.Tensor]:
        """The layer's experts whole on ``dev``, a tensor per pool component: the copy the last layer started
        (the compute stream waits for it), else one now."""
        got = self._claim_prefetched(layer)
        if got is None:
            return _copy_whole(layer, dev)
        copies, done = got
        stream = torch.cuda.current_stream(dev)
        stream.wait_event(done)
        for t in copies:
            t.record_stream(stream)  # used here, allocated on the copy stream
        return copies

    def _prefetch(self, layer: HybridLayer | None) -> None:
        """Start copying ``layer``'s experts whole on the copy stream: only from the page-locked file (a
        pageable copy would hold the host) and while the device has room for it twice over."""
        if layer is None or not layer.whole or self.copy_stream is None or self.pinned is None:
            return
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        if torch.cuda.mem_get_info(self.device)[0] + cached < 2 * layer.n_expert * layer.record_bytes:
            return
        with torch.cuda.stream(self.copy_stream):
            copies = _copy_whole(layer, self.device)
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        self._prefetched[layer.layer] = (copies, done)
        self._stats.prefetched += 1

    def close(self) -> None:
        """Wait for the last decode step and the copies, stop the threads, unlock the file's pages (also when
        the last step failed: its error is raised after)."""
        try:
            self.finish_step()
        finally:
            self.worker.shutdown()
            self.copier.shutdown()
            if self.read_ahead is not None:
                self.read_ahead.close()
            self._prefetched.clear()
            if self.pinned is not None:
                self.pinned.release()
                self.pinned = None


def host_records(layer: HybridLayer, experts: torch.Tensor, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:  # fmt: skip
    """Experts ``experts`` (n,) of ``layer`` from host memory, per pool component (n, rows, row bytes), into
    ``out`` if given: gathered from the mapped file, or (a layer streamed through a host expert cache) from
    the cache's slots, held while they are copied, a cache's worth at a time."""
    comps = layer.pool.components
    out = out or [torch.empty((len(experts), *_shape(c)), dtype=torch.uint8) for c in comps]
    if layer.host.kind != "streamed":
        for c, dst in zip(comps, out, strict=True):
            torch.index_select(getattr(layer.host, c.role).raw, 0, experts, out=dst)
        return out
    cache = layer.host.cache
    views = cache.layers[layer.layer].views(torch.from_numpy(cache.slab))
    ids = experts.tolist()
    for a in range(0, len(ids), cache.capacity):
        with cache.held(layer.layer, ids[a : a + cache.capacity], serve=False) as (_, slots):
            index = torch.tensor(slots)
            for c, dst in zip(comps, out, strict=True):
                torch.index_select(views[c.role], 0, index, out=dst[a : a + len(slots)])
    return out


def _copy_whole(layer: HybridLayer, device: torch.device) -> list[torch.Tensor]:
    """``layer``'s experts whole on ``device`` (one copy per pool component, on the current stream)."""
    return [_to_device(getattr(layer.host, c.role).raw, device) for c in layer.pool.components]


def _to_device(raw: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A contiguous host tensor on ``device`` (one copy; the host tensor itself on a CPU)."""
    return raw if device.type == "cpu" else raw.to(device, non_blocking=True)


class Staging:
    """Two pinned host buffers that a batch's expert copies pass through in turns: one is filled (gathered
    from host memory) while the other's copy to the device runs. Allocated once: pinning memory is slow (a
    batch's own pinned buffers made a 40-layer prefill spend most of its time allocating them)."""

    def __init__(self, nbytes: int) -> None:
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.copied: list[Any] = [None, None]  # the event after each buffer's last copy
        self.turn = 0

    def take(self) -> tuple[torch.Tensor, int]:
        """A buffer whose last copy has finished, and its index (for ``done``)."""
        i, self.turn = self.turn, 1 - self.turn
        if self.copied[i] is not None:
            self.copied[i].synchronize()
        return self.buffers[i], i

    def done(self, i: int) -> None:
        self.copied[i] = torch.cuda.Event()
        self.copied[i].record()


def _upload(layer: HybridLayer, experts: torch.Tensor, device: torch.device) -> list[torch.Tensor]:
    """Experts ``experts`` of ``layer`` copied from host memory to ``device``, per pool component: gathered
    into the executor's pinned buffers a share at a time, each share copied asynchronously while the next
    is gathered."""
    if device.type != "cuda":
        return host_records(layer, experts)
    comps = layer.pool.components
    out = [torch.empty((len(experts), *_shape(c)), dtype=torch.uint8, device=device) for c in comps]
    if layer.executor.pinned is not None and layer.host.kind == "per-use":
        # straight from the page-locked file: one copy per run of consecutive experts and part
        ids = experts.numpy()
        cut = np.flatnonzero(np.diff(ids) != 1) + 1
        for a, b in zip([0, *cut.tolist()], [*cut.tolist(), len(ids)], strict=True):
            e = int(ids[a])
            for c, dst in zip(comps, out, strict=True):
                dst[a:b].copy_(getattr(layer.host, c.role).raw[e : e + b - a], non_blocking=True)
        return out
    staging = layer.executor.staging
    share = max(1, STAGING_BYTES // layer.record_bytes)
    for a in range(0, len(experts), share):
        part = experts[a : a + share]
        buf, i = staging.take()
        views, at = [], 0
        for c in comps:
            n = len(part) * c.expert_bytes
            views.append(buf[at : at + n].view(len(part), *_shape(c)))
            at += n
        for dst, src in zip(out, host_records(layer, part, views), strict=True):
            dst[a : a + len(part)].copy_(src, non_blocking=True)
        staging.done(i)
    return out


def _coldest(count: np.ndarray, n: int) -> np.ndarray:
    """The indices of the ``n`` smallest counts, smallest first (ties: the lower index), as a stable argsort's
    first ``n`` but without sorting them all (a pool holds thousands of slots; a step admits one or two)."""
    if n <= 0 or n >= count.size:
        return np.argsort(count, kind="stable")[: max(n, 0)]
    cut = np.partition(count, n - 1)[n - 1]
    below = np.flatnonzero(count < cut)
    at = np.flatnonzero(count == cut)[: n - below.size]
    both = np.concatenate([below, at])
    return both[np.argsort(count[both], kind="stable")]


def _on_side_stream(pool: SlotPool, copy: Callable[[], None], reads: Iterable[torch.Tensor] = ()) -> Any:
    """Run ``copy`` on ``pool``'s side stream after the kernels queued so far (they may read the slots' old
    experts), ``reads`` kept from reuse until it is done. Returns its event (None on a host pool: copied now)."""
    if pool.stream is None:
        copy()
        return None
    queued = torch.cuda.Event()
    queued.record()
    with torch.cuda.stream(pool.stream):
        pool.stream.wait_event(queued)
        copy()
        for t in reads:
            t.record_stream(pool.stream)
        done = torch.cuda.Event()
        done.record(pool.stream)
    return done


def _finished(copied: Any, wait: bool = False) -> bool:
    """Whether an admission's copy is done: None (copied at once), a CUDA event, or the copier's job (a
    future of the event its copy records)."""
    if copied is None:
        return True
    if isinstance(copied, Future):
        if not (wait or copied.done()):
            return False
        copied = copied.result()
    if wait:
        copied.synchronize()
    return bool(copied.query())


@torch.inference_mode()  # as the model's forward pass (the mode is per thread)
def answer_missed(row: np.ndarray, index: np.ndarray, miss: np.ndarray, records: cpu_kernels.EncodedExperts,
                  h: np.ndarray, out: np.ndarray) -> None:  # fmt: skip
    """A decode step's CPU answer to one mailbox row (k ids, k weights, the input): ``out`` = h + the weighted
    sum of the pairs at positions ``miss``, computed from the encoded ``records``, whose rows ``index`` (int64)
    hold those pairs' experts."""
    k = (row.size - h.size) // 2
    act = np.empty((miss.size, records.n_ff), np.float32)
    cpu_kernels.routed_ffn_into(row[2 * k :], index, row[k : 2 * k][miss], records, h, act, out)


def _stage_and_copy(pool: SlotPool, i: int, slot: int, layer: HybridLayer, expert: int, queued: Any) -> Any:
    """The copier thread: expert ``expert``'s record from host memory into staging record ``i`` (pinned),
    then into ``slot`` on the pool's side stream after the kernels ``queued`` marks. Returns its event."""
    host_records(
        layer,
        torch.tensor([expert]),
        [pool.view(pool.stage, c.role, slice(i, i + 1)) for c in pool.components],
    )
    with torch.cuda.stream(pool.stream):
        pool.stream.wait_event(queued)
        for part, slots in pool.parts.items():
            slots[slot].copy_(pool.stage[part][i], non_blocking=True)
        done = torch.cuda.Event()
        done.record(pool.stream)
    return done


class _NoTaps:
    observers: list[Any] = []
    round_in = round_act = None
    rounds = False

    def watchers(self) -> list[Any]:
        return []


_NO_TAPS = _NoTaps()


def _to(device: torch.device, *rows: np.ndarray | torch.Tensor) -> list[torch.Tensor]:
    """Index rows (exact in float32) and weights to ``device`` in one copy: the integer ones as int64."""
    packed = torch.stack([torch.as_tensor(r, dtype=torch.float32) for r in rows])
    if device.type != "cpu":  # pinned: an asynchronous copy, which does not wait for the queued kernels
        packed = packed.pin_memory().to(device, non_blocking=True)
    return [r if isinstance(src, torch.Tensor) and src.is_floating_point() else r.long()
            for r, src in zip(packed.unbind(0), rows, strict=True)]  # fmt: skip


def measure_rates(executor: HybridExperts, layer: HybridLayer, repeat: int = 5) -> Rates:
    """The rate of a batch's copies to the fast device (16 experts' records, as ``_upload`` makes them, other
    experts each repetition) and the CPU side's time for one expert's 2 and 32 pairs (after first calls, which
    load or compile the kernels): a few milliseconds."""
    dev = executor.device

    def best(f: Callable[[], object]) -> float:
        f()
        f()  # the first calls of a kernel in a process are slower (its pages, numba's thread pool)
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            f()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t0)
        return min(times)

    # a batch's copy as it is made: 16 experts gathered from host memory, then copied; other experts each
    # time, as a batch's misses are (the same 16 again were cache-warm: 6-10x the rate on this box's 2 cores)
    n = max(1, min(16, layer.n_expert // (repeat + 2)))
    batches = itertools.cycle(torch.arange(layer.n_expert // n * n).view(-1, n))
    copy_s = best(lambda: _upload(layer, next(batches), dev))
    whole_bps = 0.0
    if layer.whole:  # one part of the layer, whole (the first copy also faults the mapping in)
        part = layer.host.down.raw
        whole_bps = part.nbytes / max(best(lambda: _to_device(part, dev)), 1e-9)
    n_embd = layer.host.down.rows
    x = torch.randn(32, n_embd, generator=torch.Generator().manual_seed(0)) * 0.1

    def cpu(rows: int, experts: int = 1) -> Callable[[], object]:
        """``rows`` pairs of each of ``experts`` experts (one call)."""
        ids = torch.arange(experts).repeat_interleave(rows)
        n = rows * experts
        return lambda: _partial(
            layer.host_backend, layer.host, _NO_TAPS, x[:n], torch.arange(n), ids, torch.ones(n)
        )

    def cpu_times() -> tuple[float, float, float]:
        cpu(1)()  # the one-token kernel: loaded now, not by the first step
        cpu_kernels.use_threads(executor.cpu_threads)  # as the CPU side runs
        return best(cpu(lo)), best(cpu(32)), best(cpu(1, ones)) / ones

    # groups of fewer pairs than ``few`` are computed from the encoded bytes (0: the torch path, none); the
    # decoded groups' rate from ``lo`` and 32 pairs of one expert, one pair's from the encoded bytes from
    # ``ones`` experts of one pair each in one call (as a batch's CPU side holds many)
    ones = max(1, min(8, layer.n_expert))
    few = cpu_kernels.DIRECT_BELOW[layer.encoded.acts] if layer.encoded is not None else 0
    lo = max(2, 2 * few)
    # on the worker, as the CPU side runs: a second thread's kernel calls would start a second OpenMP team,
    # and with more of its threads than cores every team sleeps between calls (+80 us a call, measured)
    t_lo, t32, t1 = executor.worker.submit(cpu_times).result()
    pair = max(t32 - t_lo, 0.0) / (32 - lo)
    expert = max(t_lo - lo * pair, 0.0)
    return Rates(n * layer.record_bytes / max(copy_s, 1e-9), expert, pair, whole_bps, t1, few)


def attach(model: Any, cache_bytes: int, profile: Path | None = None, device: torch.device | str | None = None,
           rates: Rates | None = None) -> HybridExperts:  # fmt: skip
    """Hybrid experts for ``model`` (its weights loaded with ``host_experts``), kept as ``model.hybrid``."""
    prof = None
    if profile is not None:
        from forge.profile_file import Profile

        prof = Profile.load(profile)
    model.hybrid = HybridExperts(model, cache_bytes, device, prof, rates)
    return model.hybrid


def format_stats(h: HybridExperts) -> str:
    s, r = h.stats, h.rates
    return (
        f"hybrid experts: {s.gpu_hits} GPU hits ({s.hit_rate:.1%}, {s.gpu_pairs} pairs), {s.upload_experts} "
        f"uploaded for a batch ({s.upload_pairs} pairs), {s.cpu_computes} CPU computes ({s.cpu_pairs} pairs), "
        f"{s.bytes_read / 1e6:,.1f} MB read by the CPU, {s.bytes_uploaded / 1e6:,.1f} MB uploaded, "
        f"{s.admissions} admissions, {s.evictions} evictions, CPU side {s.cpu_seconds:.3f} s "
        f"({s.wait_seconds:.3f} s waited); {_steps(s)}pool {h.capacity} experts ({h.nbytes / (1 << 20):,.0f} MiB on "
        f"{h.device}); measured: copy {r.upload_bps / 1e9:,.1f} GB/s, CPU {r.cpu_expert_s * 1e3:.3f} ms per "
        f"expert + {r.cpu_pair_s * 1e3:.3f} ms per pair ({r.cpu_direct_s * 1e3:.3f} ms per pair of experts of "
        f"fewer than {r.direct_below}, from the encoded bytes); {_pinned(h.pinned)}"
    )


def _steps(s: HybridStats) -> str:
    if not s.step_layers:
        return ""
    us = 1e6 / s.step_layers
    return (
        f"decode steps: {s.step_hit_rate:.1%} GPU hits, per layer {s.step_device_seconds * us:.0f} us on the "
        f"device between layers, {s.step_cpu_seconds * us:.0f} us in the CPU kernel, "
        f"{s.step_host_seconds * us:.0f} us on the host between steps ({s.step_admissions} admissions); "
    )


def _pinned(p: host_pin.PinnedRanges | None) -> str:
    if p is None:
        return "the file's experts not page-locked (copies staged)"
    return f"the file's experts page-locked ({p.nbytes / 1e9:,.1f} GB in {p.seconds:.1f} s)"
