"""What the variants are measured against, in the same process:

- :class:`DilateAttention`: DilateFormer's ``nn.Unfold`` dilated attention as published, and
  :func:`unfold_dilated_attention`, the same on this suite's (B, heads, N, d) layout;
- :class:`MaterialisedAttention`: ``self``'s mixer computing softmax(q k^T) v with the N x N matrix in memory,
  the textbook O(N^2) attention (``self`` itself runs SDPA, whose fused kernels need not hold that matrix);
- :class:`UnfoldDilatedAttention`: ``dilated``'s mixer with DilateFormer's ``nn.Unfold`` kernel in place of
  the shifted-view one (grids only, as the paper).

The two mixers are subclasses of the registered variants, unregistered, so ``attention.names()`` is unchanged.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import nn

import attention
from attention.layout import Grid

# --------------------------------------------------------------------------------------------
# DilateFormer's DilateAttention (github.com/JIAOJIAYUASD/dilateformer), as published
# --------------------------------------------------------------------------------------------


class DilateAttention(nn.Module):
    """Implementation of Dilate-attention (DilateFormer's code; attention dropout left at 0)."""

    def __init__(self, head_dim, qk_scale=None, attn_drop=0, kernel_size=3, dilation=1):
        super().__init__()
        self.head_dim = head_dim
        self.scale = qk_scale or head_dim ** -0.5
        self.kernel_size = kernel_size
        self.unfold = nn.Unfold(kernel_size, dilation, dilation * (kernel_size - 1) // 2, 1)
        self.attn_drop = nn.Dropout(attn_drop)

    def forward(self, q, k, v):
        # B, C//3, H, W
        B, d, H, W = q.shape
        q = q.reshape([B, d // self.head_dim, self.head_dim, 1, H * W]).permute(0, 1, 4, 3, 2)  # B,h,N,1,d
        k = self.unfold(k).reshape(
            [B, d // self.head_dim, self.head_dim, self.kernel_size * self.kernel_size, H * W]
        ).permute(0, 1, 4, 2, 3)  # B,h,N,d,k*k
        attn = (q @ k) * self.scale  # B,h,N,1,k*k
        attn = attn.softmax(dim=-1)
        attn = self.attn_drop(attn)
        v = self.unfold(v).reshape(
            [B, d // self.head_dim, self.head_dim, self.kernel_size * self.kernel_size, H * W]
        ).permute(0, 1, 4, 3, 2)  # B,h,N,k*k,d
        x = (attn @ v).transpose(1, 2).reshape(B, H, W, d)
        return x


def unfold_dilated_attention(q, k, v, grid, kernel_size=3, dilation=1, scale=None):
    """DilateAttention on our layout: q, k, v (B, heads, N, d) -> (B, heads, N, d), zero-padded borders."""
    (h, w), (B, H, N, d) = grid, q.shape

    def to_image(t):  # (B, heads, N, d) -> (B, heads * d, h, w), DilateFormer's channel order
        return t.permute(0, 1, 3, 2).reshape(B, H * d, h, w)

    out = DilateAttention(d, scale, 0, kernel_size, dilation)(*map(to_image, (q, k, v)))  # (B, h, w, H*d)
    return out.reshape(B, N, H, d).permute(0, 2, 1, 3)  # (B, heads, N, d)


# --------------------------------------------------------------------------------------------
# Baseline mixers: the registered variants' projections with another kernel
# --------------------------------------------------------------------------------------------

class MaterialisedAttention(attention.get("self")):
    """softmax(q k^T * scale) v with the (B, heads, N, N) matrix materialised; ``self``'s options and projections."""

    name = "materialised"
    complexity = "quadratic"  # the reference N^2 of the benchmark's exponent targets

    def mix(self, x, layout):
        q, k, v = self.qkv(x).split([self.qk_dim, self.qk_dim, self.v_dim], dim=-1)  # (B, N, C'), each
        if self.kv_pool > 1:
            k, v = self._pool(k, layout), self._pool(v, layout)  # (B, M, C')
        q, k, v = (rearrange(t, "b n (h d) -> b h n d", h=self.heads) for t in (q, k, v))
        scale = q.shape[-1] ** -0.5 if self.scale is None else self.scale
        attn = torch.softmax((q * scale) @ k.transpose(-2, -1), dim=-1)  # (B, h, N, M): the whole matrix
        return self.proj(rearrange(attn @ v, "b h n d -> b n (h d)"))


class UnfoldDilatedAttention(attention.get("dilated")):
    """``dilated``'s mixer (qkv projection, one head group per rate, output projection) with DilateFormer's
    ``nn.Unfold`` kernel; zero borders, grids only."""

    name = "unfold"
    layouts = frozenset({"grid"})

    def __init__(self, dim: int, **options):
        if options.get("border", "zeros") != "zeros":
            raise ValueError("the nn.Unfold baseline pads with zeros: it has no border='mask'.")
        super().__init__(dim, **options)

    def mix(self, x, layout):
        if not isinstance(layout, Grid):  # pragma: no cover - check_input refuses other layouts first
            raise ValueError("the nn.Unfold baseline works on grids only.")
        q, k, v = rearrange(self.qkv(x), "b n (three h d) -> three b h n d", three=3, h=self.heads)
        per_group = self.heads // len(self.dilations)
        groups = [slice(g * per_group, (g + 1) * per_group) for g in range(len(self.dilations))]
        out = [unfold_dilated_attention(q[:, g], k[:, g], v[:, g], (layout.h, layout.w), self.kernel_size, r)
               for g, r in zip(groups, self.dilations)]  # (B, heads / groups, N, d) each
        return self.proj(rearrange(torch.cat(out, dim=1), "b h n d -> b n (h d)"))


BASELINES = {"materialised": (MaterialisedAttention, "self"), "unfold": (UnfoldDilatedAttention, "dilated")}
"""Baseline name -> (mixer class, the variant whose options it takes)."""
