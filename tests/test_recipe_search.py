"""`forge recipe search` (issue 20): the exact knapsack, recipes that reproduce their predicted file, the
partial forward the measurements use, bad budgets, and (slow) whole searches that resume."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from forge.errors import ForgeError
from forge.search.knapsack import bounds, solve

ROOT = Path(__file__).resolve().parents[1]
IMATRIX = ROOT / "tests/fixtures/llamacpp/tiny-qwen3moe/tiny-qwen3moe-imatrix.gguf"
CALIB = ROOT / "tests/fixtures/text/calib.txt"


# --- the knapsack -------------------------------------------------------------------------------------


def _brute(sizes: list[list[int]], costs: list[list[float]], budget: int) -> float | None:
    best = None
    for ch in itertools.product(*[range(len(s)) for s in sizes]):
        if sum(sizes[i][j] for i, j in enumerate(ch)) <= budget:
            c = sum(costs[i][j] for i, j in enumerate(ch))
            best = c if best is None else min(best, c)
    return best


@pytest.mark.parametrize("seed", range(4))
def test_knapsack_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(150):
        n = rng.randint(1, 6)
        sizes = [[rng.randint(1, 40) for _ in range(rng.randint(1, 4))] for _ in range(n)]
        costs = [[rng.choice([0.0, round(rng.random(), 4)]) for _ in s] for s in sizes]
        lo, hi = bounds(sizes)
        budget = rng.randint(lo - 5, hi + 5)
        want = _brute(sizes, costs, budget)
        sol = solve(sizes, costs, budget)
        if want is None:
            assert sol is None
            continue
        assert sol is not None
        assert sol.size == sum(sizes[i][j] for i, j in enumerate(sol.choice)) <= budget
        assert sol.cost == pytest.approx(want, abs=1e-9)
        assert sol.cost == pytest.approx(sum(costs[i][j] for i, j in enumerate(sol.choice)), abs=1e-12)


def test_knapsack_budget_is_exact_to_the_byte() -> None:
    # the cheapest answer needs every byte: one byte less must give a worse answer
    sizes = [[100, 170], [64, 129], [7, 9]]
    costs = [[1.0, 0.1], [1.0, 0.2], [0.5, 0.0]]
    full = solve(sizes, costs, 170 + 129 + 9)
    assert full is not None and full.choice == [1, 1, 1] and full.size == 308
    short = solve(sizes, costs, 307)
    assert short is not None and short.size <= 307 and short.cost > full.cost
    assert solve(sizes, costs, 170) is None  # below the smallest total (171)
    assert bounds(sizes) == (171, 308)


# --- the interaction correction ----------------------------------------------------------------------


def _two_family_groups() -> list:
    from gguf import GGMLQuantizationType as Q

    from forge.search.measure import Group, Option

    def group(name: str) -> Group:
        opts = [Option("Q2_K", (Q.Q2_K,), 10), Option("Q4_K", (Q.Q4_K,), 20)]
        return Group(name.removesuffix(".weight"), [name], 0, opts)

    return [group("blk.0.attn_q.weight"), group("blk.0.attn_k.weight"),
            group("blk.0.ffn_up_exps.weight"), group("blk.1.ffn_up_exps.weight")]  # fmt: skip


def test_family_scales_fit_the_whole_model_and_change_the_choice(tmp_path: Path) -> None:
    """Per-group costs say the experts' upgrades pay more; the whole models (attention's errors count 3x,
    the experts' 1x) say the attention's do: the fitted scales find that and the knapsack's answer changes."""
    from forge.search.correction import corrected, family_key, fit_scales
    from forge.search.measure import Measurements, choice_key
    from forge.search.search import _choose

    groups = _two_family_groups()
    assert [family_key(g) for g in groups] == ["attn", "attn", "ffn_exps", "ffn_exps"]
    costs = [[0.10, 0.02], [0.10, 0.02], [0.15, 0.01], [0.15, 0.01]]
    truth = {"attn": 3.0, "ffn_exps": 1.0}
    sizes = [[o.size for o in g.options] for g in groups]

    def true_kld(choice: list[int]) -> float:
        return sum(truth[family_key(g)] * c[j] for g, c, j in zip(groups, costs, choice, strict=True))

    points = [
        (ch, true_kld(ch)) for ch in ([0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 1, 0], [0, 1, 0, 1], [1, 1, 0, 0])
    ]
    scales = fit_scales(groups, costs, points)
    assert scales["attn"] / scales["ffn_exps"] == pytest.approx(3.0, rel=0.15)
    # one upgrade of 10 bytes affordable twice: by the per-group costs, the experts; by the truth, attention
    plain = solve(sizes, costs, 60)
    fixed = solve(sizes, corrected(groups, costs, scales), 60)
    assert plain is not None and fixed is not None
    assert plain.choice == [0, 0, 1, 1] and fixed.choice == [1, 1, 0, 0]
    assert true_kld(fixed.choice) < true_kld(plain.choice)
    # one point only (or none): a single common scale, which leaves the answer alone
    one = fit_scales(groups, costs, points[:1])
    assert one["attn"] == pytest.approx(one["ffn_exps"])
    assert fit_scales(groups, costs, []) == {"attn": 1.0, "ffn_exps": 1.0}

    # the search's loop: anchors, then rounds that measure each new answer; the best measured one is kept
    store = Measurements(tmp_path / "m.json", {})
    calls: list[list[int]] = []

    def whole(choice: list[int]) -> float:
        calls.append(list(choice))
        store.put_point(choice_key(groups, choice), true_kld(choice))
        return store.points[choice_key(groups, choice)]

    for ch in ([0, 0, 0, 0], [1, 1, 1, 1]):
        whole(ch)
    pick = _choose(groups, sizes, costs, 60, 0, whole, store)
    assert pick.solution.choice == [1, 1, 0, 0]
    assert pick.measured == pytest.approx(true_kld([1, 1, 0, 0]))
    assert pick.uncorrected == pytest.approx(true_kld([0, 0, 1, 1])) and pick.measured < pick.uncorrected
    assert pick.predicted == pytest.approx(0.34) and pick.rounds >= 1
    saved = json.loads((tmp_path / "m.json").read_text())["points"]
    assert saved[choice_key(groups, [1, 1, 0, 0])] == pytest.approx(pick.measured)
    # resumed: every point is in the store, nothing is measured again
    n = len(calls)
    again = _choose(groups, sizes, costs, 60, 0, lambda ch: store.points[choice_key(groups, ch)],
                    Measurements(tmp_path / "m.json", {}))  # fmt: skip
    assert again.solution.choice == pick.solution.choice and len(calls) == n


