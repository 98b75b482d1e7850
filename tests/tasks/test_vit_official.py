"""ViT-S against timm's ``deit_small_patch16_224``, in float64: timm's own network (built without a download) is the
reference, and its state dict is the layout of DeiT's released ``deit_small_patch16_224-cd65a155.pth`` (which
holds it under ``model``)."""

import argparse

import pytest
import timm
import torch

from attention.errors import UserError
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
    """Every key of the full-size deit_small_patch16_224 placed in our full-size vit_s, shapes equal. timm's model is
    built with real tensors: timm 1.0.3 to 1.0.20 at least read their drop-path rates with .item(), which meta
    tensors refuse."""
    official = timm.create_model("deit_small_patch16_224", pretrained=False).state_dict()
    with torch.device("meta"):
        ours = build_backbone({"name": "vit_s"}, {"name": "self"}, num_classes=1000, img_size=224)
    mapped, own = ours.from_official(official), ours.state_dict()
    assert len(mapped) == len(official)
    assert {k: tuple(v.shape) for k, v in mapped.items()} == {k: tuple(v.shape) for k, v in own.items()}
    assert tuple(official["patch_embed.proj.weight"].shape) == (384, 3, 16, 16)  # timm's PatchEmbed: renamed
    assert tuple(official["pos_embed"].shape) == (1, 197, 384)


def test_files_that_do_not_fit_deit_s_are_refused_with_the_keys_named(tmp_path):
    """DeiT's distilled DeiT-S (a distillation token and a second head), and a DeiT-S file with fewer blocks: one
    message each, naming the keys that are missing, unexpected or of the wrong shape, and what the file holds."""
    ours = build_backbone({"name": "vit_s", **SMALL}, {"name": "self"}, num_classes=10, img_size=64)
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    distilled = timm.create_model("deit_small_distilled_patch16_224", pretrained=False, num_classes=10, img_size=64,
                                  **SMALL)
    torch.save({"model": distilled.state_dict(), "epoch": 299}, tmp_path / "deit_distilled.pth")
    with pytest.raises(UserError) as err:
        load_weights(ours, str(tmp_path / "deit_distilled.pth"))
    message = str(err.value)
    assert "\n" not in message and f"model.weights={tmp_path / 'deit_distilled.pth'} does not fit" in message
    assert "missing none" in message
    assert "unexpected 3 (dist_token, head_dist.weight, head_dist.bias)" in message
    assert "wrong shape 1 (pos_embed (1, 18, 384) (the network's: (1, 17, 384)))" in message  # two prefix tokens
    assert "a dict with keys ['model', 'epoch'] whose 'model' is a state dict of" in message
    assert "facebookresearch/deit, timm's deit_small_patch16_224 layout" in message  # what the network does read

    shallow = timm.create_model("deit_small_patch16_224", pretrained=False, num_classes=10, img_size=64, depth=1)
    torch.save({"model": shallow.state_dict()}, tmp_path / "deit_depth1.pth")
    with pytest.raises(UserError) as err:
        load_weights(ours, str(tmp_path / "deit_depth1.pth"))
    message = str(err.value)
    assert "\n" not in message and "nearest: its official key layout" in message
    assert "missing 12 (blocks.1.norm1.weight, blocks.1.norm1.bias, blocks.1.attn.qkv.weight" in message
    assert "unexpected none; wrong shape none" in message
    assert all(torch.equal(v, before[k]) for k, v in ours.state_dict().items())  # a refused file changes nothing


def test_a_deit_file_with_an_ema_loads_the_raw_weights(tmp_path):
    """DeiT's main.py keeps an EMA (saved as ``model_ema``) but evaluates ``model``: only networks whose official
    evaluation scores the EMA (``official_ema_keys``, EAMLP) read it first."""
    deit = randomise(timm.create_model("deit_small_patch16_224", pretrained=False, num_classes=10, img_size=64,
                                       **SMALL).double(), 0)
    ema = randomise(timm.create_model("deit_small_patch16_224", pretrained=False, num_classes=10, img_size=64,
                                      **SMALL).double(), 1)
    torch.save({"model": deit.state_dict(), "model_ema": ema.state_dict(), "state_dict_ema": ema.state_dict(),
                "epoch": 299}, tmp_path / "deit.pth")
    ours = build_backbone({"name": "vit_s", **SMALL}, {"name": "self"}, num_classes=10, img_size=64).double().eval()
    assert load_weights(ours, str(tmp_path / "deit.pth")) == "official"
    expected = ours.from_official(deit.state_dict())
    assert all(torch.equal(v, expected[k]) for k, v in ours.state_dict().items())
