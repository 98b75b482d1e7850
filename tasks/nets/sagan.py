"""SAGAN's generator and discriminator for 32x32 images, with any attention variant.

Layer for layer StudioGAN's ``src/models/resnet.py`` at ``img_size=32``
(``configs/CIFAR10/SAGAN.yaml``: g_conv_dim = d_conv_dim = 64, so 256 and 128
channels; attention after generator block 2 and discriminator block 1):

    G: z (128) -> linear -> (256, 4, 4)
       3 x GenBlock 256->256 (BN -> ReLU -> nearest x2 -> conv3x3 -> BN -> ReLU -> conv3x3;
                              shortcut nearest x2 -> conv1x1), attention after block 2 (16x16)
       BN -> ReLU -> conv3x3 -> 3 channels -> tanh
    D: DiscOptBlock 3->128 (32->16), attention after it (16x16),
       DiscBlock 128->128 down (->8), 2 x DiscBlock 128->128 (ReLU -> conv3x3 -> ReLU -> conv3x3 [-> avgpool];
                              shortcut [conv1x1 -> avgpool] of relu(x), see below),
       ReLU -> sum over space -> linear -> 1, + projection sum(embed(y) * h) when conditional

The attention block is ``x + sigma * mixer(x)`` (``blocks.ScaledResidual``), sigma initialised to 0,
the mixer built from the ``attn`` config on ``attention.Grid(h, w)``; with
SAGAN's options for ``self`` (``configs/task/gan.yaml``' preset, see
``attention/variants/softmax.py``) it is exactly StudioGAN's ``ops.SelfAttention``,
spectral norms included: theta, phi, g and the output conv are four layers, each
normalised on its own (``separate_qkv``); ``attn=external`` is EAGAN.

StudioGAN's ``DiscBlock`` applies ``nn.ReLU(inplace=True)`` to its input after
keeping it for the shortcut, so the shortcut (conv1x1 or identity) receives
relu(x). That is the default here (``model.d_shortcut=studiogan``), the function
its published weights compute; ``textbook`` gives the shortcut x. The default is
held equal to StudioGAN's forward (transliterated in float64, spectral norms on,
its weights loaded from a StudioGAN-layout checkpoint) in
``tests/tasks/test_sagan_official.py``; ``textbook`` is not StudioGAN's function,
and that test only checks that, with the same weights, its output differs.

Class-conditional batch norm (``conditional=True``): BN without affine
(eps 1e-4 as StudioGAN), then ``out * (1 + gain(y)) + bias(y)`` with ``gain``
and ``bias`` linear maps of the one-hot label. Weights get StudioGAN's
orthogonal initialisation, then spectral normalisation (eps 1e-6) on every
conv, linear and embedding of both networks, attention projections included.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm

from attention.errors import UserError

from .blocks import ScaledResidual

SHORTCUTS = ("studiogan", "textbook")  # what a discriminator block's shortcut takes: relu(x) or x
RESOLUTIONS = (32,)  # StudioGAN's 32x32 networks; other sizes need other block tables
BN_EPS = 1e-4


def init_and_normalise(net: nn.Module) -> nn.Module:
    """StudioGAN's ``ortho`` init (orthogonal weights, zero biases) then spectral norm on every conv/linear/embedding."""
    for module in list(net.modules()):
        if isinstance(module, (nn.Conv2d, nn.Linear, nn.Embedding)):
            nn.init.orthogonal_(module.weight)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
            spectral_norm(module, eps=1e-6)
    return net


