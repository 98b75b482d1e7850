"""PCT: Point Cloud Transformer (Guo et al., 2021) for shape classification.

Follows the reference PyTorch port (PCT_Pytorch, model.py ``Pct``) layer for
layer, with every attention layer's mixer built from the ``attn`` config:

    xyz (B, N, 3)
    point embedding   conv 3->64->64 + BN + ReLU
    neighbour embed.  2 x sample-and-group (FPS to 512 then 256 points, 32-NN,
                      [neighbour - centre, centre]) -> 2 x (conv + BN + ReLU) -> max
                      over neighbours: 128 then 256 channels
    transformer       conv 256->256 x 2 + BN + ReLU, then 4 offset blocks
                      x + ReLU(BN(conv(x - mixer(x)))), outputs concatenated (1024)
    head              [1024, 256 skip] -> conv 1280->1024 + BN + LeakyReLU(0.2) -> max
                      pool -> 1024->512->256->classes, BN, LeakyReLU(0.2), dropout

``embedding="point"`` is SPCT: a point embedding 3->128->128 and attention over
all input points at 128 channels, no neighbour embedding.
With ``attn=offset`` and the defaults the network has 2,876,136 trainable
parameters, the paper's 2.88M.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

import attention
from attention.errors import UserError
from attention.pointops import farthest_point_sample, gather, knn

from .weights import take

FPS_RULES = ("kernel", "plain")


def conv_bn(cin: int, cout: int, act: nn.Module | None = None) -> nn.Sequential:
    """1x1 conv (no bias) + BN + activation (ReLU by default), on (B, C, N)."""
    return nn.Sequential(nn.Conv1d(cin, cout, 1, bias=False), nn.BatchNorm1d(cout), act or nn.ReLU())


class SampleAndGroup(nn.Module):
    """PCT's ``sample_and_group`` + ``Local_op``: FPS centres, kNN groups, shared MLP, max over neighbours."""

    def __init__(self, cin: int, cout: int, samples: int, neighbours: int, fps: str = "kernel"):
        super().__init__()
        self.samples, self.neighbours, self.like_kernel = samples, neighbours, fps == "kernel"
        self.mlp = nn.Sequential(conv_bn(2 * cin, cout), conv_bn(cout, cout))

    def forward(self, xyz: torch.Tensor, feats: torch.Tensor):
        # xyz (B, N, 3), feats (B, N, C) -> new_xyz (B, S, 3), out (B, S, C_out)
        centres = farthest_point_sample(xyz, self.samples, like_kernel=self.like_kernel)  # (B, S)
        new_xyz = gather(xyz, centres)  # (B, S, 3)
        centre_feats = gather(feats, centres)  # (B, S, C)
        groups = gather(feats, knn(new_xyz, xyz, self.neighbours))  # (B, S, K, C)
        centre = centre_feats.unsqueeze(2).expand_as(groups)  # (B, S, K, C)
        x = torch.cat([groups - centre, centre], dim=-1)  # (B, S, K, 2C)
        b, s, k, c = x.shape
        x = self.mlp(x.reshape(b * s, k, c).transpose(1, 2))  # (B*S, C_out, K)
        x = x.amax(dim=-1).reshape(b, s, -1)  # (B, S, C_out)
        return new_xyz, x


class OffsetBlock(nn.Module):
    """PCT's offset-attention block ``x + ReLU(BN(conv(x - mixer(x))))`` around any mixer."""

    def __init__(self, channels: int, attn: Mapping):
        super().__init__()
        self.mixer = attention.build(**attn, dim=channels)
        self.conv = nn.Conv1d(channels, channels, 1)
        self.norm = nn.BatchNorm1d(channels)

    def forward(self, x: torch.Tensor, layout) -> torch.Tensor:
        # x (B, C, N)
        mixed = self.mixer(x.transpose(1, 2), layout).transpose(1, 2)  # (B, C, N)
        return x + F.relu(self.norm(self.conv(x - mixed)))


