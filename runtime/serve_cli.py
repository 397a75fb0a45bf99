"""``forge serve``: the OpenAI-compatible server (runtime.server) from the command line.

FastAPI and uvicorn are an optional extra; they are imported only when the command runs.
"""

from __future__ import annotations

import ipaddress
import socket
import sys
from dataclasses import dataclass
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


@dataclass
class ServeDemo:
    reply: str
    streamed_chunks: int
    seconds: float
    imatrix_requests: int


def demo_round_trip(model: str | Path, imatrix_out: Path | None = None, max_tokens: int = 8) -> ServeDemo:
    """For ``forge demo``: serve MODEL on a free loopback port, ask one plain and one streamed chat request
    over HTTP (stdlib client), stop the server (final imatrix snapshot when ``imatrix_out``)."""
    require_serve_deps()
    import json
    import threading
    import time
    import urllib.request

    import uvicorn

    from forge.imatrix.live import LiveImatrix
    from runtime.server import create_app, load_engine

    t0 = time.perf_counter()
    live = LiveImatrix(imatrix_out, every=0, min_requests=1) if imatrix_out is not None else None
    engine = load_engine(model, name="demo", imatrix=live)
    server = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise ForgeError("forge serve demo: the server did not start")
        time.sleep(0.01)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/v1/chat/completions"

    def post(stream: bool) -> bytes:
        body = {"model": "demo", "max_tokens": max_tokens, "temperature": 0, "stream": stream,
                "messages": [{"role": "user", "content": "Name three uses of a quantized model."}]}  # fmt: skip
        req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.read()

    try:
        reply = json.loads(post(False))["choices"][0]["message"]["content"]
        chunks = [ln for ln in post(True).split(b"\n\n") if ln.startswith(b"data: {")]
    finally:
        server.should_exit = True
        thread.join()
    return ServeDemo(reply, len(chunks), time.perf_counter() - t0, live.requests if live else 0)


if __name__ == "__main__":  # python -m runtime.serve_cli MODEL ... (works before `forge serve` is registered)
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(serve)
    try:
        app()
    except ForgeError as e:
        sys.stderr.write(f"error: {e}\n")
        sys.exit(1)