class ConditionalBatchNorm2d(nn.Module):
    """BN without affine, then ``out * (1 + gain(y)) + bias(y)``; y is a one-hot label (B, K) or None (plain BN)."""

    def __init__(self, channels: int, num_classes: int):
        super().__init__()
        self.conditional = num_classes > 0
        self.bn = nn.BatchNorm2d(channels, eps=BN_EPS, affine=not self.conditional)
        if self.conditional:
            self.gain = nn.Linear(num_classes, channels, bias=False)
            self.bias = nn.Linear(num_classes, channels, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
        out = self.bn(x)
        if not self.conditional:
            return out
        gain = (1 + self.gain(y))[:, :, None, None]  # (B, C, 1, 1)
        return out * gain + self.bias(y)[:, :, None, None]


class GenBlock(nn.Module):
    def __init__(self, cin: int, cout: int, num_classes: int):
        super().__init__()
        self.bn1 = ConditionalBatchNorm2d(cin, num_classes)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.bn2 = ConditionalBatchNorm2d(cout, num_classes)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.shortcut = nn.Conv2d(cin, cout, 1)

    def forward(self, x, y):
        h = F.interpolate(F.relu(self.bn1(x, y)), scale_factor=2, mode="nearest")
        h = self.conv2(F.relu(self.bn2(self.conv1(h), y)))
        return h + self.shortcut(F.interpolate(x, scale_factor=2, mode="nearest"))


class DiscOptBlock(nn.Module):
    """The discriminator's first block: conv -> ReLU -> conv -> avgpool, shortcut avgpool -> conv1x1."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.shortcut = nn.Conv2d(cin, cout, 1)

    def forward(self, x):
        h = F.avg_pool2d(self.conv2(F.relu(self.conv1(x))), 2)
        return h + self.shortcut(F.avg_pool2d(x, 2))


class DiscBlock(nn.Module):
    """ReLU -> conv -> ReLU -> conv [-> avgpool]; shortcut conv1x1 [-> avgpool] when shape changes, else identity.

    ``shortcut="studiogan"``: the shortcut takes relu(x), as in StudioGAN, whose ``DiscBlock`` keeps ``x0 = x`` and
    then applies ``nn.ReLU(inplace=True)`` to x, rectifying x0 too; ``"textbook"``: the shortcut takes x.
    """

    def __init__(self, cin: int, cout: int, downsample: bool, shortcut: str = "studiogan"):
        super().__init__()
        self.downsample, self.rectified_shortcut = downsample, shortcut == "studiogan"
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.shortcut = nn.Conv2d(cin, cout, 1) if downsample or cin != cout else nn.Identity()

    def forward(self, x):
        x = F.relu(x) if self.rectified_shortcut else x
        h = self.conv2(F.relu(self.conv1(F.relu(x))))  # relu(relu(x)) = relu(x)
        shortcut = self.shortcut(x)
        if self.downsample:
            h, shortcut = F.avg_pool2d(h, 2), F.avg_pool2d(shortcut, 2)
        return h + shortcut


# StudioGAN's checkpoints (src/models/resnet.py, torch.nn.utils.spectral_norm) in this module's names.
SN_TENSORS = {"weight_orig": "parametrizations.weight.original", "weight_u": "parametrizations.weight.0._u",
              "weight_v": "parametrizations.weight.0._v"}
STUDIOGAN_ATTENTION = {"conv1x1_theta": "attn.mixer.q", "conv1x1_phi": "attn.mixer.k", "conv1x1_g": "attn.mixer.v",
                       "conv1x1_attn": "attn.mixer.proj", "sigma": "attn.sigma"}
STUDIOGAN_BLOCK = {"conv2d0": "shortcut", "conv2d1": "conv1", "conv2d2": "conv2"}
BN_TENSORS = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")


def from_studiogan(state: Mapping[str, torch.Tensor], net: nn.Module, tops: Mapping[str, str], option: str
                   ) -> dict[str, torch.Tensor]:
    """A StudioGAN G or D state dict in the names of ``net`` (a :class:`Generator` or :class:`Discriminator`).

    StudioGAN's ``blocks.<i>.0`` list holds the residual blocks and, after block ``attn_*_loc``, its
    ``SelfAttention``; here the attention block is ``attn`` and the residual blocks count without it. Spectral
    norm's ``weight_orig``/``weight_u``/``weight_v`` become the parametrization's ``original``/``_u``/``_v``, 1x1
    attention convs (O, I, 1, 1) the mixer's linears (O, I), and an unconditional BN ``bn1`` the ``bn1.bn`` of
    :class:`ConditionalBatchNorm2d`. ``tops`` renames the layers outside the blocks.

    A state dict that is not a StudioGAN file of this network's kind (none of its keys under a layer of ``tops``:
    the network's own layout, the other network's file, any other file) is returned as it is, so that the loader
    names its missing and unexpected keys; one that is, but places its attention elsewhere, is refused naming
    ``model.<option>``.
    """
    if not any(k.split(".")[0] in tops for k in state):
        return dict(state)
    indices = sorted({int(k.split(".")[1]) for k in state if k.startswith("blocks.")})
    attention_at = sorted({int(k.split(".")[1]) for k in state if k.split(".")[3:4] == ["conv1x1_theta"]})
    residual = [i for i in indices if i not in attention_at]
    found = [residual.index(i - 1) + 1 for i in attention_at if i - 1 in residual] or [None]
    if found != [net.attn_block]:
        where = f"after block {found[0]}" if found[0] else "nowhere"
        raise UserError(f"model.{option}: the StudioGAN file places self-attention {where}, the network after "
                        f"block {net.attn_block}; set model.{option}={found[0] or 'null'} to load it.")
    out = {}
    for key, value in state.items():
        parts = key.split(".")
        if parts[0] == "blocks":
            layer, rest = parts[3], parts[4:]
            if layer in STUDIOGAN_ATTENTION:
                name = STUDIOGAN_ATTENTION[layer]
                if value.dim() == 4 and rest == ["weight_orig"]:
                    value = value.flatten(1)  # 1x1 conv (O, I, 1, 1) -> Linear (O, I)
            else:
                name = f"blocks.{residual.index(int(parts[1]))}.{STUDIOGAN_BLOCK.get(layer, layer)}"
                if layer in ("bn1", "bn2") and len(rest) == 1 and rest[0] in BN_TENSORS:
                    name += ".bn"  # StudioGAN's plain BN is the unconditional ConditionalBatchNorm2d's bn
        else:
            name, rest = tops.get(parts[0], parts[0]), parts[1:]
        out[".".join([name, *rest[:-1], SN_TENSORS.get(rest[-1], rest[-1])] if rest else [name])] = value
    return out


def check_resolution(resolution: int) -> None:
    if resolution not in RESOLUTIONS:
        raise UserError(f"data.resolution={resolution} is not supported by the SAGAN networks, which are "
                        f"StudioGAN's {RESOLUTIONS[0]}x{RESOLUTIONS[0]} ResNets: set data.resolution=32 "
                        "(images are resized to it).")


def _attention_after(option: str, block: int | None, blocks: int):
    if block is not None and not 0 <= block <= blocks:
        raise UserError(f"model.{option}={block} is out of range: the network has {blocks} blocks; use 1..{blocks}, "
                        "or null for no attention block.")
    return block or None


class Generator(nn.Module):
    """z (B, z_dim) and labels (B,) -> images (B, 3, 32, 32) in [-1, 1]."""
    official_weights: ClassVar[str] = ("StudioGAN's generator checkpoints, model=G-*.pth and model=G_ema-*.pth "
                                       "(POSTECH-CVLab/PyTorch-StudioGAN, configs/CIFAR10/SAGAN.yaml)")

    def __init__(self, attn: Mapping, z_dim: int = 128, channels: int = 256, num_classes: int = 0,
                 resolution: int = 32, attn_block: int | None = 2):
        super().__init__()
        check_resolution(resolution)
        self.z_dim, self.channels, self.num_classes, self.bottom = z_dim, channels, num_classes, 4
        self.linear = nn.Linear(z_dim, channels * self.bottom ** 2)
        self.blocks = nn.ModuleList([GenBlock(channels, channels, num_classes) for _ in range(3)])
        self.attn_block = _attention_after("g_attn_block", attn_block, len(self.blocks))
        self.attn = ScaledResidual(channels, attn) if self.attn_block else nn.Identity()
        self.bn = nn.BatchNorm2d(channels, eps=BN_EPS)
        self.conv = nn.Conv2d(channels, 3, 3, padding=1)
        init_and_normalise(self)

    def from_official(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return from_studiogan(state, self, {"linear0": "linear", "bn4": "bn", "conv2d5": "conv"}, "g_attn_block")

    def forward(self, z: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        onehot = F.one_hot(y, self.num_classes).to(z.dtype) if self.num_classes else None  # (B, K)
        h = self.linear(z).view(-1, self.channels, self.bottom, self.bottom)  # (B, C, 4, 4)
        for i, block in enumerate(self.blocks, start=1):
            h = block(h, onehot)  # spatial x2 per block
            if i == self.attn_block:
                h = self.attn(h)
        return torch.tanh(self.conv(F.relu(self.bn(h))))  # (B, 3, 32, 32)


class Discriminator(nn.Module):
    """Images (B, 3, 32, 32) and labels (B,) -> logits (B,)."""
    official_weights: ClassVar[str] = ("StudioGAN's discriminator checkpoints, model=D-*.pth "
                                       "(POSTECH-CVLab/PyTorch-StudioGAN, configs/CIFAR10/SAGAN.yaml)")

    def __init__(self, attn: Mapping, channels: int = 128, num_classes: int = 0, resolution: int = 32,
                 attn_block: int | None = 1, shortcut: str = "studiogan"):
        super().__init__()
        check_resolution(resolution)
        if shortcut not in SHORTCUTS:
            raise UserError(f"model.d_shortcut={shortcut!r} is not known: use studiogan (the shortcut of a "
                            "discriminator block takes relu(x), as StudioGAN's in-place ReLU makes it, and as its "
                            "published weights were trained) or textbook (the shortcut takes x).")
        self.num_classes = num_classes
        self.blocks = nn.ModuleList([DiscOptBlock(3, channels), DiscBlock(channels, channels, True, shortcut),
                                     DiscBlock(channels, channels, False, shortcut),
                                     DiscBlock(channels, channels, False, shortcut)])
        self.attn_block = _attention_after("d_attn_block", attn_block, len(self.blocks))
        self.attn = ScaledResidual(channels, attn) if self.attn_block else nn.Identity()
        self.linear = nn.Linear(channels, 1)
        self.embedding = nn.Embedding(num_classes, channels) if num_classes else None
        init_and_normalise(self)

    def from_official(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return from_studiogan(state, self, {"linear1": "linear"}, "d_attn_block")

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        h = x
        for i, block in enumerate(self.blocks, start=1):
            h = block(h)
            if i == self.attn_block:
                h = self.attn(h)
        h = F.relu(h).sum(dim=(2, 3))  # (B, C)
        out = self.linear(h).squeeze(1)  # (B,)
        if self.embedding is not None:
            out = out + (self.embedding(y) * h).sum(dim=1)  # projection discriminator
        return out
