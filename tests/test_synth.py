"""``forge synth``: its tokenizer (what llama.cpp's loader and runtime/tokenizer.py need), option checks
through the real CLI, and (slow, when llama-cpp-python is installed) llama.cpp loading and running a file."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from runtime.generate import Sampling, generate
from runtime.models import load_model
from runtime.synth import GEOMETRIES, MIN_VOCAB, SynthGeometry, compress_ratios, synth_tokens, synthesize
from runtime.tokenizer import Tokenizer
from runtime.weights import load_weights

VOCAB = 1000
TINY = SynthGeometry(
    layers=1,
    experts=4,
    experts_used=2,
    hidden=256,
    expert_ff=256,
    heads=2,
    kv_heads=1,
    head_dim=128,
    vocab=VOCAB,
)
TINY_ARGS = ["--layers", "1", "--experts", "4", "--experts-used", "2", "--hidden", "256", "--expert-ff", "256",
             "--heads", "2", "--kv-heads", "1", "--head-dim", "128", "--vocab", str(VOCAB)]  # fmt: skip
TEXTS = [
    "hello world",
    "The quick brown fox, 1234 times!\n\n  indented\ttab",
    "Ünïcödé: 数字 ✓ 🙂 — done",
    "<|im_start|>user\nhi<|im_end|>",
]


def _synthesized(tmp_path_factory: pytest.TempPathFactory, geometry: SynthGeometry) -> Path:
    path = tmp_path_factory.mktemp("synth") / "model.gguf"
    synthesize(path, geometry, "q4_k")
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _synthesized(tmp_path_factory, TINY)


def test_tokenizer_is_what_llamacpp_loads(tiny: Path) -> None:
    """The checks llama.cpp's vocabulary loader makes, on the file's own metadata."""
    r = GGUFReader(tiny)
    f = {k: v.contents() for k, v in r.fields.items()}
    assert f["tokenizer.ggml.model"] == "gpt2" and f["tokenizer.ggml.pre"] == "qwen2"
    tokens, types, merges = (
        f["tokenizer.ggml.tokens"],
        f["tokenizer.ggml.token_type"],
        f["tokenizer.ggml.merges"],
    )
    embd = next(t for t in r.tensors if t.name == "token_embd.weight")
    out = next(t for t in r.tensors if t.name == "output.weight")
    assert len(tokens) == len(types) == int(embd.shape[1]) == int(out.shape[1]) == VOCAB
    assert len(set(tokens)) == VOCAB  # llama.cpp asserts token -> id is a bijection
    assert set(types) <= {1, 3}
    for key in ("bos", "eos"):
        tid = f[f"tokenizer.ggml.{key}_token_id"]
        assert 0 <= tid < VOCAB and types[tid] == 3 and tokens[tid] == "<|endoftext|>"
    assert f["tokenizer.ggml.add_bos_token"] is False
    vocab = set(tokens)
    for m in merges:  # "left right": both halves and their join are tokens
        left, right = m.split(" ")
        assert left and right and {left, right, left + right} <= vocab
    assert len(merges) == VOCAB - MIN_VOCAB
    # byte tokens in GPT-2's byte -> unicode mapping, where llama.cpp's BPE looks them up
    assert tokens[ord("a")] == "a" and tokens[ord(" ")] == "Ġ" and tokens[ord("\n")] == "Ċ"


def test_tokenizer_round_trips_through_the_runtime(tiny: Path) -> None:
    tok = Tokenizer.from_metadata(load_weights(tiny))
    for text in TEXTS:
        ids = tok.encode(text, parse_special=True)
        assert all(0 <= i < VOCAB for i in ids)
        assert tok.decode(ids) == text
    # merges make words: " hello" is fewer tokens than its bytes, and the specials are single tokens
    assert len(tok.encode(" hello world")) < len(" hello world")
    assert tok.encode("<|im_end|>", parse_special=True) == [tok.special["<|im_end|>"]]
    assert tok.stop_ids == {tok.special["<|endoftext|>"], tok.special["<|im_end|>"]}
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_every_token_decodes_to_its_bytes() -> None:
    """Sampled ids anywhere in the vocabulary decode to text (words), and re-encode to the same bytes."""
    tokens, types, merges = synth_tokens(40_000)
    tok = Tokenizer(tokens, merges, types, pre="qwen2", eos_id=256, bos_id=256)
    rng = np.random.default_rng(0)
    ids = [int(i) for i in rng.integers(MIN_VOCAB, len(tokens), 200)]
    text = tok.decode(ids)
    assert text.replace(" ", "").isalpha() and text.isascii()
    assert tok.decode(tok.encode(text)) == text
    assert synth_tokens(40_000) == (tokens, types, merges)  # deterministic


def test_generates_text(tiny: Path) -> None:
    model = load_model(tiny)
    tok = Tokenizer.from_metadata(model.weights)
    prompt = tok.encode("hello")
    res = generate(
        model, prompt, 12, Sampling(temperature=1.0, seed=3), tokenizer=tok, stop_ids=set(), context=64
    )
    assert len(res.tokens) == 12 and all(0 <= t < VOCAB for t in res.tokens)
    assert len(set(res.tokens)) > 1  # logits in a sampled range, not one token at ~100x the others
    assert res.text == tok.decode(res.tokens) and res.text


def test_cli_writes_a_small_custom_geometry(tmp_path: Path) -> None:
    out = tmp_path / "cli.gguf"
    r = _forge(["-o", str(out), *TINY_ARGS])
    assert r.returncode == 0, r.stderr
    a, b = GGUFReader(out), GGUFReader(_reference(tmp_path))
    assert [(t.name, t.tensor_type, list(t.shape)) for t in a.tensors] == [
        (t.name, t.tensor_type, list(t.shape)) for t in b.tensors
    ]
    assert a.fields["qwen3moe.expert_count"].contents() == 4


def _reference(tmp: Path) -> Path:
    ref = tmp / "ref.gguf"
    synthesize(ref, TINY, "q4_k")
    return ref


BAD = [
    (["--vocab", "-5"], "--vocab"),
    (["--vocab", "0"], "--vocab"),
    (["--vocab", "258"], "--vocab"),
    (["--vocab", str(10**30)], "--vocab"),
    (["--seed", "-1"], "--seed"),
    (["--seed", str(2**64)], "--seed"),
    (["--layers", "0"], "--layers"),
    (["--layers", "100000"], "--layers"),
    (["--experts", "0"], "--experts"),
    (["--experts", "4", "--experts-used", "5"], "--experts-used"),
    (["--hidden", "100"], "--hidden"),
    (["--expert-ff", "-256"], "--expert-ff"),
    (["--heads", "0"], "--heads"),
    (["--heads", "16", "--kv-heads", "3"], "--kv-heads"),
    (["--head-dim", "127"], "--head-dim"),
    (["--type", "q9_z"], "--type"),
    (["--geometry", "nope"], "geometry"),
]


@pytest.mark.parametrize(("args", "names"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_options_give_one_error_line_and_no_file(tmp_path: Path, args: list[str], names: str) -> None:
    out = tmp_path / "bad.gguf"
    r = _forge(["-o", str(out), "--layers", "1", "--vocab", "512", *args])
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and names in lines[0], r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert list(tmp_path.iterdir()) == []


def _forge(args: list[str]) -> subprocess.CompletedProcess[str]:
    code = "from forge.cli import main; main()"
    return subprocess.run(
        [sys.executable, "-c", code, "synth", *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_llamacpp_loads_and_runs_a_synth_file(tiny: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(tiny), n_ctx=64, n_threads=2, logits_all=True, verbose=False)
    assert llm.n_vocab() == VOCAB
    tok = Tokenizer.from_metadata(load_weights(tiny))
    for text in TEXTS[:3]:  # llama.cpp's tokenizer agrees with the runtime's on this vocabulary
        ids = llm.tokenize(text.encode(), add_bos=False, special=True)
        assert ids == tok.encode(text, parse_special=True)
        assert llm.detokenize(ids).decode() == text
    assert llm.token_eos() == tok.eos_id
    prompt = tok.encode("hello world")
    llm.eval(prompt)
    logits = np.array(llm.scores[len(prompt) - 1])
    assert logits.shape == (VOCAB,) and np.isfinite(logits).all() and logits.std() > 0.1
    out = llm("hello world", max_tokens=8, temperature=0.0)
    assert out["usage"]["completion_tokens"] == 8
    # the runtime computes the same model: same next-token choice, same greedy text
    model = load_model(tiny)
    ours = model.forward(torch.tensor(prompt), model.new_state(64))[-1]
    assert int(ours.argmax()) == int(logits.argmax())
    res = generate(model, prompt, 8, tokenizer=tok, stop_ids=set(), context=64)
    assert res.text == out["choices"][0]["text"]


#: deepseek-v4-flash's layout at small widths: layers 0-1 window only, 2 ratio 4 (indexer), 3 ratio 128
DSV4 = replace(GEOMETRIES["deepseek-v4-flash"], layers=4, experts=8, experts_used=2, hidden=256, expert_ff=256,
               heads=4, head_dim=128, vocab=VOCAB, q_lora=256, o_groups=2, o_lora=256, index_heads=4)  # fmt: skip


@pytest.fixture(scope="module")
def dsv4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _synthesized(tmp_path_factory, DSV4)


def test_deepseek4_geometry_runs(dsv4: Path) -> None:
    assert compress_ratios("flash", 4) == [0, 0, 4, 128] and compress_ratios("pro", 5) == [
        128,
        128,
        128,
        4,
        128,
    ]
    tensors = {t.name: t for t in GGUFReader(dsv4).tensors}
    assert [i for i in range(4) if f"blk.{i}.ffn_gate_tid2eid.weight" in tensors] == [0, 1, 2]
    assert [i for i in range(4) if f"blk.{i}.attn_compressor_kv.weight" in tensors] == [2, 3]
    assert [i for i in range(4) if f"blk.{i}.indexer.proj.weight" in tensors] == [2]
    table = tensors["blk.0.ffn_gate_tid2eid.weight"].data
    assert all(len(set(row)) == 2 for row in table[:100]) and table.max() < 8
    model = load_model(dsv4)
    tok = Tokenizer.from_metadata(model.weights)
    prompt = tok.encode("hello world")
    logits = model.forward(torch.tensor(prompt), model.new_state(64))
    assert torch.isfinite(logits).all() and float(logits[-1].std()) > 0.1
    res = generate(
        model, prompt, 8, Sampling(temperature=1.0, seed=3), tokenizer=tok, stop_ids=set(), context=64
    )
    assert len(res.tokens) == 8 and all(0 <= t < VOCAB for t in res.tokens)


@pytest.mark.slow
def test_llamacpp_runs_the_deepseek4_geometry(dsv4: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(dsv4), n_ctx=64, n_threads=2, logits_all=True, verbose=False)
    prompt = Tokenizer.from_metadata(load_weights(dsv4)).encode("hello world")
    llm.eval(prompt)
    logits = np.array(llm.scores[len(prompt) - 1])
    assert logits.shape == (VOCAB,) and np.isfinite(logits).all() and logits.std() > 0.1


def test_routing_depends_on_the_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random tokens spread over the experts at every layer, as in a trained model. (Blocks of random bytes
    have a positive mean under K-quants with minimums; summed through attention, it gave every token the same
    hidden state and the same top-k experts, which made MoE prefill and expert caching look far cheaper.)"""
    from runtime import moe

    g = replace(TINY, layers=3, experts=32, experts_used=4)
    path = tmp_path / "routed.gguf"
    synthesize(path, g, "q4_k")
    chosen: list[np.ndarray] = []
    route = moe.Router.route

    def recording(self, logits, tokens=None):  # noqa: ANN001, ANN202
        ids, w = route(self, logits, tokens)
        chosen.append(ids.reshape(-1).numpy().copy())
        return ids, w

    monkeypatch.setattr(moe.Router, "route", recording)
    model = load_model(path)
    model.forward(
        torch.randint(0, VOCAB, (256,), generator=torch.Generator().manual_seed(0)), model.new_state()
    )
    assert len(chosen) == g.layers
    for layer, ids in enumerate(chosen):
        counts = np.bincount(ids, minlength=g.experts)
        fair = ids.size / g.experts
        assert np.count_nonzero(counts) == g.experts, (layer, counts)
        assert counts.max() < 3 * fair, (layer, counts)


