"""OpenAI-compatible HTTP API over the runtime (``forge serve``), with optional live imatrix collection.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (each with
``stream: true`` as server-sent events ending in ``data: [DONE]``) and ``GET /health``.

One worker thread owns the model and serves queued requests one at a time; HTTP handlers only
validate, tokenize, enqueue and relay events. A bad request (text that is not valid Unicode included)
gets a 4xx with OpenAI's error body ``{"error": {"message", "type", "param", "code"}}`` and never
reaches the worker. A client that hangs up, streaming or not, cancels its job: the worker drops it at
its next token, or as it leaves the queue (``/health`` counts ``cancelled`` and ``generated_tokens``).

Live imatrix: the model is loaded with a :class:`PrefillGate` observer that forwards matmul inputs to a
:class:`~forge.imatrix.live.LiveImatrix` only while a prompt is being prefilled (as ds4's server
does): generated tokens are the model's own output, not workload. After each request the worker calls
``request_done()``, which snapshots atomically when due; the final snapshot is written at shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import secrets
import sys
import threading
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
from fastapi import Depends, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from forge.errors import ForgeError
from forge.imatrix.live import LiveImatrix
from runtime import cpu_kernels
from runtime.generate import Sampling, generate
from runtime.models import MoeCausalLM, load_model, prepare_decode
from runtime.observers import Observer
from runtime.tokenizer import Tokenizer
from runtime.weights import DEFAULT_EXPERT_BUDGET

MAX_BODY_BYTES = 32 << 20
MAX_STOPS = 16
DISCONNECT_POLL_S = 0.1  # how often a waiting non-streaming request checks that its client is still there
R = TypeVar("R", bound=BaseModel)


# ----------------------------------------------------------------------------------------------- errors


class APIError(Exception):
    """A request the server refuses: becomes ``{"error": {...}}`` with HTTP ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


_UNION_TAGS = {"str", "int", "float", "bool", "none"}


def _validation_error(errors: list[Any]) -> APIError:
    first = errors[0] if errors else {}
    loc: list[str] = []
    msg = first.get("msg", "invalid value")
    for part in first.get("loc", ()):
        part = str(part)
        if "[" in part or part in _UNION_TAGS:  # pydantic names the union member it tried: not a field
            msg = "not one of the accepted types"
            break
        if part != "body":
            loc.append(part)
    param = ".".join(loc) or None
    where = f"{param}: " if param else ""
    return APIError(400, f"{where}{msg}", param=param, code="invalid_value")


def _no_constants(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def parse_body(raw: bytes, cls: type[R]) -> R:
    """A request model from a JSON body, whatever its Content-Type (curl sends form-encoded by default)."""
    try:
        data = json.loads(raw, parse_constant=_no_constants)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise APIError(400, "the request body is not valid JSON", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    _require_unicode(data)
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc.errors()) from None


def _require_unicode(data: dict[str, Any]) -> None:
    """Refuse text that cannot be encoded as UTF-8 anywhere in the body (keys included).

    JSON can spell a lone UTF-16 surrogate (``"\\ud800"``) and Python's decoder lets it through; such a
    string can be neither tokenized nor written back, so it is a bad request, wherever it appears.
    """
    todo: list[tuple[str, Any]] = [("", data)]
    while todo:  # iterative: the body may nest as deep as the JSON parser allows
        where, value = todo.pop()
        if isinstance(value, dict):
            for k, v in value.items():
                _require_encodable(k, f"a key in {where or 'the body'}", where or None)
                todo.append((f"{where}.{k}" if where else k, v))
        elif isinstance(value, list):
            todo.extend((f"{where}[{i}]", v) for i, v in enumerate(value) if isinstance(v, (str, list, dict)))
        elif isinstance(value, str):
            _require_encodable(value, where, where)


def _require_encodable(text: str, where: str, param: str | None) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = f"U+{ord(text[exc.start]):04X}"
        raise APIError(400, f"{where}: the text is not valid Unicode (a lone surrogate {bad}; send UTF-8)",
                       param, "invalid_unicode") from None  # fmt: skip


# --------------------------------------------------------------------------------------- request models


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    include_usage: bool | None = False


class _Request(BaseModel):
    # strict: "5" is not an int and true is not a number; unknown fields are ignored (clients send many)
    model_config = ConfigDict(strict=True, extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]


_Request.model_rebuild()
ChatRequest.model_rebuild()
CompletionRequest.model_rebuild()

# Known OpenAI parameters we do not implement: accepted only at their no-op value, refused otherwise
# (ignoring them would silently change the answer).
_NOOP_VALUES: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "tools": (None, []),
    "functions": (None, []),
    "response_format": (None, {"type": "text"}),
}


