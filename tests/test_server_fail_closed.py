"""forge serve fails closed (issue 16): bad request content gets a 4xx with OpenAI's error body and no
traceback; a client that hangs up stops its generation; bad options, addresses and imatrix folders are one
``error:`` line before the model is loaded; a final imatrix snapshot that cannot be written is one
``error:`` line and a non-zero exit, not "Application shutdown failed".

In-process servers as in test_server.py; the CLI through ``python -m forge serve`` in a subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import torch  # noqa: E402
from test_server import NAME, ROOT, CliServer, ServerThread, wait_imatrix  # noqa: E402

from forge.imatrix.live import LiveImatrix  # noqa: E402
from runtime.serve_cli import LOG_LEVELS  # noqa: E402
from runtime.server import Engine, load_engine  # noqa: E402

CHAT, COMP = "/v1/chat/completions", "/v1/completions"
LONG = 4000  # max_tokens of a request that would run for many seconds (the context is 4096)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engine(example_bf16: Path) -> Engine:
    return load_engine(example_bf16, name=NAME)


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[ServerThread]:
    s = ServerThread(engine)
    yield s
    s.stop()


def health(server: ServerThread) -> dict:
    return httpx.get(server.url + "/health", timeout=30).json()


def wait_for(server: ServerThread, what: str, test, seconds: float = 60) -> dict:
    """Poll /health until ``test(health)`` holds (a generous limit: only a hang should reach it)."""
    deadline = time.monotonic() + seconds
    while not test(h := health(server)):
        assert time.monotonic() < deadline, f"{what}: {h}"
        time.sleep(0.02)
    return h


def chat(**kw: object) -> bytes:
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}
    return json.dumps(body).encode()


def comp(**kw: object) -> bytes:
    return json.dumps({"model": NAME, "prompt": "hi", "max_tokens": 2, **kw}).encode()


def post(server: ServerThread, path: str, body: bytes) -> httpx.Response:
    return httpx.post(
        server.url + path, content=body, headers={"content-type": "application/json"}, timeout=60
    )


def assert_openai_error(r: httpx.Response, status: int | tuple[int, ...] = 400) -> dict:
    statuses = (status,) if isinstance(status, int) else status
    assert r.status_code in statuses, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    return err


def no_traceback(capfd: pytest.CaptureFixture[str]) -> None:
    out, err = capfd.readouterr()
    logs = out + err
    assert "Traceback" not in logs and "Exception in ASGI application" not in logs, logs[-3000:]


# ------------------------------------------------------------------------------------- unencodable text

SURROGATE = "\ud800"

UNENCODABLE = {
    "chat content": (
        CHAT,
        chat(messages=[{"role": "user", "content": "a" + SURROGATE}]),
        "messages[0].content",
    ),
    "chat content part": (
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": "\udfff b"}]}]),
        "messages[0].content[0].text",
    ),
    "second message": (
        CHAT,
        chat(messages=[{"role": "system", "content": "ok"}, {"role": "user", "content": SURROGATE}]),
        "messages[1].content",
    ),
    "prompt": (COMP, comp(prompt="x" + SURROGATE), "prompt"),
    "prompt list": (COMP, comp(prompt=["fine", SURROGATE]), "prompt[1]"),
    "model": (CHAT, chat(model=SURROGATE), "model"),
    "stop": (COMP, comp(stop=["ok", SURROGATE]), "stop[1]"),
    "unknown field": (CHAT, chat(user=SURROGATE), "user"),
    "a key": (CHAT, chat(**{SURROGATE: 1}), None),
    "streaming": (
        CHAT,
        chat(stream=True, messages=[{"role": "user", "content": SURROGATE}]),
        "messages[0].content",
    ),
    # the surrogate's UTF-8-style bytes (ED A0 80), which Python's JSON decoder lets through as well
    "raw bytes": (
        COMP,
        b'{"model": "tiny", "prompt": "a\xed\xa0\x80", "max_tokens": 2}',
        "prompt",
    ),
}


@pytest.mark.parametrize("case", list(UNENCODABLE))
def test_unencodable_text_is_a_400_without_traceback(
    server: ServerThread, capfd: pytest.CaptureFixture[str], case: str
) -> None:
    path, body, param = UNENCODABLE[case]
    served = health(server)["served"]
    err = assert_openai_error(post(server, path, body))
    assert err["code"] == "invalid_unicode" and err["param"] == param
    assert "not valid Unicode" in err["message"] and "U+D" in err["message"]
    assert health(server)["served"] == served  # refused before it reached the model
    no_traceback(capfd)


# ------------------------------------------------------------------------------ other bad request content

BAD_CONTENT = {
    "temperature 1e400 (inf)": (
        CHAT,
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": 1e400}',
    ),  # fmt: skip
    "temperature -1e400": (
        CHAT,
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": -1e400}',
    ),  # fmt: skip
    "temperature NaN": (
        CHAT,
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
    ),  # fmt: skip
    "temperature huge": (CHAT, chat(temperature=1e300)),
    "temperature negative": (CHAT, chat(temperature=-0.5)),
    "top_p 1e400": (
        CHAT,
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_p": 1e400}',
    ),
    "top_p above 1": (CHAT, chat(top_p=1.01)),
    "top_p 0": (CHAT, chat(top_p=0)),
    "top_k negative": (CHAT, chat(top_k=-1)),
    "max_tokens 1e400": (
        CHAT,
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1e400}',
    ),  # fmt: skip
    "max_tokens 0": (COMP, comp(max_tokens=0)),
    "max_tokens negative": (COMP, comp(max_tokens=-3)),
    "max_tokens string": (COMP, comp(max_tokens="8")),
    "max_completion_tokens negative": (CHAT, chat(max_completion_tokens=-1)),
    "seed too large": (CHAT, chat(seed=1 << 64)),
    "seed float": (CHAT, chat(seed=1.5)),
    "n 2": (CHAT, chat(n=2)),
    "n 0": (CHAT, chat(n=0)),
    "n string": (CHAT, chat(n="1")),
    "stop not strings": (CHAT, chat(stop=[1, 2])),
    "stop object": (CHAT, chat(stop={"a": 1})),
    "stop empty string": (CHAT, chat(stop="")),
    "too many stops": (CHAT, chat(stop=[str(i) for i in range(17)])),
    "no messages": (CHAT, chat(messages=[])),
    "message not an object": (CHAT, chat(messages=["hi"])),
    "message without role": (CHAT, chat(messages=[{"content": "hi"}])),
    "content a number": (CHAT, chat(messages=[{"role": "user", "content": 3.5}])),
    "content an object": (CHAT, chat(messages=[{"role": "user", "content": {"text": "hi"}}])),
    "content part without text": (CHAT, chat(messages=[{"role": "user", "content": [{"type": "text"}]}])),
    "content part image": (
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
    ),
    "prompt a number": (COMP, comp(prompt=3)),
    "prompt mixed list": (COMP, comp(prompt=["a", 1])),
    "prompt nested strings": (COMP, comp(prompt=[["a"]])),
    "prompt bool ids": (COMP, comp(prompt=[True, False])),
    "prompt id out of vocabulary": (COMP, comp(prompt=[1 << 70])),
    "prompt empty string": (COMP, comp(prompt="")),
    "stream a string": (COMP, comp(stream="true")),
    "stream_options a list": (CHAT, chat(stream=True, stream_options=[1])),
    "deeply nested": (CHAT, b'{"model": "tiny", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
}


def test_bad_request_content_gets_4xx_without_traceback(
    server: ServerThread, capfd: pytest.CaptureFixture[str]
) -> None:
    served = health(server)["served"]
    for case, (path, body) in BAD_CONTENT.items():
        r = post(server, path, body)
        assert 400 <= r.status_code < 500, (case, r.status_code, r.text[:300])
        assert_openai_error(r, r.status_code)
    assert health(server)["served"] == served
    no_traceback(capfd)
    r = post(server, CHAT, chat())  # and it still serves
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    "params",
    [{"temperature": 1e-300}, {"temperature": 1e-40, "top_p": 0.5}, {"temperature": 1, "top_p": 5e-324}],
)
def test_tiny_sampling_values_act_as_their_limits(
    server: ServerThread, capfd: pytest.CaptureFixture[str], params: dict
) -> None:
    """Valid values that float32 sampling cannot take (they used to be a 500): their limit, greedy."""
    greedy = post(server, COMP, comp(prompt="Once upon a time", max_tokens=4, temperature=0))
    r = post(server, COMP, comp(prompt="Once upon a time", max_tokens=4, seed=3, **params))
    assert r.status_code == 200, r.text[:300]
    assert r.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    no_traceback(capfd)


def test_the_traceback_check_would_see_one(
    server: ServerThread, engine: Engine, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control for ``no_traceback``: a real internal error is a 500 and its traceback is captured."""

    def broken(text: str, param: str = "prompt") -> list[int]:
        raise RuntimeError("deliberate")

    monkeypatch.setattr(engine, "encode_text", broken)
    assert_openai_error(post(server, COMP, comp()), 500)
    with pytest.raises(AssertionError, match="Traceback"):
        no_traceback(capfd)


