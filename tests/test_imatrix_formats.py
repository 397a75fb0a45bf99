"""imatrix files: llama.cpp's GGUF and .dat, round trips, merge, bad input, model checks."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from typer.testing import CliRunner

from forge.errors import ForgeError
from forge.imatrix import Imatrix, check_matches_model, importance_for, merge, read_imatrix, write_imatrix
from forge.imatrix.cli import app
from forge.imatrix.formats import dat_entry, read_dat_imatrix, read_gguf_imatrix
from tests import oracle

MODEL = "tiny-qwen3moe"


def fixture_file(ext: str):
    return oracle.llamacpp_file(MODEL, f"{MODEL}-imatrix.{ext}")


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def weights_of(im: Imatrix, shapes: dict[str, tuple[int, int]]) -> dict[str, np.ndarray]:
    return {name: importance_for(im, name, n_per_row, n_mat) for name, (n_mat, n_per_row) in shapes.items()}


def shapes_of(im: Imatrix) -> dict[str, tuple[int, int]]:
    return {name: im.shape(name) for name in im.names()}


def random_imatrix(rng: np.random.Generator, chunk_size: int = 512, unseen: bool = True) -> Imatrix:
    """Dense and 8-expert entries with uneven counts (ncall not a power of two), some experts unseen."""
    im = Imatrix(datasets=["a.txt"], chunk_count=7, chunk_size=chunk_size)
    for layer in range(2):
        for kind, n_mat, cols in (("attn_q", 1, 64), ("ffn_down_exps", 8, 32), ("ffn_up_exps", 8, 64)):
            name = f"blk.{layer}.{kind}.weight"
            counts = rng.integers(1, 3 * max(chunk_size, 1) + 1, n_mat).astype(np.int64)
            if unseen and n_mat > 1:
                counts[rng.integers(0, n_mat)] = 0
            sums = (rng.random((n_mat, cols)) * counts[:, None]).astype(np.float32)
            sums[counts == 0] = 0
            im.sums[name], im.counts[name] = sums, counts
    im.check()
    return im


# --------------------------------------------------------------------------------- llama.cpp's files


def test_llamacpp_files_parse_and_agree():
    g = read_gguf_imatrix(fixture_file("gguf"))
    d = read_dat_imatrix(fixture_file("dat"))
    assert g.names() == d.names() and len(g.names()) > 0
    assert (g.datasets, g.chunk_count) == (d.datasets, d.chunk_count)
    assert g.chunk_size > 0 and d.chunk_size == 0
    for name in g.names():
        n_mat, n_per_row = g.shape(name)
        assert d.shape(name) == (1, n_mat * n_per_row), name
        counts = g.counts[name]
        ncall = int(d.counts[name][0])
        assert ncall == -(-int(counts.max()) // g.chunk_size), name
        # llama.cpp's relation: stored = in_sum2 / count * ncall in float32; an unseen expert stores 1 * ncall
        c = np.where(counts > 0, counts, 1).astype(np.float32)[:, None]
        expected = np.where(counts[:, None] > 0, g.sums[name], np.float32(1)) / c * np.float32(ncall)
        np.testing.assert_array_equal(bits(expected.reshape(-1)), bits(d.sums[name][0]), err_msg=name)


def test_llamacpp_gguf_has_unseen_experts_reported():
    g = read_gguf_imatrix(fixture_file("gguf"))
    unseen = {n: np.flatnonzero(g.counts[n] == 0).tolist() for n in g.names() if (g.counts[n] == 0).any()}
    assert unseen, "the fixture is expected to have experts no calibration token reached"
    out = CliRunner().invoke(app, ["show", str(fixture_file("gguf")), "--json"])
    assert out.exit_code == 0, out.output
    info = json.loads(out.output)
    shown = {t["name"]: t["unseen_experts"] for t in info["tensors"] if t["unseen_experts"]}
    assert shown == unseen
    first = info["tensors"][0]
    assert first["rows"] == int(g.counts[first["name"]].sum())


def test_writers_reproduce_llamacpp_bytes(tmp_path):
    g = read_imatrix(fixture_file("gguf"))
    write_imatrix(g, tmp_path / "ours.gguf")
    assert (tmp_path / "ours.gguf").read_bytes() == fixture_file("gguf").read_bytes()
    write_imatrix(g, tmp_path / "ours.dat", rounding="llamacpp")
    assert (tmp_path / "ours.dat").read_bytes() == fixture_file("dat").read_bytes()


def test_gguf_writer_pads_the_last_tensor_as_llamacpp_does(tmp_path):
    """tiny-qwen35moe's imatrix ends with a dense ``.counts`` tensor of 4 bytes: llama-imatrix pads it to the
    alignment, and its loaders refuse a file without that padding."""
    src = oracle.llamacpp_file("tiny-qwen35moe", "tiny-qwen35moe-imatrix.gguf")
    write_imatrix(read_imatrix(src), tmp_path / "ours.gguf")
    assert (tmp_path / "ours.gguf").read_bytes() == src.read_bytes()


def test_importance_equals_llama_quantize_view():
    g = read_imatrix(fixture_file("gguf"))
    ref = oracle.llamacpp_importance(MODEL)
    assert sorted(ref) == g.names()
    for name, w in weights_of(g, shapes_of(g)).items():
        np.testing.assert_array_equal(bits(w), bits(ref[name]), err_msg=name)
    d = read_imatrix(fixture_file("dat"))
    for name in d.names():
        w = importance_for(d, name, *reversed(g.shape(name)))
        stored_over_ncall = d.sums[name].reshape(g.shape(name)) / np.float32(d.counts[name][0])
        np.testing.assert_array_equal(bits(w), bits(stored_over_ncall), err_msg=name)


# ---------------------------------------------------------------------------------------- round trips


def test_llamacpp_dat_rounding_is_lossy_on_the_fixture():
    """Why our default .dat rounding differs from llama-imatrix's: its weights lose bits."""
    g = read_imatrix(fixture_file("gguf"))
    changed = 0
    for name in g.names():
        ncall, stored = dat_entry(g, name, "llamacpp")
        changed += int(
            (
                bits(stored / np.float32(ncall))
                != bits(importance_for(g, name, *reversed(g.shape(name))).reshape(-1))
            ).sum()
        )
    assert changed > 0


