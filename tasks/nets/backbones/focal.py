"""``focal_t|focal_s``: the Focal Transformer (Yang et al., 2021, "Focal Self-attention for Local-Global
Interactions in Vision Transformers"), after the official ``classification/focal_transformer.py`` and
``configs/focal_{tiny,small}_patch4_window7_224.yaml`` (microsoft/Focal-Transformer).

    image (B, 3, H, W)
    stem       Conv 4x4 stride 4 (patch size 4) + LayerNorm                                  -> (B, H/4 * W/4, 96)
    stage i    depths[i] pre-norm blocks of width 96*2^i, heads [3, 6, 12, 24]:
               x + DropPath(focal(LN(x))), x + DropPath(MLP(LN(x)))   MLP ratio 4, GELU
               focal: window 7, expand 3, focal level 2 ('fc' pooling), focal window [7, 5, 3, 1] per stage
               then (stages 1-3) merging: Conv 2x2 stride 2 + LayerNorm, C -> 2C (the official reuses
               PatchEmbed with patch size 2; ``model.use_conv_embed=true`` gives its overlapping variant:
               7x7 stride 4 stem, 3x3 stride 2 merging)
    head       LayerNorm, average pooling, Linear

Published (official README / paper Table 1, ImageNet-1K at 224, no conv embedding): Focal-T 28.9M params,
4.9 GFLOPs (multiply-adds, the official ``flops()`` counting attention by hand), 82.2% top-1; Focal-S 51.1M,
9.1G in the paper (9.4G in the README), 83.5% (README 83.6%). Drop path 0.2 (T) / 0.3 (S); no shift, no
absolute position embedding, qkv bias on, LayerNorm eps 1e-5.

As the official block, a stage whose map at ``img_size`` is no larger than the window
(min(H_i, W_i) <= window_size, e.g. stage 4 at 224: 7x7) uses one window of side min(H_i, W_i) and no
expansion (expand_size 0); so parameters depend on ``img_size`` there, as in the official code.
``attn=X`` replaces the mixer of every stage (heads from the spec). With ``attn=focal`` the paper's
window_size, expand_size, focal_level, per-stage focal_window and border replace the generic
``configs/attn/focal.yaml`` values unless those were changed (see :mod:`.common`). ``border: roll`` (the
default here, ``model.border=mask`` for the masked borders of ``configs/attn/focal.yaml``) is the official
cyclic roll of the zero-padded map that the published weights were trained with, so that with the official
options the network is the official ``FocalTransformer`` (``pool_method="fc"``, no shift) and its released
checkpoints load (:meth:`FocalTransformer.from_official`) and give its outputs; see
``attention/variants/focal.py``. Inputs: sides multiples of 32 (``model.pad=true`` pads).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch
from einops import rearrange
from torch import nn

import attention

from .common import Backbone, Block, attn_options, drop_path_rates, init_linears, make_mixer, per_stage
from .registry import register


class ConvEmbed(nn.Module):
    """Conv then LayerNorm over channels: (B, C, H, W) -> (B, C', H', W') (the official ``PatchEmbed``)."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, padding: int = 0):
        super().__init__()
        self.proj = nn.Conv2d(cin, cout, kernel, stride, padding)
        self.norm = nn.LayerNorm(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)  # (B, C', H', W')
        return rearrange(self.norm(rearrange(x, "b c h w -> b h w c")), "b h w c -> b c h w")


class FocalStage(nn.Module):
    def __init__(self, blocks: list[nn.Module]):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2:]
        layout = attention.Grid(h, w)
        x = rearrange(x, "b c h w -> b (h w) c")  # (B, N, C)
        for block in self.blocks:
            x = block(x, layout)
        return rearrange(x, "b (h w) c -> b c h w", h=h)


