"""forge serve: the OpenAI-compatible server on the bundled example, through the real ``openai`` client.

Each server runs in-process on a free loopback port (uvicorn in a background thread); expected answers
come from ``runtime.generate`` on a separately loaded copy of the model, encoded as ``forge run`` does.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import uvicorn  # noqa: E402

from forge.errors import ForgeError  # noqa: E402
from forge.imatrix.formats import read_imatrix  # noqa: E402
from forge.imatrix.live import LiveImatrix  # noqa: E402
from runtime.generate import Sampling, generate  # noqa: E402
from runtime.models import load_model  # noqa: E402
from runtime.server import Engine, StopText, create_app, load_engine  # noqa: E402
from runtime.tokenizer import Tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NAME = "tiny"
BODY_LIMIT = 1 << 20


class ServerThread:
    """uvicorn serving ``create_app(engine)`` on 127.0.0.1 with an OS-chosen port."""

    def __init__(self, engine: Engine, **app_kwargs: object) -> None:
        config = uvicorn.Config(
            create_app(engine, **app_kwargs), host="127.0.0.1", port=0, log_level="warning"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=120)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def reference(example_bf16: Path) -> tuple[object, Tokenizer]:
    m = load_model(example_bf16)
    return m, Tokenizer.from_metadata(m.weights)


@pytest.fixture(scope="module")
def server(example_bf16: Path) -> Iterator[ServerThread]:
    s = ServerThread(load_engine(example_bf16, name=NAME), max_body_bytes=BODY_LIMIT)
    yield s
    s.stop()


def expect_chat(reference, content: str, max_tokens: int, sampling: Sampling = Sampling()):
    m, tok = reference
    text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    ids = tok.encode(text, parse_special=True)
    return generate(m, ids, max_tokens, sampling, tok), len(ids)


def expect_text(reference, prompt: str, max_tokens: int):
    m, tok = reference
    ids = tok.encode(prompt, parse_special=True)
    return generate(m, ids, max_tokens, Sampling(), tok), ids


# ------------------------------------------------------------------------------------------ happy path


def test_models_and_health(server: ServerThread) -> None:
    assert [m.id for m in server.client().models.list().data] == [NAME]
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["model"] == NAME


def test_chat_greedy_equals_generate(server: ServerThread, reference) -> None:
    want, n_prompt = expect_chat(reference, "Hello there, how are you today?", 8)
    r = server.client().chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Hello there, how are you today?"}],
        max_tokens=8, temperature=0,
    )  # fmt: skip
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == ("length" if want.stopped_by == "max-tokens" else "stop")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, len(want.tokens))
    assert r.usage.total_tokens == n_prompt + len(want.tokens)


def test_streaming_chat_equals_generate(server: ServerThread, reference) -> None:
    want, n_prompt = expect_chat(reference, "Write a short poem about the sea.", 10)
    stream = server.client().chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Write a short poem about the sea."}],
        max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len([p for p in content if p]) > 1  # really streamed, not one blob
    assert "".join(content) == want.text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == ["length"]
    assert chunks[-1].usage.completion_tokens == len(want.tokens) == 10
    assert chunks[-1].usage.prompt_tokens == n_prompt


def test_completions_text_tokens_and_stream(server: ServerThread, reference) -> None:
    prompt = "The quick brown fox jumps over the lazy dog because"
    want, ids = expect_text(reference, prompt, 8)
    client = server.client()
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].text == want.text
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 8)
    by_ids = client.completions.create(model=NAME, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == want.text
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=NAME, prompt=prompt, max_tokens=8, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == want.text


def test_completions_several_prompts(server: ServerThread, reference) -> None:
    prompts = ["Once upon a time", "import numpy as np\n"]
    r = server.client().completions.create(model=NAME, prompt=prompts, max_tokens=5, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [expect_text(reference, p, 5)[0].text for p in prompts]


def test_stop_strings_end_the_answer(server: ServerThread, reference) -> None:
    prompt = "In the beginning there was a small village by the river"
    want, _ = expect_text(reference, prompt, 12)
    assert len(want.text) >= 8
    stop = want.text[len(want.text) // 2 : len(want.text) // 2 + 3]
    cut = want.text[: want.text.find(stop)]
    client = server.client()
    r = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=12, temperature=0, stop=[stop, "@@@@"]
    )
    assert r.choices[0].text == cut
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 12  # generation really ended early
    chunks = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, stop=stop,
                                       stream=True)  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == cut


def test_stop_text_holds_back_partial_matches() -> None:
    s = StopText(["cd", "xyz"])
    assert s.feed("ab") == ("ab", False)
    assert s.feed("c") == ("", False)  # could start "cd"
    assert s.feed("e") == ("ce", False)  # it did not
    assert s.feed("xy") == ("", False)
    assert s.feed("c") == ("xy", False)  # "xyc" breaks "xyz", but "c" may still start "cd"
    assert s.feed("d!") == ("", True)
    t = StopText(["END"])
    assert t.feed("the EN") == ("the ", False)
    assert t.flush() == "EN"


def test_sampling_parameters_reach_the_sampler(server: ServerThread, reference) -> None:
    sampling = Sampling(temperature=1.3, top_k=0, top_p=0.9, seed=1234)
    want, _ = expect_chat(reference, "Tell me a story.", 10, sampling)
    greedy, _ = expect_chat(reference, "Tell me a story.", 10)
    assert want.text != greedy.text  # otherwise this test could not tell the parameters were used
    client = server.client()
    for _ in range(2):
        r = client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "Tell me a story."}],
            max_tokens=10, temperature=1.3, top_p=0.9, seed=1234,
        )  # fmt: skip
        assert r.choices[0].message.content == want.text


def test_eight_concurrent_clients(server: ServerThread, reference) -> None:
    prompts = [f"Client {i} asks: what is {i} times {i + 3}? The answer is" for i in range(8)]
    wants = [expect_chat(reference, p, 6)[0].text for p in prompts]
    assert len(set(wants)) > 1
    got: dict[int, str] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def ask(i: int) -> None:
        try:
            client = server.client()
            barrier.wait()
            messages = [{"role": "user", "content": prompts[i]}]
            if i % 2:  # half stream, so SSE responses interleave with plain ones
                chunks = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6,
                                                        temperature=0, stream=True)  # fmt: skip
                got[i] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            else:
                r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0)
                got[i] = r.choices[0].message.content
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert [got[i] for i in range(8)] == wants


def test_disconnected_stream_is_abandoned(server: ServerThread) -> None:
    before = httpx.get(server.url + "/health").json()["served"]
    body = {
        "model": NAME,
        "prompt": "A very long story:",
        "max_tokens": 4000,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    t0 = time.monotonic()
    while httpx.get(server.url + "/health").json()["served"] == before:
        assert time.monotonic() - t0 < 20, "the abandoned request kept generating"
        time.sleep(0.05)
    r2 = server.client().completions.create(model=NAME, prompt="Hi", max_tokens=2, temperature=0)
    assert r2.usage.completion_tokens == 2


# ------------------------------------------------------------------------------------------ bad input


def _bad_requests(ctx: int) -> list[tuple[str, str, bytes]]:
    chat, comp = "/v1/chat/completions", "/v1/completions"
    ok_msgs = [{"role": "user", "content": "hi"}]

    def c(**kw: object) -> bytes:
        return json.dumps({"model": NAME, "messages": ok_msgs, **kw}).encode()

    def p(**kw: object) -> bytes:
        return json.dumps({"model": NAME, "prompt": "hi", **kw}).encode()

    return [
        ("POST", chat, b"{bad json"),
        ("POST", chat, b""),
        ("POST", chat, b"null"),
        ("POST", chat, b"[1, 2]"),
        ("POST", chat, b"\xff\xfe\x00garbage"),
        (
            "POST",
            chat,
            b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
        ),
        ("POST", chat, json.dumps({"messages": ok_msgs}).encode()),  # no model
        ("POST", chat, json.dumps({"model": NAME}).encode()),  # no messages
        ("POST", chat, c(model="gpt-4o")),
        ("POST", chat, c(model=7)),
        ("POST", chat, c(messages=[])),
        ("POST", chat, c(messages="hi")),
        ("POST", chat, c(messages=[{"role": "wizard", "content": "x"}])),
        ("POST", chat, c(messages=[{"role": "user", "content": 5}])),
        ("POST", chat, c(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])),
        ("POST", chat, c(max_tokens=0)),
        ("POST", chat, c(max_tokens=-5)),
        ("POST", chat, c(max_tokens="5")),
        ("POST", chat, c(max_tokens=1.5)),
        ("POST", chat, c(max_tokens=True)),
        ("POST", chat, c(max_completion_tokens=0)),
        ("POST", chat, c(temperature=-1)),
        ("POST", chat, c(temperature="hot")),
        ("POST", chat, c(temperature=5)),
        ("POST", chat, c(top_p=0)),
        ("POST", chat, c(top_p=1.5)),
        ("POST", chat, c(seed="x")),
        ("POST", chat, c(seed=1 << 70)),
        ("POST", chat, c(stop=5)),
        ("POST", chat, c(stop=[""])),
        ("POST", chat, c(stop=["a"] * 40)),
        ("POST", chat, c(stream="yes")),
        ("POST", chat, c(stream=True, max_tokens=-1)),
        ("POST", chat, c(stream_options={"include_usage": "yes"})),
        ("POST", chat, c(n=2)),
        ("POST", chat, c(logprobs=True)),
        ("POST", chat, c(presence_penalty=0.5)),
        ("POST", chat, c(tools=[{"type": "function", "function": {"name": "f"}}])),
        ("POST", chat, c(messages=[{"role": "user", "content": "word " * 100_000}])),  # huge prompt
        ("POST", comp, p(prompt="word " * 100_000)),
        ("POST", comp, p(prompt=[1] * ctx)),  # exactly the context: no room for a reply
        ("POST", comp, p(prompt=" a" * ctx)),  # too many tokens, but few enough characters to tokenize
        ("POST", comp, p(prompt=[5000])),
        ("POST", comp, p(prompt=[-1])),
        ("POST", comp, p(prompt=[])),
        ("POST", comp, p(prompt="")),
        ("POST", comp, p(prompt=[[1, 2], []])),
        ("POST", comp, p(prompt=None)),
        ("POST", comp, p(prompt=["a", 1])),
        ("POST", comp, p(echo=True)),
        ("POST", comp, p(best_of=3)),
        ("POST", comp, b"x" * (BODY_LIMIT + 1)),
        ("GET", "/v1/nope", b""),
        ("POST", "/v1/embeddings", p()),
        ("GET", chat, b""),
        ("DELETE", "/v1/models", b""),
        ("GET", "/v1/models/other-model", b""),
    ]


def test_fuzz_bad_requests_get_4xx_and_the_server_keeps_serving(server: ServerThread) -> None:
    served = httpx.get(server.url + "/health").json()["served"]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for method, path, body in _bad_requests(4096):
            r = http.request(method, path, content=body, headers={"content-type": "application/json"})
            case = f"{method} {path} {body[:120]!r}"
            assert 400 <= r.status_code < 500, (case, r.status_code, r.text[:300])
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, case
            assert isinstance(err["message"], str) and err["message"], case
    assert httpx.get(server.url + "/health").json()["served"] == served  # none reached the model
    r = server.client().chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "still there?"}], max_tokens=3, temperature=0
    )
    assert r.usage.completion_tokens == 3


def test_specific_error_statuses(server: ServerThread) -> None:
    client = server.client()
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt=[1] * 4096, max_tokens=1)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="x", max_tokens=0)
    assert e.value.param == "max_tokens"


def test_demo_round_trip(example_bf16: Path, tmp_path: Path, reference) -> None:
    from runtime.serve_cli import demo_round_trip

    res = demo_round_trip(example_bf16, tmp_path / "demo.gguf", max_tokens=6)
    assert res.reply == expect_chat(reference, "Name three uses of a quantized model.", 6)[0].text
    assert res.streamed_chunks >= 3 and res.imatrix_requests == 2
    assert read_imatrix(tmp_path / "demo.gguf").chunk_count == 2  # written when the server stopped


def test_missing_extra_gives_a_one_line_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.serve_cli import require_serve_deps

    monkeypatch.setitem(sys.modules, "uvicorn", None)
    with pytest.raises(ForgeError, match=r"pip install 'gguf-forge\[serve\]'"):
        require_serve_deps()


# ------------------------------------------------------------------------------------------ live imatrix


PRIVATE = [
    f"Secret note {i}: the purple xylophone sings at midnight near harbour number {i}" for i in range(7)
]


def wait_imatrix(url: str, requests: int | None = None, snapshots: int | None = None) -> None:
    deadline = time.monotonic() + 30
    while True:
        state = httpx.get(url + "/health").json()["imatrix"]
        if state["requests"] >= (requests or 0) and state["snapshots"] >= (snapshots or 0):
            return
        assert time.monotonic() < deadline, state
        time.sleep(0.02)


def _windows(text: str, width: int = 8) -> set[bytes]:
    data = text.encode()
    return {data[i : i + width] for i in range(len(data) - width + 1)}


def test_live_imatrix_snapshots_grow_hold_no_text_and_close_on_shutdown(
    example_bf16: Path, tmp_path: Path
) -> None:
    out = tmp_path / "live.gguf"
    live = LiveImatrix(out, every=2, min_requests=4)
    s = ServerThread(load_engine(example_bf16, name=NAME, imatrix=live), api_key="sesame")
    try:
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").models.list()
        client = s.client("sesame")
        prompt_tokens = []

        def ask(i: int) -> None:
            r = client.chat.completions.create(
                model=NAME, messages=[{"role": "user", "content": PRIVATE[i]}], max_tokens=3, temperature=0
            )
            prompt_tokens.append(r.usage.prompt_tokens)

        for i in range(3):
            ask(i)
        wait_imatrix(s.url, requests=3)
        assert not out.exists()  # fewer than min_requests
        ask(3)
        wait_imatrix(s.url, snapshots=1)  # the answer comes first, the snapshot is written after it
        first = read_imatrix(out)
        assert first.chunk_count == 4 and first.datasets == ["live"]
        dense, routed = "blk.0.attn_q.weight", "blk.0.ffn_gate_exps.weight"
        assert min(prompt_tokens) >= 16  # dense tensors skip batches of fewer rows (llama-imatrix's rule)
        # prefill only: every prompt token once, no generated token
        assert int(first.counts[dense].sum()) == sum(prompt_tokens)
        assert int(first.counts[routed].sum()) == sum(prompt_tokens) * 4  # 4 experts per token
        ask(4)
        ask(5)
        wait_imatrix(s.url, snapshots=2)
        second = read_imatrix(out)
        assert second.chunk_count == 6
        assert int(second.counts[dense].sum()) == sum(prompt_tokens)
        assert (second.counts[routed] >= first.counts[routed]).all()
        assert (second.sums[dense] >= first.sums[dense]).all() and (
            second.sums[dense] > first.sums[dense]
        ).any()
        ask(6)  # not a snapshot point (every 2) ...
        wait_imatrix(s.url, requests=7)
        assert read_imatrix(out).chunk_count == 6
    finally:
        s.stop()
    final = read_imatrix(out)  # ... but shutdown writes the final one
    assert final.chunk_count == 7 and int(final.counts[dense].sum()) == sum(prompt_tokens)
    data = out.read_bytes()
    for text in PRIVATE:
        assert not any(w in data for w in _windows(text)), text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["live.gguf"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class CliServer:
    """``forge serve``'s own code (``python -c CODE`` or ``-m runtime.serve_cli``) as a child process."""

    def __init__(self, args: list[str], code: str | None = None) -> None:
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        head = ["-c", code] if code else ["-m", "runtime.serve_cli"]
        cmd = [sys.executable, *head, *args, "--port", str(port), "--threads", "1", "--model-name", NAME,
               "--log-level", "warning"]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, self.proc.stdout.read().decode()
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=60)

    def ask(self, i: int) -> None:
        self.client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": PRIVATE[i]}], max_tokens=2, temperature=0
        )

    def end(self, sig: int) -> int:
        self.proc.send_signal(sig)
        rc = self.proc.wait(60)
        self.proc.stdout.close()
        return rc


