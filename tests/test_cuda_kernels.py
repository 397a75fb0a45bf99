"""The Triton kernels on GGUF blocks (runtime/backends/cuda_kernels.py) against the torch reference.

Reference: ``runtime.dequant.dequantize`` (bit-exact with gguf) to float32, then a float64 product.
Bounds:
- GEMV (decode) and GEMM with precision "ieee" or "tf32x3" (the runtime's default): float32-accurate
  products, float32 sums; within 1e-4 of the output scale (max |reference|).
- GEMM with operands rounded to tf32 / fp16 / bf16 (unit roundoff u): each product w*x becomes
  w(1+a) x(1+b) with |a|, |b| <= u, so |error| <= (2u + u^2) sum|w||x|, plus float32 accumulation
  (K * 2^-24 sum|w||x|, a worst case). The test checks that bound per output element.

Marked gpu: run on CUDA. On a machine with triton but no GPU, ``TRITON_INTERPRET=1`` runs the same
tests on the CPU through Triton's interpreter (slow; for developing kernels).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from forge.quant.types import get_type
from runtime.backends import cuda_kernels as ck
from runtime.dequant import dequantize
from runtime.synth import fp16_fields, random_blocks
from tests.test_expert_grouping import assert_tiles_cover
from tests.test_expert_grouping import routing as _ids

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and ck.triton is not None


@pytest.fixture(autouse=True, params=["", "all"], ids=["default-kernels", "word-kernels"])
def word_kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs with the default kernel choice and with the word kernel for all four types."""
    monkeypatch.setenv("FORGE_CUDA_WORDS", request.param)
    return request.param


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (ck.available() or _INTERPRET), reason="needs CUDA and triton"),
]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

TYPES = ck.supported_types()
_FLOATS = {Q.F32: np.float32, Q.F16: np.float16, Q.BF16: None}


