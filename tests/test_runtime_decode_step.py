"""The one-token decode path (each block's ``step``) against the batch path and the generic one-token path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from oracle import model_dir
from output_rows import check_last_only

from runtime.generate import generate
from runtime.models import MoeCausalLM, load_model
from runtime.observers import Observer

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(scope="module")
def qwen35_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from forge.convert import convert_checkpoint

    out = tmp_path_factory.mktemp("q35") / "tiny-qwen35moe-bf16.gguf"
    convert_checkpoint(model_dir("tiny-qwen35moe"), out, "bf16", mtp=False)
    return out


@pytest.fixture(params=["qwen3moe", "qwen35moe"])
def path(request: pytest.FixtureRequest) -> Path:
    if request.param == "qwen3moe":
        return request.getfixturevalue("example_bf16")
    return request.getfixturevalue("qwen35_bf16")


@pytest.fixture(autouse=True, params=["kernels", "torch"])
def step_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The one-token path on the CPU: compiled kernels (the default) or torch ops (as on CUDA and MPS)."""
    if request.param == "torch":
        monkeypatch.setenv("FORGE_NO_NUMBA", "1")
    return request.param


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 4096, (n,), generator=torch.Generator().manual_seed(seed))


def _decode(model: MoeCausalLM, ids: torch.Tensor, prefill: int, fast: bool) -> torch.Tensor:
    """Logits of ``ids``: a batch prefill of the first ``prefill`` tokens, then one token per call."""
    model.fast_decode = fast
    try:
        st = model.new_state()
        out = [model.forward(ids[:prefill], st)]
        out += [model.forward(ids[i : i + 1], st) for i in range(prefill, len(ids))]
    finally:
        model.fast_decode = True
    return torch.cat(out)


