"""Importance matrices: llama.cpp's GGUF and .dat formats, merge, statistics, collection.

The quantizer needs only :func:`read_imatrix` and :func:`importance_for` (numpy only); collection
(``forge.imatrix.accumulate``, ``forge.imatrix.live``) imports torch and the runtime's observers.
"""

from forge.imatrix.formats import read_imatrix, write_imatrix
from forge.imatrix.importance import check_matches_model, importance_for, unseen_experts
from forge.imatrix.model import Imatrix, merge

__all__ = [
    "Imatrix",
    "check_matches_model",
    "importance_for",
    "merge",
    "read_imatrix",
    "unseen_experts",
    "write_imatrix",
]
