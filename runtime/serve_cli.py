"""``forge serve``: the OpenAI-compatible server (runtime.server) from the command line.

FastAPI and uvicorn are an optional extra; they are imported only when the command runs.
"""

from __future__ import annotations

import ipaddress
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from forge.errors import ForgeError
from forge.options import require_choice, require_context, require_int
from runtime.cli import DeviceOpt, ExpertCacheOpt, GpuCacheOpt, ProfileOpt, Q8Opt, ThreadsOpt, _setup

INSTALL_HINT = "forge serve needs FastAPI and uvicorn: pip install 'gguf-forge[serve]'"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn.config.LOG_LEVELS


def require_serve_deps() -> None:
    """One-line error (a ForgeError) when the ``serve`` extra is not installed."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ForgeError(f"{INSTALL_HINT} ({exc.name} is missing)") from None


def _addresses(host: str, port: int) -> list[tuple[int, int, int, tuple[Any, ...]]]:
    """What uvicorn (asyncio's create_server) will bind for ``host``: every address it resolves to."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise ForgeError(f"cannot serve on {host}:{port}: {reason}") from None
    return sorted({(family, kind, proto, addr) for family, kind, proto, _, addr in infos}, key=str)


def check_host(host: str, port: int, api_key: str | None) -> None:
    """Before the model is loaded: ``host`` resolves, a non-loopback host has an API key, and every address
    can be bound (a socket opened, bound as uvicorn will, and closed)."""
    addresses = _addresses(host, port)
    loopback = all(ipaddress.ip_address(addr[0].split("%")[0]).is_loopback for _, _, _, addr in addresses)
    if not loopback and not api_key:
        raise ForgeError(
            f"--host {host} is reachable from other machines: give --api-key KEY (or FORGE_API_KEY), "
            "or serve on 127.0.0.1"
        )
    for family, kind, proto, addr in addresses:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's create_server
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(addr)
        except OSError as exc:
            raise ForgeError(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None


def check_options(
    port: int,
    ctx: int | None,
    api_key: str | None,
    max_queue: int,
    imatrix_every: int,
    imatrix_min_requests: int,
    threads: int | None,
    expert_cache_mib: int,
    log_level: str,
    model_name: str | None,
) -> None:
    """Every ``forge serve`` option that can be checked without the model, in one place."""
    require_int("--port", port, 0, 65535)
    require_context("--ctx", ctx, None)
    if api_key is not None and not api_key.strip():
        raise ForgeError("--api-key must not be empty")
    if model_name is not None and not model_name.strip():
        raise ForgeError("--model-name must not be empty")
    require_int("--max-queue", max_queue, 1)
    require_int("--imatrix-every", imatrix_every, 0)
    require_int("--imatrix-min-requests", imatrix_min_requests, 0)
    require_int("--threads", threads, 1)
    require_int("--expert-cache-mib", expert_cache_mib, 0)
    require_choice("--log-level", log_level, LOG_LEVELS)


def _gpu_cache(size: str | None, profile: Path | None, device: str) -> int | None:
    """``--gpu-expert-cache`` in bytes (None: off), checked with ``--expert-profile`` before the model loads."""
    from forge.gguf_file import parse_size

    if size is None:
        if profile is not None:
            raise ForgeError("--expert-profile seeds --gpu-expert-cache: give both")
        return None
    if device != "cuda":
        raise ForgeError("--gpu-expert-cache needs --device cuda")
    if profile is not None and not profile.is_file():
        raise ForgeError(f"{profile}: no such file")
    return parse_size(size)


def _model_context(model: Path) -> int | None:
    """The trained context from a GGUF file's metadata, without loading the model (None: not known yet)."""
    if not model.is_file():
        return None
    from forge.gguf_file import open_gguf

    g = open_gguf(model)
    value = g.kv(f"{g.kv('general.architecture')}.context_length")
    return int(value) if value else None


def serve(
    model: Annotated[Path, typer.Argument(help="GGUF file (or Hugging Face folder)")],
    host: Annotated[
        str, typer.Option(help="address to bind (other than loopback: needs --api-key)")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8080,
    model_name: Annotated[
        str | None, typer.Option("--model-name", help="model id clients send (default: the file stem)")
    ] = None,
    ctx: Annotated[int | None, typer.Option(help="context length (default: the model's)")] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            envvar="FORGE_API_KEY",
            help="require 'Authorization: Bearer KEY' (needed off loopback)",
        ),
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
    q8_activations: Q8Opt = False,
    expert_cache_mib: ExpertCacheOpt = 1024,
    log_level: Annotated[
        str, typer.Option("--log-level", help="uvicorn log level: " + ", ".join(LOG_LEVELS))
    ] = "info",
    gpu_expert_cache: GpuCacheOpt = None,
    expert_profile: ProfileOpt = None,
) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API (chat, completions, streaming)."""
    # Everything that can fail is checked before the model is loaded: options, device, the imatrix
    # output's folder, the address (resolved, an API key unless loopback, bound once and released).
    log_level = log_level.lower()
    check_options(port, ctx, api_key, max_queue, imatrix_every, imatrix_min_requests, threads,
                  expert_cache_mib, log_level, model_name)  # fmt: skip
    require_serve_deps()
    import uvicorn

    from forge.imatrix.live import LiveImatrix
    from runtime.server import create_app, load_engine

    device = _setup(device, threads, q8=q8_activations, hybrid=gpu_expert_cache is not None)
    gpu_cache = _gpu_cache(gpu_expert_cache, expert_profile, device)
    live = None
    if imatrix_out is not None:
        live = LiveImatrix(imatrix_out, every=imatrix_every, min_requests=imatrix_min_requests)
    check_host(host, port, api_key)
    require_context("--ctx", ctx, _model_context(model))
    engine = load_engine(model, device, model_name, ctx, live, expert_cache_mib << 20, max_queue, gpu_cache,
                         expert_profile)  # fmt: skip
    require_context("--ctx", ctx, engine.model.n_ctx_train)  # a Hugging Face folder's, known only now
    sys.stderr.write(f"serving {engine.name!r} (context {engine.context}) on http://{host}:{port}/v1\n")
    if live is not None:
        sys.stderr.write(
            f"live imatrix -> {live.path}: every {imatrix_every} requests after {imatrix_min_requests}"
            " (prompt statistics only, no text)\n"
        )
    try:
        uvicorn.run(create_app(engine, api_key), host=host, port=port, log_level=log_level)
    finally:  # also on SIGINT/SIGTERM, which uvicorn re-raises after its graceful shutdown
        if engine.close_error is not None:  # the final snapshot failed: that, not the signal, is the news
            raise ForgeError(engine.close_error)
        if live is not None and live.snapshots:
            sys.stderr.write(
                f"imatrix: {live.requests} requests, {live.snapshots} snapshots in {live.path}\n"
            )


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
    if engine.close_error is not None:
        raise ForgeError(engine.close_error)
    return ServeDemo(reply, len(chunks), time.perf_counter() - t0, live.requests if live else 0)


if __name__ == "__main__":  # python -m runtime.serve_cli MODEL ...: `forge serve` alone, run the CLI's way
    from forge.cli import run_app

    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(serve)
    run_app(app)
