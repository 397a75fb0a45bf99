"""benchmarks/runtime_speed.py --llama-bench: the llama-bench command, parsing its ``-o json`` output (a
recorded sample), and the side-by-side run end to end with a stand-in binary that replays the sample."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmark_scripts import load

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "runtime_speed.py"

# Recorded: llama-bench -m /tmp/t.gguf -t 2 -p 16 -n 4 -r 2 -ngl 0 -o json, on a tiny `forge synth` file, llama.cpp
# of llama-cpp-python 0.3.36 (CPU build, AVX2), this 2-core machine.
SAMPLE = """[
  {
    "build_commit": "unknown",
    "build_number": 0,
    "cpu_info": "AMD EPYC",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": "/tmp/t.gguf",
    "model_type": "qwen3moe ?B (guessed) Q4_K - Medium",
    "model_size": 849152,
    "model_n_params": 1497088,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 2,
    "cpu_mask": "0x0",
    "cpu_strict": false,
    "poll": 50,
    "type_k": "f16",
    "type_v": "f16",
    "n_gpu_layers": 0,
    "n_cpu_moe": 0,
    "split_mode": "layer",
    "main_gpu": 0,
    "no_kv_offload": false,
    "flash_attn": -1,
    "devices": "auto",
    "tensor_split": "0.00",
    "tensor_buft_overrides": "none",
    "load_mode": "auto",
    "lazy_mode": "auto",
    "embeddings": false,
    "no_op_offload": 0,
    "no_host": false,
    "repack": true,
    "fit_target": 0,
    "fit_min_ctx": 0,
    "n_prompt": 16,
    "n_gen": 0,
    "n_depth": 0,
    "test_time": "2026-12-01T16:17:58Z",
    "avg_ns": 250106,
    "stddev_ns": 88756,
    "avg_ts": 68271.417257,
    "stddev_ts": 24227.103382,
    "samples_ns": [ 312865, 187348 ],
    "samples_ts": [ 51140.3, 85402.6 ]
  },
  {
    "build_commit": "unknown",
    "build_number": 0,
    "cpu_info": "AMD EPYC",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": "/tmp/t.gguf",
    "model_type": "qwen3moe ?B (guessed) Q4_K - Medium",
    "model_size": 849152,
    "model_n_params": 1497088,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 2,
    "cpu_mask": "0x0",
    "cpu_strict": false,
    "poll": 50,
    "type_k": "f16",
    "type_v": "f16",
    "n_gpu_layers": 0,
    "n_cpu_moe": 0,
    "split_mode": "layer",
    "main_gpu": 0,
    "no_kv_offload": false,
    "flash_attn": -1,
    "devices": "auto",
    "tensor_split": "0.00",
    "tensor_buft_overrides": "none",
    "load_mode": "auto",
    "lazy_mode": "auto",
    "embeddings": false,
    "no_op_offload": 0,
    "no_host": false,
    "repack": true,
    "fit_target": 0,
    "fit_min_ctx": 0,
    "n_prompt": 0,
    "n_gen": 4,
    "n_depth": 0,
    "test_time": "2026-12-01T16:17:58Z",
    "avg_ns": 316786,
    "stddev_ns": 21959,
    "avg_ts": 12657.232129,
    "stddev_ts": 877.411425,
    "samples_ns": [ 332314, 301258 ],
    "samples_ts": [ 12036.8, 13277.7 ]
  }
]
"""


@pytest.fixture(scope="module")
def rs():  # noqa: ANN201
    return load("runtime_speed")


def test_parses_llama_bench_json(rs) -> None:  # noqa: ANN001
    got = rs.parse_llama_bench("build: unknown (0) with cc for x86_64\n" + SAMPLE)
    assert got["pp"] == 85402.6 and got["pp_avg"] == 68271.4 and got["pp_tokens"] == 16
    assert got["tg"] == 13277.7 and got["tg_avg"] == 12657.2 and got["tg_tokens"] == 4
    assert got["threads"] == 2 and got["ngl"] == 0 and got["backends"] == "CPU"
    tg_only = json.dumps([t for t in json.loads(SAMPLE) if t["n_gen"]])
    assert "pp" not in rs.parse_llama_bench(tg_only) and rs.parse_llama_bench(tg_only)["tg"] == 13277.7
    for bad in ("", "error: failed to load model", "[]"):
        with pytest.raises(ValueError):
            rs.parse_llama_bench(bad)


def test_command_matches_forge_settings(rs) -> None:  # noqa: ANN001
    cpu = rs.llama_bench_command(Path("/b/llama-bench"), Path("m.gguf"), "cpu", 2, 512, 128, 3)
    assert cpu == ["/b/llama-bench", "-m", "m.gguf", "-t", "2", "-p", "512", "-n", "128", "-r", "3",
                   "-ngl", "0", "-o", "json"]  # fmt: skip
    cuda = rs.llama_bench_command(Path("lb"), Path("m.gguf"), "cuda", 16, 512, 128, 3)
    assert cuda[cuda.index("-ngl") + 1] == "99"


def test_ratios(rs) -> None:  # noqa: ANN001
    row = rs.compare({"file": "f", "pp": 4000.0, "tg": 444.45}, {"pp": 8000.0, "tg": 888.9})
    assert row["ratio_pp"] == 0.5 and row["ratio_tg"] == 0.5 and row["llama_cpp"]["pp"] == 8000.0
    failed = rs.compare({"file": "f", "pp": 1.0, "tg": 1.0}, {"error": "llama-bench exit 1: x"})
    assert "ratio_pp" not in failed and failed["llama_cpp"]["error"]


def _stand_in(tmp: Path, body: str) -> Path:
    """An executable that records its arguments and then runs ``body`` (python)."""
    exe = tmp / "llama-bench"
    exe.write_text(
        f"#!{sys.executable}\nimport sys, pathlib\n"
        f"pathlib.Path({str(tmp / 'argv.json')!r}).write_text(__import__('json').dumps(sys.argv[1:]))\n{body}\n"
    )
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


def test_run_llama_bench_reports_failures(rs, tmp_path: Path) -> None:  # noqa: ANN001
    ok = _stand_in(tmp_path, f"print({SAMPLE!r})")
    assert rs.run_llama_bench(ok, Path("m.gguf"), "cpu", 2, 16, 4, 2)["tg"] == 13277.7
    assert json.loads((tmp_path / "argv.json").read_text())[:2] == ["-m", "m.gguf"]
    bad = _stand_in(tmp_path, "sys.stderr.write('llama_model_load: error loading model\\n'); sys.exit(1)")
    assert rs.run_llama_bench(bad, Path("m.gguf"), "cpu", 2, 16, 4, 2) == {
        "error": "llama-bench exit 1: llama_model_load: error loading model"
    }
    garbage = _stand_in(tmp_path, "print('not json')")
    assert "unreadable" in rs.run_llama_bench(garbage, Path("m.gguf"), "cpu", 2, 16, 4, 2)["error"]
    assert "error" in rs.run_llama_bench(tmp_path / "missing", Path("m.gguf"), "cpu", 2, 16, 4, 2)


def test_synth_files_out_of_float16_range_are_not_run_on_the_gpu(rs, tmp_path: Path) -> None:  # noqa: ANN001
    """A synthesized file from before its values had a trained model's size is refused for llama.cpp's GPU
    run (its float16 sums would overflow) and run on the CPU; a file written now, or not synthesized, runs."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFValueType

    from forge.gguf_file import KV, TensorSpec, write_gguf
    from runtime.synth import STD_KEY, out_of_range

    def file(name: str, *extra: KV) -> Path:
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.gguf"
        kvs = [
            KV("general.architecture", "qwen3moe", GGUFValueType.STRING),
            KV("general.name", name, GGUFValueType.STRING),
            *extra,
        ]
        write_gguf(
            path, kvs, [TensorSpec("t", (4,), GGMLQuantizationType.F32)], iter([np.zeros(4, np.float32)])
        )
        return path

    old = file("synthetic qwen3.6-35b-a3b (random weights)")
    new = file("synthetic qwen3.6-35b-a3b (random weights)", KV(STD_KEY, 0.02, GGUFValueType.FLOAT32))
    trained = file("Qwen3 30B A3B")
    assert [out_of_range(p) for p in (old, new, trained, tmp_path / "missing.gguf")] == [
        True,
        False,
        False,
        False,
    ]
    ok = _stand_in(tmp_path, f"print({SAMPLE!r})")
    assert "write it again" in rs.run_llama_bench(ok, old, "cuda", 2, 16, 4, 2)["error"]
    assert not (tmp_path / "argv.json").exists()  # llama-bench never started
    assert rs.run_llama_bench(ok, old, "cpu", 2, 16, 4, 2)["tg"] == 13277.7
    assert rs.run_llama_bench(ok, new, "cuda", 2, 16, 4, 2)["tg"] == 13277.7


