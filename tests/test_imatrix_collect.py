"""The imatrix accumulator (runtime observer) and LiveImatrix (server snapshots)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from forge.errors import ForgeError
from forge.imatrix import importance_for, read_imatrix
from forge.imatrix.accumulate import ImatrixAccumulator
from forge.imatrix.live import LiveImatrix

runtime_observers = pytest.importorskip("runtime.observers")
N_EXPERT, TOP_K, D, F = 8, 2, 32, 16


class FakeMoE:
    """A two-layer random MoE that reports to observers exactly like the runtime's models do."""

    def __init__(self, observers: list, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.observers = observers
        self.router = [torch.randn(N_EXPERT, D, generator=g) for _ in range(2)]
        self.gate = [torch.randn(N_EXPERT, F, D, generator=g) / D**0.5 for _ in range(2)]
        self.down = [torch.randn(N_EXPERT, D, F, generator=g) / F**0.5 for _ in range(2)]
        self.wq = [torch.randn(D, D, generator=g) / D**0.5 for _ in range(2)]
        self.out = torch.randn(50, D, generator=g)

    def forward(self, h: torch.Tensor, allowed: int = N_EXPERT) -> torch.Tensor:
        notify_matmul, notify_routing = runtime_observers.notify_matmul, runtime_observers.notify_routing
        for layer in range(2):
            notify_matmul(self.observers, f"blk.{layer}.attn_q.weight", h)
            h = h + h @ self.wq[layer].T
            logits = h @ self.router[layer].T
            logits[:, allowed:] = -1e9  # lets a test keep the top experts unrouted
            w, ids = logits.softmax(-1).topk(TOP_K, dim=-1)
            notify_routing(self.observers, layer, ids, w, logits)
            flat = ids.reshape(-1)
            x = h.repeat_interleave(TOP_K, dim=0)  # one row per (token, slot)
            notify_matmul(self.observers, f"blk.{layer}.ffn_gate_exps.weight", x, flat)
            act = torch.nn.functional.silu(torch.einsum("rfd,rd->rf", self.gate[layer][flat], x))
            notify_matmul(self.observers, f"blk.{layer}.ffn_down_exps.weight", act, flat)
            y = torch.einsum("rdf,rf->rd", self.down[layer][flat], act) * w.reshape(-1, 1)
            h = h + y.reshape(-1, TOP_K, D).sum(1)
        notify_matmul(self.observers, "output.weight", h)
        notify_matmul(self.observers, "token_embd.weight", h)  # never collected (not blk.*)
        return h @ self.out.T


class Recorder(runtime_observers.Observer):
    """Keeps every reported input: the straightforward reference is computed from these."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, np.ndarray, np.ndarray | None]] = []

    def on_matmul_input(self, tensor_name, x, expert_ids):
        ids = None if expert_ids is None else expert_ids.numpy().copy()
        self.calls.append((tensor_name, x.numpy().astype(np.float64), ids))


def reference(calls, process_output: bool) -> tuple[dict, dict]:
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, np.ndarray] = {}
    for name, x, ids in calls:
        if not (name.startswith("blk.") or (process_output and name == "output.weight")):
            continue
        if ids is None and x.shape[0] < 16:
            continue
        n_mat = 1 if ids is None else N_EXPERT
        s = sums.setdefault(name, np.zeros((n_mat, x.shape[1])))
        c = counts.setdefault(name, np.zeros(n_mat, np.int64))
        for row in range(x.shape[0]):
            e = 0 if ids is None else ids[row]
            s[e] += x[row] ** 2
            c[e] += 1
    return sums, counts


@pytest.fixture(params=[1, 2], ids=["torch-1-thread", "numpy"])
def torch_threads(request):
    """The accumulator reduces with torch on one thread, with numpy when torch has several."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("process_output", [False, True])
def test_accumulator_matches_reference(process_output, torch_threads):
    acc, rec = ImatrixAccumulator(process_output=process_output), Recorder()
    model = FakeMoE([acc, rec])
    g = torch.Generator().manual_seed(1)
    for n_tokens in (40, 7, 64):  # the 7-token batch is below llama.cpp's 16-row minimum for plain matmuls
        model.forward(torch.randn(n_tokens, D, generator=g), allowed=N_EXPERT - 1)
    ref_sums, ref_counts = reference(rec.calls, process_output)
    im = acc.to_imatrix(["calib.txt"], chunk_count=3, chunk_size=64)
    assert im.names() == sorted(ref_sums)
    assert ("output.weight" in im.sums) == process_output and "token_embd.weight" not in im.sums
    for name in im.names():
        np.testing.assert_array_equal(im.counts[name], ref_counts[name], err_msg=name)
        np.testing.assert_allclose(im.sums[name], ref_sums[name], rtol=2e-6, atol=0, err_msg=name)
    assert im.counts["blk.0.attn_q.weight"].tolist() == [40 + 64]
    assert im.counts["blk.0.ffn_gate_exps.weight"].sum() == (40 + 7 + 64) * TOP_K
    assert im.shape("blk.1.ffn_down_exps.weight") == (N_EXPERT, F)
    assert im.counts["blk.1.ffn_down_exps.weight"][-1] == 0  # never routed, still present (count 0)


def test_accumulator_to_file_gives_mean_squares(tmp_path):
    acc, rec = ImatrixAccumulator(), Recorder()
    FakeMoE([acc, rec], seed=2).forward(torch.randn(100, D, generator=torch.Generator().manual_seed(3)))
    acc.to_imatrix(["t"], 1, 100).check()
    from forge.imatrix import write_imatrix

    write_imatrix(acc.to_imatrix(["t"], 1, 100), tmp_path / "m.gguf")
    im = read_imatrix(tmp_path / "m.gguf")
    ref_sums, ref_counts = reference(rec.calls, False)
    w = importance_for(im, "blk.0.ffn_down_exps.weight", F, N_EXPERT)
    seen = ref_counts["blk.0.ffn_down_exps.weight"] > 0
    expected = (
        ref_sums["blk.0.ffn_down_exps.weight"][seen] / ref_counts["blk.0.ffn_down_exps.weight"][seen, None]
    )
    np.testing.assert_allclose(w[seen], expected, rtol=2e-6)


def test_accumulator_refuses_bad_inputs():
    acc = ImatrixAccumulator(n_experts=4)
    x = torch.ones(20, 8)
    with pytest.raises(ForgeError, match="expert ids"):
        acc.on_matmul_input("blk.0.ffn_up_exps.weight", x, torch.zeros(3, dtype=torch.long))
    acc.on_routing(0, torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 4))
    with pytest.raises(ForgeError, match="out of range"):
        acc.on_matmul_input("blk.0.ffn_up_exps.weight", x, torch.full((20,), 4))
    acc.on_matmul_input("blk.0.attn_q.weight", x, None)
    with pytest.raises(ForgeError, match="columns"):
        acc.on_matmul_input("blk.0.attn_q.weight", torch.ones(20, 9), None)
    acc.on_matmul_input("blk.0.attn_k.weight", torch.full((20, 8), float("inf")), None)
    with pytest.raises(ForgeError, match="non-finite"):
        acc.to_imatrix()


