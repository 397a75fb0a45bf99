"""Expert pruning: router masks, profiles, masks, physically pruned files (on the bundled example model)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import typer
from typer.testing import CliRunner

from forge.errors import ForgeError
from forge.gguf_file import KV, TensorSpec, open_gguf, write_gguf
from forge.mask_file import PruneMask, format_mask, parse_mask, read_mask
from forge.prune.apply import apply_mask
from forge.prune.cli import app
from forge.prune.collect import ExpertProfiler, collect_profile, profile_from_observer
from forge.prune.mask import build_mask
from forge.prune.profile import Profile
from runtime.models import apply_prune_mask, load_model
from runtime.observers import Observer

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "README.md"  # any text works for routing statistics
N_LAYER, N_EXPERT, N_USED = 4, 32, 4


@pytest.fixture(scope="module")
def example_q8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from conftest import EXAMPLE

    from forge.quant.quantize import quantize

    out = tmp_path_factory.mktemp("prune") / "tiny-q8_0.gguf"
    quantize(EXAMPLE, out, "q8_0")
    return out


@pytest.fixture(scope="module")
def loaded(example_bf16: Path):
    return load_model(example_bf16)


@pytest.fixture
def model(loaded):
    """The example model, loaded once; each test leaves it unmasked and without observers."""
    yield loaded
    loaded.set_prune_mask(None)
    loaded.observers.clear()


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 4096, (n,), generator=torch.Generator().manual_seed(seed))


def _random_mask(keep: int, seed: int = 0) -> PruneMask:
    rng = np.random.default_rng(seed)
    pruned = np.ones((N_LAYER, N_EXPERT), dtype=bool)
    for row in pruned:
        row[rng.choice(N_EXPERT, keep, replace=False)] = False
    return PruneMask(pruned, "random mask")


def _logits(model, ids: torch.Tensor, n_decode: int = 3) -> torch.Tensor:
    """A batched prefill, then a few one-token decode steps (both expert code paths)."""
    st = model.new_state()
    parts = [model.forward(ids[:-n_decode], st)]
    parts += [model.forward(ids[i : i + 1], st) for i in range(len(ids) - n_decode, len(ids))]
    return torch.cat(parts)


# ------------------------------------------------------------------------------------- router mask


def test_masking_nothing_changes_nothing(model) -> None:
    ids = _ids(40)
    base = _logits(model, ids)
    assert apply_prune_mask(model, PruneMask(np.zeros((N_LAYER, N_EXPERT), dtype=bool))) == 0
    assert torch.equal(_logits(model, ids), base)
    model.set_prune_mask(None)
    assert torch.equal(_logits(model, ids), base)


class RoutingRecorder(Observer):
    def __init__(self) -> None:
        self.chosen: dict[int, set[int]] = {}

    def on_routing(self, layer, experts, weights, logits) -> None:  # noqa: ANN001
        self.chosen.setdefault(layer, set()).update(experts.reshape(-1).tolist())


def test_masked_experts_are_never_routed_to(model) -> None:
    rec = RoutingRecorder()
    model.observers.append(rec)
    ids = _ids(48, seed=1)
    base = _logits(model, ids)
    mask = _random_mask(keep=8, seed=1)
    assert apply_prune_mask(model, mask) == N_LAYER * (N_EXPERT - 8)
    rec.chosen.clear()
    masked = _logits(model, ids)
    for row, layer in enumerate(model.routed_layers()):
        kept = set(np.flatnonzero(~mask.pruned[row]).tolist())
        assert rec.chosen[layer] <= kept
    assert not torch.equal(masked, base)


@pytest.mark.parametrize("which", ["bf16", "q8_0"])
def test_masked_model_equals_physically_pruned_file(
    which: str, example_bf16: Path, example_q8: Path, tmp_path: Path, model
) -> None:
    src = example_bf16 if which == "bf16" else example_q8
    mask = _random_mask(keep=12, seed=2)
    out = tmp_path / "pruned.gguf"
    rep = apply_mask(src, mask, out)
    assert rep.kept == 12 and rep.output_bytes == out.stat().st_size < src.stat().st_size

    small, big = open_gguf(out), open_gguf(src)
    assert small.kv("qwen3moe.expert_count") == 12 and small.kv("qwen3moe.expert_used_count") == N_USED
    assert not any(k.startswith("forge.reuse.") for k in small.kvs)
    for layer in range(N_LAYER):
        kept = np.flatnonzero(~mask.pruned[layer])
        for name in ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            t = f"blk.{layer}.{name}.weight"
            assert small.tensors[t].shape == (12, *big.tensors[t].shape[1:])
            assert small.tensors[t].ggml_type == big.tensors[t].ggml_type
            assert np.array_equal(small.raw(t).reshape(12, -1), big.raw(t).reshape(N_EXPERT, -1)[kept])
    assert np.array_equal(small.raw("output.weight"), big.raw("output.weight"))

    masked = model if which == "bf16" else load_model(src)
    apply_prune_mask(masked, mask)
    pruned = load_model(out)
    ids = _ids(44, seed=3)
    assert torch.equal(_logits(masked, ids), _logits(pruned, ids))


def test_qwen35moe_masked_equals_pruned_and_shared_expert_kept(tmp_path: Path) -> None:
    import oracle

    from forge.convert import convert_checkpoint

    src, out = tmp_path / "q35.gguf", tmp_path / "q35-pruned.gguf"
    convert_checkpoint(oracle.model_dir("tiny-qwen35moe"), src, "bf16")
    mask = _random_mask(keep=10, seed=7)
    apply_mask(src, mask, out)
    small, big = open_gguf(out), open_gguf(src)
    assert small.kv("qwen35moe.expert_count") == 10
    for name in ("ffn_up_shexp.weight", "ffn_gate_inp_shexp.weight"):
        assert np.array_equal(small.raw(f"blk.0.{name}"), big.raw(f"blk.0.{name}"))
    masked = load_model(src)
    assert masked.routed_layers() == list(range(N_LAYER))
    apply_prune_mask(masked, mask)
    pruned = load_model(out)
    ids = _ids(70, seed=8)  # > one 64-token delta-rule chunk
    assert torch.equal(_logits(masked, ids), _logits(pruned, ids))


def test_mask_on_a_pruned_file_is_refused(example_bf16: Path, tmp_path: Path) -> None:
    out = tmp_path / "pruned.gguf"
    apply_mask(example_bf16, _random_mask(keep=16), out)
    with pytest.raises(ForgeError, match="layer 0: 32 experts in the mask, the model has 16"):
        apply_prune_mask(load_model(out), _random_mask(keep=16))


# ----------------------------------------------------------------------------------------- profile


def test_profile_counts_weights_rankings_and_json(example_bf16: Path, tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    rep = collect_profile(example_bf16, TEXT, out, ctx=64, chunks=3)
    prof = Profile.load(out)
    assert rep.tokens == prof.tokens == 3 * 64
    assert [lp.layer for lp in prof.layers] == list(range(N_LAYER))
    assert sum(int(lp.count.sum()) for lp in prof.layers) == prof.tokens * N_LAYER * N_USED
    for lp in prof.layers:
        assert int(lp.count.sum()) == prof.tokens * N_USED
        assert lp.weight.sum() == pytest.approx(prof.tokens, rel=1e-5)  # each token's weights sum to 1
        assert ((lp.count == 0) == (lp.saliency == 0)).all() and (lp.saliency >= 0).all()
        for metric in ("count", "weight", "saliency"):
            order = lp.ranking(metric)
            assert sorted(order) == list(range(N_EXPERT))
            assert (np.diff(lp.metric(metric)[order]) <= 0).all()
        assert json.loads(out.read_text())["layers"][lp.layer]["ranking"]["count"] == lp.ranking("count")


def _scaled_down_expert(src: Path, dest: Path, layer: int, expert: int) -> None:
    """A copy of a bf16 GGUF with one expert's down projection doubled (exact in bf16)."""
    f = open_gguf(src)
    name = f"blk.{layer}.ffn_down_exps.weight"

    def data():  # noqa: ANN202
        for t in f.tensors:
            raw = np.array(f.raw(t))
            if t == name:
                bits = raw.view("<u2").reshape(N_EXPERT, -1)
                values = (bits[expert].astype(np.uint32) << 16).view(np.float32) * 2
                bits[expert] = (values.view(np.uint32) >> 16).astype(np.uint16)
            yield raw

    specs = [TensorSpec(t.name, t.shape, t.ggml_type) for t in f.tensors.values()]
    write_gguf(
        dest, [KV(k.key, k.value, k.vtype, k.item_type) for k in f.kvs.values()], specs, data(), f.alignment
    )