def test_seed_recipes_are_measured_alternatives(source_and_imatrix, tmp_path: Path) -> None:  # noqa: ANN001
    """A known recipe the groups express is measured where it fits and kept when it measures lower than the
    knapsack's answers (the per-group costs misjudge it); one that does not fit is not measured."""
    from gguf import GGMLQuantizationType as Q

    from forge.search.measure import Measurements, choice_key, make_groups
    from forge.search.search import _choose, seed_choices

    source, im = source_and_imatrix
    fam, _ = make_groups(source, ["Q2_K", "Q4_K", "Q8_0"], im, "family-layer")
    seeds = seed_choices(source, fam, im, ["moe_4bit", "q4_k_m", "q8_0"])
    assert set(seeds) == {"moe_4bit", "q8_0"}  # q4_k_m mixes types inside a family-layer group
    for g, j in zip(fam, seeds["moe_4bit"], strict=True):
        assert g.options[j].types[0] == (Q.Q4_K if g.name.endswith("ffn_exps") else Q.Q8_0)
    with pytest.raises(ForgeError, match="unknown recipe"):
        seed_choices(source, fam, im, ["moe_9bit"])

    groups = _two_family_groups()
    costs = [[0.10, 0.02], [0.10, 0.02], [0.15, 0.01], [0.15, 0.01]]
    sizes = [[o.size for o in g.options] for g in groups]
    store = Measurements(tmp_path / "m.json", {})
    measured: list[tuple[int, ...]] = []

    def whole(choice: list[int]) -> float:  # the seed [1, 1, 0, 0] measures far lower than its costs say
        measured.append(tuple(choice))
        kld = 0.01 if list(choice) == [1, 1, 0, 0] else sum(c[j] for c, j in zip(costs, choice, strict=True))
        store.put_point(choice_key(groups, choice), kld)
        return kld

    pick = _choose(groups, sizes, costs, 60, 0, whole, store, {"known": [1, 1, 0, 0], "big": [1, 1, 1, 1]})
    assert pick.solution.choice == [1, 1, 0, 0] and pick.chosen_by == "seed known" and pick.measured == 0.01
    assert (1, 1, 1, 1) not in measured  # 80 bytes: over the budget, never measured
    # later searches (no seeds) keep it: a whole model measured before that fits is an answer too
    again = _choose(groups, sizes, costs, 65, 0, whole, store)
    assert again.solution.choice == [1, 1, 0, 0] and again.measured == 0.01


