"""PCT part segmentation against the authors' ``Point_Transformer_partseg`` (MenghaoGuo/PCT@b7152d6,
networks/seg/pct_partseg.py, Jittor), in float64.

The Jittor network is transliterated below into torch with the official attribute names (jt.nn.Conv1d ->
nn.Conv1d, jt.nn.BatchNorm1d -> nn.BatchNorm1d with Jittor's defaults eps 1e-5 and momentum 0.1, LeakyReLU(scale=0.2)
-> LeakyReLU(0.2), ``execute`` -> ``forward``), so its ``state_dict()`` has the keys a PyTorch port of it saves.
No checkpoint is released, so a state dict with random weights and BN statistics stands in for one: it goes through
``model.weights``' loader and both networks, in eval mode, must give the same part logits.
"""

import torch
import torch.nn.functional as F
from torch import nn

from tasks.nets.pct import PCTPartSeg
from tasks.nets.weights import load_weights


class SA_Layer(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.q_conv = nn.Conv1d(channels, channels // 4, 1, bias=False)
        self.k_conv = nn.Conv1d(channels, channels // 4, 1, bias=False)
        self.q_conv.weight = self.k_conv.weight  # tied, as the official code
        self.v_conv = nn.Conv1d(channels, channels, 1)
        self.trans_conv = nn.Conv1d(channels, channels, 1)
        self.after_norm = nn.BatchNorm1d(channels, eps=1e-5, momentum=0.1)

    def forward(self, x):
        x_q = self.q_conv(x).permute(0, 2, 1)  # (B, N, C/4)
        energy = torch.bmm(x_q, self.k_conv(x))  # (B, N, N)
        attention = energy.softmax(dim=-1)
        attention = attention / (1e-9 + attention.sum(dim=1, keepdim=True))
        x_r = torch.bmm(self.v_conv(x), attention)  # (B, C, N)
        return x + F.relu(self.after_norm(self.trans_conv(x - x_r)))


class Point_Transformer_partseg(nn.Module):
    def __init__(self, part_num=50):
        super().__init__()
        self.conv1 = nn.Conv1d(3, 128, 1, bias=False)
        self.conv2 = nn.Conv1d(128, 128, 1, bias=False)
        self.bn1, self.bn2 = nn.BatchNorm1d(128), nn.BatchNorm1d(128)
        self.sa1, self.sa2, self.sa3, self.sa4 = (SA_Layer(128) for _ in range(4))
        self.conv_fuse = nn.Sequential(nn.Conv1d(512, 1024, 1, bias=False), nn.BatchNorm1d(1024), nn.LeakyReLU(0.2))
        self.label_conv = nn.Sequential(nn.Conv1d(16, 64, 1, bias=False), nn.BatchNorm1d(64), nn.LeakyReLU(0.2))
        self.convs1 = nn.Conv1d(1024 * 3 + 64, 512, 1)
        self.dp1 = nn.Dropout(0.5)
        self.convs2 = nn.Conv1d(512, 256, 1)
        self.convs3 = nn.Conv1d(256, part_num, 1)
        self.bns1, self.bns2 = nn.BatchNorm1d(512), nn.BatchNorm1d(256)

    def forward(self, x, cls_label):  # x (B, 3, N), cls_label (B, 16) one-hot, as the reference feeds them
        batch_size, _, n = x.shape
        x = F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))
        x1 = self.sa1(x)
        x2 = self.sa2(x1)
        x3 = self.sa3(x2)
        x4 = self.sa4(x3)
        x = self.conv_fuse(torch.cat((x1, x2, x3, x4), dim=1))  # (B, 1024, N)
        x_max_feature = x.amax(2).view(batch_size, -1).unsqueeze(-1).repeat(1, 1, n)
        x_avg_feature = x.mean(2).view(batch_size, -1).unsqueeze(-1).repeat(1, 1, n)
        cls_label_feature = self.label_conv(cls_label.view(batch_size, 16, 1)).repeat(1, 1, n)
        x = torch.cat((x, x_max_feature, x_avg_feature, cls_label_feature), 1)  # (B, 1024 * 3 + 64, N)
        x = self.dp1(F.relu(self.bns1(self.convs1(x))))
        x = F.relu(self.bns2(self.convs2(x)))
        return self.convs3(x)


def official_state(seed=0):
    """The official network's state dict with random float64 weights and BN statistics, at scales that keep the
    signal alive through the 4 blocks and the head (logits of tens) and make the attention peaked (row maxima near
    1, column sums from ~1e-5 to ~45), so the column renormalisation changes the logits by thousands."""
    g = torch.Generator().manual_seed(seed)
    state = Point_Transformer_partseg().double().state_dict()
    for key, value in state.items():
        if not value.is_floating_point():
            continue
        u = torch.rand(value.shape, generator=g, dtype=value.dtype)
        if value.dim() == 3:  # Conv1d (O, I, 1): uniform, variance 2 / fan-in
            value.copy_((u * 2 - 1) * (6 / value.shape[1]) ** 0.5)
        elif key.endswith(("running_var", ".weight")):  # BN scales and variances in [0.5, 1.5]
            value.copy_(u + 0.5)
        else:  # biases, BN shifts and means in [-0.1, 0.1]
            value.copy_(u * 0.2 - 0.1)
    return state


def test_official_key_layout_and_parameter_count():
    official = Point_Transformer_partseg()
    state = official.state_dict()
    assert state["sa1.q_conv.weight"].data_ptr() == state["sa1.k_conv.weight"].data_ptr()
    assert sum(p.numel() for p in official.parameters()) == 2_446_130
    assert sum(p.numel() for p in PCTPartSeg(50, 16, {"name": "offset"}).parameters()) == 2_446_130


def test_official_state_dict_loads_and_computes_the_official_function(tmp_path):
    state = official_state()
    path = tmp_path / "partseg.pth"
    torch.save(state, path)
    official = Point_Transformer_partseg().double().eval()
    official.load_state_dict(state)
    ours = PCTPartSeg(50, 16, {"name": "offset"}).double().eval()
    assert load_weights(ours, str(path)) == "official"
    assert torch.equal(ours.blocks[3].mixer.qk.weight, state["sa4.k_conv.weight"].squeeze(-1))
    assert torch.equal(ours.category[1].running_mean, state["label_conv.1.running_mean"])
    assert torch.equal(ours.head[7].bias, state["convs3.bias"])
    g = torch.Generator().manual_seed(1)
    xyz = torch.rand(2, 128, 3, generator=g, dtype=torch.float64) * 2 - 1
    category = torch.tensor([3, 11])
    with torch.no_grad():
        expected = official(xyz.transpose(1, 2), F.one_hot(category, 16).double())
        assert expected.abs().max() > 10  # a signal that reaches the logits, not one squashed to ~0
        torch.testing.assert_close(ours(xyz, category), expected, rtol=1e-9, atol=1e-9)
        # the category matters: another one changes the logits
        assert not torch.allclose(ours(xyz, torch.tensor([4, 11])), expected, rtol=1e-3, atol=1e-3)


def test_training_step_is_the_official_one():
    """In training mode too: batch statistics, running statistics and every gradient (dropout off in both)."""
    from test_pct_official import assert_same_training_step
    state = official_state()
    official = Point_Transformer_partseg().double().train()
    official.load_state_dict(state)
    official.dp1.p = 0.0
    ours = PCTPartSeg(50, 16, {"name": "offset"}, dropout=0.0).double().train()
    ours.load_state_dict(PCTPartSeg.from_official(state))
    g = torch.Generator().manual_seed(2)
    xyz = torch.rand(2, 128, 3, generator=g, dtype=torch.float64) * 2 - 1
    category = torch.tensor([3, 11])
    weights = torch.randn(2, 50, 128, generator=g, dtype=torch.float64)
    assert_same_training_step(ours, official, ours(xyz, category),
                              official(xyz.transpose(1, 2), F.one_hot(category, 16).double()), weights)


def test_an_official_state_dict_that_does_not_fit_is_named(tmp_path):
    import pytest

    from attention.errors import UserError

    state = official_state()
    state["sa2.k_conv.weight"] = state["sa2.k_conv.weight"] + 1  # untied: no offset mixer holds two q/k weights
    del state["convs3.bias"]
    path = tmp_path / "partseg.pth"
    torch.save(state, path)
    with pytest.raises(UserError, match=r"(?s)nearest: its official key layout.*missing 1 \(head\.7\.bias\).*"
                                        r"unexpected 1 \(sa2\.k_conv\.weight\).*Point_Transformer_partseg"):
        load_weights(PCTPartSeg(50, 16, {"name": "offset"}).double(), str(path))
