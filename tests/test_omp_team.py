"""A thread lets its OpenMP team go (``runtime.omp_team``): the team's threads end; a serial thread makes none."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from runtime import omp_team
from runtime.generate import draw

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or torch.get_num_threads() < 2, reason="needs Linux and 2 threads"
)


def _named(name: str) -> int:
    """Threads of this process named ``name`` (a team's threads take the name of the thread that made it)."""
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            count += (Path("/proc/self/task") / tid / "comm").read_text().strip() == name
        except OSError:  # the thread ended
            continue
    return count


def _settled(name: str, done: Callable[[int], bool]) -> int:
    """The count of ``name``'s threads once ``done`` holds for it (a team's threads end a moment after they are
    let go), or after 5 s."""
    end = time.monotonic() + 5
    while not done(n := _named(name)) and time.monotonic() < end:
        time.sleep(0.02)
    return n


def _product() -> None:
    torch.ones(1024, 1024) @ torch.ones(1024, 1024)  # a parallel region: the calling thread's team


def test_release_ends_the_calling_threads_team() -> None:
    if not omp_team.find():
        pytest.skip("no libgomp with omp_pause_resource_all in this process")
    with ThreadPoolExecutor(1, initializer=omp_team.name_thread, initargs=("forge-omp-a",)) as pool:
        pool.submit(_product).result()
        assert _settled("forge-omp-a", lambda n: n > 1) > 1  # the thread and its team
        pool.submit(omp_team.release).result()
        assert _settled("forge-omp-a", lambda n: n == 1) == 1  # the thread alone
        pool.submit(_product).result()  # a later region makes a new team
        assert _settled("forge-omp-a", lambda n: n > 1) > 1
        pool.submit(omp_team.release).result()


def test_a_serial_thread_makes_no_team() -> None:
    with ThreadPoolExecutor(1, initializer=omp_team.serial, initargs=("forge-omp-b",)) as pool:
        a, b = torch.ones(4 << 20), torch.empty(4 << 20)
        pool.submit(b.copy_, a).result()
        pool.submit(torch.add, a, b).result()
        time.sleep(0.2)
        assert _named("forge-omp-b") == 1
        assert torch.equal(a, b)


def test_a_sampled_token_makes_no_team() -> None:
    """The draw of a sampled token over a 248k vocabulary runs on the calling thread alone: a hybrid GPU run's
    model thread, which lets its team go at each step, does not make one again per token."""
    probs = torch.softmax(torch.randn(248_320), -1).numpy()
    with ThreadPoolExecutor(1, initializer=omp_team.name_thread, initargs=("forge-omp-c",)) as pool:
        picks = [pool.submit(draw, probs, torch.Generator().manual_seed(i)).result() for i in range(3)]
        time.sleep(0.2)
        assert _named("forge-omp-c") == 1
    assert all(0 <= p < probs.size and probs[p] > 0 for p in picks)
