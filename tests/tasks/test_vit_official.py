"""ViT-S against timm's ``deit_small_patch16_224``, in float64: timm's own network (built without a download) is the
reference, and its state dict is the layout of DeiT's released ``deit_small_patch16_224-cd65a155.pth`` (which
holds it under ``model``)."""

import argparse

import pytest
import timm
import torch

from tasks.nets.backbones import build_backbone
from tasks.nets.weights import load_weights

SMALL = {"depth": 2}  # DeiT-S's width 384 and 6 heads, fewer blocks


def randomise(module, seed):
    """Random weights; LayerNorm scales around 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1 +
                    (1.0 if "norm" in name and name.endswith("weight") else 0.0))
    return module.eval()


@pytest.mark.parametrize("img_size", [224, 64])
def test_deit_file_loads_and_computes_timms_function(tmp_path, img_size):
    deit = timm.create_model("deit_small_patch16_224", pretrained=False, num_classes=10, img_size=img_size, **SMALL)
    deit = randomise(deit.double(), 0)
    args = argparse.Namespace(model="deit_small_patch16_224", input_size=img_size)
    torch.save({"model": deit.state_dict(), "optimizer": {}, "epoch": 299, "args": args}, tmp_path / "deit.pth")
    ours = build_backbone({"name": "vit_s", **SMALL}, {"name": "self"}, num_classes=10, img_size=img_size)
    ours = ours.double().eval()
    assert load_weights(ours, str(tmp_path / "deit.pth")) == "official"
    x = torch.randn(2, 3, img_size, img_size, dtype=torch.float64)
    with torch.no_grad():
        expected = deit(x)
        torch.testing.assert_close(ours(x), expected, rtol=1e-9, atol=1e-9)
        tokens = deit.forward_features(x)[:, 1:]  # (B, N, C), final-normed patch tokens
        side = img_size // 16
        torch.testing.assert_close(ours.forward_features(x)[0], tokens.transpose(1, 2).reshape(2, 384, side, side),
                                   rtol=1e-9, atol=1e-9)
    assert expected.abs().mean() > 0.1


def test_released_layout_fits_the_full_size_model():
    """Every key of the full-size deit_small_patch16_224 placed in our full-size vit_s, shapes equal."""
    with torch.device("meta"):
        official = timm.create_model("deit_small_patch16_224", pretrained=False).state_dict()
        ours = build_backbone({"name": "vit_s"}, {"name": "self"}, num_classes=1000, img_size=224)
    mapped, own = ours.from_official(official), ours.state_dict()
    assert len(mapped) == len(official)
    assert {k: tuple(v.shape) for k, v in mapped.items()} == {k: tuple(v.shape) for k, v in own.items()}
    assert tuple(official["patch_embed.proj.weight"].shape) == (384, 3, 16, 16)  # timm's PatchEmbed: renamed
    assert tuple(official["pos_embed"].shape) == (1, 197, 384)