def test_accumulator_shares_one_input_only_when_unchanged(torch_threads):
    """q/k/v (and gate/up) fed one tensor are reduced once; an in-place write or a repeat recomputes."""
    acc = ImatrixAccumulator()
    x = torch.randn(20, 8, generator=torch.Generator().manual_seed(4))
    acc.on_matmul_input("blk.0.attn_q.weight", x, None)
    x.mul_(2)  # the same storage, rewritten: must not reuse the previous reduction
    acc.on_matmul_input("blk.0.attn_k.weight", x, None)
    acc.on_matmul_input("blk.0.attn_v.weight", x, None)
    acc.on_matmul_input("blk.0.attn_v.weight", x, None)  # a second call of the same tensor is new data
    acc.on_matmul_input("blk.1.attn_q.weight", x, None)  # another layer: computed again (same values)
    s = acc.to_imatrix().sums
    q = (x.double() / 2).square().sum(0).numpy()
    np.testing.assert_allclose(s["blk.0.attn_q.weight"][0], q, rtol=1e-6)
    np.testing.assert_allclose(s["blk.0.attn_k.weight"][0], 4 * q, rtol=1e-6)
    np.testing.assert_allclose(s["blk.0.attn_v.weight"][0], 8 * q, rtol=1e-6)
    np.testing.assert_allclose(s["blk.1.attn_q.weight"][0], 4 * q, rtol=1e-6)
    ids = torch.tensor([3, 1, 1, 0] * 5)  # unsorted routed rows
    acc.on_matmul_input("blk.0.ffn_gate_exps.weight", x, ids)
    acc.on_matmul_input("blk.0.ffn_up_exps.weight", x, ids.clone())  # equal ids, another tensor: recomputed
    acc.on_matmul_input("blk.0.ffn_down_exps.weight", x, ids)  # not a sibling of gate/up
    im = acc.to_imatrix()
    for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
        s, c = im.sums[f"blk.0.{name}.weight"], im.counts[f"blk.0.{name}.weight"]
        assert c.tolist() == [5, 10, 0, 5], name
        for e in range(4):
            np.testing.assert_allclose(s[e], x[ids == e].double().square().sum(0).numpy(), rtol=1e-6)


