"""``forge layout convert|verify|inspect``: a typer sub-app (parsing and printing only)."""

from __future__ import annotations

import enum
import json
from pathlib import Path

import typer

app = typer.Typer(
    help="Expert-major layouts (ds4 v1/v2): convert, convert back, verify, inspect.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


class Target(str, enum.Enum):
    v2 = "v2"
    v1 = "v1"
    canonical = "canonical"


@app.command()
def convert(
    src: Path = typer.Argument(
        ..., help="canonical GGUF (for --to v2/v1) or expert-major GGUF (for --to canonical)"
    ),
    output: Path = typer.Option(..., "-o", "--output", help="destination file"),
    to: Target = typer.Option(Target.v2, "--to", help="target layout"),
    skip_verify: bool = typer.Option(
        False, "--skip-verify", help="skip the full check before install (not for publication)"
    ),
) -> None:
    """Convert between the canonical layout and expert-major v2/v1 (transactional, verified)."""
    from forge.layout.convert import convert as run

    r = run(src, output, to.value, verify=not skip_verify)
    typer.echo(f"source_sha256 {r.source_sha256}")
    if r.payload_sha256:
        typer.echo(f"payload_sha256 {r.payload_sha256}")
    typer.echo(f"output_bytes {r.output_bytes}")
    if to is Target.v2 and r.source_order == "recorded":
        typer.echo(
            "note: source tensor order recorded in descriptor bytes 200..223 (gguf-forge extension; ds4 refuses it)"
        )
    typer.echo(f"wrote {r.dest} ({to.value}{', verified' if r.verified else ', NOT verified'})")


@app.command()
def verify(
    src: Path = typer.Argument(..., help="the canonical GGUF the file was built from"),
    native: Path = typer.Argument(..., help="the expert-major GGUF"),
) -> None:
    """Check every byte of an expert-major file against its canonical source."""
    from forge.layout.verify import verify_files

    r = verify_files(src, native)
    typer.echo(
        f"valid expert-major v{r.version} GGUF: {r.family}, {r.layers} layers x {r.experts} experts, "
        f"{r.payload_bytes:,} payload bytes"
    )


@app.command()
def inspect(
    file: Path = typer.Argument(..., help="a canonical or expert-major GGUF"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """Family, layers, experts, record bytes per layer, store and overhead bytes."""
    from forge.layout.inspect import inspect_file

    info = inspect_file(file)
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    typer.echo(f"{info['file']}: {info['layout']}, family {info['family']} ({info['architecture']})")
    typer.echo(f"  {info['layers']} routed layers x {info['experts']} experts ({info['experts_used']} used)")
    typer.echo(f"  {'layer':>5}  {'gate/up/down types':<24} {'record bytes':>14} {'stride':>12}")
    for row in info["per_layer"]:  # type: ignore[attr-defined]
        types = "/".join(row["types"])
        typer.echo(f"  {row['layer']:>5}  {types:<24} {row['record_bytes']:>14,} {row['stride']:>12,}")
    typer.echo(f"  routed bytes   {info['routed_bytes']:>16,}")
    if info["layout"] == "canonical":
        for name, p in info["planned"].items():  # type: ignore[attr-defined]
            if "error" in p:
                typer.echo(f"  as {name}: {p['error']}")
            else:
                typer.echo(
                    f"  as {name}: store {p['store_bytes']:,} B, overhead {p['overhead_bytes']:,} B, "
                    f"file {p['file_bytes']:,} B ({p['size_delta_bytes']:+,} B)"
                )
    else:
        typer.echo(f"  store bytes    {info['store_bytes']:>16,}")
        typer.echo(f"  overhead bytes {info['overhead_bytes']:>16,}")
        typer.echo(f"  file bytes     {info['file_bytes']:>16,} ({info['size_delta_bytes']:+,} vs source)")
        typer.echo(f"  source order   {info['source_order']}")


def main() -> None:
    """Stand-alone entry (``python -m forge.layout.cli``)."""
    from forge.cli import run_app

    run_app(app)


if __name__ == "__main__":
    main()
