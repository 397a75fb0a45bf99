"""Collect an imatrix from the runtime: an observer that sums squared matmul inputs like llama-imatrix.

Per weight tensor: float32 running sums of x² per input column and int64 row counts. Routed expert
tensors (``expert_ids`` given) keep one row of sums and one count per expert, over only the
(token, slot) pairs routed to it. As in llama-imatrix, only ``blk.*`` tensors are collected
(``output.weight`` with ``process_output``), and plain matmuls with fewer than 16 input rows are
ignored (llama.cpp skips such small batches; routed experts are always collected).

Sums stay float32 like llama-imatrix's. Each call's rows are first reduced on their own (in row
order on the CPU) and that partial sum is then added to the running total, so the last bits can
differ from llama.cpp's one strictly sequential loop over all rows.
"""

from __future__ import annotations

import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from forge.errors import ForgeError
from forge.imatrix.model import Imatrix
from forge.options import require_context, require_int

try:
    from runtime.observers import Observer
except ModuleNotFoundError:  # the runtime is optional for file-format work

    class Observer:  # type: ignore[no-redef]
        def on_matmul_input(self, tensor_name: str, x: torch.Tensor, expert_ids: torch.Tensor | None) -> None:
            pass

        def on_routing(
            self, layer: int, experts: torch.Tensor, weights: torch.Tensor, logits: torch.Tensor
        ) -> None:
            pass


_LAYER = re.compile(r"^blk\.(\d+)\.")
MIN_DENSE_ROWS = 16
_MAX_SCRATCH = 64 << 20  # bytes of x² scratch kept between calls (CPU, one torch thread)


# Tensors of one layer that the models may feed the same input, one after the other: the attention
# (or linear-attention) input projections; the FFN's router, gate and up (plain or shared expert);
# the routed experts' gate and up.
_ATTN_IN = re.compile(r"^(blk\.\d+\.)(attn_q|attn_k|attn_v|attn_qkv|attn_gate|ssm_alpha|ssm_beta)\.weight$")
_FFN_IN = re.compile(r"^(blk\.\d+\.)(ffn_gate_inp|ffn_gate|ffn_up)(_shexp)?\.weight$")
_EXPS_IN = re.compile(r"^(blk\.\d+\.)(ffn_gate|ffn_up)_exps\.weight$")


def _input_group(tensor_name: str) -> str:
    """Names with the same group may share one input; any other name is a group of its own."""
    for pattern, group in ((_ATTN_IN, "attn_in"), (_FFN_IN, "ffn_in"), (_EXPS_IN, "exps_in")):
        if m := pattern.match(tensor_name):
            return m.group(1) + group
    return tensor_name


def _version(t: torch.Tensor | None) -> int | None:
    """In-place write counter (inference-mode tensors have none)."""
    return None if t is None or t.is_inference() else t._version


def _same_tensor(a: torch.Tensor | None, a_version: int | None, b: torch.Tensor | None) -> bool:
    """b is a's data: same storage and view, and no in-place write since a was seen (where tracked)."""
    if a is None or b is None:
        return a is b
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
        and a_version == _version(b)
    )


