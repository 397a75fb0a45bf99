"""``forge quantize``: source -> plan -> (encode | copy) -> GGUF."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from forge.arch import ARCHITECTURES
from forge.atomic import check_output_path
from forge.errors import ForgeError
from forge.gguf_file import DEFAULT_ALIGNMENT, KV, T
from forge.imatrix.formats import read_imatrix
from forge.quant.build import BuildReport, apply_priors, build, output_kvs, stamp_plan
from forge.quant.jobs import Executor
from forge.quant.plan import PlannedTensor, make_plan
from forge.quant.recipe import load_recipe, parse_overrides
from forge.quant.reuse import ds4_keys, load_priors
from forge.quant.source import source_ref
from forge.quant.torch_codecs import check_device

KNOWN_ARCHITECTURES = tuple(a.gguf_arch for a in ARCHITECTURES)


def quantize(
    src: str | Path,
    out: str | Path | None,
    recipe: str,
    imatrix: str | Path | None = None,
    tensor_types: list[str] = (),
    jobs: int = 1,
    allow_requantize: bool = False,
    mtp: bool = True,
    progress: bool = False,
    log: Callable[[str], None] | None = None,
    reuse: list[str | Path] = (),
    trust_mtime: bool = False,
    warn: Callable[[str], None] | None = None,
    executor: Executor | Callable[[], Executor] | None = None,
    device: str = "cpu",
) -> tuple[list[PlannedTensor], BuildReport]:
    """Quantize ``src`` (HF folder or GGUF) to ``out``; ``out=None`` is a dry run.

    ``reuse``: prior builds (files or folders) whose tensors are copied where their keys match.
    ``executor``: an :class:`Executor`, or a factory for one called only when there is work (see
    ``forge.distributed.cluster.choose_executor``); default: this process, or ``jobs`` worker processes.
    Output bytes never depend on it.
    ``device``: torch device (``cuda``) for the types that have a device encoder; same bytes as the CPU.
    """
    if out is not None:
        check_output_path(out)
    if jobs < 1:
        raise ForgeError("--jobs must be at least 1")
    check_device(device)
    rec = load_recipe(recipe)
    overrides = parse_overrides(list(tensor_types))
    priors = load_priors(reuse, Path(out) if out is not None else None) if reuse else None
    im = read_imatrix(imatrix) if imatrix else None
    ref = source_ref(src, mtp)
    source = ref.open()
    if not source.tensors():
        raise ForgeError(f"{src}: holds no tensors; nothing to quantize")
    if source.arch not in KNOWN_ARCHITECTURES:
        (warn or log or (lambda _: None))(
            f"warning: architecture {source.arch!r} is not one forge models ({', '.join(KNOWN_ARCHITECTURES)}): "
            "tensors are typed by name alone, and llama-quantize may choose other types"
        )
    # a checkpoint's FP8/FP4 tensors are its own precision (converted to Q8_0/MXFP4 as llama.cpp does), not an
    # earlier quantization the user must opt into re-encoding
    plan = make_plan(source, rec, overrides, im, allow_requantize or ref.kind == "hf")
    t0 = time.perf_counter()
    stamps = stamp_plan(source, plan, trust_mtime)
    keys_seconds = time.perf_counter() - t0
    if priors is not None:
        for w in priors.warnings:
            (warn or log or (lambda _: None))(f"warning: {w}; building those tensors from scratch")
        apply_priors(plan, stamps, priors)
    key, key_weights = ds4_keys(
        Path(ref.path), Path(imatrix) if imatrix else None, len(plan), DEFAULT_ALIGNMENT
    )
    extra = [KV("quantize.reuse_key", key, T.STRING), KV("quantize.reuse_key_weights", key_weights, T.STRING)]
    kvs = output_kvs(source, rec, overrides, im, str(imatrix) if imatrix else None, extra)
    report = build(
        source,
        plan,
        kvs,
        Path(out) if out is not None else None,
        jobs,
        progress,
        log,
        stamps,
        executor,
        device,
    )
    report.stages = {"source_keys": keys_seconds, **report.stages}
    return plan, report


def bytes_by_type(report: BuildReport) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"tensors": 0, "bytes": 0, "elements": 0})
    for row in report.tensors:
        e = out[row["to"]]
        e["tensors"] += 1
        e["bytes"] += row["bytes"]
        n = 1
        for d in row["shape"]:
            n *= d
        e["elements"] += n
    return dict(out)
