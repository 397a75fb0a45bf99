"""The deepseek4 runtime model (runtime/models/deepseek4.py) against transformers' DeepseekV4ForCausalLM and
llama.cpp's perplexity, on the tiny random fixture (tests/deepseek4_fixture.py) converted by forge convert.

transformers cannot load the published FP4 experts (no CPU dequantizer for them), so it reads a twin folder
whose experts are the same values dequantized to float32 (FP4 x 2^k is exact in float32); every other
tensor is the published file's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from deepseek4_fixture import FP4_VALUES, write_deepseek4
from output_rows import check_last_only
from safetensors.torch import load_file, save_file

from forge.convert import convert_checkpoint
from forge.errors import ForgeError
from runtime.evaluate import evaluate, perplexity_tokens
from runtime.generate import generate
from runtime.models import load_model
from runtime.observers import Observer
from runtime.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # the fixture is written and converted once per module (~7 s)
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from deepseek4_runtime_oracle import FIGURES, RUNTIME_FIXTURE, TEXT, sha256  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_deepseek4(tmp_path_factory.mktemp("dsv4") / "tiny-deepseek4", **RUNTIME_FIXTURE)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def gguf(checkpoint: Path) -> Path:
    out = checkpoint.parent / "tiny-deepseek4-f32.gguf"
    convert_checkpoint(checkpoint, out, "f32")
    return out


def fp4_to_float(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Published FP4 experts (two E2M1 codes per byte, element 2i low) with E8M0 scales per 32 -> float32."""
    b = packed.view(torch.uint8).numpy()
    codes = np.stack([b & 0xF, b >> 4], axis=-1).reshape(b.shape[0], -1)
    values = np.where(codes & 8, -1.0, 1.0) * FP4_VALUES[codes & 7]
    exp = scale.view(torch.uint8).numpy().astype(np.float32) - 127
    return torch.from_numpy((values * np.exp2(np.repeat(exp, 32, axis=1))).astype(np.float32))


def hf_model(checkpoint: Path):  # noqa: ANN201
    """transformers' model on ``checkpoint``'s twin folder (the experts dequantized to float32)."""
    models = pytest.importorskip("transformers")
    if not hasattr(models, "DeepseekV4ForCausalLM"):
        pytest.skip("this transformers has no DeepseekV4ForCausalLM")
    twin = checkpoint.parent / f"{checkpoint.name}-hf-twin"
    twin.mkdir()
    for f in checkpoint.iterdir():
        if f.suffix != ".safetensors":
            (twin / f.name).write_bytes(f.read_bytes())
            continue
        tensors = load_file(f)
        for name in [n for n in tensors if ".experts." in n and n.endswith(".scale")]:
            weight = name.removesuffix(".scale") + ".weight"
            tensors[weight] = fp4_to_float(tensors[weight], tensors.pop(name))
        save_file(tensors, twin / f.name, metadata={"format": "pt"})
    index = json.loads((twin / "model.safetensors.index.json").read_text())
    index["weight_map"] = {
        n: s for n, s in index["weight_map"].items() if not (".experts." in n and n.endswith(".scale"))
    }
    (twin / "model.safetensors.index.json").write_text(json.dumps(index))
    return models.DeepseekV4ForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf(checkpoint: Path):  # noqa: ANN201
    return hf_model(checkpoint)


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 4096, n))


def test_logits_match_transformers(gguf: Path, hf) -> None:  # noqa: ANN001
    """300 tokens: two HCA windows closed, CSA entries past the indexer's top-k, the sliding window passed."""
    ids = _ids(300, 1)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    ours = load_model(gguf)
    got = ours.forward(ids, ours.new_state())
    assert (got - ref).abs().max() <= 1e-3 * ref.abs().max()


def test_sigmoid_scoring_matches_transformers(tmp_path: Path) -> None:
    """scoring_func sigmoid (expert_gating_func 2) instead of sqrt(softplus); llama.cpp runs only the latter."""
    fixture = {**RUNTIME_FIXTURE, "scoring_func": "sigmoid"}
    checkpoint = write_deepseek4(tmp_path / "sigmoid", **fixture)  # type: ignore[arg-type]
    gguf = tmp_path / "sigmoid.gguf"
    convert_checkpoint(checkpoint, gguf, "f32")
    ids = _ids(200, 7)
    with torch.no_grad():
        ref = hf_model(checkpoint)(ids[None]).logits[0]
    ours = load_model(gguf)
    assert ours.blocks[2].moe.router.score is torch.sigmoid
    got = ours.forward(ids, ours.new_state())
    assert (got - ref).abs().max() <= 1e-3 * ref.abs().max()