def random_rows(qtype: Q, rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """uint8 (rows, row_bytes) of random well-formed ``qtype`` blocks (finite scales)."""
    rng = np.random.default_rng(seed + 1000 * int(qtype))
    if qtype in _FLOATS:
        v = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32) * 0.05)
        v = v.to({Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}[qtype])
        return v.view(torch.uint8).reshape(rows, -1).contiguous()
    if fp16_fields(qtype) is None:  # no fp16 scales to set (MXFP4): random values through the quantizer
        return torch.from_numpy(
            get_type(qtype).encode(rng.standard_normal((rows, k)).astype(np.float32) * 0.05)
        )
    blocks = random_blocks(qtype, rows * k // GGML_QUANT_SIZES[qtype][0], rng, 0.002, 0.02)
    return torch.from_numpy(blocks.reshape(rows, -1))


def k_for(qtype: Q, blocks: int = 3) -> int:
    """Several blocks per row; float rows get a length that is no multiple of any tile."""
    return 100 if qtype in _FLOATS else blocks * GGML_QUANT_SIZES[qtype][0]


def reference(x: torch.Tensor, raw: torch.Tensor, qtype: Q) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ W.T in float64, |x| @ |W|.T) with W decoded by the torch dequantizer."""
    bs, ts = GGML_QUANT_SIZES[qtype]
    w = dequantize(raw.cpu(), qtype, raw.shape[-1] // ts * bs).double()
    xd = x.cpu().double()
    return xd @ w.T, xd.abs() @ w.abs().T


def assert_close(y: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> None:
    err = (y.cpu().double() - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= rel * scale, f"max error {err:.3g} > {rel:g} x output scale {scale:.3g}"


def assert_rounding_bound(y: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor, u: float, k: int) -> None:
    bound = (2 * u + u * u + k * 2.0**-24) * mag + 1e-30
    excess = ((y.cpu().double() - ref).abs() / bound).max().item()
    assert excess <= 1.0, f"error reaches {excess:.3g} x the rounding bound (u = {u:g})"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_tok", [1, 3, 8])
@pytest.mark.parametrize("blocks", [3, 8])
def test_gemv_matches_reference(qtype: Q, n_tok: int, blocks: int) -> None:
    # 80 rows: no multiple of the 16/32-row tiles; 8 blocks of 32 take Q8_0's word kernel (K % 256 == 0)
    n, k = 80, k_for(qtype, blocks)
    raw = random_rows(qtype, n, k).to(DEVICE)
    x = torch.randn(n_tok, k, generator=torch.Generator().manual_seed(n_tok)).to(DEVICE)
    y = ck.linear(x, raw, qtype)
    assert y.shape == (n_tok, n) and y.dtype == torch.float32
    assert_close(y, reference(x, raw, qtype)[0])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("precision", ["auto", "ieee", "tf32x3", "bf16x3", "bf16x2", "tf32", "fp16", "bf16"])
def test_gemm_matches_reference(qtype: Q, precision: str) -> None:
    if _INTERPRET and (precision.startswith("bf16x") or precision == "auto"):
        if qtype not in ck._INT_TYPES:
            pytest.skip("the interpreter runs the integer-code GEMM for its own types only")
    elif _INTERPRET and (precision == "bf16" or (precision != "ieee" and qtype not in (Q.Q4_K, Q.F16))):
        pytest.skip("the interpreter has no bf16 dot, and its other precisions need one type each")
    n, k, m = 72, k_for(qtype, blocks=2), 37
    raw = random_rows(qtype, n, k, seed=1).to(DEVICE)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    y = ck.linear(x, raw, qtype, precision=precision)
    ref, mag = reference(x, raw, qtype)
    if precision in ("auto", "ieee", "tf32x3", "bf16x3"):  # float32-accurate products
        assert_close(y, ref)
    else:
        assert_rounding_bound(y, ref, mag, ck.UNIT_ROUNDOFF[precision], k)


def _moe_reference(x: torch.Tensor, raw: torch.Tensor, qtype: Q, ids: torch.Tensor):
    n_tok, top_k = ids.shape
    out = torch.empty(n_tok, top_k, raw.shape[1], dtype=torch.float64)
    mag = torch.empty_like(out)
    for t in range(n_tok):
        for s in range(top_k):
            xt = x[t, s] if x.dim() == 3 else x[t]
            r, a = reference(xt[None], raw[int(ids[t, s])], qtype)
            out[t, s], mag[t, s] = r[0], a[0]
    return out, mag


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("per_slot", [False, True], ids=["shared-x", "per-slot-x"])
def test_moe_gemv_matches_reference(qtype: Q, per_slot: bool) -> None:
    experts, n, k, n_tok, top_k = 5, 48, k_for(qtype, 8), 3, 4
    raw = random_rows(qtype, experts * n, k, seed=2).view(experts, n, -1).to(DEVICE)
    ids = _ids(n_tok, top_k, experts, 3).to(DEVICE)
    shape = (n_tok, top_k, k) if per_slot else (n_tok, k)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    y = ck.moe_linear(x, raw, qtype, ids)
    assert y.shape == (n_tok, top_k, n)
    assert_close(y, _moe_reference(x.cpu(), raw.cpu(), qtype, ids.cpu())[0])


@pytest.mark.parametrize(
    "qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.IQ4_XS, Q.F16] if _INTERPRET else TYPES, ids=lambda t: t.name
)
@pytest.mark.parametrize("skewed", [False, True], ids=["spread", "one-expert"])
@pytest.mark.parametrize("precision", ["ieee", "auto"])
def test_moe_gemm_groups_by_expert(qtype: Q, skewed: bool, precision: str) -> None:
    experts, n, k, n_tok, top_k = 6, 40, k_for(qtype, 1), 40 if not skewed else 70, 2
    raw = random_rows(qtype, experts * n, k, seed=6).view(experts, n, -1).to(DEVICE)
    ids = _ids(n_tok, top_k, experts, 7)
    if skewed:  # one expert takes more than a 64-pair tile; the others none
        ids[:, 0] = 4
        ids[:, 1] = 4
    ids = ids.to(DEVICE)
    x = torch.randn(n_tok, top_k, k, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    y = ck.moe_linear(x, raw, qtype, ids, precision=precision)
    assert_close(y, _moe_reference(x.cpu(), raw.cpu(), qtype, ids.cpu())[0])
    if not _INTERPRET and precision == "ieee":
        y16 = ck.moe_linear(x, raw, qtype, ids, precision="bf16")
        ref, mag = _moe_reference(x.cpu(), raw.cpu(), qtype, ids.cpu())
        assert_rounding_bound(y16, ref, mag, ck.UNIT_ROUNDOFF["bf16"], k)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0], ids=lambda t: t.name)
def test_word_kernel_choice(qtype: Q) -> None:
    k = 512
    raw = random_rows(qtype, 4, k).to(DEVICE)
    assert (ck._as_words(qtype, raw, k) is not None) == (
        os.environ["FORGE_CUDA_WORDS"] == "all" or qtype == Q.Q6_K
    )
    assert ck._as_words(qtype, raw, k - 32) is None or qtype != Q.Q8_0


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q5_K], ids=lambda t: t.name)
def test_gemv_tile_configurations_agree(qtype: Q) -> None:
    """Other rows-per-program / warps / K splits than the defaults (the benchmark's sweep) stay exact."""
    experts, n, k = 3, 40, 2048
    raw = random_rows(qtype, experts * n, k, seed=9).view(experts, n, -1).to(DEVICE)
    ids = torch.tensor([[2, 0, 2]], dtype=torch.int32, device=DEVICE)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(10)).to(DEVICE)
    ref = _moe_reference(x.cpu(), raw.cpu(), qtype, ids.cpu())[0]
    for bn, warps, split in ((8, 2, 4), (32, 4, 8), (16, 4, 1)):
        with ck.configured(ck.GEMV_CONFIG, bn=bn, warps=warps, split=split):
            assert_close(ck.moe_linear(x, raw, qtype, ids), ref)
            assert_close(ck.linear(x, raw[0], qtype), ref[0, 1][None])


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("precision", ["auto", "ieee"])
def test_gemm_split_k_agrees(qtype: Q, precision: str) -> None:
    """K split in 2 or 4 parts (programs of their own, partial sums added after; the sweep's option) keeps
    dense and grouped-by-expert products float32-accurate; a split that does not divide K falls back to one."""
    experts, n, k, n_tok, top_k = 4, 40, k_for(qtype, 4), 40, 2  # 80 pairs: the GEMM, not the GEMV
    raw = random_rows(qtype, experts * n, k, seed=11).view(experts, n, -1).to(DEVICE)
    ids = _ids(n_tok, top_k, experts, 12).to(DEVICE)
    x = torch.randn(n_tok, k, generator=torch.Generator().manual_seed(13)).to(DEVICE)
    ref = _moe_reference(x.cpu(), raw.cpu(), qtype, ids.cpu())[0]
    dense_ref = reference(x.cpu(), raw[1].cpu(), qtype)[0]
    for split in (2, 4, 3):
        with ck.configured(ck.GEMM_CONFIG, split=split):
            assert_close(ck.moe_linear(x, raw, qtype, ids, precision=precision), ref)
            assert_close(ck.linear(x, raw[1], qtype, precision=precision), dense_ref)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("precision", ["bf16x3", "bf16x2", "fp16x2"])
