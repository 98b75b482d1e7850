"""``dilated``: multi-scale dilated attention, MSDA (Jiao et al., 2023, "DilateFormer").

The heads are split into as many groups as there are dilation rates; group g
attends, around each query, to a k x k window of keys dilated by rate r_g
(``functional.dilated_attention``); the groups are concatenated and projected,
as in DilateFormer's ``MultiDilatelocalAttention``: one qkv projection C -> 3C
whose channels are (q|k|v, head, d) with consecutive heads forming a group, a
kernel per group, an output projection C -> C. The paper's block is
``heads=3, dilations=[1, 2, 3]`` (3, 6 or 12 heads at widths 72, 144, 288);
the defaults here, 8 heads over dilations [1, 2, 3, 4] (two heads per rate),
divide the widths 32 to 256 that the suite's networks use (see
``configs/attn/dilated.yaml``).

On point sets the k x k window becomes a dilated k-nearest neighbourhood:
each point attends to every r-th of its K*r nearest points (K = kernel_size**2
unless ``neighbours`` says otherwise; the nearest is the point itself). Where a
set has fewer than K*r points, a point takes every r-th of all of them, so
ceil(N / r) neighbours. The K*r_max nearest come from one
:func:`attention.pointops.knn` (exact, ties to the lower index; a grid search
above 2**24 pairs), so memory is O(N K r_max), never the N x N matrix.

Options:
    heads: heads in all; a multiple of the number of dilation rates, dividing dim.
    dilations: one rate per head group, each >= 1 (a bare integer is one rate).
    kernel_size: odd window side k >= 1 on grids; K = k*k neighbours on points.
    border: "zeros" (the paper's zero padding: a key outside the grid is a zero
        vector that still takes part in the softmax) or "mask" (left out of it).
    neighbours: K on point sets; None for kernel_size**2.
    qkv_bias: bias of the qkv projection.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from einops import rearrange
from torch import nn

from .. import functional
from ..base import Mixer, check_bool, check_positive
from ..errors import UserError
from ..layout import Grid
from ..pointops import knn
from ..registry import register


@register("dilated")
class DilatedAttention(Mixer):
    complexity = "linear"  # k x k windows at fixed rates
    layouts = frozenset({"grid", "points"})
    layout_options = {"border": frozenset({"grid"}), "neighbours": frozenset({"points"})}

    def __init__(self, dim: int, heads: int = 8, dilations: Sequence[int] = (1, 2, 3, 4), kernel_size: int = 3,
                 border: str = "zeros", neighbours: int | None = None, qkv_bias: bool = True):
        super().__init__(dim, heads)
        self.dilations = self._check_dilations(dilations)
        if heads % len(self.dilations):
            raise UserError(f"attn.heads={heads} is invalid for attention variant {self.name!r}: the heads are "
                            f"split into one group per dilation rate (attn.dilations={list(self.dilations)}), so "
                            f"heads must be a multiple of {len(self.dilations)} that divides the channel count {dim}.")
        check_positive("kernel_size", kernel_size, self.name)
        if kernel_size % 2 == 0:
            raise UserError(f"attn.kernel_size={kernel_size} is invalid for attention variant {self.name!r}: "
                            f"the window is centred on its query, so expected an odd integer >= 1 (e.g. 3).")
        if border not in functional.DILATED_BORDERS:
            raise UserError(f"attn.border={border!r} is invalid for attention variant {self.name!r}: expected one "
                            f"of {', '.join(repr(b) for b in functional.DILATED_BORDERS)}.")
        if neighbours is not None:
            check_positive("neighbours", neighbours, self.name)
        check_bool("qkv_bias", qkv_bias, self.name)
        self.kernel_size = kernel_size
        self.border = border
        self.neighbours = kernel_size ** 2 if neighbours is None else neighbours
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def _check_dilations(self, dilations) -> tuple[int, ...]:
        rates = (dilations,) if isinstance(dilations, int) and not isinstance(dilations, bool) else dilations
        ok = (isinstance(rates, Sequence) and not isinstance(rates, str) and len(rates) > 0
              and all(isinstance(r, int) and not isinstance(r, bool) and r >= 1 for r in rates))
        if not ok:
            raise UserError(f"attn.dilations={dilations!r} is invalid for attention variant {self.name!r}: "
                            f"expected a non-empty list of integers >= 1, one rate per head group, e.g. [1, 2, 3].")
        return tuple(int(r) for r in rates)

    def mix(self, x, layout):
        # q, k, v: (B, heads, N, d) views of the qkv projection
        q, k, v = rearrange(self.qkv(x), "b n (three h d) -> three b h n d", three=3, h=self.heads)
        if isinstance(layout, Grid):  # every head group at its rate in one call: one launch a kernel on a GPU
            out = functional.dilated_attention(q, k, v, (layout.h, layout.w), self.kernel_size, self.dilations,
                                               self.border)  # (B, heads, N, d)
        else:
            out = self._mix_points(q, k, v, layout)  # (B, heads, N, d)
        return self.proj(rearrange(out, "b h n d -> b n (h d)"))

    def _mix_points(self, q, k, v, layout):
        """Each point against every r-th of its K*r nearest points, r its head group's rate: q, k, v (B, heads, N, d)
        -> (B, heads, N, d), by :func:`functional.index_attention` (fused Triton kernels on a GPU, chunks of
        gathered rows in torch elsewhere), never holding the (B, heads, N, K, d) keys and values.

        The batch is flattened: q, k, v go in as (B N, heads d) row views of the qkv projection, sample b's points
        rows b N + j, and group g's table holds every r_g-th of each point's nearest rows: one call for all the
        groups where their tables are as long (G, B N, K), else (a set smaller than K r_max) a call per group on
        its heads' channels. The K r_max nearest are searched once, and the tables made once, for all the layers
        that share the layout (:meth:`attention.Points.memo`).
        """
        b, heads, n, d = q.shape
        kr = min(self.neighbours * max(self.dilations), len(layout))
        nearest = layout.memo(("knn", kr), lambda: knn(layout.xyz, layout.xyz, kr))  # (B, N, K r_max), nearest first

        def tables():
            first = (torch.arange(b, device=nearest.device) * n).view(b, 1, 1)  # (B, 1, 1) first row of each sample
            per_rate = [(nearest[:, :, :self.neighbours * r:r] + first).view(b * n, -1)  # (B N, K_g) rows
                        for r in self.dilations]
            return torch.stack(per_rate) if len({t.shape[1] for t in per_rate}) == 1 else per_rate  # (G, B N, K)

        idx = layout.memo(("dilated rows", kr, self.neighbours, tuple(self.dilations)), tables)
        # (B, heads, N, d) -> (B, N, heads, d) -> (B N, heads d): views of the qkv projection (rows 3C apart)
        rows = [t.transpose(1, 2).reshape(b * n, -1) for t in (q, k, v)]
        if isinstance(idx, torch.Tensor):
            out = functional.index_attention(*rows, idx, heads)  # (B N, heads d)
        else:
            per = heads // len(self.dilations) * d  # a group's channels
            out = torch.cat([functional.index_attention(*(t[:, g * per:(g + 1) * per] for t in rows), table,
                                                        heads // len(self.dilations))
                             for g, table in enumerate(idx)], dim=1)  # (B N, heads d)
        return out.view(b, n, heads, d).transpose(1, 2)  # (B, heads, N, d)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, dilations={list(self.dilations)}, kernel_size={self.kernel_size}, "
                f"border={self.border!r}, neighbours={self.neighbours}")
