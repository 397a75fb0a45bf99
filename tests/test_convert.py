"""forge convert: bit-exact with llama.cpp's converter, lossless, transactional, clear errors."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import EXAMPLE
from oracle import MODELS, manifest, model_dir
from safetensors.torch import load_file

import forge.gguf_file
from forge.bulk import bf16_to_f32
from forge.convert import convert_checkpoint
from forge.errors import ForgeError
from forge.gguf_file import open_gguf


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def _manifest_of(path: Path) -> list[dict]:
    r = open_gguf(path)
    return [
        {"name": t.name, "type": t.ggml_type.name, "shape": list(reversed(t.shape)), "nbytes": t.nbytes,
         "sha256": _sha(r.raw(t.name))}
        for t in r.tensors.values()
    ]  # fmt: skip


def _kv_as_manifest(value: object) -> object:
    if isinstance(value, list):
        if value and isinstance(value[0], str):
            raw = b"".join(v.encode() for v in value)
        else:
            raw = np.asarray(value, dtype=np.int32).tobytes()
        return {"array_len": len(value), "sha256": hashlib.sha256(raw).hexdigest()}
    return value


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("outtype", ["bf16", "f32"])
def test_matches_llamacpp_converter(model: str, outtype: str, tmp_path: Path) -> None:
    ref = manifest(model, outtype)
    out = tmp_path / f"{model}.gguf"
    convert_checkpoint(model_dir(model), out, outtype, mtp=False)
    assert _manifest_of(out) == ref["tensors"]
    kvs = {k: _kv_as_manifest(kv.value) for k, kv in open_gguf(out).kvs.items()}
    for key, value in ref["kv"].items():
        if key == "general.name":
            continue  # derived from the folder name; allowed to differ
        assert key in kvs, key
        if isinstance(value, float):
            assert kvs[key] == pytest.approx(value, rel=1e-7), key
        else:
            assert kvs[key] == value, key
    assert list(kvs) == list(ref["kv"])  # same keys, same order


def test_round_trip_equals_safetensors(example_bf16: Path) -> None:
    r = open_gguf(example_bf16)
    hf: dict[str, np.ndarray] = {}
    for shard in sorted(EXAMPLE.glob("*.safetensors")):
        hf.update({k: v.float().numpy() for k, v in load_file(shard).items()})
    n_expert = 32
    for name, info in r.tensors.items():
        got = r.array(name)
        got = bf16_to_f32(got) if info.ggml_type.name == "BF16" else got.astype(np.float32)
        if "_exps." in name:
            layer, proj = name.split(".")[1], name.split(".")[2].removeprefix("ffn_").removesuffix("_exps")
            want = np.stack(
                [hf[f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"] for e in range(n_expert)]
            )
        else:
            want = hf[_hf_name(name)]
        np.testing.assert_array_equal(got, want, err_msg=name)


def _hf_name(gguf_name: str) -> str:
    table = {"token_embd": "model.embed_tokens", "output": "lm_head", "output_norm": "model.norm",
             "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "ffn_gate_inp": "mlp.gate"}  # fmt: skip
    parts = gguf_name.split(".")
    if parts[0] != "blk":
        return table[parts[0]] + ".weight"
    return f"model.layers.{parts[1]}.{table[parts[2]]}.weight"


def test_split_output_has_the_same_tensors(tmp_path: Path, example_bf16: Path) -> None:
    paths = convert_checkpoint(EXAMPLE, tmp_path / "m.gguf", "bf16", split_max_size=20 << 20).paths
    assert [p.name for p in paths] == [
        f"m-{i:05d}-of-{len(paths):05d}.gguf" for i in range(1, len(paths) + 1)
    ]
    assert len(paths) >= 3
    whole = open_gguf(example_bf16)
    seen = []
    for i, p in enumerate(paths):
        part = open_gguf(p)
        assert part.kv("split.no") == i and part.kv("split.count") == len(paths)
        for name in part.tensors:
            assert np.array_equal(part.raw(name), whole.raw(name))
            seen.append(name)
    assert seen == list(whole.tensors)
    assert open_gguf(paths[0]).kv("tokenizer.ggml.pre") == "qwen2"


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_failure_midway_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dest = tmp_path / "out.gguf"
    dest.write_bytes(b"previous contents")
    calls = {"n": 0}
    real = forge.gguf_file._write_tensor_bytes

    def failing(f, spec, data):  # noqa: ANN001, ANN202
        calls["n"] += 1
        if calls["n"] == 10:
            raise RuntimeError("injected failure")
        return real(f, spec, data)

    monkeypatch.setattr(forge.gguf_file, "_write_tensor_bytes", failing)
    with pytest.raises(RuntimeError, match="injected"):
        convert_checkpoint(EXAMPLE, dest, "bf16")
    assert dest.read_bytes() == b"previous contents"
    assert _leftovers(tmp_path) == ["out.gguf"]


_SLOW_CONVERT = """
import sys, time
import forge.gguf_file as g
real = g._write_tensor_bytes
def slow(f, spec, data):
    time.sleep(0.2)
    return real(f, spec, data)