def _numpy_sums(
    x: torch.Tensor, ids: torch.Tensor | None, n: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sums of x² per column (per expert: (n + 1, cols), and (n + 1,) row counts) with numpy.

    Single-threaded on purpose: these are memory-bound reductions that run between the model's own
    matmuls, and with several torch threads each op would be one more thread-pool rendezvous; on a
    busy machine those stall far longer than the arithmetic takes (with one thread torch is faster). einsum adds the rows in order, without a
    temporary x² array. Routed rows come sorted by expert from the runtime (else they are sorted here),
    so each expert is one contiguous slice.
    """
    xn = (x if x.dtype == torch.float32 else x.float()).numpy()
    if ids is None:
        return torch.from_numpy(np.einsum("ij,ij->j", xn, xn)[None, :]), None
    idn = ids.numpy()
    if idn.size > 1 and (idn[1:] < idn[:-1]).any():
        order = np.argsort(idn, kind="stable")
        idn, xn = idn[order], xn[order]
    bounds = np.flatnonzero(idn[1:] != idn[:-1]) + 1
    starts, ends = np.concatenate(([0], bounds)), np.concatenate((bounds, [idn.size]))
    sums = np.zeros((n + 1, xn.shape[1]), np.float32)
    counts = np.zeros(n + 1, np.int64)
    experts = idn[starts]
    counts[experts] = ends - starts
    for e, lo, hi in zip(experts.tolist(), starts.tolist(), ends.tolist(), strict=True):  # <= n experts
        seg = xn[lo:hi]
        sums[e] = np.einsum("ij,ij->j", seg, seg)
    return torch.from_numpy(sums), torch.from_numpy(counts)


def _torch_sums(
    x: torch.Tensor,
    ids: torch.Tensor | None,
    n: int,
    ids_checked: bool = False,
    scratch: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The same with torch (an accelerator, or one CPU thread): one fused index_add_ over all rows,
    nothing read back to the host. Unless ``ids_checked``, ids out of range land in the extra row n
    (a range check would sync with the device). ``scratch``: float32 room for x² (fresh pages are
    costly on the CPU)."""
    xf = x.float()
    # a plain multiply: torch's square() goes through pow, slower on the CPU
    sq = xf * xf if scratch is None else torch.mul(xf, xf, out=scratch[: x.numel()].view(x.shape))
    if ids is None:
        return sq.sum(dim=0, keepdim=True), None
    rows = ids if ids_checked else torch.where((ids < 0) | (ids >= n), n, ids)
    sums = sq.new_zeros(n + 1, sq.shape[1]).index_add_(0, rows, sq)
    counts = torch.zeros(n + 1, dtype=torch.int64, device=ids.device).index_add_(
        0, rows, torch.ones_like(rows)
    )
    return sums, counts


@dataclass
class _Delta:
    """One call's reduction, kept for the next sibling tensor fed the same input."""

    group: str
    x: torch.Tensor
    ids: torch.Tensor | None
    versions: tuple[int | None, int | None]  # of x and ids when reduced
    n: int
    sums: torch.Tensor  # (n + 1, cols) per expert (row n: ids out of range); (1, cols) for a plain matmul
    counts: torch.Tensor | None  # (n + 1,) rows per expert; None for a plain matmul
    used_by: set[str]

    def serves(self, name: str, x: torch.Tensor, ids: torch.Tensor | None, n: int) -> bool:
        return (
            name not in self.used_by
            and self.group == _input_group(name)
            and self.n == n
            and _same_tensor(self.x, self.versions[0], x)
            and _same_tensor(self.ids, self.versions[1], ids)
        )


class ImatrixAccumulator(Observer):
    """Observer that accumulates an importance matrix; ``to_imatrix`` exports it.

    The number of experts of a routed tensor is taken from the routing logits of its layer
    (``on_routing``), else from ``n_experts``, else grown to the highest expert id seen.

    Each call reduces its batch to one delta (x² column sums, per expert for routed tensors) that is
    added to the running float32 sums, which stay on the input's device until exported. Tensors of a
    layer that read the same input (q/k/v; gate/up) reuse the first one's delta: the runtime passes
    the same tensor, recognised by storage, view and in-place write counter, so x² is reduced once.
    Off the CPU, with a known expert count, no call reads a value back to the host (no GPU sync):
    expert ids out of range are counted on the device and refused at export (on the CPU at once).
    """

    def __init__(
        self, process_output: bool = False, n_experts: int | None = None, min_rows: int = MIN_DENSE_ROWS
    ):
        self.process_output = process_output
        self.n_experts = n_experts
        self.min_rows = min_rows
        self._sums: dict[str, torch.Tensor] = {}
        self._counts: dict[str, torch.Tensor] = {}
        self._layer_experts: dict[int, int] = {}
        self._routed: set[str] = set()
        self._bad_ids: dict[str, torch.Tensor] = {}  # off the CPU: rows with an expert id out of range
        self._last: _Delta | None = None
        self._scratch: torch.Tensor | None = None

    def wants(self, tensor_name: str) -> bool:
        return tensor_name.startswith("blk.") or (self.process_output and tensor_name == "output.weight")

    def on_routing(
        self, layer: int, experts: torch.Tensor, weights: torch.Tensor, logits: torch.Tensor
    ) -> None:
        self._layer_experts[layer] = int(logits.shape[-1])

    def on_matmul_input(self, tensor_name: str, x: torch.Tensor, expert_ids: torch.Tensor | None) -> None:
        if not self.wants(tensor_name):
            return
        if x.dim() != 2:
            raise ForgeError(
                f"imatrix: {tensor_name}: expected (rows, columns) inputs, got shape {tuple(x.shape)}"
            )
        x = x.detach()
        if expert_ids is None:
            if x.shape[0] < self.min_rows:
                return
            sums, counts = self._entry(tensor_name, 1, x)
            sums.add_(self._delta(tensor_name, x, None, 0).sums)
            counts += x.shape[0]
            return
        ids = expert_ids.detach().reshape(-1)
        if ids.numel() != x.shape[0]:
            raise ForgeError(f"imatrix: {tensor_name}: {ids.numel()} expert ids for {x.shape[0]} rows")
        if ids.numel() == 0:
            return
        ids = ids.to(device=x.device, dtype=torch.long)
        n_mat = self._n_mat(tensor_name, ids)
        sums, counts = self._entry(tensor_name, n_mat, x)
        self._routed.add(tensor_name)
        n = sums.shape[0]
        delta = self._delta(tensor_name, x, ids, n)
        assert delta.counts is not None
        sums.add_(delta.sums[:n])
        counts.add_(delta.counts[:n])
        if ids.device.type != "cpu":
            bad = self._bad_ids.get(tensor_name)
            if bad is None:
                bad = self._bad_ids[tensor_name] = torch.zeros((), dtype=torch.int64, device=ids.device)
            bad.add_(delta.counts[n])

    def _delta(self, name: str, x: torch.Tensor, ids: torch.Tensor | None, n: int) -> _Delta:
        """This call's x² sums (per expert with ids), or the previous call's for a sibling fed the same input."""
        last = self._last
        if last is not None and last.serves(name, x, ids, n):
            last.used_by.add(name)
            return last
        # numpy only where torch would split the work over several threads (see _numpy_sums)
        use_numpy = x.device.type == "cpu" and torch.get_num_threads() > 1
        if use_numpy:
            sums, counts = _numpy_sums(x, ids, n)
        elif x.device.type == "cpu":  # _n_mat has checked the ids
            sums, counts = _torch_sums(x, ids, n, ids_checked=True, scratch=self._scratch_for(x))
        else:
            sums, counts = _torch_sums(x, ids, n)
        self._last = _Delta(_input_group(name), x, ids, (_version(x), _version(ids)), n, sums, counts, {name})
        return self._last

    def _scratch_for(self, x: torch.Tensor) -> torch.Tensor | None:
        """A float32 buffer kept between calls for x² (None past _MAX_SCRATCH bytes)."""
        if x.numel() * 4 > _MAX_SCRATCH:
            return None
        if self._scratch is None or self._scratch.numel() < x.numel():
            self._scratch = torch.empty(x.numel(), dtype=torch.float32)
        return self._scratch

    def _n_mat(self, tensor_name: str, ids: torch.Tensor) -> int:
        m = _LAYER.match(tensor_name)
        known = self._layer_experts.get(int(m.group(1))) if m else None
        n = known or self.n_experts or 0
        have = self._sums[tensor_name].shape[0] if tensor_name in self._sums else 0
        if ids.device.type == "cpu":  # cheap here; on a GPU a range check would be a sync per call
            lo, top = int(ids.min()), int(ids.max()) + 1
            if lo < 0 or (known and top > known):
                raise ForgeError(f"imatrix: {tensor_name}: expert id out of range 0..{(known or top) - 1}")
            return max(n, top, have)
        if n:
            return max(n, have)
        return max(int(ids.max()) + 1, have)  # no expert count known: grow to the highest id (syncs)

    def _entry(self, name: str, n_mat: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sums = self._sums.get(name)
        if sums is None:
            sums = self._sums[name] = torch.zeros(n_mat, x.shape[1], dtype=torch.float32, device=x.device)
            self._counts[name] = torch.zeros(n_mat, dtype=torch.int64, device=x.device)
        elif sums.shape[1] != x.shape[1]:
            raise ForgeError(f"imatrix: {name}: inputs have {x.shape[1]} columns, earlier {sums.shape[1]}")
        elif sums.shape[0] < n_mat:  # a higher expert id than seen so far, with no routing info
            grow = n_mat - sums.shape[0]
            sums = self._sums[name] = torch.cat([sums, sums.new_zeros(grow, sums.shape[1])])
            self._counts[name] = torch.cat([self._counts[name], self._counts[name].new_zeros(grow)])
        return sums, self._counts[name]

    @property
    def tensor_names(self) -> list[str]:
        return sorted(self._sums)

    def reset(self) -> None:
        self._sums.clear()
        self._counts.clear()
        self._routed.clear()
        self._bad_ids.clear()
        self._last = None
        self._scratch = None

    def export_arrays(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Copies of the sums and counts as numpy arrays (the tensors may live on a GPU)."""
        for name, bad in self._bad_ids.items():
            if int(bad):
                raise ForgeError(f"imatrix: {name}: {int(bad)} rows had an expert id out of range")
        sums, counts = {}, {}
        for name, s in self._sums.items():
            n_mat = max(s.shape[0], self._expected_n_mat(name))
            s_np = s.cpu().numpy().astype(np.float32, copy=True)
            c_np = self._counts[name].cpu().numpy().astype(np.int64, copy=True)
            if n_mat > s_np.shape[0]:  # trailing experts never routed: present with count 0
                s_np = np.concatenate([s_np, np.zeros((n_mat - s_np.shape[0], s_np.shape[1]), np.float32)])
                c_np = np.concatenate([c_np, np.zeros(n_mat - c_np.shape[0], np.int64)])
            if not np.isfinite(s_np).all():
                raise ForgeError(
                    f"imatrix: non-finite sums in {name} (the model produced inf/nan activations)"
                )
            sums[name], counts[name] = s_np, c_np
        return sums, counts

    def _expected_n_mat(self, name: str) -> int:
        m = _LAYER.match(name)
        if name not in self._routed or not m:
            return 1
        return self._layer_experts.get(int(m.group(1))) or self.n_experts or 1

    def to_imatrix(
        self, datasets: Iterable[str] = (), chunk_count: int = 0, chunk_size: int = 512
    ) -> Imatrix:
        """The collected data as an :class:`Imatrix` (``chunk_size`` >= 1: raw row counts)."""
        if chunk_size < 1:
            raise ForgeError("imatrix chunk size must be >= 1 (0 marks .dat-derived data)")
        sums, counts = self.export_arrays()
        return Imatrix(sums=sums, counts=counts, datasets=list(datasets), chunk_count=chunk_count,
                       chunk_size=chunk_size)  # fmt: skip


# ------------------------------------------------------------------------------------------ collection


@dataclass
class CollectReport:
    imatrix: Imatrix
    chunks: int
    tokens: int
    seconds: float
    perplexity: float | None

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def collect(
    model_path: str | os.PathLike[str],
    text_path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    ctx: int = 512,
    chunks: int | None = None,
    fmt: str | None = None,
    save_every: int = 0,
    process_output: bool = False,
    device: str = "cpu",
    log: Callable[[str], None] | None = print,
    ggml_numerics: bool = False,
) -> CollectReport:
    """``forge imatrix collect``: llama-imatrix's procedure on our runtime.

    The text is cut into consecutive ``ctx``-token chunks (at most ``chunks``); each runs from an
    empty cache as one batch. Perplexity is printed as llama-imatrix does (second half of each chunk).
    Every ``save_every`` chunks, and at the end, ``out`` is replaced atomically. ``ggml_numerics``
    runs the model with llama.cpp's CPU input rounding (closer routing, slower).
    """
    from forge.atomic import check_output_path
    from forge.imatrix.formats import format_for_path, write_imatrix
    from runtime.models import load_model
    from runtime.tokenizer import Tokenizer

    check_output_path(out)
    if fmt not in (None, "gguf", "dat"):
        raise ForgeError(f"--format must be gguf or dat, not {fmt!r}")
    require_int("--ctx", ctx, 2)
    require_int("--chunks", chunks, 1)
    require_int("--save-every", save_every, 0)
    text_file = Path(text_path)
    if not text_file.is_file():
        raise ForgeError(f"{text_file}: no such file")
    acc = ImatrixAccumulator(process_output=process_output)
    model = load_model(model_path, device=device, observers=[acc], ggml_numerics=ggml_numerics)
    require_context("--ctx", ctx, model.n_ctx_train)
    # as llama-imatrix reads it: the whole text at once, special-token parsing off, no BOS
    tok = Tokenizer.from_metadata(model.weights)
    ids = tok.encode(
        text_file.read_text(encoding="utf-8", errors="replace"), parse_special=False, add_bos=False
    )
    if len(ids) < 2 * ctx:
        raise ForgeError(f"{text_file}: {len(ids)} tokens; need at least {2 * ctx} for a context of {ctx}")
    n_chunks = len(ids) // ctx if chunks is None else min(chunks, len(ids) // ctx)
    tokens = torch.tensor(ids[: n_chunks * ctx], dtype=torch.long).reshape(n_chunks, ctx)
    target_fmt = fmt or format_for_path(out)
    first = ctx // 2
    nll, count = 0.0, 0
    start = time.perf_counter()
    saved = 0
    try:
        for i in range(n_chunks):
            logits = model.forward(tokens[i], model.new_state(ctx))
            logp = torch.log_softmax(logits[first : ctx - 1].double(), dim=-1)
            nll -= float(logp.gather(1, tokens[i, first + 1 :].to(logp.device)[:, None]).sum())
            count += ctx - 1 - first
            if log:
                log(f"[{i + 1}]{math.exp(nll / count):.4f},")
            if save_every > 0 and (i + 1) % save_every == 0 and i + 1 < n_chunks:
                snapshot = acc.to_imatrix([str(text_path)], i + 1, ctx)
                snapshot.chunks_planned = n_chunks
                write_imatrix(snapshot, out, target_fmt)  # type: ignore[arg-type]
                saved = i + 1
    except BaseException:  # an interrupt or a failure: say what the last snapshot holds
        if saved:
            sys.stderr.write(f"\n{out}: partial imatrix, {saved} of {n_chunks} chunks (the last snapshot)\n")
        raise
    seconds = time.perf_counter() - start
    im = acc.to_imatrix([str(text_path)], n_chunks, ctx)
    write_imatrix(im, out, target_fmt)  # type: ignore[arg-type]
    ppl = math.exp(nll / count) if count else None
    if log and ppl is not None:
        log(f"Final estimate: PPL = {ppl:.4f}")
    return CollectReport(im, n_chunks, n_chunks * ctx, seconds, ppl)