@pytest.mark.parametrize("source", ["fixture", "random"])
def test_gguf_dat_gguf_keeps_every_weight(tmp_path, source):
    g = (
        read_imatrix(fixture_file("gguf"))
        if source == "fixture"
        else random_imatrix(np.random.default_rng(1))
    )
    shapes = shapes_of(g)
    before = weights_of(g, shapes)
    write_imatrix(g, tmp_path / "a.gguf")
    write_imatrix(read_imatrix(tmp_path / "a.gguf"), tmp_path / "a.dat")
    d = read_imatrix(tmp_path / "a.dat")
    write_imatrix(d, tmp_path / "b.gguf")
    back = read_imatrix(tmp_path / "b.gguf")
    assert back.names() == g.names()
    assert back.chunk_count == g.chunk_count and back.datasets == g.datasets[-1:]
    for stage in (d, back):
        for name, w in weights_of(stage, shapes).items():
            np.testing.assert_array_equal(bits(w), bits(before[name]), err_msg=name)


@pytest.mark.parametrize("source", ["fixture", "random"])
def test_dat_gguf_dat_keeps_every_byte(tmp_path, source):
    if source == "fixture":
        dat = fixture_file("dat")
    else:
        dat = tmp_path / "src.dat"
        write_imatrix(random_imatrix(np.random.default_rng(2)), dat, rounding="llamacpp")
    d = read_imatrix(dat)
    write_imatrix(d, tmp_path / "x.gguf")
    g = read_imatrix(tmp_path / "x.gguf")
    assert g.chunk_size == 0  # marks .dat units, as llama.cpp's legacy loader does
    for name in d.names():
        n_per_row = d.shape(name)[1]
        np.testing.assert_array_equal(
            bits(importance_for(g, name, n_per_row)), bits(importance_for(d, name, n_per_row))
        )
    write_imatrix(g, tmp_path / "y.dat")
    assert (tmp_path / "y.dat").read_bytes() == dat.read_bytes()


