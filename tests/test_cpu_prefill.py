"""The CPU batch (prefill) kernel of the routed experts over encoded rows against the torch reference."""

from __future__ import annotations

import functools
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_cpu_kernels import _encoded_rows

from forge import ggml_types
from runtime import cpu_kernels as ck
from runtime.backends import cpu_backend, torch_backend
from runtime.dequant import dequantize
from runtime.moe import Taps
from runtime.observers import Observer

pytest.importorskip("numba")

N_EXPERT, N_FF, N_EMBD = 16, 256, 512
TYPES = [t.name for t in ggml_types.types_with("cpu_rows")]


@functools.cache
def _experts(name: str) -> tuple[list[np.ndarray], list[torch.Tensor]]:
    """Random encoded (gate, up, down) experts of one type (built once per type) and their float32 decode."""
    from gguf import GGMLQuantizationType as Q

    qtype = Q[name]
    shapes = ((N_FF, N_EMBD), (N_FF, N_EMBD), (N_EMBD, N_FF))
    raw = [
        _encoded_rows(qtype, N_EXPERT * rows, cols, seed).reshape(N_EXPERT, rows, -1)
        for seed, (rows, cols) in enumerate(shapes, 50)
    ]
    return raw, [
        dequantize(torch.from_numpy(a), qtype, cols) for a, (_, cols) in zip(raw, shapes, strict=True)
    ]


class _Source:
    """An ``ExpertSource`` as the backends see it, over random encoded experts of one type: per use (the
    records are the arrays) or streamed (each request's experts copied into shuffled slots of a small slab,
    at most ``group`` experts at once)."""

    def __init__(self, name: str, kind: str = "per-use", group: int = 0, limit: float | None = None) -> None:
        from gguf import GGMLQuantizationType as Q

        self.qtype = Q[name]
        self.raw, self.dec = _experts(name)
        self.kind, self.n_ff, self.swiglu_limit = kind, N_FF, limit
        self.cache = SimpleNamespace(group_size=group)
        self.requests: list[int] = []

    def gate_up_matrices(self, hit: list[int]) -> list[torch.Tensor]:
        return [torch.cat([self.dec[0][e], self.dec[1][e]]) for e in hit]

    def down_matrices(self, hit: list[int]) -> list[torch.Tensor]:
        return [self.dec[2][e] for e in hit]

    @contextmanager
    def records(self, ids: torch.Tensor):  # noqa: ANN201
        self.requests.append(len(ids))
        t = int(self.qtype)
        if self.kind == "per-use":
            yield ck.EncodedExperts(self.raw[0], t, self.raw[1], t, self.raw[2], t), ids
            return
        assert len(ids) <= self.cache.group_size
        slots = torch.randperm(
            self.cache.group_size + 2, generator=torch.Generator().manual_seed(len(self.requests))
        )
        slots = slots[: len(ids)]
        slabs = [np.zeros((self.cache.group_size + 2, *a.shape[1:]), np.uint8) for a in self.raw]
        for slab, a in zip(slabs, self.raw, strict=True):
            slab[slots.numpy()] = a[ids.numpy()]
        yield ck.EncodedExperts(slabs[0], t, slabs[1], t, slabs[2], t), slots


def _routing(n_tokens: int, k: int, seed: int, skewed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, k) distinct experts per token and their softmax weights; skewed: every token to the same k."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(1 if skewed else n_tokens, N_EXPERT, generator=gen).expand(n_tokens, -1)
    ids = scores.topk(k, dim=-1).indices
    return ids, torch.softmax(torch.randn(n_tokens, k, generator=gen), -1)


def _x(n_tokens: int, seed: int) -> torch.Tensor:
    return torch.randn(n_tokens, N_EMBD, generator=torch.Generator().manual_seed(seed))


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5) -> None:
    assert got.shape == want.shape
    assert (got - want).abs().max() <= rtol * want.abs().max(), float(
        (got - want).abs().max() / want.abs().max()
    )


