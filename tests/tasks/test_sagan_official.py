"""SAGAN against StudioGAN (POSTECH-CVLab/PyTorch-StudioGAN@947b35e, src/models/resnet.py, src/utils/ops.py,
configs/CIFAR10/SAGAN.yaml), in float64, spectral norms on.

StudioGAN's 32x32 G and D are transliterated below with its attribute names and its spectral norm
(``torch.nn.utils.spectral_norm``, eps 1e-6, one per layer), so their ``state_dict()`` is a released checkpoint's;
it is written as StudioGAN saves it (``{"state_dict": ..., "step": ...}``), loaded through ``model.g_weights`` /
``model.d_weights``' loader, and both networks must compute the same function (eval mode: the stored u, v).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import spectral_norm

from attention.errors import UserError
from tasks.nets.sagan import Discriminator, Generator
from tasks.nets.weights import load_weights

SAGAN_SELF = {"name": "self", "heads": 1, "qk_ratio": 8, "v_ratio": 2, "kv_pool": 2, "scale": 1.0,
              "qkv_bias": False, "proj_bias": False, "separate_qkv": True}


def sn_conv(cin, cout, k, bias=True):
    return spectral_norm(nn.Conv2d(cin, cout, k, padding=k // 2, bias=bias), eps=1e-6)


def sn_linear(cin, cout, bias=True):
    return spectral_norm(nn.Linear(cin, cout, bias=bias), eps=1e-6)


class SelfAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1x1_theta, self.conv1x1_phi = sn_conv(c, c // 8, 1, False), sn_conv(c, c // 8, 1, False)
        self.conv1x1_g, self.conv1x1_attn = sn_conv(c, c // 2, 1, False), sn_conv(c // 2, c, 1, False)
        self.sigma = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        _, ch, h, w = x.shape
        theta = self.conv1x1_theta(x).view(-1, ch // 8, h * w)
        phi = F.max_pool2d(self.conv1x1_phi(x), 2).view(-1, ch // 8, h * w // 4)
        attn = torch.bmm(theta.permute(0, 2, 1), phi).softmax(-1)
        g = F.max_pool2d(self.conv1x1_g(x), 2).view(-1, ch // 2, h * w // 4)
        return x + self.sigma * self.conv1x1_attn(torch.bmm(g, attn.permute(0, 2, 1)).view(-1, ch // 2, h, w))


class CondBN(nn.Module):
    def __init__(self, k, c):
        super().__init__()
        self.bn = nn.BatchNorm2d(c, eps=1e-4, affine=False)
        self.gain, self.bias = sn_linear(k, c, False), sn_linear(k, c, False)

    def forward(self, x, y):
        return self.bn(x) * (1 + self.gain(y))[:, :, None, None] + self.bias(y)[:, :, None, None]


class GenBlock(nn.Module):
    def __init__(self, c, k):
        super().__init__()
        self.bn1, self.bn2 = CondBN(k, c), CondBN(k, c)
        self.conv2d0, self.conv2d1, self.conv2d2 = sn_conv(c, c, 1), sn_conv(c, c, 3), sn_conv(c, c, 3)

    def forward(self, x, y):
        h = self.conv2d1(F.interpolate(F.relu(self.bn1(x, y)), scale_factor=2, mode="nearest"))
        return self.conv2d2(F.relu(self.bn2(h, y))) + self.conv2d0(F.interpolate(x, scale_factor=2, mode="nearest"))


class StudioGenerator(nn.Module):
    def __init__(self, k=10, c=256, z=128):
        super().__init__()
        self.k, self.c = k, c
        self.linear0 = sn_linear(z, c * 16)
        self.blocks = nn.ModuleList([nn.ModuleList([GenBlock(c, k)]), nn.ModuleList([GenBlock(c, k)]),
                                     nn.ModuleList([SelfAttention(c)]), nn.ModuleList([GenBlock(c, k)])])
        self.bn4 = nn.BatchNorm2d(c, eps=1e-4)
        self.conv2d5 = sn_conv(c, 3, 3)

    def forward(self, z, label):
        y = F.one_hot(label, self.k).to(z.dtype)
        act = self.linear0(z).view(-1, self.c, 4, 4)
        for (block,) in self.blocks:
            act = block(act) if isinstance(block, SelfAttention) else block(act, y)
        return torch.tanh(self.conv2d5(F.relu(self.bn4(act))))


class DiscOptBlock(nn.Module):
    def __init__(self, cin, c):
        super().__init__()
        self.conv2d0, self.conv2d1, self.conv2d2 = sn_conv(cin, c, 1), sn_conv(cin, c, 3), sn_conv(c, c, 3)

    def forward(self, x):
        return F.avg_pool2d(self.conv2d2(F.relu(self.conv2d1(x))), 2) + self.conv2d0(F.avg_pool2d(x, 2))


class DiscBlock(nn.Module):
    def __init__(self, c, downsample):
        super().__init__()
        self.downsample = downsample
        if downsample:
            self.conv2d0 = sn_conv(c, c, 1)
        self.conv2d1, self.conv2d2 = sn_conv(c, c, 3), sn_conv(c, c, 3)
        self.activation = nn.ReLU(inplace=True)

    def forward(self, x):
        x0 = x
        x = self.conv2d2(self.activation(self.conv2d1(self.activation(x))))  # in place: x0 is now relu(x) too
        if self.downsample:
            x, x0 = F.avg_pool2d(x, 2), F.avg_pool2d(self.conv2d0(x0), 2)
        return x + x0


class StudioDiscriminator(nn.Module):
    def __init__(self, k=10, c=128):
        super().__init__()
        self.blocks = nn.ModuleList([nn.ModuleList([DiscOptBlock(3, c)]), nn.ModuleList([SelfAttention(c)]),
                                     nn.ModuleList([DiscBlock(c, True)]), nn.ModuleList([DiscBlock(c, False)]),
                                     nn.ModuleList([DiscBlock(c, False)])])
        self.linear1 = sn_linear(c, 1)
        self.embedding = spectral_norm(nn.Embedding(k, c), eps=1e-6)

    def forward(self, x, label):
        h = x
        for (block,) in self.blocks:
            h = block(h)
        h = torch.sum(F.relu(h), dim=[2, 3])
        return torch.squeeze(self.linear1(h)) + torch.sum(self.embedding(label) * h, 1)


def released(net, path, seed):
    """Random weights, u, v and BN statistics; saved as StudioGAN's checkpoints are."""
    g = torch.Generator().manual_seed(seed)
    net = net.double()
    with torch.no_grad():
        for key, value in net.state_dict().items():
            if value.is_floating_point():
                value.copy_(torch.randn(value.shape, generator=g, dtype=value.dtype) * 0.3)
                if key.endswith("running_var"):
                    value.abs_().add_(0.5)
    torch.save({"state_dict": net.state_dict(), "seed": 0, "step": 100000, "best_fid": 8.5}, path)
    return net.eval()


