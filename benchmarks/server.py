"""``forge serve`` throughput and latency, and the prefill cost of live imatrix collection.

    python benchmarks/server.py [GGUF] [--requests 48] [--max-tokens 16] [--threads 1] [--json OUT]

Without a file it converts the bundled examples/tiny-qwen3moe to bf16. The server runs as its own
process (``python -m runtime.serve_cli``, as ``forge serve`` would) on a free loopback port; client
threads send short chat requests (greedy, ``--max-tokens`` tokens) over HTTP and time each one.

1. requests/s and p50/p95 latency at 1 and 8 concurrent clients, live imatrix off and on;
2. prefill time of the model alone (in this process), without observers and with the live imatrix
   observer collecting, for a few prompt lengths: the overhead the collection adds to a prefill;
3. decode time per token with the observer registered but its gate closed (what serving pays
   outside prefills).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from forge.imatrix.live import LiveImatrix  # noqa: E402
from runtime.models import load_model  # noqa: E402
from runtime.server import PrefillGate  # noqa: E402

NAME = "bench"
PROMPTS = [
    f"Question {i}: in two sentences, why does the {w} matter for a small town economy?"
    for i, w in enumerate(["river", "railway", "market", "school", "harbour", "bridge", "library", "mill"])
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: Path, threads: int, imatrix: Path | None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "runtime.serve_cli", str(model), "--port", str(self.port),
               "--threads", str(threads), "--model-name", NAME, "--log-level", "warning"]  # fmt: skip
        if imatrix is not None:
            cmd += ["--imatrix-out", str(imatrix)]  # defaults: every 64 after 8, as ds4
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the server did not start")
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(120)


def load_test(url: str, clients: int, requests: int, max_tokens: int) -> dict:
    latencies: list[float] = []
    tokens: list[int] = []
    lock = threading.Lock()
    barrier = threading.Barrier(clients)

    def client(c: int) -> None:
        with httpx.Client(base_url=url, timeout=600) as http:
            barrier.wait()
            for i in range(c, requests, clients):
                body = {"model": NAME, "max_tokens": max_tokens, "temperature": 0,
                        "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]}  # fmt: skip
                t = time.perf_counter()
                r = http.post("/v1/chat/completions", json=body)
                dt = time.perf_counter() - t
                r.raise_for_status()
                with lock:
                    latencies.append(dt)
                    tokens.append(r.json()["usage"]["completion_tokens"])

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    q = statistics.quantiles(latencies, n=20)
    return {"clients": clients, "requests": len(latencies), "req_s": round(len(latencies) / wall, 2),
            "p50_ms": round(statistics.median(latencies) * 1e3, 1), "p95_ms": round(q[18] * 1e3, 1),
            "gen_tok_s": round(sum(tokens) / wall, 1)}  # fmt: skip


def prefill_overhead(model_path: Path, lengths: list[int], reps: int, out_dir: Path) -> list[dict]:
    plain = load_model(model_path)
    live = LiveImatrix(out_dir / "overhead.gguf", every=0)
    gate = PrefillGate(live)
    gate.open = True
    observed = load_model(model_path, observers=[gate])
    rows = []
    g = torch.Generator().manual_seed(0)
    for n in lengths:
        ids = torch.randint(0, plain.vocab_size, (n,), generator=g)

        def best(model, ids: torch.Tensor = ids) -> float:
            model.forward(ids, model.new_state(), last_only=True)  # warm-up
            times = []
            for _ in range(reps):
                st = model.new_state()
                t = time.perf_counter()
                model.forward(ids, st, last_only=True)
                times.append(time.perf_counter() - t)
            return statistics.median(times)

        # interleave the two so that load from other processes hits both alike
        off, on = [], []
        for _ in range(3):
            off.append(best(plain))
            on.append(best(observed))
        t_off, t_on = min(off), min(on)
        rows.append({"prompt_tokens": n, "off_ms": round(t_off * 1e3, 2), "on_ms": round(t_on * 1e3, 2),
                     "overhead_pct": round((t_on / t_off - 1) * 100, 1)})  # fmt: skip
    return rows


def decode_overhead(model_path: Path, out_dir: Path, steps: int = 64) -> dict:
    """ms per decoded token without observers and with the (closed) prefill gate registered."""
    plain = load_model(model_path)
    observed = load_model(model_path, observers=[PrefillGate(LiveImatrix(out_dir / "d.gguf", every=0))])

    def per_token(model) -> float:
        st = model.new_state()
        model.forward(torch.tensor([1, 2, 3]), st)
        t = time.perf_counter()
        for i in range(steps):
            model.forward(torch.tensor([i + 5]), st, last_only=True)
        return (time.perf_counter() - t) / steps

    off, on = [], []
    for _ in range(5):
        off.append(per_token(plain))
        on.append(per_token(observed))
    t_off, t_on = min(off), min(on)
    return {"off_ms": round(t_off * 1e3, 2), "on_ms": round(t_on * 1e3, 2),
            "overhead_pct": round((t_on / t_off - 1) * 100, 1)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", type=Path)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (server and prefill benchmark)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_dir = Path(tmp)
        model = args.model
        if model is None:
            from forge.convert import convert_checkpoint

            model = tmp_dir / "tiny-qwen3moe-bf16.gguf"
            convert_checkpoint(ROOT / "examples" / "tiny-qwen3moe", model, "bf16")
        serving = []
        for imatrix in (None, tmp_dir / "live.gguf"):
            server = Server(model, args.threads, imatrix)
            try:
                load_test(server.url, 1, 4, args.max_tokens)  # warm-up
                for clients in (1, 8):
                    row = load_test(server.url, clients, args.requests, args.max_tokens)
                    serving.append({"imatrix": imatrix is not None, **row})
            finally:
                server.stop()
        prefill = prefill_overhead(model, [16, 64, 256, 1024], args.reps, tmp_dir)
        decode = decode_overhead(model, tmp_dir)

    print(f"forge serve, {model.name}, {args.threads} torch thread(s), max_tokens {args.max_tokens}, "
          f"{os.cpu_count()} CPUs")  # fmt: skip
    print(
        f"{'imatrix':>8} {'clients':>8} {'requests':>9} {'req/s':>8} {'p50 ms':>9} {'p95 ms':>9} {'gen tok/s':>10}"
    )
    for r in serving:
        print(f"{'on' if r['imatrix'] else 'off':>8} {r['clients']:>8} {r['requests']:>9} {r['req_s']:>8} "
              f"{r['p50_ms']:>9} {r['p95_ms']:>9} {r['gen_tok_s']:>10}")  # fmt: skip
    print("\nprefill with live imatrix collection (model only, median of reps, best of 3 rounds)")
    print(f"{'tokens':>8} {'off ms':>9} {'on ms':>9} {'overhead':>9}")
    for r in prefill:
        print(f"{r['prompt_tokens']:>8} {r['off_ms']:>9} {r['on_ms']:>9} {r['overhead_pct']:>8}%")
    print(f"decode, gate closed (observer registered, collecting nothing): {decode['off_ms']} -> "
          f"{decode['on_ms']} ms/token ({decode['overhead_pct']}%)")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"serving": serving, "prefill": prefill, "decode": decode}, indent=1))


if __name__ == "__main__":
    main()
