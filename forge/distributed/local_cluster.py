"""A Ray cluster of separate processes on this machine (loopback), for tests and benchmarks.

One ``ray start --head --block`` (no CPUs: it schedules, it does not compute) and one
``ray start --address ... --block`` per worker node, each in its own session so that a node (raylet,
its workers, its object store) can be killed as a unit by process group. Every port is chosen free
up front: several raylets on one host otherwise collide on the fixed default agent/metrics ports.
Nothing is stopped by name: only the process groups started here are signalled.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from forge.errors import ForgeError

OBJECT_STORE_BYTES = 200 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ray_cli() -> list[str]:
    exe = Path(sys.executable).with_name("ray")
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "ray.scripts.scripts"]


def _node_ports() -> list[str]:
    names = ("node-manager-port", "object-manager-port", "metrics-export-port", "runtime-env-agent-port",
             "dashboard-agent-listen-port", "dashboard-agent-grpc-port")  # fmt: skip
    return [f"--{n}={free_port()}" for n in names]


@dataclass
class LocalNode:
    proc: subprocess.Popen
    log: Path
    cpus: int

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the node's whole process group (raylet, object store, its workers)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)


@dataclass
class LocalCluster:
    """``with LocalCluster(workers=2) as c: ... c.address ...``; ``c.nodes[i].kill()`` drops a node."""

    workers: int = 2
    cpus_per_worker: int = 1
    env: dict[str, str] = field(default_factory=dict)
    start_timeout: float = 180.0
    keep_logs: bool = False
    address: str = ""
    head: LocalNode | None = None
    nodes: list[LocalNode] = field(default_factory=list)

    def __post_init__(self) -> None:
        # a short root: Ray's unix socket paths must stay under ~107 bytes
        self._tmp = Path(tempfile.mkdtemp(prefix="fr-", dir="/tmp"))

    def __enter__(self) -> LocalCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, args: list[str], name: str, cpus: int) -> LocalNode:
        log = self._tmp / f"{name}.log"
        env = {
            **os.environ,
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_raylet_start_wait_time_s": "180",
            **self.env,
        }
        with open(log, "wb") as f:
            proc = subprocess.Popen([*_ray_cli(), "start", "--block", "--disable-usage-stats",
                                     "--node-ip-address=127.0.0.1", f"--num-cpus={cpus}", "--num-gpus=0",
                                     f"--object-store-memory={OBJECT_STORE_BYTES}", *_node_ports(), *args],
                                    stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)  # fmt: skip
        return LocalNode(proc, log, cpus)

    def start(self) -> None:
        port = free_port()
        self.address = f"127.0.0.1:{port}"
        self.head = self._spawn([
            "--head", f"--port={port}", f"--temp-dir={self._tmp / 'ray'}", "--include-dashboard=false",
            f"--ray-client-server-port={free_port()}",
        ], "head", 0)  # fmt: skip
        self._wait_for(1, [self.head])
        for _ in range(self.workers):
            self.add_worker()

    def add_worker(self, cpus: int | None = None) -> LocalNode:
        """Start one more worker node and wait until it has joined (one at a time: raylets starting
        together on one host can pick the same socket name)."""
        cpus = self.cpus_per_worker if cpus is None else cpus
        node = self._spawn([f"--address={self.address}"], f"worker{len(self.nodes)}", cpus)
        self.nodes.append(node)
        self._wait_for(1 + sum(1 for n in self.nodes if n.proc.poll() is None), [self.head, node])
        return node

    def _wait_for(self, n_nodes: int, watch: list[LocalNode | None]) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            for node in watch:
                if node is not None and node.proc.poll() is not None:
                    tail = node.log.read_text(errors="replace")[-2000:]
                    raise ForgeError(f"local Ray node exited during startup:\n{tail}")
            if self._count_nodes() >= n_nodes:
                return
            time.sleep(0.5)
        raise ForgeError(f"local Ray cluster: {n_nodes} nodes not up after {self.start_timeout:.0f} s")

    def _count_nodes(self) -> int:
        from ray._raylet import GcsClient

        try:
            client = GcsClient(address=self.address)
            return sum(1 for n in client.get_all_node_info(timeout=5).values() if n.state == 0)
        except Exception:
            return 0

    def stop(self) -> None:
        """Kill every node this object started, by process group (workers first, then the head)."""
        for node in [*self.nodes, self.head]:
            if node is not None:
                node.kill()
                node.proc.wait()
        self.nodes.clear()
        self.head = None
        if self.keep_logs is False:
            shutil.rmtree(self._tmp, ignore_errors=True)
