"""benchmarks/hybrid_experts.py's decode breakdown: the CPU kernel's calls by missed experts, the timed steps
alone, and the line through them (a call's fixed cost, the cost of each missed expert)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from runtime.hybrid import HybridStats
from tests.benchmark_scripts import load


def test_cpu_calls_by_misses_count_the_timed_steps_and_fit_a_line() -> None:
    # warm-up: slow calls (a graph capture's) that must not count; timed: 110 us + 40 us a missed expert
    warm = HybridStats(step_cpu_calls=[0, 2, 1], step_cpu_seconds_by_misses=[0.0, 0.01, 0.02])
    calls, warm_calls, warm_secs = [0, 10, 30, 5, 1], [0, 2, 1, 0, 0], [0.0, 0.01, 0.02, 0.0, 0.0]
    secs = [w + n * (110 + 40 * m) * 1e-6 for m, (w, n) in enumerate(zip(warm_secs, calls, strict=True))]
    after = HybridStats(
        step_cpu_calls=[c + w for c, w in zip(calls, warm_calls, strict=True)],
        step_cpu_seconds_by_misses=secs,
    )
    got = load("hybrid_experts")._cpu_by_misses(after.since(warm))
    assert got["calls"] == {1: 10, 2: 30, 3: 5, 4: 1}
    assert got["mean_us"] == {1: 150.0, 2: 190.0, 3: 230.0, 4: 270.0}
    assert got["fixed_us"] == pytest.approx(110.0) and got["per_expert_us"] == pytest.approx(40.0)


def test_one_miss_count_has_no_line() -> None:
    after = HybridStats(step_cpu_calls=[0, 0, 4], step_cpu_seconds_by_misses=[0.0, 0.0, 4e-4])
    got = load("hybrid_experts")._cpu_by_misses(after.since(HybridStats()))
    assert got == {"calls": {2: 4}, "mean_us": {2: 100.0}}


def test_cpu_step_benchmark_times_the_worker(tmp_path: Path) -> None:
    pytest.importorskip("numba")
    hybrid_cpu_step = load("hybrid_cpu_step")
    out = tmp_path / "step.json"
    args = ["--threads", "1,2", "--misses", "1,2", "--layers", "2", "--experts", "8", "--reps", "2"]
    assert hybrid_cpu_step.main([*args, "--gap-us", "10", "--main-team", "released", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["threads"] for r in rows] == [1, 2]
    assert all(set(r["layer_us"]) == {"1", "2"} and min(r["layer_us"].values()) > 0 for r in rows)
    assert all(r["empty_region_us"] > 0 and "per_expert_us" in r for r in rows)
    assert hybrid_cpu_step.main([*args[2:], "--threads", "1", "--hot", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["args"]["hot"] is True
    with pytest.raises(SystemExit, match="misses are 1..8"):
        hybrid_cpu_step.main(["--misses", "9"])


def test_policy_bounds() -> None:
    policy = load("hybrid_policy")
    # one slot: the clairvoyant pool keeps 1 (needed again before 2 or 3 are), then has nothing worth admitting
    assert policy._belady_hits(np.array([1, 2, 3, 1, 2, 3]), np.array([1])) == 2
    # 2 admitted at its first use (needed before 1), 1 admitted back: a hit at each one's second use
    assert policy._belady_hits(np.array([2, 2, 1, 1]), np.array([1])) == 2
    rng = np.random.default_rng(0)
    seq = policy.SEQUENCE
    n = (seq.warmup_prefills + 1 + seq.reps) * seq.pp + seq.warmup + seq.reps * seq.tg
    table = [rng.zipf(1.5, (n, 2)).clip(max=31) for _ in range(3)]  # popular low ids, as a trained router's
    got = policy.bounds(table, slots=12, experts=32)
    assert 0 < got["learned"] <= got["oracle"] and got["learned"] <= got["belady"] <= 1


def test_disk_reads_benchmark_times_the_cache_reads(example_q8: Path, tmp_path: Path) -> None:
    disk_reads = load("disk_reads")
    out = tmp_path / "disk.json"
    args = ["--threads", "1,2", "--chunk-kb", "0,4", "--misses", "1,2", "--requests", "3", "--json", str(out)]
    assert disk_reads.main([str(example_q8), *args]) == 0
    got = json.loads(out.read_text())
    rows = {(r["misses"], r["threads"], r["chunk_kb"]): r for r in got["rows"]}
    assert len(rows) == 8 and got["ceiling_gb_s"] > 0
    assert all(r["gb_s"] > 0 and r["ms_per_request"] > 0 for r in rows.values())
    for m in (1, 2):  # every request a miss: a read per part, or per 4 KiB of each part
        assert rows[m, 1, 0]["reads"] == 3 * m * 3
        assert rows[m, 1, 4]["reads"] > rows[m, 1, 0]["reads"]
    assert disk_reads.main([str(tmp_path / "none.gguf")]) == 1


def test_cache_contention_benchmark_times_two_requesters(example_q8: Path, tmp_path: Path) -> None:
    contention = load("cache_contention")
    out = tmp_path / "contention.json"
    args = ["--worker", "2", "--copier", "1", "--hot", "2", "--slots", "1", "--compute-us", "50"]
    args += ["--tokens", "3", "--warmup", "2", "--read-threads", "2", "--json", str(out)]
    assert contention.main([str(example_q8), *args]) == 0
    got = json.loads(out.read_text())
    worker, copier, both = got["rows"]
    assert [r["who"] for r in got["rows"]] == ["worker", "copier", "worker+copier"]
    # the worker asks for the same two experts every token: after the warm-up, all hits, nothing read
    assert worker["hit_rate"] == 1.0 and worker["mb_read_per_token"] == 0
    assert (
        copier["mb_read_per_token"] > 0
        and both["worker_ms_per_token"] > 0
        and both["copier_ms_per_token"] > 0
    )
    assert got["overlap"] > 0
    assert contention.main([str(tmp_path / "none.gguf")]) == 1


def test_read_ahead_benchmark_replays_the_uncached_host_side(example_q8: Path, tmp_path: Path) -> None:
    read_ahead = load("read_ahead")
    out = tmp_path / "ahead.json"
    args = ["--tokens", "6", "--warmup", "2", "--compute-us", "10", "--host-share", "1", "--unhinted"]
    assert read_ahead.main([str(example_q8), *args, "--json", str(out)]) == 0
    off, on, unhinted = json.loads(out.read_text())["rows"]
    assert [(r["prefetch"], r["ahead_hints"]) for r in (off, on, unhinted)] == [
        (False, True),
        (True, True),
        (True, False),
    ]
    assert off["read_ahead_per_token"] == 0
    for r in (on, unhinted):
        assert r["read_ahead_per_token"] > 0 and r["used_per_token"] > 0
        # every expert fits: each one the decode needs is read once, by its miss or ahead of it
        assert r["needed_mb_per_token"] == off["needed_mb_per_token"] > 0
    assert off["read_mb_per_token"] == off["needed_mb_per_token"]
    assert read_ahead.main([str(example_q8), "--pool-share", "1"]) == 1
    assert read_ahead.main([str(tmp_path / "none.gguf")]) == 1


def test_pool_of_the_most_chosen_experts() -> None:
    read_ahead = load("read_ahead")
    table = [np.array([[0, 1], [0, 2], [0, 1]]), np.array([[3, 2], [3, 2], [1, 0]])]
    got = read_ahead.hottest(table, experts=4, share=0.5)  # 4 of 8: counts 3, then the three 2s
    assert got.tolist() == [[True, True, False, False], [False, False, True, True]]


def test_scaled_guesses_stand_for_the_experts_their_choices_stand_for() -> None:
    """A guess that was chosen becomes the same experts of the file as the choice, one that was not others; the
    choices' table is the same with guesses or without; layers replaying the trace's first have none."""
    hb = load("hybrid_experts")
    rng = np.random.default_rng(3)
    trace = {layer: np.stack([rng.permutation(8)[:2] for _ in range(50)]) for layer in range(2)}
    right = {1: trace[1]}
    wrong = {1: np.stack([np.setdiff1d(np.arange(8), row)[:2] for row in trace[1]])}
    plain, none = hb.scaled_trace(trace, 8, 4, 32, 4)
    table, guessed = hb.scaled_trace(trace, 8, 4, 32, 4, guesses=right)
    _, missed = hb.scaled_trace(trace, 8, 4, 32, 4, guesses=wrong)
    assert all(np.array_equal(a, b) for a, b in zip(plain, table, strict=True)) and none == [None] * 4
    assert guessed[0] is None and guessed[2] is None  # file layers 0 and 2 replay trace layer 0
    for layer in (1, 3):
        assert np.array_equal(guessed[layer], table[layer])
        assert not (missed[layer][:, :, None] == table[layer][:, None, :]).any()
        assert all(len(set(row)) == 4 for row in missed[layer])
