"""The cuda backend's prefill GEMM plan (``cuda_kernels._gemm_plan``): which kernel and precision each product
takes. Pure Python: runs without CUDA or Triton."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as Q

from runtime.backends import cuda_kernels as ck


@pytest.fixture(autouse=True)
def _no_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("FORGE_CUDA_PRECISION", "FORGE_CUDA_XT"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("moe", [True, False], ids=["routed", "dense"])
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K], ids=lambda t: t.name)
def test_auto_takes_the_super_block_kernel_for_q4_k_and_q5_k(qtype: Q, moe: bool) -> None:
    plan = ck._gemm_plan(qtype, None, moe)
    assert plan.prec == ck._PRECISIONS["fp16x2"] and plan.xt
    if moe:
        assert (plan.bn, plan.warps, plan.stages, plan.smallest_tile) == (64, 4, 3, 32)
    else:
        assert (plan.bn, plan.warps, plan.stages, plan.bm) == (128, 4, 3, 32)


@pytest.mark.parametrize(
    ("qtype", "moe", "expected"),
    [
        (Q.Q6_K, True, "bf16x3"),
        (Q.Q6_K, False, "bf16x3"),
        (Q.Q8_0, True, "bf16x3"),
        (Q.Q8_0, False, "tf32x3"),
        (Q.IQ4_XS, True, "tf32x3"),
        (Q.F16, False, "tf32x3"),
    ],
)
def test_auto_elsewhere(qtype: Q, moe: bool, expected: str) -> None:
    assert ck._gemm_plan(qtype, None, moe).prec == ck._PRECISIONS[expected]


@pytest.mark.parametrize(
    ("qtype", "expected"), [(Q.Q6_K, "bf16x3"), (Q.Q8_0, "bf16x3"), (Q.IQ4_XS, "tf32x3")]
)
def test_fp16x2_asked_of_another_type_stays_float32_accurate(qtype: Q, expected: str) -> None:
    plan = ck._gemm_plan(qtype, "fp16x2", True)
    assert plan.prec == ck._PRECISIONS[expected]


def test_the_environment_and_the_config_override_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORGE_CUDA_PRECISION", "bf16x3")
    plan = ck._gemm_plan(Q.Q4_K, None, True)
    assert plan.prec == ck._PRECISIONS["bf16x3"] and plan.xt
    monkeypatch.setenv("FORGE_CUDA_XT", "0")
    assert not ck._gemm_plan(Q.Q4_K, None, True).xt
    with ck.configured(ck.GEMM_CONFIG, bn=32, bm=16):
        plan = ck._gemm_plan(Q.Q4_K, "fp16x2", False)
    assert (plan.bn, plan.bm, plan.xt) == (32, 16, True)  # fp16x2 exists only on split x
    with pytest.raises(ValueError, match="precision must be one of"):
        ck._gemm_plan(Q.Q4_K, "fp8", True)
