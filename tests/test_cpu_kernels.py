"""The compiled one-token CPU kernels (runtime.cpu_kernels) against plain torch on random inputs."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from forge import ggml_types
from runtime import cpu_kernels as ck
from runtime.moe import softmax_top_k

pytest.importorskip("numba")


def _rand(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()).float()


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5) -> None:
    assert got.shape == want.shape
    assert (got - want).abs().max() <= rtol * want.abs().max(), (got - want).abs().max()


def _rows(w: torch.Tensor, kind: str) -> tuple[ck.Rows, torch.Tensor]:
    """w as the kernels' rows of ``kind`` (F32: float32 rows; a ggml type: w encoded in it, kept as bytes) and
    the weight those rows hold (w, or its encoding decoded). A width the type's blocks do not divide stays F32."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as Q

    from forge.quant.types import get_type
    from runtime.dequant import dequantize

    if kind == "F32" or w.shape[-1] % GGML_QUANT_SIZES[Q[kind]][0]:
        return ck.Rows.floats(w.numpy()), w
    raw = get_type(kind).encode(w.numpy(), None)
    return ck.Rows.encoded_parts([(raw, int(Q[kind]))]), dequantize(
        torch.from_numpy(raw), Q[kind], w.shape[-1]
    )


ROW_KINDS = ["F32", "Q8_0", "Q4_K"]


@pytest.mark.parametrize("rows", [1, 7, 64, 512, 3000])  # serial and threaded variants
@pytest.mark.parametrize("residual", [False, True])
def test_gemv_equals_matmul(rows: int, residual: bool) -> None:
    n_in = 96
    w, x = _rand(rows, n_in, seed=1), _rand(1, n_in, seed=2)
    res = _rand(1, rows, seed=3) if residual else None
    got = ck.gemv(x, ck.Rows.floats(w.numpy()), res)
    want = (x.double() @ w.double().T + (0 if res is None else res.double())).float()
    _close(got, want)


@pytest.mark.parametrize("rows", [32, 4096])
def test_norm_gemv_equals_rms_norm_then_matmul(rows: int) -> None:
    h, norm, w = _rand(1, 256, seed=4, scale=30.0), _rand(256, seed=5), _rand(rows, 256, seed=6)
    x, y = ck.norm_gemv(h, norm.numpy(), 1e-6, ck.Rows.floats(w.numpy()))
    want_x = _rms(h, norm, 1e-6)
    _close(x, want_x)
    _close(y, (want_x.double() @ w.double().T).float())


def _routed_reference(x, logits, k, gate_up, down, h):  # noqa: ANN001, ANN202
    top, ids = torch.topk(logits[0], k)
    w = torch.softmax(top.double(), -1)
    n_ff = down.shape[2]
    out = h.double().clone()
    acts = []
    for i, e in enumerate(ids.tolist()):
        gu = x.double() @ gate_up[e].double().T
        act = F.silu(gu[:, :n_ff]) * gu[:, n_ff:]
        acts.append(act)
        out += w[i] * (act @ down[e].double().T)
    return out.float(), ids, w.float(), torch.cat(acts).float()


@pytest.mark.parametrize("k", [1, 4, 8])
def test_routed_ffn_equals_topk_softmax_swiglu(k: int) -> None:
    n_expert, n_ff, n_embd = 16, 48, 64
    gate_up, down = _rand(n_expert, 2 * n_ff, n_embd, seed=7), _rand(n_expert, n_embd, n_ff, seed=8)
    x, h, logits = _rand(1, n_embd, seed=9), _rand(1, n_embd, seed=10), _rand(1, n_expert, seed=11)
    ids, w = (t[0] for t in softmax_top_k(logits, k))  # routed outside the kernels (runtime.moe.Router)
    out, act = ck.routed_ffn(x, ids, w, gate_up.numpy(), down.numpy(), h)
    want, want_ids, want_w, want_act = _routed_reference(x, logits, k, gate_up, down, h)
    assert torch.equal(ids, want_ids)
    _close(w, want_w)
    _close(act, want_act)
    _close(out, want)


