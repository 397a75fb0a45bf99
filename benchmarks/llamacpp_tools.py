"""llama.cpp's tools as the oracle scripts run them (benchmarks/glm_oracle.py, deepseek4_convert_oracle.py).

llama.cpp's converter names a BPE pre-tokenizer by hashing the token ids of a fixed text, a hash only a
published vocabulary has; a fixture's tiny vocabulary has none, so ``converter`` runs it with that lookup
answering a given name. Nothing else in the converter is changed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_CONVERT = """
import runpy, sys
lcb, pre = sys.argv.pop(1), sys.argv.pop(1)
sys.path[:0] = [lcb, lcb + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
sys.argv[0] = lcb + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run(cmd: list[str]) -> str:
    """The command's stdout and stderr; exits with both tails when it fails."""
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r.stdout + r.stderr


def converter(llama_cpp: Path, pre: str) -> list[str]:
    """The start of a command line running ``llama_cpp``'s convert_hf_to_gguf.py (a folder holding it,
    ``conversion/`` and ``gguf-py/``) with the pre-tokenizer lookup answering ``pre``; the converter's own
    arguments follow."""
    return [sys.executable, "-c", _CONVERT, str(llama_cpp), pre]
