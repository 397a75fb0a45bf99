"""``forge demo``: the main job end to end on the bundled example model."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from forge.errors import ForgeError

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny-qwen3moe"


@dataclass
class Step:
    step: str
    output: str
    bytes: int
    seconds: float
    result: str


def _timed(fn: Callable[[], tuple[str, int, str]], step: str) -> Step:
    start = time.perf_counter()
    output, nbytes, result = fn()
    return Step(step, output, nbytes, time.perf_counter() - start, result)


def run_demo(model: Path | None, keep: Path | None, console: Console) -> list[Step]:
    from forge.convert import convert_checkpoint
    from forge.inspect_file import describe

    model = model or EXAMPLE
    if not (model / "config.json").is_file():
        raise ForgeError(f"{model}: example model not found (pass --model HF_DIR)")
    with tempfile.TemporaryDirectory(prefix="forge-demo-") as tmp:
        work = keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        bf16 = work / "model-bf16.gguf"
        rows = []

        def do_convert() -> tuple[str, int, str]:
            rep = convert_checkpoint(model, bf16, "bf16", progress=True)
            return bf16.name, rep.bytes_written, f"{rep.n_tensors} tensors, lossless"

        def do_inspect() -> tuple[str, int, str]:
            info = describe(bf16)
            return (
                bf16.name,
                info["file_bytes"],
                f"{info['architecture']}, {info['parameters']:,} params, {info['bits_per_weight']:.2f} bpw",
            )

        for name, fn in (("convert HF -> GGUF bf16", do_convert), ("inspect", do_inspect)):
            console.print(f"[bold]>[/bold] {name}")
            rows.append(_timed(fn, name))
        return rows
