"""What the variants are measured against, in the same process:

- :class:`DilateAttention`: DilateFormer's ``nn.Unfold`` dilated attention as published, and
  :func:`unfold_dilated_attention`, the same on this suite's (B, heads, N, d) layout;
- :class:`MaterialisedAttention`: ``self``'s mixer computing softmax(q k^T) v with the N x N matrix in memory,
  the textbook O(N^2) attention (``self`` itself runs SDPA, whose fused kernels need not hold that matrix);
- :class:`UnfoldDilatedAttention`: ``dilated``'s mixer with DilateFormer's ``nn.Unfold`` kernel in place of
  the shifted-view one (grids only, as the paper);
- :class:`ChannelFirstPCT` and :class:`ChannelFirstPCTPartSeg`: PCT's two networks (``tasks/nets/pct.py``) as
  the code they replace computes them, channel-first: features (B, C, N) through 1x1 ``Conv1d`` and
  ``BatchNorm1d`` modules, PCT's SA layer on (B, C, N), the first grouping layer on the concatenated
  [neighbour - centre, centre] rows, a torch FPS loop from point 0 and kNN by ``topk`` of squared distances
  (PCT_Pytorch's ``model.py`` / ``util.py`` with its CUDA FPS replaced, the Jittor part-segmentation network).
  Written for the benchmark, with the suite's parameter names: :func:`channel_first` builds one from a suite
  network and loads its weights (tests/test_bench.py holds the two equal in float64).

The two mixers are subclasses of the registered variants, unregistered, so ``attention.names()`` is unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
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


# --------------------------------------------------------------------------------------------
# PCT's networks, channel-first, as the reference code computes them
# --------------------------------------------------------------------------------------------

@torch.compiler.disable  # eager when compiled: a graph break, as PCT_Pytorch's call of its CUDA op is one
@torch.no_grad()
def plain_fps(xyz: torch.Tensor, m: int) -> torch.Tensor:
    """Farthest point sampling from point 0 (B, N, 3) -> (B, m): a torch loop over the m picks, argmax's ties to the
    lowest index (the CUDA kernel's replacement in the issue's measurement).

    On one CPU thread, as the suite's (``tasks.nets.pct.one_cpu_thread``): so that the comparison is of the two
    networks' layers, not of FPS's thread waits on a shared machine.
    """
    from tasks.nets.pct import one_cpu_thread

    with one_cpu_thread(xyz.device):
        return _plain_fps(xyz, m)


def _plain_fps(xyz: torch.Tensor, m: int) -> torch.Tensor:
    b, n, _ = xyz.shape
    picked = torch.zeros(b, m, dtype=torch.long, device=xyz.device)
    nearest = torch.full((b, n), float("inf"), dtype=xyz.dtype, device=xyz.device)  # to the picked set, squared
    farthest = torch.zeros(b, dtype=torch.long, device=xyz.device)
    rows = torch.arange(b, device=xyz.device)
    for i in range(m):
        picked[:, i] = farthest
        nearest = torch.minimum(nearest, ((xyz - xyz[rows, farthest].unsqueeze(1)) ** 2).sum(-1))  # (B, N)
        farthest = nearest.argmax(-1)
    return picked


@torch.compiler.disable
@torch.no_grad()
def topk_knn(query: torch.Tensor, points: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (B, S, k) of each query's k nearest points, unordered: |q|^2 + |p|^2 - 2 q.p, then ``topk``."""
    square = -2 * query @ points.transpose(1, 2)  # (B, S, N)
    square += query.square().sum(-1, keepdim=True) + points.square().sum(-1).unsqueeze(1)
    return square.topk(k, dim=-1, largest=False, sorted=False).indices


