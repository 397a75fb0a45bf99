"""Expert profiles: the file format lives in ``forge.profile_file`` (the runtime reads it too, to seed a GPU
expert cache, as it reads ``forge.mask_file``); re-exported here for the prune tools."""

from forge.profile_file import FORMAT, METRICS, VERSION, LayerProfile, Profile

__all__ = ["FORMAT", "METRICS", "VERSION", "LayerProfile", "Profile"]
