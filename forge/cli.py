"""The ``forge`` command: one thin function per command (parsing and printing only)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from forge.atomic import refuse_overwriting_inputs
from forge.errors import ForgeError

app = typer.Typer(
    name="forge",
    help="Quantize, calibrate and lay out Mixture-of-Experts models as GGUF files.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console()
err = Console(stderr=True)


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=1, default=str) + "\n")


@app.command()
def convert(
    hf_dir: Annotated[
        Path, typer.Argument(help="Hugging Face checkpoint folder (config.json + safetensors)")
    ],
    output: Annotated[Path, typer.Option("-o", "--output", help="GGUF file to write")],
    outtype: Annotated[str, typer.Option(help="bf16, f16 or f32")] = "bf16",
    split_max_size: Annotated[
        str | None, typer.Option(help="split into shards of at most this size (e.g. 2G)")
    ] = None,
    no_mtp: Annotated[
        bool, typer.Option("--no-mtp", help="leave out the multi-token-prediction block")
    ] = False,
    mtp_only: Annotated[
        bool,
        typer.Option(
            "--mtp-only", help="write only the multi-token-prediction block, a draft model (deepseek4)"
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print a JSON report")] = False,
) -> None:
    """Convert a Hugging Face MoE checkpoint to GGUF, losslessly (streamed, bounded memory)."""
    from forge.convert import convert_checkpoint
    from forge.gguf_file import parse_size

    if no_mtp and mtp_only:
        raise ForgeError("--no-mtp and --mtp-only exclude each other")
    split = parse_size(split_max_size) if split_max_size else None
    rep = convert_checkpoint(
        hf_dir, output, outtype, split_max_size=split, mtp=not no_mtp, mtp_only=mtp_only, progress=not as_json
    )
    mbps = rep.source_bytes / rep.seconds / 1e6 if rep.seconds else 0.0
    if as_json:
        print_json({"outputs": [str(p) for p in rep.paths], "tensors": rep.n_tensors, "bytes": rep.bytes_written,
                    "seconds": round(rep.seconds, 3), "source_mb_per_s": round(mbps, 1)})  # fmt: skip
        return
    for p in rep.paths:
        out.print(f"wrote {p}")
    out.print(
        f"{rep.n_tensors} tensors, {rep.bytes_written:,} bytes in {rep.seconds:.2f} s ({mbps:.0f} MB/s of source)"
    )


@app.command("types")
def types_(
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON list")] = False,
) -> None:
    """GGUF tensor types: block geometry, bits per weight, and which encoders and decoders exist for each."""
    from forge import ggml_types

    rows = ggml_types.table()
    if as_json:
        print_json(rows)
        return
    table = Table()
    for heading in ("type", "id", "block", "bytes", "bpw", "encode", "decode"):
        table.add_column(heading, no_wrap=True)
    for r in rows:
        table.add_row(r["type"], str(r["id"]), str(r["block_size"]), str(r["type_size"]),
                      f"{r['bits_per_weight']:.4g}", ", ".join(r["encode"]), ", ".join(r["decode"]))  # fmt: skip
    out.print(table)


@app.command()
def inspect(
    file: Annotated[Path, typer.Argument(help="GGUF file")],
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Architecture, hyperparameters, tensors and bytes by type, bits per weight, layout and keys."""
    from forge.inspect_file import describe

    info = describe(file)
    if as_json:
        print_json(info)
        return
    out.print(f"[bold]{info['file']}[/bold]  {info['file_bytes']:,} bytes")
    out.print(f"architecture {info['architecture']}  name {info['name']!r}  file type {info['file_type']}"
              f"  layout {info['layout']}")  # fmt: skip
    hp = ", ".join(f"{k}={v}" for k, v in info["hyperparameters"].items())
    out.print(f"hyperparameters: {hp}")
    table = Table("type", "tensors", "bytes", "params", "bpw")
    for name, e in info["by_type"].items():
        table.add_row(
            name,
            str(e["tensors"]),
            f"{e['bytes']:,}",
            f"{e['elements']:,}",
            f"{8 * e['bytes'] / e['elements']:.3f}",
        )
    table.add_row("total", str(info["tensor_count"]), f"{info['tensor_bytes']:,}", f"{info['parameters']:,}",
                  f"{info['bits_per_weight']:.3f}", style="bold")  # fmt: skip
    out.print(table)
    for key, value in info["reuse_keys"].items():
        if not isinstance(value, list):
            out.print(f"{key} = {value}")
    if info["recipe"]:
        out.print("recipe: " + info["recipe"].splitlines()[0] + " ...")


