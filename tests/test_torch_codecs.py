"""Device encoders (forge/quant/torch_codecs): the same bytes as the numpy codecs, on CPU torch and CUDA."""

from __future__ import annotations

import hashlib
import os
import re

import numpy as np
import pytest
import torch

from forge.errors import ForgeError
from forge.quant.torch_codecs import encode_on_device, supported_on_device
from forge.quant.types import get_type
from tests import oracle

MODEL = "tiny-qwen3moe"
#: every type the q4_k_m, q5_k_m, q6_k, iq4_xs and iq2_xxs presets produce, with and without an imatrix
CASES = [
    *[
        (q, imat)
        for q in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "IQ4_NL", "IQ4_XS")
        for imat in (False, True)
    ],
    ("IQ2_XXS", True),
]
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available"),
        ],
    ),
]


@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread():
    """torch's CPU thread pool spins badly on a loaded 2-core box; these inputs are small anyway."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _edge_rows(n_per_row: int, seed: int) -> np.ndarray:
    """One row per awkward case, stacked: every row is encoded independently of the others."""
    rng = np.random.default_rng(seed)
    n = n_per_row

    def normal(scale: float) -> np.ndarray:
        return (rng.standard_normal(n) * scale).astype(np.float32)

    spike = np.zeros(n, np.float32)
    spike[rng.integers(n)] = 3.5
    signed_zeros = np.where(rng.random(n) < 0.5, np.float32(-0.0), np.float32(0.0)).astype(np.float32)
    signed_zeros[::37] = normal(1.0)[::37]
    half_zero = normal(1.0)
    half_zero[: n // 2] = 0  # a block of zeros next to a normal one
    rows = [
        np.zeros(n, np.float32),
        np.full(n, 0.75, np.float32),
        np.full(n, -2.0, np.float32),
        spike,
        signed_zeros,
        half_zero,
        normal(1e15),  # huge: squares and their block sums stay finite
        normal(1e-18),  # tiny: squares are float32 subnormals
        normal(1e-30),  # tiny: squares underflow to zero
        normal(2e-6),  # super-block scales in fp16's subnormal range
        np.abs(normal(1.0)) + 0.5,  # all positive: min > 0
        -np.abs(normal(1.0)) - 0.5,  # all negative
        rng.integers(-2, 3, n).astype(np.float32),  # few distinct values: ties everywhere
        rng.integers(-1, 2, n).astype(np.float32) * np.float32(0.125),
        rng.standard_t(2, n).astype(np.float32),  # heavy tails
        (normal(1.0) * np.repeat(rng.uniform(1e-3, 30, n // 32), 32)).astype(np.float32),
        normal(0.02),
    ]
    return np.stack(rows).astype(np.float32)


def _importance(n_per_row: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    imp = rng.uniform(0, 3, n_per_row).astype(np.float32) ** 2
    imp[rng.random(n_per_row) < 0.1] = 0  # columns never activated
    return imp


@pytest.fixture(autouse=True)
def _numpy_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference is the numpy codec (not the numba kernels, which are tested against it elsewhere)."""
    monkeypatch.setenv("FORGE_NO_NUMBA", "1")


