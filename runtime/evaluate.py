"""Perplexity and divergence from a reference model, computed the way llama-perplexity does.

Chunking (as llama-perplexity): the whole text is tokenized at once without special-token parsing, cut
into consecutive ``n_ctx``-token chunks (the first ``n_chunks``), each evaluated from an empty context;
only the second half is scored (logits at positions n_ctx/2 .. n_ctx-2 predicting the next token).
"""

from __future__ import annotations

import math
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from forge.atomic import atomic_output
from forge.errors import ForgeError
from runtime.diagnose import check_logits
from runtime.models import MoeCausalLM
from runtime.tokenizer import Tokenizer

DEFAULT_TOP_K = 128  # reference logits saved per scored token (plus the rest as one bucket)


def perplexity_tokens(tokenizer: Tokenizer, text: str, n_ctx: int, n_chunks: int | None) -> list[int]:
    """Token ids of ``text`` (no special-token parsing, no BOS), enough for ``n_chunks`` chunks.

    Pre-tokens never cross a newline that is followed by a non-space character, so the ids of a prefix cut
    there are the ids of the whole text's start: tokenizing a growing prefix gives the same chunks.
    """
    if n_chunks is None:
        return tokenizer.encode(text, add_bos=False)
    need = n_ctx * n_chunks + 1
    length = max(4 * need, 1 << 16)
    while True:
        if length >= len(text):
            return tokenizer.encode(text, add_bos=False)
        cut = _safe_cut(text, length)
        if cut is None:
            return tokenizer.encode(text, add_bos=False)
        ids = tokenizer.encode(text[:cut], add_bos=False)
        if len(ids) > need + 16:  # the last pre-tokens before the cut are not at risk, but keep a margin
            return ids
        length *= 2


def _safe_cut(text: str, at: int) -> int | None:
    pos = text.find("\n", at)
    while pos != -1 and pos + 1 < len(text):
        if not text[pos + 1].isspace():
            return pos + 1
        pos = text.find("\n", pos + 1)
    return None


@dataclass
class EvalResult:
    perplexity: float
    perplexity_err: float
    tokens: int  # scored tokens
    chunks: int
    n_ctx: int
    seconds: float
    reference_perplexity: float | None = None
    kld_mean: float | None = None
    kld_mean_err: float | None = None
    kld_median: float | None = None
    kld_p99: float | None = None
    kld_max: float | None = None
    top1_agreement: float | None = None
    delta_p_rms: float | None = None
    delta_ppl: float | None = None
    saved_logits: str | None = None
    saved_logits_bytes: int | None = None

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class ReferenceLogits:
    """A reference model's scored log-probabilities in compact form: top-k per token + target + rest mass."""

    tokens: np.ndarray  # int32: the evaluated token ids (chunks * n_ctx)
    n_ctx: int
    top_ids: np.ndarray  # int32 (N, k)
    top_logp: np.ndarray  # float32 (N, k)
    target_logp: np.ndarray  # float32 (N,)

    def save(self, path: str | Path) -> int:
        with atomic_output(path) as f:
            np.savez(f, tokens=self.tokens, n_ctx=np.int64(self.n_ctx), top_ids=self.top_ids,
                     top_logp=self.top_logp, target_logp=self.target_logp)  # fmt: skip
        return Path(path).stat().st_size

    @classmethod
    def load(cls, path: str | Path) -> ReferenceLogits:
        try:
            with np.load(path) as z:
                return cls(z["tokens"], int(z["n_ctx"]), z["top_ids"], z["top_logp"], z["target_logp"])
        except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
            raise ForgeError(f"{path}: not a reference-logits file ({exc})") from None


def _chunk_logp(model: MoeCausalLM, chunk: torch.Tensor, first: int, where: str) -> torch.Tensor:
    logits = model.forward(chunk.to(model.weights.device), model.new_state(chunk.shape[0]))
    check_logits(logits, model.weights, where)
    return torch.log_softmax(logits[first:-1].float(), dim=-1).cpu()


