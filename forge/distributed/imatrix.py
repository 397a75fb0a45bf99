"""Collecting an importance matrix on a Ray cluster: chunks spread over workers that each hold the model.

One actor per node (using all of the node's CPUs for torch) loads the model with its own
accumulator; the driver hands out chunks one at a time, prints the running perplexity in chunk order
(per-chunk log-likelihoods are added in chunk order, as a single-process run does), and at the end
adds the actors' partial sums and counts. Counts equal a single-process run's; sums and perplexity
agree to float rounding (the sums are added in another order, and torch's thread count, which can
change the last bits of a forward pass, follows each node's CPUs). An actor lost mid-run takes its
partial sums with it: every chunk it had processed is handed out again. ``save_every`` snapshots are
taken at chunk barriers, so a snapshot holds exactly the first N chunks.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import numpy as np

from forge.distributed.cluster import ray_session
from forge.errors import ForgeError
from forge.imatrix.accumulate import CollectReport, ImatrixAccumulator
from forge.imatrix.model import Imatrix


class ChunkCollector:
    """A Ray actor's state: the model, observed by an accumulator, and the chunks it has run."""

    def __init__(self, model_path: str, process_output: bool, device: str, threads: int):
        import torch

        from runtime.models import load_model

        if not Path(model_path).exists():
            import socket

            raise ForgeError(f"{model_path}: not visible on Ray node {socket.gethostname()} (imatrix "
                             "collection reads the model on every node: use a shared filesystem)")  # fmt: skip
        torch.set_num_threads(max(1, threads))
        self.acc = ImatrixAccumulator(process_output=process_output)
        self.model = load_model(model_path, device=device, observers=[self.acc])

    def tokenize(self, text: str) -> np.ndarray:
        from runtime.tokenizer import Tokenizer

        # as llama-imatrix reads it: the whole text at once, special-token parsing off, no BOS
        tok = Tokenizer.from_metadata(self.model.weights)
        return np.asarray(tok.encode(text, parse_special=False, add_bos=False), dtype=np.int64)

    def run(self, tokens: np.ndarray) -> float:
        """One chunk; returns the summed negative log-likelihood of its second half."""
        import torch

        ctx = len(tokens)
        ids = torch.from_numpy(tokens)
        first = ctx // 2
        logits = self.model.forward(ids, self.model.new_state(ctx))
        logp = torch.log_softmax(logits[first : ctx - 1].double(), dim=-1)
        return -float(logp.gather(1, ids[first + 1 :].to(logp.device)[:, None]).sum())

    def export(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        return self.acc.export_arrays()


def add_partials(parts: list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]) -> tuple[dict, dict]:
    """Sum partial (sums, counts) per tensor and expert; an expert range seen by fewer actors is padded."""
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, np.ndarray] = {}
    for part_sums, part_counts in parts:
        for name, s in part_sums.items():
            c = part_counts[name]
            if name not in sums:
                sums[name], counts[name] = s.astype(np.float32, copy=True), c.astype(np.int64, copy=True)
                continue
            if sums[name].shape[1] != s.shape[1]:
                raise ForgeError(f"imatrix: {name}: workers disagree on the number of columns")
            n = max(sums[name].shape[0], s.shape[0])
            sums[name], counts[name] = _pad(sums[name], n), _pad(counts[name], n)
            sums[name][: s.shape[0]] += s
            counts[name][: c.shape[0]] += c
    return sums, counts


def _pad(a: np.ndarray, n: int) -> np.ndarray:
    if a.shape[0] >= n:
        return a
    return np.concatenate([a, np.zeros((n - a.shape[0], *a.shape[1:]), a.dtype)])


def collect_ray(
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
    address: str | None = None,
    workers: int | None = None,
) -> CollectReport:
    """``forge imatrix collect --executor ray``: :func:`forge.imatrix.accumulate.collect`'s result,
    computed by one model replica per Ray node (``workers``: at most that many)."""
    from forge.atomic import check_output_path
    from forge.imatrix.formats import format_for_path, write_imatrix

    check_output_path(out)
    if fmt not in (None, "gguf", "dat"):
        raise ForgeError(f"--format must be gguf or dat, not {fmt!r}")
    if ctx < 2:
        raise ForgeError("--ctx must be at least 2")
    text_file = Path(text_path)
    if not text_file.is_file():
        raise ForgeError(f"{text_file}: no such file")
    model = os.path.abspath(model_path)
    target_fmt = fmt or format_for_path(out)
    with ray_session(address) as ray:
        actors = _start_actors(ray, model, process_output, device, workers)
        try:
            ids = _call(
                ray, actors[0].tokenize.remote(text_file.read_text(encoding="utf-8", errors="replace"))
            )
            if len(ids) < 2 * ctx:
                raise ForgeError(
                    f"{text_file}: {len(ids)} tokens; need at least {2 * ctx} for a context of {ctx}"
                )
            n_chunks = len(ids) // ctx if chunks is None or chunks < 0 else min(chunks, len(ids) // ctx)
            tokens = ids[: n_chunks * ctx].reshape(n_chunks, ctx)
            start = time.perf_counter()
            run = _Run(ray, actors, tokens, log)
            step = save_every if save_every > 0 else n_chunks
            for barrier in range(step, n_chunks + step, step):
                run.until(min(barrier, n_chunks))
                if barrier < n_chunks:
                    im = _imatrix(run.partials(), text_path, barrier, ctx)
                    write_imatrix(im, out, target_fmt)  # type: ignore[arg-type]
            im = _imatrix(run.partials(), text_path, n_chunks, ctx)
            seconds = time.perf_counter() - start
        finally:
            for a in actors:
                ray.kill(a)
    write_imatrix(im, out, target_fmt)  # type: ignore[arg-type]
    ppl = math.exp(run.nll_total / run.count) if run.count else None
    if log and ppl is not None:
        log(f"Final estimate: PPL = {ppl:.4f}")
    return CollectReport(im, n_chunks, n_chunks * ctx, seconds, ppl)


