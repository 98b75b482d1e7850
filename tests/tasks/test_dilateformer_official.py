"""DilateFormer against the official ``Dilateformer`` of JIAOJIAYUASD/dilateformer@99f85bb (models/dilateformer.py),
in float64.

The official network is transliterated below with the official attribute names (``patch_embed.proj``,
``stages.<i>.blocks.<j>``, MSDA's 1x1-conv ``qkv``, ``stages.<i>.downsample.proj``), so its ``state_dict()`` has
the keys and shapes of a released checkpoint; the file is saved as the official ``main.py`` saves it
(``{"model": ..., "args": Namespace}``) and loaded through ``model.weights``' loader.
"""

import argparse

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attention.errors import UserError
from tasks.nets.backbones import build_backbone
from tasks.nets.weights import load_weights


class Mlp(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class DilateAttention(nn.Module):  # one dilation group: each pixel attends to its k x k dilated neighbours
    def __init__(self, head_dim, kernel_size, dilation):
        super().__init__()
        self.head_dim, self.kernel_size, self.scale = head_dim, kernel_size, head_dim ** -0.5
        self.unfold = nn.Unfold(kernel_size, dilation, dilation * (kernel_size - 1) // 2, 1)

    def forward(self, q, k, v):  # each (B, d, H, W)
        b, d, h, w = q.shape
        heads, kk = d // self.head_dim, self.kernel_size ** 2
        q = q.reshape(b, heads, self.head_dim, 1, h * w).permute(0, 1, 4, 3, 2)  # (B, h, N, 1, hd)
        k = self.unfold(k).reshape(b, heads, self.head_dim, kk, h * w).permute(0, 1, 4, 2, 3)  # (B, h, N, hd, kk)
        v = self.unfold(v).reshape(b, heads, self.head_dim, kk, h * w).permute(0, 1, 4, 3, 2)  # (B, h, N, kk, hd)
        attn = ((q @ k) * self.scale).softmax(dim=-1)  # (B, h, N, 1, kk)
        return (attn @ v).transpose(1, 2).reshape(b, h, w, d)  # (B, H, W, d), heads major


class MultiDilatelocalAttention(nn.Module):
    def __init__(self, dim, num_heads, kernel_size=3, dilation=(1, 2, 3)):
        super().__init__()
        self.num_dilation = len(dilation)
        self.qkv = nn.Conv2d(dim, dim * 3, 1, bias=True)
        self.dilate_attention = nn.ModuleList(DilateAttention(dim // num_heads, kernel_size, r) for r in dilation)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):  # (B, H, W, C)
        b, h, w, c = x.shape
        g = self.num_dilation
        qkv = self.qkv(x.permute(0, 3, 1, 2)).reshape(b, 3, g, c // g, h, w).permute(2, 1, 0, 3, 4, 5)
        groups = [self.dilate_attention[i](qkv[i][0], qkv[i][1], qkv[i][2]) for i in range(g)]  # (B, H, W, C/g)
        return self.proj(torch.cat(groups, dim=-1))


class GlobalAttention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads, self.scale = num_heads, (dim // num_heads) ** -0.5
        self.qkv, self.proj = nn.Linear(dim, dim * 3, bias=True), nn.Linear(dim, dim)

    def forward(self, x):  # (B, H, W, C)
        b, h, w, c = x.shape
        q, k, v = self.qkv(x).reshape(b, h * w, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)
        attn = (q @ k.transpose(-2, -1) * self.scale).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, h, w, c))


class Block(nn.Module):  # DilateBlock / GlobalBlock with cpe_per_block=True (the official default)
    def __init__(self, dim, num_heads, dilate):
        super().__init__()
        self.pos_embed = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = MultiDilatelocalAttention(dim, num_heads) if dilate else GlobalAttention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, 4 * dim)

    def forward(self, x):  # (B, C, H, W)
        x = (x + self.pos_embed(x)).permute(0, 2, 3, 1)
        x = x + self.attn(self.norm1(x))
        x = x + self.mlp(self.norm2(x))
        return x.permute(0, 3, 1, 2)


class PatchMerging(nn.Module):  # merging_way='conv3_2', cpe_per_satge=False
    def __init__(self, cin, cout):
        super().__init__()
        self.proj = nn.Sequential(nn.Conv2d(cin, cout, 3, 2, 1), nn.BatchNorm2d(cout))

    def forward(self, x):
        return self.proj(x)


class Stage(nn.Module):  # Dilatestage / Globalstage
    def __init__(self, dim, depth, num_heads, dilate, downsample):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, num_heads, dilate) for _ in range(depth))
        self.downsample = PatchMerging(dim, 2 * dim) if downsample else nn.Identity()

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return self.downsample(x)


class PatchEmbed(nn.Module):  # patch_way='overlaping', hidden_dim=16
    def __init__(self, in_chans, embed_dim, hidden_dim=16):
        super().__init__()
        h = hidden_dim
        self.proj = nn.Sequential(
            nn.Conv2d(in_chans, h, 3, 1, 1, bias=False), nn.BatchNorm2d(h), nn.GELU(),
            nn.Conv2d(h, 2 * h, 3, 2, 1, bias=False), nn.BatchNorm2d(2 * h), nn.GELU(),
            nn.Conv2d(2 * h, 4 * h, 3, 1, 1, bias=False), nn.BatchNorm2d(4 * h), nn.GELU(),
            nn.Conv2d(4 * h, embed_dim, 3, 2, 1, bias=False))

    def forward(self, x):
        return self.proj(x)


class Dilateformer(nn.Module):
    def __init__(self, num_classes=1000, embed_dim=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24),
                 dilate_attention=(True, True, False, False), downsamples=(True, True, True, False)):
        super().__init__()
        self.patch_embed = PatchEmbed(3, embed_dim)
        self.stages = nn.ModuleList(Stage(embed_dim * 2 ** i, depths[i], num_heads[i], dilate_attention[i],
                                          downsamples[i]) for i in range(len(depths)))
        num_features = embed_dim * 2 ** (len(depths) - 1)
        self.norm = nn.LayerNorm(num_features, eps=1e-6)
        self.avgpool = nn.AdaptiveAvgPool1d(1)
        self.head = nn.Linear(num_features, num_classes)

    def forward(self, x):
        x = self.patch_embed(x)
        for stage in self.stages:
            x = stage(x)
        x = self.norm(x.flatten(2).transpose(1, 2))  # (B, L, C)
        return self.head(torch.flatten(self.avgpool(x.transpose(1, 2)), 1))