def _refuse_unsupported(req: _Request) -> None:
    for name, value in (req.model_extra or {}).items():
        allowed = _NOOP_VALUES.get(name)
        if allowed is not None and not any(type(value) is type(a) and value == a for a in allowed):
            raise APIError(400, f"{name}={value!r} is not supported", name, "unsupported_parameter")


# ------------------------------------------------------------------------------------------- the worker


@dataclass
class TextEvent:
    index: int
    text: str


@dataclass
class FinishEvent:
    index: int
    reason: str  # "stop" or "length"
    prompt_tokens: int
    completion_tokens: int


@dataclass
class ErrorEvent:
    error: APIError


class EndEvent:
    pass


Event = TextEvent | FinishEvent | ErrorEvent | EndEvent


@dataclass
class Job:
    prompts: list[list[int]]
    max_tokens: int | None  # None: until a stop or the end of the context
    sampling: Sampling
    stops: list[str]
    emit: Callable[[Event], None]
    cancelled: threading.Event = field(default_factory=threading.Event)


class _Cancelled(Exception):
    pass


class _StopStringHit(Exception):
    pass


class PrefillGate(Observer):
    """Forwards observations to ``target`` only while ``open`` (the worker opens it for each prefill)."""

    def __init__(self, target: Observer) -> None:
        self.target = target
        self.open = False

    def on_matmul_input(self, tensor_name: str, x: torch.Tensor, expert_ids: torch.Tensor | None) -> None:
        if self.open:
            self.target.on_matmul_input(tensor_name, x, expert_ids)

    def on_routing(
        self, layer: int, experts: torch.Tensor, weights: torch.Tensor, logits: torch.Tensor
    ) -> None:
        if self.open:
            self.target.on_routing(layer, experts, weights, logits)