def _assert_same(qtype: str, rows: np.ndarray, importance: np.ndarray | None, device: str, **kw) -> None:
    want = get_type(qtype).encode(rows, importance)
    got = encode_on_device(qtype, rows, importance, device, **kw)
    assert got.dtype == np.uint8 and got.shape == want.shape
    if not np.array_equal(got, want):
        tsz = get_type(qtype).type_size
        bad = np.flatnonzero((got.reshape(-1, tsz) != want.reshape(-1, tsz)).any(axis=1))
        pytest.fail(f"{qtype} on {device}: {len(bad)} blocks differ from the CPU codec, first {bad[:8]}")


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning")  # the numpy codec on the 1e15 row
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # and its sums, inf - inf there (IQ4)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("qtype", "with_importance"), CASES, ids=[f"{q}-{'imat' if i else 'plain'}" for q, i in CASES]
)
def test_same_bytes_as_numpy_on_edge_rows(device: str, qtype: str, with_importance: bool) -> None:
    n = 512
    rows = _edge_rows(n, seed=7)
    _assert_same(qtype, rows, _importance(n, 3) if with_importance else None, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("qtype", "with_importance"), CASES, ids=[f"{q}-{'imat' if i else 'plain'}" for q, i in CASES]
)
def test_same_bytes_as_numpy_across_chunks(device: str, qtype: str, with_importance: bool) -> None:
    """Random rows of mixed scales, cut into several device chunks (one row less than a chunk's worth)."""
    rng = np.random.default_rng(11)
    n = 768
    rows = (rng.standard_normal((9, n)) * rng.uniform(1e-3, 10, (9, 1))).astype(np.float32)
    importance = _importance(n, 5) if with_importance else None
    _assert_same(qtype, rows, importance, device, chunk_elems=2 * n)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q6_K", "IQ4_XS", "IQ2_XXS"])
def test_one_importance_vector_per_matrix(device: str, qtype: str) -> None:
    """A 3-D tensor's experts in one device pass, each with its own importance vector, chunks cutting
    across experts: the bytes of the CPU encoding each expert alone (jobs.encode_rows)."""
    from forge.quant.jobs import encode_rows

    rng = np.random.default_rng(4)
    n_mat, rows_per_mat, n = 3, 4, 512
    rows = (
        rng.standard_normal((n_mat * rows_per_mat, n)) * rng.uniform(0.01, 3, (n_mat * rows_per_mat, 1))
    ).astype(np.float32)
    importance = np.stack([_importance(n, seed) for seed in range(n_mat)])
    want = np.concatenate(
        [
            get_type(qtype).encode(m, w)
            for m, w in zip(rows.reshape(n_mat, rows_per_mat, n), importance, strict=True)
        ]
    )
    assert np.array_equal(encode_rows(qtype, rows, importance), want)
    got = encode_on_device(qtype, rows, importance, device, chunk_elems=3 * n)
    assert np.array_equal(got, want)
    assert np.array_equal(encode_rows(qtype, rows, importance, device), want)
    with pytest.raises(ForgeError, match="importance groups"):
        encode_on_device(qtype, rows[:-1], importance, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("qtype", "per_matrix"), [("Q4_K", False), ("Q6_K", False), ("IQ2_XXS", True)])
def test_bf16_bits_widen_on_the_device(device: str, qtype: str, per_matrix: bool) -> None:
    """bf16 rows given as their bits (what ``forge quantize --device`` uploads) encode to the bytes of their
    float32 values, across chunks and with one importance vector per matrix; a NaN or infinity among the
    bits is the job's error."""
    from forge.bulk import NON_FINITE, bf16_to_f32

    rng = np.random.default_rng(9)
    n = 512
    values = (rng.standard_normal((6, n)) * rng.uniform(1e-3, 10, (6, 1))).astype(np.float32)
    bits = (values.view(np.uint32) >> 16).astype(np.uint16)  # bf16 by truncation: any bits will do
    importance = np.stack([_importance(n, seed) for seed in range(2)]) if per_matrix else _importance(n, 1)
    want = encode_on_device(qtype, bf16_to_f32(bits), importance, device, chunk_elems=2 * n)
    assert np.array_equal(encode_on_device(qtype, bits, importance, device, chunk_elems=2 * n), want)
    for bad in (np.nan, np.inf):
        poisoned = bits.copy()
        poisoned[4, 7] = (np.array([bad], np.float32).view(np.uint32) >> 16).astype(np.uint16)[0]
        with pytest.raises(ForgeError, match=re.escape(NON_FINITE)):
            encode_on_device(qtype, poisoned, importance, device, chunk_elems=2 * n)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"])
def test_same_bytes_as_numpy_on_gaussian_matrix(device: str, qtype: str) -> None:
    """Enough blocks (1024 super-blocks) that a rare one-ulp difference would show."""
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((64, 4096), dtype=np.float32)
    _assert_same(qtype, rows, None, device)
    _assert_same(qtype, rows, rng.uniform(0.1, 2, 4096).astype(np.float32), device)