def test_gemm_on_split_x_agrees(qtype: Q, precision: str) -> None:
    """x split once into bfloat16 parts (and group sums), or for fp16x2 (Q4_K, Q5_K; the others take bf16x3)
    into float16 parts of x times a power of two per row, with the weight rows as the product's rows: routed
    products with x shared by a token's slots and one x per slot (rows from 1e-6 to 1e6), and dense ones, at
    16- and 32-pair tiles."""
    experts, n, k, n_tok, top_k = 4, 40, k_for(qtype, 2), 40, 2
    raw = random_rows(qtype, experts * n, k, seed=14).view(experts, n, -1).to(DEVICE)
    ids = _ids(n_tok, top_k, experts, 15).to(DEVICE)
    x = torch.randn(n_tok, k, generator=torch.Generator().manual_seed(16)).to(DEVICE)
    xs = torch.randn(n_tok, top_k, k, generator=torch.Generator().manual_seed(17)).to(DEVICE)
    xs *= torch.logspace(-6, 6, n_tok * top_k).view(n_tok, top_k, 1).to(DEVICE)
    raw9 = random_rows(qtype, 24, k_for(qtype, 9), seed=18).to(DEVICE)
    x9 = torch.randn(n_tok, k_for(qtype, 9), generator=torch.Generator().manual_seed(19)).to(DEVICE)
    cases = [
        (lambda: ck.moe_linear(x, raw, qtype, ids, precision=precision), _moe_reference(x, raw, qtype, ids)),
        (
            lambda: ck.moe_linear(xs, raw, qtype, ids, precision=precision),
            _moe_reference(xs, raw, qtype, ids),
        ),
        (lambda: ck.linear(x, raw[1], qtype, precision=precision), reference(x, raw[1], qtype)),
        (lambda: ck.linear(x9, raw9, qtype, precision=precision), reference(x9, raw9, qtype)),  # rows > 1,024
    ]
    for bm in (16, 32):
        with ck.configured(ck.GEMM_CONFIG, xt=1, bm=bm):
            for run, (ref, mag) in cases:
                if precision == "bf16x3":
                    assert_close(run(), ref)
                else:
                    assert_rounding_bound(run(), ref, mag, ck.UNIT_ROUNDOFF[precision], k)


