"""Scaling of ``forge quantize --executor ray`` on a local Ray cluster (head + worker nodes, loopback).

    python benchmarks/distributed.py [--workers 1,2,4] [--cpus-per-worker 1] [--recipe q4_k_m] [--json]
    python benchmarks/distributed.py --small          # a reduced checkpoint for a 2-core machine
    python benchmarks/distributed.py --workers 1,2,4,8,16 --checkpoint DIR   # a 16-core machine

Writes the ~2 GB random checkpoint of benchmarks/random_checkpoint.py (or ``--small``: ~60 MB),
converts it to a bf16 GGUF (the usual input of a big build), then quantizes it with 1, 2, 4... worker
nodes of ``--cpus-per-worker`` CPUs each; nodes are added to one cluster between runs (their start-up
is not timed). Every output is checked byte for byte against the first. Also measures the fixed
cost of one task (a no-op's round trip, one at a time and in a batch) and a local single-process
build for reference. The machine's load average is printed: on a shared machine times are upper
bounds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from random_checkpoint import write_checkpoint  # noqa: E402

from forge.convert import convert_checkpoint  # noqa: E402
from forge.distributed.local_cluster import LocalCluster  # noqa: E402
from forge.distributed.quantize import RayExecutor  # noqa: E402
from forge.quant.quantize import quantize  # noqa: E402

SMALL = {"layers": 2, "experts": 16, "hidden": 512, "moe_ff": 512, "vocab": 8192}


def sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def task_overhead(address: str, n: int = 200) -> dict[str, float]:
    """Milliseconds per no-op task: submitted one at a time (latency) and all at once (throughput)."""
    import ray

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:

        @ray.remote(num_cpus=1)
        def noop(x: int) -> int:
            return x

        ray.get([noop.remote(i) for i in range(8)])  # warm the workers
        t = time.perf_counter()
        for i in range(n):
            ray.get(noop.remote(i))
        serial = (time.perf_counter() - t) / n
        t = time.perf_counter()
        ray.get([noop.remote(i) for i in range(n)])
        batch = (time.perf_counter() - t) / n
    finally:
        ray.shutdown()
    return {"serial_ms": round(serial * 1e3, 2), "batched_ms": round(batch * 1e3, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="1,2,4", help="worker node counts to measure (ascending)")
    ap.add_argument("--cpus-per-worker", type=int, default=1)
    ap.add_argument("--recipe", default="q4_k_m")
    ap.add_argument(
        "--checkpoint", type=Path, default=None, help="an HF folder to use instead of a random one"
    )
    ap.add_argument("--small", action="store_true", help="a ~60 MB checkpoint instead of ~2 GB")
    ap.add_argument("--source-mode", default="auto", choices=("auto", "read", "ship"))
    ap.add_argument("--part-elements", type=int, default=None, help="most elements per expert-range task")
    ap.add_argument("--no-local", action="store_true", help="skip the local single-process reference")
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temp folder)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    counts = sorted({int(w) for w in a.workers.split(",")})

    work = a.work or Path(tempfile.mkdtemp(prefix="forge-dist-"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt = a.checkpoint
    if ckpt is None:
        ckpt = work / "ckpt"
        if not (ckpt / "config.json").is_file():
            write_checkpoint(ckpt, **(SMALL if a.small else {}))
    src = work / "source-bf16.gguf"
    if not src.is_file():
        convert_checkpoint(ckpt, src, "bf16")
    size = src.stat().st_size
    say = (lambda s: None) if a.json else print
    say(f"source {src} ({size / 1e9:.2f} GB), recipe {a.recipe}, load {os.getloadavg()}")

    result: dict = {"source_bytes": size, "recipe": a.recipe, "cpus_per_worker": a.cpus_per_worker,
                    "load_before": os.getloadavg(), "runs": []}  # fmt: skip
    if not a.no_local:
        t = time.perf_counter()
        quantize(src, work / "local.gguf", a.recipe)
        result["local_seconds"] = round(time.perf_counter() - t, 2)
        say(f"local, one process: {result['local_seconds']:.1f} s")

    want = None
    # each worker node's encoders get as many threads as the node has CPUs (else one node's threads
    # already fill the machine and adding nodes measures nothing)
    node_env = {"FORGE_THREADS": str(a.cpus_per_worker)}
    with LocalCluster(workers=0, cpus_per_worker=a.cpus_per_worker, env=node_env) as cluster:
        result["task_overhead"] = None
        for w in counts:
            while len(cluster.nodes) < w:
                cluster.add_worker()
            if result["task_overhead"] is None:
                result["task_overhead"] = task_overhead(cluster.address)
                say(f"per-task overhead: {result['task_overhead']}")
            out = work / f"ray-{w}.gguf"
            kw = {"part_elements": a.part_elements} if a.part_elements else {}
            ex = RayExecutor(cluster.address, source_mode=a.source_mode, **kw)
            try:
                t = time.perf_counter()
                quantize(src, out, a.recipe, executor=ex)
                seconds = time.perf_counter() - t
                tasks = ex.counters.total
            finally:
                ex.close()
            digest = sha(out)
            want = want or (sha(work / "local.gguf") if not a.no_local else digest)
            run = {"workers": w, "cpus": w * a.cpus_per_worker, "seconds": round(seconds, 2), "tasks": tasks,
                   "source_mb_per_s": round(size / seconds / 1e6, 1), "identical": digest == want,
                   "load": os.getloadavg()}  # fmt: skip
            base = result["runs"][0]["seconds"] if result["runs"] else seconds
            run["speedup"] = round(base / seconds, 2)
            result["runs"].append(run)
            out.unlink()
            say(f"{w} workers x {a.cpus_per_worker} cpu: {seconds:.1f} s, speedup {run['speedup']:.2f}, "
                f"{tasks} tasks, identical {run['identical']}, load {run['load'][0]:.1f}")  # fmt: skip
    if a.json:
        sys.stdout.write(json.dumps(result, indent=1) + "\n")
    if not all(r["identical"] for r in result["runs"]):
        sys.exit("outputs differ between executors")


if __name__ == "__main__":
    main()