class StopText:
    """Applies OpenAI ``stop`` strings to streamed text: holds back any tail that could begin a stop."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.text = ""
        self.sent = 0

    def feed(self, piece: str) -> tuple[str, bool]:
        """Text now safe to send, and whether a stop string was reached (the text ends before it)."""
        self.text += piece
        hits = [i for i in (self.text.find(s, self.sent) for s in self.stops) if i >= 0]
        if hits:
            out, self.sent = self.text[self.sent : min(hits)], len(self.text)
            return out, True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text) - self.sent), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        end = len(self.text) - hold
        out, self.sent = self.text[self.sent : end], end
        return out, False

    def flush(self) -> str:
        out, self.sent = self.text[self.sent :], len(self.text)
        return out


class _TokenTap:
    """Stands in for the tokenizer inside ``generate``: sees each generated token before it is decoded.

    That moment marks the end of the prefill (closes the imatrix gate), counts completion tokens even
    when a stop string ends generation early, and is where a cancelled request is abandoned.
    """

    def __init__(self, engine: Engine, job: Job) -> None:
        self.engine, self.job = engine, job
        self.count = 0

    def token_bytes(self, token_id: int) -> bytes:
        if self.engine.gate is not None:
            self.engine.gate.open = False
        if self.job.cancelled.is_set():
            raise _Cancelled
        self.count += 1
        self.engine.generated += 1
        return self.engine.tokenizer.token_bytes(token_id)


class Engine:
    """The model, its tokenizer and one worker thread that serves queued jobs in order."""

    def __init__(
        self,
        model: MoeCausalLM,
        tokenizer: Tokenizer,
        name: str,
        context: int | None = None,
        imatrix: LiveImatrix | None = None,
        gate: PrefillGate | None = None,
        max_queue: int = 64,
    ) -> None:
        if imatrix is not None and (gate is None or gate.target is not imatrix):
            raise ValueError("live imatrix needs the model loaded with PrefillGate(imatrix) as observer")
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.context = min(context or model.n_ctx_train, model.n_ctx_train)
        self.imatrix, self.gate = imatrix, gate
        self.stop_ids = tokenizer.stop_ids
        self.vocab_size = model.vocab_size
        # no token is longer than this many characters: longer texts cannot fit the context
        self.max_token_chars = max(len(tokenizer.token_bytes(i)) for i in range(len(tokenizer.tokens)))
        self.created = int(time.time())
        self.served = 0
        self.generated = 0  # completion tokens, counted as they are made
        self.cancelled = 0  # requests abandoned because their client went away
        self.close_error: str | None = None  # why the final imatrix snapshot failed, if it did
        self._jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._thread: threading.Thread | None = None

    # lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="forge-serve-worker", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Finish the running job, refuse the queued ones, stop the worker, write the final snapshot.

        A failed final snapshot does not raise (it would abort the server's shutdown); its reason is kept
        in ``close_error`` for the caller to report.
        """
        if self._thread is not None:
            while True:  # drain what is queued, then stop
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job.emit(ErrorEvent(APIError(503, "the server is shutting down", type_="server_error")))
                    job.emit(EndEvent())
            self._jobs.put(None)
            self._thread.join()
            self._thread = None
        if self.imatrix is not None:
            try:
                self.imatrix.close()
            except ForgeError as exc:
                self.close_error = str(exc)

    @property
    def queued(self) -> int:
        return self._jobs.qsize()

    def submit(self, job: Job) -> None:
        if self._thread is None:
            raise APIError(503, "the server is not running", type_="server_error", code="not_running")
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise APIError(503, "too many queued requests; retry later", type_="server_error",
                           code="queue_full") from None  # fmt: skip

    # prompts --------------------------------------------------------------------------------------------
    def _fits(self, text: str, param: str) -> None:
        if len(text) > self.context * self.max_token_chars:  # refuse huge bodies before tokenizing them
            raise self._too_long(f"more than {self.context} tokens", param)

    def _too_long(self, n: str, param: str) -> APIError:
        return APIError(400, f"the prompt has {n}; the context holds {self.context} (prompt + reply)",
                        param, "context_length_exceeded")  # fmt: skip

    def _checked(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise APIError(400, "the prompt is empty", param, "empty_prompt")
        if len(ids) >= self.context:
            raise self._too_long(f"{len(ids)} tokens", param)
        return ids

    def encode_text(self, text: str, param: str = "prompt") -> list[int]:
        """As ``forge run -p``: control tokens written in the text become their ids."""
        self._fits(text, param)
        return self._checked(self.tokenizer.encode(text, parse_special=True), param)

    def encode_tokens(self, ids: list[int], param: str = "prompt") -> list[int]:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})", param,
                           "invalid_token")  # fmt: skip
        return self._checked(ids, param)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """As ``forge run --chat``: the GGUF chat template with the assistant turn opened."""
        self._fits("".join(m["content"] for m in messages), "messages")
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except ForgeError as exc:
            raise APIError(400, str(exc), "messages", "chat_template_error") from exc
        return self.encode_text(text, "messages")

    # serving --------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._serve(job)

    def _serve(self, job: Job) -> None:
        if job.cancelled.is_set():  # its client left while it was queued
            self.cancelled += 1
            job.emit(EndEvent())
            return
        ran = False
        try:
            for index, ids in enumerate(job.prompts):
                ran = True
                self._generate(job, index, ids)
        except _Cancelled:
            self.cancelled += 1
        except ForgeError as exc:
            job.emit(ErrorEvent(APIError(400, str(exc))))
        except Exception as exc:  # keep serving; the client gets a 500
            traceback.print_exc(file=sys.stderr)
            job.emit(ErrorEvent(APIError(500, f"internal error: {type(exc).__name__}", type_="server_error")))
        finally:
            if self.gate is not None:
                self.gate.open = False
            job.emit(EndEvent())
        self.served += 1
        if ran and self.imatrix is not None:
            try:
                self.imatrix.request_done()
            except (ForgeError, OSError) as exc:  # e.g. a full disk: report it and keep serving
                sys.stderr.write(f"warning: imatrix snapshot failed: {exc}\n")

    def _generate(self, job: Job, index: int, ids: list[int]) -> None:
        tap = _TokenTap(self, job)
        stop = StopText(job.stops)

        def on_text(piece: str) -> None:
            out, hit = stop.feed(piece)
            if out:
                job.emit(TextEvent(index, out))
            if hit:
                raise _StopStringHit

        max_tokens = job.max_tokens if job.max_tokens is not None else self.context
        if self.gate is not None:
            self.gate.open = True
        try:
            res = generate(self.model, ids, max_tokens, job.sampling, tap,  # type: ignore[arg-type]
                           on_text, self.stop_ids, self.context)  # fmt: skip
            reason = "stop" if res.stopped_by == "stop-token" else "length"
            rest = stop.flush()  # a held-back tail that never became a stop string
            if rest:
                job.emit(TextEvent(index, rest))
        except _StopStringHit:
            reason = "stop"
        finally:
            if self.gate is not None:
                self.gate.open = False
        job.emit(FinishEvent(index, reason, len(ids), tap.count))