def test_products_over_the_same_ids_share_one_grouping(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer's gate/up and down products group the pairs by expert once (``groups``), with the results of
    grouping each on its own."""
    experts, n, k, n_tok, top_k = 4, 40, k_for(Q.Q4_K, 2), 40, 2
    up = random_rows(Q.Q4_K, experts * n, k, seed=18).view(experts, n, -1).to(DEVICE)
    down = random_rows(Q.Q4_K, experts * k, 256, seed=19).view(experts, k, -1).to(DEVICE)
    ids = _ids(n_tok, top_k, experts, 20).to(DEVICE)
    x = torch.randn(n_tok, k, generator=torch.Generator().manual_seed(21)).to(DEVICE)
    act = torch.randn(n_tok, top_k, 256, generator=torch.Generator().manual_seed(22)).to(DEVICE)
    alone = ck.moe_linear(x, up, Q.Q4_K, ids), ck.moe_linear(act, down, Q.Q4_K, ids)
    calls = []
    group = ck._group_by_expert
    monkeypatch.setattr(ck, "_group_by_expert", lambda *a: calls.append(1) or group(*a))
    groups: dict = {}
    shared = (
        ck.moe_linear(x, up, Q.Q4_K, ids, groups=groups),
        ck.moe_linear(act, down, Q.Q4_K, ids, groups=groups),
    )
    assert len(calls) == 1
    assert all(torch.equal(a, b) for a, b in zip(alone, shared, strict=True))


@pytest.mark.parametrize(
    ("experts", "n_tok", "top_k", "bm"), [(5, 4, 2, 2), (128, 300, 8, 16), (256, 512, 8, 32), (3, 1, 1, 64)]
)
def test_group_by_expert_tiles_cover_every_pair_once(experts: int, n_tok: int, top_k: int, bm: int) -> None:
    """The grouping kernel on a hand-made case and on random routing past one 1,024-pair block of its table:
    every pair in one tile of its expert (``assert_tiles_cover``), and the table of the torch operations
    that serve larger pools, value for value."""
    if experts == 5:
        ids = torch.tensor([[3, 3], [0, 3], [3, 1], [3, 3]], dtype=torch.int32)
    else:
        ids = _ids(n_tok, top_k, experts, experts)
    maps = ck._group_by_expert(ids.to(DEVICE), experts, bm=bm)
    assert_tiles_cover(ids, experts, bm, maps)
    n_tiles = maps[1].numel()
    ops = ck._group_by_expert_ops(ids.to(DEVICE).view(-1), experts, bm, n_tiles)
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(maps, ops, strict=True))


def test_type_without_kernel_falls_back_to_torch() -> None:
    qtype, n, k = Q.Q4_0, 24, 64
    assert not ck.supports(qtype)
    raw = random_rows(qtype, n, k).to(DEVICE)
    x = torch.randn(2, k).to(DEVICE)
    assert_close(ck.linear(x, raw, qtype), reference(x, raw, qtype)[0])
