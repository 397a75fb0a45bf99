"""Executing a plan: encode or copy each tensor (locally or in worker processes) and write the GGUF."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np
from gguf import GGML_QUANT_VERSION, LlamaFileType

from forge.distributed.cluster import check_executor
from forge.errors import ForgeError
from forge.gguf_file import KV, GGUFLayout, T, write_gguf
from forge.imatrix.model import Imatrix
from forge.progress import byte_progress
from forge.quant.kernels import warm_up
from forge.quant.plan import PlannedTensor
from forge.quant.recipe import Recipe
from forge.quant.reuse import (
    DIGESTS,
    Priors,
    TensorStamp,
    content_digest,
    copy_from_prior,
    importance_digest,
    stamp_kvs,
    tensor_key,
    verified_bytes,
    why_regenerated,
)
from forge.quant.source import QuantSource, SourceRef
from forge.quant.torch_codecs import encode_on_device, supported_on_device
from forge.quant.types import get_type
from forge.workers import stop_pool, worker_pool

#: rows encoded per call: bounds the float32 working set of one job to ~64 MB
CHUNK_ELEMENTS = 16 << 20
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
    seconds: float


_SOURCES: dict[SourceRef, QuantSource] = {}


def open_source(ref: SourceRef) -> QuantSource:
    """The source, opened once per process (worker processes reuse it across jobs)."""
    if ref not in _SOURCES:
        _SOURCES[ref] = ref.open()
    return _SOURCES[ref]


def encode_rows(
    qtype: str, rows: np.ndarray, importance: np.ndarray | None, device: str = "cpu"
) -> np.ndarray:
    """Encode (n_rows, n_per_row) float32 rows in bounded chunks, on ``device`` where the type has a
    torch encoder (the bytes are the same), else with the CPU codec."""
    qt = get_type(qtype)
    if not np.isfinite(rows).all():
        raise ForgeError("non-finite values (NaN or inf) in the source weights")
    if device != "cpu" and supported_on_device(qt.name()):
        return encode_on_device(qt.name(), rows, importance, device)
    step = max(1, CHUNK_ELEMENTS // rows.shape[1])
    parts = [
        qt.encode(np.ascontiguousarray(rows[i : i + step]), importance) for i in range(0, rows.shape[0], step)
    ]
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


def run_job(job: EncodeJob, values: np.ndarray | None = None) -> EncodeResult:
    """Encode one job; ``values`` (float32) replace reading the tensor from the source."""
    start = time.perf_counter()
    if values is None:
        values = open_source(job.source).float32(job.name)
    n_per_row = values.shape[-1]
    mats = values.reshape(-1, *values.shape[-2:]) if values.ndim >= 2 else values.reshape(1, 1, -1)
    if job.importance is not None and job.importance.shape[0] == mats.shape[0]:
        # routed experts: each expert's matrix with its own importance row
        encoded = [
            encode_rows(job.out_type, m, w, job.device) for m, w in zip(mats, job.importance, strict=True)
        ]
        data = np.concatenate(encoded)
    else:
        w = None if job.importance is None else job.importance[0]
        data = encode_rows(job.out_type, values.reshape(-1, n_per_row), w, job.device)
    sample = values.reshape(-1, n_per_row)[:ERROR_SAMPLE_ROWS]
    decoded = get_type(job.out_type).decode(data[: len(sample)], n_per_row)
    denom = float(np.sqrt(np.mean(sample.astype(np.float64) ** 2))) or 1.0
    rel = float(np.sqrt(np.mean((decoded.astype(np.float64) - sample) ** 2))) / denom
    return EncodeResult(data.reshape(-1), rel, time.perf_counter() - start)


class Executor:
    """Runs encode jobs and yields results in submission order."""

    def map(self, jobs: list[EncodeJob]) -> Iterator[EncodeResult]:
        return (run_job(j) for j in jobs)

    def status(self) -> str:
        """A short progress note (tasks done/running/failed) for executors that have one."""
        return ""

    def close(self) -> None:
        pass

    def abort(self) -> None:
        """Stop now: the build failed or was interrupted."""
        self.close()


class ProcessExecutor(Executor):
    """A pool of worker processes; at most 2 x workers jobs in flight to bound memory."""

    def __init__(self, workers: int):
        self.workers = workers
        self.pool = worker_pool(workers)

    def map(self, jobs: list[EncodeJob]) -> Iterator[EncodeResult]:
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
        self.pool.shutdown(cancel_futures=True)

    def abort(self) -> None:
        stop_pool(self.pool)


def make_executor(
    jobs: int = 1,
    kind: str = "local",
    ray_address: str | None = None,
    log: Callable[[str], None] | None = None,
) -> Executor:
    """``local``: this process (``jobs`` 1) or a process pool; ``ray``: tasks on a Ray cluster."""
    check_executor(kind, ray_address, jobs, reach=False)
    if kind == "ray":
        from forge.distributed.quantize import RayExecutor

        return RayExecutor(ray_address, log=log)
    return Executor() if jobs == 1 else ProcessExecutor(jobs)


def output_kvs(
    source: QuantSource, recipe: Recipe, overrides: list[tuple[str, str]], imatrix: Imatrix | None,
    imatrix_path: str | None, extra: list[KV] = (),
) -> list[KV]:  # fmt: skip
    """Source KVs, then what llama-quantize appends (quant version, file type, imatrix), then ours."""
    ftype = recipe.file_type or "MOSTLY_Q8_0"
    try:
        file_type = int(LlamaFileType[ftype])
    except KeyError:
        raise ForgeError(f"recipe {recipe.name}: unknown file_type {ftype!r}") from None
    kvs = [*source.kvs(), KV("general.quantization_version", GGML_QUANT_VERSION, T.UINT32),
           KV("general.file_type", file_type, T.UINT32)]  # fmt: skip
    if imatrix is not None:
        kvs += [
            KV("quantize.imatrix.file", os.path.basename(imatrix_path or ""), T.STRING),
            KV("quantize.imatrix.dataset", imatrix.datasets[0] if imatrix.datasets else "", T.STRING),
            KV("quantize.imatrix.entries_count", len(imatrix.sums), T.INT32),
            KV("quantize.imatrix.chunks_count", imatrix.chunk_count, T.INT32),
        ]
    text = recipe.text + "".join(f"\n# --tensor-type {p}={t}" for p, t in overrides)
    kvs.append(KV("forge.recipe", text, T.STRING))
    return kvs + list(extra)


@dataclass
class BuildReport:
    output: Path | None
    bytes: int
    seconds: float
    tensors: list[dict] = field(default_factory=list)


def stamp_plan(
    source: QuantSource, plan: list[PlannedTensor], trust_mtime: bool = False
) -> list[TensorStamp]:
    """Each planned tensor's reuse key and its components."""
    stamps = []
    for p in plan:
        src = source.digest(p.name, trust_mtime)
        qt = get_type(p.out_type) if p.action == "encode" else None
        encoder = qt.version if qt is not None else 0
        imat = importance_digest(p.importance) if qt is not None and qt.uses_imatrix else ""
        stamps.append(
            TensorStamp(tensor_key(p.name, src, p.out_type.name, p.shape, encoder, imat), src, imat, encoder)
        )
    return stamps


