"""Dilated ResNet + attention head for semantic segmentation (EANet's network, any attention variant).

    image (B, 3, H, W)
    backbone   torchvision ResNet-50/101 dilated to output stride 8 (``replace_stride_with_dilation``):
               layer3 (1024 ch) and layer4 (2048 ch) at H/8
    head       ConvBNReLU 3x3 2048->512
               attention block  ReLU(x + BN(conv1x1(mixer(conv1x1(x)))))   (``head=attention``)
               ConvBNReLU 3x3 512->256, Dropout2d(0.1), conv1x1 -> classes
    aux head   on layer3: ConvBNReLU 3x3 1024->256, Dropout2d(0.1), conv1x1 -> classes (FCN, loss weight 0.4)
    logits     bilinear upsampling to (H, W)

The mixer comes from the ``attn`` config and sees the feature map as tokens on
``attention.Grid(H/8, W/8)``; ``attn=external`` is EANet's head. ``head=none`` drops
the attention block (the plain dilated FCN every variant is compared with).

``resnet18`` / ``resnet34`` are accepted as light backbones for CPU runs; their
BasicBlocks have no dilation support in torchvision (it raises for dilation > 1),
so they are dilated here the way mmseg's ResNet does it: stride 1 and dilation
2 / 4 in the 3x3 convolutions of layer3 / layer4.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch
import torch.nn.functional as F
import torchvision
from einops import rearrange
from torch import nn

import attention
from attention.errors import UserError

log = logging.getLogger(__name__)
BACKBONES = {  # name: (torchvision builder, weights enum name, bottleneck?)
    "resnet18": ("resnet18", "ResNet18_Weights", False),
    "resnet34": ("resnet34", "ResNet34_Weights", False),
    "resnet50": ("resnet50", "ResNet50_Weights", True),
    "resnet101": ("resnet101", "ResNet101_Weights", True),
}
HEADS = ("attention", "none")


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
        if not os.path.isfile(weights):
            raise UserError(f"model.weights={weights} is not a file: pass the path of a torchvision {name} state dict "
                            f"(e.g. {name} ImageNet weights), or drop model.weights.")
        try:
            state = torch.load(weights, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - any unreadable or unsafe file is the user's to fix
            raise UserError(f"model.weights={weights} cannot be loaded with torch.load(weights_only=True) "
                            f"({str(err).splitlines()[0]}): pass a plain state dict of a torchvision {name}.") from None
        state = state.get("state_dict", state) if isinstance(state, dict) else state
        own = net.state_dict()
        state = {k: v for k, v in state.items() if not k.startswith("fc.")}
        missing = [k for k in own if k not in state and not k.startswith("fc.")]
        wrong = [k for k, v in state.items() if k not in own or own[k].shape != getattr(v, "shape", None)]
        if missing or wrong:
            raise UserError(f"model.weights={weights} does not fit a {name}: {len(missing)} missing tensors "
                            f"(e.g. {missing[:3]}), {len(wrong)} unexpected or of the wrong shape (e.g. {wrong[:3]}). "
                            "Pass the matching model.backbone or the right file.")
        net.load_state_dict(state, strict=False)
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
            raise UserError(f"model.backbone={name!r} is not known: use one of {', '.join(BACKBONES)}.")
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

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.layer2(self.layer1(self.stem(x)))  # (B, 512 | 128, H/8, W/8)
        c3 = self.layer3(x)  # (B, 1024 | 256, H/8, W/8)
        return c3, self.layer4(c3)  # (B, 2048 | 512, H/8, W/8)


class AttentionBlock(nn.Module):
    """EANet's block: ``ReLU(x + BN(conv1x1(mixer(conv1x1(x)))))`` with the mixer on the feature map's grid."""

    def __init__(self, channels: int, attn: Mapping):
        super().__init__()
        self.conv_in = nn.Conv2d(channels, channels, 1)
        self.mixer = attention.build(**attn, dim=channels)
        self.conv_out = nn.Sequential(nn.Conv2d(channels, channels, 1, bias=False), nn.BatchNorm2d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2:]
        tokens = rearrange(self.conv_in(x), "b c h w -> b (h w) c")  # (B, N, C)
        mixed = rearrange(self.mixer(tokens, attention.Grid(h, w)), "b (h w) c -> b c h w", h=h)
        return F.relu(x + self.conv_out(mixed))


class SegNet(nn.Module):
    """image (B, 3, H, W) -> logits (B, K, H, W), plus the auxiliary logits in training when ``aux``."""

    def __init__(self, num_classes: int, attn: Mapping, backbone: str = "resnet50", pretrained: bool = False,
                 weights: str | None = None, head: str = "attention", head_channels: int = 512, aux: bool = True,
                 dropout: float = 0.1):
        super().__init__()
        if head not in HEADS:
            raise UserError(f"model.head={head!r} is not known: use model.head=attention (EANet-style head with the "
                            "attn variant) or model.head=none (plain dilated FCN baseline).")
        self.backbone = Backbone(backbone, pretrained, weights)
        c3, c4 = self.backbone.channels
        self.reduce = conv_bn_relu(c4, head_channels)
        self.attention = AttentionBlock(head_channels, attn) if head == "attention" else nn.Identity()
        self.classifier = nn.Sequential(conv_bn_relu(head_channels, head_channels // 2), nn.Dropout2d(dropout),
                                        nn.Conv2d(head_channels // 2, num_classes, 1))
        self.aux = nn.Sequential(conv_bn_relu(c3, 256), nn.Dropout2d(dropout), nn.Conv2d(256, num_classes, 1)) \
            if aux else None

    def forward(self, image: torch.Tensor):
        size = image.shape[-2:]
        c3, c4 = self.backbone(image)
        logits = self.classifier(self.attention(self.reduce(c4)))  # (B, K, H/8, W/8)
        logits = F.interpolate(logits, size=size, mode="bilinear", align_corners=False)
        if self.training and self.aux is not None:
            aux = F.interpolate(self.aux(c3), size=size, mode="bilinear", align_corners=False)
            return logits, aux
        return logits
