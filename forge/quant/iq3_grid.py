"""The IQ3 grids and the search tables the IQ3 encoders use (llama.cpp's ``iq3xs_init_impl``).

An IQ3 grid point is 4 magnitudes 2l+1 with 3-bit levels l (l0..l3). Its *code* packs the levels as
l0 | l1<<3 | l2<<6 | l3<<9 (0..4095). IQ3_XXS uses 256 points, IQ3_S 512. For each code that is not
a grid point, the encoder considers every grid point at the ``nwant`` smallest distinct squared
Euclidean distances (2 for IQ3_XXS, 3 for IQ3_S), in order of (distance, grid index).

The grid points come from the ``gguf`` package's decoder tables (the same data as ggml-common.h's
iq3xxs_grid / iq3s_grid), so nothing is duplicated here; the rest is derived.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, cached_property

import numpy as np
from gguf import quants as gguf_quants

N_CODES = 1 << 12


@dataclass(frozen=True)
class IQ3Grid:
    #: (n_grid, 4) int8 levels l (0..7) of each grid point; the magnitude is 2l+1.
    levels: np.ndarray
    #: (n_grid,) uint16 code of each grid point.
    codes: np.ndarray
    #: (4096,) int32: grid index of a code, or -1 when the code is not a grid point.
    index_of_code: np.ndarray
    #: (4096, max_neighbours) int32 neighbour grid indices of each off-grid code, -1 padded.
    neighbours: np.ndarray
    #: (4096,) int32 number of neighbours (0 for codes on the grid).
    n_neighbours: np.ndarray
    #: (max_neighbours, 4096) int32: neighbours transposed, slot-major (-1 padded).
    neighbours_by_slot: np.ndarray
    #: (max_neighbours, 4, 4096) float32: magnitudes 2l+1 of each neighbour's coordinates (0 padded).
    neighbour_magnitudes: np.ndarray

    @cached_property
    def magnitudes(self) -> np.ndarray:
        """(n_grid, 4) float32 grid magnitudes 2l+1."""
        return (2 * self.levels.astype(np.float32) + 1).astype(np.float32)

    @cached_property
    def n_neighbours_u8(self) -> np.ndarray:
        return self.n_neighbours.astype(np.uint8)

    @cached_property
    def magnitudes_by_coord(self) -> np.ndarray:
        """(4, n_grid) float32: the magnitudes, coordinate-major."""
        return np.ascontiguousarray(self.magnitudes.T)


def _levels_from_gguf(qtype: type) -> np.ndarray:
    qtype.init_grid()
    values = np.asarray(qtype.grid, np.float32).reshape(qtype.grid_shape)
    if qtype is gguf_quants.IQ3_XXS:
        # decoder bytes are 4·(2l+1), except the top level stored as 62 instead of 60
        return ((values - 4) // 8).astype(np.int8)
    return ((values - 1) // 2).astype(np.int8)


def _code_levels() -> np.ndarray:
    """(4096, 4) levels of every code."""
    codes = np.arange(N_CODES)
    return np.stack([(codes >> (3 * i)) & 7 for i in range(4)], axis=1).astype(np.int8)


def build_grid(levels: np.ndarray, nwant: int) -> IQ3Grid:
    """Derive the code map and neighbour lists of a grid given its points' levels."""
    n_grid = levels.shape[0]
    codes = (levels.astype(np.uint16) << np.array([0, 3, 6, 9], np.uint16)).sum(axis=1).astype(np.uint16)
    index_of_code = np.full(N_CODES, -1, np.int32)
    index_of_code[codes] = np.arange(n_grid, dtype=np.int32)

    pos_codes = 2 * _code_levels().astype(np.int32) + 1
    pos_grid = 2 * levels.astype(np.int32) + 1
    dist2 = ((pos_codes[:, None, :] - pos_grid[None, :, :]) ** 2).sum(axis=2)  # (4096, n_grid)
    order = np.argsort(dist2, axis=1, kind="stable")  # by distance, then grid index
    sorted_d2 = np.take_along_axis(dist2, order, axis=1)
    # rank of each distinct distance along the sorted row; keep ranks < nwant
    distinct_rank = np.concatenate(
        [np.zeros((N_CODES, 1), np.int32), np.cumsum(np.diff(sorted_d2, axis=1) > 0, axis=1)], axis=1
    )
    keep = distinct_rank < nwant
    keep[index_of_code >= 0] = False
    n_neighbours = keep.sum(axis=1).astype(np.int32)
    width = int(n_neighbours.max())
    neighbours = np.where(keep[:, :width], order[:, :width], -1).astype(np.int32)
    magnitudes = np.where(keep[:, :width, None], pos_grid[order[:, :width]], 0).astype(np.float32)
    return IQ3Grid(
        levels,
        codes,
        index_of_code,
        neighbours,
        n_neighbours,
        np.ascontiguousarray(neighbours.T),
        np.ascontiguousarray(magnitudes.transpose(1, 2, 0)),
    )


@cache
def iq3xxs_grid() -> IQ3Grid:
    return build_grid(_levels_from_gguf(gguf_quants.IQ3_XXS), nwant=2)


@cache
def iq3s_grid() -> IQ3Grid:
    return build_grid(_levels_from_gguf(gguf_quants.IQ3_S), nwant=3)