def test_studiogan_discriminator_checkpoint_and_function(tmp_path):
    official = released(StudioDiscriminator(), tmp_path / "D.pth", 0)
    keys = official.state_dict()
    assert "blocks.1.0.conv1x1_theta.weight_orig" in keys and "blocks.2.0.conv2d0.weight_u" in keys
    assert "blocks.3.0.conv2d0.weight_orig" not in keys  # identity shortcut
    ours = Discriminator(SAGAN_SELF, num_classes=10).double().eval()
    assert load_weights(ours, str(tmp_path / "D.pth"), "model.d_weights") == "official"
    x, y = torch.randn(3, 3, 32, 32, dtype=torch.float64), torch.tensor([0, 4, 9])
    with torch.no_grad():
        want = official(x, y)
        torch.testing.assert_close(ours(x, y), want, rtol=1e-10, atol=1e-10)
        textbook = Discriminator(SAGAN_SELF, num_classes=10, shortcut="textbook").double().eval()
        textbook.load_state_dict(ours.state_dict())
        assert not torch.allclose(textbook(x, y), want, rtol=1e-4)  # the shortcut's relu matters


def test_studiogan_generator_checkpoint_and_function(tmp_path):
    official = released(StudioGenerator(), tmp_path / "G.pth", 1)
    ours = Generator(SAGAN_SELF, num_classes=10).double().eval()
    assert load_weights(ours, str(tmp_path / "G.pth"), "model.g_weights") == "official"
    z, y = torch.randn(2, 128, dtype=torch.float64), torch.tensor([3, 7])
    with torch.no_grad():
        torch.testing.assert_close(ours(z, y), official(z, y), rtol=1e-10, atol=1e-10)
    with pytest.raises(UserError, match="after block 2.*model.g_attn_block=2"):
        load_weights(Generator(SAGAN_SELF, num_classes=10, attn_block=1), str(tmp_path / "G.pth"), "model.g_weights")