def test_device_path_matches_cpu_path():
    """The accelerator reduction (index_add_, out-of-range ids counted apart) equals the numpy one."""
    from forge.imatrix.accumulate import _numpy_sums, _torch_sums

    g = torch.Generator().manual_seed(5)
    x, ids = torch.randn(300, 24, generator=g), torch.randint(0, 6, (300,), generator=g)
    np_s, np_c = _numpy_sums(x, ids, 6)
    dev_s, dev_c = _torch_sums(x, ids, 6)
    np.testing.assert_allclose(dev_s.numpy(), np_s.numpy(), rtol=1e-5)
    assert dev_c.tolist() == np_c.tolist() and dev_c[6] == 0
    bad = ids.clone()
    bad[:7] = 9
    dev_s, dev_c = _torch_sums(x, bad, 6)
    assert int(dev_c[6]) == 7 and int(dev_c.sum()) == 300
    np.testing.assert_allclose(dev_s[6].numpy(), x[:7].square().sum(0).numpy(), rtol=1e-5)
    dense, none = _torch_sums(x, None, 0)
    np.testing.assert_allclose(dense.numpy(), _numpy_sums(x, None, 0)[0].numpy(), rtol=1e-5)
    assert none is None


# ----------------------------------------------------------------------------------------- LiveImatrix


def feed(live, seed: int, n_tokens: int = 24) -> None:
    FakeMoE([live], seed=0).forward(torch.randn(n_tokens, D, generator=torch.Generator().manual_seed(seed)))


def test_live_snapshots_every_n_once_m_seen(tmp_path):
    out = tmp_path / "live.gguf"
    live = LiveImatrix(out, every=3, min_requests=5)
    written = []
    for i in range(1, 13):
        feed(live, i)
        if live.request_done():
            written.append(i)
            assert read_imatrix(out).chunk_count == i
        assert out.exists() == (i >= 6)
    assert written == [6, 9, 12]
    snap = read_imatrix(out)
    assert snap.datasets == ["live"]
    assert snap.counts["blk.0.attn_q.weight"].tolist() == [12 * 24]
    assert live.close() and read_imatrix(out).chunk_count == 12
    assert LiveImatrix(tmp_path / "never.gguf", every=0, min_requests=1).close() is False  # no data: no file
    assert not (tmp_path / "never.gguf").exists()