# ---------------------------------------------------------------------------------- clients that leave


def _raw_request(server: ServerThread, path: str, body: dict) -> socket.socket:
    """Send a request over a bare socket (so the test decides when the connection closes)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    sock.sendall(head.encode() + data)
    return sock


def test_a_dropped_non_streaming_request_is_cancelled(
    server: ServerThread, capfd: pytest.CaptureFixture[str]
) -> None:
    """Two long non-streaming requests whose clients hang up: the running one stops early, the queued one
    is dropped, and the next client is answered at once."""
    before = wait_for(server, "idle", lambda h: h["queued"] == 0)
    long = {"model": NAME, "prompt": "A very long story:", "max_tokens": LONG, "temperature": 0}
    first = _raw_request(server, COMP, long)
    wait_for(
        server, "the first request generates", lambda h: h["generated_tokens"] > before["generated_tokens"]
    )
    messages = [{"role": "user", "content": "Tell a long tale."}]
    second = _raw_request(server, CHAT, {"model": NAME, "messages": messages, "max_tokens": LONG})
    wait_for(server, "the second request is queued", lambda h: h["queued"] == 1)
    second.close()
    time.sleep(0.5)  # lets its watcher see the hang-up first (usual, not needed for the assertions)
    first.close()
    after = wait_for(server, "both cancelled", lambda h: h["cancelled"] == before["cancelled"] + 2)
    assert after["queued"] == 0
    # the first ran; the second was (almost always) dropped as it left the queue, before it started
    assert before["served"] + 1 <= after["served"] <= before["served"] + 2
    made = after["generated_tokens"] - before["generated_tokens"]
    assert 0 < made < LONG  # neither ran to its max_tokens (either alone would have made LONG tokens)
    r = post(server, COMP, comp(prompt="Hi", max_tokens=2, temperature=0))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert health(server)["generated_tokens"] == after["generated_tokens"] + 2  # nothing else ran meanwhile
    no_traceback(capfd)


def test_a_dropped_stream_is_cancelled(server: ServerThread, capfd: pytest.CaptureFixture[str]) -> None:
    before = wait_for(server, "idle", lambda h: h["queued"] == 0)
    body = {"model": NAME, "messages": [{"role": "user", "content": "Tell a long tale."}], "max_tokens": LONG,
            "temperature": 0, "stream": True}  # fmt: skip
    with httpx.stream("POST", server.url + CHAT, json=body, timeout=60) as r:
        assert r.status_code == 200
        assert next(line for line in r.iter_lines() if line.startswith("data: {"))
    after = wait_for(server, "cancelled", lambda h: h["cancelled"] == before["cancelled"] + 1)
    assert 0 < after["generated_tokens"] - before["generated_tokens"] < LONG
    no_traceback(capfd)


# ----------------------------------------------------------------------------------- the final snapshot


def test_a_final_snapshot_that_cannot_be_written_is_reported_not_raised(
    example_bf16: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "stats"
    folder.mkdir()
    out = folder / "live.gguf"
    engine = load_engine(example_bf16, name=NAME, imatrix=LiveImatrix(out, every=0, min_requests=1))
    s = ServerThread(engine)
    try:
        assert post(s, CHAT, chat()).status_code == 200
        wait_imatrix(s.url, requests=1)
        shutil.rmtree(folder)  # the folder goes away while serving
    finally:
        s.stop()
    assert not s.thread.is_alive()
    assert engine.close_error is not None and engine.close_error.startswith(f"imatrix snapshot: {out}: ")
    assert "does not exist" in engine.close_error
    out_, err = capfd.readouterr()
    assert "Application shutdown failed" not in out_ + err and "Traceback" not in out_ + err, err[-3000:]


def test_a_full_disk_at_the_final_snapshot_is_one_error_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    from forge.errors import ForgeError

    out = tmp_path / "live.gguf"
    live = LiveImatrix(out, every=0, min_requests=1)
    live.on_matmul_input("blk.0.attn_q.weight", torch.randn(32, 8), None)
    live.request_done()

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(ForgeError) as e:
        live.close()
    assert str(e.value).startswith(f"imatrix snapshot: {out}: {os.strerror(errno.ENOSPC)}")
    assert str(e.value).count(str(out)) == 1
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []  # nothing half-written
    assert live.close() and out.exists()  # the data was kept: a later snapshot can still succeed


def test_live_imatrix_refuses_an_unusable_folder_at_once(tmp_path: Path) -> None:
    from forge.errors import ForgeError

    with pytest.raises(ForgeError, match="does not exist"):
        LiveImatrix(tmp_path / "missing" / "live.gguf")
    with pytest.raises(ForgeError, match="folder"):
        LiveImatrix(tmp_path)


# ------------------------------------------------------------------------------------------- the CLI


def forge_serve(*args: object, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("FORGE_API_KEY", None)
    return subprocess.run([sys.executable, "-m", "forge", "serve", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)  # fmt: skip


def assert_one_error(res: subprocess.CompletedProcess[str], *needles: str) -> str:
    shown = f"exit {res.returncode}\nstdout: {res.stdout[-2000:]}\nstderr: {res.stderr[-3000:]}"
    assert res.returncode not in (0, None), shown
    assert "Traceback" not in res.stdout + res.stderr, shown
    assert "serving" not in res.stderr, shown  # it never announced itself
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, shown
    for needle in needles:
        assert needle in errors[0], shown
    return errors[0]


def _listening_port() -> tuple[socket.socket, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock, sock.getsockname()[1]


# The model is a path that does not exist: each error below must come from its own check, which therefore
# runs before the model is opened (a load would say the file is missing instead).
BAD_OPTIONS = {
    "--log-level banana": (["--log-level", "banana"], ["--log-level", "banana"]),
    "--port 70000": (["--port", "70000"], ["--port", "70000"]),
    "--port -1": (["--port", "-1"], ["--port"]),
    "--ctx 1": (["--ctx", "1"], ["--ctx"]),
    "--ctx -3": (["--ctx", "-3"], ["--ctx"]),
    "--max-queue 0": (["--max-queue", "0"], ["--max-queue"]),
    "--imatrix-every -1": (["--imatrix-every", "-1"], ["--imatrix-every"]),
    "--imatrix-min-requests -1": (["--imatrix-min-requests", "-1"], ["--imatrix-min-requests"]),
    "--threads 0": (["--threads", "0"], ["--threads"]),
    "--expert-cache-mib -5": (["--expert-cache-mib", "-5"], ["--expert-cache-mib"]),
    "--api-key empty": (["--api-key="], ["--api-key"]),
    "--model-name empty": (["--model-name", " "], ["--model-name"]),
    "--host 0.0.0.0 without a key": (["--host", "0.0.0.0"], ["0.0.0.0", "--api-key"]),
    "--host :: without a key": (["--host", "::"], ["::", "--api-key"]),
    "--host 999.1.1.1": (["--host", "999.1.1.1", "--api-key", "k", "--port", "8123"], ["999.1.1.1:8123"]),
    "--host 192.0.2.1 (not this machine's)": (
        ["--host", "192.0.2.1", "--api-key", "k", "--port", "8123"],
        ["192.0.2.1:8123", "assign"],
    ),
    "--imatrix-out in a missing folder": (["--imatrix-out", "{tmp}/nowhere/live.gguf"], ["nowhere"]),
    "--imatrix-out a folder": (["--imatrix-out", "{tmp}"], ["folder"]),
}


@pytest.mark.parametrize("case", list(BAD_OPTIONS))
def test_bad_options_fail_before_loading(tmp_path: Path, case: str) -> None:
    args, needles = BAD_OPTIONS[case]
    res = forge_serve(tmp_path / "missing.gguf", *(a.format(tmp=tmp_path) for a in args))
    line = assert_one_error(res, *needles)
    assert "missing.gguf" not in line
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written


def test_a_port_in_use_fails_before_loading(tmp_path: Path) -> None:
    sock, port = _listening_port()
    with sock:
        res = forge_serve(tmp_path / "missing.gguf", "--port", port)
    assert_one_error(res, f"127.0.0.1:{port}", "in use")


def test_a_read_only_imatrix_folder_fails_before_loading(tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        if os.access(folder, os.W_OK):  # root ignores permission bits: use a read-only mount if there is one
            folder = Path("/proc/sys")
            if os.access(folder, os.W_OK):
                pytest.skip("no read-only folder can be made here")
        res = forge_serve(tmp_path / "missing.gguf", "--imatrix-out", folder / "live.gguf")
    finally:
        (tmp_path / "ro").chmod(0o755)
    assert_one_error(res, str(folder / "live.gguf"))
    assert not (folder / "live.gguf").exists()


def test_ctx_above_the_models_is_refused_before_serving(example_bf16: Path) -> None:
    assert_one_error(forge_serve(example_bf16, "--ctx", "100000"), "--ctx", "4096")


def test_uvicorn_knows_every_log_level() -> None:
    from uvicorn.config import LOG_LEVELS as UVICORN_LEVELS

    assert set(LOG_LEVELS) == set(UVICORN_LEVELS)


@pytest.mark.slow
def test_cli_final_snapshot_failure_is_one_error_line(example_bf16: Path, tmp_path: Path) -> None:
    folder = tmp_path / "stats"
    folder.mkdir()
    out = folder / "live.gguf"
    server = CliServer([str(example_bf16), "--imatrix-out", str(out), "--imatrix-every", "0",
                        "--imatrix-min-requests", "1"])  # fmt: skip
    try:
        server.ask(0)
        wait_imatrix(server.url, requests=1)
        shutil.rmtree(folder)
    finally:
        server.proc.send_signal(signal.SIGTERM)
        output = server.proc.communicate(timeout=120)[0].decode()
    assert server.proc.returncode not in (0, None), output
    assert "Traceback" not in output and "Application shutdown failed" not in output, output
    errors = [ln for ln in output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: imatrix snapshot: {out}: "), output


@pytest.mark.slow
def test_cli_serves_on_loopback_without_a_key_and_off_loopback_with_one(example_bf16: Path) -> None:
    for extra in ([], ["--host", "0.0.0.0", "--api-key", "sesame"]):
        server = CliServer([str(example_bf16), *extra])
        try:
            key = "sesame" if extra else "x"
            r = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)
            assert r.status_code == 200 and r.json()["data"][0]["id"] == NAME
        finally:
            server.proc.send_signal(signal.SIGTERM)
            server.proc.communicate(timeout=120)
