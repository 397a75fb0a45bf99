"""Residency planning: keep the whole model in memory, split the routed experts between a GPU pool and the
CPU (hybrid), or stream them through a cache.

On a CUDA device AUTO first asks the GPU: *resident* when the file, the KV cache and the GPU overhead fit in
its free memory with headroom; else *hybrid* (runtime.hybrid: the hot experts on the GPU in the memory left
after the other weights and the KV cache, the rest computed by the CPU from host memory) when the routed
experts fit in host memory, else *streaming* as below. ``--gpu-expert-cache`` asks for hybrid at that size.

AUTO reads the model's geometry and the host's available memory (psutil) and picks *resident* when
the resident weights, the mapped routed experts, the decoded-expert budget, the KV cache and the fixed
runtime overhead fit with headroom; otherwise *streaming* with the largest expert cache that the
budget admits after the resident weights, KV cache, decode scratch and overhead. ``--memory-budget``
replaces the measured available memory.

Memory model of a streaming run (what the RSS test checks):
    peak RSS <= resident weights + KV cache + decode scratch + cache slab + RUNTIME_OVERHEAD
where the resident weights are every non-routed tensor decoded to float32 (the token embedding stays
encoded when the model has a separate output head).
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from forge.errors import ForgeError
from forge.options import require_context

# Python, torch and its libraries, numba's compiled CPU kernels, allocator slack and activations of a
# decode step (measured on Linux x86-64: ~290 MB after importing torch and the runtime, ~50 MB more once the
# decode kernels are loaded, ~100 MB more while they compile on a first run; the rest is margin).
RUNTIME_OVERHEAD = 448 << 20
# The share of *measured* available memory AUTO leaves to the rest of the system.
HEADROOM = 0.10
DEFAULT_CONTEXT = 4096
# The CUDA context, the kernels' workspaces and the activations of a prefill batch (a rough bound).
GPU_OVERHEAD = 2 << 30


@dataclass(frozen=True)
class Geometry:
    file_bytes: int
    routed_bytes: int  # routed experts as stored (encoded)
    routed_f32_bytes: int  # the same decoded
    resident_bytes: int  # non-routed weights as the runtime holds them
    kv_bytes: int
    scratch_bytes: int  # one token's experts of one layer, decoded (float32), twice
    slot_bytes: int  # the largest expert record
    routed_layers: int
    experts: int  # routed experts in all layers
    experts_used: int

    @property
    def floor(self) -> int:
        return self.routed_layers * self.experts_used + 1


@dataclass(frozen=True)
class Plan:
    mode: str  # "resident", "hybrid" or "streaming"
    reason: str
    budget: int
    budget_source: str  # "--memory-budget" or "available memory"
    cache_experts: int = 0
    cache_bytes: int = 0
    policy: str = "lru"
    geometry: Geometry | None = None
    gpu_cache_bytes: int = 0  # hybrid: the GPU expert pool

    def describe(self) -> str:
        g = self.geometry
        line = f"residency: {self.mode} ({self.reason})"
        if self.mode == "hybrid" and g is not None:
            line += (
                f"; GPU expert cache: {_mib(self.gpu_cache_bytes)} (~{self.gpu_cache_bytes // g.slot_bytes} of "
                f"{g.experts} experts), the others computed on the CPU"
            )
            if self.cache_experts:
                line += (
                    f" from a host expert cache of {self.cache_experts} experts ({_mib(self.cache_bytes)})"
                )
        if self.mode == "streaming" and g is not None:
            line += (
                f"; expert cache: {self.cache_experts} of {g.experts} experts "
                f"({_mib(self.cache_bytes)}, {self.policy}, floor {g.floor})"
            )
        return line

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.0f} MiB"


def geometry(weights: Any, context: int = DEFAULT_CONTEXT) -> Geometry:
    """The memory geometry of an opened GGUFWeights."""
    layers = weights.expert_layers()
    used = int(weights.hparam("expert_used_count"))
    routed = sum(lay.experts * lay.record_bytes for lay in layers.values())
    routed_f32 = sum(
        lay.experts * sum(c.rows * c.cols for c in lay.components) * 4 for lay in layers.values()
    )
    routed_names = {
        f"blk.{lay.layer}.ffn_{c.role}_exps.weight" for lay in layers.values() for c in lay.components
    }
    tied = not weights.has("output.weight")
    resident = 0
    for name, t in weights._tensors.items():
        if name in routed_names:
            continue
        if name == "token_embd.weight" and not tied:
            resident += t.nbytes  # rows decoded per lookup
        else:
            resident += int(np.prod(t.shape)) * 4
    n_layer = int(weights.hparam("block_count"))
    n_head = int(weights.hparam("attention.head_count", 1))
    n_kv = int(weights.hparam("attention.head_count_kv", n_head))
    head_dim = int(weights.hparam("attention.key_length", int(weights.hparam("embedding_length")) // n_head))
    kv = n_layer * context * n_kv * head_dim * 2 * 4
    scratch = 2 * used * max(sum(c.rows * c.cols for c in lay.components) * 4 for lay in layers.values())
    slot = max(lay.record_bytes for lay in layers.values())
    n_experts = sum(lay.experts for lay in layers.values())
    return Geometry(
        Path(weights.path).stat().st_size, routed, routed_f32, resident, kv, scratch, slot, len(layers),
        n_experts, used,
    )  # fmt: skip


def available_memory() -> tuple[int, str]:
    import psutil

    vm, swap = psutil.virtual_memory(), psutil.swap_memory()
    return int(vm.available), f"available memory {_mib(int(vm.available))}, swap free {_mib(int(swap.free))}"


def gpu_free_memory(device: Any) -> int:
    import torch

    return int(torch.cuda.mem_get_info(torch.device(device))[0])


def plan(
    weights: Any,
    mode: str = "auto",
    memory_budget: int | None = None,
    cache_experts: int | None = None,
    cache_bytes: int | None = None,
    policy: str = "lru",
    expert_budget: int = 0,
    context: int = DEFAULT_CONTEXT,
    gpu_cache_bytes: int | None = None,
    gpu_memory: int | None = None,
) -> Plan:
    """Decide residency for ``weights`` (GGUFWeights). ``mode``: auto, resident, hybrid or streaming.

    ``gpu_cache_bytes``: ``--gpu-expert-cache`` (hybrid at that size); ``gpu_memory``: the GPU's free memory
    (default: measured when the weights' device is CUDA)."""
    if mode not in ("auto", "resident", "hybrid", "streaming"):
        raise ForgeError(f"unknown residency mode {mode!r}")
    if cache_experts is not None and cache_bytes is not None:
        raise ForgeError("give --cache-experts or --cache-bytes, not both")
    g = geometry(weights, context)
    if memory_budget is not None:
        budget, source = memory_budget, f"--memory-budget {_mib(memory_budget)}"
    else:
        avail, source = available_memory()
        budget = int(avail * (1 - HEADROOM))
        source += f", {HEADROOM:.0%} left as headroom"
    fixed = g.resident_bytes + g.kv_bytes + RUNTIME_OVERHEAD
    need_resident = fixed + g.routed_bytes + min(expert_budget, g.routed_f32_bytes)
    explicit_cache = cache_experts is not None or cache_bytes is not None
    # the host's expert cache of a hybrid plan that streams: what --cache-* say, else what the budget leaves
    # after the runtime (the other weights are on the GPU) and the decode scratch
    if cache_experts is not None:
        host_n = cache_experts
    elif cache_bytes is not None:
        host_n = cache_bytes // g.slot_bytes
    else:
        host_n = max(budget - RUNTIME_OVERHEAD - g.scratch_bytes, 0) // g.slot_bytes
    host_n = min(host_n, g.experts)

    def hybrid(gpu_bytes: int, why: str, streamed: bool) -> Plan:
        if gpu_bytes < g.slot_bytes:
            raise ForgeError(f"a GPU expert cache needs at least one expert ({g.slot_bytes:,} bytes)")
        n = 0
        if streamed:
            if host_n < g.floor:
                raise ForgeError(
                    f"a host expert cache of {host_n} experts is below the floor of {g.floor} "
                    f"({g.routed_layers} layers x {g.experts_used} experts per token + 1)"
                )
            why += f"; the CPU's experts streamed from the file through a host cache of {host_n} experts"
            n = host_n
        return Plan("hybrid", why, budget, source, n, n * g.slot_bytes, "lfu", g, gpu_bytes)

    if mode == "hybrid" or gpu_cache_bytes is not None:
        why = f"--gpu-expert-cache {_mib(gpu_cache_bytes or 0)}"
        return hybrid(gpu_cache_bytes or 0, why, mode == "streaming" or explicit_cache)
    if mode == "auto" and not explicit_cache and (gpu_memory is not None or weights.device.type == "cuda"):
        gpu = gpu_memory if gpu_memory is not None else gpu_free_memory(weights.device)
        gpu_budget = int(gpu * (1 - HEADROOM))
        need_gpu = g.file_bytes + g.kv_bytes + GPU_OVERHEAD
        if need_gpu <= gpu_budget:
            why = f"model needs {_mib(need_gpu)} on the GPU, fits in its free {_mib(gpu)} less {HEADROOM:.0%}"
            return Plan("resident", why, budget, source, geometry=g, policy=policy)
        room = gpu_budget - (g.file_bytes - g.routed_bytes) - g.kv_bytes - GPU_OVERHEAD
        if room >= g.slot_bytes:
            why = (
                f"model needs {_mib(need_gpu)} on the GPU, more than its free {_mib(gpu)} less {HEADROOM:.0%}"
            )
            fits = g.routed_bytes + RUNTIME_OVERHEAD <= budget
            why += (
                f"; the routed experts ({_mib(g.routed_bytes)}) {'fit' if fits else 'do not fit'} in {source}"
            )
            return hybrid(room, why, not fits)
    if mode == "resident" or (mode == "auto" and not explicit_cache and need_resident <= budget):
        why = "--resident" if mode == "resident" else f"model needs {_mib(need_resident)}, fits in {source}"
        return Plan("resident", why, budget, source, geometry=g, policy=policy)
    if cache_experts is not None:
        n, why = cache_experts, f"--cache-experts {cache_experts}"
    elif cache_bytes is not None:
        n, why = cache_bytes // g.slot_bytes, f"--cache-bytes {_mib(cache_bytes)}"
    else:
        room = budget - fixed - g.scratch_bytes
        n = max(room, 0) // g.slot_bytes
        if n < g.floor:
            raise ForgeError(
                f"memory budget {_mib(budget)} is too small to stream: resident weights, KV cache and "
                f"overhead take {_mib(fixed + g.scratch_bytes)}, the expert cache floor of {g.floor} experts "
                f"needs {_mib(g.floor * g.slot_bytes)} more"
            )
        n = min(n, g.experts)
        why = f"model needs {_mib(need_resident)}, more than {source}"
        if mode == "streaming":
            why = "--ssd-streaming, " + why
    if n < g.floor:
        raise ForgeError(
            f"expert cache of {n} experts is below the floor of {g.floor} "
            f"({g.routed_layers} layers x {g.experts_used} experts per token + 1)"
        )
    n = min(n, g.experts)
    return Plan("streaming", why, budget, source, n, n * g.slot_bytes, policy, g)


def load_planned_model(
    path: Path,
    device: str,
    mode: str = "auto",
    memory_budget: int | None = None,
    cache_experts: int | None = None,
    cache_bytes: int | None = None,
    policy: str = "lru",
    expert_budget: int = 0,
    ggml_numerics: bool = False,
    context: int | None = None,
    observers: list[Any] | None = None,
    log: Any = None,
    gpu_cache_bytes: int | None = None,
    expert_profile: Path | None = None,
) -> tuple[Any, Plan | None]:
    """Plan residency, print the decision (to ``log``, default stderr) and load the model accordingly.

    ``gpu_cache_bytes``: ``--gpu-expert-cache``; ``expert_profile``: a ``forge prune profile`` JSON seeding a
    hybrid plan's GPU expert pool."""
    from runtime.models import build_model, prepare_decode
    from runtime.weights import GGUFWeights, load_weights, open_expert_cache

    say = log or (lambda s: sys.stderr.write(s + "\n"))
    weights = load_weights(path, device, expert_budget, ggml_numerics)
    require_context("--ctx", context, int(weights.hparam("context_length") or 0))
    p = None
    if isinstance(weights, GGUFWeights):
        p = plan(weights, mode, memory_budget, cache_experts, cache_bytes, policy, expert_budget,
                 context or DEFAULT_CONTEXT, gpu_cache_bytes)  # fmt: skip
        say(p.describe())
        if p.mode == "streaming":
            weights.expert_cache = open_expert_cache(weights, p.cache_experts, policy)
        elif p.mode == "hybrid" and p.cache_experts:  # the CPU side's experts streamed into host memory
            from runtime.experts import ExpertCache

            layers, used = weights.expert_layers(), int(weights.hparam("expert_used_count"))
            weights.expert_cache = ExpertCache(weights.path, layers, p.cache_experts, used, "lfu", "cpu")
        weights.host_experts = p.mode == "hybrid"
    elif mode in ("streaming", "hybrid") or gpu_cache_bytes is not None:
        raise ForgeError(
            f"{path}: expert streaming and hybrid experts need a GGUF file, not a Hugging Face folder"
        )
    model = build_model(weights, observers)
    prepare_decode(model, say)
    if p is not None and p.mode == "hybrid":
        from runtime.hybrid import attach

        attach(model, p.gpu_cache_bytes, expert_profile)
    elif expert_profile is not None:
        say(
            f"--expert-profile: ignored, residency is {p.mode if p else 'resident'} (it seeds a GPU expert cache)"
        )
    return model, p


def model_stats(model: Any) -> str:
    """``--stats``: the hybrid executor's or the expert cache's figures."""
    hybrid = getattr(model, "hybrid", None)
    cache = getattr(model.weights, "expert_cache", None)
    if hybrid is not None:  # its CPU side streamed through a host expert cache: that cache's reads too
        from runtime.hybrid import format_stats as hybrid_stats

        return hybrid_stats(hybrid) + (f"; host {format_stats(cache)}" if cache is not None else "")
    return format_stats(cache) if cache is not None else "expert cache: none (resident)"


def format_stats(cache: Any) -> str:
    s = cache.stats
    return (
        f"expert cache: {s.lookups} lookups, {s.hits} hits ({s.hit_rate:.1%}), {s.misses} misses, "
        f"{s.reads} reads, {s.bytes_read / 1e6:,.1f} MB read in {s.read_seconds:.3f} s, "
        f"{s.evictions} evictions, {cache.capacity} slots of {cache.slot_bytes:,} bytes"
        + (
            f"; prefetch: {s.prefetch_issued} read ahead, {s.prefetch_used} used, {s.prefetch_wasted} wasted, "
            f"{s.wait_seconds:.3f} s waited"
            if s.prefetch_issued or getattr(cache, "prefetching", False)
            else ""
        )
    )
