"""The cuda backend end to end (needs CUDA; marked ``gpu``): the Triton kernels on GGUF blocks, eagerly and
with the decode step captured as CUDA graphs, against the torch reference on the same device, for both
model families: prefill and decode-step logits within 1e-4 of the logit scale, 64 greedy tokens identical.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.models import MoeCausalLM, load_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PROMPT, STEPS = 40, 64


@pytest.fixture(scope="module")
def models(example_bf16: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from forge.quant.quantize import quantize
    from runtime.synth import synthesize

    d = tmp_path_factory.mktemp("cuda-models")
    quantize(example_bf16, d / "qwen3moe-q4_k_m.gguf", "q4_k_m")
    synthesize(d / "qwen35moe-q4_k.gguf", "qwen3.6-35b-a3b", "q4_k", layers=4, vocab=4096, experts=32)
    return {"qwen3moe": d / "qwen3moe-q4_k_m.gguf", "qwen35moe": d / "qwen35moe-q4_k.gguf"}


def _run(model: MoeCausalLM, prompt: torch.Tensor) -> tuple[torch.Tensor, list[int], MoeCausalLM, object]:
    """Prefill logits, then each greedy decode step's logits, and the tokens."""
    st = model.new_state()
    logits = [model.forward(prompt, st)]
    tokens = [int(logits[0][-1].argmax())]
    for _ in range(STEPS):
        logits.append(model.forward(torch.tensor(tokens[-1:], device="cuda"), st))
        tokens.append(int(logits[-1][-1].argmax()))
    return torch.cat(logits), tokens, model, st


def _load(path: Path, monkeypatch: pytest.MonkeyPatch, kernels: str, graphs: str) -> MoeCausalLM:
    monkeypatch.setenv("FORGE_CUDA_KERNELS", kernels)
    monkeypatch.setenv("FORGE_CUDA_GRAPHS", graphs)
    return load_model(path, "cuda")


@pytest.mark.parametrize("family", ["qwen3moe", "qwen35moe"])
def test_kernels_and_graphs_match_the_torch_reference(
    family: str, models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = models[family]
    ref = _load(path, monkeypatch, "0", "0")
    prompt = torch.randint(0, ref.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(1)).cuda()
    ref_logits, ref_tokens, _, _ = _run(ref, prompt)
    del ref
    scale = ref_logits.abs().max()
    for graphs in ("0", "1"):
        logits, tokens, model, st = _run(_load(path, monkeypatch, "1", graphs), prompt)
        assert float((logits - ref_logits).abs().max() / scale) < 1e-4, f"graphs={graphs}"
        assert tokens == ref_tokens, f"graphs={graphs}"
        captured = getattr(st, "graphs", None)
        replays = 0 if captured is None else captured.replays
        assert (replays >= STEPS - 2) == (graphs == "1"), replays  # steps 1-2: warm-up and capture
        del model


def test_a_graph_follows_prefills_masks_and_a_second_sequence(
    models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill in the middle of decoding, a prune mask set between steps and a second sequence on the same
    model: the graphed steps give what the eager steps give."""
    path = models["qwen35moe"]

    def session(model: MoeCausalLM) -> torch.Tensor:
        g = torch.Generator().manual_seed(2)
        out = []
        for _seq in range(2):
            st = model.new_state()
            out.append(model.forward(torch.randint(0, 4096, (20,), generator=g).cuda(), st))
            for i in range(12):
                if i == 6:
                    out.append(model.forward(torch.randint(0, 4096, (5,), generator=g).cuda(), st))
                    pruned = torch.zeros(len(model.routed_layers()), model.n_expert, dtype=torch.bool)
                    pruned[:, : model.n_expert // 2] = True
                    model.set_prune_mask(pruned)
                out.append(model.forward(out[-1][-1:].argmax(-1), st))
            model.set_prune_mask(None)
        return torch.cat(out)

    eager = session(_load(path, monkeypatch, "1", "0"))
    graphed = session(_load(path, monkeypatch, "1", "1"))
    assert float((graphed - eager).abs().max() / eager.abs().max()) < 1e-4


def test_a_resident_model_holds_its_file_bytes_not_float32_copies(models: dict[str, Path]) -> None:
    """GPU memory after load is the tensors' file bytes (every quantized weight stays encoded), not a
    float32 decode of them (which would be about 7x for Q4_K)."""
    from forge.gguf_file import GGUFFile

    path = models["qwen35moe"]
    tensor_bytes = sum(t.nbytes for t in GGUFFile(path).tensors.values())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    model = load_model(path, "cuda")
    held = torch.cuda.memory_allocated() - before
    assert held <= 1.15 * tensor_bytes, (held, tensor_bytes)
    del model


@pytest.mark.parametrize("family", ["glm4moe", "glm-dsa", "deepseek4"])
def test_other_families_on_cuda_match_the_cpu(
    family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GLM (grouped sigmoid routing, dense leading layers), GLM-5 (DSA indexer) and DeepSeek V4 (MLA-like
    attention, hyper-connections, hash routing) on CUDA, kernels and graphs on: their bf16 files' prompt
    and greedy-step logits within 1e-4 of the logit scale of the CPU run, the same greedy tokens."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from forge.convert import convert_checkpoint

    if family == "deepseek4":
        from deepseek4_fixture import write_deepseek4

        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
        from deepseek4_runtime_oracle import RUNTIME_FIXTURE

        hf = write_deepseek4(tmp_path / "tiny", **RUNTIME_FIXTURE)  # type: ignore[arg-type]
    else:
        from glm_fixture import write_glm4moe, write_glm_dsa

        hf = (write_glm_dsa if family == "glm-dsa" else write_glm4moe)(tmp_path / "tiny")
    path = tmp_path / "bf16.gguf"
    convert_checkpoint(hf, path, "bf16")
    cpu = load_model(path, "cpu")
    prompt = torch.randint(0, cpu.vocab_size, (24,), generator=torch.Generator().manual_seed(3))

    def run(model: MoeCausalLM, device: str) -> tuple[torch.Tensor, list[int]]:
        st = model.new_state()
        out = [model.forward(prompt.to(device), st).cpu()]
        tokens = [int(out[0][-1].argmax())]
        for _ in range(16):
            out.append(model.forward(torch.tensor(tokens[-1:], device=device), st).cpu())
            tokens.append(int(out[-1][-1].argmax()))
        return torch.cat(out), tokens

    ref_logits, ref_tokens = run(cpu, "cpu")
    logits, tokens = run(_load(path, monkeypatch, "1", "1"), "cuda")
    assert float((logits - ref_logits).abs().max() / ref_logits.abs().max()) < 1e-4
    assert tokens == ref_tokens