class _Sums(Observer):
    """Per tensor: the sum of squares of each expert's input rows (what the imatrix collects) and row counts."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, torch.Tensor] = {}

    def on_matmul_input(self, tensor_name: str, x: torch.Tensor, expert_ids: torch.Tensor | None) -> None:
        assert expert_ids is not None and expert_ids.shape == (x.shape[0],)
        sums = torch.zeros(N_EXPERT, x.shape[1], dtype=torch.float64).index_add_(
            0, expert_ids, x.double() ** 2
        )
        self.sums[tensor_name] = sums
        self.counts[tensor_name] = torch.bincount(expert_ids, minlength=N_EXPERT)


def _both(
    source: _Source, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None
):  # noqa: ANN202
    """(kernel output, its observer), (reference output, its observer)."""
    out = []
    for backend in (cpu_backend, torch_backend):
        seen = _Sums()
        taps = Taps(("gate", "up", "down"), 0, [seen])
        out.append((backend.routed_ffn(x, ids, w, source, taps, residual), seen))
    return out


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("n_tokens", [2, 7, 64])
@pytest.mark.parametrize("k", [4, 8])
def test_batch_kernel_equals_the_torch_reference(name: str, n_tokens: int, k: int) -> None:
    source = _Source(name)
    ids, w = _routing(n_tokens, k, seed=n_tokens + k)
    x = _x(n_tokens, seed=1)
    (got, seen), (want, ref) = _both(source, x, ids, w)
    _close(got, want)
    assert source.requests == [len(ids.unique())]  # one records request: every hit expert at once
    for tensor in ("gate", "up", "down"):  # the observers see the same rows (act within the tolerance)
        assert torch.equal(seen.counts[tensor], ref.counts[tensor])
        _close(seen.sums[tensor], ref.sums[tensor])
    assert torch.equal(seen.sums["gate"], ref.sums["gate"])


@pytest.mark.parametrize("name", TYPES)
def test_groups_of_few_rows_from_the_encoded_bytes_equal_the_reference(name: str) -> None:
    """The batch kernel's two ways of a group: from the encoded bytes (groups of fewer than ``direct_below``
    rows: none, some, all) and from decoded rows, each against the float32 reference."""
    source = _Source(name)
    t = int(source.qtype)
    records = ck.EncodedExperts(source.raw[0], t, source.raw[1], t, source.raw[2], t)
    sizes, experts = [1, 2, 3, 5, 6], [3, 0, 7, 15, 9]
    xs = _x(sum(sizes), seed=11)
    starts = torch.tensor([0, *np.cumsum(sizes)])
    want_act = torch.cat(
        [
            torch.nn.functional.silu(x @ source.dec[0][e].T) * (x @ source.dec[1][e].T)
            for x, e in zip(xs.split(sizes), experts, strict=True)
        ]
    )
    want = torch.cat([a @ source.dec[2][e].T for a, e in zip(want_act.split(sizes), experts, strict=True)])
    for below in (0, 4, 100):
        act, ys = torch.empty(len(xs), N_FF), torch.empty_like(xs)
        ck.routed_ffn_batch(xs, torch.tensor(experts), starts, records, None, act, ys, below)
        _close(act, want_act)
        _close(ys, want)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0"])
def test_skewed_routing_and_a_residual(name: str) -> None:
    source = _Source(name)
    ids, w = _routing(64, 8, seed=3, skewed=True)
    x, residual = _x(64, seed=4), _x(64, seed=5)
    (got, _), (want, _) = _both(source, x, ids, w, residual)
    _close(got, want)
    one = torch.full((64, 1), 5)  # a single expert for every token (k = 1)
    (got, _), (want, _) = _both(source, x, one, torch.ones(64, 1))
    _close(got, want)


def test_a_batch_of_one_row_runs_the_one_token_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill's last layer computes its output row alone: one row, no residual, on the kernel (the torch
    path decoded its experts whole: on a 4-layer 35B-geometry file that ate most of the saving)."""
    source = _Source("Q4_K")
    ids, w = _routing(1, 8, seed=12)
    x = _x(1, seed=13)
    (got, seen), (want, ref) = _both(source, x, ids, w)
    _close(got, want)
    _close(seen.sums["down"], ref.sums["down"])

    def no_torch(*a: object, **k: object) -> None:
        raise AssertionError("one row went the torch path")

    monkeypatch.setattr(torch_backend, "routed_ffn", no_torch)
    assert torch.equal(cpu_backend.routed_ffn(x, ids, w, source, Taps(("g", "u", "d"), 0, [])), got)


def test_clamped_swiglu_equals_the_reference() -> None:
    source = _Source("Q8_0")
    ids, w = _routing(7, 4, seed=6)
    x = _x(7, seed=7) * 4
    gate = torch.einsum("td,fd->tf", x, source.dec[0][ids[0, 0]])
    source.swiglu_limit = float(gate.abs().median())  # clamps about half of the gate and up values
    (got, seen), (want, ref) = _both(source, x, ids, w)
    _close(got, want)
    _close(seen.sums["down"], ref.sums["down"])
    source.swiglu_limit = None
    assert (
        cpu_backend.routed_ffn(x, ids, w, source, Taps(("g", "u", "d"), 0, [])) - got
    ).abs().max() > 1e-3 * got.abs().max()


