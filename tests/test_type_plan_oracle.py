"""llama-quantize's type plan on real geometries: every forge preset that llama.cpp has, on bf16 GGUFs with the
real layer counts, head grouping, expert counts, shared-expert / DeltaNet / MTP patterns and tied embeddings of
the models below (small widths; benchmarks/type_plan_oracle.py writes them and says why that is enough).

Three oracles, each optional: llama.cpp in process (``llama_cpp`` of llama-cpp-python: its
``llama_model_quantize``, dry run, with and without an imatrix), the ``llama-quantize`` binary
(FORGE_LLAMA_QUANTIZE), and the digests of llama.cpp's plans recorded in tests/fixtures/type_plan_oracle.json
(no llama.cpp needed: what CI runs).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmark_scripts import load
from tests.oracle import SHIPPED, llama_quantize, manifest

tpo = load("type_plan_oracle")

RECORDED = SHIPPED / "type_plan_oracle.json"

# The geometry table (from each model's config.json). blocks = decoder layers + MTP block; heads / KV heads;
# routed experts (used per token); shexp = shared expert; DeltaNet = Gated DeltaNet layers (the rest full
# attention, every 4th). Qwen3.5-397B-A17B's numbers are from memory of its config.json (60 layers, 32 / 2
# heads, 512 experts top 10, 16 / 64 DeltaNet key / value heads): the rules only see n_gqa >= 4 (16 either way),
# n_expert (not 8, >= 4) and the layer count (llama.cpp's loader names 60 layers 397B_A17B, which agrees).
# Dense layers: none of these models has any (decoder_sparse_step 1, mlp_only_layers []), and llama.cpp's
# qwen3moe / qwen35moe loaders know none. Size classes: only LLM_TYPE_70B changes a rule, and no qwen3moe /
# qwen35moe model gets it. The -synthetic rows reach branches the real ones do not: n_expert == 8, n_gqa < 4,
# n_expert < 4, rows that are not a multiple of 256.
#   name                            arch       blocks heads kv experts used shexp DeltaNet tied  hidden
GEOMETRY_TABLE = [
    ("qwen3-30b-a3b",                 "qwen3moe",  48, 32, 4, 128, 8,  False, 0,  False, 256),
    ("qwen3-235b-a22b",               "qwen3moe",  94, 64, 4, 128, 8,  False, 0,  False, 256),
    ("qwen3-coder-480b-a35b",         "qwen3moe",  62, 96, 8, 160, 8,  False, 0,  False, 256),
    ("qwen3.6-35b-a3b",               "qwen35moe", 41, 16, 2, 256, 8,  True,  30, False, 256),
    ("qwen3.6-35b-a3b-nomtp",         "qwen35moe", 40, 16, 2, 256, 8,  True,  30, False, 256),
    ("qwen3.5-397b-a17b",             "qwen35moe", 61, 32, 2, 512, 10, True,  45, False, 256),
    ("qwen3-30b-a3b-tied",            "qwen3moe",  48, 32, 4, 128, 8,  False, 0,  True,  256),
    ("qwen3moe-8x-synthetic",         "qwen3moe",  32, 32, 8, 8,   2,  False, 0,  False, 256),
    ("qwen3moe-hidden1088-synthetic", "qwen3moe",  24, 16, 4, 64,  4,  False, 0,  False, 1088),
    ("qwen35moe-gqa2-synthetic",      "qwen35moe", 25, 4,  2, 32,  4,  True,  18, False, 256),
    ("qwen3moe-gqa2-2x-synthetic",    "qwen3moe",  16, 8,  4, 2,   1,  False, 0,  False, 256),
    ("glm-4.5-air",                   "glm4moe",   47, 96, 8, 128, 8,  True,  0,  False, 256),
    ("glm-4.5-air-nomtp",             "glm4moe",   46, 96, 8, 128, 8,  True,  0,  False, 256),
    ("glm-4.6",                       "glm4moe",   93, 96, 8, 160, 8,  True,  0,  False, 256),
    ("deepseek-v4-flash",             "deepseek4", 43, 64,  1, 256, 6, True,  0,  False, 256),
    ("deepseek-v4-pro",               "deepseek4", 61, 128, 1, 384, 6, True,  0,  False, 256),
    ("glm-5",                         "glm-dsa",   79, 64,  64, 256, 8, True, 0,  False, 256),
]  # fmt: skip
# GLM (glm4moe, from zai-org's config.json): leading dense layers (GLM-4.5-Air 1, GLM-4.5/4.6/4.7 3), q/k
# biases, q/k norms on GLM-4.5/4.6/4.7 only; GLM-5 (glm-dsa): MLA (real widths) + DSA indexer, 3 dense layers; GLM-4.5-Air's FFN widths (10944, expert 1408) are not multiples
# of 256, so its ffn_down tensors take llama-quantize's row-length fallbacks (the files keep the remainders).
#   name                 dense-lead  dense ffn  expert ffn  q/k norm
GLM_TABLE = [
    ("glm-4.5-air",       1,         448,       384,        False),
    ("glm-4.5-air-nomtp", 1,         448,       384,        False),
    ("glm-4.6",           3,         512,       256,        True),
    ("glm-5",             3,         512,       256,        False),
]  # fmt: skip
# DeepSeek V4 (deepseek-ai's config.json): the first num_hash_layers layers hash-routed (tid2eid), per-layer
# compress_ratios (Flash: layers 0-1 window only, then 4 / 128 alternating; Pro: layers 0-1 128, then 128 / 4
# alternating), grouped output projection (o_groups). The MTP block is not in llama.cpp's converted file.
#   name                 hash  ratio-0  ratio-4  ratio-128  o_groups
DEEPSEEK4_TABLE = [
    ("deepseek-v4-flash", 3,    2,       21,      20,        8),
    ("deepseek-v4-pro",   3,    0,       29,      32,        16),
]  # fmt: skip
GEOMETRIES = [row[0] for row in GEOMETRY_TABLE]


def _row(g: tpo.Geometry) -> tuple:
    _, specs = tpo.model(g)
    names = {s.name for s in specs}
    deltanet = sum(f"blk.{i}.ssm_out.weight" in names for i in range(g.block_count))
    shexp = any(n.endswith(".ffn_down_shexp.weight") for n in names)
    return (g.name, g.arch, g.block_count, g.heads, g.kv_heads, g.experts, g.experts_used, shexp, deltanet,
            "output.weight" not in names, g.hidden)  # fmt: skip


def test_geometry_table_is_what_the_files_hold() -> None:
    assert [_row(g) for g in tpo.GEOMETRIES.values()] == GEOMETRY_TABLE


def test_glm_table_is_what_the_files_hold() -> None:
    rows = []
    for name, *_ in GLM_TABLE:
        g = tpo.GEOMETRIES[name]
        specs = {s.name: s.shape for s in tpo.model(g)[1]}
        dense = [i for i in range(g.block_count) if f"blk.{i}.ffn_down.weight" in specs]
        assert dense == list(range(len(dense)))
        rows.append((name, len(dense), specs["blk.0.ffn_down.weight"][1],
                     specs[f"blk.{len(dense)}.ffn_down_exps.weight"][2], "blk.0.attn_q_norm.weight" in specs))  # fmt: skip
    assert rows == GLM_TABLE


def test_deepseek4_table_is_what_the_files_hold() -> None:
    rows = []
    for name, *_ in DEEPSEEK4_TABLE:
        g = tpo.GEOMETRIES[name]
        kvs, specs = tpo.model(g)
        names = {s.name for s in specs}
        ratios = next(kv.value for kv in kvs if kv.key == "deepseek4.attention.compress_ratios")
        assert len(ratios) == g.layers
        for i, r in enumerate(ratios):  # the compressor / indexer tensors follow the ratio
            assert (f"blk.{i}.attn_compressor_kv.weight" in names) == (r != 0)
            assert (f"blk.{i}.indexer.proj.weight" in names) == (r == 4)
        hashed = sum(f"blk.{i}.ffn_gate_tid2eid.weight" in names for i in range(g.layers))
        groups = next(kv.value for kv in kvs if kv.key == "deepseek4.attention.output_group_count")
        rows.append((name, hashed, ratios.count(0), ratios.count(4), ratios.count(128), groups))
    assert rows == DEEPSEEK4_TABLE


def _ne(shape: tuple[int, ...]) -> list[int]:
    return list(reversed(shape))


@pytest.mark.parametrize(
    "model, geometry",
    [
        ("tiny-qwen3moe", tpo.Geometry("tiny", "qwen3moe", 4, 4, 2, 64, 32, 4)),
        ("tiny-qwen35moe", tpo.Geometry("tiny", "qwen35moe", 4, 4, 2, 64, 32, 4, linear_k_heads=2,
                                        linear_v_heads=4, linear_head_dim=64)),
        ("tiny-glm4moe", tpo.GlmGeometry("tiny", "glm4moe", 3, 4, 2, 64, 16, 4, mtp=1, dense_lead=1,
                                         dense_ff=512, expert_ff=256, qk_norm=True)),
    ],
)  # fmt: skip
def test_tensor_sets_are_llamacpp_converters(model: str, geometry: tpo.Geometry) -> None:
    """The synthetic files hold the tensors llama.cpp's converter writes (fixture geometry: same widths)."""
    theirs = {t["name"]: (t["type"], t["shape"]) for t in manifest(model, "bf16")["tensors"]}
    kvs, specs = tpo.model(geometry)
    ours = {s.name: (s.ggml_type.name, _ne(s.shape)) for s in specs}
    assert set(ours) == set(theirs)
    vocab = {"token_embd.weight", "output.weight"}  # the fixture's vocabulary is larger
    assert {n: v for n, v in ours.items() if n not in vocab} == {
        n: v for n, v in theirs.items() if n not in vocab
    }
    keys = {kv.key for kv in kvs}
    arch_keys = {k for k in manifest(model, "bf16")["kv"] if k.startswith(geometry.arch + ".")}
    assert arch_keys <= keys