def evaluate(
    model: MoeCausalLM,
    tokens: list[int],
    n_ctx: int = 512,
    n_chunks: int | None = None,
    reference: MoeCausalLM | None = None,
    reference_logits: ReferenceLogits | None = None,
    save_logits: str | Path | None = None,
    top_k: int = DEFAULT_TOP_K,
    bos_id: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> EvalResult:
    """Perplexity of ``model`` on ``tokens``; with a reference (model or saved logits) also KLD & co."""
    import time

    if n_ctx < 4 or n_ctx % 2:
        raise ForgeError(f"--ctx must be an even number >= 4, got {n_ctx}")
    if n_ctx > model.n_ctx_train:
        raise ForgeError(f"--ctx {n_ctx} is longer than the model's context ({model.n_ctx_train})")
    available = len(tokens) // n_ctx
    if available < 1 or len(tokens) < 2 * n_ctx:
        raise ForgeError(f"the text has {len(tokens)} tokens; at least 2 x ctx = {2 * n_ctx} are needed")
    n_chunks = min(n_chunks or available, available)
    ids = torch.tensor(tokens[: n_chunks * n_ctx], dtype=torch.long).view(n_chunks, n_ctx)
    if bos_id is not None:
        ids[:, 0] = (
            bos_id  # llama-perplexity replaces each chunk's first token by BOS when the model adds one
        )
    if reference is not None and reference.vocab_size != model.vocab_size:
        raise ForgeError(
            f"the reference has {reference.vocab_size} tokens in its vocabulary, the model {model.vocab_size}"
        )
    if reference_logits is not None and (
        reference_logits.n_ctx != n_ctx
        or not np.array_equal(reference_logits.tokens, ids.numpy().reshape(-1))
    ):
        raise ForgeError("the reference logits were computed on other tokens or another --ctx")
    first = n_ctx // 2
    t0 = time.perf_counter()

    nll, ref_nll, kld, same_top, delta_p = [], [], [], [], []
    saved_ids, saved_logp, saved_target = [], [], []
    row = 0
    for c in range(n_chunks):
        chunk = ids[c]
        targets = chunk[first + 1 :]
        logp = _chunk_logp(model, chunk, first, f"chunk {c + 1}")
        target_logp = logp.gather(1, targets[:, None])[:, 0]
        nll.append(-target_logp.double())
        if save_logits is not None:
            top = torch.topk(logp, min(top_k, logp.shape[1]), dim=-1)
            saved_ids.append(top.indices.to(torch.int32))
            saved_logp.append(top.values)
            saved_target.append(target_logp)
        if reference is not None:
            base = _chunk_logp(reference, chunk, first, f"chunk {c + 1} of the reference")
            base_target = base.gather(1, targets[:, None])[:, 0]
            kld.append((base.exp() * (base - logp)).sum(-1).double())
            same_top.append(base.argmax(-1) == logp.argmax(-1))
        elif reference_logits is not None:
            n = targets.shape[0]
            b_ids = torch.from_numpy(reference_logits.top_ids[row : row + n]).long()
            b_logp = torch.from_numpy(reference_logits.top_logp[row : row + n]).float()
            base_target = torch.from_numpy(reference_logits.target_logp[row : row + n]).float()
            q_top = logp.gather(1, b_ids)
            p_top = b_logp.exp()
            rest_p = (1 - p_top.sum(-1)).clamp_min(1e-12)
            rest_q = (1 - q_top.exp().sum(-1)).clamp_min(1e-12)
            kld.append(((p_top * (b_logp - q_top)).sum(-1) + rest_p * (rest_p.log() - rest_q.log())).double())
            same_top.append(b_ids[:, 0] == logp.argmax(-1))
            row += n
        if reference is not None or reference_logits is not None:
            ref_nll.append(-base_target.double())
            delta_p.append((target_logp.exp() - base_target.exp()).double())
        if progress:
            progress(c + 1, n_chunks)

    nll_all = torch.cat(nll)
    mean_nll = nll_all.mean().item()
    ppl = math.exp(mean_nll)
    n = nll_all.numel()
    res = EvalResult(
        perplexity=ppl,
        perplexity_err=ppl * nll_all.std().item() / math.sqrt(max(n - 1, 1)),
        tokens=n,
        chunks=n_chunks,
        n_ctx=n_ctx,
        seconds=0.0,
    )
    if kld:
        k = torch.cat(kld)
        res.reference_perplexity = math.exp(torch.cat(ref_nll).mean().item())
        res.kld_mean = k.mean().item()
        res.kld_mean_err = k.std().item() / math.sqrt(max(n - 1, 1))
        res.kld_median = k.median().item()
        res.kld_p99 = torch.quantile(k, 0.99).item()
        res.kld_max = k.max().item()
        res.top1_agreement = torch.cat(same_top).double().mean().item()
        res.delta_p_rms = torch.cat(delta_p).pow(2).mean().sqrt().item()
        res.delta_ppl = ppl - res.reference_perplexity
    if save_logits is not None:
        ref = ReferenceLogits(ids.numpy().reshape(-1).astype(np.int32), n_ctx, torch.cat(saved_ids).numpy(),
                              torch.cat(saved_logp).numpy(), torch.cat(saved_target).numpy())  # fmt: skip
        res.saved_logits = str(save_logits)
        res.saved_logits_bytes = ref.save(save_logits)
    res.seconds = time.perf_counter() - t0
    return res


def format_report(r: EvalResult) -> str:
    """llama-perplexity's summary layout."""
    lines = [
        f"perplexity: {r.chunks} chunks of {r.n_ctx} tokens, {r.tokens} scored tokens, {r.seconds:.2f} s"
    ]
    if r.kld_mean is None:
        lines.append(f"Final estimate: PPL = {r.perplexity:.4f} +/- {r.perplexity_err:.5f}")
    else:
        assert r.reference_perplexity is not None and r.delta_ppl is not None
        lines += [
            "====== Perplexity statistics ======",
            f"Mean PPL(Q)                   : {r.perplexity:10.6f} +/- {r.perplexity_err:10.6f}",
            f"Mean PPL(base)                : {r.reference_perplexity:10.6f}",
            f"PPL(Q)/PPL(base)              : {r.perplexity / r.reference_perplexity:10.6f}",
            f"PPL(Q)-PPL(base)              : {r.delta_ppl:10.6f}",
            "",
            "====== KL divergence statistics ======",
            f"Mean    KLD: {r.kld_mean:10.6f} +/- {r.kld_mean_err:10.6f}",
            f"Maximum KLD: {r.kld_max:10.6f}",
            f"99.0%   KLD: {r.kld_p99:10.6f}",
            f"Median  KLD: {r.kld_median:10.6f}",
            "",
            "====== Token probability statistics ======",
            f"RMS Δp    : {100 * (r.delta_p_rms or 0):7.3f} %",
            f"Same top p: {100 * (r.top1_agreement or 0):7.3f} %",
        ]
    if r.saved_logits:
        lines.append(f"saved reference logits to {r.saved_logits} ({r.saved_logits_bytes:,} bytes)")
    return "\n".join(lines)