def index_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x (B, N, C) at idx (B, *S) -> (B, *S, C), by advanced indexing."""
    rows = torch.arange(x.shape[0], device=x.device).view(-1, *[1] * (idx.dim() - 1))  # (B, 1, ...)
    return x[rows, idx]


def conv_bn_cf(cin: int, cout: int, act: nn.Module | None = None) -> nn.Sequential:
    """1x1 ``Conv1d`` (no bias), ``BatchNorm1d``, activation (ReLU by default), on (B, C, N)."""
    return nn.Sequential(nn.Conv1d(cin, cout, 1, bias=False), nn.BatchNorm1d(cout), act or nn.ReLU())


class ChannelFirstGroup(nn.Module):
    """PCT_Pytorch's ``sample_and_group`` + ``Local_op``: [g - c, c] for each of K neighbours, as (B S, 2C, K),
    through two conv layers, max over the neighbours."""

    def __init__(self, cin: int, cout: int, samples: int, neighbours: int):
        super().__init__()
        self.samples, self.neighbours = samples, neighbours
        self.mlp = nn.Sequential(conv_bn_cf(2 * cin, cout), conv_bn_cf(cout, cout))

    def forward(self, xyz: torch.Tensor, feats: torch.Tensor):
        # xyz (B, N, 3), feats (B, N, C) -> new_xyz (B, S, 3), out (B, C_out, S)
        centres = plain_fps(xyz, self.samples)  # (B, S)
        new_xyz = index_rows(xyz, centres)  # (B, S, 3)
        centre = index_rows(feats, centres).unsqueeze(2)  # (B, S, 1, C)
        groups = index_rows(feats, topk_knn(new_xyz, xyz, self.neighbours))  # (B, S, K, C)
        x = torch.cat([groups - centre, centre.expand_as(groups)], dim=-1)  # (B, S, K, 2C)
        b, s, k, c = x.shape
        x = self.mlp(x.permute(0, 1, 3, 2).reshape(b * s, c, k))  # (B S, C_out, K)
        return new_xyz, F.adaptive_max_pool1d(x, 1).view(b, s, -1).permute(0, 2, 1)  # (B, C_out, S)


class ChannelFirstOffset(nn.Module):
    """PCT's ``SA_Layer`` attention on (B, C, N): shared q/k 1x1 conv, softmax over keys, column normalisation,
    x_r = v A; the ``qk`` and ``v`` names of the suite's ``offset`` mixer (whose weights are (O, I), not (O, I, 1))."""

    def __init__(self, channels: int):
        super().__init__()
        self.qk = nn.Conv1d(channels, channels // 4, 1, bias=False)
        self.v = nn.Conv1d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x (B, C, N) -> (B, C, N)
        q = self.qk(x)  # (B, C/4, N)
        attn = torch.bmm(q.permute(0, 2, 1), q).softmax(dim=-1)  # (B, N, N)
        attn = attn / (1e-9 + attn.sum(dim=1, keepdim=True))
        return torch.bmm(self.v(x), attn)  # (B, C, N)


class ChannelFirstBlock(nn.Module):
    """``x + ReLU(BN(conv(x - SA(x))))`` on (B, C, N)."""

    def __init__(self, channels: int):
        super().__init__()
        self.mixer = ChannelFirstOffset(channels)
        self.conv = nn.Conv1d(channels, channels, 1)
        self.norm = nn.BatchNorm1d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.norm(self.conv(x - self.mixer(x))))


class ChannelFirstPCT(nn.Module):
    """PCT_Pytorch's ``Pct`` channel-first, with ``tasks.nets.pct.PCT``'s parameter names (``attn=offset``)."""

    def __init__(self, num_classes: int, samples=(512, 256), neighbours: int = 32, dropout: float = 0.5,
                 layers: int = 4, embedding: str = "neighbor"):
        super().__init__()
        stem, width = (64, 256) if embedding == "neighbor" else (128, 128)  # SPCT: no grouping
        self.embed = nn.Sequential(conv_bn_cf(3, stem), conv_bn_cf(stem, stem))
        self.groups = nn.ModuleList([ChannelFirstGroup(64, 128, samples[0], neighbours),
                                     ChannelFirstGroup(128, 256, samples[1], neighbours)]
                                    if embedding == "neighbor" else [])
        self.pre = nn.Sequential(conv_bn_cf(width, width), conv_bn_cf(width, width))
        self.blocks = nn.ModuleList([ChannelFirstBlock(width) for _ in range(layers)])
        self.fuse = conv_bn_cf(width * (layers + 1), 1024, nn.LeakyReLU(0.2))
        self.head = nn.Sequential(
            nn.Linear(1024, 512, bias=False), nn.BatchNorm1d(512), nn.LeakyReLU(0.2), nn.Dropout(dropout),
            nn.Linear(512, 256), nn.BatchNorm1d(256), nn.LeakyReLU(0.2), nn.Dropout(dropout),
            nn.Linear(256, num_classes),
        )

    def forward(self, xyz: torch.Tensor) -> torch.Tensor:
        # xyz (B, N, 3) -> logits (B, classes)
        x = self.embed(xyz.permute(0, 2, 1))  # (B, C, N)
        for group in self.groups:
            xyz, x = group(xyz, x.permute(0, 2, 1))  # (B, S, 3), (B, C, S)
        skip = x
        x = self.pre(x)
        outs = []
        for block in self.blocks:
            x = block(x)
            outs.append(x)
        x = self.fuse(torch.cat(outs + [skip], dim=1))  # (B, 1024, S)
        return self.head(F.adaptive_max_pool1d(x, 1).view(x.shape[0], -1))  # (B, classes)


