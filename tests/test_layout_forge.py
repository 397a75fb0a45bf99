"""Expert-major round trips of forge's own builds, including a mixed-precision (boosted) one."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import EXAMPLE

from forge.gguf_file import open_gguf
from forge.layout import convert, is_expert_major, verify_files
from forge.quant.quantize import quantize


@pytest.fixture(scope="module")
def boosted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("layout-forge")
    base = work / "base.gguf"
    quantize(EXAMPLE, base, "q4_0")
    out = work / "boosted.gguf"
    quantize(EXAMPLE, out, "q4_0", tensor_types=["blk\\.2\\.ffn_.*_exps=q8_0"], reuse=[base])
    return out


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_forge_mixed_precision_round_trip(boosted: Path, tmp_path: Path, version: str) -> None:
    types = {n: t.ggml_type.name for n, t in open_gguf(boosted).tensors.items() if "_exps" in n}
    assert types["blk.2.ffn_up_exps.weight"] == "Q8_0" and types["blk.1.ffn_up_exps.weight"] == "Q4_0"
    em, back = tmp_path / f"em-{version}.gguf", tmp_path / "back.gguf"
    convert(boosted, em, version)
    assert is_expert_major(em)
    verify_files(boosted, em)
    convert(em, back, "canonical")
    assert back.read_bytes() == boosted.read_bytes()
