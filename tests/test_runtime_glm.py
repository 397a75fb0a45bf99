"""GLM runtimes against transformers (fp32) and llama.cpp's perplexity, on tiny random checkpoints
(tests/glm_fixture.py). glm4moe (Glm4MoeForCausalLM): routing (sigmoid + selection bias, group-limited top-k,
normalized and scaled weights), the ungated shared expert, leading dense layers, q/k/v biases, optional q/k
norms, partial RoPE. glm-dsa (GlmMoeDsaForCausalLM): MLA with the DSA lightning indexer keeping 8 keys per
query (and a layer sharing its selection) over 256-token prompts. The MTP blocks are not run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from glm_fixture import write_glm4moe, write_glm_dsa
from oracle import SHIPPED, text
from output_rows import check_last_only

from forge.convert import convert_checkpoint
from runtime.evaluate import evaluate, perplexity_tokens
from runtime.generate import generate
from runtime.models import load_model
from runtime.moe import MASKED_SCORE, GroupedScoredTopK, ScoredTopK
from runtime.tokenizer import Tokenizer

#: the shipped fixture's config, and one without q/k norms and biases, routed over 4 groups (2 used)
VARIANTS = {"base": {}, "grouped-plain": {"use_qk_norm": False, "attention_bias": False, "n_group": 4,
                                          "topk_group": 2}}  # fmt: skip


@pytest.fixture(scope="module")
def glm(tmp_path_factory: pytest.TempPathFactory):
    """variant (or "dsa", the GLM-5 fixture) -> (HF folder, forge-converted bf16 GGUF with the MTP block)."""
    made: dict[str, tuple[Path, Path]] = {}

    def get(variant: str) -> tuple[Path, Path]:
        if variant not in made:
            if variant == "dsa":
                d = write_glm_dsa(tmp_path_factory.mktemp(variant) / "tiny-glm-dsa")
            else:
                d = write_glm4moe(tmp_path_factory.mktemp(variant) / "tiny-glm4moe", **VARIANTS[variant])
            convert_checkpoint(d, d.parent / "bf16.gguf", "bf16")
            made[variant] = (d, d.parent / "bf16.gguf")
        return made[variant]

    return get


class _Proj:
    def __init__(self, n: int) -> None:
        self.n_out = n


@pytest.mark.slow  # importing transformers' modeling code takes seconds
def test_grouped_router_matches_transformers() -> None:
    glm_moe = pytest.importorskip("transformers.models.glm4_moe.modeling_glm4_moe")
    from transformers import Glm4MoeConfig

    torch.manual_seed(0)
    for n_group, topk_group in ((1, 1), (4, 2), (8, 3)):
        cfg = Glm4MoeConfig(n_routed_experts=32, num_experts_per_tok=6, n_group=n_group, topk_group=topk_group,
                            hidden_size=16, routed_scaling_factor=2.5, norm_topk_prob=True)  # fmt: skip
        ref = glm_moe.Glm4MoeTopkRouter(cfg)
        ref.weight.data.normal_()
        ref.e_score_correction_bias.normal_(0, 0.3)
        x = torch.randn(64, 16)
        logits, w_ref, ids_ref = ref(x)
        ours = GroupedScoredTopK(
            _Proj(32), 0, 6, [], 2, ref.e_score_correction_bias, True, 2.5, n_group, topk_group
        )
        ids, w = ours.select(logits)
        order_ref, order = ids_ref.sort(-1), ids.sort(-1)
        assert torch.equal(order.values, order_ref.values), (n_group, topk_group)
        torch.testing.assert_close(w.gather(1, order.indices), w_ref.gather(1, order_ref.indices))


def test_pruned_experts_are_never_chosen_whatever_their_bias() -> None:
    bias = torch.zeros(8)
    bias[3] = 100.0  # expert 3 would always be chosen
    r = GroupedScoredTopK(_Proj(8), 0, 2, [], 2, bias, True, 1.0, 2, 1)
    r.kept = torch.tensor([0, 1, 2, 4, 5, 6, 7])
    logits = torch.randn(16, 8)
    logits[:, 3] = MASKED_SCORE
    ids, w = r.select(logits)
    assert not (ids == 3).any() and torch.allclose(w.sum(-1), torch.ones(16))


def test_masked_scores_are_the_surviving_experts_own() -> None:
    """Under a prune mask each surviving expert's score is the score function of the surviving logits alone,
    bit for bit what a physically pruned router computes (a vectorized sigmoid rounds an element by its place
    in the row: 16 and 10 experts gave one ulp apart on an AVX2 host)."""
    for gating in (1, 2, 4):
        r = ScoredTopK(_Proj(16), 0, 4, [], gating)
        kept = torch.tensor([0, 2, 3, 5, 6, 8, 9, 11, 13, 15])
        pruned = ScoredTopK(_Proj(10), 0, 4, [], gating)
        r.kept = kept
        part = torch.randn(37, 10, generator=torch.Generator().manual_seed(gating))
        logits = torch.full((37, 16), MASKED_SCORE).index_copy_(1, kept, part)
        assert torch.equal(r.scores(logits)[:, kept], pruned.scores(part)), gating
        ids, w = r.select(logits)
        ids_p, w_p = pruned.select(part)
        assert torch.equal(ids, kept[ids_p]) and torch.equal(w, w_p), gating


def test_layers_dense_routed_and_mtp(glm) -> None:
    _, gguf = glm("base")
    m = load_model(gguf)
    assert m.n_layer == 3  # blk.3, the MTP block, is in the file and not run
    assert m.routed_layers() == [1, 2]  # blk.0 is dense (leading_dense_block_count 1)
    assert m.blocks[0].ffn.dense is not None and m.blocks[1].ffn.shared is not None


@pytest.mark.parametrize("variant", ["base", "dsa"])
def test_a_prefill_for_its_last_logits_computes_the_last_layers_experts_for_one_row(
    glm, variant: str
) -> None:
    check_last_only(
        load_model(glm(variant)[1]), torch.randint(0, 200, (20,), generator=torch.Generator().manual_seed(1))
    )


def test_glm_dsa_default_indexer_types() -> None:
    """llama.cpp's defaults without the KV (GLM_5_2_DEFAULT_INDEXER_TYPES past a 1M context)."""
    from runtime.models.glm_dsa import default_indexer_types

    assert default_indexer_types(202752, 78) == [True] * 78
    glm52 = default_indexer_types(1048576, 78)
    assert (
        glm52[:10] == [True, True, True, False, False, False, True, False, False, False] and sum(glm52) == 21
    )


