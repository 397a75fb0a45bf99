"""``forge recipe search --executor ray``: the candidates' KLD measurements spread over a Ray cluster.

One actor per CPU (torch on one thread: on a model this size, candidates side by side scale better than
threads inside one forward pass) holds its own ``KldMeter`` (the reference logits and per-layer inputs,
computed once per actor from the same tokens) and measures the candidates it is handed, two in flight per
actor. The driver stores each result as it arrives (``Measurements.put``: an interrupted search resumes
from there, whatever ran it). An actor lost mid-run is dropped and its candidates handed to the others.
Measurements agree with the local executor's to float rounding (one thread each, same tokens).
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from forge.distributed.cluster import ray_session
from forge.errors import ForgeError
from forge.search.measure import Group, Measurements


class CandidateMeter:
    """A Ray actor's state: the base model's reference on the calibration tokens, and the type files."""

    def __init__(self, base: str, type_files: dict[str, str], tokens: list[int], ctx: int, chunks: int):
        import torch

        from forge.search.measure import KldMeter

        for p in [base, *type_files.values()]:
            if not Path(p).exists():
                import socket

                raise ForgeError(f"{p}: not visible on Ray node {socket.gethostname()} (the search's "
                                 "measurements read the model and the type files on every node: use a "
                                 "shared filesystem)")  # fmt: skip
        torch.set_num_threads(1)
        self.meter = KldMeter(Path(base), tokens, ctx, chunks)
        self.type_files = type_files
        self.opened: dict[str, object] = {}

    def measure(self, tensors: list[str], label: str, layer: int) -> float:
        from runtime.weights import GGUFWeights

        if label not in self.opened:
            self.opened[label] = GGUFWeights(Path(self.type_files[label]), "cpu", verify_experts=False)
        model = self.meter.variant(dict.fromkeys(tensors, self.opened[label]))
        return max(self.meter.kld(model, layer), 0.0)


def measure_ray(
    groups: list[Group],
    base: Path,
    tokens: list[int],
    ctx: int,
    chunks: int,
    type_files: dict[str, Path],
    store: Measurements,
    progress: Callable[[int, int, str], None] | None = None,
    only: set[tuple[str, str]] | None = None,
    address: str | None = None,
    workers: int | None = None,
    log: Callable[[str], None] | None = None,
) -> float:
    """``forge.search.measure.measure`` on a Ray cluster; returns the seconds spent."""
    todo = deque((g, o) for g in groups for o in g.options if store.get(g.name, o.label) is None
                 and (only is None or (g.name, o.label) in only))  # fmt: skip
    total = sum(len(g.options) for g in groups) if only is None else len(only)
    done = total - len(todo)
    t0 = time.perf_counter()
    if not todo:
        return 0.0
    with ray_session(address) as ray:
        n = max(1, int(ray.cluster_resources().get("CPU", 1)))
        n = min(n, workers or n, len(todo))
        remote = ray.remote(num_cpus=1, max_restarts=0)(CandidateMeter)
        files = {lb: os.path.abspath(p) for lb, p in type_files.items()}
        actors = [remote.remote(os.path.abspath(base), files, tokens, ctx, chunks) for _ in range(n)]
        if log:
            log(f"measuring {len(todo)} candidates on {n} Ray workers")
        busy: dict[object, tuple[object, Group, object]] = {}  # ref -> (actor, group, option)
        try:
            while todo or busy:
                load = {a: 0 for a in actors}
                for a, _, _ in busy.values():
                    load[a] += 1
                for a in actors:
                    while todo and load[a] < 2:
                        g, o = todo.popleft()
                        busy[a.measure.remote(g.tensors, o.label, g.layer)] = (a, g, o)
                        load[a] += 1
                if not busy:
                    raise ForgeError("every Ray worker of the search was lost")
                ready, _ = ray.wait(list(busy), num_returns=1)
                for ref in ready:
                    a, g, o = busy.pop(ref)
                    try:
                        kld = float(ray.get(ref))
                    except ray.exceptions.RayActorError:
                        _lose(a, actors, busy, todo, log)
                        todo.appendleft((g, o))
                        continue
                    except ray.exceptions.RayTaskError as e:
                        raise ForgeError(f"{g.name} {o.label}: {e.cause}") from None
                    store.put(g.name, o.label, kld)
                    done += 1
                    if progress:
                        progress(done, total, f"{g.name} {o.label}")
        finally:
            for a in actors:
                ray.kill(a)
    return time.perf_counter() - t0


def _lose(actor: object, actors: list, busy: dict, todo: deque, log: Callable[[str], None] | None) -> None:
    """An actor died: drop it; the candidates it still had go back to the queue."""
    if actor in actors:
        actors.remove(actor)
    for ref, (a, g, o) in list(busy.items()):
        if a is actor:
            del busy[ref]
            todo.appendleft((g, o))
    if log:
        log("(a Ray worker of the search was lost; its candidates go to the others)")
