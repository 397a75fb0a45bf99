"""``forge imatrix``: show, merge and convert importance matrices (llama.cpp's GGUF and .dat formats)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from forge.errors import ForgeError

app = typer.Typer(help="Importance matrices: show, merge, convert (llama.cpp GGUF and .dat formats).",
                  no_args_is_help=True)  # fmt: skip
out = Console()

FormatOpt = Annotated[
    str | None, typer.Option("--format", help="gguf or dat (default: from the output suffix)")
]
RoundingOpt = Annotated[
    bool,
    typer.Option("--llamacpp-rounding", help="write .dat values exactly as llama-imatrix does (loses the last bit of "
                 "~10% of weights); default keeps every weight bit for bit"),
]  # fmt: skip


def _fmt(value: str | None) -> str | None:
    if value is not None and value not in ("gguf", "dat"):
        raise ForgeError(f"--format must be gguf or dat, not {value!r}")
    return value


def _ranges(ids: list[int]) -> str:
    from forge.imatrix.importance import _ranges

    return _ranges(ids) if ids else ""


@app.command()
def show(
    file: Annotated[Path, typer.Argument(help="imatrix file (.gguf or .dat, detected from the content)")],
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Rows seen per tensor, per-expert coverage (unseen experts listed), value statistics."""
    from forge.imatrix.formats import read_imatrix
    from forge.imatrix.stats import summary

    info = summary(read_imatrix(file))
    if as_json:
        sys.stdout.write(json.dumps({"file": str(file), **info}, indent=1) + "\n")
        return
    unit = info["counts_unit"]
    out.print(f"[bold]{file}[/bold]: {info['entries']} tensors, {info['chunk_count']} chunks of "
              f"{info['chunk_size'] or '?'} tokens, datasets {info['datasets']}, counts in {unit}")  # fmt: skip
    if info["partial"]:
        out.print(f"[yellow]partial: a snapshot of an unfinished collection, {info['chunk_count']} of "
                  f"{info['chunks_planned']} chunks[/yellow]")  # fmt: skip
    table = Table("tensor", "experts x cols", unit, "seen", "unseen experts", "min", "mean", "max", "std")
    for t in info["tensors"]:
        table.add_row(
            t["name"], f"{t['n_mat']} x {t['n_per_row']}", f"{t['rows']:,}", f"{t['experts_seen']}/{t['n_mat']}",
            _ranges(t["unseen_experts"]), f"{t['value_min']:.4g}", f"{t['value_mean']:.4g}",
            f"{t['value_max']:.4g}", f"{t['value_std']:.4g}",
            style="yellow" if t["unseen_experts"] else None,
        )  # fmt: skip
    out.print(table)
    if info["entries_with_unseen_experts"]:
        out.print(f"{info['entries_with_unseen_experts']} tensors have experts with no data: the quantizer gives "
                  "them weight 1 (llama.cpp's rule) unless told otherwise")  # fmt: skip


@app.command()
def merge(
    inputs: Annotated[
        list[Path], typer.Argument(help="imatrix files to add (any mix of .gguf/.dat of one kind)")
    ],
    output: Annotated[Path, typer.Option("-o", "--output", help="merged imatrix to write")],
    fmt: FormatOpt = None,
    llamacpp_rounding: RoundingOpt = False,
) -> None:
    """Add imatrices: per tensor and expert, sums add and counts add; chunk counts add."""
    from forge.imatrix.formats import read_imatrix, write_imatrix
    from forge.imatrix.model import merge as merge_all

    merged = merge_all(read_imatrix(p) for p in inputs)
    write_imatrix(merged, output, _fmt(fmt), "llamacpp" if llamacpp_rounding else "exact")  # type: ignore[arg-type]
    out.print(
        f"wrote {output}: {len(merged.sums)} tensors, {merged.chunk_count} chunks from {len(inputs)} files"
    )


@app.command()
def convert(
    input: Annotated[Path, typer.Argument(help="imatrix file (.gguf or .dat)")],
    output: Annotated[Path, typer.Option("-o", "--output", help="file to write (.dat -> legacy, else GGUF)")],
    fmt: FormatOpt = None,
    llamacpp_rounding: RoundingOpt = False,
) -> None:
    """Convert between llama.cpp's GGUF imatrix and the legacy .dat; the quantizer's weights stay bit-exact."""
    from forge.imatrix.formats import format_for_path, read_imatrix, write_imatrix

    im = read_imatrix(input)
    target = _fmt(fmt) or format_for_path(output)
    write_imatrix(im, output, target, "llamacpp" if llamacpp_rounding else "exact")  # type: ignore[arg-type]
    lost = (
        " (per-expert counts and raw sums are not stored in .dat)"
        if target == "dat" and not im.counts_are_ncall
        else ""
    )
    out.print(f"wrote {output} ({target}): {len(im.sums)} tensors{lost}")


@app.command()
def collect(
    model: Annotated[
        Path, typer.Argument(help="model: Hugging Face folder (or GGUF once tokenizing from GGUF is wired)")
    ],
    text: Annotated[Path, typer.Option("--text", "-f", help="calibration text file")],
    output: Annotated[Path, typer.Option("-o", "--output", help="imatrix to write (.gguf, or .dat)")],
    ctx: Annotated[int, typer.Option(help="tokens per chunk (llama-imatrix -c)")] = 512,
    chunks: Annotated[
        int | None, typer.Option(help="process at most this many chunks (default: all)")
    ] = None,
    fmt: FormatOpt = None,
    save_every: Annotated[
        int, typer.Option(help="also write the output every N chunks (atomic replace)")
    ] = 0,
    process_output: Annotated[
        bool, typer.Option("--process-output", help="collect output.weight too")
    ] = False,
    device: Annotated[str, typer.Option(help="torch device")] = "cpu",
    ggml_numerics: Annotated[
        bool,
        typer.Option(
            "--ggml-numerics", help="llama.cpp's CPU input rounding (routing closer to llama-imatrix; slower)"
        ),
    ] = False,
    executor: Annotated[
        str, typer.Option(help="local (this process) or ray (chunks over a Ray cluster's nodes)")
    ] = "local",
    ray_address: Annotated[
        str | None, typer.Option(help="Ray cluster HOST:PORT (default: $RAY_ADDRESS, else a local Ray)")
    ] = None,
) -> None:
    """Collect an imatrix with llama-imatrix's chunking, printing perplexity along the way."""
    from forge.distributed.cluster import check_executor
    from forge.imatrix.accumulate import collect as run_collect

    if executor == "ray" and ggml_numerics:
        raise ForgeError("--ggml-numerics runs with the local executor only")
    check_executor(executor, ray_address)
    if executor == "ray":
        from forge.distributed.imatrix import collect_ray

        rep = collect_ray(model, text, output, ctx, chunks, _fmt(fmt), save_every, process_output, device,
                          log=lambda s: out.print(s, end=" "), address=ray_address)  # fmt: skip
    else:
        rep = run_collect(model, text, output, ctx, chunks, _fmt(fmt), save_every, process_output, device,
                          log=lambda s: out.print(s, end=" "), ggml_numerics=ggml_numerics)  # fmt: skip
    out.print()
    out.print(f"wrote {output}: {len(rep.imatrix.sums)} tensors from {rep.chunks} chunks x {ctx} tokens "
              f"in {rep.seconds:.1f} s ({rep.tokens_per_second:.0f} tokens/s)")  # fmt: skip