def test_streamed_groups_give_the_same_bits_as_one_call() -> None:
    ids, w = _routing(40, 8, seed=8)
    x = _x(40, seed=9)
    taps = Taps(("g", "u", "d"), 0, [])
    whole = cpu_backend.routed_ffn(x, ids, w, _Source("Q4_K"), taps)
    streamed = _Source("Q4_K", "streamed", group=3)
    got = cpu_backend.routed_ffn(x, ids, w, streamed, taps)
    assert torch.equal(got, whole)
    hit = len(ids.unique())
    assert (
        max(streamed.requests) == 3
        and sum(streamed.requests) == hit
        and len(streamed.requests) == -(-hit // 3)
    )


# end to end ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def q4_k_m(example_bf16: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from forge.quant.quantize import quantize

    out = tmp_path_factory.mktemp("q4km") / "tiny-qwen3moe-Q4_K_M.gguf"
    quantize(example_bf16, out, "q4_k_m")
    return out


def _prefill(path: Path, **kw: object) -> tuple[torch.Tensor, object]:
    from runtime.models import load_model

    model = load_model(path, **kw)  # type: ignore[arg-type]
    ids = torch.randint(0, 4096, (48,), generator=torch.Generator().manual_seed(10))
    return model.forward(ids, model.new_state()), model


def test_prefill_logits_on_the_kernel_equal_the_torch_path(
    q4_k_m: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from runtime.weights import GGUFWeights

    def reference_not_used(*a: object) -> None:
        raise AssertionError("the prefill of encoded experts runs the batch kernel")

    with monkeypatch.context() as m:
        m.setattr(torch_backend, "_batch", reference_not_used)
        got, model = _prefill(q4_k_m, expert_budget=0)
        w = GGUFWeights(q4_k_m)
        floor = len(w.expert_layers()) * int(w.hparam("expert_used_count")) + 1
        streamed, _ = _prefill(q4_k_m, stream_experts=floor, verify_experts=False)
    moe = [b.moe for b in model.blocks]  # type: ignore[attr-defined]
    assert all(e.backend is cpu_backend and e.source.kind == "per-use" for e in moe)
    assert torch.equal(streamed, got)
    monkeypatch.setenv("FORGE_NO_NUMBA", "1")
    want, plain = _prefill(q4_k_m, expert_budget=0)
    assert all(b.moe.backend is torch_backend for b in plain.blocks)  # type: ignore[attr-defined]
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def _products(model: object) -> list[object]:
    """Every Linear, FusedLinear and RowStack reachable from the model's attributes."""
    from runtime.layers import FusedLinear, Linear, RowStack

    seen, found, todo = set(), [], [model]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (torch.Tensor, np.ndarray, str, int, float)):
            continue
        seen.add(id(obj))
        if isinstance(obj, (Linear, FusedLinear, RowStack)):
            found.append(obj)
        if isinstance(obj, (list, tuple)):
            todo.extend(obj)
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif type(obj).__module__.startswith("runtime."):
            todo.extend(vars(obj).values())
    return found


def test_quantized_dense_weights_stay_encoded_and_compute_the_torch_paths_logits(
    q4_k_m: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CPU every quantized dense weight the row kernels read (attention, DeltaNet, shared expert when
    its parts share a type, LM head) is held as its file rows, no float32 copy: a prefill's logits (rows
    decoded in chunks) and each decode step's (dot products from the bytes) are the torch path's."""
    from runtime.models import load_model

    ids = torch.randint(0, 4096, (20,), generator=torch.Generator().manual_seed(11))

    def run(model: object) -> torch.Tensor:
        st = model.new_state()  # type: ignore[attr-defined]
        out = [model.forward(ids[:12], st)]  # type: ignore[attr-defined]
        out += [model.forward(ids[i : i + 1], st) for i in range(12, len(ids))]  # type: ignore[attr-defined]
        return torch.cat(out)

    model = load_model(q4_k_m)
    products = _products(model)
    encoded = [p for p in products if p.rows is not None and p.rows.encoded]  # type: ignore[attr-defined]
    assert model.output in encoded and model.blocks[0].attn.w_in in encoded  # type: ignore[attr-defined]
    got = run(model)
    for p in encoded:  # nothing decoded them whole
        assert vars(p).get("_weight_t") is None and vars(p).get("weight") is None
    float_rows = [p.rows.data.nbytes for p in products if p.rows is not None and not p.rows.encoded]  # type: ignore[attr-defined]
    encoded_bytes = sum(p.rows.data.nbytes for p in encoded)  # type: ignore[attr-defined]
    assert sum(float_rows) < encoded_bytes / 4, (sum(float_rows), encoded_bytes)  # routers, norms' kin: small
    monkeypatch.setenv("FORGE_NO_NUMBA", "1")
    plain = load_model(q4_k_m)
    assert all(p.rows is None for p in _products(plain))  # type: ignore[attr-defined]
    want = run(plain)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
