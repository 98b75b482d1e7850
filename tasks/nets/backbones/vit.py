"""``vit_s``: DeiT-S (Touvron et al., 2021, "Training data-efficient image transformers"), the plain ViT.

Published (DeiT paper, Table 1): 22M parameters, 4.6 GFLOPs (multiply-adds) at
224x224, 79.8% ImageNet top-1 (no distillation). Architecture as timm's
``deit_small_patch16_224``: 16x16 patch embedding (a stride-16 conv), class
token, learned absolute position embedding, 12 pre-norm blocks of width 384
with 6 heads, MLP ratio 4, LayerNorm eps 1e-6, final LayerNorm, linear head on
the class token; drop path 0.1.

``attn=X`` replaces the mixer of every block (heads from ``model.heads``).
Deviation: a class token has no place on the patch grid, so with a variant
that needs the grid (``focal``, ``dilated``: no ``none`` layout) the network
drops the class token and classifies the average of the patch tokens (timm's
``global_pool='avg'``, 384 parameters fewer); ``model.class_token`` forces
either. Inputs of another size than ``img_size`` get the position embedding
resampled bicubically (timm's ``resample_abs_pos_embed``); sides must be
multiples of 16 (``model.pad=true`` pads). ``model.global_attn`` is accepted
for a uniform interface and ignored (ViT has no global-only stages). ``forward_features`` gives one map,
the final-normed patch tokens at stride 16.

Published weights: ``model.weights=PATH`` loads DeiT's ``deit_small_patch16_224`` checkpoint (``{"model":
state_dict, ...}``, timm's ``VisionTransformer`` layout) through :meth:`VisionTransformer.from_official`: the keys
are ours but for the patch embedding's ``patch_embed.proj``. It needs the checkpoint's image size (224:
``pos_embed`` holds 1 + 14 * 14 positions), a class token (``attn=self``) and a 1000-class head.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch
from einops import rearrange
from timm.layers import resample_abs_pos_embed, trunc_normal_
from torch import nn

from attention.errors import UserError

from ..weights import take
from .common import Backbone, Block, drop_path_rates, init_linears, make_mixer
from .registry import register


@register("vit_s")
class VisionTransformer(Backbone):
    """The architecture's options: configs/model/vit_s.yaml."""

    native_attn = "self"
    official_weights: ClassVar[str] = ("DeiT-S's ImageNet-1K checkpoint (facebookresearch/deit, timm's "
                                       "deit_small_patch16_224 layout, e.g. deit_small_patch16_224-cd65a155.pth)")

    def __init__(self, name: str, attn: Mapping, num_classes: int, img_size: int, in_chans: int = 3, *,
                 patch_size: int, embed_dim: int, depth: int, heads: int, mlp_ratio: float, drop_path_rate: float,
                 class_token, pad: bool, global_attn: str):
        super().__init__()
        self.model_name, self.pad = name, bool(pad)
        self.size_divisor = self.min_size = patch_size
        if img_size % patch_size:
            raise UserError(f"data.img_size={img_size} is not a multiple of model={name}'s patch size {patch_size}; "
                            f"use {max(patch_size, img_size // patch_size * patch_size)} or "
                            f"{-(-img_size // patch_size) * patch_size}.")
        class_token = self._resolve_class_token(class_token, attn, "patch")
        self.patch_embed = nn.Conv2d(in_chans, embed_dim, patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if class_token else None
        self.num_prefix = int(bool(class_token))
        side = img_size // patch_size
        self.grid_size = (side, side)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_prefix + side * side, embed_dim))
        rates = drop_path_rates(drop_path_rate, [depth])[0]
        self.blocks = nn.ModuleList(
            Block(embed_dim, make_mixer(attn, embed_dim, heads, model=name, stage=f"block {i + 1}",
                                        layout="none" if class_token else "grid"),
                  mlp_ratio, rates[i], norm_layer=lambda d: nn.LayerNorm(d, eps=1e-6))
            for i in range(depth))
        self._add_head([embed_dim], [patch_size], num_classes, eps=1e-6)
        self._init_weights()

    def _init_weights(self):
        trunc_normal_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            trunc_normal_(self.cls_token, std=0.02)
        embed = set(self.patch_embed.modules())
        init_linears(self, skip=lambda m: m in embed)

    @staticmethod
    def from_official(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """timm's ``VisionTransformer`` (DeiT) state dict in this network's keys: ``patch_embed.proj.*`` (timm's
        ``PatchEmbed`` module) is our ``patch_embed`` conv; every other key (``cls_token``, ``pos_embed``,
        ``blocks.<i>.{norm1,attn.qkv,attn.proj,norm2,mlp.fc1,mlp.fc2}``, ``norm``, ``head``) is the same."""
        return take(state, [("patch_embed.proj.", "patch_embed.")])

    def _pos_embed(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        pos = self.pos_embed
        if (h, w) != self.grid_size:
            pos = resample_abs_pos_embed(pos, (h, w), self.grid_size, num_prefix_tokens=self.num_prefix)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)  # (B, 1 + N, C)
        return x + pos

    def _forward(self, x):
        x = self.patch_embed(x)  # (B, C, H/16, W/16)
        h, w = x.shape[-2:]
        x = self._pos_embed(rearrange(x, "b c h w -> b (h w) c"), h, w)  # (B, prefix + N, C)
        return self._tokens_forward(x, h, w)

