"""Runtime: fast checks on the bundled example model and on synthetic inputs (no fixtures needed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from forge.errors import ForgeError
from runtime.generate import Sampling, draw, generate, sample
from runtime.models import load_model
from runtime.models.qwen35moe import delta_rule_chunked, delta_rule_step
from runtime.observers import Observer
from runtime.tokenizer import Tokenizer

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(scope="module")
def model(example_bf16: Path):
    return load_model(example_bf16)


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 4096, (n,), generator=torch.Generator().manual_seed(seed))


def test_delta_rule_chunked_equals_token_by_token() -> None:
    g = torch.Generator().manual_seed(1)
    t, h, dk, dv = 150, 4, 16, 8
    q = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=g), dim=-1)
    v = torch.randn(t, h, dv, generator=g)
    decay = -torch.rand(t, h, generator=g) * 0.5
    beta = torch.rand(t, h, generator=g)
    s0 = torch.randn(h, dk, dv, generator=g)
    outs, s = [], s0
    for i in range(t):
        o, s = delta_rule_step(q[i], k[i], v[i], decay[i], beta[i], s)
        outs.append(o)
    expect = torch.stack(outs)
    for chunk in (64, 32, 7):
        got, s_end = delta_rule_chunked(q, k, v, decay, beta, s0, chunk=chunk)
        assert torch.allclose(got, expect, atol=1e-4, rtol=1e-4), chunk
        assert torch.allclose(s_end, s, atol=1e-4, rtol=1e-4), chunk


def test_hf_folder_and_its_gguf_give_the_same_logits(model, example_bf16: Path) -> None:
    from conftest import EXAMPLE

    hf = load_model(EXAMPLE)
    ids = _ids(40)
    a = model.forward(ids, model.new_state())
    b = hf.forward(ids, hf.new_state())
    assert a.shape == (40, 4096)
    assert torch.equal(a, b)  # bf16 values are exact in float32: the same numbers


def test_incremental_decoding_matches_one_prefill(model) -> None:
    ids = _ids(48, seed=2)
    full = model.forward(ids, model.new_state())
    st = model.new_state()
    parts = [model.forward(ids[:20], st), model.forward(ids[20:37], st)]
    parts += [model.forward(ids[i : i + 1], st) for i in range(37, 48)]
    got = torch.cat(parts)
    scale = full.abs().max()
    assert (got - full).abs().max() <= 1e-4 * scale


def test_expert_budget_zero_decodes_per_use_with_the_same_result(
    example_bf16: Path, model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Experts decoded per use compute what resident (decoded-at-load) experts compute: bit for bit on the
    torch reference, which computes both alike; within the kernels' tolerance on the CPU default, where a
    batch over per-use experts takes the compiled encoded-row kernel and resident ones torch's matmuls."""
    per_use = load_model(example_bf16, expert_budget=0)
    assert not per_use.blocks[0].moe.source.down.resident and model.blocks[0].moe.source.down.resident
    ids = _ids(30, seed=3)
    want = model.forward(ids, model.new_state())
    got = per_use.forward(ids, per_use.new_state())
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4
    monkeypatch.setenv("FORGE_NO_NUMBA", "1")
    torch_model, torch_per_use = load_model(example_bf16), load_model(example_bf16, expert_budget=0)
    want = torch_model.forward(ids, torch_model.new_state())
    assert torch.equal(torch_per_use.forward(ids, torch_per_use.new_state()), want)


class Recorder(Observer):
    def __init__(self) -> None:
        self.matmuls: dict[str, list[tuple[tuple[int, ...], torch.Tensor | None]]] = {}
        self.routes: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def on_matmul_input(self, tensor_name, x, expert_ids):
        self.matmuls.setdefault(tensor_name, []).append((tuple(x.shape), expert_ids))
        assert x.dtype == torch.float32

    def on_routing(self, layer, experts, weights, logits):
        self.routes.append((layer, experts, weights, logits))


