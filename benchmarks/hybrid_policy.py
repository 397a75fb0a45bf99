"""The hybrid executor's pool policy replayed on the CPU: decode-step GPU hits per policy setting.

    python benchmarks/hybrid_policy.py [--geometry qwen3.6-35b-a3b] [--slots 2427] [--windows 8,16,32,64]
        [--margins 1] [--admit-per-call 1] [--routing trace|uniform] [--bounds] [--json OUT]

Which experts a hybrid run's pool holds depends on the routing and the policy, not on the device or the
experts' width, so this replays ``hybrid_experts.py``'s sequence (two warm-up prefills of 512 tokens, one more
and 16 decode steps, then two prefills and twice 64 decode steps; routing ``trace`` or ``uniform``, as
there) through the executor on the CPU, over a synthesized model with the geometry's layers, experts and
experts per token but a narrow width (256). ``--slots``: the pool's experts (2,427 is what 4 GiB holds of the
Qwen3.6-35B-A3B-geometry Q4_K file). Per setting (``Frequency``'s window in pairs per expert of the model,
``ADMIT_MARGIN``, admissions per one-token layer call): the decode steps' hit rate and the admissions (each a
record's copy to the GPU). About a minute a setting on two cores.

On 2026-12-04 (trace routing, 2,427 slots, margin 1, one admission a layer per decode step): windows 8 / 16 /
32 / 64 / 128 hit 52.3 / 54.9 / 55.0 / 55.1 / 55.2% of the decode pairs, with 22,713 / 15,790 / 12,642 / 11,072
/ 10,438 admissions. Window 8 (the default until then) replays the H200 runs of the same sequence: 52% decode
hits and 621 decode-step admissions there, 52.3% and 621 here (1 GiB: 16% and 232 there, 16.4% and 231 here;
8 GiB: 82% and 606, 82.2% and 606). Window 32 against 8: 1 GiB (``--slots 606``) 19.1 against 16.4%, 8 GiB
(``--slots 4854``) 84.0 against 82.2%, uniform routing 23.3 against 23.8%. At window 32 neither margin 0.5 or 4
nor two admissions a layer per decode step moved the 4 GiB pool's 55.0%.

``--bounds`` replays nothing: it gives, for the timed decode steps of the sequence, the hit rates of three
pools of ``--slots`` experts, each layer's share ``slots // layers``: ``learned``, the experts most often chosen
in the tokens before (what a frequency policy that never changes its mind would hold); ``oracle``, the
experts most often chosen in those steps themselves (the best pool that never changes); ``belady``, starting
from ``learned``, a miss admitted whenever the expert it would evict is needed later than the missed one
(the best any policy can do, each admission a record's copy). Session 28 (trace routing): 606 slots
17.8 / 21.5 / 39.8%, **2,427 slots 54.3 / 60.2 / 73.3%** (the H200 runs: 55%), 4,854 slots 84.5 / 88.3 /
91.2%; uniform routing 2,427 slots 23.4 / 39.3 / 55.3% (the oracle there fits 128 tokens' chance picks).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hybrid_experts as hb  # noqa: E402

from runtime import hybrid  # noqa: E402
from runtime.experts import ExpertCache  # noqa: E402
from runtime.models import build_model  # noqa: E402
from runtime.synth import synthesize  # noqa: E402
from runtime.weights import load_weights  # noqa: E402

#: ``hybrid_experts.py``'s defaults, as the H200 runs used them
SEQUENCE = argparse.Namespace(pp=512, tg=64, warmup=16, warmup_prefills=2, reps=2, cold=False, cprofile=None)


def replay(path: Path, table: list, slots: int, window: float, margin: float, admit: int,
           host_share: float = 0.0) -> dict:  # fmt: skip
    """``hybrid_experts.timed``'s sequence through a fresh executor; its decode-step figures. ``host_share``:
    the CPU side's experts through a host expert cache of that share of all experts (the records it reads a
    decode token counted)."""
    w = load_weights(path, "cpu", 0)
    w.host_experts = True
    if host_share:
        lays, k = w.expert_layers(), int(w.hparam("expert_used_count"))
        total = sum(lay.experts for lay in lays.values())
        w.expert_cache = ExpertCache(
            path, lays, max(int(host_share * total), len(lays) * k + 1), k, "lfu", "cpu"
        )
    model = build_model(w)
    routing = hb.Routing(table)
    hb.route_by(model, routing)
    layers = w.expert_layers()
    record = max(lay.record_bytes for lay in layers.values())
    n_keys = sum(lay.experts for lay in layers.values())
    old, hybrid.ADMIT_MARGIN = hybrid.ADMIT_MARGIN, margin
    try:
        h = model.hybrid = hybrid.HybridExperts(
            model, slots * record, "cpu", rates=hybrid.Rates.never(), admit_per_call=admit,
            window=int(window * n_keys),
        )  # fmt: skip
        t0, misses = time.perf_counter(), []
        cache = w.expert_cache
        before_tg = (lambda: misses.append(cache.stats.misses)) if cache is not None else None  # noqa: E731
        # the benchmark's own sequence, its times unused
        hb.timed(model, routing, "cpu", SEQUENCE, path, None, before_tg)
        s = h.stats
        h.close()
    finally:
        hybrid.ADMIT_MARGIN = old
    row = {"window": window, "margin": margin, "admit_per_call": admit, "decode_hit_rate": round(s.step_hit_rate, 4),
           "admissions": s.admissions, "step_admissions": s.step_admissions,
           "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
    if cache is not None:
        tokens = SEQUENCE.reps * SEQUENCE.tg
        row |= {"host_share": host_share,
                "host_records_read_per_token": round((cache.stats.misses - misses[0]) / tokens, 2)}  # fmt: skip
    return row


def bounds(table: list, slots: int, experts: int) -> dict:
    """The ``--bounds`` hit rates of the timed decode steps (see the module)."""
    n = table[0].shape[0]
    start = (SEQUENCE.warmup_prefills + 1 + SEQUENCE.reps) * SEQUENCE.pp + SEQUENCE.warmup
    before = np.arange(start) % n
    steps = (start + np.arange(SEQUENCE.reps * SEQUENCE.tg)) % n
    per = slots // len(table)
    hits, total = dict.fromkeys(("learned", "oracle", "belady"), 0), 0
    for t in table:
        seq = t[steps].reshape(-1)
        learned = np.argsort(np.bincount(t[before].reshape(-1), minlength=experts), kind="stable")[::-1][:per]
        oracle = np.argsort(np.bincount(seq, minlength=experts), kind="stable")[::-1][:per]
        hits["learned"] += int(np.isin(seq, learned).sum())
        hits["oracle"] += int(np.isin(seq, oracle).sum())
        hits["belady"] += _belady_hits(seq, learned)
        total += seq.size
    return {k: round(v / total, 4) for k, v in hits.items()}


def _belady_hits(seq: np.ndarray, pool: np.ndarray) -> int:
    """Hits of a pool that starts as ``pool`` and admits a missed expert whenever the one it evicts (the one
    needed latest) is needed later than the missed one."""
    never = seq.size
    next_use = np.full(seq.size, never)
    seen: dict[int, int] = {}
    for i in range(seq.size - 1, -1, -1):
        next_use[i] = seen.get(int(seq[i]), never)
        seen[int(seq[i])] = i
    held = {int(e): seen.get(int(e), never) for e in pool}  # expert -> its next use
    hits = 0
    for i, e in enumerate(seq.tolist()):
        if e in held:
            hits += 1
            held[e] = int(next_use[i])
            continue
        victim = max(held, key=held.__getitem__)
        if held[victim] > next_use[i]:
            del held[victim]
            held[e] = int(next_use[i])
    return hits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geometry", default="qwen3.6-35b-a3b")
    ap.add_argument("--slots", type=int, default=2427)
    ap.add_argument("--windows", default="8,16,32,64")
    ap.add_argument("--margins", default=str(hybrid.ADMIT_MARGIN))
    ap.add_argument("--admit-per-call", type=int, default=hybrid.ADMIT_PER_CALL)
    ap.add_argument("--routing", choices=["trace", "uniform"], default="trace")
    ap.add_argument("--trace-model", type=Path, default=hb.ROOT / "examples" / "tiny-qwen3moe")
    ap.add_argument("--text", type=Path, default=hb.ROOT / "tests" / "fixtures" / "text" / "val.txt")
    ap.add_argument("--bounds", action="store_true")
    ap.add_argument(
        "--host-share", type=float, default=0.0,
        help="the CPU side through a host expert cache of this share of all experts (0.474: 8 GiB of the 35B "
        "file): the records it reads a decode token",
    )  # fmt: skip
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "narrow.gguf"
        synthesize(path, args.geometry, "q4_k", None, 4096, 0, hidden=256, expert_ff=256, heads=4, kv_heads=2,
                   head_dim=64)  # fmt: skip
        args.routing, args.trace_tokens = [args.routing], 2048
        table = next(iter(hb.routing_tables(args, path, 4096)[0].values()))
        print(f"{args.geometry} experts, width 256; {args.slots} slots; routing {args.routing[0]}")
        if args.bounds:
            experts = next(iter(load_weights(path).expert_layers().values())).experts
            rows.append(got := bounds(table, args.slots, experts))
            print("decode hits: " + ", ".join(f"{k} {v:.1%}" for k, v in got.items()))
            args.windows = ""
        for window in (float(v) for v in args.windows.split(",") if v):
            for margin in (float(v) for v in args.margins.split(",")):
                row = replay(path, table, args.slots, window, margin, args.admit_per_call, args.host_share)
                rows.append(row)
                host = (f"; host cache: {row['host_records_read_per_token']} records read a decode token"
                        if args.host_share else "")  # fmt: skip
                print(f"window {window:g} margin {margin:g}: decode hits {row['decode_hit_rate']:.1%}, "
                      f"{row['admissions']} admissions ({row['step_admissions']} in decode steps), "
                      f"{row['seconds']} s{host}", flush=True)  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
