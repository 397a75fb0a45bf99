"""``forge prune``: profile routed experts on a text, build a prune mask, write a physically smaller GGUF."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from forge.errors import ForgeError

app = typer.Typer(help="Expert pruning: profile, mask, apply.", no_args_is_help=True)
out = Console()
err = Console(stderr=True)

JsonOpt = Annotated[bool, typer.Option("--json", help="print one JSON object")]


@app.command()
def profile(
    model: Annotated[Path, typer.Argument(help="GGUF file (or Hugging Face folder)")],
    text: Annotated[Path, typer.Option("--text", help="text to route through the model")],
    output: Annotated[Path, typer.Option("-o", "--output", help="profile JSON to write")],
    ctx: Annotated[int, typer.Option(help="tokens per chunk, each from an empty context")] = 512,
    chunks: Annotated[int | None, typer.Option(help="first N chunks only (default: all)")] = None,
    prune_mask: Annotated[
        Path | None, typer.Option("--prune-mask", help="profile the model with this mask applied")
    ] = None,
    device: Annotated[str, typer.Option(help="cpu, cuda or mps")] = "cpu",
    as_json: JsonOpt = False,
) -> None:
    """Per routed layer and expert: tokens routed, summed routing weight, saliency, full rankings."""
    from forge.prune.collect import collect_profile

    def log(msg: str) -> None:
        if not as_json:
            err.print(msg, end="\r")

    rep = collect_profile(model, text, output, ctx, chunks, device, prune_mask, log)
    prof = rep.profile
    unused = [sum(int(c == 0) for c in lp.count) for lp in prof.layers]
    if as_json:
        sys.stdout.write(json.dumps({"output": str(output), "chunks": rep.chunks, "tokens": rep.tokens,
                                     "seconds": round(rep.seconds, 3), "layers": len(prof.layers),
                                     "unused_experts": unused}, indent=1) + "\n")  # fmt: skip
        return
    out.print(
        f"wrote {output}: {len(prof.layers)} routed layers x {prof.expert_count} experts, "
        f"{rep.chunks} chunks of {ctx} tokens ({rep.tokens / rep.seconds if rep.seconds else 0:.0f} tok/s)"
    )
    table = Table("layer", "never routed", "top-8 by count (share)")
    for lp, n_unused in zip(prof.layers, unused, strict=True):
        order = lp.ranking("count")
        total = max(int(lp.count.sum()), 1)
        table.add_row(str(lp.layer), str(n_unused), f"{100 * lp.count[order[:8]].sum() / total:.1f}%")
    out.print(table)
    if rep.hash_routed:
        out.print(f"layers {', '.join(map(str, rep.hash_routed))} are hash-routed (experts by token id): not "
                  "profiled; a prune mask covers the routed layers only")  # fmt: skip


@app.command()
def mask(
    profile_file: Annotated[Path, typer.Argument(help="profile JSON from `forge prune profile`")],
    output: Annotated[Path, typer.Option("-o", "--output", help="mask file to write (ds4 grid)")],
    keep: Annotated[int | None, typer.Option("--keep", help="experts kept per layer")] = None,
    keep_fraction: Annotated[
        float | None, typer.Option("--keep-fraction", help="fraction of experts kept per layer")
    ] = None,
    coverage: Annotated[
        float | None,
        typer.Option("--coverage", help="keep the fewest top experts whose share of the metric reaches C"),
    ] = None,
    by: Annotated[str, typer.Option("--by", help="ranking: count, weight or saliency")] = "count",
    as_json: JsonOpt = False,
) -> None:
    """Build a prune mask: one line per routed layer, one character per expert, 1 = prune, 0 = keep."""
    from forge.atomic import check_output_path
    from forge.mask_file import write_mask
    from forge.prune.mask import build_mask
    from forge.prune.profile import METRICS, Profile

    if by not in METRICS:
        raise ForgeError(f"--by must be one of {', '.join(METRICS)}, not {by!r}")
    check_output_path(output)
    m = build_mask(Profile.load(profile_file), keep, keep_fraction, coverage, by)
    write_mask(m, output)
    kept = m.kept_per_layer()
    if as_json:
        sys.stdout.write(json.dumps({"output": str(output), "pruned": m.n_pruned, "kept_per_layer": kept,
                                     "uniform": len(set(kept)) == 1}, indent=1) + "\n")  # fmt: skip
        return
    out.print(f"wrote {output}: {m.n_pruned} of {m.pruned.size} experts pruned, kept per layer {kept}")
    if len(set(kept)) > 1:
        out.print("layers keep different numbers: usable with --prune-mask, not by `forge prune apply`")


@app.command()
def apply(
    model: Annotated[Path, typer.Argument(help="GGUF file to prune")],
    mask_file: Annotated[Path, typer.Option("--mask", help="prune mask (ds4 grid)")],
    output: Annotated[Path, typer.Option("-o", "--output", help="smaller GGUF to write")],
    as_json: JsonOpt = False,
) -> None:
    """Write a physically smaller GGUF without the masked experts (same logits as the masked original)."""
    from forge.mask_file import read_mask
    from forge.prune.apply import apply_mask

    rep = apply_mask(model, read_mask(mask_file), output)
    if as_json:
        sys.stdout.write(json.dumps({"output": str(rep.output), "source_bytes": rep.source_bytes,
                                     "output_bytes": rep.output_bytes, "expert_count": rep.kept,
                                     "source_expert_count": rep.expert_count}, indent=1) + "\n")  # fmt: skip
        return
    out.print(
        f"wrote {rep.output}: {rep.kept} of {rep.expert_count} experts in each of {rep.layers} routed layers, "
        f"{rep.output_bytes:,} bytes ({100 * rep.saved_bytes / rep.source_bytes:.1f}% smaller)"
    )


def main() -> None:
    """Stand-alone entry (``python -m forge.prune.cli``)."""
    from forge.cli import run_app

    run_app(app)


if __name__ == "__main__":
    main()
