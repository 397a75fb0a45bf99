"""A hybrid decode step's CPU side (``runtime.hybrid``) as one parallel region: per routed layer in order, wait
for the device's post of its routing in the mailbox, compute the pairs the GPU pool missed from the encoded
records in host memory, write their sum and release the device.

A kernel call per layer opens two OpenMP regions. On the 16-core H200 host an empty one cost ~48 us even
back to back, with a second team on the main thread (when a process's teams outnumber the cores, libgomp
puts their threads to sleep between regions); a call's fixed cost there was ~130 us of a layer's 230 us of
CPU work at 4 GiB. Here the team is woken once a step and its threads wait for the next post by spinning
(``runtime.cpu_sync``), yielding the core after a while. No thread has a fixed part: the step's state is one
ticket (layer x stage) that any thread advances, so the step completes however many of the region's threads
run. Opt-in (``FORGE_HYBRID_STEP_REGION=1``): in its one GPU run a missed expert cost ~320 us, ten times
the per-call path's (``benchmarks/hybrid_cpu_step.py`` compares the two without a GPU).

Stages per layer: 0 waiting for the post (the first thread to see it reads the routing, finds the
misses and prepares the input), 1 the gate/up rows, 2 the down rows; work items are claimed from per-layer
counters; the thread that finishes a stage's last item prepares the next and moves the ticket on."""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, prange, typed, typeof

from runtime.cpu_ir import claim
from runtime.cpu_kernels import _FASTMATH, _down_rows, _gate_up_rows, work_chunk
from runtime.cpu_rows import prepare_into, prepared_size
from runtime.cpu_sync import arrive, load_acquire, now_ns, spin_pause, store_release, yield_thread

#: hint-paused reads of a flag before a waiting thread yields its core between reads (a system call each)
SPINS = 4096
ABORT = -1  # the ticket of a step that gave up waiting for the device
_GU_CLAIM, _GU_DONE, _DN_CLAIM, _DN_DONE, _OWNER = range(5)  # a layer's counters


@njit(fastmath=_FASTMATH, nogil=True, cache=True, parallel=True)
def _serve(mail, posted, done, result, slot_of, bases, gates, ups, downs, metas, k, acts, threads, timeout_ns,  # noqa: ANN001, ANN202, PLR0913
           ticket, counters, plan, xs, misses, weights, act, act_sums, zeros, stamps, items):  # fmt: skip
    for t in prange(threads):
        _member(mail, posted, done, result, slot_of, bases, gates, ups, downs, metas, k, acts, threads, timeout_ns,
                ticket, counters, plan, xs, misses, weights, act, act_sums, zeros, stamps, items, t)  # fmt: skip


@njit(fastmath=_FASTMATH, nogil=True, cache=True)
def _member(mail, posted, done, result, slot_of, bases, gates, ups, downs, metas, k, acts, threads, timeout_ns,  # noqa: ANN001, ANN202, PLR0913
            ticket, counters, plan, xs, misses, weights, act, act_sums, zeros, stamps, items, t):  # fmt: skip
    """Member t's share: until the ticket passes the last layer (or aborts), do whatever the current stage
    has left, else wait; ``items[t]`` counts the work items it did."""
    n_layers, n_embd, n_ff = posted.shape[0], result.shape[1], act.shape[2]
    row = np.empty(max(n_embd, n_ff), np.float32)
    seen, since, spins = -2, now_ns(), 0
    while True:
        tk = load_acquire(ticket, 0)
        if tk == ABORT or tk >= 3 * n_layers:
            return
        if tk != seen:
            seen, since, spins = tk, now_ns(), 0
        i, stage = tk // 3, tk % 3
        m = plan[i, 0]
        worked = False
        if stage == 0:
            if load_acquire(posted, i) != load_acquire(done, i) and load_acquire(counters[i], _OWNER) == 0:
                if claim(counters[i], _OWNER) == 0:
                    _take_post(i, mail, posted, done, result, slot_of, bases, k, threads, ticket, plan, xs, misses,
                               weights, n_ff, stamps)  # fmt: skip
                    worked = True
            elif now_ns() - since > timeout_ns:
                store_release(ticket, 0, ABORT)
                return
        elif stage == 1:
            # a read first: an idle thread's adds would take the counters' line from the working ones
            c = (
                claim(counters[i], _GU_CLAIM)
                if load_acquire(counters[i], _GU_CLAIM) < plan[i, 2]
                else plan[i, 2]
            )
            if c < plan[i, 2]:
                r0, r1 = c * plan[i, 1], min(m * n_ff, (c + 1) * plan[i, 1])
                _gate_up_rows(gates[i], ups[i], metas[i], mail[i, 2 * k :], xs[i], misses[i, :m], act[i, :m],
                              row[:n_embd], r0, r1)  # fmt: skip
                # the stage's last item done: the down rows' input
                if arrive(counters[i], _GU_DONE) == plan[i, 2] - 1:
                    for j in range(m):
                        prepare_into(act[i, j], act_sums[i, j])
                    store_release(ticket, 0, tk + 1)
                items[t] += 1
                worked = True
        else:
            c = (
                claim(counters[i], _DN_CLAIM)
                if load_acquire(counters[i], _DN_CLAIM) < plan[i, 4]
                else plan[i, 4]
            )
            if c < plan[i, 4]:
                d0, d1 = c * plan[i, 3], min(n_embd, (c + 1) * plan[i, 3])
                _down_rows(downs[i], metas[i], zeros, misses[i, :m], weights[i, :m], act[i, :m], act_sums[i, :m],
                           result[i], row[:n_ff], d0, d1)  # fmt: skip
                # the layer's last item done: answer the device
                if arrive(counters[i], _DN_DONE) == plan[i, 4] - 1:
                    stamps[i, 1] = now_ns()
                    store_release(done, i, load_acquire(posted, i))
                    store_release(ticket, 0, tk + 1)
                items[t] += 1
                worked = True
        if worked:
            spins = 0
        elif spins < SPINS:
            spins += 1
            spin_pause()
        else:
            yield_thread()


