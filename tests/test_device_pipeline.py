"""``forge quantize --device``: every type of the presets encodes on the device, reading and writing
overlap the encoding (forge.quant.jobs.overlapped), and the file is the CPU's, byte for byte."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from forge.errors import ForgeError
from forge.quant import jobs as jobs_mod
from forge.quant.jobs import EncodeJob, EncodeResult, Executor, ProcessExecutor
from forge.quant.torch_codecs import supported_on_device
from tests import oracle

WAIT_S = 20.0
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # torch's thread pool spins on a loaded box


class _Source:
    def __init__(self, log: list[str]):
        self.log = log

    def values_or_bits(self, name: str) -> np.ndarray:
        self.log.append(f"read {name}")
        return np.zeros((1, 1), np.float32)


def _jobs(names: str, device: str = "cuda") -> list[EncodeJob]:
    return [EncodeJob(None, n, "Q8_0", None, (), device) for n in names]  # type: ignore[arg-type]


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_reading_and_writing_overlap_the_encoding(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Job b is read while job a encodes, and a's result is consumed while b encodes: each stage waits
    for the other to happen at the same time, so a sequential run would time out. The same on the CPU
    (``Executor``, one process)."""
    log: list[str] = []
    b_read = threading.Event()
    b_encoding = threading.Event()
    monkeypatch.setattr(jobs_mod, "open_source", lambda ref: _Source(log))

    def run_job(job: EncodeJob, values: np.ndarray, read_seconds: float) -> EncodeResult:
        log.append(f"encode {job.name}")
        if job.name == "a":
            assert b_read.wait(WAIT_S) or "read b" in log, "job b was not read while job a encoded"
        if job.name == "b":
            b_encoding.set()
        return EncodeResult(np.frombuffer(job.name.encode(), np.uint8), 0.0, 0.0)

    real_read = _Source.values_or_bits

    def values_or_bits(self: _Source, name: str) -> np.ndarray:
        out = real_read(self, name)
        if name == "b":
            b_read.set()
        return out

    monkeypatch.setattr(_Source, "values_or_bits", values_or_bits)
    monkeypatch.setattr(jobs_mod, "run_job", run_job)
    got = []
    for res in Executor().map(_jobs("abcde", device)):
        if not got:
            assert b_encoding.wait(WAIT_S), "job b did not encode while job a's result was written"
        got.append(res.data.tobytes().decode())
    assert got == list("abcde")
    assert log.index("read b") < log.index("encode b")


def test_a_failed_encode_stops_the_pipeline(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []
    monkeypatch.setattr(jobs_mod, "open_source", lambda ref: _Source(log))

    def run_job(job: EncodeJob, values: np.ndarray, read_seconds: float) -> EncodeResult:
        if job.name == "b":
            raise ForgeError("b is broken")
        return EncodeResult(np.zeros(1, np.uint8), 0.0, 0.0)

    monkeypatch.setattr(jobs_mod, "run_job", run_job)
    ex = Executor()
    results = ex.map(_jobs("abcdefgh"))
    next(results)
    with pytest.raises(ForgeError, match="b is broken"):
        next(results)
    ex.abort()
    assert "read h" not in log  # at most `ahead` jobs were read past the one consumed


def test_worker_processes_leave_device_jobs_to_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--jobs N --device cuda``: the device's jobs run in the overlapped pipeline here (the stubs below
    exist in this process only), not in N processes sharing one GPU."""
    log: list[str] = []
    monkeypatch.setattr(jobs_mod, "open_source", lambda ref: _Source(log))
    monkeypatch.setattr(
        jobs_mod, "run_job", lambda job, values, read_s: EncodeResult(np.zeros(1, np.uint8), 0.0, 0.0)
    )
    ex = ProcessExecutor(2)
    try:
        assert len(list(ex.map(_jobs("abc")))) == 3
        assert log == ["read a", "read b", "read c"]
    finally:
        ex.close()


PRESETS = [("q4_k_m", False), ("q5_k_m", False), ("q6_k", False), ("iq4_xs", True), ("iq2_xxs", True)]


@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "imat"), PRESETS, ids=[r for r, _ in PRESETS])
def test_every_type_of_the_preset_encodes_on_the_device(
    recipe: str, imat: bool, example_bf16, tmp_path
) -> None:
    """The torch encoders on the CPU device: the whole file equals the CPU codecs' file."""
    from forge.quant.quantize import quantize

    imatrix = oracle.fixture("llamacpp", "tiny-qwen3moe", "tiny-qwen3moe-imatrix.gguf") if imat else None
    _, cpu = quantize(example_bf16, tmp_path / "cpu.gguf", recipe, imatrix=imatrix)
    _, dev = quantize(example_bf16, tmp_path / "dev.gguf", recipe, imatrix=imatrix, device="cpu:0")
    encoded = {r["to"] for r in dev.tensors if r["action"] == "encoded"}
    assert encoded and all(supported_on_device(t) for t in encoded), encoded
    assert (tmp_path / "cpu.gguf").read_bytes() == (tmp_path / "dev.gguf").read_bytes()


@pytest.mark.parametrize("kind", ["gguf", "hf"])
def test_sources_hand_bf16_tensors_to_a_device_as_their_bits(kind: str, example_bf16) -> None:  # noqa: ANN001
    """What the device pipeline reads (``values_or_bits``): a bf16-stored tensor's bits, which widen to exactly
    ``float32``'s values; any other tensor as ``float32`` gives it."""
    from forge.bulk import bf16_to_f32
    from forge.quant.source import source_ref
    from tests.conftest import EXAMPLE

    src = source_ref(example_bf16 if kind == "gguf" else EXAMPLE).open()
    as_bits = 0
    for t in src.tensors():
        got, want = src.values_or_bits(t.name), src.float32(t.name)
        if got.dtype == np.uint16:
            as_bits += 1
            got = bf16_to_f32(got)
        assert got.shape == want.shape and np.array_equal(got.view(np.uint32), want.view(np.uint32)), t.name
    assert as_bits > len(src.tensors()) // 2
