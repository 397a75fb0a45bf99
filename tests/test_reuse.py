"""Incremental builds: exactly the changed tensors regenerate; the result equals a from-scratch build."""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from conftest import EXAMPLE
from oracle import llamacpp_file

from forge.errors import ForgeError
from forge.gguf_file import open_gguf
from forge.imatrix.formats import read_imatrix, write_imatrix
from forge.quant.quantize import quantize
from forge.quant.reuse import FNV_BASIS, fnv1a64
from forge.quant.types import get_type

BOOST = "blk\\.1\\.ffn_.*_exps=q4_0"


def _actions(report) -> dict[str, str]:  # noqa: ANN001
    return {r["name"]: r["reason"] for r in report.tensors if r["action"] == "encoded"}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reuse") / "base.gguf"
    quantize(EXAMPLE, out, "q8_0")
    return out


def test_fnv1a64_uses_ds4_basis() -> None:
    assert fnv1a64(b"") == FNV_BASIS == 0x14650FB0739D0383
    # one step by hand: (basis ^ byte) * prime mod 2^64
    assert fnv1a64(b"a") == ((FNV_BASIS ^ 0x61) * 0x100000001B3) % (1 << 64)


def test_fnv1a64_compiled_equals_the_byte_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled hash and the plain loop agree on bytes of every value, chained over chunks."""
    data = [bytes(range(256)) * 3, b"", np.random.default_rng(0).integers(0, 256, 4099, np.uint8).tobytes()]
    compiled = fnv1a64(data)
    monkeypatch.setenv("FORGE_NO_NUMBA", "1")
    assert compiled == fnv1a64(data) == fnv1a64(b"".join(data))
    assert compiled != fnv1a64(data[::-1])


def test_boost_regenerates_only_changed_tensors(base: Path, tmp_path: Path) -> None:
    _, rep = quantize(EXAMPLE, tmp_path / "boost.gguf", "q8_0", tensor_types=[BOOST], reuse=[base])
    assert _actions(rep) == {
        f"blk.1.ffn_{p}_exps.weight": "new type (Q8_0 -> Q4_0)" for p in ("down", "gate", "up")
    }
    quantize(EXAMPLE, tmp_path / "scratch.gguf", "q8_0", tensor_types=[BOOST])
    assert (tmp_path / "boost.gguf").read_bytes() == (tmp_path / "scratch.gguf").read_bytes()


def test_no_change_copies_everything(base: Path, tmp_path: Path) -> None:
    _, rep = quantize(EXAMPLE, tmp_path / "same.gguf", "q8_0", reuse=[base.parent])  # a folder of priors
    assert _actions(rep) == {}
    assert (tmp_path / "same.gguf").read_bytes() == base.read_bytes()


def test_new_imatrix_rows_regenerate_only_that_layer(tmp_path: Path) -> None:
    im = read_imatrix(llamacpp_file("tiny-qwen3moe", "tiny-qwen3moe-imatrix.gguf"))
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_imatrix(im, a)
    for proj in ("gate", "up", "down"):
        im.sums[f"blk.2.ffn_{proj}_exps.weight"][3] *= np.float32(1.5)
    write_imatrix(im, b)
    over = ["ffn_.*_exps=q4_0"]  # Q4_0 reads importance weights; everything else stays Q8_0
    quantize(EXAMPLE, tmp_path / "ra.gguf", "q8_0", imatrix=a, tensor_types=over)
    _, rep = quantize(
        EXAMPLE, tmp_path / "rb.gguf", "q8_0", imatrix=b, tensor_types=over, reuse=[tmp_path / "ra.gguf"]
    )
    assert _actions(rep) == {
        f"blk.2.ffn_{p}_exps.weight": "imatrix rows changed" for p in ("down", "gate", "up")
    }
    quantize(EXAMPLE, tmp_path / "scratch.gguf", "q8_0", imatrix=b, tensor_types=over)
    assert (tmp_path / "rb.gguf").read_bytes() == (tmp_path / "scratch.gguf").read_bytes()


def _edit_tensor_keep_mtime(folder: Path, name: str) -> None:
    """Change a tensor's bytes in place in its shard, keeping size and mtime (ds4's blind spot)."""
    from forge.checkpoint import Checkpoint

    t = Checkpoint(folder).tensors[name]
    st = t.shard.stat()
    with open(t.shard, "r+b") as f:
        f.seek(t.offset)
        first = struct.unpack("<H", f.read(2))[0]
        f.seek(t.offset)
        f.write(struct.pack("<H", first ^ 0x0100))
    os.utime(t.shard, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_source_edit_with_mtime_restored_is_detected(tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(EXAMPLE, model)
    quantize(model, tmp_path / "prior.gguf", "q8_0")
    quantize(model, tmp_path / "prior-mtime.gguf", "q8_0", trust_mtime=True)
    _edit_tensor_keep_mtime(model, "model.layers.0.self_attn.q_proj.weight")
    _, rep = quantize(model, tmp_path / "next.gguf", "q8_0", reuse=[tmp_path / "prior.gguf"])
    assert _actions(rep) == {"blk.0.attn_q.weight": "source changed"}
    # --trust-mtime trades this safety for speed: the edit goes unseen, as documented
    _, rep = quantize(
        model, tmp_path / "next-mtime.gguf", "q8_0", trust_mtime=True, reuse=[tmp_path / "prior-mtime.gguf"]
    )
    assert _actions(rep) == {}


def test_encoder_version_bump_regenerates_that_type_only(
    base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    quantize(EXAMPLE, tmp_path / "mixed.gguf", "q8_0", tensor_types=[BOOST])
    monkeypatch.setattr(get_type("q4_0"), "version", get_type("q4_0").version + 1)
    _, rep = quantize(
        EXAMPLE, tmp_path / "again.gguf", "q8_0", tensor_types=[BOOST], reuse=[tmp_path / "mixed.gguf"]
    )
    assert set(_actions(rep)) == {f"blk.1.ffn_{p}_exps.weight" for p in ("down", "gate", "up")}
    assert all(r.startswith("encoder version") for r in _actions(rep).values())


def test_corrupt_prior_is_detected_and_regenerated(base: Path, tmp_path: Path) -> None:
    prior = tmp_path / "prior.gguf"
    shutil.copy(base, prior)
    info = open_gguf(prior).tensors["blk.3.attn_v.weight"]
    with open(prior, "r+b") as f:
        f.seek(info.offset + 100)
        byte = f.read(1)[0]
        f.seek(info.offset + 100)
        f.write(bytes([byte ^ 0xFF]))
    _, rep = quantize(EXAMPLE, tmp_path / "out.gguf", "q8_0", reuse=[prior])
    assert list(_actions(rep)) == ["blk.3.attn_v.weight"]
    assert "digest check" in _actions(rep)["blk.3.attn_v.weight"]
    assert (tmp_path / "out.gguf").read_bytes() == base.read_bytes()


def test_reuse_must_not_be_the_output(base: Path, tmp_path: Path) -> None:
    with pytest.raises(ForgeError, match="is the output file itself"):
        quantize(EXAMPLE, base, "q8_0", reuse=[base])
    link = tmp_path / "link.gguf"
    os.link(base, link)
    with pytest.raises(ForgeError, match="is the output file itself"):
        quantize(EXAMPLE, link, "q8_0", reuse=[base])


def test_unusable_priors_warn_and_build_fully(base: Path, tmp_path: Path, example_bf16: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(base.read_bytes()[: 1 << 20])
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    warnings: list[str] = []
    _, rep = quantize(
        EXAMPLE, tmp_path / "out.gguf", "q8_0", reuse=[cut, text, example_bf16], warn=warnings.append
    )
    assert len(warnings) == 3
    assert any("truncated" in w for w in warnings) and any("no forge reuse keys" in w for w in warnings)
    assert all(r["action"] == "encoded" or r["reason"].startswith("not quantized") for r in rep.tensors)
    assert (tmp_path / "out.gguf").read_bytes() == base.read_bytes()


def test_file_level_keys(base: Path, tmp_path: Path) -> None:
    r = open_gguf(base)
    key, weights = r.kv("quantize.reuse_key"), r.kv("quantize.reuse_key_weights")
    assert len(key) == 16 and int(key, 16) >= 0
    assert key == weights  # no imatrix: both keys are equal, as in ds4
    assert len(r.kv("forge.reuse.keys")) == len(r.tensors) == len(r.kv("forge.reuse.digests"))
