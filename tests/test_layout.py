"""Expert-major layouts v1/v2: byte-identical round trips, reader API, inspect, interrupted writes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from typer.testing import CliRunner

from forge.errors import ForgeError
from forge.layout.cli import app
from forge.layout.convert import PAUSE_ENV, convert
from forge.layout.gguf_raw import open_gguf
from forge.layout.reader import is_expert_major, open_expert_store
from forge.layout.source import sorted_rule_order
from forge.layout.verify import verify_files
from tests import oracle

Q = GGMLQuantizationType
ROLES = ("gate", "up", "down")
FIXTURES = [
    ("tiny-qwen3moe", "tiny-qwen3moe-Q8_0.gguf"),
    ("tiny-qwen3moe", "tiny-qwen3moe-Q4_K_M-imat.gguf"),
    ("tiny-qwen3moe", "tiny-qwen3moe-IQ2_XXS-imat.gguf"),
    ("tiny-qwen35moe", "tiny-qwen35moe-Q4_K_M-imat.gguf"),
    ("tiny-qwen35moe", "tiny-qwen35moe-IQ2_XXS-imat.gguf"),
]


def quant_bytes(rng: np.random.Generator, ggml_type: Q, dims: tuple[int, ...]) -> np.ndarray:
    """Random bytes shaped like a GGML tensor of ``dims`` (GGUF order), in numpy order."""
    block, size = GGML_QUANT_SIZES[ggml_type]
    shape = (*reversed(dims[1:]), dims[0] // block * size)
    return rng.integers(0, 256, size=shape, dtype=np.uint8)


def write_moe_gguf(
    path: Path,
    arch: str,
    layer_types: list[tuple[Q, Q, Q]],
    n_embd: int,
    n_ff: int,
    experts: int,
    used: int = 2,
    routed_first: bool = False,
    seed: int = 0,
) -> Path:
    """A canonical MoE GGUF written by gguf-py's GGUFWriter: a few non-routed tensors per block and
    the three routed tensors of each layer. ``routed_first``: convert_hf_to_gguf-like order (down,
    gate, up at the block's start) instead of llama-quantize's name-sorted blocks."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(path, arch)
    w.add_uint32(f"{arch}.block_count", len(layer_types))
    w.add_uint32(f"{arch}.expert_count", experts)
    w.add_uint32(f"{arch}.expert_used_count", used)
    w.add_uint32(f"{arch}.embedding_length", n_embd)
    w.add_string("general.name", f"synthetic {arch}")
    w.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])
    w.add_tensor("token_embd.weight", quant_bytes(rng, Q.Q8_0, (n_embd, 64)), raw_dtype=Q.Q8_0)
    for layer, types in enumerate(layer_types):
        dims = {
            "gate": (n_embd, n_ff, experts),
            "up": (n_embd, n_ff, experts),
            "down": (n_ff, n_embd, experts),
        }
        routed = {
            f"blk.{layer}.ffn_{role}_exps.weight": (types[i], dims[role]) for i, role in enumerate(ROLES)
        }
        other = {
            f"blk.{layer}.attn_norm.weight": (Q.F32, (n_embd,)),
            f"blk.{layer}.ffn_gate_inp.weight": (Q.F32, (n_embd, experts)),
            f"blk.{layer}.ffn_norm.weight": (Q.F32, (n_embd,)),
        }
        if routed_first:
            names = [f"blk.{layer}.ffn_{r}_exps.weight" for r in ("down", "gate", "up")] + list(other)
        else:
            names = sorted([*routed, *other])
        for name in names:
            ggml_type, d = routed.get(name) or other[name]
            if ggml_type == Q.F32:
                w.add_tensor(name, rng.standard_normal(tuple(reversed(d))).astype(np.float32))
            else:
                data = quant_bytes(rng, ggml_type, d)
                w.add_tensor(name, data, raw_dtype=ggml_type)
    w.add_tensor("output_norm.weight", rng.standard_normal(n_embd).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def mixed_qwen3moe(path: Path, routed_first: bool = True) -> Path:
    """Mixed precision: one boosted layer, one layer whose gate and up differ in type."""
    types = [(Q.Q4_K, Q.Q4_K, Q.Q6_K), (Q.Q8_0, Q.Q8_0, Q.Q8_0), (Q.IQ2_XXS, Q.IQ3_S, Q.Q2_K)]
    return write_moe_gguf(path, "qwen3moe", types, n_embd=256, n_ff=512, experts=8, routed_first=routed_first)


def deepseek4(path: Path) -> Path:
    """ds4's main target at toy size: IQ2_XXS gate/up, Q2_K down, 256 x 512 x 8 experts."""
    types = [(Q.IQ2_XXS, Q.IQ2_XXS, Q.Q2_K)] * 3
    return write_moe_gguf(path, "deepseek4", types, n_embd=256, n_ff=512, experts=8, used=2)


def round_trip(src: Path, tmp: Path, version: str) -> Path:
    native = tmp / f"native-{version}.gguf"
    back = tmp / f"back-{version}.gguf"
    convert(src, native, version)
    convert(native, back, "canonical")
    assert back.read_bytes() == src.read_bytes()
    return native


def fixture_path(model: str, name: str) -> Path:
    path = oracle.llamacpp_dir(model) / name
    if not path.exists():
        pytest.skip(f"{path} is absent")
    return path


@pytest.mark.parametrize("version", ["v2", "v1"])
@pytest.mark.parametrize(("model", "name"), FIXTURES)
def test_llamacpp_fixture_round_trip_is_byte_identical(
    tmp_path: Path, model: str, name: str, version: str
) -> None:
    src = fixture_path(model, name)
    native = round_trip(src, tmp_path, version)
    assert is_expert_major(native) and not is_expert_major(src)
    with open_gguf(src) as s, open_gguf(native) as n:
        assert bytes(n.kv_block) == bytes(s.kv_block) and n.n_kv == s.n_kv
        assert n.tensors[-1].name == f"ds4.expert_major.{version}" and n.tensors[-1].ggml_type == 24
        assert not any("_exps." in t.name for t in n.tensors)
        kept = [t.name for t in s.tensors if "_exps." not in t.name]
        assert [t.name for t in n.tensors[:-1]] == kept
        if version == "v1":
            assert (n.data_start + n.tensors[-1].offset) % 4096 == 0
    with open_expert_store(native) as store:
        # llama-quantize writes name-sorted blocks: v2 derives the order, reserved bytes stay zero.
        assert all(lr.source_index is None for lr in store.layers.values()) == (version == "v2")


def _check_reader_against_source(src: Path, native: Path) -> None:
    with open_gguf(src) as raw, open_expert_store(native) as store:
        by_name = raw.by_name()
        assert sorted(store.layers) == list(range(len(store.layers)))
        for layer, lr in store.layers.items():
            for name, ggml_type, dims in store.routed_tensors()[3 * layer : 3 * layer + 3]:
                t = by_name[name]
                assert (t.ggml_type, t.dims) == (ggml_type, dims)
            for e in (0, lr.experts // 2, lr.experts - 1):
                parts = store.expert(layer, e)
                offset, n = store.record_span(layer, e)
                record = raw_file_bytes(native, offset, n)
                assert record == b"".join(bytes(p) for p in parts)
                for role, part in enumerate(parts):
                    t = by_name[f"blk.{layer}.ffn_{ROLES[role]}_exps.weight"]
                    per = t.nbytes // lr.experts
                    assert bytes(part) == bytes(raw.tensor_view(t)[e * per : (e + 1) * per])
            del parts


def raw_file_bytes(path: Path, offset: int, n: int) -> bytes:
    with open(path, "rb") as f:
        return os.pread(f.fileno(), n, offset)


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_mixed_precision_round_trip_and_reader(tmp_path: Path, version: str) -> None:
    src = mixed_qwen3moe(tmp_path / "mixed.gguf")
    native = round_trip(src, tmp_path, version)
    with open_expert_store(native) as store:
        types = {layer: tuple(c.ggml_type for c in lr.components) for layer, lr in store.layers.items()}
        assert types == {0: (Q.Q4_K, Q.Q4_K, Q.Q6_K), 1: (Q.Q8_0,) * 3, 2: (Q.IQ2_XXS, Q.IQ3_S, Q.Q2_K)}
        # routed tensors first in each block is not llama-quantize's order: positions are recorded
        assert all(lr.source_index is not None for lr in store.layers.values())
    _check_reader_against_source(src, native)


def test_sorted_block_order_is_derived_without_recording(tmp_path: Path) -> None:
    src = mixed_qwen3moe(tmp_path / "sorted.gguf", routed_first=False)
    native = round_trip(src, tmp_path, "v2")
    with open_expert_store(native) as store:
        assert all(lr.source_index is None for lr in store.layers.values())


def test_sorted_rule_order_places_tail_before_next_block_head() -> None:
    kept = ["tok", "blk.0.a", "blk.0.m", "blk.1.ffn_norm", "out"]
    routed = {0: ["blk.0.b", "blk.0.z"], 1: ["blk.1.aa"]}
    assert sorted_rule_order(kept, routed) == [
        "tok", "blk.0.a", "blk.0.b", "blk.0.m", "blk.0.z", "blk.1.aa", "blk.1.ffn_norm", "out",
    ]  # fmt: skip
    assert sorted_rule_order(["tok"], {0: ["blk.0.x"]}) is None


def test_deepseek4_family_round_trip(tmp_path: Path) -> None:
    src = deepseek4(tmp_path / "ds4.gguf")
    native = round_trip(src, tmp_path, "v2")
    with open_expert_store(native) as store:
        assert store.family_name == "deepseek4" and store.header.family == 1
        lr = store.layers[0]
        assert [c.ggml_type for c in lr.components] == [Q.IQ2_XXS, Q.IQ2_XXS, Q.Q2_K]
        assert [c.dims for c in lr.components] == [(256, 512, 8), (256, 512, 8), (512, 256, 8)]
        assert lr.record_bytes == 2 * 512 * 66 + 256 * 2 * 84
    _check_reader_against_source(src, native)
    with pytest.raises(ForgeError, match="v1 supports qwen35moe and qwen3moe only"):
        convert(src, tmp_path / "ds4-v1.gguf", "v1")


def test_inspect_json(tmp_path: Path) -> None:
    src = mixed_qwen3moe(tmp_path / "mixed.gguf")
    native = tmp_path / "native.gguf"
    convert(src, native, "v2")
    result = CliRunner().invoke(app, ["inspect", str(native), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert (info["family"], info["layers"], info["experts"]) == ("qwen3moe", 3, 8)
    with open_gguf(src) as raw:
        per_layer = {
            str(layer): sum(raw.by_name()[f"blk.{layer}.ffn_{r}_exps.weight"].nbytes for r in ROLES) // 8
            for layer in range(3)
        }
        routed = sum(t.nbytes for t in raw.tensors if "_exps." in t.name)
    assert info["record_bytes"] == per_layer
    with open_gguf(native) as raw:
        assert info["store_bytes"] == raw.tensors[-1].nbytes
    assert info["overhead_bytes"] == info["store_bytes"] - routed > 0
    canonical = json.loads(CliRunner().invoke(app, ["inspect", str(src), "--json"]).output)
    assert canonical["planned"]["v2"]["file_bytes"] == native.stat().st_size


def test_verify_cli_and_one_line_errors(tmp_path: Path) -> None:
    src = mixed_qwen3moe(tmp_path / "mixed.gguf")
    native = tmp_path / "native.gguf"
    runner = CliRunner()
    result = runner.invoke(app, ["convert", str(src), "-o", str(native), "--to", "v1"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["verify", str(src), str(native)])
    assert result.exit_code == 0 and "valid expert-major v1" in result.output
    # A wrong pairing is a ForgeError naming the problem, not a traceback.
    other = write_moe_gguf(tmp_path / "other.gguf", "qwen3moe", [(Q.Q8_0,) * 3] * 3, 256, 512, 8, seed=1)
    with pytest.raises(ForgeError):
        verify_files(other, native)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "forge.layout.cli",
            "convert",
            str(native),
            "-o",
            str(tmp_path / "x.gguf"),
            "--to",
            "v2",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().startswith("error:") and len(proc.stderr.strip().splitlines()) == 1


def test_killed_conversion_leaves_nothing(tmp_path: Path) -> None:
    src = mixed_qwen3moe(tmp_path / "mixed.gguf")
    before = sorted(os.listdir(tmp_path))
    dest = tmp_path / "native.gguf"
    env = {**os.environ, PAUSE_ENV: "30"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "forge.layout.cli", "convert", str(src), "-o", str(dest), "--to", "v2"],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = proc.stderr.readline()  # the hook reports after layer 0's records are written
        assert "wrote layer 0" in line, line
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert sorted(os.listdir(tmp_path)) == before
    assert not dest.exists()


def test_refuses_source_whose_inverse_would_differ(tmp_path: Path) -> None:
    src = mixed_qwen3moe(tmp_path / "mixed.gguf")
    with open_gguf(src) as raw:
        gap = (raw.dir_end, raw.data_start)
    assert gap[1] > gap[0]  # GGUFWriter pads the directory to the alignment
    data = bytearray(src.read_bytes())
    data[gap[1] - 1] = 0xFF
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ForgeError, match="non-zero padding"):
        convert(bad, tmp_path / "native.gguf", "v2")
    assert not (tmp_path / "native.gguf").exists()
