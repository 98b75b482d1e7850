"""Where tokens sit: the second argument of every mixer.

Global variants ignore the layout; local variants (focal, dilated) need it to
know which tokens are neighbours. A mixer declares which layouts it serves
(``Mixer.layouts``) instead of guessing a grid from N.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Grid:
    """An image's pixels in row-major order: token ``i * w + j`` is pixel (i, j)."""

    h: int
    w: int

    kind = "grid"

    def __post_init__(self):
        if self.h < 1 or self.w < 1:
            raise ValueError(f"Grid(h={self.h}, w={self.w}): both sides must be >= 1.")

    def __len__(self) -> int:
        return self.h * self.w


@dataclass(frozen=True, eq=False)
class Points:
    """A point set: ``xyz`` of shape (B, N, 3), token n of sample b sits at xyz[b, n]."""

    xyz: torch.Tensor

    kind = "points"

    def __post_init__(self):
        if self.xyz.dim() != 3 or self.xyz.shape[-1] != 3:
            raise ValueError(f"Points(xyz) needs xyz of shape (B, N, 3), got {tuple(self.xyz.shape)}.")

    def __len__(self) -> int:
        return self.xyz.shape[1]


def kind_of(layout) -> str:
    """'grid', 'points' or 'none'."""
    return "none" if layout is None else layout.kind