@njit(fastmath=_FASTMATH, nogil=True, cache=True, inline="always")
def _take_post(i, mail, posted, done, result, slot_of, bases, k, threads, ticket, plan, xs, misses, weights,  # noqa: ANN001, ANN202, PLR0913
               n_ff, stamps):  # fmt: skip
    """Layer i's post seen (by this thread first): its missed pairs, the prepared input and the work items; a
    layer with none is answered with zeros at once."""
    stamps[i, 0] = now_ns()
    m = 0
    for j in range(k):
        e = np.int64(mail[i, j])
        if slot_of[bases[i] + e] < 0:
            misses[i, m], weights[i, m] = e, mail[i, k + j]
            m += 1
    plan[i, 0] = m
    if m == 0:
        result[i, :] = 0.0
        stamps[i, 1] = stamps[i, 0]
        store_release(done, i, load_acquire(posted, i))
        store_release(ticket, 0, 3 * (i + 1))
        return
    prepare_into(mail[i, 2 * k :], xs[i])
    n_embd = result.shape[1]
    plan[i, 1] = work_chunk(m * n_ff, threads)
    plan[i, 2] = (m * n_ff + plan[i, 1] - 1) // plan[i, 1]
    plan[i, 3] = work_chunk(n_embd, threads)
    plan[i, 4] = (n_embd + plan[i, 3] - 1) // plan[i, 3]
    store_release(ticket, 0, 3 * i + 1)


class DecodeStep:
    """The arrays a decode step's region works on, made once for an exchange's layers: their encoded records,
    the mailbox (``mail``, ``posted``, ``done``, ``result``: numpy views of the page-locked tensors), the
    executor's slot table (``slot_of``, read in place: it changes only between steps) and each layer's
    first key in it (``bases``); the scratch rows; after a step, each layer's missed pairs (``missed``) and
    its post's and answer's clock (``stamps``, ns)."""

    def __init__(self, records: list[Any], mail: np.ndarray, posted: np.ndarray, done: np.ndarray,
                 result: np.ndarray, slot_of: np.ndarray, bases: np.ndarray, k: int) -> None:  # fmt: skip
        n, n_embd, n_ff, self.acts = len(records), result.shape[1], records[0].n_ff, records[0].acts
        self.mail, self.posted, self.done, self.result = mail, posted, done, result
        self.slot_of, self.bases, self.k = slot_of, bases, k
        self.records = records
        self.parts = tuple(typed.List([r.buffers[p] for r in records]) for p in range(3))
        self.metas = np.stack([r.meta for r in records])
        self.ticket = np.zeros(1, np.int64)
        self.counters, self.plan = np.zeros((n, 5), np.int64), np.zeros((n, 5), np.int64)
        self.stamps = np.zeros((n, 2), np.int64)
        self.xs = np.zeros((n, prepared_size(n_embd, self.acts)), np.float32)
        self.misses, self.weights = np.zeros((n, k), np.int64), np.zeros((n, k), np.float32)
        self.act = np.zeros((n, k, n_ff), np.float32)
        self.act_sums = np.zeros((n, k, prepared_size(n_ff, self.acts)), np.float32)
        self.zeros = np.zeros(n_embd, np.float32)
        self.items = np.zeros(0, np.int64)  # work items done by each member over the steps served so far

    @staticmethod
    def fits(records: list[Any]) -> bool:
        """One region serves these layers: every one encoded, with one expert width, input form and buffer
        type (a list the region indexes holds one type)."""
        if not records or any(r is None for r in records):
            return False
        return (
            len({(r.n_ff, r.acts) for r in records}) == 1
            and len({typeof(b) for r in records for b in r.buffers}) == 1
        )

    @property
    def missed(self) -> np.ndarray:
        return self.plan[:, 0]

    @property
    def busiest_share(self) -> float:
        """The share of the work items that the busiest member did (1 / threads when they share evenly, 1.0
        when one thread did everything)."""
        return float(self.items.max() / max(1, self.items.sum())) if self.items.size else 0.0

    def serve(self, threads: int, timeout_s: float) -> bool:
        """Serve one step's layers on ``threads`` threads; False when a post did not come within ``timeout_s``
        (the step was abandoned)."""
        self.ticket[0] = 0
        self.counters[:] = 0
        self.plan[:] = 0
        if self.items.size != threads:
            self.items = np.zeros(threads, np.int64)
        gates, ups, downs = self.parts
        _serve(self.mail, self.posted, self.done, self.result, self.slot_of, self.bases, gates, ups, downs,
               self.metas, self.k, self.acts, threads, int(timeout_s * 1e9), self.ticket, self.counters, self.plan,
               self.xs, self.misses, self.weights, self.act, self.act_sums, self.zeros, self.stamps, self.items)  # fmt: skip
        return self.ticket[0] != ABORT

    def warm(self) -> None:
        """Compile the region for these arrays' types now (or load it from numba's disk cache), not in the
        first step, whose device would give up waiting: a one-layer twin served at once (its post there, its
        first expert missed)."""
        twin = DecodeStep(
            self.records[:1], np.zeros_like(self.mail[:1]), np.ones(1, self.posted.dtype),
            np.zeros(1, self.done.dtype), np.zeros_like(self.result[:1]),
            np.full(self.slot_of.size, -1, self.slot_of.dtype), np.zeros(1, np.int64), self.k,
        )  # fmt: skip
        twin.serve(1, 1.0)