def test_one_stacked_qkv_would_normalise_the_stack_not_each_layer():
    """Why ``separate_qkv``: one spectral norm over [theta; phi; g] is not StudioGAN's three."""
    torch.manual_seed(0)
    separate = Discriminator(SAGAN_SELF, num_classes=0).double().eval()
    stacked = Discriminator({**SAGAN_SELF, "separate_qkv": False}, num_classes=0).double().eval()
    mixer_s, mixer_t = separate.attn.mixer, stacked.attn.mixer
    with torch.no_grad():
        w = torch.cat([m.parametrizations.weight.original for m in (mixer_s.q, mixer_s.k, mixer_s.v)])
        mixer_t.qkv.parametrizations.weight.original.copy_(w)
        q, k, v = (m.weight for m in (mixer_s.q, mixer_s.k, mixer_s.v))
        assert not torch.allclose(mixer_t.qkv.weight, torch.cat([q, k, v]))


def refusal(net, path, option):
    """The loader's one-line message for a file that ``net`` refuses; the network is left as it was."""
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(UserError) as err:
        load_weights(net, str(path), option)
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
    message = str(err.value)
    assert "\n" not in message and f"{option}={path} does not fit a " in message
    return message


def test_studiogan_discriminator_files_that_do_not_fit_are_named(tmp_path):
    released(StudioDiscriminator(k=10, c=32), tmp_path / "D.pth", 0)
    released(StudioGenerator(k=10, c=32, z=16), tmp_path / "G.pth", 1)
    # a conditional D into an unconditional one (model.conditional=false): its projection embedding is left over
    message = refusal(Discriminator(SAGAN_SELF, channels=32, num_classes=0), tmp_path / "D.pth", "model.d_weights")
    assert "nearest: its official key layout" in message and "missing none" in message
    assert ("unexpected 3 (embedding.parametrizations.weight.original, embedding.parametrizations.weight.0._u, "
            "embedding.parametrizations.weight.0._v)") in message
    assert "a dict with keys ['state_dict', 'seed', 'step', 'best_fid'] whose 'state_dict' is a state dict of 60 " \
           "tensors" in message and "StudioGAN's discriminator checkpoints, model=D-*.pth" in message
    # other widths (model.d_channels): every mis-shaped tensor counted, the first named with both shapes
    message = refusal(Discriminator(SAGAN_SELF, channels=16, num_classes=10), tmp_path / "D.pth", "model.d_weights")
    assert "missing none; unexpected none; wrong shape 54 (blocks.0.shortcut.bias (32,) (the network's: (16,))" \
           in message
    # the generator's file passed as the discriminator's: named as such, not taken for a misplaced attention block
    message = refusal(Discriminator(SAGAN_SELF, channels=32, num_classes=10), tmp_path / "G.pth", "model.d_weights")
    assert "missing 60 (blocks.0.conv1.bias" in message
    assert "unexpected 116 (linear0.bias, linear0.weight_orig, linear0.weight_u, linear0.weight_v" in message
    assert "d_attn_block" not in message


