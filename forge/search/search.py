"""``forge recipe search``: the recipe with the least measured KL divergence within a size budget.

1. groups and options with exact sizes (``measure.make_groups``); impossible budgets fail here, before work;
2. one GGUF per candidate type (``forge.quant.quantize``), kept in ``OUT.search/`` and reused by later runs;
3. the cost of each (group, type): mean KLD from the base model with that group alone quantized, persisted
   in ``OUT.search.json`` after every measurement (an interrupted search resumes from there);
4. an exact multiple-choice knapsack over the sizes (``knapsack.solve``), predicted KLD = the sum of costs;
5. a recipe TOML (exact ``name`` rules over a default type), its exact file size from a dry run, and with
   ``quantize_out`` the file itself (built with ``reuse=`` of the type files: every tensor copied) and its
   measured size and KLD.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gguf import LlamaFileType

from forge.atomic import atomic_output
from forge.errors import ForgeError
from forge.fileio import read_text
from forge.search.correction import corrected, fit_scales, uniform_choice
from forge.search.knapsack import Solution, bounds, solve
from forge.search.measure import (
    Group,
    KldMeter,
    Measurements,
    choice_key,
    cost_table,
    make_groups,
    measure,
    measure_choice,
    parse_types,
    settings_key,
    type_file_recipe,
)

Log = Callable[[str], None]


@dataclass
class Budget:
    """A target as bytes of tensor data the groups may use (``capacity``), from bpw or a file size."""

    kind: str  # "bpw" or "size"
    value: float
    capacity: int


@dataclass
class SearchResult:
    recipe: Path
    target: dict
    groups: list[dict]
    predicted_bytes: int  # file size (dry run of the written recipe)
    predicted_tensor_bytes: int
    predicted_bpw: float
    predicted_kld: float
    parameters: int
    measured: int  # (group, type) costs measured by this run
    measurements: int  # all costs used
    seconds: dict = field(default_factory=dict)
    front_states: int = 0
    quantized: Path | None = None
    measured_bytes: int | None = None
    measured_bpw: float | None = None
    measured_kld: float | None = None
    base_perplexity: float | None = None
    scored_tokens: int | None = None
    # the interaction correction (calibration text): the knapsack's objective with the family scales,
    # the whole model measured, and the measured KLD of the uncorrected knapsack's answer
    corrected_kld: float | None = None
    calib_kld: float | None = None
    uncorrected_kld: float | None = None
    scales: dict | None = None
    rounds: int | None = None
    points: int | None = None
    points_measured: int | None = None
    chosen_by: str | None = None  # knapsack, corrected knapsack (round k), or seed NAME
    seeds: list | None = None  # the known recipes the groups can express (measured where they fit)
    proxy: dict | None = None  # --proxy: the sample, its rank correlations, the family scales

    def to_json(self) -> dict:
        out = {k: (str(v) if isinstance(v, Path) else v) for k, v in self.__dict__.items()}
        return {k: v for k, v in out.items() if v is not None}


def search_paths(output: Path) -> tuple[Path, Path]:
    """(measurements JSON, folder of type files) next to the output recipe."""
    return output.with_name(output.name + ".search.json"), output.with_name(output.name + ".search")


def _file_type(label: str) -> str | None:
    for name in (f"MOSTLY_{label}", f"MOSTLY_{label}_M"):
        if name in LlamaFileType.__members__:
            return name
    return None


def recipe_text(groups: list[Group], choice: list[int], header: list[str]) -> str:
    """A recipe giving each tensor its chosen type: the most common type as default, exact names for the
    rest (the types are after fallbacks, so planning the recipe gives exactly these types)."""
    per_tensor = [(n, t) for g, j in zip(groups, choice, strict=True)
                  for n, t in zip(g.tensors, g.options[j].types, strict=True)]  # fmt: skip
    default = Counter(t.name for _, t in per_tensor).most_common(1)[0][0]
    by_bytes: Counter[str] = Counter()
    for g, j in zip(groups, choice, strict=True):
        by_bytes[g.options[j].types[0].name] += g.options[j].size
    lines = [f"# {h}" for h in header]
    lines += ['name = "searched"', "version = 1"]
    ft = _file_type(by_bytes.most_common(1)[0][0])  # general.file_type: the type holding the most bytes
    if ft:
        lines.append(f'file_type = "{ft}"')
    lines.append(f'default = "{default.lower()}"')
    for name, t in per_tensor:
        if t.name != default:
            lines += ["", "[[rules]]", f'name = "{name}"', f'type = "{t.name.lower()}"']
    return "\n".join(lines) + "\n"


def dry_run_bytes(model: Path, recipe: Path, imatrix: Path | None) -> tuple[int, int]:
    """(file bytes, tensor bytes) ``forge quantize --recipe`` would write."""
    from forge.quant.quantize import quantize

    _, rep = quantize(model, None, str(recipe), imatrix=imatrix)
    return rep.bytes, sum(r["bytes"] for r in rep.tensors)


def search(
    model: Path,
    output: Path,
    text: Path,
    imatrix: Path | None = None,
    target_bpw: float | None = None,
    target_size: int | None = None,
    types: str | None = None,
    granularity: str = "tensor",
    ctx: int = 512,
    chunks: int = 4,
    quantize_out: Path | None = None,
    log: Log | None = None,
    progress: Callable[[int, int, str], None] | None = None,
    correction: bool = True,
    proxy_sample: int | None = None,
    executor: str = "local",
    ray_address: str | None = None,
    seeds: list[str] | None = None,
) -> SearchResult:
    from forge.distributed.cluster import check_executor, choose_executor
    from forge.imatrix.formats import read_imatrix
    from forge.quant.source import source_ref

    say = log or (lambda _: None)
    t_start = time.perf_counter()
    if (target_bpw is None) == (target_size is None):
        raise ForgeError("give exactly one of --target-bpw or --target-size")
    check_executor(executor, ray_address)
    if seeds and seeds != ["all"]:
        from forge.quant.recipe import load_recipe

        for name in seeds:  # an unknown recipe is an error before any work
            load_recipe(name)
    encode_on = choose_executor(executor, 1, ray_address, log) if executor == "ray" else None
    body = read_text(text)
    labels = parse_types(types)
    im = read_imatrix(imatrix) if imatrix is not None else None
    ref = source_ref(model, True)
    source = ref.open()
    groups, fixed = make_groups(source, labels, im, granularity)
    parameters = sum(math.prod(t.shape) for t in source.tensors())
    sizes = [[o.size for o in g.options] for g in groups]
    lo, hi = bounds(sizes)
    measurements_path, folder = search_paths(output)
    folder.mkdir(exist_ok=True)
    if target_size is not None:  # the file's bytes besides tensor data: a dry run of the smallest recipe
        probe = folder / "probe.toml"
        smallest = [min(range(len(g.options)), key=lambda j, g=g: g.options[j].size) for g in groups]
        with atomic_output(probe) as f:
            f.write(recipe_text(groups, smallest, ["probe"]).encode())
        file_bytes, tensor_bytes = dry_run_bytes(model, probe, imatrix)
        overhead = file_bytes - tensor_bytes
        budget = Budget("size", float(target_size), target_size - overhead - fixed)
        asked = f"--target-size {target_size:,} bytes"

        def reach(n: int) -> str:
            return f"{n + overhead:,} bytes, {8 * n / parameters:.3f} bpw"

    else:
        assert target_bpw is not None
        budget = Budget("bpw", target_bpw, math.floor(target_bpw * parameters / 8) - fixed)
        asked = f"--target-bpw {target_bpw}"

        def reach(n: int) -> str:
            return f"{8 * n / parameters:.4f} bpw, {n:,} bytes of tensors"

    if budget.capacity < lo:
        raise ForgeError(f"{asked} is below the smallest file these types make ({reach(lo + fixed)})")
    if budget.capacity > hi:
        raise ForgeError(
            f"{asked} is above the largest file these types make ({reach(hi + fixed)}): every tensor at its "
            "largest type already fits"
        )
    n_options = sum(len(g.options) for g in groups)
    say(f"{len(groups)} groups ({granularity}), {n_options} candidates over {len(labels)} types; "
        f"{fixed:,} bytes of tensors kept as they are")  # fmt: skip

    # 2. the type files ------------------------------------------------------------------------------
    store = Measurements(measurements_path, settings_key(model, imatrix, body, ctx, chunks, granularity))
    if store.stale:
        say(f"{measurements_path} was made with other settings (model, imatrix, text, ctx, chunks or "
            "granularity): measuring again")  # fmt: skip
        store.costs, store.reference, store.points = {}, {}, {}
        prev = store.previous.get("settings", {})
        if all(prev.get(k) == store.settings[k] for k in ("model", "imatrix")):  # the encodings still hold
            store.reference["type_files"] = store.previous.get("reference", {}).get("type_files", {})
    elif store.count:
        say(f"resuming: {store.count} of {n_options} candidates already measured in {measurements_path}")
    used = [lb for lb in labels if any(o.label == lb for g in groups for o in g.options)]
    type_files = {lb: folder / f"{lb}.gguf" for lb in used}
    known = store.reference.setdefault("type_files", {})
    t0 = time.perf_counter()
    need_files = [lb for lb in used if any(store.get(g.name, o.label) is None
                                           for g in groups for o in g.options if o.label == lb)]  # fmt: skip
    if quantize_out is not None or correction:
        need_files = used  # whole-model points and the final build take every tensor from them
    for k, lb in enumerate(need_files):
        path = type_files[lb]
        if path.is_file() and known.get(lb) == _stamp(path):
            continue
        say(f"encoding the candidates' {lb} tensors ({k + 1}/{len(need_files)}) -> {path}")
        _build_type_file(model, source, lb, im, imatrix, folder, path, progress is not None, encode_on)
        known[lb] = _stamp(path)
        store.save()
    seconds = {"encode": round(time.perf_counter() - t0, 2)}

    # 3. measurements ---------------------------------------------------------------------------------
    base = _base_gguf(model, folder, say)
    meter: KldMeter | None = None

    def calib_ids() -> list[int]:
        from runtime.evaluate import perplexity_tokens
        from runtime.tokenizer import Tokenizer
        from runtime.weights import load_weights

        tok = Tokenizer.from_metadata(load_weights(base, "cpu", verify_experts=False))
        return perplexity_tokens(tok, body, ctx, chunks)

    def get_meter() -> KldMeter:
        nonlocal meter
        if meter is None:
            t0 = time.perf_counter()
            meter = KldMeter(base, calib_ids(), ctx, chunks)
            store.reference.update({"perplexity": meter.perplexity, "scored_tokens": meter.scored})
            seconds["reference"] = round(time.perf_counter() - t0, 2)
        return meter

    def run_measure(only: set[tuple[str, str]] | None = None) -> float:
        if executor == "ray":
            from forge.distributed.search import measure_ray

            return measure_ray(groups, base, calib_ids(), ctx, chunks, type_files, store, progress, only,
                               ray_address, log=say)  # fmt: skip
        return measure(groups, get_meter(), type_files, store, progress, only)

    before, points_before = store.count, len(store.points)
    validation = None
    if proxy_sample is not None:
        validation = _proxy_costs(
            groups, source, type_files, im, store, proxy_sample, run_measure, seconds, say
        )
        costs = validation[1]
    elif any(store.get(g.name, o.label) is None for g in groups for o in g.options):
        seconds["measure"] = round(run_measure(), 2)
    measured_now = store.count - before

    def whole(choice: list[int]) -> float:
        if choice_key(groups, choice) not in store.points:
            say(f"measuring a whole model ({len(store.points) + 1} so far)")
        return measure_choice(groups, choice, get_meter(), type_files, store)

    # 4. the knapsack, corrected by whole-model points ------------------------------------------------
    if validation is None:
        costs = cost_table(groups, store)
    t0 = time.perf_counter()
    seed_map = {}
    if correction and seeds:
        from forge.quant.recipe import available_recipes
        from forge.search.measure import quiet_importance

        with quiet_importance():
            seed_map = seed_choices(source, groups, im, available_recipes() if seeds == ["all"] else seeds)
    if correction:
        for lb in used:  # the anchors: one type everywhere, for each candidate type
            whole([uniform_choice(g, lb) for g in groups])
    capacity = budget.capacity
    for _ in range(8):
        pick = _choose(groups, sizes, costs, capacity, fixed, whole if correction else None, store, seed_map)
        sol = pick.solution
        header = [
            f"forge recipe search: {model.name}, target {_target_text(budget)}, {len(groups)} groups "
            f"({granularity}), types {','.join(labels).lower()}",
            f"calibration {text.name}: {chunks} x {ctx} tokens; mean KLD predicted {pick.predicted:.6f} "
            f"(sum of the per-group costs), corrected {pick.corrected:.6f}, measured {pick.measured:.6f} "
            f"({pick.chosen_by})"
            if correction else
            f"calibration {text.name}: {chunks} x {ctx} tokens; predicted mean KLD {sol.cost:.6f} "
            "(sum of the measured per-group costs)",
        ]  # fmt: skip
        text_out = recipe_text(groups, sol.choice, header)
        with atomic_output(output) as f:
            f.write(text_out.encode())
        file_bytes, tensor_bytes = dry_run_bytes(model, output, imatrix)
        if tensor_bytes != sol.size + fixed:  # pragma: no cover - the plan disagrees with our sizes
            raise ForgeError(
                f"internal error: the recipe plans {tensor_bytes:,} bytes of tensors, the search {sol.size + fixed:,}"
            )
        if budget.kind == "bpw" or file_bytes <= budget.value:
            break
        capacity -= file_bytes - int(budget.value)  # the header grew with the recipe's rules: shrink
    else:  # pragma: no cover
        raise ForgeError("could not fit the recipe's own header into --target-size")
    seconds["solve"] = round(time.perf_counter() - t0, 2)
    rows = [{"group": g.name, "type": g.options[j].label.lower(), "tensors": len(g.tensors),
             "bytes": g.options[j].size, "kld": costs[i][j]}
            for i, (g, j) in enumerate(zip(groups, sol.choice, strict=True))]  # fmt: skip
    res = SearchResult(
        recipe=output,
        target={"kind": budget.kind, "value": budget.value},
        groups=rows,
        predicted_bytes=file_bytes,
        predicted_tensor_bytes=tensor_bytes,
        predicted_bpw=8 * tensor_bytes / parameters,
        predicted_kld=pick.predicted,
        parameters=parameters,
        measured=measured_now,
        measurements=n_options,
        front_states=sol.states,
        base_perplexity=store.reference.get("perplexity"),
        scored_tokens=store.reference.get("scored_tokens"),
    )
    if validation is not None:
        v = validation[0]
        res.proxy = {
            "sampled": v.sampled,
            "spearman": v.rho,
            "spearman_unscaled": v.rho_raw,
            "scales": v.scales,
        }
    if correction:
        res.corrected_kld, res.calib_kld = pick.corrected, pick.measured
        res.uncorrected_kld, res.scales, res.rounds = pick.uncorrected, pick.scales, pick.rounds
        res.chosen_by, res.seeds = pick.chosen_by, sorted(seed_map)
        res.points = len(store.points)
        res.points_measured = len(store.points) - points_before

    # 5. the file ------------------------------------------------------------------------------------
    if quantize_out is not None:
        from forge.quant.quantize import quantize

        t0 = time.perf_counter()
        say(f"quantizing {quantize_out} with the recipe (reusing the search's encodings)")
        _, rep = quantize(model, quantize_out, str(output), imatrix=imatrix, reuse=[folder])
        res.quantized = quantize_out
        res.measured_bytes = quantize_out.stat().st_size
        res.measured_bpw = 8 * sum(r["bytes"] for r in rep.tensors) / parameters
        res.measured_kld = get_meter().kld_of_file(quantize_out)
        seconds["quantize"] = round(time.perf_counter() - t0, 2)
    seconds["total"] = round(time.perf_counter() - t_start, 2)
    res.seconds = seconds
    return res


def _proxy_costs(
    groups: list[Group],
    source: object,
    type_files: dict[str, Path],
    im: object,
    store: Measurements,
    n_sample: int,
    run_measure: Callable[[set[tuple[str, str]]], float],
    seconds: dict,
    say: Log,
) -> tuple[object, list[list[float]]]:
    """--proxy: weighted weight errors for every candidate, KLD measured for a sample, the proxy scaled per
    family and validated on the sample (a ForgeError when it ranks the sample poorly)."""
    from forge.quant.source import source_ref
    from forge.search.proxy import REFUSE_BELOW, WARN_BELOW, calibrate, group_errors, proxy_costs, sample

    t0 = time.perf_counter()
    typed = {lb: source_ref(p).open() for lb, p in type_files.items()}
    group_errors(groups, source, typed, im, store)  # type: ignore[arg-type]
    seconds["proxy"] = round(time.perf_counter() - t0, 2)
    picks = set(sample(groups, n_sample))
    seconds["measure"] = round(run_measure(picks), 2)
    measured = {(g.name, o.label): store.get(g.name, o.label) for g in groups for o in g.options
                if store.get(g.name, o.label) is not None}  # fmt: skip
    v = calibrate(groups, store.proxy, measured)  # type: ignore[arg-type]
    line = (f"proxy: rank correlation with the KLD of {v.sampled} measured candidates {v.rho:.3f} "
            f"(scaled per role, each left out of its scale; unscaled {v.rho_raw:.3f})")  # fmt: skip
    if not v.rho >= REFUSE_BELOW:
        raise ForgeError(f"{line}: below {REFUSE_BELOW}, the proxy cannot stand for the measured KLD here; "
                         "search without --proxy")  # fmt: skip
    say(line + (f" - WARNING: below {WARN_BELOW}, the choice may be poor" if v.rho < WARN_BELOW else ""))
    return v, proxy_costs(groups, store.proxy, measured, v.scales)  # type: ignore[arg-type]


#: knapsack answers re-solved with refitted scales per budget (each costs one whole-model measurement)
ROUNDS = 3


@dataclass
class Pick:
    solution: Solution
    predicted: float  # sum of the per-group costs
    corrected: float  # with the family scales
    measured: float = math.nan  # the whole model, measured
    uncorrected: float = math.nan  # the whole model the uncorrected knapsack picks, measured
    scales: dict = field(default_factory=dict)
    rounds: int = 0
    chosen_by: str = "knapsack"


def _choose(
    groups: list[Group],
    sizes: list[list[int]],
    costs: list[list[float]],
    capacity: int,
    fixed: int,
    whole: Callable[[list[int]], float] | None,
    store: Measurements | None = None,
    seeds: dict[str, list[int]] | None = None,
) -> Pick:
    """The knapsack's answer; with ``whole`` (measures a whole model), the interaction correction: refit
    the family scales on every measured point, re-solve with the scaled costs and measure the answer,
    until an answer repeats (at most ROUNDS times). ``seeds`` (known recipes as choices) that fit are
    measured too: the per-group costs can misjudge a whole mix (they add up what partly cancels), and a
    known recipe is a measured alternative. The answer with the least measured KLD among these and every
    whole model measured before that fits is kept, so the search can only improve on the uncorrected
    answer, on every seed and on every earlier answer that fits, on the calibration text."""
    sol = solve(sizes, costs, capacity)
    if sol is None:  # pragma: no cover - the bounds were checked before
        raise ForgeError("no recipe fits the budget")
    if whole is None or store is None:
        return Pick(sol, sol.cost, sol.cost)
    tried = {tuple(sol.choice): (sol, whole(sol.choice), {}, 0, "knapsack")}
    scales: dict = {}
    for k in range(1, ROUNDS + 1):
        pts = _points(groups, store)
        pt_sizes = [fixed + sum(g.options[j].size for g, j in zip(groups, ch, strict=True)) for ch, _ in pts]
        scales = fit_scales(groups, costs, pts, pt_sizes, capacity + fixed)
        nxt = solve(sizes, corrected(groups, costs, scales), capacity)
        assert nxt is not None
        if tuple(nxt.choice) in tried:
            break
        tried[tuple(nxt.choice)] = (nxt, whole(nxt.choice), scales, k, f"corrected knapsack (round {k})")
    for name, choice in (seeds or {}).items():
        size = sum(s[j] for s, j in zip(sizes, choice, strict=True))
        if size <= capacity and tuple(choice) not in tried:
            cost = sum(c[j] for c, j in zip(costs, choice, strict=True))
            tried[tuple(choice)] = (
                Solution(list(choice), size, cost, 0),
                whole(choice),
                {},
                0,
                f"seed {name}",
            )
    for choice, kld in _points(groups, store):  # whole models measured before (other budgets, runs) that fit
        size = sum(s[j] for s, j in zip(sizes, choice, strict=True))
        if size <= capacity and tuple(choice) not in tried:
            cost = sum(c[j] for c, j in zip(costs, choice, strict=True))
            tried[tuple(choice)] = (
                Solution(list(choice), size, cost, 0),
                kld,
                {},
                0,
                "whole model measured before",
            )
    best, measured, best_scales, rounds, how = min(tried.values(), key=lambda t: (t[1], t[0].size))
    final = best_scales or scales
    pred = sum(c[j] for c, j in zip(costs, best.choice, strict=True))
    corr = sum(c[j] for c, j in zip(corrected(groups, costs, final), best.choice, strict=True))
    return Pick(best, pred, corr, measured, tried[tuple(sol.choice)][1], final, rounds, how)


def seed_choices(
    source: object, groups: list[Group], imatrix: object, names: list[str]
) -> dict[str, list[int]]:
    """The recipes among ``names`` that the groups can express exactly (every group's tensors planned to
    one of its options' types), as choices; the others are left out."""
    from forge.quant.plan import make_plan
    from forge.quant.recipe import load_recipe

    out = {}
    for name, recipe in [(n, load_recipe(n)) for n in names]:  # an unknown name is an error, before any work
        try:
            plan = {p.name: p.out_type for p in make_plan(source, recipe, imatrix=imatrix)}  # type: ignore[arg-type]
        except ForgeError:  # e.g. an IQ preset without an imatrix
            continue
        choice = []
        for g in groups:
            want = tuple(plan.get(n) for n in g.tensors)
            j = next((j for j, o in enumerate(g.options) if o.types == want), None)
            if j is None:
                break
            choice.append(j)
        else:
            out[name] = choice
    return out


def _points(groups: list[Group], store: Measurements) -> list[tuple[list[int], float]]:
    """Every whole model measured so far (any budget), as (choice, KLD)."""
    index = [{o.label: j for j, o in enumerate(g.options)} for g in groups]
    out = []
    for key, kld in store.points.items():
        labels = key.split(",")
        if len(labels) == len(groups) and all(lb in ix for lb, ix in zip(labels, index, strict=True)):
            out.append(([ix[lb] for lb, ix in zip(labels, index, strict=True)], kld))
    return out


def _target_text(b: Budget) -> str:
    return f"{b.value:g} bpw" if b.kind == "bpw" else f"{int(b.value):,} bytes"


def _stamp(path: Path) -> dict:
    st = path.stat()
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def _build_type_file(
    model: Path,
    source: object,
    label: str,
    im: object,
    imatrix: Path | None,
    folder: Path,
    path: Path,
    show_progress: bool = False,
    executor: Callable | None = None,
) -> None:
    from forge.quant.quantize import quantize

    recipe = folder / f"{label}.toml"
    with atomic_output(recipe) as f:
        f.write(type_file_recipe(source, label, im).encode())  # type: ignore[arg-type]
    quantize(model, path, str(recipe), imatrix=imatrix, progress=show_progress, executor=executor)


def _base_gguf(model: Path, folder: Path, say: Log) -> Path:
    """The unquantized model as a GGUF the runtime maps (a Hugging Face folder is converted once)."""
    if not model.is_dir():
        return model
    from forge.convert import convert_checkpoint

    out = folder / "source.gguf"
    if not out.is_file():
        say(f"converting {model} -> {out} (the reference model)")
        convert_checkpoint(model, out, "bf16")
    return out