# --- the proxy -------------------------------------------------------------------------------------------


def test_proxy_is_the_weighted_error_per_expert(
    source_and_imatrix, example_bf16: Path, tmp_path: Path
) -> None:  # noqa: ANN001
    """The proxy of a routed-expert tensor equals the error summed expert by expert with that expert's
    importance row; without an imatrix, the plain squared error."""
    import gguf
    import numpy as np

    from forge.imatrix.importance import importance_for
    from forge.quant.quantize import quantize
    from forge.quant.source import source_ref
    from forge.search.proxy import weighted_error

    source, im = source_and_imatrix
    name = "blk.1.ffn_down_exps.weight"
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'default = "bf16"\n[[rules]]\nname = "{name}"\ntype = "q3_k"\n')
    q = tmp_path / "q.gguf"
    quantize(example_bf16, q, str(recipe), imatrix=IMATRIX)
    typed = source_ref(q).open()
    shape = next(tuple(t.shape) for t in source.tensors() if t.name == name)
    w = source.float32(name).astype(np.float64)
    d2 = (
        gguf.quants.dequantize(typed.stored(name), gguf.GGMLQuantizationType.Q3_K).reshape(w.shape) - w
    ) ** 2
    imp = importance_for(im, name, shape[-1], shape[0]).astype(np.float64)
    want = sum(float((d2[e] * imp[e][None, :]).sum()) for e in range(shape[0]))
    assert len(set(imp[:, 0].tolist())) > 1  # the experts' rows differ: a mix-up would show
    assert weighted_error(source, typed, name, shape, im) == pytest.approx(want, rel=1e-6)
    assert weighted_error(source, typed, name, shape, None) == pytest.approx(float(d2.sum()), rel=1e-6)


def test_proxy_validation_leaves_each_candidate_out(tmp_path: Path) -> None:
    import numpy as np

    from forge.search.proxy import calibrate, proxy_costs, sample, spearman

    groups = _two_family_groups()
    proxy = {g.name: {"Q2_K": 10.0 * (i + 1), "Q4_K": 1.0 * (i + 1)} for i, g in enumerate(groups)}
    # the truth: attention's errors cost 0.01 per unit, the experts' 0.001
    truth = {
        (g.name, lb): p * (0.01 if "attn" in g.name else 0.001)
        for g in groups
        for lb, p in proxy[g.name].items()
    }
    v = calibrate(groups, proxy, truth)
    assert v.scales == pytest.approx({"attn_q": 0.01, "attn_k": 0.01, "ffn_up_exps": 0.001})
    # a role with fewer than two measured candidates takes its family's scale
    some = {k: x for k, x in truth.items() if k[0] != "blk.0.attn_k"}
    some[("blk.0.attn_k", "Q2_K")] = 5 * truth[("blk.0.attn_k", "Q2_K")]
    assert calibrate(groups, proxy, some).scales["attn_k"] == pytest.approx(np.median([0.01, 0.01, 0.05]))
    assert v.rho == pytest.approx(1.0) and v.rho_raw < 0.9  # unscaled, the families interleave wrongly
    costs = proxy_costs(groups, proxy, {}, v.scales)
    assert costs[0] == pytest.approx([0.1, 0.01]) and costs[3] == pytest.approx([0.04, 0.004])
    # a proxy that ranks backwards is caught
    backwards = {k: 1.0 / v_ for k, v_ in truth.items()}
    assert calibrate(groups, proxy, backwards).rho < 0
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert sample(groups, 5) == sample(groups, 5) and len(sample(groups, 100)) == 8


# --- groups, options and recipes on the example model -----------------------------------------------


@pytest.fixture(scope="module")
def source_and_imatrix(example_bf16: Path):  # noqa: ANN201
    from forge.imatrix.formats import read_imatrix
    from forge.quant.source import source_ref

    return source_ref(example_bf16, True).open(), read_imatrix(IMATRIX)