def test_deepseek4_tensor_set_is_llamacpp_converters() -> None:
    """The synthetic deepseek4 files hold what llama.cpp's converter writes from a published (FP8 + FP4)
    checkpoint: the tiny FP8 fixture's geometry gives its manifest's names, types and shapes."""
    tiny = tpo.Deepseek4Geometry("tiny", "deepseek4", 4, 4, 1, 64, 8, 2, hidden=256, q_lora=64, o_groups=2,
                                 o_lora=32, hash_layers=2, compress_ratios=(0, 4, 128, 4), index_heads=4,
                                 attn_head_dim=64)  # fmt: skip
    ref = manifest("tiny-deepseek4", "fp8")
    theirs = {t["name"]: (t["type"], t["shape"]) for t in ref["tensors"]}
    kvs, specs = tpo.model(tiny)
    ours = {s.name: (s.ggml_type.name, _ne(s.shape)) for s in specs}
    vocab = {"token_embd.weight", "output.weight"} | {n for n in theirs if "tid2eid" in n}  # vocabulary sized
    assert set(ours) == set(theirs)
    assert {n: v for n, v in ours.items() if n not in vocab} == {
        n: v for n, v in theirs.items() if n not in vocab
    }
    assert {k for k in ref["kv"] if k.startswith("deepseek4.") and "rope.scaling" not in k} <= {
        kv.key for kv in kvs
    }


