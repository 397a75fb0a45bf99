"""A built wheel works on its own: presets and the demo's files are package data; quantize and demo run from it.

The wheel is built from a copy of the sources and installed (``--no-deps --no-index``) into a fresh virtual
environment made without system site-packages, so this checkout's editable install (a ``.pth`` hook in this
interpreter's site-packages) is not seen; the dependencies (torch, numpy, ...) come from this interpreter's
site-packages listed as plain path entries, whose ``.pth`` files Python does not run. Everything runs from a
folder outside the checkout, and the tests check that ``forge`` and ``runtime`` are imported from the venv.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from oracle import manifest, tensor_manifest

from forge.demo import EXAMPLE, EXAMPLE_FILES, write_random_example
from forge.quant.recipe import available_recipes

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("setuptools", reason="the wheel is built without build isolation (no network)")
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("forge", "runtime"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", dist, src])
    (whl,) = dist.glob("gguf_forge-*.whl")
    return whl


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    env = tmp_path_factory.mktemp("venv")
    _run([sys.executable, "-m", "venv", env])
    _run([_bin(env, "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel])
    purelib = _run([_bin(env, "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
    deps = [p for p in [*site.getsitepackages(), site.getusersitepackages()] if Path(p).is_dir()]
    (Path(purelib.strip()) / "forge-test-deps.pth").write_text("\n".join(deps) + "\n")
    return env


def _bin(env: Path, name: str) -> Path:
    return env / ("Scripts" if os.name == "nt" else "bin") / name


def _run(cmd: list, cwd: Path | None = None, check: bool = True) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")} | {
        "PYTHONNOUSERSITE": "1",
        "COLUMNS": "250",
    }
    proc = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=900
    )
    if check:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout + proc.stderr


def test_package_data_is_read_through_the_package() -> None:
    assert available_recipes() == sorted(p.stem for p in (ROOT / "forge" / "recipes").glob("*.toml"))
    assert {"q4_k_m", "q8_0", "iq2_xxs", "moe_4bit"} <= set(available_recipes())
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja"):  # fmt: skip
        assert (EXAMPLE_FILES / name).read_bytes() == (EXAMPLE / name).read_bytes(), name
    excerpt = (EXAMPLE_FILES / "val-excerpt.txt").read_bytes()
    assert excerpt == (EXAMPLE.parent / "tiny-qwen3moe-val-excerpt.txt").read_bytes()
    assert (ROOT / "tests" / "fixtures" / "text" / "val.txt").read_bytes().startswith(excerpt)


@pytest.mark.slow
def test_random_example_has_the_example_geometry(tmp_path: Path) -> None:
    from safetensors import safe_open

    def tensors(folder: Path) -> dict:
        out = {}
        for shard in folder.glob("*.safetensors"):
            with safe_open(shard, "pt") as f:
                out |= {k: (f.get_slice(k).get_shape(), f.get_slice(k).get_dtype()) for k in f.keys()}  # noqa: SIM118
        return out

    made = write_random_example(tmp_path / "m")
    assert tensors(made) == tensors(EXAMPLE)
    assert (made / "tokenizer.json").read_bytes() == (EXAMPLE / "tokenizer.json").read_bytes()


@pytest.mark.slow
def test_wheel_holds_the_package_data(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"forge/recipes/{r}.toml" for r in available_recipes()} <= names
    assert {f"forge/example/{p.name}" for p in EXAMPLE_FILES.iterdir()} <= names
    assert {
        f"forge/arch/templates/{p.name}" for p in (ROOT / "forge" / "arch" / "templates").iterdir()
    } <= names
    assert not [n for n in names if n.startswith(("tests/", "examples/", "benchmarks/"))]


@pytest.mark.slow
def test_installed_wheel_is_what_runs(venv: Path, tmp_path: Path) -> None:
    out = _run([_bin(venv, "python"), "-c", "import forge, runtime; print(forge.__file__); print(runtime.__file__)"],
               cwd=tmp_path)  # fmt: skip
    for line in out.split():
        assert Path(line).resolve().is_relative_to(venv.resolve()), out


@pytest.mark.slow
def test_quantize_from_the_wheel_is_bit_exact(venv: Path, tmp_path: Path) -> None:
    out = tmp_path / "q.gguf"
    _run([_bin(venv, "forge"), "quantize", EXAMPLE, "-o", out, "--recipe", "q4_k_m"], cwd=tmp_path)
    assert tensor_manifest(out) == manifest("tiny-qwen3moe", "Q4_K_M")["tensors"]  # llama-quantize's tensors
    err = _run(
        [_bin(venv, "forge"), "quantize", EXAMPLE, "-o", out, "--recipe", "q9"], cwd=tmp_path, check=False
    )
    assert f"unknown recipe 'q9'; presets: {', '.join(available_recipes())}" in err


@pytest.mark.slow
def test_demo_from_the_wheel(venv: Path, tmp_path: Path) -> None:
    keep = tmp_path / "demo"
    out = _run([_bin(venv, "forge"), "demo", "--keep", keep], cwd=tmp_path)
    assert "random weights" in out and "byte-identical" in out, out[-3000:]
    made = {p.name for p in keep.iterdir()}
    assert {"tiny-qwen3moe-random", "model-bf16.gguf", "model-Q4_K_M.gguf", "model-Q4_K_M-v2.gguf"} <= made