RELEASED = {  # the official dilateformer_tiny / small / base
    "dilateformer_t": {"depths": (2, 2, 6, 2), "embed_dim": 72},
    "dilateformer_s": {"depths": (3, 5, 8, 3), "embed_dim": 72},
    "dilateformer_b": {"depths": (4, 8, 10, 3), "embed_dim": 96},
}
SMALL = {"depths": [2, 1, 1, 1], "embed_dim": 24}  # heads 3, 6, 12, 24: head width 8 in every stage


def randomise(module, seed):
    """Random weights and BatchNorm statistics (eval mode then uses them); norm scales around 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for owner in module.modules():
            for name, t in [*owner.named_parameters(recurse=False), *owner.named_buffers(recurse=False)]:
                if not t.is_floating_point():
                    t.fill_(7)  # num_batches_tracked
                    continue
                noise = torch.randn(t.shape, generator=g, dtype=t.dtype) * 0.2
                if name == "running_var":
                    noise = noise.abs() + 0.5
                elif name == "weight" and isinstance(owner, (nn.BatchNorm2d, nn.LayerNorm)):
                    noise = noise + 1.0
                t.copy_(noise)
    return module.eval()


def save_official(net, path):
    """As the official ``main.py`` saves ``checkpoint.pth`` (model EMA on, its default): the weights under
    ``model``, beside the optimiser, scheduler, EMA and AMP scaler states and the argparse arguments."""
    from timm.scheduler import CosineLRScheduler

    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    net(torch.zeros(1, 3, 32, 32, dtype=torch.float64)).sum().backward()
    optimizer.step()  # tensors in the optimiser state, as a trained checkpoint has them
    optimizer.zero_grad()
    args = argparse.Namespace(model="dilateformer_tiny", input_size=64, drop_path=0.1, output_dir="ckpt",
                              model_ema=True, model_ema_decay=0.99996, smoothing=0.1, resume="")
    torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                "lr_scheduler": CosineLRScheduler(optimizer, t_initial=300).state_dict(), "epoch": 299,
                "model_ema": {k: v + 1 for k, v in net.state_dict().items()},
                "scaler": torch.amp.GradScaler("cpu").state_dict(), "args": args, "max_accuracy": 82.1}, path)


def test_official_file_loads_and_computes_the_official_function(tmp_path):
    official = randomise(Dilateformer(num_classes=10, **SMALL).double(), 0)
    save_official(official, tmp_path / "checkpoint.pth")
    ours = build_backbone({"name": "dilateformer_t", **SMALL}, {"name": "dilated"}, num_classes=10,
                          img_size=64).double().eval()
    assert load_weights(ours, str(tmp_path / "checkpoint.pth")) == "official"
    assert int(ours.stem[1].num_batches_tracked) == 7  # BatchNorm buffers placed too
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    with torch.no_grad():
        expected = official(x)
        torch.testing.assert_close(ours(x), expected, rtol=1e-9, atol=1e-9)
        # the feature maps too: stage 4 before the final norm is the official last stage's output
        x4 = official.stages[3](official.stages[2](official.stages[1](official.stages[0](official.patch_embed(x)))))
        torch.testing.assert_close(ours.forward_features(x)[3], x4, rtol=1e-9, atol=1e-9)
    assert expected.abs().mean() > 0.1  # the weights are not a trivial fit


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_released_layouts_fit_the_full_size_models(name):
    """Every key of the official T/S/B state dict placed in our full-size model, shapes equal (meta tensors)."""
    with torch.device("meta"):
        official = Dilateformer(**RELEASED[name]).state_dict()
        ours = build_backbone({"name": name}, {"name": "dilated"}, num_classes=1000, img_size=224)
    mapped, own = ours.from_official(official), ours.state_dict()
    assert len(mapped) == len(official)  # no two official keys on one of ours
    assert sorted(mapped) == sorted(own)
    assert {k: tuple(v.shape) for k, v in mapped.items()} == {k: tuple(v.shape) for k, v in own.items()}
    assert tuple(official["stages.0.blocks.0.attn.qkv.weight"].shape) == (3 * RELEASED[name]["embed_dim"],
                                                                          RELEASED[name]["embed_dim"], 1, 1)


def test_a_deit_file_is_refused_with_the_keys_named(tmp_path):
    import timm

    deit = timm.create_model("deit_small_patch16_224", pretrained=False, depth=1, num_classes=10, img_size=64)
    torch.save({"model": deit.state_dict()}, tmp_path / "deit.pth")
    ours = build_backbone({"name": "dilateformer_t", **SMALL}, {"name": "dilated"}, num_classes=10, img_size=64)
    with pytest.raises(UserError) as err:
        load_weights(ours, str(tmp_path / "deit.pth"))
    message = str(err.value)
    assert "\n" not in message and "model.weights=" in message
    assert "missing" in message and "stem.0.weight" in message
    assert "unexpected" in message and "cls_token" in message
    assert "JIAOJIAYUASD/dilateformer" in message  # what the network does read


def test_msda_qkv_keeps_the_official_1x1_conv_init():
    """The official MSDA's qkv is nn.Conv2d(C, 3C, 1, bias=True), which _init_weights (Linear and LayerNorm only)
    leaves at PyTorch's conv init: kaiming_uniform(a=sqrt(5)), i.e. U(+-1/sqrt(C)) weights, and U(+-1/sqrt(C))
    biases, C = fan_in. The official Linears (MSDA's proj, the global stages' qkv, the head) are drawn with std
    0.02 and zero biases."""
    torch.manual_seed(0)
    net = build_backbone({"name": "dilateformer_t"}, {"name": "dilated"}, num_classes=1000, img_size=224)
    weights, biases = [], []
    for stage in (0, 1):
        for block in net.stages[stage]:
            qkv = block.block.attn.qkv
            bound = qkv.in_features ** -0.5  # 1/sqrt(fan_in) of the 1x1 conv: in_channels * 1 * 1
            assert qkv.bias is not None and qkv.bias.abs().min() > 0
            weights.append(qkv.weight.flatten() / bound)
            biases.append(qkv.bias / bound)
            proj = block.block.attn.proj
            assert proj.weight.std().item() == pytest.approx(0.02, rel=0.05) and not proj.bias.any()
    w, b = torch.cat(weights), torch.cat(biases)  # 186,624 and 1,296 draws of U(-1, 1)
    assert w.abs().max() <= 1 and w.abs().max() > 0.999 and b.abs().max() <= 1
    assert w.std().item() == pytest.approx(3 ** -0.5, rel=0.01) and abs(w.mean().item()) < 4 / 3 ** 0.5 / 432
    assert b.std().item() == pytest.approx(3 ** -0.5, rel=0.06)
    for block in net.stages[2]:  # global attention: an official Linear
        qkv = block.block.attn.qkv
        assert qkv.weight.std().item() == pytest.approx(0.02, rel=0.02) and not qkv.bias.any()
