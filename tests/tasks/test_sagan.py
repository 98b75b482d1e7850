"""SAGAN/EAGAN networks: SAGAN's attention block exactly, every variant plugged in, spectral norm, losses, EMA."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

import attention
from attention.errors import UserError
from tasks.gan import EMA, d_loss_fake, d_loss_real, g_loss
from tasks.nets.blocks import ScaledResidual
from tasks.nets.sagan import ConditionalBatchNorm2d, Discriminator, Generator

SAGAN_SELF = {"name": "self", "heads": 1, "qk_ratio": 8, "v_ratio": 2, "kv_pool": 2, "scale": 1.0,
              "qkv_bias": False, "proj_bias": False}


class StudioGANSelfAttention(nn.Module):
    """StudioGAN's ``ops.SelfAttention`` (src/utils/ops.py), written out with plain 1x1 convs."""

    def __init__(self, c):
        super().__init__()
        self.theta = nn.Conv2d(c, c // 8, 1, bias=False)
        self.phi = nn.Conv2d(c, c // 8, 1, bias=False)
        self.g = nn.Conv2d(c, c // 2, 1, bias=False)
        self.attn = nn.Conv2d(c // 2, c, 1, bias=False)
        self.sigma = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        b, c, h, w = x.shape
        theta = self.theta(x).view(b, c // 8, h * w)
        phi = F.max_pool2d(self.phi(x), 2).view(b, c // 8, h * w // 4)
        attn = torch.softmax(torch.bmm(theta.permute(0, 2, 1), phi), dim=-1)  # (B, HW, HW/4)
        g = F.max_pool2d(self.g(x), 2).view(b, c // 2, h * w // 4)
        attn_g = torch.bmm(g, attn.permute(0, 2, 1)).view(b, c // 2, h, w)
        return x + self.sigma * self.attn(attn_g)


def test_self_with_sagan_options_is_studiogans_block():
    torch.manual_seed(0)
    c = 64
    ref = StudioGANSelfAttention(c).double()
    for p in ref.parameters():
        nn.init.normal_(p, std=0.3)
    ours = ScaledResidual(c, SAGAN_SELF).double()
    mixer = ours.mixer
    with torch.no_grad():
        mixer.qkv.weight.copy_(torch.cat([ref.theta.weight, ref.phi.weight, ref.g.weight])[..., 0, 0])
        mixer.proj.weight.copy_(ref.attn.weight[..., 0, 0])
        ours.sigma.copy_(ref.sigma)
    x = torch.randn(3, c, 16, 16, dtype=torch.float64)
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-12, atol=1e-12)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in ref.parameters())
    # a wrong option would not match: the default d^-0.5 scaling changes the result
    scaled = ScaledResidual(c, {**SAGAN_SELF, "scale": None}).double()
    scaled.load_state_dict(ours.state_dict())
    assert not torch.allclose(scaled(x), ref(x))


def test_kv_pool_on_points_pools_over_neighbourhoods():
    torch.manual_seed(0)
    mixer = attention.build(**SAGAN_SELF, dim=32)
    xyz = torch.rand(2, 64, 3)
    y = mixer(torch.randn(2, 64, 32), attention.Points(xyz))
    assert y.shape == (2, 64, 32) and torch.isfinite(y).all()
    with pytest.raises(ValueError, match="kv_pool"):
        mixer(torch.randn(2, 64, 32), None)
    with pytest.raises(ValueError, match="divisible"):
        mixer(torch.randn(2, 15, 32), attention.Grid(3, 5))


@pytest.mark.parametrize("name", attention.names())
@pytest.mark.parametrize("conditional", [True, False])
def test_every_variant_in_generator_and_discriminator(name, conditional):
    torch.manual_seed(0)
    attn = {**attention.options(name), "name": name}
    k = 3 if conditional else 0
    G = Generator(attn, z_dim=16, channels=32, num_classes=k)
    D = Discriminator(attn, channels=16, num_classes=k)
    z, y = torch.randn(4, 16), torch.tensor([0, 1, 2, 1])
    images = G(z, y if k else None)
    assert images.shape == (4, 3, 32, 32) and images.abs().max() <= 1
    out = D(images, y if k else None)
    assert out.shape == (4,)
    out.sum().backward()
    # sigma starts at 0: the attention block is the identity at initialisation, and still gets a gradient
    assert G.attn.sigma.item() == 0 and D.attn.sigma.item() == 0
    assert D.attn.sigma.grad is not None and D.attn.sigma.grad.abs() > 0


def test_spectral_norm_on_every_conv_linear_embedding():
    G = Generator(SAGAN_SELF, z_dim=16, channels=32, num_classes=3)
    D = Discriminator({"name": "external", "heads": 1, "memory": 8}, channels=16, num_classes=3)
    layers = [m for net in (G, D) for m in net.modules() if isinstance(m, (nn.Conv2d, nn.Linear, nn.Embedding))]
    assert any(isinstance(m, nn.Embedding) for m in layers)
    assert len(layers) > 20 and all(parametrize.is_parametrized(m, "weight") for m in layers)
    # the normalised weight has spectral norm 1 (power iteration converges over forward passes in train mode)
    lin = G.linear
    for _ in range(30):
        G(torch.randn(2, 16), torch.tensor([0, 1]))
    G.eval()
    assert torch.linalg.matrix_norm(lin.weight.detach(), ord=2).item() == pytest.approx(1.0, rel=1e-2)


def test_conditional_batch_norm_formula():
    torch.manual_seed(0)
    cbn = ConditionalBatchNorm2d(4, 3)
    x, y = torch.randn(5, 4, 2, 2), F.one_hot(torch.tensor([0, 2, 1, 1, 0]), 3).float()
    mean, var = x.mean(dim=(0, 2, 3), keepdim=True), x.var(dim=(0, 2, 3), unbiased=False, keepdim=True)
    normed = (x - mean) / torch.sqrt(var + 1e-4)
    expected = normed * (1 + y @ cbn.gain.weight.T)[:, :, None, None] + (y @ cbn.bias.weight.T)[:, :, None, None]
    torch.testing.assert_close(cbn(x, y), expected, rtol=1e-5, atol=1e-5)
    assert not cbn.bn.affine
    assert ConditionalBatchNorm2d(4, 0).bn.affine  # unconditional: plain BN


def test_resolution_and_block_errors():
    with pytest.raises(UserError, match="data.resolution=64"):
        Generator(SAGAN_SELF, resolution=64)
    with pytest.raises(UserError, match="model.d_attn_block=7"):
        Discriminator(SAGAN_SELF, attn_block=7)
    G = Generator(SAGAN_SELF, z_dim=8, channels=16, attn_block=None)
    assert isinstance(G.attn, nn.Identity)


def test_losses_against_hand_computed_values():
    real, fake = torch.tensor([2.0, 0.5, -1.0]), torch.tensor([-2.0, 0.0, 1.5])
    # hinge: mean(relu(1 - real)) + mean(relu(1 + fake)) = (0 + 0.5 + 2) / 3 + (0 + 1 + 2.5) / 3
    assert d_loss_real("hinge", real).item() == pytest.approx(2.5 / 3)
    assert d_loss_fake("hinge", fake).item() == pytest.approx(3.5 / 3)
    assert g_loss("hinge", fake).item() == pytest.approx(0.5 / 3)
    sp = lambda t: torch.log1p(torch.exp(torch.tensor(t))).item()  # noqa: E731
    assert d_loss_real("nonsaturating", real).item() == pytest.approx((sp(-2.0) + sp(-0.5) + sp(1.0)) / 3, rel=1e-6)
    assert d_loss_fake("nonsaturating", fake).item() == pytest.approx((sp(-2.0) + sp(0.0) + sp(1.5)) / 3, rel=1e-6)
    assert g_loss("nonsaturating", fake).item() == pytest.approx((sp(2.0) + sp(0.0) + sp(-1.5)) / 3, rel=1e-6)


@pytest.mark.parametrize("kind", ["hinge", "nonsaturating"])
def test_losses_keep_float64_logits_in_float64(kind):
    """trainer.precision=64-true: D's logits are float64, and so are the losses (they were cast to float32, so a
    run "in float64 throughout" computed its GAN losses and their gradients in float32); half-precision logits
    still give float32 losses."""
    real = torch.tensor([2.0, 0.5, -1.0], dtype=torch.float64) + 1e-12  # 1e-12: lost in float32, kept in float64
    fake = torch.tensor([-2.0, 0.0, 1.5], dtype=torch.float64) + 1e-12
    sp = lambda t: torch.log1p(torch.exp(t))  # noqa: E731 - float64 softplus
    expected = {"hinge": ((1 - real).clamp(min=0).mean(), (1 + fake).clamp(min=0).mean(), -fake.mean()),
                "nonsaturating": (sp(-real).mean(), sp(fake).mean(), sp(-fake).mean())}[kind]
    got = (d_loss_real(kind, real), d_loss_fake(kind, fake), g_loss(kind, fake))
    for loss, want in zip(got, expected):
        assert loss.dtype == torch.float64
        torch.testing.assert_close(loss, want, rtol=1e-15, atol=1e-15)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert d_loss_real(kind, real.to(dtype)).dtype == torch.float32
        assert g_loss(kind, fake.to(dtype)).dtype == torch.float32


def test_ema_copies_before_start_then_averages():
    net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    ema = EMA(net, decay=0.9, start=2)
    with torch.no_grad():
        net[0].weight.fill_(1.0)
        net[1].running_mean.fill_(3.0)
    ema.update(net, step=1)  # before start: a copy
    assert torch.equal(ema.module[0].weight, net[0].weight)
    assert torch.equal(ema.module[1].running_mean, net[1].running_mean)
    with torch.no_grad():
        net[0].weight.fill_(2.0)
    ema.update(net, step=2)  # 0.9 * 1 + 0.1 * 2
    torch.testing.assert_close(ema.module[0].weight, torch.full((2, 2), 1.1))
    assert not any(p.requires_grad for p in ema.module.parameters())
    with pytest.raises(UserError, match="ema.decay"):
        EMA(net, decay=1.0, start=0)
