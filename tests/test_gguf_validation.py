"""Both GGUF readers refuse damaged files at open time, and the runtime refuses NaN/inf logits.

Small GGUFs are written in code with forge's writer, then damaged field by field (a misaligned, an
out-of-file and an overlapping offset, truncations in every section, a bad type id, bad shapes, absurd
counts) or replaced by an empty file, a 10-byte "GGUF", a text file or a folder. Each must be refused
by ``GGUFFile`` (toolkit + runtime) and ``RawGGUF`` (layout tools) with one clear ForgeError naming
the file, and by the real CLI (``forge inspect``, ``forge layout inspect``) with exit 1 and exactly
one ``error:`` line. A copy of the example model with one tensor set to NaN must make ``forge eval``
and ``forge run`` fail naming that tensor.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf_fields import directory_fields

from forge.errors import ForgeError
from forge.gguf_file import KV, GGUFFile, T, TensorSpec, align_up, write_gguf
from forge.layout.gguf_raw import open_gguf as open_raw

ROOT = Path(__file__).resolve().parents[1]
VAL_TEXT = ROOT / "examples" / "tiny-qwen3moe-val-excerpt.txt"
NAMES = ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight")  # equal lengths on purpose


def _build(path: Path, alignment: int = 32) -> Path:
    """Three tensors (F32 4x8, Q8_0 2x64, F16 16) after a KV block of ~1.3 KB (a token list)."""
    kvs = [
        KV("general.architecture", "qwen3moe", T.STRING),
        KV("general.alignment", alignment, T.UINT32),
        KV("tokenizer.ggml.tokens", [f"token{i}" for i in range(100)], T.ARRAY, T.STRING),
    ]
    specs = [
        TensorSpec(NAMES[0], (8, 4), Q.F32),
        TensorSpec(NAMES[1], (2, 64), Q.Q8_0),
        TensorSpec(NAMES[2], (16,), Q.F16),
    ]
    data = [
        np.arange(32, dtype=np.float32).reshape(8, 4),
        np.zeros((2, 68), np.uint8),
        np.ones(16, np.float16),
    ]
    write_gguf(path, kvs, specs, data, alignment)
    return path


def _put(data: bytearray, at: int, fmt: str, *values: int) -> bytes:
    struct.pack_into(fmt, data, at, *values)
    return bytes(data)


def _offset(data: bytearray, f: dict, name: str) -> int:
    return struct.unpack_from("<Q", data, f[name]["offset"])[0]


Damage = Callable[[bytearray, int, int, dict], bytes]

# name: (damage(file bytes, KV start, directory start, directory fields) -> new bytes, expected message)
CASES: dict[str, tuple[Damage, str]] = {
    "offset + 1": (
        lambda d, k, s, f: _put(d, f[NAMES[1]]["offset"], "<Q", _offset(d, f, NAMES[1]) + 1),
        f"tensor {NAMES[1]} at offset",
    ),
    "offset past the end": (
        lambda d, k, s, f: _put(d, f[NAMES[2]]["offset"], "<Q", align_up(len(d), 32)),
        f"tensor {NAMES[2]} (bytes",
    ),
    "overlapping tensors": (
        lambda d, k, s, f: _put(d, f[NAMES[1]]["offset"], "<Q", 64),  # inside attn_q's 128 bytes
        f"tensors {NAMES[0]} and {NAMES[1]} overlap",
    ),
    "unknown type id": (
        lambda d, k, s, f: _put(d, f[NAMES[1]]["type"], "<I", 99),
        f"tensor {NAMES[1]} has unknown GGML type id 99",
    ),
    "zero dimension": (
        lambda d, k, s, f: _put(d, f[NAMES[0]]["dims"] + 8, "<Q", 0),
        f"tensor {NAMES[0]} has an empty dimension",
    ),
    "five dimensions": (
        lambda d, k, s, f: _put(d, f[NAMES[0]]["n_dims"], "<I", 5),
        f"tensor {NAMES[0]} has 5 dimensions (1..4 allowed)",
    ),
    "row not whole blocks": (
        lambda d, k, s, f: _put(d, f[NAMES[1]]["dims"], "<Q", 48),
        f"tensor {NAMES[1]}: row length 48 is not a multiple of Q8_0's block size 32",
    ),
    "element count overflow": (
        lambda d, k, s, f: _put(d, f[NAMES[0]]["dims"], "<QQ", 1 << 32, 1 << 32),
        f"tensor {NAMES[0]}: element count (ne 4294967296x4294967296) overflows int64",
    ),
    "duplicate name": (
        lambda d, k, s, f: _put(d, f[NAMES[1]]["name"], f"<{len(NAMES[0])}s", *[NAMES[0].encode()]),  # type: ignore[arg-type]
        f"tensor {NAMES[0]} appears twice",
    ),
    "huge tensor count": (lambda d, k, s, f: _put(d, 8, "<Q", 1 << 40), "truncated or damaged GGUF"),
    "huge KV count": (lambda d, k, s, f: _put(d, 16, "<Q", 1 << 50), "truncated or damaged GGUF"),
    "huge array length": (  # the token list's item count (after key, value type, item type)
        lambda d, k, s, f: _put(d, _array_count_at(d, k), "<Q", 1 << 40),
        "truncated",
    ),
    "cut in the header": (lambda d, k, s, f: bytes(d[:20]), "truncated GGUF (20 bytes)"),
    "cut in the KV block": (lambda d, k, s, f: bytes(d[: k + 600]), "truncated"),
    "cut in the directory": (lambda d, k, s, f: bytes(d[: s + 30]), "truncated"),
    "cut in the data": (lambda d, k, s, f: bytes(d[:-7]), f"tensor {NAMES[2]} (bytes"),
    "ten bytes with the magic": (lambda d, k, s, f: bytes(d[:10]), "truncated GGUF (10 bytes)"),
    "empty file": (lambda d, k, s, f: b"", "empty file"),
    "text file": (lambda d, k, s, f: b"hello, this is not a model\n" * 3, "not a GGUF file (bad magic)"),
}


def _array_count_at(data: bytearray, kv_start: int) -> int:
    """File position of the item count of the third KV (tokenizer.ggml.tokens)."""
    pos = kv_start
    for _ in range(2):  # skip general.architecture (string) and general.alignment (u32)
        (n,) = struct.unpack_from("<Q", data, pos)
        (vtype,) = struct.unpack_from("<I", data, pos + 8 + n)
        pos += 8 + n + 4
        pos += 8 + struct.unpack_from("<Q", data, pos)[0] if vtype == 8 else 4
    (n,) = struct.unpack_from("<Q", data, pos)
    return pos + 8 + n + 4 + 4  # key, value type (array), item type


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """Every damaged file of CASES (plus a folder, a bad alignment and a 64-aligned misalignment)."""
    tmp = tmp_path_factory.mktemp("bad")
    good = _build(tmp / "good.gguf")
    kv_start, dir_start, fields = directory_fields(good)
    out = {}
    for i, (case, (damage, needle)) in enumerate(CASES.items()):
        path = tmp / f"case{i}.gguf"
        path.write_bytes(damage(bytearray(good.read_bytes()), kv_start, dir_start, fields))
        out[case] = (path, needle)
    folder = tmp / "folder.gguf"
    folder.mkdir()
    out["a folder"] = (folder, "is a folder, not a GGUF file")
    out["alignment 24"] = (
        _build(tmp / "align24.gguf", alignment=24),
        "general.alignment 24 is not a power of two",
    )
    a64 = _build(tmp / "align64.gguf", alignment=64)
    _, _, f64 = directory_fields(a64)
    data = bytearray(a64.read_bytes())
    a64.write_bytes(_put(data, f64[NAMES[1]]["offset"], "<Q", _offset(data, f64, NAMES[1]) + 32))
    out["32 off in a 64-aligned file"] = (a64, "is not aligned to 64 bytes")
    return out


ALL_CASES = [*CASES, "a folder", "alignment 24", "32 off in a 64-aligned file"]


def test_the_undamaged_file_opens_in_both_readers(tmp_path: Path) -> None:
    for alignment in (32, 64):
        path = _build(tmp_path / f"good{alignment}.gguf", alignment)
        g = GGUFFile(path)
        assert list(g.tensors) == list(NAMES) and g.alignment == alignment
        assert g.array(NAMES[0]).tolist() == np.arange(32, dtype=np.float32).reshape(8, 4).tolist()
        assert g.tensors[NAMES[1]].nbytes == 136 and g.tensors[NAMES[1]].offset % alignment == 0
        with open_raw(path) as raw:
            assert [t.name for t in raw.tensors] == list(NAMES) and raw.alignment == alignment
            assert [t.nbytes for t in raw.tensors] == [128, 136, 32]


@pytest.mark.parametrize("case", ALL_CASES)
def test_both_readers_refuse(bad_files: dict[str, tuple[Path, str]], case: str) -> None:
    path, needle = bad_files[case]
    for reader in (GGUFFile, open_raw):
        with pytest.raises(ForgeError) as info:
            reader(path)
        message = str(info.value)
        assert message.startswith(f"{path}: "), message
        assert needle in message, message
        assert "\n" not in message


def test_misaligned_message_reads_as_documented(bad_files: dict[str, tuple[Path, str]]) -> None:
    path, _ = bad_files["offset + 1"]
    offset = GGUFFile(path.with_name("good.gguf")).tensors[NAMES[1]].offset + 1
    with pytest.raises(ForgeError) as info:
        GGUFFile(path)
    assert str(info.value) == (
        f"{path}: tensor {NAMES[1]} at offset {offset:,} is not aligned to 32 bytes (damaged or not a GGUF)"
    )


# ------------------------------------------------------------------------------------ the real CLI

# Runs ``forge ARGS`` once per argument list, each in a forked child of one interpreter that has
# imported the CLI already (a fresh interpreter per case would take seconds each): every child is a
# real process running forge's own entry point, whose exit status and stderr are reported back.
_DRIVER = r"""
import json, os, sys, traceback
from forge.cli import main
results = []
for i, args in enumerate(json.loads(sys.argv[1])):
    err = os.path.join(sys.argv[2], f"stderr{i}.txt")
    pid = os.fork()
    if pid == 0:
        fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 2)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        sys.argv = ["forge", *args]
        code = 0
        try:
            main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 99
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    with open(err) as f:
        results.append([os.waitstatus_to_exitcode(status), f.read()])
