"""8-bit activations for the CPU kernels' Q4_K rows (``runtime.cpu_q8``, ``--q8-activations``): llama.cpp's Q8_K
quantization of the input and its integer block products, against the torch path's own Q8_K rounding
(``runtime.layers._round_q8_k``, the ``--ggml-numerics`` reference) and the dequantized weights."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from numba import njit

from runtime import cpu_kernels as ck
from runtime import cpu_q8
from runtime.cpu_rows import FLOAT_ACTS, Q8_ACTS, dot_row, prepare_input
from runtime.dequant import dequantize
from runtime.layers import _round_q8_k


def _input(n: int, seed: int) -> np.ndarray:
    """Values over several orders of magnitude, a block of zeros, ties at the largest magnitude."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * np.exp(2 * rng.standard_normal(n))).astype(np.float32)
    x[256:512] = 0
    x[600], x[700] = 50.0, -50.0  # two values of the block's largest magnitude: the first one sets the scale
    return x


def test_q8_k_form_is_the_torch_paths_rounding() -> None:
    n = 1024
    x = _input(n, 1)
    xp = prepare_input(x, Q8_ACTS)
    nb = n // 256
    d_at, s_at, c_at = cpu_q8.layout(n)
    assert xp.shape == (n // 32 + nb + n // 64 + n // 4,) and 4 * xp.shape[0] == c_at + n
    assert np.array_equal(xp[: n // 32], prepare_input(x, FLOAT_ACTS))  # the float sums come first either way
    scales = xp[d_at : d_at + nb]
    sums = xp.view(np.int16)[s_at // 2 : c_at // 2]
    codes = xp.view(np.int8)[c_at:].astype(np.float32)
    assert codes.max() <= 127 and codes.min() >= -127
    assert scales[1] == 0 and not codes[256:512].any()
    dequantized = (codes.reshape(nb, 256) * scales[:, None]).reshape(-1)
    assert np.array_equal(dequantized, _round_q8_k(torch.from_numpy(x)).numpy())
    assert np.array_equal(sums, codes.reshape(-1, 32).sum(1))


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_rows_times_q8_input_equal_ggml_numerics(name: str) -> None:
    from forge.quant.types import get_type

    n, rows, qtype = 1024, 40, Q[name]
    rng = np.random.default_rng(2)
    raw = get_type(qtype).encode(rng.standard_normal((rows, n)).astype(np.float32))
    w = dequantize(torch.from_numpy(raw), qtype, n).double().numpy()
    x = _input(n, 3)
    want = w @ _round_q8_k(torch.from_numpy(x)).double().numpy()
    xp, buf = prepare_input(x, Q8_ACTS), np.empty(n, np.float32)
    got = np.array([dot_row(raw[r], int(qtype), x, xp, buf) for r in range(rows)])
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()
    exact = w @ x.astype(np.float64)  # what the float32 path computes: the rounding moved the result
    assert np.abs(got - exact).max() > 1e-4 * np.abs(exact).max()


@njit
def _block(avx2: bool, five: bool, b: np.ndarray, xp: np.ndarray) -> tuple[int, int]:
    if avx2:
        return cpu_q8._block5_avx2(b, 0, xp, 0, 16) if five else cpu_q8._block4_avx2(b, 0, xp, 0, 16)
    return cpu_q8._block5_loop(b, 0, xp, 0, 16) if five else cpu_q8._block4_loop(b, 0, xp, 0, 16)


@pytest.mark.parametrize("five", [False, True], ids=["Q4_K", "Q5_K"])
def test_block_products_are_exact_on_both_implementations(five: bool) -> None:
    """The AVX2 form (where this host has it) and the plain loops give the exact integer sums (scales times
    quant-code products, mins times code sums), at the extremes too (quant 15 / 31 x code -127 everywhere,
    every six-bit scale and min 63)."""
    from runtime.dequant_kquants import _scales_mins_k4

    rng = np.random.default_rng(4)
    size, qs_at = (176, 48) if five else (144, 16)
    for trial in range(20):
        b = rng.integers(0, 256, size, dtype=np.uint8)
        codes = rng.integers(-127, 128, 256).astype(np.int8)
        if trial == 0:
            b[4:], codes[:] = 255, -127
        sums = codes.astype(np.int64).reshape(8, 32).sum(1)
        xp = np.concatenate([sums.astype(np.int16).view(np.float32), codes.view(np.float32)])
        sc, mn = (a[0].numpy().astype(np.int64) for a in _scales_mins_k4(torch.from_numpy(b[4:16][None])))
        qs = b[qs_at:].reshape(4, 32).astype(np.int64)
        q = np.stack([qs & 15, qs >> 4], 1).reshape(8, 32)
        if five:
            q |= ((b[16:48].astype(np.int64)[None, :] >> np.arange(8)[:, None]) & 1) << 4
        want = (int(sc @ (q * codes.reshape(8, 32)).sum(1)), int(mn @ sums))
        assert _block(False, five, b, xp) == want
        if cpu_q8._AVX2:
            assert _block(True, five, b, xp) == want


def test_the_option_switches_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FORGE_Q8_ACTIVATIONS", raising=False)
    raw = np.zeros((2, 144), np.uint8)
    assert ck.Rows.encoded_parts([(raw, int(Q.Q4_K))]).acts != Q8_ACTS
    monkeypatch.setenv("FORGE_Q8_ACTIVATIONS", "1")
    assert ck.Rows.encoded_parts([(raw, int(Q.Q4_K))]).acts == Q8_ACTS
    experts = np.zeros((2, 256, 144), np.uint8)
    assert ck.EncodedExperts(experts, int(Q.Q4_K), experts, int(Q.Q4_K), experts, int(Q.Q4_K)).acts == Q8_ACTS


def test_a_model_decodes_with_8_bit_activations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A synthesized Q4_K model's decode logits with --q8-activations: close to the float32 path's (the
    inputs' rounding moves each product by about 1%) and not equal to them (the kernels took the path)."""
    from runtime.models import load_model
    from runtime.synth import synthesize
    from tests.test_synth import TINY

    path = tmp_path / "model.gguf"
    synthesize(path, replace(TINY, layers=2, experts=8, experts_used=2), "q4_k")
    ids = torch.randint(0, TINY.vocab, (12,), generator=torch.Generator().manual_seed(0))
    logits = {}
    for q8 in ("0", "1"):
        monkeypatch.setenv("FORGE_Q8_ACTIVATIONS", q8)
        model = load_model(path)
        state = model.new_state()
        model.forward(ids[:8], state)
        logits[q8] = torch.cat([model.forward(ids[i : i + 1], state, last_only=True) for i in range(8, 12)])
    scale = logits["0"].abs().max()
    deviation = (logits["1"] - logits["0"]).abs().max() / scale
    assert 0 < deviation < 0.05, deviation


@njit
def _block6(avx2: bool, b: np.ndarray, xp: np.ndarray) -> int:
    if avx2:
        return cpu_q8._block6_avx2(b, 0, xp, 0)
    return cpu_q8._block6_loop(b, 0, xp, 0)


def _q6_values(b: np.ndarray) -> np.ndarray:
    """A Q6_K block's 256 quants (0..63) in value order, from ggml's layout."""
    q = np.empty(256, np.int64)
    for h in range(2):
        ql, qh = b[64 * h : 64 * h + 64].astype(np.int64), b[128 + 32 * h : 160 + 32 * h].astype(np.int64)
        y = 128 * h
        q[y : y + 32] = (ql[:32] & 15) | ((qh & 3) << 4)
        q[y + 32 : y + 64] = (ql[32:] & 15) | (((qh >> 2) & 3) << 4)
        q[y + 64 : y + 96] = (ql[:32] >> 4) | (((qh >> 4) & 3) << 4)
        q[y + 96 : y + 128] = (ql[32:] >> 4) | (((qh >> 6) & 3) << 4)
    return q


def test_q6_k_block_products_are_exact_on_both_implementations() -> None:
    """Q6_K: sum over 16-value groups of the signed scale times (q - 32) x code, exact, at the extremes too
    (the layout read here checked against the dequantizer's)."""
    rng = np.random.default_rng(5)
    for trial in range(20):
        b = rng.integers(0, 256, 210, dtype=np.uint8)
        b[208:210] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
        codes = rng.integers(-127, 128, 256).astype(np.int8)
        if trial == 0:
            b[:192], b[192:208], codes[:] = 255, 128, -127  # q 63, scale -128
        if trial == 1:
            b[:192], b[192:208], codes[:] = 0, 127, 127  # q 0 (-32 after the offset), scale 127
        q, scales = _q6_values(b), np.repeat(b[192:208].view(np.int8).astype(np.int64), 16)
        decoded = dequantize(torch.from_numpy(b[None]), Q.Q6_K, 256).double().numpy()[0]
        assert np.array_equal(decoded, 0.5 * scales * (q - 32))
        want = int(((q - 32) * scales) @ codes.astype(np.int64))
        xp = codes.view(np.float32)
        assert _block6(False, b, xp) == want
        if cpu_q8._AVX2:
            assert _block6(True, b, xp) == want


def test_the_cli_option_runs_a_model_and_refuses_other_devices(tmp_path: Path) -> None:
    from runtime.synth import synthesize
    from tests.test_experts import _forge as forge
    from tests.test_synth import TINY

    path = tmp_path / "model.gguf"
    synthesize(path, TINY, "q4_k")
    ok = forge("run", str(path), "-p", "hello", "-n", "4", "--q8-activations")
    assert ok.returncode == 0, ok.stderr
    assert "decode: 4 tokens" in ok.stderr
    bad = forge("run", str(path), "-p", "hello", "-n", "4", "--q8-activations", "--device", "mps")
    assert bad.returncode != 0
    assert "--q8-activations is for --device cpu" in bad.stderr and "Traceback" not in bad.stderr
    hybrid = forge("run", str(path), "-p", "hello", "-n", "4", "--q8-activations", "--device", "cuda",
                   "--gpu-expert-cache", "1G")  # fmt: skip
    if not torch.cuda.is_available():  # accepted with a GPU expert cache: what stops it here is the device
        assert hybrid.returncode != 0 and "Traceback" not in hybrid.stderr
        assert "no CUDA device" in hybrid.stderr and "--q8-activations" not in hybrid.stderr


def test_hybrid_cpu_side_takes_8_bit_activations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the option, the hybrid executor's CPU-side experts multiply on Q8_K inputs (the records its decode
    steps hand the step kernel say so), and the logits stay within 5% of the float32 path's scale."""
    from runtime import cpu_kernels
    from runtime.hybrid import Rates
    from runtime.synth import synthesize
    from tests.test_hybrid import _hybrid
    from tests.test_synth import TINY

    path = tmp_path / "model.gguf"
    synthesize(path, TINY, "q4_k")

    seen: list[bool] = []
    step = cpu_kernels.routed_ffn_into

    def spy(x, ids, weights, experts, h, act, out):  # noqa: ANN001, ANN202
        seen.append(experts.acts == Q8_ACTS)
        return step(x, ids, weights, experts, h, act, out)

    monkeypatch.setattr(cpu_kernels, "routed_ffn_into", spy)

    def decode(q8: str) -> tuple[torch.Tensor, int]:
        monkeypatch.setenv("FORGE_Q8_ACTIVATIONS", q8)
        seen.clear()
        m, h = _hybrid(path, slots=2, rates=Rates.never())
        state = m.new_state(32)
        ids = torch.randint(0, m.vocab_size, (12,), generator=torch.Generator().manual_seed(3))
        m.forward(ids[:4], state)
        out = torch.cat([m.forward(ids[i : i + 1], state) for i in range(4, 12)])
        return out, h.stats.cpu_pairs

    base, cpu_pairs = decode("0")
    assert cpu_pairs > 0 and seen and not any(seen)
    q8, _ = decode("1")
    assert seen and all(seen)
    diff = float((q8 - base).abs().max())
    assert 1e-6 * float(base.abs().max()) < diff <= 0.05 * float(base.abs().max())
