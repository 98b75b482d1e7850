"""Where tokens sit: the second argument of every mixer.

Global variants ignore the layout; local variants (focal, dilated) need it to
know which tokens are neighbours. A mixer declares which layouts it serves
(``Mixer.layouts``) instead of guessing a grid from N.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from .tensor_cache import under_fake_mode

T = TypeVar("T")


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
    """A point set: ``xyz`` of shape (B, N, 3), token n of sample b sits at xyz[b, n].

    A network passes one layout to all its attention layers, and what a local variant derives from the points
    alone (dilated's nearest neighbours, focal's regions and order) is the same in each: :meth:`memo` keeps it on
    the layout, so that PCT's four blocks search their neighbours once a forward instead of four times.
    """

    xyz: torch.Tensor
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    kind = "points"

    def __post_init__(self):
        if self.xyz.dim() != 3 or self.xyz.shape[-1] != 3:
            raise ValueError(f"Points(xyz) needs xyz of shape (B, N, 3), got {tuple(self.xyz.shape)}.")

    def __len__(self) -> int:
        return self.xyz.shape[1]

    def memo(self, key: Hashable, make: Callable[[], T]) -> T:
        """``make()``, a function of the points alone named by ``key`` (the deriving code and its options), made
        once for this layout and kept while ``xyz`` is not changed in place (its version counter is part of the
        key). Made anew under torch.compile (dynamo traces ``make`` into the graph: a dict on the layout is not
        state a graph can keep) and under a fake mode (its tensors would be fake)."""
        if torch.compiler.is_compiling() or under_fake_mode():
            return make()
        try:
            version = self.xyz._version
        except RuntimeError:  # an inference-mode tensor keeps no version; it cannot change outside inference mode
            version = None
        stamp = (key, version)
        if stamp not in self._memo:
            self._memo[stamp] = make()
        return self._memo[stamp]


def kind_of(layout) -> str:
    """'grid', 'points' or 'none'."""
    return "none" if layout is None else layout.kind
