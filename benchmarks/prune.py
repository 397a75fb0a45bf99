"""Expert pruning on tiny-qwen3moe: quality kept under each ranking, and bytes saved.

Profiles the bundled example on text/calib.txt, then for keep fractions 0.9, 0.75, 0.5 and rankings count,
weight, saliency (plus a seeded random choice as a baseline) masks the model and scores text/val.txt
against the unpruned model: mean KL divergence, top-1 agreement, perplexity. File sizes come from
`forge prune apply` on the bf16 and Q8_0 files (masked logits equal the pruned file's bit for bit; the
tests check it).

    python benchmarks/prune.py [--ctx 512] [--profile-chunks 8] [--eval-chunks 8]
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-qwen3moe"
TEXT = ROOT / "tests" / "fixtures" / "text"
FRACTIONS = (0.9, 0.75, 0.5)
RANKINGS = ("count", "weight", "saliency")


def random_mask(n_layers: int, n_expert: int, keep: int, seed: int = 0):  # noqa: ANN201
    from forge.mask_file import PruneMask

    rng = np.random.default_rng(seed)
    pruned = np.ones((n_layers, n_expert), dtype=bool)
    for row in pruned:
        row[rng.choice(n_expert, keep, replace=False)] = False
    return PruneMask(pruned, "random")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--profile-chunks", type=int, default=8)
    ap.add_argument("--eval-chunks", type=int, default=8)
    ap.add_argument("--text-dir", type=Path, default=TEXT)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from forge.convert import convert_checkpoint
    from forge.prune.apply import apply_mask
    from forge.prune.collect import collect_profile
    from forge.prune.mask import build_mask
    from forge.quant.quantize import quantize
    from runtime.evaluate import ReferenceLogits, evaluate, perplexity_tokens
    from runtime.models import load_model
    from runtime.tokenizer import Tokenizer

    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        bf16, q8 = tmp / "bf16.gguf", tmp / "q8_0.gguf"
        convert_checkpoint(EXAMPLE, bf16, "bf16")
        quantize(EXAMPLE, q8, "q8_0")

        t0 = time.perf_counter()
        rep = collect_profile(
            bf16, args.text_dir / "calib.txt", tmp / "profile.json", args.ctx, args.profile_chunks
        )
        prof = rep.profile
        t_profile = time.perf_counter() - t0

        model = load_model(bf16)
        tok = Tokenizer.from_metadata(model.weights)
        val = (args.text_dir / "val.txt").read_text(encoding="utf-8")
        ids = perplexity_tokens(tok, val, args.ctx, args.eval_chunks)
        bos = tok.bos_id if tok.add_bos else None
        ref_file = tmp / "ref.npz"
        base = evaluate(model, ids, args.ctx, args.eval_chunks, save_logits=ref_file, top_k=model.vocab_size,
                        bos_id=bos)  # fmt: skip
        ref = ReferenceLogits.load(ref_file)

        rows = []
        for frac in FRACTIONS:
            for by in (*RANKINGS, "random"):
                keep = int(np.floor(frac * prof.expert_count + 0.5))
                if by == "random":
                    mask = random_mask(len(prof.layers), prof.expert_count, keep)
                else:
                    mask = build_mask(prof, keep_fraction=frac, by=by)
                model.set_prune_mask(torch.from_numpy(mask.pruned.copy()))
                r = evaluate(model, ids, args.ctx, args.eval_chunks, reference_logits=ref, bos_id=bos)
                rows.append((frac, by, keep, r.kld_mean, r.kld_mean_err, r.top1_agreement, r.perplexity))
        model.set_prune_mask(None)

        sizes = {}
        for frac in FRACTIONS:
            mask = build_mask(prof, keep_fraction=frac, by="count")
            sizes[frac] = {}
            for name, src in (("bf16", bf16), ("q8_0", q8)):
                out = tmp / f"{name}-{frac}.gguf"
                a = apply_mask(src, mask, out)
                sizes[frac][name] = (a.source_bytes, a.output_bytes)
                out.unlink()

    print(
        f"machine: {platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"
    )
    print(f"profile: text/calib.txt, {rep.chunks} chunks x {args.ctx} tokens ({t_profile:.0f} s); "
          f"eval: text/val.txt, {base.chunks} chunks x {args.ctx} ({base.tokens} scored tokens); "
          f"unpruned PPL {base.perplexity:.3f}")  # fmt: skip
    print()
    print("| keep | experts/layer | ranking | mean KLD | top-1 agreement | PPL |")
    print("|---:|---:|---|---:|---:|---:|")
    for frac, by, keep, kld, err, top1, ppl in rows:
        print(f"| {frac:.2f} | {keep}/{prof.expert_count} | {by} | {kld:.4f} ± {err:.4f} | "
              f"{100 * top1:.2f}% | {ppl:.3f} |")  # fmt: skip
    print()
    print("| keep | bf16 bytes | saved | q8_0 bytes | saved |")
    print("|---:|---:|---:|---:|---:|")
    for frac in FRACTIONS:
        (b_src, b_out), (q_src, q_out) = sizes[frac]["bf16"], sizes[frac]["q8_0"]
        print(f"| {frac:.2f} | {b_out:,} | {100 * (b_src - b_out) / b_src:.1f}% | {q_out:,} | "
              f"{100 * (q_src - q_out) / q_src:.1f}% |")  # fmt: skip
    print()
    for frac in FRACTIONS:
        klds = {by: kld for f, by, _, kld, *_ in rows if f == frac and by != "random"}
        low = min(klds.values())
        print(f"keep {frac:.2f}: lowest KLD by {' = '.join(b for b, v in klds.items() if v == low)}")
    mean_kld = {by: np.mean([r[3] for r in rows if r[1] == by]) for by in RANKINGS}
    best = min(mean_kld, key=mean_kld.get)  # type: ignore[arg-type]
    print(f"best ranking over all fractions (mean KLD): {best} "
          f"({', '.join(f'{b} {v:.4f}' for b, v in mean_kld.items())})")  # fmt: skip


if __name__ == "__main__":
    main()
