"""EANet's block and LAM's module against float64 transliterations of the official code, weights copied.

EANet: MenghaoGuo/EANet@59c03cb, model_torch.py ``External_attention``. LAM: lironui/Linear-Attention-Mechanism
@bcf9789, ``PositionLinearAttention``. Both are reached by configuration: ``task=segmentation``'s presets for
``attn=external`` and ``attn=linear_taylor`` (``configs/task/segmentation.yaml``).
"""

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

import attention
from attention.errors import UserError
from tasks.nets.blocks import EANetResidual, ScaledResidual


def segmentation_attn(name):
    """``attn`` as task=segmentation composes it for ``attn=<name>`` (its preset applied)."""
    from hydra import compose, initialize_config_dir

    from suite.compose import apply_attn_preset
    from test_run import ROOT

    with initialize_config_dir(str(ROOT / "configs"), version_base=None):
        cfg = compose("config", ["task=segmentation", f"attn={name}"])
    apply_attn_preset(cfg, [])
    return OmegaConf.to_container(cfg.attn, resolve=True)


class ExternalAttention(nn.Module):
    """EANet's block as released (BatchNorm for its SynchronizedBatchNorm2d)."""

    def __init__(self, c, k=64):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 1)
        self.linear_0 = nn.Conv1d(c, k, 1, bias=False)
        self.linear_1 = nn.Conv1d(k, c, 1, bias=False)
        self.conv2 = nn.Sequential(nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x):
        idn = x
        x = self.conv1(x)
        b, c, h, w = x.shape
        attn = F.softmax(self.linear_0(x.view(b, c, h * w)), dim=-1)  # (b, k, n)
        attn = attn / (1e-9 + attn.sum(dim=1, keepdim=True))
        x = self.linear_1(attn).view(b, c, h, w)
        return F.relu(self.conv2(x) + idn)


class PositionLinearAttention(nn.Module):
    """LAM's module as released: l2 norms without eps, eps 1e-6 on the key sum, gamma residual."""

    def __init__(self, c, eps=1e-6):
        super().__init__()
        self.gamma = nn.Parameter(torch.zeros(1))
        self.eps = eps
        self.query_conv, self.key_conv = nn.Conv2d(c, c // 8, 1), nn.Conv2d(c, c // 8, 1)
        self.value_conv = nn.Conv2d(c, c, 1)

    def forward(self, x):
        b, c, width, height = x.shape  # LAM's names: (H, W) called (width, height)
        q = self.query_conv(x).view(b, -1, width * height)
        k = self.key_conv(x).view(b, -1, width * height)
        v = self.value_conv(x).view(b, -1, width * height)
        q = (q / torch.norm(q, p=2, dim=-2, keepdim=True)).permute(0, 2, 1)  # (b, n, c')
        k = k / torch.norm(k, p=2, dim=-2, keepdim=True)  # (b, c', n)
        tailor_sum = 1 / (width * height + torch.einsum("bnc,bc->bn", q, k.sum(dim=-1) + self.eps))
        value_sum = v.sum(dim=-1, keepdim=True).expand(-1, c, width * height)
        matrix_sum = value_sum + torch.einsum("bnm,bmc->bcn", q, torch.einsum("bmn,bcn->bmc", k, v))
        weight_value = torch.einsum("bcn,bn->bcn", matrix_sum, tailor_sum).view(b, c, height, width)
        return x + self.gamma * weight_value


def randomise(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, value in module.state_dict().items():
            if value.is_floating_point():
                value.copy_(torch.randn(value.shape, generator=g, dtype=value.dtype) * 0.2)
                if key.endswith("running_var"):
                    value.abs_().add_(0.5)
    return module.eval()


def test_eanet_block_is_the_segmentation_head_for_attn_external():
    attn = segmentation_attn("external")
    assert attn == {"name": "external", "heads": 1, "memory": 64, "expand": 1, "in_proj": False, "out_proj": False,
                    "attn_drop": 0.0, "proj_drop": 0.0}
    official = randomise(ExternalAttention(512).double(), 0)
    ours = EANetResidual(512, attn).double().eval()
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in official.parameters()) == 591_360
    with torch.no_grad():
        ours.conv_in.load_state_dict(official.conv1.state_dict())
        ours.conv_out.load_state_dict(official.conv2.state_dict())
        ours.mixer.mem_k.copy_(official.linear_0.weight[:, :, 0])  # (S, C)
        ours.mixer.mem_v.copy_(official.linear_1.weight[:, :, 0].T)  # (C, S) -> (S, C)
        x = torch.randn(2, 512, 9, 11, dtype=torch.float64)
        torch.testing.assert_close(ours(x), official(x), rtol=1e-10, atol=1e-10)
    # The suite's default mixer (own query and output projections) is not EANet's block: 1,116,672 parameters.
    assert sum(p.numel() for p in EANetResidual(512, {"name": "external"}).parameters()) == 1_116_672


def test_lam_module_is_the_scaled_block_with_linear_taylor_preset():
    attn = segmentation_attn("linear_taylor")
    assert attn["qk_ratio"] == 8 and attn["out_proj"] is False and attn["heads"] == 1
    official = randomise(PositionLinearAttention(512).double(), 1)
    ours = ScaledResidual(512, attn).double().eval()
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in official.parameters()) == 328_321
    with torch.no_grad():
        convs = (official.query_conv, official.key_conv, official.value_conv)
        ours.mixer.qkv.weight.copy_(torch.cat([c.weight[:, :, 0, 0] for c in convs]))
        ours.mixer.qkv.bias.copy_(torch.cat([c.bias for c in convs]))
        ours.sigma.copy_(official.gamma)
        x = torch.randn(2, 512, 10, 10, dtype=torch.float64)  # LAM's module is defined on square maps
        torch.testing.assert_close(ours(x), official(x), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name,opts", [("external", {"expand": 2, "in_proj": False}),
                                       ("linear_taylor", {"qk_ratio": 8, "in_proj": False}),
                                       ("self", {"out_proj": False})])
def test_projections_that_cannot_be_switched_off_are_refused(name, opts):
    with pytest.raises(UserError, match=r"attn\.(in_proj|out_proj)"):
        attention.build(name, dim=64, **opts)