@app.command()
def quantize(
    src: Annotated[
        Path, typer.Argument(help="Hugging Face folder (converted on the fly) or F32/F16/BF16 GGUF")
    ],
    output: Annotated[Path | None, typer.Option("-o", "--output", help="GGUF file to write")] = None,
    recipe: Annotated[str, typer.Option(help="preset name (e.g. q4_k_m) or a recipe .toml file")] = "q4_k_m",
    imatrix: Annotated[Path | None, typer.Option(help="importance matrix (llama.cpp GGUF or .dat)")] = None,
    tensor_type: Annotated[list[str] | None, typer.Option(help="PATTERN=TYPE override (repeatable)")] = None,
    dry_run: Annotated[
        bool, typer.Option(help="print the plan and exact output size; write nothing")
    ] = False,
    jobs: Annotated[int, typer.Option(help="worker processes; output bytes do not depend on it")] = 1,
    executor: Annotated[
        str, typer.Option(help="local (this machine, --jobs processes) or ray (a Ray cluster); same bytes")
    ] = "local",
    ray_address: Annotated[
        str | None, typer.Option(help="Ray cluster HOST:PORT (default: $RAY_ADDRESS, else a local Ray)")
    ] = None,
    device: Annotated[
        str, typer.Option(help="cpu, or a torch device (cuda) for types with a gpu encoder (forge types)")
    ] = "cpu",
    allow_requantize: Annotated[bool, typer.Option(help="allow an already-quantized source")] = False,
    reuse: Annotated[
        list[Path] | None, typer.Option(help="prior build (file or folder) to copy unchanged tensors from")
    ] = None,
    trust_mtime: Annotated[
        bool, typer.Option(help="key sources by shard name/size/mtime instead of content")
    ] = False,
    no_mtp: Annotated[
        bool, typer.Option("--no-mtp", help="leave out the multi-token-prediction block")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON report")] = False,
) -> None:
    """Quantize to GGUF with a recipe (llama.cpp's mixes or your own), bit-exact with llama-quantize."""
    from forge.distributed.cluster import choose_executor
    from forge.quant.quantize import bytes_by_type
    from forge.quant.quantize import quantize as run

    if output is None and not dry_run:
        raise ForgeError("give -o OUT.gguf (or --dry-run)")
    log = None if as_json else (lambda line: err.print(line, highlight=False, markup=False))
    on = choose_executor(executor, jobs, ray_address, log)
    plan, rep = run(src, None if dry_run else output, recipe, imatrix, tensor_type or [], jobs, allow_requantize,
                    not no_mtp, progress=not as_json, log=log, reuse=reuse or [], trust_mtime=trust_mtime,
                    warn=lambda line: err.print(line, highlight=False, markup=False), executor=on,
                    device=device)  # fmt: skip
    by_type = bytes_by_type(rep)
    n_el = sum(e["elements"] for e in by_type.values())
    n_bytes = sum(e["bytes"] for e in by_type.values())
    summary = {"output": str(output) if not dry_run else None, "dry_run": dry_run, "file_bytes": rep.bytes,
               "bits_per_weight": round(8 * n_bytes / n_el, 4), "seconds": round(rep.seconds, 3),
               "stages": {k: round(v, 3) for k, v in rep.stages.items()}, "by_type": by_type,
               "tensors": rep.tensors}  # fmt: skip
    if as_json:
        print_json(summary)
        return
    if dry_run:
        for row in rep.tensors:
            out.print(f"{row['name']:<36} {row['from']:>5} -> {row['to']:<7} {row['bytes']:>12,}  {row['reason']}",
                      highlight=False, markup=False, soft_wrap=True)  # fmt: skip
    table = Table("type", "tensors", "bytes", "bpw", title="plan" if dry_run else "quantized")
    for name, e in sorted(by_type.items(), key=lambda kv: -kv[1]["bytes"]):
        table.add_row(name, str(e["tensors"]), f"{e['bytes']:,}", f"{8 * e['bytes'] / e['elements']:.3f}")
    out.print(table)
    if reuse:
        copied = [r for r in rep.tensors if r["reason"].startswith("key match")]
        out.print(f"reuse: copied {len(copied)} / {len(rep.tensors)} tensors from prior builds")
        for r in rep.tensors:
            if r["action"] == "encoded":
                out.print(f"  regenerated {r['name']}: {r['reason']}", highlight=False, markup=False)
    verb = "would write" if dry_run else f"wrote {output}:"
    out.print(f"{verb} {rep.bytes:,} bytes, {summary['bits_per_weight']:.3f} bpw"
              + ("" if dry_run else f" in {rep.seconds:.1f} s"))  # fmt: skip
    if not dry_run:
        out.print(_stages_line(rep.stages), highlight=False, soft_wrap=True)


def _stages_line(stages: dict[str, float]) -> str:
    """Where a build's time went: reading and encoding are busy seconds summed over tensors (they overlap each
    other and the writer), the rest the writer's own."""
    s = {k: f"{v:.1f} s" for k, v in stages.items()}
    return (
        f"  time: source keys {s['source_keys']}; reading {s['read']}, encoding {s['encode']} (summed over "
        f"tensors); the writer waited {s['waited']}, hashed the output {s['output_digests']}, wrote "
        f"{s['writing']}"
    )


@app.command()
def demo(
    model: Annotated[
        Path | None,
        typer.Option(
            help="HF folder (default: the checkout's examples/tiny-qwen3moe, else random weights in its geometry)"
        ),
    ] = None,
    keep: Annotated[
        Path | None, typer.Option(help="keep the outputs in this folder instead of a temp folder")
    ] = None,
) -> None:
    """Run the main job end to end on the bundled example model and print a summary."""
    from forge.demo import run_demo

    rows = run_demo(model, keep, out)
    table = Table("step", "output", "bytes", "seconds", "result", title="forge demo")
    for r in rows:
        table.add_row(r.step, r.output, f"{r.bytes:,}" if r.bytes else "", f"{r.seconds:.2f}", r.result)
    out.print(table)


def _register_subcommands() -> None:
    from forge.imatrix.cli import app as imatrix_app
    from forge.layout.cli import app as layout_app
    from forge.prune.cli import app as prune_app
    from forge.search.cli import app as recipe_app
    from runtime.cli import eval_, run
    from runtime.serve_cli import serve
    from runtime.synth import synth

    app.add_typer(
        imatrix_app,
        name="imatrix",
        help="Importance matrices: collect, show, merge, convert (llama.cpp GGUF and .dat).",
    )

    app.add_typer(
        layout_app,
        name="layout",
        help="Expert-major layouts (ds4 v1/v2): convert, convert back, verify, inspect.",
    )

    app.add_typer(
        prune_app,
        name="prune",
        help="Expert pruning: profile routed experts, build a prune mask, write a smaller GGUF.",
    )
    app.add_typer(recipe_app, name="recipe", help="Recipes found by measurement: search.")
    app.command("run")(run)
    app.command("eval")(eval_)
    app.command("serve")(serve)
    app.command("synth")(synth)


_register_subcommands()


# Options that name files a command writes; every other path option or argument is an input.
OUTPUT_OPTIONS = {
    "output": "-o",
    "save_logits": "--save-logits",
    "imatrix_out": "--imatrix-out",
    "keep": "--keep",
}


def _paths(value: Any, files_named: bool = False) -> list[Path]:
    """The paths in an option's value; with ``files_named`` also strings that name an existing file
    (``--recipe my.toml``)."""
    items = value if isinstance(value, list | tuple) else [value]
    named = [Path(v) for v in items if files_named and isinstance(v, str) and v and os.path.isfile(v)]
    return [Path(v) for v in items if isinstance(v, Path)] + named


def _guarded(callback: Any) -> Any:
    """``callback`` preceded by the output guard: no output may replace or write into an input."""

    @functools.wraps(callback)
    def command(**params: Any) -> Any:
        outputs = [
            (OUTPUT_OPTIONS[k], p) for k, v in params.items() if k in OUTPUT_OPTIONS for p in _paths(v)
        ]
        inputs = [
            (k.replace("_", "-"), p)
            for k, v in params.items()
            if k not in OUTPUT_OPTIONS
            for p in _paths(v, True)
        ]
        refuse_overwriting_inputs(outputs, inputs)
        return callback(**params)

    return command


def _guard_all(command: Any) -> None:
    for sub in getattr(command, "commands", {}).values():
        _guard_all(sub)
    if getattr(command, "callback", None) is not None and not getattr(command, "commands", None):
        command.callback = _guarded(command.callback)


class Interrupted(BaseException):
    """SIGINT or SIGTERM: unwinds like an exception (outputs in progress are discarded), never caught as one."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


# After an interrupt, unwinding (temp files dropped, workers stopped) gets this long before a hard exit; the
# outputs in progress are anonymous files, so even the hard exit leaves nothing behind.
UNWIND_SECONDS = 10.0
_interrupted: list[int] = []
_redelivered: list[int] = []


def _interrupt(signum: int, frame: Any) -> None:
    if _redelivered:  # the first interrupt again, after a destructor swallowed it (``_unraisable``)
        if _running(frame, _unraisable.__code__):  # raised in the hook itself, it would be swallowed too
            _deliver_again(signum)
            return
        _redelivered.clear()
        raise Interrupted(signum)
    if _interrupted:  # a second Ctrl-C: stop now
        os._exit(128 + signum)
    _interrupted.append(signum)
    timer = threading.Timer(UNWIND_SECONDS, _hard_exit, (128 + signum,))
    timer.daemon = True
    timer.start()
    raise Interrupted(signum)


def _unraisable(unraisable: Any) -> None:
    """Python swallows an exception raised in a destructor (it prints "Exception ignored in ..."): an
    interrupt that lands in one would be lost and the command run on to success. Deliver it again, from
    another thread a moment later, so that it is handled once the destructor has returned (should it land in
    one again, this repeats)."""
    if isinstance(unraisable.exc_value, Interrupted):
        _redelivered.append(unraisable.exc_value.signum)
        _deliver_again(unraisable.exc_value.signum)
        return
    sys.__unraisablehook__(unraisable)


def _deliver_again(signum: int) -> None:
    again = threading.Timer(0.001, os.kill, (os.getpid(), signum))
    again.daemon = True
    again.start()


def _running(frame: Any, code: Any) -> bool:
    """Whether ``code`` is on the stack that ``frame`` ends."""
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _hard_exit(code: int) -> None:
    """Say ``interrupted`` and exit without Python's exit hooks (a worker pool's hook can hang on a pipe
    whose readers were killed); whatever had to be undone was undone while the interrupt unwound."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    sys.stderr.write("interrupted\n")
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    run_app(app)


