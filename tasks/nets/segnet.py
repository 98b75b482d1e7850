"""Dilated ResNet + attention head for semantic segmentation (EANet's network, any attention variant).

    image (B, 3, H, W)
    backbone   torchvision ResNet-50/101 dilated to output stride 8 (``replace_stride_with_dilation``):
               layer3 (1024 ch) and layer4 (2048 ch) at H/8
    head       ConvBNReLU 3x3 2048->512
               attention block  ReLU(x + BN(conv1x1(mixer(conv1x1(x)))))   (``head=attention``, EANet's)
                                or x + gamma * mixer(x)                   (``head=scaled``, LAM's)
               ConvBNReLU 3x3 512->256, Dropout2d(0.1), conv1x1 -> classes
    aux head   on layer3: ConvBNReLU 3x3 1024->256, Dropout2d(0.1), conv1x1 -> classes (FCN, loss weight 0.4)
    logits     bilinear upsampling to (H, W)

The mixer comes from the ``attn`` config and sees the feature map as tokens on
``attention.Grid(H/8, W/8)``; ``attn=external`` is EANet's head exactly (the task's preset
switches off the mixer's own projections: conv1/conv2 are EANet's; 591,360 parameters
at 512 channels), ``attn=linear_taylor model.head=scaled`` LAM's module (its preset:
C/8 queries and keys, no output projection). ``head=none`` drops
the attention block (the plain dilated FCN every variant is compared with).

``resnet18`` / ``resnet34`` are accepted as light backbones for CPU runs; their
BasicBlocks have no dilation support in torchvision (it raises for dilation > 1),
so they are dilated here the way mmseg's ResNet does it: stride 1 and dilation
2 / 4 in the 3x3 convolutions of layer3 / layer4.

Transformer backbones: ``model.backbone`` may name any ImageNet backbone of
``tasks.nets.backbones`` (``dilateformer_t``, ``focal_t``, ``vit_s``, ...), built at
``img_size`` = the crop. Their multi-scale maps feed the same heads, FPN-lite:

    main    concat(stage 3 (stride 16), stage 4 upsampled bilinearly to stride 16)  -> the head above
    aux     stage 2 (stride 8)                                                         -> the aux head
    plain   (ViT, EAMLP: one map at stride 16) that map feeds both

so the attention head works at stride 16 (at stride 8 the ResNets). The image is
padded with zeros (the mean after normalisation) at the bottom and right to a
multiple of the backbone's stride (32, or 16) and the logits are cropped back.
``model.backbone_attn`` picks the mixer of the backbone's local stages: ``native``
(default: the paper's, e.g. MSDA for DilateFormer), ``same`` (the task's ``attn``,
so ``attn=X`` swaps head and backbone together) or a variant name (with its
``configs/attn`` options); ``model.backbone_options`` overrides the architecture
(e.g. ``{depths: [1, 1, 1, 1]}``). No ImageNet weights are fetched for them:
``model.pretrained=true`` logs a warning and trains from scratch, ``model.weights=PATH``
loads the backbone's published ImageNet file or a ``task=classification`` checkpoint
(``tasks/nets/weights.py``: containers, ``module.`` / ``net.`` prefixes and the official key
layouts are understood; the classifier is skipped).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import attention
from attention.errors import UserError

from ..deterministic import resize_bilinear
from .backbones import MODELS, build_backbone, native_attn
from .backbones.common import attn_defaults
from .blocks import EANetResidual, ScaledResidual
from .weights import load_weights

log = logging.getLogger(__name__)
BACKBONES = {  # name: (torchvision builder, weights enum name, bottleneck?)
    "resnet18": ("resnet18", "ResNet18_Weights", False),
    "resnet34": ("resnet34", "ResNet34_Weights", False),
    "resnet50": ("resnet50", "ResNet50_Weights", True),
    "resnet101": ("resnet101", "ResNet101_Weights", True),
}
HEADS = {"attention": EANetResidual, "scaled": ScaledResidual, "none": None}  # model.head


def conv_bn_relu(cin: int, cout: int, kernel: int = 3) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, kernel, padding=kernel // 2, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU(inplace=True))


def _dilate_basic_layer(layer: nn.Sequential, dilation: int) -> None:
    """Output stride stays: the first block's stride 2 becomes 1, every 3x3 conv dilated by ``dilation``."""
    for i, block in enumerate(layer):
        if i == 0:
            block.conv1.stride = (1, 1)
            if block.downsample is not None:
                block.downsample[0].stride = (1, 1)
        for conv in (block.conv1, block.conv2):
            conv.dilation, conv.padding = (dilation, dilation), (dilation, dilation)


def _load_weights(net: nn.Module, name: str, pretrained: bool, weights: str | None) -> None:
    if weights:
        load_weights(net, weights, skip=("fc.",), name=name)  # the ImageNet classifier is not part of the backbone
        return
    if not pretrained:
        return
    enum = getattr(torchvision.models, BACKBONES[name][1]).IMAGENET1K_V1
    try:
        state = enum.get_state_dict(progress=True, check_hash=True)
    except Exception as err:  # noqa: BLE001 - offline, proxy, corrupt cache: all need the same fix
        cached = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(enum.url))
        raise UserError(f"Could not fetch the ImageNet weights of {name} from {enum.url} "
                        f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}). Put that file at "
                        f"{cached}, or pass model.weights=PATH, or train from scratch with model.pretrained=false."
                        ) from None
    net.load_state_dict(state)


