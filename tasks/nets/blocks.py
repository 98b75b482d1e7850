"""The blocks that put a mixer into a convolutional network, on feature maps (B, C, H, W).

A mixer (``attention.build``) maps tokens to tokens with no residual or normalisation around it; these blocks
are the papers' residuals around it, the mixer seeing the map's pixels as tokens on ``attention.Grid(H, W)``:

- :class:`ScaledResidual`: ``x + gamma * mixer(x)``, gamma a learned scalar starting at 0: SAGAN's block
  (StudioGAN's ``ops.SelfAttention`` with ``self``'s SAGAN options) and LAM's ``PositionLinearAttention``
  (``linear_taylor`` with ``qk_ratio=8 out_proj=false``);
- :class:`EANetResidual`: ``ReLU(x + BN(conv1x1(mixer(conv1x1(x)))))``: EANet's ``External_attention`` block
  (``external`` with ``in_proj=false out_proj=false``), the segmentation head's default.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

import attention


def mix_map(mixer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``mixer`` applied to the pixels of x (B, C, H, W) as tokens on their grid -> (B, C, H, W)."""
    h, w = x.shape[-2:]
    tokens = rearrange(x, "b c h w -> b (h w) c")  # (B, N, C)
    return rearrange(mixer(tokens, attention.Grid(h, w)), "b (h w) c -> b c h w", h=h)


class ScaledResidual(nn.Module):
    """``x + sigma * mixer(x)`` on a feature map; sigma (SAGAN's name; LAM's gamma) starts at 0."""

    def __init__(self, channels: int, attn: Mapping):
        super().__init__()
        self.mixer = attention.build(**attn, dim=channels)
        self.sigma = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.sigma * mix_map(self.mixer, x)


class EANetResidual(nn.Module):
    """EANet's block: ``ReLU(x + BN(conv1x1(mixer(conv1x1(x)))))`` (conv1 with a bias, conv2 without)."""

    def __init__(self, channels: int, attn: Mapping):
        super().__init__()
        self.conv_in = nn.Conv2d(channels, channels, 1)
        self.mixer = attention.build(**attn, dim=channels)
        self.conv_out = nn.Sequential(nn.Conv2d(channels, channels, 1, bias=False), nn.BatchNorm2d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.conv_out(mix_map(self.mixer, self.conv_in(x))))