def test_options_follow_fallbacks_and_imatrix_requirements(source_and_imatrix) -> None:  # noqa: ANN001
    from gguf import GGMLQuantizationType as Q

    from forge.search.measure import make_groups

    source, im = source_and_imatrix
    groups, fixed = make_groups(source, ["IQ2_XXS", "Q4_K", "Q8_0"], im, "tensor")
    by_name = {g.name: g for g in groups}
    assert len(groups) == 30 and fixed > 0  # 4 layers x 7 + token_embd + output; norms and routers kept
    # the imatrix has no entry for the embedding/head: IQ2_XXS cannot be made for them, the rest can
    assert [o.label for o in by_name["output"].options] == ["Q4_K", "Q8_0"]
    assert [o.label for o in by_name["blk.0.ffn_up_exps"].options] == ["IQ2_XXS", "Q4_K", "Q8_0"]
    assert by_name["blk.0.ffn_up_exps"].options[1].size == 32 * 256 * 256 // 256 * 144
    # without an imatrix IQ2_XXS is no candidate anywhere
    groups_no_im, _ = make_groups(source, ["IQ2_XXS", "Q4_K"], None, "tensor")
    assert all(o.types != (Q.IQ2_XXS,) for g in groups_no_im for o in g.options)
    fam, fixed2 = make_groups(source, ["Q4_K", "Q8_0"], im, "family-layer")
    assert fixed2 == fixed
    assert [g.name for g in fam][:4] == ["output", "token_embd", "blk.0.attn", "blk.0.ffn_exps"]
    assert len(fam) == 2 + 4 * 2 and sum(len(g.tensors) for g in fam) == 30


def test_fallback_types_are_options_with_their_real_size(source_and_imatrix) -> None:  # noqa: ANN001
    from gguf import GGMLQuantizationType as Q

    from forge.quant.source import SrcTensor
    from forge.search.measure import option_for

    t = SrcTensor("blk.0.attn_q.weight", (256, 96), Q.BF16)  # 96 columns: no 256-blocks
    assert option_for(t, Q.Q4_K, None) == Q.Q5_0
    assert option_for(t, Q.Q6_K, None) == Q.Q8_0
    assert option_for(t, Q.IQ2_XXS, None) == Q.IQ4_NL  # the fallback needs no imatrix (make_plan's rule)
    full = SrcTensor("blk.0.attn_q.weight", (256, 256), Q.BF16)
    assert option_for(full, Q.IQ2_XXS, None) is None


def test_recipe_reproduces_the_chosen_types_and_size(
    source_and_imatrix, example_bf16: Path, tmp_path: Path
) -> None:  # noqa: ANN001
    from forge.quant.plan import make_plan
    from forge.quant.recipe import parse_recipe
    from forge.search.measure import make_groups
    from forge.search.search import dry_run_bytes, recipe_text

    source, im = source_and_imatrix
    groups, fixed = make_groups(source, ["IQ2_XXS", "Q2_K", "IQ4_XS", "Q6_K", "Q8_0"], im, "tensor")
    rng = random.Random(7)
    choice = [rng.randrange(len(g.options)) for g in groups]
    text = recipe_text(groups, choice, ["test"])
    plan = {p.name: p.out_type for p in make_plan(source, parse_recipe(text), imatrix=im)}
    for g, j in zip(groups, choice, strict=True):
        for name, t in zip(g.tensors, g.options[j].types, strict=True):
            assert plan[name] == t, name
    path = tmp_path / "r.toml"
    path.write_text(text)
    _, tensor_bytes = dry_run_bytes(example_bf16, path, IMATRIX)
    assert tensor_bytes == fixed + sum(g.options[j].size for g, j in zip(groups, choice, strict=True))


def test_bad_budgets_are_errors_before_any_work(example_bf16: Path, tmp_path: Path) -> None:
    from forge.search.search import search

    out = tmp_path / "best.toml"
    kw = dict(imatrix=IMATRIX, types="q2_k,q8_0", ctx=32, chunks=1)
    with pytest.raises(ForgeError, match=r"below the smallest file these types make \(2\.\d+ bpw"):
        search(example_bf16, out, CALIB, target_bpw=2.0, **kw)
    with pytest.raises(ForgeError, match=r"above the largest file these types make \(8\.5\d+ bpw"):
        search(example_bf16, out, CALIB, target_bpw=8.6, **kw)
    with pytest.raises(ForgeError, match="below the smallest file"):
        search(example_bf16, out, CALIB, target_size=1 << 20, **kw)
    with pytest.raises(ForgeError, match="above the largest file"):
        search(example_bf16, out, CALIB, target_size=1 << 30, **kw)
    with pytest.raises(ForgeError, match="exactly one of"):
        search(example_bf16, out, CALIB, target_bpw=4.0, target_size=1 << 24, **kw)
    with pytest.raises(ForgeError, match="unknown"):
        search(example_bf16, out, CALIB, target_bpw=4.0, imatrix=IMATRIX, types="q4_k,q9_z")
    with pytest.raises(ForgeError, match="unknown recipe 'moe_9bit'"):
        search(example_bf16, out, CALIB, target_bpw=4.0, seeds=["moe_9bit"], **kw)
    assert not out.exists() and not (tmp_path / "best.toml.search.json").exists()