def run_app(typer_app: typer.Typer) -> None:
    """Run a typer app the forge way: the output guard before every command; ForgeError and OS errors ->
    one ``error:`` line and exit 1; SIGINT/SIGTERM -> ``interrupted`` and exit 130/143, outputs untouched."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _interrupt)
    sys.unraisablehook = _unraisable
    command = typer.main.get_command(typer_app)
    _guard_all(command)
    try:
        code = command.main(standalone_mode=False)
    except ForgeError as e:
        _fail(str(e))
    except Interrupted as e:
        _hard_exit(128 + e.signum)
    except KeyboardInterrupt:  # a SIGINT that reached Python's default handler (another library's)
        _hard_exit(130)
    except OSError as e:
        _fail(f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e))
    except MemoryError:
        _fail("out of memory")
    except typer.Abort:
        sys.exit(1)
    except Exception as e:  # click's usage errors and exits arrive here in non-standalone mode
        if not hasattr(e, "exit_code"):
            raise
        if hasattr(e, "format_message") and type(e).__name__ != "NoArgsIsHelpError":
            ctx = getattr(e, "ctx", None)
            where = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
            sys.stderr.write(f"error: {' '.join(e.format_message().split())}{where}\n")
        elif hasattr(e, "show"):
            e.show()
        sys.exit(e.exit_code)
    if isinstance(code, int) and code:  # typer's own exit code (130 for a KeyboardInterrupt it caught)
        if code == 130:
            _hard_exit(code)
        sys.exit(code)


def _fail(message: str) -> None:
    sys.stderr.write(f"error: {' '.join(message.split())}\n")
    sys.exit(1)
