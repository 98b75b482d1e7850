"""Where tokens sit: the second argument of every mixer.

Global variants ignore the layout; local variants (focal, dilated) need it to
know which tokens are neighbours. A mixer declares which layouts it serves
(``Mixer.layouts``) instead of guessing a grid from N.
"""

from __future__ import annotations

import numbers
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
        # integers only (a SymInt too: a map's size under torch.compile's dynamic shapes): Grid(2.0, 3) built and
        # then failed in len(), and Grid(True, 3) passed as a side of 1
        if not all(isinstance(s, (numbers.Integral, torch.SymInt)) and not isinstance(s, bool) and s >= 1
                   for s in (self.h, self.w)):
            raise ValueError(f"Grid(h={self.h!r}, w={self.w!r}): both sides must be integers >= 1.")

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

    def __repr__(self) -> str:
        # the shape, not the coordinates: a message naming the layout printed the whole tensor
        return f"Points(xyz of shape {tuple(self.xyz.shape)}, {self.xyz.dtype}, {self.xyz.device})"

    def memo(self, key: Hashable, make: Callable[[], T]) -> T:
        """``make()``, a function of the points alone named by ``key`` (the deriving code and its options), made
        once for this layout and kept while ``xyz`` is not changed in place (its version counter is part of the
        key). Made anew under torch.compile (dynamo traces ``make`` into the graph: a dict on the layout is not
        state a graph can keep) and under a fake mode (its tensors would be fake).

        An inference tensor (made under ``torch.inference_mode``, as Lightning's validation and test make their
        batches) keeps no version counter: its results are kept as made, so the layers of a network share one
        neighbour search at evaluation too. Changing such a tensor in place inside inference mode and calling
        mixers on the same layout again would reuse the old neighbourhoods: make a new ``Points`` for new
        coordinates (nothing in the suite changes a layout's points)."""
        if torch.compiler.is_compiling() or under_fake_mode():
            return make()
        try:
            version = self.xyz._version
        except RuntimeError:  # an inference tensor keeps no version (see above)
            version = None
        stamp = (key, version)
        if stamp not in self._memo:
            self._memo[stamp] = make()
        return self._memo[stamp]


def kind_of(layout) -> str:
    """'grid', 'points' or 'none'."""
    return "none" if layout is None else layout.kind