def test_exact_rounding_uses_power_of_two_ncall():
    im = random_imatrix(np.random.default_rng(3), chunk_size=100)
    for name in im.names():
        ncall_llama, _ = dat_entry(im, name, "llamacpp")
        ncall, stored = dat_entry(im, name, "exact")
        assert ncall & (ncall - 1) == 0 and ncall <= ncall_llama < 2 * ncall
        w = importance_for(im, name, *reversed(im.shape(name))).reshape(-1)
        np.testing.assert_array_equal(bits(stored / np.float32(ncall)), bits(w))


# ---------------------------------------------------------------------------------------------- merge


def test_merge_adds_counts_and_sums(tmp_path):
    rng = np.random.default_rng(4)
    a, b = random_imatrix(rng), random_imatrix(rng)
    b.sums["blk.9.attn_k.weight"] = np.ones((1, 16), np.float32)  # only in b: kept as is
    b.counts["blk.9.attn_k.weight"] = np.array([20], np.int64)
    write_imatrix(a, tmp_path / "a.gguf")
    write_imatrix(b, tmp_path / "b.gguf")
    res = CliRunner().invoke(
        app, ["merge", str(tmp_path / "a.gguf"), str(tmp_path / "b.gguf"), "-o", str(tmp_path / "c.gguf")]
    )
    assert res.exit_code == 0, res.output
    c = read_imatrix(tmp_path / "c.gguf")
    assert c.names() == sorted(set(a.names()) | set(b.names()))
    assert c.chunk_count == a.chunk_count + b.chunk_count and c.datasets == a.datasets + b.datasets
    for name in a.names():
        np.testing.assert_array_equal(c.counts[name], a.counts[name] + b.counts[name])
        np.testing.assert_array_equal(bits(c.sums[name]), bits(a.sums[name] + b.sums[name]))
    np.testing.assert_array_equal(c.counts["blk.9.attn_k.weight"], [20])


def test_merge_refuses_mixed_units_and_shapes():
    rng = np.random.default_rng(5)
    g = random_imatrix(rng)
    legacy = random_imatrix(rng, chunk_size=0, unseen=False)
    with pytest.raises(ForgeError, match=r"\.dat"):
        merge([g, legacy])
    other = random_imatrix(rng)
    other.sums["blk.0.attn_q.weight"] = np.zeros((1, 32), np.float32)
    with pytest.raises(ForgeError, match="blk.0.attn_q.weight"):
        merge([g, other])


def test_convert_cli_both_ways(tmp_path):
    g = read_imatrix(fixture_file("gguf"))
    r = CliRunner().invoke(app, ["convert", str(fixture_file("gguf")), "-o", str(tmp_path / "c.dat")])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["convert", str(tmp_path / "c.dat"), "-o", str(tmp_path / "c.gguf")])
    assert r.exit_code == 0, r.output
    back = read_imatrix(tmp_path / "c.gguf")
    for name in g.names():
        n_mat, n_per_row = g.shape(name)
        np.testing.assert_array_equal(bits(importance_for(back, name, n_per_row, n_mat)),
                                      bits(importance_for(g, name, n_per_row, n_mat)))  # fmt: skip


# ------------------------------------------------------------------------------------------ bad input