@pytest.mark.parametrize("qtype", ["q4_k", "q6_k", "q8_0"])
def test_activations_stay_in_float16_range(tmp_path: Path, qtype: str) -> None:
    """Every matmul's input (the experts' SwiGLU outputs too) stays far inside float16's range at a real
    model's width, whatever the type: llama.cpp's GPU kernels keep 32-value sums of them in float16. (Block
    scales alone set the values' size: the 35B geometry's SwiGLU outputs reached 4.4e6 in Q4_K, and
    llama.cpp's GPU prefill would route infinities.) Matrices have a trained model's element deviation."""
    from runtime.dequant import dequantize
    from runtime.observers import Observer
    from runtime.synth import WEIGHT_STD, out_of_range

    g = replace(GEOMETRIES["qwen3.6-35b-a3b"], layers=2, experts=16, experts_used=4, vocab=MIN_VOCAB + 64)
    path = tmp_path / "wide.gguf"
    synthesize(path, g, qtype)
    assert not out_of_range(path)  # it records WEIGHT_STD
    largest: dict[str, float] = {}

    class Largest(Observer):
        def on_matmul_input(self, name: str, x: torch.Tensor, expert_ids: torch.Tensor | None) -> None:
            largest[name] = max(largest.get(name, 0.0), float(x.abs().max()))

    model = load_model(path, observers=[Largest()])
    tokens = torch.randint(0, g.vocab, (64,), generator=torch.Generator().manual_seed(0))
    logits = model.forward(tokens, model.new_state())
    assert torch.isfinite(logits).all() and 0.3 < float(logits.std()) < 10
    assert max(largest.values()) * 32 < 65504, sorted(largest.items(), key=lambda kv: -kv[1])[:3]
    weights, name = load_weights(path), "blk.0.ffn_gate_exps.weight"
    w = dequantize(weights.raw(name), weights.qtype(name), weights.shape(name)[-1])
    assert 0.5 * WEIGHT_STD < float(w.std()) < 2 * WEIGHT_STD
