"""Expert pruning: profile routed experts on a text, build ds4-style prune masks, remove experts from a GGUF."""

from forge.prune.apply import apply_mask
from forge.prune.mask import PruneMask, apply_mask_to_model, build_mask, parse_mask, read_mask, write_mask
from forge.prune.profile import ExpertProfiler, Profile, collect_profile

__all__ = [
    "ExpertProfiler",
    "Profile",
    "PruneMask",
    "apply_mask",
    "apply_mask_to_model",
    "build_mask",
    "collect_profile",
    "parse_mask",
    "read_mask",
    "write_mask",
]
