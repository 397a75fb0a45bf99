from __future__ import annotations

import shutil
import sys
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