class PCT(nn.Module):
    official_weights: ClassVar[str] = ("PCT_Pytorch's model.t7 (Strawberry-Eat-Mango/PCT_Pytorch, its Pct network, "
                                       "saved from nn.DataParallel; attn=offset with its defaults)")

    def __init__(self, num_classes: int, attn: Mapping, embedding: str = "neighbor",
                 samples: Sequence[int] = (512, 256), neighbours: int = 32, dropout: float = 0.5,
                 layers: int = 4, fps: str = "kernel"):
        super().__init__()
        if embedding not in ("neighbor", "point"):
            raise UserError(f"model.embedding={embedding!r} is not known: use `neighbor` (PCT) or `point` (SPCT).")
        if fps not in FPS_RULES:
            raise UserError(f"model.fps={fps!r} is not known: use `kernel` (pointnet2_ops' CUDA kernel, which the "
                            "reference calls: points within sqrt(1e-3) of the origin are never sampled) or `plain` "
                            "(every point may be sampled).")
        if len(samples) != 2 or any(int(s) < 1 for s in samples):
            raise UserError(f"model.samples={list(samples)} must be two positive point counts, e.g. [512, 256].")
        self.embedding = embedding
        if embedding == "neighbor":
            self.embed = nn.Sequential(conv_bn(3, 64), conv_bn(64, 64))
            self.groups = nn.ModuleList([SampleAndGroup(64, 128, samples[0], neighbours, fps),
                                         SampleAndGroup(128, 256, samples[1], neighbours, fps)])
            width = 256
        else:
            self.embed = nn.Sequential(conv_bn(3, 128), conv_bn(128, 128))
            self.groups = nn.ModuleList()
            width = 128
        self.pre = nn.Sequential(conv_bn(width, width), conv_bn(width, width))
        self.blocks = nn.ModuleList([OffsetBlock(width, attn) for _ in range(layers)])
        self.fuse = conv_bn(width * (layers + 1), 1024, nn.LeakyReLU(0.2))
        self.head = nn.Sequential(
            nn.Linear(1024, 512, bias=False), nn.BatchNorm1d(512), nn.LeakyReLU(0.2), nn.Dropout(dropout),
            nn.Linear(512, 256), nn.BatchNorm1d(256), nn.LeakyReLU(0.2), nn.Dropout(dropout),
            nn.Linear(256, num_classes),
        )
        self.min_points = max(samples) if embedding == "neighbor" else 1
        self.neighbours = neighbours

    @staticmethod
    def from_official(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """PCT_Pytorch's ``Pct`` state dict in this network's keys (``module.`` already dropped by the loader).

        Its SA_Layer ties ``q_conv.weight`` to ``k_conv.weight`` (both saved), which is the offset mixer's one
        ``qk``; its 1x1 ``Conv1d`` projections (O, I, 1) are the mixer's ``Linear`` (O, I).
        """
        renames = [("conv1.", "embed.0.0."), ("bn1.", "embed.0.1."), ("conv2.", "embed.1.0."), ("bn2.", "embed.1.1."),
                   ("pt_last.conv1.", "pre.0.0."), ("pt_last.bn1.", "pre.0.1."), ("pt_last.conv2.", "pre.1.0."),
                   ("pt_last.bn2.", "pre.1.1."), ("conv_fuse.0.", "fuse.0."), ("conv_fuse.1.", "fuse.1."),
                   ("linear1.", "head.0."), ("bn6.", "head.1."), ("linear2.", "head.4."), ("bn7.", "head.5."),
                   ("linear3.", "head.8.")]
        for i in range(2):
            local, group = f"gather_local_{i}.", f"groups.{i}.mlp."
            renames += [(local + "conv1.", group + "0.0."), (local + "bn1.", group + "0.1."),
                        (local + "conv2.", group + "1.0."), (local + "bn2.", group + "1.1.")]
        for j in range(4):
            sa, block = f"pt_last.sa{j + 1}.", f"blocks.{j}."
            renames += [(sa + "q_conv.", block + "mixer.qk."), (sa + "v_conv.", block + "mixer.v."),
                        (sa + "trans_conv.", block + "conv."), (sa + "after_norm.", block + "norm.")]
        tied = {k for k in state if ".k_conv." in k and k.replace("k_conv", "q_conv") in state
                and torch.equal(state[k], state[k.replace("k_conv", "q_conv")])}
        out = take({k: v for k, v in state.items() if k not in tied}, renames)  # an untied k_conv stays unexpected
        for key in [k for k in out if ".mixer." in k and out[k].dim() == 3]:
            out[key] = out[key].squeeze(-1)  # Conv1d (O, I, 1) -> Linear (O, I)
        return out

    def forward(self, xyz: torch.Tensor) -> torch.Tensor:
        # xyz (B, N, 3) -> logits (B, classes)
        if xyz.shape[1] < self.min_points or xyz.shape[1] < self.neighbours:
            raise UserError(f"PCT got {xyz.shape[1]} points per shape but samples {self.min_points} centres with "
                            f"{self.neighbours} neighbours; raise data.npoints or lower model.samples/model.neighbours.")
        feats = self.embed(xyz.transpose(1, 2)).transpose(1, 2)  # (B, N, C)
        for group in self.groups:
            xyz, feats = group(xyz, feats)  # (B, S, 3), (B, S, C)
        layout = attention.Points(xyz)
        skip = feats.transpose(1, 2)  # (B, C, S)
        x = self.pre(skip)
        outs = []
        for block in self.blocks:
            x = block(x, layout)
            outs.append(x)
        x = self.fuse(torch.cat(outs + [skip], dim=1))  # (B, 1024, S)
        return self.head(x.amax(dim=-1))  # (B, classes)


class PCTPartSeg(nn.Module):
    """PCT part segmentation, as the reference (Jittor PCT and its PyTorch ports, ``Point_Transformer_partseg``).

        xyz (+ normals) (B, N, 3|6)
        point embedding   conv 3->128->128 + BN + ReLU (no neighbour embedding)
        transformer       4 offset blocks at 128 channels, concatenated (512)
                          -> conv 512->1024 + BN + LeakyReLU(0.2)
        global features   max and mean over points (1024 each), the category one-hot
                          through conv C->64 + BN + LeakyReLU(0.2), repeated over points
        head              [3136] -> conv 512 + BN + ReLU -> dropout -> conv 256 + BN + ReLU
                          -> conv parts

    With ``attn=offset``, 16 categories and 50 parts: 2,446,130 trainable parameters. Equal, in float64, to the
    authors' Jittor ``Point_Transformer_partseg`` (MenghaoGuo/PCT@b7152d6, networks/seg/pct_partseg.py, xyz input)
    in torch's key layout: tests/tasks/test_pct_partseg_official.py.
    """

    official_weights: ClassVar[str] = ("the authors' Point_Transformer_partseg keys (MenghaoGuo/PCT, "
                                       "networks/seg/pct_partseg.py, as a PyTorch state dict; no checkpoint is "
                                       "released; attn=offset with its defaults, 16 categories, xyz input)")

    def __init__(self, num_parts: int, num_categories: int, attn: Mapping, in_channels: int = 3,
                 dropout: float = 0.5, layers: int = 4, width: int = 128):
        super().__init__()
        self.num_categories = num_categories
        self.embed = nn.Sequential(conv_bn(in_channels, width), conv_bn(width, width))
        self.blocks = nn.ModuleList([OffsetBlock(width, attn) for _ in range(layers)])
        self.fuse = conv_bn(width * layers, 1024, nn.LeakyReLU(0.2))
        self.category = conv_bn(num_categories, 64, nn.LeakyReLU(0.2))
        self.head = nn.Sequential(
            nn.Conv1d(3 * 1024 + 64, 512, 1), nn.BatchNorm1d(512), nn.ReLU(), nn.Dropout(dropout),
            nn.Conv1d(512, 256, 1), nn.BatchNorm1d(256), nn.ReLU(),
            nn.Conv1d(256, num_parts, 1),
        )

    @staticmethod
    def from_official(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``Point_Transformer_partseg``'s state dict (torch layout: Conv1d weights (O, I, 1)) in this network's keys.

        As in ``PCT.from_official``, each SA_Layer's tied ``q_conv``/``k_conv`` weight is the offset mixer's ``qk``.
        """
        renames = [("conv1.", "embed.0.0."), ("bn1.", "embed.0.1."), ("conv2.", "embed.1.0."), ("bn2.", "embed.1.1."),
                   ("conv_fuse.", "fuse."), ("label_conv.", "category."), ("convs1.", "head.0."),
                   ("bns1.", "head.1."), ("convs2.", "head.4."), ("bns2.", "head.5."), ("convs3.", "head.7.")]
        for j in range(4):
            sa, block = f"sa{j + 1}.", f"blocks.{j}."
            renames += [(sa + "q_conv.", block + "mixer.qk."), (sa + "v_conv.", block + "mixer.v."),
                        (sa + "trans_conv.", block + "conv."), (sa + "after_norm.", block + "norm.")]
        tied = {k for k in state if ".k_conv." in k and k.replace("k_conv", "q_conv") in state
                and torch.equal(state[k], state[k.replace("k_conv", "q_conv")])}
        out = take({k: v for k, v in state.items() if k not in tied}, renames)  # an untied k_conv stays unexpected
        for key in [k for k in out if ".mixer." in k and out[k].dim() == 3]:
            out[key] = out[key].squeeze(-1)  # Conv1d (O, I, 1) -> Linear (O, I)
        return out

    def forward(self, points: torch.Tensor, category: torch.Tensor) -> torch.Tensor:
        # points (B, N, 3 or 6) with xyz first, category (B,) -> part logits (B, parts, N)
        n = points.shape[1]
        layout = attention.Points(points[..., :3])
        x = self.embed(points.transpose(1, 2))  # (B, 128, N)
        outs = []
        for block in self.blocks:
            x = block(x, layout)
            outs.append(x)
        x = self.fuse(torch.cat(outs, dim=1))  # (B, 1024, N)
        one_hot = F.one_hot(category, self.num_categories).to(x.dtype).unsqueeze(-1)  # (B, categories, 1)
        glob = torch.cat([x.amax(dim=-1, keepdim=True), x.mean(dim=-1, keepdim=True),
                          self.category(one_hot)], dim=1)  # (B, 2048 + 64, 1)
        return self.head(torch.cat([x, glob.expand(-1, -1, n)], dim=1))  # (B, parts, N)