def test_g_ema_weights_load_the_ema_generator_and_wrong_files_are_named(tmp_path):
    from tasks.gan import GAN

    def task(ema):
        torch.manual_seed(0)
        return GAN(num_classes=10, class_names=[str(i) for i in range(10)], resolution=32,
                   model={"conditional": True, "z_dim": 16, "g_channels": 32, "d_channels": 32}, attn=SAGAN_SELF,
                   optim={}, ema={"enabled": ema, "decay": 0.999, "start": 0}, grid_per_class=1)

    official = released(StudioGenerator(k=10, c=32, z=16), tmp_path / "G_ema.pth", 2)
    released(StudioDiscriminator(k=10, c=32), tmp_path / "D.pth", 0)
    gan = task(ema=True)
    g_before = {k: v.clone() for k, v in gan.G.state_dict().items()}
    assert gan.load_weights({"g_weights": None, "d_weights": None,
                             "g_ema_weights": str(tmp_path / "G_ema.pth")}) == {"g_ema_weights": "official"}
    assert all(torch.equal(v, g_before[k]) for k, v in gan.G.state_dict().items())  # G keeps its own weights
    z, y = torch.randn(2, 16, dtype=torch.float64), torch.tensor([1, 8])
    with torch.no_grad():  # the evaluated generator is StudioGAN's G_ema
        torch.testing.assert_close(gan.generator.double().eval()(z, y), official(z, y), rtol=1e-10, atol=1e-10)

    gan = task(ema=True)  # StudioGAN's discriminator file passed as the EMA generator's
    message = refusal(gan.G_ema.module, tmp_path / "D.pth", "model.g_ema_weights")
    assert "a Generator (nearest: its own key layout)" in message and "missing 116 (linear.bias" in message
    assert "unexpected 60 (blocks.0.0.conv2d0.bias, blocks.0.0.conv2d0.weight_orig" in message
    assert "g_attn_block" not in message and "StudioGAN's generator checkpoints" in message
    with pytest.raises(UserError, match=r"model\.g_ema_weights=.*does not fit a Generator.*unexpected 60"):
        gan.load_weights({"g_ema_weights": str(tmp_path / "D.pth")})  # through the task: the same message
    torch.save(gan.G.state_dict(), tmp_path / "own.pth")  # a generator this suite saved: its own layout loads
    assert load_weights(gan.G_ema.module, str(tmp_path / "own.pth"), "model.g_ema_weights") == "own"
    with pytest.raises(UserError, match=r"model\.g_ema_weights is given but the generator EMA is off.*"
                                        r"ema\.enabled=true"):
        task(ema=False).load_weights({"g_ema_weights": str(tmp_path / "G_ema.pth")})


def test_a_gan_checkpoint_of_this_suite_gives_each_network_its_own_part(tmp_path):
    """A task=gan Lightning checkpoint (keys under G., D., G_ema.module.) as model.g_weights / d_weights /
    g_ema_weights: each network takes its own entries, every tensor placed."""
    from tasks.gan import GAN

    def task(seed):
        torch.manual_seed(seed)
        return GAN(num_classes=10, class_names=[str(i) for i in range(10)], resolution=32,
                   model={"conditional": True, "z_dim": 16, "g_channels": 32, "d_channels": 32}, attn=SAGAN_SELF,
                   optim={}, ema={"enabled": True, "decay": 0.999, "start": 0}, grid_per_class=1)

    trained = task(0)
    with torch.no_grad():
        for p in trained.G_ema.module.parameters():  # the EMA apart from G, so a wrong pick shows
            p.add_(1.0)
    torch.save({"state_dict": trained.state_dict(), "epoch": 3}, tmp_path / "gan.ckpt")
    fresh = task(1)
    path = str(tmp_path / "gan.ckpt")
    layouts = fresh.load_weights({"g_weights": path, "d_weights": path, "g_ema_weights": path})
    assert layouts == {"g_weights": "own (G.)", "d_weights": "own (D.)", "g_ema_weights": "own (G_ema.module.)"}
    for name in ("G", "D", "G_ema"):
        ours, theirs = getattr(fresh, name).state_dict(), getattr(trained, name).state_dict()
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs), name