def load_engine(
    model: str | Path,
    device: str = "cpu",
    name: str | None = None,
    context: int | None = None,
    imatrix: LiveImatrix | None = None,
    expert_budget: int = DEFAULT_EXPERT_BUDGET,
    max_queue: int = 64,
    gpu_cache_bytes: int | None = None,
    expert_profile: Path | None = None,
) -> Engine:
    """Load a GGUF file (or HF folder) for serving; with ``imatrix`` its prefill statistics are collected.
    ``gpu_cache_bytes``: hybrid experts (runtime.hybrid) with a GPU pool of that size, seeded from
    ``expert_profile``."""

    def load() -> Engine:
        gate = PrefillGate(imatrix) if imatrix is not None else None
        if gpu_cache_bytes is not None:
            from runtime.planner import load_planned_model

            m, _ = load_planned_model(Path(model), device, "hybrid", expert_budget=expert_budget,
                                      observers=[gate] if gate else None, gpu_cache_bytes=gpu_cache_bytes,
                                      expert_profile=expert_profile)  # fmt: skip
        else:
            m = load_model(model, device, observers=[gate] if gate else None, expert_budget=expert_budget)
            prepare_decode(m)
        tok = Tokenizer.from_metadata(m.weights)
        return Engine(m, tok, name or Path(model).stem, context, imatrix, gate, max_queue)

    # loaded on a thread of its own (``cpu_kernels.on_own_thread``): the worker that serves the requests runs
    # the kernels, and this thread would keep an OpenMP team for good
    return cpu_kernels.on_own_thread(load)


# ------------------------------------------------------------------------------------------ HTTP layer


def _sampling(req: _Request) -> Sampling:
    temperature = 1.0 if req.temperature is None else req.temperature  # OpenAI's default
    return Sampling(
        temperature=temperature,
        top_k=req.top_k or 0,
        top_p=1.0 if req.top_p is None else req.top_p,
        seed=req.seed,
    )


def _stops(req: _Request) -> list[str]:
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOPS:
        raise APIError(400, f"at most {MAX_STOPS} stop strings", "stop", "invalid_value")
    if any(not s for s in stops):
        raise APIError(400, "stop strings must not be empty", "stop", "invalid_value")
    return stops


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def _usage(finishes: dict[int, FinishEvent]) -> dict[str, int]:
    p = sum(f.prompt_tokens for f in finishes.values())
    c = sum(f.completion_tokens for f in finishes.values())
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


