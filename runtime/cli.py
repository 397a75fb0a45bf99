"""``forge run`` and ``forge eval``: thin typer functions over runtime.generate / runtime.evaluate."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from forge.errors import ForgeError
from forge.fileio import read_text
from forge.options import require_choice, require_float, require_int, require_seed

DeviceOpt = Annotated[str, typer.Option(help="cpu, cuda or mps")]
ThreadsOpt = Annotated[
    int | None,
    typer.Option(help="CPU threads for the compiled kernels and torch (default: torch's choice, the cores)"),
]
GgmlOpt = Annotated[
    bool,
    typer.Option(
        "--ggml-numerics", help="round matmul inputs and the KV cache as llama.cpp's CPU backend does"
    ),
]
Q8Opt = Annotated[
    bool,
    typer.Option(
        "--q8-activations",
        help="CPU decode steps (--device cpu, or the CPU side of --gpu-expert-cache): multiply Q4_K/Q5_K/Q6_K weights with 8-bit activations as llama.cpp does (each product moves by about 1 percent; without it, hosts with AVX-512 VNNI take 22-bit integer activations, about 1e-6, and others float32)",
    ),
]
ExpertCacheOpt = Annotated[
    int,
    typer.Option(
        "--expert-cache-mib", help="MiB of decoded routed experts kept resident (0: decode per use)"
    ),
]
PruneMaskOpt = Annotated[
    Path | None,
    typer.Option("--prune-mask", help="expert prune mask (ds4 grid: a line per routed layer, 1 = prune)"),
]


def _apply_prune_mask(model: object, mask_file: Path | None) -> None:
    if mask_file is None:
        return
    from forge.mask_file import read_mask
    from runtime.models import apply_prune_mask

    mask = read_mask(mask_file)
    n = apply_prune_mask(model, mask)
    sys.stderr.write(
        f"expert prune mask active: {n} of {mask.pruned.size} experts masked ({mask.n_layers} layers) "
        f"from {mask_file}\n"
    )


ResidentOpt = Annotated[
    bool, typer.Option("--resident", help="keep the whole model in memory (default: AUTO decides)")
]
StreamingOpt = Annotated[
    bool,
    typer.Option("--ssd-streaming", help="read routed experts from the file on demand into an expert cache"),
]
CacheExpertsOpt = Annotated[
    int | None, typer.Option("--cache-experts", help="expert cache capacity in whole experts (streaming)")
]
CacheBytesOpt = Annotated[
    str | None, typer.Option("--cache-bytes", help="expert cache size, e.g. 4G (streaming)")
]
BudgetOpt = Annotated[
    str | None,
    typer.Option("--memory-budget", help="memory the planner may use, e.g. 16G (default: available memory)"),
]
PolicyOpt = Annotated[str, typer.Option("--cache-policy", help="expert cache eviction: lru or lfu")]
StatsOpt = Annotated[bool, typer.Option("--stats", help="print expert cache statistics at the end")]
GpuCacheOpt = Annotated[
    str | None,
    typer.Option(
        "--gpu-expert-cache",
        help="hybrid experts: a GPU pool of this size (e.g. 4G) for the hot experts, the others on the CPU "
        "(with --ssd-streaming / --cache-bytes: read from the file through a host expert cache)",
    ),
]
ProfileOpt = Annotated[
    Path | None,
    typer.Option("--expert-profile", help="a `forge prune profile` JSON seeding the GPU expert cache"),
]
PrefetchOpt = Annotated[
    bool,
    typer.Option(
        "--prefetch", help="read the next layer's predicted experts ahead, in the background (streaming)"
    ),
]


@dataclass
class Residency:
    """The residency flags of ``forge run`` / ``forge eval``."""

    resident: bool = False
    ssd_streaming: bool = False
    cache_experts: int | None = None
    cache_bytes: str | None = None
    memory_budget: str | None = None
    cache_policy: str = "lru"
    prefetch: bool = False
    gpu_expert_cache: str | None = None
    expert_profile: Path | None = None

    def load(self, model: Path, device: str, expert_budget: int, ggml_numerics: bool, context: int | None):  # noqa: ANN201
        from forge.gguf_file import parse_size
        from runtime.planner import load_planned_model

        require_choice("--cache-policy", self.cache_policy, ("lru", "lfu"))
        require_int("--cache-experts", self.cache_experts, 1)
        require_int("--ctx", context, 2)
        if self.resident and self.ssd_streaming:
            raise ForgeError("--resident and --ssd-streaming exclude each other")
        if self.resident and (self.cache_experts is not None or self.cache_bytes is not None):
            raise ForgeError("--cache-experts/--cache-bytes apply to --ssd-streaming, not --resident")
        if self.gpu_expert_cache is not None and self.resident:
            raise ForgeError("--gpu-expert-cache excludes --resident")
        if self.gpu_expert_cache is not None and device != "cuda":
            raise ForgeError("--gpu-expert-cache needs --device cuda")
        if self.expert_profile is not None and not self.expert_profile.is_file():
            raise ForgeError(f"{self.expert_profile}: no such file")
        mode = "resident" if self.resident else "streaming" if self.ssd_streaming else "auto"
        m, plan = load_planned_model(
            model,
            device,
            mode,
            parse_size(self.memory_budget) if self.memory_budget else None,
            self.cache_experts,
            parse_size(self.cache_bytes) if self.cache_bytes else None,
            self.cache_policy,
            expert_budget,
            ggml_numerics,
            context,
            gpu_cache_bytes=parse_size(self.gpu_expert_cache) if self.gpu_expert_cache else None,
            expert_profile=self.expert_profile,
        )
        if self.prefetch:
            from runtime.prefetch import attach_prefetcher

            if attach_prefetcher(m) is None:
                sys.stderr.write("--prefetch: ignored, the model is resident (no expert cache)\n")
        return m, plan


def cache_stats(m) -> dict | None:  # noqa: ANN001
    hybrid = getattr(m, "hybrid", None)
    cache = getattr(m.weights, "expert_cache", None)
    if hybrid is not None:  # over a host expert cache: that cache's figures as ``host_cache``
        return hybrid.stats.to_json() | ({"host_cache": cache.stats.to_json()} if cache is not None else {})
    return None if cache is None else cache.stats.to_json()


def print_stats(m) -> None:  # noqa: ANN001
    from runtime.cpu_rows import activation_form, describe_form
    from runtime.planner import model_stats

    sys.stderr.write(model_stats(m) + "\n")
    if m.weights.cpu_kernels or getattr(m, "hybrid", None) is not None:
        sys.stderr.write(f"cpu products: K-quant rows on {describe_form(activation_form())}\n")


def _setup(
    device: str, threads: int | None, expert_cache_mib: int = 0, q8: bool = False, hybrid: bool = False
) -> str:
    """Check the device and thread options (and the expert cache size), then apply the thread count and
    ``--q8-activations`` (``runtime.cpu_q8``: every model this process loads next; with ``hybrid``, a
    ``--gpu-expert-cache``, the CPU side's experts)."""
    import os

    import torch

    require_int("--threads", threads, 1)
    require_int("--expert-cache-mib", expert_cache_mib, 0)

    require_choice("--device", device, ("cpu", "cuda", "mps"))
    if q8 and device != "cpu" and not hybrid:
        raise ForgeError(
            "--q8-activations is for --device cpu or the CPU side of --gpu-expert-cache (the CPU kernels' products)"
        )
    if device == "cuda" and not torch.cuda.is_available():
        raise ForgeError("--device cuda: no CUDA device is available")
    if device == "mps" and not torch.backends.mps.is_available():
        raise ForgeError("--device mps: Metal (MPS) is not available")
    if threads is not None:
        torch.set_num_threads(threads)
    if q8:
        os.environ["FORGE_Q8_ACTIVATIONS"] = "1"
    return device


def run(
    model: Annotated[Path, typer.Argument(help="GGUF file (or Hugging Face folder)")],
    prompt: Annotated[str, typer.Option("-p", "--prompt", help="prompt text")],
    chat: Annotated[
        bool, typer.Option("--chat", help="wrap the prompt in the model's chat template")
    ] = False,
    system: Annotated[str | None, typer.Option(help="system message (with --chat)")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", help="tokens to generate at most")] = 128,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.0,
    top_k: Annotated[int, typer.Option("--top-k", help="0 = off")] = 0,
    top_p: Annotated[float, typer.Option("--top-p", help="1 = off")] = 1.0,
    seed: Annotated[int | None, typer.Option(help="sampling seed")] = None,
    ctx: Annotated[int | None, typer.Option(help="context length (default: the model's)")] = None,
    device: DeviceOpt = "cpu",
    threads: ThreadsOpt = None,
    expert_cache_mib: ExpertCacheOpt = 1024,
    ggml_numerics: GgmlOpt = False,
    q8_activations: Q8Opt = False,
    prune_mask: PruneMaskOpt = None,
    resident: ResidentOpt = False,
    ssd_streaming: StreamingOpt = False,
    cache_experts: CacheExpertsOpt = None,
    cache_bytes: CacheBytesOpt = None,
    memory_budget: BudgetOpt = None,
    cache_policy: PolicyOpt = "lru",
    stats: StatsOpt = False,
    prefetch: PrefetchOpt = False,
    gpu_expert_cache: GpuCacheOpt = None,
    expert_profile: ProfileOpt = None,
) -> None:
    """Generate text from a prompt, streamed; prints prefill and decode tokens/s at the end."""
    from runtime.generate import Sampling, generate
    from runtime.tokenizer import Tokenizer

    require_int("--max-tokens", max_tokens, 0)
    require_float("--temperature", temperature, 0)
    require_int("--top-k", top_k, 0)
    require_float("--top-p", top_p, 0, 1, lo_open=True)
    require_seed("--seed", seed)
    dev = _setup(device, threads, expert_cache_mib, q8_activations, gpu_expert_cache is not None)
    residency = Residency(
        resident, ssd_streaming, cache_experts, cache_bytes, memory_budget, cache_policy, prefetch,
        gpu_expert_cache, expert_profile,
    )  # fmt: skip
    m, _ = residency.load(model, dev, expert_cache_mib << 20, ggml_numerics, ctx)
    _apply_prune_mask(m, prune_mask)
    tok = Tokenizer.from_metadata(m.weights)
    text = prompt
    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}
        ]
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
    ids = tok.encode(text, parse_special=True)

    def stream(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    res = generate(m, ids, max_tokens, Sampling(temperature, top_k, top_p, seed), tok, stream, context=ctx)
    sys.stdout.write("\n")
    sys.stderr.write(
        f"prefill: {res.prompt_tokens} tokens, {res.prefill_tps:.1f} tok/s | "
        f"decode: {len(res.tokens)} tokens, {res.decode_tps:.1f} tok/s | stop: {res.stopped_by}\n"
    )
    if stats:
        print_stats(m)


def eval_(
    model: Annotated[Path, typer.Argument(help="GGUF file (or Hugging Face folder)")],
    text: Annotated[Path, typer.Option("--text", help="text file to score")],
    ctx: Annotated[int, typer.Option(help="tokens per chunk (llama-perplexity -c)")] = 512,
    chunks: Annotated[int | None, typer.Option(help="first N chunks only (default: all)")] = None,
    reference: Annotated[
        Path | None, typer.Option(help="reference model (GGUF or HF folder) for KL divergence")
    ] = None,
    save_logits: Annotated[
        Path | None,
        typer.Option("--save-logits", help="save this model's logits (top-k) as a reference file"),
    ] = None,
    reference_logits: Annotated[
        Path | None, typer.Option("--reference-logits", help="a file written by --save-logits")
    ] = None,
    top_k: Annotated[int, typer.Option("--top-k", help="logits kept per token with --save-logits")] = 128,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    device: DeviceOpt = "cpu",
    threads: ThreadsOpt = None,
    expert_cache_mib: ExpertCacheOpt = 1024,
    ggml_numerics: GgmlOpt = False,
    prune_mask: PruneMaskOpt = None,
    resident: ResidentOpt = False,
    ssd_streaming: StreamingOpt = False,
    cache_experts: CacheExpertsOpt = None,
    cache_bytes: CacheBytesOpt = None,
    memory_budget: BudgetOpt = None,
    cache_policy: PolicyOpt = "lru",
    stats: StatsOpt = False,
    prefetch: PrefetchOpt = False,
    gpu_expert_cache: GpuCacheOpt = None,
    expert_profile: ProfileOpt = None,
) -> None:
    """Perplexity like llama-perplexity; with a reference also KL divergence, top-1 agreement, RMS Δp."""
    from runtime.evaluate import ReferenceLogits, evaluate, format_report, perplexity_tokens
    from runtime.models import load_model
    from runtime.tokenizer import Tokenizer

    if save_logits is not None and reference_logits is not None:
        raise ForgeError("--save-logits and --reference-logits exclude each other")
    if reference is not None and reference_logits is not None:
        raise ForgeError("give either --reference or --reference-logits")
    require_int("--chunks", chunks, 1)
    require_int("--top-k", top_k, 1)
    require_int("--ctx", ctx, 2)
    body = read_text(text)  # before the model loads: a bad text fails at once
    dev = _setup(device, threads, expert_cache_mib)
    budget = expert_cache_mib << 20
    residency = Residency(
        resident, ssd_streaming, cache_experts, cache_bytes, memory_budget, cache_policy, prefetch,
        gpu_expert_cache, expert_profile,
    )  # fmt: skip
    m, plan = residency.load(model, dev, budget, ggml_numerics, ctx)
    _apply_prune_mask(m, prune_mask)
    ref = load_model(reference, dev, expert_budget=budget, ggml_numerics=ggml_numerics) if reference else None
    ref_logits = ReferenceLogits.load(reference_logits) if reference_logits else None
    tok = Tokenizer.from_metadata(m.weights)
    ids = perplexity_tokens(tok, body, ctx, chunks)
    bos = tok.bos_id if tok.add_bos else None

    def progress(done: int, total: int) -> None:
        if not as_json:
            sys.stderr.write(f"\rchunk {done}/{total}")
            sys.stderr.flush()
            if done == total:
                sys.stderr.write("\n")

    res = evaluate(m, ids, ctx, chunks, ref, ref_logits, save_logits, top_k, bos, progress)
    if as_json:
        out = res.to_json()
        if stats:
            out["residency"] = None if plan is None else plan.mode
            out["expert_cache"] = cache_stats(m)
        sys.stdout.write(json.dumps(out, indent=1) + "\n")
    else:
        sys.stdout.write(format_report(res) + "\n")
        if stats:
            print_stats(m)
