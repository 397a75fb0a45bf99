"""Deterministic tensor values for the checkpoints the fixture modules make in code (glm_fixture,
deepseek4_fixture): numpy PCG64 draws in a fixed order, so the bytes do not depend on the torch version."""

from __future__ import annotations

import numpy as np
import torch


class Values:
    """numpy PCG64 draws in the order they are asked for."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.Generator(np.random.PCG64(seed))

    def normal(self, shape: tuple[int, ...], std: float, mean: float = 0.0) -> np.ndarray:
        return (
            self.rng.standard_normal(shape, dtype=np.float32) * np.float32(std) + np.float32(mean)
        ).astype(np.float32)

    def integers(self, low: int, high: int, shape: tuple[int, ...]) -> np.ndarray:
        return self.rng.integers(low, high, shape, dtype=np.int64)


def bf16(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a).to(torch.bfloat16)
