"""Executing a plan: encode (through the executor it is given) or copy each tensor, and write the GGUF."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from gguf import GGML_QUANT_VERSION, LlamaFileType

from forge.bulk import thread_pool
from forge.errors import ForgeError
from forge.gguf_file import KV, GGUFLayout, T, write_gguf
from forge.imatrix.model import Imatrix
from forge.progress import byte_progress
from forge.quant.jobs import EncodeJob, EncodeResult, Executor, local_executor
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
from forge.quant.source import QuantSource
from forge.quant.types import get_type


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
    # seconds by stage: the source's reuse keys, and of the build reading and encoding (busy time summed over
    # tensors: these overlap each other and the writing), the writer waiting for encoded tensors, hashing
    # them for their keys, and writing the rest of the time
    stages: dict[str, float] = field(default_factory=dict)


def stamp_plan(
    source: QuantSource, plan: list[PlannedTensor], trust_mtime: bool = False
) -> list[TensorStamp]:
    """Each planned tensor's reuse key and its components (the sources' digests on the encoders' threads:
    hashing a 10 GB checkpoint on one took seconds before anything was encoded)."""
    stamps = []
    sources = thread_pool().map(lambda p: source.digest(p.name, trust_mtime), plan)
    for p, src in zip(plan, sources, strict=True):
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
    default: ``local_executor(jobs)``. An executor passed in is not closed here.
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
        executor = local_executor(jobs)
    elif owned:
        executor = executor()
    stages = report.stages
    stages.update(read=0.0, encode=0.0, waited=0.0, output_digests=0.0)
    try:
        results = executor.map(encode_jobs)
        with byte_progress(sum(s.nbytes for s in specs), "quantize", progress) as advance:

            def data() -> Iterator[object]:
                for p in plan:
                    t0 = time.perf_counter()
                    res = next(results) if p.action == "encode" else None
                    stages["waited"] += time.perf_counter() - t0
                    if res is not None:
                        stages["read"] += res.read_seconds
                        stages["encode"] += res.seconds - res.read_seconds
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
                        t0 = time.perf_counter()
                        digests.append(content_digest([item]))
                        stages["output_digests"] += time.perf_counter() - t0
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
    stages["writing"] = report.seconds - stages["waited"] - stages["output_digests"]
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
