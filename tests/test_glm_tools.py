"""glm4moe and glm-dsa through the rest of the toolkit: imatrix collection against llama-imatrix, prune masks
(masked == physically pruned, the selection bias sliced with the experts, MTP files refused), expert-major v2
files and SSD-streamed experts bit-identical to the canonical file, forge synth's GLM geometries."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from oracle import llamacpp_file, text

from forge.errors import ForgeError
from forge.gguf_file import open_gguf
from forge.imatrix.accumulate import collect
from forge.imatrix.formats import read_imatrix
from forge.layout import convert
from forge.mask_file import PruneMask
from forge.prune.apply import apply_mask
from forge.quant.quantize import quantize
from runtime.models import apply_prune_mask, load_model
from runtime.weights import GGUFWeights

N_ROUTED, N_EXPERT, N_USED = 2, 16, 4  # blk.0 is dense; blk.1, blk.2 routed (blk.3, the MTP block, not run)
MODELS = ("tiny-glm4moe", pytest.param("tiny-glm-dsa", marks=pytest.mark.slow))  # MLA runs the slow path


@pytest.fixture(scope="module", params=MODELS)
def q8(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Each tiny GLM quantized to Q8_0 without its MTP block."""
    out = tmp_path_factory.mktemp("glm-q8") / f"{request.param}-Q8_0.gguf"
    quantize(request.getfixturevalue(request.param.replace("-", "_")), out, "q8_0", mtp=False)
    return out


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 4105, (n,), generator=torch.Generator().manual_seed(seed))


def _logits(path_or_model, ids: torch.Tensor, **kw: object) -> torch.Tensor:
    """A prefill, then three one-token steps."""
    m = load_model(path_or_model, **kw) if isinstance(path_or_model, Path) else path_or_model
    st = m.new_state(64)
    return torch.cat(
        [m.forward(ids[:-3], st)] + [m.forward(ids[i : i + 1], st) for i in range(len(ids) - 3, len(ids))]
    )


def _mask(keep: int, seed: int) -> PruneMask:
    rng = np.random.default_rng(seed)
    pruned = np.ones((N_ROUTED, N_EXPERT), dtype=bool)
    for row in pruned:
        row[rng.choice(N_EXPERT, keep, replace=False)] = False
    return PruneMask(pruned, "random mask")


def test_masked_model_equals_physically_pruned_file(q8: Path, tmp_path: Path) -> None:
    mask = _mask(keep=10, seed=1)
    out = tmp_path / "pruned.gguf"
    apply_mask(q8, mask, out)
    small, big = open_gguf(out), open_gguf(q8)
    assert small.kv(f"{big.architecture}.expert_count") == 10
    for row, layer in enumerate((1, 2)):
        kept = np.flatnonzero(~mask.pruned[row])
        bias = f"blk.{layer}.exp_probs_b.bias"
        assert np.array_equal(
            small.raw(bias), big.raw(bias).reshape(N_EXPERT, -1)[kept].reshape(-1)
        )  # with its experts
        assert np.array_equal(
            small.raw(f"blk.{layer}.ffn_up_shexp.weight"), big.raw(f"blk.{layer}.ffn_up_shexp.weight")
        )
    masked = load_model(q8)
    assert masked.routed_layers() == [1, 2]
    apply_prune_mask(masked, mask)
    ids = _ids(40, seed=2)
    got = _logits(masked, ids)
    assert torch.equal(got, _logits(load_model(out), ids))
    assert not torch.equal(got, _logits(q8, ids))


def test_mtp_file_is_refused_by_apply(tiny_glm4moe: Path, tmp_path: Path) -> None:
    from forge.convert import convert_checkpoint

    src = tmp_path / "with-mtp.gguf"
    convert_checkpoint(tiny_glm4moe, src, "bf16")  # the NextN block's experts are in blk.3
    with pytest.raises(ForgeError, match="--no-mtp"):
        apply_mask(src, _mask(keep=8, seed=3), tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()


def test_expert_major_and_streamed_equal_canonical(q8: Path, tmp_path: Path) -> None:
    ids = _ids(24, seed=4)
    for budget in (0, 1 << 30):
        want = _logits(q8, ids, expert_budget=budget)
        for version in ("v2",):  # v1 is qwen-only
            dst = tmp_path / f"glm-{version}.gguf"
            convert(q8, dst, version)
            assert torch.equal(_logits(dst, ids, expert_budget=budget), want), (version, budget)
    floor = N_ROUTED * N_USED + 1
    resident = _logits(q8, ids, expert_budget=0)
    for path in (q8, tmp_path / "glm-v2.gguf"):
        assert len(GGUFWeights(path).expert_layers()) == N_ROUTED
        assert torch.equal(_logits(path, ids, stream_experts=floor), resident), path.name


#: (model, (token, slot) routing choices per layer that may differ from llama-imatrix's, relative tolerance of
#: the squared-activation sums). Measured with ggml's input rounding: glm4moe 3 of 16384 per layer (near ties;
#: each moves one count between two experts), sums within 1%; glm-dsa 11 and 22 in its two routed layers: its
#: DSA indexer keeps 8 keys per query and flips on near ties too (llama.cpp's indexer keys go through a
#: Hadamard rotation and its cache), which moves later layers' activations by up to 4.4%.
IMATRIX_AGREEMENT = [("tiny-glm4moe", 4, 0.01), ("tiny-glm-dsa", 32, 0.05)]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "choices", "rel"), IMATRIX_AGREEMENT)
def test_imatrix_collection_matches_llama_imatrix(
    request: pytest.FixtureRequest, model: str, choices: int, rel: float, tmp_path: Path
) -> None:
    """llama-imatrix on llama.cpp's own conversion (benchmarks/glm_oracle.py: text/calib.txt, 8 chunks of 512):
    the same tensors (glm-dsa: the per-head attn_k_b / attn_v_b products included), the same token counts."""
    ours_path = tmp_path / "imatrix.gguf"
    collect(request.getfixturevalue(model.replace("-", "_")), text("calib.txt"), ours_path, ctx=512, chunks=8,
            log=None, ggml_numerics=True)  # fmt: skip
    ours, theirs = read_imatrix(ours_path), read_imatrix(llamacpp_file(model, f"{model}-imatrix.gguf"))
    assert ours.names() == theirs.names()
    assert not any(n.startswith("blk.3.") for n in ours.names())  # the MTP block is not run
    for name in theirs.names():
        a, b = ours.counts[name], theirs.counts[name]
        assert a.sum() == b.sum() and np.abs(a - b).sum() <= 2 * choices, name
        assert np.abs(ours.sums[name] - theirs.sums[name]).max() <= rel * np.abs(theirs.sums[name]).max(), (
            name
        )


