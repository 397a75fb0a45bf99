"""``forge serve``: the OpenAI-compatible server (runtime.server) from the command line.

FastAPI and uvicorn are an optional extra; they are imported only when the command runs.
"""

from __future__ import annotations

import ipaddress
import socket
import sys
from pathlib import Path
from typing import Annotated

import typer

from forge.errors import ForgeError
from runtime.cli import DeviceOpt, ExpertCacheOpt, ThreadsOpt, _setup

INSTALL_HINT = "forge serve needs FastAPI and uvicorn: pip install 'gguf-forge[serve]'"


def require_serve_deps() -> None:
    """One-line error (a ForgeError) when the ``serve`` extra is not installed."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ForgeError(f"{INSTALL_HINT} ({exc.name} is missing)") from None


def is_loopback(host: str) -> bool:
    try:
        return all(ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, None))
    except (OSError, ValueError):
        return False


def serve(
    model: Annotated[Path, typer.Argument(help="GGUF file (or Hugging Face folder)")],
    host: Annotated[str, typer.Option(help="address to bind (default: loopback only)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8080,
    model_name: Annotated[
        str | None, typer.Option("--model-name", help="model id clients send (default: the file stem)")
    ] = None,
    ctx: Annotated[int | None, typer.Option(help="context length (default: the model's)")] = None,
    api_key: Annotated[
        str | None,
        typer.Option("--api-key", envvar="FORGE_API_KEY", help="require 'Authorization: Bearer KEY'"),
    ] = None,
    max_queue: Annotated[int, typer.Option("--max-queue", help="queued requests before 503")] = 64,
    imatrix_out: Annotated[
        Path | None,
        typer.Option("--imatrix-out", help="collect a live importance matrix into this file (.gguf or .dat)"),
    ] = None,
    imatrix_every: Annotated[
        int, typer.Option("--imatrix-every", help="snapshot every N requests (0: only at shutdown)")
    ] = 64,
    imatrix_min_requests: Annotated[
        int, typer.Option("--imatrix-min-requests", help="no snapshot before N requests")
    ] = 8,
    device: DeviceOpt = "cpu",
    threads: ThreadsOpt = None,
    expert_cache_mib: ExpertCacheOpt = 1024,
    log_level: Annotated[str, typer.Option("--log-level", help="uvicorn log level")] = "info",
) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API (chat, completions, streaming)."""
    require_serve_deps()
    import uvicorn

    from forge.imatrix.live import LiveImatrix
    from runtime.server import create_app, load_engine

    if not 0 <= port <= 65535:
        raise ForgeError("--port must be in 0..65535")
    if imatrix_every < 0 or imatrix_min_requests < 0:
        raise ForgeError("--imatrix-every and --imatrix-min-requests must be >= 0")
    if max_queue < 1:
        raise ForgeError("--max-queue must be >= 1")
    if ctx is not None and ctx < 2:
        raise ForgeError("--ctx must be >= 2")
    live = None
    if imatrix_out is not None:
        live = LiveImatrix(imatrix_out, every=imatrix_every, min_requests=imatrix_min_requests)
    if not is_loopback(host) and api_key is None:
        sys.stderr.write(
            f"warning: serving on {host} without --api-key: anyone who can reach it can use it\n"
        )
    engine = load_engine(
        model, _setup(device, threads), model_name, ctx, live, expert_cache_mib << 20, max_queue
    )
    sys.stderr.write(f"serving {engine.name!r} (context {engine.context}) on http://{host}:{port}/v1\n")
    if live is not None:
        sys.stderr.write(
            f"live imatrix -> {live.path}: every {imatrix_every} requests after {imatrix_min_requests}"
            " (prompt statistics only, no text)\n"
        )
    uvicorn.run(create_app(engine, api_key), host=host, port=port, log_level=log_level)
    if live is not None and live.snapshots:
        sys.stderr.write(f"imatrix: {live.requests} requests, {live.snapshots} snapshots in {live.path}\n")


if __name__ == "__main__":  # python -m runtime.serve_cli MODEL ... (works before `forge serve` is registered)
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(serve)
    try:
        app()
    except ForgeError as e:
        sys.stderr.write(f"error: {e}\n")
        sys.exit(1)
