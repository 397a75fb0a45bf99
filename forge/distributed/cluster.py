"""Connecting to Ray: a clear message when it is not installed, a bounded wait for a bad address.

``ray.init`` waits a minute or more (and prints C++ warnings) before giving up on an address where no
cluster answers, so the address is probed first with one call to Ray's control service (GCS),
under a deadline.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType

from forge.errors import ForgeError
from forge.quant.jobs import Executor, local_executor

INSTALL_HINT = "pip install 'gguf-forge[distributed]'"
EXECUTORS = ("local", "ray")
#: seconds to wait for a cluster's address to answer (FORGE_RAY_CONNECT_TIMEOUT overrides)
CONNECT_TIMEOUT = 10.0


def require_ray() -> ModuleType:
    """The ``ray`` module, or a ForgeError that says how to install it."""
    try:
        import ray
    except ImportError:
        raise ForgeError(f"--executor ray needs Ray, which is not installed: {INSTALL_HINT}") from None
    return ray


def check_executor(kind: str, ray_address: str | None, jobs: int = 1, reach: bool = True) -> None:
    """ForgeError for a bad ``--executor`` / ``--ray-address`` / ``--jobs`` choice; for ``ray`` also
    that Ray is installed and (``reach``, an explicit address) a cluster answers there."""
    if kind not in EXECUTORS:
        raise ForgeError(f"--executor must be one of {', '.join(EXECUTORS)}, not {kind!r}")
    if kind == "ray":
        require_ray()
        if reach and ray_address not in (None, "auto"):
            probe(ray_address)
    elif ray_address is not None:
        raise ForgeError("--ray-address needs --executor ray")
    elif jobs < 1:
        raise ForgeError("--jobs must be at least 1")


def choose_executor(
    kind: str = "local",
    jobs: int = 1,
    ray_address: str | None = None,
    log: Callable[[str], None] | None = None,
) -> Callable[[], Executor]:
    """The ``--executor`` choice, checked now (before any source is read), as a factory the build calls
    only when there is work: ``local`` runs in this process or ``jobs`` worker processes, ``ray`` on a
    Ray cluster (connecting then)."""
    check_executor(kind, ray_address, jobs)
    if kind == "ray":

        def on_ray() -> Executor:
            from forge.distributed.quantize import RayExecutor

            return RayExecutor(ray_address, log=log)

        return on_ray
    return lambda: local_executor(jobs)


def connect_timeout() -> float:
    try:
        return float(os.environ.get("FORGE_RAY_CONNECT_TIMEOUT", CONNECT_TIMEOUT))
    except ValueError:
        raise ForgeError("FORGE_RAY_CONNECT_TIMEOUT must be a number of seconds") from None


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` or ``ray://host:port`` -> (host, port)."""
    hostport = address.removeprefix("ray://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ForgeError(f"--ray-address {address!r}: expected HOST:PORT (or ray://HOST:PORT, or auto)")
    return host.strip("[]"), int(port)


def probe(address: str, timeout: float | None = None) -> None:
    """Raise ForgeError unless Ray's control service answers at ``address`` within ``timeout`` s."""
    require_ray()
    try:
        import grpc
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    except ImportError:
        raise ForgeError(
            "probing a Ray address needs grpcio: pip install 'gguf-forge[distributed]'"
        ) from None

    timeout = connect_timeout() if timeout is None else timeout
    host, port = split_address(address)
    if address.startswith("ray://"):  # a Ray Client server: only check that something listens
        try:
            socket.create_connection((host, port), timeout=timeout).close()
        except OSError as e:
            raise ForgeError(f"cannot reach a Ray client server at {address}: {e.strerror or e}") from None
        return
    with grpc.insecure_channel(f"{host}:{port}") as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=timeout)
        except grpc.RpcError as e:
            code = e.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise ForgeError(f"no Ray cluster answered at {address} within {timeout:g} s") from None
            if code == grpc.StatusCode.UNAVAILABLE:
                raise ForgeError(f"cannot reach a Ray cluster at {address} (connection failed)") from None
            raise ForgeError(f"{address} answers, but not as a Ray cluster ({code.name.lower()})") from None


@contextmanager
def ray_session(address: str | None) -> Iterator[ModuleType]:
    """Yield ``ray`` connected to ``address``; disconnect on exit if this call connected.

    ``address``: ``HOST:PORT`` or ``ray://HOST:PORT`` (probed first), ``auto`` (Ray's own lookup of a
    cluster started on this machine), or ``None``: ``RAY_ADDRESS`` when set, else a private Ray
    instance started on this machine for the duration of the build.
    """
    ray = require_ray()
    if ray.is_initialized():
        yield ray
        return
    target = address or os.environ.get("RAY_ADDRESS") or "local"
    if target not in ("auto", "local"):
        probe(target)
    try:
        ray.init(address=target, logging_level="ERROR", log_to_driver=False, configure_logging=True)
    except ConnectionError as e:
        raise ForgeError(f"cannot connect to the Ray cluster at {target}: {e}") from None
    try:
        yield ray
    finally:
        ray.shutdown()


def cluster_cpus(ray: ModuleType) -> int:
    """CPUs of the cluster's live nodes (at least 1, so that a window of tasks can be sized)."""
    return max(1, int(ray.cluster_resources().get("CPU", 0)))