@pytest.mark.parametrize("device", DEVICES)
def test_float32_primitives_match_numpy(device: str) -> None:
    """Each primitive, on a million values spread over 2**-58..2**58, bit for bit against numpy."""
    from forge.quant import numerics as nx
    from forge.quant.torch_codecs import ops

    rng = np.random.default_rng(2)
    n = 1 << 20
    a = (rng.standard_normal(n) * np.exp(rng.uniform(-40, 40, n))).astype(np.float32)
    b = (rng.standard_normal(n) * np.exp(rng.uniform(-40, 40, n))).astype(np.float32)
    a[:6] = [0.0, -0.0, np.inf, -np.inf, np.nan, 5e6]
    ta, tb = torch.from_numpy(a).to(device), torch.from_numpy(b).to(device)

    def same(mine: torch.Tensor, want: np.ndarray) -> None:
        """Bit for bit, except that a NaN's payload is the device's own (CUDA's is canonical)."""
        got = mine.cpu().numpy()
        assert got.dtype == want.dtype
        nan = np.isnan(want) if want.dtype.kind == "f" else np.zeros(want.shape, bool)
        assert np.array_equal(nan, np.isnan(got) if got.dtype.kind == "f" else nan)
        assert np.array_equal(got[~nan].view(np.uint8), want[~nan].view(np.uint8))

    with np.errstate(all="ignore"):
        same(ops.sqrt(ta.abs()), np.sqrt(np.abs(a)))
        same(ops.div(ta, tb), a / b)
        same(ops.div(ta, 63.0), a / np.float32(63))
        same(ops.div(63.0, tb), np.float32(63) / b)
        same(ops.nearest_int(ops.div(ta, 1e3)), nx.nearest_int(a / np.float32(1e3)))
        same(ops.nearest_int(ta), nx.nearest_int(a))
        # levels: compared as values (numpy itself gives -0.0 or +0.0 there depending on the whole array)
        clipped = ops.nearest_int_clip(ta * 1e-3, 0, 15).cpu().numpy()
        assert np.array_equal(clipped, nx.nearest_int_clip(a * np.float32(1e-3), 0, 15))
        num = ~np.isnan(a)  # fp16 NaN payloads are the device's own
        same(
            ops.fp16_bytes(ta[torch.from_numpy(num).to(device)]).reshape(-1),
            nx.fp16_bits(a[num]).view(np.uint8),
        )
        same(ops.np_maximum(ta, 0.0), np.maximum(a, np.float32(0)))
        same(ops.np_minimum(ta, 0.0), np.minimum(a, np.float32(0)))
        terms = (a[: 32 * 4096] * np.float32(1e-20)).reshape(32, 4096)
        t_terms = torch.from_numpy(terms).to(device)
        same(ops.seq_sum(t_terms), nx.seq_sum(terms))
        same(ops.seq_sum(t_terms, start_zero=False), nx.seq_sum(terms, start_zero=False))