@pytest.mark.slow  # writes, runs and loads in llama.cpp a 70-100 MB file
def test_synth_glm_geometry_runs_here_and_in_llamacpp(tmp_path: Path) -> None:
    """``forge synth --geometry glm-4.5-air`` (small: 3 layers, 16 experts, hidden 512): a glm4moe file with
    GLM-4.5-Air's expert FFN 1408 and dense FFN 10944 rows written as Q8_0 (not whole Q4_K blocks)."""
    from runtime.generate import Sampling, generate
    from runtime.synth import GEOMETRIES, synthesize
    from runtime.tokenizer import Tokenizer

    g = GEOMETRIES["glm-4.5-air"]
    assert (g.arch, g.layers, g.heads, g.kv_heads, g.experts, g.experts_used, g.dense_lead, g.expert_ff,
            g.dense_ff) == ("glm4moe", 46, 96, 8, 128, 8, 1, 1408, 10944)  # fmt: skip
    out = tmp_path / "glm.gguf"
    synthesize(out, "glm-4.5-air", "q4_k", layers=3, vocab=4096, experts=16, hidden=512, heads=8, kv_heads=2)
    f = open_gguf(out)
    types = {n: t.ggml_type.name for n, t in f.tensors.items()}
    assert types["blk.1.ffn_down_exps.weight"] == types["blk.0.ffn_down.weight"] == "Q8_0"
    assert types["blk.1.ffn_up_exps.weight"] == "Q4_K" and "blk.0.ffn_gate_inp.weight" not in types
    m = load_model(out)
    assert m.routed_layers() == [1, 2]
    tok = Tokenizer.from_metadata(m.weights)
    res = generate(
        m, tok.encode("hello"), 8, Sampling(temperature=1.0, seed=3), tokenizer=tok, stop_ids=set()
    )
    assert len(set(res.tokens)) > 1
    llama_cpp = pytest.importorskip("llama_cpp")
    text_out = llama_cpp.Llama(str(out), n_ctx=64, verbose=False)("hello", max_tokens=4)["choices"][0]["text"]
    assert text_out


@pytest.mark.slow  # writes, runs and loads in llama.cpp a 70-100 MB file
def test_synth_glm5_geometry_runs_here_and_in_llamacpp(tmp_path: Path) -> None:
    """``forge synth --geometry glm-5`` (small: 4 layers, 16 experts, hidden 512, 4 heads): a glm-dsa file, its
    attn_k_b rows (qk_nope 192) written as Q8_0."""
    from runtime.generate import Sampling, generate
    from runtime.synth import GEOMETRIES, synthesize
    from runtime.tokenizer import Tokenizer

    g = GEOMETRIES["glm-5"]
    assert (g.arch, g.layers, g.heads, g.experts, g.experts_used, g.dense_lead, g.q_lora, g.kv_lora, g.head_dim,
            g.rope_dim, g.v_dim, g.index_heads, g.index_dim) == ("glm-dsa", 78, 64, 256, 8, 3, 2048, 512, 256, 64,
                                                                 256, 32, 128)  # fmt: skip
    out = tmp_path / "glm5.gguf"
    synthesize(out, "glm-5", "q4_k", layers=4, vocab=4096, experts=16, hidden=512, heads=4)
    types = {n: t.ggml_type.name for n, t in open_gguf(out).tensors.items()}
    assert types["blk.3.attn_k_b.weight"] == "Q8_0" and types["blk.3.attn_v_b.weight"] == "Q4_K"
    m = load_model(out)
    assert m.routed_layers() == [3]
    tok = Tokenizer.from_metadata(m.weights)
    res = generate(
        m, tok.encode("hello"), 6, Sampling(temperature=1.0, seed=3), tokenizer=tok, stop_ids=set()
    )
    assert len(set(res.tokens)) > 1
    llama_cpp = pytest.importorskip("llama_cpp")
    assert llama_cpp.Llama(str(out), n_ctx=64, verbose=False)("hello", max_tokens=4)["choices"][0]["text"]