def test_live_is_thread_safe(tmp_path):
    import threading

    live = LiveImatrix(tmp_path / "t.gguf", every=4, min_requests=1)
    threads = [threading.Thread(target=lambda s=s: (feed(live, s), live.request_done())) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    live.close()
    im = read_imatrix(tmp_path / "t.gguf")
    assert live.requests == 8 and im.chunk_count == 8
    assert im.counts["blk.0.attn_q.weight"].tolist() == [8 * 24]
    assert im.counts["blk.1.ffn_down_exps.weight"].sum() == 8 * 24 * TOP_K


def _strings_in_gguf(path: Path) -> set[str]:
    from forge.gguf_file import open_gguf

    g = open_gguf(path)
    out = set(g.tensors)
    for kv in g.kvs.values():
        out.add(kv.key)
        values = kv.value if isinstance(kv.value, list) else [kv.value]
        out.update(v for v in values if isinstance(v, str))
    return out


def test_live_file_holds_no_prompt_text(tmp_path):
    prompt = "Patient Jane Q. Example, DOB 1970-01-01, diagnosis: confidential-4711"
    out = tmp_path / "live.gguf"
    live = LiveImatrix(out, every=1, min_requests=1)
    # the prompt enters only as activations (its bytes as values), as it would through the model
    codes = torch.tensor(list(prompt.encode()), dtype=torch.float32)
    x = codes[: (codes.numel() // D) * D].reshape(-1, D).repeat(8, 1)
    live.on_matmul_input("blk.0.attn_q.weight", x, None)
    with pytest.raises(TypeError):
        live.request_done(prompt)  # type: ignore[call-arg]  # no request metadata is accepted at all
    assert live.request_done()
    data = out.read_bytes()
    for needle in (prompt, "confidential-4711", "Jane"):
        assert needle.encode() not in data and needle.encode("utf-16-le") not in data
    row_bytes = codes[:D].numpy().astype("<f4").tobytes()
    assert row_bytes not in data  # no single input row is stored, only sums of squares
    strings = _strings_in_gguf(out)
    assert strings == {"general.type", "imatrix", "imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size",
                       "live", "blk.0.attn_q.weight.in_sum2", "blk.0.attn_q.weight.counts"}  # fmt: skip


_KILL_SCRIPT = textwrap.dedent(
    """
    import sys, time, torch
    import forge.imatrix.formats as formats
    from forge.imatrix.live import LiveImatrix

    live = LiveImatrix(sys.argv[1], every=1, min_requests=1)
    live.on_matmul_input("blk.0.attn_q.weight", torch.ones(32, 64), None)
    live.request_done()
    print("FIRST", flush=True)
    real = formats._tensor_data

    def stalled(tensors):
        for i, data in enumerate(real(tensors)):
            yield data
            if i == 1:
                print("WRITING", flush=True)
                time.sleep(120)

    formats._tensor_data = stalled
    live.on_matmul_input("blk.0.attn_q.weight", torch.full((32, 64), 2.0), None)
    live.on_matmul_input("blk.1.attn_q.weight", torch.ones(32, 64), None)
    live.request_done()
    """
)


@pytest.mark.slow
def test_kill_during_snapshot_keeps_previous(tmp_path):
    out = tmp_path / "live.gguf"
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-c", _KILL_SCRIPT, str(out)], stdout=subprocess.PIPE, text=True,
                            env=env, cwd=root)  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "FIRST"
        first = out.read_bytes()
        assert proc.stdout.readline().strip() == "WRITING"
        time.sleep(0.2)
        assert out.read_bytes() == first
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert out.read_bytes() == first
    im = read_imatrix(out)
    assert im.names() == ["blk.0.attn_q.weight"] and im.counts["blk.0.attn_q.weight"].tolist() == [32]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["live.gguf"], "a temporary file was left behind"
    assert re.fullmatch(r"-?\d+", str(proc.returncode)) and proc.returncode == -signal.SIGKILL


# --------------------------------------------------------------------------------- collection on a model


def _model_dir():
    from tests import oracle

    d = oracle.model_dir("tiny-qwen3moe")
    if not (d / "tokenizer.json").is_file():
        pytest.skip("tiny-qwen3moe fixture is absent")
    return d


@pytest.mark.slow
def test_collect_small_run(tmp_path):
    from forge.imatrix.accumulate import collect
    from tests import oracle

    text = tmp_path / "t.txt"
    text.write_text(oracle.text("calib.txt").read_text()[:6000])
    lines: list[str] = []
    rep = collect(_model_dir(), text, tmp_path / "im.dat", ctx=64, chunks=3, save_every=1, log=lines.append)
    assert rep.chunks == 3 and lines[0].startswith("[1]") and lines[-1].startswith("Final estimate: PPL = ")
    assert 1 < rep.perplexity < 1000
    im = read_imatrix(tmp_path / "im.dat")
    assert im.chunk_count == 3 and im.datasets == [str(text)]
    g = rep.imatrix
    assert g.chunk_size == 64 and g.counts["blk.0.attn_q.weight"].tolist() == [3 * 64]
    assert g.counts["blk.3.ffn_down_exps.weight"].sum() == 3 * 64 * 4 and g.shape(
        "blk.3.ffn_down_exps.weight"
    ) == (32, 256)
    assert "output.weight" not in g.sums
    with pytest.raises(ForgeError, match="need at least"):
        collect(_model_dir(), text, tmp_path / "x.gguf", ctx=4096, log=None)
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.slow
def test_collect_with_ggml_numerics(tmp_path):
    """llama.cpp's input rounding changes activations by rounding-size amounts, never the bookkeeping."""
    from forge.imatrix.accumulate import collect
    from tests import oracle

    text = tmp_path / "t.txt"
    text.write_text(oracle.text("calib.txt").read_text()[:3000])
    plain = collect(_model_dir(), text, tmp_path / "a.gguf", ctx=64, chunks=2, log=None).imatrix
    ggml = collect(
        _model_dir(), text, tmp_path / "b.gguf", ctx=64, chunks=2, log=None, ggml_numerics=True
    ).imatrix
    assert ggml.names() == plain.names()
    for name in plain.names():
        assert ggml.counts[name].sum() == plain.counts[name].sum(), name
        if plain.shape(name)[0] == 1:
            assert _rel_l2(ggml.sums[name], plain.sums[name]) < 2e-2, name
    assert any(not np.array_equal(ggml.sums[n], plain.sums[n]) for n in plain.names())


@pytest.fixture(scope="module")
def collected_like_llamacpp(tmp_path_factory):
    """The fixture README's llama-imatrix run (calib.txt, -c 512, --chunks 32) on our runtime."""
    from forge.imatrix.accumulate import collect
    from tests import oracle

    ref = oracle.llamacpp_file("tiny-qwen3moe", "tiny-qwen3moe-imatrix.gguf")
    if not ref.is_file():
        pytest.skip("llama.cpp's imatrix fixture is absent")
    out = tmp_path_factory.mktemp("collect") / "ours.gguf"
    rep = collect(_model_dir(), oracle.text("calib.txt"), out, ctx=512, chunks=32, log=None)
    return rep.imatrix, read_imatrix(ref), out


def _rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b.astype(np.float64)))


