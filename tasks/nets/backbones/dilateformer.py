"""``dilateformer_t|s|b``: DilateFormer (Jiao et al., 2023, "DilateFormer: Multi-Scale Dilated Transformer
for Visual Recognition"), after the official ``models/dilateformer.py`` (JIAOJIAYUASD/dilateformer).

    image (B, 3, H, W)
    stem       overlapping conv embedding: 3x3 convs 3->16 (s1), 16->32 (s2), 32->64 (s1), 64->C (s2),
               BN + GELU after all but the last, no biases                                   -> (B, C, H/4, W/4)
    stage i    depths[i] blocks of width C*2^i, heads[i] heads:
               x + DWConv3x3(x)                (conditional position encoding, every block)
               x + DropPath(mixer(LN(x)))      stages 1-2: MSDA (``dilated``, kernel 3, dilations [1, 2, 3]);
                                               stages 3-4: global multi-head self-attention (``self``)
               x + DropPath(MLP(LN(x)))        MLP ratio 4, GELU; LN eps 1e-6
               then (stages 1-3) conv merging: Conv3x3 stride 2 (bias) + BatchNorm, C -> 2C
    head       LN, average pooling, Linear

Published (paper, Table 2; ImageNet-1K at 224): T 17.2M params / 3.2 GFLOPs / 82.1%, S 24.2M / 4.8G / 83.3%,
B 47.2M / 10.0G / 84.4% (FLOPs are multiply-adds, counted with fvcore by the official ``check_model.py``).
Specs: T depths [2, 2, 6, 2], width 72; S [3, 5, 8, 3], 72; B [4, 8, 10, 3], 96; heads [3, 6, 12, 24];
qkv bias on; drop path 0.1 (the official training script's default) for T; 0.2 / 0.3 for S / B are
our choice (Swin-style scaling), not a published figure.

``attn=X`` replaces the MSDA of stages 1-2 (``model.local_stages`` says which stages are local);
``model.global_attn`` names the mixer of the other stages (``self`` as the paper). With ``attn=dilated``
the paper's ``kernel_size=3, dilations=[1, 2, 3]`` replace the generic ``configs/attn/dilated.yaml``
values unless those were changed (see :mod:`.common`). The official MSDA takes q/k/v from a 1x1
conv; ours from a Linear, the same map. Inputs: sides multiples of 32 (``model.pad=true`` pads).

Published weights: ``model.weights=PATH`` loads the official checkpoints (``{"model": state_dict, ...}`` as the
official ``main.py`` saves them) through :meth:`DilateFormer.from_official`, into a network with the paper's
options (``attn=dilated``, ``local_stages=[1, 2]``, ``global_attn=self``) and a 1000-class head.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import ClassVar

import torch
from einops import rearrange
from torch import nn

import attention
from attention.errors import UserError
from attention.variants.dilated import DilatedAttention

from .common import Backbone, Block, attn_defaults, drop_path_rates, init_linears, make_mixer, per_stage
from .registry import register

PRESETS = {"kernel_size": 3, "dilations": [1, 2, 3]}  # the paper's MSDA


def overlapping_stem(in_chans: int, hidden: int, dim: int) -> nn.Sequential:
    """Four 3x3 convs, strides 1, 2, 1, 2 (official ``PatchEmbed(patch_way='overlaping')``)."""
    widths = [in_chans, hidden, 2 * hidden, 4 * hidden]
    layers = []
    for i, stride in enumerate((1, 2, 1)):
        layers += [nn.Conv2d(widths[i], widths[i + 1], 3, stride, 1, bias=False), nn.BatchNorm2d(widths[i + 1]),
                   nn.GELU()]
    layers.append(nn.Conv2d(widths[3], dim, 3, 2, 1, bias=False))
    return nn.Sequential(*layers)


class CPEBlock(nn.Module):
    """DilateFormer's block on a map (B, C, H, W): ``x + DWConv3x3(x)``, then a pre-norm transformer block."""

    def __init__(self, dim: int, mixer: nn.Module, mlp_ratio: float, drop_path: float):
        super().__init__()
        self.pos_embed = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
        self.block = Block(dim, mixer, mlp_ratio, drop_path, norm_layer=lambda d: nn.LayerNorm(d, eps=1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2:]
        x = x + self.pos_embed(x)
        tokens = self.block(rearrange(x, "b c h w -> b (h w) c"), attention.Grid(h, w))  # (B, N, C)
        return rearrange(tokens, "b (h w) c -> b c h w", h=h)


@register("dilateformer_t", "dilateformer_s", "dilateformer_b")
class DilateFormer(Backbone):
    """The architecture's options: configs/model/dilateformer_{t,s,b}.yaml."""

    native_attn = "dilated"
    official_weights: ClassVar[str] = ("DilateFormer's ImageNet-1K checkpoints (JIAOJIAYUASD/dilateformer, "
                                       "models/dilateformer.py's Dilateformer: dilateformer_tiny/small/base)")

    def __init__(self, name: str, attn: Mapping, num_classes: int, img_size: int, in_chans: int = 3, *,
                 embed_dim: int, depths, heads, mlp_ratio: float, drop_path_rate: float, local_stages,
                 global_attn: str, stem_channels: int, pad: bool):
        super().__init__()
        self.model_name, self.pad = name, bool(pad)
        n = len(depths)
        heads = per_stage(name, "heads", heads, n)
        bad = [s for s in local_stages if not (isinstance(s, int) and 1 <= s <= n)]
        if bad:
            raise UserError(f"model.local_stages={list(local_stages)} names stages {bad} that model={name} does not "
                            f"have: expected numbers from 1 to {n}.")
        self.size_divisor = self.min_size = 4 * 2 ** (n - 1)
        widths = [embed_dim * 2 ** i for i in range(n)]
        rates = drop_path_rates(drop_path_rate, depths)
        global_cfg = dict(attn) if global_attn == attn["name"] else {"name": global_attn, **attn_defaults(global_attn)}
        self.stem = overlapping_stem(in_chans, stem_channels, embed_dim)
        self.stages, self.downsamples = nn.ModuleList(), nn.ModuleList()
        for i, (dim, depth) in enumerate(zip(widths, depths)):
            local = i + 1 in local_stages
            cfg = attn if local else global_cfg
            presets = PRESETS if cfg["name"] == self.native_attn else None
            kind = "local" if local else "global"
            self.stages.append(nn.Sequential(*(
                CPEBlock(dim, make_mixer(cfg, dim, heads[i], model=name, stage=f"stage {i + 1} ({kind})",
                                         presets=presets), mlp_ratio, rates[i][j])
                for j in range(depth))))
            self.downsamples.append(nn.Sequential(nn.Conv2d(dim, 2 * dim, 3, 2, 1), nn.BatchNorm2d(2 * dim))
                                    if i < n - 1 else nn.Identity())
        self._add_head(widths, [4 * 2 ** i for i in range(n)], num_classes, eps=1e-6)
        # The official MSDA's qkv is a 1x1 Conv2d, which its _init_weights (Linear and LayerNorm only) leaves at
        # PyTorch's conv init: kaiming_uniform(a=sqrt(5)) weights and U(+-1/sqrt(C)) biases over fan_in C, which is
        # what nn.Linear's own reset_parameters drew when ours was built, so those are kept. Every other official
        # conv (stem, CPE, merging) is a Conv2d here too, also left at PyTorch's init.
        msda_qkv = {m.qkv for m in self.stages.modules() if isinstance(m, DilatedAttention)}
        init_linears(self, skip=lambda m: m in msda_qkv)

    @staticmethod
    def from_official(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The official ``Dilateformer`` state dict in this network's keys.

        Renames: ``patch_embed.proj.<i>`` -> ``stem.<i>`` (the same Sequential positions, BatchNorm buffers
        included), ``stages.<i>.blocks.<j>.pos_embed`` -> ``stages.<i>.<j>.pos_embed``, the rest of a block
        (``norm1``, ``attn``, ``norm2``, ``mlp``) under ``stages.<i>.<j>.block``, ``stages.<i>.downsample.proj``
        -> ``downsamples.<i>``; ``norm`` and ``head`` keep their names. The MSDA's ``qkv`` is a 1x1 Conv2d,
        weight (3C, C, 1, 1): the Linear's (3C, C) with the same channel order (q|k|v, then dilation groups,
        then heads), so it is squeezed; the global blocks' ``qkv`` is a Linear already.
        """
        out = {}
        for key, value in state.items():
            if key.startswith("patch_embed.proj."):
                key = "stem." + key[len("patch_embed.proj."):]
            elif match := re.fullmatch(r"stages\.(\d+)\.blocks\.(\d+)\.(.+)", key):
                stage, block, rest = match.groups()
                key = f"stages.{stage}.{block}." + (rest if rest.startswith("pos_embed.") else f"block.{rest}")
                if rest == "attn.qkv.weight" and value.dim() == 4:  # (3C, C, 1, 1): a 1x1 conv
                    value = value.flatten(1)  # (3C, C)
            elif match := re.fullmatch(r"stages\.(\d+)\.downsample\.proj\.(.+)", key):
                key = f"downsamples.{match[1]}.{match[2]}"
            out[key] = value
        return out

    def _forward(self, x):
        return self._stages_forward(x)