class Stats(Observer):
    """imatrix-like sums of every matmul input, the routing, and (optionally) the routed experts' outputs."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.rows: dict[str, int] = {}
        self.experts: dict[str, torch.Tensor] = {}
        self.routes: list[torch.Tensor] = []

    def on_matmul_input(self, tensor_name, x, expert_ids):
        assert x.dtype == torch.float32 and x.dim() == 2
        sq = (x * x).sum(0)
        self.sums[tensor_name] = self.sums.get(tensor_name, 0) + sq
        self.rows[tensor_name] = self.rows.get(tensor_name, 0) + x.shape[0]
        if expert_ids is not None:
            assert expert_ids.shape == (x.shape[0],)
            counts = torch.bincount(expert_ids, minlength=32)
            self.experts[tensor_name] = self.experts.get(tensor_name, 0) + counts

    def on_routing(self, layer, experts, weights, logits):
        self.routes.append(experts.clone())


class OutputStats(Stats):
    def __init__(self) -> None:
        super().__init__()
        self.outputs = 0.0

    def on_expert_output(self, layer, expert_ids, outputs, weights):
        self.outputs += float((outputs * weights[:, None]).sum())


def test_step_matches_the_batch_path(path: Path, step_path: str) -> None:
    model = load_model(path)
    assert model.weights.cpu_kernels == (step_path == "kernels")
    ids = _ids(40, seed=1)
    full = model.forward(ids, model.new_state())
    scale = full.abs().max()
    fast = _decode(model, ids, 8, fast=True)
    generic = _decode(model, ids, 8, fast=False)
    assert fast.shape == full.shape
    assert (fast - full).abs().max() <= 1e-4 * scale
    assert (fast - generic).abs().max() <= 1e-4 * scale
    assert torch.equal(fast.argmax(-1), generic.argmax(-1))


def test_greedy_tokens_are_the_same_on_both_paths(path: Path) -> None:
    model = load_model(path)
    prompt = _ids(12, seed=2).tolist()
    fast = generate(model, prompt, 48, stop_ids=set()).tokens
    model.fast_decode = False
    try:
        generic = generate(model, prompt, 48, stop_ids=set()).tokens
    finally:
        model.fast_decode = True
    assert len(fast) == 48 and fast == generic


@pytest.mark.parametrize("observer", [Stats, OutputStats])
def test_observers_see_the_same_inputs_on_both_paths(path: Path, observer: type[Stats]) -> None:
    model = load_model(path)
    ids = _ids(24, seed=3)
    seen = {}
    logits = {}
    for fast in (True, False):
        obs = observer()
        model.observers.append(obs)
        try:
            logits[fast] = _decode(model, ids, 4, fast=fast)
        finally:
            model.observers.remove(obs)
        seen[fast] = obs
    a, b = seen[True], seen[False]
    assert set(a.sums) == set(b.sums) and len(a.sums) > 0
    assert a.rows == b.rows
    for name in a.sums:
        assert torch.allclose(a.sums[name], b.sums[name], rtol=1e-4, atol=1e-6), name
    assert a.experts.keys() == b.experts.keys() and len(a.experts) == 3 * len(model.routed_layers())
    for name in a.experts:
        assert torch.equal(a.experts[name], b.experts[name]), name
    assert all(torch.equal(x, y) for x, y in zip(a.routes, b.routes, strict=True))
    if isinstance(a, OutputStats):
        assert isinstance(b, OutputStats) and a.outputs == pytest.approx(b.outputs, rel=1e-4)
    assert (logits[True] - logits[False]).abs().max() <= 1e-4 * logits[False].abs().max()
    # without an observer the same logits come back
    plain = _decode(model, ids, 4, fast=True)
    assert (plain - logits[False]).abs().max() <= 1e-4 * logits[False].abs().max()


def test_prune_mask_and_per_use_experts_on_the_step_path(path: Path) -> None:
    model = load_model(path)
    ids = _ids(20, seed=4)
    layers = len(model.routed_layers())
    pruned = torch.zeros(layers, model.n_expert, dtype=torch.bool)
    pruned[:, ::3] = True
    model.set_prune_mask(pruned)
    full = model.forward(ids, model.new_state())
    fast = _decode(model, ids, 5, fast=True)
    assert (fast - full).abs().max() <= 1e-4 * full.abs().max()
    per_use = load_model(path, expert_budget=0)
    assert per_use.blocks[0].moe.source.kind == "per-use"  # type: ignore[attr-defined]
    model.set_prune_mask(None)
    ref = _decode(model, ids, 5, fast=True)
    got = _decode(per_use, ids, 5, fast=True)
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_ggml_numerics_keeps_the_generic_path(example_bf16: Path, monkeypatch) -> None:
    from runtime.models.qwen3moe import Qwen3MoeBlock

    def boom(*a, **k):
        raise AssertionError("the step path does not reproduce ggml's roundings")

    monkeypatch.setattr(Qwen3MoeBlock, "step", boom)
    model = load_model(example_bf16, ggml_numerics=True)
    assert not model.fast_decode
    st = model.new_state()
    model.forward(_ids(4, seed=5), st)
    assert model.forward(_ids(1, seed=6), st).shape == (1, model.vocab_size)


def test_the_captured_form_of_the_step_matches_the_plain_step(path: Path, step_path: str) -> None:
    """What a CUDA graph captures (position from a device tensor, a static span of KV slots with the rest
    masked) computes the plain step's logits; run eagerly here, on the torch ops the cuda path uses."""
    from runtime.backends.cuda_graph import captured_form, span_for
    from runtime.layers import KVCache

    if step_path == "kernels":
        pytest.skip("the captured form is the torch-ops step")
    model = load_model(path)
    ids = _ids(40, seed=3)
    plain = _decode(model, ids, 30, fast=True)
    st = model.new_state()
    out = [model.forward(ids[:30], st)]
    at = torch.zeros(1, dtype=torch.long)
    for i in range(30, len(ids)):
        h = model.weights.rows("token_embd.weight", ids[i : i + 1])
        caches = [c for c in st.layers if isinstance(c, KVCache)]
        at.fill_(st.pos)
        with captured_form(caches, at, span_for(st.pos)), torch.inference_mode():
            out.append(model.decode_layers(h, st.layers, st.pos))
        for c in caches:
            c.length = st.pos + 1
        st.pos += 1
    scale = plain.abs().max()
    assert float((torch.cat(out) - plain).abs().max() / scale) < 1e-5


def test_a_prefill_for_its_last_logits_computes_the_last_layers_experts_for_one_row(path: Path) -> None:
    check_last_only(load_model(path), _ids(24, seed=5))