class _BodyLimit:
    """Refuses request bodies declared larger than ``limit`` bytes (413) before reading them."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            length = dict(scope["headers"]).get(b"content-length")
            if length is not None and (not length.isdigit() or int(length) > self.limit):
                err = APIError(413, f"the request body exceeds {self.limit} bytes", code="body_too_large")
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(engine: Engine, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The FastAPI application; starting it starts the engine's worker, stopping it closes the engine."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await run_in_threadpool(engine.close)

    app = FastAPI(title="gguf-forge", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_BodyLimit, limit=max_body_bytes)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                        code=code).response()  # fmt: skip

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        traceback.print_exception(exc, file=sys.stderr)
        return APIError(500, f"internal error: {type(exc).__name__}", type_="server_error").response()

    async def authorize(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "invalid or missing API key", code="invalid_api_key")

    def check_model(req: _Request) -> None:
        if req.model != engine.name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server has {engine.name!r}",
                           "model", "model_not_found")  # fmt: skip
        _refuse_unsupported(req)

    def model_card() -> dict[str, Any]:
        return {"id": engine.name, "object": "model", "created": engine.created, "owned_by": "gguf-forge",
                "context_length": engine.context}  # fmt: skip

    @app.get("/health")
    async def health() -> dict[str, Any]:
        info: dict[str, Any] = {"status": "ok", "model": engine.name, "queued": engine.queued,
                                "served": engine.served, "cancelled": engine.cancelled,
                                "generated_tokens": engine.generated}  # fmt: skip
        if engine.imatrix is not None:
            info["imatrix"] = {"requests": engine.imatrix.requests, "snapshots": engine.imatrix.snapshots}
        return info

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(authorize)])
    async def model_info(model_id: str) -> dict[str, Any]:
        if model_id != engine.name:
            raise APIError(404, f"the model {model_id!r} does not exist", "model", "model_not_found")
        return model_card()

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)], response_model=None)
    async def chat_completions(request: Request) -> JSONResponse | StreamingResponse:
        req = parse_body(await request.body(), ChatRequest)
        check_model(req)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        ids = await run_in_threadpool(engine.encode_chat, messages)
        max_tokens = req.max_completion_tokens or req.max_tokens
        return await _respond(engine, request, req, [ids], max_tokens, chat=True)

    @app.post("/v1/completions", dependencies=[Depends(authorize)], response_model=None)
    async def completions(request: Request) -> JSONResponse | StreamingResponse:
        req = parse_body(await request.body(), CompletionRequest)
        check_model(req)
        p = req.prompt
        if isinstance(p, str):
            prompts = [await run_in_threadpool(engine.encode_text, p)]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [engine.encode_tokens(p)]  # type: ignore[arg-type]
        elif p and all(isinstance(x, str) for x in p):
            prompts = [await run_in_threadpool(engine.encode_text, x) for x in p]  # type: ignore[arg-type]
        elif p:
            prompts = [engine.encode_tokens(x) for x in p]  # type: ignore[arg-type]
        else:
            raise APIError(400, "the prompt is empty", "prompt", "empty_prompt")
        return await _respond(engine, request, req, prompts, req.max_tokens or 16, chat=False)  # OpenAI: 16

    return app


async def _respond(
    engine: Engine,
    request: Request,
    req: _Request,
    prompts: list[list[int]],
    max_tokens: int | None,
    chat: bool,
) -> JSONResponse | StreamingResponse:
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[Event] = asyncio.Queue()

    def emit(ev: Event) -> None:  # called from the worker thread
        with contextlib.suppress(RuntimeError):  # the event loop is gone (shutdown): nobody listens
            loop.call_soon_threadsafe(events.put_nowait, ev)

    job = Job(prompts, max_tokens, _sampling(req), _stops(req), emit)
    engine.submit(job)
    ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    head = {"id": ident, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": engine.name}  # fmt: skip
    if req.stream:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        stream = _stream(job, events, head, chat, req)
        return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
    watch = asyncio.create_task(_cancel_on_disconnect(request, job))
    try:
        texts: dict[int, list[str]] = {i: [] for i in range(len(prompts))}
        finishes: dict[int, FinishEvent] = {}
        while not isinstance(ev := await events.get(), EndEvent):
            if isinstance(ev, ErrorEvent):
                raise ev.error
            if isinstance(ev, TextEvent):
                texts[ev.index].append(ev.text)
            elif isinstance(ev, FinishEvent):
                finishes[ev.index] = ev
    except asyncio.CancelledError:
        job.cancelled.set()
        raise
    finally:
        watch.cancel()
    choices = []
    for i, f in sorted(finishes.items()):
        text = "".join(texts[i])
        if chat:
            choices.append({"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                            "finish_reason": f.reason})  # fmt: skip
        else:
            choices.append({"index": i, "text": text, "logprobs": None, "finish_reason": f.reason})
    return JSONResponse({**head, "choices": choices, "usage": _usage(finishes)})


async def _cancel_on_disconnect(request: Request, job: Job) -> None:
    """While a non-streaming answer is being made: if the client hangs up, cancel its job (the worker drops
    it at its next token, or when it leaves the queue). Streaming responses get this from Starlette."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    job.cancelled.set()


def _stream(
    job: Job, events: asyncio.Queue[Event], head: dict[str, Any], chat: bool, req: _Request
) -> AsyncIterator[bytes]:
    head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(index: int, content: str | None, reason: str | None = None, role: bool = False) -> bytes:
        if chat:
            delta: dict[str, str] = {"role": "assistant"} if role else {}
            if content is not None:
                delta["content"] = content
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": index, "text": content or "", "logprobs": None, "finish_reason": reason}
        return _sse({**head, "choices": [choice]})

    async def body() -> AsyncIterator[bytes]:
        finishes: dict[int, FinishEvent] = {}
        started: set[int] = set()
        try:
            while not isinstance(ev := await events.get(), EndEvent):
                if isinstance(ev, ErrorEvent):
                    yield _sse(ev.error.body())
                    continue
                if chat and ev.index not in started:  # the first chunk of a choice names the role
                    started.add(ev.index)
                    yield chunk(ev.index, "", role=True)
                if isinstance(ev, TextEvent):
                    yield chunk(ev.index, ev.text)
                else:
                    finishes[ev.index] = ev
                    yield chunk(ev.index, None, ev.reason)
            if include_usage:
                yield _sse({**head, "choices": [], "usage": _usage(finishes)})
            yield b"data: [DONE]\n\n"
        finally:  # the client went away (or we are done): stop generating for it
            job.cancelled.set()

    return body()