g._write_tensor_bytes = slow
sys.argv = ["forge", "convert", sys.argv[1], "-o", sys.argv[2]]
from forge.cli import main
main()
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_conversion_leaves_nothing(tmp_path: Path, sig: int) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_CONVERT, str(EXAMPLE), str(out_dir / "m.gguf")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    time.sleep(4.0)  # well into the tensor loop (51 tensors x 0.2 s)
    assert proc.poll() is None, proc.stderr.read().decode()
    os.kill(proc.pid, sig)
    proc.wait(timeout=30)
    assert _leftovers(out_dir) == []


def _forge(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "forge", *args], capture_output=True, text=True, timeout=120)


def _assert_one_line_error(proc: subprocess.CompletedProcess[str], needle: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    assert needle in lines[0]


def test_bad_inputs_give_one_clear_line(tmp_path: Path, example_copy: Path) -> None:
    out = str(tmp_path / "o.gguf")
    _assert_one_line_error(_forge("convert", str(tmp_path / "missing"), "-o", out), "no such folder")
    (tmp_path / "empty").mkdir()
    _assert_one_line_error(_forge("convert", str(tmp_path / "empty"), "-o", out), "missing config.json")
    _assert_one_line_error(
        _forge("convert", str(example_copy), "-o", str(tmp_path / "nope" / "o.gguf")), "does not exist"
    )

    cfg = json.loads((example_copy / "config.json").read_text())
    (example_copy / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    proc = _forge("convert", str(example_copy), "-o", out)
    _assert_one_line_error(proc, "unsupported model_type 'llama'")
    assert "qwen3_moe" in proc.stderr and "qwen3_5_moe" in proc.stderr
    (example_copy / "config.json").write_text(json.dumps(cfg))

    shard = example_copy / "model-00003-of-00005.safetensors"
    data = shard.read_bytes()
    shard.unlink()
    shard.write_bytes(data[: len(data) // 2])
    _assert_one_line_error(_forge("convert", str(example_copy), "-o", out), "truncated")
    shard.unlink()
    _assert_one_line_error(_forge("convert", str(example_copy), "-o", out), "listed in the index but absent")
    assert not Path(out).exists()


def test_inspect_rejects_bad_files(tmp_path: Path, example_bf16: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello, not a model")
    _assert_one_line_error(_forge("inspect", str(text)), "not a GGUF file")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(example_bf16.read_bytes()[: 3 << 20])
    _assert_one_line_error(_forge("inspect", str(cut)), "truncated")


def test_inspect_json(example_bf16: Path) -> None:
    proc = _forge("inspect", str(example_bf16), "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["architecture"] == "qwen3moe"
    assert info["tensor_count"] == 51
    assert info["hyperparameters"]["expert_count"] == 32
    assert info["by_type"]["BF16"]["tensors"] == 30
    assert info["parameters"] == 28_084_992
    assert 16.0 < info["bits_per_weight"] < 16.1


def test_unsupported_outtype(tmp_path: Path) -> None:
    with pytest.raises(ForgeError, match="unsupported --outtype"):
        convert_checkpoint(EXAMPLE, tmp_path / "x.gguf", "q4")
