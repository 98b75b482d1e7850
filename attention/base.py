"""The mixer base class: the contract every variant implements.

A mixer maps tokens x of shape (B, N, C) to (B, N, C) with its own
projections and no residual or normalisation around it; the task's network
owns the block. ``forward(x, layout)`` takes ``attention.Grid``,
``attention.Points`` or ``None``.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from .errors import UserError
from .layout import Grid, Points, kind_of


def check_positive(name: str, value, variant: str, minimum: int = 1):
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise UserError(f"attn.{name}={value!r} is invalid for attention variant {variant!r}: "
                        f"expected an integer >= {minimum}.")


def check_bool(name: str, value, variant: str):
    """A boolean option: true or false only. A string such as "false" (a quoted yaml value, a command line typo) is
    truthy, so it would silently switch a layer on; it is refused, as is 0/1 (not what the yaml writes)."""
    if not isinstance(value, bool):
        raise UserError(f"attn.{name}={value!r} is invalid for attention variant {variant!r}: expected true or false "
                        f"(a boolean, not a string or a number).")


def check_divides(name: str, value: int, dim: int, variant: str, what: str = "the channel count"):
    check_positive(name, value, variant)
    if dim % value:
        raise UserError(f"attn.{name}={value} does not divide {what} {dim} for attention variant {variant!r}; "
                        f"choose a divisor of {dim}.")


class Mixer(nn.Module):
    """Base class of every attention variant.

    Subclasses set ``layouts`` (which of 'grid', 'points', 'none' they serve),
    call ``super().__init__(dim, heads)`` and implement ``mix(x, layout)``.
    Options that act on one layout only are declared in ``layout_options``
    (option -> the layouts it acts on), so that run.py can refuse, before any
    data is read, an option given for a task whose layout ignores it.

    Projections: a mixer owns its input projections (x -> q, k, v) and its
    output projection. Where the surrounding block of a paper already has
    them (EANet's conv1/conv2 around its memories, LAM's module without an
    output conv), a variant lets them be switched off by the options
    ``in_proj`` and ``out_proj`` (default true), built with :meth:`projection`
    (a Linear, or the identity). A variant without these options refuses them
    as any unknown option (``attention.build``).

    ``complexity`` is how the mixer's cost grows with the token count N on a
    grid: ``"quadratic"`` (every token may attend to every other, the general
    case and so the default) or ``"linear"`` (O(N): a fixed memory, a kernel
    feature map, a fixed window). The benchmark holds a linear variant's
    measured time to an exponent of 1 and the tests its FLOPs to N, so a new
    variant says which it is here rather than in a list elsewhere. (On point
    sets the local variants' exact k-nearest-neighbour search, ``pointops.knn``,
    takes O(N k) memory and, on a grid of cells for large sets, about O(N k)
    time.)
    """

    name: ClassVar[str] = "?"  # set by @register
    layouts: ClassVar[frozenset[str]] = frozenset({"grid", "points", "none"})
    complexity: ClassVar[str] = "quadratic"
    layout_options: ClassVar[dict[str, frozenset[str]]] = {}

    def __init__(self, dim: int, heads: int):
        super().__init__()
        check_positive("dim", dim, self.name)
        check_divides("heads", heads, dim, self.name)
        self.dim = dim
        self.heads = heads

    def projection(self, cin: int, cout: int, on: bool, option: str, bias: bool = True) -> nn.Module:
        """``nn.Linear(cin, cout)``, or the identity when the option ``attn.<option>`` is false (cin == cout)."""
        check_bool(option, on, self.name)
        if on:
            return nn.Linear(cin, cout, bias=bias)
        if cin != cout:
            raise UserError(f"attn.{option}=false is impossible for attention variant {self.name!r} with these "
                            f"options: the projection maps {cin} to {cout} channels, so it cannot be the identity. "
                            f"Set attn.{option}=true, or the options that change the width (e.g. expand, qk_ratio) "
                            "back to 1.")
        return nn.Identity()

    def forward(self, x: torch.Tensor, layout: Grid | Points | None = None) -> torch.Tensor:
        self.check_input(x, layout)
        if x.numel() == 0:  # no samples or no tokens: nothing to mix (the point searches divide by the batch)
            # the empty (B, N, C) output; every parameter takes part with a zero gradient, as in a variant that
            # computes through the empty input, so that DDP's ranks agree on which parameters got one
            return x + sum(p.sum() * 0 for p in self.parameters())
        return self.mix(x, layout)

    def mix(self, x: torch.Tensor, layout) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def check_input(self, x: torch.Tensor, layout) -> None:
        kind = kind_of(layout)
        if kind not in self.layouts:
            raise ValueError(f"Attention variant {self.name!r} cannot serve layout {kind!r}; it serves "
                             f"{sorted(self.layouts)}. Use a variant that does, or pass a suitable layout.")
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"{self.name!r} mixer expects x of shape (B, N, {self.dim}), got {tuple(x.shape)}.")
        if layout is not None and len(layout) != x.shape[1]:
            # a Points layout's repr is its shape, not its coordinates (Points.__repr__)
            raise ValueError(f"{self.name!r} mixer: layout {layout!r} holds {len(layout)} tokens, x has {x.shape[1]}.")
        if isinstance(layout, Points) and layout.xyz.shape[0] != x.shape[0]:
            raise ValueError(f"{self.name!r} mixer: Points batch {layout.xyz.shape[0]} != x batch {x.shape[0]}.")

    def example_layout(self, n: int, batch: int = 1, kind: str | None = None,
                       generator: torch.Generator | None = None):
        """A layout of n tokens of ``kind`` ('points', 'grid' or 'none').

        By default the first this mixer serves of points, grid, none, so costs
        at different N are always measured on the same kind of layout. A grid
        needs a square n.
        """
        kind = kind or next(k for k in ("points", "grid", "none") if k in self.layouts)
        if kind not in self.layouts:
            raise ValueError(f"Attention variant {self.name!r} cannot serve layout {kind!r}; "
                             f"it serves {sorted(self.layouts)}.")
        if kind == "points":
            return Points(torch.rand(batch, n, 3, generator=generator))
        if kind == "grid":
            side = math.isqrt(n)
            if side * side != n:
                raise ValueError(f"a square grid of {n} tokens does not exist; use a square n or kind='points'.")
            return Grid(side, side)
        return None

    def num_params(self) -> int:
        """Trainable parameters (shared tensors counted once)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    @torch.no_grad()
    def cost(self, n: int, batch: int = 1, layout: str | None = None) -> dict[str, int]:
        """Parameters and forward FLOPs for ``batch`` x ``n`` tokens of ``dim`` channels.

        FLOPs as counted by ``torch.utils.flop_counter`` (a multiply-add is 2 FLOPs),
        on a layout of kind ``layout`` (see :meth:`example_layout`). Inputs come from
        a private generator, so a seeded run's random stream is left untouched.
        """
        generator = torch.Generator().manual_seed(0)
        # inputs of the module's dtype and device (its first floating parameter's): a float64 or half mixer's
        # projections refuse float32 inputs
        like = next((p for p in self.parameters() if p.is_floating_point()), None)
        dtype, device = (torch.get_default_dtype(), "cpu") if like is None else (like.dtype, like.device)
        x = torch.randn(batch, n, self.dim, generator=generator).to(device, dtype)
        layout = self.example_layout(n, batch, layout, generator)
        if isinstance(layout, Points):
            layout = Points(layout.xyz.to(device, dtype))
        with FlopCounterMode(display=False) as counter:
            self(x, layout)
        return {"params": self.num_params(), "flops": int(counter.get_total_flops())}

    def extra_repr(self) -> str:
        return f"dim={self.dim}, heads={self.heads}"