def test_greedy_tokens_match_transformers(gguf: Path, hf) -> None:  # noqa: ANN001
    """64 greedy tokens after a 120-token prompt: the caches (window, compressor states) carried step by step."""
    prompt = _ids(120, 2)
    with torch.no_grad():
        want = hf.generate(prompt[None], max_new_tokens=64, do_sample=False)[0, 120:].tolist()
    got = generate(load_model(gguf), prompt.tolist(), 64, stop_ids=set())
    assert got.tokens == want


def test_state_is_carried_across_calls(gguf: Path) -> None:
    """Prefill in pieces (crossing compressor windows and the sliding window) == in one call."""
    m = load_model(gguf)
    ids = _ids(150, 3)
    full = m.forward(ids, m.new_state())
    for sizes in ((5, 1, 1, 90, 53), (129, 21)):
        st, outs, start = m.new_state(), [], 0
        for n in sizes:
            outs.append(m.forward(ids[start : start + n], st))
            start += n
        assert (torch.cat(outs) - full).abs().max() <= 1e-5 * full.abs().max(), sizes


def test_a_prefill_for_its_last_logits_computes_the_last_layers_experts_for_one_row(gguf: Path) -> None:
    check_last_only(load_model(gguf), _ids(40, 4))


def test_prune_mask_covers_the_routed_layers_only(gguf: Path) -> None:
    m = load_model(gguf)
    hashed = [i for i, b in enumerate(m.blocks) if b.hashed]
    assert hashed == [0, 1] and m.routed_layers() == [2, 3]
    pruned = torch.zeros(2, m.n_expert, dtype=torch.bool)
    pruned[:, :3] = True
    assert m.set_prune_mask(pruned) == 6
    ids = _ids(40, 4)
    routes: list[tuple[int, torch.Tensor]] = []

    class Routes(Observer):
        def on_routing(
            self, layer: int, ids: torch.Tensor, weights: torch.Tensor, logits: torch.Tensor
        ) -> None:
            routes.append((layer, ids))

    m.observers.append(Routes())
    m.forward(ids, m.new_state())
    chosen = {layer: torch.cat([i.flatten() for lay, i in routes if lay == layer]) for layer in range(4)}
    assert all(int(chosen[layer].min()) >= 3 for layer in (2, 3))  # never a pruned expert
    table = m.weights.table("blk.0.ffn_gate_tid2eid.weight")
    assert torch.equal(chosen[0].view(-1, 2), table[ids])  # hash layers: the token's experts, unmasked
    with pytest.raises(ForgeError, match="hash-routed"):
        m.blocks[0].moe.set_mask(torch.zeros(m.n_expert, dtype=torch.bool))


def test_perplexity_matches_llamacpp(gguf: Path) -> None:
    """llama-perplexity's figure on this file (benchmarks/deepseek4_runtime_oracle.py), within 0.5%, with ggml's
    matmul input rounding (MXFP4 experts read Q8_0 activations in llama.cpp)."""
    if not FIGURES.is_file():
        pytest.skip(f"{FIGURES} is absent: run benchmarks/deepseek4_runtime_oracle.py")
    want = json.loads(FIGURES.read_text())["tiny-deepseek4-f32"]
    if sha256(gguf) != want["gguf_sha256"]:
        pytest.skip("the fixture's bytes changed since llama.cpp's figure was recorded: rerun the benchmark")
    m = load_model(gguf, ggml_numerics=True)
    tok = Tokenizer.from_metadata(m.weights)
    ids = perplexity_tokens(tok, TEXT.read_text(), want["ctx"], want["chunks"])
    got = evaluate(m, ids, want["ctx"], want["chunks"], bos_id=tok.bos_id if tok.add_bos else None)
    assert abs(got.perplexity / want["ppl"] - 1) <= 0.005, (got.perplexity, want["ppl"])


def test_streamed_and_expert_major_files_match_resident(gguf: Path, tmp_path: Path) -> None:
    """SSD streaming through the expert cache, decoding per use, and the expert-major v2 file: bit for bit."""
    from forge.layout.convert import convert

    ids = _ids(150, 5)
    resident = load_model(gguf)
    want = resident.forward(ids, resident.new_state())
    v2 = tmp_path / "v2.gguf"
    convert(gguf, v2, "v2")
    for path, kwargs in ((gguf, {"stream_experts": 9}), (gguf, {"expert_budget": 0}), (v2, {}),
                         (v2, {"stream_experts": 9})):  # fmt: skip
        m = load_model(path, **kwargs)  # type: ignore[arg-type]
        assert torch.equal(m.forward(ids, m.new_state()), want), (path.name, kwargs)


