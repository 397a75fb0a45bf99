"""imatrix collection from a GGUF model (tokenizer from its metadata) equals collection from the HF folder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from conftest import EXAMPLE

from forge.imatrix.accumulate import collect
from forge.imatrix.formats import read_imatrix

TEXT = EXAMPLE.parent / "tiny-qwen3moe-val-excerpt.txt"


def test_collect_from_gguf_equals_hf_folder(example_bf16: Path, tmp_path: Path) -> None:
    collect(example_bf16, TEXT, tmp_path / "gguf.gguf", ctx=128, chunks=2, log=None)
    collect(EXAMPLE, TEXT, tmp_path / "hf.gguf", ctx=128, chunks=2, log=None)
    a, b = read_imatrix(tmp_path / "gguf.gguf"), read_imatrix(tmp_path / "hf.gguf")
    assert a.names() == b.names() and len(a.names()) == 4 * 8
    for name in a.names():
        np.testing.assert_array_equal(a.counts[name], b.counts[name])
        np.testing.assert_allclose(a.sums[name], b.sums[name], rtol=1e-5, atol=1e-6)
    assert a.counts["blk.0.attn_q.weight"][0] == 2 * 128
