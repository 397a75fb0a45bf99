"""Encode jobs and the executors that run them: one tensor's work as a picklable job, run in this process
or in a pool of worker processes. A cluster executor (forge.distributed) runs the same jobs; the build never
knows which one ran them."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from forge.bulk import NON_FINITE, all_finite, bf16_to_f32
from forge.errors import ForgeError
from forge.quant.source import QuantSource, SourceRef
from forge.quant.torch_codecs import encode_on_device, supported_on_device
from forge.quant.types import BlockCodec, get_type
from forge.workers import stop_pool, worker_pool

ERROR_SAMPLE_ROWS = 64


@dataclass(frozen=True)
class EncodeJob:
    """One tensor's encode work; picklable, so a worker process can run it."""

    source: SourceRef
    name: str
    out_type: str
    importance: np.ndarray | None  # (n_mat, n_per_row)
    shape: tuple[int, ...] = ()  # numpy order; lets an executor split a 3-D tensor by expert ranges
    device: str = "cpu"  # torch device for the types that have a device encoder (same bytes)


@dataclass
class EncodeResult:
    data: np.ndarray  # uint8, the tensor's bytes
    rel_rmse: float
    seconds: float  # reading and encoding
    read_seconds: float = 0.0  # reading the values (by the reader thread when overlapped)


_SOURCES: dict[SourceRef, QuantSource] = {}


def open_source(ref: SourceRef) -> QuantSource:
    """The source, opened once per process (worker processes reuse it across jobs)."""
    if ref not in _SOURCES:
        _SOURCES[ref] = ref.open()
    return _SOURCES[ref]


def encode_rows(
    qtype: str, rows: np.ndarray, importance: np.ndarray | None, device: str = "cpu"
) -> np.ndarray:
    """Encode (n_rows, n_per_row) float32 rows (or bf16 rows as uint16 bits) in bounded chunks, on ``device``
    where the type has a torch encoder (the bytes are the same), else with the CPU codec. ``importance``: one
    vector for all rows, or one per group of consecutive rows (n_mat, n_per_row), a 3-D tensor's matrices."""
    qt = get_type(qtype)
    if device != "cpu" and supported_on_device(qt.name()):
        return encode_on_device(qt.name(), rows, importance, device)  # checks the values on the device
    if issubclass(qt, BlockCodec):  # bf16 bits and per-matrix vectors as they are
        return qt.encode(rows, importance)
    values = bf16_to_f32(rows) if rows.dtype == np.uint16 else rows
    if not all_finite(values):
        raise ForgeError(NON_FINITE)
    return qt.encode(values)


def run_job(job: EncodeJob, values: np.ndarray | None = None, read_seconds: float = 0.0) -> EncodeResult:
    """Encode one job; ``values`` (float32, read in ``read_seconds``) replace reading the tensor from the
    source."""
    start = time.perf_counter() - read_seconds
    if values is None:
        values = open_source(job.source).float32(job.name)
        read_seconds = time.perf_counter() - start
    n_per_row = values.shape[-1]
    mats = values.reshape(-1, *values.shape[-2:]) if values.ndim >= 2 else values.reshape(1, 1, -1)
    w = job.importance
    if w is not None and w.shape[0] != mats.shape[0]:
        w = w[0]  # one vector for every matrix; else routed experts, each matrix with its own
    data = encode_rows(job.out_type, values.reshape(-1, n_per_row), w, job.device)
    sample = values.reshape(-1, n_per_row)[:ERROR_SAMPLE_ROWS]
    if sample.dtype == np.uint16:
        sample = bf16_to_f32(sample)
    decoded = get_type(job.out_type).decode(data[: len(sample)], n_per_row)
    denom = float(np.sqrt(np.mean(sample.astype(np.float64) ** 2))) or 1.0
    rel = float(np.sqrt(np.mean((decoded.astype(np.float64) - sample) ** 2))) / denom
    return EncodeResult(data.reshape(-1), rel, time.perf_counter() - start, read_seconds)


def overlapped(jobs: list[EncodeJob], ahead: int = 2) -> Iterator[EncodeResult]:
    """``run_job`` over ``jobs``, in order, in three stages at once: one thread reads the tensors up to
    ``ahead`` jobs ahead (bf16 ones as their bits, widened chunk by chunk where they are encoded; others as
    float32), another encodes them one at a time (on the device, or on the encoders' thread pool), and the
    caller consumes (writes) the results. Threads suffice: the reading, the kernels and the writing all
    release the GIL."""
    reader = ThreadPoolExecutor(1, thread_name_prefix="forge-read")
    encoder = ThreadPoolExecutor(1, thread_name_prefix="forge-encode")
    pending: deque[Future] = deque()
    todo = iter(jobs)

    def read(job: EncodeJob) -> tuple[np.ndarray, float]:
        t0 = time.perf_counter()
        return open_source(job.source).values_or_bits(job.name), time.perf_counter() - t0

    def submit(job: EncodeJob) -> None:
        values = reader.submit(read, job)
        pending.append(encoder.submit(lambda: run_job(job, *values.result())))

    try:
        for job in todo:
            submit(job)
            if len(pending) >= ahead:
                break
        while pending:
            done = pending.popleft()
            job = next(todo, None)
            if job is not None:
                submit(job)
            yield done.result()
    finally:
        for pool in (reader, encoder):
            pool.shutdown(wait=True, cancel_futures=True)


class Executor:
    """Runs encode jobs and yields results in submission order, in this process, with reading and writing
    overlapping the encoding (:func:`overlapped`): on 16 cores, reading, encoding and writing one after the
    other had left the encoders idle for a third of a q6_k run."""

    def map(self, jobs: list[EncodeJob]) -> Iterator[EncodeResult]:
        self._running = overlapped(jobs)
        return self._running

    def status(self) -> str:
        """A short progress note (tasks done/running/failed) for executors that have one."""
        return ""

    def close(self) -> None:
        running = getattr(self, "_running", None)
        if running is not None:
            running.close()  # its threads finish the job at hand and drop the rest

    def abort(self) -> None:
        """Stop now: the build failed or was interrupted."""
        self.close()


class ProcessExecutor(Executor):
    """A pool of worker processes; at most 2 x workers jobs in flight to bound memory."""

    def __init__(self, workers: int):
        self.workers = workers
        self.pool = worker_pool(workers)

    def map(self, jobs: list[EncodeJob]) -> Iterator[EncodeResult]:
        if any(j.device != "cpu" for j in jobs):
            return super().map(jobs)  # one device for every worker: its jobs overlap in this process instead
        return self._in_workers(jobs)

    def _in_workers(self, jobs: list[EncodeJob]) -> Iterator[EncodeResult]:
        pending = []
        it = iter(jobs)
        for job in it:
            pending.append(self.pool.submit(run_job, job))
            if len(pending) >= 2 * self.workers:
                break
        while pending:
            fut = pending.pop(0)
            nxt = next(it, None)
            if nxt is not None:
                pending.append(self.pool.submit(run_job, nxt))
            yield fut.result()

    def close(self) -> None:
        super().close()
        self.pool.shutdown(cancel_futures=True)

    def abort(self) -> None:
        super().close()
        stop_pool(self.pool)


def local_executor(jobs: int = 1) -> Executor:
    """This process (``jobs`` 1) or a pool of ``jobs`` worker processes."""
    return Executor() if jobs == 1 else ProcessExecutor(jobs)