def test_routed_ffn_skips_masked_experts_and_breaks_ties_by_index() -> None:
    n_expert, n_ff, n_embd = 8, 32, 32
    gate_up, down = _rand(n_expert, 2 * n_ff, n_embd, seed=12), _rand(n_expert, n_embd, n_ff, seed=13)
    logits = torch.full((1, n_expert), -1e30)
    logits[0, [6, 2, 5]] = torch.tensor([0.5, 0.5, 1.0])
    ids, w = (t[0] for t in softmax_top_k(logits, 3))  # the router's choice, given to the kernel
    assert ids.tolist() == [5, 2, 6]
    _close(w, torch.softmax(torch.tensor([1.0, 0.5, 0.5]), -1))
    x, h = _rand(1, n_embd), _rand(1, n_embd)
    out, _ = ck.routed_ffn(x, ids, w, gate_up.numpy(), down.numpy(), h)
    want = _routed_reference(x, logits, 3, gate_up, down, h)[0]
    _close(out, want)


def _attention_reference(h, norm, eps, w_in, n_head, n_gate, qk_norm, cos, sin, keys, values, pos, w_out):  # noqa: ANN001, ANN202, PLR0913
    n_kv, _, d = keys.shape
    x = _rms(h, norm, eps)
    y = (x.double() @ w_in.double().T).float()[0]
    n_qk = n_head + n_kv
    qk = _rms(y[: n_qk * d].view(n_qk, d), qk_norm, eps)
    half = cos.shape[0]
    a, b = qk[:, :half].clone(), qk[:, half : 2 * half].clone()
    qk[:, :half], qk[:, half : 2 * half] = a * cos - b * sin, b * cos + a * sin
    v0 = n_qk * d + n_gate
    keys[:, pos], values[:, pos] = qk[n_head:], y[v0:].view(n_kv, d)
    q = qk[:n_head].double().view(n_kv, n_head // n_kv, d)
    p = torch.softmax(q @ keys[:, : pos + 1].double().transpose(1, 2), -1)
    att = (p @ values[:, : pos + 1].double()).reshape(1, -1)
    if n_gate:
        att = att * torch.sigmoid(y[n_qk * d : n_qk * d + n_gate].double())
    return (h.double() + att @ w_out.double().T).float(), x, att.float()


@pytest.mark.parametrize("kind", ROW_KINDS)
@pytest.mark.parametrize(
    ("n_head", "n_kv", "n_rot", "gated", "pos"),
    [(4, 2, 64, False, 0), (4, 2, 32, True, 37), (8, 8, 64, False, 200)],
)
def test_attention_step_equals_reference(
    n_head: int, n_kv: int, n_rot: int, gated: bool, pos: int, kind: str
) -> None:
    d, n_embd = 64, 256
    n_gate = n_head * d if gated else 0
    rows_in, w_in = _rows(_rand((n_head + 2 * n_kv) * d + n_gate, n_embd, seed=14, scale=0.1), kind)
    rows_out, w_out = _rows(_rand(n_embd, n_head * d, seed=15, scale=0.1), kind)
    h, norm = _rand(1, n_embd, seed=16), _rand(n_embd, seed=17)
    qk_norm = _rand(n_head + n_kv, d, seed=18)
    ang = torch.rand(n_rot // 2, generator=torch.Generator().manual_seed(19)) * 6
    cos, sin = ang.cos(), ang.sin()
    keys, values = _rand(n_kv, 256, d, seed=20), _rand(n_kv, 256, d, seed=21)
    ref_k, ref_v = keys.clone(), values.clone()
    out, x, att = ck.attention_step(
        h,
        norm,
        1e-6,
        rows_in,
        n_head,
        n_gate,
        qk_norm.numpy(),
        (cos, sin),
        keys,
        values,
        pos,
        rows_out,
    )
    want, want_x, want_att = _attention_reference(
        h, norm, 1e-6, w_in, n_head, n_gate, qk_norm, cos, sin, ref_k, ref_v, pos, w_out
    )
    _close(keys, ref_k)
    _close(values, ref_v)
    _close(x, want_x)
    _close(att, want_att)
    _close(out, want)
    assert torch.equal(keys[:, pos + 1 :], ref_k[:, pos + 1 :])


def test_available_follows_device_and_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ck.available(torch.device("cpu"))
    assert not ck.available(torch.device("meta"))
    monkeypatch.setenv("FORGE_NO_NUMBA", "1")
    assert not ck.available(torch.device("cpu"))


def _deltanet_reference(h, norm, eps, w_in, n_k, conv, conv_w, dt_bias, a, out_norm, s, w_out):  # noqa: ANN001, ANN202, PLR0913
    n_v, d_k, d_v = s.shape
    channels, key_dim = conv.shape[1], n_k * d_k
    x = _rms(h, norm, eps).double()
    y = (x @ w_in.double().T)[0]
    window = torch.cat([conv.double(), y[None, :channels]])
    c = F.silu((window * conv_w.double()).sum(0))
    qk = c[: 2 * key_dim].view(2 * n_k, d_k)
    qk = qk / qk.norm(dim=-1, keepdim=True).clamp_min(eps)
    q, k = qk[:n_k] * d_k**-0.5, qk[n_k:]
    v = c[2 * key_dim :].view(n_v, d_v)
    z = y[channels : channels + n_v * d_v].view(n_v, d_v)
    beta = torch.sigmoid(y[channels + n_v * d_v : channels + n_v * d_v + n_v])
    g = F.softplus(y[channels + n_v * d_v + n_v :] + dt_bias.double()) * a.double()
    s = s.double() * torch.exp(g)[:, None, None]
    kt, qt = k[torch.arange(n_v) % n_k], q[torch.arange(n_v) % n_k]
    delta = (v - torch.einsum("hk,hkv->hv", kt, s)) * beta[:, None]
    s = s + kt[:, :, None] * delta[:, None, :]
    o = torch.einsum("hk,hkv->hv", qt, s)
    o = _rms(o.float(), out_norm, eps).double() * F.silu(z)
    out = h.double() + o.reshape(1, -1) @ w_out.double().T
    return out.float(), window[1:].float(), s.float(), o.reshape(1, -1).float()


@pytest.mark.parametrize("kind", ROW_KINDS)
@pytest.mark.parametrize(("n_k", "n_v"), [(2, 4), (2, 2), (1, 3)])
def test_deltanet_step_equals_reference(n_k: int, n_v: int, kind: str) -> None:
    d_k, d_v, n_embd, kernel = 16, 64, 256, 4
    channels = 2 * n_k * d_k + n_v * d_v
    rows_in, w_in = _rows(_rand(channels + n_v * d_v + 2 * n_v, n_embd, seed=22, scale=0.2), kind)
    rows_out, w_out = _rows(_rand(n_embd, n_v * d_v, seed=23, scale=0.2), kind)
    h, norm = _rand(1, n_embd, seed=24), _rand(n_embd, seed=25)
    conv, conv_w = _rand(kernel - 1, channels, seed=26), _rand(kernel, channels, seed=27)
    dt_bias, a, out_norm = _rand(n_v, seed=28), -_rand(n_v, seed=29).abs(), _rand(d_v, seed=30)
    s = _rand(n_v, d_k, d_v, seed=31)
    want, want_conv, want_s, want_o = _deltanet_reference(
        h, norm, 1e-6, w_in, n_k, conv, conv_w, dt_bias, a, out_norm, s, w_out
    )
    out, x, o = ck.deltanet_step(
        h, norm, 1e-6, rows_in, n_k, conv, conv_w.numpy(), dt_bias, a, out_norm, s, rows_out
    )
    _close(x, _rms(h, norm, 1e-6))
    _close(conv, want_conv)
    _close(s, want_s)
    _close(o, want_o)
    _close(out, want)


@pytest.mark.parametrize("kind", ROW_KINDS)
def test_shared_ffn_equals_gated_swiglu(kind: str) -> None:
    n_ff, n_embd = 256, 256
    rows_in, w_in = _rows(_rand(2 * n_ff + 1, n_embd, seed=32, scale=0.1), kind)
    rows_down, w_down = _rows(_rand(n_embd, n_ff, seed=33, scale=0.1), kind)
    x, h = _rand(1, n_embd, seed=34), _rand(1, n_embd, seed=35)
    out, act = ck.shared_ffn(x, rows_in, rows_down, h)
    y = x.double() @ w_in.double().T
    want_act = F.silu(y[:, :n_ff]) * y[:, n_ff : 2 * n_ff]
    _close(act, want_act.float())
    _close(out, (h.double() + torch.sigmoid(y[:, -1:]) * (want_act @ w_down.double().T)).float())


def test_warm_up_leaves_every_kernel_compiled_on_disk() -> None:
    ck.warm_up()
    assert ck.cached_on_disk()


def test_prepare_decode_says_when_it_compiles(example_bf16, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    from runtime.models import load_model, prepare_decode

    model = load_model(example_bf16)
    said: list[str] = []
    monkeypatch.setattr(ck, "cached_on_disk", lambda: False)
    prepare_decode(model, said.append)
    assert len(said) == 1 and said[0].startswith("compiling the CPU decode kernels")
    monkeypatch.setattr(ck, "cached_on_disk", lambda: True)
    prepare_decode(model, said.append)
    assert len(said) == 1
    model.fast_decode = False  # e.g. --ggml-numerics: no one-token kernels to prepare
    monkeypatch.setattr(ck, "cached_on_disk", lambda: False)
    prepare_decode(model, said.append)
    assert len(said) == 1


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_prepare_decode_leaves_the_loading_thread_no_openmp_team(example_bf16) -> None:  # noqa: ANN001
    """The kernels' warm-up runs on a thread of its own that exits. A thread that ran numba's parallel regions
    keeps an OpenMP team; when another thread decodes (a server's worker), that team is one too many for the
    cores and libgomp's threads then sleep between every region (an empty one: 2 -> 17 us on 2 cores). Here the
    loading thread stays alive after ``prepare_decode``, as a server's does: no team's threads may remain."""
    import subprocess
    import sys

    script = f"""
import os, threading, time
import numba
import numpy as np
from runtime.models import load_model, prepare_decode
m = load_model({str(example_bf16)!r})
def native() -> int:  # threads no Python code started: OpenMP teams' (and any other library's)
    return len(os.listdir("/proc/self/task")) - threading.active_count()
def settle() -> int:  # a finished thread's team leaves as its threads see the pool freed: wait until still
    end, last, since = time.monotonic() + 5, native(), time.monotonic()
    while time.monotonic() < end and time.monotonic() - since < 0.5:
        time.sleep(0.01)
        if native() != last:
            last, since = native(), time.monotonic()
    return last
@numba.njit(parallel=True)
def region(a):
    for i in numba.prange(a.shape[0]):
        a[i] += 1.0
first = threading.Thread(target=region, args=(np.zeros(8),))  # starts numba's pool; its team leaves with it
first.start()
first.join()
counts, hold = [settle()], threading.Event()
def loader():
    prepare_decode(m)
    counts.append(settle())
    hold.wait()
t = threading.Thread(target=loader)
t.start()
while len(counts) < 2:
    time.sleep(0.01)
print(numba.threading_layer(), *counts)
hold.set()
t.join()
"""
    env = {**os.environ, "NUMBA_NUM_THREADS": "4"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    layer, before, after = done.stdout.split()
    if layer != "omp":
        pytest.skip(f"numba's {layer} threading layer keeps one pool for the process")
    assert after == before


def test_a_loaded_model_keeps_torchs_thread_count(example_bf16) -> None:  # noqa: ANN001
    """``torch.set_num_threads(1)`` (``--threads 1``) before loading holds through a prefill and a decode step,
    for torch and the kernels alike: numba's thread pool, started by a first kernel, reset the process's
    OpenMP thread count to every core (numba's pool of 4 here, so that it shows on any machine)."""
    import subprocess
    import sys

    script = f"""
import torch
torch.set_num_threads(1)
import numba
from runtime.models import load_model
m = load_model({str(example_bf16)!r})
st = m.new_state()
m.forward(torch.arange(8), st)
m.forward(torch.tensor([8]), st, last_only=True)
print(torch.get_num_threads(), numba.get_num_threads())
"""
    env = {**os.environ, "NUMBA_NUM_THREADS": "4"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["1", "1"]


@pytest.mark.parametrize(
    ("host", "avx512", "env", "want"),
    [
        ("sapphirerapids", True, None, "skylake"),  # Intel with AVX-512: skylake tuning
        ("rocketlake", True, None, "skylake"),
        ("znver4", True, None, "None"),  # AMD: numba's own choice
        ("haswell", False, None, "None"),  # no AVX-512
        ("sapphirerapids", True, "icelake-server", "icelake-server"),  # the user's NUMBA_CPU_NAME wins
    ],
)
def test_numba_tuning_for_the_host(host: str, avx512: bool, env: str | None, want: str) -> None:
    """forge.jit's choice of LLVM tuning, made before numba builds its target (a fresh process with the
    host's name and features faked)."""
    import subprocess
    import sys

    script = f"""
import llvmlite.binding as llvm
features = llvm.get_host_cpu_features()
features["avx512f"] = {avx512}
llvm.get_host_cpu_name = lambda: {host!r}
llvm.get_host_cpu_features = lambda: features
import forge.jit
from numba.core import config
print(config.CPU_NAME)
"""
    environ = {k: v for k, v in os.environ.items() if k != "NUMBA_CPU_NAME"}
    if env:
        environ["NUMBA_CPU_NAME"] = env
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=environ, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == want


# experts kept encoded --------------------------------------------------------------------------------------


def _encoded_rows(qtype, rows: int, n: int, seed: int) -> np.ndarray:  # noqa: ANN001
    """Random rows of ``qtype``: random bytes with finite, small fp16 scales where the type's decoder says
    where they are, else random values encoded by the quantizer (float types: random values)."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as Q

    from forge.quant.types import get_type
    from runtime.synth import fp16_fields, random_blocks

    rng = np.random.default_rng(seed)
    if qtype in (Q.F32, Q.F16):
        return (
            rng.standard_normal((rows, n)).astype(np.float32 if qtype == Q.F32 else np.float16).view(np.uint8)
        )
    if qtype == Q.BF16:
        return (
            (rng.standard_normal((rows, n)).astype(np.float32).view(np.uint32) >> 16)
            .astype(np.uint16)
            .view(np.uint8)
        )
    if fp16_fields(qtype) is None:
        return get_type(qtype).encode(rng.standard_normal((rows, n)).astype(np.float32) * 0.05)
    return random_blocks(qtype, rows * n // GGML_QUANT_SIZES[qtype][0], rng, 1e-4, 0.0101).reshape(rows, -1)


@pytest.mark.parametrize("name", [t.name for t in ggml_types.types_with("cpu_rows")])
def test_decode_row_equals_dequantize(name: str) -> None:
    from gguf import GGMLQuantizationType as Q

    from runtime.cpu_rows import decode_row
    from runtime.dequant import dequantize

    qtype = Q[name]
    raw = _encoded_rows(qtype, 6, 512, seed=40)
    want = dequantize(torch.from_numpy(raw), qtype, 512).numpy()
    got = np.empty(512, np.float32)
    for r in range(raw.shape[0]):
        decode_row(raw[r], int(qtype), got)
        assert np.array_equal(got.view(np.uint32), want[r].view(np.uint32)), (name, r)


@pytest.mark.parametrize(
    "types",
    [
        ("Q4_K", "Q4_K", "Q6_K"),
        ("Q8_0", "Q8_0", "Q8_0"),
        ("BF16", "BF16", "Q5_K"),
        ("MXFP4", "MXFP4", "Q8_0"),
    ],
)
def test_routed_ffn_encoded_equals_decoded(types: tuple[str, str, str]) -> None:
    from gguf import GGMLQuantizationType as Q

    from runtime.dequant import dequantize

    n_expert, n_ff, n_embd, k = 8, 256, 256, 3
    qt = [Q[t] for t in types]
    gate = _encoded_rows(qt[0], n_expert * n_ff, n_embd, 41).reshape(n_expert, n_ff, -1)
    up = _encoded_rows(qt[1], n_expert * n_ff, n_embd, 42).reshape(n_expert, n_ff, -1)
    down = _encoded_rows(qt[2], n_expert * n_embd, n_ff, 43).reshape(n_expert, n_embd, -1)
    x, h, logits = _rand(1, n_embd, seed=44), _rand(1, n_embd, seed=45), _rand(1, n_expert, seed=46)
    experts = ck.EncodedExperts(gate, qt[0], up, qt[1], down, qt[2])
    ids, w = (t[0] for t in softmax_top_k(logits, k))  # routed outside the kernels (runtime.moe.Router)
    out, act = ck.routed_ffn_encoded(x, ids, w, experts, h)
    dec = [
        dequantize(torch.from_numpy(a), t, c)
        for a, t, c in zip((gate, up, down), qt, (n_embd, n_embd, n_ff), strict=True)
    ]
    want, want_ids, want_w, want_act = _routed_reference(x, logits, k, torch.cat(dec[:2], dim=1), dec[2], h)
    assert torch.equal(ids, want_ids)
    _close(w, want_w)
    _close(act, want_act)
    _close(out, want)
    # a gate|up tensor stored fused: the two halves are strided views of one array
    fused = np.concatenate([gate, up], axis=1) if qt[0] == qt[1] else None
    if fused is not None:
        halves = ck.EncodedExperts(fused[:, :n_ff], qt[0], fused[:, n_ff:], qt[1], down, qt[2])
        assert torch.equal(ck.routed_ffn_encoded(x, ids, w, halves, h)[0], out)


def test_expert_chunks_spread_a_few_experts_over_every_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """One expert's 512 gate/up rows on 16 threads: at least one work item per thread (at 64 rows an item, 8
    of 16 threads had none); the bytes do not depend on how the rows are cut."""
    from gguf import GGMLQuantizationType as Q

    for threads in (1, 2, 16, 64):
        for rows in (256, 512, 4096):
            items = [
                -(-n // c) for n, c in zip((rows, 2048), ck.expert_chunks(rows, 2048, threads), strict=True)
            ]
            assert all(i >= min(threads, n // 4) for i, n in zip(items, (rows, 2048), strict=True)), (
                threads,
                rows,
            )
            assert all(4 <= c <= 64 for c in ck.expert_chunks(rows, 2048, threads))
    n_expert, n_ff, n_embd = 4, 256, 256
    gate = _encoded_rows(Q.Q4_K, n_expert * n_ff, n_embd, 51).reshape(n_expert, n_ff, -1)
    down = _encoded_rows(Q.Q6_K, n_expert * n_embd, n_ff, 52).reshape(n_expert, n_embd, -1)
    experts = ck.EncodedExperts(gate, Q.Q4_K, np.ascontiguousarray(gate[::-1]), Q.Q4_K, down, Q.Q6_K)
    x, h = _rand(1, n_embd, seed=53), _rand(1, n_embd, seed=54)
    ids, w = torch.tensor([2, 0, 3]), torch.tensor([0.5, 0.3, 0.2])
    want = ck.routed_ffn_encoded(x, ids, w, experts, h)
    for chunks in ((4, 4), (5, 64), (64, 7)):
        monkeypatch.setattr(ck, "expert_chunks", lambda *_, c=chunks: c)
        got = ck.routed_ffn_encoded(x, ids, w, experts, h)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), chunks


@pytest.mark.parametrize("name", [t.name for t in ggml_types.types_with("cpu_rows")])
def test_encoded_rows_product_equals_decoded_product(name: str) -> None:
    """Every row type's dot products straight from the bytes (vectorized over a block's lanes, the next row
    prefetched), over more rows than one parallel work item and a row of several blocks; and a batch's
    product (rows decoded a chunk at a time)."""
    from gguf import GGMLQuantizationType as Q

    from runtime.dequant import dequantize

    qtype, n, rows = Q[name], 768, 150
    raw = _encoded_rows(qtype, rows, n, seed=47)
    w = dequantize(torch.from_numpy(raw), qtype, n).double()
    x, res = _rand(1, n, seed=48), _rand(1, rows, seed=49)
    rows = ck.Rows.encoded_parts([(raw, int(qtype))])
    _close(ck.gemv(x, rows), (x.double() @ w.T).float())
    _close(ck.gemv(x, rows, res), (x.double() @ w.T + res.double()).float())
    batch = _rand(5, n, seed=50)
    _close(ck.product(batch, rows), (batch.double() @ w.T).float())


def test_rows_of_mixed_types_stacked_and_permuted() -> None:
    """A stack of weights of different types (Q4_K, Q6_K, one F32 row stored 1-D), rows permuted: each row is
    multiplied by its own type's kernel, one token and a batch alike."""
    from gguf import GGMLQuantizationType as Q

    from runtime.dequant import dequantize

    n = 512
    a, b = _encoded_rows(Q.Q4_K, 70, n, seed=51), _encoded_rows(Q.Q6_K, 9, n, seed=52)
    one = _rand(n, seed=53)
    want = torch.cat(
        [dequantize(torch.from_numpy(a), Q.Q4_K, n), dequantize(torch.from_numpy(b), Q.Q6_K, n), one[None]]
    )
    order = np.random.default_rng(54).permutation(len(want))
    rows = ck.Rows.encoded_parts(
        [(a, int(Q.Q4_K)), (b, int(Q.Q6_K)), (one.numpy().view(np.uint8), int(Q.F32))], order
    )
    w = want[torch.from_numpy(order)].double()
    x, batch = _rand(1, n, seed=55), _rand(3, n, seed=56)
    assert rows.n_out == 80
    _close(ck.gemv(x, rows), (x.double() @ w.T).float())
    _close(ck.product(batch, rows), (batch.double() @ w.T).float())


def test_claimed_work_items_are_each_taken_once() -> None:
    """``claim``: the threads of a parallel region take every work item exactly once, with items of uneven cost
    (the first eight far dearer); the counter ends at the items plus one failed claim per thread."""
    from numba import get_num_threads, njit, prange

    from runtime.cpu_ir import claim

    @njit(parallel=True, nogil=True)
    def take(items: int, threads: int, taken: np.ndarray, done: np.ndarray, who: np.ndarray) -> None:
        for t in prange(threads):
            c = claim(taken, 1)
            while c < items:
                s = 0.0
                for j in range(20000 if c < 8 else 10):
                    s += np.sqrt(j + 1.0)
                done[c] += 1 if s > 0 else 2
                who[c] = t
                c = claim(taken, 1)

    threads = get_num_threads()
    for items in (0, 1, 7, 200):
        taken, done, who = np.zeros(2, np.int64), np.zeros(items, np.int64), np.full(items, -1)
        take(items, threads, taken, done, who)
        assert (done == 1).all(), items
        assert taken[0] == 0 and taken[1] == items + threads
        assert (who >= 0).all() and (who < threads).all()


def test_on_own_thread_returns_and_raises_as_a_call_does() -> None:
    import threading

    from forge.errors import ForgeError

    assert ck.on_own_thread(lambda a, b: (a + b, threading.get_ident()), 2, 3)[0] == 5
    assert ck.on_own_thread(threading.get_ident) != threading.get_ident()

    def fail() -> None:
        raise ForgeError("no such file")

    with pytest.raises(ForgeError, match="no such file"):
        ck.on_own_thread(fail)