def test_glm_dsa_layers(glm) -> None:
    m = load_model(glm("dsa")[1])
    assert m.n_layer == 3 and m.routed_layers() == [1, 2]
    assert [b.attn.indexer for b in m.blocks] == [True, False, True]  # indexer.types: full, shared, full


@pytest.mark.slow
@pytest.mark.parametrize("variant", [*VARIANTS, "dsa"])
def test_matches_transformers_fp32(glm, variant: str) -> None:
    from transformers import AutoModelForCausalLM

    folder, gguf = glm(variant)
    ours = load_model(gguf)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = Tokenizer.from_metadata(ours.weights)
    ids = torch.tensor(tok.encode(text("val.txt").read_text()[5000:15000])[:256])
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    got = ours.forward(ids, ours.new_state())
    assert (got - ref).abs().max() <= 1e-3 * ref.abs().max()
    prompt = ids[:48]
    with torch.no_grad():
        want = hf.generate(prompt[None], max_new_tokens=64, min_new_tokens=64, do_sample=False)[
            0, 48:
        ].tolist()
    assert generate(ours, prompt.tolist(), 64).tokens == want


@pytest.mark.slow
@pytest.mark.parametrize(("model", "variant"), [("tiny-glm4moe", "base"), ("tiny-glm-dsa", "dsa")])
def test_perplexity_matches_llamacpp(glm, model: str, variant: str) -> None:
    """llama-perplexity on llama.cpp's own conversion of the same checkpoint (benchmarks/glm_oracle.py)."""
    want = json.loads((SHIPPED / "llamacpp" / "glm_perplexity.json").read_text())[model]["bf16-no-mtp"]
    m = load_model(glm(variant)[1], ggml_numerics=True)
    ids = perplexity_tokens(
        Tokenizer.from_metadata(m.weights), text("val.txt").read_text(), want["ctx"], want["chunks"]
    )
    res = evaluate(m, ids, want["ctx"], want["chunks"])
    assert abs(res.perplexity / want["ppl"] - 1) <= 0.005, (res.perplexity, want["ppl"])


def test_glm4_tokenizer_matches_llamacpp(glm) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    gguf = glm("base")[1]
    body = text("val.txt").read_text()[:20000]
    theirs = llama_cpp.Llama(str(gguf), vocab_only=True, verbose=False).tokenize(body.encode(), add_bos=False)
    ours = Tokenizer.from_metadata(load_model(gguf).weights)
    assert ours.encode(body) == theirs
    user, observation = ours.special["<|user|>"], ours.special["<|observation|>"]
    assert {user, observation} <= ours.stop_ids  # GLM ends a turn with <|user|> (llama.cpp's eot), or eom