@pytest.mark.slow
def test_collection_matches_llama_imatrix(collected_like_llamacpp, tmp_path):
    ours, ref, _ = collected_like_llamacpp
    assert ours.names() == ref.names() and ours.chunk_count == ref.chunk_count == 32
    assert ours.chunk_size == ref.chunk_size
    for name in ref.names():
        assert ours.shape(name) == ref.shape(name), name
        if ref.shape(name)[0] == 1:  # attention and router inputs: same rows, same sums
            assert ours.counts[name].tolist() == ref.counts[name].tolist(), name
            assert _rel_l2(ours.sums[name], ref.sums[name]) <= 1e-3, name
        else:  # routed experts: every routed pair counted; a few near-tie routings differ (see below)
            assert ours.counts[name].sum() == ref.counts[name].sum(), name
            assert np.abs(ours.counts[name] - ref.counts[name]).sum() <= 2e-3 * ref.counts[name].sum(), name
            assert _rel_l2(ours.sums[name], ref.sums[name]) <= 1e-2, name
    # the same through .dat: our file's weights against llama-imatrix's .dat
    from forge.imatrix import write_imatrix

    write_imatrix(ours, tmp_path / "ours.dat")
    dat, ref_dat = read_imatrix(tmp_path / "ours.dat"), read_imatrix(str(ref_dat_path()))
    for name in ref_dat.names():
        n_per_row = ref.shape(name)[1] * ref.shape(name)[0]
        w, w_ref = importance_for(dat, name, n_per_row), importance_for(ref_dat, name, n_per_row)
        assert _rel_l2(w, w_ref) <= (1e-3 if ref.shape(name)[0] == 1 else 5e-2), name