class ChannelFirstPCTPartSeg(nn.Module):
    """The authors' ``Point_Transformer_partseg`` channel-first, with ``tasks.nets.pct.PCTPartSeg``'s parameter
    names (``attn=offset``)."""

    def __init__(self, num_parts: int, num_categories: int, in_channels: int = 3, dropout: float = 0.5,
                 layers: int = 4, width: int = 128):
        super().__init__()
        self.num_categories = num_categories
        self.embed = nn.Sequential(conv_bn_cf(in_channels, width), conv_bn_cf(width, width))
        self.blocks = nn.ModuleList([ChannelFirstBlock(width) for _ in range(layers)])
        self.fuse = conv_bn_cf(width * layers, 1024, nn.LeakyReLU(0.2))
        self.category = conv_bn_cf(num_categories, 64, nn.LeakyReLU(0.2))
        self.head = nn.Sequential(
            nn.Conv1d(3 * 1024 + 64, 512, 1), nn.BatchNorm1d(512), nn.ReLU(), nn.Dropout(dropout),
            nn.Conv1d(512, 256, 1), nn.BatchNorm1d(256), nn.ReLU(),
            nn.Conv1d(256, num_parts, 1),
        )

    def forward(self, points: torch.Tensor, category: torch.Tensor) -> torch.Tensor:
        # points (B, N, 3 or 6), category (B,) -> part logits (B, parts, N)
        n = points.shape[1]
        x = self.embed(points.permute(0, 2, 1))  # (B, C, N)
        outs = []
        for block in self.blocks:
            x = block(x)
            outs.append(x)
        x = self.fuse(torch.cat(outs, dim=1))  # (B, 1024, N)
        one_hot = F.one_hot(category, self.num_categories).to(x.dtype).unsqueeze(-1)  # (B, categories, 1)
        glob = [x.max(dim=2, keepdim=True).values, x.mean(dim=2, keepdim=True), self.category(one_hot)]
        x = torch.cat([x] + [g.repeat(1, 1, n) for g in glob], dim=1)  # (B, 3 * 1024 + 64, N)
        return self.head(x)  # (B, parts, N)


def channel_first(net: nn.Module) -> nn.Module:
    """The channel-first formulation of a suite ``PCT`` or ``PCTPartSeg`` (``attn=offset``, one head, qk_ratio 4),
    on the same device and dtype, in the same mode, with its weights and buffers.

    Its FPS is the plain one (every point may be a centre): the same function as ``PCT(..., fps="plain")``; with
    the suite's default ``fps="kernel"`` (points within sqrt(1e-3) of the origin are never centres) the two pick
    the same centres unless such a point is farthest, and cost the same to within a permutation of the points.
    """
    from tasks.nets.pct import PCT, PCTPartSeg

    mixer = net.blocks[0].mixer
    if mixer.name != "offset" or mixer.heads != 1 or mixer.qk_ratio != 4:
        raise ValueError("the channel-first baseline is PCT's own attention: attn=offset with heads=1, qk_ratio=4.")
    if isinstance(net, PCT):
        groups = list(net.groups)
        base = ChannelFirstPCT(net.head[-1].out_features, [g.samples for g in groups] or (512, 256),
                               net.neighbours, net.head[3].p, len(net.blocks), net.embedding)
    elif isinstance(net, PCTPartSeg):
        base = ChannelFirstPCTPartSeg(net.head[-1].out_channels, net.num_categories, net.embed[0][0].in_channels,
                                      net.head[3].p, len(net.blocks), net.blocks[0].conv.in_channels)
    else:
        raise TypeError(f"no channel-first baseline for {type(net).__name__}")
    state = {k: v.unsqueeze(-1) if ".mixer." in k and v.dim() == 2 else v  # Linear (O, I) -> Conv1d (O, I, 1)
             for k, v in net.state_dict().items()}
    base.load_state_dict(state)
    ref = next(net.parameters())
    return base.to(device=ref.device, dtype=ref.dtype).train(net.training)
