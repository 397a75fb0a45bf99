"""Quantizing on a Ray cluster: one task per tensor (expert ranges of large 3-D tensors).

The driver (the ``forge quantize`` process) plans, checks reuse keys and writes the file; workers only
encode. A task reads its slice from the source itself when the worker sees the same files (a shared
filesystem); otherwise it reports so and the driver sends the slice through the object store
(``FORGE_RAY_SOURCE=ship`` forces that, ``read`` forbids it). Results are consumed in file order
as they arrive; at most a window of tasks is outstanding, so memory stays bounded. Retries are the
driver's own (Ray's are off), so that every failure is counted and reported: a task lost with its
worker or node, or failing with anything but a ForgeError, is resubmitted up to ``max_retries``
times.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from forge.distributed.cluster import cluster_cpus, ray_session
from forge.distributed.slices import Part, Shipped, fingerprint, read_part, ship_part, split_experts
from forge.errors import ForgeError
from forge.quant.jobs import EncodeJob, EncodeResult, Executor, open_source, run_job

SOURCE_MODES = ("auto", "read", "ship")
MAX_RETRIES = 3
#: the most elements of one expert-range task on the cluster
PART_ELEMENTS = 16 << 20
#: test hook: while ``$FORGE_TEST_HOLD_DIR/hold`` exists, tasks announce themselves there and wait
HOLD_ENV = "FORGE_TEST_HOLD_DIR"


class SourceNotVisible(Exception):
    """The worker does not see the source files the driver sees."""


def encode_part(job: EncodeJob, part: Part, shipped: Shipped | None, want: tuple) -> EncodeResult:
    """The task body: encode a tensor or an expert range of it, on a worker."""
    _hold_for_tests()
    if shipped is not None:
        values = shipped.values()
    else:
        if fingerprint(job.source) != want:
            raise SourceNotVisible(job.source.path)
        values = read_part(open_source(job.source), job.name, part)
    return run_job(job, values)


def _hold_for_tests() -> None:
    hold = os.environ.get(HOLD_ENV)
    if not hold or not (Path(hold) / "hold").exists():
        return
    import ray

    node = ray.get_runtime_context().get_node_id()
    (Path(hold) / f"task-{node}-{os.getpid()}-{time.monotonic_ns()}").touch()
    deadline = time.monotonic() + 120
    while (Path(hold) / "hold").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


@dataclass
class _Task:
    job_index: int
    part: Part
    job: EncodeJob
    ship: bool
    attempts: int = 0
    ref: object = None
    result: EncodeResult | None = None


@dataclass
class Counters:
    done: int = 0
    failed: int = 0
    shipped: int = 0
    total: int = 0
    in_flight: int = 0
    retried: list[str] = field(default_factory=list)


class RayExecutor(Executor):
    """Runs encode jobs as Ray tasks; yields one result per job, in submission order.

    ``source_mode``: ``auto`` (workers read when they see the files, else the driver ships),
    ``read`` or ``ship``; default ``$FORGE_RAY_SOURCE`` or ``auto``. ``part_elements``: the most
    elements of one expert-range task (default: 16 Mi).
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        max_retries: int = MAX_RETRIES,
        source_mode: str | None = None,
        part_elements: int = PART_ELEMENTS,
        window: int | None = None,
        log: Callable[[str], None] | None = None,
    ):
        mode = source_mode or os.environ.get("FORGE_RAY_SOURCE", "auto")
        if mode not in SOURCE_MODES:
            raise ForgeError(f"FORGE_RAY_SOURCE must be one of {', '.join(SOURCE_MODES)}, not {mode!r}")
        self.source_mode = mode
        self.max_retries = max_retries
        self.part_elements = part_elements
        self.log = log
        self.counters = Counters()
        self._last: dict = {}  # the tensor whose expert ranges are being shipped
        self._stack = contextlib.ExitStack()
        self.ray = self._stack.enter_context(ray_session(address))
        self.cpus = cluster_cpus(self.ray)
        self.window = window or max(4, 4 * self.cpus)
        self._remote = self.ray.remote(num_cpus=1, max_retries=0)(encode_part)

    def status(self) -> str:
        c = self.counters
        running = min(c.in_flight, self.cpus)
        return f"tasks {c.done}/{c.total} done, {running} running, {c.failed} failed"

    def close(self) -> None:
        self._stack.close()

    # -------------------------------------------------------------------------------------------------
    def map(self, jobs: list[EncodeJob]) -> Iterator[EncodeResult]:
        # workers resolve the path themselves: make it independent of the driver's directory
        jobs = [replace(j, source=replace(j.source, path=os.path.abspath(j.source.path))) for j in jobs]
        tasks = [t for i, job in enumerate(jobs) for t in self._split(i, job)]
        self.counters.total += len(tasks)
        by_job: list[list[_Task]] = [[] for _ in jobs]
        for t in tasks:
            by_job[t.job_index].append(t)
        want = fingerprint(jobs[0].source) if jobs else ()
        pending = deque(tasks)
        outstanding: dict[object, _Task] = {}  # ref -> task, submitted and not yet finished
        unconsumed = 0  # submitted (finished or not) and not yet yielded
        for index, parts in enumerate(by_job):
            while any(t.result is None for t in parts):
                # the window bounds work ahead of the writer; the job being written is always let in
                while pending and (unconsumed < self.window or pending[0].job_index <= index):
                    self._submit(pending.popleft(), want, outstanding)
                    unconsumed += 1
                self._collect(outstanding, want)
            unconsumed -= len(parts)
            yield _assemble(jobs[index], parts)
            for t in parts:
                t.result = None  # let the bytes go once written

    def _split(self, index: int, job: EncodeJob) -> list[_Task]:
        parts = split_experts(job.shape, self.part_elements)
        ship = self.source_mode == "ship"
        if len(parts) == 1:
            return [_Task(index, parts[0], job, ship)]
        imp = job.importance
        per_expert = imp is not None and imp.shape[0] == job.shape[0]
        return [
            _Task(index, p, replace(job, importance=imp[p.lo : p.hi] if per_expert else imp), ship)
            for p in parts
        ]

    def _submit(self, task: _Task, want: tuple, outstanding: dict) -> None:
        shipped = None
        if task.ship:
            part = ship_part(open_source(task.job.source), task.job.name, task.part, self._last)
            shipped = self.ray.put(part)
            self.counters.shipped += 1
        task.ref = self._remote.remote(task.job, task.part, shipped, want)
        outstanding[task.ref] = task
        self.counters.in_flight = len(outstanding)

    def _collect(self, outstanding: dict, want: tuple) -> None:
        """Wait for at least one outstanding task; store its result or resubmit it."""
        ray = self.ray
        ready, _ = ray.wait(list(outstanding), num_returns=1, timeout=None)
        for ref in ready:
            task = outstanding.pop(ref)
            try:
                task.result = ray.get(ref)
                self.counters.done += 1
            except ray.exceptions.RayTaskError as e:
                cause = e.cause
                if isinstance(cause, SourceNotVisible):
                    if self.source_mode == "read":
                        raise ForgeError(f"a Ray worker does not see the source {cause}, and "
                                         "FORGE_RAY_SOURCE=read forbids shipping it") from None  # fmt: skip
                    task.ship = True
                    self._submit(task, want, outstanding)
                    continue
                if isinstance(cause, ForgeError):
                    raise ForgeError(f"{task.job.name}: {cause}") from None
                self._retry(task, want, outstanding, f"{type(cause).__name__}: {cause}")
            except ray.exceptions.RayError as e:  # worker or node lost, result lost with its node...
                self._retry(task, want, outstanding, type(e).__name__)
        self.counters.in_flight = len(outstanding)

    def _retry(self, task: _Task, want: tuple, outstanding: dict, why: str) -> None:
        self.counters.failed += 1
        task.attempts += 1
        what = task.job.name + ("" if task.part.whole else f" experts {task.part.lo}-{task.part.hi - 1}")
        if task.attempts > self.max_retries:
            raise ForgeError(f"{what}: task failed {task.attempts} times on the Ray cluster (last: {why})")
        self.counters.retried.append(what)
        if self.log:
            self.log(f"retrying {what} ({why}); attempt {task.attempts + 1} of {self.max_retries + 1}")
        self._submit(task, want, outstanding)


def _assemble(job: EncodeJob, parts: list[_Task]) -> EncodeResult:
    """One result from a job's parts: bytes in expert order; the error sample is the first part's."""
    if len(parts) == 1:
        return parts[0].result
    results = [t.result for t in parts]
    data = np.concatenate([r.data for r in results])
    return EncodeResult(
        data, results[0].rel_rmse, sum(r.seconds for r in results), sum(r.read_seconds for r in results)
    )
