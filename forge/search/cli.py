"""``forge recipe``: recipes found by measurement (``search``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from forge.errors import ForgeError

app = typer.Typer(help="Recipes found by measurement.", no_args_is_help=True)
out = Console()
err = Console(stderr=True)


@app.command("search")
def search_cmd(
    model: Annotated[
        Path, typer.Argument(help="unquantized model: F32/F16/BF16 GGUF or Hugging Face folder")
    ],
    text: Annotated[Path, typer.Option("--text", help="calibration text (KL divergence measured on it)")],
    output: Annotated[Path, typer.Option("-o", "--output", help="recipe TOML to write")],
    imatrix: Annotated[
        Path | None, typer.Option(help="importance matrix (needed for IQ2/IQ1 types; steers the others)")
    ] = None,
    target_bpw: Annotated[
        float | None,
        typer.Option("--target-bpw", help="bits per weight, over all tensors (as forge inspect)"),
    ] = None,
    target_size: Annotated[
        str | None, typer.Option("--target-size", help="file size, e.g. 12G or 15000000 (bytes)")
    ] = None,
    types: Annotated[
        str | None, typer.Option(help="candidate types, comma-separated (default: iq2_xxs ... q8_0)")
    ] = None,
    granularity: Annotated[
        str,
        typer.Option(help="tensor (one type per tensor) or family-layer (attention, experts... per layer)"),
    ] = "tensor",
    ctx: Annotated[int, typer.Option(help="tokens per calibration chunk")] = 512,
    chunks: Annotated[int, typer.Option(help="calibration chunks")] = 4,
    quantize_out: Annotated[
        Path | None, typer.Option("--quantize", help="also write the quantized GGUF and measure it")
    ] = None,
    threads: Annotated[
        int | None, typer.Option(help="CPU threads for torch (default: torch's choice)")
    ] = None,
    correction: Annotated[
        bool,
        typer.Option(help="fit per-family scales to whole models measured on the calibration text"),
    ] = True,
    proxy: Annotated[
        bool,
        typer.Option(
            "--proxy",
            help="rank candidates by imatrix-weighted weight error (no forward pass), "
            "measuring KLD only for a sample that validates it",
        ),
    ] = False,
    proxy_sample: Annotated[int, typer.Option(help="candidates measured to scale and validate --proxy")] = 32,
    executor: Annotated[
        str, typer.Option(help="where candidates are measured: local (this process) or ray (a Ray cluster)")
    ] = "local",
    ray_address: Annotated[
        str | None,
        typer.Option(help="Ray cluster HOST:PORT or auto (default: $RAY_ADDRESS or a private one)"),
    ] = None,
    seeds: Annotated[
        str,
        typer.Option(
            help="known recipes measured as alternatives where the groups express them and they fit: "
            "all (the bundled presets), none, or a comma-separated list"
        ),
    ] = "all",
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """The recipe with the least measured KL divergence within a size budget (llama.cpp's types).

    Measurements are kept in OUTPUT.search.json and the candidate encodings in OUTPUT.search/, so a
    search that is stopped resumes, and other budgets on the same settings cost only the knapsack.
    """
    from forge.atomic import refuse_overwriting_inputs
    from forge.gguf_file import parse_size
    from forge.options import require_float, require_int
    from forge.search.search import search

    require_float("--target-bpw", target_bpw, 0, 64, lo_open=True)
    require_int("--ctx", ctx, 4)
    if ctx % 2:
        raise ForgeError(f"--ctx must be an even number >= 4, got {ctx}")
    require_int("--chunks", chunks, 1)
    require_int("--threads", threads, 1)
    require_int("--proxy-sample", proxy_sample, 3)
    size = None
    if target_size is not None:
        size = parse_size(target_size)
        if size <= 0:
            raise ForgeError(f"--target-size must be a positive size, not {target_size!r}")
    if output.suffix != ".toml":
        raise ForgeError(f"-o {output}: a recipe is a .toml file")
    if quantize_out is not None:
        inputs = [("model", model), ("--text", text), ("-o", output)]
        if imatrix is not None:
            inputs.append(("--imatrix", imatrix))
        refuse_overwriting_inputs([("--quantize", quantize_out)], inputs)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)

    def log(msg: str) -> None:
        if not as_json:
            err.print(msg, highlight=False)

    def progress(done: int, total: int, what: str) -> None:
        if not as_json and sys.stderr.isatty():
            sys.stderr.write(f"\rmeasured {done}/{total} {what:<40}")
            sys.stderr.flush()
            if done == total:
                sys.stderr.write("\n")
        elif not as_json and (done == total or done % 25 == 0):
            sys.stderr.write(f"measured {done}/{total}\n")

    res = search(model, output, text, imatrix, target_bpw, size, types, granularity, ctx, chunks,
                 quantize_out, log, None if as_json else progress, correction,
                 proxy_sample if proxy else None, executor, ray_address,
                 None if seeds == "none" else [x.strip() for x in seeds.split(",") if x.strip()])  # fmt: skip
    if as_json:
        sys.stdout.write(json.dumps(res.to_json(), indent=1) + "\n")
        return
    table = Table("group", "type", "bytes", "KLD alone")
    for row in res.groups:
        table.add_row(row["group"], row["type"], f"{row['bytes']:,}", f"{row['kld']:.6f}")
    out.print(table)
    out.print(f"wrote {res.recipe} ({res.measured} of {res.measurements} candidates measured now; "
              f"{res.seconds.get('total', 0):.1f} s)")  # fmt: skip
    out.print(f"predicted: {res.predicted_bytes:,} bytes, {res.predicted_bpw:.4f} bpw, "
              f"mean KLD {res.predicted_kld:.6f} (sum of the per-group costs)")  # fmt: skip
    if res.proxy is not None:
        p = res.proxy
        out.print(f"proxy: {res.measured} candidates measured; rank correlation with measured KLD "
                  f"{p['spearman']:.3f} (scaled per role, leave-one-out; unscaled {p['spearman_unscaled']:.3f}, "
                  f"{p['sampled']} measured)")  # fmt: skip
    if res.calib_kld is not None:
        scales = ", ".join(f"{k} {v:.2f}" for k, v in sorted(res.scales.items()))
        out.print(f"corrected: mean KLD {res.corrected_kld:.6f} (family scales: {scales}); whole model "
                  f"measured: {res.calib_kld:.6f}, from the {res.chosen_by} (the uncorrected knapsack's answer: "
                  f"{res.uncorrected_kld:.6f}; "
                  f"{res.points} whole models measured, {res.points_measured} now)")  # fmt: skip
    if res.quantized is not None:
        out.print(f"measured:  {res.measured_bytes:,} bytes, {res.measured_bpw:.4f} bpw, "
                  f"mean KLD {res.measured_kld:.6f} ({res.quantized})")  # fmt: skip
