"""``self``: multi-head softmax self-attention (Vaswani et al., 2017) through SDPA.

Defaults are the transformer's block: queries, keys and values of ``dim``
channels, scale d^-0.5, output projection. The options also give SAGAN's
block (Zhang et al., 2019; StudioGAN's ``ops.SelfAttention``)::

    heads=1, qk_ratio=8, v_ratio=2, kv_pool=2, scale=1.0, qkv_bias=false, proj_bias=false, separate_qkv=true

queries and keys of C/8 channels, values of C/2, keys and values max-pooled
2x2 on the grid, no scaling of the logits, output projection C/2 -> C.
``separate_qkv=true`` makes queries, keys and values three layers (``q``,
``k``, ``v``, StudioGAN's theta, phi and g) instead of one stacked ``qkv``:
the same function, but a spectral norm (SAGAN normalises every layer) then
normalises each of the three matrices, as StudioGAN does, not their stack.

``kv_pool=p`` pools keys and values by p x p max-pooling on a ``Grid`` (sides
divisible by p); on ``Points`` it max-pools over the p*p nearest neighbours of
N / p^2 farthest-point-sampled centres, the point-set analogue (sampling starts at the point farthest from the
centroid, so the output does not depend on the order of the points).

``fused=false`` computes softmax(q k^T) v in plain ops instead of SDPA's fused
kernels, whose backward cannot be differentiated again: a discriminator with a
gradient penalty (R1, WGAN-GP) needs it (as timm's ``fused_attn=False``).
"""

from __future__ import annotations

import math

import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .. import functional
from ..base import Mixer, check_bool, check_divides, check_positive
from ..errors import UserError
from ..layout import Grid, Points
from ..pointops import farthest_from_centroid, farthest_point_sample, gather, knn
from ..registry import register


@register("self")
class SelfAttention(Mixer):
    complexity = "quadratic"  # the N x N map (SDPA may not hold it)

    def __init__(self, dim: int, heads: int = 4, qkv_bias: bool = True, qk_ratio: int = 1, v_ratio: int = 1,
                 kv_pool: int = 1, scale: float | None = None, proj_bias: bool = True, separate_qkv: bool = False,
                 fused: bool = True):
        super().__init__(dim, heads)
        check_divides("qk_ratio", qk_ratio, dim, self.name)
        check_divides("v_ratio", v_ratio, dim, self.name)
        check_positive("kv_pool", kv_pool, self.name)
        self.qk_dim, self.v_dim = dim // qk_ratio, dim // v_ratio
        check_divides("heads", heads, self.qk_dim, self.name, what="the query/key channels dim/qk_ratio")
        check_divides("heads", heads, self.v_dim, self.name, what="the value channels dim/v_ratio")
        # a number, not float(scale): float() takes strings ("abc" raised its own ValueError) and inf, whose logits
        # inf * 0 made every output NaN
        if scale is not None and not (isinstance(scale, (int, float)) and not isinstance(scale, bool)
                                      and math.isfinite(scale) and scale > 0):
            raise UserError(f"attn.scale={scale!r} is invalid for attention variant 'self': expected a finite "
                            "positive number, or null for d^-0.5.")
        for option, value in (("qkv_bias", qkv_bias), ("proj_bias", proj_bias), ("separate_qkv", separate_qkv)):
            check_bool(option, value, self.name)
        if not isinstance(fused, bool):
            raise UserError(f"attn.fused={fused!r} is invalid for attention variant 'self': expected true (SDPA's "
                            "fused kernels) or false (plain ops, which a gradient penalty can differentiate twice).")
        self.kv_pool, self.fused = kv_pool, fused
        self.scale = None if scale is None else float(scale)
        if separate_qkv:
            self.q, self.k = (nn.Linear(dim, self.qk_dim, bias=qkv_bias) for _ in range(2))
            self.v = nn.Linear(dim, self.v_dim, bias=qkv_bias)
        else:
            self.qkv = nn.Linear(dim, 2 * self.qk_dim + self.v_dim, bias=qkv_bias)
        self.separate_qkv = separate_qkv
        self.proj = nn.Linear(self.v_dim, dim, bias=proj_bias)

    def mix(self, x, layout):
        if self.separate_qkv:
            q, k, v = self.q(x), self.k(x), self.v(x)  # (B, N, C'), each
        else:
            q, k, v = self.qkv(x).split([self.qk_dim, self.qk_dim, self.v_dim], dim=-1)  # (B, N, C'), each
        if self.kv_pool > 1:
            k, v = self._pool(k, layout), self._pool(v, layout)  # (B, M, C'), M = N / kv_pool^2
        q, k, v = (rearrange(t, "b n (h d) -> b h n d", h=self.heads) for t in (q, k, v))
        out = functional.softmax_attention(q, k, v, scale=self.scale, fused=self.fused)  # (B, h, N, d_v)
        return self.proj(rearrange(out, "b h n d -> b n (h d)"))

    def _pool(self, t, layout):
        p = self.kv_pool
        if isinstance(layout, Grid):
            if layout.h % p or layout.w % p:
                raise ValueError(f"'self' with kv_pool={p} needs grid sides divisible by {p}, got {layout!r}.")
            grid = rearrange(t, "b (h w) c -> b c h w", h=layout.h)
            return rearrange(F.max_pool2d(grid, p), "b c h w -> b (h w) c")
        if isinstance(layout, Points):
            m = max(1, len(layout) // (p * p))
            # sampling starts at the point farthest from the centroid, not at point 0: the pooled keys and values,
            # and so the output, are then the same whatever the order of the points (as focal's regions)
            start = farthest_from_centroid(layout.xyz)  # (B,)
            centres = gather(layout.xyz, farthest_point_sample(layout.xyz, m, start))  # (B, M, 3)
            groups = knn(centres, layout.xyz, min(p * p, len(layout)))  # (B, M, p*p)
            return gather(t, groups).amax(dim=2)  # (B, M, C')
        raise ValueError(f"'self' with kv_pool={p} needs a Grid or Points layout to pool keys and values over; "
                         "got none. Pass a layout, or set attn.kv_pool=1.")

    def extra_repr(self) -> str:
        extra = ""
        if (self.qk_dim, self.v_dim) != (self.dim, self.dim):
            extra += f", qk_dim={self.qk_dim}, v_dim={self.v_dim}"
        if self.kv_pool > 1:
            extra += f", kv_pool={self.kv_pool}"
        if self.scale is not None:
            extra += f", scale={self.scale}"
        if not self.fused:
            extra += ", fused=False"
        return super().extra_repr() + extra
