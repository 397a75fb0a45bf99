"""Progress bars for long work (rich, on stderr); silent when disabled or not a terminal."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

stderr = Console(stderr=True)


@contextlib.contextmanager
def byte_progress(total: int, description: str, enabled: bool = True) -> Iterator[Callable[[int, str], None]]:
    """Yield ``advance(nbytes, label)``; shows a bar with throughput when enabled and on a terminal."""
    if not enabled or not sys.stderr.isatty():
        yield lambda n, label="": None
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[label]}"),
    )
    with Progress(*columns, console=stderr, transient=True) as bar:
        task = bar.add_task(description, total=total, label="")
        yield lambda n, label="": bar.update(task, advance=n, label=label)
