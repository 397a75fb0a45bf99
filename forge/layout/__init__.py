"""Expert-major layouts (ds4 ``ds4.expert_major.v1`` / ``v2``): convert, convert back, verify, read."""

from forge.layout.convert import convert, to_canonical, to_expert_major
from forge.layout.reader import ExpertStore, is_expert_major, open_expert_store
from forge.layout.verify import verify_files

__all__ = [
    "ExpertStore",
    "convert",
    "is_expert_major",
    "open_expert_store",
    "to_canonical",
    "to_expert_major",
    "verify_files",
]