def _fixture_cases() -> list:
    wanted = [
        ("Q4_K_M", "blk.0.attn_k.weight", "Q4_K"),
        ("Q4_K_M-imat", "blk.0.attn_k.weight", "Q4_K"),
        ("Q5_K_M", "blk.0.attn_k.weight", "Q5_K"),
        ("IQ2_XXS-imat", "blk.0.attn_k.weight", "IQ2_XXS"),
        ("Q6_K", "blk.0.attn_k.weight", "Q6_K"),
        ("Q8_0", "blk.0.attn_k.weight", "Q8_0"),
        ("IQ4_XS", "blk.0.attn_k.weight", "IQ4_XS"),
        ("IQ4_XS-imat", "blk.0.attn_k.weight", "IQ4_XS"),
        ("IQ4_NL", "blk.0.attn_k.weight", "IQ4_NL"),
        ("Q2_K", "blk.0.attn_k.weight", "Q2_K"),
        ("Q2_K-imat", "blk.0.attn_k.weight", "Q2_K"),
        ("Q2_K-imat", "blk.0.attn_v.weight", "Q3_K"),
        ("Q3_K_M", "blk.0.attn_k.weight", "Q3_K"),
        ("Q3_K_M-imat", "blk.0.attn_k.weight", "Q3_K"),
    ]
    present = set(oracle.manifest_names(MODEL))
    cases = [
        pytest.param(man, tensor, qtype, id=f"{man}:{tensor}")
        for man, tensor, qtype in wanted
        if man in present
    ]
    return cases or [pytest.param(None, None, None, marks=pytest.mark.skip(reason="fixtures absent"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("manifest", "tensor", "qtype"), _fixture_cases())
def test_fixture_tensor_matches_llamacpp(device: str, manifest: str, tensor: str, qtype: str) -> None:
    """A real tensor with the fixture's importance: device bytes hash to llama-quantize's tensor."""
    entry = oracle.manifest_tensor(MODEL, manifest, tensor)
    assert entry["type"] == qtype
    rows = oracle.qwen3moe_tensor(tensor)
    importance = oracle.llamacpp_importance(MODEL)[tensor][0] if manifest.endswith("-imat") else None
    got = encode_on_device(qtype, rows, importance, device)
    assert got.nbytes == entry["nbytes"]
    assert hashlib.sha256(got.tobytes()).hexdigest() == entry["sha256"]
    assert np.array_equal(got, get_type(qtype).encode(rows, importance))


def test_supported_types_and_refusals() -> None:
    for qtype in ("q4_k", "IQ2_XXS", "Q5_K", "Q6_K", "Q8_0", "IQ4_XS", "Q2_K", "Q3_K"):
        assert supported_on_device(qtype)
    assert not supported_on_device("IQ3_S")
    rows = np.ones((2, 256), np.float32)
    with pytest.raises(ForgeError, match="no device encoder"):
        encode_on_device("IQ3_S", rows, None, "cpu")
    with pytest.raises(ForgeError, match="needs importance"):
        encode_on_device("IQ2_XXS", rows, None, "cpu")
    with pytest.raises(ForgeError, match="NaN"):
        encode_on_device("Q4_K", np.full((1, 256), np.nan, np.float32), None, "cpu")
    with pytest.raises(ForgeError, match="multiple of the block size"):
        encode_on_device("Q4_K", np.ones((1, 100), np.float32), None, "cpu")
    with pytest.raises(ForgeError, match="device"):
        encode_on_device("Q4_K", rows, None, "no-such-device")
    empty = encode_on_device("Q4_K", np.zeros((0, 512), np.float32), None, "cpu")
    assert empty.shape == (0, get_type("Q4_K").row_bytes(512))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_cuda_missing_is_a_forge_error() -> None:
    with pytest.raises(ForgeError, match="no CUDA device"):
        encode_on_device("Q4_K", np.ones((1, 256), np.float32), None, "cuda")


@pytest.mark.parametrize("device", [pytest.param("cpu:0", id="torch-cpu"), *DEVICES[1:]])
def test_quantize_on_device_writes_the_cpu_bytes(device: str, example_bf16, tmp_path) -> None:
    """``forge quantize --device``: the types with a device encoder go through it; the file is identical."""
    from forge.quant.quantize import quantize

    kw = {"tensor_types": ["attn_k=q4_k", "attn_q=q5_k"]}
    _, cpu = quantize(example_bf16, tmp_path / "cpu.gguf", "q8_0", **kw)
    _, dev = quantize(example_bf16, tmp_path / "dev.gguf", "q8_0", device=device, **kw)
    assert {r["to"] for r in dev.tensors} >= {"Q4_K", "Q5_K", "Q8_0"}
    assert (tmp_path / "cpu.gguf").read_bytes() == (tmp_path / "dev.gguf").read_bytes()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_quantize_device_cuda_without_cuda_is_one_error_line(example_bf16, tmp_path) -> None:
    import subprocess
    import sys

    out = tmp_path / "o.gguf"
    cmd = [sys.executable, "-m", "forge", "quantize", str(example_bf16), "-o", str(out), "--device", "cuda"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "no CUDA device" in proc.stderr
    assert not out.exists()


@pytest.mark.parametrize("device", DEVICES)
def test_first_absmax_is_numpys_on_ties_and_nans(device: str) -> None:
    """Equal magnitudes of both signs take the first; a NaN column its first NaN: numpy's argmax semantics,
    computed without argmax (whose pick among equal values is the reduction's, and differs on CUDA)."""
    from forge.quant import numerics
    from forge.quant.torch_codecs import ops

    rng = np.random.default_rng(5)
    x = rng.integers(-2, 3, (32, 64)).astype(np.float32)
    x[:, 0] = 0
    x[5, 1], x[9, 1] = np.nan, np.nan
    want = numerics.first_absmax(x)
    got = ops.first_absmax(torch.from_numpy(x).to(device)).cpu().numpy()
    np.testing.assert_array_equal(got, want)
    assert np.signbit(got[2:]).any() and not np.signbit(got[2:]).all()  # both signs were chosen somewhere


class _CanonicalNaNs(torch.overrides.TorchFunctionMode):
    """CUDA's NaN habits on the CPU: every float32 result's NaNs become the positive canonical NaN (a GPU
    does not carry x86's sign and payload through arithmetic) and an fp16 NaN is 0x7FFF (its conversion)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype in (torch.float32, torch.float16):
            nan = torch.isnan(out)
            if bool(nan.any()):
                if out.dtype == torch.float32:
                    out.view(torch.int32).masked_fill_(nan, 0x7FFFFFFF)
                else:
                    out.view(torch.int16).masked_fill_(nan, 0x7FFF)
        return out


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize(
    ("qtype", "with_importance"), CASES, ids=[f"{q}-{'imat' if i else 'plain'}" for q, i in CASES]
)
def test_nan_fields_do_not_depend_on_the_devices_nan_bits(qtype: str, with_importance: bool) -> None:
    """The edge rows' NaN scales (the 1e15 row: inf / inf) come out with the CPU codec's bits when NaNs are
    made as CUDA makes them (this used to differ on the H200 for plain Q3_K, Q6_K, IQ4_NL and IQ4_XS)."""
    n = 512
    rows = _edge_rows(n, seed=7)
    with _CanonicalNaNs():
        _assert_same(qtype, rows, _importance(n, 3) if with_importance else None, "cpu")


def _q4k_rows() -> np.ndarray:
    """Rows for the fused Q4_K kernel: Gaussian, heavy-tailed, tiny, on a grid, an outlier, flat and zero
    sub-blocks."""
    rng = np.random.default_rng(7)
    parts = [
        rng.standard_normal((16, 1024)),
        rng.standard_t(2, (16, 1024)),
        rng.uniform(-1, 1, (8, 1024)) * 1e-3,
        np.round(rng.standard_normal((8, 1024)) * 4) / 4,
    ]
    rows = np.concatenate(parts).astype(np.float32)
    rows[3, 100] = 1e4
    rows[40:42, 256:512] = -2.0
    rows[44, :32] = 0.0
    return rows


_FUSED_SCRIPT = """
import sys, numpy as np, torch
sys.path.insert(0, sys.argv[1])
from tests.test_torch_codecs import _q4k_rows
from forge.quant.torch_codecs import kquants_triton
from forge.quant.types import get_type
rows = _q4k_rows()[:: int(sys.argv[2])]
imp = np.random.default_rng(3).random(rows.shape[1]).astype(np.float32)
bad = []
for q in ("q4_k", "q5_k"):
    for w in (None, imp, np.tile(imp, (len(rows), 1))):
        t = None if w is None else torch.from_numpy(w)
        got = kquants_triton.encode_q45_k_fused(torch.from_numpy(rows), q, t).numpy()
        bad.append(np.flatnonzero((got != get_type(q).encode(rows, None if w is None else imp)).any(1)).tolist())
for w in (None, imp, np.tile(imp, (len(rows), 1))):
    t = None if w is None else torch.from_numpy(w)
    got = kquants_triton.encode_q6_k_fused(torch.from_numpy(rows), t).numpy()
    want = get_type("q6_k").encode(rows, None if w is None else imp)
    bad.append(np.flatnonzero((got != want).any(1)).tolist())
print(bad)
"""


@pytest.mark.slow  # two minutes in the interpreter
def test_fused_k_quants_in_the_triton_interpreter() -> None:
    """The fused Q4_K, Q5_K and Q6_K kernels' operations, run by Triton's interpreter (numpy float32: no
    contraction, correctly rounded division), give the CPU codecs' bytes (without importance, with one vector,
    with one per row). Needs triton (absent from CI's CPU torch)."""
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, "-c", _FUSED_SCRIPT, str(root), "6"],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == str([[]] * 9)  # no row differs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
def test_fused_k_quants_on_cuda() -> None:
    """On a GPU the fused Q4_K, Q5_K and Q6_K kernels pass their self-checks (so ``encode_on_device`` uses them)
    and give the CPU codecs' bytes on rows of every kind."""
    from forge.quant.torch_codecs import kquants_triton

    rows = _q4k_rows()
    imp = np.random.default_rng(3).random(rows.shape[1]).astype(np.float32)
    for qtype, w in ((q, w) for q in ("q4_k", "q5_k", "q6_k") for w in (None, imp)):
        assert kquants_triton.usable(qtype, torch.device("cuda"))
        want = get_type(qtype).encode(rows, w)
        assert np.array_equal(encode_on_device(qtype.upper(), rows, w, "cuda"), want), (qtype, w is None)


@pytest.mark.slow  # two minutes in the interpreter
def test_iq2_kernels_in_the_triton_interpreter() -> None:
    """The IQ2_XXS search kernels (make_qp_quants, snap + fit), run by Triton's interpreter (numpy float32: no
    contraction, correctly rounded division), give the torch operations' bytes (one program's columns: random
    rows at several scales, zero and flat sub-blocks, an outlier; one importance vector and one per row).
    Needs triton."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    script = "from forge.quant.torch_codecs import iq2_triton; print(iq2_triton.agrees('cpu', 256))"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "True"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
def test_iq2_kernels_on_cuda() -> None:
    """On a GPU the IQ2_XXS kernels pass their self-check (so the encoder uses them), and the encoder then gives
    the CPU codec's bytes, with one importance vector and with one per expert."""
    from forge.quant.torch_codecs import iq2_triton

    assert iq2_triton.self_check("cuda")
    rng = np.random.default_rng(5)
    rows = (rng.standard_normal((64, 1024)) * rng.uniform(0.01, 3, (64, 1))).astype(np.float32)
    imp = rng.random(1024).astype(np.float32)
    assert np.array_equal(
        encode_on_device("IQ2_XXS", rows, imp, "cuda"), get_type("iq2_xxs").encode(rows, imp)
    )
    per_expert = rng.random((4, 1024)).astype(np.float32)
    want = np.concatenate(
        [get_type("iq2_xxs").encode(r, w) for r, w in zip(np.split(rows, 4), per_expert, strict=True)]
    )
    assert np.array_equal(encode_on_device("IQ2_XXS", rows, per_expert, "cuda"), want)


def test_tame_chunks_for_the_fused_kernels() -> None:
    """Chunks with a nonzero magnitude outside 1e-10..1e10 (rows or importance) go to the torch operations,
    which reproduce the CPU's subnormals and NaN bits; zeros are tame."""
    from forge.quant.torch_codecs.kquants_triton import tame

    rows = torch.randn(4, 256)
    rows[0, :10] = 0.0
    assert tame(rows, None) and tame(rows, torch.rand(256) + 0.5)
    for value in (1e-12, -1e-12, 1e11, -1e11):
        odd = rows.clone()
        odd[2, 7] = value
        assert not tame(odd, None)
    assert not tame(rows, torch.full((256,), 1e-20))
