"""The interaction correction: per-group costs are measured one group at a time, and the KLD of a whole
model is not their sum (errors of several groups compound, or partly cancel, differently per family).

A few whole models are measured (``points``: one type everywhere, for every candidate type, then each
knapsack answer), and one scale per tensor family (attention, routed experts, shared expert, SSM, the
embedding, the head) is fitted so that ``sum over families of scale x (sum of that family's costs)``
matches the measured KLDs in relative terms. Points near the budget weigh more (they describe the
interactions where the answer lies), and the scales are pulled toward one common scale (ridge), so with
few points the correction is a single scale, which never changes the knapsack's choice; it changes the
choice only where the data show that one family's costs add up differently from another's.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
from gguf import GGMLQuantizationType as Q

from forge.quant.types import get_type
from forge.search.measure import Group, family_of

#: ridge weight pulling each family's scale toward the common one (relative units)
RIDGE = 0.01
#: how far a family's scale may move from the common one (factor)
SPREAD = 4.0


def family_key(group: Group) -> str:
    """``attn``, ``ffn_exps``, ``ssm``, ``output``...: the family of the group's tensors, layer dropped."""
    return re.sub(r"^blk\.\d+\.", "", family_of(group.tensors[0]))


def family_costs(groups: Sequence[Group], costs: Sequence[Sequence[float]], choice: Sequence[int],
                 families: list[str]) -> np.ndarray:  # fmt: skip
    """Per family, the sum of the chosen options' costs."""
    out = np.zeros(len(families))
    index = {f: k for k, f in enumerate(families)}
    for g, c, j in zip(groups, costs, choice, strict=True):
        out[index[family_key(g)]] += c[j]
    return out


def fit_scales(
    groups: Sequence[Group],
    costs: Sequence[Sequence[float]],
    points: Sequence[tuple[Sequence[int], float]],
    sizes: Sequence[float] | None = None,
    target_size: float | None = None,
) -> dict[str, float]:
    """One scale per family from measured whole-model points ``(choice, measured KLD)``.

    ``sizes`` (bytes of each point) and ``target_size`` weigh points near the budget more: weight
    ``1 / (1 + |log2(size / target)| * 8)`` (a point 10% away weighs about half)."""
    families = sorted({family_key(g) for g in groups})
    if not points:
        return dict.fromkeys(families, 1.0)
    p = np.array([family_costs(groups, costs, ch, families) for ch, _ in points])
    m = np.array([max(k, 1e-12) for _, k in points])
    total = np.maximum(p.sum(1), 1e-12)
    w = np.ones(len(points))
    if sizes is not None and target_size:
        w = 1.0 / (1.0 + 8.0 * np.abs(np.log2(np.asarray(sizes, dtype=np.float64) / target_size)))
    common = float(np.exp(np.average(np.log(m / total), weights=w)))
    # relative residuals of s = common * (1 + u): (p @ s) / m - 1 = a @ u + (a.sum(1) - 1), a = p * common / m
    a = p * common / m[:, None]
    sw = np.sqrt(w)[:, None]
    lhs = np.vstack([a * sw, np.sqrt(RIDGE) * np.eye(len(families))])
    rhs = np.concatenate([(1.0 - a.sum(1)) * sw[:, 0], np.zeros(len(families))])
    u = np.linalg.lstsq(lhs, rhs, rcond=None)[0]
    s = np.clip(common * (1.0 + u), common / SPREAD, common * SPREAD)
    return {f: float(v) for f, v in zip(families, s, strict=True)}


def corrected(groups: Sequence[Group], costs: Sequence[Sequence[float]],
              scales: dict[str, float]) -> list[list[float]]:  # fmt: skip
    """The costs with each group's family scale applied (the knapsack's objective)."""
    return [[scales[family_key(g)] * c for c in row] for g, row in zip(groups, costs, strict=True)]


def uniform_choice(group: Group, label: str) -> int:
    """The option of ``group`` for ``label``; where the group has none (an IQ type without imatrix rows,
    a fallback shared with another label), the option whose types are nearest in bits per weight."""
    for j, o in enumerate(group.options):
        if o.label == label:
            return j
    want = _bpw(Q[label])
    return min(range(len(group.options)),
               key=lambda j: abs(np.mean([_bpw(t) for t in group.options[j].types]) - want))  # fmt: skip


def _bpw(t: Q) -> float:
    qt = get_type(t.name)
    return 8 * qt.type_size / qt.block_size