@pytest.mark.parametrize("one_token", [False, True])
def test_saliency_is_route_weight_times_expert_output_norm(
    one_token: bool, example_bf16: Path, tmp_path: Path
) -> None:
    ids = _ids(24, seed=4)

    def profile(path: Path) -> Profile:
        obs = ExpertProfiler()
        model = load_model(path, observers=[obs])
        st = model.new_state()
        if one_token:
            for i in range(len(ids)):
                model.forward(ids[i : i + 1], st)
        else:
            model.forward(ids, st)
        return profile_from_observer(obs, N_USED, len(ids))

    base = profile(example_bf16)
    layer = 1
    expert = int(base.layers[layer].ranking("count")[0])
    doubled = tmp_path / "doubled.gguf"
    _scaled_down_expert(example_bf16, doubled, layer, expert)
    other = profile(doubled)
    a, b = base.layers[layer], other.layers[layer]
    assert np.array_equal(a.count, b.count) and np.array_equal(a.weight, b.weight)  # routing is upstream
    assert b.saliency[expert] == 2 * a.saliency[expert] > 0
    rest = np.arange(N_EXPERT) != expert
    assert np.array_equal(a.saliency[rest], b.saliency[rest])


# -------------------------------------------------------------------------------------------- masks


def _profile(counts: np.ndarray, weights: np.ndarray | None = None) -> Profile:
    from forge.prune.profile import LayerProfile

    weights = counts.astype(float) if weights is None else weights
    layers = [LayerProfile(i, c.astype(np.int64), w, w / np.maximum(c, 1)) for i, (c, w) in
              enumerate(zip(counts, weights, strict=True))]  # fmt: skip
    return Profile(layers, counts.shape[1], 2, int(counts[0].sum()) // 2)


def test_build_mask_keeps_the_top_of_each_ranking() -> None:
    rng = np.random.default_rng(5)
    counts = rng.permutation(np.arange(1, 9) * 10)[None].repeat(3, 0)
    weights = rng.random((3, 8)) * 100
    prof = _profile(counts, weights)
    for by, values in (("count", counts), ("weight", weights)):
        m = build_mask(prof, keep=3, by=by)
        for row in range(3):
            assert set(np.flatnonzero(~m.pruned[row])) == set(np.argsort(-values[row])[:3])
    assert build_mask(prof, keep_fraction=0.5).kept_per_layer() == [4, 4, 4]
    assert build_mask(prof, keep_fraction=0.3).kept_per_layer() == [2, 2, 2]  # 2.4 -> 2
    assert build_mask(prof, keep_fraction=0.1).kept_per_layer() == [2, 2, 2]  # never below experts-per-token
    # coverage: counts 80, 70, 60 are 210 of 360 (58%): 0.55 needs 3 experts, 0.6 needs 4
    assert build_mask(prof, coverage=0.55).kept_per_layer() == [3, 3, 3]
    assert build_mask(prof, coverage=0.6).kept_per_layer() == [4, 4, 4]
    assert build_mask(prof, coverage=1.0).kept_per_layer() == [8, 8, 8]
    with pytest.raises(ForgeError, match="--keep must be between"):
        build_mask(prof, keep=1)
    with pytest.raises(ForgeError, match="exactly one"):
        build_mask(prof, keep=3, coverage=0.5)


def test_mask_text_round_trip_and_format_errors() -> None:
    m = _random_mask(keep=10, seed=6)
    text = format_mask(m)
    assert text.count("\n") == N_LAYER and set(text) == {"0", "1", "\n"}
    assert np.array_equal(parse_mask("# a comment\n\n" + text).pruned, m.pruned)
    with pytest.raises(ForgeError, match="unexpected character 'x'"):
        parse_mask("01x0\n")
    with pytest.raises(ForgeError, match="layer line 1 has 3 experts"):
        parse_mask("0100\n010\n")
    with pytest.raises(ForgeError, match="empty"):
        parse_mask("# nothing\n")


def test_wrong_masks_are_refused_naming_the_layer(example_bf16: Path, tmp_path: Path, model) -> None:
    rows = format_mask(_random_mask(keep=8)).splitlines()
    cases = {
        "no line for layer 3": rows[:3],
        "line 5 has no layer": [*rows, rows[0]],
        "layer 0: 31 experts in the mask, the model has 32": [r[:31] for r in rows],
        "layer 2 keeps 3 experts, fewer than the 4": rows[:2] + ["0001" + "1" * 28] + rows[3:],
    }
    for message, lines in cases.items():
        mask = parse_mask("\n".join(lines))
        with pytest.raises(ForgeError, match=message):
            apply_prune_mask(model, mask)
        with pytest.raises(ForgeError, match=message):
            apply_mask(example_bf16, mask, tmp_path / "x.gguf")
    assert list(tmp_path.iterdir()) == []


def test_uneven_mask_is_refused_by_apply_and_leaves_nothing(
    example_bf16: Path, tmp_path: Path, model
) -> None:
    pruned = _random_mask(keep=8).pruned
    pruned[2, np.flatnonzero(pruned[2])[0]] = False  # layer 2 keeps 9
    with pytest.raises(ForgeError, match=r"layer 1: 8, layer 2: 9.*--prune-mask"):
        apply_mask(example_bf16, PruneMask(pruned), tmp_path / "x.gguf")
    assert list(tmp_path.iterdir()) == []
    # the runtime takes it as a mask
    assert apply_prune_mask(model, PruneMask(pruned)) == N_LAYER * 24 - 1


# ---------------------------------------------------------------------------------------------- CLI


def test_cli_profile_mask_apply_and_runtime_flag(example_bf16: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    prof, mask, small = tmp_path / "p.json", tmp_path / "m.txt", tmp_path / "s.gguf"
    res = runner.invoke(app, ["profile", str(example_bf16), "--text", str(TEXT), "-o", str(prof),
                              "--ctx", "32", "--chunks", "2", "--json"])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["tokens"] == 64
    res = runner.invoke(
        app, ["mask", str(prof), "-o", str(mask), "--keep-fraction", "0.75", "--by", "saliency"]
    )
    assert res.exit_code == 0, res.output
    assert read_mask(mask).kept_per_layer() == [24] * N_LAYER
    res = runner.invoke(app, ["apply", str(example_bf16), "--mask", str(mask), "-o", str(small), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["expert_count"] == 24 and open_gguf(small).kv("qwen3moe.expert_count") == 24

    from runtime.cli import eval_

    rt = typer.Typer()
    rt.command("eval")(eval_)
    rt.command("other")(lambda: None)
    res = runner.invoke(rt, ["eval", str(example_bf16), "--text", str(TEXT), "--ctx", "32", "--chunks", "2",
                             "--prune-mask", str(mask), "--reference", str(small), "--json"])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "expert prune mask active: 32 of 128 experts masked" in res.stderr
    assert json.loads(res.stdout)["kld_mean"] == 0.0  # masked == physically pruned, bit for bit


def test_cli_errors_are_one_line(example_bf16: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_text("0" * 32 + "\n")
    proc = subprocess.run([sys.executable, "-m", "forge.prune.cli", "apply", str(example_bf16), "--mask",
                           str(bad), "-o", str(tmp_path / "o.gguf")], capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"error: {bad}: 1 mask lines for 4 routed layers: no line for layer 1"
    ]
    res = CliRunner().invoke(app, ["mask", str(bad), "-o", str(tmp_path / "m.txt"), "--keep", "8"])
    assert isinstance(res.exception, ForgeError) and "not a JSON expert profile" in str(res.exception)