def _truncations(size: int) -> list[int]:
    return sorted({2, 10, size // 3, size // 2, size - 3, size - 1})


@pytest.mark.parametrize("ext", ["gguf", "dat"])
def test_truncated_files_are_refused(tmp_path, ext):
    if ext == "gguf":
        src = tmp_path / "full.gguf"
        write_imatrix(random_imatrix(np.random.default_rng(6)), src)
    else:
        src = tmp_path / "full.dat"
        write_imatrix(random_imatrix(np.random.default_rng(6)), src)
    data = src.read_bytes()
    for cut in _truncations(len(data)):
        bad = tmp_path / f"cut{cut}.{ext}"
        bad.write_bytes(data[:cut])
        with pytest.raises(ForgeError, match="truncated|not a GGUF|malformed|not an imatrix"):
            read_imatrix(bad)


def test_garbage_and_model_files_are_refused(tmp_path, example_bf16):
    junk = tmp_path / "junk.dat"
    junk.write_bytes(b"\x05\x00\x00\x00" + b"\xff" * 40)
    with pytest.raises(ForgeError):
        read_imatrix(junk)
    trailing = tmp_path / "trailing.dat"
    write_imatrix(random_imatrix(np.random.default_rng(7)), trailing)
    trailing.write_bytes(trailing.read_bytes() + b"xx")
    with pytest.raises(ForgeError, match="unexpected bytes"):
        read_imatrix(trailing)
    with pytest.raises(ForgeError, match="not an imatrix|missing imatrix metadata"):
        read_imatrix(example_bf16)


def model_shapes() -> dict[str, tuple[int, int]]:
    """The bf16 model's matmul weights as (n_mat, n_per_row), from llama.cpp's manifest."""
    out = {}
    for t in oracle.manifest(MODEL, "bf16")["tensors"]:
        shape = t["shape"]  # manifest shapes are ggml ne order
        out[t["name"]] = (shape[2] if len(shape) == 3 else 1, shape[0])
    return out


def test_model_check_accepts_the_right_model_and_names_the_first_mismatch():
    g = read_imatrix(fixture_file("gguf"))
    shapes = model_shapes()
    check_matches_model(g, shapes)
    wrong = dict(shapes)
    del wrong["blk.1.attn_q.weight"]
    wrong["blk.3.ffn_down_exps.weight"] = (32, 128)
    with pytest.raises(ForgeError, match=r"blk\.1\.attn_q\.weight is not in the model"):
        check_matches_model(g, wrong)
    wrong["blk.1.attn_q.weight"] = shapes["blk.1.attn_q.weight"]
    with pytest.raises(ForgeError, match=r"blk\.3\.ffn_down_exps\.weight.*32 x 128"):
        check_matches_model(g, wrong)
    with pytest.raises(ForgeError, match=r"blk\.0\.ffn_up_exps\.weight"):
        importance_for(g, "blk.0.ffn_up_exps.weight", 512, 32)


def test_manifest_shape_convention():
    shapes = model_shapes()
    g = read_imatrix(fixture_file("gguf"))
    assert shapes["blk.0.ffn_down_exps.weight"] == g.shape("blk.0.ffn_down_exps.weight")


# ------------------------------------------------------------------------------------- unseen experts


def test_unseen_expert_policies(caplog):
    g = read_imatrix(fixture_file("gguf"))
    name = next(n for n in g.names() if (g.counts[n] == 0).any())
    n_mat, n_per_row = g.shape(name)
    seen = g.counts[name] > 0
    with caplog.at_level(logging.WARNING, logger="forge.imatrix.importance"):
        ones = importance_for(g, name, n_per_row, n_mat)
    assert name in caplog.text and "no imatrix data" in caplog.text
    assert (ones[~seen] == 1).all()
    mean = importance_for(g, name, n_per_row, n_mat, unseen="mean")
    np.testing.assert_array_equal(bits(mean[seen]), bits(ones[seen]))
    expected = (g.sums[name][seen] / g.counts[name][seen, None].astype(np.float32)).astype(np.float64).mean(0)
    np.testing.assert_array_equal(
        bits(mean[~seen]), bits(np.broadcast_to(expected.astype(np.float32), mean[~seen].shape))
    )
    with pytest.raises(ForgeError, match="policy"):
        importance_for(g, name, n_per_row, n_mat, unseen="zero")  # type: ignore[arg-type]
    assert importance_for(g, "token_embd.weight", 256) is None
