from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-qwen3moe"
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session")
def example_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled example converted once per session (bf16 GGUF)."""
    from forge.convert import convert_checkpoint

    out = tmp_path_factory.mktemp("example") / "tiny-qwen3moe-bf16.gguf"
    convert_checkpoint(EXAMPLE, out, "bf16")
    return out


@pytest.fixture(scope="session")
def example_q8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled example quantized to Q8_0 by forge, once per session."""
    from forge.quant.quantize import quantize

    out = tmp_path_factory.mktemp("example-q8") / "tiny-qwen3moe-Q8_0.gguf"
    quantize(EXAMPLE, out, "q8_0")
    return out


@pytest.fixture
def example_copy(tmp_path: Path) -> Path:
    """A writable copy of the example folder: small files copied, shards symlinked."""
    dst = tmp_path / "model"
    dst.mkdir()
    for p in EXAMPLE.iterdir():
        if p.suffix == ".safetensors":
            (dst / p.name).symlink_to(p)
        else:
            shutil.copy(p, dst / p.name)
    return dst


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One torch thread for a module of many small forward passes: two threads on a loaded 2-core machine
    are many times slower for the tiny models than one."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_glm4moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random GLM-4.5-style checkpoint (tests/glm_fixture.py), written once per session."""
    from glm_fixture import write_glm4moe

    return write_glm4moe(tmp_path_factory.mktemp("glm") / "tiny-glm4moe")


@pytest.fixture(scope="session")
def tiny_glm_dsa(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random GLM-5-style (glm-dsa) checkpoint (tests/glm_fixture.py), written once per session."""
    from glm_fixture import write_glm_dsa

    return write_glm_dsa(tmp_path_factory.mktemp("glm-dsa") / "tiny-glm-dsa")
