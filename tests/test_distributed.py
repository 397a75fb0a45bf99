"""Quantize and calibrate on Ray: same bytes as the local executor, retries, clear failures.

The cluster tests start a real cluster on loopback (a head without CPUs and two one-CPU worker nodes,
separate processes) once for the module; they are ``slow``: the cluster alone takes ~30-60 s to come
up on a loaded 2-core machine. Split/ship logic, the missing-Ray message and the bad-address
failure run in the default suite without a cluster.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import EXAMPLE

from forge.distributed.cluster import choose_executor
from forge.distributed.slices import Part, read_part, ship_part, split_experts
from forge.errors import ForgeError
from forge.quant.jobs import EncodeJob, open_source, run_job
from forge.quant.quantize import quantize
from forge.quant.source import source_ref

TEXT = EXAMPLE.parent / "tiny-qwen3moe-val-excerpt.txt"
EXPERTS = "blk.0.ffn_down_exps.weight"
BOOST = "blk\\.1\\.ffn_.*_exps=q4_0"


# ----------------------------------------------------------------------------------- without a cluster


@pytest.mark.parametrize("src", ["hf", "gguf"])
def test_expert_ranges_encode_to_the_whole_tensors_bytes(src: str, example_bf16: Path) -> None:
    ref = source_ref(EXAMPLE if src == "hf" else example_bf16)
    source = open_source(ref)
    whole = source.float32(EXPERTS)
    parts = split_experts(whole.shape, max_elements=3 * whole.shape[1] * whole.shape[2])
    assert [(p.lo, p.hi) for p in parts][:2] == [(0, 3), (3, 6)] and parts[-1].hi == whole.shape[0]
    imp = np.random.default_rng(0).random((whole.shape[0], whole.shape[2]), dtype=np.float32) + 0.1
    job = EncodeJob(ref, EXPERTS, "q4_k", imp, whole.shape)
    want = run_job(job).data
    got = []
    for p in parts:
        values = read_part(source, EXPERTS, p)
        np.testing.assert_array_equal(values, whole[p.lo : p.hi])
        np.testing.assert_array_equal(ship_part(source, EXPERTS, p).values(), values)
        got.append(run_job(EncodeJob(ref, EXPERTS, "q4_k", imp[p.lo : p.hi], values.shape), values).data)
    assert np.concatenate(got).tobytes() == want.tobytes()
    assert split_experts((4, 8), 1) == [Part()] and split_experts(whole.shape, 1 << 30) == [Part()]


def test_missing_ray_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real_import = builtins.__import__

    def no_ray(name: str, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(ForgeError, match=r"pip install 'gguf-forge\[distributed\]'"):
        quantize(EXAMPLE, tmp_path / "q.gguf", "q8_0", executor=choose_executor("ray"))
    from forge.distributed.imatrix import collect_ray

    with pytest.raises(ForgeError, match=r"pip install 'gguf-forge\[distributed\]'"):
        collect_ray(EXAMPLE, TEXT, tmp_path / "im.gguf")
    assert not list(tmp_path.iterdir())


def test_executor_choice_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ForgeError, match="--executor must be one of local, ray"):
        quantize(EXAMPLE, tmp_path / "q.gguf", "q8_0", executor=choose_executor("dask"))
    with pytest.raises(ForgeError, match="--ray-address needs --executor ray"):
        quantize(EXAMPLE, tmp_path / "q.gguf", "q8_0", executor=choose_executor(ray_address="127.0.0.1:6379"))


def _silent_listener() -> tuple[socket.socket, int]:
    """A port that accepts connections and never answers (no Ray behind it)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, s.getsockname()[1]


