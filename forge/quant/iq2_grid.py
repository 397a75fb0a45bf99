"""Codebooks of the 8-dimensional i-quants (IQ2_XXS/XS/S, IQ1_S/M) and their neighbour maps.

Each codebook point is 8 levels l in {0, 1, 2}. ggml stores the points as 16-bit codes (2 bits per
coordinate, coordinate i at bits 2i); the pip ``gguf`` package ships exactly those codes, in the
same order, as ``grid_hex`` of its dequantizer classes, so we decode them from there instead of
carrying a copy. The quantizer works with the odd magnitudes 2l+1 in {1, 3, 5}.

The quantizer rounds every coordinate to a level and then needs the codebook point for that code:
either the code is a point, or it looks among the code's "neighbours". ggml's ``iq2xs_init_impl``
defines them as every point whose squared distance (in 2l+1 units) is among the ``nwant`` smallest
distinct distances, ordered by (distance, point index). Codes are indexed here in base 3
(c = sum l_i 3^i); only levels 0..2 ever occur, so the 3^8 = 6561 codes cover every lookup.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

N_CODES = 3**8
#: Weight of coordinate i in a base-3 code.
CODE_WEIGHTS = 3 ** np.arange(8, dtype=np.int32)

#: Queries sharing a code from which scoring them as one dense block beats the ragged path.
_DENSE_MIN_QUERIES = 24

# nwant (number of distinct distances kept) per codebook, from iq2xs_init_impl.
_NWANT = {T.IQ2_XXS: 2, T.IQ2_XS: 2, T.IQ2_S: 1, T.IQ1_S: 3, T.IQ1_M: 3}


@dataclass(frozen=True)
class Codebook:
    """One codebook with the lookup tables the encoders need."""

    #: (n_points, 8) uint8 levels in {0, 1, 2}.
    levels: np.ndarray
    #: (N_CODES,) int32: the point index of a code that is a point, else -1.
    point_of_code: np.ndarray
    #: Neighbour lists in CSR form: code c's list is ``nb_flat[nb_start[c] : nb_start[c] + nb_count[c]]``
    #: (point indices in ggml's order; empty for codes that are points).
    nb_start: np.ndarray
    nb_count: np.ndarray
    nb_flat: np.ndarray
    #: (len(nb_flat), 8) int64: the term_index columns of every neighbour-list entry.
    nb_term_cols: np.ndarray

    @property
    def magnitudes(self) -> np.ndarray:
        """(n_points, 8) float32 values 2l+1 (the IQ2 quantizer's q)."""
        return (2 * self.levels.astype(np.float32) + 1).astype(np.float32)

    def neighbours_of(self, code: int) -> np.ndarray:
        return self.nb_flat[self.nb_start[code] : self.nb_start[code] + self.nb_count[code]]

    @property
    def term_index(self) -> np.ndarray:
        """(8, n_points) int32: row i holds 3*i + l_i, the column of coordinate i's term in a (., 24) table."""
        return (3 * np.arange(8, dtype=np.int32)[:, None] + self.levels.T).astype(np.int32)

    def best_neighbour(self, codes: np.ndarray, terms: np.ndarray) -> np.ndarray:
        """Among each code's neighbours, the point of least score (the first one on ties, as ggml).

        ``terms`` (n, 8, 3) float32 holds, per query, the term of coordinate i at level l; a point's
        score is the float32 sum of its 8 terms in coordinate order, which is exactly how ggml
        accumulates its weighted distances. Queries are grouped by code: a frequent code is scored
        for all its queries at once as dense (neighbours x queries) rows, the rare ones ragged.
        """
        n = len(codes)
        out = np.empty(n, np.int32)
        order = np.argsort(codes, kind="stable")
        uniq, first, counts = np.unique(codes[order], return_index=True, return_counts=True)
        table = terms.reshape(n, 24)[order]
        tindex = self.term_index
        dense = counts >= _DENSE_MIN_QUERIES
        if dense.any():
            by_col = np.ascontiguousarray(table.T)  # (24, n): one row per (coordinate, level)
            for code, s, c in zip(uniq[dense], first[dense], counts[dense], strict=True):
                cand = self.neighbours_of(code)
                rows = tindex[:, cand]
                cols = by_col[:, s : s + c]
                acc = cols[rows[0]]
                for i in range(1, 8):
                    acc = acc + cols[rows[i]]
                out[order[s : s + c]] = cand[np.argmin(acc, axis=0)]
        rare = ~np.repeat(dense, counts)
        if rare.any():
            out[order[rare]] = self._best_ragged(codes[order[rare]], table[rare], tindex)
        return out

    def _best_ragged(self, codes: np.ndarray, table: np.ndarray, tindex: np.ndarray) -> np.ndarray:
        """Queries with few peers: walk the neighbour lists rank by rank, all queries at once."""
        n = len(codes)
        counts = self.nb_count[codes]
        order = np.argsort(-counts, kind="stable")  # longest lists first: the live queries are a prefix
        count = counts[order]
        start = self.nb_start[codes[order]]
        flat = table[order].reshape(-1)
        base = np.arange(n, dtype=np.int64)[:, None] * 24
        cols = self.nb_term_cols
        best = np.full(n, np.inf, np.float32)
        rank = np.zeros(n, np.int64)
        live_counts = np.searchsorted(-count, -np.arange(int(count[0])), side="left")
        for k, live in enumerate(live_counts):  # live = queries whose list has more than k entries
            v = flat[base[:live] + cols[start[:live] + k]]
            score = v[:, 0]
            for i in range(1, 8):
                score = score + v[:, i]
            better = score < best[:live]
            best[:live] = np.where(better, score, best[:live])
            rank[:live] = np.where(better, k, rank[:live])
        out = np.empty(n, np.int32)
        out[order] = self.nb_flat[start + rank]
        return out


def grid_codes(gtype: T) -> np.ndarray:
    """ggml's 16-bit point codes (kgrid_2bit_256/512/1024, kgrid_1bit_2048) for a type."""
    cls = getattr(gguf_quants, gtype.name)
    return np.frombuffer(bytes.fromhex(cls.grid_hex.decode()), dtype="<u2").astype(np.int32)


def _levels_of(codes: np.ndarray) -> np.ndarray:
    return ((codes[:, None] >> (2 * np.arange(8))) & 3).astype(np.uint8)


def neighbour_lists(levels: np.ndarray, nwant: int, query_levels: np.ndarray) -> list[np.ndarray]:
    """ggml's neighbour list of each query code (rows of levels): see the module docstring."""
    pts = 2 * levels.astype(np.int16) + 1
    q = 2 * query_levels.astype(np.int16) + 1
    d2 = ((q[:, None, :] - pts[None, :, :]) ** 2).sum(-1, dtype=np.int16)  # (n_query, n_points)
    order = np.argsort(d2, axis=1, kind="stable")  # ties by point index, as qsort on (d2, j)
    sorted_d2 = np.take_along_axis(d2, order, axis=1)
    # Rank of each sorted distance among the row's distinct distances; keep ranks < nwant.
    new_value = np.concatenate([np.ones((len(q), 1), bool), sorted_d2[:, 1:] != sorted_d2[:, :-1]], axis=1)
    rank = np.cumsum(new_value, axis=1) - 1
    counts = (rank < nwant).sum(1)
    return [order[r, : counts[r]].astype(np.int32) for r in range(len(q))]


def codebook(gtype: T) -> Codebook:
    """The codebook of an IQ2/IQ1 type (IQ1_S and IQ1_M share one), built once per process."""
    return _codebook(T.IQ1_S if gtype == T.IQ1_M else gtype)


@cache
def _codebook(gtype: T) -> Codebook:
    levels = _levels_of(grid_codes(gtype))
    if levels.max() > 2:
        raise AssertionError(f"{gtype.name}: codebook level above 2")
    point_codes = levels.astype(np.int32) @ CODE_WEIGHTS
    point_of_code = np.full(N_CODES, -1, np.int32)
    point_of_code[point_codes] = np.arange(len(levels), dtype=np.int32)

    off = np.flatnonzero(point_of_code < 0)
    all_levels = ((np.arange(N_CODES)[:, None] // CODE_WEIGHTS) % 3).astype(np.uint8)
    lists: list[np.ndarray] = []
    for start in range(0, len(off), 1024):  # bounded memory for the 2048-point codebook
        lists += neighbour_lists(levels, _NWANT[gtype], all_levels[off[start : start + 1024]])
    nb_count = np.zeros(N_CODES, np.int32)
    nb_count[off] = [len(x) for x in lists]
    nb_start = (np.cumsum(nb_count) - nb_count).astype(np.int32)
    nb_flat = np.concatenate(lists).astype(np.int32)
    term_cols = (3 * np.arange(8) + levels[nb_flat].astype(np.int64)).astype(np.int64)
    for arr in (levels, point_of_code, nb_start, nb_count, nb_flat, term_cols):
        arr.flags.writeable = False
    return Codebook(levels, point_of_code, nb_start, nb_count, nb_flat, term_cols)