def test_tied_embeddings_fact(tmp_path: Path) -> None:
    """No output.weight: token_embd takes the output's rule (llama-quantize's has_tied_embeddings)."""
    plans = {}
    for name in ("qwen3-30b-a3b", "qwen3-30b-a3b-tied"):
        path = tmp_path / f"{name}.gguf"
        tpo.write_model(tpo.GEOMETRIES[name], path)
        plans[name] = tpo.forge_types(path, "q4_k_m", None)
    assert plans["qwen3-30b-a3b"]["token_embd.weight"] == "Q4_K"
    assert plans["qwen3-30b-a3b"]["output.weight"] == "Q6_K"
    assert plans["qwen3-30b-a3b-tied"]["token_embd.weight"] == "Q6_K"
    assert "output.weight" not in plans["qwen3-30b-a3b-tied"]


def test_every_llamacpp_mix_is_a_preset() -> None:
    """The mixes of llama-quantize that forge's types can make are all presets (TQ1_0/TQ2_0/Q1_0/Q2_0/NVFP4
    need their types: not in the registry)."""
    want = {"q8_0", "q6_k", "q5_k_m", "q5_k_s", "q5_1", "q5_0", "q4_k_m", "q4_k_s", "q4_1", "q4_0", "q3_k_l",
            "q3_k_m", "q3_k_s", "q2_k", "q2_k_s", "iq4_xs", "iq4_nl", "iq3_m", "iq3_s", "iq3_xs", "iq3_xxs",
            "iq2_m", "iq2_s", "iq2_xs", "iq2_xxs", "iq1_m", "iq1_s", "mxfp4_moe"}  # fmt: skip
    assert want <= set(tpo.available_recipes())


