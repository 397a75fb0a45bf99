"""Building prune masks from expert profiles (the file format: forge.mask_file)."""

from __future__ import annotations

import math

import numpy as np

from forge.errors import ForgeError
from forge.mask_file import PruneMask
from forge.prune.profile import Profile


def build_mask(
    profile: Profile,
    keep: int | None = None,
    keep_fraction: float | None = None,
    coverage: float | None = None,
    by: str = "count",
) -> PruneMask:
    """Keep each layer's top experts by ``by``: ``keep`` of them, a ``keep_fraction`` of them (rounded
    half up), or the fewest whose share of the layer's total ``by`` reaches ``coverage``. Never fewer than
    experts-per-token."""
    given = [v is not None for v in (keep, keep_fraction, coverage)]
    if sum(given) != 1:
        raise ForgeError("give exactly one of --keep, --keep-fraction, --coverage")
    n, k = profile.expert_count, profile.expert_used_count
    if not profile.layers or n < 1:
        raise ForgeError("the profile has no routed layers")
    if keep is not None and not k <= keep <= n:
        raise ForgeError(
            f"--keep must be between experts-per-token ({k}) and the expert count ({n}), not {keep}"
        )
    if keep_fraction is not None and not 0 < keep_fraction <= 1:
        raise ForgeError(f"--keep-fraction must be in (0, 1], not {keep_fraction}")
    if coverage is not None and not 0 < coverage <= 1:
        raise ForgeError(f"--coverage must be in (0, 1], not {coverage}")
    pruned = np.ones((len(profile.layers), n), dtype=bool)
    for row, lp in enumerate(profile.layers):
        order = lp.ranking(by)
        if keep is not None:
            n_keep = keep
        elif keep_fraction is not None:
            n_keep = math.floor(keep_fraction * n + 0.5)
        else:
            values = lp.metric(by).astype(np.float64)[order]
            total = values.sum()
            share = np.cumsum(values) / total if total > 0 else np.ones(n)
            assert coverage is not None
            n_keep = int(np.searchsorted(share, coverage * (1 - 1e-12))) + 1
        pruned[row, order[: min(n, max(k, n_keep))]] = False
    return PruneMask(pruned, f"mask by {by}")