def apply_priors(plan: list[PlannedTensor], stamps: list[TensorStamp], priors: Priors) -> None:
    """Turn tensors whose key a prior holds (with intact bytes) into copies; say why for the rest."""
    for p, stamp in zip(plan, stamps, strict=True):
        prior = priors.by_key.get(stamp.key)
        if prior is not None and prior.out_type == p.out_type.name and prior.shape == p.spec.shape:
            if verified_bytes(prior) is not None:
                p.action, p.reason, p.prior = "reuse", f"key match ({prior.file.path.name})", prior
                continue
            p.reason = f"prior {prior.file.path.name} failed its digest check: regenerated"
        else:
            p.reason = why_regenerated(stamp, p.out_type.name, priors.by_name.get(p.name))
        if p.action == "copy":
            p.reason = "not quantized; " + p.reason


def _digest_patcher(digests: list[str]) -> Callable[[BinaryIO, GGUFLayout], None]:
    """Writes the output digests into their placeholder (fixed-size) KV once all data is written."""

    def finalize(f: BinaryIO, layout: GGUFLayout) -> None:
        kv = next(k for k in layout.kvs if k.key == DIGESTS)
        start = layout.kv_offset(DIGESTS) + 8 + len(DIGESTS.encode()) + 4 + 4 + 8
        for j, d in enumerate(digests):
            f.seek(start + j * (8 + 16) + 8)
            f.write(d.encode())
        assert len(digests) == len(kv.value)

    return finalize