def test_imatrix_counts_hash_routed_assignments(gguf: Path) -> None:
    """A hash-routed layer's experts are counted by the token ids' table rows, like a routed layer's."""
    from forge.imatrix.accumulate import ImatrixAccumulator

    acc = ImatrixAccumulator()
    m = load_model(gguf, observers=[acc])
    ids = _ids(100, 6)
    m.forward(ids, m.new_state())
    _, counts = acc.export_arrays()
    table = m.weights.table("blk.0.ffn_gate_tid2eid.weight")
    for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
        np.testing.assert_array_equal(
            counts[f"blk.0.{name}.weight"], np.bincount(table[ids].flatten(), minlength=8)
        )
        assert counts[f"blk.3.{name}.weight"].sum() == 2 * len(ids)


def test_prune_profile_covers_routed_layers_and_apply_refuses_hash_layers(gguf: Path, tmp_path: Path) -> None:
    from forge.prune.apply import apply_mask
    from forge.prune.collect import collect_profile
    from forge.prune.mask import build_mask
    from runtime.models import apply_prune_mask

    report = collect_profile(gguf, TEXT, None, ctx=128, chunks=1)
    assert [p.layer for p in report.profile.layers] == [2, 3]
    assert report.hash_routed == [0, 1] and report.profile.meta["hash_routed_layers"] == [0, 1]
    mask = build_mask(report.profile, keep=4)
    assert apply_prune_mask(load_model(gguf), mask) == 8
    with pytest.raises(ForgeError, match="layers 0, 1 are hash-routed"):
        apply_mask(gguf, mask, tmp_path / "pruned.gguf")


def test_serve_chat_uses_the_chat_template(gguf: Path) -> None:
    """forge serve on deepseek4: a greedy chat completion = generate on the chat-templated prompt."""
    for module in ("fastapi", "uvicorn", "openai", "httpx"):
        pytest.importorskip(module)
    from test_server import ServerThread

    from runtime.generate import Sampling
    from runtime.server import load_engine

    m = load_model(gguf)
    tok = Tokenizer.from_metadata(m.weights)
    messages = [{"role": "user", "content": "Hello there, how are you today?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert text.endswith("<｜User｜>Hello there, how are you today?<｜Assistant｜>")
    ids = tok.encode(text, parse_special=True)
    want = generate(m, ids, 8, Sampling(), tok)
    server = ServerThread(load_engine(gguf, name="dsv4"))
    try:
        r = server.client().chat.completions.create(
            model="dsv4", messages=messages, max_tokens=8, temperature=0
        )
    finally:
        server.stop()
    assert r.choices[0].message.content == want.text
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(want.tokens))


def test_hugging_face_folder_runs_as_its_gguf(checkpoint: Path, gguf: Path) -> None:
    """The runtime on the published checkpoint folder (converted in memory by forge's deepseek4 table)."""
    ids = _ids(60, 8)
    a, b = load_model(gguf), load_model(checkpoint)
    assert torch.equal(a.forward(ids, a.new_state()), b.forward(ids, b.new_state()))


def _rewritten(gguf: Path, out: Path, changes: dict[str, object], drop: str | None = None) -> Path:
    """``gguf`` with some KVs given new values (or added as uint32) and tensors named ``drop*`` left out."""
    from gguf import GGUFValueType

    from forge.gguf_file import KV, TensorSpec, open_gguf, write_gguf

    f = open_gguf(gguf)
    kvs = [KV(kv.key, changes.pop(kv.key), kv.vtype, kv.item_type) if kv.key in changes else kv
           for kv in f.kvs.values()]  # fmt: skip
    kvs += [KV(k, v, GGUFValueType.UINT32) for k, v in changes.items()]
    names = [n for n in f.tensors if drop is None or not n.startswith(drop)]
    specs = [TensorSpec(n, f.tensors[n].shape, f.tensors[n].ggml_type) for n in names]
    write_gguf(out, kvs, specs, (f.raw(n) for n in names), alignment=f.alignment)
    return out


def test_mtp_block_is_not_run_and_bad_files_are_one_error(gguf: Path, tmp_path: Path) -> None:
    ids = _ids(40, 9)
    m = load_model(gguf)
    want = m.forward(ids, m.new_state())
    # a file that declares an MTP block (block_count counts it): the trunk's layers only
    mtp = _rewritten(
        gguf, tmp_path / "mtp.gguf", {"deepseek4.block_count": 5, "deepseek4.nextn_predict_layers": 1}
    )
    m = load_model(mtp)
    assert m.n_layer == 4 and torch.equal(m.forward(ids, m.new_state()), want)
    bad = _rewritten(gguf, tmp_path / "ratio.gguf", {"deepseek4.attention.compress_ratios": [0, 4, 8, 4]})
    with pytest.raises(ForgeError, match="layer 2: compress ratio 8"):
        load_model(bad)
    missing = _rewritten(gguf, tmp_path / "table.gguf", {}, drop="blk.1.ffn_gate_tid2eid")
    with pytest.raises(ForgeError, match="missing tensor blk.1.ffn_gate_tid2eid.weight"):
        load_model(missing)
