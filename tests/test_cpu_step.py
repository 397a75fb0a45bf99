"""A hybrid decode step's one parallel region (``runtime.cpu_step``) against the per-call kernel, with a thread
standing in for the device: it posts each layer's routing, waits for the answer, then posts the next."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

pytest.importorskip("numba")

from runtime import cpu_kernels  # noqa: E402
from runtime.cpu_kernels import EncodedExperts, routed_ffn_into  # noqa: E402
from runtime.cpu_step import DecodeStep  # noqa: E402
from runtime.synth import random_blocks  # noqa: E402

N_EXPERT, N_FF, N_EMBD, K, LAYERS = 6, 64, 256, 3, 4


def _q8_0(rng: np.random.Generator, experts: int, rows: int, cols: int) -> np.ndarray:
    return random_blocks(Q.Q8_0, experts * rows * cols // 32, rng, 0.005, 0.02, signed=True).reshape(
        experts, rows, -1
    )


def _record(rng: np.random.Generator, n_ff: int = N_FF) -> EncodedExperts:
    """One layer's experts: gate, up (n_ff x N_EMBD) and down (N_EMBD x n_ff) as Q8_0 rows."""
    parts = ((n_ff, N_EMBD), (n_ff, N_EMBD), (N_EMBD, n_ff))
    return EncodedExperts(*(a for rows, cols in parts for a in (_q8_0(rng, N_EXPERT, rows, cols), Q.Q8_0)))


def _layers(rng: np.random.Generator) -> list[EncodedExperts]:
    return [_record(rng) for _ in range(LAYERS)]


def _device(step: DecodeStep, routes: list[tuple[np.ndarray, np.ndarray, np.ndarray]], answers: list) -> None:
    """Post layer after layer (step number 1), each after the last one's answer; keep the answers."""
    for i, (ids, w, x) in enumerate(routes):
        step.mail[i] = np.concatenate([ids.astype(np.float32), w, x])
        step.posted[i] = 1
        t0 = time.monotonic()
        while step.done[i] != 1 and time.monotonic() - t0 < 20:
            time.sleep(0)
        answers.append(step.result[i].copy())


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_one_region_answers_each_layer_as_the_kernel_does(threads: int) -> None:
    rng = np.random.default_rng(threads)
    records = _layers(rng)
    assert DecodeStep.fits(records)
    slot_of = np.full(LAYERS * N_EXPERT, -1, np.int64)
    slot_of[rng.choice(slot_of.size, slot_of.size // 3, replace=False)] = 0  # these are on the device
    bases = np.arange(LAYERS, dtype=np.int64) * N_EXPERT
    step = DecodeStep(
        records, np.zeros((LAYERS, 2 * K + N_EMBD), np.float32), np.zeros(LAYERS, np.int32),
        np.zeros(LAYERS, np.int32), np.zeros((LAYERS, N_EMBD), np.float32), slot_of, bases, K,
    )  # fmt: skip
    routes = [
        (
            rng.choice(N_EXPERT, K, replace=False),
            rng.random(K).astype(np.float32),
            rng.standard_normal(N_EMBD).astype(np.float32),
        )
        for _ in range(LAYERS)
    ]
    # one layer with every expert on the device: answered with zeros
    slot_of[bases[2] + routes[2][0]] = 0
    step.warm()  # compiled before the stand-in device starts waiting for answers
    answers: list = []
    device = threading.Thread(target=_device, args=(step, routes, answers))
    device.start()
    assert step.serve(threads, 20.0)
    device.join()
    cpu_kernels.use_threads(threads)
    for i, (ids, w, x) in enumerate(routes):
        miss = np.flatnonzero(slot_of[bases[i] + ids] < 0)
        assert step.missed[i] == miss.size
        want = np.zeros(N_EMBD, np.float32)
        if miss.size:
            act = np.empty((miss.size, N_FF), np.float32)
            routed_ffn_into(x, ids[miss], w[miss], records[i], np.zeros(N_EMBD, np.float32), act, want)
        np.testing.assert_array_equal(answers[i], want)
    assert step.missed.sum() > 0 and step.missed[2] == 0
    # every work item done once, by some member: gate/up and down items of the layers with misses
    assert (
        step.items.size == threads and step.items.sum() == step.plan[:, 2].sum() + step.plan[:, 4].sum() > 0
    )
    assert 1 / threads <= step.busiest_share <= 1.0
    assert (step.stamps[:, 1] >= step.stamps[:, 0]).all() and (
        step.stamps[1:, 0] >= step.stamps[:-1, 1]
    ).all()


def test_a_post_that_never_comes_ends_the_step() -> None:
    records = _layers(np.random.default_rng(0))
    step = DecodeStep(
        records, np.zeros((LAYERS, 2 * K + N_EMBD), np.float32), np.zeros(LAYERS, np.int32),
        np.zeros(LAYERS, np.int32), np.zeros((LAYERS, N_EMBD), np.float32),
        np.full(LAYERS * N_EXPERT, -1, np.int64), np.arange(LAYERS, dtype=np.int64) * N_EXPERT, K,
    )  # fmt: skip
    step.warm()  # compiled first: the limit below times the wait, not numba
    t0 = time.monotonic()
    assert not step.serve(2, 0.2)
    assert time.monotonic() - t0 < 10


def test_layers_of_two_widths_are_served_layer_by_layer() -> None:
    rng = np.random.default_rng(1)
    assert not DecodeStep.fits([*_layers(rng), _record(rng, n_ff=32)])
    assert not DecodeStep.fits([None]) and not DecodeStep.fits([])