def _imatrix(parts: list, text_path: str | os.PathLike[str], n_chunks: int, ctx: int) -> Imatrix:
    sums, counts = add_partials(parts)
    for name, s in sums.items():
        if not np.isfinite(s).all():
            raise ForgeError(f"imatrix: non-finite sums in {name} (the model produced inf/nan activations)")
    return Imatrix(sums=sums, counts=counts, datasets=[str(text_path)], chunk_count=n_chunks, chunk_size=ctx)


def _call(ray: object, ref: object) -> object:
    try:
        return ray.get(ref)  # type: ignore[attr-defined]
    except ray.exceptions.RayTaskError as e:  # type: ignore[attr-defined]
        if isinstance(e.cause, ForgeError):
            raise ForgeError(str(e.cause)) from None
        raise


def _start_actors(ray: object, model: str, process_output: bool, device: str, workers: int | None) -> list:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) >= 1]  # type: ignore[attr-defined]
    if not nodes:
        raise ForgeError("the Ray cluster has no node with a free CPU")
    nodes = nodes[:workers] if workers else nodes
    remote = ray.remote(max_restarts=0)(ChunkCollector)  # type: ignore[attr-defined]
    actors = []
    for n in nodes:
        cpus = int(n["Resources"]["CPU"])
        strategy = NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
        actors.append(remote.options(num_cpus=cpus, scheduling_strategy=strategy).remote(
            model, process_output, device, cpus))  # fmt: skip
    return actors


class _Run:
    """Hands chunks to actors one at a time; keeps per-chunk NLL in chunk order and actor ownership."""

    def __init__(self, ray: object, actors: list, tokens: np.ndarray, log: Callable[[str], None] | None):
        self.ray, self.actors, self.tokens, self.log = ray, list(actors), tokens, log
        self.todo: deque[int] = deque(range(len(tokens)))
        self.nll: dict[int, float] = {}
        self.owned: dict[object, list[int]] = {a: [] for a in self.actors}  # chunks in each accumulator
        self.busy: dict[object, tuple[object, int]] = {}  # ref -> (actor, chunk)
        self.printed = 0
        self.nll_total, self.count = 0.0, 0

    def until(self, limit: int) -> None:
        """Run every chunk below ``limit`` (and no other)."""
        while any(c not in self.nll for c in range(limit)):
            idle = [a for a in self.actors if a not in {v[0] for v in self.busy.values()}]
            for actor in idle:
                nxt = next((c for c in self.todo if c < limit), None)
                if nxt is None:
                    break
                self.todo.remove(nxt)
                self.busy[actor.run.remote(self.tokens[nxt])] = (actor, nxt)
            if not self.busy:
                raise ForgeError("every Ray worker of the imatrix collection was lost")
            ready, _ = self.ray.wait(list(self.busy), num_returns=1)  # type: ignore[attr-defined]
            for ref in ready:
                actor, chunk = self.busy.pop(ref)
                try:
                    self.nll[chunk] = float(self.ray.get(ref))  # type: ignore[attr-defined]
                    self.owned[actor].append(chunk)
                except self.ray.exceptions.RayActorError:  # type: ignore[attr-defined]
                    self._lose(actor, chunk)
                except self.ray.exceptions.RayTaskError as e:  # type: ignore[attr-defined]
                    raise ForgeError(f"imatrix chunk {chunk + 1}: {e.cause}") from None
            self._print_ready()

    def _lose(self, actor: object, chunk: int) -> None:
        """An actor died: its accumulator is gone, so every chunk it held runs again elsewhere."""
        self.actors.remove(actor)
        redo = [chunk, *self.owned.pop(actor)]
        for c in redo:
            self.nll.pop(c, None)
        self.todo.extendleft(sorted(redo, reverse=True))
        for ref, (a, c) in list(self.busy.items()):
            if a is actor:
                del self.busy[ref]
                self.todo.appendleft(c)
        if self.log:
            self.log(f"(a Ray worker was lost; running {len(redo)} chunks again)")

    def _print_ready(self) -> None:
        ctx = self.tokens.shape[1]
        first = ctx // 2
        while self.printed in self.nll:
            self.nll_total += self.nll[self.printed]
            self.count += ctx - 1 - first
            self.printed += 1
            if self.log:
                self.log(f"[{self.printed}]{math.exp(self.nll_total / self.count):.4f},")

    def partials(self) -> list:
        return [self.ray.get(a.export.remote()) for a in self.actors]  # type: ignore[attr-defined]