def test_observers_see_every_matmul_and_routing(model) -> None:
    rec = Recorder()
    model.observers.append(rec)
    try:
        model.forward(_ids(10), model.new_state())
    finally:
        model.observers.remove(rec)
    names = set(rec.matmuls)
    for i in range(model.n_layer):
        for t in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp"):
            assert rec.matmuls[f"blk.{i}.{t}.weight"] == [
                ((10, model.n_embd if t != "attn_output" else 256), None)
            ]
        for t in ("gate", "up", "down"):
            ((shape, ids),) = rec.matmuls[f"blk.{i}.ffn_{t}_exps.weight"]
            assert shape[0] == 10 * model.n_expert_used and ids is not None and ids.shape == (shape[0],)
            assert ids.dtype == torch.int64
    assert "output.weight" in names
    assert [r[0] for r in rec.routes] == list(range(model.n_layer))
    layer, experts, weights, logits = rec.routes[0]
    assert experts.shape == weights.shape == (10, model.n_expert_used) and logits.shape == (
        10,
        model.n_expert,
    )
    assert torch.allclose(weights.sum(-1), torch.ones(10))
    # the routed rows of each expert are exactly the tokens that chose it
    counts = torch.bincount(experts.reshape(-1), minlength=model.n_expert)
    _, ids = rec.matmuls["blk.0.ffn_gate_exps.weight"][0]
    assert torch.equal(torch.bincount(ids, minlength=model.n_expert), counts)


def test_no_observer_means_no_calls(model, monkeypatch) -> None:
    import runtime.layers as layers
    import runtime.moe as moe

    def boom(*a, **k):
        raise AssertionError("observer hook called without observers")

    monkeypatch.setattr(layers, "notify_matmul", boom)
    monkeypatch.setattr(moe, "notify_routing", boom)
    monkeypatch.setattr(moe, "notify_matmul", boom)
    model.forward(_ids(5), model.new_state())


def test_tokenizer_matches_hf_and_round_trips(model) -> None:
    from conftest import EXAMPLE
    from tokenizers import Tokenizer as HFTokenizer

    tok = Tokenizer.from_metadata(model.weights)
    hf = HFTokenizer.from_file(str(EXAMPLE / "tokenizer.json"))
    text = (Path(__file__).resolve().parents[1] / "runtime" / "tokenizer.py").read_text()
    text += "\n<|endoftext|>ünïcödé 你好 123456 \r\n\t  x  \n\n"
    assert tok.encode(text, parse_special=True) == hf.encode(text, add_special_tokens=False).ids
    hf.encode_special_tokens = True
    assert tok.encode(text) == hf.encode(text, add_special_tokens=False).ids
    assert tok.decode(tok.encode(text)) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode(chat, parse_special=True)[0] == tok.special["<|im_start|>"]


def test_greedy_generation_is_deterministic_and_sampling_follows_seed(model) -> None:
    tok = Tokenizer.from_metadata(model.weights)
    prompt = tok.encode("def main():\n    ")
    a = generate(model, prompt, 12, tokenizer=tok)
    b = generate(model, prompt, 12, tokenizer=tok)
    assert a.tokens == b.tokens and len(a.tokens) <= 12 and a.text == tok.decode(a.tokens)
    s = Sampling(temperature=0.9, top_k=40, top_p=0.9, seed=7)
    assert generate(model, prompt, 8, s, tok).tokens == generate(model, prompt, 8, s, tok).tokens
    logits = torch.tensor([0.0, 5.0, 4.9, -3.0])
    assert sample(logits, Sampling()) == 1
    picks = {
        sample(logits, Sampling(1.0, top_k=1, seed=0), torch.Generator().manual_seed(i)) for i in range(20)
    }
    assert picks == {1}
    picks = {sample(logits, Sampling(1.0, top_p=0.5), torch.Generator().manual_seed(i)) for i in range(20)}
    assert picks == {1}


def test_sampling_draws_tokens_by_their_probability(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0]))  # the last: probability 0, never drawn
    g = torch.Generator().manual_seed(3)
    n = 4000
    counts = np.bincount([sample(logits, Sampling(1.0), g) for _ in range(n)], minlength=5)
    assert counts[4] == 0
    assert np.abs(counts[:4] / n - [0.1, 0.2, 0.3, 0.4]).max() < 0.03  # 4 standard deviations at 0.4
    # a uniform draw whose product with the total rounds up to it: the last token with any probability
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.tensor(1.0, dtype=torch.float64))
    assert draw(np.array([0.5, 0.5, 0.0, 0.0], np.float32)) == 1