@pytest.mark.slow  # a minute in CI: the script's subprocess compiles every kernel it runs from cold
def test_side_by_side_end_to_end(tmp_path: Path) -> None:
    """The script on a tiny synth file with a stand-in llama-bench: the table, the ratios, the JSON."""
    from runtime.synth import SynthGeometry, synthesize

    model = tmp_path / "tiny.gguf"
    geo = SynthGeometry(1, 4, 2, hidden=256, expert_ff=256, heads=2, kv_heads=1, head_dim=128, vocab=512)
    synthesize(model, geo, "q4_k")
    exe = _stand_in(tmp_path, f"print({SAMPLE!r})")
    out = tmp_path / "speed.json"
    cmd = [sys.executable, str(SCRIPT), "--model", str(model), "--llama-bench", str(exe), "--threads", "1",
           "--pp", "16", "--tg", "4", "--reps", "2", "--resident-only", "--no-transformers", "--json", str(out)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv == ["-m", str(model), "-t", "1", "-p", "16", "-n", "4", "-r", "2", "-ngl", "0", "-o", "json"]
    (row,) = json.loads(out.read_text())["rows"]
    lc = row["llama_cpp"]
    assert row["file"] == "tiny.gguf" and lc["pp"] == 85402.6 and lc["tg"] == 13277.7
    for k in ("pp", "tg"):  # three significant digits: forge / llama.cpp can be far below 0.001
        assert row[f"ratio_{k}"] == float(f"{row[k] / lc[k]:.3g}") > 0
    table = r.stdout[r.stdout.index("pp forge") :].splitlines()
    assert "tiny.gguf" in table[1] and f"{row['ratio_tg']:.3g}" in table[1] and "13277.7" in table[1]


@pytest.mark.slow
def test_real_llama_bench(tmp_path: Path) -> None:
    """With a real llama-bench (``LLAMA_BENCH=PATH``, e.g. build/bin/llama-bench of a llama.cpp CMake build):
    it loads a synth file and the script reports both sides."""
    import os

    exe = os.environ.get("LLAMA_BENCH")
    if not exe or not os.access(exe, os.X_OK):
        pytest.skip("set LLAMA_BENCH to a llama-bench binary")
    from runtime.synth import SynthGeometry, synthesize

    model = tmp_path / "tiny.gguf"
    synthesize(
        model, SynthGeometry(1, 4, 2, hidden=256, expert_ff=256, heads=2, kv_heads=1, head_dim=128, vocab=512)
    )
    out = tmp_path / "speed.json"
    cmd = [sys.executable, str(SCRIPT), str(model), "--llama-bench", exe, "--threads", "1", "--pp", "16",
           "--tg", "4", "--reps", "2", "--resident-only", "--no-transformers", "--json", str(out)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(out.read_text())["rows"]
    lc = row["llama_cpp"]
    assert "error" not in lc, lc
    assert (
        lc["pp"] > 0
        and lc["tg"] > 0
        and lc["threads"] == 1
        and lc["pp_tokens"] == 16
        and lc["tg_tokens"] == 4
    )
    assert row["ratio_pp"] > 0 and row["ratio_tg"] > 0
