"""A cheaper cost than a forward pass per candidate (``--proxy``): the importance-weighted squared error
of a group's weights at a type, from the encodings alone (the candidates' type files against the source),

    error(group, type) = sum over its tensors, experts, rows, columns of  w[column] * (W - decode(encode(W)))^2

with ``w`` the imatrix's mean squared activation of that column (per expert; 1 without an imatrix), the
quantity llama.cpp's IQ/K encoders minimise. Its units are not KLD's and the families differ in how an error
reaches the output, so the search measures the true cost (KLD) of a sample of candidates, scales each
family's errors by the median measured/proxy ratio of its sampled candidates, and checks the scaled proxy
against the measurements by rank correlation, leaving each sampled candidate out of its own family's scale
(so the figure is not flattered by fitting); a poor correlation stops the search.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

import numpy as np

from forge.imatrix.importance import importance_for
from forge.imatrix.model import Imatrix
from forge.quant.source import QuantSource
from forge.quant.types import get_type
from forge.search.correction import family_key
from forge.search.measure import Group, quiet_importance

#: rows decoded at once (bounds memory on large tensors)
CHUNK_ROWS = 1 << 14
#: the leave-one-out rank correlation below which --proxy refuses, and below which it warns
REFUSE_BELOW = 0.5
WARN_BELOW = 0.8


def weighted_error(
    source: QuantSource, typed: QuantSource, name: str, shape: tuple[int, ...], imatrix: Imatrix | None
) -> float:
    """sum of w * (W - W_typed)^2 over one tensor (``typed`` holds it encoded)."""
    n_per_row = shape[-1]
    n_mat = shape[0] if len(shape) == 3 else 1
    w = importance_for(imatrix, name, n_per_row, n_mat) if imatrix is not None else None
    t = typed.file.tensors[name]  # type: ignore[attr-defined]
    qt = get_type(t.ggml_type.name)
    raw = np.asarray(typed.stored(name)).reshape(-1, qt.row_bytes(n_per_row))
    src = source.float32(name).reshape(-1, n_per_row)
    rows_per_mat = src.shape[0] // n_mat
    total = 0.0
    for lo in range(0, src.shape[0], CHUNK_ROWS):
        hi = min(lo + CHUNK_ROWS, src.shape[0])
        d = qt.decode(raw[lo:hi], n_per_row) - src[lo:hi]
        sq = (d.astype(np.float64) ** 2).reshape(hi - lo, n_per_row)
        if w is None:
            total += float(sq.sum())
            continue
        mat = np.arange(lo, hi) // rows_per_mat  # the expert of each row
        total += float(np.einsum("rc,rc->", sq, w[mat].astype(np.float64)))
    return total


def group_errors(
    groups: list[Group],
    source: QuantSource,
    typed: dict[str, QuantSource],
    imatrix: Imatrix | None,
    store: object,
) -> None:
    """The proxy of every (group, option) not in ``store.proxy`` yet (persisted as they are computed)."""
    shapes = {t.name: tuple(t.shape) for t in source.tensors()}
    with quiet_importance():
        for label, src_typed in typed.items():
            for g in groups:
                if (
                    not any(o.label == label for o in g.options)
                    or store.proxy.get(g.name, {}).get(label) is not None
                ):  # type: ignore[attr-defined]
                    continue
                err = sum(weighted_error(source, src_typed, n, shapes[n], imatrix) for n in g.tensors)
                store.proxy.setdefault(g.name, {})[label] = err  # type: ignore[attr-defined]
            store.save()  # type: ignore[attr-defined]


def sample(groups: list[Group], n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` (group, label) candidates drawn at random (fixed seed), the same on every run."""
    every = [(g.name, o.label) for g in groups for o in g.options]
    return sorted(random.Random(seed).sample(every, min(n, len(every))))


def spearman(x: list[float], y: list[float]) -> float:
    if len(x) < 3:
        return math.nan
    rx = np.argsort(np.argsort(x)).astype(np.float64)
    ry = np.argsort(np.argsort(y)).astype(np.float64)
    if rx.std() == 0 or ry.std() == 0:
        return math.nan
    return float(np.corrcoef(rx, ry)[0, 1])


@dataclass
class Validation:
    sampled: int
    rho_raw: float  # the unscaled proxy vs measured KLD
    rho: float  # the proxy scaled per role, each candidate left out of its own scale
    scales: dict[str, float]  # KLD per unit of proxy, per role


def role_key(group: Group) -> str:
    """``attn_q``, ``ffn_down_exps``... (per-tensor groups) or the family (family-layer groups), layer dropped."""
    return re.sub(r"^blk\.\d+\.", "", group.name)


def calibrate(groups: list[Group], proxy: dict, measured: dict[tuple[str, str], float]) -> Validation:
    """KLD/proxy scales from the measured sample: per role (the median ratio of its sampled candidates, when
    it has two or more), else per family, else over the whole sample; and how well the scaled proxy ranks it."""
    by_name = {g.name: g for g in groups}
    items = [(role_key(by_name[gn]), family_key(by_name[gn]), proxy[gn][lb], kld)
             for (gn, lb), kld in measured.items() if proxy[gn][lb] > 0]  # fmt: skip
    if not items:
        return Validation(len(measured), math.nan, math.nan, {})

    def scale_of(role: str, family: str, skip: int | None = None) -> float:
        rest = [(r, f, k / p) for i, (r, f, p, k) in enumerate(items) if i != skip]
        for ratios, enough in (([x for r, _, x in rest if r == role], 2), ([x for _, f, x in rest if f == family], 1),
                               ([x for _, _, x in rest], 1)):  # fmt: skip
            if len(ratios) >= enough:
                return float(np.median(ratios))
        return 0.0

    scales = {role_key(g): scale_of(role_key(g), family_key(g)) for g in groups}
    loo = [p * scale_of(r, f, i) for i, (r, f, p, _) in enumerate(items)]
    truth = [k for _, _, _, k in items]
    return Validation(
        len(measured), spearman([p for _, _, p, _ in items], truth), spearman(loo, truth), scales
    )


def proxy_costs(groups: list[Group], proxy: dict, measured: dict[tuple[str, str], float],
                scales: dict[str, float]) -> list[list[float]]:  # fmt: skip
    """KLD where measured, else the proxy scaled per role."""
    return [[measured.get((g.name, o.label), proxy[g.name][o.label] * scales[role_key(g)]) for o in g.options]
            for g in groups]  # fmt: skip