def test_bad_address_fails_fast(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    from forge.distributed.cluster import probe

    listener, port = _silent_listener()
    with listener:
        start = time.monotonic()
        with pytest.raises(ForgeError, match=f"no Ray cluster answered at 127.0.0.1:{port} within 2 s"):
            probe(f"127.0.0.1:{port}", timeout=2)
        assert time.monotonic() - start < 10
    with pytest.raises(ForgeError, match="expected HOST:PORT"):
        probe("nowhere")
    # nothing listens on a port just released: refused at once, one error line from the CLI
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    out = tmp_path / "q.gguf"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "forge", "quantize", str(EXAMPLE), "-o", str(out), "--recipe",
                           "q8_0", "--executor", "ray", "--ray-address", f"127.0.0.1:{closed}"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    elapsed = time.monotonic() - start
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [f"error: cannot reach a Ray cluster at 127.0.0.1:{closed} "
                                                "(connection failed)"]  # fmt: skip
    assert elapsed < 60 and not out.exists()


# -------------------------------------------------------------------------------------- on a cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    pytest.importorskip("ray")
    from forge.distributed.local_cluster import LocalCluster

    hold = tmp_path_factory.mktemp("hold")
    # quick node-death detection, so that the kill test does not wait out Ray's default health checks
    env = {"FORGE_TEST_HOLD_DIR": str(hold), "RAY_health_check_period_ms": "500",
           "RAY_health_check_failure_threshold": "4", "RAY_health_check_initial_delay_ms": "500"}  # fmt: skip
    with LocalCluster(workers=2, cpus_per_worker=1, env=env) as c:
        c.hold = hold
        yield c


def _ray(cluster, **kw):  # noqa: ANN001, ANN003, ANN202
    from forge.distributed.quantize import RayExecutor

    return RayExecutor(cluster.address, **kw)


def _same(a: Path, b: Path) -> bool:
    return a.read_bytes() == b.read_bytes()


@pytest.mark.slow
def test_ray_builds_are_byte_identical(cluster, example_bf16: Path, tmp_path: Path) -> None:  # noqa: ANN001
    from oracle import llamacpp_file

    imatrix = llamacpp_file("tiny-qwen3moe", "tiny-qwen3moe-imatrix.gguf")
    cases = [
        (EXAMPLE, "q4_k_m", None, [], "auto"),  # HF folder read by the workers, experts in parts
        (example_bf16, "q8_0", None, [], "ship"),  # bf16 GGUF slices shipped through the object store
        (
            example_bf16,
            "q8_0",
            imatrix,
            ["ffn_.*_exps=q4_k", "attn_q=iq4_xs"],
            "auto",
        ),  # per-expert importance
    ]
    for i, (src, recipe, im, over, mode) in enumerate(cases):
        local, dist = tmp_path / f"local{i}.gguf", tmp_path / f"ray{i}.gguf"
        quantize(src, local, recipe, imatrix=im, tensor_types=over)
        ex = _ray(cluster, source_mode=mode, part_elements=8 * 256 * 256)  # 4 parts per expert tensor
        try:
            quantize(src, dist, recipe, imatrix=im, tensor_types=over, executor=ex)
            c = ex.counters
            assert c.done == c.total > 30 and c.failed == 0, (recipe, c)
            assert (c.shipped == c.total) if mode == "ship" else (c.shipped == 0)
        finally:
            ex.close()
        assert _same(local, dist), (recipe, mode)


@pytest.mark.slow
def test_ray_reuse_is_byte_identical(cluster, tmp_path: Path) -> None:  # noqa: ANN001
    base = tmp_path / "base.gguf"
    quantize(EXAMPLE, base, "q8_0", executor=choose_executor("ray", ray_address=cluster.address))
    quantize(EXAMPLE, tmp_path / "local-base.gguf", "q8_0")
    assert _same(base, tmp_path / "local-base.gguf")
    ex = _ray(cluster)
    try:
        _, rep = quantize(
            EXAMPLE, tmp_path / "boost.gguf", "q8_0", tensor_types=[BOOST], reuse=[base], executor=ex
        )
        # only the changed tensors travelled: three expert tensors, nothing else
        assert ex.counters.total == 3
    finally:
        ex.close()
    encoded = sorted(r["name"] for r in rep.tensors if r["action"] == "encoded")
    assert encoded == [f"blk.1.ffn_{p}_exps.weight" for p in ("down", "gate", "up")]
    quantize(EXAMPLE, tmp_path / "scratch.gguf", "q8_0", tensor_types=[BOOST])
    assert _same(tmp_path / "boost.gguf", tmp_path / "scratch.gguf")


@pytest.mark.slow
def test_ray_imatrix_equals_single_process(cluster, tmp_path: Path) -> None:  # noqa: ANN001
    from forge.distributed.imatrix import collect_ray
    from forge.imatrix.accumulate import collect

    one_lines: list[str] = []
    ray_lines: list[str] = []
    one = collect(EXAMPLE, TEXT, tmp_path / "one.gguf", ctx=128, chunks=4, log=one_lines.append)
    dist = collect_ray(EXAMPLE, TEXT, tmp_path / "ray.gguf", ctx=128, chunks=4, save_every=2,
                       log=ray_lines.append, address=cluster.address)  # fmt: skip
    a, b = one.imatrix, dist.imatrix
    assert a.names() == b.names() and len(a.names()) == 4 * 8
    assert (
        (a.chunk_count, a.chunk_size, a.datasets)
        == (b.chunk_count, b.chunk_size, b.datasets)
        == (4, 128, [str(TEXT)])
    )
    for name in a.names():
        np.testing.assert_array_equal(a.counts[name], b.counts[name], err_msg=name)
        np.testing.assert_allclose(b.sums[name], a.sums[name], rtol=1e-5, atol=1e-7, err_msg=name)
    # the running perplexity, printed in chunk order, agrees line for line (up to the float rounding of
    # forward passes run with another torch thread count)
    assert len(ray_lines) == len(one_lines) == 5 and ray_lines[-1].startswith("Final estimate: PPL = ")
    got = [float(s.split("]")[-1].rstrip(",").split("= ")[-1]) for s in ray_lines]
    want = [float(s.split("]")[-1].rstrip(",").split("= ")[-1]) for s in one_lines]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert dist.perplexity == pytest.approx(one.perplexity, rel=1e-6)


@pytest.mark.slow
def test_killing_a_worker_node_mid_build_still_gives_the_right_file(cluster, tmp_path: Path) -> None:  # noqa: ANN001
    """Last in the module: it leaves the cluster with one worker node."""
    local, dist = tmp_path / "local.gguf", tmp_path / "ray.gguf"
    quantize(EXAMPLE, local, "q4_0")
    hold = cluster.hold / "hold"
    hold.touch()
    env = {**os.environ, "FORGE_RAY_SOURCE": "auto"}
    proc = subprocess.Popen([sys.executable, "-m", "forge", "quantize", str(EXAMPLE), "-o", str(dist), "--recipe",
                             "q4_0", "--executor", "ray", "--ray-address", cluster.address],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        victim, worker = _held_tasks(cluster, proc)
        victim.kill()  # the node's raylet and object store (its process group), and its busy worker
        os.kill(worker, signal.SIGKILL)
        victim.proc.wait()
        threading.Timer(1.0, hold.unlink).start()
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        hold.unlink(missing_ok=True)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    assert "retrying" in stderr
    assert _same(local, dist)
    assert not [p for p in tmp_path.iterdir() if p.name not in ("local.gguf", "ray.gguf")]


def _held_tasks(cluster, proc: subprocess.Popen):  # noqa: ANN001, ANN202
    """Once tasks are held on both worker nodes: the second node and the pid of its busy worker."""
    import psutil

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"build ended before tasks were held: {proc.stderr.read()[-2000:]}")
        held: dict[int, int] = {}  # node's `ray start` pid -> a worker pid holding a task there
        for marker in cluster.hold.glob("task-*"):
            pid = int(marker.name.split("-")[2])
            with contextlib.suppress(psutil.NoSuchProcess):
                for parent in psutil.Process(pid).parents():
                    held.setdefault(parent.pid, pid)
        nodes = [n for n in cluster.nodes if n.proc.pid in held]
        if len(nodes) == 2:
            return nodes[1], held[nodes[1].proc.pid]
        time.sleep(0.1)
    raise AssertionError("tasks were not held on both worker nodes in time")