def ref_dat_path():
    from tests import oracle

    return oracle.llamacpp_file("tiny-qwen3moe", "tiny-qwen3moe-imatrix.dat")


@pytest.fixture(scope="module")
def collected_with_ggml_numerics(tmp_path_factory):
    """The same run with llama.cpp's CPU roundings (--ggml-numerics): bf16 matmul inputs, fp16 K/V, RoPE table."""
    from forge.imatrix.accumulate import collect
    from tests import oracle

    ref = oracle.llamacpp_file("tiny-qwen3moe", "tiny-qwen3moe-imatrix.gguf")
    if not ref.is_file():
        pytest.skip("llama.cpp's imatrix fixture is absent")
    text = oracle.text("calib.txt")
    out = tmp_path_factory.mktemp("collect-ggml") / "ours.gguf"
    rep = collect(_model_dir(), text, out, ctx=512, chunks=32, log=None, ggml_numerics=True)
    return rep.imatrix, read_imatrix(ref)


# llama.cpp at another commit (the llama-cpp-python 0.3.36 peer, same CPU and settings) routes this text with
# a summed |count difference| of 210 from the fixture file over the 12 routed tensors.
LLAMA_CPP_BUILD_SPREAD = 210


@pytest.mark.slow
def test_ggml_numerics_collection_is_as_close_as_another_llama_cpp_build(collected_with_ggml_numerics):
    ours, ref = collected_with_ggml_numerics
    routed = [n for n in ref.names() if ref.shape(n)[0] > 1]
    for name in (n for n in routed if n.startswith("blk.0.")):  # layer 0: llama.cpp's routing exactly
        assert ours.counts[name].tolist() == ref.counts[name].tolist(), name
    spread = sum(int(np.abs(ours.counts[n] - ref.counts[n]).sum()) for n in routed)
    assert spread <= LLAMA_CPP_BUILD_SPREAD
    for name in ref.names():
        if ref.shape(name)[0] == 1:
            assert ours.counts[name].tolist() == ref.counts[name].tolist(), name
            assert _rel_l2(ours.sums[name], ref.sums[name]) <= 1e-3, name


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="near ties in the router's top-k are flipped by ulp-level differences from "
                   "layer 1 on: with --ggml-numerics ~0.03% of routed (token, slot) pairs differ, as between two "
                   "llama.cpp builds (LLAMA_CPP_BUILD_SPREAD); equal counts need the fixture's exact binary")  # fmt: skip
def test_collection_expert_counts_equal_llama_imatrix(collected_with_ggml_numerics):
    ours, ref = collected_with_ggml_numerics
    for name in ref.names():
        assert ours.counts[name].tolist() == ref.counts[name].tolist(), name
        assert _rel_l2(ours.sums[name], ref.sums[name]) <= 1e-3, name