class Backbone(nn.Module):
    """Dilated ResNet, output stride 8: returns (layer3, layer4) features."""

    def __init__(self, name: str = "resnet50", pretrained: bool = False, weights: str | None = None):
        super().__init__()
        if name not in BACKBONES:
            raise UserError(f"model.backbone={name!r} is not known: use one of {', '.join(BACKBONES)} (dilated "
                            f"ResNets) or {', '.join(MODELS)} (transformer backbones).")
        builder, _, bottleneck = BACKBONES[name]
        if bottleneck:
            net = getattr(torchvision.models, builder)(weights=None, replace_stride_with_dilation=[False, True, True])
        else:
            net = getattr(torchvision.models, builder)(weights=None)
            _dilate_basic_layer(net.layer3, 2)
            _dilate_basic_layer(net.layer4, 4)
        _load_weights(net, name, pretrained, weights)
        self.stem = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool)
        self.layer1, self.layer2, self.layer3, self.layer4 = net.layer1, net.layer2, net.layer3, net.layer4
        self.channels = (1024, 2048) if bottleneck else (256, 512)  # (layer3, layer4)
        self.size_divisor = 1  # any input size

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.layer2(self.layer1(self.stem(x)))  # (B, 512 | 128, H/8, W/8)
        c3 = self.layer3(x)  # (B, 1024 | 256, H/8, W/8)
        return c3, self.layer4(c3)  # (B, 2048 | 512, H/8, W/8)


class TransformerBackbone(nn.Module):
    """A ``tasks.nets.backbones`` model as a segmentation backbone: returns (aux, main) features (FPN-lite)."""

    def __init__(self, name: str, attn: Mapping, crop: int, backbone_attn: str = "native",
                 options: Mapping | None = None, pretrained: bool = False, weights: str | None = None):
        super().__init__()
        if backbone_attn == "native":
            cfg = native_attn(name)
        elif backbone_attn == "same":
            cfg = dict(attn)
        else:
            cfg = {"name": backbone_attn, **attn_defaults(attention.get(backbone_attn).name)}
        self.net = build_backbone({"name": name, **dict(options or {})}, cfg, num_classes=0, img_size=crop)
        if weights:  # official ImageNet files or a task=classification checkpoint; its classifier is left out
            load_weights(self.net, weights, skip=("head.",), name=name)
        elif pretrained:
            log.warning("model.pretrained=true: no ImageNet weights are fetched for the transformer backbone %s; "
                        "it trains from scratch. Pass model.weights=PATH (e.g. a task=classification checkpoint) to "
                        "start from ImageNet weights, or set model.pretrained=false to silence this.", name)
        channels, strides = self.net.feature_channels, self.net.feature_strides
        self.size_divisor = self.net.size_divisor
        if len(channels) >= 3:
            self.channels = (channels[-3], channels[-2] + channels[-1])  # (aux: stage 2, main: stages 3 + 4)
            self.strides = (strides[-3], strides[-2])
        else:
            self.channels = (channels[-1], channels[-1])
            self.strides = (strides[-1], strides[-1])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.net.forward_features(x)  # [(B, C_i, H / s_i, W / s_i)]
        if len(features) < 3:
            return features[-1], features[-1]
        c3, c4 = features[-2], features[-1]
        up = resize_bilinear(c4, c3.shape[-2:])  # (B, C4, H/16, W/16)
        return features[-3], torch.cat([c3, up], dim=1)  # (B, C2, H/8, W/8), (B, C3 + C4, H/16, W/16)


class SegNet(nn.Module):
    """image (B, 3, H, W) -> logits (B, K, H, W), plus the auxiliary logits in training when ``aux``."""

    def __init__(self, num_classes: int, attn: Mapping, backbone: str = "resnet50", pretrained: bool = False,
                 weights: str | None = None, head: str = "attention", head_channels: int = 512, aux: bool = True,
                 dropout: float = 0.1, crop: int = 512, backbone_attn: str = "native",
                 backbone_options: Mapping | None = None):
        super().__init__()
        if head not in HEADS:
            raise UserError(f"model.head={head!r} is not known: use model.head=attention (EANet's block around the "
                            "attn variant), scaled (x + gamma * attn(x): LAM's and SAGAN's block) or none (plain "
                            "dilated FCN baseline).")
        if backbone in MODELS:
            self.backbone = TransformerBackbone(backbone, attn, crop, backbone_attn, backbone_options, pretrained,
                                                weights)
        else:
            self.backbone = Backbone(backbone, pretrained, weights)
        c3, c4 = self.backbone.channels
        self.reduce = conv_bn_relu(c4, head_channels)
        self.attention = HEADS[head](head_channels, attn) if HEADS[head] else nn.Identity()
        self.classifier = nn.Sequential(conv_bn_relu(head_channels, head_channels // 2), nn.Dropout2d(dropout),
                                        nn.Conv2d(head_channels // 2, num_classes, 1))
        self.aux = nn.Sequential(conv_bn_relu(c3, 256), nn.Dropout2d(dropout), nn.Conv2d(256, num_classes, 1)) \
            if aux else None

    def forward(self, image: torch.Tensor):
        h, w = image.shape[-2:]
        d = self.backbone.size_divisor
        if h % d or w % d:
            image = F.pad(image, (0, -w % d, 0, -h % d))  # (B, 3, H', W'), sides multiples of the backbone's stride
        size = image.shape[-2:]
        c3, c4 = self.backbone(image)
        logits = self.classifier(self.attention(self.reduce(c4)))  # (B, K, H/8, W/8) (transformers: H/16)
        logits = resize_bilinear(logits, size)[..., :h, :w]
        if self.training and self.aux is not None:
            aux = resize_bilinear(self.aux(c3), size)[..., :h, :w]
            return logits, aux
        return logits
