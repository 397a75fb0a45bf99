"""Text generation: prefill the prompt in chunks, then decode token by token, streaming the text."""

from __future__ import annotations

import codecs
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from forge.errors import ForgeError
from runtime.diagnose import check_logits
from runtime.models import MoeCausalLM
from runtime.tokenizer import Tokenizer


@dataclass(frozen=True)
class Sampling:
    """temperature 0 = greedy (the default, reproducible); top_k 0 and top_p 1 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float
    stopped_by: str  # "stop-token", "max-tokens" or "context"

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        # the first generated token comes from the prefill logits; the others from one decode step each
        steps = max(len(self.tokens) - 1, 0)
        return steps / self.decode_seconds if self.decode_seconds else 0.0


# Valid but tiny values that float32 sampling cannot take (logits / 1e-40 overflow; top_p 1e-320 rounds to 0
# and drops every token) act as their limits: greedy below vLLM's 1e-5 threshold, and the smallest float32
# top_p, which keeps only the most likely token as any top_p that small does.
GREEDY_BELOW = 1e-5
MIN_TOP_P = float(torch.finfo(torch.float32).tiny)


def sample(logits: torch.Tensor, params: Sampling, generator: torch.Generator | None = None) -> int:
    """One token id from (vocab,) logits."""
    if params.temperature < GREEDY_BELOW:
        return int(torch.argmax(logits))
    logits = logits.float() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        top_p = max(params.top_p, MIN_TOP_P)
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, -1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, -1) >= top_p  # keep the smallest set reaching top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return draw(torch.softmax(logits, -1).cpu().numpy(), generator)


def draw(probs: np.ndarray, generator: torch.Generator | None = None) -> int:
    """A token id drawn by ``probs`` (vocab,), by inverse CDF on one thread. torch.multinomial ran a parallel
    region over the vocabulary: an OpenMP team on the model's thread each sampled token, which a hybrid GPU
    run lets go at each step."""
    cdf = np.cumsum(probs, dtype=np.float64)
    u = torch.rand((), generator=generator, dtype=torch.float64).item()
    i = int(np.searchsorted(cdf, u * cdf[-1], side="right"))  # the first token whose share reaches past u
    if i == cdf.size:  # u * total rounded up to the total: the last token with any probability
        i = int(np.flatnonzero(probs)[-1])
    return i


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def generate(
    model: MoeCausalLM,
    prompt_ids: list[int],
    max_tokens: int,
    sampling: Sampling = Sampling(),
    tokenizer: Tokenizer | None = None,
    on_text: Callable[[str], None] | None = None,
    stop_ids: set[int] | None = None,
    context: int | None = None,
    prefill_chunk: int = 512,
) -> GenerationResult:
    """Generate up to ``max_tokens`` after ``prompt_ids``; ``on_text`` receives the decoded text as it grows."""
    ctx = min(context or model.n_ctx_train, model.n_ctx_train)
    if not prompt_ids:
        raise ForgeError("the prompt is empty")
    if len(prompt_ids) >= ctx:
        raise ForgeError(f"the prompt has {len(prompt_ids)} tokens; the context holds {ctx}")
    device = model.weights.device
    state = model.new_state(ctx)
    generator = None
    if sampling.seed is not None:
        generator = torch.Generator().manual_seed(sampling.seed)
    elif sampling.temperature > 0:
        generator = torch.Generator()
        generator.seed()
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    stops = stop_ids if stop_ids is not None else (tokenizer.stop_ids if tokenizer else set())

    ids = torch.tensor(prompt_ids, dtype=torch.long, device=device)
    t0 = time.perf_counter()
    for start in range(0, len(prompt_ids), prefill_chunk):
        logits = model.forward(ids[start : start + prefill_chunk], state, last_only=True)
    check_logits(logits, model.weights, "the prompt")
    _sync(device)
    t1 = time.perf_counter()

    out: list[int] = []
    text_parts: list[str] = []
    stopped_by = "max-tokens"
    while len(out) < max_tokens:
        token = sample(logits[-1], sampling, generator)
        if token in stops:
            stopped_by = "stop-token"
            break
        out.append(token)
        if tokenizer is not None:
            piece = decoder.decode(tokenizer.token_bytes(token))
            if piece:
                text_parts.append(piece)
                if on_text:
                    on_text(piece)
        if len(out) >= max_tokens:
            break
        if state.pos >= ctx:
            stopped_by = "context"
            break
        logits = model.forward(torch.tensor([token], device=device), state, last_only=True)
        check_logits(logits, model.weights, f"generated token {len(out) + 1}")
    _sync(device)
    t2 = time.perf_counter()
    if tokenizer is not None:
        tail = decoder.decode(b"", final=True)
        if tail:
            text_parts.append(tail)
            if on_text:
                on_text(tail)
    return GenerationResult(out, "".join(text_parts), len(prompt_ids), t1 - t0, t2 - t1, stopped_by)