def test_prompt_longer_than_context_is_refused(model) -> None:
    with pytest.raises(ForgeError, match="context"):
        generate(model, list(range(100)), 4, context=64)
    with pytest.raises(ForgeError, match="context"):
        model.forward(_ids(70), model.new_state(64))


# bad files ----------------------------------------------------------------------------------------------


def _copy_gguf(
    src: Path,
    dst: Path,
    drop: str | None = None,
    arch: str | None = None,
    retype: tuple[str, GGMLQuantizationType] | None = None,
) -> Path:
    """Rewrite a GGUF (tiny edits for error tests): drop a tensor, rename the architecture, or retag a type."""
    r = GGUFReader(src)
    a = arch or str(r.fields["general.architecture"].contents())
    w = GGUFWriter(dst, a)
    old = str(r.fields["general.architecture"].contents())
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        new_key = key.replace(old + ".", a + ".", 1) if key.startswith(old + ".") else key
        if vtype.name == "ARRAY":
            w.add_key_value(new_key, value, vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(new_key, value, vtype)
    for t in r.tensors:
        if t.name == drop:
            continue
        data, qtype = np.asarray(t.data), GGMLQuantizationType(t.tensor_type)
        if retype and t.name == retype[0]:
            from gguf import GGML_QUANT_SIZES

            qtype = retype[1]
            block, size = GGML_QUANT_SIZES[qtype]
            data = np.zeros((int(t.shape[1]), int(t.shape[0]) // block * size), dtype=np.uint8)
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            w.add_tensor(t.name, data, raw_dtype=qtype)
        else:
            w.add_tensor(t.name, data.view(np.uint8), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_bad_files_give_one_line_errors(example_bf16: Path, tmp_path: Path) -> None:
    with pytest.raises(ForgeError, match="missing tensor blk.1.attn_k.weight"):
        load_model(_copy_gguf(example_bf16, tmp_path / "missing.gguf", drop="blk.1.attn_k.weight"))
    with pytest.raises(ForgeError, match="unsupported architecture 'llama'"):
        load_model(_copy_gguf(example_bf16, tmp_path / "llama.gguf", arch="llama"))
    with pytest.raises(ForgeError, match="cannot decode quant type Q8_1"):
        load_model(
            _copy_gguf(
                example_bf16, tmp_path / "q81.gguf", retype=("blk.0.attn_q.weight", GGMLQuantizationType.Q8_1)
            )
        )
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(example_bf16.read_bytes()[:4096])
    with pytest.raises(ForgeError):
        load_model(truncated)
    with pytest.raises(ForgeError, match="no such file"):
        load_model(tmp_path / "absent.gguf")


def test_cli_run_and_eval(example_bf16: Path, tmp_path: Path) -> None:
    import json

    import typer
    from typer.testing import CliRunner

    from runtime.cli import eval_, run

    app = typer.Typer()
    app.command("run")(run)
    app.command("eval")(eval_)
    runner = CliRunner()
    res = runner.invoke(app, ["run", str(example_bf16), "-p", "import os\n", "-n", "8", "--threads", "1"])
    assert res.exit_code == 0, res.output
    assert "decode: 8 tokens" in res.output or "stop: stop-token" in res.output
    text = Path(__file__).resolve().parents[1] / "examples" / "tiny-qwen3moe-val-excerpt.txt"
    saved = tmp_path / "ref.npz"
    eval_args = ["eval", str(example_bf16), "--text", str(text), "--ctx", "128", "--chunks", "3", "--json"]
    res = runner.invoke(app, [*eval_args, "--save-logits", str(saved), "--top-k", "4096"])
    assert res.exit_code == 0, res.output
    first = json.loads(res.stdout)
    assert first["tokens"] == 3 * 63 and first["perplexity"] > 1 and first["saved_logits_bytes"] > 0
    res = runner.invoke(app, [*eval_args, "--reference-logits", str(saved)])
    again = json.loads(res.stdout)
    # the same model against its own saved (full-vocabulary) logits: no divergence at all
    assert again["perplexity"] == first["perplexity"] and abs(again["kld_mean"]) < 1e-3
    assert again["top1_agreement"] == 1.0
    res = runner.invoke(
        app, ["eval", str(example_bf16), "--text", str(text), "--ctx", "8192"]
    )  # > n_ctx_train
    assert res.exit_code != 0 and isinstance(res.exception, ForgeError)
