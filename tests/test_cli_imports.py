"""Commands that only touch files start without torch (issue 19: `forge prune mask|apply`, `forge layout`,
`forge inspect`, `forge imatrix show|merge|convert`); the runtime is imported only by commands that run a model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from forge.imatrix.formats import write_imatrix
from forge.imatrix.model import Imatrix

PROBE = """
import atexit, os, sys
atexit.register(lambda: os.write(2, f"\\ntorch imported: {'torch' in sys.modules}\\n".encode()))
from forge.cli import main
sys.argv = ["forge", *sys.argv[1:]]
main()
"""

COMMANDS = [
    "inspect m.gguf",
    "inspect m.gguf --json",
    "layout inspect m.gguf",
    "layout convert m.gguf -o v2.gguf",
    "quantize m.gguf --dry-run",
    "imatrix show im.gguf",
    "imatrix convert im.gguf -o im.dat",
    "imatrix merge im.gguf im.gguf -o im2.gguf",
    "prune apply m.gguf --mask mask.txt -o pruned.gguf",
]


@pytest.fixture
def files(tmp_path: Path, example_bf16: Path) -> Path:
    (tmp_path / "m.gguf").symlink_to(example_bf16)
    im = Imatrix(chunk_count=1, chunk_size=8)
    im.sums["blk.0.attn_q.weight"] = np.ones((1, 256), np.float32)
    im.counts["blk.0.attn_q.weight"] = np.array([8])
    write_imatrix(im, tmp_path / "im.gguf", "gguf")
    (tmp_path / "mask.txt").write_text("\n".join(["0" * 24 + "1" * 8] * 4) + "\n")
    return tmp_path


@pytest.mark.parametrize("command", COMMANDS)
def test_file_commands_start_without_torch(files: Path, command: str) -> None:
    res = subprocess.run([sys.executable, "-c", PROBE, *command.split()], cwd=files, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "torch imported: False" in res.stderr, res.stderr