def build(
    source: QuantSource,
    plan: list[PlannedTensor],
    kvs: list[KV],
    out: Path | None,
    jobs: int = 1,
    progress: bool = False,
    log: Callable[[str], None] | None = None,
    stamps: list[TensorStamp] | None = None,
    executor: Executor | Callable[[], Executor] | None = None,
    device: str = "cpu",
) -> BuildReport:
    """Encode/copy every planned tensor and write ``out`` (``None``: dry run, nothing written).

    ``executor``: runs the encode jobs (or a factory for one, called only when there is work);
    default: ``make_executor(jobs)``. An executor passed in is not closed here.
    """
    specs = [p.spec for p in plan]
    digests: list[str] = []
    if stamps is not None:
        kvs = kvs + stamp_kvs(stamps, ["0" * 16] * len(plan))
    layout = GGUFLayout(kvs, specs)
    report = BuildReport(out, layout.total_size, 0.0)
    if out is None:
        report.tensors = [_row(p, None) for p in plan]
        return report
    start = time.perf_counter()
    to_encode = [p for p in plan if p.action == "encode"]
    encode_jobs = [
        EncodeJob(source.ref, p.name, p.out_type.name, p.importance, p.shape, device) for p in to_encode
    ]
    owned = not isinstance(executor, Executor)
    if jobs > 1 and encode_jobs:  # compile (or load) the kernels once, not in every worker at once
        warm_up(sorted({j.out_type for j in encode_jobs}))
    if owned and not encode_jobs:  # everything copied or reused: no workers to start
        executor = Executor()
    elif executor is None:
        executor = make_executor(jobs)
    elif owned:
        executor = executor()
    try:
        results = executor.map(encode_jobs)
        with byte_progress(sum(s.nbytes for s in specs), "quantize", progress) as advance:

            def data() -> Iterator[object]:
                for p in plan:
                    res = next(results) if p.action == "encode" else None
                    row = _row(p, res)
                    report.tensors.append(row)
                    note = executor.status()  # e.g. a cluster's tasks done/running/failed
                    if log:
                        log(_log_line(row) + (f"  [{note}]" if note else ""))
                    if p.action == "reuse":
                        digests.append(p.prior.digest)
                        yield copy_from_prior(p.prior)
                    else:
                        item = res.data if res else source.stored(p.name)
                        digests.append(content_digest([item]))
                        yield item
                    advance(p.spec.nbytes, f"{p.name}  {note}" if note else p.name)

            finalize = _digest_patcher(digests) if stamps is not None else None
            write_gguf(out, kvs, specs, data(), finalize=finalize)
    except BaseException:
        if owned:
            executor.abort()
        raise
    else:
        if owned:
            executor.close()
    report.seconds = time.perf_counter() - start
    return report


def _row(p: PlannedTensor, res: EncodeResult | None) -> dict:
    row = {"name": p.name, "shape": list(reversed(p.shape)), "from": p.src_type.name, "to": p.out_type.name,
           "action": "encoded" if p.action == "encode" else "copied", "reason": p.reason,
           "bytes": p.spec.nbytes, "imatrix": p.importance is not None}  # fmt: skip
    if res is not None:
        row["rel_rmse"] = round(res.rel_rmse, 6)
        row["seconds"] = round(res.seconds, 3)
    return row


def _log_line(row: dict) -> str:
    shape = "x".join(str(d) for d in row["shape"])
    err = f"  rel.rmse {row['rel_rmse']:.4f}" if "rel_rmse" in row else ""
    imat = " +imatrix" if row["imatrix"] else ""
    return f"{row['name']:<36} {shape:>16}  {row['from']:>5} -> {row['to']:<7}{imat}{err}"