def test_cli_bad_budget_is_one_error_line(example_bf16: Path, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "forge", "recipe", "search", str(example_bf16), "--text", str(CALIB),
           "-o", str(tmp_path / "b.toml"), "--target-bpw", "1", "--types", "q4_k,q8_0"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert (
        r.stderr.strip().splitlines() == [r.stderr.strip().splitlines()[-1]]
        and "below the smallest file" in r.stderr
    )
    assert "Traceback" not in r.stderr


# --- the measurements -----------------------------------------------------------------------------------


def test_partial_forward_equals_the_full_forward(
    example_bf16: Path, tmp_path: Path, one_torch_thread: None
) -> None:
    """A variant measured from layer L on (earlier layers taken from the reference) gives the KLD of the whole
    forward pass; the base model against itself gives 0."""
    from forge.quant.quantize import quantize
    from forge.search.measure import KldMeter
    from runtime.evaluate import perplexity_tokens
    from runtime.tokenizer import Tokenizer
    from runtime.weights import GGUFWeights, load_weights

    recipe = tmp_path / "one.toml"
    recipe.write_text('default = "bf16"\n[[rules]]\nname = "blk.2.attn_v.weight"\ntype = "q2_k"\n'
                      '[[rules]]\nname = "output.weight"\ntype = "q2_k"\n')  # fmt: skip
    q = tmp_path / "one.gguf"
    quantize(example_bf16, q, str(recipe))
    tok = Tokenizer.from_metadata(load_weights(example_bf16))
    ids = perplexity_tokens(tok, CALIB.read_text(encoding="utf-8"), 32, 2)
    meter = KldMeter(example_bf16, ids, 32, 2)
    assert meter.kld(meter.variant({}), -1) == pytest.approx(0.0, abs=1e-9)
    w = GGUFWeights(q)
    v = meter.variant({"blk.2.attn_v.weight": w})
    partial, full = meter.kld(v, 2), meter.kld(v, -1)
    assert partial > 1e-6
    assert partial == pytest.approx(full, rel=1e-4, abs=1e-9)
    head = meter.variant({"output.weight": w})
    assert meter.kld(head, 4) == pytest.approx(meter.kld(head, -1), rel=1e-4)
    assert meter.kld_of_file(q) > max(partial, meter.kld(head, 4))  # both groups at once
    # variants share the base's decoded matrices: a variant built on a warm cache equals one built cold
    assert meter.shared  # only base decodes: an overlaid tensor is decoded by its variant
    cold = KldMeter(example_bf16, ids, 32, 2)
    assert cold.kld(cold.variant({"blk.2.attn_v.weight": w}), -1) == meter.kld(
        meter.variant({"blk.2.attn_v.weight": w}), -1
    )


def test_measurements_of_other_settings_are_not_used(tmp_path: Path) -> None:
    from forge.search.measure import Measurements

    p = tmp_path / "m.json"
    m = Measurements(p, {"ctx": 32})
    m.put("blk.0.attn_q", "Q4_K", 0.25)
    again = Measurements(p, {"ctx": 32})
    assert again.get("blk.0.attn_q", "Q4_K") == 0.25 and not again.stale
    other = Measurements(p, {"ctx": 64})
    assert other.stale and other.get("blk.0.attn_q", "Q4_K") is None


@pytest.mark.slow
def test_search_resumes_and_reproduces_its_file(
    example_bf16: Path, tmp_path: Path, one_torch_thread: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from forge.search.search import search

    out = tmp_path / "best.toml"
    kw = dict(imatrix=IMATRIX, types="q2_k,q4_k,q8_0", granularity="family-layer", ctx=32, chunks=2)

    class Stop(Exception):
        pass

    def stop_after_3(done: int, total: int, what: str) -> None:
        if done == 3:
            raise Stop

    with pytest.raises(Stop):
        search(example_bf16, out, CALIB, target_bpw=4.0, progress=stop_after_3, **kw)
    saved = json.loads((tmp_path / "best.toml.search.json").read_text())
    assert sum(len(v) for v in saved["costs"].values()) == 3
    q = tmp_path / "best.gguf"
    res = search(example_bf16, out, CALIB, target_bpw=4.0, quantize_out=q, **kw)
    assert res.measured == res.measurements - 3 == 30 - 3
    assert res.predicted_bytes == q.stat().st_size
    assert res.predicted_bpw <= 4.0 and res.measured_bpw == pytest.approx(res.predicted_bpw)
    assert res.measured_kld is not None and 0 < res.measured_kld < 1
    # the whole model the correction measured is the file written (same bytes, copied from the type files)
    assert res.calib_kld == pytest.approx(res.measured_kld, rel=1e-6)
    assert res.uncorrected_kld is not None and res.calib_kld <= res.uncorrected_kld
    assert res.points == res.points_measured >= 3  # one anchor per type, then the knapsack's answers
    assert set(res.scales) == {"attn", "ffn_exps", "output", "token_embd"}
    assert len(json.loads((tmp_path / "best.toml.search.json").read_text())["points"]) == res.points
    # another budget on the same settings measures nothing
    res2 = search(example_bf16, out, CALIB, target_bpw=3.0, **kw)
    assert res2.measured == 0 and res2.predicted_bpw <= 3.0 and res2.calib_kld >= res.calib_kld
    assert res2.points_measured <= 1 + 3  # the anchors are reused: only this budget's answers are new
    res3 = search(example_bf16, out, CALIB, target_bpw=3.0, **kw)  # the same again: nothing at all
    assert res3.measured == res3.points_measured == 0 and res3.calib_kld == res2.calib_kld

    # --proxy: weighted weight errors for every candidate, KLD for a sample only; a poor proxy is refused
    pout = tmp_path / "proxy.toml"
    res4 = search(example_bf16, pout, CALIB, target_bpw=4.0, proxy_sample=8, **kw)
    assert res4.measured == 8 and res4.proxy is not None and res4.proxy["sampled"] == 8
    assert -1 <= res4.proxy["spearman"] <= 1 and res4.predicted_bpw <= 4.0
    assert len(json.loads((tmp_path / "proxy.toml.search.json").read_text())["proxy"]) == 10
    monkeypatch.setattr("forge.search.proxy.REFUSE_BELOW", 1.01)
    with pytest.raises(ForgeError, match="cannot stand for the measured KLD"):
        search(example_bf16, pout, CALIB, target_bpw=4.0, proxy_sample=8, **kw)
    # the recipe is an ordinary one: forge quantize writes the same bytes
    from forge.quant.quantize import quantize

    q2 = tmp_path / "again.gguf"
    quantize(example_bf16, q2, str(out), imatrix=IMATRIX)
    assert q2.stat().st_size == res2.predicted_bytes


@pytest.mark.slow
def test_ray_measurements_match_the_local_ones(
    example_bf16: Path, tmp_path: Path, one_torch_thread: None
) -> None:
    """--executor ray (a private Ray instance on this machine): every candidate measured by the workers,
    the same costs as in this process, and the same recipe."""
    pytest.importorskip("ray")
    from forge.search.search import search

    kw = dict(
        imatrix=IMATRIX, types="q2_k,q8_0", granularity="family-layer", ctx=32, chunks=2, correction=False
    )
    local = search(example_bf16, tmp_path / "local.toml", CALIB, target_bpw=4.0, **kw)
    seen: list[int] = []
    dist = search(example_bf16, tmp_path / "ray.toml", CALIB, target_bpw=4.0, executor="ray",
                  progress=lambda done, total, what: seen.append(done), **kw)  # fmt: skip
    assert dist.measured == local.measured == dist.measurements == 20 and sorted(seen) == list(range(1, 21))
    costs = [json.loads((tmp_path / f"{n}.toml.search.json").read_text())["costs"] for n in ("local", "ray")]
    assert costs[0].keys() == costs[1].keys()
    for g in costs[0]:
        assert costs[1][g] == pytest.approx(costs[0][g], rel=1e-5, abs=1e-9)
    assert [r["type"] for r in dist.groups] == [r["type"] for r in local.groups]
    with pytest.raises(ForgeError, match="--executor must be one of"):
        search(example_bf16, tmp_path / "x.toml", CALIB, target_bpw=4.0, executor="spark", **kw)