print(json.dumps(results))
"""


def _forge_many(runs: list[list[str]], tmp: Path) -> list[tuple[int, str]]:
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER, json.dumps(runs), str(tmp)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    return [(code, err) for code, err in json.loads(proc.stdout.strip().splitlines()[-1])]


def _assert_one_error_line(code: int, stderr: str, *needles: str, notes: bool = False) -> None:
    """Exit 1, no traceback, one ``error:`` line holding every needle; ``notes``: after info lines."""
    assert code == 1, (code, stderr)
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], stderr
    assert notes or len(lines) == 1, stderr  # run/eval may first say how the model is held
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])


def test_cli_inspect_and_layout_inspect_refuse(
    bad_files: dict[str, tuple[Path, str]], tmp_path: Path
) -> None:
    runs = [
        [*cmd, str(bad_files[case][0])] for case in ALL_CASES for cmd in (["inspect"], ["layout", "inspect"])
    ]
    results = _forge_many(runs, tmp_path)
    assert len(results) == 2 * len(ALL_CASES)
    for (code, stderr), args in zip(results, runs, strict=True):
        case = ALL_CASES[runs.index(args) // 2]
        _assert_one_error_line(code, stderr, bad_files[case][1], str(bad_files[case][0]))


def test_cli_in_a_fresh_interpreter(bad_files: dict[str, tuple[Path, str]]) -> None:
    """The issue's case, without the fork driver: ``python -m forge inspect`` on a misaligned tensor."""
    path, needle = bad_files["offset + 1"]
    proc = subprocess.run(
        [sys.executable, "-m", "forge", "inspect", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    _assert_one_error_line(proc.returncode, proc.stderr, needle, "not aligned to 32 bytes")


# ------------------------------------------------------------------------ a damaged real model


def _tensor_span(path: Path, name: str) -> tuple[int, int]:
    t = GGUFFile(path).tensors[name]
    return t.offset, t.nbytes


def test_run_and_eval_refuse_a_misaligned_model(example_bf16: Path, tmp_path: Path) -> None:
    bad = tmp_path / "misaligned.gguf"
    data = bytearray(example_bf16.read_bytes())
    _, _, fields = directory_fields(example_bf16)
    name = "blk.0.attn_q.weight"
    _put(data, fields[name]["offset"], "<Q", _offset(data, fields, name) + 1)
    bad.write_bytes(bytes(data))
    runs = [
        ["run", str(bad), "-p", "import os", "-n", "2", "--threads", "1"],
        ["eval", str(bad), "--text", str(VAL_TEXT), "--ctx", "128", "--chunks", "1", "--threads", "1"],
    ]
    for code, stderr in _forge_many(runs, tmp_path):
        _assert_one_error_line(
            code, stderr, f"tensor {name} at offset", "not aligned to 32 bytes", notes=True
        )


def _with_values(src: Path, dst: Path, name: str, fill: bytes) -> Path:
    """A copy of ``src`` whose tensor ``name`` holds ``fill`` (one element's bytes) everywhere."""
    start, nbytes = _tensor_span(src, name)
    data = bytearray(src.read_bytes())
    data[start : start + nbytes] = fill * (nbytes // len(fill))
    dst.write_bytes(bytes(data))
    return dst


def test_nan_weights_are_named_by_eval_and_run(example_bf16: Path, tmp_path: Path) -> None:
    name = "blk.0.ffn_down_exps.weight"
    assert GGUFFile(example_bf16).tensors[name].ggml_type == Q.BF16
    bad = _with_values(example_bf16, tmp_path / "nan.gguf", name, b"\xc0\x7f")  # bf16 NaN
    eval_args = ["--text", str(VAL_TEXT), "--ctx", "128", "--threads", "1"]
    runs = [
        ["eval", str(bad), *eval_args, "--chunks", "2"],
        ["run", str(bad), "-p", "import os\n", "-n", "4", "--threads", "1"],
        ["eval", str(example_bf16), *eval_args, "--chunks", "1"],
    ]
    (ev_code, ev_err), (run_code, run_err), (ok_code, ok_err) = _forge_many(runs, tmp_path)
    nan = f"tensor {name} holds NaN/inf values"
    _assert_one_error_line(ev_code, ev_err, f"non-finite logits at chunk 1: {nan}", notes=True)
    _assert_one_error_line(run_code, run_err, f"non-finite logits at the prompt: {nan}", notes=True)
    assert ok_code == 0, ok_err  # the undamaged model still evaluates


def test_overflowing_activations_are_told_apart(example_bf16: Path, tmp_path: Path) -> None:
    """Finite but huge weights: no tensor to blame, the message says the activations overflowed."""
    from runtime.diagnose import first_nonfinite_tensor
    from runtime.evaluate import evaluate
    from runtime.models import load_model

    name = "blk.0.ffn_norm.weight"
    assert GGUFFile(example_bf16).tensors[name].ggml_type == Q.F32
    bad = _with_values(example_bf16, tmp_path / "huge.gguf", name, struct.pack("<f", 3e38))
    model = load_model(bad)
    assert first_nonfinite_tensor(model.weights) is None
    tokens = list(range(100, 100 + 256))
    with pytest.raises(ForgeError, match=r"^non-finite logits at chunk 1 \(no weight tensor holds NaN/inf"):
        evaluate(model, tokens, n_ctx=128, n_chunks=1)


def test_diagnosis_walks_the_file_in_order(example_bf16: Path, tmp_path: Path) -> None:
    """With two damaged tensors the first in file order is named, whatever the forward pass touches."""
    from runtime.diagnose import first_nonfinite_tensor
    from runtime.models import load_model

    bf16 = [t.name for t in GGUFFile(example_bf16).tensors.values() if t.ggml_type == Q.BF16]
    first, later = bf16[len(bf16) // 3], bf16[-1]  # directory order
    step = _with_values(example_bf16, tmp_path / "one.gguf", later, b"\x80\x7f")  # bf16 +inf
    assert first_nonfinite_tensor(load_model(step).weights) == later
    both = _with_values(step, tmp_path / "two.gguf", first, b"\xc0\x7f")
    assert first_nonfinite_tensor(load_model(both).weights) == first
    assert first_nonfinite_tensor(load_model(example_bf16).weights) is None
    assert os.path.getsize(both) == os.path.getsize(example_bf16)