def _recorded() -> dict:
    if not RECORDED.is_file():
        pytest.skip(f"{RECORDED} is absent")
    return json.loads(RECORDED.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_recorded_llamacpp_plans(geometry: str, tmp_path: Path) -> None:
    """forge's plan of every preset equals llama.cpp's recorded one (digest of every tensor's type)."""
    rec = _recorded()
    assert rec["geometries"][geometry] == json.loads(json.dumps(tpo.asdict(tpo.GEOMETRIES[geometry])))
    # the presets llama.cpp had when the plans were recorded (no llama.cpp needed here)
    presets = sorted({key.split()[1] for key in rec["plans"] if key.split()[0] == geometry})
    results = tpo.recorded_check(geometry, presets, tmp_path, rec["plans"])
    assert len(results) >= 40
    assert [r for r in results if not r.ok] == []
    # forge refuses the imatrix-only presets without one, as llama-quantize does (with hidden 1088 the IQ3_XXS
    # tensors all fall back to IQ4_NL, and neither refuses iq3_xxs)
    plain = {r.preset for r in results if not r.imatrix}
    needs = {"iq2_xxs", "iq2_xs", "iq2_s", "iq2_m", "iq1_s", "iq1_m"}
    # (deepseek4 has no attn_k, which the iq3_xxs mix makes IQ2_S: neither refuses iq3_xxs there)
    g = tpo.GEOMETRIES[geometry]
    assert (needs | {"iq3_xxs"} if g.hidden % 256 == 0 and g.arch != "deepseek4" else needs).isdisjoint(plain)
    assert {"q4_k_m", "iq4_xs", "q2_k", "iq3_s"} <= plain


def _llama_cpp() -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")


@pytest.mark.slow
@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_llamacpp_in_process(geometry: str, tmp_path: Path) -> None:
    """Live: llama.cpp's own quantizer (dry run), every preset, with and without an imatrix."""
    _llama_cpp()
    results = tpo.run_geometry(geometry, tpo.comparable_presets(), tmp_path, oracle=tpo.Oracle())
    bad = {(r.preset, r.imatrix): r.diffs[:5] for r in results if not r.ok}
    assert bad == {}
    assert all(r.tensors > 100 for r in results)
    from importlib.metadata import version

    rec = _recorded()
    if version("llama-cpp-python") in rec["oracle"]:  # the record is llama.cpp's, kept in step
        assert {tpo.record_key(geometry, r.preset, r.imatrix): r.llama_digest for r in results} == {
            k: v for k, v in rec["plans"].items() if k.startswith(geometry + " ")
        }


@pytest.mark.slow
@pytest.mark.parametrize("geometry", ["qwen3.6-35b-a3b", "qwen3-30b-a3b-tied", "qwen3moe-8x-synthetic"])
def test_llama_quantize_binary(geometry: str, tmp_path: Path) -> None:
    """Live: the llama-quantize binary's --dry-run, the imatrix given as a file (forge's GGUF imatrix writer)."""
    binary = llama_quantize()
    results = tpo.run_geometry(geometry, tpo.comparable_presets(), tmp_path, oracle=tpo.Oracle(binary))
    assert len(results) >= 40
    assert {(r.preset, r.imatrix): r.diffs[:5] for r in results if not r.ok} == {}


SMALL = tpo.Geometry("small-qwen35moe", "qwen35moe", 8, 16, 2, 256, 8, 2, mtp=1, linear_k_heads=4,
                     linear_v_heads=8)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("preset, with_imatrix", [("q4_k_m", False), ("q4_0", True), ("iq2_xxs", True)])
def test_dry_run_types_are_written_types(preset: str, with_imatrix: bool, tmp_path: Path) -> None:
    """The oracle reads types from llama.cpp's dry run: a real run writes the same ones (random bf16 data)."""
    _llama_cpp()
    path = tmp_path / "small.gguf"
    tpo.write_model(SMALL, path, data="random")
    im = tpo.imatrix_for(tpo.model(SMALL)[1]) if with_imatrix else None
    dry = tpo.llama_types(path, preset, im)
    real = tpo.llama_types(path, preset, im, real=True)
    assert dry == real
    assert dry == tpo.forge_types(path, preset, im)
    assert len({t for t in real.values()}) >= 3  # a mixture, not one type


def test_cli_dry_run_json_is_the_plan(tmp_path: Path) -> None:
    """``forge quantize --dry-run --json`` prints the plan the oracle compares (tensor names and types)."""
    path = tmp_path / "small.gguf"
    tpo.write_model(SMALL, path, data="random")
    out = subprocess.run([sys.executable, "-m", "forge", "quantize", str(path), "--recipe", "q3_k_m", "--dry-run",
                          "--json"], capture_output=True, text=True, check=True).stdout  # fmt: skip
    printed = {t["name"]: t["to"] for t in json.loads(out)["tensors"]}
    assert printed == tpo.forge_types(path, "q3_k_m", None)
    # 8 experts: llama.cpp's Mixtral rules (attn_v-like and attn_k Q8_0, attn_output Q5_K)
    assert printed["blk.0.attn_qkv.weight"] == printed["blk.3.attn_k.weight"] == "Q8_0"
    assert printed["blk.3.attn_output.weight"] == "Q5_K"
    assert printed["blk.0.ffn_down_exps.weight"] == printed["blk.0.ffn_down_shexp.weight"] == "Q4_K"
    assert printed["blk.0.ffn_gate_exps.weight"] == "Q3_K"


def test_glm5_tensor_set_is_the_converters(tmp_path: Path) -> None:
    """The glm-5 rows' file holds the tensors (names, shapes, types) llama.cpp's converter writes, checked at the
    tiny GLM-5 fixture's widths with every layer running its indexer, through forge convert (byte-identical to
    llama.cpp's converter on the shipped tiny-glm-dsa manifests)."""
    from glm_fixture import write_glm_dsa

    from forge.convert import convert_checkpoint
    from forge.gguf_file import open_gguf

    src = write_glm_dsa(tmp_path / "tiny-glm-dsa", indexer_types=["full"] * 3)
    convert_checkpoint(src, tmp_path / "m.gguf", "bf16")
    theirs = {n: (t.ggml_type.name, list(t.shape)) for n, t in open_gguf(tmp_path / "m.gguf").tensors.items()}
    g = tpo.GlmDsaGeometry("tiny", "glm-dsa", 3, 4, 4, 16, 16, 4, mtp=1, dense_lead=1, dense_ff=512, expert_ff=256,
                           q_lora=256, kv_lora=256, rope_dim=32, nope_dim=64, v_dim=64, index_heads=4, index_dim=64)  # fmt: skip
    kvs, specs = tpo.model(g)
    ours = {s.name: (s.ggml_type.name, list(s.shape)) for s in specs}
    vocab = {"token_embd.weight", "output.weight"}  # the fixture's vocabulary is larger
    assert {n: v for n, v in ours.items() if n not in vocab} == {
        n: v for n, v in theirs.items() if n not in vocab
    }