@register("focal_t", "focal_s")
class FocalTransformer(Backbone):
    """The architecture's options: configs/model/focal_{t,s}.yaml."""

    native_attn = "focal"
    official_weights: ClassVar[str] = ("Focal Transformer's ImageNet checkpoints (microsoft/Focal-Transformer, "
                                       "classification/focal_transformer.py, e.g. focal-tiny-is224-ws7.pth; "
                                       "with model.use_conv_embed=true the useconv ones)")

    def __init__(self, name: str, attn: Mapping, num_classes: int, img_size: int, in_chans: int = 3, *,
                 embed_dim: int, depths, heads, mlp_ratio: float, drop_path_rate: float, window_size: int,
                 expand_size: int, focal_level: int, focal_window, border: str, use_conv_embed: bool,
                 global_attn: str, pad: bool):
        super().__init__()
        self.model_name, self.pad = name, bool(pad)
        n = len(depths)
        heads = per_stage(name, "heads", heads, n)
        focal_window = per_stage(name, "focal_window", focal_window, n)
        self.size_divisor = self.min_size = 4 * 2 ** (n - 1)
        widths = [embed_dim * 2 ** i for i in range(n)]
        rates = drop_path_rates(drop_path_rate, depths)
        self.stem = ConvEmbed(in_chans, embed_dim, 7, 4, 2) if use_conv_embed else ConvEmbed(in_chans, embed_dim, 4, 4)
        self.stages, self.downsamples = nn.ModuleList(), nn.ModuleList()
        for i, (dim, depth) in enumerate(zip(widths, depths)):
            presets = force = None
            if attn["name"] == self.native_attn:
                presets = dict(window_size=window_size, expand_size=expand_size, focal_level=focal_level,
                               focal_window=focal_window[i], border=border)
                side = img_size // (4 * 2 ** i)  # the stage's map side at img_size
                if side <= attn_options(attn, presets)["window_size"]:  # the official small-map rule
                    force = dict(window_size=max(side, 1), expand_size=0)
            self.stages.append(FocalStage([
                Block(dim, make_mixer(attn, dim, heads[i], model=name, stage=f"stage {i + 1}", presets=presets,
                                      force=force), mlp_ratio, rates[i][j])
                for j in range(depth)]))
            if i == n - 1:
                self.downsamples.append(nn.Identity())
            elif use_conv_embed:
                self.downsamples.append(ConvEmbed(dim, 2 * dim, 3, 2, 1))
            else:
                self.downsamples.append(ConvEmbed(dim, 2 * dim, 2, 2))
        self._add_head(widths, [4 * 2 ** i for i in range(n)], num_classes)
        # Every Linear, the focal mixers' 'fc' pools included: the official block fills a pool with its mean
        # (1/g^2), but FocalTransformer's self.apply(_init_weights) then draws it again like every Linear.
        init_linears(self)

    def _forward(self, x):
        return self._stages_forward(x)

    @staticmethod
    def from_official(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The official ``FocalTransformer`` state dict in this network's keys.

        Renames: ``patch_embed`` -> ``stem``, ``layers.i.blocks`` -> ``stages.i.blocks``, the block's
        ``pool_layers`` -> its mixer's (``attn.pool_layers``), ``layers.i.downsample`` -> ``downsamples.i``. The
        official index buffers (``relative_position_index*``, ``valid_ind_rolled``, ``valid_ind_unfold_*``,
        ``attn_mask``) are functions of the window sizes, which the bias tables' shapes fix; the mixer computes
        them, so they are dropped.
        """
        buffers = ("relative_position_index", "valid_ind_rolled", "valid_ind_unfold_", "attn_mask")
        out = {}
        for key, value in state.items():
            if key.split(".")[-1].startswith(buffers):
                continue
            parts = key.split(".")
            if parts[0] == "patch_embed":
                key = ".".join(["stem"] + parts[1:])
            elif parts[0] == "layers" and parts[2] == "downsample":
                key = ".".join(["downsamples", parts[1]] + parts[3:])
            elif parts[0] == "layers" and parts[2] == "blocks":
                tail = ["attn"] + parts[4:] if parts[4] == "pool_layers" else parts[4:]  # the block's pools
                key = ".".join(["stages", parts[1], "blocks", parts[3]] + tail)
            out[key] = value
        return out