@pytest.mark.slow
def test_sigterm_writes_the_final_snapshot(example_bf16: Path, tmp_path: Path) -> None:
    out = tmp_path / "live.dat"
    server = CliServer([str(example_bf16), "--imatrix-out", str(out), "--imatrix-every", "0",
                        "--imatrix-min-requests", "2"])  # fmt: skip
    try:
        for i in range(3):
            server.ask(i)
        wait_imatrix(server.url, requests=3)
        assert not out.exists()  # every 0: only at shutdown
    finally:
        server.end(signal.SIGTERM)
    im = read_imatrix(out)  # the legacy .dat format, chosen by the suffix
    assert im.chunk_count == 3 and im.names()
    assert not any(w in out.read_bytes() for text in PRIVATE[:3] for w in _windows(text))


# The child runs `forge serve`'s own code with os.fsync slowed down once ARM exists, so that SIGKILL
# lands while a snapshot is being written (data written, not yet renamed).
_CHILD = """
import os, sys, time, runpy
real_fsync, arm = os.fsync, sys.argv.pop(1)
def fsync(fd):
    if os.path.exists(arm):
        open(arm + ".in-write", "w").close()
        time.sleep(120)
    real_fsync(fd)
os.fsync = fsync
runpy.run_module("runtime.serve_cli", run_name="__main__")
"""


@pytest.mark.slow
def test_sigkill_during_a_snapshot_keeps_the_previous_one(example_bf16: Path, tmp_path: Path) -> None:
    out, arm = tmp_path / "live.gguf", tmp_path / "arm"
    args = [str(arm), str(example_bf16), "--imatrix-out", str(out), "--imatrix-every", "1",
            "--imatrix-min-requests", "1"]  # fmt: skip
    server = CliServer(args, _CHILD)
    try:
        server.ask(0)
        wait_imatrix(server.url, snapshots=1)
        before = out.read_bytes()
        arm.touch()
        server.ask(1)  # answered; the worker then hangs inside the second snapshot's fsync
        deadline = time.monotonic() + 30
        while not (tmp_path / "arm.in-write").exists():
            assert time.monotonic() < deadline, "the second snapshot never started"
            time.sleep(0.05)
    finally:
        server.end(signal.SIGKILL)
    assert out.read_bytes() == before
    assert read_imatrix(out).chunk_count == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["arm", "arm.in-write", "live.gguf"]  # no temp file
